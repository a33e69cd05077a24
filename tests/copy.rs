//! Initial copy (`--copy-data`): existing rows, in the slot's snapshot, while the source keeps
//! changing; row filters and column lists; interrupted copies start over; non-empty targets.

mod common;

use futures_util::FutureExt;

use common::{connect, run_with_deadline, spawn, stderr, wait_for, TestDb};

async fn setup(db: &TestDb) {
    db.both(
        "CREATE TABLE big (id int PRIMARY KEY, pad text); \
         CREATE TABLE nopk (a int, b text); ALTER TABLE nopk REPLICA IDENTITY FULL; \
         CREATE TABLE filtered (id int PRIMARY KEY, a text, secret text);",
    )
    .await;
    db.source_sql(
        "INSERT INTO big SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, 60000) g; \
         INSERT INTO nopk SELECT g % 100, 'x' FROM generate_series(1, 1000) g; \
         INSERT INTO filtered SELECT g, 'a' || g, 's' || g FROM generate_series(1, 1000) g; \
         ANALYZE big;",
    )
    .await;
    if common::clusters().source_major >= 15 {
        db.source_sql(
            "CREATE PUBLICATION p FOR TABLE big, nopk; \
             CREATE PUBLICATION pf FOR TABLE filtered (id, a) WHERE (id % 2 = 0);",
        )
        .await;
    } else {
        // Row filters and column lists arrive with PostgreSQL 15: publish the whole table.
        db.source_sql(
            "CREATE PUBLICATION p FOR TABLE big, nopk; CREATE PUBLICATION pf FOR TABLE filtered;",
        )
        .await;
    }
}

async fn text_value(c: &tokio_postgres::Client, sql: &str) -> Option<String> {
    c.query_one(sql, &[])
        .await
        .ok()
        .and_then(|r| r.get::<_, Option<String>>(0))
}

/// The target holds exactly the published rows (even ids) and columns (no `secret`) of `filtered`.
async fn filtered_matches(db: &TestDb) -> bool {
    if common::clusters().source_major < 15 {
        let (s, t) = db.digest("filtered").await;
        return s == t;
    }
    let s = text_value(&db.source, "SELECT md5(string_agg(id || ':' || a || '-', ',' ORDER BY id)) FROM filtered WHERE id % 2 = 0").await;
    let t = text_value(&db.target, "SELECT md5(string_agg(id || ':' || a || coalesce(secret, '-'), ',' ORDER BY id)) FROM filtered").await;
    s.is_some() && s == t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_while_the_source_changes_then_stream() {
    let db = TestDb::new("copy").await;
    setup(&db).await;
    // Writers keep changing the source during the copy.
    let writer = {
        let client = connect(db.source_port, &db.name).await;
        tokio::spawn(async move {
            for i in 0..300 {
                client
                    .batch_execute(&format!(
                        "BEGIN; UPDATE big SET pad = 'changed {i}' WHERE id = {}; INSERT INTO big VALUES ({}, 'new'); \
                         DELETE FROM nopk WHERE ctid = (SELECT ctid FROM nopk LIMIT 1); INSERT INTO nopk VALUES ({i}, 'w'); \
                         INSERT INTO filtered VALUES ({}, 'n', 's'); COMMIT;",
                        i * 97 % 60000 + 1,
                        100000 + i,
                        5000 + i
                    ))
                    .await
                    .expect("writer");
            }
        })
    };
    let (mut child, log) = common::spawn_logged(db.pgapply(
        "p,pf",
        &[
            "--copy-data",
            "--create-slot",
            "--copy-jobs",
            "3",
            "--copy-split-pages",
            "200",
        ],
    ));
    writer.await.expect("writer");
    let target_matches = || async {
        let (s, t) = db.digest("big").await;
        let (s2, t2) = db.digest("nopk").await;
        s == t && s2 == t2 && filtered_matches(&db).await
    };
    wait_for(
        "target to match the source after copy and catch-up",
        120,
        target_matches,
    )
    .await;
    let pid = child.id().expect("pid") as i32;
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(child.wait().await.expect("wait").success());
    // The large table's key on the target is named, with the faster way (the small ones are
    // not: `nopk` has no index, `filtered` is small).
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    let said: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("these large tables have indexes on the target"))
        .collect();
    assert!(
        said.len() == 1
            && said[0].contains("\"public\".\"big\"")
            && !said[0].contains("filtered")
            && said[0].contains("schema --section post-data"),
        "{text}"
    );
    // The big table was copied in page ranges.
    let jobs: i64 = db
        .target
        .query_one(
            "SELECT count(*) FROM pgapply.copy_state WHERE state = 'done'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(jobs, 3);
    let (total, done): (i32, i32) = db
        .target
        .query_one(
            "SELECT jobs_total, jobs_done FROM pgapply.copy_state WHERE table_name = 'big'",
            &[],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    // (Page ranges need a 14+ source: TID range scans.)
    let split = common::clusters().source_major >= 14;
    assert!(
        (total > 1 || !split) && done == total,
        "big copied in {done} of {total} page ranges"
    );
    // Rows and bytes of every table are recorded (bytes while the copy runs, rows per range).
    let counted = db
        .count(
            &db.target,
            "SELECT count(*) FROM pgapply.copy_state WHERE rows_copied > 0 AND bytes_copied > rows_copied",
        )
        .await;
    assert_eq!(counted, 3);
    // Streaming goes on after a restart without --copy-data, and a second --copy-data does not copy again.
    db.source_sql("INSERT INTO big VALUES (999999, 'after')")
        .await;
    db.sync("p,pf").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p,pf", &["--copy-data", "--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("big").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inheritance_children_are_copied_once_and_user_defined_types_arrive() {
    let db = TestDb::new("copyinh").await;
    // A type on the target only, so the enum's type OIDs differ between the two sides (binary
    // COPY of an array of it would carry the source's OID).
    db.target_sql("CREATE TYPE unrelated AS ENUM ('u')").await;
    db.both(
        "CREATE TYPE mood AS ENUM ('calm', 'loud'); \
         CREATE TABLE animals (id int PRIMARY KEY, moods mood[], m mood); \
         CREATE TABLE dogs (PRIMARY KEY (id)) INHERITS (animals);",
    )
    .await;
    db.source_sql(
        "INSERT INTO animals SELECT g, ARRAY['calm', 'loud']::mood[], 'calm' FROM generate_series(1, 50) g; \
         INSERT INTO dogs SELECT g, ARRAY['loud']::mood[], 'loud' FROM generate_series(101, 120) g; \
         CREATE PUBLICATION p FOR TABLE animals;",
    )
    .await;
    copy_up_to_now(&db).await;
    for (sql, want) in [
        ("SELECT count(*) FROM ONLY animals", 50),
        ("SELECT count(*) FROM dogs", 20),
        (
            "SELECT count(*) FROM animals WHERE moods = ARRAY['calm', 'loud']::mood[]",
            50,
        ),
        (
            "SELECT count(*) FROM dogs WHERE moods = ARRAY['loud']::mood[] AND m = 'loud'",
            20,
        ),
    ] {
        assert_eq!(db.count(&db.target, sql).await, want, "{sql}");
    }

    // A table published after the copy: copied by the next --copy-data run, alone.
    db.both("CREATE TABLE later (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO later VALUES (1); ALTER PUBLICATION p ADD TABLE later")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("published after the initial copy: copying")
            && stderr(&out).contains("\"public\".\"later\""),
        "{}",
        stderr(&out)
    );
    db.assert_same("later").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM dogs").await, 20);

    // The slot is lost: a new one would skip what the old one held. Refused, with the way out.
    db.drop_slot().await;
    db.source_sql("INSERT INTO dogs VALUES (200, NULL, 'calm')")
        .await;
    let out = run_with_deadline(db.pgapply("p", &["--create-slot"]), 60).await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no longer exists") && stderr(&out).contains("--truncate-target"),
        "{}",
        stderr(&out)
    );
    // Taking it: the tables are copied again into a new slot.
    let copy_again = || async {
        let endpos = db.source_wal().await;
        let out = run_with_deadline(
            db.pgapply(
                "p",
                &["--copy-data", "--truncate-target", "--endpos", &endpos],
            ),
            60,
        )
        .await;
        assert!(out.status.success(), "{}", stderr(&out));
    };
    copy_again().await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM dogs").await, 21);
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM later").await, 1);

    // Once more, with `later` out of the publication: the copy's record holds only what this
    // copy took (an interrupted copy empties what is recorded there before it starts over, and
    // `later` is no longer pgapply's to empty).
    db.drop_slot().await;
    db.source_sql("ALTER PUBLICATION p DROP TABLE later").await;
    copy_again().await;
    let recorded = format!(
        "SELECT count(*) FROM pgapply.copy_state WHERE slot_name = '{}' AND table_name = 'later'",
        db.slot()
    );
    assert_eq!(db.count(&db.target, &recorded).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_copy_starts_over() {
    let db = TestDb::new("copykill").await;
    db.both(
        &(1..=8)
            .map(|i| format!("CREATE TABLE t{i} (id int PRIMARY KEY, pad text);"))
            .collect::<String>(),
    )
    .await;
    db.source_sql(
        &(1..=8)
            .map(|i| {
                format!(
                    "INSERT INTO t{i} SELECT g, repeat('x', 200) FROM generate_series(1, 40000) g;"
                )
            })
            .collect::<String>(),
    )
    .await;
    db.source_sql(&format!(
        "CREATE PUBLICATION p FOR TABLE {}",
        (1..=8)
            .map(|i| format!("t{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
    .await;
    let under_way = || async {
        db.target
            .query_one("SELECT count(*) FILTER (WHERE state = 'done') > 0 AND count(*) FILTER (WHERE state = 'copying') > 0 FROM pgapply.copy_state", &[])
            .await
            .map(|r| r.get::<_, Option<bool>>(0) == Some(true))
            .unwrap_or(false)
    };
    // Stopped (SIGTERM) first: status shows the table it was copying as interrupted.
    let mut child = spawn(db.pgapply("p", &["--copy-data", "--copy-jobs", "1"]));
    wait_for("the copy to be under way", 60, under_way).await;
    common::signal(&child, libc::SIGTERM);
    assert!(child.wait().await.expect("wait").success());
    let out = run_with_deadline(
        common::pgapply_command(&["status", "--target", &db.target_conninfo()]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains(": stopped") && !text.contains(" copying:") && text.contains(" interrupted:"),
        "{text}"
    );
    // Then killed.
    let mut child = spawn(db.pgapply("p", &["--copy-data", "--copy-jobs", "1"]));
    wait_for("the copy to be under way again", 60, under_way).await;
    child.start_kill().expect("kill -9");
    child.wait().await.expect("wait");
    // Without --copy-data the interrupted copy is refused with a clear message.
    let out = run_with_deadline(db.pgapply("p", &[]), 60).await;
    assert!(!out.status.success());
    assert!(stderr(&out).contains("interrupted"), "{}", stderr(&out));
    // check says so too, and which tables a run with --copy-data empties again.
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("PROBLEM")
            && l.contains("interrupted")
            && l.contains("--copy-data")
            && l.contains("\"public\".\"t")),
        "{text}"
    );
    db.source_sql("UPDATE t1 SET pad = 'changed' WHERE id < 100")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 120).await;
    assert!(out.status.success(), "{}", stderr(&out));
    // The tables it empties again are named as tables (not as the TRUNCATE's `ONLY ...`).
    let err = stderr(&out);
    let said = err
        .lines()
        .find(|l| l.contains("the previous initial copy was interrupted: starting it over"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        said.contains("\"public\".\"t1\"") && !said.contains("ONLY"),
        "{said}"
    );
    for i in 1..=8 {
        db.assert_same(&format!("t{i}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_empty_target_is_refused_unless_truncate_target() {
    let db = TestDb::new("copyfull").await;
    // ref_parent has rows on the target, ref_child (which references it) has none: PostgreSQL
    // empties such a pair only in one statement.
    db.both(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE ref_parent (id int PRIMARY KEY); \
         CREATE TABLE ref_child (id int PRIMARY KEY, parent int REFERENCES ref_parent)",
    )
    .await;
    db.source_sql(
        "INSERT INTO t VALUES (1, 'source'); INSERT INTO ref_parent VALUES (1); \
         INSERT INTO ref_child VALUES (1, 1); CREATE PUBLICATION p FOR TABLE t, ref_parent, ref_child;",
    )
    .await;
    db.target_sql("INSERT INTO t VALUES (2, 'stale'); INSERT INTO ref_parent VALUES (2)")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("\"public\".\"t\"")
            && err.contains("not empty")
            && err.contains("--truncate-target"),
        "{err}"
    );
    // Refused before the slot was made: none is left to hold WAL, or to stream from later.
    let slots = db.slot_count().await;
    assert_eq!(slots, 0, "a refused copy leaves no slot behind");
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &["--copy-data", "--truncate-target", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    for table in ["t", "ref_parent", "ref_child"] {
        db.assert_same(table).await;
    }
}

/// `pgapply run --copy-data --create-slot` up to the source's current position; expects success.
async fn copy_up_to_now(db: &TestDb) {
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--create-slot", "--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `pgapply run --copy-data --truncate-target` of publication p under a second slot.
async fn copy_under_another_slot(db: &TestDb) -> std::process::Output {
    let other = format!("{}_b", db.slot());
    run_with_deadline(
        db.pgapply_via(
            &db.source_conninfo(),
            &db.target_conninfo(),
            &other,
            "p",
            &[
                "--copy-data",
                "--truncate-target",
                "--endpos",
                &db.source_wal().await,
            ],
        ),
        60,
    )
    .await
}

/// A second worker's --copy-data --truncate-target into a table the copy of another slot filled
/// (fan-in from two sources): refused, naming that slot, and the rows stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_target_refuses_a_table_another_slot_filled() {
    let db = TestDb::new("faninc").await;
    db.both("CREATE TABLE shared (id int PRIMARY KEY)").await;
    db.source_sql(
        "INSERT INTO shared SELECT generate_series(1, 10); CREATE PUBLICATION p FOR TABLE shared;",
    )
    .await;
    copy_up_to_now(&db).await;
    let out = copy_under_another_slot(&db).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!(
            "\"public\".\"shared\" (filled by slot '{}')",
            db.slot()
        )) && stderr(&out).contains(&format!("pgapply forget --target ... --slot {}", db.slot())),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM shared").await,
        10
    );
    // `check` says the same, not "empty it, or add --truncate-target".
    let other = format!("{}_b", db.slot());
    let out = run_with_deadline(
        db.on_both("check", &["--slot", &other, "--create-slot", "--copy-data"]),
        60,
    )
    .await;
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(&format!(
            "target table \"public\".\"shared\" holds the rows another worker (slot '{}') fills",
            db.slot()
        )) && !said.contains("empty it, or add --truncate-target"),
        "{said}"
    );
    // A table published later to a worker that copied before: not emptied, and said why.
    db.both("CREATE TABLE mine (id int PRIMARY KEY)").await;
    db.source_sql("CREATE PUBLICATION q FOR TABLE mine").await;
    // `run --copy-data` of publication q under the second slot, up to now.
    let copy_q = || {
        let (db, other) = (&db, other.clone());
        async move {
            let end = db.source_wal().await;
            let args = ["--copy-data", "--endpos", end.as_str()];
            let run = db.pgapply_via(
                &db.source_conninfo(),
                &db.target_conninfo(),
                &other,
                "q",
                &args,
            );
            run_with_deadline(run, 60).await
        }
    };
    let out = copy_q().await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql("ALTER PUBLICATION q ADD TABLE shared").await;
    let out = run_with_deadline(
        db.on_both_publication("check", "q", &["--slot", &other, "--copy-data"]),
        60,
    )
    .await;
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(&format!(
            "published after the initial copy: target table \"public\".\"shared\" holds the rows another worker (slot '{}') fills",
            db.slot()
        )),
        "{said}"
    );
    let out = copy_q().await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!(
            "its target table \"public\".\"shared\" holds the rows another worker (slot '{}') fills",
            db.slot()
        )),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM shared").await,
        10
    );
}

/// The same when the other slot's copy filled the table under another source name ([tables]
/// maps its source table onto it): the copy records the target table it fills, so the refusal
/// does not depend on names matching.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_target_refuses_a_table_another_slot_filled_through_a_mapping() {
    let db = TestDb::new("faninmap").await;
    db.source_sql(
        "CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE shared (id int PRIMARY KEY); \
         INSERT INTO a SELECT generate_series(1, 10); INSERT INTO shared SELECT generate_series(11, 15); \
         CREATE PUBLICATION p FOR TABLE a; CREATE PUBLICATION q FOR TABLE shared;",
    )
    .await;
    db.target_sql("CREATE TABLE shared (id int PRIMARY KEY)")
        .await;
    let config = std::env::temp_dir().join(format!("pgapply-faninmap-{}.toml", db.name));
    std::fs::write(
        &config,
        "[tables.\"public.a\"]\ntarget = \"public.shared\"\n",
    )
    .unwrap();
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--config",
                config.to_str().unwrap(),
                "--copy-data",
                "--create-slot",
                "--endpos",
                &endpos,
            ],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let other = format!("{}_b", db.slot());
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_via(
            &db.source_conninfo(),
            &db.target_conninfo(),
            &other,
            "q",
            &["--copy-data", "--truncate-target", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!(
            "\"public\".\"shared\" (filled by slot '{}')",
            db.slot()
        )),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM shared").await,
        10
    );
}

/// The same for a table another slot only streams into (started without an initial copy, as
/// the other sources of a fan-in are): its rows are never sent again, so emptying it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_target_refuses_a_table_another_slot_streams_into() {
    let db = TestDb::new("faninstream").await;
    db.both("CREATE TABLE shared (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE shared").await;
    db.source_sql("INSERT INTO shared SELECT generate_series(1, 10)")
        .await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &db.source_wal().await]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let out = copy_under_another_slot(&db).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!(
            "\"public\".\"shared\" (filled by slot '{}')",
            db.slot()
        )) && stderr(&out).contains("by its initial copy or its stream"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM shared").await,
        10
    );
}

/// A table the copy fills that the target publishes (the way back of a two-way set-up): the
/// copied rows carry no origin, which the copy says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_table_the_target_publishes_is_named() {
    let db = TestDb::new("copyback").await;
    db.both("CREATE TABLE tw (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO tw VALUES (1); CREATE PUBLICATION p FOR TABLE tw;")
        .await;
    db.target_sql("CREATE PUBLICATION back FOR TABLE tw").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--create-slot", "--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("tables this copy fills are published on the target"),
        "{}",
        stderr(&out)
    );
}

/// A copied row no partition of the target takes: the error says to create the partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_row_without_a_target_partition_is_named() {
    let db = TestDb::new("copynopart").await;
    db.source_sql("CREATE TABLE rb (id int PRIMARY KEY, v text)")
        .await;
    db.target_sql(
        "CREATE TABLE rb (id int PRIMARY KEY, v text) PARTITION BY RANGE (id); \
         CREATE TABLE rb_low PARTITION OF rb FOR VALUES FROM (0) TO (1000);",
    )
    .await;
    db.source_sql(
        "INSERT INTO rb SELECT i, 'x' FROM generate_series(1, 10) i; INSERT INTO rb VALUES (3002, 'far'); \
         CREATE PUBLICATION p FOR TABLE rb;",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--create-slot", "--endpos", &endpos]),
        60,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no partition of target table \"public\".\"rb\" takes the source's row: create the partition on the target"),
        "{}",
        stderr(&out)
    );
}

