//! Settings: command-line flags, `PGAPPLY_*` environment variables, a TOML file, defaults — in that
//! order of precedence. clap handles flag > environment; this module adds the file and defaults,
//! and resolves everything into the [`RunConfig`] the worker runs with.
//!
//! The file uses the flags' names with underscores (`status_interval = "10s"`); unknown keys are
//! errors that name the key and line, durations are humantime ("500ms", "10s", "5m").

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::cli::{LogFormat, RunArgs, ServersArgs, Streaming};

use crate::conninfo;
use crate::error::{Error, Result};
use crate::replicate::RunConfig;

/// Smallest `--queue-size`: room for a few messages at least.
const MIN_QUEUE_BYTES: u64 = 64 * 1024;
/// Largest `--queue-size`: far beyond any machine's memory, well within the queue's counter.
const MAX_QUEUE_BYTES: u64 = 1 << 40;

/// Longest duration a setting takes: far beyond any sensible timeout, and well within what a
/// clock reading can be moved by without overflowing.
const MAX_DURATION: Duration = Duration::from_secs(10 * 366 * 24 * 3600);

/// Settings that only `run` (and `check`, which checks for it) refuses together: `cutover`
/// shares the settings and ignores --copy-only.
pub fn check_run_only(config: &RunConfig) -> Result<()> {
    if config.copy_only && !config.copy_data {
        return Err(Error::usage(
            "--copy-only goes with --copy-data: it stops after the initial copy",
        ));
    }
    if config.copy.truncate_target && !config.copy_data {
        return Err(Error::usage(
            "--truncate-target goes with --copy-data: it empties the target tables before the initial copy (without a copy, nothing is emptied)",
        ));
    }
    if config.copy_only && config.endpos.is_some() {
        return Err(Error::usage(
            "--copy-only stops after the initial copy, before any change: --endpos does not apply",
        ));
    }
    Ok(())
}

/// A duration setting that must not be 0 (a time limit).
pub fn parse_positive_duration(text: &str) -> std::result::Result<Duration, String> {
    match parse_duration(text)? {
        d if d.is_zero() => Err(format!(
            "{text:?} is no time at all: give a time limit (for example \"10m\")"
        )),
        d => Ok(d),
    }
}

/// A duration setting ("500ms", "10s", "5m"), at most ten years.
pub fn parse_duration(text: &str) -> std::result::Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| format!("{e} (write it like \"500ms\", \"10s\" or \"5m\")"))?;
    if d > MAX_DURATION {
        return Err(format!("{text:?} is longer than ten years"));
    }
    Ok(d)
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<Duration>, D::Error> {
    let text: Option<String> = Option::deserialize(d)?;
    text.map(|t| {
        parse_duration(&t)
            .map_err(|e| serde::de::Error::custom(format!("invalid duration {t:?}: {e}")))
    })
    .transpose()
}

/// `max_message_bytes`: a size with a unit ("64MB") or plain bytes.
pub fn parse_message_size(text: &str) -> std::result::Result<usize, String> {
    let bytes = crate::cutover::parse_size(text).map_err(|e| e.message().to_owned())?;
    Ok(usize::try_from(bytes).unwrap_or(usize::MAX))
}

