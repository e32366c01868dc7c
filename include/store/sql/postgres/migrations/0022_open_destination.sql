-- Stageline store, PostgreSQL, version 22: the open routed rows by destination (issue 29).
--
-- Every route finalize asks whether a pass-through destination still has routed rows open
-- (route_passthrough_open). Through the claimable and in-flight indexes that question read the
-- whole routed backlog whenever the answer was no, which is nearly always: with a million routed
-- rows waiting for the transform stage, 122 ms of every route finalize, and a sequential scan of
-- the table once the backlog is most of it (bench/growth.py, docs/performance.md "Growth"). Here
-- it is one probe a destination. The index holds open rows only, so history does not grow it.
--
-- `destination <> ''` (true of every row) is in the predicate so that only a statement that says
-- so can use the index: with `status IN (...)` alone, a claim's held-lane probe (`status IN
-- ('in_flight', 'error') AND lane_key = ...`) implies the predicate too, and on statistics taken
-- before a backlog arrived the planner chose to walk this index for every candidate — 10 s for a
-- claim of 5,000 rows over 16,000 open ones, where the held-lane index takes milliseconds.
CREATE INDEX IF NOT EXISTS stage_routed_open_destination ON stage_routed (destination)
    WHERE status IN ('pending', 'in_flight', 'error') AND destination <> '';
