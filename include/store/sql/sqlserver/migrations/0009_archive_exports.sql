-- Stageline store, SQL Server (T-SQL), version 9: the archive tables move on to Parquet (spark_jobs/archive_job.py).
--
-- export_batch: the Parquet export batch a row of an archive table belongs to, once the export job
-- marked it (NULL before). archive_exports: one row per open export batch, so a run killed anywhere
-- resumes that batch instead of picking a new one: 'marked' (rows chosen; Parquet may be partly
-- written: write it again, overwriting exactly its partitions), then 'written' (Parquet verified
-- to hold `row_count` rows: only delete the marked rows). The row goes when its rows are gone.
-- archive_events.connection: the event's message's inbound connection, kept when the event is
-- archived (its inbound row may have left the store by the time the event goes to Parquet).
ALTER TABLE archive_events ADD connection nvarchar(200) NULL;
GO
ALTER TABLE archive_inbound ADD export_batch nvarchar(100) COLLATE Latin1_General_100_BIN2 NULL;
GO

CREATE INDEX archive_inbound_export ON archive_inbound (export_batch) WHERE export_batch IS NOT NULL;
GO
ALTER TABLE archive_routed ADD export_batch nvarchar(100) COLLATE Latin1_General_100_BIN2 NULL;
GO

CREATE INDEX archive_routed_export ON archive_routed (export_batch) WHERE export_batch IS NOT NULL;
GO
ALTER TABLE archive_outbound ADD export_batch nvarchar(100) COLLATE Latin1_General_100_BIN2 NULL;
GO

CREATE INDEX archive_outbound_export ON archive_outbound (export_batch) WHERE export_batch IS NOT NULL;
GO
ALTER TABLE archive_events ADD export_batch nvarchar(100) COLLATE Latin1_General_100_BIN2 NULL;
GO

CREATE INDEX archive_events_export ON archive_events (export_batch) WHERE export_batch IS NOT NULL;
GO
ALTER TABLE archive_inbound_batches ADD export_batch nvarchar(100) COLLATE Latin1_General_100_BIN2 NULL;
GO

CREATE INDEX archive_inbound_batches_export ON archive_inbound_batches (export_batch) WHERE export_batch IS NOT NULL;
GO

CREATE TABLE archive_exports (
    batch       nvarchar(100) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY,
    kind        nvarchar(20)  NOT NULL,
    row_count   bigint        NOT NULL,
    state       nvarchar(10)  NOT NULL DEFAULT 'marked' CHECK (state IN ('marked', 'written')),
    epoch       bigint        NOT NULL,
    created_at  datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
);
