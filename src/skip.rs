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
    let lsn: Lsn = args
        .lsn
        .parse()
        .map_err(|e| Error::usage(format!("--lsn: {e}")))?;
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
            "SELECT greatest(lsn, applied_lsn)::text, skip_lsn::text FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?;
    let applied: Option<String> = row.as_ref().and_then(|r| r.get(0));
    let pending: Option<String> = row.as_ref().and_then(|r| r.get(1));
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
        "the source transaction committed at {lsn} will be skipped when pgapply next starts for slot {slot}; it is recorded in pgapply.conflicts"
    );
    Ok(())
}
