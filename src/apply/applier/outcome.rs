//! The answers to pipelined statements: which change a failure belongs to, what the error tells
//! the user to do, and when a group is applied again without batching.

use super::*;

/// What to do about a foreign key only the target has, which checks replicated changes.
const KEEP_FOREIGN_KEYS_QUIET: &str = "To keep the target a copy of the source: drop that foreign key on the target, or apply as a superuser or, on PostgreSQL 15+, a role granted SET ON PARAMETER session_replication_role (foreign keys are then not checked, as under PostgreSQL's own subscriber), then start pgapply again";

impl Applier {
    pub(super) fn check_outcome(&mut self, outcome: Outcome) {
        let values = self.in_flight_sizes.pop_front().unwrap_or(0);
        self.in_flight_values -= values.min(self.in_flight_values);
        self.completed += 1;
        self.check_outcome_of(outcome);
        // A COMMIT answered with nothing failed before it: that group is committed. (After a
        // failed statement the server answers COMMIT with a rollback, and `failure` is set.)
        while self
            .committing
            .front()
            .is_some_and(|c| c.seq <= self.completed && self.failure.is_none())
        {
            if let Some(mut c) = self.committing.pop_front() {
                // Answers come in order: every conflict noted so far was met by this group (or
                // an earlier one), all committed now.
                c.conflicts = std::mem::take(&mut self.conflicts);
                self.committed.push(c);
            }
        }
    }

