//! The target side: turns decoded changes into statements and runs them in target transactions.
//!
//! - [`statement`]: SQL per statement shape, values bound as parameters in pgoutput's text form.
//! - [`applier`]: the apply loop. Statements are pipelined: a transaction's statements (and
//!   BEGIN/COMMIT) go to the server together and their results are checked together, so there is no
//!   round trip per statement. Consecutive small source transactions that are already waiting are
//!   grouped into one target transaction (each stays atomic, order is kept, and the recorded
//!   position is the last included commit).
//! - [`batch`]: UPDATEs of independent tables collapsed per row and sent together.
//! - [`parallel`]: `--apply-workers N`: transactions spread over N connections, committed in
//!   source order.
//! - [`progress`]: the applied position, written atomically with each target commit.
//! - [`sessions`]: the apply sessions, for saying when one waits for a target user's lock.
//! - [`conflict`]: conflict types and policies; [`unique`]: the target rows a unique violation is
//!   about.

pub mod applier;
pub mod batch;
pub mod parallel;
pub mod progress;
pub mod sessions;
pub mod statement;

pub use applier::{Applier, ApplierOptions, ApplySettings, LIVE_WITHIN, SOURCE_SENDS_LIVE};
pub use progress::{ProgressMode, ProgressStore};
pub mod conflict;
pub mod spool;
pub mod triggers;
pub mod unique;
