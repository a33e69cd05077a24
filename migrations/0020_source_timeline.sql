-- The source timeline the slot's applied position was read on. A standby promoted after a
-- failover starts a new timeline that forks from the old one at the switch point: when the target
-- has applied past that point from the old timeline, it holds changes the new primary never had,
-- and the new primary's own transactions between the switch point and that position would be
-- skipped. A run compares the two (the source's TIMELINE_HISTORY gives the switch point) before it
-- streams, and records the timeline it streams from. NULL until the slot's next start.
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS source_timeline bigint;
