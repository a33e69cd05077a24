//! The source's part of `pgapply check`: settings, role, slot and publications.

use tokio_postgres::Client;

use super::{query_bool, server_version, source_system_id, Report};
use crate::copy::published_tables;
use crate::error::describe_postgres;
use crate::sql::quote_ident;

/// The source database's unlogged tables, which no publication can hold (not even FOR ALL
/// TABLES): a migration leaves them, and their rows, behind unless the user moves them.
async fn unlogged_tables(src: &Client) -> Option<String> {
    let rows = src
        .query(
            "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname) FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.relpersistence = 'u' AND c.relkind IN ('r', 'p') \
               AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_%' \
             ORDER BY 1 LIMIT 21",
            &[],
        )
        .await
        .ok()?;
    if rows.is_empty() {
        return None;
    }
    let mut names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let more = if names.len() > 20 {
        names.truncate(20);
        ", and more"
    } else {
        ""
    };
    Some(format!(
        "unlogged table(s) on the source: {}{more}: PostgreSQL replicates no unlogged table (no publication holds one, FOR ALL TABLES included), so neither `schema`, the copy nor the stream takes them; for a migration, create them on the target and copy their rows yourself (or ALTER TABLE ... SET LOGGED on the source and add them to the publication)",
        names.join(", ")
    ))
}

