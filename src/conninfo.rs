//! Connection strings: libpq key=value or postgres:// URLs, completed from the environment the way
//! libpq does (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD, ~/.pgpass), and described for logs
//! without the password.

use std::path::PathBuf;
use std::str::FromStr;

use tokio_postgres::config::{Host, TargetSessionAttrs};

use crate::error::{Error, Result};

mod service;

/// Parses `conninfo` for the connection called `role` ("source" or "target").
pub fn parse(role: &str, conninfo: &str) -> Result<tokio_postgres::Config> {
    // libpq reads an empty string as "every default" (localhost, the OS user's name): here it is
    // far more likely an unset shell variable, and would be retried for ever.
    if conninfo.trim().is_empty() {
        return Err(Error::usage(format!(
            "--{role}: the connection string is empty (an unset shell variable?): give the {role}'s, host=... port=... user=... dbname=... or a postgres:// URL"
        )));
    }
    if let Some(problem) = unencoded_url(conninfo) {
        return Err(Error::usage(format!(
            "--{role}: invalid connection string: {problem}"
        )));
    }
    let (rest, tls, mode_given, service) = take_tls_settings(conninfo)
        .map_err(|e| e.context(format!("--{role}: invalid connection string")))?;
    let rest = session_attrs_as_tokio_postgres_reads_them(&rest);
    let mut config = tokio_postgres::Config::from_str(&rest).map_err(|e| {
        // The cause (tokio-postgres' error source) names the bad key, never a value; but an
        // unquoted password with a space in it reads as more keys, named from the password.
        let detail = crate::error::describe_postgres(&e);
        let detail = detail
            .strip_prefix("invalid connection string: ")
            .unwrap_or(&detail)
            .to_owned();
        if !rest.contains('=') && !rest.contains("://") {
            return Error::usage(format!(
                "--{role}: invalid connection string: write key=value pairs (host=... port=... user=... dbname=...) or a postgres:// URL"
            ));
        }
        match named_from_password(&rest, &detail) {
            // `password=secret dbnmae=x`: a misspelt key as likely as a password with a space
            // (whose piece the parser's message would show).
            Some(true) => {
                return Error::usage(format!(
                    "--{role}: invalid connection string: a key that follows password= is unknown: is it misspelt? (Not named here, as it may be a piece of the password: a password with a space in it goes in single quotes, password='...', or with --{role}-password-file)"
                ))
            }
            Some(false) => {
                return Error::usage(format!(
                    "--{role}: invalid connection string: the password seems to contain a space: put it in single quotes (password='...'), or give it with --{role}-password-file"
                ))
            }
            None => {}
        }
        Error::usage(format!(
            "--{role}: invalid connection string: {detail}{}",
            unsupported_hint(&rest)
        ))
    })?;
    let mut tls = tls;
    let mut mode_given = mode_given;
    // As in libpq, a service's settings come after the connection string's and before the
    // environment's.
    if let Some(name) = service.or_else(|| env("PGSERVICE")) {
        service::complete(&name, &mut config, &mut tls, &mut mode_given)
            .map_err(|e| e.context(format!("--{role}")))?;
    }
    complete_from_environment(&mut config).map_err(|e| e.context(format!("--{role}")))?;
    detect_dead_peers(&mut config);
    // As in libpq, the connection string's sslmode wins over PGSSLMODE.
    if !mode_given {
        if let Some(mode) = env("PGSSLMODE") {
            tls.mode = crate::tls::SslMode::parse(&mode)?;
        }
    }
    if tls.root_cert.is_none() {
        tls.root_cert = env("PGSSLROOTCERT").map(PathBuf::from);
    }
    if tls.client_cert.is_none() {
        tls.client_cert = env("PGSSLCERT").map(PathBuf::from);
    }
    if tls.client_key.is_none() {
        tls.client_key = env("PGSSLKEY").map(PathBuf::from);
    }
    // As libpq: a Unix-domain socket carries no TLS, whatever sslmode says (the server answers
    // no to it there).
    let sockets_only = !config.get_hosts().is_empty()
        && config.get_hostaddrs().is_empty()
        && config
            .get_hosts()
            .iter()
            .all(|h| matches!(h, Host::Unix(_)));
    if sockets_only {
        tls.mode = crate::tls::SslMode::Disable;
    }
    config.ssl_mode(tls.mode.for_tokio_postgres());
    crate::tls::register(&config, tls);
    Ok(config)
}

