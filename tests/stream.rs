//! Large and in-progress transactions (streaming), prepared transactions (two-phase), binary
//! values, logical decoding messages. Own test binary: the source streams after 64 kB
//! (`logical_decoding_work_mem`), which would change what other tests exercise.

mod common;

use std::sync::OnceLock;

use common::{connect, run_with_deadline, spawn, stderr, wait_for, TestDb};

/// Makes the source stream any transaction larger than 64 kB (once per test binary).
async fn small_decoding_memory() -> i32 {
    static DONE: OnceLock<i32> = OnceLock::new();
    if let Some(v) = DONE.get() {
        return *v;
    }
    let c = common::clusters();
    let admin = connect(c.source_port, "postgres").await;
    let version: i32 = admin
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    // The tests here are of streamed transactions: streaming on unless a test's flag says
    // otherwise (pgapply's default is off). (Set once, before this binary starts any pgapply.)
    std::env::set_var("PGAPPLY_STREAMING", "on");
    if version >= 130000 {
        admin
            .batch_execute("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
            .await
            .unwrap();
        admin
            .batch_execute("SELECT pg_reload_conf()")
            .await
            .unwrap();
    }
    *DONE.get_or_init(|| version)
}

async fn pgapply_version_or_skip(what: &str, min: i32) -> bool {
    let v = small_decoding_memory().await;
    if v < min {
        common::skip(&format!(
            "{what} needs a PostgreSQL {} source, this one is {}",
            min / 10000,
            v / 10000
        ));
        return false;
    }
    true
}

fn spool_dir(db: &TestDb) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("pgapply-test-spool-{}", db.name))
}

/// Spooled transactions' files (not the lock files of the processes spooling there).
fn spool_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".spool"))
                .count()
        })
        .unwrap_or(0)
}

/// Without `--streaming`, a large transaction is not streamed (the source sends it whole at
/// commit, only what committed): the default, whatever the source's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_off_unless_asked_for() {
    small_decoding_memory().await;
    let db = TestDb::new("streamdefault").await;
    db.both("CREATE TABLE s (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE s").await;
    db.source_sql(
        "BEGIN; INSERT INTO s SELECT g, repeat('x', 200) FROM generate_series(1, 3000) g; \
         SAVEPOINT a; UPDATE s SET pad = 'undone' WHERE id % 2 = 0; ROLLBACK TO SAVEPOINT a; \
         UPDATE s SET pad = 'kept' WHERE id % 3 = 0; COMMIT;",
    )
    .await;
    let endpos = db.source_wal().await;
    let mut cmd = db.pgapply("p", &["--endpos", &endpos]);
    cmd.env_remove("PGAPPLY_STREAMING");
    let out = run_with_deadline(cmd, 120).await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("streaming off"), "{log}");
    db.assert_same("s").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_streamed_transactions_with_aborts() {
    interleaved_streamed_transactions("streamed", &[]).await;
}

/// Parallel workers hand streamed transactions to the first worker, in order with the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_streamed_transactions_with_parallel_workers() {
    interleaved_streamed_transactions("streampar", &["--apply-workers", "3"]).await;
}

/// `--streaming parallel` (16+): the first streamed transaction is applied as it arrives on the
/// helper connection (savepoints for its subtransactions), the one interleaved with it is spooled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_streamed_transactions_applied_as_they_arrive() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let db = interleaved_streamed_transactions("streamlive", &["--streaming", "parallel"]).await;
    assert!(
        helper_progress(&db).await.is_some(),
        "the helper committed a streamed transaction (origin {}-w1 has a position)",
        origin(&db)
    );
}

/// `--streaming parallel`: a streamed transaction updates rows that ordinary transactions
/// inserted just before (committed on the source before the update, received before its block):
/// the helper must see them, so they commit on the target before the block is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_transaction_sees_rows_committed_before_its_changes() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let db = TestDb::new("streamsees").await;
    db.both("CREATE TABLE v (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE v").await;
    let big = connect(db.source_port, &db.name).await;
    big.batch_execute(
        "BEGIN; INSERT INTO v SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 3000) g;",
    )
    .await
    .unwrap();
    // Many small transactions: the main applier is still busy with them (its group open) when
    // the next block of the streamed transaction arrives.
    let small = connect(db.source_port, &db.name).await;
    for i in 0..1000 {
        small
            .execute("INSERT INTO v VALUES ($1, 'small')", &[&(100_000 + i)])
            .await
            .unwrap();
    }
    big.batch_execute(
        "UPDATE v SET pad = 'seen' WHERE id >= 100000; \
         INSERT INTO v SELECT g, repeat(md5(g::text), 8) FROM generate_series(3001, 6000) g; COMMIT;",
    )
    .await
    .unwrap();
    let out = live_catch_up(&db).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM v WHERE pad = 'seen'")
            .await,
        1000
    );
    db.assert_same("v").await;
    assert!(
        helper_progress(&db).await.is_some(),
        "applied by the helper"
    );
}

/// `--streaming parallel` up to the source's current WAL end.
async fn live_catch_up(db: &TestDb) -> std::process::Output {
    let endpos = db.source_wal().await;
    let dir = spool_dir(db).to_string_lossy().to_string();
    let args = [
        "--endpos",
        &endpos,
        "--spool-dir",
        &dir,
        "--streaming",
        "parallel",
    ];
    run_with_deadline(db.pgapply("p", &args), 120).await
}

/// `--streaming parallel` in the background, its log in a file the test reads.
fn spawn_live(db: &TestDb) -> (tokio::process::Child, std::path::PathBuf) {
    let dir = spool_dir(db).to_string_lossy().to_string();
    let log_path = std::env::temp_dir().join(format!("pgapply-test-{}.log", db.name));
    let mut cmd = db.pgapply("p", &["--spool-dir", &dir, "--streaming", "parallel"]);
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap());
    (cmd.spawn().unwrap(), log_path)
}

/// A trigger on the target only, enabled ALWAYS (it fires for replicated rows): every insert
/// into `table` updates the one row of `tally`, so two open transactions inserting there wait
/// for each other.
async fn count_inserts_on_target(db: &TestDb, table: &str) {
    db.target_sql(&format!(
        "CREATE TABLE tally (n bigint NOT NULL); INSERT INTO tally VALUES (0); \
         CREATE FUNCTION count_row() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN UPDATE tally SET n = n + 1; RETURN NULL; END $$; \
         CREATE TRIGGER count_row AFTER INSERT ON {table} FOR EACH ROW EXECUTE PROCEDURE count_row(); \
         ALTER TABLE {table} ENABLE ALWAYS TRIGGER count_row;"
    ))
    .await;
}

