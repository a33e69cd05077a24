//! Parallel apply (`--apply-workers N`): source transactions spread over N target connections.
//!
//! One connection applies one statement at a time on the target. When the target is the
//! bottleneck (a slow or distant server), several connections apply more. The dispatcher here
//! receives whole source transactions, finds the rows each one touches (target table and replica
//! identity key values, hashed), and hands it to a worker: an `Applier` with its own connection,
//! replication origin and pipeline.
//!
//! Rules, in the order the source committed:
//! - A transaction that touches a row an earlier, not yet committed one touched goes to the
//!   worker of the latest such transaction, behind it (one connection applies in order). Earlier
//!   ones on other workers that share rows with it are its dependencies: before any of its changes
//!   it waits on the server for their commits (`pgapply.wait_for_commit`), so it never races them
//!   for a row or misses a row they insert.
//! - Only tables whose rows are told apart by their key alone run in parallel: on the target a
//!   plain table whose only unique index is the key's, without foreign keys, exclusion
//!   constraints, triggers, rules or inheritance children (`batch::independent`), published with
//!   a key (not REPLICA IDENTITY FULL or NOTHING). A transaction touching any other table, a
//!   TRUNCATE, a streamed transaction, one skipped on request, and one too large to hold are
//!   serial: it starts after every earlier one has committed, and nothing starts before it has.
//! - Commits happen in source order. Each worker transaction takes an advisory lock keyed by its
//!   place in the order (`pg_advisory_xact_lock(<slot key>, seq)`) right after BEGIN. Before its
//!   COMMIT, the next transaction waits on the server (`pgapply.wait_for_commit`: the lock in
//!   shared mode, polling while it is not taken yet) until its predecessor's worker origin has
//!   reached the predecessor's end, so it commits after the predecessor, and not at all if that
//!   failed. On the same connection a look at the origin is enough. All waits point to earlier
//!   transactions, so they can not form a cycle; rows the dispatcher could not know about end in
//!   a deadlock error (or the wait's timeout), and the run is retried with the transactions that
//!   were in flight applied one at a time.
//! - Each worker records its position in its own replication origin (`pgapply_<slot>` for the
//!   first, `pgapply_<slot>-w<i>` for the others). Commits in source order make the latest of them
//!   the position of the whole: everything before it is committed (`ProgressStore`).

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};

use futures_util::StreamExt;

use super::applier::{ApplyStats, Envelope};
use super::Applier;
use crate::error::{Error, Result};
use crate::protocol::pgoutput::{LogicalMessage, Oid, ReplicaIdentity};
use crate::protocol::{Lsn, Tuple, Value};
use crate::relation::RelationCache;

/// A dispatched transaction's place in the commit order.
#[derive(Debug, Clone)]
pub struct Turn {
    /// 1, 2, 3 ... in source commit order, for this run.
    pub seq: u64,
    /// The transaction dispatched just before, when it may not have committed yet.
    pub after: Option<After>,
    /// Earlier transactions of other workers, not known to have committed, that touched rows this
    /// one touches: they must commit before this one changes anything.
    pub deps: Vec<After>,
}

#[derive(Debug, Clone, Copy)]
pub struct After {
    pub seq: u64,
    pub worker: usize,
    pub end_lsn: Lsn,
}

/// What a worker needs to keep the commit order with the others.
#[derive(Debug, Clone)]
pub struct WorkerRole {
    pub index: usize,
    /// First key of the turn locks: one per slot, so two pgapply runs on one target do not meet.
    pub lock_key: i32,
    /// Every worker's replication origin, by index.
    pub origins: Arc<Vec<String>>,
}

/// The lock key of a slot's turn locks.
pub fn lock_key(slot: &str) -> i32 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ("pgapply turn", slot).hash(&mut h);
    h.finish() as i32
}

/// The second key of a turn's lock (advisory lock keys are 32-bit; turns far apart may share one
/// harmlessly, the check after the wait tells them apart).
pub fn turn_key(seq: u64) -> i32 {
    (seq % (i32::MAX as u64)) as i32
}

