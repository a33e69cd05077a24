//! Bad input: each a non-zero exit within seconds and one clear line naming the thing.

mod common;

use std::time::Instant;

use common::{run_with_deadline, stderr, TestDb};
use tokio::process::Command;

async fn expect_failure(cmd: Command, must_contain: &[&str]) -> String {
    let started = Instant::now();
    let out = run_with_deadline(cmd, 30).await;
    let err = stderr(&out);
    assert!(
        !out.status.success(),
        "expected failure, got success: {err}"
    );
    assert!(
        started.elapsed().as_secs() < 15,
        "took {:?}",
        started.elapsed()
    );
    let last = err.lines().last().unwrap_or_default().to_owned();
    assert!(
        last.starts_with("pgapply: error: "),
        "last line: {last}\n{err}"
    );
    for needle in must_contain {
        assert!(last.contains(needle), "{needle:?} not in {last:?}");
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_publication() {
    let db = TestDb::new("badpub").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    expect_failure(
        db.pgapply("p,nope", &[]),
        &["publication", "\"nope\"", "does not exist"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_slot_without_create_slot() {
    let db = TestDb::new("badslot").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE t").await;
    let slot = db.slot();
    expect_failure(
        db.pgapply("p", &[]),
        &["replication slot", &slot, "does not exist", "--create-slot"],
    )
    .await;
    // With --create-slot it is created and used.
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--create-slot", "--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_missing_on_target() {
    let db = TestDb::new("badtable").await;
    db.source_sql("CREATE TABLE only_here (id int PRIMARY KEY)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE only_here").await;
    // Named at the start, before any change to it arrives.
    expect_failure(
        db.pgapply("p", &[]),
        &[
            "\"public\".\"only_here\"",
            "does not exist",
            "create it on the target",
        ],
    )
    .await;
}

/// A table published, written and dropped on the source while pgapply was behind: pg_dump can
/// no longer show it, so the error gives CREATE TABLE as the changes describe it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_the_source_dropped_since_is_described_from_its_changes() {
    let db = TestDb::new("gonetable").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql(
        "CREATE TABLE gone (id int PRIMARY KEY, v varchar(20), n numeric(10,2));          ALTER PUBLICATION p ADD TABLE gone;",
    )
    .await;
    db.source_sql("INSERT INTO gone VALUES (1, 'x', 2.5)").await;
    db.source_sql("DROP TABLE gone").await;
    let endpos = db.source_wal().await;
    expect_failure(
        db.pgapply("p", &["--endpos", &endpos]),
        &[
            "\"public\".\"gone\"",
            "if the source has dropped it since, as its changes describe it: CREATE TABLE \"public\".\"gone\" (\"id\" integer, \"v\" character varying(20), \"n\" numeric(10,2), PRIMARY KEY (\"id\"))",
        ],
    )
    .await;
}

/// A partition published under its own name (not through its root) must exist on the target by
/// that name: said at the start, not at its first change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_partition_missing_on_target() {
    let db = TestDb::new("badpart").await;
    db.source_sql(
        "CREATE TABLE m (id int, v text) PARTITION BY RANGE (id); \
         CREATE TABLE m_1 PARTITION OF m FOR VALUES FROM (0) TO (100); \
         CREATE PUBLICATION p FOR TABLE m_1;",
    )
    .await;
    // An empty target has no root to map the partitions onto: they are missing tables, said
    // as such (and a table of another kind missing too is not left unsaid).
    db.source_sql(
        "CREATE TABLE m_2 PARTITION OF m FOR VALUES FROM (100) TO (200); \
         CREATE TABLE plain (id int PRIMARY KEY); ALTER PUBLICATION p ADD TABLE m_2, plain;",
    )
    .await;
    expect_failure(
        db.pgapply("p", &[]),
        &[
            "none of the 3 published tables exists on the target",
            "pgapply schema",
        ],
    )
    .await;
    db.target_sql("CREATE TABLE m (id int, v text)").await;
    expect_failure(
        db.pgapply("p", &[]),
        &[
            "table public.m_1 is a partition of public.m on the source, published under its own name",
            "map it in the config file ([tables.\"public.m_1\"] target = \"public.m\")",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_missing_on_target() {
    let db = TestDb::new("badcol").await;
    db.source_sql("CREATE TABLE t (id int PRIMARY KEY, extra text)")
        .await;
    db.target_sql("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1, 'x')").await;
    expect_failure(
        db.pgapply("p", &[]),
        &[
            "column \"extra\"",
            "\"public\".\"t\"",
            "ADD COLUMN \"extra\" text",
        ],
    )
    .await;
    // A type with a length: named with it.
    db.target_sql("ALTER TABLE t ADD COLUMN extra text").await;
    db.source_sql("ALTER TABLE t ADD COLUMN vc varchar(50); INSERT INTO t VALUES (2, 'y', 'z')")
        .await;
    expect_failure(
        db.pgapply("p", &[]),
        &["ADD COLUMN \"vc\" character varying(50)"],
    )
    .await;
}

/// A value an older target refuses although both columns have the same type (numeric
/// 'Infinity' before 14): not "change the column", but what can be done, skip included. Runs
/// only on such a pair (`PGAPPLY_TARGET_PG_BIN` of a 10 to 13 target; scripts/test-matrix.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_an_older_target_refuses_is_said_so() {
    let db = TestDb::new("olderval").await;
    if common::source_version(&db).await < 140000 || common::target_version(&db).await >= 140000 {
        return common::skip("needs a 14+ source and a target before 14");
    }
    db.both("CREATE TABLE n (id int PRIMARY KEY, v numeric)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE n").await;
    db.source_sql("INSERT INTO n VALUES (1, 'Infinity')").await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &[
            "target table \"public\".\"n\" refuses the source's value, though none of its columns of a built-in type differs from the source's",
            "pgapply skip",
        ],
    )
    .await;
    assert!(
        !last.contains("change the column on the target to fit")
            && last.contains("changing the value on the source now does not replace it"),
        "{last}"
    );
}

/// A value a target trigger refuses (a 22xxx error of its own): the advice says the change is in
/// the slot already (a fix on the source comes after it), and what does help.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_a_target_trigger_refuses_is_not_fixed_on_the_source() {
    let db = TestDb::new("trigval").await;
    db.both("CREATE TABLE n (id int PRIMARY KEY, v int)").await;
    db.target_sql(
        "CREATE FUNCTION no_negatives() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.v < 0 THEN RAISE EXCEPTION 'negative' USING ERRCODE = '22023'; END IF; RETURN NEW; END $$; \
         CREATE TRIGGER no_negatives BEFORE INSERT ON n FOR EACH ROW EXECUTE PROCEDURE no_negatives(); \
         ALTER TABLE n ENABLE ALWAYS TRIGGER no_negatives;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE n").await;
    db.source_sql("INSERT INTO n VALUES (1, -1)").await;
    expect_failure(
        db.pgapply("p", &[]),
        &[
            "target table \"public\".\"n\" refuses the source's value",
            "changing the value on the source now does not replace it",
            "Change the column, type or trigger on the target",
            "pgapply skip",
            "pgapply verify",
        ],
    )
    .await;
}

/// A target column narrower than the source's: the error names the table and says to widen the
/// column, not to skip the transaction (which would lose it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_too_narrow_on_target() {
    let db = TestDb::new("narrow").await;
    db.source_sql("CREATE TABLE n (id int PRIMARY KEY, big bigint)")
        .await;
    db.target_sql("CREATE TABLE n (id int PRIMARY KEY, big int)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE n").await;
    db.source_sql("INSERT INTO n VALUES (1, 5), (2, 10000000000)")
        .await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &[
            "column \"big\" (integer) of target table \"public\".\"n\"",
            "does not take the source's value",
        ],
    )
    .await;
    assert!(!last.contains("pgapply skip"), "{last}");
}

/// An enum value added on the source only, and a domain's CHECK only the target has: `check`
/// names the missing value, and each stop says what to change on the target (not to skip).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enum_value_and_a_domain_check_only_one_side_has_are_named() {
    let db = TestDb::new("enumdom").await;
    db.both(
        "CREATE TYPE mood AS ENUM ('sad', 'happy'); CREATE DOMAIN short_text AS text; \
         CREATE TABLE e (id int PRIMARY KEY, m mood, d short_text)",
    )
    .await;
    db.target_sql("ALTER DOMAIN short_text ADD CONSTRAINT short CHECK (length(VALUE) < 3)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE e").await;
    db.source_sql("ALTER TYPE mood ADD VALUE 'ecstatic'").await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.lines().any(|l| l.starts_with("PROBLEM")
            && l.contains("column \"m\" of \"public\".\"e\"")
            && l.contains("'ecstatic'")),
        "{text}"
    );
    db.source_sql("INSERT INTO e VALUES (1, 'ecstatic', 'ok')")
        .await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &[
            "enum type mood",
            "ALTER TYPE mood ADD VALUE 'ecstatic'",
            "ALTER TYPE mood RENAME VALUE '...' TO 'ecstatic'",
        ],
    )
    .await;
    assert!(!last.contains("pgapply skip"), "{last}");
    db.target_sql("ALTER TYPE mood ADD VALUE 'ecstatic'").await;
    db.source_sql("INSERT INTO e VALUES (2, 'sad', 'too long')")
        .await;
    expect_failure(
        db.pgapply("p", &[]),
        &[
            "CHECK constraint \"short\" of domain \"public\".\"short_text\" on the target refuses the source's value for column \"d\" of",
            "ALTER DOMAIN \"public\".\"short_text\" DROP CONSTRAINT \"short\"",
        ],
    )
    .await;
    db.target_sql("ALTER DOMAIN short_text DROP CONSTRAINT short")
        .await;
    db.sync("p").await;
    db.assert_same("e").await;
    // A composite type given an attribute on the source only.
    db.both("CREATE TYPE pair AS (a int, b int); CREATE TABLE c (id int PRIMARY KEY, p pair)")
        .await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE c; ALTER TYPE pair ADD ATTRIBUTE x int")
        .await;
    db.source_sql("INSERT INTO c VALUES (1, ROW(1, 2, 3))")
        .await;
    expect_failure(
        db.pgapply("p", &[]),
        &[
            "a value of a composite type (a column of target table \"public\".\"c\", or inside one) does not fit",
            "ALTER TYPE ... ADD ATTRIBUTE",
        ],
    )
    .await;
    db.target_sql("ALTER TYPE pair ADD ATTRIBUTE x int").await;
    db.sync("p").await;
    db.assert_same("c").await;
}

/// A column dropped on the source that is NOT NULL without a default on the target: the error
/// names it and says what to change there, not to skip the transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_null_column_the_source_no_longer_sends() {
    let db = TestDb::new("dropnn").await;
    db.both("CREATE TABLE d (id int PRIMARY KEY, a text, b int NOT NULL)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE d").await;
    db.source_sql("ALTER TABLE d DROP COLUMN b").await;
    db.source_sql("INSERT INTO d VALUES (1, 'x')").await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &[
            "column \"b\" of target table \"public\".\"d\" is NOT NULL without a default",
            "SET DEFAULT",
        ],
    )
    .await;
    assert!(!last.contains("pgapply skip"), "{last}");
}

