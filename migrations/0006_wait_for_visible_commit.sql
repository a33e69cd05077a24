-- Parallel apply: `pgapply.wait_for_commit` returned as soon as the awaited worker's replication
-- origin reached end_lsn. The origin moves while the commit record is written, a moment before
-- the transaction becomes visible to other sessions; a waiting transaction whose next statement
-- took its snapshot in that moment did not see the rows the awaited one wrote (an UPDATE of a row
-- it had inserted found nothing). Now the wait also takes the awaited transaction's lock (key,
-- seq), which it holds until after its commit is visible, before it returns.
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
