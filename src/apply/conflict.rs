//! Conflicts between a change and the target's rows, in PostgreSQL 18's terms, and what to do
//! about each: stop (`error`), ignore the change (`skip`), make the target look like the source
//! (`apply_remote`), or leave the target's row alone (`keep_local`).
//!
//! | conflict | found when | policies |
//! | --- | --- | --- |
//! | insert_exists | an INSERT hits an existing key | error (default), skip / keep_local (the row stays), apply_remote (the row is overwritten) |
//! | update_missing | an UPDATE finds no row | skip (default), error, apply_remote (the new row is inserted) |
//! | delete_missing | a DELETE finds no row | skip (default), error |
//! | update_exists | an UPDATE's new values hit another row's unique key | error (default), skip / keep_local (the update is not applied), apply_remote (the other row is deleted, the update applied) |
//! | multiple_unique_conflicts | a new row violates more than one unique index of the target | error (default), skip / keep_local, apply_remote (every clashing row is deleted) |
//!
//! update_exists and multiple_unique_conflicts are found by running the change inside a savepoint
//! and, on a unique violation, looking up the rows that hold the clashing values (`unique.rs`).
//! That costs a round trip per change, so it is done only for tables whose policies ask for it.
//!
//! Conflicts that do not stop pgapply are recorded in `pgapply.conflicts` right after the target
//! transaction that met them commits, and counted in status and metrics.

use std::collections::HashMap;

use serde::Deserialize;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConflictType {
    InsertExists,
    UpdateExists,
    UpdateMissing,
    DeleteMissing,
    MultipleUniqueConflicts,
}

impl ConflictType {
    pub fn name(self) -> &'static str {
        match self {
            ConflictType::InsertExists => "insert_exists",
            ConflictType::UpdateExists => "update_exists",
            ConflictType::UpdateMissing => "update_missing",
            ConflictType::DeleteMissing => "delete_missing",
            ConflictType::MultipleUniqueConflicts => "multiple_unique_conflicts",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    Error,
    Skip,
    ApplyRemote,
    KeepLocal,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Error => "error",
            Policy::Skip => "skip",
            Policy::ApplyRemote => "apply_remote",
            Policy::KeepLocal => "keep_local",
        }
    }
}

/// Policies as written in the config file; unset ones fall back to the global ones, then to the
/// defaults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoliciesFile {
    pub insert_exists: Option<Policy>,
    pub update_exists: Option<Policy>,
    pub update_missing: Option<Policy>,
    pub delete_missing: Option<Policy>,
    pub multiple_unique_conflicts: Option<Policy>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policies {
    pub insert_exists: Policy,
    pub update_exists: Policy,
    pub update_missing: Policy,
    pub delete_missing: Policy,
    pub multiple_unique_conflicts: Policy,
}

impl Default for Policies {
    fn default() -> Self {
        Policies {
            insert_exists: Policy::Error,
            update_exists: Policy::Error,
            update_missing: Policy::Skip,
            delete_missing: Policy::Skip,
            multiple_unique_conflicts: Policy::Error,
        }
    }
}

impl Policies {
    pub fn get(&self, conflict: ConflictType) -> Policy {
        match conflict {
            ConflictType::InsertExists => self.insert_exists,
            ConflictType::UpdateExists => self.update_exists,
            ConflictType::UpdateMissing => self.update_missing,
            ConflictType::DeleteMissing => self.delete_missing,
            ConflictType::MultipleUniqueConflicts => self.multiple_unique_conflicts,
        }
    }

    /// `base` overridden by what `file` sets; refuses combinations pgapply cannot honour.
    pub fn merge(base: Policies, file: &PoliciesFile, scope: &str) -> Result<Policies> {
        let p = Policies {
            insert_exists: file.insert_exists.unwrap_or(base.insert_exists),
            update_exists: file.update_exists.unwrap_or(base.update_exists),
            update_missing: file.update_missing.unwrap_or(base.update_missing),
            delete_missing: file.delete_missing.unwrap_or(base.delete_missing),
            multiple_unique_conflicts: file
                .multiple_unique_conflicts
                .unwrap_or(base.multiple_unique_conflicts),
        };
        let refuse = |what: &str, policy: Policy| {
            Err(Error::usage(format!(
                "{scope}: {what} = {:?} is not supported; use {}",
                policy.name(),
                match what {
                    "update_missing" => "error, skip or apply_remote",
                    _ => "error or skip",
                }
            )))
        };
        if p.update_missing == Policy::KeepLocal {
            return refuse("update_missing", p.update_missing);
        }
        if matches!(p.delete_missing, Policy::ApplyRemote | Policy::KeepLocal) {
            return refuse("delete_missing", p.delete_missing);
        }
        Ok(p)
    }
}