/// Built-in types whose text form is equal exactly when the values are: bool, bytea, char, name,
/// int8, int2, int4, text, oid, varchar, date, time, timestamp, timestamptz, uuid. (text and
/// varchar when the target's key index compares them by a deterministic collation, as the
/// default one does: `batch::independent` says no otherwise, and the table is applied serially.)
const BYTE_EQUAL_TYPES: &[Oid] = &[
    16, 17, 18, 19, 20, 21, 23, 25, 26, 1043, 1082, 1083, 1114, 1184, 2950,
];

/// Most messages of one transaction held to find its rows; a larger one is applied serially as
/// it arrives.
const MAX_HELD_MESSAGES: usize = 8_192;

/// How a parallel table's rows are told apart: its target table, and the source positions of its
/// key columns in the target's column order.
struct RowKey {
    table: Oid,
    columns: Vec<usize>,
}

/// A worker as the dispatcher sees it.
pub struct WorkerLink {
    pub tx: mpsc::UnboundedSender<Envelope>,
}

/// The transaction being received.
struct Held {
    final_lsn: Lsn,
    envelopes: Vec<Envelope>,
    /// The envelopes' share of the reader's queue.
    bytes: usize,
    rows: Vec<u64>,
    serial: bool,
    /// Applied before a restart: only its Relation and Type messages matter.
    skip: bool,
    /// Too large to hold: being forwarded to this worker as it arrives.
    direct: Option<usize>,
}

pub struct Dispatcher {
    /// See `Applier::stop_between`.
    stop_between: Arc<std::sync::atomic::AtomicBool>,
    workers: Vec<WorkerLink>,
    /// The end LSN of the latest committed transaction (commits are in order).
    applied: watch::Receiver<Lsn>,
    /// Turns true when a worker stops.
    stopped: watch::Receiver<bool>,
    catalog: deadpool_postgres::Object,
    relations: RelationCache,
    /// Whether a relation's changes may run in parallel, by source OID.
    keys: HashMap<Oid, Option<RowKey>>,
    resume: Lsn,
    skip_lsn: Option<Lsn>,
    /// Transactions committing at or before this run serially (after a failure in parallel).
    serial_through: Arc<std::sync::atomic::AtomicU64>,
    /// Rows touched by transactions that may not have committed yet: (worker, turn, end LSN).
    rows: HashMap<u64, (usize, u64, Lsn)>,
    rows_pruned_at: usize,
    /// Per worker: the end LSNs of its transactions that may not have committed yet.
    outstanding: Vec<VecDeque<Lsn>>,
    seq: u64,
    last: Option<After>,
    last_end: Lsn,
    held: Option<Held>,
    /// Inside a Stream Start .. Stream Stop block.
    streaming: bool,
    next_worker: usize,
    queue_bytes: usize,
}

pub struct DispatcherOptions {
    pub resume: Lsn,
    pub skip_lsn: Option<Lsn>,
    pub serial_through: Arc<std::sync::atomic::AtomicU64>,
    pub table_map: Arc<crate::config::TableMap>,
    pub column_map: Arc<crate::config::ColumnMap>,
    pub queue_bytes: usize,
}

impl Dispatcher {
    pub fn new(
        workers: Vec<WorkerLink>,
        applied: watch::Receiver<Lsn>,
        stopped: watch::Receiver<bool>,
        catalog: deadpool_postgres::Object,
        options: DispatcherOptions,
    ) -> Self {
        let n = workers.len();
        Dispatcher {
            workers,
            applied,
            stopped,
            catalog,
            relations: RelationCache::new(options.table_map).with_column_map(options.column_map),
            keys: HashMap::new(),
            resume: options.resume,
            skip_lsn: options.skip_lsn,
            serial_through: options.serial_through,
            rows: HashMap::new(),
            rows_pruned_at: 1024,
            outstanding: vec![VecDeque::new(); n],
            seq: 0,
            last: None,
            last_end: Lsn::INVALID,
            held: None,
            stop_between: Arc::default(),
            streaming: false,
            next_worker: 0,
            queue_bytes: options.queue_bytes,
        }
    }