fn origin(db: &TestDb) -> String {
    format!("pgapply_{}", db.slot())
}

/// The position of the `--streaming parallel` helper's origin on the target, if it has one.
async fn helper_progress(db: &TestDb) -> Option<String> {
    db.target
        .query_opt(
            "SELECT remote_lsn::text FROM pg_replication_origin_status \
             WHERE external_id = $1 AND remote_lsn <> '0/0'",
            &[&format!("{}-w1", origin(db))],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

async fn interleaved_streamed_transactions(prefix: &str, extra: &[&str]) -> TestDb {
    if !pgapply_version_or_skip("streaming", 140000).await {
        return TestDb::new(prefix).await;
    }
    let db = TestDb::new(prefix).await;
    db.both("CREATE TABLE s (id int PRIMARY KEY, who text, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE s").await;
    let a = connect(db.source_port, &db.name).await;
    let b = connect(db.source_port, &db.name).await;
    let pad = "repeat(md5(g::text), 3)";
    a.batch_execute(&format!(
        "BEGIN; INSERT INTO s SELECT g, 'a', {pad} FROM generate_series(1, 3000) g;"
    ))
    .await
    .unwrap();
    b.batch_execute(&format!(
        "BEGIN; INSERT INTO s SELECT g, 'b', {pad} FROM generate_series(100001, 103000) g;"
    ))
    .await
    .unwrap();
    // Nested subtransactions: x2 (and its updates of rows of the top level) rolls back, x stays.
    // Transactional messages (`--messages` logs them) of x and x2: only x's was committed.
    // (Streamed, they carry the top transaction's xid: one that comes before any change of its
    // subtransaction cannot be told from the transaction's own.)
    a.batch_execute(&format!("SAVEPOINT x; SELECT pg_logical_emit_message(true, 'msg-kept', 'k'); INSERT INTO s SELECT g, 'a-sub', {pad} FROM generate_series(3001, 4000) g; \
        SAVEPOINT x2; INSERT INTO s SELECT g, 'a-aborted', {pad} FROM generate_series(4001, 6000) g; SELECT pg_logical_emit_message(true, 'msg-undone', 'u'); \
        UPDATE s SET pad = 'a-aborted-update' WHERE id <= 500; ROLLBACK TO SAVEPOINT x2; RELEASE SAVEPOINT x;")).await.unwrap();
    db.source_sql("INSERT INTO s VALUES (-1, 'small', 'between')")
        .await;
    b.batch_execute(&format!("SAVEPOINT y; UPDATE s SET pad = 'b-updated' WHERE id > 102000; SAVEPOINT z; DELETE FROM s WHERE id > 102500; RELEASE SAVEPOINT z; INSERT INTO s SELECT g, 'b-more', {pad} FROM generate_series(103001, 104000) g; COMMIT;")).await.unwrap();
    a.batch_execute(&format!("INSERT INTO s SELECT g, 'a-after', {pad} FROM generate_series(6001, 7000) g; UPDATE s SET who = 'a-updated' WHERE id <= 1000; COMMIT;")).await.unwrap();
    // A whole streamed transaction that aborts.
    a.batch_execute(&format!("BEGIN; SELECT pg_logical_emit_message(true, 'msg-aborted', 'a'); INSERT INTO s SELECT g, 'gone', {pad} FROM generate_series(200001, 205000) g; ROLLBACK;")).await.unwrap();
    let dir = spool_dir(&db);
    let dir_arg = dir.to_string_lossy().to_string();
    let endpos = db.source_wal().await;
    let mut args = vec!["--endpos", &endpos, "--spool-dir", &dir_arg, "--messages"];
    args.extend_from_slice(extra);
    let out = run_with_deadline(db.pgapply("p", &args), 120).await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("msg-kept") && !log.contains("msg-undone") && !log.contains("msg-aborted"),
        "only the committed message is logged: {log}"
    );
    let expected = if extra.contains(&"parallel") {
        "streaming parallel"
    } else {
        "streaming on"
    };
    assert!(
        stderr(&out).contains(expected),
        "negotiated {expected}: {}",
        stderr(&out)
    );
    db.assert_same("s").await;
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM s WHERE who IN ('a-aborted', 'gone') OR pad = 'a-aborted-update'"
        )
        .await,
        0
    );
    // ids 1..1000 and -1 (the small transaction committed in between).
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM s WHERE who = 'a-updated'")
            .await,
        1001
    );
    assert_eq!(spool_files(&dir), 0, "spool files are removed after use");
    // Rows counted as applied: not those of the rolled-back subtransaction x2 (2000 inserts,
    // 500 updates) nor of the aborted transaction, whichever way they were applied.
    let counted = db
        .target
        .query_one(
            "SELECT inserts, updates, deletes FROM pgapply.progress WHERE slot_name = $1",
            &[&db.slot()],
        )
        .await
        .unwrap();
    let counted: (i64, i64, i64) = (counted.get(0), counted.get(1), counted.get(2));
    assert_eq!(counted, (9001, 2001, 500), "inserts, updates, deletes");
    db
}

/// `--streaming parallel`: an ordinary transaction that, on the target, must wait for rows the
/// open streamed transaction holds (here an ENABLE ALWAYS trigger on the target keeps a count
/// in one row; the source has no such trigger) would wait forever, as the streamed one commits
/// only after it. The watchdog finds the wait, and the run is retried with the streamed
/// transaction spooled: everything lands, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_transaction_that_blocks_an_ordinary_one_is_retried_spooled() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let db = TestDb::new("streamblock").await;
    db.both("CREATE TABLE b (id int PRIMARY KEY, pad text)")
        .await;
    count_inserts_on_target(&db, "b").await;
    db.publish("CREATE PUBLICATION p FOR TABLE b").await;
    let (mut child, log_path) = spawn_live(&db);
    let big = connect(db.source_port, &db.name).await;
    big.batch_execute(
        "BEGIN; INSERT INTO b SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 5000) g;",
    )
    .await
    .unwrap();
    // The helper's open transaction has counted its rows: it holds the tally row.
    wait_for("the helper to hold the tally row", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.relation = 'tally'::regclass AND l.mode = 'RowExclusiveLock' \
             AND a.datname = current_database() AND a.state = 'idle in transaction'",
        )
        .await
            > 0
    })
    .await;
    // Its count waits for the helper's transaction, which cannot commit before it.
    db.source_sql("INSERT INTO b VALUES (-1, 'small')").await;
    big.batch_execute("INSERT INTO b SELECT g, 'tail' FROM generate_series(5001, 6000) g; COMMIT;")
        .await
        .unwrap();
    wait_for("everything, after the retry", 120, || async {
        db.count(&db.target, "SELECT count(*) FROM b").await == 6001
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        log.contains("waited for rows that streamed transaction")
            && log.contains("retrying with streamed transactions spooled"),
        "the watchdog found the wait and the run was retried: {log}"
    );
    db.assert_same("b").await;
    assert_eq!(
        db.count(&db.target, "SELECT n FROM tally").await,
        6001,
        "each row inserted once"
    );
}

