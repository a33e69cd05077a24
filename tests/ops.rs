//! Operating pgapply: config file and precedence, `check`, `status`, metrics, JSON logs.

mod common;

use std::io::Write;
use std::net::TcpListener;

use common::{http_get, metric, run_with_deadline, spawn, stderr, wait_for, TestDb};
use tokio::process::Command;

fn pgapply() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    cmd.kill_on_drop(true);
    cmd
}

fn write_config(text: &str) -> tempfile_path::Path {
    tempfile_path::Path::new(text)
}

/// A config file in the temp directory, removed on drop.
mod tempfile_path {
    use std::sync::atomic::{AtomicUsize, Ordering};
    pub struct Path(pub std::path::PathBuf);
    impl Path {
        pub fn new(text: &str) -> Path {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "pgapply-config-{}-{}.toml",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            let mut f = std::fs::File::create(&p).unwrap();
            std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
            Path(p)
        }
        pub fn arg(&self) -> &std::path::Path {
            &self.0
        }
    }
    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// Connection services (`service=` and `PGSERVICE`, from `PGSERVICEFILE`): the file's settings
/// fill in what the connection string leaves out, the string's own win, and a service the file
/// does not define is named with where pgapply looked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_services_from_a_service_file() {
    let db = TestDb::new("svc").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1), (2)").await;
    let endpos = db.source_wal().await;
    let file = std::env::temp_dir().join(format!("pgapply-services-{}.conf", db.name));
    std::fs::write(
        &file,
        format!(
            "# services of this test\n[src]\nhost=127.0.0.1\nport={}\nuser=postgres\ndbname={}\n\n\
             [dst]\nhost=127.0.0.1\nport={}\nuser=postgres\ndbname=postgres\napplication_name=from_file\n",
            db.source_port, db.name, db.target_port
        ),
    )
    .unwrap();
    // The target's database from the string (the file's is postgres), the rest from the file.
    let mut run = db.pgapply_via(
        "service=src",
        &format!("dbname={}", db.name),
        &db.slot(),
        "p",
        &["--endpos", &endpos],
    );
    run.env("PGSERVICEFILE", &file).env("PGSERVICE", "dst");
    let out = run_with_deadline(run, 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM t").await, 2);
    let mut run = db.pgapply_via(
        "service=nowhere",
        &db.target_conninfo(),
        &db.slot(),
        "p",
        &["--endpos", &endpos],
    );
    run.env("PGSERVICEFILE", &file);
    let out = run_with_deadline(run, 60).await;
    let _ = std::fs::remove_file(&file);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("service \"nowhere\" is not defined")
            && stderr(&out).contains(&file.display().to_string()),
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_file_and_precedence() {
    let db = TestDb::new("cfg").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1), (2)").await;
    let endpos = db.source_wal().await;
    // The file names a wrong slot and publication; the environment fixes the publication and a
    // flag fixes the slot: flag > environment > file.
    let config = write_config(&format!(
        "source = \"{}\"\ntarget = \"{}\"\nslot = \"wrong_slot\"\npublications = [\"wrong_pub\"]\nstatus_interval = \"1s\"\n\n[retry]\nmin = \"100ms\"\nmax = \"1s\"\n",
        db.source_conninfo(),
        db.target_conninfo()
    ));
    let mut cmd = pgapply();
    cmd.arg("run")
        .arg("--config")
        .arg(config.arg())
        .args(["--slot", &db.slot(), "--endpos", &endpos])
        .env("PGAPPLY_SLOT", "also_wrong")
        .env("PGAPPLY_PUBLICATION", "p");
    let out = run_with_deadline(cmd, 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("t").await;

    // verify and schema read the same file: servers and publication (the flag's name) from it.
    let servers = write_config(&format!(
        "source = \"{}\"\ntarget = \"{}\"\npublication = \"p\"\n",
        db.source_conninfo(),
        db.target_conninfo()
    ));
    let mut cmd = pgapply();
    cmd.args(["verify", "--json", "--config"])
        .arg(servers.arg());
    let out = run_with_deadline(cmd, 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("\"ok\": true") && text.contains("public"),
        "{text}"
    );

    // A typo is an error naming the key and the line.
    let bad = write_config("slot = \"s\"\nstatus_intervall = \"1s\"\n");
    let mut cmd = pgapply();
    cmd.arg("run").arg("--config").arg(bad.arg());
    let out = run_with_deadline(cmd, 30).await;
    assert_eq!(out.status.code(), Some(2), "a configuration error exits 2");
    let err = stderr(&out);
    assert!(
        err.contains("status_intervall") && err.contains("line 2"),
        "{err}"
    );

    // A connection string from the file: its error names the file, not the flag.
    let bad = write_config("source = \"host=127.0.0.1 password=x dbnmae=y\"\ntarget = \"host=127.0.0.1\"\npublication = \"p\"\nslot = \"s\"\n");
    let mut cmd = pgapply();
    cmd.arg("run").arg("--config").arg(bad.arg());
    let out = run_with_deadline(cmd, 30).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(&format!(
            "source (in config file {}): invalid connection string",
            bad.arg().to_string_lossy()
        )) && !stderr(&out).contains("--source:"),
        "{}",
        stderr(&out)
    );

    // A value refused by its meaning (not its form) names where it was given.
    let bad = write_config(&format!(
        "source = \"{}\"\ntarget = \"{}\"\npublication = \"p\"\nslot = \"s\"\ncopy_jobs = 0\n",
        db.source_conninfo(),
        db.target_conninfo()
    ));
    let mut cmd = pgapply();
    cmd.arg("run").arg("--config").arg(bad.arg());
    let out = run_with_deadline(cmd, 30).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(&format!(
            "copy_jobs is 0 (copy_jobs in config file {})",
            bad.arg().to_string_lossy()
        )),
        "{}",
        stderr(&out)
    );

    // A bad duration names the value.
    let bad = write_config("status_interval = \"soon\"\n");
    let mut cmd = pgapply();
    cmd.arg("run").arg("--config").arg(bad.arg());
    let out = run_with_deadline(cmd, 30).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("invalid duration \"soon\""),
        "{}",
        stderr(&out)
    );

    // An on/off setting in the file is overridden by PGAPPLY_* saying off: here the file's
    // two_phase = true would refuse --apply-workers 2 before anything starts.
    let on = write_config("two_phase = true\n");
    let check = |env_off: bool| {
        let mut cmd = pgapply();
        cmd.args(["check", "--config"]).arg(on.arg()).args([
            "--source",
            "host=127.0.0.1 port=1",
            "--target",
            "host=127.0.0.1 port=1",
            "--publication",
            "p",
            "--slot",
            "s",
            "--apply-workers",
            "2",
        ]);
        if env_off {
            cmd.env("PGAPPLY_TWO_PHASE", "false");
        }
        cmd
    };
    let out = run_with_deadline(check(false), 30).await;
    assert!(
        stderr(&out).contains("--two-phase and --apply-workers"),
        "{}",
        stderr(&out)
    );
    let out = run_with_deadline(check(true), 30).await;
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ok       settings"),
        "{}",
        stderr(&out)
    );
    assert!(
        !stderr(&out).contains("--two-phase and --apply-workers"),
        "{}",
        stderr(&out)
    );

    // Values the argument parser cannot check are refused the same way, before anything starts:
    // exit 2, naming the setting.
    let servers = [
        "--source",
        "host=x",
        "--target",
        "host=x",
        "--publication",
        "p",
        "--slot",
        "s",
    ];
    let with = |command: &'static str, extra: &[&'static str]| {
        let mut args = vec![command];
        args.extend_from_slice(&servers);
        args.extend_from_slice(extra);
        args
    };
    for (args, named) in [
        ([&["run"][..], &servers[2..]].concat(), "--source"),
        (with("run", &["--endpos", "zz"]), "--endpos"),
        (with("run", &["--origin", "sometimes"]), "origin"),
        (with("run", &["--apply-workers", "0"]), "apply_workers"),
        (with("run", &["--queue-size", "1kB"]), "queue_size"),
        (with("cutover", &["--max-lag", "fast"]), "--max-lag"),
        (
            vec!["skip", "--target", "host=x", "--slot", "s", "--lsn", "bad"],
            "--lsn",
        ),
    ] {
        let mut cmd = pgapply();
        cmd.args(&args);
        let out = run_with_deadline(cmd, 30).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(named), "{args:?}: {}", stderr(&out));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_name_mapping() {
    let db = TestDb::new("tmap").await;
    db.source_sql("CREATE TABLE src_t (id int PRIMARY KEY, v text)")
        .await;
    db.target_sql(
        "CREATE SCHEMA archive; CREATE TABLE archive.\"Dst T\" (id int PRIMARY KEY, v text)",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE src_t").await;
    db.source_sql(
        "INSERT INTO src_t VALUES (1, 'a'), (2, 'b'); UPDATE src_t SET v = 'c' WHERE id = 1;",
    )
    .await;
    let config = write_config("[tables.\"public.src_t\"]\ntarget = 'archive.\"Dst T\"'\n");
    let endpos = db.source_wal().await;
    let mut cmd = db.pgapply("p", &["--endpos", &endpos]);
    cmd.arg("--config").arg(config.arg());
    let out = run_with_deadline(cmd, 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let rows = db
        .count(
            &db.target,
            "SELECT count(*) FROM archive.\"Dst T\" WHERE v IN ('c', 'b')",
        )
        .await;
    assert_eq!(rows, 2);
    // verify names both tables: the source's, and the target's it was compared with.
    let mut verify = db.on_both("verify", &["--json"]);
    verify.arg("--config").arg(config.arg());
    let out = run_with_deadline(verify, 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("\"table\": \"public.src_t\"")
            && text.contains("\"target_table\": \"archive.Dst T\""),
        "{text}"
    );
    // Renamed on the source while mapped and streaming: the entry is what must follow.
    let mut cmd = db.pgapply("p", &[]);
    cmd.arg("--config").arg(config.arg());
    let (mut worker, log) = common::spawn_logged(cmd);
    db.source_sql("INSERT INTO src_t VALUES (4, 'e')").await;
    wait_for("the worker to apply", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM archive.\"Dst T\"")
            .await
            == 3
    })
    .await;
    db.source_sql("ALTER TABLE src_t RENAME TO src_t2; INSERT INTO src_t2 VALUES (3, 'd')")
        .await;
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), worker.wait())
        .await
        .expect("the worker stops")
        .unwrap();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(
        said.contains("rename that entry after the source's new name ([tables.\"public.src_t2\"]"),
        "{said}"
    );
    let endpos = db.source_wal().await;
    let renamed = write_config("[tables.\"public.src_t2\"]\ntarget = 'archive.\"Dst T\"'\n");
    let mut cmd = db.pgapply("p", &["--endpos", &endpos]);
    cmd.arg("--config").arg(renamed.arg());
    let out = run_with_deadline(cmd, 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM archive.\"Dst T\"")
            .await,
        4
    );
}

