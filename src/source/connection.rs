//! A minimal PostgreSQL client for replication sessions.
//!
//! tokio-postgres cannot open a walsender session (`replication=database`) nor speak CopyBoth, so
//! this is a thin client on `postgres-protocol`, the codec tokio-postgres itself is built on: startup,
//! authentication (trust, cleartext, MD5, SCRAM-SHA-256), simple queries, and CopyBoth framing.
//!
//! Reads go into one persistent buffer, so `read_copy_data` can be cancelled (in a `select!`)
//! without losing bytes. A message's length is checked against `max_message_bytes` before any of it
//! is buffered.

use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::sasl::{self, ScramSha256};
use postgres_protocol::message::{backend, frontend};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::config::{Host, TargetSessionAttrs};

use crate::error::{Error, Result};

/// Startup options that make text values round-trip exactly, as PostgreSQL's own subscriber sets,
/// and money in the C locale's form, which the target's sessions read with the same setting
/// (servers of different lc_monetary would misread each other's amounts, or refuse them).
/// The idle-in-transaction timeout is off: the session that exported the initial copy's snapshot
/// waits inside its transaction until the copy is done. An empty search_path, as PostgreSQL's own
/// subscriber sets, prints OID alias values (regclass ...) schema-qualified, which the target
/// reads whatever its own search_path.
const STARTUP_OPTIONS: &str = "-c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3 -c lc_monetary=C -c idle_in_transaction_session_timeout=0 -c search_path=";

/// How much to ask the kernel for per read: large reads let the walsender batch its sends.
const READ_CHUNK: usize = 256 * 1024;

trait AsyncStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> AsyncStream for T {}

enum Stream {
    Tcp(TcpStream),
    Unix(tokio::net::UnixStream),
    Tls(Box<dyn AsyncStream>),
}

impl Stream {
    async fn read_buf(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read_buf(buf).await,
            Stream::Unix(s) => s.read_buf(buf).await,
            Stream::Tls(s) => s.read_buf(buf).await,
        }
    }

    async fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.write_all(buf).await,
            Stream::Unix(s) => s.write_all(buf).await,
            Stream::Tls(s) => {
                s.write_all(buf).await?;
                s.flush().await
            }
        }
    }
}

/// The TLS channel a SCRAM exchange may be bound to.
#[derive(Default)]
struct Channel {
    tls: bool,
    /// The server certificate's `tls-server-end-point` data, when its hash is one pgapply knows.
    end_point: Option<Vec<u8>>,
}

/// SSLRequest, then the TLS handshake when the server agrees (libpq's sslmode semantics).
async fn negotiate_tls(
    stream: Stream,
    host: &str,
    endpoint: &str,
    config: &tokio_postgres::Config,
) -> Result<(Stream, Channel)> {
    use crate::tls::SslMode;
    use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
    let settings = crate::tls::settings_for(config);
    let Stream::Tcp(mut tcp) = stream else {
        return Ok((stream, Channel::default()));
    };
    if settings.mode == SslMode::Disable {
        return Ok((Stream::Tcp(tcp), Channel::default()));
    }
    let mut request = BytesMut::new();
    frontend::ssl_request(&mut request);
    tcp.write_all(&request)
        .await
        .map_err(|e| Error::io(format!("writing to source {endpoint}"), e))?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer)
        .await
        .map_err(|e| Error::io(format!("reading from source {endpoint}"), e))?;
    // 'E': the server could not start a session (out of processes or memory), and says so
    // instead of answering.
    if answer[0] == b'E' {
        return Err(Error::transient(format!(
            "source {endpoint} could not start a session (it answered the TLS request with an error: short of memory or processes?)"
        )));
    }
    if answer[0] != b'S' && answer[0] != b'N' {
        return Err(Error::definite(format!(
            "source {endpoint} does not answer as a PostgreSQL server does (it answered the TLS request with {:?}): check the host and port of --source",
            answer[0] as char
        )));
    }
    if answer[0] != b'S' {
        if settings.mode == SslMode::Prefer {
            return Ok((Stream::Tcp(tcp), Channel::default()));
        }
        return Err(Error::definite(format!(
            "source {endpoint} does not accept TLS connections, but sslmode requires TLS: enable ssl on the server, or use sslmode=prefer or disable"
        )));
    }
    let seen = crate::tls::SeenCertificate::default();
    let mut maker = crate::tls::make_tls_seeing(config, Some(seen.clone()))?;
    let connect =
        <tokio_postgres_rustls::MakeRustlsConnect as MakeTlsConnect<TcpStream>>::make_tls_connect(
            &mut maker, host,
        )
        .map_err(|e| Error::definite(format!("TLS setup for source {endpoint}: {e}")))?;
    let tls = connect.connect(tcp).await.map_err(|e| {
        Error::definite(format!(
            "TLS handshake with source {endpoint} failed: {e}: {}",
            crate::tls::CERTIFICATE_ADVICE
        ))
    })?;
    let end_point = seen
        .lock()
        .ok()
        .and_then(|c| c.as_deref().and_then(crate::tls::tls_server_end_point));
    Ok((
        Stream::Tls(Box::new(tls)),
        Channel {
            tls: true,
            end_point,
        },
    ))
}

