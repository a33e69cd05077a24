//! Initial copy (`pgapply run --copy-data`): the published tables' existing rows, copied in the
//! snapshot of the slot's consistent point, so that streaming from that point neither misses nor
//! repeats a change.
//!
//! The slot is created on the replication session with EXPORT_SNAPSHOT; copy workers import that
//! snapshot (`SET TRANSACTION SNAPSHOT` in REPEATABLE READ transactions on ordinary connections)
//! and stream `COPY ... TO STDOUT` from the source into `COPY ... FROM STDIN` on the target, chunk
//! by chunk, so memory stays bounded whatever the table size. Several tables, and several page
//! ranges of a large table, are copied at once (`--copy-jobs`). Row filters and column lists of
//! the publications (PostgreSQL 15+) apply to the copy as they do to the stream.
//!
//! State per table is kept in `pgapply.copy_state`. A copy that was interrupted cannot continue
//! (its snapshot is gone), so it is started over: the slot is dropped, the tables emptied, and the
//! copy runs again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use futures_util::{pin_mut, SinkExt, StreamExt};
use tokio::sync::Mutex;
use tokio_postgres::{Client, IsolationLevel};

use crate::error::{Error, Result};
use crate::sql::{qualified_name, quote_ident, quote_literal};

mod later;
mod tables;

use later::target_table_exists;
pub use later::{
    copied_since, copies_to_make_again, cover_partitions, covered_by_copies, forget_unpublished,
    late_unfinished, set_synced_lsn, LaterCopies,
};
pub use tables::{
    missing_publications, no_tables_message, own_rows, published_tables, PublishedTable,
};

/// Bytes of COPY data gathered before they are handed to the target connection.
const COPY_BUFFER: usize = 256 * 1024;

#[derive(Debug, Clone)]
pub struct CopySettings {
    /// Copy jobs running at once.
    pub jobs: usize,
    /// Empty non-empty target tables instead of refusing.
    pub truncate_target: bool,
    /// Tables with more pages than this are split into page ranges (PostgreSQL 14+ sources).
    pub split_pages: i64,
    /// The configuration's column renames (`[tables."s.t".columns]`): a renamed column is
    /// copied into its target column.
    pub column_map: crate::config::ColumnMap,
}

impl Default for CopySettings {
    fn default() -> Self {
        CopySettings {
            jobs: 4,
            truncate_target: false,
            split_pages: 16_384,
            column_map: Default::default(),
        }
    }
}

/// What the target says about a slot's initial copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyStatus {
    /// Never started.
    None,
    /// Started but not finished: must start over.
    Incomplete,
    Done,
}

pub async fn status(target: &Client, slot: &str) -> Result<CopyStatus> {
    let row = target
        .query_one(
            // (Rows of tables copied later count only as "a copy was made": the initial copy's
            // tables may all have left the publication since, their rows forgotten.)
            "SELECT count(*), count(*) FILTER (WHERE state <> 'done' AND synced_lsn IS NULL) FROM pgapply.copy_state WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.copy_state on the target", e))?;
    let (all, unfinished): (i64, i64) = (row.get(0), row.get(1));
    Ok(match (all, unfinished) {
        (0, _) => CopyStatus::None,
        (_, 0) => CopyStatus::Done,
        _ => CopyStatus::Incomplete,
    })
}

/// Whether the target role may set `session_replication_role` (which keeps triggers and
/// foreign-key checks quiet during the copy).
fn may_quiet_triggers_sql(version: i32) -> &'static str {
    if version >= 150000 {
        "SELECT rolsuper OR has_parameter_privilege('session_replication_role', 'SET') FROM pg_roles WHERE rolname = current_user"
    } else {
        "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
    }
}

/// When the target role may not quiet them, names the target tables whose triggers or foreign
/// keys will act on the copied rows: tables are copied side by side in any order, so a
/// foreign key fails when a child's rows come before its parent's, and triggers change rows.
async fn warn_of_loud_triggers(target: &Client, tables: &[PublishedTable]) -> Result<()> {
    let loud = loud_trigger_tables(target, tables).await?;
    if !loud.is_empty() {
        tracing::warn!(
            tables = %loud.join(", "),
            "the target role may not set session_replication_role, so these tables' triggers and foreign keys act on the copied rows (a foreign key fails when a child table's rows arrive before its parent's): copy as a superuser (or, on PostgreSQL 15+, GRANT SET ON PARAMETER session_replication_role TO the role), or create the triggers and foreign keys after the copy (`pgapply schema --section post-data`)"
        );
    }
    Ok(())
}

/// The target tables whose triggers or foreign keys act on replicated rows: none when the
/// target role may set `session_replication_role` (as PostgreSQL's own subscriber does).
pub async fn loud_trigger_tables(
    target: &Client,
    tables: &[PublishedTable],
) -> Result<Vec<String>> {
    let context = |e| Error::postgres("reading the target's triggers and foreign keys", e);
    let version = crate::sql::server_version(target).await.map_err(context)?;
    let may: bool = target
        .query_one(may_quiet_triggers_sql(version), &[])
        .await
        .map_err(context)?
        .get(0);
    if may {
        return Ok(Vec::new());
    }
    let names: Vec<String> = tables.iter().map(|t| t.target_qualified()).collect();
    let loud: Vec<String> = target
        .query(
            "SELECT n FROM unnest($1::text[]) n JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(n) \
             WHERE EXISTS (SELECT FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal AND t.tgenabled IN ('O', 'A')) \
                OR EXISTS (SELECT FROM pg_catalog.pg_constraint k WHERE k.conrelid = c.oid AND k.contype = 'f') \
                OR EXISTS (SELECT FROM pg_catalog.pg_constraint k WHERE k.confrelid = c.oid AND k.contype = 'f' \
                                  AND (k.confdeltype IN ('c', 'n', 'd') OR k.confupdtype IN ('c', 'n', 'd'))) \
             ORDER BY 1",
            &[&names],
        )
        .await
        .map_err(context)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(loud)
}

