//! Conflict policies (PostgreSQL 18's taxonomy), the conflict table, and skipping a transaction.

mod common;

use common::{run_with_deadline, spawn, stderr, wait_for, TestDb};
use tokio::process::Command;

/// A config file of its own: tests run side by side, and one must not read another's.
fn config_file(name: &str, text: &str) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let p = std::env::temp_dir().join(format!(
        "pgapply-conflicts-{}-{name}-{}.toml",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    ));
    std::fs::write(&p, text).unwrap();
    p
}

async fn sync_with(db: &TestDb, extra: &[&str]) -> std::process::Output {
    let endpos = db.source_wal().await;
    let mut args = vec!["--endpos", endpos.as_str()];
    args.extend_from_slice(extra);
    run_with_deadline(db.pgapply("p", &args), 60).await
}

/// Runs `pgapply skip` with the commit LSN the error names. Exactly one LSN: messages about
/// statements that carried several transactions' changes must not point at any one of them.
async fn skip_named_transaction(db: &TestDb, err: &str) {
    let mut hints: Vec<&str> = err
        .split("--lsn ")
        .skip(1)
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    // The final error is both logged and printed: the same hint twice.
    hints.dedup();
    assert_eq!(
        hints.len(),
        1,
        "one commit LSN expected in the hints of: {err}"
    );
    skip_lsn(db, hints[0]).await;
}

/// Runs `pgapply skip --lsn` and expects it taken.
async fn skip_lsn(db: &TestDb, lsn: &str) {
    let mut skip = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    skip.args([
        "skip",
        "--target",
        &db.target_conninfo(),
        "--slot",
        &db.slot(),
        "--lsn",
        lsn,
    ]);
    let out = run_with_deadline(skip, 30).await;
    assert!(out.status.success(), "{}", stderr(&out));
}

async fn conflicts(db: &TestDb) -> Vec<(String, String, Option<String>, Option<String>)> {
    db.target
        .query(
            "SELECT conflict_type, policy, local_row::text, remote_row::text FROM pgapply.conflicts ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_resolve_and_record_conflicts() {
    let db = TestDb::new("policies").await;
    db.both("CREATE TABLE kl (id int PRIMARY KEY, v text); CREATE TABLE ar (id int PRIMARY KEY, v text);").await;
    db.publish("CREATE PUBLICATION p FOR TABLE kl, ar").await;
    db.target_sql("INSERT INTO kl VALUES (1, 'local'); INSERT INTO ar VALUES (1, 'local');")
        .await;
    db.source_sql(
        "INSERT INTO kl VALUES (1, 'remote'), (2, 'two'); INSERT INTO ar VALUES (1, 'remote'), (2, 'two'); \
         DELETE FROM kl WHERE id = 2;",
    )
    .await;
    // Rows the target lacks: an update (inserted under apply_remote for ar) and a delete.
    db.target_sql("DELETE FROM ar WHERE id = 2").await;
    let config = config_file(
        "a",
        "[conflicts]\ninsert_exists = \"keep_local\"\nupdate_missing = \"skip\"\n\n[tables.\"public.ar\".conflicts]\ninsert_exists = \"apply_remote\"\nupdate_missing = \"apply_remote\"\n",
    );
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql("UPDATE ar SET v = 'two again' WHERE id = 2; DELETE FROM kl WHERE id = 99; INSERT INTO kl VALUES (99, 'x'); DELETE FROM kl WHERE id = 99;").await;
    db.target_sql("DELETE FROM ar WHERE id = 2").await;
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));

    let kl: Vec<(i32, String)> = db
        .target
        .query("SELECT id, v FROM kl ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        kl,
        vec![(1, "local".to_string())],
        "keep_local kept the target's row"
    );
    let ar: Vec<(i32, String)> = db
        .target
        .query("SELECT id, v FROM ar ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        ar,
        vec![(1, "remote".to_string()), (2, "two again".to_string())],
        "apply_remote made the target match"
    );
    let recorded = conflicts(&db).await;
    // `pgapply status` counts the conflicts of both runs, as the log does.
    let counted = db
        .count(
            &db.target,
            "SELECT coalesce(sum(value::bigint), 0)::bigint FROM pgapply.progress, jsonb_each_text(conflicts)",
        )
        .await;
    assert_eq!(counted, recorded.len() as i64, "{recorded:?}");
    // And says them in words: counts and kinds, not the stored JSON.
    let mut status = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    status.args(["status", "--target", &db.target_conninfo()]);
    let out = run_with_deadline(status, 30).await;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("conflicts"))
        .unwrap_or_default();
    assert!(
        line.contains(" insert_exists") && !line.contains('{'),
        "{text}"
    );
    let kinds: Vec<(&str, &str)> = recorded
        .iter()
        .map(|(k, p, ..)| (k.as_str(), p.as_str()))
        .collect();
    assert!(
        kinds.contains(&("insert_exists", "keep_local")),
        "{recorded:?}"
    );
    assert!(
        kinds.contains(&("insert_exists", "apply_remote")),
        "{recorded:?}"
    );
    assert!(
        kinds.contains(&("update_missing", "apply_remote")),
        "{recorded:?}"
    );
    let keep = recorded
        .iter()
        .find(|(k, p, ..)| k == "insert_exists" && p == "keep_local")
        .unwrap();
    assert_eq!(keep.2.as_deref(), Some("{\"v\": \"local\", \"id\": 1}"));
    // The source's row in the same JSON kinds as the target's (the id a number, not "1").
    assert_eq!(keep.3.as_deref(), Some("{\"v\": \"remote\", \"id\": 1}"));
    // The row apply_remote overwrote is recorded as it was.
    let overwritten = recorded
        .iter()
        .find(|(k, p, ..)| k == "insert_exists" && p == "apply_remote")
        .unwrap();
    assert_eq!(
        overwritten.2.as_deref(),
        Some("{\"v\": \"local\", \"id\": 1}"),
        "{recorded:?}"
    );
    assert!(overwritten.3.as_deref().unwrap().contains("\"remote\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_policy_stops_and_skip_gets_past_one_transaction() {
    let db = TestDb::new("skip").await;
    db.both("CREATE TABLE k (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE k").await;
    db.target_sql("INSERT INTO k VALUES (2, 'local')").await;
    db.source_sql("INSERT INTO k VALUES (1, 'a')").await;
    db.source_sql("INSERT INTO k VALUES (2, 'b'), (3, 'c')")
        .await;
    db.source_sql("INSERT INTO k VALUES (4, 'd')").await;
    let out = sync_with(&db, &[]).await;
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    // Fixing the row comes first; skipping loses the transaction's other rows (3 here).
    assert!(
        err.contains("delete or change that row on the target")
            && err.contains("insert_exists = \"apply_remote\"")
            && err.contains("DROP CONSTRAINT \"k_pkey\"")
            && err.contains("DROP INDEX \"public\".\"k_pkey\"")
            && err.contains("multiple_unique_conflicts, with the same choices")
            && err.contains("its other changes too"),
        "{err}"
    );
    skip_named_transaction(&db, &err).await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<(i32, String)> = db
        .target
        .query("SELECT id, v FROM k ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        rows,
        vec![(1, "a".into()), (2, "local".into()), (4, "d".into())]
    );
    let recorded = conflicts(&db).await;
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].0, "skipped_transaction");
    // Skipping it again is refused: it is behind the applied position, and a request for it
    // would wait for ever.
    let skipped: String = db
        .target
        .query_one(
            "SELECT source_lsn::text FROM pgapply.conflicts WHERE conflict_type = 'skipped_transaction'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let mut again = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    again.args([
        "skip",
        "--target",
        &db.target_conninfo(),
        "--slot",
        &db.slot(),
        "--lsn",
        &skipped,
    ]);
    let out = run_with_deadline(again, 30).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("already applied"), "{}", stderr(&out));
    // The request is used up; later runs apply normally.
    db.source_sql("INSERT INTO k VALUES (5, 'e')").await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM k").await, 4);

    // update_missing = error: stops, naming table, key and the way out.
    db.target_sql("DELETE FROM k WHERE id = 5").await;
    db.source_sql("UPDATE k SET v = 'E' WHERE id = 5; INSERT INTO k VALUES (6, 'f');")
        .await;
    let config = config_file("b", "[conflicts]\nupdate_missing = \"error\"\n");
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("update_missing")
            && err.contains("\"public\".\"k\"")
            && err.contains("(\"id\")=(5)")
            && err.contains("pgapply skip"),
        "{err}"
    );
    // Nothing of that transaction was committed, and a rerun stops again instead of skipping it.
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM k WHERE id = 6")
            .await,
        0
    );
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));

    // A value the target cannot hold: the advice is to change the target, so no skip command
    // is printed, but skip takes the commit LSN the error names without --force.
    db.target_sql("DELETE FROM pgapply.conflicts; ALTER TABLE k ADD COLUMN n int2")
        .await;
    db.source_sql("ALTER TABLE k ADD COLUMN n int8").await;
    let before_update = db.source_wal().await;
    db.source_sql("UPDATE k SET v = 'F', n = 100000 WHERE id = 6")
        .await;
    let out = sync_with(&db, &[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    let named = err
        .split(", commit ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("a commit LSN in: {err}"))
        .to_owned();
    assert!(!named.is_empty() && named != before_update, "{err}");
    skip_lsn(&db, &named).await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.conflicts WHERE conflict_type = 'skipped_transaction'"
        )
        .await,
        1
    );
}

