-- The apply session sends a group of source transactions before the previous group's COMMIT is
-- answered (a round trip per group would cost throughput when the target is far away). The later
-- group checks on the server, before it commits, that the earlier one did: that group's position
-- reached the origin's row in pgapply.origin_commit, which an aborted transaction leaves as it
-- was. If not, this raises, the later group is rolled back with it, and nothing commits out of
-- order. The earlier group's own error is the one reported.
CREATE OR REPLACE FUNCTION pgapply.check_committed(origin text, end_lsn pg_lsn)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pgapply.origin_commit w
                   WHERE w.origin_name = origin AND w.end_lsn >= check_committed.end_lsn) THEN
        RAISE EXCEPTION 'the previous group of source transactions (ending at %) did not commit', end_lsn
            USING ERRCODE = '40001';
    END IF;
END $$;
