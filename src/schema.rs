//! `pgapply schema`: copies the definitions of the published tables — with the types, sequences
//! and functions of their schemas — from source to target with pg_dump --schema-only.
//!
//! The schemas that hold published tables are dumped whole, except relations that are not
//! published, so the types and sequences the tables use come along. `--section pre-data` (tables,
//! types, sequences) belongs before an initial copy, `--section post-data` (indexes, constraints,
//! triggers) after it, which makes the copy faster; the default does both.

use std::path::PathBuf;

use crate::conninfo;
use crate::copy::published_tables;
use crate::copy::PublishedTable;
use crate::error::{Error, Result};
use crate::sql::{qualified_name, quote_ident, quote_literal};

/// pg_dump to use: PGAPPLY_PG_DUMP, else the newest /usr/lib/postgresql/*/bin/pg_dump, else PATH.
fn find_pg_dump() -> PathBuf {
    if let Some(p) = std::env::var_os("PGAPPLY_PG_DUMP") {
        return PathBuf::from(p);
    }
    crate::cluster::newest_installed("pg_dump").unwrap_or_else(|| PathBuf::from("pg_dump"))
}

/// A libpq keyword value, quoted.
fn libpq_value(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// libpq keywords for a connection, without the password (that goes in PGPASSWORD); TLS as
/// pgapply itself connects (sslmode and sslrootcert are pgapply's, not tokio-postgres's).
fn libpq_conninfo(config: &tokio_postgres::Config) -> String {
    let mut parts = Vec::new();
    // Every host, as libpq lists them (pg_dump tries them in turn, as pgapply does).
    let list = |items: Vec<String>| libpq_value(&items.join(","));
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.to_string_lossy().into_owned(),
        })
        .collect();
    if !hosts.is_empty() {
        parts.push(format!("host={}", list(hosts)));
    }
    let addrs: Vec<String> = config
        .get_hostaddrs()
        .iter()
        .map(|a| a.to_string())
        .collect();
    if !addrs.is_empty() {
        parts.push(format!("hostaddr={}", list(addrs)));
    }
    let ports: Vec<String> = config.get_ports().iter().map(|p| p.to_string()).collect();
    if !ports.is_empty() {
        parts.push(format!("port={}", list(ports)));
    }
    if let Some(u) = config.get_user() {
        parts.push(format!("user={}", libpq_value(u)));
    }
    if let Some(d) = config.get_dbname() {
        parts.push(format!("dbname={}", libpq_value(d)));
    }
    if let Some(o) = config.get_options() {
        parts.push(format!("options={}", libpq_value(o)));
    }
    let tls = crate::tls::settings_for(config);
    let mode = match tls.mode {
        crate::tls::SslMode::Disable => "disable",
        crate::tls::SslMode::Prefer => "prefer",
        crate::tls::SslMode::Require => "require",
        crate::tls::SslMode::VerifyCa => "verify-ca",
        crate::tls::SslMode::VerifyFull => "verify-full",
    };
    parts.push(format!("sslmode={mode}"));
    for (key, path) in [
        ("sslrootcert", &tls.root_cert),
        ("sslcert", &tls.client_cert),
        ("sslkey", &tls.client_key),
    ] {
        if let Some(path) = path {
            parts.push(format!("{key}={}", libpq_value(&path.to_string_lossy())));
        }
    }
    parts.join(" ")
}

/// The line of `sql` that holds character `position` (1-based, as the server counts), shortened.
fn statement_at(sql: &str, position: usize) -> Option<String> {
    let offset = sql.char_indices().nth(position.checked_sub(1)?)?.0;
    let start = sql[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = sql[offset..].find('\n').map_or(sql.len(), |i| offset + i);
    let shorten = |line: &str| match line.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &line[..cut]),
        None => line.to_owned(),
    };
    let line = shorten(sql[start..end].trim());
    // Inside a statement of several lines (a CREATE TABLE's column, say): which one.
    // (pg_dump puts a blank line and a `--` comment block before each statement.)
    let head = sql[..start]
        .lines()
        .rev()
        .take_while(|l| !l.trim_end().ends_with(';'))
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("--"))
        .last();
    Some(match head {
        Some(head) if !line.starts_with("CREATE ") && !line.starts_with("ALTER ") => {
            format!("{line} (in {})", shorten(head))
        }
        _ => line,
    })
}

