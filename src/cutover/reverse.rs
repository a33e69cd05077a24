//! Step 6 of the cutover, `--reverse`: a publication and slot on the target (the new primary),
//! for replication back to the source, checked before anything is done and prepared at the end.

use std::time::Duration;

use tokio_postgres::Client;

use crate::copy::published_tables;
use crate::error::{Error, Result};
use crate::replicate::RunConfig;
use crate::sql::quote_ident;

/// What would stop `--reverse` on the target (step 6, after writes are frozen): a slot cannot
/// be made there (wal_level, no free slot), the role may not make one or a publication, or does
/// not own the tables (a publication names only tables its role owns).
pub(super) async fn reverse_problems(
    source: &Client,
    target: &Client,
    config: &RunConfig,
) -> Result<Vec<String>> {
    let reverse = format!("{}_reverse", config.slot);
    let row = target
        .query_one(
            "SELECT current_setting('wal_level'),                     (SELECT rolsuper OR rolreplication FROM pg_catalog.pg_roles WHERE rolname = current_user) OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles g WHERE g.rolname = 'rds_replication' AND pg_catalog.pg_has_role(current_user, g.oid, 'MEMBER')),                     has_database_privilege(current_database(), 'CREATE'),                     current_setting('max_replication_slots')::int                       - (SELECT count(*) FROM pg_catalog.pg_replication_slots)::int                       + (SELECT count(*) FROM pg_catalog.pg_replication_slots WHERE slot_name = $1)::int",
            &[&reverse],
        )
        .await
        .map_err(|e| Error::postgres("reading what --reverse needs on the target", e))?;
    let (wal_level, replication, create, free): (String, Option<bool>, bool, i32) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    let mut problems = Vec::new();
    let (role, database) = crate::sql::role_and_database(target).await;
    if wal_level != "logical" {
        problems.push(format!("--reverse makes a logical replication slot on the target, whose wal_level is {wal_level}: set wal_level = logical there and restart it, or cut over without --reverse"));
    }
    if replication != Some(true) {
        problems.push(format!("--reverse makes a replication slot on the target, which its role may not (it needs REPLICATION, or superuser; on Amazon RDS, rds_replication): ALTER ROLE {role} REPLICATION there, or cut over without --reverse"));
    }
    if !create {
        problems.push(format!("--reverse makes a publication on the target, in a database where its role may not create objects: GRANT CREATE ON DATABASE {database} TO {role}, or cut over without --reverse"));
    }
    if free < 1 {
        problems.push("--reverse makes a replication slot on the target, which has no free one (max_replication_slots): raise it and restart the target, or drop a slot nothing uses".to_owned());
    }
    let published = published_tables(source, &config.publications, &config.table_map).await?;
    let tables: Vec<String> = published.iter().map(|t| t.target_qualified()).collect();
    let not_owned: Vec<(String, String, String, Option<bool>)> = target
        .query(
            "SELECT n, pg_catalog.pg_get_userbyid(c.relowner)::text, current_user::text, \
                    (SELECT rolsuper FROM pg_catalog.pg_roles WHERE oid = c.relowner) \
             FROM unnest($1::text[]) n JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(n) \
             WHERE NOT pg_catalog.pg_has_role(current_user, c.relowner, 'USAGE')",
            &[&tables],
        )
        .await
        .map_err(|e| Error::postgres("reading the tables' owners on the target", e))?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    if let Some((_, _, me, _)) = not_owned.first() {
        let shown: Vec<&str> = not_owned.iter().take(5).map(|(t, ..)| t.as_str()).collect();
        let mut owners: Vec<String> = not_owned
            .iter()
            .map(|(_, o, ..)| crate::sql::quote_ident(o))
            .collect();
        owners.sort();
        owners.dedup();
        let me = crate::sql::quote_ident(me);
        // Membership in a superuser role is not something to hand out for this.
        let fix = if not_owned.iter().any(|(.., sup)| *sup == Some(true)) {
            format!("give the tables to the application's role (ALTER TABLE ... OWNER TO it) and GRANT it TO {me} on the target, or run the cutover as a superuser there")
        } else {
            format!("GRANT {} TO {me} on the target (which also keeps pgapply's rights on tables the application's role owns)", owners.join(", "))
        };
        problems.push(format!(
            "--reverse makes a publication of the tables on the target, and only their owner may publish a table: role {me} does not own {}{} (owned by {}): {fix}, or cut over without --reverse",
            shown.join(", "),
            if not_owned.len() > shown.len() { format!(" and {} more", not_owned.len() - shown.len()) } else { String::new() },
            owners.join(", "),
        ));
    }
    let plan = reverse_tables(source, target, &published, &config.publications).await?;
    problems.extend(plan.problems.iter().cloned());
    if not_owned.is_empty() && create && problems.is_empty() {
        problems.extend(probe_publication(target, &plan).await);
    }
    Ok(problems)
}

