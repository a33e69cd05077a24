//! Ending a group: COMMIT with the position reached (without waiting for the previous group's
//! answer), commits in source order among parallel workers, and ROLLBACK with the origin moved back.

use super::*;

impl Applier {
    /// Sends every queued statement, waits for every result and checks them.
    pub(super) async fn send_pipeline(&mut self) -> Result<()> {
        self.flush_held_updates(None).await?;
        self.flush_insert_run().await?;
        self.submit_pending();
        self.drain_to(0).await;
        self.fail_if_failed().await?;
        self.settle_committed().await;
        Ok(())
    }

    /// Moves the session's origin back to the last position known committed, after a
    /// transaction that had its position set failed to commit: PostgreSQL 16+ advances the
    /// origin on abort too, and the next run would skip that transaction. (Before 16 the origin
    /// is already there: nothing moves.) The session may be busy with statements sent after
    /// the failure: a short wait, then a warning.
    ///
    /// Returns what the user must do when it could not: the next run, retried or not, would
    /// skip the transactions that failed.
    pub(super) async fn rewind_origin(&mut self) -> Option<String> {
        let name = self.progress.origin_name().map(str::to_owned)?;
        // Groups answered as committed but not settled yet count too: moved back past them,
        // the origin would have the next run apply them twice.
        let to = self
            .committed
            .iter()
            .map(|c| c.end_lsn)
            .fold(self.resume, Lsn::max);
        let text = to.to_string();
        // PostgreSQL moves an origin only while no session has it bound, this one included;
        // unbinding also clears the failed group's position, which stays set in the session
        // after its transaction ended, so that no later abort moves the origin to it again.
        let client = &self.client;
        let rewind = async {
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_session_reset()",
                    &[],
                )
                .await?;
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_advance($1, $2::text::pg_lsn)",
                    &[&name, &text],
                )
                .await?;
            client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_session_setup($1)",
                    &[&name],
                )
                .await
        };
        let why = match tokio::time::timeout(Duration::from_secs(10), rewind).await {
            Ok(Ok(_)) => {
                tracing::debug!(origin = %name, %to, "moved the origin back after a failed commit");
                return None;
            }
            Ok(Err(e)) => describe_postgres(&e),
            Err(_) => "no answer in 10 s".to_owned(),
        };
        Some(rewind_advice(&name, to, &why))
    }

    /// A failure that moved the origin: moved back, or, if that failed, the error says what to
    /// do and is not retried by itself.
    pub(super) async fn with_origin_rewound(&mut self, e: Error) -> Error {
        match self.rewind_origin().await {
            None => e,
            // The origin's row in pgapply.origin_commit holds the last commit: the next start
            // moves the origin back to it (`ProgressStore::open`), retried or not.
            Some(_) if self.commit_row => {
                tracing::warn!("the origin could not be moved back after the failed commit; the next start moves it back to its last commit");
                e
            }
            Some(advice) => e.context_after(advice).needing_a_person(),
        }
    }

    /// After a failed statement the transaction is aborted on the server: end it, forget the
    /// group, and report the first failure.
    pub(super) async fn fail_if_failed(&mut self) -> Result<()> {
        if self.failure.is_none() {
            return Ok(());
        }
        let rewind = std::mem::take(&mut self.origin_rewind) && self.worker.is_none();
        if rewind && failpoint::armed(failpoint::FAIL_COMMIT_THEN_EXIT) {
            failpoint::exit(failpoint::FAIL_COMMIT_THEN_EXIT);
        }
        // Answers come in order: a COMMIT not yet answered comes after the failed statement, so
        // its group did not commit (PostgreSQL answers it with a rollback). Forget those groups
        // before draining, so that their answers cannot count them as committed.
        self.committing.clear();
        if self.worker.is_some() {
            // A parallel worker stops at once: statements after the failure may be waiting on
            // the server for transactions that will not commit now, and dropping the connection
            // ends them. Positions are in the origins; nothing after the failure committed.
            // (An origin that an abort moved is moved back when the run starts again, to the
            // worker's row in pgapply.origin_commit: `ProgressStore::open`.) Groups answered as
            // committed before it are counted and their conflicts recorded first.
            if let Some(e) = self.failure.take() {
                self.settle_committed().await;
                return Err(self.unless_table_changed(e).await);
            }
        }
        match self.failure.take() {
            Some(e) => {
                self.drain_to(0).await;
                self.failure = None;
                self.group = None;
                self.current = None;
                self.conflicts.clear();
                self.skip_records.clear();
                self.pending.clear();
                self.pending_weight = 0;
                self.insert_run = None;
                self.delete_run = None;
                self.held_updates.clear();
                self.held_rows = 0;
                self.unsettled_rows = RowCounts::default();
                // COMMITs answered before the failure stand (settled below).
                let _ = self.client.batch_execute("ROLLBACK").await;
                // Last, outside any transaction: the ROLLBACK of a later group moves the origin
                // too (PostgreSQL 16+).
                let e = if rewind {
                    self.with_origin_rewound(e).await
                } else {
                    e
                };
                let e = self.unless_table_changed(e).await;
                self.settle_committed().await;
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// A value the target refused, in a table changed on the target since pgapply read it (the
    /// user fixing the column while pgapply ran): the error names the type as it was read, and
    /// the fix is in already, so the run starts again with the table read anew.
    async fn unless_table_changed(&mut self, e: Error) -> Error {
        let Some(entry) = self.refused_in.take() else {
            return e;
        };
        if e.is_transient() {
            return e;
        }
        match crate::relation::target_changed(&self.catalog, &entry).await {
            Ok(Some(change)) => Error::transient(format!(
                "{}; but target table {} changed since pgapply read it ({change}): starting again, with the table read anew",
                e.message(),
                entry.target.qualified
            )),
            _ => e,
        }
    }

    /// Records the position and commits the group's target transaction.
    pub(super) async fn commit_group(&mut self) -> Result<()> {
        self.note_tables_written().await;
        self.flush_held_updates(None).await?;
        self.flush_insert_run().await?;
        if self.group.as_ref().is_some_and(|g| g.check_before_commit) {
            // A row count decides whether this group may commit at all.
            self.send_pipeline().await?;
        }
        let Some(group) = self.group.take() else {
            return Ok(());
        };
        match group.turn {
            // A parallel worker's transaction: the server orders the commit (`apply::parallel`).
            Some(turn) => self.wait_for_turn(&turn),
            // This group may commit only once the previous one has: if that failed, this one
            // must not commit without it.
            None => self.chain_commit().await?,
        }
        let Some((end_lsn, commit_time)) = group.last_commit else {
            // Only skipped transactions: nothing to commit but the empty BEGIN.
            self.pending.push(Pending::plain(self.commit.clone()));
            return self.send_pipeline().await;
        };
        for (xid, lsn, time) in std::mem::take(&mut self.skip_records) {
            let clear = match self
                .client
                .prepare(
                    // (Only this request: `pgapply skip` may have asked for another since.)
                    "WITH cleared AS (UPDATE pgapply.progress SET skip_lsn = NULL WHERE slot_name = $1 AND skip_lsn = $3::text::pg_lsn) \
                     INSERT INTO pgapply.conflicts (slot_name, conflict_type, key, source_lsn, source_commit_time, policy) \
                     VALUES ($1, 'skipped_transaction', $2, $3::text::pg_lsn, $4::text::timestamptz, 'skip')",
                )
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    return self
                        .prepare_failed("the record of a skipped transaction", "pgapply.conflicts", e)
                        .await
                }
            };
            self.pending.push(Pending::with_params(
                clear,
                vec![
                    WireValue::Text(self.slot.clone().into()),
                    WireValue::Text(format!("xid {xid}").into()),
                    WireValue::Text(lsn.to_string().into()),
                    WireValue::Text(time.to_rfc3339().into()),
                ],
            ));
        }
        // One statement: no stop position `pgapply cutover` set at or before this group's last
        // source commit, and the tables it relied on as they were read (migration 0012). (By now
        // the group's own statements hold those tables, so they cannot change before it ends.)
        if group.last_transaction.is_some() || !group.relied_on.is_empty() {
            let commit_lsn = group.last_transaction.map(|(_, lsn)| lsn.to_string());
            let (oids, fingerprints): (Vec<String>, Vec<&str>) = group
                .relied_on
                .iter()
                .map(|(oid, f)| (oid.to_string(), &**f))
                .unzip();
            self.pending.push(Pending::with_params(
                self.check_group.clone(),
                vec![
                    WireValue::Text(self.slot.clone().into()),
                    match commit_lsn {
                        Some(lsn) => WireValue::Text(lsn.into()),
                        None => WireValue::Null,
                    },
                    WireValue::Text(oids.join(",").into()),
                    WireValue::Text(fingerprints.join("\n").into()),
                ],
            ));
        }
        // Deferred constraints and triggers are checked before the origin position is set, not
        // at COMMIT: PostgreSQL 16+ moves a session's origin on abort as well as on commit, so
        // a transaction that fails after the position is set would count as applied.
        let immediate_seq = (!self.progress.is_table_mode()).then(|| {
            self.pending.push(Pending::plain(self.immediate.clone()));
            self.submitted + self.pending.len() as u64
        });
        let record = self.record_params(end_lsn, commit_time);
        self.pending
            .push(Pending::with_params(self.record.clone(), record));
        if failpoint::armed(failpoint::EXIT_BEFORE_COMMIT) {
            self.submit_pending();
            self.drain_to(0).await;
            failpoint::exit(failpoint::EXIT_BEFORE_COMMIT);
        }
        let commit = match &self.origin_commit {
            _ if self.worker.as_ref().is_none_or(|w| w.index == 1)
                && failpoint::fail_commit_once() =>
            {
                Pending::simple(ProgressStore::origin_commit_sql(failpoint::FAILING_COMMIT).into())
            }
            Some(sql) => Pending::simple(sql.clone()),
            None => Pending::plain(self.commit.clone()),
        };
        self.pending.push(commit);
        // The COMMIT goes out without waiting for its answer: the next group is built (and
        // sent) meanwhile. The group counts as applied once the answer is in. (Noted before
        // sending: the answer may be taken while sending.)
        self.committing.push_back(Committing {
            seq: self.submitted + self.pending.len() as u64,
            end_lsn,
            commit_time,
            transactions: group.transactions,
            last_transaction: group.last_transaction,
            immediate_seq,
            started: group.started,
            conflicts: GroupConflicts::default(),
            rows: std::mem::take(&mut self.unsettled_rows),
        });
        self.submit_pending();
        self.bound_in_flight().await;
        // Answers taken while sending may have settled it already (or found a failure).
        self.fail_if_failed().await?;
        self.settle_committed().await;
        Ok(())
    }

    /// Queues what makes a parallel worker's transaction commit after its predecessor, and only
    /// if that committed: on this connection, a look at its own origin; on another worker, a wait
    /// on the server (`pgapply.wait_for_commit`) for the predecessor's commit.
    pub(super) fn wait_for_turn(&mut self, turn: &Turn) {
        let Some(after) = turn.after else {
            return;
        };
        let (Some(worker), Some(statements)) = (&self.worker, &self.turn_statements) else {
            return;
        };
        // On this connection the predecessor has ended: the wait only checks that it committed
        // (timeout 0), and fails this transaction on the server if not, so its COMMIT can not
        // follow. (A row count checked in the client would come too late: the COMMIT is already
        // on its way.)
        let timeout_ms = if after.worker == worker.index {
            0
        } else {
            WAIT_FOR_COMMIT_MS
        };
        let pending = Pending {
            request: Request::Prepared(statements.wait.clone()),
            params: wait_params(worker, &after, timeout_ms),
            about: None,
            batch: Vec::new(),
            orders: true,
        };
        self.pending.push(pending);
    }

    /// Makes the open group commit only if the previous one did. With the origin's row
    /// (`commit_row`) the server checks it, in this group, after the previous COMMIT ran: the
    /// group goes out without waiting for that COMMIT's answer, which a far target would
    /// otherwise make a round trip per group (measured with 1 ms each way: most of the time
    /// lost to the delay). If the previous COMMIT failed, this group fails with it (and is
    /// rolled back: its own COMMIT then ends an aborted transaction), and the earlier failure is
    /// the one reported. Otherwise the client waits for the answer.
    pub(super) async fn chain_commit(&mut self) -> Result<()> {
        let previous = self.committing.back().map(|c| c.end_lsn);
        let origin = self.progress.origin_name().map(str::to_owned);
        match (previous, &self.check_committed, origin) {
            (Some(end_lsn), Some(check), Some(origin)) => {
                tracing::debug!(previous_end_lsn = %end_lsn, "group sent before the previous COMMIT is answered; the target checks that one committed");
                self.pending.push(Pending::with_params(
                    check.clone(),
                    vec![
                        WireValue::Text(origin.into()),
                        WireValue::Text(end_lsn.to_string().into()),
                    ],
                ));
                Ok(())
            }
            _ => self.wait_for_commits().await,
        }
    }

    /// Waits until every COMMIT sent has been answered; fails if one did not succeed.
    pub(super) async fn wait_for_commits(&mut self) -> Result<()> {
        while let Some(seq) = self.committing.back().map(|c| c.seq) {
            if self.completed >= seq || self.worker_failed() {
                break;
            }
            match self.in_flight_mut().next().await {
                Some(outcome) => self.check_outcome(outcome),
                None => break,
            }
        }
        self.fail_if_failed().await?;
        self.settle_committed().await;
        Ok(())
    }

    /// Commits the open group and waits for the answer (before two-phase steps, which run
    /// outside the pipeline).
    pub(super) async fn commit_group_and_wait(&mut self) -> Result<()> {
        self.commit_group().await?;
        self.wait_for_commits().await
    }

    /// The bookkeeping of groups whose COMMIT succeeded: counters, the applied position, and
    /// their conflict records.
    pub(super) async fn settle_committed(&mut self) {
        for c in std::mem::take(&mut self.committed) {
            if !c.conflicts.is_empty() {
                self.record_conflicts(c.conflicts).await;
            }
            self.stats.transactions += c.transactions;
            c.rows.settle(&mut self.stats);
            let m = &*METRICS;
            m.transactions.add(c.transactions);
            // Parallel workers settle in any order; the position only moves forward.
            m.applied_lsn.set_max(c.end_lsn.0);
            m.last_commit_time.set(c.commit_time.0.max(0) as u64);
            m.apply_latency.observe(c.started.elapsed());
            self.advance_applied(c.end_lsn);
        }
    }

    /// Moves the applied position forward (never back).
    pub(super) fn advance_applied(&mut self, lsn: Lsn) {
        // (Also what the lag in seconds counts from: a prepared transaction is applied too.)
        METRICS.applied_lsn.set_max(lsn.0);
        self.applied.send_if_modified(|a| {
            let advanced = lsn > *a;
            *a = (*a).max(lsn);
            advanced
        });
        self.resume = self.resume.max(lsn);
    }

    pub(super) async fn rollback(&mut self) -> Result<()> {
        // Earlier groups' answers first: their conflicts are theirs to record.
        self.drain_to(0).await;
        let mut earlier_failed = None;
        if let Some(e) = self.failure.take() {
            if self.committing.is_empty() {
                // Whatever failed is rolled back with the rest and applied again after a restart.
                tracing::debug!(error = %e, "a statement of the abandoned target transaction failed");
            } else {
                // An earlier group's COMMIT failed: it was not applied, and this run must not end
                // as if it had been.
                earlier_failed = Some(e);
            }
            self.committing.clear();
        }
        self.pending.clear();
        self.insert_run = None;
        self.delete_run = None;
        self.held_updates.clear();
        self.held_rows = 0;
        self.unsettled_rows = RowCounts::default();
        self.conflicts.clear();
        self.skip_records.clear();
        if self.group.take().is_some() {
            if let Err(e) = self.client.batch_execute("ROLLBACK").await {
                tracing::warn!(error = %describe_postgres(&e), "rolling back the open target transaction failed");
            }
        }
        self.current = None;
        let rewind = std::mem::take(&mut self.origin_rewind);
        match earlier_failed {
            Some(e) if rewind => Err(self.with_origin_rewound(e).await),
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// What to do when an origin could not be moved back after a failed commit.
pub(super) fn rewind_advice(origin: &str, to: Lsn, why: &str) -> String {
    let origin = crate::sql::quote_literal(origin);
    format!(
        "the target's replication origin {origin} could not be moved back to {to} after the failed commit ({why}): before starting pgapply again, run SELECT pg_replication_origin_advance({origin}, '{to}') on the target, or the next run skips the transactions that failed"
    )
}

/// Parameters of `pgapply.wait_for_commit` for an earlier transaction.
pub(super) fn wait_params(worker: &WorkerRole, after: &After, timeout_ms: u32) -> Vec<WireValue> {
    let mut params = turn_lock_params(worker.lock_key, after.seq);
    params.push(WireValue::Text(
        worker
            .origins
            .get(after.worker)
            .cloned()
            .unwrap_or_default()
            .into(),
    ));
    params.push(WireValue::Text(after.end_lsn.to_string().into()));
    params.push(WireValue::Text(timeout_ms.to_string().into()));
    params
}

/// How long a worker waits on the server for another worker's transaction that has not begun
/// (one that began is waited for as long as it runs) before it gives up, and the run restarts.
/// Long: that transaction's worker may be held up by a user's lock on the target on an earlier
/// one, which pgapply waits for (a minute was too short for that, and each restart waited anew).
pub(super) const WAIT_FOR_COMMIT_MS: u32 = 600_000;

/// Parameters of a turn lock: the slot's key and the turn's.
pub(super) fn turn_lock_params(lock_key: i32, seq: u64) -> Vec<WireValue> {
    vec![
        WireValue::Text(lock_key.to_string().into()),
        WireValue::Text(crate::apply::parallel::turn_key(seq).to_string().into()),
    ]
}
