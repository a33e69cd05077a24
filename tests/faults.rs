//! Fault injection: network cuts and stalls through a TCP proxy, idle periods with unrelated WAL,
//! errors raised by the target (definite and transient). Every test ends with source == target.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{metric, run_with_deadline, spawn, stderr, wait_for, TestDb};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A TCP proxy on 127.0.0.1 in front of a server. `cut()` drops every open connection;
/// `stall(true)` stops forwarding bytes (connections stay open) until `stall(false)`.
struct Proxy {
    port: u16,
    generation: watch::Sender<u64>,
    stalled: Arc<AtomicBool>,
    connections: Arc<AtomicU64>,
    /// Connections numbered below this pass nothing more, for ever (`freeze_open`).
    frozen_below: Arc<AtomicU64>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (generation, _) = watch::channel(0u64);
        let stalled = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(AtomicU64::new(0));
        let frozen_below = Arc::new(AtomicU64::new(0));
        let gen_tx = generation.clone();
        let (stalled2, connections2) = (stalled.clone(), connections.clone());
        let frozen2 = frozen_below.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let number = connections2.fetch_add(1, Ordering::SeqCst);
                let mut cut = gen_tx.subscribe();
                let stalled = stalled2.clone();
                let frozen = frozen2.clone();
                tokio::spawn(async move {
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let pump = |mut r: tokio::net::tcp::OwnedReadHalf,
                                mut w: tokio::net::tcp::OwnedWriteHalf,
                                stalled: Arc<AtomicBool>,
                                frozen: Arc<AtomicU64>| async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            use tokio::io::AsyncReadExt;
                            let n = match r.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            while stalled.load(Ordering::SeqCst)
                                || number < frozen.load(Ordering::SeqCst)
                            {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            if w.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    };
                    tokio::select! {
                        _ = pump(cr, sw, stalled.clone(), frozen.clone()) => {}
                        _ = pump(sr, cw, stalled, frozen) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Proxy {
            port,
            generation,
            stalled,
            connections,
            frozen_below,
        }
    }

    /// The connections open now pass nothing more, for ever, and stay open (a peer gone
    /// silent behind a device that keeps the TCP connection up); new ones pass.
    fn freeze_open(&self) {
        self.frozen_below
            .store(self.connections.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    fn cut(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    fn stall(&self, on: bool) {
        self.stalled.store(on, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_cuts_and_stalls_are_ridden_out() {
    let db = TestDb::new("netcut").await;
    db.both("CREATE TABLE n (id int PRIMARY KEY, v int); CREATE TABLE f (a int, b text); ALTER TABLE f REPLICA IDENTITY FULL;").await;
    db.publish("CREATE PUBLICATION p FOR TABLE n, f").await;
    let source_proxy = Proxy::start(db.source_port).await;
    let target_proxy = Proxy::start(db.target_port).await;
    let source = format!(
        "host=127.0.0.1 port={} user=postgres dbname={}",
        source_proxy.port, db.name
    );
    let target = format!(
        "host=127.0.0.1 port={} user=postgres dbname={}",
        target_proxy.port, db.name
    );
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgapply"));
    cmd.args([
        "run",
        "--source",
        &source,
        "--target",
        &target,
        "--publication",
        "p",
        "--slot",
        &db.slot(),
    ])
    .args([
        "--status-interval",
        "1s",
        "--retry-min",
        "50ms",
        "--retry-max",
        "500ms",
    ])
    .kill_on_drop(true);
    let (mut child, log_path) = common::spawn_logged(cmd);
    let mut total = 0;
    for round in 0..6 {
        for i in 0..50 {
            let id = round * 50 + i;
            db.source_sql(&format!("INSERT INTO n VALUES ({id}, {id}); UPDATE n SET v = v + 1 WHERE id = {}; INSERT INTO f VALUES ({id}, 'x');", id / 2)).await;
        }
        total += 50;
        match round % 3 {
            0 => source_proxy.cut(),
            1 => target_proxy.cut(),
            _ => {
                // A stall longer than nothing, shorter than the silence limit: no data is lost.
                source_proxy.stall(true);
                tokio::time::sleep(Duration::from_millis(300)).await;
                source_proxy.stall(false);
            }
        }
        let expected = total as i64;
        wait_for("target to catch up after the fault", 90, || async {
            db.count(&db.target, "SELECT count(*) FROM f").await == expected
        })
        .await;
    }
    assert!(
        source_proxy.connections.load(Ordering::SeqCst) >= 3,
        "pgapply reconnected to the source"
    );
    let pid = child.id().unwrap() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let _ = child.wait().await;
    db.assert_same("n").await;
    db.assert_same("f").await;
    // The last line counts the whole run's work, not only what its last connection applied:
    // 300 transactions of two inserts each, across the reconnects. (A commit whose reply a cut
    // lost is applied but not counted: the next connection finds it stored and skips it.)
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let field = |name: &str| common::stopped_count(&log, name);
    let applied = field("transactions").unwrap_or_default();
    assert!(
        applied <= total as u64 && applied + 3 >= total as u64,
        "{log}"
    );
    let inserts = field("inserts").unwrap_or_default();
    assert!(
        inserts <= 2 * total as u64 && inserts + 6 >= 2 * total as u64,
        "{log}"
    );
    assert!(field("reconnects") >= Some(2), "{log}");
}

/// The replication connection goes silent for good behind a device that keeps it open, and the
/// source never ends its walsender (wal_sender_timeout = 0), which keeps the slot: pgapply
/// gives the connection up after its silence limit, and at its next start ends that walsender
/// of its own (it was "in use" for ever), then streams on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_own_walsender_cut_off_silently_is_ended() {
    let db = TestDb::new("ownwalsender").await;
    db.both("CREATE TABLE n (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE n").await;
    let proxy = Proxy::start(db.source_port).await;
    let source = format!(
        "host=127.0.0.1 port={} user=postgres dbname={} options='-c wal_sender_timeout=0'",
        proxy.port, db.name
    );
    let mut cmd = db.pgapply_via(&source, &db.target_conninfo(), &db.slot(), "p", &[]);
    cmd.args(["--retry-min", "100ms", "--retry-max", "1s"]);
    let (mut child, log) = common::spawn_logged(cmd);
    db.source_sql("INSERT INTO n VALUES (1)").await;
    wait_for("the first row", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM n").await == 1
    })
    .await;
    proxy.freeze_open();
    db.source_sql("INSERT INTO n VALUES (2)").await;
    // (The silence limit is a minute at least.)
    wait_for("the row written after the cut", 150, || async {
        db.count(&db.target, "SELECT count(*) FROM n").await == 2
    })
    .await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("ended this process's earlier walsender on the source"),
        "{text}"
    );
    // The silence was said before the connection was given up, once.
    let said = text
        .lines()
        .position(|l| l.contains("has sent nothing for") && l.contains("is given up if"));
    let given_up = text.lines().position(|l| l.contains("presumed lost"));
    assert!(said.is_some() && said < given_up, "{text}");
    assert_eq!(
        text.matches("is given up if it stays silent").count(),
        1,
        "{text}"
    );
    common::signal(&child, libc::SIGTERM);
    let _ = child.wait().await;
    db.assert_same("n").await;
}

/// SIGTERM while the reader waits for room in a full queue: the change it holds is dropped, and so
/// is everything after it, so no source transaction lands on the target in part. A run started
/// again applies the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_with_a_full_queue_applies_no_transaction_in_part() {
    let db = TestDb::new("fullq").await;
    db.both("CREATE TABLE pairs (txn int, part int, payload text, PRIMARY KEY (txn, part))")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE pairs").await;
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = spawn(db.pgapply("p", &["--queue-size", "64kB", "--metrics-addr", &addr]));
    db.wait_slot_active().await;
    // The applier waits for this lock, so the queue fills up behind it.
    let locker = common::connect(db.target_port, &db.name).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE pairs IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    for i in 0..200 {
        db.source
            .batch_execute(&format!(
                "BEGIN; INSERT INTO pairs VALUES ({i}, 1, repeat('x', 3000)); \
                 INSERT INTO pairs VALUES ({i}, 2, repeat('y', 3000)); COMMIT"
            ))
            .await
            .unwrap();
    }
    wait_for("the 64 kB queue to fill", 60, || async {
        metric(
            &common::http_get(port, "/metrics").await,
            "pgapply_queue_bytes",
        ) >= 50_000.0
    })
    .await;
    let pid = child.id().expect("pid") as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    // The applier goes on with what it was handed, and stops.
    locker.batch_execute("COMMIT").await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("pgapply stops after SIGTERM")
        .expect("wait");
    assert!(status.success(), "{status}");
    let applied = db.count(&db.target, "SELECT count(*) FROM pairs").await;
    let in_part = db
        .count(
            &db.target,
            "SELECT count(*) FROM (SELECT txn FROM pairs GROUP BY txn HAVING count(*) <> 2) t",
        )
        .await;
    assert_eq!(
        in_part, 0,
        "transactions applied in part ({applied} rows applied)"
    );
    assert!(applied < 400, "the stop came before the end of the backlog");
    db.sync("p").await;
    db.assert_same("pairs").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_publication_lets_the_slot_advance() {
    let db = TestDb::new("idle").await;
    db.both("CREATE TABLE published (id int PRIMARY KEY); CREATE TABLE other (id int)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE published").await;
    db.source_sql("INSERT INTO published VALUES (1)").await;
    let mut child = spawn(db.pgapply("p", &[]));
    wait_for("the first row", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM published").await == 1
    })
    .await;
    // Lots of WAL that is not published.
    db.source_sql("INSERT INTO other SELECT generate_series(1, 20000)")
        .await;
    let wal = db.source_wal().await;
    wait_for("the slot to confirm past the unpublished WAL", 60, || {
        db.slot_confirmed(&wal)
    })
    .await;
    // And a change after the idle period is still applied.
    db.source_sql("INSERT INTO published VALUES (2)").await;
    wait_for("the row after the idle period", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM published").await == 2
    })
    .await;
    // Idle again: the slot confirms past the last applied commit; killed there, the next run
    // knows the target recorded that position before it was reported, and goes on.
    db.source_sql("INSERT INTO other SELECT generate_series(1, 20000)")
        .await;
    let wal = db.source_wal().await;
    wait_for("the slot to confirm past the unpublished WAL", 60, || {
        db.slot_confirmed(&wal)
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
    db.source_sql("INSERT INTO published VALUES (3)").await;
    db.sync("p").await;
    db.assert_same("published").await;
}

/// A slot confirmed past what the target applied (here: dropped and made again while pgapply was
/// stopped, as after a target restored from an older backup) no longer holds the changes between:
/// refused, naming both positions, instead of going on without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_confirmed_past_the_target_is_refused() {
    let db = TestDb::new("lostslot").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.sync("p").await;
    db.source_sql("INSERT INTO t VALUES (2)").await;
    db.drop_slot().await;
    db.source
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&db.slot()],
        )
        .await
        .unwrap();
    db.source_sql("INSERT INTO t VALUES (3)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "replication slot \"{}\" on the source has confirmed changes up to",
            db.slot()
        )) && err.contains("are missing here")
            && err.contains("--copy-data --truncate-target"),
        "{err}"
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 1);
    // Accepted by hand: the run takes the slot's position and goes on from there.
    db.target_sql(&format!(
        "UPDATE pgapply.progress SET reported_lsn = NULL WHERE slot_name = '{}'",
        db.slot()
    ))
    .await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 2);
}

