-- Stageline store, PostgreSQL, version 13: indexes that keep statements bounded by the rows they
-- touch, not by the table (issue 22; tests/store/test_statement_plans.py reads every statement's
-- plan on a store of a million rows).
--
-- Dead letters, per staged table: what dead_letters (the API and the Airflow view), dead_ids (a
-- requeue) and stage_overview (the leader's stage gauges, every few seconds) read. Without it each
-- read every row of the table. Small: a row enters it once, when it is dead-lettered.
CREATE INDEX IF NOT EXISTS stage_inbound_dead  ON stage_inbound (id)  WHERE status = 'dead';
CREATE INDEX IF NOT EXISTS stage_routed_dead   ON stage_routed (id)   WHERE status = 'dead';
CREATE INDEX IF NOT EXISTS stage_outbound_dead ON stage_outbound (id) WHERE status = 'dead';

-- Archived rows not yet exported to Parquet, by when they were archived: the export's mark takes
-- the oldest (export_mark_*), and in this order reads only the rows it marks. Without it a mark
-- walked the archive table in id order past every row archived too recently, under the write lock.
-- A row leaves the index when it is marked.
CREATE INDEX IF NOT EXISTS archive_inbound_unexported         ON archive_inbound (archived_at)         WHERE export_batch IS NULL;
CREATE INDEX IF NOT EXISTS archive_routed_unexported          ON archive_routed (archived_at)          WHERE export_batch IS NULL;
CREATE INDEX IF NOT EXISTS archive_outbound_unexported        ON archive_outbound (archived_at)        WHERE export_batch IS NULL;
CREATE INDEX IF NOT EXISTS archive_events_unexported          ON archive_events (archived_at)          WHERE export_batch IS NULL;
CREATE INDEX IF NOT EXISTS archive_inbound_batches_unexported ON archive_inbound_batches (archived_at) WHERE export_batch IS NULL;
