//! `pgapply check`: validates the settings and both servers before anything runs, and lists every
//! problem found (not just the first), each naming the object and what to do.

use tokio_postgres::Client;

use crate::cli::RunArgs;
use crate::config::{self, FileConfig};
use crate::conninfo;
use crate::copy::published_tables;
use crate::error::{Error, Result};
use crate::sql::quote_ident;

struct Report {
    problems: Vec<String>,
}

impl Report {
    fn ok(&self, text: impl AsRef<str>) {
        println!("ok       {}", text.as_ref());
    }
    fn problem(&mut self, text: impl Into<String>) {
        let text = text.into();
        println!("PROBLEM  {text}");
        self.problems.push(text);
    }
}

pub async fn check_command(args: &RunArgs, file: &FileConfig) -> Result<()> {
    let mut report = Report {
        problems: Vec::new(),
    };
    let (config, _) = match config::resolve(args, file) {
        Ok(c) => c,
        Err(e) => {
            report.problem(e.to_string());
            return finish(report);
        }
    };
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
    if let Some(src) = &source {
        check_source(src, &config, &mut report, &mut tables).await;
    }
    if let (Some(dst), false) = (&target, tables.is_empty()) {
        check_target(dst, &mut report, &tables).await;
    }
    finish(report)
}

fn finish(report: Report) -> Result<()> {
    if report.problems.is_empty() {
        println!("no problems found");
        Ok(())
    } else {
        Err(Error::definite(format!(
            "{} problem(s) found: {}",
            report.problems.len(),
            report.problems.join("; ")
        )))
    }
}

async fn query_bool(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Option<bool> {
    client
        .query_one(sql, params)
        .await
        .ok()
        .and_then(|r| r.get::<_, Option<bool>>(0))
}

async fn check_source(
    src: &Client,
    config: &crate::replicate::RunConfig,
    report: &mut Report,
    tables: &mut Vec<crate::copy::PublishedTable>,
) {
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
        Err(e) => report.problem(format!("source: cannot read wal_level: {e}")),
    }
    if query_bool(
        src,
        "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
        &[],
    )
    .await
        == Some(true)
    {
        report.ok("source role may replicate");
    } else {
        report.problem("the source role lacks the REPLICATION attribute: ALTER ROLE ... REPLICATION (or use a superuser)");
    }
    for publication in &config.publications {
        if query_bool(
            src,
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            &[publication],
        )
        .await
            == Some(true)
        {
            report.ok(format!("publication {publication:?} exists"));
        } else {
            report.problem(format!(
                "publication {publication:?} does not exist on the source: CREATE PUBLICATION {} FOR TABLE ...",
                quote_ident(publication)
            ));
        }
    }
    match src
        .query_opt(
            "SELECT plugin::text, database::text = current_database() FROM pg_replication_slots WHERE slot_name = $1",
            &[&config.slot],
        )
        .await
    {
        Ok(Some(row)) => {
            let plugin: Option<String> = row.get(0);
            let same_db: Option<bool> = row.get(1);
            if plugin.as_deref() != Some("pgoutput") {
                report.problem(format!("slot {:?} uses plugin {:?}; pgapply needs pgoutput", config.slot, plugin));
            } else if same_db != Some(true) {
                report.problem(format!("slot {:?} belongs to another database than the source connection", config.slot));
            } else {
                report.ok(format!("slot {:?} exists (pgoutput)", config.slot));
            }
        }
        Ok(None) if config.create_slot || config.copy_data => {
            report.ok(format!("slot {:?} will be created", config.slot))
        }
        Ok(None) => report.problem(format!(
            "replication slot {:?} does not exist on the source: run with --create-slot",
            config.slot
        )),
        Err(e) => report.problem(format!("source: cannot read pg_replication_slots: {e}")),
    }
    match published_tables(src, &config.publications, &config.table_map).await {
        Ok(t) => *tables = t,
        Err(e) => {
            report.problem(e.to_string());
            return;
        }
    }
    if tables.is_empty() {
        report.problem("the publications contain no tables");
    }
    for table in tables.iter() {
        let qualified = table.qualified();
        let row = src
            .query_one(
                "SELECT c.relreplident::text, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), \
                        has_table_privilege(c.oid, 'SELECT') \
                 FROM pg_class c WHERE c.oid = $1::text::regclass",
                &[&qualified],
            )
            .await;
        match row {
            Ok(row) => {
                let identity: String = row.get(0);
                let has_pk: bool = row.get(1);
                if identity == "n" || (identity == "d" && !has_pk) {
                    report.problem(format!(
                        "table {qualified} has no primary key and no replica identity on the source: UPDATE and DELETE on it fail on the source; add a primary key or ALTER TABLE {qualified} REPLICA IDENTITY FULL"
                    ));
                } else {
                    report.ok(format!("table {qualified} has a replica identity"));
                }
                if config.copy_data && !row.get::<_, bool>(2) {
                    report.problem(format!("the source role may not SELECT from {qualified} (needed by --copy-data): GRANT SELECT ON {qualified} TO ..."));
                }
            }
            Err(e) => report.problem(format!("source table {qualified}: {e}")),
        }
    }
}

