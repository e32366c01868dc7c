-- Stageline store, SQL Server (T-SQL), version 3: the transform stage's landing area and the lookup
-- tables.
--
-- landing_outbound: Spark's JDBC writer appends one transform run's results here (keyed by run_id);
-- the fenced finalize moves them into stage_outbound and deletes them. payload NULL means the
-- message could not be transformed: the finalize dead-letters its routed row instead. Sizes and
-- collations as in stage_outbound (version 1), so the finalize compares without conversion.
-- lookup_entries: the code tables `map` rules translate through, one row per (table, code).
-- landing_routed, redone: the route stage lands only its decision (source, destination, route,
-- status); the finalize takes payload, ids and lane from the inbound row itself, so no message body
-- travels through Spark's JDBC writer twice. Scratch data: dropping it loses nothing durable.
DROP TABLE landing_routed;
GO

CREATE TABLE landing_routed (
    run_id       nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    source_id    bigint        NOT NULL,
    destination  nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    route_name   nvarchar(200) NULL,
    status       nvarchar(16)  NOT NULL
);
GO

CREATE INDEX landing_routed_run    ON landing_routed (run_id);
CREATE INDEX landing_routed_source ON landing_routed (source_id);
GO

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
GO

-- Held lanes: rows in flight or backing off, by lane — what claim_batch probes for every
-- candidate row. Small (only the rows being worked on), unlike the open_lane index.
CREATE INDEX stage_inbound_held_lane  ON stage_inbound (lane_key, id)  WHERE status IN ('in_flight', 'error');
CREATE INDEX stage_routed_held_lane   ON stage_routed (lane_key, id)   WHERE status IN ('in_flight', 'error');
CREATE INDEX stage_outbound_held_lane ON stage_outbound (lane_key, id) WHERE status IN ('in_flight', 'error');
