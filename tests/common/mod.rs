//! Test harness: one source and one target cluster per test binary (started on first use, stopped
//! at exit), a fresh database pair per test, and pgapply run as a real process.
#![allow(dead_code)]

use std::process::Output;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pgapply::cluster::{find_pg_bin, LocalCluster};
use pgapply::compare::{table_digests, TableDigest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio_postgres::{Client, NoTls};

pub struct Clusters {
    pub source_port: u16,
    pub target_port: u16,
    pub source_dir: std::path::PathBuf,
    pub source_bin: std::path::PathBuf,
    pub target_dir: std::path::PathBuf,
    pub target_bin: std::path::PathBuf,
    pub source_major: u32,
    pub target_major: u32,
}

/// Source binaries: PGAPPLY_SOURCE_PG_BIN, else the default; target: PGAPPLY_TARGET_PG_BIN.
pub fn clusters() -> &'static Clusters {
    static CLUSTERS: OnceLock<Clusters> = OnceLock::new();
    CLUSTERS.get_or_init(|| {
        let default = find_pg_bin().expect("PostgreSQL binaries (set PGAPPLY_PG_BIN)");
        let source_bin = std::env::var_os("PGAPPLY_SOURCE_PG_BIN")
            .map(Into::into)
            .unwrap_or_else(|| default.clone());
        let target_bin = std::env::var_os("PGAPPLY_TARGET_PG_BIN")
            .map(Into::into)
            .unwrap_or(default);
        let target_bin_dir: std::path::PathBuf = target_bin;
        let source = LocalCluster::start(&source_bin, &[]).expect("start source cluster");
        let target = LocalCluster::start(&target_bin_dir, &[]).expect("start target cluster");
        let source_dir = source.data_dir.clone();
        let target_dir = target.data_dir.clone();
        let (source_port, _, source_major) = source.keep_until_exit();
        let (target_port, _, target_major) = target.keep_until_exit();
        Clusters {
            source_port,
            target_port,
            source_dir,
            source_bin,
            target_dir,
            target_bin: target_bin_dir,
            source_major,
            target_major,
        }
    })
}

