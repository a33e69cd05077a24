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

mod commit;
mod conflicts;
mod live;
mod outcome;
mod pipeline;
mod rows;
mod two_phase;
mod updates;

use commit::*;
use conflicts::*;
use outcome::*;

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
    /// With nothing more to apply, a group stays open until it is this old, so that a steady
    /// trickle of small transactions shares one target transaction's fixed costs (its checks,
    /// its position, its COMMIT) instead of paying them each: three times the built-in
    /// subscriber's CPU per transaction without it, at a few thousand transactions a second.
    /// Adds at most this much to the lag.
    pub group_linger: Duration,
    /// Collapse and batch UPDATEs of tables that allow it (`apply::batch`).
    pub batch_updates: bool,
    /// Source transactions whose commit LSN is at or before this are applied without batching:
    /// set when a batched statement failed, so that the retry names the failing transaction.
    /// Shared by the attempts of one run.
    pub unbatched_through: Arc<std::sync::atomic::AtomicU64>,
    /// Set when applying failed while a streamed transaction was applied as it arrived
    /// (`--streaming parallel`): from then on the process spools them (see `applier::live`).
    pub live_streaming_off: Arc<std::sync::atomic::AtomicBool>,
    /// The commit LSN of the last source transaction applied again because a row it found
    /// missing, under conflict policy `error`, may have been kept by a trigger added on the
    /// target since its table's triggers were read (`Applier::may_skip`): again, it is the
    /// transaction's own error. Shared by the attempts of one run.
    pub triggers_reread_at: Arc<std::sync::atomic::AtomicU64>,
}

