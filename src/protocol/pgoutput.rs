//! pgoutput's logical replication messages, protocol versions 1 to 4.
//!
//! The manual's "Logical Replication Message Formats" is the reference. Two things are not visible
//! in a single message and so are explicit here:
//! - Relation, Type, Insert, Update, Delete, Truncate and Message carry the transaction's Xid first
//!   when, and only when, they are sent inside a Stream Start .. Stream Stop block (v2+). Use
//!   [`MessageDecoder`], which follows Stream Start/Stop, or pass [`Context`] to [`decode`] yourself.
//! - Stream Abort carries an abort LSN and timestamp only with protocol 4 and `streaming = parallel`.
//!   [`Context::abort_info`] says whether to expect them.
//!
//! 'K' and 'O' are top-level tags (Commit Prepared, Origin) and also tuple markers inside Update and
//! Delete; the position decides, so tuple markers are only looked for inside those messages.

use bytes::Bytes;

use super::cursor::Cursor;
use super::error::{DecodeError, DecodeErrorKind};
use super::lsn::Lsn;
use super::timestamp::PgTimestamp;
use super::tuple::Tuple;

/// A PostgreSQL transaction id.
pub type Xid = u32;
/// A PostgreSQL object id.
pub type Oid = u32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage {
    Begin(Begin),
    Commit(Commit),
    Origin(Origin),
    Relation(Relation),
    Type(TypeInfo),
    Insert(Insert),
    Update(Update),
    Delete(Delete),
    Truncate(Truncate),
    Message(DecodingMessage),
    StreamStart(StreamStart),
    StreamStop,
    StreamCommit(StreamCommit),
    StreamAbort(StreamAbort),
    BeginPrepare(BeginPrepare),
    Prepare(Prepare),
    CommitPrepared(CommitPrepared),
    RollbackPrepared(RollbackPrepared),
    StreamPrepare(Prepare),
}

impl LogicalMessage {
    /// The message's name as the manual spells it, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            LogicalMessage::Begin(_) => "Begin",
            LogicalMessage::Commit(_) => "Commit",
            LogicalMessage::Origin(_) => "Origin",
            LogicalMessage::Relation(_) => "Relation",
            LogicalMessage::Type(_) => "Type",
            LogicalMessage::Insert(_) => "Insert",
            LogicalMessage::Update(_) => "Update",
            LogicalMessage::Delete(_) => "Delete",
            LogicalMessage::Truncate(_) => "Truncate",
            LogicalMessage::Message(_) => "Message",
            LogicalMessage::StreamStart(_) => "Stream Start",
            LogicalMessage::StreamStop => "Stream Stop",
            LogicalMessage::StreamCommit(_) => "Stream Commit",
            LogicalMessage::StreamAbort(_) => "Stream Abort",
            LogicalMessage::BeginPrepare(_) => "Begin Prepare",
            LogicalMessage::Prepare(_) => "Prepare",
            LogicalMessage::CommitPrepared(_) => "Commit Prepared",
            LogicalMessage::RollbackPrepared(_) => "Rollback Prepared",
            LogicalMessage::StreamPrepare(_) => "Stream Prepare",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the transaction's commit record.
    pub final_lsn: Lsn,
    pub commit_time: PgTimestamp,
    pub xid: Xid,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    pub flags: u8,
    pub commit_lsn: Lsn,
    /// End of the commit record: the position to report as flushed once this is applied.
    pub end_lsn: Lsn,
    pub commit_time: PgTimestamp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub commit_lsn: Lsn,
    pub name: String,
}

/// REPLICA IDENTITY of the published table (`pg_class.relreplident`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaIdentity {
    /// 'd': the primary key.
    Default,
    /// 'n': nothing; updates and deletes carry no old values.
    Nothing,
    /// 'f': every column; updates and deletes carry the whole old row ('O').
    Full,
    /// 'i': the columns of a chosen unique index.
    Index,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Bit 1: part of the replica identity key.
    pub flags: u8,
    pub name: String,
    pub type_oid: Oid,
    pub type_modifier: i32,
}