/// Two failing transactions in a row: skipping the first, the run stops at the second, and the
/// first stays skipped (its record is committed before the second fails), so skipping the
/// second gets past both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_failing_transactions_are_skipped_one_after_the_other() {
    let db = TestDb::new("skiptwo").await;
    db.both("CREATE TABLE k (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE k").await;
    db.target_sql("INSERT INTO k VALUES (1, 'local'), (2, 'local')")
        .await;
    db.source_sql("INSERT INTO k VALUES (1, 'a')").await;
    db.source_sql("INSERT INTO k VALUES (2, 'b')").await;
    db.source_sql("INSERT INTO k VALUES (3, 'c')").await;
    let out = sync_with(&db, &[]).await;
    assert_eq!(out.status.code(), Some(1));
    let first = stderr(&out);
    skip_named_transaction(&db, &first).await;
    let out = sync_with(&db, &[]).await;
    assert_eq!(out.status.code(), Some(1));
    let second = stderr(&out);
    assert!(second.contains("Key (id)=(2)"), "{second}");
    skip_named_transaction(&db, &second).await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<(i32, String)> = db
        .target
        .query("SELECT id, v FROM k ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        rows,
        vec![(1, "local".into()), (2, "local".into()), (3, "c".into())]
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.conflicts WHERE conflict_type = 'skipped_transaction'"
        )
        .await,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_remote_with_a_second_unique_index_is_named() {
    let db = TestDb::new("multiunique").await;
    db.both("CREATE TABLE m (id int PRIMARY KEY, code text UNIQUE)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE m").await;
    db.target_sql("INSERT INTO m VALUES (1, 'a'), (2, 'b')")
        .await;
    // Key 1 exists (resolved by apply_remote) but code 'b' belongs to row 2.
    db.source_sql("INSERT INTO m VALUES (1, 'b')").await;
    let config = config_file("c", "[conflicts]\ninsert_exists = \"apply_remote\"\n");
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("multiple_unique_conflicts") && err.contains("\"public\".\"m\""),
        "{err}"
    );
    // The advice names the policy that settles it, not the one already set.
    assert!(
        err.contains("[conflicts] multiple_unique_conflicts = \"apply_remote\"")
            && !err.contains("[conflicts] insert_exists = \"apply_remote\""),
        "{err}"
    );
}

/// insert_exists = apply_remote on a REPLICA IDENTITY FULL table (every column is "key" then):
/// the target's primary key decides which row an insert overwrites, and inserts that meet no row
/// go in as usual. A FULL table without a unique index on the target is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_remote_on_a_replica_identity_full_table_uses_the_targets_key() {
    let db = TestDb::new("fullar").await;
    db.both(
        "CREATE TABLE f (id int PRIMARY KEY, v text, n int); ALTER TABLE f REPLICA IDENTITY FULL; \
         CREATE TABLE g (a int, b text); ALTER TABLE g REPLICA IDENTITY FULL;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE f").await;
    db.target_sql("INSERT INTO f VALUES (1, 'local', NULL)")
        .await;
    db.source_sql(
        "INSERT INTO f VALUES (1, 'remote', 7), (2, 'new', NULL); UPDATE f SET n = 8 WHERE id = 1",
    )
    .await;
    let config = config_file("c", "[conflicts]\ninsert_exists = \"apply_remote\"\n");
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("f").await;
    let recorded = conflicts(&db).await;
    assert!(
        recorded.iter().any(|(k, _, local, _)| k == "insert_exists"
            && local.as_deref() == Some("{\"n\": null, \"v\": \"local\", \"id\": 1}")),
        "the overwritten row is recorded: {recorded:?}"
    );

    db.source_sql("ALTER PUBLICATION p ADD TABLE g; INSERT INTO g VALUES (1, 'x')")
        .await;
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("REPLICA IDENTITY FULL") && err.contains("\"public\".\"g\""),
        "{err}"
    );
    // update_exists on a REPLICA IDENTITY FULL table: its policies find the other row by the
    // table's key, which it has not; the advice says so instead of naming the policy again.
    db.source_sql("ALTER PUBLICATION p DROP TABLE g").await;
    db.both("CREATE TABLE h (a int, b text, c int); ALTER TABLE h REPLICA IDENTITY FULL")
        .await;
    db.target_sql("CREATE UNIQUE INDEX ON h (c); INSERT INTO h VALUES (3, 'L', 3)")
        .await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE h; INSERT INTO h VALUES (1, 'x', 1); UPDATE h SET c = 3 WHERE a = 1")
        .await;
    let skip = config_file("d", "[conflicts]\nupdate_exists = \"skip\"\n");
    let out = sync_with(&db, &["--config", skip.to_str().unwrap()]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("update_exists policies need a primary key or replica identity index on the source table")
            && !err.contains("update_exists = \"apply_remote\""),
        "{err}"
    );
}

