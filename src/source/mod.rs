//! The source side: a walsender session that streams a logical slot with pgoutput.
//!
//! [`connection`] speaks the wire protocol; this module runs the replication commands:
//! IDENTIFY_SYSTEM, checking (or creating) the slot, checking the publications, and
//! START_REPLICATION, after which [`ReplicationStream`] hands out walsender frames and sends
//! standby status updates.

pub mod connection;
pub mod options;

use bytes::BytesMut;

use crate::error::{Error, Result};
use crate::protocol::{Lsn, PgTimestamp, ReplicationFrame, StandbyStatusUpdate};
use crate::sql::{quote_ident, quote_literal};
use connection::{QueryResult, ReplicationConnection};

/// What IDENTIFY_SYSTEM says about the source.
#[derive(Debug, Clone)]
pub struct SystemIdentity {
    pub system_id: String,
    pub timeline: u32,
    pub wal_position: Lsn,
    pub database: String,
}

/// Why a failover slot alone does not make a failover safe.
pub const STANDBY_SLOTS_UNSET: &str = "--failover-slot: synchronized_standby_slots is empty on the source, so pgapply may apply changes a standby has not received yet; after a failover to that standby the target would hold changes the new primary never had (pgapply then refuses to go on from it). Set synchronized_standby_slots on the source to the physical slots of the standbys that may take over (and sync_replication_slots = on on them)";

/// A timeline history file's entries: "parent timeline, switch point, reason" per line (comments
/// and blank lines aside). `Err` holds a line that does not read so.
pub fn parse_timeline_history(content: &str) -> std::result::Result<Vec<(u32, Lsn)>, String> {
    let mut entries = Vec::new();
    for line in content.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split_whitespace();
        let timeline = fields.next().and_then(|t| t.parse::<u32>().ok());
        let switch = fields.next().and_then(|l| l.parse::<Lsn>().ok());
        match (timeline, switch) {
            (Some(t), Some(l)) => entries.push((t, l)),
            _ => return Err(line.to_owned()),
        }
    }
    Ok(entries)
}

/// A new slot's starting point and the snapshot that shows the data as of that point.
#[derive(Debug, Clone)]
pub struct ExportedSnapshot {
    pub consistent_point: Lsn,
    pub snapshot_name: String,
}

pub struct ReplicationSession {
    conn: ReplicationConnection,
}

impl ReplicationSession {
    pub async fn connect(
        config: &tokio_postgres::Config,
        max_message_bytes: usize,
    ) -> Result<Self> {
        let conn = ReplicationConnection::connect(config, max_message_bytes).await?;
        if conn.server_version < 100000 {
            return Err(Error::definite(format!(
                "source {} runs PostgreSQL {}; pgapply needs PostgreSQL 10 or later (pgoutput)",
                conn.endpoint,
                conn.server_version / 10000
            )));
        }
        Ok(ReplicationSession { conn })
    }

    pub fn server_version(&self) -> u32 {
        self.conn.server_version
    }

    pub fn endpoint(&self) -> &str {
        &self.conn.endpoint
    }

    pub async fn identify_system(&mut self) -> Result<SystemIdentity> {
        let r = self.conn.simple_query("IDENTIFY_SYSTEM").await?;
        let field = |name: &str| {
            r.first(name).map(str::to_owned).ok_or_else(|| {
                Error::definite(format!("IDENTIFY_SYSTEM on the source returned no {name}"))
            })
        };
        let wal: String = field("xlogpos")?;
        Ok(SystemIdentity {
            system_id: field("systemid")?,
            timeline: field("timeline")?.parse().unwrap_or(0),
            wal_position: wal.parse().map_err(|e| {
                Error::definite(format!("IDENTIFY_SYSTEM returned a bad xlogpos: {e}"))
            })?,
            database: r.first("dbname").unwrap_or_default().to_owned(),
        })
    }