/// A postgres:// URL whose user or password holds `@`, `/` or `:` unencoded splits in the wrong
/// places (part of the password becomes the host or the database, and would be shown in every
/// message about the connection): said, without the URL.
fn unencoded_url(conninfo: &str) -> Option<String> {
    let rest = conninfo
        .strip_prefix("postgresql://")
        .or_else(|| conninfo.strip_prefix("postgres://"))?;
    // The authority ends at the first / ? or #. An @ after it, a password's or a parameter
    // value's, would be read as the end of the user and password (the parser takes the last
    // @): it must be encoded.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, after) = rest.split_at(end);
    (authority.matches('@').count() > 1 || after.contains('@')).then(|| {
        "the URL has an @ where the server, database or parameters should be: a user, password or parameter value with @, /, :, ? or # in it must be percent-encoded in a URL (@ as %40, / as %2F, : as %3A, ? as %3F, # as %23), or give the password with PGPASSWORD or a password file".to_owned()
    })
}

/// TCP keepalives of about a minute, and a connect timeout, unless the connection string sets
/// its own: a server that
/// went away without a word (host down, network cut) is noticed while pgapply waits for an
/// answer, and the retry takes over, instead of waiting for the system default of two hours.
/// Keepalives are answered by the peer's kernel, so a slow statement is never cut short.
fn detect_dead_peers(config: &mut tokio_postgres::Config) {
    if config.get_keepalives_idle() == std::time::Duration::from_secs(2 * 60 * 60) {
        config.keepalives_idle(std::time::Duration::from_secs(30));
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(std::time::Duration::from_secs(10));
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(3);
    }
    // Each attempt (each host, each address) bounded, as the whole handshake is
    // (`tls::handshake_timeout`): without it an unreachable address waits for the system's
    // TCP timeout, about two minutes.
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
}

/// `connect_timeout` unless the connection string sets it.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A connection string without the settings pgapply handles itself, those settings, whether
/// sslmode was given, and the service named.
pub(crate) type TakenSettings = (String, crate::tls::TlsSettings, bool, Option<String>);

/// Takes `sslmode`, `sslrootcert`, `sslcert`, `sslkey` and `service` out of a connection string
/// (key=value or URL): pgapply handles them itself (tokio-postgres knows none of them).
/// Also says whether sslmode was given.
pub(crate) fn take_tls_settings(conninfo: &str) -> Result<TakenSettings> {
    let mut tls = crate::tls::TlsSettings::default();
    let mut mode_given = false;
    let mut service = None;
    let mut apply = |key: &str, value: &str| -> Result<bool> {
        match key {
            "sslmode" => {
                tls.mode = crate::tls::SslMode::parse(value)?;
                mode_given = true;
                Ok(true)
            }
            "sslrootcert" => {
                tls.root_cert = Some(PathBuf::from(value));
                Ok(true)
            }
            "sslcert" => {
                tls.client_cert = Some(PathBuf::from(value));
                Ok(true)
            }
            "sslkey" => {
                tls.client_key = Some(PathBuf::from(value));
                Ok(true)
            }
            "service" => {
                service = Some(value.to_owned());
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    let trimmed = conninfo.trim();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let Some((base, query)) = trimmed.split_once('?') else {
            return Ok((trimmed.to_owned(), tls, false, None));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if !apply(k, &percent_decode(v))? {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, tls, mode_given, service));
    }
    // key = value pairs; values may be single-quoted with \' and \\ escapes.
    let mut kept = String::new();
    let chars: Vec<char> = trimmed.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        let start = i;
        while i < chars.len() && chars[i] != '=' && !chars[i].is_whitespace() {
            i += 1;
        }
        let key: String = chars[start..i].iter().collect();
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if i >= chars.len() || chars[i] != '=' {
            if !key.is_empty() {
                // Let tokio-postgres report the malformed part.
                kept.push_str(&chars[start..].iter().collect::<String>());
            }
            break;
        }
        i += 1;
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        let value_start = i;
        let mut value = String::new();
        if i < chars.len() && chars[i] == '\'' {
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    i += 1;
                }
                value.push(chars[i]);
                i += 1;
            }
            i += 1;
        } else {
            while i < chars.len() && !chars[i].is_whitespace() {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    i += 1;
                }
                value.push(chars[i]);
                i += 1;
            }
        }
        if !apply(&key, &value)? {
            let raw: String = chars[start..i.min(chars.len())].iter().collect();
            let _ = value_start;
            kept.push_str(&raw);
            kept.push(' ');
        }
    }
    Ok((kept.trim_end().to_owned(), tls, mode_given, service))
}

