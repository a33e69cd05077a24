//! The apply loop: decoded messages in, target transactions out.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit};
use tokio_postgres::{Client, Statement};

use super::batch::UpdateBatch;
use super::conflict::{ConflictRecord, ConflictType, GroupConflicts, Policy, PolicyMap};
use super::parallel::{After, Turn, WorkerRole};
use super::progress::ProgressStore;
use super::spool::Spool;
use super::statement::{build_sql, ColumnSet, OnConflict, Operation, RowMatch, Shape, WireValue};
use crate::error::{describe_postgres, Error, Result};
use crate::failpoint;
use crate::metrics::METRICS;
use crate::protocol::pgoutput::{
    Begin, Commit, Delete, Insert, LogicalMessage, Oid, OldRow, ReplicaIdentity, Truncate, Update,
    Xid,
};
use crate::protocol::{Lsn, PgTimestamp, Tuple, Value};
use crate::relation::{RelationCache, RelationEntry};
use crate::sql::quote_ident;

mod live;

/// A decoded message on its way from the source reader to the applier. The permit holds the
/// message's bytes against the queue's byte budget until the applier is done with it.
pub struct Envelope {
    pub message: LogicalMessage,
    /// The message's bytes as received: what streamed transactions spool.
    pub raw: bytes::Bytes,
    pub permit: Option<OwnedSemaphorePermit>,
    /// On a Begin handed to a parallel worker: the transaction's place in the commit order.
    pub turn: Option<Turn>,
}

#[derive(Debug, Clone)]
pub struct ApplySettings {
    /// Most parameter values in statements sent but not yet answered: bounds the memory the
    /// pipeline holds (a batched statement carries many rows).
    pub pipeline_values: usize,
    /// Close a group of source transactions once it holds this many statements...
    pub group_statements: usize,
    /// ... or has been open this long.
    pub group_age: Duration,
    /// Collapse and batch UPDATEs of tables that allow it (`apply::batch`).
    pub batch_updates: bool,
    /// Source transactions whose commit LSN is at or before this are applied without batching:
    /// set when a batched statement failed, so that the retry names the failing transaction.
    /// Shared by the attempts of one run.
    pub unbatched_through: Arc<std::sync::atomic::AtomicU64>,
    /// Set when applying failed while a streamed transaction was applied as it arrived
    /// (`--streaming parallel`): from then on the process spools them (see `applier::live`).
    pub live_streaming_off: Arc<std::sync::atomic::AtomicBool>,
}

impl Default for ApplySettings {
    fn default() -> Self {
        ApplySettings {
            pipeline_values: 20_000,
            group_statements: 10_000,
            group_age: Duration::from_millis(200),
            batch_updates: true,
            unbatched_through: Arc::default(),
            live_streaming_off: Arc::default(),
        }
    }
}

/// Counters for progress logs and status.
#[derive(Debug, Default, Clone)]
pub struct ApplyStats {
    pub transactions: u64,
    pub inserts: u64,
    pub updates: u64,
    pub deletes: u64,
    pub truncates: u64,
    pub missing_rows: u64,
}

/// Changes sent since the last COMMIT (or PREPARE) was queued: they count once it is answered,
/// so a group rolled back and applied again counts once.
#[derive(Debug, Clone, Copy, Default)]
struct RowCounts {
    inserts: u64,
    updates: u64,
    deletes: u64,
    truncates: u64,
}

impl RowCounts {
    /// Adds them to the run's counts and the metrics.
    fn settle(self, stats: &mut ApplyStats) {
        stats.inserts += self.inserts;
        stats.updates += self.updates;
        stats.deletes += self.deletes;
        stats.truncates += self.truncates;
        let m = &*METRICS;
        m.inserts.add(self.inserts);
        m.updates.add(self.updates);
        m.deletes.add(self.deletes);
        m.truncates.add(self.truncates);
    }
}

impl ApplyStats {
    pub fn add(&mut self, other: &ApplyStats) {
        self.transactions += other.transactions;
        self.inserts += other.inserts;
        self.updates += other.updates;
        self.deletes += other.deletes;
        self.truncates += other.truncates;
        self.missing_rows += other.missing_rows;
    }
}

/// The source transaction being received.
struct SourceTransaction {
    xid: u32,
    final_lsn: Lsn,
    commit_time: PgTimestamp,
    /// Already applied before a restart: its changes are dropped.
    skip: bool,
    /// Skipped on request (`pgapply skip`): recorded when its commit arrives.
    skip_requested: bool,
}

/// The target transaction being built: one or more whole source transactions.
struct Group {
    started: Instant,
    /// A statement whose conflict must stop the group is in it: check results before COMMIT.
    check_before_commit: bool,
    statements: usize,
    /// Last included source commit: end LSN and time.
    last_commit: Option<(Lsn, PgTimestamp)>,
    /// The last included source transaction: xid and commit LSN (what `pgapply skip` takes).
    last_transaction: Option<(u32, Lsn)>,
    transactions: u64,
    /// Its place in the commit order, on a parallel worker.
    turn: Option<Turn>,
    /// Target tables this group relied on being as read (batched, or passing held updates), and
    /// what was read of them: checked on the target before it commits (`pgapply.check_group`).
    relied_on: Vec<(Oid, Arc<str>)>,
}

/// Statements queued before they are handed to the connection together.
const SUBMIT_CHUNK: usize = 64;

type InFlight = std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>>;

/// What the apply loop got while waiting: a message, or an answer from the target.
enum Next {
    Message(Option<Envelope>),
    Outcome(Option<Outcome>),
}

/// A group whose COMMIT has been sent and not yet answered.
struct Committing {
    /// The COMMIT's place among the statements sent (its answer is the `seq`-th).
    seq: u64,
    end_lsn: Lsn,
    commit_time: PgTimestamp,
    transactions: u64,
    /// The last source transaction in it: xid and commit LSN.
    last_transaction: Option<(u32, Lsn)>,
    /// Where `SET CONSTRAINTS ALL IMMEDIATE` is among the statements sent (origin mode): its
    /// failure is the group's failure to commit.
    immediate_seq: Option<u64>,
    started: Instant,
    /// Filled when the COMMIT's answer arrives.
    conflicts: GroupConflicts,
    /// The group's changes, counted once it committed.
    rows: RowCounts,
}

/// A statement's result, with what to say about it. (Lives inside an already boxed future: boxing
/// the larger variant would only add an allocation per statement.)
#[allow(clippy::large_enum_variant)]
enum Outcome {
    /// Row count of one change's statement.
    One(
        Option<ChangeInfo>,
        std::result::Result<u64, tokio_postgres::Error>,
    ),
    /// A batched UPDATE: the numbers of its rows that matched nothing.
    Batch(
        Vec<HeldChange>,
        std::result::Result<Vec<i32>, tokio_postgres::Error>,
    ),
    /// A statement keeping parallel workers' commits in order: only its failure matters.
    Order(std::result::Result<u64, tokio_postgres::Error>),
}

/// What a queued request runs.
enum Request {
    Prepared(Statement),
    /// A fixed simple query: its statements reach the server in one message (the end of a
    /// group in origin mode, `ProgressStore::origin_commit_sql`).
    Simple(Arc<str>),
}

/// One queued statement and what to say about it if it fails or finds no row.
struct Pending {
    request: Request,
    params: Vec<WireValue>,
    about: Option<ChangeInfo>,
    /// A batched UPDATE: its rows' changes, by row number.
    batch: Vec<HeldChange>,
    /// A turn lock or a wait for another transaction's commit (`apply::parallel`).
    orders: bool,
}

impl Pending {
    /// A statement with nothing to check in its result but success (BEGIN, COMMIT, ...).
    fn plain(statement: Statement) -> Self {
        Pending::with_params(statement, Vec::new())
    }

    fn simple(sql: Arc<str>) -> Self {
        Pending {
            request: Request::Simple(sql),
            params: Vec::new(),
            about: None,
            batch: Vec::new(),
            orders: false,
        }
    }

    fn with_params(statement: Statement, params: Vec<WireValue>) -> Self {
        Pending {
            request: Request::Prepared(statement),
            params,
            about: None,
            batch: Vec::new(),
            orders: false,
        }
    }
}

/// A held UPDATE's change, in brief (held rows are many; `ChangeInfo` is made only for the
/// rare one that finds no row).
struct HeldChange {
    relation: Arc<RelationEntry>,
    xid: u32,
    commit_lsn: Lsn,
    commit_time: PgTimestamp,
    /// The new row (a detached copy), which also holds the key.
    new: Tuple,
}

impl HeldChange {
    fn into_change_info(self) -> ChangeInfo {
        ChangeInfo {
            relation: self.relation,
            operation: "UPDATE",
            xid: self.xid,
            commit_lsn: self.commit_lsn,
            commit_time: self.commit_time,
            key: None,
            remote: Some(self.new),
            // Only updates under update_missing = skip are held.
            signal: Some(Signal {
                conflict: ConflictType::UpdateMissing,
                policy: Policy::Skip,
                when_rows: 0,
            }),
            through: None,
        }
    }
}

#[derive(Clone)]
struct ChangeInfo {
    relation: Arc<RelationEntry>,
    operation: &'static str,
    xid: u32,
    commit_lsn: Lsn,
    commit_time: PgTimestamp,
    /// For UPDATE/DELETE: the values that identify the row (for the "no row" warning).
    key: Option<(RowMatch, Vec<Value>)>,
    /// The new row (INSERT, UPDATE), for conflict records.
    remote: Option<Tuple>,
    /// Which row count means a conflict, and what to do about it.
    signal: Option<Signal>,
    /// The statement also carries changes of later source transactions, up to the one committing
    /// at this LSN (a multi-row INSERT across transactions): a failure is retried one change at a
    /// time so that it names its transaction.
    through: Option<Lsn>,
}

/// A statement's row count that means a conflict.
#[derive(Debug, Clone, Copy)]
struct Signal {
    conflict: ConflictType,
    policy: Policy,
    when_rows: u64,
}

impl ChangeInfo {
    fn describe(&self) -> String {
        // A streamed transaction applied as it arrives has no commit yet.
        let commit = if self.commit_lsn == Lsn(u64::MAX) {
            "not committed yet".to_owned()
        } else {
            format!("commit {}", self.commit_lsn)
        };
        format!(
            "{} on table {} (source transaction {}, {commit})",
            self.operation, self.relation.target.qualified, self.xid
        )
    }

    /// The row's identity for a log line or an error: under REPLICA IDENTITY FULL the "key" is
    /// the whole row, whose values stay out of logs at the default level (they are logged at
    /// debug level, and a conflict record keeps them); a key's values are shown, as PostgreSQL's
    /// own messages show them.
    fn describe_key_for_log(&self) -> String {
        let full = matches!(&self.key, Some((RowMatch::Full { .. }, _)));
        if !full {
            return self.describe_key();
        }
        tracing::debug!(table = %self.relation.target.qualified, row = %self.describe_key(), "the old row");
        let names = self
            .relation
            .source
            .columns
            .iter()
            .map(|c| quote_ident(&c.name))
            .collect::<Vec<_>>()
            .join(", ");
        format!("({names}) (REPLICA IDENTITY FULL: the old row's values are logged at debug level, and recorded with a conflict in pgapply.conflicts)")
    }

    fn describe_key(&self) -> String {
        let from_remote;
        let (row_match, old) = match (&self.key, &self.remote) {
            (Some((m, old)), _) => (m, old),
            (None, Some(new)) => {
                from_remote = (RowMatch::Key, new.values().collect::<Vec<Value>>());
                (&from_remote.0, &from_remote.1)
            }
            (None, None) => return String::new(),
        };
        let entry = &self.relation;
        let columns: Vec<usize> = match row_match {
            RowMatch::Key => entry.key_columns.clone(),
            RowMatch::Full { .. } => (0..entry.source.columns.len()).collect(),
        };
        let names = columns
            .iter()
            .map(|&c| quote_ident(&entry.source.columns[c].name))
            .collect::<Vec<_>>()
            .join(", ");
        let values = columns
            .iter()
            .map(|&c| match old.get(c) {
                Some(Value::Text(t)) => {
                    let s = String::from_utf8_lossy(t);
                    if s.len() > 64 {
                        format!("{}…", s.chars().take(64).collect::<String>())
                    } else {
                        s.into_owned()
                    }
                }
                Some(Value::Binary(_)) => "<binary>".into(),
                Some(Value::Null) => "NULL".into(),
                Some(Value::UnchangedToast) => "<unchanged>".into(),
                None => "?".into(),
            })
            .collect::<Vec<_>>()
            .join(", ");
        format!("({names})=({values})")
    }
}

pub struct Applier {
    /// The apply session, taken out of the pool for good: it is bound to the replication
    /// origin, and the position set in it outlives each transaction; no other work may inherit
    /// either (a commit of anything in it would carry that position).
    client: Arc<deadpool_postgres::ClientWrapper>,
    catalog: deadpool_postgres::Object,
    progress: ProgressStore,
    /// Statements sent to the target whose results have not been checked yet, in order.
    /// (In a mutex only so that the applier is `Sync`; it is always reached through `&mut self`.)
    in_flight: std::sync::Mutex<futures_util::stream::FuturesOrdered<InFlight>>,
    /// Statements handed to the connection, and answers taken, since the start.
    submitted: u64,
    completed: u64,
    /// Groups whose COMMIT is in flight, oldest first; and those whose COMMIT succeeded, waiting
    /// for their bookkeeping (position, counters, conflict records).
    committing: std::collections::VecDeque<Committing>,
    committed: Vec<Committing>,
    /// The number of parameter values of each of them, in order, and their sum.
    in_flight_sizes: std::collections::VecDeque<usize>,
    in_flight_values: usize,
    /// The first failure among them.
    failure: Option<Error>,
    settings: ApplySettings,
    relations: RelationCache,
    statements: HashMap<Shape, Statement>,
    /// Relations whose REPLICA IDENTITY FULL matching compares values as text.
    full_as_text: HashSet<Oid>,
    begin: Statement,
    commit: Statement,
    record: Statement,
    /// `SET CONSTRAINTS ALL IMMEDIATE`, sent before the origin position is set (origin mode).
    immediate: Statement,
    /// Origin mode: what sets the origin position and commits, in one message.
    origin_commit: Option<Arc<str>>,
    /// Each commit also writes the position to the origin's row in `pgapply.origin_commit`.
    commit_row: bool,
    /// With `commit_row`: `pgapply.check_committed`, which lets a group follow the previous
    /// one's COMMIT before its answer is in (`chain_commit`).
    check_committed: Option<Statement>,
    /// A transaction that had the origin position set failed to commit: PostgreSQL 16+ moves
    /// the origin on abort too, so it must be moved back (`rewind_origin`).
    origin_rewind: bool,
    /// Transactions ending at or before this were applied before: skip them.
    resume: Lsn,
    pending: Vec<Pending>,
    /// BEGIN has been sent (or queued) for the current group.
    group: Option<Group>,
    current: Option<SourceTransaction>,
    /// Shared by parallel workers: they commit in source order, so the latest is the position.
    applied: Arc<watch::Sender<Lsn>>,
    pub stats: ApplyStats,
    /// Changes sent since the last COMMIT or PREPARE was queued (`RowCounts`).
    unsettled_rows: RowCounts,
    /// Streamed transactions waiting for their Stream Commit.
    spool: Spool,
    /// The streamed transaction whose block is being received (Stream Start .. Stop).
    streaming: Option<Xid>,
    /// The slot, for the names of prepared transactions.
    slot: String,
    /// Log logical decoding messages at info level (`--messages`).
    log_messages: bool,
    /// `ApplierOptions::binary_values`.
    binary_values: bool,
    policies: Arc<PolicyMap>,
    policy_updates: Option<watch::Receiver<Arc<PolicyMap>>>,
    /// The commit LSN of a transaction to skip on purpose (`pgapply skip`).
    skip_lsn: Option<Lsn>,
    /// Conflicts met in the open group, recorded once it commits.
    conflicts: GroupConflicts,
    /// Conflicts met by transactions prepared on the target (by source xid): recorded at COMMIT
    /// PREPARED, dropped at ROLLBACK PREPARED.
    prepared_conflicts: HashMap<Xid, GroupConflicts>,
    /// Transactions of the open group skipped on request: (xid, commit LSN, commit time).
    skip_records: Vec<(u32, Lsn, PgTimestamp)>,
    /// Inserts into one table by one source transaction, waiting to go out as one statement.
    insert_run: Option<InsertRun>,
    /// Unique indexes of target tables as source column positions, by (source OID, generation):
    /// read when a guarded change first needs them.
    unique_keys: HashMap<(Oid, u64), Arc<Vec<Vec<usize>>>>,
    /// UPDATEs held in the open group, by target table (`apply::batch`): two source relations
    /// that reach one target table must not pass each other.
    held_updates: HashMap<Oid, UpdateBatch<HeldChange>>,
    held_rows: usize,
    /// Conflict policies by (source OID, generation).
    policy_cache: HashMap<(Oid, u64), super::conflict::Policies>,
    /// Whether a relation's updates may be batched, by (source OID, generation).
    /// Per relation: whether its updates are batched, and if so, what that was read from
    /// (`apply::batch::independent`).
    batchable: HashMap<(Oid, u64), Option<Arc<str>>>,
    /// `pgapply.check_group`, run by each group before it commits (migration 0012).
    check_group: Statement,
    /// Per relation: whether its changes may pass other tables' held updates (no trigger or
    /// rule: `apply::batch::quiet`), and if so, what that was read from.
    quiet: HashMap<(Oid, u64), Option<Arc<str>>>,
    /// Set on a parallel apply worker (`apply::parallel`).
    worker: Option<WorkerRole>,
    turn_statements: Option<TurnStatements>,
    /// The turn of the transaction whose Begin comes next.
    next_turn: Option<Turn>,
    /// The helper for `--streaming parallel` (main applier), or this applier is one (`live`).
    live: Option<live::LiveLink>,
    live_helper: Option<live::HelperState>,
    /// The queue permit of the message being dispatched, for a message forwarded to the helper.
    permit: Option<OwnedSemaphorePermit>,
    copied_tables: Option<Arc<std::collections::HashSet<(String, String)>>>,
    /// Relations `entry` has looked up in `copied_tables` already.
    copy_checked: HashSet<Oid>,
}

