//! Prometheus metrics (`--metrics-addr`): `/metrics` in the text exposition format, `/healthz`
//! for liveness and `/readyz` for whether the worker streams now. The exposition format is a few lines of text, so it is written here directly
//! rather than through a metrics framework and an HTTP stack (see docs/design.md).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::error::{Error, Result};

pub const RECEIVED_LSN: &str = "pgapply_received_lsn";
pub const APPLIED_LSN: &str = "pgapply_applied_lsn";
pub const FLUSHED_LSN: &str = "pgapply_flushed_lsn";
pub const LAG_BYTES: &str = "pgapply_lag_bytes";
pub const LAG_SECONDS: &str = "pgapply_lag_seconds";
pub const TRANSACTIONS: &str = "pgapply_transactions_total";
pub const ROWS: &str = "pgapply_rows_total";
pub const APPLY_LATENCY: &str = "pgapply_apply_latency_seconds";
pub const SPILLED_BYTES: &str = "pgapply_spilled_bytes_total";
pub const RECONNECTS: &str = "pgapply_reconnects_total";
pub const QUEUE_BYTES: &str = "pgapply_queue_bytes";
pub const CONFLICTS: &str = "pgapply_conflicts_total";
pub const COPY_ROWS: &str = "pgapply_copy_rows_total";
pub const COPY_BYTES: &str = "pgapply_copy_bytes_total";
pub const STREAMING: &str = "pgapply_streaming";

#[derive(Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn set_max(&self, v: u64) {
        self.0.fetch_max(v, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

const LATENCY_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; 12],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (i, upper) in LATENCY_BUCKETS.iter().enumerate() {
            if secs <= *upper {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }
}

/// All of pgapply's metrics. One process runs one worker, so they are process-wide.
#[derive(Default)]
pub struct Metrics {
    pub received_lsn: Gauge,
    pub applied_lsn: Gauge,
    pub flushed_lsn: Gauge,
    /// Source WAL end (from keepalives) minus the flushed position.
    pub lag_bytes: Gauge,
    /// Source commit time (µs since 2000-01-01) of the oldest transaction received and not
    /// applied yet, 0 when nothing is pending. The lag in seconds is computed from it when read,
    /// so it keeps growing while nothing updates it: a run waiting to retry after the target
    /// failed, or a reader waiting for room in a full queue.
    pub oldest_pending_commit: Gauge,
    /// Bytes received from the source and not applied yet (at most `--queue-size`).
    pub queue_bytes: Gauge,
    /// 1 while a run streams from the source into the target, 0 otherwise (waiting to retry
    /// after an error, copying, stopped): the lag figures are only current while it is 1.
    pub streaming: Gauge,
    /// 1 while the worker's last word with the target (its heartbeat) went through: an idle
    /// worker learns of a target gone down only there.
    pub target_ok: Gauge,
    /// Commit time of the last applied source transaction: µs since 2000-01-01.
    pub last_commit_time: Gauge,
    pub transactions: Counter,
    pub inserts: Counter,
    pub updates: Counter,
    pub deletes: Counter,
    pub truncates: Counter,
    pub apply_latency: Histogram,
    pub spilled_bytes: Counter,
    pub reconnects: Counter,
    pub conflicts: Mutex<BTreeMap<&'static str, u64>>,
    pub copy: Mutex<BTreeMap<String, (u64, u64)>>,
    /// The slot this process's worker applies (`pgapply_info{slot=..}`): several workers on one
    /// host are told apart by it, not only by their ports.
    pub slot: std::sync::OnceLock<String>,
}

pub static METRICS: std::sync::LazyLock<Metrics> = std::sync::LazyLock::new(Metrics::default);

impl Metrics {
    /// Streaming, and the target answering.
    pub fn ready(&self) -> bool {
        self.streaming.get() == 1 && self.target_ok.get() == 1
    }

    pub fn conflict(&self, kind: &'static str, count: u64) {
        if let Ok(mut c) = self.conflicts.lock() {
            *c.entry(kind).or_default() += count;
        }
    }

    pub fn copied(&self, table: &str, rows: u64, bytes: u64) {
        if let Ok(mut c) = self.copy.lock() {
            let e = c.entry(table.to_owned()).or_default();
            e.0 += rows;
            e.1 += bytes;
        }
    }

