//! `pgapply skip`: skip one source transaction on purpose, like ALTER SUBSCRIPTION .. SKIP.
//!
//! The transaction is named by its commit LSN, which every apply error prints. The request is
//! stored on the target; the worker reads it when it starts, drops that transaction's changes,
//! records the skip in pgapply.conflicts and clears the request in the same target transaction.

use crate::cli::SkipArgs;
use crate::config::FileConfig;
use crate::conninfo;
use crate::error::{Error, Result};
use crate::protocol::Lsn;

pub async fn skip_command(args: &SkipArgs, file: &FileConfig) -> Result<()> {
    let cancel = args.lsn.eq_ignore_ascii_case("none");
    let lsn: Lsn = if cancel {
        Lsn::INVALID
    } else {
        args.lsn
            .parse()
            .map_err(|e| Error::usage(format!("--lsn: {e} (or none, to take back a request)")))?
    };
    let slot = slot_of(args.slot.as_ref(), file)?;
    let client = connect_target(&args.servers, file).await?;
    // A transaction already applied never comes again: its request would wait for ever.
    let row = client
        .query_opt(
            "SELECT greatest(lsn, applied_lsn)::text, skip_lsn::text, last_error \
             FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) {
                Error::definite("the target has no pgapply state (schema pgapply): pgapply has not run against this database yet, so there is nothing to skip: check --target")
            } else {
                Error::postgres("reading pgapply.progress on the target", e)
            }
        })?;
    if row.is_none() {
        return Err(Error::definite(format!(
            "the target has no pgapply progress for slot {slot:?}: check --slot (see `pgapply status`)"
        )));
    }
    let applied: Option<String> = row.as_ref().and_then(|r| r.get(0));
    let pending: Option<String> = row.as_ref().and_then(|r| r.get(1));
    let last_error: Option<String> = row.as_ref().and_then(|r| r.get(2));
    if cancel {
        let updated = client
            .execute(
                "UPDATE pgapply.progress SET skip_lsn = NULL WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(|e| Error::postgres("taking back the skip request on the target", e))?;
        if updated == 0 {
            return Err(Error::definite(format!(
                "the target has no pgapply progress for slot {slot:?}: check --slot (see `pgapply status`)"
            )));
        }
        match pending {
            Some(p) => crate::out!("took back the request to skip the transaction committed at {p} (a worker running now read it when it started: restart it)"),
            None => crate::out!("slot {slot} had no skip request"),
        }
        return Ok(());
    }
    let applied = applied.and_then(|a| a.parse::<Lsn>().ok());
    if let Some(applied) = applied {
        if lsn < applied {
            return Err(Error::definite(format!(
                "the source transaction committed at {lsn} is already applied (slot {slot:?} has applied up to {applied}): nothing to skip; check --lsn against the latest error"
            )));
        }
    }
    // The transaction the last error named (kept while a retry runs, until another error
    // replaces it): another LSN is most likely a typo, and a request with no error behind it
    // would drop a transaction that applies fine.
    let named = last_error
        .as_deref()
        .and_then(named_lsn)
        .filter(|n| applied.is_none_or(|a| *n >= a));
    match named {
        Some(named) if named != lsn && !args.force => {
            return Err(Error::definite(format!(
                "the last error of slot {slot:?} names the source transaction committed at {named}, not {lsn}: give --lsn {named} (or add --force to skip the transaction committed at {lsn} anyway: all of its changes are lost on the target)"
            )));
        }
        None if !args.force => {
            return Err(Error::definite(format!(
                "no recorded error of slot {slot:?} names a source transaction still to apply (`pgapply status` shows the last error): skip is for the transaction an apply error names; check --slot and --lsn, or add --force to skip the transaction committed at {lsn} anyway (all of its changes are lost on the target)"
            )));
        }
        _ => {}
    }
    let updated = client
        .execute(
            "UPDATE pgapply.progress SET skip_lsn = $2::text::pg_lsn WHERE slot_name = $1",
            &[&slot, &lsn.to_string()],
        )
        .await
        .map_err(|e| Error::postgres("recording the skip request on the target", e))?;
    if updated == 0 {
        return Err(Error::definite(format!(
            "the target has no pgapply progress for slot {slot:?}: check --slot (see `pgapply status`)"
        )));
    }
    if let Some(pending) = pending.filter(|p| *p != lsn.to_string()) {
        crate::out!("(this replaces the request to skip the transaction committed at {pending}, which a worker started from now on no longer skips; a running worker read it when it started)");
    }
    crate::out!(
        "the source transaction committed at {lsn} will be skipped when pgapply next starts for slot {slot} (all of it: every change it made); the skip is then recorded in pgapply.conflicts. `pgapply skip --lsn none` takes the request back"
    );
    Ok(())
}