/// `max_message_bytes` in the file: a number of bytes, as before, or a size with a unit.
fn message_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<usize>, D::Error> {
    match Option::<toml::Value>::deserialize(d)? {
        None => Ok(None),
        Some(toml::Value::Integer(n)) if n >= 0 => {
            Ok(Some(usize::try_from(n).unwrap_or(usize::MAX)))
        }
        Some(toml::Value::String(t)) => parse_message_size(&t)
            .map(Some)
            .map_err(serde::de::Error::custom),
        Some(other) => Err(serde::de::Error::custom(format!(
            "{other} is not a size: give a number of bytes (1048576) or a size in quotes (\"64MB\")"
        ))),
    }
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryFile {
    #[serde(default, deserialize_with = "duration")]
    pub min: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub max: Option<Duration>,
    #[serde(alias = "max_retries")]
    pub max_attempts: Option<u32>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableFile {
    /// Target table for this source table: `schema.table`.
    pub target: Option<String>,
    /// Conflict policies for this table, over the global ones.
    pub conflicts: Option<crate::apply::conflict::PoliciesFile>,
    /// Source column -> target column, for changes that name a column the target has under
    /// another name (a rename the source made in the middle of a transaction).
    pub columns: Option<BTreeMap<String, String>>,
}

/// Names given as one comma-separated string or as a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Names {
    One(String),
    Many(Vec<String>),
}

impl Names {
    fn to_vec(&self) -> Vec<String> {
        match self {
            Names::One(text) => text.split(',').map(str::to_owned).collect(),
            Names::Many(names) => names.clone(),
        }
    }
}

/// The TOML configuration file.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub source: Option<String>,
    pub target: Option<String>,
    pub source_password_file: Option<PathBuf>,
    pub target_password_file: Option<PathBuf>,
    pub publications: Option<Vec<String>>,
    /// The flag's own name: "a,b" as on the command line, or a list.
    pub publication: Option<Names>,
    pub slot: Option<String>,
    pub create_slot: Option<bool>,
    pub copy_data: Option<bool>,
    pub copy_only: Option<bool>,
    pub copy_jobs: Option<usize>,
    pub copy_split_pages: Option<i64>,
    pub truncate_target: Option<bool>,
    pub streaming: Option<Streaming>,
    pub two_phase: Option<bool>,
    pub failover_slot: Option<bool>,
    pub binary: Option<bool>,
    pub messages: Option<bool>,
    pub origin: Option<String>,
    pub spool_dir: Option<PathBuf>,
    #[serde(default, deserialize_with = "message_size")]
    pub max_message_bytes: Option<usize>,
    pub queue_size: Option<String>,
    pub apply_workers: Option<usize>,
    #[serde(default, deserialize_with = "duration")]
    pub status_interval: Option<Duration>,
    pub metrics_addr: Option<String>,
    pub log_level: Option<String>,
    pub log_format: Option<LogFormat>,
    pub retry: Option<RetryFile>,
    /// The flags' names for `[retry]`'s min, max and max_attempts (these win over the table).
    #[serde(default, deserialize_with = "duration")]
    pub retry_min: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub retry_max: Option<Duration>,
    pub max_retries: Option<u32>,
    /// Conflict policies for every table.
    pub conflicts: Option<crate::apply::conflict::PoliciesFile>,
    /// Per source table (`schema.table`): settings such as the target table name.
    pub tables: Option<BTreeMap<String, TableFile>>,
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::usage(format!("--config: cannot read {}: {e}", path.display())))?;
        let mut file =
            Self::parse(&text).map_err(|e| e.context(format!("--config {}", path.display())))?;
        // Paths in the file are relative to the file, not to wherever pgapply was started.
        let dir = path.parent().unwrap_or(Path::new("."));
        for p in [
            &mut file.source_password_file,
            &mut file.target_password_file,
            &mut file.spool_dir,
        ]
        .into_iter()
        .flatten()
        {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        }
        Ok(file)
    }

    pub fn parse(text: &str) -> Result<FileConfig> {
        toml::from_str(text).map_err(|e| {
            // On one line: where, the key (a type error's message does not name it), and what
            // to write, in the file's terms rather than Rust's.
            let mut message = e.message().to_owned();
            for (rust, file) in [
                ("expected usize", "expected a whole number"),
                ("expected u64", "expected a whole number"),
                ("expected u32", "expected a whole number"),
                ("expected u16", "expected a whole number"),
                ("expected i64", "expected a whole number"),
                (
                    "expected a string",
                    "expected a string in quotes (a size like \"64MB\", a duration like \"10s\")",
                ),
            ] {
                message = message.replace(rust, file);
            }
            let position = e
                .span()
                .map(|span| {
                    let start = span.start.min(text.len());
                    let line = text[..start].matches('\n').count() + 1;
                    let line_text = text.lines().nth(line - 1).unwrap_or_default();
                    match line_text.split_once('=') {
                        Some((key, _)) if !message.contains(key.trim()) => {
                            format!("line {line}, {}: ", key.trim())
                        }
                        _ => format!("line {line}: "),
                    }
                })
                .unwrap_or_default();
            Error::usage(format!("{position}{message}"))
        })
    }
}

