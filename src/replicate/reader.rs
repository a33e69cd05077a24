//! The source reader: reads the replication stream in large gulps, decodes frames into messages for
//! the applier's byte-bounded queue, and sends standby status updates with the durable position.

use super::*;

/// Queued bytes from which the reader paces its reads (see `ReplicationConnection::set_pacing`).
pub(super) const PACE_WHEN_QUEUED: usize = 256 * 1024;

pub(super) struct Reader<'a> {
    pub(super) stream: &'a mut ReplicationStream,
    pub(super) tx: Option<mpsc::UnboundedSender<Envelope>>,
    pub(super) budget: Arc<Semaphore>,
    pub(super) queue_bytes: usize,
    pub(super) decoder: MessageDecoder,
    pub(super) durable: watch::Receiver<Lsn>,
    pub(super) applier_done: watch::Receiver<bool>,
    /// Between a forwarded Begin and its Commit.
    pub(super) in_transaction: bool,
    /// End LSN of the last forwarded commit.
    pub(super) forwarded_end: Lsn,
    /// WAL end from the last keepalive.
    pub(super) keepalive_end: Lsn,
    /// The source's WAL end when the run started (IDENTIFY_SYSTEM): only for the lag in bytes,
    /// which would otherwise read 0 while the source decodes a backlog before it sends anything
    /// (never as a position to confirm: what lies before it has not been received).
    pub(super) wal_end_at_start: Lsn,
    /// How far past the applied position the target has recorded that pgapply may report
    /// (`pgapply.progress.reported_lsn`, written by the heartbeat before it is reported): a
    /// restart then knows a slot confirmed beyond it lost changes.
    pub(super) report_recorded: watch::Receiver<Lsn>,
    /// The keepalive position the reader would report, for the heartbeat to record.
    pub(super) report_wanted: watch::Sender<Lsn>,
    /// Highest WAL position received.
    pub(super) received: Lsn,
    pub(super) endpos: Option<Lsn>,
    /// A position `pgapply cutover` asked this worker to stop at (`pgapply.progress.stop_lsn`).
    pub(super) stop_request: watch::Receiver<Option<Lsn>>,
    /// The stop position taken from a request, once one came.
    pub(super) stop_requested: Option<Lsn>,
    /// No request can come any more.
    pub(super) stop_unheard: bool,
    pub(super) status_interval: Duration,
    /// The source's `wal_sender_timeout` (0: none).
    pub(super) wal_sender_timeout: Duration,
    pub(super) progress: Option<watch::Sender<RunProgress>>,
    /// When the source last sent anything (or when pgapply last started listening again).
    pub(super) last_heard: Instant,
    /// When the last status update went out: due again `status_interval` later, however the
    /// reader is busy meanwhile (handling a gulp of frames, each waiting briefly for room in the
    /// queue, would otherwise send none for minutes: the source ends a connection silent for
    /// its `wal_sender_timeout`, and a source gone away is noticed only by writing to it).
    pub(super) last_status: Instant,
    /// A Begin not forwarded yet (see `on_frame`).
    pub(super) held_begin: Option<(LogicalMessage, bytes::Bytes, usize)>,
    /// The shutdown signal, also while waiting for room in the queue.
    pub(super) stopping: watch::Receiver<bool>,
    /// `PACE_WHEN_QUEUED`, or `PGAPPLY_PACE_WHEN_QUEUED` (bytes; for bench/pacing.sh).
    pub(super) pace_when_queued: usize,
    /// For the lag in seconds: (end, source commit time) of transactions handed to the applier
    /// and not known applied, oldest first (see `oldest_pending`).
    pub(super) pending: std::collections::VecDeque<(Lsn, u64)>,
    /// When the transaction being received began to arrive (its Begin).
    pub(super) transaction_started: Option<Instant>,
    /// The commit time the transaction being received carries (its Begin's).
    pub(super) receiving_commit_time: u64,
    /// Streamed transactions being received (a first Stream Start seen, no end yet), and when
    /// each began to arrive: for the progress line.
    pub(super) streams_open: std::collections::HashMap<crate::protocol::pgoutput::Xid, Instant>,
    /// Where this run started reading (the recorded position, else the first change's): the
    /// lag in bytes counts from it until the source has confirmed something.
    pub(super) read_from: Lsn,
}