/// Where the value of the `password` key starts: libpq allows spaces around `=`
/// (`password = secret`), and a search for `password=` alone would miss those.
fn password_value_start(conninfo: &str) -> Option<usize> {
    conninfo.match_indices("password").find_map(|(at, key)| {
        let before_ok = conninfo[..at]
            .chars()
            .next_back()
            .is_none_or(char::is_whitespace);
        let rest = &conninfo[at + key.len()..];
        let after_key = rest.trim_start();
        let value = after_key.strip_prefix('=')?.trim_start();
        before_ok.then_some(conninfo.len() - value.len())
    })
}

/// Whether the parser's complaint names a word that follows an unquoted `password=`, maybe a
/// part of the password: `Some(true)` when that word reads `key=value` (as likely a misspelt
/// key), `Some(false)` when it cannot be a key, `None` when the complaint is about another word.
fn named_from_password(conninfo: &str, detail: &str) -> Option<bool> {
    let after = &conninfo[password_value_start(conninfo)?..];
    if after.starts_with('\'') {
        return None;
    }
    let words: Vec<&str> = after.split_whitespace().skip(1).collect();
    // A libpq keyword named is a real option (passfile, say), not a piece of the password.
    let named = words.iter().find(|w| {
        let key = w.split('=').next().unwrap_or(w);
        !key.is_empty() && !LIBPQ_KEYWORDS.contains(&key) && detail.contains(&format!("`{key}`"))
    });
    match named {
        Some(w) => Some(w.contains('=')),
        // `password=ab cd port=5432`: the parser stops at `cd`, a word without `=`.
        None if (detail.contains("unexpected EOF") || detail.contains("expected `=`"))
            && words.iter().any(|w| !w.contains('=')) =>
        {
            Some(false)
        }
        None => None,
    }
}

/// libpq's connection keywords (PostgreSQL 18).
const LIBPQ_KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "require_auth",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "sslnegotiation",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslkeylogfile",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
    "min_protocol_version",
    "max_protocol_version",
    "scram_client_key",
    "scram_server_key",
];

/// libpq keywords tokio-postgres does not know, with what to use instead (its own message says
/// only "unknown option").
fn unsupported_hint(conninfo: &str) -> &'static str {
    let has =
        |key: &str| conninfo.contains(&format!("{key}=")) || conninfo.contains(&format!("{key} ="));
    if has("passfile") {
        "; passfile is not supported: set PGPASSFILE, or give the password with --source-password-file / --target-password-file"
    } else if has("sslpassword") {
        "; sslpassword is not supported: give sslkey a key without a passphrase (openssl pkey -in encrypted.key -out plain.key), readable only by its owner"
    } else if has("target_session_attrs") {
        "; pgapply takes target_session_attrs any, read-write (or primary) and read-only (or standby)"
    } else {
        ""
    }
}

