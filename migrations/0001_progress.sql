-- pgapply's own state on the target. Applied by pgapply at start-up, once, in order; see
-- src/migrations.rs. Every statement is idempotent so a half-applied run can be repeated.

-- Where each slot's stream has been applied up to. With a replication origin the origin holds the
-- authoritative position (written atomically with each commit, no extra row write); this row then
-- records the source's identity and is the fallback position store for roles that may not use
-- replication origins, where it is updated in the same transaction as the changes.
CREATE TABLE IF NOT EXISTS pgapply.progress (
    slot_name        text PRIMARY KEY,
    source_system_id text,
    lsn              pg_lsn,
    commit_time      timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
