-- What `pgapply status` shows: written by the running worker every status interval (a heartbeat),
-- not per transaction. Counters accumulate across restarts.
ALTER TABLE pgapply.progress
    ADD COLUMN IF NOT EXISTS state            text,
    ADD COLUMN IF NOT EXISTS pid              integer,
    ADD COLUMN IF NOT EXISTS applied_lsn      pg_lsn,
    ADD COLUMN IF NOT EXISTS received_lsn     pg_lsn,
    ADD COLUMN IF NOT EXISTS last_commit_time timestamptz,
    ADD COLUMN IF NOT EXISTS lag_seconds      double precision,
    ADD COLUMN IF NOT EXISTS transactions     bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS inserts          bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS updates          bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS deletes          bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS truncates        bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS conflicts        jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN IF NOT EXISTS heartbeat_at     timestamptz;
