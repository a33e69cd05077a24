//! UPDATEs by key, held back inside a group and sent as one statement per table; and runs of
//! consecutive DELETEs by key of such a table, sent together (`delete_sql`).
//!
//! pgbench-like workloads update the same few rows (branches, tellers) in nearly every transaction,
//! and one row of a big table (accounts) each time. Sent one statement per change, the target spends
//! most of its time starting and ending statements. Within one target transaction (a group) nobody
//! sees the intermediate states, so for a table whose rows nothing else depends on, only the last
//! state of each row matters: the updates of a row collapse into one, and the rows go out together
//! as `UPDATE .. FROM (VALUES ..)`.
//!
//! That is safe only when the order of a table's updates relative to other changes cannot be
//! observed. So a table qualifies only when, on the target, it is a plain table without
//! inheritance children, its unique indexes are all on exactly the replica identity key's columns
//! (and there is one), and it has no exclusion constraint, no foreign key to or from it, no enabled
//! trigger and no rule. That is read once per relation (again after a Relation message), and each
//! group that batches a table's updates has the target check, before it commits and while its
//! statements hold the table, that none of it changed since (`pgapply.check_group`): if a
//! trigger, say, was added
//! meanwhile, the group is rolled back and applied again one change at a time, and the table is
//! read anew. Updates
//! qualify only when they keep the key and find their row by it, and when the conflict policies
//! are the defaults for updates (update_missing `skip`: a missing row is still found, warned about
//! and recorded, once per collapsed row). Any other change to the same target table sends its held
//! updates first (held updates are kept per target table, so two source tables mapped onto one do
//! not pass each other), and the group sends all of them before it commits. A change to another
//! table goes out while updates are held only if that table has no enabled trigger and no rule
//! (which could read a table whose updates are held, and see it before them); otherwise every
//! held update is sent first. That too is checked by each group on the server.
//!
//! The statement returns the batch rows that matched nothing, so a missing row is named exactly.
//! If a batched statement fails, the group is rolled back and the same source transactions are
//! applied again one change at a time, so the error names the exact source transaction.

use std::collections::HashMap;
use std::sync::Arc;

use tokio_postgres::types::{Kind, Type};
use tokio_postgres::Client;

use super::statement::{ColumnSet, WireValue};
use crate::error::{Error, Result};
use crate::relation::RelationEntry;

/// Most rows in one batched statement (a power of two: batches are sent in power-of-two sizes, so
/// a table needs at most a handful of prepared statements).
pub const MAX_BATCH_ROWS: usize = 128;

/// Whether the target table's updates may be collapsed and reordered (see the module docs): if
/// so, what that was read from (`pgapply.batching_fingerprint`), which each group that batches the
/// table's updates checks on the server (`pgapply.check_group`), so that a trigger added while
/// pgapply runs is not missed.
pub async fn independent(client: &Client, entry: &RelationEntry) -> Result<Option<String>> {
    if entry.target.partitioned || entry.key_columns.is_empty() {
        return Ok(None);
    }
    let failed = |e| {
        Error::postgres(
            format!(
                "reading the constraints of table {} on the target",
                entry.target.qualified
            ),
            e,
        )
    };
    // Any trigger counts, internal ones included (those of partitions copied from a parent are
    // marked internal before 15); inheritance children would be updated too, so they rule it out.
    let row = client
        .query_one(
            "SELECT c.relkind::text, c.relhasrules, c.relhassubclass, \
                    EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t \
                            WHERE t.tgrelid = c.oid AND t.tgenabled <> 'D'), \
                    EXISTS (SELECT 1 FROM pg_catalog.pg_constraint k \
                            WHERE (k.conrelid = c.oid OR k.confrelid = c.oid) AND k.contype IN ('f', 'x')), \
                    pgapply.batching_fingerprint(c.oid) \
             FROM pg_catalog.pg_class c WHERE c.oid = $1",
            &[&entry.target.oid],
        )
        .await
        .map_err(failed)?;
    let relkind: String = row.get(0);
    let plain = relkind == "r" && !row.get::<_, bool>(1) && !row.get::<_, bool>(2);
    if !plain || row.get::<_, bool>(3) || row.get::<_, bool>(4) {
        return Ok(None);
    }
    let fingerprint: String = row.get(5);
    let indexes = super::unique::unique_indexes(client, entry).await?;
    let mut key: Vec<&str> = entry
        .key_columns
        .iter()
        .filter_map(|&c| entry.target_column(c).map(|t| t.name.as_str()))
        .collect();
    key.sort_unstable();
    // Exactly the key's unique index: then one row per key, and no other unique value whose
    // order of writes could matter. (Compared by a deterministic collation: under a
    // case-insensitive one, keys that differ in bytes can be one row, which neither the
    // collapsing of updates nor parallel apply, both by the keys' bytes, would see.)
    let is_key = |index: &super::unique::UniqueIndex| {
        let mut columns: Vec<&str> = index.columns.iter().map(String::as_str).collect();
        columns.sort_unstable();
        index.simple && index.deterministic && columns == key
    };
    Ok((!indexes.is_empty() && indexes.iter().all(is_key)).then_some(fingerprint))
}

