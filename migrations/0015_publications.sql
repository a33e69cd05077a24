-- The publications a slot's worker replicates, as its last run gave them: a run with others
-- (a typo, or a changed set) is told which tables it leaves out, and `pgapply cutover` refuses
-- publications other than the worker's (its verify step and sequences follow them).
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS publications text[];