/// The target made again (its database re-created: pgapply's state gone with the rows) while
/// the slot went on: a run on that slot without --copy-data is told that nothing from before
/// the slot's position comes to this target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_used_slot_on_a_target_without_state_is_said() {
    let db = TestDb::new("remade").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.sync("p").await;
    db.target_sql(&format!(
        "DROP SCHEMA pgapply CASCADE; TRUNCATE t; \
         SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname LIKE '%{}%'",
        db.slot()
    ))
    .await;
    db.source_sql("INSERT INTO t VALUES (2)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.lines().any(|l| l.contains("WARN")
            && l.contains(&format!(
                "replication slot \"{}\" exists on the source",
                db.slot()
            ))
            && l.contains("this target has no pgapply state for it")
            && l.contains("--copy-data")),
        "{err}"
    );
    // Once: the next run knows the slot.
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("no pgapply state"),
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_errors_definite_and_transient() {
    let db = TestDb::new("trigger").await;
    db.both("CREATE TABLE g (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE g").await;
    // A trigger that refuses a row (definite) — replica triggers fire under session_replication_role = replica.
    db.target_sql(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.v = 'bad' THEN RAISE EXCEPTION 'row refused by target trigger'; END IF; \
           IF NEW.v = 'full' AND NOT EXISTS (SELECT 1 FROM pg_class WHERE relname = 'disk_ok') THEN \
             RAISE EXCEPTION 'could not extend file' USING ERRCODE = 'disk_full'; END IF; \
           RETURN NEW; END $$; \
         CREATE TRIGGER refuse BEFORE INSERT ON g FOR EACH ROW EXECUTE PROCEDURE refuse(); \
         ALTER TABLE g ENABLE ALWAYS TRIGGER refuse;",
    )
    .await;
    db.source_sql("INSERT INTO g VALUES (1, 'ok'); INSERT INTO g VALUES (2, 'bad');")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert_eq!(out.status.code(), Some(1), "definite: exit 1");
    assert!(
        stderr(&out).contains("row refused by target trigger")
            && stderr(&out).contains("\"public\".\"g\"")
            && stderr(&out).contains("in PL/pgSQL function refuse()"),
        "{}",
        stderr(&out)
    );
    // The run's last word reaches the progress row: the failed transaction's session, handed
    // back to the pool, is not reused for it.
    let state = db
        .target
        .query_one("SELECT state FROM pgapply.progress", &[])
        .await
        .unwrap();
    assert_eq!(
        state.get::<_, String>(0),
        "failed",
        "state after a definite error"
    );
    // `pgapply status` says what it failed with.
    let out = run_with_deadline(
        common::pgapply_command(&[
            "status",
            "--target",
            &db.target_conninfo(),
            "--slot",
            &db.slot(),
        ]),
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains(": failed")
            && text.contains("  error: ")
            && text.contains("row refused by target trigger"),
        "{text}{}",
        stderr(&out)
    );
    db.target_sql("UPDATE g SET v = v WHERE false; CREATE OR REPLACE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.v = 'full' AND NOT EXISTS (SELECT 1 FROM pg_class WHERE relname = 'disk_ok') THEN \
             RAISE EXCEPTION 'could not extend file' USING ERRCODE = 'disk_full'; END IF; RETURN NEW; END $$;").await;
    // Disk full is transient: pgapply retries until the condition clears.
    db.source_sql("INSERT INTO g VALUES (3, 'full')").await;
    let endpos = db.source_wal().await;
    let mut child = spawn(db.pgapply(
        "p",
        &[
            "--endpos",
            &endpos,
            "--retry-min",
            "100ms",
            "--retry-max",
            "300ms",
        ],
    ));
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "still retrying while the disk is full"
    );
    db.target_sql("CREATE TABLE disk_ok ()").await;
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    db.assert_same("g").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_that_changes_nothing_on_the_target_still_moves_the_slot() {
    let db = TestDb::new("nowrite").await;
    db.both("CREATE TABLE x (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE x").await;
    db.source_sql("INSERT INTO x VALUES (1, 'a')").await;
    db.sync("p").await;
    // The row is gone on the target: the update finds nothing (skipped, recorded).
    db.target_sql("DELETE FROM x").await;
    db.source_sql("UPDATE x SET v = 'b' WHERE id = 1").await;
    let wal = db.source_wal().await;
    let mut child = spawn(db.pgapply("p", &[]));
    wait_for("the slot to confirm past the no-op transaction", 60, || {
        db.slot_confirmed(&wal)
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_left_inside_a_transaction_is_not_handed_out_again() {
    let db = TestDb::new("pooltx").await;
    let config: tokio_postgres::Config = db.target_conninfo().parse().unwrap();
    let pool = pgapply::replicate::target_pool(&config, 1).unwrap();
    // (Simple protocol: one message, so a statement outside a block starts its transaction.)
    let in_transaction = "SELECT now() <> statement_timestamp()";
    // One session left in an open transaction, then one in an aborted transaction.
    for leave in ["BEGIN", "BEGIN; SELECT 1/0"] {
        let first = pgapply::replicate::target_connection(&pool, &config)
            .await
            .unwrap();
        let pid = backend_pid(&first).await;
        let _ = first.batch_execute(leave).await;
        drop(first);
        let next = pgapply::replicate::target_connection(&pool, &config)
            .await
            .unwrap();
        let answer = next
            .simple_query(&format!("{in_transaction}, pg_backend_pid()"))
            .await
            .unwrap();
        let Some(row) = answer.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        }) else {
            panic!("no row: {answer:?}");
        };
        assert_eq!(
            row.get(0),
            Some("f"),
            "{leave}: handed out inside a transaction"
        );
        assert_ne!(
            row.get(1),
            Some(pid.to_string().as_str()),
            "{leave}: the same session again"
        );
    }
    // A session outside a transaction is reused as before.
    let first = pgapply::replicate::target_connection(&pool, &config)
        .await
        .unwrap();
    let pid = backend_pid(&first).await;
    drop(first);
    let next = pgapply::replicate::target_connection(&pool, &config)
        .await
        .unwrap();
    let again = backend_pid(&next).await;
    assert_eq!(again, pid, "an idle session is reused");
}

async fn backend_pid(client: &tokio_postgres::Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// A slot the source invalidated (it removed WAL the slot still needed: max_slot_wal_keep_size)
/// stops pgapply at once, with an error that names the slot and the reason and says what to do,
/// instead of retrying for ever. (A source cluster of its own: the setting would invalidate the
/// slots of other tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_is_named_with_what_to_do() {
    let c = common::clusters();
    if c.source_major < 13 {
        common::skip("max_slot_wal_keep_size needs PostgreSQL 13");
        return;
    }
    let source = pgapply::cluster::LocalCluster::start(
        &c.source_bin,
        &["max_slot_wal_keep_size = 1MB", "wal_keep_size = 0"],
    )
    .expect("a source cluster of its own");
    let admin = common::connect(source.port, "postgres").await;
    admin
        .batch_execute(
            "CREATE TABLE t (id int PRIMARY KEY, pad text); CREATE PUBLICATION p FOR TABLE t",
        )
        .await
        .unwrap();
    admin
        .batch_execute("SELECT pg_create_logical_replication_slot('lost_slot', 'pgoutput')")
        .await
        .unwrap();
    let db = TestDb::new("lostslot").await;
    db.target_sql("CREATE TABLE t (id int PRIMARY KEY, pad text)")
        .await;
    // WAL beyond the slot's reach: new segments, then a checkpoint removes the old ones.
    let mut round = 0;
    wait_for("the source to invalidate the slot", 60, || {
        round += 1;
        let admin = &admin;
        async move {
            for sql in [
                format!(
                    "INSERT INTO t SELECT g, repeat('x', 200) \
                     FROM generate_series({round} * 10000, {round} * 10000 + 9999) g"
                ),
                "SELECT pg_switch_wal()".to_owned(),
                "CHECKPOINT".to_owned(),
            ] {
                admin.batch_execute(&sql).await.unwrap();
            }
            admin
                .query_one(
                    "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'lost_slot'",
                    &[],
                )
                .await
                .map(|r| r.get::<_, Option<String>>(0).as_deref() == Some("lost"))
                .unwrap_or(false)
        }
    })
    .await;
    let out = run_with_deadline(
        common::pgapply_command(&[
            "run",
            "--source",
            &source.conninfo("postgres"),
            "--target",
            &db.target_conninfo(),
            "--publication",
            "p",
            "--slot",
            "lost_slot",
        ]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a definite error, not retried: {log}"
    );
    assert!(
        log.contains("\"lost_slot\"")
            && log.contains("was invalidated")
            && log.contains("max_slot_wal_keep_size")
            && log.contains("pg_drop_replication_slot('lost_slot')"),
        "{log}"
    );
    // `status` with the source says so too, not just a lag in bytes.
    let out = run_with_deadline(
        common::pgapply_command(&[
            "status",
            "--source",
            &source.conninfo("postgres"),
            "--target",
            &db.target_conninfo(),
            "--slot",
            "lost_slot",
        ]),
        60,
    )
    .await;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(
        text.contains("slot \"lost_slot\" is invalidated on the source (wal_status lost"),
        "{text}"
    );
}

/// A source whose wal_level is not `logical`: creating the slot fails with the server's words and
/// what to change, not retried; `check` lists the same setting. (A source cluster of its own.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_without_logical_wal_level_says_what_to_set() {
    let c = common::clusters();
    let source = pgapply::cluster::LocalCluster::start(&c.source_bin, &["wal_level = replica"])
        .expect("a source cluster of its own");
    let admin = common::connect(source.port, "postgres").await;
    admin
        .batch_execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION p FOR TABLE t")
        .await
        .unwrap();
    let db = TestDb::new("walreplica").await;
    db.target_sql("CREATE TABLE t (id int PRIMARY KEY)").await;
    let args = |cmd: &'static str| {
        let mut args = vec![
            cmd.to_owned(),
            "--source".to_owned(),
            source.conninfo("postgres"),
            "--target".to_owned(),
            db.target_conninfo(),
            "--publication".to_owned(),
            "p".to_owned(),
            "--slot".to_owned(),
            "wal_replica_slot".to_owned(),
        ];
        if cmd == "run" {
            args.push("--create-slot".to_owned());
        }
        args
    };
    let run = args("run");
    let out = run_with_deadline(
        common::pgapply_command(&run.iter().map(String::as_str).collect::<Vec<_>>()),
        60,
    )
    .await;
    let log = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a definite error, not retried: {log}"
    );
    assert!(
        log.contains("creating replication slot \"wal_replica_slot\"")
            && log.contains("set wal_level = logical in the source's postgresql.conf"),
        "{log}"
    );
    let check = args("check");
    let out = run_with_deadline(
        common::pgapply_command(&check.iter().map(String::as_str).collect::<Vec<_>>()),
        60,
    )
    .await;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert_ne!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("source wal_level is \"replica\": set wal_level = logical"),
        "{text}"
    );
}

