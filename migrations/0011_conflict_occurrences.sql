-- How many conflicts a row of pgapply.conflicts stands for. 1 for a conflict recorded with its key
-- and rows; more for the summary of the conflicts that one target transaction met beyond the
-- first ones recorded one by one (a bulk DELETE of rows the target lacks, say), which are counted
-- but not kept, so that memory stays bounded whatever the size of a source transaction.
ALTER TABLE pgapply.conflicts ADD COLUMN IF NOT EXISTS occurrences bigint NOT NULL DEFAULT 1;