pub async fn connect(port: u16, db: &str) -> Client {
    let conninfo = format!("host=127.0.0.1 port={port} user=postgres dbname={db}");
    let (client, connection) = tokio_postgres::connect(&conninfo, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {conninfo}: {e}"));
    tokio::spawn(connection);
    client
}

/// A connection, or `None` while the server is not accepting them.
pub async fn connect_maybe(port: u16, db: &str) -> Option<Client> {
    let conninfo = format!("host=127.0.0.1 port={port} user=postgres dbname={db}");
    let (client, connection) = tokio_postgres::connect(&conninfo, NoTls).await.ok()?;
    tokio::spawn(connection);
    Some(client)
}

/// A database of the same name on both clusters, and a slot name of its own.
pub struct TestDb {
    pub name: String,
    pub source_port: u16,
    pub target_port: u16,
    pub source: Client,
    pub target: Client,
}

impl TestDb {
    pub async fn new(prefix: &str) -> TestDb {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let c = clusters();
        let name = format!(
            "{prefix}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        for port in [c.source_port, c.target_port] {
            let admin = connect(port, "postgres").await;
            admin
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .await
                .expect("create database");
        }
        TestDb {
            source: connect(c.source_port, &name).await,
            target: connect(c.target_port, &name).await,
            source_port: c.source_port,
            target_port: c.target_port,
            name,
        }
    }

    /// New connections to the same databases (after a server restart).
    pub async fn reconnect(other: &TestDb) -> TestDb {
        TestDb {
            name: other.name.clone(),
            source_port: other.source_port,
            target_port: other.target_port,
            source: connect(other.source_port, &other.name).await,
            target: connect(other.target_port, &other.name).await,
        }
    }

    pub fn slot(&self) -> String {
        format!("slot_{}", self.name)
    }

    pub fn source_conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={}",
            self.source_port, self.name
        )
    }

    pub fn target_conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={}",
            self.target_port, self.name
        )
    }

    /// How many slots of this database's slot name the source has (0 or 1).
    pub async fn slot_count(&self) -> i64 {
        self.count(
            &self.source,
            &format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
                self.slot()
            ),
        )
        .await
    }

    /// The target database, reached as `user`.
    pub fn source_conninfo_as(&self, user: &str, password: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname={}",
            self.source_port, self.name
        )
    }

    pub fn target_conninfo_as(&self, user: &str, password: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname={}",
            self.target_port, self.name
        )
    }

    /// `pgapply run` of this database pair and slot with the target reached as `user`.
    pub fn pgapply_as_target_user(&self, user: &str, password: &str, extra: &[&str]) -> Command {
        let target = self.target_conninfo_as(user, password);
        self.pgapply_via(&self.source_conninfo(), &target, &self.slot(), "p", extra)
    }

    /// The same DDL on both sides.
    pub async fn both(&self, sql: &str) {
        self.source
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("source: {e}\n{sql}"));
        self.target
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("target: {e}\n{sql}"));
    }

    pub async fn source_sql(&self, sql: &str) {
        self.source
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("source: {e:?}\n{sql}"));
    }

    pub async fn target_sql(&self, sql: &str) {
        self.target
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("target: {e:?}\n{sql}"));
    }

    /// Creates the publication and the slot (before any workload, so all of it streams).
    pub async fn publish(&self, publication_sql: &str) {
        self.source_sql(publication_sql).await;
        self.source
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&self.slot()],
            )
            .await
            .expect("create slot");
    }

    pub async fn source_wal(&self) -> String {
        self.source
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .unwrap()
            .get(0)
    }

    /// `pgapply <command> --source .. --target .. --publication p <extra>` for this database.
    pub fn on_both(&self, command: &str, extra: &[&str]) -> Command {
        self.on_both_via(command, &self.target_conninfo(), extra)
    }

    /// `on_both` with the target reached as `user`.
    pub fn on_both_as_target_user(
        &self,
        command: &str,
        user: &str,
        password: &str,
        extra: &[&str],
    ) -> Command {
        self.on_both_via(command, &self.target_conninfo_as(user, password), extra)
    }

    fn on_both_via(&self, command: &str, target: &str, extra: &[&str]) -> Command {
        self.on_both_full(command, target, "p", extra)
    }

    /// `on_both` with another publication than `p`.
    pub fn on_both_publication(&self, command: &str, publication: &str, extra: &[&str]) -> Command {
        self.on_both_full(command, &self.target_conninfo(), publication, extra)
    }

    fn on_both_full(
        &self,
        command: &str,
        target: &str,
        publication: &str,
        extra: &[&str],
    ) -> Command {
        let source = self.source_conninfo();
        let mut args = vec![
            command,
            "--source",
            &source,
            "--target",
            target,
            "--publication",
            publication,
        ];
        args.extend_from_slice(extra);
        pgapply_command(&args)
    }

    /// `pgapply cutover` of this database's slot (60 s timeout) with `extra` options: expects
    /// success and returns what it printed.
    pub async fn cutover(&self, extra: &[&str]) -> String {
        let slot = self.slot();
        let mut args = vec!["--slot", slot.as_str(), "--timeout", "60s"];
        args.extend_from_slice(extra);
        let out = run_with_deadline(self.on_both("cutover", &args), 120).await;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{text}\n{}", stderr(&out));
        text
    }

    /// Drops this database's slot on the source once no walsender holds it (a pgapply that just
    /// exited may leave its walsender a moment longer).
    pub async fn drop_slot(&self) {
        self.drop_slot_named(&self.slot()).await;
    }

    /// `drop_slot` of another slot on this database's source.
    pub async fn drop_slot_named(&self, slot: &str) {
        wait_for("the slot to be released", 60, || async {
            self.source
                .query_one(
                    "SELECT NOT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
        })
        .await;
        self.source
            .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
            .expect("drop the slot");
    }

    /// Waits until a worker streams from this database's slot.
    pub async fn wait_slot_active(&self) {
        let slot = self.slot();
        // A slot being created is active already, but has no confirmed position until its
        // snapshot is consistent; a transaction prepared before that would be decoded only at
        // its COMMIT PREPARED (and one left open would keep the creation waiting).
        wait_for("the worker to stream", 60, || async {
            self.source
                .query_one(
                    "SELECT coalesce(bool_or(active AND confirmed_flush_lsn IS NOT NULL), false) FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
        })
        .await;
    }

    /// `pgapply run` against this database pair with the given publication and extra arguments.
    pub fn pgapply(&self, publication: &str, extra: &[&str]) -> Command {
        self.pgapply_via(
            &self.source_conninfo(),
            &self.target_conninfo(),
            &self.slot(),
            publication,
            extra,
        )
    }

    /// `pgapply run` with other connection strings or another slot than this pair's own.
    pub fn pgapply_via(
        &self,
        source: &str,
        target: &str,
        slot: &str,
        publication: &str,
        extra: &[&str],
    ) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
        cmd.arg("run")
            .arg("--source")
            .arg(source)
            .arg("--target")
            .arg(target)
            .arg("--publication")
            .arg(publication)
            .arg("--slot")
            .arg(slot)
            .args(["--status-interval", "1s"])
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("PGAPPLY_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .kill_on_drop(true);
        cmd
    }

    /// Runs pgapply up to the source's current WAL position and expects success.
    pub async fn sync(&self, publication: &str) -> Output {
        let endpos = self.source_wal().await;
        let out = run_with_deadline(self.pgapply(publication, &["--endpos", &endpos]), 120).await;
        assert!(
            out.status.success(),
            "pgapply failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    pub async fn digest(&self, table: &str) -> (TableDigest, TableDigest) {
        table_digests(&self.source, &self.target, table)
            .await
            .unwrap()
    }

    /// Source and target tables hold exactly the same rows.
    pub async fn assert_same(&self, table: &str) {
        let (s, t) = self.digest(table).await;
        if s != t {
            let q = format!("SELECT (r.*)::text FROM {table} r ORDER BY 1");
            let source_rows = rows(&self.source, &q).await;
            let target_rows = rows(&self.target, &q).await;
            panic!(
                "{table} differs: source {s:?} target {t:?}\nsource rows: {:?}\ntarget rows: {:?}",
                source_rows, target_rows
            );
        }
    }

    /// The slot has confirmed the source up to `lsn`.
    pub async fn slot_confirmed(&self, lsn: &str) -> bool {
        self.source
            .query_one(
                "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot(), &lsn],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false)
    }

    pub async fn count(&self, client: &Client, sql: &str) -> i64 {
        client.query_one(sql, &[]).await.unwrap().get(0)
    }
}

async fn rows(client: &Client, sql: &str) -> Vec<String> {
    client
        .query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect()
}

pub async fn run_with_deadline(mut cmd: Command, seconds: u64) -> Output {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn pgapply");
    match tokio::time::timeout(Duration::from_secs(seconds), child.wait_with_output()).await {
        Ok(out) => out.expect("pgapply output"),
        Err(_) => panic!("pgapply did not finish within {seconds}s"),
    }
}

/// `pgapply <args>`, killed if the test drops it.
pub fn pgapply_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgapply"));
    cmd.args(args).kill_on_drop(true);
    cmd
}

/// Starts pgapply in the background; its log goes to a file in the temp directory (named in the
/// test output) so a failing test can be diagnosed.
pub fn spawn(cmd: Command) -> Child {
    spawn_logged(cmd).0
}

/// `spawn`, and the path of the log, for a test that reads it while pgapply runs.
pub fn spawn_logged(mut cmd: Command) -> (Child, std::path::PathBuf) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "pgapply-test-{}-{}.log",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let log = std::fs::File::create(&path).expect("log file");
    eprintln!("pgapply log: {}", path.display());
    let child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn pgapply");
    (child, path)
}

/// Sends `sig` (`libc::SIGTERM`, ...) to a pgapply started by the test.
pub fn signal(child: &Child, sig: i32) {
    let pid = child.id().expect("pid") as i32;
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(pid, sig) };
}

