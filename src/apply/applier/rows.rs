//! INSERT, DELETE and TRUNCATE into statements: runs of inserts sent as multi-row INSERTs, rows
//! found by key or by the whole old row, and the checks that a tuple fits the table it names.

use super::*;

impl Applier {
    pub(super) fn check_width(entry: &RelationEntry, tuple: &Tuple) -> Result<()> {
        if tuple.len() != entry.source.columns.len() {
            return Err(Error::definite(format!(
                "the source sent {} columns for table {}, but its Relation message described {}; this is a protocol error",
                tuple.len(),
                entry.display_name(),
                entry.source.columns.len()
            )));
        }
        Self::check_binary(entry, tuple)
    }

    /// Binary values (`--binary`) need the same type on both sides; the run checked that when it
    /// started, but a column's type may change on either side while it runs.
    pub(super) fn check_binary(entry: &RelationEntry, tuple: &Tuple) -> Result<()> {
        if entry.type_differs.is_empty() {
            return Ok(());
        }
        let values: Vec<Value> = tuple.values().collect();
        let Some(&c) = entry
            .type_differs
            .iter()
            .find(|&&c| matches!(values.get(c), Some(Value::Binary(_))))
        else {
            return Ok(());
        };
        // Transient: the run that starts again has text values sent (for the rest of the
        // process: the table may no longer be published when it starts, for its check to see).
        crate::replicate::TEXT_FROM_NOW_ON.store(true, std::sync::atomic::Ordering::SeqCst);
        Err(Error::transient(format!(
            "column {} of table {} has type {} on the target, which the source's binary values (--binary) may not fit (the source's column has another type, or a user-defined one): starting again, with text values where the types differ",
            quote_ident(&entry.source.columns[c].name),
            entry.display_name(),
            entry.target_column(c).map_or("?", |t| t.type_name.as_str())
        )))
    }

