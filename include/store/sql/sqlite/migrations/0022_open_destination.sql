-- Stageline store, SQLite, version 22: the open routed rows by destination (issue 29;
-- postgres/migrations/0022_open_destination.sql says why, and why `destination <> ''`).
CREATE INDEX IF NOT EXISTS stage_routed_open_destination ON stage_routed (destination)
    WHERE status IN ('pending', 'in_flight', 'error') AND destination <> '';
