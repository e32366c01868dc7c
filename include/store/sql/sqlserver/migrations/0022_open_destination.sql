-- Stageline store, SQL Server (T-SQL), version 22: the open routed rows by destination (issue 29;
-- postgres/migrations/0022_open_destination.sql says why). This dialect has had the index since
-- version 13 (0013_plan_indexes.sql); it is rebuilt here as it was, so that every dialect has a
-- version 22 and the index is defined by the same statement in all three. It holds open rows
-- only: the rebuild reads the table once but writes only the backlog.
DROP INDEX stage_routed_open_destination ON stage_routed;
GO
CREATE INDEX stage_routed_open_destination ON stage_routed (destination) WHERE status IN ('pending', 'in_flight', 'error');
