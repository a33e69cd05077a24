-- The highest position pgapply has reported to the source as flushed beyond what it applied (the
-- WAL end of an idle source's keepalive), recorded before it is reported. At start, a slot whose
-- confirmed position is past both this and the applied position lost changes the target never
-- got (a target restored from an older backup, a slot made again, another consumer): refused.
-- NULL (a row from before this column): the next start takes the slot's position once.
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS reported_lsn pg_lsn;
ALTER TABLE pgapply.progress ALTER COLUMN reported_lsn SET DEFAULT '0/0';
