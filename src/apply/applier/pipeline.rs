//! The pipeline to the target: statements prepared once and kept per session, queued with their
//! parameters, sent in chunks without waiting, and their answers taken in order.

use super::*;

/// How a columns fingerprint starts (`TargetTable::columns_fingerprint`), telling it from a
/// batching one in `pgapply.check_group`.
pub(super) const COLUMNS_MARK: &str = "c|";

impl Applier {
    pub(super) async fn queue(
        &mut self,
        entry: &Arc<RelationEntry>,
        shape: Shape,
        params: Vec<WireValue>,
        about: ChangeInfo,
    ) -> Result<()> {
        let statement = self.statement(entry, shape).await?;
        if about.signal.is_some_and(|s| s.policy == Policy::Error) {
            if let Some(g) = &mut self.group {
                g.check_before_commit = true;
            }
        }
        self.push(Pending {
            request: Request::Prepared(statement),
            params,
            about: Some(about),
            batch: Vec::new(),
            orders: false,
        })
        .await
    }

    pub(super) async fn push(&mut self, pending: Pending) -> Result<()> {
        self.flush_insert_run().await?;
        if let Some(g) = &mut self.group {
            g.statements += 1;
        }
        self.push_pending(pending).await
    }

    /// Queues a statement, handing the queue to the connection when it is long enough.
    pub(super) async fn push_pending(&mut self, pending: Pending) -> Result<()> {
        self.pending_weight += values_weight(&pending.params);
        self.pending.push(pending);
        // (By weight too: 64 statements of large values would be sent, and held twice over,
        // all at once.)
        if self.pending.len() >= SUBMIT_CHUNK
            || self.pending_weight >= self.settings.pipeline_values / 4
        {
            self.submit_pending();
            self.bound_in_flight().await;
            self.fail_if_failed().await?;
        }
        Ok(())
    }

    /// Waits for answers while too much is in flight: by parameter values (the statements'
    /// size; each KiB of a value counted as one value more, so that large values stay within
    /// about 20 MB in flight), and by statements, as each costs memory whatever it carries. (Messages leave the
    /// reader's byte-bounded queue once they are statements: without this, a target slower than
    /// the source would let the statements of tens of thousands of small transactions, sent but
    /// unanswered, grow without bound, as a parallel worker's BEGIN and COMMIT carry no values.)
    /// Everything queued is sent before waiting, so a parallel worker never waits for an answer
    /// that depends on a statement of its own still unsent.
    pub(super) async fn bound_in_flight(&mut self) {
        if self.in_flight_values >= self.settings.pipeline_values {
            self.drain_values_to(self.settings.pipeline_values / 2)
                .await;
        }
        if self.in_flight_mut().len() >= MAX_IN_FLIGHT {
            self.drain_to(MAX_IN_FLIGHT / 2).await;
        }
    }

    /// Keeps a prepared statement for its shape (see `StatementCache`).
    pub(super) fn remember_statement(&mut self, shape: Shape, statement: Statement) {
        self.statements.insert(shape, statement);
    }

    /// Whether to prepare only the statement needed now, not every batch size of its table at
    /// once: with the cache a quarter full (hundreds of tables written), eight sizes per table
    /// would fill it and push out statements still in use.
    pub(super) fn prepare_sparingly(&self) -> bool {
        self.statements.len() >= max_statements() / 4
    }

    /// The prepared statement for a shape, preparing it the first time.
    pub(super) async fn statement(
        &mut self,
        entry: &RelationEntry,
        mut shape: Shape,
    ) -> Result<Statement> {
        self.check_columns(entry);
        if let Some(s) = self.statements.get(&shape) {
            return Ok(s.clone());
        }
        let sql = build_sql(entry, &shape);
        let statement = match self.client.prepare(&sql).await {
            Ok(s) => s,
            // A type without an equality operator under REPLICA IDENTITY FULL: compare as text.
            Err(e)
                if e.code().is_some_and(|c| c.code() == "42883")
                    && matches!(shape.row_match, RowMatch::Full { as_text: false, .. }) =>
            {
                tracing::info!(table = %entry.target.qualified, "a column type has no equality operator; matching REPLICA IDENTITY FULL rows by their text form");
                self.full_as_text.insert(entry.source.oid);
                if let Ok(mut known) = FULL_AS_TEXT.lock() {
                    known.insert(entry.source.oid);
                }
                if let RowMatch::Full { as_text, .. } = &mut shape.row_match {
                    *as_text = true;
                }
                let sql = build_sql(entry, &shape);
                match self.client.prepare(&sql).await {
                    Ok(s) => s,
                    // The group's transaction was open on the target, and the failed statement
                    // aborted it: the run starts again (FULL_AS_TEXT keeps what was learnt).
                    Err(e) if e.code().is_some_and(|c| c.code() == "25P02") => {
                        return Err(Error::planned_restart(format!(
                            "table {}: a column type has no equality operator, which aborted the open target transaction; applying again, comparing REPLICA IDENTITY FULL rows by their text form",
                            entry.target.qualified
                        )));
                    }
                    Err(e) => {
                        return Err(Error::postgres(
                            format!(
                                "preparing a statement for table {} on the target",
                                entry.target.qualified
                            ),
                            e,
                        ))
                    }
                }
            }
            Err(e) => {
                let what = format!("a statement for table {}", entry.target.qualified);
                return self.prepare_failed(&what, &entry.target.qualified, e).await;
            }
        };
        self.check_prepared_types(entry).await?;
        self.remember_statement(shape, statement.clone());
        Ok(statement)
    }