/// The result of a simple query: column names and rows of text values.
#[derive(Debug, Default)]
pub struct QueryResult {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl QueryResult {
    /// The value of `column` in the first row.
    pub fn first(&self, column: &str) -> Option<&str> {
        let index = self.columns.iter().position(|c| c == column)?;
        self.rows.first()?.get(index)?.as_deref()
    }
}

/// An error the server sent: SQLSTATE and message.
#[derive(Debug, Clone)]
pub struct ServerError {
    /// ERROR, WARNING, NOTICE.. (the untranslated one where the server sends it, 9.6+).
    pub severity: String,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl std::fmt::Display for ServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (SQLSTATE {})", self.message, self.code)?;
        if let Some(d) = &self.detail {
            write!(f, "; detail: {d}")?;
        }
        if let Some(h) = &self.hint {
            write!(f, "; hint: {h}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ServerError {}

impl ServerError {
    fn into_error(self, context: &str) -> Error {
        // No walsender at all is a setting, not a passing shortage: retrying cannot help.
        if self.code == "53300" && self.message.contains("max_wal_senders (currently 0)") {
            let message = format!(
                "{context}: {self}: the source allows no replication connections: set max_wal_senders above 0 (and wal_level = logical) in its postgresql.conf and restart it"
            );
            return Error::definite(message).with_source(self);
        }
        if self.code == "0A000" && self.message.contains("while in recovery") {
            let message = format!(
                "{context}: {self}: the source is a standby, where PostgreSQL before 16 cannot decode changes: point --source at the primary"
            );
            return Error::definite(message).with_source(self);
        }
        // `ALTER DATABASE .. ALLOW_CONNECTIONS false`, for maintenance: it ends some day.
        if self.code == "55000" && self.message.contains("not currently accepting connections") {
            let message = format!(
                "{context}: {self}: the source database refuses connections (ALTER DATABASE .. ALLOW_CONNECTIONS false, for maintenance): the changes wait in the slot until it allows them again"
            );
            return Error::transient(message).with_source(self);
        }
        // A table published since the run started has a type without a binary form (an array
        // of aclitem), asked for with --binary: the next start sees it and asks for text.
        if self.code == "42883" && self.message.starts_with("no binary output function") {
            crate::replicate::TEXT_FROM_NOW_ON.store(true, std::sync::atomic::Ordering::SeqCst);
            let message = format!(
                "{context}: {self}: a published table has a type without a binary form: starting again, with values in text form"
            );
            return Error::transient(message).with_source(self);
        }
        let transient = crate::error::is_transient_sqlstate(&self.code);
        let message = format!("{context}: {self}");
        let err = if transient {
            Error::transient(message)
        } else {
            Error::definite(message)
        };
        err.with_source(self)
    }
}

/// What to do about errors the walsender ends the stream with that its own message leaves open.
fn stream_error_hint(e: &ServerError, slot: &str) -> Option<String> {
    match e.code.as_str() {
        // The slot decodes with the catalog as it was when each change was written. (Copying
        // again into the same slot would stream it from where it stands, and stop there again.)
        "42704" if e.message.contains("publication") => {
            let start_over = start_over_advice(slot);
            let slot = crate::sql::shown_literal(slot);
            Some(format!(
                "if it was renamed while pgapply ran, run with its new name in --publication (pgapply stopped at the rename; a transaction open across it may come only in part: compare with `pgapply verify` after). If it exists now (dropped and created again, renamed while pgapply was stopped, or created after changes were written), the source cannot decode the changes written while it did not exist, and a PostgreSQL source before 18 stops at them every time. If it is a publication added to --publication since the slot started, nothing need be lost: run with the publications of before (without it) until the slot is past the time it was created, then add it (a table only it publishes is then published later: a run with --copy-data copies it). Otherwise {start_over}; or, losing those changes, move the slot past them (SELECT pg_replication_slot_advance({slot}, pg_current_wal_lsn()) on the source) and tell the target to accept the slot's new position (UPDATE pgapply.progress SET reported_lsn = NULL WHERE slot_name = {slot} on the target; pgapply otherwise refuses a slot confirmed past what it applied)"
            ))
        }
        "22021" => {
            let start_over = start_over_advice(slot);
            let slot = crate::sql::shown_literal(slot);
            Some(format!("the source has text that cannot be converted to UTF-8 (in a SQL_ASCII database, bytes above 127 have no known encoding): fix those values on the source, or move the data to a database whose encoding says what the bytes are. A change already written stays in the slot as it was (changing the value on the source now does not replace it, and the source fails before pgapply sees the transaction, so `pgapply skip` cannot pass it): {start_over}, once the values are fixed, or, losing the changes in between, move the slot past it (SELECT pg_replication_slot_advance({slot}, pg_current_wal_lsn()) on the source, then UPDATE pgapply.progress SET reported_lsn = NULL WHERE slot_name = {slot} on the target)"))
        }
        _ => None,
    }
}

/// The way out when the slot holds changes the source cannot decode any more.
fn start_over_advice(slot: &str) -> String {
    format!(
        "start over with a new slot, with pgapply stopped: drop this one on the source (SELECT pg_drop_replication_slot({})), then run with --create-slot --copy-data --truncate-target",
        crate::sql::shown_literal(slot)
    )
}

fn server_error(fields: backend::ErrorFields<'_>) -> ServerError {
    let mut e = ServerError {
        severity: String::new(),
        code: String::new(),
        message: String::new(),
        detail: None,
        hint: None,
    };
    let mut fields = fields;
    while let Ok(Some(field)) = fields.next() {
        let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
        match field.type_() {
            b'V' => e.severity = value,
            b'S' if e.severity.is_empty() => e.severity = value,
            b'C' => e.code = value,
            b'M' => e.message = value,
            b'D' => e.detail = Some(value),
            b'H' => e.hint = Some(value),
            _ => {}
        }
    }
    e
}

/// The next allocation for a large message (`need` bytes) of which `have` have arrived:
/// doubling what has arrived (a few reads more at least) keeps the copies linear in its size,
/// and it never goes past the message's end.
fn large_message_room(have: usize, need: usize) -> usize {
    need.min(have.saturating_mul(2).max(have + 4 * READ_CHUNK))
}

pub struct ReplicationConnection {
    stream: Stream,
    read: BytesMut,
    write: BytesMut,
    /// Where we connected, without credentials: for messages.
    pub endpoint: String,
    /// `server_version_num`, e.g. 150004.
    pub server_version: u32,
    /// The slot being streamed, once START_REPLICATION is sent: for advice in messages.
    pub slot: String,
    max_message_bytes: usize,
    /// While streaming: after a read that found little, wait this long before the next one, so
    /// the walsender can fill its buffers and send in large writes instead of one per message.
    read_pause: Option<Duration>,
    /// The last read returned less than `SHORT_READ` bytes.
    last_read_short: bool,
    /// Whether to pause now: only while the consumer has work queued (see `set_pacing`).
    pacing: bool,
    /// Until the server is ready for queries: only the handful of message kinds a PostgreSQL
    /// server sends then are taken, so another kind of server is named as such.
    in_handshake: bool,
    /// The connection settings, for the one ordinary query a skipped publication needs.
    sql_config: tokio_postgres::Config,
    /// The publications START_REPLICATION names.
    pub publications: Vec<String>,
    /// A skipped-publication WARNING not looked into yet: kept here across a read that is
    /// cancelled while it looks, so that it is never lost.
    skipped_notice: Option<ServerError>,
    /// The look-up of the publications that notice calls for, in a task of its own: a read
    /// cancelled meanwhile (the reader's timers do, every second or more often) finds it where
    /// it was instead of starting it over, which behind a slow link would never finish.
    publication_lookup: Option<tokio::task::JoinHandle<Result<Vec<String>>>>,
    /// The walsender's process id on the source (BackendKeyData).
    backend_pid: Option<i32>,
    /// The source's last warning or notice logged: the same one again within a minute is
    /// counted, not logged (a source waiting on `synchronized_standby_slots` repeats its
    /// warning several times a second).
    last_notice: Option<RepeatedNotice>,
}

#[cfg(test)]
impl ReplicationConnection {
    fn for_test(stream: Stream) -> Self {
        ReplicationConnection {
            stream,
            read: BytesMut::with_capacity(READ_CHUNK),
            write: BytesMut::new(),
            endpoint: "test".into(),
            server_version: 0,
            slot: String::new(),
            max_message_bytes: 1 << 30,
            read_pause: None,
            last_read_short: false,
            pacing: true,
            in_handshake: false,
            sql_config: tokio_postgres::Config::new(),
            publications: Vec::new(),
            skipped_notice: None,
            publication_lookup: None,
            backend_pid: None,
            last_notice: None,
        }
    }
}

struct RepeatedNotice {
    text: String,
    logged_at: std::time::Instant,
    repeats: u64,
}

impl RepeatedNotice {
    /// Whether to log `text` now, after the last one logged: `Some(times it came meanwhile
    /// unlogged)`, or `None` for the same text again within `NOTICE_REPEAT_QUIET` (counted).
    fn to_log(last: &mut Option<RepeatedNotice>, text: String) -> Option<u64> {
        let repeats = match last {
            Some(l) if l.text == text && l.logged_at.elapsed() < NOTICE_REPEAT_QUIET => {
                l.repeats += 1;
                return None;
            }
            Some(l) if l.text == text => l.repeats,
            _ => 0,
        };
        *last = Some(RepeatedNotice {
            text,
            logged_at: std::time::Instant::now(),
            repeats: 0,
        });
        Some(repeats)
    }
}

/// How long the same source notice is counted instead of logged again.
const NOTICE_REPEAT_QUIET: std::time::Duration = std::time::Duration::from_secs(60);

/// Walsenders of this process's replication connections that it has let go (dropped), and
/// when: one whose connection the network cut off silently may still hold its slot on the
/// source, which notices only after wal_sender_timeout (never when that is 0).
static LET_GO: std::sync::Mutex<Vec<(i32, std::time::SystemTime)>> =
    std::sync::Mutex::new(Vec::new());

impl Drop for ReplicationConnection {
    fn drop(&mut self) {
        if let (Some(pid), Ok(mut let_go)) = (self.backend_pid, LET_GO.lock()) {
            // (A few are enough: only the latest can still hold the slot.)
            if let_go.len() >= 16 {
                let_go.remove(0);
            }
            let_go.push((pid, std::time::SystemTime::now()));
        }
    }
}

/// When this process let go of its connection to walsender `pid`, if it had one.
pub fn let_go_at(pid: i32) -> Option<std::time::SystemTime> {
    let let_go = LET_GO.lock().ok()?;
    let_go
        .iter()
        .rev()
        .find(|(p, _)| *p == pid)
        .map(|(_, at)| *at)
}

/// A read smaller than this means the source is keeping up with us message by message.
const SHORT_READ: usize = 16 * 1024;

impl ReplicationConnection {
    /// Opens a `replication=database` session with the given connection settings.
    pub async fn connect(
        config: &tokio_postgres::Config,
        max_message_bytes: usize,
    ) -> Result<Self> {
        let user = config
            .get_user()
            .ok_or_else(|| {
                Error::definite("source connection: no user given (set user= or PGUSER)")
            })?
            .to_owned();
        // connect_timeout per host, for its addresses (two: IPv6 and IPv4) and then the
        // handshake: a server that accepts the connection and then says nothing (stopped,
        // overloaded, not PostgreSQL) would keep it waiting for ever.
        let each = config
            .get_connect_timeout()
            .copied()
            .unwrap_or(crate::conninfo::CONNECT_TIMEOUT);
        // As libpq: with target_session_attrs, a host whose session is not of that kind is
        // left for the next one (after a failover, the old primary may be back as a standby).
        let wanted = config.get_target_session_attrs();
        let mut from = 0;
        let mut unsuitable = None;
        loop {
            let Some((stream, endpoint, host, index)) =
                open_stream(config, each * 2, from, unsuitable.is_some()).await?
            else {
                return Err(unsuitable
                    .unwrap_or_else(|| Error::definite("source connection: no host given")));
            };
            from = index + 1;
            let shown = endpoint.clone();
            let handshake = Self::handshake(
                stream,
                endpoint,
                host,
                config,
                max_message_bytes,
                user.clone(),
            );
            // (A host that fails the handshake leaves the next one to try, as in libpq.)
            let mut conn = match tokio::time::timeout(each, handshake).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(e)) => {
                    unsuitable = Some(e);
                    continue;
                }
                Err(_) => {
                    unsuitable = Some(Error::transient(format!(
                        "source {shown} accepted the connection but did not complete the PostgreSQL handshake within {} (connect_timeout): is it overloaded or stopped, and is that port PostgreSQL's?",
                        humantime::format_duration(each)
                    )));
                    continue;
                }
            };
            if wanted == TargetSessionAttrs::Any {
                return Ok(conn);
            }
            let read_only = conn
                .simple_query("SHOW transaction_read_only")
                .await?
                .rows
                .first()
                .and_then(|r| r.first().cloned().flatten())
                .is_some_and(|v| v == "on");
            if read_only == (wanted == TargetSessionAttrs::ReadOnly) {
                return Ok(conn);
            }
            conn.close().await;
            // (Transient: during a failover the new primary takes writes a moment later.)
            unsuitable = Some(Error::transient(format!(
                "source {shown} is {} and --source asks for target_session_attrs={}: no host of --source fits (yet)",
                if read_only { "read-only (a standby?)" } else { "read-write" },
                if wanted == TargetSessionAttrs::ReadOnly { "read-only" } else { "read-write" }
            )));
        }
    }

    /// TLS, startup and authentication on an open connection.
    async fn handshake(
        stream: Stream,
        endpoint: String,
        host: String,
        config: &tokio_postgres::Config,
        max_message_bytes: usize,
        user: String,
    ) -> Result<Self> {
        let dbname = config.get_dbname().unwrap_or(&user).to_owned();
        let (stream, channel) = negotiate_tls(stream, &host, &endpoint, config).await?;
        let mut conn = ReplicationConnection {
            stream,
            read: BytesMut::with_capacity(READ_CHUNK),
            write: BytesMut::new(),
            endpoint,
            server_version: 0,
            slot: String::new(),
            max_message_bytes,
            read_pause: None,
            last_read_short: false,
            pacing: true,
            in_handshake: true,
            sql_config: config.clone(),
            publications: Vec::new(),
            skipped_notice: None,
            publication_lookup: None,
            backend_pid: None,
            last_notice: None,
        };
        // The user's own `options` (say `-c work_mem=..`) come first: the later of two
        // settings wins, and the text form of the values pgoutput sends depends on pgapply's.
        let options = match config.get_options() {
            Some(own) if !own.trim().is_empty() => format!("{own} {STARTUP_OPTIONS}"),
            _ => STARTUP_OPTIONS.to_owned(),
        };
        let mut params: Vec<(&str, &str)> = vec![
            ("user", &user),
            ("database", &dbname),
            ("replication", "database"),
            ("options", &options),
            ("client_encoding", "UTF8"),
        ];
        let app = config.get_application_name().unwrap_or("pgapply");
        params.push(("application_name", app));
        frontend::startup_message(params.iter().copied(), &mut conn.write)
            .map_err(|e| Error::io("source connection: encoding startup", e))?;
        conn.flush().await?;
        let password = config.get_password().map(|p| p.to_vec());
        conn.authenticate(
            &user,
            password.as_deref(),
            &channel,
            config.get_channel_binding(),
        )
        .await?;
        Ok(conn)
    }

    async fn flush(&mut self) -> Result<()> {
        let buf = self.write.split();
        self.stream
            .write_all(&buf)
            .await
            .map_err(|e| Error::io(format!("writing to source {}", self.endpoint), e))
    }

    /// Whether a whole CopyData message is already buffered: reading it needs no I/O.
    pub fn has_buffered_copy_data(&self) -> bool {
        if self.read.len() < 5 || self.read[0] != b'd' {
            return false;
        }
        let len = u32::from_be_bytes([self.read[1], self.read[2], self.read[3], self.read[4]]);
        self.read.len() > len as usize
    }

    /// Paces reads while streaming (see `read_pause`); `None` reads as soon as data arrives.
    pub fn set_read_pause(&mut self, pause: Option<Duration>) {
        self.read_pause = pause;
    }

    /// Pause after short reads only while this is on: the consumer has enough queued not to
    /// starve meanwhile.
    pub fn set_pacing(&mut self, on: bool) {
        self.pacing = on;
    }

    /// Room in the read buffer for the rest of a message of `need` bytes (tag included) that
    /// starts the buffer, grown as its bytes arrive rather than by what its header claims.
    /// A message larger than a read gets an allocation of its own that ends where it ends: the
    /// buffer's usual doubling would leave up to as much again behind it, which the next
    /// messages' bytes would fill and the received message would keep alive while it waits in
    /// the queue, so that the queue's budget would hold twice its size in memory.
    fn make_room_for(&mut self, need: usize) {
        let have = self.read.len();
        if need <= READ_CHUNK {
            if self.read.capacity() - have < READ_CHUNK / 4 {
                self.read.reserve(READ_CHUNK);
            }
            return;
        }
        if self.read.capacity() >= need {
            return;
        }
        let mut grown = BytesMut::with_capacity(large_message_room(have, need));
        grown.extend_from_slice(&self.read);
        self.read = grown;
    }

    /// Reads the next complete backend message; `Ok((tag, body))`, body without tag and length.
    async fn read_message(&mut self) -> Result<(u8, Bytes)> {
        loop {
            if self.read.len() >= 5 {
                let tag = self.read[0];
                let len =
                    u32::from_be_bytes([self.read[1], self.read[2], self.read[3], self.read[4]])
                        as usize;
                if len < 4 {
                    return Err(Error::definite(format!(
                        "source {} sent a protocol message with invalid length {len}",
                        self.endpoint
                    )));
                }
                // Authentication, errors, notices, parameters, protocol negotiation, key, ready.
                if self.in_handshake && !b"RENSvKZ".contains(&tag) {
                    return Err(Error::definite(format!(
                        "source {} does not answer as a PostgreSQL server does (its first bytes: {:?}): check the host and port of --source",
                        self.endpoint,
                        String::from_utf8_lossy(&self.read[..self.read.len().min(16)])
                    )));
                }
                if len > self.max_message_bytes {
                    return Err(Error::definite(format!(
                        "source {} sent a {len}-byte message, larger than the limit of {} bytes (max_message_bytes)",
                        self.endpoint, self.max_message_bytes
                    )));
                }
                if self.read.len() > len {
                    let mut frame = self.read.split_to(len + 1);
                    frame.advance(5);
                    return Ok((tag, frame.freeze()));
                }
                self.make_room_for(len + 1);
            } else if self.read.capacity() - self.read.len() < READ_CHUNK / 4 {
                self.read.reserve(READ_CHUNK);
            }
            if let Some(pause) = self
                .read_pause
                .filter(|_| self.last_read_short && self.pacing)
            {
                self.last_read_short = false;
                tokio::time::sleep(pause).await;
            }
            let n = self
                .stream
                .read_buf(&mut self.read)
                .await
                .map_err(|e| Error::io(format!("reading from source {}", self.endpoint), e))?;
            if n == 0 {
                return Err(Error::transient(format!(
                    "source {} closed the connection",
                    self.endpoint
                )));
            }
            self.last_read_short = n < SHORT_READ;
        }
    }

    /// Parses a message we already framed, with postgres-protocol's codec.
    fn parse(&self, tag: u8, body: &Bytes) -> Result<backend::Message> {
        let mut raw = BytesMut::with_capacity(body.len() + 5);
        raw.extend_from_slice(&[tag]);
        raw.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        raw.extend_from_slice(body);
        match backend::Message::parse(&mut raw) {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(Error::definite(format!(
                "source {} sent an incomplete message (tag {:?})",
                self.endpoint, tag as char
            ))),
            Err(e) => Err(Error::definite(format!(
                "source {} sent a malformed message (tag {:?}): {e}",
                self.endpoint, tag as char
            ))),
        }
    }

    /// Authenticates as libpq does, `channel_binding` included: SCRAM-SHA-256-PLUS over TLS
    /// where the server offers it (unless disabled), so that a man in the middle of the TLS
    /// connection (possible with sslmode=require, which does not check the certificate) is
    /// caught; `require` refuses any authentication without it.
    async fn authenticate(
        &mut self,
        user: &str,
        password: Option<&[u8]>,
        channel: &Channel,
        binding: tokio_postgres::config::ChannelBinding,
    ) -> Result<()> {
        use tokio_postgres::config::ChannelBinding as Wanted;
        let required = matches!(binding, Wanted::Require);
        let endpoint = self.endpoint.clone();
        let unbound = |how: &str| {
            Error::definite(format!(
                "channel_binding=require, but source {endpoint} {how}: channel binding needs TLS (sslmode=require or stronger) and scram-sha-256 authentication in the source's pg_hba.conf; or leave channel_binding out (prefer binds where the server can)"
            ))
        };
        let mut bound = false;
        let need_password = || {
            Error::definite(format!(
                "source requires a password for user {user:?}: give password= in --source, --source-password-file, PGPASSWORD, or ~/.pgpass"
            ))
        };
        let mut scram: Option<ScramSha256> = None;
        // Whether the server proved it knows the password (SCRAM's final message verified).
        let mut scram_verified = false;
        loop {
            let (tag, body) = self.read_message().await?;
            match self.parse(tag, &body)? {
                // As libpq: a server that started SCRAM must finish it before saying "ok", or it
                // has not shown it knows the password (a man in the middle could do that).
                backend::Message::AuthenticationOk if scram.is_some() && !scram_verified => {
                    return Err(Error::definite(format!(
                        "source {} ended SCRAM authentication without proving it knows the password: refusing the connection",
                        self.endpoint
                    )));
                }
                backend::Message::AuthenticationOk if required && !bound => {
                    return Err(unbound("let pgapply in without SCRAM authentication"));
                }
                backend::Message::AuthenticationOk => {}
                backend::Message::AuthenticationCleartextPassword
                | backend::Message::AuthenticationMd5Password(_)
                    if required =>
                {
                    return Err(unbound("asks for a password without SCRAM"));
                }
                backend::Message::AuthenticationCleartextPassword => {
                    let pw = password.ok_or_else(need_password)?;
                    frontend::password_message(pw, &mut self.write)
                        .map_err(|e| Error::io("encoding password", e))?;
                    self.flush().await?;
                }
                backend::Message::AuthenticationMd5Password(body) => {
                    let pw = password.ok_or_else(need_password)?;
                    let hash =
                        postgres_protocol::authentication::md5_hash(user.as_bytes(), pw, body.salt());
                    frontend::password_message(hash.as_bytes(), &mut self.write)
                        .map_err(|e| Error::io("encoding password", e))?;
                    self.flush().await?;
                }
                backend::Message::AuthenticationSasl(body) => {
                    let pw = password.ok_or_else(need_password)?;
                    let mut mechanisms = body.mechanisms();
                    let (mut plain, mut plus) = (false, false);
                    while let Ok(Some(m)) = mechanisms.next() {
                        plain |= m == sasl::SCRAM_SHA_256;
                        plus |= m == sasl::SCRAM_SHA_256_PLUS;
                    }
                    let may_bind = !matches!(binding, Wanted::Disable);
                    let (mechanism, data) = match &channel.end_point {
                        Some(end_point) if plus && may_bind => (
                            sasl::SCRAM_SHA_256_PLUS,
                            sasl::ChannelBinding::tls_server_end_point(end_point.clone()),
                        ),
                        _ if required && !channel.tls => {
                            return Err(unbound("is reached without TLS"))
                        }
                        _ if required && !plus => {
                            return Err(unbound("does not offer SCRAM-SHA-256-PLUS"))
                        }
                        _ if required => {
                            return Err(unbound("has a certificate whose signature algorithm names no hash pgapply can bind with"))
                        }
                        _ if !plain => {
                            return Err(Error::definite(
                                "source offers no SASL mechanism pgapply supports (SCRAM-SHA-256, SCRAM-SHA-256-PLUS)",
                            ))
                        }
                        // ("y": the client could bind, the server offered no binding; a server
                        // that can bind sees a man in the middle who took it off the list.)
                        Some(_) if may_bind => {
                            (sasl::SCRAM_SHA_256, sasl::ChannelBinding::unrequested())
                        }
                        _ => (sasl::SCRAM_SHA_256, sasl::ChannelBinding::unsupported()),
                    };
                    bound = mechanism == sasl::SCRAM_SHA_256_PLUS;
                    let s = ScramSha256::new(pw, data);
                    frontend::sasl_initial_response(mechanism, s.message(), &mut self.write)
                        .map_err(|e| Error::io("encoding SASL", e))?;
                    self.flush().await?;
                    scram = Some(s);
                }
                backend::Message::AuthenticationSaslContinue(body) => {
                    let s = scram
                        .as_mut()
                        .ok_or_else(|| Error::definite("source sent SASL continue without SASL start"))?;
                    s.update(body.data()).map_err(|e| {
                        Error::definite(format!("SCRAM authentication with the source failed: {e}"))
                    })?;
                    frontend::sasl_response(s.message(), &mut self.write)
                        .map_err(|e| Error::io("encoding SASL", e))?;
                    self.flush().await?;
                }
                backend::Message::AuthenticationSaslFinal(body) => {
                    let s = scram
                        .as_mut()
                        .ok_or_else(|| Error::definite("source sent SASL final without SASL start"))?;
                    s.finish(body.data()).map_err(|e| {
                        Error::definite(format!(
                            "SCRAM authentication with the source failed (server signature did not verify): {e}"
                        ))
                    })?;
                    scram_verified = true;
                }
                backend::Message::ParameterStatus(p) => {
                    if p.name().ok() == Some("server_version") {
                        if let Ok(v) = p.value() {
                            self.server_version = parse_server_version(v);
                        }
                    }
                }
                backend::Message::BackendKeyData(key) => {
                    self.backend_pid = Some(key.process_id());
                }
                backend::Message::NoticeResponse(_) => {}
                backend::Message::ReadyForQuery(_) => {
                    self.in_handshake = false;
                    return Ok(());
                }
                backend::Message::ErrorResponse(e) => {
                    let e = server_error(e.fields());
                    return Err(e.into_error(&format!("connecting to source {} as {user:?}", self.endpoint)));
                }
                _ => {
                    return Err(Error::definite(format!(
                        "source {} sent an unsupported authentication request (tag {:?}); pgapply supports trust, password, md5 and scram-sha-256",
                        self.endpoint, tag as char
                    )))
                }
            }
        }
    }

    /// Runs one statement with the simple query protocol and collects its rows as text.
    pub async fn simple_query(&mut self, sql: &str) -> Result<QueryResult> {
        frontend::query(sql, &mut self.write).map_err(|e| Error::io("encoding query", e))?;
        self.flush().await?;
        let mut result = QueryResult::default();
        let mut error: Option<ServerError> = None;
        loop {
            let (tag, body) = self.read_message().await?;
            match self.parse(tag, &body)? {
                backend::Message::RowDescription(desc) => {
                    let mut fields = desc.fields();
                    while let Ok(Some(f)) = fields.next() {
                        result.columns.push(f.name().to_owned());
                    }
                }
                backend::Message::DataRow(row) => {
                    let buf = row.buffer();
                    let mut values = Vec::new();
                    let mut ranges = row.ranges();
                    while let Ok(Some(range)) = ranges.next() {
                        values.push(range.map(|r| String::from_utf8_lossy(&buf[r]).into_owned()));
                    }
                    result.rows.push(values);
                }
                backend::Message::ErrorResponse(e) => error = Some(server_error(e.fields())),
                backend::Message::ReadyForQuery(_) => {
                    return match error {
                        Some(e) => Err(e.into_error(&format!("source {}", self.endpoint))),
                        None => Ok(result),
                    };
                }
                _ => {}
            }
        }
    }

    /// Sends a command that answers with CopyBothResponse (START_REPLICATION) and enters copy mode.
    pub async fn start_copy_both(&mut self, sql: &str) -> Result<()> {
        frontend::query(sql, &mut self.write).map_err(|e| Error::io("encoding query", e))?;
        self.flush().await?;
        loop {
            let (tag, body) = self.read_message().await?;
            // postgres-protocol does not know CopyBothResponse ('W'): it is handled here.
            if tag == b'W' {
                return Ok(());
            }
            match self.parse(tag, &body)? {
                backend::Message::ErrorResponse(e) => {
                    let e = server_error(e.fields());
                    // The server follows an error with ReadyForQuery; drain it so the connection
                    // stays usable for a caller that wants to retry.
                    let _ = self.wait_ready().await;
                    return Err(e.into_error(&format!("source {}", self.endpoint)));
                }
                backend::Message::NoticeResponse(_) | backend::Message::ParameterStatus(_) => {}
                _ => {
                    return Err(Error::definite(format!(
                        "source {} answered START_REPLICATION with unexpected message {:?}",
                        self.endpoint, tag as char
                    )))
                }
            }
        }
    }

    async fn wait_ready(&mut self) -> Result<()> {
        loop {
            let (tag, _) = self.read_message().await?;
            if tag == b'Z' {
                return Ok(());
            }
        }
    }

    /// Logs a source's notice or warning, once a minute at most when it repeats itself.
    fn log_notice(&mut self, n: &ServerError) {
        let Some(repeats) = RepeatedNotice::to_log(&mut self.last_notice, n.to_string()) else {
            return;
        };
        // A WARNING says something is wrong (a standby that holds logical replication back,
        // say): seen, and with what the server says to do.
        if n.severity == "WARNING" {
            tracing::warn!(source = %self.endpoint, warning = %n, repeated_since_last_logged = repeats, "source warning");
        } else {
            tracing::info!(source = %self.endpoint, notice = %n.message, repeated_since_last_logged = repeats, "source notice");
        }
    }

    /// In copy mode: the next CopyData payload. `Ok(None)` when the server ended copy mode.
    /// Cancel-safe: bytes read so far stay in the connection's buffer.
    pub async fn read_copy_data(&mut self) -> Result<Option<Bytes>> {
        loop {
            if self.skipped_notice.is_some() {
                self.look_into_skipped_publication().await?;
            }
            let (tag, body) = self.read_message().await?;
            match tag {
                b'd' => return Ok(Some(body)),
                // CopyDone ends the stream; a walsender that is shutting down (server stop)
                // sends CommandComplete without CopyDone.
                b'c' | b'C' => return Ok(None),
                b'N' | b'S' => {
                    if let Ok(backend::Message::NoticeResponse(n)) = self.parse(tag, &body) {
                        let n = server_error(n.fields());
                        // (PostgreSQL 18 sends it as a plain WARNING; a translated message
                        // still names the publication in quotes. A false match costs one query.)
                        if n.code == "42704"
                            || n.message.starts_with("skipped loading publication")
                            || self
                                .publications
                                .iter()
                                .any(|p| n.message.contains(&format!("\"{p}\"")))
                        {
                            self.skipped_notice = Some(n);
                            continue;
                        }
                        self.log_notice(&n);
                    }
                }
                b'E' => {
                    let e = match self.parse(tag, &body)? {
                        backend::Message::ErrorResponse(e) => server_error(e.fields()),
                        _ => unreachable_error(),
                    };
                    let hint = stream_error_hint(&e, &self.slot);
                    let err = e.into_error(&format!("source {} ended replication", self.endpoint));
                    return Err(match hint {
                        Some(hint) => err.context_after(hint),
                        None => err,
                    });
                }
                other => {
                    return Err(Error::definite(format!(
                        "source {} sent unexpected message {:?} during replication",
                        self.endpoint, other as char
                    )))
                }
            }
        }
    }

    /// A PostgreSQL 18+ source decoding a change at a point in the WAL where a publication the
    /// run names did not exist under that name says so in a WARNING, and goes on without it.
    /// (Before 18 the walsender stops with an error instead.) That is as meant for changes
    /// written before the publication was created (a slot made first), but a publication renamed
    /// or dropped while pgapply runs would leave its tables' changes out, and the slot would be
    /// confirmed past them. So: if one of the run's publications is missing on the source now,
    /// stop at once, before anything after this point is applied or confirmed; else warn.
    async fn look_into_skipped_publication(&mut self) -> Result<()> {
        let lookup = self.publication_lookup.get_or_insert_with(|| {
            let (config, publications) = (self.sql_config.clone(), self.publications.clone());
            let what = format!(
                "source {}: looking up the publications after the source skipped one",
                self.endpoint
            );
            tokio::spawn(tracing::Instrument::in_current_span(async move {
                let client = crate::tls::connect(&config)
                    .await
                    .map_err(|e| e.into_error(what.clone()))?;
                let rows = client
                    .query(
                        "SELECT pubname::text FROM pg_catalog.pg_publication WHERE pubname = ANY($1)",
                        &[&publications],
                    )
                    .await
                    .map_err(|e| Error::postgres(what, e))?;
                Ok(rows.iter().map(|r| r.get(0)).collect())
            }))
        });
        // (Awaited by reference: cancelled here, the task goes on, and the next read awaits it.)
        let done = lookup.await;
        self.publication_lookup = None;
        let existing: Vec<String> = done.map_err(|e| {
            Error::transient(format!(
                "source {}: looking up the publications after the source skipped one: {e}",
                self.endpoint
            ))
        })??;
        let missing: Vec<&String> = self
            .publications
            .iter()
            .filter(|p| !existing.contains(p))
            .collect();
        let Some(notice) = self.skipped_notice.take() else {
            return Ok(());
        };
        let said = format!(
            "{}{}",
            notice.message,
            notice
                .detail
                .as_deref()
                .map(|d| format!(" ({})", d.trim_end_matches('.')))
                .unwrap_or_default()
        );
        if !missing.is_empty() {
            let start_over = start_over_advice(&self.slot);
            let names: Vec<String> = missing.iter().map(|p| format!("{p:?}")).collect();
            return Err(Error::definite(format!(
                "source {}: {said}: publication {} of this run no longer exists on the source (renamed or dropped while pgapply ran), and the source would send none of its tables' changes from here on; pgapply stopped before applying or confirming anything after this point. Renamed: run with its new name in --publication (a change is decoded under the name the publication had when it was written; a transaction open across the rename may have been decoded in part under the old name only: compare its tables with `pgapply verify` after). Dropped: the changes written since cannot be decoded: create it again and {start_over}",
                self.endpoint,
                names.join(", "),
            )));
        }
        // (Each time: the source says it once per reload of its publications, after a change to
        // them, so a second drop or rename is not hidden behind the first.)
        tracing::warn!(
            source = %self.endpoint,
            notice = %said,
            "the source left out a publication for changes written where it did not exist under that name: as meant for changes written before it was created (a slot made first); but if it was dropped and created again, or renamed away and back, the changes of its tables written in between were not sent: compare with `pgapply verify`, and copy those tables again if they differ"
        );
        Ok(())
    }

    /// Sends one CopyData message (a standby status update).
    pub async fn send_copy_data(&mut self, payload: &[u8]) -> Result<()> {
        self.write.extend_from_slice(b"d");
        self.write
            .extend_from_slice(&((payload.len() + 4) as u32).to_be_bytes());
        self.write.extend_from_slice(payload);
        self.flush().await
    }

    /// Ends copy mode from our side and closes the session politely.
    pub async fn close(mut self) {
        frontend::copy_done(&mut self.write);
        frontend::terminate(&mut self.write);
        let _ = self.flush().await;
    }
}

fn unreachable_error() -> ServerError {
    ServerError {
        severity: "ERROR".into(),
        code: "XX000".into(),
        message: "unparseable error response".into(),
        detail: None,
        hint: None,
    }
}

/// "15.4 (Debian 15.4-1)" -> 150004; "9.6.24" -> 90624; "18beta1" -> 180000.
pub fn parse_server_version(text: &str) -> u32 {
    let numeric: String = text
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    // (Parts kept small: the text comes from the network, and the sums must not overflow.)
    let mut parts = numeric
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0).min(9999));
    let major = parts.next().unwrap_or(0);
    let second = parts.next().unwrap_or(0);
    if major >= 10 {
        major * 10000 + second
    } else {
        major * 10000 + second.min(99) * 100 + parts.next().unwrap_or(0).min(99)
    }
}

