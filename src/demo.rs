//! `pgapply demo`: two throwaway local clusters, a live workload on one, pgapply mirroring it into
//! the other, progress while it runs, and proof at the end that both sides match.

use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::cluster::{find_pg_bin, LocalCluster};
use crate::compare::table_digests;
use crate::conninfo;
use crate::error::{Error, Result};
use crate::protocol::Lsn;
use crate::replicate::{run, RunConfig, RunProgress};

const SCHEMA: &str = "CREATE TABLE public.orders (
    id bigint PRIMARY KEY,
    customer text NOT NULL,
    amount numeric(12,2) NOT NULL,
    status text NOT NULL,
    tags text[],
    updated_at timestamptz NOT NULL DEFAULT now()
)";

async fn connect(conninfo: &str) -> Result<tokio_postgres::Client> {
    let config = conninfo::parse("demo", conninfo)?;
    crate::tls::connect(&config)
        .await
        .map_err(|e| e.into_error("connecting to a demo cluster"))
}

async fn wal_position(client: &tokio_postgres::Client) -> Result<Lsn> {
    let row = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .map_err(|e| Error::postgres("reading the source WAL position", e))?;
    row.get::<_, String>(0)
        .parse()
        .map_err(|e| Error::definite(format!("{e}")))
}

pub async fn demo(duration: Duration, pg_bin: Option<std::path::PathBuf>) -> Result<()> {
    let bin = pg_bin.or_else(find_pg_bin).ok_or_else(|| {
        Error::definite("no PostgreSQL binaries found: install postgresql (e.g. apt-get install postgresql-15) or set PGAPPLY_PG_BIN to a directory with initdb, pg_ctl and postgres")
    })?;
    for program in ["initdb", "pg_ctl", "postgres"] {
        if !bin.join(program).is_file() {
            return Err(Error::usage(format!(
                "{} not found: give --pg-bin (or PGAPPLY_PG_BIN) a directory with initdb, pg_ctl and postgres",
                bin.join(program).display()
            )));
        }
    }
    // Ctrl-C or SIGTERM ends the demo early, and the clusters are stopped and removed as at
    // its end (they are dropped on the way out).
    let (asked_tx, asked) = watch::channel(false);
    tokio::spawn(async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = term => {}
        }
        asked_tx.send_replace(true);
    });
    let stop_asked = || *asked.borrow();
    crate::out!(
        "starting two throwaway PostgreSQL clusters from {}",
        bin.display()
    );
    let start =
        |b: std::path::PathBuf| tokio::task::spawn_blocking(move || LocalCluster::start(&b, &[]));
    let source = start(bin.clone())
        .await
        .map_err(|e| Error::definite(e.to_string()))?
        .map_err(|e| Error::definite(format!("starting the source cluster: {e}")))?;
    let target = start(bin)
        .await
        .map_err(|e| Error::definite(e.to_string()))?
        .map_err(|e| Error::definite(format!("starting the target cluster: {e}")))?;
    crate::out!(
        "  source: port {}   target: port {}",
        source.port,
        target.port
    );

    let src = connect(&source.conninfo("postgres")).await?;
    let dst = connect(&target.conninfo("postgres")).await?;
    let setup = |e| Error::postgres("setting up the demo tables", e);
    src.batch_execute(SCHEMA).await.map_err(setup)?;
    dst.batch_execute(SCHEMA).await.map_err(setup)?;
    src.batch_execute("CREATE PUBLICATION demo_pub FOR TABLE public.orders")
        .await
        .map_err(setup)?;

    let mut config = RunConfig::new(
        conninfo::parse("source", &source.conninfo("postgres"))?,
        conninfo::parse("target", &target.conninfo("postgres"))?,
        vec!["demo_pub".into()],
        "demo_slot".into(),
    );
    config.create_slot = true;
    config.status_interval = Duration::from_secs(1);
    // (Inside a cluster's directory: removed with it.)
    config.spool_dir = Some(target.data_dir.join("pgapply-spool"));
    let (stop_tx, stop_rx) = watch::channel(false);
    let (progress_tx, progress_rx) = watch::channel(RunProgress::default());
    let worker = tokio::spawn(run(config, stop_rx, Some(progress_tx)));

    // Wait for the slot before writing, so the workload is all in the stream.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let row = src
            .query_one(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'demo_slot'",
                &[],
            )
            .await
            .map_err(setup)?;
        if row.get::<_, i64>(0) == 1 {
            break;
        }
        if worker.is_finished() || Instant::now() > deadline || stop_asked() {
            stop_tx.send_replace(true);
            if stop_asked() {
                let _ = worker.await;
                crate::out!("stopped on request: the demo clusters are removed");
                return Ok(());
            }
            return match worker.await {
                Ok(Err(e)) => Err(e),
                _ => Err(Error::definite(
                    "pgapply did not create its slot within 30s",
                )),
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    crate::out!(
        "running a live workload on the source for {} (inserts, updates, deletes)",
        humantime::format_duration(duration)
    );
    let began = Instant::now();
    let mut next_id: i64 = 1;
    let mut last_report = Instant::now();
    let mut txns = 0u64;
    while began.elapsed() < duration && !stop_asked() {
        let statuses = ["new", "paid", "shipped"];
        let sql = format!(
            "BEGIN;
             INSERT INTO orders (id, customer, amount, status, tags) VALUES
               ({a}, 'customer {a}', {a}.25, 'new', ARRAY['demo', 'it''s']),
               ({b}, 'customer {b}', {b}.50, 'new', NULL);
             UPDATE orders SET status = '{s}', amount = amount + 1, updated_at = now() WHERE id = {u};
             DELETE FROM orders WHERE id = {d};
             COMMIT;",
            a = next_id,
            b = next_id + 1,
            s = statuses[(next_id % 3) as usize],
            u = (next_id / 2).max(1),
            d = (next_id / 3).max(1) * 3 - 1,
        );
        src.batch_execute(&sql)
            .await
            .map_err(|e| Error::postgres("running the demo workload", e))?;
        next_id += 2;
        txns += 1;
        if last_report.elapsed() >= Duration::from_secs(1) {
            last_report = Instant::now();
            let lsn = wal_position(&src).await?;
            let applied = progress_rx.borrow().durable;
            crate::out!(
                "  {:>5.1}s  {txns:>6} transactions on the source   source WAL {lsn}   applied {applied}   lag {} bytes",
                began.elapsed().as_secs_f64(),
                lsn.0.saturating_sub(applied.0)
            );
        }
        if worker.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    if stop_asked() {
        stop_tx.send_replace(true);
        let _ = worker.await;
        crate::out!("stopped on request after {txns} transactions: the demo clusters are removed");
        return Ok(());
    }
    let end = wal_position(&src).await?;
    crate::out!("workload done: {txns} transactions; waiting for pgapply to reach {end}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while progress_rx.borrow().durable < end {
        if worker.is_finished() || Instant::now() > deadline || stop_asked() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_tx.send_replace(true);
    let outcome = worker
        .await
        .map_err(|e| Error::definite(format!("the replication task failed: {e}")))??;

    let (s, t) = table_digests(&src, &dst, "public.orders").await?;
    crate::out!(
        "applied {} transactions ({} inserts, {} updates, {} deletes); flushed up to {}",
        outcome.stats.transactions,
        outcome.stats.inserts,
        outcome.stats.updates,
        outcome.stats.deletes,
        outcome.flushed
    );
    crate::out!("source orders: {} rows, md5 {}", s.rows, s.md5);
    crate::out!("target orders: {} rows, md5 {}", t.rows, t.md5);
    if s == t {
        crate::out!("source and target match");
        Ok(())
    } else {
        Err(Error::definite("source and target differ after the demo"))
    }
}
