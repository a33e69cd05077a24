//! The wire formats pgapply reads from a walsender, as pure functions from bytes to typed values.
//!
//! Two layers, both sans-IO:
//! - [`walsender`]: the CopyData payloads of a replication session: XLogData ('w') and primary
//!   keepalive ('k') from the server, and the standby status update ('r') we send back.
//! - [`pgoutput`]: the logical replication messages inside XLogData, protocol versions 1 to 4
//!   (PostgreSQL 10 to 18), including the tuple data they carry ([`tuple`]).
//!
//! Nothing here touches a socket, so everything is tested with byte fixtures: hand-made ones for the
//! error paths and ones captured from real servers (`tests/fixtures/pgoutput/`). Malformed input is a
//! [`DecodeError`] naming the message, the field and the byte offset; decoding never panics and never
//! allocates more than the input can account for.

mod cursor;
mod error;
mod lsn;
pub mod pgoutput;
mod timestamp;
pub mod tuple;
pub mod walsender;

pub use error::{DecodeError, DecodeErrorKind};
pub use lsn::{Lsn, ParseLsnError};
pub use pgoutput::{LogicalMessage, MessageDecoder};
pub use timestamp::PgTimestamp;
pub use tuple::{Tuple, Value};
pub use walsender::{ReplicationFrame, StandbyStatusUpdate};
