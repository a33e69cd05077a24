//! Hand-made byte fixtures: one per message and protocol variant, and the error paths.
//! Real-server captures are checked in `tests/decoder_fixtures.rs`.

use super::*;
use crate::protocol::tuple::Value;

/// Builds a message byte by byte, in the manual's field order.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn tag(t: u8) -> Self {
        Msg(vec![t])
    }
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn i16(mut self, v: i16) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn i32(mut self, v: i32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn str(mut self, s: &str) -> Self {
        self.0.extend_from_slice(s.as_bytes());
        self.0.push(0);
        self
    }
    fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    fn text(self, s: &[u8]) -> Self {
        self.u8(b't').i32(s.len() as i32).raw(s)
    }
    fn bytes(self) -> Bytes {
        Bytes::from(self.0)
    }
}

fn outside() -> Context {
    Context::default()
}

fn streamed() -> Context {
    Context {
        in_stream_block: true,
        abort_info: false,
    }
}

fn texts(t: &Tuple) -> Vec<Option<String>> {
    t.values()
        .map(|v| match v {
            Value::Text(b) => Some(String::from_utf8(b.to_vec()).unwrap()),
            Value::Null => None,
            Value::UnchangedToast => Some("<unchanged>".into()),
            Value::Binary(b) => Some(format!("<binary {:?}>", b.as_ref())),
        })
        .collect()
}

#[test]
fn begin_and_commit() {
    let m = Msg::tag(b'B').u64(0x10).u64(20).u32(700).bytes();
    assert_eq!(
        decode(m, outside()).unwrap(),
        LogicalMessage::Begin(Begin {
            final_lsn: Lsn(0x10),
            commit_time: PgTimestamp(20),
            xid: 700
        })
    );
    let m = Msg::tag(b'C').u8(0).u64(0x10).u64(0x48).u64(20).bytes();
    assert_eq!(
        decode(m, outside()).unwrap(),
        LogicalMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(0x10),
            end_lsn: Lsn(0x48),
            commit_time: PgTimestamp(20)
        })
    );
}

#[test]
fn origin() {
    let m = Msg::tag(b'O').u64(99).str("node_a").bytes();
    assert_eq!(
        decode(m, outside()).unwrap(),
        LogicalMessage::Origin(Origin {
            commit_lsn: Lsn(99),
            name: "node_a".into()
        })
    );
}

fn relation_body(m: Msg) -> Msg {
    m.u32(16384)
        .str("public")
        .str("My Table")
        .u8(b'd')
        .i16(2)
        .u8(1)
        .str("id")
        .u32(23)
        .i32(-1)
        .u8(0)
        .str("näme")
        .u32(1043)
        .i32(14)
}

#[test]
fn relation_outside_and_inside_stream() {
    let expected = |xid| {
        LogicalMessage::Relation(Relation {
            xid,
            oid: 16384,
            namespace: "public".into(),
            name: "My Table".into(),
            replica_identity: ReplicaIdentity::Default,
            columns: vec![
                RelationColumn {
                    flags: 1,
                    name: "id".into(),
                    type_oid: 23,
                    type_modifier: -1,
                },
                RelationColumn {
                    flags: 0,
                    name: "näme".into(),
                    type_oid: 1043,
                    type_modifier: 14,
                },
            ],
        })
    };
    let m = relation_body(Msg::tag(b'R')).bytes();
    let decoded = decode(m, outside()).unwrap();
    assert_eq!(decoded, expected(None));
    if let LogicalMessage::Relation(r) = decoded {
        assert!(r.columns[0].is_key() && !r.columns[1].is_key());
    }
    let m = relation_body(Msg::tag(b'R').u32(777)).bytes();
    assert_eq!(decode(m, streamed()).unwrap(), expected(Some(777)));
}