/// A table of the reverse publication: the target table, the columns it sends back (`None`:
/// all), a column of it to probe an UPDATE with, and the forward row filter.
struct ReverseTable {
    name: String,
    columns: Option<Vec<String>>,
    any_column: Option<String>,
    filter: Option<String>,
    /// A partitioned table: a row filter or column list on it asks for
    /// `publish_via_partition_root` (PostgreSQL refuses them on a partitioned table otherwise).
    partitioned: bool,
    /// The old primary refuses UPDATE and DELETE on it today (published for them, without a
    /// replica identity: an insert-only table): the new primary doing the same once it is
    /// published back changes nothing for the application.
    refused_on_source: bool,
}

/// The reverse publication's tables, each target table once. A forward column list goes back
/// as one wherever the target table has columns the source does not send: published whole, the
/// new primary would send its own values of those (defaults, NULLs) over the old primary's
/// real ones. A forward row filter goes back too (a rollback's verify then compares the rows
/// the mirror held, not the old primary's others). Both need PostgreSQL 15 on the target: a
/// column list it cannot take is a problem, a row filter is left out (said at step 6).
/// A forward row filter goes back only where the new primary can evaluate it on the columns
/// that came (one on a column left out of the column list would judge values the new primary
/// never got): otherwise all of the table's rows go back. A forward publication through the
/// partitioned root goes back through it too (the new primary may partition differently).
async fn reverse_tables(
    source: &Client,
    target: &Client,
    published: &[crate::copy::PublishedTable],
    publications: &[String],
) -> Result<ReversePlan> {
    let version = crate::sql::server_version(target)
        .await
        .map_err(|e| Error::postgres("reading the target's version", e))?;
    let forward_via_root: bool = source
        .query_one(
            "SELECT coalesce(bool_or(coalesce((to_jsonb(p) ->> 'pubviaroot')::bool, false)), false) \
             FROM pg_catalog.pg_publication p WHERE pubname = ANY($1)",
            &[&publications],
        )
        .await
        .map_err(|e| Error::postgres("reading the publications on the source", e))?
        .get(0);
    let mut tables: Vec<ReverseTable> = Vec::new();
    let mut problems = Vec::new();
    for t in published {
        let name = t.target_qualified();
        if let Some(first) = tables.iter_mut().find(|r| r.name == name) {
            // Filled from several source tables: all its rows go back (to be parted by hand).
            first.filter = None;
            continue;
        }
        let own: Vec<String> = target
            .query(
                "SELECT a.attname::text FROM pg_catalog.pg_attribute a \
                 WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped \
                   AND coalesce(to_jsonb(a) ->> 'attgenerated', '') = '' ORDER BY a.attnum",
                &[&name],
            )
            .await
            .map_err(|e| Error::postgres(format!("reading the columns of {name} on the target"), e))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let sent = |c: &String| t.columns.iter().any(|(p, _)| p == c);
        let columns = if own.iter().all(sent) {
            None
        } else {
            let list: Vec<String> = own.iter().filter(|c| sent(c)).cloned().collect();
            let others: Vec<String> = own
                .iter()
                .filter(|c| !sent(c))
                .map(|c| quote_ident(c))
                .collect();
            if version < 150000 {
                problems.push(format!(
                    "--reverse: the source does not send columns {} of {name} (a column list, or columns only the target has); published back whole, the new primary would send its own values of them over the old primary's, and a column list needs PostgreSQL 15 or later on the target: cut over without --reverse",
                    others.join(", ")
                ));
            } else if list.is_empty() {
                problems.push(format!(
                    "--reverse: the source sends none of the columns {name} has on the target: cut over without --reverse, or take it out of the publication"
                ));
            }
            Some(list)
        };
        let partitioned: bool = target
            .query_one(
                "SELECT coalesce((SELECT relkind = 'p' FROM pg_catalog.pg_class WHERE oid = pg_catalog.to_regclass($1)), false)",
                &[&name],
            )
            .await
            .map_err(|e| Error::postgres(format!("reading {name} on the target"), e))?
            .get(0);
        let mut filter = t.row_filter.clone().filter(|_| version >= 150000);
        if let Some(f) = &filter {
            let came: Vec<String> = own
                .iter()
                .filter(|c| sent(c))
                .map(|c| quote_ident(c))
                .collect();
            // (Only an unknown column says no; a lock waited on too long says nothing.)
            let checked = if came.is_empty() {
                Err(None)
            } else {
                target
                    .batch_execute(&format!(
                        "SET lock_timeout = '5s'; EXPLAIN SELECT 1 FROM (SELECT {} FROM {name}) AS pgapply_came WHERE ({f})",
                        came.join(", ")
                    ))
                    .await
                    .map_err(|e| e.code().map(|c| c.code().to_owned()))
            };
            let _ = target.batch_execute("RESET lock_timeout").await;
            if matches!(checked, Err(None)) || matches!(&checked, Err(Some(c)) if c == "42703") {
                filter = None;
            }
        }
        // (relreplident 'd' without a primary key, or 'n'; published for UPDATE or DELETE.)
        let refused_on_source: bool = source
            .query_one(
                "SELECT (c.relreplident = 'n' OR (c.relreplident = 'd' AND NOT EXISTS \
                            (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisprimary))) \
                        AND EXISTS (SELECT 1 FROM pg_catalog.pg_publication p \
                                    WHERE p.pubname = ANY($2) AND (p.pubupdate OR p.pubdelete)) \
                 FROM pg_catalog.pg_class c WHERE c.oid = $1::text::regclass",
                &[&crate::sql::qualified_name(&t.schema, &t.name), &publications],
            )
            .await
            .map(|r| r.get(0))
            .unwrap_or(false);
        tables.push(ReverseTable {
            name,
            columns,
            any_column: own.first().cloned(),
            filter,
            partitioned,
            refused_on_source,
        });
    }
    if version >= 120000 {
        tables = whole_partition_sets_as_roots(target, tables).await?;
    }
    // (publish_via_partition_root is 13+; before, partitioned tables are not published at all.)
    // Through the root also when the old primary lacks a partition the new one has (it keeps
    // the table whole, or parts it otherwise): the partitions' own changes would name tables it
    // does not have. Otherwise partition by partition, as forward: a TRUNCATE of one partition
    // is published only so.
    let mut via_root = version >= 130000
        && tables.iter().any(|t| t.partitioned)
        && (forward_via_root
            || tables
                .iter()
                .any(|t| t.partitioned && (t.columns.is_some() || t.filter.is_some())));
    if version >= 130000 && !via_root {
        for t in tables.iter().filter(|t| t.partitioned) {
            if partition_missing_on_old_primary(source, target, &t.name).await? {
                via_root = true;
                break;
            }
        }
    }
    Ok(ReversePlan {
        tables,
        via_root,
        problems,
    })
}

