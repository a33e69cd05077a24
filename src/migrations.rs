//! pgapply's schema on the target (`migrations/*.sql`), applied at start-up.
//!
//! Each migration runs once, in version order, in one transaction holding an advisory lock, so two
//! pgapply processes starting together do not race. Applied versions are recorded in
//! `pgapply.schema_migrations`.

use tokio_postgres::Client;

use crate::error::{Error, Result};

/// (version, name, SQL), in order. New migrations are appended, never edited.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "progress",
        include_str!("../migrations/0001_progress.sql"),
    ),
    (
        2,
        "copy_state",
        include_str!("../migrations/0002_copy_state.sql"),
    ),
    (3, "status", include_str!("../migrations/0003_status.sql")),
    (
        4,
        "conflicts",
        include_str!("../migrations/0004_conflicts.sql"),
    ),
    (
        5,
        "parallel_apply",
        include_str!("../migrations/0005_parallel_apply.sql"),
    ),
    (
        6,
        "wait_for_visible_commit",
        include_str!("../migrations/0006_wait_for_visible_commit.sql"),
    ),
    (
        7,
        "copy_ranges",
        include_str!("../migrations/0007_copy_ranges.sql"),
    ),
    (
        8,
        "stop_request",
        include_str!("../migrations/0008_stop_request.sql"),
    ),
    (
        9,
        "origin_commit",
        include_str!("../migrations/0009_origin_commit.sql"),
    ),
    (
        10,
        "check_committed",
        include_str!("../migrations/0010_check_committed.sql"),
    ),
    (
        11,
        "conflict_occurrences",
        include_str!("../migrations/0011_conflict_occurrences.sql"),
    ),
    (
        12,
        "group_checks",
        include_str!("../migrations/0012_group_checks.sql"),
    ),
    (
        13,
        "cutover_done",
        include_str!("../migrations/0013_cutover_done.sql"),
    ),
    (
        14,
        "last_error",
        include_str!("../migrations/0014_last_error.sql"),
    ),
    (
        15,
        "publications",
        include_str!("../migrations/0015_publications.sql"),
    ),
    (
        16,
        "late_copy",
        include_str!("../migrations/0016_late_copy.sql"),
    ),
    (
        17,
        "reported_lsn",
        include_str!("../migrations/0017_reported_lsn.sql"),
    ),
    (
        18,
        "copy_membership",
        include_str!("../migrations/0018_copy_membership.sql"),
    ),
    (
        19,
        "column_types",
        include_str!("../migrations/0019_column_types.sql"),
    ),
    (
        20,
        "source_timeline",
        include_str!("../migrations/0020_source_timeline.sql"),
    ),
    (
        21,
        "slot_tables",
        include_str!("../migrations/0021_slot_tables.sql"),
    ),
];

/// An arbitrary, fixed advisory lock key: "pgapply" in ASCII.
const LOCK_KEY: i64 = 0x0070_6761_7070_6c79;

pub async fn apply(client: &mut Client) -> Result<()> {
    match apply_migrations(client).await {
        // Another role's schema pgapply: what to grant, not only "permission denied". (No
        // schema yet: the error already says the role needs CREATE on the database.)
        Err(e) if e.sqlstate() == Some("42501") => match other_owner(client).await {
            Some(owner) => Err(e.context_after(format!(
                "schema pgapply (pgapply's state on the target) was made by role {owner}, whose grants this role lacks: have {owner} or a superuser run GRANT USAGE, CREATE ON SCHEMA pgapply TO this role; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA pgapply TO it; GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA pgapply TO it, or give this role a database of its own"
            ))),
            None => Err(e),
        },
        other => other,
    }
}

/// The owner of schema pgapply when it exists and is not this role (quoted as an identifier).
async fn other_owner(client: &Client) -> Option<String> {
    client
        .query_opt(
            "SELECT nspowner::regrole::text FROM pg_catalog.pg_namespace \
             WHERE nspname = 'pgapply' AND nspowner <> (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user)",
            &[],
        )
        .await
        .ok()
        .flatten()
        .map(|r| r.get(0))
}

async fn apply_migrations(client: &mut Client) -> Result<()> {
    let context = |e| Error::postgres("setting up pgapply's schema on the target", e);
    refuse_read_only(client).await?;
    let tx = client.transaction().await.map_err(context)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await
        .map_err(context)?;
    // Created once, by a role that may: a role given rights in an existing schema (or given
    // the schema itself) need not be allowed to create one (CREATE ... IF NOT EXISTS checks
    // that right first).
    let row = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = 'pgapply'), \
                    pg_catalog.to_regclass('pgapply.schema_migrations') IS NOT NULL",
            &[],
        )
        .await
        .map_err(context)?;
    let (schema, table): (bool, bool) = (row.get(0), row.get(1));
    if !table {
        create_schema(&tx, schema).await?;
    }
    let row = tx
        .query_one(
            "SELECT coalesce(max(version), 0) FROM pgapply.schema_migrations",
            &[],
        )
        .await
        .map_err(context)?;
    let current: i32 = row.get(0);
    let mut applied = Vec::new();
    for (version, name, sql) in MIGRATIONS {
        if *version <= current {
            continue;
        }
        tx.batch_execute(sql).await.map_err(|e| {
            Error::postgres(
                format!("applying pgapply migration {version} ({name}) on the target (run pgapply once as the role that owns schema pgapply, or a superuser)"),
                e,
            )
        })?;
        tx.execute(
            "INSERT INTO pgapply.schema_migrations (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await
        .map_err(context)?;
        tracing::debug!(
            version,
            name,
            "applied pgapply schema migration on the target"
        );
        applied.push(*version);
    }
    tx.commit().await.map_err(context)?;
    // One line, not one per migration (a first run applies them all).
    if let (Some(first), Some(last)) = (applied.first(), applied.last()) {
        tracing::info!(
            from = first,
            to = last,
            "applied pgapply's schema migrations on the target (its own state, schema pgapply)"
        );
    }
    Ok(())
}

