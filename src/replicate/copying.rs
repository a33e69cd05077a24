//! The initial copy as a run starts it: the slot's copy lock on the target, tables published
//! after the initial copy, and what an interrupted copy leaves behind.

use tokio::sync::watch;

use super::heartbeat::*;
use super::{target_connection, RunConfig, RunOutcome, StopReason};
use crate::apply::applier::ApplyStats;
use crate::copy;
use crate::error::{Error, Result};
use crate::protocol::Lsn;
use crate::source::ReplicationSession;

/// A target session holding the slot's copy lock (a session-level advisory lock), or a transient
/// error if another session holds it.
pub(super) async fn copy_lock(config: &RunConfig) -> Result<tokio_postgres::Client> {
    let client = crate::tls::connect_to(&config.target, "target").await?;
    let failed = |e| Error::postgres("taking the initial copy's lock on the target", e);
    // Idle for the whole copy: no idle timeout may end it (and the lock with it), and the
    // server notices within a minute or two when this process is gone without a word, so that
    // a retry is not kept out by a session nobody holds any more.
    client
        .batch_execute(
            "SET tcp_keepalives_idle = 30; SET tcp_keepalives_interval = 10; SET tcp_keepalives_count = 3; \
             SELECT pg_catalog.set_config(name, '0', false) FROM pg_catalog.pg_settings WHERE name = 'idle_session_timeout'",
        )
        .await
        .map_err(failed)?;
    // (The key from the server's own hash, the same for every build of pgapply.)
    let got: bool = client
        .query_one(
            "SELECT pg_catalog.pg_try_advisory_lock($1::int4, pg_catalog.hashtext('pgapply copy ' || $2))",
            &[&COPY_LOCK_CLASS, &config.slot],
        )
        .await
        .map_err(failed)?
        .get(0);
    if !got {
        return Err(Error::transient(format!(
            "another pgapply is making the initial copy for slot {:?} (see pgapply status): this one waits for it to finish or to stop",
            config.slot
        )));
    }
    Ok(client)
}

/// The first key of the copy lock: "pgcp".
pub(super) const COPY_LOCK_CLASS: i32 = 0x7067_6370;

/// Drops the slot of a copy that did not finish, saying so (a failure to drop is only logged:
/// the error that ended the copy is the one to report, and the next --copy-data run drops it).
pub(super) async fn drop_copy_slot(session: &mut crate::source::ReplicationSession, slot: &str) {
    match session.drop_slot(slot).await {
        Ok(()) => tracing::warn!(
            slot,
            "dropped the replication slot made for the unfinished initial copy, so that it does not hold the source's WAL: the next run with --copy-data makes a new one and copies again"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            "could not drop the replication slot made for the unfinished initial copy: the next run with --copy-data drops it; if you give up instead, drop it on the source with SELECT pg_drop_replication_slot({})",
            crate::sql::quote_literal(slot)
        ),
    }
}

/// `--copy-data` after a finished initial copy: copies the tables published since (and those
/// whose such copy did not finish) as of the snapshot of a temporary slot of their own, and
/// records its position, before which the stream drops their changes (the copy holds them).
/// The main slot is not touched: every other table goes on from where it was. Returns false if
/// a stop request ended the copy (the next --copy-data run starts it over).
pub(super) async fn copy_late_tables(
    config: &RunConfig,
    pool: &deadpool_postgres::Pool,
    late: copy::LateCopy,
    source_major: u32,
    shutdown: &watch::Receiver<bool>,
) -> Result<bool> {
    let Some(plan) = copy::plan_copy(
        &config.source,
        pool,
        &config.target,
        &config.slot,
        &config.publications,
        &config.copy,
        &config.table_map,
        source_major,
        Some(late),
    )
    .await?
    else {
        return Ok(true);
    };
    let mut stop = shutdown.clone();
    let stopped = async move {
        let _ = stop.wait_for(|stopping| *stopping).await;
    };
    tokio::pin!(stopped);
    let client = target_connection(pool, &config.target).await?;
    let slot = config.slot.clone();
    let beat = Background::spawn(|quit| copy_heartbeat(client, slot, quit));
    let copied = async {
        // Its own replication session: the temporary slot, and the snapshot it exports, last
        // as long as the session, which stays idle until the copy is done.
        let mut session =
            ReplicationSession::connect(&config.source, config.max_message_bytes).await?;
        // Once more now that the plan is recorded (a worker starting from here on sees the copy
        // unfinished and refuses): one that started streaming the slot meanwhile would apply
        // the changes the copy holds. The plan stays, unfinished: the tables are copied by the
        // next run with --copy-data, and not streamed into by one without.
        if let Some(pid) = session.slot_active_pid(&config.slot).await? {
            return Err(Error::transient(format!(
                "replication slot {:?} is in use by process {pid} on the source (another pgapply started streaming it): stop that one before a run with --copy-data copies the tables published since; it must end first",
                config.slot
            )));
        }
        let temporary = format!("pgapply_copy_{}", std::process::id());
        let snapshot = session
            .create_temporary_slot_with_snapshot(&temporary)
            .await?;
        let setup = target_connection(pool, &config.target).await?;
        copy::set_synced_lsn(&setup, &config.slot, snapshot.consistent_point).await?;
        drop(setup);
        copy::copy_tables(
            plan,
            &config.source,
            pool,
            &config.target,
            &config.slot,
            &snapshot.snapshot_name,
            &config.copy,
        )
        .await?;
        // (The temporary slot goes with the session.)
        drop(session);
        tracing::info!(consistent_point = %snapshot.consistent_point, "copied the tables published after the initial copy; their changes from transactions committed before that position are skipped");
        Ok::<_, Error>(())
    };
    let outcome = tokio::select! {
        biased;
        c = copied => Some(c),
        () = &mut stopped => None,
    };
    beat.stop().await;
    match outcome {
        Some(Ok(())) => Ok(true),
        Some(Err(e)) => Err(e),
        None => Ok(false),
    }
}

/// The run's outcome when a stop was asked for during the initial copy.
pub(super) async fn copy_interrupted(
    setup: &tokio_postgres::Client,
    config: &RunConfig,
    resume: Lsn,
) -> Result<RunOutcome> {
    let slot = &config.slot;
    tracing::warn!("initial copy interrupted by the stop request: run again with --copy-data to start it over (the tables it copied are emptied first)");
    // `pgapply status` says stopped, not a copy whose process went away.
    if let Err(e) = setup
        .execute(
            "UPDATE pgapply.progress SET state = 'stopped', pid = NULL, heartbeat_at = now() WHERE slot_name = $1",
            &[&slot],
        )
        .await
    {
        tracing::debug!(error = %e, "could not record the stop on the target");
    }
    if config.copy_only {
        // What `--copy-only` was asked for is not done: a script must not go on to the next step.
        return Err(Error::definite(
            "the initial copy was stopped before it finished (--copy-only): run the same command again to start it over",
        ));
    }
    Ok(RunOutcome {
        reason: StopReason::Shutdown,
        flushed: resume,
        stats: ApplyStats::default(),
    })
}
