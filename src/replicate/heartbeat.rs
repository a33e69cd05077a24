//! The worker's heartbeat on the target: its state and counters in `pgapply.progress` for
//! `pgapply status`, and the stop position `pgapply cutover` may ask for.

use super::*;

/// Counters already added to `pgapply.progress` by this process.
#[derive(Default)]
pub(super) struct HeartbeatCounts {
    transactions: u64,
    inserts: u64,
    updates: u64,
    deletes: u64,
    truncates: u64,
    conflicts: std::collections::BTreeMap<&'static str, u64>,
}

/// Tells a worker's operator that `pgapply cutover` stopped the slot: after a finished cutover
/// (the target is the new primary) that this worker is done; otherwise (a cutover given up
/// half-way) how to undo the stop.
///
/// `reached_now`: this worker has just applied up to the stop, as a running cutover waits for
/// it to: the normal way of a cutover, said as such.
pub(super) async fn fenced_warning(
    target: &tokio_postgres::Client,
    slot: &str,
    fence: Lsn,
    reached_now: bool,
) {
    let done = target
        .query_opt(
            "SELECT cutover_done_at IS NOT NULL FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ok()
        .flatten()
        .is_some_and(|r| r.get::<_, Option<bool>>(0) == Some(true));
    if done {
        tracing::info!(
            slot,
            stop_lsn = %fence,
            "this slot was stopped at {fence} by a finished `pgapply cutover`: the target is the new primary, and this worker has nothing more to apply; stop it (and `pgapply forget --drop-slot` the slot once you no longer need a way back)"
        );
        return;
    }
    let undo = format!(
        "UPDATE pgapply.progress SET stop_lsn = NULL WHERE slot_name = '{}'",
        slot.replace('\'', "''")
    );
    if reached_now {
        tracing::info!(
            slot,
            stop_lsn = %fence,
            "applied everything up to {fence}, where `pgapply cutover` asked this worker to stop: the cutover goes on from there. (Were it given up before it finishes, replicating from this slot again needs the stop cleared on the target: {undo})"
        );
        return;
    }
    tracing::warn!(
        slot,
        stop_lsn = %fence,
        "this slot was stopped at {fence} by `pgapply cutover`: nothing after it is applied. If that cutover was given up before it finished, replicate from it again by clearing that on the target: {undo}"
    );
}

/// The position `pgapply cutover` asked this slot's worker to stop at, if any.
pub(super) async fn stop_position(
    target: &tokio_postgres::Client,
    slot: &str,
) -> Result<Option<Lsn>> {
    let row = target
        .query_opt(
            "SELECT stop_lsn::text FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?;
    Ok(row
        .and_then(|r| r.get::<_, Option<String>>(0))
        .and_then(|t| t.parse::<Lsn>().ok()))
}

/// During the initial copy: `pgapply status` shows the state `copying` (its per-table progress
/// is in `pgapply.copy_state`), with a heartbeat as fresh as while streaming.
pub(super) async fn copy_heartbeat(client: Object, slot: String, mut quit: watch::Receiver<bool>) {
    loop {
        if let Err(e) = client
            .execute(
                "UPDATE pgapply.progress SET state = 'copying', pid = $2, heartbeat_at = now() \
                 WHERE slot_name = $1",
                &[&slot, &(std::process::id() as i32)],
            )
            .await
        {
            tracing::debug!(error = %crate::error::describe_postgres(&e), "could not record the copy's heartbeat on the target");
        }
        tokio::select! {
            _ = tokio::time::sleep(HEARTBEAT_MAX_EVERY) => {}
            _ = quit.changed() => return,
        }
    }
}

/// Says, while the initial copy runs, a wait of its target sessions for a lock that lasts (a
/// user's open transaction on a target table holds the copy's checks, or its COPY), as the
/// heartbeat says the apply sessions'.
pub(super) async fn copy_lock_watch(client: Object, mut quit: watch::Receiver<bool>) {
    let mut waits = crate::apply::sessions::LockWaits::for_copy();
    loop {
        waits.check(&client).await;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = quit.changed() => return,
        }
    }
}

/// A task that writes to the target in the background. Stopped, it is told so and awaited, not
/// aborted: a write it has under way then lands before what the run writes after it (and is
/// counted as written).
/// (Dropped without `stop`, on an early return, it is aborted: it must not outlive its run.)
pub(super) struct Background {
    quit: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Background {
    pub(super) fn spawn<F>(make: impl FnOnce(watch::Receiver<bool>) -> F) -> Background
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (quit, quit_rx) = watch::channel(false);
        let task = tokio::spawn(make(quit_rx).in_current_span());
        Background {
            quit,
            task: Some(task),
        }
    }

    pub(super) async fn stop(mut self) {
        let _ = self.quit.send(true);
        if let Some(mut task) = self.task.take() {
            // A target that stopped answering must not hold the run up for long.
            if tokio::time::timeout(Duration::from_secs(5), &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Counters this process has added to `pgapply.progress`. The metrics count for the whole
/// process, across the runs its retries make: so must this.
pub(super) static REPORTED: std::sync::LazyLock<Arc<tokio::sync::Mutex<HeartbeatCounts>>> =
    std::sync::LazyLock::new(Arc::default);

/// The longest time between two heartbeats of a running worker: `pgapply status` calls a worker
/// whose heartbeat is three times older "not responding".
pub const HEARTBEAT_MAX_EVERY: Duration = Duration::from_secs(10);

/// How long the heartbeat waits for the target's answer before it calls the target not ready.
pub(super) const HEARTBEAT_ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// Records the worker's state on the target every status interval (at most 10 s), and every
/// second reads whether `pgapply cutover` asked it to stop at a position and records the
/// position the reader wants to report (`record_reported`).
#[allow(clippy::too_many_arguments)]
pub(super) async fn heartbeat(
    client: Object,
    (pool, target): (Pool, tokio_postgres::Config),
    slot: String,
    every: Duration,
    reported: Arc<tokio::sync::Mutex<HeartbeatCounts>>,
    stop: watch::Sender<Option<Lsn>>,
    (report_wanted, report_recorded): (watch::Receiver<Lsn>, Arc<watch::Sender<Lsn>>),
    mut quit: watch::Receiver<bool>,
) {
    let every = every.min(HEARTBEAT_MAX_EVERY);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut beaten: Option<Instant> = None;
    // None after the target stopped answering on it: a new one at the next tick.
    let mut session = Some(client);
    let mut lock_waits = crate::apply::sessions::LockWaits::default();
    let mut locks_seen: Option<Instant> = None;
    let said = |beaten: &mut Option<Instant>, e: &dyn std::fmt::Display| {
        METRICS.target_ok.set(0);
        if beaten.is_none_or(|at| at.elapsed() >= every) {
            *beaten = Some(Instant::now());
            tracing::warn!(error = %e, "could not record the heartbeat on the target");
        }
    };
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = quit.changed() => return,
        }
        // A target restarted under an idle worker: nothing else notices until a change comes,
        // and `pgapply cutover`'s stop request, read here, must still get through.
        let client = match session.take().filter(|c| !c.is_closed()) {
            Some(c) => c,
            // (Ready again once a heartbeat is recorded, not on connecting.)
            None => match target_connection(&pool, &target).await {
                Ok(fresh) => fresh,
                Err(e) => {
                    said(&mut beaten, &e);
                    continue;
                }
            },
        };
        // A target that holds the connection open and answers nothing (hung, a lock on the
        // progress row, a proxy in front of a dead server) is not ready, and said so; its
        // answer is still waited for on the same session (a new one would leave this one's
        // statement behind, to run later and count the same deltas twice).
        let work = async {
            if beaten.is_none_or(|at| at.elapsed() >= every) {
                beaten = Some(Instant::now());
                let mut last = reported.lock().await;
                match write_heartbeat(&client, &slot, "streaming", &mut last).await {
                    Ok(()) => {
                        if METRICS.target_ok.get() == 0 {
                            tracing::info!("the target answers the heartbeat again");
                        }
                        METRICS.target_ok.set(1);
                    }
                    Err(e) => {
                        METRICS.target_ok.set(0);
                        tracing::warn!(error = %e, "could not record the heartbeat on the target");
                    }
                }
            }
            // Recorded before the reader may report it (see `Reader::report_recorded`).
            let wanted = *report_wanted.borrow();
            if wanted > *report_recorded.borrow() {
                match record_reported(&client, &slot, wanted).await {
                    Ok(()) => {
                        report_recorded.send_replace(wanted);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "could not record the position to report on the target")
                    }
                }
            }
            // (Every 2 s: a wait is said within about 7 s of its start, 5 s after it began.)
            if locks_seen.is_none_or(|at| at.elapsed() >= Duration::from_secs(2)) {
                locks_seen = Some(Instant::now());
                lock_waits.check(&client).await;
            }
            match stop_position(&client, &slot).await {
                Ok(lsn) => {
                    stop.send_if_modified(|current| {
                        let changed = *current != lsn;
                        *current = lsn;
                        changed
                    });
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not read the stop request on the target")
                }
            }
        };
        {
            tokio::pin!(work);
            let mut said_late = false;
            loop {
                tokio::select! {
                    () = &mut work => break,
                    _ = tokio::time::sleep(HEARTBEAT_ANSWER_WITHIN), if !said_late => {
                        said_late = true;
                        METRICS.target_ok.set(0);
                        tracing::warn!(
                            "the target has not answered the heartbeat for {}: it may be overloaded, locked (pgapply.progress) or cut off; applying waits for its answers too",
                            humantime::format_duration(HEARTBEAT_ANSWER_WITHIN)
                        );
                    }
                    _ = quit.changed() => return,
                }
            }
        }
        session = Some(client);
    }
}

/// Records on the target (durably, before it is reported) that pgapply may report `lsn` to the
/// source as flushed although nothing was applied up to there: the WAL end of a keepalive.
pub(super) async fn record_reported(
    client: &tokio_postgres::Client,
    slot: &str,
    lsn: Lsn,
) -> Result<()> {
    let result = client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL synchronous_commit = on; \
             UPDATE pgapply.progress SET reported_lsn = greatest(coalesce(reported_lsn, '0/0'), '{lsn}'::pg_lsn) \
             WHERE slot_name = {}; COMMIT",
            crate::sql::quote_literal(slot)
        ))
        .await;
    if let Err(e) = result {
        // A failed statement leaves the session in an aborted transaction (the COMMIT of the
        // same message is not run): ended, or every later use of the session would fail.
        let _ = client.batch_execute("ROLLBACK").await;
        return Err(Error::postgres(
            "recording the position to report on the target",
            e,
        ));
    }
    Ok(())
}