/// The settings of two readings of a config file that differ, but for what SIGHUP reloads
/// (`log_level`, `[conflicts]` and each table's `conflicts`): those take effect only when pgapply
/// starts again. Keys as written (`tables."public.t".target`).
pub fn changed_on_reload(old: &toml::Value, new: &toml::Value) -> Vec<String> {
    fn walk(
        path: &str,
        old: Option<&toml::Value>,
        new: Option<&toml::Value>,
        out: &mut Vec<String>,
    ) {
        let reloaded = path == "log_level"
            || path == "conflicts"
            || (path.starts_with("tables.") && path.ends_with(".conflicts"));
        if reloaded || old == new {
            return;
        }
        // (A table on one side only, `[tables."t".conflicts]` added: compared with an empty one,
        // so that what a reload applies inside it is not named.)
        let empty = toml::map::Map::new();
        let as_table = |v: Option<&'_ toml::Value>| match v {
            Some(toml::Value::Table(t)) => Some(t.clone()),
            None => Some(empty.clone()),
            Some(_) => None,
        };
        match (as_table(old), as_table(new)) {
            (Some(a), Some(b)) => {
                let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
                keys.sort();
                keys.dedup();
                for key in keys {
                    let shown = if key.contains('.') || key.contains(' ') || key.contains('"') {
                        format!("{key:?}")
                    } else {
                        key.clone()
                    };
                    let child = if path.is_empty() {
                        shown
                    } else {
                        format!("{path}.{shown}")
                    };
                    walk(&child, a.get(key), b.get(key), out);
                }
            }
            _ => out.push(path.to_owned()),
        }
    }
    let mut out = Vec::new();
    walk("", Some(old), Some(new), &mut out);
    out
}

/// Source table -> target table, both `(schema, table)`.
pub type TableMap = HashMap<(String, String), (String, String)>;

/// Source table `(schema, table)` -> its columns' target names, where they differ.
pub type ColumnMap = HashMap<(String, String), HashMap<String, String>>;

/// The file's `[tables."schema.table"] target = ..` renames.
pub fn table_map(file: &FileConfig) -> Result<TableMap> {
    let mut map = TableMap::new();
    for (name, table) in file.tables.iter().flatten() {
        if let Some(to) = &table.target {
            map.insert(parse_table_name(name)?, parse_table_name(to)?);
        }
    }
    Ok(map)
}

/// The file's `[tables."schema.table".columns]` renames.
pub fn column_map(file: &FileConfig) -> Result<ColumnMap> {
    let mut map = ColumnMap::new();
    for (name, table) in file.tables.iter().flatten() {
        if let Some(columns) = table.columns.as_ref().filter(|c| !c.is_empty()) {
            map.insert(
                parse_table_name(name)?,
                columns
                    .iter()
                    .map(|(s, t)| (s.clone(), t.clone()))
                    .collect(),
            );
        }
    }
    Ok(map)
}

/// Splits `schema.table`; either part may be double-quoted (`"my.schema"."T"`). Names are taken
/// exactly as written (no case folding).
pub fn parse_table_name(text: &str) -> Result<(String, String)> {
    let mut parts = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    let mut chars = text.trim().chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                chars.next();
                current.push('"');
            }
            '"' => quoted = !quoted,
            '.' if !quoted => parts.push(std::mem::take(&mut current)),
            _ => current.push(c),
        }
    }
    parts.push(current);
    match parts.as_slice() {
        [schema, table] if !schema.is_empty() && !table.is_empty() && !quoted => {
            Ok((schema.clone(), table.clone()))
        }
        _ => Err(Error::usage(format!(
            "invalid table name {text:?}: write it as schema.table (quote parts that contain dots: \"my.schema\".\"t\")"
        ))),
    }
}

fn read_password_file(path: &Path, which: &str) -> Result<String> {
    // A configuration value that does not work: exit 2, as for other settings.
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::usage(format!(
            "{which} password file {}: cannot read it: {e}",
            path.display()
        ))
    })?;
    let password = text.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(Error::usage(format!(
            "{which} password file {} is empty: put the password in it (one line)",
            path.display()
        )));
    }
    Ok(password.to_owned())
}

