-- Stageline store, PostgreSQL, version 9: the archive tables move on to Parquet (spark_jobs/archive_job.py).
--
-- export_batch: the Parquet export batch a row of an archive table belongs to, once the export job
-- marked it (NULL before). archive_exports: one row per open export batch, so a run killed anywhere
-- resumes that batch instead of picking a new one: 'marked' (rows chosen; Parquet may be partly
-- written: write it again, overwriting exactly its partitions), then 'written' (Parquet verified
-- to hold `row_count` rows: only delete the marked rows). The row goes when its rows are gone.
-- archive_events.connection: the event's message's inbound connection, kept when the event is
-- archived (its inbound row may have left the store by the time the event goes to Parquet).
ALTER TABLE archive_events ADD COLUMN connection text;
ALTER TABLE archive_inbound ADD COLUMN export_batch text;
CREATE INDEX archive_inbound_export ON archive_inbound (export_batch) WHERE export_batch IS NOT NULL;
ALTER TABLE archive_routed ADD COLUMN export_batch text;
CREATE INDEX archive_routed_export ON archive_routed (export_batch) WHERE export_batch IS NOT NULL;
ALTER TABLE archive_outbound ADD COLUMN export_batch text;
CREATE INDEX archive_outbound_export ON archive_outbound (export_batch) WHERE export_batch IS NOT NULL;
ALTER TABLE archive_events ADD COLUMN export_batch text;
CREATE INDEX archive_events_export ON archive_events (export_batch) WHERE export_batch IS NOT NULL;
ALTER TABLE archive_inbound_batches ADD COLUMN export_batch text;
CREATE INDEX archive_inbound_batches_export ON archive_inbound_batches (export_batch) WHERE export_batch IS NOT NULL;

CREATE TABLE archive_exports (
    batch       text        PRIMARY KEY,
    kind        text        NOT NULL,
    row_count   bigint      NOT NULL,
    state       text        NOT NULL DEFAULT 'marked' CHECK (state IN ('marked', 'written')),
    epoch       bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
