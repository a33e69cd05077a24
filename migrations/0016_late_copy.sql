-- A table published after the slot's initial copy is copied by a later `run --copy-data`, in the
-- snapshot of a temporary slot of its own: synced_lsn is that slot's consistent point (0/0 until
-- the slot exists). The stream drops the table's changes from source transactions that committed
-- before it (the copied rows hold them) and applies the rest. NULL: part of the initial copy.
ALTER TABLE pgapply.copy_state ADD COLUMN IF NOT EXISTS synced_lsn pg_lsn;