/// A source that cannot be reached: pgapply retries with backoff, and once --max-retries are
/// used up it exits 3 (transient: running it again later resumes), naming the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_used_up_exit_3() {
    let db = TestDb::new("retriesout").await;
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let source = format!(
        "host=127.0.0.1 port={closed} user=postgres dbname={}",
        db.name
    );
    let out = run_with_deadline(
        common::pgapply_command(&[
            "run",
            "--source",
            &source,
            "--target",
            &db.target_conninfo(),
            "--publication",
            "p",
            "--slot",
            &db.slot(),
            "--max-retries",
            "2",
            "--retry-min",
            "100ms",
            "--retry-max",
            "200ms",
        ]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{log}");
    assert!(
        log.contains("source") && log.contains(&closed.to_string()),
        "{log}"
    );
}

/// SIGTERM while the initial copy waits (here for a lock a target session holds): the process
/// stops within seconds instead of when the copy is done, and the next run copies it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_the_initial_copy_ends_it_and_the_next_run_copies_again() {
    let db = TestDb::new("stopcopy").await;
    db.both("CREATE TABLE c (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO c SELECT generate_series(1, 1000)")
        .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE c").await;
    let locker = common::connect(db.target_port, &db.name).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE c IN SHARE MODE")
        .await
        .unwrap();
    let mut cmd = db.pgapply("p", &["--copy-data"]);
    // (The warning of a copy that gets nothing done after 2 s instead of a minute.)
    cmd.env("PGAPPLY_TEST_COPY_SILENCE_SECS", "2");
    let (mut child, log) = common::spawn_logged(cmd);
    wait_for("the copy to wait for the lock", 30, || async {
        common::waiting_for_a_lock(&db).await == 1
    })
    .await;
    // A copy that gets nothing done is said, naming the table (not only a growing ETA).
    wait_for("the copy's stall said", 30, || async {
        std::fs::read_to_string(&log).is_ok_and(|t| {
            t.contains("copying: nothing of this table has been copied for 2s")
                && t.contains("\"public\".\"c\"")
        })
    })
    .await;
    let asked = std::time::Instant::now();
    common::signal(&child, libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("pgapply stops during the copy")
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
    db.source_sql("INSERT INTO c VALUES (1001)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("c").await;
}

/// The target's connections are cut while the initial copy waits (here for a lock), and the
/// copy's state cannot be read on the connection that went with them: the process retries the
/// copy by itself and finishes it, and does not tell the user to give the slot up meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_cut_off_from_the_target_is_retried_by_the_same_run() {
    let db = TestDb::new("cutcopy").await;
    db.both("CREATE TABLE c (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO c SELECT generate_series(1, 1000)")
        .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE c").await;
    let proxy = Proxy::start(db.target_port).await;
    let target = format!(
        "host=127.0.0.1 port={} user=postgres dbname={}",
        proxy.port, db.name
    );
    let locker = common::connect(db.target_port, &db.name).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE c IN SHARE MODE")
        .await
        .unwrap();
    let mut cmd = db.pgapply_via(
        &db.source_conninfo(),
        &target,
        &db.slot(),
        "p",
        &["--copy-data", "--retry-min", "50ms", "--retry-max", "500ms"],
    );
    cmd.kill_on_drop(true);
    let (mut child, log_path) = common::spawn_logged(cmd);
    wait_for("the copy to wait for the lock", 30, || async {
        common::waiting_for_a_lock(&db).await == 1
    })
    .await;
    proxy.cut();
    locker.batch_execute("ROLLBACK").await.unwrap();
    wait_for("the copy made again", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM c").await == 1000
    })
    .await;
    db.source_sql("INSERT INTO c VALUES (1001)").await;
    wait_for("streaming after the copy", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM c").await == 1001
    })
    .await;
    common::signal(&child, libc::SIGTERM);
    let _ = child.wait().await;
    db.assert_same("c").await;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(log.contains("retry"), "{log}");
    assert!(!log.contains("pg_drop_replication_slot"), "{log}");
}

