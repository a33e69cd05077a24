//! `pgapply check`: validates the settings and both servers before anything runs, and lists every
//! problem found (not just the first), each naming the object and what to do.

use tokio_postgres::Client;

use crate::cli::RunArgs;
use crate::config::{self, FileConfig};
use crate::conninfo;
use crate::copy::published_tables;
use crate::error::{describe_postgres, Error, Result};
use crate::sql::quote_ident;

struct Report {
    problems: Vec<String>,
}

impl Report {
    fn ok(&self, text: impl AsRef<str>) {
        crate::out!("ok       {}", text.as_ref());
    }
    fn problem(&mut self, text: impl Into<String>) {
        let text = text.into();
        crate::out!("PROBLEM  {text}");
        self.problems.push(text);
    }
    /// Works, but may fail or change values later: said, not counted as a problem.
    fn warning(&self, text: impl AsRef<str>) {
        crate::out!("WARNING  {}", text.as_ref());
    }
}

pub async fn check_command(args: &RunArgs, file: &FileConfig) -> Result<()> {
    let mut report = Report {
        problems: Vec::new(),
    };
    let (config, service) =
        match config::resolve(args, file).and_then(|c| config::check_run_only(&c.0).map(|()| c)) {
            Ok(c) => c,
            Err(e) => {
                report.problem(e.to_string());
                return finish(report);
            }
        };
    // Where `run` would listen (not listened on here: a running worker may hold it).
    if let Some(addr) = &service.metrics_addr {
        if let Err(e) = tokio::net::lookup_host(addr.as_str()).await {
            report.problem(format!(
                "--metrics-addr {addr}: {e}; give HOST:PORT, for example 127.0.0.1:9187"
            ));
            return finish(report);
        }
    }
    report.ok("settings");
    let source = match crate::tls::connect_to(&config.source, "source").await {
        Ok(c) => {
            report.ok(format!(
                "source {} reachable",
                conninfo::describe(&config.source)
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
            report.ok(format!(
                "target {} reachable",
                conninfo::describe(&config.target)
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
        if status == CopyStatus::Incomplete && !config.copy_data {
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
            let not_copied: Vec<String> = tables
                .iter()
                .filter(|t| !recorded.contains(&(t.schema.clone(), t.name.clone())))
                .map(|t| t.qualified())
                .collect();
            if !not_copied.is_empty() {
                let how = if config.copy_data {
                    "this run copies them (--copy-data): their target tables must be empty, or give --truncate-target"
                } else {
                    "rows they held before they were published are not on the target (none if they were empty then): a run with --copy-data copies them"
                };
                report.warning(format!(
                    "published after the initial copy: {}; {how}",
                    not_copied.join(", ")
                ));
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
        let must_be_empty = copy_pending && !config.copy.truncate_target;
        check_target(
            dst,
            source.as_ref(),
            &mut report,
            &tables,
            (&truncated, &updated),
            must_be_empty,
            &emptied,
        )
        .await;
        check_apply_session(dst, &mut report, &tables, two_phase).await;
    }
    finish(report)
}

/// The server's `server_version_num`, or 0 if it cannot be read.
async fn server_version(client: &Client) -> u32 {
    match client.query_one("SHOW server_version_num", &[]).await {
        Ok(row) => row.get::<_, String>(0).parse().unwrap_or(0),
        Err(_) => 0,
    }
}

fn finish(report: Report) -> Result<()> {
    if report.problems.is_empty() {
        crate::out!("no problems found");
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

/// A yes/no query; a failure is the server's own message (not taken for a "no").
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

async fn check_source(
    src: &Client,
    dst: Option<&Client>,
    config: &crate::replicate::RunConfig,
    report: &mut Report,
    tables: &mut Vec<crate::copy::PublishedTable>,
    (truncated, updated): (&mut Vec<bool>, &mut Vec<bool>),
) {
    if let (Some(dst), Ok(Some(row))) = (
        dst,
        src.query_opt(
            "SELECT system_identifier::text, current_database()::text FROM pg_catalog.pg_control_system()",
            &[],
        )
        .await,
    ) {
        let (system_id, database): (String, String) = (row.get(0), row.get(1));
        if let Err(e) = crate::replicate::refuse_same_database(dst, &system_id, &database).await {
            report.problem(e.to_string());
        }
    }
    if let Ok(row) = src
        .query_one(
            "SELECT pg_catalog.pg_is_in_recovery(), current_setting('server_version_num')::int",
            &[],
        )
        .await
    {
        if row.get::<_, bool>(0) && row.get::<_, i32>(1) < 160000 {
            report.problem("the source is a standby (in recovery), where PostgreSQL before 16 cannot decode changes: point --source at the primary");
        }
    }
    if let Ok(row) = src
        .query_one(
            "SELECT setting::bigint FROM pg_catalog.pg_settings WHERE name = 'wal_sender_timeout'",
            &[],
        )
        .await
    {
        let ms: i64 = row.get(0);
        match crate::replicate::status_interval_problem(config.status_interval, ms.max(0) as u64) {
            Some(problem) => report.problem(problem),
            None => report.ok("status interval within the source's wal_sender_timeout"),
        }
    }
    // Options this source's version cannot serve, as `run` refuses them (or warns).
    {
        let version = server_version(src).await;
        if version > 0 {
            for problem in crate::source::options::version_problems(version, &config.requested) {
                report.problem(problem);
            }
            if config.failover_slot && version < 170000 {
                report.problem(format!(
                    "--failover-slot needs a PostgreSQL 17 or later source; this source runs PostgreSQL {}: leave it out",
                    version / 10000
                ));
            }
            // --binary falls back to text, for the whole stream, rather than refuse: said here.
            if config.requested.binary {
                if version < 140000 {
                    report.warning(format!("--binary needs a PostgreSQL 14 or later source; this source runs PostgreSQL {}: values arrive in text form", version / 10000));
                } else {
                    match crate::replicate::binary_unsafe(config, version).await {
                        Ok(Some(reason)) => report.warning(format!(
                            "--binary: values arrive in text form for every table, as {reason}"
                        )),
                        Ok(None) => report.ok("--binary: values arrive in binary form"),
                        // (A server that cannot be reached is reported on its own.)
                        Err(_) => {}
                    }
                }
            }
            if config.requested.streaming == Some(crate::cli::Streaming::Parallel)
                && (140000..160000).contains(&version)
            {
                report.warning("--streaming parallel needs a PostgreSQL 16 or later source: large transactions are streamed with --streaming on instead");
            }
        }
    }
    // (As `run` warns: a TRUNCATE on such a source leaves the target's rows in place.)
    {
        let version = server_version(src).await;
        if version > 0 && version < 110000 {
            report.warning(
                "the source runs PostgreSQL 10, which does not replicate TRUNCATE: a table truncated there keeps its rows on the target (verify shows it); truncate it on the target too, or keep TRUNCATE away from published tables until the migration",
            );
        }
    }
    match src.query_one("SHOW wal_level", &[]).await {
        Ok(row) => {
            let level: String = row.get(0);
            if level == "logical" {
                report.ok("source wal_level = logical");
            } else {
                report.problem(format!(
                    "source wal_level is {level:?}: set wal_level = logical in postgresql.conf and restart the source"
                ));
            }
        }
        Err(e) => report.problem(format!(
            "source: cannot read wal_level: {}",
            describe_postgres(&e)
        )),
    }
    match query_bool(
        src,
        "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
        &[],
    )
    .await
    {
        Ok(true) => report.ok("source role may replicate"),
        Ok(false) => report.problem("the source role lacks the REPLICATION attribute: ALTER ROLE ... REPLICATION (or use a superuser)"),
        Err(e) => report.problem(format!("source: cannot read the role's attributes (pg_roles): {e}")),
    }
    // The tables of the publications that exist are still checked.
    let mut existing: Vec<String> = Vec::new();
    for publication in &config.publications {
        match query_bool(
            src,
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            &[publication],
        )
        .await
        {
            Ok(true) => {
                existing.push(publication.clone());
                report.ok(format!("publication {publication:?} exists"))
            }
            Ok(false) => {
                report.problem(format!(
                    "publication {publication:?} does not exist on the source: CREATE PUBLICATION {} FOR TABLE ...",
                    quote_ident(publication)
                ))
            }
            Err(e) => report.problem(format!(
                "source: cannot read publication {publication:?}: {e}"
            )),
        }
    }
    match src
        .query_opt(
            "SELECT plugin::text, database::text = current_database(), active_pid, \
                    coalesce(database::text, ''), \
                    coalesce(to_jsonb(s) ->> 'wal_status', '') = 'lost' OR coalesce(to_jsonb(s) ->> 'invalidation_reason', '') <> '' \
             FROM pg_replication_slots s WHERE slot_name = $1",
            &[&config.slot],
        )
        .await
    {
        Ok(Some(row)) => {
            let plugin: Option<String> = row.get(0);
            let same_db: Option<bool> = row.get(1);
            let active_pid: Option<i32> = row.get(2);
            let lost: Option<bool> = row.get(4);
            let slot_db: String = row.get(3);
            let drop = format!(
                "SELECT pg_drop_replication_slot({}) on the source if nothing else uses it, or give another --slot",
                crate::sql::quote_literal(&config.slot)
            );
            if lost == Some(true) {
                report.problem(format!(
                    "slot {:?} was invalidated (the source removed WAL it needed): drop it and start over with --copy-data --truncate-target",
                    config.slot
                ));
            } else if plugin.as_deref() != Some("pgoutput") {
                report.problem(match plugin {
                    Some(plugin) => format!(
                        "slot {:?} is a logical slot of plugin {plugin:?}; pgapply needs one of pgoutput: {drop}",
                        config.slot
                    ),
                    None => format!(
                        "slot {:?} is a physical slot; pgapply needs a logical one of pgoutput: {drop}",
                        config.slot
                    ),
                });
            } else if same_db != Some(true) {
                report.problem(format!(
                    "slot {:?} belongs to database {slot_db:?}, not the source connection's: connect --source to dbname={slot_db}, or give another --slot",
                    config.slot
                ));
            } else if let Some(pid) = active_pid {
                // The worker this check describes, running: its heartbeat on the target is
                // fresh, and the target's progress is from this source.
                let running = match dst {
                    Some(dst) => query_bool(
                        dst,
                        "SELECT coalesce((SELECT state IN ('streaming', 'copying') \
                                                 AND heartbeat_at > now() - $2::text::interval \
                                                 AND source_system_id = $3 \
                                          FROM pgapply.progress WHERE slot_name = $1), false)",
                        &[
                            &config.slot,
                            &format!("{} seconds", 3 * crate::replicate::HEARTBEAT_MAX_EVERY.as_secs()),
                            &source_system_id(src).await,
                        ],
                    )
                    .await
                    .unwrap_or(false),
                    None => false,
                };
                if running {
                    report.ok(format!(
                        "slot {:?} is in use by the running pgapply worker (pgoutput, source process {pid}); the checks below describe its setup",
                        config.slot
                    ));
                } else {
                    report.problem(format!(
                        "slot {:?} is in use by the source process {pid} (another pgapply, or another client): stop that one first",
                        config.slot
                    ));
                }
            } else {
                report.ok(format!("slot {:?} exists (pgoutput)", config.slot));
            }
        }
        Ok(None) if config.create_slot || config.copy_data => {
            report.ok(format!("slot {:?} will be created", config.slot))
        }
        Ok(None) => report.problem(format!(
            "replication slot {:?} does not exist on the source: run with --create-slot (streams changes from now on), or --copy-data (copies the tables' rows first, then streams)",
            config.slot
        )),
        Err(e) => report.problem(format!("source: cannot read pg_replication_slots: {}", describe_postgres(&e))),
    }
    if existing.is_empty() {
        // (Named above.)
        return;
    }
    match published_tables(src, &existing, &config.table_map).await {
        Ok(t) => *tables = t,
        Err(e) => {
            report.problem(e.to_string());
            return;
        }
    }
    if tables.is_empty() {
        report.problem(crate::copy::no_tables_message(&existing));
    }
    for problem in crate::replicate::unmatched_table_settings(config, tables) {
        report.warning(problem);
    }
    // Several source tables mapped onto one target table: the rows there are not told apart.
    let mut sources_of: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for table in tables.iter() {
        sources_of
            .entry(table.target_qualified())
            .or_default()
            .push(table.qualified());
    }
    for (target, sources) in sources_of.iter().filter(|(_, s)| s.len() > 1) {
        report.warning(format!(
            "target table {target} receives the rows of {} source tables ({}): a TRUNCATE of only some of them stops the apply (it cannot empty {target} of their rows alone); `pgapply verify` compares {target} with all of them together",
            sources.len(),
            sources.join(", ")
        ));
    }
    for table in tables.iter() {
        let qualified = table.qualified();
        // What the publications that have it replicate: only UPDATEs or DELETEs need a replica
        // identity; TRUNCATE needs the target's privilege (pubtruncate is 11+: read through
        // to_jsonb).
        let (updates_published, truncates) = src
            .query_one(
                "SELECT coalesce(bool_or(p.pubupdate OR p.pubdelete), false), \
                        coalesce(bool_or((to_jsonb(p) ->> 'pubtruncate')::bool), false) \
                 FROM pg_publication p JOIN pg_publication_tables pt ON pt.pubname = p.pubname \
                 WHERE p.pubname = ANY ($1) AND pt.schemaname = $2 AND pt.tablename = $3",
                &[&config.publications, &table.schema, &table.name],
            )
            .await
            .map_or((true, false), |r| (r.get(0), r.get(1)));
        truncated.push(truncates);
        updated.push(updates_published);
        for problem in publication_rule_problems(src, &config.publications, &qualified).await {
            report.problem(problem);
        }
        // A table published through its partitioned root: the partitions' replica identities
        // are what UPDATE and DELETE on them need (ALTER TABLE .. REPLICA IDENTITY on the root
        // does not reach them).
        // (With an index that could serve as replica identity: unique, not partial, on plain
        // NOT NULL columns.)
        let usable_index = "(SELECT pg_catalog.quote_ident(x.relname) FROM pg_catalog.pg_index i \
                               JOIN pg_catalog.pg_class x ON x.oid = i.indexrelid \
                             WHERE i.indrelid = c.oid AND i.indisunique AND i.indimmediate AND i.indisvalid \
                               AND i.indpred IS NULL AND i.indexprs IS NULL \
                               AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a \
                                               WHERE a.attrelid = c.oid AND a.attnum = ANY (i.indkey) AND NOT a.attnotnull) \
                             ORDER BY x.relname LIMIT 1)";
        let sql = if table.partitioned {
            format!("SELECT n.nspname::text, c.relname::text, c.relreplident::text, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), \
                    has_table_privilege($1::text::regclass, 'SELECT'), {usable_index} \
             FROM pg_partition_tree($1::text::regclass) t JOIN pg_class c ON c.oid = t.relid \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE t.isleaf")
        } else {
            format!("SELECT n.nspname::text, c.relname::text, c.relreplident::text, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), \
                    has_table_privilege(c.oid, 'SELECT'), {usable_index} \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1::text::regclass")
        };
        match src.query(&sql, &[&qualified]).await {
            Ok(rows) => {
                let mut identified = true;
                for row in &rows {
                    let name = crate::sql::qualified_name(row.get(0), row.get(1));
                    let identity: String = row.get(2);
                    let has_pk: bool = row.get(3);
                    if updates_published && (identity == "n" || (identity == "d" && !has_pk)) {
                        identified = false;
                        let index = row
                            .get::<_, Option<String>>(5)
                            .map(|i| format!(", ALTER TABLE {name} REPLICA IDENTITY USING INDEX {i} (a unique index on NOT NULL columns it has),"))
                            .unwrap_or_default();
                        // Fine for a table that only ever gets INSERTs (a log): said, not refused.
                        report.warning(format!(
                            "table {name} has no primary key and no replica identity on the source: UPDATE and DELETE on it fail on the source while it is published (fine if it only gets INSERTs); otherwise add a primary key{index} or ALTER TABLE {name} REPLICA IDENTITY FULL"
                        ));
                    }
                }
                if identified {
                    report.ok(format!("table {qualified} has a replica identity"));
                }
                let Some(row) = rows.first() else { continue };
                if config.copy_data && !row.get::<_, bool>(4) {
                    report.problem(format!("the source role may not SELECT from {qualified} (needed by --copy-data): GRANT SELECT ON {qualified} TO ..."));
                }
            }
            Err(e) => report.problem(format!(
                "source table {qualified}: {}",
                describe_postgres(&e)
            )),
        }
    }
}

/// What the source refuses at the first change of a table, found before (PostgreSQL 15+): a row
/// filter or column list that leaves out replica identity columns in a publication of UPDATE or
/// DELETE ("cannot update table"), and different column lists in two of the publications.
/// (Row filter columns are read from the filter's stored form, `:varattno N`.)
async fn publication_rule_problems(
    src: &Client,
    publications: &[String],
    qualified: &str,
) -> Vec<String> {
    // Row filters and column lists exist from PostgreSQL 15.
    match crate::sql::server_version(src).await {
        Ok(v) if v >= 150000 => {}
        _ => return Vec::new(),
    }
    let rows = match src
        .query(
            "WITH ri AS ( \
               SELECT c.oid, c.relreplident, \
                      CASE c.relreplident \
                        WHEN 'd' THEN (SELECT (i.indkey::int2[])[0:i.indnkeyatts - 1] FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisprimary) \
                        WHEN 'i' THEN (SELECT (i.indkey::int2[])[0:i.indnkeyatts - 1] FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisreplident) \
                        WHEN 'f' THEN (SELECT array_agg(a.attnum) FROM pg_catalog.pg_attribute a \
                                       WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '') \
                      END AS cols \
               FROM pg_catalog.pg_class c WHERE c.oid = $1::text::pg_catalog.regclass) \
             SELECT p.pubname::text, \
               (SELECT string_agg(pg_catalog.quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_catalog.pg_attribute a \
                WHERE a.attrelid = ri.oid AND ri.relreplident <> 'f' \
                  AND a.attnum IN (SELECT m[1]::int2 FROM regexp_matches(pr.prqual::text, ':varattno (\\d+)', 'g') m) \
                  AND NOT (a.attnum = ANY (coalesce(ri.cols, '{}')))), \
               (SELECT string_agg(pg_catalog.quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_catalog.pg_attribute a \
                WHERE a.attrelid = ri.oid AND pr.prattrs IS NOT NULL \
                  AND a.attnum = ANY (coalesce(ri.cols, '{}')) AND NOT (a.attnum = ANY (pr.prattrs::int2[]))) \
             FROM pg_catalog.pg_publication p JOIN pg_catalog.pg_publication_rel pr ON pr.prpubid = p.oid \
             JOIN ri ON pr.prrelid = ri.oid \
             WHERE p.pubname = ANY ($2) AND (p.pubupdate OR p.pubdelete) ORDER BY 1",
            &[&qualified, &publications],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => {
            return vec![format!(
                "source: cannot read the publications' row filters and column lists of {qualified}: {}",
                describe_postgres(&e)
            )]
        }
    };
    let mut problems = Vec::new();
    for row in rows {
        let publication: String = row.get(0);
        if let Some(columns) = row.get::<_, Option<String>>(1) {
            problems.push(format!(
                "the row filter of publication {publication:?} on {qualified} uses {columns}, outside the table's replica identity: the source refuses every UPDATE and DELETE of {qualified} while it is published so; filter on replica identity columns only, or ALTER TABLE {qualified} REPLICA IDENTITY FULL (or USING INDEX on an index that covers them)"
            ));
        }
        if let Some(columns) = row.get::<_, Option<String>>(2) {
            problems.push(format!(
                "the column list of publication {publication:?} on {qualified} leaves out replica identity column(s) {columns}: the source refuses every UPDATE and DELETE of {qualified} while it is published so; add them to the column list (ALTER PUBLICATION ... SET TABLE {qualified} (...))"
            ));
        }
    }
    let lists = match src
        .query(
            "SELECT DISTINCT array_to_string(attnames, ', ') FROM pg_catalog.pg_publication_tables \
             WHERE pubname = ANY ($1) \
               AND (schemaname, tablename) = (SELECT n.nspname, c.relname FROM pg_catalog.pg_class c \
                                               JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                                               WHERE c.oid = $2::text::pg_catalog.regclass)",
            &[&publications, &qualified],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => {
            problems.push(format!(
                "source: cannot read the publications' column lists of {qualified}: {}",
                describe_postgres(&e)
            ));
            return problems;
        }
    };
    if lists.len() > 1 {
        problems.push(format!(
            "the publications publish different column lists of {qualified} ({}): the source refuses that at its first change (\"cannot use different column lists for table ... in different publications\"); give every publication the same list, or replicate them with separate slots",
            lists.iter().map(|r| format!("({})", r.get::<_, String>(0))).collect::<Vec<_>>().join(" and ")
        ));
    }
    problems
}

/// What the apply session needs beyond the tables: quiet triggers (as under PostgreSQL's own
/// subscriber) and, with --two-phase, prepared transactions.
async fn check_apply_session(
    dst: &Client,
    report: &mut Report,
    tables: &[crate::copy::PublishedTable],
    two_phase: bool,
) {
    match crate::migrations::refuse_read_only(dst).await {
        Ok(()) => report.ok("the target takes writes"),
        Err(e) => report.problem(e.to_string()),
    }
    match crate::copy::loud_trigger_tables(dst, tables).await {
        Ok(loud) if loud.is_empty() => {}
        Ok(loud) => report.problem(format!(
            "the target role may not set session_replication_role, so the triggers and foreign keys of {} act on replicated changes (PostgreSQL's own subscriber keeps them quiet): use a superuser, or on PostgreSQL 15+ GRANT SET ON PARAMETER session_replication_role TO the role",
            loud.join(", ")
        )),
        Err(e) => report.problem(e.to_string()),
    }
    if two_phase {
        let prepared = dst
            .query_one(
                "SELECT current_setting('max_prepared_transactions')::int",
                &[],
            )
            .await;
        match prepared {
            Ok(r) if r.get::<_, i32>(0) > 0 => report.ok("the target takes prepared transactions (two-phase)"),
            Ok(_) => report.problem("two-phase apply (--two-phase, or a slot made by a --two-phase run) needs prepared transactions on the target, but its max_prepared_transactions is 0: set it above 0 in postgresql.conf and restart the target"),
            Err(e) => report.problem(format!("target: reading max_prepared_transactions: {}", describe_postgres(&e))),
        }
    }
}

async fn check_target(
    dst: &Client,
    source: Option<&Client>,
    report: &mut Report,
    tables: &[crate::copy::PublishedTable],
    (truncated, updated): (&[bool], &[bool]),
    copy_pending: bool,
    emptied: &[String],
) {
    let can_create = query_bool(
        dst,
        // (A schema pgapply that exists already is what counts then: another role's may refuse.)
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'pgapply') \
                     THEN (SELECT has_schema_privilege(oid, 'CREATE') AND has_schema_privilege(oid, 'USAGE') \
                                  AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid AND c.relkind = 'r' \
                                                  AND NOT has_table_privilege(c.oid, 'SELECT, INSERT, UPDATE, DELETE')) \
                           FROM pg_namespace n WHERE nspname = 'pgapply') \
                     ELSE has_database_privilege(current_database(), 'CREATE') END",
        &[],
    )
    .await;
    match can_create {
        Ok(true) => report.ok("target role may keep pgapply's state (schema pgapply)"),
        Ok(false) => report.problem("the target role may not create schema pgapply, or may not use the one there (made by another role): GRANT CREATE ON DATABASE ... TO it, or have the owner of schema pgapply grant it USAGE and CREATE on the schema and SELECT, INSERT, UPDATE, DELETE on its tables (or drop it if no other pgapply uses it)"),
        Err(e) => report.problem(format!("target: cannot read the role's privileges: {e}")),
    }
    // A target without any of the tables (a new cluster) is one problem, not one per table.
    let names: Vec<String> = tables.iter().map(|t| t.target_qualified()).collect();
    let none_there = !names.is_empty()
        && dst
            .query_one(
                "SELECT bool_and(pg_catalog.to_regclass(n) IS NULL) FROM unnest($1::text[]) n",
                &[&names],
            )
            .await
            .ok()
            .and_then(|r| r.get::<_, Option<bool>>(0))
            .unwrap_or(false);
    if none_there {
        // Partitions published under their own names, the target keeping their rows in the
        // parent: said as `run` says it.
        if let Some(src) = source {
            let sources: Vec<String> = tables.iter().map(|t| t.qualified()).collect();
            if let Ok(Some(hint)) = crate::replicate::missing_partition_hint(src, &sources).await {
                report.problem(hint);
                return;
            }
        }
        report.problem(format!(
            "none of the {} published tables exists on the target: create them first, for example with `pgapply schema --source ... --target ... --publication ... --section pre-data` (and `--section post-data` after the initial copy, for the keys and indexes)",
            names.len()
        ));
        return;
    }
    for (i, table) in tables.iter().enumerate() {
        let truncates = truncated.get(i).copied().unwrap_or(false);
        let qualified = table.target_qualified();
        let rows = dst
            .query(
                &format!("SELECT a.attname::text, {}, t.typcategory::text, \
                        coalesce(to_jsonb(a) ->> 'attgenerated', '') <> '', \
                        array_to_string(ARRAY(SELECT p FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) p \
                                              WHERE NOT has_table_privilege(a.attrelid, p) \
                                                AND NOT (p <> 'DELETE' AND cardinality($2::text[]) > 0 \
                                                         AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute pc \
                                                                         WHERE pc.attrelid = a.attrelid AND pc.attname = ANY ($2::text[]) \
                                                                           AND NOT has_column_privilege(pc.attrelid, pc.attnum, p)))), ', '), \
                        a.attnotnull AND NOT a.atthasdef AND coalesce(to_jsonb(a) ->> 'attidentity', '') = '', \
                        has_table_privilege(a.attrelid, 'TRUNCATE'), \
                        (SELECT array_agg(e.enumlabel::text ORDER BY e.enumsortorder) FROM pg_catalog.pg_enum e WHERE e.enumtypid = a.atttypid), \
                        (SELECT c.relrowsecurity AND (c.relforcerowsecurity OR NOT pg_catalog.pg_has_role(c.relowner, 'USAGE')) \
                                AND NOT (r.rolsuper OR r.rolbypassrls) \
                         FROM pg_catalog.pg_class c, pg_catalog.pg_roles r WHERE c.oid = a.attrelid AND r.rolname = current_user), \
                        current_user::text, \
                        coalesce(to_jsonb(a) ->> 'attidentity', '') = 'a' \
                 FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON t.oid = a.atttypid \
                 WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
                    crate::sql::type_name_sql("a.atttypid", "a.atttypmod")),
                // (Column rights count when every published column has them.)
                &[&qualified, &table.columns.iter().map(|(c, _)| c.clone()).collect::<Vec<String>>()],
            )
            .await;
        let rows = match rows {
            Ok(r) if !r.is_empty() => r,
            Ok(_) => {
                report.problem(format!(
                    "table {qualified} does not exist on the target: if the source renamed it, rename it on the target too (ALTER TABLE ... RENAME TO ..., or SET SCHEMA ...: a new empty table would leave its rows behind under the old name); otherwise create it with the published columns (pg_dump --schema-only --table='{}' from the source)",
                    table.qualified()
                ));
                continue;
            }
            Err(e) => {
                report.problem(format!(
                    "target table {qualified}: {}",
                    describe_postgres(&e)
                ));
                continue;
            }
        };
        let me = quote_ident(&rows[0].get::<_, String>(9));
        let lacking: String = rows[0].get(4);
        if !lacking.is_empty() {
            report.problem(format!(
                "the target role may not {lacking} on {qualified}: GRANT {lacking} ON {qualified} TO {me}"
            ));
        }
        if rows[0].get::<_, Option<bool>>(8) == Some(true) {
            report.problem(format!(
                "target table {qualified} has row-level security, which applies to the target role: pgapply's changes would fail on it (\"query would be affected by row-level security policy\"), as they must reach every row: give the role BYPASSRLS (ALTER ROLE {me} BYPASSRLS), or connect as the table's owner (if the table says FORCE ROW LEVEL SECURITY, that is not enough: ALTER TABLE {qualified} NO FORCE ROW LEVEL SECURITY)"
            ));
        }
        // GENERATED ALWAYS identity columns that UPDATEs write: PostgreSQL refuses every one.
        let always: Vec<String> = rows
            .iter()
            .filter(|r| r.get::<_, bool>(10))
            .map(|r| r.get::<_, String>(0))
            .filter(|c| table.columns.iter().any(|(p, _)| p == c))
            .collect();
        if !always.is_empty() && updated.get(i).copied().unwrap_or(true) {
            if let Some((identity, key)) = source_key(source, table).await {
                // (No key but FULL: the source refuses UPDATEs of the table while published.)
                let keyless = identity != "f" && key.is_empty();
                let written: Vec<String> = always
                    .iter()
                    .filter(|c| identity != "f" && !keyless && !key.contains(c))
                    .map(|c| quote_ident(c))
                    .collect();
                if !written.is_empty() {
                    report.problem(format!(
                        "column(s) {} of target table {qualified} are GENERATED ALWAYS AS IDENTITY, outside the source's replica identity key: the source sends their values with every UPDATE, and PostgreSQL lets an UPDATE write such a column only if it is GENERATED BY DEFAULT, so the first UPDATE of the table would stop pgapply: {} on the target (after a cutover, SET GENERATED ALWAYS gives it back)",
                        written.join(", "),
                        written
                            .iter()
                            .map(|c| format!("ALTER TABLE {qualified} ALTER COLUMN {c} SET GENERATED BY DEFAULT;"))
                            .collect::<Vec<_>>()
                            .join(" ")
                    ));
                }
            }
        }
        if truncates && !rows[0].get::<_, bool>(6) {
            report.problem(format!(
                "the publications replicate TRUNCATE, but the target role may not truncate {qualified}: GRANT TRUNCATE ON {qualified} TO {me}"
            ));
        }
        if copy_pending && !emptied.contains(&qualified) {
            match dst
                .query_one(
                    &format!("SELECT EXISTS (SELECT 1 FROM {qualified})"),
                    &[],
                )
                .await
            {
                Ok(r) if r.get::<_, bool>(0) => report.problem(format!(
                    "target table {qualified} is not empty, and --copy-data copies into empty tables: empty it, or add --truncate-target"
                )),
                Ok(_) => {}
                Err(e) => report.problem(format!("target table {qualified}: {}", describe_postgres(&e))),
            }
        }
        let mut fine = true;
        // A target column the source does not send gets its default: without one, NOT NULL
        // refuses every new row.
        for r in &rows {
            let column: String = r.get(0);
            if r.get::<_, bool>(5) && !table.columns.iter().any(|(c, _)| *c == column) {
                fine = false;
                report.problem(format!(
                    "column {} of {qualified} is NOT NULL without a default on the target, but the source does not send it: give it a default or drop NOT NULL (ALTER TABLE {qualified} ALTER COLUMN {} DROP NOT NULL)",
                    quote_ident(&column),
                    quote_ident(&column)
                ));
            }
        }
        for (column, source_type) in &table.columns {
            match rows.iter().find(|r| r.get::<_, String>(0) == *column) {
                None => {
                    fine = false;
                    // Target columns of that type the source no longer sends: one may be the
                    // column under its old name, whose values an added column would not have.
                    let candidates: Vec<String> = rows
                        .iter()
                        .filter(|r| {
                            r.get::<_, String>(1) == *source_type
                                && !r.get::<_, bool>(3)
                                && !table
                                    .columns
                                    .iter()
                                    .any(|(c, _)| *c == r.get::<_, String>(0))
                        })
                        .map(|r| quote_ident(&r.get::<_, String>(0)))
                        .collect();
                    let renamed = match candidates.as_slice() {
                        [] => String::new(),
                        [one] => format!(
                            "; or, if the source renamed {one} to {new}, rename it on the target instead (ALTER TABLE {qualified} RENAME COLUMN {one} TO {new})",
                            new = quote_ident(column)
                        ),
                        more => format!(
                            "; or, if the source renamed one of {} to {}, rename that one on the target instead",
                            more.join(", "),
                            quote_ident(column)
                        ),
                    };
                    let definition = match source {
                        Some(src) => source_column_definition(src, table, column).await,
                        None => String::new(),
                    };
                    let note = if definition.starts_with(" DEFAULT ") {
                        " (as on the source, the default fills the rows already there)"
                    } else {
                        ""
                    };
                    report.problem(format!(
                        "column {} of {qualified} is published but missing on the target: ALTER TABLE {qualified} ADD COLUMN {} {source_type}{definition}{note}{renamed}",
                        quote_ident(column),
                        quote_ident(column)
                    ));
                }
                Some(r) if r.get::<_, bool>(3) => {
                    fine = false;
                    let version = crate::sql::server_version(dst).await.ok();
                    report.problem(format!(
                        "column {} of {qualified} is generated on the target but published by the source: {}",
                        quote_ident(column),
                        crate::sql::generated_column_fix(&qualified, &quote_ident(column), version)
                    ));
                }
                Some(r) => {
                    let target_type: String = r.get(1);
                    if target_type != *source_type
                        && !compatible(source_type, &target_type, &r.get::<_, String>(2))
                    {
                        fine = false;
                        report.problem(format!(
                            "column {} of {qualified} is {source_type} on the source but {target_type} on the target: values may not convert",
                            quote_ident(column)
                        ));
                    } else if let Some(how) = narrower(source_type, &target_type) {
                        fine = false;
                        report.warning(format!(
                            "column {} of {qualified} is {source_type} on the source but {target_type} on the target, which {how}: make it {source_type} on the target (ALTER TABLE {qualified} ALTER COLUMN {} TYPE {source_type})",
                            quote_ident(column),
                            quote_ident(column)
                        ));
                    }
                }
            }
        }
        // An enum's values: ALTER TYPE .. ADD VALUE is not replicated, and a value the target's
        // type lacks stops the apply when a row brings it.
        let target_enums: Vec<(String, Vec<String>)> = rows
            .iter()
            .filter_map(|r| Some((r.get::<_, String>(0), r.get::<_, Option<Vec<String>>>(7)?)))
            .filter(|(c, _)| table.columns.iter().any(|(p, _)| p == c))
            .collect();
        if let (Some(src), false) = (source, target_enums.is_empty()) {
            let source_enums = src
                .query(
                    "SELECT a.attname::text, pg_catalog.format_type(a.atttypid, NULL), \
                            (SELECT array_agg(e.enumlabel::text ORDER BY e.enumsortorder) FROM pg_catalog.pg_enum e WHERE e.enumtypid = a.atttypid) \
                     FROM pg_catalog.pg_attribute a \
                     WHERE a.attrelid = $1::text::pg_catalog.regclass AND a.attnum > 0 AND NOT a.attisdropped",
                    &[&table.qualified()],
                )
                .await
                .unwrap_or_default();
            for (column, labels) in &target_enums {
                let Some(source_row) = source_enums
                    .iter()
                    .find(|r| r.get::<_, String>(0) == *column)
                else {
                    continue;
                };
                let Some(source_labels) = source_row.get::<_, Option<Vec<String>>>(2) else {
                    continue;
                };
                let lacking: Vec<String> = source_labels
                    .iter()
                    .filter(|l| !labels.contains(l))
                    .map(|l| crate::sql::shown_literal(l))
                    .collect();
                if !lacking.is_empty() {
                    fine = false;
                    report.problem(format!(
                        "column {} of {qualified}: its enum type on the target lacks value(s) the source's type {} has: {} (ALTER TYPE .. ADD VALUE is not replicated; a row bringing one would stop pgapply): add them on the target (ALTER TYPE ... ADD VALUE ..., in the source's order)",
                        quote_ident(column),
                        source_row.get::<_, String>(1),
                        lacking.join(", ")
                    ));
                }
            }
        }
        // A column generated on the source is not published (before 18, or without
        // publish_generated_columns): a plain target column of that name is never filled.
        if let Some(src) = source {
            let generated = src
                .query(
                    "SELECT a.attname::text FROM pg_catalog.pg_attribute a \
                     WHERE a.attrelid = $1::text::pg_catalog.regclass AND a.attnum > 0 AND NOT a.attisdropped \
                       AND coalesce(to_jsonb(a) ->> 'attgenerated', '') <> '' ORDER BY a.attnum",
                    &[&table.qualified()],
                )
                .await
                .map(|rows| rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>())
                .unwrap_or_default();
            for column in generated {
                let plain_on_target = rows
                    .iter()
                    .any(|r| r.get::<_, String>(0) == column && !r.get::<_, bool>(3));
                if plain_on_target && !table.columns.iter().any(|(c, _)| *c == column) {
                    fine = false;
                    report.warning(format!(
                        "column {} of {qualified} is generated on the source, which does not publish its values, and a plain column on the target: it stays empty (NULL or its default) there; make it generated on the target too (the same GENERATED ALWAYS AS expression), or on a PostgreSQL 18 source publish it (publish_generated_columns = stored)",
                        quote_ident(&column)
                    ));
                }
            }
        }
        if let Some(advice) = key_advice(dst, source, table, &qualified).await {
            fine = false;
            report.warning(advice);
        }
        if fine {
            report.ok(format!("table {qualified} matches on the target"));
        }
    }
}

/// `relation::key_index_advice` for one published table: its key read from the source's replica
/// identity (nothing said for REPLICA IDENTITY NOTHING, or without the source).
async fn key_advice(
    dst: &Client,
    source: Option<&Client>,
    table: &crate::copy::PublishedTable,
    qualified: &str,
) -> Option<String> {
    let (identity, key) = source_key(source, table).await?;
    let key = match identity.as_str() {
        "f" => Vec::new(),
        // No key (or none to find rows by): UPDATE and DELETE are refused on the source anyway.
        _ if key.is_empty() => return None,
        _ => key,
    };
    let target = crate::relation::load_target_table(dst, &table.target_schema, &table.target_name)
        .await
        .ok()??;
    debug_assert_eq!(target.qualified, qualified);
    crate::relation::key_index_advice(dst, &target, &key).await
}

/// A published table's replica identity on the source (`relreplident`) and the columns of its
/// key (none for FULL or NOTHING, or without a key).
async fn source_key(
    source: Option<&Client>,
    table: &crate::copy::PublishedTable,
) -> Option<(String, Vec<String>)> {
    let row = source?
        .query_one(
            "SELECT c.relreplident::text, ARRAY(SELECT a.attname::text FROM pg_catalog.pg_index i \
                      JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey) \
                      WHERE i.indrelid = c.oid \
                        AND ((c.relreplident = 'd' AND i.indisprimary) OR (c.relreplident = 'i' AND i.indisreplident)) \
                      ORDER BY array_position(i.indkey::int2[], a.attnum)) \
             FROM pg_catalog.pg_class c WHERE c.oid = $1::text::pg_catalog.regclass",
            &[&table.qualified()],
        )
        .await
        .ok()?;
    Some((row.get(0), row.get(1)))
}

/// The rest of a source column's definition for ADD COLUMN on the target: its default and NOT
/// NULL (` DEFAULT 5 NOT NULL`), so that the rows already there get the source's values. Empty
/// if it has neither, or cannot be read.
async fn source_column_definition(
    src: &Client,
    table: &crate::copy::PublishedTable,
    column: &str,
) -> String {
    let row = src
        .query_opt(
            "SELECT pg_catalog.pg_get_expr(d.adbin, d.adrelid), a.attnotnull, \
                    coalesce(d.adbin::text LIKE '%SQLVALUEFUNCTION%', false) \
             FROM pg_catalog.pg_attribute a \
             LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
             WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attname = $2 \
               AND coalesce(to_jsonb(a) ->> 'attgenerated', '') = ''",
            &[&table.qualified(), &column],
        )
        .await;
    let Ok(Some(row)) = row else {
        return String::new();
    };
    let (default, not_null): (Option<String>, bool) = (row.get(0), row.get(1));
    // CURRENT_TIMESTAMP, CURRENT_USER and the like print without parentheses.
    let value_function: bool = row.get(2);
    // A constant (`5`, `'x'::text`) fills the rows already there as on the source; a function
    // call (`now()`, `nextval(..)`) gives them other values than the source's, and NOT NULL
    // without a default fails on a table with rows: then the values are to be copied.
    match default {
        Some(default) if !default.contains('(') && !value_function => {
            format!(" DEFAULT {default}{}", if not_null { " NOT NULL" } else { "" })
        }
        Some(default) => format!(
            " (the source's default, {default}, computes each row's value: the rows already on the target would get other values than the source's, so copy them from the source, then SET DEFAULT{})",
            if not_null { " and SET NOT NULL" } else { "" }
        ),
        None if not_null => {
            " (NOT NULL on the source: copy the values of the rows already there from the source, then SET NOT NULL)".to_owned()
        }
        None => String::new(),
    }
}

/// How a target type of the same family holds less than the source's, if it does: what then
/// happens to the values that do not fit (refused, or rounded without a word).
fn narrower(source: &str, target: &str) -> Option<&'static str> {
    // Arrays: as their elements.
    if let (Some(s), Some(t)) = (
        source.trim().strip_suffix("[]"),
        target.trim().strip_suffix("[]"),
    ) {
        return narrower(s, t);
    }
    let ((s, s_mod), (t, t_mod)) = (split_type(source), split_type(target));
    let integer_rank = |t: &str| match t {
        "smallint" => Some(1),
        "integer" => Some(2),
        "bigint" => Some(3),
        _ => None,
    };
    let refused = Some("refuses the source's values that do not fit");
    let rounded = Some("rounds the source's values without a word");
    match (integer_rank(&s), integer_rank(&t)) {
        (Some(a), Some(b)) if b < a => return refused,
        (None, Some(_)) if ["numeric", "real", "double precision"].contains(&s.as_str()) => {
            return Some("refuses the source's values with a fraction, and those too large")
        }
        _ => {}
    }
    match (s.as_str(), t.as_str()) {
        ("double precision", "real") => return rounded,
        ("numeric", "real" | "double precision") => return rounded,
        // numeric(precision, scale): fewer decimals round, fewer digits refuse.
        ("numeric", "numeric") => {
            let scale = |m: &[u32]| m.get(1).copied().unwrap_or(0);
            return match (s_mod.first(), t_mod.first()) {
                (_, None) => None,
                (None, Some(_)) => rounded,
                (Some(_), Some(_)) if scale(&t_mod) < scale(&s_mod) => rounded,
                (Some(a), Some(b)) if b - scale(&t_mod).min(*b) < a - scale(&s_mod).min(*a) => {
                    refused
                }
                _ => None,
            };
        }
        // Fractional digits of seconds (6 without a precision): fewer round.
        (
            "timestamp with time zone"
            | "timestamp without time zone"
            | "time with time zone"
            | "time without time zone"
            | "interval",
            _,
        ) if s == t => {
            let digits = |m: &[u32]| m.first().copied().unwrap_or(6);
            return (digits(&t_mod) < digits(&s_mod)).then_some(
                "rounds the source's values to fewer fractional digits of a second without a word",
            );
        }
        _ => {}
    }
    let text = ["text", "character varying", "character"];
    if text.contains(&s.as_str()) && text.contains(&t.as_str()) {
        // A length: the longest value the type holds (text, and varchar without one: unbounded).
        let length = |base: &str, m: &[u32]| match base {
            "text" => None,
            "character" => Some(m.first().copied().unwrap_or(1)),
            _ => m.first().copied(),
        };
        return match (length(&s, &s_mod), length(&t, &t_mod)) {
            (None, Some(_)) => refused,
            (Some(a), Some(b)) if b < a => refused,
            _ => None,
        };
    }
    None
}

/// A type as `format_type` names it, without its modifiers, and the modifiers:
/// "numeric(10,2)" -> ("numeric", [10, 2]); "timestamp(3) with time zone" -> ("timestamp with
/// time zone", [3]); "character varying" -> (.., []). (An array's "[]" stays in the name.)
fn split_type(t: &str) -> (String, Vec<u32>) {
    // An array: its element's modifiers, the marker kept on the name ("numeric(12,2)[]").
    if let Some(element) = t.trim().strip_suffix("[]") {
        let (base, modifiers) = split_type(element);
        return (format!("{base}[]"), modifiers);
    }
    match (t.find('('), t.find(')')) {
        (Some(open), Some(close)) if open < close => {
            let modifiers = t[open + 1..close]
                .split(',')
                .filter_map(|m| m.trim().parse().ok())
                .collect();
            let base = format!("{} {}", t[..open].trim_end(), t[close + 1..].trim_start());
            (base.trim().to_owned(), modifiers)
        }
        _ => (t.trim().to_owned(), Vec::new()),
    }
}

/// Different type names that still take each other's text form: same family of numbers, text or
/// times (by the target type's category), a length/precision change of the same type, or the
/// same type name in another schema (an extension installed elsewhere on the target, say).
fn compatible(source: &str, target: &str, target_category: &str) -> bool {
    let base = |t: &str| split_type(t).0;
    if base(source) == base(target) {
        return true;
    }
    // The name after the schema: `public.citext` and `extensions.citext` alike.
    let unqualified = |t: &str| {
        let b = base(t);
        match b.rfind("\".") {
            Some(i) if b.ends_with('"') => b[i + 2..].to_owned(),
            _ => b.rsplit('.').next().unwrap_or(&b).to_owned(),
        }
    };
    if unqualified(source) == unqualified(target) {
        return true;
    }
    let numeric = [
        "smallint",
        "integer",
        "bigint",
        "numeric",
        "real",
        "double precision",
    ];
    let text = ["text", "character varying", "character", "name"];
    let times = ["timestamp without time zone", "timestamp with time zone"];
    let family = |list: &[&str]| {
        list.contains(&base(source).as_str()) && list.contains(&base(target).as_str())
    };
    family(&numeric)
        || family(&text)
        || family(&times)
        || (target_category == "S" && text.contains(&base(source).as_str()))
}

#[cfg(test)]
mod tests {
    use super::{compatible, narrower};

    #[test]
    fn type_names_compare_as_the_target_takes_them() {
        assert!(compatible("integer", "bigint", "N"));
        assert!(compatible(
            "character varying(10)",
            "character varying(20)",
            "S"
        ));
        // The same type, named from another search_path or installed in another schema.
        assert!(compatible("\"My Schema\".\"Mood\"", "\"Mood\"", "E"));
        assert!(compatible("public.citext", "extensions.citext", "S"));
        assert!(compatible("public.citext[]", "ext.citext[]", "A"));
        assert!(!compatible("text", "integer", "N"));
        assert!(narrower("bigint", "integer").is_some());
        assert!(narrower("integer", "bigint").is_none());
        assert!(narrower("numeric", "integer").is_some());
        assert!(narrower("numeric(10,4)", "numeric(10,2)").is_some());
        assert!(narrower("numeric(10,2)", "numeric(8,2)").is_some());
        assert!(narrower("numeric(8,2)", "numeric(12,4)").is_none());
        assert!(narrower("numeric(8,2)", "numeric").is_none());
        assert!(narrower("numeric", "double precision").is_some());
        assert!(narrower("character varying(20)", "character varying(10)").is_some());
        assert!(narrower("text", "character varying(10)").is_some());
        assert!(narrower("character varying(10)", "text").is_none());
        assert!(narrower("character(3)", "character varying(5)").is_none());
        assert!(!compatible("public.mood", "public.feeling", "E"));
        // A precision of fractional seconds: the same type, fewer digits round.
        assert!(compatible(
            "timestamp with time zone",
            "timestamp(0) with time zone",
            "D"
        ));
        assert!(narrower("timestamp with time zone", "timestamp(0) with time zone").is_some());
        assert!(narrower(
            "timestamp(3) without time zone",
            "timestamp without time zone"
        )
        .is_none());
        assert!(narrower("interval", "interval(2)").is_some());
        assert!(narrower("time(2) with time zone", "time(4) with time zone").is_none());
        assert!(!compatible(
            "timestamp with time zone",
            "time with time zone",
            "D"
        ));
        // Arrays: their elements compared.
        assert!(narrower("numeric(12,2)[]", "numeric(10,2)[]").is_some());
        assert!(narrower("character varying(20)[]", "character varying(10)[]").is_some());
        assert!(narrower("character varying(10)[]", "text[]").is_none());
        assert!(compatible(
            "character varying(20)[]",
            "character varying(10)[]",
            "A"
        ));
    }
}
