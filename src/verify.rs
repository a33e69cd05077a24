//! `pgapply verify`: compares the published tables on both sides, chunk by chunk (ranges of the
//! primary key; counts and an md5 of each chunk's rows), in parallel. Chunks that differ are
//! checked again a few times, since replication may still be catching up, before they are
//! reported with the key range that differs.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_postgres::Client;

use crate::config::TableMap;
use crate::copy::{own_rows, published_tables, PublishedTable};
use crate::error::{Error, Result};
use crate::sql::{qualified_name, quote_ident};

#[derive(Debug, Clone)]
pub struct VerifySettings {
    pub chunk_rows: i64,
    pub jobs: usize,
    /// Checks of a differing chunk before it is reported.
    pub attempts: u32,
    pub retry_delay: Duration,
}

/// The comment `cutover --reverse` puts on the publication it makes on the new primary. The
/// old primary, which that publication replicates back into, holds the rows the forward row
/// filter never took: on the way back, a table is compared through its filter on both sides.
/// Anywhere else a target row the filter leaves out is one the mirror should not hold (stale:
/// a DELETE lost, a filter changed) and is a difference.
pub const REVERSE_COMMENT: &str =
    "pgapply cutover --reverse: replicates the new primary back into the old one";

impl Default for VerifySettings {
    fn default() -> Self {
        VerifySettings {
            chunk_rows: 10_000,
            jobs: 4,
            attempts: 4,
            retry_delay: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TableResult {
    /// `"schema"."table"`, as the text report and errors name it.
    pub table: String,
    pub schema: String,
    pub name: String,
    /// The target table, where the `[tables]` mapping gives another name: (schema, name).
    pub target: Option<(String, String)>,
    pub ok: bool,
    pub source_rows: i64,
    pub target_rows: i64,
    pub chunks: usize,
    /// Key ranges whose rows differ: `[from, to)` as text, `None` for an open end.
    pub mismatches: Vec<(Option<String>, Option<String>)>,
    pub note: Option<String>,
    /// Why the table could not be compared (then `ok` is false and nothing else is known).
    pub error: Option<String>,
    /// That error may pass by itself (a server unreachable, out of connections): exit 3.
    pub transient: bool,
}

/// How both sides print floating-point numbers. PostgreSQL 12 changed the output: from 12 on,
/// `extra_float_digits` above 0 gives the shortest exact form, before 12 it gave 17 digits, so
/// 0.1 reads `0.1` on one side and `0.100000000000000006` on the other. When one side runs 11 or
/// older, both print 15 significant digits (`extra_float_digits = 0`), as both versions do alike;
/// otherwise the exact form.
pub fn float_digits(source_version: i32, target_version: i32) -> i32 {
    if source_version.min(target_version) < 120000 {
        0
    } else {
        3
    }
}

/// The application_name of this process's verify sessions, by which `watch_lock_waits` finds
/// them (digits only: safe in a literal).
fn session_name() -> String {
    format!("pgapply verify {}", std::process::id())
}

/// Says when one of this process's verify sessions on `side` has waited 5 s for a lock (a table
/// locked there, by a migration script, say): the verify waits, as it must, and without this it
/// would stand still without a word, writes frozen meanwhile in a cutover's verify step.
async fn watch_lock_waits(config: tokio_postgres::Config, side: &'static str) {
    let Ok(client) = crate::tls::connect_to(&config, side).await else {
        return;
    };
    let mut said = std::collections::HashSet::new();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rows = client
            .query(
                "SELECT a.pid, \
                        coalesce((SELECT l.relation::regclass::text FROM pg_catalog.pg_locks l \
                                  WHERE l.pid = a.pid AND NOT l.granted AND l.relation IS NOT NULL LIMIT 1), ''), \
                        pg_catalog.array_to_string(pg_catalog.pg_blocking_pids(a.pid), ', '), \
                        extract(epoch FROM now() - a.state_change)::int8 \
                 FROM pg_catalog.pg_stat_activity a \
                 WHERE a.application_name = $1 AND a.wait_event_type = 'Lock' \
                   AND a.state_change < now() - interval '5 s'",
                &[&session_name()],
            )
            .await;
        let Ok(rows) = rows else {
            return;
        };
        for row in rows {
            let pid: i32 = row.get(0);
            if !said.insert(pid) {
                continue;
            }
            let table: String = row.get(1);
            let blockers: String = row.get(2);
            let what = if table.is_empty() {
                "a lock".to_owned()
            } else {
                format!("a lock on table {table}")
            };
            tracing::warn!(
                "verify: reading on the {side} waits for {what}, held by {side} process(es) {blockers}, for {} s now: it goes on once they release it (see pg_stat_activity there; SELECT pg_terminate_backend(pid) ends one)",
                row.get::<_, i64>(3)
            );
        }
    }
}

/// A background task that ends with its owner.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn connect(config: &tokio_postgres::Config, role: &str, float_digits: i32) -> Result<Client> {
    let client = crate::tls::connect_to(config, role).await?;
    // The same text for the same value on both sides; every row, or an error (row_security).
    client
        .batch_execute(&format!(
            "SET datestyle = ISO; SET intervalstyle = postgres; SET extra_float_digits = {float_digits}; \
             SET timezone = 'UTC'; SET bytea_output = hex; SET lc_monetary = 'C'; SET statement_timeout = 0; \
             SET row_security = off; SET quote_all_identifiers = off; SET application_name = '{}'; \
             SELECT pg_catalog.set_config(name, '0', false) FROM pg_catalog.pg_settings WHERE name = 'transaction_timeout'",
            session_name()
        ))
        .await
        .map_err(|e| Error::postgres(format!("configuring the {role} session"), e))?;
    Ok(client)
}

async fn server_version(client: &Client, role: &str) -> Result<i32> {
    crate::sql::server_version(client)
        .await
        .map_err(|e| Error::postgres(format!("reading the {role}'s version"), e))
}

/// Primary key columns of a source table (or else of its replica identity index), with their
/// types (with the type modifier: `character(8)`, not `character`, which is `character(1)`; a
/// domain's base type, so that a domain over text is compared in "C" as text is).
/// Only the key columns proper: an index's INCLUDE columns (11+) may be NULL and need not sort.
async fn key_columns(source: &Client, table: &PublishedTable) -> Result<Vec<Key>> {
    let key_count = if server_version(source, "source").await? >= 110000 {
        "i.indnkeyatts"
    } else {
        "i.indnatts"
    };
    let rows = source
        .query(
            &format!(
                "SELECT a.attname::text, \
                        CASE WHEN t.typtype = 'd' THEN pg_catalog.format_type(t.typbasetype, t.typtypmod) \
                             ELSE pg_catalog.format_type(a.atttypid, a.atttypmod) END, \
                        {SORTED_AS_TEXT} \
                 FROM (SELECT i.indrelid, i.indkey, {key_count} AS n FROM pg_catalog.pg_index i \
                       WHERE i.indrelid = $1::text::regclass AND (i.indisprimary OR i.indisreplident) \
                       ORDER BY i.indisprimary DESC LIMIT 1) i \
                 CROSS JOIN generate_series(0, i.n - 1) k \
                 JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[k] \
                 JOIN pg_catalog.pg_type t ON t.oid = a.atttypid \
                 ORDER BY k"
            ),
            &[&table.qualified()],
        )
        .await
        .map_err(|e| Error::postgres(format!("reading the key of {}", table.qualified()), e))?;
    let keys: Vec<Key> = rows
        .iter()
        .map(|r| {
            let ty: String = r.get(1);
            Key {
                by_text: r.get::<_, bool>(2) || collatable(&ty),
                name: r.get(0),
                ty,
                // (A primary key's or replica identity index's columns are NOT NULL.)
                nullable: false,
            }
        })
        .collect();
    // Only keys that are published can be compared.
    if keys
        .iter()
        .all(|k| table.columns.iter().any(|(c, _)| *c == k.name))
    {
        Ok(keys)
    } else {
        Ok(Vec::new())
    }
}

/// The key columns' types on the target, named as the target's own sessions name them: a type
/// name travels badly between servers (search_paths differ; an extension may live in another
/// schema there), so each side casts the bounds to its own types.
async fn target_key_types(
    target: &Client,
    table: &PublishedTable,
    keys: &mut [Key],
) -> Result<Vec<Key>> {
    let qualified = table.target_qualified();
    let exists: bool = target
        .query_one(
            "SELECT pg_catalog.to_regclass($1) IS NOT NULL",
            &[&qualified],
        )
        .await
        .map_err(|e| Error::postgres(format!("looking up {qualified} on the target"), e))?
        .get(0);
    if !exists {
        return Err(Error::definite(format!(
            "table {qualified} does not exist on the target"
        )));
    }
    let mut out = Vec::with_capacity(keys.len());
    for key in keys.iter_mut() {
        let column = &key.name;
        let row = target
            .query_opt(
                &format!("SELECT CASE WHEN t.typtype = 'd' THEN pg_catalog.format_type(t.typbasetype, t.typtypmod) \
                             ELSE pg_catalog.format_type(a.atttypid, a.atttypmod) END, {SORTED_AS_TEXT}, \
                        NOT a.attnotnull \
                 FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON t.oid = a.atttypid \
                 WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attname = $2 AND NOT a.attisdropped"),
                &[&qualified, &table.target_column(column)],
            )
            .await
            .map_err(|e| Error::postgres(format!("reading the key columns of {qualified} on the target"), e))?;
        let Some(row) = row else {
            return Err(Error::definite(format!(
                "key column {} of {} is missing on the target table {qualified}",
                quote_ident(column),
                table.qualified()
            )));
        };
        let ty: String = row.get(0);
        // Both sides sort the column the same way: by text if either side's type needs it.
        key.by_text |= row.get::<_, bool>(1) || collatable(&ty);
        out.push(Key {
            name: column.clone(),
            ty,
            by_text: false,
            nullable: row.get(2),
        });
    }
    for (theirs, key) in out.iter_mut().zip(keys.iter()) {
        theirs.by_text = key.by_text;
    }
    Ok(out)
}

/// The target table's column types (`format_type`, modifiers included), by target column name.
async fn target_column_types(
    target: &Client,
    table: &PublishedTable,
) -> Result<std::collections::HashMap<String, String>> {
    let qualified = table.target_qualified();
    let rows = target
        .query(
            "SELECT a.attname::text, pg_catalog.format_type(a.atttypid, a.atttypmod) \
             FROM pg_catalog.pg_attribute a \
             WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
            &[&qualified],
        )
        .await
        .map_err(|e| {
            Error::postgres(
                format!("reading the columns of {qualified} on the target"),
                e,
            )
        })?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Whether two built-in types (as `format_type` prints them) differ only in their modifier:
/// `numeric(20,5)` and `numeric(30,10)`, `character(4)` and `character(8)[]`'s array
/// counterpart, `timestamp(3) without time zone` and `timestamp without time zone`.
fn same_type_but_modifier(a: &str, b: &str) -> bool {
    fn unmodified(t: &str) -> String {
        match (t.find('('), t.find(')')) {
            (Some(open), Some(close)) if open < close => {
                format!("{}{}", &t[..open], &t[close + 1..])
            }
            _ => t.to_owned(),
        }
    }
    // First words of the built-in types a modifier changes (character varying, bit varying,
    // time with time zone ... included).
    const WITH_MODIFIERS: [&str; 6] = [
        "numeric",
        "character",
        "bit",
        "time",
        "timestamp",
        "interval",
    ];
    let (a, b) = (unmodified(a), unmodified(b));
    a == b
        && a.split([' ', '['])
            .next()
            .is_some_and(|first| WITH_MODIFIERS.contains(&first))
}

/// How the source reads a column whose type the target has with another modifier.
struct ReadAs {
    /// The value as the target's type holds it.
    value: String,
    /// A condition true when the target's type holds the value unchanged; `None` when it always
    /// does (the target's type is the wider).
    unchanged: Option<String>,
}

/// Reads `name` (of type `source` on the source) as the target's type `target`, which differs
/// only in its modifier (`same_type_but_modifier`).
fn read_as_target_type(name: &str, source: &str, target: &str) -> ReadAs {
    let cast = format!("CAST({name} AS {target})");
    if let (Some(s), Some(t)) = (numeric_modifier(source), numeric_modifier(target)) {
        let is_array = target.ends_with(']');
        return match (s, t) {
            // Unconstrained on the target, or wider both in scale and in integer digits.
            (_, None) => ReadAs {
                value: format!("{cast} AS {name}"),
                unchanged: None,
            },
            (Some((sp, ss)), Some((tp, ts))) if ts >= ss && tp - ts >= sp - ss => ReadAs {
                value: format!("{cast} AS {name}"),
                unchanged: None,
            },
            // Narrower: the cast would fail on a value with too many integer digits, so it is
            // taken only for a value that fits (NaN fits any numeric); for an array, when every
            // element does.
            (_, Some((tp, ts))) => {
                let element_fits = |e: &str| {
                    format!(
                        "({e} IS NULL OR {e} = 'NaN' OR (pg_catalog.abs({e}) < 1e{} AND pg_catalog.round({e}, {ts}) = {e}))",
                        tp - ts
                    )
                };
                let fits = if is_array {
                    format!(
                        "({name} IS NULL OR NOT EXISTS (SELECT 1 FROM pg_catalog.unnest({name}) AS pgapply_e(e) WHERE NOT {}))",
                        element_fits("pgapply_e.e")
                    )
                } else {
                    element_fits(name)
                };
                ReadAs {
                    value: format!("CASE WHEN {fits} THEN {cast} END AS {name}"),
                    unchanged: Some(fits),
                }
            }
        };
    }
    // Lengths and fractional-second precisions: a cast that cuts or rounds, never fails.
    ReadAs {
        value: format!("{cast} AS {name}"),
        unchanged: Some(format!("{cast} IS NOT DISTINCT FROM {name}")),
    }
}

/// A numeric type's modifier, as `format_type` prints it: `Some(None)` for `numeric`,
/// `Some(Some((precision, scale)))` for `numeric(p,s)`; `None` for another type.
fn numeric_modifier(ty: &str) -> Option<Option<(i32, i32)>> {
    let ty = ty.strip_suffix("[]").unwrap_or(ty);
    let rest = ty.strip_prefix("numeric")?;
    if rest.is_empty() {
        return Some(None);
    }
    let inner = rest.strip_prefix('(')?.strip_suffix(')')?;
    let (p, s) = inner.split_once(',').unwrap_or((inner, "0"));
    Some(Some((p.trim().parse().ok()?, s.trim().parse().ok()?)))
}

/// Per chunk index: row count and digest (chunks without rows are left out).
type ChunkDigests = std::collections::HashMap<i64, (i64, String)>;

/// Every chunk's row count and digest in one pass over a table: one sort, whatever the key's
/// collation and indexes. (A range query per chunk cannot use the key's index when the key is
/// compared in the "C" collation and the index uses another: every chunk would read the whole
/// table.) The rows and the chunks' first keys (`starts`, the bounds after the first) are
/// sorted together; a row's chunk is the number of starts at or before it. Digests are the
/// ones `chunk_digest` makes, so a chunk can be checked again on its own.
async fn all_chunk_digests(
    client: &Client,
    side: &str,
    table_sql: &str,
    columns: &str,
    keys: &[Key],
    filter: Option<&str>,
    starts: &[Vec<String>],
) -> Result<ChunkDigests> {
    let key_columns = keys
        .iter()
        .map(|k| quote_ident(&k.name))
        .collect::<Vec<_>>()
        .join(", ");
    let start_columns = keys
        .iter()
        .enumerate()
        .map(|(i, k)| format!("b.c{i}::{} AS {}", k.ty, quote_ident(&k.name)))
        .collect::<Vec<_>>()
        .join(", ");
    let arrays = (1..=keys.len())
        .map(|i| format!("${i}::text[]"))
        .collect::<Vec<_>>()
        .join(", ");
    let names = (0..keys.len())
        .map(|i| format!("c{i}"))
        .collect::<Vec<_>>()
        .join(", ");
    let order = key_list("", keys);
    let filter = filter.map(|f| format!(" WHERE ({f})")).unwrap_or_default();
    let row_hash = ROW_HASH;
    let sql = format!(
        "SELECT pgapply_chunk, count(*), md5(string_agg(pgapply_h, '' ORDER BY {order})) FROM ( \
           SELECT *, sum(pgapply_start::int) OVER (ORDER BY {order}, pgapply_start DESC ROWS UNBOUNDED PRECEDING) AS pgapply_chunk \
           FROM (SELECT {key_columns}, {row_hash} AS pgapply_h, false AS pgapply_start \
                 FROM (SELECT {columns} FROM {table_sql}{filter}) r \
                 UNION ALL SELECT {start_columns}, NULL, true FROM unnest({arrays}) AS b({names})) x \
         ) y WHERE NOT pgapply_start GROUP BY pgapply_chunk"
    );
    let per_column: Vec<Vec<String>> = (0..keys.len())
        .map(|i| starts.iter().map(|s| s[i].clone()).collect())
        .collect();
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = per_column
        .iter()
        .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    let rows = client
        .query(sql.as_str(), &params)
        .await
        .map_err(|e| Error::postgres(format!("reading {table_sql} on the {side}"), e))?;
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get::<_, i64>(0),
                (r.get::<_, i64>(1), r.get::<_, String>(2)),
            )
        })
        .collect())
}

