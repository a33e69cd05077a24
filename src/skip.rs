//! `pgapply skip`: skip one source transaction on purpose, like ALTER SUBSCRIPTION .. SKIP.
//!
//! The transaction is named by its commit LSN, which every apply error prints. The request is
//! stored on the target; the worker reads it when it starts, drops that transaction's changes,
//! records the skip in pgapply.conflicts and clears the request in the same target transaction.

use crate::cli::SkipArgs;
use crate::conninfo;
use crate::error::{Error, Result};
use crate::protocol::Lsn;

pub async fn skip_command(args: &SkipArgs) -> Result<()> {
    let lsn: Lsn = args
        .lsn
        .parse()
        .map_err(|e| Error::usage(format!("--lsn: {e}")))?;
    let config = conninfo::parse("target", &args.target)?;
    let client = crate::tls::connect(&config).await.map_err(|e| {
        e.into_error(format!(
            "connecting to target {}",
            conninfo::describe(&config)
        ))
    })?;
    let updated = client
        .execute(
            "UPDATE pgapply.progress SET skip_lsn = $2::text::pg_lsn WHERE slot_name = $1",
            &[&args.slot, &lsn.to_string()],
        )
        .await
        .map_err(|e| Error::postgres("recording the skip request on the target", e))?;
    if updated == 0 {
        return Err(Error::definite(format!(
            "the target has no pgapply progress for slot {:?}: check --slot (see `pgapply status`)",
            args.slot
        )));
    }
    println!(
        "the source transaction committed at {lsn} will be skipped when pgapply next starts for slot {}; it is recorded in pgapply.conflicts",
        args.slot
    );
    Ok(())
}
