-- Why each copied table is published, as the source's catalog rows that publish it (a
-- pg_publication_rel row, a pg_publication_namespace row, or a FOR ALL TABLES publication's own
-- row), read at each start. A table taken out of the publication and put back, or whose row
-- filter or column list changed, gets new rows: when none of those recorded is there any more,
-- rows or changes may be missing on the target, and `recopy` says so until a copy is made again
-- (a run with --copy-data) or the user clears it. NULL: not read yet.
ALTER TABLE pgapply.copy_state ADD COLUMN IF NOT EXISTS membership oid[];
ALTER TABLE pgapply.copy_state ADD COLUMN IF NOT EXISTS recopy boolean NOT NULL DEFAULT false;
-- The row filter the table is published with ('' for none), as read at the last start: a filter
-- widened or dropped (another publication, or a schema one, publishing it whole) leaves the
-- recorded rows in place, and rows it now takes were never copied.
ALTER TABLE pgapply.copy_state ADD COLUMN IF NOT EXISTS row_filter text;
-- The source table's oid: a table renamed on the source keeps it, and its copy state follows the
-- new name instead of the table being taken for one published after the copy.
ALTER TABLE pgapply.copy_state ADD COLUMN IF NOT EXISTS source_relid oid;