impl RelationColumn {
    pub fn is_key(&self) -> bool {
        self.flags & 1 != 0
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Present only inside a streamed block.
    pub xid: Option<Xid>,
    pub oid: Oid,
    /// Empty for `pg_catalog`, as the server sends it.
    pub namespace: String,
    pub name: String,
    pub replica_identity: ReplicaIdentity,
    pub columns: Vec<RelationColumn>,
}

/// The Type message ('Y'): names a non-built-in type used by a following Relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeInfo {
    pub xid: Option<Xid>,
    pub oid: Oid,
    pub namespace: String,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    pub xid: Option<Xid>,
    pub relation: Oid,
    pub new: Tuple,
}

/// The row before an Update or Delete, as the replica identity sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldRow {
    /// 'K': only the key columns have values (the others are null).
    Key(Tuple),
    /// 'O': the whole old row (REPLICA IDENTITY FULL).
    Full(Tuple),
}

impl OldRow {
    pub fn tuple(&self) -> &Tuple {
        match self {
            OldRow::Key(t) | OldRow::Full(t) => t,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub xid: Option<Xid>,
    pub relation: Oid,
    /// Absent when the key did not change and the identity is not FULL.
    pub old: Option<OldRow>,
    pub new: Tuple,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    pub xid: Option<Xid>,
    pub relation: Oid,
    pub old: OldRow,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    pub xid: Option<Xid>,
    /// Bit 1: CASCADE; bit 2: RESTART IDENTITY.
    pub options: u8,
    pub relations: Vec<Oid>,
}

impl Truncate {
    pub fn cascade(&self) -> bool {
        self.options & 1 != 0
    }
    pub fn restart_identity(&self) -> bool {
        self.options & 2 != 0
    }
}

/// A logical decoding message (`pg_logical_emit_message`), sent with `messages = true`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodingMessage {
    pub xid: Option<Xid>,
    /// Bit 1: transactional.
    pub flags: u8,
    pub lsn: Lsn,
    pub prefix: String,
    pub content: Bytes,
}

impl DecodingMessage {
    pub fn transactional(&self) -> bool {
        self.flags & 1 != 0
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStart {
    pub xid: Xid,
    /// True for the first block of this transaction.
    pub first_segment: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamCommit {
    pub xid: Xid,
    pub flags: u8,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_time: PgTimestamp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamAbort {
    pub xid: Xid,
    /// Equal to `xid` when the whole transaction aborted; otherwise the aborted subtransaction.
    pub subxid: Xid,
    /// Protocol 4 with `streaming = parallel` only.
    pub abort_lsn: Option<Lsn>,
    pub abort_time: Option<PgTimestamp>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeginPrepare {
    pub prepare_lsn: Lsn,
    pub end_lsn: Lsn,
    pub prepare_time: PgTimestamp,
    pub xid: Xid,
    pub gid: String,
}

/// Prepare ('P') and Stream Prepare ('p') share their layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepare {
    pub flags: u8,
    pub prepare_lsn: Lsn,
    pub end_lsn: Lsn,
    pub prepare_time: PgTimestamp,
    pub xid: Xid,
    pub gid: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPrepared {
    pub flags: u8,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_time: PgTimestamp,
    pub xid: Xid,
    pub gid: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackPrepared {
    pub flags: u8,
    /// End of the PREPARE TRANSACTION record.
    pub prepare_end_lsn: Lsn,
    /// End of the ROLLBACK PREPARED record.
    pub rollback_end_lsn: Lsn,
    pub prepare_time: PgTimestamp,
    pub rollback_time: PgTimestamp,
    pub xid: Xid,
    pub gid: String,
}

/// What a message's bytes alone do not say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Context {
    /// Between Stream Start and Stream Stop: change messages begin with an Xid.
    pub in_stream_block: bool,
    /// Protocol 4 with `streaming = parallel`: Stream Abort carries abort LSN and timestamp.
    pub abort_info: bool,
}

/// Decodes one message (the payload of one XLogData frame).
pub fn decode(buf: Bytes, context: Context) -> Result<LogicalMessage, DecodeError> {
    let mut c = Cursor::new(buf, "pgoutput");
    let tag = match c.peek_u8() {
        Some(tag) => tag,
        None => return Err(c.error("message tag", DecodeErrorKind::Empty)),
    };
    c.u8("message tag")?;
    let streamed_xid = |c: &mut Cursor| -> Result<Option<Xid>, DecodeError> {
        if context.in_stream_block {
            Ok(Some(c.u32("xid")?))
        } else {
            Ok(None)
        }
    };
    let message = match tag {
        b'B' => {
            c.rename("Begin");
            LogicalMessage::Begin(Begin {
                final_lsn: lsn(&mut c, "final LSN")?,
                commit_time: timestamp(&mut c, "commit timestamp")?,
                xid: c.u32("xid")?,
            })
        }
        b'C' => {
            c.rename("Commit");
            LogicalMessage::Commit(Commit {
                flags: c.u8("flags")?,
                commit_lsn: lsn(&mut c, "commit LSN")?,
                end_lsn: lsn(&mut c, "end LSN")?,
                commit_time: timestamp(&mut c, "commit timestamp")?,
            })
        }
        b'O' => {
            c.rename("Origin");
            LogicalMessage::Origin(Origin {
                commit_lsn: lsn(&mut c, "origin commit LSN")?,
                name: c.cstr("origin name")?,
            })
        }
        b'R' => {
            c.rename("Relation");
            let xid = streamed_xid(&mut c)?;
            let oid = c.u32("relation OID")?;
            let namespace = c.cstr("namespace")?;
            let name = c.cstr("relation name")?;
            let replica_identity = match c.u8("replica identity")? {
                b'd' => ReplicaIdentity::Default,
                b'n' => ReplicaIdentity::Nothing,
                b'f' => ReplicaIdentity::Full,
                b'i' => ReplicaIdentity::Index,
                other => {
                    let mut e = c.error("replica identity", DecodeErrorKind::UnknownTag(other));
                    e.offset -= 1;
                    return Err(e);
                }
            };
            let count_at = c.position();
            let count = c.i16("column count")?;
            // Each column takes at least 10 bytes (flags, NUL, two Int32s): bound the allocation
            // by what the message can hold, not by the count it claims.
            let count = usize::try_from(count)
                .ok()
                .filter(|&n| n <= c.remaining() / 10)
                .ok_or_else(|| {
                    let mut e =
                        c.error("column count", DecodeErrorKind::InvalidLength(count.into()));
                    e.offset = count_at;
                    e
                })?;
            let mut columns = Vec::with_capacity(count);
            for _ in 0..count {
                columns.push(RelationColumn {
                    flags: c.u8("column flags")?,
                    name: c.cstr("column name")?,
                    type_oid: c.u32("column type OID")?,
                    type_modifier: c.i32("column type modifier")?,
                });
            }
            LogicalMessage::Relation(Relation {
                xid,
                oid,
                namespace,
                name,
                replica_identity,
                columns,
            })
        }
        b'Y' => {
            c.rename("Type");
            LogicalMessage::Type(TypeInfo {
                xid: streamed_xid(&mut c)?,
                oid: c.u32("type OID")?,
                namespace: c.cstr("namespace")?,
                name: c.cstr("type name")?,
            })
        }
        b'I' => {
            c.rename("Insert");
            let xid = streamed_xid(&mut c)?;
            let relation = c.u32("relation OID")?;
            expect_marker(&mut c, b'N', "new tuple marker")?;
            LogicalMessage::Insert(Insert {
                xid,
                relation,
                new: Tuple::decode(&mut c)?,
            })
        }
        b'U' => {
            c.rename("Update");
            let xid = streamed_xid(&mut c)?;
            let relation = c.u32("relation OID")?;
            let marker = c.u8("tuple marker")?;
            let old = match marker {
                b'K' => Some(OldRow::Key(Tuple::decode(&mut c)?)),
                b'O' => Some(OldRow::Full(Tuple::decode(&mut c)?)),
                b'N' => None,
                other => {
                    let mut e = c.error("tuple marker", DecodeErrorKind::UnknownTag(other));
                    e.offset -= 1;
                    return Err(e);
                }
            };
            if old.is_some() {
                expect_marker(&mut c, b'N', "new tuple marker")?;
            }
            LogicalMessage::Update(Update {
                xid,
                relation,
                old,
                new: Tuple::decode(&mut c)?,
            })
        }
        b'D' => {
            c.rename("Delete");
            let xid = streamed_xid(&mut c)?;
            let relation = c.u32("relation OID")?;
            let old = match c.u8("tuple marker")? {
                b'K' => OldRow::Key(Tuple::decode(&mut c)?),
                b'O' => OldRow::Full(Tuple::decode(&mut c)?),
                other => {
                    let mut e = c.error("tuple marker", DecodeErrorKind::UnknownTag(other));
                    e.offset -= 1;
                    return Err(e);
                }
            };
            LogicalMessage::Delete(Delete { xid, relation, old })
        }
        b'T' => {
            c.rename("Truncate");
            let xid = streamed_xid(&mut c)?;
            let count_at = c.position();
            let count = c.i32("relation count")?;
            let options = c.u8("options")?;
            let count = usize::try_from(count)
                .ok()
                .filter(|&n| n <= c.remaining() / 4)
                .ok_or_else(|| {
                    let mut e = c.error(
                        "relation count",
                        DecodeErrorKind::InvalidLength(count.into()),
                    );
                    e.offset = count_at;
                    e
                })?;
            let mut relations = Vec::with_capacity(count);
            for _ in 0..count {
                relations.push(c.u32("relation OID")?);
            }
            LogicalMessage::Truncate(Truncate {
                xid,
                options,
                relations,
            })
        }
        b'M' => {
            c.rename("Message");
            LogicalMessage::Message(DecodingMessage {
                xid: streamed_xid(&mut c)?,
                flags: c.u8("flags")?,
                lsn: lsn(&mut c, "message LSN")?,
                prefix: c.cstr("prefix")?,
                content: c.counted_bytes("content")?,
            })
        }
        b'S' => {
            c.rename("Stream Start");
            LogicalMessage::StreamStart(StreamStart {
                xid: c.u32("xid")?,
                first_segment: c.u8("first segment flag")? == 1,
            })
        }
        b'E' => {
            c.rename("Stream Stop");
            LogicalMessage::StreamStop
        }
        b'c' => {
            c.rename("Stream Commit");
            LogicalMessage::StreamCommit(StreamCommit {
                xid: c.u32("xid")?,
                flags: c.u8("flags")?,
                commit_lsn: lsn(&mut c, "commit LSN")?,
                end_lsn: lsn(&mut c, "end LSN")?,
                commit_time: timestamp(&mut c, "commit timestamp")?,
            })
        }
        b'A' => {
            c.rename("Stream Abort");
            let xid = c.u32("xid")?;
            let subxid = c.u32("subtransaction xid")?;
            let (abort_lsn, abort_time) = if context.abort_info {
                (
                    Some(lsn(&mut c, "abort LSN")?),
                    Some(timestamp(&mut c, "abort timestamp")?),
                )
            } else {
                (None, None)
            };
            LogicalMessage::StreamAbort(StreamAbort {
                xid,
                subxid,
                abort_lsn,
                abort_time,
            })
        }
        b'b' => {
            c.rename("Begin Prepare");
            LogicalMessage::BeginPrepare(BeginPrepare {
                prepare_lsn: lsn(&mut c, "prepare LSN")?,
                end_lsn: lsn(&mut c, "end LSN")?,
                prepare_time: timestamp(&mut c, "prepare timestamp")?,
                xid: c.u32("xid")?,
                gid: c.cstr("gid")?,
            })
        }
        b'P' | b'p' => {
            c.rename(if tag == b'P' {
                "Prepare"
            } else {
                "Stream Prepare"
            });
            let prepare = Prepare {
                flags: c.u8("flags")?,
                prepare_lsn: lsn(&mut c, "prepare LSN")?,
                end_lsn: lsn(&mut c, "end LSN")?,
                prepare_time: timestamp(&mut c, "prepare timestamp")?,
                xid: c.u32("xid")?,
                gid: c.cstr("gid")?,
            };
            if tag == b'P' {
                LogicalMessage::Prepare(prepare)
            } else {
                LogicalMessage::StreamPrepare(prepare)
            }
        }
        b'K' => {
            c.rename("Commit Prepared");
            LogicalMessage::CommitPrepared(CommitPrepared {
                flags: c.u8("flags")?,
                commit_lsn: lsn(&mut c, "commit LSN")?,
                end_lsn: lsn(&mut c, "end LSN")?,
                commit_time: timestamp(&mut c, "commit timestamp")?,
                xid: c.u32("xid")?,
                gid: c.cstr("gid")?,
            })
        }
        b'r' => {
            c.rename("Rollback Prepared");
            LogicalMessage::RollbackPrepared(RollbackPrepared {
                flags: c.u8("flags")?,
                prepare_end_lsn: lsn(&mut c, "prepare end LSN")?,
                rollback_end_lsn: lsn(&mut c, "rollback end LSN")?,
                prepare_time: timestamp(&mut c, "prepare timestamp")?,
                rollback_time: timestamp(&mut c, "rollback timestamp")?,
                xid: c.u32("xid")?,
                gid: c.cstr("gid")?,
            })
        }
        other => {
            return Err(DecodeError::new(
                "pgoutput",
                "message tag",
                0,
                DecodeErrorKind::UnknownTag(other),
            ))
        }
    };
    c.finish()?;
    Ok(message)
}

fn lsn(c: &mut Cursor, field: &'static str) -> Result<Lsn, DecodeError> {
    Ok(Lsn(c.u64(field)?))
}

fn timestamp(c: &mut Cursor, field: &'static str) -> Result<PgTimestamp, DecodeError> {
    Ok(PgTimestamp(c.i64(field)?))
}

fn expect_marker(c: &mut Cursor, want: u8, field: &'static str) -> Result<(), DecodeError> {
    let got = c.u8(field)?;
    if got == want {
        Ok(())
    } else {
        let mut e = c.error(field, DecodeErrorKind::UnknownTag(got));
        e.offset -= 1;
        Err(e)
    }
}

/// Decodes a stream of messages in order, following Stream Start / Stream Stop so that the
/// streamed Xid field is read exactly where the server writes it.
#[derive(Debug, Clone, Default)]
pub struct MessageDecoder {
    context: Context,
}

impl MessageDecoder {
    /// `abort_info`: the session uses protocol 4 with `streaming = parallel`.
    pub fn new(abort_info: bool) -> Self {
        MessageDecoder {
            context: Context {
                in_stream_block: false,
                abort_info,
            },
        }
    }

    pub fn in_stream_block(&self) -> bool {
        self.context.in_stream_block
    }

    pub fn decode(&mut self, buf: Bytes) -> Result<LogicalMessage, DecodeError> {
        let message = decode(buf, self.context)?;
        match message {
            LogicalMessage::StreamStart(_) => self.context.in_stream_block = true,
            LogicalMessage::StreamStop => self.context.in_stream_block = false,
            _ => {}
        }
        Ok(message)
    }
}

#[cfg(test)]
#[path = "pgoutput_tests.rs"]
mod tests;
