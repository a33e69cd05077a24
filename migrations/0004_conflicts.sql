-- Conflicts found while applying (PostgreSQL 18's taxonomy) that did not stop pgapply, and
-- transactions skipped on request (`pgapply skip`).
CREATE TABLE IF NOT EXISTS pgapply.conflicts (
    id                 bigserial PRIMARY KEY,
    recorded_at        timestamptz NOT NULL DEFAULT now(),
    slot_name          text NOT NULL,
    relation           text,
    conflict_type      text NOT NULL,
    key                text,
    local_row          jsonb,
    remote_row         jsonb,
    source_lsn         pg_lsn,
    source_commit_time timestamptz,
    policy             text NOT NULL
);

-- `pgapply skip --lsn`: the commit LSN of one source transaction to skip on purpose.
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS skip_lsn pg_lsn;
