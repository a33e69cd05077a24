//! The command line. Flag names are part of pgapply's interface: other tools and docs call them.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "pgapply",
    version,
    about = "PostgreSQL-to-PostgreSQL logical replication apply worker"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Log level or filter (as RUST_LOG): error, warn, info, debug, trace.
    #[arg(long, global = true, env = "PGAPPLY_LOG_LEVEL")]
    pub log_level: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream a publication from the source into the target.
    Run(RunArgs),
    /// Start two throwaway local clusters, mirror a live workload between them, and show that both
    /// sides match.
    Demo(DemoArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Streaming {
    Off,
    On,
    Parallel,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Source connection: libpq key=value string or postgres:// URL.
    #[arg(long, env = "PGAPPLY_SOURCE")]
    pub source: String,
    /// Target connection: libpq key=value string or postgres:// URL.
    #[arg(long, env = "PGAPPLY_TARGET")]
    pub target: String,
    /// Publication name(s) on the source, comma separated, taken as given (case and spaces kept).
    #[arg(
        long,
        env = "PGAPPLY_PUBLICATION",
        value_delimiter = ',',
        required = true
    )]
    pub publication: Vec<String>,
    /// Logical replication slot on the source.
    #[arg(long, env = "PGAPPLY_SLOT")]
    pub slot: String,
    /// Create the slot (pgoutput) if it does not exist.
    #[arg(long)]
    pub create_slot: bool,
    /// Copy the published tables' existing rows first (creates the slot with a snapshot), then
    /// stream from that point.
    #[arg(long)]
    pub copy_data: bool,
    /// Tables (or parts of large tables) copied at once during --copy-data.
    #[arg(long, default_value = "4")]
    pub copy_jobs: usize,
    /// With --copy-data: tables larger than this many 8 kB pages are copied in parallel page
    /// ranges (PostgreSQL 14+ sources).
    #[arg(long, default_value = "16384")]
    pub copy_split_pages: i64,
    /// With --copy-data: empty target tables that already hold rows instead of refusing.
    #[arg(long)]
    pub truncate_target: bool,
    /// Exit 0 once every transaction committed before this LSN is applied.
    #[arg(long, value_name = "LSN")]
    pub endpos: Option<String>,
    /// Stream large in-progress transactions (not available yet: off only).
    #[arg(long, value_enum, default_value = "off")]
    pub streaming: Streaming,
    /// Replicate prepared transactions (not available yet).
    #[arg(long)]
    pub two_phase: bool,
    /// Configuration file (not available yet).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Shortest wait before reconnecting after a transient error (connection lost, server restart).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub retry_min: Duration,
    /// Longest wait between reconnect attempts (the wait doubles up to this).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub retry_max: Duration,
    /// Give up after this many consecutive failed attempts (0: never give up).
    #[arg(long, default_value = "0")]
    pub max_retries: u32,
    /// How often to report progress to the source when nothing else prompts it.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub status_interval: Duration,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How long the live workload runs.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Directory with initdb, pg_ctl and postgres (default: PGAPPLY_PG_BIN, or the newest
    /// /usr/lib/postgresql/*/bin).
    #[arg(long, env = "PGAPPLY_PG_BIN")]
    pub pg_bin: Option<PathBuf>,
}