/// Partitions that came forward one by one (a publication FOR ALL TABLES, or of a partitioned
/// table not through its root), all of one partitioned table's: published back as that table,
/// which takes in the partitions made later too (next month's, made on both sides, say). Listed
/// one by one, a partition made after the cutover would not be published back, and its rows
/// would be missing on the old primary after a rollback without a word. Each still goes back
/// under its own name, as forward (not through the root: a TRUNCATE of one partition is
/// published only so). Partitions with a column list or row filter of their own stay listed.
async fn whole_partition_sets_as_roots(
    target: &Client,
    tables: Vec<ReverseTable>,
) -> Result<Vec<ReverseTable>> {
    let names: Vec<String> = tables.iter().map(|t| t.name.clone()).collect();
    // Each listed partition's root, and whether all of that root's leaves are listed.
    let rows = target
        .query(
            "WITH listed AS (SELECT n, pg_catalog.to_regclass(n) AS rel FROM unnest($1::text[]) n),                   roots AS (SELECT n, pg_catalog.pg_partition_root(rel) AS root FROM listed                             WHERE rel IS NOT NULL AND (SELECT relispartition FROM pg_catalog.pg_class WHERE oid = rel))              SELECT r.n, pg_catalog.quote_ident(ns.nspname) || '.' || pg_catalog.quote_ident(c.relname),                     NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree(r.root) t                                 WHERE t.isleaf AND t.relid NOT IN (SELECT rel FROM listed WHERE rel IS NOT NULL))              FROM roots r JOIN pg_catalog.pg_class c ON c.oid = r.root              JOIN pg_catalog.pg_namespace ns ON ns.oid = c.relnamespace",
            &[&names],
        )
        .await
        .map_err(|e| Error::postgres("reading the partitions of the published tables on the target", e))?;
    let mut root_of: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    for row in rows {
        let (leaf, root, whole): (String, String, bool) = (row.get(0), row.get(1), row.get(2));
        if whole {
            root_of.insert(leaf, root);
        }
    }
    // A root whose partitions all go back whole, with no list or filter of their own.
    let plain = |t: &ReverseTable| t.columns.is_none() && t.filter.is_none();
    let mut merged: Vec<ReverseTable> = Vec::new();
    let mut kept_apart: std::collections::HashSet<String> = std::collections::HashSet::new();
    for t in &tables {
        if let Some(root) = root_of.get(&t.name) {
            if !plain(t) {
                kept_apart.insert(root.clone());
            }
        }
    }
    for t in tables {
        match root_of.get(&t.name).filter(|r| !kept_apart.contains(*r)) {
            Some(root) => {
                if let Some(entry) = merged.iter_mut().find(|m| m.name == *root) {
                    entry.refused_on_source |= t.refused_on_source;
                } else {
                    merged.push(ReverseTable {
                        name: root.clone(),
                        columns: None,
                        any_column: t.any_column,
                        filter: None,
                        partitioned: true,
                        refused_on_source: t.refused_on_source,
                    });
                }
            }
            None => merged.push(t),
        }
    }
    Ok(merged)
}

