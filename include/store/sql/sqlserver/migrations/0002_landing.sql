-- Stageline store, SQL Server (T-SQL), version 2: the route stage's landing area.
-- Spark's JDBC writer (jTDS) appends one run's results here (keyed by run_id); the fenced finalize
-- transaction moves them into stage_routed and deletes them. Scratch data: a run that dies before its
-- finalize leaves rows that the next finalize of the same sources removes. No timestamps.
-- Sizes and collations as in stage_routed (version 1), so the finalize compares without conversion.
CREATE TABLE landing_routed (
    run_id       nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    source_id    bigint        NOT NULL,
    destination  nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    route_name   nvarchar(200) NULL,
    lane_key     nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    status       nvarchar(16)  NOT NULL,
    payload      nvarchar(max) NOT NULL,
    message_id   nvarchar(450) COLLATE Latin1_General_100_BIN2 NOT NULL,
    control_id   nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL
);
GO

CREATE INDEX landing_routed_run    ON landing_routed (run_id);
CREATE INDEX landing_routed_source ON landing_routed (source_id);
