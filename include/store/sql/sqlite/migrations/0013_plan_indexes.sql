-- Stageline store, SQLite, version 13: indexes that keep statements bounded by the rows they touch,
-- not by the table (issue 22; postgres/migrations/0013_plan_indexes.sql says why each exists).
CREATE INDEX IF NOT EXISTS stage_inbound_dead  ON stage_inbound (id)  WHERE status = 'dead';
CREATE INDEX IF NOT EXISTS stage_routed_dead   ON stage_routed (id)   WHERE status = 'dead';
CREATE INDEX IF NOT EXISTS stage_outbound_dead ON stage_outbound (id) WHERE status = 'dead';

CREATE INDEX IF NOT EXISTS archive_inbound_unexported         ON archive_inbound (archived_at)         WHERE export_batch IS NULL;
CREATE INDEX IF NOT EXISTS archive_routed_unexported          ON archive_routed (archived_at)          WHERE export_batch IS NULL;
CREATE INDEX IF NOT EXISTS archive_outbound_unexported        ON archive_outbound (archived_at)        WHERE export_batch IS NULL;
CREATE INDEX IF NOT EXISTS archive_events_unexported          ON archive_events (archived_at)          WHERE export_batch IS NULL;
CREATE INDEX IF NOT EXISTS archive_inbound_batches_unexported ON archive_inbound_batches (archived_at) WHERE export_batch IS NULL;