/// What the last progress line said.
struct Logged {
    transactions: u64,
    at: Instant,
}

/// Most transactions `Reader::pending` keeps apart: past it, the newest entry stands for the
/// ones after it (its commit time is older than theirs: the lag reads a little high).
const MAX_PENDING: usize = 100_000;

/// What a run left pending (see `Reader::carry_pending`); one worker runs per process.
static CARRIED_PENDING: std::sync::Mutex<std::collections::VecDeque<(Lsn, u64)>> =
    std::sync::Mutex::new(std::collections::VecDeque::new());

/// What the run before left pending, for a new reader.
pub(super) fn carried_pending() -> std::collections::VecDeque<(Lsn, u64)> {
    CARRIED_PENDING
        .lock()
        .map(|mut carried| std::mem::take(&mut *carried))
        .unwrap_or_default()
}

pub(super) enum Step {
    Continue,
    Stop(StopReason),
}

impl Reader<'_> {
    pub(super) fn flush_position(&self, durable: Lsn) -> Lsn {
        if !self.in_transaction && durable >= self.forwarded_end {
            let wanted = self.keepalive_end;
            self.report_wanted.send_if_modified(|w| {
                let more = wanted > *w;
                if more {
                    *w = wanted;
                }
                more
            });
            durable.max(wanted.min(*self.report_recorded.borrow()))
        } else {
            durable
        }
    }

    /// Stops before a transaction that commits at or after the end position: the source has
    /// sent everything before that commit, so once what came is applied, the end position
    /// itself may be confirmed (`flush_position`), as a keepalive past it would let it be; a
    /// cutover waiting for the slot to reach its end then sees it there.
    fn past_the_end(&mut self) -> Step {
        if let Some(end) = self.endpos {
            self.keepalive_end = self.keepalive_end.max(end);
        }
        Step::Stop(StopReason::EndPosition)
    }

    pub(super) async fn send_status(&mut self, reply_requested: bool) -> Result<()> {
        let durable = *self.durable.borrow();
        let flushed = self.flush_position(durable);
        METRICS.received_lsn.set_max(self.received.0);
        METRICS.flushed_lsn.set_max(flushed.0);
        self.update_lag();
        self.last_status = Instant::now();
        if let Some(p) = &self.progress {
            p.send_replace(RunProgress { durable: flushed });
        }
        self.stream
            .send_status(self.received.max(flushed), flushed, reply_requested)
            .await
    }

    pub(super) async fn run(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<StopReason> {
        let mut status = tokio::time::interval(self.status_interval);
        status.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // With an end position, ask the source for its WAL end often, so an idle source
        // still tells us when the end is reached.
        let mut probe = tokio::time::interval(Duration::from_millis(250));
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The lag gauges move every second, not only with status updates.
        let mut lag = tokio::time::interval(Duration::from_secs(1));
        lag.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_log = Instant::now();
        // The silence already said (its start, `last_heard` then): once per silence.
        let mut silence_said: Option<Instant> = None;
        let mut logged = Logged {
            transactions: METRICS.transactions.get(),
            at: Instant::now(),
        };
        self.send_status(self.endpos.is_some()).await?;
        loop {
            if *shutdown.borrow() {
                return Ok(StopReason::Shutdown);
            }
            if *self.applier_done.borrow() {
                // The applier stopped on its own: it failed; its error is reported by the caller.
                return Ok(StopReason::Shutdown);
            }
            // Let the source's data accumulate (pause after short reads) only while the applier
            // has enough queued not to starve meanwhile.
            let queued = self.queued();
            METRICS.queue_bytes.set(queued as u64);
            self.stream.set_pacing(queued >= self.pace_when_queued);
            tokio::select! {
                _ = shutdown.changed() => return Ok(StopReason::Shutdown),
                // The applier stopped (or is gone): the caller reports why.
                _ = self.applier_done.changed() => return Ok(StopReason::Shutdown),
                frame = self.stream.next_frame() => {
                    let frame = frame?.ok_or_else(|| Error::transient(format!(
                        "source {} ended the replication stream (server shutting down?)", self.stream.endpoint())))?;
                    if let Step::Stop(reason) = self.on_frame(frame).await? {
                        return Ok(reason);
                    }
                    // Frames already received are handled without going through the select
                    // again (a few hundred at most, and for a second at most, so timers and
                    // signals are still served; a status update that falls due is sent).
                    let gulp = Instant::now();
                    for _ in 0..256 {
                        if !self.stream.has_buffered_frame() {
                            break;
                        }
                        // (One clock reading per frame: this loop is the reader's hot path.)
                        let now = Instant::now();
                        if now - gulp >= Duration::from_secs(1) {
                            break;
                        }
                        if now - self.last_status >= self.status_interval {
                            self.send_status(false).await?;
                        }
                        let frame = self.stream.next_frame().await?.ok_or_else(|| Error::transient(format!(
                            "source {} ended the replication stream (server shutting down?)", self.stream.endpoint())))?;
                        if let Step::Stop(reason) = self.on_frame(frame).await? {
                            return Ok(reason);
                        }
                    }
                }
                _ = status.tick() => {
                    // Ask for a reply each time, so a silent source is noticed.
                    let silent = self.last_heard.elapsed();
                    if silent > self.silence_limit() / 2
                        && silent <= self.silence_limit()
                        && silence_said != Some(self.last_heard)
                    {
                        // Said well before the connection is given up: a source stopped, or a
                        // network device that keeps the connection open and passes nothing,
                        // would otherwise show no sign for a minute or more.
                        silence_said = Some(self.last_heard);
                        tracing::warn!(
                            "source {} has sent nothing for {}, not even an answer to a status update: the connection is given up if it stays silent {} in all (a source busy decoding a large transaction of unpublished changes is silent too)",
                            self.stream.endpoint(),
                            humantime::format_duration(Duration::from_secs(silent.as_secs())),
                            humantime::format_duration(self.silence_limit())
                        );
                    }
                    if silent > self.silence_limit() {
                        return Err(Error::transient(format!(
                            "source {} sent nothing for {}, not even an answer to a status update: the connection is presumed lost (a source busy decoding a large transaction of unpublished changes stays silent: on PostgreSQL before 15, raise the source's wal_sender_timeout to wait longer)",
                            self.stream.endpoint(),
                            humantime::format_duration(self.silence_limit())
                        )));
                    }
                    self.send_status(true).await?
                }
                _ = probe.tick(), if self.endpos.is_some() && !self.in_transaction => {
                    self.send_status(true).await?
                }
                _ = lag.tick() => self.update_lag(),
                changed = self.stop_request.changed(), if self.stop_requested.is_none() && !self.stop_unheard => {
                    let request = if changed.is_ok() { *self.stop_request.borrow_and_update() } else { None };
                    if changed.is_err() {
                        // The heartbeat task is gone (the run is ending): nothing more to hear.
                        self.stop_unheard = true;
                    } else if let Some(stop) = request {
                        tracing::info!(stop_lsn = %stop, "`pgapply cutover` asks to stop there: applying everything committed before it, then stopping");
                        self.stop_requested = Some(stop);
                        self.endpos = Some(self.endpos.map_or(stop, |e| e.min(stop)));
                        // Ask for the source's WAL end now: an idle source tells with its reply.
                        self.send_status(true).await?;
                    }
                }
                changed = self.durable.changed() => {
                    if changed.is_err() {
                        return Err(Error::definite("the durability tracker stopped unexpectedly"));
                    }
                    self.send_status(false).await?
                }
            }
            if last_log.elapsed() >= Duration::from_secs(10) {
                last_log = Instant::now();
                self.log_progress(&mut logged);
            }
        }
    }

    /// The periodic progress line: every 10 s while the stream moves (or a transaction is being
    /// received), every 10 minutes while it is idle.
    fn log_progress(&mut self, logged: &mut Logged) {
        // (Positions move with writes to unpublished tables too: not what "idle" means here.)
        let transactions = METRICS.transactions.get();
        // (Also while transactions handed to the applier wait to be applied: a large streamed
        // one applied at its commit, or by the --streaming parallel helper catching up.)
        let moved = transactions != logged.transactions
            || self.in_transaction
            || !self.streams_open.is_empty()
            || self.queued() > 0
            || self.oldest_pending().is_some();
        if !moved && logged.at.elapsed() < Duration::from_secs(600) {
            return;
        }
        // (A streamed transaction arrives in blocks between others: the oldest one open.)
        let receiving = self
            .transaction_started
            .filter(|_| self.in_transaction)
            .into_iter()
            .chain(self.streams_open.values().copied())
            .map(|t| t.elapsed().as_secs())
            .max()
            .unwrap_or(0);
        tracing::info!(
            received_lsn = %self.received,
            flushed_lsn = %Lsn(METRICS.flushed_lsn.get()),
            lag_seconds = (METRICS.lag_seconds() * 10.0).round() / 10.0,
            transactions_applied = transactions.saturating_sub(logged.transactions),
            seconds = logged.at.elapsed().as_secs(),
            receiving_a_transaction_for_seconds = receiving,
            "{}",
            if moved { "replicating" } else { "replicating (idle)" }
        );
        *logged = Logged {
            transactions,
            at: Instant::now(),
        };
    }

    /// The commit time of the oldest transaction received and not applied yet, if any.
    fn oldest_pending(&mut self) -> Option<u64> {
        let applied = Lsn(METRICS.applied_lsn.get());
        while self.pending.front().is_some_and(|(end, _)| *end <= applied) {
            self.pending.pop_front();
        }
        match self.pending.front() {
            Some((_, time)) => Some(*time),
            None if self.in_transaction && self.receiving_commit_time > 0 => {
                Some(self.receiving_commit_time)
            }
            None => None,
        }
    }

    fn note_pending(&mut self, end: Lsn, time: crate::protocol::PgTimestamp) {
        let time = time.0.max(0) as u64;
        let full = self.pending.len() >= MAX_PENDING;
        match self.pending.back_mut() {
            // Sent again after a restart: known from the run before (see `carry_pending`).
            Some(back) if back.0 >= end => {}
            Some(back) if full => back.0 = end,
            _ => self.pending.push_back((end, time)),
        }
    }

    /// Keeps what is still pending for the next run of this process (after an error, the
    /// retry), so the lag in seconds keeps counting from the oldest unapplied commit meanwhile
    /// and after it reconnects, instead of starting again from the first transaction it gets.
    pub(super) fn carry_pending(&mut self) {
        self.update_lag();
        if let Ok(mut carried) = CARRIED_PENDING.lock() {
            *carried = std::mem::take(&mut self.pending);
        }
    }

    pub(super) fn update_lag(&mut self) {
        let oldest = self.oldest_pending();
        METRICS.update_lag(
            self.keepalive_end
                .0
                .max(self.received.0)
                .max(self.wal_end_at_start.0),
            self.read_from.0,
            oldest,
        );
    }

    /// Bytes handed to the applier and not applied yet.
    pub(super) fn queued(&self) -> usize {
        self.queue_bytes - self.budget.available_permits().min(self.queue_bytes)
    }

    pub(super) fn silence_limit(&self) -> Duration {
        silence_limit(self.status_interval, self.wal_sender_timeout)
    }

    pub(super) async fn on_frame(&mut self, frame: ReplicationFrame) -> Result<Step> {
        self.last_heard = Instant::now();
        match frame {
            ReplicationFrame::Keepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                self.keepalive_end = self.keepalive_end.max(wal_end);
                self.received = self.received.max(wal_end);
                if reply_requested {
                    self.send_status(false).await?;
                }
                if let Some(endpos) = self.endpos {
                    if !self.in_transaction && wal_end >= endpos {
                        return Ok(Step::Stop(StopReason::EndPosition));
                    }
                }
                Ok(Step::Continue)
            }
            ReplicationFrame::XLogData {
                wal_start,
                data,
                send_time,
                ..
            } => {
                self.received = self.received.max(wal_start);
                if !self.read_from.is_valid() {
                    self.read_from = wal_start;
                }
                let size = data.len();
                let raw = data.clone();
                let message = self.decoder.decode(data).map_err(|e| {
                    Error::definite(format!(
                        "source {} sent a message at {wal_start} that pgapply cannot decode: {e}",
                        self.stream.endpoint()
                    ))
                })?;
                let endpos = self.endpos;
                let reached = |lsn: Lsn| endpos.is_some_and(|e| lsn >= e);
                let mut stop_after = false;
                match &message {
                    LogicalMessage::Begin(b) => {
                        if reached(b.final_lsn) {
                            return Ok(self.past_the_end());
                        }
                        let sent_after_us = send_time.0.saturating_sub(b.commit_time.0);
                        crate::apply::SOURCE_SENDS_LIVE.store(
                            sent_after_us < crate::apply::LIVE_WITHIN.as_micros() as i64,
                            std::sync::atomic::Ordering::Relaxed,
                        );
                        self.in_transaction = true;
                        self.transaction_started = Some(self.last_heard);
                        self.receiving_commit_time = b.commit_time.0.max(0) as u64;
                        // Held until something follows: before PostgreSQL 15 the source sends an
                        // empty Begin/Commit for every transaction that touched nothing
                        // published; applied, it would write nothing on the target, the position
                        // would not move there, and the slot would stop advancing.
                        self.held_begin = Some((message, raw, size));
                        return Ok(Step::Continue);
                    }
                    LogicalMessage::BeginPrepare(b) => {
                        if reached(b.prepare_lsn) {
                            return Ok(self.past_the_end());
                        }
                        self.in_transaction = true;
                        self.transaction_started = Some(self.last_heard);
                        self.receiving_commit_time = b.prepare_time.0.max(0) as u64;
                    }
                    LogicalMessage::Commit(c) => {
                        self.in_transaction = false;
                        if self.held_begin.take().is_some() {
                            // An empty transaction: nothing to apply, nothing to wait for.
                            return Ok(if reached(c.end_lsn) {
                                self.past_the_end()
                            } else {
                                Step::Continue
                            });
                        }
                        self.forwarded_end = c.end_lsn;
                        self.note_pending(c.end_lsn, c.commit_time);
                        stop_after = reached(c.end_lsn);
                    }
                    LogicalMessage::Prepare(p) => {
                        self.in_transaction = false;
                        self.forwarded_end = p.end_lsn;
                        self.note_pending(p.end_lsn, p.prepare_time);
                        stop_after = reached(p.end_lsn);
                    }
                    LogicalMessage::StreamStart(s) => {
                        let at = self.last_heard;
                        self.streams_open.entry(s.xid).or_insert(at);
                    }
                    LogicalMessage::StreamAbort(a) if a.subxid == a.xid => {
                        self.streams_open.remove(&a.xid);
                    }
                    LogicalMessage::StreamCommit(c) => {
                        self.streams_open.remove(&c.xid);
                        if reached(c.commit_lsn) {
                            return Ok(self.past_the_end());
                        }
                        self.forwarded_end = c.end_lsn;
                        self.note_pending(c.end_lsn, c.commit_time);
                        stop_after = reached(c.end_lsn);
                    }
                    LogicalMessage::StreamPrepare(p) => {
                        self.streams_open.remove(&p.xid);
                        if reached(p.prepare_lsn) {
                            return Ok(self.past_the_end());
                        }
                        self.forwarded_end = p.end_lsn;
                        self.note_pending(p.end_lsn, p.prepare_time);
                        stop_after = reached(p.end_lsn);
                    }
                    LogicalMessage::CommitPrepared(c) => {
                        if reached(c.commit_lsn) {
                            return Ok(self.past_the_end());
                        }
                        self.forwarded_end = c.end_lsn;
                        self.note_pending(c.end_lsn, c.commit_time);
                        stop_after = reached(c.end_lsn);
                    }
                    LogicalMessage::RollbackPrepared(r) => {
                        self.forwarded_end = r.rollback_end_lsn;
                        self.note_pending(r.rollback_end_lsn, r.rollback_time);
                        stop_after = reached(r.rollback_end_lsn);
                    }
                    _ => {}
                }
                self.received = self.received.max(self.forwarded_end);
                if let Some((begin, begin_raw, begin_size)) = self.held_begin.take() {
                    self.forward(begin, begin_raw, begin_size).await?;
                }
                if self.tx.is_some() {
                    self.forward(message, raw, size).await?;
                }
                if self.tx.is_none() {
                    // A message was dropped while stopping (see `forward`): stop here.
                    return Ok(Step::Stop(StopReason::Shutdown));
                }
                if stop_after {
                    return Ok(self.past_the_end());
                }
                Ok(Step::Continue)
            }
        }
    }

    /// Hands a message to the applier, waiting while the queue is over its byte budget; status
    /// updates keep going meanwhile so the source does not time us out.
    pub(super) async fn forward(
        &mut self,
        message: LogicalMessage,
        raw: bytes::Bytes,
        size: usize,
    ) -> Result<()> {
        // Each queued message also costs its decoded form and the queue's own bookkeeping. A
        // message larger than the queue costs at most three quarters of it: with
        // --apply-workers, a transaction's first messages are held (up to a quarter of the
        // queue) until it is known whole or too large, so a message asking for the whole queue
        // would wait for them for ever.
        let overhead = std::mem::size_of::<Envelope>() + 64;
        let most = self.queue_bytes - self.queue_bytes / 4;
        let cost = (size + overhead).clamp(1, most.max(1)) as u32;
        let permit = match self.budget.clone().try_acquire_many_owned(cost) {
            Ok(permit) => permit,
            Err(_) => match self.wait_for_budget(cost).await? {
                Some(permit) => permit,
                None => {
                    // This message is dropped, so nothing after it may reach the applier either:
                    // its transaction would commit there without this change. Closing the queue
                    // makes the applier roll the incomplete transaction back.
                    self.tx = None;
                    return Ok(());
                }
            },
        };
        if let Some(tx) = &self.tx {
            // A closed channel means the applier stopped; the caller reports why.
            let _ = tx.send(Envelope {
                message,
                raw,
                permit: Some(permit),
                turn: None,
            });
        }
        Ok(())
    }

    /// The slow path of `forward`: the queue is full. `None` if the applier stopped meanwhile.
    pub(super) async fn wait_for_budget(
        &mut self,
        cost: u32,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>> {
        METRICS.queue_bytes.set(self.queued() as u64);
        // The lag gauges move while it waits too (that is when the lag grows).
        let mut lag = tokio::time::interval(Duration::from_secs(1));
        lag.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let started = Instant::now();
        let mut said: Option<Instant> = None;
        loop {
            // A full queue for long (a slow target, a large transaction applied): said, or the
            // log would look stuck; every 60 s after the first 30.
            if started.elapsed() >= Duration::from_secs(30)
                && said.is_none_or(|at| at.elapsed() >= Duration::from_secs(60))
            {
                said = Some(Instant::now());
                tracing::info!(
                    queued_bytes = self.queued(),
                    received_lsn = %self.received,
                    durable_lsn = %*self.durable.borrow(),
                    waited_seconds = started.elapsed().as_secs(),
                    "the apply queue is full: reading from the source waits for the target to apply what it has"
                );
            }
            tokio::select! {
                permit = self.budget.clone().acquire_many_owned(cost) => {
                    // Nothing was read meanwhile: the source's silence counts from now.
                    self.last_heard = Instant::now();
                    return permit
                        .map(Some)
                        .map_err(|_| Error::definite("the apply queue closed"));
                }
                // (Due from the last update sent, not from the start of this wait: waits one
                // after the other, each shorter than the interval, must not skip them all.)
                _ = tokio::time::sleep_until((self.last_status + self.status_interval).into()) => {
                    self.send_status(false).await?
                }
                _ = lag.tick() => self.update_lag(),
                _ = self.applier_done.changed() => return Ok(None),
                // Stopping: the message is dropped; its transaction is incomplete on the applier's
                // side, rolled back there, and sent again after a restart.
                _ = self.stopping.changed() => return Ok(None),
            }
        }
    }
}