/// Decodes %XX escapes (in bytes: a `%` before anything but two hex digits stays as it is).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let hex = |b: u8| char::from(b).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            if let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            ) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(crate) fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn complete_from_environment(config: &mut tokio_postgres::Config) -> Result<()> {
    // (hostaddr alone names the server: libpq then connects there, not to localhost.)
    let no_host = config.get_hosts().is_empty() && config.get_hostaddrs().is_empty();
    if no_host {
        match env("PGHOST") {
            Some(host) => {
                for h in host.split(',') {
                    config.host(h);
                }
            }
            None => {
                config.host("localhost");
            }
        }
    }
    if config.get_ports().is_empty() {
        if let Some(ports) = env("PGPORT") {
            // One port for every host, or one per host, as in libpq.
            for p in ports.split(',') {
                let port: u16 = p.trim().parse().map_err(|_| {
                    Error::usage(format!(
                        "PGPORT {ports:?} is not a port number (or a comma-separated list of them, one per host)"
                    ))
                })?;
                config.port(port);
            }
        }
    }
    if config.get_user().is_none() {
        if let Some(user) = env("PGUSER").or_else(|| env("USER")) {
            config.user(user);
        }
    }
    if config.get_dbname().is_none() {
        if let Some(db) = env("PGDATABASE") {
            config.dbname(db);
        }
    }
    if config.get_target_session_attrs() == TargetSessionAttrs::Any {
        if let Some(attrs) = env("PGTARGETSESSIONATTRS") {
            config.target_session_attrs(match attrs.as_str() {
                "read-write" | "primary" => TargetSessionAttrs::ReadWrite,
                "read-only" | "standby" => TargetSessionAttrs::ReadOnly,
                "any" => TargetSessionAttrs::Any,
                other => {
                    return Err(Error::usage(format!(
                        "PGTARGETSESSIONATTRS={other:?}: {SESSION_ATTRS_TAKEN}"
                    )))
                }
            });
        }
    }
    if config.get_password().is_none() {
        if let Some(pw) = env("PGPASSWORD").or_else(|| password_from_pgpass(config)) {
            config.password(pw);
        }
    }
    if config.get_application_name().is_none() {
        config.application_name("pgapply");
    }
    Ok(())
}

/// The target_session_attrs values pgapply takes.
const SESSION_ATTRS_TAKEN: &str = "pgapply takes target_session_attrs any, read-write (or primary: a server not in recovery, here also one whose sessions are read-write by default) and read-only (or standby: here also a primary whose sessions are read-only by default); prefer-standby is not supported";

/// libpq's `primary` and `standby` as tokio-postgres's nearest values (`read-write`,
/// `read-only`); another value it does not know is left for its parser to refuse.
fn session_attrs_as_tokio_postgres_reads_them(conninfo: &str) -> String {
    conninfo
        .replace(
            "target_session_attrs=primary",
            "target_session_attrs=read-write",
        )
        .replace(
            "target_session_attrs=standby",
            "target_session_attrs=read-only",
        )
}

