//! Test hooks: with `PGAPPLY_TEST_FAILPOINT=<name>` the process exits at that point, as a crash
//! or a cut connection would, so that a test can check what the next run does with what the
//! servers were left with. Unset in normal use; the environment is read once per process.

use std::sync::OnceLock;

/// In the apply loop: a group's changes and its position have been answered by the target, and
/// the message that commits (or prepares) it has not been sent.
pub const EXIT_BEFORE_COMMIT: &str = "exit-before-commit";

/// The exit status at a failpoint (none of the statuses `main` uses).
pub const EXIT_STATUS: i32 = 86;

pub fn armed(name: &str) -> bool {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    ARMED
        .get_or_init(|| std::env::var("PGAPPLY_TEST_FAILPOINT").ok())
        .as_deref()
        == Some(name)
}

pub fn exit(name: &str) -> ! {
    tracing::error!(failpoint = name, "PGAPPLY_TEST_FAILPOINT: exiting here");
    std::process::exit(EXIT_STATUS)
}