/// Whether changes to this target table may go out while other tables' updates are held (see
/// the module docs): no enabled trigger (but foreign keys' own) and no rule, which could read
/// another table and see it before the held updates; if so, what that was read from, which each
/// group that relies on it checks on the server, as for a batched table.
pub async fn quiet(client: &Client, entry: &RelationEntry) -> Result<Option<String>> {
    let row = client
        .query_one(
            // (Triggers cloned onto partitions are marked internal before 15; foreign keys'
            // are internal and tied to their constraint.)
            "SELECT NOT c.relhasrules \
                    AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t \
                                    WHERE t.tgrelid = c.oid AND t.tgenabled <> 'D' \
                                      AND NOT (t.tgisinternal AND t.tgconstraint <> 0)), \
                    pgapply.batching_fingerprint(c.oid) \
             FROM pg_catalog.pg_class c WHERE c.oid = $1",
            &[&entry.target.oid],
        )
        .await
        .map_err(|e| {
            Error::postgres(
                format!(
                    "reading the triggers of table {} on the target",
                    entry.target.qualified
                ),
                e,
            )
        })?;
    Ok(row.get::<_, bool>(0).then(|| row.get(1)))
}

/// Most rows in one batched statement of a table with `columns` columns: a power of two, under
/// PostgreSQL's limit on parameters per statement.
pub fn row_limit(columns: usize) -> usize {
    let mut limit = MAX_BATCH_ROWS;
    while limit > 1 && limit * (columns.max(1) + 1) > 30_000 {
        limit /= 2;
    }
    limit
}

/// One row's latest values: `None` where no update so far carried the column (unchanged TOAST).
struct HeldRow<A> {
    values: Vec<Option<WireValue>>,
    about: A,
}

/// The updates of one table held in the open group, one entry per key.
pub struct UpdateBatch<A> {
    pub entry: Arc<RelationEntry>,
    by_key: HashMap<bytes::Bytes, usize>,
    rows: Vec<HeldRow<A>>,
}

/// Rows sent in one statement: same columns, `rows.len()` a power of two.
pub struct Chunk<A> {
    pub unchanged: ColumnSet,
    pub params: Vec<WireValue>,
    pub about: Vec<A>,
}

