//! The decoder against pgoutput bytes captured from real servers (tests/fixtures/pgoutput/, made by
//! scripts/capture-fixtures.sh): every message of protocol versions 1 to 4 decodes, and the
//! decoded fields say what the workload did.

use std::collections::BTreeMap;

use bytes::Bytes;
use pgapply::protocol::pgoutput::{LogicalMessage, OldRow, ReplicaIdentity};
use pgapply::protocol::{MessageDecoder, Value};

struct Fixture {
    messages: Vec<LogicalMessage>,
}

fn hex(line: &str) -> Vec<u8> {
    (0..line.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&line[i..i + 2], 16).expect("fixture hex"))
        .collect()
}

/// Raw messages of a fixture file and whether its session used streaming = parallel.
pub fn raw_messages(name: &str) -> (Vec<Vec<u8>>, bool) {
    let path = format!(
        "{}/tests/fixtures/pgoutput/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("fixture file");
    let parallel = text
        .lines()
        .any(|l| l.starts_with('#') && l.contains("streaming=parallel"));
    let raw = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(hex)
        .collect();
    (raw, parallel)
}

fn load(name: &str) -> Fixture {
    let (raw, parallel) = raw_messages(name);
    let mut decoder = MessageDecoder::new(parallel);
    let messages = raw
        .into_iter()
        .enumerate()
        .map(|(i, bytes)| {
            decoder
                .decode(Bytes::from(bytes))
                .unwrap_or_else(|e| panic!("{name}: message {}: {e}", i + 1))
        })
        .collect();
    Fixture { messages }
}

impl Fixture {
    fn counts(&self) -> BTreeMap<&'static str, usize> {
        let mut counts = BTreeMap::new();
        for m in &self.messages {
            *counts.entry(m.name()).or_default() += 1;
        }
        counts
    }

    fn has(&self, pred: impl Fn(&LogicalMessage) -> bool) -> bool {
        self.messages.iter().any(pred)
    }
}

fn all_values(m: &LogicalMessage) -> Vec<Value> {
    match m {
        LogicalMessage::Insert(i) => i.new.values().collect(),
        LogicalMessage::Update(u) => {
            let mut v: Vec<Value> = u.new.values().collect();
            if let Some(old) = &u.old {
                v.extend(old.tuple().values());
            }
            v
        }
        LogicalMessage::Delete(d) => d.old.tuple().values().collect(),
        _ => Vec::new(),
    }
}

#[test]
fn v1_every_message() {
    let f = load("v1.txt");
    let counts = f.counts();
    for name in [
        "Begin", "Commit", "Origin", "Relation", "Type", "Insert", "Update", "Delete", "Truncate",
        "Message",
    ] {
        assert!(counts.contains_key(name), "v1 lacks {name}: {counts:?}");
    }
    assert_eq!(counts["Begin"], counts["Commit"]);
    for identity in [
        ReplicaIdentity::Default,
        ReplicaIdentity::Full,
        ReplicaIdentity::Index,
    ] {
        assert!(
            f.has(|m| matches!(m, LogicalMessage::Relation(r) if r.replica_identity == identity)),
            "no relation with {identity:?}"
        );
    }
    assert!(
        f.has(|m| matches!(m, LogicalMessage::Relation(r) if r.columns.iter().any(|c| c.is_key())))
    );
    assert!(f.has(|m| matches!(m, LogicalMessage::Update(u) if u.old.is_none())));
    assert!(
        f.has(|m| matches!(m, LogicalMessage::Update(u) if matches!(u.old, Some(OldRow::Key(_)))))
    );
    assert!(
        f.has(|m| matches!(m, LogicalMessage::Update(u) if matches!(u.old, Some(OldRow::Full(_)))))
    );
    assert!(f.has(|m| matches!(m, LogicalMessage::Delete(d) if matches!(d.old, OldRow::Key(_)))));
    assert!(f.has(|m| matches!(m, LogicalMessage::Delete(d) if matches!(d.old, OldRow::Full(_)))));
    assert!(
        f.has(|m| all_values(m).contains(&Value::UnchangedToast)),
        "no unchanged TOAST value"
    );
    assert!(
        f.has(|m| all_values(m).contains(&Value::Null)),
        "no NULL value"
    );
    assert!(
        f.has(|m| all_values(m)
            .iter()
            .any(|v| matches!(v, Value::Text(t) if t.len() > 50_000))),
        "no large TOASTed value"
    );
    assert!(f.has(|m| matches!(m, LogicalMessage::Truncate(t) if t.relations.len() == 2)));
    assert!(f.has(|m| matches!(m, LogicalMessage::Truncate(t) if t.cascade())));
    assert!(f.has(|m| matches!(m, LogicalMessage::Truncate(t) if t.restart_identity())));
    assert!(f.has(|m| matches!(m, LogicalMessage::Message(x) if x.transactional() && x.prefix == "pgapply-test")));
    assert!(f.has(|m| matches!(m, LogicalMessage::Message(x) if !x.transactional() && &x.content[..] == b"hello")));
    assert!(f.has(|m| matches!(m, LogicalMessage::Origin(o) if o.name == "fixture_origin")));
    assert!(f.has(|m| matches!(m, LogicalMessage::Type(t) if !t.name.is_empty())));
    // Outside streaming no message carries an Xid field.
    assert!(!f.has(|m| matches!(m, LogicalMessage::Insert(i) if i.xid.is_some())));
}

