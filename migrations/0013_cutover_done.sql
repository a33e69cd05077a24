-- When a cutover of the slot finished (all its steps succeeded). A cutover run again after that,
-- without --again, is refused: by then the applications may write to the target, and draining
-- the source once more would apply the old primary's later writes over theirs.
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS cutover_done_at timestamptz;