    /// Checks the slot: it must exist (or be created with `create`), be logical, use pgoutput and
    /// belong to the connected database.
    pub async fn ensure_slot(
        &mut self,
        slot: &str,
        create: bool,
        database: &str,
        two_phase: bool,
        failover: bool,
        parallel: bool,
    ) -> Result<()> {
        self.check_failover(failover, two_phase)?;
        let two_phase_column = if self.conn.server_version >= 140000 {
            "two_phase::text"
        } else {
            "'false'"
        };
        let failover_column = if self.conn.server_version >= 170000 {
            "failover::text"
        } else {
            "'false'"
        };
        let sql = format!(
            "SELECT slot_type, plugin, database, {two_phase_column} AS two_phase, {failover_column} AS failover FROM pg_catalog.pg_replication_slots WHERE slot_name = {}",
            quote_literal(slot)
        );
        let r = self.conn.simple_query(&sql).await?;
        if r.rows.is_empty() {
            if !create {
                return Err(Error::definite(format!(
                    "replication slot {slot:?} does not exist on the source {}: run with --create-slot (or --copy-data, to copy the tables' rows first), or create it with SELECT pg_create_logical_replication_slot({}, 'pgoutput')",
                    self.conn.endpoint,
                    quote_literal(slot)
                )));
            }
            let sql = create_slot_sql(slot, "nothing", two_phase, failover);
            self.create_slot(slot, &sql).await?;
            tracing::info!(slot, "created logical replication slot (pgoutput)");
            return Ok(());
        }
        let slot_type = r.first("slot_type").unwrap_or_default();
        let plugin = r.first("plugin").unwrap_or_default();
        let slot_db = r.first("database").unwrap_or_default();
        if slot_type != "logical" || plugin != "pgoutput" {
            return Err(Error::definite(format!(
                "replication slot {slot:?} on the source is a {slot_type} slot with plugin {plugin:?}; pgapply needs a logical slot using pgoutput: give another --slot, or drop this one (SELECT pg_drop_replication_slot({})) if nothing else uses it and run with --create-slot",
                quote_literal(slot)
            )));
        }
        if slot_db != database {
            return Err(Error::definite(format!(
                "replication slot {slot:?} belongs to database {slot_db:?}, but the source connection is to database {database:?}: connect --source to dbname={slot_db}, or give another --slot for {database:?}"
            )));
        }
        // Invalidated (13+: WAL it needed was removed, max_slot_wal_keep_size; 16+: conflicts on
        // a standby; 17+: the reason named): START_REPLICATION would fail with less to go on.
        // (Columns read through to_jsonb, as they differ by version.)
        let sql = format!(
            "SELECT coalesce(to_jsonb(s) ->> 'invalidation_reason', CASE WHEN to_jsonb(s) ->> 'wal_status' = 'lost' THEN 'wal_removed' WHEN to_jsonb(s) ->> 'conflicting' = 'true' THEN 'conflict on a standby' END) AS invalidated \
             FROM pg_catalog.pg_replication_slots s WHERE slot_name = {}",
            quote_literal(slot)
        );
        let invalid = self.conn.simple_query(&sql).await?;
        if let Some(reason) = invalid.first("invalidated").filter(|r| !r.is_empty()) {
            return Err(Error::definite(format!(
                "replication slot {slot:?} on the source {} was invalidated ({reason}{}): the changes it still held for the target cannot be read any more. Drop it (SELECT pg_drop_replication_slot('{}')) and start over with --copy-data --truncate-target",
                self.conn.endpoint,
                if reason == "wal_removed" { ": the source removed WAL the slot needed, see max_slot_wal_keep_size" } else { "" },
                slot.replace('\'', "''")
            )));
        }
        if let Some(problem) = two_phase_slot_problem(
            slot,
            r.first("two_phase") == Some("true"),
            two_phase,
            parallel,
        ) {
            return Err(Error::definite(problem));
        }
        if failover && r.first("failover") != Some("true") {
            self.check_failover(failover, r.first("two_phase") == Some("true"))?;
            let sql = format!(
                "ALTER_REPLICATION_SLOT {} (FAILOVER true)",
                quote_ident(slot)
            );
            self.conn.simple_query(&sql).await.map_err(|e| {
                e.context(format!(
                    "making replication slot {slot:?} a failover slot on the source"
                ))
            })?;
            tracing::info!(slot, "made the replication slot a failover slot");
        }
        Ok(())
    }

    /// Whether the slot may be a failover slot here (`two_phase`: the slot is, or is to be, a
    /// two-phase one).
    fn check_failover(&self, failover: bool, two_phase: bool) -> Result<()> {
        let version = self.conn.server_version;
        if failover && version < 170000 {
            return Err(Error::definite(format!(
                "--failover-slot needs a PostgreSQL 17 or later source; this source runs PostgreSQL {}: leave it out",
                version / 10000
            )));
        }
        if failover && two_phase && version < 180000 {
            return Err(Error::definite(
                "PostgreSQL 17 cannot make a two-phase slot a failover slot (18 can): use --failover-slot or --two-phase, not both",
            ));
        }
        Ok(())
    }