/// PostgreSQL 15+: an UPDATE that moves a row into a publication's row filter is sent as an
/// INSERT, and a TOASTed column outside the replica identity comes without its value. Applied
/// as NULL (as PostgreSQL's own subscriber does) the target would silently differ: the error
/// names the table, the column and the way out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_moved_into_a_row_filter_without_its_toasted_value() {
    let db = TestDb::new("rftoast").await;
    if common::source_version(&db).await < 150000 {
        return common::skip("row filters need a PostgreSQL 15+ source");
    }
    db.both("CREATE TABLE rf (id int PRIMARY KEY, b text)")
        .await;
    db.source_sql("ALTER TABLE rf ALTER b SET STORAGE EXTERNAL")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE rf WHERE (id > 100)")
        .await;
    db.source_sql("INSERT INTO rf VALUES (1, repeat('x', 100000))")
        .await;
    db.source_sql("UPDATE rf SET id = 200 WHERE id = 1").await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &[
            "\"public\".\"rf\"",
            "column \"b\"",
            "row filter",
            "REPLICA IDENTITY FULL",
            "pgapply skip",
        ],
    )
    .await;
    assert!(!last.contains("protocol error"), "{last}");
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM rf").await, 0);
}

/// A row for a partition only the source has (published through the root into a partitioned
/// target): the error says to create the partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_missing_on_the_target() {
    if common::clusters().source_major < 13 {
        common::skip("publish_via_partition_root needs PostgreSQL 13");
        return;
    }
    let db = TestDb::new("nopart").await;
    db.both(
        "CREATE TABLE m (id int, at int, PRIMARY KEY (id, at)) PARTITION BY RANGE (at); \
         CREATE TABLE m_1 PARTITION OF m FOR VALUES FROM (0) TO (100);",
    )
    .await;
    db.source_sql("CREATE TABLE m_2 PARTITION OF m FOR VALUES FROM (100) TO (200)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE m WITH (publish_via_partition_root = true)")
        .await;
    db.source_sql("INSERT INTO m VALUES (1, 150)").await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &[
            "no partition of target table \"public\".\"m\"",
            "create the partition",
        ],
    )
    .await;
    assert!(!last.contains("pgapply skip"), "{last}");
}

/// The same for a length: a value longer than the target's varchar(n) names that column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_too_long_for_target_column() {
    let db = TestDb::new("toolong").await;
    db.source_sql("CREATE TABLE w (id int PRIMARY KEY, code varchar(5), name varchar(20))")
        .await;
    db.target_sql("CREATE TABLE w (id int PRIMARY KEY, code varchar(5), name varchar(8))")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE w").await;
    db.source_sql("INSERT INTO w VALUES (1, 'ab', 'a name far too long')")
        .await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &["column \"name\" (character varying(8))", "\"public\".\"w\""],
    )
    .await;
    assert!(!last.contains("pgapply skip"), "{last}");
    assert!(!last.contains("\"code\""), "{last}");
}

/// TRUNCATE .. CASCADE on the source: the message lists every published table the cascade
/// reached, and a target-only table that references one of them is not emptied behind the
/// user's back; the apply stops and says what to do instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_does_not_cascade_to_target_only_tables() {
    if common::clusters().source_major < 11 {
        common::skip("TRUNCATE is replicated from PostgreSQL 11");
        return;
    }
    let db = TestDb::new("trunc_fk").await;
    db.both("CREATE TABLE parent (id int PRIMARY KEY)").await;
    db.target_sql(
        "CREATE TABLE notes (id int PRIMARY KEY, parent_id int REFERENCES parent); \
         INSERT INTO parent VALUES (1); INSERT INTO notes VALUES (1, 1);",
    )
    .await;
    db.source_sql("INSERT INTO parent VALUES (1)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE parent").await;
    db.source_sql("TRUNCATE parent CASCADE").await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &[
            "TRUNCATE on table \"public\".\"parent\"",
            "does not cascade",
        ],
    )
    .await;
    assert!(!last.contains("pgapply skip"), "{last}");
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM notes").await,
        1,
        "the target-only table was emptied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password() {
    let db = TestDb::new("badpw").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let user = format!("app_{}", db.name);
    db.source_sql(&format!(
        "CREATE ROLE {user} LOGIN REPLICATION PASSWORD 'right-secret'"
    ))
    .await;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    cmd.arg("run")
        .arg("--source")
        .arg(format!(
            "host=127.0.0.1 port={} user={user} password=wrong-secret dbname={}",
            db.source_port, db.name
        ))
        .arg("--target")
        .arg(db.target_conninfo())
        .args(["--publication", "p", "--slot", &db.slot()])
        .kill_on_drop(true);
    let line = expect_failure(cmd, &["password authentication failed", &user]).await;
    assert!(!line.contains("wrong-secret"), "password leaked: {line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_from_environment_and_scram() {
    let db = TestDb::new("envpw").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let user = format!("scram_{}", db.name);
    db.source_sql(&format!(
        "SET password_encryption = 'scram-sha-256'; CREATE ROLE {user} LOGIN REPLICATION PASSWORD 's3cret'; GRANT SELECT ON t TO {user};"
    ))
    .await;
    db.source_sql("INSERT INTO t VALUES (1), (2)").await;
    let endpos = db.source_wal().await;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    cmd.arg("run")
        .arg("--source")
        .arg(format!(
            "host=127.0.0.1 port={} user={user} dbname={}",
            db.source_port, db.name
        ))
        .arg("--target")
        .arg(db.target_conninfo())
        .args([
            "--publication",
            "p",
            "--slot",
            &db.slot(),
            "--endpos",
            &endpos,
        ])
        .env("PGPASSWORD", "s3cret")
        .kill_on_drop(true);
    let out = run_with_deadline(cmd, 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("s3cret"), "password leaked: {err}");
    db.assert_same("t").await;

    // The same password from --source-password-file (a secrets file ends with a newline).
    let file = std::env::temp_dir().join(format!("pgapply-test-{}.password", db.name));
    std::fs::write(&file, "s3cret\n").unwrap();
    db.source_sql("INSERT INTO t VALUES (3)").await;
    let endpos = db.source_wal().await;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    cmd.arg("run")
        .arg("--source")
        .arg(format!(
            "host=127.0.0.1 port={} user={user} dbname={}",
            db.source_port, db.name
        ))
        .arg("--source-password-file")
        .arg(&file)
        .arg("--target")
        .arg(db.target_conninfo())
        .args([
            "--publication",
            "p",
            "--slot",
            &db.slot(),
            "--endpos",
            &endpos,
        ])
        .env_remove("PGPASSWORD")
        .kill_on_drop(true);
    let out = run_with_deadline(cmd, 60).await;
    let _ = std::fs::remove_file(&file);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("s3cret"), "password leaked: {err}");
    db.assert_same("t").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn features_the_source_lacks_and_bad_values_are_refused() {
    let db = TestDb::new("refused").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let version: i32 = db
        .source
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    if version < 140000 {
        expect_failure(
            db.pgapply("p", &["--streaming", "parallel"]),
            &["--streaming parallel needs a PostgreSQL 14"],
        )
        .await;
    } else if version < 160000 {
        // 14 and 15 stream as with `on`, as PostgreSQL's own subscriber does.
        let endpos = db.source_wal().await;
        let out = run_with_deadline(
            db.pgapply("p", &["--streaming", "parallel", "--endpos", &endpos]),
            30,
        )
        .await;
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("with --streaming on instead"),
            "{}",
            stderr(&out)
        );
    }
    if version < 150000 {
        expect_failure(
            db.pgapply("p", &["--two-phase"]),
            &["--two-phase needs a PostgreSQL 15"],
        )
        .await;
    }
    // `check` says what `run` would refuse.
    if version < 170000 {
        let (option, needs): (&[&str], &str) = if version < 160000 {
            (&["--origin", "none"], "--origin none needs a PostgreSQL 16")
        } else {
            (
                &["--failover-slot"],
                "--failover-slot needs a PostgreSQL 17",
            )
        };
        let slot = db.slot();
        let mut args = vec!["--slot", slot.as_str()];
        args.extend_from_slice(option);
        let out = run_with_deadline(db.on_both("check", &args), 60).await;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(!out.status.success(), "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("PROBLEM") && l.contains(needs)),
            "{text}"
        );
    }
    // `check --binary` says when values will arrive as text instead (here: an enum column).
    db.both("CREATE TYPE mood AS ENUM ('ok'); CREATE TABLE e (id int PRIMARY KEY, m mood)")
        .await;
    db.source_sql("ALTER PUBLICATION p ADD TABLE e").await;
    let slot = db.slot();
    let out = run_with_deadline(db.on_both("check", &["--slot", &slot, "--binary"]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let said = if version < 140000 {
        "--binary needs a PostgreSQL 14 or later source"
    } else {
        "--binary: values arrive in text form for every table, as "
    };
    assert!(
        text.lines()
            .any(|l| l.starts_with("WARNING") && l.contains(said)),
        "{text}"
    );
    expect_failure(
        db.pgapply("p", &["--endpos", "zz"]),
        &["--endpos", "invalid LSN"],
    )
    .await;
    expect_failure(
        db.pgapply("p", &["--origin", "sometimes"]),
        &["origin \"sometimes\""],
    )
    .await;
    expect_failure(
        db.pgapply("p", &["--apply-workers", "0"]),
        &["apply_workers is 0", "from 1 to 64"],
    )
    .await;
    expect_failure(
        db.pgapply("p", &["--apply-workers", "2", "--two-phase"]),
        &["--two-phase and --apply-workers above 1"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn md5_user_and_target_role_without_origin_rights() {
    let db = TestDb::new("md5").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let user = format!("md5_{}", db.name);
    db.source_sql(&format!(
        "SET password_encryption = 'md5'; CREATE ROLE {user} LOGIN REPLICATION PASSWORD 'md5-secret'; GRANT SELECT ON t TO {user};"
    ))
    .await;
    // A plain target role: may write the table and create pgapply's schema, not use origins.
    let writer = format!("writer_{}", db.name);
    db.target_sql(&format!(
        "SET password_encryption = 'scram-sha-256'; CREATE ROLE {writer} LOGIN PASSWORD 'w-secret'; \
         GRANT INSERT, UPDATE, DELETE, SELECT ON t TO {writer}; GRANT CREATE ON DATABASE {} TO {writer};",
        db.name
    ))
    .await;
    db.source_sql("INSERT INTO t VALUES (1, 'a'), (2, 'b'); UPDATE t SET v = 'c' WHERE id = 1;")
        .await;
    let endpos = db.source_wal().await;
    // pgapply as the md5 source user and the plain target role.
    let as_plain_roles_do = |what: &str, extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
        cmd.arg(what)
            .arg("--source")
            .arg(format!(
                "host=127.0.0.1 port={} user={user} password=md5-secret dbname={}",
                db.source_port, db.name
            ))
            .arg("--target")
            .arg(format!(
                "postgres://{writer}:w-secret@127.0.0.1:{}/{}",
                db.target_port, db.name
            ))
            .args(["--publication", "p", "--slot", &db.slot()])
            .args(extra)
            .kill_on_drop(true);
        cmd
    };
    let as_plain_roles = |extra: &[&str]| as_plain_roles_do("run", extra);
    let cmd = as_plain_roles(&["--endpos", &endpos]);
    let out = run_with_deadline(cmd, 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("pgapply.progress"),
        "falls back to the progress table: {err}"
    );
    assert!(
        !err.contains("md5-secret") && !err.contains("w-secret"),
        "password leaked: {err}"
    );
    db.assert_same("t").await;
    let recorded: Option<String> = db
        .target
        .query_one("SELECT lsn::text FROM pgapply.progress", &[])
        .await
        .unwrap()
        .get(0);
    assert!(recorded.is_some(), "the position is in the table");
    // Parallel workers need origins: refused with what to do.
    expect_failure(
        as_plain_roles(&["--apply-workers", "2", "--max-retries", "1"]),
        &[
            "--apply-workers above 1",
            "replication origins",
            "--apply-workers 1",
        ],
    )
    .await;
    // And `check` says so before a run does.
    let out = run_with_deadline(as_plain_roles_do("check", &["--apply-workers", "2"]), 60).await;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("--apply-workers above 1 records progress in replication origins"),
        "{text}"
    );
}

/// Settings that are wrong in themselves: exit 2 ("nothing was started"), one line naming the
/// setting, before any server is contacted (the servers named here do not exist), and never a
/// panic or a password echoed back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_settings_exit_2_before_connecting() {
    let run = |extra: &[&str], source: &str| {
        let mut args = vec![
            "run",
            "--source",
            source,
            "--target",
            "host=no-such-host.invalid",
            "--publication",
            "p",
            "--slot",
            "s",
        ];
        args.extend_from_slice(extra);
        common::pgapply_command(&args)
    };
    let cases: Vec<(Command, &[&str])> = vec![
        (
            run(
                &["--max-retries", "1", "--retry-min", "10ms"],
                "postgres://u@no-such-host.invalid/db?sslrootcert=%aé%zz&password=hunter2",
            ),
            &["exit 2"],
        ),
        (
            run(&[], "host=h port=abc password=hunter2"),
            &["--source", "port"],
        ),
        (run(&[], "host=h passfile=/p"), &["passfile", "PGPASSFILE"]),
        (
            run(&["--metrics-addr", "9187"], "host=h"),
            &["--metrics-addr", "HOST:PORT"],
        ),
        (
            common::pgapply_command(&[
                "schema",
                "--source",
                "host=no-such-host.invalid",
                "--target",
                "host=no-such-host.invalid",
                "--publication",
                "p",
                "--section",
                "typo",
            ]),
            &["--section", "pre-data"],
        ),
        (
            common::pgapply_command(&[
                "cutover",
                "--source",
                "host=no-such-host.invalid",
                "--target",
                "host=no-such-host.invalid",
                "--publication",
                "p",
                "--slot",
                "s",
                "--endpos",
                "0/1",
            ]),
            &["--endpos", "cutover"],
        ),
        (
            common::pgapply_command(&[
                "run",
                "--source",
                "host=no-such-host.invalid",
                "--target",
                "host=no-such-host.invalid",
                "--publication",
                "p",
                "--slot",
                "My-Slot",
            ]),
            &["slot name \"My-Slot\" is not valid"],
        ),
        (
            run(&["--copy-jobs", "100000"], "host=h"),
            &["copy_jobs is 100000", "from 1 to 64"],
        ),
        (
            run(&[], "host=h password=hunter2 b=c"),
            &["--source", "single quotes"],
        ),
        (
            common::pgapply_command(&[
                "cutover",
                "--source",
                "host=no-such-host.invalid",
                "--target",
                "host=no-such-host.invalid",
                "--publication",
                "p",
                "--slot",
                "s",
                "--timeout",
                "300000000000y",
            ]),
            &["--timeout", "ten years"],
        ),
        (
            // A bad value from the environment: the variable is named, not only the flag.
            {
                let mut c = run(&[], "host=h");
                c.env("PGAPPLY_STATUS_INTERVAL", "5");
                c
            },
            &["environment variable PGAPPLY_STATUS_INTERVAL"],
        ),
        (
            // Also for a flag whose value may be left out (`--create-slot[=on|off]`).
            {
                let mut c = run(&[], "host=h");
                c.env("PGAPPLY_CREATE_SLOT", "maybe");
                c
            },
            &["environment variable PGAPPLY_CREATE_SLOT"],
        ),
    ];
    for (cmd, needles) in cases {
        let out = run_with_deadline(cmd, 30).await;
        let err = stderr(&out);
        assert!(!err.contains("hunter2"), "password echoed:\n{err}");
        assert!(!err.contains("panicked"), "panic:\n{err}");
        if needles == ["exit 2"] {
            // (A malformed escape in a URL: refused or taken as written, never a panic.)
            assert!(out.status.code() != Some(101), "{err}");
            continue;
        }
        assert_eq!(out.status.code(), Some(2), "{err}");
        // (A value the command line parser refuses: its message, then a line about --help.)
        let last = match err.lines().last().unwrap_or_default() {
            l if l.starts_with("For more information") => err.as_str(),
            l => l,
        };
        for needle in needles {
            assert!(last.contains(needle), "{needle:?} not in {last:?}");
        }
    }
}

/// Progress in `pgapply.progress` (a target role without origin rights): a previous run's
/// session still finishing a transaction it was sent (here: one holding the slot's lock, its
/// transaction applied and its position recorded but not committed yet) must be waited for and
/// seen, or the new run applies that transaction a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_mode_waits_for_a_previous_session_still_committing() {
    let db = TestDb::new("tblwait").await;
    db.both("CREATE TABLE h (v int); ALTER TABLE h REPLICA IDENTITY FULL;")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE h").await;
    let writer = format!("w_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {writer} LOGIN PASSWORD 'w-secret'; GRANT INSERT, UPDATE, DELETE, SELECT ON h TO {writer}; \
         GRANT CREATE ON DATABASE {} TO {writer};",
        db.name
    ))
    .await;
    let target = format!(
        "host=127.0.0.1 port={} user={writer} password=w-secret dbname={}",
        db.target_port, db.name
    );
    let run = |endpos: &str| {
        db.pgapply_via(
            &db.source_conninfo(),
            &target,
            &db.slot(),
            "p",
            &["--endpos", endpos],
        )
    };
    db.source_sql("INSERT INTO h VALUES (1)").await;
    let out = run_with_deadline(run(&db.source_wal().await), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("pgapply.progress"),
        "{}",
        stderr(&out)
    );

    db.source_sql("INSERT INTO h VALUES (2)").await;
    let endpos = db.source_wal().await;
    // The "previous session": has applied the transaction, not yet recorded its position.
    let old = common::connect(db.target_port, &db.name).await;
    let key = "('x' || left(md5('pgapply progress ' || $1), 16))::bit(64)::bigint";
    old.batch_execute("BEGIN").await.unwrap();
    old.execute(&format!("SELECT pg_advisory_lock({key})"), &[&db.slot()])
        .await
        .unwrap();
    old.batch_execute("INSERT INTO h VALUES (2)").await.unwrap();
    let mut child = run(&endpos);
    child.stdout(std::process::Stdio::null());
    child.stderr(std::process::Stdio::piped());
    let mut child = child.spawn().expect("spawn");
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let mut pipe = child.stderr.take().expect("stderr");
    let log_task = tokio::spawn({
        let log = log.clone();
        async move {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                log.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        }
    });
    // (Before the fix the new run did not wait: it applied the transaction and ended.)
    let mut exited = false;
    common::wait_for("the new run to wait for the previous session", 60, || {
        exited = exited || child.try_wait().ok().flatten().is_some();
        let exited = exited;
        let db = &db;
        let writer = &writer;
        async move {
            exited
                || db
                    .count(
                        &db.target,
                        &format!(
                            "SELECT count(*) FROM pg_stat_activity WHERE usename = '{writer}' \
                             AND query LIKE '%pg_try_advisory_lock%'"
                        ),
                    )
                    .await
                    > 0
        }
    })
    .await;
    // Said while it waits, with the session that holds the lock.
    let old_pid: i32 = old
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    common::wait_for("the wait to be said", 30, || {
        let said = log
            .lock()
            .unwrap()
            .lines()
            .any(|l| l.contains(&format!("(process {old_pid}) holds this slot's apply lock")));
        async move { said }
    })
    .await;
    old.execute(
        "UPDATE pgapply.progress SET lsn = $2::text::pg_lsn WHERE slot_name = $1",
        &[&db.slot(), &endpos],
    )
    .await
    .unwrap();
    old.batch_execute("COMMIT").await.unwrap();
    old.execute(&format!("SELECT pg_advisory_unlock({key})"), &[&db.slot()])
        .await
        .unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(90), child.wait())
        .await
        .expect("pgapply did not finish")
        .expect("wait");
    let _ = log_task.await;
    let text = log.lock().unwrap().clone();
    assert!(status.success(), "{text}");
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM h WHERE v = 2")
            .await,
        1,
        "applied twice:\n{text}"
    );
    db.assert_same("h").await;
}

