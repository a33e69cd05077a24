//! SQL for each change, built once per statement shape and prepared once per connection.
//!
//! A shape is (relation generation, operation, which columns are skipped, which old values are
//! NULL). Values are never part of the SQL: they are bound as parameters in the text form pgoutput
//! sends, and the server parses them with the target column's input function (parameter types are
//! inferred from the target columns), so any type round-trips: arrays, enums, domains, composites,
//! ranges.

use bytes::{BufMut, BytesMut};
use tokio_postgres::types::{Format, IsNull, Kind, ToSql, Type};

use crate::protocol::pgoutput::Oid;
use crate::protocol::Value;
use crate::relation::RelationEntry;

/// A parameter as pgoutput sent it: NULL, text or binary. Never converted on our side.
#[derive(Debug, Clone)]
pub enum WireValue {
    Null,
    Text(bytes::Bytes),
    Binary(bytes::Bytes),
}

impl ToSql for WireValue {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            WireValue::Null => Ok(IsNull::Yes),
            WireValue::Text(b) => {
                match char_byte(ty, b) {
                    Some(byte) => out.put_u8(byte),
                    None => out.put_slice(b),
                }
                Ok(IsNull::No)
            }
            WireValue::Binary(b) => {
                out.put_slice(b);
                Ok(IsNull::No)
            }
        }
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }

    fn encode_format(&self, ty: &Type) -> Format {
        match self {
            WireValue::Binary(_) => Format::Binary,
            WireValue::Text(b) if char_byte(ty, b).is_some() => Format::Binary,
            _ => Format::Text,
        }
    }

    tokio_postgres::types::to_sql_checked!();
}

/// The byte of a `"char"` value above 127, sent in binary form (that byte alone), which every
/// target version reads the same. In text form a PostgreSQL 14 or older source writes it as the
/// raw byte, which is no valid UTF-8 (the target refuses it as a text parameter), and 15 or later
/// as `\ooo`, which a target before 15 would read as a backslash.
fn char_byte(ty: &Type, text: &[u8]) -> Option<u8> {
    // (A domain over `"char"` takes the same binary form.)
    let is_char =
        *ty == Type::CHAR || matches!(ty.kind(), Kind::Domain(base) if *base == Type::CHAR);
    if !is_char {
        return None;
    }
    match text {
        [b] if *b >= 0x80 => Some(*b),
        [b'\\', d @ ..] if d.len() == 3 && d.iter().all(|c| (b'0'..=b'7').contains(c)) => {
            let value = d.iter().fold(0u16, |v, c| v * 8 + u16::from(c - b'0'));
            u8::try_from(value).ok()
        }
        _ => None,
    }
}

impl WireValue {
    /// `None` for an unchanged TOAST value, which has no value to bind.
    pub fn from_value(value: Value) -> Option<WireValue> {
        match value {
            Value::Null => Some(WireValue::Null),
            Value::Text(b) => Some(WireValue::Text(b)),
            Value::Binary(b) => Some(WireValue::Binary(b)),
            Value::UnchangedToast => None,
        }
    }
}

/// A set of column positions, small and hashable; no allocation up to 128 columns.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ColumnSet {
    low: u128,
    high: Vec<u64>,
}

impl ColumnSet {
    pub fn insert(&mut self, column: usize) {
        if column < 128 {
            self.low |= 1 << column;
        } else {
            let word = (column - 128) / 64;
            if self.high.len() <= word {
                self.high.resize(word + 1, 0);
            }
            self.high[word] |= 1 << ((column - 128) % 64);
        }
    }

    pub fn contains(&self, column: usize) -> bool {
        if column < 128 {
            self.low & (1 << column) != 0
        } else {
            let word = (column - 128) / 64;
            self.high
                .get(word)
                .is_some_and(|w| w & (1 << ((column - 128) % 64)) != 0)
        }
    }