/// While `pgapply run` waits to try again after a failure: the slot's heartbeat kept fresh (its
/// state stays `failed`, with the error), so that `forget` and `status` see a worker that still
/// runs, until `stopped` is written when it is told to stop meanwhile. Only a `failed` row is
/// touched: another worker streaming on the slot (this one waiting for it) keeps its own.
/// `client` is the target connection kept across calls (made again when lost); nothing here
/// stops the wait.
pub async fn note_waiting(
    target: &tokio_postgres::Config,
    client: &mut Option<tokio_postgres::Client>,
    slot: &str,
    stopped: bool,
) {
    if client.as_ref().is_none_or(|c| c.is_closed()) {
        *client = crate::tls::connect(target).await.ok();
    }
    let Some(c) = client.as_ref() else { return };
    let sql = if stopped {
        "UPDATE pgapply.progress SET state = 'stopped', pid = NULL, heartbeat_at = now() \
         WHERE slot_name = $1 AND state = 'failed' AND (pid IS NULL OR pid = $2)"
    } else {
        "UPDATE pgapply.progress SET pid = $2, heartbeat_at = now() \
         WHERE slot_name = $1 AND state = 'failed' AND (pid IS NULL OR pid = $2)"
    };
    let pid = std::process::id() as i32;
    let result = c.execute(sql, &[&slot, &pid]).await;
    if let Err(e) = result {
        tracing::debug!(error = %e, "recording the wait before trying again on the target");
    }
}

