//! The target sessions this process applies in, so that the heartbeat can say when one of them
//! waits for a lock a target user holds (a table locked, a row updated in an open transaction):
//! applying then waits, as it must, and without this nothing would say why it stands still.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

/// (pid, backend_start in microseconds since 1970): a pid alone may be reused by another backend
/// once ours ends. (A number, not text, whose form would follow each session's DateStyle.)
static SESSIONS: LazyLock<Mutex<Vec<(i32, i64)>>> = LazyLock::new(Mutex::default);

/// How long a session waits before the wait is said.
const SAY_AFTER: Duration = Duration::from_secs(5);

/// The initial copy's target sessions (its checks of the target tables, and its COPYs), whose
/// lock waits are said as the apply sessions' are.
static COPY_SESSIONS: LazyLock<Mutex<Vec<(i32, i64)>>> = LazyLock::new(Mutex::default);

/// Notes an apply session (called once per session, at its start).
pub async fn register(client: &tokio_postgres::Client) {
    note(client, &SESSIONS).await;
}

/// Notes a target session of the initial copy.
pub async fn register_copy(client: &tokio_postgres::Client) {
    note(client, &COPY_SESSIONS).await;
}

async fn note(client: &tokio_postgres::Client, registry: &Mutex<Vec<(i32, i64)>>) {
    let row = client
        .query_one(
            "SELECT pid, (extract(epoch FROM backend_start) * 1000000)::int8 \
             FROM pg_catalog.pg_stat_activity WHERE pid = pg_catalog.pg_backend_pid()",
            &[],
        )
        .await;
    if let Ok(row) = row {
        let session = (row.get::<_, i32>(0), row.get::<_, i64>(1));
        if let Ok(mut sessions) = registry.lock() {
            // Sessions of earlier runs of this process are gone, or will be: the last few do.
            if sessions.len() >= 64 {
                sessions.remove(0);
            }
            if !sessions.contains(&session) {
                sessions.push(session);
            }
        }
    }
}

/// Ends one session, only while it is still there: one gone meanwhile is not counted, and the
/// server does not warn of a pid that is no backend. (In the select list, not in WHERE.)
const END_SESSION_IF_THERE: &str =
    "SELECT pg_catalog.pg_terminate_backend(pid) FROM pg_catalog.pg_stat_activity WHERE pid = $1";