    pub fn is_empty(&self) -> bool {
        self.low == 0 && self.high.iter().all(|w| *w == 0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    Insert,
    Update,
    Delete,
    /// Several UPDATEs by key in one statement (`apply::batch`); `rows` of them.
    UpdateBatch,
    /// A run of DELETEs by key of one table in one statement (`apply::batch::delete_sql`); `rows`
    /// of them.
    DeleteBatch,
}

/// How an UPDATE or DELETE finds its row.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RowMatch {
    /// By the replica identity key columns (`key = $n`); the key is unique.
    Key,
    /// REPLICA IDENTITY FULL: by every old value (NULLs matched with IS NULL, skipped columns left
    /// out), changing exactly one row even when identical rows exist.
    Full {
        nulls: ColumnSet,
        skipped: ColumnSet,
        /// Compare every column as text: the fallback when a type has no equality operator.
        as_text: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    pub relation: Oid,
    pub generation: u64,
    pub operation: Operation,
    /// UPDATE: source columns left out of SET (unchanged TOAST values).
    pub unchanged: ColumnSet,
    pub row_match: RowMatch,
    pub on_conflict: OnConflict,
    /// INSERT: rows in one statement (runs of inserts into one table are sent together).
    pub rows: usize,
    /// `InsertOverwrite` under REPLICA IDENTITY FULL: the columns of the target's unique index
    /// that decides the conflict (every column is "key" then, and no index covers them all).
    /// Empty: the replica identity key.
    pub arbiter: ColumnSet,
    /// INSERT under `skip`/`keep_local`: the target's unique keys (source columns), by which the
    /// statement answers, when it inserted nothing, with the rows that kept it out (as they were
    /// then, for the conflict record). Empty: it answers with its row count only.
    pub lookup: std::sync::Arc<Vec<Vec<usize>>>,
    /// A trigger on the target may skip the change (`apply::triggers`): an UPDATE or DELETE
    /// answers one row when it changed the row or the row was there (none: missing), an INSERT
    /// under `skip` answers only when a row kept it out.
    pub triggers_may_skip: bool,
}

/// How a statement deals with a conflict itself (see `apply::conflict`). The statement's row
/// count then tells whether the conflict happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OnConflict {
    /// Plain statement: an INSERT conflict is an error; an UPDATE/DELETE conflict changes 0 rows.
    Plain,
    /// INSERT ... ON CONFLICT DO NOTHING: 0 rows when the key existed.
    InsertDoNothing,
    /// INSERT ... ON CONFLICT (key) DO UPDATE, counted by a SELECT: 1 row when the key existed.
    InsertOverwrite,
    /// UPDATE, or INSERT of the new row when none matched: 1 row when it was inserted.
    UpdateOrInsert,
}

/// Types without a default equality operator, or whose `=` is not identity (geometric `=`
/// compares areas): under REPLICA IDENTITY FULL they are compared by their text form.
fn needs_text_comparison(type_oid: Oid) -> bool {
    matches!(
        type_oid,
        114 | 199 // json, json[]
            | 142 | 143 // xml, xml[]
            | 600 | 1017 // point
            | 601 | 1018 // lseg
            | 602 | 1019 // path
            | 603 | 1020 // box
            | 604 | 1027 // polygon
            | 628 | 629 // line
            | 718 | 719 // circle
    )
}

/// `t.a = $1 AND t.b = $2` over the columns of `key`, for a one-row INSERT's statement (whose
/// parameter $n+1 holds column n's value): the target's row with that key.
fn same_key(entry: &RelationEntry, key: &[usize]) -> String {
    key.iter()
        .map(|&c| format!("t.{}", column_equals(entry, c, c + 1)))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// `"col" = $n::type`: source column `c` equal to parameter `n`, which is read as the target
/// column's type. Without the cast the server infers the parameter's type from the operator: a
/// composite column's would be an anonymous record, which has no input, and a regclass
/// column's an oid (regclass has no `=` of its own), which cannot read `pg_class`.
pub fn column_equals(entry: &RelationEntry, c: usize, n: usize) -> String {
    match entry.target_column(c) {
        Some(t) => format!("{} = ${n}::{}", entry.quoted_columns[c], t.cast_type),
        None => format!("{} = ${n}", entry.quoted_columns[c]),
    }
}

/// Builds the SQL for a shape. Parameters: SET/VALUES values in source column order, then the
/// values that find the row, in source column order.
pub fn build_sql(entry: &RelationEntry, shape: &Shape) -> String {
    let table = &entry.target.qualified;
    let ncols = entry.source.columns.len();
    // The source's value goes into a GENERATED ALWAYS identity column too, as with PostgreSQL's
    // own subscriber.
    let overriding = if entry.target.has_identity_always() {
        " OVERRIDING SYSTEM VALUE"
    } else {
        ""
    };
    let mut param = 0usize;
    let mut next = || {
        param += 1;
        param
    };
    match shape.operation {
        Operation::Insert => {
            let columns = entry.quoted_columns.join(", ");
            let values = (0..shape.rows.max(1))
                .map(|_| {
                    (0..ncols)
                        .map(|_| format!("${}", next()))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .collect::<Vec<_>>()
                .join("), (");
            let insert = if ncols == 0 {
                // A table without columns (`CREATE TABLE t ()`): rows of nothing, as many as
                // sent; the target's own columns, if it has some, take their defaults.
                format!(
                    "INSERT INTO {table}{overriding} SELECT FROM pg_catalog.generate_series(1, {})",
                    shape.rows.max(1)
                )
            } else {
                format!("INSERT INTO {table} ({columns}){overriding} VALUES ({values})")
            };
            match shape.on_conflict {
                OnConflict::InsertDoNothing => {
                    // The target has a DEFERRABLE unique constraint: the key checked at once,
                    // named (without one, ON CONFLICT refuses the table).
                    let named = if shape.arbiter.is_empty() {
                        String::new()
                    } else {
                        let keys = (0..ncols)
                            .filter(|&c| shape.arbiter.contains(c))
                            .map(|c| entry.quoted_columns[c].clone())
                            .collect::<Vec<_>>()
                            .join(", ");
                        format!(" ({keys})")
                    };
                    if shape.lookup.is_empty() {
                        return format!("{insert} ON CONFLICT{named} DO NOTHING");
                    }
                    // Inserted nothing: the rows whose unique values it met, read in the
                    // statement's snapshot (before any later change of the group), one as an
                    // object, several as an array.
                    let met = shape
                        .lookup
                        .iter()
                        .map(|key| format!("({})", same_key(entry, key)))
                        .collect::<Vec<_>>()
                        .join(" OR ");
                    // (Where a trigger may skip the insert, nothing inserted and no row met is no
                    // conflict: no answer.)
                    let met_one = if shape.triggers_may_skip {
                        format!(
                            " AND EXISTS (SELECT 1 FROM {}{table} t WHERE {met})",
                            only(entry)
                        )
                    } else {
                        String::new()
                    };
                    format!(
                        "WITH ins AS ({insert} ON CONFLICT{named} DO NOTHING RETURNING 1) \
                         SELECT (SELECT CASE WHEN count(*) = 1 THEN min(x) ELSE '[' || string_agg(x, ', ') || ']' END \
                                 FROM (SELECT pg_catalog.to_jsonb(t.*)::text AS x FROM {}{table} t WHERE {met}) found) \
                         WHERE NOT EXISTS (SELECT 1 FROM ins){met_one}",
                        only(entry)
                    )
                }
                OnConflict::InsertOverwrite => {
                    let key_columns: Vec<usize> = if shape.arbiter.is_empty() {
                        entry.key_columns.clone()
                    } else {
                        (0..ncols).filter(|&c| shape.arbiter.contains(c)).collect()
                    };
                    let keys = key_columns
                        .iter()
                        .map(|&c| entry.quoted_columns[c].clone())
                        .collect::<Vec<_>>()
                        .join(", ");
                    let set: Vec<String> = (0..ncols)
                        .filter(|c| !key_columns.contains(c))
                        .map(|c| format!("{0} = EXCLUDED.{0}", entry.quoted_columns[c]))
                        .collect();
                    // The row answered is the target's row as it was (for the conflict
                    // record): every part of one statement reads the same snapshot, taken before
                    // the upsert wrote.
                    let local = format!(
                        "(SELECT pg_catalog.to_jsonb(t.*)::text FROM {}{table} t WHERE {} LIMIT 1)",
                        only(entry),
                        same_key(entry, &key_columns)
                    );
                    if set.is_empty() {
                        // Every column is in the key: the row there is the row sent, and nothing
                        // is left to overwrite. (A SET of the key itself would also fail on a
                        // GENERATED ALWAYS identity key.) A row back still means "it existed".
                        format!(
                            "WITH ins AS ({insert} ON CONFLICT ({keys}) DO NOTHING RETURNING 1) \
                             SELECT {local} WHERE NOT EXISTS (SELECT 1 FROM ins)"
                        )
                    } else if entry.target.partitioned {
                        // (RETURNING cannot read xmax through a partitioned table: the row as it
                        // was, read before the upsert, tells that it existed.)
                        format!(
                            "WITH ins AS ({insert} ON CONFLICT ({keys}) DO UPDATE SET {} RETURNING 1) \
                             SELECT {local} FROM ins WHERE {local} IS NOT NULL",
                            set.join(", ")
                        )
                    } else {
                        format!(
                            "WITH ins AS ({insert} ON CONFLICT ({keys}) DO UPDATE SET {} RETURNING xmax) \
                             SELECT {local} FROM ins WHERE xmax::text <> '0'",
                            set.join(", ")
                        )
                    }
                }
                _ => insert,
            }
        }
        Operation::Update => {
            let set_columns: Vec<usize> = (0..ncols)
                .filter(|c| !shape.unchanged.contains(*c))
                .collect();
            let set = set_columns
                .iter()
                .map(|&c| format!("{} = ${}", entry.quoted_columns[c], next()))
                .collect::<Vec<_>>()
                .join(", ");
            let filter = row_filter(entry, &shape.row_match, &mut next);
            let only = only(entry);
            let update = format!("UPDATE {only}{table} SET {set} WHERE {filter}");
            // (The row is found by the parameters after the SET's.)
            let there = || row_there(entry, &shape.row_match, set_columns.len());
            if shape.triggers_may_skip && shape.on_conflict == OnConflict::Plain {
                return changed_or_there(&update, &there());
            }
            if shape.on_conflict == OnConflict::UpdateOrInsert {
                // The SET parameters ($1..) are the new row: reused for the INSERT. A key column
                // left out of the SET (a GENERATED ALWAYS identity that stays) takes the value
                // that finds the row, the parameter after them.
                let mut columns: Vec<String> = set_columns
                    .iter()
                    .map(|&c| entry.quoted_columns[c].clone())
                    .collect();
                let mut values: Vec<String> =
                    (1..=set_columns.len()).map(|i| format!("${i}")).collect();
                if shape.row_match == RowMatch::Key {
                    for (j, &c) in entry.key_columns.iter().enumerate() {
                        if shape.unchanged.contains(c) {
                            columns.push(entry.quoted_columns[c].clone());
                            values.push(format!("${}", set_columns.len() + j + 1));
                        }
                    }
                }
                // (A row a trigger kept from being updated is there: not inserted.)
                let kept = if shape.triggers_may_skip {
                    format!(" AND NOT {}", there())
                } else {
                    String::new()
                };
                format!(
                    "WITH upd AS ({update} RETURNING 1) INSERT INTO {table} ({}){overriding} \
                     SELECT {} WHERE NOT EXISTS (SELECT 1 FROM upd){kept}",
                    columns.join(", "),
                    values.join(", ")
                )
            } else {
                update
            }
        }
        Operation::Delete => {
            let filter = row_filter(entry, &shape.row_match, &mut next);
            let delete = format!("DELETE FROM {}{table} WHERE {filter}", only(entry));
            if shape.triggers_may_skip {
                return changed_or_there(&delete, &row_there(entry, &shape.row_match, 0));
            }
            delete
        }
        Operation::UpdateBatch => super::batch::batch_sql(entry, &shape.unchanged, shape.rows),
        Operation::DeleteBatch => super::batch::delete_sql(entry, shape.rows),
    }
}

/// `ONLY ` for a plain table: an UPDATE or DELETE of an inheritance parent must not reach its
/// children (the source sends their changes as their own). A partitioned table has its rows in
/// its partitions: no ONLY there.
pub fn only(entry: &RelationEntry) -> &'static str {
    if entry.target.partitioned {
        ""
    } else {
        "ONLY "
    }
}

/// An UPDATE or DELETE that answers one row (a NULL text) when it changed the row or the row
/// was `there` before it (a trigger on the target skipped the change), none when no row was
/// there. Both parts read the statement's snapshot, taken before it writes.
fn changed_or_there(statement: &str, there: &str) -> String {
    format!(
        "WITH changed AS ({statement} RETURNING 1) SELECT NULL::text \
         WHERE EXISTS (SELECT 1 FROM changed) OR {there}"
    )
}

/// `EXISTS (..)`: the row an UPDATE or DELETE finds is there, by the same parameters as its
/// own filter (the `first` parameters come before them).
fn row_there(entry: &RelationEntry, row_match: &RowMatch, first: usize) -> String {
    let mut param = first;
    let filter = row_filter(entry, row_match, &mut || {
        param += 1;
        param
    });
    format!(
        "EXISTS (SELECT 1 FROM {}{} WHERE {filter})",
        only(entry),
        entry.target.qualified
    )
}

fn row_filter(
    entry: &RelationEntry,
    row_match: &RowMatch,
    next: &mut impl FnMut() -> usize,
) -> String {
    match row_match {
        RowMatch::Key => entry
            .key_columns
            .iter()
            .map(|&c| column_equals(entry, c, next()))
            .collect::<Vec<_>>()
            .join(" AND "),
        RowMatch::Full {
            nulls,
            skipped,
            as_text,
        } => {
            let mut conditions = Vec::new();
            for c in 0..entry.source.columns.len() {
                if skipped.contains(c) {
                    continue;
                }
                let column = &entry.quoted_columns[c];
                if nulls.contains(c) {
                    conditions.push(format!("{column} IS NULL"));
                    continue;
                }
                let target = entry.target_column(c);
                let type_oid = target.map_or(0, |t| t.type_oid);
                if *as_text || needs_text_comparison(type_oid) {
                    // The value is read as the column's type and printed again, in this session:
                    // binary values (--binary) are read correctly, and both sides print alike
                    // (time zone, a json's or a point's own form) whatever the source's settings.
                    let ty = target.map_or("text", |t| t.cast_type.as_str());
                    conditions.push(format!(
                        "{column}::text COLLATE \"C\" = (${}::{ty})::text COLLATE \"C\"",
                        next()
                    ));
                } else if let Some(t) = target {
                    // `=` finds the candidates (an index may serve it); the text form then tells
                    // apart values that `=` calls equal but that differ (1.0 and 1.00, 0 and -0,
                    // '1 day' and '24 hours', a domain over box): the row the source changed, not
                    // another that only compares equal. The cast names the type: a composite's
                    // parameter would otherwise be an anonymous record, which has no input.
                    let (n, ty) = (next(), &t.cast_type);
                    // ("C": a nondeterministic collation of the column would call 'A' and 'a' equal
                    // in the text form too.)
                    conditions.push(format!(
                        "{column} = ${n}::{ty} AND {column}::text COLLATE \"C\" = (${n}::{ty})::text COLLATE \"C\""
                    ));
                } else {
                    conditions.push(format!("{column} = ${}", next()));
                }
            }
            let conditions = if conditions.is_empty() {
                "true".to_owned()
            } else {
                conditions.join(" AND ")
            };
            let table = &entry.target.qualified;
            // ctid alone is unique only within one table; partitions need tableoid too.
            if entry.target.partitioned {
                format!("(tableoid, ctid) = (SELECT tableoid, ctid FROM {table} WHERE {conditions} LIMIT 1)")
            } else {
                format!("ctid = (SELECT ctid FROM ONLY {table} WHERE {conditions} LIMIT 1)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_char_byte_above_127_goes_in_binary_form() {
        let sent = |ty: &Type, text: &[u8]| {
            let v = WireValue::Text(bytes::Bytes::copy_from_slice(text));
            let mut out = BytesMut::new();
            let _ = v.to_sql(ty, &mut out);
            (v.encode_format(ty), out.to_vec())
        };
        // A source before 15: the raw byte; 15 and later: its octal escape.
        assert!(matches!(sent(&Type::CHAR, &[0xc3]), (Format::Binary, b) if b == [0xc3]));
        assert!(matches!(sent(&Type::CHAR, b"\\303"), (Format::Binary, b) if b == [0xc3]));
        // Plain ones, other types, and what is no escape stay text.
        assert!(matches!(sent(&Type::CHAR, b"a"), (Format::Text, b) if b == b"a"));
        assert!(matches!(sent(&Type::CHAR, b"\\"), (Format::Text, _)));
        assert!(matches!(sent(&Type::CHAR, b"\\400"), (Format::Text, _)));
        assert!(matches!(sent(&Type::TEXT, b"\\303"), (Format::Text, b) if b == b"\\303"));
    }
}