/// The `pgapply run` a `cutover --reverse` printed (its output `text`), as arguments: split as a
/// shell would (its connection strings are in single quotes), and naming the new and the old
/// primary as this test reaches them.
fn printed_reverse_run(db: &TestDb, text: &str) -> Vec<String> {
    let printed = text
        .lines()
        .find(|l| l.trim_start().starts_with("pgapply run --source "))
        .unwrap_or_else(|| panic!("no command printed: {text}"));
    let mut args = Vec::new();
    let (mut word, mut quoted, mut any) = (String::new(), false, false);
    for c in printed.trim().chars() {
        match c {
            '\'' => (quoted, any) = (!quoted, true),
            c if c.is_whitespace() && !quoted => {
                if any {
                    args.push(std::mem::take(&mut word));
                }
                any = false;
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        args.push(word);
    }
    let value = |flag: &str| {
        let at = args.iter().position(|a| a == flag).unwrap() + 1;
        args[at].clone()
    };
    let port_of = |conninfo: &str| {
        conninfo
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("port="))
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(
        port_of(&value("--source")),
        db.target_port.to_string(),
        "{printed}"
    );
    assert_eq!(
        port_of(&value("--target")),
        db.source_port.to_string(),
        "{printed}"
    );
    assert!(!printed.contains('<'), "a placeholder: {printed}");
    args.into_iter().skip(1).collect()
}

/// Whether a pg_dump at least as new as the source is installed (`pgapply schema` needs one);
/// says why not when not.
fn pg_dump_usable() -> bool {
    let c = common::clusters();
    let pg_dump = std::env::var_os("PGAPPLY_PG_DUMP")
        .map(std::path::PathBuf::from)
        .or_else(|| pgapply::cluster::newest_installed("pg_dump"));
    let dump_major = pg_dump
        .and_then(|p| std::process::Command::new(p).arg("--version").output().ok())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .find_map(|w| w.split('.').next().and_then(|m| m.parse::<u32>().ok()))
        })
        .unwrap_or(0);
    if dump_major < c.source_major {
        common::skip(&format!(
            "pgapply schema needs pg_dump {} or newer (set PGAPPLY_PG_DUMP); found {dump_major}",
            c.source_major
        ));
        return false;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_then_copy_then_cutover_with_sequences() {
    // A pg_dump that says it is 9.6, written long before it runs (a file still open for writing
    // in a process forked meanwhile cannot be run).
    let fake = std::env::temp_dir().join(format!("pgapply-old-pg_dump-{}", std::process::id()));
    std::fs::write(&fake, "#!/bin/sh\necho 'pg_dump (PostgreSQL) 9.6.24'\n").unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    if !pg_dump_usable() {
        let _ = std::fs::remove_file(&fake);
        return;
    }
    let db = TestDb::new("cutover").await;
    let role = format!("app_{}", db.name);
    db.source_sql(&format!(
        "CREATE TYPE state AS ENUM ('new', 'done'); \
         CREATE SEQUENCE invoice_no START 1000; CREATE SEQUENCE unused_seq; \
         CREATE TABLE orders (id bigserial PRIMARY KEY, s state NOT NULL DEFAULT 'new', note text, \
                              invoice bigint DEFAULT nextval('invoice_no')); \
         CREATE TABLE items (id int GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, order_id bigint REFERENCES orders); \
         CREATE TABLE unpublished (x int); \
         INSERT INTO orders (note) SELECT 'n' || g FROM generate_series(1, 500) g; \
         INSERT INTO items (order_id) SELECT g FROM generate_series(1, 500) g; \
         CREATE PUBLICATION p FOR TABLE orders, items; \
         CREATE ROLE {role} LOGIN; GRANT SELECT, INSERT ON orders TO {role};"
    ))
    .await;
    // No pg_dump, or one older than the source: said, with what to install, before anything.
    let older = format!(
        "pg_dump (PostgreSQL) 9.6.24 ({}) is older than the source",
        fake.display()
    );
    for (pg_dump, says) in [
        (
            "/nonexistent/pg_dump",
            "cannot run pg_dump (/nonexistent/pg_dump)",
        ),
        (fake.to_str().unwrap(), older.as_str()),
    ] {
        let mut cmd = db.on_both("schema", &[]);
        cmd.env("PGAPPLY_PG_DUMP", pg_dump);
        let out = run_with_deadline(cmd, 60).await;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains(says) && err.contains("PGAPPLY_PG_DUMP"),
            "{err}"
        );
    }
    let _ = std::fs::remove_file(&fake);
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_class WHERE relname = 'orders'"
        )
        .await,
        0
    );
    // Definitions: types, sequences, tables; not the unpublished table.
    let out = run_with_deadline(db.on_both("schema", &[]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_class WHERE relname IN ('orders', 'items', 'orders_id_seq')"
        )
        .await,
        3
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_class WHERE relname = 'unpublished'"
        )
        .await,
        0
    );

    let (mut worker, worker_log) = common::spawn_logged(db.pgapply("p", &["--copy-data"]));
    db.source_sql(
        "INSERT INTO orders (note) VALUES ('during'); INSERT INTO items (order_id) VALUES (501);",
    )
    .await;
    wait_for("copy and catch-up", 60, || async {
        let (s, t) = db.digest("orders").await;
        s == t
    })
    .await;
    db.wait_slot_active().await;
    // Cutover with the worker running: lag, freeze, drain, sequences, verify. The frozen role
    // is on the target too, without the rights it has on the source: said before anything.
    db.target_sql(&format!("CREATE ROLE {role} LOGIN")).await;
    let text = db.cutover(&["--freeze-writes", &role]).await;
    assert!(
        text.contains(&format!(
            "before the cutover: WARNING: role \"{role}\" may do less on the target than on the source"
        )) && text.contains(&format!("GRANT SELECT, INSERT ON \"public\".\"orders\" TO \"{role}\";"))
            && !text.contains("ON \"public\".\"items\"")
            && text.contains("first give the frozen roles there the rights they lack"),
        "{text}"
    );
    // The serial and identity sequences, and the one a column default names; not the unused.
    assert!(
        text.contains("step 4: copied 3 sequence(s)")
            && text
                .contains("not copied, as no published table uses them: \"public\".\"unused_seq\"")
            && text.contains("before the cutover: sequence(s) no published table uses are not copied: \"public\".\"unused_seq\"")
            && text.contains("SELECT setval(E'\"public\".\"unused_seq\"', 1, false);")
            && text.contains("cutover done"),
        "{text}"
    );
    let frozen: i64 = db.count(&db.source, &format!("SELECT count(*) FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole WHERE r.rolname = '{role}' AND s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database()) AND 'default_transaction_read_only=on' = ANY (s.setconfig)")).await;
    assert_eq!(frozen, 1);
    // Sequences continue after the source's values, not at 1.
    let next_order = db
        .count(&db.target, "SELECT nextval('orders_id_seq')")
        .await;
    let next_item = db
        .count(
            &db.target,
            "SELECT nextval(pg_get_serial_sequence('items', 'id'))",
        )
        .await;
    assert_eq!((next_order, next_item), (502, 502));
    let next_invoice = db.count(&db.target, "SELECT nextval('invoice_no')").await;
    assert_eq!(next_invoice, 1501);
    // The worker was asked to stop at the cutover's end position: it has, cleanly, and applies
    // nothing the source (still writable for other roles) does afterwards.
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), worker.wait())
        .await
        .expect("the worker stops after the cutover")
        .unwrap();
    assert!(status.success(), "worker exit: {status}");
    // Stopping where the cutover asked is the normal way of it: said, not warned about.
    let log = std::fs::read_to_string(&worker_log).unwrap_or_default();
    assert!(
        log.contains("where `pgapply cutover` asked this worker to stop: the cutover goes on")
            && !log
                .lines()
                .any(|l| l.contains("WARN") && l.contains("stopped at")),
        "{log}"
    );
    db.assert_same("items").await;
    // Started again (a service manager would), it stays stopped: the target is the primary now.
    db.source_sql("INSERT INTO orders (note) VALUES ('after the cutover')")
        .await;
    let out = run_with_deadline(db.pgapply("p", &[]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    // After a finished cutover, not an invitation to replicate into the new primary again.
    assert!(
        stderr(&out).contains("by a finished `pgapply cutover`: the target is the new primary")
            && !stderr(&out).contains("SET stop_lsn = NULL"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM orders WHERE note = 'after the cutover'"
        )
        .await,
        0
    );
    let out = run_with_deadline(
        common::pgapply_command(&["status", "--target", &db.target_conninfo()]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("by `pgapply cutover`"), "{text}");
    // Nor does it copy the tables again when the slot is gone, whatever its options say.
    db.drop_slot().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--truncate-target", "--create-slot"]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("stopped at"), "{}", stderr(&out));
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM orders").await,
        501
    );
    // Going back to mirroring (here: copying again) is one statement away.
    db.target_sql("UPDATE pgapply.progress SET stop_lsn = NULL")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &["--copy-data", "--truncate-target", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("orders").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_without_a_worker_copies_partitioned_tables_sequences() {
    let db = TestDb::new("cutpart").await;
    if common::clusters().source_major < 13 {
        common::skip("publishing a partitioned table needs PostgreSQL 13");
        return;
    }
    db.both(
        "CREATE TABLE events (id serial, at int NOT NULL, PRIMARY KEY (id, at)) PARTITION BY RANGE (at); \
         CREATE TABLE events_a PARTITION OF events FOR VALUES FROM (0) TO (100); \
         CREATE TABLE events_b PARTITION OF events FOR VALUES FROM (100) TO (200); \
         CREATE TABLE events_c (id serial, at int NOT NULL, PRIMARY KEY (id, at)); \
         ALTER TABLE events ATTACH PARTITION events_c FOR VALUES FROM (200) TO (300); \
         CREATE TABLE plain_par (id serial PRIMARY KEY);",
    )
    .await;
    // An inheritance child, not published (ONLY its parent is): its sequence is not the
    // cutover's, and the target need not have it.
    db.source_sql(
        "CREATE TABLE kid (kid_no serial) INHERITS (plain_par); INSERT INTO kid DEFAULT VALUES",
    )
    .await;
    // events_c, a table of its own attached as a partition, keeps its own sequence, which
    // rows inserted into it directly take.
    db.source_sql(
        "INSERT INTO events (at) SELECT g % 200 FROM generate_series(1, 300) g; \
         INSERT INTO events_c (at) SELECT 200 + g FROM generate_series(1, 5) g; \
         CREATE PUBLICATION p FOR TABLE events, ONLY plain_par;",
    )
    .await;
    copy_up_to_now(&db).await;
    db.source_sql("INSERT INTO events (at) VALUES (150)").await;
    let role = format!("ro_{}", db.name);
    db.source_sql(&format!("CREATE ROLE {role} LOGIN")).await;
    // A role that does not exist (a typo), a sequence the target lacks: both named before
    // anything is done, so no role is frozen.
    db.source_sql("CREATE SEQUENCE only_here").await;
    // pgapply's own, on a source replicated back into (`--reverse`): never copied.
    db.source_sql("CREATE SCHEMA pgapply; CREATE SEQUENCE pgapply.conflicts_id_seq")
        .await;
    let slot = db.slot();
    let roles = format!("{role}, nosuch_{}", db.name);
    let out = run_with_deadline(
        db.on_both(
            "cutover",
            &[
                "--slot",
                &slot,
                "--timeout",
                "60s",
                "--freeze-writes",
                &roles,
                "--all-sequences",
            ],
        ),
        120,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("nothing was done")
            && err.contains(&format!("role \"nosuch_{}\"", db.name))
            && err.contains("sequence \"public\".\"only_here\" does not exist on the target")
            && err.contains("or leave --all-sequences out")
            && !err.contains("conflicts_id_seq"),
        "{err}"
    );
    let frozen = format!(
        "SELECT count(*) FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole WHERE r.rolname = '{role}'"
    );
    assert_eq!(db.count(&db.source, &frozen).await, 0);
    // No worker runs: the cutover catches up itself before it freezes writes, applies the rest,
    // then copies the sequence that the partitions' column takes its values from (owned by the
    // partitioned table), and the one a partition owns.
    let text = db.cutover(&["--freeze-writes", &role]).await;
    assert!(
        text.contains("before freezing writes")
            && text.contains(&format!("read-only now in database \"{}\"", db.name))
            && text.contains("step 4: copied 3 sequence(s)")
            && !text.contains("kid_kid_no_seq\" does not exist"),
        "{text}"
    );
    assert_eq!(
        db.count(&db.target, "SELECT nextval('events_id_seq')")
            .await,
        302
    );
    assert_eq!(
        db.count(&db.target, "SELECT nextval('events_c_id_seq')")
            .await,
        6
    );
    db.assert_same("events").await;
}

/// A CYCLE sequence that wrapped on the source is behind the target's in number, not in time:
/// the cutover copies the source's state instead of keeping the target's as "ahead".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_copies_a_cycling_sequence_that_wrapped() {
    let db = TestDb::new("cutcycle").await;
    db.both(
        "CREATE SEQUENCE ring MAXVALUE 5 CYCLE; \
         CREATE TABLE r (slot int PRIMARY KEY DEFAULT nextval('ring'), v text);",
    )
    .await;
    db.source_sql(
        "INSERT INTO r (v) SELECT 'a' FROM generate_series(1, 4); CREATE PUBLICATION p FOR TABLE r;",
    )
    .await;
    copy_up_to_now(&db).await;
    // Since then the ring went round on the source (5, 1, 2); the target's sequence stands at
    // 4, as an earlier (rehearsal) cutover would have left it.
    db.source_sql(
        "INSERT INTO r (v) SELECT 'b' FROM generate_series(1, 3) ON CONFLICT (slot) DO UPDATE SET v = EXCLUDED.v",
    )
    .await;
    db.target_sql("SELECT setval('ring', 4)").await;
    let text = db.cutover(&[]).await;
    assert!(
        text.contains("step 4: copied 1 sequence(s)") && !text.contains("is ahead"),
        "{text}"
    );
    assert_eq!(db.count(&db.target, "SELECT nextval('ring')").await, 3);
    db.assert_same("r").await;
}

/// A cutover with no worker streaming the slot drains it itself, over a replication connection:
/// a source role without REPLICATION is refused before anything is done (no stop position set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_without_a_worker_needs_a_replication_role_first() {
    let db = TestDb::new("cutnorepl").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO t VALUES (1); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    copy_up_to_now(&db).await;
    let role = format!("norepl_{}", db.name);
    db.source_sql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'n'; GRANT SELECT ON t TO {role};"
    ))
    .await;
    let source = db.source_conninfo_as(&role, "n");
    let target = db.target_conninfo();
    let slot = db.slot();
    let out = run_with_deadline(
        common::pgapply_command(&[
            "cutover",
            "--source",
            &source,
            "--target",
            &target,
            "--publication",
            "p",
            "--slot",
            &slot,
            "--timeout",
            "30s",
        ]),
        60,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("nothing was done")
            && stderr(&out).contains("source role with the REPLICATION attribute"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE stop_lsn IS NOT NULL"
        )
        .await,
        0
    );
}

/// `--freeze-writes` run by the least-privileged role the README names (CREATEROLE,
/// pg_signal_backend, on 16+ ADMIN OPTION without the frozen role's rights): it cannot read the
/// frozen role's sessions' details in pg_stat_activity, yet ends them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freeze_writes_by_a_role_that_cannot_see_the_sessions_details_ends_them() {
    let db = TestDb::new("cutfreezepriv").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.source_sql("INSERT INTO t VALUES (1, 'a'); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    copy_up_to_now(&db).await;
    let (app, cut) = (format!("app_{}", db.name), format!("cut_{}", db.name));
    db.source_sql(&format!(
        "CREATE ROLE {app} LOGIN PASSWORD 'a'; GRANT SELECT, INSERT ON t TO {app}; \
         CREATE ROLE {cut} LOGIN PASSWORD 'c' CREATEROLE REPLICATION; GRANT pg_signal_backend TO {cut}; \
         GRANT SELECT ON t TO {cut};"
    ))
    .await;
    if common::clusters().source_major >= 16 {
        db.source_sql(&format!(
            "GRANT {app} TO {cut} WITH ADMIN OPTION, INHERIT FALSE, SET FALSE"
        ))
        .await;
    }
    let (app_session, connection) = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port={} user={app} password=a dbname={}",
            db.source_port, db.name
        ),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    let connection = tokio::spawn(connection);
    app_session.simple_query("SELECT 1").await.unwrap();
    let source = format!(
        "host=127.0.0.1 port={} user={cut} password=c dbname={}",
        db.source_port, db.name
    );
    let target = db.target_conninfo();
    let slot = db.slot();
    let out = run_with_deadline(
        common::pgapply_command(&[
            "cutover",
            "--source",
            &source,
            "--target",
            &target,
            "--publication",
            "p",
            "--slot",
            &slot,
            "--timeout",
            "60s",
            "--freeze-writes",
            &app,
        ]),
        120,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert!(text.contains("and 1 session(s) there ended"), "{text}");
    let ended = tokio::time::timeout(std::time::Duration::from_secs(30), connection)
        .await
        .expect("the application's session was not ended");
    assert!(ended.is_ok(), "{ended:?}");
    db.source_sql(&format!(
        "ALTER ROLE {app} IN DATABASE {} RESET ALL",
        db.name
    ))
    .await;
}

/// A migration as users run it: the application keeps writing (hot rows updated, a history
/// table growing) while a worker with `--apply-workers 2` mirrors. The cutover freezes the
/// application's role, drains the running worker to its end position, copies the sequence and
/// verifies: afterwards both sides hold exactly the same rows and the worker has stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_while_the_application_writes_and_parallel_workers_apply() {
    let db = TestDb::new("cutlive").await;
    let role = format!("app_{}", db.name);
    db.both(
        "CREATE TABLE acct (id int PRIMARY KEY, bal bigint NOT NULL); \
         CREATE TABLE hist (id bigserial PRIMARY KEY, acct int NOT NULL, delta int NOT NULL);",
    )
    .await;
    db.source_sql(&format!(
        "INSERT INTO acct SELECT g, 0 FROM generate_series(1, 50) g; \
         CREATE PUBLICATION p FOR TABLE acct, hist; \
         CREATE ROLE {role} LOGIN PASSWORD 'app'; \
         GRANT ALL ON acct, hist, hist_id_seq TO {role};"
    ))
    .await;
    let app_conninfo = format!(
        "host=127.0.0.1 port={} user={role} password=app dbname={}",
        db.source_port, db.name
    );
    let (app, connection) = tokio_postgres::connect(&app_conninfo, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    // Writes until the cutover ends its session; returns how many transactions committed.
    let writes = tokio::spawn(async move {
        let mut committed = 0u64;
        loop {
            let a = (committed % 50) as i32 + 1;
            let sql = format!(
                "BEGIN; UPDATE acct SET bal = bal + 1 WHERE id = {a}; \
                 INSERT INTO hist (acct, delta) VALUES ({a}, 1); COMMIT;"
            );
            if app.batch_execute(&sql).await.is_err() {
                return committed;
            }
            committed += 1;
        }
    });
    let mut worker = spawn(db.pgapply("p", &["--copy-data", "--apply-workers", "2"]));
    wait_for("the worker to mirror the writes", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM hist").await > 200
    })
    .await;
    // (The application writes as fast as it can, which on a loaded machine can outrun the
    // worker: the lag need not fall first, the drain takes the rest after the freeze.)
    let text = db
        .cutover(&["--freeze-writes", &role, "--max-lag", "1GB"])
        .await;
    assert!(text.contains("cutover done"), "{text}");
    let committed = tokio::time::timeout(std::time::Duration::from_secs(30), writes)
        .await
        .expect("the application's session ends with the freeze")
        .unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), worker.wait())
        .await
        .expect("the worker stops at the cutover's end position")
        .unwrap();
    assert!(status.success(), "worker exit: {status}");
    db.assert_same("acct").await;
    db.assert_same("hist").await;
    // Every transaction the application saw commit arrived, once (the one its session was ended
    // in may have committed unseen).
    let rows = db.count(&db.target, "SELECT count(*) FROM hist").await;
    assert!(
        rows == committed as i64 || rows == committed as i64 + 1,
        "{rows} rows for {committed} commits"
    );
    assert_eq!(
        db.count(&db.target, "SELECT sum(bal)::bigint FROM acct")
            .await,
        rows
    );
    // The target's sequence continues after the source's last value.
    assert_eq!(
        db.count(&db.target, "SELECT nextval('hist_id_seq')").await,
        db.count(&db.source, "SELECT last_value + 1 FROM hist_id_seq")
            .await
    );
}