/// A clashing row with NULL in another unique index's column: the lookup of what clashes reads
/// that as "not through that index" (it used to fail reading a NULL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clashing_row_with_nulls_in_another_unique_index() {
    let db = TestDb::new("clashnull").await;
    db.both("CREATE TABLE w (id int PRIMARY KEY, email text UNIQUE, phone text UNIQUE)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE w").await;
    db.source_sql("INSERT INTO w VALUES (1, 'a@x', '111')")
        .await;
    db.target_sql("INSERT INTO w VALUES (100, 'taken@x', NULL)")
        .await;
    db.source_sql(
        "INSERT INTO w VALUES (2, 'b@x', '222'); UPDATE w SET email = 'taken@x' WHERE id = 1",
    )
    .await;
    let config = config_file("c", "[conflicts]\nupdate_exists = \"skip\"\n");
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    // Skipped: row 1 keeps its old email, the local row stays, row 2 arrived.
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM w WHERE (id = 1 AND email = 'a@x') OR (id = 100 AND phone IS NULL) OR id = 2")
            .await,
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_exists_and_multiple_unique_conflicts_follow_their_policies() {
    let db = TestDb::new("updexists").await;
    db.both("CREATE TABLE u (id int PRIMARY KEY, code text UNIQUE, v text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE u").await;
    db.source_sql("INSERT INTO u VALUES (1, 'a', 'x'), (2, 'b', 'x')")
        .await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    // Rows only the target has, holding the codes the source is about to use.
    db.target_sql("INSERT INTO u VALUES (100, 'taken', 'local'), (101, 'taken2', 'local')")
        .await;

    // Default policy: update_exists stops pgapply and names the table.
    db.source_sql("UPDATE u SET code = 'taken', v = 'y' WHERE id = 1")
        .await;
    let out = sync_with(&db, &[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("update_exists") && err.contains("\"public\".\"u\""),
        "{err}"
    );

    // skip: the update is left out, recorded with the clashing local row; later changes apply.
    db.source_sql("UPDATE u SET v = 'later' WHERE id = 2").await;
    let skip = config_file("d", "[conflicts]\nupdate_exists = \"skip\"\n");
    let out = sync_with(&db, &["--config", skip.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        u_rows(&db).await,
        vec![
            (1, "a".into(), "x".into()),
            (2, "b".into(), "later".into()),
            (100, "taken".into(), "local".into()),
            (101, "taken2".into(), "local".into()),
        ]
    );
    let recorded = conflicts(&db).await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(
        (recorded[0].0.as_str(), recorded[0].1.as_str()),
        ("update_exists", "skip")
    );
    assert!(
        recorded[0].2.as_deref().unwrap_or("").contains("\"taken\""),
        "{recorded:?}"
    );

    // apply_remote (per table): the clashing row goes, the update lands. A new row that clashes
    // with two rows (its key and its code) is a multiple_unique_conflicts, settled the same way.
    db.source_sql("UPDATE u SET code = 'taken2', v = 'z' WHERE id = 2")
        .await;
    db.target_sql("INSERT INTO u VALUES (3, 'zzz', 'local'), (102, 'c', 'local')")
        .await;
    db.source_sql("INSERT INTO u VALUES (3, 'c', 'new')").await;
    let remote = config_file(
        "e",
        "[tables.\"public.u\".conflicts]\nupdate_exists = \"apply_remote\"\ninsert_exists = \"apply_remote\"\nmultiple_unique_conflicts = \"apply_remote\"\n",
    );
    let out = sync_with(&db, &["--config", remote.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        u_rows(&db).await,
        vec![
            (1, "a".into(), "x".into()),
            (2, "taken2".into(), "z".into()),
            (3, "c".into(), "new".into()),
            (100, "taken".into(), "local".into()),
        ]
    );
    let recorded = conflicts(&db).await;
    let kinds: Vec<(&str, &str)> = recorded
        .iter()
        .map(|(k, p, ..)| (k.as_str(), p.as_str()))
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("update_exists", "skip"),
            ("update_exists", "apply_remote"),
            ("multiple_unique_conflicts", "apply_remote")
        ]
    );
    let multiple = recorded[2].2.as_deref().unwrap_or("");
    assert!(
        multiple.starts_with('[') && multiple.contains("\"zzz\"") && multiple.contains("102"),
        "{multiple}"
    );
}

async fn u_rows(db: &TestDb) -> Vec<(i32, String, String)> {
    db.target
        .query("SELECT id, code, v FROM u ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_batched_update_names_its_own_transaction() {
    let db = TestDb::new("batchfail").await;
    db.both("CREATE TABLE b (id int PRIMARY KEY, n int)").await;
    // Only the target refuses big values: one source transaction will fail there.
    db.target_sql("ALTER TABLE b ADD CONSTRAINT small CHECK (n < 1000)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE b").await;
    db.source_sql("INSERT INTO b SELECT g, 0 FROM generate_series(1, 3) g")
        .await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    // Three transactions that land in one group, their updates in one batched statement.
    db.source_sql(
        "BEGIN; UPDATE b SET n = 1 WHERE id = 1; COMMIT; \
         BEGIN; UPDATE b SET n = 5000 WHERE id = 2; COMMIT; \
         BEGIN; UPDATE b SET n = 3 WHERE id = 3; COMMIT;",
    )
    .await;
    let out = sync_with(&db, &["--retry-min", "10ms", "--retry-max", "100ms"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("small") && err.contains("\"public\".\"b\""),
        "{err}"
    );
    // The batched statement failed first; the retry, one change at a time, named the transaction.
    assert!(err.contains("one change at a time"), "{err}");
    // Skipping the named transaction is enough: it was the failing one.
    skip_named_transaction(&db, &err).await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<(i32, i32)> = db
        .target
        .query("SELECT id, n FROM b ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, vec![(1, 1), (2, 0), (3, 3)]);
}

/// The counters of `pgapply status` stay exact when one process retries after losing its target
/// connections: its metrics go on counting across the retry, and only what was not recorded yet
/// is added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_stay_exact_across_retries_in_one_process() {
    let db = TestDb::new("retrycount").await;
    db.both("CREATE TABLE k (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE k").await;
    db.target_sql("INSERT INTO k VALUES (1, 'local')").await;
    let config = config_file(
        "retrycount",
        "[conflicts]\ninsert_exists = \"keep_local\"\n",
    );
    let config_arg = config.to_string_lossy().to_string();
    let mut child = spawn(db.pgapply(
        "p",
        &[
            "--config",
            &config_arg,
            "--retry-min",
            "100ms",
            "--retry-max",
            "200ms",
        ],
    ));
    let recorded = "SELECT coalesce(sum(value::bigint), 0)::bigint FROM pgapply.progress, jsonb_each_text(conflicts)";
    wait_for("pgapply's state on the target", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'pgapply' AND tablename = 'conflicts'",
        )
        .await
            == 1
    })
    .await;
    db.source_sql("INSERT INTO k VALUES (1, 'remote'), (2, 'two')")
        .await;
    wait_for("the conflict in the status", 60, || async {
        db.count(&db.target, recorded).await == 1
    })
    .await;
    // Every session of the worker on the target ends: the process retries.
    db.target_sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'pgapply'",
    )
    .await;
    db.target_sql("INSERT INTO k VALUES (3, 'local')").await;
    db.source_sql("INSERT INTO k VALUES (3, 'remote')").await;
    wait_for("the second conflict in the log", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM pgapply.conflicts")
            .await
            == 2
    })
    .await;
    let pid = child.id().unwrap() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(child.wait().await.unwrap().success());
    assert_eq!(db.count(&db.target, recorded).await, 2);
}

