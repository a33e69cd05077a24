//! Queries to cancel when a one-shot command is interrupted (`verify`'s comparisons, a `skip`
//! waiting for a lock): a backend notices that its client went away only when it next writes to
//! it, so a query would otherwise run to its end on the server after pgapply has stopped (a
//! write waiting for a lock would even commit then).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tokio_postgres::{CancelToken, Client};

/// Each session's cancel key, and its connection settings (a cancel request goes over TLS as
/// the session did).
static OPEN: Mutex<Vec<(CancelToken, tokio_postgres::Config)>> = Mutex::new(Vec::new());

/// Set by the one-shot commands: `run`'s sessions, made again and again over days, are not
/// kept (its stop waits for them instead).
static ENABLED: AtomicBool = AtomicBool::new(false);

/// From now on, the sessions this process opens are noted for `cancel_all`.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Notes `client`'s session, made with `config`, if enabled: its query in progress is
/// cancelled by `cancel_all`.
pub fn register(client: &Client, config: &tokio_postgres::Config) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    if let Ok(mut open) = OPEN.lock() {
        open.push((client.cancel_token(), config.clone()));
    }
}

/// Asks the server of each registered session to cancel what it runs (a session with nothing
/// running ignores it), waiting at most two seconds in all.
pub async fn cancel_all() {
    let tokens: Vec<(CancelToken, tokio_postgres::Config)> = match OPEN.lock() {
        Ok(mut open) => std::mem::take(&mut *open),
        Err(_) => return,
    };
    // Over TLS as the session was; a server that takes none then (or a TLS setting that cannot
    // be made again) is asked without.
    let requests = tokens.iter().map(|(token, config)| async move {
        let tls_done = match crate::tls::make_tls(config) {
            Ok(tls) => token.cancel_query(tls).await.is_ok(),
            Err(_) => false,
        };
        if !tls_done {
            let _ = token.cancel_query(tokio_postgres::NoTls).await;
        }
    });
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        futures_util::future::join_all(requests),
    )
    .await;
}