/// A target that cannot take writes, named with its cause before any write fails with a bare
/// "read-only transaction": a standby, or sessions read-only by default (as `pgapply cutover
/// --freeze-writes` leaves the roles it froze, on the old primary a reverse run writes into).
pub async fn refuse_read_only(client: &Client) -> Result<()> {
    let row = client
        .query_one(
            "SELECT pg_catalog.pg_is_in_recovery(), \
                    pg_catalog.current_setting('default_transaction_read_only') = 'on', \
                    current_user::text, current_database()::text, \
                    (SELECT source FROM pg_catalog.pg_settings WHERE name = 'default_transaction_read_only')",
            &[],
        )
        .await
        .map_err(|e| Error::postgres("reading whether the target takes writes", e))?;
    let (standby, read_only, role, database): (bool, bool, String, String) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    // Where the session's value comes from: "database user" (ALTER ROLE .. IN DATABASE),
    // "user", "database", "client" (the connection's options), else the server's configuration.
    let source: Option<String> = row.get(4);
    if standby {
        return Err(Error::definite(
            "the target is a standby in recovery, which takes no writes: point --target at the primary",
        ));
    }
    if read_only {
        let role = crate::sql::quote_ident(&role);
        let database = crate::sql::quote_ident(&database);
        // Where it is set, and how to undo it there (in a read-write transaction: the session
        // running it may be read-only by the same setting).
        let (where_, undo) = match source.as_deref() {
            Some("database user") => (
                format!("for role {role} in database {database}, as pgapply cutover --freeze-writes does"),
                format!("BEGIN READ WRITE; ALTER ROLE {role} IN DATABASE {database} RESET default_transaction_read_only; COMMIT;"),
            ),
            Some("user") => (
                format!("for role {role}"),
                format!("BEGIN READ WRITE; ALTER ROLE {role} RESET default_transaction_read_only; COMMIT;"),
            ),
            Some("database") => (
                format!("for database {database}"),
                format!("BEGIN READ WRITE; ALTER DATABASE {database} RESET default_transaction_read_only; COMMIT;"),
            ),
            Some("client") => (
                "by the connection (options in --target)".to_owned(),
                "leave it out of --target".to_owned(),
            ),
            _ => (
                "in the server's configuration (postgresql.conf or ALTER SYSTEM)".to_owned(),
                "change it there and reload the server (SELECT pg_reload_conf())".to_owned(),
            ),
        };
        // Another role helps only where the setting is the role's own.
        let how = if matches!(source.as_deref(), Some("database user" | "user")) {
            "connect as a role that writes, or "
        } else {
            ""
        };
        return Err(Error::definite(format!(
            "the target's sessions are read-only by default (default_transaction_read_only = on, set {where_}): {how}undo it ({undo}), then start pgapply again"
        )));
    }
    Ok(())
}

async fn create_schema(tx: &tokio_postgres::Transaction<'_>, schema_exists: bool) -> Result<()> {
    if !schema_exists {
        tx.batch_execute("SET LOCAL client_min_messages = warning; CREATE SCHEMA IF NOT EXISTS pgapply")
            .await
            .map_err(|e| {
                Error::postgres(
                    "creating schema pgapply on the target (the target role needs CREATE on the database, or create the schema for it)",
                    e,
                )
            })?;
    }
    // (SET LOCAL: without "already exists, skipping" notices when two runs race to create it.)
    tx.batch_execute(
        "SET LOCAL client_min_messages = warning;
         CREATE TABLE IF NOT EXISTS pgapply.schema_migrations (
             version    integer PRIMARY KEY,
             name       text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );",
    )
    .await
    .map_err(|e| {
        Error::postgres(
            "creating pgapply's tables in schema pgapply on the target (the target role needs CREATE on that schema: GRANT CREATE ON SCHEMA pgapply TO ..., or make the role its owner)",
            e,
        )
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_migration_file_is_listed_in_order() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        assert_eq!(files.len(), super::MIGRATIONS.len(), "{files:?}");
        for (i, (version, _, _)) in super::MIGRATIONS.iter().enumerate() {
            assert_eq!(*version as usize, i + 1);
            assert!(
                files[i].starts_with(&format!("{version:04}_")),
                "{}",
                files[i]
            );
        }
    }

    /// The tables left out of replication as pgapply's own are exactly those its migrations make.
    #[test]
    fn own_tables_are_those_the_migrations_make() {
        let source = include_str!("migrations.rs");
        let mut made: Vec<String> = super::MIGRATIONS
            .iter()
            .map(|(_, _, sql)| *sql)
            .chain([source])
            .flat_map(|sql| {
                sql.split("CREATE TABLE IF NOT EXISTS pgapply.")
                    .skip(1)
                    .map(|rest| {
                        rest.chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect::<String>()
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        // (This test's own search text is in the source too.)
        made.retain(|t| !t.is_empty());
        made.sort();
        made.dedup();
        let mut own: Vec<String> = crate::apply::applier::OWN_TABLES
            .iter()
            .map(|t| t.to_string())
            .collect();
        own.sort();
        assert_eq!(made, own);
    }
}