/// What `--reverse` needs on the target is checked before anything is frozen or changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_reverse_needs_are_checked_before_anything_is_done() {
    let db = TestDb::new("cutrevpre").await;
    db.both("CREATE TABLE t (id serial PRIMARY KEY, v text)")
        .await;
    db.source_sql("INSERT INTO t (v) VALUES ('a'); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    copy_up_to_now(&db).await;
    let role = format!("cut_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'c'; GRANT USAGE, CREATE ON SCHEMA pgapply TO {role}; \
         GRANT ALL ON ALL TABLES IN SCHEMA pgapply TO {role}; GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA pgapply TO {role}; \
         GRANT ALL ON t TO {role}; GRANT UPDATE ON t_id_seq TO {role}; GRANT CREATE ON DATABASE {} TO {role};",
        db.name
    ))
    .await;
    let out = run_with_deadline(
        db.on_both_as_target_user(
            "cutover",
            &role,
            "c",
            &["--slot", &db.slot(), "--timeout", "30s", "--reverse"],
        ),
        90,
    )
    .await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("nothing was done") && err.contains("(it needs REPLICATION, or superuser"),
        "{err}"
    );
    // Step 4 reads the target's sequences before it sets them: both rights are named.
    assert!(
        err.contains(&format!("may not read and set sequence \"public\".\"t_id_seq\" (GRANT SELECT, UPDATE ON SEQUENCE \"public\".\"t_id_seq\" TO \"{role}\")")),
        "{err}"
    );
    // Nor may it publish a table it does not own: said with the grant that lets it.
    assert!(
        err.contains("only their owner may publish a table")
            && err.contains("does not own \"public\".\"t\"")
            && err.contains(&format!("GRANT it TO \"{role}\"")),
        "{err}"
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM pg_publication")
            .await,
        0
    );
    // A slot name with no room for "_reverse" (56 to 63 characters): said as such.
    let long = format!("{:s<60}", "s");
    let out = run_with_deadline(
        db.on_both(
            "cutover",
            &["--slot", &long, "--timeout", "30s", "--reverse"],
        ),
        90,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("longer than PostgreSQL's 63 characters") && !err.contains("42622"),
        "{err}"
    );
}