/// insert_exists = apply_remote on a table whose every column is the key, here a GENERATED
/// ALWAYS identity on the target: the row there is the row sent, so nothing is overwritten (a
/// SET of the key would fail on such a column); the conflict is recorded and the run goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_remote_on_a_key_only_identity_table() {
    let db = TestDb::new("keyonlyid").await;
    db.source_sql("CREATE TABLE ko (id int PRIMARY KEY)").await;
    db.target_sql(
        "CREATE TABLE ko (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY); \
         INSERT INTO ko OVERRIDING SYSTEM VALUE VALUES (1);",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE ko").await;
    db.source_sql("INSERT INTO ko VALUES (1), (2)").await;
    let config = config_file(
        "keyonlyid",
        "[conflicts]\ninsert_exists = \"apply_remote\"\n",
    );
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("ko").await;
    let recorded = conflicts(&db).await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(
        (recorded[0].0.as_str(), recorded[0].1.as_str()),
        ("insert_exists", "apply_remote")
    );
    assert_eq!(
        recorded[0].2.as_deref(),
        Some("{\"id\": 1}"),
        "{recorded:?}"
    );
}

/// update_missing = apply_remote where the target's key is a GENERATED ALWAYS identity (left out
/// of the UPDATE's SET, as it stays): the missing row is inserted with the key that was looked
/// for, not skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_missing_inserts_the_row_with_an_identity_key() {
    let db = TestDb::new("umident").await;
    db.source_sql("CREATE TABLE um (id int PRIMARY KEY, v text)")
        .await;
    db.target_sql("CREATE TABLE um (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE um").await;
    db.source_sql("INSERT INTO um VALUES (1, 'a'), (2, 'a')")
        .await;
    let config = config_file(
        "umident",
        "[conflicts]\nupdate_missing = \"apply_remote\"\n",
    );
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.target_sql("DELETE FROM um WHERE id = 2").await;
    db.source_sql("UPDATE um SET v = 'b'").await;
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("um").await;
    let recorded = conflicts(&db).await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(
        (recorded[0].0.as_str(), recorded[0].1.as_str()),
        ("update_missing", "apply_remote")
    );
}

/// A failure at COMMIT (a deferred constraint trigger that fires on the target) of a group of
/// several source transactions: they are applied again one at a time, each committing on its
/// own, so the error names the one transaction that fails, and skipping it gets past it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_at_commit_names_the_one_transaction() {
    let db = TestDb::new("commitfail").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    db.target_sql(
        "CREATE FUNCTION no13() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN IF NEW.v = 13 THEN RAISE EXCEPTION 'thirteen is not allowed here'; END IF; RETURN NULL; END$$; \
         CREATE CONSTRAINT TRIGGER no13 AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED \
           FOR EACH ROW EXECUTE PROCEDURE no13(); \
         ALTER TABLE t ENABLE ALWAYS TRIGGER no13;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    for i in 1..=30 {
        db.source_sql(&format!("INSERT INTO t VALUES ({i}, {i})"))
            .await;
    }
    let out = sync_with(&db, &["--max-retries", "5", "--retry-min", "10ms"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("thirteen is not allowed here") && last.contains("pgapply skip"),
        "{last}"
    );
    // Everything before it is applied, nothing after it.
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM t").await,
        12,
        "{err}"
    );
    skip_named_transaction(&db, last).await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 29);
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM t WHERE id = 13")
            .await,
        0
    );
}

/// A PREPARE TRANSACTION the target refuses (here: a target trigger wrote to a temporary table)
/// ends a transaction whose origin position was set. PostgreSQL 16+ moves the origin then, and
/// pgapply moves it back: once the cause is gone, the next run prepares the transaction and the
/// COMMIT PREPARED applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_the_target_refuses_is_applied_once_the_cause_is_gone() {
    let db = TestDb::new("prepfail").await;
    if common::source_version(&db).await < 150000 {
        common::skip("--two-phase needs a PostgreSQL 15 source");
        return;
    }
    let gid = format!("refused_{}", db.name);
    common::cleaning_prepared(&db, &gid, refused_prepare(&db, &gid)).await;
}