/// A key as a row's text form: `(2001)`, `("a, b", x)`. Values that would read ambiguously
/// (empty, with a comma, a quote, a backslash, a parenthesis or a space) are double-quoted.
fn key_text(values: &[String]) -> String {
    let field = |v: &String| {
        let plain = !v.is_empty()
            && !v
                .chars()
                .any(|c| matches!(c, ',' | '"' | '\\' | '(' | ')') || c.is_whitespace());
        if plain {
            return v.clone();
        }
        let mut out = String::with_capacity(v.len() + 2);
        out.push('"');
        for c in v.chars() {
            if matches!(c, '"' | '\\') {
                out.push(c);
            }
            out.push(c);
        }
        out.push('"');
        out
    };
    format!(
        "({})",
        values.iter().map(field).collect::<Vec<_>>().join(", ")
    )
}

/// A row's digest: of its text form in UTF-8, so that databases of different encodings (a
/// LATIN1 source migrated to a UTF8 target, say) give the same digest for the same row. `r.*`,
/// not `r`: a column named `r` would stand for the whole row.
const ROW_HASH: &str = "md5(convert_to((r.*)::text, 'UTF8'))";

/// A key column: its name, its type as its side names it, and whether both sides sort it by the
/// bytes of its UTF-8 text form (text-like types, whose order depends on collations; enums,
/// whose order is their labels' order on each side; composite and range types, which may hold
/// either).
struct Key {
    name: String,
    ty: String,
    by_text: bool,
    /// May hold NULL on this side (a target table without the source's key): compared so that
    /// NULL sorts after every value, as ORDER BY puts it, never as an unknown result that
    /// leaves the row out of every range.
    nullable: bool,
}