/// `--streaming parallel`: the run ends (end position) while the helper holds a streamed
/// transaction that an ordinary transaction in the last group waits for (an ENABLE ALWAYS trigger
/// on the target counts rows in one row). The helper's transaction is given up first, so the last
/// group commits and pgapply stops cleanly, without a watchdog cancel or a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_end_position_inside_a_streamed_transaction_stops_cleanly() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let db = TestDb::new("streamend").await;
    db.both("CREATE TABLE e (id int PRIMARY KEY, pad text)")
        .await;
    count_inserts_on_target(&db, "e").await;
    db.publish("CREATE PUBLICATION p FOR TABLE e").await;
    let big = connect(db.source_port, &db.name).await;
    big.batch_execute(
        "BEGIN; INSERT INTO e SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 5000) g;",
    )
    .await
    .unwrap();
    db.source_sql("INSERT INTO e VALUES (-1, 'small')").await;
    let out = live_catch_up(&db).await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(!log.contains("retrying"), "stopped without a retry: {log}");
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM e").await, 1);
    assert_eq!(db.count(&db.target, "SELECT n FROM tally").await, 1);
    big.batch_execute("COMMIT").await.unwrap();
    db.sync("p").await;
    db.assert_same("e").await;
}

/// `--streaming parallel`: a subtransaction of the open streamed transaction updates a row and
/// rolls back; an ordinary transaction then updates that row. The rollback must reach the target
/// at once, or the ordinary one waits for the helper's lock until the watchdog steps in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_subtransaction_releases_its_rows_at_once() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let db = TestDb::new("streamrelease").await;
    db.both("CREATE TABLE r (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE r").await;
    db.source_sql("INSERT INTO r VALUES (-5, 'before')").await;
    let (mut child, log_path) = spawn_live(&db);
    wait_for("the first row", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM r").await == 1
    })
    .await;
    let big = connect(db.source_port, &db.name).await;
    // The update inside the subtransaction is streamed (the rows after it fill a block) before
    // the subtransaction rolls back.
    big.batch_execute(
        "BEGIN; INSERT INTO r SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 3000) g; \
         SAVEPOINT s; UPDATE r SET pad = 'undone' WHERE id = -5; \
         INSERT INTO r SELECT g, repeat(md5(g::text), 8) FROM generate_series(3001, 6000) g; \
         ROLLBACK TO SAVEPOINT s;",
    )
    .await
    .unwrap();
    db.source_sql("UPDATE r SET pad = 'after' WHERE id = -5")
        .await;
    wait_for("the ordinary update", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM r WHERE id = -5 AND pad = 'after'",
        )
        .await
            == 1
    })
    .await;
    big.batch_execute("INSERT INTO r VALUES (7000, 'tail'); COMMIT;")
        .await
        .unwrap();
    wait_for("the streamed transaction", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM r").await == 3002
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        !log.contains("waited for rows the streamed transaction holds")
            && !log.contains("retrying"),
        "no wait on the helper, no retry: {log}"
    );
    db.assert_same("r").await;
    assert!(
        helper_progress(&db).await.is_some(),
        "applied by the helper"
    );
}

