//! Tables published after the initial copy: copied by a later run with `--copy-data`, and the
//! position each such copy's snapshot had, so that changes already in the copied rows are
//! dropped.

use std::collections::HashMap;

use tokio_postgres::Client;

use super::{connect_source, published_tables};
use crate::error::{Error, Result};
use crate::sql::qualified_name;

/// Tables published after the slot's initial copy whose copy (`plan_copy` with `late`) began
/// but did not finish: streamed into as they are, they would miss rows.
pub async fn late_unfinished(target: &Client, slot: &str) -> Result<Vec<String>> {
    let rows = target
        .query(
            "SELECT schema_name, table_name FROM pgapply.copy_state \
             WHERE slot_name = $1 AND synced_lsn IS NOT NULL AND state <> 'done' ORDER BY 1, 2",
            &[&slot],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.copy_state on the target", e))?;
    Ok(rows
        .iter()
        .map(|r| qualified_name(&r.get::<_, String>(0), &r.get::<_, String>(1)))
        .collect())
}

/// Whether `qualified` names a table on the target.
pub(super) async fn target_table_exists(target: &Client, qualified: &str) -> Result<bool> {
    Ok(target
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
        .await
        .map_err(|e| Error::postgres(format!("reading table {qualified} on the target"), e))?
        .get(0))
}

/// Tables copied after the initial copy (published later), with that copy's snapshot position:
/// changes from transactions committed before it are in the copied rows, and are dropped.
#[derive(Debug, Default)]
pub struct LaterCopies {
    /// By source table (schema, name): the copied tables, and the source tables whose rows a
    /// copy read under another name (`cover_partitions`).
    pub by_source: HashMap<(String, String), crate::protocol::Lsn>,
}

impl LaterCopies {
    pub fn is_empty(&self) -> bool {
        self.by_source.is_empty()
    }
}

/// The tables copied after the initial copy whose snapshot position is past `from` (their other
/// names on the source: `cover_partitions`).
pub async fn copied_since(
    target: &Client,
    slot: &str,
    from: crate::protocol::Lsn,
) -> Result<LaterCopies> {
    let rows = target
        .query(
            "SELECT schema_name, table_name, synced_lsn::text FROM pgapply.copy_state \
             WHERE slot_name = $1 AND state = 'done' AND synced_lsn > $2::text::pg_lsn",
            &[&slot, &from.to_string()],
        )
        .await
        .map_err(|e| Error::postgres("reading pgapply.copy_state on the target", e))?;
    let mut copies = LaterCopies::default();
    for r in rows {
        let text: String = r.get(2);
        let lsn: crate::protocol::Lsn = text.parse().map_err(|e| {
            Error::definite(format!(
                "pgapply.copy_state on the target holds an unreadable position {text:?}: {e}"
            ))
        })?;
        copies.by_source.insert((r.get(0), r.get(1)), lsn);
    }
    Ok(copies)
}

/// The source tables whose rows the copies of `copied` hold: those tables, the partitions
/// under them, and the partitioned tables all of whose leaves are among them
/// (`cover_partitions`). After `publish_via_partition_root` switched, the stream names the
/// other ones, which were copied all the same. (`copied` alone when the source cannot say.)
pub async fn covered_by_copies(
    source: &Client,
    copied: Vec<(String, String)>,
) -> std::collections::HashSet<(String, String)> {
    let mut copies = LaterCopies {
        by_source: copied
            .iter()
            .map(|t| (t.clone(), crate::protocol::Lsn::INVALID))
            .collect(),
    };
    if cover_partitions(source, &mut copies).await.is_err() {
        return copied.into_iter().collect();
    }
    copies.by_source.into_keys().collect()
}

/// A copied table's rows, read on the source, are those of its partitions too, and a
/// partitioned table's rows those of its leaves: after `publish_via_partition_root` switched, a
/// change still to be applied may come under the other name. Adds (by the source's partition
/// tree, as it is now) each partition under a copied table, at that copy's position, and each
/// partitioned table above copied ones whose every leaf partition is covered, at the earliest
/// of their positions. (Not tables inheriting otherwise: COPY reads a table's own rows only.)
pub async fn cover_partitions(source: &Client, copies: &mut LaterCopies) -> Result<()> {
    let by_source = &mut copies.by_source;
    let edges = source
        .query(
            "SELECT i.inhrelid, cn.nspname::text, c.relname::text, c.relkind = 'p', \
                    i.inhparent, pn.nspname::text, p.relname::text \
             FROM pg_catalog.pg_inherits i \
             JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid AND c.relispartition \
             JOIN pg_catalog.pg_namespace cn ON cn.oid = c.relnamespace \
             JOIN pg_catalog.pg_class p ON p.oid = i.inhparent \
             JOIN pg_catalog.pg_namespace pn ON pn.oid = p.relnamespace",
            &[],
        )
        .await
        .map_err(|e| {
            Error::postgres(
                "reading the partitions of the copied tables on the source",
                e,
            )
        })?;
    type Name = (String, String);
    let mut name_of: HashMap<u32, Name> = HashMap::new();
    let mut parent_of: HashMap<u32, u32> = HashMap::new();
    let mut children: HashMap<u32, Vec<(u32, bool)>> = HashMap::new();
    for e in &edges {
        let (child, parent): (u32, u32) = (e.get(0), e.get(4));
        name_of.insert(child, (e.get(1), e.get(2)));
        name_of.insert(parent, (e.get(5), e.get(6)));
        parent_of.insert(child, parent);
        children.entry(parent).or_default().push((child, e.get(3)));
    }
    let oid_of: HashMap<&Name, u32> = name_of.iter().map(|(oid, name)| (name, *oid)).collect();
    let mut by_oid: HashMap<u32, crate::protocol::Lsn> = HashMap::new();
    for (name, lsn) in by_source.iter() {
        if let Some(&oid) = oid_of.get(name) {
            by_oid.insert(oid, *lsn);
        }
    }
    // Down: every partition under a copied table.
    let copied: Vec<(u32, crate::protocol::Lsn)> = by_oid.iter().map(|(o, l)| (*o, *l)).collect();
    for (oid, lsn) in copied {
        let mut stack = vec![oid];
        let mut seen = 0usize;
        while let Some(table) = stack.pop() {
            seen += 1;
            if seen > 100_000 {
                break;
            }
            for &(child, _) in children.get(&table).into_iter().flatten() {
                let at = by_oid.entry(child).or_insert(lsn);
                *at = (*at).max(lsn);
                stack.push(child);
            }
        }
    }
    // Up: a partitioned table whose leaves are all covered.
    fn leaves_covered(
        table: u32,
        children: &HashMap<u32, Vec<(u32, bool)>>,
        by_oid: &HashMap<u32, crate::protocol::Lsn>,
        depth: usize,
    ) -> Option<crate::protocol::Lsn> {
        let mut earliest: Option<crate::protocol::Lsn> = None;
        for &(child, partitioned) in children.get(&table)? {
            let at = if partitioned && depth < 64 {
                leaves_covered(child, children, by_oid, depth + 1)?
            } else {
                *by_oid.get(&child)?
            };
            earliest = Some(earliest.map_or(at, |e| e.min(at)));
        }
        earliest
    }
    let mut ancestors: Vec<u32> = Vec::new();
    for &oid in by_oid.keys() {
        let mut at = oid;
        while let Some(&parent) = parent_of.get(&at) {
            if ancestors.contains(&parent) || ancestors.len() > 10_000 {
                break;
            }
            ancestors.push(parent);
            at = parent;
        }
    }
    for parent in ancestors {
        if by_oid.contains_key(&parent) {
            continue;
        }
        if let Some(at) = leaves_covered(parent, &children, &by_oid, 0) {
            by_oid.insert(parent, at);
        }
    }
    for (oid, lsn) in by_oid {
        if let Some(name) = name_of.get(&oid) {
            by_source.entry(name.clone()).or_insert(lsn);
        }
    }
    Ok(())
}

/// Per published table (schema, name): its oid on the source, and the source's catalog rows
/// that publish it through
/// `publications` (its own or an ancestor's `pg_publication_rel` row, its or an ancestor's
/// schema's `pg_publication_namespace` row on 15+, a FOR ALL TABLES publication's row).
pub(super) async fn memberships(
    source: &Client,
    publications: &[String],
    tables: &[(String, String)],
) -> Result<HashMap<(String, String), (u32, Vec<u32>)>> {
    let version = crate::sql::server_version(source)
        .await
        .map_err(|e| Error::postgres("reading the source's version", e))?;
    // (Partitions publish through their ancestors' rows; pg_partition_ancestors is 12+, and
    // has no row for a table that is not in a partition tree.)
    let related = if version >= 120000 {
        "SELECT c.oid UNION SELECT relid FROM pg_catalog.pg_partition_ancestors(c.oid)"
    } else {
        "SELECT c.oid"
    };
    let schemas = if version >= 150000 {
        format!(
            "UNION ALL SELECT pn.oid FROM pg_catalog.pg_publication_namespace pn \
             JOIN pg_catalog.pg_publication p ON p.oid = pn.pnpubid \
             WHERE p.pubname = ANY($1) AND pn.pnnspid IN \
               (SELECT r.relnamespace FROM pg_catalog.pg_class r WHERE r.oid IN ({related}))"
        )
    } else {
        String::new()
    };
    let sql = format!(
        "SELECT t.s, t.n, c.oid, ARRAY( \
             SELECT pr.oid FROM pg_catalog.pg_publication_rel pr \
             JOIN pg_catalog.pg_publication p ON p.oid = pr.prpubid \
             WHERE p.pubname = ANY($1) AND pr.prrelid IN ({related}) \
             UNION ALL SELECT p.oid FROM pg_catalog.pg_publication p \
             WHERE p.pubname = ANY($1) AND p.puballtables \
             {schemas})::oid[] \
         FROM unnest($2::text[], $3::text[]) AS t(s, n) \
         JOIN pg_catalog.pg_namespace ns ON ns.nspname = t.s \
         JOIN pg_catalog.pg_class c ON c.relnamespace = ns.oid AND c.relname = t.n"
    );
    let (schemas, names): (Vec<String>, Vec<String>) = tables.iter().cloned().unzip();
    let rows = source
        .query(&sql, &[&publications, &schemas, &names])
        .await
        .map_err(|e| Error::postgres("reading what publishes each table on the source", e))?;
    Ok(rows
        .iter()
        .map(|r| ((r.get(0), r.get(1)), (r.get(2), r.get(3))))
        .collect())
}

/// After the initial copy, forgets the copy state of tables no longer published (as `REFRESH
/// PUBLICATION` does): published again later, such a table is copied again by a `--copy-data`
/// run, instead of being taken as copied with the changes made while it was out missing. A copy
/// of such a table that did not finish no longer blocks the runs either. The last row stays:
/// it is what says that the slot's initial copy was made.
///
/// A table taken out and put back since the last start (stopped or not meanwhile), or whose
/// row filter or column list changed, is published by new catalog rows: when none of those
/// recorded at the last start is left, changes made in between were not sent (or rows the new
/// filter takes were never copied). It is marked (`recopy`) and said at every start until a run
/// with `--copy-data` copies it again, as a table published later (`--truncate-target` for its
/// rows), or the user clears the mark. Not compared when a publication the last run gave is
/// left out now (its rows no longer count); one added leaves the earlier rows in place.
#[allow(clippy::too_many_arguments)]
pub async fn forget_unpublished(
    target: &Client,
    source_config: &tokio_postgres::Config,
    slot: &str,
    publications: &[String],
    table_map: &crate::config::TableMap,
    resume: crate::protocol::Lsn,
    publications_dropped: bool,
    copying_again: bool,
) -> Result<()> {
    let source = connect_source(source_config).await?;
    let published_now = published_tables(&source, publications, table_map).await?;
    let filters: HashMap<(String, String), String> = published_now
        .iter()
        .map(|t| {
            (
                (t.schema.clone(), t.name.clone()),
                t.row_filter.clone().unwrap_or_default(),
            )
        })
        .collect();
    let published: Vec<(String, String)> = published_now
        .into_iter()
        .map(|t| (t.schema, t.name))
        .collect();
    let context = |e| Error::postgres("reading pgapply.copy_state on the target", e);
    // (A copied table whose copy's position the stream has not passed yet is not forgotten:
    // its changes from before that position, still to come, are to be dropped. What publishes
    // it is compared all the same.)
    let rows = target
        .query(
            "SELECT schema_name, table_name, source_relid, \
                    coalesce(state = 'done' AND synced_lsn > $2::text::pg_lsn, false) \
             FROM pgapply.copy_state WHERE slot_name = $1",
            &[&slot, &resume.to_string()],
        )
        .await
        .map_err(context)?;
    let mut recorded: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let stream_behind: Vec<bool> = rows.iter().map(|r| r.get(3)).collect();
    // Renamed on the source (same oid, a published name the copy state does not have): the
    // state follows the new name.
    let renamed: Vec<((String, String), u32)> = rows
        .iter()
        .filter_map(|r| {
            let name: (String, String) = (r.get(0), r.get(1));
            let relid: Option<u32> = r.get(2);
            relid
                .filter(|_| !published.contains(&name))
                .map(|id| (name, id))
        })
        .collect();
    if !renamed.is_empty() {
        let unrecorded: Vec<(String, String)> = published
            .iter()
            .filter(|t| !recorded.contains(t))
            .cloned()
            .collect();
        let now = memberships(&source, publications, &unrecorded).await?;
        for (old, relid) in renamed {
            let Some((new, _)) = now.iter().find(|(_, (id, _))| *id == relid) else {
                continue;
            };
            let moved = target
                .execute(
                    "UPDATE pgapply.copy_state SET schema_name = $4, table_name = $5 \
                     WHERE slot_name = $1 AND schema_name = $2 AND table_name = $3 \
                       AND NOT EXISTS (SELECT 1 FROM pgapply.copy_state o \
                                       WHERE o.slot_name = $1 AND o.schema_name = $4 AND o.table_name = $5)",
                    &[&slot, &old.0, &old.1, &new.0, &new.1],
                )
                .await
                .map_err(context)?;
            if moved == 1 {
                tracing::info!(
                    from = %qualified_name(&old.0, &old.1),
                    to = %qualified_name(&new.0, &new.1),
                    "renamed on the source: its copy state follows the new name"
                );
                if let Some(entry) = recorded.iter_mut().find(|t| **t == old) {
                    *entry = new.clone();
                }
            }
        }
    }
    let gone: Vec<&(String, String)> = recorded
        .iter()
        .zip(&stream_behind)
        .filter(|(t, behind)| !**behind && !published.contains(t))
        .map(|(t, _)| t)
        .collect();
    let kept: Vec<(String, String)> = recorded
        .iter()
        .filter(|t| published.contains(t))
        .cloned()
        .collect();
    if !kept.is_empty() {
        let compare = !publications_dropped;
        note_memberships(
            target,
            &source,
            slot,
            publications,
            &kept,
            &filters,
            compare,
            copying_again,
        )
        .await?;
    }
    if gone.is_empty() || gone.len() == recorded.len() {
        return Ok(());
    }
    for (schema, name) in &gone {
        target
            .execute(
                "DELETE FROM pgapply.copy_state WHERE slot_name = $1 AND schema_name = $2 AND table_name = $3",
                &[&slot, schema, name],
            )
            .await
            .map_err(context)?;
    }
    let names: Vec<String> = gone.iter().map(|(s, n)| qualified_name(s, n)).collect();
    tracing::info!(tables = %names.join(", "), "no longer published: their copy state is forgotten (published again, a run with --copy-data copies them again)");
    Ok(())
}

/// Compares what publishes each of `tables` now with what did at the last start (see
/// `forget_unpublished`), marks those put back since as copies to make again, and records what
/// publishes them now.
#[allow(clippy::too_many_arguments)]
async fn note_memberships(
    target: &Client,
    source: &Client,
    slot: &str,
    publications: &[String],
    tables: &[(String, String)],
    filters: &HashMap<(String, String), String>,
    compare: bool,
    copying_again: bool,
) -> Result<()> {
    let context = |e| {
        Error::postgres(
            "recording what publishes the copied tables on the target",
            e,
        )
    };
    let now = memberships(source, publications, tables).await?;
    // (Read and written in one statement each: a publication may hold thousands of tables.)
    type Recorded = (Option<Vec<u32>>, Option<String>);
    let before: HashMap<(String, String), Recorded> = target
        .query(
            "SELECT schema_name, table_name, membership, row_filter FROM pgapply.copy_state WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(context)?
        .iter()
        .map(|r| ((r.get(0), r.get(1)), (r.get(2), r.get(3))))
        .collect();
    let mut returned = Vec::new();
    let (mut schemas, mut names, mut rows, mut relids, mut put_backs, mut row_filters) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for table in tables {
        let Some((relid, current)) = now.get(table) else {
            continue;
        };
        let (rows_before, filter_before) = before.get(table).cloned().unwrap_or((None, None));
        let filter = filters.get(table).cloned().unwrap_or_default();
        let put_back = is_put_back(compare, rows_before, filter_before, current, &filter);
        if put_back {
            returned.push(qualified_name(&table.0, &table.1));
        }
        schemas.push(table.0.clone());
        names.push(table.1.clone());
        // (As text: arrays of arrays of different lengths do not pass as one parameter.)
        rows.push(format!(
            "{{{}}}",
            current
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ));
        relids.push(*relid);
        put_backs.push(put_back);
        row_filters.push(filter);
    }
    target
        .execute(
            "UPDATE pgapply.copy_state c SET membership = u.m::oid[], source_relid = u.relid, \
                    recopy = c.recopy OR u.put_back, row_filter = u.f \
             FROM unnest($2::text[], $3::text[], $4::text[], $5::oid[], $6::bool[], $7::text[]) AS u(s, n, m, relid, put_back, f) \
             WHERE c.slot_name = $1 AND c.schema_name = u.s AND c.table_name = u.n",
            &[&slot, &schemas, &names, &rows, &relids, &put_backs, &row_filters],
        )
        .await
        .map_err(context)?;
    if !returned.is_empty() {
        tracing::info!(
            tables = %returned.join(", "),
            "what publishes these tables changed since pgapply last started (their publication rows, or their row filter)"
        );
    }
    let marked: Vec<String> = target
        .query(
            "SELECT schema_name, table_name FROM pgapply.copy_state WHERE slot_name = $1 AND recopy ORDER BY 1, 2",
            &[&slot],
        )
        .await
        .map_err(context)?
        .iter()
        .map(|r| qualified_name(&r.get::<_, String>(0), &r.get::<_, String>(1)))
        .collect();
    if !marked.is_empty() && copying_again {
        tracing::info!(
            tables = %marked.join(", "),
            "taken out of the publication and put back, or given another row filter or column list, after their copy: this run (--copy-data --truncate-target) copies them again"
        );
    } else if !marked.is_empty() {
        tracing::warn!(
            tables = %marked.join(", "),
            "taken out of the publication and put back, or given another row filter or column list, after their copy: the source did not send their changes while they were out, nor rows a new filter takes, so rows may be missing or stale on the target (pgapply verify compares them). A run with --copy-data --truncate-target copies them again; if nothing is missing, stop this warning with UPDATE pgapply.copy_state SET recopy = false WHERE slot_name = '{}' on the target",
            slot.replace('\'', "''")
        );
    }
    Ok(())
}

/// Whether a table is published by none of the catalog rows recorded at the last start (only
/// when `membership` may be compared: no publication of the last run left out), or with another
/// row filter, whatever publications give it (see `forget_unpublished`). Nothing recorded:
/// nothing to compare.
fn is_put_back(
    membership: bool,
    rows_before: Option<Vec<u32>>,
    filter_before: Option<String>,
    current: &[u32],
    filter: &str,
) -> bool {
    (membership
        && rows_before.is_some_and(|b| !b.is_empty() && !b.iter().any(|oid| current.contains(oid))))
        || filter_before.is_some_and(|f| !same_filters(&f, filter))
}

/// Whether two row filters, each the publications' filters ORed (`(a) OR (b)`), are the same
/// set in any order: the order follows the source's catalog, which any ALTER PUBLICATION may
/// change without changing what is published.
fn same_filters(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    let (mut a, mut b) = (filter_parts(a), filter_parts(b));
    a.sort_unstable();
    b.sort_unstable();
    a == b
}

/// The ORed parts of a row filter: split at ` OR ` outside parentheses, quoted literals and
/// quoted names.
fn filter_parts(filter: &str) -> Vec<&str> {
    let bytes = filter.as_bytes();
    let (mut parts, mut start, mut depth, mut quote) = (Vec::new(), 0, 0i32, None::<u8>);
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match quote {
            // (A doubled quote inside reads as leaving and entering again: the same.)
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None => match c {
                b'\'' | b'"' => quote = Some(c),
                b'(' => depth += 1,
                b')' => depth -= 1,
                b' ' if depth == 0 && bytes[i..].starts_with(b" OR ") => {
                    parts.push(&filter[start..i]);
                    i += 4;
                    start = i;
                    continue;
                }
                _ => {}
            },
        }
        i += 1;
    }
    parts.push(&filter[start..]);
    parts
}

/// For `pgapply check`: the copied tables a run would name as copies to make again (marked at an
/// earlier start, or put back since the last one), without recording anything.
pub async fn copies_to_make_again(
    target: &Client,
    source: &Client,
    slot: &str,
    publications: &[String],
    published: &[super::PublishedTable],
) -> Result<Vec<String>> {
    let context = |e| Error::postgres("reading pgapply.copy_state on the target", e);
    let rows = target
        .query(
            "SELECT schema_name, table_name, membership, row_filter, recopy FROM pgapply.copy_state \
             WHERE slot_name = $1 AND state = 'done' ORDER BY 1, 2",
            &[&slot],
        )
        .await
        .map_err(context)?;
    let previous = crate::replicate::recorded_publications(target, slot)
        .await
        .map_err(context)?;
    // (As a run decides.)
    let compare = !crate::replicate::publications_dropped(previous.as_deref(), publications);
    let tables: Vec<(String, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .filter(|t| {
            published
                .iter()
                .any(|p| (&p.schema, &p.name) == (&t.0, &t.1))
        })
        .collect();
    let now = memberships(source, publications, &tables).await?;
    let mut again = Vec::new();
    for row in &rows {
        let table: (String, String) = (row.get(0), row.get(1));
        let marked: bool = row.get(4);
        let put_back = now.get(&table).is_some_and(|(_, current)| {
            let filter = published
                .iter()
                .find(|p| (&p.schema, &p.name) == (&table.0, &table.1))
                .and_then(|p| p.row_filter.clone())
                .unwrap_or_default();
            is_put_back(compare, row.get(2), row.get(3), current, &filter)
        });
        if marked || put_back {
            again.push(qualified_name(&table.0, &table.1));
        }
    }
    Ok(again)
}

/// Records the snapshot position of a copy of tables published after the initial copy.
pub async fn set_synced_lsn(target: &Client, slot: &str, at: crate::protocol::Lsn) -> Result<()> {
    target
        .execute(
            "UPDATE pgapply.copy_state SET synced_lsn = $2::text::pg_lsn \
             WHERE slot_name = $1 AND synced_lsn = '0/0' AND state <> 'done'",
            &[&slot, &at.to_string()],
        )
        .await
        .map_err(|e| Error::postgres("recording the copy's snapshot position on the target", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_filters_in_another_order_are_the_same() {
        assert!(same_filters(
            "((id < 50)) OR ((id >= 100))",
            "((id >= 100)) OR ((id < 50))"
        ));
        assert!(same_filters("((a))", "((a))"));
        assert!(!same_filters("((id < 50))", "((id < 50)) OR ((id >= 100))"));
        assert!(!same_filters(
            "((id < 50)) OR ((id > 1))",
            "((id < 50)) OR ((id >= 100))"
        ));
        // ` OR ` inside parentheses or quotes does not split.
        assert_eq!(
            filter_parts("((a = 1) OR (b = 2)) OR ((v = ') OR (')) OR ((\"x OR y\" = 1))"),
            vec![
                "((a = 1) OR (b = 2))",
                "((v = ') OR ('))",
                "((\"x OR y\" = 1))"
            ]
        );
        assert!(same_filters(
            "((v = 'it''s')) OR ((id > 1))",
            "((id > 1)) OR ((v = 'it''s'))"
        ));
    }
}