/// `pgapply forget`: removes what the target holds for a slot (progress, copy state, its origins'
/// commit rows, its replication origins), so that a retired worker or a misspelt slot leaves no
/// row in `status` and no origin state taken. Refused while a worker of the slot runs. Conflict
/// records stay (they are history). With --drop-slot, the source's slot goes too.
pub async fn forget_command(args: &crate::cli::ForgetArgs, file: &FileConfig) -> Result<()> {
    let slot = slot_of(args.slot.as_ref(), file)?;
    let source = if args.drop_slot {
        Some(
            crate::config::resolve_optional_source(&args.servers, file)?.ok_or_else(|| {
                Error::usage(
                    "--drop-slot needs the source: give --source (or source in the config file)",
                )
            })?,
        )
    } else {
        None
    };
    let mut client = connect_target(&args.servers, file).await?;
    let context = |e| Error::postgres("forgetting the slot on the target", e);
    let has_state: bool = client
        .query_one("SELECT to_regclass('pgapply.progress') IS NOT NULL", &[])
        .await
        .map_err(context)?
        .get(0);
    let row = if has_state {
        client
            // (Any state but a clean stop: a worker backing off after a failure, or starting,
            // still runs. Not a failed run with no process: it exited, and said so.)
            .query_opt(
                "SELECT coalesce(state, '') <> 'stopped' AND NOT (coalesce(state, '') = 'failed' AND pid IS NULL) \
                        AND heartbeat_at > now() - interval '30 seconds', pid \
                 FROM pgapply.progress WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(context)?
    } else {
        None
    };
    if let Some(row) = &row {
        if row.get::<_, Option<bool>>(0) == Some(true) {
            let pid: Option<i32> = row.get(1);
            return Err(Error::definite(format!(
                "a worker runs for slot {slot:?}{} (its heartbeat is less than 30 s old): stop it first, then forget the slot",
                pid.map_or_else(String::new, |p| format!(" (process {p})"))
            )));
        }
    }
    // --drop-slot: the slot of that name on the given source must be the one this target's state
    // is about (fan-in: each slot has a source of its own), checked before anything is removed.
    if let (Some(source), true) = (&source, has_state) {
        let recorded: Option<String> = client
            .query_opt(
                "SELECT source_system_id FROM pgapply.progress WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(context)?
            .and_then(|r| r.get(0));
        if let Some(recorded) = recorded.filter(|r| !r.is_empty()) {
            let mut session = crate::source::ReplicationSession::connect(source, 1 << 20)
                .await
                .map_err(|e| e.context(format!("source {}", conninfo::describe(source))))?;
            let identity = session.identify_system().await?;
            if identity.system_id != recorded {
                return Err(Error::definite(format!(
                    "this target's state for slot {slot:?} is about a source with system identifier {recorded}, but --source ({}) is system {}: its slot of that name belongs to another replication. Nothing was removed; give the --source slot {slot:?} replicates from",
                    conninfo::describe(source),
                    identity.system_id
                )));
            }
        }
    }
    // (One session on the source: the checks before anything is removed, then the drop.)
    let source_sql = match &source {
        Some(config) => Some(crate::tls::connect(config).await.map_err(|e| {
            e.into_error(format!(
                "connecting to source {}",
                conninfo::describe(config)
            ))
        })?),
        None => None,
    };
    if let Some(src) = &source_sql {
        refuse_a_slot_not_ours(&client, src, &slot, has_state).await?;
    }
    // Replication origins belong to the whole target cluster: the slot name claimed by another
    // database's pgapply (`pgapply_<slot>.db<oid>`) is that database's to forget.
    let other: Option<String> = client
        .query_opt(
            "SELECT d.datname::text FROM pg_catalog.pg_replication_origin o \
             JOIN pg_catalog.pg_database d ON o.roname = $1 || '.db' || d.oid::text \
             WHERE d.datname <> current_database() LIMIT 1",
            &[&format!("pgapply_{slot}")],
        )
        .await
        .map_err(context)?
        .map(|r| r.get(0));
    if let Some(other) = other {
        return Err(Error::definite(format!(
            "slot name {slot:?} is used by pgapply in database {other:?} of the target cluster: forget it there (--target with dbname={other})"
        )));
    }
    // Its origins: the slot's, its parallel workers' and helper's (`-wN`), and the claim of its
    // name by a database (`.db<oid>`). Slot names have neither '-' nor '.', so these prefixes
    // name no other slot's origins.
    let origin = format!("pgapply_{slot}");
    let origins: Vec<String> = client
        .query(
            "SELECT roname::text FROM pg_catalog.pg_replication_origin \
             WHERE roname = $1 OR left(roname, length($1) + 2) = $1 || '-w' OR left(roname, length($1) + 3) = $1 || '.db'",
            &[&origin],
        )
        .await
        .map_err(context)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let tx = client.transaction().await.map_err(context)?;
    let mut rows = 0;
    if has_state {
        for table in ["progress", "copy_state"] {
            rows += tx
                .execute(
                    &format!("DELETE FROM pgapply.{table} WHERE slot_name = $1"),
                    &[&slot],
                )
                .await
                .map_err(context)?;
        }
        // (Made by a later migration than the others: perhaps not there.)
        let noted: bool = tx
            .query_one(
                "SELECT pg_catalog.to_regclass('pgapply.slot_tables') IS NOT NULL",
                &[],
            )
            .await
            .map_err(context)?
            .get(0);
        if noted {
            tx.execute(
                "DELETE FROM pgapply.slot_tables WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(context)?;
        }
        // (Keyed by origin name: the slot's and its workers'.)
        rows += tx
            .execute(
                "DELETE FROM pgapply.origin_commit WHERE origin_name = ANY ($1)",
                &[&origins],
            )
            .await
            .map_err(context)?;
    }
    for name in &origins {
        tx.execute("SELECT pg_catalog.pg_replication_origin_drop($1)", &[name])
            .await
            .map_err(|e| {
                Error::postgres(
                    format!("dropping replication origin {name:?} on the target (is a session of a pgapply still using it?)"),
                    e,
                )
            })?;
    }
    tx.commit().await.map_err(context)?;
    if rows == 0 && origins.is_empty() {
        crate::out!("the target holds nothing for slot {slot}");
        // Nothing ties the source's slot of that name to a replication into this target (its
        // state forgotten earlier, or never here): it may be another one's.
        let on_source = match &source_sql {
            Some(src) => src
                .query_opt(
                    "SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .map_err(|e| Error::postgres("reading the source's replication slots", e))?
                .is_some(),
            None => false,
        };
        // (A slot the source lacks too: said below, nothing to drop.)
        if source.is_some() && on_source {
            return Err(Error::definite(format!(
                "not dropping replication slot {slot:?} on the source: this target holds no state for it, so nothing says it is the slot of a replication into this target (it may be another one's). If it is yours, drop it on the source yourself: SELECT pg_drop_replication_slot({})",
                crate::sql::shown_literal(&slot)
            )));
        }
    } else {
        crate::out!(
            "forgot slot {slot} on the target: {rows} row(s) of pgapply's state and {} replication origin(s); its conflict records stay in pgapply.conflicts",
            origins.len()
        );
        if source.is_none() {
            crate::out!(
                "the source's slot {slot}, if it has one, stays and keeps the WAL it has not confirmed: drop it when no longer needed (on the source: SELECT pg_drop_replication_slot({}))",
                crate::sql::shown_literal(&slot)
            );
        }
    }
    if let Some(src) = &source_sql {
        let dropped = src
            .query_opt(
                "SELECT pg_catalog.pg_drop_replication_slot(slot_name) FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(|e| Error::postgres(format!("dropping replication slot {slot:?} on the source (is a pgapply still streaming from it?)"), e))?;
        match dropped {
            Some(_) => crate::out!("dropped replication slot {slot} on the source"),
            None => crate::out!("the source has no replication slot {slot}"),
        }
    }
    settle_prepared(&client, &slot, source_sql.is_some()).await
}

/// The transactions a two-phase slot's worker prepared on the target (`pgapply_<slot>_<xid>`)
/// that are still prepared: their COMMIT or ROLLBACK PREPARED comes from the slot. With the slot
/// gone nothing would ever end them, and their locks would hold up the next run: rolled back
/// (the source's commit of one, if it came, would have reached the target only through that
/// slot). With the slot kept, they are named: its stream still ends them.
async fn settle_prepared(
    client: &tokio_postgres::Client,
    slot: &str,
    slot_dropped: bool,
) -> Result<()> {
    // (Slot names are lower-case letters, digits and underscores: nothing a pattern reads.)
    let gids: Vec<String> = client
        .query(
            "SELECT gid FROM pg_catalog.pg_prepared_xacts \
             WHERE database = current_database() AND gid ~ ('^pgapply_' || $1 || '_[0-9]+$') ORDER BY prepared",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading the target's prepared transactions", e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if gids.is_empty() {
        return Ok(());
    }
    if !slot_dropped {
        crate::out!(
            "the target holds {} transaction(s) prepared for slot {slot} ({}): the slot's stream ends them (COMMIT or ROLLBACK PREPARED) when pgapply runs for it again; if that slot is dropped instead, roll them back on the target (ROLLBACK PREPARED '<gid>'), or their locks hold up whatever writes those rows",
            gids.len(),
            gids.join(", ")
        );
        return Ok(());
    }
    for gid in &gids {
        client
            .batch_execute(&format!(
                "ROLLBACK PREPARED {}",
                crate::sql::quote_literal(gid)
            ))
            .await
            .map_err(|e| {
                Error::postgres(
                    format!("rolling back transaction {gid:?}, prepared on the target for the dropped slot (run it as its owner or a superuser: ROLLBACK PREPARED '{gid}')"),
                    e,
                )
            })?;
    }
    crate::out!(
        "rolled back {} transaction(s) prepared on the target for slot {slot} ({}): with the slot dropped, nothing would have ended them",
        gids.len(),
        gids.join(", ")
    );
    Ok(())
}

/// `forget --drop-slot`: refuses, before anything is removed, to drop a source slot that nothing
/// shows pgapply streamed from into this target: one pgapply cannot use (physical, another
/// plugin, another database), or one this target's state records no position, no copy and no
/// clean stop for (a run given a misspelt --slot that named another tool's slot is refused and
/// leaves a row, and no more).
async fn refuse_a_slot_not_ours(
    target: &tokio_postgres::Client,
    src: &tokio_postgres::Client,
    slot: &str,
    has_state: bool,
) -> Result<()> {
    let found = src
        .query_opt(
            "SELECT slot_type::text, coalesce(plugin::text, ''), coalesce(database::text, ''), \
                    current_database()::text \
             FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading the source's replication slots", e))?;
    let Some(found) = found else {
        return Ok(());
    };
    let (kind, plugin, database, here): (String, String, String, String) =
        (found.get(0), found.get(1), found.get(2), found.get(3));
    let manual = format!(
        "SELECT pg_drop_replication_slot({})",
        crate::sql::shown_literal(slot)
    );
    let foreign = if kind != "logical" {
        Some(format!("a {kind} slot"))
    } else if plugin != "pgoutput" {
        Some(format!("a logical slot of plugin {plugin:?}"))
    } else if database != here {
        // This target's state for the slot names that database: --source points at the
        // wrong one, and the advice below would remove a working mirror's state.
        let recorded: Option<String> = target
            .query_opt(
                "SELECT source_database FROM pgapply.progress WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .ok()
            .flatten()
            .and_then(|r| r.get(0));
        if recorded.as_deref() == Some(database.as_str()) {
            return Err(Error::definite(format!(
                "not dropping replication slot {slot:?}: it belongs to source database {database:?}, which this target's state for it names too, but --source connects to {here:?}. Nothing was removed: give --source with dbname={database} to drop it and remove its state"
            )));
        }
        Some(format!("a slot of database {database:?}, not of {here:?}"))
    } else {
        None
    };
    if let Some(what) = foreign {
        return Err(Error::definite(format!(
            "not dropping replication slot {slot:?} on the source: it is {what}, which pgapply does not stream from here, so it is another replication's. Nothing was removed: run forget without --drop-slot to remove only this target's state for the name; if that slot is to go, drop it on the source yourself ({manual})"
        )));
    }
    // No row for the slot at all: the refusal that follows says the target holds no state.
    let has_row = has_state
        && target
            .query_opt(
                "SELECT 1 FROM pgapply.progress WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .ok()
            .flatten()
            .is_some();
    if !has_row {
        return Ok(());
    }
    // (Each read on its own: a role that may not read origins' progress still has the rest.)
    let holds = |sql: &'static str, name: String| async move {
        target
            .query_one(sql, &[&name])
            .await
            .ok()
            .and_then(|r| r.get::<_, Option<bool>>(0))
            .unwrap_or(false)
    };
    let origin = format!("pgapply_{slot}");
    let used = holds(
        "SELECT EXISTS (SELECT 1 FROM pgapply.progress WHERE slot_name = $1 \
                          AND (lsn IS NOT NULL OR reported_lsn > '0/0' OR state = 'stopped')) \
             OR EXISTS (SELECT 1 FROM pgapply.copy_state WHERE slot_name = $1)",
        slot.to_owned(),
    )
    .await
        || holds(
            "SELECT EXISTS (SELECT 1 FROM pgapply.origin_commit \
                            WHERE origin_name = $1 OR left(origin_name, length($1) + 2) = $1 || '-w')",
            origin.clone(),
        )
        .await
        || holds(
            "SELECT bool_or(pg_catalog.pg_replication_origin_progress(roname, false) IS NOT NULL) \
             FROM pg_catalog.pg_replication_origin \
             WHERE roname = $1 OR left(roname, length($1) + 2) = $1 || '-w'",
            origin,
        )
        .await;
    if !used {
        return Err(Error::definite(format!(
            "not dropping replication slot {slot:?} on the source: this target's state for it records no position applied from it and no initial copy, so nothing says pgapply streamed from it into this target (a run given another replication's slot name leaves such a row). Nothing was removed: run forget without --drop-slot to remove that row; if the slot is pgapply's (made by a run that failed before applying anything), drop it on the source yourself ({manual})"
        )));
    }
    Ok(())
}

/// The slot a command is about: --slot (or PGAPPLY_SLOT), else the config file's.
fn slot_of(given: Option<&String>, file: &FileConfig) -> Result<String> {
    given.or(file.slot.as_ref()).cloned().ok_or_else(|| {
        Error::usage("no slot given: use --slot, PGAPPLY_SLOT or slot in the config file")
    })
}

async fn connect_target(
    servers: &crate::cli::ServersArgs,
    file: &FileConfig,
) -> Result<tokio_postgres::Client> {
    let config = crate::config::resolve_target(servers, file)?;
    crate::tls::connect(&config).await.map_err(|e| {
        e.into_error(format!(
            "connecting to target {}",
            conninfo::describe(&config)
        ))
    })
}

/// The LSN in "--lsn X" of an apply error's hint.
/// The source transaction an apply error is about: the LSN its skip advice gives, else the
/// commit its context names (`applying INSERT on table ... (source transaction 826, commit
/// 0/15691B8): ...`), which errors whose advice is to change the target carry too.
fn named_lsn(error: &str) -> Option<Lsn> {
    let advised = || {
        let rest = error.split("pgapply skip ").nth(1)?;
        let after = rest.split("--lsn ").nth(1)?;
        after.split_whitespace().next()?.parse().ok()
    };
    let in_context = || {
        let after = error.split(", commit ").nth(1)?;
        after.split(')').next()?.trim().parse().ok()
    };
    advised().or_else(in_context)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lsn_an_error_names() {
        assert_eq!(
            named_lsn("insert_exists: ...; or, losing it: to skip this source transaction on purpose, run: pgapply skip --target ... --slot s --lsn 0/1D6A410 (then start pgapply again)"),
            Some(Lsn(0x1D6A410))
        );
        assert_eq!(named_lsn("connection refused"), None);
        assert_eq!(
            named_lsn("applying INSERT on table \"public\".\"t\" (source transaction 826, commit 0/15691B8): value \"3000000000\" is out of range for type integer"),
            Some(Lsn(0x15691B8))
        );
        assert_eq!(
            named_lsn("applying INSERT on table t (source transaction 826, streamed, its commit not received yet): x"),
            None
        );
    }
}
