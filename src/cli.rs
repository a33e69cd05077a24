//! The command line. Flag names are part of pgapply's interface: other tools and docs call them.

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{BoolishValueParser, TypedValueParser};
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

    /// Log as text lines (default) or JSON objects.
    #[arg(long, global = true, value_enum, env = "PGAPPLY_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream a publication from the source into the target.
    Run(RunArgs),
    /// Check the configuration and both servers before running, and list every problem found.
    Check(CheckArgs),
    /// Show each slot's progress as recorded on the target.
    Status(StatusArgs),
    /// Skip one failing source transaction on purpose (by its commit LSN, printed by the error).
    Skip(SkipArgs),
    /// Forget a slot on the target: its progress, copy state and replication origins (a worker
    /// retired, or a misspelt slot's leftovers); --drop-slot drops the slot on the source too.
    Forget(ForgetArgs),
    /// Compare the published tables on source and target, chunk by chunk.
    Verify(VerifyArgs),
    /// Finish a migration: wait for lag, optionally freeze writes, drain, copy sequences, verify.
    Cutover(CutoverArgs),
    /// Create the published tables' definitions on the target with pg_dump --schema-only.
    Schema(SchemaArgs),
    /// Start two throwaway local clusters, mirror a live workload between them, and show that both
    /// sides match.
    Demo(DemoArgs),
    /// Measure how fast the source sends a slot's backlog when nothing is applied (the ceiling for
    /// any applier); the slot is not moved.
    SourceSpeed(SourceSpeedArgs),
}

/// `pgapply source-speed`.
#[derive(Debug, Args)]
pub struct SourceSpeedArgs {
    /// Source connection (a role with REPLICATION).
    #[arg(long, env = "PGAPPLY_SOURCE", hide_env_values = true)]
    pub source: String,
    /// File holding the source password (instead of PGPASSWORD or ~/.pgpass).
    #[arg(long, env = "PGAPPLY_SOURCE_PASSWORD_FILE")]
    pub source_password_file: Option<PathBuf>,
    /// Publication(s) to read, comma-separated.
    #[arg(
        long,
        env = "PGAPPLY_PUBLICATION",
        value_delimiter = ',',
        required = true
    )]
    pub publication: Vec<String>,
    /// An existing logical slot (pgoutput); read from its confirmed position, not moved.
    #[arg(long, env = "PGAPPLY_SLOT")]
    pub slot: String,
    /// Read up to this LSN (for example pg_current_wal_lsn() on the source after a workload).
    #[arg(long, value_name = "LSN")]
    pub endpos: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Streaming {
    Off,
    On,
    Parallel,
}