/// `cutover --reverse`: the new primary gets a publication and a slot, and the command the
/// cutover prints replicates what the application then writes there back to the old primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_reverse_replicates_back_to_the_old_primary() {
    let db = TestDb::new("cutrev").await;
    db.both("CREATE TABLE t (id serial PRIMARY KEY, v text)")
        .await;
    db.source_sql(
        "INSERT INTO t (v) SELECT 'old ' || g FROM generate_series(1, 10) g; \
         CREATE PUBLICATION p FOR TABLE t;",
    )
    .await;
    copy_up_to_now(&db).await;
    let slot = db.slot();
    let cutover = |extra: &'static [&'static str]| {
        let mut args = vec!["--slot", slot.as_str(), "--timeout", "60s"];
        args.extend_from_slice(extra);
        run_with_deadline(db.on_both("cutover", &args), 120)
    };
    let out = cutover(&["--reverse"]).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    // Without a worker's warning about the stop the cutover itself set, nor server notices.
    assert!(
        !stderr(&out).contains("To replicate from it again") && !stderr(&out).contains("NOTICE"),
        "{}",
        stderr(&out)
    );
    // The reverse slot holds the new primary's WAL until used: how to drop it is printed.
    assert!(
        text.contains("on the target (the new primary) holds its WAL")
            && text.contains("pg_drop_replication_slot("),
        "{text}"
    );
    // Once more before anything replicates back: refused, as the applications may write to
    // the target by now; with --again (a rehearsal), said, and done again.
    let out = cutover(&[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("finished at") && stderr(&out).contains("--again"),
        "{}",
        stderr(&out)
    );
    assert!(text.contains("step 5: 1 table(s) verified"), "{text}");
    // So it is once the stop was cleared on the target (as to go back to mirroring after a
    // rehearsal): the first cutover finished all the same.
    let clear_stop =
        format!("UPDATE pgapply.progress SET stop_lsn = NULL WHERE slot_name = '{slot}'");
    db.target_sql(&clear_stop).await;
    let out = cutover(&[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("finished at") && stderr(&out).contains("--again"),
        "{}",
        stderr(&out)
    );
    // (And, this time, without the verify that keeps writes frozen longest.)
    let again = cutover(&["--again", "--no-verify"]).await;
    let again_text = String::from_utf8_lossy(&again.stdout).to_string();
    assert!(again.status.success(), "{again_text}\n{}", stderr(&again));
    assert!(
        again_text.contains("a cutover already stopped slot")
            && again_text.contains("step 5: left out (--no-verify)")
            && !again_text.contains("table(s) verified"),
        "{again_text}"
    );
    // The printed command, as printed: it names both servers.
    let mut args = printed_reverse_run(&db, &text);
    // The application now writes on the new primary.
    db.target_sql("INSERT INTO t (v) VALUES ('written on the new primary')")
        .await;
    let target_wal: String = db
        .target
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    // Now the target has handed out a value of its own: a cutover from the old primary is
    // refused even with --again, and the target's sequence stays where it is (the stop
    // cleared on the target or not).
    db.target_sql(&clear_stop).await;
    let out = cutover(&["--again"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the target has handed out sequence values of its own")
            && stderr(&out).contains("\"public\".\"t_id_seq\" at 11, the source's at 10"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(&db.target, "SELECT last_value FROM t_id_seq")
            .await,
        11
    );
    args.extend(["--endpos".to_owned(), target_wal.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_with_deadline(common::pgapply_command(&args), 60).await;
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    assert_eq!(
        db.count(
            &db.source,
            "SELECT count(*) FROM t WHERE id = 11 AND v = 'written on the new primary'"
        )
        .await,
        1
    );
    db.assert_same("t").await;
    // The same cutover again would drain the old primary once more, changes from the new one
    // included: refused, with the way back.
    let out = cutover(&[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("replication back from the target into the source has run since")
            && stderr(&out).contains("cut over in the other direction"),
        "{}",
        stderr(&out)
    );
    db.assert_same("t").await;
}

/// A table the new primary partitions and the old one keeps whole: the reverse publication
/// goes through the root (the old primary has none of the partitions), and the printed run
/// brings a row written on the new primary back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_reverse_through_the_root_of_a_table_only_the_new_primary_partitions() {
    let db = TestDb::new("cutrevpart").await;
    db.source_sql("CREATE TABLE g (id int PRIMARY KEY, v text)")
        .await;
    db.target_sql(
        "CREATE TABLE g (id int PRIMARY KEY, v text) PARTITION BY HASH (id); \
         CREATE TABLE g_0 PARTITION OF g FOR VALUES WITH (MODULUS 2, REMAINDER 0); \
         CREATE TABLE g_1 PARTITION OF g FOR VALUES WITH (MODULUS 2, REMAINDER 1);",
    )
    .await;
    db.source_sql(
        "INSERT INTO g SELECT i, 'old' FROM generate_series(1, 10) i; \
         CREATE PUBLICATION p FOR TABLE g;",
    )
    .await;
    copy_up_to_now(&db).await;
    let slot = db.slot();
    let out = run_with_deadline(
        db.on_both(
            "cutover",
            &["--slot", slot.as_str(), "--timeout", "60s", "--reverse"],
        ),
        120,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    let via_root: bool = db
        .target
        .query_one(
            "SELECT bool_and(pubviaroot) FROM pg_publication WHERE pubname <> 'p'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(via_root, "{text}");
    let mut args = printed_reverse_run(&db, &text);
    db.target_sql("INSERT INTO g VALUES (11, 'new'), (12, 'new')")
        .await;
    let target_wal: String = db
        .target
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    args.extend(["--endpos".to_owned(), target_wal.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_with_deadline(common::pgapply_command(&args), 60).await;
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    assert_eq!(
        db.count(&db.source, "SELECT count(*) FROM g WHERE v = 'new'")
            .await,
        2
    );
}

/// Partitions that came one by one (published not through their root): the way back publishes
/// their partitioned table, so a partition made on both sides after the cutover (next month's)
/// goes back too, instead of its rows being left out of a rollback without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_reverse_takes_partitions_made_after_it() {
    let db = TestDb::new("cutrevnew").await;
    db.both(
        "CREATE TABLE ev (id int, at date, PRIMARY KEY (id, at)) PARTITION BY RANGE (at); \
         CREATE TABLE ev_01 PARTITION OF ev FOR VALUES FROM ('2024-01-01') TO ('2024-02-01');",
    )
    .await;
    db.source_sql(
        "INSERT INTO ev VALUES (1, '2024-01-05'); \
         CREATE PUBLICATION p FOR TABLE ev;",
    )
    .await;
    copy_up_to_now(&db).await;
    let slot = db.slot();
    let out = run_with_deadline(
        db.on_both(
            "cutover",
            &["--slot", slot.as_str(), "--timeout", "60s", "--reverse"],
        ),
        120,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    let mut args = printed_reverse_run(&db, &text);
    db.both("CREATE TABLE ev_02 PARTITION OF ev FOR VALUES FROM ('2024-02-01') TO ('2024-03-01')")
        .await;
    db.target_sql("INSERT INTO ev VALUES (3, '2024-02-10'), (4, '2024-01-20')")
        .await;
    let target_wal: String = db
        .target
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    args.extend(["--endpos".to_owned(), target_wal.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_with_deadline(common::pgapply_command(&args), 60).await;
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    assert_eq!(
        db.count(&db.source, "SELECT count(*) FROM ev WHERE id IN (3, 4)")
            .await,
        2
    );
    db.assert_same("ev").await;
}

/// `cutover --reverse` publishes back only what came: a table mirrored by a column list goes
/// back by the same list (published whole, the new primary's own value of a column it never got
/// would overwrite the old primary's), a row-filtered one with its filter; the way back then
/// verifies. A table the new primary could no longer UPDATE once published (no replica
/// identity there) stops the cutover before anything is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_reverse_sends_back_only_the_columns_and_rows_that_came() {
    let c = common::clusters();
    if c.source_major < 15 || c.target_major < 15 {
        common::skip("column lists and row filters need PostgreSQL 15 on both sides");
        return;
    }
    let db = TestDb::new("cutrevcols").await;
    db.both(
        "CREATE TABLE a (id int PRIMARY KEY, v text, secret text NOT NULL DEFAULT 'keep'); \
         CREATE TABLE b (id int PRIMARY KEY, region text, v text); \
         CREATE TABLE c (id int, v text); \
         CREATE TABLE ins (at int, msg text); \
         ALTER TABLE b REPLICA IDENTITY FULL; \
         CREATE TABLE g (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text); \
         CREATE TABLE parted (id int PRIMARY KEY, v text) PARTITION BY RANGE (id); \
         CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM (0) TO (100); \
         CREATE TABLE pn (id int, v text) PARTITION BY RANGE (id); \
         CREATE TABLE pn_1 PARTITION OF pn FOR VALUES FROM (0) TO (100); \
         ALTER TABLE pn REPLICA IDENTITY FULL;",
    )
    .await;
    // (pn's partition keeps no identity of its root's: fine on the source, which only inserts.)
    // (A row filter on a partitioned table asks for publish_via_partition_root.)
    db.source_sql(
        "ALTER TABLE c REPLICA IDENTITY FULL; \
         INSERT INTO a SELECT g, 'old', 'S' || g FROM generate_series(1, 5) g; \
         INSERT INTO b SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 'old' FROM generate_series(1, 6) g; \
         INSERT INTO c VALUES (1, 'x'); INSERT INTO g (v) VALUES ('x'); \
         INSERT INTO parted SELECT g, 'old' FROM generate_series(1, 10) g; \
         INSERT INTO pn VALUES (1, 'x'); \
         INSERT INTO ins VALUES (1, 'x'); \
         CREATE PUBLICATION p FOR TABLE a (id, v), b WHERE (region = 'eu'), c, g, parted WHERE (id > 5), pn, ins \
           WITH (publish_via_partition_root = true);",
    )
    .await;
    copy_up_to_now(&db).await;
    let slot = db.slot();
    let cutover = || {
        run_with_deadline(
            db.on_both(
                "cutover",
                &["--slot", slot.as_str(), "--timeout", "60s", "--reverse"],
            ),
            120,
        )
    };
    // c has no replica identity on the target: once published there, every UPDATE and DELETE
    // of the application on it would fail.
    let out = cutover().await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("nothing was done")
            && err.contains("once \"public\".\"c\" is in the reverse publication, the new primary refuses UPDATE or DELETE on it")
            && err.contains("REPLICA IDENTITY")
            && !err.contains("\"public\".\"a\" is in")
            && !err.contains("\"public\".\"ins\" is in"),
        "{err}"
    );
    // A partition without an identity of its own, under a root that has one: its UPDATEs are
    // refused too (a probe of the root alone prunes it away).
    assert!(
        err.contains("once \"public\".\"pn\" is in the reverse publication")
            && err.contains("pn_1"),
        "{err}"
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM pg_publication")
            .await,
        0
    );
    db.target_sql("ALTER TABLE c REPLICA IDENTITY FULL; ALTER TABLE pn_1 REPLICA IDENTITY FULL")
        .await;
    let out = cutover().await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert!(
        text.contains("table \"public\".\"b\" goes back with the row filter it came with"),
        "{text}"
    );
    // An insert-only table without a key on either side: no reason to stop, said.
    assert!(
        text.contains("\"public\".\"ins\" has no replica identity on the source either"),
        "{text}"
    );
    // The application writes on the new primary; the way back runs.
    db.target_sql(
        "UPDATE a SET v = 'new' WHERE id <= 3; INSERT INTO b VALUES (8, 'eu', 'new'); \
         UPDATE b SET v = 'new' WHERE id = 2; UPDATE c SET v = 'y'; UPDATE g SET v = 'y'; \
         UPDATE parted SET v = 'new' WHERE id = 7",
    )
    .await;
    let target_wal: String = db
        .target
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let reverse = format!("{slot}_reverse");
    let (new_primary, old_primary) = (db.target_conninfo(), db.source_conninfo());
    let out = run_with_deadline(
        common::pgapply_command(&[
            "run",
            "--source",
            &new_primary,
            "--target",
            &old_primary,
            "--publication",
            &reverse,
            "--slot",
            &reverse,
            "--endpos",
            &target_wal,
        ]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    // The old primary keeps its own values of the column that never went over.
    assert_eq!(
        db.count(
            &db.source,
            "SELECT count(*) FROM a WHERE v = 'new' AND secret = 'S' || id"
        )
        .await,
        3
    );
    assert_eq!(
        db.count(&db.source, "SELECT count(*) FROM a WHERE secret = 'keep'")
            .await,
        0
    );
    assert_eq!(
        db.count(
            &db.source,
            "SELECT count(*) FROM b WHERE (id IN (2, 8) AND v = 'new') OR (region = 'us' AND v = 'old')"
        )
        .await,
        5
    );
    // The way back compares what it mirrors: the old primary's rows the filter left out and
    // the column it never sent are not differences.
    let out = run_with_deadline(
        common::pgapply_command(&[
            "verify",
            "--source",
            &new_primary,
            "--target",
            &old_primary,
            "--publication",
            &reverse,
        ]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert!(
        text.contains("3 row(s) on the target that the row filter leaves out: not compared"),
        "{text}"
    );
    assert_eq!(
        db.count(
            &db.source,
            "SELECT count(*) FROM parted WHERE id = 7 AND v = 'new'"
        )
        .await,
        1
    );
    // Forward, a target row outside the filter is one the mirror should not hold (a DELETE
    // lost, say): a difference, not a note.
    db.source_sql("DELETE FROM b WHERE id = 1").await;
    db.target_sql("INSERT INTO b VALUES (101, 'us', 'stale')")
        .await;
    let out = run_with_deadline(
        common::pgapply_command(&[
            "verify",
            "--source",
            &old_primary,
            "--target",
            &new_primary,
            "--publication",
            "p",
        ]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("MISMATCH  \"public\".\"b\""), "{text}");
}

/// `--two-phase`: a transaction prepared on the source and not decided there before the cutover
/// stays prepared on the target. The cutover names it and says what to do; it does not commit
/// or roll it back by itself, and the rest of the cutover goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_names_a_transaction_still_prepared() {
    if common::clusters().source_major < 15 {
        common::skip("--two-phase needs a PostgreSQL 15 source");
        return;
    }
    let db = TestDb::new("cutprep").await;
    // A prepared transaction left on the shared source would hold up every slot created after
    // it (other tests'): it is rolled back whatever happens here.
    let gid = format!("undecided_{}", db.name);
    let outcome = std::panic::AssertUnwindSafe(cutover_with_a_prepared_transaction(&db, &gid))
        .catch_unwind()
        .await;
    let _ = db
        .source
        .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
        .await;
    if let Ok(rows) = db
        .target
        .query(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()",
            &[],
        )
        .await
    {
        for row in rows {
            let target_gid: String = row.get(0);
            let _ = db
                .target
                .batch_execute(&format!("ROLLBACK PREPARED '{target_gid}'"))
                .await;
        }
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn cutover_with_a_prepared_transaction(db: &TestDb, gid: &str) {
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE t").await;
    let mut worker = spawn(db.pgapply("p", &["--two-phase", "--create-slot"]));
    db.wait_slot_active().await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.source_sql(&format!(
        "BEGIN; INSERT INTO t VALUES (2); PREPARE TRANSACTION '{gid}';"
    ))
    .await;
    let prepared_on_target = "SELECT count(*) FROM pg_prepared_xacts \
         WHERE database = current_database() AND gid LIKE 'pgapply\\_%'";
    wait_for("the prepared transaction on the target", 60, || async {
        db.count(&db.target, prepared_on_target).await == 1
    })
    .await;
    let text = db.cutover(&[]).await;
    assert!(
        text.contains("is still prepared on the target") && text.contains("COMMIT PREPARED"),
        "{text}"
    );
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), worker.wait())
        .await
        .expect("the worker stops at the cutover's end position")
        .unwrap();
    assert!(status.success(), "worker exit: {status}");
    assert_eq!(db.count(&db.target, prepared_on_target).await, 1);
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_a_corrupted_row() {
    let db = TestDb::new("verify").await;
    db.both("CREATE TABLE v (id int PRIMARY KEY, x text); CREATE TABLE w (a int, b text);")
        .await;
    db.source_sql("INSERT INTO v SELECT g, 'x' || g FROM generate_series(1, 5000) g; INSERT INTO w SELECT g, 'w' FROM generate_series(1, 10) g; CREATE PUBLICATION p FOR TABLE v, w;").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let base = |json: bool| {
        let mut c = db.on_both("verify", &["--chunk-rows", "1000"]);
        if json {
            c.arg("--json");
        }
        c
    };
    let out = run_with_deadline(base(false), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("OK        \"public\".\"v\" (5000 rows, 5 chunks)"),
        "{text}"
    );
    db.target_sql("UPDATE v SET x = 'corrupted' WHERE id = 2500")
        .await;
    let out = run_with_deadline(base(false), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("MISMATCH  \"public\".\"v\"")
            && text.contains("key range [(2001) .. (3001))"),
        "{text}"
    );
    let out = run_with_deadline(base(true), 60).await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bad: Vec<&serde_json::Value> = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["ok"] == false)
        .collect();
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0]["table"], "public.v");
    assert_eq!(bad[0]["schema"], "public");
    assert_eq!(bad[0]["name"], "v");
    assert_eq!(bad[0]["mismatches"][0]["from"], "(2001)");
    assert_eq!(bad[0]["mismatches"][0]["to"], "(3001)");

    // A table without a key is compared without a sort: a changed row still shows.
    db.target_sql(
        "UPDATE v SET x = 'x2500' WHERE id = 2500; UPDATE w SET b = 'changed' WHERE a = 3",
    )
    .await;
    let out = run_with_deadline(base(false), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("OK        \"public\".\"v\"")
            && text.contains("MISMATCH  \"public\".\"w\"")
            && text.contains("key range: the whole table (compared as one chunk"),
        "{text}"
    );
    // A table that cannot be compared is named, and the others are still compared.
    db.target_sql("DROP TABLE w").await;
    let out = run_with_deadline(base(false), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("OK        \"public\".\"v\"")
            && text.contains("FAILED    \"public\".\"w\": not compared: table \"public\".\"w\" does not exist on the target"),
        "{text}\n{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("could not be compared"),
        "{}",
        stderr(&out)
    );
    // A misspelt publication is named as missing, not as one without tables.
    let missing = run_with_deadline(
        common::pgapply_command(&[
            "verify",
            "--source",
            &db.source_conninfo(),
            "--target",
            &db.target_conninfo(),
            "--publication",
            "p,nosuch",
        ]),
        60,
    )
    .await;
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr(&missing)
            .contains("publication \"nosuch\" does not exist on the source: check --publication"),
        "{}",
        stderr(&missing)
    );
    let out = run_with_deadline(base(true), 60).await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let w = v
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "w")
        .unwrap();
    assert!(w["error"].is_string() && w["source_rows"].is_null(), "{w}");
}

/// A UTF8 source copied into a LATIN1 target: the same rows, so verify says OK (it compares
/// the rows' text in UTF-8, not in each server's encoding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_agrees_across_encodings() {
    let db = TestDb::new("verifyenc").await;
    // WIN1252: its "C" byte order is not UTF-8's ('€' is 0x80 there), unlike LATIN1's.
    let latin1 = format!("{}_win1252", db.name);
    db.target_sql(&format!(
        "CREATE DATABASE {latin1} ENCODING 'WIN1252' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    ))
    .await;
    let target = format!(
        "host=127.0.0.1 port={} user=postgres dbname={latin1}",
        db.target_port
    );
    common::connect(db.target_port, &latin1)
        .await
        .batch_execute(
            "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE w (k text PRIMARY KEY, n int)",
        )
        .await
        .unwrap();
    db.source_sql(
        "CREATE TABLE t (id int PRIMARY KEY, v text); \
         INSERT INTO t SELECT g, 'café crème à ' || g FROM generate_series(1, 300) g; \
         CREATE TABLE w (k text PRIMARY KEY, n int); \
         INSERT INTO w SELECT c || g, g FROM unnest(ARRAY['€', 'é', 'a', 'z', '‰', 'Ÿ', 'ÿ', 'œ', '™', '•']) c, generate_series(1, 3) g; \
         CREATE PUBLICATION p FOR TABLE t, w;",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_via(
            &db.source_conninfo(),
            &target,
            &db.slot(),
            "p",
            &["--copy-data", "--create-slot", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let verify = |extra: &[&str]| {
        let mut args = vec![
            "verify",
            "--source",
            &db.source_conninfo(),
            "--target",
            &target,
            "--publication",
            "p",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>();
        args.extend(extra.iter().map(|s| s.to_string()));
        common::pgapply_command(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    // Both ways of comparing: chunks from one pass, and a chunk at a time.
    for extra in [
        &[][..],
        &["--chunk-rows", "100"][..],
        &["--chunk-rows", "3"][..],
    ] {
        let out = run_with_deadline(verify(extra), 60).await;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{text}{}", stderr(&out));
        assert!(text.contains("OK        \"public\".\"t\""), "{text}");
        assert!(
            text.contains("OK        \"public\".\"w\" (30 rows"),
            "{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_agrees_across_collations_char_keys_and_floats() {
    let db = TestDb::new("verifycoll").await;
    // The target sorts the text key in another collation (as after an operating system upgrade);
    // a char(4) key; floats whose text form depends on the server version.
    db.source_sql(
        "CREATE TABLE t (k text COLLATE \"C\" PRIMARY KEY, f float8); \
         CREATE TABLE c (code char(4) PRIMARY KEY, r real); \
         CREATE DOMAIN dcode AS text COLLATE \"C\"; CREATE TABLE d (k dcode PRIMARY KEY); \
         CREATE TYPE st AS ENUM ('new', 'active', 'closed'); CREATE TABLE e (k st, n int, PRIMARY KEY (k, n)); \
         CREATE DOMAIN dst AS st; CREATE TABLE f (k dst PRIMARY KEY);",
    )
    .await;
    // (The enum's labels in another order on the target: its rows sort differently there.)
    db.target_sql(
        "CREATE TABLE t (k text COLLATE \"und-x-icu\" PRIMARY KEY, f float8); \
         CREATE TABLE c (code char(4) PRIMARY KEY, r real); \
         CREATE DOMAIN dcode AS text COLLATE \"und-x-icu\"; CREATE TABLE d (k dcode PRIMARY KEY); \
         CREATE TYPE st AS ENUM ('active', 'closed', 'new'); CREATE TABLE e (k st, n int, PRIMARY KEY (k, n)); \
         CREATE DOMAIN dst AS st; CREATE TABLE f (k dst PRIMARY KEY);",
    )
    .await;
    db.source_sql(
        "INSERT INTO t SELECT CASE WHEN g % 2 = 0 THEN upper(md5(g::text)) ELSE md5(g::text) END, g / 10.0 FROM generate_series(1, 3000) g; \
         INSERT INTO c SELECT lpad(g::text, 4, 'x'), g / 3.0 FROM generate_series(1, 900) g; \
         INSERT INTO d SELECT CASE WHEN g % 2 = 0 THEN upper(md5(g::text)) ELSE md5(g::text) END FROM generate_series(1, 500) g; \
         INSERT INTO e SELECT (ARRAY['new', 'active', 'closed'])[g % 3 + 1]::st, g FROM generate_series(1, 300) g; \
         INSERT INTO f VALUES ('new'), ('active'), ('closed'); \
         CREATE PUBLICATION p FOR TABLE t, c, d, e, f;",
    )
    .await;
    copy_up_to_now(&db).await;
    let verify = || db.on_both("verify", &["--chunk-rows", "100"]);
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("OK        \"public\".\"t\" (3000 rows, 30 chunks)")
            && text.contains("OK        \"public\".\"c\" (900 rows, 9 chunks)")
            && text.contains("OK        \"public\".\"d\" (500 rows, 5 chunks)")
            && text.contains("OK        \"public\".\"e\" (300 rows, 3 chunks)")
            && text.contains("OK        \"public\".\"f\" (3 rows"),
        "{text}"
    );
    // `check` says the target orders the enum otherwise.
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.lines().any(|l| l.starts_with("WARNING")
            && l.contains("column \"k\" of \"public\".\"e\": its enum type on the target has the source's values in another order")),
        "{text}"
    );
    // And a changed row is still found, in its chunk.
    db.target_sql("UPDATE c SET r = 0 WHERE code = 'x450'")
        .await;
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("MISMATCH  \"public\".\"c\"")
            && text.contains("key range [(x400) .. (x500))")
            && text.contains("OK        \"public\".\"t\""),
        "{text}"
    );
    // Every chunk of the text-keyed table differs: checked again in whole passes, each row
    // counted once.
    db.target_sql("UPDATE c SET r = 450 / 3.0 WHERE code = 'x450'")
        .await;
    db.target_sql("UPDATE t SET f = f + 1").await;
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("MISMATCH  \"public\".\"t\": source 3000 rows, target 3000 rows")
            && text.matches("key range").count() == 30,
        "{text}"
    );
}

/// A column the target holds in a wider type of the same kind (numeric(30,10) for
/// numeric(20,5), character(8) for character(4), timestamp(3) for timestamp(0), as the README
/// advises before widening one on the source): equal values are no mismatch (1.50000 and
/// 1.5000000000 read alike), and a changed one is still found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reads_equal_values_of_a_wider_target_type_alike() {
    let db = TestDb::new("verifywide").await;
    db.source_sql(
        "CREATE TABLE w (id int PRIMARY KEY, amount numeric(20,5), tag char(4), at timestamp(0), amounts numeric(10,2)[])",
    )
    .await;
    db.target_sql(
        "CREATE TABLE w (id int PRIMARY KEY, amount numeric(30,10), tag char(8), at timestamp(3), amounts numeric(12,4)[])",
    )
    .await;
    db.source_sql(
        "INSERT INTO w SELECT g, g + 0.5, 'ab', '2026-01-01'::timestamp + g * interval '1 s', ARRAY[g + 0.25] FROM generate_series(1, 50) g; \
         CREATE PUBLICATION p FOR TABLE w;",
    )
    .await;
    copy_up_to_now(&db).await;
    let verify = || db.on_both("verify", &["--chunk-rows", "10"]);
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("OK        \"public\".\"w\" (50 rows"),
        "{text}"
    );
    db.target_sql("UPDATE w SET amount = amount + 0.00001 WHERE id = 25")
        .await;
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("MISMATCH  \"public\".\"w\"") && text.contains("key range [(21) .. (31))"),
        "{text}"
    );
}

/// A target column of a narrower type of the same kind (numeric(8,2) for numeric(12,4),
/// timestamp(0) for timestamp(3), numeric for numeric(8,2)) rounds what it receives without a
/// word: verify must say so for the rows it rounded, and only for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_values_a_narrower_target_type_rounded() {
    let db = TestDb::new("verifynarrow").await;
    db.source_sql(
        "CREATE TABLE n (id int PRIMARY KEY, amount numeric(12,4), at timestamp(3), x numeric, arr numeric(12,4)[])",
    )
    .await;
    db.target_sql(
        "CREATE TABLE n (id int PRIMARY KEY, amount numeric(8,2), at timestamp(0), x numeric(8,2), arr numeric(8,2)[])",
    )
    .await;
    db.source_sql(
        "INSERT INTO n SELECT g, g + 0.25, '2026-01-01'::timestamp + g * interval '1 s', g, ARRAY[g + 0.5, NULL] FROM generate_series(1, 50) g; \
         INSERT INTO n VALUES (51, 'NaN', NULL, NULL, NULL); \
         CREATE PUBLICATION p FOR TABLE n;",
    )
    .await;
    copy_up_to_now(&db).await;
    let verify = || db.on_both("verify", &["--chunk-rows", "10"]);
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("OK        \"public\".\"n\" (51 rows"),
        "{text}"
    );
    // Rounded by the target's types: 1.2346 held as 1.23, .400 s as a whole second, 7.125 as 7.13.
    db.source_sql(
        "UPDATE n SET amount = 1.2346 WHERE id = 5; UPDATE n SET at = at + interval '0.4 s' WHERE id = 25; \
         UPDATE n SET x = 7.125 WHERE id = 45; UPDATE n SET arr = ARRAY[1.2346] WHERE id = 35",
    )
    .await;
    db.target_sql(
        "UPDATE n SET amount = 1.2346 WHERE id = 5; UPDATE n SET at = at + interval '0.4 s' WHERE id = 25; \
         UPDATE n SET x = 7.125 WHERE id = 45; UPDATE n SET arr = ARRAY[1.2346] WHERE id = 35",
    )
    .await;
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    for range in [
        "[start .. (11))",
        "[(21) .. (31))",
        "[(31) .. (41))",
        "[(41) .. (51))",
    ] {
        assert!(
            text.contains(&format!("key range {range}")),
            "{range}: {text}"
        );
    }
    assert!(!text.contains("key range [(11) .. (21))"), "{text}");
}

/// A regclass key sorts by OID, and the same tables have other OIDs on the target: verify must
/// put the same rows in the same chunks on both sides (it compared them as different).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_orders_regclass_keys_alike_on_both_sides() {
    let db = TestDb::new("verifyregclass").await;
    let tables = |order: &mut dyn Iterator<Item = i32>| {
        order
            .map(|i| format!("CREATE TABLE rr_{i} ();"))
            .collect::<String>()
    };
    db.source_sql(&tables(&mut (1..=12))).await;
    db.target_sql(&tables(&mut (1..=12).rev())).await;
    db.both("CREATE TABLE rkv (k regclass PRIMARY KEY, v text)")
        .await;
    db.source_sql(
        "INSERT INTO rkv SELECT ('rr_' || g)::regclass, 'v' || g FROM generate_series(1, 12) g; \
         CREATE PUBLICATION p FOR TABLE rkv;",
    )
    .await;
    copy_up_to_now(&db).await;
    let out = run_with_deadline(db.on_both("verify", &["--chunk-rows", "3"]), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("OK        \"public\".\"rkv\" (12 rows"),
        "{text}"
    );
}

/// A table locked on the target holds verify up, as it must; after 5 s its log says so, naming
/// the table, and once the lock goes it finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_says_when_it_waits_for_a_lock() {
    let db = TestDb::new("verifylock").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO t SELECT generate_series(1, 10); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    copy_up_to_now(&db).await;
    let holder = connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (mut verify, log) = common::spawn_logged(db.on_both("verify", &[]));
    wait_for("verify to say it waits for the lock", 60, || async {
        std::fs::read_to_string(&log).unwrap_or_default().contains(
            "verify: reading on the target waits for a lock on table t, held by target process(es)",
        )
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), verify.wait())
        .await
        .expect("verify to end once the lock is gone")
        .unwrap();
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

/// A composite key holding text, sorted by another collation on the target, is no mismatch;
/// a row whose key is NULL on a target without the source's key is one, in the last range,
/// and counted (a range check left it out of every range: "OK").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_sorts_composite_keys_alike_and_counts_null_keys() {
    let db = TestDb::new("verifynull").await;
    db.source_sql(
        "CREATE TYPE pair AS (a text, b int); CREATE TABLE ck (k pair PRIMARY KEY, v int); \
         CREATE TABLE nk (k int PRIMARY KEY, v int); \
         CREATE TABLE nk2 (a int, b int, v int, PRIMARY KEY (a, b));",
    )
    .await;
    db.target_sql(
        "CREATE TYPE pair AS (a text COLLATE \"und-x-icu\", b int); CREATE TABLE ck (k pair PRIMARY KEY, v int); \
         CREATE TABLE nk (k int, v int); CREATE TABLE nk2 (a int, b int, v int);",
    )
    .await;
    db.source_sql(
        "INSERT INTO ck SELECT ROW(CASE WHEN g % 2 = 0 THEN upper(md5(g::text)) ELSE md5(g::text) END, g)::pair, g \
           FROM generate_series(1, 500) g; \
         INSERT INTO nk SELECT g, g FROM generate_series(1, 250) g; \
         INSERT INTO nk2 SELECT g / 10, g % 10, g FROM generate_series(1, 250) g; \
         CREATE PUBLICATION p FOR TABLE ck, nk, nk2;",
    )
    .await;
    copy_up_to_now(&db).await;
    let verify = || db.on_both("verify", &["--chunk-rows", "100"]);
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("OK        \"public\".\"ck\" (500 rows, 5 chunks)"),
        "{text}"
    );
    db.target_sql("INSERT INTO nk VALUES (NULL, 5); INSERT INTO nk2 VALUES (1, NULL, 7);")
        .await;
    let out = run_with_deadline(verify(), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("MISMATCH  \"public\".\"nk\": source 250 rows, target 251 rows")
            && text.contains("MISMATCH  \"public\".\"nk2\": source 250 rows, target 251 rows")
            && text.contains("OK        \"public\".\"ck\""),
        "{text}"
    );
}

/// A partitioned table copied through its root, then published by its partitions' names
/// (`publish_via_partition_root` switched off): their rows were copied under the root's name,
/// so neither `run` nor `check` calls them published after the initial copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_of_a_copied_root_are_not_published_later() {
    let db = TestDb::new("viaroot").await;
    if common::source_version(&db).await < 130000 {
        return common::skip("publish_via_partition_root needs PostgreSQL 13");
    }
    db.both(
        "CREATE TABLE ev (id int, k int, PRIMARY KEY (id, k)) PARTITION BY RANGE (k); \
         CREATE TABLE ev_0 PARTITION OF ev FOR VALUES FROM (0) TO (10); \
         CREATE TABLE ev_1 PARTITION OF ev FOR VALUES FROM (10) TO (20);",
    )
    .await;
    db.source_sql(
        "INSERT INTO ev SELECT g, g % 20 FROM generate_series(1, 100) g; \
         CREATE PUBLICATION p FOR TABLE ev WITH (publish_via_partition_root = true);",
    )
    .await;
    copy_up_to_now(&db).await;
    db.source_sql("ALTER PUBLICATION p SET (publish_via_partition_root = false)")
        .await;
    db.source_sql("UPDATE ev SET id = id + 1000 WHERE id <= 10")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(!log.contains("the initial copy did not take in"), "{log}");
    db.assert_same("ev").await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!text.contains("published after the initial copy"), "{text}");
}

/// Verify interrupted (Ctrl-C) while its query waits on the target: the query is cancelled on
/// the server too, not left waiting (a backend waiting for a lock does not notice that its
/// client went away), and the exit code is the shell's for SIGINT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_interrupted_cancels_its_queries() {
    let db = TestDb::new("verifyint").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO t SELECT generate_series(1, 10); CREATE PUBLICATION p FOR TABLE t")
        .await;
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (child, log) = common::spawn_logged(db.on_both("verify", &[]));
    common::wait_for("verify waiting for the lock", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    common::signal(&child, libc::SIGINT);
    let out = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("verify stopped")
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(out.status.code(), Some(130), "{text}");
    common::wait_for("no query of verify left waiting", 10, || async {
        common::waiting_for_a_lock(&db).await == 0
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    // A `skip` interrupted while its request waits for the progress row (a worker holding it):
    // the request is cancelled, not recorded once the row is free.
    copy_up_to_now(&db).await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM pgapply.progress WHERE slot_name = '{}' FOR UPDATE",
            db.slot()
        ))
        .await
        .unwrap();
    let target = db.target_conninfo();
    let slot = db.slot();
    let skip = common::pgapply_command(&[
        "skip",
        "--target",
        &target,
        "--slot",
        &slot,
        "--lsn",
        "0/FFFFFFF0",
        "--force",
    ]);
    let (child, _) = common::spawn_logged(skip);
    common::wait_for("skip waiting for the progress row", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    common::signal(&child, libc::SIGINT);
    let out = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("skip stopped")
        .unwrap();
    assert_eq!(out.status.code(), Some(130));
    common::wait_for("no query of skip left waiting", 10, || async {
        common::waiting_for_a_lock(&db).await == 0
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE skip_lsn IS NOT NULL"
        )
        .await,
        0
    );
}

/// Verify keys on an index's key columns only (INCLUDE columns may be NULL), and reads a plain
/// table's own rows (ONLY), as the copy does: an unpublished inheritance child's rows on the
/// source are not the parent's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_uses_key_columns_only_and_reads_a_parent_alone() {
    let db = TestDb::new("verifyonly").await;
    let include = if common::clusters().source_major >= 11 {
        "INCLUDE (note)"
    } else {
        ""
    };
    db.both(&format!(
        "CREATE TABLE inc (id int, note text, PRIMARY KEY (id) {include}); \
         CREATE TABLE parent (id int PRIMARY KEY, v text);"
    ))
    .await;
    db.source_sql(
        "CREATE TABLE kid () INHERITS (parent); \
         INSERT INTO inc SELECT g, CASE WHEN g % 3 = 1 THEN NULL ELSE 'n' || g END FROM generate_series(1, 50) g; \
         INSERT INTO parent SELECT g, 'p' FROM generate_series(1, 30) g; \
         INSERT INTO kid SELECT g, 'k' FROM generate_series(100, 120) g; \
         CREATE PUBLICATION p FOR TABLE inc, ONLY parent;",
    )
    .await;
    copy_up_to_now(&db).await;
    let out = run_with_deadline(db.on_both("verify", &["--chunk-rows", "10"]), 120).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("OK        \"public\".\"inc\" (50 rows, 5 chunks)")
            && text.contains("OK        \"public\".\"parent\" (30 rows, 3 chunks)"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_brings_the_partitions_of_a_table_published_through_its_root() {
    if !pg_dump_usable() || common::clusters().source_major < 13 {
        common::skip("publish_via_partition_root needs PostgreSQL 13 and a pg_dump for the source");
        return;
    }
    let db = TestDb::new("schemapart").await;
    db.source_sql(
        "CREATE TABLE m (id int, at int NOT NULL, PRIMARY KEY (id, at)) PARTITION BY RANGE (at); \
         CREATE TABLE m_1 PARTITION OF m FOR VALUES FROM (0) TO (10); \
         CREATE TABLE m_2 PARTITION OF m FOR VALUES FROM (10) TO (20); \
         INSERT INTO m SELECT g, g % 20 FROM generate_series(1, 100) g; \
         CREATE PUBLICATION p FOR TABLE m WITH (publish_via_partition_root = true);",
    )
    .await;
    let out = run_with_deadline(db.on_both("schema", &[]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    copy_up_to_now(&db).await;
    db.source_sql("INSERT INTO m VALUES (500, 15)").await;
    db.sync("p").await;
    db.assert_same("m").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM m_2").await, 51);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_rewritten_during_the_copy_is_not_copied_empty() {
    let db = TestDb::new("copyddl").await;
    let tables: Vec<String> = (1..=6).map(|i| format!("t{i}")).collect();
    db.both(
        &tables
            .iter()
            .map(|t| format!("CREATE TABLE {t} (id int PRIMARY KEY, pad text);"))
            .collect::<String>(),
    )
    .await;
    db.source_sql(
        &tables
            .iter()
            .map(|t| {
                format!(
                    "INSERT INTO {t} SELECT g, repeat('x', 200) FROM generate_series(1, 40000) g;"
                )
            })
            .collect::<String>(),
    )
    .await;
    db.source_sql(&format!(
        "CREATE PUBLICATION p FOR TABLE {}",
        tables.join(", ")
    ))
    .await;
    let mut child = spawn(db.pgapply("p", &["--copy-data", "--create-slot", "--copy-jobs", "1"]));
    wait_for("the copy to be under way", 60, || async {
        db.target
            .query_one("SELECT count(*) FILTER (WHERE state = 'done') > 0 AND count(*) FILTER (WHERE state <> 'done') > 1 FROM pgapply.copy_state", &[])
            .await
            .map(|r| r.get::<_, Option<bool>>(0) == Some(true))
            .unwrap_or(false)
    })
    .await;
    // A rewriting ALTER of a table still waiting in the queue: its rows can no longer be read in
    // the copy's snapshot. The copy notices and starts over, instead of copying it empty.
    let not_done: String = db
        .target
        .query_one(
            "SELECT max(table_name) FROM pgapply.copy_state WHERE state = 'pending'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    db.source_sql(&format!(
        "ALTER TABLE {not_done} ALTER COLUMN pad TYPE varchar(300); INSERT INTO {not_done} VALUES (0, 'after')"
    ))
    .await;
    wait_for("every row on the target", 120, || async {
        db.count(&db.target, &format!("SELECT count(*) FROM {not_done}"))
            .await
            == 40001
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
    for t in &tables {
        assert_eq!(
            db.count(&db.target, &format!("SELECT count(*) FROM {t}"))
                .await,
            if *t == not_done { 40001 } else { 40000 },
            "{t}"
        );
    }
}

/// A table added to the publication while pgapply runs, after its initial copy: its changes are
/// applied from then on, and pgapply names it once, since the rows it had before are not on the
/// target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_published_after_the_copy_is_named_when_its_changes_arrive() {
    let db = TestDb::new("latejoin").await;
    db.both(
        "CREATE TABLE early (id int PRIMARY KEY); CREATE TABLE late (id int PRIMARY KEY, v text);",
    )
    .await;
    db.source_sql(
        "INSERT INTO early VALUES (1); INSERT INTO late VALUES (1, 'before'); \
         CREATE PUBLICATION p FOR TABLE early;",
    )
    .await;
    let log_path = std::env::temp_dir().join(format!("pgapply-test-{}.log", db.name));
    let mut cmd = db.pgapply("p", &["--copy-data", "--create-slot"]);
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap());
    let mut child = cmd.spawn().unwrap();
    wait_for("the copy", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM early").await == 1
    })
    .await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE late").await;
    db.source_sql("INSERT INTO late VALUES (2, 'after')").await;
    wait_for("the new table's change", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM late").await == 1
    })
    .await;
    let pid = child.id().unwrap() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(child.wait().await.unwrap().success());
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let named: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("the initial copy did not take in"))
        .collect();
    assert_eq!(named.len(), 1, "{log}");
    assert!(named[0].contains("\"public\".\"late\""), "{log}");
}

/// A table without columns (`CREATE TABLE t ()`): checked, copied and streamed (its rows are
/// empty, and as many on both sides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_columns_is_checked_copied_and_streamed() {
    let db = TestDb::new("nocols").await;
    db.both("CREATE TABLE nocols (); CREATE TABLE other (id int PRIMARY KEY);")
        .await;
    db.source_sql(
        "ALTER TABLE nocols REPLICA IDENTITY FULL; \
         INSERT INTO nocols SELECT FROM generate_series(1, 3); \
         CREATE PUBLICATION p FOR TABLE nocols, other;",
    )
    .await;
    let out = run_with_deadline(
        db.on_both("check", &["--slot", &db.slot(), "--create-slot"]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}");
    copy_up_to_now(&db).await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM nocols").await, 3);
    db.source_sql("INSERT INTO nocols DEFAULT VALUES; INSERT INTO other VALUES (1)")
        .await;
    db.source_sql("INSERT INTO nocols SELECT FROM generate_series(1, 4)")
        .await;
    db.sync("p").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM nocols").await, 8);
    db.assert_same("other").await;
    db.source_sql("DELETE FROM nocols WHERE ctid IN (SELECT ctid FROM nocols LIMIT 2)")
        .await;
    db.sync("p").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM nocols").await, 6);
}

/// A row filter opened up after the copy (the same publication now also publishes the table's
/// whole schema): rows the copy left out are missing on the target, and each start says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_filter_opened_after_the_copy_is_named() {
    if common::clusters().source_major < 15 {
        common::skip("row filters and schema publications need PostgreSQL 15");
        return;
    }
    let db = TestDb::new("filteropen").await;
    db.both("CREATE TABLE f (id int PRIMARY KEY)").await;
    db.source_sql(
        "INSERT INTO f SELECT generate_series(1, 10); CREATE PUBLICATION p FOR TABLE f WHERE (id > 5);",
    )
    .await;
    copy_up_to_now(&db).await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM f").await, 5);
    db.source_sql("ALTER PUBLICATION p ADD TABLES IN SCHEMA public")
        .await;
    let out = db.sync("p").await;
    let err = stderr(&out);
    assert!(
        err.lines()
            .any(|l| l.contains("given another row filter") && l.contains("\"public\".\"f\"")),
        "{err}"
    );
}

/// A table renamed on the source (and on the target) after the copy: its copy state follows the
/// new name, and its changes are not taken for those of a table the copy did not take in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_renamed_after_the_copy_keeps_its_copy_state() {
    let db = TestDb::new("renamedcopy").await;
    db.both("CREATE TABLE r (id int PRIMARY KEY, v text)").await;
    db.source_sql(
        "INSERT INTO r SELECT g, 'a' FROM generate_series(1, 10) g; CREATE PUBLICATION p FOR TABLE r;",
    )
    .await;
    copy_up_to_now(&db).await;
    db.both("ALTER TABLE r RENAME TO r2").await;
    db.source_sql("INSERT INTO r2 VALUES (11, 'b')").await;
    // `check` before the run that moves the copy state: not a table published since the copy.
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!text.contains("published after the initial copy"), "{text}");
    let out = db.sync("p").await;
    let err = stderr(&out);
    assert!(
        err.contains("renamed on the source: its copy state follows the new name")
            && !err.contains("did not take in"),
        "{err}"
    );
    db.assert_same("r2").await;
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.copy_state WHERE table_name = 'r2' AND state = 'done'"
        )
        .await,
        1
    );
}