    pub(super) fn check_outcome_of(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::One(about, result) => self.check_result(about, result),
            Outcome::Order(Ok(_)) => {}
            // A deadlock here (rows the dispatcher could not see made two transactions wait for
            // each other) is transient: the retry applies them one at a time.
            Outcome::Order(Err(e)) => {
                if self.failure.is_none() {
                    self.failure = Some(Error::postgres(
                        "keeping parallel apply workers in commit order",
                        e,
                    ));
                }
            }
            Outcome::Batch(rows, Ok(missing)) => {
                let mut rows: Vec<Option<HeldChange>> = rows.into_iter().map(Some).collect();
                for r in missing {
                    let held = usize::try_from(r)
                        .ok()
                        .and_then(|r| rows.get_mut(r)?.take());
                    if let Some(held) = held {
                        self.check_result(Some(held.into_change_info()), Ok((0, None)));
                    }
                }
            }
            Outcome::Batch(rows, Err(e)) => {
                if self.failure.is_some() {
                    return;
                }
                let first = rows.first();
                let table = first.map_or_else(String::new, |a| a.relation.target.qualified.clone());
                // "Current transaction is aborted": an earlier statement failed; that failure
                // is the one to report.
                let aborted = e.code().is_some_and(|c| c.code() == "25P02");
                let operation = match first.map(|a| &a.change) {
                    Some(Held::Delete(_)) => "DELETE",
                    _ => "UPDATE",
                };
                let err = Error::postgres(
                    format!(
                        "applying {} batched {operation}s of table {table}",
                        rows.len()
                    ),
                    e,
                );
                if err.is_transient() || aborted {
                    self.failure = Some(err);
                    return;
                }
                let through = rows.iter().map(|a| a.commit_lsn).max();
                self.retry_unbatched(err, through);
            }
        }
    }

    /// Fails the run for the source transaction committing at `commit_lsn`. A parallel worker's
    /// transaction ran beside others on what the dispatcher could see of its rows; what it could
    /// not see (a unique index added on the target, keys equal under the target's collation but
    /// not in bytes) may have run it before an earlier one it needed: the first time, the
    /// transactions in flight are applied again one at a time, and only an error then is the
    /// transaction's own.
    pub(super) fn fail(&mut self, err: Error, commit_lsn: Lsn) {
        let ran_in_parallel = self.worker.is_some() && !self.one_at_a_time(commit_lsn);
        if ran_in_parallel && !err.is_transient() {
            self.retry_unbatched(err, Some(commit_lsn));
        } else {
            self.failure = Some(err);
        }
    }

    /// A statement carrying changes of several source transactions failed: applies them again
    /// one change at a time (after a reconnect), so that the error names the transaction that
    /// causes it.
    pub(super) fn retry_unbatched(&mut self, err: Error, through: Option<Lsn>) {
        let through = self.unbatch(through);
        // (Planned: the next step of finding the change, not a failed attempt.)
        self.failure = Some(Error::planned_restart(format!(
            "{}; applying the source transactions up to commit {through} again one change at a time to find the one that fails",
            err.message()
        )));
    }

    /// Makes the source transactions up to `through` (and the open group's, and the current
    /// one) be applied one change at a time after the restart that follows; returns up to where.
    pub(super) fn unbatch(&mut self, through: Option<Lsn>) -> Lsn {
        let through = self
            .current
            .as_ref()
            .map(|t| t.final_lsn)
            .into_iter()
            .chain(through)
            .chain(self.group.as_ref().and_then(|g| g.last_commit).map(|c| c.0))
            .max()
            .unwrap_or_default();
        self.settings
            .unbatched_through
            .fetch_max(through.0, std::sync::atomic::Ordering::Relaxed);
        through
    }

    /// Notes what one statement's result means: a conflict, a failure, or nothing.
    pub(super) fn check_result(
        &mut self,
        about: Option<ChangeInfo>,
        result: std::result::Result<(u64, Option<String>), tokio_postgres::Error>,
    ) {
        match result {
            Ok((rows, local_row)) => {
                let Some(about) = &about else { return };
                let Some(signal) = about.signal else { return };
                if rows != signal.when_rows {
                    return;
                }
                let kind = signal.conflict.name();
                let missing = matches!(
                    signal.conflict,
                    ConflictType::UpdateMissing | ConflictType::DeleteMissing
                );
                // A trigger added on the target since the table's triggers were read may have
                // kept the row (`apply::triggers`): read again for the next change, and a stop
                // is first a retry with them read anew.
                let cached = (about.relation.source.oid, about.relation.generation);
                let read_a_while_ago = missing
                    && self
                        .may_skip
                        .get(&cached)
                        .is_some_and(|(_, at)| at.elapsed() >= Duration::from_secs(2));
                if read_a_while_ago {
                    self.may_skip.remove(&cached);
                }
                if signal.policy == Policy::Error
                    && read_a_while_ago
                    && about.commit_lsn.0 != u64::MAX
                    && self.failure.is_none()
                    && self
                        .settings
                        .triggers_reread_at
                        .fetch_max(about.commit_lsn.0, std::sync::atomic::Ordering::Relaxed)
                        < about.commit_lsn.0
                {
                    self.failure = Some(Error::planned_restart(format!(
                        "{kind}: {} found no row for key {}: applying again with the target table's triggers read anew (one added since may have kept the row)",
                        about.describe(),
                        about.describe_key_for_log()
                    )));
                    return;
                }
                if signal.policy == Policy::Error {
                    if self.failure.is_none() {
                        let err = Error::definite(format!(
                            "{kind}: {} found no row for key {} and the conflict policy for {kind} is error: {}",
                            about.describe(),
                            about.describe_key_for_log(),
                            self.skip_hint(about.commit_lsn)
                        ));
                        self.fail(err, about.commit_lsn);
                    }
                    return;
                }
                let mut record = conflict_record(about, signal);
                if local_row.is_some() {
                    record.local_row = local_row;
                }
                self.conflicts.push(record);
            }
            Err(e) if e.code().map(|c| c.code()) == Some("PGA02") => {
                // `pgapply cutover` set a stop position this group's transactions pass: the run
                // starts again, and applies what comes before it, then stops.
                if self.failure.is_none() {
                    let said = e
                        .as_db_error()
                        .map_or_else(|| describe_postgres(&e), |db| db.message().to_owned());
                    self.failure = Some(Error::planned_restart(format!(
                        "{said}, inside the transactions applied together: applying again up to the stop, then stopping"
                    )));
                }
            }
            // A column of a table this group writes changed since pgapply read it: its
            // statements' parameters would be cast to the new type. Applied again, from the
            // last commit, with the table read anew (planned: not a failed attempt).
            Err(e) if e.code().map(|c| c.code()) == Some("PGA03") => {
                if self.failure.is_none() {
                    let said = e
                        .as_db_error()
                        .map_or_else(|| describe_postgres(&e), |db| db.message().to_owned());
                    self.failure = Some(Error::planned_restart(format!(
                        "{said}: applying again from the last commit, with the table read anew and its statements prepared anew"
                    )));
                }
            }
            Err(e) if e.code().map(|c| c.code()) == Some("PGA01") => {
                // A table whose updates this group batched got a trigger (say) meanwhile.
                if self.failure.is_none() {
                    let through = self.unbatch(None);
                    let again = if through.is_valid() {
                        format!("applying the source transactions up to commit {through} again one change at a time, then batching only the updates of tables that still allow it")
                    } else {
                        "starting again, with the table read anew".to_owned()
                    };
                    // (Planned: the answer to a change on the target, not a failed attempt; the
                    // message alone, without the PL/pgSQL context.)
                    let said = e
                        .as_db_error()
                        .map_or_else(|| describe_postgres(&e), |db| db.message().to_owned());
                    self.failure = Some(Error::planned_restart(format!("{said}: {again}")));
                }
            }
            Err(e) => {
                if self.failure.is_none() {
                    // A unique violation is a conflict in PostgreSQL 18's terms: name it so.
                    let overwriting = about.as_ref().and_then(|a| a.signal).is_some_and(|s| {
                        s.conflict == ConflictType::InsertExists && s.policy == Policy::ApplyRemote
                    });
                    let kind = match (
                        e.code().map(|c| c.code()),
                        about.as_ref().map(|a| a.operation),
                    ) {
                        // The upsert settled the key; another unique index still clashed.
                        (Some("23505"), Some("INSERT")) if overwriting => {
                            "multiple_unique_conflicts"
                        }
                        (Some("23505"), Some("INSERT")) => "insert_exists",
                        (Some("23505"), Some("UPDATE")) => "update_exists",
                        _ => "",
                    };
                    let aborted = e.code().is_some_and(|c| c.code() == "25P02");
                    if about.is_none() && !aborted {
                        let completed = self.completed;
                        if let Some(c) = self
                            .committing
                            .iter()
                            .find(|c| c.seq == completed || c.immediate_seq == Some(completed))
                        {
                            let (transactions, end_lsn, last) =
                                (c.transactions, c.end_lsn, c.last_transaction);
                            // Only an error the server sent says the COMMIT did not happen; a
                            // connection lost on the way leaves that open (the origin tells).
                            if c.seq == completed && e.as_db_error().is_some() {
                                self.origin_rewind = true;
                            }
                            return self.commit_failed(transactions, end_lsn, last, e);
                        }
                    }
                    // Under REPLICA IDENTITY FULL, a composite or array whose field or element
                    // type has no equality operator prepares fine (record and array equality
                    // exist) and fails only when it runs: as when preparing fails, the run
                    // starts again comparing that table's rows by their text form.
                    if let Some(about) = about.as_ref().filter(|a| {
                        e.code().map(|c| c.code()) == Some("42883")
                            && matches!(a.operation, "UPDATE" | "DELETE")
                            && a.relation.source.replica_identity
                                == crate::protocol::pgoutput::ReplicaIdentity::Full
                            && !self.full_as_text.contains(&a.relation.source.oid)
                    }) {
                        let oid = about.relation.source.oid;
                        self.full_as_text.insert(oid);
                        if let Ok(mut known) = FULL_AS_TEXT.lock() {
                            known.insert(oid);
                        }
                        // (Planned: not a failed attempt, and no pause; once per table.)
                        self.failure = Some(Error::planned_restart(format!(
                            "applying {}: {}: a type in a column of table {} (or inside one) has no equality operator on the target; applying again, comparing REPLICA IDENTITY FULL rows by their text form",
                            about.describe(),
                            describe_postgres(&e),
                            about.relation.target.qualified
                        )));
                        return;
                    }
                    // A column's type changed on the target under a prepared statement: the
                    // statements prepared anew by a fresh start take the new type.
                    if let Some(about) = about
                        .as_ref()
                        .filter(|_| e.code().map(|c| c.code()) == Some("42804"))
                    {
                        if first_type_mismatch(about.relation.source.oid) {
                            self.failure = Some(Error::transient(format!(
                                "applying {}: {}: a column of target table {} may have changed type since pgapply prepared its statements: starting again with statements prepared anew",
                                about.describe(),
                                describe_postgres(&e),
                                about.relation.target.qualified
                            )));
                            return;
                        }
                    }
                    if let Some(about) = about
                        .as_ref()
                        .filter(|_| e.code().is_some_and(|c| value_refused(c.code())))
                    {
                        self.refused_in = Some(about.relation.clone());
                    }
                    let through = about.as_ref().and_then(|a| a.through);
                    let err = self.violation_error(kind, about.as_ref(), e);
                    match (through, &about) {
                        (Some(lsn), _) if !err.is_transient() && !aborted => {
                            self.retry_unbatched(err, Some(lsn))
                        }
                        (None, Some(about)) if !aborted => self.fail(err, about.commit_lsn),
                        _ => self.failure = Some(err),
                    }
                }
            }
        }
    }

    /// A group's COMMIT failed (a deferred constraint checked then, a serialization failure):
    /// with several source transactions in it, they are applied again one at a time, each
    /// committing on its own, so that the error names the one that fails.
    pub(super) fn commit_failed(
        &mut self,
        transactions: u64,
        end_lsn: Lsn,
        last: Option<(u32, Lsn)>,
        e: tokio_postgres::Error,
    ) {
        // A deferrable foreign key checks at COMMIT (pgapply defers all it can).
        let foreign_key = e.code() == Some(&tokio_postgres::error::SqlState::FOREIGN_KEY_VIOLATION);
        let err = Error::postgres(
            format!(
                "committing {transactions} source transaction(s) ending at {end_lsn} on the target"
            ),
            e,
        );
        if err.is_transient() {
            self.failure = Some(err);
            return;
        }
        match last {
            Some((_, commit_lsn)) if transactions > 1 => {
                self.retry_unbatched(err, Some(commit_lsn));
            }
            Some((xid, commit_lsn)) => {
                let advice = if foreign_key {
                    format!("a deferrable foreign key of the target, checked at commit, refused this transaction, which the source did not stop (it has no such foreign key, or its rows differ); the target checks foreign keys on replicated changes because the target role may not set session_replication_role. {KEEP_FOREIGN_KEYS_QUIET}; or, if the target lacks a row the source has (a mirror started without --copy-data), copy it from the source. Otherwise, ")
                } else {
                    String::new()
                };
                let err = Error::definite(format!(
                    "{} (source transaction xid {xid}, commit LSN {commit_lsn}): {advice}{}",
                    err.message(),
                    self.skip_hint(commit_lsn)
                ));
                self.fail(err, commit_lsn);
            }
            None => self.failure = Some(err),
        }
    }

    /// The error for a failed statement, named by its conflict type when it is one.
    pub(super) fn violation_error(
        &self,
        kind: &str,
        about: Option<&ChangeInfo>,
        e: tokio_postgres::Error,
    ) -> Error {
        let what = about.map_or_else(
            || "a statement on the target".to_owned(),
            ChangeInfo::describe,
        );
        let kind = if kind.is_empty() {
            String::new()
        } else {
            format!("{kind}: ")
        };
        // A statement with several transactions' changes is retried one change at a time; the
        // hint comes with that retry's error.
        // A lost connection or a restarting target is retried: nothing to fix, nothing to skip.
        let transient = e
            .as_db_error()
            .is_none_or(|db| crate::error::is_transient_sqlstate(db.code().code()));
        let hint = about
            .filter(|a| a.through.is_none() && !transient)
            .map(|about| self.change_hint(about, &e));
        let err = Error::postgres(format!("{kind}applying {what}"), e);
        match hint {
            Some(hint) => err.context_after(hint),
            None => err,
        }
    }

    /// What to do about a change the target refused: what to change on the target where that
    /// fixes it (skipping would lose the transaction), else how to skip it on purpose.
    pub(super) fn change_hint(&self, about: &ChangeInfo, e: &tokio_postgres::Error) -> String {
        let table = &about.relation.target.qualified;
        let db = e.as_db_error();
        match e.code().map(|c| c.code()) {
            // An enum label added on the source (ALTER TYPE .. ADD VALUE is not replicated).
            Some("22P02")
                if db.is_some_and(|d| d.message().starts_with("invalid input value for enum ")) =>
            {
                let detail = db.map(|d| d.message()).unwrap_or_default();
                let (enum_type, value) = detail
                    .trim_start_matches("invalid input value for enum ")
                    .split_once(": ")
                    .unwrap_or(("...", "..."));
                let label = value.trim_matches('"');
                format!(
                    "the source's enum type {enum_type} has a value the target's lacks ({value}; ALTER TYPE on the source is not replicated): add it on the target (ALTER TYPE {enum_type} ADD VALUE {}, at the same place as on the source: BEFORE or AFTER another label), or, if the source renamed a label to it, rename that label on the target the same way (ALTER TYPE {enum_type} RENAME VALUE '...' TO {}); then start pgapply again",
                    crate::sql::shown_literal(label),
                    crate::sql::shown_literal(label)
                )
            }
            // A composite type changed on the source (ALTER TYPE .. ADD/DROP ATTRIBUTE).
            Some("22P02")
                if db.is_some_and(|d| d.message().starts_with("malformed record literal")) =>
            {
                format!(
                    "a value of a composite type (a column of target table {table}, or inside one) does not fit the target's type: attributes were added, dropped or changed on the source (ALTER TYPE is not replicated); change the type on the target the same way (ALTER TYPE ... ADD ATTRIBUTE ..., DROP ATTRIBUTE ...), then start pgapply again"
                )
            }
            // A value the target refuses: name the columns it can come from.
            // Values bound in binary form that the target does not read back (a built-in type's
            // binary form that PostgreSQL writes but refuses): text would go through.
            Some("22P03") if self.binary_values => format!(
                "target table {table} refuses a value the source sent in binary form (--binary): PostgreSQL does not read back every binary value it writes; start pgapply again without --binary (values then come as text); nothing of this source transaction was applied"
            ),
            Some(c) if value_refused(c) => match refused_by_type(about.relation.narrower_candidates(), db.map(|d| d.message())).as_slice() {
                [] => format!("target table {table} refuses the source's value, though none of its columns of a built-in type differs from the source's: a PostgreSQL older than the source's refuses some values that newer versions take (numeric 'Infinity' before 14, an infinite interval before 17), a user-defined type (an enum, a domain) may differ between the two clusters, and a target trigger may raise it. This change is in the slot already: changing the value on the source now does not replace it. Change the column, type or trigger on the target so that it takes the value, then start pgapply again; where the target cannot hold the value at all, {}, and put that transaction's rows right on the target by hand (`pgapply verify` names the rows that differ)", self.skip_hint(about.commit_lsn)),
                [one] => format!("column {one} of target table {table} does not take the source's value: its type differs from the source column's; change it on the target to fit the source's type, then start pgapply again (it reads the target's columns when it starts)"),
                many => format!("a column of target table {table} does not take the source's value; these columns' types differ from the source's: {}: change the one the error is about on the target to fit the source's type, then start pgapply again (it reads the target's columns when it starts)", many.join(", ")),
            },
            // NOT NULL on the target: a column the source does not send (dropped there, or
            // target-only) without a default, or one the source sends NULL in.
            // A foreign key checked on the target: quiet under PostgreSQL's own subscriber.
            Some("23503") => {
                let constraint = db
                    .and_then(|d| d.constraint())
                    .map(|c| format!(" {}", quote_ident(c)))
                    .unwrap_or_default();
                // (The error names the referencing table: another one when this change removes
                // or rekeys a row that target rows still refer to.)
                let referencing = db
                    .and_then(|d| d.table())
                    .filter(|t| *t != about.relation.target.name);
                if let Some(child) = referencing {
                    let child = match db.and_then(|d| d.schema()) {
                        Some(schema) => crate::sql::qualified_name(schema, child),
                        None => quote_ident(child),
                    };
                    return format!(
                        "rows of target table {child} still refer to the row of {table} this {} changes, through its foreign key{constraint}, which the source did not stop (it has no such foreign key, or its rows differ), and the target checks it on replicated changes because the target role may not set session_replication_role. {KEEP_FOREIGN_KEYS_QUIET}. Deleting or changing the referring rows on the target (or ON DELETE/ON UPDATE CASCADE) is right only for rows the source does not have (a target-only table): rows that came from the source would then differ from it. Or {}",
                        about.operation,
                        self.skip_hint(about.commit_lsn)
                    );
                }
                format!(
                    "the foreign key{constraint} of target table {table} checks replicated changes, which it does only when the target role may not set session_replication_role (PostgreSQL's own subscriber keeps foreign keys quiet): apply as a superuser or, on PostgreSQL 15+, GRANT SET ON PARAMETER session_replication_role TO the role, and start pgapply again; or the target lacks the row it refers to (a mirror started without --copy-data holds only the rows changed since it began): copy the missing rows from the source, then start pgapply again; or {}",
                    self.skip_hint(about.commit_lsn)
                )
            }
            Some("23502") if db.and_then(|d| d.column()).is_some() => {
                let column = db.and_then(|d| d.column()).unwrap_or_default();
                let quoted = quote_ident(column);
                let sent = (0..about.relation.source.columns.len())
                    .any(|c| about.relation.target_column(c).is_some_and(|t| t.name == column));
                if sent {
                    format!("the source's row has NULL in column {quoted} of target table {table}, which is NOT NULL there (not on the source): ALTER TABLE {table} ALTER COLUMN {quoted} DROP NOT NULL on the target, then start pgapply again")
                } else {
                    format!("column {quoted} of target table {table} is NOT NULL without a default, and the source does not send it (dropped on the source, left out of the publication's column list, or a target-only column): give it a default (ALTER TABLE {table} ALTER COLUMN {quoted} SET DEFAULT ...), drop NOT NULL, or drop the column on the target, then start pgapply again")
                }
            }
            // No partition takes the row (a partition only the source has), a leaf partition's
            // bounds, or a CHECK constraint only the target has.
            Some("23514") => match db.and_then(|d| d.constraint()).filter(|n| !n.is_empty()) {
                // A domain's CHECK (the error names the domain as its data type), not the table's.
                Some(name) if db.and_then(|d| d.datatype()).is_some() => {
                    let domain = db
                        .map(|d| match (d.schema(), d.datatype()) {
                            (Some(schema), Some(t)) => crate::sql::qualified_name(schema, t),
                            (_, t) => quote_ident(t.unwrap_or_default()),
                        })
                        .unwrap_or_default();
                    // The target columns of that domain (or arrays of it): the error names none.
                    let datatype = db.and_then(|d| d.datatype()).unwrap_or_default();
                    let columns: Vec<String> = about
                        .relation
                        .target
                        .columns
                        .iter()
                        .filter(|c| {
                            let base = c.type_name.trim_end_matches("[]");
                            let unqualified = base.rsplit('.').next().unwrap_or(base);
                            unqualified.trim_matches('"').replace("\"\"", "\"") == datatype
                        })
                        .map(|c| quote_ident(&c.name))
                        .collect();
                    let which = match columns.as_slice() {
                        [] => "a column".to_owned(),
                        [one] => format!("column {one}"),
                        more => format!("one of columns {}", more.join(", ")),
                    };
                    format!("the CHECK constraint {} of domain {domain} on the target refuses the source's value for {which} of target table {table}: drop or change it on the target (ALTER DOMAIN {domain} DROP CONSTRAINT {}), then start pgapply again; or {}", quote_ident(name), quote_ident(name), self.skip_hint(about.commit_lsn))
                }
                None if db.is_some_and(|d| d.message().starts_with("no partition")) => format!("no partition of target table {table} takes the source's row: create the partition on the target (as on the source), then start pgapply again"),
                None => format!("target table {table} is a partition whose bounds do not take the source's row (the target's partitions differ from the source's): make its bounds match the source's, or apply into the partitioned table (`[tables]` in the config file), then start pgapply again"),
                Some(name) => format!("the CHECK constraint {} of target table {table} refuses the source's row: drop or change it on the target, then start pgapply again; or {}", quote_ident(name), self.skip_hint(about.commit_lsn)),
            },
            // A row the target has and the source does not know of: fixing that row keeps the
            // transaction, skipping loses all of it.
            // A key only the source defers: most likely keys swapped within one statement or
            // transaction, which no row of the target's own causes.
            Some("23505")
                if about.operation == "UPDATE"
                    && self
                        .deferrable_on_source
                        .contains(&about.relation.target.qualified) =>
            {
                format!(
                    "target table {table} keeps unique without deferring a key that is DEFERRABLE on the source (said when pgapply started): this source transaction most likely swaps key values, which the source allows as it checks that key only at the end. Do not delete the row this error names: that would lose it. On the target, drop that constraint and add it again as DEFERRABLE INITIALLY DEFERRED (as on the source), then start pgapply again; the transaction is then applied whole"
                )
            }
            Some("23505") if matches!(about.operation, "INSERT" | "UPDATE") => {
                // A policy in force for this statement that did not settle it: the row clashes
                // on another unique key than the one that policy handles.
                let beyond = about.signal.is_some_and(|s| {
                    s.policy != Policy::Error
                        && matches!(
                            (about.operation, s.conflict),
                            ("INSERT", ConflictType::InsertExists)
                                | ("UPDATE", ConflictType::UpdateExists)
                        )
                });
                let full = about.relation.source.replica_identity
                    == crate::protocol::pgoutput::ReplicaIdentity::Full;
                let (kind, take) = if beyond {
                    ("multiple_unique_conflicts", "\"apply_remote\" (delete the target's clashing rows), \"skip\" or \"keep_local\" (keep them); but no policy covers a unique index that is partial, on an expression, deferrable, or on a column the source does not send, whose key pgapply cannot compute: if the index this error names is one, fix the row or drop that index")
                } else if about.operation == "INSERT" {
                    ("insert_exists", "\"apply_remote\" (replace the target's row with the source's), \"skip\" or \"keep_local\" (keep the target's); that covers a clash on the key rows are found by: one on another unique index of the target is multiple_unique_conflicts, with the same choices")
                } else if full {
                    // (update_exists policies find the other row by the table's key.)
                    return format!(
                        "a row of target table {table} already holds that key (written on the target, or by another source): delete or change that row on the target and start pgapply again (update_exists policies need a primary key or replica identity index on the source table: this one is REPLICA IDENTITY FULL); or, losing the whole source transaction, its other changes too: {}",
                        self.skip_hint(about.commit_lsn)
                    );
                } else {
                    ("update_exists", "\"apply_remote\" (delete the target's other row), \"skip\" or \"keep_local\" (keep it and leave this update out); that covers a clash on the key rows are found by: one on another unique index of the target is multiple_unique_conflicts, with the same choices")
                };
                let key = format!(
                    "{}.{}",
                    crate::relation::source_schema(&about.relation.source),
                    about.relation.source.name
                )
                .replace('\\', "\\\\")
                .replace('"', "\\\"");
                // The source's table is a new one under that name: the clash is most likely
                // with the old table's rows, which the target still holds.
                if let (Some(old), "INSERT", false) =
                    (about.relation.recreated_from, about.operation, beyond)
                {
                    return format!(
                        "a row of target table {table} already holds that key, and the source's table {} is a new table under that name (dropped and created again, or another table renamed to it, while pgapply ran: its relation id went from {old} to {}): the target table most likely still holds the old table's rows. To make it the new table's copy, give it insert_exists = \"apply_remote\" in the config file ([tables.\"{key}\".conflicts]: such rows are replaced by the source's), start pgapply again, and once it has caught up delete on the target the old rows that remain (`pgapply verify` names the rows only the target has); to keep the old rows, insert_exists = \"keep_local\" instead; or, losing the whole source transaction, its other changes too: {}",
                        about.relation.display_name(),
                        about.relation.source.oid,
                        self.skip_hint(about.commit_lsn)
                    );
                }
                // (The unique key may be one the source no longer has: then it is the target
                // that differs, not a row.)
                let constraint = db.and_then(|d| d.constraint()).map(|c| {
                    format!(
                        " If the source does not have that unique key {} (dropped or changed there, such DDL is not replicated; or made on the target only), drop it on the target instead (ALTER TABLE {table} DROP CONSTRAINT {}; or, for a unique index that is no constraint, DROP INDEX {}) and start pgapply again.",
                        quote_ident(c),
                        quote_ident(c),
                        crate::sql::qualified_name(&about.relation.target.schema, c)
                    )
                });
                format!(
                    "a row of target table {table} already holds that key (written on the target, or by another source): delete or change that row on the target and start pgapply again, or give the table a conflict policy in the config file ([tables.\"{key}\".conflicts] or [conflicts] {kind} = {take}); or, losing the whole source transaction, its other changes too: {skip}.{}",
                    constraint.unwrap_or_default(),
                    skip = self.skip_hint(about.commit_lsn)
                )
            }
            // Nothing to skip: the target takes no writes (or a trigger writes where none are
            // taken). Not retried: a trigger's or foreign table's refusal would come back for
            // ever.
            Some("25006") => format!(
                "the target refused to write {table} in a read-only transaction: it was made read-only while pgapply ran (default_transaction_read_only set by ALTER SYSTEM, ALTER DATABASE or ALTER ROLE and reloaded, or the server is now a standby), or a trigger, rule or foreign table of {table} writes to a server that is: make the target take writes again, then start pgapply again (at its start it says where such a setting comes from and how to undo it); nothing of this source transaction was applied"
            ),
            // A relation or type a value names (regclass, regtype ...) that the target lacks.
            Some(code @ ("42P01" | "42704"))
                if named_object(db.map(|d| d.message()))
                    .is_some_and(|n| !names_table(&n, &about.relation.target)) =>
            {
                let name = named_object(db.map(|d| d.message())).unwrap_or_default();
                let what = if code == "42P01" { "relation" } else { "type" };
                let columns: Vec<String> = (0..about.relation.source.columns.len())
                    .filter(|&c| is_oid_alias(about.relation.source.columns[c].type_oid))
                    .map(|c| quote_ident(&about.relation.source.columns[c].name))
                    .collect();
                let held = match columns.as_slice() {
                    [] => String::new(),
                    [one] => format!(" (column {one} holds object names)"),
                    more => format!(" (columns {} hold object names)", more.join(", ")),
                };
                format!(
                    "a value of {table} names {what} {name:?}, which the target does not have{held}: create it on the target (an object name is looked up where the row is written), then start pgapply again; or, losing the whole source transaction, its other changes too: {}",
                    self.skip_hint(about.commit_lsn)
                )
            }
            // The target table went away under the prepared statements.
            Some("42P01") => format!(
                "target table {table} no longer exists (dropped or renamed on the target while pgapply ran): create it again or rename it back, then start pgapply again"
            ),
            // A target foreign key from a table the source did not truncate.
            Some("0A000") if about.operation == "TRUNCATE" => format!(
                "the source truncated {table}, and a table on the target that the source did not truncate references it: pgapply does not cascade to such tables (nor does PostgreSQL's own subscriber), and PostgreSQL refuses to truncate a referenced table alone even when the referencing one is empty. Drop the foreign key of the referencing table on the target (or that table), then start pgapply again"
            ),
            // Text that is no valid UTF-8, which nothing on the target changes.
            Some("22021") => format!(
                "the source sent text that is no valid UTF-8 for {table}: from a SQL_ASCII source database (bytes above 127 have no known encoding), or a \"char\" byte above 127 inside an array, which a PostgreSQL 14 or older source writes raw. Fix those values on the source (set them to plain characters); this transaction cannot be applied as sent: {}, and copy its rows by hand",
                self.skip_hint(about.commit_lsn)
            ),
            c => c
                .and_then(|c| target_table_hint(c, table, db.map(|d| d.message())))
                .unwrap_or_else(|| self.skip_hint(about.commit_lsn)),
        }
    }
}