/// Whether a partition of `table` on the new primary (`target`) is missing on the old one.
async fn partition_missing_on_old_primary(
    source: &Client,
    target: &Client,
    table: &str,
) -> Result<bool> {
    let leaves: Vec<String> = target
        .query(
            "SELECT pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(c.relname) \
             FROM pg_catalog.pg_partition_tree($1::text::regclass) t \
             JOIN pg_catalog.pg_class c ON c.oid = t.relid \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE t.isleaf",
            &[&table],
        )
        .await
        .map_err(|e| {
            Error::postgres(
                format!("reading the partitions of {table} on the target"),
                e,
            )
        })?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let present: i64 = source
        .query_one(
            "SELECT count(*) FROM unnest($1::text[]) l WHERE pg_catalog.to_regclass(l) IS NOT NULL",
            &[&leaves],
        )
        .await
        .map_err(|e| Error::postgres("reading the tables on the source", e))?
        .get(0);
    Ok(present < leaves.len() as i64)
}

/// The reverse publication: its tables, whether it publishes partitions through their root,
/// and what stops it.
struct ReversePlan {
    tables: Vec<ReverseTable>,
    via_root: bool,
    problems: Vec<String>,
}

/// `CREATE PUBLICATION` of `tables` under `name`.
fn publication_sql(name: &str, plan: &ReversePlan) -> String {
    let list: Vec<String> = plan
        .tables
        .iter()
        .map(|t| {
            let mut spec = t.name.clone();
            if let Some(columns) = &t.columns {
                let quoted: Vec<String> = columns.iter().map(|c| quote_ident(c)).collect();
                spec.push_str(&format!(" ({})", quoted.join(", ")));
            }
            if let Some(filter) = &t.filter {
                spec.push_str(&format!(" WHERE ({filter})"));
            }
            spec
        })
        .collect();
    // (The changes of a partitioned table then go out as its own, as they came: the old
    // primary has the same table.)
    let via_root = plan.via_root;
    format!(
        "CREATE PUBLICATION {} FOR TABLE {}{}",
        quote_ident(name),
        list.join(", "),
        if via_root {
            " WITH (publish_via_partition_root = true)"
        } else {
            ""
        }
    )
}