async fn refused_prepare(db: &TestDb, gid: &str) {
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.target_sql(
        "CREATE FUNCTION scratch() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN CREATE TEMP TABLE IF NOT EXISTS scratch (x int); INSERT INTO scratch VALUES (1); RETURN NEW; END$$; \
         CREATE TRIGGER scratch BEFORE INSERT ON t FOR EACH ROW EXECUTE PROCEDURE scratch(); \
         ALTER TABLE t ENABLE ALWAYS TRIGGER scratch;",
    )
    .await;
    // The slot is pgapply's own (with two-phase support).
    db.source_sql("CREATE PUBLICATION p FOR TABLE t").await;
    let two_phase_run = |extra: &'static [&'static str]| async move {
        let endpos = db.source_wal().await;
        let mut args = vec!["--two-phase", "--endpos", endpos.as_str()];
        args.extend_from_slice(extra);
        run_with_deadline(db.pgapply("p", &args), 120).await
    };
    let out = two_phase_run(&["--create-slot"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql(&format!(
        "BEGIN; INSERT INTO t VALUES (1, 'prepared'); PREPARE TRANSACTION '{gid}';"
    ))
    .await;
    let out = two_phase_run(&[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    // ("temporary tables" before PostgreSQL 11.)
    assert!(
        stderr(&out).contains("temporary objects") || stderr(&out).contains("temporary tables"),
        "{}",
        stderr(&out)
    );
    db.target_sql("DROP TRIGGER scratch ON t").await;
    let out = two_phase_run(&[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()"
        )
        .await,
        1,
        "the transaction is prepared on the target"
    );
    db.source_sql(&format!("COMMIT PREPARED '{gid}'")).await;
    let out = two_phase_run(&[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("t").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 1);
}

/// A bulk DELETE of rows the target lacks is one conflict per row: the first ones are logged and
/// recorded one by one, the rest counted in one row, so memory does not grow with the size of the
/// source transaction. Every conflict is still counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_beyond_the_first_thousand_of_a_transaction_are_counted_in_one_row() {
    let db = TestDb::new("bulk_missing").await;
    db.both("CREATE TABLE bulk (id int PRIMARY KEY, v text);")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE bulk").await;
    db.source_sql("INSERT INTO bulk SELECT g, 'row ' || g FROM generate_series(1, 2500) g")
        .await;
    let out = sync_with(&db, &[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.target_sql("DELETE FROM bulk").await;
    db.source_sql("DELETE FROM bulk").await;
    let out = sync_with(&db, &[]).await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("1500 more delete_missing conflicts on \"public\".\"bulk\""),
        "{log}"
    );
    let rows: Vec<(Option<String>, i64)> = db
        .target
        .query(
            "SELECT key, occurrences FROM pgapply.conflicts WHERE conflict_type = 'delete_missing' ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows.len(), 1001, "1000 whole records and one summary");
    assert!(rows[..1000].iter().all(|(k, n)| k.is_some() && *n == 1));
    assert_eq!(rows[1000], (None, 1500));
    let counted = db
        .count(
            &db.target,
            "SELECT coalesce(sum(value::bigint), 0)::bigint FROM pgapply.progress, jsonb_each_text(conflicts)",
        )
        .await;
    assert_eq!(counted, 2500, "status counts every conflict");
}

/// Two source tables mapped onto one target table (the target keeps what the source splits, as
/// with partitions published under their own names): a TRUNCATE of one of them would empty the
/// target table of the other's rows too. It stops the apply instead, naming both and the way
/// out; following that way out loses nothing; a TRUNCATE of both is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_of_one_of_two_tables_mapped_onto_one_stops_and_says_what_to_do() {
    let db = TestDb::new("sharedtrunc").await;
    if common::source_version(&db).await < 110000 {
        return common::skip("PostgreSQL 10 does not replicate TRUNCATE");
    }
    db.source_sql(
        "CREATE TABLE a (id int PRIMARY KEY, v text); CREATE TABLE b (id int PRIMARY KEY, v text)",
    )
    .await;
    db.target_sql("CREATE TABLE ab (id int PRIMARY KEY, v text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE a, b").await;
    let config = config_file(
        "shared",
        "[tables.\"public.a\"]\ntarget = \"public.ab\"\n[tables.\"public.b\"]\ntarget = \"public.ab\"\n",
    );
    let config = ["--config", config.to_str().unwrap()];
    db.source_sql("INSERT INTO a SELECT g, 'a' FROM generate_series(1, 5) g")
        .await;
    db.source_sql("INSERT INTO b SELECT g, 'b' FROM generate_series(101, 105) g")
        .await;
    let out = sync_with(&db, &config).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM ab").await, 10);

    db.source_sql("TRUNCATE a").await;
    db.source_sql("INSERT INTO a VALUES (6, 'a')").await;
    let out = sync_with(&db, &config).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("source table \"public\".\"a\" was truncated, but target table \"public\".\"ab\" also holds the rows of source table \"public\".\"b\""),
        "{err}"
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM ab WHERE v = 'b'")
            .await,
        5,
        "the other table's rows are kept"
    );
    // The way out the message gives: a's rows deleted by hand, the TRUNCATE skipped.
    db.target_sql("DELETE FROM ab WHERE v = 'a'").await;
    skip_named_transaction(&db, &err).await;
    let out = sync_with(&db, &config).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<i32> = db
        .target
        .query("SELECT id FROM ab ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows, vec![6, 101, 102, 103, 104, 105]);
    // verify compares the target table with both source tables' rows together.
    let mut verify = db.on_both("verify", &[]);
    verify.args(config);
    let out = run_with_deadline(verify, 60).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains(
            "OK        \"public\".\"a\" + \"public\".\"b\" -> target \"public\".\"ab\" (6 rows"
        ),
        "{text}"
    );
    db.target_sql("DELETE FROM ab WHERE id = 102").await;
    let mut verify = db.on_both("verify", &[]);
    verify.args(config);
    let out = run_with_deadline(verify, 60).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    // Named by the target table too: the one to look at there.
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("MISMATCH  \"public\".\"a\" + \"public\".\"b\" -> target \"public\".\"ab\": source 6 rows, target 5 rows")
            && stderr(&out).contains("differ in \"public\".\"a\" + \"public\".\"b\" -> target \"public\".\"ab\""),
        "{text}{}",
        stderr(&out)
    );
    db.target_sql("INSERT INTO ab VALUES (102, 'b')").await;

    // Both truncated together: nothing else lives in ab, so it is applied.
    db.source_sql("TRUNCATE a, b").await;
    let out = sync_with(&db, &config).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM ab").await, 0);
}

/// `pgapply skip` with another LSN than the last error names is refused, naming the right one;
/// `--lsn none` takes a request back; and a request the stream passes without a transaction
/// committing exactly there is taken back by the worker, which says so and applies on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_for_the_wrong_lsn_is_refused_or_taken_back() {
    let db = TestDb::new("skipwrong").await;
    db.both("CREATE TABLE k (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE k").await;
    db.target_sql("INSERT INTO k VALUES (1, 'local')").await;
    db.source_sql("INSERT INTO k VALUES (1, 'a'), (2, 'b')")
        .await;
    let out = sync_with(&db, &[]).await;
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    let named: String = err
        .split("--lsn ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{err}"))
        .to_owned();
    let skip = |lsn: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
        cmd.args([
            "skip",
            "--target",
            &db.target_conninfo(),
            "--slot",
            &db.slot(),
            "--lsn",
            lsn,
        ]);
        cmd
    };
    // One byte off: refused, with the LSN to give.
    let wrong: pgapply::protocol::Lsn = named.parse().unwrap();
    let wrong = pgapply::protocol::Lsn(wrong.0 - 1).to_string();
    let out = run_with_deadline(skip(&wrong), 30).await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("give --lsn {named}")),
        "{}",
        stderr(&out)
    );
    // A request made and taken back.
    let out = run_with_deadline(skip(&named), 30).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run_with_deadline(skip("none"), 30).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!(
            "took back the request to skip the transaction committed at {named}"
        )),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // A request for an LSN nothing commits at (set by hand, past the check): taken back by the
    // worker when the stream passes it; the conflict stops the run again.
    db.target_sql(&format!("UPDATE pgapply.progress SET skip_lsn = '{wrong}'"))
        .await;
    let out = sync_with(&db, &[]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains(&format!(
            "the request to skip the source transaction committed at {wrong} matched none"
        )),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE skip_lsn IS NOT NULL"
        )
        .await,
        0
    );
}

