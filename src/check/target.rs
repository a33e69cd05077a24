//! The target's part of `pgapply check`: the role and its rights, pgapply's schema, and each
//! published table's counterpart (columns, types, keys, triggers).

use tokio_postgres::Client;

use super::{query_bool, Report};
use crate::error::describe_postgres;
use crate::sql::quote_ident;

/// What the apply session needs beyond the tables: quiet triggers (as under PostgreSQL's own
/// subscriber) and, with --two-phase, prepared transactions.
pub(super) async fn check_apply_session(
    dst: &Client,
    report: &mut Report,
    tables: &[crate::copy::PublishedTable],
    (two_phase, apply_workers): (bool, usize),
    policies: &crate::apply::conflict::PolicyMap,
) {
    // An insert_exists policy needs INSERT .. ON CONFLICT, which a table whose every key is
    // DEFERRABLE refuses (`run` stops at its first INSERT, saying so).
    for t in tables {
        let policy = policies.for_table(&t.schema, &t.name).insert_exists;
        if policy == crate::apply::conflict::Policy::Error {
            continue;
        }
        let qualified = t.target_qualified();
        let only_deferrable = dst
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_index WHERE indrelid = pg_catalog.to_regclass($1) \
                                  AND NOT indimmediate AND (indisunique OR indisexclusion)) \
                        AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_index WHERE indrelid = pg_catalog.to_regclass($1) \
                                  AND indimmediate AND indisunique AND indisvalid \
                                  AND indexprs IS NULL AND indpred IS NULL)",
                &[&qualified],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false);
        // apply_remote overwrites the row with the same key: the source's, or else the target's
        // own primary key or unique index; without any, `run` stops at the table's first INSERT.
        // (Over replicated columns: a key of a target-only column says nothing of the source's
        // rows.)
        let replicated: Vec<String> = t
            .columns
            .iter()
            .map(|(c, _)| t.target_column(c).to_owned())
            .collect();
        let no_unique = policy == crate::apply::conflict::Policy::ApplyRemote
            && !only_deferrable
            && dst
                .query_one(
                    "SELECT pg_catalog.to_regclass($1) IS NOT NULL AND NOT EXISTS ( \
                        SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = pg_catalog.to_regclass($1) \
                          AND i.indimmediate AND i.indisunique AND i.indisvalid \
                          AND i.indexprs IS NULL AND i.indpred IS NULL \
                          AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a \
                                          WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey::int2[]) \
                                            AND a.attname::text <> ALL ($2::text[])))",
                    &[&qualified, &replicated],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false);
        if no_unique {
            report.problem(format!(
                "conflict policy insert_exists = \"apply_remote\" for {}: target table {qualified} has no primary key or unique index to tell which row an insert overwrites (pgapply would stop at the table's first INSERT): add one on the target (on the source's key columns), or set another insert_exists policy for this table",
                t.qualified()
            ));
        }
        if only_deferrable {
            report.problem(format!(
                "conflict policy insert_exists = \"{}\" for {}: every unique key of target table {qualified} is DEFERRABLE, and the INSERT .. ON CONFLICT the policy needs cannot use one (pgapply would stop at the table's first INSERT): on the target, drop the constraint and add it again without DEFERRABLE, or set insert_exists = \"error\" for this table",
                policy.name(),
                t.qualified()
            ));
        }
    }
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
    match crate::copy::unenforced_unique_constraints(dst, tables).await {
        Ok(found) if found.is_empty() => {}
        Ok(found) => report.warning(format!(
            "DEFERRABLE unique constraints on the target: {}. pgapply applies with session_replication_role = replica (as PostgreSQL's own subscriber), under which PostgreSQL does not check a deferrable constraint (its check is a trigger): a source row that clashes with a row written on the target goes in beside it, and no insert_exists or update_exists conflict is seen. If the target takes writes of its own, either apply as a role that may not set session_replication_role (then the constraints are checked before each commit, but the target's triggers and foreign keys fire too), or make them NOT DEFERRABLE there unless the source's are DEFERRABLE too (drop and add the constraint again; a source statement that swaps keys under it then stops pgapply); `pgapply verify` finds rows that slipped in",
            found.join(", ")
        )),
        Err(e) => report.problem(e.to_string()),
    }
    // As `run` decides: parallel workers keep their progress in replication origins only.
    if apply_workers > 1 {
        let may = query_bool(
            dst,
            // (Before 14 the functions also insist on a superuser, whatever the grants.)
            "SELECT rolsuper OR (pg_catalog.current_setting('server_version_num')::int >= 140000 \
                                 AND has_function_privilege('pg_catalog.pg_replication_origin_create(text)', 'EXECUTE') \
                                 AND has_function_privilege('pg_catalog.pg_replication_origin_session_setup(text)', 'EXECUTE')) \
             FROM pg_catalog.pg_roles WHERE rolname = current_user",
            &[],
        )
        .await;
        match may {
            Ok(true) => report.ok("the target role may use replication origins (--apply-workers)"),
            Ok(false) => report.problem(crate::apply::progress::WORKERS_NEED_ORIGINS),
            Err(e) => report.problem(format!(
                "target: cannot read the role's rights on replication origins: {e}"
            )),
        }
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

/// The published tables with their columns under the target's names (`[tables."s.t".columns]`
/// renames them for the stream): what the target tables must have.
pub(super) fn with_target_columns(
    tables: &[crate::copy::PublishedTable],
    column_map: &crate::config::ColumnMap,
) -> Vec<crate::copy::PublishedTable> {
    tables
        .iter()
        .map(|table| {
            let mut t = table.clone();
            if let Some(renames) = column_map.get(&(table.schema.clone(), table.name.clone())) {
                for (column, _) in &mut t.columns {
                    if let Some(to) = renames.get(column.as_str()) {
                        *column = to.clone();
                    }
                }
                // (Kept, source name to target name: messages name both, and the source's key
                // is found under its target names.)
                t.renamed_columns = renames.clone();
            }
            t
        })
        .collect()
}

pub(super) async fn check_target(
    dst: &Client,
    source: Option<&Client>,
    report: &mut Report,
    tables: &[crate::copy::PublishedTable],
    (truncated, updated): (&[bool], &[bool]),
    // Whether a copy is to come, the tables it empties first, and the slot.
    (copy_pending, emptied, slot): (bool, &[String], &str),
) {
    // (A swap of keys under a key only the source defers stops the run.)
    if let Some(src) = source {
        match crate::copy::keys_deferrable_only_on_source(src, dst, tables).await {
            Ok(found) => {
                for (_, warning) in found {
                    report.warning(warning);
                }
            }
            Err(e) => report.problem(e.to_string()),
        }
    }
    // (A schema pgapply that exists already is what counts then: another role's may refuse.
    // Only pgapply's own tables there: a user's tables in a schema of that name are theirs.)
    let can_create = query_bool(
        dst,
        &format!(
            "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'pgapply') \
                         THEN (SELECT has_schema_privilege(oid, 'CREATE') AND has_schema_privilege(oid, 'USAGE') \
                                      AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid AND c.relkind = 'r' \
                                                      AND {} \
                                                      AND NOT has_table_privilege(c.oid, 'SELECT, INSERT, UPDATE, DELETE')) \
                                      AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid \
                                                      AND CASE WHEN c.relkind = 'S' THEN NOT has_sequence_privilege(c.oid, 'USAGE') END) \
                               FROM pg_namespace n WHERE nspname = 'pgapply') \
                         ELSE has_database_privilege(current_database(), 'CREATE') END",
            crate::apply::applier::own_table_sql("'pgapply'", "c.relname")
        ),
        &[],
    )
    .await;
    match can_create {
        Ok(true) => report.ok("target role may keep pgapply's state (schema pgapply)"),
        Ok(false) => {
            let owner: Option<(String, bool)> = dst
                .query_opt(
                    "SELECT nspowner::regrole::text, nspowner = (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user) \
                     FROM pg_catalog.pg_namespace WHERE nspname = 'pgapply'",
                    &[],
                )
                .await
                .ok()
                .flatten()
                .map(|r| (r.get(0), r.get(1)));
            let (role, database) = crate::sql::role_and_database(dst).await;
            report.problem(match owner {
                None => format!("the target role may not create schema pgapply, where pgapply keeps its state: GRANT CREATE ON DATABASE {database} TO {role}, or create the schema for it (CREATE SCHEMA pgapply AUTHORIZATION {role})"),
                Some((_, true)) => format!("the target role lacks rights on pgapply's tables in its schema pgapply (made by another role): have their owner or a superuser run GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA pgapply TO {role}; GRANT USAGE ON ALL SEQUENCES IN SCHEMA pgapply TO {role} (the sequence numbers conflict records)"),
                Some((owner, false)) => format!("the target role may not use schema pgapply, which role {owner} made: have {owner} run GRANT USAGE, CREATE ON SCHEMA pgapply TO {role}; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA pgapply TO {role}; GRANT USAGE ON ALL SEQUENCES IN SCHEMA pgapply TO {role} (the sequence numbers conflict records); or drop the schema if no other pgapply uses it"),
            })
        }
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
            if let Ok(Some(hint)) =
                crate::replicate::missing_partition_hint(src, dst, &sources).await
            {
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
            Ok(_)
                if query_bool(
                    dst,
                    "SELECT pg_catalog.to_regclass($1) IS NOT NULL",
                    &[&qualified],
                )
                .await
                .unwrap_or(false) =>
            {
                // (A table without columns, `CREATE TABLE t ()`: nothing more to compare.)
                report.ok(format!("target table {qualified} (no columns)"));
                continue;
            }
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
                // A key column is written only by an UPDATE that changes the key: rare, but
                // then refused the same way.
                let key_always: Vec<String> = always
                    .iter()
                    .filter(|c| identity != "f" && !keyless && key.contains(c))
                    .map(|c| quote_ident(c))
                    .collect();
                if !key_always.is_empty() {
                    report.warning(format!(
                        "target table {qualified}: its key column(s) {} are GENERATED ALWAYS AS IDENTITY: inserts are applied, but an UPDATE on the source that changes the key would stop pgapply (PostgreSQL lets an UPDATE write such a column only if it is GENERATED BY DEFAULT): {} on the target if keys may change (after a cutover, SET GENERATED ALWAYS gives it back)",
                        key_always.join(", "),
                        key_always
                            .iter()
                            .map(|c| format!("ALTER TABLE {qualified} ALTER COLUMN {c} SET GENERATED BY DEFAULT;"))
                            .collect::<Vec<_>>()
                            .join(" ")
                    ));
                }
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
                .query_one(&format!("SELECT EXISTS (SELECT 1 FROM {qualified})"), &[])
                .await
            {
                Ok(r) if r.get::<_, bool>(0) => {
                    match crate::copy::other_slots_filling(dst, slot, &[table]).await.first() {
                        Some((_, other)) => report.problem(format!(
                            "target table {qualified} holds the rows another worker (slot {}) fills: --copy-data copies only into empty tables, and --truncate-target is refused there (that worker never sends its rows again): copy this source's rows into it by hand and run without --copy-data (README: \"Several workers\", fan-in into one table)",
                            crate::sql::shown_literal(other)
                        )),
                        None => report.problem(format!(
                            "target table {qualified} is not empty, and --copy-data copies into empty tables: empty it, or add --truncate-target"
                        )),
                    }
                }
                Ok(_) => {}
                Err(e) => report.problem(format!(
                    "target table {qualified}: {}",
                    describe_postgres(&e)
                )),
            }
        }
        let mut fine = true;
        // Two published columns renamed onto one target column: the copy and the stream would
        // name it twice.
        let mut seen = std::collections::HashSet::new();
        for (column, _) in &table.columns {
            if !seen.insert(column.as_str()) {
                fine = false;
                let from: Vec<String> = table
                    .renamed_columns
                    .iter()
                    .filter(|(_, to)| *to == column)
                    .map(|(s, _)| quote_ident(s))
                    .collect();
                report.problem(format!(
                    "two published columns of {} go into target column {} ({} renamed onto it in the config file's [tables.\"{}.{}\".columns], beside the source's own column of that name): rename the source column onto another target column, or leave that line out",
                    table.qualified(),
                    quote_ident(column),
                    from.join(", "),
                    table.schema,
                    table.name
                ));
            }
        }
        // The name a message gives a published column: its target name, and its source name
        // when the configuration renames it.
        let named = |column: &str| match table.renamed_columns.iter().find(|(_, to)| *to == column)
        {
            Some((source, _)) => format!(
                "{} (source column {}, renamed in the config file)",
                quote_ident(column),
                quote_ident(source)
            ),
            None => quote_ident(column),
        };
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
                        " (as on the source, the default fills the rows already there; if the target had this column and dropped it, their values are the source's, not the default: copy them from the source, `pgapply verify` shows the rows)"
                    } else if definition.is_empty() {
                        " (if the target had this column and dropped it, copy the values of the rows already there from the source: `pgapply verify` shows them)"
                    } else {
                        ""
                    };
                    // A type of the source's own (an enum, a domain, a composite) the target
                    // lacks: the statement would fail on it.
                    let type_missing = dst
                        .query_one("SELECT pg_catalog.to_regtype($1) IS NULL", &[&source_type])
                        .await
                        .is_ok_and(|r| r.get::<_, bool>(0));
                    let create_type = if type_missing {
                        format!(" (type {source_type} does not exist on the target: create it there first, as the source has it: pg_dump --schema-only of the source shows its CREATE TYPE or CREATE DOMAIN)")
                    } else {
                        String::new()
                    };
                    report.problem(format!(
                        "column {} of {qualified} is published but missing on the target: ALTER TABLE {qualified} ADD COLUMN {} {source_type}{definition}{create_type}{note}{renamed}",
                        named(column),
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
                            named(column)
                        ));
                    } else if let Some(how) = narrower(source_type, &target_type) {
                        fine = false;
                        report.warning(format!(
                            "column {} of {qualified} is {source_type} on the source but {target_type} on the target, which {how}: make it {source_type} on the target (ALTER TABLE {qualified} ALTER COLUMN {} TYPE {source_type}{})",
                            quote_ident(column),
                            quote_ident(column),
                            converted_using(source_type, &target_type, &quote_ident(column))
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
                } else {
                    // Same labels, another order: the rows are the same, but the target sorts
                    // and compares them otherwise (ORDER BY, <, range partitions, indexes).
                    let shared: Vec<&String> = labels
                        .iter()
                        .filter(|l| source_labels.contains(l))
                        .collect();
                    let source_order: Vec<&String> = source_labels
                        .iter()
                        .filter(|l| labels.contains(l))
                        .collect();
                    if shared != source_order {
                        report.warning(format!(
                            "column {} of {qualified}: its enum type on the target has the source's values in another order ({} there, {} on the source): the rows replicate as they are, but queries on the target sort and compare them otherwise (ORDER BY, <, >); `pgapply verify` compares them by their text",
                            quote_ident(column),
                            shared.iter().map(|l| crate::sql::shown_literal(l)).collect::<Vec<_>>().join(", "),
                            source_order.iter().map(|l| crate::sql::shown_literal(l)).collect::<Vec<_>>().join(", ")
                        ));
                    }
                }
            }
        }
        // A composite type's values travel as text, by position: the same attributes in
        // another order (or others) on the target land in the wrong ones, or fail.
        if let Some(src) = source {
            let target_composites = composite_attributes(dst, &qualified).await;
            if !target_composites.is_empty() {
                let source_composites = composite_attributes(src, &table.qualified()).await;
                for (column, (target_type, target_attributes)) in &target_composites {
                    if !table.columns.iter().any(|(p, _)| p == column) {
                        continue;
                    }
                    let Some((source_type, source_attributes)) = source_composites.get(column)
                    else {
                        continue;
                    };
                    let names = |a: &[String]| {
                        a.iter()
                            .map(|x| x.split_once(' ').map_or(x.as_str(), |(n, _)| n).to_owned())
                            .collect::<Vec<_>>()
                    };
                    let shown = |a: &[String]| format!("({})", a.join(", "));
                    if names(source_attributes) != names(target_attributes) {
                        fine = false;
                        report.problem(format!(
                            "column {} of {qualified}: its composite type is {source_type} {} on the source but {target_type} {} on the target: composite values are sent and copied by position, so they would go into other attributes than the source's, or fail: give the target's type the source's attributes in the source's order",
                            quote_ident(column),
                            shown(source_attributes),
                            shown(target_attributes)
                        ));
                    } else if source_attributes != target_attributes {
                        report.warning(format!(
                            "column {} of {qualified}: its composite type's attributes have other types on the target ({} there, {} on the source): values may not convert",
                            quote_ident(column),
                            shown(target_attributes),
                            shown(source_attributes)
                        ));
                    }
                }
            }
        }
        // A column generated on the source is not published (before 18, or without
        // publish_generated_columns): a plain target column of that name is never filled.
        if let Some(src) = source {
            let generated = src
                .query(
                    "SELECT a.attname::text, coalesce(to_jsonb(a) ->> 'attgenerated', '') = 'v' \
                     FROM pg_catalog.pg_attribute a \
                     WHERE a.attrelid = $1::text::pg_catalog.regclass AND a.attnum > 0 AND NOT a.attisdropped \
                       AND coalesce(to_jsonb(a) ->> 'attgenerated', '') <> '' ORDER BY a.attnum",
                    &[&table.qualified()],
                )
                .await
                .map(|rows| {
                    rows.iter()
                        .map(|r| (r.get::<_, String>(0), r.get::<_, bool>(1)))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            let target_major = crate::sql::server_version(dst).await.unwrap_or(0) / 10000;
            for (column, is_virtual) in generated {
                let plain_on_target = rows
                    .iter()
                    .any(|r| r.get::<_, String>(0) == column && !r.get::<_, bool>(3));
                if plain_on_target && !table.columns.iter().any(|(c, _)| *c == column) {
                    fine = false;
                    // (Generated columns are 12+; a VIRTUAL one is never published.)
                    let make_generated = if target_major >= 12 || target_major == 0 {
                        "make it generated on the target too (the same GENERATED ALWAYS AS expression)"
                    } else {
                        "fill it on the target some other way (a trigger: PostgreSQL before 12 has no generated columns), or drop it there"
                    };
                    let publish = if is_virtual {
                        " (a VIRTUAL generated column is never published)"
                    } else {
                        ", or on a PostgreSQL 18 source publish it (publish_generated_columns = stored)"
                    };
                    report.warning(format!(
                        "column {} of {qualified} is generated on the source, which does not publish its values, and a plain column on the target: it stays empty (NULL or its default) there; {make_generated}{publish}",
                        quote_ident(&column)
                    ));
                }
            }
        }
        if let Some(advice) = key_advice(dst, source, table, &qualified).await {
            fine = false;
            report.warning(advice);
        }
        if let (Some(src), true) = (source, table.partitioned) {
            if let Some(advice) = partition_advice(src, dst, table, &qualified).await {
                fine = false;
                report.warning(advice);
            }
        }
        if fine {
            report.ok(format!("table {qualified} matches on the target"));
        }
    }
}

/// The partitions of a table published through its partitioned root: each holds rows the
/// target must take too. Said when the source has partitions whose bounds no partition of the
/// target has and the target has no DEFAULT partition (its own partitions may still cover them
/// otherwise: by year where the source has months, say); none for a target table that is not
/// partitioned, which takes every row.
async fn partition_advice(
    src: &Client,
    dst: &Client,
    table: &crate::copy::PublishedTable,
    qualified: &str,
) -> Option<String> {
    let bounds = "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname), pg_catalog.pg_get_expr(c.relpartbound, c.oid) \
                  FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid \
                  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                  WHERE i.inhparent = pg_catalog.to_regclass($1) AND c.relispartition \
                    AND (SELECT relkind FROM pg_catalog.pg_class WHERE oid = i.inhparent) = 'p' \
                  ORDER BY 2";
    let read = |rows: Vec<tokio_postgres::Row>| {
        rows.iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
            .collect::<Vec<_>>()
    };
    let on_source = read(src.query(bounds, &[&table.qualified()]).await.ok()?);
    let on_target = read(dst.query(bounds, &[&qualified]).await.ok()?);
    // (Not partitioned on the target, or with a DEFAULT partition there: every row has a place.)
    if on_target.is_empty() || on_target.iter().any(|(_, b)| b == "DEFAULT") {
        return None;
    }
    let missing: Vec<String> = on_source
        .iter()
        .filter(|(_, b)| !on_target.iter().any(|(_, t)| t == b))
        .map(|(name, b)| format!("{name} {b}"))
        .collect();
    if missing.is_empty() {
        return None;
    }
    Some(format!(
        "partitioned table {qualified}: no partition on the target has the bounds of the source's {}: unless the target's own partitions cover them, their rows stop pgapply (no partition takes them): create them on the target as on the source (CREATE TABLE ... PARTITION OF {qualified} FOR VALUES ...), or a DEFAULT partition",
        missing.join(", ")
    ))
}

/// `relation::key_index_advice` for one published table: its key read from the source's replica
/// identity (nothing said for REPLICA IDENTITY NOTHING, or without the source).
pub(super) async fn key_advice(
    dst: &Client,
    source: Option<&Client>,
    table: &crate::copy::PublishedTable,
    qualified: &str,
) -> Option<String> {
    let (identity, key) = source_key(source, table).await?;
    // (Found on the target under the names the configuration gives them.)
    let key: Vec<String> = key
        .iter()
        .map(|k| table.target_column(k).to_owned())
        .collect();
    let key = match identity.as_str() {
        "f" => Vec::new(),
        // No key (or none to find rows by): UPDATE and DELETE are refused on the source anyway.
        _ if key.is_empty() => return None,
        _ => key,
    };
    let version = crate::sql::server_version(dst).await.ok()?;
    let target =
        crate::relation::load_target_table(dst, version, &table.target_schema, &table.target_name)
            .await
            .ok()??;
    debug_assert_eq!(target.qualified, qualified);
    crate::relation::key_index_advice(&target, &key)
}

/// A published table's replica identity on the source (`relreplident`) and the columns of its
/// key (none for FULL or NOTHING, or without a key).
pub(super) async fn source_key(
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
pub(super) async fn source_column_definition(
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
pub(crate) fn narrower(source: &str, target: &str) -> Option<&'static str> {
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
        // A date keeps the day only (of a timestamp with time zone: the day in the target
        // session's time zone).
        ("timestamp with time zone" | "timestamp without time zone", "date") => {
            return Some("drops the time of day of the source's values without a word")
        }
        // Without a time zone, the target reads the source's text of a value (a timestamp in
        // the source server's TimeZone, a time with its own offset) and drops the offset.
        ("timestamp with time zone", "timestamp without time zone") => {
            return Some("drops the offset of the source's values without a word: they land as the source server's time zone (its TimeZone setting) shows them")
        }
        ("json", "jsonb") => {
            return Some("stores the source's documents as jsonb does: keys sorted, the last of duplicate keys kept, whitespace dropped, without a word (`pgapply verify` shows such rows as different)")
        }
        ("jsonb", "json") => return None,
        ("time with time zone", "time without time zone") => {
            return Some("drops the offset of the source's values without a word: each keeps its time of day as written, whatever its offset")
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
pub(super) fn split_type(t: &str) -> (String, Vec<u32>) {
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
/// The `USING` that converts the rows already on the target when a column is made the source's
/// type again, where the default conversion would not give the source's values: a timestamp
/// that holds the source's values as its TimeZone showed them is read back in that zone (the
/// target session's zone would shift every row).
pub(crate) fn converted_using(source: &str, target: &str, column: &str) -> String {
    if split_type(source).0 == "timestamp with time zone"
        && split_type(target).0 == "timestamp without time zone"
    {
        format!(" USING {column} AT TIME ZONE '<the source's TimeZone: SHOW TimeZone there>'")
    } else {
        String::new()
    }
}

pub(crate) fn compatible(source: &str, target: &str, target_category: &str) -> bool {
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
    // Arrays: as their elements (an enum's array into text[] goes as text does).
    if let (Some(s), Some(t)) = (source.strip_suffix("[]"), target.strip_suffix("[]")) {
        return compatible(s, t, "");
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
    // A timestamp into a date keeps the day (`narrower` says so); json into jsonb is parsed
    // there (`narrower` says what it changes).
    let days = [
        "date",
        "timestamp without time zone",
        "timestamp with time zone",
    ];
    let documents = ["json", "jsonb"];
    // A time with a time zone read as one without: its offset dropped (`narrower` says so).
    let times_of_day = ["time without time zone", "time with time zone"];
    let family = |list: &[&str]| {
        list.contains(&base(source).as_str()) && list.contains(&base(target).as_str())
    };
    family(&numeric)
        || family(&text)
        || family(&times)
        || family(&days)
        || family(&documents)
        || family(&times_of_day)
        || (target_category == "S" && text.contains(&base(source).as_str()))
        // Values travel in their text form, which a text column takes whatever the source's
        // type (one a target of an older version lacks, a multirange into 13, say).
        || target == "text"
}

/// The columns of `table` whose type is a composite type (also inside an array or a domain):
/// column -> (the composite type's name, its attributes as `name type`, in order).
async fn composite_attributes(
    client: &tokio_postgres::Client,
    table: &str,
) -> std::collections::HashMap<String, (String, Vec<String>)> {
    client
        .query(
            "SELECT a.attname::text, pg_catalog.format_type(b3.oid, NULL), \
                    ARRAY(SELECT ca.attname::text || ' ' || pg_catalog.format_type(ca.atttypid, ca.atttypmod) \
                          FROM pg_catalog.pg_attribute ca \
                          WHERE ca.attrelid = b3.typrelid AND ca.attnum > 0 AND NOT ca.attisdropped \
                          ORDER BY ca.attnum) \
             FROM pg_catalog.pg_attribute a \
             JOIN pg_catalog.pg_type b0 ON b0.oid = a.atttypid \
             JOIN pg_catalog.pg_type b1 ON b1.oid = CASE WHEN b0.typtype = 'd' THEN b0.typbasetype ELSE b0.oid END \
             JOIN pg_catalog.pg_type b2 ON b2.oid = CASE WHEN b1.typcategory = 'A' AND b1.typelem <> 0 THEN b1.typelem ELSE b1.oid END \
             JOIN pg_catalog.pg_type b3 ON b3.oid = CASE WHEN b2.typtype = 'd' THEN b2.typbasetype ELSE b2.oid END \
             WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped \
               AND b3.typtype = 'c'",
            &[&table],
        )
        .await
        .map(|rows| {
            rows.iter()
                .map(|r| (r.get(0), (r.get(1), r.get(2))))
                .collect()
        })
        .unwrap_or_default()
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
        assert!(compatible("int4multirange", "text", "S"));
        assert!(compatible("app.mood[]", "text[]", "A"));
        // Converted by the target, with what changes said by `narrower`.
        assert!(compatible("json", "jsonb", "U"));
        assert!(compatible("timestamp(3) without time zone", "date", "D"));
        assert!(narrower("json", "jsonb").is_some() && narrower("jsonb", "json").is_none());
        assert!(!compatible("date", "integer", "N"));
        assert_eq!(
            super::converted_using(
                "timestamp with time zone",
                "timestamp(3) without time zone",
                "\"t\""
            ),
            " USING \"t\" AT TIME ZONE '<the source's TimeZone: SHOW TimeZone there>'"
        );
        assert_eq!(
            super::converted_using("numeric(8,2)", "numeric(4,1)", "\"n\""),
            ""
        );
        assert!(!compatible("app.mood[]", "integer[]", "A"));
        assert!(!compatible("int4multirange", "character varying(10)", "S"));
        assert!(narrower("bigint", "integer").is_some());
        assert!(narrower("timestamp(3) with time zone", "date").is_some());
        assert!(narrower("date", "timestamp with time zone").is_none());
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
        // The offset dropped: the values shift by the source's time zone.
        assert!(
            narrower("timestamp(3) with time zone", "timestamp without time zone")
                .is_some_and(|why| why.contains("offset"))
        );
        assert!(narrower("time with time zone", "time without time zone").is_some());
        assert!(compatible(
            "time with time zone",
            "time without time zone",
            "D"
        ));
        assert!(narrower("timestamp without time zone", "timestamp with time zone").is_none());
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
