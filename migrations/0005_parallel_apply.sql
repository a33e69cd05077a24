-- Parallel apply (`--apply-workers`): makes a worker's transaction wait, on the server, until an
-- earlier source transaction has committed. That transaction holds the advisory lock (key, seq)
-- from its BEGIN to its end, and its worker's replication origin reaches end_lsn when it commits.
-- While the lock has not been taken yet, the wait polls every millisecond. If the transaction
-- ended without committing, or neither it nor its worker's origin moved for timeout_ms (its worker
-- is not getting anywhere), this fails with SQLSTATE 40001,
-- which rolls back the waiting transaction too (pgapply restarts and applies the transactions
-- that were in flight one at a time).
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
        progress := pg_catalog.pg_replication_origin_progress(origin, false);
        IF progress >= end_lsn THEN
            RETURN;
        END IF;
        IF progress IS DISTINCT FROM last_progress THEN
            -- Its worker is moving: the time allowed counts from here.
            last_progress := progress;
            started := clock_timestamp();
        END IF;
        IF pg_catalog.pg_try_advisory_lock_shared(key, seq) THEN
            -- Not held: not begun yet, or ended.
            PERFORM pg_catalog.pg_advisory_unlock_shared(key, seq);
            IF pg_catalog.pg_replication_origin_progress(origin, false) >= end_lsn THEN
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
