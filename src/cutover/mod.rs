//! `pgapply cutover`: the steps that turn a running mirror into a finished migration.
//!
//! 1. Wait until the slot's lag is below `--max-lag`, showing it as it falls.
//! 2. Optionally freeze writes (`--freeze-writes ROLE,...`): in the source database, those roles
//!    get `default_transaction_read_only = on` and their sessions are ended. Undo with
//!    `ALTER ROLE <role> IN DATABASE <db> RESET default_transaction_read_only`.
//! 3. Take the source's flushed WAL position as the end and drain replication to it: the running
//!    worker is asked to stop there (`pgapply.progress.stop_lsn`, read by the worker every
//!    second) and this waits until it has confirmed the end and stopped; when none runs, or it
//!    goes away before the end, the rest is applied here.
//! 4. Copy sequences (owned by published tables, or all with `--all-sequences`): the source's
//!    `last_value` and `is_called`, not max(column).
//! 5. Verify the tables (`pgapply verify`).
//! 6. With `--reverse`, prepare replication from the new primary back to the old one.
//!
//! It exits 0 only if every step succeeded.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_postgres::Client;

use crate::copy::published_tables;
use crate::error::{Error, Result};
use crate::protocol::Lsn;
use crate::replicate::{run, RunConfig, RunOutcome};
use crate::sql::quote_ident;
use crate::verify::{self, VerifySettings};

mod reverse;
mod sequences;

use reverse::{prepare_reverse, reverse_problems};
use sequences::{copy_sequences, sequence_problems, sequences_ahead};
pub use sequences::{plan_sequences, SequencePlan};

/// How far behind the worker may be before the cutover goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxLag {
    /// Source WAL position minus the slot's confirmed position.
    Bytes(u64),
    /// The walsender's `flush_lag`: how long ago the newest confirmed WAL was written.
    Time(Duration),
}

impl MaxLag {
    /// "16MB" is a size, "5s" a duration.
    pub fn parse(text: &str) -> Result<MaxLag> {
        match parse_size(text) {
            Ok(bytes) => Ok(MaxLag::Bytes(bytes)),
            Err(_) => crate::config::parse_duration(text)
                .map(MaxLag::Time)
                .map_err(|_| {
                    Error::usage(format!(
                        "--max-lag {text:?}: give a size (16MB) or a duration (5s)"
                    ))
                }),
        }
    }
}

#[derive(Debug, Clone)]
pub struct CutoverSettings {
    pub max_lag: MaxLag,
    pub timeout: Duration,
    pub freeze_roles: Vec<String>,
    pub all_sequences: bool,
    pub reverse: bool,
    /// Leave out step 5 (`--no-verify`).
    pub no_verify: bool,
    /// Run although a cutover of the slot finished already (`--again`).
    pub again: bool,
}