/// A graceful stop waits for the open target transaction; a target session holding a row it
/// needs keeps it waiting. A second SIGTERM stops the process at once (exit status 4), and
/// nothing is lost: the next run applies that transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_stops_at_once_when_the_target_holds_a_lock() {
    let db = TestDb::new("stoplock").await;
    db.both("CREATE TABLE l (id int PRIMARY KEY, v int)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE l").await;
    db.source_sql("INSERT INTO l VALUES (1, 0)").await;
    db.sync("p").await;
    let locker = common::connect(db.target_port, &db.name).await;
    locker
        .batch_execute("BEGIN; SELECT * FROM l WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();
    db.source_sql("UPDATE l SET v = 1 WHERE id = 1").await;
    let (mut child, log_path) = common::spawn_logged(db.pgapply("p", &[]));
    wait_for("the apply to wait for the row lock", 30, || async {
        common::waiting_for_a_lock(&db).await == 1
    })
    .await;
    common::signal(&child, libc::SIGTERM);
    wait_for("the first signal to be taken", 30, || async {
        std::fs::read_to_string(&log_path).is_ok_and(|l| l.contains("shutting down"))
    })
    .await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "stopped without the lock"
    );
    common::signal(&child, libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("a second signal stops pgapply at once")
        .unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let _ = std::fs::remove_file(&log_path);
    assert_eq!(status.code(), Some(4), "{log}");
    // Named with the run's slot, as every line of a run (the last one too).
    assert!(
        log.lines().any(
            |l| l.contains("stopping at once after a second signal") && l.contains("run{slot=")
        ),
        "{log}"
    );
    assert!(
        log.lines().any(
            |l| l.contains("shutting down: the transaction being applied")
                && l.contains("run{slot=")
        ),
        "{log}"
    );
    // `status` does not show the gone process as streaming.
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE state = 'stopped' AND pid IS NULL"
        )
        .await,
        1
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
    db.sync("p").await;
    db.assert_same("l").await;
    assert_eq!(db.count(&db.target, "SELECT v::int8 FROM l").await, 1);
}