/// A source whose WAL ends before what the target applied from it (a standby that was behind and
/// was promoted, a restore from a backup: same system identifier) is refused: streaming from
/// there would skip its transactions below that position without a word. Here the target's
/// position is moved past the source's end by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_behind_the_targets_position_is_refused() {
    let db = TestDb::new("behind").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.target_sql("UPDATE pgapply.progress SET lsn = 'FF/0'")
        .await;
    let last = expect_failure(
        db.pgapply("p", &[]),
        &[
            "FF/0",
            "but the WAL of the source reached (127.0.0.1:",
            "an old primary started again after a failover",
            "--copy-data --truncate-target",
        ],
    )
    .await;
    assert!(!last.contains("panicked"), "{last}");
    // `check` says so too.
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("up to FF/0, but the source's WAL ends at"),
        "{said}"
    );
    // A later timeline recorded than the source's own (an old primary back): both refuse.
    db.target_sql("UPDATE pgapply.progress SET lsn = '0/1', source_timeline = 7")
        .await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains(
            "applied changes of the source's timeline 7, but this source is on timeline 1"
        ),
        "{said}"
    );
    expect_failure(
        db.pgapply("p", &[]),
        &["whose history does not go through timeline 7"],
    )
    .await;
}

/// Replication origins belong to the whole target cluster: a second database of that cluster
/// replicated under a slot name another database uses is refused, naming that database, instead
/// of sharing (and corrupting) its position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_name_used_by_another_database_of_the_target_cluster_is_refused() {
    let a = TestDb::new("claim_a").await;
    a.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    a.publish("CREATE PUBLICATION p FOR TABLE t").await;
    a.source_sql("INSERT INTO t VALUES (1)").await;
    a.sync("p").await;
    let b = TestDb::new("claim_b").await;
    b.target_sql("CREATE TABLE t (id int PRIMARY KEY)").await;
    let endpos = a.source_wal().await;
    let last = expect_failure(
        a.pgapply_via(
            &a.source_conninfo(),
            &b.target_conninfo(),
            &a.slot(),
            "p",
            &["--endpos", &endpos],
        ),
        &[
            &format!("slot name \"{}\" is already used", a.slot()),
            &format!("database \"{}\"", a.name),
            "another --slot",
        ],
    )
    .await;
    assert!(!last.contains("panicked"), "{last}");
    // check says so too.
    let check = common::pgapply_command(&[
        "check",
        "--source",
        &a.source_conninfo(),
        "--target",
        &b.target_conninfo(),
        "--slot",
        &a.slot(),
        "--publication",
        "p",
    ]);
    let out = run_with_deadline(check, 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "is already used by pgapply in database \"{}\"",
            a.name
        )),
        "{text}"
    );
    // The first database's own runs go on.
    a.source_sql("INSERT INTO t VALUES (2)").await;
    a.sync("p").await;
    a.assert_same("t").await;
}