/// update_missing = apply_remote for an UPDATE whose new row the source did not send whole (a
/// large value it left unchanged): the row cannot be inserted, so it is skipped, and the log says
/// why instead of a bare "policy skip" the user did not ask for. Under REPLICA IDENTITY FULL the
/// old row has the value: the row is inserted whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_missing_apply_remote_without_the_whole_row_says_why_it_skipped() {
    let db = TestDb::new("umtoast").await;
    db.both("CREATE TABLE ut (id int PRIMARY KEY, n int, big text, doc jsonb)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE ut").await;
    // Random text does not compress: stored out of line, and left out of later UPDATEs.
    db.source_sql(
        "INSERT INTO ut SELECT 1, 0, string_agg(md5(g::text), ''), '{\"a\": [1, 2]}' FROM generate_series(1, 4000) g",
    )
    .await;
    let config = config_file(
        "umtoast",
        "[conflicts]\nupdate_missing = \"apply_remote\"\n",
    );
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.target_sql("DELETE FROM ut").await;
    db.source_sql("UPDATE ut SET n = 1").await;
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("(update_missing); skipped: policy apply_remote would insert the new row, but the source did not send all of it"),
        "{err}"
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM ut").await, 0);
    // Recorded with the values it had, typed as the target's, and the one it lacked said so.
    let recorded = conflicts(&db).await;
    assert_eq!(
        recorded.last().and_then(|r| r.3.as_deref()),
        Some("{\"n\": 1, \"id\": 1, \"big\": \"<unchanged>\", \"doc\": {\"a\": [1, 2]}}"),
        "{recorded:?}"
    );
    // Under REPLICA IDENTITY FULL the old row carries the large value: the row goes in whole.
    db.both("CREATE TABLE uf (id int, n int, big text); ALTER TABLE uf REPLICA IDENTITY FULL;")
        .await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE uf").await;
    db.source_sql(
        "INSERT INTO uf SELECT 1, 0, string_agg(md5(g::text), '') FROM generate_series(1, 4000) g",
    )
    .await;
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.target_sql("DELETE FROM uf").await;
    db.source_sql("UPDATE uf SET n = 1").await;
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("uf").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM uf").await, 1);
}