/// Columns renamed in the configuration (the key among them): the initial copy writes them,
/// the stream applies them, and verify compares them, finding a row changed on the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_mapping_in_copy_stream_and_verify() {
    let db = TestDb::new("cmap").await;
    db.source_sql("CREATE TABLE c (id int PRIMARY KEY, k3 text, same int)")
        .await;
    db.target_sql("CREATE TABLE c (\"Pk\" int PRIMARY KEY, same int, k4 text)")
        .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE c").await;
    db.source_sql("INSERT INTO c SELECT g, 'v' || g, g FROM generate_series(1, 50) g")
        .await;
    let config = write_config("[tables.\"public.c\".columns]\nk3 = \"k4\"\nid = \"Pk\"\n");
    // check finds the target's key under its renamed column, and nothing else to say.
    let mut check = db.on_both("check", &["--slot", &db.slot(), "--copy-data", "--json"]);
    check.arg("--config").arg(config.arg());
    let out = run_with_deadline(check, 60).await;
    let found: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(&out)));
    assert!(
        out.status.success()
            && found["warnings"].as_array().is_some_and(|w| w
                .iter()
                .all(|w| !w.as_str().unwrap_or_default().contains("\"c\""))),
        "{found}"
    );
    let endpos = db.source_wal().await;
    let mut cmd = db.pgapply("p", &["--copy-data", "--endpos", &endpos]);
    cmd.arg("--config").arg(config.arg());
    let out = run_with_deadline(cmd, 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.source_sql("UPDATE c SET k3 = 'new' WHERE id = 7; DELETE FROM c WHERE id = 8; INSERT INTO c VALUES (51, 'v51', 51)")
        .await;
    let endpos = db.source_wal().await;
    let mut cmd = db.pgapply("p", &["--endpos", &endpos]);
    cmd.arg("--config").arg(config.arg());
    let out = run_with_deadline(cmd, 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM c WHERE k4 = 'v' || \"Pk\" AND same = \"Pk\" OR \"Pk\" = 7 AND k4 = 'new'"
        )
        .await,
        50
    );
    let verify = |config: &std::path::Path| {
        let mut verify = db.on_both("verify", &["--json"]);
        verify.arg("--config").arg(config);
        verify
    };
    let out = run_with_deadline(verify(config.arg()), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.target_sql("UPDATE c SET k4 = 'changed' WHERE \"Pk\" = 20")
        .await;
    let out = run_with_deadline(verify(config.arg()), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(text.contains("mismatch"), "{text}");
}

/// A table applied into a differently named one keeps its serial column's sequence under the
/// target's name: the cutover sets that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_sets_the_sequence_of_a_mapped_table() {
    let db = TestDb::new("seqmap").await;
    db.source_sql("CREATE TABLE src_s (id serial PRIMARY KEY, v text)")
        .await;
    db.target_sql("CREATE TABLE \"Dst S\" (id serial PRIMARY KEY, v text)")
        .await;
    db.publish("CREATE PUBLICATION p FOR TABLE src_s").await;
    db.source_sql("INSERT INTO src_s (v) SELECT 'x' FROM generate_series(1, 5)")
        .await;
    let config = write_config("[tables.\"public.src_s\"]\ntarget = 'public.\"Dst S\"'\n");
    let path = config.arg().to_string_lossy().into_owned();
    let text = db.cutover(&["--config", &path]).await;
    assert!(text.contains("step 4: copied 1 sequence(s)"), "{text}");
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM \"Dst S\"").await,
        5
    );
    assert_eq!(
        db.count(&db.target, "SELECT nextval('\"Dst S_id_seq\"')")
            .await,
        6
    );
}

