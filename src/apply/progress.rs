//! Where the applied position lives on the target, written atomically with the changes.
//!
//! Preferred: a replication origin (`pgapply_<slot>`), as PostgreSQL's own subscriber uses. The
//! apply session binds to it once; each target transaction calls
//! `pg_replication_origin_xact_setup(lsn, time)` and the commit record itself then carries the
//! source position. (Each group also writes the position to the origin's row in
//! `pgapply.origin_commit`, so that an origin an aborted transaction moved can be told apart:
//! `reconcile_origins`.) It also lets the target run with
//! `synchronous_commit = off`: `pg_replication_origin_progress(name, true)` flushes the target's
//! WAL up to the last recorded commit and returns the source position that is now durable, which
//! is exactly what may be reported to the source as flushed.
//!
//! Fallback, for target roles that may not use origins: the row in `pgapply.progress`, updated in
//! the same transaction as the changes, with `synchronous_commit` left on.

use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::protocol::Lsn;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProgressMode {
    Origin { name: String },
    Table,
}

#[derive(Debug, Clone)]
pub struct ProgressStore {
    pub mode: ProgressMode,
    pub slot: String,
}

const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Transaction-local settings that carry a group's end position and commit time from the
/// statement that binds them to the one that sets the origin (`ProgressStore::origin_commit_sql`).
const END_LSN_SETTING: &str = "pgapply.end_lsn";
const COMMIT_TIME_SETTING: &str = "pgapply.commit_time";

/// Between the slot's origin name and a parallel worker's number (slot names can not hold '-').
const WORKER_SUFFIX: &str = "-w";

/// Replication origins (and prepared transactions' names) belong to the whole target cluster,
/// pgapply's tables to one database: two databases of one cluster replicated under the same slot
/// name would share a position, and each would skip what the other applied. So the database
/// that uses a slot name claims it with an origin of its own, `pgapply_<slot>.db<oid>` (never
/// advanced, so it takes no origin state), and another database's claim refuses the run.
async fn claim_slot_name(client: &Client, slot: &str, origin: &str) -> Result<()> {
    let context = |e| {
        Error::postgres(
            "checking which database uses this slot name on the target",
            e,
        )
    };
    // Claim first, then look: of two databases starting together, both see both claims, and
    // the earlier claim wins. (Another process of this database may create the same claim at
    // the same moment: a unique violation is then this claim, made.)
    let created = client
        .execute(
            "SELECT pg_catalog.pg_replication_origin_create(n) \
             FROM (SELECT $1 || '.db' || oid::text AS n FROM pg_catalog.pg_database WHERE datname = current_database()) c \
             WHERE pg_catalog.pg_replication_origin_oid(n) IS NULL",
            &[&origin],
        )
        .await;
    if let Err(e) = created {
        if e.code() != Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
            return Err(context(e));
        }
    }
    let claims = slot_name_claims(client, origin).await.map_err(context)?;
    let mut first: Option<(String, bool, String)> = None;
    let mut mine: Option<String> = None;
    for SlotNameClaim {
        claim,
        database,
        mine: is_mine,
    } in claims
    {
        match database {
            Some(database) => {
                if is_mine {
                    mine = Some(claim.clone());
                }
                if first.is_none() {
                    first = Some((database, is_mine, claim));
                }
            }
            None => {
                // A dropped database's claim (another run may have dropped it already).
                let _ = client
                    .execute(
                        "SELECT pg_catalog.pg_replication_origin_drop($1)",
                        &[&claim],
                    )
                    .await;
            }
        }
    }
    match first {
        Some((database, false, claim)) => {
            // The name is another database's: this one's claim goes.
            if let Some(claim) = mine {
                let _ = client
                    .execute(
                        "SELECT pg_catalog.pg_replication_origin_drop($1)",
                        &[&claim],
                    )
                    .await;
            }
            Err(Error::definite(format!(
                "slot name {slot:?} is already used by pgapply in database {database:?} of this target cluster: the position is kept in replication origins, which all databases of a cluster share, so give this run another --slot (and make that slot on the source). If nothing replicates into {database:?} under this name any more, remove its state there: pgapply forget --target <that server, dbname={database}> --slot {slot} (or, for a database dropped since, SELECT pg_replication_origin_drop({}))",
                crate::sql::quote_literal(&claim)
            )))
        }
        _ => Ok(()),
    }
}

/// A database's claim on a slot name (`claim_slot_name`).
pub struct SlotNameClaim {
    /// The claim's origin, `pgapply_<slot>.db<oid>`.
    pub claim: String,
    /// None: the database was dropped since.
    pub database: Option<String>,
    /// The claim of the database this session is connected to.
    pub mine: bool,
}

