//! Test hooks: with `PGAPPLY_TEST_FAILPOINT=<name>` the process exits, or a statement fails, at
//! that point, as a crash, a cut connection or a failing server would make it, so that a test can
//! check what pgapply and the next run do with what the servers were left with. Unset in normal
//! use; the environment is read once per process.

use std::sync::OnceLock;

/// In the apply loop: a group's changes and its position have been answered by the target, and
/// the message that commits (or prepares) it has not been sent.
pub const EXIT_BEFORE_COMMIT: &str = "exit-before-commit";

/// The first group committed in the process (with parallel workers: by the second worker) fails
/// once its origin position is set, as a COMMIT failing at its very end would (PostgreSQL 16+
/// moves the origin then).
pub const FAIL_COMMIT: &str = "fail-commit";

/// The same, and the process exits once the failure is seen, before it moves the origin back.
pub const FAIL_COMMIT_THEN_EXIT: &str = "fail-commit-then-exit";

/// What that group runs instead of COMMIT: the transaction ends without committing and the
/// COMMIT's answer is an error (a serialization failure, retried like one), as when a COMMIT
/// itself fails. The session is then outside any transaction, so what was sent after it runs.
pub const FAILING_COMMIT: &str =
    "ROLLBACK; DO $$BEGIN RAISE EXCEPTION 'PGAPPLY_TEST_FAILPOINT fail-commit' USING ERRCODE = '40001'; END$$";

/// The exit status at a failpoint (none of the statuses `main` uses).
pub const EXIT_STATUS: i32 = 86;

pub fn armed(name: &str) -> bool {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    ARMED
        .get_or_init(|| std::env::var("PGAPPLY_TEST_FAILPOINT").ok())
        .as_deref()
        == Some(name)
}

/// Whether a failing commit is armed and has not fired yet in this process (then it has now).
pub fn fail_commit_once() -> bool {
    static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    (armed(FAIL_COMMIT) || armed(FAIL_COMMIT_THEN_EXIT))
        && !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst)
}

pub fn exit(name: &str) -> ! {
    tracing::error!(failpoint = name, "PGAPPLY_TEST_FAILPOINT: exiting here");
    std::process::exit(EXIT_STATUS)
}

/// How long a table being copied may receive nothing before that is said: `default`, or
/// `PGAPPLY_TEST_COPY_SILENCE_SECS` seconds (a test waits less than a minute).
pub fn copy_silence(default: std::time::Duration) -> std::time::Duration {
    std::env::var("PGAPPLY_TEST_COPY_SILENCE_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(default, std::time::Duration::from_secs)
}