    /// Dispatches until the queue closes or a worker stops. A transaction still incomplete then
    /// is dropped: it is sent again after a restart.
    pub async fn run(&mut self, rx: &mut mpsc::UnboundedReceiver<Envelope>) -> Result<()> {
        loop {
            // Asked to stop: the workers finish what they were handed, the rest comes again.
            if self.held.is_none() && !self.streaming && self.stop_between.load(Ordering::Relaxed) {
                return Ok(());
            }
            let envelope = tokio::select! {
                envelope = rx.recv() => envelope,
                _ = self.stopped.wait_for(|s| *s) => return Ok(()),
            };
            let Some(envelope) = envelope else {
                return Ok(());
            };
            self.route(envelope).await?;
        }
    }

    /// The end of the last transaction handed to a worker.
    pub fn last_end(&self) -> Lsn {
        self.last_end
    }

    async fn route(&mut self, envelope: Envelope) -> Result<()> {
        match &envelope.message {
            LogicalMessage::StreamStart(_) => {
                self.streaming = true;
                self.send(0, envelope)
            }
            LogicalMessage::StreamStop => {
                self.streaming = false;
                self.send(0, envelope)
            }
            // Spooled by the first worker until the transaction's Stream Commit. A table
            // description is needed by every worker: pgoutput does not send it again for later
            // transactions once the streamed one commits.
            LogicalMessage::Relation(r) if self.streaming => {
                self.learn(r.clone()).await?;
                for w in 1..self.workers.len() {
                    self.send(w, copy(&envelope))?;
                }
                self.send(0, envelope)
            }
            LogicalMessage::Type(_) if self.streaming => {
                for w in 1..self.workers.len() {
                    self.send(w, copy(&envelope))?;
                }
                self.send(0, envelope)
            }
            _ if self.streaming => self.send(0, envelope),
            LogicalMessage::StreamAbort(_) => self.send(0, envelope),
            LogicalMessage::StreamCommit(c) => {
                let end = c.end_lsn;
                self.wait_applied(self.last_end).await?;
                self.send(0, envelope)?;
                self.after_serial(end).await
            }
            LogicalMessage::Begin(b) => {
                if let Some(held) = &self.held {
                    return Err(Error::definite(format!(
                        "the source began a transaction while the one committing at {} was still open; this is a protocol error",
                        held.final_lsn
                    )));
                }
                let final_lsn = b.final_lsn;
                let skip = self.resume.is_valid() && final_lsn < self.resume;
                let serial = self.skip_lsn == Some(final_lsn)
                    || final_lsn.0 <= self.serial_through.load(Ordering::Relaxed);
                self.held = Some(Held {
                    final_lsn,
                    envelopes: vec![envelope],
                    bytes: 0,
                    rows: Vec::new(),
                    serial,
                    skip,
                    direct: None,
                });
                Ok(())
            }
            LogicalMessage::Commit(c) => {
                let end = c.end_lsn;
                if self.held.is_none() {
                    // The worker reports the protocol error.
                    return self.send(0, envelope);
                }
                self.hold(envelope).await?;
                self.dispatch(end).await
            }
            LogicalMessage::Relation(r) => {
                self.learn(r.clone()).await?;
                if self.held.is_some() {
                    self.hold(envelope).await
                } else {
                    self.broadcast(envelope)
                }
            }
            LogicalMessage::Type(_) if self.held.is_none() => self.broadcast(envelope),
            _ if self.held.is_some() => {
                let touched = self.touched(&envelope.message);
                if let Some(held) = &mut self.held {
                    match touched {
                        Some(rows) => held.rows.extend(rows),
                        None => held.serial = true,
                    }
                }
                self.hold(envelope).await
            }
            // Non-transactional messages and anything unexpected: the first worker handles
            // (or reports) them.
            _ => self.send(0, envelope),
        }
    }

