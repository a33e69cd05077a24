//! Two-phase transactions (`--two-phase`): a source PREPARE becomes a PREPARE TRANSACTION on the
//! target, with the position it reached, and COMMIT / ROLLBACK PREPARED follow the source's.

use super::*;

impl Applier {
    /// The name of the target's prepared transaction for a source transaction.
    pub(super) fn gid(&self, xid: Xid) -> String {
        format!("pgapply_{}_{}", self.slot, xid)
    }

    /// The parameters of the `record` statement (`ProgressStore::record_sql`).
    pub(super) fn record_params(&self, end_lsn: Lsn, time: PgTimestamp) -> Vec<WireValue> {
        let mut params = vec![
            WireValue::Text(end_lsn.to_string().into()),
            WireValue::Text(time.to_rfc3339().into()),
        ];
        if let Some(origin) = self.progress.origin_name().filter(|_| self.commit_row) {
            params.push(WireValue::Text(origin.to_owned().into()));
        }
        params
    }

    pub(super) async fn prepared_exists(&self, gid: &str) -> Result<bool> {
        let row = self
            .catalog
            .query_one(
                // The view is the whole cluster's: another database's transaction is not ours.
                "SELECT EXISTS (SELECT 1 FROM pg_prepared_xacts WHERE gid = $1 AND database = current_database())",
                &[&gid],
            )
            .await
            .map_err(|e| Error::postgres("reading pg_prepared_xacts on the target", e))?;
        Ok(row.get(0))
    }

    /// Begin Prepare: a transaction of its own (never grouped), ended by PREPARE TRANSACTION.
    pub(super) async fn begin_prepare(
        &mut self,
        b: crate::protocol::pgoutput::BeginPrepare,
    ) -> Result<()> {
        self.commit_group_and_wait().await?;
        let gid = self.gid(b.xid);
        self.begin_at(
            Begin {
                final_lsn: b.prepare_lsn,
                commit_time: b.prepare_time,
                xid: b.xid,
            },
            false,
        )?;
        // Prepared before a restart: it survives on the target, so it is not applied again.
        if self.prepared_exists(&gid).await? {
            tracing::info!(gid = %gid, source_gid = %b.gid, "transaction already prepared on the target");
            if let Some(t) = &mut self.current {
                t.skip = true;
                // Applied: its COMMIT PREPARED commits it, so it is not recorded as skipped.
                t.skip_requested = false;
            }
            self.pending.clear();
            self.group = None;
            self.unsettled_rows = RowCounts::default();
        }
        Ok(())
    }

    pub(super) async fn prepare(&mut self, p: crate::protocol::pgoutput::Prepare) -> Result<()> {
        let Some(txn) = self.current.take() else {
            return Err(Error::definite(format!(
                "the source sent Prepare {} without Begin Prepare; this is a protocol error",
                p.gid
            )));
        };
        if txn.skip_requested {
            self.skip_lsn = None;
            self.record_requested_skip(&txn, p.end_lsn, p.prepare_time);
            return Ok(());
        }
        if txn.skip {
            return Ok(());
        }
        self.prepare_group(p.xid, p.end_lsn, p.prepare_time).await
    }

    pub(super) async fn stream_prepare(
        &mut self,
        p: crate::protocol::pgoutput::Prepare,
    ) -> Result<()> {
        self.commit_group_and_wait().await?;
        let gid = self.gid(p.xid);
        let already = self.prepared_exists(&gid).await?;
        self.begin_at(
            Begin {
                final_lsn: p.prepare_lsn,
                commit_time: p.prepare_time,
                xid: p.xid,
            },
            false,
        )?;
        if let Some(txn) = self.current.take_if(|t| t.skip_requested && !already) {
            self.spool.discard(p.xid);
            self.skip_lsn = None;
            self.record_requested_skip(&txn, p.end_lsn, p.prepare_time);
            return Ok(());
        }
        let skip = already || self.current.as_ref().is_some_and(|t| t.skip);
        if skip {
            self.spool.discard(p.xid);
            self.current = None;
            self.pending.clear();
            self.group = None;
            return Ok(());
        }
        self.replay_spool(p.xid).await?;
        self.current = None;
        self.prepare_group(p.xid, p.end_lsn, p.prepare_time).await
    }

