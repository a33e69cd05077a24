//! kill -9 of pgapply at arbitrary moments under load, restarted each time: the target ends equal
//! to the source, with no change lost and none applied twice (a table without a key under
//! REPLICA IDENTITY FULL would show a double apply as an extra row).

mod common;

use std::time::Duration;

use common::{connect, spawn, wait_for, TestDb};

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