    /// Recomputes the lag gauges. Bytes: the source's WAL end past what it has confirmed (or,
    /// before anything is confirmed, past where this run started reading: not the whole WAL of a
    /// new slot). Seconds: how long ago the oldest transaction received and not applied yet
    /// committed on the source (`oldest_pending`, its commit time), else 0: WAL the source
    /// writes without a published change (an idle source, unpublished tables) is no lag, and the
    /// first change after an idle hour counts from its own commit, not from the last one applied.
    pub fn update_lag(&self, source_wal_end: u64, read_from: u64, oldest_pending: Option<u64>) {
        let confirmed = self.flushed_lsn.get().max(read_from);
        self.lag_bytes.set(source_wal_end.saturating_sub(confirmed));
        // (A commit time of 0, year 2000 exactly, would read as nothing pending: it never occurs.)
        self.oldest_pending_commit.set(oldest_pending.unwrap_or(0));
    }

    /// How long ago the oldest transaction received and not applied yet committed on the
    /// source, in seconds; 0 while nothing is pending.
    pub fn lag_seconds(&self) -> f64 {
        match self.oldest_pending_commit.get() {
            0 => 0.0,
            commit => {
                let now = crate::protocol::PgTimestamp::now().0.max(0) as u64;
                now.saturating_sub(commit) as f64 / 1_000_000.0
            }
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Some(slot) = self.slot.get() {
            let escaped = slot.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "# HELP pgapply_info The slot this process applies.\n# TYPE pgapply_info gauge\npgapply_info{{slot=\"{escaped}\"}} 1"
            );
        }
        let mut gauge = |name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(
            RECEIVED_LSN,
            "Highest source WAL position received (LSN as a number).",
            // (The reader records it with each status update; anything applied was received.)
            self.received_lsn.get().max(self.applied_lsn.get()) as f64,
        );
        gauge(
            APPLIED_LSN,
            "Source position of the last transaction committed on the target.",
            self.applied_lsn.get() as f64,
        );
        gauge(
            FLUSHED_LSN,
            "Source position durable on the target and reported to the source.",
            self.flushed_lsn.get() as f64,
        );
        gauge(
            LAG_BYTES,
            "The source's WAL end as last known (its latest report, or at the run's start) minus the position confirmed to it, in bytes.",
            self.lag_bytes.get() as f64,
        );
        gauge(
            LAG_SECONDS,
            "Seconds since the oldest source transaction not applied yet committed on the source; 0 when nothing is pending. It keeps growing while the run waits to retry or for a full queue.",
            self.lag_seconds(),
        );
        gauge(
            STREAMING,
            "1 while a run streams from the source into the target; 0 while it waits to retry after an error or the target does not answer its heartbeat (the lag in bytes is then the last known; the lag in seconds goes on growing), copies, or has stopped.",
            f64::from(u8::from(self.ready())),
        );
        gauge(
            QUEUE_BYTES,
            "Bytes received from the source and not applied yet (at most --queue-size).",
            self.queue_bytes.get() as f64,
        );
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        counter(
            TRANSACTIONS,
            "Source transactions applied.",
            self.transactions.get(),
        );
        counter(
            SPILLED_BYTES,
            "Bytes of streamed transactions spooled to disk.",
            self.spilled_bytes.get(),
        );
        counter(
            RECONNECTS,
            "Reconnects after transient errors.",
            self.reconnects.get(),
        );
        let _ = writeln!(
            out,
            "# HELP {ROWS} Row changes applied, by operation.\n# TYPE {ROWS} counter"
        );
        for (op, c) in [
            ("insert", &self.inserts),
            ("update", &self.updates),
            ("delete", &self.deletes),
            ("truncate", &self.truncates),
        ] {
            let _ = writeln!(out, "{ROWS}{{operation=\"{op}\"}} {}", c.get());
        }
        let _ = writeln!(out, "# HELP {CONFLICTS} Conflicts found while applying, by type.\n# TYPE {CONFLICTS} counter");
        if let Ok(c) = self.conflicts.lock() {
            for kind in [
                "insert_exists",
                "update_exists",
                "update_missing",
                "delete_missing",
                "multiple_unique_conflicts",
            ] {
                let _ = writeln!(
                    out,
                    "{CONFLICTS}{{type=\"{kind}\"}} {}",
                    c.get(kind).copied().unwrap_or(0)
                );
            }
        }
        let _ = writeln!(out, "# HELP {APPLY_LATENCY} Time to apply and commit one target transaction.\n# TYPE {APPLY_LATENCY} histogram");
        for (i, upper) in LATENCY_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{APPLY_LATENCY}_bucket{{le=\"{upper}\"}} {}",
                self.apply_latency.buckets[i].load(Ordering::Relaxed)
            );
        }
        let count = self.apply_latency.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{APPLY_LATENCY}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{APPLY_LATENCY}_sum {}\n{APPLY_LATENCY}_count {count}",
            self.apply_latency.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "# HELP {COPY_ROWS} Rows copied by the initial copy, per table.\n# TYPE {COPY_ROWS} counter");
        let copy = self.copy.lock().map(|c| c.clone()).unwrap_or_default();
        for (table, (rows, _)) in &copy {
            let _ = writeln!(
                out,
                "{COPY_ROWS}{{table=\"{}\"}} {rows}",
                escape_label(table)
            );
        }
        let _ = writeln!(out, "# HELP {COPY_BYTES} Bytes copied by the initial copy, per table.\n# TYPE {COPY_BYTES} counter");
        for (table, (_, bytes)) in &copy {
            let _ = writeln!(
                out,
                "{COPY_BYTES}{{table=\"{}\"}} {bytes}",
                escape_label(table)
            );
        }
        out
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Requests the metrics endpoint serves at once; more wait to be accepted.
const MAX_METRICS_REQUESTS: usize = 16;

/// Binds `addr` and serves metrics in the background.
/// Where `--metrics-addr` listens: `:9187`, as exporters write it, is every interface.
pub fn listen_address(addr: &str) -> String {
    match addr.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => addr.to_owned(),
    }
}

