-- Checks each group of source transactions makes on the target before it commits, in one call
-- (pgapply.check_group), so that they cost one statement per group.
--
-- The stop position. `pgapply cutover` asks a running worker to stop at an end position
-- (pgapply.progress.stop_lsn), which the worker reads every second: a group it commits before it
-- has read the request could hold source transactions committed after the end, applied to what is
-- now the primary. So a group raises if a stop position at or before its last source commit is
-- set; it holds the slot's stop lock (shared) while it looks, and the cutover holds it
-- exclusively from reading the end position on the source until the position is recorded here: a
-- group either committed before the end was read (its transactions come before it), or sees the
-- stop position. Then the group is rolled back, and the worker, started again, applies what comes
-- before the end and stops.
--
-- The tables' shape. A table's UPDATEs are collapsed and sent together within a group only while
-- nothing on the target can see their order (apply::batch): no enabled trigger or rule, no foreign
-- key or exclusion constraint, no inheritance child, no unique index but the key's; and changes to
-- other tables pass held updates only where those tables have no trigger or rule. pgapply reads
-- that when it first meets a table, and someone may add an audit trigger afterwards, while pgapply
-- runs. So the group passes what pgapply read of each table it relied on, and raises if any of it
-- changed. The group's own statements hold ROW EXCLUSIVE on those tables by then, so nothing of it
-- can change until the group ends; a change made before is seen here. Then the group is rolled
-- back and its source transactions applied again one change at a time, the tables read anew.

-- (PL/pgSQL, not SQL: its query's plan is kept for the session; a SQL function's is made anew at
-- every call. Foreign keys to or from the table show as its triggers, exclusion constraints as
-- its indexes. NULL for a table that no longer exists.)
CREATE OR REPLACE FUNCTION pgapply.batching_fingerprint(rel oid)
RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
    result text;
BEGIN
    SELECT concat_ws('|', c.relkind::text, c.relhasrules::text, c.relhassubclass::text,
        coalesce((SELECT string_agg(t.oid::text || ':' || t.tgenabled::text, ',' ORDER BY t.oid)
                  FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid), '-'),
        coalesce((SELECT string_agg(i.indexrelid::text, ',' ORDER BY i.indexrelid)
                  FROM pg_catalog.pg_index i
                  WHERE i.indrelid = c.oid AND (i.indisunique OR i.indisexclusion)), '-'))
    INTO result
    FROM pg_catalog.pg_class c WHERE c.oid = rel;
    RETURN result;
END $$;

-- `commit_lsn`: the group's last source commit (NULL: no stop check). `rels` and `fingerprints`:
-- the tables relied on and what was read of them, comma- and newline-separated.
CREATE OR REPLACE FUNCTION pgapply.check_group(slot text, commit_lsn pg_lsn, rels text, fingerprints text)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    changed oid;
BEGIN
    IF commit_lsn IS NOT NULL THEN
        -- ("pgst" and the slot name's hash, as `pgapply cutover` takes it.)
        PERFORM pg_catalog.pg_advisory_xact_lock_shared(1885827956, pg_catalog.hashtext('pgapply stop ' || slot));
        IF EXISTS (SELECT 1 FROM pgapply.progress p
                   WHERE p.slot_name = slot AND p.stop_lsn IS NOT NULL
                     AND check_group.commit_lsn >= p.stop_lsn) THEN
            RAISE EXCEPTION 'pgapply cutover asked this slot to stop at a position before source commit %', commit_lsn
                USING ERRCODE = 'PGA02';
        END IF;
    END IF;
    IF rels <> '' THEN
        SELECT r.rel INTO changed
        FROM unnest(pg_catalog.string_to_array(rels, ',')::oid[],
                    pg_catalog.string_to_array(fingerprints, E'\n')) AS r(rel, fingerprint)
        WHERE pgapply.batching_fingerprint(r.rel) IS DISTINCT FROM r.fingerprint
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'the triggers, rules, constraints or unique indexes of table % changed on the target while pgapply ran', changed::regclass
                USING ERRCODE = 'PGA01';
        END IF;
    END IF;
END $$;