/// A mapped table's cutover with --reverse prints the mapping the way back needs, and the way
/// back works with it as printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_cutover_prints_the_mapping_back() {
    let db = TestDb::new("mapback").await;
    db.source_sql("CREATE TABLE src_m (id int PRIMARY KEY, v text)")
        .await;
    db.target_sql(
        "CREATE SCHEMA archive; CREATE TABLE archive.\"Dst M\" (id int PRIMARY KEY, v text)",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE src_m").await;
    db.source_sql("INSERT INTO src_m VALUES (1, 'old primary')")
        .await;
    let config = write_config("[tables.\"public.src_m\"]\ntarget = 'archive.\"Dst M\"'\n");
    let path = config.arg().to_string_lossy().into_owned();
    let text = db.cutover(&["--config", &path, "--reverse"]).await;
    assert!(
        text.contains("--config <a file with the lines below>")
            && text.contains("  [tables.'archive.Dst M']\n  target = 'public.src_m'"),
        "{text}"
    );
    let back: String = text
        .lines()
        .skip_while(|l| !l.contains("in its config file:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| format!("{l}\n"))
        .collect();
    let back = write_config(&back);
    db.target_sql("INSERT INTO archive.\"Dst M\" VALUES (2, 'new primary')")
        .await;
    let endpos: String = db
        .target
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let reverse = format!("{}_reverse", db.slot());
    let mut cmd = common::pgapply_command(&[
        "run",
        "--source",
        &db.target_conninfo(),
        "--target",
        &db.source_conninfo(),
        "--publication",
        &reverse,
        "--slot",
        &reverse,
        "--endpos",
        &endpos,
    ]);
    cmd.arg("--config").arg(back.arg());
    let out = run_with_deadline(cmd, 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.source,
            "SELECT count(*) FROM src_m WHERE v = 'new primary'"
        )
        .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_metrics_move_with_the_workload() {
    let db = TestDb::new("obs").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v int)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = spawn(db.pgapply(
        "p",
        &[
            "--metrics-addr",
            &addr,
            "--retry-min",
            "3s",
            "--retry-max",
            "3s",
        ],
    ));
    wait_for("metrics endpoint", 30, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    assert!(http_get(port, "/healthz").await.ends_with("ok\n"));
    let before = http_get(port, "/metrics").await;
    assert_eq!(
        metric(&before, "pgapply_transactions_total"),
        0.0,
        "{before}"
    );
    for i in 0..20 {
        db.source_sql(&format!(
            "INSERT INTO t VALUES ({i}, {i}); UPDATE t SET v = v + 1 WHERE id = {i};"
        ))
        .await;
    }
    wait_for("metrics to count 20 transactions", 60, || async {
        let m = http_get(port, "/metrics").await;
        metric(&m, "pgapply_transactions_total") >= 20.0
            && m.contains("pgapply_rows_total{operation=\"insert\"} 20")
            && metric(&m, "pgapply_flushed_lsn") > 0.0
    })
    .await;
    let m = http_get(port, "/metrics").await;
    assert!(
        m.contains("# TYPE pgapply_apply_latency_seconds histogram"),
        "{m}"
    );
    // WAL without a published change (an unpublished table; an idle source writes some too)
    // moves the received position past the applied one: that is no lag, however long ago the
    // last commit was.
    let idle_from = std::time::Instant::now();
    db.source_sql("CREATE TABLE unpublished (x int); INSERT INTO unpublished VALUES (1);")
        .await;
    wait_for(
        "the received position to pass the applied one, 3 s on",
        60,
        || async {
            let m = http_get(port, "/metrics").await;
            metric(&m, "pgapply_received_lsn") > metric(&m, "pgapply_applied_lsn")
                && idle_from.elapsed() > std::time::Duration::from_secs(3)
        },
    )
    .await;
    let m = http_get(port, "/metrics").await;
    assert!(metric(&m, "pgapply_lag_seconds") < 1.0, "{m}");
    assert!(
        m.contains(&format!("pgapply_info{{slot=\"{}\"}} 1", db.slot())),
        "{m}"
    );
    // status reads the heartbeat the worker writes every status interval.
    wait_for("status to show the transactions", 30, || async {
        let out = run_with_deadline(
            {
                let mut c = pgapply();
                c.args([
                    "status",
                    "--json",
                    "--target",
                    &db.target_conninfo(),
                    "--source",
                    &db.source_conninfo(),
                ]);
                c
            },
            30,
        )
        .await;
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
            return false;
        };
        let s = &v[0];
        s["slot"] == db.slot().as_str()
            && s["state"] == "streaming"
            && s["transactions"].as_i64() >= Some(20)
            && s["inserts"].as_i64() == Some(20)
            && s["lag_bytes"].as_i64().is_some()
    })
    .await;
    let out = run_with_deadline(
        {
            let mut c = pgapply();
            c.args(["status", "--target", &db.target_conninfo()]);
            c
        },
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("slot {}: streaming", db.slot())),
        "{text}"
    );
    // Readiness: streaming now; not while the run waits to retry after losing the target
    // (its sessions ended here, and a change to apply shows it the loss).
    assert!(http_get(port, "/readyz").await.ends_with("streaming\n"));
    db.target_sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    .await;
    db.source_sql("INSERT INTO t VALUES (100, 100)").await;
    wait_for("/readyz to say not streaming", 30, || async {
        let r = http_get(port, "/readyz").await;
        r.starts_with("HTTP/1.1 503")
            && metric(&http_get(port, "/metrics").await, "pgapply_streaming") == 0.0
    })
    .await;
    wait_for("/readyz to say streaming again", 60, || async {
        http_get(port, "/readyz").await.starts_with("HTTP/1.1 200")
    })
    .await;
    // The target gone while the source is idle: only the heartbeat notices, and readiness
    // follows it.
    // (From another database: a session cannot close its own.)
    let admin = common::connect(db.target_port, "postgres").await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS false",
            db.name
        ))
        .await
        .unwrap();
    db.target_sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    .await;
    wait_for("/readyz to say the target does not answer", 30, || async {
        http_get(port, "/readyz").await.starts_with("HTTP/1.1 503")
    })
    .await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS true",
            db.name
        ))
        .await
        .unwrap();
    wait_for(
        "/readyz to say streaming once the target answers",
        60,
        || async { http_get(port, "/readyz").await.starts_with("HTTP/1.1 200") },
    )
    .await;
    // The target holds the connection open but does not answer the heartbeat (here a lock it
    // waits for; a hung server or a proxy in front of a dead one looks the same): not ready.
    let locker = common::connect(db.target_port, &db.name).await;
    locker
        .batch_execute("BEGIN; LOCK pgapply.progress IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    wait_for(
        "/readyz to say the target does not answer the heartbeat",
        90,
        || async { http_get(port, "/readyz").await.starts_with("HTTP/1.1 503") },
    )
    .await;
    locker.batch_execute("COMMIT").await.unwrap();
    wait_for(
        "/readyz to say streaming once the heartbeat is answered",
        60,
        || async { http_get(port, "/readyz").await.starts_with("HTTP/1.1 200") },
    )
    .await;
    let pid = child.id().unwrap() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(child.wait().await.unwrap().success());
    let status_text = || async {
        let mut c = pgapply();
        c.args(["status", "--target", &db.target_conninfo()]);
        let out = run_with_deadline(c, 30).await;
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let text = status_text().await;
    assert!(
        text.contains(&format!("slot {}: stopped", db.slot())),
        "{text}"
    );
    // A slot the target does not know: said, exit 1.
    let out = run_with_deadline(
        {
            let mut c = pgapply();
            c.args([
                "status",
                "--target",
                &db.target_conninfo(),
                "--slot",
                "no_such_slot",
            ]);
            c
        },
        30,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no pgapply state for slot \"no_such_slot\""),
        "{}",
        stderr(&out)
    );
    // A source that cannot be reached: what the target knows is still shown.
    let out = run_with_deadline(
        {
            let mut c = pgapply();
            c.args([
                "status",
                "--target",
                &db.target_conninfo(),
                "--source",
                "host=127.0.0.1 port=1 user=postgres dbname=x connect_timeout=2",
            ]);
            c
        },
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains(&format!("slot {}: stopped", db.slot()))
            && text.contains("? bytes (the source cannot be reached: connecting to source"),
        "{text}"
    );
    // Another cluster than the slot's (here the target's): no lag made up from its WAL.
    let out = run_with_deadline(
        {
            let mut c = pgapply();
            c.args([
                "status",
                "--target",
                &db.target_conninfo(),
                "--source",
                &db.target_conninfo(),
            ]);
            c
        },
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains(&format!(
            "? bytes (slot \"{}\" does not exist on this source: is --source the cluster",
            db.slot()
        )),
        "{text}"
    );
    // ... also when that cluster has a slot of the same name.
    db.target
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&db.slot()],
        )
        .await
        .unwrap();
    let out = run_with_deadline(
        {
            let mut c = pgapply();
            c.args([
                "status",
                "--target",
                &db.target_conninfo(),
                "--source",
                &db.target_conninfo(),
            ]);
            c
        },
        30,
    )
    .await;
    db.target
        .execute("SELECT pg_drop_replication_slot($1)", &[&db.slot()])
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("replicates from another cluster (system identifier"),
        "{text}"
    );
    // Its output cut short (`pgapply status | head -1`): no panic on the closed pipe.
    {
        let mut c = pgapply();
        c.args(["status", "--target", &db.target_conninfo()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        drop(child.stdout.take());
        let out =
            tokio::time::timeout(std::time::Duration::from_secs(30), child.wait_with_output())
                .await
                .expect("status ends")
                .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {err}", out.status);
        assert!(!err.contains("panicked"), "{err}");
    }
    // A worker killed (or cut off from the target) cannot record that it stopped: its old
    // heartbeat gives it away.
    db.target_sql(
        "UPDATE pgapply.progress SET state = 'streaming', heartbeat_at = now() - interval '1 minute', pid = 4242",
    )
    .await;
    let text = status_text().await;
    assert!(
        text.contains(&format!(
            "slot {}: not responding (last recorded: streaming), last recorded pid 4242,",
            db.slot()
        )),
        "{text}"
    );
    // The same for scripts, in fields of one word or a flag.
    let mut c = pgapply();
    c.args(["status", "--json", "--target", &db.target_conninfo()]);
    let out = run_with_deadline(c, 30).await;
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let mine = status
        .as_array()
        .and_then(|a| a.iter().find(|s| s["slot"] == db.slot().as_str()))
        .cloned()
        .unwrap_or_default();
    assert_eq!(mine["recorded_state"], "streaming", "{status}");
    assert_eq!(mine["responding"], false, "{status}");
    assert_eq!(mine["retrying"], false, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_lines_parse() {
    let db = TestDb::new("jsonlog").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--endpos", &endpos, "--log-format", "json"]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    let mut lines = 0;
    for line in err.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{line}");
        // No field shadows the log's own keys (a parser keeps only one of two "target"s).
        assert!(line.matches("\"target\":").count() <= 1, "{line}");
        // Every line of the run names its slot (the last, "done", comes after the run).
        if v["message"] != "done" {
            assert_eq!(v["span"]["slot"], db.slot().as_str(), "{line}");
        }
        lines += 1;
    }
    assert!(lines >= 2);
    // A failing run too: the error is a JSON line like the others, with the error in a field.
    let out = run_with_deadline(
        db.pgapply("no_such_publication", &["--log-format", "json"]),
        60,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    let last = err.lines().last().unwrap_or_default();
    for line in err.lines() {
        serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    }
    let v: serde_json::Value = serde_json::from_str(last).unwrap_or_default();
    assert_eq!(v["level"], "ERROR", "{last}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("no_such_publication")),
        "{last}"
    );
}

/// `check` says what `run` would refuse about the slot's history on the target: progress
/// recorded from another source, and a slot dropped after changes from it were applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_progress_from_another_source_and_a_slot_gone_since() {
    let db = TestDb::new("chkhist").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.sync("p").await;
    let check = || async {
        let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let text = check().await;
    assert!(!text.contains("PROBLEM"), "{text}");
    // `:PORT` (every interface), as run takes it.
    let out = run_with_deadline(
        db.on_both("check", &["--slot", &db.slot(), "--metrics-addr", ":59187"]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!text.contains("PROBLEM"), "{text}");
    db.target_sql("UPDATE pgapply.progress SET source_system_id = '42'")
        .await;
    let text = check().await;
    assert!(
        text.contains("from another source (system identifier 42"),
        "{text}"
    );
    // The same for scripts: one JSON object, the problems in it, exit 1.
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot(), "--json"]), 60).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let found: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    let problems = found["problems"].as_array().cloned().unwrap_or_default();
    assert!(
        problems.len() == 1
            && problems[0]
                .as_str()
                .is_some_and(|p| p.contains("from another source"))
            && found["ok"].as_array().is_some_and(|ok| !ok.is_empty()),
        "{found}"
    );
    db.target_sql("UPDATE pgapply.progress SET source_system_id = NULL")
        .await;
    // A target database closed for maintenance: a one-shot command exits 3 (transient).
    // (From another database: a session cannot close its own.)
    let admin = common::connect(db.target_port, "postgres").await;
    let allow = |yes: bool| format!("ALTER DATABASE {} ALLOW_CONNECTIONS {yes}", db.name);
    admin.batch_execute(&allow(false)).await.unwrap();
    let out = run_with_deadline(
        common::pgapply_command(&["status", "--target", &db.target_conninfo()]),
        30,
    )
    .await;
    admin.batch_execute(&allow(true)).await.unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("refuses connections for now"),
        "{}",
        stderr(&out)
    );
    db.drop_slot().await;
    let text = check().await;
    assert!(
        text.contains("no longer exists on the source, but pgapply applied changes from it")
            && !text.contains("run with --create-slot"),
        "{text}"
    );
    // Made again by hand, later: it starts past what the target applied.
    db.source_sql("INSERT INTO t VALUES (2)").await;
    db.source_sql(&format!(
        "SELECT pg_create_logical_replication_slot('{}', 'pgoutput')",
        db.slot()
    ))
    .await;
    let text = check().await;
    assert!(
        text.contains("has confirmed changes up to") && text.contains("PROBLEM"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_lists_every_problem() {
    let db = TestDb::new("check").await;
    db.source_sql(
        "CREATE TABLE keyless (a int, b text); \
         CREATE TABLE only_source (id int PRIMARY KEY); \
         CREATE TABLE cols (id int PRIMARY KEY, extra text, n int); \
         CREATE TABLE strict (id int PRIMARY KEY); \
         CREATE TABLE good (id int PRIMARY KEY, v text);",
    )
    .await;
    db.target_sql(
        "CREATE TABLE keyless (a int, b text); CREATE TABLE cols (id int PRIMARY KEY, n point); \
         CREATE TABLE strict (id int PRIMARY KEY, must text NOT NULL); \
         CREATE TABLE good (id int PRIMARY KEY, v varchar);",
    )
    .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE keyless, only_source, cols, strict, good")
        .await;
    // Published through its root (13+): the partition's replica identity is what counts.
    let roots = common::source_version(&db).await >= 130000;
    if roots {
        db.both(
            "CREATE TABLE parts (id int, v text) PARTITION BY RANGE (id); \
             CREATE TABLE parts_1 PARTITION OF parts FOR VALUES FROM (0) TO (100);",
        )
        .await;
        // A partition the target lacks: its rows would have no place there.
        db.source_sql(
            "ALTER TABLE parts REPLICA IDENTITY FULL; \
             CREATE TABLE parts_2 PARTITION OF parts FOR VALUES FROM (100) TO (200); \
             CREATE PUBLICATION pr FOR TABLE parts WITH (publish_via_partition_root = true);",
        )
        .await;
    }
    let out = run_with_deadline(
        db.pgapply("p,missing_pub", &["--check-only-placeholder"]),
        30,
    )
    .await;
    // Unknown flag: clap refuses with exit 2 (keeps the command line honest).
    assert_eq!(out.status.code(), Some(2));

    // `pgapply check` of this database pair and slot: its exit code, its report, its log.
    let check = |publications: &'static str, extra: &'static [&'static str]| {
        let mut cmd = pgapply();
        cmd.args([
            "check",
            "--source",
            &db.source_conninfo(),
            "--target",
            &db.target_conninfo(),
            "--slot",
            &db.slot(),
            "--publication",
            publications,
        ])
        .args(extra);
        async move {
            let out = run_with_deadline(cmd, 60).await;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            (out.status.code(), text, stderr(&out))
        }
    };
    // (The source's wal_sender_timeout is the default 60 s.)
    let (code, text, _) = check(
        if roots {
            "p,missing_pub,pr"
        } else {
            "p,missing_pub"
        },
        &["--status-interval", "40s"],
    )
    .await;
    assert_eq!(code, Some(1), "{text}");
    for expected in [
        "--status-interval 40s is more than half the source's wal_sender_timeout (1m)",
        "publication \"missing_pub\" does not exist",
        &format!("replication slot \"{}\" does not exist", db.slot()),
        "table \"public\".\"keyless\" has no primary key",
        "table \"public\".\"only_source\" does not exist on the target",
        "column \"extra\" of \"public\".\"cols\" is published but missing",
        "column \"n\" of \"public\".\"cols\" is integer on the source but point on the target",
        "column \"must\" of \"public\".\"strict\" is NOT NULL without a default on the target",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    if roots {
        assert!(
            text.contains("table \"public\".\"parts_1\" has no primary key"),
            "{text}"
        );
        assert!(
            text.contains("partitioned table \"public\".\"parts\": no partition on the target has the bounds of the source's public.parts_2 FOR VALUES FROM (100) TO (200)")
                && !text.contains("public.parts_1 FOR VALUES"),
            "{text}"
        );
    }
    assert!(
        text.contains("ok       table \"public\".\"good\" matches"),
        "{text}"
    );

    // All fixed: no problems. (A table without a key is fine where only its INSERTs are
    // published.)
    db.target_sql("DROP TABLE cols; CREATE TABLE cols (id int PRIMARY KEY, extra text, n bigint);")
        .await;
    db.source_sql(
        "DROP PUBLICATION p; CREATE PUBLICATION p FOR TABLE cols, good; \
         CREATE PUBLICATION ins FOR TABLE keyless WITH (publish = 'insert');",
    )
    .await;
    let (code, text, log) = check("p,ins", &["--create-slot"]).await;
    assert_eq!(code, Some(0), "{text}\n{log}");
    assert!(text.contains("no problems found"), "{text}");
    // What `run` would refuse: --copy-only without --copy-data; --copy-data into a table with
    // rows.
    let (code, text, _) = check("p,ins", &["--create-slot", "--copy-only"]).await;
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("--copy-only goes with --copy-data"), "{text}");
    let (code, text, _) = check("p,ins", &["--create-slot", "--truncate-target"]).await;
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("--truncate-target goes with --copy-data"),
        "{text}"
    );
    db.target_sql("INSERT INTO good VALUES (1, 'already here')")
        .await;
    let (code, text, _) = check("p,ins", &["--copy-data"]).await;
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("target table \"public\".\"good\" is not empty")
            && text.contains("--truncate-target"),
        "{text}"
    );
    let (code, text, _) = check("p,ins", &["--copy-data", "--truncate-target"]).await;
    assert_eq!(code, Some(0), "{text}");
    db.target_sql("DELETE FROM good").await;

    // The slot in use by the running worker of this target: a check of the live deployment.
    let mut worker = spawn(db.pgapply("p,ins", &["--create-slot"]));
    db.wait_slot_active().await;
    wait_for("the worker's heartbeat", 30, || async {
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE state = 'streaming'",
        )
        .await
            == 1
    })
    .await;
    let (code, text, log) = check("p,ins", &[]).await;
    assert_eq!(code, Some(0), "{text}\n{log}");
    assert!(
        text.contains(&format!(
            "slot \"{}\" is in use by the running pgapply worker",
            db.slot()
        )),
        "{text}"
    );
    // Seen from another target, that worker is another process using the slot: named.
    let other = TestDb::new("check_other").await;
    let mut cmd = pgapply();
    cmd.args([
        "check",
        "--source",
        &db.source_conninfo(),
        "--target",
        &other.target_conninfo(),
        "--slot",
        &db.slot(),
        "--publication",
        "p,ins",
    ]);
    let out = run_with_deadline(cmd, 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "slot \"{}\" is in use by the source process",
            db.slot()
        )),
        "{text}"
    );
    worker.start_kill().expect("kill");
    let _ = worker.wait().await;
    // That slot was made without --copy-data: `run --copy-data` would refuse it, so check says so.
    let (code, text, _) = check("p,ins", &["--copy-data", "--truncate-target"]).await;
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("already exists on the source"), "{text}");
    let _ = std::io::stdout().flush();
}