/// A source whose `wal_sender_timeout` is shorter than twice the status interval: the run sends
/// its status updates at a third of that timeout instead, says so, and replicates. (A full queue
/// behind a slow target stops reading, and then only these updates keep the connection.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_wal_sender_timeout_lowers_the_status_interval() {
    if common::clusters().source_major < 12 {
        common::skip("wal_sender_timeout is set per connection from PostgreSQL 12");
        return;
    }
    let db = TestDb::new("shortwst").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t SELECT generate_series(1, 100)")
        .await;
    let endpos = db.source_wal().await;
    let source = format!(
        "{} options=-cwal_sender_timeout=1500ms",
        db.source_conninfo()
    );
    let out = run_with_deadline(
        db.pgapply_via(
            &source,
            &db.target_conninfo(),
            &db.slot(),
            "p",
            &["--endpos", &endpos],
        ),
        60,
    )
    .await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("this run sends them every 500ms"), "{log}");
    db.assert_same("t").await;
}

/// A target slower than the source, but moving: the reader works through what it received with
/// many short waits for room in the queue. Status updates still go out on time, so the source
/// (here with a 2 s wal_sender_timeout) never ends the connection as unresponsive. (A tester saw
/// a source gone away noticed only after a minute in such a catch-up; this test does not
/// reproduce that, it guards the pace of the updates.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_updates_keep_their_pace_behind_a_slow_target() {
    if common::clusters().source_major < 12 {
        common::skip("wal_sender_timeout is set per connection from PostgreSQL 12");
        return;
    }
    let db = TestDb::new("slowpace").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, pad text)")
        .await;
    db.target_sql(
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.02); RETURN NEW; END $$; \
         CREATE TRIGGER slow BEFORE INSERT ON t FOR EACH ROW EXECUTE FUNCTION slow(); \
         ALTER TABLE t ENABLE ALWAYS TRIGGER slow;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.sync("p").await;
    for i in 0..400 {
        db.source_sql(&format!(
            "INSERT INTO t VALUES ({i}, repeat(md5('{i}'), 300))"
        ))
        .await;
    }
    let endpos = db.source_wal().await;
    let source = format!("{} options=-cwal_sender_timeout=2s", db.source_conninfo());
    let out = run_with_deadline(
        db.pgapply_via(
            &source,
            &db.target_conninfo(),
            &db.slot(),
            "p",
            &["--endpos", &endpos, "--queue-size", "64kB"],
        ),
        120,
    )
    .await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(!log.contains("transient error"), "{log}");
    db.assert_same("t").await;
}

