-- Parallel apply (`--apply-workers`): makes a worker's transaction wait, on the server, until an
-- earlier source transaction has committed. That transaction holds the advisory lock (key, seq)
-- from its BEGIN to its end, and its worker's replication origin reaches end_lsn when it commits.
-- While the lock has not been taken yet, the wait polls every millisecond. If the transaction
-- ended without committing, or does not commit within timeout_ms, this fails with SQLSTATE 40001,
-- which rolls back the waiting transaction too (pgapply restarts and applies the transactions
-- that were in flight one at a time).
CREATE OR REPLACE FUNCTION pgapply.wait_for_commit(key integer, seq integer, origin text,
                                                   end_lsn pg_lsn, timeout_ms integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    started timestamptz := clock_timestamp();
    seen_held boolean := false;
BEGIN
    LOOP
        IF pg_catalog.pg_replication_origin_progress(origin, false) >= end_lsn THEN
            RETURN;
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