/// The DEFERRABLE unique and primary-key constraints of the target tables (`table (constraint)`)
/// when the target role sets `session_replication_role = replica`, as PostgreSQL's own subscriber
/// does: a deferrable constraint is checked by a trigger, which does not fire then, so a row the
/// source sends that clashes with one written on the target goes in beside it, unnoticed.
pub async fn unenforced_unique_constraints(
    target: &Client,
    tables: &[PublishedTable],
) -> Result<Vec<String>> {
    let context = |e| Error::postgres("reading the target's unique constraints", e);
    let version = crate::sql::server_version(target).await.map_err(context)?;
    let replica: bool = target
        .query_one(may_quiet_triggers_sql(version), &[])
        .await
        .map_err(context)?
        .get(0);
    if !replica {
        return Ok(Vec::new());
    }
    let names: Vec<String> = tables.iter().map(|t| t.target_qualified()).collect();
    Ok(target
        .query(
            "SELECT n || ' (' || pg_catalog.quote_ident(k.conname) || ')' \
             FROM unnest($1::text[]) n JOIN pg_catalog.pg_constraint k ON k.conrelid = pg_catalog.to_regclass(n) \
             WHERE k.contype IN ('p', 'u') AND k.condeferrable ORDER BY 1",
            &[&names],
        )
        .await
        .map_err(context)?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Unique keys DEFERRABLE on the source whose columns the target keeps unique without deferring:
/// a statement that swaps keys on the source (legal there, checked at its end) stops the apply
/// with a duplicate key error that no row of the target's own causes, and deleting the row the
/// error names loses a row. Per key: its target table and a description of it.
pub async fn keys_deferrable_only_on_source(
    source: &Client,
    target: &Client,
    tables: &[PublishedTable],
) -> Result<Vec<(String, String)>> {
    let sources: Vec<String> = tables.iter().map(|t| t.qualified()).collect();
    let deferrable = source
        .query(
            "SELECT s.i::int, k.conname::text, \
                    ARRAY(SELECT a.attname::text FROM unnest(k.conkey) c \
                          JOIN pg_catalog.pg_attribute a ON a.attrelid = k.conrelid AND a.attnum = c \
                          ORDER BY 1) \
             FROM unnest($1::text[]) WITH ORDINALITY s (n, i) \
             JOIN pg_catalog.pg_constraint k ON k.conrelid = pg_catalog.to_regclass(s.n) \
             WHERE k.contype IN ('p', 'u') AND k.condeferrable",
            &[&sources],
        )
        .await
        .map_err(|e| Error::postgres("reading the source's deferrable unique keys", e))?;
    if deferrable.is_empty() {
        return Ok(Vec::new());
    }
    let targets: Vec<String> = tables.iter().map(|t| t.target_qualified()).collect();
    let immediate: Vec<(String, Vec<String>)> = target
        .query(
            "SELECT n, ARRAY(SELECT a.attname::text FROM unnest(i.indkey::int2[]) c \
                             JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = c \
                             ORDER BY 1) \
             FROM unnest($1::text[]) n \
             JOIN pg_catalog.pg_index i ON i.indrelid = pg_catalog.to_regclass(n) \
             WHERE i.indisunique AND i.indimmediate AND i.indpred IS NULL AND i.indexprs IS NULL",
            &[&targets],
        )
        .await
        .map_err(|e| Error::postgres("reading the target's unique keys", e))?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut found = Vec::new();
    for row in &deferrable {
        let Some(table) = usize::try_from(row.get::<_, i32>(0))
            .ok()
            .and_then(|i| tables.get(i.wrapping_sub(1)))
        else {
            continue;
        };
        let columns: Vec<String> = row.get(2);
        let target = table.target_qualified();
        if immediate.iter().any(|(t, c)| *t == target && *c == columns) {
            let quoted: Vec<String> = columns.iter().map(|c| quote_ident(c)).collect();
            found.push((
                target,
                format!(
                    "unique key {} ({}) of source table {} is DEFERRABLE, but target table {} keeps those columns unique without deferring: a statement that swaps their values on the source (legal there: checked at its end) stops pgapply with a duplicate key error on the target, and deleting the row it names would lose that row. Make the target's DEFERRABLE INITIALLY DEFERRED too (drop it and add it again so)",
                    quote_ident(row.get(1)),
                    quoted.join(", "),
                    table.qualified(),
                    table.target_qualified()
                ),
            ));
        }
    }
    Ok(found)
}

/// Checks the target tables: they exist with the published columns, and are empty (or are emptied
/// with `truncate`). Returns per table whether binary COPY can be used (same column types).
async fn prepare_target(
    target: &Client,
    slot: &str,
    tables: &[PublishedTable],
    truncate: bool,
    same_major: bool,
    late: bool,
) -> Result<Vec<bool>> {
    let mut binary = Vec::with_capacity(tables.len());
    let mut not_empty = Vec::new();
    let mut all = Vec::new();
    for table in tables {
        let qualified = table.target_qualified();
        let rows = target
            .query(
                &format!(
                    "SELECT a.attname::text, {}, (to_jsonb(a) ->> 'attgenerated') \
                     FROM pg_catalog.pg_attribute a \
                     WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
                    crate::sql::type_name_sql("a.atttypid", "a.atttypmod")
                ),
                &[&qualified],
            )
            .await
            .map_err(|e| Error::postgres(format!("reading table {qualified} on the target"), e))?;
        // (No column: a table without any, or none at all.)
        if rows.is_empty() && !target_table_exists(target, &qualified).await? {
            return Err(Error::definite(format!(
                "table {qualified} is published by the source but does not exist on the target: create it first (for example with `pgapply schema` or pg_dump --schema-only)"
            )));
        }
        let mut same_types = same_major && !table.binary_unsafe;
        for (source_column, source_type) in &table.columns {
            let column = table.target_column(source_column);
            let found = rows.iter().find(|r| r.get::<_, String>(0) == column);
            let Some(found) = found else {
                let renamed = if column == source_column {
                    String::new()
                } else {
                    format!(
                        " (source column {} renamed in the configuration)",
                        quote_ident(source_column)
                    )
                };
                return Err(Error::definite(format!(
                    "column {}{renamed} of table {qualified} is published by the source but does not exist on the target: add it on the target",
                    quote_ident(column)
                )));
            };
            let generated: Option<String> = found.get(2);
            if generated.is_some_and(|g| !g.is_empty()) {
                let version = crate::sql::server_version(target).await.ok();
                return Err(Error::definite(format!(
                    "column {} of target table {qualified} is a generated column, but the source publishes values for it: {}",
                    quote_ident(column),
                    crate::sql::generated_column_fix(&qualified, &quote_ident(column), version)
                )));
            }
            if found.get::<_, String>(1) != *source_type {
                same_types = false;
            }
        }
        binary.push(same_types);
        let own = own_rows(target, &qualified, "target").await?;
        let has_rows = target
            .query_one(&format!("SELECT EXISTS (SELECT 1 FROM {own})"), &[])
            .await
            .map_err(|e| Error::postgres(format!("reading table {qualified} on the target"), e))?
            .get::<_, bool>(0);
        // (Several source tables mapped onto one target table: named, and emptied, once.)
        if has_rows && !not_empty.contains(&qualified) {
            not_empty.push(qualified);
        }
        if !all.contains(&own) {
            all.push(own);
        }
    }
    if !not_empty.is_empty() {
        // Rows another worker (another slot, from another source) copied in: emptying the
        // table would lose them, and that worker never sends them again.
        let filled: Vec<&PublishedTable> = tables
            .iter()
            .filter(|t| not_empty.contains(&t.target_qualified()))
            .collect();
        let others = other_slots_filling(target, slot, &filled).await;
        if !others.is_empty() {
            let named: Vec<String> = others
                .iter()
                .map(|(table, other)| {
                    format!(
                        "{table} (filled by slot {})",
                        crate::sql::shown_literal(other)
                    )
                })
                .collect();
            let forget = match others
                .iter()
                .map(|(_, o)| o)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .as_slice()
            {
                [one] => format!("pgapply forget --target ... --slot {one}, with --drop-slot --source ... if its slot on the source is not used either"),
                _ => "pgapply forget --target ... --slot <that slot>, with --drop-slot --source ... if its slot on the source is not used either".to_owned(),
            };
            return Err(Error::definite(format!(
                "target {} {} not empty, and another worker (into this database) filled {}, by its initial copy or its stream: {}. Emptying {} would lose that worker's rows, which it never sends again, and --copy-data copies only into empty tables: copy this source's rows into {} by hand (COPY ... TO/FROM, in a snapshot you then start a slot at), and replicate from then on without --copy-data. If that worker no longer replicates into this database (a migration started over under a new slot), remove its state first ({forget}), then run this again",
                if named.len() == 1 { "table" } else { "tables" },
                if named.len() == 1 { "is" } else { "are" },
                if named.len() == 1 { "it" } else { "them" },
                named.join(", "),
                if named.len() == 1 { "it" } else { "them" },
                if named.len() == 1 { "it" } else { "them" },
            )));
        }
        if !truncate {
            let why = if late {
                "published after the initial copy, they are copied into empty tables (the rows the stream brought since they were published are in the copy too)"
            } else {
                "the initial copy needs empty tables"
            };
            return Err(Error::definite(format!(
                "target table{} {} {} not empty: {why}; empty them, or run with --truncate-target to let pgapply do it",
                if not_empty.len() == 1 { "" } else { "s" },
                not_empty.join(", "),
                if not_empty.len() == 1 { "is" } else { "are" }
            )));
        }
        // Every published table in one statement, the empty ones too: a table with rows may be
        // referenced by a foreign key of an empty one, and PostgreSQL truncates such a pair only
        // together. `ONLY` for plain tables, as everywhere pgapply names them.
        target
            .batch_execute(&format!("TRUNCATE {}", all.join(", ")))
            .await
            .map_err(|e| {
                Error::postgres(
                    format!("emptying {} on the target (--truncate-target; PostgreSQL refuses to empty a table that another one, not emptied in the same statement, references by a foreign key, even an empty one: drop that foreign key on the target for the copy and add it back after, or empty the tables by hand)", not_empty.join(", ")),
                    e,
                )
            })?;
        tracing::info!(tables = %not_empty.join(", "), "emptied target tables (--truncate-target)");
    }
    Ok(binary)
}

/// Says when target tables the copy fills are published on the target: its rows carry no
/// replication origin (PostgreSQL's own table sync sets one), so a worker replicating them back
/// with `--origin none` (a two-way setup) would take them for the target's own writes.
async fn warn_of_republished(target: &Client, tables: &[PublishedTable]) {
    // (Compared as regclass: pgapply quotes every name, PostgreSQL's quote_ident only where
    // needed.)
    let names: Vec<String> = tables.iter().map(|t| t.target_qualified()).collect();
    let Ok(rows) = target
        .query(
            "SELECT string_agg(DISTINCT pg_catalog.quote_ident(p.pubname), ', ') FROM pg_catalog.pg_publication_tables p \
             WHERE format('%I.%I', p.schemaname, p.tablename)::regclass = ANY ($1::text[]::regclass[])",
            &[&names],
        )
        .await
    else {
        return;
    };
    if let Some(publications) = rows.first().and_then(|r| r.get::<_, Option<String>>(0)) {
        tracing::warn!(
            publications = %publications,
            "tables this copy fills are published on the target: the copied rows carry no replication origin, so a worker that replicates them back from the target with --origin none (a two-way setup) receives them as the target's own writes. Make that worker's slot after this copy has finished (or skip the copy's transactions there)"
        );
    }
}

/// Names the large tables (`large_pages`: those a copy splits) that have indexes on the target:
/// every copied row goes into each index one at a time, where an index built after the rows is
/// one sort (the README's migration flow; about a third faster on pgbench, BENCHMARKS.md).
async fn note_indexes_in_place(target: &Client, tables: &[PublishedTable], large_pages: i64) {
    let large: Vec<String> = tables
        .iter()
        .filter(|t| t.pages >= large_pages)
        .map(PublishedTable::target_qualified)
        .collect();
    if large.is_empty() {
        return;
    }
    let Ok(row) = target
        .query_one(
            "SELECT string_agg(n, ', ') FROM unnest($1::text[]) n \
             WHERE EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = pg_catalog.to_regclass(n))",
            &[&large],
        )
        .await
    else {
        return;
    };
    if let Some(tables) = row.get::<_, Option<String>>(0) {
        tracing::info!(
            tables = %tables,
            "these large tables have indexes on the target, which the copy fills one row at a time: building them after the rows is faster (README \"Migrating a database\": schema --section pre-data, run --copy-data --copy-only, schema --section post-data, then run)"
        );
    }
}

/// The tables of `tables` another slot's initial copy took in (by source or target name), each
/// as its target name and that slot's name; none when that cannot be read.
pub(crate) async fn other_slots_filling(
    target: &Client,
    slot: &str,
    tables: &[&PublishedTable],
) -> Vec<(String, String)> {
    let Ok(rows) = target
        .query(
            "SELECT slot_name, schema_name, table_name FROM pgapply.copy_state WHERE slot_name <> $1 \
             UNION SELECT s.slot_name, s.schema_name, s.table_name FROM pgapply.slot_tables s \
                   JOIN pgapply.progress p USING (slot_name) WHERE s.slot_name <> $1 \
             ORDER BY 1",
            &[&slot],
        )
        .await
    else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for row in rows {
        let (other, schema, name): (String, String, String) = (row.get(0), row.get(1), row.get(2));
        for t in tables {
            let same = (t.schema == schema && t.name == name)
                || (t.target_schema == schema && t.target_name == name);
            if same
                && !found
                    .iter()
                    .any(|(q, s)| *q == t.target_qualified() && *s == other)
            {
                found.push((t.target_qualified(), other.clone()));
            }
        }
    }
    found
}

/// One unit of copy work: a table, or a page range of it.
struct CopyJob {
    table: usize,
    pages: Option<(i64, i64)>,
}

struct TableProgress {
    rows: AtomicU64,
    bytes: AtomicU64,
    jobs_left: AtomicU64,
    /// Of `bytes`, how much `record_bytes` has added to the metrics and to `pgapply.copy_state`.
    bytes_in_metrics: AtomicU64,
    bytes_in_state: AtomicU64,
    /// Ranges of the table being copied now (not waiting for a free job).
    active: AtomicU64,
}

/// Counts a range as being copied while it lives (`TableProgress::active`).
struct Active<'a>(&'a TableProgress);

impl<'a> Active<'a> {
    fn start(progress: &'a TableProgress) -> Self {
        progress.active.fetch_add(1, Ordering::Relaxed);
        Active(progress)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a table being copied may receive nothing before that is said (once per stall).
const COPY_SILENCE_WARNING: Duration = Duration::from_secs(60);

/// The source tables (schema, name) a slot's initial copy took in.
pub(crate) async fn copied_tables(
    target: &Client,
    slot: &str,
) -> std::result::Result<Vec<(String, String)>, tokio_postgres::Error> {
    Ok(target
        .query(
            "SELECT schema_name, table_name FROM pgapply.copy_state WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// Empties the tables a previous, interrupted copy wrote into, and forgets its state.
pub async fn reset_interrupted(
    target: &Client,
    slot: &str,
    table_map: &crate::config::TableMap,
) -> Result<()> {
    let context = |e| Error::postgres("resetting an interrupted initial copy on the target", e);
    let mut tables = Vec::new();
    for key in copied_tables(target, slot).await.map_err(context)? {
        let (schema, name) = table_map.get(&key).cloned().unwrap_or(key);
        let qualified = qualified_name(&schema, &name);
        let exists: bool = target
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
            .await
            .map_err(context)?
            .get(0);
        if !exists {
            continue;
        }
        // (Several source tables may be mapped onto one target table: each is emptied once.)
        let rows = own_rows(target, &qualified, "target").await?;
        if !tables.contains(&rows) {
            tables.push(rows);
        }
    }
    if !tables.is_empty() {
        target
            .batch_execute(&format!("TRUNCATE {}", tables.join(", ")))
            .await
            .map_err(context)?;
    }
    // The rows stay (pending) until `plan_copy` replaces them in one transaction: should that
    // fail, the copy still reads as interrupted, so a run without --copy-data refuses to stream
    // into the emptied tables, and the next --copy-data run knows the slot as the copy's own.
    target
        .execute(
            "UPDATE pgapply.copy_state SET state = 'pending' WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(context)?;
    // (Named as tables, without the TRUNCATE's ONLY.)
    let shown: Vec<&str> = tables
        .iter()
        .map(|t| t.strip_prefix("ONLY ").unwrap_or(t))
        .collect();
    tracing::warn!(tables = %shown.join(", "), "the previous initial copy was interrupted: starting it over");
    Ok(())
}

/// A copy of the tables published after the slot's initial copy (`plan_copy`).
#[derive(Debug, Clone, Copy)]
pub struct LateCopy {
    /// The slot decodes two-phase transactions: refused.
    pub two_phase: bool,
}

/// The tables an initial copy takes and the page ranges they are split into.
pub struct CopyPlan {
    tables: Vec<PublishedTable>,
    jobs: Vec<CopyJob>,
    /// Per table: binary COPY.
    binary: Vec<bool>,
}

/// Lists the published tables, checks (or empties, with `--truncate-target`) their target tables
/// and records them as pending in `pgapply.copy_state`. Done before the slot is created: a refusal
/// leaves no slot behind, and once a slot exists a run without `--copy-data` finds the copy
/// unfinished and refuses to stream into tables that were never copied.
#[allow(clippy::too_many_arguments)]
pub async fn plan_copy(
    source_config: &tokio_postgres::Config,
    target_pool: &Pool,
    target_config: &tokio_postgres::Config,
    slot: &str,
    publications: &[String],
    settings: &CopySettings,
    table_map: &crate::config::TableMap,
    source_major: u32,
    late: Option<LateCopy>,
) -> Result<Option<CopyPlan>> {
    let source = connect_source(source_config).await?;
    let target = crate::replicate::target_connection(target_pool, target_config).await?;
    crate::apply::sessions::register_copy(&target).await;
    let target_major: u32 = target
        .query_one(
            "SELECT current_setting('server_version_num')::int / 10000",
            &[],
        )
        .await
        .map_err(|e| Error::postgres("reading the target's version", e))?
        .get::<_, i32>(0) as u32;
    let mut tables = published_tables(&source, publications, table_map).await?;
    for table in &mut tables {
        table.rename_columns(&settings.column_map);
    }
    let all_targets: Vec<String> = tables
        .iter()
        .map(PublishedTable::target_qualified)
        .collect();
    if let Some(late) = late {
        // Tables published after the initial copy: those it did not take in, and those whose
        // own copy did not finish (their rows, from that copy, are pgapply's: emptied).
        // (A table marked to copy again, `recopy`, is copied as one published later: its rows
        // are the earlier copy's and the stream's, emptied only with --truncate-target.)
        let recorded: Vec<(String, String, bool)> = target
            .query(
                "SELECT schema_name, table_name, state = 'done' OR synced_lsn IS NULL \
                 FROM pgapply.copy_state WHERE slot_name = $1 AND NOT recopy",
                &[&slot],
            )
            .await
            .map_err(|e| Error::postgres("reading pgapply.copy_state on the target", e))?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        tables.retain(|t| {
            !recorded
                .iter()
                .any(|(schema, name, done)| *done && *schema == t.schema && *name == t.name)
        });
        if tables.is_empty() {
            return Ok(None);
        }
        let names: Vec<String> = tables.iter().map(PublishedTable::qualified).collect();
        // What is not copied is said, and the run goes on streaming: a worker kept running
        // with copy_data on (and started again by its retries) must not stop over it.
        if late.two_phase {
            // A transaction prepared before the copy's snapshot and committed after it is in
            // neither the copy nor, for these tables, the stream (applied at PREPARE).
            tracing::warn!(
                tables = %names.join(", "),
                "published after the initial copy, but not copied: --copy-data cannot copy them on a two-phase slot; their changes are applied from now on, and their earlier rows can be copied by hand (README: \"A table added to the publication later\")"
            );
            return Ok(None);
        }
        let mut kept = Vec::with_capacity(tables.len());
        for table in std::mem::take(&mut tables) {
            let qualified = table.target_qualified();
            let unfinished = recorded
                .iter()
                .any(|(schema, name, _)| *schema == table.schema && *name == table.name);
            // Never what would empty rows that are not this table's: a target table other
            // published tables are applied into too (partitions mapped onto their root under
            // [tables], say), or a partitioned one a plain source table is mapped onto.
            let shared = all_targets.iter().filter(|t| **t == qualified).count() > 1;
            let partitioned_target = !table.partitioned
                && target
                    .query_one(
                        "SELECT coalesce((SELECT relkind = 'p' FROM pg_catalog.pg_class WHERE oid = pg_catalog.to_regclass($1)), false)",
                        &[&qualified],
                    )
                    .await
                    .map_err(|e| Error::postgres(format!("reading table {qualified} on the target"), e))?
                    .get::<_, bool>(0);
            let why = if shared || partitioned_target {
                Some(format!("its target table {qualified} also holds rows of other tables, which the copy would empty"))
            } else if !unfinished && !settings.truncate_target {
                let exists = target_table_exists(&target, &qualified).await?;
                let has_rows = exists && {
                    let own = own_rows(&target, &qualified, "target").await?;
                    target
                        .query_one(&format!("SELECT EXISTS (SELECT 1 FROM {own})"), &[])
                        .await
                        .map_err(|e| {
                            Error::postgres(format!("reading table {qualified} on the target"), e)
                        })?
                        .get::<_, bool>(0)
                };
                let filled_by = if has_rows {
                    other_slots_filling(&target, slot, &[&table]).await
                } else {
                    Vec::new()
                };
                match filled_by.first() {
                    // Not to be emptied: that worker never sends its rows again.
                    Some((_, other)) => Some(format!("its target table {qualified} holds the rows another worker (slot {}) fills, which emptying it would lose: copy this source's earlier rows into it by hand (README: \"Several workers\", fan-in into one table)", crate::sql::shown_literal(other))),
                    None => has_rows.then(|| format!("its target table {qualified} is not empty (the stream brought rows since it was published, and the copy has them too): empty it, or run with --truncate-target, to have it copied")),
                }
            } else {
                None
            };
            match why {
                Some(why) => tracing::warn!(
                    table = %table.qualified(),
                    "published after the initial copy, but not copied: {why}; its changes are applied from now on"
                ),
                None => kept.push(table),
            }
        }
        tables = kept;
        if tables.is_empty() {
            return Ok(None);
        }
        let names: Vec<String> = tables.iter().map(PublishedTable::qualified).collect();
        let unfinished: Vec<&PublishedTable> = tables
            .iter()
            .filter(|t| {
                recorded
                    .iter()
                    .any(|(schema, name, _)| *schema == t.schema && *name == t.name)
            })
            .collect();
        let mut emptied = Vec::new();
        for table in unfinished {
            let qualified = table.target_qualified();
            if target_table_exists(&target, &qualified).await? {
                let own = own_rows(&target, &qualified, "target").await?;
                if !emptied.contains(&own) {
                    emptied.push(own);
                }
            }
        }
        if !emptied.is_empty() {
            target
                .batch_execute(&format!("TRUNCATE {}", emptied.join(", ")))
                .await
                .map_err(|e| {
                    Error::postgres("emptying the tables of an unfinished copy on the target", e)
                })?;
            let shown: Vec<&str> = emptied
                .iter()
                .map(|t| t.strip_prefix("ONLY ").unwrap_or(t))
                .collect();
            tracing::warn!(tables = %shown.join(", "), "the copy of these tables (published after the initial copy) did not finish: starting it over");
        }
        tracing::info!(tables = %names.join(", "), "published after the initial copy: copying their rows in a snapshot of their own; the stream then skips their changes that the copy holds");
    }
    if late.is_none() && source_major >= 15 {
        refuse_mixed_column_lists(&source, publications).await?;
    }
    warn_of_char_bytes(&tables, source_major, target_major);
    warn_of_loud_triggers(&target, &tables).await?;
    warn_of_republished(&target, &tables).await;
    if late.is_none() {
        note_indexes_in_place(&target, &tables, settings.split_pages).await;
    }
    let binary = prepare_target(
        &target,
        slot,
        &tables,
        settings.truncate_target,
        source_major == target_major,
        late.is_some(),
    )
    .await?;
    // Large tables are split by page ranges; TID range scans make that cheap from PostgreSQL 14.
    let mut jobs = Vec::new();
    let jobs_wanted = settings.jobs.max(1) as i64;
    for (i, table) in tables.iter().enumerate() {
        if source_major >= 14 && table.pages > settings.split_pages && jobs_wanted > 1 {
            let chunk = (table.pages / jobs_wanted)
                .max(settings.split_pages / 4)
                .max(1);
            let mut start = 0;
            while start <= table.pages {
                let end = start + chunk;
                // The last range is open-ended: the table may have grown since relpages was set.
                let last = end > table.pages;
                jobs.push(CopyJob {
                    table: i,
                    pages: Some((start, if last { i64::MAX } else { end })),
                });
                start = end;
            }
        } else {
            jobs.push(CopyJob {
                table: i,
                pages: None,
            });
        }
    }
    // The plan replaces whatever an earlier copy for this slot recorded: a table recorded there
    // but no longer published would be emptied if this copy were interrupted and started over.
    let record = |e| Error::postgres("recording the initial copy on the target", e);
    // (A copy of tables published later keeps what the initial copy recorded; its own rows get
    // a snapshot position, 0/0 until its slot exists: `set_synced_lsn`.)
    // What publishes each table now (`forget_unpublished` compares at later starts).
    let keys: Vec<(String, String)> = tables
        .iter()
        .map(|t| (t.schema.clone(), t.name.clone()))
        .collect();
    let membership = later::memberships(&source, publications, &keys).await?;
    target.batch_execute("BEGIN").await.map_err(record)?;
    if late.is_none() {
        target
            .execute(
                "DELETE FROM pgapply.copy_state WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(record)?;
    }
    let synced: Option<String> = late.map(|_| "0/0".to_owned());
    for (i, table) in tables.iter().enumerate() {
        let jobs_total = jobs.iter().filter(|j| j.table == i).count() as i32;
        let (relid, published_by) = membership
            .get(&(table.schema.clone(), table.name.clone()))
            .map(|(relid, rows)| (Some(*relid), Some(rows)))
            .unwrap_or((None, None));
        target
            .execute(
                "INSERT INTO pgapply.copy_state (slot_name, schema_name, table_name, state, jobs_total, synced_lsn, membership, source_relid, row_filter) \
                 VALUES ($1, $2, $3, 'pending', $4, $5::text::pg_lsn, $6, $7, $8) \
                 ON CONFLICT (slot_name, schema_name, table_name) DO UPDATE \
                 SET state = 'pending', rows_copied = 0, bytes_copied = 0, jobs_total = $4, jobs_done = 0, recopy = false, \
                     synced_lsn = $5::text::pg_lsn, started_at = NULL, finished_at = NULL, membership = $6, source_relid = $7, row_filter = $8",
                &[&slot, &table.schema, &table.name, &jobs_total, &synced, &published_by, &relid, &table.row_filter.clone().unwrap_or_default()],
            )
            .await
            .map_err(record)?;
        // The target table this slot fills, under its own name (copy_state has the source's):
        // another worker's copy or --truncate-target into it is then refused, whatever
        // [tables] maps onto it on either side.
        target
            .execute(
                "INSERT INTO pgapply.slot_tables (slot_name, schema_name, table_name) VALUES ($1, $2, $3) \
                 ON CONFLICT DO NOTHING",
                &[&slot, &table.target_schema, &table.target_name],
            )
            .await
            .map_err(record)?;
    }
    target.batch_execute("COMMIT").await.map_err(record)?;
    Ok(Some(CopyPlan {
        tables,
        jobs,
        binary,
    }))
}

/// Tasks of the copy, aborted when it ends or is dropped.
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Copies the planned tables as of `snapshot`. The caller keeps the exporting replication session
/// idle until this returns.
pub async fn copy_tables(
    plan: CopyPlan,
    source_config: &tokio_postgres::Config,
    target_pool: &Pool,
    target_config: &tokio_postgres::Config,
    slot: &str,
    snapshot: &str,
    settings: &CopySettings,
) -> Result<Vec<PublishedTable>> {
    let CopyPlan {
        tables,
        jobs,
        binary,
    } = plan;
    let progress: Vec<Arc<TableProgress>> = tables
        .iter()
        .enumerate()
        .map(|(i, _)| {
            Arc::new(TableProgress {
                rows: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
                jobs_left: AtomicU64::new(jobs.iter().filter(|j| j.table == i).count() as u64),
                bytes_in_metrics: AtomicU64::new(0),
                bytes_in_state: AtomicU64::new(0),
                active: AtomicU64::new(0),
            })
        })
        .collect();
    let total_jobs = jobs.len();
    tracing::info!(
        tables = tables.len(),
        parts = total_jobs,
        copy_jobs = settings.jobs,
        "starting the copy"
    );
    let queue = Arc::new(Mutex::new(jobs.into_iter()));
    let tables = Arc::new(tables);
    let binary = Arc::new(binary);
    let started = Instant::now();

    let reporter = {
        let tables = tables.clone();
        let progress = progress.clone();
        tokio::spawn(tracing::Instrument::in_current_span(report_progress(
            tables, progress, started,
        )))
    };

    let recorder = {
        let tables = tables.clone();
        let progress = progress.clone();
        let pool = target_pool.clone();
        let target_config = target_config.clone();
        let slot = slot.to_owned();
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                if let Ok(target) = crate::replicate::target_connection(&pool, &target_config).await
                {
                    record_bytes(&target, &slot, &tables, &progress).await;
                }
            }
        }))
    };

    // Dropped with this future (a stop asked for during the copy), the tasks end too.
    let mut tasks = AbortOnDrop(vec![reporter.abort_handle(), recorder.abort_handle()]);
    // Once a job failed the copy starts over anyway: the others stop taking jobs.
    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..settings.jobs.max(1).min(total_jobs.max(1)) {
        let failed = failed.clone();
        let queue = queue.clone();
        let tables = tables.clone();
        let binary = binary.clone();
        let progress = progress.clone();
        let source_config = source_config.clone();
        let target_config = target_config.clone();
        let pool = target_pool.clone();
        let slot = slot.to_owned();
        let snapshot = snapshot.to_owned();
        workers.push(tokio::spawn(tracing::Instrument::in_current_span(
            async move {
                let mut source = connect_source(&source_config).await?;
                let mut target = crate::replicate::target_connection(&pool, &target_config).await?;
                crate::apply::sessions::register_copy(&target).await;
                loop {
                    if failed.load(Ordering::Relaxed) {
                        return Ok::<(), Error>(());
                    }
                    let job = queue.lock().await.next();
                    let Some(job) = job else {
                        return Ok(());
                    };
                    let table = &tables[job.table];
                    copy_one(
                        &mut source,
                        &mut target,
                        table,
                        job.pages,
                        binary[job.table],
                        &snapshot,
                        &slot,
                        &progress[job.table],
                    )
                    .await
                    .inspect_err(|_| failed.store(true, Ordering::Relaxed))?;
                }
            },
        )));
    }
    tasks.0.extend(workers.iter().map(|w| w.abort_handle()));
    let mut failure = None;
    for w in workers {
        match w.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                failure.get_or_insert(e);
            }
            Err(e) => {
                failure.get_or_insert(Error::definite(format!("a copy worker failed: {e}")));
            }
        }
    }
    drop(tasks);
    if let Some(e) = failure {
        return Err(e);
    }
    let target = crate::replicate::target_connection(target_pool, target_config).await?;
    record_bytes(&target, slot, &tables, &progress).await;
    let rows: u64 = progress
        .iter()
        .map(|p| p.rows.load(Ordering::Relaxed))
        .sum();
    let bytes: u64 = progress
        .iter()
        .map(|p| p.bytes.load(Ordering::Relaxed))
        .sum();
    tracing::info!(
        tables = tables.len(),
        rows,
        megabytes = bytes / 1_000_000,
        seconds = format!("{:.1}", started.elapsed().as_secs_f64()),
        "copy done"
    );
    Ok(Arc::try_unwrap(tables).unwrap_or_else(|t| (*t).clone()))
}

/// Adds the bytes copied since the last call, per table, to the metrics and to
/// `pgapply.copy_state`: `pgapply status` shows a table's progress while it is copied, not only
/// when one of its ranges is done. (Rows are counted when a range is done: COPY says how many.)
async fn record_bytes(
    target: &Client,
    slot: &str,
    tables: &[PublishedTable],
    progress: &[Arc<TableProgress>],
) {
    for (table, p) in tables.iter().zip(progress) {
        let now = p.bytes.load(Ordering::Relaxed);
        let delta = now.saturating_sub(p.bytes_in_metrics.swap(now, Ordering::Relaxed));
        if delta > 0 {
            crate::metrics::METRICS.copied(&table.label(), 0, delta);
        }
        if now == p.bytes_in_state.load(Ordering::Relaxed) {
            continue;
        }
        // The total, not an increment: a write cut short (the task is aborted at the end) and
        // made again cannot count twice.
        let recorded = target
            .execute(
                "UPDATE pgapply.copy_state SET bytes_copied = greatest(bytes_copied, $4) \
                 WHERE slot_name = $1 AND schema_name = $2 AND table_name = $3",
                &[&slot, &table.schema, &table.name, &(now as i64)],
            )
            .await;
        match recorded {
            Ok(_) => {
                p.bytes_in_state.store(now, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(error = %crate::error::describe_postgres(&e), "could not record the copy's progress; trying again");
            }
        }
    }
}

/// Copy progress per table: a bar per table redrawn every second on a terminal, a log line per
/// table every 5 seconds otherwise.
async fn report_progress(
    tables: Arc<Vec<PublishedTable>>,
    progress: Vec<Arc<TableProgress>>,
    started: Instant,
) {
    use std::io::{IsTerminal, Write};
    let terminal = std::io::stderr().is_terminal();
    let mut tick = tokio::time::interval(Duration::from_secs(if terminal { 1 } else { 5 }));
    tick.tick().await;
    let mut drawn = 0usize;
    // Per table: the bytes last seen while it was being copied, since when, and whether that
    // stall was said.
    let mut seen: Vec<(u64, Instant, bool)> = vec![(0, Instant::now(), false); tables.len()];
    let silence = crate::failpoint::copy_silence(COPY_SILENCE_WARNING);
    loop {
        tick.tick().await;
        let secs = started.elapsed().as_secs_f64().max(0.001);
        let mut lines = Vec::new();
        for ((table, p), seen) in tables.iter().zip(progress.iter()).zip(seen.iter_mut()) {
            let left = p.jobs_left.load(Ordering::Relaxed);
            let rows = p.rows.load(Ordering::Relaxed);
            let bytes = p.bytes.load(Ordering::Relaxed);
            if p.active.load(Ordering::Relaxed) == 0 || bytes != seen.0 {
                *seen = (bytes, Instant::now(), false);
            } else if !seen.2 && seen.1.elapsed() >= silence {
                seen.2 = true;
                tracing::warn!(
                    table = %table.qualified(),
                    "copying: nothing of this table has been copied for {}: the source may be reading rows its row filter leaves out, or a server waiting for a lock (look at pg_stat_activity on both), or a connection gone silent behind a device that keeps it open (then stop pgapply and start it again: the copy starts over); pgapply goes on waiting",
                    humantime::format_duration(silence)
                );
            }
            let estimate = (table.pages.max(1) as f64) * 8192.0;
            let fraction = if left == 0 {
                1.0
            } else {
                (bytes as f64 / estimate).min(0.99)
            };
            let rate = bytes as f64 / 1e6 / secs;
            // Seconds left, as a log field (`eta=6s`); the bar says "eta 6s".
            let eta = if left == 0 {
                "done".to_owned()
            } else if bytes > 0 && (bytes as f64) < estimate {
                format!("{:.0}s", (estimate - bytes as f64) / (bytes as f64 / secs))
            } else {
                "?".to_owned()
            };
            if terminal {
                let filled = (fraction * 30.0) as usize;
                lines.push(format!(
                    "{:<40} [{}{}] {:>10} rows {:>8.1} MB {:>6.1} MB/s {}",
                    table.qualified(),
                    "#".repeat(filled),
                    " ".repeat(30 - filled),
                    rows,
                    bytes as f64 / 1e6,
                    rate,
                    if left == 0 { eta } else { format!("eta {eta}") }
                ));
            } else if left > 0 && bytes > 0 {
                tracing::info!(
                    table = %table.qualified(),
                    rows,
                    megabytes = bytes / 1_000_000,
                    rate_mb_s = format!("{rate:.1}"),
                    eta = %eta,
                    "copying"
                );
            }
        }
        if terminal {
            let mut err = std::io::stderr().lock();
            if drawn > 0 {
                let _ = write!(err, "\x1b[{drawn}A");
            }
            for line in &lines {
                let _ = writeln!(err, "\x1b[2K{line}");
            }
            let _ = err.flush();
            drawn = lines.len();
        }
    }
}

pub(super) async fn connect_source(config: &tokio_postgres::Config) -> Result<Client> {
    let client = crate::tls::connect(config).await.map_err(|e| {
        e.into_error(format!(
            "connecting to source {}",
            crate::conninfo::describe(config)
        ))
    })?;
    client
        .batch_execute(
            // A big table's COPY may take hours: the role's or database's timeouts must not end
            // it (transaction_timeout exists from PostgreSQL 17).
            // row_security = off: a table's policies must make the copy fail, not leave rows out.
            // search_path = '': an OID alias value (regclass ...) is printed schema-qualified, so
            // the target reads it whatever its own search_path.
            "SET datestyle = ISO; SET intervalstyle = postgres; SET extra_float_digits = 3; \
             SET lc_monetary = 'C'; SET row_security = off; SET search_path = ''; \
             SET statement_timeout = 0; SET idle_in_transaction_session_timeout = 0; \
             SELECT pg_catalog.set_config(name, '0', false) FROM pg_catalog.pg_settings WHERE name = 'transaction_timeout'",
        )
        .await
        .map_err(|e| Error::postgres("configuring a source copy session", e))?;
    Ok(client)
}

#[allow(clippy::too_many_arguments)]
async fn copy_one(
    source: &mut Client,
    target: &mut deadpool_postgres::Object,
    table: &PublishedTable,
    pages: Option<(i64, i64)>,
    binary: bool,
    snapshot: &str,
    slot: &str,
    progress: &TableProgress,
) -> Result<()> {
    let _active = Active::start(progress);
    let qualified = table.qualified();
    let columns = table.column_list();
    let mut conditions = Vec::new();
    if let Some(filter) = &table.row_filter {
        conditions.push(format!("({filter})"));
    }
    if let Some((start, end)) = pages {
        conditions.push(format!("ctid >= '({start},0)'::tid"));
        if end != i64::MAX {
            conditions.push(format!("ctid < '({end},0)'::tid"));
        }
    }
    let filter = if conditions.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", conditions.join(" AND "))
    };
    let format = if binary { " (FORMAT binary)" } else { "" };
    // ONLY: an inheritance parent's children are published (and copied) as tables of their own.
    // A partitioned table published through its root has its rows in its partitions.
    let only = if table.partitioned { "" } else { "ONLY " };
    let copy_out =
        format!("COPY (SELECT {columns} FROM {only}{qualified}{filter}) TO STDOUT{format}");
    // (A table without columns, `CREATE TABLE t ()`, takes no column list: its rows are empty.)
    let into = if columns.is_empty() {
        String::new()
    } else {
        format!(" ({})", table.target_column_list())
    };
    let copy_in = format!("COPY {}{into} FROM STDIN", table.target_qualified());
    let what = match pages {
        Some((s, e)) if e != i64::MAX => format!("{qualified} pages {s}..{e}"),
        Some((s, _)) => format!("{qualified} pages {s}.."),
        None => qualified.clone(),
    };
    // (A privilege missing: the GRANT that gives it.)
    let target_table = table.target_qualified();
    let with_grant = |err: Error, e_code: Option<String>, grant: String, side: &str| {
        if e_code.as_deref() == Some("42501") {
            err.context_after(format!("{grant} TO the {side} role pgapply connects as (`pgapply check` lists every missing right)"))
        } else {
            err
        }
    };
    let src_err = |e: tokio_postgres::Error| {
        let code = e.code().map(|c| c.code().to_owned());
        let err = Error::postgres(format!("copying {what} from the source"), e);
        with_grant(err, code, format!("GRANT SELECT ON {qualified}"), "source")
    };
    let dst_err = |e: tokio_postgres::Error| {
        let code = e.code().map(|c| c.code().to_owned());
        let no_partition = code.as_deref() == Some("23514")
            && e.as_db_error()
                .is_some_and(|d| d.message().starts_with("no partition"));
        let err = Error::postgres(format!("copying {what} into the target"), e);
        if no_partition {
            return err.context_after(format!(
                "no partition of target table {target_table} takes the source's row: create the partition on the target (as on the source; or a DEFAULT partition), then run with --copy-data again (the copy starts over)"
            ));
        }
        if code.as_deref() == Some("22021") {
            let chars: Vec<String> = table
                .columns
                .iter()
                .filter(|(_, ty)| ty == "\"char\"")
                .map(|(name, _)| crate::sql::quote_ident(name))
                .collect();
            return err.context_after(if chars.is_empty() {
                "the source's rows hold bytes that are not valid UTF-8 (in a SQL_ASCII source database, bytes above 127 have no known encoding; a PostgreSQL 14 or older source also writes a byte above 127 of a column of a domain over \"char\", or of a \"char\" array, raw): fix those values on the source, or move the data to a database whose encoding says what the bytes are".to_owned()
            } else {
                format!(
                    "column(s) {} of type \"char\" may hold a byte above 127, which a PostgreSQL 14 or older source writes raw (no valid UTF-8) in the text form the copy between different major versions uses (streamed changes carry such bytes; the copy cannot): set those values to plain characters on the source, or fill the table on the target by hand, then run again",
                    chars.join(", ")
                )
            });
        }
        // An infinite interval (17+) or numeric (14+) into a target of an older major.
        let infinite = message_has_infinity(&err);
        if infinite && matches!(code.as_deref(), Some("22P02" | "22007" | "22008")) {
            return err.context_after(
                "the source holds an infinite value the target's PostgreSQL version cannot read (an infinite interval needs 17, an infinite numeric 14): change those values on the source, or copy into a target of the source's version or newer",
            );
        }
        // Tables are copied side by side, in no order: a child's rows may come first.
        if code.as_deref() == Some("23503") {
            return err.context_after(
                "the target's foreign keys check the copied rows because the target role may not set session_replication_role: copy as a superuser (or, on PostgreSQL 15+, GRANT SET ON PARAMETER session_replication_role TO the role), or create the foreign keys after the copy (`pgapply schema --section post-data`), then run with --copy-data again (the copy starts over). Tables are copied side by side, so a row may come before the one it refers to; but if the source itself holds rows that refer to nothing (it has no such foreign key), the key cannot be created after the copy either: leave it out on the target",
            );
        }
        with_grant(
            err,
            code,
            format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {target_table}"),
            "target",
        )
    };

    let source_tx = source
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(src_err)?;
    source_tx
        .batch_execute(&format!(
            "SET TRANSACTION SNAPSHOT {}",
            quote_literal(snapshot)
        ))
        .await
        .map_err(|e| {
            // The snapshot lives as long as the replication session that exported it: that
            // session ended (its connection lost, its walsender ended) before this part began.
            // Nothing to fix: the copy starts over, with a new slot and snapshot.
            if matches!(
                e.code().map(|c| c.code()),
                Some("22023") | Some("42704")
            ) {
                Error::transient(format!(
                    "copying {what} from the source: the copy's snapshot is gone ({}): the replication session that exported it ended (its connection lost, or its walsender ended on the source); the copy starts over",
                    crate::error::describe_postgres(&e)
                ))
            } else {
                src_err(e)
            }
        })?;
    // A table rewritten by ALTER TABLE since the snapshot has rows the snapshot cannot see (they
    // carry the ALTER's transaction id), and the rewrite is not streamed: copied now, it would
    // come out empty. Locked first (so it cannot happen from here on; the lock covers a
    // partitioned table's partitions), then compared: the snapshot's pg_class rows against the
    // files the table (or each partition of a partitioned table, 12+) has now.
    {
        source_tx
            .batch_execute(&format!("LOCK TABLE {qualified} IN ACCESS SHARE MODE"))
            .await
            .map_err(src_err)?;
        // (No row: created after the snapshot, which holds none of its rows.)
        let sql = if table.partitioned {
            "SELECT coalesce(bool_and(c.relfilenode = pg_catalog.pg_relation_filenode(c.oid)), true) \
             FROM pg_catalog.pg_partition_tree($1::text::regclass) t JOIN pg_catalog.pg_class c ON c.oid = t.relid \
             WHERE t.isleaf"
        } else {
            "SELECT c.relfilenode = pg_catalog.pg_relation_filenode(c.oid) FROM pg_catalog.pg_class c WHERE c.oid = $1::text::regclass"
        };
        let same_file: bool = source_tx
            .query_opt(sql, &[&qualified])
            .await
            .map_err(src_err)?
            .is_none_or(|r| r.get(0));
        if !same_file {
            return Err(Error::transient(format!(
                "table {qualified} was rewritten on the source (ALTER TABLE, TRUNCATE, VACUUM FULL or CLUSTER) during the initial copy: its rows cannot be read in the copy's snapshot any more, so the copy starts over, and will again as long as something rewrites it: pause the job that does (a periodic TRUNCATE, say) until the copy is done"
            )));
        }
    }
    // Marked in a statement of its own: held in the copy's transaction, the row's lock would
    // make the other ranges of the table wait for this one.
    target
        .execute(
            "UPDATE pgapply.copy_state SET state = 'copying', started_at = coalesce(started_at, now()) \
             WHERE slot_name = $1 AND schema_name = $2 AND table_name = $3 AND state = 'pending'",
            &[&slot, &table.schema, &table.name],
        )
        .await
        .map_err(dst_err)?;
    let target_tx = target.transaction().await.map_err(dst_err)?;
    // A big table's COPY may take hours: the role's or database's timeouts must not end it.
    // money is read as the source session wrote it (lc_monetary C on both).
    target_tx
        .batch_execute(
            "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0; \
             SET LOCAL idle_in_transaction_session_timeout = 0; SET LOCAL lc_monetary = 'C'; \
             SET LOCAL xmloption = content; \
             SELECT pg_catalog.set_config(name, '0', true) FROM pg_catalog.pg_settings WHERE name = 'transaction_timeout'",
        )
        .await
        .map_err(dst_err)?;
    // Triggers and foreign keys stay quiet during the copy where the role may ask for it (tables
    // are copied in parallel, in any order).
    let version: i32 = target_tx
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .map_err(dst_err)?
        .get(0);
    let may_set_role: bool = target_tx
        .query_one(may_quiet_triggers_sql(version), &[])
        .await
        .map_err(dst_err)?
        .get(0);
    if may_set_role {
        target_tx
            .batch_execute("SET LOCAL session_replication_role = replica")
            .await
            .map_err(dst_err)?;
    }
    // A table copied whole into an empty table on the target goes in frozen where it can (not
    // a small one: a few pages gain nothing, and the checks cost round trips per table, which
    // thousands of small tables would feel).
    let frozen = pages.is_none()
        && table.pages >= FREEZE_MIN_PAGES
        && begin_frozen_copy(&target_tx, &target_table).await?;
    let out = source_tx.copy_out(&copy_out).await.map_err(src_err)?;
    let sink = if frozen {
        match target_tx
            .copy_in::<_, bytes::Bytes>(&copy_in_with(&copy_in, binary, true))
            .await
        {
            Ok(sink) => sink,
            Err(e) => {
                // (Refused before any row: "prior transaction activity", say.) The table is
                // emptied by the TRUNCATE; its rows go in as in any other COPY.
                tracing::debug!(table = %target_table, error = %crate::error::describe_postgres(&e), "COPY FREEZE refused; copying without it");
                target_tx
                    .batch_execute("ROLLBACK TO SAVEPOINT pgapply_freeze")
                    .await
                    .map_err(dst_err)?;
                target_tx
                    .copy_in::<_, bytes::Bytes>(&copy_in_with(&copy_in, binary, false))
                    .await
                    .map_err(dst_err)?
            }
        }
    } else {
        target_tx
            .copy_in::<_, bytes::Bytes>(&copy_in_with(&copy_in, binary, false))
            .await
            .map_err(dst_err)?
    };
    pin_mut!(out);
    pin_mut!(sink);
    let mut bytes = 0u64;
    // The source sends one CopyData message per row; handed on one by one, each would be its own
    // message and flush towards the target. Gathered into large buffers instead.
    let mut buffer = bytes::BytesMut::with_capacity(COPY_BUFFER);
    // Rows so far, for the progress report: the source sends a message per row (in binary, the
    // header rides with the first row and the trailer comes alone). The target's count, at the
    // end, is the one kept.
    let (mut messages, mut reported) = (0u64, 0u64);
    while let Some(chunk) = out.next().await {
        let chunk = chunk.map_err(src_err)?;
        bytes += chunk.len() as u64;
        messages += 1;
        buffer.extend_from_slice(&chunk);
        if buffer.len() >= COPY_BUFFER {
            progress
                .bytes
                .fetch_add(buffer.len() as u64, Ordering::Relaxed);
            progress
                .rows
                .fetch_add(messages - reported, Ordering::Relaxed);
            reported = messages;
            let full = buffer.split().freeze();
            sink.send(full).await.map_err(dst_err)?;
            buffer.reserve(COPY_BUFFER);
        }
    }
    progress
        .bytes
        .fetch_add(buffer.len() as u64, Ordering::Relaxed);
    if !buffer.is_empty() {
        sink.send(buffer.freeze()).await.map_err(dst_err)?;
    }
    let rows = sink.finish().await.map_err(dst_err)?;
    progress.rows.fetch_sub(reported, Ordering::Relaxed);
    progress.rows.fetch_add(rows, Ordering::Relaxed);
    // (Its bytes: `record_bytes`.)
    crate::metrics::METRICS.copied(&table.label(), rows, 0);
    // The table is done when its last range commits, counted here under the row's lock; its
    // bytes so far too (the periodic `record_bytes` may not come again: a kill, the end).
    let bytes_so_far = progress.bytes.load(Ordering::Relaxed) as i64;
    target_tx
        .execute(
            "UPDATE pgapply.copy_state SET rows_copied = rows_copied + $4, \
                    bytes_copied = greatest(bytes_copied, $5), \
                    jobs_done = jobs_done + 1, \
                    state = CASE WHEN jobs_done + 1 >= jobs_total THEN 'done' ELSE state END, \
                    finished_at = CASE WHEN jobs_done + 1 >= jobs_total THEN clock_timestamp() ELSE finished_at END \
             WHERE slot_name = $1 AND schema_name = $2 AND table_name = $3",
            &[&slot, &table.schema, &table.name, &(rows as i64), &bytes_so_far],
        )
        .await
        .map_err(dst_err)?;
    target_tx.commit().await.map_err(dst_err)?;
    source_tx.commit().await.map_err(src_err)?;
    progress.jobs_left.fetch_sub(1, Ordering::SeqCst);
    tracing::info!(table = %what, rows, bytes, frozen, "copied");
    Ok(())
}

/// Refuses, before the slot and the copy, a table the publications give different column lists
/// (15+): the source ends the stream at its first change ("cannot use different column lists for
/// table ... in different publications"), which would come only after the whole copy.
async fn refuse_mixed_column_lists(source: &Client, publications: &[String]) -> Result<()> {
    let mixed: Vec<String> = source
        .query(
            "SELECT pg_catalog.format('%I.%I', schemaname, tablename) FROM pg_catalog.pg_publication_tables \
             WHERE pubname = ANY ($1) GROUP BY schemaname, tablename \
             HAVING count(DISTINCT attnames) > 1 ORDER BY 1",
            &[&publications],
        )
        .await
        .map_err(|e| Error::postgres("reading the publications' column lists on the source", e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if mixed.is_empty() {
        return Ok(());
    }
    Err(Error::definite(format!(
        "the publications {} publish different column lists of {}: the source ends replication at the first change of such a table (\"cannot use different column lists for table ... in different publications\"), which would come after the whole copy; nothing was copied: give every publication the same column list for it, or replicate the publications with separate slots (`pgapply check` lists such problems)",
        publications.join(", "),
        mixed.join(", ")
    )))
}

/// Tables smaller than this (8 kB pages, 1 MiB) are copied without FREEZE.
const FREEZE_MIN_PAGES: i64 = 128;

/// A `"char"` byte above 127 is written `\ooo` by PostgreSQL 15 and later, which a 14 or older
/// target reads as a backslash (README: the copy's text form cannot carry it): said before the
/// copy, naming the columns, so that it is checked (`pgapply verify` finds such rows).
fn warn_of_char_bytes(tables: &[PublishedTable], source_major: u32, target_major: u32) {
    if source_major < 15 || target_major >= 15 {
        return;
    }
    let columns: Vec<String> = tables
        .iter()
        .flat_map(|t| {
            t.columns
                .iter()
                .filter(|(_, ty)| ty == "\"char\"" || ty == "\"char\"[]")
                .map(move |(c, _)| format!("{}.{}", t.qualified(), quote_ident(c)))
        })
        .collect();
    if !columns.is_empty() {
        tracing::warn!(
            columns = %columns.join(", "),
            "\"char\" columns are copied from a PostgreSQL {source_major} source into a {target_major} target: a byte above 127 in them arrives as a backslash (its text form differs between the two versions); if they hold such bytes, set them to plain characters on the source first, or fix the rows `pgapply verify` names after the copy"
        );
    }
}

/// `copy_in` (`COPY t (columns) FROM STDIN`) with its options.
fn copy_in_with(copy_in: &str, binary: bool, freeze: bool) -> String {
    match (binary, freeze) {
        (true, true) => format!("{copy_in} (FORMAT binary, FREEZE)"),
        (true, false) => format!("{copy_in} (FORMAT binary)"),
        (false, true) => format!("{copy_in} (FREEZE)"),
        (false, false) => copy_in.to_owned(),
    }
}

/// Readies `COPY .. FREEZE` into `table` (the target's, quoted), in a savepoint of the copy's
/// transaction: true when the table is locked, still empty, and truncated in that savepoint, which
/// FREEZE requires; false (the savepoint undone) when it cannot be.
///
/// Why: rows copied frozen (and, 14+, their pages marked all-visible) need no hint bits set by
/// the key built after them (`schema --section post-data`) or the first scans, and the target's
/// VACUUM need not freeze them later, one more write of every page of a table months after a
/// migration. The TRUNCATE must be one nobody sees or is refused: not with a logical replication
/// slot in the target database (a subscriber of the target would be sent it), not on a table
/// with TRUNCATE triggers or one other tables' foreign keys reference (TRUNCATE refuses it), and
/// not where the role may not truncate, row security may hide rows from the check that it is
/// empty, a READ COMMITTED transaction is not the default (FREEZE refuses an older snapshot) or
/// the table is not a plain one (partitioned, foreign). The lock held from here to the commit
/// keeps readers of the target table waiting for the copy of that table; a lock someone else
/// holds is waited for a second at most.
async fn begin_frozen_copy(
    target_tx: &tokio_postgres::Transaction<'_>,
    table: &str,
) -> Result<bool> {
    let failed = |e: tokio_postgres::Error| {
        Error::postgres(
            format!("getting target table {table} ready for the copy"),
            e,
        )
    };
    let eligible: bool = target_tx
        .query_one(
            "SELECT c.relkind = 'r' AND NOT c.relrowsecurity \
               AND current_setting('transaction_isolation') = 'read committed' \
               AND pg_catalog.has_table_privilege(c.oid, 'TRUNCATE') \
               AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint k \
                               WHERE k.confrelid = c.oid AND k.conrelid <> c.oid AND k.contype = 'f') \
               AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger g WHERE g.tgrelid = c.oid AND g.tgtype & 32 <> 0) \
               AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots s \
                               WHERE s.slot_type = 'logical' AND s.database = current_database()) \
             FROM pg_catalog.pg_class c WHERE c.oid = $1::text::regclass",
            &[&table],
        )
        .await
        .map_err(failed)?
        .get(0);
    if !eligible {
        return Ok(false);
    }
    target_tx
        .batch_execute("SAVEPOINT pgapply_freeze; SET LOCAL lock_timeout = '1s'")
        .await
        .map_err(failed)?;
    let emptied = async {
        target_tx
            .batch_execute(&format!("LOCK TABLE ONLY {table} IN ACCESS EXCLUSIVE MODE"))
            .await?;
        let empty: bool = target_tx
            .query_one(
                &format!("SELECT NOT EXISTS (SELECT 1 FROM ONLY {table})"),
                &[],
            )
            .await?
            .get(0);
        if empty {
            target_tx
                .batch_execute(&format!(
                    "TRUNCATE ONLY {table}; SET LOCAL lock_timeout = 0"
                ))
                .await?;
        }
        Ok::<_, tokio_postgres::Error>(empty)
    }
    .await;
    match emptied {
        Ok(true) => Ok(true),
        outcome => {
            match outcome {
                Err(e) => {
                    tracing::info!(table = %table, error = %crate::error::describe_postgres(&e), "copying without FREEZE")
                }
                _ => tracing::info!(
                    table = %table,
                    "the target table is no longer empty: copying without FREEZE"
                ),
            }
            target_tx
                .batch_execute(
                    "ROLLBACK TO SAVEPOINT pgapply_freeze; RELEASE SAVEPOINT pgapply_freeze",
                )
                .await
                .map_err(failed)?;
            Ok(false)
        }
    }
}

/// Whether a worker is making the initial copy of `slot` now (its heartbeat is recent).
pub async fn copy_under_way(target: &Client, slot: &str) -> Result<bool> {
    Ok(target
        .query_opt(
            "SELECT 1 FROM pgapply.progress WHERE slot_name = $1 AND state = 'copying' \
             AND heartbeat_at > now() - interval '30 seconds'",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.progress on the target", e))?
        .is_some())
}

/// Per table: rows and state, for status output.
pub async fn summary(target: &Client, slot: &str) -> Result<HashMap<String, (String, i64)>> {
    let rows = target
        .query(
            "SELECT schema_name, table_name, state, rows_copied FROM pgapply.copy_state WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.copy_state", e))?;
    Ok(rows
        .iter()
        .map(|r| {
            (
                qualified_name(&r.get::<_, String>(0), &r.get::<_, String>(1)),
                (r.get(2), r.get(3)),
            )
        })
        .collect())
}

/// Whether the target refused a value written `infinity` (its message quotes the value).
fn message_has_infinity(err: &Error) -> bool {
    let message = err.message().to_ascii_lowercase();
    message.contains("\"infinity\"") || message.contains("\"-infinity\"")
}