pub async fn serve(addr: &str) -> Result<()> {
    let bound = listen_address(addr);
    let listener = TcpListener::bind(&bound).await.map_err(|e| {
        let text = format!("--metrics-addr {addr}: cannot listen there: {e}");
        // Not an address at all (say a bare port), or a host name that does not resolve: the
        // setting is wrong, nothing was started.
        let lookup_failed = e.to_string().contains("not known");
        if e.kind() == std::io::ErrorKind::InvalidInput || lookup_failed {
            Error::usage(format!(
                "{text}; give HOST:PORT, for example 127.0.0.1:9187"
            ))
        } else {
            Error::definite(text)
        }
    })?;
    tracing::info!(addr = %bound, "serving metrics on /metrics, liveness on /healthz and readiness on /readyz");
    // A bounded number of requests at once (each may wait 5 s for its headers), so that
    // whoever reaches the port cannot use up the descriptors the database connections need.
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_METRICS_REQUESTS));
    tokio::spawn(async move {
        loop {
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let mut socket = match listener.accept().await {
                Ok((socket, _)) => socket,
                Err(e) => {
                    // Out of descriptors, say: not a reason to spin.
                    tracing::debug!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            tokio::spawn(async move {
                let _permit = permit;
                let mut request = Vec::with_capacity(512);
                let mut buf = [0u8; 1024];
                let read = tokio::time::timeout(Duration::from_secs(5), async {
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                })
                .await;
                if read.is_err() {
                    return;
                }
                let line = String::from_utf8_lossy(&request);
                // (A query string, as a scraper's `params` add, does not change the page.)
                let target = line.split_whitespace().nth(1).unwrap_or("/");
                let path = target.split('?').next().unwrap_or(target);
                let (status, content_type, body) = match path {
                    "/metrics" => ("200 OK", "text/plain; version=0.0.4", METRICS.render()),
                    "/healthz" => ("200 OK", "text/plain", "ok\n".to_owned()),
                    // Readiness: streaming now, not waiting to retry after an error.
                    "/readyz" if METRICS.ready() => {
                        ("200 OK", "text/plain", "streaming\n".to_owned())
                    }
                    "/readyz" => (
                        "503 Service Unavailable",
                        "text/plain",
                        "not streaming (waiting to retry, the target not answering, copying, or stopped: see the log)\n"
                            .to_owned(),
                    ),
                    _ => ("404 Not Found", "text/plain", "not found\n".to_owned()),
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_received_position_is_never_shown_behind_the_applied_one() {
        let m = super::Metrics::default();
        m.received_lsn.set(5);
        m.applied_lsn.set(10);
        let text = m.render();
        assert!(text.contains("\npgapply_received_lsn 10\n"), "{text}");
    }

    #[tokio::test]
    async fn an_address_is_taken_as_exporters_write_it_and_a_wrong_one_is_a_usage_error() {
        super::serve(":0").await.unwrap();
        super::serve("127.0.0.1:0").await.unwrap();
        for wrong in ["9187", "127.0.0.1"] {
            let err = super::serve(wrong).await.unwrap_err();
            assert!(err.to_string().contains("give HOST:PORT"), "{wrong}: {err}");
            assert_eq!(err.class(), crate::error::ErrorClass::Usage, "{wrong}");
        }
    }
}