/// The object an "undefined" error names: `relation "x" does not exist`, `type "x" does not
/// exist`.
fn named_object(message: Option<&str>) -> Option<String> {
    let m = message?;
    let rest = m
        .strip_prefix("relation \"")
        .or_else(|| m.strip_prefix("type \""))?;
    rest.split_once("\" does not exist")
        .map(|(n, _)| n.to_owned())
}

/// Whether `name` (as an error message writes it: `schema.table` or `table`) is this table.
fn names_table(name: &str, table: &crate::relation::TargetTable) -> bool {
    name == table.name || name == format!("{}.{}", table.schema, table.name)
}

/// The OID alias types (regclass, regtype, ...), whose values name objects looked up where they
/// are read.
fn is_oid_alias(type_oid: crate::protocol::pgoutput::Oid) -> bool {
    matches!(
        type_oid,
        24 | 2202 | 2203 | 2204 | 2205 | 2206 | 3734 | 3769 | 4089 | 4096 | 4191
            // and their arrays
            | 1008 | 2207 | 2208 | 2209 | 2210 | 2211 | 3735 | 3770 | 4090 | 4097 | 4192
    )
}

/// A data exception (class 22) that a target column's type explains: not an encoding problem
/// (22P05 untranslatable character, 22021 invalid byte sequence), which no column change fixes.
/// The columns whose type differs from the source's that can be the one a value error is about:
/// those of the type the error names (`invalid input syntax for type numeric`, `out of range
/// for type integer`, `value too long for type character varying(10)`), all of them when it
/// names none. None when it names a type no such column has: the value is refused for another
/// reason (an older target's type, a domain, a trigger).
fn refused_by_type(candidates: Vec<String>, message: Option<&str>) -> Vec<String> {
    let named = message.and_then(|m| {
        let rest = m.split(" for type ").nth(1)?;
        let end = rest.find(':').unwrap_or(rest.len());
        Some(rest[..end].trim().to_owned())
    });
    let Some(named) = named else {
        return candidates;
    };
    // A candidate reads `"column" (type)`.
    candidates
        .into_iter()
        .filter(|c| {
            c.rsplit_once(" (")
                .and_then(|(_, t)| t.strip_suffix(')'))
                .is_some_and(|t| t == named || t.split('(').next() == Some(named.as_str()))
        })
        .collect()
}

