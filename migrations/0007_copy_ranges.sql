-- A large table is copied as several page ranges, each in its own target transaction. The table
-- is 'done' when the transaction of its last range commits: each range's transaction counts
-- itself in jobs_done, under the row's lock, and sets 'done' when the count reaches jobs_total.
-- (Counting in the process instead could mark a table done while one of its ranges failed.)
ALTER TABLE pgapply.copy_state
    ADD COLUMN IF NOT EXISTS jobs_total integer NOT NULL DEFAULT 1,
    ADD COLUMN IF NOT EXISTS jobs_done integer NOT NULL DEFAULT 0;