    /// The slot's confirmed flush position, if the slot exists (0/0 if it has none yet).
    pub async fn slot_confirmed(&mut self, slot: &str) -> Result<Option<Lsn>> {
        let sql = format!(
            "SELECT coalesce(confirmed_flush_lsn, '0/0')::text AS confirmed FROM pg_catalog.pg_replication_slots WHERE slot_name = {}",
            quote_literal(slot)
        );
        let r = self.conn.simple_query(&sql).await?;
        Ok(r.first("confirmed")
            .map(|t| t.parse::<Lsn>().unwrap_or(Lsn::INVALID)))
    }

    /// The source's `wal_sender_timeout`, in milliseconds (0: off).
    pub async fn wal_sender_timeout_ms(&mut self) -> Result<u64> {
        let r = self
            .conn
            .simple_query(
                "SELECT setting AS ms FROM pg_catalog.pg_settings WHERE name = 'wal_sender_timeout'",
            )
            .await?;
        Ok(r.first("ms").and_then(|t| t.parse().ok()).unwrap_or(0))
    }

    /// Where each earlier timeline in the history of `timeline` ended: (timeline, switch point),
    /// from the source's TIMELINE_HISTORY (timeline 1 has no history).
    pub async fn timeline_history(&mut self, timeline: u32) -> Result<Vec<(u32, Lsn)>> {
        if timeline <= 1 {
            return Ok(Vec::new());
        }
        let r = self
            .conn
            .simple_query(&format!("TIMELINE_HISTORY {timeline}"))
            .await?;
        let content = r.first("content").ok_or_else(|| {
            Error::definite(format!(
                "TIMELINE_HISTORY {timeline} on the source returned no content"
            ))
        })?;
        parse_timeline_history(content).map_err(|line| {
            Error::definite(format!(
                "the source's history of timeline {timeline} has a line pgapply cannot read: {line:?}"
            ))
        })
    }

    /// Whether a 17+ source lets logical replication run ahead of its standbys: its
    /// `synchronized_standby_slots` is empty.
    pub async fn standby_slots_unset(&mut self) -> Result<bool> {
        if self.conn.server_version < 170000 {
            return Ok(false);
        }
        let r = self
            .conn
            .simple_query(
                "SELECT pg_catalog.current_setting('synchronized_standby_slots') AS slots",
            )
            .await?;
        Ok(r.first("slots").is_some_and(str::is_empty))
    }

    /// Whether the source is a standby (logical decoding from a standby is 16+).
    pub async fn in_recovery(&mut self) -> Result<bool> {
        let r = self
            .conn
            .simple_query("SELECT pg_catalog.pg_is_in_recovery()::text AS recovery")
            .await?;
        Ok(r.first("recovery") == Some("true"))
    }

    pub async fn slot_exists(&mut self, slot: &str) -> Result<bool> {
        let sql = format!(
            "SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = {}",
            quote_literal(slot)
        );
        Ok(!self.conn.simple_query(&sql).await?.rows.is_empty())
    }

    /// Refuses a logical slot of another database than the connection's (`database`): before
    /// any other refusal, whose advice (drop the slot, forget its state) would be wrong then.
    pub async fn refuse_another_databases_slot(
        &mut self,
        slot: &str,
        database: &str,
    ) -> Result<()> {
        let sql = format!(
            "SELECT coalesce(database::text, '') AS database FROM pg_catalog.pg_replication_slots WHERE slot_name = {} AND slot_type = 'logical'",
            quote_literal(slot)
        );
        let r = self.conn.simple_query(&sql).await?;
        match r.first("database") {
            Some(slot_db) if slot_db != database => Err(Error::definite(format!(
                "replication slot {slot:?} belongs to database {slot_db:?}, but the source connection is to database {database:?}: connect --source to dbname={slot_db}, or give another --slot for {database:?}"
            ))),
            _ => Ok(()),
        }
    }

    /// The process streaming from the slot now, if one is (another pgapply, or a walsender of
    /// a run that just ended and has not noticed yet).
    pub async fn slot_active_pid(&mut self, slot: &str) -> Result<Option<i32>> {
        let sql = format!(
            "SELECT active_pid::text AS pid FROM pg_catalog.pg_replication_slots WHERE slot_name = {} AND active",
            quote_literal(slot)
        );
        let r = self.conn.simple_query(&sql).await?;
        Ok(r.first("pid").and_then(|p| p.parse().ok()))
    }

