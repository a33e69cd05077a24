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
    // The former workers' origins are gone, and their commit-order rows with them.
    let slot = db.slot();
    assert_eq!(
        db.count(
            &db.target,
            &format!(
                "SELECT count(*) FROM pgapply.origin_commit WHERE origin_name IN ('pgapply_{slot}-w2', 'pgapply_{slot}-w3')"
            )
        )
        .await,
        0
    );
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

/// A worker's transaction fails once its origin position is set (a test hook: as a COMMIT that
/// fails at its very end). PostgreSQL 16+ moves the origin then, as if it had committed: the
/// transactions after it must still wait (for its row in pgapply.origin_commit, which the abort
/// leaves as it was), the origin is moved back, and the retry applies everything. Can only fail
/// with a 16+ target (CI runs this suite with an 18 one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_transaction_failing_after_its_position_was_set_is_applied_again() {
    let db = TestDb::new("parlate").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    for id in 1..=80 {
        db.source_sql(&format!("INSERT INTO t VALUES ({id}, {id})"))
            .await;
    }
    let endpos = db.source_wal().await;
    let mut cmd = db.pgapply(
        "p",
        &[
            "--endpos",
            &endpos,
            "--apply-workers",
            "3",
            "--retry-min",
            "10ms",
        ],
    );
    cmd.env("PGAPPLY_TEST_FAILPOINT", "fail-commit");
    let out = run_with_deadline(cmd, 120).await;
    let log = stderr(&out);
    assert!(
        out.status.success(),
        "pgapply failed: {}\n{log}",
        out.status
    );
    // The first error reported is the hook's, or that of a transaction that waited for the
    // failed one and found it not committed.
    assert!(
        log.contains("PGAPPLY_TEST_FAILPOINT fail-commit") || log.contains("did not commit"),
        "the hook did not fire:\n{log}"
    );
    if common::clusters().target_major >= 16 {
        assert!(
            log.contains("moved a replication origin back"),
            "the abort moved the worker's origin, and the restart moved it back:\n{log}"
        );
    }
    db.assert_same("t").await;
}

/// A target whose sessions default to repeatable read: a worker that waited for an earlier
/// transaction's commit on another worker must still see that transaction's rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeatable_read_default_on_the_target_loses_nothing() {
    let db = setup("parrr").await;
    db.target_sql(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'",
        db.name
    ))
    .await;
    workload(&db, 300).await;
    sync_parallel(&db, "4").await;
    for table in TABLES {
        db.assert_same(table).await;
    }
}

/// A slot left two-phase by an earlier `--two-phase` run sends prepared transactions whatever is
/// asked; several workers would apply them out of order, so pgapply refuses and says what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_phase_slot_is_refused_with_several_workers() {
    let db = TestDb::new("par2pc").await;
    if common::source_version(&db).await < 140000 {
        common::skip("two-phase slots need a PostgreSQL 14+ source");
        return;
    }
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source
        .execute(
            "SELECT pg_drop_replication_slot($1), pg_create_logical_replication_slot($1, 'pgoutput', false, true)",
            &[&db.slot()],
        )
        .await
        .expect("two-phase slot");
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--endpos", &endpos, "--apply-workers", "2"]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert!(!out.status.success(), "pgapply ran:\n{log}");
    assert!(
        log.contains("two-phase") && log.contains("--apply-workers 1"),
        "the error says why and what to do:\n{log}"
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 0);
    // One worker applies it.
    db.sync("p").await;
    db.assert_same("t").await;
}