/// A DEFERRABLE unique constraint on the target: INSERT .. ON CONFLICT without a named key
/// refuses such a table, so the insert_exists policies name the key checked at once (and a
/// clash on another unique index is still skipped); a table whose only key is deferrable is
/// refused by name, saying what to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_policies_on_a_table_with_a_deferrable_unique_constraint() {
    let db = TestDb::new("deferins").await;
    db.source_sql(
        "CREATE TABLE d (id int PRIMARY KEY, v text, w int); \
         CREATE TABLE o (id int NOT NULL, v text); ALTER TABLE o REPLICA IDENTITY FULL;",
    )
    .await;
    db.target_sql(
        "CREATE TABLE d (id int PRIMARY KEY, v text, w int UNIQUE, CONSTRAINT d_v UNIQUE (v) DEFERRABLE); \
         CREATE TABLE o (id int NOT NULL, v text, CONSTRAINT o_id UNIQUE (id) DEFERRABLE); \
         INSERT INTO d VALUES (2, 'local two', 20), (3, 'local three', 30);",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE d").await;
    db.source_sql(
        "INSERT INTO d VALUES (1, 'one', 10); INSERT INTO d VALUES (2, 'remote two', 21); \
         INSERT INTO d VALUES (4, 'four', 30); INSERT INTO d VALUES (5, 'five', 50);",
    )
    .await;
    let skip = config_file("deferins", "[conflicts]\ninsert_exists = \"skip\"\n");
    let out = sync_with(&db, &["--config", skip.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<(i32, String)> = db
        .target
        .query("SELECT id, v FROM d ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        rows,
        vec![
            (1, "one".to_string()),
            (2, "local two".to_string()),
            (3, "local three".to_string()),
            (5, "five".to_string())
        ]
    );
    let recorded = conflicts(&db).await;
    assert_eq!(recorded.len(), 2, "{recorded:?}");
    // apply_remote overwrites by the primary key beside the deferrable constraint.
    db.source_sql("INSERT INTO d VALUES (3, 'remote three', 31)")
        .await;
    let overwrite = config_file(
        "deferins",
        "[conflicts]\ninsert_exists = \"apply_remote\"\n",
    );
    let out = sync_with(&db, &["--config", overwrite.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM d WHERE id = 3 AND v = 'remote three'"
        )
        .await,
        1
    );
    // The only key deferrable: refused by name, with what to do; `check` says so first.
    db.source_sql("ALTER PUBLICATION p ADD TABLE o; INSERT INTO o VALUES (1, 'x')")
        .await;
    let out = run_with_deadline(
        db.on_both(
            "check",
            &["--slot", &db.slot(), "--config", skip.to_str().unwrap()],
        ),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(
        text.lines().any(|l| l.starts_with("PROBLEM")
            && l.contains("every unique key of target table \"public\".\"o\" is DEFERRABLE")),
        "{text}"
    );
    let out = sync_with(&db, &["--config", skip.to_str().unwrap()]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("\"public\".\"o\"")
            && err.contains("DEFERRABLE")
            && err.contains("[tables.\"public.o\".conflicts]"),
        "{err}"
    );
}

/// insert_exists under skip / keep_local records the target's row as it was when the INSERT met
/// it, also when the clash is on another unique index than the key, and every row met.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_rows_are_recorded_as_they_were_met() {
    let db = TestDb::new("keptrows").await;
    db.both("CREATE TABLE k (id int PRIMARY KEY, u int UNIQUE, v text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE k").await;
    db.target_sql(
        "INSERT INTO k VALUES (2, 20, 'local2'), (500, 5000, 'L500'), (60, 600, 'a'), (61, 610, 'b')",
    )
    .await;
    db.source_sql(
        "INSERT INTO k VALUES (3, 20, 'remote3'); INSERT INTO k VALUES (500, 5001, 'R500'); \
         INSERT INTO k VALUES (60, 610, 'both');",
    )
    .await;
    // A later change of the kept row, applied in the same run.
    db.source_sql("UPDATE k SET v = 'later' WHERE id = 500")
        .await;
    let config = config_file("keptrows", "[conflicts]\ninsert_exists = \"keep_local\"\n");
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let recorded = conflicts(&db).await;
    let locals: Vec<Option<&str>> = recorded.iter().map(|r| r.2.as_deref()).collect();
    assert_eq!(
        locals,
        vec![
            Some("{\"u\": 20, \"v\": \"local2\", \"id\": 2}"),
            Some("{\"u\": 5000, \"v\": \"L500\", \"id\": 500}"),
            Some(
                "[{\"u\": 600, \"v\": \"a\", \"id\": 60}, {\"u\": 610, \"v\": \"b\", \"id\": 61}]"
            ),
        ],
        "{recorded:?}"
    );
}

/// Conflict records hold a row's values as the apply reads them, whatever the target
/// database's own output settings: all of a float's digits, ISO dates, hex bytea.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflict_records_keep_every_digit_whatever_the_targets_settings() {
    let db = TestDb::new("recdigits").await;
    db.both("CREATE TABLE f (id int PRIMARY KEY, x float8, d date, b bytea)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE f").await;
    db.target_sql(&format!(
        "ALTER DATABASE {} SET extra_float_digits = -15; ALTER DATABASE {} SET datestyle = 'SQL, DMY'; \
         ALTER DATABASE {} SET bytea_output = escape",
        db.name, db.name, db.name
    ))
    .await;
    db.target_sql("INSERT INTO f VALUES (1, 0.30000000000000004, '2024-02-03', '\\x00ff')")
        .await;
    db.source_sql("INSERT INTO f VALUES (1, 1.0000000000000002, '2024-03-04', '\\x01ff')")
        .await;
    let config = config_file("recdigits", "[conflicts]\ninsert_exists = \"keep_local\"\n");
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let recorded = conflicts(&db).await;
    assert_eq!(
        (recorded[0].2.as_deref(), recorded[0].3.as_deref()),
        (
            Some("{\"b\": \"\\\\x00ff\", \"d\": \"2024-02-03\", \"x\": 0.30000000000000004, \"id\": 1}"),
            Some("{\"b\": \"\\\\x01ff\", \"d\": \"2024-03-04\", \"x\": 1.0000000000000002, \"id\": 1}")
        ),
        "{recorded:?}"
    );
}

/// A BEFORE ROW trigger on the target (ENABLE ALWAYS) that returns NULL keeps a change from
/// happening on purpose (a table that keeps the rows the source deletes, say): as with
/// PostgreSQL's own subscriber, that is no conflict, whatever the policy. A row really missing
/// still is one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_a_target_trigger_skips_is_no_conflict() {
    let db = TestDb::new("trigskip").await;
    db.both("CREATE TABLE kept (id int PRIMARY KEY, v text); CREATE TABLE odd (id int PRIMARY KEY, v int);")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE kept, odd").await;
    db.target_sql(
        "CREATE FUNCTION keep() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$; \
         CREATE TRIGGER keep BEFORE DELETE ON kept FOR EACH ROW EXECUTE FUNCTION keep(); \
         ALTER TABLE kept ENABLE ALWAYS TRIGGER keep; \
         CREATE FUNCTION only_even() RETURNS trigger LANGUAGE plpgsql AS $$ \
           BEGIN IF NEW.v % 2 = 1 THEN RETURN NULL; END IF; RETURN NEW; END $$; \
         CREATE TRIGGER only_even BEFORE INSERT OR UPDATE ON odd FOR EACH ROW EXECUTE FUNCTION only_even(); \
         ALTER TABLE odd ENABLE ALWAYS TRIGGER only_even;",
    )
    .await;
    db.source_sql("INSERT INTO kept SELECT g, 'row ' || g FROM generate_series(1, 5) g; INSERT INTO odd VALUES (1, 2), (2, 2);")
        .await;
    let config = config_file(
        "t",
        "[conflicts]\nupdate_missing = \"error\"\ndelete_missing = \"error\"\ninsert_exists = \"skip\"\n",
    );
    let config = config.to_str().unwrap();
    let out = sync_with(&db, &["--config", config]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    // Deletes the trigger keeps out; an update (to an odd value) it skips; an insert it skips
    // under `skip`, which answers by the key.
    db.source_sql(
        "DELETE FROM kept WHERE id <= 3; UPDATE odd SET v = 3 WHERE id = 1; INSERT INTO odd VALUES (3, 5);",
    )
    .await;
    let out = sync_with(&db, &["--config", config]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM kept").await, 5);
    assert_eq!(
        db.count(&db.target, "SELECT v::bigint FROM odd WHERE id = 1")
            .await,
        2
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM odd").await, 2);
    assert_eq!(conflicts(&db).await, vec![], "no conflict happened");
    // A row the target really lacks is still a conflict (policy error: the run stops).
    db.target_sql("ALTER TABLE kept DISABLE TRIGGER keep; DELETE FROM kept WHERE id = 5; ALTER TABLE kept ENABLE ALWAYS TRIGGER keep;")
        .await;
    db.source_sql("DELETE FROM kept WHERE id = 5").await;
    let out = sync_with(&db, &["--config", config]).await;
    assert!(!out.status.success());
    assert!(stderr(&out).contains("delete_missing"), "{}", stderr(&out));
}

/// insert_exists = "apply_remote" where the target's primary key is not the source's: the row
/// an insert overwrites is the one with the same target key (an INSERT with a new key used to
/// stop the run: no unique index matched its ON CONFLICT). Without any unique index there, the
/// error says which to add.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_remote_where_the_target_has_another_primary_key() {
    let db = TestDb::new("otherpk").await;
    db.source_sql("CREATE TABLE d (id int PRIMARY KEY, code text NOT NULL, v text); CREATE TABLE n (id int PRIMARY KEY, v text);")
        .await;
    db.target_sql("CREATE TABLE d (id int NOT NULL, code text PRIMARY KEY, v text); CREATE TABLE n (id int, v text);")
        .await;
    // A partitioned target keyed (id, region): the upsert goes through the partitioned table.
    db.source_sql("CREATE TABLE pt (id int PRIMARY KEY, region text NOT NULL, v text)")
        .await;
    db.target_sql(
        "CREATE TABLE pt (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region); \
         CREATE TABLE pt_eu PARTITION OF pt FOR VALUES IN ('eu'); CREATE TABLE pt_us PARTITION OF pt FOR VALUES IN ('us');",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE d, pt").await;
    db.target_sql(
        "INSERT INTO d VALUES (7, 'b', 'local'); INSERT INTO pt VALUES (2, 'us', 'local');",
    )
    .await;
    db.source_sql("INSERT INTO d VALUES (1, 'a', 'new'), (2, 'b', 'remote'); INSERT INTO pt VALUES (1, 'eu', 'new'), (2, 'us', 'remote');")
        .await;
    let config = config_file("o", "[conflicts]\ninsert_exists = \"apply_remote\"\n");
    let config = config.to_str().unwrap();
    let out = sync_with(&db, &["--config", config]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let target = &db.target;
    let rows = |sql: &'static str| async move {
        target
            .query(sql, &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect::<Vec<(i32, String, String)>>()
    };
    assert_eq!(
        rows("SELECT id, code, v FROM d ORDER BY code").await,
        vec![
            (1, "a".to_string(), "new".to_string()),
            (2, "b".to_string(), "remote".to_string())
        ]
    );
    assert_eq!(
        rows("SELECT id, region, v FROM pt ORDER BY id").await,
        vec![
            (1, "eu".to_string(), "new".to_string()),
            (2, "us".to_string(), "remote".to_string())
        ]
    );
    // No unique index at all on the target: said at the first insert, naming the one to add.
    db.source_sql("ALTER PUBLICATION p ADD TABLE n; INSERT INTO n VALUES (1, 'x');")
        .await;
    let out = sync_with(&db, &["--config", config]).await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("CREATE UNIQUE INDEX ON \"public\".\"n\" (\"id\")"),
        "{}",
        stderr(&out)
    );
    // `check` says so before a run meets it.
    let cmd = common::pgapply_command(&[
        "check",
        "--source",
        &db.source_conninfo(),
        "--target",
        &db.target_conninfo(),
        "--publication",
        "p",
        "--slot",
        &db.slot(),
        "--config",
        config,
    ]);
    let out = run_with_deadline(cmd, 60).await;
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        said.contains(
            "PROBLEM  conflict policy insert_exists = \"apply_remote\" for \"public\".\"n\""
        ),
        "{said}"
    );
    assert!(
        !said.contains("apply_remote\" for \"public\".\"d\""),
        "{said}"
    );
}

/// A trigger that skips changes, added on the target while pgapply runs: the table's triggers
/// were read before it, so the first change it keeps looks like a row missing; under policy
/// "error" pgapply applies again with them read anew, and goes on (it stopped for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipping_trigger_added_while_running_is_taken_in() {
    let db = TestDb::new("trigadded").await;
    db.both("CREATE TABLE late (id int PRIMARY KEY, v text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE late").await;
    db.source_sql("INSERT INTO late SELECT g, 'a' FROM generate_series(1, 5) g")
        .await;
    let config = config_file(
        "late",
        "[conflicts]\nupdate_missing = \"error\"\ndelete_missing = \"error\"\n",
    );
    let (mut child, log) =
        common::spawn_logged(db.pgapply("p", &["--config", config.to_str().unwrap()]));
    db.source_sql("UPDATE late SET v = 'b' WHERE id = 1").await;
    wait_for("the first update", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM late WHERE v = 'b'")
            .await
            == 1
    })
    .await;
    // (Not a wait for a condition: the table's triggers must have been read a while ago.)
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    db.target_sql(
        "CREATE FUNCTION keep() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$; \
         CREATE TRIGGER keep BEFORE DELETE ON late FOR EACH ROW EXECUTE FUNCTION keep(); \
         ALTER TABLE late ENABLE ALWAYS TRIGGER keep;",
    )
    .await;
    db.source_sql("DELETE FROM late WHERE id = 2; UPDATE late SET v = 'c' WHERE id = 3;")
        .await;
    wait_for("the update after the kept delete", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM late WHERE v = 'c'")
            .await
            == 1
    })
    .await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "pgapply stopped: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM late").await, 5);
    assert_eq!(conflicts(&db).await, vec![]);
    child.start_kill().unwrap();
    let _ = child.wait().await;
}

