-- Initial copy (`pgapply run --copy-data`): one row per published table and slot.
-- state: 'pending' -> 'copying' -> 'done'. An interrupted copy (any row not 'done') is started over
-- from scratch on the next `--copy-data` run, because the exported snapshot it used is gone.
CREATE TABLE IF NOT EXISTS pgapply.copy_state (
    slot_name    text NOT NULL,
    schema_name  text NOT NULL,
    table_name   text NOT NULL,
    state        text NOT NULL CHECK (state IN ('pending', 'copying', 'done')),
    rows_copied  bigint NOT NULL DEFAULT 0,
    bytes_copied bigint NOT NULL DEFAULT 0,
    started_at   timestamptz,
    finished_at  timestamptz,
    PRIMARY KEY (slot_name, schema_name, table_name)
);