fn pgpass_path() -> Option<PathBuf> {
    env("PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".pgpass")))
}

fn password_from_pgpass(config: &tokio_postgres::Config) -> Option<String> {
    password_in_file(&pgpass_path()?, config)
}

fn password_in_file(path: &std::path::Path, config: &tokio_postgres::Config) -> Option<String> {
    // As libpq: a password file others may read is not used (its passwords may be known).
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).ok()?.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                "password file {} has group or world access, so it is not used (as libpq does): chmod 0600 it",
                path.display()
            );
            return None;
        }
    }
    let text = std::fs::read_to_string(path).ok()?;
    // (libpq looks a password up by host, or by hostaddr when no host is given; with several
    // hosts, per host. One password serves a connection here: the first host's that has one,
    // so that a list whose first host has no line still finds the others'.)
    let hosts: Vec<String> = if config.get_hosts().is_empty() {
        config
            .get_hostaddrs()
            .iter()
            .map(|a| a.to_string())
            .collect()
    } else {
        config
            .get_hosts()
            .iter()
            .map(|h| match h {
                Host::Tcp(h) => h.clone(),
                // (As libpq: a socket directory is looked up by its path, the default one,
                // which libpq was built with, as localhost.)
                Host::Unix(dir) => {
                    let dir = dir.to_string_lossy();
                    let default = ["/var/run/postgresql", "/run/postgresql", "/tmp"];
                    if default.contains(&dir.trim_end_matches('/')) {
                        "localhost".to_owned()
                    } else {
                        dir.into_owned()
                    }
                }
            })
            .collect()
    };
    let ports = config.get_ports();
    let user = config.get_user()?.to_owned();
    let db = config.get_dbname().unwrap_or(&user).to_owned();
    hosts.iter().enumerate().find_map(|(i, host)| {
        // One port for every host, or one each.
        let port = ports
            .get(i)
            .or(ports.first())
            .copied()
            .unwrap_or(5432)
            .to_string();
        lookup_pgpass(&text, host, &port, &db, &user)
    })
}

/// Finds the password for a connection in .pgpass text: `host:port:db:user:password` lines,
/// `*` matching anything, `\:` and `\\` escaped.
pub fn lookup_pgpass(text: &str, host: &str, port: &str, db: &str, user: &str) -> Option<String> {
    for line in text.lines() {
        if line.trim_start().starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = split_pgpass_line(line);
        if fields.len() < 5 {
            continue;
        }
        let matches = |pattern: &str, value: &str| pattern == "*" || pattern == value;
        if matches(&fields[0], host)
            && matches(&fields[1], port)
            && matches(&fields[2], db)
            && matches(&fields[3], user)
        {
            return Some(fields[4..].join(":"));
        }
    }
    None
}

fn split_pgpass_line(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    if let Some(last) = fields.last_mut() {
                        last.push(next);
                    }
                }
            }
            ':' => fields.push(String::new()),
            _ => {
                if let Some(last) = fields.last_mut() {
                    last.push(c);
                }
            }
        }
    }
    fields
}

/// A connection string for the same server and database as `config`, to print in a command a
/// person runs next: host(s), hostaddr(s), port(s), dbname and user. Never the password (nor
/// TLS files or other settings, which the person adds as they gave them).
pub fn without_password(config: &tokio_postgres::Config) -> String {
    let quote = |v: &str| {
        if !v.is_empty() && !v.contains(|c: char| c.is_whitespace() || c == '\'' || c == '\\') {
            v.to_owned()
        } else {
            format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))
        }
    };
    let mut parts = Vec::new();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(h) => h.clone(),
            Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    if !hosts.is_empty() {
        parts.push(format!("host={}", quote(&hosts.join(","))));
    }
    let addrs: Vec<String> = config
        .get_hostaddrs()
        .iter()
        .map(|a| a.to_string())
        .collect();
    if !addrs.is_empty() {
        parts.push(format!("hostaddr={}", quote(&addrs.join(","))));
    }
    let ports: Vec<String> = config.get_ports().iter().map(|p| p.to_string()).collect();
    if !ports.is_empty() {
        parts.push(format!("port={}", quote(&ports.join(","))));
    }
    if let Some(db) = config.get_dbname() {
        parts.push(format!("dbname={}", quote(db)));
    }
    if let Some(user) = config.get_user() {
        parts.push(format!("user={}", quote(user)));
    }
    parts.join(" ")
}

