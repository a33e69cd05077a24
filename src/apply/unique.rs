//! The target rows that hold the unique values a change is about to write: what an update_exists
//! or multiple_unique_conflicts conflict is about, and what `apply_remote` deletes to settle it.
//!
//! Only the target's unique indexes on plain columns the source sends are looked at: an index on an
//! expression, a partial index, or one on a target-only column has a key pgapply cannot compute, so
//! a violation of it stays an error.

use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

use super::statement::WireValue;
use crate::error::{Error, Result};
use crate::protocol::{Tuple, Value};
use crate::relation::RelationEntry;

/// One target row that holds a clashing value.
#[derive(Debug, Clone)]
pub struct ClashingRow {
    tableoid: u32,
    ctid: String,
    /// The row as JSON, for the conflict table.
    pub json: String,
    /// Which of the unique indexes (by position in the list given) it clashes through.
    pub through: Vec<bool>,
}

/// How many unique indexes the clashing rows violate together: more than one is
/// multiple_unique_conflicts in PostgreSQL 18's terms.
pub fn indexes_violated(rows: &[ClashingRow]) -> usize {
    let width = rows.iter().map(|r| r.through.len()).max().unwrap_or(0);
    (0..width)
        .filter(|&i| rows.iter().any(|r| r.through.get(i) == Some(&true)))
        .count()
}

/// One unique index of a target table.
pub struct UniqueIndex {
    /// On plain columns, without a predicate, checked at once and valid (an expression, partial,
    /// deferrable or invalid index is not: neither ON CONFLICT nor a lookup can rely on it).
    pub simple: bool,
    /// Its key columns (INCLUDE columns left out), in index order.
    pub columns: Vec<String>,
    /// No key column compared by a nondeterministic collation (PostgreSQL 12+: `'a'` and `'A'`
    /// equal under a case-insensitive one): values that differ in bytes may still be one key.
    pub deterministic: bool,
}

/// The target table's unique indexes.
pub async fn unique_indexes(client: &Client, entry: &RelationEntry) -> Result<Vec<UniqueIndex>> {
    let failed = |e| {
        Error::postgres(
            format!(
                "reading the unique indexes of table {} on the target",
                entry.target.qualified
            ),
            e,
        )
    };
    let version = crate::sql::server_version(client).await.map_err(failed)?;
    // From 11, indkey also lists INCLUDE columns after the indnkeyatts key columns.
    let key_count = if version >= 110000 {
        "i.indnkeyatts"
    } else {
        "i.indnatts"
    };
    let sql = format!(
        "SELECT i.indexprs IS NULL AND i.indpred IS NULL AND i.indimmediate AND i.indisvalid, \
                ARRAY(SELECT a.attname::text \
                      FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
                      JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
                      WHERE k.ord <= {key_count} ORDER BY k.ord), \
                NOT EXISTS (SELECT 1 FROM unnest(i.indcollation::oid[]) AS ic(coll) \
                            JOIN pg_catalog.pg_collation c ON c.oid = ic.coll \
                            WHERE coalesce((to_jsonb(c) ->> 'collisdeterministic')::bool, true) = false) \
         FROM pg_catalog.pg_index i WHERE i.indrelid = $1 AND i.indisunique \
         ORDER BY i.indisprimary DESC, i.indexrelid"
    );
    let rows = client
        .query(&sql, &[&entry.target.oid])
        .await
        .map_err(failed)?;
    Ok(rows
        .iter()
        .map(|r| UniqueIndex {
            simple: r.get(0),
            columns: r.get(1),
            deterministic: r.get(2),
        })
        .collect())
}

/// Whether the target table has a DEFERRABLE unique or exclusion constraint: INSERT .. ON
/// CONFLICT examines every unique index unless it names its key, and refuses a deferrable one.
pub async fn has_deferrable(client: &Client, entry: &RelationEntry) -> Result<bool> {
    client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_index \
                            WHERE indrelid = $1 AND NOT indimmediate AND (indisunique OR indisexclusion))",
            &[&entry.target.oid],
        )
        .await
        .map(|r| r.get(0))
        .map_err(|e| {
            Error::postgres(
                format!(
                    "reading the constraints of table {} on the target",
                    entry.target.qualified
                ),
                e,
            )
        })
}