impl<A> UpdateBatch<A> {
    pub fn new(entry: Arc<RelationEntry>) -> Self {
        UpdateBatch {
            entry,
            by_key: HashMap::with_capacity(64),
            rows: Vec::with_capacity(64),
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Holds an update; a later update of the same key replaces the values it carries. `values`
    /// is the whole new row by source column; the key columns must be present.
    pub fn add(&mut self, values: Vec<Option<WireValue>>, about: A) {
        let key = key_bytes(&self.entry.key_columns, &values);
        match self.by_key.get(&key) {
            Some(&i) => {
                let held = &mut self.rows[i];
                for (old, new) in held.values.iter_mut().zip(values) {
                    if new.is_some() {
                        *old = new;
                    }
                }
                held.about = about;
            }
            None => {
                self.by_key.insert(key, self.rows.len());
                self.rows.push(HeldRow { values, about });
            }
        }
    }

    /// The held rows as statements' worth of parameters: rows with the same missing columns
    /// together, in power-of-two sizes that keep each statement under the parameter limit.
    pub fn into_chunks(self) -> Vec<Chunk<A>> {
        let columns = self.entry.source.columns.len().max(1);
        let limit = row_limit(columns);
        let mut by_shape: Vec<(ColumnSet, Vec<HeldRow<A>>)> = Vec::new();
        for row in self.rows {
            let mut unchanged = ColumnSet::default();
            for (c, v) in row.values.iter().enumerate() {
                if v.is_none() {
                    unchanged.insert(c);
                }
            }
            match by_shape.iter_mut().find(|(u, _)| *u == unchanged) {
                Some((_, rows)) => rows.push(row),
                None => by_shape.push((unchanged, vec![row])),
            }
        }
        let mut chunks = Vec::new();
        for (unchanged, rows) in by_shape {
            let mut rows = rows.into_iter().peekable();
            let mut left = rows.len();
            while left > 0 {
                let mut size = limit;
                while size > left {
                    size /= 2;
                }
                let mut params = Vec::with_capacity(size * columns);
                let mut about = Vec::with_capacity(size);
                for row in rows.by_ref().take(size) {
                    params.extend(row.values.into_iter().flatten());
                    about.push(row.about);
                }
                left -= size;
                chunks.push(Chunk {
                    unchanged: unchanged.clone(),
                    params,
                    about,
                });
            }
        }
        chunks
    }
}

/// The key columns' values as one map key: the value itself for a one-column key (no copy),
/// otherwise each value length-prefixed.
fn key_bytes(key_columns: &[usize], values: &[Option<WireValue>]) -> bytes::Bytes {
    if let [c] = key_columns {
        if let Some(Some(WireValue::Text(b) | WireValue::Binary(b))) = values.get(*c) {
            return b.clone();
        }
    }
    let mut key = Vec::new();
    for &c in key_columns {
        match values.get(c) {
            Some(Some(WireValue::Text(b))) | Some(Some(WireValue::Binary(b))) => {
                key.extend_from_slice(&(b.len() as u32).to_be_bytes());
                key.extend_from_slice(b);
            }
            _ => key.extend_from_slice(&u32::MAX.to_be_bytes()),
        }
    }
    key.into()
}

/// The statement for `rows` rows with the columns of `unchanged` left out. It returns the numbers
/// of the rows that matched nothing. Parameters: each row's present columns in source order.
pub fn batch_sql(entry: &RelationEntry, unchanged: &ColumnSet, rows: usize) -> String {
    let present: Vec<usize> = (0..entry.source.columns.len())
        .filter(|c| !unchanged.contains(*c))
        .collect();
    let (aliases, values) = numbered_values(&present, rows);
    let mut set: Vec<String> = present
        .iter()
        .filter(|c| !entry.key_columns.contains(c))
        .map(|&c| format!("{} = v.c{c}", entry.quoted_columns[c]))
        .collect();
    if set.is_empty() {
        set = entry
            .key_columns
            .iter()
            .map(|&c| format!("{} = v.c{c}", entry.quoted_columns[c]))
            .collect();
    }
    format!(
        "WITH v (r{aliases}) AS (VALUES {values}), \
         u AS (UPDATE {only}{table} t SET {set} FROM v WHERE {matches} RETURNING v.r) \
         SELECT r FROM v WHERE r NOT IN (SELECT r FROM u)",
        only = super::statement::only(entry),
        table = entry.target.qualified,
        set = set.join(", "),
        matches = key_matches(entry),
    )
}

/// The statement for a run of `rows` DELETEs by key of one table (consecutive in the stream, so
/// nothing passes them). It returns the numbers of the rows that matched nothing. Parameters:
/// each row's key values, in key order.
pub fn delete_sql(entry: &RelationEntry, rows: usize) -> String {
    let (aliases, values) = numbered_values(&entry.key_columns, rows);
    format!(
        "WITH v (r{aliases}) AS (VALUES {values}), \
         d AS (DELETE FROM {only}{table} t USING v WHERE {matches} RETURNING v.r) \
         SELECT r FROM v WHERE r NOT IN (SELECT r FROM d)",
        only = super::statement::only(entry),
        table = entry.target.qualified,
        matches = key_matches(entry),
    )
}

/// The parameter types of `delete_sql`: the key columns' target types.
pub fn delete_param_types(entry: &RelationEntry, rows: usize) -> Vec<Type> {
    repeated_types(entry, &entry.key_columns, rows)
}

/// `, c<n>` for each column, and `rows` rows of `(row number, $i, ..)` with parameters numbered
/// on from row to row.
fn numbered_values(columns: &[usize], rows: usize) -> (String, String) {
    let mut param = 0usize;
    let values = (0..rows)
        .map(|r| {
            let mut row = format!("({r}");
            for _ in columns {
                param += 1;
                row.push_str(&format!(", ${param}"));
            }
            row.push(')');
            row
        })
        .collect::<Vec<_>>()
        .join(", ");
    let aliases = columns.iter().map(|c| format!(", c{c}")).collect();
    (aliases, values)
}

/// The target row matching a row of `v` by the key.
fn key_matches(entry: &RelationEntry) -> String {
    entry
        .key_columns
        .iter()
        .map(|&c| format!("t.{} = v.c{c}", entry.quoted_columns[c]))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// The parameter types of `batch_sql`: the target columns' types (VALUES has no column to infer
/// them from).
pub fn param_types(entry: &RelationEntry, unchanged: &ColumnSet, rows: usize) -> Vec<Type> {
    let present: Vec<usize> = (0..entry.source.columns.len())
        .filter(|c| !unchanged.contains(*c))
        .collect();
    repeated_types(entry, &present, rows)
}

/// The target types of `columns` (source column numbers), `rows` times over.
fn repeated_types(entry: &RelationEntry, columns: &[usize], rows: usize) -> Vec<Type> {
    let row: Vec<Type> = columns
        .iter()
        .map(|&c| {
            let (oid, name) = entry.target_column(c).map_or((25, "text".to_owned()), |t| {
                (t.type_oid, t.type_name.clone())
            });
            Type::from_oid(oid).unwrap_or_else(|| Type::new(name, oid, Kind::Simple, String::new()))
        })
        .collect();
    let mut types = Vec::with_capacity(row.len() * rows);
    for _ in 0..rows {
        types.extend(row.iter().cloned());
    }
    types
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::pgoutput::{Relation, RelationColumn, ReplicaIdentity};
    use crate::relation::{TargetColumn, TargetTable};

    fn entry() -> Arc<RelationEntry> {
        let column = |name: &str, key: bool| RelationColumn {
            flags: u8::from(key),
            name: name.into(),
            type_oid: 23,
            type_modifier: -1,
        };
        let target = |name: &str| TargetColumn {
            name: name.into(),
            type_oid: 23,
            type_name: "integer".into(),
            type_modifier: -1,
            cast_type: "integer".into(),
            generated: false,
            identity_always: false,
            category: "N".into(),
        };
        Arc::new(RelationEntry {
            source: Relation {
                xid: None,
                oid: 1,
                namespace: "public".into(),
                name: "t".into(),
                replica_identity: ReplicaIdentity::Default,
                columns: vec![column("id", true), column("a", false), column("b", false)],
            },
            target: TargetTable {
                oid: 2,
                schema: "public".into(),
                name: "t".into(),
                qualified: "\"public\".\"t\"".into(),
                partitioned: false,
                columns: vec![target("id"), target("a"), target("b")],
                indexes: Vec::new(),
            },
            quoted_columns: vec!["\"id\"".into(), "\"a\"".into(), "\"b\"".into()],
            target_columns: vec![0, 1, 2],
            key_columns: vec![0],
            generation: 1,
            type_differs: Vec::new(),
            recreated_from: None,
        })
    }

    fn text(s: &str) -> Option<WireValue> {
        Some(WireValue::Text(bytes::Bytes::copy_from_slice(s.as_bytes())))
    }

    fn shown(params: &[WireValue]) -> Vec<String> {
        params
            .iter()
            .map(|p| match p {
                WireValue::Text(b) => String::from_utf8_lossy(b).into_owned(),
                WireValue::Binary(_) => "<bin>".into(),
                WireValue::Null => "NULL".into(),
            })
            .collect()
    }

    #[test]
    fn updates_of_one_key_collapse_and_keep_unchanged_values() {
        let mut batch = UpdateBatch::new(entry());
        batch.add(vec![text("1"), text("10"), text("x")], "first");
        batch.add(vec![text("2"), text("20"), text("y")], "other");
        // An unchanged TOAST value keeps what the earlier update wrote.
        batch.add(vec![text("1"), text("11"), None], "second");
        assert_eq!(batch.len(), 2);
        let chunks = batch.into_chunks();
        assert_eq!(chunks.len(), 1);
        assert_eq!(
            shown(&chunks[0].params),
            vec!["1", "11", "x", "2", "20", "y"]
        );
        assert_eq!(chunks[0].about, vec!["second", "other"]);
    }

    #[test]
    fn chunks_are_powers_of_two_and_group_missing_columns() {
        let mut batch = UpdateBatch::new(entry());
        for i in 0..7 {
            batch.add(vec![text(&i.to_string()), text("1"), text("1")], i);
        }
        batch.add(vec![text("100"), text("1"), None], 100);
        let sizes: Vec<(usize, bool)> = batch
            .into_chunks()
            .iter()
            .map(|c| (c.about.len(), c.unchanged.contains(2)))
            .collect();
        assert_eq!(sizes, vec![(4, false), (2, false), (1, false), (1, true)]);
    }

    #[test]
    fn sql_updates_by_key_and_returns_rows_that_matched_nothing() {
        let e = entry();
        let sql = batch_sql(&e, &ColumnSet::default(), 2);
        assert_eq!(
            sql,
            "WITH v (r, c0, c1, c2) AS (VALUES (0, $1, $2, $3), (1, $4, $5, $6)), \
             u AS (UPDATE ONLY \"public\".\"t\" t SET \"a\" = v.c1, \"b\" = v.c2 FROM v WHERE t.\"id\" = v.c0 RETURNING v.r) \
             SELECT r FROM v WHERE r NOT IN (SELECT r FROM u)"
        );
        let mut unchanged = ColumnSet::default();
        unchanged.insert(2);
        assert_eq!(param_types(&e, &unchanged, 3).len(), 6);
        assert!(batch_sql(&e, &unchanged, 1).contains("SET \"a\" = v.c1 FROM"));
    }

    #[test]
    fn delete_sql_deletes_by_key_and_returns_rows_that_matched_nothing() {
        let e = entry();
        assert_eq!(
            delete_sql(&e, 2),
            "WITH v (r, c0) AS (VALUES (0, $1), (1, $2)), \
             d AS (DELETE FROM ONLY \"public\".\"t\" t USING v WHERE t.\"id\" = v.c0 RETURNING v.r) \
             SELECT r FROM v WHERE r NOT IN (SELECT r FROM d)"
        );
        assert_eq!(delete_param_types(&e, 3), vec![Type::INT4; 3]);
    }
}