    pub(super) async fn insert(&mut self, insert: Insert) -> Result<()> {
        let Some((xid, commit_lsn, commit_time)) = self.in_transaction("Insert")? else {
            return Ok(());
        };
        let entry = self.entry(insert.relation)?;
        if self.in_later_copy(&entry, commit_lsn) {
            return Ok(());
        }
        Self::check_width(&entry, &insert.new)?;
        self.before_change(&entry).await?;
        let mut params = Vec::with_capacity(insert.new.len());
        for (i, value) in insert.new.values().enumerate() {
            params.push(WireValue::from_value(value).ok_or_else(|| {
                // PostgreSQL 15+ sends an UPDATE that moves a row into a row filter as an
                // INSERT, and a TOASTed value outside the replica identity is then "unchanged"
                // with nothing to take it from. Its own subscriber stores NULL; that would make
                // the target differ without a word.
                Error::definite(format!(
                    "the source sent an INSERT into {} without the value of column {} (an unchanged TOASTed value): an UPDATE moved the row into a publication's row filter, and the column is not part of the table's replica identity. On the source, run ALTER TABLE {} REPLICA IDENTITY FULL so that such rows come whole (if a publication gives the table a column list, drop the list first: PostgreSQL refuses every UPDATE and DELETE of a FULL table published with one); for this row, copy it from the source to the target by hand; {}",
                    entry.display_name(),
                    quote_ident(&entry.source.columns[i].name),
                    entry.display_name(),
                    self.skip_hint(commit_lsn)
                ))
            })?);
        }
        let policy = self.policies_for(&entry).insert_exists;
        let mut arbiter = ColumnSet::default();
        let mut lookup = std::sync::Arc::default();
        // A DEFERRABLE unique constraint on the target: ON CONFLICT must name a key checked at
        // once (without one it examines every unique index, and refuses the deferrable one).
        let deferrable = policy != Policy::Error && self.target_has_deferrable(&entry).await?;
        let (on_conflict, signal) = match policy {
            Policy::Error => (OnConflict::Plain, None),
            Policy::Skip | Policy::KeepLocal => {
                let keys = self.target_unique_keys(&entry).await?;
                if deferrable {
                    let Some(key) = keys.first() else {
                        return Err(deferrable_arbiter_error(&entry, policy));
                    };
                    for &c in key {
                        arbiter.insert(c);
                    }
                }
                // With the keys, the statement answers with the rows that kept it out.
                let when = if keys.is_empty() { 0 } else { 1 };
                lookup = keys;
                (OnConflict::InsertDoNothing, Some(when))
            }
            Policy::ApplyRemote => {
                if entry.key_columns.is_empty() {
                    return Err(Error::definite(format!(
                        "conflict policy insert_exists = \"apply_remote\" needs a replica identity key on table {}, which has none",
                        entry.display_name()
                    )));
                }
                // Every column is "key" under FULL; and the target may have no unique index on the
                // source's key (another primary key there): the row that exists is then the one
                // with the same values in the target's primary key (or first unique index).
                let keys = self.target_unique_keys(&entry).await?;
                let on_the_key = keys.iter().any(|k| {
                    k.len() == entry.key_columns.len()
                        && k.iter().all(|c| entry.key_columns.contains(c))
                });
                if entry.source.replica_identity == ReplicaIdentity::Full || !on_the_key {
                    let Some(key) = keys.first() else {
                        let (what, add) = if entry.source.replica_identity == ReplicaIdentity::Full
                        {
                            ("(REPLICA IDENTITY FULL) ".to_owned(), "add one".to_owned())
                        } else {
                            let columns: Vec<&str> = entry
                                .key_columns
                                .iter()
                                .map(|&c| entry.quoted_columns[c].as_str())
                                .collect();
                            (
                                String::new(),
                                format!(
                                    "add one (CREATE UNIQUE INDEX ON {} ({}), the source's key{})",
                                    entry.target.qualified,
                                    columns.join(", "),
                                    if entry.target.partitioned {
                                        ", with the partition key's columns too: a partitioned table's unique index must hold them"
                                    } else {
                                        ""
                                    }
                                ),
                            )
                        };
                        return Err(Error::definite(format!(
                            "conflict policy insert_exists = \"apply_remote\" on table {} {what}needs a primary key or unique index on the target table {} over replicated columns, to tell which row an insert overwrites: {add}, or use another policy for this table",
                            entry.display_name(),
                            entry.target.qualified
                        )));
                    };
                    for &c in key {
                        arbiter.insert(c);
                    }
                }
                if deferrable {
                    let wanted: Vec<usize> = if arbiter.is_empty() {
                        entry.key_columns.clone()
                    } else {
                        (0..entry.source.columns.len())
                            .filter(|&c| arbiter.contains(c))
                            .collect()
                    };
                    let keys = self.target_unique_keys(&entry).await?;
                    let usable = keys
                        .iter()
                        .any(|k| k.len() == wanted.len() && k.iter().all(|c| wanted.contains(c)));
                    if !usable {
                        return Err(deferrable_arbiter_error(&entry, policy));
                    }
                }
                (OnConflict::InsertOverwrite, Some(1))
            }
        };
        let shape = Shape {
            relation: entry.source.oid,
            generation: entry.generation,
            operation: Operation::Insert,
            unchanged: ColumnSet::default(),
            row_match: RowMatch::Key,
            on_conflict,
            rows: 1,
            triggers_may_skip: on_conflict == OnConflict::InsertDoNothing
                && !lookup.is_empty()
                && self.may_skip(&entry).await?.insert,
            arbiter,
            lookup,
        };
        self.unsettled_rows.inserts += 1;
        // (ON CONFLICT DO NOTHING naming its key leaves a clash on another unique index to the
        // guard, as one without a key would have skipped it.)
        let guarded = (self.policies_for(&entry).multiple_unique_conflicts != Policy::Error
            && on_conflict != OnConflict::InsertDoNothing)
            || (on_conflict == OnConflict::InsertDoNothing && !shape.arbiter.is_empty());
        if on_conflict == OnConflict::Plain && !guarded {
            return self
                .batch_insert(
                    &entry,
                    shape,
                    params,
                    xid,
                    commit_lsn,
                    commit_time,
                    insert.new,
                )
                .await;
        }
        let answers = on_conflict == OnConflict::InsertOverwrite || !shape.lookup.is_empty();
        let about = ChangeInfo {
            relation: entry.clone(),
            operation: "INSERT",
            xid,
            commit_lsn,
            commit_time,
            key: None,
            remote: Some(insert.new),
            signal: signal.map(|when_rows| Signal {
                conflict: ConflictType::InsertExists,
                policy,
                when_rows,
                incomplete_row: false,
                answers_local_row: answers,
            }),
            through: None,
        };
        if guarded {
            return self
                .apply_guarded(&entry, shape, params, about, ConflictType::InsertExists)
                .await;
        }
        self.queue(&entry, shape, params, about).await
    }