/// A target role that may not set session_replication_role: `check` names the tables whose
/// triggers would fire for replicated changes (PostgreSQL's own subscriber keeps them quiet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_target_triggers_that_would_fire() {
    let db = TestDb::new("checktrig").await;
    // par has no trigger of its own, but the cascade of kid's foreign key acts on its deletes;
    // calm is only checked (NO ACTION), and acts on nothing.
    db.both(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE par (id int PRIMARY KEY); \
         CREATE TABLE kid (id int PRIMARY KEY, par_id int REFERENCES par ON DELETE CASCADE); \
         CREATE TABLE calm (id int PRIMARY KEY); \
         CREATE TABLE calm_kid (id int PRIMARY KEY, calm_id int REFERENCES calm);",
    )
    .await;
    db.target_sql(
        "CREATE FUNCTION stamp() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN NEW.v := ''stamped''; RETURN NEW; END'; \
         CREATE TRIGGER stamp BEFORE INSERT ON t FOR EACH ROW EXECUTE PROCEDURE stamp();",
    )
    .await;
    db.source_sql("CREATE PUBLICATION p FOR TABLE t, par, kid, calm")
        .await;
    let writer = format!("plain_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {writer} LOGIN PASSWORD 'w-secret'; \
         GRANT INSERT, UPDATE, DELETE, SELECT, TRUNCATE ON t, par, kid, calm TO {writer}; GRANT CREATE ON DATABASE {} TO {writer};",
        db.name
    ))
    .await;
    let mut cmd = pgapply();
    cmd.args([
        "check",
        "--source",
        &db.source_conninfo(),
        "--target",
        &format!(
            "postgres://{writer}:w-secret@127.0.0.1:{}/{}",
            db.target_port, db.name
        ),
        "--slot",
        &db.slot(),
        "--publication",
        "p",
        "--create-slot",
    ]);
    let out = run_with_deadline(cmd, 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("may not set session_replication_role"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains(
            "foreign keys of \"public\".\"kid\", \"public\".\"par\", \"public\".\"t\" act"
        ),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_conflict_policies_and_log_level() {
    let db = TestDb::new("sighup").await;
    db.both("CREATE TABLE h (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE h").await;
    let config = write_config(&format!(
        "source = \"{}\"\ntarget = \"{}\"\nslot = \"{}\"\npublications = [\"p\"]\nlog_level = \"info\"\n[conflicts]\nupdate_missing = \"error\"\n",
        db.source_conninfo(),
        db.target_conninfo(),
        db.slot()
    ));
    let log = std::env::temp_dir().join(format!("pgapply-sighup-{}.log", std::process::id()));
    let mut cmd = pgapply();
    cmd.arg("run")
        .arg("--config")
        .arg(config.arg())
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut child = cmd.spawn().unwrap();
    db.source_sql("INSERT INTO h VALUES (1, 'a')").await;
    wait_for("the first row", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM h").await == 1
    })
    .await;
    // New policies and a quieter log level, then SIGHUP.
    std::fs::write(
        config.arg(),
        format!(
            "source = \"{}\"\ntarget = \"{}\"\nslot = \"{}\"\npublications = [\"p\"]\nlog_level = \"warn\"\ncopy_jobs = 3\n[conflicts]\nupdate_missing = \"skip\"\n",
            db.source_conninfo(),
            db.target_conninfo(),
            db.slot()
        ),
    )
    .unwrap();
    let pid = child.id().unwrap() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    wait_for("the reload", 30, || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("SIGHUP: reloaded")
    })
    .await;
    // Under the old policy this would stop pgapply; now it is skipped and recorded.
    db.target_sql("DELETE FROM h WHERE id = 1").await;
    db.source_sql("UPDATE h SET v = 'b' WHERE id = 1; INSERT INTO h VALUES (2, 'c');")
        .await;
    wait_for("the next transaction", 30, || async {
        db.count(&db.target, "SELECT count(*) FROM h WHERE id = 2")
            .await
            == 1
    })
    .await;
    assert!(child.try_wait().unwrap().is_none(), "still running");
    assert_eq!(db.count(&db.target, "SELECT count(*) FROM pgapply.conflicts WHERE conflict_type = 'update_missing' AND policy = 'skip'").await, 1);
    // The log_level taken out of the file: back to info.
    let base = format!(
        "source = \"{}\"\ntarget = \"{}\"\nslot = \"{}\"\npublications = [\"p\"]\ncopy_jobs = 3\n",
        db.source_conninfo(),
        db.target_conninfo(),
        db.slot()
    );
    std::fs::write(
        config.arg(),
        format!("{base}[conflicts]\nupdate_missing = \"skip\"\n"),
    )
    .unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    wait_for("the level back to info", 30, || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("the file sets no log_level now: back to info")
    })
    .await;
    // A file that does not load: said, and what changed in it is not.
    std::fs::write(
        config.arg(),
        format!("{base}[retry]\nlog_level = \"debug\"\n"),
    )
    .unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    wait_for("the refused reload", 30, || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("SIGHUP: config file not reloaded")
    })
    .await;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(child.wait().await.unwrap().success());
    let text = std::fs::read_to_string(&log).unwrap();
    // A setting a reload does not apply is named as such.
    assert!(
        text.contains("SIGHUP: copy_jobs changed in the config file: a reload applies only log_level and the conflict policies"),
        "{text}"
    );
    let after = text
        .split_once("SIGHUP: reloaded")
        .map(|x| x.1)
        .unwrap_or_default();
    // (Up to the line that says the level is back.)
    let quiet = after
        .find("back to info")
        .and_then(|i| after[..i].rfind('\n'))
        .map_or(after, |i| &after[..i]);
    assert!(
        !quiet.contains(" INFO "),
        "info lines after the level went to warn: {quiet}"
    );
    let last = text.split("back to info").nth(1).unwrap_or_default();
    assert!(
        last.contains(" INFO ") && !last.contains("retry.log_level"),
        "{last}"
    );
    let _ = std::fs::remove_file(&log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_speed_reads_the_backlog_without_moving_the_slot() {
    let db = TestDb::new("speed").await;
    db.both("CREATE TABLE s (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE s").await;
    let slot = db.slot();
    // publish() made the slot.
    let before = confirmed_lsn(&db).await;
    for i in 0..25 {
        db.source_sql(&format!("INSERT INTO s VALUES ({i}, 'x')"))
            .await;
    }
    let endpos = db.source_wal().await;
    // As a replication role whose password is in a file, as for `run`.
    let role = format!("speed_{}", std::process::id());
    db.source_sql(&format!(
        "CREATE ROLE {role} LOGIN REPLICATION PASSWORD 'sp-secret'"
    ))
    .await;
    let password_file = std::env::temp_dir().join(format!("{role}.pw"));
    std::fs::write(&password_file, "sp-secret\n").unwrap();
    let source = format!(
        "host=127.0.0.1 port={} user={role} dbname={}",
        db.source_port, db.name
    );
    let mut cmd = pgapply();
    cmd.args([
        "source-speed",
        "--source",
        &source,
        "--source-password-file",
        password_file.to_str().unwrap(),
        "--publication",
        "p",
        "--slot",
        &slot,
        "--endpos",
        &endpos,
    ]);
    let out = run_with_deadline(cmd, 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("read 25 transactions"), "{stdout}");
    assert_eq!(confirmed_lsn(&db).await, before, "the slot did not move");
    let _ = std::fs::remove_file(&password_file);
}

async fn confirmed_lsn(db: &TestDb) -> String {
    let sql = format!(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{}'",
        db.slot()
    );
    db.source.query_one(&sql, &[]).await.unwrap().get(0)
}

/// The README's first command: two throwaway clusters, a live workload mirrored, both sides
/// compared. (Uses the harness's server binaries.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_mirrors_a_live_workload() {
    let bin = common::clusters().target_bin.to_string_lossy().to_string();
    let mut cmd = pgapply();
    cmd.args(["demo", "--duration", "2s", "--pg-bin", &bin]);
    let out = run_with_deadline(cmd, 180).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert!(text.contains("source and target match"), "{text}");
}

