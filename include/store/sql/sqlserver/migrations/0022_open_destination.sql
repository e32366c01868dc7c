-- Stageline store, SQL Server (T-SQL), version 22: the open routed rows by destination (issue 29;
-- postgres/migrations/0022_open_destination.sql says why). This dialect has had the index since
-- version 13; it is rebuilt with the others' predicate, `destination <> ''` included, so that
-- only route_passthrough_open, which states it, matches the filter — not a claim's held-lane probe,
-- whose status filter alone would imply the old one. It holds open rows only: the rebuild reads
-- the table once but writes only the backlog.
DROP INDEX stage_routed_open_destination ON stage_routed;
GO
CREATE INDEX stage_routed_open_destination ON stage_routed (destination)
    WHERE status IN ('pending', 'in_flight', 'error') AND destination <> '';