/// Whether a column's type is an enum, a composite or a range type (whose order may follow a
/// collation or an enum inside), or a reg* type (regclass and the like, ordered by OIDs, which
/// differ between the two databases), or built on one: through domains and arrays, to any depth
/// (a domain over an array of a domain over an enum).
const SORTED_AS_TEXT: &str = "coalesce((WITH RECURSIVE b(oid, depth) AS ( \
                             SELECT t.oid, 0 \
                             UNION ALL \
                             SELECT CASE WHEN bt.typtype = 'd' THEN bt.typbasetype ELSE bt.typelem END, b.depth + 1 \
                             FROM b JOIN pg_catalog.pg_type bt ON bt.oid = b.oid \
                             WHERE b.depth < 16 AND (bt.typtype = 'd' OR (bt.typelem <> 0 AND bt.typlen = -1))) \
                         SELECT bool_or(e.typtype IN ('e', 'c', 'r') \
                                        OR e.oid IN (24, 2202, 2203, 2204, 2205, 2206, 3734, 3769, 4089, 4096, 4191)) \
                         FROM b JOIN pg_catalog.pg_type e ON e.oid = b.oid), false)";

struct Chunk {
    from: Option<Vec<String>>,
    to: Option<Vec<String>>,
}

/// A key column as compared and sorted: text-like columns by the bytes of their UTF-8 form, so
/// that both sides put the same rows in the same chunks and order whatever their collations
/// (which differ after an operating system upgrade, a common reason to migrate), their encodings
/// (the "C" collation is byte order in the database's own encoding: '€' is 0x80 in WIN1252 and
/// sorts elsewhere in UTF-8) and their types (citext ignores COLLATE and case).
fn key_expr(prefix: &str, key: &Key) -> String {
    if key.by_text {
        format!(
            "pg_catalog.convert_to({prefix}{}::text, 'UTF8')",
            quote_ident(&key.name)
        )
    } else {
        format!("{prefix}{}", quote_ident(&key.name))
    }
}

