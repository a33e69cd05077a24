//! kill -9 of pgapply at arbitrary moments under load, restarted each time: the target ends equal
//! to the source, with no change lost and none applied twice (a table without a key under
//! REPLICA IDENTITY FULL would show a double apply as an extra row).

mod common;

use std::time::Duration;

use common::{
    cleaning_prepared, connect, run_with_deadline, skip, source_version, spawn, stderr, wait_for,
    TestDb,
};

/// Kills per run; `PGAPPLY_SOAK_KILLS` raises it for long runs.
fn kills() -> usize {
    std::env::var("PGAPPLY_SOAK_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_load_loses_and_duplicates_nothing() {
    let db = TestDb::new("crash").await;
    db.both(
        "CREATE TABLE acct (id int PRIMARY KEY, bal bigint NOT NULL); \
         CREATE TABLE hist (aid int, delta int, note text); ALTER TABLE hist REPLICA IDENTITY FULL; \
         INSERT INTO acct SELECT g, 0 FROM generate_series(1, 100) g;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE acct, hist")
        .await;

    // Two concurrent writers, so commits interleave in another order than they began.
    let transactions = 300 * kills();
    let mut writers = Vec::new();
    for w in 0..2 {
        let client = connect(db.source_port, &db.name).await;
        writers.push(tokio::spawn(async move {
            for i in 0..transactions / 2 {
                let a = (i * 7 + w * 13) % 100 + 1;
                let sql = format!(
                    "BEGIN; UPDATE acct SET bal = bal + {i} WHERE id = {a}; \
                     INSERT INTO hist VALUES ({a}, {i}, 'w{w}'), ({a}, {i}, 'w{w}'); \
                     DELETE FROM hist WHERE ctid = (SELECT ctid FROM hist WHERE aid = {a} AND note = 'w{w}' LIMIT 1); COMMIT;"
                );
                client.batch_execute(&sql).await.expect("workload");
            }
        }));
    }

    let mut seed = std::process::id() as u64;
    let mut next_random = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed >> 33
    };
    for round in 0..kills() {
        let before = db.count(&db.target, "SELECT count(*) FROM hist").await;
        let mut child = spawn(db.pgapply("p", &[]));
        // Let it make some progress, then kill it at a random moment.
        wait_for("pgapply to apply something", 60, || async {
            db.count(&db.target, "SELECT count(*) FROM hist").await > before
                || writers.iter().all(|w| w.is_finished())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(next_random() % 300)).await;
        child.start_kill().expect("kill -9");
        let status = child.wait().await.expect("wait");
        assert!(
            !status.success(),
            "round {round}: pgapply exited by itself: {status}"
        );
    }
    for w in writers {
        w.await.expect("writer");
    }
    db.sync("p").await;
    db.assert_same("acct").await;
    db.assert_same("hist").await;
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM hist").await,
        transactions as i64
    );
}

/// pgapply's exit status at a `PGAPPLY_TEST_FAILPOINT` (src/failpoint.rs).
const FAILPOINT_EXIT: i32 = 86;

/// Runs pgapply up to the source's current position, stopping at the failpoint just before the
/// message that commits (or prepares) a group, as if the connection to the target were lost
/// there; the target must still hold none of the group's rows.
async fn run_into_lost_commit(db: &TestDb, table: &str, extra: &[&str]) {
    run_to_failpoint(db, "exit-before-commit", table, extra).await;
}

/// Runs pgapply up to the source's current position with `failpoint` armed, expects it to exit
/// there, and the target to hold none of `table`'s rows from that run.
async fn run_to_failpoint(db: &TestDb, failpoint: &str, table: &str, extra: &[&str]) {
    let endpos = db.source_wal().await;
    let mut args = vec!["--endpos", endpos.as_str()];
    args.extend_from_slice(extra);
    let mut cmd = db.pgapply("p", &args);
    cmd.env("PGAPPLY_TEST_FAILPOINT", failpoint);
    let out = run_with_deadline(cmd, 120).await;
    assert_eq!(
        out.status.code(),
        Some(FAILPOINT_EXIT),
        "pgapply did not stop at the failpoint: {}",
        stderr(&out)
    );
    let sql = format!("SELECT count(*) FROM {table}");
    assert_eq!(
        db.count(&db.target, &sql).await,
        0,
        "rows of a group that never committed"
    );
}