/// A unique index added on the target while pgapply runs is unknown to the dispatcher until the
/// source describes the table again: two transactions it let run side by side then clash. That
/// is not the second transaction's fault: the transactions in flight are applied again one at a
/// time, and nothing is lost or refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clash_the_dispatcher_could_not_see_is_retried_one_at_a_time() {
    let db = TestDb::new("parclash").await;
    let target_version: i32 = db
        .target
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    if target_version < 140000 {
        // (Before 14 a backend waiting on a lock does not notice its client is gone:
        // client_connection_check_interval; the retry waits for it.)
        common::skip("needs a PostgreSQL 14+ target");
        return;
    }
    db.both("CREATE TABLE u (id int PRIMARY KEY, email text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE u").await;
    db.source_sql("INSERT INTO u VALUES (1, 'a')").await;
    let mut child = spawn(db.pgapply("p", &["--apply-workers", "2", "--retry-min", "100ms"]));
    wait_for("row 1 on the target", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM u").await == 1
    })
    .await;
    db.target_sql("CREATE UNIQUE INDEX u_email ON u (email)")
        .await;
    // Holds row 1 on the target, so the first transaction (on one worker) waits while the
    // second (on the other) runs into the unique index.
    let blocker = connect(db.target_port, &db.name).await;
    blocker
        .batch_execute("BEGIN; SELECT * FROM u WHERE id = 1 FOR UPDATE")
        .await
        .expect("blocker");
    let walsender = || async {
        db.count(
            &db.source,
            &format!(
                "SELECT coalesce(max(active_pid), 0)::bigint FROM pg_replication_slots WHERE slot_name = '{}' AND active",
                db.slot()
            ),
        )
        .await
    };
    let first = walsender().await;
    db.source_sql("UPDATE u SET email = 'b' WHERE id = 1").await;
    db.source_sql("INSERT INTO u VALUES (2, 'a')").await;
    // The clash ends the first attempt: a new one (a new walsender) starts, or, before the fix,
    // pgapply gives up.
    let mut exited = None;
    wait_for("the clash to end the first attempt", 60, || {
        let status = child.try_wait().expect("try_wait");
        exited = exited.or(status);
        async move {
            status.is_some() || {
                let now = walsender().await;
                now != 0 && now != first
            }
        }
    })
    .await;
    blocker.batch_execute("ROLLBACK").await.expect("rollback");
    assert!(exited.is_none(), "pgapply gave up on the clash: {exited:?}");
    wait_for("both transactions on the target", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM u WHERE (id, email) IN ((1, 'b'), (2, 'a'))",
        )
        .await
            == 2
    })
    .await;
    child.start_kill().expect("kill");
    db.assert_same("u").await;
}

/// A large transaction under parallel workers with a small queue (`--queue-size 1MB`): the
/// dispatcher holds a transaction only up to a quarter of the queue, counted as the queue counts
/// it, and forwards it serially past that (it used to count the wire bytes only, hold more than
/// the whole queue, and wait for ever for messages the reader could not queue). Memory stays
/// bounded with many small transactions after it. (The statements a worker has in flight are
/// bounded too, `pipeline::bound_in_flight`: seen with a target slower than these, 700 MB before,
/// under 100 MB after; not reproduced here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_transaction_behind_a_small_queue_goes_through_parallel_workers() {
    let db = TestDb::new("parmem").await;
    if common::source_version(&db).await < 110000 {
        return common::skip("COMMIT in a DO block needs a PostgreSQL 11+ source");
    }
    db.both("CREATE TABLE big (id int PRIMARY KEY, pad text); CREATE TABLE small (id int PRIMARY KEY, v text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE big, small")
        .await;
    db.sync("p").await;

    // A large transaction (applied serially), then many small ones (in parallel).
    db.source_sql("INSERT INTO big SELECT g, 'x' FROM generate_series(1, 100000) g")
        .await;
    db.source_sql(
        "DO $$ BEGIN FOR i IN 1..40000 LOOP INSERT INTO small VALUES (i, 'x'); COMMIT; END LOOP; END $$",
    )
    .await;
    let endpos = db.source_wal().await;
    let (mut child, log) = common::spawn_logged(db.pgapply(
        "p",
        &[
            "--apply-workers",
            "2",
            "--queue-size",
            "1MB",
            "--endpos",
            &endpos,
        ],
    ));
    let status = tokio::time::timeout(Duration::from_secs(180), child.wait())
        .await
        .expect("the backlog is applied")
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{text}");
    let peak = common::peak_rss_mb(&text);
    assert!(peak < 150, "peak RSS {peak} MB: {text}");
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM small").await,
        40000
    );
    db.assert_same("big").await;
}