/// A target role given the schema pgapply (its owner), without CREATE on the database, runs:
/// the schema is not created again (CREATE SCHEMA IF NOT EXISTS asks for that right first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_given_the_pgapply_schema_needs_no_create_on_the_database() {
    let db = TestDb::new("schemaowner").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let role = format!("owner_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'o'; CREATE SCHEMA pgapply AUTHORIZATION {role}; \
         GRANT ALL ON t TO {role}; REVOKE CREATE ON DATABASE {} FROM PUBLIC;",
        db.name
    ))
    .await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_as_target_user(&role, "o", &["--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("t").await;
}

/// A slot that cannot serve the run's two-phase or worker settings is named by `check` as by
/// `run`: one made without two-phase support for --two-phase, and a two-phase one for
/// --apply-workers above 1 (it sends prepared transactions, which one connection applies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_slot_that_does_not_fit_two_phase_or_several_workers() {
    let db = TestDb::new("slotfit").await;
    if common::source_version(&db).await < 150000 {
        common::skip("--two-phase needs a PostgreSQL 15 source");
        return;
    }
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let slot = db.slot();
    let db = &db;
    let check = |extra: &'static [&'static str]| {
        let slot = slot.clone();
        async move {
            let mut args = vec!["--slot", slot.as_str()];
            args.extend_from_slice(extra);
            let out = run_with_deadline(db.on_both("check", &args), 60).await;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            (out.status.code(), text)
        }
    };
    // Without two-phase support (as `publish` made it).
    let (code, text) = check(&["--two-phase"]).await;
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("was created without two-phase support, which --two-phase needs"),
        "{text}"
    );
    expect_failure(
        db.pgapply("p", &["--two-phase"]),
        &["was created without two-phase support"],
    )
    .await;
    let (code, text) = check(&["--apply-workers", "2"]).await;
    assert!(!text.contains("two-phase support"), "{text}");
    assert_eq!(code, Some(0), "{text}");
    // With it.
    db.source_sql(&format!("SELECT pg_drop_replication_slot('{slot}')"))
        .await;
    db.source_sql(&format!(
        "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput', false, true)"
    ))
    .await;
    let (code, text) = check(&["--apply-workers", "2"]).await;
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("was created with two-phase support")
            && text.contains("use --apply-workers 1"),
        "{text}"
    );
    db.source_sql(&format!("SELECT pg_drop_replication_slot('{slot}')"))
        .await;
}

/// A target role whose sessions are read-only by default (as `cutover --freeze-writes` leaves the
/// roles it froze) is named with the way to undo it, not "cannot execute CREATE SCHEMA in a
/// read-only transaction" with advice about rights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_target_role_is_named_with_the_way_back() {
    let db = TestDb::new("readonly").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let role = format!("frozen_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN SUPERUSER PASSWORD 'f'; \
         ALTER ROLE {role} SET default_transaction_read_only = on;"
    ))
    .await;
    let out = expect_failure(
        db.pgapply_as_target_user(&role, "f", &[]),
        &[
            "read-only by default",
            &format!("set for role \"{role}\""),
            &format!(
                "BEGIN READ WRITE; ALTER ROLE \"{role}\" RESET default_transaction_read_only; COMMIT;"
            ),
        ],
    )
    .await;
    assert!(!out.contains("needs CREATE"), "{out}");
    // Set for the database instead: said so, with the way back there.
    db.target_sql(&format!(
        "ALTER ROLE {role} RESET default_transaction_read_only; \
         ALTER DATABASE {} SET default_transaction_read_only = on",
        db.name
    ))
    .await;
    expect_failure(
        db.pgapply_as_target_user(&role, "f", &[]),
        &[
            &format!("set for database \"{}\"", db.name),
            &format!(
                "BEGIN READ WRITE; ALTER DATABASE \"{}\" RESET default_transaction_read_only; COMMIT;",
                db.name
            ),
        ],
    )
    .await;
    db.target_sql(&format!(
        "ALTER DATABASE {} RESET default_transaction_read_only",
        db.name
    ))
    .await;
    db.target_sql(&format!("DROP ROLE {role}")).await;
}

/// `check` as a target role that lacks some rights and meets row-level security: each is named,
/// with the GRANT (or ALTER ROLE) for that role, as `run` would fail on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_missing_rights_and_row_security_on_the_target() {
    let db = TestDb::new("checkrights").await;
    db.both(
        "CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY); \
         CREATE TABLE c (id int PRIMARY KEY, v text); CREATE TABLE d (id int PRIMARY KEY, v text)",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE a, b, c, d")
        .await;
    let role = format!("limited_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'l'; GRANT CREATE ON DATABASE {} TO {role}; \
         GRANT SELECT, DELETE ON a TO {role}; GRANT SELECT, INSERT, UPDATE, DELETE ON b TO {role}; \
         ALTER TABLE b ENABLE ROW LEVEL SECURITY; \
         GRANT SELECT (id, v), INSERT (id, v), UPDATE (id, v), DELETE ON c TO {role}; \
         GRANT SELECT, INSERT (id), UPDATE, DELETE ON d TO {role};",
        db.name
    ))
    .await;
    let out = run_with_deadline(
        db.on_both_as_target_user("check", &role, "l", &["--slot", &db.slot()]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains(&format!(
            "the target role may not INSERT, UPDATE on \"public\".\"a\": GRANT INSERT, UPDATE ON \"public\".\"a\" TO \"{role}\""
        )),
        "{text}"
    );
    // Column rights count when every published column has them.
    assert!(!text.contains("on \"public\".\"c\""), "{text}");
    assert!(
        text.contains(&format!(
            "the target role may not INSERT on \"public\".\"d\": GRANT INSERT ON \"public\".\"d\" TO \"{role}\""
        )),
        "{text}"
    );
    assert!(
        text.contains("target table \"public\".\"b\" has row-level security")
            && text.contains(&format!("ALTER ROLE \"{role}\" BYPASSRLS")),
        "{text}"
    );
    db.target_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await;
}

/// `check` on tables that changed on the source: a new column is to be added with the source's
/// default and NOT NULL (or the rows already there differ), a renamed column or table is to be
/// renamed (an added one would be empty), and a narrower type on the target is a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_gives_the_fix_that_keeps_the_rows() {
    let db = TestDb::new("checkfix").await;
    db.source_sql(
        "CREATE TABLE t (id int PRIMARY KEY, g int NOT NULL DEFAULT 5, n bigint, d2 text, \
                         at timestamptz DEFAULT current_timestamp); \
         CREATE TABLE u2 (id int PRIMARY KEY);",
    )
    .await;
    db.target_sql(
        "CREATE TABLE t (id int PRIMARY KEY, n int, d text); CREATE TABLE u (id int PRIMARY KEY);",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t, u2").await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    for expected in [
        "ALTER TABLE \"public\".\"t\" ADD COLUMN \"g\" integer DEFAULT 5 NOT NULL (as on the source, the default fills the rows already there; if the target had this column and dropped it, their values are the source's, not the default",
        "rename it on the target instead (ALTER TABLE \"public\".\"t\" RENAME COLUMN \"d\" TO \"d2\")",
        "WARNING  column \"n\" of \"public\".\"t\" is bigint on the source but integer on the target, which refuses the source's values that do not fit",
        "table \"public\".\"u2\" does not exist on the target: if the source renamed it, rename it on the target too",
        "(the source's default, CURRENT_TIMESTAMP, computes each row's value",
    ] {
        assert!(text.contains(expected), "{expected:?} not in:\n{text}");
    }
}

/// A listener on 127.0.0.1 that accepts connections and, if given, writes `answer` on each: then
/// keeps them open, saying nothing more. Its port, and how many connections it took.
async fn fake_server(
    answer: Option<&'static [u8]>,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut socket, _)) = listener.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if let Some(answer) = answer {
                let _ = socket.write_all(answer).await;
            }
            held.push(socket);
        }
    });
    (port, accepted)
}

/// A source or target that accepts the connection and then says nothing (a stopped server, say)
/// is given up after connect_timeout, not waited for without a word; one that is not PostgreSQL
/// is named as such; and a stop asked while connecting ends the run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_or_is_not_postgresql_is_named() {
    let db = TestDb::new("silentpeer").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let (silent, accepted) = fake_server(None).await;
    let peer =
        |port: u16| format!("host=127.0.0.1 port={port} user=postgres dbname=x connect_timeout=2");
    let retries = ["--max-retries", "1", "--retry-min", "100ms"];
    let err = expect_failure(
        db.pgapply_via(
            &peer(silent),
            &db.target_conninfo(),
            &db.slot(),
            "p",
            &retries,
        ),
        &[
            "source",
            "did not complete the PostgreSQL handshake within 2s",
        ],
    )
    .await;
    assert!(!err.contains("panicked"), "{err}");
    expect_failure(
        db.pgapply_via(
            &db.source_conninfo(),
            &peer(silent),
            &db.slot(),
            "p",
            &retries,
        ),
        &[
            "target",
            "did not complete the PostgreSQL handshake within 2s (connect_timeout 2s per host and address)",
        ],
    )
    .await;
    let (http, _) = fake_server(Some(b"HTTP/1.1 400 Bad Request\r\n\r\n")).await;
    for sslmode in ["prefer", "disable"] {
        let source = format!("{} sslmode={sslmode}", peer(http));
        expect_failure(
            db.pgapply_via(&source, &db.target_conninfo(), &db.slot(), "p", &retries),
            &[
                "does not answer as a PostgreSQL server does",
                "check the host and port",
            ],
        )
        .await;
    }
    // SIGTERM while connecting (for up to a minute) stops at once, cleanly.
    let slow = format!("host=127.0.0.1 port={silent} user=postgres dbname=x connect_timeout=60");
    let before = accepted.load(std::sync::atomic::Ordering::SeqCst);
    let mut child =
        common::spawn(db.pgapply_via(&slow, &db.target_conninfo(), &db.slot(), "p", &[]));
    // Waiting for the source's answer.
    common::wait_for("pgapply to reach the source", 30, || async {
        accepted.load(std::sync::atomic::Ordering::SeqCst) > before
    })
    .await;
    let pid = child.id().unwrap();
    let started = Instant::now();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait())
        .await
        .expect("pgapply stopped")
        .unwrap();
    assert_eq!(status.code(), Some(0), "a clean stop");
    assert!(
        started.elapsed().as_secs() < 10,
        "took {:?}",
        started.elapsed()
    );
}