/// The run reached its end position while the applier still waits on the target (a full queue
/// behind a slow target): status updates go on while it finishes, so the source keeps the
/// connection past its wal_sender_timeout and learns, at the end, everything that was applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_updates_go_on_while_the_applier_finishes_after_the_end_position() {
    if common::clusters().source_major < 12 {
        common::skip("wal_sender_timeout is set per connection from PostgreSQL 12");
        return;
    }
    let db = TestDb::new("drainstatus").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t SELECT generate_series(1, 100)")
        .await;
    let endpos = db.source_wal().await;
    let locker = common::connect(db.target_port, &db.name).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let source = format!(
        "{} options=-cwal_sender_timeout=1500ms",
        db.source_conninfo()
    );
    let mut child = spawn(db.pgapply_via(
        &source,
        &db.target_conninfo(),
        &db.slot(),
        "p",
        &["--endpos", &endpos],
    ));
    wait_for("the applier to wait for the lock", 30, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    // The delay under test, not a synchronisation: the applier stays blocked for more than twice
    // the source's wal_sender_timeout after the reader has everything up to the end position.
    tokio::time::sleep(Duration::from_secs(4)).await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("pgapply finished")
        .unwrap();
    assert!(status.success());
    db.assert_same("t").await;
    let confirmed = db
        .count(
            &db.source,
            &format!(
                "SELECT (confirmed_flush_lsn >= '{endpos}')::int::int8 FROM pg_replication_slots WHERE slot_name = '{}'",
                db.slot()
            ),
        )
        .await;
    assert_eq!(confirmed, 1, "the slot learnt what was applied");
}

/// A run that fails as it starts, after a clean stop, says `failed` in `pgapply status`, with
/// its error, not the earlier run's `stopped`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_failing_at_start_after_a_clean_stop_is_failed_in_status() {
    let db = TestDb::new("failstart").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.sync("p").await;
    let state = || async {
        let row = db
            .target
            .query_one(
                "SELECT state, coalesce(last_error, '') FROM pgapply.progress",
                &[],
            )
            .await
            .unwrap();
        (row.get::<_, String>(0), row.get::<_, String>(1))
    };
    assert_eq!(state().await.0, "stopped");
    db.target_sql("DROP TABLE t").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert!(!out.status.success(), "{}", stderr(&out));
    let (now, error) = state().await;
    assert_eq!(now, "failed", "{}", stderr(&out));
    assert!(error.contains("does not exist on the target"), "{error}");
}

/// A stop asked while a new slot waits for a transaction open on the source ends the wait at
/// once (exit 0), and no slot is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_the_slot_waits_for_open_transactions_ends_at_once() {
    let db = TestDb::new("slotwait").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    // (Without the slot `publish` makes: the run makes it.)
    db.source_sql("CREATE PUBLICATION p FOR TABLE t").await;
    let holder = common::connect(db.source_port, &db.name).await;
    holder
        .batch_execute("BEGIN; INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    let mut worker = spawn(db.pgapply("p", &["--create-slot"]));
    wait_for("the slot's creation to wait for the open transaction", 60, || async {
        db.count(
            &db.source,
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' AND wait_event_type = 'Lock' \
             AND datname = current_database()",
        )
        .await
            > 0
    })
    .await;
    common::signal(&worker, libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(15), worker.wait())
        .await
        .expect("the stop ends the wait")
        .unwrap();
    assert!(status.success(), "{status}");
    holder.batch_execute("ROLLBACK").await.unwrap();
    wait_for("no slot left", 30, || async { db.slot_count().await == 0 }).await;
}

/// Stopped (SIGTERM) with a backlog queued (the target held up by a lock meanwhile): the run
/// ends after the transaction being applied, cleanly (exit 0), instead of applying its whole
/// queue first (which behind a slow target outlasts the shutdown's grace and ends in a forced
/// stop). The rest comes again at the next start, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_with_a_backlog_ends_after_the_transaction_being_applied() {
    stop_with_a_backlog("backlogstop", &[]).await;
}

/// The same with parallel workers: the dispatcher hands out no more once asked to stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_with_a_backlog_and_parallel_workers_ends_soon() {
    stop_with_a_backlog("backlogstoppar", &["--apply-workers", "2"]).await;
}

async fn stop_with_a_backlog(name: &str, extra: &[&str]) {
    let db = TestDb::new(name).await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.sync("p").await;
    // 20 transactions of 20,000 rows.
    for n in 0..20 {
        db.source_sql(&format!(
            "INSERT INTO t SELECT g FROM generate_series({}, {}) g",
            n * 20_000 + 1,
            (n + 1) * 20_000
        ))
        .await;
    }
    let endpos = db.source_wal().await;
    let locker = common::connect(db.target_port, &db.name).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let mut args = vec!["--queue-size", "512MB"];
    args.extend_from_slice(extra);
    let (mut child, log) = common::spawn_logged(db.pgapply("p", &args));
    wait_for("the applier to wait for the lock", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    wait_for("the source to send the backlog", 60, || async {
        db.count(
            &db.source,
            &format!(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name <> '' AND sent_lsn >= '{endpos}'"
            ),
        )
        .await
            > 0
    })
    .await;
    common::signal(&child, libc::SIGTERM);
    wait_for("the worker to take the stop", 30, || async {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("shutting down"))
    })
    .await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(25), child.wait())
        .await
        .expect("the worker did not stop within 25 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "exit: {status}");
    let applied = db.count(&db.target, "SELECT count(*) FROM t").await;
    assert!(
        applied < 200_000,
        "{applied} rows: the queue was applied before stopping"
    );
    db.sync("p").await;
    db.assert_same("t").await;
}

