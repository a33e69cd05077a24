//! `--streaming parallel`: a streamed transaction applied while it arrives, on a target connection
//! of its own (the helper), instead of being spooled and applied at its Stream Commit.
//!
//! The main applier keeps applying ordinary transactions on its connection. The first streamed
//! transaction that starts while the helper is free goes to the helper: every block of it is
//! forwarded as it arrives, subtransactions become savepoints (a subtransaction's abort rolls back
//! to its savepoint), and nothing commits until its Stream Commit. Streamed transactions that start
//! while the helper is busy are spooled as with `--streaming on`.
//!
//! Order: before each block is forwarded, the main applier commits what it received before the
//! block and waits for those commits (the block's changes may touch their rows). At Stream Commit
//! it does the same, then the helper commits, with its position in its own replication origin, and the
//! main applier waits for that answer before it commits anything later. The resume position is
//! the latest over all of pgapply's origins of the slot (see `ProgressStore::durable_position`).
//!
//! Deadlock: on the source, a transaction that commits before the streamed one cannot have
//! touched its rows, but the target may have what the source does not (a trigger enabled ALWAYS
//! that updates a shared row, an extra unique index). Then an ordinary transaction on the main
//! connection can wait for a row lock of the helper's open transaction, which can only commit
//! after the main connection gets past that transaction: a wait no server sees as a deadlock.
//! A watchdog asks the target every second whether the main session waits for the helper's
//! while the helper is idle with nothing left to send; five times in a row, and it cancels the
//! main session's statement. The other direction cannot hang: the helper's backlog has a budget of its
//! own, and the main applier waits for that budget only inside a block, when it has committed
//! everything and holds no lock.
//! Whenever applying fails while the helper holds a transaction, the error is retried with
//! streamed transactions spooled for the rest of the process (`ApplySettings::live_streaming_off`),
//! so a transaction that cannot be applied this way is applied the proven way. A lost target
//! connection (the target restarted, its sessions ended) is not such a failure: the run is
//! retried still applying streamed transactions as they arrive.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinHandle;
use tokio_postgres::Statement;

use super::{streamed_xid, Applier, ApplyStats, Envelope, Pending};
use crate::error::{Error, Result};
use crate::protocol::pgoutput::{
    Begin, Commit, DecodingMessage, LogicalMessage, StreamAbort, StreamCommit, StreamStart, Xid,
};
use crate::protocol::{Lsn, PgTimestamp};

/// How often the watchdog looks for the main session waiting on the helper's.
const WATCHDOG_EVERY: Duration = Duration::from_secs(1);

/// How many looks in a row must find that wait before the watchdog cancels it. A wait on a row
/// the helper is about to release (a subtransaction abort not sent yet), or at the end of a run
/// (the helper's transaction is given up once the reader has seen the end), is not a deadlock;
/// on a busy machine these take a second or two.
const WATCHDOG_LOOKS: u32 = 5;

/// The sessions the main session ($2) waits for, directly or behind other sessions.
macro_rules! blockers_of_main {
    () => {
        "WITH RECURSIVE blockers(pid) AS ( \
           SELECT unnest(pg_catalog.pg_blocking_pids($2::int4)) \
           UNION SELECT unnest(pg_catalog.pg_blocking_pids(b.pid)) FROM blockers b) "
    };
}

/// Whether the main session ($2) waits for the helper's ($1), while the helper's session sits
/// idle in its transaction.
const WAITS_FOR_HELPER: &str = concat!(
    blockers_of_main!(),
    "SELECT coalesce($1::int4 IN (SELECT pid FROM blockers) \
       AND (SELECT state = 'idle in transaction' FROM pg_catalog.pg_stat_activity \
            WHERE pid = $1::int4), false)"
);

/// Cancels the main session's statement only if it still waits for the helper's (the same
/// test in the same statement, so the cancel cannot hit a later statement).
const CANCEL_IF_WAITING: &str = concat!(
    blockers_of_main!(),
    "SELECT pg_catalog.pg_cancel_backend($2::int4) WHERE $1::int4 IN (SELECT pid FROM blockers)"
);