/// The target table's simple unique indexes, each as the source column positions it covers.
pub async fn unique_keys(client: &Client, entry: &RelationEntry) -> Result<Vec<Vec<usize>>> {
    let indexes = unique_indexes(client, entry).await?;
    let mut keys = Vec::new();
    'index: for index in indexes.into_iter().filter(|i| i.simple) {
        let mut columns = Vec::with_capacity(index.columns.len());
        for name in index.columns {
            let source = (0..entry.source.columns.len())
                .find(|&c| entry.target_column(c).is_some_and(|t| t.name == name));
            match source {
                Some(c) => columns.push(c),
                None => continue 'index,
            }
        }
        keys.push(columns);
    }
    Ok(keys)
}

/// Rows whose values in some unique index equal the new row's, other than the row being updated
/// (`own_key`: the replica identity key values of that row, by source column).
pub async fn clashing_rows(
    client: &Client,
    entry: &RelationEntry,
    keys: &[Vec<usize>],
    new: &Tuple,
    own_key: Option<&[Value]>,
) -> Result<Vec<ClashingRow>> {
    let new: Vec<Value> = new.values().collect();
    let mut params: Vec<WireValue> = Vec::new();
    let bind = |value: Option<&Value>, params: &mut Vec<WireValue>| -> Option<usize> {
        let wire = match value? {
            Value::Text(b) => WireValue::Text(b.clone()),
            Value::Binary(b) => WireValue::Binary(b.clone()),
            // NULLs never clash; an unchanged TOAST value is not known here.
            Value::Null | Value::UnchangedToast => return None,
        };
        params.push(wire);
        Some(params.len())
    };
    let mut any_of = Vec::new();
    'index: for key in keys {
        let mut all_of = Vec::with_capacity(key.len());
        for &c in key {
            let Some(n) = bind(new.get(c), &mut params) else {
                continue 'index;
            };
            all_of.push(super::statement::column_equals(entry, c, n));
        }
        any_of.push(format!("({})", all_of.join(" AND ")));
    }
    if any_of.is_empty() {
        return Ok(Vec::new());
    }
    // coalesce: a clashing row may have NULL in another index's column (the comparison is NULL
    // then, not false). `t.*`: `t` alone would be a column of that name, if the table has one.
    let through = any_of
        .iter()
        .map(|c| format!("coalesce({c}, false)"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut sql = format!(
        "SELECT tableoid::oid, ctid::text, to_jsonb(t.*)::text, ARRAY[{through}]::bool[] FROM {}{} t WHERE ({})",
        super::statement::only(entry),
        entry.target.qualified,
        any_of.join(" OR ")
    );
    if let Some(own) = own_key {
        let mut all_of = Vec::with_capacity(entry.key_columns.len());
        for &c in &entry.key_columns {
            if let Some(n) = bind(own.get(c), &mut params) {
                all_of.push(super::statement::column_equals(entry, c, n));
            }
        }
        if !all_of.is_empty() {
            sql.push_str(&format!(" AND NOT ({})", all_of.join(" AND ")));
        }
    }
    let refs: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p as _).collect();
    let rows = client.query(sql.as_str(), &refs).await.map_err(|e| {
        Error::postgres(
            format!(
                "looking up the rows of table {} that clash with a replicated change",
                entry.target.qualified
            ),
            e,
        )
    })?;
    Ok(rows
        .iter()
        .map(|r| ClashingRow {
            tableoid: r.get(0),
            ctid: r.get(1),
            json: r.get(2),
            through: r.get(3),
        })
        .collect())
}

/// Deletes the clashing rows (the `apply_remote` resolution).
pub async fn delete_rows(
    client: &Client,
    entry: &RelationEntry,
    rows: &[ClashingRow],
) -> Result<()> {
    let sql = format!(
        "DELETE FROM {}{} WHERE tableoid = $1::oid AND ctid = $2::text::tid",
        super::statement::only(entry),
        entry.target.qualified
    );
    for row in rows {
        client
            .execute(sql.as_str(), &[&row.tableoid, &row.ctid])
            .await
            .map_err(|e| {
                Error::postgres(
                    format!(
                        "deleting a row of table {} that clashes with a replicated change",
                        entry.target.qualified
                    ),
                    e,
                )
            })?;
    }
    Ok(())
}

/// The clashing rows as one JSON value: the row, or an array of them.
pub fn rows_json(rows: &[ClashingRow]) -> Option<String> {
    match rows {
        [] => None,
        [one] => Some(one.json.clone()),
        many => Some(format!(
            "[{}]",
            many.iter()
                .map(|r| r.json.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}