/// A table taken out of the publication and put back while pgapply is stopped: its changes in
/// between were not sent. Each start says so until a run with --copy-data --truncate-target
/// copies it again. A change of publications that still publish it is no such gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_put_back_into_the_publication_is_copied_again() {
    let db = TestDb::new("putback").await;
    db.both(
        "CREATE TABLE stays (id int PRIMARY KEY, v text); CREATE TABLE back (id int PRIMARY KEY, v text);",
    )
    .await;
    db.source_sql(
        "INSERT INTO stays SELECT g, 's' FROM generate_series(1, 10) g; \
         INSERT INTO back SELECT g, 'b' FROM generate_series(1, 40) g; \
         CREATE PUBLICATION p FOR TABLE stays, back;",
    )
    .await;
    // (A publication a later run adds: made before the slot, which decodes with the catalog
    // as it was.)
    db.both("CREATE TABLE extra (id int PRIMARY KEY)").await;
    db.source_sql("CREATE PUBLICATION pextra FOR TABLE extra")
        .await;
    copy_up_to_now(&db).await;
    db.source_sql("ALTER PUBLICATION p DROP TABLE back").await;
    db.source_sql("UPDATE back SET v = 'gap' WHERE id <= 20; INSERT INTO stays VALUES (11, 's')")
        .await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE back").await;
    db.source_sql("UPDATE back SET v = 'after' WHERE id = 40")
        .await;
    let said = |err: &str| {
        err.lines().any(|l| {
            l.contains("taken out of the publication and put back, or given another row filter")
                && l.contains("\"public\".\"back\"")
                && l.contains("--copy-data --truncate-target")
        })
    };
    // `check` says so too: before the run that notices (read only), and after it (marked).
    let check_says = || async {
        let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            text.lines()
                .any(|l| l.starts_with("WARNING") && said(l) && !l.contains("\"stays\"")),
            "{text}"
        );
    };
    check_says().await;
    // The first run after it is given one more publication than the last (added ones leave the
    // earlier publishing rows in place: still compared); the next one the first alone again
    // (the mark stays).
    for publications in ["p,pextra", "p"] {
        let endpos = db.source_wal().await;
        let out = run_with_deadline(db.pgapply(publications, &["--endpos", &endpos]), 60).await;
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        assert!(said(&err), "{err}");
        // One added is no warning; one left out is.
        assert_eq!(
            err.contains("this run replicates more publications than the last one"),
            publications == "p,pextra",
            "{err}"
        );
        assert_eq!(
            err.contains("this slot was replicated with other publications until now"),
            publications == "p",
            "{err}"
        );
        check_says().await;
    }
    let (s, t) = db.digest("back").await;
    assert_ne!(s, t, "the gap's changes never came");
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &["--copy-data", "--truncate-target", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("back").await;
    db.assert_same("stays").await;
    let out = db.sync("p").await;
    assert!(!said(&stderr(&out)), "{}", stderr(&out));
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!said(&text), "{text}");
    // Published by another publication as well, then no longer by the first one while
    // pgapply runs: published throughout, nothing to copy again.
    db.source_sql("CREATE PUBLICATION p2 FOR TABLE back, stays")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p,p2", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql("ALTER PUBLICATION p DROP TABLE back; UPDATE back SET v = 'later' WHERE id = 1")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p,p2", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("put back"), "{err}");
    db.assert_same("back").await;
}

/// A table published after the initial copy is copied by the next `run --copy-data`, in a
/// snapshot of its own, without touching the other tables or the slot: its changes the copy
/// holds are skipped (an INSERT of a copied row would fail, a TRUNCATE would empty it), later
/// ones applied. An unfinished such copy is not streamed into, and starts over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_published_after_the_copy_is_copied_by_the_next_copy_data_run() {
    let db = TestDb::new("latecopy").await;
    db.both(
        "CREATE TABLE early (id int PRIMARY KEY, v text); CREATE TABLE late (id int PRIMARY KEY, v text);",
    )
    .await;
    db.source_sql(
        "INSERT INTO early SELECT g, 'e' FROM generate_series(1, 20) g; \
         INSERT INTO late SELECT g, 'before' FROM generate_series(1, 50) g; \
         CREATE PUBLICATION p FOR TABLE early;",
    )
    .await;
    copy_up_to_now(&db).await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE late").await;
    db.source_sql(
        "INSERT INTO late VALUES (51, 'after'); UPDATE late SET v = 'u' WHERE id <= 10; \
         DELETE FROM late WHERE id BETWEEN 11 AND 20; UPDATE early SET v = 'f' WHERE id = 1;",
    )
    .await;
    // Streamed without --copy-data: only what changed since it was published.
    db.sync("p").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM late").await, 1);
    // `check` names it.
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.lines().any(|l| l.starts_with("WARNING")
            && l.contains("published after the initial copy: \"public\".\"late\"")
            && l.contains("a run with --copy-data copies them")),
        "{text}"
    );

    let endpos = db.source_wal().await;
    // Its target table holds the streamed rows: not copied (said), and the run streams on (a
    // worker kept running with copy_data on must not stop over it).
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("published after the initial copy, but not copied: its target table \"public\".\"late\" is not empty")
            && err.contains("--truncate-target"),
        "{err}"
    );
    db.target_sql("TRUNCATE late").await;

    // Changes while pgapply is stopped: in the stream from its position, and in the copy.
    db.source_sql(
        "UPDATE late SET v = 'w' WHERE id = 51; INSERT INTO late VALUES (52, 'x'); \
         INSERT INTO late VALUES (60, 'y'); UPDATE late SET v = 'z' WHERE id = 60; \
         DELETE FROM late WHERE id BETWEEN 21 AND 50; \
         INSERT INTO early VALUES (21, 'e');",
    )
    .await;

    // Interrupted: the target table is locked, the copy waits, and is stopped.
    let holder = connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE late IN SHARE MODE")
        .await
        .unwrap();
    let mut worker = spawn(db.pgapply("p", &["--copy-data"]));
    wait_for("the copy to wait for the lock", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    common::signal(&worker, libc::SIGTERM);
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), worker.wait())
        .await
        .expect("the stopped copy ends")
        .unwrap();
    assert!(status.success(), "{status}");
    holder.batch_execute("COMMIT").await.unwrap();
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("the copy of \"public\".\"late\" (published after the initial copy) did not finish: run with --copy-data"),
        "{err}"
    );
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.lines().any(|l| l.starts_with("PROBLEM")
            && l.contains(
                "the copy of \"public\".\"late\" (published after the initial copy) did not finish"
            )),
        "{text}"
    );

    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("published after the initial copy: copying"),
        "{err}"
    );
    db.assert_same("late").await;
    // Later changes of the table are applied over the copy; the other table went on as before.
    db.source_sql(
        "UPDATE late SET v = 'later' WHERE id = 1; DELETE FROM late WHERE id = 2; \
         INSERT INTO late VALUES (100, 'new'); UPDATE early SET v = 'g' WHERE id = 2;",
    )
    .await;
    db.sync("p").await;
    db.assert_same("late").await;
    db.assert_same("early").await;
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM late WHERE v = 'u'")
            .await,
        8
    );
}

/// A table that leaves the publication and comes back is copied again by the next `--copy-data`
/// run (its copy state was forgotten at a start in between, as `REFRESH PUBLICATION` does), and
/// that copy is refused while a worker streams the slot (it would apply the changes the copy
/// holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_published_again_is_copied_again_and_not_under_a_running_worker() {
    let db = TestDb::new("latereadd").await;
    db.both(
        "CREATE TABLE a (id int PRIMARY KEY, n int); CREATE TABLE h (id int PRIMARY KEY, n int);",
    )
    .await;
    db.source_sql(
        "INSERT INTO a VALUES (1, 0); INSERT INTO h SELECT g, 0 FROM generate_series(1, 100) g; \
         CREATE PUBLICATION p FOR TABLE a, h;",
    )
    .await;
    copy_up_to_now(&db).await;
    db.source_sql("ALTER PUBLICATION p DROP TABLE h").await;
    db.source_sql("UPDATE h SET n = 9 WHERE id <= 10; DELETE FROM h WHERE id = 50")
        .await;
    // A start while it is out of the publication forgets its copy.
    db.sync("p").await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE h").await;
    db.source_sql("UPDATE h SET n = 10 WHERE id = 1").await;
    // Not while a worker streams the slot.
    let mut worker = spawn(db.pgapply("p", &[]));
    db.wait_slot_active().await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--copy-data",
                "--truncate-target",
                "--endpos",
                &endpos,
                "--max-retries",
                "1",
                "--retry-min",
                "10ms",
            ],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("its walsender is process"), "{err}");
    common::signal(&worker, libc::SIGTERM);
    assert!(worker.wait().await.unwrap().success());
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &["--copy-data", "--truncate-target", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("published after the initial copy: copying"),
        "{err}"
    );
    db.source_sql("UPDATE h SET n = 11 WHERE id = 2").await;
    db.sync("p").await;
    db.assert_same("h").await;
    db.assert_same("a").await;
}

/// The publication switched to publishing a partitioned table through its root while changes
/// to a partition, sent under the partition's name, were still to be applied: the root's copy
/// (published later) holds them, and they must not be applied over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_under_a_partitions_name_do_not_overwrite_its_roots_later_copy() {
    publish_via_partition_root_switched("latepart", false).await;
}

/// The other way: published through its root at the initial copy, then the partitions published
/// under their own names (copied as tables published later): changes still to be applied that
/// come under the root's name land in the partitions' copied rows, and are left out too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_under_a_roots_name_do_not_overwrite_its_partitions_later_copies() {
    publish_via_partition_root_switched("latepart2", true).await;
}

/// A partitioned table copied with `publish_via_partition_root` = `through_root_first`; changes
/// while stopped, the setting switched, more changes; then `--copy-data --truncate-target`
/// copies the tables now published, and the target equals the source, then and after more
/// changes streamed.
async fn publish_via_partition_root_switched(name: &str, through_root_first: bool) {
    if common::clusters().source_major < 13 {
        return; // publish_via_partition_root: 13+
    }
    let db = TestDb::new(name).await;
    db.both(
        "CREATE TABLE m (id int PRIMARY KEY, v int) PARTITION BY RANGE (id); \
         CREATE TABLE m_a PARTITION OF m FOR VALUES FROM (0) TO (100); \
         CREATE TABLE m_b PARTITION OF m FOR VALUES FROM (100) TO (200);",
    )
    .await;
    db.source_sql(&format!(
        "INSERT INTO m SELECT g, 0 FROM generate_series(1, 150) g WHERE g <> 50; \
         CREATE PUBLICATION p FOR TABLE m WITH (publish_via_partition_root = {through_root_first});"
    ))
    .await;
    copy_up_to_now(&db).await;
    db.assert_same("m").await;
    // Sent under one set of names; then, switched, under the other.
    db.source_sql("UPDATE m SET v = 5 WHERE id IN (11, 111); DELETE FROM m WHERE id = 12; INSERT INTO m VALUES (50, 5)")
        .await;
    db.source_sql(&format!(
        "ALTER PUBLICATION p SET (publish_via_partition_root = {})",
        !through_root_first
    ))
    .await;
    db.source_sql("UPDATE m SET v = 6 WHERE id IN (11, 111); INSERT INTO m VALUES (12, 6)")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &["--copy-data", "--truncate-target", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("m").await;
    // And the stream goes on from there.
    db.source_sql("UPDATE m SET v = 7 WHERE id = 11; DELETE FROM m WHERE id = 111")
        .await;
    db.sync("p").await;
    db.assert_same("m").await;
}

/// A table published later whose target table also holds another published table's rows
/// (`[tables]` maps both onto it) is not copied, even with --truncate-target: emptying it would
/// lose the other's rows. Said, and the run streams on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_table_sharing_its_target_table_is_not_copied() {
    let db = TestDb::new("lateshared").await;
    db.source_sql(
        "CREATE TABLE m_1 (id int PRIMARY KEY, v text); CREATE TABLE m_2 (id int PRIMARY KEY, v text); \
         INSERT INTO m_1 SELECT g, 'one' FROM generate_series(1, 10) g; \
         INSERT INTO m_2 SELECT g, 'two' FROM generate_series(11, 20) g; \
         CREATE PUBLICATION p FOR TABLE m_1;",
    )
    .await;
    db.target_sql("CREATE TABLE m (id int PRIMARY KEY, v text)")
        .await;
    let config = std::env::temp_dir().join(format!("pgapply-lateshared-{}.toml", db.name));
    std::fs::write(
        &config,
        "[tables.\"public.m_1\"]\ntarget = \"public.m\"\n[tables.\"public.m_2\"]\ntarget = \"public.m\"\n",
    )
    .unwrap();
    let cfg = config.to_str().unwrap();
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--config",
                cfg,
                "--copy-data",
                "--create-slot",
                "--endpos",
                &endpos,
            ],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql("ALTER PUBLICATION p ADD TABLE m_2").await;
    db.source_sql("INSERT INTO m_2 VALUES (21, 'later')").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--config",
                cfg,
                "--copy-data",
                "--truncate-target",
                "--endpos",
                &endpos,
            ],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("published after the initial copy, but not copied: its target table \"public\".\"m\" also holds rows of other tables"),
        "{err}"
    );
    // m_1's rows are all there, and m_2's change since it was published.
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM m WHERE v = 'one'")
            .await,
        10
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM m WHERE id = 21")
            .await,
        1
    );
}

