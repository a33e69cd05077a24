//! Starting the apply side of a run: one applier, or a dispatcher and `--apply-workers` workers,
//! with the checks made before the first change is applied.

use super::*;
use crate::apply::applier::SharedTargets;
use std::sync::atomic::AtomicBool;

/// The `--streaming parallel` helper records its position in the origin a second parallel worker
/// would use (`pgapply_<slot>-w1`): the two never run together.
pub(crate) const LIVE_HELPER_INDEX: usize = 1;

/// The applier of a run, connected and ready: one, or parallel workers behind a dispatcher.
pub(super) enum ApplyStart {
    Single(Box<Applier>),
    Parallel(Box<Workers>),
}

impl ApplyStart {
    pub(super) async fn prepare(
        config: &RunConfig,
        pool: &Pool,
        store: &ProgressStore,
        resume: Lsn,
        applied: watch::Sender<Lsn>,
        options: ApplierOptions,
    ) -> Result<Self> {
        let connect = || target_connection(pool, &config.target);
        let n = config.apply_workers.max(1);
        if n == 1 {
            let live = options.live_streaming;
            let mut applier = Applier::new(
                connect().await?,
                connect().await?,
                store.clone(),
                resume,
                config.apply.clone(),
                applied,
                options.clone(),
            )
            .await?;
            if live {
                Self::add_live_helper(&mut applier, config, store, resume, options).await?;
            }
            return Ok(ApplyStart::Single(Box::new(applier)));
        }
        let setup = connect().await?;
        let mut stores = Vec::new();
        for index in 0..n {
            stores.push(store.for_worker(&setup, index).await?);
        }
        drop(setup);
        let origins: Arc<Vec<String>> = Arc::new(
            stores
                .iter()
                .map(|s| s.origin_name().unwrap_or_default().to_owned())
                .collect(),
        );
        let lock_key = crate::apply::parallel::lock_key(&config.slot);
        let applied = Arc::new(applied);
        let applied_rx = applied.subscribe();
        let mut workers = Vec::new();
        let mut links = Vec::new();
        for (index, store) in stores.into_iter().enumerate() {
            let role = WorkerRole {
                index,
                lock_key,
                origins: origins.clone(),
            };
            let applier = Applier::new(
                connect().await?,
                connect().await?,
                store,
                resume,
                config.apply.clone(),
                applied.clone(),
                ApplierOptions {
                    worker: Some(role),
                    ..options.clone()
                },
            )
            .await?;
            let (tx, rx) = mpsc::unbounded_channel();
            links.push(WorkerLink { tx });
            workers.push((applier, rx));
        }
        let (stopped, stopped_rx) = watch::channel(false);
        let serial_through = config.apply.unbatched_through.clone();
        let dispatcher = Dispatcher::new(
            links,
            applied_rx,
            stopped_rx,
            connect().await?,
            DispatcherOptions {
                resume,
                skip_lsn: options.skip_lsn,
                serial_through: serial_through.clone(),
                table_map: options.table_map.clone(),
                column_map: options.column_map.clone(),
                queue_bytes: config.queue_bytes,
            },
        );
        tracing::info!(workers = n, "applying with parallel workers");
        Ok(ApplyStart::Parallel(Box::new(Workers {
            dispatcher,
            workers,
            stopped,
            serial_through,
        })))
    }

    /// `--streaming parallel`: a helper applier on connections of its own, with its own origin
    /// (`applier::live`). Not with the progress table (one row, one session) nor after a
    /// failure of such a transaction in this process: then streamed transactions are spooled.
    pub(super) async fn add_live_helper(
        applier: &mut Applier,
        config: &RunConfig,
        store: &ProgressStore,
        resume: Lsn,
        options: ApplierOptions,
    ) -> Result<()> {
        if store.is_table_mode() {
            tracing::info!("--streaming parallel: progress is kept in the pgapply.progress table (no replication origins), so streamed transactions are spooled and applied at commit");
            return Ok(());
        }
        if config
            .apply
            .live_streaming_off
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            tracing::info!("--streaming parallel: streamed transactions are spooled and applied at commit after the failure above");
            return Ok(());
        }
        // Its own pool, dropped here: when the helper stops (even inside its transaction, after
        // an error) its sessions close with it and release what they hold, instead of going
        // back to a pool for someone else. The watchdog has a one-session pool of its own.
        let pool = target_pool(&config.target, 2)?;
        let watchdog_pool = target_pool(&config.target, 1)?;
        let connect = || target_connection(&pool, &config.target);
        let helper = async {
            let helper_store = store
                .for_worker(&*connect().await?, LIVE_HELPER_INDEX)
                .await?;
            let (helper_applied, _) = watch::channel(resume);
            // The helper's transaction has no commit LSN until it commits: a failed batch of it
            // must not turn batching off for the main applier's later transactions.
            let settings = ApplySettings {
                unbatched_through: Arc::default(),
                ..config.apply.clone()
            };
            Applier::new(
                connect().await?,
                connect().await?,
                helper_store,
                resume,
                settings,
                helper_applied,
                options,
            )
            .await
        }
        .await;
        let attached = match helper {
            Ok(helper) => applier.attach_live_helper(helper, watchdog_pool).await,
            Err(e) => Err(e),
        };
        if let Err(e) = attached {
            // The helper's origin still held by the session of a run that was just killed (or
            // moved by it after the start position was read), or a connection lost: the run is
            // retried, as for the main session's origin. (Other
            // transient errors, too many connections say, fall back to spooling.)
            if e.sqlstate() == Some("55006")
                || e.is_connection_lost()
                || ProgressStore::is_resume_moved(&e)
            {
                return Err(e);
            }
            // Spooling works wherever this does not (no free replication origin, say).
            tracing::warn!(error = %e, "--streaming parallel: could not set up the second target session; streamed transactions are spooled and applied at commit");
        }
        Ok(())
    }

    /// Applies what arrives on `rx` until it closes or applying fails.
    pub(super) async fn run(
        self,
        mut rx: mpsc::UnboundedReceiver<Envelope>,
        done: watch::Sender<bool>,
        stop_between: Arc<AtomicBool>,
    ) -> (ApplyStats, Result<()>) {
        let outcome = match self {
            ApplyStart::Single(mut applier) => {
                applier.stop_between = stop_between;
                let result = applier.run(&mut rx).await;
                (applier.stats.clone(), result)
            }
            ApplyStart::Parallel(mut workers) => {
                workers.stop_between(stop_between);
                workers.run(&mut rx).await
            }
        };
        let _ = done.send(true);
        outcome
    }
}