/// PostgreSQL 16+ moves a session's replication origin to the position set in a transaction
/// when that transaction aborts, as when it commits. If the position were set by a message of
/// its own, a connection lost before the COMMIT arrived would leave the origin past a group that
/// never committed, and the next run would skip it. Can only fail with a 16+ target (CI runs
/// this suite with an 18 one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_before_the_commit_loses_nothing() {
    let db = TestDb::new("lostcommit").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.sync("p").await;
    db.source_sql("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        .await;
    db.source_sql("UPDATE t SET v = 'c' WHERE id = 2").await;
    run_into_lost_commit(&db, "t", &[]).await;
    db.sync("p").await;
    db.assert_same("t").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 2);
}

/// The same for a prepared transaction (`--two-phase`): the origin position is set with the
/// PREPARE TRANSACTION, so that a connection lost before it leaves nothing prepared and nothing
/// counted as applied; the next run prepares it, and the COMMIT PREPARED applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_before_the_prepare_loses_nothing() {
    let db = TestDb::new("lostprepare").await;
    if source_version(&db).await < 150000 {
        skip("--two-phase needs a PostgreSQL 15 source");
        return;
    }
    let gid = format!("lost_{}", db.name);
    cleaning_prepared(&db, &gid, lost_prepare(&db, &gid)).await;
}

async fn lost_prepare(db: &TestDb, gid: &str) {
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    // The slot is pgapply's own (with two-phase support).
    db.source_sql("CREATE PUBLICATION p FOR TABLE t").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--two-phase", "--create-slot", "--endpos", &endpos]),
        120,
    )
    .await;
    assert!(out.status.success(), "first run: {}", stderr(&out));
    db.source_sql(&format!(
        "BEGIN; INSERT INTO t VALUES (1, 'a'); PREPARE TRANSACTION '{gid}';"
    ))
    .await;
    run_into_lost_commit(db, "t", &["--two-phase"]).await;
    let prepared = "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()";
    assert_eq!(
        db.count(&db.target, prepared).await,
        0,
        "prepared before the failpoint"
    );
    // The next run prepares it on the target...
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--two-phase", "--endpos", &endpos]), 120).await;
    assert!(out.status.success(), "second run: {}", stderr(&out));
    assert_eq!(
        db.count(&db.target, prepared).await,
        1,
        "the transaction is prepared on the target"
    );
    // ...and COMMIT PREPARED on the source commits it there.
    db.source_sql(&format!("COMMIT PREPARED '{gid}'")).await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--two-phase", "--endpos", &endpos]), 120).await;
    assert!(out.status.success(), "third run: {}", stderr(&out));
    db.assert_same("t").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 1);
}

/// A COMMIT that fails once the group's origin position is set (a test hook: as one failing at
/// its very end), and the process gone before it could move the origin back: PostgreSQL 16+
/// moved the origin with the abort. The next run finds the origin ahead of its row in
/// pgapply.origin_commit, which the abort left as it was, moves it back and applies the group.
/// Can only fail with a 16+ target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_moved_by_a_failed_commit_is_moved_back_by_the_next_run() {
    let db = TestDb::new("abortmoved").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.sync("p").await;
    db.source_sql("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        .await;
    run_to_failpoint(&db, "fail-commit-then-exit", "t", &[]).await;
    let out = db.sync("p").await;
    db.assert_same("t").await;
    if common::clusters().target_major >= 16 {
        assert!(
            stderr(&out).contains("moved a replication origin back"),
            "{}",
            stderr(&out)
        );
    }
}