/// The file's conflict policies, global and per table (also what SIGHUP reloads).
pub fn conflict_policies(file: &FileConfig) -> Result<crate::apply::conflict::PolicyMap> {
    use crate::apply::conflict::Policies;
    let mut map = crate::apply::conflict::PolicyMap::default();
    let global = Policies::merge(
        Policies::default(),
        &file.conflicts.clone().unwrap_or_default(),
        "[conflicts]",
    )?;
    map.global = global;
    for (source_name, table) in file.tables.iter().flatten() {
        if let Some(policies) = &table.conflicts {
            let merged = Policies::merge(
                global,
                policies,
                &format!("[tables.{source_name:?}.conflicts]"),
            )?;
            map.tables.insert(parse_table_name(source_name)?, merged);
        }
    }
    Ok(map)
}

/// An on/off setting: the flag (`--binary`, `--binary=false`) or its `PGAPPLY_*` variable, else
/// the file, else off.
fn switch(flag_or_env: Option<crate::cli::Switch>, file: Option<bool>) -> bool {
    flag_or_env
        .and_then(crate::cli::Switch::given)
        .or(file)
        .unwrap_or(false)
}

/// Everything `pgapply run` needs besides the run configuration itself.
#[derive(Debug, Clone)]
pub struct ServiceSettings {
    pub retry_min: Duration,
    pub retry_max: Duration,
    pub max_retries: u32,
    pub metrics_addr: Option<String>,
}

/// The servers and publications given by flags or environment (`args`), else by the file.
pub struct Servers {
    pub source: tokio_postgres::Config,
    pub target: tokio_postgres::Config,
    pub publications: Vec<String>,
}

fn missing(what: &str, key: &str) -> Error {
    Error::usage(format!(
        "no {what} given: use --{} (or PGAPPLY_{}), or `{key} = ...` in the config file",
        key.replace('_', "-"),
        key.to_uppercase()
    ))
}

/// One side's connection, from the flags or environment, else the file, with its password file.
fn resolve_side(
    role: &str,
    text: Option<&String>,
    password_file: Option<&PathBuf>,
    from_file: Option<&Path>,
) -> Result<Option<tokio_postgres::Config>> {
    let Some(text) = text else {
        return Ok(None);
    };
    // (The parser's messages name the flag: a connection string from the file is said as such.)
    let mut config = conninfo::parse(role, text).map_err(|e| match from_file {
        Some(path) => {
            let message = e.to_string();
            let rest = message
                .strip_prefix(&format!("--{role}:"))
                .unwrap_or(&message);
            Error::usage(format!("{role} (in config file {}):{rest}", path.display()))
        }
        None => e,
    })?;
    if let Some(path) = password_file {
        config.password(read_password_file(path, role)?);
    }
    Ok(Some(config))
}

/// A source given by flags alone (`source-speed`).
pub fn resolve_source_flag(
    text: &str,
    password_file: Option<&PathBuf>,
) -> Result<tokio_postgres::Config> {
    resolve_side("source", Some(&text.to_owned()), password_file, None)?
        .ok_or_else(|| missing("source connection", "source"))
}

/// The target connection alone (`status`, `skip`).
pub fn resolve_target(args: &ServersArgs, file: &FileConfig) -> Result<tokio_postgres::Config> {
    resolve_side(
        "target",
        args.target.as_ref().or(file.target.as_ref()),
        args.target_password_file
            .as_ref()
            .or(file.target_password_file.as_ref()),
        args.config.as_deref().filter(|_| args.target.is_none()),
    )?
    .ok_or_else(|| missing("target connection", "target"))
}

/// The source connection if one is given (`status`).
pub fn resolve_optional_source(
    args: &ServersArgs,
    file: &FileConfig,
) -> Result<Option<tokio_postgres::Config>> {
    resolve_side(
        "source",
        args.source.as_ref().or(file.source.as_ref()),
        args.source_password_file
            .as_ref()
            .or(file.source_password_file.as_ref()),
        args.config.as_deref().filter(|_| args.source.is_none()),
    )
}