/// `--streaming parallel`: a cutover while the helper applies a streamed transaction that is
/// still open on the source. The worker stops at the cutover's end position, giving the open
/// transaction up (it never committed before the end), and the target holds exactly what the
/// source had committed. What the source commits afterwards stays out: the target is the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_while_the_helper_holds_an_open_streamed_transaction() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let db = TestDb::new("streamcut").await;
    db.both("CREATE TABLE c (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE c").await;
    let big = connect(db.source_port, &db.name).await;
    let (mut child, log_path) = spawn_live(&db);
    db.source_sql("INSERT INTO c VALUES (-1, 'before')").await;
    wait_for("the first row", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM c").await == 1
    })
    .await;
    big.batch_execute(
        "BEGIN; INSERT INTO c SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 5000) g;",
    )
    .await
    .unwrap();
    wait_for("the helper to apply the open transaction", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state = 'idle in transaction' AND backend_xid IS NOT NULL",
        )
        .await
            > 0
    })
    .await;
    db.source_sql("INSERT INTO c VALUES (-2, 'committed during')")
        .await;
    db.cutover(&[]).await;
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait())
        .await
        .expect("the worker stops at the cutover's end position")
        .unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(status.success(), "worker exit: {status}\n{log}");
    assert!(!log.contains("retrying"), "stopped without a retry: {log}");
    db.assert_same("c").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM c").await, 2);
    big.batch_execute("COMMIT").await.unwrap();
    let out = run_with_deadline(db.pgapply("p", &["--streaming", "parallel"]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("stopped at"), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM c").await, 2);
}

/// `--streaming parallel`: killed while the helper holds a streamed transaction, and again after
/// the source committed it; the restarted run applies it exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_a_streamed_transaction_is_applied_as_it_arrives() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let db = TestDb::new("streamlivekill").await;
    db.both("CREATE TABLE k (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE k").await;
    let dir = spool_dir(&db);
    let dir_arg = dir.to_string_lossy().to_string();
    let args = ["--spool-dir", dir_arg.as_str(), "--streaming", "parallel"];
    let big = connect(db.source_port, &db.name).await;
    let mut child = spawn(db.pgapply("p", &args));
    db.source_sql("INSERT INTO k VALUES (-1, 'before')").await;
    wait_for("the first row", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM k").await == 1
    })
    .await;
    big.batch_execute(
        "BEGIN; INSERT INTO k SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 20000) g;",
    )
    .await
    .unwrap();
    // The helper's open transaction holds the rows it inserted: their keys are locked.
    wait_for(
        "the helper to apply part of the open transaction",
        60,
        || async {
            db.count(
                &db.target,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state = 'idle in transaction' AND backend_xid IS NOT NULL",
            )
            .await
                > 0
        },
    )
    .await;
    assert_eq!(spool_files(&dir), 0, "applied as it arrives, not spooled");
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    big.batch_execute(
        "INSERT INTO k SELECT g, 'tail' FROM generate_series(20001, 21000) g; COMMIT;",
    )
    .await
    .unwrap();
    let endpos = db.source_wal().await;
    let mut with_end = args.to_vec();
    with_end.extend_from_slice(&["--endpos", &endpos]);
    let out = run_with_deadline(db.pgapply("p", &with_end), 120).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("k").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM k").await, 21001);
    // The streamed transaction was the last one: only the helper's origin holds its position,
    // and the rerun below must resume from there.
    let main_lsn: String = db
        .target
        .query_one(
            "SELECT coalesce(max(remote_lsn), '0/0')::text FROM pg_replication_origin_status WHERE external_id = $1",
            &[&origin(&db)],
        )
        .await
        .unwrap()
        .get(0);
    let helper_lsn = helper_progress(&db).await.expect("the helper committed it");
    assert_eq!(
        db.count(
            &db.target,
            &format!("SELECT ('{helper_lsn}'::pg_lsn > '{main_lsn}'::pg_lsn)::int::bigint")
        )
        .await,
        1,
        "the helper's position {helper_lsn} is past the main origin's {main_lsn}"
    );
    // Once more from the start: everything is applied already, nothing twice.
    let out = run_with_deadline(db.pgapply("p", &with_end), 120).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("k").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_streamed_transaction_and_during_replay() {
    if !pgapply_version_or_skip("streaming", 140000).await {
        return;
    }
    let db = TestDb::new("streamkill").await;
    db.both("CREATE TABLE k (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE k").await;
    let dir = spool_dir(&db);
    let dir_arg = dir.to_string_lossy().to_string();
    let big = connect(db.source_port, &db.name).await;
    let mut child = spawn(db.pgapply("p", &["--spool-dir", &dir_arg]));
    // 1. Killed while a streamed transaction is still arriving (its spool file exists).
    big.batch_execute(
        "BEGIN; INSERT INTO k SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 20000) g;",
    )
    .await
    .unwrap();
    wait_for(
        "the streamed transaction to be spooled to disk",
        60,
        || async { spool_files(&dir) > 0 },
    )
    .await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    big.batch_execute(
        "INSERT INTO k SELECT g, 'tail' FROM generate_series(20001, 21000) g; COMMIT;",
    )
    .await
    .unwrap();
    // 2. Killed while the committed transaction is being replayed from the spool.
    let mut child = spawn(db.pgapply("p", &["--spool-dir", &dir_arg]));
    // The replay writes into k inside one transaction (it holds a lock on it); on a fast machine
    // it may be over before the test looks, which is fine too.
    wait_for("the replay to start (or end)", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_locks WHERE relation = 'k'::regclass AND mode = 'RowExclusiveLock'",
        )
        .await
            > 0
            || db.count(&db.target, "SELECT count(*) FROM k").await == 21000
    })
    .await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    db.sync("p").await;
    db.assert_same("k").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM k").await, 21000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_flat_for_a_huge_transaction() {
    if !pgapply_version_or_skip("streaming", 140000).await {
        return;
    }
    let rows: i64 = std::env::var("PGAPPLY_BIG_TXN_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400_000);
    let db = TestDb::new("bigtxn").await;
    db.both("CREATE TABLE big (id int PRIMARY KEY, v int, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE big").await;
    db.source_sql(&format!(
        "BEGIN; INSERT INTO big SELECT g, 0, repeat('x', 100) FROM generate_series(1, {rows}) g; \
         UPDATE big SET v = 1 WHERE id % 2 = 0; COMMIT;"
    ))
    .await;
    let dir = spool_dir(&db);
    let dir_arg = dir.to_string_lossy().to_string();
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--endpos", &endpos, "--spool-dir", &dir_arg]),
        900,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("big").await;
    // pgapply's own figure: the test binary's other children (other tests) do not count.
    let log = stderr(&out);
    let rss_mb = common::peak_rss_mb(&log);
    eprintln!("peak RSS of pgapply for a {rows}-row transaction: {rss_mb} MB");
    // The bound does not depend on the transaction's size: the queue (64 MB of messages at most),
    // 4 MB of spool memory, statement batches and the runtime.
    assert!(rss_mb < 160, "peak RSS {rss_mb} MB");
}

/// One transaction of 200 values of 1 MB each (compressed on the source, whole in the stream):
/// pgapply's memory stays within its bounds, not the transaction's size (inserts used to go out
/// 128 rows to a statement, and 64 statements at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_for_a_transaction_of_large_values() {
    let db = TestDb::new("bigvalues").await;
    db.both("CREATE TABLE v (id int PRIMARY KEY, doc text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE v").await;
    db.source_sql(
        "INSERT INTO v SELECT g, repeat(md5(g::text), 32768) FROM generate_series(1, 200) g",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 600).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM v WHERE length(doc) = 1048576"
        )
        .await,
        200
    );
    let rss_mb = common::peak_rss_mb(&stderr(&out));
    eprintln!("peak RSS of pgapply for 200 MB of values in one transaction: {rss_mb} MB");
    assert!(rss_mb < 200, "peak RSS {rss_mb} MB");
}

/// A transaction prepared while the slot was being made (after its snapshot could see changes,
/// before it was consistent) is sent only at its COMMIT PREPARED, prepare and all, with its old
/// prepare position, which lies before the copy's start: it was never applied, and must be now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_prepared_while_the_slot_was_made_is_applied_at_commit_prepared() {
    if !pgapply_version_or_skip("two-phase", 150000).await {
        return;
    }
    let db = TestDb::new("prepmaking").await;
    let gid = format!("making_{}", db.name);
    common::cleaning_prepared(&db, &gid, prepared_while_making(&db, &gid)).await;
}

/// The session's transaction id, as pg_locks shows it.
async fn current_xid(client: &tokio_postgres::Client) -> String {
    client
        .query_one("SELECT (txid_current() % 4294967296)::text", &[])
        .await
        .unwrap()
        .get::<_, String>(0)
}

