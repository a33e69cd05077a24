-- A table's UPDATEs are collapsed and sent together within a group only while nothing on the
-- target can see their order (apply::batch): no enabled trigger or rule, no foreign key or
-- exclusion constraint, no inheritance child, no unique index but the key's. pgapply reads that
-- when it first meets the table, and someone may add an audit trigger afterwards, while pgapply
-- runs. So a group that sends batched UPDATEs of a table first calls pgapply.check_batching with
-- what pgapply read: it locks the table as the UPDATE would (nothing of that can change until the
-- group ends) and raises if any of it changed since. The group is then rolled back and its source
-- transactions applied again one change at a time, and the table is read anew.
CREATE OR REPLACE FUNCTION pgapply.batching_fingerprint(rel oid)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT concat_ws('|', c.relkind::text, c.relhasrules::text, c.relhassubclass::text,
        coalesce((SELECT string_agg(t.oid::text || ':' || t.tgenabled::text, ',' ORDER BY t.oid)
                  FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid), '-'),
        coalesce((SELECT string_agg(k.oid::text, ',' ORDER BY k.oid)
                  FROM pg_catalog.pg_constraint k
                  WHERE (k.conrelid = c.oid OR k.confrelid = c.oid) AND k.contype IN ('f', 'x')), '-'),
        coalesce((SELECT string_agg(i.indexrelid::text, ',' ORDER BY i.indexrelid)
                  FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisunique), '-'))
    FROM pg_catalog.pg_class c WHERE c.oid = rel
$$;

CREATE OR REPLACE FUNCTION pgapply.check_batching(rel oid, fingerprint text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    -- (Dropped and created again under the same name: another table, read anew.)
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class WHERE oid = rel) THEN
        RAISE EXCEPTION 'table % was dropped on the target while pgapply ran', rel
            USING ERRCODE = 'PGA01';
    END IF;
    -- LOCK needs a table-wide right; a role that may update some columns only goes without the
    -- lock (a trigger created between this check and the UPDATE is then missed).
    IF pg_catalog.has_table_privilege(rel, 'UPDATE') THEN
        EXECUTE format('LOCK TABLE %s IN ROW EXCLUSIVE MODE', rel::regclass);
    END IF;
    IF pgapply.batching_fingerprint(rel) IS DISTINCT FROM fingerprint THEN
        RAISE EXCEPTION 'the triggers, rules, constraints or unique indexes of table % changed on the target while pgapply ran', rel::regclass
            USING ERRCODE = 'PGA01';
    END IF;
END $$;