/// `check` tries what `run` would need of this machine: a spool directory it cannot make is a
/// problem; a metrics address in use now is said (it may be this slot's running worker's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_tries_the_spool_directory_and_the_metrics_address() {
    let db = TestDb::new("checklocal").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    // And an unlogged table, which no publication takes: named for a migration.
    db.source_sql("CREATE UNLOGGED TABLE scratch (id int)")
        .await;
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let slot = db.slot();
    let args = [
        "--slot",
        &slot,
        "--spool-dir",
        "/proc/pgapply-spool",
        "--metrics-addr",
        &addr,
    ];
    let out = run_with_deadline(db.on_both("check", &args), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    for expected in [
        "PROBLEM  --spool-dir /proc/pgapply-spool: cannot create a directory in /proc",
        &format!("WARNING  --metrics-addr {addr}: in use now, so `run` would stop at its start"),
        "WARNING  unlogged table(s) on the source: public.scratch: PostgreSQL replicates no unlogged table",
    ] {
        assert!(text.contains(expected), "{expected:?} not in:\n{text}");
    }
    // A spool directory that can be made is not made by `check`.
    let spool = std::env::temp_dir().join(format!("pgapply-check-spool-{}", std::process::id()));
    drop(held);
    let spool_arg = spool.to_string_lossy().to_string();
    let args = [
        "--slot",
        &slot,
        "--spool-dir",
        &spool_arg,
        "--metrics-addr",
        &addr,
    ];
    let out = run_with_deadline(db.on_both("check", &args), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(!spool.exists());
}

/// SIGINT or SIGTERM ends a one-shot command where it is, also while it waits for a server
/// that does not answer, with the shell's code for it (128 + the signal) and a line that says
/// it did not finish; and stderr that cannot be written is no panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_commands_stop_on_a_signal() {
    let (silent, accepted) = fake_server(None).await;
    let server = format!("host=127.0.0.1 port={silent} user=postgres dbname=x connect_timeout=60");
    for (command, sig, code) in [
        ("verify", libc::SIGINT, 130),
        ("status", libc::SIGINT, 130),
        ("check", libc::SIGTERM, 143),
    ] {
        let mut args = vec![command, "--target", &server];
        if command != "status" {
            args.extend(["--source", &server, "--publication", "p"]);
        }
        if command != "verify" {
            args.extend(["--slot", "s"]);
        }
        let before = accepted.load(std::sync::atomic::Ordering::SeqCst);
        let (child, log) = common::spawn_logged(common::pgapply_command(&args));
        common::wait_for("pgapply to reach the server", 30, || async {
            accepted.load(std::sync::atomic::Ordering::SeqCst) > before
        })
        .await;
        let started = Instant::now();
        common::signal(&child, sig);
        let out =
            tokio::time::timeout(std::time::Duration::from_secs(20), child.wait_with_output())
                .await
                .expect("pgapply stopped")
                .unwrap();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(out.status.code(), Some(code), "{command}: {text}");
        assert!(
            started.elapsed().as_secs() < 10,
            "{command}: {:?}",
            started.elapsed()
        );
        assert!(text.contains("interrupted by SIG"), "{command}: {text}");
    }
    // stderr full: the error is lost, the exit code is still the error's (not a panic's 101).
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = run_with_deadline(
        {
            let mut cmd = common::pgapply_command(&[
                "status",
                "--target",
                "host=127.0.0.1 port=1 user=x dbname=x",
            ]);
            cmd.stderr(full);
            cmd
        },
        30,
    )
    .await;
    assert_eq!(out.status.code(), Some(3));
}

/// A misspelt log level is refused, not taken as a module name that would silence every line,
/// errors included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misspelt_log_level_is_refused() {
    for (args, env) in [
        (vec!["--log-level", "warning", "status"], None),
        (vec!["status"], Some("verbose")),
    ] {
        let mut cmd = common::pgapply_command(&args);
        cmd.env_remove("PGAPPLY_LOG_LEVEL");
        match env {
            Some(v) => cmd.env("RUST_LOG", v),
            None => cmd.env_remove("RUST_LOG"),
        };
        let out = run_with_deadline(cmd, 30).await;
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("is not a log level: use one of trace, debug, info, warn"),
            "{}",
            stderr(&out)
        );
    }
    // Any other word that names no module that logs (a misspelt level) is refused too; a
    // module that logs stays a valid directive.
    for (level, refused) in [("inof", true), ("info,warnn", true), ("pgapply", false)] {
        let mut cmd = common::pgapply_command(&["--log-level", level, "status"]);
        cmd.env_remove("PGAPPLY_LOG_LEVEL").env_remove("RUST_LOG");
        let out = run_with_deadline(cmd, 30).await;
        assert_eq!(
            stderr(&out).contains("is neither a log level nor a module that logs"),
            refused,
            "{level}: {}",
            stderr(&out)
        );
        if refused {
            assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        }
    }
    // Asked for JSON lines, the error is one too.
    let mut cmd =
        common::pgapply_command(&["--log-format", "json", "--log-level", "warning", "status"]);
    cmd.env_remove("PGAPPLY_LOG_LEVEL").env_remove("RUST_LOG");
    let out = run_with_deadline(cmd, 30).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let line: serde_json::Value = serde_json::from_str(stderr(&out).trim())
        .unwrap_or_else(|e| panic!("{e}: {}", stderr(&out)));
    assert!(
        line["level"] == "ERROR"
            && line["error"]
                .as_str()
                .is_some_and(|e| e.contains("is not a log level")),
        "{line}"
    );
    // A module name alone is a directive, as in RUST_LOG elsewhere.
    let mut cmd = common::pgapply_command(&["status", "--target", "host=127.0.0.1 port=1 user=x"]);
    cmd.env_remove("PGAPPLY_LOG_LEVEL")
        .env("RUST_LOG", "pgapply");
    let out = run_with_deadline(cmd, 30).await;
    assert!(
        !stderr(&out).contains("not a log level"),
        "{}",
        stderr(&out)
    );
}

/// `check` names what the source refuses at the first change (PostgreSQL 15+): a row filter or
/// column list outside the replica identity in a publication of UPDATE and DELETE, and two
/// publications with different column lists of one table; and a column generated on the source
/// (so not published) that is a plain column on the target, never filled there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_publication_rules_the_source_would_refuse() {
    let db = TestDb::new("checkrules").await;
    if common::source_version(&db).await < 150000 {
        return common::skip("row filters and column lists need PostgreSQL 15");
    }
    db.both(
        "CREATE TABLE f (id int PRIMARY KEY, region text); \
         CREATE TABLE c (id int PRIMARY KEY, a int, b int); \
         CREATE TABLE two (id int PRIMARY KEY, x int, y int); \
         CREATE TABLE pt (id int, grp int, n int, PRIMARY KEY (id, grp)) PARTITION BY LIST (grp); \
         CREATE TABLE pt_a PARTITION OF pt FOR VALUES IN (1); \
         CREATE TABLE pt_b PARTITION OF pt FOR VALUES IN (2);",
    )
    .await;
    // Published through its root with a filter on n: the source checks each partition's own
    // identity (the root's FULL does not count); pt_b's covers it, pt_a's does not.
    db.source_sql(
        "ALTER TABLE pt REPLICA IDENTITY FULL; ALTER TABLE pt_b REPLICA IDENTITY FULL; \
         CREATE PUBLICATION r FOR TABLE pt WHERE (n < 1000) WITH (publish_via_partition_root = true);",
    )
    .await;
    db.source_sql(
        "CREATE TABLE g (id int PRIMARY KEY, a int, d int GENERATED ALWAYS AS (a * 2) STORED)",
    )
    .await;
    db.target_sql("CREATE TABLE g (id int PRIMARY KEY, a int, d int)")
        .await;
    // REPLICA IDENTITY FULL with a column list, even one of every column; and (18+) FULL over
    // a generated column the publication leaves out.
    db.both(
        "CREATE TABLE fl (id int, a int); ALTER TABLE fl REPLICA IDENTITY FULL; \
         CREATE TABLE fg (id int, a int, d int GENERATED ALWAYS AS (a * 2) STORED); \
         ALTER TABLE fg REPLICA IDENTITY FULL;",
    )
    .await;
    db.source_sql(
        "CREATE PUBLICATION p FOR TABLE f WHERE (region = 'eu'), c (a, b), two (id, x), g, fl (id, a), fg; \
         CREATE PUBLICATION q FOR TABLE two (id, y);",
    )
    .await;
    db.source_sql("INSERT INTO fl VALUES (1, 1); INSERT INTO fg VALUES (1, 1)")
        .await;
    // What check says is what the source does.
    let refused = db.source.batch_execute("UPDATE fl SET a = 2").await;
    assert!(refused.is_err(), "the source took an UPDATE of fl");
    let generated_refused = db
        .source
        .batch_execute("UPDATE fg SET a = 2")
        .await
        .is_err();
    assert_eq!(generated_refused, common::clusters().source_major >= 18);
    // A conflict policy for a table that is not published (a misspelt name): said.
    let config = std::env::temp_dir().join(format!("pgapply-{}.toml", db.name));
    std::fs::write(
        &config,
        "[tables.\"public.F\".conflicts]\ninsert_exists = \"skip\"\n",
    )
    .unwrap();
    let out = run_with_deadline(
        db.on_both(
            "check",
            &[
                "--slot",
                &db.slot(),
                "--publication",
                "p,q,r",
                "--config",
                config.to_str().unwrap(),
            ],
        ),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    for expected in [
        "the row filter of publication \"p\" on \"public\".\"f\" uses region, outside the table's replica identity",
        "the column list of publication \"p\" on \"public\".\"c\" leaves out replica identity column(s) id",
        "the publications publish different column lists of \"public\".\"two\" ((id, x) and (id, y))",
        "the row filter of publication \"r\" on \"public\".\"pt\" (published through its root) uses columns outside the replica identity of its partition(s) pt_a (n): the source checks each partition's own",
        "set it on each of them: ALTER TABLE pt_a REPLICA IDENTITY FULL;",
        "WARNING  column \"d\" of \"public\".\"g\" is generated on the source, which does not publish its values",
        "WARNING  the config file's [tables.\"public.F\"] names no table the publications publish",
        "publication \"p\" publishes \"public\".\"fl\" with a column list, and the table has REPLICA IDENTITY FULL",
    ] {
        assert!(text.contains(expected), "{expected:?} not in:\n{text}");
    }
    let generated = "publication \"p\" does not publish generated column(s) d of \"public\".\"fg\"";
    assert_eq!(
        text.contains(generated),
        common::clusters().source_major >= 18,
        "{text}"
    );
    assert!(!text.contains("pt_b ("), "{text}");
}

/// A publication dropped and created again while changes were written: a source before 18
/// stops at those changes every time, with "publication does not exist" though it exists now.
/// The error says why, and the two ways out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_created_again_says_why_the_source_stops() {
    if common::clusters().source_major >= 18 {
        return common::skip("PostgreSQL 18 skips such changes with a warning");
    }
    let db = TestDb::new("pubagain").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.sync("p").await;
    db.source_sql("DROP PUBLICATION p").await;
    db.source_sql("INSERT INTO t VALUES (2)").await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (3)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("publication \"p\" does not exist")
            && err.contains("If it exists now (dropped and created again")
            // This slot by name, dropped before copying again (a copy into the same slot
            // would stream from where it stands, and stop there again).
            && err.contains(&format!("SELECT pg_drop_replication_slot('{}')", db.slot()))
            && err.contains("then run with --create-slot --copy-data --truncate-target")
            && err.contains(&format!("pg_replication_slot_advance('{}',", db.slot())),
        "{err}"
    );
}

