-- Stageline store, SQL Server (T-SQL), version 3: the transform stage's landing area and the lookup
-- tables.
--
-- landing_outbound: Spark's JDBC writer appends one transform run's results here (keyed by run_id);
-- the fenced finalize moves them into stage_outbound and deletes them. payload NULL means the
-- message could not be transformed: the finalize dead-letters its routed row instead. Sizes and
-- collations as in stage_outbound (version 1), so the finalize compares without conversion.
-- lookup_entries: the code tables `map` rules translate through, one row per (table, code).
CREATE TABLE landing_outbound (
    run_id        nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    source_id     bigint        NOT NULL,
    routed_id     bigint        NOT NULL,
    destination   nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    content_type  nvarchar(200) NOT NULL,
    lane_key      nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    payload       nvarchar(max) NULL,
    message_id    nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    control_id    nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL
);
GO

CREATE INDEX landing_outbound_run    ON landing_outbound (run_id);
CREATE INDEX landing_outbound_routed ON landing_outbound (routed_id);
GO

CREATE TABLE lookup_entries (
    table_name  nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    code        nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    value       nvarchar(1000) NOT NULL,
    updated_at  datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    UNIQUE (table_name, code)
);
