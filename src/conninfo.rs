//! Connection strings: libpq key=value or postgres:// URLs, completed from the environment the way
//! libpq does (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD, ~/.pgpass), and described for logs
//! without the password.

use std::path::PathBuf;
use std::str::FromStr;

use tokio_postgres::config::Host;

use crate::error::{Error, Result};

/// Parses `conninfo` for the connection called `role` ("source" or "target").
pub fn parse(role: &str, conninfo: &str) -> Result<tokio_postgres::Config> {
    let mut config = tokio_postgres::Config::from_str(conninfo).map_err(|e| {
        // tokio-postgres' message names the bad key or value, never the password.
        Error::definite(format!("--{role}: invalid connection string: {e}"))
    })?;
    complete_from_environment(&mut config);
    Ok(config)
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn complete_from_environment(config: &mut tokio_postgres::Config) {
    if config.get_hosts().is_empty() {
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
        if let Some(port) = env("PGPORT").and_then(|p| p.parse().ok()) {
            config.port(port);
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
    if config.get_password().is_none() {
        if let Some(pw) = env("PGPASSWORD").or_else(|| password_from_pgpass(config)) {
            config.password(pw);
        }
    }
    if config.get_application_name().is_none() {
        config.application_name("pgapply");
    }
}

fn pgpass_path() -> Option<PathBuf> {
    env("PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".pgpass")))
}

fn password_from_pgpass(config: &tokio_postgres::Config) -> Option<String> {
    let path = pgpass_path()?;
    let text = std::fs::read_to_string(path).ok()?;
    let host = match config.get_hosts().first()? {
        Host::Tcp(h) => h.clone(),
        Host::Unix(_) => "localhost".to_owned(),
    };
    let port = config
        .get_ports()
        .first()
        .copied()
        .unwrap_or(5432)
        .to_string();
    let user = config.get_user()?.to_owned();
    let db = config.get_dbname().unwrap_or(&user).to_owned();
    lookup_pgpass(&text, &host, &port, &db, &user)
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

/// `user@host:port/dbname`: enough to know which server is meant, never the password.
pub fn describe(config: &tokio_postgres::Config) -> String {
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
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
    fn bad_conninfo_names_the_flag() {
        let err = parse("target", "host=x bogus=1").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("--target: invalid connection string"),
            "{err}"
        );
    }
}