    /// The slot's walsender, if one streams it, after ending it if it is this process's own
    /// earlier connection that the network cut off without a word (the source would keep it
    /// until wal_sender_timeout, for ever when that is 0, and the slot with it): then `None`
    /// once it is gone.
    pub async fn slot_holder(&mut self, slot: &str) -> Result<Option<i32>> {
        let Some(pid) = self.slot_active_pid(slot).await? else {
            return Ok(None);
        };
        let Some(at) = connection::let_go_at(pid) else {
            // The walsender of a run that has just ended goes away within moments (its client's
            // close seen): waited for briefly, rather than failing this start for a retry.
            return self.until_released(slot, pid, 20).await;
        };
        // (Started before this process let it go: not another process that took its pid.)
        let sql = format!(
            "SELECT pg_catalog.pg_terminate_backend(pid)::text AS ended FROM pg_catalog.pg_stat_activity \
             WHERE pid = {pid} AND backend_start < {}::timestamptz",
            quote_literal(&humantime::format_rfc3339_micros(at).to_string())
        );
        if self.conn.simple_query(&sql).await?.first("ended") != Some("true") {
            return Ok(Some(pid));
        }
        tracing::info!(pid, slot, "ended this process's earlier walsender on the source, whose connection was cut off without the source noticing (it held the slot)");
        self.until_released(slot, pid, 50).await
    }

    /// The slot's walsender once walsender `pid` has let it go, or `pid` after `tries` looks
    /// 100 ms apart.
    async fn until_released(&mut self, slot: &str, pid: i32, tries: u32) -> Result<Option<i32>> {
        for _ in 0..tries {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            let holder = self.slot_active_pid(slot).await?;
            if holder != Some(pid) {
                return Ok(holder);
            }
        }
        Ok(Some(pid))
    }

    /// Whether the slot exists and decodes two-phase transactions (15+; made so by a
    /// `--two-phase` run). PostgreSQL keeps that once enabled, whatever a start asks for.
    pub async fn slot_is_two_phase(&mut self, slot: &str) -> Result<bool> {
        let sql = format!(
            "SELECT coalesce(to_jsonb(s) ->> 'two_phase', 'false') AS two_phase FROM pg_catalog.pg_replication_slots s WHERE slot_name = {}",
            quote_literal(slot)
        );
        Ok(self.conn.simple_query(&sql).await?.first("two_phase") == Some("true"))
    }

    /// Creates the slot and exports the snapshot of its consistent point. The snapshot stays
    /// importable (SET TRANSACTION SNAPSHOT) until the next command on this session.
    pub async fn create_slot_with_snapshot(
        &mut self,
        slot: &str,
        two_phase: bool,
        failover: bool,
    ) -> Result<ExportedSnapshot> {
        self.check_failover(failover, two_phase)?;
        let sql = create_slot_sql(slot, "export", two_phase, failover);
        self.exported_snapshot(slot, &sql).await
    }

    /// A temporary slot (gone with this session) for its exported snapshot and consistent point
    /// only: the copy of tables published after the initial copy (its changes are never read).
    pub async fn create_temporary_slot_with_snapshot(
        &mut self,
        slot: &str,
    ) -> Result<ExportedSnapshot> {
        let sql = format!(
            "CREATE_REPLICATION_SLOT {} TEMPORARY LOGICAL pgoutput EXPORT_SNAPSHOT",
            quote_ident(slot)
        );
        self.exported_snapshot(slot, &sql).await.map_err(|e| {
            if e.sqlstate() == Some("53400") {
                e.context_after("copying tables published after the initial copy takes one more replication slot on the source for as long as the copy runs (a temporary one): raise max_replication_slots there, or drop a slot nothing uses")
            } else {
                e
            }
        })
    }

    async fn exported_snapshot(&mut self, slot: &str, sql: &str) -> Result<ExportedSnapshot> {
        let r = self.create_slot(slot, sql).await?;
        let consistent_point = r
            .first("consistent_point")
            .unwrap_or_default()
            .parse()
            .map_err(|e| {
                Error::definite(format!(
                    "CREATE_REPLICATION_SLOT returned a bad consistent point: {e}"
                ))
            })?;
        let snapshot_name = r
            .first("snapshot_name")
            .filter(|s| !s.is_empty())
            .ok_or_else(|| Error::definite("CREATE_REPLICATION_SLOT exported no snapshot"))?
            .to_owned();
        tracing::info!(slot, %consistent_point, snapshot = %snapshot_name, "created logical replication slot with an exported snapshot");
        Ok(ExportedSnapshot {
            consistent_point,
            snapshot_name,
        })
    }