/// Policies per source table (`(schema, table)`), over the global ones.
#[derive(Debug, Clone, Default)]
pub struct PolicyMap {
    pub global: Policies,
    pub tables: HashMap<(String, String), Policies>,
}

impl PolicyMap {
    pub fn for_table(&self, schema: &str, table: &str) -> Policies {
        self.tables
            .get(&(schema.to_owned(), table.to_owned()))
            .copied()
            .unwrap_or(self.global)
    }
}

/// A conflict met while applying, to be recorded.
#[derive(Debug, Clone)]
pub struct ConflictRecord {
    pub relation: String,
    pub conflict_type: &'static str,
    pub key: String,
    /// The target's row (JSON), where there is one.
    pub local_row_query: Option<(String, Vec<crate::apply::statement::WireValue>)>,
    /// The target's rows as JSON when they were read while applying (and may be gone since).
    pub local_row: Option<String>,
    pub remote_row: Option<String>,
    pub source_lsn: crate::protocol::Lsn,
    pub source_commit_time: Option<crate::protocol::PgTimestamp>,
    pub policy: &'static str,
    /// The warning logged (and counted) once the group that met the conflict has committed: a
    /// group rolled back and applied again would otherwise say it twice, and the group after a
    /// failed one would report rows "missing" that were only never committed.
    pub log: ConflictLog,
}

#[derive(Debug, Clone)]
pub struct ConflictLog {
    pub key: String,
    pub xid: u32,
    pub sentence: String,
    /// Rows affected, for a unique conflict that found several.
    pub rows: Option<usize>,
    /// An update_missing or delete_missing (counted in the run's statistics).
    pub missing: bool,
}

/// The conflicts that one target transaction met, to be logged and recorded once it commits.
/// Memory stays bounded however many rows one source transaction touches (a bulk DELETE of
/// rows the target lacks is one conflict per row): the first ones are kept whole, the rest only
/// counted, per table, conflict and policy.
#[derive(Debug, Default)]
pub struct GroupConflicts {
    records: Vec<ConflictRecord>,
    bytes: usize,
    beyond: Vec<ConflictSummary>,
}

/// Conflicts counted but not kept one by one (`GroupConflicts`).
#[derive(Debug, Clone)]
pub struct ConflictSummary {
    pub relation: String,
    pub conflict_type: &'static str,
    pub policy: &'static str,
    pub missing: bool,
    pub count: u64,
    pub first_lsn: crate::protocol::Lsn,
    pub last_lsn: crate::protocol::Lsn,
    pub last_commit_time: Option<crate::protocol::PgTimestamp>,
}

impl GroupConflicts {
    /// Conflicts kept whole per target transaction, and the bytes they may hold.
    pub const MAX_RECORDS: usize = 1000;
    pub const MAX_BYTES: usize = 16 << 20;

