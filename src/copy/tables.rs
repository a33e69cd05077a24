//! The published tables as the copy sees them: which tables (and partitions) the publications
//! hold on the source, with their published columns and row filters, and the target table each
//! goes to.

use std::collections::HashMap;

use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::sql::{qualified_name, quote_ident};

/// A published table as the copy sees it.
#[derive(Debug, Clone)]
pub struct PublishedTable {
    pub schema: String,
    pub name: String,
    /// Where it goes on the target (the same name unless mapped).
    pub target_schema: String,
    pub target_name: String,
    /// Published columns in table order, with their types (`format_type`).
    pub columns: Vec<(String, String)>,
    /// The publications' row filter (ORed), or none.
    pub row_filter: Option<String>,
    pub pages: i64,
    /// A partitioned table (published through its root): its rows are in its partitions.
    pub partitioned: bool,
    /// A published column has a type whose values cannot be copied in binary form
    /// (`sql::binary_unsafe_type_sql`): one not built into PostgreSQL (an enum, a domain, an
    /// extension's type, an array or composite of one) or an OID alias type (regclass ...),
    /// whose binary form carries the source's OIDs; aclitem, which has none; tsquery,
    /// int2vector and oidvector, whose empty values do not read back.
    pub binary_unsafe: bool,
    /// Source column -> its target column, where the configuration renames it
    /// (`[tables."s.t".columns]`).
    pub renamed_columns: HashMap<String, String>,
}

impl PublishedTable {
    /// The target column a published column goes into.
    pub fn target_column<'a>(&'a self, source_column: &'a str) -> &'a str {
        self.renamed_columns
            .get(source_column)
            .map_or(source_column, String::as_str)
    }

    /// Takes the configuration's column renames of this table.
    pub fn rename_columns(&mut self, column_map: &crate::config::ColumnMap) {
        if let Some(renames) = column_map.get(&(self.schema.clone(), self.name.clone())) {
            self.renamed_columns = renames.clone();
        }
    }