/// Prepared statements of the turn steps.
struct TurnStatements {
    lock: Statement,
    /// `pgapply.wait_for_commit`: waits on the server until another worker's transaction committed.
    wait: Statement,
}

/// Most UPDATEs held at once before they are sent.
const MAX_HELD_ROWS: usize = 4_096;

/// Most rows in one multi-row INSERT.
/// Most rows in one multi-row INSERT (a power of two: runs are sent in power-of-two pieces, so a
/// table needs at most a handful of prepared statements).
const MAX_INSERT_ROWS: usize = 128;

struct InsertRun {
    entry: Arc<RelationEntry>,
    shape: Shape,
    params: Vec<WireValue>,
    rows: usize,
    limit: usize,
    /// The first row's change, for messages.
    about: ChangeInfo,
    /// The commit LSN of the last row's source transaction.
    last_commit: Lsn,
}

/// What the session negotiated that the applier needs to know.
#[derive(Debug, Clone)]
pub struct ApplierOptions {
    pub slot: String,
    pub two_phase: bool,
    pub log_messages: bool,
    pub spool_dir: std::path::PathBuf,
    /// Source table -> target table, where they differ.
    pub table_map: Arc<crate::config::TableMap>,
    pub policies: Arc<PolicyMap>,
    pub policy_updates: Option<watch::Receiver<Arc<PolicyMap>>>,
    pub skip_lsn: Option<Lsn>,
    /// Set for each worker of a parallel apply.
    pub worker: Option<WorkerRole>,
    /// `--streaming parallel` was negotiated (and two-phase was not): apply streamed
    /// transactions as they arrive on a helper connection (`applier::live`).
    pub live_streaming: bool,
    /// After a finished initial copy: the source tables (schema, name) it copied.
    pub copied_tables: Option<Arc<std::collections::HashSet<(String, String)>>>,
    /// Values arrive in binary form (`--binary`, negotiated): the server reads a parameter by
    /// the type the statement was prepared with, so a target column whose type changed while
    /// pgapply runs must be noticed before a statement prepared against it is used.
    pub binary_values: bool,
}

/// Tables (slot, relation) already named by `Applier::entry` in this process: parallel workers
/// and retries share it.
static NOT_COPIED_WARNED: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashSet<(String, Oid)>>,
> = std::sync::LazyLock::new(Default::default);

impl Applier {
    pub async fn new(
        client: deadpool_postgres::Object,
        catalog: deadpool_postgres::Object,
        progress: ProgressStore,
        resume: Lsn,
        settings: ApplySettings,
        applied: impl Into<Arc<watch::Sender<Lsn>>>,
        options: ApplierOptions,
    ) -> Result<Self> {
        let client = deadpool_postgres::Object::take(client);
        progress.setup_session(&client).await?;
        progress.check_resume(&client, resume).await?;
        if options.two_phase {
            let row = client
                .query_one(
                    "SELECT current_setting('max_prepared_transactions')::int",
                    &[],
                )
                .await
                .map_err(|e| {
                    Error::postgres("reading max_prepared_transactions on the target", e)
                })?;
            if row.get::<_, i32>(0) == 0 {
                return Err(Error::definite(
                    "--two-phase needs prepared transactions on the target, but its max_prepared_transactions is 0: set it above 0 in postgresql.conf and restart the target",
                ));
            }
        }
        let spool = Spool::open(options.spool_dir.clone(), &options.slot)?;
        client
            .batch_execute(
                "SET datestyle = ISO; SET intervalstyle = postgres; SET extra_float_digits = 3; SET lc_monetary = 'C'; SET row_security = off",
            )
            .await
            .map_err(|e| Error::postgres("configuring the target apply session", e))?;
        // As PostgreSQL's own subscriber: ordinary triggers and foreign-key checks do not fire for
        // replicated changes. Only superusers (or, from 15, roles granted SET on the parameter)
        // may ask for that; others apply with triggers firing, and are told.
        if let Err(e) = client
            .batch_execute("SET session_replication_role = replica")
            .await
        {
            if e.code().is_some_and(|c| c.code() == "42501") {
                tracing::warn!("the target role may not set session_replication_role: triggers and foreign-key checks on the target fire for replicated changes (GRANT SET ON PARAMETER session_replication_role TO <role> on PostgreSQL 15+ to avoid that)");
            } else {
                return Err(Error::postgres("configuring the target apply session", e));
            }
        }
        // Every statement is prepared once and run many times with simple key lookups: skip the
        // custom plans PostgreSQL would otherwise make for the first executions (12+).
        let version = crate::sql::server_version(&client)
            .await
            .map_err(|e| Error::postgres("reading the target's version", e))?;
        if version >= 140000 && options.worker.is_some() {
            // A parallel worker's transaction may wait on the server for another's
            // (`pgapply.wait_for_commit`): if pgapply goes away meanwhile, end it soon rather than
            // hold its rows until the wait times out.
            if let Err(e) = client
                .batch_execute("SET client_connection_check_interval = '1s'")
                .await
            {
                tracing::debug!(error = %describe_postgres(&e), "client_connection_check_interval not available on the target");
            }
        }
        // Each statement works on the rows as committed when it runs (by other workers, by the
        // target's own users), as PostgreSQL's own apply worker does: under a database or role
        // default of repeatable read or serializable, a group's snapshot would be fixed at its
        // first statement, and any target write since would fail it with a serialization error.
        client
            .batch_execute("SET default_transaction_isolation = 'read committed'")
            .await
            .map_err(|e| Error::postgres("configuring the target apply session", e))?;
        if options.worker.is_some() {
            // Waits for other workers' commits are part of the plan: a role's statement, lock or
            // transaction timeouts must not turn them into errors.
            client
                .batch_execute(
                    "SET statement_timeout = 0; SET lock_timeout = 0; \
                     SET idle_in_transaction_session_timeout = 0; \
                     SELECT pg_catalog.set_config(name, '0', false) FROM pg_catalog.pg_settings WHERE name = 'transaction_timeout'",
                )
                .await
                .map_err(|e| Error::postgres("configuring the target apply session", e))?;
        }
        if version >= 120000 {
            client
                .batch_execute("SET plan_cache_mode = force_generic_plan")
                .await
                .map_err(|e| Error::postgres("configuring the target apply session", e))?;
        }
        let prepare = |sql: String| {
            let client = &client;
            async move {
                client
                    .prepare(&sql)
                    .await
                    .map_err(|e| Error::postgres(format!("preparing {sql:?} on the target"), e))
            }
        };
        let begin = prepare("BEGIN".into()).await?;
        let commit = prepare("COMMIT".into()).await?;
        let commit_row = !progress.is_table_mode() && !options.two_phase;
        let record = prepare(progress.record_sql(commit_row)).await?;
        // Bound to the origin now: no other session moves it while its row starts where it is.
        progress.start_commit_row(&client, commit_row).await?;
        let immediate = prepare("SET CONSTRAINTS ALL IMMEDIATE".into()).await?;
        let check_group = prepare(
            "SELECT pgapply.check_group($1::text, $2::text::pg_lsn, $3::text, $4::text)".into(),
        )
        .await?;
        let check_committed = match commit_row && options.worker.is_none() {
            true => Some(
                prepare("SELECT pgapply.check_committed($1::text, $2::text::pg_lsn)".into())
                    .await?,
            ),
            false => None,
        };
        let origin_commit = (!progress.is_table_mode())
            .then(|| Arc::from(ProgressStore::origin_commit_sql("COMMIT")));
        let turn_statements = match &options.worker {
            None => None,
            Some(_) => Some(TurnStatements {
                lock: prepare("SELECT pg_catalog.pg_advisory_xact_lock($1::int4, $2::int4)".into())
                    .await?,
                wait: prepare(
                    "SELECT pgapply.wait_for_commit($1::int4, $2::int4, $3::text, $4::text::pg_lsn, $5::int4)".into(),
                )
                .await?,
            }),
        };
        Ok(Applier {
            client: Arc::new(client),
            catalog,
            in_flight: std::sync::Mutex::new(futures_util::stream::FuturesOrdered::new()),
            failure: None,
            in_flight_sizes: std::collections::VecDeque::new(),
            submitted: 0,
            completed: 0,
            committing: std::collections::VecDeque::new(),
            committed: Vec::new(),
            in_flight_values: 0,
            progress,
            settings,
            relations: RelationCache::new(options.table_map.clone()),
            statements: HashMap::new(),
            full_as_text: FULL_AS_TEXT.lock().map(|s| s.clone()).unwrap_or_default(),
            begin,
            commit,
            record,
            immediate,
            origin_commit,
            commit_row,
            check_committed,
            origin_rewind: false,
            resume,
            pending: Vec::new(),
            group: None,
            current: None,
            applied: applied.into(),
            stats: ApplyStats::default(),
            unsettled_rows: RowCounts::default(),
            spool,
            streaming: None,
            slot: options.slot,
            log_messages: options.log_messages,
            binary_values: options.binary_values,
            policies: options.policies,
            policy_updates: options.policy_updates,
            skip_lsn: options.skip_lsn,
            conflicts: GroupConflicts::default(),
            prepared_conflicts: HashMap::new(),
            skip_records: Vec::new(),
            insert_run: None,
            unique_keys: HashMap::new(),
            held_updates: HashMap::new(),
            held_rows: 0,
            batchable: HashMap::new(),
            quiet: HashMap::new(),
            check_group,
            policy_cache: HashMap::new(),
            worker: options.worker,
            turn_statements,
            next_turn: None,
            live: None,
            live_helper: None,
            permit: None,
            copied_tables: options.copied_tables,
            copy_checked: HashSet::new(),
        })
    }

