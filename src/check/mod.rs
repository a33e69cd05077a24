//! `pgapply check`: validates the settings and both servers before anything runs, and lists every
//! problem found (not just the first), each naming the object and what to do.

use tokio_postgres::Client;

use crate::cli::CheckArgs;
use crate::config::{self, FileConfig};
use crate::conninfo;
use crate::error::{describe_postgres, Error, Result};

mod source;
pub(crate) use source::{full_roots_over_keyed_partitions, operations_left_out};
mod target;

use source::check_source;
use target::{check_apply_session, check_target, with_target_columns};
pub(crate) use target::{compatible, converted_using, narrower};

/// What the checks found: printed a line each as they go, or, for `--json`, kept and printed
/// as one object at the end.
#[derive(Default)]
struct Report {
    json: bool,
    ok: Vec<String>,
    warnings: Vec<String>,
    problems: Vec<String>,
}

impl Report {
    fn ok(&mut self, text: impl Into<String>) {
        let text = text.into();
        if self.json {
            self.ok.push(text);
        } else {
            crate::out!("ok       {text}");
        }
    }
    fn problem(&mut self, text: impl Into<String>) {
        let text = text.into();
        if !self.json {
            crate::out!("PROBLEM  {text}");
        }
        self.problems.push(text);
    }
    /// Works, but may fail or change values later: said, not counted as a problem.
    fn warning(&mut self, text: impl Into<String>) {
        let text = text.into();
        if self.json {
            self.warnings.push(text);
        } else {
            crate::out!("WARNING  {text}");
        }
    }
}

/// Why `run` could not make its spool directory (`--spool-dir`, else the default), if it
/// could not: the nearest existing directory on the way must be one this user may write in.
/// (Not made here: `check` changes nothing.)
fn spool_dir_problem(dir: Option<&std::path::Path>) -> Option<String> {
    let dir = dir?;
    let mut existing = dir;
    while std::fs::symlink_metadata(existing).is_err() {
        existing = existing.parent()?;
    }
    let said = |why: &str| {
        format!(
            "--spool-dir {}: {why} (it holds spooled transactions: point it at a directory this user may create and write)",
            dir.display()
        )
    };
    if !existing.is_dir() {
        return Some(said(&format!("{} is not a directory", existing.display())));
    }
    // A directory made and removed at once (in the spool directory itself if it is there):
    // permissions alone do not tell (root may write anywhere, but not in /proc).
    let probe = existing.join(format!(".pgapply-check-{}", std::process::id()));
    match std::fs::create_dir(&probe) {
        Ok(()) => {
            let _ = std::fs::remove_dir(&probe);
            None
        }
        Err(e) => Some(said(&format!(
            "cannot create a directory in {}: {e}",
            existing.display()
        ))),
    }
}

