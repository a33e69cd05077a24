//! End-to-end scenarios: a real source, a real target, pgapply as a process.

mod common;

use common::{run_with_deadline, stderr, wait_for, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_updates_deletes_over_many_transactions() {
    let db = TestDb::new("dml").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text, n numeric)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    for i in 0..200 {
        db.source_sql(&format!(
            "INSERT INTO t VALUES ({i}, 'v{i}', {i}.5); UPDATE t SET v = v || '!' WHERE id = {h}; DELETE FROM t WHERE id = {d};",
            h = i / 2,
            d = i / 3 * 3 - 1
        ))
        .await;
    }
    // A rolled-back transaction never appears.
    db.source_sql("BEGIN; INSERT INTO t VALUES (100000, 'rolled back', 0); ROLLBACK;")
        .await;
    db.sync("p").await;
    db.assert_same("t").await;
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM t WHERE id = 100000")
            .await,
        0
    );
    // A second run continues where the first stopped: nothing applied twice.
    db.source_sql("INSERT INTO t VALUES (5000, 'later', 1)")
        .await;
    db.sync("p").await;
    db.assert_same("t").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_key_changed_by_update() {
    let db = TestDb::new("pkchange").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1, 'a'), (2, 'b'); UPDATE t SET id = 10 WHERE id = 1; UPDATE t SET id = id + 100;").await;
    db.sync("p").await;
    db.assert_same("t").await;
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM t WHERE id IN (110, 102)")
            .await,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_identity_full_with_duplicates_and_nulls() {
    let db = TestDb::new("full").await;
    db.both(
        "CREATE TABLE f (a int, b text, c jsonb, d point); ALTER TABLE f REPLICA IDENTITY FULL;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE f").await;
    db.source_sql(
        "INSERT INTO f VALUES (1, 'x', '{\"k\": 1}', '(1,2)'), (1, 'x', '{\"k\": 1}', '(1,2)'), (2, NULL, NULL, NULL), (3, 'y', NULL, '(0,0)');",
    )
    .await;
    // Delete one of two identical rows: exactly one goes.
    db.source_sql("DELETE FROM f WHERE ctid = (SELECT ctid FROM f WHERE a = 1 LIMIT 1)")
        .await;
    db.source_sql("UPDATE f SET b = 'was null' WHERE a = 2")
        .await;
    db.source_sql("UPDATE f SET c = '{\"k\": 2}' WHERE a = 3")
        .await;
    db.sync("p").await;
    db.assert_same("f").await;
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM f WHERE a = 1")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_identity_using_index() {
    let db = TestDb::new("ridx").await;
    db.both(
        "CREATE TABLE u (id int NOT NULL, code text NOT NULL, v text); \
         CREATE UNIQUE INDEX u_code ON u (code); ALTER TABLE u REPLICA IDENTITY USING INDEX u_code;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE u").await;
    db.source_sql("INSERT INTO u VALUES (1, 'a', 'x'), (2, 'b', 'y'); UPDATE u SET v = 'z' WHERE code = 'a'; UPDATE u SET code = 'c' WHERE code = 'b'; DELETE FROM u WHERE code = 'a';").await;
    db.sync("p").await;
    db.assert_same("u").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn toast_value_kept_when_other_column_updated() {
    let db = TestDb::new("toast").await;
    db.both("CREATE TABLE d (id int PRIMARY KEY, title text, body text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE d").await;
    // ~1 MB of incompressible text, stored out of line.
    db.source_sql(
        "INSERT INTO d SELECT 1, 'first', string_agg(md5(i::text), '') FROM generate_series(1, 32768) i; \
         UPDATE d SET title = 'second' WHERE id = 1;",
    )
    .await;
    db.sync("p").await;
    db.assert_same("d").await;
    assert_eq!(
        db.count(&db.target, "SELECT length(body)::bigint FROM d")
            .await,
        32768 * 32
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_two_tables_cascade_restart_identity() {
    if common::clusters().source_major < 11 {
        common::skip("TRUNCATE is replicated from PostgreSQL 11");
        return;
    }
    let db = TestDb::new("trunc").await;
    db.both(
        "CREATE TABLE a (id serial PRIMARY KEY, v text); CREATE TABLE b (id serial PRIMARY KEY, v text); \
         CREATE TABLE parent (id int PRIMARY KEY); CREATE TABLE child (id int PRIMARY KEY, p int REFERENCES parent);",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE a, b, parent, child")
        .await;
    db.source_sql("INSERT INTO a (v) VALUES ('1'), ('2'); INSERT INTO b (v) VALUES ('3'); INSERT INTO parent VALUES (1); INSERT INTO child VALUES (1, 1);").await;
    db.source_sql("TRUNCATE a, b").await;
    db.source_sql("TRUNCATE parent CASCADE").await;
    db.sync("p").await;
    for t in ["a", "b", "parent", "child"] {
        db.assert_same(t).await;
    }
    // RESTART IDENTITY resets the target's own sequence too.
    db.target_sql("SELECT setval('a_id_seq', 50)").await;
    db.source_sql("INSERT INTO a (v) VALUES ('after'); TRUNCATE a RESTART IDENTITY;")
        .await;
    db.sync("p").await;
    db.assert_same("a").await;
    assert_eq!(db.count(&db.target, "SELECT nextval('a_id_seq')").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savepoints_rolled_back_inside_a_transaction() {
    let db = TestDb::new("savepoint").await;
    db.both("CREATE TABLE s (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE s").await;
    db.source_sql(
        "BEGIN; INSERT INTO s VALUES (1, 'kept'); SAVEPOINT a; INSERT INTO s VALUES (2, 'gone'); \
         UPDATE s SET v = 'gone too' WHERE id = 1; ROLLBACK TO SAVEPOINT a; SAVEPOINT b; INSERT INTO s VALUES (3, 'kept'); \
         RELEASE SAVEPOINT b; COMMIT;",
    )
    .await;
    db.sync("p").await;
    db.assert_same("s").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM s").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identifiers_that_need_quoting() {
    let db = TestDb::new("idents").await;
    db.both(
        r#"CREATE SCHEMA "Odd Schema"; CREATE TABLE "Odd Schema"."Mixed ""Case"" Tåble" ("Id" int PRIMARY KEY, "select" text, "with space" text, "ünï" int);"#,
    )
    .await;
    db.publish(r#"CREATE PUBLICATION "My Pub" FOR TABLE "Odd Schema"."Mixed ""Case"" Tåble""#)
        .await;
    db.source_sql(r#"INSERT INTO "Odd Schema"."Mixed ""Case"" Tåble" VALUES (1, 'a', 'b', 1), (2, 'c', 'd', 2); UPDATE "Odd Schema"."Mixed ""Case"" Tåble" SET "select" = 'z' WHERE "Id" = 1; DELETE FROM "Odd Schema"."Mixed ""Case"" Tåble" WHERE "Id" = 2;"#).await;
    db.sync("My Pub").await;
    db.assert_same(r#""Odd Schema"."Mixed ""Case"" Tåble""#)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_columns_reordered_with_default_and_generated() {
    let db = TestDb::new("colmap").await;
    db.source_sql("CREATE TABLE c (id int PRIMARY KEY, a text, b int)")
        .await;
    db.target_sql(
        "CREATE TABLE c (b int, extra text DEFAULT 'dflt', id int PRIMARY KEY, twice int GENERATED ALWAYS AS (b * 2) STORED, a text)",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE c").await;
    db.source_sql(
        "INSERT INTO c VALUES (1, 'x', 10), (2, 'y', 20); UPDATE c SET b = 11 WHERE id = 1;",
    )
    .await;
    db.sync("p").await;
    let rows = db
        .target
        .query("SELECT id, a, b, extra, twice FROM c ORDER BY id", &[])
        .await
        .unwrap();
    let got: Vec<(i32, String, i32, String, i32)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, "x".into(), 11, "dflt".into(), 22),
            (2, "y".into(), 20, "dflt".into(), 40)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_column_between_transactions() {
    let db = TestDb::new("addcol").await;
    db.both("CREATE TABLE g (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE g").await;
    db.source_sql("INSERT INTO g VALUES (1, 'before')").await;
    db.sync("p").await;
    // The target gets the column first, as with PostgreSQL's own subscriber.
    db.both("ALTER TABLE g ADD COLUMN w int").await;
    db.source_sql("INSERT INTO g VALUES (2, 'after', 7); UPDATE g SET w = 1 WHERE id = 1;")
        .await;
    db.sync("p").await;
    db.assert_same("g").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_type_round_trips() {
    let db = TestDb::new("types").await;
    db.both(
        "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy'); \
         CREATE DOMAIN posint AS int CHECK (VALUE > 0); \
         CREATE TYPE pair AS (x int, y text); \
         CREATE TABLE ty (id int PRIMARY KEY, n numeric, f4 real, f8 double precision, ts timestamptz, \
            tsn timestamp, d date, iv interval, by bytea, j json, jb jsonb, arr text[], iarr int[], e mood, \
            dm posint, cp pair, r int4range, tr tstzrange, ip inet, cidr_ cidr, u uuid, m money, vb bit varying(16), \
            b bit(3), ch char(5), vc varchar(10), x xml, pt point, t time, ttz timetz, bo boolean, o oid);",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE ty").await;
    db.source_sql(
        r#"SET timezone = 'America/New_York';
        INSERT INTO ty VALUES
        (1, 1234567890123456789012345678901234567890.0123456789, 'NaN', 'Infinity', '2024-02-29 12:34:56.789012+05:30',
         '1999-12-31 23:59:59.999999', '0001-01-01 BC', '1 year 2 mons -3 days 04:05:06.7', '\x00ff00deadbeef00',
         '{"a": [1, 2, {"b": null}], "z": "é"}', '{"k": "v", "n": 1.50}', ARRAY['a', NULL, 'with "quotes"', 'back\slash', ''],
         '{{1,2},{3,NULL}}', 'happy', 42, ROW(1, 'x,y"z'), '[1,10)', '[2024-01-01,2024-02-01)', '10.0.0.1/8', '192.168.0.0/16',
         'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '$1,234.56', B'1010', B'101', 'ab', 'ünïcødé', '<a x="1">t</a>', '(1.5,-2)',
         '23:59:59.999999', '12:00:00+03', true, 4294967295),
        (2, '-0.000000000000000000001', '-Infinity', '-0', 'infinity', '-infinity', 'infinity', '-178000000 years', '',
         'null', '[]', '{}', '{}', 'sad', 1, ROW(NULL, NULL), 'empty', '(,)', '::1', '::/0',
         '00000000-0000-0000-0000-000000000000', '-$0.01', B'', B'000', '', '', NULL, '(0,0)',
         '00:00', '00:00+00', false, 0),
        (3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
         NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
        UPDATE ty SET f8 = 1e308, f4 = 1.17549435e-38 WHERE id = 3;"#,
    )
    .await;
    // Updates of every type, held and sent as one batched statement: row 1's values into 2 and 3.
    let columns = "n, f4, f8, ts, tsn, d, iv, by, j, jb, arr, iarr, e, dm, cp, r, tr, ip, cidr_, u, m, vb, b, ch, vc, x, pt, t, ttz, bo, o";
    db.source_sql(&format!(
        "BEGIN; UPDATE ty SET ({columns}) = (SELECT {columns} FROM ty WHERE id = 1) WHERE id = 2; COMMIT; \
         BEGIN; UPDATE ty SET ({columns}) = (SELECT {columns} FROM ty WHERE id = 1) WHERE id = 3; COMMIT;"
    ))
    .await;
    db.sync("p").await;
    db.assert_same("ty").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpos_stops_exactly_there() {
    let db = TestDb::new("endpos").await;
    db.both("CREATE TABLE e (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE e").await;
    db.source_sql("INSERT INTO e SELECT generate_series(1, 10)")
        .await;
    let endpos = db.source_wal().await;
    db.source_sql("INSERT INTO e VALUES (11)").await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM e").await, 10);
    // Idle source, end position already reached: exits at once.
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 30).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.sync("p").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM e").await, 11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_row_warns_and_continues() {
    let db = TestDb::new("missing").await;
    db.both("CREATE TABLE m (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE m").await;
    db.source_sql("INSERT INTO m VALUES (1, 'a'), (2, 'b')")
        .await;
    db.sync("p").await;
    db.target_sql("DELETE FROM m WHERE id = 1").await;
    db.source_sql("UPDATE m SET v = 'changed' WHERE id = 1; DELETE FROM m WHERE id = 1; UPDATE m SET v = 'c' WHERE id = 2;").await;
    let out = db.sync("p").await;
    let log = stderr(&out);
    assert!(
        log.contains("UPDATE found no row")
            && log.contains("\"public\".\"m\"")
            && log.contains("(\"id\")=(1)"),
        "{log}"
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM m WHERE v = 'c'")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_violation_stops_and_is_retried_after_fix() {
    let db = TestDb::new("conflict").await;
    db.both("CREATE TABLE k (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE k").await;
    db.target_sql("INSERT INTO k VALUES (2, 'local')").await;
    db.source_sql("INSERT INTO k VALUES (1, 'a')").await;
    db.source_sql("INSERT INTO k VALUES (2, 'b'); INSERT INTO k VALUES (3, 'c');")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("duplicate key") && err.contains("\"public\".\"k\""),
        "{err}"
    );
    // The failing transaction left nothing behind; the one before it is applied.
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM k WHERE id = 3")
            .await,
        0
    );
    db.target_sql("DELETE FROM k WHERE id = 2").await;
    db.sync("p").await;
    db.assert_same("k").await;
}

/// Rows of a table as text, in key order, for comparing source and target.
async fn rows_text(client: &tokio_postgres::Client, sql: &str) -> Vec<String> {
    client
        .query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_of_one_group_are_collapsed_and_land_exactly() {
    let db = TestDb::new("batch").await;
    db.both(
        "CREATE TABLE acc (id int PRIMARY KEY, n int NOT NULL, note text); \
         CREATE TABLE log (id int PRIMARY KEY, acc int)",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE acc, log").await;
    // Notes big and random enough to be stored out of line: updates that leave them alone send
    // them as unchanged TOAST values.
    db.source_sql(
        "INSERT INTO acc SELECT o.id, 0, (SELECT string_agg(md5(random()::text || o.id || s.k), '') \
         FROM generate_series(1, 300) AS s(k)) FROM generate_series(1, 50) AS o(id)",
    )
    .await;
    db.sync("p").await;
    // A row only the source has (update_missing, skipped and recorded once per group).
    db.target_sql("DELETE FROM acc WHERE id = 50").await;
    let mut workload = String::new();
    for i in 1..=200 {
        workload.push_str(&format!(
            "BEGIN; UPDATE acc SET n = n + 1 WHERE id = {hot}; UPDATE acc SET n = n + {i} WHERE id = {cold}; \
             INSERT INTO log VALUES ({i}, {hot}); COMMIT; ",
            hot = 1 + i % 5,
            cold = 6 + i % 45,
        ));
        if i % 50 == 0 {
            // Other changes to the same table in between: the held updates go first.
            workload.push_str(&format!(
                "BEGIN; UPDATE acc SET note = 'short {i}' WHERE id = 7; DELETE FROM acc WHERE id = 8; \
                 INSERT INTO acc VALUES (8, {i}, 'again'); UPDATE acc SET n = n + 1 WHERE id = 8; \
                 UPDATE acc SET id = 1000 + {i} WHERE id = 9; UPDATE acc SET id = 9 WHERE id = 1000 + {i}; COMMIT; "
            ));
        }
    }
    db.source_sql(&workload).await;
    let updates_before = db
        .count(
            &db.target,
            "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'acc'",
        )
        .await;
    db.sync("p").await;
    let query = "SELECT (a.*)::text FROM acc a WHERE id <> 50 ORDER BY id";
    assert_eq!(
        rows_text(&db.source, query).await,
        rows_text(&db.target, query).await
    );
    db.assert_same("log").await;
    let missing = db
        .count(
            &db.target,
            "SELECT count(*) FROM pgapply.conflicts WHERE conflict_type = 'update_missing'",
        )
        .await;
    assert!(missing >= 1, "the update of row 50 is recorded as missing");
    // The source ran more than 400 UPDATEs of acc; held per group, far fewer reach the target.
    let stats = "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'acc'";
    wait_for(
        "the target's statistics to show the updates",
        30,
        || async { db.count(&db.target, stats).await > updates_before },
    )
    .await;
    let updates = db.count(&db.target, stats).await - updates_before;
    assert!(updates < 250, "{updates} row updates on the target");
}