    /// The relation a change is for. After an initial copy, a table it did not take in (added to
    /// the publication since) is named once: its earlier rows are not on the target.
    fn entry(&mut self, oid: Oid) -> Result<Arc<RelationEntry>> {
        let entry = self.relations.get(oid)?.clone();
        if let Some(copied) = &self.copied_tables {
            // Once per relation: this is on every change's path.
            if self.copy_checked.insert(oid) {
                let source = (
                    crate::relation::source_schema(&entry.source).to_owned(),
                    entry.source.name.clone(),
                );
                let first = !copied.contains(&source)
                    && NOT_COPIED_WARNED
                        .lock()
                        .map(|mut w| w.insert((self.slot.clone(), oid)))
                        .unwrap_or(false);
                if first {
                    tracing::warn!(
                        table = %entry.display_name(),
                        "changes arrive for a table the initial copy did not take in (published, or renamed, after it): rows it had before may be missing on the target, and their updates and deletes would then be missing-row conflicts. Copy them by hand if so, or start over with a new slot and --copy-data --truncate-target"
                    );
                }
            }
        }
        Ok(entry)
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn progress_store(&self) -> &ProgressStore {
        &self.progress
    }

    /// Applies messages until the channel closes. A source transaction that is incomplete when it
    /// closes is rolled back on the target; complete ones are committed.
    pub async fn run(&mut self, rx: &mut mpsc::UnboundedReceiver<Envelope>) -> Result<()> {
        let result = self.run_messages(rx).await;
        match result {
            Err(e) => Err(self.live_failed(e)),
            Ok(()) => {
                self.live_finish().await;
                Ok(())
            }
        }
    }

    async fn run_messages(&mut self, rx: &mut mpsc::UnboundedReceiver<Envelope>) -> Result<()> {
        loop {
            // A failure noted while sending (answers taken on the way) ends the run before it
            // waits for more: later answers may be waiting on it.
            if self.failure.is_some() {
                self.fail_if_failed().await?;
            }
            let next = if !rx.is_empty() || self.in_flight_mut().is_empty() {
                Next::Message(rx.recv().await)
            } else {
                // Nothing to apply right now: take the target's answers while waiting, so a
                // committed group is confirmed (and its position reported) without delay.
                let in_flight = self
                    .in_flight
                    .get_mut()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                tokio::select! {
                    biased;
                    envelope = rx.recv() => Next::Message(envelope),
                    outcome = in_flight.next() => Next::Outcome(outcome),
                }
            };
            match next {
                Next::Message(None) => break,
                Next::Message(Some(envelope)) => {
                    if envelope.turn.is_some() {
                        self.next_turn = envelope.turn;
                    }
                    self.permit = envelope.permit;
                    self.dispatch(envelope.message, envelope.raw).await?;
                    self.permit = None;
                    // Between source transactions a finished group may commit: right after a
                    // commit, or when other messages (stream blocks, non-transactional messages)
                    // follow it.
                    if self.current.is_none() && self.group_should_close(rx.is_empty()) {
                        self.commit_group().await?;
                    }
                }
                Next::Outcome(outcome) => {
                    if let Some(outcome) = outcome {
                        self.check_outcome(outcome);
                    }
                    self.fail_if_failed().await?;
                    self.settle_committed().await;
                    if self.current.is_none() && self.group_should_close(rx.is_empty()) {
                        self.commit_group().await?;
                    }
                }
            }
        }
        // A streamed transaction still open on the helper ends with its sessions (it never
        // committed on the source before the end): first, as the last group may wait for its
        // rows.
        self.live_abandon();
        if self.current.is_some() {
            self.rollback().await?;
        } else if self.group.is_some() {
            self.commit_group().await?;
        }
        self.drain_to(0).await;
        self.fail_if_failed().await?;
        self.settle_committed().await;
        Ok(())
    }

    /// Routes a message: inside a streamed block it is spooled, or forwarded to the helper when
    /// that transaction is the helper's (`live`); stream and two-phase control messages are
    /// handled here; everything else is applied. A helper routes everything its own way.
    async fn dispatch(&mut self, message: LogicalMessage, raw: bytes::Bytes) -> Result<()> {
        if self.live_helper.is_some() {
            return self.live_dispatch(message).await;
        }
        // Between Stream Start and Stream Stop come only a transaction's changes (and the
        // descriptions they need): anything that begins, ends or finishes a transaction there
        // would be spooled under the wrong one, or lost.
        if self.streaming.is_some() || self.live_in_block() {
            let out_of_place = matches!(
                &message,
                LogicalMessage::Begin(_)
                    | LogicalMessage::Commit(_)
                    | LogicalMessage::StreamStart(_)
                    | LogicalMessage::StreamCommit(_)
                    | LogicalMessage::StreamAbort(_)
                    | LogicalMessage::BeginPrepare(_)
                    | LogicalMessage::Prepare(_)
                    | LogicalMessage::StreamPrepare(_)
                    | LogicalMessage::CommitPrepared(_)
                    | LogicalMessage::RollbackPrepared(_)
            );
            if out_of_place {
                return Err(Error::definite(format!(
                    "the source sent {} inside a streamed transaction's block (before Stream Stop); this is a protocol error",
                    message.name()
                )));
            }
        }
        match message {
            LogicalMessage::StreamStart(s) if self.live_takes(&s) => self.live_start(s, raw).await,
            LogicalMessage::StreamStop if self.live_in_block() => self.live_stop(raw).await,
            LogicalMessage::StreamAbort(a) if self.live_holds(a.xid) => {
                self.live_abort(a, raw).await
            }
            LogicalMessage::StreamCommit(c) if self.live_holds(c.xid) => {
                self.live_commit(c, raw).await
            }
            LogicalMessage::StreamStart(s) => {
                self.spool.start(s.xid, s.first_segment);
                self.streaming = Some(s.xid);
                Ok(())
            }
            LogicalMessage::StreamStop => {
                self.streaming = None;
                Ok(())
            }
            LogicalMessage::StreamAbort(a) => {
                tracing::debug!(
                    xid = a.xid,
                    subxid = a.subxid,
                    "streamed transaction aborted"
                );
                self.spool.abort(a.xid, a.subxid)
            }
            LogicalMessage::StreamCommit(c) => self.stream_commit(c).await,
            LogicalMessage::BeginPrepare(b) => self.begin_prepare(b).await,
            LogicalMessage::Prepare(p) => self.prepare(p).await,
            LogicalMessage::StreamPrepare(p) => self.stream_prepare(p).await,
            LogicalMessage::CommitPrepared(c) => {
                self.finish_prepared(c.xid, &c.gid, c.end_lsn, c.commit_time, true)
                    .await
            }
            LogicalMessage::RollbackPrepared(r) => {
                self.finish_prepared(r.xid, &r.gid, r.rollback_end_lsn, r.rollback_time, false)
                    .await
            }
            // A non-transactional message is sent at once, outside any block.
            LogicalMessage::Message(m) if !m.transactional() => {
                self.handle(LogicalMessage::Message(m)).await
            }
            message if self.live_in_block() => self.live_change(message, raw).await,
            message => match self.streaming {
                Some(xid) => {
                    let subxid = streamed_xid(&message);
                    self.spool.append(xid, subxid, raw)
                }
                None => self.handle(message).await,
            },
        }
    }

    /// Applies a committed streamed transaction from the spool, as one source transaction.
    async fn stream_commit(&mut self, c: crate::protocol::pgoutput::StreamCommit) -> Result<()> {
        self.begin(Begin {
            final_lsn: c.commit_lsn,
            commit_time: c.commit_time,
            xid: c.xid,
        })?;
        self.replay_spool(c.xid).await?;
        self.on_commit(Commit {
            flags: c.flags,
            commit_lsn: c.commit_lsn,
            end_lsn: c.end_lsn,
            commit_time: c.commit_time,
        })
    }

    async fn replay_spool(&mut self, xid: Xid) -> Result<()> {
        let mut replay = self.spool.take(xid)?;
        let context = crate::protocol::pgoutput::Context {
            in_stream_block: true,
            abort_info: false,
        };
        let mut count = 0u64;
        while let Some(raw) = replay.next_message()? {
            let message = crate::protocol::pgoutput::decode(raw, context).map_err(|e| {
                Error::definite(format!("replaying streamed transaction {xid}: {e}"))
            })?;
            self.handle(message).await?;
            count += 1;
        }
        tracing::debug!(xid, messages = count, "replayed streamed transaction");
        Ok(())
    }

    /// How to get past a transaction that cannot be applied.
    fn skip_hint(&self, commit_lsn: Lsn) -> String {
        format!(
            "to skip this source transaction on purpose, run: pgapply skip --target ... --slot {} --lsn {commit_lsn} (then start pgapply again)",
            self.slot
        )
    }

    /// Writes the conflicts of the group that just committed to pgapply.conflicts.
    async fn record_conflicts(&mut self, conflicts: GroupConflicts) {
        self.announce_conflicts(&conflicts);
        self.write_conflicts(conflicts).await;
    }

    /// Logs the conflicts of a group that committed (or a transaction that was prepared) and
    /// counts them.
    fn announce_conflicts(&mut self, conflicts: &GroupConflicts) {
        for record in conflicts.records() {
            let log = &record.log;
            if log.missing {
                self.stats.missing_rows += 1;
            }
            METRICS.conflict(record.conflict_type, 1);
            match log.rows {
                Some(rows) => tracing::warn!(
                    table = %record.relation,
                    key = %log.key,
                    xid = log.xid,
                    commit_lsn = %record.source_lsn,
                    conflict = record.conflict_type,
                    policy = record.policy,
                    rows,
                    "{}", log.sentence
                ),
                None => tracing::warn!(
                    table = %record.relation,
                    key = %log.key,
                    xid = log.xid,
                    commit_lsn = %record.source_lsn,
                    conflict = record.conflict_type,
                    policy = record.policy,
                    "{}", log.sentence
                ),
            }
        }
        for more in conflicts.beyond() {
            if more.missing {
                self.stats.missing_rows += more.count;
            }
            METRICS.conflict(more.conflict_type, more.count);
            tracing::warn!(
                table = %more.relation,
                conflict = more.conflict_type,
                policy = more.policy,
                conflicts = more.count,
                first_commit_lsn = %more.first_lsn,
                last_commit_lsn = %more.last_lsn,
                "{} more {} conflicts on {} in the same target transaction (policy {}), counted but not logged one by one: pgapply.conflicts holds them as one row with occurrences = {}",
                more.count,
                more.conflict_type,
                more.relation,
                more.policy,
                more.count
            );
        }
    }

    /// Writes conflict records to pgapply.conflicts (after their transaction committed).
    async fn write_conflicts(&mut self, conflicts: GroupConflicts) {
        let (records, beyond) = conflicts.into_parts();
        for record in records {
            let local_row: Option<String> = match &record.local_row_query {
                _ if record.local_row.is_some() => record.local_row.clone(),
                Some((sql, params)) => self
                    .catalog
                    .query_opt(
                        sql.as_str(),
                        &params
                            .iter()
                            .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
                            .collect::<Vec<_>>(),
                    )
                    .await
                    .ok()
                    .flatten()
                    .and_then(|r| r.get(0)),
                None => None,
            };
            self.write_conflict(
                &record.relation,
                record.conflict_type,
                Some(&record.key),
                (local_row.as_deref(), record.remote_row.as_deref()),
                (record.source_lsn, record.source_commit_time),
                record.policy,
                1,
            )
            .await;
        }
        for more in beyond {
            self.write_conflict(
                &more.relation,
                more.conflict_type,
                None,
                (None, None),
                (more.last_lsn, more.last_commit_time),
                more.policy,
                more.count,
            )
            .await;
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn write_conflict(
        &self,
        relation: &str,
        conflict_type: &str,
        key: Option<&str>,
        (local_row, remote_row): (Option<&str>, Option<&str>),
        (source_lsn, commit_time): (Lsn, Option<PgTimestamp>),
        policy: &str,
        occurrences: u64,
    ) {
        let result = self
            .catalog
            .execute(
                "INSERT INTO pgapply.conflicts (slot_name, relation, conflict_type, key, local_row, remote_row, \
                     source_lsn, source_commit_time, policy, occurrences) \
                 VALUES ($1, $2, $3, $4, $5::text::jsonb, $6::text::jsonb, $7::text::pg_lsn, $8::text::timestamptz, $9, $10)",
                &[
                    &self.slot,
                    &relation,
                    &conflict_type,
                    &key,
                    &local_row,
                    &remote_row,
                    &source_lsn.to_string(),
                    &commit_time.map(|t| t.to_rfc3339()),
                    &policy,
                    &i64::try_from(occurrences).unwrap_or(i64::MAX),
                ],
            )
            .await;
        if let Err(e) = result {
            tracing::warn!(error = %describe_postgres(&e), "could not record a conflict in pgapply.conflicts");
        }
    }

    /// The name of the target's prepared transaction for a source transaction.
    fn gid(&self, xid: Xid) -> String {
        format!("pgapply_{}_{}", self.slot, xid)
    }

    /// The parameters of the `record` statement (`ProgressStore::record_sql`).
    fn record_params(&self, end_lsn: Lsn, time: PgTimestamp) -> Vec<WireValue> {
        let mut params = vec![
            WireValue::Text(end_lsn.to_string().into()),
            WireValue::Text(time.to_rfc3339().into()),
        ];
        if let Some(origin) = self.progress.origin_name().filter(|_| self.commit_row) {
            params.push(WireValue::Text(origin.to_owned().into()));
        }
        params
    }

    async fn prepared_exists(&self, gid: &str) -> Result<bool> {
        let row = self
            .catalog
            .query_one(
                // The view is the whole cluster's: another database's transaction is not ours.
                "SELECT EXISTS (SELECT 1 FROM pg_prepared_xacts WHERE gid = $1 AND database = current_database())",
                &[&gid],
            )
            .await
            .map_err(|e| Error::postgres("reading pg_prepared_xacts on the target", e))?;
        Ok(row.get(0))
    }

    /// Begin Prepare: a transaction of its own (never grouped), ended by PREPARE TRANSACTION.
    async fn begin_prepare(&mut self, b: crate::protocol::pgoutput::BeginPrepare) -> Result<()> {
        self.commit_group_and_wait().await?;
        let gid = self.gid(b.xid);
        self.begin_at(
            Begin {
                final_lsn: b.prepare_lsn,
                commit_time: b.prepare_time,
                xid: b.xid,
            },
            false,
        )?;
        // Prepared before a restart: it survives on the target, so it is not applied again.
        if self.prepared_exists(&gid).await? {
            tracing::info!(gid = %gid, source_gid = %b.gid, "transaction already prepared on the target");
            if let Some(t) = &mut self.current {
                t.skip = true;
                // Applied: its COMMIT PREPARED commits it, so it is not recorded as skipped.
                t.skip_requested = false;
            }
            self.pending.clear();
            self.group = None;
            self.unsettled_rows = RowCounts::default();
        }
        Ok(())
    }

    async fn prepare(&mut self, p: crate::protocol::pgoutput::Prepare) -> Result<()> {
        let Some(txn) = self.current.take() else {
            return Err(Error::definite(format!(
                "the source sent Prepare {} without Begin Prepare; this is a protocol error",
                p.gid
            )));
        };
        if txn.skip_requested {
            self.skip_lsn = None;
            self.record_requested_skip(&txn, p.end_lsn, p.prepare_time);
            return Ok(());
        }
        if txn.skip {
            return Ok(());
        }
        self.prepare_group(p.xid, p.end_lsn, p.prepare_time).await
    }

    async fn stream_prepare(&mut self, p: crate::protocol::pgoutput::Prepare) -> Result<()> {
        self.commit_group_and_wait().await?;
        let gid = self.gid(p.xid);
        let already = self.prepared_exists(&gid).await?;
        self.begin_at(
            Begin {
                final_lsn: p.prepare_lsn,
                commit_time: p.prepare_time,
                xid: p.xid,
            },
            false,
        )?;
        if let Some(txn) = self.current.take_if(|t| t.skip_requested && !already) {
            self.spool.discard(p.xid);
            self.skip_lsn = None;
            self.record_requested_skip(&txn, p.end_lsn, p.prepare_time);
            return Ok(());
        }
        let skip = already || self.current.as_ref().is_some_and(|t| t.skip);
        if skip {
            self.spool.discard(p.xid);
            self.current = None;
            self.pending.clear();
            self.group = None;
            return Ok(());
        }
        self.replay_spool(p.xid).await?;
        self.current = None;
        self.prepare_group(p.xid, p.end_lsn, p.prepare_time).await
    }

    /// Ends the open group with PREPARE TRANSACTION instead of COMMIT.
    async fn prepare_group(&mut self, xid: Xid, end_lsn: Lsn, time: PgTimestamp) -> Result<()> {
        self.flush_held_updates(None).await?;
        self.flush_insert_run().await?;
        let gid = self.gid(xid);
        let record = self.record_params(end_lsn, time);
        let table_mode = self.progress.is_table_mode();
        if !table_mode {
            // (Deferred checks first: see `commit_group`.)
            self.pending.push(Pending::plain(self.immediate.clone()));
            // The origin position goes into the PREPARE record itself (noted here, set with
            // the PREPARE).
            self.pending
                .push(Pending::with_params(self.record.clone(), record.to_vec()));
        }
        self.send_pipeline().await?;
        // Everything before was answered: what is left was met by this transaction.
        let conflicts = std::mem::take(&mut self.conflicts);
        if !conflicts.is_empty() {
            self.prepared_conflicts.insert(xid, conflicts);
        }
        if failpoint::armed(failpoint::EXIT_BEFORE_COMMIT) {
            failpoint::exit(failpoint::EXIT_BEFORE_COMMIT);
        }
        let prepare = format!("PREPARE TRANSACTION {}", crate::sql::quote_literal(&gid));
        let prepare = if table_mode {
            prepare
        } else {
            // The origin position is set in the same message (see `origin_commit_sql`).
            ProgressStore::origin_commit_sql(&prepare)
        };
        if let Err(e) = self.client.batch_execute(&prepare).await {
            // Only an error the server sent says the PREPARE did not happen (as for a COMMIT).
            let refused = e.as_db_error().is_some();
            let err = Error::postgres(format!("preparing transaction {gid} on the target"), e);
            return Err(if refused {
                self.with_origin_rewound(err).await
            } else {
                err
            });
        }
        if table_mode {
            // Not inside the prepared transaction: its row lock would be held until COMMIT
            // PREPARED and block every later transaction.
            let record_sql = self.record.clone();
            let failed = |e| Error::postgres("recording the position on the target", e);
            self.client.batch_execute("BEGIN").await.map_err(failed)?;
            self.client
                .execute(&record_sql, &[&record[0], &record[1]])
                .await
                .map_err(failed)?;
            self.client.batch_execute("COMMIT").await.map_err(failed)?;
        }
        self.group = None;
        std::mem::take(&mut self.unsettled_rows).settle(&mut self.stats);
        // Said and counted once prepared, as its rows are (a restart before COMMIT PREPARED
        // finds the transaction prepared, not its conflicts); written to pgapply.conflicts when
        // it commits.
        if let Some(conflicts) = self.prepared_conflicts.remove(&xid) {
            self.announce_conflicts(&conflicts);
            self.prepared_conflicts.insert(xid, conflicts);
        }
        tracing::debug!(gid = %gid, %end_lsn, "prepared");
        self.advance_applied(end_lsn);
        Ok(())
    }

    /// COMMIT PREPARED or ROLLBACK PREPARED, recording the position.
    async fn finish_prepared(
        &mut self,
        xid: Xid,
        source_gid: &str,
        end_lsn: Lsn,
        time: PgTimestamp,
        commit: bool,
    ) -> Result<()> {
        self.commit_group_and_wait().await?;
        let gid = self.gid(xid);
        let verb = if commit {
            "COMMIT PREPARED"
        } else {
            "ROLLBACK PREPARED"
        };
        if !self.prepared_exists(&gid).await? {
            if !(self.resume.is_valid() && end_lsn <= self.resume) {
                tracing::warn!(gid = %gid, source_gid, "{verb}: the transaction is not prepared on the target; assuming it was finished before a restart");
            }
            // Finished before: nothing more to wait for at this position.
            self.advance_applied(end_lsn);
            return Ok(());
        }
        let lsn = end_lsn.to_string();
        let at = time.to_rfc3339();
        let finish = format!("{verb} {}", crate::sql::quote_literal(&gid));
        match &self.progress.mode {
            // The session's origin position is taken by the COMMIT/ROLLBACK PREPARED record.
            super::progress::ProgressMode::Origin { .. } => {
                // Only the session's origin position is set here (no transaction id, so no
                // commit record of its own): the COMMIT/ROLLBACK PREPARED record takes it.
                self.client
                    .execute(
                        "SELECT pg_catalog.pg_replication_origin_xact_setup($1::pg_lsn, $2::timestamptz)",
                        &[
                            &WireValue::Text(lsn.clone().into()),
                            &WireValue::Text(at.clone().into()),
                        ],
                    )
                    .await
                    .map_err(|e| Error::postgres("recording the position on the target", e))?;
                if let Err(e) = self.client.batch_execute(&finish).await {
                    // The position stays set in the session: cleared, or the session's next
                    // commit would carry it and count this transaction as finished.
                    let _ = self
                        .client
                        .batch_execute("SELECT pg_catalog.pg_replication_origin_xact_reset()")
                        .await;
                    return Err(Error::postgres(format!("{verb} {gid} on the target"), e));
                }
            }
            super::progress::ProgressMode::Table => {
                self.client
                    .batch_execute(&finish)
                    .await
                    .map_err(|e| Error::postgres(format!("{verb} {gid} on the target"), e))?;
                self.client
                    .batch_execute("BEGIN")
                    .await
                    .map_err(|e| Error::postgres("recording the position on the target", e))?;
                self.client
                    .execute(
                        &self.record,
                        &[&WireValue::Text(lsn.into()), &WireValue::Text(at.into())],
                    )
                    .await
                    .map_err(|e| Error::postgres("recording the position on the target", e))?;
                self.client
                    .batch_execute("COMMIT")
                    .await
                    .map_err(|e| Error::postgres("recording the position on the target", e))?;
            }
        }
        tracing::debug!(gid = %gid, %end_lsn, "{verb}");
        if let Some(conflicts) = self.prepared_conflicts.remove(&xid) {
            if commit {
                self.write_conflicts(conflicts).await;
            }
        }
        if commit {
            self.stats.transactions += 1;
            METRICS.transactions.inc();
        }
        METRICS.applied_lsn.set(end_lsn.0);
        self.advance_applied(end_lsn);
        Ok(())
    }

    fn group_should_close(&self, nothing_waiting: bool) -> bool {
        // A parallel worker commits each source transaction on its own: its commit waits for
        // transactions of other workers, which may wait for this one's.
        if self.worker.is_some() {
            return self.group.is_some();
        }
        match &self.group {
            None => false,
            Some(g) => {
                // While the transactions of a failed group are applied again one at a time, each
                // commits on its own: a failure at COMMIT (a deferred constraint) then names it.
                let one_at_a_time = g
                    .last_transaction
                    .is_some_and(|(_, lsn)| self.one_at_a_time(lsn));
                // Idle: commit, unless the previous COMMIT is still unanswered (the group grows
                // meanwhile and closes when it is answered, or when it is big or old enough).
                one_at_a_time
                    || (nothing_waiting && self.committing.is_empty())
                    || g.statements >= self.settings.group_statements
                    || g.started.elapsed() >= self.settings.group_age
            }
        }
    }

    async fn handle(&mut self, message: LogicalMessage) -> Result<()> {
        match message {
            LogicalMessage::Begin(b) => self.begin(b),
            LogicalMessage::Commit(c) => self.on_commit(c),
            LogicalMessage::Relation(r) => {
                // Held updates were built for the relation as it was.
                self.flush_held_updates(None).await?;
                let name = format!("{}.{}", r.namespace, r.name);
                match self.relations.update(r, &self.catalog).await {
                    Ok(_) => Ok(()),
                    // Raised by the first change of it, if one comes (see `RelationCache`).
                    Err(e) if !e.is_transient() => {
                        tracing::debug!(relation = %name, error = %e, "relation not usable on the target");
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            LogicalMessage::Type(t) => {
                self.relations.remember_type(t);
                Ok(())
            }
            LogicalMessage::Insert(i) => self.insert(i).await,
            LogicalMessage::Update(u) => self.update(u).await,
            LogicalMessage::Delete(d) => self.delete(d).await,
            LogicalMessage::Truncate(t) => self.truncate(t).await,
            LogicalMessage::Origin(o) => {
                tracing::debug!(origin = %o.name, commit_lsn = %o.commit_lsn, "transaction from origin");
                Ok(())
            }
            LogicalMessage::Message(m) => {
                // The hook point for logical decoding messages: logged.
                if self.log_messages {
                    tracing::info!(prefix = %m.prefix, lsn = %m.lsn, transactional = m.transactional(), bytes = m.content.len(), "logical decoding message");
                } else {
                    tracing::debug!(prefix = %m.prefix, lsn = %m.lsn, transactional = m.transactional(), bytes = m.content.len(), "logical decoding message");
                }
                Ok(())
            }
            other => Err(Error::definite(format!(
                "the source sent a {} message where pgapply did not expect one; this is a protocol error",
                other.name()
            ))),
        }
    }

    fn begin(&mut self, b: Begin) -> Result<()> {
        self.begin_at(b, true)
    }

    /// `skip_applied`: skip the transaction when its commit lies before the resume position.
    /// Not for prepared transactions: the source sends one prepared before its slot could decode
    /// prepares (before `two_phase_at`, or while the slot was being created) only at COMMIT
    /// PREPARED, with its old prepare position, which may lie before the resume position although
    /// it was never applied. One that was applied is not sent again, or found prepared on the
    /// target (`prepared_exists`).
    fn begin_at(&mut self, b: Begin, skip_applied: bool) -> Result<()> {
        // Policies reloaded (SIGHUP) apply from the next transaction on.
        if let Some(updates) = &mut self.policy_updates {
            if updates.has_changed().unwrap_or(false) {
                self.policies = updates.borrow_and_update().clone();
                self.policy_cache.clear();
                tracing::info!("conflict policies reloaded");
            }
        }
        if let Some(open) = &self.current {
            return Err(Error::definite(format!(
                "the source began transaction {} while transaction {} (commit {}) was still open; this is a protocol error",
                b.xid, open.xid, open.final_lsn
            )));
        }
        // A commit record that starts before the resume position ends at or before it: applied.
        let skip = skip_applied && self.resume.is_valid() && b.final_lsn < self.resume;
        if skip {
            tracing::debug!(xid = b.xid, commit_lsn = %b.final_lsn, "skipping transaction applied before");
        } else if self.group.is_none() {
            let turn = self.next_turn.take();
            self.group = Some(Group {
                started: Instant::now(),
                check_before_commit: false,
                statements: 0,
                last_commit: None,
                last_transaction: None,
                transactions: 0,
                turn: turn.clone(),
                relied_on: Vec::new(),
            });
            let begin = self.begin.clone();
            self.pending.push(Pending::plain(begin));
            if let (Some(turn), Some(worker), Some(statements)) =
                (turn, &self.worker, &self.turn_statements)
            {
                self.pending.push(Pending {
                    request: Request::Prepared(statements.lock.clone()),
                    params: turn_lock_params(worker.lock_key, turn.seq),
                    about: None,
                    batch: Vec::new(),
                    orders: true,
                });
                // Earlier transactions of other workers that touched the same rows: their
                // commits come before any change of this one.
                for dep in &turn.deps {
                    self.pending.push(Pending {
                        request: Request::Prepared(statements.wait.clone()),
                        params: wait_params(worker, dep, WAIT_FOR_COMMIT_MS),
                        about: None,
                        batch: Vec::new(),
                        orders: true,
                    });
                }
                // Out at once: other workers' transactions wait for this lock.
                self.submit_pending();
            }
        }
        self.next_turn = None;
        let skip_requested = !skip && self.skip_lsn == Some(b.final_lsn);
        if skip_requested {
            tracing::warn!(xid = b.xid, commit_lsn = %b.final_lsn, "skipping this source transaction as requested (pgapply skip)");
            // The group opened above (if any) records the skip when the commit arrives.
        }
        self.current = Some(SourceTransaction {
            xid: b.xid,
            final_lsn: b.final_lsn,
            commit_time: b.commit_time,
            skip: skip || skip_requested,
            skip_requested,
        });
        Ok(())
    }

    fn on_commit(&mut self, c: Commit) -> Result<()> {
        let txn = self.current.take().ok_or_else(|| {
            Error::definite(format!(
                "the source sent Commit {} without Begin; this is a protocol error",
                c.commit_lsn
            ))
        })?;
        if txn.skip_requested {
            self.skip_lsn = None;
            self.record_requested_skip(&txn, c.end_lsn, c.commit_time);
            return Ok(());
        }
        if txn.skip {
            return Ok(());
        }
        if let Some(group) = &mut self.group {
            group.last_commit = Some((c.end_lsn, c.commit_time));
            group.last_transaction = Some((txn.xid, txn.final_lsn));
            group.transactions += 1;
        }
        Ok(())
    }

    /// A transaction skipped with `pgapply skip`: its position is recorded (so it stays skipped),
    /// the request is cleared and the skip is logged in pgapply.conflicts, all in the group.
    fn record_requested_skip(&mut self, txn: &SourceTransaction, end_lsn: Lsn, time: PgTimestamp) {
        if self.group.is_none() {
            self.group = Some(Group {
                started: Instant::now(),
                check_before_commit: false,
                statements: 0,
                last_commit: None,
                last_transaction: None,
                transactions: 0,
                turn: None,
                relied_on: Vec::new(),
            });
            self.pending.push(Pending::plain(self.begin.clone()));
        }
        self.skip_records.push((txn.xid, txn.final_lsn, time));
        if let Some(group) = &mut self.group {
            group.last_commit = Some((end_lsn, time));
        }
    }

    fn in_transaction(&self, what: &str) -> Result<Option<(u32, Lsn, PgTimestamp)>> {
        match &self.current {
            None => Err(Error::definite(format!(
                "the source sent {what} outside a transaction; this is a protocol error"
            ))),
            Some(t) if t.skip => Ok(None),
            Some(t) => Ok(Some((t.xid, t.final_lsn, t.commit_time))),
        }
    }

    fn check_width(entry: &RelationEntry, tuple: &Tuple) -> Result<()> {
        if tuple.len() != entry.source.columns.len() {
            return Err(Error::definite(format!(
                "the source sent {} columns for table {}, but its Relation message described {}; this is a protocol error",
                tuple.len(),
                entry.display_name(),
                entry.source.columns.len()
            )));
        }
        Self::check_binary(entry, tuple)
    }

    /// Binary values (`--binary`) need the same type on both sides; the run checked that when it
    /// started, but a column's type may change on either side while it runs.
    fn check_binary(entry: &RelationEntry, tuple: &Tuple) -> Result<()> {
        if entry.type_differs.is_empty() {
            return Ok(());
        }
        let values: Vec<Value> = tuple.values().collect();
        let Some(&c) = entry
            .type_differs
            .iter()
            .find(|&&c| matches!(values.get(c), Some(Value::Binary(_))))
        else {
            return Ok(());
        };
        Err(Error::definite(format!(
            "column {} of table {} has type {} on the target, which the source's binary values (--binary) may not fit (the source's column has another type, or a user-defined one): start pgapply again (it then checks the types and receives text values where they differ)",
            quote_ident(&entry.source.columns[c].name),
            entry.display_name(),
            entry.target_column(c).map_or("?", |t| t.type_name.as_str())
        )))
    }

    async fn insert(&mut self, insert: Insert) -> Result<()> {
        let Some((xid, commit_lsn, commit_time)) = self.in_transaction("Insert")? else {
            return Ok(());
        };
        let entry = self.entry(insert.relation)?;
        Self::check_width(&entry, &insert.new)?;
        self.before_change(&entry).await?;
        let mut params = Vec::with_capacity(insert.new.len());
        for (i, value) in insert.new.values().enumerate() {
            params.push(WireValue::from_value(value).ok_or_else(|| {
                // PostgreSQL 15+ sends an UPDATE that moves a row into a row filter as an
                // INSERT, and a TOASTed value outside the replica identity is then "unchanged"
                // with nothing to take it from. Its own subscriber stores NULL; that would make
                // the target differ without a word.
                Error::definite(format!(
                    "the source sent an INSERT into {} without the value of column {} (an unchanged TOASTed value): an UPDATE moved the row into a publication's row filter, and the column is not part of the table's replica identity. On the source, run ALTER TABLE {} REPLICA IDENTITY FULL so that such rows come whole; for this row, copy it from the source to the target by hand; {}",
                    entry.display_name(),
                    quote_ident(&entry.source.columns[i].name),
                    entry.display_name(),
                    self.skip_hint(commit_lsn)
                ))
            })?);
        }
        let policy = self.policies_for(&entry).insert_exists;
        let mut arbiter = ColumnSet::default();
        let (on_conflict, signal) = match policy {
            Policy::Error => (OnConflict::Plain, None),
            Policy::Skip | Policy::KeepLocal => (OnConflict::InsertDoNothing, Some(0)),
            Policy::ApplyRemote => {
                if entry.key_columns.is_empty() {
                    return Err(Error::definite(format!(
                        "conflict policy insert_exists = \"apply_remote\" needs a replica identity key on table {}, which has none",
                        entry.display_name()
                    )));
                }
                if entry.source.replica_identity == ReplicaIdentity::Full {
                    // Every column is "key" under FULL: the row that exists is the one with the
                    // same values in the target's primary key (or first unique index).
                    let keys = self.target_unique_keys(&entry).await?;
                    let Some(key) = keys.first() else {
                        return Err(Error::definite(format!(
                            "conflict policy insert_exists = \"apply_remote\" on table {} (REPLICA IDENTITY FULL) needs a primary key or unique index on the target table {} over replicated columns, to tell which row an insert overwrites: add one, or use another policy for this table",
                            entry.display_name(),
                            entry.target.qualified
                        )));
                    };
                    for &c in key {
                        arbiter.insert(c);
                    }
                }
                (OnConflict::InsertOverwrite, Some(1))
            }
        };
        let shape = Shape {
            relation: entry.source.oid,
            generation: entry.generation,
            operation: Operation::Insert,
            unchanged: ColumnSet::default(),
            row_match: RowMatch::Key,
            on_conflict,
            rows: 1,
            arbiter,
        };
        self.unsettled_rows.inserts += 1;
        let guarded = self.policies_for(&entry).multiple_unique_conflicts != Policy::Error
            && on_conflict != OnConflict::InsertDoNothing;
        if on_conflict == OnConflict::Plain && !guarded {
            return self
                .batch_insert(
                    &entry,
                    shape,
                    params,
                    xid,
                    commit_lsn,
                    commit_time,
                    insert.new,
                )
                .await;
        }
        let about = ChangeInfo {
            relation: entry.clone(),
            operation: "INSERT",
            xid,
            commit_lsn,
            commit_time,
            key: None,
            remote: Some(insert.new),
            signal: signal.map(|when_rows| Signal {
                conflict: ConflictType::InsertExists,
                policy,
                when_rows,
            }),
            through: None,
        };
        if guarded {
            return self
                .apply_guarded(&entry, shape, params, about, ConflictType::InsertExists)
                .await;
        }
        self.queue(&entry, shape, params, about).await
    }

    /// Adds a row to the run of inserts into the same table by the same source transaction, sent
    /// as one multi-row INSERT; a different statement ends the run.
    #[allow(clippy::too_many_arguments)]
    async fn batch_insert(
        &mut self,
        entry: &Arc<RelationEntry>,
        shape: Shape,
        params: Vec<WireValue>,
        xid: u32,
        commit_lsn: Lsn,
        commit_time: PgTimestamp,
        row: Tuple,
    ) -> Result<()> {
        // A run continues across source transactions of the group unless batching is off for
        // them (after a failed batch).
        let across = self.batching_allowed(commit_lsn);
        let fits = self.insert_run.as_ref().is_some_and(|run| {
            run.shape == shape
                && (across || (run.about.xid == xid && run.about.commit_lsn == commit_lsn))
        });
        if !fits {
            self.flush_insert_run().await?;
            let columns = entry.source.columns.len().max(1);
            self.insert_run = Some(InsertRun {
                entry: entry.clone(),
                shape,
                params: Vec::with_capacity(params.len() * 8),
                rows: 0,
                limit: {
                    let mut limit = MAX_INSERT_ROWS;
                    while limit > 1 && limit * columns > 60_000 {
                        limit /= 2;
                    }
                    limit
                },
                about: ChangeInfo {
                    relation: entry.clone(),
                    operation: "INSERT",
                    xid,
                    commit_lsn,
                    commit_time,
                    key: None,
                    remote: Some(row),
                    signal: None,
                    through: None,
                },
                last_commit: commit_lsn,
            });
        }
        let full = match &mut self.insert_run {
            Some(run) => {
                run.last_commit = commit_lsn;
                run.params.extend(params);
                run.rows += 1;
                run.rows >= run.limit
            }
            None => false,
        };
        if full {
            self.flush_insert_run().await?;
        }
        Ok(())
    }

    /// Queues the open run of inserts as one statement.
    async fn flush_insert_run(&mut self) -> Result<()> {
        let Some(run) = self.insert_run.take() else {
            return Ok(());
        };
        let mut about = run.about;
        if run.last_commit != about.commit_lsn {
            about.through = Some(run.last_commit);
        }
        if let Some(g) = &mut self.group {
            g.statements += run.rows;
        }
        self.prepare_insert_sizes(&run.entry, &run.shape, run.limit)
            .await?;
        let columns = run.params.len() / run.rows.max(1);
        let mut params = run.params.into_iter();
        let mut left = run.rows;
        while left > 0 {
            let mut rows = run.limit;
            while rows > left {
                rows /= 2;
            }
            left -= rows;
            let mut shape = run.shape.clone();
            shape.rows = rows;
            let statement = self.statement(&run.entry, shape).await?;
            self.push_pending(Pending {
                request: Request::Prepared(statement),
                params: params.by_ref().take(rows * columns).collect(),
                about: Some(about.clone()),
                batch: Vec::new(),
                orders: false,
            })
            .await?;
        }
        Ok(())
    }

    /// Prepares the multi-row INSERTs of every size a run of this shape can be sent in, together
    /// (one round trip instead of one per size).
    async fn prepare_insert_sizes(
        &mut self,
        entry: &RelationEntry,
        shape: &Shape,
        limit: usize,
    ) -> Result<()> {
        let mut missing = Vec::new();
        let mut size = 1;
        while size <= limit {
            let mut sized = shape.clone();
            sized.rows = size;
            if !self.statements.contains_key(&sized) {
                missing.push(sized);
            }
            size *= 2;
        }
        if missing.len() < 2 {
            return Ok(());
        }
        let prepared = futures_util::future::join_all(missing.iter().map(|sized| {
            let sql = build_sql(entry, sized);
            let client = self.client.clone();
            async move { client.prepare(&sql).await }
        }))
        .await;
        let mut failed = None;
        for (sized, result) in missing.into_iter().zip(prepared) {
            match result {
                Ok(statement) => {
                    self.remember_statement(sized, statement);
                }
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            None => self.check_prepared_types(entry).await,
            // A failed Parse aborts the open transaction: say why, not "transaction aborted".
            Some(e) => {
                let what = format!("a multi-row INSERT into table {}", entry.target.qualified);
                self.prepare_failed(&what, &entry.target.qualified, e).await
            }
        }
    }

    /// The conflict policies of a relation (looked up once per relation and policy reload).
    fn policies_for(&mut self, entry: &RelationEntry) -> super::conflict::Policies {
        let key = (entry.source.oid, entry.generation);
        if let Some(p) = self.policy_cache.get(&key) {
            return *p;
        }
        let schema = if entry.source.namespace.is_empty() {
            "pg_catalog"
        } else {
            &entry.source.namespace
        };
        let policies = self.policies.for_table(schema, &entry.source.name);
        self.policy_cache.insert(key, policies);
        policies
    }

    /// Values that find the old row, and how to match them.
    fn row_match(
        &self,
        entry: &RelationEntry,
        old: Option<&OldRow>,
        new: &Tuple,
        params: &mut Vec<WireValue>,
    ) -> Result<(RowMatch, Vec<Value>)> {
        match old {
            Some(OldRow::Full(tuple)) => {
                Self::check_width(entry, tuple)?;
                let values: Vec<Value> = tuple.values().collect();
                // PostgreSQL sends a FULL old row whole; one with nothing to match by would
                // find any row of the table.
                if !values.is_empty() && values.iter().all(|v| matches!(v, Value::UnchangedToast)) {
                    return Err(Error::definite(format!(
                        "the source sent the old row of a change to table {} (REPLICA IDENTITY FULL) with every value marked unchanged: there is nothing to find the row by; this is a protocol error",
                        entry.display_name()
                    )));
                }
                let mut nulls = ColumnSet::default();
                let mut skipped = ColumnSet::default();
                for (i, v) in values.iter().enumerate() {
                    match v {
                        Value::Null => nulls.insert(i),
                        Value::UnchangedToast => skipped.insert(i),
                        Value::Text(b) => params.push(WireValue::Text(b.clone())),
                        Value::Binary(b) => params.push(WireValue::Binary(b.clone())),
                    }
                }
                let as_text = self.full_as_text.contains(&entry.source.oid);
                Ok((
                    RowMatch::Full {
                        nulls,
                        skipped,
                        as_text,
                    },
                    values,
                ))
            }
            Some(OldRow::Key(tuple)) => {
                Self::check_width(entry, tuple)?;
                self.key_values(entry, tuple, params)
            }
            None => self.key_values(entry, new, params),
        }
    }

    fn key_values(
        &self,
        entry: &RelationEntry,
        tuple: &Tuple,
        params: &mut Vec<WireValue>,
    ) -> Result<(RowMatch, Vec<Value>)> {
        if entry.key_columns.is_empty() {
            return Err(Error::definite(format!(
                "table {} has no replica identity key on the source, so an UPDATE or DELETE cannot find its row on the target: give it a primary key or set REPLICA IDENTITY FULL (or USING INDEX) on the source",
                entry.display_name()
            )));
        }
        let values: Vec<Value> = tuple.values().collect();
        for &k in &entry.key_columns {
            match values.get(k) {
                Some(Value::Text(b)) => params.push(WireValue::Text(b.clone())),
                Some(Value::Binary(b)) => params.push(WireValue::Binary(b.clone())),
                _ => {
                    return Err(Error::definite(format!(
                        "the source sent no value for key column {} of table {}; this is a protocol error",
                        quote_ident(&entry.source.columns[k].name),
                        entry.display_name()
                    )))
                }
            }
        }
        Ok((RowMatch::Key, values))
    }

    async fn update(&mut self, update: Update) -> Result<()> {
        let Some((xid, commit_lsn, commit_time)) = self.in_transaction("Update")? else {
            return Ok(());
        };
        let entry = self.entry(update.relation)?;
        Self::check_width(&entry, &update.new)?;
        let policies = self.policies_for(&entry);
        // The common case first: an update that keeps its key, held for a batched statement.
        if update.old.is_none()
            && !entry.key_columns.is_empty()
            && !identity_outside_key(&entry)
            && policies.update_missing == Policy::Skip
            && policies.update_exists == Policy::Error
            && policies.multiple_unique_conflicts == Policy::Error
            && self.may_batch(&entry, commit_lsn).await?
        {
            // Held for a while: a copy, so as not to keep the receive buffer alive.
            let new = update.new.detached();
            let values: Vec<Option<WireValue>> = new.values().map(WireValue::from_value).collect();
            if values.iter().all(Option::is_none) {
                return Ok(());
            }
            for &k in &entry.key_columns {
                if !matches!(
                    values.get(k),
                    Some(Some(WireValue::Text(_) | WireValue::Binary(_)))
                ) {
                    return Err(Error::definite(format!(
                        "the source sent no value for key column {} of table {}; this is a protocol error",
                        quote_ident(&entry.source.columns[k].name),
                        entry.display_name()
                    )));
                }
            }
            // Only the key and unchanged TOAST values: nothing to write (and `SET key = key`
            // would fail on a GENERATED ALWAYS identity key). Unlike the unbatched path, a row
            // missing on the target goes unnoticed then: the update changed nothing published.
            let writes_something = values
                .iter()
                .enumerate()
                .any(|(i, v)| v.is_some() && !entry.key_columns.contains(&i));
            if !writes_something {
                return Ok(());
            }
            self.unsettled_rows.updates += 1;
            let about = HeldChange {
                relation: entry.clone(),
                xid,
                commit_lsn,
                commit_time,
                new,
            };
            return self.hold_update(&entry, values, about).await;
        }
        self.before_change(&entry).await?;
        let mut params = Vec::with_capacity(update.new.len() * 2);
        let mut unchanged = identity_kept(&entry, &update);
        for (i, value) in update.new.values().enumerate() {
            if unchanged.contains(i) {
                continue;
            }
            match WireValue::from_value(value) {
                Some(v) => params.push(v),
                None => unchanged.insert(i),
            }
        }
        if params.is_empty() {
            // Every column is an unchanged TOAST value: nothing to write.
            return Ok(());
        }
        let (row_match, old_values) =
            self.row_match(&entry, update.old.as_ref(), &update.new, &mut params)?;
        let policy = policies.update_missing;
        let guarded = (policies.update_exists != Policy::Error
            || policies.multiple_unique_conflicts != Policy::Error)
            && row_match == RowMatch::Key;
        // The missing row can be inserted only when the new row is complete: no unchanged TOAST
        // value, and no identity column left out of the SET unless it is a key column (the
        // INSERT takes it from the key that finds the row).
        let complete = (0..update.new.len())
            .all(|c| !unchanged.contains(c) || entry.key_columns.contains(&c))
            && (unchanged.is_empty() || row_match == RowMatch::Key);
        let (on_conflict, signal) = match policy {
            Policy::ApplyRemote if complete => {
                (OnConflict::UpdateOrInsert, (Policy::ApplyRemote, 1))
            }
            Policy::ApplyRemote => (OnConflict::Plain, (Policy::Skip, 0)),
            other => (OnConflict::Plain, (other, 0)),
        };
        let shape = Shape {
            relation: entry.source.oid,
            generation: entry.generation,
            operation: Operation::Update,
            unchanged,
            row_match: row_match.clone(),
            on_conflict,
            rows: 1,
            arbiter: ColumnSet::default(),
        };
        self.unsettled_rows.updates += 1;
        let about = ChangeInfo {
            relation: entry.clone(),
            operation: "UPDATE",
            xid,
            commit_lsn,
            commit_time,
            key: Some((row_match, old_values)),
            remote: Some(update.new),
            signal: Some(Signal {
                conflict: ConflictType::UpdateMissing,
                policy: signal.0,
                when_rows: signal.1,
            }),
            through: None,
        };
        if guarded {
            return self
                .apply_guarded(&entry, shape, params, about, ConflictType::UpdateExists)
                .await;
        }
        self.queue(&entry, shape, params, about).await
    }

    /// Whether an UPDATE of this relation, in the source transaction committing at `commit_lsn`,
    /// may be held back and batched (`apply::batch`).
    async fn may_batch(&mut self, entry: &Arc<RelationEntry>, commit_lsn: Lsn) -> Result<bool> {
        if !self.batching_allowed(commit_lsn) {
            return Ok(false);
        }
        let key = (entry.source.oid, entry.generation);
        if let Some(known) = self.batchable.get(&key) {
            return Ok(known.is_some());
        }
        let fingerprint = super::batch::independent(&self.catalog, entry)
            .await?
            .map(Arc::from);
        let batchable = fingerprint.is_some();
        tracing::debug!(table = %entry.target.qualified, batchable, "updates batched within a group");
        self.batchable.insert(key, fingerprint);
        Ok(batchable)
    }

    /// Whether the source transaction committing at `commit_lsn` is among those of a failed
    /// group that are applied again one at a time (`retry_unbatched`).
    fn one_at_a_time(&self, commit_lsn: Lsn) -> bool {
        commit_lsn.0
            <= self
                .settings
                .unbatched_through
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether changes of the source transaction committing at `commit_lsn` may share statements
    /// with other transactions' changes.
    fn batching_allowed(&self, commit_lsn: Lsn) -> bool {
        self.settings.batch_updates && !self.one_at_a_time(commit_lsn)
    }

    /// Holds an UPDATE until another change to its table, or the end of the group, sends it.
    async fn hold_update(
        &mut self,
        entry: &Arc<RelationEntry>,
        values: Vec<Option<WireValue>>,
        about: HeldChange,
    ) -> Result<()> {
        let held_for_other = self.held_updates.get(&entry.target.oid).is_some_and(|b| {
            b.entry.source.oid != entry.source.oid || b.entry.generation != entry.generation
        });
        if held_for_other {
            self.flush_held_updates(Some(entry.target.oid)).await?;
        }
        let batch = self
            .held_updates
            .entry(entry.target.oid)
            .or_insert_with(|| UpdateBatch::new(entry.clone()));
        let before = batch.len();
        batch.add(values, about);
        self.held_rows += batch.len() - before;
        if let Some(g) = &mut self.group {
            g.statements += 1;
        }
        if self.held_rows >= MAX_HELD_ROWS {
            self.flush_held_updates(None).await?;
        }
        Ok(())
    }

    /// Queues the held UPDATEs of one target table (or of all) as batched statements.
    async fn flush_held_updates(&mut self, target_table: Option<Oid>) -> Result<()> {
        if self.held_updates.is_empty() {
            return Ok(());
        }
        let batches: Vec<UpdateBatch<HeldChange>> = match target_table {
            Some(oid) => self.held_updates.remove(&oid).into_iter().collect(),
            None => self.held_updates.drain().map(|(_, b)| b).collect(),
        };
        if batches.is_empty() {
            return Ok(());
        }
        // Inserts queued before these updates go first.
        self.flush_insert_run().await?;
        for batch in batches {
            self.held_rows -= batch.len().min(self.held_rows);
            let entry = batch.entry.clone();
            self.check_batching(&entry);
            for chunk in batch.into_chunks() {
                let statement = self
                    .batch_statement(&entry, chunk.unchanged, chunk.about.len())
                    .await?;
                self.push_pending(Pending {
                    request: Request::Prepared(statement),
                    params: chunk.params,
                    about: None,
                    batch: chunk.about,
                    orders: false,
                })
                .await?;
            }
        }
        Ok(())
    }

    /// Before a change to `entry`'s table: its own held updates go first; so do all the others
    /// if a trigger or rule of this table could read their tables (`apply::batch::quiet`).
    async fn before_change(&mut self, entry: &Arc<RelationEntry>) -> Result<()> {
        let others_held = self.held_updates.keys().any(|&oid| oid != entry.target.oid);
        if !others_held {
            return self.flush_held_updates(Some(entry.target.oid)).await;
        }
        let key = (entry.source.oid, entry.generation);
        let quiet = match self.quiet.get(&key) {
            Some(known) => known.clone(),
            None => {
                let fingerprint = super::batch::quiet(&self.catalog, entry)
                    .await?
                    .map(Arc::<str>::from);
                self.quiet.insert(key, fingerprint.clone());
                fingerprint
            }
        };
        match quiet {
            Some(fingerprint) => {
                self.check_unchanged(entry, fingerprint);
                self.flush_held_updates(Some(entry.target.oid)).await
            }
            None => self.flush_held_updates(None).await,
        }
    }

    /// Has the target check, before the group commits, that what made the table's updates
    /// batchable still holds (`apply::batch`): else the group fails and is applied again one
    /// change at a time.
    fn check_batching(&mut self, entry: &RelationEntry) {
        let Some(Some(fingerprint)) = self
            .batchable
            .get(&(entry.source.oid, entry.generation))
            .cloned()
        else {
            return;
        };
        self.check_unchanged(entry, fingerprint);
    }

    /// Has the target check, before the group commits, that the table is as `fingerprint` says
    /// it was read (`pgapply.check_group`): else the group fails and is applied again one change
    /// at a time.
    fn check_unchanged(&mut self, entry: &RelationEntry, fingerprint: Arc<str>) {
        let Some(group) = &mut self.group else {
            return;
        };
        if group
            .relied_on
            .iter()
            .any(|(oid, _)| *oid == entry.target.oid)
        {
            return;
        }
        group.relied_on.push((entry.target.oid, fingerprint));
    }

    /// The prepared statement for a batch of `rows` UPDATEs, preparing it the first time.
    async fn batch_statement(
        &mut self,
        entry: &RelationEntry,
        unchanged: ColumnSet,
        rows: usize,
    ) -> Result<Statement> {
        let shape = Shape {
            relation: entry.source.oid,
            generation: entry.generation,
            operation: Operation::UpdateBatch,
            unchanged,
            row_match: RowMatch::Key,
            on_conflict: OnConflict::Plain,
            rows,
            arbiter: ColumnSet::default(),
        };
        if let Some(s) = self.statements.get(&shape) {
            return Ok(s.clone());
        }
        // Every size this table's batches can take, prepared together: one round trip.
        let mut sizes = vec![rows];
        let mut size = 1;
        while size <= super::batch::row_limit(entry.source.columns.len()) {
            let mut other = shape.clone();
            other.rows = size;
            if size != rows && !self.statements.contains_key(&other) {
                sizes.push(size);
            }
            size *= 2;
        }
        let prepared = futures_util::future::join_all(sizes.iter().map(|&n| {
            let sql = super::batch::batch_sql(entry, &shape.unchanged, n);
            let types = super::batch::param_types(entry, &shape.unchanged, n);
            let client = self.client.clone();
            async move { client.prepare_typed(&sql, &types).await }
        }))
        .await;
        let mut prepared = sizes.into_iter().zip(prepared);
        let wanted = prepared.next().map(|(_, r)| r);
        let mut other_failed = None;
        for (n, result) in prepared {
            match result {
                Ok(statement) => {
                    let mut other = shape.clone();
                    other.rows = n;
                    self.remember_statement(other, statement);
                }
                // A failed Parse aborts the open transaction: report it rather than a later
                // "transaction aborted".
                Err(e) => other_failed = other_failed.or(Some(e)),
            }
        }
        let wanted = match wanted {
            Some(result) => result,
            None => {
                self.client
                    .prepare_typed(
                        &super::batch::batch_sql(entry, &shape.unchanged, rows),
                        &super::batch::param_types(entry, &shape.unchanged, rows),
                    )
                    .await
            }
        };
        let wanted = match (wanted, other_failed) {
            (Ok(_), Some(e)) => Err(e),
            (wanted, _) => wanted,
        };
        let statement = match wanted {
            Ok(s) => s,
            Err(e) => {
                let what = format!("a batched UPDATE of table {}", entry.target.qualified);
                return self.prepare_failed(&what, &entry.target.qualified, e).await;
            }
        };
        self.remember_statement(shape, statement.clone());
        Ok(statement)
    }

    /// Applies one change inside a savepoint, after everything queued before it has run and been
    /// checked, so that a unique violation can be rolled back and settled by the update_exists /
    /// multiple_unique_conflicts policies instead of failing the group. A round trip per change:
    /// only tables whose policies ask for it come here.
    async fn apply_guarded(
        &mut self,
        entry: &Arc<RelationEntry>,
        shape: Shape,
        params: Vec<WireValue>,
        about: ChangeInfo,
        base: ConflictType,
    ) -> Result<()> {
        let statement = self.statement(entry, shape).await?;
        if let Some(g) = &mut self.group {
            g.statements += 1;
        }
        self.send_pipeline().await?;
        self.run_in_group("SAVEPOINT pgapply_guard").await?;
        let violation = match self.client.execute_raw(&statement, params.iter()).await {
            Err(e) if e.code().is_some_and(|c| c.code() == "23505") => e,
            other => {
                self.check_result(Some(about), other);
                self.fail_if_failed().await?;
                return self.run_in_group("RELEASE SAVEPOINT pgapply_guard").await;
            }
        };
        self.run_in_group("ROLLBACK TO SAVEPOINT pgapply_guard")
            .await?;
        let clashing = match self.find_clashing(entry, &about).await {
            Ok(rows) => rows,
            Err(e) => {
                self.failure = Some(e);
                return self.fail_if_failed().await;
            }
        };
        let conflict = if super::unique::indexes_violated(&clashing) > 1 {
            ConflictType::MultipleUniqueConflicts
        } else {
            base
        };
        let policy = self.policies_for(entry).get(conflict);
        if clashing.is_empty() || policy == Policy::Error {
            self.failure = Some(self.violation_error(conflict.name(), Some(&about), violation));
            return self.fail_if_failed().await;
        }
        let signal = Signal {
            conflict,
            policy,
            when_rows: 0,
        };
        let mut record = conflict_record(&about, signal);
        record.local_row = super::unique::rows_json(&clashing);
        record.log.rows = Some(clashing.len());
        if policy == Policy::ApplyRemote {
            if let Err(e) = super::unique::delete_rows(&self.client, entry, &clashing).await {
                self.failure = Some(e);
                return self.fail_if_failed().await;
            }
            let again = self.client.execute_raw(&statement, params.iter()).await;
            self.check_result(Some(about), again);
            self.fail_if_failed().await?;
        }
        self.conflicts.push(record);
        self.run_in_group("RELEASE SAVEPOINT pgapply_guard").await
    }

    /// The target table's simple unique indexes (primary key first), as source columns; read
    /// once per relation generation.
    async fn target_unique_keys(
        &mut self,
        entry: &Arc<RelationEntry>,
    ) -> Result<Arc<Vec<Vec<usize>>>> {
        let cache_key = (entry.source.oid, entry.generation);
        if let Some(k) = self.unique_keys.get(&cache_key) {
            return Ok(k.clone());
        }
        // (On the catalog session: the apply session's transaction may already have failed.)
        let k = Arc::new(super::unique::unique_keys(&self.catalog, entry).await?);
        self.unique_keys.insert(cache_key, k.clone());
        Ok(k)
    }

    /// The target rows a change's unique values clash with.
    async fn find_clashing(
        &mut self,
        entry: &Arc<RelationEntry>,
        about: &ChangeInfo,
    ) -> Result<Vec<super::unique::ClashingRow>> {
        let keys = self.target_unique_keys(entry).await?;
        let Some(new) = &about.remote else {
            return Ok(Vec::new());
        };
        let own = match &about.key {
            Some((RowMatch::Key, values)) => Some(values.as_slice()),
            _ => None,
        };
        super::unique::clashing_rows(&self.client, entry, &keys, new, own).await
    }

    /// Runs a statement of the open target transaction now; a failure ends the group.
    async fn run_in_group(&mut self, sql: &str) -> Result<()> {
        if let Err(e) = self.client.batch_execute(sql).await {
            self.failure = Some(Error::postgres(format!("running {sql} on the target"), e));
            return self.fail_if_failed().await;
        }
        Ok(())
    }

    async fn delete(&mut self, delete: Delete) -> Result<()> {
        let Some((xid, commit_lsn, commit_time)) = self.in_transaction("Delete")? else {
            return Ok(());
        };
        let entry = self.entry(delete.relation)?;
        Self::check_binary(&entry, delete.old.tuple())?;
        self.before_change(&entry).await?;
        let mut params = Vec::new();
        let old = delete.old;
        let (row_match, old_values) =
            self.row_match(&entry, Some(&old), old.tuple(), &mut params)?;
        let shape = Shape {
            relation: entry.source.oid,
            generation: entry.generation,
            operation: Operation::Delete,
            unchanged: ColumnSet::default(),
            row_match: row_match.clone(),
            on_conflict: OnConflict::Plain,
            rows: 1,
            arbiter: ColumnSet::default(),
        };
        self.unsettled_rows.deletes += 1;
        let about = ChangeInfo {
            relation: entry.clone(),
            operation: "DELETE",
            xid,
            commit_lsn,
            commit_time,
            key: Some((row_match, old_values)),
            remote: None,
            signal: Some(Signal {
                conflict: ConflictType::DeleteMissing,
                policy: self.policies_for(&entry).delete_missing,
                when_rows: 0,
            }),
            through: None,
        };
        self.queue(&entry, shape, params, about).await
    }

    async fn truncate(&mut self, truncate: Truncate) -> Result<()> {
        let Some((xid, commit_lsn, commit_time)) = self.in_transaction("Truncate")? else {
            return Ok(());
        };
        self.flush_held_updates(None).await?;
        let mut tables = Vec::new();
        let mut names = Vec::new();
        let mut first_entry = None;
        // (Each table once: the list comes from the network, and a repeated OID would only
        // make the statement longer.)
        let mut seen = std::collections::HashSet::new();
        for oid in &truncate.relations {
            if !seen.insert(*oid) {
                continue;
            }
            let entry = self.entry(*oid)?;
            tables.push(entry.target.qualified.clone());
            first_entry.get_or_insert_with(|| entry.clone());
            // Each table the source truncated is listed: an inheritance child too, if it was.
            names.push(format!(
                "{}{}",
                super::statement::only(&entry),
                entry.target.qualified
            ));
        }
        let mut sql = format!("TRUNCATE {}", names.join(", "));
        if truncate.restart_identity() {
            sql.push_str(" RESTART IDENTITY");
        }
        // CASCADE is not passed on: the message already lists every published table the
        // source's cascade reached, so on the target it could only reach tables the source never
        // truncated (target-only tables, or ones filled from elsewhere). PostgreSQL's own
        // subscriber does the same. A target foreign key from a table not listed then stops the
        // apply with what to do (`violation_error`).
        // A failed Parse (or one in a transaction an earlier statement failed): the reason
        // comes from `prepare_failed`, not "transaction aborted".
        let statement = match self.client.prepare(&sql).await {
            Ok(s) => s,
            Err(e) => {
                let what = format!("TRUNCATE of {}", tables.join(", "));
                let first = tables.first().cloned().unwrap_or_default();
                return self.prepare_failed(&what, &first, e).await;
            }
        };
        tracing::debug!(xid, commit_lsn = %commit_lsn, commit_time = %commit_time.to_rfc3339(), tables = %tables.join(", "), "truncate");
        self.unsettled_rows.truncates += 1;
        let about = first_entry.map(|relation| ChangeInfo {
            relation,
            operation: "TRUNCATE",
            xid,
            commit_lsn,
            commit_time,
            key: None,
            remote: None,
            signal: None,
            through: None,
        });
        self.push(Pending {
            request: Request::Prepared(statement),
            params: Vec::new(),
            about,
            batch: Vec::new(),
            orders: false,
        })
        .await
    }

    async fn queue(
        &mut self,
        entry: &Arc<RelationEntry>,
        shape: Shape,
        params: Vec<WireValue>,
        about: ChangeInfo,
    ) -> Result<()> {
        let statement = self.statement(entry, shape).await?;
        if about.signal.is_some_and(|s| s.policy == Policy::Error) {
            if let Some(g) = &mut self.group {
                g.check_before_commit = true;
            }
        }
        self.push(Pending {
            request: Request::Prepared(statement),
            params,
            about: Some(about),
            batch: Vec::new(),
            orders: false,
        })
        .await
    }

    async fn push(&mut self, pending: Pending) -> Result<()> {
        self.flush_insert_run().await?;
        if let Some(g) = &mut self.group {
            g.statements += 1;
        }
        self.push_pending(pending).await
    }

    /// Queues a statement, handing the queue to the connection when it is long enough.
    async fn push_pending(&mut self, pending: Pending) -> Result<()> {
        self.pending.push(pending);
        if self.pending.len() >= SUBMIT_CHUNK {
            self.submit_pending();
            if self.in_flight_values >= self.settings.pipeline_values {
                self.drain_values_to(self.settings.pipeline_values / 2)
                    .await;
            }
            self.fail_if_failed().await?;
        }
        Ok(())
    }

    /// Keeps a prepared statement for its shape. The shapes a process meets are many in some
    /// workloads (under REPLICA IDENTITY FULL each pattern of NULLs is one, each set of unchanged
    /// TOAST columns eight batch sizes, each relation change a new generation): past a bound the
    /// cache starts afresh, and what is still used is prepared again. (A statement still in the
    /// pipeline keeps its own handle; the server forgets it when the last handle goes.)
    fn remember_statement(&mut self, shape: Shape, statement: Statement) {
        if self.statements.len() >= MAX_STATEMENTS {
            tracing::debug!(
                statements = self.statements.len(),
                "prepared statement cache full: starting it afresh"
            );
            self.statements.clear();
        }
        self.statements.insert(shape, statement);
    }

    /// The prepared statement for a shape, preparing it the first time.
    async fn statement(&mut self, entry: &RelationEntry, mut shape: Shape) -> Result<Statement> {
        if let Some(s) = self.statements.get(&shape) {
            return Ok(s.clone());
        }
        let sql = build_sql(entry, &shape);
        let statement = match self.client.prepare(&sql).await {
            Ok(s) => s,
            // A type without an equality operator under REPLICA IDENTITY FULL: compare as text.
            Err(e)
                if e.code().is_some_and(|c| c.code() == "42883")
                    && matches!(shape.row_match, RowMatch::Full { as_text: false, .. }) =>
            {
                tracing::info!(table = %entry.target.qualified, "a column type has no equality operator; matching REPLICA IDENTITY FULL rows by their text form");
                self.full_as_text.insert(entry.source.oid);
                if let Ok(mut known) = FULL_AS_TEXT.lock() {
                    known.insert(entry.source.oid);
                }
                if let RowMatch::Full { as_text, .. } = &mut shape.row_match {
                    *as_text = true;
                }
                let sql = build_sql(entry, &shape);
                match self.client.prepare(&sql).await {
                    Ok(s) => s,
                    // The group's transaction was open on the target, and the failed statement
                    // aborted it: the run starts again (FULL_AS_TEXT keeps what was learnt).
                    Err(e) if e.code().is_some_and(|c| c.code() == "25P02") => {
                        return Err(Error::transient(format!(
                            "table {}: a column type has no equality operator, which aborted the open target transaction; applying again, comparing REPLICA IDENTITY FULL rows by their text form",
                            entry.target.qualified
                        )));
                    }
                    Err(e) => {
                        return Err(Error::postgres(
                            format!(
                                "preparing a statement for table {} on the target",
                                entry.target.qualified
                            ),
                            e,
                        ))
                    }
                }
            }
            Err(e) => {
                let what = format!("a statement for table {}", entry.target.qualified);
                return self.prepare_failed(&what, &entry.target.qualified, e).await;
            }
        };
        self.check_prepared_types(entry).await?;
        self.remember_statement(shape, statement.clone());
        Ok(statement)
    }

    /// After preparing statements for `entry`: their parameters took the target's column types as
    /// they are now, while binary values (`--binary`) come in the types the run started with.
    /// A column whose type changed since would have the source's bytes read as the new type, so
    /// the run starts again and reads the table anew (and receives text where types differ). (A
    /// column changed after the prepare is fine: the server then casts from the prepared type.)
    async fn check_prepared_types(&self, entry: &RelationEntry) -> Result<()> {
        if !self.binary_values {
            return Ok(());
        }
        match crate::relation::target_changed(&self.catalog, entry).await? {
            None => Ok(()),
            Some(change) => Err(Error::transient(format!(
                "target table {} changed while pgapply ran ({change}), and values arrive in binary form (--binary): applying again from the last committed position, with the table read anew",
                entry.target.qualified
            ))),
        }
    }

    /// A statement could not be prepared. An earlier statement of the group may have failed (this
    /// one then fails with "transaction aborted"): that earlier failure is the one to report.
    async fn prepare_failed<T>(
        &mut self,
        what: &str,
        table: &str,
        e: tokio_postgres::Error,
    ) -> Result<T> {
        self.drain_to(0).await;
        self.fail_if_failed().await?;
        let hint = e.code().and_then(|c| target_table_hint(c.code(), table));
        let err = Error::postgres(format!("preparing {what} on the target"), e);
        Err(match hint {
            Some(hint) => err.context_after(hint),
            None => err,
        })
    }

    /// Hands the queued statements to the connection without waiting for their results, so the
    /// target executes them while the next ones are being built.
    fn submit_pending(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for pending in pending {
            let client = self.client.clone();
            let Pending {
                request,
                params,
                about,
                batch,
                orders,
            } = pending;
            self.in_flight_sizes.push_back(params.len());
            self.in_flight_values += params.len();
            self.submitted += 1;
            let statement = match request {
                Request::Prepared(statement) => statement,
                Request::Simple(sql) => {
                    self.in_flight_mut().push_back(Box::pin(async move {
                        let result = client.batch_execute(&sql).await.map(|()| 0);
                        Outcome::One(about, result)
                    }));
                    continue;
                }
            };
            if orders {
                self.in_flight_mut().push_back(Box::pin(async move {
                    let result = client.execute_raw(&statement, params.iter()).await;
                    Outcome::Order(result)
                }));
            } else if batch.is_empty() {
                self.in_flight_mut().push_back(Box::pin(async move {
                    let result = client.execute_raw(&statement, params.iter()).await;
                    Outcome::One(about, result)
                }));
            } else {
                self.in_flight_mut().push_back(Box::pin(async move {
                    let result = async {
                        let rows = client.query_raw(&statement, params.iter()).await?;
                        futures_util::pin_mut!(rows);
                        let mut missing = Vec::new();
                        while let Some(row) = rows.next().await {
                            missing.push(row?.try_get::<_, i32>(0)?);
                        }
                        Ok(missing)
                    }
                    .await;
                    Outcome::Batch(batch, result)
                }));
            }
        }
        // tokio-postgres sends a request when its future is first polled; poll now, in order.
        let mut cx = std::task::Context::from_waker(futures_util::task::noop_waker_ref());
        while let std::task::Poll::Ready(Some(outcome)) =
            self.in_flight_mut().poll_next_unpin(&mut cx)
        {
            self.check_outcome(outcome);
        }
    }

    fn in_flight_mut(&mut self) -> &mut futures_util::stream::FuturesOrdered<InFlight> {
        self.in_flight
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A parallel worker stops waiting for answers once one failed: later statements may wait on
    /// the server for transactions that will not commit now (`fail_if_failed` ends it).
    fn worker_failed(&self) -> bool {
        self.worker.is_some() && self.failure.is_some()
    }

    /// Waits until at most `keep` parameter values are still in flight.
    async fn drain_values_to(&mut self, keep: usize) {
        while self.in_flight_values > keep && !self.worker_failed() {
            match self.in_flight_mut().next().await {
                Some(outcome) => self.check_outcome(outcome),
                None => break,
            }
        }
    }

    /// Waits until at most `keep` statements are still in flight.
    async fn drain_to(&mut self, keep: usize) {
        while self.in_flight_mut().len() > keep && !self.worker_failed() {
            match self.in_flight_mut().next().await {
                Some(outcome) => self.check_outcome(outcome),
                None => break,
            }
        }
    }

    fn check_outcome(&mut self, outcome: Outcome) {
        let values = self.in_flight_sizes.pop_front().unwrap_or(0);
        self.in_flight_values -= values.min(self.in_flight_values);
        self.completed += 1;
        self.check_outcome_of(outcome);
        // A COMMIT answered with nothing failed before it: that group is committed. (After a
        // failed statement the server answers COMMIT with a rollback, and `failure` is set.)
        while self
            .committing
            .front()
            .is_some_and(|c| c.seq <= self.completed && self.failure.is_none())
        {
            if let Some(mut c) = self.committing.pop_front() {
                // Answers come in order: every conflict noted so far was met by this group (or
                // an earlier one), all committed now.
                c.conflicts = std::mem::take(&mut self.conflicts);
                self.committed.push(c);
            }
        }
    }

    fn check_outcome_of(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::One(about, result) => self.check_result(about, result),
            Outcome::Order(Ok(_)) => {}
            // A deadlock here (rows the dispatcher could not see made two transactions wait for
            // each other) is transient: the retry applies them one at a time.
            Outcome::Order(Err(e)) => {
                if self.failure.is_none() {
                    self.failure = Some(Error::postgres(
                        "keeping parallel apply workers in commit order",
                        e,
                    ));
                }
            }
            Outcome::Batch(rows, Ok(missing)) => {
                let mut rows: Vec<Option<HeldChange>> = rows.into_iter().map(Some).collect();
                for r in missing {
                    let held = usize::try_from(r)
                        .ok()
                        .and_then(|r| rows.get_mut(r)?.take());
                    if let Some(held) = held {
                        self.check_result(Some(held.into_change_info()), Ok(0));
                    }
                }
            }
            Outcome::Batch(rows, Err(e)) => {
                if self.failure.is_some() {
                    return;
                }
                let first = rows.first();
                let table = first.map_or_else(String::new, |a| a.relation.target.qualified.clone());
                // "Current transaction is aborted": an earlier statement failed; that failure
                // is the one to report.
                let aborted = e.code().is_some_and(|c| c.code() == "25P02");
                let err = Error::postgres(
                    format!("applying {} batched UPDATEs of table {table}", rows.len()),
                    e,
                );
                if err.is_transient() || aborted {
                    self.failure = Some(err);
                    return;
                }
                let through = rows.iter().map(|a| a.commit_lsn).max();
                self.retry_unbatched(err, through);
            }
        }
    }

    /// Fails the run for the source transaction committing at `commit_lsn`. A parallel worker's
    /// transaction ran beside others on what the dispatcher could see of its rows; what it could
    /// not see (a unique index added on the target, keys equal under the target's collation but
    /// not in bytes) may have run it before an earlier one it needed: the first time, the
    /// transactions in flight are applied again one at a time, and only an error then is the
    /// transaction's own.
    fn fail(&mut self, err: Error, commit_lsn: Lsn) {
        let ran_in_parallel = self.worker.is_some() && !self.one_at_a_time(commit_lsn);
        if ran_in_parallel && !err.is_transient() {
            self.retry_unbatched(err, Some(commit_lsn));
        } else {
            self.failure = Some(err);
        }
    }

    /// A statement carrying changes of several source transactions failed: applies them again
    /// one change at a time (after a reconnect), so that the error names the transaction that
    /// causes it.
    fn retry_unbatched(&mut self, err: Error, through: Option<Lsn>) {
        let through = self.unbatch(through);
        self.failure = Some(Error::transient(format!(
            "{}; applying the source transactions up to commit {through} again one change at a time to find the one that fails",
            err.message()
        )));
    }

    /// Makes the source transactions up to `through` (and the open group's, and the current
    /// one) be applied one change at a time after the restart that follows; returns up to where.
    fn unbatch(&mut self, through: Option<Lsn>) -> Lsn {
        let through = self
            .current
            .as_ref()
            .map(|t| t.final_lsn)
            .into_iter()
            .chain(through)
            .chain(self.group.as_ref().and_then(|g| g.last_commit).map(|c| c.0))
            .max()
            .unwrap_or_default();
        self.settings
            .unbatched_through
            .fetch_max(through.0, std::sync::atomic::Ordering::Relaxed);
        through
    }

    /// Notes what one statement's result means: a conflict, a failure, or nothing.
    fn check_result(
        &mut self,
        about: Option<ChangeInfo>,
        result: std::result::Result<u64, tokio_postgres::Error>,
    ) {
        match result {
            Ok(rows) => {
                let Some(about) = &about else { return };
                let Some(signal) = about.signal else { return };
                if rows != signal.when_rows {
                    return;
                }
                let kind = signal.conflict.name();
                if signal.policy == Policy::Error {
                    if self.failure.is_none() {
                        let err = Error::definite(format!(
                            "{kind}: {} found no row for key {} and the conflict policy for {kind} is error: {}",
                            about.describe(),
                            about.describe_key_for_log(),
                            self.skip_hint(about.commit_lsn)
                        ));
                        self.fail(err, about.commit_lsn);
                    }
                    return;
                }
                self.conflicts.push(conflict_record(about, signal));
            }
            Err(e) if e.code().map(|c| c.code()) == Some("PGA02") => {
                // `pgapply cutover` set a stop position this group's transactions pass: the run
                // starts again, and applies what comes before it, then stops.
                if self.failure.is_none() {
                    self.failure = Some(Error::transient(format!(
                        "{}: starting again to apply what comes before it, then stop",
                        describe_postgres(&e)
                    )));
                }
            }
            Err(e) if e.code().map(|c| c.code()) == Some("PGA01") => {
                // A table whose updates this group batched got a trigger (say) meanwhile.
                if self.failure.is_none() {
                    let through = self.unbatch(None);
                    let again = if through.is_valid() {
                        format!("applying the source transactions up to commit {through} again one change at a time, then batching only the updates of tables that still allow it")
                    } else {
                        "starting again, with the table read anew".to_owned()
                    };
                    self.failure = Some(Error::transient(format!(
                        "{}: {again}",
                        describe_postgres(&e)
                    )));
                }
            }
            Err(e) => {
                if self.failure.is_none() {
                    // A unique violation is a conflict in PostgreSQL 18's terms: name it so.
                    let overwriting = about.as_ref().and_then(|a| a.signal).is_some_and(|s| {
                        s.conflict == ConflictType::InsertExists && s.policy == Policy::ApplyRemote
                    });
                    let kind = match (
                        e.code().map(|c| c.code()),
                        about.as_ref().map(|a| a.operation),
                    ) {
                        // The upsert settled the key; another unique index still clashed.
                        (Some("23505"), Some("INSERT")) if overwriting => {
                            "multiple_unique_conflicts"
                        }
                        (Some("23505"), Some("INSERT")) => "insert_exists",
                        (Some("23505"), Some("UPDATE")) => "update_exists",
                        _ => "",
                    };
                    let aborted = e.code().is_some_and(|c| c.code() == "25P02");
                    if about.is_none() && !aborted {
                        let completed = self.completed;
                        if let Some(c) = self
                            .committing
                            .iter()
                            .find(|c| c.seq == completed || c.immediate_seq == Some(completed))
                        {
                            let (transactions, end_lsn, last) =
                                (c.transactions, c.end_lsn, c.last_transaction);
                            // Only an error the server sent says the COMMIT did not happen; a
                            // connection lost on the way leaves that open (the origin tells).
                            if c.seq == completed && e.as_db_error().is_some() {
                                self.origin_rewind = true;
                            }
                            return self.commit_failed(transactions, end_lsn, last, e);
                        }
                    }
                    // A column's type changed on the target under a prepared statement: the
                    // statements prepared anew by a fresh start take the new type.
                    if let Some(about) = about
                        .as_ref()
                        .filter(|_| e.code().map(|c| c.code()) == Some("42804"))
                    {
                        if first_type_mismatch(about.relation.source.oid) {
                            self.failure = Some(Error::transient(format!(
                                "applying {}: {}: a column of target table {} may have changed type since pgapply prepared its statements: starting again with statements prepared anew",
                                about.describe(),
                                describe_postgres(&e),
                                about.relation.target.qualified
                            )));
                            return;
                        }
                    }
                    let through = about.as_ref().and_then(|a| a.through);
                    let err = self.violation_error(kind, about.as_ref(), e);
                    match (through, &about) {
                        (Some(lsn), _) if !err.is_transient() && !aborted => {
                            self.retry_unbatched(err, Some(lsn))
                        }
                        (None, Some(about)) if !aborted => self.fail(err, about.commit_lsn),
                        _ => self.failure = Some(err),
                    }
                }
            }
        }
    }

    /// A group's COMMIT failed (a deferred constraint checked then, a serialization failure):
    /// with several source transactions in it, they are applied again one at a time, each
    /// committing on its own, so that the error names the one that fails.
    fn commit_failed(
        &mut self,
        transactions: u64,
        end_lsn: Lsn,
        last: Option<(u32, Lsn)>,
        e: tokio_postgres::Error,
    ) {
        let err = Error::postgres(
            format!(
                "committing {transactions} source transaction(s) ending at {end_lsn} on the target"
            ),
            e,
        );
        if err.is_transient() {
            self.failure = Some(err);
            return;
        }
        match last {
            Some((_, commit_lsn)) if transactions > 1 => {
                self.retry_unbatched(err, Some(commit_lsn));
            }
            Some((xid, commit_lsn)) => {
                let err = Error::definite(format!(
                    "{} (source transaction xid {xid}, commit LSN {commit_lsn}): {}",
                    err.message(),
                    self.skip_hint(commit_lsn)
                ));
                self.fail(err, commit_lsn);
            }
            None => self.failure = Some(err),
        }
    }

    /// The error for a failed statement, named by its conflict type when it is one.
    fn violation_error(
        &self,
        kind: &str,
        about: Option<&ChangeInfo>,
        e: tokio_postgres::Error,
    ) -> Error {
        let what = about.map_or_else(
            || "a statement on the target".to_owned(),
            ChangeInfo::describe,
        );
        let kind = if kind.is_empty() {
            String::new()
        } else {
            format!("{kind}: ")
        };
        // A statement with several transactions' changes is retried one change at a time; the
        // hint comes with that retry's error.
        // A lost connection or a restarting target is retried: nothing to fix, nothing to skip.
        let transient = e
            .as_db_error()
            .is_none_or(|db| crate::error::is_transient_sqlstate(db.code().code()));
        let hint = about
            .filter(|a| a.through.is_none() && !transient)
            .map(|about| self.change_hint(about, &e));
        let err = Error::postgres(format!("{kind}applying {what}"), e);
        match hint {
            Some(hint) => err.context_after(hint),
            None => err,
        }
    }

    /// What to do about a change the target refused: what to change on the target where that
    /// fixes it (skipping would lose the transaction), else how to skip it on purpose.
    fn change_hint(&self, about: &ChangeInfo, e: &tokio_postgres::Error) -> String {
        let table = &about.relation.target.qualified;
        let db = e.as_db_error();
        match e.code().map(|c| c.code()) {
            // A value the target refuses: name the columns it can come from.
            Some(c) if value_refused(c) => match about.relation.narrower_candidates().as_slice() {
                [] => target_table_hint(c, table).unwrap_or_default(),
                [one] => format!("column {one} of target table {table} does not take the source's value: its type differs from the source column's; change it on the target to fit the source's type, then start pgapply again (it reads the target's columns when it starts)"),
                many => format!("a column of target table {table} does not take the source's value; these columns' types differ from the source's: {}: change the one the error is about on the target to fit the source's type, then start pgapply again (it reads the target's columns when it starts)", many.join(", ")),
            },
            // NOT NULL on the target: a column the source does not send (dropped there, or
            // target-only) without a default, or one the source sends NULL in.
            Some("23502") if db.and_then(|d| d.column()).is_some() => {
                let column = db.and_then(|d| d.column()).unwrap_or_default();
                let quoted = quote_ident(column);
                let sent = (0..about.relation.source.columns.len())
                    .any(|c| about.relation.target_column(c).is_some_and(|t| t.name == column));
                if sent {
                    format!("the source's row has NULL in column {quoted} of target table {table}, which is NOT NULL there (not on the source): ALTER TABLE {table} ALTER COLUMN {quoted} DROP NOT NULL on the target, then start pgapply again")
                } else {
                    format!("column {quoted} of target table {table} is NOT NULL without a default, and the source does not send it (dropped on the source, or a target-only column): give it a default (ALTER TABLE {table} ALTER COLUMN {quoted} SET DEFAULT ...), drop NOT NULL, or drop the column on the target, then start pgapply again")
                }
            }
            // No partition takes the row (a partition only the source has), a leaf partition's
            // bounds, or a CHECK constraint only the target has.
            Some("23514") => match db.and_then(|d| d.constraint()).filter(|n| !n.is_empty()) {
                None if db.is_some_and(|d| d.message().starts_with("no partition")) => format!("no partition of target table {table} takes the source's row: create the partition on the target (as on the source), then start pgapply again"),
                None => format!("target table {table} is a partition whose bounds do not take the source's row (the target's partitions differ from the source's): make its bounds match the source's, or apply into the partitioned table (`[tables]` in the config file), then start pgapply again"),
                Some(name) => format!("the CHECK constraint {} of target table {table} refuses the source's row: drop or change it on the target, then start pgapply again; or {}", quote_ident(name), self.skip_hint(about.commit_lsn)),
            },
            // A target foreign key from a table the source did not truncate.
            Some("0A000") if about.operation == "TRUNCATE" => format!(
                "the source truncated {table}, and a table on the target that the source did not truncate references it: pgapply does not cascade to such tables (nor does PostgreSQL's own subscriber). Empty or drop the referencing table on the target (or drop its foreign key), or publish it, then start pgapply again"
            ),
            c => c
                .and_then(|c| target_table_hint(c, table))
                .unwrap_or_else(|| self.skip_hint(about.commit_lsn)),
        }
    }

    /// Sends every queued statement, waits for every result and checks them.
    async fn send_pipeline(&mut self) -> Result<()> {
        self.flush_held_updates(None).await?;
        self.flush_insert_run().await?;
        self.submit_pending();
        self.drain_to(0).await;
        self.fail_if_failed().await?;
        self.settle_committed().await;
        Ok(())
    }

    /// Moves the session's origin back to the last position known committed, after a
    /// transaction that had its position set failed to commit: PostgreSQL 16+ advances the
    /// origin on abort too, and the next run would skip that transaction. (Before 16 the origin
    /// is already there: nothing moves.) The session may be busy with statements sent after
    /// the failure: a short wait, then a warning.
    ///
    /// Returns what the user must do when it could not: the next run, retried or not, would
    /// skip the transactions that failed.
    async fn rewind_origin(&mut self) -> Option<String> {
        let name = self.progress.origin_name().map(str::to_owned)?;
        // Groups answered as committed but not settled yet count too: moved back past them,
        // the origin would have the next run apply them twice.
        let to = self
            .committed
            .iter()
            .map(|c| c.end_lsn)
            .fold(self.resume, Lsn::max);
        let text = to.to_string();
        // PostgreSQL moves an origin only while no session has it bound, this one included;
        // unbinding also clears the failed group's position, which stays set in the session
        // after its transaction ended, so that no later abort moves the origin to it again.
        let client = &self.client;
        let rewind = async {
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_session_reset()",
                    &[],
                )
                .await?;
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_advance($1, $2::text::pg_lsn)",
                    &[&name, &text],
                )
                .await?;
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_session_setup($1)",
                    &[&name],
                )
                .await
        };
        let why = match tokio::time::timeout(Duration::from_secs(10), rewind).await {
            Ok(Ok(_)) => {
                tracing::debug!(origin = %name, %to, "moved the origin back after a failed commit");
                return None;
            }
            Ok(Err(e)) => describe_postgres(&e),
            Err(_) => "no answer in 10 s".to_owned(),
        };
        Some(rewind_advice(&name, to, &why))
    }

    /// A failure that moved the origin: moved back, or, if that failed, the error says what to
    /// do and is not retried by itself.
    async fn with_origin_rewound(&mut self, e: Error) -> Error {
        match self.rewind_origin().await {
            None => e,
            // The origin's row in pgapply.origin_commit holds the last commit: the next start
            // moves the origin back to it (`ProgressStore::open`), retried or not.
            Some(_) if self.commit_row => {
                tracing::warn!("the origin could not be moved back after the failed commit; the next start moves it back to its last commit");
                e
            }
            Some(advice) => e.context_after(advice).needing_a_person(),
        }
    }

    /// After a failed statement the transaction is aborted on the server: end it, forget the
    /// group, and report the first failure.
    async fn fail_if_failed(&mut self) -> Result<()> {
        if self.failure.is_none() {
            return Ok(());
        }
        let rewind = std::mem::take(&mut self.origin_rewind) && self.worker.is_none();
        if rewind && failpoint::armed(failpoint::FAIL_COMMIT_THEN_EXIT) {
            failpoint::exit(failpoint::FAIL_COMMIT_THEN_EXIT);
        }
        // Answers come in order: a COMMIT not yet answered comes after the failed statement, so
        // its group did not commit (PostgreSQL answers it with a rollback). Forget those groups
        // before draining, so that their answers cannot count them as committed.
        self.committing.clear();
        if self.worker.is_some() {
            // A parallel worker stops at once: statements after the failure may be waiting on
            // the server for transactions that will not commit now, and dropping the connection
            // ends them. Positions are in the origins; nothing after the failure committed.
            // (An origin that an abort moved is moved back when the run starts again, to the
            // worker's row in pgapply.origin_commit: `ProgressStore::open`.) Groups answered as
            // committed before it are counted and their conflicts recorded first.
            if let Some(e) = self.failure.take() {
                self.settle_committed().await;
                return Err(e);
            }
        }
        match self.failure.take() {
            Some(e) => {
                self.drain_to(0).await;
                self.failure = None;
                self.group = None;
                self.current = None;
                self.conflicts.clear();
                self.skip_records.clear();
                self.pending.clear();
                self.insert_run = None;
                self.held_updates.clear();
                self.held_rows = 0;
                self.unsettled_rows = RowCounts::default();
                // COMMITs answered before the failure stand (settled below).
                let _ = self.client.batch_execute("ROLLBACK").await;
                // Last, outside any transaction: the ROLLBACK of a later group moves the origin
                // too (PostgreSQL 16+).
                let e = if rewind {
                    self.with_origin_rewound(e).await
                } else {
                    e
                };
                self.settle_committed().await;
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Records the position and commits the group's target transaction.
    async fn commit_group(&mut self) -> Result<()> {
        self.flush_held_updates(None).await?;
        self.flush_insert_run().await?;
        if self.group.as_ref().is_some_and(|g| g.check_before_commit) {
            // A row count decides whether this group may commit at all.
            self.send_pipeline().await?;
        }
        let Some(group) = self.group.take() else {
            return Ok(());
        };
        match group.turn {
            // A parallel worker's transaction: the server orders the commit (`apply::parallel`).
            Some(turn) => self.wait_for_turn(&turn),
            // This group may commit only once the previous one has: if that failed, this one
            // must not commit without it.
            None => self.chain_commit().await?,
        }
        let Some((end_lsn, commit_time)) = group.last_commit else {
            // Only skipped transactions: nothing to commit but the empty BEGIN.
            self.pending.push(Pending::plain(self.commit.clone()));
            return self.send_pipeline().await;
        };
        for (xid, lsn, time) in std::mem::take(&mut self.skip_records) {
            let clear = match self
                .client
                .prepare(
                    // (Only this request: `pgapply skip` may have asked for another since.)
                    "WITH cleared AS (UPDATE pgapply.progress SET skip_lsn = NULL WHERE slot_name = $1 AND skip_lsn = $3::text::pg_lsn) \
                     INSERT INTO pgapply.conflicts (slot_name, conflict_type, key, source_lsn, source_commit_time, policy) \
                     VALUES ($1, 'skipped_transaction', $2, $3::text::pg_lsn, $4::text::timestamptz, 'skip')",
                )
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    return self
                        .prepare_failed("the record of a skipped transaction", "pgapply.conflicts", e)
                        .await
                }
            };
            self.pending.push(Pending::with_params(
                clear,
                vec![
                    WireValue::Text(self.slot.clone().into()),
                    WireValue::Text(format!("xid {xid}").into()),
                    WireValue::Text(lsn.to_string().into()),
                    WireValue::Text(time.to_rfc3339().into()),
                ],
            ));
        }
        // One statement: no stop position `pgapply cutover` set at or before this group's last
        // source commit, and the tables it relied on as they were read (migration 0012). (By now
        // the group's own statements hold those tables, so they cannot change before it ends.)
        if group.last_transaction.is_some() || !group.relied_on.is_empty() {
            let commit_lsn = group.last_transaction.map(|(_, lsn)| lsn.to_string());
            let (oids, fingerprints): (Vec<String>, Vec<&str>) = group
                .relied_on
                .iter()
                .map(|(oid, f)| (oid.to_string(), &**f))
                .unzip();
            self.pending.push(Pending::with_params(
                self.check_group.clone(),
                vec![
                    WireValue::Text(self.slot.clone().into()),
                    match commit_lsn {
                        Some(lsn) => WireValue::Text(lsn.into()),
                        None => WireValue::Null,
                    },
                    WireValue::Text(oids.join(",").into()),
                    WireValue::Text(fingerprints.join("\n").into()),
                ],
            ));
        }
        // Deferred constraints and triggers are checked before the origin position is set, not
        // at COMMIT: PostgreSQL 16+ moves a session's origin on abort as well as on commit, so
        // a transaction that fails after the position is set would count as applied.
        let immediate_seq = (!self.progress.is_table_mode()).then(|| {
            self.pending.push(Pending::plain(self.immediate.clone()));
            self.submitted + self.pending.len() as u64
        });
        let record = self.record_params(end_lsn, commit_time);
        self.pending
            .push(Pending::with_params(self.record.clone(), record));
        if failpoint::armed(failpoint::EXIT_BEFORE_COMMIT) {
            self.submit_pending();
            self.drain_to(0).await;
            failpoint::exit(failpoint::EXIT_BEFORE_COMMIT);
        }
        let commit = match &self.origin_commit {
            _ if self.worker.as_ref().is_none_or(|w| w.index == 1)
                && failpoint::fail_commit_once() =>
            {
                Pending::simple(ProgressStore::origin_commit_sql(failpoint::FAILING_COMMIT).into())
            }
            Some(sql) => Pending::simple(sql.clone()),
            None => Pending::plain(self.commit.clone()),
        };
        self.pending.push(commit);
        // The COMMIT goes out without waiting for its answer: the next group is built (and
        // sent) meanwhile. The group counts as applied once the answer is in. (Noted before
        // sending: the answer may be taken while sending.)
        self.committing.push_back(Committing {
            seq: self.submitted + self.pending.len() as u64,
            end_lsn,
            commit_time,
            transactions: group.transactions,
            last_transaction: group.last_transaction,
            immediate_seq,
            started: group.started,
            conflicts: GroupConflicts::default(),
            rows: std::mem::take(&mut self.unsettled_rows),
        });
        self.submit_pending();
        // Answers taken while sending may have settled it already (or found a failure).
        self.fail_if_failed().await?;
        self.settle_committed().await;
        Ok(())
    }

    /// Queues what makes a parallel worker's transaction commit after its predecessor, and only
    /// if that committed: on this connection, a look at its own origin; on another worker, a wait
    /// on the server (`pgapply.wait_for_commit`) for the predecessor's commit.
    fn wait_for_turn(&mut self, turn: &Turn) {
        let Some(after) = turn.after else {
            return;
        };
        let (Some(worker), Some(statements)) = (&self.worker, &self.turn_statements) else {
            return;
        };
        // On this connection the predecessor has ended: the wait only checks that it committed
        // (timeout 0), and fails this transaction on the server if not, so its COMMIT can not
        // follow. (A row count checked in the client would come too late: the COMMIT is already
        // on its way.)
        let timeout_ms = if after.worker == worker.index {
            0
        } else {
            WAIT_FOR_COMMIT_MS
        };
        let pending = Pending {
            request: Request::Prepared(statements.wait.clone()),
            params: wait_params(worker, &after, timeout_ms),
            about: None,
            batch: Vec::new(),
            orders: true,
        };
        self.pending.push(pending);
    }

    /// Makes the open group commit only if the previous one did. With the origin's row
    /// (`commit_row`) the server checks it, in this group, after the previous COMMIT ran: the
    /// group goes out without waiting for that COMMIT's answer, which a far target would
    /// otherwise make a round trip per group (measured with 1 ms each way: most of the time
    /// lost to the delay). If the previous COMMIT failed, this group fails with it (and is
    /// rolled back: its own COMMIT then ends an aborted transaction), and the earlier failure is
    /// the one reported. Otherwise the client waits for the answer.
    async fn chain_commit(&mut self) -> Result<()> {
        let previous = self.committing.back().map(|c| c.end_lsn);
        let origin = self.progress.origin_name().map(str::to_owned);
        match (previous, &self.check_committed, origin) {
            (Some(end_lsn), Some(check), Some(origin)) => {
                tracing::debug!(previous_end_lsn = %end_lsn, "group sent before the previous COMMIT is answered; the target checks that one committed");
                self.pending.push(Pending::with_params(
                    check.clone(),
                    vec![
                        WireValue::Text(origin.into()),
                        WireValue::Text(end_lsn.to_string().into()),
                    ],
                ));
                Ok(())
            }
            _ => self.wait_for_commits().await,
        }
    }

    /// Waits until every COMMIT sent has been answered; fails if one did not succeed.
    async fn wait_for_commits(&mut self) -> Result<()> {
        while let Some(seq) = self.committing.back().map(|c| c.seq) {
            if self.completed >= seq || self.worker_failed() {
                break;
            }
            match self.in_flight_mut().next().await {
                Some(outcome) => self.check_outcome(outcome),
                None => break,
            }
        }
        self.fail_if_failed().await?;
        self.settle_committed().await;
        Ok(())
    }

    /// Commits the open group and waits for the answer (before two-phase steps, which run
    /// outside the pipeline).
    async fn commit_group_and_wait(&mut self) -> Result<()> {
        self.commit_group().await?;
        self.wait_for_commits().await
    }

    /// The bookkeeping of groups whose COMMIT succeeded: counters, the applied position, and
    /// their conflict records.
    async fn settle_committed(&mut self) {
        for c in std::mem::take(&mut self.committed) {
            if !c.conflicts.is_empty() {
                self.record_conflicts(c.conflicts).await;
            }
            self.stats.transactions += c.transactions;
            c.rows.settle(&mut self.stats);
            let m = &*METRICS;
            m.transactions.add(c.transactions);
            // Parallel workers settle in any order; the position only moves forward.
            m.applied_lsn.set_max(c.end_lsn.0);
            m.last_commit_time.set(c.commit_time.0.max(0) as u64);
            m.apply_latency.observe(c.started.elapsed());
            self.advance_applied(c.end_lsn);
        }
    }

    /// Moves the applied position forward (never back).
    fn advance_applied(&mut self, lsn: Lsn) {
        self.applied.send_if_modified(|a| {
            let advanced = lsn > *a;
            *a = (*a).max(lsn);
            advanced
        });
        self.resume = self.resume.max(lsn);
    }

    async fn rollback(&mut self) -> Result<()> {
        // Earlier groups' answers first: their conflicts are theirs to record.
        self.drain_to(0).await;
        let mut earlier_failed = None;
        if let Some(e) = self.failure.take() {
            if self.committing.is_empty() {
                // Whatever failed is rolled back with the rest and applied again after a restart.
                tracing::debug!(error = %e, "a statement of the abandoned target transaction failed");
            } else {
                // An earlier group's COMMIT failed: it was not applied, and this run must not end
                // as if it had been.
                earlier_failed = Some(e);
            }
            self.committing.clear();
        }
        self.pending.clear();
        self.insert_run = None;
        self.held_updates.clear();
        self.held_rows = 0;
        self.unsettled_rows = RowCounts::default();
        self.conflicts.clear();
        self.skip_records.clear();
        if self.group.take().is_some() {
            if let Err(e) = self.client.batch_execute("ROLLBACK").await {
                tracing::warn!(error = %describe_postgres(&e), "rolling back the open target transaction failed");
            }
        }
        self.current = None;
        let rewind = std::mem::take(&mut self.origin_rewind);
        match earlier_failed {
            Some(e) if rewind => Err(self.with_origin_rewound(e).await),
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// What to do when an origin could not be moved back after a failed commit.
fn rewind_advice(origin: &str, to: Lsn, why: &str) -> String {
    let origin = crate::sql::quote_literal(origin);
    format!(
        "the target's replication origin {origin} could not be moved back to {to} after the failed commit ({why}): before starting pgapply again, run SELECT pg_replication_origin_advance({origin}, '{to}') on the target, or the next run skips the transactions that failed"
    )
}

/// Parameters of `pgapply.wait_for_commit` for an earlier transaction.
fn wait_params(worker: &WorkerRole, after: &After, timeout_ms: u32) -> Vec<WireValue> {
    let mut params = turn_lock_params(worker.lock_key, after.seq);
    params.push(WireValue::Text(
        worker
            .origins
            .get(after.worker)
            .cloned()
            .unwrap_or_default()
            .into(),
    ));
    params.push(WireValue::Text(after.end_lsn.to_string().into()));
    params.push(WireValue::Text(timeout_ms.to_string().into()));
    params
}

/// How long a worker waits on the server for another worker's transaction to commit before it
/// gives up (and the run restarts, applying those transactions one at a time).
const WAIT_FOR_COMMIT_MS: u32 = 60_000;

/// Parameters of a turn lock: the slot's key and the turn's.
fn turn_lock_params(lock_key: i32, seq: u64) -> Vec<WireValue> {
    vec![
        WireValue::Text(lock_key.to_string().into()),
        WireValue::Text(super::parallel::turn_key(seq).to_string().into()),
    ]
}

/// The Xid a change carries inside a streamed block (the subtransaction's, for its changes).
fn streamed_xid(message: &LogicalMessage) -> Option<Xid> {
    match message {
        LogicalMessage::Relation(r) => r.xid,
        LogicalMessage::Type(t) => t.xid,
        LogicalMessage::Insert(i) => i.xid,
        LogicalMessage::Update(u) => u.xid,
        LogicalMessage::Delete(d) => d.xid,
        LogicalMessage::Truncate(t) => t.xid,
        LogicalMessage::Message(m) => m.xid,
        _ => None,
    }
}

/// Whether an "expression is of type x" error for a relation may start the run again: not if
/// one did in the last ten minutes (then the statements were prepared anew and the error is
/// not about a changed table).
fn first_type_mismatch(relation: crate::protocol::pgoutput::Oid) -> bool {
    static SEEN: std::sync::LazyLock<
        std::sync::Mutex<HashMap<crate::protocol::pgoutput::Oid, Instant>>,
    > = std::sync::LazyLock::new(Default::default);
    let Ok(mut seen) = SEEN.lock() else {
        return false;
    };
    match seen.get(&relation) {
        Some(at) if at.elapsed() < Duration::from_secs(600) => false,
        _ => {
            seen.insert(relation, Instant::now());
            true
        }
    }
}

/// What to write to pgapply.conflicts for a conflict met by `about`.
fn conflict_record(about: &ChangeInfo, signal: Signal) -> ConflictRecord {
    let entry = &about.relation;
    let remote_row = about.remote.as_ref().map(|tuple| {
        let mut object = serde_json::Map::new();
        for (i, value) in tuple.values().enumerate() {
            let Some(column) = entry.source.columns.get(i) else {
                break;
            };
            let v = match value {
                Value::Null => serde_json::Value::Null,
                Value::Text(t) => {
                    serde_json::Value::String(String::from_utf8_lossy(&t).into_owned())
                }
                Value::Binary(_) => serde_json::Value::String("<binary>".into()),
                Value::UnchangedToast => serde_json::Value::String("<unchanged>".into()),
            };
            object.insert(column.name.clone(), v);
        }
        serde_json::Value::Object(object).to_string()
    });
    // The target's row, for an INSERT that found one and left it in place.
    let local_row_query = match (signal.conflict, signal.policy, &about.remote) {
        (ConflictType::InsertExists, Policy::Skip | Policy::KeepLocal, Some(tuple))
            if !entry.key_columns.is_empty() =>
        {
            let values: Vec<Value> = tuple.values().collect();
            let mut params = Vec::new();
            let mut conditions = Vec::new();
            for (n, &k) in entry.key_columns.iter().enumerate() {
                conditions.push(format!("{} = ${}", entry.quoted_columns[k], n + 1));
                // Copies: a slice would keep the whole received message alive until the
                // group commits.
                params.push(match values.get(k) {
                    Some(Value::Text(t)) => WireValue::Text(bytes::Bytes::copy_from_slice(t)),
                    Some(Value::Binary(b)) => WireValue::Binary(bytes::Bytes::copy_from_slice(b)),
                    _ => WireValue::Null,
                });
            }
            Some((
                format!(
                    "SELECT to_jsonb(t.*)::text FROM {}{} t WHERE {}",
                    super::statement::only(entry),
                    entry.target.qualified,
                    conditions.join(" AND ")
                ),
                params,
            ))
        }
        _ => None,
    };
    ConflictRecord {
        relation: entry.target.qualified.clone(),
        conflict_type: signal.conflict.name(),
        key: about.describe_key(),
        local_row_query,
        local_row: None,
        remote_row,
        source_lsn: about.commit_lsn,
        source_commit_time: Some(about.commit_time),
        policy: signal.policy.name(),
        log: super::conflict::ConflictLog {
            key: about.describe_key_for_log(),
            xid: about.xid,
            sentence: conflict_sentence(about.operation, signal),
            rows: None,
            missing: matches!(
                signal.conflict,
                ConflictType::UpdateMissing | ConflictType::DeleteMissing
            ),
        },
    }
}

/// A data exception (class 22) that a target column's type explains: not an encoding problem
/// (22P05 untranslatable character, 22021 invalid byte sequence), which no column change fixes.
fn value_refused(code: &str) -> bool {
    code.starts_with("22") && !matches!(code, "22P05" | "22021")
}

/// What to do when the target refuses a statement because of how its table is defined (SQLSTATE
/// `code`): a change on the target fixes it, not skipping the transaction.
fn target_table_hint(code: &str, table: &str) -> Option<String> {
    match code {
        "428C9" => Some(format!(
            "pgapply writes the source's values, and an UPDATE may write into an identity column of {table} only if it is GENERATED BY DEFAULT (pgapply leaves it out only when it is part of the key, or the old row shows it unchanged): run ALTER TABLE {table} ALTER COLUMN ... SET GENERATED BY DEFAULT on the target and start pgapply again"
        )),
        // A value the target's column does not take (out of range, too long): a narrower type
        // than the source's. Skipping would lose the transaction.
        c if value_refused(c) => Some(format!(
            "a column of target table {table} does not take the source's value (a narrower type, or a different one): change the column on the target to fit the source's type, then start pgapply again (it reads the target's columns when it starts, so a column changed while it runs counts only from then); `pgapply check` lists what differs"
        )),
        c if c.starts_with("42") => Some(format!(
            "target table {table} does not take the source's rows as they are (a column or type changed on the target, or a privilege is missing): fix the target table and start pgapply again (it reads the target's columns when it starts); `pgapply check` lists what differs"
        )),
        _ => None,
    }
}

/// Prepared statements kept per target session (see `remember_statement`).
const MAX_STATEMENTS: usize = 4096;

/// Tables (by source OID) whose REPLICA IDENTITY FULL rows are compared by their text form,
/// learnt when a statement failed: kept for the whole process, so that a run started again after
/// that failure aborted its transaction compares them so from the start.
static FULL_AS_TEXT: std::sync::LazyLock<std::sync::Mutex<HashSet<Oid>>> =
    std::sync::LazyLock::new(Default::default);

/// A target `GENERATED ALWAYS AS IDENTITY` column that is not part of the key: an UPDATE cannot
/// tell whether it changed, and sets it (the target then refuses, saying what to change).
fn identity_outside_key(entry: &RelationEntry) -> bool {
    entry.target.has_identity_always()
        && (0..entry.source.columns.len()).any(|c| {
            !entry.key_columns.contains(&c)
                && entry.target_column(c).is_some_and(|t| t.identity_always)
        })
}

/// The target's `GENERATED ALWAYS AS IDENTITY` columns that an UPDATE leaves as they are: such a
/// column may not be SET, not even to its own value, so it is left out of the SET (as an
/// unchanged column is). Known to stay: a key column when no old key was sent (the key did not
/// change), or any column whose old value (REPLICA IDENTITY FULL, or a changed key) equals the
/// new one. A column that does change, or might, stays in: the target's error then says why.
fn identity_kept(entry: &RelationEntry, update: &Update) -> ColumnSet {
    let mut kept = ColumnSet::default();
    if !entry.target.has_identity_always() {
        return kept;
    }
    let new: Vec<Value> = update.new.values().collect();
    let old: Option<Vec<Value>> = update.old.as_ref().map(|o| o.tuple().values().collect());
    for (i, value) in new.iter().enumerate() {
        if !entry.target_column(i).is_some_and(|t| t.identity_always) {
            continue;
        }
        let stays = match &old {
            None => entry.key_columns.contains(&i),
            Some(old) => match (old.get(i), value) {
                (Some(Value::Text(a)), Value::Text(b))
                | (Some(Value::Binary(a)), Value::Binary(b)) => a == b,
                (Some(Value::Null), Value::Null) => true,
                _ => false,
            },
        };
        if stays {
            kept.insert(i);
        }
    }
    kept
}

/// A conflict in words, for the log.
fn conflict_sentence(operation: &str, signal: Signal) -> String {
    let kind = signal.conflict.name();
    match (signal.conflict, signal.policy) {
        (ConflictType::InsertExists, Policy::ApplyRemote) => {
            format!("{operation} found an existing row on the target ({kind}); overwrote it (policy apply_remote)")
        }
        (ConflictType::InsertExists, p) => {
            format!("{operation} found an existing row on the target ({kind}); kept the target's row (policy {})", p.name())
        }
        (
            ConflictType::UpdateExists | ConflictType::MultipleUniqueConflicts,
            Policy::ApplyRemote,
        ) => {
            format!("{operation} clashed with other rows' unique values on the target ({kind}); deleted those rows and applied the change (policy apply_remote)")
        }
        (ConflictType::UpdateExists | ConflictType::MultipleUniqueConflicts, p) => {
            format!("{operation} clashed with other rows' unique values on the target ({kind}); left the target as it was (policy {})", p.name())
        }
        (_, Policy::ApplyRemote) => {
            format!("{operation} found no row on the target ({kind}); inserted the new row (policy apply_remote)")
        }
        (_, p) => format!(
            "{operation} found no row on the target ({kind}); skipped (policy {})",
            p.name()
        ),
    }
}