/// The target must not be the source's own database: every change applied there would be
/// published again and applied once more, without end. (Another database of the same cluster
/// is fine.) Not known when the target role may not read the control data: then not checked.
pub async fn refuse_same_database(
    target: &tokio_postgres::Client,
    system_id: &str,
    database: &str,
) -> Result<()> {
    let row = target
        .query_opt(
            "SELECT system_identifier::text, current_database()::text FROM pg_catalog.pg_control_system()",
            &[],
        )
        .await;
    if let Ok(Some(row)) = row {
        if row.get::<_, String>(0) == system_id && row.get::<_, String>(1) == database {
            return Err(Error::definite(format!(
                "--target is the source's own database {database:?} (the same cluster: system identifier {system_id}): every change applied there would be published again and applied once more, without end; point --target at another database or cluster"
            )));
        }
    }
    Ok(())
}

/// What the error of a start that finds the slot streamed by another process says (a warm
/// standby worker meets it at every try: `is_slot_in_use`).
const SLOT_IN_USE: &str = "is in use on the source";

/// Whether `e` says the slot is streamed by another process: a warm standby waits for it.
pub fn is_slot_in_use(e: &Error) -> bool {
    e.message().contains(SLOT_IN_USE)
}

/// Refuses a slot the source has confirmed past everything this target applied or was told it
/// could report: the changes between are gone from the slot and missing on the target (a target
/// restored from an older backup, a slot dropped and made again, another consumer of the slot).
/// Returns how far past the applied position pgapply may report (`Reader::report_recorded`).
pub(super) async fn refuse_lost_changes(
    setup: &tokio_postgres::Client,
    session: &mut ReplicationSession,
    store: &crate::apply::ProgressStore,
    slot: &str,
    resume: Lsn,
) -> Result<Lsn> {
    let context = |e| Error::postgres("reading pgapply.progress on the target", e);
    let recorded: Option<String> = setup
        .query_opt(
            "SELECT reported_lsn::text FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(context)?
        .and_then(|r| r.get(0));
    let recorded: Option<Lsn> = match recorded {
        Some(text) => Some(text.parse().map_err(|e| {
            Error::definite(format!(
                "pgapply.progress on the target holds an unreadable reported_lsn {text:?}: {e}"
            ))
        })?),
        None => None,
    };
    // Another process streaming from the slot moves it under this comparison: that is what
    // to say (the run waits for it as for a previous run's session), not lost changes.
    if let Some(pid) = session.slot_holder(slot).await? {
        return Err(Error::transient(format!(
            "replication slot {slot:?} {SLOT_IN_USE} (its walsender is process {pid} there: another pgapply streaming it, into this target or another one, or the session of a run that just ended, or an earlier connection of another pgapply that the network cut off, which the source ends after wal_sender_timeout (never when that is 0: then end it there, SELECT pg_terminate_backend({pid})); `pgapply status` on the target shows its running worker): it must end first"
        )));
    }
    let Some(confirmed) = session.slot_confirmed(slot).await? else {
        return Ok(recorded.unwrap_or(resume));
    };
    let Some(recorded) = recorded else {
        // A row from before pgapply recorded this (or set back by hand): the slot's position is
        // taken as it is, once.
        record_reported(setup, slot, confirmed).await?;
        return Ok(confirmed);
    };
    if resume.is_valid() && confirmed > resume.max(recorded) {
        // Another worker of this slot (the one a warm standby waits for) may have applied and
        // confirmed more since this run read where the target stands, and let go of the slot
        // just now (its connection to the source cut): read both again. Moved: this run starts
        // again from there.
        let applied_now = store.durable_position(setup).await?;
        let recorded_now: Option<String> = setup
            .query_opt(
                "SELECT greatest(lsn, reported_lsn)::text FROM pgapply.progress WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(context)?
            .and_then(|r| r.get(0));
        let recorded_now = recorded_now
            .and_then(|text| text.parse::<Lsn>().ok())
            .unwrap_or(recorded);
        if confirmed <= applied_now.max(recorded_now) {
            return Err(Error::transient(format!(
                "the target's position for slot {slot:?} moved from {} to {} while this run started (another worker applied for it, and let go of the slot): starting again from there",
                resume.max(recorded),
                applied_now.max(recorded_now)
            )));
        }
        return Err(Error::definite(format!(
            "replication slot {slot:?} on the source has confirmed changes up to {confirmed}, but this target applied them only up to {resume} (and pgapply never reported more than {}): the changes between are no longer in the slot and are missing here. That happens when the target was restored from an older backup, when the slot was dropped and made again, or when another pgapply or client consumed the slot. Start over with a new slot and the initial copy (drop this slot: SELECT pg_drop_replication_slot({}); then run with --copy-data --truncate-target), or, if the target is known to hold those changes, accept the slot's position: UPDATE pgapply.progress SET reported_lsn = NULL WHERE slot_name = {} on the target, and start again",
            recorded.max(resume),
            crate::sql::quote_literal(slot),
            crate::sql::quote_literal(slot),
        )));
    }
    Ok(recorded)
}

/// The applied position and the time of the last applied commit, as the target recorded them,
/// into the metrics of a process that has applied nothing yet: the lag in seconds after a restart
/// (a large first transaction, a locked table) is then the age of that commit, not 0, and the
/// applied position does not drop to 0 on graphs. Best effort.
pub(super) async fn restore_applied_metrics(
    setup: &tokio_postgres::Client,
    slot: &str,
    resume: Lsn,
) {
    METRICS.applied_lsn.set_max(resume.0);
    if METRICS.last_commit_time.get() != 0 {
        return;
    }
    // (Microseconds since 2000-01-01, PostgreSQL's epoch, as `PgTimestamp`.)
    let row = setup
        .query_opt(
            "SELECT ((extract(epoch FROM coalesce(last_commit_time, commit_time)) - 946684800) * 1000000)::bigint \
             FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await;
    if let Ok(Some(row)) = row {
        if let Some(micros) = row.get::<_, Option<i64>>(0).filter(|m| *m > 0) {
            METRICS.last_commit_time.set(micros as u64);
        }
    }
}

/// Whether two lists name the same publications, in any order.
pub fn same_publications(a: &[String], b: &[String]) -> bool {
    let sorted = |list: &[String]| {
        let mut l = list.to_vec();
        l.sort();
        l.dedup();
        l
    };
    sorted(a) == sorted(b)
}

/// Records the publications this run replicates for the slot; says so when the slot's previous
/// run gave others (a typo would otherwise leave tables out, and move the slot past their
/// changes, without a word). Returns whether one the previous run gave is left out now (only
/// added ones leave each table's earlier publishing rows in place).
/// The publications the slot's last run gave, if one ran.
pub async fn recorded_publications(
    target: &tokio_postgres::Client,
    slot: &str,
) -> std::result::Result<Option<Vec<String>>, tokio_postgres::Error> {
    Ok(target
        .query_opt(
            "SELECT publications FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .and_then(|r| r.get(0)))
}

/// Whether a publication the last run gave (`previous`) is left out now: its catalog rows no
/// longer count, so what publishes each copied table is not compared (added ones leave the
/// earlier rows in place).
pub fn publications_dropped(previous: Option<&[String]>, now: &[String]) -> bool {
    previous.is_some_and(|p| p.iter().any(|name| !now.contains(name)))
}

pub(super) async fn publications_change(
    target: &tokio_postgres::Client,
    slot: &str,
    publications: &[String],
) -> Result<bool> {
    let context = |e| Error::postgres("recording the slot's publications on the target", e);
    let previous = recorded_publications(target, slot).await.map_err(context)?;
    let changed = previous
        .as_ref()
        .is_some_and(|p| !same_publications(p, publications));
    let dropped = publications_dropped(previous.as_deref(), publications);
    if let Some(previous) = previous.as_ref().filter(|_| changed && !dropped) {
        // Only added: nothing is left out.
        tracing::info!(
            slot,
            before = %previous.join(","),
            now = %publications.join(","),
            "this run replicates more publications than the last one: the tables only the added ones publish are applied from here on"
        );
    } else if let Some(previous) = previous.filter(|_| changed) {
        tracing::warn!(
            slot,
            before = %previous.join(","),
            now = %publications.join(","),
            "this slot was replicated with other publications until now: the tables only the ones left out publish are not applied by this run, and the slot moves past their changes; if that is a mistake, stop pgapply and give --publication {}",
            previous.join(",")
        );
    }
    Ok(dropped)
}

/// Records the slot's publications and source database on the target, once the run has found
/// the source to be the slot's (its slot there, or one made now): a start refused before that
/// (another database's slot, a slot the server lacks) leaves what the last run recorded.
pub(super) async fn record_source(
    target: &tokio_postgres::Client,
    slot: &str,
    publications: &[String],
    database: &str,
) -> Result<()> {
    target
        .execute(
            "UPDATE pgapply.progress SET publications = $2, source_database = $3 WHERE slot_name = $1",
            &[&slot, &publications, &database],
        )
        .await
        .map_err(|e| Error::postgres("recording the slot's publications on the target", e))?;
    Ok(())
}

/// Says when another slot's worker, alive now, applies one of the same publications of the same
/// source database into this target database: two workers writing the same tables meet each
/// other's rows as conflicts (insert_exists), and a conflict policy would only hide that.
/// (Usually a second worker started by mistake, with another --slot.) Records this slot's source
/// database first, which the other slots' rows are compared by (with the system identifier).
pub(super) async fn warn_of_other_live_slots(
    target: &tokio_postgres::Client,
    slot: &str,
    publications: &[String],
    source: &crate::source::SystemIdentity,
) {
    let Ok(rows) = target
        .query(
            "SELECT slot_name, pid, array_to_string(publications, ',') FROM pgapply.progress \
             WHERE slot_name <> $1 AND publications && $2::text[] \
               AND source_system_id IS NOT DISTINCT FROM $3 \
               AND coalesce(source_database, $4) = $4 \
               AND heartbeat_at > now() - interval '1 minute' AND stop_lsn IS NULL \
               AND pid IS NOT NULL AND coalesce(state, '') NOT IN ('stopped', 'failed')",
            &[&slot, &publications, &source.system_id, &source.database],
        )
        .await
    else {
        return;
    };
    for row in rows {
        let (other, pid, shared): (String, Option<i32>, Option<String>) =
            (row.get(0), row.get(1), row.get(2));
        tracing::warn!(
            other_slot = %other,
            pid = pid.unwrap_or(0),
            publications = %shared.unwrap_or_default(),
            "another pgapply worker (slot {other:?}) applies the same publication into this target database now: two workers writing the same tables meet each other's rows as conflicts (insert_exists, update_missing); if this one was started by mistake, stop it and remove its slot (pgapply forget --slot {slot} --drop-slot)"
        );
    }
}

/// Source tables this worker's publications share with another slot's that applies from the same
/// source database into this target (a worker that a cutover stopped aside): both workers would
/// apply each of their changes, the second time as a conflict, and the two streams' updates land
/// in whatever order the workers reach them, so an older value can win. Said, not refused: the
/// other worker may map them to target tables of its own (its `[tables]`, which this one cannot
/// see); a table this worker maps elsewhere is named only when the other slot is known to write
/// that target table too (`pgapply.slot_tables`: its copies and its stream).
pub async fn tables_shared_with_other_slots(
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
    slot: &str,
    publications: &[String],
    table_map: &crate::config::TableMap,
) -> Vec<String> {
    let Ok(Some(here)) = source
        .query_opt(
            "SELECT system_identifier::text, current_database()::text FROM pg_catalog.pg_control_system()",
            &[],
        )
        .await
    else {
        return Vec::new();
    };
    let (system_id, database): (String, String) = (here.get(0), here.get(1));
    // (No pgapply schema on the target yet: no other worker.)
    let Ok(others) = target
        .query(
            "SELECT slot_name, publications FROM pgapply.progress \
             WHERE slot_name <> $1 AND publications IS NOT NULL AND stop_lsn IS NULL \
               AND source_system_id = $2 AND coalesce(source_database, $3) = $3 \
             ORDER BY slot_name",
            &[&slot, &system_id, &database],
        )
        .await
    else {
        return Vec::new();
    };
    let mut said = Vec::new();
    for other in others {
        let (other_slot, theirs): (String, Vec<String>) = (other.get(0), other.get(1));
        let Ok(rows) = source
            .query(
                "SELECT DISTINCT schemaname::text, tablename::text FROM pg_catalog.pg_publication_tables \
                 WHERE pubname = ANY($1) \
                 INTERSECT \
                 SELECT schemaname::text, tablename::text FROM pg_catalog.pg_publication_tables \
                 WHERE pubname = ANY($2) \
                 ORDER BY 1, 2",
                &[&publications, &theirs],
            )
            .await
        else {
            continue;
        };
        // The target tables the other slot is known to write (its copies, its stream).
        let written: Vec<(String, String)> = target
            .query(
                "SELECT schema_name, table_name FROM pgapply.slot_tables WHERE slot_name = $1",
                &[&other_slot],
            )
            .await
            .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
            .unwrap_or_default();
        let shared: Vec<String> = rows
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
            .filter(|name| match table_map.get(name) {
                // Mapped elsewhere here: shared only if the other writes that table too.
                Some(mapped) => written.contains(mapped),
                None => true,
            })
            .map(|(schema, name)| crate::sql::qualified_name(&schema, &name))
            .collect();
        if shared.is_empty() {
            continue;
        }
        said.push(format!(
            "source table(s) {} are published both by this worker's publication(s) {} and by publication(s) {} of slot {other_slot:?}, which applies from the same source database into this target: each of their changes would be applied twice (the second time as a conflict, such as insert_exists) and the two workers' updates could land out of order (an older value winning). Take each table out of one worker's publications (ALTER PUBLICATION ... DROP TABLE ...), or map it to a different target table in one worker's [tables] (if slot {other_slot:?} maps it to a table of its own already, nothing is wrong); if slot {other_slot:?} is retired for good, remove its state (pgapply forget --slot {other_slot})",
            shared.join(", "),
            publications.join(", "),
            theirs.join(", "),
        ));
    }
    said
}

/// `--origin none` with `--copy-data`: tables of the publications that a subscription on the
/// source writes into are copied whole, rows of every origin, while their later changes that
/// come the same way are left out: the target's copy goes stale without an error (PostgreSQL's
/// own CREATE SUBSCRIPTION warns the same).
pub async fn copy_across_origins(
    source: &tokio_postgres::Client,
    origin_none: bool,
    copy_data: bool,
    publications: &[String],
) -> Option<String> {
    if !(origin_none && copy_data) {
        return None;
    }
    let rows = source
        .query(
            "SELECT DISTINCT n.nspname::text, c.relname::text, s.subname::text \
             FROM pg_catalog.pg_subscription_rel sr \
             JOIN pg_catalog.pg_subscription s ON s.oid = sr.srsubid \
             JOIN pg_catalog.pg_class c ON c.oid = sr.srrelid \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_catalog.pg_publication_tables pt ON pt.schemaname = n.nspname AND pt.tablename = c.relname \
             WHERE pt.pubname = ANY ($1) \
               AND s.subdbid = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
             ORDER BY 1, 2, 3",
            &[&publications],
        )
        .await
        .ok()?;
    let tables: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{} (subscription {})",
                crate::sql::qualified_name(r.get(0), r.get(1)),
                crate::sql::quote_ident(r.get(2))
            )
        })
        .collect();
    let tables = tables.join(", ");
    (!rows.is_empty()).then(|| format!(
        "--origin none with --copy-data: {tables} on the source take rows from a subscription there. The initial copy takes all their rows, whatever their origin, but --origin none leaves out the changes that come to them that way afterwards: the target's copy of them goes stale without an error. Replicate those tables without --origin none, or from the server their rows come from"
    ))
}

/// A worker that replicates from this target into this source (its state is on the source):
/// with `--origin any` on both sides, each change one applies is sent back by the other, for
/// ever. Said when this run takes every origin (the other worker's setting is not known here).
pub async fn replication_loop(
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
    origin_none: bool,
    (publications, table_map): (&[String], &crate::config::TableMap),
) -> Option<String> {
    if origin_none {
        return None;
    }
    let target_id: String = target
        .query_one(
            "SELECT system_identifier::text FROM pg_catalog.pg_control_system()",
            &[],
        )
        .await
        .ok()?
        .get(0);
    let target_db: String = target
        .query_one("SELECT current_database()::text", &[])
        .await
        .ok()?
        .get(0);
    // (No schema pgapply on the source: nothing replicates into it.)
    let exists = source
        .query_one(
            "SELECT pg_catalog.to_regclass('pgapply.progress') IS NOT NULL",
            &[],
        )
        .await
        .ok()?
        .get::<_, bool>(0);
    if !exists {
        return None;
    }
    let back: Vec<(String, Option<Vec<String>>)> = source
        .query(
            "SELECT slot_name, publications FROM pgapply.progress \
             WHERE source_system_id = $1 AND coalesce(source_database, $2) = $2 AND stop_lsn IS NULL \
             ORDER BY 1",
            &[&target_id, &target_db],
        )
        .await
        .ok()?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // Only a worker that publishes back a table this run writes makes a loop (two-way
    // replication of disjoint tables is fine). Its publications are read where they are, on
    // this target; one whose publications are not recorded (an older pgapply) is taken to.
    let ours: Vec<String> = crate::copy::published_tables(source, publications, table_map)
        .await
        .ok()?
        .iter()
        .map(|t| t.target_qualified())
        .collect();
    let mut first = None;
    for (slot, theirs) in &back {
        let Some(theirs) = theirs else {
            first = Some(slot);
            break;
        };
        if publishes_any(target, theirs, &ours).await.unwrap_or(true) {
            first = Some(slot);
            break;
        }
    }
    let first = first?;
    Some(format!(
        "a pgapply worker (slot {first:?}) replicates from this target into this source (its state is in pgapply.progress on the source): with --origin any, as this run has, what that worker applies on the source comes back here, and what this run applies goes back there, for ever, unless that worker runs with --origin none. For two-way replication give both directions --origin none (PostgreSQL 16+ sources; README: \"Several workers\", two-way)"
    ))
}

/// Whether `publications` (on `server`) publish any of `tables` (qualified names), a partition
/// or a partitioned table counted with its tree (12+; names alone before). (A table that is
/// no partition has no ancestors, itself neither: compared as it is first.)
async fn publishes_any(
    server: &tokio_postgres::Client,
    publications: &[String],
    tables: &[String],
) -> std::result::Result<bool, tokio_postgres::Error> {
    let tree = crate::sql::server_version(server).await? >= 120000;
    let query = if tree {
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_tables p \
                        CROSS JOIN LATERAL (SELECT pg_catalog.to_regclass(t) AS rel FROM unnest($2::text[]) t) ours \
                        WHERE p.pubname = ANY($1) AND ours.rel IS NOT NULL \
                          AND (ours.rel = pg_catalog.format('%I.%I', p.schemaname, p.tablename)::regclass \
                               OR ours.rel IN (SELECT relid FROM pg_catalog.pg_partition_ancestors(pg_catalog.format('%I.%I', p.schemaname, p.tablename)::regclass)) \
                               OR pg_catalog.format('%I.%I', p.schemaname, p.tablename)::regclass \
                                  IN (SELECT relid FROM pg_catalog.pg_partition_ancestors(ours.rel))))"
    } else {
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_tables p \
                        WHERE p.pubname = ANY($1) \
                          AND pg_catalog.format('%I.%I', p.schemaname, p.tablename)::regclass \
                              = ANY(SELECT pg_catalog.to_regclass(t) FROM unnest($2::text[]) t))"
    };
    Ok(server
        .query_one(query, &[&publications, &tables])
        .await?
        .get(0))
}