    /// Ends the open group with PREPARE TRANSACTION instead of COMMIT.
    pub(super) async fn prepare_group(
        &mut self,
        xid: Xid,
        end_lsn: Lsn,
        time: PgTimestamp,
    ) -> Result<()> {
        self.flush_held_updates(None).await?;
        self.flush_insert_run().await?;
        let gid = self.gid(xid);
        let record = self.record_params(end_lsn, time);
        let table_mode = self.progress.is_table_mode();
        if !table_mode {
            // (Deferred checks first: see `commit_group`.)
            self.pending.push(Pending::plain(self.immediate.clone()));
            // The origin position goes into the PREPARE record itself (noted here, set with
            // the PREPARE).
            self.pending
                .push(Pending::with_params(self.record.clone(), record.to_vec()));
        }
        self.send_pipeline().await?;
        // Everything before was answered: what is left was met by this transaction.
        let conflicts = std::mem::take(&mut self.conflicts);
        if !conflicts.is_empty() {
            self.prepared_conflicts.insert(xid, conflicts);
        }
        if failpoint::armed(failpoint::EXIT_BEFORE_COMMIT) {
            failpoint::exit(failpoint::EXIT_BEFORE_COMMIT);
        }
        let prepare = format!("PREPARE TRANSACTION {}", crate::sql::quote_literal(&gid));
        let prepare = if table_mode {
            prepare
        } else {
            // The origin position is set in the same message (see `origin_commit_sql`).
            ProgressStore::origin_commit_sql(&prepare)
        };
        if let Err(e) = self.client.batch_execute(&prepare).await {
            // Only an error the server sent says the PREPARE did not happen (as for a COMMIT).
            let refused = e.as_db_error().is_some();
            let taken = e.code().is_some_and(|c| c.code() == "42710");
            let mut err = Error::postgres(format!("preparing transaction {gid} on the target"), e);
            // Prepared transactions' names are the whole cluster's: another database's worker
            // of a slot with the same name, from a source where the same xid was used.
            if taken {
                err = err.context_after(format!(
                    "a prepared transaction of that name exists in the target cluster already: another database's pgapply with a slot named {:?} (names of prepared transactions are shared by all databases of a cluster) — give one of them another --slot; this one goes on once that transaction is committed or rolled back (pg_prepared_xacts lists it)",
                    self.slot
                ));
            }
            return Err(if refused {
                self.with_origin_rewound(err).await
            } else {
                err
            });
        }
        if table_mode {
            // Not inside the prepared transaction: its row lock would be held until COMMIT
            // PREPARED and block every later transaction.
            let record_sql = self.record.clone();
            let failed = |e| Error::postgres("recording the position on the target", e);
            self.client.batch_execute("BEGIN").await.map_err(failed)?;
            self.client
                .execute(&record_sql, &[&record[0], &record[1]])
                .await
                .map_err(failed)?;
            self.client.batch_execute("COMMIT").await.map_err(failed)?;
        }
        self.group = None;
        let rows = std::mem::take(&mut self.unsettled_rows);
        self.prepared_rows.insert(xid, rows);
        // Its rows are counted when it commits (a ROLLBACK PREPARED applies none of them; one
        // prepared before a restart is not counted). Its conflicts are said and counted once
        // prepared (a restart before COMMIT PREPARED finds the transaction prepared, not its
        // conflicts), and written to pgapply.conflicts when it commits.
        if let Some(conflicts) = self.prepared_conflicts.remove(&xid) {
            self.announce_conflicts(&conflicts);
            self.prepared_conflicts.insert(xid, conflicts);
        }
        tracing::debug!(gid = %gid, %end_lsn, "prepared");
        self.advance_applied(end_lsn);
        Ok(())
    }

    /// A transaction of its own that records `lsn` as applied: in origin mode its commit record
    /// carries the position; in table mode it writes the progress row.
    async fn origin_position_transaction(&self, lsn: &str, at: &str) -> Result<()> {
        if !matches!(
            self.progress.mode,
            crate::apply::progress::ProgressMode::Origin { .. }
        ) {
            let context = |e| Error::postgres("recording the position on the target", e);
            self.client.batch_execute("BEGIN").await.map_err(context)?;
            let recorded = self
                .client
                .execute(
                    &self.record,
                    &[
                        &WireValue::Text(lsn.to_owned().into()),
                        &WireValue::Text(at.to_owned().into()),
                    ],
                )
                .await;
            if let Err(e) = recorded {
                let _ = self.client.batch_execute("ROLLBACK").await;
                return Err(context(e));
            }
            return self.client.batch_execute("COMMIT").await.map_err(context);
        }
        self.client
            .batch_execute(&format!(
                "BEGIN; SELECT pg_catalog.pg_replication_origin_xact_setup({}::pg_lsn, {}::timestamptz), pg_catalog.txid_current(); COMMIT",
                crate::sql::quote_literal(lsn),
                crate::sql::quote_literal(at)
            ))
            .await
            .map_err(|e| Error::postgres("recording the position on the target", e))
    }

