//! One replication run: source reader, applier and durability tracker, wired together.
//!
//! ```text
//!  walsender ──frames──> reader ──decoded messages (byte-bounded queue)──> applier ──> target
//!      ^                   │                                                  │
//!      └──status updates───┘<──── durable position <── durability tracker <───┘ applied position
//! ```
//!
//! The reader decodes frames and forwards messages; the applier turns them into pipelined target
//! transactions; the tracker turns "committed on the target" into "durable on the target"
//! (see `apply::progress`). The reader reports as flushed only what is durable, except that when
//! nothing it forwarded is still pending and it is between transactions, it may acknowledge the
//! source's WAL end from a keepalive, so the slot does not hold WAL for unpublished changes.
//! It never does that while a transaction is being received or is not yet durable: that is the
//! bug that makes some tools lose transactions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::Instrument;

use crate::apply::applier::{ApplyStats, Envelope};
use crate::apply::parallel::{Dispatcher, DispatcherOptions, WorkerLink, WorkerRole, Workers};
use crate::apply::{Applier, ApplierOptions, ApplySettings, ProgressMode, ProgressStore};
use crate::cli::Streaming;
use crate::conninfo;
use crate::copy::{self, CopySettings, CopyStatus};
use crate::error::{Error, Result};
use crate::metrics::METRICS;
use crate::protocol::pgoutput::LogicalMessage;
use crate::protocol::{Lsn, MessageDecoder, ReplicationFrame};
use crate::source::options::{negotiate, Requested};
use crate::source::{ReplicationSession, ReplicationStream};

mod copying;
mod heartbeat;
mod reader;
mod start;

use copying::*;
use heartbeat::*;
pub use heartbeat::{note_forced_stop, note_waiting, HEARTBEAT_MAX_EVERY};
use reader::*;
use start::*;
pub(crate) use start::{
    binary_unsafe, copy_across_origins, missing_partition_hint, LIVE_HELPER_INDEX,
};
pub use start::{
    is_slot_in_use, publications_dropped, recorded_publications, refuse_same_database,
    replication_loop, same_publications, tables_shared_with_other_slots, unmatched_table_settings,
};

#[derive(Debug, Clone)]
pub struct RunConfig {
    pub source: tokio_postgres::Config,
    pub target: tokio_postgres::Config,
    pub publications: Vec<String>,
    pub slot: String,
    pub create_slot: bool,
    /// Create (or make) the slot a failover slot (17+).
    pub failover_slot: bool,
    pub endpos: Option<Lsn>,
    /// How often to send a standby status update when nothing else prompts one.
    pub status_interval: Duration,
    /// Bytes of decoded messages that may wait for the applier.
    pub queue_bytes: usize,
    /// Largest protocol message accepted from the source.
    pub max_message_bytes: usize,
    pub apply: ApplySettings,
    /// Copy the published tables' existing rows first (`--copy-data`).
    pub copy_data: bool,
    /// Stop once the copy is done, before streaming (`--copy-only`).
    pub copy_only: bool,
    pub copy: CopySettings,
    /// Source table -> target table, where they differ.
    pub table_map: crate::config::TableMap,
    /// Source column -> target column, per source table, where they differ.
    pub column_map: crate::config::ColumnMap,
    /// Streaming, two-phase, binary, messages, origin: as asked; negotiated per server.
    pub requested: Requested,
    /// Where streamed transactions are spooled (default: a directory under the temp dir).
    pub spool_dir: Option<std::path::PathBuf>,
    /// Conflict policies, global and per table.
    pub policies: crate::apply::conflict::PolicyMap,
    /// New conflict policies while running (SIGHUP reloads the config file).
    pub policy_updates: Option<watch::Receiver<Arc<crate::apply::conflict::PolicyMap>>>,
    /// Target connections applying in parallel (`apply::parallel`); 1: one, in order.
    pub apply_workers: usize,
    /// Run by `pgapply cutover`, which says itself where the slot stopped (no warning about the
    /// stop position it set).
    pub by_cutover: bool,
}