/// Entries of the config file's `[tables]` (renames, conflict policies) that name no published
/// table: a misspelt name would otherwise be ignored without a word.
pub fn unmatched_table_settings(
    config: &RunConfig,
    tables: &[copy::PublishedTable],
) -> Vec<String> {
    let published =
        |key: &(String, String)| tables.iter().any(|t| t.schema == key.0 && t.name == key.1);
    let mut keys: Vec<&(String, String)> = config
        .table_map
        .keys()
        .chain(config.policies.tables.keys())
        .filter(|k| !published(k))
        .collect();
    keys.sort();
    keys.dedup();
    keys.iter()
        .map(|(schema, name)| {
            format!(
                "the config file's [tables.\"{schema}.{name}\"] names no table the publications publish now (names are case-sensitive): its settings are used only by changes still to apply that name it (made before the table was renamed on the source); otherwise check the name against the source's tables"
            )
        })
        .collect()
}

/// Target tables with a unique key that is DEFERRABLE only on the source
/// (`copy::keys_deferrable_only_on_source`).
pub(crate) type DeferrableOnSource = std::collections::HashSet<String>;

/// Every published table must exist on the target. Checked at the start, a missing one is named
/// at once, not at its first change (which may come hours later). Returns the target tables
/// that several published tables are mapped onto (`ApplierOptions::shared_targets`), and those
/// whose unique key only the source defers.
pub(super) async fn target_tables_exist(
    config: &RunConfig,
    target: &tokio_postgres::Client,
) -> Result<(SharedTargets, DeferrableOnSource)> {
    let source = crate::tls::connect(&config.source)
        .await
        .map_err(|e| e.into_error("connecting to the source"))?;
    let tables = copy::published_tables(&source, &config.publications, &config.table_map).await?;
    if tables.is_empty() {
        tracing::warn!(
            "{}: nothing is replicated until tables are added to it",
            copy::no_tables_message(&config.publications)
        );
    }
    for problem in unmatched_table_settings(config, &tables) {
        tracing::warn!("{problem}");
    }
    if let Some(warning) = replication_loop(
        &source,
        target,
        config.requested.origin_none,
        (&config.publications, &config.table_map),
    )
    .await
    {
        tracing::warn!("{warning}");
    }
    if let Some(warning) = copy_across_origins(
        &source,
        config.requested.origin_none,
        config.copy_data,
        &config.publications,
    )
    .await
    {
        tracing::warn!("{warning}");
    }
    for shared in tables_shared_with_other_slots(
        &source,
        target,
        &config.slot,
        &config.publications,
        &config.table_map,
    )
    .await
    {
        tracing::warn!("{shared}");
    }
    for left_out in crate::check::operations_left_out(&source, &config.publications).await? {
        tracing::warn!("{left_out}");
    }
    for root in crate::check::full_roots_over_keyed_partitions(&source, &config.publications).await
    {
        tracing::warn!("{root}");
    }
    // (A partition listed beside its partitioned root, whose changes come as the root's, is not
    // in the list: `published_tables` leaves it out. Those left come under their own names.)
    let names: Vec<String> = tables.iter().map(|t| t.target_qualified()).collect();
    let mut sources_of: SharedTargets = SharedTargets::new();
    for t in &tables {
        sources_of
            .entry(t.target_qualified())
            .or_default()
            .push((t.schema.clone(), t.name.clone()));
    }
    sources_of.retain(|_, sources| sources.len() > 1);
    let missing: Vec<String> = target
        .query(
            "SELECT n FROM unnest($1::text[]) WITH ORDINALITY AS x (n, i) \
             WHERE pg_catalog.to_regclass(n) IS NULL ORDER BY i",
            &[&names],
        )
        .await
        .map_err(|e| Error::postgres("looking up the published tables on the target", e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    // A partition published under its own name whose target table is missing: most likely the
    // target holds its rows in the parent (or the publication's publish_via_partition_root was
    // turned off), which creating the partition would not serve.
    let missing_sources: Vec<String> = tables
        .iter()
        .filter(|t| missing.contains(&t.target_qualified()))
        .map(|t| t.qualified())
        .collect();
    if let Some(hint) = missing_partition_hint(&source, target, &missing_sources).await? {
        return Err(Error::definite(hint));
    }
    match missing.as_slice() {
        [] => {
            let mut deferrable = DeferrableOnSource::new();
            for (table, warning) in
                copy::keys_deferrable_only_on_source(&source, target, &tables).await?
            {
                tracing::warn!("{warning}");
                deferrable.insert(table);
            }
            Ok((sources_of, deferrable))
        }
        all if all.len() == names.len() && all.len() > 1 => Err(Error::definite(format!(
            "none of the {} published tables exists on the target: create them first, for example with `pgapply schema --source ... --target ... --publication ... --section pre-data` (and `--section post-data` after the initial copy, for the keys and indexes); or check --target",
            all.len()
        ))),
        [one] if tables
            .iter()
            .any(|t| t.target_qualified() == *one && t.qualified() != *one) =>
        {
            let source_name = tables
                .iter()
                .find(|t| t.target_qualified() == *one)
                .map(|t| t.qualified())
                .unwrap_or_default();
            Err(Error::definite(format!(
                "target table {one}, onto which [tables] in the config file maps published source table {source_name}, does not exist on the target: create it there with the source table's columns (pg_dump --schema-only --table '{source_name}' of the source database, renamed to {one}), or correct that [tables] entry; then start pgapply again"
            )))
        }
        [one] => {
            let renamed = match tables.iter().find(|t| t.target_qualified() == *one) {
                Some(t) => rename_hint(target, &config.slot, &names, &t.target_schema, &t.target_name).await,
                None => None,
            };
            if let Some(hint) = renamed {
                return Err(Error::definite(format!(
                    "table {one} is published by the source but does not exist on the target; {hint}; otherwise create it on the target as on the source (pg_dump --schema-only --table '{one}' of the source database, into psql on the target), or take it out of the publication; then start pgapply again"
                )));
            }
            Err(Error::definite(format!(
            "table {one} is published by the source but does not exist on the target: create it on the target as on the source (pg_dump --schema-only --table '{one}' of the source database, into psql on the target: `pgapply schema` is for a target that has none of the published tables yet), or take it out of the publication; or, if it was renamed on the source, rename it on the target too (ALTER TABLE ... RENAME TO ...: an empty new table would leave its rows behind under the old name), or update its entry under [tables] in the config file if it is mapped there; then start pgapply again"
        )))
        }
        many => Err(Error::definite(format!(
            "{} published tables do not exist on the target: {}: create them on the target as on the source (pg_dump --schema-only with a --table for each, of the source database, into psql on the target: `pgapply schema` is for a target that has none of the published tables yet), or take them out of the publication; or, if they were renamed on the source, rename them on the target too (ALTER TABLE ... RENAME TO ...); then start pgapply again",
            many.len(),
            many.join(", ")
        ))),
    }
}

/// Why binary transfer cannot be used for these publications, if it cannot: every published
/// column must have a built-in type (whose binary format does not embed cluster-specific OIDs),
/// the same type on the target, and both servers the same major version.
pub(crate) async fn binary_unsafe(
    config: &RunConfig,
    source_version: u32,
) -> Result<Option<String>> {
    let source = crate::tls::connect(&config.source)
        .await
        .map_err(|e| e.into_error("connecting to the source"))?;
    let target = crate::tls::connect(&config.target)
        .await
        .map_err(|e| e.into_error("connecting to the target"))?;
    let target_version = crate::sql::server_version(&target)
        .await
        .map_err(|e| Error::postgres("reading the target's version", e))?;
    if target_version as u32 / 10000 != source_version / 10000 {
        return Ok(Some(format!(
            "source and target run different major versions ({} and {})",
            source_version / 10000,
            target_version / 10000
        )));
    }
    let tables = copy::published_tables(&source, &config.publications, &config.table_map).await?;
    for table in &tables {
        let rows = source
            .query(
                &format!(
                    "SELECT a.attname::text, NOT {} FROM pg_catalog.pg_attribute a \
                     WHERE a.attrelid = $1::text::pg_catalog.regclass AND a.attnum > 0 AND NOT a.attisdropped",
                    crate::sql::binary_unsafe_type_sql("a.atttypid")
                ),
                &[&table.qualified()],
            )
            .await
            .map_err(|e| Error::postgres("reading published column types on the source", e))?;
        for row in rows {
            if !row.get::<_, bool>(1) {
                return Ok(Some(format!(
                    "column {} of {} has a user-defined type or an OID alias type (regclass, regtype and the like), whose binary form holds the source's OIDs, or a type PostgreSQL cannot read back in binary form (aclitem, tsquery, int2vector, oidvector)",
                    crate::sql::quote_ident(&row.get::<_, String>(0)),
                    table.qualified()
                )));
            }
        }
        for (column, source_type) in &table.columns {
            let target_type: Option<String> = target
                .query_opt(
                    &format!(
                        "SELECT {} FROM pg_catalog.pg_attribute WHERE attrelid = pg_catalog.to_regclass($1) AND attname = $2",
                        crate::sql::type_name_sql("atttypid", "atttypmod")
                    ),
                    &[&table.target_qualified(), column],
                )
                .await
                .map_err(|e| Error::postgres("reading column types on the target", e))?
                .map(|r| r.get(0));
            if target_type.as_deref() != Some(source_type.as_str()) {
                return Ok(Some(format!(
                    "column {} of {} has type {source_type} on the source and {} on the target",
                    crate::sql::quote_ident(column),
                    table.qualified(),
                    target_type.as_deref().unwrap_or("none")
                )));
            }
        }
    }
    Ok(None)
}

/// Of source tables published under their own names whose target tables are missing: a
/// partition, said as such (its rows are most likely in the target's parent, or the
/// publication's publish_via_partition_root was turned off; creating the partition would not
/// serve), with the ways to apply it there. Only where the target has the partition's root: a
/// target without it lacks the tables themselves.
pub(crate) async fn missing_partition_hint(
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
    missing_sources: &[String],
) -> Result<Option<String>> {
    let partitions = source
        .query(
            // (The root: partitions may be partitioned again.)
            "SELECT pg_catalog.format('%I.%I', cn.nspname, c.relname), pg_catalog.format('%I.%I', pn.nspname, p.relname), \
                    pg_catalog.current_setting('server_version_num')::int >= 130000 \
             FROM unnest($1::text[]) s \
             JOIN pg_catalog.pg_class c ON c.oid = s::pg_catalog.regclass AND c.relispartition \
             JOIN pg_catalog.pg_namespace cn ON cn.oid = c.relnamespace \
             CROSS JOIN LATERAL ( \
               WITH RECURSIVE up(rel) AS ( \
                 SELECT c.oid UNION ALL \
                 SELECT i.inhparent FROM pg_catalog.pg_inherits i JOIN up ON i.inhrelid = up.rel) \
               SELECT u.rel FROM up u \
               WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i2 WHERE i2.inhrelid = u.rel)) root \
             JOIN pg_catalog.pg_class p ON p.oid = root.rel \
             JOIN pg_catalog.pg_namespace pn ON pn.oid = p.relnamespace",
            &[&missing_sources],
        )
        .await
        .map_err(|e| Error::postgres("looking up partitions on the source", e))?;
    let roots: Vec<String> = partitions.iter().map(|r| r.get(1)).collect();
    let roots_there: Vec<String> = target
        .query(
            "SELECT r FROM unnest($1::text[]) r WHERE pg_catalog.to_regclass(r) IS NOT NULL",
            &[&roots],
        )
        .await
        .map_err(|e| Error::postgres("looking up the partitions' roots on the target", e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let partitions: Vec<_> = partitions
        .into_iter()
        .filter(|r| roots_there.contains(&r.get::<_, String>(1)))
        .collect();
    let Some(row) = partitions.first() else {
        return Ok(None);
    };
    {
        let (partition, root, via_root): (String, String, bool) =
            (row.get(0), row.get(1), row.get(2));
        // As a TOML key or value (quoted names keep their quotes, escaped).
        let toml = |name: &str| name.replace('\\', "\\\\").replace('"', "\\\"");
        Ok(Some(format!(
            "table {partition} is a partition of {root} on the source, published under its own name ({}), and the target has no table of that name{}: to apply its rows to the target's {root}, {}map it in the config file ([tables.\"{}\"] target = \"{}\"); or create it on the target; then start pgapply again",
            if via_root {
                "publish_via_partition_root = false, or the publication lists the partition"
            } else {
                "PostgreSQL before 13 publishes partitions so"
            },
            if partitions.len() > 1 {
                format!(" ({} partitions in all)", partitions.len())
            } else {
                String::new()
            },
            if via_root {
                "publish it through its root (ALTER PUBLICATION ... SET (publish_via_partition_root = true)) or "
            } else {
                ""
            },
            toml(&partition),
            toml(&root)
        )))
    }
}

/// When a published table is missing on the target and exactly one target table this slot
/// replicated into before (`pgapply.slot_tables`, `pgapply.copy_state`) is there but no longer
/// published: most likely the source renamed it (while pgapply was not running, or before the
/// changes it is on now). Says so first, with the statement that follows the source.
async fn rename_hint(
    target: &tokio_postgres::Client,
    slot: &str,
    published: &[String],
    schema: &str,
    name: &str,
) -> Option<String> {
    let rows = target
        .query(
            "SELECT s, t FROM (SELECT schema_name, table_name FROM pgapply.slot_tables WHERE slot_name = $1 \
                               UNION SELECT schema_name, table_name FROM pgapply.copy_state WHERE slot_name = $1) k (s, t) \
             WHERE pg_catalog.to_regclass(pg_catalog.format('%I.%I', s, t)) IS NOT NULL \
               AND pg_catalog.to_regclass(pg_catalog.format('%I.%I', s, t)) <> ALL ( \
                   SELECT pg_catalog.to_regclass(n) FROM unnest($2::text[]) n \
                   WHERE pg_catalog.to_regclass(n) IS NOT NULL)",
            &[&slot, &published.to_vec()],
        )
        .await
        .ok()?;
    let [row] = rows.as_slice() else {
        return None;
    };
    let (old_schema, old_name): (String, String) = (row.get(0), row.get(1));
    let old = crate::sql::qualified_name(&old_schema, &old_name);
    let q = crate::sql::quote_ident;
    let statement = match (old_schema == schema, old_name == name) {
        (true, _) => format!("ALTER TABLE {old} RENAME TO {}", q(name)),
        (false, true) => format!("ALTER TABLE {old} SET SCHEMA {}", q(schema)),
        (false, false) => format!(
            "ALTER TABLE {old} RENAME TO {}; ALTER TABLE {}.{} SET SCHEMA {}",
            q(name),
            q(&old_schema),
            q(name),
            q(schema)
        ),
    };
    Some(format!(
        "target table {old}, which slot {slot:?} replicated into before, is there and no longer published: if the source renamed it, do the same on the target ({statement}), which keeps its rows (a new empty table would leave them behind under the old name)"
    ))
}