/// Bytes of messages forwarded to the helper and not yet handed to its connection.
const HELPER_QUEUE_BYTES: usize = 16 * 1024 * 1024;

/// The main applier's side: the helper it forwards to.
pub(crate) struct LiveLink {
    tx: mpsc::UnboundedSender<Envelope>,
    task: Option<JoinHandle<(ApplyStats, Result<()>)>>,
    /// The helper's applied position: its commits.
    applied: watch::Receiver<Lsn>,
    /// The streamed transaction the helper holds.
    xid: Option<Xid>,
    /// Inside a block of that transaction (Stream Start .. Stop).
    in_block: bool,
    /// The helper's backlog: its own budget, so that a helper waiting on the main session
    /// never holds the budget the main applier needs to get there.
    budget: Arc<Semaphore>,
    /// Messages forwarded and not yet dispatched by the helper.
    queued: Arc<AtomicUsize>,
    watchdog: Watchdog,
    off: Arc<AtomicBool>,
}

struct Watchdog {
    /// A pool of its own: a connection per look, so a lost one is replaced.
    pool: deadpool_postgres::Pool,
    main_pid: i32,
    helper_pid: i32,
    queued: Arc<AtomicUsize>,
    /// Set when it found the main session waiting on the helper's and cancelled it.
    fired: Arc<AtomicBool>,
    task: Option<JoinHandle<()>>,
}

impl Watchdog {
    fn start(&mut self) {
        self.stop();
        let pool = self.pool.clone();
        let (main_pid, helper_pid) = (self.main_pid, self.helper_pid);
        let queued = self.queued.clone();
        let fired = self.fired.clone();
        self.task = Some(tokio::spawn(tracing::Instrument::in_current_span(
            async move {
                let mut seen = 0;
                let mut warned: Option<std::time::Instant> = None;
                loop {
                    tokio::time::sleep(WATCHDOG_EVERY).await;
                    let idle = queued.load(Ordering::SeqCst) == 0;
                    let blocked = match pool.get().await {
                        Ok(conn) => conn
                            .query_one(WAITS_FOR_HELPER, &[&helper_pid, &main_pid])
                            .await
                            .map(|r| r.get::<_, bool>(0))
                            .map_err(|e| crate::error::describe_postgres(&e)),
                        // (The pool's own text hides the server's reason: "db error".)
                        Err(deadpool_postgres::PoolError::Backend(e)) => {
                            Err(crate::error::describe_postgres(&e))
                        }
                        Err(e) => Err(e.to_string()),
                    };
                    match blocked {
                        Ok(true) if idle => seen += 1,
                        Ok(_) => seen = 0,
                        Err(e) => {
                            // Once in a while: it asks every WATCHDOG_EVERY, and a target that
                            // restarts is said by the heartbeat too.
                            if warned.is_none_or(|at: std::time::Instant| {
                                at.elapsed() >= std::time::Duration::from_secs(30)
                            }) {
                                warned = Some(std::time::Instant::now());
                                tracing::warn!(error = %e, "the deadlock watchdog could not ask the target; trying again");
                            } else {
                                tracing::debug!(error = %e, "the deadlock watchdog could not ask the target");
                            }
                            seen = 0;
                        }
                    }
                    if seen < WATCHDOG_LOOKS {
                        continue;
                    }
                    seen = 0;
                    // Set before the cancel: its failure can reach the main applier (which then drops
                    // this task) before the answer below arrives here.
                    fired.store(true, Ordering::SeqCst);
                    let cancelled = match pool.get().await {
                        Ok(conn) => conn
                            .query_opt(CANCEL_IF_WAITING, &[&helper_pid, &main_pid])
                            .await
                            .map(|row| row.is_some_and(|r| r.get::<_, bool>(0)))
                            .map_err(|e| crate::error::describe_postgres(&e)),
                        Err(e) => Err(e.to_string()),
                    };
                    match cancelled {
                        Ok(true) => {
                            tracing::warn!(
                            "the main apply session waited for rows the streamed transaction holds on the target; its statement was cancelled (the run restarts with streamed transactions spooled)"
                        );
                        }
                        Ok(false) => fired.store(false, Ordering::SeqCst),
                        Err(e) => {
                            fired.store(false, Ordering::SeqCst);
                            tracing::warn!(error = %e, "could not cancel the blocked apply session; trying again");
                        }
                    }
                }
            },
        )));
    }

    fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for LiveLink {
    fn drop(&mut self) {
        self.watchdog.stop();
        // An open transaction on the helper ends with its connection.
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The helper's side: the savepoints of the open transaction.
pub(crate) struct HelperState {
    /// Subtransactions with changes, in the order their savepoints were made (and as a set).
    subxacts: Vec<Xid>,
    /// Per savepoint: the transaction's row counts when it was made, what a rollback to it
    /// brings them back to (rows undone are not applied, so not counted).
    rows_at: Vec<super::RowCounts>,
    known: std::collections::HashSet<Xid>,
    /// Transactional logical decoding messages of the open transaction, logged at its Stream
    /// Commit: one of a subtransaction that rolls back later was never committed on the source.
    /// (They carry the top transaction's xid: a rollback to a savepoint drops those that came
    /// after it, as the spool of `--streaming on` does.)
    messages: Vec<DecodingMessage>,
    /// Per savepoint: how many messages came before it.
    messages_at: Vec<usize>,
    /// One savepoint name for every depth: SAVEPOINT, ROLLBACK TO SAVEPOINT, RELEASE SAVEPOINT.
    /// Rolling back to depth d pops the savepoints above it one by one, so three prepared
    /// statements serve any nesting.
    savepoint: Statement,
    rollback_to: Statement,
    release: Statement,
    queued: Arc<AtomicUsize>,
}

impl Applier {
    /// Makes `helper` this applier's helper for `--streaming parallel` and starts it. `pool` is
    /// the deadlock watchdog's own pool.
    pub async fn attach_live_helper(
        &mut self,
        mut helper: Applier,
        pool: deadpool_postgres::Pool,
    ) -> Result<()> {
        let main_pid = backend_pid(&self.client).await?;
        let helper_pid = backend_pid(&helper.client).await?;
        // The helper's changes must see what the main session committed before each block
        // (read committed, whatever the role's default), and it waits idle in its transaction
        // between blocks for as long as the source transaction runs.
        helper
            .client
            .batch_execute(
                "SET default_transaction_isolation = 'read committed'; \
                 SET idle_in_transaction_session_timeout = 0",
            )
            .await
            .map_err(|e| Error::postgres("configuring the streamed-transaction session", e))?;
        // Newer limits (14+, 17+), set where the server has them (a SET of an unknown one would
        // be an ERROR in the target's log).
        let newer_limits =
            "SELECT pg_catalog.set_config(name, '0', false) FROM pg_catalog.pg_settings \
                            WHERE name IN ('idle_session_timeout', 'transaction_timeout')";
        let configured = |e| Error::postgres("configuring the streamed-transaction session", e);
        helper
            .client
            .batch_execute(newer_limits)
            .await
            .map_err(configured)?;
        helper
            .catalog
            .batch_execute(newer_limits)
            .await
            .map_err(configured)?;
        let prepare = |sql: &'static str| {
            let client = helper.client.clone();
            async move {
                client
                    .prepare(sql)
                    .await
                    .map_err(|e| Error::postgres(format!("preparing {sql:?} on the target"), e))
            }
        };
        let queued = Arc::new(AtomicUsize::new(0));
        helper.live_helper = Some(HelperState {
            subxacts: Vec::new(),
            rows_at: Vec::new(),
            known: Default::default(),
            messages: Vec::new(),
            messages_at: Vec::new(),
            savepoint: prepare("SAVEPOINT pgapply_sub").await?,
            rollback_to: prepare("ROLLBACK TO SAVEPOINT pgapply_sub").await?,
            release: prepare("RELEASE SAVEPOINT pgapply_sub").await?,
            queued: queued.clone(),
        });
        let applied = helper.applied.subscribe();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            let result = helper.run(&mut rx).await;
            (helper.stats.clone(), result)
        }));
        self.live = Some(LiveLink {
            tx,
            task: Some(task),
            applied,
            xid: None,
            in_block: false,
            budget: Arc::new(Semaphore::new(HELPER_QUEUE_BYTES)),
            queued: queued.clone(),
            watchdog: Watchdog {
                pool,
                main_pid,
                helper_pid,
                queued,
                fired: Arc::default(),
                task: None,
            },
            off: self.settings.live_streaming_off.clone(),
        });
        tracing::info!("streamed transactions are applied as they arrive, on a second target connection (--streaming parallel)");
        Ok(())
    }

    /// Whether this Stream Start goes to the helper: the helper's own transaction continues, or
    /// a new one starts while the helper is free.
    pub(super) fn live_takes(&self, s: &StreamStart) -> bool {
        let Some(live) = &self.live else {
            return false;
        };
        match live.xid {
            Some(xid) => xid == s.xid,
            None => {
                s.first_segment
                    && self.skip_lsn.is_none()
                    && !live.off.load(Ordering::SeqCst)
                    && !live.task.as_ref().is_some_and(|t| t.is_finished())
            }
        }
    }

    /// Whether the helper holds streamed transaction `xid`.
    pub(super) fn live_holds(&self, xid: Xid) -> bool {
        self.live.as_ref().is_some_and(|l| l.xid == Some(xid))
    }

    /// Whether a block of the helper's transaction is being received.
    pub(super) fn live_in_block(&self) -> bool {
        self.live.as_ref().is_some_and(|l| l.in_block)
    }

    pub(super) async fn live_start(&mut self, s: StreamStart, raw: bytes::Bytes) -> Result<()> {
        // The block's changes happened on the source after every transaction received so far
        // committed, and may touch their rows (an UPDATE of a row one of them inserted): those
        // commit on the target first. A block is logical_decoding_work_mem of changes, so this
        // wait is rare.
        self.commit_group_and_wait().await?;
        if let Some(live) = &mut self.live {
            if live.xid.is_none() {
                tracing::debug!(xid = s.xid, "streamed transaction applied as it arrives");
                live.xid = Some(s.xid);
                live.watchdog.start();
            }
            live.in_block = true;
        }
        self.live_forward(LogicalMessage::StreamStart(s), raw, true)
            .await
    }

    pub(super) async fn live_stop(&mut self, raw: bytes::Bytes) -> Result<()> {
        if let Some(live) = &mut self.live {
            live.in_block = false;
        }
        self.live_forward(LogicalMessage::StreamStop, raw, true)
            .await
    }

    /// A change (or Relation, Type, message) inside a block of the helper's transaction.
    /// Relation and Type messages also go to the main applier at once, in the order they came,
    /// as PostgreSQL's own leader does: the source will not send them again for later
    /// transactions, and a later one may already bring a newer definition.
    pub(super) async fn live_change(
        &mut self,
        message: LogicalMessage,
        raw: bytes::Bytes,
    ) -> Result<()> {
        if matches!(
            message,
            LogicalMessage::Relation(_) | LogicalMessage::Type(_)
        ) {
            self.handle(message.clone()).await?;
        }
        self.live_forward(message, raw, true).await
    }

    pub(super) async fn live_abort(&mut self, a: StreamAbort, raw: bytes::Bytes) -> Result<()> {
        let whole = a.subxid == a.xid;
        // Outside a block the main applier may hold locks the helper waits for: no waiting
        // for the helper's budget here.
        self.live_forward(LogicalMessage::StreamAbort(a), raw, false)
            .await?;
        if whole {
            self.live_release();
        }
        Ok(())
    }

    /// Stream Commit of the helper's transaction: everything before it commits first, then it,
    /// then (on return) anything after it.
    pub(super) async fn live_commit(&mut self, c: StreamCommit, raw: bytes::Bytes) -> Result<()> {
        self.commit_group_and_wait().await?;
        // Applied before a restart (it ends at or before the resume position): roll it back.
        let applied_before = self.resume.is_valid() && c.commit_lsn < self.resume;
        let end = c.end_lsn;
        let xid = c.xid;
        if applied_before {
            tracing::debug!(xid, commit_lsn = %c.commit_lsn, "skipping streamed transaction applied before");
            let abort = StreamAbort {
                xid,
                subxid: xid,
                abort_lsn: None,
                abort_time: None,
            };
            self.live_forward(
                LogicalMessage::StreamAbort(abort),
                bytes::Bytes::new(),
                false,
            )
            .await?;
        } else {
            self.live_forward(LogicalMessage::StreamCommit(c), raw, false)
                .await?;
            self.live_wait_applied(end).await?;
        }
        self.live_release();
        if !applied_before {
            self.advance_applied(end);
        }
        Ok(())
    }

    /// The helper is free again.
    fn live_release(&mut self) {
        if let Some(live) = &mut self.live {
            live.xid = None;
            live.in_block = false;
            live.watchdog.stop();
        }
    }

    /// The end of the run while the helper may hold a transaction: its sessions close, which
    /// rolls it back on the target and releases what it holds.
    pub(super) fn live_abandon(&mut self) {
        if self.live.as_ref().is_some_and(|l| l.xid.is_some()) {
            tracing::debug!(
                "the run ends inside a streamed transaction: the helper's sessions close"
            );
            self.live = None;
        }
    }

    /// Hands a message to the helper. With `wait`, its bytes count against the helper's budget
    /// (waiting for room): only inside a block, when the main applier holds no locks.
    async fn live_forward(
        &mut self,
        message: LogicalMessage,
        raw: bytes::Bytes,
        wait: bool,
    ) -> Result<()> {
        // The main queue's budget is given back now; the helper's own takes over.
        self.permit = None;
        let Some(live) = &self.live else {
            return Err(self.live_helper_failure().await);
        };
        let permit = if wait {
            let bytes = (raw.len() + 64).min(HELPER_QUEUE_BYTES) as u32;
            live.budget.clone().acquire_many_owned(bytes).await.ok()
        } else {
            None
        };
        live.queued.fetch_add(1, Ordering::SeqCst);
        let sent = live
            .tx
            .send(Envelope {
                message,
                raw,
                permit,
                turn: None,
            })
            .is_ok();
        if sent {
            Ok(())
        } else {
            Err(self.live_helper_failure().await)
        }
    }

    /// Waits until the helper has committed up to `end`.
    async fn live_wait_applied(&mut self, end: Lsn) -> Result<()> {
        loop {
            let Some(live) = &mut self.live else {
                return Ok(());
            };
            if *live.applied.borrow_and_update() >= end {
                return Ok(());
            }
            if live.applied.changed().await.is_err() {
                // The helper is gone: it failed.
                return Err(self.live_helper_failure().await);
            }
        }
    }

    /// Why the helper stopped (it only stops on a failure while the main applier runs).
    async fn live_helper_failure(&mut self) -> Error {
        let Some(task) = self.live.as_mut().and_then(|l| l.task.take()) else {
            return Error::transient("the helper applying a streamed transaction has stopped");
        };
        match task.await {
            Ok((_, Err(e))) => e,
            Ok((_, Ok(()))) => {
                Error::transient("the helper applying a streamed transaction stopped early")
            }
            Err(e) => Error::transient(format!(
                "the helper applying a streamed transaction ended abnormally: {e}"
            )),
        }
    }

    /// A failure while the helper held a streamed transaction: streamed transactions are spooled
    /// from now on, and the run is retried from the recorded position.
    pub(super) fn live_failed(&mut self, e: Error) -> Error {
        let Some(live) = &self.live else {
            return e;
        };
        // The watchdog's cancel may reach the main session after the streamed transaction ended
        // (it aborted meanwhile): still this cause, and still worth a retry.
        // Set just before the cancel is sent: only a cancelled statement is its doing.
        let fired = live.watchdog.fired.load(Ordering::SeqCst) && e.sqlstate() == Some("57014");
        let xid = match (live.xid, fired) {
            (Some(xid), _) => xid.to_string(),
            (None, true) => "(already ended)".to_owned(),
            (None, false) => return e,
        };
        // The target went away (restarted, sessions ended): nothing this way of applying did.
        // The run is retried as it would be anyway, still applying streamed transactions as
        // they arrive.
        if !fired && (e.is_connection_lost() || e.sqlstate().is_some_and(|c| c.starts_with("57P")))
        {
            return e;
        }
        live.off.store(true, Ordering::SeqCst);
        let why = if fired {
            format!("a change waited for rows that streamed transaction {xid} held on the target, and that transaction could only commit after it (the target has a trigger, unique index or constraint the source does not)")
        } else {
            format!("applying failed while streamed transaction {xid} was applied as it arrived")
        };
        tracing::warn!(error = %e, "{why}: retrying with streamed transactions spooled (as with --streaming on)");
        Error::transient(format!(
            "{}; {why}: retrying with streamed transactions spooled",
            e.message()
        ))
    }

    /// At the end of the run: the helper ends (rolling back a transaction still open) and its
    /// counters join this applier's.
    pub(super) async fn live_finish(&mut self) {
        let Some(mut live) = self.live.take() else {
            return;
        };
        live.watchdog.stop();
        let (closed, _) = mpsc::unbounded_channel();
        drop(std::mem::replace(&mut live.tx, closed));
        if let Some(task) = live.task.take() {
            if let Ok((stats, result)) = task.await {
                self.stats.add(&stats);
                if let Err(e) = result {
                    tracing::warn!(error = %e, "the helper for streamed transactions ended with an error");
                }
            }
        }
    }

    // ---- the helper's side ----

    /// The helper's routing: one streamed transaction at a time, applied as it arrives.
    pub(super) async fn live_dispatch(&mut self, message: LogicalMessage) -> Result<()> {
        let result = self.live_dispatch_one(message).await;
        if let Some(h) = &self.live_helper {
            h.queued.fetch_sub(1, Ordering::SeqCst);
        }
        result
    }

    async fn live_dispatch_one(&mut self, message: LogicalMessage) -> Result<()> {
        match message {
            LogicalMessage::StreamStart(s) => {
                if self.current.is_none() {
                    // Its commit position comes with Stream Commit; until then it is "not yet".
                    self.begin(Begin {
                        final_lsn: Lsn(u64::MAX),
                        commit_time: PgTimestamp(0),
                        xid: s.xid,
                    })?;
                    if let Some(h) = &mut self.live_helper {
                        h.subxacts.clear();
                        h.rows_at.clear();
                        h.known.clear();
                        h.messages.clear();
                        h.messages_at.clear();
                    }
                }
                Ok(())
            }
            // The block's statements go out now, while the next block is on its way.
            LogicalMessage::StreamStop => {
                self.submit_pending();
                Ok(())
            }
            LogicalMessage::StreamAbort(a) if a.subxid == a.xid => {
                if let Some(h) = &mut self.live_helper {
                    h.messages.clear();
                }
                self.rollback().await
            }
            LogicalMessage::StreamAbort(a) => self.rollback_subxact(a.subxid).await,
            LogicalMessage::StreamCommit(c) => {
                // Conflicts met on the way name the transaction by its commit, known only now:
                // every answer first (held rows included), then the names.
                self.send_pipeline().await?;
                self.conflicts
                    .name_commit(Lsn(u64::MAX), c.commit_lsn, c.commit_time);
                let messages = self
                    .live_helper
                    .as_mut()
                    .map(|h| std::mem::take(&mut h.messages))
                    .unwrap_or_default();
                for m in &messages {
                    self.log_message(m);
                }
                self.on_commit(Commit {
                    flags: c.flags,
                    commit_lsn: c.commit_lsn,
                    end_lsn: c.end_lsn,
                    commit_time: c.commit_time,
                })?;
                self.commit_group().await
            }
            change => {
                let top = self.current.as_ref().map(|t| t.xid);
                if let Some(sub) = streamed_xid(&change).filter(|x| Some(*x) != top) {
                    self.savepoint_for(sub).await?;
                }
                match (change, &mut self.live_helper) {
                    (LogicalMessage::Message(m), Some(h)) if m.transactional() => {
                        h.messages.push(m);
                        Ok(())
                    }
                    (change, _) => self.handle(change).await,
                }
            }
        }
    }

    /// The first change of subtransaction `sub`: a savepoint, so its abort can undo just it.
    async fn savepoint_for(&mut self, sub: Xid) -> Result<()> {
        let statement = match &self.live_helper {
            Some(h) if h.known.contains(&sub) => return Ok(()),
            // Each savepoint that writes holds a lock on the target until the transaction
            // ends, in the lock table every session of the target cluster shares (about
            // max_locks_per_transaction x max_connections slots): tens of thousands of them
            // (exception blocks in a loop) would leave other sessions "out of shared memory".
            Some(h) if h.subxacts.len() >= MAX_LIVE_SAVEPOINTS => {
                return Err(Error::transient(format!(
                    "streamed transaction {} has more than {MAX_LIVE_SAVEPOINTS} subtransactions that changed published tables: a savepoint for each would hold as many locks in the target's shared lock table",
                    self.current.as_ref().map_or(0, |t| t.xid)
                )));
            }
            Some(h) => h.savepoint.clone(),
            None => return Ok(()),
        };
        // Held rows belong before the savepoint.
        self.flush_held_updates(None).await?;
        self.flush_insert_run().await?;
        self.push_plain(statement);
        let rows = self.unsettled_rows;
        if let Some(h) = &mut self.live_helper {
            h.subxacts.push(sub);
            h.rows_at.push(rows);
            h.messages_at.push(h.messages.len());
            h.known.insert(sub);
        }
        Ok(())
    }

    /// Stream Abort of subtransaction `sub`: back to its savepoint, which also undoes the
    /// subtransactions after it (they were inside it, or aborted with it), as PostgreSQL's
    /// parallel apply does. (Conflicts its changes met are still recorded if the transaction
    /// commits: over-reporting, never hiding one.)
    async fn rollback_subxact(&mut self, sub: Xid) -> Result<()> {
        let Some((depth, rollback_to, release)) = self.live_helper.as_ref().and_then(|h| {
            h.subxacts
                .iter()
                .rposition(|x| *x == sub)
                .map(|d| (d, h.rollback_to.clone(), h.release.clone()))
        }) else {
            // No change of it reached the target.
            return Ok(());
        };
        // Held rows go out first, so that the rollback undoes those of the subtransaction.
        self.flush_held_updates(None).await?;
        self.flush_insert_run().await?;
        let above = self.live_helper.as_ref().map_or(0, |h| h.subxacts.len()) - depth;
        // Each pair undoes the innermost savepoint and removes it: the server's nesting stays
        // equal to the list's.
        for _ in 0..above {
            self.push_plain(rollback_to.clone());
            self.push_plain(release.clone());
        }
        if let Some(h) = &mut self.live_helper {
            for x in h.subxacts.drain(depth..) {
                h.known.remove(&x);
            }
            if let Some(kept) = h.messages_at.drain(depth..).next() {
                h.messages.truncate(kept);
            }
            if let Some(rows) = h.rows_at.drain(depth..).next() {
                self.unsettled_rows = rows;
            }
        }
        // Out now: the main session may be about to wait for the rows this releases.
        self.submit_pending();
        Ok(())
    }

    /// Queues a statement without parameters.
    fn push_plain(&mut self, statement: Statement) {
        self.pending.push(Pending::plain(statement));
    }
}

/// Most savepoints the helper keeps in one streamed transaction (`savepoint_for`); beyond, it is
/// applied spooled, at its commit.
const MAX_LIVE_SAVEPOINTS: usize = 1000;

/// The server process id of a session (what `pg_blocking_pids` and `pg_cancel_backend` take).
async fn backend_pid(client: &tokio_postgres::Client) -> Result<i32> {
    client
        .query_one("SELECT pg_catalog.pg_backend_pid()", &[])
        .await
        .map(|r| r.get(0))
        .map_err(|e| Error::postgres("reading an apply session's process id", e))
}