pub async fn check_command(args: &CheckArgs, file: &FileConfig) -> Result<()> {
    let mut report = Report {
        json: args.json,
        ..Report::default()
    };
    let args = &args.run;
    let (config, service) =
        match config::resolve(args, file).and_then(|c| config::check_run_only(&c.0).map(|()| c)) {
            Ok(c) => c,
            Err(e) => {
                report.problem(e.to_string());
                return finish(report);
            }
        };
    // Where `run` would listen: tried, and let go at once. (In use may be this slot's own
    // running worker: said, not counted as a problem.)
    if let Some(addr) = &service.metrics_addr {
        let bound = crate::metrics::listen_address(addr);
        if let Err(e) = tokio::net::lookup_host(&bound).await {
            report.problem(format!(
                "--metrics-addr {addr}: {e}; give HOST:PORT, for example 127.0.0.1:9187"
            ));
            return finish(report);
        }
        match tokio::net::TcpListener::bind(&bound).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => report.warning(format!(
                "--metrics-addr {addr}: in use now, so `run` would stop at its start (unless what holds it is this slot's worker, to be stopped first); choose another port"
            )),
            Err(e) => report.problem(format!(
                "--metrics-addr {addr}: cannot listen there: {e}; choose an address of this machine and a free port"
            )),
        }
    }
    let spool_dir = config
        .spool_dir
        .clone()
        .unwrap_or_else(|| crate::replicate::default_spool_dir(&config.slot));
    if let Some(problem) = spool_dir_problem(Some(&spool_dir)) {
        report.problem(problem);
    }
    report.ok("settings");
    let source = match crate::tls::connect_to(&config.source, "source").await {
        Ok(c) => {
            // (The role's statement_timeout would cut a catalog read short on a busy server,
            // and report a problem that is none.)
            let _ = c.batch_execute("SET statement_timeout = 0").await;
            report.ok(format!(
                "source {} reachable{}",
                conninfo::describe(&config.source),
                crate::sql::connected_to(&c, &config.source).await
            ));
            Some(c)
        }
        Err(e) => {
            report.problem(e.to_string());
            None
        }
    };
    let target = match crate::tls::connect_to(&config.target, "target").await {
        Ok(c) => {
            // (The role's statement_timeout would cut a catalog read short on a busy server,
            // and report a problem that is none.)
            let _ = c.batch_execute("SET statement_timeout = 0").await;
            report.ok(format!(
                "target {} reachable{}",
                conninfo::describe(&config.target),
                crate::sql::connected_to(&c, &config.target).await
            ));
            Some(c)
        }
        Err(e) => {
            report.problem(e.to_string());
            None
        }
    };
    let mut tables = Vec::new();
    let mut truncated = Vec::new();
    let mut updated = Vec::new();
    if let Some(src) = &source {
        check_source(
            src,
            target.as_ref(),
            &config,
            &mut report,
            &mut tables,
            (&mut truncated, &mut updated),
        )
        .await;
    }
    // A slot made by a --two-phase run makes every run on it two-phase.
    let mut two_phase = config.requested.two_phase;
    // (None: not known, the source unreachable; then nothing is judged from it.)
    let mut slot_exists = None;
    if let Some(src) = &source {
        slot_exists = src
            .query_opt(
                "SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&config.slot],
            )
            .await
            .ok()
            .map(|r| r.is_some());
        let slot_two_phase = src
            .query_opt(
                "SELECT 1 FROM pg_catalog.pg_replication_slots s WHERE slot_name = $1 \
                 AND coalesce(to_jsonb(s) ->> 'two_phase', 'false') = 'true'",
                &[&config.slot],
            )
            .await
            .is_ok_and(|r| r.is_some());
        // As the run decides (before 15, --two-phase is negotiated off and the slot not judged).
        if slot_exists == Some(true) && server_version(src).await >= 150000 {
            if let Some(problem) = crate::source::two_phase_slot_problem(
                &config.slot,
                slot_two_phase,
                config.requested.two_phase,
                config.apply_workers > 1,
            ) {
                report.problem(problem);
            }
        }
        two_phase |= slot_two_phase;
    }
    if let Some(dst) = &target {
        // Origins are the cluster's: a slot name another database of it claimed is refused.
        let origin = format!("pgapply_{}", config.slot);
        let first = crate::apply::progress::slot_name_claims(dst, &origin)
            .await
            .ok()
            .and_then(|claims| claims.into_iter().find(|c| c.database.is_some()));
        if let Some(claim) = first.filter(|c| !c.mine) {
            report.problem(format!(
                "slot name {:?} is already used by pgapply in database {:?} of the target cluster (replication origins are shared by its databases): give this run another --slot",
                config.slot,
                claim.database.unwrap_or_default()
            ));
        }
        // Whatever the source said: the role's rights for pgapply's own state.
        // As `run` decides: --copy-data with a copy still to make (none yet, an interrupted one,
        // or a finished one whose slot is gone) wants empty tables, or --truncate-target; an
        // interrupted copy's tables it empties itself; and a slot it did not make for a copy
        // it refuses.
        use crate::copy::CopyStatus;
        let status = crate::copy::status(dst, &config.slot)
            .await
            .unwrap_or(CopyStatus::None);
        // A slot a cutover stopped is not copied again by `run`.
        let fenced = dst
            .query_opt(
                "SELECT 1 FROM pgapply.progress WHERE slot_name = $1 AND to_jsonb(progress) ->> 'stop_lsn' IS NOT NULL",
                &[&config.slot],
            )
            .await
            .is_ok_and(|r| r.is_some());
        let copy_pending = config.copy_data
            && !fenced
            && slot_exists.is_some_and(|exists| status != CopyStatus::Done || !exists);
        if copy_pending && slot_exists == Some(true) && status == CopyStatus::None {
            report.problem(format!(
                "--copy-data creates slot {:?} with a snapshot of the data, but a slot of that name already exists on the source (made by hand, or by a run without --copy-data): give another --slot, or drop it if nothing needs its changes",
                config.slot
            ));
        }
        let emptied: Vec<String> = if status == CopyStatus::Incomplete {
            crate::copy::copied_tables(dst, &config.slot)
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|(schema, name)| {
                    let (schema, name) = config
                        .table_map
                        .get(&(schema.clone(), name.clone()))
                        .cloned()
                        .unwrap_or((schema, name));
                    crate::sql::qualified_name(&schema, &name)
                })
                .collect()
        } else {
            Vec::new()
        };
        // (A copy under way shows in its heartbeat: not interrupted, only not finished.)
        let copying = status == CopyStatus::Incomplete
            && crate::copy::copy_under_way(dst, &config.slot)
                .await
                .unwrap_or(false);
        if copying {
            report.ok(format!(
                "the initial copy for slot {:?} is under way (its worker's heartbeat is recent): `pgapply status` shows its progress",
                config.slot
            ));
        } else if status == CopyStatus::Incomplete && !config.copy_data {
            report.problem(format!(
                "the initial copy for slot {:?} was interrupted and cannot continue: run with --copy-data to start it over (it empties the tables it had copied: {})",
                config.slot,
                if emptied.is_empty() { "none yet".to_owned() } else { emptied.join(", ") }
            ));
        }
        // After the initial copy: tables published since, which a run with --copy-data copies
        // (and one without leaves without their earlier rows), and such copies that did not
        // finish, which a run without --copy-data refuses.
        if status == CopyStatus::Done && slot_exists == Some(true) && !fenced {
            let recorded = crate::copy::copied_tables(dst, &config.slot)
                .await
                .unwrap_or_default();
            // (Partitions of copied tables, and roots of copied partitions, were copied too.)
            let recorded = match &source {
                Some(src) => crate::copy::covered_by_copies(src, recorded).await,
                None => recorded.into_iter().collect(),
            };
            // A copied table renamed on the source since (same oid, a name the copy state does
            // not have): not new, and `run` moves its copy state to the new name.
            let renamed = match &source {
                Some(src) => renamed_since_copy(dst, src, &config.slot, &tables).await,
                None => Vec::new(),
            };
            let later: Vec<&crate::copy::PublishedTable> = tables
                .iter()
                .filter(|t| !recorded.contains(&(t.schema.clone(), t.name.clone())))
                .filter(|t| !renamed.contains(&(t.schema.clone(), t.name.clone())))
                .collect();
            // Target tables another worker fills: a copy would have to empty them.
            let filled = crate::copy::other_slots_filling(dst, &config.slot, &later).await;
            let not_copied: Vec<String> = later
                .iter()
                .filter(|t| !filled.iter().any(|(q, _)| *q == t.target_qualified()))
                .map(|t| t.qualified())
                .collect();
            for (table, other) in &filled {
                report.warning(format!(
                    "published after the initial copy: target table {table} holds the rows another worker (slot {}) fills, so --copy-data does not copy into it (emptying it would lose that worker's rows, and --truncate-target is refused): copy this source's earlier rows into it by hand (README: \"Several workers\", fan-in into one table)",
                    crate::sql::shown_literal(other)
                ));
            }
            if !not_copied.is_empty() {
                let how = if two_phase {
                    "the slot is a two-phase one, whose --copy-data cannot copy them: copy their earlier rows by hand (README: \"A table added to the publication later\")"
                } else if config.copy_data {
                    "this run copies them (--copy-data): their target tables must be empty, or give --truncate-target"
                } else {
                    "rows they held before they were published are not on the target (none if they were empty then): a run with --copy-data copies them"
                };
                report.warning(format!(
                    "published after the initial copy: {}; {how}",
                    not_copied.join(", ")
                ));
            }
            if let Some(src) = &source {
                let again = crate::copy::copies_to_make_again(
                    dst,
                    src,
                    &config.slot,
                    &config.publications,
                    &tables,
                )
                .await
                .unwrap_or_default();
                if !again.is_empty() {
                    let how = if config.copy_data && config.copy.truncate_target {
                        "this run copies them again (--copy-data --truncate-target)"
                    } else {
                        "a run with --copy-data --truncate-target copies them again; `pgapply run` names them at every start until then"
                    };
                    report.warning(format!(
                        "taken out of the publication and put back, or given another row filter or column list, after their copy: {}; rows may be missing or stale on the target (pgapply verify compares them); {how}",
                        again.join(", ")
                    ));
                }
            }
            let unfinished = crate::copy::late_unfinished(dst, &config.slot)
                .await
                .unwrap_or_default();
            if !unfinished.is_empty() && !config.copy_data {
                report.problem(format!(
                    "the copy of {} (published after the initial copy) did not finish: a run without --copy-data refuses to stream into it; run with --copy-data",
                    unfinished.join(", ")
                ));
            }
        }
        // A column map entry that maps nothing: a misspelt source column or table.
        for ((schema, name), renames) in &config.column_map {
            let published = tables
                .iter()
                .find(|t| t.schema == *schema && t.name == *name);
            for from in renames.keys() {
                let known = published.is_some_and(|t| t.columns.iter().any(|(c, _)| c == from));
                if !known {
                    report.warning(format!(
                        "[tables] in the config file maps column {} of table {}, which the publications do not publish now: fine while changes from before a rename of it on the source still come (remove the entry once pgapply is past them); otherwise a misspelling, which maps nothing",
                        crate::sql::quote_ident(from),
                        crate::sql::qualified_name(schema, name)
                    ));
                }
            }
        }
        let must_be_empty = copy_pending && !config.copy.truncate_target;
        check_target(
            dst,
            source.as_ref(),
            &mut report,
            &with_target_columns(&tables, &config.column_map),
            (&truncated, &updated),
            (must_be_empty, &emptied, &config.slot),
        )
        .await;
        check_apply_session(
            dst,
            &mut report,
            &tables,
            (two_phase, config.apply_workers),
            &config.policies,
        )
        .await;
        if let Some(warning) = room_for_sessions(dst, &config).await {
            report.warning(warning);
        }
        if let Some(problem) = room_for_origins(dst, &config).await {
            report.problem(problem);
        }
    }
    finish(report)
}