#[test]
fn v1_binary_values() {
    let f = load("v1-binary.txt");
    assert!(f.has(|m| all_values(m).iter().any(|v| matches!(v, Value::Binary(_)))));
    // int4 1 in binary is four bytes.
    assert!(f.has(|m| all_values(m)
        .iter()
        .any(|v| matches!(v, Value::Binary(b) if b.len() == 4))));
}

#[test]
fn v2_streamed_transactions() {
    let f = load("v2-streaming.txt");
    let counts = f.counts();
    for name in [
        "Stream Start",
        "Stream Stop",
        "Stream Commit",
        "Stream Abort",
        "Begin",
        "Commit",
    ] {
        assert!(counts.contains_key(name), "v2 lacks {name}: {counts:?}");
    }
    assert_eq!(counts["Stream Start"], counts["Stream Stop"]);
    // Inside blocks changes carry the streamed xid; outside they do not.
    let mut inside = false;
    let mut streamed_xid = 0;
    for m in &f.messages {
        match m {
            LogicalMessage::StreamStart(s) => {
                inside = true;
                streamed_xid = s.xid;
            }
            LogicalMessage::StreamStop => inside = false,
            LogicalMessage::Insert(i) => {
                assert_eq!(i.xid.is_some(), inside);
                if inside {
                    // A subtransaction's changes carry the subxact's xid, which differs from the
                    // top-level one only for inserts inside a savepoint.
                    assert!(i.xid.unwrap() >= streamed_xid);
                }
            }
            LogicalMessage::Relation(r) => assert_eq!(r.xid.is_some(), inside),
            LogicalMessage::Truncate(t) => assert_eq!(t.xid.is_some(), inside),
            _ => {}
        }
    }
    assert!(f.has(|m| matches!(m, LogicalMessage::StreamAbort(a) if a.subxid != a.xid && a.abort_lsn.is_none())));
    assert!(f.has(|m| matches!(m, LogicalMessage::StreamAbort(a) if a.subxid == a.xid)));
    assert!(f.has(|m| matches!(m, LogicalMessage::Truncate(t) if t.xid.is_some())));
    assert!(f.has(|m| matches!(m, LogicalMessage::Message(x) if x.xid.is_some())));
}

#[test]
fn v3_two_phase() {
    let f = load("v3-two-phase.txt");
    let counts = f.counts();
    for name in [
        "Begin Prepare",
        "Prepare",
        "Commit Prepared",
        "Rollback Prepared",
        "Stream Prepare",
    ] {
        assert!(counts.contains_key(name), "v3 lacks {name}: {counts:?}");
    }
    let gids: Vec<&str> = f
        .messages
        .iter()
        .filter_map(|m| match m {
            LogicalMessage::BeginPrepare(b) => Some(b.gid.as_str()),
            _ => None,
        })
        .collect();
    assert!(gids.iter().all(|g| !g.is_empty()));
    assert!(f.has(|m| matches!(m, LogicalMessage::CommitPrepared(c) if c.end_lsn > c.commit_lsn)));
}

#[test]
fn v4_parallel_abort_info() {
    let f = load("v4-parallel.txt");
    assert!(f.has(|m| matches!(m, LogicalMessage::StreamAbort(a) if a.abort_lsn.is_some() && a.abort_time.is_some())));
    assert!(!f.has(|m| matches!(m, LogicalMessage::StreamAbort(a) if a.abort_lsn.is_none())));
    assert!(f.has(|m| all_values(m).iter().any(|v| matches!(v, Value::Binary(_)))));
}