/// Makes the reverse publication in a transaction it rolls back, and tries an UPDATE and a
/// DELETE of no row on each table: PostgreSQL refuses them once a table is published without a
/// replica identity, or with a row filter or column list its replica identity does not cover.
/// After step 6 that would be every UPDATE or DELETE of the application on the new primary.
async fn probe_publication(target: &Client, plan: &ReversePlan) -> Vec<String> {
    let tables = &plan.tables;
    let mut problems = Vec::new();
    let sql = publication_sql("pgapply_reverse_probe", plan);
    if let Err(e) = target
        .batch_execute(&format!(
            "BEGIN; SET LOCAL client_min_messages = warning; SET LOCAL lock_timeout = '10s'; {sql}"
        ))
        .await
    {
        problems.push(format!(
            "--reverse: the reverse publication cannot be made on the target: {}: cut over without --reverse, or fix that first",
            crate::error::describe_postgres(&e)
        ));
    } else {
        for t in tables {
            let update = t
                .any_column
                .as_ref()
                .map(|c| {
                    // (DEFAULT: an identity column GENERATED ALWAYS takes nothing else.)
                    format!(
                        "UPDATE {} SET {} = DEFAULT WHERE false; ",
                        t.name,
                        quote_ident(c)
                    )
                })
                .unwrap_or_default();
            // A partitioned table's UPDATE of no row prunes every partition, whose own replica
            // identities PostgreSQL then does not check: its leaves are tried one by one too.
            let mut leaves = String::new();
            if t.partitioned {
                if let Ok(rows) = target
                    .query(
                        "SELECT relid::regclass::text FROM pg_catalog.pg_partition_tree($1::text::regclass) WHERE isleaf",
                        &[&t.name],
                    )
                    .await
                {
                    for row in rows {
                        let leaf: String = row.get(0);
                        if let Some(c) = &t.any_column {
                            leaves.push_str(&format!(
                                "UPDATE ONLY {leaf} SET {} = DEFAULT WHERE false; ",
                                quote_ident(c)
                            ));
                        }
                        leaves.push_str(&format!("DELETE FROM ONLY {leaf} WHERE false; "));
                    }
                }
            }
            let probe = format!(
                "SAVEPOINT pgapply_probe; {update}DELETE FROM {} WHERE false; {leaves}RELEASE SAVEPOINT pgapply_probe",
                t.name
            );
            if let Err(e) = target.batch_execute(&probe).await {
                // 55000: no replica identity; 42P10: one that does not cover the row filter's
                // columns or the column list. Anything else (a lock timeout): not a verdict.
                let code = e.code().map(|c| c.code().to_owned());
                let refused = matches!(code.as_deref(), Some("55000" | "42P10"));
                let _ = target
                    .batch_execute("ROLLBACK TO SAVEPOINT pgapply_probe")
                    .await;
                if code.as_deref() == Some("55000") && t.refused_on_source {
                    // As the old primary does now: an insert-only table, most likely.
                    crate::out!(
                        "before the cutover: {} has no replica identity on the source either (no primary key): as there, the new primary will refuse UPDATE and DELETE on it once it is published back (fine for a table that only gets INSERTs)",
                        t.name
                    );
                    continue;
                }
                let what = match (&t.filter, &t.columns) {
                    (None, None) => "a primary key, or REPLICA IDENTITY FULL".to_owned(),
                    _ => "a replica identity that covers the columns the row filter uses and the column list holds".to_owned(),
                };
                problems.push(if refused {
                    format!(
                        "--reverse: once {} is in the reverse publication, the new primary refuses UPDATE or DELETE on it: {}: give it {what} on the target (ALTER TABLE {} REPLICA IDENTITY FULL, or ADD PRIMARY KEY ...), or cut over without --reverse",
                        t.name,
                        crate::error::describe_postgres(&e),
                        t.name
                    )
                } else {
                    format!(
                        "--reverse: checking that the new primary still takes UPDATE and DELETE on {} once published did not finish: {}: run the cutover again",
                        t.name,
                        crate::error::describe_postgres(&e)
                    )
                });
            }
        }
    }
    let _ = target.batch_execute("ROLLBACK").await;
    problems
}

