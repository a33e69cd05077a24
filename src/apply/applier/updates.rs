//! UPDATE into statements: one at a time, or held and collapsed per row while the table allows
//! it (`apply::batch`), with the checks that keep batching invisible on the target.

use super::pipeline::run_counting;
use super::*;

impl Applier {
    pub(super) async fn update(&mut self, update: Update) -> Result<()> {
        let Some((xid, commit_lsn, commit_time)) = self.in_transaction("Update")? else {
            return Ok(());
        };
        let entry = self.entry(update.relation)?;
        if self.in_later_copy(&entry, commit_lsn) {
            return Ok(());
        }
        Self::check_width(&entry, &update.new)?;
        let policies = self.policies_for(&entry);
        // The common case first: an update that keeps its key, held for a batched statement.
        if update.old.is_none()
            && !entry.key_columns.is_empty()
            && !identity_outside_key(&entry)
            && policies.update_missing == Policy::Skip
            && policies.update_exists == Policy::Error
            && policies.multiple_unique_conflicts == Policy::Error
            && self.may_batch(&entry, commit_lsn).await?
        {
            // Held for a while: a copy, so as not to keep the receive buffer alive.
            let new = update.new.detached();
            let values: Vec<Option<WireValue>> = new.values().map(WireValue::from_value).collect();
            if values.iter().all(Option::is_none) {
                return Ok(());
            }
            for &k in &entry.key_columns {
                if !matches!(
                    values.get(k),
                    Some(Some(WireValue::Text(_) | WireValue::Binary(_)))
                ) {
                    return Err(Error::definite(format!(
                        "the source sent no value for key column {} of table {}; this is a protocol error",
                        quote_ident(&entry.source.columns[k].name),
                        entry.display_name()
                    )));
                }
            }
            // Only the key and unchanged TOAST values: nothing to write (and `SET key = key`
            // would fail on a GENERATED ALWAYS identity key). Unlike the unbatched path, a row
            // missing on the target goes unnoticed then: the update changed nothing published.
            let writes_something = values
                .iter()
                .enumerate()
                .any(|(i, v)| v.is_some() && !entry.key_columns.contains(&i));
            if !writes_something {
                return Ok(());
            }
            self.unsettled_rows.updates += 1;
            let about = HeldChange {
                relation: entry.clone(),
                xid,
                commit_lsn,
                commit_time,
                change: Held::Update(new),
            };
            return self.hold_update(&entry, values, about).await;
        }
        self.before_change(&entry).await?;
        let mut params = Vec::with_capacity(update.new.len() * 2);
        let mut unchanged = identity_kept(&entry, &update);
        // A value the source left out as unchanged (TOAST), not only an identity column kept.
        let mut value_left_out = false;
        // Under REPLICA IDENTITY FULL the old row comes whole (TOASTed values included): a
        // value the new row leaves out as unchanged is there, which apply_remote needs to insert
        // a missing row. (Only then: otherwise a large value would be written again for nothing.)
        let old_whole: Option<Vec<Value>> = match &update.old {
            Some(OldRow::Full(old)) if policies.update_missing == Policy::ApplyRemote => {
                Some(old.values().collect())
            }
            _ => None,
        };
        for (i, value) in update.new.values().enumerate() {
            if unchanged.contains(i) {
                continue;
            }
            let value = match (value, old_whole.as_ref().and_then(|o| o.get(i))) {
                (Value::UnchangedToast, Some(old @ (Value::Text(_) | Value::Binary(_)))) => {
                    old.clone()
                }
                (value, _) => value,
            };
            match WireValue::from_value(value) {
                Some(v) => params.push(v),
                None => {
                    unchanged.insert(i);
                    value_left_out = true;
                }
            }
        }
        if params.is_empty() {
            // Every column is an unchanged TOAST value: nothing to write.
            return Ok(());
        }
        let (row_match, old_values) =
            self.row_match(&entry, update.old.as_ref(), &update.new, &mut params)?;
        let policy = policies.update_missing;
        let guarded = (policies.update_exists != Policy::Error
            || policies.multiple_unique_conflicts != Policy::Error)
            && row_match == RowMatch::Key;
        // The missing row can be inserted only when the new row is complete: no unchanged TOAST
        // value, and no identity column left out of the SET unless it is a key column (the
        // INSERT takes it from the key that finds the row).
        let complete = (0..update.new.len())
            .all(|c| !unchanged.contains(c) || entry.key_columns.contains(&c))
            && (unchanged.is_empty() || row_match == RowMatch::Key);
        let (on_conflict, signal) = match policy {
            Policy::ApplyRemote if complete => {
                (OnConflict::UpdateOrInsert, (Policy::ApplyRemote, 1))
            }
            Policy::ApplyRemote => (OnConflict::Plain, (Policy::Skip, 0)),
            other => (OnConflict::Plain, (other, 0)),
        };
        let triggers_may_skip = self.may_skip(&entry).await?.update;
        if row_match == RowMatch::Key {
            self.note_row_update(&entry, &old_values);
        }
        let shape = Shape {
            relation: entry.source.oid,
            generation: entry.generation,
            operation: Operation::Update,
            unchanged,
            row_match: row_match.clone(),
            on_conflict,
            rows: 1,
            arbiter: ColumnSet::default(),
            lookup: Default::default(),
            triggers_may_skip,
        };
        self.unsettled_rows.updates += 1;
        let about = ChangeInfo {
            relation: entry.clone(),
            operation: "UPDATE",
            xid,
            commit_lsn,
            commit_time,
            key: Some((row_match, old_values)),
            remote: Some(update.new),
            signal: Some(Signal {
                conflict: ConflictType::UpdateMissing,
                policy: signal.0,
                when_rows: signal.1,
                incomplete_row: policy == Policy::ApplyRemote && !complete && value_left_out,
                // (Whether the row was there, where a trigger may skip the update.)
                answers_local_row: triggers_may_skip && on_conflict == OnConflict::Plain,
            }),
            through: None,
        };
        if guarded {
            return self
                .apply_guarded(&entry, shape, params, about, ConflictType::UpdateExists)
                .await;
        }
        self.queue(&entry, shape, params, about).await
    }

