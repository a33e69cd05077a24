//! The target sessions this process applies in, so that the heartbeat can say when one of them
//! waits for a lock a target user holds (a table locked, a row updated in an open transaction):
//! applying then waits, as it must, and without this nothing would say why it stands still.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

/// (pid, backend_start as text): a pid alone may be reused by another backend once ours ends.
static SESSIONS: LazyLock<Mutex<Vec<(i32, String)>>> = LazyLock::new(Mutex::default);

/// How long a session waits before the wait is said.
const SAY_AFTER: Duration = Duration::from_secs(5);

/// Notes an apply session (called once per session, at its start).
pub async fn register(client: &tokio_postgres::Client) {
    let row = client
        .query_one(
            "SELECT pid, backend_start::text FROM pg_catalog.pg_stat_activity WHERE pid = pg_catalog.pg_backend_pid()",
            &[],
        )
        .await;
    if let Ok(row) = row {
        let session = (row.get::<_, i32>(0), row.get::<_, String>(1));
        if let Ok(mut sessions) = SESSIONS.lock() {
            // Sessions of earlier runs of this process are gone, or will be: the last few do.
            if sessions.len() >= 64 {
                sessions.remove(0);
            }
            sessions.push(session);
        }
    }
}

/// Lock waits of the apply sessions, as the heartbeat last saw them.
#[derive(Default)]
pub struct LockWaits {
    /// pid -> since when it waits, and whether that was said.
    waiting: HashMap<i32, (Instant, bool)>,
}

impl LockWaits {
    /// Looks at the apply sessions' waits on `client` (a session of its own on the target) and
    /// says one that has lasted `SAY_AFTER`, naming the table and the blocking processes, and
    /// its end.
    pub async fn check(&mut self, client: &tokio_postgres::Client) {
        let (pids, starts): (Vec<i32>, Vec<String>) = match SESSIONS.lock() {
            Ok(sessions) => sessions.iter().cloned().unzip(),
            Err(_) => return,
        };
        if pids.is_empty() {
            return;
        }
        // Advisory locks are pgapply's own ordering of parallel workers, not a user's.
        let rows = client
            .query(
                "SELECT a.pid, a.wait_event, \
                        (SELECT l.relation::pg_catalog.regclass::text FROM pg_catalog.pg_locks l \
                         WHERE l.pid = a.pid AND NOT l.granted AND l.relation IS NOT NULL LIMIT 1), \
                        pg_catalog.pg_blocking_pids(a.pid) \
                 FROM pg_catalog.pg_stat_activity a \
                 JOIN unnest($1::int4[], $2::text[]) s(pid, started) \
                   ON a.pid = s.pid AND a.backend_start::text = s.started \
                 WHERE a.wait_event_type = 'Lock' AND a.wait_event <> 'advisory'",
                &[&pids, &starts],
            )
            .await;
        let Ok(rows) = rows else {
            return;
        };
        let now = Instant::now();
        let mut still = HashMap::new();
        for row in rows {
            let pid: i32 = row.get(0);
            let event: String = row.get(1);
            let table: Option<String> = row.get(2);
            let blockers: Vec<i32> = row.get::<_, Option<Vec<i32>>>(3).unwrap_or_default();
            // Blocked by another apply session of this process: ordering, not a user.
            if blockers.iter().all(|b| pids.contains(b)) {
                continue;
            }
            let (since, mut said) = self.waiting.get(&pid).copied().unwrap_or((now, false));
            if !said && now.duration_since(since) >= SAY_AFTER {
                said = true;
                let what = match (&table, event.as_str()) {
                    (Some(t), _) => format!("a lock on table {t}"),
                    (None, "transactionid") => {
                        "a row lock (another transaction changed or locked a row this change needs)"
                            .to_owned()
                    }
                    (None, e) => format!("a lock ({e})"),
                };
                let by: Vec<String> = blockers.iter().map(|b| b.to_string()).collect();
                tracing::warn!(
                    target_process = pid,
                    "applying waits for {what} on the target, held by target process(es) {} for {} s now: it goes on once they release it (see pg_stat_activity there; SELECT pg_terminate_backend(pid) ends one)",
                    by.join(", "),
                    now.duration_since(since).as_secs()
                );
            }
            still.insert(pid, (since, said));
        }
        for (pid, (since, said)) in &self.waiting {
            if *said && !still.contains_key(pid) {
                tracing::info!(
                    target_process = pid,
                    "applying no longer waits for a lock on the target (waited about {} s)",
                    since.elapsed().as_secs()
                );
            }
        }
        self.waiting = still;
    }
}
