-- `pgapply cutover` asks a running worker to stop at an end position (pgapply.progress.stop_lsn),
-- which the worker reads every second: a group it commits before it has read the request could
-- hold source transactions committed after the end, applied to what is now the primary. So each
-- group checks, in its own transaction before it commits, that no stop position at or before its
-- last source commit has been set; it holds the slot's stop lock (shared) while it does, and the
-- cutover holds it exclusively from reading the end position on the source until the position
-- is recorded here: a group either committed before the end was read (its transactions come
-- before it), or sees the stop position. If it raises, the group is rolled back, and the worker,
-- started again, applies what comes before the end and stops.
CREATE OR REPLACE FUNCTION pgapply.check_stop(slot text, commit_lsn pg_lsn)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    -- ("pgst" and the slot name's hash, as `pgapply cutover` takes it.)
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(1885827956, pg_catalog.hashtext('pgapply stop ' || slot));
    IF EXISTS (SELECT 1 FROM pgapply.progress p
               WHERE p.slot_name = slot AND p.stop_lsn IS NOT NULL AND check_stop.commit_lsn >= p.stop_lsn) THEN
        RAISE EXCEPTION 'pgapply cutover asked this slot to stop at a position before source commit %', commit_lsn
            USING ERRCODE = 'PGA02';
    END IF;
END $$;