/// Sessions of the test's target database waiting for a lock.
pub async fn waiting_for_a_lock(db: &TestDb) -> i64 {
    db.count(
        &db.target,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .await
}

/// Polls `check` until it returns true or the deadline passes.
pub async fn wait_for<F, Fut>(what: &str, seconds: u64, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `test`, then rolls back what it may have left prepared: the source transaction `gid` and
/// any of pgapply's on the target in this pair's database. Left on the shared clusters, a prepared
/// transaction would hold up other tests' slot creation. A panic of `test` is raised again after.
pub async fn cleaning_prepared(
    db: &TestDb,
    gid: &str,
    test: impl std::future::Future<Output = ()>,
) {
    let outcome = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(test)).await;
    let _ = db
        .source
        .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
        .await;
    let left = db
        .target
        .query(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()",
            &[],
        )
        .await
        .unwrap_or_default();
    for row in left {
        let gid: String = row.get(0);
        let _ = db
            .target
            .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
            .await;
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Says that the running test skips itself, and why, in a form scripts/test-matrix.sh reads.
pub fn skip(reason: &str) {
    let name = std::thread::current()
        .name()
        .map(|n| n.rsplit("::").next().unwrap_or(n).to_owned())
        .unwrap_or_default();
    eprintln!("PGAPPLY-SKIP {name}: {reason}");
}

/// The source server's version (`server_version_num`).
pub async fn source_version(db: &TestDb) -> i32 {
    db.source
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0)
}

pub async fn target_version(db: &TestDb) -> i32 {
    db.target
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0)
}

/// A TCP port free on 127.0.0.1 right now (for `--metrics-addr`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The body of a plain HTTP GET (the metrics endpoint).
pub async fn http_get(port: u16, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect metrics");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body
}

/// The peak RSS (MB) pgapply's last log line reports (`peak_rss_mb=`): its own figure, not
/// the test binary's other children.
pub fn peak_rss_mb(log: &str) -> u64 {
    log.split("peak_rss_mb=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no peak_rss_mb in the log: {log}"))
}

/// A count (`transactions`, `inserts`, ...) from the `replication stopped` line of a pgapply log.
pub fn stopped_count(log: &str, name: &str) -> Option<u64> {
    log.lines()
        .find(|l| l.contains("replication stopped"))?
        .split(&format!(" {name}=")[..])
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// A metric's value from the text exposition format; -1 when it is missing.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}