#[test]
fn relation_replica_identities() {
    for (byte, want) in [
        (b'd', ReplicaIdentity::Default),
        (b'n', ReplicaIdentity::Nothing),
        (b'f', ReplicaIdentity::Full),
        (b'i', ReplicaIdentity::Index),
    ] {
        let m = Msg::tag(b'R')
            .u32(1)
            .str("")
            .str("t")
            .u8(byte)
            .i16(0)
            .bytes();
        match decode(m, outside()).unwrap() {
            LogicalMessage::Relation(r) => {
                assert_eq!(r.replica_identity, want);
                assert_eq!(r.namespace, "");
            }
            other => panic!("{other:?}"),
        }
    }
    let m = Msg::tag(b'R')
        .u32(1)
        .str("")
        .str("t")
        .u8(b'x')
        .i16(0)
        .bytes();
    let err = decode(m, outside()).unwrap_err();
    assert_eq!(
        (err.message, err.field, err.offset),
        ("Relation", "replica identity", 8)
    );
}

#[test]
fn type_message() {
    let m = Msg::tag(b'Y')
        .u32(5)
        .u32(16400)
        .str("public")
        .str("mood")
        .bytes();
    assert_eq!(
        decode(m, streamed()).unwrap(),
        LogicalMessage::Type(TypeInfo {
            xid: Some(5),
            oid: 16400,
            namespace: "public".into(),
            name: "mood".into()
        })
    );
}

