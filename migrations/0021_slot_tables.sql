-- The target tables each slot's stream has written (recorded at its first Relation message of the
-- table in a process). A run with --copy-data --truncate-target into a table another slot streams
-- into (fan-in, a worker started without an initial copy) would delete that worker's rows, which
-- it never sends again: with pgapply.copy_state (the tables another slot's initial copy filled),
-- this is what refuses it. `pgapply forget` deletes a slot's rows.
CREATE TABLE IF NOT EXISTS pgapply.slot_tables (
    slot_name   text NOT NULL,
    schema_name text NOT NULL,
    table_name  text NOT NULL,
    PRIMARY KEY (slot_name, schema_name, table_name)
);