    /// Has the group check, before it commits, that the target table's columns are still those
    /// `entry` read (`pgapply.check_group`, migration 0019): the statements' parameters took their
    /// types, and a column changed under a prepared statement takes values through an
    /// assignment cast (numeric into integer rounds) where a fresh start would refuse them.
    /// Read with the table, before any statement was prepared: a change in between fails the
    /// check instead of slipping through. (Once per table and group: a short scan.)
    pub(super) fn check_columns(&mut self, entry: &RelationEntry) {
        let Some(group) = &mut self.group else {
            return;
        };
        let oid = entry.target.oid;
        if group
            .relied_on
            .iter()
            .any(|(o, f)| *o == oid && f.starts_with(COLUMNS_MARK))
        {
            return;
        }
        group
            .relied_on
            .push((oid, Arc::from(entry.target.columns_fingerprint())));
    }

    /// After preparing statements for `entry`: their parameters took the target's column types as
    /// they are now, while binary values (`--binary`) come in the types the run started with.
    /// A column whose type changed since would have the source's bytes read as the new type, so
    /// the run starts again and reads the table anew (and receives text where types differ). (A
    /// column changed after the prepare fails the group's check: see `statement`.)
    pub(super) async fn check_prepared_types(&self, entry: &RelationEntry) -> Result<()> {
        if !self.binary_values {
            return Ok(());
        }
        match crate::relation::target_changed(&self.catalog, entry).await? {
            None => Ok(()),
            Some(change) => Err(Error::transient(format!(
                "target table {} changed while pgapply ran ({change}), and values arrive in binary form (--binary): applying again from the last committed position, with the table read anew",
                entry.target.qualified
            ))),
        }
    }

    /// A statement could not be prepared. An earlier statement of the group may have failed (this
    /// one then fails with "transaction aborted"): that earlier failure is the one to report.
    pub(super) async fn prepare_failed<T>(
        &mut self,
        what: &str,
        table: &str,
        e: tokio_postgres::Error,
    ) -> Result<T> {
        self.drain_to(0).await;
        self.fail_if_failed().await?;
        let hint = e
            .code()
            .and_then(|c| target_table_hint(c.code(), table, e.as_db_error().map(|d| d.message())));
        let err = Error::postgres(format!("preparing {what} on the target"), e);
        Err(match hint {
            Some(hint) => err.context_after(hint),
            None => err,
        })
    }

    /// Hands the queued statements to the connection without waiting for their results, so the
    /// target executes them while the next ones are being built.
    pub(super) fn submit_pending(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        self.pending_weight = 0;
        for pending in pending {
            let client = self.client.clone();
            let Pending {
                request,
                params,
                about,
                batch,
                orders,
            } = pending;
            let weight = values_weight(&params);
            self.in_flight_sizes.push_back(weight);
            self.in_flight_values += weight;
            self.submitted += 1;
            let statement = match request {
                Request::Prepared(statement) => statement,
                Request::Simple(sql) => {
                    self.in_flight_mut().push_back(Box::pin(async move {
                        let result = client.batch_execute(&sql).await.map(|()| (0, None));
                        Outcome::One(about, result)
                    }));
                    continue;
                }
            };
            if orders {
                self.in_flight_mut().push_back(Box::pin(async move {
                    let result = client.execute_raw(&statement, params.iter()).await;
                    Outcome::Order(result)
                }));
            } else if batch.is_empty() {
                let answers = about.as_ref().is_some_and(ChangeInfo::answers_local_row);
                self.in_flight_mut().push_back(Box::pin(async move {
                    let result = run_counting(&client, &statement, &params, answers).await;
                    Outcome::One(about, result)
                }));
            } else {
                self.in_flight_mut().push_back(Box::pin(async move {
                    let result = async {
                        let rows = client.query_raw(&statement, params.iter()).await?;
                        futures_util::pin_mut!(rows);
                        let mut missing = Vec::new();
                        while let Some(row) = rows.next().await {
                            missing.push(row?.try_get::<_, i32>(0)?);
                        }
                        Ok(missing)
                    }
                    .await;
                    Outcome::Batch(batch, result)
                }));
            }
        }
        // tokio-postgres sends a request when its future is first polled; poll now, in order.
        let mut cx = std::task::Context::from_waker(futures_util::task::noop_waker_ref());
        while let std::task::Poll::Ready(Some(outcome)) =
            self.in_flight_mut().poll_next_unpin(&mut cx)
        {
            self.check_outcome(outcome);
        }
    }