#[test]
fn insert() {
    let m = Msg::tag(b'I')
        .u32(16384)
        .u8(b'N')
        .i16(3)
        .text(b"1")
        .u8(b'n')
        .text(b"")
        .bytes();
    match decode(m, outside()).unwrap() {
        LogicalMessage::Insert(i) => {
            assert_eq!((i.xid, i.relation), (None, 16384));
            assert_eq!(texts(&i.new), vec![Some("1".into()), None, Some("".into())]);
        }
        other => panic!("{other:?}"),
    }
    let m = Msg::tag(b'I')
        .u32(9)
        .u32(16384)
        .u8(b'N')
        .i16(1)
        .text(b"x")
        .bytes();
    match decode(m, streamed()).unwrap() {
        LogicalMessage::Insert(i) => assert_eq!(i.xid, Some(9)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn update_variants() {
    // No old tuple.
    let m = Msg::tag(b'U')
        .u32(1)
        .u8(b'N')
        .i16(2)
        .text(b"1")
        .u8(b'u')
        .bytes();
    match decode(m, outside()).unwrap() {
        LogicalMessage::Update(u) => {
            assert!(u.old.is_none());
            assert_eq!(
                texts(&u.new),
                vec![Some("1".into()), Some("<unchanged>".into())]
            );
        }
        other => panic!("{other:?}"),
    }
    // 'K' then 'N'.
    let m = Msg::tag(b'U')
        .u32(1)
        .u8(b'K')
        .i16(2)
        .text(b"1")
        .u8(b'n')
        .u8(b'N')
        .i16(2)
        .text(b"2")
        .text(b"b")
        .bytes();
    match decode(m, outside()).unwrap() {
        LogicalMessage::Update(u) => {
            let Some(OldRow::Key(k)) = &u.old else {
                panic!("{u:?}")
            };
            assert_eq!(texts(k), vec![Some("1".into()), None]);
            assert_eq!(texts(&u.new), vec![Some("2".into()), Some("b".into())]);
        }
        other => panic!("{other:?}"),
    }
    // 'O' then 'N', streamed.
    let m = Msg::tag(b'U')
        .u32(3)
        .u32(1)
        .u8(b'O')
        .i16(1)
        .text(b"a")
        .u8(b'N')
        .i16(1)
        .text(b"b")
        .bytes();
    match decode(m, streamed()).unwrap() {
        LogicalMessage::Update(u) => {
            assert_eq!(u.xid, Some(3));
            assert!(matches!(u.old, Some(OldRow::Full(_))));
        }
        other => panic!("{other:?}"),
    }
    // Old tuple not followed by 'N'.
    let m = Msg::tag(b'U')
        .u32(1)
        .u8(b'K')
        .i16(1)
        .text(b"a")
        .u8(b'K')
        .i16(0)
        .bytes();
    let err = decode(m, outside()).unwrap_err();
    assert_eq!(err.field, "new tuple marker");
    assert_eq!(err.kind, DecodeErrorKind::UnknownTag(b'K'));
    assert_eq!(err.offset, 14);
}

#[test]
fn delete_key_and_full() {
    for (marker, full) in [(b'K', false), (b'O', true)] {
        let m = Msg::tag(b'D').u32(1).u8(marker).i16(1).text(b"7").bytes();
        match decode(m, outside()).unwrap() {
            LogicalMessage::Delete(d) => {
                assert_eq!(matches!(d.old, OldRow::Full(_)), full);
                assert_eq!(texts(d.old.tuple()), vec![Some("7".into())]);
            }
            other => panic!("{other:?}"),
        }
    }
    let m = Msg::tag(b'D').u32(1).u8(b'N').i16(0).bytes();
    let err = decode(m, outside()).unwrap_err();
    assert_eq!((err.field, err.offset), ("tuple marker", 5));
}

#[test]
fn truncate_options() {
    let m = Msg::tag(b'T').i32(2).u8(3).u32(10).u32(11).bytes();
    match decode(m, outside()).unwrap() {
        LogicalMessage::Truncate(t) => {
            assert_eq!(t.relations, vec![10, 11]);
            assert!(t.cascade() && t.restart_identity());
        }
        other => panic!("{other:?}"),
    }
    let m = Msg::tag(b'T').u32(4).i32(1).u8(0).u32(10).bytes();
    match decode(m, streamed()).unwrap() {
        LogicalMessage::Truncate(t) => {
            assert_eq!(t.xid, Some(4));
            assert!(!t.cascade() && !t.restart_identity());
        }
        other => panic!("{other:?}"),
    }
    // A count larger than the message: refused before allocating.
    let m = Msg::tag(b'T').i32(i32::MAX).u8(0).u32(10).bytes();
    let err = decode(m, outside()).unwrap_err();
    assert_eq!(err.kind, DecodeErrorKind::InvalidLength(i32::MAX.into()));
    assert_eq!((err.field, err.offset), ("relation count", 1));
}

#[test]
fn logical_decoding_message() {
    let m = Msg::tag(b'M')
        .u8(1)
        .u64(5)
        .str("app")
        .i32(3)
        .raw(b"a\0b")
        .bytes();
    assert_eq!(
        decode(m, outside()).unwrap(),
        LogicalMessage::Message(DecodingMessage {
            xid: None,
            flags: 1,
            lsn: Lsn(5),
            prefix: "app".into(),
            content: Bytes::from_static(b"a\0b"),
        })
    );
    let m = Msg::tag(b'M').u32(8).u8(0).u64(5).str("app").i32(0).bytes();
    match decode(m, streamed()).unwrap() {
        LogicalMessage::Message(msg) => {
            assert_eq!(msg.xid, Some(8));
            assert!(!msg.transactional());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn stream_messages() {
    let m = Msg::tag(b'S').u32(42).u8(1).bytes();
    assert_eq!(
        decode(m, outside()).unwrap(),
        LogicalMessage::StreamStart(StreamStart {
            xid: 42,
            first_segment: true
        })
    );
    assert_eq!(
        decode(Msg::tag(b'E').bytes(), streamed()).unwrap(),
        LogicalMessage::StreamStop
    );
    let m = Msg::tag(b'c').u32(42).u8(0).u64(1).u64(2).u64(3).bytes();
    assert_eq!(
        decode(m, outside()).unwrap(),
        LogicalMessage::StreamCommit(StreamCommit {
            xid: 42,
            flags: 0,
            commit_lsn: Lsn(1),
            end_lsn: Lsn(2),
            commit_time: PgTimestamp(3)
        })
    );
}

#[test]
fn stream_abort_with_and_without_parallel_fields() {
    let short = Msg::tag(b'A').u32(42).u32(43).bytes();
    assert_eq!(
        decode(short.clone(), outside()).unwrap(),
        LogicalMessage::StreamAbort(StreamAbort {
            xid: 42,
            subxid: 43,
            abort_lsn: None,
            abort_time: None
        })
    );
    let parallel = Context {
        in_stream_block: false,
        abort_info: true,
    };
    let long = Msg::tag(b'A').u32(42).u32(42).u64(0x99).u64(1234).bytes();
    assert_eq!(
        decode(long.clone(), parallel).unwrap(),
        LogicalMessage::StreamAbort(StreamAbort {
            xid: 42,
            subxid: 42,
            abort_lsn: Some(Lsn(0x99)),
            abort_time: Some(PgTimestamp(1234))
        })
    );
    // The wrong expectation is caught, not misread.
    assert_eq!(
        decode(long, outside()).unwrap_err().kind,
        DecodeErrorKind::TrailingBytes(16)
    );
    assert!(matches!(
        decode(short, parallel).unwrap_err().kind,
        DecodeErrorKind::Truncated { .. }
    ));
}

#[test]
fn two_phase_messages() {
    let m = Msg::tag(b'b')
        .u64(1)
        .u64(2)
        .u64(3)
        .u32(4)
        .str("gid-1")
        .bytes();
    assert_eq!(
        decode(m, outside()).unwrap(),
        LogicalMessage::BeginPrepare(BeginPrepare {
            prepare_lsn: Lsn(1),
            end_lsn: Lsn(2),
            prepare_time: PgTimestamp(3),
            xid: 4,
            gid: "gid-1".into()
        })
    );
    let prepare = Prepare {
        flags: 0,
        prepare_lsn: Lsn(1),
        end_lsn: Lsn(2),
        prepare_time: PgTimestamp(3),
        xid: 4,
        gid: "gid-1".into(),
    };
    let m = Msg::tag(b'P')
        .u8(0)
        .u64(1)
        .u64(2)
        .u64(3)
        .u32(4)
        .str("gid-1");
    assert_eq!(
        decode(m.bytes(), outside()).unwrap(),
        LogicalMessage::Prepare(prepare.clone())
    );
    let m = Msg::tag(b'p')
        .u8(0)
        .u64(1)
        .u64(2)
        .u64(3)
        .u32(4)
        .str("gid-1");
    assert_eq!(
        decode(m.bytes(), outside()).unwrap(),
        LogicalMessage::StreamPrepare(prepare)
    );
    let m = Msg::tag(b'K')
        .u8(0)
        .u64(5)
        .u64(6)
        .u64(7)
        .u32(4)
        .str("gid-1");
    assert_eq!(
        decode(m.bytes(), outside()).unwrap(),
        LogicalMessage::CommitPrepared(CommitPrepared {
            flags: 0,
            commit_lsn: Lsn(5),
            end_lsn: Lsn(6),
            commit_time: PgTimestamp(7),
            xid: 4,
            gid: "gid-1".into()
        })
    );
    let m = Msg::tag(b'r')
        .u8(0)
        .u64(2)
        .u64(8)
        .u64(3)
        .u64(9)
        .u32(4)
        .str("gid-1");
    assert_eq!(
        decode(m.bytes(), outside()).unwrap(),
        LogicalMessage::RollbackPrepared(RollbackPrepared {
            flags: 0,
            prepare_end_lsn: Lsn(2),
            rollback_end_lsn: Lsn(8),
            prepare_time: PgTimestamp(3),
            rollback_time: PgTimestamp(9),
            xid: 4,
            gid: "gid-1".into()
        })
    );
}

#[test]
fn decoder_follows_stream_blocks() {
    let mut d = MessageDecoder::new(false);
    let insert = |xid: Option<u32>| {
        let m = Msg::tag(b'I');
        let m = match xid {
            Some(x) => m.u32(x),
            None => m,
        };
        m.u32(1).u8(b'N').i16(1).text(b"v").bytes()
    };
    assert!(
        matches!(d.decode(insert(None)).unwrap(), LogicalMessage::Insert(i) if i.xid.is_none())
    );
    d.decode(Msg::tag(b'S').u32(50).u8(1).bytes()).unwrap();
    assert!(d.in_stream_block());
    assert!(
        matches!(d.decode(insert(Some(50))).unwrap(), LogicalMessage::Insert(i) if i.xid == Some(50))
    );
    d.decode(Msg::tag(b'E').bytes()).unwrap();
    assert!(!d.in_stream_block());
    assert!(
        matches!(d.decode(insert(None)).unwrap(), LogicalMessage::Insert(i) if i.xid.is_none())
    );
}

#[test]
fn malformed_messages_name_message_field_and_offset() {
    let cases: Vec<(Bytes, &str, &str, usize)> = vec![
        (Bytes::new(), "pgoutput", "message tag", 0),
        (Msg::tag(b'Z').bytes(), "pgoutput", "message tag", 0),
        (
            Msg::tag(b'B').u64(1).bytes(),
            "Begin",
            "commit timestamp",
            9,
        ),
        (
            Msg::tag(b'C').u8(0).u64(1).u64(2).u64(3).u8(9).bytes(),
            "Commit",
            "end of message",
            26,
        ),
        (
            Msg::tag(b'O').u64(1).raw(b"no-nul").bytes(),
            "Origin",
            "origin name",
            9,
        ),
        (
            Msg::tag(b'O').u64(1).raw(b"\xff\xfe\0").bytes(),
            "Origin",
            "origin name",
            9,
        ),
        (
            Msg::tag(b'R')
                .u32(1)
                .str("s")
                .str("t")
                .u8(b'd')
                .i16(300)
                .bytes(),
            "Relation",
            "column count",
            10,
        ),
        (
            Msg::tag(b'R')
                .u32(1)
                .str("s")
                .str("t")
                .u8(b'd')
                .i16(-1)
                .bytes(),
            "Relation",
            "column count",
            10,
        ),
        (
            Msg::tag(b'I').u32(1).u8(b'X').bytes(),
            "Insert",
            "new tuple marker",
            5,
        ),
        (
            Msg::tag(b'I')
                .u32(1)
                .u8(b'N')
                .i16(1)
                .text(b"a")
                .u8(0)
                .bytes(),
            "Insert",
            "end of message",
            14,
        ),
        (
            Msg::tag(b'M').u8(1).u64(1).str("p").i32(10).bytes(),
            "Message",
            "content",
            12,
        ),
        (
            Msg::tag(b'S').u32(1).bytes(),
            "Stream Start",
            "first segment flag",
            5,
        ),
        (
            Msg::tag(b'E').u8(0).bytes(),
            "Stream Stop",
            "end of message",
            1,
        ),
        (
            Msg::tag(b'K').u8(0).u64(1).u64(2).u64(3).u32(4).bytes(),
            "Commit Prepared",
            "gid",
            30,
        ),
    ];
    for (bytes, message, field, offset) in cases {
        let err = decode(bytes.clone(), outside()).unwrap_err();
        assert_eq!(
            (err.message, err.field, err.offset),
            (message, field, offset),
            "{bytes:?}: {err}"
        );
        let text = err.to_string();
        assert!(text.contains(message) && text.contains(field), "{text}");
    }
    let err = decode(Msg::tag(b'O').u64(1).raw(b"\xff\0").bytes(), outside()).unwrap_err();
    assert_eq!(err.kind, DecodeErrorKind::InvalidUtf8);
    assert_eq!(
        decode(Msg::tag(b'Z').bytes(), outside())
            .unwrap_err()
            .to_string(),
        "malformed pgoutput message: message tag at byte offset 0: unknown tag 'Z' (0x5a)"
    );
}