pub(super) async fn prepare_reverse(target: &Client, config: &RunConfig) -> Result<()> {
    let source = crate::tls::connect(&config.source)
        .await
        .map_err(|e| e.into_error("connecting to the source"))?;
    let tables = published_tables(&source, &config.publications, &config.table_map).await?;
    let publication = format!("{}_reverse", config.slot);
    let slot = format!("{}_reverse", config.slot);
    let plan = reverse_tables(&source, target, &tables, &config.publications).await?;
    drop(source);
    let reverse = &plan.tables;
    target
        .batch_execute(&format!(
            "BEGIN; SET LOCAL client_min_messages = warning; DROP PUBLICATION IF EXISTS {p}; {create}; COMMENT ON PUBLICATION {p} IS {comment}; COMMIT",
            p = quote_ident(&publication),
            create = publication_sql(&publication, &plan),
            comment = crate::sql::quote_literal(crate::verify::REVERSE_COMMENT)
        ))
        .await
        .map_err(|e| {
            Error::postgres("step 6: creating the reverse publication on the target", e)
        })?;
    let exists: bool = target
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("step 6: reading slots on the target", e))?
        .get(0);
    if !exists {
        // A logical slot is ready only once every transaction open on the cluster (prepared
        // ones included, in any database) has ended: after a minute, say which, rather than
        // wait in silence.
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&slot];
        let create = target.execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &params,
        );
        match tokio::time::timeout(Duration::from_secs(60), create).await {
            Ok(result) => {
                result.map_err(|e| {
                    Error::postgres(
                        "step 6: creating the reverse slot on the target (wal_level = logical?)",
                        e,
                    )
                })?;
            }
            Err(_) => {
                let _ = target
                    .cancel_token()
                    .cancel_query(tokio_postgres::NoTls)
                    .await;
                let prepared: Vec<String> = target
                    .query("SELECT gid FROM pg_catalog.pg_prepared_xacts", &[])
                    .await
                    .map(|rows| rows.iter().map(|r| r.get(0)).collect())
                    .unwrap_or_default();
                let prepared = if prepared.is_empty() {
                    String::new()
                } else {
                    format!(
                        " (prepared there: {}; COMMIT PREPARED or ROLLBACK PREPARED them)",
                        prepared.join(", ")
                    )
                };
                return Err(Error::definite(format!(
                    "step 6: creating the reverse slot on the target waited a minute for transactions open on the target cluster to end{prepared}; any database counts: see pg_stat_activity for sessions idle in transaction or long queries. End them, then run the cutover again"
                )));
            }
        }
    }
    // Loop prevention: the reverse slot starts after everything pgapply applied, and the forward
    // worker is fenced, so nothing comes back; `--origin none` (a 16+ source, here the new
    // primary) also filters out anything a forward run might still apply.
    let version = crate::sql::server_version(target)
        .await
        .map_err(|e| Error::postgres("step 6: reading the target's version", e))?;
    let origin = if version >= 160000 {
        " --origin none"
    } else {
        ""
    };
    let (mapping, merged) = inverse_mapping(&tables);
    let config_arg = if mapping.is_empty() {
        ""
    } else {
        " --config <a file with the lines below>"
    };
    // (Shell-quoted: a connection string has spaces.)
    let shell = |s: String| format!("'{}'", s.replace('\'', "'\\''"));
    crate::out!(
        "step 6: reverse replication prepared: publication {publication:?} and slot {slot:?} on the target. To replicate back, run (passwords and TLS settings are not printed: give them as for this cutover, or by PGPASSWORD or ~/.pgpass):\n  pgapply run --source {} --target {} --publication {publication} --slot {slot}{origin}{config_arg}",
        shell(crate::conninfo::without_password(&config.target)),
        shell(crate::conninfo::without_password(&config.source)),
    );
    if !mapping.is_empty() {
        crate::out!(
            "the tables are mapped ([tables]): the way back maps them the other way round, in its config file:\n{}",
            mapping.join("\n")
        );
    }
    for t in &tables {
        let Some(filter) = &t.row_filter else {
            continue;
        };
        let back = reverse.iter().find(|r| r.name == t.target_qualified());
        if back.is_some_and(|r| r.filter.is_some()) {
            crate::out!(
                "table {} goes back with the row filter it came with (WHERE {filter}): rows the new primary holds or gets that it leaves out do not go back",
                t.target_qualified()
            );
        } else {
            crate::out!(
                "table {} came with a row filter (WHERE {filter}) that the way back does not have (several tables fill it, it uses columns that did not come, or the target is older than PostgreSQL 15): all its rows go back, and the old primary also holds the rows the filter left out, which a verify of the way back reports",
                t.target_qualified()
            );
        }
    }
    for (target, sources) in merged {
        crate::out!(
            "target table {target} holds the rows of source tables {}: the way back cannot part them again. Take it out of publication {publication:?} on the new primary (ALTER PUBLICATION {} DROP TABLE {target}) before replicating back, and move its rows back by hand",
            sources.join(", "),
            quote_ident(&publication)
        );
    }
    // Unread, the slot keeps the new primary's WAL for good.
    crate::out!(
        "slot {slot:?} on the target (the new primary) holds its WAL from now on until that runs: if you will not replicate back, drop it there: SELECT pg_drop_replication_slot('{}')",
        slot.replace('\'', "''")
    );
    Ok(())
}