    pub(super) fn in_flight_mut(&mut self) -> &mut futures_util::stream::FuturesOrdered<InFlight> {
        self.in_flight
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A parallel worker stops waiting for answers once one failed: later statements may wait on
    /// the server for transactions that will not commit now (`fail_if_failed` ends it).
    pub(super) fn worker_failed(&self) -> bool {
        self.worker.is_some() && self.failure.is_some()
    }

    /// Waits until at most `keep` parameter values are still in flight.
    pub(super) async fn drain_values_to(&mut self, keep: usize) {
        while self.in_flight_values > keep && !self.worker_failed() {
            match self.in_flight_mut().next().await {
                Some(outcome) => self.check_outcome(outcome),
                None => break,
            }
        }
    }

    /// Waits until at most `keep` statements are still in flight.
    pub(super) async fn drain_to(&mut self, keep: usize) {
        while self.in_flight_mut().len() > keep && !self.worker_failed() {
            match self.in_flight_mut().next().await {
                Some(outcome) => self.check_outcome(outcome),
                None => break,
            }
        }
    }
}

/// Prepared statements kept per target session (see `remember_statement`).
pub(super) const MAX_STATEMENTS: usize = 4096;

/// The cache's bound: `MAX_STATEMENTS`, or `PGAPPLY_MAX_STATEMENTS` (for tests, which reach it
/// with a few tables).
fn max_statements() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("PGAPPLY_MAX_STATEMENTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n >= 4)
            .unwrap_or(MAX_STATEMENTS)
    })
}

/// Prepared statements by shape. The shapes a process meets are many in some workloads (under
/// REPLICA IDENTITY FULL each pattern of NULLs is one, each set of unchanged TOAST columns eight
/// batch sizes, each relation change a new generation, thousands of tables): past a bound the
/// half used least recently goes, and what is used again is prepared again. (A statement still
/// in the pipeline keeps its own handle; the server forgets it when the last handle goes.)
#[derive(Default)]
pub(crate) struct StatementCache {
    map: HashMap<Shape, (Statement, u64)>,
    /// Counts uses: an entry's number is its last use.
    tick: u64,
}

impl StatementCache {
    pub(super) fn get(&mut self, shape: &Shape) -> Option<Statement> {
        self.tick += 1;
        let tick = self.tick;
        self.map.get_mut(shape).map(|(s, used)| {
            *used = tick;
            s.clone()
        })
    }

    pub(super) fn contains_key(&self, shape: &Shape) -> bool {
        self.map.contains_key(shape)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn insert(&mut self, shape: Shape, statement: Statement) {
        if self.map.len() >= max_statements() {
            let mut uses: Vec<u64> = self.map.values().map(|(_, used)| *used).collect();
            let half = uses.len() / 2;
            let (_, median, _) = uses.select_nth_unstable(half);
            let median = *median;
            self.map.retain(|_, (_, used)| *used > median);
            tracing::debug!(
                kept = self.map.len(),
                "prepared statement cache full: the half used least recently goes"
            );
        }
        self.tick += 1;
        self.map.insert(shape, (statement, self.tick));
    }
}

/// What a statement's parameters weigh against `ApplySettings::pipeline_values`: one per value,
/// and one more per KiB of a value (a row of 1 MB values would otherwise let thousands of
/// megabytes wait for their answers, as values count rows).
pub(super) fn values_weight(params: &[WireValue]) -> usize {
    params.len()
        + params
            .iter()
            .map(|p| match p {
                WireValue::Null => 0,
                WireValue::Text(b) | WireValue::Binary(b) => b.len() / 1024,
            })
            .sum::<usize>()
}

/// Most statements sent and not yet answered (see `bound_in_flight`).
const MAX_IN_FLIGHT: usize = 8192;

/// Runs one change's statement: its row count or, for one that answers with the target's row(s)
/// it met (`Signal::answers_local_row`), how many answers and the first's text.
pub(super) async fn run_counting(
    client: &tokio_postgres::Client,
    statement: &Statement,
    params: &[WireValue],
    answers: bool,
) -> std::result::Result<(u64, Option<String>), tokio_postgres::Error> {
    if !answers {
        return client
            .execute_raw(statement, params.iter())
            .await
            .map(|n| (n, None));
    }
    let rows = client.query_raw(statement, params.iter()).await?;
    futures_util::pin_mut!(rows);
    let (mut count, mut local) = (0, None);
    while let Some(row) = rows.next().await {
        let row = row?;
        if count == 0 {
            local = row.try_get::<_, Option<String>>(0)?;
        }
        count += 1;
    }
    Ok((count, local))
}
