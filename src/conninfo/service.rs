//! Connection service files (`service=name` or `PGSERVICE`), read as libpq reads them: the
//! user's file (`PGSERVICEFILE`, else `~/.pg_service.conf`), then the system's
//! (`$PGSYSCONFDIR/pg_service.conf`, else `/etc/postgresql-common/pg_service.conf`, where
//! Debian's libpq looks); the first that has the service gives its settings, which fill in what
//! the connection string leaves out, before the environment does.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::{env, take_tls_settings};
use crate::error::{Error, Result};

/// Fills in `config` (and the TLS settings) from service `name`.
pub(super) fn complete(
    name: &str,
    config: &mut tokio_postgres::Config,
    tls: &mut crate::tls::TlsSettings,
    mode_given: &mut bool,
) -> Result<()> {
    let files = service_files();
    let mut found = None;
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        if let Some(pairs) = section(&text, name).map_err(|e| in_file(file, e))? {
            found = Some((file, pairs));
            break;
        }
    }
    let Some((file, pairs)) = found else {
        let looked: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        return Err(Error::usage(format!(
            "service {name:?} is not defined in any service file (looked in: {}): add a [{name}] section with host=, port=, dbname=, user= lines, set PGSERVICEFILE to the file that has it, or give those settings in the connection string",
            looked.join(", ")
        )));
    };
    let text = pairs
        .iter()
        .map(|(k, v)| format!("{k}='{}'", v.replace('\\', "\\\\").replace('\'', "\\'")))
        .collect::<Vec<_>>()
        .join(" ");
    let (rest, from_service, service_mode, nested) =
        take_tls_settings(&text).map_err(|e| in_file(file, e.to_string()))?;
    if nested.is_some() {
        return Err(in_file(
            file,
            format!("service {name:?} names another service: nested services are not supported"),
        ));
    }
    let service = tokio_postgres::Config::from_str(&rest).map_err(|e| {
        in_file(
            file,
            format!("service {name:?}: {}", crate::error::describe_postgres(&e)),
        )
    })?;
    fill(config, &service);
    if !*mode_given && service_mode {
        tls.mode = from_service.mode;
        *mode_given = true;
    }
    tls.root_cert = tls.root_cert.take().or(from_service.root_cert);
    tls.client_cert = tls.client_cert.take().or(from_service.client_cert);
    tls.client_key = tls.client_key.take().or(from_service.client_key);
    Ok(())
}

fn in_file(file: &Path, problem: impl std::fmt::Display) -> Error {
    Error::usage(format!("service file {}: {problem}", file.display()))
}

fn service_files() -> Vec<PathBuf> {
    let user = env("PGSERVICEFILE")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".pg_service.conf")));
    let system = env("PGSYSCONFDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/etc/postgresql-common"))
        .join("pg_service.conf");
    user.into_iter().chain([system]).collect()
}

/// The `key=value` lines of section `[name]`, or None when the file has no such section.
/// As in libpq: `#` starts a comment line, blanks around a line are ignored, the value is the
/// rest of the line after the first `=`, taken as it is (no quotes).
fn section(text: &str, name: &str) -> std::result::Result<Option<Vec<(String, String)>>, String> {
    let mut inside = false;
    let mut found = false;
    let mut pairs = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(header) = line.strip_prefix('[') {
            if found {
                break;
            }
            inside = header.strip_suffix(']') == Some(name);
            found = inside;
            continue;
        }
        if !inside {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(format!(
                "line {}: not key=value (in service {name:?})",
                number + 1
            ));
        };
        pairs.push((key.trim().to_owned(), value.to_owned()));
    }
    Ok(found.then_some(pairs))
}

/// What the connection string left out, from the service.
fn fill(config: &mut tokio_postgres::Config, service: &tokio_postgres::Config) {
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        for host in service.get_hosts() {
            match host {
                tokio_postgres::config::Host::Tcp(h) => config.host(h),
                tokio_postgres::config::Host::Unix(p) => config.host_path(p),
            };
        }
        for addr in service.get_hostaddrs() {
            config.hostaddr(*addr);
        }
    }
    if config.get_ports().is_empty() {
        for port in service.get_ports() {
            config.port(*port);
        }
    }
    if config.get_user().is_none() {
        if let Some(user) = service.get_user() {
            config.user(user);
        }
    }
    if config.get_password().is_none() {
        if let Some(password) = service.get_password() {
            config.password(password);
        }
    }
    if config.get_dbname().is_none() {
        if let Some(db) = service.get_dbname() {
            config.dbname(db);
        }
    }
    if config.get_options().is_none() {
        if let Some(options) = service.get_options() {
            config.options(options);
        }
    }
    if config.get_application_name().is_none() {
        if let Some(name) = service.get_application_name() {
            config.application_name(name);
        }
    }
    if config.get_connect_timeout().is_none() {
        if let Some(timeout) = service.get_connect_timeout() {
            config.connect_timeout(*timeout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_named_section_is_read_as_libpq_reads_it() {
        let text = "# comment\n[other]\nhost=elsewhere\n\n  [src]  \nhost=db1\n port = 5433\npassword=a=b c\n[next]\nhost=no\n";
        let pairs = section(text, "src").unwrap().unwrap();
        assert_eq!(
            pairs,
            vec![
                ("host".to_owned(), "db1".to_owned()),
                ("port".to_owned(), " 5433".to_owned()),
                ("password".to_owned(), "a=b c".to_owned()),
            ]
        );
        assert_eq!(section(text, "missing").unwrap(), None);
        assert!(section("[s]\nhost\n", "s").unwrap_err().contains("line 2"));
    }
}