    /// Runs a CREATE_REPLICATION_SLOT. A logical slot starts where no transaction is open on
    /// the source, so the command waits for every one running (a session idle in a
    /// transaction, a forgotten prepared one): said while it waits, not left to look like a hang.
    async fn create_slot(&mut self, slot: &str, sql: &str) -> Result<QueryResult> {
        let started = std::time::Instant::now();
        let create = self.conn.simple_query(sql);
        tokio::pin!(create);
        let mut every = tokio::time::interval_at(
            tokio::time::Instant::now() + std::time::Duration::from_secs(5),
            std::time::Duration::from_secs(30),
        );
        loop {
            tokio::select! {
                r = &mut create => {
                    return r.map_err(|e| {
                        let e = e.context(format!("creating replication slot {slot:?} on the source"));
                        if e.message().contains("wal_level") {
                            e.context_after("set wal_level = logical in the source's postgresql.conf (ALTER SYSTEM SET wal_level = logical) and restart it")
                        } else {
                            e
                        }
                    });
                }
                _ = every.tick() => tracing::warn!(
                    slot,
                    waited = %humantime::format_duration(std::time::Duration::from_secs(started.elapsed().as_secs())),
                    "creating the replication slot waits for the transactions open on the source to end (a logical slot starts where none is open): look for old ones in pg_stat_activity (backend_xid, xact_start; sessions idle in transaction) and pg_prepared_xacts, and end them"
                ),
            }
        }
    }

    pub async fn drop_slot(&mut self, slot: &str) -> Result<()> {
        let sql = format!("DROP_REPLICATION_SLOT {}", quote_ident(slot));
        self.conn
            .simple_query(&sql)
            .await
            .map_err(|e| e.context(format!("dropping replication slot {slot:?} on the source")))?;
        tracing::info!(slot, "dropped replication slot");
        Ok(())
    }

    /// Fails naming every publication that does not exist.
    pub async fn check_publications(&mut self, publications: &[String]) -> Result<()> {
        let list = publications
            .iter()
            .map(|p| quote_literal(p))
            .collect::<Vec<_>>()
            .join(", ");
        let sql =
            format!("SELECT pubname FROM pg_catalog.pg_publication WHERE pubname IN ({list})");
        let r = self.conn.simple_query(&sql).await?;
        let found: Vec<&str> = r
            .rows
            .iter()
            .filter_map(|row| row.first()?.as_deref())
            .collect();
        let missing: Vec<&String> = publications
            .iter()
            .filter(|p| !found.contains(&p.as_str()))
            .collect();
        if !missing.is_empty() {
            return Err(Error::definite(format!(
                "{} on the source {}: create {} with CREATE PUBLICATION, or fix --publication",
                crate::copy::missing_publications(&missing),
                self.conn.endpoint,
                if missing.len() == 1 { "it" } else { "them" }
            )));
        }
        Ok(())
    }

    /// START_REPLICATION; from here on the session only streams.
    pub async fn start(
        mut self,
        slot: &str,
        start: Lsn,
        negotiated: &options::Negotiated,
        publications: &[String],
    ) -> Result<ReplicationStream> {
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {} ({})",
            quote_ident(slot),
            start,
            negotiated.options_sql(publications)
        );
        tracing::debug!(command = %sql, "starting replication");
        self.conn.slot = slot.to_owned();
        self.conn.publications = publications.to_vec();
        self.conn
            .start_copy_both(&sql)
            .await
            .map_err(|e| e.context(format!("starting replication from slot {slot:?}")))?;
        // Measured with bench/run.sh: pausing 1 to 5 ms after a short read lets the walsender
        // send in large writes, and catch-up runs about 10% faster with less CPU on both sides.
        // PGAPPLY_READ_PAUSE_US=0 turns it off (for measuring).
        let pause = std::env::var("PGAPPLY_READ_PAUSE_US")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(2_000);
        self.conn
            .set_read_pause((pause > 0).then(|| std::time::Duration::from_micros(pause)));
        Ok(ReplicationStream {
            conn: self.conn,
            buf: BytesMut::with_capacity(StandbyStatusUpdate::LEN),
        })
    }
}