    /// Reads a Relation message: where its table goes and whether it may run in parallel.
    async fn learn(&mut self, relation: crate::protocol::pgoutput::Relation) -> Result<()> {
        let oid = relation.oid;
        // Keys are compared by their bytes: only types whose equal values have equal text run
        // in parallel (not numeric 1.0 and 1.00, floats, case-insensitive text ...).
        let keyed = matches!(
            relation.replica_identity,
            ReplicaIdentity::Default | ReplicaIdentity::Index
        ) && relation
            .columns
            .iter()
            .filter(|c| c.is_key())
            .all(|c| BYTE_EQUAL_TYPES.contains(&c.type_oid));
        // A table the target lacks is the workers' error to report; here it is just serial.
        let key = match self.relations.update(relation, &self.catalog).await {
            Ok(entry)
                if keyed
                    && super::batch::independent(&self.catalog, &entry)
                        .await
                        .is_ok_and(|f| f.is_some()) =>
            {
                // In the target's column order: two source tables mapped onto one agree.
                let mut columns = entry.key_columns.clone();
                columns.sort_by_key(|&c| entry.target_columns.get(c).copied());
                Some(RowKey {
                    table: entry.target.oid,
                    columns,
                })
            }
            _ => None,
        };
        tracing::debug!(
            relation = oid,
            parallel = key.is_some(),
            "parallel apply of the relation's changes"
        );
        self.keys.insert(oid, key);
        // Its catalog session gone (ended on the target, the connection lost): this table, and
        // every one learnt from here on, would go serial, slowly and without a word. Started
        // again instead, as one apply session would be.
        if self.catalog.is_closed() {
            return Err(crate::error::Error::transient(
                "the target session that reads table descriptions for --apply-workers ended (terminated on the target, or its connection lost): starting again",
            ));
        }
        Ok(())
    }