/// The source's own database as the target: every applied change would be published again and
/// applied once more, without end. Refused by `check` and `run`, before anything is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_database_as_the_target_is_refused() {
    let db = TestDb::new("selfloop").await;
    db.source_sql("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let source = db.source_conninfo();
    let slot = db.slot();
    let mut check = common::pgapply_command(&[
        "check",
        "--source",
        &source,
        "--target",
        &source,
        "--publication",
        "p",
        "--slot",
        &slot,
        "--create-slot",
    ]);
    check.env_remove("PGAPPLY_TARGET");
    let out = run_with_deadline(check, 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("--target is the source's own database"),
        "{text}"
    );
    let out = run_with_deadline(
        db.pgapply_via(&source, &source, &slot, "p", &["--create-slot"]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--target is the source's own database"),
        "{err}"
    );
    assert_eq!(db.count(&db.source, "SELECT count(*) FROM t").await, 1);
}

/// `check` names a slot that is not a logical pgoutput one with the way out, and a schema
/// pgapply made by another role that the target role may not use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_physical_slot_and_another_roles_schema() {
    let db = TestDb::new("checkslotkind").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql(&format!(
        "CREATE PUBLICATION p FOR TABLE t; SELECT pg_create_physical_replication_slot('{}')",
        db.slot()
    ))
    .await;
    let user = format!("chk_{}", db.name);
    db.target_sql(&format!(
        "CREATE SCHEMA pgapply; CREATE TABLE pgapply.progress (slot_name text); \
         CREATE SEQUENCE pgapply.conflicts_id_seq; \
         CREATE ROLE {user} LOGIN PASSWORD 'chk-secret'; GRANT CREATE ON DATABASE {} TO {user}; \
         GRANT ALL ON t TO {user};",
        db.name
    ))
    .await;
    let out = run_with_deadline(
        db.on_both_as_target_user("check", &user, "chk-secret", &["--slot", &db.slot()]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    for expected in [
        "is a physical slot; pgapply needs a logical one of pgoutput: SELECT pg_drop_replication_slot(",
        "may not use schema pgapply, which role",
    ] {
        assert!(text.contains(expected), "{expected:?} not in:\n{text}");
    }
    let check_again = || async {
        let out = run_with_deadline(
            db.on_both_as_target_user("check", &user, "chk-secret", &["--slot", &db.slot()]),
            60,
        )
        .await;
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    // The schema and tables granted, not the sequence: still a problem (conflict records
    // could not be numbered).
    db.target_sql(&format!(
        "GRANT USAGE, CREATE ON SCHEMA pgapply TO {user}; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA pgapply TO {user}"
    ))
    .await;
    let text = check_again().await;
    assert!(!text.contains("may keep pgapply's state"), "{text}");
    // The grants the advice gives, as given, are enough.
    let advice = text
        .split(" run GRANT ")
        .nth(1)
        .and_then(|rest| rest.split(" (the sequence").next())
        .unwrap_or_else(|| panic!("grants in: {text}"));
    db.target_sql(&format!("GRANT {advice}")).await;
    let text = check_again().await;
    assert!(text.contains("may keep pgapply's state"), "{text}");
    db.source_sql(&format!("SELECT pg_drop_replication_slot('{}')", db.slot()))
        .await;
}

/// `check` with the source role the README asks for (LOGIN REPLICATION, SELECT on the tables,
/// not a superuser) reads the publications' rules without touching schemas it may not use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_as_a_replication_role_that_is_not_a_superuser() {
    let db = TestDb::new("chkrepl").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let user = format!("repl_{}", db.name);
    db.source_sql(&format!(
        "CREATE ROLE {user} LOGIN REPLICATION PASSWORD 'r-secret'; GRANT SELECT ON t TO {user};"
    ))
    .await;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    cmd.arg("check")
        .arg("--source")
        .arg(format!(
            "host=127.0.0.1 port={} user={user} dbname={}",
            db.source_port, db.name
        ))
        .arg("--target")
        .arg(db.target_conninfo())
        .args(["--publication", "p", "--slot", &db.slot(), "--create-slot"])
        .env("PGPASSWORD", "r-secret")
        .kill_on_drop(true);
    let out = run_with_deadline(cmd, 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        !text.contains("PROBLEM"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
}

/// A slot name whose progress on the target belongs to another source: a running worker of that
/// source is not to be disturbed (only "use another slot name"); a stopped one's row may be
/// deleted, said with the statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_name_of_another_source_on_the_target() {
    let db = TestDb::new("othersrc").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.sync("p").await;
    db.target_sql("UPDATE pgapply.progress SET source_system_id = '42', state = 'stopped'")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("from another source (system identifier 42")
            && err.contains("pgapply forget --target ... --slot"),
        "{err}"
    );
    db.target_sql("UPDATE pgapply.progress SET state = 'streaming', heartbeat_at = now()")
        .await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("is in use on this target by a running worker of another source")
            && !err.contains("DELETE FROM"),
        "{err}"
    );
}

/// A role without grants on a schema pgapply another role made is told what to grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_roles_pgapply_schema_says_what_to_grant() {
    let db = TestDb::new("schemaother").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.sync("p").await;
    let role = format!("second_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 's'; GRANT ALL ON t TO {role};"
    ))
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_as_target_user(&role, "s", &["--endpos", &endpos]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("permission denied")
            && err.contains("was made by role")
            && err.contains("GRANT USAGE, CREATE ON SCHEMA pgapply"),
        "{err}"
    );
    // With no schema pgapply yet, the role lacks CREATE on the database: said, and no schema
    // of another role is blamed.
    let fresh = TestDb::new("schemanone").await;
    fresh.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    fresh.publish("CREATE PUBLICATION p FOR TABLE t").await;
    fresh
        .target_sql(&format!(
            "GRANT ALL ON t TO {role}; REVOKE CREATE ON DATABASE {} FROM PUBLIC",
            fresh.name
        ))
        .await;
    let out = run_with_deadline(
        fresh.pgapply_as_target_user(&role, "s", &["--create-slot"]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("needs CREATE on the database") && !err.contains("made by"),
        "{err}"
    );
    let out = run_with_deadline(
        fresh.on_both_as_target_user(
            "check",
            &role,
            "s",
            &["--slot", &fresh.slot(), "--create-slot"],
        ),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("may not create schema pgapply, where pgapply keeps its state"),
        "{text}"
    );
}

/// A target role without INSERT on a published table: the apply error gives the GRANT, not
/// advice to skip the transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_target_privilege_at_apply_names_the_grant() {
    let db = TestDb::new("noinsert").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let role = format!("noins_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'n'; CREATE SCHEMA pgapply AUTHORIZATION {role}; \
         GRANT SELECT, UPDATE, DELETE ON t TO {role};"
    ))
    .await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_as_target_user(&role, "n", &["--endpos", &endpos]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("permission denied")
            && err.contains("GRANT SELECT, INSERT, UPDATE, DELETE ON \"public\".\"t\" TO the role pgapply connects as")
            && !err.contains("pgapply skip"),
        "{err}"
    );
    // The initial copy likewise.
    let fresh = TestDb::new("noinsertcopy").await;
    fresh.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    fresh
        .source_sql("INSERT INTO t VALUES (1); CREATE PUBLICATION p FOR TABLE t;")
        .await;
    fresh
        .target_sql(&format!(
            "CREATE SCHEMA pgapply AUTHORIZATION {role}; GRANT SELECT, UPDATE, DELETE ON t TO {role};"
        ))
        .await;
    let endpos = fresh.source_wal().await;
    let out = run_with_deadline(
        fresh.pgapply_as_target_user(
            &role,
            "n",
            &["--copy-data", "--create-slot", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("permission denied")
            && err.contains("GRANT SELECT, INSERT, UPDATE, DELETE ON"),
        "{err}"
    );
}

/// A target column narrowed while pgapply runs (numeric to integer): the statements prepared
/// before it would take the source's 1.5 through an assignment cast and write 2; the group's check
/// sees the table changed, the run starts again with statements prepared anew, and the value is
/// refused as at a fresh start, naming the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_column_narrowed_while_running_does_not_round_values() {
    let db = TestDb::new("narrowed").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, x numeric)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1, 1.25)").await;
    let (mut worker, log) = common::spawn_logged(db.pgapply("p", &[]));
    common::wait_for("the first row", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 1
    })
    .await;
    // A column added on the target changes nothing the statements write: no restart.
    db.target_sql("ALTER TABLE t ADD COLUMN note text").await;
    db.source_sql("INSERT INTO t VALUES (0, 0.5)").await;
    common::wait_for("the row after the added column", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 2
    })
    .await;
    assert!(
        !std::fs::read_to_string(&log)
            .unwrap()
            .contains("changed on the target"),
        "restarted for a column added at the end"
    );
    db.target_sql("ALTER TABLE t ALTER COLUMN x TYPE int").await;
    db.source_sql("INSERT INTO t VALUES (2, 1.5)").await;
    db.source_sql("UPDATE t SET x = 7.7 WHERE id = 1").await;
    let status = tokio::time::timeout(std::time::Duration::from_secs(90), worker.wait())
        .await
        .expect("pgapply stops")
        .unwrap();
    let log = std::fs::read_to_string(log).unwrap();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("changed on the target while pgapply ran")
            && log.contains("invalid input syntax for type integer")
            && log.contains("column \"x\""),
        "{log}"
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM t WHERE id = 2 OR (id = 1 AND x <> 1)"
        )
        .await,
        0
    );
}

/// A source column widened (integer to bigint) and the target's fixed while pgapply runs, before
/// a value that needs it arrives: the value the old statements refuse is applied after a restart
/// that reads the table anew, instead of an error that asks to change a column already changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_column_widened_while_running_takes_the_wider_values() {
    let db = TestDb::new("widened").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, n int)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1, 1)").await;
    let (worker, log) = common::spawn_logged(db.pgapply("p", &[]));
    let worker = std::sync::Mutex::new(worker);
    db.source_sql("ALTER TABLE t ALTER COLUMN n TYPE bigint")
        .await;
    db.source_sql("INSERT INTO t VALUES (2, 2)").await;
    common::wait_for("the first rows", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 2
    })
    .await;
    db.target_sql("ALTER TABLE t ALTER COLUMN n TYPE bigint")
        .await;
    db.source_sql("INSERT INTO t VALUES (3, 9000000000)").await;
    common::wait_for("the wide value", 90, || async {
        db.count(&db.target, "SELECT count(*) FROM t WHERE n = 9000000000")
            .await
            == 1
            || worker.lock().unwrap().try_wait().ok().flatten().is_some()
    })
    .await;
    let log_text = std::fs::read_to_string(&log).unwrap();
    let mut worker = worker.into_inner().unwrap();
    assert!(
        worker.try_wait().unwrap().is_none(),
        "pgapply stopped: {log_text}"
    );
    assert!(
        log_text.contains("changed since pgapply read it"),
        "{log_text}"
    );
    db.assert_same("t").await;
    worker.start_kill().unwrap();
    let _ = worker.wait().await;
}

/// A partitioned table published through its root, REPLICA IDENTITY FULL on its partitions
/// only: `check` says the root's identity describes their changes; a run stops at the first
/// UPDATE naming the table, the root, and how to skip what was decoded before the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_without_replica_identity_is_named_by_check_and_run() {
    if common::clusters().source_major < 13 {
        common::skip("publish_via_partition_root needs PostgreSQL 13");
        return;
    }
    let db = TestDb::new("rootident").await;
    db.both(
        "CREATE TABLE r (id int, v text) PARTITION BY RANGE (id); \
         CREATE TABLE r1 PARTITION OF r FOR VALUES FROM (0) TO (100); \
         CREATE TABLE r2 PARTITION OF r FOR VALUES FROM (100) TO (200)",
    )
    .await;
    db.source_sql("ALTER TABLE r1 REPLICA IDENTITY FULL; ALTER TABLE r2 REPLICA IDENTITY FULL")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE r WITH (publish_via_partition_root = true)")
        .await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.lines().any(|l| l.starts_with("PROBLEM")
            && l.contains("publish_via_partition_root")
            && l.contains("ALTER TABLE \"public\".\"r\" REPLICA IDENTITY FULL")),
        "{text}"
    );
    db.source_sql("INSERT INTO r VALUES (5, 'a')").await;
    db.source_sql("UPDATE r SET v = 'b' WHERE id = 5").await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &db.source_wal().await]), 60).await;
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("no replica identity key")
            && err.contains("on the root as well as on its partitions")
            && err.contains("pgapply skip"),
        "{err}"
    );
}