/// The demo stopped by SIGTERM (or Ctrl-C) while its workload runs: it says so, exits 0, and
/// leaves no cluster running and no directory behind. A --pg-bin without the programs is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_stopped_early_removes_its_clusters() {
    let bin = common::clusters().target_bin.to_string_lossy().to_string();
    let tmp = std::env::temp_dir().join(format!("pgapply-demo-stop-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    // (The postgres user creates its clusters there.)
    let _ = std::process::Command::new("chmod")
        .arg("0777")
        .arg(&tmp)
        .output();
    let out_path = tmp.join("demo.out");
    let mut cmd = pgapply();
    cmd.args(["demo", "--duration", "120s", "--pg-bin", &bin])
        .env("TMPDIR", &tmp)
        .stdout(std::fs::File::create(&out_path).unwrap());
    let mut child = cmd.spawn().unwrap();
    let said = || std::fs::read_to_string(&out_path).unwrap_or_default();
    wait_for("the demo's workload to run", 120, || async {
        said().contains("transactions on the source")
    })
    .await;
    let pid = child.id().unwrap() as i32;
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), child.wait())
        .await
        .expect("the demo ends")
        .unwrap();
    assert!(status.success(), "{status}: {}", said());
    assert!(said().contains("stopped on request"), "{}", said());
    let left: Vec<String> = std::fs::read_dir(&tmp)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "demo.out")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&tmp);
    let mut cmd = pgapply();
    cmd.args(["demo", "--pg-bin", "/nonexistent/bin"]);
    let out = run_with_deadline(cmd, 30).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("/nonexistent/bin/initdb not found"),
        "{}",
        stderr(&out)
    );
}

/// `status` and `skip` read the target, its password file and the slot from `--config` too, as
/// `run` does: one config file serves every command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_skip_take_the_config_file() {
    let db = TestDb::new("cfgcmds").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.sync("p").await;
    let dir = std::env::temp_dir();
    let config = dir.join(format!("pgapply-cfgcmds-{}.toml", std::process::id()));
    let write = |extra: &str| {
        let mut f = std::fs::File::create(&config).unwrap();
        writeln!(
            f,
            "target = {:?}\nslot = {:?}\n{extra}",
            db.target_conninfo(),
            db.slot()
        )
        .unwrap();
    };
    let path = config.to_str().unwrap().to_owned();
    let cmd = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--config", path.as_str()]);
        common::pgapply_command(&all)
    };
    // A target pgapply never ran against: said so, not as a missing relation.
    let fresh = TestDb::new("noskip").await;
    let out = run_with_deadline(
        common::pgapply_command(&[
            "skip",
            "--target",
            &fresh.target_conninfo(),
            "--slot",
            "s",
            "--lsn",
            "0/1",
        ]),
        30,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("pgapply has not run against this database yet"),
        "{}",
        stderr(&out)
    );
    write("");
    let out = run_with_deadline(cmd(&["status"]), 30).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains(&db.slot()), "{text}");
    // A commit time is shown, whichever store holds the position (a replication origin keeps
    // none: then the latest one recorded, "or later").
    assert!(
        text.contains("(source commit 2") && !text.contains("(source commit -)"),
        "{text}"
    );
    // The slot there narrows status to it, as --slot does.
    {
        let mut other = std::fs::File::create(&config).unwrap();
        writeln!(
            other,
            "target = {:?}\nslot = \"some_other_slot\"",
            db.target_conninfo()
        )
        .unwrap();
    }
    // (Here a slot the target has no state for: said, exit 1.)
    let out = run_with_deadline(cmd(&["status", "--json"]), 30).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no pgapply state for slot \"some_other_slot\""),
        "{}",
        stderr(&out)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!text.contains(&db.slot()), "{text}");
    write("");
    // No recorded error names a transaction: refused (it would drop one that applies fine),
    // unless forced.
    let out = run_with_deadline(cmd(&["skip", "--lsn", "FF/0"]), 30).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no recorded error of slot") && stderr(&out).contains("--force"),
        "{}",
        stderr(&out)
    );
    let out = run_with_deadline(cmd(&["skip", "--lsn", "FF/0", "--force"]), 30).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&db.slot()),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // The pending request shows in status; another one says what it replaces.
    let out = run_with_deadline(cmd(&["status"]), 30).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("will skip the source transaction committed at FF/0"),
        "{text}"
    );
    let out = run_with_deadline(cmd(&["skip", "--lsn", "FF/1", "--force"]), 30).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        text.contains("replaces the request to skip the transaction committed at FF/0"),
        "{text}"
    );
    // The password file named there is read (here: it is missing, and the error says so).
    write("target_password_file = \"/nonexistent/pgapply-password\"");
    let out = run_with_deadline(cmd(&["status"]), 30).await;
    assert_eq!(
        out.status.code(),
        Some(2),
        "a setting that does not work: exit 2"
    );
    assert!(
        stderr(&out).contains("/nonexistent/pgapply-password"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_file(&config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_table_without_the_sources_key_is_named_by_check_and_run() {
    let db = TestDb::new("nokey").await;
    // The target made from pre-data only: no primary key, no index.
    db.source_sql(
        "CREATE TABLE k (id int PRIMARY KEY, v text); \
         CREATE TABLE f (x int, v text); ALTER TABLE f REPLICA IDENTITY FULL; \
         CREATE TABLE n (x int, v text); \
         CREATE TABLE u (a int NOT NULL, v text); CREATE UNIQUE INDEX u_a ON u (a); \
         CREATE TABLE ok (id int PRIMARY KEY, v text); \
         CREATE TABLE h (id int PRIMARY KEY, c int NOT NULL); CREATE UNIQUE INDEX h_c ON h (c); \
         ALTER TABLE h REPLICA IDENTITY USING INDEX h_c; \
         CREATE TABLE nothing (id int PRIMARY KEY); ALTER TABLE nothing REPLICA IDENTITY NOTHING; \
         CREATE TABLE dpk (id int, CONSTRAINT dpk_pkey PRIMARY KEY (id) DEFERRABLE);",
    )
    .await;
    db.target_sql(
        "CREATE TABLE k (id int, v text); CREATE TABLE f (x int, v text); \
         CREATE TABLE n (x int, v text); CREATE TABLE ok (id int PRIMARY KEY, v text); \
         CREATE TABLE u (a int NOT NULL, v text); CREATE TABLE h (id int PRIMARY KEY, c int NOT NULL); \
         CREATE TABLE nothing (id int PRIMARY KEY); CREATE TABLE dpk (id int PRIMARY KEY);",
    )
    .await;
    // n: no key and the default identity, so the source allows only INSERTs into it: no row is
    // ever looked up there, and nothing is to be said about its indexes.
    db.publish("CREATE PUBLICATION p FOR TABLE k, f, n, ok, u, h, nothing, dpk")
        .await;
    let out = run_with_deadline(
        db.on_both("check", &["--slot", &db.slot(), "--create-slot"]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let warning = |table: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("WARNING")
                    && l.contains(&format!("target table \"public\".\"{table}\" has no"))
            })
            .map(str::to_owned)
    };
    let k = warning("k").unwrap_or_else(|| panic!("{text}"));
    assert!(
        k.contains("ADD PRIMARY KEY (\"id\")") && k.contains("reads the whole table"),
        "{text}"
    );
    // Beside the target's own primary key, the source's key is a unique index.
    let h = warning("h").unwrap_or_else(|| panic!("{text}"));
    assert!(
        h.contains("CREATE UNIQUE INDEX ON \"public\".\"h\" (\"c\")"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l
            .contains("table \"public\".\"nothing\" has REPLICA IDENTITY NOTHING")
            && l.contains("REPLICA IDENTITY DEFAULT (its primary key)")),
        "{text}"
    );
    let f = warning("f").unwrap_or_else(|| panic!("{text}"));
    assert!(f.contains("REPLICA IDENTITY FULL"), "{text}");
    assert!(warning("ok").is_none(), "{text}");
    assert!(warning("n").is_none(), "{text}");
    // A source table without a replica identity, but with an index that could be one: named.
    let source_warning = |table: &str| {
        text.lines()
            .find(|l| l.contains(&format!("table \"public\".\"{table}\" has no primary key (a DEFERRABLE one does not count) and no replica identity on the source")))
            .map(str::to_owned)
    };
    let u = source_warning("u").unwrap_or_else(|| panic!("{text}"));
    assert!(
        u.contains("ALTER TABLE \"public\".\"u\" REPLICA IDENTITY USING INDEX u_a"),
        "{u}"
    );
    // A DEFERRABLE primary key is no replica identity (the source refuses UPDATEs).
    assert!(source_warning("dpk").is_some(), "{text}");
    let n = source_warning("n").unwrap_or_else(|| panic!("{text}"));
    assert!(!n.contains("USING INDEX"), "{n}");
    assert!(
        text.contains("table \"public\".\"ok\" matches on the target"),
        "{text}"
    );

    db.source_sql(
        "INSERT INTO k SELECT g, 'a' FROM generate_series(1, 5) g; \
         INSERT INTO f SELECT g, 'a' FROM generate_series(1, 5) g; \
         INSERT INTO n SELECT g, 'a' FROM generate_series(1, 5) g; \
         UPDATE k SET v = 'b' WHERE id = 2; DELETE FROM f WHERE x = 3;",
    )
    .await;
    let run = db.sync("p").await;
    let log = String::from_utf8_lossy(&run.stderr).to_string();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("target table \"public\".\"k\" has no primary key")),
        "{log}"
    );
    assert!(
        log.lines().any(|l| l.contains("WARN") && l.contains("target table \"public\".\"f\" has no index")),
        "{log}"
    );
    assert!(!log.contains("\"public\".\"n\" has no"), "{log}");
    db.assert_same("k").await;
    db.assert_same("n").await;
    db.assert_same("f").await;
}

/// A table locked on the source holds up the start: said, naming the session that holds the
/// lock, and a stop ends the wait at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_lock_at_the_start_is_named_and_a_stop_ends_the_wait() {
    let db = TestDb::new("srclockwait").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let holder = common::connect(db.source_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let holder_pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let (mut child, log) = common::spawn_logged(db.pgapply("p", &["--create-slot"]));
    wait_for("the source lock wait to be said", 60, || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines().any(|l| {
            l.contains("reading the published tables on the source waits for a lock")
                && l.contains(&format!("held by process {holder_pid}"))
        })
    })
    .await;
    // A stop ends the wait at once (not after the 30 s grace), and cleanly.
    common::signal(&child, libc::SIGTERM);
    let status = tokio::time::timeout(std::time::Duration::from_secs(15), child.wait())
        .await
        .expect("pgapply stops while it waits for the source's lock")
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{text}");
    holder.batch_execute("ROLLBACK").await.unwrap();
}