    /// Adds a row to the run of inserts into the same table by the same source transaction, sent
    /// as one multi-row INSERT; a different statement ends the run.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn batch_insert(
        &mut self,
        entry: &Arc<RelationEntry>,
        shape: Shape,
        params: Vec<WireValue>,
        xid: u32,
        commit_lsn: Lsn,
        commit_time: PgTimestamp,
        row: Tuple,
    ) -> Result<()> {
        // A run continues across source transactions of the group unless batching is off for
        // them (after a failed batch).
        let across = self.batching_allowed(commit_lsn);
        let fits = self.insert_run.as_ref().is_some_and(|run| {
            run.shape == shape
                && (across || (run.about.xid == xid && run.about.commit_lsn == commit_lsn))
        });
        if !fits {
            self.flush_insert_run().await?;
            let columns = entry.source.columns.len().max(1);
            self.insert_run = Some(InsertRun {
                entry: entry.clone(),
                shape,
                params: Vec::with_capacity(params.len() * 8),
                weight: 0,
                rows: 0,
                limit: {
                    let mut limit = MAX_INSERT_ROWS;
                    while limit > 1 && limit * columns > 60_000 {
                        limit /= 2;
                    }
                    limit
                },
                about: ChangeInfo {
                    relation: entry.clone(),
                    operation: "INSERT",
                    xid,
                    commit_lsn,
                    commit_time,
                    key: None,
                    remote: Some(row),
                    signal: None,
                    through: None,
                },
                last_commit: commit_lsn,
            });
        }
        let full = match &mut self.insert_run {
            Some(run) => {
                run.last_commit = commit_lsn;
                run.weight += super::pipeline::values_weight(&params);
                run.params.extend(params);
                run.rows += 1;
                // (Large values: a statement of a few MB, not of 128 rows of them.)
                run.rows >= run.limit || run.weight >= self.settings.pipeline_values / 8
            }
            None => false,
        };
        if full {
            self.flush_insert_run().await?;
        }
        Ok(())
    }

    /// Queues the open run of inserts as one statement.
    pub(super) async fn flush_insert_run(&mut self) -> Result<()> {
        // (At most one of the two runs is open: each starts by ending the other.)
        self.flush_delete_run().await?;
        let Some(run) = self.insert_run.take() else {
            return Ok(());
        };
        let mut about = run.about;
        if run.last_commit != about.commit_lsn {
            about.through = Some(run.last_commit);
        }
        if let Some(g) = &mut self.group {
            g.statements += run.rows;
        }
        // (A table that gets one row at a time needs no other size: prepared as needed.)
        if run.rows > 1 {
            self.prepare_insert_sizes(&run.entry, &run.shape, run.limit)
                .await?;
        }
        let columns = run.params.len() / run.rows.max(1);
        let mut params = run.params.into_iter();
        let mut left = run.rows;
        while left > 0 {
            let mut rows = run.limit;
            while rows > left {
                rows /= 2;
            }
            left -= rows;
            let mut shape = run.shape.clone();
            shape.rows = rows;
            let statement = self.statement(&run.entry, shape).await?;
            self.push_pending(Pending {
                request: Request::Prepared(statement),
                params: params.by_ref().take(rows * columns).collect(),
                about: Some(about.clone()),
                batch: Vec::new(),
                orders: false,
            })
            .await?;
        }
        Ok(())
    }

    /// Prepares the multi-row INSERTs of every size a run of this shape can be sent in, together
    /// (one round trip instead of one per size).
    pub(super) async fn prepare_insert_sizes(
        &mut self,
        entry: &RelationEntry,
        shape: &Shape,
        limit: usize,
    ) -> Result<()> {
        let mut missing = Vec::new();
        let mut size = 1;
        while size <= limit {
            let mut sized = shape.clone();
            sized.rows = size;
            if !self.statements.contains_key(&sized) {
                missing.push(sized);
            }
            size *= 2;
        }
        // (Many tables written: each size as it is needed, see `prepare_sparingly`.)
        if missing.len() < 2 || self.prepare_sparingly() {
            return Ok(());
        }
        let prepared = futures_util::future::join_all(missing.iter().map(|sized| {
            let sql = build_sql(entry, sized);
            let client = self.client.clone();
            async move { client.prepare(&sql).await }
        }))
        .await;
        let mut failed = None;
        for (sized, result) in missing.into_iter().zip(prepared) {
            match result {
                Ok(statement) => {
                    self.remember_statement(sized, statement);
                }
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            None => self.check_prepared_types(entry).await,
            // A failed Parse aborts the open transaction: say why, not "transaction aborted".
            Some(e) => {
                let what = format!("a multi-row INSERT into table {}", entry.target.qualified);
                self.prepare_failed(&what, &entry.target.qualified, e).await
            }
        }
    }

    /// The conflict policies of a relation (looked up once per relation and policy reload).
    pub(super) fn policies_for(
        &mut self,
        entry: &RelationEntry,
    ) -> crate::apply::conflict::Policies {
        let key = (entry.source.oid, entry.generation);
        if let Some(p) = self.policy_cache.get(&key) {
            return *p;
        }
        let schema = if entry.source.namespace.is_empty() {
            "pg_catalog"
        } else {
            &entry.source.namespace
        };
        let policies = self.policies.for_table(schema, &entry.source.name);
        self.policy_cache.insert(key, policies);
        policies
    }

    /// Values that find the old row, and how to match them.
    pub(super) fn row_match(
        &self,
        entry: &RelationEntry,
        old: Option<&OldRow>,
        new: &Tuple,
        params: &mut Vec<WireValue>,
    ) -> Result<(RowMatch, Vec<Value>)> {
        match old {
            Some(OldRow::Full(tuple)) => {
                Self::check_width(entry, tuple)?;
                let values: Vec<Value> = tuple.values().collect();
                // PostgreSQL sends a FULL old row whole; one with nothing to match by would
                // find any row of the table.
                if !values.is_empty() && values.iter().all(|v| matches!(v, Value::UnchangedToast)) {
                    return Err(Error::definite(format!(
                        "the source sent the old row of a change to table {} (REPLICA IDENTITY FULL) with every value marked unchanged: there is nothing to find the row by; this is a protocol error",
                        entry.display_name()
                    )));
                }
                let mut nulls = ColumnSet::default();
                let mut skipped = ColumnSet::default();
                for (i, v) in values.iter().enumerate() {
                    match v {
                        Value::Null => nulls.insert(i),
                        Value::UnchangedToast => skipped.insert(i),
                        Value::Text(b) => params.push(WireValue::Text(b.clone())),
                        Value::Binary(b) => params.push(WireValue::Binary(b.clone())),
                    }
                }
                let as_text = self.full_as_text.contains(&entry.source.oid);
                Ok((
                    RowMatch::Full {
                        nulls,
                        skipped,
                        as_text,
                    },
                    values,
                ))
            }
            Some(OldRow::Key(tuple)) => {
                Self::check_width(entry, tuple)?;
                self.key_values(entry, tuple, params)
            }
            None => self.key_values(entry, new, params),
        }
    }

    pub(super) fn key_values(
        &self,
        entry: &RelationEntry,
        tuple: &Tuple,
        params: &mut Vec<WireValue>,
    ) -> Result<(RowMatch, Vec<Value>)> {
        if entry.key_columns.is_empty() {
            // (A transaction's changes keep the description they were decoded with: one made
            // before the fix can only be skipped.)
            let skip = match self.current.as_ref().map(|t| t.final_lsn) {
                Some(lsn) if lsn.is_valid() && lsn.0 != u64::MAX => format!(
                    " (source transaction committed at {lsn}); changes made before that fix keep the description they were made with: {}",
                    self.skip_hint(lsn)
                ),
                _ => String::new(),
            };
            return Err(Error::definite(format!(
                "table {} has no replica identity key on the source, so an UPDATE or DELETE cannot find its row on the target: give it a primary key or set REPLICA IDENTITY FULL (or USING INDEX) on the source (for a partitioned table published through its root, on the root as well as on its partitions: the root's identity describes their changes){skip}",
                entry.display_name()
            )));
        }
        let values: Vec<Value> = tuple.values().collect();
        for &k in &entry.key_columns {
            match values.get(k) {
                Some(Value::Text(b)) => params.push(WireValue::Text(b.clone())),
                Some(Value::Binary(b)) => params.push(WireValue::Binary(b.clone())),
                _ => {
                    return Err(Error::definite(format!(
                        "the source sent no value for key column {} of table {}; this is a protocol error",
                        quote_ident(&entry.source.columns[k].name),
                        entry.display_name()
                    )))
                }
            }
        }
        Ok((RowMatch::Key, values))
    }

    pub(super) async fn delete(&mut self, delete: Delete) -> Result<()> {
        let Some((xid, commit_lsn, commit_time)) = self.in_transaction("Delete")? else {
            return Ok(());
        };
        let entry = self.entry(delete.relation)?;
        if self.in_later_copy(&entry, commit_lsn) {
            return Ok(());
        }
        Self::check_binary(&entry, delete.old.tuple())?;
        self.before_change(&entry).await?;
        let mut params = Vec::new();
        let old = delete.old;
        let (row_match, old_values) =
            self.row_match(&entry, Some(&old), old.tuple(), &mut params)?;
        let triggers_may_skip = self.may_skip(&entry).await?.delete;
        let policy = self.policies_for(&entry).delete_missing;
        if row_match == RowMatch::Key
            && policy == Policy::Skip
            && !triggers_may_skip
            && self.batching_allowed(commit_lsn)
            && self.quiet_fingerprint(&entry).await?.is_some()
        {
            self.unsettled_rows.deletes += 1;
            let held = HeldChange {
                relation: entry.clone(),
                xid,
                commit_lsn,
                commit_time,
                change: Held::Delete(old_values),
            };
            return self.add_to_delete_run(&entry, params, held).await;
        }
        let shape = Shape {
            relation: entry.source.oid,
            generation: entry.generation,
            operation: Operation::Delete,
            unchanged: ColumnSet::default(),
            row_match: row_match.clone(),
            on_conflict: OnConflict::Plain,
            rows: 1,
            arbiter: ColumnSet::default(),
            lookup: Default::default(),
            triggers_may_skip,
        };
        self.unsettled_rows.deletes += 1;
        let about = ChangeInfo {
            relation: entry.clone(),
            operation: "DELETE",
            xid,
            commit_lsn,
            commit_time,
            key: Some((row_match, old_values)),
            remote: None,
            signal: Some(Signal {
                conflict: ConflictType::DeleteMissing,
                policy,
                when_rows: 0,
                incomplete_row: false,
                // (Whether the row was there, where a trigger may skip the delete.)
                answers_local_row: triggers_may_skip,
            }),
            through: None,
        };
        self.queue(&entry, shape, params, about).await
    }

    /// Adds a DELETE by key to the run of its table's consecutive deletes (`DeleteRun`): a
    /// bulk DELETE on the source arrives as one change per row, which one statement per row
    /// would apply several times slower than PostgreSQL's own subscriber. Any other statement
    /// queued sends the run first (`flush_insert_run`), so nothing passes it, and each row is
    /// deleted as its own statement would (every row with that key). Only tables with no
    /// enabled trigger (but foreign keys') and no rule qualify (`apply::batch::quiet`): a
    /// statement-level trigger would fire once, and a row trigger that skips a delete would
    /// make its row look missing; a row the statement does not find is then a row missing on
    /// the target, recorded as the conflict it is. The group checks that on the server.
    async fn add_to_delete_run(
        &mut self,
        entry: &Arc<RelationEntry>,
        params: Vec<WireValue>,
        held: HeldChange,
    ) -> Result<()> {
        let fits = self.delete_run.as_ref().is_some_and(|run| {
            run.entry.source.oid == entry.source.oid
                && run.entry.generation == entry.generation
                && run.entry.target.oid == entry.target.oid
        });
        if !fits {
            self.flush_insert_run().await?;
            self.delete_run = Some(DeleteRun {
                entry: entry.clone(),
                params: Vec::with_capacity(params.len() * 16),
                rows: Vec::with_capacity(16),
                limit: crate::apply::batch::row_limit(entry.key_columns.len()),
            });
        }
        let full = match &mut self.delete_run {
            Some(run) => {
                run.params.extend(params);
                run.rows.push(held);
                run.rows.len() >= run.limit
            }
            None => false,
        };
        if full {
            self.flush_delete_run().await?;
        }
        Ok(())
    }

    /// Queues the open run of deletes as statements of power-of-two sizes.
    pub(super) async fn flush_delete_run(&mut self) -> Result<()> {
        let Some(run) = self.delete_run.take() else {
            return Ok(());
        };
        if let Some(g) = &mut self.group {
            g.statements += run.rows.len();
        }
        if let Some(fingerprint) = self.quiet_fingerprint(&run.entry).await? {
            self.check_unchanged(&run.entry, fingerprint);
        }
        let per_row = run.entry.key_columns.len();
        let mut left = run.rows.len();
        let mut params = run.params.into_iter();
        let mut rows = run.rows.into_iter();
        while left > 0 {
            let mut size = run.limit;
            while size > left {
                size /= 2;
            }
            left -= size;
            let statement = self
                .batch_statement(
                    &run.entry,
                    Operation::DeleteBatch,
                    ColumnSet::default(),
                    size,
                )
                .await?;
            self.push_pending(Pending {
                request: Request::Prepared(statement),
                params: params.by_ref().take(size * per_row).collect(),
                about: None,
                batch: rows.by_ref().take(size).collect(),
                orders: false,
            })
            .await?;
        }
        Ok(())
    }

    /// A target table that receives the rows of several source tables cannot be truncated
    /// for one of them: its rows are not told apart there. So a TRUNCATE that leaves out one of
    /// the source tables mapped onto a target table stops the apply, saying what to do.
    fn refuse_partial_truncate(&mut self, relations: &[Oid], commit_lsn: Lsn) -> Result<()> {
        if self.shared_targets.is_empty() {
            return Ok(());
        }
        let mut truncated = HashSet::new();
        let mut targets = Vec::new();
        for oid in relations {
            let entry = self.entry(*oid)?;
            truncated.insert((
                crate::relation::source_schema(&entry.source).to_string(),
                entry.source.name.clone(),
            ));
            targets.push(entry);
        }
        for entry in targets {
            let Some(sources) = self.shared_targets.get(&entry.target.qualified) else {
                continue;
            };
            let others: Vec<String> = sources
                .iter()
                .filter(|s| !truncated.contains(*s))
                .map(|(schema, name)| crate::sql::qualified_name(schema, name))
                .collect();
            if others.is_empty() {
                continue;
            }
            return Err(Error::definite(format!(
                "source table {} was truncated, but target table {} also holds the rows of source table{} {} (mapped onto it under [tables] in the config file), which a TRUNCATE there would remove too: nothing of this transaction was applied. Delete the rows that came from {} on the target yourself (for a partition: the rows within its bounds on the source), then skip this transaction, which drops all of its changes (apply its other changes by hand, if it has any): {}",
                entry.display_name(),
                entry.target.qualified,
                if others.len() == 1 { "" } else { "s" },
                others.join(", "),
                entry.display_name(),
                self.skip_hint(commit_lsn),
            )));
        }
        Ok(())
    }

    pub(super) async fn truncate(&mut self, truncate: Truncate) -> Result<()> {
        let Some((xid, commit_lsn, commit_time)) = self.in_transaction("Truncate")? else {
            return Ok(());
        };
        let mut relations = Vec::with_capacity(truncate.relations.len());
        for oid in &truncate.relations {
            let entry = self.entry(*oid)?;
            if !self.in_later_copy(&entry, commit_lsn) {
                relations.push(*oid);
            }
        }
        if relations.is_empty() {
            return Ok(());
        }
        self.flush_held_updates(None).await?;
        let mut tables = Vec::new();
        let mut names = Vec::new();
        let mut first_entry = None;
        // (Each table once: the list comes from the network, and a repeated OID would only
        // make the statement longer.)
        let mut seen = std::collections::HashSet::new();
        for oid in &relations {
            if !seen.insert(*oid) {
                continue;
            }
            let entry = self.entry(*oid)?;
            tables.push(entry.target.qualified.clone());
            first_entry.get_or_insert_with(|| entry.clone());
            // Each table the source truncated is listed: an inheritance child too, if it was.
            names.push(format!(
                "{}{}",
                crate::apply::statement::only(&entry),
                entry.target.qualified
            ));
        }
        self.refuse_partial_truncate(&relations, commit_lsn)?;
        let mut sql = format!("TRUNCATE {}", names.join(", "));
        if truncate.restart_identity() {
            sql.push_str(" RESTART IDENTITY");
        }
        // CASCADE is not passed on: the message already lists every published table the
        // source's cascade reached, so on the target it could only reach tables the source never
        // truncated (target-only tables, or ones filled from elsewhere). PostgreSQL's own
        // subscriber does the same. A target foreign key from a table not listed then stops the
        // apply with what to do (`violation_error`).
        // A failed Parse (or one in a transaction an earlier statement failed): the reason
        // comes from `prepare_failed`, not "transaction aborted".
        let statement = match self.client.prepare(&sql).await {
            Ok(s) => s,
            Err(e) => {
                let what = format!("TRUNCATE of {}", tables.join(", "));
                let first = tables.first().cloned().unwrap_or_default();
                return self.prepare_failed(&what, &first, e).await;
            }
        };
        tracing::debug!(xid, commit_lsn = %commit_lsn, commit_time = %commit_time.to_rfc3339(), tables = %tables.join(", "), "truncate");
        self.unsettled_rows.truncates += 1;
        let about = first_entry.map(|relation| ChangeInfo {
            relation,
            operation: "TRUNCATE",
            xid,
            commit_lsn,
            commit_time,
            key: None,
            remote: None,
            signal: None,
            through: None,
        });
        self.push(Pending {
            request: Request::Prepared(statement),
            params: Vec::new(),
            about,
            batch: Vec::new(),
            orders: false,
        })
        .await
    }
}

/// An insert_exists policy on a table whose key on the target is DEFERRABLE: the INSERT .. ON
/// CONFLICT the policy needs cannot use it.
fn deferrable_arbiter_error(entry: &RelationEntry, policy: Policy) -> Error {
    Error::definite(format!(
        "conflict policy insert_exists = \"{}\" on table {}: the target table {} has no unique key that INSERT .. ON CONFLICT may use (the one over the replica identity's columns is DEFERRABLE, which ON CONFLICT refuses): on the target, drop that constraint and add it again without DEFERRABLE, or set insert_exists = \"error\" for this table ([tables.\"{}.{}\".conflicts])",
        policy.name(),
        entry.display_name(),
        entry.target.qualified,
        if entry.source.namespace.is_empty() {
            "pg_catalog"
        } else {
            &entry.source.namespace
        },
        entry.source.name
    ))
}