    pub fn push(&mut self, record: ConflictRecord) {
        let size = record.size();
        if self.beyond.is_empty()
            && self.records.len() < Self::MAX_RECORDS
            && self.bytes + size <= Self::MAX_BYTES
        {
            self.bytes += size;
            self.records.push(record);
            return;
        }
        let same = |s: &&mut ConflictSummary| {
            s.relation == record.relation
                && s.conflict_type == record.conflict_type
                && s.policy == record.policy
        };
        match self.beyond.iter_mut().find(same) {
            Some(s) => {
                s.count += 1;
                s.last_lsn = record.source_lsn;
                s.last_commit_time = record.source_commit_time;
            }
            None => self.beyond.push(ConflictSummary {
                relation: record.relation,
                conflict_type: record.conflict_type,
                policy: record.policy,
                missing: record.log.missing,
                count: 1,
                first_lsn: record.source_lsn,
                last_lsn: record.source_lsn,
                last_commit_time: record.source_commit_time,
            }),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty() && self.beyond.is_empty()
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }

    pub fn records(&self) -> &[ConflictRecord] {
        &self.records
    }

    pub fn beyond(&self) -> &[ConflictSummary] {
        &self.beyond
    }

    pub fn into_parts(self) -> (Vec<ConflictRecord>, Vec<ConflictSummary>) {
        (self.records, self.beyond)
    }

    /// Names the commit of conflicts noted before it was known (`placeholder` as their LSN).
    pub fn name_commit(
        &mut self,
        placeholder: crate::protocol::Lsn,
        commit_lsn: crate::protocol::Lsn,
        commit_time: crate::protocol::PgTimestamp,
    ) {
        for r in &mut self.records {
            if r.source_lsn == placeholder {
                r.source_lsn = commit_lsn;
                r.source_commit_time = Some(commit_time);
            }
        }
        for s in &mut self.beyond {
            if s.first_lsn == placeholder {
                s.first_lsn = commit_lsn;
            }
            if s.last_lsn == placeholder {
                s.last_lsn = commit_lsn;
                s.last_commit_time = Some(commit_time);
            }
        }
    }
}

impl ConflictRecord {
    /// Roughly the bytes it holds.
    fn size(&self) -> usize {
        let query = self.local_row_query.as_ref().map_or(0, |(sql, params)| {
            use crate::apply::statement::WireValue;
            let value = |p: &WireValue| match p {
                WireValue::Null => 0,
                WireValue::Text(b) | WireValue::Binary(b) => b.len(),
            };
            sql.len() + params.iter().map(value).sum::<usize>()
        });
        std::mem::size_of::<Self>()
            + self.relation.len()
            + self.key.len()
            + query
            + self.local_row.as_ref().map_or(0, String::len)
            + self.remote_row.as_ref().map_or(0, String::len)
            + self.log.key.len()
            + self.log.sentence.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(table: &str, row_bytes: usize, lsn: u64) -> ConflictRecord {
        ConflictRecord {
            relation: table.into(),
            conflict_type: "delete_missing",
            key: "(id)=(1)".into(),
            local_row_query: None,
            local_row: None,
            remote_row: Some("x".repeat(row_bytes)),
            source_lsn: crate::protocol::Lsn(lsn),
            source_commit_time: None,
            policy: "skip",
            log: ConflictLog {
                key: "(id)=(1)".into(),
                xid: 1,
                sentence: "DELETE found no row".into(),
                rows: None,
                missing: true,
            },
        }
    }

    #[test]
    fn a_group_keeps_its_first_conflicts_whole_and_counts_the_rest_by_bytes_too() {
        let mut g = GroupConflicts::default();
        // 1 MiB rows: the byte budget ends it before the count does.
        for n in 0..40 {
            g.push(record("a", 1 << 20, 100 + n));
        }
        g.push(record("b", 10, 200));
        g.push(record("a", 10, 201));
        let kept = g.records().len();
        assert!((10..=16).contains(&kept), "{kept}");
        let beyond: Vec<(&str, u64, u64, u64)> = g
            .beyond()
            .iter()
            .map(|s| (s.relation.as_str(), s.count, s.first_lsn.0, s.last_lsn.0))
            .collect();
        assert_eq!(
            beyond,
            vec![
                ("a", 40 - kept as u64 + 1, 100 + kept as u64, 201),
                ("b", 1, 200, 200)
            ],
            "once counting began, later small ones are counted too (their order is kept)"
        );
        g.name_commit(
            crate::protocol::Lsn(201),
            crate::protocol::Lsn(300),
            crate::protocol::PgTimestamp(7),
        );
        assert_eq!(g.beyond()[0].last_lsn.0, 300);
        assert_eq!(
            g.beyond()[0].last_commit_time,
            Some(crate::protocol::PgTimestamp(7))
        );
    }

    #[test]
    fn defaults_and_refusals() {
        let d = Policies::default();
        assert_eq!(
            (d.insert_exists, d.update_missing),
            (Policy::Error, Policy::Skip)
        );
        let f = PoliciesFile {
            insert_exists: Some(Policy::ApplyRemote),
            ..Default::default()
        };
        assert_eq!(
            Policies::merge(d, &f, "x").unwrap().insert_exists,
            Policy::ApplyRemote
        );
        let f = PoliciesFile {
            delete_missing: Some(Policy::ApplyRemote),
            ..Default::default()
        };
        let err = Policies::merge(d, &f, "[conflicts]").unwrap_err();
        assert!(
            err.to_string()
                .contains("delete_missing = \"apply_remote\" is not supported"),
            "{err}"
        );
        let f = PoliciesFile {
            update_exists: Some(Policy::Skip),
            multiple_unique_conflicts: Some(Policy::ApplyRemote),
            ..Default::default()
        };
        let p = Policies::merge(d, &f, "x").unwrap();
        assert_eq!(p.get(ConflictType::UpdateExists), Policy::Skip);
        assert_eq!(
            p.get(ConflictType::MultipleUniqueConflicts),
            Policy::ApplyRemote
        );
    }
}