/// The built-in types of a key whose order may differ between two databases (text, varchar,
/// char, name, jsonb; arrays of them).
fn collatable(ty: &str) -> bool {
    let base = ty.split(['(', '[']).next().unwrap_or(ty).trim();
    // citext may live in another schema than the search path's (printed `ext.citext`).
    let base = base.rsplit('.').next().unwrap_or(base).trim_matches('"');
    // jsonb compares its strings in the database's default collation; `name` takes a
    // column's COLLATE from 12 on.
    matches!(
        base,
        "text" | "character varying" | "character" | "bpchar" | "citext" | "jsonb" | "name"
    )
}

fn key_list(prefix: &str, keys: &[Key]) -> String {
    keys.iter()
        .map(|k| key_expr(prefix, k))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A row's key for a range condition. With a nullable key column, each value is preceded by
/// whether it is NULL (`(a IS NULL, a, ..)` against `(false, $1, ..)`): the comparison is then
/// decided before it reaches a NULL, and puts such rows after every bound, where the chunks'
/// ORDER BY put them. (The bounds come from the source's key: never NULL.)
fn row_expr(keys: &[Key]) -> String {
    if !keys.iter().any(|k| k.nullable) {
        return format!("({})", key_list("", keys));
    }
    format!(
        "({})",
        keys.iter()
            .map(|k| format!("{} IS NULL, {}", key_expr("", k), key_expr("", k)))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// A key bound as shown on a line: a key of large values (thousands of characters) is cut,
/// saying by how much (`--json` gives it whole).
fn shortened(bound: &str) -> String {
    const SHOWN: usize = 120;
    let chars = bound.chars().count();
    if chars <= SHOWN * 2 {
        return bound.to_owned();
    }
    let head: String = bound.chars().take(SHOWN).collect();
    format!("{head}... ({chars} characters: --json shows it whole)")
}

fn bound_expr(keys: &[Key], first_param: usize) -> String {
    let nullable = keys.iter().any(|k| k.nullable);
    format!(
        "({})",
        keys.iter()
            .enumerate()
            .map(|(i, k)| {
                let cast = format!("${}::text::{}", first_param + i, k.ty);
                let value = if k.by_text {
                    format!("pg_catalog.convert_to({cast}::text, 'UTF8')")
                } else {
                    cast
                };
                if nullable {
                    format!("false, {value}")
                } else {
                    value
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    )
}

async fn chunk_digest(
    client: &Client,
    side: &str,
    table_sql: &str,
    columns: &str,
    keys: &[Key],
    filter: Option<&str>,
    chunk: &Chunk,
) -> Result<(i64, String)> {
    let mut conditions = Vec::new();
    let mut params: Vec<String> = Vec::new();
    if let Some(f) = filter {
        conditions.push(format!("({f})"));
    }
    if let Some(from) = &chunk.from {
        conditions.push(format!(
            "{} >= {}",
            row_expr(keys),
            bound_expr(keys, params.len() + 1)
        ));
        params.extend(from.iter().cloned());
    }
    if let Some(to) = &chunk.to {
        conditions.push(format!(
            "{} < {}",
            row_expr(keys),
            bound_expr(keys, params.len() + 1)
        ));
        params.extend(to.iter().cloned());
    }
    let filter = if conditions.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", conditions.join(" AND "))
    };
    let sql = if keys.is_empty() {
        // No key to order the rows by: a digest that needs no order, the sums of the rows'
        // digests (two 64-bit halves each), so no sort and no value that grows with the table
        // (a string of 32 bytes a row passes PostgreSQL's 1 GB limit at about 33 million rows).
        format!(
            "SELECT count(*), coalesce(sum(('x' || left(h, 16))::bit(64)::bigint::numeric)::text \
                 || '/' || sum(('x' || right(h, 16))::bit(64)::bigint::numeric)::text, '') \
             FROM (SELECT {ROW_HASH} AS h FROM (SELECT {columns} FROM {table_sql}{filter}) r) d"
        )
    } else {
        // A digest of the rows' digests in key order: 32 bytes a row to aggregate, however wide
        // the rows (a chunk holds --chunk-rows rows).
        let order = key_list("r.", keys);
        format!(
            "SELECT count(*), coalesce(md5(string_agg({ROW_HASH}, '' ORDER BY {order})), '') \
             FROM (SELECT {columns} FROM {table_sql}{filter}) r"
        )
    };
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
        .iter()
        .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    let row = client
        .query_one(sql.as_str(), &params)
        .await
        .map_err(|e| Error::postgres(format!("reading {table_sql} on the {side}"), e))?;
    Ok((row.get(0), row.get(1)))
}

/// What a table's comparison reads on each side: both are read at once.
struct Sides<'a> {
    source: &'a Client,
    target: &'a Client,
    source_table: &'a str,
    target_table: &'a str,
    /// The source's column list (read as the target's types where only a modifier differs).
    source_columns: &'a str,
    columns: &'a str,
    keys: &'a [Key],
    target_keys: &'a [Key],
    source_filter: Option<&'a str>,
    target_filter: Option<&'a str>,
}

impl Sides<'_> {
    /// Every chunk's digest on both sides, one pass over the table each.
    async fn all_chunk_digests(
        &self,
        starts: &[Vec<String>],
    ) -> Result<(ChunkDigests, ChunkDigests)> {
        let (s, t) = tokio::join!(
            all_chunk_digests(
                self.source,
                "source",
                self.source_table,
                self.source_columns,
                self.keys,
                self.source_filter,
                starts
            ),
            all_chunk_digests(
                self.target,
                "target",
                self.target_table,
                self.columns,
                self.target_keys,
                self.target_filter,
                starts
            ),
        );
        Ok((s?, t?))
    }

    /// One chunk's count and digest on both sides.
    async fn chunk_digest(&self, chunk: &Chunk) -> Result<((i64, String), (i64, String))> {
        let (s, t) = tokio::join!(
            chunk_digest(
                self.source,
                "source",
                self.source_table,
                self.source_columns,
                self.keys,
                self.source_filter,
                chunk
            ),
            chunk_digest(
                self.target,
                "target",
                self.target_table,
                self.columns,
                self.target_keys,
                self.target_filter,
                chunk
            ),
        );
        Ok((s?, t?))
    }
}

/// Compares one target table with what the source has for it: `table`, and `also`, the other
/// source tables mapped onto the same target table (their rows are compared together).
async fn verify_table(
    source_config: tokio_postgres::Config,
    target_config: tokio_postgres::Config,
    mut table: PublishedTable,
    also: Vec<PublishedTable>,
    settings: VerifySettings,
    float_digits: i32,
    // Compare the target's rows through the row filter too: a publication `cutover --reverse`
    // made (`REVERSE_COMMENT`).
    filter_target: bool,
) -> Result<TableResult> {
    let source = connect(&source_config, "source", float_digits).await?;
    let target = connect(&target_config, "target", float_digits).await?;
    // The source's search_path on both sides: a regclass or regtype value prints as the
    // session's search_path makes it (qualified or not), and operators of a key type that an
    // extension keeps outside pg_catalog are found where the source finds them.
    let path: String = source
        .query_one("SELECT pg_catalog.current_setting('search_path')", &[])
        .await
        .map_err(|e| Error::postgres("reading the source session's search_path", e))?
        .get(0);
    target
        .execute(
            "SELECT pg_catalog.set_config('search_path', $1, false)",
            &[&path],
        )
        .await
        .map_err(|e| Error::postgres("setting the target session's search_path", e))?;
    let mut keys = key_columns(&source, &table).await?;
    let target_keys = target_key_types(&target, &table, &mut keys).await?;
    // (Columns renamed in the configuration read under their source names.)
    let target_table =
        table.target_rows_as_source(&own_rows(&target, &table.target_qualified(), "target").await?);
    // A "char" byte above 127 is written raw (no valid UTF-8) by PostgreSQL 14 and older, as an
    // octal escape by 15 and later: compared as the number both sides agree on. (Not a key
    // column: keys keep their type, to be compared with the chunks' bounds.)
    // A "char" byte above 127 is read as a number (above). A column whose type differs on the
    // target only in its modifier (numeric(30,10) for numeric(20,5), character(8) for
    // character(4), timestamp(0) for timestamp): the source's values are read as the target's
    // type, as applying them stores them (1.50000 is 1.5000000000 there), so that equal values
    // compare equal. Where the target's type is the narrower one, that reading could round a
    // value as the apply did (1.2346 read as 1.23 in numeric(8,2)) and hide it: each such
    // column gets a second field on both sides, true on the source for a value the target's type
    // cannot hold unchanged, false on the target, so its row differs. Key columns keep their types.
    let target_types = target_column_types(&target, &table).await?;
    let mut source_columns = Vec::new();
    let mut columns = Vec::new();
    for (c, ty) in &table.columns {
        let name = quote_ident(c);
        if keys.iter().any(|k| k.name == *c) {
            source_columns.push(name.clone());
            columns.push(name);
            continue;
        }
        let modified = target_types
            .get(table.target_column(c))
            .filter(|t| *t != ty && same_type_but_modifier(ty, t));
        match modified {
            Some(t) => {
                let read = read_as_target_type(&name, ty, t);
                source_columns.push(read.value);
                columns.push(name);
                if let Some(unchanged) = read.unchanged {
                    source_columns.push(format!("NOT ({unchanged})"));
                    columns.push("false".to_owned());
                }
            }
            None if ty == "\"char\"" => {
                let read = format!("pg_catalog.int4({name}) AS {name}");
                source_columns.push(read.clone());
                columns.push(read);
            }
            None => {
                source_columns.push(name.clone());
                columns.push(name);
            }
        }
    }
    let (columns, source_columns) = (columns.join(", "), source_columns.join(", "));
    // (The parts of a union of source tables are read by name, in the first table's order.)
    let plain_columns = table
        .columns
        .iter()
        .map(|(c, _)| quote_ident(c))
        .collect::<Vec<_>>()
        .join(", ");
    let mut note = None;
    let mut name = table.qualified();
    let source_table = if also.is_empty() {
        own_rows(&source, &table.qualified(), "source").await?
    } else {
        // The rows of every source table mapped onto this target table, each with its own
        // row filter: what the target table should hold.
        let mut parts = Vec::new();
        for t in std::iter::once(&table).chain(&also) {
            // (By name: partitions attached after their creation list them in other orders.)
            fn names(t: &PublishedTable) -> Vec<&str> {
                let mut n: Vec<&str> = t.columns.iter().map(|(c, _)| c.as_str()).collect();
                n.sort_unstable();
                n
            }
            let same_columns = names(t) == names(&table);
            if !same_columns {
                return Err(Error::definite(format!(
                    "source tables {} and {} are both mapped onto target table {} but publish different columns: compare them with it by hand",
                    table.qualified(),
                    t.qualified(),
                    table.target_qualified()
                )));
            }
            let rows = own_rows(&source, &t.qualified(), "source").await?;
            let filter = t
                .row_filter
                .as_ref()
                .map(|f| format!(" WHERE ({f})"))
                .unwrap_or_default();
            parts.push(format!("SELECT {plain_columns} FROM {rows}{filter}"));
        }
        let names: Vec<String> = std::iter::once(&table)
            .chain(&also)
            .map(|t| t.qualified())
            .collect();
        note = Some(format!(
            "target table {} receives the rows of {}: compared with all of them together",
            table.target_qualified(),
            names.join(", ")
        ));
        name = names.join(" + ");
        table.row_filter = None;
        format!("({}) AS pgapply_sources", parts.join(" UNION ALL "))
    };
    // On the way back from a cutover (`REVERSE_COMMENT`) the target's rows are compared through
    // the row filter too: the old primary holds the rows the forward filter left out. Counted
    // and said, not compared. A filter the target cannot evaluate is not applied there.
    let mut target_filter = None;
    if let Some(f) = table.row_filter.as_ref().filter(|_| filter_target) {
        let left_out = target
            .query_one(
                &format!("SELECT count(*) FROM {target_table} WHERE NOT coalesce(({f}), false)"),
                &[],
            )
            .await;
        if let Ok(row) = left_out {
            target_filter = Some(f.clone());
            let n: i64 = row.get(0);
            if n > 0 {
                let text = format!(
                    "{n} row(s) on the target that the row filter leaves out: not compared"
                );
                note = Some(match note.take() {
                    Some(earlier) => format!("{earlier}; {text}"),
                    None => text,
                });
            }
        }
    }
    let sides = Sides {
        source: &source,
        target: &target,
        source_table: &source_table,
        target_table: &target_table,
        source_columns: &source_columns,
        columns: &columns,
        keys: &keys,
        target_keys: &target_keys,
        source_filter: table.row_filter.as_deref(),
        target_filter: target_filter.as_deref(),
    };
    let mut chunks = Vec::new();
    // Every chunk's digest on both sides, taken in one pass per side.
    let mut first_pass: Option<(ChunkDigests, ChunkDigests)> = None;
    // The chunks' first keys after the first, for another pass over the whole table.
    let mut starts: Vec<Vec<String>> = Vec::new();
    if keys.is_empty() {
        let no_key = "no primary key or replica identity index whose columns are all published: compared as one chunk, without key ranges";
        note = Some(match note.take() {
            Some(earlier) => format!("{earlier}; {no_key}"),
            None => no_key.to_owned(),
        });
        chunks.push(Chunk {
            from: None,
            to: None,
        });
    } else {
        let key_texts = keys
            .iter()
            .map(|k| format!("{}::text", quote_ident(&k.name)))
            .collect::<Vec<_>>()
            .join(", ");
        let order = key_list("", &keys);
        let filter = table
            .row_filter
            .as_ref()
            .map(|f| format!(" WHERE ({f})"))
            .unwrap_or_default();
        let sql = format!(
            "SELECT {key_texts} FROM (SELECT *, row_number() OVER (ORDER BY {order}) AS pgapply_rn FROM {source_table}{filter}) s \
             WHERE (pgapply_rn - 1) % $1 = 0 ORDER BY pgapply_rn"
        );
        let rows = source
            .query(sql.as_str(), &[&settings.chunk_rows.max(1)])
            .await
            .map_err(|e| Error::postgres(format!("chunking {name}"), e))?;
        let bounds = rows
            .iter()
            .map(|r| {
                (0..keys.len())
                    .map(|i| match r.try_get::<_, Option<String>>(i) {
                        Ok(Some(v)) => Ok(v),
                        _ => Err(Error::definite(format!(
                            "chunking {}: key column {} is NULL in a row (a replica identity index should not allow that)",
                            name,
                            keys[i].name
                        ))),
                    })
                    .collect::<Result<Vec<String>>>()
            })
            .collect::<Result<Vec<Vec<String>>>>()?;
        // Everything below the first bound (rows only the target has) is a chunk too.
        let mut from: Option<Vec<String>> = None;
        for b in bounds.iter().skip(1) {
            chunks.push(Chunk {
                from: from.clone(),
                to: Some(b.clone()),
            });
            from = Some(b.clone());
        }
        chunks.push(Chunk { from, to: None });
        starts = bounds.into_iter().skip(1).collect();
        first_pass = Some(sides.all_chunk_digests(&starts).await?);
    }
    let mut result = TableResult {
        table: name,
        schema: table.schema.clone(),
        name: table.name.clone(),
        ok: true,
        source_rows: 0,
        target_rows: 0,
        chunks: chunks.len(),
        mismatches: Vec::new(),
        note,
        error: None,
        transient: false,
        target: mapped_target(&table),
    };
    // Chunks that differ are checked again together, round after round (one pause a round,
    // not one a chunk: a table of many differing chunks would otherwise take minutes of
    // pauses), each with both sides read at once.
    let mut pending: Vec<usize> = (0..chunks.len()).collect();
    let mut differing: Vec<usize> = Vec::new();
    let mut attempt = 0;
    while !pending.is_empty() {
        attempt += 1;
        // Many chunks to check again: one more pass over the whole table on each side. A range
        // query per chunk reads the whole table when the key sorts by its text (no index
        // serves that), so a table whose every chunk differs would take chunks x table size.
        let whole_pass = attempt > 1
            && !keys.is_empty()
            && (pending.len() > 8 || (pending.len() > 1 && keys.iter().any(|k| k.by_text)));
        if whole_pass {
            first_pass = Some(sides.all_chunk_digests(&starts).await?);
        }
        let mut again = Vec::new();
        for &index in &pending {
            let chunk = &chunks[index];
            let (s, t) = match first_pass.as_ref().filter(|_| attempt == 1 || whole_pass) {
                Some((s, t)) => (
                    s.get(&(index as i64)).cloned().unwrap_or_default(),
                    t.get(&(index as i64)).cloned().unwrap_or_default(),
                ),
                None => sides.chunk_digest(chunk).await?,
            };
            if s == t || attempt >= settings.attempts {
                result.source_rows += s.0;
                result.target_rows += t.0;
                if s != t {
                    differing.push(index);
                }
            } else {
                again.push(index);
            }
        }
        pending = again;
        if !pending.is_empty() {
            tokio::time::sleep(settings.retry_delay).await;
        }
    }
    differing.sort_unstable();
    let show = |b: &Option<Vec<String>>| b.as_ref().map(|v| key_text(v));
    for index in differing {
        result.ok = false;
        let chunk = &chunks[index];
        result.mismatches.push((show(&chunk.from), show(&chunk.to)));
    }
    Ok(result)
}

/// Verifies every table of the publications.
pub async fn verify(
    source: &tokio_postgres::Config,
    target: &tokio_postgres::Config,
    publications: &[String],
    table_map: &TableMap,
    column_map: &crate::config::ColumnMap,
    settings: &VerifySettings,
) -> Result<Vec<TableResult>> {
    let client = connect(source, "source", 3).await?;
    let target_client = connect(target, "target", 3).await?;
    let float_digits = float_digits(
        server_version(&client, "source").await?,
        server_version(&target_client, "target").await?,
    );
    drop(target_client);
    let mut tables = published_tables(&client, publications, table_map).await?;
    for table in &mut tables {
        table.rename_columns(column_map);
    }
    let filter_target: bool = client
        .query_one(
            "SELECT coalesce(bool_or(pg_catalog.obj_description(oid, 'pg_publication') = $2), false) \
             FROM pg_catalog.pg_publication WHERE pubname = ANY($1)",
            &[&publications, &REVERSE_COMMENT],
        )
        .await
        .map_err(|e| Error::postgres("reading the publications' comments on the source", e))?
        .get(0);
    if tables.is_empty() {
        return Err(Error::definite(crate::copy::no_tables_message(
            publications,
        )));
    }
    let limit = Arc::new(Semaphore::new(settings.jobs.max(1)));
    let mut tasks = Vec::new();
    // (Aborted on return, whichever way it goes.)
    let _watchers = [
        AbortOnDrop(tokio::spawn(watch_lock_waits(source.clone(), "source"))),
        AbortOnDrop(tokio::spawn(watch_lock_waits(target.clone(), "target"))),
    ];
    // Source tables mapped onto one target table are compared with it together.
    let mut by_target: Vec<(PublishedTable, Vec<PublishedTable>)> = Vec::new();
    for table in tables {
        match by_target
            .iter_mut()
            .find(|(first, _)| first.target_qualified() == table.target_qualified())
        {
            Some((_, also)) => also.push(table),
            None => by_target.push((table, Vec::new())),
        }
    }
    for (table, also) in by_target {
        let (s, t, settings, limit) = (
            source.clone(),
            target.clone(),
            settings.clone(),
            limit.clone(),
        );
        let names = (
            table.qualified(),
            table.schema.clone(),
            table.name.clone(),
            mapped_target(&table),
        );
        tasks.push((
            names,
            tokio::spawn(async move {
                let _permit = limit.acquire_owned().await;
                verify_table(s, t, table, also, settings, float_digits, filter_target).await
            }),
        ));
    }
    // A table that cannot be compared (missing on the target, say) is reported as such; the
    // others are still compared.
    let mut results = Vec::new();
    for ((table, schema, name, target), task) in tasks {
        let (error, transient) = match task.await {
            Ok(Ok(result)) => {
                results.push(result);
                continue;
            }
            Ok(Err(e)) => {
                let transient = e.is_transient();
                let mut text = e.to_string();
                if text.contains("53300") {
                    text.push_str(" (fewer sessions at once: a smaller --jobs)");
                }
                (text, transient)
            }
            Err(e) => (format!("the verify task failed: {e}"), false),
        };
        results.push(TableResult {
            table,
            schema,
            name,
            ok: false,
            source_rows: 0,
            target_rows: 0,
            chunks: 0,
            mismatches: Vec::new(),
            note: None,
            error: Some(error),
            transient,
            target,
        });
    }
    results.sort_by(|a, b| a.table.cmp(&b.table));
    Ok(results)
}

/// Prints the results; an error if any table differs.
pub fn report(results: &[TableResult], json: bool) -> Result<()> {
    if json {
        // Named as `status --json` names tables (`schema.table`, and each part on its own).
        let list: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                let mut v = serde_json::json!({
                    "table": format!("{}.{}", r.schema, r.name),
                    "schema": r.schema,
                    "name": r.name,
                    "ok": r.ok,
                    // (Not known for a table that could not be compared.)
                    "source_rows": r.error.is_none().then_some(r.source_rows),
                    "target_rows": r.error.is_none().then_some(r.target_rows),
                    "chunks": r.chunks,
                    "mismatches": r.mismatches.iter().map(|(from, to)| serde_json::json!({"from": from, "to": to})).collect::<Vec<_>>(),
                });
                if let Some((schema, name)) = &r.target {
                    v["target_table"] = format!("{schema}.{name}").into();
                    v["target_schema"] = schema.as_str().into();
                    v["target_name"] = name.as_str().into();
                }
                if let Some(note) = &r.note {
                    v["note"] = note.as_str().into();
                }
                if let Some(error) = &r.error {
                    v["error"] = error.as_str().into();
                }
                v
            })
            .collect();
        let text = serde_json::to_string_pretty(&list)
            .map_err(|e| Error::definite(format!("encoding JSON: {e}")))?;
        crate::out!("{text}");
    } else {
        for r in results {
            if let Some(error) = &r.error {
                crate::out!("FAILED    {}: not compared: {error}", r.shown());
            } else if r.ok {
                crate::out!(
                    "OK        {} ({}, {})",
                    r.shown(),
                    counted(r.source_rows as u64, "row"),
                    counted(r.chunks as u64, "chunk")
                );
            } else {
                crate::out!(
                    "MISMATCH  {}: source {}, target {}",
                    r.shown(),
                    counted(r.source_rows as u64, "row"),
                    counted(r.target_rows as u64, "row")
                );
                for (from, to) in &r.mismatches {
                    if from.is_none() && to.is_none() {
                        crate::out!(
                            "          key range: the whole table (compared as one chunk: chunks are cut from the source's rows, and it has no more than --chunk-rows of them, or no key to cut by; rows only the target has are in it too)"
                        );
                        continue;
                    }
                    crate::out!(
                        "          key range [{} .. {})",
                        shortened(from.as_deref().unwrap_or("start")),
                        shortened(to.as_deref().unwrap_or("end"))
                    );
                }
            }
            if let Some(note) = &r.note {
                crate::out!("          note: {note}");
            }
        }
    }
    let bad: Vec<String> = results
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.shown())
        .collect();
    let failed: Vec<String> = results
        .iter()
        .filter(|r| r.error.is_some())
        .map(|r| r.shown())
        .collect();
    if !failed.is_empty() {
        let message = format!(
            "{} could not be compared (see above){}",
            failed.join(", "),
            if bad.len() > failed.len() {
                "; other tables differ"
            } else {
                ""
            }
        );
        // Only for errors that may pass by themselves, and nothing found different: exit 3,
        // as for a server out of reach (run it again later).
        let all_transient = results.iter().filter(|r| !r.ok).all(|r| r.transient);
        Err(if all_transient {
            Error::transient(message)
        } else {
            Error::definite(message)
        })
    } else if bad.is_empty() {
        Ok(())
    } else {
        Err(Error::definite(format!(
            "source and target differ in {}",
            bad.join(", ")
        )))
    }
}