    /// The rows a change touches, hashed; `None` when they can not be told (serial).
    fn touched(&self, message: &LogicalMessage) -> Option<Vec<u64>> {
        let (relation, tuples): (Oid, Vec<&Tuple>) = match message {
            LogicalMessage::Insert(i) => (i.relation, vec![&i.new]),
            LogicalMessage::Update(u) => (
                u.relation,
                u.old.iter().map(|o| o.tuple()).chain([&u.new]).collect(),
            ),
            LogicalMessage::Delete(d) => (d.relation, vec![d.old.tuple()]),
            LogicalMessage::Origin(_) | LogicalMessage::Message(_) | LogicalMessage::Type(_) => {
                return Some(Vec::new())
            }
            _ => return None,
        };
        let key = self.keys.get(&relation)?.as_ref()?;
        tuples
            .into_iter()
            .map(|tuple| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                key.table.hash(&mut h);
                for &c in &key.columns {
                    match tuple.values().nth(c)? {
                        Value::Text(b) | Value::Binary(b) => b.hash(&mut h),
                        Value::Null => 0u8.hash(&mut h),
                        // A key value is always sent.
                        Value::UnchangedToast => return None,
                    }
                }
                Some(h.finish())
            })
            .collect()
    }

    /// Adds a message to the transaction being received; one that grows too large is forwarded
    /// as it arrives, serially.
    async fn hold(&mut self, envelope: Envelope) -> Result<()> {
        let Some(held) = &mut self.held else {
            return self.send(0, envelope);
        };
        if let Some(worker) = held.direct {
            return self.send_in_transaction(worker, envelope);
        }
        if held.skip
            && !matches!(
                envelope.message,
                LogicalMessage::Relation(_) | LogicalMessage::Type(_) | LogicalMessage::Commit(_)
            )
        {
            // Applied before: only its table descriptions matter (and it may be large).
            return Ok(());
        }
        // Counted as the reader's queue counts it (its permit: the bytes and what the decoded
        // message costs besides): held envelopes keep their share of the queue, and a
        // transaction held past the queue's size would wait for messages the reader cannot
        // queue any more.
        held.bytes += envelope
            .permit
            .as_ref()
            .map_or(envelope.raw.len(), |p| p.num_permits());
        held.envelopes.push(envelope);
        let too_large =
            held.envelopes.len() > MAX_HELD_MESSAGES || held.bytes > self.queue_bytes / 4;
        if too_large && !held.skip {
            held.serial = true;
            held.direct = Some(0);
            let envelopes = std::mem::take(&mut held.envelopes);
            self.wait_applied(self.last_end).await?;
            for envelope in envelopes {
                self.send_in_transaction(0, envelope)?;
            }
        }
        Ok(())
    }

    /// A whole transaction has arrived: hands it to a worker.
    async fn dispatch(&mut self, end: Lsn) -> Result<()> {
        let Some(held) = self.held.take() else {
            return Ok(());
        };
        if held.skip {
            // Applied before: the workers still need its table descriptions.
            for envelope in held.envelopes {
                if matches!(
                    envelope.message,
                    LogicalMessage::Relation(_) | LogicalMessage::Type(_)
                ) {
                    self.broadcast(envelope)?;
                }
            }
            return Ok(());
        }
        if held.direct.is_some() {
            return self.after_serial(end).await;
        }
        if held.serial {
            tracing::trace!(commit_lsn = %held.final_lsn, "applying a transaction serially");
            self.wait_applied(self.last_end).await?;
            for envelope in held.envelopes {
                self.send_in_transaction(0, envelope)?;
            }
            return self.after_serial(end).await;
        }
        self.prune();
        let (worker, deps) = self.choose(&held.rows);
        self.seq += 1;
        let applied = *self.applied.borrow();
        let turn = Turn {
            seq: self.seq,
            after: self.last.filter(|a| a.end_lsn > applied),
            deps,
        };
        for row in held.rows {
            self.rows.insert(row, (worker, self.seq, end));
        }
        self.outstanding[worker].push_back(end);
        self.last = Some(After {
            seq: self.seq,
            worker,
            end_lsn: end,
        });
        self.last_end = end;
        tracing::trace!(seq = turn.seq, worker, after = ?turn.after.map(|a| a.seq), "dispatched");
        let mut turn = Some(turn);
        for mut envelope in held.envelopes {
            if matches!(envelope.message, LogicalMessage::Begin(_)) {
                envelope.turn = turn.take();
            }
            self.send_in_transaction(worker, envelope)?;
        }
        Ok(())
    }

    /// The worker for a transaction touching `rows`: the one holding the latest earlier
    /// transaction it shares a row with (one connection applies in order), or the least busy one.
    /// Earlier transactions on other workers that share rows with it are returned as dependencies:
    /// it waits for their commits on the server before changing anything.
    fn choose(&mut self, rows: &[u64]) -> (usize, Vec<After>) {
        let applied = *self.applied.borrow();
        // The latest uncommitted transaction per worker that shares a row with this one.
        let mut latest: Vec<Option<After>> = vec![None; self.workers.len()];
        for row in rows {
            if let Some(&(worker, seq, end_lsn)) = self.rows.get(row) {
                if end_lsn > applied && latest[worker].is_none_or(|a| a.seq < seq) {
                    latest[worker] = Some(After {
                        seq,
                        worker,
                        end_lsn,
                    });
                }
            }
        }
        let mut deps: Vec<After> = latest.into_iter().flatten().collect();
        let Some(newest) = deps.iter().max_by_key(|a| a.seq).copied() else {
            return (self.least_busy(), Vec::new());
        };
        deps.retain(|a| a.worker != newest.worker);
        (newest.worker, deps)
    }

    fn least_busy(&mut self) -> usize {
        let n = self.workers.len();
        let start = self.next_worker;
        let best = (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&w| self.outstanding[w].len())
            .unwrap_or(0);
        self.next_worker = (best + 1) % n;
        best
    }

    /// Forgets committed transactions: all of them per worker, rows when there are many.
    fn prune(&mut self) {
        let applied = *self.applied.borrow();
        for queue in &mut self.outstanding {
            while queue.front().is_some_and(|&e| e <= applied) {
                queue.pop_front();
            }
        }
        if self.rows.len() < self.rows_pruned_at {
            return;
        }
        self.rows.retain(|_, (_, _, end)| *end > applied);
        self.rows_pruned_at = (self.rows.len() * 2).max(1024);
    }

    /// A serial transaction was handed over: nothing starts before it has committed.
    async fn after_serial(&mut self, end: Lsn) -> Result<()> {
        self.wait_applied(end).await?;
        self.last = None;
        self.last_end = end;
        Ok(())
    }

    /// Waits until every transaction ending at or before `lsn` has committed.
    async fn wait_applied(&mut self, lsn: Lsn) -> Result<()> {
        if !lsn.is_valid() {
            return Ok(());
        }
        tracing::trace!(%lsn, applied = %*self.applied.borrow(), "waiting for earlier transactions to commit");
        tokio::select! {
            r = self.applied.wait_for(|a| *a >= lsn) => {
                r.map(|_| ()).map_err(|_| Error::transient("an apply worker stopped"))
            }
            _ = self.stopped.wait_for(|s| *s) => Err(Error::transient("an apply worker stopped")),
        }
    }

    /// Sends a message of a transaction to its worker; Relation and Type messages also go to
    /// every other worker, which need them for their own transactions.
    fn send_in_transaction(&mut self, worker: usize, envelope: Envelope) -> Result<()> {
        if matches!(
            envelope.message,
            LogicalMessage::Relation(_) | LogicalMessage::Type(_)
        ) {
            for w in (0..self.workers.len()).filter(|&w| w != worker) {
                self.send(w, copy(&envelope))?;
            }
        }
        self.send(worker, envelope)
    }

    fn broadcast(&mut self, envelope: Envelope) -> Result<()> {
        for w in 1..self.workers.len() {
            self.send(w, copy(&envelope))?;
        }
        self.send(0, envelope)
    }

    fn send(&self, worker: usize, envelope: Envelope) -> Result<()> {
        self.workers[worker]
            .tx
            .send(envelope)
            .map_err(|_| Error::transient(format!("apply worker {worker} stopped")))
    }
}