/// A published table dropped and created again on the source while pgapply runs: the target
/// table still holds the old one's rows, and an insert of the new one that clashes with one of
/// them says so (not only "a row already holds that key"), with what makes the target follow the
/// new table; following that advice applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_created_again_on_the_source_is_named_as_such_at_its_first_clash() {
    let db = TestDb::new("recreated").await;
    db.both("CREATE TABLE r (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR ALL TABLES").await;
    db.source_sql("INSERT INTO r VALUES (1, 'old'), (2, 'old')")
        .await;
    db.source_sql("DROP TABLE r").await;
    db.source_sql("CREATE TABLE r (id int PRIMARY KEY, v text)")
        .await;
    db.source_sql("INSERT INTO r VALUES (1, 'new')").await;
    let out = sync_with(&db, &[]).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("is a new table under that name") && err.contains("apply_remote"),
        "{err}"
    );
    let config = config_file(
        "recreated",
        "[tables.\"public.r\".conflicts]\ninsert_exists = \"apply_remote\"\n",
    );
    let out = sync_with(&db, &["--config", config.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<(i32, String)> = db
        .target
        .query("SELECT id, v FROM r ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // The old table's row 2 remains until deleted by hand (`pgapply verify` names it).
    assert_eq!(rows, vec![(1, "new".to_string()), (2, "old".to_string())]);
}