/// Published tables the slot's copy took in under another name (renamed on the source since
/// the copy: the copy state's oid is theirs, its name is no published table's).
async fn renamed_since_copy(
    dst: &Client,
    src: &Client,
    slot: &str,
    tables: &[crate::copy::PublishedTable],
) -> Vec<(String, String)> {
    let Ok(rows) = dst
        .query(
            "SELECT schema_name, table_name, source_relid FROM pgapply.copy_state \
             WHERE slot_name = $1 AND source_relid IS NOT NULL",
            &[&slot],
        )
        .await
    else {
        return Vec::new();
    };
    let published = |s: &str, n: &str| tables.iter().any(|t| t.schema == s && t.name == n);
    let old_oids: Vec<u32> = rows
        .iter()
        .filter(|r| !published(&r.get::<_, String>(0), &r.get::<_, String>(1)))
        .map(|r| r.get(2))
        .collect();
    if old_oids.is_empty() {
        return Vec::new();
    }
    let mut renamed = Vec::new();
    for t in tables {
        let oid = src
            .query_one("SELECT pg_catalog.to_regclass($1)::oid", &[&t.qualified()])
            .await
            .ok()
            .and_then(|r| r.get::<_, Option<u32>>(0));
        if oid.is_some_and(|o| old_oids.contains(&o)) {
            renamed.push((t.schema.clone(), t.name.clone()));
        }
    }
    renamed
}