/// Asked to stop while a worker waits on the target (a user's lock on a table) and the others
/// wait for its transactions' commits: the workers still waiting after a few seconds are ended
/// (their open transactions roll back), the process exits 0 well before the forced stop, its
/// last line counts what the workers committed before, and a start after the lock is gone
/// applies everything, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_workers_wait_on_the_target_ends_cleanly() {
    let db = setup("parstop").await;
    db.both("CREATE TABLE late (id int PRIMARY KEY)").await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE late").await;
    workload(&db, 200).await;
    // The 600 transactions above commit; this one waits for the lock, and those after it for
    // its commit.
    db.source_sql("INSERT INTO late VALUES (1)").await;
    for w in 7..10 {
        workload_more(&db, w).await;
    }
    let holder = connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE late IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (mut worker, log_path) = common::spawn_logged(db.pgapply("p", &["--apply-workers", "3"]));
    // (Its workers also wait on each other's turn locks: the wait meant is the one on late.)
    wait_for("a worker waiting for the lock on late", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_locks WHERE relation = 'late'::regclass AND NOT granted",
        )
        .await
            > 0
    })
    .await;
    let asked = std::time::Instant::now();
    common::signal(&worker, libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(60), worker.wait())
        .await
        .expect("pgapply stops")
        .unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert_eq!(
        status.code(),
        Some(0),
        "stopped after {:?}\n{log}",
        asked.elapsed()
    );
    assert!(
        asked.elapsed() < Duration::from_secs(25),
        "stopped after {:?}",
        asked.elapsed()
    );
    let counted = common::stopped_count(&log, "transactions");
    // (Not all 600: a worker may have grouped the last few with the one that waits.)
    assert!(counted > Some(500), "{log}");
    // Its sessions are gone from the target too, the lock still held: a backend waiting for it
    // with statements unread in its socket would not notice the client's close by itself, and
    // would keep the origins and row locks the next start needs.
    wait_for("no pgapply session left on the target", 10, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'pgapply'",
        )
        .await
            == 0
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    sync_parallel(&db, "3").await;
    for t in TABLES {
        db.assert_same(t).await;
    }
}

/// A key compared by a case-insensitive (nondeterministic) collation: 'user5' and 'USER5' are one
/// row there, though their bytes differ, so the dispatcher cannot tell by the bytes that two
/// transactions touch the same row: such a table is applied serially. (Without that, an INSERT
/// of 'USER5' ran before the DELETE of 'user5' and, under insert_exists = skip, was lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_a_nondeterministic_collation_are_applied_in_order() {
    let db = TestDb::new("parci").await;
    let icu = db
        .source
        .batch_execute(
            "CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)",
        )
        .await;
    if icu.is_err() {
        return common::skip("the source's PostgreSQL has no ICU collations");
    }
    if db
        .target
        .batch_execute(
            "CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)",
        )
        .await
        .is_err()
    {
        return common::skip("the target's PostgreSQL has no ICU collations");
    }
    db.both(
        "CREATE TABLE u (name text COLLATE ci PRIMARY KEY, v int); \
         CREATE TABLE filler (id int PRIMARY KEY, v int); \
         INSERT INTO u SELECT 'user' || g, 0 FROM generate_series(1, 200) g; \
         INSERT INTO filler SELECT g, 0 FROM generate_series(1, 600) g;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE u, filler").await;
    let mut script = String::new();
    for g in 1..=200 {
        script.push_str(&format!(
            "BEGIN; UPDATE filler SET v = v + 1 WHERE id BETWEEN {} AND {}; DELETE FROM u WHERE name = 'user{g}'; COMMIT; \
             INSERT INTO u VALUES ('USER{g}', 1);",
            g * 3 - 2,
            g * 3
        ));
    }
    db.source.batch_execute(&script).await.unwrap();
    let config = std::env::temp_dir().join(format!("pgapply-parci-{}.toml", std::process::id()));
    std::fs::write(&config, "[conflicts]\ninsert_exists = \"skip\"\n").unwrap();
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--endpos",
                &endpos,
                "--apply-workers",
                "4",
                "--config",
                config.to_str().unwrap(),
            ],
        ),
        120,
    )
    .await;
    let _ = std::fs::remove_file(&config);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM u WHERE name = upper(name)"
        )
        .await,
        200
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM pgapply.conflicts")
            .await,
        0
    );
}

/// A change larger than the whole queue (`--queue-size`), after other changes of its
/// transaction: with workers, those are held until the transaction is known whole or too
/// large, and the large one asking for the whole queue waited for them for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_larger_than_the_queue_is_applied_by_workers() {
    let db = TestDb::new("pbig").await;
    db.both("CREATE TABLE p (id int PRIMARY KEY, t text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE p").await;
    // Stored uncompressed, so that the change is as large as the value (2.2 MB).
    db.both("ALTER TABLE p ALTER COLUMN t SET STORAGE EXTERNAL")
        .await;
    db.source_sql(
        "BEGIN; INSERT INTO p VALUES (1, 'small'); \
         INSERT INTO p SELECT 2, string_agg(md5(i::text), '') FROM generate_series(1, 70000) i; \
         COMMIT;",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--endpos",
                &endpos,
                "--apply-workers",
                "2",
                "--queue-size",
                "1MB",
            ],
        ),
        120,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("p").await;
}