/// Killed while its target session waits for a user's lock: that session stays (it holds the
/// replication origin) until the lock is released. The next start says so, naming the lock's
/// holder, instead of "another pgapply running", and goes on once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_left_waiting_for_a_lock_is_named_at_the_next_start() {
    let db = TestDb::new("leftlock").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1, 'a')").await;
    db.sync("p").await;
    let origins: i64 = db
        .count(
            &db.target,
            "SELECT count(*) FROM pg_replication_origin WHERE roname LIKE 'pgapply%'",
        )
        .await;
    if origins == 0 {
        // (Progress in a table: no origin to hold.)
        return;
    }
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let holder_pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let mut first = spawn(db.pgapply("p", &[]));
    db.source_sql("INSERT INTO t VALUES (2, 'b')").await;
    wait_for("pgapply's session to wait for the lock", 60, || async {
        db.count(
            &db.target,
            // (This database's: another test's pgapply may wait on a lock in the cluster.)
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgapply' AND wait_event_type = 'Lock' \
             AND datname = current_database()",
        )
        .await
            > 0
    })
    .await;
    first.start_kill().unwrap();
    let _ = first.wait().await;
    let (mut second, log) = common::spawn_logged(db.pgapply("p", &[]));
    let named = |text: &str| {
        text.lines().any(|l| {
            l.contains("which waits for a lock held by target process(es)")
                && l.contains(&holder_pid.to_string())
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if named(&text) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the left session and the lock's holder were not named:\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    holder.batch_execute("COMMIT").await.unwrap();
    wait_for("the change after the lock", 60, || async {
        let (s, t) = db.digest("t").await;
        s == t
    })
    .await;
    let _ = second.start_kill();
}

/// A target user's lock holds applying up: said in the log after a few seconds, naming the
/// table and the process holding it, even under a role's lock_timeout and statement_timeout
/// (which must not make pgapply give up: it waits), and said again when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_users_lock_is_waited_for_and_named() {
    let db = TestDb::new("lockwait").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.target_sql(&format!(
        "ALTER DATABASE {} SET lock_timeout = '500ms'; ALTER DATABASE {} SET statement_timeout = '1s'",
        db.name, db.name
    ))
    .await;
    // (14+: idle sessions ended after 1 s, the heartbeat's and the apply sessions' among them.)
    if common::clusters().target_major >= 14 {
        db.target_sql(&format!(
            "ALTER DATABASE {} SET idle_session_timeout = '1s'",
            db.name
        ))
        .await;
    }
    db.source_sql("INSERT INTO t VALUES (1, 'a')").await;
    db.sync("p").await;
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("SET lock_timeout = 0; SET statement_timeout = 0; BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let holder_pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let (mut child, log) = common::spawn_logged(db.pgapply("p", &[]));
    db.source_sql("INSERT INTO t VALUES (2, 'b'); UPDATE t SET v = 'c' WHERE id = 1")
        .await;
    wait_for("the lock wait to be said", 60, || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines().any(|l| {
            l.contains("applying waits for a lock on table t on the target")
                && l.contains(&format!("held by target process(es) {holder_pid}"))
        })
    })
    .await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "pgapply gave up: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    holder.batch_execute("COMMIT").await.unwrap();
    wait_for("the changes after the lock", 60, || async {
        let (s, t) = db.digest("t").await;
        s == t
    })
    .await;
    wait_for("the end of the wait to be said", 30, || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("applying no longer waits for a lock on the target")
    })
    .await;
    if common::clusters().target_major >= 14 {
        // pgapply's sessions outlive the database's idle_session_timeout, and keep applying.
        wait_for(
            "a pgapply session idle past idle_session_timeout",
            30,
            || async {
                db.count(
                    &db.target,
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND application_name = 'pgapply' AND state = 'idle' \
                 AND now() - state_change > interval '1.5 s'",
                )
                .await
                    > 0
            },
        )
        .await;
        db.source_sql("INSERT INTO t VALUES (3, 'd')").await;
        wait_for("the change after the idle time", 60, || async {
            let (s, t) = db.digest("t").await;
            s == t
        })
        .await;
    }
    common::signal(&child, libc::SIGTERM);
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), child.wait())
        .await
        .expect("pgapply stops")
        .unwrap();
    assert!(status.success(), "{status}");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !text.contains("lock timeout")
            && !text.contains("statement timeout")
            && !text.contains("transient error"),
        "{text}"
    );
}

/// The target's notices: a trigger's RAISE WARNING reaches the log, its RAISE NOTICE does not
/// (nor the server's warnings about pgapply's own statements); from the debug level on, both do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_warnings_are_logged_and_notices_left_out() {
    let db = TestDb::new("notices").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.target_sql(
        "CREATE FUNCTION talk() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           RAISE NOTICE 'quiet notice from the trigger'; RAISE WARNING 'loud warning from the trigger'; \
           RETURN NEW; END $$; \
         CREATE TRIGGER talk BEFORE INSERT ON t FOR EACH ROW EXECUTE PROCEDURE talk(); \
         ALTER TABLE t ENABLE ALWAYS TRIGGER talk;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", &endpos]), 60).await;
    let log = stderr(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("loud warning from the trigger") && !log.contains("quiet notice"),
        "{log}"
    );
    db.source_sql("INSERT INTO t VALUES (2)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--endpos", &endpos, "--log-level", "debug"]),
        60,
    )
    .await;
    assert!(
        stderr(&out).contains("quiet notice from the trigger"),
        "{}",
        stderr(&out)
    );
    // A server's WARNING is a warning: shown at --log-level warn, as one.
    db.source_sql("INSERT INTO t VALUES (3)").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--endpos", &endpos, "--log-level", "warn"]),
        60,
    )
    .await;
    let log = stderr(&out);
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("loud warning from the trigger"))
            && !log.contains("quiet notice"),
        "{log}"
    );
}

/// After a restart, before anything is applied (the target table locked), the lag in seconds is
/// the age of the last commit the target recorded, and the applied position is the recorded one,
/// not 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_restart_start_from_the_recorded_position() {
    let db = TestDb::new("obsrestart").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.sync("p").await;
    // The last applied commit grows old (a source idle for a while; time has to pass here):
    // the lag of the next change counts from that change's own commit, not from this one.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let before_second = std::time::Instant::now();
    db.source_sql("INSERT INTO t VALUES (2)").await;
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = spawn(db.pgapply("p", &["--metrics-addr", &addr]));
    let lag = std::sync::Mutex::new(0.0);
    wait_for("a lag in seconds while the table is locked", 60, || async {
        let Ok(m) = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                Ok(_) => Some(http_get(port, "/metrics").await),
                Err(_) => None,
            }
        })
        .await
        else {
            return false;
        };
        m.is_some_and(|m| {
            *lag.lock().unwrap() = metric(&m, "pgapply_lag_seconds");
            metric(&m, "pgapply_lag_seconds") > 0.0 && metric(&m, "pgapply_applied_lsn") > 0.0
        })
    })
    .await;
    let lag = *lag.lock().unwrap();
    assert!(
        lag <= before_second.elapsed().as_secs_f64() + 1.0,
        "lag {lag} s counts from before the waiting change ({:?} ago)",
        before_second.elapsed()
    );
    holder.batch_execute("COMMIT").await.unwrap();
    wait_for("the row", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 2
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
}

/// While a run waits to retry (the target refusing connections), the lag in seconds keeps
/// growing from the commit of the transaction it could not apply, instead of standing still at
/// the last figure computed before the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_in_seconds_grows_while_the_target_is_away() {
    let db = TestDb::new("obsaway").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    // The change stays pending: its table is locked on the target.
    let holder = common::connect(db.target_port, &db.name).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = spawn(db.pgapply("p", &["--metrics-addr", &addr]));
    let metrics = || async {
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                Ok(_) => Some(http_get(port, "/metrics").await),
                Err(_) => None,
            }
        })
        .await
        .ok()
        .flatten()
    };
    wait_for("the worker to stream", 60, || async {
        metrics()
            .await
            .is_some_and(|m| metric(&m, "pgapply_streaming") == 1.0)
    })
    .await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    wait_for("a lag in seconds", 60, || async {
        metrics()
            .await
            .is_some_and(|m| metric(&m, "pgapply_lag_seconds") > 0.0)
    })
    .await;
    // The target goes away for the worker: no new connections, its sessions ended.
    let admin = common::connect(db.target_port, "postgres").await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{0}\" ALLOW_CONNECTIONS false; SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{0}' AND application_name = 'pgapply'",
            db.name
        ))
        .await
        .unwrap();
    let away = std::sync::Mutex::new(None::<f64>);
    wait_for(
        "the lag to grow by 2 s while the run waits to retry",
        60,
        || async {
            let Some(m) = metrics().await else {
                return false;
            };
            if metric(&m, "pgapply_streaming") != 0.0 {
                return false;
            }
            let lag = metric(&m, "pgapply_lag_seconds");
            let mut first = away.lock().unwrap();
            match *first {
                None => {
                    *first = Some(lag);
                    false
                }
                Some(first) => lag >= first + 2.0,
            }
        },
    )
    .await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" ALLOW_CONNECTIONS true",
            db.name
        ))
        .await
        .unwrap();
    holder.batch_execute("COMMIT").await.unwrap();
    wait_for("the row, and no lag", 120, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 1
            && metrics()
                .await
                .is_some_and(|m| metric(&m, "pgapply_lag_seconds") == 0.0)
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
}