/// Flags and environment (already merged by clap) over the file.
pub fn resolve_servers(args: &ServersArgs, file: &FileConfig) -> Result<Servers> {
    let source = resolve_optional_source(args, file)?
        .ok_or_else(|| missing("source connection", "source"))?;
    let target = resolve_target(args, file)?;
    let publications: Vec<String> = if !args.publication.is_empty() {
        args.publication.to_vec()
    } else if let Some(names) = &file.publication {
        if file.publications.is_some() {
            return Err(Error::usage(
                "the config file gives both publication and publications: keep one",
            ));
        }
        names.to_vec()
    } else {
        file.publications.clone().unwrap_or_default()
    }
    .into_iter()
    .filter(|p| !p.is_empty())
    .collect();
    if publications.is_empty() {
        return Err(missing("publication", "publication"));
    }
    Ok(Servers {
        source,
        target,
        publications,
    })
}

/// Flags and environment (already merged by clap) over the file over defaults.
pub fn resolve(args: &RunArgs, file: &FileConfig) -> Result<(RunConfig, ServiceSettings)> {
    let Servers {
        source,
        target,
        publications,
    } = resolve_servers(&args.servers, file)?;
    // Where a refused value was given: the flag (or its PGAPPLY_ variable), or the file.
    let config_path = args.servers.config.as_deref();
    let given = |on_command_line: bool, key: &str| -> String {
        match config_path {
            Some(path) if !on_command_line => {
                format!(" ({key} in config file {})", path.display())
            }
            _ => format!(
                " (--{}, or PGAPPLY_{})",
                key.replace('_', "-"),
                key.to_ascii_uppercase()
            ),
        }
    };
    let slot = args
        .slot
        .clone()
        .or_else(|| file.slot.clone())
        .ok_or_else(|| missing("slot", "slot"))?;
    // PostgreSQL's rule for slot names (a wrong one would otherwise read "does not exist").
    if slot.is_empty()
        || slot.len() > 63
        || !slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(Error::usage(format!(
            "slot name {slot:?} is not valid{}: use lower-case letters, digits and _ (at most 63)",
            given(args.slot.is_some(), "slot")
        )));
    }
    let mut config = RunConfig::new(source, target, publications, slot);
    config.create_slot = switch(args.create_slot, file.create_slot);
    config.failover_slot = switch(args.failover_slot, file.failover_slot);
    config.copy_data = switch(args.copy_data, file.copy_data);
    config.copy_only = switch(args.copy_only, file.copy_only);
    config.copy.truncate_target = switch(args.truncate_target, file.truncate_target);
    if let Some(jobs) = args.copy_jobs.or(file.copy_jobs) {
        if !(1..=64).contains(&jobs) {
            return Err(Error::usage(format!(
                "copy_jobs is {jobs}{}: use a number from 1 to 64 (each job holds a source and a target connection)",
                given(args.copy_jobs.is_some(), "copy_jobs")
            )));
        }
        config.copy.jobs = jobs;
    }
    if let Some(pages) = args.copy_split_pages.or(file.copy_split_pages) {
        config.copy.split_pages = pages.max(1);
    }
    if let Some(interval) = args.status_interval.or(file.status_interval) {
        if interval.is_zero() {
            return Err(Error::usage(format!(
                "status_interval{} must be more than 0s",
                given(args.status_interval.is_some(), "status_interval")
            )));
        }
        config.status_interval = interval;
    }
    if let Some(endpos) = &args.endpos {
        config.endpos = Some(
            endpos
                .parse()
                .map_err(|e| Error::usage(format!("--endpos (or PGAPPLY_ENDPOS): {e}")))?,
        );
    }
    config.requested = crate::source::options::Requested {
        streaming: args.streaming.or(file.streaming),
        two_phase: switch(args.two_phase, file.two_phase),
        binary: switch(args.binary, file.binary),
        messages: switch(args.messages, file.messages),
        origin_none: match args.origin.clone().or_else(|| file.origin.clone()).as_deref() {
            None | Some("any") => false,
            Some("none") => true,
            Some(other) => {
                return Err(Error::usage(format!(
                    "origin {other:?}{}: use \"any\" (every change) or \"none\" (only changes made on the source itself)",
                    given(args.origin.is_some(), "origin")
                )))
            }
        },
    };
    config.spool_dir = args.spool_dir.clone().or_else(|| file.spool_dir.clone());
    if let Some(size) = args.queue_size.as_ref().or(file.queue_size.as_ref()) {
        let bytes = crate::cutover::parse_size(size).map_err(|e| {
            Error::usage(format!(
                "queue_size{}: {}",
                given(args.queue_size.is_some(), "queue_size"),
                e.message()
            ))
        })?;
        if !(MIN_QUEUE_BYTES..=MAX_QUEUE_BYTES).contains(&bytes) {
            return Err(Error::usage(format!(
                "queue_size {size:?}{}: give a size from 64kB to 1024GB, such as 64MB or 512kB",
                given(args.queue_size.is_some(), "queue_size")
            )));
        }
        config.queue_bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    }
    if let Some(max) = args.max_message_bytes.or(file.max_message_bytes) {
        config.max_message_bytes = max.max(1024);
    }
    let workers = args.apply_workers.or(file.apply_workers).unwrap_or(1);
    if !(1..=64).contains(&workers) {
        return Err(Error::usage(format!(
            "apply_workers is {workers}{}: use a number from 1 to 64 (each worker is one target connection)",
            given(args.apply_workers.is_some(), "apply_workers")
        )));
    }
    if workers > 1 && config.requested.two_phase {
        return Err(Error::usage(
            "--two-phase and --apply-workers above 1 can not be combined: prepared transactions are applied by one connection; use --apply-workers 1 with --two-phase",
        ));
    }
    config.apply_workers = workers;
    config.policies = conflict_policies(file)?;
    for (source_name, table) in file.tables.iter().flatten() {
        if let Some(to) = &table.target {
            config
                .table_map
                .insert(parse_table_name(source_name)?, parse_table_name(to)?);
        }
    }
    config.column_map = column_map(file)?;
    config.copy.column_map = config.column_map.clone();
    let retry = file.retry.clone().unwrap_or_default();
    let service = ServiceSettings {
        retry_min: args
            .retry_min
            .or(file.retry_min)
            .or(retry.min)
            .unwrap_or(Duration::from_secs(1)),
        retry_max: args
            .retry_max
            .or(file.retry_max)
            .or(retry.max)
            .unwrap_or(Duration::from_secs(60)),
        max_retries: args
            .max_retries
            .or(file.max_retries)
            .or(retry.max_attempts)
            .unwrap_or(0),
        metrics_addr: args
            .metrics_addr
            .clone()
            .or_else(|| file.metrics_addr.clone()),
    };
    // (No wait at all would retry a server that is down in a tight loop.)
    if service.retry_min.is_zero() {
        return Err(Error::usage(
            "retry_min is 0: give the shortest wait between retries, at least 1ms (for example \"1s\")",
        ));
    }
    if service.retry_min > service.retry_max {
        return Err(Error::usage(format!(
            "retry_min ({}) is longer than retry_max ({}){}: the shortest wait between retries must not exceed the longest",
            humantime::format_duration(service.retry_min),
            humantime::format_duration(service.retry_max),
            match config_path {
                Some(path)
                    if (args.retry_min.is_none() && file.retry_min.or(retry.min).is_some())
                        || (args.retry_max.is_none()
                            && file.retry_max.or(retry.max).is_some()) =>
                    format!(" (one of them in config file {})", path.display()),
                _ => String::new(),
            }
        )));
    }
    Ok((config, service))
}

