//! The CopyData payloads of a replication session (the manual's "Streaming Replication Protocol").

use bytes::{BufMut, Bytes, BytesMut};

use super::cursor::Cursor;
use super::error::{DecodeError, DecodeErrorKind};
use super::lsn::Lsn;
use super::timestamp::PgTimestamp;

/// A CopyData payload sent by the walsender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationFrame {
    /// 'w': one pgoutput message.
    XLogData {
        wal_start: Lsn,
        /// The server's current end of WAL.
        wal_end: Lsn,
        send_time: PgTimestamp,
        data: Bytes,
    },
    /// 'k': the server's position, and whether it wants a status update now.
    Keepalive {
        wal_end: Lsn,
        send_time: PgTimestamp,
        reply_requested: bool,
    },
}

impl ReplicationFrame {
    pub fn parse(buf: Bytes) -> Result<ReplicationFrame, DecodeError> {
        let mut c = Cursor::new(buf, "replication frame");
        let tag = match c.peek_u8() {
            Some(tag) => tag,
            None => return Err(c.error("frame tag", DecodeErrorKind::Empty)),
        };
        c.u8("frame tag")?;
        match tag {
            b'w' => {
                c.rename("XLogData");
                let wal_start = Lsn(c.u64("WAL start")?);
                let wal_end = Lsn(c.u64("WAL end")?);
                let send_time = PgTimestamp(c.i64("send time")?);
                Ok(ReplicationFrame::XLogData {
                    wal_start,
                    wal_end,
                    send_time,
                    data: c.rest(),
                })
            }
            b'k' => {
                c.rename("primary keepalive");
                let frame = ReplicationFrame::Keepalive {
                    wal_end: Lsn(c.u64("WAL end")?),
                    send_time: PgTimestamp(c.i64("send time")?),
                    reply_requested: c.u8("reply requested")? != 0,
                };
                c.finish()?;
                Ok(frame)
            }
            other => Err(DecodeError::new(
                "replication frame",
                "frame tag",
                0,
                DecodeErrorKind::UnknownTag(other),
            )),
        }
    }
}

/// 'r': what we tell the server about our progress. `flush` is what lets the slot advance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbyStatusUpdate {
    pub write: Lsn,
    pub flush: Lsn,
    pub apply: Lsn,
    pub client_time: PgTimestamp,
    pub reply_requested: bool,
}

impl StandbyStatusUpdate {
    /// Length of the encoded payload.
    pub const LEN: usize = 34;

    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(Self::LEN);
        out.put_u8(b'r');
        out.put_u64(self.write.0);
        out.put_u64(self.flush.0);
        out.put_u64(self.apply.0);
        out.put_i64(self.client_time.0);
        out.put_u8(u8::from(self.reply_requested));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xlogdata_keeps_payload_as_slice() {
        let mut raw = vec![b'w'];
        raw.extend_from_slice(&0x1_0000_0010u64.to_be_bytes());
        raw.extend_from_slice(&0x1_0000_0020u64.to_be_bytes());
        raw.extend_from_slice(&5i64.to_be_bytes());
        raw.extend_from_slice(b"Bpayload");
        let frame = ReplicationFrame::parse(Bytes::from(raw)).unwrap();
        assert_eq!(
            frame,
            ReplicationFrame::XLogData {
                wal_start: Lsn(0x1_0000_0010),
                wal_end: Lsn(0x1_0000_0020),
                send_time: PgTimestamp(5),
                data: Bytes::from_static(b"Bpayload"),
            }
        );
    }

    #[test]
    fn keepalive() {
        let mut raw = vec![b'k'];
        raw.extend_from_slice(&42u64.to_be_bytes());
        raw.extend_from_slice(&7i64.to_be_bytes());
        raw.push(1);
        assert_eq!(
            ReplicationFrame::parse(Bytes::from(raw.clone())).unwrap(),
            ReplicationFrame::Keepalive {
                wal_end: Lsn(42),
                send_time: PgTimestamp(7),
                reply_requested: true,
            }
        );
        raw.push(0);
        let err = ReplicationFrame::parse(Bytes::from(raw)).unwrap_err();
        assert_eq!(err.kind, DecodeErrorKind::TrailingBytes(1));
        assert_eq!(err.message, "primary keepalive");
    }

    #[test]
    fn malformed_frames() {
        let err = ReplicationFrame::parse(Bytes::new()).unwrap_err();
        assert_eq!(err.kind, DecodeErrorKind::Empty);
        let err = ReplicationFrame::parse(Bytes::from_static(b"z")).unwrap_err();
        assert_eq!(err.kind, DecodeErrorKind::UnknownTag(b'z'));
        let err = ReplicationFrame::parse(Bytes::from_static(b"w\0\0")).unwrap_err();
        assert_eq!(
            (err.message, err.field, err.offset),
            ("XLogData", "WAL start", 1)
        );
        assert!(err
            .to_string()
            .starts_with("malformed XLogData message: WAL start at byte offset 1"));
    }

    #[test]
    fn status_update_layout() {
        let mut out = BytesMut::new();
        StandbyStatusUpdate {
            write: Lsn(1),
            flush: Lsn(2),
            apply: Lsn(3),
            client_time: PgTimestamp(4),
            reply_requested: true,
        }
        .encode(&mut out);
        assert_eq!(out.len(), StandbyStatusUpdate::LEN);
        assert_eq!(out[0], b'r');
        assert_eq!(&out[1..9], &1u64.to_be_bytes());
        assert_eq!(&out[9..17], &2u64.to_be_bytes());
        assert_eq!(&out[17..25], &3u64.to_be_bytes());
        assert_eq!(&out[25..33], &4i64.to_be_bytes());
        assert_eq!(out[33], 1);
    }
}