/// A group goes out before the previous group's COMMIT is answered, and commits only if the
/// server finds that one committed (`pgapply.check_committed`). Here the previous COMMIT fails:
/// the later group must not commit without it (its position would make the next run skip the
/// failed one). A target session holds a row the first group updates, so the second group is
/// sent while the first still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_sent_behind_a_failing_commit_does_not_commit_without_it() {
    let db = TestDb::new("chained").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1, 'first')").await;
    db.sync("p").await;
    let locker = common::connect(db.target_port, &db.name).await;
    locker
        .batch_execute("BEGIN; SELECT * FROM t WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = db.pgapply(
        "p",
        &[
            "--retry-min",
            "10ms",
            "--log-level",
            "debug",
            "--metrics-addr",
            &addr,
        ],
    );
    cmd.env("PGAPPLY_TEST_FAILPOINT", "fail-commit");
    let (mut child, log_path) = common::spawn_logged(cmd);
    // The first group: its UPDATE waits for the row; its COMMIT is sent behind it. (Its INSERT
    // has the INSERT statements prepared before: a prepare would wait behind the UPDATE.)
    db.source_sql("INSERT INTO t VALUES (0, 'second'); UPDATE t SET v = 'updated' WHERE id = 1")
        .await;
    common::wait_for("the first group to wait for the row", 30, || async {
        common::waiting_for_a_lock(&db).await == 1
    })
    .await;
    // Later transactions form the second group; it closes when it is old enough (at a
    // transaction's end), while the first COMMIT is unanswered.
    let next = std::sync::atomic::AtomicI32::new(2);
    common::wait_for("the second group sent behind the first", 30, || async {
        let id = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // (Each also updates the first group's new row: applied without it, after the failed
        // COMMIT, the update finds nothing, which must not be reported as a conflict.)
        db.source_sql(&format!(
            "INSERT INTO t VALUES ({id}, 'second'); UPDATE t SET v = 'second' WHERE id = 0"
        ))
        .await;
        std::fs::read_to_string(&log_path)
            .is_ok_and(|l| l.contains("group sent before the previous COMMIT is answered"))
    })
    .await;
    let second = i64::from(next.load(std::sync::atomic::Ordering::SeqCst)) - 2;
    locker.batch_execute("ROLLBACK").await.unwrap();
    common::wait_for("both changes applied", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM t WHERE (id = 1 AND v = 'updated') OR v = 'second'",
        )
        .await
            == 2 + second
    })
    .await;
    // The changes of the two groups rolled back count once, when applied again.
    let inserts = 1 + second;
    common::wait_for("the counters to settle", 30, || async {
        let m = common::http_get(port, "/metrics").await;
        common::metric(&m, "pgapply_transactions_total") >= (1 + second) as f64
    })
    .await;
    let m = common::http_get(port, "/metrics").await;
    assert!(
        m.contains(&format!(
            "pgapply_rows_total{{operation=\"insert\"}} {inserts}\n"
        )) && m.contains(&format!(
            "pgapply_rows_total{{operation=\"update\"}} {}\n",
            1 + second
        )),
        "{m}"
    );
    assert!(
        m.contains("pgapply_conflicts_total{type=\"update_missing\"} 0\n"),
        "{m}"
    );
    common::signal(&child, libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("pgapply stops")
        .unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let _ = std::fs::remove_file(&log_path);
    assert!(status.success(), "{log}");
    assert!(
        log.contains("PGAPPLY_TEST_FAILPOINT fail-commit"),
        "the first COMMIT did not fail:\n{log}"
    );
    assert!(!log.contains("update_missing"), "{log}");
    // Had the second group committed, the retry would have resumed after it, without the
    // first group's UPDATE.
    db.assert_same("t").await;
}

/// Puts back, under the slot's name, a copy of the slot taken before anything was applied: the
/// source then streams from before what the target already applied, as after a crash between
/// a target commit and the source's confirmation. (Slot copies are PostgreSQL 12+.)
async fn rewind_slot(db: &TestDb, copy: &str) {
    // The walsender of a run that just ended may hold the slot a moment longer.
    wait_for("the slot to be free", 30, || async {
        db.count(
            &db.source,
            &format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}' AND active",
                db.slot()
            ),
        )
        .await
            == 0
    })
    .await;
    db.drop_slot().await;
    db.source
        .execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[&copy, &db.slot()],
        )
        .await
        .unwrap();
}

