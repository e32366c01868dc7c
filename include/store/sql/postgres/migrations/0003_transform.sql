-- Stageline store, PostgreSQL, version 3: the transform stage's landing area and the lookup tables.
--
-- landing_outbound: Spark's JDBC writer appends one transform run's results here (keyed by run_id);
-- the fenced finalize moves them into stage_outbound and deletes them. payload NULL means the
-- message could not be transformed: the finalize dead-letters its routed row instead.
-- lookup_entries: the code tables `map` rules translate through, one row per (table, code),
-- managed with `stageline lookups` and read by each transform run.

CREATE TABLE landing_outbound (
    run_id           text   NOT NULL,
    source_id        bigint NOT NULL,
    routed_id        bigint NOT NULL,
    destination      text   NOT NULL,
    content_type     text   NOT NULL,
    lane_key         text   NOT NULL,
    payload          text,
    message_id       text   NOT NULL,
    control_id       text
);
CREATE INDEX landing_outbound_run    ON landing_outbound (run_id);
CREATE INDEX landing_outbound_routed ON landing_outbound (routed_id);

CREATE TABLE lookup_entries (
    table_name  text        NOT NULL,
    code        text        NOT NULL,
    value       text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (table_name, code)
);
