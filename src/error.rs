//! pgapply's error: what failed, in words a user can act on, and whether retrying can help.

use std::fmt;

/// Whether an error can go away by itself (retry) or needs a person (stop and say what to do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Connection lost, server shutting down, serialization failure: retry from the recorded position.
    Transient,
    /// Missing table, constraint violation: retrying gives the same result.
    Definite,
    /// A bad flag, environment variable or config file value: nothing was started; fix the
    /// invocation (exit code 2, as for what the argument parser itself refuses).
    Usage,
}

#[derive(Debug)]
pub struct Error {
    class: ErrorClass,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn definite(message: impl Into<String>) -> Self {
        Error {
            class: ErrorClass::Definite,
            message: message.into(),
            source: None,
        }
    }

    pub fn usage(message: impl Into<String>) -> Self {
        Error {
            class: ErrorClass::Usage,
            message: message.into(),
            source: None,
        }
    }

    pub fn transient(message: impl Into<String>) -> Self {
        Error {
            class: ErrorClass::Transient,
            message: message.into(),
            source: None,
        }
    }

    /// A database error with context; the class follows the SQLSTATE (or the I/O failure).
    pub fn postgres(context: impl Into<String>, err: tokio_postgres::Error) -> Self {
        let class = classify_postgres(&err);
        Error {
            class,
            message: format!("{}: {}", context.into(), describe_postgres(&err)),
            source: Some(Box::new(err)),
        }
    }

    pub fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        // The server ended the TLS handshake over a setting (a client certificate it does not
        // take, say: TLS 1.3 says so only after the handshake, at the first read).
        if let Some(alert) = refusing_alert(&err) {
            return Error {
                class: ErrorClass::Definite,
                message: format!("{}: {err}; {}", context.into(), alert_advice(alert)),
                source: Some(Box::new(err)),
            };
        }
        Error {
            class: ErrorClass::Transient,
            message: format!("{}: {err}", context.into()),
            source: Some(Box::new(err)),
        }
    }

    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    pub fn class(&self) -> ErrorClass {
        self.class
    }

    pub fn is_transient(&self) -> bool {
        self.class == ErrorClass::Transient
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The server's SQLSTATE when the error came from a server.
    pub fn sqlstate(&self) -> Option<&str> {
        let source = self.source.as_deref()?;
        let pg = source.downcast_ref::<tokio_postgres::Error>()?;
        pg.as_db_error().map(|db| db.code().code())
    }

    /// A connection lost or refused (no server error): the kind a retry is made for.
    pub fn is_connection_lost(&self) -> bool {
        match self.source.as_deref() {
            Some(source) => match source.downcast_ref::<tokio_postgres::Error>() {
                Some(pg) => pg
                    .as_db_error()
                    .is_none_or(|db| db.code().code().starts_with("08")),
                None => source.downcast_ref::<std::io::Error>().is_some(),
            },
            None => false,
        }
    }

    /// A restart the run asks for itself, no failure (a cutover's stop position fell inside a
    /// group of transactions): said as news, and made at once.
    pub fn planned_restart(message: impl Into<String>) -> Self {
        Error::transient(message).with_source(PlannedRestart)
    }

    pub fn is_planned_restart(&self) -> bool {
        self.source
            .as_deref()
            .is_some_and(|s| s.downcast_ref::<PlannedRestart>().is_some())
    }

    /// The same error, but one that a retry must not paper over: a person has to act first.
    pub fn needing_a_person(mut self) -> Self {
        self.class = ErrorClass::Definite;
        self
    }

    /// Adds advice after the message.
    pub fn context_after(mut self, advice: impl fmt::Display) -> Self {
        self.message = format!("{}; {advice}", self.message);
        self
    }

    /// Adds what was being done in front of the message.
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

/// The mark of `Error::planned_restart`.
#[derive(Debug)]
struct PlannedRestart;

impl fmt::Display for PlannedRestart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a planned restart")
    }
}

impl std::error::Error for PlannedRestart {}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// SQLSTATE classes and codes that a retry can cure.
pub fn is_transient_sqlstate(code: &str) -> bool {
    matches!(
        code,
        "40001" // serialization_failure
            | "40P01" // deadlock_detected
            | "53300" // too_many_connections
            | "57P01" // admin_shutdown
            | "57P02" // crash_shutdown
            | "57P03" // cannot_connect_now
            | "55006" // object_in_use (e.g. slot or origin still held by a dying process)
            | "53100" // disk_full
            | "53200" // out_of_memory
    ) || code.starts_with("08") // connection_exception
}