/// A DEFERRABLE unique constraint on the target, which PostgreSQL does not check under
/// session_replication_role = replica: `check` names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_deferrable_unique_constraint_on_the_target() {
    let db = TestDb::new("deferchk").await;
    db.source_sql("CREATE TABLE d (id int PRIMARY KEY, k int)")
        .await;
    db.target_sql(
        "CREATE TABLE d (id int PRIMARY KEY, k int, CONSTRAINT d_k UNIQUE (k) DEFERRABLE)",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE d").await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.lines().any(|l| l.starts_with("WARNING")
            && l.contains("DEFERRABLE unique constraints on the target: \"public\".\"d\" (d_k)")),
        "{text}"
    );
}

/// A column renamed on the source in the middle of a transaction that writes it before and
/// after: the error says to rename it on the target and map the old name onto it; with both
/// done, the transaction applies whole, its earlier changes into the renamed column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_renamed_inside_a_transaction_is_applied_through_a_column_map() {
    let db = TestDb::new("renmid").await;
    db.both("CREATE TABLE t1 (id int PRIMARY KEY, k3 int)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t1").await;
    db.source_sql("INSERT INTO t1 VALUES (1, 1), (2, 2)").await;
    db.source_sql(
        "BEGIN; UPDATE t1 SET k3 = 100 WHERE id = 1; INSERT INTO t1 VALUES (3, 101); \
         ALTER TABLE t1 RENAME COLUMN k3 TO k4; UPDATE t1 SET k4 = 200 WHERE id = 2; \
         INSERT INTO t1 VALUES (4, 102); COMMIT",
    )
    .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let map = r#"tables."public.t1".columns."k3" = "k4""#;
    assert!(
        stderr(&out).contains("RENAME COLUMN \"k3\" TO \"k4\"") && stderr(&out).contains(map),
        "{}",
        stderr(&out)
    );
    db.target_sql("ALTER TABLE t1 RENAME COLUMN k3 TO k4").await;
    let config = std::env::temp_dir().join(format!("pgapply-renmid-{}.toml", std::process::id()));
    // The line as the error printed it.
    std::fs::write(&config, format!("{map}\n")).unwrap();
    let out = run_with_deadline(
        db.pgapply(
            "p",
            &["--endpos", &endpos, "--config", config.to_str().unwrap()],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("t1").await;
}

/// A column map onto a target column that does not exist: `check` names the mapped column, and
/// `run` says to add that one (or correct the map), not the source's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_mapped_onto_a_missing_target_column_is_named_by_its_target_name() {
    let db = TestDb::new("mapmiss").await;
    db.both("CREATE TABLE t2 (id int PRIMARY KEY, a int)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t2").await;
    db.source_sql("INSERT INTO t2 VALUES (1, 1)").await;
    let config = std::env::temp_dir().join(format!("pgapply-mapmiss-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        "[tables.\"public.t2\".columns]\na = \"x\"\nzz = \"b\"\n",
    )
    .unwrap();
    let config_arg = config.to_str().unwrap();
    let out = run_with_deadline(
        db.on_both("check", &["--slot", &db.slot(), "--config", config_arg]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(
        text.contains("column \"x\" (source column \"a\", renamed in the config file) of \"public\".\"t2\" is published but missing on the target")
            && text.contains("maps column \"zz\" of table \"public\".\"t2\", which the publications do not publish"),
        "{text}"
    );
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--endpos", &endpos, "--config", config_arg]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("(mapped to \"x\" by the config file)")
            && err.contains("ADD COLUMN \"x\" integer")
            && err.contains("or correct that column's entry under [tables]"),
        "{err}"
    );
    let _ = std::fs::remove_file(&config);
}

/// A column the source widened (numeric(20,5) to numeric(30,10)) while the target's stayed: the
/// target rounds the values without a word, so pgapply warns, naming the column and the ALTER.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_the_source_widened_is_named_while_the_target_rounds() {
    let db = TestDb::new("widened").await;
    db.both("CREATE TABLE w (id int PRIMARY KEY, n numeric(20,5))")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE w").await;
    db.source_sql("ALTER TABLE w ALTER COLUMN n TYPE numeric(30,10)")
        .await;
    db.source_sql("INSERT INTO w VALUES (1, 1.0123456789)")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("column \"n\" is numeric(30,10) on the source and numeric(20,5) on the target, which rounds the source's values without a word")
            && err.contains("ALTER COLUMN \"n\" TYPE numeric(30,10)"),
        "{err}"
    );
    // Once, though more than one session reads the table.
    assert_eq!(
        err.matches("is numeric(30,10) on the source and numeric(20,5) on the target")
            .count(),
        1,
        "{err}"
    );
}

/// A column the source made another kind of type (integer to text) while the target's stayed:
/// values that still read as integers go in, and pgapply says at once, naming the column and the
/// ALTER, that the first one that does not will stop the apply (it then does, naming it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_the_source_made_text_is_named_before_a_value_stops_the_apply() {
    let db = TestDb::new("madetext").await;
    db.both("CREATE TABLE m (id int PRIMARY KEY, v integer)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE m").await;
    db.source_sql("ALTER TABLE m ALTER COLUMN v TYPE text")
        .await;
    db.source_sql("INSERT INTO m VALUES (1, '42')").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let said = "column \"v\" is text on the source and integer on the target, which refuses the source's values it cannot read as integer";
    assert!(
        err.contains(said) && err.contains("ALTER COLUMN \"v\" TYPE text"),
        "{err}"
    );
    assert_eq!(err.matches(said).count(), 1, "{err}");
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM m WHERE id = 1 AND v = 42")
            .await,
        1
    );
    db.source_sql("INSERT INTO m VALUES (2, 'forty-two')").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("column \"v\" (integer) of target table \"public\".\"m\" does not take the source's value"),
        "{err}"
    );
}

/// A foreign key the target checks (its role may not set session_replication_role) refusing a
/// replicated row, while streaming and in the initial copy: each error says why it fires and
/// what to do, not only how to skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_the_target_checks_is_explained() {
    let db = TestDb::new("fkexplain").await;
    db.both(
        "CREATE TABLE parent (id int PRIMARY KEY); \
         CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent)",
    )
    .await;
    db.source_sql("INSERT INTO parent VALUES (1)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE parent, child")
        .await;
    let writer = format!("w_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {writer} LOGIN PASSWORD 'w-secret'; GRANT INSERT, UPDATE, DELETE, SELECT, TRUNCATE ON parent, child TO {writer}; \
         GRANT CREATE ON DATABASE {} TO {writer};",
        db.name
    ))
    .await;
    let target = format!(
        "host=127.0.0.1 port={} user={writer} password=w-secret dbname={}",
        db.target_port, db.name
    );
    // Mirrored from now on: the parent row the child refers to never came.
    db.source_sql("INSERT INTO child VALUES (1, 1)").await;
    let out = run_with_deadline(
        db.pgapply_via(
            &db.source_conninfo(),
            &target,
            &db.slot(),
            "p",
            &["--endpos", &db.source_wal().await],
        ),
        60,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("GRANT SET ON PARAMETER session_replication_role")
            && stderr(&out).contains("the target lacks the row it refers to"),
        "{}",
        stderr(&out)
    );
}

/// A source without the target's foreign key deletes a parent its replicated children still
/// refer to: the error says to drop (or not check) the target's key, not to delete the children
/// (rows the source still has); for a deferrable key too, which refuses at commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_a_target_only_foreign_key_refuses_is_explained() {
    let err = delete_refused_by_a_target_foreign_key("fkdelete", "").await;
    assert!(
        err.contains("which the source did not stop")
            && err.contains("drop that foreign key on the target")
            && err.contains("right only for rows the source does not have"),
        "{err}"
    );
    let err = delete_refused_by_a_target_foreign_key("fkdeferred", "DEFERRABLE").await;
    assert!(
        err.contains("a deferrable foreign key of the target, checked at commit")
            && err.contains("drop that foreign key on the target")
            && err.contains("Otherwise, to skip this source transaction"),
        "{err}"
    );
}

/// The run's error when a DELETE of a parent meets the target's own foreign key (`deferrable`:
/// its clause), applied by a role that may not set session_replication_role.
async fn delete_refused_by_a_target_foreign_key(prefix: &str, deferrable: &str) -> String {
    let db = TestDb::new(prefix).await;
    db.both("CREATE TABLE parent (id int PRIMARY KEY); CREATE TABLE child (id int PRIMARY KEY, parent_id int)")
        .await;
    db.target_sql(&format!(
        "ALTER TABLE child ADD FOREIGN KEY (parent_id) REFERENCES parent {deferrable}"
    ))
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE parent, child")
        .await;
    db.source_sql("INSERT INTO parent VALUES (1); INSERT INTO child VALUES (1, 1)")
        .await;
    db.sync("p").await;
    let writer = format!("w_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {writer} LOGIN PASSWORD 'w-secret'; GRANT INSERT, UPDATE, DELETE, SELECT, TRUNCATE ON parent, child TO {writer}; \
         GRANT USAGE ON SCHEMA pgapply TO {writer}; GRANT ALL ON ALL TABLES IN SCHEMA pgapply TO {writer}; \
         GRANT CREATE ON DATABASE {} TO {writer};",
        db.name
    ))
    .await;
    let target = format!(
        "host=127.0.0.1 port={} user={writer} password=w-secret dbname={}",
        db.target_port, db.name
    );
    db.source_sql("DELETE FROM parent WHERE id = 1").await;
    let out = run_with_deadline(
        db.pgapply_via(
            &db.source_conninfo(),
            &target,
            &db.slot(),
            "p",
            &["--endpos", &db.source_wal().await],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    err
}

/// A publication that leaves out some kinds of change (`publish = 'insert'`): the target drifts
/// from the source with no error, so `check` and every start say so, with the ALTER that undoes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_that_leaves_out_updates_is_named() {
    let db = TestDb::new("pubops").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t WITH (publish = 'insert')")
        .await;
    db.source_sql("INSERT INTO t VALUES (1, 1); UPDATE t SET v = 2")
        .await;
    let said = |text: &str| {
        text.contains("publication \"p\" does not publish update, delete")
            // (PostgreSQL 10 has no TRUNCATE to publish, nor to ask for.)
            && (text.contains(
                "ALTER PUBLICATION \"p\" SET (publish = 'insert, update, delete, truncate')",
            ) || text.contains("ALTER PUBLICATION \"p\" SET (publish = 'insert, update, delete')"))
    };
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.lines().any(|l| l.starts_with("WARNING") && said(l)),
        "{text}"
    );
    let out = db.sync("p").await;
    assert!(said(&stderr(&out)), "{}", stderr(&out));
    // As published: the insert, not the update.
    assert_eq!(db.count(&db.target, "SELECT v::int8 FROM t").await, 1);
}

/// PGPORT that is no port (or list of ports), and a PGSERVICE no service file defines, when
/// the connection string leaves the server to the environment: named, instead of connecting to
/// localhost:5432.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_pgport_and_pgservice_are_not_passed_over() {
    for (name, value, said) in [
        ("PGPORT", "abc", "PGPORT \"abc\" is not a port number"),
        (
            "PGSERVICE",
            "src",
            "service \"src\" is not defined in any service file",
        ),
    ] {
        let mut cmd = common::pgapply_command(&[
            "check",
            "--source",
            "user=u dbname=d",
            "--target",
            "host=127.0.0.1 port=1 user=u dbname=d",
            "--publication",
            "p",
        ]);
        cmd.env(name, value).env_remove("PGHOST");
        let out = run_with_deadline(cmd, 30).await;
        // (check reports it as the problem it found, exit 1; run exits 2 on it.)
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(said) && !stderr(&out).contains(":5432"),
            "{}",
            stderr(&out)
        );
    }
}