/// Sessions a run may keep on the target (README: "Room in max_connections").
/// Whether the run keeps a second session for `--streaming parallel` (with --apply-workers above
/// 1 or --two-phase, streamed transactions are spooled instead, as `run` decides).
fn live_helper(config: &crate::replicate::RunConfig) -> bool {
    matches!(
        config.requested.streaming,
        Some(crate::cli::Streaming::Parallel)
    ) && config.apply_workers <= 1
        && !config.requested.two_phase
}

fn sessions_needed(config: &crate::replicate::RunConfig) -> i64 {
    let parallel = live_helper(config);
    let copy = if config.copy_data {
        config.copy.jobs
    } else {
        0
    };
    8 + config.apply_workers.saturating_sub(1) as i64 + i64::from(parallel) + copy as i64
}

/// Whether the target has room for the sessions a run keeps, besides those it has now: a full
/// target refuses pgapply's sessions with "too many clients", which reads as someone else's.
async fn room_for_sessions(dst: &Client, config: &crate::replicate::RunConfig) -> Option<String> {
    let row = dst
        .query_one(
            "SELECT current_setting('max_connections')::int \
                    - CASE WHEN (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) \
                           THEN 0 ELSE current_setting('superuser_reserved_connections')::int \
                                       + CASE WHEN coalesce(pg_catalog.pg_has_role(current_user, pg_catalog.to_regrole('pg_use_reserved_connections'), 'MEMBER'), false) \
                                              THEN 0 ELSE coalesce(current_setting('reserved_connections', true)::int, 0) END END, \
                    (SELECT count(*) FROM pg_catalog.pg_stat_activity \
                     WHERE backend_type = 'client backend' AND pid <> pg_catalog.pg_backend_pid())::int",
            &[],
        )
        .await
        .ok()?;
    let (allowed, others): (i32, i32) = (row.get(0), row.get(1));
    let needed = sessions_needed(config);
    let free = i64::from(allowed) - i64::from(others);
    (free < needed).then(|| format!(
        "the target has room for {free} more sessions (max_connections less the ones reserved for other roles, {allowed}, of which {others} in use now), and a run with these settings keeps up to about {needed} there: it would retry \"too many clients\" errors until sessions end; raise max_connections on the target"
    ))
}