async fn copy_slot(db: &TestDb) -> Option<String> {
    if source_version(db).await < 120000 {
        skip("slots can be copied from PostgreSQL 12");
        return None;
    }
    let copy = format!("{}_copy", db.slot());
    db.source
        .execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[&db.slot(), &copy],
        )
        .await
        .unwrap();
    Some(copy)
}

/// A run in origin mode applied transactions the source did not hear about; the next run's
/// target role may not use origins (progress table mode): it resumes after what the origin mode
/// applied (its rows in pgapply.origin_commit), not from the source's older position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_without_origin_rights_resumes_after_what_origin_mode_applied() {
    let db = TestDb::new("modeswitch").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let Some(copy) = copy_slot(&db).await else {
        return;
    };
    db.source_sql("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        .await;
    db.sync("p").await;
    rewind_slot(&db, &copy).await;
    let writer = format!("writer_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {writer} LOGIN PASSWORD 'w'; GRANT ALL ON t TO {writer}; \
         GRANT USAGE ON SCHEMA pgapply TO {writer}; GRANT ALL ON ALL TABLES IN SCHEMA pgapply TO {writer}; \
         GRANT ALL ON ALL SEQUENCES IN SCHEMA pgapply TO {writer};"
    ))
    .await;
    db.source_sql("INSERT INTO t VALUES (3, 'c')").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_as_target_user(&writer, "w", &["--endpos", &endpos, "--max-retries", "1"]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("pgapply.progress"), "table mode: {log}");
    db.assert_same("t").await;
}

/// Deleting the slot's row from pgapply.progress starts it over (as the error about a slot name
/// pointed at another source says): positions left in its origins no longer count, or the run
/// would skip every transaction below them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_progress_row_starts_the_slot_over() {
    let db = TestDb::new("startover").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let Some(copy) = copy_slot(&db).await else {
        return;
    };
    db.source_sql("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        .await;
    db.sync("p").await;
    // Start over: the target emptied, its progress forgotten, the slot from the beginning.
    db.target_sql("TRUNCATE t; DELETE FROM pgapply.progress")
        .await;
    rewind_slot(&db, &copy).await;
    let out = db.sync("p").await;
    assert!(
        stderr(&out).contains("positions an earlier run left"),
        "{}",
        stderr(&out)
    );
    db.assert_same("t").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 2);
}

/// The latest of a slot's origins (parallel workers, the --streaming parallel helper) is where a
/// run resumes, compared as positions: '0/F000000' is before '0/10000000', though its text
/// sorts after. (Compared as text, a run resumed at the earlier one and applied again what lay
/// between.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_latest_origin_is_found_by_position_not_by_text() {
    let db = TestDb::new("lsnorder").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--apply-workers", "2", "--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    // The source's WAL past 0/10000000: a segment switch per round costs next to nothing.
    for _ in 0..20 {
        let past = db
            .count(
                &db.source,
                "SELECT (pg_current_wal_lsn() > '0/10000100')::int::int8",
            )
            .await;
        if past == 1 {
            break;
        }
        db.source_sql(
            "SELECT pg_logical_emit_message(false, 'pgapply-test', 'x'); SELECT pg_switch_wal();",
        )
        .await;
    }
    let main = format!("pgapply_{}", db.slot());
    let worker = format!("{main}-w1");
    db.target_sql(&format!(
        "SELECT pg_replication_origin_advance('{main}', '0/F000000'); \
         SELECT pg_replication_origin_advance('{worker}', '0/10000000'); \
         UPDATE pgapply.origin_commit SET end_lsn = '0/F000000' WHERE origin_name = '{main}'; \
         UPDATE pgapply.origin_commit SET end_lsn = '0/10000000' WHERE origin_name = '{worker}';"
    ))
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--apply-workers", "2", "--endpos", &endpos]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("resume_lsn=0/10000000"), "{log}");
}
