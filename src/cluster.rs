//! Throwaway local PostgreSQL clusters, for the demo, the tests and the benchmark.
//!
//! initdb into a temporary directory, a free port on 127.0.0.1, `wal_level = logical`. PostgreSQL
//! refuses to run as root, so when we are root the server runs as the `postgres` OS user.
//! Dropping a cluster stops it (immediate mode) and removes its directory.

use std::io;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const DIR_PREFIX: &str = "pgapply-cluster-";

pub struct LocalCluster {
    pub port: u16,
    pub data_dir: PathBuf,
    pub bin: PathBuf,
    /// Major version, e.g. 15.
    pub major: u32,
    owner: Option<(u32, u32)>,
    stopped: bool,
}

/// `PGAPPLY_PG_BIN`, else the newest `/usr/lib/postgresql/*/bin`.
pub fn find_pg_bin() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("PGAPPLY_PG_BIN") {
        return Some(PathBuf::from(dir));
    }
    newest_installed("postgres").and_then(|p| p.parent().map(Path::to_path_buf))
}

/// `/usr/lib/postgresql/<major>/bin/<program>` of the newest major that has it.
pub fn newest_installed(program: &str) -> Option<PathBuf> {
    let mut best: Option<(u32, PathBuf)> = None;
    for entry in std::fs::read_dir("/usr/lib/postgresql").ok()?.flatten() {
        let Some(major) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path().join("bin").join(program);
        if path.exists() && best.as_ref().is_none_or(|(m, _)| major > *m) {
            best = Some((major, path));
        }
    }
    best.map(|(_, p)| p)
}

fn postgres_user() -> io::Result<Option<(u32, u32)>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = c"postgres";
    // SAFETY: getpwnam with a valid C string; the result is read before any other call.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        return Err(io::Error::other(
            "running as root, and there is no 'postgres' OS user to run PostgreSQL as (PostgreSQL refuses root): create one with `useradd -r -m postgres`",
        ));
    }
    // SAFETY: pw is non-null and points to a valid passwd struct.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    Ok(Some((uid, gid)))
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn check(output: Output, what: &str) -> io::Result<Output> {
    if output.status.success() {
        Ok(output)
    } else {
        Err(io::Error::other(format!(
            "{what} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )))
    }
}

/// Removes clusters left behind by processes that no longer exist.
fn remove_stale_clusters() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        if unsafe { libc::kill(pid, 0) } == 0 {
            continue;
        }
        let pidfile = entry.path().join("postmaster.pid");
        if let Some(pm) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<i32>().ok()))
        {
            // SAFETY: sending SIGKILL to a leftover postmaster of ours.
            unsafe { libc::kill(pm, libc::SIGKILL) };
        }
        let _ = std::fs::remove_dir_all(entry.path());
    }
}