#[cfg(test)]
mod tests {
    #[test]
    fn settings_sighup_does_not_reload_are_named() {
        let old: toml::Value = toml::from_str(
            "slot = \"s\"\nlog_level = \"info\"\n[conflicts]\ninsert_exists = \"error\"\n[tables.\"public.t\"]\ntarget = \"public.u\"\n",
        )
        .unwrap();
        let new: toml::Value = toml::from_str(
            "slot = \"s\"\nlog_level = \"debug\"\npublication = \"q\"\n[conflicts]\ninsert_exists = \"skip\"\n[tables.\"public.t\"]\ntarget = \"public.v\"\n[tables.\"public.t\".conflicts]\nupdate_missing = \"error\"\n",
        )
        .unwrap();
        assert_eq!(
            super::changed_on_reload(&old, &new),
            vec![
                "publication".to_owned(),
                "tables.\"public.t\".target".to_owned()
            ]
        );
        assert!(super::changed_on_reload(&old, &old).is_empty());
        // A table's conflict policies added where the file had no [tables] at all: nothing
        // but what a reload applies.
        let bare: toml::Value = toml::from_str("slot = \"s\"\n").unwrap();
        let with_policy: toml::Value = toml::from_str(
            "slot = \"s\"\n[tables.\"public.t\".conflicts]\ninsert_exists = \"keep_local\"\n",
        )
        .unwrap();
        assert!(super::changed_on_reload(&bare, &with_policy).is_empty());
        assert!(super::changed_on_reload(&with_policy, &bare).is_empty());
    }