/// Opens a connection to the first host of `config`, from its `from`th on, that accepts one:
/// the stream, the endpoint, the name TLS verifies, and the host's index. `None` when none is
/// left after `from` and `tried_before` says an earlier host answered.
async fn open_stream(
    config: &tokio_postgres::Config,
    timeout: Duration,
    from: usize,
    tried_before: bool,
) -> Result<Option<(Stream, String, String, usize)>> {
    let hosts = config.get_hosts();
    let hostaddrs = config.get_hostaddrs();
    let ports = config.get_ports();
    let mut last_err = None;
    let default_hosts = [Host::Tcp("localhost".into())];
    let hosts: &[Host] = if hosts.is_empty() && hostaddrs.is_empty() {
        &default_hosts
    } else {
        hosts
    };
    for i in from..hosts.len().max(hostaddrs.len()) {
        let port = ports
            .get(i)
            .or_else(|| ports.first())
            .copied()
            .unwrap_or(5432);
        // As libpq: hostaddr is where to connect, host (if given) the name TLS verifies.
        let host = match (hosts.get(i), hostaddrs.get(i)) {
            (Some(Host::Unix(dir)), None) => Host::Unix(dir.clone()),
            (Some(Host::Tcp(name)), addr) => {
                Host::Tcp(addr.map(|a| a.to_string()).unwrap_or_else(|| name.clone()))
            }
            (_, Some(addr)) => Host::Tcp(addr.to_string()),
            (None, None) => continue,
        };
        let tls_name = match hosts.get(i) {
            Some(Host::Tcp(name)) => name.clone(),
            _ => hostaddrs.get(i).map(|a| a.to_string()).unwrap_or_default(),
        };
        match &host {
            Host::Tcp(name) => {
                let endpoint = format!("{name}:{port}");
                match tokio::time::timeout(timeout, TcpStream::connect((name.as_str(), port))).await
                {
                    Ok(Ok(s)) => {
                        let _ = s.set_nodelay(true);
                        return Ok(Some((Stream::Tcp(s), endpoint, tls_name, i)));
                    }
                    Ok(Err(e)) => {
                        last_err = Some(Error::io(format!("connecting to source {endpoint}"), e))
                    }
                    Err(_) => {
                        last_err = Some(Error::transient(format!(
                            "connecting to source {endpoint}: timed out after {}",
                            humantime::format_duration(timeout)
                        )))
                    }
                }
            }
            Host::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                let endpoint = path.display().to_string();
                match tokio::net::UnixStream::connect(&path).await {
                    Ok(s) => return Ok(Some((Stream::Unix(s), endpoint, String::new(), i))),
                    Err(e) => {
                        last_err = Some(Error::io(format!("connecting to source {endpoint}"), e))
                    }
                }
            }
        }
    }
    match last_err {
        Some(e) if !tried_before => Err(e),
        _ if tried_before => Ok(None),
        _ => Err(Error::definite("source connection: no host given")),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_server_version;

    #[test]
    fn a_large_message_is_grown_to_its_size_and_no_further() {
        use super::{large_message_room, READ_CHUNK};
        for need in [READ_CHUNK + 1, 1 << 20, (1 << 20) + 45, 1 << 30] {
            // Each step at least a read larger, never past the end, and the bytes copied on
            // the way (what had arrived at each step) stay within twice the message.
            let (mut have, mut copied, mut steps) = (100, 0, 0);
            while have < need {
                let room = large_message_room(have, need);
                assert!(room <= need && room >= have + READ_CHUNK.min(need - have));
                copied += have;
                steps += 1;
                have = room;
            }
            assert_eq!(have, need);
            assert!(copied <= 2 * need, "{need}: {copied}");
            assert!(steps <= 12, "{need}: {steps}");
        }
    }

    /// A message larger than a read, arriving in pieces and followed by others: framed whole,
    /// and the ones after it too.
    #[tokio::test]
    async fn a_message_larger_than_a_read_is_framed_whole() {
        use tokio::io::AsyncWriteExt;
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let mut conn = super::ReplicationConnection::for_test(super::Stream::Tls(Box::new(client)));
        let big: Vec<u8> = (0..(1 << 20) + 13).map(|i| (i % 251) as u8).collect();
        let mut wire = Vec::new();
        for body in [&big[..], b"small", &big[..1000]] {
            wire.push(b'd');
            wire.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
            wire.extend_from_slice(body);
        }
        let writer = tokio::spawn(async move {
            for piece in wire.chunks(100_000) {
                server.write_all(piece).await.unwrap();
            }
            server
        });
        for expected in [&big[..], b"small", &big[..1000]] {
            let (tag, body) = conn.read_message().await.unwrap();
            assert_eq!(tag, b'd');
            assert_eq!(&body[..], expected);
        }
        drop(writer.await.unwrap());
    }

    #[test]
    fn a_repeated_notice_is_counted_not_logged() {
        use super::{RepeatedNotice, NOTICE_REPEAT_QUIET};
        let mut last = None;
        assert_eq!(RepeatedNotice::to_log(&mut last, "a".into()), Some(0));
        assert_eq!(RepeatedNotice::to_log(&mut last, "a".into()), None);
        assert_eq!(RepeatedNotice::to_log(&mut last, "a".into()), None);
        // Another one is logged at once; the first again too (its count started over).
        assert_eq!(RepeatedNotice::to_log(&mut last, "b".into()), Some(0));
        assert_eq!(RepeatedNotice::to_log(&mut last, "a".into()), Some(0));
        assert_eq!(RepeatedNotice::to_log(&mut last, "a".into()), None);
        // A minute on, the same one is logged again, with how often it came meanwhile.
        if let Some(l) = last.as_mut() {
            l.logged_at -= NOTICE_REPEAT_QUIET;
        }
        assert_eq!(RepeatedNotice::to_log(&mut last, "a".into()), Some(1));
    }

    #[test]
    fn server_versions() {
        assert_eq!(
            parse_server_version("15.4 (Debian 15.4-1.pgdg120+1)"),
            150004
        );
        assert_eq!(parse_server_version("10.23"), 100023);
        assert_eq!(parse_server_version("18beta1"), 180000);
        assert_eq!(parse_server_version("9.6.24"), 90624);
        // Nonsense from the network: no overflow.
        assert_eq!(parse_server_version("429497.99999"), 99_999_999);
    }
}
