//! Servers restart under a running pgapply: it reconnects with backoff, resumes from the recorded
//! position, converges, and stops cleanly on SIGTERM. (Own test binary: restarting the shared
//! clusters must not disturb other tests.)

mod common;

use common::{clusters, spawn, wait_for, TestDb};
use pgapply::cluster::restart_cluster;

async fn insert_batch(db: &TestDb, from: i32, to: i32) {
    db.source_sql(&format!(
        "INSERT INTO r SELECT g, 'v' || g FROM generate_series({from}, {to}) g; UPDATE r SET v = v || '+' WHERE id % 7 = 0;"
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_and_target_restarts_are_ridden_out() {
    let db = TestDb::new("restart").await;
    db.both("CREATE TABLE r (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE r").await;
    let mut child = spawn(db.pgapply("p", &["--retry-min", "100ms", "--retry-max", "1s"]));
    let c = clusters();
    let expect = |n: i64| {
        let port = db.target_port;
        let name = db.name.clone();
        move || {
            let name = name.clone();
            async move {
                let target = common::connect_maybe(port, &name).await;
                match target {
                    Some(t) => t
                        .query_one("SELECT count(*) FROM r", &[])
                        .await
                        .map(|r| r.get::<_, i64>(0) == n)
                        .unwrap_or(false),
                    None => false,
                }
            }
        }
    };
    insert_batch(&db, 1, 100).await;
    wait_for("first batch", 60, expect(100)).await;

    for (round, mode) in ["fast", "immediate"].iter().enumerate() {
        restart_cluster(&c.source_bin, &c.source_dir, mode).expect("restart source");
        let db2 = TestDb::reconnect(&db).await;
        let from = 101 + round as i32 * 100;
        insert_batch(&db2, from, from + 99).await;
        wait_for(
            "batch after source restart",
            90,
            expect(i64::from(from + 99)),
        )
        .await;
    }
    restart_cluster(&c.target_bin, &c.target_dir, "fast").expect("restart target");
    let db3 = TestDb::reconnect(&db).await;
    insert_batch(&db3, 301, 400).await;
    wait_for("batch after target restart", 90, expect(400)).await;

    // SIGTERM: finish, report, exit 0.
    let pid = child.id().expect("pid") as i32;
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait())
        .await
        .expect("pgapply stops after SIGTERM")
        .expect("wait");
    assert!(status.success(), "{status}");
    db3.assert_same("r").await;

    // The target restarts under an idle worker: nothing is applied meanwhile to show it the lost
    // connection, but `pgapply cutover`'s request to stop, read on the heartbeat's connection,
    // still gets through, and the worker stops where it asks.
    let mut child = spawn(db3.pgapply("p", &["--retry-min", "100ms", "--retry-max", "1s"]));
    db3.wait_slot_active().await;
    restart_cluster(&c.target_bin, &c.target_dir, "fast").expect("restart target");
    let db4 = TestDb::reconnect(&db).await;
    db4.cutover(&[]).await;
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait())
        .await
        .expect("the worker stops at the cutover's position")
        .expect("wait");
    assert!(status.success(), "{status}");
    db4.assert_same("r").await;
}
