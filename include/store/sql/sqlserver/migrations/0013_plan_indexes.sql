-- Stageline store, SQL Server (T-SQL), version 13: indexes that keep statements bounded by the rows
-- they touch, not by the table (issue 22; postgres/migrations/0013_plan_indexes.sql says why each
-- exists). A filtered index is matched on the query's literal predicate: the statements that read
-- these name it as written here (status = 'dead'; export_batch IS NULL).
CREATE INDEX stage_inbound_dead  ON stage_inbound (id)  WHERE status = 'dead';
CREATE INDEX stage_routed_dead   ON stage_routed (id)   WHERE status = 'dead';
CREATE INDEX stage_outbound_dead ON stage_outbound (id) WHERE status = 'dead';

CREATE INDEX archive_inbound_unexported         ON archive_inbound (archived_at)         WHERE export_batch IS NULL;
CREATE INDEX archive_routed_unexported          ON archive_routed (archived_at)          WHERE export_batch IS NULL;
CREATE INDEX archive_outbound_unexported        ON archive_outbound (archived_at)        WHERE export_batch IS NULL;
CREATE INDEX archive_events_unexported          ON archive_events (archived_at)          WHERE export_batch IS NULL;
CREATE INDEX archive_inbound_batches_unexported ON archive_inbound_batches (archived_at) WHERE export_batch IS NULL;

-- route_passthrough_open reads the open routed rows of a few destinations in one statement
-- (sqlserver/queries.sql says why not a UNION, as elsewhere).
CREATE INDEX stage_routed_open_destination ON stage_routed (destination) WHERE status IN ('pending', 'in_flight', 'error');