/// `pgapply run`. Every setting can also come from the environment (`PGAPPLY_<NAME>`) or from the
/// `--config` file (same names with underscores); a flag wins over the environment, which wins
/// over the file.
#[derive(Debug, Clone, Args, Default)]
pub struct RunArgs {
    #[command(flatten)]
    pub servers: ServersArgs,
    /// Logical replication slot on the source.
    #[arg(long, env = "PGAPPLY_SLOT")]
    pub slot: Option<String>,
    /// Create the slot (pgoutput) if it does not exist.
    #[arg(long, env = "PGAPPLY_CREATE_SLOT", value_parser = parse_switch, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub create_slot: Option<Switch>,
    /// Copy the published tables' existing rows first (creates the slot with a snapshot), then
    /// stream from that point.
    #[arg(long, env = "PGAPPLY_COPY_DATA", value_parser = parse_switch, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub copy_data: Option<Switch>,
    /// Tables (or parts of large tables) copied at once during --copy-data, 1 to 64 [default: 4].
    #[arg(long, env = "PGAPPLY_COPY_JOBS")]
    pub copy_jobs: Option<usize>,
    /// With --copy-data: tables larger than this many 8 kB pages are copied in parallel page
    /// ranges (PostgreSQL 14+ sources) [default: 16384].
    #[arg(long, env = "PGAPPLY_COPY_SPLIT_PAGES")]
    pub copy_split_pages: Option<i64>,
    /// With --copy-data: exit once the copy is done, before streaming. The slot stays at the
    /// copy's consistent point, and the next `run` streams from there (build the indexes with
    /// `pgapply schema --section post-data` in between).
    #[arg(long, env = "PGAPPLY_COPY_ONLY", value_parser = parse_switch, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub copy_only: Option<Switch>,
    /// With --copy-data: empty target tables that already hold rows instead of refusing.
    #[arg(long, env = "PGAPPLY_TRUNCATE_TARGET", value_parser = parse_switch, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub truncate_target: Option<Switch>,
    /// Exit 0 once every transaction committed before this LSN is applied.
    #[arg(long, value_name = "LSN", env = "PGAPPLY_ENDPOS")]
    pub endpos: Option<String>,
    /// Receive large transactions while they run (PostgreSQL 14+): `on` spools them until they
    /// commit; `parallel` (16+; `on` with a 14 or 15 source) applies one at a time as it
    /// arrives, on a second target connection [default: off: sources were seen sending, when
    /// streaming, changes that ROLLBACK TO SAVEPOINT undid as kept (README: Supported versions)].
    #[arg(long, value_enum, env = "PGAPPLY_STREAMING")]
    pub streaming: Option<Streaming>,
    /// Replicate PREPARE TRANSACTION as prepared transactions on the target (PostgreSQL 15+).
    #[arg(long, env = "PGAPPLY_TWO_PHASE", value_parser = parse_switch, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub two_phase: Option<Switch>,
    /// Make the slot a failover slot (PostgreSQL 17+): standbys with `sync_replication_slots`
    /// keep a copy of it, so replication goes on from the new primary after a failover. Sets it
    /// on an existing slot too.
    #[arg(long, env = "PGAPPLY_FAILOVER_SLOT", value_parser = parse_switch, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub failover_slot: Option<Switch>,
    /// Receive values in binary form when every published column has the same built-in type on
    /// both sides and both run the same major version (PostgreSQL 14+); text otherwise.
    #[arg(long, env = "PGAPPLY_BINARY", value_parser = parse_switch, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub binary: Option<Switch>,
    /// Receive logical decoding messages (pg_logical_emit_message) and log them (PostgreSQL 14+).
    #[arg(long, env = "PGAPPLY_MESSAGES", value_parser = parse_switch, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub messages: Option<Switch>,
    /// `none`: only changes made on the source itself, not ones it replicated from elsewhere
    /// (loop prevention, PostgreSQL 16+) [default: any].
    #[arg(long, env = "PGAPPLY_ORIGIN", value_name = "any|none")]
    pub origin: Option<String>,
    /// Directory for spooled streamed transactions: each needs about the size of its changes
    /// there while it is received (beyond 4 MB in memory); removed once applied
    /// [default: $TMPDIR/pgapply-spool-<uid>-<slot>].
    #[arg(long, env = "PGAPPLY_SPOOL_DIR")]
    pub spool_dir: Option<PathBuf>,
    /// Experimental: target connections applying transactions in parallel; transactions
    /// touching the same rows (or tables whose rows can not be told apart by key) stay in order,
    /// commits follow the source's order. Each transaction commits on its own, so workloads with
    /// hot rows go far slower than with one connection (README) [default: 1].
    #[arg(long, env = "PGAPPLY_APPLY_WORKERS")]
    pub apply_workers: Option<usize>,
    /// Shortest wait before reconnecting after a transient error [default: 1s].
    #[arg(long, env = "PGAPPLY_RETRY_MIN", value_parser = crate::config::parse_duration)]
    pub retry_min: Option<Duration>,
    /// Longest wait between reconnect attempts; the wait doubles up to this [default: 60s].
    #[arg(long, env = "PGAPPLY_RETRY_MAX", value_parser = crate::config::parse_duration)]
    pub retry_max: Option<Duration>,
    /// Retries after transient errors before giving up, counted afresh once a run applies
    /// something or lasts a minute; 0 retries forever [default: 0].
    #[arg(long, env = "PGAPPLY_MAX_RETRIES")]
    pub max_retries: Option<u32>,
    /// How often to report progress to the source when nothing else prompts it; below half the
    /// source's wal_sender_timeout, or the source may end the connection [default: 10s].
    #[arg(long, env = "PGAPPLY_STATUS_INTERVAL", value_parser = crate::config::parse_duration)]
    pub status_interval: Option<Duration>,
    /// Largest protocol message accepted from the source, in bytes; a larger one is refused
    /// instead of buffered [default: 1 GiB, PostgreSQL's own limit].
    #[arg(long, env = "PGAPPLY_MAX_MESSAGE_BYTES", value_name = "SIZE", value_parser = crate::config::parse_message_size)]
    pub max_message_bytes: Option<usize>,
    /// Memory for changes received and not applied yet (64MB, 512kB, ...); when it is full,
    /// pgapply reads nothing more from the source until the target has caught up [default: 64MB].
    #[arg(long, env = "PGAPPLY_QUEUE_SIZE", value_name = "SIZE")]
    pub queue_size: Option<String>,
    /// Serve Prometheus metrics (/metrics), liveness (/healthz) and readiness (/readyz) on this address.
    #[arg(long, env = "PGAPPLY_METRICS_ADDR", value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
}

