//! Step 4 of the cutover: the sequences published tables use, copied from the source to the
//! target as the source has them (`last_value` and `is_called`, not max(column)).

use tokio_postgres::Client;

use crate::config::TableMap;
use crate::copy::published_tables;
use crate::error::{Error, Result};

/// The sequences a cutover copies: those published tables use (owned by one of their columns,
/// or named in a column default), or all with `--all-sequences`.
pub struct SequencePlan {
    /// (source sequence, its target sequence), both qualified and quoted.
    pub copy: Vec<(String, String)>,
    /// Source sequences left out.
    pub left_out: Vec<String>,
}

/// Lists the sequences to copy and the target sequence of each.
pub async fn plan_sequences(
    source: &Client,
    target: &Client,
    publications: &[String],
    table_map: &TableMap,
    all: bool,
) -> Result<SequencePlan> {
    let tables: Vec<String> = published_tables(source, publications, table_map)
        .await?
        .iter()
        .map(|t| t.qualified())
        .collect();
    let rows = source
        .query(
            // Used: owned by a published table, by one of its ancestors (a partition's serial
            // column takes its values from the partitioned table's sequence) or by one of its
            // partitions (a table with a serial column of its own, attached to a root published
            // whole; not an inheritance child, which is published, and copied, as a table of
            // its own), or named in a column default of one (`DEFAULT nextval('invoice_no')`).
            &format!(
                "WITH RECURSIVE published (oid) AS (SELECT x::regclass::oid FROM unnest($1::text[]) x), \
             up (oid) AS (SELECT oid FROM published \
                 UNION SELECT i.inhparent FROM pg_inherits i JOIN up ON i.inhrelid = up.oid), \
             down (oid) AS (SELECT oid FROM published \
                 UNION SELECT i.inhrelid FROM pg_inherits i JOIN down ON i.inhparent = down.oid \
                 JOIN pg_class p ON p.oid = i.inhrelid WHERE p.relispartition), \
             rel (oid) AS (SELECT oid FROM up UNION SELECT oid FROM down), \
             in_default AS ( \
                 SELECT dd.refobjid AS oid FROM pg_depend dd \
                 JOIN pg_attrdef ad ON dd.classid = 'pg_attrdef'::regclass AND dd.objid = ad.oid \
                 WHERE dd.refclassid = 'pg_class'::regclass AND ad.adrelid IN (SELECT oid FROM rel)) \
             SELECT n.nspname::text, c.relname::text, tn.nspname::text, t.relname::text, a.attname::text, \
                    coalesce(d.refobjid IN (SELECT oid FROM rel), false) OR c.oid IN (SELECT oid FROM in_default) \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             LEFT JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = c.oid \
                  AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i') \
             LEFT JOIN pg_class t ON t.oid = d.refobjid \
             LEFT JOIN pg_namespace tn ON tn.oid = t.relnamespace \
             LEFT JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid \
             WHERE c.relkind = 'S' AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
               AND n.nspname NOT LIKE 'pg_toast%' AND n.nspname NOT LIKE 'pg_temp%' \
               AND NOT coalesce({}, false) \
             ORDER BY 1, 2",
                crate::apply::applier::own_table_sql("tn.nspname", "t.relname")
            ),
            &[&tables],
        )
        .await
        .map_err(|e| Error::postgres("listing sequences on the source", e))?;
    let mut plan = SequencePlan {
        copy: Vec::new(),
        left_out: Vec::new(),
    };
    for row in rows {
        let name = crate::sql::qualified_name(&row.get::<_, String>(0), &row.get::<_, String>(1));
        if !all && !row.get::<_, bool>(5) {
            plan.left_out.push(name);
            continue;
        }
        let owner: Option<(String, String, String)> = match (row.get(2), row.get(3), row.get(4)) {
            (Some(schema), Some(table), Some(column)) => Some((schema, table, column)),
            _ => None,
        };
        let target_name = target_sequence(target, &name, owner, table_map).await;
        plan.copy.push((name, target_name));
    }
    Ok(plan)
}

/// What would stop step 4 half-way, found before anything is frozen: a sequence missing on the
/// target, or one the roles may not read or set.
pub(super) async fn sequence_problems(
    source: &Client,
    target: &Client,
    plan: &SequencePlan,
    all_sequences: bool,
) -> Result<Vec<String>> {
    let (names, target_names): (Vec<String>, Vec<String>) = plan.copy.iter().cloned().unzip();
    let mut problems = Vec::new();
    for row in source
        .query(
            "SELECT n, current_user::text FROM unnest($1::text[]) n WHERE NOT pg_catalog.has_sequence_privilege(n, 'SELECT')",
            &[&names],
        )
        .await
        .map_err(|e| Error::postgres("checking the source's sequences", e))?
    {
        problems.push(format!(
            "the source role may not read sequence {} (GRANT SELECT ON SEQUENCE {} TO {})",
            row.get::<_, String>(0),
            row.get::<_, String>(0),
            crate::sql::quote_ident(&row.get::<_, String>(1))
        ));
    }
    for row in target
        .query(
            "SELECT n, c.relkind::text, \
                    CASE WHEN c.relkind = 'S' THEN pg_catalog.has_sequence_privilege(c.oid, 'SELECT') \
                                               AND pg_catalog.has_sequence_privilege(c.oid, 'UPDATE') END, \
                    current_user::text \
             FROM unnest($1::text[]) n LEFT JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(n)",
            &[&target_names],
        )
        .await
        .map_err(|e| Error::postgres("checking the target's sequences", e))?
    {
        let (name, kind, may, me): (String, Option<String>, Option<bool>, String) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        // (Read first, to never set one back: SELECT as well as UPDATE.)
        match (kind.as_deref(), may) {
            (Some("S"), Some(true)) => {}
            (Some("S"), _) => problems.push(format!(
                "the target role may not read and set sequence {name} (GRANT SELECT, UPDATE ON SEQUENCE {name} TO {})",
                crate::sql::quote_ident(&me)
            )),
            (Some(_), _) => problems.push(format!(
                "{name} is not a sequence on the target: the source's sequence of that name has nowhere to go"
            )),
            (None, _) => problems.push(format!(
                "sequence {name} does not exist on the target: create it (pgapply schema creates the published tables' sequences){}",
                if all_sequences { ", or leave --all-sequences out" } else { "; the cutover carries each sequence a published table uses over to the target, so that new rows there continue after the source's" }
            )),
        }
    }
    Ok(problems)
}