/// The migration flow with indexes built after the rows and before streaming: definitions
/// without indexes, `--copy-only`, then the indexes, then `run` streams what changed meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_data_copy_only_post_data_then_stream() {
    if !pg_dump_usable() {
        return;
    }
    let db = TestDb::new("copyonly").await;
    db.source_sql(
        "CREATE TABLE acct (id int PRIMARY KEY, owner text, bal int); \
         CREATE INDEX acct_owner ON acct (owner); \
         INSERT INTO acct SELECT g, 'o' || g % 10, g FROM generate_series(1, 2000) g; \
         CREATE PUBLICATION p FOR TABLE acct;",
    )
    .await;
    let out = run_with_deadline(db.on_both("schema", &["--section", "pre-data"]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let indexes = "SELECT count(*) FROM pg_indexes WHERE tablename = 'acct'";
    assert_eq!(db.count(&db.target, indexes).await, 0);
    // --copy-only without --copy-data: a usage error.
    let out = run_with_deadline(db.pgapply("p", &["--copy-only"]), 30).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    // ...and so is an end position (it stops before any change).
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--copy-only", "--endpos", "0/1"]),
        30,
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--endpos"), "{}", stderr(&out));

    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--copy-only"]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("--copy-only"), "{}", stderr(&out));
    // Stopped, not a copy whose process went away.
    let target = db.target_conninfo();
    let out = run_with_deadline(
        common::pgapply_command(&["status", "--target", &target]),
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains(&format!("slot {}: stopped", db.slot())),
        "{text}"
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM acct").await,
        2000
    );
    // The copy's progress per table, named as a user writes it (as in the metrics' label).
    let out = run_with_deadline(
        common::pgapply_command(&["status", "--json", "--target", &target]),
        30,
    )
    .await;
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let copy = &status[0]["copy"][0];
    assert_eq!(copy["table"], "public.acct", "{status}");
    assert_eq!(copy["rows"], 2000, "{status}");
    assert_eq!(copy["state"], "done", "{status}");
    // Changes from now on wait in the slot.
    db.source_sql("UPDATE acct SET bal = bal + 1 WHERE id <= 100; DELETE FROM acct WHERE id > 1900; INSERT INTO acct VALUES (5000, 'late', 0);")
        .await;
    let out = run_with_deadline(db.on_both("schema", &["--section", "post-data"]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, indexes).await, 2);
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM acct").await,
        2000
    );
    db.sync("p").await;
    db.assert_same("acct").await;
}

/// post-data builds the keys with more sort memory than the server's default (512MB, or
/// --maintenance-work-mem), never less than the target's own setting, and the target's with
/// `server`: an event trigger on the target records the setting each build ran with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_data_builds_keys_with_more_sort_memory() {
    if !pg_dump_usable() {
        return;
    }
    let db = TestDb::new("sortmem").await;
    db.source_sql("CREATE TABLE k (id int PRIMARY KEY, v text); CREATE PUBLICATION p FOR TABLE k;")
        .await;
    let out = run_with_deadline(db.on_both("schema", &["--section", "pre-data"]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.target_sql(
        "CREATE TABLE seen (setting text); \
         CREATE FUNCTION record_setting() RETURNS event_trigger LANGUAGE plpgsql AS \
           $$BEGIN INSERT INTO public.seen VALUES (pg_catalog.current_setting('maintenance_work_mem')); END$$; \
         CREATE EVENT TRIGGER record_setting ON ddl_command_end WHEN TAG IN ('ALTER TABLE') \
           EXECUTE PROCEDURE record_setting();",
    )
    .await;
    let post_data = |extra: &'static [&'static str]| {
        let mut args = vec!["--section", "post-data"];
        args.extend_from_slice(extra);
        run_with_deadline(db.on_both("schema", &args), 60)
    };
    let out = post_data(&[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(settings_seen(&db.target).await, ["512MB"]);
    // Run again: the key is there already, and the error says what that means.
    let out = post_data(&[]).await;
    assert!(
        !out.status.success() && stderr(&out).contains("was this section run before?"),
        "{}",
        stderr(&out)
    );
    let again = "ALTER TABLE k DROP CONSTRAINT k_pkey";
    db.target_sql(again).await;
    settings_seen(&db.target).await;
    let out = post_data(&["--maintenance-work-mem", "1GB"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(settings_seen(&db.target).await, ["1GB"]);
    db.target_sql(again).await;
    settings_seen(&db.target).await;
    let server: String = db
        .target
        .query_one("SHOW maintenance_work_mem", &[])
        .await
        .unwrap()
        .get(0);
    let out = post_data(&["--maintenance-work-mem", "server"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(settings_seen(&db.target).await, [server]);
    // A target that gives more already keeps it.
    db.target_sql(again).await;
    settings_seen(&db.target).await;
    db.target_sql(&format!(
        "ALTER DATABASE {} SET maintenance_work_mem = '2GB'",
        db.name
    ))
    .await;
    let out = post_data(&[]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(settings_seen(&db.target).await, ["2GB"]);
    let out = post_data(&["--maintenance-work-mem", "lots"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--maintenance-work-mem: invalid size \"lots\""),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_constraint WHERE conname = 'k_pkey'"
        )
        .await,
        1
    );
}

/// The settings the event trigger of `post_data_builds_keys_with_more_sort_memory` recorded,
/// forgotten once read.
async fn settings_seen(target: &tokio_postgres::Client) -> Vec<String> {
    let rows = target.query("SELECT setting FROM seen", &[]).await.unwrap();
    target.batch_execute("DELETE FROM seen").await.unwrap();
    rows.iter().map(|r| r.get::<_, String>(0)).collect()
}

/// `schema` follows the config file's table renames (pre-data creates the table under its target
/// name; post-data finds it there), and a column left out of a column list (15+) is not NOT NULL
/// on the target, where it never gets a value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_follows_renames_and_column_lists() {
    if !pg_dump_usable() {
        return;
    }
    let db = TestDb::new("schemamap").await;
    let column_list = common::source_version(&db).await >= 150000;
    db.source_sql(&format!(
        "CREATE TABLE orders (id int PRIMARY KEY, note text, secret text NOT NULL); \
         CREATE INDEX orders_note ON orders (note); \
         INSERT INTO orders SELECT g, 'n' || g, 's' FROM generate_series(1, 300) g; \
         CREATE PUBLICATION p FOR TABLE orders{};",
        if column_list { " (id, note)" } else { "" }
    ))
    .await;
    let config = std::env::temp_dir().join(format!("pgapply-schemamap-{}.toml", db.name));
    std::fs::write(
        &config,
        "[tables.\"public.orders\"]\ntarget = \"archive.orders_2024\"\n",
    )
    .unwrap();
    let cfg = config.to_str().unwrap();
    let out = run_with_deadline(
        db.on_both("schema", &["--section", "pre-data", "--config", cfg]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let exists = |name: &'static str| {
        let target = &db.target;
        async move {
            target
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    assert!(exists("archive.orders_2024").await);
    assert!(!exists("public.orders").await);
    // Again: refused, naming the table that is there already.
    let out = run_with_deadline(
        db.on_both("schema", &["--section", "pre-data", "--config", cfg]),
        60,
    )
    .await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(
            "\"archive\".\"orders_2024\" (published as \"public\".\"orders\") already exists"
        ),
        "{}",
        stderr(&out)
    );
    if column_list {
        assert_eq!(
            db.count(
                &db.target,
                "SELECT count(*) FROM pg_attribute WHERE attrelid = 'archive.orders_2024'::regclass AND attname = 'secret' AND attnotnull"
            )
            .await,
            0,
            "the unpublished column is still NOT NULL"
        );
    }
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--copy-only", "--config", cfg]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run_with_deadline(
        db.on_both("schema", &["--section", "post-data", "--config", cfg]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'archive' AND tablename = 'orders_2024'"
        )
        .await,
        2
    );
    assert!(!exists("public.orders").await);
    db.source_sql(
        "UPDATE orders SET note = 'changed' WHERE id <= 10; DELETE FROM orders WHERE id > 290;",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos, "--config", cfg]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let q = "SELECT count(*) FILTER (WHERE note = 'changed')::bigint * 1000 + count(*) FROM ";
    assert_eq!(
        db.count(&db.target, &format!("{q} archive.orders_2024"))
            .await,
        db.count(&db.source, &format!("{q} orders")).await
    );
    let _ = std::fs::remove_file(&config);
}

/// A target role that may not set session_replication_role: the tables whose foreign keys or
/// triggers will act on the copied rows are named before the copy, with what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_whose_foreign_keys_will_fire_names_the_tables() {
    let db = TestDb::new("copyfk").await;
    db.both(
        "CREATE TABLE parent (id int PRIMARY KEY); \
         CREATE TABLE child (id int PRIMARY KEY, pid int REFERENCES parent); \
         CREATE TABLE plain (id int PRIMARY KEY);",
    )
    .await;
    db.source_sql(
        "INSERT INTO parent VALUES (1); INSERT INTO child VALUES (1, 1); INSERT INTO plain VALUES (1); \
         CREATE PUBLICATION p FOR TABLE parent, child, plain;",
    )
    .await;
    let writer = format!("w_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {writer} LOGIN PASSWORD 'w-secret'; \
         GRANT ALL ON parent, child, plain TO {writer}; GRANT CREATE ON DATABASE {} TO {writer};",
        db.name
    ))
    .await;
    let target = format!(
        "host=127.0.0.1 port={} user={writer} password=w-secret dbname={}",
        db.target_port, db.name
    );
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_via(
            &db.source_conninfo(),
            &target,
            &db.slot(),
            "p",
            &[
                "--copy-data",
                "--create-slot",
                "--copy-jobs",
                "1",
                "--endpos",
                &endpos,
            ],
        ),
        60,
    )
    .await;
    let log = stderr(&out);
    let warning = log
        .lines()
        .find(|l| l.contains("may not set session_replication_role"))
        .unwrap_or_else(|| panic!("no warning: {log}"));
    assert!(
        warning.contains("child") && !warning.contains("plain") && warning.contains("post-data"),
        "{warning}"
    );
}

/// Row-level security on the source: policies that would hide rows from the source role make the
/// copy fail, naming the way out (BYPASSRLS), instead of copying part of the table; the slot made
/// for the failed copy is dropped; with BYPASSRLS, every row is copied and verify agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_level_security_fails_the_copy_instead_of_hiding_rows() {
    let db = TestDb::new("copyrls").await;
    db.both("CREATE TABLE secret (id int PRIMARY KEY, v text)")
        .await;
    let user = format!("rls_{}", db.name);
    db.source_sql(&format!(
        "CREATE ROLE {user} LOGIN REPLICATION PASSWORD 'rls-secret'; GRANT SELECT ON secret TO {user}; \
         INSERT INTO secret SELECT g, 'v' || g FROM generate_series(1, 20) g; \
         ALTER TABLE secret ENABLE ROW LEVEL SECURITY; \
         CREATE POLICY few ON secret FOR SELECT USING (id <= 5); \
         CREATE PUBLICATION p FOR TABLE secret;"
    ))
    .await;
    let source = format!(
        "host=127.0.0.1 port={} user={user} password=rls-secret dbname={}",
        db.source_port, db.name
    );
    let endpos = db.source_wal().await;
    let run = || {
        db.pgapply_via(
            &source,
            &db.target_conninfo(),
            &db.slot(),
            "p",
            &["--copy-data", "--endpos", &endpos],
        )
    };
    let out = run_with_deadline(run(), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("secret") && err.contains("row-level security") && err.contains("BYPASSRLS"),
        "{err}"
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM secret").await, 0);
    let slots = db.slot_count().await;
    assert_eq!(slots, 0, "the failed copy's slot is dropped");

    db.source_sql(&format!("ALTER ROLE {user} BYPASSRLS")).await;
    let out = run_with_deadline(run(), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM secret").await,
        20
    );

    // verify reads the same way: under the policy it fails rather than compare 5 rows with 20.
    db.source_sql(&format!("ALTER ROLE {user} NOBYPASSRLS"))
        .await;
    let target = db.target_conninfo();
    let out = run_with_deadline(
        common::pgapply_command(&[
            "verify",
            "--source",
            &source,
            "--target",
            &target,
            "--publication",
            "p",
        ]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    let said = format!("{}{err}", String::from_utf8_lossy(&out.stdout));
    assert!(said.contains("BYPASSRLS"), "{said}");
}

/// A partition published beside its root (one publication through the root, another naming the
/// partition): its rows are copied once, with the root's, as the stream sends them as the root's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_published_twice_is_copied_once() {
    let db = TestDb::new("copypart2").await;
    if common::source_version(&db).await < 130000 {
        return common::skip("publish_via_partition_root needs a PostgreSQL 13+ source");
    }
    db.both(
        "CREATE TABLE m (id int PRIMARY KEY, v text) PARTITION BY RANGE (id); \
         CREATE TABLE m_1 PARTITION OF m FOR VALUES FROM (0) TO (100); \
         CREATE TABLE m_2 PARTITION OF m FOR VALUES FROM (100) TO (200); \
         CREATE TABLE n (v text) PARTITION BY LIST (v); \
         CREATE TABLE n_a PARTITION OF n FOR VALUES IN ('a');",
    )
    .await;
    db.source_sql(
        "INSERT INTO m SELECT g, 'v' || g FROM generate_series(1, 150) g; \
         INSERT INTO n SELECT 'a' FROM generate_series(1, 7); \
         CREATE PUBLICATION a FOR TABLE m, n WITH (publish_via_partition_root); \
         CREATE PUBLICATION b FOR TABLE m_1, n_a;",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("a,b", &["--copy-data", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM m").await, 150);
    // (No key to refuse a second copy: the rows would simply be there twice.)
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM n").await, 7);
    db.source_sql("UPDATE m SET v = 'y' WHERE id = 5; INSERT INTO n VALUES ('a')")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("a,b", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM m WHERE v = 'y'")
            .await,
        1
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM n").await, 8);
}

/// A `"char"` column copied from a 15-or-later source into a 14-or-older target (whose text
/// forms of a byte above 127 differ) is named before the copy; between other versions nothing
/// is said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn char_columns_between_versions_that_write_them_differently_are_named() {
    let db = TestDb::new("copychar").await;
    db.both("CREATE TABLE ch (id int PRIMARY KEY, c \"char\")")
        .await;
    db.source_sql("INSERT INTO ch VALUES (1, 'a'); CREATE PUBLICATION p FOR TABLE ch;")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let differ =
        common::source_version(&db).await >= 150000 && common::target_version(&db).await < 150000;
    assert_eq!(
        stderr(&out).contains("\"char\" columns are copied from a PostgreSQL")
            && stderr(&out).contains("\"public\".\"ch\".\"c\""),
        differ,
        "{}",
        stderr(&out)
    );
    db.assert_same("ch").await;
}

/// `cutover` while `run --copy-data` is still copying (the slot shows inactive meanwhile): it
/// waits for the copy instead of taking the slot over, then cuts over as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_waits_for_a_copy_still_running() {
    let db = TestDb::new("cutcopy").await;
    db.both("CREATE TABLE big (id int PRIMARY KEY, v text)")
        .await;
    db.source_sql(
        "INSERT INTO big SELECT g, 'v' || g FROM generate_series(1, 1000) g; \
         CREATE PUBLICATION p FOR TABLE big;",
    )
    .await;
    // A target lock that lets the copy's checks read the table but holds its COPY.
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE big IN SHARE MODE")
        .await
        .unwrap();
    let mut worker = spawn(db.pgapply("p", &["--copy-data"]));
    wait_for("the copy to wait for the lock", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    let out_path = std::env::temp_dir().join(format!("pgapply-cutcopy-{}.out", std::process::id()));
    let slot = db.slot();
    let mut cutover = db.on_both("cutover", &["--slot", &slot, "--timeout", "60s"]);
    cutover.stdout(std::fs::File::create(&out_path).unwrap());
    let mut cutover = cutover.kill_on_drop(true).spawn().unwrap();
    let said = || std::fs::read_to_string(&out_path).unwrap_or_default();
    wait_for("the cutover to say it waits for the copy", 30, || async {
        said().contains("still making the initial copy")
    })
    .await;
    db.source_sql("INSERT INTO big VALUES (1001, 'after the snapshot')")
        .await;
    // The copy outlasts the time a worker gets to show its heartbeat (30 s): that allowance
    // starts once the copy is done, not with the cutover. (Not a wait for a condition: the
    // scenario is a copy that takes this long.)
    tokio::time::sleep(std::time::Duration::from_secs(32)).await;
    holder.batch_execute("COMMIT").await.unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(90), cutover.wait())
        .await
        .expect("the cutover ends")
        .unwrap();
    assert!(status.success(), "cutover exit {status}: {}", said());
    assert!(said().contains("cutover done"), "{}", said());
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), worker.wait())
        .await
        .expect("the worker stops at the cutover's end position")
        .unwrap();
    assert!(status.success(), "worker exit: {status}");
    db.assert_same("big").await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM big").await, 1001);
    let _ = std::fs::remove_file(&out_path);
}

/// A copy killed (kill -9) while its COPY waits for a target lock leaves its backend waiting;
/// the next run, emptying the tables to start over, waits behind that backend, and says so,
/// naming it, instead of standing still without a word. Once the lock goes, it copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_started_over_says_what_it_waits_for() {
    let db = TestDb::new("copyagainwait").await;
    db.both("CREATE TABLE big (id int PRIMARY KEY, v text)")
        .await;
    db.source_sql(
        "INSERT INTO big SELECT g, 'v' || g FROM generate_series(1, 1000) g; \
         CREATE PUBLICATION p FOR TABLE big;",
    )
    .await;
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE big IN SHARE MODE")
        .await
        .unwrap();
    let mut first = spawn(db.pgapply("p", &["--copy-data"]));
    wait_for("the copy to wait for the lock", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    first.start_kill().unwrap();
    let _ = first.wait().await;
    let (mut again, log) = common::spawn_logged(db.pgapply("p", &["--copy-data"]));
    wait_for("the rerun to name the wait", 60, || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("the initial copy waits for a lock on table")
            && text.contains("held by target process(es)")
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    wait_for("the copy", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM big").await == 1000
    })
    .await;
    again.start_kill().unwrap();
    let _ = again.wait().await;
    db.assert_same("big").await;
}

/// `cutover` while `run --copy-data` has not created its slot yet (a lock on a target table
/// holds its checks back): it waits for the worker instead of calling the slot missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_waits_for_a_worker_still_creating_its_slot() {
    let db = TestDb::new("cutstart").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO t VALUES (1), (2); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    // A lock that holds the worker's check of the target table, before it creates the slot.
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (mut worker, log) = common::spawn_logged(db.pgapply("p", &["--copy-data"]));
    wait_for("the worker to wait for the lock", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    assert_eq!(db.slot_count().await, 0);
    let out_path =
        std::env::temp_dir().join(format!("pgapply-cutstart-{}.out", std::process::id()));
    let slot = db.slot();
    let mut cutover = db.on_both("cutover", &["--slot", &slot, "--timeout", "60s"]);
    cutover.stdout(std::fs::File::create(&out_path).unwrap());
    let mut cutover = cutover.kill_on_drop(true).spawn().unwrap();
    let said = || std::fs::read_to_string(&out_path).unwrap_or_default();
    wait_for("the cutover to say it waits for the worker", 30, || async {
        said().contains("has not created its slot yet")
    })
    .await;
    // The worker's log names the lock and who holds it.
    wait_for("the worker to name the lock it waits for", 30, || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("the initial copy waits for a lock on table")
            && text.contains("held by target process(es)")
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(90), cutover.wait())
        .await
        .expect("the cutover ends")
        .unwrap();
    assert!(status.success(), "cutover exit {status}: {}", said());
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), worker.wait())
        .await
        .expect("the worker stops at the cutover's end position")
        .unwrap();
    assert!(status.success(), "worker exit: {status}");
    db.assert_same("t").await;
    let _ = std::fs::remove_file(&out_path);
}

/// A transaction left open on the source holds the slot's creation (and so the copy) back: the
/// log says so while it waits, and the copy goes on once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_left_open_on_the_source_is_named_while_the_slot_waits() {
    let db = TestDb::new("copywait").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO t VALUES (1), (2); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    let holder = common::connect(db.source_port, &db.name).await;
    holder
        .batch_execute("BEGIN; SELECT txid_current();")
        .await
        .unwrap();
    let (mut worker, log) = common::spawn_logged(db.pgapply("p", &["--copy-data", "--copy-only"]));
    wait_for("the log to name the wait", 30, || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("waits for the transactions open on the source")
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), worker.wait())
        .await
        .expect("the copy ends once the transaction did")
        .unwrap();
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 2);
}

