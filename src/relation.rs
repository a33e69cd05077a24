//! The relation cache: what each published table looks like on the source (from Relation
//! messages) and where its columns go on the target (from the target's catalog).
//!
//! Columns are matched by name. A source column the target lacks is an error naming table and
//! column; target-only columns are left to their defaults; a target column that is generated can
//! not receive values and is an error if the source sends it. A new Relation message for the same
//! OID replaces the entry (the table changed on the source) and bumps its generation, so statements
//! prepared for the old shape are not reused.

use std::collections::HashMap;
use std::sync::Arc;

use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::protocol::pgoutput::{Oid, Relation, RelationColumn, ReplicaIdentity, TypeInfo};
use crate::sql::{qualified_name, quote_ident};

/// The connection the target's catalog is read through for each table. A pooled session keeps
/// each of these queries prepared: a transaction that touches thousands of tables for the first
/// time pays one round trip per query and table, not a parse, a plan and two round trips. A
/// plain client (`check`, once per table) prepares it each time.
pub trait Catalog: Sync {
    fn client(&self) -> &Client;
    fn statement(
        &self,
        sql: &str,
    ) -> impl std::future::Future<
        Output = std::result::Result<tokio_postgres::Statement, tokio_postgres::Error>,
    > + Send;
}

impl Catalog for Client {
    fn client(&self) -> &Client {
        self
    }
    async fn statement(
        &self,
        sql: &str,
    ) -> std::result::Result<tokio_postgres::Statement, tokio_postgres::Error> {
        self.prepare(sql).await
    }
}

impl Catalog for deadpool_postgres::Object {
    fn client(&self) -> &Client {
        self
    }
    async fn statement(
        &self,
        sql: &str,
    ) -> std::result::Result<tokio_postgres::Statement, tokio_postgres::Error> {
        self.prepare_cached(sql).await
    }
}