    use super::*;

    #[test]
    fn unknown_key_names_key_and_line() {
        let err = FileConfig::parse("slot = \"s\"\nstatus_intervall = \"5s\"\n").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("line 2") && text.contains("status_intervall"),
            "{text}"
        );
    }

    #[test]
    fn a_value_of_the_wrong_type_names_its_key_and_what_to_write() {
        let err = FileConfig::parse("slot = \"s\"\nqueue_size = 1000000\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "line 2, queue_size: invalid type: integer `1000000`, expected a string in quotes (a size like \"64MB\", a duration like \"10s\")"
        );
        let err = FileConfig::parse("copy_jobs = \"4\"").unwrap_err();
        assert_eq!(
            err.to_string(),
            "line 1, copy_jobs: invalid type: string \"4\", expected a whole number"
        );
    }

    #[test]
    fn max_message_bytes_takes_a_number_or_a_size() {
        let bytes = FileConfig::parse("max_message_bytes = 1048576").unwrap();
        assert_eq!(bytes.max_message_bytes, Some(1 << 20));
        let size = FileConfig::parse("max_message_bytes = \"256MB\"").unwrap();
        assert_eq!(size.max_message_bytes, Some(256 << 20));
        let err = FileConfig::parse("max_message_bytes = \"lots\"").unwrap_err();
        assert!(err.to_string().contains("invalid size \"lots\""), "{err}");
        let err = FileConfig::parse("max_message_bytes = -1").unwrap_err();
        assert!(err.to_string().contains("-1 is not a size"), "{err}");
        assert_eq!(parse_message_size("2GB"), Ok(2 << 30));
    }

    #[test]
    fn bad_duration_is_named() {
        let err = FileConfig::parse("status_interval = \"ten seconds\"").unwrap_err();
        assert!(
            err.to_string().contains("invalid duration \"ten seconds\""),
            "{err}"
        );
        let ok = FileConfig::parse("status_interval = \"250ms\"\n[retry]\nmax = \"2m\"").unwrap();
        assert_eq!(ok.status_interval, Some(Duration::from_millis(250)));
        assert_eq!(ok.retry.unwrap().max, Some(Duration::from_secs(120)));
    }

    #[test]
    fn the_flags_names_work_in_the_file() {
        let file = FileConfig::parse(
            "source = \"host=a\"\ntarget = \"host=b\"\nslot = \"s\"\npublication = \"p1,p2\"\n\
             retry_min = \"2s\"\nretry_max = \"1m\"\nmax_retries = 3\n[retry]\nmin = \"5s\"\n",
        )
        .unwrap();
        let (config, service) = resolve(&RunArgs::default(), &file).unwrap();
        assert_eq!(config.publications, vec!["p1", "p2"]);
        assert_eq!(service.retry_min, Duration::from_secs(2));
        assert_eq!(service.retry_max, Duration::from_secs(60));
        assert_eq!(service.max_retries, 3);
        let listed = FileConfig::parse("publication = [\"a\", \"b\"]").unwrap();
        assert_eq!(
            listed.publication.map(|n| n.to_vec()),
            Some(vec!["a".into(), "b".into()])
        );
        let both = FileConfig::parse(
            "source = \"host=a\"\ntarget = \"host=b\"\nslot = \"s\"\npublication = \"p\"\npublications = [\"q\"]",
        )
        .unwrap();
        let err = resolve(&RunArgs::default(), &both).unwrap_err();
        assert_eq!(err.class(), crate::error::ErrorClass::Usage);
    }

    #[test]
    fn table_names() {
        assert_eq!(
            parse_table_name("public.t").unwrap(),
            ("public".into(), "t".into())
        );
        assert_eq!(
            parse_table_name("\"my.schema\".\"Ta\"\"ble\"").unwrap(),
            ("my.schema".into(), "Ta\"ble".into())
        );
        assert!(parse_table_name("t").is_err());
        assert!(parse_table_name("a.b.c").is_err());
    }
}
