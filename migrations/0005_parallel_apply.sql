-- Parallel apply (`--apply-workers`): makes a worker's transaction wait, on the server, until an
-- earlier source transaction applied by another worker has committed. That transaction holds the
-- advisory lock (key, seq) from its BEGIN to its end, and its worker's replication origin reaches
-- end_lsn when it commits. If it has not taken its lock yet, the wait polls every millisecond;
-- if it ended without committing, or does not commit within timeout_ms, this fails (SQLSTATE
-- 40001: pgapply restarts and applies those transactions one at a time).
CREATE OR REPLACE FUNCTION pgapply.wait_for_commit(key integer, seq integer, origin text,
                                                   end_lsn pg_lsn, timeout_ms integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    started timestamptz := clock_timestamp();
BEGIN
    LOOP
        IF pg_catalog.pg_replication_origin_progress(origin, false) >= end_lsn THEN
            RETURN;
        END IF;
        -- Held while that transaction runs: returns once it has ended (or before it began).
        PERFORM pg_catalog.pg_advisory_lock_shared(key, seq);
        PERFORM pg_catalog.pg_advisory_unlock_shared(key, seq);
        IF pg_catalog.pg_replication_origin_progress(origin, false) >= end_lsn THEN
            RETURN;
        END IF;
        IF clock_timestamp() - started > timeout_ms * interval '1 millisecond' THEN
            RAISE EXCEPTION 'the source transaction ending at % (parallel apply turn %) did not commit within % ms', end_lsn, seq, timeout_ms
                USING ERRCODE = '40001';
        END IF;
        PERFORM pg_catalog.pg_sleep(0.001);
    END LOOP;
END
$$;