/// A slot that exists but is not the slot of an interrupted copy (made by hand, or by a run
/// without --copy-data) is left alone by --copy-data: refused, naming it, and kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_data_leaves_a_slot_it_did_not_make() {
    let db = TestDb::new("copyslot").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO t VALUES (1); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    db.source
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&db.slot()],
        )
        .await
        .unwrap();
    db.source_sql("INSERT INTO t VALUES (2)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("already exists on the source") && err.contains("pg_drop_replication_slot"),
        "{err}"
    );
    let slots = db.slot_count().await;
    assert_eq!(slots, 1, "the slot is kept");
    // Without --copy-data it streams what it holds.
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM t WHERE id = 2")
            .await,
        1
    );
}

/// The verify step reads every published table: a source role that may not is named before the
/// cutover changes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_names_a_table_the_source_role_may_not_read() {
    let db = TestDb::new("cutread").await;
    // (A sequence too: the wrong target lacks it as well, which must not bury the real cause.)
    db.both("CREATE TABLE t (id int PRIMARY KEY, n serial)")
        .await;
    let user = format!("cut_{}", db.name);
    db.source_sql(&format!(
        "INSERT INTO t VALUES (1); CREATE PUBLICATION p FOR TABLE t; \
         CREATE ROLE {user} LOGIN REPLICATION PASSWORD 'cut-secret';"
    ))
    .await;
    let source = db.source_conninfo_as(&user, "cut-secret");
    let target = db.target_conninfo();
    let slot = db.slot();
    let out = run_with_deadline(
        common::pgapply_command(&[
            "cutover",
            "--source",
            &source,
            "--target",
            &target,
            "--publication",
            "p",
            "--slot",
            &slot,
            "--timeout",
            "30s",
        ]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("nothing was done")
            && err.contains("the source role may not read \"public\".\"t\""),
        "{err}"
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE stop_lsn IS NOT NULL"
        )
        .await,
        0
    );
    // Another target database, where the table is not: refused before any role is frozen.
    let other = format!("{}_other", db.name);
    db.target_sql(&format!("CREATE DATABASE {other}")).await;
    let wrong_target = db
        .target_conninfo()
        .replace(&format!("dbname={}", db.name), &format!("dbname={other}"));
    assert_ne!(wrong_target, db.target_conninfo());
    let out = run_with_deadline(
        common::pgapply_command(&[
            "cutover",
            "--source",
            &db.source_conninfo(),
            "--target",
            &wrong_target,
            "--publication",
            "p",
            "--slot",
            &slot,
            "--timeout",
            "30s",
            "--freeze-writes",
            &user,
        ]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("nothing was done")
            && err.contains("the target has none of the published tables (\"public\".\"t\"): is --target the database")
            && !err.contains("sequence"),
        "{err}"
    );
    assert_eq!(
        db.count(
            &db.source,
            &format!("SELECT count(*) FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole WHERE r.rolname = '{user}'")
        )
        .await,
        0,
        "the role was frozen"
    );
    db.target_sql(&format!("DROP DATABASE {other}")).await;
}

/// A new slot's run says "starting" in `pgapply status` until its first status update (here it
/// waits for a target table a session holds locked), not "unknown".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_slot_is_starting_until_its_run_reports() {
    let db = TestDb::new("copystart").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE t").await;
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let mut worker = common::spawn(db.pgapply("p", &["--copy-data", "--copy-only"]));
    wait_for("the run to wait for the table", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    let target = db.target_conninfo();
    let out = run_with_deadline(
        common::pgapply_command(&["status", "--target", &target, "--slot", &db.slot()]),
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains(&format!("slot {}: starting", db.slot())),
        "{text}"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), worker.wait())
        .await
        .expect("the copy ends")
        .unwrap();
    assert!(status.success());
}

/// A second `run --copy-data` for a slot whose copy another process is making leaves it alone
/// (starting over would empty the tables under it): it waits, here giving up after one retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_copy_of_the_same_slot_waits_for_the_first() {
    let db = TestDb::new("copytwice").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql(
        "INSERT INTO t SELECT generate_series(1, 1000); CREATE PUBLICATION p FOR TABLE t;",
    )
    .await;
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN SHARE MODE")
        .await
        .unwrap();
    let mut first = common::spawn(db.pgapply("p", &["--copy-data", "--copy-only"]));
    wait_for("the first copy to wait for the lock", 60, || async {
        common::waiting_for_a_lock(&db).await > 0
    })
    .await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--copy-data",
                "--copy-only",
                "--max-retries",
                "1",
                "--retry-min",
                "10ms",
            ],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("another pgapply is making the initial copy"),
        "{err}"
    );
    // check sees a copy under way, not an interrupted one.
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("is under way") && !text.contains("was interrupted"),
        "{text}"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), first.wait())
        .await
        .expect("the first copy ends")
        .unwrap();
    assert!(status.success());
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 1000);
}

/// verify compares whole rows whatever the columns are called (a column named `r` once stood for
/// the row in its digest) and whatever each side's search_path (a key of a user type was named
/// as the source's search_path shows it, and then not found on the target).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_compares_whole_rows_whatever_the_names_and_search_paths() {
    let db = TestDb::new("verifynames").await;
    db.both(
        "CREATE SCHEMA \"My Schema\"; CREATE TYPE \"My Schema\".\"Mood\" AS ENUM ('sad', 'ok'); \
         CREATE TABLE rk (id int PRIMARY KEY, r int, v text); CREATE TABLE rn (r int, v text); \
         CREATE TABLE mk (m \"My Schema\".\"Mood\" PRIMARY KEY, v text); \
         INSERT INTO rk VALUES (1, 1, 'same'); INSERT INTO rn VALUES (1, 'same'); \
         INSERT INTO mk VALUES ('sad', 'same'), ('ok', 'same');",
    )
    .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE rk, rn, mk")
        .await;
    db.source_sql(&format!(
        "ALTER DATABASE {} SET search_path = \"My Schema\", public",
        db.name
    ))
    .await;
    let verify = || db.on_both("verify", &[]);
    let out = run_with_deadline(verify(), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    for table in ["rk", "rn", "mk"] {
        assert!(
            text.contains(&format!("OK        \"public\".\"{table}\"")),
            "{text}"
        );
    }
    db.target_sql("UPDATE rk SET v = 'differs'; UPDATE rn SET v = 'differs'; UPDATE mk SET v = 'differs' WHERE m = 'ok';")
        .await;
    let out = run_with_deadline(verify(), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    for table in ["rk", "rn", "mk"] {
        assert!(
            text.contains(&format!("MISMATCH  \"public\".\"{table}\"")),
            "{text}"
        );
    }
}

/// A stored generated column, generated on both sides (as `pgapply schema` makes it): copied and
/// streamed with the target computing it. PostgreSQL 15 lists such columns among a publication's
/// columns even without a column list, though it sends no value for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_columns_are_left_to_the_target_in_copy_and_stream() {
    let db = TestDb::new("copygen").await;
    if common::source_version(&db).await < 120000 {
        common::skip("generated columns are PostgreSQL 12+");
        return;
    }
    db.both("CREATE TABLE g (id int PRIMARY KEY, a int, doubled int GENERATED ALWAYS AS (a * 2) STORED)")
        .await;
    db.source_sql(
        "INSERT INTO g (id, a) VALUES (1, 10), (2, 20); CREATE PUBLICATION p FOR TABLE g",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql("INSERT INTO g (id, a) VALUES (3, 50); UPDATE g SET a = 100 WHERE id = 1")
        .await;
    db.sync("p").await;
    db.assert_same("g").await;
    let check = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(!text.contains("generated on the target"), "{text}");
    assert!(check.status.success(), "{text}\n{}", stderr(&check));

    // Generated on the target only: the fix check gives is one the target's version has.
    if common::target_version(&db).await < 120000 {
        return;
    }
    db.source_sql(
        "CREATE TABLE h (id int PRIMARY KEY, a int, d int); ALTER PUBLICATION p ADD TABLE h",
    )
    .await;
    db.target_sql(
        "CREATE TABLE h (id int PRIMARY KEY, a int, d int GENERATED ALWAYS AS (a * 2) STORED)",
    )
    .await;
    let check = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&check.stdout).to_string();
    let fix = if common::target_version(&db).await < 130000 {
        "PostgreSQL 12 has no DROP EXPRESSION: add a plain column"
    } else {
        "ALTER TABLE \"public\".\"h\" ALTER COLUMN \"d\" DROP EXPRESSION)"
    };
    assert!(
        text.contains("column \"d\" of \"public\".\"h\" is generated on the target but published by the source")
            && text.contains(fix),
        "{text}"
    );
}

/// An extension type in another schema on the target (public on the source, its own schema on
/// the target, as managed services do): verify casts each side's bounds to that side's own type,
/// and check takes the two names for the same type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_type_in_another_schema_on_the_target_is_compared() {
    let db = TestDb::new("extschema").await;
    // (Not every build of the servers ships it, nor lists its extensions without an error.)
    let source_has = db
        .source
        .batch_execute("CREATE EXTENSION citext SCHEMA public")
        .await
        .is_ok();
    let target_has = db
        .target
        .batch_execute("CREATE SCHEMA ext; CREATE EXTENSION citext SCHEMA ext")
        .await
        .is_ok();
    if !(source_has && target_has) {
        common::skip("the citext extension is not installed with these servers");
        return;
    }
    db.source_sql("CREATE TABLE c (k public.citext PRIMARY KEY, v text)")
        .await;
    db.target_sql("CREATE TABLE c (k ext.citext PRIMARY KEY, v text)")
        .await;
    db.both("INSERT INTO c SELECT 'key' || g, 'v' FROM generate_series(1, 50) g")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE c").await;
    let out = run_with_deadline(db.on_both("verify", &["--chunk-rows", "10"]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert!(
        text.contains("OK        \"public\".\"c\" (50 rows, 5 chunks)"),
        "{text}"
    );
    let check = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(!text.contains("values may not convert"), "{text}");
}

/// A writer the cutover did not freeze keeps committing while a worker runs: nothing it
/// committed at or after the cutover's end position reaches the target, although the worker
/// reads the stop request only every second (each group checks it on the target before it
/// commits, and the cutover holds the groups back while it takes the end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_committed_after_the_end_position_reaches_the_target() {
    let db = TestDb::new("cutend").await;
    db.both("CREATE TABLE w (id bigserial PRIMARY KEY, lsn pg_lsn NOT NULL)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE w").await;
    let mut worker = spawn(db.pgapply("p", &[]));
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let writer = {
        let writing = writing.clone();
        let client = common::connect(db.source_port, &db.name).await;
        tokio::spawn(async move {
            while writing.load(std::sync::atomic::Ordering::SeqCst) {
                client
                    .batch_execute("INSERT INTO w (lsn) VALUES (pg_current_wal_insert_lsn())")
                    .await
                    .unwrap();
            }
        })
    };
    wait_for("rows on the target", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM w").await > 100
    })
    .await;
    // The cutover's verify finds the rows written since: it fails, after the stop.
    let slot = db.slot();
    let out = run_with_deadline(
        db.on_both("cutover", &["--slot", &slot, "--timeout", "60s"]),
        120,
    )
    .await;
    writing.store(false, std::sync::atomic::Ordering::SeqCst);
    writer.await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let end = text
        .lines()
        .find_map(|l| l.strip_prefix("step 3: draining replication to "))
        .unwrap_or_else(|| panic!("no end position in:\n{text}\n{}", stderr(&out)))
        .trim()
        .to_owned();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(30), worker.wait()).await;
    let _ = worker.start_kill();
    assert_eq!(
        db.count(
            &db.target,
            &format!("SELECT count(*) FROM w WHERE lsn >= '{end}'")
        )
        .await,
        0,
        "rows committed after the end {end} reached the target:\n{text}"
    );
    // Everything committed before it did.
    assert!(
        db.count(&db.target, "SELECT count(*) FROM w").await > 100,
        "{text}"
    );
}

/// Columns of OID alias types (regclass, regtype) hold OIDs in their binary form, which name
/// other objects, or none, on the target: they are copied and streamed as text, by name, and
/// schema-qualified, so a target whose search_path differs reads them too. An xml fragment
/// arrives on a target set to `xmloption = document`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oid_alias_types_arrive_as_names_not_oids() {
    let db = TestDb::new("regtypes").await;
    db.source_sql(
        "CREATE SCHEMA app; CREATE TYPE app.color AS ENUM ('red'); CREATE TABLE app.thing (id int);",
    )
    .await;
    // Other objects first on the target: the same names get other OIDs there.
    db.target_sql(
        "CREATE TABLE filler (x int); CREATE TYPE filler_type AS ENUM ('x'); CREATE SCHEMA app; \
         CREATE TABLE app.thing (id int); CREATE TYPE app.color AS ENUM ('red');",
    )
    .await;
    db.both("CREATE TABLE misc (id int PRIMARY KEY, rc regclass, rty regtype, x xml)")
        .await;
    let database: String = db
        .target
        .query_one("SELECT current_database()::text", &[])
        .await
        .unwrap()
        .get(0);
    db.target_sql(&format!(
        "ALTER DATABASE \"{database}\" SET search_path = '\"$user\"'; ALTER DATABASE \"{database}\" SET xmloption = document"
    ))
    .await;
    db.source_sql(
        "INSERT INTO misc VALUES (1, 'app.thing', 'app.color', 'abc<a/>'), (3, 'misc', 'integer', ''); \
         CREATE PUBLICATION p FOR TABLE misc;",
    )
    .await;
    copy_up_to_now(&db).await;
    db.source_sql("INSERT INTO misc VALUES (2, 'misc', 'app.color[]', 'x<b/>y')")
        .await;
    let c = common::clusters();
    let binary: &[&str] = if c.source_major == c.target_major && c.source_major >= 14 {
        &["--binary"]
    } else {
        &[]
    };
    let endpos = db.source_wal().await;
    let mut args = vec!["--endpos", endpos.as_str()];
    args.extend_from_slice(binary);
    let out = run_with_deadline(db.pgapply("p", &args), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let q = "SELECT id, rc::text, rty::text, x::text FROM misc ORDER BY id";
    let rows = |client: &'static str| {
        let client = if client == "source" {
            &db.source
        } else {
            &db.target
        };
        async move {
            client
                .query(q, &[])
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r.get::<_, i32>(0),
                        r.get::<_, String>(1),
                        r.get::<_, String>(2),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let source = rows("source").await;
    assert_eq!(source.len(), 3);
    assert_eq!(source[1].2, "app.color[]");
    assert_eq!(rows("target").await, source);
    // verify prints them schema-qualified on both sides too, whatever the search_path.
    let out = run_with_deadline(db.on_both("verify", &[]), 60).await;
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
}

/// A worker that stopped answering (here: SIGSTOP) keeps its last lag figures on the source, low
/// ones too: the cutover waits for it to be seen answering before it freezes or drains anything,
/// and gives up at --timeout saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_does_not_trust_a_worker_that_stopped_answering() {
    let db = TestDb::new("cuthung").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("INSERT INTO t VALUES (1); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    copy_up_to_now(&db).await;
    let worker = spawn(db.pgapply("p", &[]));
    db.wait_slot_active().await;
    db.source_sql("INSERT INTO t VALUES (2)").await;
    let lsn = db.source_wal().await;
    wait_for("the worker to confirm the insert", 30, || {
        db.slot_confirmed(&lsn)
    })
    .await;
    common::signal(&worker, libc::SIGSTOP);
    // Nothing of it still under way on the target (a heartbeat sent just before the stop).
    wait_for(
        "the stopped worker's target sessions to be idle",
        30,
        || async {
            db.count(
                &db.target,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgapply' \
             AND datname = current_database() AND state <> 'idle'",
            )
            .await
                == 0
        },
    )
    .await;
    let slot = db.slot();
    let out = run_with_deadline(
        db.on_both(
            "cutover",
            &["--slot", &slot, "--timeout", "4s", "--max-lag", "1GB"],
        ),
        60,
    )
    .await;
    common::signal(&worker, libc::SIGCONT);
    common::signal(&worker, libc::SIGTERM);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("wrote no heartbeat on the target in ")
            && err.contains("nothing was changed yet"),
        "{err}"
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE stop_lsn IS NOT NULL"
        )
        .await,
        0
    );
}

/// A cutover given a slot the target has no state for (a misspelt --slot that exists, another
/// target's slot, one made by hand) is refused before anything is done, naming the slots that
/// do replicate into this database: it used to apply that slot's changes here itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_of_a_slot_never_replicated_here_is_refused() {
    let db = TestDb::new("cutwrongslot").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    db.source_sql("INSERT INTO t VALUES (1, 0); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    copy_up_to_now(&db).await;
    let other = format!("{}_other", db.slot());
    db.source
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&other],
        )
        .await
        .unwrap();
    let role = format!("app_{}", db.name);
    db.source_sql(&format!("CREATE ROLE {role} LOGIN")).await;
    db.source_sql("UPDATE t SET v = v + 1").await;
    let before: String = db
        .source
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&other],
        )
        .await
        .unwrap()
        .get(0);
    let out = run_with_deadline(
        db.on_both(
            "cutover",
            &[
                "--slot",
                &other,
                "--timeout",
                "30s",
                "--freeze-writes",
                &role,
            ],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "the target has no pgapply state for slot \"{other}\""
        )) && err.contains(&format!("\"{}\"", db.slot()))
            && err.contains("nothing was done"),
        "{err}"
    );
    let after: String = db
        .source
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&other],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(before, after);
    assert_eq!(
        db.count(
            &db.source,
            &format!("SELECT count(*) FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole WHERE r.rolname = '{role}'"),
        )
        .await,
        0
    );
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM t WHERE v = 1")
            .await,
        0
    );
    db.drop_slot_named(&other).await;
}