/// Source, target and publications: `run`, `check`, `cutover`, `verify` and `schema`. Each may
/// come from the config file instead.
#[derive(Debug, Clone, Args, Default)]
pub struct ServersArgs {
    /// Configuration file (TOML): the settings of these options, and what only the file sets:
    /// conflict policies ([conflicts], [tables."schema.table".conflicts]) and table renames
    /// ([tables."schema.table"] target = ...); see README.md.
    #[arg(long, env = "PGAPPLY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Source connection: libpq key=value string or postgres:// URL.
    #[arg(long, env = "PGAPPLY_SOURCE", hide_env_values = true)]
    pub source: Option<String>,
    /// Target connection: libpq key=value string or postgres:// URL.
    #[arg(long, env = "PGAPPLY_TARGET", hide_env_values = true)]
    pub target: Option<String>,
    /// File holding the source password (instead of PGPASSWORD or ~/.pgpass).
    #[arg(long, env = "PGAPPLY_SOURCE_PASSWORD_FILE")]
    pub source_password_file: Option<PathBuf>,
    /// File holding the target password.
    #[arg(long, env = "PGAPPLY_TARGET_PASSWORD_FILE")]
    pub target_password_file: Option<PathBuf>,
    /// Publication name(s) on the source, comma separated, taken as given (case and spaces kept).
    #[arg(long, env = "PGAPPLY_PUBLICATION", value_delimiter = ',')]
    pub publication: Vec<String>,
}

/// `pgapply verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub servers: ServersArgs,
    /// Rows per compared chunk.
    #[arg(long, default_value = "10000", value_parser = clap::value_parser!(i64).range(1..))]
    pub chunk_rows: i64,
    /// Tables compared at once.
    #[arg(long, default_value = "4", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub jobs: u32,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `pgapply cutover`.
#[derive(Debug, Args)]
pub struct CutoverArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Lag below which the cutover proceeds: a size (16MB) or a duration (5s).
    #[arg(long, default_value = "1MB")]
    pub max_lag: String,
    /// Give up if the lag or the drain takes longer than this; transient errors are retried
    /// until then (--retry-min, --retry-max and --max-retries are for `run`).
    #[arg(long, default_value = "10m", value_parser = crate::config::parse_positive_duration)]
    pub timeout: Duration,
    /// Make these source roles read-only and end their sessions before draining.
    #[arg(long, value_delimiter = ',', value_name = "ROLE,...")]
    pub freeze_writes: Vec<String>,
    /// Copy every sequence of the source database, not just those published tables use.
    #[arg(long)]
    pub all_sequences: bool,
    /// Prepare replication from the target back to the source (publication and slot on the target).
    #[arg(long)]
    pub reverse: bool,
    /// Leave out step 5's comparison of the tables, which takes most of the time writes are
    /// frozen: for a database verified beforehand (`pgapply verify` while mirroring).
    #[arg(long)]
    pub no_verify: bool,
    /// Cut over again although a cutover of the slot finished: after a rehearsal, when the
    /// applications still write to the source (never once they write to the target).
    #[arg(long)]
    pub again: bool,
}

/// `pgapply schema`.
#[derive(Debug, Args)]
pub struct SchemaArgs {
    #[command(flatten)]
    pub servers: ServersArgs,
    /// pre-data (tables, types, sequences), post-data (indexes, constraints, triggers) or all.
    #[arg(long, default_value = "all")]
    pub section: String,
    /// Memory each index or key build may sort in on the target (its maintenance_work_mem, for
    /// this command only), where the target's own setting is lower; `server` keeps the target's.
    #[arg(long, default_value = "512MB", value_name = "SIZE")]
    pub maintenance_work_mem: String,
}

/// `pgapply skip`.
#[derive(Debug, Args)]
pub struct SkipArgs {
    /// Target (where pgapply keeps its state), --config and password files as for `run`.
    #[command(flatten)]
    pub servers: ServersArgs,
    /// The slot whose worker should skip the transaction.
    #[arg(long, env = "PGAPPLY_SLOT")]
    pub slot: Option<String>,
    /// Commit LSN of the source transaction to skip (as the error printed it), or `none` to
    /// take back a request not carried out yet.
    #[arg(long)]
    pub lsn: String,
    /// Skip the transaction even though no recorded error names it (all of its changes are
    /// lost on the target).
    #[arg(long)]
    pub force: bool,
}

