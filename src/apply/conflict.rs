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

#[cfg(test)]
mod tests {
    use super::*;

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
