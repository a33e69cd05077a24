//! Conflicts met while applying: counted, logged once per kind, and written to `pgapply.conflicts`.

use super::*;

impl Applier {
    /// Writes the conflicts of the group that just committed to pgapply.conflicts.
    pub(super) async fn record_conflicts(&mut self, conflicts: GroupConflicts) {
        self.announce_conflicts(&conflicts);
        self.write_conflicts(conflicts).await;
    }

    /// Logs the conflicts of a group that committed (or a transaction that was prepared) and
    /// counts them.
    pub(super) fn announce_conflicts(&mut self, conflicts: &GroupConflicts) {
        for record in conflicts.records() {
            let log = &record.log;
            if log.missing {
                self.stats.missing_rows += 1;
            }
            METRICS.conflict(record.conflict_type, 1);
            match log.rows {
                Some(rows) => tracing::warn!(
                    table = %record.relation,
                    key = %log.key,
                    xid = log.xid,
                    commit_lsn = %record.source_lsn,
                    conflict = record.conflict_type,
                    policy = record.policy,
                    rows,
                    "{}", log.sentence
                ),
                None => tracing::warn!(
                    table = %record.relation,
                    key = %log.key,
                    xid = log.xid,
                    commit_lsn = %record.source_lsn,
                    conflict = record.conflict_type,
                    policy = record.policy,
                    "{}", log.sentence
                ),
            }
        }
        for more in conflicts.beyond() {
            if more.missing {
                self.stats.missing_rows += more.count;
            }
            METRICS.conflict(more.conflict_type, more.count);
            tracing::warn!(
                table = %more.relation,
                conflict = more.conflict_type,
                policy = more.policy,
                conflicts = more.count,
                first_commit_lsn = %more.first_lsn,
                last_commit_lsn = %more.last_lsn,
                "{} more {} conflict{} on {} in the same target transaction (policy {}), counted but not logged one by one: pgapply.conflicts holds them as one row with occurrences = {}",
                more.count,
                more.conflict_type,
                if more.count == 1 { "" } else { "s" },
                more.relation,
                more.policy,
                more.count
            );
        }
    }