impl RunConfig {
    pub fn new(
        source: tokio_postgres::Config,
        target: tokio_postgres::Config,
        publications: Vec<String>,
        slot: String,
    ) -> Self {
        RunConfig {
            source,
            target,
            publications,
            slot,
            create_slot: false,
            endpos: None,
            status_interval: Duration::from_secs(10),
            queue_bytes: 64 * 1024 * 1024,
            max_message_bytes: 1024 * 1024 * 1024 + 1024,
            apply: ApplySettings::default(),
            copy_data: false,
            copy_only: false,
            copy: CopySettings::default(),
            table_map: Default::default(),
            column_map: Default::default(),
            requested: Requested::default(),
            spool_dir: None,
            policies: Default::default(),
            policy_updates: None,
            apply_workers: 1,
            failover_slot: false,
            by_cutover: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Shutdown,
    EndPosition,
    /// `--copy-only`: the initial copy is done.
    CopyDone,
}

#[derive(Debug)]
pub struct RunOutcome {
    pub reason: StopReason,
    /// Durable on the target and reported to the source.
    pub flushed: Lsn,
    pub stats: ApplyStats,
}

/// Set when the stream met a table whose values binary transfer cannot carry (see
/// `Error::text_from_now_on`): the runs after it in this process ask for text, whatever the
/// publication says then, so that starting again cannot meet the same table in binary for ever.
pub static TEXT_FROM_NOW_ON: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Reports progress of one run to whoever watches (status output, tests, the demo).
#[derive(Debug, Clone, Default)]
pub struct RunProgress {
    pub durable: Lsn,
}

pub fn target_pool(target: &tokio_postgres::Config, size: usize) -> Result<Pool> {
    let manager = Manager::from_config(
        target.clone(),
        crate::tls::make_tls(target).map_err(|e| {
            e.context(format!(
                "connecting to target {}",
                conninfo::describe(target)
            ))
        })?,
        ManagerConfig {
            // A session handed back by a task that failed may still be inside its (aborted or
            // open) transaction; reusing it would put the next user's writes into it, to be
            // rolled back with it. Outside a transaction block a statement's transaction starts
            // with the statement (one simple-protocol message), so now() equals
            // statement_timestamp(); inside one it is older, and the cast below fails (as does any
            // statement in an aborted transaction): the pool then closes that session and hands
            // out another (its log line, with the text below, shows with --log-level
            // deadpool=warn or more; it is left out by default). (Appending the stable, empty
            // left(now()::text, 0) keeps the planner from folding, and so raising, the cast
            // before the comparison is known.)
            recycling_method: RecyclingMethod::Custom(
                "SELECT CASE WHEN now() = statement_timestamp() THEN 1 ELSE \
                 ('session left inside a transaction, closed' || left(now()::text, 0))::int END"
                    .into(),
            ),
        },
    );
    // A server that accepts the connection and then says nothing would keep a new session
    // waiting for ever (tokio-postgres times the TCP connect only).
    Pool::builder(manager)
        .max_size(size)
        .create_timeout(Some(crate::tls::handshake_timeout(target)))
        .recycle_timeout(Some(crate::tls::handshake_timeout(target)))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        // A role's or database's idle_session_timeout (14+) would end pgapply's sessions between
        // two quiet moments of the source (the heartbeat's, the apply sessions'), and each end
        // is a restart of the run; its statement_timeout or lock_timeout (set for the
        // applications) would fail pgapply's bookkeeping (catalog reads, progress, heartbeat)
        // when the target is busy, as they would its apply sessions, which set the same. (Set by
        // name from pg_settings: older servers do not know every one.)
        .post_create(deadpool_postgres::Hook::async_fn(|client, _| {
            Box::pin(async move {
                let _ = client
                    .batch_execute(
                        "SET statement_timeout = 0; SET lock_timeout = 0; \
                         SET idle_in_transaction_session_timeout = 0; \
                         SELECT pg_catalog.set_config(name, '0', false) FROM pg_catalog.pg_settings \
                         WHERE name IN ('idle_session_timeout', 'transaction_timeout')",
                    )
                    .await;
                Ok(())
            })
        }))
        .build()
        .map_err(|e| Error::definite(format!("building the target connection pool: {e}")))
}

pub async fn target_connection(pool: &Pool, target: &tokio_postgres::Config) -> Result<Object> {
    pool.get().await.map_err(|e| match e {
        deadpool_postgres::PoolError::Backend(e) => {
            let refused = e.code()
                == Some(&tokio_postgres::error::SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE);
            let full = e.code() == Some(&tokio_postgres::error::SqlState::TOO_MANY_CONNECTIONS);
            let tls_advice = crate::tls::tls_advice(&e);
            let err = Error::postgres(
                format!("connecting to target {}", conninfo::describe(target)),
                e,
            );
            // `ALTER DATABASE .. ALLOW_CONNECTIONS false` (the only 55000 a connection gets),
            // for maintenance: it ends some day, and the changes wait in the slot meanwhile.
            if refused {
                Error::transient(format!(
                    "{}: the target database refuses connections (ALTER DATABASE .. ALLOW_CONNECTIONS false, for maintenance): the changes wait in the slot until it allows them again",
                    err.message()
                ))
            } else if full {
                // (Transient: another client's sessions may end.)
                err.context_after(
                    "the target's max_connections are all in use, pgapply's own sessions counted: a run keeps up to about 8 on the target (one more per extra --apply-workers worker and for --streaming parallel, --copy-jobs more during a copy); raise max_connections on the target or end other sessions there (SELECT count(*) FROM pg_stat_activity shows how many it has)",
                )
            } else if let Some(advice) = tls_advice {
                err.context_after(advice)
            } else if err.message().ends_with("password missing") {
                err.context_after(
                    "the target asks for a password: give it in the connection string, PGPASSWORD, ~/.pgpass or --target-password-file",
                )
            } else {
                err
            }
        }
        deadpool_postgres::PoolError::Timeout(_) => Error::transient(format!(
            "connecting to target {}: {}",
            conninfo::describe(target),
            crate::tls::handshake_timed_out(target)
        )),
        other => Error::transient(format!(
            "connecting to target {}: {other}",
            conninfo::describe(target)
        )),
    })
}

/// Runs until `shutdown` turns true, `endpos` is reached, or an error. Every log line of the
/// run, its tasks' included, carries the slot (a span; `in_current_span` on each spawn).
pub async fn run(
    config: RunConfig,
    shutdown: watch::Receiver<bool>,
    progress: Option<watch::Sender<RunProgress>>,
) -> Result<RunOutcome> {
    // error_span: kept whatever the log level, so that warnings and errors name the slot too.
    let span = tracing::error_span!("run", slot = %config.slot);
    let target = config.target.clone();
    let slot = config.slot.clone();
    let result = run_in_span(config, shutdown, progress)
        .instrument(span.clone())
        .await;
    if let Err(e) = &result {
        record_failure(&target, &slot, &e.to_string())
            .instrument(span)
            .await;
    }
    result
}

/// `work`'s result, or `None` if a stop is asked first (`work` is dropped then).
async fn unless_stopped<T>(
    shutdown: &mut watch::Receiver<bool>,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    let asked = async {
        // A sender gone asks nothing.
        if shutdown.wait_for(|stop| *stop).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        result = work => Some(result),
        () = asked => None,
    }
}

/// Prepared transactions must be enabled on the target for two-phase apply. `what` starts the
/// error message.
async fn target_takes_prepared_transactions(
    target: &tokio_postgres::Client,
    what: &str,
) -> Result<()> {
    let prepared: i32 = target
        .query_one(
            "SELECT current_setting('max_prepared_transactions')::int",
            &[],
        )
        .await
        .map_err(|e| Error::postgres("reading max_prepared_transactions on the target", e))?
        .get(0);
    if prepared == 0 {
        return Err(Error::definite(format!(
            "{what} prepared transactions on the target, but its max_prepared_transactions is 0: set it above 0 in postgresql.conf and restart the target"
        )));
    }
    Ok(())
}

/// Where streamed transactions are spooled without `--spool-dir`. The user's id in the name:
/// another user's directory of the same slot name (private to them) would otherwise stop a run.
pub fn default_spool_dir(slot: &str) -> std::path::PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    std::env::temp_dir().join(format!("pgapply-spool-{uid}-{slot}"))
}

/// A run that ended with an error says so in `pgapply status` (`failed`, and the error; the log also says
/// whether it is retried), instead of leaving `streaming`, `copying` or the `stopped` of an earlier
/// run behind. Only a row no other process holds (this one's pid, or none): the error may be that
/// another worker holds the slot. Best effort.
async fn record_failure(target: &tokio_postgres::Config, slot: &str, error: &str) {
    let attempt = async {
        let client = crate::tls::connect(target).await.ok()?;
        client
            .execute(
                "UPDATE pgapply.progress SET state = 'failed', pid = NULL, heartbeat_at = now(), \
                        last_error = $3 \
                 WHERE slot_name = $1 AND (pid = $2 OR pid IS NULL)",
                &[&slot, &(std::process::id() as i32), &error],
            )
            .await
            .ok()
    };
    if tokio::time::timeout(Duration::from_secs(3), attempt)
        .await
        .is_err()
    {
        tracing::debug!("could not record the failure on the target in time");
    }
}

async fn run_in_span(
    config: RunConfig,
    mut shutdown: watch::Receiver<bool>,
    progress: Option<watch::Sender<RunProgress>>,
) -> Result<RunOutcome> {
    // Setup, tracker, heartbeat and per applier two connections (statements, catalog reads),
    // plus the dispatcher's catalog reads with parallel workers.
    // (The --streaming parallel helper has a pool of its own: `ApplyStart::add_live_helper`.)
    // The initial copy needs one per copy job besides the setup session, its heartbeat, the
    // watcher of its lock waits and the recorder of its progress.
    let sessions = (5 + 2 * config.apply_workers.max(1)).max(config.copy.jobs + 5);
    let pool = target_pool(&config.target, sessions)?;
    // Connecting may take up to connect_timeout: a stop asked meanwhile ends the run at once
    // (nothing has started that needs a graceful end).
    let stopped = || RunOutcome {
        reason: StopReason::Shutdown,
        flushed: Lsn::INVALID,
        stats: ApplyStats::default(),
    };
    let Some(setup) = unless_stopped(&mut shutdown, target_connection(&pool, &config.target)).await
    else {
        return Ok(stopped());
    };
    let mut setup = setup?;
    crate::migrations::apply(&mut setup).await?;

    let connecting = ReplicationSession::connect(&config.source, config.max_message_bytes);
    let Some(session) = unless_stopped(&mut shutdown, connecting).await else {
        return Ok(stopped());
    };
    let mut session =
        session.map_err(|e| e.context(format!("source {}", conninfo::describe(&config.source))))?;
    let identity = session.identify_system().await?;
    refuse_same_database(&setup, &identity.system_id, &identity.database).await?;
    session.check_publications(&config.publications).await?;
    let wal_sender_timeout_ms = session.wal_sender_timeout_ms().await?;
    let config = match status_interval_problem(config.status_interval, wal_sender_timeout_ms) {
        Some(problem) => {
            // Stopped reading (a full queue behind a slow target), pgapply answers no keepalive
            // request: only its own status updates keep the source from ending the connection.
            let lowered = safe_status_interval(wal_sender_timeout_ms);
            // Said once per process and timeout, not at each reconnect.
            static WARNED_FOR_TIMEOUT_MS: std::sync::atomic::AtomicU64 =
                std::sync::atomic::AtomicU64::new(u64::MAX);
            if WARNED_FOR_TIMEOUT_MS
                .swap(wal_sender_timeout_ms, std::sync::atomic::Ordering::Relaxed)
                != wal_sender_timeout_ms
            {
                tracing::warn!(
                    "{problem}; this run sends them every {}",
                    humantime::format_duration(lowered)
                );
            }
            RunConfig {
                status_interval: lowered,
                ..config
            }
        }
        None => config,
    };
    let mut negotiated = negotiate(session.server_version(), &config.requested)?;
    if negotiated.binary {
        if TEXT_FROM_NOW_ON.load(std::sync::atomic::Ordering::SeqCst) {
            // The stream met a table binary values cannot carry (it may no longer be published,
            // or exist, for the start's check to see it): text for the rest of this process.
            tracing::info!("binary transfer off: values are sent as text, as the stream met a table whose types binary transfer cannot carry");
            negotiated.binary = false;
        } else {
            // (Reading the published tables may wait for a lock on the source.)
            let unsafe_reason = binary_unsafe(&config, session.server_version());
            let Some(unsafe_reason) = unless_stopped(&mut shutdown, unsafe_reason).await else {
                return Ok(stopped());
            };
            if let Some(reason) = unsafe_reason? {
                tracing::info!(reason = %reason, "binary transfer off: values are sent as text");
                negotiated.binary = false;
            }
        }
    }
    if negotiated.two_phase {
        // Before the slot is made two-phase (which cannot be undone on it).
        target_takes_prepared_transactions(&setup, "--two-phase needs").await?;
    }

    // Whether this target has seen the slot before (`open` makes its row).
    let known_slot = setup
        .query_opt(
            "SELECT 1 FROM pgapply.progress WHERE slot_name = $1",
            &[&config.slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?
        .is_some();
    let (store, mut resume) =
        ProgressStore::open(&setup, &config.slot, &identity.system_id).await?;
    // (Before a slot is made or a table copied for a run that could not apply.)
    if config.apply_workers > 1 && store.is_table_mode() {
        return Err(Error::definite(
            crate::apply::progress::WORKERS_NEED_ORIGINS,
        ));
    }
    // (What changed is said now, and recorded once the source is known to be the slot's.)
    let publications_dropped =
        publications_change(&setup, &config.slot, &config.publications).await?;
    warn_of_other_live_slots(&setup, &config.slot, &config.publications, &identity).await;
    // A slot that `pgapply cutover` stopped at a position stays stopped there: after a cutover
    // the target is the primary, and a worker started again (by a service manager, say) must not
    // apply the old source's later writes to it, nor copy the tables again.
    let fence = stop_position(&setup, &config.slot).await?;
    if let Some(fence) = fence {
        // Reached (applied here, or confirmed to the source, which pgapply does only for what is
        // durable on the target), or nothing to stop at without a slot: a run that would copy
        // the tables again or make a new slot is what the fence is there to prevent.
        let confirmed = session.slot_confirmed(&config.slot).await?;
        let reached =
            (resume.is_valid() && resume >= fence) || confirmed.is_some_and(|c| c >= fence);
        if reached || confirmed.is_none() {
            if !config.by_cutover {
                fenced_warning(&setup, &config.slot, fence, false).await;
            }
            return Ok(RunOutcome {
                reason: StopReason::EndPosition,
                flushed: resume,
                stats: ApplyStats::default(),
            });
        }
        tracing::info!(stop_lsn = %fence, "`pgapply cutover` asked to stop there: applying everything committed before it, then stopping");
    }
    source_has_reached(&mut session, &config.slot, identity.wal_position, resume).await?;
    // (Recorded only once the source is known to be the slot's: a start refused on the way, say
    // for a slot the server lacks, must not make this server's timeline the one applied from.)
    let timeline = on_the_timeline_applied_from(
        &setup,
        &mut session,
        &config.slot,
        identity.timeline,
        resume,
    )
    .await?;
    // (Reading the published tables may wait for a lock on the source.)
    let Some(shared_targets) =
        unless_stopped(&mut shutdown, target_tables_exist(&config, &setup)).await
    else {
        return Ok(stopped());
    };
    let (shared_targets, deferrable_on_source) = shared_targets?;
    let shared_targets = Arc::new(shared_targets);
    // The fence decides where this run stops unless --endpos comes first (the cutover's own run
    // stops at the same position: no warning then).
    let fence_decides = fence.filter(|f| config.endpos.is_none_or(|e| e > *f));
    let config = RunConfig {
        endpos: match (config.endpos, fence) {
            (Some(e), Some(f)) => Some(e.min(f)),
            (e, f) => e.or(f),
        },
        ..config
    };
    // One copy per slot at a time: starting over under another process's copy would empty the
    // tables it is filling. A session of its own holds the slot's copy lock, taken before the
    // copy's state is read (so that it cannot change under this run) and kept until the copy
    // ends (a killed process's session ends with it, and the lock with the session).
    let copy_lock = if config.copy_data && fence.is_none() {
        Some(copy_lock(&config).await?)
    } else {
        None
    };
    let copy_status = copy::status(&setup, &config.slot).await?;
    let slot_exists = session.slot_exists(&config.slot).await?;
    if slot_exists {
        session
            .refuse_another_databases_slot(&config.slot, &identity.database)
            .await?;
    }
    // The slot of a finished copy was dropped: the changes it held are lost, so with --copy-data
    // the copy is made again, into a new slot. (An invalidated slot still exists: ensure_slot
    // names it.)
    let copy_again = config.copy_data && copy_status == CopyStatus::Done && !slot_exists;
    if copy_again {
        tracing::warn!("the initial copy was done, but its slot no longer exists on the source: copying the tables again into a new slot (the target tables must be empty, or use --truncate-target)");
    }
    if config.copy_data && fence.is_none() && (copy_status != CopyStatus::Done || copy_again) {
        if slot_exists && copy_status != CopyStatus::Incomplete {
            // Not the slot of an interrupted copy of pgapply's: made by hand, or by a run without
            // --copy-data, it may hold changes someone counts on. The copy's snapshot can only
            // come with a slot created for it.
            return Err(Error::definite(if resume.is_valid() {
                format!(
                    "--copy-data creates slot {:?} with a snapshot of the data, but the slot exists and pgapply has already applied changes from it: run without --copy-data to go on from where it is; or, to copy everything again, drop the slot and pgapply's state of it (pgapply forget --slot {} --drop-slot, with --source and --target) and run with --copy-data --truncate-target",
                    config.slot, config.slot
                )
            } else {
                format!(
                    "--copy-data creates slot {:?} with a snapshot of the data, but a slot of that name already exists on the source (made by hand, or by a run without --copy-data): give another --slot, or drop it if nothing needs its changes (SELECT pg_drop_replication_slot({})) and run again",
                    config.slot,
                    crate::sql::quote_literal(&config.slot)
                )
            }));
        }
        // (Aborted when dropped, at the end of the copy or on an early return.)
        let _lock_watch = Background::spawn({
            let client = target_connection(&pool, &config.target).await?;
            |quit| heartbeat::copy_lock_watch(client, quit)
        });
        if copy_status == CopyStatus::Incomplete {
            // Emptying the tables may wait for a lock: a session of the interrupted run (killed,
            // its backend still waiting for a lock of its own) holds one on them, and the watch
            // names it, as it names the copy's own waits.
            crate::apply::sessions::register_copy(&setup).await;
            copy::reset_interrupted(&setup, &config.slot, &config.table_map).await?;
        }
        // Each apply worker binds an origin of its own, all at once: as many free origin states.
        let mut probes = Vec::new();
        for index in 0..config.apply_workers.max(1) {
            let client = target_connection(&pool, &config.target).await?;
            let worker = match index {
                0 => store.clone(),
                _ => store.for_worker(&client, index).await?,
            };
            worker.probe_origin(&client).await?;
            probes.push((client, worker));
        }
        for (client, worker) in probes {
            worker.release_origin(&client).await?;
        }
        record_source(
            &setup,
            &config.slot,
            &config.publications,
            &identity.database,
        )
        .await?;
        if let Some(timeline) = &timeline {
            timeline.record(&setup, &config.slot).await?;
        }
        let plan = copy::plan_copy(
            &config.source,
            &pool,
            &config.target,
            &config.slot,
            &config.publications,
            &config.copy,
            &config.table_map,
            session.server_version() / 10000,
            None,
        )
        .await?
        .ok_or_else(|| Error::definite(copy::no_tables_message(&config.publications)))?;
        // The slot of the interrupted copy: nothing was applied from it, and the copy starts over
        // with a new one (only now, once the target tables were found ready for it).
        if slot_exists {
            session.drop_slot(&config.slot).await?;
        }
        // (Asked before the slot is made: its snapshot lasts only until the session's next
        // command.)
        if config.failover_slot && session.standby_slots_unset().await? {
            tracing::warn!("{}", crate::source::STANDBY_SLOTS_UNSET);
        }
        // A stop asked for during the copy (or while the slot waits for running transactions)
        // ends it: tables not finished are copied again by the next run with --copy-data, as
        // after an interrupted one.
        let mut stop = shutdown.clone();
        let stopped = async move {
            let _ = stop.wait_for(|stopping| *stopping).await;
        };
        tokio::pin!(stopped);
        // The copy is under way from here (`pgapply status`; a cutover waits for it), the
        // slot's creation included, which waits for the transactions open on the source.
        let client = target_connection(&pool, &config.target).await?;
        let slot = config.slot.clone();
        let beat = Background::spawn(|quit| copy_heartbeat(client, slot, quit));
        let snapshot = tokio::select! {
            biased;
            s = session.create_slot_with_snapshot(&config.slot, negotiated.two_phase, config.failover_slot) => s?,
            () = &mut stopped => {
                // (A slot whose creation was cut short is not there, or is dropped by the next
                // --copy-data run.)
                beat.stop().await;
                return copy_interrupted(&setup, &config, resume).await;
            }
        };
        let copied = tokio::select! {
            // (A copy that ends as the stop comes counts as done.)
            biased;
            c = copy::copy_tables(
                plan,
                &config.source,
                &pool,
                &config.target,
                &config.slot,
                &snapshot.snapshot_name,
                &config.copy,
            ) => Some(c),
            () = &mut stopped => None,
        };
        beat.stop().await;
        // Every table may be recorded as copied already when what failed, or the stop, came
        // (the last range's commit marks its table done): then the copy is complete, and its
        // slot holds every change since.
        let status = match &copied {
            Some(Ok(_)) => Ok(CopyStatus::Done),
            _ => copy::status(&setup, &config.slot).await,
        };
        if !matches!(status, Ok(CopyStatus::Done)) {
            // Started over by the next --copy-data run, with a new slot: this one would only
            // hold the source's WAL meanwhile (and for ever, if the user gives up). (When the
            // copy's state cannot be read, the slot stays: the next run decides.)
            let retried =
                matches!(&copied, Some(Err(e)) if e.is_transient()) && !*shutdown.borrow();
            if status.is_ok() {
                drop_copy_slot(&mut session, &config.slot).await;
            } else if retried {
                // (The error below is retried by this process, which decides about the slot.)
                tracing::warn!(
                    "the initial copy did not finish and its state could not be read: its replication slot stays until the retry starts the copy over"
                );
            } else {
                tracing::warn!(
                    "the initial copy did not finish and its state could not be read: its replication slot stays; the next run with --copy-data starts the copy over, or, if you give up, drop it on the source with SELECT pg_drop_replication_slot({})",
                    crate::sql::quote_literal(&config.slot)
                );
            }
            return match copied {
                Some(Err(e)) => Err(e),
                _ => copy_interrupted(&setup, &config, resume).await,
            };
        }
        store
            .set_position(&setup, snapshot.consistent_point)
            .await?;
        resume = snapshot.consistent_point;
        // (Its session ends: the copy lock goes with it.)
        drop(copy_lock);
    } else {
        if copy_status == CopyStatus::Incomplete {
            return Err(Error::definite(format!(
                "the initial copy for slot {:?} was interrupted and cannot continue: rerun with --copy-data to start it over",
                config.slot
            )));
        }
        if !slot_exists && resume.is_valid() {
            // A new slot starts at the source's current position: whatever the old one still
            // held for the target would be skipped without a word.
            return Err(Error::definite(format!(
                "replication slot {:?} no longer exists on the source ({}), but pgapply applied changes from it up to {resume}: a new slot would start after changes that were never applied. Start over with --copy-data --truncate-target (copies the published tables again into a new slot) (a slot does not survive a failover before PostgreSQL 17, nor one not synced to the standby: README \"A failover of the source\")",
                config.slot,
                session.endpoint()
            )));
        }
        if !slot_exists && copy_status == CopyStatus::Done {
            return Err(Error::definite(format!(
                "replication slot {:?} no longer exists on the source ({}), but the initial copy was made from it: a new slot would start after the changes made since the copy. Start over with --copy-data --truncate-target (copies the published tables again into a new slot) (a slot does not survive a failover before PostgreSQL 17, nor one not synced to the standby: README \"A failover of the source\")",
                config.slot,
                session.endpoint()
            )));
        }
        // A slot of the source, and no state for it on this target: the first run on a slot made
        // by hand, or a target made again (database re-created, restored from before the first
        // run) whose rows are gone while the slot went on without them. Said, not refused: only
        // the user knows which.
        // (Not for the slot `cutover --reverse` makes for the way back: the old primary holds
        // the data up to it.)
        if slot_exists
            && !known_slot
            && !resume.is_valid()
            && copy_status == CopyStatus::None
            && !config.slot.ends_with("_reverse")
        {
            if let Some(confirmed) = session.slot_confirmed(&config.slot).await? {
                tracing::warn!(
                    slot = %config.slot,
                    %confirmed,
                    "replication slot {:?} exists on the source (confirmed up to {confirmed}) and this target has no pgapply state for it: applying starts at the slot's position, and nothing from before it (rows, or changes the slot passed) comes to this target. Right for a slot made by hand for this target; if the target should hold the source's data already (its database made again, or restored), stop now, drop the slot and start over with --copy-data (--truncate-target if the tables have rows)",
                    config.slot
                );
            }
        }
        // A slot made two-phase by an earlier --two-phase run goes on sending prepared
        // transactions: applied as such (and the target checked for them) whether or not
        // --two-phase is given again. (With several workers, ensure_slot refuses such a slot.)
        if slot_exists
            && !negotiated.two_phase
            && config.apply_workers <= 1
            && session.server_version() >= 150000
            && session.slot_is_two_phase(&config.slot).await?
        {
            target_takes_prepared_transactions(
                &setup,
                &format!("replication slot {:?} decodes two-phase transactions (it was made by a --two-phase run), which needs", config.slot),
            )
            .await?;
            tracing::info!(
                slot = %config.slot,
                "the slot decodes two-phase transactions (made by a --two-phase run): applying them as with --two-phase"
            );
            negotiated.two_phase = true;
        }
        // (A new slot waits for the transactions open on the source: a stop asked meanwhile
        // ends the wait, and the slot not yet made goes with the session.)
        let ensured = session.ensure_slot(
            &config.slot,
            config.create_slot,
            &identity.database,
            negotiated.two_phase,
            config.failover_slot,
            config.apply_workers > 1,
        );
        match unless_stopped(&mut shutdown, ensured).await {
            Some(result) => result?,
            None => return Ok(stopped()),
        }
        record_source(
            &setup,
            &config.slot,
            &config.publications,
            &identity.database,
        )
        .await?;
        if let Some(timeline) = &timeline {
            timeline.record(&setup, &config.slot).await?;
        }
        if config.failover_slot && session.standby_slots_unset().await? {
            tracing::warn!("{}", crate::source::STANDBY_SLOTS_UNSET);
        }
        if copy_status == CopyStatus::Done {
            // (Reading the published tables may wait for a lock on the source.)
            let forgetting = copy::forget_unpublished(
                &setup,
                &config.source,
                &config.slot,
                &config.publications,
                &config.table_map,
                resume,
                publications_dropped,
                config.copy_data && config.copy.truncate_target && fence.is_none(),
            );
            match unless_stopped(&mut shutdown, forgetting).await {
                Some(result) => result?,
                None => return Ok(stopped()),
            }
        }
        // (Not under a cutover's stop position: what it stops at is decided.)
        if config.copy_data && copy_status == CopyStatus::Done && fence.is_none() {
            // Not under a worker that streams the slot: it would apply the copied tables'
            // changes the copy holds (it knows nothing of the copy's position).
            if let Some(pid) = session.slot_holder(&config.slot).await? {
                return Err(Error::transient(format!(
                    "replication slot {:?} is in use on the source (its walsender is process {pid} there; another pgapply streaming it?): stop that one before a run with --copy-data copies the tables published since; it must end first",
                    config.slot
                )));
            }
            let probe = target_connection(&pool, &config.target).await?;
            store.probe_origin(&probe).await?;
            store.release_origin(&probe).await?;
            drop(probe);
            let late = copy::LateCopy {
                two_phase: negotiated.two_phase,
            };
            let source_major = session.server_version() / 10000;
            if !copy_late_tables(&config, &pool, late, source_major, &shutdown).await? {
                return copy_interrupted(&setup, &config, resume).await;
            }
        } else {
            let unfinished = copy::late_unfinished(&setup, &config.slot).await?;
            if !unfinished.is_empty() {
                return Err(Error::definite(format!(
                    "the copy of {} (published after the initial copy) did not finish: run with --copy-data to copy {} again; streamed into as {} now, {} would miss rows",
                    unfinished.join(", "),
                    if unfinished.len() == 1 { "it" } else { "them" },
                    if unfinished.len() == 1 { "it is" } else { "they are" },
                    if unfinished.len() == 1 { "it" } else { "they" },
                )));
            }
        }
        // (Its session ends: the copy lock goes with it.)
        drop(copy_lock);
    }
    if config.copy_only {
        // `pgapply status` says stopped, not a copy whose process went away.
        setup
            .execute(
                "UPDATE pgapply.progress SET state = 'stopped', pid = NULL, heartbeat_at = now() WHERE slot_name = $1",
                &[&config.slot],
            )
            .await
            .map_err(|e| Error::postgres("recording the state on the target", e))?;
        tracing::info!(
            slot = %config.slot,
            consistent_point = %resume,
            "--copy-only: the initial copy is done; the slot keeps the changes since, and the next run without --copy-only streams them"
        );
        return Ok(RunOutcome {
            reason: StopReason::CopyDone,
            flushed: resume,
            stats: ApplyStats::default(),
        });
    }
    // The --streaming parallel helper keeps its origin from run to run.
    let live_possible = negotiated.streaming == Streaming::Parallel
        && !negotiated.two_phase
        && config.apply_workers.max(1) == 1;
    if negotiated.streaming == Streaming::Parallel && !live_possible {
        tracing::info!("--streaming parallel with --two-phase or --apply-workers above 1: streamed transactions are spooled and applied at commit");
    }
    let report_recorded =
        refuse_lost_changes(&setup, &mut session, &store, &config.slot, resume).await?;
    restore_applied_metrics(&setup, &config.slot, resume).await;
    // Tables copied after the initial copy whose snapshot this run's stream has not passed yet.
    // (The source's partition trees say which other names the copies' rows go by: read on a
    // session of its own, only when there are such copies.)
    let mut later = copy::copied_since(&setup, &config.slot, resume).await?;
    if !later.is_empty() {
        let source = crate::tls::connect(&config.source)
            .await
            .map_err(|e| e.into_error("connecting to the source"))?;
        copy::cover_partitions(&source, &mut later).await?;
    }
    let copied_since = Arc::new(later);
    let live_now = live_possible && copied_since.is_empty();
    if live_possible && !live_now {
        tracing::info!("--streaming parallel: streamed transactions are spooled and applied at commit in this run, as the stream starts before the snapshot of tables copied after the initial copy (a run started after it applies them as they arrive)");
    }
    let origins_in_use = if live_possible {
        LIVE_HELPER_INDEX + 1
    } else {
        config.apply_workers.max(1)
    };
    store
        .retire_unused_workers(&setup, origins_in_use, resume)
        .await?;
    // After a finished initial copy, the tables it took in: a change of another table (published
    // since) is named once, as its earlier rows are not on the target.
    // (With the partitions of copied tables, and the roots of copied partitions: their rows
    // were copied under the other name.)
    let copied_tables = match copy::status(&setup, &config.slot).await? {
        CopyStatus::Done => {
            let copied = copy::copied_tables(&setup, &config.slot)
                .await
                .map_err(|e| Error::postgres("reading pgapply.copy_state on the target", e))?;
            let source = crate::tls::connect(&config.source)
                .await
                .map_err(|e| e.into_error("connecting to the source"))?;
            Some(Arc::new(copy::covered_by_copies(&source, copied).await))
        }
        _ => None,
    };
    if session.server_version() < 110000 {
        tracing::warn!("the source runs PostgreSQL 10, which does not replicate TRUNCATE: truncate the target's tables yourself when you truncate on the source");
    }
    // (What the stream carries, and, for `--streaming parallel` that this run cannot apply as
    // it arrives, that it is spooled.)
    let shown = if negotiated.streaming == Streaming::Parallel && !live_now {
        negotiated.describe().replace(
            "streaming parallel",
            "streaming parallel (spooled, applied at commit)",
        )
    } else {
        negotiated.describe()
    };
    tracing::info!(negotiated = %shown, "replication options for this source");
    // (Of several hosts, the one this session reached.)
    let source_shown = if config.source.get_hosts().len() > 1 {
        format!(
            "{} (connected to {})",
            conninfo::describe(&config.source),
            session.endpoint()
        )
    } else {
        conninfo::describe(&config.source)
    };
    let target_shown = format!(
        "{}{}",
        conninfo::describe(&config.target),
        crate::sql::connected_to(&setup, &config.target).await
    );
    tracing::info!(
        source = %source_shown,
        target_server = %target_shown,
        server_version = session.server_version(),
        protocol_version = negotiated.protocol_version,
        progress = match &store.mode { ProgressMode::Origin { .. } => "replication origin", ProgressMode::Table => "pgapply.progress table" },
        resume_lsn = %resume,
        "starting replication"
    );
    if let Some(endpos) = config.endpos {
        if resume.is_valid() && resume >= endpos {
            tracing::info!(%endpos, %resume, "already applied up to the end position");
            // (Right after an initial copy the row still says `copying`: `status`, and a
            // cutover waiting for a copy to end, would take it for one under way.) Another
            // process's row too when nothing streams the slot: that one was killed, and `status`
            // and `forget` would take it for a live worker until its heartbeat aged.
            let nobody_streams = session.slot_active_pid(&config.slot).await.ok() == Some(None);
            if let Err(e) = setup
                .execute(
                    "UPDATE pgapply.progress SET state = 'stopped', pid = NULL, heartbeat_at = now() \
                     WHERE slot_name = $1 AND (pid IS NULL OR pid = $2 OR ($3 AND state IS DISTINCT FROM 'copying'))",
                    &[&config.slot, &(std::process::id() as i32), &nobody_streams],
                )
                .await
            {
                tracing::debug!(error = %e, "could not record the stop on the target");
            }
            return Ok(RunOutcome {
                reason: StopReason::EndPosition,
                flushed: resume,
                stats: ApplyStats::default(),
            });
        }
    }
    drop(setup);

    let (applied_tx, applied_rx) = watch::channel(resume);
    let options = ApplierOptions {
        shared_targets,
        deferrable_on_source: Arc::new(deferrable_on_source),
        table_map: Arc::new(config.table_map.clone()),
        column_map: Arc::new(config.column_map.clone()),
        policies: Arc::new(config.policies.clone()),
        policy_updates: config.policy_updates.clone(),
        skip_lsn: store
            .skip_lsn(&*target_connection(&pool, &config.target).await?)
            .await?,
        slot: config.slot.clone(),
        two_phase: negotiated.two_phase,
        log_messages: negotiated.messages,
        spool_dir: match &config.spool_dir {
            Some(dir) => dir.clone(),
            None => {
                let dir = default_spool_dir(&config.slot);
                crate::apply::spool::private_dir(&dir)?;
                dir
            }
        },
        worker: None,
        live_streaming: live_now,
        copied_tables,
        copied_since,
        binary_values: negotiated.binary,
    };
    let applied_at_end = applied_tx.subscribe();
    // (It may wait for a previous session of the slot to end: a stop asked meanwhile ends it.)
    let preparing = ApplyStart::prepare(&config, &pool, &store, resume, applied_tx, options);
    let Some(apply) = unless_stopped(&mut shutdown, preparing).await else {
        return Ok(stopped());
    };
    let apply = apply?;
    let mut stream = session
        .start(&config.slot, resume, &negotiated, &config.publications)
        .await?;

    let (durable_tx, durable_rx) = watch::channel(resume);
    let (report_wanted_tx, report_wanted_rx) = watch::channel(Lsn::INVALID);
    let report_recorded_tx = Arc::new(watch::Sender::new(report_recorded));
    let tracker_conn = target_connection(&pool, &config.target).await?;
    let tracker = tokio::spawn(
        track_durable(
            store.clone(),
            tracker_conn,
            (pool.clone(), config.target.clone()),
            applied_rx,
            durable_tx,
        )
        .in_current_span(),
    );

    let reported = REPORTED.clone();
    let (stop_tx, stop_rx) = watch::channel(None);
    let heartbeat = {
        let client = target_connection(&pool, &config.target).await?;
        let target = (pool.clone(), config.target.clone());
        let (slot, every, reported) = (
            config.slot.clone(),
            config.status_interval,
            reported.clone(),
        );
        let report = (report_wanted_rx, report_recorded_tx.clone());
        Background::spawn(|quit| {
            heartbeat(client, target, slot, every, reported, stop_tx, report, quit)
        })
    };

    let (tx, rx) = mpsc::unbounded_channel();
    let (applier_done_tx, applier_done_rx) = watch::channel(false);
    // Set when a stop is asked for: the applier ends at the next transaction boundary instead of
    // applying the rest of its queue (which the slot sends again at the next start).
    let stop_between = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut applier_task = tokio::spawn(
        apply
            .run(rx, applier_done_tx, stop_between.clone())
            .in_current_span(),
    );
    let mut reader = Reader {
        stream: &mut stream,
        tx: Some(tx),
        budget: Arc::new(Semaphore::new(config.queue_bytes)),
        queue_bytes: config.queue_bytes,
        decoder: MessageDecoder::new(negotiated.abort_info()),
        durable: durable_rx.clone(),
        applier_done: applier_done_rx,
        in_transaction: false,
        forwarded_end: resume,
        keepalive_end: Lsn::INVALID,
        wal_end_at_start: identity.wal_position,
        transaction_started: None,
        streams_open: std::collections::HashMap::new(),
        report_recorded: report_recorded_tx.subscribe(),
        report_wanted: report_wanted_tx,
        received: resume,
        endpos: config.endpos,
        stop_request: stop_rx,
        stop_requested: fence_decides,
        stop_unheard: fence.is_some(),
        status_interval: config.status_interval,
        wal_sender_timeout: Duration::from_millis(wal_sender_timeout_ms),
        progress,
        last_heard: Instant::now(),
        last_status: Instant::now(),
        held_begin: None,
        stopping: shutdown.clone(),
        pace_when_queued: std::env::var("PGAPPLY_PACE_WHEN_QUEUED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(PACE_WHEN_QUEUED),
        pending: reader::carried_pending(),
        receiving_commit_time: 0,
        read_from: resume,
    };
    METRICS.target_ok.set(1);
    METRICS.streaming.set(1);
    let read_result = reader.run(&mut shutdown).await;
    METRICS.streaming.set(0);
    // Said now: with a full queue and a slow target, the applier may take minutes to finish, and
    // the run's error (which would say it) only comes after that.
    // (Only a lost connection: the reader also stops when the applier failed, for its reason.)
    if let Err(e) = &read_result {
        if e.is_connection_lost() {
            tracing::warn!(
                error = %e,
                "the source connection ended: applying what was already received, then reconnecting"
            );
        }
    }
    // Closing the queue lets the applier finish what it has and stop; asked to stop, it ends
    // after the transaction it applies (a queue full behind a slow target could take longer
    // than the shutdown's grace).
    if *shutdown.borrow() {
        stop_between.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    reader.tx = None;
    // The applier may take a while to finish a full queue against a slow target: status updates
    // go on meanwhile, or the source would end the connection (wal_sender_timeout) before the
    // last word below, and the slot would not learn what was applied until the next run.
    let joined = loop {
        tokio::select! {
            joined = &mut applier_task => break joined,
            _ = tokio::time::sleep(reader.status_interval) => {
                if let Err(e) = reader.send_status(false).await {
                    tracing::debug!(error = %e, "status update while the applier finishes not sent");
                }
            }
        }
    };
    // Apply sessions ended from this side (parallel workers at a stop, or after a failure) may
    // live on in the server: a backend waiting for a lock with unread statements in its socket
    // never sees the close, and keeps its origin and row locks for the next start to wait on.
    if *shutdown.borrow() || !matches!(&joined, Ok((_, Ok(())))) {
        if let Ok(client) = target_connection(&pool, &config.target).await {
            crate::apply::sessions::end_own_lingering(&client).await;
        }
    }
    let (stats, apply_result) = match joined {
        Ok(pair) => pair,
        Err(e) => return Err(Error::definite(format!("the apply task failed: {e}"))),
    };
    tracker.abort();
    heartbeat.stop().await;

    // Last word to the source: what is durable now (and the last keepalive's position, once
    // recorded).
    let durable = match target_connection(&pool, &config.target).await {
        Ok(client) => {
            let wanted = reader.keepalive_end;
            if wanted > *report_recorded_tx.borrow()
                && record_reported(&client, &config.slot, wanted).await.is_ok()
            {
                report_recorded_tx.send_replace(wanted);
            }
            match store.durable_position(&client).await {
                // (Never past what was answered as committed: see `track_durable`.)
                Ok(lsn) => lsn.min(*applied_at_end.borrow()).max(*durable_rx.borrow()),
                Err(_) => *durable_rx.borrow(),
            }
        }
        Err(_) => *durable_rx.borrow(),
    };
    let flushed = reader.flush_position(durable);
    if let Err(e) = reader
        .stream
        .send_status(reader.received.max(flushed), flushed, false)
        .await
    {
        tracing::debug!(error = %e, "final status update not sent");
    }
    if let Some(p) = &reader.progress {
        p.send_replace(RunProgress { durable: flushed });
    }
    let reader_stop_requested = reader.stop_requested;
    reader.carry_pending();
    drop(reader);
    stream.close().await;
    if let Ok(client) = target_connection(&pool, &config.target).await {
        let mut last = reported.lock().await;
        // `failed` until a retry (if any) records `streaming` again: the log says why.
        let state = if apply_result.is_err() || read_result.is_err() {
            "failed"
        } else {
            "stopped"
        };
        let _ = write_heartbeat(&client, &config.slot, state, &mut last).await;
    }
    if let (Ok(StopReason::EndPosition), Some(stop)) = (&read_result, reader_stop_requested) {
        // The request stays: a run started again stops there too (see `stop_position`).
        if !config.by_cutover {
            if let Ok(client) = target_connection(&pool, &config.target).await {
                fenced_warning(&client, &config.slot, stop, true).await;
            }
        }
    }

    apply_result?;
    let reason = read_result?;
    // The process's counts, not this connection's: after reconnects, the last connection's
    // alone would undercount what the run applied (and they take in streamed transactions
    // applied by a helper, which commit on their own).
    let m = &*METRICS;
    tracing::info!(
        flushed_lsn = %flushed,
        transactions = m.transactions.get(),
        inserts = m.inserts.get(),
        updates = m.updates.get(),
        deletes = m.deletes.get(),
        reconnects = m.reconnects.get(),
        peak_rss_mb = peak_rss_mb(),
        "replication stopped"
    );
    Ok(RunOutcome {
        reason,
        flushed,
        stats,
    })
}

/// This process's peak resident memory in MB, for the last log line (memory is bounded by the
/// queue budgets, whatever the size of a transaction; this shows it).
fn peak_rss_mb() -> i64 {
    // SAFETY: getrusage fills the zeroed struct it is given a valid pointer to.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    // Linux reports kilobytes.
    usage.ru_maxrss / 1024
}

/// Refuses a source whose WAL ends before what the target has applied from it: a standby that
/// was behind and was promoted, or a server restored from a backup, has the same system
/// identifier, and streaming from there would skip, without a word, every transaction it commits
/// below that position.
async fn source_has_reached(
    session: &mut ReplicationSession,
    slot: &str,
    wal_end: Lsn,
    resume: Lsn,
) -> Result<()> {
    if !resume.is_valid() || resume <= wal_end {
        return Ok(());
    }
    // Read again: the first reading came before the target's position was read.
    let wal_end = session.identify_system().await?.wal_position;
    if resume <= wal_end {
        return Ok(());
    }
    // A standby just started reports what it has replayed, from its last restartpoint on,
    // until it receives WAL again: wait for it.
    if session.in_recovery().await? {
        return Err(Error::transient(format!(
            "the source is a standby whose WAL ends at {wal_end} for now, before {resume}, which the target has applied: waiting for it to catch up"
        )));
    }
    Err(Error::definite(format!(
        "the target has applied changes from this source up to {resume}, but the WAL of the source reached ({}) ends at {wal_end}: it is not the server those changes came from (a standby that was behind was promoted, the server was restored from a backup, or an old primary started again after a failover: with several hosts in --source the first that answers is taken; stop it, and pgapply goes on from the server that took over), and its transactions below {resume} would be skipped. If it is the right server: {}",
        session.endpoint(),
        start_over_advice_for_another_server(slot)
    )))
}

/// Refuses a source whose history forked from the timeline the target's position was read on,
/// below that position: a standby that was behind when it was promoted starts a new timeline at
/// its own end of WAL, and the target then holds changes of the old primary the new one never had,
/// while the new primary's own transactions up to that position would be skipped without a word
/// (once its WAL is past the position, `source_has_reached` cannot tell); and one whose timeline
/// has the recorded number but began elsewhere. Then says what to record once the run streams:
/// the timeline it streams from and where it began (nothing for a standby source, which changes
/// timelines as it streams), if that is not what the target has already.
async fn on_the_timeline_applied_from(
    setup: &tokio_postgres::Client,
    session: &mut ReplicationSession,
    slot: &str,
    timeline: u32,
    resume: Lsn,
) -> Result<Option<TimelineRecord>> {
    if timeline == 0 {
        return Ok(None);
    }
    let row = setup
        .query_opt(
            "SELECT source_timeline, source_timeline_start::text FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?;
    let recorded: Option<i64> = row.as_ref().and_then(|r| r.get(0));
    let recorded_start: Option<Lsn> = row
        .as_ref()
        .and_then(|r| r.get::<_, Option<String>>(1))
        .and_then(|l| l.parse().ok());
    let history = session.timeline_history(timeline).await?;
    // Where this timeline began: the switch point from its parent (0/0 for the first).
    let began = history.last().map_or(Lsn(0), |(_, l)| *l);
    let start_over = start_over_advice_for_another_server(slot);
    match recorded {
        Some(recorded) if recorded != i64::from(timeline) && resume.is_valid() => {
            match history.iter().find(|(t, _)| i64::from(*t) == recorded) {
                Some((_, end)) if resume <= *end => {}
                Some((_, end)) => {
                    return Err(Error::definite(format!(
                        "the source is on timeline {timeline}, which forked from timeline {recorded} at {end} (a failover, or a restore to a point in time), but the target has applied changes of timeline {recorded} up to {resume}: it holds changes this server never had, and this server's own transactions between {end} and {resume} would be skipped: {start_over}"
                    )));
                }
                None => {
                    return Err(Error::definite(format!(
                        "the target has applied changes of timeline {recorded} of this source up to {resume}, but the source reached ({}) is on timeline {timeline}, whose history does not go through timeline {recorded}: it is not the server those changes came from (an old primary after a failover, say: with several hosts in --source the first that answers is taken). Stop it, or point --source at the server that took over; or, if this is the right one: {start_over}",
                        session.endpoint()
                    )));
                }
            }
        }
        // The same number, another timeline: two servers promoted from one parent (without a
        // shared WAL archive) both took it, at different points.
        Some(_) if resume.is_valid() => {
            if let Some(start) = recorded_start.filter(|s| *s != began) {
                if resume > start.min(began) {
                    return Err(Error::definite(format!(
                        "the source's timeline {timeline} began at {began}, but the timeline {timeline} the target has applied changes of (up to {resume}) began at {start}: two servers were promoted to the same timeline number, and this one is not the server those changes came from. Point --source at the server that took over; or, if this is the right one: {start_over}"
                    )));
                }
            }
        }
        _ => {}
    }
    // A standby follows its upstream onto new timelines while it streams: what the timeline
    // was at the start says nothing of later positions, so nothing is recorded (and checked).
    let (timeline, began) = if session.in_recovery().await? {
        (None, None)
    } else {
        (Some(i64::from(timeline)), Some(began.to_string()))
    };
    let changed = recorded != timeline || recorded_start.map(|s| s.to_string()) != began;
    Ok(changed.then_some(TimelineRecord { timeline, began }))
}

/// The source's timeline, and where it began, for `pgapply.progress` (both NULL: a standby).
struct TimelineRecord {
    timeline: Option<i64>,
    began: Option<String>,
}

impl TimelineRecord {
    async fn record(&self, setup: &tokio_postgres::Client, slot: &str) -> Result<()> {
        setup
            .execute(
                "UPDATE pgapply.progress SET source_timeline = $2, source_timeline_start = $3::text::pg_lsn WHERE slot_name = $1",
                &[&slot, &self.timeline, &self.began],
            )
            .await
            .map_err(|e| Error::postgres("recording the source's timeline on the target", e))?;
        Ok(())
    }
}

/// What to do when the target holds changes the source never had: the slot's state on the
/// target (its progress, its copy's record, its origins) must go with the slot, or a new copy
/// would find the old one "done" and copy nothing.
fn start_over_advice_for_another_server(slot: &str) -> String {
    format!(
        "compare the tables (pgapply verify), then start over: remove the slot's state on the target and the slot (pgapply forget --target ... --slot {slot} --drop-slot --source ...), then run with --copy-data --truncate-target (under this slot name or a new one), with --source naming this server alone"
    )
}

/// How long the source may say nothing before the connection is presumed lost. A source busy
/// decoding changes it does not send (unpublished tables, row filters) is silent until it sends a
/// keepalive, every `wal_sender_timeout / 2` at the latest (PostgreSQL 15+; older ones may stay
/// silent longer): the limit waits for a whole `wal_sender_timeout`, and at least a minute, as
/// PostgreSQL's own subscriber does (`wal_receiver_timeout`).
pub fn silence_limit(status_interval: Duration, wal_sender_timeout: Duration) -> Duration {
    (status_interval * 3)
        .max(Duration::from_secs(60))
        .max(wal_sender_timeout + status_interval)
}

/// Status updates must reach the source well within its `wal_sender_timeout`, or it may end the
/// connection as unresponsive while pgapply is busy (a reply to a keepalive request is sent at
/// once, but only when pgapply reads the request).
pub fn status_interval_problem(interval: Duration, wal_sender_timeout_ms: u64) -> Option<String> {
    let timeout = Duration::from_millis(wal_sender_timeout_ms);
    (wal_sender_timeout_ms > 0 && interval > timeout / 2).then(|| {
        format!(
            "--status-interval {} is more than half the source's wal_sender_timeout ({}): the source may end the connection between two status updates; use --status-interval {} or less, or raise wal_sender_timeout on the source",
            humantime::format_duration(interval),
            humantime::format_duration(timeout),
            humantime::format_duration(timeout / 2)
        )
    })
}

/// A status interval that the source's `wal_sender_timeout` allows with room to spare: a third
/// of it (never under 100 ms).
pub fn safe_status_interval(wal_sender_timeout_ms: u64) -> Duration {
    (Duration::from_millis(wal_sender_timeout_ms) / 3).max(Duration::from_millis(100))
}

/// Turns the applier's committed position into the target's durable position.
async fn track_durable(
    store: ProgressStore,
    mut client: Object,
    (pool, target): (Pool, tokio_postgres::Config),
    mut applied: watch::Receiver<Lsn>,
    durable: watch::Sender<Lsn>,
) {
    // Each check flushes the target's WAL: at most ten a second.
    let mut pace = tokio::time::interval(Duration::from_millis(100));
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // After a failed read the same position is asked for again a second later: waiting for the
    // next applied commit instead would hold the slot back for as long as the source is quiet.
    let mut failed = false;
    loop {
        if failed {
            tokio::time::sleep(Duration::from_secs(1)).await;
        } else if applied.changed().await.is_err() {
            return;
        }
        let committed = *applied.borrow_and_update();
        let position = match store.mode {
            // Synchronous commit: committed is durable.
            ProgressMode::Table => Ok(committed),
            // Never past what was answered as committed: PostgreSQL 16+ also moves an origin
            // when a transaction that had its position set aborts, and a source slot moved past
            // that transaction would never send it again.
            ProgressMode::Origin { .. } => {
                pace.tick().await;
                store
                    .durable_position(&client)
                    .await
                    .map(|lsn| lsn.min(committed))
            }
        };
        match position {
            Ok(lsn) => {
                METRICS.flushed_lsn.set_max(lsn.0);
                durable.send_if_modified(|d| {
                    let advanced = lsn > *d;
                    if advanced {
                        *d = lsn;
                    }
                    advanced
                });
            }
            Err(e) => {
                if !failed {
                    tracing::warn!(error = %e, "could not read the durable position on the target; trying again every second");
                }
                failed = true;
                // A session that is gone (ended by the server, say) is replaced.
                if client.is_closed() {
                    if let Ok(fresh) = target_connection(&pool, &target).await {
                        client = fresh;
                    }
                }
                continue;
            }
        }
        failed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_interval_too_long_for_the_source_is_lowered() {
        let ten = Duration::from_secs(10);
        assert!(status_interval_problem(ten, 60_000).is_none());
        assert!(status_interval_problem(ten, 0).is_none(), "no timeout");
        assert!(status_interval_problem(ten, 8_000).is_some());
        assert_eq!(
            safe_status_interval(8_000),
            Duration::from_millis(8_000) / 3
        );
        assert!(status_interval_problem(safe_status_interval(8_000), 8_000).is_none());
        assert_eq!(safe_status_interval(30), Duration::from_millis(100));
    }

    #[test]
    fn silence_limit_waits_for_the_sources_keepalives() {
        let s = Duration::from_secs;
        // Defaults (10 s status interval, 60 s wal_sender_timeout): a keepalive comes every 30 s.
        assert_eq!(silence_limit(s(10), s(60)), s(70));
        // A raised wal_sender_timeout: its keepalives come less often.
        assert_eq!(silence_limit(s(10), s(300)), s(310));
        // No wal_sender_timeout, short status interval: a minute, as wal_receiver_timeout.
        assert_eq!(silence_limit(s(1), s(0)), s(60));
        // A long status interval: three of them.
        assert_eq!(silence_limit(s(40), s(60)), s(120));
    }
}