/// `pgapply forget`.
#[derive(Debug, Args)]
pub struct ForgetArgs {
    /// Target (where pgapply keeps its state), --config and password files as for `run`; the
    /// source only with --drop-slot.
    #[command(flatten)]
    pub servers: ServersArgs,
    /// The slot whose state to forget.
    #[arg(long, env = "PGAPPLY_SLOT")]
    pub slot: Option<String>,
    /// Also drop the replication slot on the source (its changes not applied yet are lost).
    #[arg(long)]
    pub drop_slot: bool,
}

/// `pgapply check`: `run`'s settings, checked.
#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Print JSON instead of text: {"ok": [...], "warnings": [...], "problems": [...]}.
    #[arg(long)]
    pub json: bool,
}

/// `pgapply status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Target (where pgapply keeps its state), --config and password files as for `run`; a
    /// source adds lag in bytes.
    #[command(flatten)]
    pub servers: ServersArgs,
    /// Only this slot (also PGAPPLY_SLOT or `slot` in the config file; without any, every slot).
    #[arg(long, env = "PGAPPLY_SLOT")]
    pub slot: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How long the live workload runs.
    #[arg(long, default_value = "10s", value_parser = crate::config::parse_duration)]
    pub duration: Duration,
    /// Directory with initdb, pg_ctl and postgres (default: PGAPPLY_PG_BIN, or the newest
    /// /usr/lib/postgresql/*/bin).
    #[arg(long, env = "PGAPPLY_PG_BIN")]
    pub pg_bin: Option<PathBuf>,
}

/// An on/off flag's value, given (`--binary=off`) or from its `PGAPPLY_*` variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    On,
    Off,
    /// An empty variable, as shells and service files leave them: as if not set (the config
    /// file's value, else off).
    Unset,
}

impl Switch {
    /// On or off as given, `None` when not.
    pub fn given(self) -> Option<bool> {
        match self {
            Switch::On => Some(true),
            Switch::Off => Some(false),
            Switch::Unset => None,
        }
    }
}

/// true/false, yes/no, on/off, 1/0; empty: not set.
fn parse_switch(value: &str) -> Result<Switch, String> {
    if value.trim().is_empty() {
        return Ok(Switch::Unset);
    }
    let command = clap::Command::new("pgapply");
    BoolishValueParser::new()
        .parse_ref(&command, None, std::ffi::OsStr::new(value))
        .map(|on| if on { Switch::On } else { Switch::Off })
        .map_err(|_| format!("{value:?} is not on or off: use true/false, yes/no, on/off or 1/0"))
}

#[cfg(test)]
mod switch_tests {
    #[test]
    fn an_empty_variable_is_not_set_and_a_wrong_value_is_named() {
        use super::Switch;
        assert_eq!(super::parse_switch(""), Ok(Switch::Unset));
        assert_eq!(super::parse_switch(" "), Ok(Switch::Unset));
        for on in ["true", "yes", "on", "1", "TRUE"] {
            assert_eq!(super::parse_switch(on), Ok(Switch::On), "{on}");
        }
        for off in ["false", "no", "off", "0"] {
            assert_eq!(super::parse_switch(off), Ok(Switch::Off), "{off}");
        }
        let err = super::parse_switch("bogus").unwrap_err();
        assert!(err.contains("\"bogus\" is not on or off"), "{err}");
    }

    /// `--copy-data=false` turns off what the config file turns on; a bare flag turns it on.
    #[test]
    fn a_switch_can_be_turned_off_on_the_command_line() {
        use clap::Parser;
        let parse = |args: &[&str]| match super::Cli::try_parse_from(args) {
            Ok(super::Cli {
                command: super::Command::Run(run),
                ..
            }) => (
                run.copy_data.and_then(super::Switch::given),
                run.binary.and_then(super::Switch::given),
            ),
            other => panic!("{other:?}"),
        };
        let run = |extra: &[&str]| parse(&[&["pgapply", "run"][..], extra].concat());
        assert_eq!(
            run(&["--copy-data=false", "--binary"]),
            (Some(false), Some(true))
        );
        assert_eq!(
            run(&["--copy-data=on", "--binary=no"]),
            (Some(true), Some(false))
        );
        assert_eq!(run(&[]), (None, None));
        assert_eq!(run(&["--copy-data="]), (None, None));
    }
}
