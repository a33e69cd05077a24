//! Target triggers that can make a change do nothing, without an error.
//!
//! A BEFORE ROW trigger on the target that returns NULL (enabled ALWAYS or REPLICA: pgapply's
//! sessions run as a replica, so only those fire; ALWAYS and ordinary ones for a role that may
//! not set session_replication_role) keeps an INSERT, UPDATE or DELETE from
//! happening, as a table that keeps the rows the source deletes does on purpose. A row count of 0
//! then does not mean that the row was missing (nor, for an INSERT under `skip`, that one was
//! there). PostgreSQL's own subscriber finds the row before it changes it, so such a change passes
//! without a word there. For such a table pgapply's statement also answers whether the row was
//! there (`Shape::triggers_may_skip`), so that only a row really missing is a conflict.

use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::relation::RelationEntry;

/// Which of a table's changes a trigger on the target may skip.
#[derive(Debug, Default, Clone, Copy)]
pub struct MaySkip {
    pub insert: bool,
    pub update: bool,
    pub delete: bool,
}

/// What the target table's triggers (and its partitions', or inheritance children's) may skip.
/// A table with rules is left as it is: a data-modifying WITH, which the statements that tell
/// need, is refused on a table with most kinds of rules.
/// `as_replica`: the apply session runs as a replica (ALWAYS and REPLICA triggers fire); else as
/// an origin (ALWAYS and ordinary ones: the role may not set session_replication_role).
pub async fn may_skip(client: &Client, entry: &RelationEntry, as_replica: bool) -> Result<MaySkip> {
    let firing = if as_replica { "R" } else { "O" };
    // tgtype bits: 1 row, 2 before, 4 insert, 8 delete, 16 update.
    let row = client
        .query_one(
            "WITH RECURSIVE tree(oid) AS ( \
                 SELECT $1::oid \
                 UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN tree ON i.inhparent = tree.oid) \
             SELECT coalesce(bool_or(t.tgtype::int & 4 <> 0), false), \
                    coalesce(bool_or(t.tgtype::int & 16 <> 0), false), \
                    coalesce(bool_or(t.tgtype::int & 8 <> 0), false), \
                    EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite r JOIN tree ON r.ev_class = tree.oid \
                            WHERE r.rulename <> '_RETURN') \
             FROM pg_catalog.pg_trigger t JOIN tree ON t.tgrelid = tree.oid \
             WHERE t.tgenabled IN ('A', $2::text::\"char\") AND t.tgtype::int & 3 = 3",
            &[&entry.target.oid, &firing],
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
    if row.get::<_, bool>(3) {
        return Ok(MaySkip::default());
    }
    Ok(MaySkip {
        insert: row.get(0),
        update: row.get(1),
        delete: row.get(2),
    })
}
