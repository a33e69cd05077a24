-- The source timeline the slot's applied position was read on, and where that timeline began (the
-- switch point from its parent; 0/0 for timeline 1). A standby promoted after a failover starts a
-- new timeline that forks from the old one at the switch point: when the target has applied past
-- that point from the old timeline, it holds changes the new primary never had, and the new
-- primary's own transactions between the switch point and that position would be skipped. Two
-- servers promoted from the same parent (without a shared WAL archive) can both take the same
-- timeline number, which only the point where each began tells apart. A run compares them (the
-- source's TIMELINE_HISTORY) before it streams, and records the timeline it streams from. NULL
-- until the slot's next start, and while it streams from a standby (which follows its upstream
-- onto new timelines while it streams).
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS source_timeline bigint;
ALTER TABLE pgapply.progress ADD COLUMN IF NOT EXISTS source_timeline_start pg_lsn;