fn classify_postgres(err: &tokio_postgres::Error) -> ErrorClass {
    match err.as_db_error() {
        Some(db) if is_transient_sqlstate(db.code().code()) => ErrorClass::Transient,
        Some(_) => ErrorClass::Definite,
        // A setting that cannot work (the server asked for a password and none was given, say):
        // trying again changes nothing.
        None if err.to_string().starts_with("invalid configuration") => ErrorClass::Definite,
        // sslmode=require (or verify-*) against a server without TLS: it will not grow it.
        None if server_lacks_tls(err) => ErrorClass::Definite,
        // A certificate the connection's sslmode and sslrootcert do not accept: nor will they.
        None if certificate_refused(err) => ErrorClass::Definite,
        // Nor does the server take again what it refused (a client certificate, say).
        None if refusing_alert(err).is_some() => ErrorClass::Definite,
        // Not a server error: connection closed, I/O, timeout.
        None => ErrorClass::Transient,
    }
}

/// A TLS alert from the server that a retry does not change: it refuses the client's
/// certificate (or its absence), or the versions and algorithms offered.
pub fn refusing_alert(err: &(dyn std::error::Error + 'static)) -> Option<rustls::AlertDescription> {
    use rustls::AlertDescription as A;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(s) = source {
        let found = s.downcast_ref::<rustls::Error>().or_else(|| {
            s.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|e| e.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::AlertReceived(alert)) = found {
            return matches!(
                alert,
                A::BadCertificate
                    | A::UnsupportedCertificate
                    | A::CertificateRevoked
                    | A::CertificateExpired
                    | A::CertificateUnknown
                    | A::UnknownCA
                    | A::DecryptError
                    | A::IllegalParameter
                    | A::HandshakeFailure
                    | A::ProtocolVersion
                    | A::AccessDenied
                    | A::CertificateRequired
                    | A::InsufficientSecurity
            )
            .then_some(*alert);
        }
        source = s.source();
    }
    None
}

/// What a refusing TLS alert asks of the user.
pub fn alert_advice(alert: rustls::AlertDescription) -> String {
    format!(
        "(TLS alert {alert:?}) {}",
        crate::tls::CLIENT_CERTIFICATE_ADVICE
    )
}

/// The TLS handshake refused the server's certificate (another CA, another name, expired).
pub fn certificate_refused(err: &tokio_postgres::Error) -> bool {
    let refused = |e: &(dyn std::error::Error + 'static)| {
        e.downcast_ref::<rustls::Error>()
            .is_some_and(|e| matches!(e, rustls::Error::InvalidCertificate(_)))
    };
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        let inner = s
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .is_some_and(|e| refused(e));
        if inner || refused(s) {
            return true;
        }
        source = s.source();
    }
    false
}

/// The server answered that it does not do TLS, and sslmode requires it.
pub fn server_lacks_tls(err: &tokio_postgres::Error) -> bool {
    std::error::Error::source(err).is_some_and(|s| s.to_string() == "server does not support TLS")
}

/// The server's message with its detail and hint, on one line.
pub fn describe_postgres(err: &tokio_postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => {
            let mut text = format!("{} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(detail) = db.detail() {
                text.push_str(&format!("; detail: {detail}"));
            }
            if let Some(hint) = db.hint() {
                text.push_str(&format!("; hint: {hint}"));
            }
            // A COPY names the row and column a value failed in there ("COPY t, line 3, column
            // v: ..."): the column is what the user must change.
            if let Some(place) = db
                .where_()
                .and_then(|w| w.lines().find(|l| l.starts_with("COPY ")))
            {
                text.push_str(&format!("; where: {place}"));
            }
            // A function's RAISE (a target trigger refusing a row, say): the function is what
            // the user must look at, and the message alone may not say which one it is.
            if let Some(place) = db.where_().and_then(|w| {
                w.lines()
                    .find(|l| l.starts_with("PL/pgSQL function ") || l.starts_with("SQL function "))
            }) {
                text.push_str(&format!("; in {place}"));
            }
            // pgapply's reading sessions set row_security = off, so that policies cannot hide
            // rows from a copy or a comparison without a word.
            // (PostgreSQL's own hint, when it gives one, is for a table owner under FORCE ROW
            // LEVEL SECURITY, and says what to do.)
            // A COPY into a table under policies is refused outright (its hint says to use
            // INSERT, which is not for pgapply's user to do).
            if (db.code() == &tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE
                && db
                    .message()
                    .starts_with("query would be affected by row-level security")
                && db.hint().is_none())
                || db
                    .message()
                    .starts_with("COPY FROM not supported with row-level security")
            {
                text.push_str(
                    "; pgapply copies, compares and applies every row regardless of policies: give this role BYPASSRLS (ALTER ROLE .. BYPASSRLS), or connect as the table's owner",
                );
            }
            text
        }
        None => {
            let mut text = err.to_string();
            let mut source = std::error::Error::source(err);
            while let Some(s) = source {
                text.push_str(&format!(": {s}"));
                source = s.source();
            }
            text
        }
    }
}