pub(super) async fn check_source(
    src: &Client,
    dst: Option<&Client>,
    config: &crate::replicate::RunConfig,
    report: &mut Report,
    tables: &mut Vec<crate::copy::PublishedTable>,
    (truncated, updated): (&mut Vec<bool>, &mut Vec<bool>),
) {
    // Progress from another source: what the target applied says nothing of this source's slot.
    let mut other_source = false;
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
        // The slot's progress on the target, made from another source: `run` refuses it.
        let recorded: Option<String> = dst
            .query_opt(
                "SELECT source_system_id FROM pgapply.progress WHERE slot_name = $1",
                &[&config.slot],
            )
            .await
            .ok()
            .flatten()
            .and_then(|r| r.get(0));
        if let Some(id) = recorded.filter(|id| *id != system_id) {
            other_source = true;
            report.problem(format!(
                "the target holds progress for slot {:?} from another source (system identifier {id}, this source is {system_id}): is --source the server this slot replicates from? Otherwise give this source another --slot (or, if that other source's worker is gone for good and the target should start over for this one: pgapply forget --slot {})",
                config.slot, config.slot
            ));
        }
    }
    // What the target applied from the slot already: a slot gone since cannot be replaced by a
    // new one without losing the changes in between.
    let applied: Option<String> = match dst.filter(|_| !other_source) {
        Some(dst) => dst
            .query_opt(
                "SELECT nullif(greatest(p.lsn, p.applied_lsn, o.end_lsn), '0/0')::text FROM pgapply.progress p \
                 LEFT JOIN pgapply.origin_commit o ON o.origin_name = 'pgapply_' || p.slot_name \
                 WHERE p.slot_name = $1",
                &[&config.slot],
            )
            .await
            .ok()
            .flatten()
            .and_then(|r| r.get(0)),
        None => None,
    };
    if let (Some(dst), Some(applied)) = (dst, applied.as_deref()) {
        if let Some(problem) = not_the_server_applied_from(src, dst, &config.slot, applied).await {
            report.problem(problem);
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
            if config.failover_slot
                && version >= 170000
                && query_bool(
                    src,
                    "SELECT pg_catalog.current_setting('synchronized_standby_slots') = ''",
                    &[],
                )
                .await
                .unwrap_or(false)
            {
                report.warning(crate::source::STANDBY_SLOTS_UNSET);
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
        Ok(false) => {
            let (role, _) = crate::sql::role_and_database(src).await;
            report.problem(format!("the source role lacks the REPLICATION attribute: ALTER ROLE {role} REPLICATION (or use a superuser)"))
        }
        Err(e) => report.problem(format!(
            "source: cannot read the role's attributes (pg_roles): {e}"
        )),
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
    match operations_left_out(src, &existing).await {
        Ok(left_out) => {
            for warning in left_out {
                report.warning(warning);
            }
        }
        Err(e) => report.problem(e.to_string()),
    }
    if let Some(warning) = unlogged_tables(src).await {
        report.warning(warning);
    }
    if let Some(dst) = dst {
        if let Some(warning) = crate::replicate::replication_loop(
            src,
            dst,
            config.requested.origin_none,
            (&existing, &config.table_map),
        )
        .await
        {
            report.warning(warning);
        }
        if let Some(warning) = crate::replicate::copy_across_origins(
            src,
            config.requested.origin_none,
            config.copy_data,
            &existing,
        )
        .await
        {
            report.warning(warning);
        }
        for shared in crate::replicate::tables_shared_with_other_slots(
            src,
            dst,
            &config.slot,
            &existing,
            &config.table_map,
        )
        .await
        {
            report.warning(shared);
        }
    }
    match src
        .query_opt(
            "SELECT plugin::text, database::text = current_database(), active_pid, \
                    coalesce(database::text, ''), \
                    coalesce(to_jsonb(s) ->> 'wal_status', '') = 'lost' OR coalesce(to_jsonb(s) ->> 'invalidation_reason', '') <> '', \
                    confirmed_flush_lsn::text \
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
            } else if let Some(problem) = slot_ahead(dst, config, row.get(5), applied.as_deref()).await {
                report.problem(problem);
            } else {
                report.ok(format!("slot {:?} exists (pgoutput)", config.slot));
            }
        }
        Ok(None) if !config.copy_data && applied.is_some() => report.problem(format!(
            "replication slot {:?} no longer exists on the source, but pgapply applied changes from it up to {}: a new slot would start after changes that were never applied. Start over with --copy-data --truncate-target (copies the published tables again into a new slot)",
            config.slot,
            applied.as_deref().unwrap_or_default()
        )),
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
            format!("SELECT n.nspname::text, c.relname::text, c.relreplident::text, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary AND i.indimmediate), \
                    has_table_privilege($1::text::regclass, 'SELECT'), {usable_index} \
             FROM pg_partition_tree($1::text::regclass) t JOIN pg_class c ON c.oid = t.relid \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE t.isleaf")
        } else {
            format!("SELECT n.nspname::text, c.relname::text, c.relreplident::text, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary AND i.indimmediate), \
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
                        if identity == "n" {
                            let default = if has_pk {
                                format!(
                                    "ALTER TABLE {name} REPLICA IDENTITY DEFAULT (its primary key)"
                                )
                            } else {
                                "add a primary key".to_owned()
                            };
                            report.warning(format!(
                                "table {name} has REPLICA IDENTITY NOTHING on the source: UPDATE and DELETE on it fail on the source while it is published (fine if it only gets INSERTs); otherwise {default}{index} or ALTER TABLE {name} REPLICA IDENTITY FULL"
                            ));
                        } else {
                            report.warning(format!(
                                "table {name} has no primary key (a DEFERRABLE one does not count) and no replica identity on the source: UPDATE and DELETE on it fail on the source while it is published (fine if it only gets INSERTs); otherwise add a primary key{index} or ALTER TABLE {name} REPLICA IDENTITY FULL"
                            ));
                        }
                    }
                }
                // Published through the root: PostgreSQL describes the partitions' changes by the
                // root's replica identity (its key columns, or FULL), and sends their old rows
                // as the partitions' identities give them. Both must say the same.
                if table.partitioned && updates_published {
                    // (A problem: every such UPDATE or DELETE is lost on the target.)
                    if let Some(problem) = root_identity_problem(src, &qualified, &rows).await {
                        identified = false;
                        report.problem(problem);
                    }
                }
                if identified {
                    report.ok(format!("table {qualified} has a replica identity"));
                }
                let Some(row) = rows.first() else { continue };
                if config.copy_data && !row.get::<_, bool>(4) {
                    let (role, _) = crate::sql::role_and_database(src).await;
                    report.problem(format!("the source role may not SELECT from {qualified} (needed by --copy-data): GRANT SELECT ON {qualified} TO {role}"));
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
/// What `run` refuses at its start, said here too: a source whose WAL ends before what the
/// target applied from it, or on a timeline older than the one the target applied from (an old
/// primary started again after a failover). (A timeline that forked below the position needs the
/// source's timeline history, which only `run` reads.)
async fn not_the_server_applied_from(
    src: &Client,
    dst: &Client,
    slot: &str,
    applied: &str,
) -> Option<String> {
    let applied: crate::protocol::Lsn = applied.parse().ok()?;
    let row = src
        .query_one(
            "SELECT CASE WHEN pg_catalog.pg_is_in_recovery() \
                         THEN pg_catalog.pg_last_wal_replay_lsn() \
                         ELSE pg_catalog.pg_current_wal_lsn() END::text, \
                    pg_catalog.pg_is_in_recovery(), \
                    CASE WHEN NOT pg_catalog.pg_is_in_recovery() THEN \
                         ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))::bit(32)::bigint END",
            &[],
        )
        .await
        .ok()?;
    // (The timeline from the current WAL file's name: the last checkpoint's may still be the
    // old one for minutes after a promotion.)
    let (wal_end, standby, timeline): (Option<String>, bool, Option<i64>) =
        (row.get(0), row.get(1), row.get(2));
    let wal_end: crate::protocol::Lsn = wal_end?.parse().ok()?;
    let recorded: Option<i64> = dst
        .query_opt(
            "SELECT source_timeline FROM pgapply.progress WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ok()
        .flatten()
        .and_then(|r| r.get(0));
    let advice = "stop it, or point --source at the server that took over; if it is the right server, compare the tables (pgapply verify) and start over as `run` would say";
    if applied > wal_end && !standby {
        return Some(format!(
            "the target has applied changes from this source up to {applied}, but the source's WAL ends at {wal_end}: it is not the server those changes came from (a standby that was behind was promoted, the server was restored from a backup, or an old primary started again after a failover); `run` refuses it: {advice}"
        ));
    }
    match (recorded, timeline) {
        (Some(recorded), Some(timeline)) if timeline < recorded && !standby => Some(format!(
            "the target has applied changes of the source's timeline {recorded}, but this source is on timeline {timeline}: it is not the server those changes came from (an old primary started again after a failover, say); `run` refuses it: {advice}"
        )),
        _ => None,
    }
}

/// A slot that confirmed more than the target applied (and more than pgapply ever reported):
/// dropped and made again, or consumed by another client. `run` refuses it; said the same way.
async fn slot_ahead(
    dst: Option<&Client>,
    config: &crate::replicate::RunConfig,
    confirmed: Option<String>,
    applied: Option<&str>,
) -> Option<String> {
    let lsn = |t: &str| t.parse::<crate::protocol::Lsn>().ok();
    let confirmed = lsn(confirmed.as_deref()?)?;
    let applied = lsn(applied?)?;
    let reported = dst?
        .query_opt(
            "SELECT reported_lsn::text FROM pgapply.progress WHERE slot_name = $1",
            &[&config.slot],
        )
        .await
        .ok()
        .flatten()
        .and_then(|r| r.get::<_, Option<String>>(0))
        .and_then(|t| lsn(&t))?;
    (confirmed > applied.max(reported)).then(|| format!(
        "replication slot {:?} on the source has confirmed changes up to {confirmed}, but the target applied them only up to {applied}: the changes between are no longer in the slot (the slot was dropped and made again, or another client consumed it, or the target was restored from an older backup); `run` refuses to go on. Start over with a new slot and the initial copy (SELECT pg_drop_replication_slot({}) on the source, then run with --copy-data --truncate-target)",
        config.slot,
        crate::sql::quote_literal(&config.slot)
    ))
}

pub(super) async fn publication_rule_problems(
    src: &Client,
    publications: &[String],
    qualified: &str,
) -> Vec<String> {
    // Row filters and column lists exist from PostgreSQL 15.
    match crate::sql::server_version(src).await {
        Ok(v) if v >= 150000 => {}
        _ => return Vec::new(),
    }
    // The row filter is the published table's; the source checks it against the replica
    // identity of the table a change is made in: for a partitioned table published through its
    // root, each partition's own (a FULL root over partitions with a key is refused). Columns
    // go by name: a partition's attribute numbers may differ from its root's.
    let filters = match src
        .query(
            "WITH leaves AS ( \
               SELECT t.relid AS oid FROM pg_catalog.pg_partition_tree($1::text::pg_catalog.regclass) t WHERE t.isleaf \
               UNION SELECT $1::text::pg_catalog.regclass), \
             ri AS ( \
               SELECT c.oid, c.relreplident, \
                      ARRAY(SELECT a.attname FROM pg_catalog.pg_index i JOIN pg_catalog.pg_attribute a \
                              ON a.attrelid = i.indrelid AND a.attnum = ANY ((i.indkey::int2[])[0:i.indnkeyatts - 1]) \
                            WHERE i.indrelid = c.oid \
                              AND ((c.relreplident = 'd' AND i.indisprimary) OR (c.relreplident = 'i' AND i.indisreplident))) AS cols \
               FROM leaves l JOIN pg_catalog.pg_class c ON c.oid = l.oid WHERE c.relkind = 'r') \
             SELECT p.pubname::text, ri.oid = $1::text::pg_catalog.regclass, ri.oid::pg_catalog.regclass::text, \
               (SELECT string_agg(pg_catalog.quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_catalog.pg_attribute a \
                WHERE a.attrelid = pr.prrelid \
                  AND a.attnum IN (SELECT m[1]::int2 FROM regexp_matches(pr.prqual::text, ':varattno (\\d+)', 'g') m) \
                  AND NOT (a.attname = ANY (ri.cols))) \
             FROM pg_catalog.pg_publication p JOIN pg_catalog.pg_publication_rel pr ON pr.prpubid = p.oid \
             CROSS JOIN ri \
             WHERE pr.prrelid = $1::text::pg_catalog.regclass AND p.pubname = ANY ($2) AND (p.pubupdate OR p.pubdelete) \
               AND pr.prqual IS NOT NULL AND ri.relreplident <> 'f' \
               AND (ri.oid = $1::text::pg_catalog.regclass OR p.pubviaroot) \
             ORDER BY 1, 2 DESC, 3",
            &[&qualified, &publications],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => {
            return vec![format!(
                "source: cannot read the publications' row filters of {qualified}: {}",
                describe_postgres(&e)
            )]
        }
    };
    let mut problems = Vec::new();
    // Per publication: the filter's columns outside the identity of the table itself, and of
    // each of its partitions (name, columns).
    type Outside = (String, Option<String>, Vec<(String, String)>);
    let mut outside: Vec<Outside> = Vec::new();
    for row in filters {
        let (publication, itself, table): (String, bool, String) =
            (row.get(0), row.get(1), row.get(2));
        let Some(columns) = row.get::<_, Option<String>>(3) else {
            continue;
        };
        if outside.last().is_none_or(|(p, ..)| *p != publication) {
            outside.push((publication, None, Vec::new()));
        }
        if let Some(entry) = outside.last_mut() {
            if itself {
                entry.1 = Some(columns);
            } else {
                entry.2.push((table, columns));
            }
        }
    }
    for (publication, own, partitions) in outside {
        match (own, partitions.as_slice()) {
            (Some(columns), []) => problems.push(format!(
                "the row filter of publication {publication:?} on {qualified} uses {columns}, outside the table's replica identity: the source refuses every UPDATE and DELETE of {qualified} while it is published so; filter on replica identity columns only, or ALTER TABLE {qualified} REPLICA IDENTITY FULL (not with a column list, which FULL refuses) or USING INDEX on an index that covers them"
            )),
            (_, []) => {}
            (_, partitions) => problems.push(format!(
                "the row filter of publication {publication:?} on {qualified} (published through its root) uses columns outside the replica identity of its partition(s) {}: the source checks each partition's own, and refuses every UPDATE and DELETE of them while it is published so; filter on replica identity columns only, or set it on each of them: {}",
                partitions
                    .iter()
                    .map(|(t, c)| format!("{t} ({c})"))
                    .collect::<Vec<_>>()
                    .join(", "),
                partitions
                    .iter()
                    .map(|(t, _)| format!("ALTER TABLE {t} REPLICA IDENTITY FULL;"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )),
        }
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
                WHERE a.attrelid = ri.oid AND pr.prattrs IS NOT NULL \
                  AND a.attnum = ANY (coalesce(ri.cols, '{}')) AND NOT (a.attnum = ANY (pr.prattrs::int2[]))), \
               ri.relreplident = 'f' AND pr.prattrs IS NOT NULL \
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
                "source: cannot read the publications' column lists of {qualified}: {}",
                describe_postgres(&e)
            )]
        }
    };
    for row in rows {
        let publication: String = row.get(0);
        if row.get::<_, bool>(2) {
            problems.push(format!(
                "publication {publication:?} publishes {qualified} with a column list, and the table has REPLICA IDENTITY FULL on the source, which PostgreSQL refuses with any column list: every UPDATE and DELETE of {qualified} fails on the source while it is published so (\"Column list used by the publication does not cover the replica identity\"). Publish it without a column list (ALTER PUBLICATION {} SET TABLE {qualified}, with its other tables), or give it a key the list covers (a primary key, or REPLICA IDENTITY USING INDEX)",
                quote_ident(&publication)
            ));
            continue;
        }
        if let Some(columns) = row.get::<_, Option<String>>(1) {
            problems.push(format!(
                "the column list of publication {publication:?} on {qualified} leaves out replica identity column(s) {columns}: the source refuses every UPDATE and DELETE of {qualified} while it is published so; add them to the column list (ALTER PUBLICATION ... SET TABLE {qualified} (...))"
            ));
        }
    }
    // PostgreSQL 18 publishes generated columns only if asked (and virtual ones never), and a
    // FULL identity must not hold one it leaves out.
    let unpublished = src
        .query(
            "SELECT pt.pubname::text, string_agg(DISTINCT pg_catalog.quote_ident(a.attname), ', ') \
             FROM pg_catalog.pg_publication_tables pt \
             JOIN pg_catalog.pg_class c ON c.oid = $2::text::pg_catalog.regclass \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid \
             WHERE pg_catalog.current_setting('server_version_num')::int >= 180000 \
               AND pt.pubname = ANY ($1) AND pt.schemaname = n.nspname AND pt.tablename = c.relname \
               AND c.relreplident = 'f' AND a.attnum > 0 AND NOT a.attisdropped \
               AND (pg_catalog.to_jsonb(a) ->> 'attgenerated') <> '' \
               AND NOT (a.attname = ANY (pt.attnames)) \
             GROUP BY 1 ORDER BY 1",
            &[&publications, &qualified],
        )
        .await;
    if let Ok(rows) = unpublished {
        for row in rows {
            let (publication, columns): (String, String) = (row.get(0), row.get(1));
            problems.push(format!(
                "publication {publication:?} does not publish generated column(s) {columns} of {qualified}, which has REPLICA IDENTITY FULL on the source: PostgreSQL 18 refuses every UPDATE and DELETE of {qualified} while it is published so (\"Replica identity must not contain unpublished generated columns\"). Publish them (ALTER PUBLICATION {} SET (publish_generated_columns = stored), for stored ones: a virtual column cannot be published), or give the table a key (a primary key, or REPLICA IDENTITY USING INDEX)",
                quote_ident(&publication)
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

/// A partitioned table published through its root whose own replica identity does not describe
/// its partitions' changes: none (UPDATE and DELETE arrive with no key pgapply can use), or FULL
/// over partitions that send only their key (the old row's other columns arrive NULL and match
/// nothing). `leaves`: the partitions' rows read above (relreplident in column 2).
async fn root_identity_problem(
    src: &tokio_postgres::Client,
    root: &str,
    leaves: &[tokio_postgres::Row],
) -> Option<String> {
    let row = src
        .query_one(
            "SELECT c.relreplident::text, EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisprimary AND i.indimmediate) \
             FROM pg_catalog.pg_class c WHERE c.oid = $1::text::regclass",
            &[&root],
        )
        .await
        .ok()?;
    let identity: String = row.get(0);
    let has_pk: bool = row.get(1);
    let leaves_full = leaves.iter().all(|l| l.get::<_, String>(2) == "f");
    let later = "changes made before the fix keep the old description and can only be skipped";
    if identity == "n" || (identity == "d" && !has_pk) {
        let fix = if leaves_full {
            format!("ALTER TABLE {root} REPLICA IDENTITY FULL, as its partitions have")
        } else {
            format!("a primary key on {root} (as on its partitions), or ALTER TABLE {root} REPLICA IDENTITY FULL on it and its partitions")
        };
        return Some(format!(
            "partitioned table {root} is published through its root (publish_via_partition_root), and PostgreSQL describes its partitions' UPDATEs and DELETEs by the root's replica identity, which it has none of: pgapply cannot find their rows on the target. Set it on the source: {fix} ({later})"
        ));
    }
    if identity == "f" && !leaves_full {
        return Some(full_root_over_keyed_partitions(root));
    }
    None
}

fn full_root_over_keyed_partitions(root: &str) -> String {
    format!(
        "partitioned table {root} has REPLICA IDENTITY FULL and is published through its root, but some of its partitions do not: their UPDATEs and DELETEs send only the key, and the old row's other columns arrive empty and match no row on the target (each a conflict: update_missing or delete_missing). Set ALTER TABLE ... REPLICA IDENTITY FULL on each partition too (changes made before the fix keep the old description and can only be skipped)"
    )
}

/// The run's roots of that kind (`root_identity_problem`), said at every start as `check` says
/// them: every UPDATE and DELETE of their partitions would be a conflict.
pub(crate) async fn full_roots_over_keyed_partitions(
    src: &Client,
    publications: &[String],
) -> Vec<String> {
    // (Published through a root from 13 on; pg_partition_tree is 12+.)
    let rows = src
        .query(
            "SELECT DISTINCT pt.schemaname::text, pt.tablename::text \
             FROM pg_catalog.pg_publication_tables pt \
             JOIN pg_catalog.pg_class c ON c.oid = format('%I.%I', pt.schemaname, pt.tablename)::regclass \
             WHERE pg_catalog.current_setting('server_version_num')::int >= 130000 \
               AND pt.pubname = ANY ($1) AND c.relkind = 'p' AND c.relreplident = 'f' \
               AND EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree(c.oid) t \
                           JOIN pg_catalog.pg_class l ON l.oid = t.relid \
                           WHERE t.isleaf AND l.relreplident <> 'f') \
             ORDER BY 1, 2",
            &[&publications],
        )
        .await;
    match rows {
        Ok(rows) => rows
            .iter()
            .map(|r| {
                full_root_over_keyed_partitions(&crate::sql::qualified_name(r.get(0), r.get(1)))
            })
            .collect(),
        // (A source before 12 has no pg_partition_tree, and no root published as such.)
        Err(_) => Vec::new(),
    }
}

/// The run's publications that leave out some kinds of change (`publish = 'insert'`, say): the
/// source never sends those, so the target drifts from the source without any error. Said by
/// `check` and at every start. (A table another of the publications publishes with that kind
/// still gets it: said all the same, per publication.)
pub(crate) async fn operations_left_out(
    src: &Client,
    publications: &[String],
) -> crate::error::Result<Vec<String>> {
    let rows = src
        .query(
            "SELECT pubname::text, \
                    ARRAY[CASE WHEN NOT pubinsert THEN 'insert' END, \
                          CASE WHEN NOT pubupdate THEN 'update' END, \
                          CASE WHEN NOT pubdelete THEN 'delete' END, \
                          CASE WHEN (to_jsonb(p) ->> 'pubtruncate') = 'false' THEN 'truncate' END], \
                    to_jsonb(p) ? 'pubtruncate' \
             FROM pg_catalog.pg_publication p WHERE pubname = ANY($1) ORDER BY 1",
            &[&publications],
        )
        .await
        .map_err(|e| crate::error::Error::postgres("reading what the publications publish", e))?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let name: String = r.get(0);
            let left: Vec<String> = r
                .get::<_, Vec<Option<String>>>(1)
                .into_iter()
                .flatten()
                .collect();
            // (PostgreSQL 10 has no TRUNCATE to publish.)
            let all = if r.get::<_, bool>(2) {
                "insert, update, delete, truncate"
            } else {
                "insert, update, delete"
            };
            (!left.is_empty()).then(|| {
                format!(
                    "publication {name:?} does not publish {} (its publish setting): the source never sends those changes for its tables (unless another of the run's publications publishes them), so the target drifts from the source without an error. If that is not meant: ALTER PUBLICATION {} SET (publish = '{all}') on the source; changes made while it was set so are not sent later (`pgapply verify` finds the tables that differ)",
                    left.join(", "),
                    quote_ident(&name)
                )
            })
        })
        .collect())
}