async fn check_target(dst: &Client, report: &mut Report, tables: &[crate::copy::PublishedTable]) {
    let can_create = query_bool(
        dst,
        "SELECT has_database_privilege(current_database(), 'CREATE') OR EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'pgapply' AND has_schema_privilege(oid, 'CREATE'))",
        &[],
    )
    .await;
    if can_create == Some(true) {
        report.ok("target role may keep pgapply's state (schema pgapply)");
    } else {
        report.problem("the target role may not create schema pgapply: GRANT CREATE ON DATABASE ... TO ..., or create the schema for it");
    }
    for table in tables {
        let qualified = table.target_qualified();
        let rows = dst
            .query(
                "SELECT a.attname::text, pg_catalog.format_type(a.atttypid, a.atttypmod), t.typcategory::text, \
                        coalesce(to_jsonb(a) ->> 'attgenerated', '') <> '', \
                        has_table_privilege(a.attrelid, 'INSERT') AND has_table_privilege(a.attrelid, 'UPDATE') AND has_table_privilege(a.attrelid, 'DELETE') \
                 FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
                 WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
                &[&qualified],
            )
            .await;
        let rows = match rows {
            Ok(r) if !r.is_empty() => r,
            Ok(_) => {
                report.problem(format!(
                    "table {qualified} does not exist on the target: create it with the published columns"
                ));
                continue;
            }
            Err(e) => {
                report.problem(format!("target table {qualified}: {e}"));
                continue;
            }
        };
        if !rows[0].get::<_, bool>(4) {
            report.problem(format!(
                "the target role may not INSERT, UPDATE and DELETE on {qualified}: GRANT INSERT, UPDATE, DELETE ON {qualified} TO ..."
            ));
        }
        let mut fine = true;
        for (column, source_type) in &table.columns {
            match rows.iter().find(|r| r.get::<_, String>(0) == *column) {
                None => {
                    fine = false;
                    report.problem(format!(
                        "column {} of {qualified} is published but missing on the target: ALTER TABLE {qualified} ADD COLUMN {} {source_type}",
                        quote_ident(column),
                        quote_ident(column)
                    ));
                }
                Some(r) if r.get::<_, bool>(3) => {
                    fine = false;
                    report.problem(format!(
                        "column {} of {qualified} is generated on the target but published by the source",
                        quote_ident(column)
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
                    }
                }
            }
        }
        if fine {
            report.ok(format!("table {qualified} matches on the target"));
        }
    }
}

/// Different type names that still take each other's text form: same family of numbers, text or
/// times (by the target type's category), or a length/precision change of the same type.
fn compatible(source: &str, target: &str, target_category: &str) -> bool {
    let base = |t: &str| t.split('(').next().unwrap_or(t).trim().to_owned();
    if base(source) == base(target) {
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