/// The target refusing writes as read-only while pgapply runs (here a trigger raising what a
/// target made read-only by ALTER SYSTEM or turned standby raises): a definite stop that says
/// what is wrong, never advice to skip the transaction (not retried: a trigger's or foreign
/// table's refusal would come back for ever); applied once the target takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_turned_read_only_is_named_not_skipped() {
    let db = TestDb::new("readonlyrun").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.target_sql(
        "CREATE FUNCTION ro() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction' USING ERRCODE = '25006'; END $$; \
         CREATE TRIGGER ro BEFORE INSERT ON t FOR EACH ROW EXECUTE FUNCTION ro(); \
         ALTER TABLE t ENABLE ALWAYS TRIGGER ro;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("in a read-only transaction: it was made read-only while pgapply ran")
            && !err.contains("pgapply skip"),
        "{err}"
    );
    db.target_sql("DROP TRIGGER ro ON t").await;
    db.sync("p").await;
    db.assert_same("t").await;
}

/// Where the target of `db` has applied slot `slot` up to (its progress row, or its origin).
async fn applied_position(db: &TestDb, slot: &str) -> String {
    db.target
        .query_one(
            "SELECT greatest(coalesce((SELECT lsn FROM pgapply.progress), '0/0'), \
                    coalesce(pg_replication_origin_progress('pgapply_' || $1, true), '0/0'))::text",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
}

/// Inserts rows into `t` (ids from `first`, value `tag`) until the server's WAL is past `lsn`.
async fn write_past(client: &tokio_postgres::Client, lsn: &str, first: i32, tag: &str) {
    let mut next = first;
    wait_for(
        "the new primary's WAL to pass the target's position",
        60,
        || {
            next += 1000;
            async move {
                client
                    .batch_execute(&format!(
                    "INSERT INTO t SELECT g, '{tag}' FROM generate_series({next}, {next} + 999) g"
                ))
                    .await
                    .unwrap();
                client
                    .query_one("SELECT pg_current_wal_lsn() > $1::text::pg_lsn", &[&lsn])
                    .await
                    .unwrap()
                    .get::<_, bool>(0)
            }
        },
    )
    .await;
}

/// `pgapply run` from publication p of the `postgres` database of the cluster at `port` into
/// `db`'s target, up to `endpos`.
fn run_from_port(port: u16, db: &TestDb, slot: &str, endpos: &str) -> tokio::process::Command {
    let source = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
    let target = db.target_conninfo();
    common::pgapply_command(&[
        "run",
        "--source",
        &source,
        "--target",
        &target,
        "--publication",
        "p",
        "--slot",
        slot,
        "--endpos",
        endpos,
    ])
}

/// The server's current WAL position.
async fn wal(client: &tokio_postgres::Client) -> String {
    let row = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap();
    row.get::<_, String>(0)
}

/// A failover to a standby that was behind: the promoted server's timeline forks below what the
/// target applied from the old primary. pgapply refuses it (the target holds changes that server
/// never had, and its own transactions up to there would be skipped), even once its WAL is past
/// the target's position; a slot whose target applied nothing past the fork goes on from the new
/// timeline. (A source cluster of its own, and a cold copy of it as the standby.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_that_was_behind_is_refused_even_once_its_wal_is_ahead() {
    let c = common::clusters();
    let mut primary = pgapply::cluster::LocalCluster::start(&c.source_bin, &[])
        .expect("a source cluster of its own");
    let admin = common::connect(primary.port, "postgres").await;
    for sql in [
        "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "CREATE PUBLICATION p FOR TABLE t",
        "SELECT pg_create_logical_replication_slot('fork_slot', 'pgoutput')",
        "SELECT pg_create_logical_replication_slot('ok_slot', 'pgoutput')",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let ahead = TestDb::new("tlfork").await;
    let behind = TestDb::new("tlok").await;
    for db in [&ahead, &behind] {
        db.target_sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
            .await;
    }
    let apply = run_from_port;
    admin
        .batch_execute("INSERT INTO t SELECT g, 'before' FROM generate_series(1, 10) g")
        .await
        .unwrap();
    let endpos = wal(&admin).await;
    for (db, slot) in [(&ahead, "fork_slot"), (&behind, "ok_slot")] {
        let out = run_with_deadline(apply(primary.port, db, slot, &endpos), 60).await;
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let recorded: Option<i64> = ahead
        .target
        .query_one("SELECT source_timeline FROM pgapply.progress", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, Some(1));
    // The standby: a copy taken now, so it lacks what the primary writes next.
    drop(admin);
    primary.stop("fast").unwrap();
    let mut standby = primary.copy_of_stopped().unwrap();
    primary.start_again().unwrap();
    let admin = common::connect(primary.port, "postgres").await;
    admin
        .batch_execute("INSERT INTO t SELECT g, 'lost' FROM generate_series(11, 20) g")
        .await
        .unwrap();
    let endpos = wal(&admin).await;
    let out = run_with_deadline(apply(primary.port, &ahead, "fork_slot", &endpos), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let applied = applied_position(&ahead, "fork_slot").await;
    // The primary fails; the standby takes over and writes on, past that position.
    drop(admin);
    primary.stop("immediate").unwrap();
    standby.make_standby().unwrap();
    standby.start_again().unwrap();
    standby.promote().unwrap();
    let new_primary = common::connect(standby.port, "postgres").await;
    write_past(&new_primary, &applied, 100, "new").await;
    let endpos = wal(&new_primary).await;
    let out = run_with_deadline(apply(standby.port, &ahead, "fork_slot", &endpos), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the source is on timeline 2, which forked from timeline 1 at")
            && err.contains(&format!("up to {applied}"))
            && err.contains("pgapply verify"),
        "{err}"
    );
    // The slot whose target stopped before the fork goes on, from the new timeline.
    let out = run_with_deadline(apply(standby.port, &behind, "ok_slot", &endpos), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let expected: i64 = new_primary
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        behind.count(&behind.target, "SELECT count(*) FROM t").await,
        expected
    );
    let recorded: Option<i64> = behind
        .target
        .query_one("SELECT source_timeline FROM pgapply.progress", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, Some(2));
    let applied = applied_position(&behind, "ok_slot").await;
    // Another copy of the old primary, as it was when it failed, promoted too: without a
    // shared archive it takes timeline 2 as well, begun at another point.
    let mut second = primary.copy_of_stopped().unwrap();
    second.make_standby().unwrap();
    second.start_again().unwrap();
    second.promote().unwrap();
    let other = common::connect(second.port, "postgres").await;
    write_past(&other, &applied, 100_000, "other").await;
    let endpos = wal(&other).await;
    let out = run_with_deadline(apply(second.port, &behind, "ok_slot", &endpos), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("two servers were promoted to the same timeline number"),
        "{err}"
    );
}

/// A run refused by a promoted standby (the slot is not there) records nothing of that server:
/// the old primary, back and still holding the slot, is taken again (its timeline was refused
/// as "not the server those changes came from" when the refused start had recorded the new one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_refused_by_a_promoted_standby_leaves_the_old_primary_usable() {
    let c = common::clusters();
    let mut primary = pgapply::cluster::LocalCluster::start(&c.source_bin, &[])
        .expect("a source cluster of its own");
    let admin = common::connect(primary.port, "postgres").await;
    for sql in [
        "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "CREATE PUBLICATION p FOR TABLE t",
        "SELECT pg_create_logical_replication_slot('back_slot', 'pgoutput')",
        "INSERT INTO t SELECT g, 'before' FROM generate_series(1, 10) g",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let db = TestDb::new("tlback").await;
    db.target_sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
        .await;
    let apply = |port: u16, endpos: &str| run_from_port(port, &db, "back_slot", endpos);
    let out = run_with_deadline(apply(primary.port, &wal(&admin).await), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    // A standby of it promoted, without the slot (a base backup does not take slots).
    drop(admin);
    primary.stop("fast").unwrap();
    let mut standby = primary.copy_of_stopped().unwrap();
    standby.make_standby().unwrap();
    standby.start_again().unwrap();
    standby.promote().unwrap();
    let promoted = common::connect(standby.port, "postgres").await;
    promoted
        .batch_execute("SELECT pg_drop_replication_slot('back_slot')")
        .await
        .unwrap();
    let out = run_with_deadline(apply(standby.port, &wal(&promoted).await), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no longer exists on the source"), "{err}");
    let recorded: Option<i64> = db
        .target
        .query_one("SELECT source_timeline FROM pgapply.progress", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        recorded,
        Some(1),
        "the refused start recorded the promoted server's timeline"
    );
    // The failover is given up: the old primary comes back, with the slot, and goes on.
    drop(promoted);
    standby.stop("fast").unwrap();
    primary.start_again().unwrap();
    let admin = common::connect(primary.port, "postgres").await;
    admin
        .batch_execute("INSERT INTO t SELECT g, 'after' FROM generate_series(11, 20) g")
        .await
        .unwrap();
    let out = run_with_deadline(apply(primary.port, &wal(&admin).await), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 20);
}

/// `target_session_attrs=read-write` with several hosts in --source: a host whose sessions are
/// read-only (a standby, or an old primary back as one) is passed over for the next, as libpq
/// does. (A read-only cluster of its own as the first host.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_first_host_is_passed_over_for_one_that_takes_writes() {
    let c = common::clusters();
    let read_only = pgapply::cluster::LocalCluster::start(
        &c.source_bin,
        &["default_transaction_read_only = on"],
    )
    .expect("a read-only cluster of its own");
    let db = TestDb::new("tsattrs").await;
    let admin = common::connect(read_only.port, "postgres").await;
    admin
        .batch_execute("SET default_transaction_read_only = off")
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {}", db.name))
        .await
        .unwrap();
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1), (2)").await;
    let endpos = db.source_wal().await;
    let source = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres dbname={} target_session_attrs=read-write",
        read_only.port, db.source_port, db.name
    );
    let out = run_with_deadline(
        db.pgapply_via(
            &source,
            &db.target_conninfo(),
            &db.slot(),
            "p",
            &["--endpos", &endpos],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!("(connected to 127.0.0.1:{})", db.source_port)),
        "{err}"
    );
    db.assert_same("t").await;
}

/// Every pgapply session on the target ended while nothing is applied (as a target restart
/// does): the idle apply session's loss is found within seconds and the run starts again,
/// rather than at the next change while `status` says streaming; that change then arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_apply_session_ended_on_the_target_is_replaced() {
    let db = TestDb::new("idlegone").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let (mut worker, log) = common::spawn_logged(db.pgapply("p", &[]));
    wait_for("the first row", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 1
    })
    .await;
    db.target_sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'pgapply' AND pid <> pg_backend_pid()",
    )
    .await;
    wait_for("the closed apply session to be found", 60, || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("the apply session's connection to the target was closed")
    })
    .await;
    db.source_sql("INSERT INTO t VALUES (2)").await;
    wait_for("the second row", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 2
    })
    .await;
    common::signal(&worker, libc::SIGTERM);
    let status = worker.wait().await.unwrap();
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