impl Default for ApplySettings {
    fn default() -> Self {
        ApplySettings {
            pipeline_values: 20_000,
            group_statements: 10_000,
            group_age: Duration::from_millis(200),
            group_linger: Duration::from_millis(5),
            batch_updates: true,
            unbatched_through: Arc::default(),
            live_streaming_off: Arc::default(),
            triggers_reread_at: Arc::default(),
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
    /// Holds a transaction skipped with `pgapply skip`: commits right after it, so that its
    /// record does not go down with a failing transaction after it (whose skip would then
    /// replace this one's request).
    closes_now: bool,
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
    /// Updates by key not batched (`apply::batch`), per (source relation, hash of the key):
    /// see `HOT_ROW_UPDATES`.
    row_updates: HashMap<(Oid, u64), u32>,
}

impl Group {
    /// Whether the group waits for more (`ApplySettings::group_linger`) when nothing more has
    /// come: only a small one, while the source sends transactions as they commit (a trickle).
    /// Catching up on a backlog, the stream pauses now and then while the reader lets data
    /// accumulate; a group waiting then would leave the target idle (about 8% slower).
    fn lingers(&self) -> bool {
        self.transactions < LINGER_BELOW_TRANSACTIONS
            && SOURCE_SENDS_LIVE.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// See `Group::lingers`.
const LINGER_BELOW_TRANSACTIONS: u64 = 64;

/// Whether the source sent its latest transaction within `LIVE_WITHIN` of its commit, both read
/// on the source's clock (the commit time in Begin, the send time of its frame): it sends as its
/// transactions commit, rather than from a backlog. Set by the reader at each Begin.
pub static SOURCE_SENDS_LIVE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// See `SOURCE_SENDS_LIVE`.
pub const LIVE_WITHIN: Duration = Duration::from_millis(50);

/// Updates of one row by the group's transactions, beyond which the group commits after the
/// current transaction. Each update of a row leaves a version the next one must step past (in
/// the heap and in each index) until the transaction that wrote them commits: a counter row
/// updated by every source transaction would make a group of thousands of them quadratic. (The
/// updates of a table whose updates are batched collapse into one per row instead.)
const HOT_ROW_UPDATES: u32 = 32;

/// Statements queued before they are handed to the connection together.
const SUBMIT_CHUNK: usize = 64;

type InFlight = std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>>;

/// What the apply loop got while waiting: a message, or an answer from the target.
enum Next {
    Message(Option<Envelope>),
    Outcome(Option<Outcome>),
    /// The open group has lingered long enough (`ApplySettings::group_linger`).
    Lingered,
    /// Nothing for 2 s: a time to see whether the apply connection is still open.
    Quiet,
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
        std::result::Result<(u64, Option<String>), tokio_postgres::Error>,
    ),
    /// A batched UPDATE or DELETE: the numbers of its rows that matched nothing.
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
    /// A batched UPDATE or DELETE: its rows' changes, by row number.
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
    change: Held,
}

/// What a row of a batched statement does.
enum Held {
    /// An UPDATE: the new row (a detached copy), which also holds the key.
    Update(Tuple),
    /// A DELETE: the values of the key tuple.
    Delete(Vec<Value>),
}

impl HeldChange {
    fn into_change_info(self) -> ChangeInfo {
        let (operation, key, remote, conflict) = match self.change {
            Held::Update(new) => ("UPDATE", None, Some(new), ConflictType::UpdateMissing),
            Held::Delete(key) => (
                "DELETE",
                Some((RowMatch::Key, key)),
                None,
                ConflictType::DeleteMissing,
            ),
        };
        ChangeInfo {
            relation: self.relation,
            operation,
            xid: self.xid,
            commit_lsn: self.commit_lsn,
            commit_time: self.commit_time,
            key,
            remote,
            // Only changes under update_missing / delete_missing = skip are batched.
            signal: Some(Signal {
                conflict,
                policy: Policy::Skip,
                when_rows: 0,
                incomplete_row: false,
                answers_local_row: false,
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
    /// `apply_remote` asked for, but the missing row cannot be inserted: the source did not send
    /// all of the new row (unchanged TOAST values). Skipped instead, and said why.
    incomplete_row: bool,
    /// The statement answers with the target's row(s) the change met (an INSERT under an
    /// insert_exists policy), for the conflict record, instead of a row count.
    answers_local_row: bool,
}

impl ChangeInfo {
    /// Its statement answers with the target's row(s) it met (`Signal::answers_local_row`).
    fn answers_local_row(&self) -> bool {
        self.signal.is_some_and(|s| s.answers_local_row)
    }

    fn describe(&self) -> String {
        // A streamed transaction applied as it arrives has no commit yet.
        let commit = if self.commit_lsn == Lsn(u64::MAX) {
            "streamed, its commit not received yet".to_owned()
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
        format!("({names}) (REPLICA IDENTITY FULL: the old row's values are logged at debug level, and recorded in pgapply.conflicts when a policy other than error lets the change pass)")
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
    /// Set when a stop is asked for: the run ends at the next boundary between source
    /// transactions, leaving the rest of its queue to the next start.
    pub stop_between: Arc<std::sync::atomic::AtomicBool>,
    /// The apply session, taken out of the pool for good: it is bound to the replication
    /// origin, and the position set in it outlives each transaction; no other work may inherit
    /// either (a commit of anything in it would carry that position).
    client: Arc<deadpool_postgres::ClientWrapper>,
    catalog: deadpool_postgres::Object,
    /// Target tables (schema, name) to note in pgapply.slot_tables at the next group commit:
    /// one statement for all the tables a group met for the first time.
    tables_to_note: Vec<(String, String)>,
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
    statements: pipeline::StatementCache,
    /// Relations whose REPLICA IDENTITY FULL matching compares values as text.
    full_as_text: HashSet<Oid>,
    begin: Statement,
    /// `SET CONSTRAINTS ALL DEFERRED`, right after each BEGIN: a source statement that swaps
    /// keys under a DEFERRABLE (INITIALLY IMMEDIATE) unique constraint passes its check at the
    /// statement's end, but arrives here as one statement per row, the first of which clashes
    /// with the second row until that is applied too. Deferred, the check comes before commit.
    deferred: Statement,
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
    /// The weight (`values_weight`) of the statements queued by `push_pending`, not sent yet.
    pending_weight: usize,
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
    /// `ApplierOptions::shared_targets`.
    shared_targets: Arc<SharedTargets>,
    /// `ApplierOptions::deferrable_on_source`.
    deferrable_on_source: Arc<HashSet<String>>,
    /// Source relations of schema pgapply (a source that was a target once, published FOR ALL
    /// TABLES): pgapply's own state there, never applied over this target's.
    own_state: HashSet<Oid>,
    policies: Arc<PolicyMap>,
    policy_updates: Option<watch::Receiver<Arc<PolicyMap>>>,
    /// The commit LSN of a transaction to skip on purpose (`pgapply skip`).
    skip_lsn: Option<Lsn>,
    /// Conflicts met in the open group, recorded once it commits.
    conflicts: GroupConflicts,
    /// Conflicts met by transactions prepared on the target (by source xid): recorded at COMMIT
    /// PREPARED, dropped at ROLLBACK PREPARED.
    prepared_conflicts: HashMap<Xid, GroupConflicts>,
    /// The rows of transactions prepared on the target, counted when they commit (a ROLLBACK
    /// PREPARED applies none of them).
    prepared_rows: HashMap<Xid, RowCounts>,
    /// Transactions of the open group skipped on request: (xid, commit LSN, commit time).
    skip_records: Vec<(u32, Lsn, PgTimestamp)>,
    /// Inserts into one table by one source transaction, waiting to go out as one statement.
    insert_run: Option<InsertRun>,
    /// Consecutive DELETEs by key of one table not yet queued (`delete_run`).
    delete_run: Option<DeleteRun>,
    /// Unique indexes of target tables as source column positions, by (source OID, generation):
    /// read when a guarded change first needs them.
    unique_keys: HashMap<(Oid, u64), Arc<Vec<Vec<usize>>>>,
    /// Per relation generation: the target table has a DEFERRABLE unique or exclusion
    /// constraint, which INSERT .. ON CONFLICT without a named key refuses.
    deferrable_unique: HashMap<(Oid, u64), bool>,
    /// Per relation generation: the changes a trigger on the target table may skip
    /// (`apply::triggers`).
    /// (And when they were read: read again after a conflict, at most every 2 s.)
    may_skip: HashMap<(Oid, u64), (crate::apply::triggers::MaySkip, Instant)>,
    /// The apply session runs with `session_replication_role = replica` (the role may set it):
    /// which triggers fire (`apply::triggers`).
    as_replica: bool,
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
    /// Per relation, by (source OID, generation): the first `pgapply.batching_fingerprint` read
    /// of its target table, which each group that writes the table checks (`check_unchanged`).
    fingerprints: HashMap<(Oid, u64), Arc<str>>,
    /// The table whose statement the target refused a value for (`failure`): if it changed
    /// since pgapply read it, the error is not the user's to fix (`fail_if_failed`).
    refused_in: Option<Arc<RelationEntry>>,
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
    /// A two-phase slot, which `--copy-data` cannot copy later-published tables from.
    two_phase_slot: bool,
    /// Relations `entry` has looked up in `copied_tables` already.
    copy_checked: HashSet<Oid>,
    copied_since: Arc<crate::copy::LaterCopies>,
    /// `copied_since` by source OID, as looked up.
    copied_since_by_oid: HashMap<Oid, Option<Lsn>>,
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
    /// `values_weight` of `params`.
    weight: usize,
    rows: usize,
    limit: usize,
    /// The first row's change, for messages.
    about: ChangeInfo,
    /// The commit LSN of the last row's source transaction.
    last_commit: Lsn,
}

/// Consecutive DELETEs by key of one table whose changes may share a statement, queued as
/// `apply::batch::delete_sql` statements once another statement comes, the run is full, or the
/// group ends.
struct DeleteRun {
    entry: Arc<RelationEntry>,
    /// Each row's key values, in key order.
    params: Vec<WireValue>,
    rows: Vec<HeldChange>,
    /// Most rows in one statement (a power of two).
    limit: usize,
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
    /// Source column -> target column, per source table, where they differ.
    pub column_map: Arc<crate::config::ColumnMap>,
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
    /// Tables copied after the initial copy (published later), with that copy's snapshot
    /// position: their changes from transactions committed before it are in the copied rows,
    /// and are dropped.
    pub copied_since: Arc<crate::copy::LaterCopies>,
    /// Values arrive in binary form (`--binary`, negotiated): the server reads a parameter by
    /// the type the statement was prepared with, so a target column whose type changed while
    /// pgapply runs must be noticed before a statement prepared against it is used.
    pub binary_values: bool,
    /// Target tables that receive the rows of more than one published source table (mapped
    /// onto them under `[tables]`), with those source tables `(schema, name)`: a TRUNCATE of
    /// only some of them must not empty the target table.
    pub shared_targets: Arc<SharedTargets>,
    /// Target tables with a unique key only the source defers: a duplicate key there may be a
    /// swap of keys, which the error then says.
    pub deferrable_on_source: Arc<HashSet<String>>,
}

/// Target table (quoted, qualified) -> the published source tables mapped onto it, when more
/// than one is.
pub type SharedTargets = HashMap<String, Vec<(String, String)>>;

/// The schema of pgapply's own state, whose tables are left out of what is replicated, on
/// either side (a source that was a target once has them, and a FOR ALL TABLES publication would
/// publish them). Only pgapply's own: a user's tables in a schema of that name are replicated.
pub const OWN_SCHEMA: &str = "pgapply";

/// The tables pgapply's migrations make in `OWN_SCHEMA`.
pub const OWN_TABLES: [&str; 6] = [
    "progress",
    "copy_state",
    "conflicts",
    "origin_commit",
    "schema_migrations",
    "slot_tables",
];

/// Whether `schema`.`name` is a table of pgapply's own state.
pub fn is_own_table(schema: &str, name: &str) -> bool {
    schema == OWN_SCHEMA && OWN_TABLES.contains(&name)
}

/// SQL that is true for pgapply's own tables, given the expressions of a schema and table name.
pub fn own_table_sql(schema: &str, name: &str) -> String {
    format!(
        "({schema} = '{OWN_SCHEMA}' AND {name} IN ({}))",
        OWN_TABLES
            .iter()
            .map(|t| format!("'{t}'"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// How the target's sessions write and read values, whatever the target database sets: all of
/// a float's digits, ISO dates, hex bytea; xmloption = content because an xml value may be a
/// fragment, which a target set to DOCUMENT would refuse (pg_dump sets the same).
const VALUE_FORMAT: &str = "SET datestyle = ISO; SET intervalstyle = postgres; SET extra_float_digits = 3; SET lc_monetary = 'C'; SET xmloption = content; SET bytea_output = hex";

/// Target tables (slot, schema, name) this process noted in pgapply.slot_tables.
static TABLES_NOTED: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashSet<(String, String, String)>>,
> = std::sync::LazyLock::new(Default::default);

/// Tables (slot, relation) already named by `Applier::entry` in this process: parallel workers
/// and retries share it.
static NOT_COPIED_WARNED: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashSet<(String, Oid)>>,
> = std::sync::LazyLock::new(Default::default);

impl Applier {
    /// Notes that this slot's stream writes a target table (pgapply.slot_tables), once a
    /// process: another slot's `--copy-data --truncate-target` must not empty it. Written at the
    /// next group commit (`note_tables_written`), with the group's other new tables.
    fn note_table_written(&mut self, entry: &RelationEntry) {
        let key = (entry.target.schema.clone(), entry.target.name.clone());
        let noted = TABLES_NOTED
            .lock()
            .map(|noted| noted.contains(&(self.slot.clone(), key.0.clone(), key.1.clone())))
            .unwrap_or(false);
        if !noted && !self.tables_to_note.contains(&key) {
            self.tables_to_note.push(key);
        }
    }

    /// Writes the tables `note_table_written` gathered, in one statement. Best effort (a
    /// failure is logged at debug level, and the tables are noted again when next described):
    /// it protects, it does not apply anything.
    pub(super) async fn note_tables_written(&mut self) {
        if self.tables_to_note.is_empty() {
            return;
        }
        let tables = std::mem::take(&mut self.tables_to_note);
        let (schemas, names): (Vec<String>, Vec<String>) = tables.iter().cloned().unzip();
        // (Prepared once a session: groups go on meeting tables new to this process.)
        let noted = match self
            .catalog
            .prepare_cached(
                "INSERT INTO pgapply.slot_tables (slot_name, schema_name, table_name) \
                 SELECT $1, s, t FROM unnest($2::text[], $3::text[]) AS u (s, t) \
                 ON CONFLICT DO NOTHING",
            )
            .await
        {
            Ok(statement) => {
                self.catalog
                    .execute(&statement, &[&self.slot, &schemas, &names])
                    .await
            }
            Err(e) => Err(e),
        };
        match noted {
            Ok(_) => {
                if let Ok(mut set) = TABLES_NOTED.lock() {
                    set.extend(
                        tables
                            .into_iter()
                            .map(|(schema, name)| (self.slot.clone(), schema, name)),
                    );
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "noting the tables the stream writes in pgapply.slot_tables")
            }
        }
    }

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
            .batch_execute(&format!("{VALUE_FORMAT}; SET row_security = off"))
            .await
            .map_err(|e| Error::postgres("configuring the target apply session", e))?;
        // The session that writes conflict records turns rows into JSON: values as the apply
        // session reads them (all of a float's digits, ISO dates, xml fragments), not as the
        // target database's own settings would show them.
        catalog.batch_execute(VALUE_FORMAT).await.map_err(|e| {
            Error::postgres("configuring the target session for conflict records", e)
        })?;
        // As PostgreSQL's own subscriber: ordinary triggers and foreign-key checks do not fire for
        // replicated changes. Only superusers (or, from 15, roles granted SET on the parameter)
        // may ask for that; others apply with triggers firing, and are told.
        let mut as_replica = true;
        if let Err(e) = client
            .batch_execute("SET session_replication_role = replica")
            .await
        {
            if e.code().is_some_and(|c| c.code() == "42501") {
                as_replica = false;
                // (Said once a process: every apply session of every retry meets it.)
                static SAID: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!("the target role may not set session_replication_role: triggers and foreign-key checks on the target fire for replicated changes (GRANT SET ON PARAMETER session_replication_role TO <role> on PostgreSQL 15+ to avoid that)");
                }
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
        // A role's or database's statement, lock or transaction timeouts (meant for the
        // applications) must not turn waiting into errors: a change held up by a target user's
        // lock is applied once the lock goes (the heartbeat names the blocker meanwhile), and
        // waits for other workers' commits are part of the plan. As PostgreSQL's own apply
        // worker, which such settings do not reach either.
        client
            .batch_execute(
                "SET statement_timeout = 0; SET lock_timeout = 0; \
                 SET idle_in_transaction_session_timeout = 0; \
                 SELECT pg_catalog.set_config(name, '0', false) FROM pg_catalog.pg_settings WHERE name = 'transaction_timeout'",
            )
            .await
            .map_err(|e| Error::postgres("configuring the target apply session", e))?;
        crate::apply::sessions::register(&client).await;
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
        let deferred = prepare("SET CONSTRAINTS ALL DEFERRED".into()).await?;
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
            tables_to_note: Vec::new(),
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
            relations: RelationCache::new(options.table_map.clone())
                .with_column_map(options.column_map.clone()),
            statements: pipeline::StatementCache::default(),
            full_as_text: FULL_AS_TEXT.lock().map(|s| s.clone()).unwrap_or_default(),
            begin,
            deferred,
            commit,
            record,
            immediate,
            origin_commit,
            commit_row,
            check_committed,
            origin_rewind: false,
            resume,
            pending: Vec::new(),
            pending_weight: 0,
            group: None,
            current: None,
            stop_between: Arc::default(),
            applied: applied.into(),
            stats: ApplyStats::default(),
            unsettled_rows: RowCounts::default(),
            spool,
            streaming: None,
            slot: options.slot,
            log_messages: options.log_messages,
            binary_values: options.binary_values,
            shared_targets: options.shared_targets,
            deferrable_on_source: options.deferrable_on_source,
            own_state: HashSet::new(),
            policies: options.policies,
            policy_updates: options.policy_updates,
            skip_lsn: options.skip_lsn,
            conflicts: GroupConflicts::default(),
            prepared_conflicts: HashMap::new(),
            prepared_rows: HashMap::new(),
            skip_records: Vec::new(),
            insert_run: None,
            delete_run: None,
            unique_keys: HashMap::new(),
            deferrable_unique: HashMap::new(),
            may_skip: HashMap::new(),
            as_replica,
            held_updates: HashMap::new(),
            held_rows: 0,
            batchable: HashMap::new(),
            fingerprints: HashMap::new(),
            refused_in: None,
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
            two_phase_slot: options.two_phase,
            copy_checked: HashSet::new(),
            copied_since: options.copied_since,
            copied_since_by_oid: HashMap::new(),
        })
    }

    /// A change of a table copied after the initial copy, from a source transaction that
    /// committed before that copy's snapshot: the copied rows hold it already.
    pub(super) fn in_later_copy(&mut self, entry: &RelationEntry, commit_lsn: Lsn) -> bool {
        if self.copied_since.is_empty() {
            return false;
        }
        let copied = &self.copied_since;
        let since = *self
            .copied_since_by_oid
            .entry(entry.source.oid)
            .or_insert_with(|| {
                copied
                    .by_source
                    .get(&(
                        crate::relation::source_schema(&entry.source).to_owned(),
                        entry.source.name.clone(),
                    ))
                    .copied()
            });
        since.is_some_and(|s| commit_lsn < s)
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
                if first && self.two_phase_slot {
                    tracing::warn!(
                        table = %entry.display_name(),
                        "changes arrive for a table the initial copy did not take in (published, or renamed, after it): rows it had before may be missing on the target, and their updates and deletes would then be missing-row conflicts. --copy-data cannot copy it on a two-phase slot: copy its earlier rows by hand (README: \"A table added to the publication later\")"
                    );
                } else if first {
                    tracing::warn!(
                        table = %entry.display_name(),
                        "changes arrive for a table the initial copy did not take in (published, or renamed, after it): rows it had before may be missing on the target, and their updates and deletes would then be missing-row conflicts. To copy them, start pgapply again with --copy-data (with --truncate-target if the target table holds rows already: the copy has them too; a target table that also holds other tables' rows is not copied into: copy such rows by hand)"
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
            // Asked to stop: the open group commits below, the queue's rest comes again.
            if self.current.is_none()
                && self.stop_between.load(std::sync::atomic::Ordering::Relaxed)
            {
                break;
            }
            // Nothing more to read for now: what is queued goes to the target, which works on
            // it meanwhile (held updates and insert runs stay held, to grow).
            if rx.is_empty() && !self.pending.is_empty() {
                self.submit_pending();
            }
            // A failure noted while sending (answers taken on the way, just above too) ends the
            // run before it waits for more: later answers may be waiting on it, and the source
            // may send nothing more. (On a closed connection every statement fails as it is
            // sent: checked before the send above, the failure waited there unseen.)
            if self.failure.is_some() {
                self.fail_if_failed().await?;
            }
            // When the open group, between source transactions, is to commit if nothing comes.
            // (Not while a COMMIT is unanswered: its answer closes the group, see
            // `group_should_close`.)
            let linger_until = match (&self.group, &self.current, &self.worker) {
                (Some(g), None, None) if self.committing.is_empty() && g.lingers() => {
                    Some(g.started + self.settings.group_linger)
                }
                _ => None,
            };
            let lingered = async {
                match linger_until {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            let next = if !rx.is_empty() {
                Next::Message(rx.recv().await)
            } else if self.in_flight_mut().is_empty() {
                // Nothing under way (or the rest of a transaction still to come): a session the
                // target closed meanwhile (restarted, or the session ended there) is found now,
                // not at the next change, which may come much later while `status` says
                // streaming.
                tokio::select! {
                    envelope = rx.recv() => Next::Message(envelope),
                    () = lingered => Next::Lingered,
                    _ = tokio::time::sleep(Duration::from_secs(2)) => Next::Quiet,
                }
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
                    () = lingered => Next::Lingered,
                    // (Also here: answers that never come on a closed connection.)
                    _ = tokio::time::sleep(Duration::from_secs(2)) => Next::Quiet,
                }
            };
            match next {
                Next::Quiet => {
                    if self.client.is_closed() {
                        return Err(Error::transient(
                            "the apply session's connection to the target was closed (the target restarted, or the session was ended there): starting again",
                        ));
                    }
                }
                Next::Message(None) => break,
                Next::Message(Some(envelope)) => {
                    if envelope.turn.is_some() {
                        self.next_turn = envelope.turn;
                    }
                    self.permit = envelope.permit;
                    if let Err(e) = self.dispatch(envelope.message, envelope.raw).await {
                        // Groups closed before it (their COMMIT sent, its answer not in yet)
                        // are not the failing transaction's: their answers are waited for, so
                        // they count as applied, instead of the process ending first. (Not on
                        // a parallel worker: its statements may wait for others'.)
                        // (Bounded: the failing group's own statements may wait on a lock.)
                        if self.worker.is_none() && !self.committing.is_empty() {
                            let drained =
                                tokio::time::timeout(Duration::from_secs(30), self.drain_to(0))
                                    .await;
                            if drained.is_ok() {
                                self.settle_committed().await;
                            }
                        }
                        return Err(e);
                    }
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
                Next::Lingered => {
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
        // A large one takes minutes on the target, while the stream's position does not move:
        // said every 10 s, so that it does not look stuck.
        let started = Instant::now();
        let mut said = started;
        while let Some(raw) = replay.next_message()? {
            let message = crate::protocol::pgoutput::decode(raw, context).map_err(|e| {
                Error::definite(format!("replaying streamed transaction {xid}: {e}"))
            })?;
            self.handle(message).await?;
            count += 1;
            if count % 1024 == 0 && said.elapsed() >= Duration::from_secs(10) {
                said = Instant::now();
                tracing::info!(
                    xid,
                    messages = count,
                    seconds = started.elapsed().as_secs(),
                    "applying a large streamed transaction"
                );
            }
        }
        if started.elapsed() >= Duration::from_secs(10) {
            tracing::info!(
                xid,
                messages = count,
                seconds = started.elapsed().as_secs(),
                "applied the streamed transaction's changes; committing"
            );
        } else {
            tracing::debug!(xid, messages = count, "replayed streamed transaction");
        }
        Ok(())
    }

    /// How to get past a transaction that cannot be applied.
    fn skip_hint(&self, commit_lsn: Lsn) -> String {
        format!(
            "to skip this source transaction on purpose, run: pgapply skip --target ... --slot {} --lsn {commit_lsn} (then start pgapply again)",
            self.slot
        )
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
                // Idle: commit once the group has lingered, unless the previous COMMIT is still
                // unanswered (the group grows meanwhile and closes when it is answered, or when
                // it is big or old enough).
                one_at_a_time
                    || g.closes_now
                    || (nothing_waiting
                        && self.committing.is_empty()
                        && (!g.lingers() || g.started.elapsed() >= self.settings.group_linger))
                    || g.statements >= self.settings.group_statements
                    || g.started.elapsed() >= self.settings.group_age
            }
        }
    }

    async fn handle(&mut self, message: LogicalMessage) -> Result<()> {
        match message {
            LogicalMessage::Begin(b) => {
                let final_lsn = b.final_lsn;
                self.begin(b)?;
                self.drop_passed_skip(final_lsn).await;
                Ok(())
            }
            LogicalMessage::Commit(c) => self.on_commit(c),
            LogicalMessage::Relation(r) if is_own_table(&r.namespace, &r.name) => {
                self.own_state.insert(r.oid);
                Ok(())
            }
            LogicalMessage::Insert(i) if self.own_state.contains(&i.relation) => Ok(()),
            LogicalMessage::Update(u) if self.own_state.contains(&u.relation) => Ok(()),
            LogicalMessage::Delete(d) if self.own_state.contains(&d.relation) => Ok(()),
            LogicalMessage::Truncate(mut t)
                if t.relations.iter().any(|r| self.own_state.contains(r)) =>
            {
                t.relations.retain(|r| !self.own_state.contains(r));
                if t.relations.is_empty() {
                    return Ok(());
                }
                self.truncate(t).await
            }
            LogicalMessage::Relation(r) => {
                // Held updates were built for the relation as it was.
                self.flush_held_updates(None).await?;
                let name = format!("{}.{}", r.namespace, r.name);
                // A table published since the start whose values do not come back from their
                // binary form (tsquery, int2vector, oidvector, their arrays, aclitem[];
                // `sql::binary_unsafe_type_sql`):
                // the run starts again, and the start sees it and asks for text.
                if self.binary_values {
                    if let Some(c) = r
                        .columns
                        .iter()
                        .find(|c| {
                            c.type_oid == 1034
                                || crate::sql::NOT_READ_BACK_TYPES.contains(&c.type_oid)
                        })
                    {
                        crate::replicate::TEXT_FROM_NOW_ON
                            .store(true, std::sync::atomic::Ordering::SeqCst);
                        return Err(Error::transient(format!(
                            "table {name} has column {} of a type whose binary form PostgreSQL does not read back (tsquery, int2vector, oidvector, aclitem[]): starting again, with values in text form",
                            crate::sql::quote_ident(&c.name)
                        )));
                    }
                }
                match self.relations.update(r, &self.catalog).await {
                    Ok(entry) => {
                        self.note_table_written(&entry);
                        Ok(())
                    }
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
            LogicalMessage::Insert(i) => {
                let r = self.insert(i).await;
                self.alone_if_grouped(r)
            }
            LogicalMessage::Update(u) => {
                let r = self.update(u).await;
                self.alone_if_grouped(r)
            }
            LogicalMessage::Delete(d) => {
                let r = self.delete(d).await;
                self.alone_if_grouped(r)
            }
            LogicalMessage::Truncate(t) => {
                let r = self.truncate(t).await;
                self.alone_if_grouped(r)
            }
            LogicalMessage::Origin(o) => {
                tracing::debug!(origin = %o.name, commit_lsn = %o.commit_lsn, "transaction from origin");
                Ok(())
            }
            LogicalMessage::Message(m) => {
                self.log_message(&m);
                Ok(())
            }
            other => Err(Error::definite(format!(
                "the source sent a {} message where pgapply did not expect one; this is a protocol error",
                other.name()
            ))),
        }
    }

    /// The hook point for logical decoding messages: logged (at info with `--messages`).
    fn log_message(&self, m: &crate::protocol::pgoutput::DecodingMessage) {
        if self.log_messages {
            tracing::info!(prefix = %m.prefix, lsn = %m.lsn, transactional = m.transactional(), bytes = m.content.len(), "logical decoding message");
        } else {
            tracing::debug!(prefix = %m.prefix, lsn = %m.lsn, transactional = m.transactional(), bytes = m.content.len(), "logical decoding message");
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
                closes_now: false,
                statements: 0,
                last_commit: None,
                last_transaction: None,
                transactions: 0,
                turn: turn.clone(),
                relied_on: Vec::new(),
                row_updates: HashMap::new(),
            });
            let begin = self.begin.clone();
            self.pending.push(Pending::plain(begin));
            self.pending.push(Pending::plain(self.deferred.clone()));
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

    /// A `pgapply skip` request for a commit LSN that the stream has passed without a
    /// transaction committing exactly there (a mistyped LSN) can never be carried out:
    /// transactions come in commit order. It is taken back, said, and the transactions are
    /// applied (as PostgreSQL's own subscriber does with a SKIP LSN that matched nothing).
    async fn drop_passed_skip(&mut self, final_lsn: Lsn) {
        // (A parallel worker sees only its share of the transactions: the one asked for may be
        // another worker's.)
        let Some(requested) = self
            .skip_lsn
            .filter(|s| final_lsn > *s && self.worker.is_none())
        else {
            return;
        };
        self.skip_lsn = None;
        tracing::warn!(
            requested = %requested,
            next_commit = %final_lsn,
            "the request to skip the source transaction committed at {requested} matched none (the stream is past it): taken back; give the commit LSN an error printed"
        );
        if let Err(e) = self
            .catalog
            .execute(
                "UPDATE pgapply.progress SET skip_lsn = NULL WHERE slot_name = $1 AND skip_lsn = $2::text::pg_lsn",
                &[&self.slot, &requested.to_string()],
            )
            .await
        {
            tracing::debug!(error = %e, "could not take back the skip request on the target");
        }
    }

    /// A change that cannot be applied (its table's description does not fit the target, say)
    /// while the open group holds earlier source transactions: those must not go down with it.
    /// A column or table renamed on the source while pgapply was behind is the case: the
    /// transactions before the rename need the old name on the target, the one after it the new,
    /// and in one group neither order of fixing it lets both commit. So the group is applied
    /// again one transaction at a time, after which the error is this transaction's alone.
    fn alone_if_grouped(&mut self, result: Result<()>) -> Result<()> {
        match result {
            Err(e)
                if !e.is_transient()
                    && self.worker.is_none()
                    && self.group.as_ref().is_some_and(|g| g.transactions > 0) =>
            {
                let through = self.unbatch(None);
                Err(Error::planned_restart(format!(
                    "{}; applying the source transactions up to commit {through} again one at a time, so that those before it are committed",
                    e.message()
                )))
            }
            other => other,
        }
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
                closes_now: false,
                statements: 0,
                last_commit: None,
                last_transaction: None,
                transactions: 0,
                turn: None,
                relied_on: Vec::new(),
                row_updates: HashMap::new(),
            });
            self.pending.push(Pending::plain(self.begin.clone()));
        }
        self.skip_records.push((txn.xid, txn.final_lsn, time));
        if let Some(group) = &mut self.group {
            group.last_commit = Some((end_lsn, time));
            group.closes_now = true;
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

/// Tables (by source OID) whose REPLICA IDENTITY FULL rows are compared by their text form,
/// learnt when a statement failed: kept for the whole process, so that a run started again after
/// that failure aborted its transaction compares them so from the start.
static FULL_AS_TEXT: std::sync::LazyLock<std::sync::Mutex<HashSet<Oid>>> =
    std::sync::LazyLock::new(Default::default);
