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
use crate::error::{Error, Result};
use crate::sql::qualified_name;

/// pg_dump to use: PGAPPLY_PG_DUMP, else the newest /usr/lib/postgresql/*/bin/pg_dump, else PATH.
fn find_pg_dump() -> PathBuf {
    if let Some(p) = std::env::var_os("PGAPPLY_PG_DUMP") {
        return PathBuf::from(p);
    }
    crate::cluster::newest_installed("pg_dump").unwrap_or_else(|| PathBuf::from("pg_dump"))
}

/// libpq keywords for a connection, without the password (that goes in PGPASSWORD).
fn libpq_conninfo(config: &tokio_postgres::Config) -> String {
    let mut parts = Vec::new();
    if let Some(tokio_postgres::config::Host::Tcp(h)) = config.get_hosts().first() {
        parts.push(format!("host='{h}'"));
    }
    if let Some(tokio_postgres::config::Host::Unix(p)) = config.get_hosts().first() {
        parts.push(format!("host='{}'", p.display()));
    }
    if let Some(port) = config.get_ports().first() {
        parts.push(format!("port={port}"));
    }
    if let Some(u) = config.get_user() {
        parts.push(format!("user='{}'", u.replace('\'', "\\'")));
    }
    if let Some(d) = config.get_dbname() {
        parts.push(format!("dbname='{}'", d.replace('\'', "\\'")));
    }
    parts.join(" ")
}

pub async fn schema(
    source_config: &tokio_postgres::Config,
    target_config: &tokio_postgres::Config,
    publications: &[String],
    section: &str,
) -> Result<()> {
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
    let tables = published_tables(&source, publications, &Default::default()).await?;
    if tables.is_empty() {
        return Err(Error::definite("the publications contain no tables"));
    }
    let mut schemas: Vec<String> = tables.iter().map(|t| t.schema.clone()).collect();
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
            "pg_dump {} is older than the source (PostgreSQL {source_major}): install pg_dump {source_major} or newer, or set PGAPPLY_PG_DUMP",
            text.trim()
        )));
    }
    let mut cmd = tokio::process::Command::new(&pg_dump);
    cmd.arg("--schema-only")
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
            return Err(Error::definite(format!(
                "--section {other:?}: use pre-data, post-data or all"
            )))
        }
    }
    for s in &schemas {
        cmd.arg(format!("--schema={}", crate::sql::quote_ident(s)));
    }
    for row in &others {
        let (schema, name): (String, String) = (row.get(0), row.get(1));
        if !tables.iter().any(|t| t.schema == schema && t.name == name) {
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
    // Schemas that already exist on the target (public) are fine.
    let sql = sql.replace("CREATE SCHEMA ", "CREATE SCHEMA IF NOT EXISTS ");
    target
        .batch_execute(&sql)
        .await
        .map_err(|e| Error::postgres("creating the definitions on the target", e))?;
    println!(
        "created the definitions ({section}) of {} published table(s) in schema(s) {} on the target",
        tables.len(),
        schemas.join(", ")
    );
    Ok(())
}