/// A second `run` for a slot another worker streams waits for it (a warm standby) and, however
/// long it has waited, takes over within seconds once the other is gone: its back-off is capped
/// at 5 s while the slot is in use (it reached a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_standby_takes_over_within_seconds_however_long_it_waited() {
    let db = TestDb::new("standby").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let (mut first, _) = common::spawn_logged(db.pgapply("p", &[]));
    db.source_sql("INSERT INTO t VALUES (1)").await;
    wait_for("the first worker to apply", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 1
    })
    .await;
    let (mut standby, log) = common::spawn_logged(db.pgapply("p", &["--retry-max", "60s"]));
    // Five tries: the back-off before the next one would be 8 to 16 s uncapped.
    let tries = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                l.contains("is in use on the source") || l.contains("the slot is still in use")
            })
            .count()
    };
    wait_for("the standby's fifth try", 90, || async { tries() >= 5 }).await;
    first.kill().await.unwrap();
    let gone = std::time::Instant::now();
    db.source_sql("INSERT INTO t VALUES (2)").await;
    wait_for("the standby to take over", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 2
    })
    .await;
    let took = gone.elapsed();
    standby.start_kill().unwrap();
    let _ = standby.wait().await;
    assert!(
        took < std::time::Duration::from_secs(7),
        "took over after {took:?}: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}