/// The claims on the slot whose origin is `origin`, earliest first.
pub async fn slot_name_claims(
    client: &Client,
    origin: &str,
) -> Result<Vec<SlotNameClaim>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT c.roname::text, d.datname::text, coalesce(d.datname = current_database(), false) \
             FROM pg_catalog.pg_replication_origin c \
             LEFT JOIN pg_catalog.pg_database d ON 'db' || d.oid::text = substr(c.roname, length($1) + 2) \
             WHERE left(c.roname, length($1) + 3) = $1 || '.db' \
             ORDER BY c.roident",
            &[&origin],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| SlotNameClaim {
            claim: r.get(0),
            database: r.get(1),
            mine: r.get(2),
        })
        .collect())
}

/// A slot without a row in pgapply.progress has applied nothing here (every run writes the row
/// before it applies anything): positions left under its name (its row deleted to start over,
/// after the slot name was pointed at another source, say) belong to something else, and would
/// make the run skip the new source's transactions below them.
async fn forget_positions(client: &Client, mode: &ProgressMode, origin: &str) -> Result<()> {
    let context = |e| Error::postgres("clearing old positions of this slot on the target", e);
    let mine = "origin_name = $1 OR left(origin_name, length($1) + 2) = $1 || '-w'";
    // Read first: a role that may not use origins may not be allowed to delete either, and
    // there is usually nothing to delete.
    let rows: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM pgapply.origin_commit WHERE {mine}"),
            &[&origin],
        )
        .await
        .map_err(context)?
        .get(0);
    if rows > 0 {
        client
            .execute(
                &format!("DELETE FROM pgapply.origin_commit WHERE {mine}"),
                &[&origin],
            )
            .await
            .map_err(context)?;
    }
    let mut origins = 0;
    if let ProgressMode::Origin { .. } = mode {
        // Moved back to nothing (the function may move an origin backwards).
        origins = client
            .query(
                "SELECT pg_catalog.pg_replication_origin_advance(roname, '0/0') \
                 FROM pg_catalog.pg_replication_origin \
                 WHERE (roname = $1 OR left(roname, length($1) + 2) = $1 || '-w') \
                   AND pg_catalog.pg_replication_origin_progress(roname, false) IS NOT NULL",
                &[&origin],
            )
            .await
            .map_err(context)?
            .len();
    }
    if rows > 0 || origins > 0 {
        tracing::info!(
            origin,
            "no progress is recorded on the target for this slot: positions an earlier run left in its replication origins were cleared"
        );
    }
    Ok(())
}

