-- A table's columns join what each group checks of the tables it writes (pgapply.check_group).
-- A statement's parameters keep the column types they were prepared with: a target column changed
-- while pgapply runs (numeric to integer, say) would take the source's values through the
-- server's assignment cast, which rounds instead of failing. So each group passes what pgapply
-- read of every table it writes, its columns' names, types and type modifiers included, and raises
-- if any of it changed; the run then starts again and prepares its statements anew, and a value
-- that no longer fits fails as it would at a fresh start. (The group's statements hold ROW
-- EXCLUSIVE on the table: a column cannot change under them until the group ends.)
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
                  WHERE i.indrelid = c.oid AND (i.indisunique OR i.indisexclusion)), '-'),
        coalesce((SELECT string_agg(a.attnum::text || ':' || a.atttypid::text || ':' || a.atttypmod::text
                                    || ':' || md5(a.attname::text), ',' ORDER BY a.attnum)
                  FROM pg_catalog.pg_attribute a
                  WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '-'))
    INTO result
    FROM pg_catalog.pg_class c WHERE c.oid = rel;
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
        WHERE pgapply.batching_fingerprint(r.rel) IS DISTINCT FROM r.fingerprint
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'the columns, triggers, rules, constraints or unique indexes of table % changed on the target while pgapply ran', changed::regclass
                USING ERRCODE = 'PGA01';
        END IF;
    END IF;
END $$;