/// A worker that goes away while the cutover waits for its lag (killed, here while a lock on
/// the target holds it back) is taken over: the cutover applies the rest itself, as when none
/// ran, instead of failing for want of its heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_takes_over_from_a_worker_killed_while_it_waits_for_the_lag() {
    let db = TestDb::new("cutkilled").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    db.source_sql("INSERT INTO t VALUES (1, 0); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    copy_up_to_now(&db).await;
    let mut worker = spawn(db.pgapply("p", &[]));
    db.wait_slot_active().await;
    let holder = connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    db.source_sql("INSERT INTO t SELECT g, g FROM generate_series(2, 100) g")
        .await;
    wait_for("the worker to wait for the lock", 60, || async {
        common::waiting_for_a_lock(&db).await >= 1
    })
    .await;
    let out_path = std::env::temp_dir().join(format!("pgapply-test-{}-cutover.out", db.name));
    let mut cmd = db.on_both(
        "cutover",
        &["--slot", &db.slot(), "--timeout", "90s", "--max-lag", "1"],
    );
    cmd.stdout(std::fs::File::create(&out_path).unwrap());
    cmd.stderr(std::process::Stdio::piped());
    let cutover = cmd.spawn().unwrap();
    wait_for("the cutover to wait for the lag", 60, || async {
        std::fs::read_to_string(&out_path)
            .unwrap_or_default()
            .contains("step 1: lag")
    })
    .await;
    worker.start_kill().unwrap();
    let _ = worker.wait().await;
    holder.batch_execute("COMMIT").await.unwrap();
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        cutover.wait_with_output(),
    )
    .await
    .expect("the cutover to end")
    .unwrap();
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", stderr(&out));
    assert!(
        text.contains("the worker let go of slot") && text.contains("cutover done"),
        "{text}"
    );
    db.assert_same("t").await;
}

/// An initial copy first makes sure that the apply session can bind to its replication origin
/// afterwards (here another session holds it; a target without a free origin state fails the
/// same way): refused before any row is copied, not after hours of copying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_checks_its_replication_origin_before_copying() {
    let db = TestDb::new("copyorigin").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql(
        "INSERT INTO t SELECT generate_series(1, 100); CREATE PUBLICATION p FOR TABLE t;",
    )
    .await;
    let origin = format!("pgapply_{}", db.slot());
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .execute("SELECT pg_replication_origin_create($1)", &[&origin])
        .await
        .unwrap();
    holder
        .execute("SELECT pg_replication_origin_session_setup($1)", &[&origin])
        .await
        .unwrap();
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--copy-data",
                "--create-slot",
                "--endpos",
                &endpos,
                "--max-retries",
                "1",
                "--retry-max",
                "1s",
            ],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(&format!(
            "binding the apply session to replication origin {origin:?}"
        )),
        "{err}"
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 0);
    // Released, the copy goes through.
    holder
        .execute("SELECT pg_replication_origin_session_reset()", &[])
        .await
        .unwrap();
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--create-slot", "--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 100);
}

/// A cutover ended by a signal after writes were frozen says so, with the undo, and exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cutover_interrupted_after_the_freeze_says_how_to_undo_it() {
    let db = TestDb::new("cutsig").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    let role = format!("app_{}", db.name);
    db.source_sql(&format!(
        "INSERT INTO t VALUES (1, 'a'); CREATE PUBLICATION p FOR TABLE t; CREATE ROLE {role} LOGIN;"
    ))
    .await;
    copy_up_to_now(&db).await;
    // That run ended at its end position right after the copy: recorded as stopped, not as a
    // copy still under way (which the cutover would wait for).
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE state = 'stopped'"
        )
        .await,
        1
    );
    // The verify step (5) waits for this lock.
    let holder = connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let slot = db.slot();
    let (mut cutover, log) = common::spawn_logged(db.on_both(
        "cutover",
        &["--slot", &slot, "--timeout", "5m", "--freeze-writes", &role],
    ));
    wait_for("the freeze (step 2)", 60, || async {
        db.count(
            &db.source,
            &format!("SELECT count(*) FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole WHERE r.rolname = '{role}' AND 'default_transaction_read_only=on' = ANY (s.setconfig)"),
        )
        .await
            == 1
    })
    .await;
    wait_for("the verify step (5) to wait for the lock", 60, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .await
            >= 1
    })
    .await;
    common::signal(&cutover, libc::SIGINT);
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), cutover.wait())
        .await
        .expect("the cutover ends on SIGINT")
        .unwrap();
    let err = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("the cutover was interrupted by a signal at step 5")
            && err.contains(&format!("writes are frozen for {role}"))
            && err.contains("UPDATE pgapply.progress SET stop_lsn = NULL")
            && err.contains(&format!("ALTER ROLE \"{role}\" IN DATABASE")),
        "{err}"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
}

/// Interrupted while it drains the slot itself (no worker runs): `pgapply status` does not go on
/// showing that run as streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cutover_interrupted_while_it_drains_leaves_its_run_stopped() {
    let db = TestDb::new("cutsigdrain").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.source_sql("INSERT INTO t VALUES (1, 'a'); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    copy_up_to_now(&db).await;
    db.source_sql("INSERT INTO t VALUES (2, 'b')").await;
    // The drain's apply waits for this lock.
    let holder = connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let slot = db.slot();
    let (mut cutover, log) =
        common::spawn_logged(db.on_both("cutover", &["--slot", &slot, "--timeout", "5m"]));
    let pid = cutover.id().unwrap() as i64;
    wait_for("the drain (step 3) to run in the cutover's process", 60, || async {
        db.count(
            &db.target,
            &format!("SELECT count(*) FROM pgapply.progress WHERE state = 'streaming' AND pid = {pid}"),
        )
        .await
            == 1
    })
    .await;
    common::signal(&cutover, libc::SIGINT);
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), cutover.wait())
        .await
        .expect("the cutover ends on SIGINT")
        .unwrap();
    let err = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("the cutover was interrupted by a signal at step 3"),
        "{err}"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE state = 'stopped' AND pid IS NULL"
        )
        .await,
        1,
        "{err}"
    );
}

/// Back to the old primary with a cutover in the other direction: the roles the first cutover
/// froze there are still read-only, and the summary says so, with the command that undoes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cutover_back_names_the_roles_still_frozen_there() {
    let db = TestDb::new("cutback").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    let role = format!("app_{}", db.name);
    db.source_sql(&format!(
        "INSERT INTO t VALUES (1, 'old'); CREATE PUBLICATION p FOR TABLE t; CREATE ROLE {role} LOGIN;"
    ))
    .await;
    copy_up_to_now(&db).await;
    db.cutover(&["--reverse", "--freeze-writes", &role]).await;
    db.target_sql("INSERT INTO t VALUES (2, 'new primary')")
        .await;
    let reverse = format!("{}_reverse", db.slot());
    let out = run_with_deadline(
        common::pgapply_command(&[
            "cutover",
            "--source",
            &db.target_conninfo(),
            "--target",
            &db.source_conninfo(),
            "--publication",
            &reverse,
            "--slot",
            &reverse,
            "--timeout",
            "60s",
        ]),
        120,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert_eq!(
        db.count(&db.source, "SELECT count(*) FROM t WHERE id = 2")
            .await,
        1
    );
    assert!(
        text.contains(&format!("role(s) {role} are read-only in this database"))
            && text.contains(&format!("ALTER ROLE \"{role}\" IN DATABASE")),
        "{text}"
    );
    // The forward slot, on the old primary again, is named with how to drop it.
    assert!(
        text.contains(&format!(
            "the forward slot \"{}\" on the target (the old primary, primary again) holds",
            db.slot()
        )) && text.contains("pg_drop_replication_slot("),
        "{text}"
    );
}

/// `pgapply schema` as a target role that does not own schema public: the dump's comment on it
/// (the target's own business) is left out, not refused; nor does it need CREATE on the
/// database to create tables in a schema that exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_as_a_role_that_does_not_own_public() {
    if !pg_dump_usable() {
        return;
    }
    let db = TestDb::new("schemarole").await;
    db.source_sql(
        "COMMENT ON SCHEMA public IS 'commented on the source'; \
         CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION p FOR TABLE t;",
    )
    .await;
    let user = format!("owner_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {user} LOGIN PASSWORD 'schema-secret'; GRANT CREATE ON SCHEMA public TO {user};"
    ))
    .await;
    let out = run_with_deadline(
        db.on_both_as_target_user("schema", &user, "schema-secret", &["--section", "pre-data"]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pg_class WHERE relname = 't'"
        )
        .await,
        1
    );
}

/// The publications a slot's worker replicates are recorded: a cutover given others is refused
/// (it would verify the wrong tables and call the migration done), and a run given others says
/// which way it changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_publications_than_the_slots_are_named() {
    let db = TestDb::new("otherpub").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE u (id int PRIMARY KEY)")
        .await;
    db.source_sql(
        "INSERT INTO t VALUES (1); CREATE PUBLICATION p FOR TABLE t; CREATE PUBLICATION q FOR TABLE u;",
    )
    .await;
    copy_up_to_now(&db).await;
    let slot = db.slot();
    let mut cutover = common::pgapply_command(&[
        "cutover",
        "--source",
        &db.source_conninfo(),
        "--target",
        &db.target_conninfo(),
        "--publication",
        "q",
        "--slot",
        &slot,
        "--timeout",
        "30s",
    ]);
    cutover.env_remove("PGAPPLY_PUBLICATION");
    let out = run_with_deadline(cutover, 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "replicates publication(s) p, not q: give the cutover the worker's --publication p"
        ) && err.contains("nothing was done"),
        "{err}"
    );
    db.source_sql("INSERT INTO t VALUES (2)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("q", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("this slot was replicated with other publications until now")
            && err.contains("give --publication p"),
        "{err}"
    );
}

/// A value the target's narrower column refuses during the initial copy: the error names the
/// column (from the COPY's own context), as the same error while streaming does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_refused_by_a_narrower_column_names_the_column() {
    let db = TestDb::new("copynarrow").await;
    db.source_sql(
        "CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'abcdef'); \
         CREATE PUBLICATION p FOR TABLE t;",
    )
    .await;
    db.target_sql("CREATE TABLE t (id int PRIMARY KEY, v varchar(3))")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--create-slot", "--endpos", &endpos]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("value too long for type character varying(3)") && err.contains("column v"),
        "{err}"
    );
}

/// A target role that may not set session_replication_role copies into tables whose foreign keys
/// check the rows: a row whose referenced row is not on the target stops the copy with what to
/// do (copy as a role that may, or create the foreign keys after the copy), not the bare error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_refusing_a_copied_row_says_what_to_do() {
    let db = TestDb::new("copyfk").await;
    db.both(
        "CREATE TABLE parent (id int PRIMARY KEY); \
         CREATE TABLE child (id int PRIMARY KEY, pid int REFERENCES parent)",
    )
    .await;
    db.source_sql("INSERT INTO parent VALUES (1); INSERT INTO child VALUES (10, 1)")
        .await;
    // Only the child is published: its parent row never reaches the target.
    db.source_sql("CREATE PUBLICATION p FOR TABLE child").await;
    let role = format!("fk_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'f'; CREATE SCHEMA pgapply AUTHORIZATION {role}; \
         GRANT ALL ON parent, child TO {role};"
    ))
    .await;
    let out = run_with_deadline(
        db.pgapply_as_target_user(&role, "f", &["--copy-data", "--create-slot"]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "a definite error: {log}");
    assert!(
        log.contains("copying")
            && log.contains("\"public\".\"child\"")
            && log.contains("the target's foreign keys check the copied rows")
            && log.contains("pgapply schema --section post-data"),
        "{log}"
    );
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM child").await, 0);
}

/// A table copied after the initial copy, with a row filter, then published whole by another
/// publication the run adds, while the source writes nothing the slot applies (the stream has
/// not passed that copy's position yet): each start names it as a copy to make again, as
/// `check` does, not only once the stream moved on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_copy_widened_by_another_publication_is_named_while_the_source_is_idle() {
    let db = TestDb::new("latewiden").await;
    if common::clusters().source_major < 15 {
        common::skip("row filters need a PostgreSQL 15 source");
        return;
    }
    db.both("CREATE TABLE stays (id int PRIMARY KEY); CREATE TABLE late (k int PRIMARY KEY)")
        .await;
    db.source_sql(
        "INSERT INTO stays SELECT generate_series(1, 10); \
         INSERT INTO late SELECT generate_series(1, 100); \
         CREATE PUBLICATION p FOR TABLE stays; CREATE PUBLICATION pwide FOR TABLE stays;",
    )
    .await;
    copy_up_to_now(&db).await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE late WHERE (k < 50)")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--copy-data", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM late").await, 49);
    db.source_sql("ALTER PUBLICATION pwide ADD TABLE late")
        .await;
    let said = |text: &str| {
        text.lines().any(|l| {
            l.contains("taken out of the publication and put back, or given another row filter")
                && l.contains("\"public\".\"late\"")
        })
    };
    for _ in 0..2 {
        let endpos = db.source_wal().await;
        let out = run_with_deadline(db.pgapply("p,pwide", &["--endpos", &endpos]), 60).await;
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        assert!(said(&err), "{err}");
    }
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p,pwide",
            &["--copy-data", "--truncate-target", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    // The run that copies it again says so, and gives no warning to do it.
    assert!(
        !err.lines().any(|l| l.contains(" WARN ") && said(l))
            && err.lines().any(|l| said(l)
                && l.contains("this run (--copy-data --truncate-target) copies them again")),
        "{err}"
    );
    db.assert_same("late").await;
}

/// A run that switches to another publication giving a copied table a wider row filter (and
/// leaves the first publication out): the table is named as a copy to make again, although what
/// publishes it is not compared when a publication is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_to_a_publication_with_a_wider_filter_is_named() {
    let db = TestDb::new("switchwide").await;
    if common::clusters().source_major < 15 {
        common::skip("row filters need a PostgreSQL 15 source");
        return;
    }
    db.both("CREATE TABLE t2 (id int PRIMARY KEY)").await;
    db.source_sql(
        "INSERT INTO t2 SELECT generate_series(1, 100); \
         CREATE PUBLICATION p FOR TABLE t2 WHERE (id > 50); \
         CREATE PUBLICATION pwide FOR TABLE t2 WHERE (id > 20);",
    )
    .await;
    copy_up_to_now(&db).await;
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t2").await, 50);
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("pwide", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.lines().any(|l| l
            .contains("taken out of the publication and put back, or given another row filter")
            && l.contains("\"public\".\"t2\"")),
        "{err}"
    );
}

/// A table in two publications with different row filters: an ALTER PUBLICATION that changes
/// neither filter (it moves the publication's catalog row, and with it the order the source
/// lists the filters in) does not name the table as a copy to make again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_listed_in_another_order_are_the_same_filter() {
    let db = TestDb::new("filterorder").await;
    if common::clusters().source_major < 15 {
        common::skip("row filters need a PostgreSQL 15 source");
        return;
    }
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql(
        "INSERT INTO t SELECT generate_series(1, 200); \
         CREATE PUBLICATION pa FOR TABLE t WHERE (id < 50); \
         CREATE PUBLICATION pb FOR TABLE t WHERE (id >= 100);",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "pa,pb",
            &["--copy-data", "--create-slot", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 150);
    for publication in ["pa", "pb", "pa"] {
        db.source_sql(&format!(
            "ALTER PUBLICATION {publication} SET (publish = 'insert, update, delete, truncate')"
        ))
        .await;
        let endpos = db.source_wal().await;
        let out = run_with_deadline(db.pgapply("pa,pb", &["--endpos", &endpos]), 60).await;
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        assert!(
            !err.contains("taken out of the publication and put back"),
            "{err}"
        );
    }
}

/// Two publications giving one table different column lists (15+): the source ends the stream at
/// that table's first change, so `--copy-data` refuses before it makes a slot or copies a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_column_lists_are_refused_before_the_copy() {
    let db = TestDb::new("mixedlists").await;
    if common::clusters().source_major < 15 {
        common::skip("column lists need a PostgreSQL 15 source");
        return;
    }
    db.both("CREATE TABLE t (id int PRIMARY KEY, a text, b text)")
        .await;
    db.source_sql(
        "INSERT INTO t VALUES (1, 'a', 'b'); \
         CREATE PUBLICATION pa FOR TABLE t (id, a); CREATE PUBLICATION pb FOR TABLE t (id, b);",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "pa,pb",
            &["--copy-data", "--create-slot", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("publish different column lists of public.t")
            && err.contains("nothing was copied"),
        "{err}"
    );
    assert_eq!(db.slot_count().await, 0);
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 0);
    // What the refusal spares: the source refuses the stream at the table's first change.
    db.source
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&db.slot()],
        )
        .await
        .expect("create slot");
    db.source_sql("INSERT INTO t VALUES (2, 'a', 'b')").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("pa,pb", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot use different column lists"), "{err}");
}

/// `--copy-data --create-slot --copy-jobs 1` up to the source's position now: its log.
async fn copy_up_to_now_logged(db: &TestDb) -> String {
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &[
                "--copy-data",
                "--create-slot",
                "--copy-jobs",
                "1",
                "--endpos",
                &endpos,
            ],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    stderr(&out)
}

/// Whether the copy's log says `table` went in frozen (None: no such line).
fn copied_frozen(log: &str, table: &str) -> Option<bool> {
    let line = log
        .lines()
        .find(|l| l.contains(" copied ") && l.contains(&format!("\"public\".\"{table}\"")))?;
    Some(line.contains("frozen=true"))
}

/// A table copied whole into an empty target table goes in frozen (COPY FREEZE, the table emptied
/// in the copy's transaction): on 14+, its pages come out all-visible. Not a table other tables'
/// foreign keys reference (TRUNCATE refuses it), nor any table while a logical slot in the target
/// database could pass the TRUNCATE on. Every row arrives either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_copied_whole_into_an_empty_table_goes_in_frozen() {
    let db = TestDb::new("copyfrozen").await;
    db.both(
        "CREATE TABLE parent (id int PRIMARY KEY); \
         CREATE TABLE child (id int PRIMARY KEY, pid int REFERENCES parent, v text); \
         CREATE TABLE tree (id int PRIMARY KEY, up int REFERENCES tree); \
         CREATE TABLE small (id int PRIMARY KEY);",
    )
    .await;
    db.source_sql(
        "INSERT INTO parent SELECT g FROM generate_series(1, 100) g; \
         INSERT INTO child SELECT g, g % 100 + 1, repeat('x', 200) FROM generate_series(1, 8000) g; \
         INSERT INTO tree SELECT g, nullif(g - 1, 0) FROM generate_series(1, 40000) g; \
         INSERT INTO small SELECT generate_series(1, 10); \
         CREATE PUBLICATION p FOR TABLE parent, child, tree, small;",
    )
    .await;
    let log = copy_up_to_now_logged(&db).await;
    assert_eq!(copied_frozen(&log, "child"), Some(true), "{log}");
    // (A foreign key of a table to itself does not stop its TRUNCATE.)
    assert_eq!(copied_frozen(&log, "tree"), Some(true), "{log}");
    // A table of a few pages gains nothing from it.
    assert_eq!(copied_frozen(&log, "small"), Some(false), "{log}");
    assert_eq!(copied_frozen(&log, "parent"), Some(false), "{log}");
    db.assert_same("parent").await;
    db.assert_same("child").await;
    db.assert_same("tree").await;
    db.assert_same("small").await;
    if common::target_version(&db).await >= 140000 {
        db.target_sql("ANALYZE child").await;
        assert_eq!(
            db.count(
                &db.target,
                "SELECT count(*) FROM pg_class WHERE relname = 'child' AND relpages > 0 AND relallvisible = relpages"
            )
            .await,
            1
        );
    }

    // A logical slot in the target database: nothing is truncated, nothing frozen.
    let other = TestDb::new("copyfrozenslot").await;
    other.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    other
        .source_sql(
            "INSERT INTO t SELECT generate_series(1, 1000); CREATE PUBLICATION p FOR TABLE t;",
        )
        .await;
    let downstream = format!("down_{}", other.name);
    other
        .target
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&downstream],
        )
        .await
        .expect("a slot on the target");
    let log = copy_up_to_now_logged(&other).await;
    other
        .target
        .execute("SELECT pg_drop_replication_slot($1)", &[&downstream])
        .await
        .expect("drop the target's slot");
    assert_eq!(copied_frozen(&log, "t"), Some(false), "{log}");
    other.assert_same("t").await;
}