pub(super) fn value_refused(code: &str) -> bool {
    code.starts_with("22") && !matches!(code, "22P05" | "22021")
}

/// What to do when the target refuses a statement because of how its table is defined (SQLSTATE
/// `code`): a change on the target fixes it, not skipping the transaction.
pub(super) fn target_table_hint(code: &str, table: &str, message: Option<&str>) -> Option<String> {
    match code {
        "428C9" => Some(format!(
            "pgapply writes the source's values, and an UPDATE may write into an identity column of {table} only if it is GENERATED BY DEFAULT (pgapply leaves it out only when it is part of the key, or the old row shows it unchanged): run ALTER TABLE {table} ALTER COLUMN {} SET GENERATED BY DEFAULT on the target and start pgapply again (after a cutover, SET GENERATED ALWAYS gives it back)",
            // `column "x" can only be updated to DEFAULT`
            message
                .and_then(|m| m.strip_prefix("column \""))
                .and_then(|m| m.split_once("\" can only"))
                .map(|(name, _)| quote_ident(name))
                .unwrap_or_else(|| "...".to_owned())
        )),
        // A value the target's column does not take (out of range, too long): a narrower type
        // than the source's. Skipping would lose the transaction.
        c if value_refused(c) => Some(format!(
            "a column of target table {table} does not take the source's value (a narrower type, or a different one): change the column on the target to fit the source's type, then start pgapply again (it reads the target's columns when it starts, so a column changed while it runs counts only from then); `pgapply check` lists what differs"
        )),
        // Row-level security: the error itself says what to do (`describe_postgres`).
        "42501" if message.is_some_and(|m| m.contains("row-level security")) => None,
        // The schema, not the table: its owner changed (ALTER SCHEMA .. OWNER TO), say, and
        // with it the rights pgapply's role had through owning it.
        "42501" if message.is_some_and(|m| m.starts_with("permission denied for schema ")) => {
            let schema = message
                .and_then(|m| m.strip_prefix("permission denied for schema "))
                .map(|s| quote_ident(s.trim()))
                .unwrap_or_else(|| "...".to_owned());
            Some(format!(
                "the target role may not use schema {schema} of table {table} (it lost its rights there when the schema's owner changed, say): GRANT USAGE ON SCHEMA {schema} TO the role pgapply connects as, or make that role a member of the schema's owner (GRANT owner_role TO pgapply_role), then start pgapply again; `pgapply check` lists every missing right"
            ))
        }
        "42501" => Some(format!(
            "the target role lacks a privilege on {table} (or on a sequence, function or table its defaults, triggers or foreign keys use): GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO the role pgapply connects as (and TRUNCATE if truncates are published), then start pgapply again; `pgapply check` lists every missing right"
        )),
        c if c.starts_with("42") => Some(format!(
            "target table {table} does not take the source's rows as they are (a column or type changed on the target, or a privilege is missing): fix the target table and start pgapply again (it reads the target's columns when it starts); `pgapply check` lists what differs"
        )),
        _ => None,
    }
}