/// `user@host:port/dbname`: enough to know which server is meant, never the password.
pub fn describe(config: &tokio_postgres::Config) -> String {
    let host = match (config.get_hosts().first(), config.get_hostaddrs().first()) {
        (Some(Host::Tcp(h)), _) => h.clone(),
        (Some(Host::Unix(p)), _) => p.display().to_string(),
        (None, Some(addr)) => addr.to_string(),
        (None, None) => "localhost".into(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}@{}:{}/{}",
        config.get_user().unwrap_or("?"),
        host,
        port,
        config.get_dbname().or(config.get_user()).unwrap_or("?")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_string_to_print_keeps_the_server_not_the_password() {
        let config = parse(
            "target",
            "host=h1,h2 port=5433,5434 dbname='my db' user=u password=secret",
        )
        .unwrap();
        let printed = without_password(&config);
        assert_eq!(printed, "host=h1,h2 port=5433,5434 dbname='my db' user=u");
        assert!(!printed.contains("secret"));
        assert_eq!(
            parse("target", &printed).unwrap().get_dbname(),
            Some("my db")
        );
    }

    #[test]
    fn a_password_with_a_space_is_not_repeated_in_the_error() {
        for conninfo in [
            "host=h password=abc def=x user=u",
            "host=h password=abc def",
            "host=h password=abc def port=5432",
            // libpq allows spaces around `=`.
            "host=h password = abc def=x user=u",
            "host=h password =abc def",
        ] {
            let err = parse("source", conninfo).unwrap_err().to_string();
            assert!(!err.contains("def"), "{err}");
            assert!(err.contains("single quotes"), "{err}");
        }
        let err = parse("target", " ").unwrap_err().to_string();
        assert!(
            err.starts_with("--target: the connection string is empty"),
            "{err}"
        );
        let err = parse("source", "host=h pasword=x").unwrap_err().to_string();
        assert!(err.contains("`pasword`"), "{err}");
        // A word=value after the password: as likely a misspelt key, said as such too.
        let err = parse("source", "host=h password=abc dbnmae=x")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a key that follows password= is unknown: is it misspelt?")
                && !err.contains("dbnmae"),
            "{err}"
        );
        // A real option after the password keeps its own message.
        let err = parse("source", "host=h password=x passfile=/p")
            .unwrap_err()
            .to_string();
        assert!(err.contains("PGPASSFILE"), "{err}");
    }

    #[test]
    fn a_unix_socket_carries_no_tls_whatever_sslmode_says() {
        let c = parse(
            "target",
            "host=/var/run/postgresql user=u dbname=d sslmode=verify-full",
        )
        .unwrap();
        assert_eq!(
            crate::tls::settings_for(&c).mode,
            crate::tls::SslMode::Disable
        );
        let c = parse("target", "host=db user=u dbname=d sslmode=require").unwrap();
        assert_eq!(
            crate::tls::settings_for(&c).mode,
            crate::tls::SslMode::Require
        );
    }

    #[test]
    fn tls_settings_stay_with_their_own_connection_string() {
        // The same user and database on two servers named by address only.
        let source = parse(
            "source",
            "hostaddr=10.0.0.5 user=u dbname=d sslmode=verify-ca sslrootcert=/tmp/ca.pem",
        )
        .unwrap();
        let target = parse(
            "target",
            "hostaddr=10.0.0.6 user=u dbname=d sslmode=disable",
        )
        .unwrap();
        assert_eq!(
            crate::tls::settings_for(&source).mode,
            crate::tls::SslMode::VerifyCa
        );
        assert_eq!(
            crate::tls::settings_for(&source).root_cert,
            Some(PathBuf::from("/tmp/ca.pem"))
        );
        assert_eq!(
            crate::tls::settings_for(&target).mode,
            crate::tls::SslMode::Disable
        );
    }

    #[test]
    fn target_session_attrs_of_libpq() {
        let config = parse("source", "host=a,b user=u target_session_attrs=primary").unwrap();
        assert_eq!(
            config.get_target_session_attrs(),
            TargetSessionAttrs::ReadWrite
        );
        let config = parse("source", "postgres://u@a,b/d?target_session_attrs=standby").unwrap();
        assert_eq!(
            config.get_target_session_attrs(),
            TargetSessionAttrs::ReadOnly
        );
        let err = parse(
            "source",
            "host=a user=u target_session_attrs=prefer-standby",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("read-write (or primary)"), "{err}");
    }

    #[test]
    fn pgpass_matching() {
        let text = "# comment\nother:5432:*:u:nope\nlocalhost:*:db:u:se\\:cret\n*:*:*:*:fallback\n";
        assert_eq!(
            lookup_pgpass(text, "localhost", "5433", "db", "u").as_deref(),
            Some("se:cret")
        );
        assert_eq!(
            lookup_pgpass(text, "h", "1", "x", "y").as_deref(),
            Some("fallback")
        );
        assert_eq!(lookup_pgpass("a:b:c:d:e", "x", "b", "c", "d"), None);
    }

    #[test]
    fn keepalives_notice_a_dead_server_within_a_minute_unless_set() {
        let c = parse("target", "host=h user=u").unwrap();
        assert_eq!(c.get_keepalives_idle(), std::time::Duration::from_secs(30));
        assert_eq!(
            c.get_keepalives_interval(),
            Some(std::time::Duration::from_secs(10))
        );
        assert_eq!(c.get_keepalives_retries(), Some(3));
        let c = parse("target", "host=h user=u keepalives_idle=600").unwrap();
        assert_eq!(c.get_keepalives_idle(), std::time::Duration::from_secs(600));
    }

    #[test]
    fn description_has_no_password() {
        let c = parse(
            "source",
            "host=db.example port=6543 user=app password=hunter2 dbname=shop",
        )
        .unwrap();
        let d = describe(&c);
        assert_eq!(d, "app@db.example:6543/shop");
        assert!(!d.contains("hunter2"));
        let c = parse("target", "postgres://app:hunter2@h:1/d").unwrap();
        assert!(!describe(&c).contains("hunter2"));
    }

    #[test]
    fn a_socket_directory_is_looked_up_by_its_path_the_default_one_as_localhost() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("pgapply-pgpass-sock-{}", std::process::id()));
        std::fs::write(
            &path,
            "/srv/pg\\:x:5432:*:u:by-path\nlocalhost:5432:*:u:local\n",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let config = |host: &str| {
            let mut c = tokio_postgres::Config::new();
            c.host_path(host).port(5432).user("u").dbname("d");
            c
        };
        assert_eq!(
            password_in_file(&path, &config("/srv/pg:x")).as_deref(),
            Some("by-path")
        );
        assert_eq!(
            password_in_file(&path, &config("/var/run/postgresql")).as_deref(),
            Some("local")
        );
        assert_eq!(password_in_file(&path, &config("/elsewhere")), None);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn several_hosts_find_the_first_line_that_fits_one_of_them() {
        use std::os::unix::fs::PermissionsExt;
        let path =
            std::env::temp_dir().join(format!("pgapply-pgpass-hosts-{}", std::process::id()));
        std::fs::write(
            &path,
            "b:5433:d:u:second
",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let config =
            tokio_postgres::Config::from_str("host=a,b port=5432,5433 user=u dbname=d").unwrap();
        assert_eq!(password_in_file(&path, &config).as_deref(), Some("second"));
        let one_port =
            tokio_postgres::Config::from_str("host=a,b port=5433 user=u dbname=d").unwrap();
        assert_eq!(
            password_in_file(&path, &one_port).as_deref(),
            Some("second")
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_password_file_others_may_read_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("pgapply-pgpass-{}", std::process::id()));
        std::fs::write(&path, "h:5432:d:u:secret\n").unwrap();
        let config = tokio_postgres::Config::from_str("host=h user=u dbname=d").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(password_in_file(&path, &config).as_deref(), Some("secret"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(password_in_file(&path, &config), None);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_url_with_an_unencoded_password_is_refused_without_showing_it() {
        for url in [
            "postgres://postgres:Sup3r:P@ss/w0rd@127.0.0.1:5521/app",
            "postgresql://u:pa/ss@host/db",
            "postgresql://repl:my?pass@SECRETword@127.0.0.1:56300/shop",
            "postgresql://u:S3cr@t:/?#%pw@host/db",
            "postgresql://u:a#b@host/db",
        ] {
            let err = parse("source", url).unwrap_err().to_string();
            assert!(err.contains("must be percent-encoded"), "{err}");
            assert!(
                !err.contains("w0rd") && !err.contains("ss@") && !err.contains("SECRET"),
                "{err}"
            );
        }
        // An @ in a parameter's value, encoded; unencoded it would end the user and password.
        assert!(parse("source", "postgres://u@h:1/db?application_name=a%40b").is_ok());
        let err = parse(
            "source",
            "postgresql://h:1/db?application_name=me@x&user=rep&password=secretpw",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("percent-encoded") && !err.contains("secretpw"),
            "{err}"
        );
        assert!(parse(
            "source",
            "postgres://u:P%40ss%2Fw0rd@h:1/db?sslmode=disable"
        )
        .is_ok());
        let err = parse("target", "x").unwrap_err().to_string();
        assert!(
            err.contains("write key=value pairs")
                && !err.contains("string: invalid connection string"),
            "{err}"
        );
    }

    #[test]
    fn tls_settings_are_taken_out() {
        let (rest, tls, given, _) =
            take_tls_settings("host=h sslmode=verify-full sslrootcert='/a b/ca.crt' user=u")
                .unwrap();
        assert!(given);
        assert_eq!(rest, "host=h user=u");
        assert_eq!(tls.mode, crate::tls::SslMode::VerifyFull);
        assert_eq!(tls.root_cert, Some(PathBuf::from("/a b/ca.crt")));
        let (rest, tls, _, _) = take_tls_settings(
            "postgres://u@h/db?sslmode=verify-ca&sslrootcert=%2Ftmp%2Fca.crt&application_name=x",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@h/db?application_name=x");
        assert_eq!(tls.mode, crate::tls::SslMode::VerifyCa);
        assert_eq!(tls.root_cert, Some(PathBuf::from("/tmp/ca.crt")));
        assert!(take_tls_settings("sslmode=sometimes").is_err());
        let c = parse(
            "source",
            "host=h sslmode=verify-full sslrootcert=/x user=u dbname=d",
        )
        .unwrap();
        assert_eq!(
            crate::tls::settings_for(&c).mode,
            crate::tls::SslMode::VerifyFull
        );
    }

    #[test]
    fn bad_conninfo_names_the_flag_and_the_key() {
        let err = parse("target", "host=x bogus=1").unwrap_err().to_string();
        assert!(
            err.starts_with("--target: invalid connection string"),
            "{err}"
        );
        assert!(err.contains("bogus"), "{err}");
        let err = parse("source", "host=x passfile=/p")
            .unwrap_err()
            .to_string();
        assert!(err.contains("PGPASSFILE"), "{err}");
        let err = parse("source", "host=x port=abc password=hunter2")
            .unwrap_err()
            .to_string();
        assert!(err.contains("port") && !err.contains("hunter2"), "{err}");
    }

    #[test]
    fn malformed_percent_escapes_are_kept_not_a_panic() {
        assert_eq!(percent_decode("se%aécret"), "se%aécret");
        assert_eq!(percent_decode("%zé%"), "%zé%");
        assert_eq!(percent_decode("a%2Fb%2f%4"), "a/b/%4");
        let err = parse("source", "postgres://u@h/db?password=se%aécret&x=%zé")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(!err.contains("cret"), "{err}");
    }

    #[test]
    fn hostaddr_alone_is_not_completed_with_localhost() {
        let c = parse("source", "hostaddr=10.0.0.5 port=6000 user=u dbname=d").unwrap();
        assert!(c.get_hosts().is_empty());
        assert_eq!(describe(&c), "u@10.0.0.5:6000/d");
    }
}
