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
    let slot = args
        .slot
        .clone()
        .or_else(|| file.slot.clone())
        .ok_or_else(|| {
            Error::usage("no slot given: use --slot, PGAPPLY_SLOT or slot in the config file")
        })?;
    let config = crate::config::resolve_target(&args.servers, file)?;
    let client = crate::tls::connect(&config).await.map_err(|e| {
        e.into_error(format!(
            "connecting to target {}",
            conninfo::describe(&config)
        ))
    })?;
    // A transaction already applied never comes again: its request would wait for ever.
    let row = client
        .query_opt(
            "SELECT greatest(lsn, applied_lsn)::text, skip_lsn::text, last_error FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?;
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
    // The transaction the last error named: another LSN matches only a transaction committing
    // exactly there, and is most likely a typo.
    let named = last_error.as_deref().and_then(named_lsn);
    if let Some(named) = named.filter(|n| *n != lsn) {
        return Err(Error::definite(format!(
            "the last error of slot {slot:?} names the source transaction committed at {named}, not {lsn}: give --lsn {named} (a request for another LSN would skip nothing until a transaction commits exactly there)"
        )));
    }
    if let Some(applied) = applied.and_then(|a| a.parse::<Lsn>().ok()) {
        if lsn < applied {
            return Err(Error::definite(format!(
                "the source transaction committed at {lsn} is already applied (slot {slot:?} has applied up to {applied}): nothing to skip; check --lsn against the latest error"
            )));
        }
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

/// The LSN in "--lsn X" of an apply error's hint.
fn named_lsn(error: &str) -> Option<Lsn> {
    let rest = error.split("pgapply skip ").nth(1)?;
    let after = rest.split("--lsn ").nth(1)?;
    after.split_whitespace().next()?.parse().ok()
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
    }
}