/// A session in CopyBoth mode.
pub struct ReplicationStream {
    conn: ReplicationConnection,
    buf: BytesMut,
}

impl ReplicationStream {
    /// The next frame from the walsender, or `None` when it ended the stream. Cancel-safe.
    pub async fn next_frame(&mut self) -> Result<Option<ReplicationFrame>> {
        match self.conn.read_copy_data().await? {
            None => Ok(None),
            Some(payload) => ReplicationFrame::parse(payload)
                .map(Some)
                .map_err(|e| Error::definite(format!("source {}: {e}", self.conn.endpoint))),
        }
    }

    /// See `ReplicationConnection::set_pacing`.
    pub fn set_pacing(&mut self, on: bool) {
        self.conn.set_pacing(on);
    }

    /// Whether the next frame is already received (`next_frame` then returns without waiting).
    pub fn has_buffered_frame(&self) -> bool {
        self.conn.has_buffered_copy_data()
    }

    pub async fn send_status(
        &mut self,
        written: Lsn,
        flushed: Lsn,
        reply_requested: bool,
    ) -> Result<()> {
        self.buf.clear();
        StandbyStatusUpdate {
            write: written,
            flush: flushed,
            apply: flushed,
            client_time: PgTimestamp::now(),
            reply_requested,
        }
        .encode(&mut self.buf);
        let payload = self.buf.split().freeze();
        self.conn.send_copy_data(&payload).await
    }

    pub fn endpoint(&self) -> &str {
        &self.conn.endpoint
    }

    pub async fn close(self) {
        self.conn.close().await;
    }
}

/// CREATE_REPLICATION_SLOT for pgoutput with `snapshot` ("export" or "nothing"). The options
/// list is PostgreSQL 15's syntax; older servers know only the keywords, and need them for
/// neither option (both are refused before this on them).
/// Why an existing slot (`slot_two_phase`: it decodes two-phase transactions) cannot serve a run
/// with `two_phase` asked and several apply workers (`parallel`), if it cannot. Shared by the run
/// and `pgapply check`, so both say the same.
pub fn two_phase_slot_problem(
    slot: &str,
    slot_two_phase: bool,
    two_phase: bool,
    parallel: bool,
) -> Option<String> {
    // A two-phase slot goes on sending prepared transactions whatever is asked at start
    // (PostgreSQL keeps a slot's two-phase decoding once enabled), and those are applied by
    // one connection only.
    if parallel && slot_two_phase {
        return Some(format!(
            "replication slot {slot:?} was created with two-phase support (by an earlier --two-phase run), so the source sends prepared transactions through it, which --apply-workers above 1 cannot apply in order: use --apply-workers 1, or drop the slot and start over with a new one (--copy-data --truncate-target)"
        ));
    }
    if two_phase && !slot_two_phase {
        return Some(format!(
            "replication slot {slot:?} was created without two-phase support, which --two-phase needs (pgapply does not change an existing slot to it): run without --two-phase, or start over with a new slot made by a --two-phase run and the initial copy (give another --slot with --copy-data --truncate-target, or drop this one: the changes it holds go with it)"
        ));
    }
    None
}

fn create_slot_sql(slot: &str, snapshot: &str, two_phase: bool, failover: bool) -> String {
    if !two_phase && !failover {
        let keyword = if snapshot == "export" {
            "EXPORT_SNAPSHOT"
        } else {
            "NOEXPORT_SNAPSHOT"
        };
        return format!(
            "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput {keyword}",
            quote_ident(slot)
        );
    }
    let mut options = vec![format!("SNAPSHOT '{snapshot}'")];
    if two_phase {
        options.push("TWO_PHASE".into());
    }
    if failover {
        options.push("FAILOVER".into());
    }
    format!(
        "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput ({})",
        quote_ident(slot),
        options.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeline_history_reads_as_where_each_timeline_ended() {
        let history = "1\t0/3B323498\tno recovery target specified\n\n# a comment\n2\t1/A0\tat restore point \"x\"\n";
        assert_eq!(
            parse_timeline_history(history),
            Ok(vec![(1, Lsn(0x3B32_3498)), (2, Lsn(0x1_0000_00A0))])
        );
        assert_eq!(parse_timeline_history(""), Ok(Vec::new()));
        assert_eq!(
            parse_timeline_history("1 nowhere reason"),
            Err("1 nowhere reason".to_owned())
        );
    }
}