async fn prepared_while_making(db: &TestDb, gid: &str) {
    db.both("CREATE TABLE pm (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO pm VALUES (1); CREATE PUBLICATION p FOR TABLE pm")
        .await;
    // Waits of this slot's walsender only: other tests' slot creations wait for every running
    // transaction too.
    let slot = db.slot();
    let waits_for = |xid: String| {
        let source = &db.source;
        let slot = slot.clone();
        move || {
            let (xid, slot) = (xid.clone(), slot.clone());
            async move {
                source
                    .query_one(
                        "SELECT count(*) FROM pg_locks l JOIN pg_replication_slots s ON s.active_pid = l.pid \
                         WHERE s.slot_name = $2 AND l.locktype = 'transactionid' AND NOT l.granted \
                         AND l.transactionid::text = $1",
                        &[&xid, &slot],
                    )
                    .await
                    .map(|r| r.get::<_, i64>(0) > 0)
                    .unwrap_or(false)
            }
        }
    };
    // The slot's creation first waits for the transactions running when it starts (l), then for
    // those running when its snapshot starts seeing changes (m): the prepared one goes in between.
    let l = connect(db.source_port, &db.name).await;
    l.batch_execute("BEGIN").await.unwrap();
    let l_xid = current_xid(&l).await;
    let mut worker = spawn(db.pgapply("p", &["--two-phase", "--create-slot", "--copy-data"]));
    wait_for("slot creation to wait for l", 60, waits_for(l_xid)).await;
    let m = connect(db.source_port, &db.name).await;
    m.batch_execute("BEGIN").await.unwrap();
    let m_xid = current_xid(&m).await;
    l.batch_execute("COMMIT").await.unwrap();
    wait_for("slot creation to wait for m", 60, waits_for(m_xid)).await;
    db.source_sql(&format!(
        "BEGIN; INSERT INTO pm VALUES (2); PREPARE TRANSACTION '{gid}';"
    ))
    .await;
    m.batch_execute("COMMIT").await.unwrap();
    db.wait_slot_active().await;
    db.source_sql(&format!("COMMIT PREPARED '{gid}'")).await;
    db.source_sql("INSERT INTO pm VALUES (3)").await;
    wait_for("the rows after the copy", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM pm WHERE id = 3")
            .await
            == 1
    })
    .await;
    worker.start_kill().unwrap();
    let _ = worker.wait().await;
    db.assert_same("pm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_prepare_commit_rollback_and_kill_in_between() {
    if !pgapply_version_or_skip("two-phase", 150000).await {
        return;
    }
    let db = TestDb::new("twophase").await;
    db.both("CREATE TABLE tp (id int PRIMARY KEY, v text)")
        .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE tp").await;
    // pgapply creates the slot with two-phase support.
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--two-phase", "--create-slot", "--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql("INSERT INTO tp VALUES (0, 'ordinary')").await;
    db.source_sql("BEGIN; INSERT INTO tp VALUES (1, 'committed'); PREPARE TRANSACTION 'src-1';")
        .await;
    db.source_sql("BEGIN; INSERT INTO tp VALUES (2, 'rolled back'); PREPARE TRANSACTION 'src-2';")
        .await;
    db.source_sql("COMMIT PREPARED 'src-1'").await;
    db.source_sql("ROLLBACK PREPARED 'src-2'").await;
    // A transaction committed between a PREPARE and its COMMIT PREPARED.
    db.source_sql("BEGIN; INSERT INTO tp VALUES (4, 'prepared'); PREPARE TRANSACTION 'src-4';")
        .await;
    db.source_sql("INSERT INTO tp VALUES (5, 'in between')")
        .await;
    db.source_sql("COMMIT PREPARED 'src-4'").await;
    db.source_sql("BEGIN; INSERT INTO tp VALUES (3, 'pending'); PREPARE TRANSACTION 'src-3';")
        .await;
    // Without --two-phase this time: the slot is a two-phase one, so the run is too.
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("applying them as with --two-phase"),
        "{}",
        stderr(&out)
    );
    // Rows counted: those committed (0, 1, 4, 5), not the rolled back src-2 nor the pending src-3.
    assert_eq!(
        db.count(
            &db.target,
            &format!(
                "SELECT inserts FROM pgapply.progress WHERE slot_name = '{}'",
                db.slot()
            )
        )
        .await,
        4
    );
    // src-3 is prepared on the target too, not committed.
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'pgapply_%' \
             AND database = current_database()"
        )
        .await,
        1
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM tp WHERE id = 3")
            .await,
        0
    );
    // pgapply stopped between prepare and commit prepared: the prepared transaction is found again.
    let before: String = db
        .source
        .query_one("SELECT clock_timestamp()::text", &[])
        .await
        .unwrap()
        .get(0);
    db.source_sql("COMMIT PREPARED 'src-3'").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--two-phase", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("tp").await;
    // The applied position's commit time is the COMMIT PREPARED's (it stayed the last
    // ordinary commit's).
    assert_eq!(
        db.count(
            &db.target,
            &format!(
                "SELECT count(*) FROM pgapply.progress WHERE slot_name = '{}' \
                 AND last_commit_time >= '{before}'::timestamptz",
                db.slot()
            )
        )
        .await,
        1
    );
    // A ROLLBACK PREPARED last: the slot moves past it, with no commit after it to carry the
    // position (before PostgreSQL 14 an abort record does not carry it).
    db.source_sql("BEGIN; INSERT INTO tp VALUES (6, 'x'); PREPARE TRANSACTION 'src-6';")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--two-phase", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql("ROLLBACK PREPARED 'src-6'").await;
    let rolled_back = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--two-phase", "--endpos", &rolled_back]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        db.slot_confirmed(&rolled_back).await,
        "the slot stays before the rollback"
    );
    assert_eq!(
        // This test's database only: other tests prepare transactions on the same target.
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()"
        )
        .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_values_give_the_same_rows_as_text() {
    if !pgapply_version_or_skip("binary", 140000).await {
        return;
    }
    let c = common::clusters();
    if c.source_major != c.target_major {
        common::skip("binary transfer is used only between servers of the same major version");
        return;
    }
    let db = TestDb::new("binary").await;
    db.both(
        "CREATE TABLE b (id int PRIMARY KEY, i8 bigint, n numeric, f float8, r real, t text, vc varchar(20), \
         by bytea, ts timestamptz, d date, iv interval, j jsonb, arr int[], tarr text[], u uuid, ip inet, bo bool, \
         tm time, bits bit varying(8), m money, pt point);",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE b").await;
    db.source_sql(
        r#"INSERT INTO b VALUES
        (1, 9223372036854775807, 12345678901234567890.123456789, 'NaN', '-Infinity', 'tëxt', 'vc', '\x00ff', '2024-02-29 12:00:00.123456+00',
         '4713-01-01 BC', '1 mon -2 days 03:00', '{"a": [1, null]}', '{1,NULL,3}', '{"x,y", NULL}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
         '::1/128', true, '23:59:59.999999', B'101', '-12.34', '(1.5,2)'),
        (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
        UPDATE b SET t = 'updated', f = 1e-300 WHERE id = 1;"#,
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--binary", "--messages", "--endpos", &endpos]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("binary on"), "binary was negotiated: {log}");
    db.assert_same("b").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_falls_back_to_text_for_user_types_and_messages_are_logged() {
    if !pgapply_version_or_skip("binary", 140000).await {
        return;
    }
    let db = TestDb::new("binfallback").await;
    db.both("CREATE TYPE mood AS ENUM ('sad', 'happy'); CREATE TABLE e (id int PRIMARY KEY, m mood, a mood[])").await;
    db.publish("CREATE PUBLICATION p FOR TABLE e").await;
    db.source_sql("INSERT INTO e VALUES (1, 'happy', '{sad,happy}'); SELECT pg_logical_emit_message(true, 'app-prefix', 'payload'); SELECT pg_logical_emit_message(false, 'app-nontx', 'payload');").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--binary", "--messages", "--endpos", &endpos]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    let c = common::clusters();
    assert!(log.contains("binary transfer off"), "{log}");
    if c.source_major == c.target_major {
        assert!(log.contains("user-defined type"), "{log}");
    }
    assert!(
        log.contains("app-prefix") && log.contains("app-nontx"),
        "messages logged: {log}"
    );
    db.assert_same("e").await;
}

/// aclitem has no binary form, and an empty tsquery's (int2vector's, oidvector's) binary form
/// does not read back: the copy
/// (binary between servers of one major version) and `--binary` take text for such tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copy_and_binary_take_text_for_types_without_a_binary_form_that_reads_back() {
    if !pgapply_version_or_skip("binary", 140000).await {
        return;
    }
    let db = TestDb::new("binaryunsafe").await;
    db.both(
        "CREATE TABLE m (id int PRIMARY KEY, q tsquery, qs tsquery[], a aclitem, aa aclitem[], \
         iv int2vector, ov oidvector, ovs oidvector[])",
    )
    .await;
    let row = |id: i32| {
        format!(
            "INSERT INTO m VALUES ({id}, '', ARRAY[''::tsquery, 'a & b'], makeaclitem(10, 10, 'SELECT', false), ARRAY[makeaclitem(10, 10, 'SELECT', false), makeaclitem(10, 10, 'UPDATE', true)], '', '', ARRAY[''::oidvector, '1 2'])"
        )
    };
    db.source_sql(&format!("{}; CREATE PUBLICATION p FOR TABLE m", row(1)))
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--binary", "--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql(&format!(
        "{}; UPDATE m SET q = '', a = makeaclitem(10, 10, 'SELECT', false) WHERE id = 1",
        row(2)
    ))
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--binary", "--endpos", &endpos]), 60).await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    let c = common::clusters();
    if c.source_major == c.target_major {
        assert!(
            log.contains("binary transfer off") && log.contains("aclitem, tsquery"),
            "{log}"
        );
    }
    db.assert_same("m").await;
    // Such tables published while a --binary run streams others: it starts again with text.
    for (table, columns, value) in [
        ("q2", "q tsquery", "''"),
        ("v2", "v int2vector", "''"),
        (
            "a2",
            "a aclitem[]",
            "ARRAY[makeaclitem(10, 10, 'SELECT', false), makeaclitem(10, 10, 'UPDATE', true)]",
        ),
    ] {
        db.both(&format!(
            "CREATE TABLE only_binary_{table} (id int PRIMARY KEY); CREATE TABLE {table} (id int PRIMARY KEY, {columns})"
        ))
        .await;
        db.source_sql(&format!(
            "ALTER PUBLICATION p SET TABLE only_binary_{table}; INSERT INTO only_binary_{table} VALUES (1)"
        ))
        .await;
        let (mut child, log) = common::spawn_logged(db.pgapply("p", &["--binary"]));
        wait_for("the first row", 60, || async {
            db.count(
                &db.target,
                &format!("SELECT count(*) FROM only_binary_{table}"),
            )
            .await
                == 1
        })
        .await;
        db.source_sql(&format!(
            "ALTER PUBLICATION p ADD TABLE {table}; INSERT INTO {table} VALUES (1, {value}); \
             INSERT INTO only_binary_{table} VALUES (2)"
        ))
        .await;
        wait_for("the new table's row", 60, || async {
            db.count(&db.target, &format!("SELECT count(*) FROM {table}"))
                .await
                == 1
        })
        .await;
        common::signal(&child, libc::SIGTERM);
        let status = tokio::time::timeout(std::time::Duration::from_secs(60), child.wait())
            .await
            .expect("pgapply stops")
            .unwrap();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(status.success(), "{text}");
        if c.source_major == c.target_major {
            assert!(
                text.contains("starting again, with values in text form"),
                "{text}"
            );
        }
        db.assert_same(table).await;
        db.assert_same(&format!("only_binary_{table}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_transactions_land_while_a_big_one_streams() {
    if !pgapply_version_or_skip("streaming", 140000).await {
        return;
    }
    let db = TestDb::new("streamopen").await;
    db.both("CREATE TABLE o (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE o").await;
    let dir = spool_dir(&db);
    let dir_arg = dir.to_string_lossy().to_string();
    let mut child = spawn(db.pgapply("p", &["--spool-dir", &dir_arg]));
    db.source_sql("INSERT INTO o VALUES (-1, 'before')").await;
    wait_for("the first row", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM o").await == 1
    })
    .await;
    let big = connect(db.source_port, &db.name).await;
    big.batch_execute(
        "BEGIN; INSERT INTO o SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 20000) g;",
    )
    .await
    .unwrap();
    wait_for("the open transaction to stream", 60, || async {
        spool_files(&dir) > 0
    })
    .await;
    // Committed while the big one is still open: it must not wait for the big one.
    db.source_sql("INSERT INTO o VALUES (-2, 'small')").await;
    wait_for(
        "the small transaction while the big one is open",
        30,
        || async {
            db.count(&db.target, "SELECT count(*) FROM o WHERE id = -2")
                .await
                == 1
        },
    )
    .await;
    big.batch_execute("COMMIT").await.unwrap();
    wait_for("the big transaction", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM o").await == 20002
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
    db.assert_same("o").await;
}

/// Without `--spool-dir`, streamed transactions are spooled under the temp directory, and the
/// run leaves no spool file there behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_spool_directory_is_not_left_behind() {
    if !pgapply_version_or_skip("streaming", 140000).await {
        return;
    }
    let db = TestDb::new("spooldef").await;
    db.both("CREATE TABLE s (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE s").await;
    db.source_sql(
        "INSERT INTO s SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 20000) g",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 120).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("s").await;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let dir = std::env::temp_dir().join(format!("pgapply-spool-{uid}-{}", db.slot()));
    assert!(
        dir.is_dir(),
        "{} is where streamed transactions are spooled",
        dir.display()
    );
    assert_eq!(spool_files(&dir), 0, "spool files are removed after use");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_with_the_progress_table() {
    if !pgapply_version_or_skip("two-phase", 150000).await {
        return;
    }
    let db = TestDb::new("twophasetable").await;
    db.both("CREATE TABLE tt (id int PRIMARY KEY, v text)")
        .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE tt").await;
    // A target role that may not use replication origins: progress goes to pgapply.progress.
    let writer = format!("w2_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {writer} LOGIN PASSWORD 'pw'; GRANT INSERT, UPDATE, DELETE, SELECT ON tt TO {writer}; \
         GRANT CREATE ON DATABASE {} TO {writer};",
        db.name
    ))
    .await;
    let target = format!(
        "host=127.0.0.1 port={} user={writer} password=pw dbname={}",
        db.target_port, db.name
    );
    let run = |endpos: String, create: bool| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgapply"));
        cmd.args([
            "run",
            "--source",
            &db.source_conninfo(),
            "--target",
            &target,
            "--publication",
            "p",
            "--slot",
            &db.slot(),
        ])
        .args(["--two-phase", "--endpos", &endpos])
        .kill_on_drop(true);
        if create {
            cmd.arg("--create-slot");
        }
        cmd
    };
    let out = run_with_deadline(run(db.source_wal().await, true), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    // Prepared, then an ordinary transaction, then the commit of the prepared one: the ordinary
    // one must not wait behind the prepared one's row lock.
    db.source_sql("BEGIN; INSERT INTO tt VALUES (1, 'prepared'); PREPARE TRANSACTION 'p1';")
        .await;
    db.source_sql("INSERT INTO tt VALUES (2, 'ordinary')").await;
    db.source_sql("COMMIT PREPARED 'p1'").await;
    let out = run_with_deadline(run(db.source_wal().await, false), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("tt").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_of_a_prepared_transaction_count_only_if_it_commits() {
    if !pgapply_version_or_skip("two-phase", 150000).await {
        return;
    }
    let db = TestDb::new("twophaseconf").await;
    db.both("CREATE TABLE tc (id int PRIMARY KEY, v text)")
        .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE tc").await;
    let config = std::env::temp_dir().join(format!(
        "pgapply-stream-{}-twophaseconf.toml",
        std::process::id()
    ));
    std::fs::write(&config, "[conflicts]\ninsert_exists = \"skip\"\n").unwrap();
    let config = config.to_string_lossy().to_string();
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--two-phase",
                "--create-slot",
                "--endpos",
                &endpos,
                "--config",
                &config,
            ],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.target_sql("INSERT INTO tc VALUES (1, 'local'), (2, 'local')")
        .await;
    db.source_sql("BEGIN; INSERT INTO tc VALUES (1, 'a'); PREPARE TRANSACTION 'c-1';")
        .await;
    db.source_sql("BEGIN; INSERT INTO tc VALUES (2, 'b'); PREPARE TRANSACTION 'c-2';")
        .await;
    db.source_sql("COMMIT PREPARED 'c-1'").await;
    db.source_sql("ROLLBACK PREPARED 'c-2'").await;
    // An ordinary transaction after them: its commit must not carry their conflicts.
    db.source_sql("INSERT INTO tc VALUES (3, 'c')").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &["--two-phase", "--endpos", &endpos, "--config", &config],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let recorded: Vec<(String, String)> = db
        .target
        .query(
            "SELECT conflict_type, key FROM pgapply.conflicts ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        recorded,
        vec![("insert_exists".to_string(), "(\"id\")=(1)".to_string())],
        "only the committed prepared transaction's conflict is recorded"
    );
}

/// `--streaming parallel`: the target's sessions are ended while the helper holds a streamed
/// transaction. That is no reason to spool from then on: the retried run applies the next
/// streamed transaction as it arrives again, and every row lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_outage_keeps_streamed_transactions_applied_as_they_arrive() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let db = TestDb::new("streamoutage").await;
    db.both("CREATE TABLE o (id int PRIMARY KEY, pad text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE o").await;
    let dir = spool_dir(&db);
    let (mut child, log_path) = spawn_live(&db);
    let big = connect(db.source_port, &db.name).await;
    db.source_sql("INSERT INTO o VALUES (-1, 'before')").await;
    wait_for("the first row", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM o").await == 1
    })
    .await;
    // The helper holds an open streamed transaction on the target.
    let helper_open = || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state = 'idle in transaction' AND backend_xid IS NOT NULL",
        )
        .await
            > 0
    };
    big.batch_execute(
        "BEGIN; INSERT INTO o SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 5000) g;",
    )
    .await
    .unwrap();
    wait_for(
        "the helper to apply part of the first open transaction",
        60,
        helper_open,
    )
    .await;
    // The outage: every pgapply session of the target database ends.
    db.target_sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    .await;
    big.batch_execute("INSERT INTO o SELECT g, 'tail' FROM generate_series(5001, 6000) g; COMMIT;")
        .await
        .unwrap();
    wait_for("the first transaction, after the retry", 120, || async {
        db.count(&db.target, "SELECT count(*) FROM o").await == 6001
    })
    .await;
    // The next one is applied as it arrives, not spooled.
    big.batch_execute(
        "BEGIN; INSERT INTO o SELECT g, repeat(md5(g::text), 8) FROM generate_series(10001, 15000) g;",
    )
    .await
    .unwrap();
    wait_for(
        "the helper to apply part of the second open transaction",
        60,
        helper_open,
    )
    .await;
    assert_eq!(spool_files(&dir), 0, "applied as it arrives, not spooled");
    big.batch_execute("COMMIT").await.unwrap();
    wait_for("the second transaction", 120, || async {
        db.count(&db.target, "SELECT count(*) FROM o").await == 11001
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        !log.contains("retrying with streamed transactions spooled"),
        "an outage is no reason to spool: {log}"
    );
    // Retried on its own: nothing to skip, and no made-up commit position.
    assert!(
        !log.contains("pgapply skip") && !log.contains("FFFFFFFF"),
        "{log}"
    );
    db.assert_same("o").await;
}

/// `forget` of a two-phase slot: with the slot kept, the transactions its worker prepared on the
/// target are named (the slot's stream ends them); with `--drop-slot` they are rolled back, as
/// nothing would end them and their locks would hold up the next run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_ends_what_a_dropped_two_phase_slot_left_prepared() {
    if !pgapply_version_or_skip("two-phase", 150000).await {
        return;
    }
    let db = TestDb::new("forgetprep").await;
    let gid = format!("fp_{}", db.name);
    common::cleaning_prepared(&db, &gid, forget_prepared(&db, &gid)).await;
}

async fn forget_prepared(db: &TestDb, gid: &str) {
    db.both("CREATE TABLE o (id int PRIMARY KEY, v text)").await;
    db.source_sql("INSERT INTO o VALUES (1, 'a'); CREATE PUBLICATION p FOR TABLE o")
        .await;
    let mut worker = spawn(db.pgapply("p", &["--two-phase", "--create-slot", "--copy-data"]));
    db.wait_slot_active().await;
    db.source_sql(&format!(
        "BEGIN; UPDATE o SET v = 'b' WHERE id = 1; PREPARE TRANSACTION '{gid}';"
    ))
    .await;
    let prepared_on_target = "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database() AND gid LIKE 'pgapply%'";
    wait_for("the transaction prepared on the target", 60, || async {
        db.count(&db.target, prepared_on_target).await == 1
    })
    .await;
    common::signal(&worker, libc::SIGTERM);
    assert!(worker.wait().await.unwrap().success());
    let forget = |extra: &[&str]| {
        let mut c = common::pgapply_command(&[
            "forget",
            "--target",
            &db.target_conninfo(),
            "--slot",
            &db.slot(),
        ]);
        c.args(extra);
        c
    };
    let out = run_with_deadline(forget(&[]), 30).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("transaction(s) prepared for slot")
            && text.contains("the slot's stream ends them"),
        "{text}"
    );
    assert_eq!(db.count(&db.target, prepared_on_target).await, 1);
    // Started again (state forgotten, slot kept) and then given up for good.
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run_with_deadline(
        forget(&["--drop-slot", "--source", &db.source_conninfo()]),
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("dropped replication slot")
            && text.contains("rolled back 1 transaction(s) prepared on the target"),
        "{text}"
    );
    assert_eq!(db.count(&db.target, prepared_on_target).await, 0);
    // Nothing holds the row now: the target takes a write to it at once.
    db.target
        .batch_execute(
            "SET lock_timeout = '5s'; UPDATE o SET v = 'free' WHERE id = 1; RESET lock_timeout",
        )
        .await
        .unwrap();
}

/// 400 values of 1 MiB in one source transaction, applied with `--streaming mode` and a 16 MB
/// queue into a target whose trigger sleeps `pause` per row: every value arrives; returns the
/// run's stderr (its peak RSS, what it warned of).
async fn four_hundred_values_into_a_slow_target(prefix: &str, pause: &str, mode: &str) -> String {
    let db = TestDb::new(prefix).await;
    db.both("CREATE TABLE v (id int PRIMARY KEY, doc text)")
        .await;
    db.target_sql(&format!(
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep({pause}); RETURN NEW; END $$; \
         CREATE TRIGGER slow BEFORE INSERT ON v FOR EACH ROW EXECUTE PROCEDURE slow(); \
         ALTER TABLE v ENABLE ALWAYS TRIGGER slow;"
    ))
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE v").await;
    db.source_sql(
        "INSERT INTO v SELECT g, repeat(md5(g::text), 32768) FROM generate_series(1, 400) g",
    )
    .await;
    let endpos = db.source_wal().await;
    let dir = spool_dir(&db).to_string_lossy().to_string();
    let args = [
        "--endpos",
        &endpos,
        "--spool-dir",
        &dir,
        "--streaming",
        mode,
        "--queue-size",
        "16MB",
    ];
    let out = run_with_deadline(db.pgapply("p", &args), 120).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM v WHERE length(doc) = 1048576"
        )
        .await,
        400
    );
    stderr(&out)
}

