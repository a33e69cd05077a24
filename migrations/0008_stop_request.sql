-- `pgapply cutover` asks the running worker to stop at its end position by writing it here; the
-- worker reads it every second, stops like `--endpos` once everything committed before it is
-- applied, and clears it.
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS stop_lsn pg_lsn;