/// Whether an "expression is of type x" error for a relation may start the run again: not if
/// one did in the last ten minutes (then the statements were prepared anew and the error is
/// not about a changed table).
pub(super) fn first_type_mismatch(relation: crate::protocol::pgoutput::Oid) -> bool {
    static SEEN: std::sync::LazyLock<
        std::sync::Mutex<HashMap<crate::protocol::pgoutput::Oid, Instant>>,
    > = std::sync::LazyLock::new(Default::default);
    let Ok(mut seen) = SEEN.lock() else {
        return false;
    };
    match seen.get(&relation) {
        Some(at) if at.elapsed() < Duration::from_secs(600) => false,
        _ => {
            seen.insert(relation, Instant::now());
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schema_refused_gets_the_schema_grant_not_the_table_grants() {
        let hint = target_table_hint(
            "42501",
            "\"app\".\"customers\"",
            Some("permission denied for schema app"),
        )
        .unwrap_or_default();
        assert!(hint.contains("GRANT USAGE ON SCHEMA \"app\" TO"), "{hint}");
        assert!(!hint.contains("GRANT SELECT, INSERT"), "{hint}");
        let hint = target_table_hint(
            "42501",
            "\"app\".\"customers\"",
            Some("permission denied for table customers"),
        )
        .unwrap_or_default();
        assert!(
            hint.contains("GRANT SELECT, INSERT, UPDATE, DELETE ON"),
            "{hint}"
        );
    }

    #[test]
    fn a_value_error_is_put_on_the_columns_of_the_type_it_names() {
        let candidates = || {
            vec![
                "\"mr\" (text)".to_owned(),
                "\"n\" (integer)".to_owned(),
                "\"v\" (character varying(10))".to_owned(),
            ]
        };
        assert_eq!(
            refused_by_type(
                candidates(),
                Some("invalid input syntax for type numeric: \"-Infinity\"")
            ),
            Vec::<String>::new()
        );
        assert_eq!(
            refused_by_type(
                candidates(),
                Some("value \"3000000000\" is out of range for type integer")
            ),
            vec!["\"n\" (integer)".to_owned()]
        );
        assert_eq!(
            refused_by_type(
                candidates(),
                Some("value too long for type character varying(10)")
            ),
            vec!["\"v\" (character varying(10))".to_owned()]
        );
        assert_eq!(
            refused_by_type(candidates(), Some("numeric field overflow")).len(),
            3
        );
    }
}