/// `sql` run through `catalog`'s prepared statement for it.
async fn catalog_query<C: Catalog>(
    catalog: &C,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> std::result::Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let statement = catalog.statement(sql).await?;
    catalog.client().query(&statement, params).await
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetColumn {
    pub name: String,
    pub type_oid: Oid,
    /// `format_type(atttypid, atttypmod)`: for messages and casts (`character(8)`: without the
    /// modifier, `character` is `character(1)`).
    pub type_name: String,
    /// `atttypmod` (-1: none): with the type, what the source's column is compared with.
    pub type_modifier: i32,
    /// The type for casts of a value that is compared with the column. For the types whose
    /// modifier is a length (character, varchar, bit, varbit and their arrays) without it,
    /// schema-qualified: `pg_catalog.varchar`, not `character varying(5)`, which would cut a
    /// longer value (the column may have been widened since it was read) so that it matches
    /// nothing; and not `character`, which means `character(1)`. Others as `type_name`: a
    /// numeric's scale or a timestamp's precision round the value as the column does.
    pub cast_type: String,
    pub generated: bool,
    /// `GENERATED ALWAYS AS IDENTITY`: an INSERT needs OVERRIDING SYSTEM VALUE to write the
    /// source's value, and an UPDATE may not set it at all.
    pub identity_always: bool,
    /// `typcategory` of the column's type (a domain has its base type's): `S` for the string
    /// types (text, citext ...), which take any text a source sends.
    pub category: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetTable {
    pub oid: Oid,
    pub schema: String,
    pub name: String,
    /// `"schema"."name"`, ready for SQL.
    pub qualified: String,
    /// A partitioned table: row identity needs `tableoid` as well as `ctid`.
    pub partitioned: bool,
    pub columns: Vec<TargetColumn>,
    /// Its valid indexes, read with the columns (`key_index_advice`).
    pub indexes: Vec<TargetIndex>,
}

/// A valid index of a target table, as `key_index_advice` weighs it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct TargetIndex {
    /// Unique, without a predicate or an expression among its key columns: one row a key.
    pub unique: bool,
    pub primary: bool,
    /// Its key columns' names, in order (INCLUDEd columns and expressions left out).
    pub columns: Vec<String>,
}

impl TargetTable {
    /// A column is `GENERATED ALWAYS AS IDENTITY`.
    pub fn has_identity_always(&self) -> bool {
        self.columns.iter().any(|c| c.identity_always)
    }

    /// The column types as read, as `pgapply.columns_fingerprint` writes them (migration 0019):
    /// `c|` and, per column in attnum order, `type:typmod,`.
    pub fn columns_fingerprint(&self) -> String {
        let mut out = String::from("c|");
        for c in &self.columns {
            out.push_str(&format!("{}:{},", c.type_oid, c.type_modifier));
        }
        out
    }
}

/// OIDs below this are built in, the same in every cluster (PostgreSQL's FirstNormalObjectId).
const FIRST_NORMAL_OID: u32 = 16384;

/// One published relation, resolved against the target.
#[derive(Debug)]
pub struct RelationEntry {
    pub source: Relation,
    pub target: TargetTable,
    /// Per source column: the quoted target column name.
    pub quoted_columns: Vec<String>,
    /// Per source column: the target column.
    pub target_columns: Vec<usize>,
    /// Source column positions that form the replica identity key.
    pub key_columns: Vec<usize>,
    /// Changes each time the relation is replaced.
    pub generation: u64,
    /// Source columns whose target column has another type (`binary_forms_differ`): binary
    /// values (`--binary`, decided when the run starts) may not fit them.
    pub type_differs: Vec<usize>,
    /// The source relation id this process knew the table's name under before, when this is
    /// another one: the table was dropped and created again (or another table took its name)
    /// while pgapply ran, and the target table may still hold the old one's rows.
    pub recreated_from: Option<Oid>,
}

impl RelationEntry {
    /// `"schema"."table"` as the source names it, for messages.
    pub fn display_name(&self) -> String {
        qualified_name(source_schema(&self.source), &self.source.name)
    }

    /// The target columns whose type (or its modifier: length, precision) is not the source
    /// column's, as `"name" (type on the target)`: where a value the target refuses comes from.
    pub fn narrower_candidates(&self) -> Vec<String> {
        (0..self.source.columns.len())
            .filter_map(|c| {
                let source = &self.source.columns[c];
                let target = self.target_column(c)?;
                // A user-defined type's OID is the cluster's own: no telling from it.
                if source.type_oid >= FIRST_NORMAL_OID {
                    return None;
                }
                (source.type_oid != target.type_oid || source.type_modifier != target.type_modifier)
                    .then(|| format!("{} ({})", quote_ident(&target.name), target.type_name))
            })
            .collect()
    }

    pub fn target_column(&self, source_column: usize) -> Option<&TargetColumn> {
        self.target
            .columns
            .get(*self.target_columns.get(source_column)?)
    }
}

/// A built-in number, text or time type as `format_type` names it, from its OID and modifier
/// (the Relation message's): the types whose modifier says how much they hold.
/// A source column's type for a statement the user is to run: a built-in type by its name,
/// with its length or precision where it is one of those `builtin_type_name` knows; another
/// one is left for the user ("...").
fn column_type_name(column: &crate::protocol::pgoutput::RelationColumn) -> String {
    // The SQL names first (integer, not int4), as `pgapply check` writes them; a `bpchar`
    // without a length is not `character`, which means character(1).
    let unbounded_bpchar = column.type_oid == 1042 && column.type_modifier < 4;
    if let Some(name) =
        builtin_type_name(column.type_oid, column.type_modifier).filter(|_| !unbounded_bpchar)
    {
        return name;
    }
    match tokio_postgres::types::Type::from_oid(column.type_oid) {
        Some(t) if column.type_modifier == -1 && t.name() == "char" => "\"char\"".to_owned(),
        Some(t) if column.type_modifier == -1 => t.name().to_owned(),
        _ => builtin_type_name(column.type_oid, column.type_modifier)
            .unwrap_or_else(|| "...".to_owned()),
    }
}

/// CREATE TABLE for a table as the source's stream describes it (names, types, its replica
/// identity key as the primary key): for a table the source has dropped since, which pg_dump
/// can no longer show.
fn create_table_from_stream(
    qualified: &str,
    relation: &crate::protocol::pgoutput::Relation,
) -> String {
    let mut items: Vec<String> = relation
        .columns
        .iter()
        .map(|c| format!("{} {}", quote_ident(&c.name), column_type_name(c)))
        .collect();
    let key: Vec<String> = relation
        .columns
        .iter()
        .filter(|c| c.is_key())
        .map(|c| quote_ident(&c.name))
        .collect();
    if !key.is_empty()
        && relation.replica_identity != crate::protocol::pgoutput::ReplicaIdentity::Full
    {
        items.push(format!("PRIMARY KEY ({})", key.join(", ")));
    }
    format!("CREATE TABLE {qualified} ({})", items.join(", "))
}

fn builtin_type_name(oid: Oid, modifier: i32) -> Option<String> {
    let with = |base: &str, m: Option<String>, after: &str| match m {
        Some(m) => format!("{base}({m}){after}"),
        None => format!("{base}{after}"),
    };
    let precision = (modifier >= 0).then(|| modifier.to_string());
    let length = (modifier >= 4).then(|| (modifier - 4).to_string());
    Some(match oid {
        21 => "smallint".to_owned(),
        23 => "integer".to_owned(),
        20 => "bigint".to_owned(),
        700 => "real".to_owned(),
        701 => "double precision".to_owned(),
        25 => "text".to_owned(),
        1700 => {
            if modifier < 4 {
                return Some("numeric".to_owned());
            }
            // (The scale is 11 signed bits from PostgreSQL 15, which allows a negative one.)
            let m = modifier - 4;
            let scale = ((m & 0x7ff) ^ 1024) - 1024;
            if scale < 0 {
                return None;
            }
            with(
                "numeric",
                Some(format!("{},{scale}", (m >> 16) & 0xffff)),
                "",
            )
        }
        1043 => with("character varying", length, ""),
        1042 => with("character", length, ""),
        1114 => with("timestamp", precision, " without time zone"),
        1184 => with("timestamp", precision, " with time zone"),
        1083 => with("time", precision, " without time zone"),
        1266 => with("time", precision, " with time zone"),
        _ => return None,
    })
}

/// Whether binary values of the source's type may not fit the target's: another type (a
/// user-defined type counts as another on every cluster: its OID differs), except text, varchar
/// and char, which send the same bytes.
fn binary_forms_differ(source: Oid, target: Oid) -> bool {
    let text_like = |oid| matches!(oid, 25 | 1042 | 1043);
    source != target && !(text_like(source) && text_like(target))
}

/// The server sends an empty namespace for pg_catalog.
pub fn source_schema(rel: &Relation) -> &str {
    if rel.namespace.is_empty() {
        "pg_catalog"
    } else {
        &rel.namespace
    }
}

#[derive(Default)]
pub struct RelationCache {
    /// Source (schema, table) -> target (schema, table), where they differ.
    table_map: Arc<crate::config::TableMap>,
    /// Source column -> target column, per source table, where they differ.
    column_map: Arc<crate::config::ColumnMap>,
    relations: HashMap<Oid, Arc<RelationEntry>>,
    /// Relations whose latest description does not fit the target (no such table, a column
    /// missing ...): the error, raised when a change uses the relation. PostgreSQL also
    /// describes a partition when it publishes through the root, and a target may well have no
    /// such table; PostgreSQL's own subscriber, too, looks a table up only for a change.
    unusable: HashMap<Oid, String>,
    types: HashMap<Oid, TypeInfo>,
    generation: u64,
    /// The target's `server_version_num`, read at the first table (not once per table: a
    /// thousand tables cost a round trip each).
    target_version: Option<i32>,
}

impl RelationCache {
    pub fn new(table_map: Arc<crate::config::TableMap>) -> Self {
        RelationCache {
            table_map,
            ..Default::default()
        }
    }

    /// With `[tables."s.t".columns]`: source columns applied to target columns of other names.
    pub fn with_column_map(mut self, column_map: Arc<crate::config::ColumnMap>) -> Self {
        self.column_map = column_map;
        self
    }

    pub fn get(&self, oid: Oid) -> Result<&Arc<RelationEntry>> {
        if let Some(message) = self.unusable.get(&oid) {
            return Err(Error::definite(message.clone()));
        }
        self.relations.get(&oid).ok_or_else(|| {
            Error::definite(format!(
                "the source sent a change for relation OID {oid} before describing it in a Relation message; this is a protocol error: restart pgapply"
            ))
        })
    }

    pub fn remember_type(&mut self, info: TypeInfo) {
        self.types.insert(info.oid, info);
    }

    /// A source type's name, when a Type message told it.
    pub fn type_name(&self, oid: Oid) -> Option<String> {
        self.types
            .get(&oid)
            .map(|t| qualified_name(&t.namespace, &t.name))
    }

    /// Resolves a Relation message against the target's catalog and stores it.
    /// Takes in a Relation message. A description that does not fit the target is an error
    /// here and, remembered, for every change of the relation until a description that fits.
    pub async fn update<C: Catalog>(
        &mut self,
        relation: Relation,
        catalog: &C,
    ) -> Result<Arc<RelationEntry>> {
        let oid = relation.oid;
        match self.resolve(relation, catalog).await {
            Ok(entry) => {
                self.unusable.remove(&oid);
                Ok(entry)
            }
            Err(e) if !e.is_transient() => {
                self.unusable.insert(oid, e.message().to_owned());
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    async fn resolve<C: Catalog>(
        &mut self,
        relation: Relation,
        catalog: &C,
    ) -> Result<Arc<RelationEntry>> {
        let schema = source_schema(&relation).to_owned();
        let (target_schema, target_name) = self
            .table_map
            .get(&(schema.clone(), relation.name.clone()))
            .cloned()
            .unwrap_or_else(|| (schema.clone(), relation.name.clone()));
        let version = match self.target_version {
            Some(v) => v,
            None => {
                let v = crate::sql::server_version(catalog.client())
                    .await
                    .map_err(|e| Error::postgres("reading the target's version", e))?;
                self.target_version = Some(v);
                v
            }
        };
        let target = load_target_table(catalog, version, &target_schema, &target_name).await?;
        let shown = qualified_name(&schema, &relation.name);
        let known = self.relations.get(&relation.oid).cloned();
        let target = match target {
            Some(t) => t,
            // The same table (same OID) had another name: renamed on the source. A new, empty
            // table on the target would lose the rows the old one holds.
            None => match &known {
                // Mapped by the configuration: the entry follows the source's name.
                Some(k)
                    if k.display_name() != shown && k.target.qualified != k.display_name() =>
                {
                    return Err(Error::definite(format!(
                        "table {} was renamed to {shown} on the source; it is applied into target table {} by its [tables] entry in the configuration: rename that entry after the source's new name ([tables.\"{}.{}\"] target = ...), then start pgapply again",
                        k.display_name(),
                        k.target.qualified,
                        schema.replace('\\', "\\\\").replace('"', "\\\""),
                        relation.name.replace('\\', "\\\\").replace('"', "\\\""),
                    )))
                }
                Some(k) if k.display_name() != shown => {
                    return Err(Error::definite(format!(
                        "table {} was renamed to {shown} on the source: rename {} on the target too ({}), then start pgapply again",
                        k.display_name(),
                        k.target.qualified,
                        rename_table_sql(&k.target, &target_schema, &target_name)
                    )))
                }
                _ => {
                    return Err(Error::definite(format!(
                        "table {shown} is published by the source but target table {} does not exist: if it was renamed on the source, rename it on the target too (ALTER TABLE ... RENAME TO ..., or SET SCHEMA ...: a new empty table would leave its rows behind under the old name); if it was renamed there already, and these are changes from before the source's rename, map the old name onto it until pgapply is past them ([tables.\"{}.{}\"] target = \"<schema>.<new name>\" in the config file); if it is a partition on the source, published under its own name (publish_via_partition_root = false), whose rows the target keeps in another table, map it onto that one ([tables.\"{}.{}\"] target = \"<schema>.<table>\"); otherwise create it on the target with the same columns (pg_dump --schema-only --table='{}' from the source; if the source has dropped it since, as its changes describe it: {}), then start pgapply again",
                        qualified_name(&target_schema, &target_name),
                        schema.replace('\\', "\\\\").replace('"', "\\\""),
                        relation.name.replace('\\', "\\\\").replace('"', "\\\""),
                        schema.replace('\\', "\\\\").replace('"', "\\\""),
                        relation.name.replace('\\', "\\\\").replace('"', "\\\""),
                        shown,
                        create_table_from_stream(&qualified_name(&target_schema, &target_name), &relation)
                    )))
                }
            },
        };
        let mut quoted_columns = Vec::with_capacity(relation.columns.len());
        let mut target_columns = Vec::with_capacity(relation.columns.len());
        let renames = self
            .column_map
            .get(&(schema.clone(), relation.name.clone()));
        // Names swapped between columns on the source (through a temporary name): every name
        // is still there, so changes apply by name without an error, into columns whose rows
        // hold the other's values. Said, as the target must follow.
        if let Some(k) = &known {
            let moved = renamed_in_place(&k.source.columns, &relation.columns);
            let swapped = !moved.is_empty()
                && moved
                    .iter()
                    .all(|(_, new)| moved.iter().any(|(old, _)| old == new));
            if swapped && renames.is_none() {
                tracing::warn!(
                    "columns of table {shown} swapped names on the source ({}): pgapply applies by name, so the rows already on the target hold each column's values under the other name until the target is renamed the same way ({}; best with pgapply stopped right after the source's rename), or the values are copied again",
                    moved
                        .iter()
                        .map(|(old, new)| format!("{} to {}", quote_ident(old), quote_ident(new)))
                        .collect::<Vec<_>>()
                        .join(", "),
                    rename_columns_sql(&target.qualified, &moved).join("; ")
                );
            }
        }
        for column in &relation.columns {
            let wanted = renames
                .and_then(|r| r.get(&column.name))
                .unwrap_or(&column.name);
            let index = target
                .columns
                .iter()
                .position(|t| t.name == *wanted)
                .ok_or_else(|| {
                    // A column of the same position and type had another name, which the target
                    // still has: renamed on the source. Adding a column would leave it empty.
                    let renamed = known.as_ref().and_then(|k| {
                        let i = relation.columns.iter().position(|c| c.name == column.name)?;
                        let before = k.source.columns.get(i)?;
                        (before.name != column.name
                            && before.type_oid == column.type_oid
                            && !relation.columns.iter().any(|c| c.name == before.name)
                            && target.columns.iter().any(|t| t.name == before.name))
                        .then(|| before.name.clone())
                    });
                    // Several renamed at once, a name moving on to the next column (price to
                    // price_old, price_new to price): each old name must go to its new one on
                    // the target, in an order that frees each name before it is taken.
                    let shifted = known
                        .as_ref()
                        .map(|k| renamed_in_place(&k.source.columns, &relation.columns))
                        .unwrap_or_default();
                    let shift_applies = shifted.len() > 1
                        && shifted.iter().any(|(_, new)| new == &column.name)
                        && shifted
                            .iter()
                            .all(|(old, _)| target.columns.iter().any(|t| t.name == *old));
                    if shift_applies {
                        return Error::definite(format!(
                            "columns of table {shown} were renamed on the source ({}): rename them on the target too, in this order ({}); adding {} instead would leave the rows already there with their values under the old names; if the source renamed them in the middle of a transaction, whose earlier changes still name the old columns, also map each old name onto its new one in the config file until pgapply is past them; then start pgapply again",
                            shifted
                                .iter()
                                .map(|(old, new)| format!("{} to {}", quote_ident(old), quote_ident(new)))
                                .collect::<Vec<_>>()
                                .join(", "),
                            rename_columns_sql(&target.qualified, &shifted).join("; "),
                            quote_ident(&column.name)
                        ));
                    }
                    if let Some(old) = renamed {
                        return Error::definite(format!(
                            "column {} of table {shown} is gone on the source and {} is new in its place: if it was renamed, rename it on the target too (ALTER TABLE {} RENAME COLUMN {} TO {}; if the source renamed it in the middle of a transaction, whose earlier changes still name {}, also map the old name onto it in the config file until pgapply is past them: {}); if one was dropped and the other added, add {} on the target (ALTER TABLE {} ADD COLUMN ...); then start pgapply again",
                            quote_ident(&old),
                            quote_ident(&column.name),
                            target.qualified,
                            quote_ident(&old),
                            quote_ident(&column.name),
                            quote_ident(&old),
                            column_map_lines(&schema, &relation.name, &old, &column.name),
                            quote_ident(&column.name),
                            target.qualified
                        ));
                    }
                    // Without the old description (pgapply restarted since): a target column
                    // of the same type that the source no longer sends may be the old name.
                    let candidates: Vec<String> = target
                        .columns
                        .iter()
                        .filter(|t| {
                            !t.generated
                                && t.type_oid == column.type_oid
                                && !relation.columns.iter().any(|c| c.name == t.name)
                        })
                        .map(|t| quote_ident(&t.name))
                        .collect();
                    let (mapped, or_mapping) = if wanted != &column.name {
                        (
                            format!(" (mapped to {} by the config file)", quote_ident(wanted)),
                            "; or correct that column's entry under [tables] in the config file",
                        )
                    } else {
                        (String::new(), "")
                    };
                    let renamed = match candidates.as_slice() {
                        [] => String::new(),
                        [one] => format!(
                            "; or, if the source renamed {one} to {new}, rename it on the target instead (ALTER TABLE {table} RENAME COLUMN {one} TO {new}); or, if {one} was renamed from {new} on the target already, following a rename on the source that these changes come before, map the old name onto it in the config file until pgapply is past them ({lines})",
                            new = quote_ident(&column.name),
                            table = target.qualified,
                            lines = column_map_lines(&schema, &relation.name, &column.name, &target.columns.iter().find(|t| quote_ident(&t.name) == *one).map(|t| t.name.clone()).unwrap_or_default()),
                        ),
                        more => format!(
                            "; or, if the source renamed one of {} to {}, rename that one on the target instead",
                            more.join(", "),
                            quote_ident(&column.name)
                        ),
                    };
                    let type_name = match column_type_name(column) {
                        unknown if unknown == "..." => "<its type on the source: pgapply check prints it; a type of the source's own (an enum, a domain, a composite) is created on the target first>".to_owned(),
                        known => known,
                    };
                    Error::definite(format!(
                        "column {}{mapped} of table {shown} is replicated from the source but does not exist in target table {}: add it on the target (ALTER TABLE {} ADD COLUMN {} {type_name}, with the DEFAULT and NOT NULL it has on the source if its default is a constant: the rows already there took it on the source; a default computed for each row, such as now(), gives them other values than the source's, so copy those from the source; `pgapply check` prints the statement; if the source has dropped it since, these changes come from before that: add it back for now, nullable, and drop it once pgapply is past them){renamed}{or_mapping}",
                        quote_ident(&column.name),
                        target.qualified,
                        target.qualified,
                        quote_ident(wanted)
                    ))
                })?;
            if target.columns[index].generated {
                return Err(Error::definite(format!(
                    "column {} of target table {} is a generated column, but the source replicates values for it: {}",
                    quote_ident(&column.name),
                    target.qualified,
                    crate::sql::generated_column_fix(&target.qualified, &quote_ident(&column.name), None)
                )));
            }
            // (Only through `[tables."s.t".columns]`: the source's names are unique.)
            if let Some(other) = target_columns.iter().position(|&t| t == index) {
                return Err(Error::definite(format!(
                    "columns {} and {} of table {shown} both go to column {} of target table {} (the config file's [tables.\"{}.{}\".columns] maps them onto one name): remove or change that mapping, then start pgapply again",
                    quote_ident(&relation.columns[other].name),
                    quote_ident(&column.name),
                    quote_ident(wanted),
                    target.qualified,
                    schema,
                    relation.name
                )));
            }
            quoted_columns.push(quote_ident(wanted));
            target_columns.push(index);
        }
        let key_columns = relation
            .columns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_key())
            .map(|(i, _)| i)
            .collect();
        if relation.replica_identity == ReplicaIdentity::Nothing {
            tracing::debug!(relation = %shown, "replica identity NOTHING: only inserts can be replicated");
        }
        // The source sends a Relation again in every streamed transaction that touches the table
        // and after any cache invalidation on its side: when nothing changed on either side, the
        // entry (and so the statements prepared for it) stays, instead of a new generation's
        // statements being prepared next to the old ones for as long as the process runs.
        if let Some(known) = self.relations.get(&relation.oid) {
            let same_source = known.source.namespace == relation.namespace
                && known.source.name == relation.name
                && known.source.replica_identity == relation.replica_identity
                && known.source.columns == relation.columns;
            if same_source && known.target == target {
                return Ok(known.clone());
            }
        }
        self.generation += 1;
        // (The target's names: a key column may be mapped onto another name.)
        let key: Vec<String> = relation
            .columns
            .iter()
            .zip(&target_columns)
            .filter(|(c, _)| c.is_key() && relation.replica_identity != ReplicaIdentity::Full)
            .map(|(_, &t)| target.columns[t].name.clone())
            .collect();
        // No key and not FULL (identity NOTHING, or a default identity without a primary key):
        // the source refuses UPDATE and DELETE on the table, so no change ever looks a row up.
        if relation.replica_identity == ReplicaIdentity::Full || !key.is_empty() {
            if let Some(advice) = key_index_advice(&target, &key) {
                // Once per process and table: every apply session (--apply-workers), and every
                // run after a reconnection, reads the same table.
                static SAID: std::sync::LazyLock<
                    std::sync::Mutex<std::collections::HashSet<String>>,
                > = std::sync::LazyLock::new(Default::default);
                let first = SAID
                    .lock()
                    .map(|mut said| said.insert(advice.clone()))
                    .unwrap_or(true);
                if first {
                    tracing::warn!(relation = %shown, "{advice}");
                }
            }
        }
        // A column the source changed to hold more (ALTER TABLE .. TYPE numeric(30,10), say)
        // while the target's still holds less: the target's assignment cast rounds without a
        // word; or changed to another kind of type, which the target's refuses values of. Said once per process for each pair of types (every apply session reads the
        // table; a change of either type is said again).
        static TYPE_ADVICE_SAID: std::sync::LazyLock<
            std::sync::Mutex<std::collections::HashSet<String>>,
        > = std::sync::LazyLock::new(Default::default);
        for (column, &t) in relation.columns.iter().zip(&target_columns) {
            let target_column = &target.columns[t];
            let Some(source_type) = builtin_type_name(column.type_oid, column.type_modifier) else {
                continue;
            };
            let said = if let Some(how) =
                crate::check::narrower(&source_type, &target_column.type_name)
            {
                format!(
                    "column {} is {source_type} on the source and {} on the target, which {how}: change it on the target first (ALTER TABLE {} ALTER COLUMN {} TYPE {source_type}{}); `pgapply verify` finds the rows already changed",
                    quote_ident(&column.name),
                    target_column.type_name,
                    target.qualified,
                    quote_ident(&target_column.name),
                    crate::check::converted_using(
                        &source_type,
                        &target_column.type_name,
                        &quote_ident(&target_column.name)
                    )
                )
            } else if !crate::check::compatible(
                &source_type,
                &target_column.type_name,
                &target_column.category,
            ) {
                // Another kind of type altogether (the source's column made text, the
                // target's still integer): said when the table's description comes, before
                // the first value the target cannot read stops the apply.
                format!(
                    "column {} is {source_type} on the source and {} on the target, which refuses the source's values it cannot read as {}: the first such row stops the apply. Change it on the target first (ALTER TABLE {} ALTER COLUMN {} TYPE {source_type}, with a USING clause if PostgreSQL asks for one)",
                    quote_ident(&column.name),
                    target_column.type_name,
                    target_column.type_name,
                    target.qualified,
                    quote_ident(&target_column.name),
                )
            } else {
                continue;
            };
            let first = TYPE_ADVICE_SAID
                .lock()
                .map(|mut s| s.insert(format!("{shown} {said}")))
                .unwrap_or(true);
            if first {
                tracing::warn!(relation = %shown, "{said}");
            }
        }
        let type_differs = relation
            .columns
            .iter()
            .zip(&target_columns)
            .enumerate()
            .filter(|(_, (c, &t))| binary_forms_differ(c.type_oid, target.columns[t].type_oid))
            .map(|(i, _)| i)
            .collect();
        let recreated_from = self
            .relations
            .values()
            // (By the names themselves: formatting each known table's name made loading the
            // thousandth new table cost a thousand allocations.)
            .find(|e| {
                e.source.oid != relation.oid
                    && e.source.name == relation.name
                    && source_schema(&e.source) == schema
            })
            .map(|e| e.source.oid)
            .or_else(|| known.as_ref().and_then(|k| k.recreated_from));
        let entry = Arc::new(RelationEntry {
            source: relation,
            target,
            quoted_columns,
            target_columns,
            key_columns,
            generation: self.generation,
            type_differs,
            recreated_from,
        });
        self.relations.insert(entry.source.oid, entry.clone());
        Ok(entry)
    }
}

pub async fn load_target_table<C: Catalog>(
    catalog: &C,
    version: i32,
    schema: &str,
    name: &str,
) -> Result<Option<TargetTable>> {
    // attgenerated exists from PostgreSQL 12.
    let generated = if version >= 120000 {
        "a.attgenerated::text"
    } else {
        "''::text"
    };
    let sql = format!(
        "SELECT c.oid, c.relkind::text, a.attname::text, a.atttypid, \
                pg_catalog.format_type(a.atttypid, a.atttypmod), {generated}, a.attidentity::text, a.atttypmod, \
                CASE WHEN a.atttypid IN (1042, 1043, 1560, 1562, 1014, 1015, 1561, 1563) \
                     THEN pg_catalog.quote_ident(tn.nspname) || '.' || pg_catalog.quote_ident(ty.typname) \
                     ELSE pg_catalog.format_type(a.atttypid, a.atttypmod) END, \
                ty.typcategory::text, ix.indexes::text \
         FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         LEFT JOIN pg_catalog.pg_attribute a \
                ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped \
         LEFT JOIN pg_catalog.pg_type ty ON ty.oid = a.atttypid \
         LEFT JOIN pg_catalog.pg_namespace tn ON tn.oid = ty.typnamespace \
         LEFT JOIN LATERAL ( \
           SELECT pg_catalog.json_agg(pg_catalog.json_build_object( \
                    'unique', i.indisunique AND i.indpred IS NULL AND NOT 0 = ANY (k.cols), \
                    'primary', i.indisprimary, 'columns', k.names)) AS indexes \
           FROM pg_catalog.pg_index i \
           CROSS JOIN LATERAL (SELECT (i.indkey::int2[])[0:coalesce((pg_catalog.to_jsonb(i) ->> 'indnkeyatts')::int, i.indnatts) - 1] AS cols) k0 \
           CROSS JOIN LATERAL (SELECT k0.cols, ARRAY(SELECT ia.attname::text FROM unnest(k0.cols) WITH ORDINALITY u(n, o) \
                                                     JOIN pg_catalog.pg_attribute ia ON ia.attrelid = i.indrelid AND ia.attnum = u.n \
                                                     ORDER BY u.o) AS names) k \
           WHERE i.indrelid = c.oid AND i.indisvalid) ix ON true \
         WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p') \
         ORDER BY a.attnum"
    );
    let rows = catalog_query(catalog, &sql, &[&schema, &name])
        .await
        .map_err(|e| {
            Error::postgres(
                format!(
                    "looking up table {} on the target",
                    qualified_name(schema, name)
                ),
                e,
            )
        })?;
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let relkind: String = first.get(1);
    let mut table = TargetTable {
        oid: first.get(0),
        schema: schema.to_owned(),
        name: name.to_owned(),
        qualified: qualified_name(schema, name),
        partitioned: relkind == "p",
        columns: Vec::with_capacity(rows.len()),
        // (Read for advice only: unreadable, it is none.)
        indexes: first
            .get::<_, Option<String>>(10)
            .and_then(|json| serde_json::from_str(&json).ok())
            .unwrap_or_default(),
    };
    for row in &rows {
        let column: Option<String> = row.get(2);
        let Some(column) = column else { continue };
        let generated: Option<String> = row.get(5);
        let identity: Option<String> = row.get(6);
        table.columns.push(TargetColumn {
            name: column,
            type_oid: row.get(3),
            type_name: row.get(4),
            type_modifier: row.get::<_, Option<i32>>(7).unwrap_or(-1),
            cast_type: row
                .get::<_, Option<String>>(8)
                .unwrap_or_else(|| "pg_catalog.text".to_owned()),
            generated: generated.is_some_and(|g| !g.is_empty()),
            identity_always: identity.as_deref() == Some("a"),
            category: row.get::<_, Option<String>>(9).unwrap_or_default(),
        });
    }
    Ok(Some(table))
}

/// Why finding rows of target table `target` by the source's key is slow or ambiguous, if it is:
/// no unique index on the key columns `key` (an UPDATE or DELETE by key changes every row with
/// that key), or no index that can serve the lookup at all (each one scans the table). With an
/// empty `key` (REPLICA IDENTITY FULL: rows are found by all their values) only the latter.
/// Typical cause: `schema --section pre-data` without `--section post-data`. The indexes are
/// those `load_target_table` read (none when they could not be read: this is advice, not a
/// condition for applying).
pub fn key_index_advice(target: &TargetTable, key: &[String]) -> Option<String> {
    let unique = target
        .indexes
        .iter()
        .any(|i| i.unique && !i.columns.is_empty() && i.columns.iter().all(|c| key.contains(c)));
    let indexed = target.indexes.iter().any(|i| match i.columns.first() {
        Some(first) => key.is_empty() || key.contains(first),
        None => false,
    });
    let has_primary = target.indexes.iter().any(|i| i.primary);
    let table = &target.qualified;
    let post_data = "(`pgapply schema --section post-data` creates the source's keys and indexes)";
    if key.is_empty() {
        return (!indexed).then(|| format!(
            "target table {table} has no index, and the source finds its rows by all their values (REPLICA IDENTITY FULL): every UPDATE and DELETE replicated to it reads the whole table; create an index on the target on a column whose values are (nearly) unique (if the source has one, `pgapply schema --section post-data` creates it there)"
        ));
    }
    if unique {
        return None;
    }
    let columns = key
        .iter()
        .map(|c| quote_ident(c))
        .collect::<Vec<_>>()
        .join(", ");
    let scans = if indexed {
        ""
    } else {
        " and reads the whole table to find it"
    };
    // (A table has one primary key: beside another one, the source's key is a unique index.)
    let add = if has_primary {
        format!("CREATE UNIQUE INDEX ON {table} ({columns})")
    } else {
        format!("ALTER TABLE {table} ADD PRIMARY KEY ({columns})")
    };
    Some(format!(
        "target table {table} has no primary key or unique index on the source's key ({columns}): every UPDATE and DELETE replicated to it changes each target row with that key{scans}; add it on the target ({add}) {post_data}"
    ))
}

/// What changed in the target table since `entry` read it, if anything that a statement's
/// parameter types depend on: the table itself (dropped, or another one under its name) or the
/// type of a column the source fills.
pub async fn target_changed<C: Catalog>(
    catalog: &C,
    entry: &RelationEntry,
) -> Result<Option<String>> {
    let rows = catalog_query(
        catalog,
        "SELECT pg_catalog.to_regclass($1)::oid = $2::oid, a.attname::text, a.atttypid \
             FROM pg_catalog.pg_attribute a \
             WHERE a.attrelid = $2::oid AND a.attnum > 0 AND NOT a.attisdropped",
        &[&entry.target.qualified, &entry.target.oid],
    )
    .await
    .map_err(|e| {
        Error::postgres(
            format!(
                "reading the columns of table {} on the target",
                entry.target.qualified
            ),
            e,
        )
    })?;
    if rows
        .first()
        .is_none_or(|r| r.get::<_, Option<bool>>(0) != Some(true))
    {
        return Ok(Some("the table was dropped or replaced".into()));
    }
    let now: HashMap<String, Oid> = rows.iter().map(|r| (r.get(1), r.get(2))).collect();
    for c in 0..entry.source.columns.len() {
        let Some(column) = entry.target_column(c) else {
            continue;
        };
        match now.get(&column.name) {
            Some(&oid) if oid == column.type_oid => {}
            Some(_) => {
                return Ok(Some(format!(
                    "column {} no longer has type {}",
                    quote_ident(&column.name),
                    column.type_name
                )))
            }
            None => {
                return Ok(Some(format!(
                    "column {} is gone",
                    quote_ident(&column.name)
                )))
            }
        }
    }
    Ok(None)
}

/// The statements that give target table `from` the name `schema`.`name`: SET SCHEMA when the
/// schema changed, RENAME TO when the name did (in that order, so the rename finds it).
fn rename_table_sql(from: &TargetTable, schema: &str, name: &str) -> String {
    let mut steps = Vec::new();
    let mut current = from.qualified.clone();
    if from.schema != schema {
        steps.push(format!(
            "CREATE SCHEMA IF NOT EXISTS {schema}; ALTER TABLE {current} SET SCHEMA {schema}",
            schema = quote_ident(schema)
        ));
        current = qualified_name(schema, &from.name);
    }
    if from.name != name {
        steps.push(format!(
            "ALTER TABLE {current} RENAME TO {}",
            quote_ident(name)
        ));
    }
    steps.join("; ")
}

/// The config file line that applies source column `from` of table `schema.table` to target
/// column `to`: a dotted key, one line of valid TOML (before any `[table]` header of the file).
/// Columns renamed on the source, as two descriptions of one table show them: at the same
/// position, of the same type, under another name (a rename keeps a column's place). Empty
/// when columns were added or dropped (positions no longer line up) or a type changed.
fn renamed_in_place(before: &[RelationColumn], now: &[RelationColumn]) -> Vec<(String, String)> {
    if before.len() != now.len()
        || before
            .iter()
            .zip(now)
            .any(|(b, n)| b.type_oid != n.type_oid)
    {
        return Vec::new();
    }
    before
        .iter()
        .zip(now)
        .filter(|(b, n)| b.name != n.name)
        .map(|(b, n)| (b.name.clone(), n.name.clone()))
        .collect()
}

/// RENAME COLUMN statements that give the target's columns the new names of `renames`, in an
/// order in which each new name is free when taken (a swap goes through a temporary name).
fn rename_columns_sql(table: &str, renames: &[(String, String)]) -> Vec<String> {
    let mut pending = renames.to_vec();
    let mut out = Vec::new();
    let sql = |from: &str, to: &str| {
        format!(
            "ALTER TABLE {table} RENAME COLUMN {} TO {}",
            quote_ident(from),
            quote_ident(to)
        )
    };
    while !pending.is_empty() {
        let free = pending
            .iter()
            .position(|(_, new)| !pending.iter().any(|(old, _)| old == new));
        match free {
            Some(i) => {
                let (old, new) = pending.remove(i);
                out.push(sql(&old, &new));
            }
            None => {
                // Every new name is held by another column still to rename: a cycle.
                let (old, new) = pending.remove(0);
                let temporary = format!("{old}_pgapply_tmp");
                out.push(sql(&old, &temporary));
                pending.push((temporary, new));
            }
        }
    }
    out
}

fn column_map_lines(schema: &str, table: &str, from: &str, to: &str) -> String {
    let toml = |s: &str| format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
    let name = format!("{schema}.{table}");
    format!(
        "tables.{name}.columns.{from} = {to} (a line at the top of the file, before any [...] header; where the file has a [tables.{name}] header already, write columns.{from} = {to} under it)",
        name = toml(&name),
        from = toml(from),
        to = toml(to)
    )
}

#[cfg(test)]
mod tests {
    use super::{binary_forms_differ, builtin_type_name, rename_table_sql, TargetTable};

    #[test]
    fn built_in_types_are_named_as_format_type_names_them() {
        // numeric(30,10): ((30 << 16) | 10) + 4.
        assert_eq!(
            builtin_type_name(1700, (30 << 16 | 10) + 4).as_deref(),
            Some("numeric(30,10)")
        );
        assert_eq!(builtin_type_name(1700, -1).as_deref(), Some("numeric"));
        // numeric(5,-2), PostgreSQL 15+: left alone.
        assert_eq!(builtin_type_name(1700, (5 << 16 | 0x7fe) + 4), None);
        assert_eq!(
            builtin_type_name(1043, 24).as_deref(),
            Some("character varying(20)")
        );
        assert_eq!(
            builtin_type_name(1114, 3).as_deref(),
            Some("timestamp(3) without time zone")
        );
        assert_eq!(
            builtin_type_name(1184, -1).as_deref(),
            Some("timestamp with time zone")
        );
        assert_eq!(builtin_type_name(16, -1), None);
        // And what they are compared with.
        assert!(crate::check::narrower("numeric(30,10)", "numeric(20,5)").is_some());
        assert!(crate::check::narrower(
            "timestamp(6) without time zone",
            "timestamp(3) without time zone"
        )
        .is_some());
    }

    #[test]
    fn renames_in_place_are_ordered_so_that_each_name_is_free() {
        use super::{rename_columns_sql, renamed_in_place};
        use crate::protocol::pgoutput::RelationColumn;
        let col = |name: &str, type_oid| RelationColumn {
            flags: 0,
            name: name.to_owned(),
            type_oid,
            type_modifier: -1,
        };
        let before = [col("id", 23), col("price", 23), col("price_new", 23)];
        let now = [col("id", 23), col("price_old", 23), col("price", 23)];
        let moved = renamed_in_place(&before, &now);
        assert_eq!(
            rename_columns_sql("t", &moved),
            [
                "ALTER TABLE t RENAME COLUMN \"price\" TO \"price_old\"",
                "ALTER TABLE t RENAME COLUMN \"price_new\" TO \"price\""
            ]
        );
        // A swap goes through a temporary name.
        let swapped = [col("id", 23), col("price_new", 23), col("price", 23)];
        let moved = renamed_in_place(&before, &swapped);
        assert_eq!(
            rename_columns_sql("t", &moved),
            [
                "ALTER TABLE t RENAME COLUMN \"price\" TO \"price_pgapply_tmp\"",
                "ALTER TABLE t RENAME COLUMN \"price_new\" TO \"price\"",
                "ALTER TABLE t RENAME COLUMN \"price_pgapply_tmp\" TO \"price_new\""
            ]
        );
        // A column added or a type changed: positions say nothing.
        assert!(renamed_in_place(&before, &now[..2]).is_empty());
        assert!(renamed_in_place(&before, &[col("id", 23), col("a", 20), col("b", 23)]).is_empty());
    }

    #[test]
    fn a_rename_sets_the_schema_then_the_name() {
        let from = TargetTable {
            oid: 1,
            schema: "public".into(),
            name: "u3".into(),
            qualified: "\"public\".\"u3\"".into(),
            partitioned: false,
            columns: Vec::new(),
            indexes: Vec::new(),
        };
        assert_eq!(
            rename_table_sql(&from, "s2", "u3"),
            "CREATE SCHEMA IF NOT EXISTS \"s2\"; ALTER TABLE \"public\".\"u3\" SET SCHEMA \"s2\""
        );
        assert_eq!(
            rename_table_sql(&from, "public", "u4"),
            "ALTER TABLE \"public\".\"u3\" RENAME TO \"u4\""
        );
        assert_eq!(
            rename_table_sql(&from, "s2", "u4"),
            "CREATE SCHEMA IF NOT EXISTS \"s2\"; ALTER TABLE \"public\".\"u3\" SET SCHEMA \"s2\"; ALTER TABLE \"s2\".\"u3\" RENAME TO \"u4\""
        );
    }

    #[test]
    fn binary_forms() {
        assert!(!binary_forms_differ(23, 23), "int4 = int4");
        assert!(binary_forms_differ(23, 20), "int4 into int8");
        assert!(
            !binary_forms_differ(25, 1043),
            "text into varchar: same bytes"
        );
        assert!(!binary_forms_differ(1042, 25), "char into text: same bytes");
        assert!(
            binary_forms_differ(16500, 16600),
            "user-defined types: OIDs differ by cluster"
        );
    }
}