/// A streamed transaction of 400 values of 1 MiB, spooled (`--streaming on`) and replayed into
/// a slow target: each value read back from the spool file is allocated at its size (grown by
/// doubling, each kept 2 MiB alive while its statement was pending).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_when_a_spooled_transaction_replays() {
    if !pgapply_version_or_skip("streaming", 140000).await {
        return;
    }
    let log = four_hundred_values_into_a_slow_target("slowreplay", "0.005", "on").await;
    let rss_mb = common::peak_rss_mb(&log);
    eprintln!("peak RSS of pgapply for 400 MB of values replayed from the spool: {rss_mb} MB");
    // 96 to 101 MB measured with the doubling, 72 to 73 MB without.
    assert!(rss_mb < 90, "peak RSS {rss_mb} MB");
}

/// `--streaming parallel` with a target slower than the source (a trigger sleeping per row):
/// the helper's backlog is bounded, whatever the streamed transaction's size. What it may hold:
/// the reader's queue (16 MB here), the helper's own 16 MiB, statements pending and in flight
/// (about 25 MB of values, held as received and again as sent), and the process itself (about
/// 20 MB): some 100 MB, 128 to 134 MB measured. A received message that kept twice its size
/// alive (the read buffer's doubling) went past 170 MB; 800 values instead of 400 measure the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_when_the_helper_is_slow() {
    if !pgapply_version_or_skip("--streaming parallel", 160000).await {
        return;
    }
    let log = four_hundred_values_into_a_slow_target("slowhelper", "0.01", "parallel").await;
    let rss_mb = common::peak_rss_mb(&log);
    eprintln!("peak RSS of pgapply for 400 MB of values streamed to a slow helper: {rss_mb} MB");
    // (With what the run said: a fallback to spooling, a retry, ... explain a peak.)
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR ") || l.contains("spool"))
        .collect();
    assert!(
        rss_mb < 170,
        "peak RSS {rss_mb} MB; the run said:\n{}",
        said.join("\n")
    );
}
