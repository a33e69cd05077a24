//! pgapply: a PostgreSQL-to-PostgreSQL logical replication apply worker.
//!
//! Data path: [`source`] (walsender connection) -> [`protocol`] (pgoutput decoder) ->
//! [`relation`] (relation cache, column mapping) -> [`apply`] (statements, transactions, progress)
//! -> flushed position back to the source. See docs/design.md.

pub mod protocol;
pub mod error;
pub mod source;
pub mod sql;
pub mod conninfo;
pub mod relation;
pub mod migrations;
pub mod apply;
pub mod replicate;
pub mod cli;
pub mod cluster;
pub mod compare;
pub mod demo;
