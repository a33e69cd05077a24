-- Whether a transaction committed was read from replication origins: by parallel workers waiting
-- for an earlier worker's transaction, and by a new run for where to resume. PostgreSQL 16 and
-- later also move an origin when a transaction that had its position set aborts, so a
-- transaction whose COMMIT failed looked committed. Each apply session now also writes its
-- position here, inside the transaction it applies (an aborted one leaves no trace): parallel
-- workers wait for this row, and a new run moves an origin that is ahead of its row back to it.
CREATE TABLE IF NOT EXISTS pgapply.origin_commit (
    origin_name text PRIMARY KEY,
    end_lsn pg_lsn NOT NULL
);

CREATE OR REPLACE FUNCTION pgapply.wait_for_commit(key integer, seq integer, origin text,
                                                   end_lsn pg_lsn, timeout_ms integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    started timestamptz := clock_timestamp();
    seen_held boolean := false;
    progress pg_lsn;
    last_progress pg_lsn;
BEGIN
    LOOP
        SELECT w.end_lsn INTO progress FROM pgapply.origin_commit w WHERE w.origin_name = origin;
        IF progress >= end_lsn THEN
            -- Committed; once its lock is free, the commit is visible too.
            PERFORM pg_catalog.pg_advisory_lock_shared(key, seq);
            PERFORM pg_catalog.pg_advisory_unlock_shared(key, seq);
            RETURN;
        END IF;
        IF progress IS DISTINCT FROM last_progress THEN
            -- Its worker is moving: the time allowed counts from here.
            last_progress := progress;
            started := clock_timestamp();
        END IF;
        IF pg_catalog.pg_try_advisory_lock_shared(key, seq) THEN
            -- Not held: not begun yet, or ended (and then visible: the lock outlives neither).
            PERFORM pg_catalog.pg_advisory_unlock_shared(key, seq);
            SELECT w.end_lsn INTO progress FROM pgapply.origin_commit w WHERE w.origin_name = origin;
            IF progress >= end_lsn THEN
                RETURN;
            END IF;
            IF seen_held OR clock_timestamp() - started >= timeout_ms * interval '1 millisecond' THEN
                RAISE EXCEPTION 'the source transaction ending at % (parallel apply turn %) did not commit', end_lsn, seq
                    USING ERRCODE = '40001';
            END IF;
            PERFORM pg_catalog.pg_sleep(0.001);
        ELSE
            -- Running: wait for its end.
            seen_held := true;
            PERFORM pg_catalog.pg_advisory_lock_shared(key, seq);
            PERFORM pg_catalog.pg_advisory_unlock_shared(key, seq);
        END IF;
    END LOOP;
END
$$;