impl TableResult {
    /// The source table, and the target table where the mapping names another.
    fn shown(&self) -> String {
        match &self.target {
            Some((schema, name)) => {
                format!("{} -> target {}", self.table, qualified_name(schema, name))
            }
            None => self.table.clone(),
        }
    }
}

/// The target table where the `[tables]` mapping gives another name than the source's.
fn mapped_target(table: &PublishedTable) -> Option<(String, String)> {
    (table.target_schema != table.schema || table.target_name != table.name)
        .then(|| (table.target_schema.clone(), table.target_name.clone()))
}

/// "1 row", "2 rows".
fn counted(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_bounds_are_cut_saying_so() {
        use super::shortened;
        assert_eq!(shortened("(1, abc)"), "(1, abc)");
        let long = "x".repeat(3000);
        let shown = shortened(&long);
        assert!(shown.starts_with(&"x".repeat(120)), "{shown}");
        assert!(
            shown.ends_with("... (3000 characters: --json shows it whole)"),
            "{shown}"
        );
    }

    #[test]
    fn types_that_differ_only_in_their_modifier() {
        use super::{collatable, same_type_but_modifier};
        assert!(same_type_but_modifier("numeric(20,5)", "numeric(30,10)"));
        assert!(same_type_but_modifier("numeric(20,5)", "numeric"));
        assert!(same_type_but_modifier("character(4)", "character(8)"));
        assert!(same_type_but_modifier("numeric(10,2)[]", "numeric(12,4)[]"));
        assert!(same_type_but_modifier(
            "timestamp(0) without time zone",
            "timestamp(3) without time zone"
        ));
        assert!(!same_type_but_modifier(
            "character(4)",
            "character varying(4)"
        ));
        assert!(!same_type_but_modifier("numeric(10,2)", "numeric(10,2)[]"));
        assert!(!same_type_but_modifier("integer", "bigint"));
        assert!(!same_type_but_modifier(
            "public.money2(4)",
            "public.money2(8)"
        ));
        assert!(collatable("jsonb") && collatable("name") && collatable("jsonb[]"));
        assert!(!collatable("integer"));
    }

    #[test]
    fn a_narrower_target_type_is_read_with_a_test_of_what_it_keeps() {
        use super::{numeric_modifier, read_as_target_type};
        assert_eq!(numeric_modifier("numeric"), Some(None));
        assert_eq!(numeric_modifier("numeric(12,4)[]"), Some(Some((12, 4))));
        assert_eq!(numeric_modifier("numeric(7)"), Some(Some((7, 0))));
        assert_eq!(numeric_modifier("integer"), None);
        // Wider: a cast alone.
        let wider = read_as_target_type("\"a\"", "numeric(20,5)", "numeric(30,10)");
        assert_eq!(wider.value, "CAST(\"a\" AS numeric(30,10)) AS \"a\"");
        assert!(wider.unchanged.is_none());
        assert!(read_as_target_type("\"a\"", "numeric(8,2)", "numeric")
            .unchanged
            .is_none());
        let array = read_as_target_type("\"a\"", "numeric(12,4)[]", "numeric(8,2)[]");
        assert!(array
            .unchanged
            .expect("a test")
            .contains("pg_catalog.unnest(\"a\")"));
        // Narrower in scale or in integer digits, or from an unconstrained numeric: tested.
        for (from, to) in [
            ("numeric(12,4)", "numeric(12,2)"),
            ("numeric(12,4)", "numeric(10,4)"),
            ("numeric", "numeric(8,2)"),
        ] {
            let read = read_as_target_type("\"a\"", from, to);
            let fits = read.unchanged.expect("a test of what the target keeps");
            assert!(fits.contains("pg_catalog.round(\"a\""), "{fits}");
            assert!(
                read.value.starts_with(&format!("CASE WHEN {fits} THEN")),
                "{}",
                read.value
            );
        }
        let text = read_as_target_type(
            "\"t\"",
            "timestamp(3) without time zone",
            "timestamp(0) without time zone",
        );
        assert_eq!(
            text.unchanged.as_deref(),
            Some("CAST(\"t\" AS timestamp(0) without time zone) IS NOT DISTINCT FROM \"t\"")
        );
    }

    use super::key_text;

    #[test]
    fn keys_are_printed_so_that_each_value_reads_alone() {
        let key = |v: &[&str]| key_text(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(key(&["2001"]), "(2001)");
        assert_eq!(key(&["a, b", "x"]), r#"("a, b", x)"#);
        assert_eq!(key(&["", r#"q"\"#]), r#"("", "q""\\")"#);
    }
}