    /// COMMIT PREPARED or ROLLBACK PREPARED, recording the position.
    pub(super) async fn finish_prepared(
        &mut self,
        xid: Xid,
        source_gid: &str,
        end_lsn: Lsn,
        time: PgTimestamp,
        commit: bool,
    ) -> Result<()> {
        self.commit_group_and_wait().await?;
        let gid = self.gid(xid);
        let verb = if commit {
            "COMMIT PREPARED"
        } else {
            "ROLLBACK PREPARED"
        };
        let lsn = end_lsn.to_string();
        let at = time.to_rfc3339();
        if !self.prepared_exists(&gid).await? {
            if !(self.resume.is_valid() && end_lsn <= self.resume) {
                tracing::warn!(gid = %gid, source_gid, "{verb}: the transaction is not prepared on the target: finished before a restart, or skipped on request (`pgapply skip`)");
            }
            // (A ROLLBACK PREPARED whose origin position a crash kept from being written.)
            let seen_before = self.resume.is_valid() && end_lsn <= self.resume;
            if !commit && !seen_before {
                self.origin_position_transaction(&lsn, &at).await?;
            }
            // Finished before: nothing more to wait for at this position.
            self.advance_applied(end_lsn);
            return Ok(());
        }
        let finish = format!("{verb} {}", crate::sql::quote_literal(&gid));
        match &self.progress.mode {
            // The session's origin position is taken by the COMMIT/ROLLBACK PREPARED record.
            crate::apply::progress::ProgressMode::Origin { .. } => {
                // Only the session's origin position is set here (no transaction id, so no
                // commit record of its own): the COMMIT/ROLLBACK PREPARED record takes it.
                self.client
                    .execute(
                        "SELECT pg_catalog.pg_replication_origin_xact_setup($1::pg_lsn, $2::timestamptz)",
                        &[
                            &WireValue::Text(lsn.clone().into()),
                            &WireValue::Text(at.clone().into()),
                        ],
                    )
                    .await
                    .map_err(|e| Error::postgres("recording the position on the target", e))?;
                if let Err(e) = self.client.batch_execute(&finish).await {
                    // The position stays set in the session: cleared, or the session's next
                    // commit would carry it and count this transaction as finished.
                    let _ = self
                        .client
                        .batch_execute("SELECT pg_catalog.pg_replication_origin_xact_reset()")
                        .await;
                    return Err(Error::postgres(format!("{verb} {gid} on the target"), e));
                }
                // Before PostgreSQL 14 an abort record carries no origin position, so a
                // ROLLBACK PREPARED leaves the origin where it was, and the slot would wait for
                // the next commit to move: a transaction of its own carries the position then.
                // (Harmless where the rollback carried it: the same position again.)
                if !commit {
                    self.origin_position_transaction(&lsn, &at).await?;
                }
            }
            crate::apply::progress::ProgressMode::Table => {
                self.client
                    .batch_execute(&finish)
                    .await
                    .map_err(|e| Error::postgres(format!("{verb} {gid} on the target"), e))?;
                self.client
                    .batch_execute("BEGIN")
                    .await
                    .map_err(|e| Error::postgres("recording the position on the target", e))?;
                self.client
                    .execute(
                        &self.record,
                        &[&WireValue::Text(lsn.into()), &WireValue::Text(at.into())],
                    )
                    .await
                    .map_err(|e| Error::postgres("recording the position on the target", e))?;
                self.client
                    .batch_execute("COMMIT")
                    .await
                    .map_err(|e| Error::postgres("recording the position on the target", e))?;
            }
        }
        tracing::debug!(gid = %gid, %end_lsn, "{verb}");
        if let Some(conflicts) = self.prepared_conflicts.remove(&xid) {
            if commit {
                self.write_conflicts(conflicts).await;
            }
        }
        let rows = self.prepared_rows.remove(&xid);
        if commit {
            self.stats.transactions += 1;
            METRICS.transactions.inc();
            // (Prepared before a restart: not counted, as its rows are not known here.)
            if let Some(rows) = rows {
                rows.settle(&mut self.stats);
            }
        }
        METRICS.applied_lsn.set(end_lsn.0);
        // (The applied position's own commit time, for `status` and the lag: the one of the
        // COMMIT or ROLLBACK PREPARED, not of the last transaction committed before it.)
        METRICS.last_commit_time.set(time.0.max(0) as u64);
        self.advance_applied(end_lsn);
        Ok(())
    }
}