/// The latest position that the slot's origin and its parallel workers' origins recorded in
/// their rows of pgapply.origin_commit, each written inside the transaction it describes.
async fn origin_rows_position(client: &Client, origin: &str) -> Result<Lsn> {
    // ORDER BY: max(pg_lsn) is PostgreSQL 13+. (By the qualified column: a bare name would be
    // the output column, the text, and '0/C0' would come after '0/10000000'.)
    let row = client
        .query_opt(
            "SELECT w.end_lsn::text FROM pgapply.origin_commit w \
             WHERE w.origin_name = $1 OR left(w.origin_name, length($1) + 2) = $1 || '-w' \
             ORDER BY w.end_lsn DESC LIMIT 1",
            &[&origin],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.origin_commit on the target", e))?;
    match row {
        Some(row) => parse_lsn(row.get(0)),
        None => Ok(Lsn::INVALID),
    }
}

/// Why `--apply-workers` above 1 is refused for a role without origin rights (`run` and `check`).
pub const WORKERS_NEED_ORIGINS: &str = "--apply-workers above 1 records progress in replication origins, but the target role may not use them: use --apply-workers 1, or apply as a role that may (a superuser, or one granted EXECUTE on the pg_replication_origin_* functions in the target database)";

impl ProgressStore {
    /// Chooses the mode, checks the recorded source identity, and returns the resume position
    /// (`0/0` when nothing was applied yet).
    pub async fn open(client: &Client, slot: &str, source_system_id: &str) -> Result<(Self, Lsn)> {
        let origin = format!("pgapply_{slot}");
        let mode = match ensure_origin(client, &origin).await {
            Ok(()) => ProgressMode::Origin {
                name: origin.clone(),
            },
            Err(e) if e.code().is_some_and(|c| c.code() == INSUFFICIENT_PRIVILEGE) => {
                // (Said once a process, not at every retry.)
                static SAID: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                    "the target role may not use replication origins; recording progress in pgapply.progress instead (synchronous_commit stays on). The changes applied here carry no origin, so a stream from this database back to the source (a reverse or two-way set-up) cannot leave them out with --origin none, and would send them back: for that, use a target role that may use replication origins (a superuser, or one granted EXECUTE on the pg_replication_origin_* functions in the target database)"
                    );
                }
                ProgressMode::Table
            }
            Err(e) => {
                return Err(Error::postgres(
                    "setting up replication origin on the target",
                    e,
                ))
            }
        };
        if let ProgressMode::Origin { name } = &mode {
            claim_slot_name(client, slot, name).await?;
        }
        let store = ProgressStore {
            mode,
            slot: slot.to_owned(),
        };
        let context = |e| Error::postgres("reading pgapply.progress on the target", e);
        // The row and the clearing of old positions commit together: a run stopped in between
        // (killed, or an origin still held by a dying session) leaves no row, and the next run
        // clears them again.
        client.batch_execute("BEGIN").await.map_err(context)?;
        let created = async {
            let new_row = client
                .execute(
                    // (A new slot's row says "starting" until the run's first status update.)
                    "INSERT INTO pgapply.progress (slot_name, source_system_id, state, pid, heartbeat_at) \
                     VALUES ($1, $2, 'starting', $3, now()) ON CONFLICT (slot_name) DO NOTHING",
                    &[&slot, &source_system_id, &(std::process::id() as i32)],
                )
                .await
                .map_err(context)?
                == 1;
            if new_row {
                forget_positions(client, &store.mode, &origin).await?;
            }
            client.batch_execute("COMMIT").await.map_err(context)
        }
        .await;
        if let Err(e) = created {
            let _ = client.batch_execute("ROLLBACK").await;
            return Err(e);
        }
        let row = client
            .query_one(
                "SELECT source_system_id, lsn::text, \
                        state IN ('streaming', 'copying') AND heartbeat_at > now() - interval '30 seconds' \
                 FROM pgapply.progress WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(context)?;
        let recorded_system: Option<String> = row.get(0);
        let alive = row.get::<_, Option<bool>>(2).unwrap_or(false);
        match recorded_system.as_deref() {
            Some(id) if id != source_system_id && alive => {
                return Err(Error::definite(format!(
                    "slot name {slot:?} is in use on this target by a running worker of another source (system identifier {id}; this source is {source_system_id}): each source needs its own slot name here, give this one another --slot"
                )))
            }
            Some(id) if id != source_system_id => {
                return Err(Error::definite(format!(
                    "the target holds progress for slot {slot:?} from another source (system identifier {id}, this source is {source_system_id}): give this source another --slot; only if that other source's worker is gone for good and the target should start over for this one, forget that state on the target (pgapply forget --target ... --slot {slot}, without --drop-slot), then start again"
                )))
            }
            Some(_) => {}
            None => {
                client
                    .execute(
                        "UPDATE pgapply.progress SET source_system_id = $2 WHERE slot_name = $1",
                        &[&slot, &source_system_id],
                    )
                    .await
                    .map_err(context)?;
            }
        }
        let table_lsn = parse_lsn(row.get(1))?;
        // Take the later of both stores: a run in the other mode may have moved one of them.
        // In origin mode the origin is the authority: not being able to read it is an error, not
        // a reason to start from the (older) table position and apply things twice.
        let origin_lsn = match &store.mode {
            ProgressMode::Origin { name } => {
                reconcile_origins(client, name).await?;
                store.durable_position(client).await?
            }
            // Without origin rights now, perhaps not before: what a run in origin mode applied
            // is in its rows of pgapply.origin_commit (an ordinary table), not in the progress
            // row, and starting from the progress row would apply it again.
            ProgressMode::Table => origin_rows_position(client, &origin).await?,
        };
        Ok((store, table_lsn.max(origin_lsn)))
    }

    /// The store of parallel apply worker `index` (`--apply-workers`): the first worker uses the
    /// slot's origin, the others `pgapply_<slot>-w<index>`, created here. Table mode can not be
    /// shared by several connections (see `apply::parallel`).
    pub async fn for_worker(&self, client: &Client, index: usize) -> Result<ProgressStore> {
        let ProgressMode::Origin { name } = &self.mode else {
            return Err(Error::definite(WORKERS_NEED_ORIGINS));
        };
        if index == 0 {
            return Ok(self.clone());
        }
        let name = format!("{name}{WORKER_SUFFIX}{index}");
        ensure_origin(client, &name).await.map_err(|e| {
            Error::postgres(
                format!("creating replication origin {name:?} on the target"),
                e,
            )
        })?;
        Ok(ProgressStore {
            mode: ProgressMode::Origin { name },
            slot: self.slot.clone(),
        })
    }

    /// Folds the origins of parallel workers this run does not use (an earlier run had more)
    /// into the slot's origin: it is moved up to `resume` (the latest of all), then they are
    /// dropped, so no position hides in an origin nobody uses.
    pub async fn retire_unused_workers(
        &self,
        client: &Client,
        workers: usize,
        resume: Lsn,
    ) -> Result<()> {
        let ProgressMode::Origin { name } = &self.mode else {
            return Ok(());
        };
        let context = |e| {
            Error::postgres(
                "retiring replication origins of former parallel workers on the target",
                e,
            )
        };
        let rows = client
            .query(
                "SELECT roname::text FROM pg_catalog.pg_replication_origin \
                 WHERE left(roname, length($1) + 2) = $1 || '-w'",
                &[name],
            )
            .await
            .map_err(context)?;
        let prefix = format!("{name}{WORKER_SUFFIX}");
        let unused: Vec<String> = rows
            .into_iter()
            .map(|r| r.get::<_, String>(0))
            .filter(|o| {
                o.strip_prefix(&prefix)
                    .and_then(|i| i.parse::<usize>().ok())
                    .is_none_or(|i| i >= workers)
            })
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        // The main origin takes the latest position of all (ORDER BY: max(pg_lsn) is 13+; by the
        // qualified column, not the text of the output), read now rather than taken from
        // `resume`: a backend of a killed run may have committed on one of these since `resume`
        // was read (the resume check after binding then sees the main origin moved and starts
        // over from there). One still bound to such a backend cannot be dropped: an error, and a
        // retry. An origin ahead of its row counts only up to the row: the rest is an abort's
        // (one that landed after the start's `reconcile_origins`).
        let latest: Option<String> = client
            .query_one(
                "SELECT f::text FROM ( \
                   SELECT CASE WHEN w.end_lsn < x.p THEN w.end_lsn ELSE x.p END AS f \
                   FROM (SELECT o, pg_catalog.pg_replication_origin_progress(o, false) AS p FROM unnest($1::text[]) o) x \
                   LEFT JOIN pgapply.origin_commit w ON w.origin_name = x.o \
                   UNION ALL SELECT $2::text::pg_lsn WHERE $3) fs \
                 ORDER BY fs.f DESC NULLS LAST LIMIT 1",
                &[&unused, &resume.to_string(), &resume.is_valid()],
            )
            .await
            .map_err(context)?
            .get(0);
        if let Some(latest) = latest {
            // The main origin's row first, then the origin (see `set_position`).
            client
                .execute(
                    "UPDATE pgapply.origin_commit SET end_lsn = greatest(end_lsn, $2::text::pg_lsn) WHERE origin_name = $1",
                    &[name, &latest],
                )
                .await
                .map_err(context)?;
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_advance($1, $2::text::pg_lsn) \
                     WHERE coalesce(pg_catalog.pg_replication_origin_progress($1, false), '0/0') < $2::text::pg_lsn",
                    &[name, &latest],
                )
                .await
                .map_err(context)?;
        }
        for origin in unused {
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_drop($1)",
                    &[&origin],
                )
                .await
                .map_err(context)?;
            // (Its commit-order row goes with it: nothing waits on a worker that is gone.)
            client
                .execute(
                    "DELETE FROM pgapply.origin_commit WHERE origin_name = $1",
                    &[&origin],
                )
                .await
                .map_err(context)?;
            tracing::info!(origin = %origin, "dropped the replication origin of a former parallel worker");
        }
        Ok(())
    }

    /// The name of the origin this store records progress in (origin mode).
    pub fn origin_name(&self) -> Option<&str> {
        match &self.mode {
            ProgressMode::Origin { name } => Some(name),
            ProgressMode::Table => None,
        }
    }

    /// Binds the apply session to the origin and relaxes commit durability, which
    /// `durable_position` makes up for. Table mode keeps synchronous commits.
    pub async fn setup_session(&self, client: &Client) -> Result<()> {
        if let ProgressMode::Origin { name } = &self.mode {
            bind_origin(client, name).await?;
            client
                .batch_execute("SET synchronous_commit = off")
                .await
                .map_err(|e| Error::postgres("configuring the apply session", e))?;
        } else {
            // Committed must mean durable here, whatever the target's default says.
            client
                .batch_execute("SET synchronous_commit = on")
                .await
                .map_err(|e| Error::postgres("configuring the apply session", e))?;
        }
        Ok(())
    }

    /// Whether `e` is `check_resume`'s: the run must start again (nothing else helps).
    pub fn is_resume_moved(e: &Error) -> bool {
        e.message().contains(RESUME_MOVED)
    }

    /// After `setup_session`: fails (transiently) if the session's origin moved past `resume`,
    /// the position this run starts from. A previous run's session can still be finishing a
    /// commit it had sent when its run failed; had it landed after `resume` was read, the run
    /// would apply that transaction a second time. Binding the origin waits for that session to
    /// let go of it, so reading it now is final.
    pub async fn check_resume(&self, client: &Client, resume: Lsn) -> Result<()> {
        let ProgressMode::Origin { name } = &self.mode else {
            return self.check_resume_in_table(client, resume).await;
        };
        let row = client
            .query_one(
                "SELECT coalesce(pg_catalog.pg_replication_origin_progress($1, false), '0/0')::text",
                &[name],
            )
            .await
            .map_err(|e| Error::postgres(format!("reading replication origin {name:?}"), e))?;
        let now = parse_lsn(row.get(0))?;
        if now > resume {
            return Err(Error::transient(format!(
                "replication origin {name:?} moved from {resume} to {now} while this run started ({RESUME_MOVED}): starting again from there"
            )));
        }
        Ok(())
    }

    /// `check_resume` for progress kept in `pgapply.progress`. No origin tells whether a previous
    /// session is still finishing: each apply session holds a session-level advisory lock of the
    /// slot for its life, so taking it waits for the previous one to end, and the position read
    /// after that is final.
    async fn check_resume_in_table(&self, client: &Client, resume: Lsn) -> Result<()> {
        let context = |e| Error::postgres("taking the apply session's lock on the target", e);
        let key = "('x' || left(md5('pgapply progress ' || $1), 16))::bit(64)::bigint";
        let started = std::time::Instant::now();
        let deadline = started + std::time::Duration::from_secs(60);
        let mut said = false;
        loop {
            let row = client
                .query_one(
                    &format!("SELECT pg_catalog.pg_try_advisory_lock({key})"),
                    &[&self.slot],
                )
                .await
                .map_err(context)?;
            if row.get::<_, bool>(0) {
                break;
            }
            if !said && started.elapsed() >= std::time::Duration::from_secs(2) {
                said = true;
                // (A bigint advisory lock is classid = high half, objid = low half, objsubid 1.)
                let holder: Option<i32> = client
                    .query_opt(
                        &format!(
                            "SELECT l.pid FROM pg_catalog.pg_locks l, (SELECT {key} AS k) x \
                             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
                               AND l.classid::bigint = (x.k >> 32) & 4294967295 AND l.objid::bigint = x.k & 4294967295 LIMIT 1"
                        ),
                        &[&self.slot],
                    )
                    .await
                    .ok()
                    .flatten()
                    .map(|r| r.get(0));
                let who = holder.map_or_else(String::new, |p| format!(" (process {p})"));
                tracing::warn!(
                    slot = %self.slot,
                    "another target session{who} holds this slot's apply lock: a previous run finishing what it was sent, or a second pgapply on the same slot (then stop one of them); waiting up to 60 s for it to end"
                );
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::transient(format!(
                    "another session still applies for slot {:?} on the target (a previous run's, finishing what it was sent, or a second pgapply on the same slot): it must end first",
                    self.slot
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let row = client
            .query_one(
                "SELECT lsn::text FROM pgapply.progress WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?;
        let now = parse_lsn(row.get(0))?;
        if now > resume {
            return Err(Error::transient(format!(
                "the position in pgapply.progress moved from {resume} to {now} while this run started ({RESUME_MOVED}): starting again from there"
            )));
        }
        Ok(())
    }

    /// The commit LSN of a transaction to skip on purpose (`pgapply skip`), if one is set.
    pub async fn skip_lsn(&self, client: &Client) -> Result<Option<Lsn>> {
        let row = client
            .query_one(
                "SELECT skip_lsn::text FROM pgapply.progress WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?;
        let lsn = parse_lsn(row.get(0))?;
        Ok(lsn.is_valid().then_some(lsn))
    }

    /// Before an initial copy: binds `client`'s session to the origin, as the apply session will
    /// (the target has a free origin state), so that a shortage is not found out only after
    /// hours of copying. `release_origin` ends it.
    pub async fn probe_origin(&self, client: &Client) -> Result<()> {
        if let ProgressMode::Origin { name } = &self.mode {
            bind_origin(client, name).await?;
        }
        Ok(())
    }

    /// Ends what `probe_origin` began.
    pub async fn release_origin(&self, client: &Client) -> Result<()> {
        if let ProgressMode::Origin { .. } = &self.mode {
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_session_reset()",
                    &[],
                )
                .await
                .map_err(|e| {
                    Error::postgres("releasing the replication origin on the target", e)
                })?;
        }
        Ok(())
    }

    /// Sets the position outside any apply transaction (after an initial copy).
    pub async fn set_position(&self, client: &Client, lsn: Lsn) -> Result<()> {
        let text = lsn.to_string();
        if let ProgressMode::Origin { name } = &self.mode {
            // Their rows first, or the next start would take the origins' move for an abort's
            // (stopped in between, the origins stay behind their rows: nothing is moved back).
            client
                .execute(
                    "UPDATE pgapply.origin_commit SET end_lsn = $2::text::pg_lsn \
                     WHERE origin_name = $1 OR left(origin_name, length($1) + 2) = $1 || '-w'",
                    &[name, &text],
                )
                .await
                .map_err(|e| Error::postgres("recording the copy's position on the target", e))?;
            // Parallel workers' origins too: the position is the latest of them.
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_advance(roname, $2::text::pg_lsn) \
                     FROM pg_catalog.pg_replication_origin \
                     WHERE roname = $1 OR left(roname, length($1) + 2) = $1 || '-w'",
                    &[name, &text],
                )
                .await
                .map_err(|e| Error::postgres("recording the copy's position on the target", e))?;
        }
        client
            .execute(
                "UPDATE pgapply.progress SET lsn = $2::text::pg_lsn, updated_at = now() WHERE slot_name = $1",
                &[&self.slot, &text],
            )
            .await
            .map_err(|e| Error::postgres("recording the copy's position on the target", e))?;
        Ok(())
    }

    /// For an apply session bound to its origin: the origin's row in `pgapply.origin_commit`
    /// starts where the origin is, written by each commit from now on (`keep`), or is removed
    /// where this session will not keep it (prepared transactions: a PREPARE moves the origin,
    /// the row moves only at COMMIT PREPARED).
    pub async fn start_commit_row(&self, client: &Client, keep: bool) -> Result<()> {
        let ProgressMode::Origin { name } = &self.mode else {
            return Ok(());
        };
        let sql = if keep {
            "INSERT INTO pgapply.origin_commit (origin_name, end_lsn) \
             VALUES ($1, coalesce(pg_catalog.pg_replication_origin_progress($1, false), '0/0')) \
             ON CONFLICT (origin_name) DO UPDATE SET end_lsn = EXCLUDED.end_lsn"
        } else {
            "DELETE FROM pgapply.origin_commit WHERE origin_name = $1"
        };
        client.execute(sql, &[name]).await.map_err(|e| {
            Error::postgres("setting up the apply session's position on the target", e)
        })?;
        Ok(())
    }

    pub fn is_table_mode(&self) -> bool {
        self.mode == ProgressMode::Table
    }

    /// The statement that records `($1 lsn, $2 commit time)` inside the current transaction.
    /// In origin mode it only notes them in the transaction (`origin_commit_sql` sets the
    /// origin position from them in the same message as the COMMIT), and with `commit_row` it
    /// also writes the position to the origin's row of `pgapply.origin_commit` (`$3` is the
    /// origin's name): an aborted transaction leaves that row as it was, where PostgreSQL 16+
    /// moves the origin (see `reconcile_origins`).
    pub fn record_sql(&self, commit_row: bool) -> String {
        match &self.mode {
            ProgressMode::Origin { .. } if commit_row => format!(
                "WITH w AS (UPDATE pgapply.origin_commit SET end_lsn = $1::text::pg_lsn WHERE origin_name = $3) \
                 SELECT pg_catalog.set_config('{END_LSN_SETTING}', $1, true), pg_catalog.set_config('{COMMIT_TIME_SETTING}', $2, true)"
            ),
            ProgressMode::Origin { .. } => format!(
                "SELECT pg_catalog.set_config('{END_LSN_SETTING}', $1, true), pg_catalog.set_config('{COMMIT_TIME_SETTING}', $2, true)"
            ),
            ProgressMode::Table => format!(
                "UPDATE pgapply.progress SET lsn = $1::pg_lsn, commit_time = $2::timestamptz, updated_at = now() WHERE slot_name = {}",
                crate::sql::quote_literal(&self.slot)
            ),
        }
    }

    /// Origin mode: the simple query that sets the origin position noted by `record_sql` and
    /// then ends the transaction with `finish` (COMMIT, PREPARE TRANSACTION ..). PostgreSQL 16+
    /// moves a session's origin to the position set when its transaction aborts, as when it
    /// commits: set in a statement of its own, a connection lost before the COMMIT arrived would
    /// leave the origin past a transaction that never committed, and the next run would skip
    /// it. The server reads a whole message before running any of it, so the two arrive together
    /// or not at all. (No values in the text: they were bound in `record_sql`.)
    pub fn origin_commit_sql(finish: &str) -> String {
        // txid_current() makes sure the transaction has an id, so COMMIT writes a commit record
        // carrying the position even when every change of the group found no row.
        format!(
            "SELECT pg_catalog.pg_replication_origin_xact_setup(pg_catalog.current_setting('{END_LSN_SETTING}')::pg_lsn, pg_catalog.current_setting('{COMMIT_TIME_SETTING}')::timestamptz), pg_catalog.txid_current(); {finish}"
        )
    }

    /// The source position whose changes are durable on the target. In origin mode this flushes
    /// the target's WAL up to the last recorded commit first.
    pub async fn durable_position(&self, client: &Client) -> Result<Lsn> {
        let row = match &self.mode {
            // With parallel workers (`apply::parallel`) each has its own origin and they commit
            // in source order: the latest of them is the position, everything before it is
            // committed. Flushing each flushes the WAL of all earlier commits too. (Ordered by
            // `s.p`, the pg_lsn: a bare `p` is the output column, whose text sorts wrongly.)
            ProgressMode::Origin { name } => {
                client
                    .query_one(
                        "SELECT p::text FROM ( \
                           SELECT pg_catalog.pg_replication_origin_progress(roname, true) AS p \
                           FROM pg_catalog.pg_replication_origin \
                           WHERE roname = $1 OR left(roname, length($1) + 2) = $1 || '-w') s \
                         ORDER BY s.p DESC NULLS LAST LIMIT 1",
                        &[name],
                    )
                    .await
            }
            ProgressMode::Table => {
                client
                    .query_one(
                        "SELECT lsn::text FROM pgapply.progress WHERE slot_name = $1",
                        &[&self.slot],
                    )
                    .await
            }
        }
        .map_err(|e| Error::postgres("reading the applied position on the target", e))?;
        parse_lsn(row.get(0))
    }
}

/// Apply sessions write their position to `pgapply.origin_commit` in the transaction whose commit
/// also moves their origin (`ProgressStore::record_sql`). An origin ahead of its row was moved by
/// a transaction that aborted (PostgreSQL 16+ moves an origin on abort too, and the session that
/// failed may have been stopped before it could move it back): it goes back to the row's
/// position, or the run would skip that transaction. Origins bound to a running session can not
/// be moved (an error, retried): those are another process's, not left behind.
async fn reconcile_origins(client: &Client, name: &str) -> Result<()> {
    let context = |e| Error::postgres("checking the replication origins on the target", e);
    // Before 16 an abort moves no origin: one ahead of its row has some other cause (a pgapply
    // older than the rows, a move by hand), and moving it back would apply things twice.
    let version = crate::sql::server_version(client).await.map_err(context)?;
    if version < 160000 {
        return Ok(());
    }
    let mine = "origin_name = $1 OR left(origin_name, length($1) + 2) = $1 || '-w'";
    // Rows of origins that are gone (dropped by hand, say) mean nothing.
    client
        .execute(
            &format!(
                "DELETE FROM pgapply.origin_commit WHERE ({mine}) AND pg_catalog.pg_replication_origin_oid(origin_name) IS NULL"
            ),
            &[&name],
        )
        .await
        .map_err(context)?;
    // The origins first, the rows after (a later snapshot): a commit in between shows in the
    // row, so it is not taken for an abort.
    let origins = client
        .query(
            "SELECT roname::text, pg_catalog.pg_replication_origin_progress(roname, false)::text \
             FROM pg_catalog.pg_replication_origin \
             WHERE roname = $1 OR left(roname, length($1) + 2) = $1 || '-w'",
            &[&name],
        )
        .await
        .map_err(context)?;
    for origin in origins {
        let (origin, progress): (String, Option<String>) = (origin.get(0), origin.get(1));
        let Some(progress) = progress else { continue };
        let row = client
            .query_opt(
                // FOR SHARE waits for a commit that has moved the origin and is not visible
                // yet (a previous run's session ending), then reads its row.
                "SELECT end_lsn::text FROM pgapply.origin_commit \
                 WHERE origin_name = $1 AND end_lsn < $2::text::pg_lsn FOR SHARE",
                &[&origin, &progress],
            )
            .await
            .map_err(context)?;
        let Some(row) = row else { continue };
        let to: String = row.get(0);
        client
            .execute(
                "SELECT pg_catalog.pg_replication_origin_advance($1, $2::text::pg_lsn)",
                &[&origin, &to],
            )
            .await
            .map_err(|e| {
                Error::postgres(
                    format!("moving replication origin {origin:?} back to {to}, where it last committed (is a session of the previous run still there?)"),
                    e,
                )
            })?;
        tracing::warn!(origin = %origin, from = %progress, to = %to, "moved a replication origin back to its last commit: a transaction that failed to commit had moved it");
    }
    Ok(())
}

/// Binds `client`'s session to replication origin `name`. Held by a session this process left
/// from an earlier attempt (still waiting on the server), that session is ended first.
async fn bind_origin(client: &Client, name: &str) -> Result<()> {
    let setup = || async {
        client
            .execute(
                "SELECT pg_catalog.pg_replication_origin_session_setup($1)",
                &[&name],
            )
            .await
    };
    let Err(mut e) = setup().await else {
        return Ok(());
    };
    if let Some(pid) = e.as_db_error().and_then(|d| origin_holder(d.message())) {
        if crate::apply::sessions::end_own_earlier_session(client, pid as i32).await {
            match setup().await {
                Ok(_) => return Ok(()),
                Err(again) => e = again,
            }
        }
    }
    let why = match e.code().map(|c| c.code()) {
        Some("53400") => "the target has no free replication origin state: raise max_active_replication_origins (PostgreSQL 18+) or max_replication_slots (before 18) on the target, or free the origins of slots no longer replicated into this target cluster: `pgapply forget --target ... --slot <slot>` in the database each was replicated into (SELECT roname FROM pg_replication_origin lists them; dropping one of a slot still in use makes its changes apply again)".to_owned(),
        _ => match e.as_db_error().and_then(|d| origin_holder(d.message())) {
            Some(pid) => holder_described(client, name, pid).await,
            None => "is another pgapply running for this slot, or hung? The PID below is its session on the target".to_owned(),
        },
    };
    Err(Error::postgres(
        format!("binding the apply session to replication origin {name:?} ({why})"),
        e,
    ))
}

/// The target process holding a replication origin, from PostgreSQL's error ("... is already
/// active for PID 123", "... in use by PID 123").
pub fn origin_holder(text: &str) -> Option<u32> {
    let rest = text
        .split("is already active for PID ")
        .nth(1)
        .or_else(|| text.split("in use by PID ").nth(1))?;
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// What the session holding an origin is doing. Waiting for a user's lock: that lock's holder is
/// named, as the session goes on (or, left by a stopped pgapply, goes away) only once it is
/// released. Otherwise most likely another pgapply running for the slot (its heartbeat in
/// pgapply.progress is fresh), or one that hung.
async fn holder_described(client: &Client, origin: &str, pid: u32) -> String {
    let running: Option<i32> = client
        .query_opt(
            "SELECT pid FROM pgapply.progress \
             WHERE pid IS NOT NULL AND pid <> $2 AND heartbeat_at > now() - interval '30 seconds' \
               AND coalesce(state, '') NOT IN ('stopped', 'failed') \
               AND ($1 = 'pgapply_' || slot_name OR left($1, length(slot_name) + 10) = 'pgapply_' || slot_name || '-w') \
             LIMIT 1",
            &[&origin, &(std::process::id() as i32)],
        )
        .await
        .ok()
        .flatten()
        .map(|r| r.get(0));
    let row = client
        .query_opt(
            "SELECT coalesce(application_name, ''), coalesce(wait_event_type, ''), coalesce(wait_event, ''), \
                    pg_catalog.array_to_string(pg_catalog.pg_blocking_pids(pid), ', ') \
             FROM pg_catalog.pg_stat_activity WHERE pid = $1",
            &[&(pid as i32)],
        )
        .await
        .ok()
        .flatten();
    let end = format!("SELECT pg_terminate_backend({pid})");
    let other = running.map_or_else(String::new, |p| {
        format!(" (pgapply.progress shows pgapply process {p} running for this slot in the last 30 s: if it still runs, it is that one's)")
    });
    match row {
        // (Not pgapply's own advisory locks: parallel workers wait on those for each other.)
        Some(r) if r.get::<_, String>(1) == "Lock" && r.get::<_, String>(2) != "advisory" => format!(
            "it is held by target session {pid}, which waits for a lock held by target process(es) {}{other}; left by a pgapply process that was stopped while it waited, it goes away when that lock is released, or end it now ({end}); pgapply tries again meanwhile",
            r.get::<_, String>(3)
        ),
        Some(_) if running.is_some() => format!(
            "another pgapply{other} holds it through target session {pid}: stop that process first, or give this one another --slot"
        ),
        Some(r) => format!(
            "it is held by target session {pid} (application {:?}): another pgapply running for this slot, or one that hung; stop that process, or end the session ({end})",
            r.get::<_, String>(0)
        ),
        None => format!(
            "it is held by target process {pid}, which has just ended or is not visible to this role: pgapply tries again"
        ),
    }
}

async fn ensure_origin(client: &Client, name: &str) -> Result<(), tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT pg_catalog.pg_replication_origin_oid($1) IS NOT NULL",
            &[&name],
        )
        .await?;
    if !row.get::<_, bool>(0) {
        let created = client
            .execute(
                "SELECT pg_catalog.pg_replication_origin_create($1)",
                &[&name],
            )
            .await;
        match created {
            // Another process of the slot made it in between (two started at once): there now.
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {}
            other => {
                other?;
            }
        }
    }
    Ok(())
}

/// Marks `check_resume`'s error.
const RESUME_MOVED: &str = "a commit of the previous run landed late";

fn parse_lsn(text: Option<String>) -> Result<Lsn> {
    match text {
        None => Ok(Lsn::INVALID),
        Some(t) => t
            .parse()
            .map_err(|e| Error::definite(format!("the target holds an unreadable position: {e}"))),
    }
}