/// Whether the target has a free replication origin state for each origin a run binds (one per
/// apply worker, and the second session of `--streaming parallel`): without one, `run` stops at
/// its start (53400). States this slot's own origins hold already are theirs to reuse. Not said
/// when the role may not use origins (progress then goes to a table, or `check` says that
/// --apply-workers needs them) or may not read their states.
async fn room_for_origins(dst: &Client, config: &crate::replicate::RunConfig) -> Option<String> {
    let origin = format!("pgapply_{}", config.slot);
    let row = dst
        .query_one(
            "SELECT (SELECT rolsuper OR (pg_catalog.current_setting('server_version_num')::int >= 140000 \
                            AND has_function_privilege('pg_catalog.pg_replication_origin_session_setup(text)', 'EXECUTE')) \
                     FROM pg_catalog.pg_roles WHERE rolname = current_user), \
                    coalesce(pg_catalog.current_setting('max_active_replication_origins', true), \
                             pg_catalog.current_setting('max_replication_slots'))::int, \
                    (SELECT count(*) FROM pg_catalog.pg_replication_origin_status s \
                     WHERE NOT (s.external_id = $1 OR left(s.external_id, length($1) + 2) = $1 || '-w'))::int",
            &[&origin],
        )
        .await
        .ok()?;
    let (may_use, limit, taken): (Option<bool>, i32, i32) = (row.get(0), row.get(1), row.get(2));
    if may_use != Some(true) {
        return None;
    }
    let needed = if live_helper(config) {
        crate::replicate::LIVE_HELPER_INDEX as i64 + 1
    } else {
        config.apply_workers.max(1) as i64
    };
    let free = i64::from(limit) - i64::from(taken);
    let setting = if server_version(dst).await >= 180000 {
        "max_active_replication_origins"
    } else {
        "max_replication_slots"
    };
    (free < needed).then(|| format!(
        "the target has {free} free replication origin state(s) ({setting} = {limit}, {taken} held by other origins: other subscriptions and pgapply slots), and this run binds {needed} (one per apply worker, two for --streaming parallel): it would stop at its start; raise {setting} on the target (a restart), use fewer --apply-workers, or free the origins of slots no longer replicated into this cluster (pgapply forget --slot <slot> in the database each went into; SELECT external_id FROM pg_replication_origin_status lists them)"
    ))
}

/// The server's `server_version_num`, or 0 if it cannot be read.
async fn server_version(client: &Client) -> u32 {
    match client.query_one("SHOW server_version_num", &[]).await {
        Ok(row) => row.get::<_, String>(0).parse().unwrap_or(0),
        Err(_) => 0,
    }
}

fn finish(report: Report) -> Result<()> {
    if report.json {
        crate::out!(
            "{}",
            serde_json::json!({
                "ok": report.ok,
                "warnings": report.warnings,
                "problems": report.problems,
            })
        );
    }
    if report.problems.is_empty() {
        if !report.json {
            crate::out!("no problems found");
        }
        Ok(())
    } else {
        // Each is on its PROBLEM line above: the error names the count and the first only, or
        // a target without the tables would print its long list three times.
        let first = &report.problems[0];
        Err(Error::definite(match report.problems.len() {
            1 => format!("1 problem found: {first}"),
            n => format!("{n} problems found (the PROBLEM lines above), the first: {first}"),
        }))
    }
}

/// The source's system identifier, as pgapply.progress records it ("" if unreadable).
async fn source_system_id(src: &Client) -> String {
    src.query_one(
        "SELECT system_identifier::text FROM pg_catalog.pg_control_system()",
        &[],
    )
    .await
    .map(|r| r.get(0))
    .unwrap_or_default()
}

/// A yes/no query; a failure is the server's own message (not taken for a "no").
async fn query_bool(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> std::result::Result<bool, String> {
    client
        .query_one(sql, params)
        .await
        .map(|r| r.get::<_, Option<bool>>(0).unwrap_or(false))
        .map_err(|e| describe_postgres(&e))
}
