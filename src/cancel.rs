//! Queries to cancel when a one-shot command is interrupted (`verify`'s comparisons): a backend
//! notices that its client went away only when it next writes to it, so a long query would
//! otherwise run to its end on the server after pgapply has stopped.

use std::sync::Mutex;

use tokio_postgres::{CancelToken, Client};

/// Each session's cancel key, and its connection settings (a cancel request goes over TLS as
/// the session did).
static OPEN: Mutex<Vec<(CancelToken, tokio_postgres::Config)>> = Mutex::new(Vec::new());

/// Notes `client`'s session, made with `config`: its query in progress is cancelled by
/// `cancel_all`.
pub fn register(client: &Client, config: &tokio_postgres::Config) {
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
    let requests = tokens.iter().filter_map(|(token, config)| {
        let tls = crate::tls::make_tls(config).ok()?;
        Some(token.cancel_query(tls))
    });
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        futures_util::future::join_all(requests),
    )
    .await;
}