/// Copies each planned sequence's state (`last_value`, `is_called`), except where the target's
/// is ahead of the source's: moving it back would hand out values the target used already.
/// Returns how many were copied.
pub(super) async fn copy_sequences(
    source: &Client,
    target: &Client,
    plan: &SequencePlan,
) -> Result<usize> {
    let ahead = sequences_ahead(source, target, plan).await?;
    for a in &ahead {
        crate::out!(
            "step 4: sequence {} on the target is ahead of the source's ({} against {}): kept as it is",
            a.target_name,
            a.target_value,
            a.source_value
        );
    }
    let mut count = 0;
    for (name, target_name) in &plan.copy {
        if ahead.iter().any(|a| &a.target_name == target_name) {
            continue;
        }
        let state = source
            .query_one(&format!("SELECT last_value, is_called FROM {name}"), &[])
            .await
            .map_err(|e| {
                Error::postgres(format!("step 4: reading sequence {name} on the source"), e)
            })?;
        let (value, called): (i64, bool) = (state.get(0), state.get(1));
        target
            .execute(
                "SELECT setval($1::text::regclass, $2, $3)",
                &[&target_name, &value, &called],
            )
            .await
            .map_err(|e| {
                Error::postgres(
                    format!("step 4: setting sequence {target_name} on the target (for {name} of the source; does it exist there?)"),
                    e,
                )
            })?;
        count += 1;
    }
    Ok(count)
}

/// A target sequence that has handed out values beyond the source's.
pub(super) struct Ahead {
    pub(super) target_name: String,
    pub(super) target_value: i64,
    pub(super) source_value: String,
}

/// The planned sequences whose target sequence is ahead of the source's, in the sequence's own
/// direction (a descending one is ahead when lower): the target has had inserts of its own. A
/// CYCLE sequence never is: once it wrapped on the source, a lower value there may be the later
/// one, so the source's state, the one of record, is copied.
pub(super) async fn sequences_ahead(
    source: &Client,
    target: &Client,
    plan: &SequencePlan,
) -> Result<Vec<Ahead>> {
    // (last_value, is_called, increment, cycles) of a sequence: is_called false means not used
    // yet.
    async fn state(client: &Client, name: &str, side: &str) -> Result<(i64, bool, i64, bool)> {
        let row = client
            .query_one(
                &format!(
                    "SELECT s.last_value, s.is_called, p.seqincrement, p.seqcycle FROM {name} s, pg_catalog.pg_sequence p WHERE p.seqrelid = $1::text::regclass"
                ),
                &[&name],
            )
            .await
            .map_err(|e| Error::postgres(format!("reading sequence {name} on the {side}"), e))?;
        Ok((row.get(0), row.get(1), row.get(2), row.get(3)))
    }
    let mut ahead = Vec::new();
    for (name, target_name) in &plan.copy {
        let (t_value, t_called, increment, t_cycles) = state(target, target_name, "target").await?;
        if !t_called {
            continue;
        }
        let (s_value, s_called, _, s_cycles) = state(source, name, "source").await?;
        if s_cycles || t_cycles {
            continue;
        }
        let beyond = !s_called
            || (increment > 0 && t_value > s_value)
            || (increment < 0 && t_value < s_value);
        if beyond {
            ahead.push(Ahead {
                target_name: target_name.clone(),
                target_value: t_value,
                source_value: if s_called {
                    s_value.to_string()
                } else {
                    "not used yet".to_owned()
                },
            });
        }
    }
    Ok(ahead)
}

/// The target's sequence for source sequence `name`: a sequence owned by a table column (serial,
/// identity) is the one of that column on the target, whatever it is called there (the table may
/// be mapped to another name with `[tables."x".target]`); any other keeps its name.
pub(super) async fn target_sequence(
    target: &Client,
    name: &str,
    owner: Option<(String, String, String)>,
    table_map: &TableMap,
) -> String {
    let Some((schema, table, column)) = owner else {
        return name.to_owned();
    };
    let key = (schema, table);
    let (schema, table) = table_map.get(&key).cloned().unwrap_or(key);
    let on_target = target
        .query_one(
            "SELECT n.nspname::text, c.relname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid = pg_catalog.pg_get_serial_sequence($1, $2)::pg_catalog.regclass",
            &[&crate::sql::qualified_name(&schema, &table), &column],
        )
        .await
        .ok()
        // Written as the other names are, schema and name always quoted.
        .map(|r| crate::sql::qualified_name(&r.get::<_, String>(0), &r.get::<_, String>(1)));
    on_target.unwrap_or_else(|| name.to_owned())
}