/// A process ending at once (a second signal, or a stop that took too long) records that it
/// stopped, so `status` does not show a gone process as streaming until its heartbeat ages.
/// Best effort, on a connection of its own (the run's may be the one held up).
pub async fn note_forced_stop(target: &tokio_postgres::Config, slot: &str) {
    let Ok(c) = crate::tls::connect(target).await else {
        return;
    };
    let pid = std::process::id() as i32;
    // (The run's open transaction may hold the row, in table mode: not waited for.)
    let _ = c.batch_execute("SET lock_timeout = '1s'").await;
    let noted = c
        .execute(
            "UPDATE pgapply.progress SET state = 'stopped', pid = NULL, heartbeat_at = now() \
             WHERE slot_name = $1 AND pid = $2",
            &[&slot, &pid],
        )
        .await;
    if noted.is_err() {
        tracing::warn!("the stop could not be recorded on the target (its row is locked): `pgapply status` shows this process as not responding once its heartbeat is 30 s old");
    }
}

pub(super) async fn write_heartbeat(
    client: &tokio_postgres::Client,
    slot: &str,
    state: &str,
    last: &mut HeartbeatCounts,
) -> Result<()> {
    let m = &*METRICS;
    let now = HeartbeatCounts {
        transactions: m.transactions.get(),
        inserts: m.inserts.get(),
        updates: m.updates.get(),
        deletes: m.deletes.get(),
        truncates: m.truncates.get(),
        conflicts: m.conflicts.lock().map(|c| c.clone()).unwrap_or_default(),
    };
    let delta = |a: u64, b: u64| (a.saturating_sub(b)) as i64;
    let applied = Lsn(m.applied_lsn.get());
    let received = Lsn(m.received_lsn.get());
    let commit = crate::protocol::PgTimestamp(m.last_commit_time.get() as i64);
    // Added to what earlier runs recorded, like the other counters.
    let conflict_delta: std::collections::BTreeMap<&str, i64> = now
        .conflicts
        .iter()
        .map(|(kind, n)| {
            let before = last.conflicts.get(kind).copied().unwrap_or(0);
            (*kind, delta(*n, before))
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    let conflicts = serde_json::to_string(&conflict_delta).unwrap_or_else(|_| "{}".into());
    let pid = (state == "streaming").then_some(std::process::id() as i32);
    client
        .execute(
            "UPDATE pgapply.progress SET state = $2, pid = $3,                  applied_lsn = CASE WHEN $4::text = '0/0' THEN applied_lsn ELSE $4::text::pg_lsn END,                  received_lsn = CASE WHEN $5::text = '0/0' THEN received_lsn ELSE $5::text::pg_lsn END,                  last_commit_time = CASE WHEN $6::bigint = 0 THEN last_commit_time ELSE $7::text::timestamptz END,                  lag_seconds = $8, transactions = transactions + $9, inserts = inserts + $10,                  updates = updates + $11, deletes = deletes + $12, truncates = truncates + $13,                  conflicts = (SELECT coalesce(jsonb_object_agg(kind, n), '{}') FROM (SELECT kind, sum(n) AS n FROM (SELECT key AS kind, value::bigint AS n FROM jsonb_each_text(coalesce(conflicts, '{}')) UNION ALL SELECT key, value::bigint FROM jsonb_each_text($14::text::jsonb)) c GROUP BY kind) s), heartbeat_at = now()              WHERE slot_name = $1",
            &[
                &slot,
                &state,
                &pid,
                &applied.to_string(),
                &received.to_string(),
                &commit.0,
                &commit.to_rfc3339(),
                &m.lag_seconds(),
                &delta(now.transactions, last.transactions),
                &delta(now.inserts, last.inserts),
                &delta(now.updates, last.updates),
                &delta(now.deletes, last.deletes),
                &delta(now.truncates, last.truncates),
                &conflicts,
            ],
        )
        .await
        .map_err(|e| Error::postgres("recording the heartbeat", e))?;
    *last = now;
    Ok(())
}