/// Ends `pid` if it is an apply session this process opened (same pid and start time), left
/// from an earlier attempt: one waiting on the server (a parallel worker's wait for another's
/// commit, say) keeps its connection until the server answers, and with it its replication
/// origin, which the next attempt needs. Returns whether it ended (within 5 s).
pub async fn end_own_earlier_session(client: &tokio_postgres::Client, pid: i32) -> bool {
    if !own_sessions_on_server(client).await.contains(&pid) {
        return false;
    }
    if client.execute(END_SESSION_IF_THERE, &[&pid]).await.is_err() {
        return false;
    }
    tracing::info!(pid, "ended this process's target session of an earlier attempt, which still held what this one needs");
    for _ in 0..50 {
        let gone = client
            .query_one(
                "SELECT NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = $1)",
                &[&pid],
            )
            .await
            .is_ok_and(|r| r.get::<_, bool>(0));
        if gone {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    false
}

/// Ends the apply sessions this process opened that are still on the server once its applier
/// is done with them (all of them, at the end of a run). A session whose client closed is ended
/// by the server only when it notices, which a backend waiting for a lock, its socket full of
/// statements it has not read, does not. Their open transactions roll back.
pub async fn end_own_lingering(client: &tokio_postgres::Client) {
    // (Found first, ended one by one after: a pg_terminate_backend in the WHERE clause may be
    // evaluated before the join narrows the rows down, on every session of the server.)
    let mut ended = Vec::new();
    for pid in own_sessions_on_server(client).await {
        let ended_now = client
            .query(END_SESSION_IF_THERE, &[&pid])
            .await
            .is_ok_and(|rows| rows.first().is_some_and(|r| r.get::<_, bool>(0)));
        if ended_now {
            ended.push(pid);
        }
    }
    if !ended.is_empty() {
        tracing::info!(sessions = ?ended, "ended this run's target sessions still on the server (their open transactions roll back)");
    }
}

/// The apply sessions this process opened (same pid and start time) that are still on the
/// server, `client`'s own left out; none when that cannot be read.
async fn own_sessions_on_server(client: &tokio_postgres::Client) -> Vec<i32> {
    let (pids, starts): (Vec<i32>, Vec<i64>) = match SESSIONS.lock() {
        Ok(sessions) => sessions.iter().cloned().unzip(),
        Err(_) => return Vec::new(),
    };
    if pids.is_empty() {
        return Vec::new();
    }
    client
        .query(
            "SELECT s.pid FROM pg_catalog.pg_stat_activity s \
             JOIN unnest($1::int4[], $2::int8[]) o(pid, started) ON o.pid = s.pid \
             WHERE (extract(epoch FROM s.backend_start) * 1000000)::int8 = o.started \
               AND s.pid <> pg_catalog.pg_backend_pid()",
            &[&pids, &starts],
        )
        .await
        .map(|rows| rows.iter().map(|r| r.get::<_, i32>(0)).collect())
        .unwrap_or_default()
}

/// Lock waits of the apply sessions (or the copy's), as the heartbeat last saw them.
#[derive(Default)]
pub struct LockWaits {
    /// pid -> since when it waits, and whether that was said.
    waiting: HashMap<i32, (Instant, bool)>,
    /// The initial copy's sessions rather than the apply sessions.
    copy: bool,
}

impl LockWaits {
    /// The waits of the initial copy's sessions.
    pub fn for_copy() -> LockWaits {
        LockWaits {
            copy: true,
            ..LockWaits::default()
        }
    }

    /// Looks at the apply sessions' waits on `client` (a session of its own on the target) and
    /// says one that has lasted `SAY_AFTER`, naming the table and the blocking processes, and
    /// its end.
    pub async fn check(&mut self, client: &tokio_postgres::Client) {
        let registry = if self.copy { &COPY_SESSIONS } else { &SESSIONS };
        let doing = if self.copy {
            "the initial copy"
        } else {
            "applying"
        };
        let (pids, starts): (Vec<i32>, Vec<i64>) = match registry.lock() {
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
                        pg_catalog.pg_blocking_pids(a.pid), \
                        (SELECT pg_catalog.string_agg(b.pid || CASE WHEN b.application_name <> '' \
                                THEN ' (' || b.application_name || ')' ELSE '' END, ', ' ORDER BY b.pid) \
                         FROM pg_catalog.pg_stat_activity b WHERE b.pid = ANY (pg_catalog.pg_blocking_pids(a.pid))), \
                        (SELECT pg_catalog.bool_and(EXISTS (SELECT 1 FROM unnest($1::int4[], $2::int8[]) o(pid, started) \
                                                            WHERE o.pid = b.pid \
                                                              AND (extract(epoch FROM b.backend_start) * 1000000)::int8 = o.started)) \
                         FROM pg_catalog.pg_stat_activity b WHERE b.pid = ANY (pg_catalog.pg_blocking_pids(a.pid))) \
                 FROM pg_catalog.pg_stat_activity a \
                 JOIN unnest($1::int4[], $2::int8[]) s(pid, started) \
                   ON a.pid = s.pid AND (extract(epoch FROM a.backend_start) * 1000000)::int8 = s.started \
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
            let named: Option<String> = row.get(4);
            // Blocked only by other apply sessions of this process (the same pid and start: a
            // pid of an ended session may be a user's now): ordering, not a user.
            let all_ours: Option<bool> = row.get(5);
            if !blockers.contains(&0) && all_ours == Some(true) {
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
                // pg_blocking_pids says 0 for a prepared transaction, which no process holds.
                let prepared = blockers.contains(&0);
                let by = match (named.as_deref().filter(|n| !n.is_empty()), prepared) {
                    (Some(n), false) => format!("target process(es) {n}"),
                    (Some(n), true) => format!("target process(es) {n} and a prepared transaction"),
                    (None, true) => "a prepared transaction".to_owned(),
                    (None, false) => "another target session".to_owned(),
                };
                let how = if prepared {
                    "see pg_prepared_xacts there: COMMIT PREPARED or ROLLBACK PREPARED it"
                } else {
                    "see pg_stat_activity there; SELECT pg_terminate_backend(pid) ends one"
                };
                tracing::warn!(
                    target_process = pid,
                    "{doing} waits for {what} on the target, held by {by} for {} s now: it goes on once they release it ({how})",
                    now.duration_since(since).as_secs()
                );
            }
            still.insert(pid, (since, said));
        }
        for (pid, (since, said)) in &self.waiting {
            if *said && !still.contains_key(pid) {
                tracing::info!(
                    target_process = pid,
                    "{doing} no longer waits for a lock on the target (waited about {} s)",
                    since.elapsed().as_secs()
                );
            }
        }
        self.waiting = still;
    }
}