    /// Writes conflict records to pgapply.conflicts (after their transaction committed).
    pub(super) async fn write_conflicts(&mut self, conflicts: GroupConflicts) {
        let (records, beyond) = conflicts.into_parts();
        for record in records {
            let local_row: Option<String> = match &record.local_row_query {
                _ if record.local_row.is_some() => record.local_row.clone(),
                Some((sql, params)) => self
                    .catalog
                    .query_opt(
                        sql.as_str(),
                        &params
                            .iter()
                            .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
                            .collect::<Vec<_>>(),
                    )
                    .await
                    .ok()
                    .flatten()
                    .and_then(|r| r.get(0)),
                None => None,
            };
            self.write_conflict(
                &record.relation,
                record.conflict_type,
                Some(&record.key),
                (local_row.as_deref(), record.remote_row.as_deref()),
                (record.source_lsn, record.source_commit_time),
                record.policy,
                1,
            )
            .await;
        }
        for more in beyond {
            self.write_conflict(
                &more.relation,
                more.conflict_type,
                None,
                (None, None),
                (more.last_lsn, more.last_commit_time),
                more.policy,
                more.count,
            )
            .await;
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn write_conflict(
        &self,
        relation: &str,
        conflict_type: &str,
        key: Option<&str>,
        (local_row, remote_row): (Option<&str>, Option<&str>),
        (source_lsn, commit_time): (Lsn, Option<PgTimestamp>),
        policy: &str,
        occurrences: u64,
    ) {
        let lsn = source_lsn.to_string();
        let commit_time = commit_time.map(|t| t.to_rfc3339());
        let occurrences = i64::try_from(occurrences).unwrap_or(i64::MAX);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 10] = [
            &self.slot,
            &relation,
            &conflict_type,
            &key,
            &local_row,
            &remote_row,
            &lsn,
            &commit_time,
            &policy,
            &occurrences,
        ];
        // The source's row arrives as text: read through the target table's types (as they
        // would store it: a numeric rounded to its scale, say), its values are JSON of the same
        // kinds as the target's row beside it (numbers, booleans, nested arrays, a json
        // column's document). A value the target's type cannot read, or a column it lacks,
        // stays as the source's text.
        let mut result = Err(None);
        if remote_row.is_some() {
            let typed = format!(
                "INSERT INTO pgapply.conflicts (slot_name, relation, conflict_type, key, local_row, remote_row, \
                     source_lsn, source_commit_time, policy, occurrences) \
                 SELECT $1, $2, $3, $4, $5::text::jsonb, \
                        (SELECT jsonb_object_agg(s.key, CASE WHEN s.value IN ('\"<binary>\"', '\"<unchanged>\"') THEN s.value \
                                WHEN jsonb_typeof(t.row -> s.key) = 'string' AND EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a \
                                    WHERE a.attrelid = pg_catalog.to_regclass($2) AND a.attname = s.key \
                                      AND a.atttypid IN ('json'::regtype, 'jsonb'::regtype)) \
                                THEN (t.row ->> s.key)::jsonb \
                                ELSE coalesce(t.row -> s.key, s.value) END) \
                           FROM jsonb_each(r.row) s, \
                                (SELECT to_jsonb(jsonb_populate_record(NULL::{relation}, \
                                    r.row - ARRAY(SELECT p.key FROM jsonb_each(r.row) p \
                                        WHERE p.value IN ('\"<binary>\"', '\"<unchanged>\"')))) AS row) t), \
                        $7::text::pg_lsn, $8::text::timestamptz, $9, $10 \
                   FROM (SELECT $6::text::jsonb AS row) r"
            );
            result = self
                .catalog
                .execute(typed.as_str(), &params)
                .await
                .map_err(Some);
        }
        if result.is_err() {
            result = self
                .catalog
                .execute(
                    "INSERT INTO pgapply.conflicts (slot_name, relation, conflict_type, key, local_row, remote_row, \
                         source_lsn, source_commit_time, policy, occurrences) \
                     VALUES ($1, $2, $3, $4, $5::text::jsonb, $6::text::jsonb, $7::text::pg_lsn, $8::text::timestamptz, $9, $10)",
                    &params,
                )
                .await
                .map_err(Some);
        }
        if let Err(Some(e)) = result {
            tracing::warn!(error = %describe_postgres(&e), "could not record a conflict in pgapply.conflicts");
        }
    }
}

/// What to write to pgapply.conflicts for a conflict met by `about`.
pub(super) fn conflict_record(about: &ChangeInfo, signal: Signal) -> ConflictRecord {
    let entry = &about.relation;
    let remote_row = about.remote.as_ref().map(|tuple| {
        let mut object = serde_json::Map::new();
        for (i, value) in tuple.values().enumerate() {
            let Some(column) = entry.source.columns.get(i) else {
                break;
            };
            let v = match value {
                Value::Null => serde_json::Value::Null,
                Value::Text(t) => {
                    serde_json::Value::String(String::from_utf8_lossy(&t).into_owned())
                }
                Value::Binary(_) => serde_json::Value::String("<binary>".into()),
                Value::UnchangedToast => serde_json::Value::String("<unchanged>".into()),
            };
            object.insert(column.name.clone(), v);
        }
        serde_json::Value::Object(object).to_string()
    });
    // The target's row, for an INSERT that found one and left it in place.
    let local_row_query = match (signal.conflict, signal.policy, &about.remote) {
        (ConflictType::InsertExists, Policy::Skip | Policy::KeepLocal, Some(tuple))
            if !entry.key_columns.is_empty() =>
        {
            let values: Vec<Value> = tuple.values().collect();
            let mut params = Vec::new();
            let mut conditions = Vec::new();
            for (n, &k) in entry.key_columns.iter().enumerate() {
                conditions.push(crate::apply::statement::column_equals(entry, k, n + 1));
                // Copies: a slice would keep the whole received message alive until the
                // group commits.
                params.push(match values.get(k) {
                    Some(Value::Text(t)) => WireValue::Text(bytes::Bytes::copy_from_slice(t)),
                    Some(Value::Binary(b)) => WireValue::Binary(bytes::Bytes::copy_from_slice(b)),
                    _ => WireValue::Null,
                });
            }
            Some((
                format!(
                    "SELECT to_jsonb(t.*)::text FROM {}{} t WHERE {}",
                    crate::apply::statement::only(entry),
                    entry.target.qualified,
                    conditions.join(" AND ")
                ),
                params,
            ))
        }
        _ => None,
    };
    ConflictRecord {
        relation: entry.target.qualified.clone(),
        conflict_type: signal.conflict.name(),
        key: about.describe_key(),
        local_row_query,
        local_row: None,
        remote_row,
        source_lsn: about.commit_lsn,
        source_commit_time: Some(about.commit_time),
        policy: signal.policy.name(),
        log: crate::apply::conflict::ConflictLog {
            key: about.describe_key_for_log(),
            xid: about.xid,
            sentence: conflict_sentence(about.operation, signal),
            rows: None,
            missing: matches!(
                signal.conflict,
                ConflictType::UpdateMissing | ConflictType::DeleteMissing
            ),
        },
    }
}

/// A conflict in words, for the log.
pub(super) fn conflict_sentence(operation: &str, signal: Signal) -> String {
    let kind = signal.conflict.name();
    match (signal.conflict, signal.policy) {
        (ConflictType::InsertExists, Policy::ApplyRemote) => {
            format!("{operation} found an existing row on the target ({kind}); overwrote it (policy apply_remote)")
        }
        (ConflictType::InsertExists, p) => {
            format!("{operation} found an existing row on the target ({kind}); kept the target's row (policy {})", p.name())
        }
        (
            ConflictType::UpdateExists | ConflictType::MultipleUniqueConflicts,
            Policy::ApplyRemote,
        ) => {
            format!("{operation} clashed with other rows' unique values on the target ({kind}); deleted those rows and applied the change (policy apply_remote)")
        }
        (ConflictType::UpdateExists | ConflictType::MultipleUniqueConflicts, p) => {
            format!("{operation} clashed with other rows' unique values on the target ({kind}); left the target as it was (policy {})", p.name())
        }
        (_, Policy::ApplyRemote) => {
            format!("{operation} found no row on the target ({kind}); inserted the new row (policy apply_remote)")
        }
        (_, _) if signal.incomplete_row => format!(
            "{operation} found no row on the target ({kind}); skipped: policy apply_remote would insert the new row, but the source did not send all of it (a large value it left unchanged, which it sends only when changed)"
        ),
        (_, p) => format!(
            "{operation} found no row on the target ({kind}); skipped (policy {})",
            p.name()
        ),
    }
}
