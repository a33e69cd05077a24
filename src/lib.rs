//! pgapply: a PostgreSQL-to-PostgreSQL logical replication apply worker.
//!
//! Data path: [`source`] (walsender connection) -> [`protocol`] (pgoutput decoder) ->
//! [`relation`] (relation cache, column mapping) -> [`apply`] (statements, transactions, progress)
//! -> flushed position back to the source. See docs/design.md.

/// `println!` for a command's output that goes on quietly when stdout is closed (`pgapply
/// status | head -1`), where `println!` would panic on the broken pipe.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!` that goes on quietly when stderr cannot be written (closed, or a full disk),
/// where `eprintln!` would panic and the exit code would be a panic's.
#[macro_export]
macro_rules! err_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod apply;
pub mod cancel;
pub mod check;
pub mod cli;
pub mod cluster;
pub mod compare;
pub mod config;
pub mod conninfo;
pub mod copy;
pub mod cutover;
pub mod demo;
pub mod error;
pub mod failpoint;
pub mod metrics;
pub mod migrations;
pub mod protocol;
pub mod relation;
pub mod replicate;
pub mod retry;
pub mod schema;
pub mod skip;
pub mod source;
pub mod source_speed;
pub mod sql;
pub mod status;
pub mod tls;
pub mod verify;