/// `pgapply forget` removes a retired slot's state and origins from the target (refused while a
/// worker of it runs), and with --drop-slot its slot on the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_removes_a_slots_state_and_origins() {
    let db = TestDb::new("forget").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    let mut worker = spawn(db.pgapply("p", &["--apply-workers", "2"]));
    wait_for("the worker to apply", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 1
            && db
                .count(
                    &db.target,
                    "SELECT count(*) FROM pgapply.progress WHERE state = 'streaming'",
                )
                .await
                == 1
    })
    .await;
    let forget = |extra: &[&str]| {
        let mut c = pgapply();
        c.args([
            "forget",
            "--target",
            &db.target_conninfo(),
            "--slot",
            &db.slot(),
        ])
        .args(extra);
        c
    };
    let out = run_with_deadline(forget(&[]), 30).await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("a worker runs for slot"),
        "{}",
        stderr(&out)
    );
    common::signal(&worker, libc::SIGTERM);
    assert!(worker.wait().await.unwrap().success());
    // A run that fails and exits (--copy-data into a used slot) leaves no worker behind: the
    // forget it points to is not refused as if one ran.
    let out = run_with_deadline(db.pgapply("p", &["--copy-data"]), 60).await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("pgapply forget --slot {} --drop-slot", db.slot())),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE state = 'failed' AND heartbeat_at > now() - interval '30 seconds'"
        )
        .await,
        1
    );
    let origins = format!(
        "SELECT count(*) FROM pg_replication_origin WHERE roname LIKE 'pgapply\\_{}%'",
        db.slot().replace('_', "\\_")
    );
    assert!(db.count(&db.target, &origins).await >= 2);
    // The wrong --source (another cluster, with a slot of the same name): refused before
    // anything is removed, and that slot stays.
    let wal_level: String = db
        .target
        .query_one("SHOW wal_level", &[])
        .await
        .unwrap()
        .get(0);
    if wal_level == "logical" {
        db.target
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&db.slot()],
            )
            .await
            .unwrap();
        let out = run_with_deadline(
            forget(&["--drop-slot", "--source", &db.target_conninfo()]),
            30,
        )
        .await;
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("Nothing was removed"),
            "{}",
            stderr(&out)
        );
        assert!(db.count(&db.target, &origins).await >= 2);
        db.target
            .execute("SELECT pg_drop_replication_slot($1)", &[&db.slot()])
            .await
            .unwrap();
    }
    let out = run_with_deadline(
        forget(&["--drop-slot", "--source", &db.source_conninfo()]),
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.contains("dropped replication slot"), "{text}");
    assert_eq!(db.count(&db.target, &origins).await, 0);
    assert_eq!(
        db.count(&db.target, "SELECT count(*) FROM pgapply.progress")
            .await,
        0
    );
    assert_eq!(db.slot_count().await, 0);
    // A new start from scratch works.
    db.target_sql("TRUNCATE t").await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply("p", &["--copy-data", "--create-slot", "--endpos", &endpos]),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("t").await;
}

/// `forget --drop-slot` drops only a slot pgapply streamed from into this target: a run given
/// another tool's slot name fails and leaves a row, and the cleanup that follows must not drop
/// that tool's slot (physical, another plugin, or a pgoutput slot nothing was applied from).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_drops_no_slot_of_another_replication() {
    let db = TestDb::new("forgetother").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source
        .execute(
            "SELECT pg_create_logical_replication_slot('other_td', 'test_decoding')",
            &[],
        )
        .await
        .unwrap();
    db.source
        .execute(
            "SELECT pg_create_physical_replication_slot('other_phys')",
            &[],
        )
        .await
        .unwrap();
    db.source
        .execute(
            "SELECT pg_create_logical_replication_slot('other_sub', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    // The misspelt run: refused, its row left behind.
    let mut run = pgapply();
    run.args([
        "run",
        "--source",
        &db.source_conninfo(),
        "--target",
        &db.target_conninfo(),
        "--publication",
        "p",
        "--slot",
        "other_td",
        "--max-retries",
        "0",
    ]);
    let out = run_with_deadline(run, 60).await;
    assert!(!out.status.success(), "{}", stderr(&out));
    // Another tool's pgoutput slot whose name a run took and left at once.
    db.target_sql(
        "INSERT INTO pgapply.progress (slot_name, state) VALUES ('other_phys', 'failed'), ('other_sub', 'failed')",
    )
    .await;
    let forget = |slot: &str, extra: &[&str]| {
        let mut c = pgapply();
        c.args(["forget", "--target", &db.target_conninfo(), "--slot", slot])
            .args(extra);
        c
    };
    for (slot, said) in [
        ("other_td", "a logical slot of plugin \"test_decoding\""),
        ("other_phys", "a physical slot"),
        ("other_sub", "records no position applied from it"),
    ] {
        let out = run_with_deadline(
            forget(slot, &["--drop-slot", "--source", &db.source_conninfo()]),
            30,
        )
        .await;
        assert_eq!(out.status.code(), Some(1), "{slot}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(said) && stderr(&out).contains("Nothing was removed"),
            "{slot}: {}",
            stderr(&out)
        );
        assert_eq!(
            db.count(
                &db.source,
                &format!("SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}'")
            )
            .await,
            1,
            "{slot} stays"
        );
        // Without --drop-slot the target's row goes, and the slot stays.
        let out = run_with_deadline(forget(slot, &[]), 30).await;
        assert!(out.status.success(), "{slot}: {}", stderr(&out));
        assert_eq!(
            db.count(
                &db.target,
                &format!("SELECT count(*) FROM pgapply.progress WHERE slot_name = '{slot}'")
            )
            .await,
            0
        );
    }
    // A slot the target never heard of: said as such.
    let out = run_with_deadline(
        forget(
            "other_sub",
            &["--drop-slot", "--source", &db.source_conninfo()],
        ),
        30,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("this target holds no state for it"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        db.count(
            &db.source,
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'other%'"
        )
        .await,
        3
    );
    // A slot neither side has: nothing to do, said so (no advice to drop what is not there).
    let out = run_with_deadline(
        forget(
            "no_such_slot",
            &["--drop-slot", "--source", &db.source_conninfo()],
        ),
        30,
    )
    .await;
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        said.contains("the target holds nothing for slot no_such_slot")
            && said.contains("the source has no replication slot no_such_slot")
            && !said.contains("pg_drop_replication_slot"),
        "{said}"
    );
    // skip for it: the unknown slot is what is said (not "add --force").
    let mut skip = pgapply();
    skip.args([
        "skip",
        "--target",
        &db.target_conninfo(),
        "--slot",
        "no_such_slot",
        "--lsn",
        "0/1",
    ]);
    let out = run_with_deadline(skip, 30).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the target has no pgapply progress for slot \"no_such_slot\"")
            && !stderr(&out).contains("--force"),
        "{}",
        stderr(&out)
    );
}

/// A worker waiting to try again after a failure still runs: its heartbeat goes on, `forget`
/// refuses its slot, and a stop meanwhile is recorded as one (then `forget` goes ahead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_between_attempts_still_counts_as_running() {
    let db = TestDb::new("forgetwait").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.target_sql(
        "CREATE FUNCTION busy() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           RAISE EXCEPTION 'try again later' USING ERRCODE = 'serialization_failure'; END $$; \
         CREATE TRIGGER busy BEFORE INSERT ON t FOR EACH ROW EXECUTE PROCEDURE busy(); \
         ALTER TABLE t ENABLE ALWAYS TRIGGER busy;",
    )
    .await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let (mut worker, log_path) = common::spawn_logged(db.pgapply(
        "p",
        &[
            "--retry-min",
            "1m",
            "--retry-max",
            "1m",
            "--metrics-addr",
            &addr,
        ],
    ));
    let pid = worker.id().unwrap() as i32;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    wait_for("the worker to wait for its next attempt", 60, || async {
        db.target
            .query_one(
                "SELECT count(*) FROM pgapply.progress WHERE state = 'failed' AND pid = $1",
                &[&pid],
            )
            .await
            .is_ok_and(|r| r.get::<_, i64>(0) == 1)
    })
    .await;
    // status says it waits.
    let out = run_with_deadline(
        common::pgapply_command(&["status", "--target", &db.target_conninfo()]),
        30,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains(&format!(
            "slot {}: failed (the process waits to try again), pid {pid}",
            db.slot()
        )),
        "{text}"
    );
    // The lag in bytes of a new slot whose first transaction fails counts from where it began
    // reading, not from the start of the source's WAL.
    let m = common::http_get(port, "/metrics").await;
    let lag = common::metric(&m, "pgapply_lag_bytes");
    assert!(lag > 0.0 && lag < 1e6, "{m}");
    let forget = || {
        let mut c = pgapply();
        c.args([
            "forget",
            "--target",
            &db.target_conninfo(),
            "--slot",
            &db.slot(),
        ]);
        c
    };
    let out = run_with_deadline(forget(), 30).await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!(
            "a worker runs for slot {:?} (process {pid})",
            db.slot()
        )),
        "{}",
        stderr(&out)
    );
    common::signal(&worker, libc::SIGTERM);
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), worker.wait())
        .await
        .expect("the worker stops on SIGTERM while it waits")
        .unwrap();
    assert!(status.success(), "worker exit: {status}");
    // Its log ends as any run's does.
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        log.contains("replication stopped while waiting to start again")
            && log
                .trim_end()
                .lines()
                .last()
                .is_some_and(|l| l.contains("done")),
        "{log}"
    );
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE state = 'stopped' AND pid IS NULL"
        )
        .await,
        1
    );
    let out = run_with_deadline(forget(), 30).await;
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `check` against a target without any of the published tables says so once, with the way to
/// create them, and its error line does not repeat every problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_of_an_empty_target_points_to_schema() {
    let db = TestDb::new("chkempty").await;
    db.source_sql(
        "CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY); \
         CREATE PUBLICATION p FOR TABLE a, b;",
    )
    .await;
    let out = run_with_deadline(
        db.on_both("check", &["--slot", &db.slot(), "--create-slot"]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    let problems: Vec<&str> = text.lines().filter(|l| l.starts_with("PROBLEM")).collect();
    assert_eq!(problems.len(), 1, "{text}");
    assert!(
        problems[0].contains("none of the 2 published tables exists on the target")
            && problems[0].contains("pgapply schema"),
        "{text}"
    );
    assert!(stderr(&out).contains("1 problem found"), "{}", stderr(&out));
}

/// A second worker started by mistake (another --slot, the same publication, the same target
/// database) while the first runs: said at its start, naming the other slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_on_the_same_publication_and_target_is_named() {
    let db = TestDb::new("twoworkers").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.sync("p").await;
    let mut first = spawn(db.pgapply("p", &[]));
    db.wait_slot_active().await;
    wait_for("the first worker's heartbeat", 60, || async {
        db.count(
            &db.target,
            &format!(
                "SELECT count(*) FROM pgapply.progress WHERE slot_name = '{}' AND heartbeat_at > now() - interval '1 minute'",
                db.slot()
            ),
        )
        .await
            > 0
    })
    .await;
    let second = format!("{}_2", db.slot());
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_via(
            &db.source_conninfo(),
            &db.target_conninfo(),
            &second,
            "p",
            &["--create-slot", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    let err = stderr(&out);
    first.start_kill().unwrap();
    let _ = first.wait().await;
    let _ = db
        .source
        .execute("SELECT pg_drop_replication_slot($1)", &[&second])
        .await;
    assert!(
        err.contains(&format!(
            "another pgapply worker (slot \"{}\") applies the same publication into this target database now",
            db.slot()
        )) && err.contains(&format!("pgapply forget --slot {second} --drop-slot")),
        "{err}"
    );
}

/// A table in the publications of two workers of one source into one target (another
/// publication, another slot): `check` and the second worker's start name it and the other slot
/// (each change would be applied twice, and updates could land out of order). A table only one
/// of them publishes is not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_two_workers_publish_into_one_target_is_named() {
    let db = TestDb::new("overlap").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.both("CREATE TABLE u (id int PRIMARY KEY)").await;
    db.both("CREATE TABLE w (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t, u").await;
    db.source
        .batch_execute("CREATE PUBLICATION q FOR TABLE u, w")
        .await
        .unwrap();
    db.sync("p").await;
    let second = format!("{}_q", db.slot());
    let (source, target) = (db.source_conninfo(), db.target_conninfo());
    let shared = format!(
        "source table(s) \"public\".\"u\" are published both by this worker's publication(s) q and by publication(s) p of slot \"{}\"",
        db.slot()
    );
    // `check` of the second worker (publication q, its slot), with `extra` options.
    let check_q = |extra: &[&str]| {
        let mut args = vec!["--slot", second.as_str(), "--create-slot"];
        args.extend_from_slice(extra);
        run_with_deadline(db.on_both_publication("check", "q", &args), 60)
    };
    let out = check_q(&[]).await;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(
        said.contains(&shared) && !said.contains("\"public\".\"w\" are"),
        "{said}"
    );
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_via(
            &source,
            &target,
            &second,
            "q",
            &["--create-slot", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    let _ = db
        .source
        .execute("SELECT pg_drop_replication_slot($1)", &[&second])
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains(&shared), "{}", stderr(&out));
    // A table this worker maps onto a table of its own: named only once the other slot is
    // known to write that table too.
    let config = std::env::temp_dir().join(format!("pgapply-overlap-{}.toml", db.name));
    std::fs::write(&config, "[tables.\"public.u\"]\ntarget = \"public.u2\"\n").unwrap();
    db.target_sql("CREATE TABLE u2 (id int PRIMARY KEY)").await;
    let config = config.to_str().unwrap();
    let out = check_q(&["--config", config]).await;
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!said.contains("\"public\".\"u\" are published"), "{said}");
    db.target_sql(&format!(
        "INSERT INTO pgapply.slot_tables VALUES ('{}', 'public', 'u2')",
        db.slot()
    ))
    .await;
    let out = check_q(&["--config", config]).await;
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(said.contains(&shared), "{said}");
}

/// A reload signal sent to every pgapply process (a service manager's reload) does not end a
/// command other than `run` half-way: it is said and ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_does_not_end_other_commands() {
    // A server that takes the connection and never answers: `status` waits on it.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let target = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
    let log = std::env::temp_dir().join(format!("pgapply-hup-{}.log", std::process::id()));
    let mut cmd = pgapply();
    cmd.args(["status", "--target", &target])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut child = cmd.spawn().unwrap();
    let (mut accepted, _) = silent.accept().unwrap();
    // Its first bytes (the startup or TLS request) come after the handler is set up: the
    // runtime runs that task at the command's first wait, the connect.
    let mut first = [0u8; 8];
    std::io::Read::read_exact(&mut accepted, &mut first).unwrap();
    let pid = child.id().unwrap() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    wait_for("the signal to be said", 30, || async {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("SIGHUP: nothing to reload for this command")
    })
    .await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "status ended on SIGHUP"
    );
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let _ = std::fs::remove_file(&log);
}