/// A parallel apply, connected and ready: the dispatcher and its workers.
pub struct Workers {
    pub dispatcher: Dispatcher,
    pub workers: Vec<(Applier, mpsc::UnboundedReceiver<Envelope>)>,
    /// Set when a worker stops (the dispatcher watches it).
    pub stopped: watch::Sender<bool>,
    pub serial_through: Arc<std::sync::atomic::AtomicU64>,
}

/// Sets `stopped` when a worker's task ends, however it ends.
struct StopOnDrop(Arc<watch::Sender<bool>>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

impl Workers {
    pub fn stop_between(&mut self, stop: Arc<std::sync::atomic::AtomicBool>) {
        self.dispatcher.stop_between = stop;
    }

    /// Applies what arrives on `rx` until it closes or a worker fails.
    pub async fn run(self, rx: &mut mpsc::UnboundedReceiver<Envelope>) -> (ApplyStats, Result<()>) {
        let Workers {
            mut dispatcher,
            workers,
            stopped,
            serial_through,
        } = self;
        let stopped = Arc::new(stopped);
        // The first worker failure is the one to report: the others follow from it.
        let first_failure: Arc<std::sync::Mutex<Option<Error>>> = Arc::default();
        // Set to end the workers where they are (their open transactions roll back); each
        // still returns what it committed, so the run's last line counts it.
        let (end_workers, end_seen) = watch::channel(false);
        let mut tasks = Vec::new();
        for (mut applier, mut worker_rx) in workers {
            let stopped = StopOnDrop(stopped.clone());
            let first_failure = first_failure.clone();
            let mut end_seen = end_seen.clone();
            tasks.push(tokio::spawn(tracing::Instrument::in_current_span(
                async move {
                    let _stopped = stopped;
                    tokio::select! {
                        result = applier.run(&mut worker_rx) => {
                            if let Err(e) = result {
                                if let Ok(mut first) = first_failure.lock() {
                                    first.get_or_insert(e);
                                }
                            }
                        }
                        _ = end_seen.wait_for(|end| *end) => {}
                    }
                    applier.stats.clone()
                },
            )));
        }
        let stopping = dispatcher.stop_between.clone();
        // Asked to stop: a worker may wait on the target (a user's lock), and the others, and the
        // dispatcher, for its commits. Given a few seconds to end at a transaction boundary,
        // the workers still busy are ended: their open transactions roll back, and each
        // worker's origin keeps what it committed, so nothing is lost; the process then stops
        // cleanly instead of running into the forced stop.
        let mut stop_seen: Option<std::time::Instant> = None;
        let mut ended_for_stop = false;
        let end_for_stop = |stop_seen: &mut Option<std::time::Instant>, ended: &mut bool| {
            if *ended || !stopping.load(Ordering::Relaxed) {
                return;
            }
            let seen = *stop_seen.get_or_insert_with(std::time::Instant::now);
            if seen.elapsed() >= STOP_WAIT {
                tracing::info!("stopping: ending the apply workers still busy on the target (their open transactions roll back)");
                end_workers.send_replace(true);
                *ended = true;
            }
        };
        let dispatched = {
            let dispatch = dispatcher.run(rx);
            tokio::pin!(dispatch);
            loop {
                tokio::select! {
                    d = &mut dispatch => break d,
                    _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {
                        end_for_stop(&mut stop_seen, &mut ended_for_stop);
                    }
                }
            }
        };
        let last_end = dispatcher.last_end();
        // Closing the workers' queues lets them finish what they have and stop.
        drop(dispatcher);
        let mut running: futures_util::stream::FuturesUnordered<_> = tasks.into_iter().collect();
        let mut stats = ApplyStats::default();
        let mut result = Ok(());
        loop {
            let joined = tokio::select! {
                joined = running.next() => joined,
                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {
                    end_for_stop(&mut stop_seen, &mut ended_for_stop);
                    continue;
                }
            };
            let Some(joined) = joined else { break };
            match joined {
                Ok(s) => stats.add(&s),
                Err(e) if e.is_cancelled() => {}
                // (A panic: its session, back in the pool, may still hold its turn lock; the
                // others are stopped below rather than left waiting for it.)
                Err(e) => {
                    if let Ok(mut first) = first_failure.lock() {
                        first
                            .get_or_insert(Error::definite(format!("an apply worker failed: {e}")));
                    }
                }
            }
            if first_failure.lock().is_ok_and(|f| f.is_some()) {
                // The others may be waiting on the server for a transaction that will not
                // commit now: drop their connections rather than wait for that.
                end_workers.send_replace(true);
            }
        }
        let failure = first_failure.lock().ok().and_then(|mut f| f.take());
        if let Some(e) = failure {
            // The transactions in flight when it failed are applied one at a time by the retry,
            // in case they depend on each other in ways not seen here.
            serial_through.fetch_max(last_end.0, Ordering::Relaxed);
            result = Err(e);
        } else if ended_for_stop {
            // (The dispatcher saw its workers end: that was the stop.)
        } else if result.is_ok() {
            result = dispatched;
        }
        (stats, result)
    }
}

/// How long a stop waits for the workers to reach a transaction boundary before ending them.
const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A copy of a message for another worker (its bytes count once against the queue's budget).
fn copy(envelope: &Envelope) -> Envelope {
    Envelope {
        message: envelope.message.clone(),
        raw: envelope.raw.clone(),
        permit: None,
        turn: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_keys_stay_in_range() {
        assert_eq!(turn_key(1), 1);
        assert_eq!(turn_key(i32::MAX as u64), 0);
        assert!(turn_key(u64::MAX) >= 0);
        assert_eq!(lock_key("a"), lock_key("a"));
        assert_ne!(lock_key("a"), lock_key("b"));
    }
}