/// Drops `SET name = ...;` lines of settings the target does not know: a newer pg_dump sets
/// parameters an older server rejects (`transaction_timeout` from 17, `default_table_access_method`
/// from 12), and the dump is otherwise valid for it.
/// Only pg_dump's own form is touched (`SET lower_case_name = value;` on one line); `SET LOCAL`,
/// `SET CONSTRAINTS`, `SET TIME ZONE` and custom `a.b` settings, as in function bodies, are kept.
fn without_unknown_settings(sql: &str, known: &[String]) -> String {
    sql.lines()
        .filter(|line| {
            let Some(rest) = line.strip_prefix("SET ") else {
                return true;
            };
            let Some((name, _)) = rest.split_once(" = ") else {
                return true;
            };
            let plain =
                !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            !plain || !line.trim_end().ends_with(';') || known.iter().any(|k| k == name)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `SET LOCAL maintenance_work_mem` for the index and key builds of post-data, where `wanted`
/// is more than the target's own setting (the server's 64MB default makes a key of a few million
/// rows sort on disk); nothing otherwise. PostgreSQL's "Populating a Database" advises the same
/// for a restore.
async fn sort_memory_setting(
    target: &tokio_postgres::Client,
    wanted: Option<u64>,
) -> Result<String> {
    let Some(wanted) = wanted else {
        return Ok(String::new());
    };
    let kilobytes = wanted / 1024;
    // PostgreSQL's range for the setting: 1MB to 2^31 - 1 kB.
    if !(1024..=i32::MAX as u64).contains(&kilobytes) {
        return Err(Error::usage(format!(
            "--maintenance-work-mem: {} kB is outside what PostgreSQL takes (1MB to 2TB): give a size like 512MB or 2GB, or `server` to keep the target's setting",
            kilobytes
        )));
    }
    let current: i64 = target
        .query_one(
            "SELECT pg_catalog.pg_size_bytes(pg_catalog.current_setting('maintenance_work_mem')) / 1024",
            &[],
        )
        .await
        .map_err(|e| Error::postgres("reading the target's maintenance_work_mem", e))?
        .get(0);
    Ok(if (kilobytes as i64) > current {
        format!("SET LOCAL maintenance_work_mem = {kilobytes};\n")
    } else {
        String::new()
    })
}

pub async fn schema(
    source_config: &tokio_postgres::Config,
    target_config: &tokio_postgres::Config,
    publications: &[String],
    section: &str,
    table_map: &crate::config::TableMap,
    sort_memory: Option<u64>,
) -> Result<()> {
    // Checked before anything is started.
    if !matches!(section, "all" | "pre-data" | "post-data") {
        return Err(Error::usage(format!(
            "--section {section:?}: use pre-data, post-data or all"
        )));
    }
    let source = crate::tls::connect(source_config).await.map_err(|e| {
        e.into_error(format!(
            "connecting to source {}",
            conninfo::describe(source_config)
        ))
    })?;
    let source_major: i32 = source
        .query_one(
            "SELECT current_setting('server_version_num')::int / 10000",
            &[],
        )
        .await
        .map_err(|e| Error::postgres("reading the source version", e))?
        .get(0);
    let tables = published_tables(&source, publications, table_map).await?;
    if tables.is_empty() {
        return Err(Error::definite(crate::copy::no_tables_message(
            publications,
        )));
    }
    // Renames are done by moving tables around the dump: two tables into one name, or a name
    // that is one table's source and another's target, cannot be.
    let renamed: Vec<&PublishedTable> = tables
        .iter()
        .filter(|t| t.qualified() != t.target_qualified())
        .collect();
    for &t in &renamed {
        let clash = tables.iter().find(|o| {
            !std::ptr::eq(*o, t)
                && (o.target_qualified() == t.target_qualified()
                    || o.qualified() == t.target_qualified())
        });
        if let Some(o) = clash {
            return Err(Error::usage(format!(
                "the config file maps {} to {}, which is also {} {}: pgapply schema cannot create that; create these tables on the target yourself",
                t.qualified(),
                t.target_qualified(),
                if o.qualified() == t.target_qualified() { "the source name of published table" } else { "where it maps" },
                o.qualified()
            )));
        }
    }
    // The published tables with their partitions and parents: a partitioned table published
    // through its root needs its partitions to take rows, a published partition needs its parent
    // to be created.
    let names: Vec<String> = tables.iter().map(|t| t.qualified()).collect();
    let related = source
        .query(
            "WITH RECURSIVE pub (oid) AS (SELECT x::regclass::oid FROM unnest($1::text[]) x), \
             up (oid) AS (SELECT oid FROM pub UNION SELECT i.inhparent FROM pg_inherits i JOIN up ON i.inhrelid = up.oid), \
             down (oid) AS (SELECT oid FROM pub UNION SELECT i.inhrelid FROM pg_inherits i JOIN down ON i.inhparent = down.oid) \
             SELECT n.nspname::text, c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid IN (SELECT oid FROM up UNION SELECT oid FROM down)",
            &[&names],
        )
        .await
        .map_err(|e| Error::postgres("listing the published tables' partitions and parents", e))?;
    let keep: Vec<(String, String)> = related.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mut schemas: Vec<String> = keep.iter().map(|(schema, _)| schema.clone()).collect();
    schemas.sort();
    schemas.dedup();
    // Relations in those schemas that are not published stay behind.
    let others = source
        .query(
            "SELECT n.nspname::text, c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = ANY ($1) AND c.relkind IN ('r', 'p', 'v', 'm', 'f')",
            &[&schemas],
        )
        .await
        .map_err(|e| Error::postgres("listing relations on the source", e))?;
    let pg_dump = find_pg_dump();
    let version = tokio::process::Command::new(&pg_dump)
        .arg("--version")
        .output()
        .await
        .map_err(|e| {
            Error::definite(format!(
                "cannot run pg_dump ({}): {e}; install the PostgreSQL client (for example apt-get install postgresql-client-{source_major}) or set PGAPPLY_PG_DUMP",
                pg_dump.display()
            ))
        })?;
    let text = String::from_utf8_lossy(&version.stdout);
    let dump_major: i32 = text
        .split_whitespace()
        .find_map(|w| w.split('.').next().and_then(|m| m.parse().ok()))
        .unwrap_or(0);
    if dump_major < source_major {
        return Err(Error::definite(format!(
            "{} ({}) is older than the source (PostgreSQL {source_major}): install pg_dump {source_major} or newer, or set PGAPPLY_PG_DUMP",
            text.trim(),
            pg_dump.display()
        )));
    }
    let mut cmd = tokio::process::Command::new(&pg_dump);
    // (Ended with pgapply when it is interrupted.)
    cmd.kill_on_drop(true);
    // UTF8: names are read as UTF-8 whatever the source database's encoding; no tablespaces:
    // the target's may not be there.
    cmd.arg("--schema-only")
        .arg("--encoding=UTF8")
        .arg("--no-tablespaces")
        .arg("--no-owner")
        .arg("--no-privileges")
        .arg("--no-publications")
        .arg("--no-subscriptions")
        .arg(format!("--dbname={}", libpq_conninfo(source_config)));
    match section {
        "all" => {}
        "pre-data" | "post-data" => {
            cmd.arg(format!("--section={section}"));
        }
        other => {
            return Err(Error::usage(format!(
                "--section {other:?}: use pre-data, post-data or all"
            )))
        }
    }
    for s in &schemas {
        cmd.arg(format!("--schema={}", quote_ident(s)));
    }
    for row in &others {
        let (schema, name): (String, String) = (row.get(0), row.get(1));
        if !keep.iter().any(|(s, n)| *s == schema && *n == name) {
            cmd.arg(format!(
                "--exclude-table={}",
                qualified_name(&schema, &name)
            ));
        }
    }
    if let Some(pw) = source_config.get_password() {
        cmd.env("PGPASSWORD", String::from_utf8_lossy(pw).into_owned());
    }
    let out = cmd
        .output()
        .await
        .map_err(|e| Error::definite(format!("running pg_dump: {e}")))?;
    if !out.status.success() {
        return Err(Error::definite(format!(
            "pg_dump failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    // psql meta-commands (\connect, \restrict) mean nothing to the server.
    let sql: String = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.starts_with('\\'))
        .collect::<Vec<_>>()
        .join("\n");
    let target = crate::tls::connect(target_config).await.map_err(|e| {
        e.into_error(format!(
            "connecting to target {}",
            conninfo::describe(target_config)
        ))
    })?;
    // Schemas that already exist on the target (public) are fine, and their comments are the
    // target's own (a COMMENT ON SCHEMA public needs its owner, which the target role rarely is).
    let existing: Vec<String> = target
        .query(
            "SELECT pg_catalog.quote_ident(nspname) FROM pg_catalog.pg_namespace",
            &[],
        )
        .await
        .map_err(|e| Error::postgres("reading the target's schemas", e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    // Nor are they created again: even CREATE SCHEMA IF NOT EXISTS asks for CREATE on the
    // database, which a role that only creates tables in existing schemas need not have.
    let sql = sql
        .lines()
        .filter(|l| {
            l.strip_prefix("COMMENT ON SCHEMA ")
                .and_then(|rest| rest.split(" IS ").next())
                .is_none_or(|name| !existing.iter().any(|e| e == name))
        })
        .filter(|l| {
            l.strip_prefix("CREATE SCHEMA ")
                .map(|rest| rest.trim_end_matches(';'))
                .and_then(|rest| rest.split(" AUTHORIZATION ").next())
                .is_none_or(|name| !existing.iter().any(|e| e == name))
        })
        .collect::<Vec<_>>()
        .join("\n");
    let sql = sql.replace("CREATE SCHEMA ", "CREATE SCHEMA IF NOT EXISTS ");
    let known: Vec<String> = target
        .query("SELECT name FROM pg_catalog.pg_settings", &[])
        .await
        .map_err(|e| Error::postgres("reading the target's settings", e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let sql = without_unknown_settings(&sql, &known);
    let target_major: i32 = target
        .query_one(
            "SELECT current_setting('server_version_num')::int / 10000",
            &[],
        )
        .await
        .map_err(|e| Error::postgres("reading the target version", e))?
        .get(0);
    // One transaction: for post-data, the tables renamed by the config file take their source
    // names while the dump runs (pg_dump knows only those); they all end under their own names.
    let tag = format!(
        "$pgapply_{:x}$",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    let mut sql_all = String::from("BEGIN;\n");
    if section != "pre-data" {
        sql_all.push_str(&sort_memory_setting(&target, sort_memory).await?);
    }
    for t in &renamed {
        let at_target = relation_exists(&target, &t.target_qualified()).await?;
        let at_source = relation_exists(&target, &t.qualified()).await?;
        match (section, at_target, at_source) {
            ("post-data", true, false) => sql_all.push_str(&move_table(
                &t.target_schema,
                &t.target_name,
                &t.schema,
                &t.name,
            )),
            ("post-data", false, _) => {
                return Err(Error::definite(format!(
                    "table {} (published as {}) does not exist on the target: run pgapply schema --section pre-data first",
                    t.target_qualified(),
                    t.qualified()
                )))
            }
            ("post-data", true, true) => {
                return Err(Error::definite(format!(
                    "the target has both {} and {}, and the config file maps the source's {} to the first: drop or rename the second",
                    t.target_qualified(),
                    t.qualified(),
                    t.qualified()
                )))
            }
            (_, true, _) => {
                return Err(Error::definite(format!(
                    "table {} (published as {}) already exists on the target: pre-data creates it",
                    t.target_qualified(),
                    t.qualified()
                )))
            }
            _ => {}
        }
    }
    sql_all.push_str(&sql);
    sql_all.push('\n');
    for t in &renamed {
        sql_all.push_str(&format!(
            "DO {tag} BEGIN IF to_regclass({dst}) IS NOT NULL THEN RAISE EXCEPTION 'table % already exists on the target', {dst}; END IF; {stmt} END {tag};\n",
            dst = quote_literal(&t.target_qualified()),
            stmt = move_table(&t.schema, &t.name, &t.target_schema, &t.target_name)
        ));
    }
    // Columns left out of a column list (15+) never get a value: NOT NULL without a default
    // would refuse every row.
    if section != "post-data" {
        for t in &tables {
            let published = t
                .columns
                .iter()
                .map(|(c, _)| quote_literal(c))
                .collect::<Vec<_>>()
                .join(", ");
            sql_all.push_str(&format!(
                "DO {tag} DECLARE c text; BEGIN \
                   FOR c IN SELECT a.attname FROM pg_catalog.pg_attribute a \
                     JOIN pg_catalog.pg_class r ON r.oid = a.attrelid \
                     WHERE a.attrelid = to_regclass({table}) AND a.attnum > 0 AND NOT a.attisdropped \
                       AND NOT r.relispartition AND a.attinhcount = 0 \
                       AND a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' \
                       AND a.attname::text <> ALL (ARRAY[{published}]::text[]) \
                       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = a.attrelid \
                                       AND i.indisprimary AND a.attnum = ANY (i.indkey)) \
                   LOOP EXECUTE format('ALTER TABLE %s ALTER COLUMN %I DROP NOT NULL', {table}, c); END LOOP; \
                 END {tag};\n",
                table = quote_literal(&t.target_qualified()),
            ));
        }
    }
    sql_all.push_str("COMMIT;");
    let sql = sql_all;
    target
        .batch_execute(&sql)
        .await
        .map_err(|e| {
            // The statement the server refused, as the dump wrote it (its position is in the
            // whole text sent).
            let at = e
                .as_db_error()
                .and_then(|d| match d.position() {
                    Some(tokio_postgres::error::ErrorPosition::Original(p)) => {
                        statement_at(&sql, *p as usize)
                    }
                    _ => None,
                })
                .map(|line| format!("; the statement: {line}"))
                .unwrap_or_default();
            // A syntax the target's version does not know (generated columns before 12,
            // COMPRESSION before 14, ...).
            // (Or a type or function only the source's version has: multiranges before 14.)
            let older = if matches!(e.code().map(|c| c.code()), Some("42601" | "42704" | "42883"))
                && target_major < source_major
            {
                format!("; the target runs PostgreSQL {target_major}, older than the source's {source_major}, and the dump uses what the source's version has: create the published tables on the target yourself instead (pg_dump --schema-only of them from the source, with what PostgreSQL {target_major} lacks edited out, into psql on the target), or use a target of the source's version or newer")
            } else {
                String::new()
            };
            let hint = match e.code().map(|c| c.code()) {
                // A type or function from an extension: pg_dump --schema leaves extensions out.
                // Or from a schema no published table is in, which the dump does not cover.
                Some("42704") | Some("42883") => "; if it comes from an extension, CREATE EXTENSION it on the target first; if it is defined in a schema without published tables (the dump covers only the published tables' schemas), create it on the target first",
                // A type (or function) of a schema no published table is in: the dump neither
                // covers nor creates that schema.
                Some("3F000") => "; a type or function the tables use may be defined in a schema without published tables (the dump covers only the published tables' schemas): create that schema and what the tables use from it on the target first",
                // A foreign key to a table that is not published.
                Some("42P01") => "; a table it refers to may not be published: publish it, or create it on the target first",
                // Some of the definitions are there already: all or nothing, so none was made.
                // (42P16: a second primary key, post-data run again.)
                Some("42P07" | "42710" | "42723" | "42P06" | "42P16") => "; an object the dump creates is on the target already (named below; was this section run before?): drop what is there, or create the missing tables by hand (pg_dump --schema-only --table ...)",
                _ => "",
            };
            Error::postgres(format!("creating the definitions on the target (all or nothing: nothing was created){hint}{older}{at}"), e)
        })?;
    // (The schemas the `[tables]` mapping moves tables to, too.)
    let mut shown = schemas;
    shown.extend(tables.iter().map(|t| t.target_schema.clone()));
    shown.sort();
    shown.dedup();
    crate::out!(
        "created the definitions ({section}) of {} published table(s) in schema(s) {} on the target",
        tables.len(),
        shown.join(", ")
    );
    Ok(())
}

async fn relation_exists(client: &tokio_postgres::Client, qualified: &str) -> Result<bool> {
    Ok(client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
        .await
        .map_err(|e| Error::postgres("reading the target's tables", e))?
        .get(0))
}

/// Statements that give table `schema.name` the name `to_schema.to_name` (its owned sequences,
/// indexes and constraints go along).
fn move_table(schema: &str, name: &str, to_schema: &str, to_name: &str) -> String {
    let mut sql = String::new();
    let mut at = qualified_name(schema, name);
    if name != to_name {
        sql.push_str(&format!(
            "ALTER TABLE {at} RENAME TO {}; ",
            quote_ident(to_name)
        ));
        at = qualified_name(schema, to_name);
    }
    if schema != to_schema {
        sql.push_str(&format!(
            "CREATE SCHEMA IF NOT EXISTS {s}; ALTER TABLE {at} SET SCHEMA {s}; ",
            s = quote_ident(to_schema)
        ));
    }
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_statement_at_a_position_is_named_with_its_table() {
        let sql = "SET x = 1;\n\n--\n-- Name: t; Type: TABLE; Schema: public\n--\n\nCREATE TABLE public.t (\n    a integer,\n    g integer GENERATED ALWAYS AS ((a + 1)) STORED\n);\nCREATE INDEX i ON t (a);";
        let at = |needle: &str| sql.find(needle).unwrap() + 1;
        assert_eq!(
            statement_at(sql, at("GENERATED")).as_deref(),
            Some("g integer GENERATED ALWAYS AS ((a + 1)) STORED (in CREATE TABLE public.t ()")
        );
        assert_eq!(
            statement_at(sql, at("INDEX")).as_deref(),
            Some("CREATE INDEX i ON t (a);")
        );
        assert_eq!(statement_at(sql, 10_000), None);
    }

    #[test]
    fn settings_the_target_does_not_know_are_dropped() {
        let dump = "SET statement_timeout = 0;\nSET transaction_timeout = 0;\nSELECT pg_catalog.set_config('search_path', '', false);\nCREATE TABLE t (SET int);\nSET default_table_access_method = heap;\nSET LOCAL work_mem = '1MB';\nSET CONSTRAINTS ALL DEFERRED;\nSET app.x = 1;";
        let known = vec!["statement_timeout".to_owned(), "search_path".to_owned()];
        assert_eq!(
            without_unknown_settings(dump, &known),
            "SET statement_timeout = 0;\nSELECT pg_catalog.set_config('search_path', '', false);\nCREATE TABLE t (SET int);\nSET LOCAL work_mem = '1MB';\nSET CONSTRAINTS ALL DEFERRED;\nSET app.x = 1;"
        );
    }

    #[test]
    fn libpq_values_are_quoted() {
        assert_eq!(libpq_value("a b'c\\d"), "'a b\\'c\\\\d'");
    }

    #[test]
    fn pg_dump_is_given_every_host() {
        let config =
            crate::conninfo::parse("source", "host=a,b port=5433,5434 user=u dbname=d").unwrap();
        let text = libpq_conninfo(&config);
        assert!(
            text.contains("host='a,b'") && text.contains("port='5433,5434'"),
            "{text}"
        );
    }
}