impl LocalCluster {
    /// initdb and start a cluster from the binaries in `bin`, with extra `postgresql.conf` lines.
    pub fn start(bin: &Path, extra_settings: &[&str]) -> io::Result<LocalCluster> {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        static CLEANED: std::sync::Once = std::sync::Once::new();
        CLEANED.call_once(remove_stale_clusters);
        let owner = postgres_user()?;
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let data_dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data_dir);
        std::fs::create_dir_all(&data_dir)?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&data_dir, Some(uid), Some(gid))?;
        }
        let mut cluster = LocalCluster {
            port: 0,
            data_dir,
            bin: bin.to_owned(),
            major: 0,
            owner,
            stopped: true,
        };
        let out = check(
            cluster
                .command("initdb")
                .arg("-D")
                .arg(&cluster.data_dir)
                .args([
                    "--locale=C",
                    "-E",
                    "UTF8",
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "--no-sync",
                ])
                .output()?,
            "initdb",
        )?;
        drop(out);
        let version = std::fs::read_to_string(cluster.data_dir.join("PG_VERSION"))?;
        cluster.major = version.trim().parse().unwrap_or(0);
        std::fs::write(
            cluster.data_dir.join("pg_hba.conf"),
            "local all all trust\n\
             host all postgres 127.0.0.1/32 trust\n\
             host replication postgres 127.0.0.1/32 trust\n\
             host all all 127.0.0.1/32 md5\n\
             host replication all 127.0.0.1/32 md5\n",
        )?;
        let mut conf = String::from(
            "\n# pgapply test cluster\n\
             listen_addresses = '127.0.0.1'\n\
             wal_level = logical\n\
             max_wal_senders = 20\n\
             max_replication_slots = 100\n\
             max_prepared_transactions = 10\n\
             max_connections = 200\n\
             fsync = off\n\
             full_page_writes = off\n\
             shared_buffers = 64MB\n\
             log_min_messages = warning\n",
        );
        conf.push_str(&format!(
            "unix_socket_directories = '{}'\n",
            cluster.data_dir.display()
        ));
        if cluster.major >= 18 {
            // From 18 the number of replication origins has its own limit (default 10); every
            // test database's pgapply has one.
            conf.push_str("max_active_replication_origins = 100\n");
        }
        for line in extra_settings {
            conf.push_str(line);
            conf.push('\n');
        }
        let conf_path = cluster.data_dir.join("postgresql.conf");
        let mut existing = std::fs::read_to_string(&conf_path)?;
        existing.push_str(&conf);
        std::fs::write(&conf_path, existing)?;
        // A port can be taken between choosing and binding: try a few.
        let mut last_err = None;
        for _ in 0..5 {
            cluster.port = free_port()?;
            match cluster.pg_ctl_start() {
                Ok(()) => {
                    cluster.stopped = false;
                    return Ok(cluster);
                }
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("could not start PostgreSQL")))
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin.join(program));
        // The server must be able to read the working directory.
        cmd.current_dir(std::env::temp_dir());
        if let Some((uid, gid)) = self.owner {
            cmd.uid(uid).gid(gid);
            cmd.env("HOME", std::env::temp_dir());
        }
        cmd
    }

    fn pg_ctl_start(&self) -> io::Result<()> {
        check(
            self.command("pg_ctl")
                .arg("-D")
                .arg(&self.data_dir)
                .arg("-l")
                .arg(self.data_dir.join("server.log"))
                .args(["-w", "-t", "120", "-o"])
                .arg(format!("-p {}", self.port))
                .arg("start")
                .output()?,
            "pg_ctl start",
        )
        .map(drop)
    }

    /// Stops the server: `mode` is fast, smart or immediate.
    pub fn stop(&mut self, mode: &str) -> io::Result<()> {
        check(
            self.command("pg_ctl")
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-w", "-t", "120", "-m", mode, "stop"])
                .output()?,
            "pg_ctl stop",
        )?;
        self.stopped = true;
        Ok(())
    }

    /// Stops (in `mode`) and starts again on the same port.
    pub fn restart(&mut self, mode: &str) -> io::Result<()> {
        self.stop(mode)?;
        self.pg_ctl_start()?;
        self.stopped = false;
        Ok(())
    }

    /// A copy of this stopped cluster's data directory, itself stopped, on a port of its own: the
    /// same system (a cold backup), to be started as a standby or as a restored server.
    pub fn copy_of_stopped(&self) -> io::Result<LocalCluster> {
        static COPIES: AtomicUsize = AtomicUsize::new(0);
        if !self.stopped {
            return Err(io::Error::other("copy_of_stopped: stop the cluster first"));
        }
        let n = COPIES.fetch_add(1, Ordering::SeqCst);
        let data_dir =
            std::env::temp_dir().join(format!("{DIR_PREFIX}{}-copy{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data_dir);
        // (cp -a keeps the owner and the modes the server insists on.)
        let out = Command::new("cp")
            .arg("-a")
            .arg(&self.data_dir)
            .arg(&data_dir)
            .output()?;
        check(out, "cp -a")?;
        Ok(LocalCluster {
            port: free_port()?,
            data_dir,
            bin: self.bin.clone(),
            major: self.major,
            owner: self.owner,
            stopped: true,
        })
    }

    /// Starts a stopped cluster again, on its port.
    pub fn start_again(&mut self) -> io::Result<()> {
        self.pg_ctl_start()?;
        self.stopped = false;
        Ok(())
    }

    /// Makes the next start a standby's (with no primary to follow: it replays what its pg_wal
    /// holds and waits).
    pub fn make_standby(&self) -> io::Result<()> {
        if self.major >= 12 {
            std::fs::write(self.data_dir.join("standby.signal"), "")?;
        } else {
            std::fs::write(self.data_dir.join("recovery.conf"), "standby_mode = 'on'\n")?;
        }
        if let Some((uid, gid)) = self.owner {
            for name in ["standby.signal", "recovery.conf"] {
                let path = self.data_dir.join(name);
                if path.exists() {
                    std::os::unix::fs::chown(&path, Some(uid), Some(gid))?;
                }
            }
        }
        Ok(())
    }

    /// Promotes a running standby, waiting until it takes writes (a new timeline).
    pub fn promote(&self) -> io::Result<()> {
        check(
            self.command("pg_ctl")
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-w", "-t", "120", "promote"])
                .output()?,
            "pg_ctl promote",
        )
        .map(drop)
    }

    /// A libpq connection string for `dbname` as the superuser.
    pub fn conninfo(&self, dbname: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={dbname}",
            self.port
        )
    }

    /// Keeps the cluster until the process exits, then stops it and removes its directory.
    pub fn keep_until_exit(mut self) -> (u16, PathBuf, u32) {
        /// (bin dir, data dir, owner) of each cluster to stop at exit.
        type ExitEntry = (PathBuf, PathBuf, Option<(u32, u32)>);
        static EXIT_LIST: Mutex<Vec<ExitEntry>> = Mutex::new(Vec::new());
        static REGISTERED: std::sync::Once = std::sync::Once::new();
        extern "C" fn stop_all() {
            let list = match EXIT_LIST.lock() {
                Ok(l) => l,
                Err(p) => p.into_inner(),
            };
            for (bin, dir, owner) in list.iter() {
                let mut cmd = Command::new(bin.join("pg_ctl"));
                cmd.current_dir(std::env::temp_dir())
                    .arg("-D")
                    .arg(dir)
                    .args(["-m", "immediate", "stop"]);
                if let Some((uid, gid)) = owner {
                    cmd.uid(*uid).gid(*gid);
                }
                let _ = cmd.output();
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        REGISTERED.call_once(|| {
            // SAFETY: registering a plain extern "C" function with no captured state.
            unsafe { libc::atexit(stop_all) };
        });
        if let Ok(mut list) = EXIT_LIST.lock() {
            list.push((self.bin.clone(), self.data_dir.clone(), self.owner));
        }
        self.stopped = true; // Drop must not stop it now.
        (self.port, self.data_dir.clone(), self.major)
    }
}

/// Restarts a running cluster by its directory (`pg_ctl restart -m mode`), keeping its port.
pub fn restart_cluster(bin: &Path, data_dir: &Path, mode: &str) -> io::Result<()> {
    let mut cmd = Command::new(bin.join("pg_ctl"));
    cmd.current_dir(std::env::temp_dir())
        .arg("-D")
        .arg(data_dir)
        .arg("-l")
        .arg(data_dir.join("server.log"))
        .args(["-w", "-t", "120", "-m", mode, "restart"]);
    if let Some((uid, gid)) = postgres_user()? {
        cmd.uid(uid).gid(gid);
    }
    check(cmd.output()?, "pg_ctl restart").map(drop)
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.stop("immediate");
            let _ = std::fs::remove_dir_all(&self.data_dir);
        }
    }
}
