-- The columns of every table a group writes join what the group checks before it commits
-- (pgapply.check_group). A statement's parameters keep the column types they were prepared with: a
-- target column changed while pgapply runs (numeric to integer, say) would take the source's
-- values through the server's assignment cast, which rounds instead of failing. So each group
-- passes, per table it writes, the column types pgapply read ("c|" and, per column in attnum
-- order, "type:typmod,"), and raises PGA03 if they are no longer a prefix of the table's (a column
-- added at the end changes nothing a statement wrote; one dropped or changed does). The run then
-- starts again, reads the table anew and prepares its statements anew, and a value that no longer
-- fits fails as it would at a fresh start. The group's statements hold ROW EXCLUSIVE on the table:
-- no column can change under them until the group ends. (pgapply.batching_fingerprint is left as
-- it was, so that a worker of an older pgapply on the same database keeps working.)
CREATE OR REPLACE FUNCTION pgapply.columns_fingerprint(rel oid)
RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
    result text;
BEGIN
    SELECT 'c|' || coalesce(string_agg(a.atttypid::text || ':' || a.atttypmod::text || ',', '' ORDER BY a.attnum), '')
    INTO result
    FROM pg_catalog.pg_attribute a
    WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped
      AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = rel);
    RETURN result;
END $$;

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
        WHERE r.fingerprint LIKE 'c|%'
          AND pg_catalog.left(coalesce(pgapply.columns_fingerprint(r.rel), ''), pg_catalog.length(r.fingerprint)) <> r.fingerprint
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'the columns of table % changed on the target while pgapply ran', changed::regclass
                USING ERRCODE = 'PGA03';
        END IF;
        SELECT r.rel INTO changed
        FROM unnest(pg_catalog.string_to_array(rels, ',')::oid[],
                    pg_catalog.string_to_array(fingerprints, E'\n')) AS r(rel, fingerprint)
        WHERE r.fingerprint NOT LIKE 'c|%'
          AND pgapply.batching_fingerprint(r.rel) IS DISTINCT FROM r.fingerprint
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'the triggers, rules, constraints or unique indexes of table % changed on the target while pgapply ran', changed::regclass
                USING ERRCODE = 'PGA01';
        END IF;
    END IF;
END $$;

-- The source database a slot replicates from (with source_system_id, the source itself): two
-- workers of one target database apply the same tables only when they read the same source, so
-- a warning about that compares both (fan-in from several sources uses the same publication
-- names everywhere). NULL until the slot's next start.
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS source_database text;