    /// The target's published columns, in the source's order, named as the source names them:
    /// a table expression to compare the target's rows with the source's (the table itself
    /// when no column is renamed). `rows` is the target table as read (`ONLY t` or `t`).
    pub fn target_rows_as_source(&self, rows: &str) -> String {
        if self.renamed_columns.is_empty() {
            return rows.to_owned();
        }
        let columns = self
            .columns
            .iter()
            .map(|(c, _)| {
                format!(
                    "{} AS {}",
                    quote_ident(self.target_column(c)),
                    quote_ident(c)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        format!("(SELECT {columns} FROM {rows}) AS pgapply_renamed")
    }

    /// The target's column list for the published columns, in the source's order.
    pub(super) fn target_column_list(&self) -> String {
        self.columns
            .iter()
            .map(|(c, _)| quote_ident(self.target_column(c)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn qualified(&self) -> String {
        qualified_name(&self.schema, &self.name)
    }

    /// `schema.table`, unquoted: the metrics' `table` label (what a query filters on).
    pub fn label(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }

    pub fn target_qualified(&self) -> String {
        qualified_name(&self.target_schema, &self.target_name)
    }

    pub(super) fn column_list(&self) -> String {
        self.columns
            .iter()
            .map(|(c, _)| quote_ident(c))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What to say when `publications` hold no table.
pub fn no_tables_message(publications: &[String]) -> String {
    let names: Vec<String> = publications.iter().map(|p| format!("{p:?}")).collect();
    format!(
        "publication{} {} contain{} no tables: add some (ALTER PUBLICATION {} ADD TABLE ...), or check --publication",
        if names.len() == 1 { "" } else { "s" },
        names.join(", "),
        if names.len() == 1 { "s" } else { "" },
        publications.first().map_or_else(|| "...".to_owned(), |p| quote_ident(p))
    )
}

/// `publication "a" does not exist`, `publications "a", "b" do not exist`.
pub fn missing_publications(missing: &[impl AsRef<str>]) -> String {
    let names: Vec<String> = missing
        .iter()
        .map(|p| format!("{:?}", p.as_ref()))
        .collect();
    if names.len() == 1 {
        format!("publication {} does not exist", names[0])
    } else {
        format!("publications {} do not exist", names.join(", "))
    }
}

/// The tables of `publications`, with their published columns and row filters. Fails naming
/// the publications that do not exist (a typo would otherwise read as "no tables", or leave a
/// publication's tables out unsaid).
///
/// Reading them takes a lock on each table: a table locked on the source (LOCK TABLE, or an
/// ALTER TABLE that waits itself) would hold every command that starts here without a word, so
/// the wait is said every 30 s, naming the sessions that hold such locks. (In steps of 5 s, so
/// that the session does not go on waiting on the source for long after the command ends.)
pub async fn published_tables(
    source: &Client,
    publications: &[String],
    table_map: &crate::config::TableMap,
) -> Result<Vec<PublishedTable>> {
    const STEP: &str = "SET lock_timeout = '5s'";
    let stepped = source.batch_execute(STEP).await.is_ok();
    let started = std::time::Instant::now();
    let mut said = None::<std::time::Instant>;
    let result = loop {
        match read_published_tables(source, publications, table_map).await {
            Err(e) if stepped && e.sqlstate() == Some("55P03") => {
                if said.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(30)) {
                    said = Some(std::time::Instant::now());
                    tracing::warn!(
                        waited_seconds = started.elapsed().as_secs(),
                        "reading the published tables on the source waits for a lock on one of them{}: it goes on when that transaction ends (or end it on the source: SELECT pg_terminate_backend(pid))",
                        exclusive_lock_holders(source).await
                    );
                }
            }
            other => break other,
        }
    };
    if stepped {
        let _ = source.batch_execute("RESET lock_timeout").await;
    }
    result
}

/// ", held by process N (user, "query")" for the sessions holding an ACCESS EXCLUSIVE lock on a
/// table of this database, or queued for one (an ALTER TABLE waiting behind a long reader holds
/// up everyone after it: its blockers are named too); "" if none is seen (or they cannot be
/// read).
async fn exclusive_lock_holders(source: &Client) -> String {
    let rows = source
        .query(
            "SELECT a.pid, coalesce(a.usename::text, ''), left(coalesce(a.query, ''), 120), bool_or(l.granted), \
                    pg_catalog.array_to_string(pg_catalog.pg_blocking_pids(a.pid), ', ') \
             FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'relation' AND l.mode = 'AccessExclusiveLock' \
               AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
               AND a.pid <> pg_catalog.pg_backend_pid() \
             GROUP BY 1, 2, 3 ORDER BY 4 DESC, 1 LIMIT 5",
            &[],
        )
        .await
        .unwrap_or_default();
    let holders: Vec<String> = rows
        .iter()
        .map(|r| {
            let who = format!(
                "process {} ({}, {:?})",
                r.get::<_, i32>(0),
                r.get::<_, String>(1),
                r.get::<_, String>(2)
            );
            let blockers: String = r.get(4);
            if r.get::<_, bool>(3) || blockers.is_empty() {
                who
            } else {
                format!("{who}, queued for it behind process(es) {blockers}")
            }
        })
        .collect();
    if holders.is_empty() {
        String::new()
    } else {
        format!(", held by {}", holders.join(", "))
    }
}

async fn read_published_tables(
    source: &Client,
    publications: &[String],
    table_map: &crate::config::TableMap,
) -> Result<Vec<PublishedTable>> {
    let context = |e| Error::postgres("listing the published tables on the source", e);
    let missing: Vec<String> = source
        .query(
            "SELECT n FROM unnest($1::text[]) n \
             WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication p WHERE p.pubname = n)",
            &[&publications],
        )
        .await
        .map_err(context)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if !missing.is_empty() {
        return Err(Error::definite(format!(
            "{} on the source: check --publication, or create {} there (CREATE PUBLICATION ... FOR TABLE ...)",
            missing_publications(&missing),
            if missing.len() == 1 { "it" } else { "them" }
        )));
    }
    let version = crate::sql::server_version(source).await.map_err(context)?;
    let columns = if version >= 150000 {
        "attnames::text[], rowfilter"
    } else {
        "NULL::text[], NULL::text"
    };
    let sql = format!(
        "SELECT schemaname::text, tablename::text, {columns} FROM pg_catalog.pg_publication_tables \
         WHERE pubname = ANY($1) AND NOT {}",
        crate::apply::applier::own_table_sql("schemaname", "tablename")
    );
    let rows = source
        .query(&sql, &[&publications])
        .await
        .map_err(context)?;
    // One table may be in several publications: columns are the union, filters are ORed, and
    // "no list" / "no filter" wins.
    struct Merged {
        columns: Option<Vec<String>>,
        filters: Option<Vec<String>>,
    }
    let mut merged: Vec<((String, String), Merged)> = Vec::new();
    for row in rows {
        let key: (String, String) = (row.get(0), row.get(1));
        let columns: Option<Vec<String>> = row.get(2);
        let filter: Option<String> = row.get(3);
        let index = match merged.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                merged.push((
                    key.clone(),
                    Merged {
                        columns: Some(Vec::new()),
                        filters: Some(Vec::new()),
                    },
                ));
                merged.len() - 1
            }
        };
        let entry = &mut merged[index].1;
        match (&mut entry.columns, columns) {
            (Some(all), Some(cols)) => all.extend(cols),
            (slot, None) => *slot = None,
            (None, _) => {}
        }
        match (&mut entry.filters, filter) {
            (Some(all), Some(f)) => all.push(f),
            (slot, None) => *slot = None,
            (None, _) => {}
        }
    }
    let mut tables = Vec::with_capacity(merged.len());
    // Every table's columns in one query (one per table cost a round trip and a plan each: a
    // thousand tables took seconds at every start).
    let names: Vec<String> = merged
        .iter()
        .map(|((schema, name), _)| qualified_name(schema, name))
        .collect();
    let rows = source
        .query(
            // Pages from the file's size: relpages is 0 until the first VACUUM or ANALYZE.
            &format!(
                "SELECT a.attname::text, {}, \
                        (pg_catalog.pg_relation_size(c.oid) / pg_catalog.current_setting('block_size')::int8)::int8, \
                        c.relkind = 'p', {}, coalesce(to_jsonb(a) ->> 'attgenerated', '') <> '', q.i \
                 FROM pg_catalog.unnest($1::text[]) WITH ORDINALITY AS q(name, i) \
                 JOIN pg_catalog.pg_class c ON c.oid = q.name::pg_catalog.regclass \
                 JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid \
                 WHERE a.attnum > 0 AND NOT a.attisdropped \
                 ORDER BY q.i, a.attnum",
                crate::sql::type_name_sql("a.atttypid", "a.atttypmod"),
                crate::sql::binary_unsafe_type_sql("a.atttypid"),
            ),
            &[&names],
        )
        .await
        .map_err(|e| {
            let which = match names.len() {
                1..=5 => names.join(", "),
                n => format!("{n} published tables"),
            };
            Error::postgres(format!("reading the columns of {which} on the source"), e)
        })?;
    let mut by_table: std::collections::HashMap<i64, Vec<tokio_postgres::Row>> =
        std::collections::HashMap::new();
    for row in rows {
        by_table.entry(row.get::<_, i64>(6)).or_default().push(row);
    }
    for (i, ((schema, name), m)) in merged.into_iter().enumerate() {
        let info = by_table.remove(&(i as i64 + 1)).unwrap_or_default();
        let pages = info.first().map_or(0, |r| r.get::<_, i64>(2));
        let partitioned = info.first().is_some_and(|r| r.get::<_, bool>(3));
        // The publication's column list says what is published (PostgreSQL 18 may list stored
        // generated columns: their values are streamed, so they are copied too). Without a list
        // (before 15) every column but the generated ones is. PostgreSQL 15 lists generated
        // columns even without a column list, but streams no value for them before 18.
        let published: Vec<&tokio_postgres::Row> = info
            .iter()
            .filter(|r| {
                let generated = r.get::<_, bool>(5);
                match &m.columns {
                    Some(list) => {
                        list.contains(&r.get::<_, String>(0)) && (version >= 180000 || !generated)
                    }
                    None => !generated,
                }
            })
            .collect();
        let binary_unsafe = published.iter().any(|r| r.get::<_, bool>(4));
        let columns = published
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
            .collect();
        // (The same filter from two publications once: `(a) OR (a)` would read as another one.
        // Sorted: the catalog's order changes with any ALTER PUBLICATION.)
        let row_filter = m.filters.filter(|f| !f.is_empty()).map(|f| {
            let mut unique: Vec<&String> = Vec::new();
            for x in &f {
                if !unique.contains(&x) {
                    unique.push(x);
                }
            }
            unique.sort();
            unique
                .iter()
                .map(|x| format!("({x})"))
                .collect::<Vec<_>>()
                .join(" OR ")
        });
        let (target_schema, target_name) = table_map
            .get(&(schema.clone(), name.clone()))
            .cloned()
            .unwrap_or_else(|| (schema.clone(), name.clone()));
        tables.push(PublishedTable {
            schema,
            name,
            target_schema,
            target_name,
            columns,
            row_filter,
            pages,
            partitioned,
            binary_unsafe,
            renamed_columns: HashMap::new(),
        });
    }
    // A partition listed beside its partitioned root (a publication through the root and another
    // naming the partition, or FOR ALL TABLES): the stream sends its changes as the root's, and
    // the root's copy reads its rows. Copied again on its own, they would be there twice.
    if tables.iter().any(|t| t.partitioned) {
        let names: Vec<String> = tables.iter().map(PublishedTable::qualified).collect();
        let inside: Vec<String> = source
            .query(
                "SELECT t.q FROM unnest($1::text[]) AS t(q) \
                 WHERE EXISTS (SELECT 1 FROM pg_catalog.pg_partition_ancestors(t.q::regclass) a \
                               WHERE a.relid <> t.q::regclass \
                                 AND a.relid IN (SELECT x::regclass FROM unnest($1::text[]) AS x))",
                &[&names],
            )
            .await
            .map_err(context)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for name in &inside {
            tracing::debug!(table = %name, "copied with its partitioned root, which is published too");
        }
        tables.retain(|t| !inside.contains(&t.qualified()));
    }
    Ok(tables)
}

/// How to name a table in a statement about its own rows: `ONLY t` for a plain table (an inheritance parent's
/// children are published, or kept, as tables of their own, as the copy reads them), `t` for a
/// partitioned one (its rows are in its partitions). Errors if the table does not exist.
pub async fn own_rows(client: &Client, qualified: &str, role: &str) -> Result<String> {
    let partitioned: bool = client
        .query_one(
            "SELECT relkind = 'p' FROM pg_catalog.pg_class WHERE oid = $1::text::regclass",
            &[&qualified],
        )
        .await
        .map_err(|e| Error::postgres(format!("reading table {qualified} on the {role}"), e))?
        .get(0);
    Ok(if partitioned {
        qualified.to_owned()
    } else {
        format!("ONLY {qualified}")
    })
}