/// A password rotated while pgapply runs: the password file is read again when a run starts
/// again (as libpq reads its sources at each connection), so the reconnect after the rotation
/// succeeds without a restart of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_password_file_is_read_again_on_reconnect() {
    let db = TestDb::new("rotate").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let role = format!("rot_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN SUPERUSER PASSWORD 'one'"
    ))
    .await;
    let file = std::env::temp_dir().join(format!("pgapply-rotate-{}", std::process::id()));
    std::fs::write(&file, "one\n").unwrap();
    let target = format!(
        "host=127.0.0.1 port={} user={role} dbname={}",
        db.target_port, db.name
    );
    let mut worker = spawn(db.pgapply_via(
        &db.source_conninfo(),
        &target,
        &db.slot(),
        "p",
        &["--target-password-file", file.to_str().unwrap()],
    ));
    db.source_sql("INSERT INTO t VALUES (1)").await;
    wait_for("the first row", 60, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 1
    })
    .await;
    db.target_sql(&format!("ALTER ROLE {role} PASSWORD 'two'"))
        .await;
    std::fs::write(&file, "two\n").unwrap();
    db.target_sql(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
    ))
    .await;
    db.source_sql("INSERT INTO t VALUES (2)").await;
    wait_for("the row after the rotation", 90, || async {
        db.count(&db.target, "SELECT count(*) FROM t").await == 2
    })
    .await;
    common::signal(&worker, libc::SIGTERM);
    assert!(worker.wait().await.unwrap().success());
    let _ = std::fs::remove_file(&file);
}

/// With several hosts in a connection string, `check` says which one it reached, as the
/// description names the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_the_host_it_reached() {
    let db = TestDb::new("checkhosts").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let down = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let target = format!(
        "host=127.0.0.1,127.0.0.1 port={down},{} user=postgres dbname={}",
        db.target_port, db.name
    );
    let out = run_with_deadline(
        common::pgapply_command(&[
            "check",
            "--source",
            &db.source_conninfo(),
            "--target",
            &target,
            "--publication",
            "p",
            "--slot",
            &db.slot(),
        ]),
        60,
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains(&format!(
            "reachable (connected to 127.0.0.1:{})",
            db.target_port
        )),
        "{text}{}",
        stderr(&out)
    );
    // And `run`'s start line.
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_via(
            &db.source_conninfo(),
            &target,
            &db.slot(),
            "p",
            &["--create-slot", "--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("(connected to 127.0.0.1:{})", db.target_port)),
        "{}",
        stderr(&out)
    );
}

/// A role's statement_timeout and lock_timeout (set for the applications) reach none of
/// pgapply's target sessions: its bookkeeping (catalog reads, progress, heartbeat) failed under
/// them, and the run stopped (exit 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roles_timeouts_do_not_reach_pgapplys_sessions() {
    let db = TestDb::new("roletimeouts").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let role = format!("to_{}", db.name);
    db.target_sql(&format!(
        "CREATE ROLE {role} LOGIN SUPERUSER PASSWORD 't'; \
         ALTER ROLE {role} IN DATABASE {db} SET statement_timeout = '1ms'; \
         ALTER ROLE {role} IN DATABASE {db} SET lock_timeout = '1ms';",
        db = db.name
    ))
    .await;
    db.source_sql("INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1, 2000) g; UPDATE t SET v = 'x' WHERE id % 7 = 0")
        .await;
    let endpos = db.source_wal().await;
    let out = run_with_deadline(
        db.pgapply_as_target_user(&role, "t", &["--endpos", &endpos, "--max-retries", "1"]),
        90,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    db.assert_same("t").await;
}

/// A pgapply worker replicating from the target back into the source (its state on the source)
/// and this run taking every origin: `check` and `run` say the changes would go round for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_loop_without_origin_none_is_named() {
    let db = TestDb::new("loopback").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    let target_id: String = db
        .target
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // The way back's state, as a worker from the target into the source keeps it there: first
    // one whose publication (on the target) publishes only a table this run does not write.
    db.both("CREATE TABLE u (id int PRIMARY KEY)").await;
    db.target
        .batch_execute("CREATE PUBLICATION back_pub FOR TABLE u")
        .await
        .unwrap();
    db.source_sql(&format!(
        "CREATE SCHEMA pgapply; \
         CREATE TABLE pgapply.progress (slot_name text PRIMARY KEY, source_system_id text, source_database text, stop_lsn pg_lsn, publications text[]); \
         INSERT INTO pgapply.progress VALUES ('back_slot', '{target_id}', '{}', NULL, '{{back_pub}}')",
        db.name
    ))
    .await;
    let said = "a pgapply worker (slot \"back_slot\") replicates from this target into this source";
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains(said), "{text}");
    let out = db.sync("p").await;
    assert!(!stderr(&out).contains(said), "{}", stderr(&out));
    // Then it publishes t as well: what this run applies to t goes back.
    db.target
        .batch_execute("ALTER PUBLICATION back_pub ADD TABLE t")
        .await
        .unwrap();
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(said), "{text}");
    let out = db.sync("p").await;
    assert!(stderr(&out).contains(said), "{}", stderr(&out));
    // A worker whose publications are not recorded (an older pgapply's state) counts too.
    db.source_sql("UPDATE pgapply.progress SET publications = NULL")
        .await;
    db.target
        .batch_execute("ALTER PUBLICATION back_pub DROP TABLE t")
        .await
        .unwrap();
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(said), "{text}");
}

/// A worker killed with kill -9, then a run whose end position is applied already: it records
/// the slot stopped (nothing streams it), so `status` and `forget` do not take the dead process
/// for a live worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_position_applied_already_records_a_killed_worker_stopped() {
    let db = TestDb::new("deadrow").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t VALUES (1)").await;
    db.sync("p").await;
    let mut child = spawn(db.pgapply("p", &[]));
    db.wait_slot_active().await;
    let pid = child.id().unwrap() as i32;
    wait_for("the worker's row", 60, || async {
        db.count(
            &db.target,
            &format!(
                "SELECT count(*) FROM pgapply.progress WHERE pid = {pid} AND state = 'streaming'"
            ),
        )
        .await
            == 1
    })
    .await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let slot = db.slot();
    wait_for("the slot to be let go", 60, || async {
        db.count(
            &db.source,
            &format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}' AND active"
            ),
        )
        .await
            == 0
    })
    .await;
    let out = run_with_deadline(db.pgapply("p", &["--endpos", "0/1"]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        db.count(
            &db.target,
            "SELECT count(*) FROM pgapply.progress WHERE state = 'stopped' AND pid IS NULL"
        )
        .await,
        1
    );
}

/// A statement_timeout the target sets for every session (here the database's, 1 ms) does not
/// cut `status` and `check` short: they read the catalogs without it, as `run` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_check_are_not_cut_short_by_the_targets_statement_timeout() {
    let db = TestDb::new("stmttimeout").await;
    db.both("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.publish("CREATE PUBLICATION p FOR TABLE t").await;
    db.source_sql("INSERT INTO t SELECT generate_series(1, 10)")
        .await;
    db.sync("p").await;
    db.target_sql(&format!(
        "ALTER DATABASE {} SET statement_timeout = '1ms'",
        db.name
    ))
    .await;
    let out = run_with_deadline(
        common::pgapply_command(&["status", "--target", &db.target_conninfo()]),
        60,
    )
    .await;
    let status_ok = out.status.success();
    let status_err = stderr(&out);
    let out = run_with_deadline(db.on_both("check", &["--slot", &db.slot()]), 60).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    db.target_sql(&format!(
        "ALTER DATABASE {} RESET statement_timeout",
        db.name
    ))
    .await;
    assert!(status_ok, "{status_err}");
    assert!(!text.contains("statement timeout"), "{text}");
}