/// A regclass or regtype value naming an object the target lacks: said as such, with the
/// column, not as a target table that went away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_name_value_the_target_cannot_resolve_is_named() {
    let db = TestDb::new("regvalue").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, rc regclass)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("CREATE TABLE only_src (); INSERT INTO t VALUES (1, 'only_src')")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("names relation \"public.only_src\", which the target does not have (column \"rc\" holds object names)")
            && text.contains("pgapply skip")
            && !text.contains("no longer exists"),
        "{text}"
    );
    db.target_sql("CREATE TABLE only_src ()").await;
    db.sync("p").await;
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM t WHERE rc::text = 'only_src'"
        )
        .await,
        1
    );
}

/// `check` compares composite types attribute by attribute: values travel by position, so the
/// same attributes in another order would land in the wrong ones without an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_composite_type_whose_attributes_differ() {
    let db = TestDb::new("checkcomp").await;
    // (A domain over a composite type needs PostgreSQL 11.)
    let domain = common::clusters().source_major >= 11;
    let (dpair, d) = if domain {
        ("CREATE DOMAIN dpair AS pair;", ", d dpair")
    } else {
        ("", "")
    };
    db.source_sql(&format!(
        "CREATE TYPE pair AS (a text, b text); CREATE TYPE tri AS (x int, y int); {dpair} \
         CREATE TABLE c (id int PRIMARY KEY, p pair, ps pair[]{d}, t tri); \
         CREATE PUBLICATION p FOR TABLE c;"
    ))
    .await;
    db.target_sql(&format!(
        "CREATE TYPE pair AS (b text, a text); CREATE TYPE tri AS (x int, y bigint); {dpair} \
         CREATE TABLE c (id int PRIMARY KEY, p pair, ps pair[]{d}, t tri);"
    ))
    .await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    for column in ["p", "ps", "d"].into_iter().filter(|c| domain || *c != "d") {
        assert!(
            text.lines().any(|l| l.starts_with("PROBLEM")
                && l.contains(&format!("column \"{column}\" of \"public\".\"c\": its composite type is pair (a text, b text) on the source but pair (b text, a text) on the target"))),
            "{column}: {text}"
        );
    }
    assert!(
        text.lines().any(|l| l.starts_with("WARNING")
            && l.contains("column \"t\" of \"public\".\"c\": its composite type's attributes have other types on the target ((x integer, y bigint) there")),
        "{text}"
    );
}

/// A target table under row-level security that applies to the target role: the error says
/// to give the role BYPASSRLS, not to GRANT rights it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_level_security_on_the_target_is_named_with_its_way_out() {
    let db = TestDb::new("targetrls").await;
    db.both("CREATE TABLE r (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE r").await;
    let role = format!("rls_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'r'; CREATE SCHEMA pgapply AUTHORIZATION {role}; \
         GRANT ALL ON r TO {role}; ALTER TABLE r ENABLE ROW LEVEL SECURITY; \
         CREATE POLICY only_small ON r USING (id < 10);",
    ))
    .await;
    db.source_sql("INSERT INTO r VALUES (1, 'a'); UPDATE r SET v = 'b' WHERE id = 1")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_as_target_user(&role, "r", &["--endpos", &endpos, "--max-retries", "0"]),
        60,
    )
    .await;
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("row-level security")
            && text.contains("BYPASSRLS")
            && !text.contains("GRANT SELECT, INSERT, UPDATE, DELETE"),
        "{text}"
    );
}

/// An empty password file is named as such (it was sent as an empty password, and the server's
/// "password authentication failed" pointed elsewhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_password_file_is_named() {
    let file = std::env::temp_dir().join(format!("pgapply-empty-pw-{}", std::process::id()));
    std::fs::write(&file, "\n").unwrap();
    let out = run_with_deadline(
        common::pgapply_command(&[
            "status",
            "--target",
            "host=127.0.0.1 port=1 user=u dbname=d",
            "--target-password-file",
            file.to_str().unwrap(),
        ]),
        30,
    )
    .await;
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains(&format!("target password file {} is empty", file.display())),
        "{text}"
    );
    let _ = std::fs::remove_file(&file);
}

/// A run refused because its slot belongs to another source database records nothing of that
/// database: the slot's publications and database stay what the last run recorded, so the next,
/// right, start does not warn that the publications changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_refused_for_another_database_leaves_the_slots_state() {
    let db = TestDb::new("otherdb").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.sync("p").await;
    let other = format!("{}_b", db.name);
    db.source
        .batch_execute(&format!("CREATE DATABASE {other}"))
        .await
        .unwrap();
    let other_db = common::connect(db.source_port, &other).await;
    other_db
        .batch_execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION q FOR TABLE t")
        .await
        .unwrap();
    let source = format!(
        "host=127.0.0.1 port={} user=postgres dbname={other}",
        db.source_port
    );
    let out = run_with_deadline(
        db.pgapply_via(&source, &db.target_conninfo(), &db.slot(), "q", &[]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("belongs to database"), "{err}");
    let row = db
        .target
        .query_one(
            "SELECT publications, source_database FROM pgapply.progress WHERE slot_name = $1",
            &[&db.slot()],
        )
        .await
        .unwrap();
    let (publications, database): (Vec<String>, String) = (row.get(0), row.get(1));
    assert_eq!(
        (publications, database),
        (vec!["p".to_owned()], db.name.clone())
    );
    // With --copy-data too, the database is what is named (not "drop the slot and its state").
    let out = run_with_deadline(
        db.pgapply_via(
            &source,
            &db.target_conninfo(),
            &db.slot(),
            "q",
            &["--copy-data"],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("belongs to database") && !err.contains("forget"),
        "{err}"
    );
    // And forget --drop-slot through that database says to connect to the slot's.
    let out = run_with_deadline(
        common::pgapply_command(&[
            "forget",
            "--target",
            &db.target_conninfo(),
            "--slot",
            &db.slot(),
            "--drop-slot",
            "--source",
            &source,
        ]),
        60,
    )
    .await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("give --source with dbname={} to drop it", db.name)),
        "{err}"
    );
    let out = db.sync("p").await;
    assert!(
        !stderr(&out).contains("other publications until now"),
        "{}",
        stderr(&out)
    );
}

/// `check` compares the room the target has for sessions with what a run keeps there: a full
/// target refuses them as "too many clients", which reads as someone else's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_says_when_the_target_has_no_free_origin_state_for_each_worker() {
    let c = common::clusters();
    let setting = if c.target_major >= 18 {
        "max_active_replication_origins = 2"
    } else {
        "max_replication_slots = 2"
    };
    let small = pgapply::cluster::LocalCluster::start(&c.target_bin, &[setting])
        .expect("a target cluster of its own");
    let db = TestDb::new("origin_states").await;
    db.source_sql("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let target = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        small.port
    );
    let check_with = |workers: &'static str, extra: &'static [&'static str]| {
        let source = db.source_conninfo();
        let target = target.clone();
        let slot = db.slot();
        async move {
            let mut args = vec![
                "check",
                "--source",
                &source,
                "--target",
                &target,
                "--publication",
                "p",
                "--slot",
                &slot,
                "--apply-workers",
                workers,
            ];
            args.extend_from_slice(extra);
            let cmd = common::pgapply_command(&args);
            let out = run_with_deadline(cmd, 60).await;
            String::from_utf8_lossy(&out.stdout).to_string()
        }
    };
    let check = |workers: &'static str| check_with(workers, &[]);
    let said = check("2").await;
    assert!(!said.contains("free replication origin state"), "{said}");
    let said = check("3").await;
    assert!(
        said.contains("the target has 2 free replication origin state(s)")
            && said.contains("this run binds 3"),
        "{said}"
    );
    // With several workers, --streaming parallel keeps no second session: still 3.
    let said = check_with("3", &["--streaming", "parallel"]).await;
    assert!(said.contains("this run binds 3"), "{said}");
    // An origin of someone else's that holds a state leaves one.
    let target_client = common::connect(small.port, "postgres").await;
    target_client
        .batch_execute(
            "SELECT pg_replication_origin_create('someone_else'); \
             SELECT pg_replication_origin_advance('someone_else', '0/10');",
        )
        .await
        .expect("an origin holding a state");
    let said = check("2").await;
    assert!(
        said.contains("the target has 1 free replication origin state(s)")
            && said.contains("1 held by other origins"),
        "{said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_says_when_the_target_has_no_room_for_the_runs_sessions() {
    let c = common::clusters();
    let small = pgapply::cluster::LocalCluster::start(&c.target_bin, &["max_connections = 12"])
        .expect("a target cluster of its own");
    let db = TestDb::new("roomy").await;
    db.source_sql("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let target = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        small.port
    );
    let check = |extra: &[&str]| {
        let source = db.source_conninfo();
        let mut args = vec![
            "check",
            "--source",
            &source,
            "--target",
            &target,
            "--publication",
            "p",
            "--slot",
        ];
        let slot = db.slot();
        args.push(&slot);
        args.extend_from_slice(extra);
        let cmd = common::pgapply_command(&args);
        async move {
            let out = run_with_deadline(cmd, 60).await;
            String::from_utf8_lossy(&out.stdout).to_string()
        }
    };
    let said = check(&[]).await;
    assert!(!said.contains("more sessions"), "{said}");
    let said = check(&["--copy-data", "--copy-jobs", "8"]).await;
    assert!(
        said.contains("a run with these settings keeps up to about 16 there"),
        "{said}"
    );
}

/// A column of a type of the source's own that the target lacks, type and all: `check`'s ADD
/// COLUMN says to create the type first (the statement alone fails on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_says_to_create_a_missing_columns_type_first() {
    let db = TestDb::new("newtype").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.source_sql("CREATE TYPE color AS ENUM ('red', 'blue'); ALTER TABLE t ADD COLUMN c color")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("ADD COLUMN \"c\" public.color")
            && text
                .contains("(type public.color does not exist on the target: create it there first"),
        "{text}"
    );
}

/// A partitioned table published through its root with REPLICA IDENTITY FULL on the root only:
/// its partitions' UPDATEs and DELETEs come with their key alone, and match no row on the
/// target. `check` calls that a problem (it was a warning, and "no problems found").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_calls_a_full_root_over_keyed_partitions_a_problem() {
    if common::clusters().source_major < 13 {
        common::skip("publish_via_partition_root needs PostgreSQL 13");
        return;
    }
    let db = TestDb::new("fullroot").await;
    db.both(
        "CREATE TABLE r (k int, id int, v text, PRIMARY KEY (k, id)) PARTITION BY RANGE (k); \
         CREATE TABLE r1 PARTITION OF r FOR VALUES FROM (0) TO (100);",
    )
    .await;
    db.source_sql("ALTER TABLE r REPLICA IDENTITY FULL").await;
    db.publish("CREATE PUBLICATION p FOR TABLE r WITH (publish_via_partition_root = true)")
        .await;
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("PROBLEM  partitioned table \"public\".\"r\" has REPLICA IDENTITY FULL"),
        "{said}"
    );
    // `run` says it at start too.
    let out = db.sync("p").await;
    let log = stderr(&out);
    assert!(
        log.contains("partitioned table \"public\".\"r\" has REPLICA IDENTITY FULL"),
        "{log}"
    );
}
