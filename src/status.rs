//! `pgapply status`: each slot's progress as the running worker records it on the target (a
//! heartbeat every status interval), plus lag in bytes when the source is given.

use serde::Serialize;

use crate::cli::StatusArgs;
use crate::config::FileConfig;
use crate::error::{Error, Result};

#[derive(Debug, Serialize)]
pub struct SlotStatus {
    pub slot: String,
    pub state: String,
    /// For scripts: the state the worker last recorded, one word (`state` says more in words).
    pub recorded_state: String,
    /// False when a `streaming` or `copying` worker's heartbeat stopped (killed, cut off).
    pub responding: bool,
    /// A `failed` run whose process is still there, waiting to try again.
    pub retrying: bool,
    pub pid: Option<i32>,
    pub applied_lsn: Option<String>,
    pub last_commit_time: Option<String>,
    /// When `last_commit_time` is not known for the applied position (it is kept with the
    /// progress row and the heartbeat, not with a replication origin's commits): the commit time
    /// the worker last recorded, for a position at or before the applied one.
    pub recorded_commit_time: Option<String>,
    pub heartbeat_age_seconds: Option<f64>,
    pub lag_seconds: Option<f64>,
    /// With --source: the source's WAL position minus the applied position.
    pub lag_bytes: Option<i64>,
    /// With --source, when it could not be reached: why (the rest comes from the target).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_error: Option<String>,
    pub transactions: i64,
    pub inserts: i64,
    pub updates: i64,
    pub deletes: i64,
    pub truncates: i64,
    pub conflicts: serde_json::Value,
    pub copy: Vec<CopyTableStatus>,
    /// Where `pgapply cutover` stopped this slot's worker (it stays stopped there).
    pub stop_lsn: Option<String>,
    /// The commit LSN of a source transaction `pgapply skip` asked to skip, not reached yet.
    pub skip_lsn: Option<String>,
    /// What the last run ended with, when it failed.
    pub last_error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct CopyTableStatus {
    /// `schema.name`, unquoted (as the metrics' `table` label).
    pub table: String,
    pub schema: String,
    pub name: String,
    pub state: String,
    pub rows: i64,
    pub bytes: i64,
}

async fn connect(role: &str, config: &tokio_postgres::Config) -> Result<tokio_postgres::Client> {
    crate::tls::connect_to(config, role).await
}

pub async fn collect(args: &StatusArgs, file: &FileConfig) -> Result<Vec<SlotStatus>> {
    let target_config = crate::config::resolve_target(&args.servers, file)?;
    let source_config = crate::config::resolve_optional_source(&args.servers, file)?;
    let target = connect("target", &target_config).await?;
    // A lock held on pgapply's tables (a long transaction, a DDL waiting) must not make status,
    // which is wanted most when something is wrong, wait without a word.
    target
        .batch_execute("SET lock_timeout = '10s'; SET statement_timeout = 0")
        .await
        .map_err(|e| Error::postgres("setting lock_timeout on the target", e))?;
    let exists: bool = target
        .query_one("SELECT to_regclass('pgapply.progress') IS NOT NULL", &[])
        .await
        .map_err(|e| Error::postgres("reading pgapply's state on the target", e))?
        .get(0);
    if !exists {
        return Err(Error::definite(
            "the target has no pgapply state (schema pgapply): pgapply has not run against this database yet",
        ));
    }
    // The position: the latest of the progress row's (table mode), the origin's row in
    // pgapply.origin_commit (origin mode; both written in the transaction they record) and the
    // heartbeat's copy (which a kill -9 leaves behind). The commit time goes with it: the
    // progress row's own, or the heartbeat's when that is the latest; none is kept with the
    // origin's row.
    let rows = target
        .query(
            "SELECT slot_name, coalesce(state, 'unknown'), pid, \
                    greatest(lsn, applied_lsn, o.end_lsn)::text, \
                    to_char(CASE WHEN lsn IS NOT NULL AND lsn >= greatest(applied_lsn, o.end_lsn) \
                                      AND commit_time IS NOT NULL THEN commit_time \
                                 WHEN applied_lsn >= greatest(lsn, o.end_lsn) THEN last_commit_time END \
                            AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
                    extract(epoch FROM now() - heartbeat_at)::float8, lag_seconds, \
                    transactions, inserts, updates, deletes, truncates, conflicts::text, \
                    to_jsonb(p) ->> 'stop_lsn', to_jsonb(p) ->> 'skip_lsn', \
                    CASE WHEN state = 'failed' THEN to_jsonb(p) ->> 'last_error' END, \
                    source_system_id, \
                    to_char(greatest(commit_time, last_commit_time) AT TIME ZONE 'UTC', \
                            'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
             FROM pgapply.progress p \
             LEFT JOIN pgapply.origin_commit o ON o.origin_name = 'pgapply_' || p.slot_name \
             WHERE $1::text IS NULL OR slot_name = $1 ORDER BY slot_name",
            &[&args.slot.clone().or_else(|| file.slot.clone())],
        )
        .await
        .map_err(|e| {
            let locked = e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE);
            let err = Error::postgres("reading pgapply.progress on the target", e);
            if locked {
                err.context_after("another session has held a lock on pgapply.progress for 10 s (an open transaction, a DDL): SELECT pid, mode, granted FROM pg_locks WHERE relation = 'pgapply.progress'::regclass on the target names it")
            } else {
                err
            }
        })?;
    // A source that is down is when status is wanted most: what the target knows is shown,
    // the lag in bytes is not.
    let (source, source_error) = match &source_config {
        Some(s) => match connect("source", s).await {
            Ok(client) => (Some(client), None),
            Err(e) => (None, Some(format!("the source cannot be reached: {e}"))),
        },
        None => (None, None),
    };
    let mut out = Vec::new();
    for row in rows {
        let slot: String = row.get(0);
        let applied: Option<String> = row.get(3);
        // The slot must be on this source: another cluster's WAL position would give a lag
        // that means nothing.
        let mut slot_error = source_error.clone();
        if let Some(src) = &source {
            let recorded: Option<String> = row.get(16);
            let here = src
                .query_opt(
                    "SELECT coalesce(to_jsonb(s) ->> 'wal_status', '') FROM pg_catalog.pg_replication_slots s WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .map_err(|e| Error::postgres("reading the slots of the source", e))?;
            match here {
                None => {
                    slot_error = Some(format!(
                        "slot {slot:?} does not exist on this source: is --source the cluster the worker replicates from?"
                    ));
                }
                // (13+: the WAL it needed was removed, max_slot_wal_keep_size.)
                Some(row) if row.get::<_, String>(0) == "lost" => {
                    slot_error = Some(format!(
                        "slot {slot:?} is invalidated on the source (wal_status lost: the WAL it still needed was removed, see max_slot_wal_keep_size): its changes can no longer be read; start over: drop it (SELECT pg_drop_replication_slot({})), then run with --create-slot --copy-data --truncate-target",
                        crate::sql::shown_literal(&slot)
                    ));
                }
                Some(_) => {
                    // (A role that may not read the control data: not compared.)
                    let system: Option<String> = src
                        .query_one(
                            "SELECT system_identifier::text FROM pg_catalog.pg_control_system()",
                            &[],
                        )
                        .await
                        .ok()
                        .map(|r| r.get(0));
                    if let (Some(system), Some(recorded)) = (system, recorded) {
                        if system != recorded {
                            slot_error = Some(format!(
                                "slot {slot:?} replicates from another cluster (system identifier {recorded}) than --source ({system}), which has a slot of that name too: give the worker's source"
                            ));
                        }
                    }
                }
            }
        }
        let lag_bytes = match source.as_ref().filter(|_| slot_error.is_none()) {
            // From what the slot has confirmed too: pgapply confirms WAL without published
            // changes (an idle source) without applying anything; and a run that has not
            // applied anything yet has only that. (greatest() passes over a NULL.)
            Some(src) => src
                .query_one(
                    "SELECT (pg_current_wal_lsn() - greatest($1::text::pg_lsn, \
                       (SELECT confirmed_flush_lsn FROM pg_catalog.pg_replication_slots WHERE slot_name = $2)))::int8",
                    &[&applied, &slot],
                )
                .await
                .map_err(|e| Error::postgres("reading the source WAL position", e))?
                .get::<_, Option<i64>>(0)
                .map(|b| b.max(0)),
            None => None,
        };
        let copy_rows = target
            .query(
                "SELECT schema_name, table_name, state, rows_copied, bytes_copied FROM pgapply.copy_state \
                 WHERE slot_name = $1 ORDER BY schema_name, table_name",
                &[&slot],
            )
            .await
            .map_err(|e| Error::postgres("reading pgapply.copy_state on the target", e))?;
        let conflicts: String = row.get(12);
        let mut state: String = row.get(1);
        let recorded_state = state.clone();
        let heartbeat_age: Option<f64> = row.get(5);
        let silent_after = 3.0 * crate::replicate::HEARTBEAT_MAX_EVERY.as_secs_f64();
        let responding = !((state == "streaming" || state == "copying")
            && heartbeat_age.is_none_or(|age| age > silent_after));
        if !responding {
            // Killed, or cut off from the target: it could not record that it stopped.
            state = format!("not responding (last recorded: {state})");
        }
        let pid: Option<i32> = row.get(2);
        let retrying = recorded_state == "failed"
            && pid.is_some()
            && heartbeat_age.is_some_and(|a| a <= silent_after);
        // A table the copy was taking when the worker stopped (or went silent) is not being
        // copied: the next `run --copy-data` starts its copy over.
        let copy_ended =
            state == "stopped" || state == "failed" || state.starts_with("not responding");
        let copy_state = |recorded: String| {
            if copy_ended && recorded == "copying" {
                "interrupted".to_owned()
            } else {
                recorded
            }
        };
        out.push(SlotStatus {
            slot,
            state,
            recorded_state,
            responding,
            retrying,
            pid,
            applied_lsn: applied,
            last_commit_time: row.get(4),
            recorded_commit_time: row
                .get::<_, Option<String>>(4)
                .is_none()
                .then(|| row.get(17))
                .flatten(),
            heartbeat_age_seconds: row.get(5),
            lag_seconds: row.get(6),
            lag_bytes,
            source_error: slot_error,
            transactions: row.get(7),
            inserts: row.get(8),
            updates: row.get(9),
            deletes: row.get(10),
            truncates: row.get(11),
            conflicts: serde_json::from_str(&conflicts).unwrap_or(serde_json::Value::Null),
            copy: copy_rows
                .iter()
                .map(|r| CopyTableStatus {
                    table: format!("{}.{}", r.get::<_, String>(0), r.get::<_, String>(1)),
                    schema: r.get(0),
                    name: r.get(1),
                    state: copy_state(r.get(2)),
                    rows: r.get(3),
                    bytes: r.get(4),
                })
                .collect(),
            stop_lsn: row.get(13),
            skip_lsn: row.get(14),
            last_error: row.get(15),
        });
    }
    Ok(out)
}

pub async fn status_command(args: &StatusArgs, file: &FileConfig) -> Result<()> {
    let slots = collect(args, file).await?;
    // A slot asked for by name that the target does not know: a typo, or the wrong target.
    if let Some(slot) = args.slot.clone().or_else(|| file.slot.clone()) {
        if slots.is_empty() {
            return Err(Error::definite(format!(
                "the target has no pgapply state for slot {slot:?}: check the slot (--slot, PGAPPLY_SLOT or slot in the config file) and --target; without a slot, status lists every slot the target has"
            )));
        }
    }
    if args.json {
        let text = serde_json::to_string_pretty(&slots)
            .map_err(|e| Error::definite(format!("encoding status as JSON: {e}")))?;
        crate::out!("{text}");
        return Ok(());
    }
    if slots.is_empty() {
        crate::out!("no pgapply slots recorded on the target");
    }
    for s in &slots {
        let heartbeat = s
            .heartbeat_age_seconds
            .map(|a| format!(", last heartbeat {a:.0}s ago"))
            .unwrap_or_default();
        // A silent worker's pid is what it last recorded: it may be gone, or be another process.
        let pid = match (s.pid, s.responding) {
            (Some(p), true) => format!(", pid {p}"),
            (Some(p), false) => format!(", last recorded pid {p}"),
            (None, _) => String::new(),
        };
        // A failed run's process still there (its heartbeat fresh): it waits to try again.
        let waiting = if s.retrying {
            " (the process waits to try again)"
        } else {
            ""
        };
        crate::out!("slot {}: {}{waiting}{pid}{heartbeat}", s.slot, s.state);
        if let Some(error) = &s.last_error {
            crate::out!("  error: {error}");
        }
        let commit = match (&s.last_commit_time, &s.recorded_commit_time) {
            (Some(t), _) => t.clone(),
            (None, Some(t)) => format!("{t} or later"),
            (None, None) => "-".to_owned(),
        };
        crate::out!(
            "  applied up to {} (source commit {commit})",
            s.applied_lsn.as_deref().unwrap_or("-"),
        );
        let bytes = match (&s.lag_bytes, &s.source_error) {
            (Some(b), _) => format!("{b} bytes"),
            (None, Some(e)) => format!("? bytes ({e})"),
            (None, None) => "? bytes (give --source)".into(),
        };
        let seconds = lag_seconds_text(&s.state, s.lag_seconds, s.heartbeat_age_seconds);
        crate::out!("  lag {bytes}, {seconds}");
        crate::out!(
            "  applied {} transactions: {} inserts, {} updates, {} deletes, {} truncates",
            s.transactions,
            s.inserts,
            s.updates,
            s.deletes,
            s.truncates
        );
        crate::out!("  conflicts: {}", conflicts_text(&s.conflicts));
        if let Some(stop) = &s.stop_lsn {
            crate::out!(
                "  stopped at {stop} by `pgapply cutover`: what the source committed before it is applied (the last commit may come earlier), nothing after it (only if that cutover was given up before it finished: clear pgapply.progress.stop_lsn to replicate again)"
            );
        }
        if let Some(skip) = &s.skip_lsn {
            crate::out!("  will skip the source transaction committed at {skip} (`pgapply skip`)");
        }
        for c in &s.copy {
            let table = printable(&c.table);
            if c.state == "done" {
                crate::out!("  copy {table} done: {} rows, {} bytes", c.rows, c.bytes);
            } else {
                // A part's rows are counted when it commits (COPY says how many then); its
                // bytes as they go.
                crate::out!(
                    "  copy {table} {}: {} bytes so far, {} rows in the parts finished",
                    c.state,
                    c.bytes,
                    c.rows
                );
            }
        }
    }
    Ok(())
}

/// A name as one line of text: control characters (a newline in a table's name) escaped.
fn printable(name: &str) -> String {
    name.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// The lag in seconds as `status` prints it: the worker's own figure, as of its last heartbeat.
/// The bytes beside it are read from the source now, and the seconds may be up to a status
/// interval old: said, so the two are not read as one moment.
fn lag_seconds_text(state: &str, lag: Option<f64>, heartbeat_age: Option<f64>) -> String {
    match (lag, heartbeat_age) {
        (Some(l), Some(age)) if state == "streaming" && age >= 1.0 => {
            format!("{l:.1} s as of the heartbeat {age:.0} s ago")
        }
        (Some(l), _) if state == "streaming" => format!("{l:.1} s"),
        (Some(l), _) => format!("{l:.1} s when last recorded"),
        (None, _) => "? s".into(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_print_on_one_line() {
        assert_eq!(super::printable("s.t\nz"), "s.t\\nz");
        assert_eq!(super::printable("Sch \"q\".t"), "Sch \"q\".t");
    }

    use super::lag_seconds_text;

    #[test]
    fn an_old_heartbeats_lag_says_how_old_it_is() {
        assert_eq!(
            lag_seconds_text("streaming", Some(9.7), Some(6.2)),
            "9.7 s as of the heartbeat 6 s ago"
        );
        assert_eq!(lag_seconds_text("streaming", Some(0.2), Some(0.4)), "0.2 s");
        assert_eq!(
            lag_seconds_text("stopped", Some(3.0), Some(60.0)),
            "3.0 s when last recorded"
        );
        assert_eq!(lag_seconds_text("streaming", None, Some(1.0)), "? s");
    }
}

/// The conflict counts as a person reads them: `none`, or `2 delete_missing, 1 insert_exists`
/// (largest first) and where each is recorded. (`--json` keeps the object.)
fn conflicts_text(conflicts: &serde_json::Value) -> String {
    let mut counts: Vec<(&str, u64)> = conflicts
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.as_str(), v.as_u64()?)))
                .filter(|&(_, n)| n > 0)
                .collect()
        })
        .unwrap_or_default();
    if counts.is_empty() {
        return "none".to_owned();
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let list: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
    format!(
        "{} (each in pgapply.conflicts on the target)",
        list.join(", ")
    )
}

#[cfg(test)]
mod conflicts_text_tests {
    use super::conflicts_text;

    #[test]
    fn counts_read_as_words_largest_first() {
        let v = serde_json::json!({"insert_exists": 1, "delete_missing": 2, "update_missing": 0});
        assert_eq!(
            conflicts_text(&v),
            "2 delete_missing, 1 insert_exists (each in pgapply.conflicts on the target)"
        );
        assert_eq!(conflicts_text(&serde_json::json!({})), "none");
        assert_eq!(conflicts_text(&serde_json::Value::Null), "none");
    }
}