/// A `run --copy-data` that has not created its slot yet (it waits for the source's open
/// transactions, or for a lock on a target table it checks): waited for, rather than the slot
/// called missing.
async fn wait_for_a_starting_worker(
    source: &Client,
    target: &Client,
    slot: &str,
    deadline: Instant,
) -> Result<()> {
    let mut said = false;
    loop {
        let exists = source
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(|e| Error::postgres("reading the slot on the source", e))?
            .is_some();
        if exists {
            return Ok(());
        }
        let starting = target
            .query_opt(
                "SELECT 1 FROM pgapply.progress WHERE slot_name = $1 AND state = 'starting'",
                &[&slot],
            )
            .await
            .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?
            .is_some();
        if !starting {
            // (No worker on its way: slot_state names the missing slot.)
            return Ok(());
        }
        if !said {
            crate::out!("step 1: the worker for slot {slot:?} is starting and has not created its slot yet (an initial copy waits for the source's open transactions, and for locks on the target's tables); waiting for it");
            said = true;
        }
        if Instant::now() > deadline {
            return Err(Error::definite(format!(
                "step 1: the worker for slot {slot:?} was still starting (its slot not created yet on the source) at --timeout: see its log and pgapply status (a lock held on a target table, or a long open transaction on the source, keeps it waiting), then run the cutover again (nothing was changed yet)"
            )));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Slot state on the source: (active, confirmed flush, source WAL position).
async fn slot_state(source: &Client, slot: &str) -> Result<(bool, Lsn, Lsn)> {
    let row = source
        .query_opt(
            "SELECT active, coalesce(confirmed_flush_lsn, '0/0')::text, pg_current_wal_lsn()::text \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading the slot on the source", e))?
        .ok_or_else(|| Error::definite(format!("replication slot {slot:?} does not exist on the source: check --slot (the slot `pgapply run` streams from) and --source")))?;
    let parse = |t: String| t.parse::<Lsn>().map_err(|e| Error::definite(e.to_string()));
    Ok((row.get(0), parse(row.get(1))?, parse(row.get(2))?))
}

/// Whether the target holds pgapply's progress for the slot (a worker replicating into it made it).
async fn has_progress(target: &Client, slot: &str) -> Result<bool> {
    Ok(target
        .query_opt(
            "SELECT 1 FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?
        .is_some())
}

/// Whether `slot` is the way back an earlier `cutover --reverse` made on this source (then the
/// target of that cutover): `<forward>_reverse`, where the source's pgapply state says a
/// cutover stopped slot `<forward>`.
async fn made_by_a_reverse_cutover(source: &Client, slot: &str) -> bool {
    let Some(forward) = slot.strip_suffix("_reverse").filter(|f| !f.is_empty()) else {
        return false;
    };
    let has_state = source
        .query_one("SELECT to_regclass('pgapply.progress') IS NOT NULL", &[])
        .await
        .is_ok_and(|r| r.get::<_, bool>(0));
    has_state
        && source
            .query_opt(
                "SELECT 1 FROM pgapply.progress WHERE slot_name = $1 \
                 AND (stop_lsn IS NOT NULL OR cutover_done_at IS NOT NULL)",
                &[&forward],
            )
            .await
            .is_ok_and(|r| r.is_some())
}

/// Refuses a cutover of a slot the target has no state for when other slots replicate the
/// same publications into it (their states' publications unknown: counted), naming them.
async fn refuse_a_slot_not_replicated_here(
    target: &Client,
    slot: &str,
    publications: &[String],
) -> Result<()> {
    let others: Vec<String> = target
        .query(
            "SELECT slot_name FROM pgapply.progress \
             WHERE slot_name <> $1 AND (publications IS NULL OR publications && $2::text[]) ORDER BY 1",
            &[&slot, &publications],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?
        .iter()
        .map(|r| format!("{:?}", r.get::<_, String>(0)))
        .collect();
    if others.is_empty() {
        return Ok(());
    }
    Err(Error::definite(format!(
        "the target has no pgapply state for slot {slot:?}: no pgapply run has replicated from it into this database, while slot(s) {} replicate publication {} here: a cutover of slot {slot:?} would apply its changes over that mirror's, from wherever the slot is (nothing was done). Check --slot (the slot of the worker that replicates into this --target; pgapply status lists them)",
        others.join(", "),
        publications.join(", ")
    )))
}

/// Whether a `pgapply run --copy-data` is copying for the slot now: its state says so and its
/// heartbeat (every 10 s) is fresh (a killed one's state says so too, but goes stale).
async fn copy_under_way(target: &Client, slot: &str) -> Result<bool> {
    crate::copy::copy_under_way(target, slot)
        .await
        .map_err(|e| e.context("step 1"))
}

/// Sizes like "16MB", "512kB", "1GB" or plain bytes.
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: f64 = number
        .parse()
        .ok()
        .filter(|n: &f64| n.is_finite())
        .ok_or_else(|| {
            Error::definite(format!(
                "invalid size {text:?}: write it like 16MB, 1.5GB, 512kB or 1048576"
            ))
        })?;
    // Powers of 1024, as PostgreSQL's own settings; the binary prefixes (MiB) mean the same.
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        // No one-letter units: "5m" is five minutes (humantime), not five megabytes.
        "kb" | "kib" => 1 << 10,
        "mb" | "mib" => 1 << 20,
        "gb" | "gib" => 1 << 30,
        "tb" | "tib" => 1 << 40,
        _ => {
            return Err(Error::definite(format!(
                "invalid size {text:?}: units are B, kB, MB, GB, TB (or KiB, MiB, GiB, TiB)"
            )))
        }
    };
    let bytes = (n * factor as f64).round();
    if bytes >= u64::MAX as f64 {
        return Err(Error::usage(format!("invalid size {text:?}: too large")));
    }
    Ok(bytes as u64)
}

pub async fn cutover(
    run_config: RunConfig,
    settings: CutoverSettings,
    verify_settings: VerifySettings,
) -> Result<()> {
    let source = crate::tls::connect_to(&run_config.source, "source").await?;
    // A cutover run again after one that froze its own role writes all the same.
    source
        .batch_execute("SET default_transaction_read_only = off")
        .await
        .map_err(|e| Error::postgres("configuring the source session", e))?;
    let mut target = crate::tls::connect_to(&run_config.target, "target").await?;
    // pgapply's own tables on the target, for a cutover of a slot no `pgapply run` used yet.
    crate::migrations::apply(&mut target).await?;
    let slot = run_config.slot.clone();
    let started = Instant::now();
    let deadline = started + settings.timeout;

    // Before anything: what would stop a later step half-way, with writes frozen.
    let sequences = plan_sequences(
        &source,
        &target,
        &run_config.publications,
        &run_config.table_map,
        settings.all_sequences,
    )
    .await?;
    // A wrong --target (another database) first, and alone when none of the tables is there:
    // the sequences it lacks too would only bury it.
    let mut problems = read_problems(&source, &target, &run_config).await?;
    if problems.first().is_some_and(|p| p.starts_with(NONE_THERE)) {
        return Err(Error::definite(format!(
            "the cutover would stop half-way (nothing was done): {}",
            problems.join("; ")
        )));
    }
    problems.extend(sequence_problems(&source, &target, &sequences, settings.all_sequences).await?);
    problems.extend(freeze_problems(&source, &settings.freeze_roles).await?);
    // The worker's publications decide what it applied: a cutover of others would verify and
    // carry sequences over for the wrong tables, and call it done.
    let recorded: Option<Vec<String>> = target
        .query_opt(
            "SELECT publications FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?
        .and_then(|r| r.get(0));
    if let Some(recorded) = recorded {
        if !crate::replicate::same_publications(&recorded, &run_config.publications) {
            problems.push(format!(
                "slot {slot:?} replicates publication(s) {}, not {}: give the cutover the worker's --publication {}",
                recorded.join(", "),
                run_config.publications.join(", "),
                recorded.join(",")
            ));
        }
    }
    // (The name first: the checks of the reverse side look up objects of that name.)
    if settings.reverse && run_config.slot.len() + "_reverse".len() > 63 {
        problems.push(format!(
            "--reverse names its slot and publication {:?}, longer than PostgreSQL's 63 characters: a slot of at most 55 characters has room for it; without --reverse this cutover works, and a rollback path can then be set up by hand (a publication on the target and a slot there, streamed by a pgapply run into the old primary with --origin none)",
            format!("{}_reverse", run_config.slot)
        ));
    } else if settings.reverse {
        problems.extend(reverse_problems(&source, &target, &run_config).await?);
    }
    // Step 3 drains the slot itself when no worker streams it: over a replication connection.
    let (streamed, may_replicate): (bool, bool) = source
        .query_one(
            "SELECT coalesce((SELECT bool_or(active) FROM pg_replication_slots WHERE slot_name = $1), false), \
                    (SELECT rolsuper OR rolreplication FROM pg_roles WHERE rolname = current_user)",
            &[&slot],
        )
        .await
        .map(|r| (r.get(0), r.get::<_, Option<bool>>(1).unwrap_or(false)))
        .map_err(|e| Error::postgres("reading the source role's rights", e))?;
    if !may_replicate && !streamed {
        problems.push(format!(
            "no worker streams slot {slot:?}, so the cutover would apply the rest itself, which needs a source role with the REPLICATION attribute (ALTER ROLE ... REPLICATION on the source), or start the worker (pgapply run) first and let it stream"
        ));
    } else if !may_replicate {
        crate::out!(
            "before the cutover: WARNING: the source role has no REPLICATION attribute: should the worker streaming slot {slot:?} stop before the end, the cutover cannot apply the rest itself"
        );
    }
    if !problems.is_empty() {
        return Err(Error::definite(format!(
            "the cutover would stop half-way (nothing was done): {}",
            problems.join("; ")
        )));
    }
    if !sequences.left_out.is_empty() {
        // Said before anything is frozen: an application that calls one by name would reissue
        // its values on the new primary.
        let shown = sequences.left_out.len().min(20);
        crate::out!(
            "before the cutover: sequence(s) no published table uses are not copied: {}{} (if the application calls any by name: run on the target the setval statements step 4 prints for them, before the applications write there; or, before the writes are frozen, stop this cutover with Ctrl-C or SIGTERM and run it with --all-sequences)",
            sequences.left_out[..shown].join(", "),
            match sequences.left_out.len() - shown {
                0 => String::new(),
                n => format!(" and {n} more"),
            }
        );
    }
    // Roles and grants are not replicated: an application role the cutover freezes on the
    // source should be able to do there, on the target, what it does here, or the applications
    // meet "permission denied" once pointed at it. Said, not refused: they may log in as
    // another role there.
    let grants = role_grant_warnings(&source, &target, &run_config, &settings.freeze_roles).await?;
    for warning in &grants {
        crate::out!("before the cutover: WARNING: {warning}");
    }
    again(&source, &target, &slot, settings.again, &sequences).await?;
    wait_for_a_starting_worker(&source, &target, &slot, deadline).await?;
    if !has_progress(&target, &slot).await? {
        if slot_state(&source, &slot).await?.0 {
            return Err(Error::definite(format!(
                "a worker streams slot {slot:?}, but the target has no pgapply progress for it: is --target the database that worker replicates into? (nothing was done)"
            )));
        }
        // A slot no pgapply run replicated into this database, while another slot's worker
        // replicates the same publication here: a misspelt --slot (another target's slot, one
        // made by hand), which would apply its changes over that mirror's, from wherever the
        // slot happens to be. (A slot made for this cutover alone, into a database no worker
        // replicates that publication into, is applied from its start; so is the slot an
        // earlier `cutover --reverse` made for the way back.)
        if !made_by_a_reverse_cutover(&source, &slot).await {
            refuse_a_slot_not_replicated_here(&target, &slot, &run_config.publications).await?;
        }
    }

    STEP.store(1, Ordering::Relaxed);
    // 1. Lag. A worker still making the initial copy leaves the slot inactive (it streams once
    // the copy is done): wait for it, rather than take over a slot it is about to stream from.
    let mut said = false;
    while copy_under_way(&target, &slot).await? {
        if !said {
            crate::out!("step 1: pgapply is still making the initial copy for slot {slot:?} (see pgapply status); waiting for it to finish");
            said = true;
        }
        if Instant::now() > deadline {
            return Err(Error::definite(format!(
                "step 1: the initial copy was still running after {}: run the cutover once it is done (pgapply status), or give a longer --timeout",
                humantime::format_duration(settings.timeout)
            )));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // A worker that is just (re)connecting shows the slot inactive for a moment: look a
    // few times before concluding that none runs.
    let mut active = false;
    for _ in 0..10 {
        active = slot_state(&source, &slot).await?.0;
        if active {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    if active {
        active = watch_the_worker(&source, &target, &slot, &settings, deadline).await?;
        if !active {
            crate::out!("step 1: the worker let go of slot {slot:?} (stopped, or its connection lost); this command applies the remaining changes itself");
        }
    } else {
        crate::out!("step 1: no worker is streaming slot {slot:?}; this command applies the remaining changes itself");
    }
    if !active && !settings.freeze_roles.is_empty() {
        // Catch up while the application still writes: once frozen, it waits only for
        // what it wrote since.
        let (_, _, current) = slot_state(&source, &slot).await?;
        let mut config = run_config.clone();
        config.endpos = Some(current);
        let outcome = run_until(config, deadline, "step 1").await?;
        crate::out!(
            "step 1: caught up to {} before freezing writes",
            outcome.flushed
        );
    }

    STEP.store(2, Ordering::Relaxed);
    // 2. Freeze writes, in the migrated database only: the roles may write to other databases of
    // the same cluster, which this cutover does not move.
    let mut ended_pids: Vec<i32> = Vec::new();
    let database: String = if settings.freeze_roles.is_empty() {
        String::new()
    } else {
        source
            .query_one("SELECT current_database()::text", &[])
            .await
            .map_err(|e| Error::postgres("step 2: reading the source's database name", e))?
            .get(0)
    };
    // (In a read-write transaction: in a session of a frozen role, the cutover's own say, the
    // ALTER would be refused as a write in a read-only one, even sent as one string.)
    let undo = |role: &str| {
        format!(
            "BEGIN READ WRITE; ALTER ROLE {} IN DATABASE {} RESET default_transaction_read_only; COMMIT",
            quote_ident(role),
            quote_ident(&database)
        )
    };
    let undo_all = |roles: &[String]| roles.iter().map(|r| undo(r)).collect::<Vec<_>>().join("; ");
    let mut altered: Vec<&str> = Vec::new();
    // A failure half-way leaves the roles before it read-only: say so, with the way back.
    let half_way = |e: Error, altered: &[&str]| {
        if altered.is_empty() {
            e
        } else {
            e.context_after(format!(
                "role(s) {} are read-only already: undo with {}",
                altered.join(", "),
                altered
                    .iter()
                    .map(|r| undo(r))
                    .collect::<Vec<_>>()
                    .join("; ")
            ))
        }
    };
    for role in &settings.freeze_roles {
        if let Err(e) = source
            .batch_execute(&format!(
                "ALTER ROLE {} IN DATABASE {} SET default_transaction_read_only = on",
                quote_ident(role),
                quote_ident(&database)
            ))
            .await
        {
            let e = Error::postgres(format!("step 2: making role {role:?} read-only"), e);
            return Err(half_way(e, &altered));
        }
        altered.push(role);
        // The sessions first, then the signal: in one WHERE clause the planner may call
        // pg_terminate_backend before the role filter.
        let context = |e| {
            half_way(
                Error::postgres(format!("step 2: ending the sessions of role {role:?}"), e),
                &altered,
            )
        };
        let pids: Vec<i32> = source
            .query(
                // (Not walsenders: a worker connected as that role keeps replicating. A role
                // that may not see the session's details, neither a member of that role nor of
                // pg_read_all_stats, reads a NULL backend_type: such sessions are ended too.)
                "SELECT pid FROM pg_stat_activity WHERE usename = $1 AND datname = current_database() AND pid <> pg_backend_pid() AND backend_type IS DISTINCT FROM 'walsender'",
                &[role],
            )
            .await
            .map_err(context)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let ended = source
            .execute(
                "SELECT pg_terminate_backend(p) FROM unnest($1::int4[]) p",
                &[&pids],
            )
            .await
            .map_err(context)?;
        ended_pids.extend(pids);
        crate::out!(
            "step 2: role {role:?} is read-only now in database {database:?} and {ended} session(s) there ended; undo with: {}",
            undo(role)
        );
    }

    // From here on, a failure leaves the roles read-only and (once step 3 has written the end)
    // the slot's worker stopped: say so with it, and how to go back.
    let frozen = |e: Error| {
        let e = if settings.freeze_roles.is_empty() {
            e
        } else {
            e.context_after(format!(
                "writes are still frozen for {}: undo with {}, or run the cutover again",
                settings.freeze_roles.join(", "),
                undo_all(&settings.freeze_roles)
            ))
        };
        e.context_after(format!(
            "to go back to mirroring instead of finishing the cutover, clear the stop position the cutover may have set on the target: UPDATE pgapply.progress SET stop_lsn = NULL WHERE slot_name = '{}', and start pgapply run again",
            slot.replace('\'', "''")
        ))
    };
    STEP.store(3, Ordering::Relaxed);
    let end = drain(&source, &target, &run_config, &ended_pids, deadline)
        .await
        .map_err(frozen)?;
    crate::out!("step 3: everything up to {end} is applied");
    // A transaction prepared on the source before the end (--two-phase) and not yet committed or
    // rolled back there stays prepared on the target: somebody must decide it.
    // (Named pgapply_<slot>_<xid>: the rest after the slot's prefix is all digits, which keeps
    // slot app's transactions apart from slot app_eu's.)
    let prefix = format!("pgapply_{slot}_");
    let prepared: Vec<String> = target
        .query(
            "SELECT gid FROM pg_catalog.pg_prepared_xacts WHERE database = current_database()",
            &[],
        )
        .await
        .map_err(|e| {
            frozen(Error::postgres(
                "step 3: reading prepared transactions on the target",
                e,
            ))
        })?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|gid| {
            gid.strip_prefix(&prefix)
                .is_some_and(|xid| !xid.is_empty() && xid.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    for gid in &prepared {
        crate::out!(
            "step 3: WARNING: transaction {gid} is still prepared on the target (prepared on the source, neither committed nor rolled back there before the end): COMMIT PREPARED or ROLLBACK PREPARED it on the target as the source decides"
        );
    }

    STEP.store(4, Ordering::Relaxed);
    // 4. Sequences.
    let copied = copy_sequences(&source, &target, &sequences)
        .await
        .map_err(frozen)?;
    crate::out!("step 4: copied {copied} sequence(s)");
    if !sequences.left_out.is_empty() {
        let shown = sequences.left_out.len().min(20);
        let more = match sequences.left_out.len() - shown {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        crate::out!(
            "step 4: not copied, as no published table uses them: {}{more} (--all-sequences copies every sequence)",
            sequences.left_out[..shown].join(", ")
        );
        // Their values as of now (writes frozen or drained): what to run on the target if the
        // application calls one by name, which only the user knows.
        let mut statements = Vec::new();
        for name in &sequences.left_out[..shown] {
            let row = source
                .query_opt(
                    &format!("SELECT last_value::text, is_called FROM {name}"),
                    &[],
                )
                .await;
            if let Ok(Some(row)) = row {
                let (value, called): (String, bool) = (row.get(0), row.get(1));
                statements.push(format!(
                    "SELECT setval({}, {value}, {called});",
                    crate::sql::quote_literal(name)
                ));
            }
        }
        if !statements.is_empty() {
            crate::out!(
                "step 4: if the application uses any of them (by name, or from a table that is not published), set it on the target as on the source now: {}",
                statements.join(" ")
            );
        }
    }

    STEP.store(5, Ordering::Relaxed);
    // 5. Verify. Everything up to the end is applied and nothing after it will be: a chunk that
    // differs stays so, and checking it again would only keep the writes frozen longer.
    if settings.no_verify {
        crate::out!("step 5: left out (--no-verify): compare the tables with `pgapply verify` before the application writes to the target, if it was not done while mirroring");
    } else {
        let verify_settings = VerifySettings {
            attempts: 1,
            ..verify_settings
        };
        let results = verify::verify(
            &run_config.source,
            &run_config.target,
            &run_config.publications,
            &run_config.table_map,
            &run_config.column_map,
            &verify_settings,
        )
        .await
        .map_err(frozen)?;
        verify::report(&results, false).map_err(|e| frozen(e.context("step 5")))?;
        crate::out!("step 5: {} table(s) verified", results.len());
    }

    STEP.store(6, Ordering::Relaxed);
    // 6. Reverse replication.
    if settings.reverse {
        prepare_reverse(&target, &run_config)
            .await
            .map_err(frozen)?;
    }
    target
        .execute(
            "UPDATE pgapply.progress SET cutover_done_at = now() WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| {
            frozen(Error::postgres(
                "recording the finished cutover on the target",
                e,
            ))
        })?;
    crate::out!(
        "cutover done in {:.1}s: the target holds everything committed on the source up to {end}; point the applications at the target{}",
        started.elapsed().as_secs_f64(),
        if grants.is_empty() {
            ""
        } else {
            " (first give the frozen roles there the rights they lack: see the warnings before step 1)"
        }
    );
    // Said again at the end (step 2 said it first): what a rollback, or a rehearsal, runs on the
    // source to let the frozen roles write there again.
    if !settings.freeze_roles.is_empty() {
        crate::out!(
            "role(s) {} stay read-only on the source; to let them write there again (a rollback, or after a rehearsal), run there: {}",
            settings.freeze_roles.join(", "),
            undo_all(&settings.freeze_roles)
        );
    }
    // Going back (slot `<forward>_reverse`): the forward slot on the old primary, the target
    // now, has held its WAL since the first cutover, and will until dropped.
    if let Some(forward) = slot.strip_suffix("_reverse").filter(|f| !f.is_empty()) {
        let held = target
            .query_opt(
                "SELECT pg_size_pretty(pg_current_wal_lsn() - restart_lsn) FROM pg_catalog.pg_replication_slots                  WHERE slot_name = $1 AND NOT active",
                &[&forward],
            )
            .await
            .ok()
            .flatten()
            .map(|r| r.get::<_, Option<String>>(0).unwrap_or_default());
        if let Some(held) = held {
            crate::out!(
                "the forward slot {forward:?} on the target (the old primary, primary again) holds {held} of its WAL, more every minute: drop it there: SELECT pg_drop_replication_slot({}) (it cannot take a migration forward again: it would send back what came from the new primary; a new migration starts with a new slot and --copy-data)",
                crate::sql::shown_literal(forward)
            );
        }
    }
    // Going back to an old primary (a cutover in the other direction): the roles an earlier
    // cutover froze there are read-only still, and the applications would fail on it.
    let still_frozen: Vec<String> = target
        .query(
            "SELECT r.rolname::text FROM pg_catalog.pg_db_role_setting s \
             JOIN pg_catalog.pg_roles r ON r.oid = s.setrole \
             JOIN pg_catalog.pg_database d ON d.oid = s.setdatabase AND d.datname = current_database() \
             WHERE 'default_transaction_read_only=on' = ANY (s.setconfig) ORDER BY 1",
            &[],
        )
        .await
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default();
    if !still_frozen.is_empty() {
        let target_database: String = target
            .query_one("SELECT current_database()::text", &[])
            .await
            .map(|r| r.get(0))
            .unwrap_or_default();
        crate::out!(
            "WARNING: on the target, role(s) {} are read-only in this database (frozen by an earlier cutover, when it was the source): before the applications write there, run {}",
            still_frozen.join(", "),
            still_frozen
                .iter()
                .map(|r| format!(
                    "BEGIN READ WRITE; ALTER ROLE {} IN DATABASE {} RESET default_transaction_read_only; COMMIT",
                    quote_ident(r),
                    quote_ident(&target_database)
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    // The slot stays (a worker started again stops at the end, and it shows where the cutover
    // ended), but it holds the old primary's WAL from the end on, for as long as it exists.
    crate::out!(
        "slot {slot:?} on the source is kept and holds its WAL from {end} on: once the migration is settled, drop it there: SELECT pg_drop_replication_slot('{}')",
        slot.replace('\'', "''")
    );
    Ok(())
}

/// Step 1 with a worker streaming the slot: waits until its lag is below --max-lag and it is
/// seen alive. Returns false when it lets go of the slot meanwhile (then the cutover applies
/// the rest itself, as when none ran).
async fn watch_the_worker(
    source: &Client,
    target: &Client,
    slot: &str,
    settings: &CutoverSettings,
    deadline: Instant,
) -> Result<bool> {
    // The worker must also be seen working: a stopped (hung) one keeps its last lag figures,
    // low ones too, until the source gives up on it. Its heartbeat on the target (every
    // status interval, 10 s at most) must move while we look: that needs no privilege on
    // the source, and works on every version.
    let heartbeat = || async {
        target
            .query_opt(
                "SELECT heartbeat_at::text FROM pgapply.progress WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map(|r| r.and_then(|r| r.get::<_, Option<String>>(0)))
            .map_err(|e| Error::postgres("step 1: reading the worker's heartbeat on the target", e))
    };
    let first_heartbeat = heartbeat().await?;
    // (From here: a wait for the initial copy above does not count against the worker.)
    let watching = Instant::now();
    let mut said_waiting = false;
    let mut inactive_since: Option<Instant> = None;
    loop {
        let (streamed, confirmed, current) = slot_state(source, slot).await?;
        // Let go of for a few seconds (a reconnect takes less): stopped, killed, or cut off.
        if streamed {
            inactive_since = None;
        } else if inactive_since.get_or_insert_with(Instant::now).elapsed()
            >= Duration::from_secs(3)
        {
            return Ok(false);
        }
        let bytes = current.0.saturating_sub(confirmed.0);
        // flush_lag is NULL while the worker is idle and caught up.
        let row = source
                .query_one(
                    "SELECT coalesce(extract(epoch FROM r.flush_lag), 0)::float8, \
                            (pg_current_wal_lsn() - r.sent_lsn)::float8 \
                     FROM pg_replication_slots s \
                     LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1",
                    &[&slot],
                )
                .await
                .map_err(|e| Error::postgres("step 1: reading the lag on the source", e))?;
        let seconds: f64 = row.get(0);
        // How far the walsender's sending trails the source's WAL: while it is still
        // decoding a backlog it sends nothing, and the worker, with nothing in flight,
        // would say 0 s.
        let unsent: Option<f64> = row.get(1);
        // The walsender's flush_lag counts until the worker's next status update: for a
        // quiet publication on a busy cluster it never falls below the status interval
        // (10 s by default). The worker's own figure (the age of the last applied commit
        // while it is behind, 0 when it is not: recorded by its heartbeat) does.
        let worker: Option<f64> = target
            .query_opt(
                "SELECT lag_seconds FROM pgapply.progress WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(|e| Error::postgres("step 1: reading the worker's lag on the target", e))?
            .and_then(|r| r.get(0));
        let caught_up = unsent.is_some_and(|u| u <= 16.0 * 1024.0 * 1024.0);
        let seconds = match worker {
            Some(w) if caught_up => seconds.min(w.max(0.0)),
            _ => seconds,
        };
        let answering = heartbeat().await? != first_heartbeat;
        let below = match settings.max_lag {
            MaxLag::Bytes(max) => bytes <= max,
            MaxLag::Time(max) => seconds <= max.as_secs_f64(),
        };
        let waiting = if below && !answering {
            ": below --max-lag, waiting for the worker's next heartbeat on the target (every 10 s at most) to see it alive"
        } else {
            ""
        };
        // (Said once while it waits for the heartbeat: the figures change little meanwhile.)
        if waiting.is_empty() || !said_waiting {
            crate::out!("step 1: lag {bytes} bytes, {seconds:.1} s (source at {current}, confirmed {confirmed}){waiting}");
        }
        said_waiting |= !waiting.is_empty();
        if below && answering {
            return Ok(true);
        }
        // A worker writes its heartbeat every 10 s at most: three times that without one,
        // and it is not coming.
        let silent = !answering && watching.elapsed() > 3 * crate::replicate::HEARTBEAT_MAX_EVERY;
        if Instant::now() > deadline || silent {
            if !answering {
                return Err(Error::definite(format!(
                        "step 1: the worker streaming slot {slot:?} wrote no heartbeat on the target in {} (it writes one every status interval, 10 s at most): is it stopped or hung? See its log and pgapply status, then run the cutover again (nothing was changed yet)",
                        humantime::format_duration(Duration::from_secs(watching.elapsed().as_secs()))
                    )));
            }
            let hint = match settings.max_lag {
                    MaxLag::Bytes(_) => " (on a source that writes much WAL outside the publication, the slot's confirmed position trails it by up to a status interval's worth: give --max-lag as a duration, 5s say)",
                    MaxLag::Time(_) => "",
                };
            return Err(Error::definite(format!(
                    "step 1: the lag of slot {slot:?} was still {bytes} bytes, {seconds:.1} s after {} (--timeout), above --max-lag: check that pgapply keeps up (pgapply status), then run the cutover again, or give a larger --max-lag or --timeout{hint} (nothing was changed yet)",
                    humantime::format_duration(settings.timeout)
                )));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Step 3: takes the end position once the frozen roles' sessions are gone, and drains replication
/// to it. Returns the end.
async fn drain(
    source: &Client,
    target: &Client,
    run_config: &RunConfig,
    ended_pids: &[i32],
    deadline: Instant,
) -> Result<Lsn> {
    let slot = &run_config.slot;
    // pg_terminate_backend only signals: a session caught committing may still write. The end
    // is taken once they are gone.
    while !ended_pids.is_empty() {
        let left: Vec<i32> = source
            .query(
                "SELECT pid FROM pg_stat_activity WHERE pid = ANY ($1) ORDER BY pid",
                &[&ended_pids],
            )
            .await
            .map_err(|e| Error::postgres("step 3: waiting for the ended sessions", e))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if left.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let pids: Vec<String> = left.iter().map(|p| p.to_string()).collect();
            return Err(Error::definite(format!(
                "step 3: {} session(s) of the frozen roles did not end in time (--timeout): source process(es) {}; end them (SELECT pg_terminate_backend(pid)) and run the cutover again",
                left.len(),
                pids.join(", ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // From reading the end until it is recorded on the target, no group of the running worker
    // commits (each takes this lock, shared, to check the stop position: `pgapply.check_group`, migration 0012): a
    // writer that was not frozen cannot slip a transaction committed after the end through a
    // group sent before the worker read the request.
    target
        .batch_execute("BEGIN")
        .await
        .map_err(|e| Error::postgres("step 3: starting the stop on the target", e))?;
    target
        .execute(
            "SELECT pg_catalog.pg_advisory_xact_lock(1885827956, pg_catalog.hashtext('pgapply stop ' || $1))",
            &[slot],
        )
        .await
        .map_err(|e| Error::postgres("step 3: taking the slot's stop lock on the target", e))?;
    // The flushed position, once it covers every commit made so far. Commits made with
    // synchronous_commit = off are visible before their WAL is even written; WAL is flushed in
    // order, so a synchronous commit of our own (an xid, nothing else; `local`: not waiting for
    // synchronous standbys) flushes all of them. (The
    // insert position cannot be waited for: at a page boundary it points past the page header,
    // where no flush ever reaches until more WAL comes.)
    source
        .batch_execute(
            "SET synchronous_commit = local; BEGIN; SELECT txid_current(); COMMIT; RESET synchronous_commit",
        )
        .await
        .map_err(|e| Error::postgres("step 3: flushing the source's WAL", e))?;
    let end = source
        .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
        .await
        .map_err(|e| Error::postgres("step 3: reading the source's WAL position", e))?
        .get::<_, String>(0)
        .parse::<Lsn>()
        .map_err(|e| Error::definite(e.to_string()))?;
    crate::out!("step 3: draining replication to {end}");
    // The slot's worker stops at the end, as with --endpos, and stays stopped there when started
    // again: it must not apply the source's later writes to what is now the primary. (Written
    // again after a run of our own, which may have made the slot's row.)
    let fence = || async {
        target
            .execute(
                // (A cutover that finished before is not this one: it is done when this one is.)
                "UPDATE pgapply.progress SET stop_lsn = $2::text::pg_lsn, cutover_done_at = NULL WHERE slot_name = $1",
                &[slot, &end.to_string()],
            )
            .await
            .map_err(|e| Error::postgres("step 3: asking the worker to stop at the end", e))
    };
    let marked = fence().await?;
    target
        .batch_execute("COMMIT")
        .await
        .map_err(|e| Error::postgres("step 3: recording the end position on the target", e))?;
    let (active, _, _) = slot_state(source, slot).await?;
    if active && marked == 0 {
        return Err(Error::definite(format!(
            "step 3: a worker streams slot {slot:?}, but the target has no pgapply progress for it: is --target the database that worker replicates into?"
        )));
    }
    if active {
        crate::out!("step 3: asked the running worker to stop at {end}");
        let mut inactive_since: Option<Instant> = None;
        // A worker that stopped answering (SIGSTOP, a hang) keeps the slot until the source's
        // wal_sender_timeout, and its target session the slot's replication origin for ever:
        // its heartbeat on the target (every 10 s at most) tells it apart from a busy one.
        let heartbeat = || async {
            target
                .query_opt(
                    "SELECT heartbeat_at::text FROM pgapply.progress WHERE slot_name = $1",
                    &[slot],
                )
                .await
                .map(|r| r.and_then(|r| r.get::<_, Option<String>>(0)))
                .map_err(|e| {
                    Error::postgres("step 3: reading the worker's heartbeat on the target", e)
                })
        };
        let mut last_heartbeat = (heartbeat().await?, Instant::now());
        loop {
            let (active, confirmed, _) = slot_state(source, slot).await?;
            if !active && confirmed >= end {
                crate::out!("step 3: the worker confirmed {end} and stopped");
                return Ok(end);
            }
            let beat = heartbeat().await?;
            if beat != last_heartbeat.0 {
                last_heartbeat = (beat, Instant::now());
            } else if active
                // (Twice step 1's margin: a busy target may answer a heartbeat late.)
                && last_heartbeat.1.elapsed() > 6 * crate::replicate::HEARTBEAT_MAX_EVERY
            {
                return Err(Error::definite(format!(
                    "step 3: the worker streaming slot {slot:?} wrote no heartbeat on the target in {} s while asked to stop at {end} (confirmed {confirmed}): it seems hung. Stop that pgapply process (kill it if SIGTERM does nothing), then run the cutover again: it applies the rest itself",
                    last_heartbeat.1.elapsed().as_secs()
                )));
            }
            if active {
                inactive_since = None;
            } else if inactive_since.get_or_insert_with(Instant::now).elapsed()
                > Duration::from_secs(5)
            {
                // Gone before the end (stopped, failed and not back within 5 s, or timed out
                // by the source).
                crate::out!("step 3: the worker let go of the slot at {confirmed}, before {end} (it stopped, failed, or the source ended its connection): applying the rest here");
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::definite(if active && confirmed >= end {
                    format!(
                        "step 3: the worker confirmed {end} (it is at {confirmed}) but did not stop in time: it reads the request to stop from the target, so it may have lost its connection there; see its log, stop it (SIGTERM), and run the cutover again"
                    )
                } else {
                    format!(
                        "step 3: the worker did not confirm {end} and stop in time (confirmed {confirmed}, slot {}): see its log",
                        if active { "still in use" } else { "free" }
                    )
                }));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let mut config = run_config.clone();
    config.endpos = Some(end);
    let outcome = run_until(config, deadline, "step 3").await?;
    fence().await?;
    // It stops at the first transaction committed at or after the end, or when the source's
    // position passes it: either way everything before the end is applied.
    if outcome.reason != crate::replicate::StopReason::EndPosition {
        return Err(Error::definite(format!(
            "step 3: replication stopped before the end {end} ({:?}): run the cutover again",
            outcome.reason
        )));
    }
    Ok(end)
}

/// A cutover of a slot that an earlier one stopped: said, and refused once replication back
/// into the source (`--reverse`) has run, whose changes draining again would bring to the target
/// a second time.
async fn again(
    source: &Client,
    target: &Client,
    slot: &str,
    allowed: bool,
    sequences: &SequencePlan,
) -> Result<()> {
    // A finished cutover counts whether or not its stop position was cleared since (as to go
    // back to mirroring after a rehearsal): the applications may write to the target all the
    // same.
    let previous: Option<(Option<String>, Option<String>)> = target
        .query_opt(
            "SELECT stop_lsn::text, cutover_done_at::text FROM pgapply.progress \
             WHERE slot_name = $1 AND (stop_lsn IS NOT NULL OR cutover_done_at IS NOT NULL)",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?
        .map(|r| (r.get(0), r.get(1)));
    let Some((previous, done_at)) = previous else {
        return Ok(());
    };
    let previous =
        previous.unwrap_or_else(|| "a position (cleared on the target since)".to_owned());
    let reverse = format!("{slot}_reverse");
    // Known from the source's pgapply schema (the reverse run's progress), or from the reverse
    // slot on the target: in use now, or, when the source's schema cannot be read, there at all.
    // (Two queries: a query naming the table fails where it does not exist.)
    let has_schema = source
        .query_one("SELECT to_regclass('pgapply.progress') IS NOT NULL", &[])
        .await
        .map(|r| r.get::<_, bool>(0));
    let read = match has_schema {
        Ok(true) => source
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pgapply.progress WHERE slot_name = $1)",
                &[&reverse],
            )
            .await
            .map(|r| r.get::<_, bool>(0)),
        other => other,
    };
    let reverse_slot: Option<bool> = target
        .query_opt(
            "SELECT active FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
            &[&reverse],
        )
        .await
        .map_err(|e| Error::postgres("reading the reverse slot on the target", e))?
        .map(|r| r.get(0));
    let reversed = match read {
        Ok(ran) => ran || reverse_slot == Some(true),
        Err(_) => reverse_slot.is_some(),
    };
    if reversed {
        return Err(Error::definite(format!(
            "a cutover already stopped slot {slot:?} at {previous}, and replication back from the target into the source has run since (slot {reverse:?}): draining the source again would apply those changes to the target a second time. To go back to the old primary, cut over in the other direction (pgapply cutover --source <the target> --target <the source> --slot {reverse} ...); if nothing was replicated back, drop slot {reverse:?} on the target and run this cutover again"
        )));
    }
    // Once the applications write to the target, another drain would apply the old primary's
    // later writes over theirs, and set the sequences back.
    if let Some(done_at) = done_at.filter(|_| !allowed) {
        return Err(Error::definite(format!(
            "a cutover of slot {slot:?} finished at {done_at}, stopping it at {previous}: if the applications write to the target now, another cutover would apply what the old primary committed since over their writes, so nothing was done. If that cutover was a rehearsal and the applications still write to the source, run this one with --again"
        )));
    }
    let ahead = sequences_ahead(source, target, sequences).await?;
    if !ahead.is_empty() {
        return Err(Error::definite(format!(
            "a cutover already stopped slot {slot:?} at {previous}, and since then the target has handed out sequence values of its own ({}): the applications seem to write to the target, and draining the source again would apply the old primary's later writes over theirs, so nothing was done. If the target's writes are to be thrown away, set those sequences back on the target (SELECT setval(...)) and run the cutover again",
            ahead
                .iter()
                .map(|a| format!("{} at {}, the source's at {}", a.target_name, a.target_value, a.source_value))
                .collect::<Vec<_>>()
                .join("; ")
        )));
    }
    crate::out!("a cutover already stopped slot {slot:?} at {previous}: this one drains it again, applying what the source committed since");
    Ok(())
}

/// Applies up to `config.endpos` here, in this process; past `deadline` (`--timeout`) the run is
/// stopped (what it committed stays, as after any stop) and the step fails. Transient errors are
/// retried until then, as `pgapply run` does (a worker that just stopped may still hold the
/// slot or the origin for a moment).
async fn run_until(config: RunConfig, deadline: Instant, step: &str) -> Result<RunOutcome> {
    // Since when a session of another process has held the slot's replication origin: a worker
    // that stopped answering (SIGSTOP, a hang) keeps it for ever, and waiting for --timeout
    // would only keep the writes frozen longer.
    let mut origin_held_since: Option<Instant> = None;
    let mut last_said: Option<(String, Instant)> = None;
    loop {
        match run_once_until(config.clone(), deadline, step).await {
            Err(e) if e.is_transient() => {
                let text = e.to_string();
                if let Some(pid) = crate::apply::progress::origin_holder(&text) {
                    let since = *origin_held_since.get_or_insert_with(Instant::now);
                    let out_of_time = Instant::now() + Duration::from_secs(1) >= deadline;
                    if out_of_time || since.elapsed() > 3 * crate::replicate::HEARTBEAT_MAX_EVERY {
                        return Err(Error::definite(format!(
                            "{step}: target session {pid} (of another pgapply, likely the worker that stopped answering) has held the slot's replication origin for {} s: end that pgapply process, or that session on the target (SELECT pg_terminate_backend({pid})), and run the cutover again",
                            since.elapsed().as_secs()
                        )));
                    }
                } else if Instant::now() + Duration::from_secs(1) >= deadline {
                    return Err(e);
                } else {
                    origin_held_since = None;
                }
                // (The same error again within 10 s is not repeated: a lock or a worker's
                // session held for a while would print it every second.)
                let shown = if text.starts_with(step) {
                    format!("{text}; trying again")
                } else {
                    format!("{step}: {text}; trying again")
                };
                let repeated = last_said.as_ref().is_some_and(|(said, at)| {
                    *said == shown && at.elapsed() < Duration::from_secs(10)
                });
                if !repeated {
                    crate::out!("{shown}");
                    last_said = Some((shown, Instant::now()));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            outcome => return outcome,
        }
    }
}

async fn run_once_until(
    mut config: RunConfig,
    deadline: Instant,
    step: &str,
) -> Result<RunOutcome> {
    config.by_cutover = true;
    let endpos = config.endpos;
    let (stop, stop_rx) = watch::channel(false);
    let applying = run(config, stop_rx, None);
    tokio::pin!(applying);
    tokio::select! {
        outcome = &mut applying => outcome.map_err(|e| e.context(step)),
        _ = tokio::time::sleep_until(deadline.into()) => {
            let _ = stop.send(true);
            let stopped = applying.await;
            Err(Error::definite(format!(
                "{step}: applying up to {} did not finish within --timeout (stopped at {}): run the cutover again, or with a longer --timeout",
                endpos.unwrap_or(Lsn::INVALID),
                stopped.map(|o| o.flushed.to_string()).unwrap_or_else(|e| format!("an error: {e}"))
            )))
        }
    }
}

/// What would stop step 2 half-way: a role that does not exist (a typo), or a source role that
/// may not alter roles or end their sessions.
/// For each role `--freeze-writes` names: missing on the target, or lacking there a right on a
/// published table (SELECT, INSERT, UPDATE, DELETE) that it has on the source.
async fn role_grant_warnings(
    source: &Client,
    target: &Client,
    config: &RunConfig,
    roles: &[String],
) -> Result<Vec<String>> {
    if roles.is_empty() {
        return Ok(Vec::new());
    }
    let tables = published_tables(source, &config.publications, &config.table_map).await?;
    let source_names: Vec<String> = tables.iter().map(|t| t.qualified()).collect();
    let target_names: Vec<String> = tables.iter().map(|t| t.target_qualified()).collect();
    // Per table (in the order given): the rights the role has on it, NULL where the role or
    // the table does not exist.
    let rights_sql = "SELECT (SELECT pg_catalog.array_to_string(ARRAY( \
                         SELECT p FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) p \
                         WHERE pg_catalog.has_table_privilege($1, t.n, p)), ',') \
                       WHERE EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = $1) \
                         AND pg_catalog.to_regclass(t.n) IS NOT NULL) \
                      FROM unnest($2::text[]) WITH ORDINALITY t(n, i) ORDER BY t.i";
    let mut warnings = Vec::new();
    for role in roles {
        let exists = target
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = $1)",
                &[role],
            )
            .await
            .map_err(|e| Error::postgres("looking up the frozen roles on the target", e))?
            .get::<_, bool>(0);
        if !exists {
            warnings.push(format!(
                "role {} does not exist on the target (roles belong to a cluster and are not replicated): create it there, with the rights it has on the source (pg_dumpall --roles-only lists the roles, and pg_dump --schema-only the grants), before the applications log in as it", crate::sql::quote_ident(role)
            ));
            continue;
        }
        let rights = |rows: Vec<tokio_postgres::Row>| -> Vec<String> {
            rows.iter()
                .map(|r| r.get::<_, Option<String>>(0).unwrap_or_default())
                .collect()
        };
        let here = rights(
            source
                .query(rights_sql, &[role, &source_names])
                .await
                .map_err(|e| {
                    Error::postgres("reading the frozen roles' rights on the source", e)
                })?,
        );
        let there = rights(
            target
                .query(rights_sql, &[role, &target_names])
                .await
                .map_err(|e| {
                    Error::postgres("reading the frozen roles' rights on the target", e)
                })?,
        );
        let lacking: Vec<String> = here
            .iter()
            .zip(&there)
            .zip(&target_names)
            .filter_map(|((here, there), table)| {
                let missing: Vec<&str> = here
                    .split(',')
                    .filter(|p| !p.is_empty() && !there.split(',').any(|q| q == *p))
                    .collect();
                (!missing.is_empty()).then(|| {
                    format!(
                        "GRANT {} ON {table} TO {};",
                        missing.join(", "),
                        crate::sql::quote_ident(role)
                    )
                })
            })
            .collect();
        if !lacking.is_empty() {
            let shown = lacking.len().min(5);
            warnings.push(format!(
                "role {} may do less on the target than on the source (rights are not replicated): on the target, {}{} (and USAGE on the tables' schemas and sequences, if it lacks it there)",
                crate::sql::quote_ident(role),
                lacking[..shown].join(" "),
                match lacking.len() - shown {
                    0 => String::new(),
                    n => format!(" and the same for {n} more table(s)"),
                }
            ));
        }
    }
    Ok(warnings)
}

async fn freeze_problems(source: &Client, roles: &[String]) -> Result<Vec<String>> {
    if roles.is_empty() {
        return Ok(Vec::new());
    }
    let context = |e| Error::postgres("looking up the roles to freeze on the source", e);
    let mut problems: Vec<String> = source
        .query(
            "SELECT r FROM unnest($1::text[]) r WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r)",
            &[&roles],
        )
        .await
        .map_err(context)?
        .iter()
        .map(|r| {
            format!(
                "--freeze-writes names role {:?}, which the source does not have",
                r.get::<_, String>(0)
            )
        })
        .collect();
    let me = source
        .query_one(
            "SELECT rolsuper, rolcreaterole, pg_catalog.pg_has_role(current_user, 'pg_signal_backend', 'USAGE'), \
                    pg_catalog.current_setting('server_version_num')::int, current_user::text \
             FROM pg_catalog.pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(context)?;
    let (superuser, createrole, signal, version, me): (bool, bool, bool, i32, String) =
        (me.get(0), me.get(1), me.get(2), me.get(3), me.get(4));
    if superuser {
        return Ok(problems);
    }
    if !createrole {
        problems.push("--freeze-writes needs a source role with CREATEROLE (or a superuser) to make roles read-only".to_owned());
    }
    if !signal {
        problems.push("--freeze-writes needs a source role that is a member of pg_signal_backend (or a superuser) to end the frozen roles' sessions".to_owned());
    }
    // Superusers are altered and signalled by superusers only; from 16, CREATEROLE acts only on
    // roles it has ADMIN OPTION on.
    for row in source
        .query(
            "SELECT r.rolname::text, r.rolsuper, \
                    $2 < 160000 OR pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER WITH ADMIN OPTION') \
             FROM pg_catalog.pg_roles r WHERE r.rolname::text = ANY($1::text[])",
            &[&roles, &version],
        )
        .await
        .map_err(context)?
    {
        let (role, is_superuser, admin): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
        if is_superuser {
            problems.push(format!(
                "--freeze-writes names superuser {role:?}: only a superuser may make it read-only and end its sessions; run the cutover as a superuser, or leave that role out"
            ));
        } else if !admin {
            problems.push(format!(
                "--freeze-writes names role {role:?}, which the source role may not alter (PostgreSQL 16+ asks for ADMIN OPTION on it: GRANT {} TO {} WITH ADMIN OPTION, INHERIT FALSE, SET FALSE, which lets it alter the role without taking on its rights)",
                crate::sql::quote_ident(&role),
                crate::sql::quote_ident(&me)
            ));
        }
    }
    Ok(problems)
}

/// How `read_problems` starts when the target has none of the published tables.
const NONE_THERE: &str = "the target has none of the published tables";

/// The verify step reads every published table on both sides: a table either role may not
/// read would fail it after writes were frozen.
async fn read_problems(
    source: &Client,
    target: &Client,
    config: &RunConfig,
) -> Result<Vec<String>> {
    let tables = published_tables(source, &config.publications, &config.table_map).await?;
    let mut problems = Vec::new();
    let targets: Vec<String> = tables.iter().map(|t| t.target_qualified()).collect();
    let missing: Vec<String> = target
        .query(
            "SELECT n FROM unnest($1::text[]) n WHERE pg_catalog.to_regclass(n) IS NULL",
            &[&targets],
        )
        .await
        .map_err(|e| Error::postgres("looking up the published tables on the target", e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if !missing.is_empty() && missing.len() == targets.len() {
        problems.push(format!(
            "{NONE_THERE} ({}): is --target the database the worker replicates into?",
            missing.join(", ")
        ));
        return Ok(problems);
    }
    if !missing.is_empty() {
        problems.push(format!(
            "the target has no table {}: is --target the database the worker replicates into?",
            missing.join(", ")
        ));
    }
    for (client, side, names) in [
        (
            source,
            "source",
            tables.iter().map(|t| t.qualified()).collect::<Vec<_>>(),
        ),
        (
            target,
            "target",
            tables.iter().map(|t| t.target_qualified()).collect(),
        ),
    ] {
        for row in client
            .query(
                "SELECT n FROM unnest($1::text[]) n \
                 WHERE pg_catalog.to_regclass(n) IS NOT NULL AND NOT pg_catalog.has_table_privilege(n, 'SELECT')",
                &[&names],
            )
            .await
            .map_err(|e| Error::postgres(format!("checking the {side} role's rights on the published tables"), e))?
        {
            let table: String = row.get(0);
            let (role, _) = crate::sql::role_and_database(client).await;
            problems.push(format!(
                "the {side} role may not read {table}, which the verify step compares: GRANT SELECT ON {table} TO {role}"
            ));
        }
    }
    Ok(problems)
}

/// After a signal: the run this process made to drain the slot (step 3, when no worker ran)
/// ended with it, and `pgapply status` must not go on showing it as streaming. Rows of another
/// process (the worker the cutover asked to stop) are left alone. Best effort, briefly: the
/// error that follows says what is left.
pub async fn release_own_run(config: &RunConfig) {
    let attempt = async {
        let client = crate::tls::connect(&config.target).await.ok()?;
        client
            .execute(
                "UPDATE pgapply.progress SET state = 'stopped', pid = NULL, heartbeat_at = now() \
                 WHERE slot_name = $1 AND pid = $2",
                &[&config.slot, &(std::process::id() as i32)],
            )
            .await
            .ok()
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), attempt).await;
}

/// The step the cutover is at (0 before step 1), for `interrupted`.
static STEP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// What is left when a signal ends the cutover: the steps printed are done, and from step 2 on
/// the frozen roles stay read-only and the worker stays stopped at the end position.
pub fn interrupted(config: &RunConfig, roles: &[String]) -> Error {
    let step = STEP.load(Ordering::Relaxed);
    let database = config
        .source
        .get_dbname()
        .or(config.source.get_user())
        .unwrap_or("postgres");
    let frozen = if roles.is_empty() || step < 2 {
        String::new()
    } else {
        format!(
            "; writes are frozen for {}{}: undo with {}",
            roles.join(", "),
            if step == 2 { " (some of them, or all)" } else { "" },
            roles
                .iter()
                .map(|r| format!(
                    "BEGIN READ WRITE; ALTER ROLE {} IN DATABASE {} RESET default_transaction_read_only; COMMIT",
                    quote_ident(r),
                    quote_ident(database)
                ))
                .collect::<Vec<_>>()
                .join("; ")
        )
    };
    if step < 2 {
        return Error::definite(format!(
            "the cutover was interrupted by a signal at step {}: nothing was changed yet (no role frozen, no stop position set); run it again when you are ready",
            step.max(1)
        ));
    }
    Error::definite(format!(
        "the cutover was interrupted by a signal at step {step}: the steps it printed are done, step {step} may be half done{frozen}. Run the cutover again to finish it; or, to go back to mirroring instead,{} and start pgapply run again",
        if step >= 3 {
            format!(
                " clear the stop position set on the target (UPDATE pgapply.progress SET stop_lsn = NULL WHERE slot_name = '{}')",
                config.slot.replace('\'', "''")
            )
        } else {
            String::new()
        }
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_session_holding_an_origin_is_read_from_the_error() {
        use crate::apply::progress::origin_holder;
        assert_eq!(
            origin_holder("step 3: binding the apply session to replication origin \"pgapply_m2\" (is another pgapply running for this slot?): replication origin with ID 5 is already active for PID 29929 (SQLSTATE 55006)"),
            Some(29929)
        );
        assert_eq!(
            origin_holder(
                "could not drop replication origin with ID 3, in use by PID 2830 (SQLSTATE 55006)"
            ),
            Some(2830)
        );
        assert_eq!(origin_holder("connection refused"), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(super::parse_size("16MB").unwrap(), 16 << 20);
        assert_eq!(super::parse_size("512kB").unwrap(), 512 << 10);
        assert_eq!(super::parse_size("100").unwrap(), 100);
        assert!(super::parse_size("lots").is_err());
        assert_eq!(super::parse_size("1.5GB").unwrap(), 3 << 29);
        assert_eq!(super::parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(super::parse_size("2 kib").unwrap(), 2048);
        assert!(super::parse_size("1.2.3MB").is_err());
        assert!(super::parse_size("5m").is_err());
        assert!(
            matches!(super::MaxLag::parse("5m"), Ok(super::MaxLag::Time(t)) if t.as_secs() == 300)
        );
        assert!(matches!(super::MaxLag::parse("2MB"), Ok(super::MaxLag::Bytes(b)) if b == 2 << 20));
        assert!(super::MaxLag::parse("fast").is_err());
        assert_eq!(
            super::MaxLag::parse("5s").unwrap(),
            super::MaxLag::Time(std::time::Duration::from_secs(5))
        );
        assert_eq!(
            super::MaxLag::parse("1MB").unwrap(),
            super::MaxLag::Bytes(1 << 20)
        );
        assert!(super::MaxLag::parse("soonish").is_err());
    }
}