/// The `[tables]` entries that replicate the mapped tables back (target name -> source name),
/// and the target tables that several source tables fill (which no mapping parts again).
pub(super) fn inverse_mapping(
    tables: &[crate::copy::PublishedTable],
) -> (Vec<String>, Vec<(String, Vec<String>)>) {
    let mut by_target: Vec<(&crate::copy::PublishedTable, Vec<String>)> = Vec::new();
    for t in tables {
        match by_target
            .iter_mut()
            .find(|(first, _)| first.target_qualified() == t.target_qualified())
        {
            Some((_, sources)) => sources.push(t.qualified()),
            None => by_target.push((t, vec![t.qualified()])),
        }
    }
    let mut mapping = Vec::new();
    let mut merged = Vec::new();
    for (t, sources) in by_target {
        if sources.len() > 1 {
            merged.push((t.target_qualified(), sources));
        } else if t.schema != t.target_schema || t.name != t.target_name {
            mapping.push(format!(
                "  [tables.{}]\n  target = {}",
                toml_string(&config_name(&t.target_schema, &t.target_name)),
                toml_string(&config_name(&t.schema, &t.name))
            ));
        }
    }
    (mapping, merged)
}

/// A table's name as the config file reads it: `schema.table`, quoted where it must be.
pub(super) fn config_name(schema: &str, name: &str) -> String {
    let plain = |s: &str| !s.is_empty() && !s.contains(['.', '"']);
    if plain(schema) && plain(name) {
        format!("{schema}.{name}")
    } else {
        crate::sql::qualified_name(schema, name)
    }
}

/// A TOML string: literal (single quotes) where it can be, else basic with escapes.
pub(super) fn toml_string(text: &str) -> String {
    if !text.contains(['\'', '\n', '\r']) {
        format!("'{text}'")
    } else {
        serde_json::Value::from(text).to_string()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn mapped_names_are_written_as_the_config_file_reads_them() {
        use super::{config_name, toml_string};
        assert_eq!(config_name("app", "orders"), "app.orders");
        assert_eq!(
            config_name("ledger", "Invoice \"Archive\""),
            "\"ledger\".\"Invoice \"\"Archive\"\"\""
        );
        assert_eq!(config_name("my.schema", "t"), "\"my.schema\".\"t\"");
        assert_eq!(toml_string("app.orders"), "'app.orders'");
        assert_eq!(toml_string("o'brien.t"), "\"o'brien.t\"");
        for (schema, name) in [
            ("ledger", "Invoice \"Archive\""),
            ("o'b", "t.x"),
            ("a", "b"),
        ] {
            let text = format!(
                "[tables.{}]\ntarget = 'x.y'\n",
                toml_string(&config_name(schema, name))
            );
            let file: toml::Value = toml::from_str(&text).unwrap();
            let key = file["tables"]
                .as_table()
                .unwrap()
                .keys()
                .next()
                .unwrap()
                .clone();
            assert_eq!(
                crate::config::parse_table_name(&key).unwrap(),
                (schema.to_owned(), name.to_owned())
            );
        }
    }
}