    /// Whether an UPDATE of this relation, in the source transaction committing at `commit_lsn`,
    /// may be held back and batched (`apply::batch`).
    pub(super) async fn may_batch(
        &mut self,
        entry: &Arc<RelationEntry>,
        commit_lsn: Lsn,
    ) -> Result<bool> {
        if !self.batching_allowed(commit_lsn) {
            return Ok(false);
        }
        let key = (entry.source.oid, entry.generation);
        if let Some(known) = self.batchable.get(&key) {
            return Ok(known.is_some());
        }
        let fingerprint = crate::apply::batch::independent(&self.catalog, entry)
            .await?
            .map(Arc::from);
        let batchable = fingerprint.is_some();
        tracing::debug!(table = %entry.target.qualified, batchable, "updates batched within a group");
        self.batchable.insert(key, fingerprint);
        Ok(batchable)
    }

    /// Whether the source transaction committing at `commit_lsn` is among those of a failed
    /// group that are applied again one at a time (`retry_unbatched`).
    pub(super) fn one_at_a_time(&self, commit_lsn: Lsn) -> bool {
        commit_lsn.0
            <= self
                .settings
                .unbatched_through
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether changes of the source transaction committing at `commit_lsn` may share statements
    /// with other transactions' changes.
    pub(super) fn batching_allowed(&self, commit_lsn: Lsn) -> bool {
        self.settings.batch_updates && !self.one_at_a_time(commit_lsn)
    }

    /// Holds an UPDATE until another change to its table, or the end of the group, sends it.
    pub(super) async fn hold_update(
        &mut self,
        entry: &Arc<RelationEntry>,
        values: Vec<Option<WireValue>>,
        about: HeldChange,
    ) -> Result<()> {
        let held_for_other = self.held_updates.get(&entry.target.oid).is_some_and(|b| {
            b.entry.source.oid != entry.source.oid || b.entry.generation != entry.generation
        });
        if held_for_other {
            self.flush_held_updates(Some(entry.target.oid)).await?;
        }
        let batch = self
            .held_updates
            .entry(entry.target.oid)
            .or_insert_with(|| UpdateBatch::new(entry.clone()));
        let before = batch.len();
        batch.add(values, about);
        self.held_rows += batch.len() - before;
        if let Some(g) = &mut self.group {
            g.statements += 1;
        }
        if self.held_rows >= MAX_HELD_ROWS {
            self.flush_held_updates(None).await?;
        }
        Ok(())
    }

    /// Queues the held UPDATEs of one target table (or of all) as batched statements.
    pub(super) async fn flush_held_updates(&mut self, target_table: Option<Oid>) -> Result<()> {
        if self.held_updates.is_empty() {
            return Ok(());
        }
        let batches: Vec<UpdateBatch<HeldChange>> = match target_table {
            Some(oid) => self.held_updates.remove(&oid).into_iter().collect(),
            None => self.held_updates.drain().map(|(_, b)| b).collect(),
        };
        if batches.is_empty() {
            return Ok(());
        }
        // Inserts queued before these updates go first.
        self.flush_insert_run().await?;
        for batch in batches {
            self.held_rows -= batch.len().min(self.held_rows);
            let entry = batch.entry.clone();
            self.check_batching(&entry);
            for chunk in batch.into_chunks() {
                let statement = self
                    .batch_statement(
                        &entry,
                        Operation::UpdateBatch,
                        chunk.unchanged,
                        chunk.about.len(),
                    )
                    .await?;
                self.push_pending(Pending {
                    request: Request::Prepared(statement),
                    params: chunk.params,
                    about: None,
                    batch: chunk.about,
                    orders: false,
                })
                .await?;
            }
        }
        Ok(())
    }

    /// Before a change to `entry`'s table: its own held updates go first; so do all the others
    /// if a trigger or rule of this table could read their tables (`apply::batch::quiet`).
    pub(super) async fn before_change(&mut self, entry: &Arc<RelationEntry>) -> Result<()> {
        let others_held = self.held_updates.keys().any(|&oid| oid != entry.target.oid);
        if !others_held {
            return self.flush_held_updates(Some(entry.target.oid)).await;
        }
        match self.quiet_fingerprint(entry).await? {
            Some(fingerprint) => {
                self.check_unchanged(entry, fingerprint);
                self.flush_held_updates(Some(entry.target.oid)).await
            }
            None => self.flush_held_updates(None).await,
        }
    }

    /// Whether the target table has no enabled trigger (but foreign keys') and no rule
    /// (`apply::batch::quiet`): if so, what that was read from. Read once per relation.
    pub(super) async fn quiet_fingerprint(
        &mut self,
        entry: &Arc<RelationEntry>,
    ) -> Result<Option<Arc<str>>> {
        let key = (entry.source.oid, entry.generation);
        if let Some(known) = self.quiet.get(&key) {
            return Ok(known.clone());
        }
        let fingerprint = crate::apply::batch::quiet(&self.catalog, entry)
            .await?
            .map(Arc::<str>::from);
        self.quiet.insert(key, fingerprint.clone());
        Ok(fingerprint)
    }

    /// Has the target check, before the group commits, that what made the table's updates
    /// batchable still holds (`apply::batch`): else the group fails and is applied again one
    /// change at a time.
    pub(super) fn check_batching(&mut self, entry: &RelationEntry) {
        let Some(Some(fingerprint)) = self
            .batchable
            .get(&(entry.source.oid, entry.generation))
            .cloned()
        else {
            return;
        };
        self.check_unchanged(entry, fingerprint);
    }

    /// Has the target check, before the group commits, that the table is as `fingerprint` says
    /// it was read (`pgapply.check_group`): else the group fails and is applied again one change
    /// at a time. Checked is the first reading of the table (for this relation generation): a
    /// later one may have been taken after a change that decisions made before did not see.
    pub(super) fn check_unchanged(&mut self, entry: &RelationEntry, fingerprint: Arc<str>) {
        let fingerprint = self
            .fingerprints
            .entry((entry.source.oid, entry.generation))
            .or_insert(fingerprint)
            .clone();
        let Some(group) = &mut self.group else {
            return;
        };
        if group.relied_on.iter().any(|(oid, f)| {
            *oid == entry.target.oid && !f.starts_with(super::pipeline::COLUMNS_MARK)
        }) {
            return;
        }
        group.relied_on.push((entry.target.oid, fingerprint));
    }

    /// The prepared statement for a batch of `rows` UPDATEs (or DELETEs), preparing it the first
    /// time.
    pub(super) async fn batch_statement(
        &mut self,
        entry: &RelationEntry,
        operation: Operation,
        unchanged: ColumnSet,
        rows: usize,
    ) -> Result<Statement> {
        self.check_columns(entry);
        let shape = Shape {
            relation: entry.source.oid,
            generation: entry.generation,
            operation,
            unchanged,
            row_match: RowMatch::Key,
            on_conflict: OnConflict::Plain,
            rows,
            arbiter: ColumnSet::default(),
            lookup: Default::default(),
            triggers_may_skip: false,
        };
        if let Some(s) = self.statements.get(&shape) {
            return Ok(s.clone());
        }
        let deletes = operation == Operation::DeleteBatch;
        let unchanged = shape.unchanged.clone();
        let sql = |n| match deletes {
            true => crate::apply::batch::delete_sql(entry, n),
            false => crate::apply::batch::batch_sql(entry, &unchanged, n),
        };
        let types = |n| match deletes {
            true => crate::apply::batch::delete_param_types(entry, n),
            false => crate::apply::batch::param_types(entry, &unchanged, n),
        };
        // Every size this table's batches can take, prepared together: one round trip (only
        // the one needed when many tables are written, see `prepare_sparingly`).
        let mut sizes = vec![rows];
        let mut size = 1;
        let limit = if self.prepare_sparingly() {
            0
        } else {
            crate::apply::batch::row_limit(match deletes {
                true => entry.key_columns.len(),
                false => entry.source.columns.len(),
            })
        };
        while size <= limit {
            let mut other = shape.clone();
            other.rows = size;
            if size != rows && !self.statements.contains_key(&other) {
                sizes.push(size);
            }
            size *= 2;
        }
        let prepared = futures_util::future::join_all(sizes.iter().map(|&n| {
            let (sql, types) = (sql(n), types(n));
            let client = self.client.clone();
            async move { client.prepare_typed(&sql, &types).await }
        }))
        .await;
        let mut prepared = sizes.into_iter().zip(prepared);
        let wanted = prepared.next().map(|(_, r)| r);
        let mut other_failed = None;
        for (n, result) in prepared {
            match result {
                Ok(statement) => {
                    let mut other = shape.clone();
                    other.rows = n;
                    self.remember_statement(other, statement);
                }
                // A failed Parse aborts the open transaction: report it rather than a later
                // "transaction aborted".
                Err(e) => other_failed = other_failed.or(Some(e)),
            }
        }
        let wanted = match wanted {
            Some(result) => result,
            None => self.client.prepare_typed(&sql(rows), &types(rows)).await,
        };
        let wanted = match (wanted, other_failed) {
            (Ok(_), Some(e)) => Err(e),
            (wanted, _) => wanted,
        };
        let statement = match wanted {
            Ok(s) => s,
            Err(e) => {
                let what = format!(
                    "a batched {} of table {}",
                    if deletes { "DELETE" } else { "UPDATE" },
                    entry.target.qualified
                );
                return self.prepare_failed(&what, &entry.target.qualified, e).await;
            }
        };
        self.remember_statement(shape, statement.clone());
        Ok(statement)
    }

    /// Applies one change inside a savepoint, after everything queued before it has run and been
    /// checked, so that a unique violation can be rolled back and settled by the update_exists /
    /// multiple_unique_conflicts policies instead of failing the group. A round trip per change:
    /// only tables whose policies ask for it come here.
    pub(super) async fn apply_guarded(
        &mut self,
        entry: &Arc<RelationEntry>,
        shape: Shape,
        params: Vec<WireValue>,
        about: ChangeInfo,
        base: ConflictType,
    ) -> Result<()> {
        let statement = self.statement(entry, shape).await?;
        if let Some(g) = &mut self.group {
            g.statements += 1;
        }
        self.send_pipeline().await?;
        self.run_in_group("SAVEPOINT pgapply_guard").await?;
        let answers = about.answers_local_row();
        let violation = match run_counting(&self.client, &statement, &params, answers).await {
            Err(e) if e.code().is_some_and(|c| c.code() == "23505") => e,
            other => {
                self.check_result(Some(about), other);
                self.fail_if_failed().await?;
                return self.run_in_group("RELEASE SAVEPOINT pgapply_guard").await;
            }
        };
        self.run_in_group("ROLLBACK TO SAVEPOINT pgapply_guard")
            .await?;
        let clashing = match self.find_clashing(entry, &about).await {
            Ok(rows) => rows,
            Err(e) => {
                self.failure = Some(e);
                return self.fail_if_failed().await;
            }
        };
        let conflict = if crate::apply::unique::indexes_violated(&clashing) > 1 {
            ConflictType::MultipleUniqueConflicts
        } else {
            base
        };
        let policy = self.policies_for(entry).get(conflict);
        if clashing.is_empty() || policy == Policy::Error {
            self.failure = Some(self.violation_error(conflict.name(), Some(&about), violation));
            return self.fail_if_failed().await;
        }
        let signal = Signal {
            conflict,
            policy,
            when_rows: 0,
            incomplete_row: false,
            answers_local_row: false,
        };
        let mut record = conflict_record(&about, signal);
        record.local_row = crate::apply::unique::rows_json(&clashing);
        record.log.rows = Some(clashing.len());
        if policy == Policy::ApplyRemote {
            if let Err(e) = crate::apply::unique::delete_rows(&self.client, entry, &clashing).await
            {
                self.failure = Some(e);
                return self.fail_if_failed().await;
            }
            let again = run_counting(&self.client, &statement, &params, answers).await;
            self.check_result(Some(about), again);
            self.fail_if_failed().await?;
        }
        self.conflicts.push(record);
        self.run_in_group("RELEASE SAVEPOINT pgapply_guard").await
    }

    /// The target table's simple unique indexes (primary key first), as source columns; read
    /// once per relation generation.
    pub(super) async fn target_unique_keys(
        &mut self,
        entry: &Arc<RelationEntry>,
    ) -> Result<Arc<Vec<Vec<usize>>>> {
        let cache_key = (entry.source.oid, entry.generation);
        if let Some(k) = self.unique_keys.get(&cache_key) {
            return Ok(k.clone());
        }
        // (On the catalog session: the apply session's transaction may already have failed.)
        let k = Arc::new(crate::apply::unique::unique_keys(&self.catalog, entry).await?);
        self.unique_keys.insert(cache_key, k.clone());
        Ok(k)
    }

    /// Whether the target table has a DEFERRABLE unique or exclusion constraint; read once per
    /// relation generation.
    pub(super) async fn target_has_deferrable(
        &mut self,
        entry: &Arc<RelationEntry>,
    ) -> Result<bool> {
        let cache_key = (entry.source.oid, entry.generation);
        if let Some(&d) = self.deferrable_unique.get(&cache_key) {
            return Ok(d);
        }
        let d = crate::apply::unique::has_deferrable(&self.catalog, entry).await?;
        self.deferrable_unique.insert(cache_key, d);
        Ok(d)
    }

    /// Counts an unbatched update of the row with key `row`'s key columns (`row`: the values that
    /// find it, in source column order) in the open group; the group commits after the current
    /// transaction once a row had `HOT_ROW_UPDATES` of them.
    fn note_row_update(&mut self, entry: &RelationEntry, row: &[Value]) {
        use std::hash::{Hash, Hasher};
        let Some(group) = &mut self.group else {
            return;
        };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        for value in entry.key_columns.iter().filter_map(|&k| row.get(k)) {
            match value {
                Value::Text(b) | Value::Binary(b) => b.as_ref().hash(&mut hasher),
                Value::Null | Value::UnchangedToast => 0u8.hash(&mut hasher),
            }
        }
        let count = group
            .row_updates
            .entry((entry.source.oid, hasher.finish()))
            .or_insert(0);
        *count += 1;
        if *count >= super::HOT_ROW_UPDATES {
            group.closes_now = true;
        }
    }

    /// The changes a trigger on the target table may skip (`apply::triggers`).
    pub(super) async fn may_skip(
        &mut self,
        entry: &Arc<RelationEntry>,
    ) -> Result<crate::apply::triggers::MaySkip> {
        let cache_key = (entry.source.oid, entry.generation);
        if let Some(&(m, _)) = self.may_skip.get(&cache_key) {
            return Ok(m);
        }
        let m = crate::apply::triggers::may_skip(&self.catalog, entry, self.as_replica).await?;
        self.may_skip.insert(cache_key, (m, Instant::now()));
        Ok(m)
    }

    /// The target rows a change's unique values clash with.
    pub(super) async fn find_clashing(
        &mut self,
        entry: &Arc<RelationEntry>,
        about: &ChangeInfo,
    ) -> Result<Vec<crate::apply::unique::ClashingRow>> {
        let keys = self.target_unique_keys(entry).await?;
        let Some(new) = &about.remote else {
            return Ok(Vec::new());
        };
        let own = match &about.key {
            Some((RowMatch::Key, values)) => Some(values.as_slice()),
            _ => None,
        };
        crate::apply::unique::clashing_rows(&self.client, entry, &keys, new, own).await
    }

    /// Runs a statement of the open target transaction now; a failure ends the group.
    pub(super) async fn run_in_group(&mut self, sql: &str) -> Result<()> {
        if let Err(e) = self.client.batch_execute(sql).await {
            self.failure = Some(Error::postgres(format!("running {sql} on the target"), e));
            return self.fail_if_failed().await;
        }
        Ok(())
    }
}

/// A target `GENERATED ALWAYS AS IDENTITY` column that is not part of the key: an UPDATE cannot
/// tell whether it changed, and sets it (the target then refuses, saying what to change).
pub(super) fn identity_outside_key(entry: &RelationEntry) -> bool {
    entry.target.has_identity_always()
        && (0..entry.source.columns.len()).any(|c| {
            !entry.key_columns.contains(&c)
                && entry.target_column(c).is_some_and(|t| t.identity_always)
        })
}

/// The target's `GENERATED ALWAYS AS IDENTITY` columns that an UPDATE leaves as they are: such a
/// column may not be SET, not even to its own value, so it is left out of the SET (as an
/// unchanged column is). Known to stay: a key column when no old key was sent (the key did not
/// change), or any column whose old value (REPLICA IDENTITY FULL, or a changed key) equals the
/// new one. A column that does change, or might, stays in: the target's error then says why.
pub(super) fn identity_kept(entry: &RelationEntry, update: &Update) -> ColumnSet {
    let mut kept = ColumnSet::default();
    if !entry.target.has_identity_always() {
        return kept;
    }
    let new: Vec<Value> = update.new.values().collect();
    let old: Option<Vec<Value>> = update.old.as_ref().map(|o| o.tuple().values().collect());
    for (i, value) in new.iter().enumerate() {
        if !entry.target_column(i).is_some_and(|t| t.identity_always) {
            continue;
        }
        let stays = match &old {
            None => entry.key_columns.contains(&i),
            Some(old) => match (old.get(i), value) {
                (Some(Value::Text(a)), Value::Text(b))
                | (Some(Value::Binary(a)), Value::Binary(b)) => a == b,
                (Some(Value::Null), Value::Null) => true,
                _ => false,
            },
        };
        if stays {
            kept.insert(i);
        }
    }
    kept
}
