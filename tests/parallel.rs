//! Parallel apply (`--apply-workers`): transactions spread over several target connections land
//! exactly as applied one at a time, in source order, also across kill -9.

mod common;

use std::time::Duration;

use common::{connect, run_with_deadline, spawn, stderr, wait_for, TestDb};

const TABLES: &[&str] = &["acct", "log", "child", "coded", "side"];

async fn setup(prefix: &str) -> TestDb {
    let db = TestDb::new(prefix).await;
    // acct and log run in parallel (their only unique index is the key); child has a foreign
    // key and coded a second unique index, so transactions touching them are serial; side is
    // truncated midway.
    db.both(
        "CREATE TABLE acct (id int PRIMARY KEY, bal bigint NOT NULL); \
         CREATE TABLE log (w int, i int, a int, PRIMARY KEY (w, i)); \
         CREATE TABLE coded (id int PRIMARY KEY, code int UNIQUE); \
         CREATE TABLE child (id int PRIMARY KEY, cid int REFERENCES coded (id), note text); \
         CREATE TABLE side (id int PRIMARY KEY); \
         INSERT INTO acct SELECT g, g FROM generate_series(1, 20) g; \
         INSERT INTO coded SELECT g, g FROM generate_series(1, 10) g;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE acct, log, child, coded, side")
        .await;
    db
}

/// Three concurrent writers. Every transaction updates a hot account (in an order-sensitive
/// way) and inserts a log row; some update or delete a log row an earlier transaction inserted,
/// so a transaction applied before the one it depends on would find no row.
async fn workload(db: &TestDb, per_writer: usize) {
    let mut writers = Vec::new();
    for w in 0..3usize {
        let client = connect(db.source_port, &db.name).await;
        writers.push(tokio::spawn(async move {
            for i in 0..per_writer {
                let a = (i * 7 + w * 3) % 20 + 1;
                let mut sql = format!(
                    "BEGIN; UPDATE acct SET bal = (bal * 31 + {i}) % 1000003 WHERE id = {a}; \
                     INSERT INTO log VALUES ({w}, {i}, {a});"
                );
                if i % 10 == 9 {
                    sql += &format!(
                        "DELETE FROM log WHERE w = {w} AND i = {}; \
                         UPDATE log SET a = a * 2 + 1 WHERE w = {w} AND i = {};",
                        i - 5,
                        i - 3
                    );
                }
                if i % 25 == 0 {
                    sql += &format!(
                        "INSERT INTO child VALUES ({}, {}, 'x');",
                        w * 10_000 + i,
                        a % 10 + 1
                    );
                }
                if i % 40 == 0 {
                    sql += &format!(
                        "UPDATE coded SET code = code + 100 WHERE id = {};",
                        (i / 40) % 10 + 1
                    );
                }
                if i % 5 == 0 {
                    sql += &format!("INSERT INTO side VALUES ({});", w * 10_000 + i);
                }
                if w == 0 && i == per_writer / 2 {
                    sql += "TRUNCATE side;";
                }
                sql += "COMMIT;";
                client.batch_execute(&sql).await.expect("workload");
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
}

async fn sync_parallel(db: &TestDb, workers: &str) -> String {
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--endpos", &endpos, "--apply-workers", workers]),
        180,
    )
    .await;
    let log = stderr(&out);
    assert!(
        out.status.success(),
        "pgapply failed: {}\n{log}",
        out.status
    );
    log
}

/// How many of the slot's parallel worker origins (beyond the first) have committed something.
async fn busy_worker_origins(db: &TestDb) -> i64 {
    db.count(
        &db.target,
        &format!(
            "SELECT count(*) FROM pg_replication_origin o \
             WHERE o.roname LIKE 'pgapply\\_{}-w%' \
               AND pg_replication_origin_progress(o.roname, false) IS NOT NULL",
            db.slot()
        ),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_workers_land_exactly_what_one_connection_would() {
    let db = setup("parallel").await;
    workload(&db, 400).await;
    let log = sync_parallel(&db, "4").await;
    assert!(
        log.contains("applying with parallel workers"),
        "no parallel apply in the log:\n{log}"
    );
    for table in TABLES {
        db.assert_same(table).await;
    }
    assert!(
        busy_worker_origins(&db).await >= 1,
        "no transaction was committed by a worker other than the first:\n{log}"
    );
    // A second run goes on from the position the workers reached together.
    workload_more(&db, 8).await;
    sync_parallel(&db, "2").await;
    for table in TABLES {
        db.assert_same(table).await;
    }
    // And one connection again, from the same position.
    workload_more(&db, 9).await;
    db.sync("p").await;
    for table in TABLES {
        db.assert_same(table).await;
    }
}

async fn workload_more(db: &TestDb, w: i32) {
    db.source_sql(&format!(
        "UPDATE acct SET bal = bal + 1; INSERT INTO log SELECT {w}, g, g FROM generate_series(1, 50) g"
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_workers_survive_kill_9_exactly() {
    let db = setup("parcrash").await;
    workload(&db, 500).await;
    let total = db.count(&db.source, "SELECT count(*) FROM log").await;
    let mut seed = std::process::id() as u64;
    for round in 0..5 {
        let before = db.count(&db.target, "SELECT count(*) FROM log").await;
        if before >= total {
            break;
        }
        let mut child = spawn(db.pgapply("p", &["--apply-workers", "3"]));
        wait_for("pgapply to apply something", 60, || async {
            db.count(&db.target, "SELECT count(*) FROM log").await > before
        })
        .await;
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        tokio::time::sleep(Duration::from_millis((seed >> 33) % 200)).await;
        child.start_kill().expect("kill -9");
        let status = child.wait().await.expect("wait");
        assert!(
            !status.success(),
            "round {round}: pgapply exited by itself: {status}"
        );
    }
    // Applied twice would stop on a duplicate key; lost would differ.
    sync_parallel(&db, "3").await;
    for table in TABLES {
        db.assert_same(table).await;
    }
}

/// A transaction that fails on the target stops every later one, whichever worker has it: none
/// commits after it (they would be skipped after a restart), and a rerun once the cause is gone
/// applies everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_commits_after_a_failed_transaction() {
    let db = TestDb::new("parfail").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    db.target_sql("ALTER TABLE t ADD CONSTRAINT small CHECK (v < 100)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    for id in 1..=60 {
        let v = if id == 30 { 500 } else { id };
        db.source_sql(&format!("INSERT INTO t VALUES ({id}, {v})"))
            .await;
    }
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--endpos",
                &endpos,
                "--apply-workers",
                "3",
                "--max-retries",
                "3",
            ],
        ),
        120,
    )
    .await;
    let log = stderr(&out);
    assert!(
        !out.status.success(),
        "the CHECK violation stops pgapply:\n{log}"
    );
    assert!(
        log.contains("small"),
        "the error names the constraint:\n{log}"
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM t WHERE id >= 30")
            .await,
        0,
        "a transaction after the failed one committed:\n{log}"
    );
    db.target_sql("ALTER TABLE t DROP CONSTRAINT small").await;
    sync_parallel(&db, "3").await;
    db.assert_same("t").await;
}
