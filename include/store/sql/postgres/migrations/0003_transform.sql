-- Stageline store, PostgreSQL, version 3: the transform stage's landing area, the lookup tables, a slimmer route landing.
--
-- landing_outbound: Spark's JDBC writer appends one transform run's results here (keyed by run_id);
-- the fenced finalize moves them into stage_outbound and deletes them. payload NULL means the
-- message could not be transformed: the finalize dead-letters its routed row instead.
-- lookup_entries: the code tables `map` rules translate through, one row per (table, code),
-- managed with `stageline lookups` and read by each transform run.

-- landing_routed, redone: the route stage lands only its decision (source, destination, route,
-- status); the finalize takes payload, ids and lane from the inbound row itself, so no message body
-- travels through Spark's JDBC writer twice. Scratch data: dropping it loses nothing durable.
DROP TABLE landing_routed;
CREATE TABLE landing_routed (
    run_id       text   NOT NULL,
    source_id    bigint NOT NULL,
    destination  text,
    route_name   text,
    status       text   NOT NULL
);
CREATE INDEX landing_routed_run    ON landing_routed (run_id);
CREATE INDEX landing_routed_source ON landing_routed (source_id);

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

-- Held lanes: rows in flight or backing off, by lane — what claim_batch probes for every
-- candidate row. Small (only the rows being worked on), unlike the open_lane index.
CREATE INDEX stage_inbound_held_lane  ON stage_inbound (lane_key, id)  WHERE status IN ('in_flight', 'error');
CREATE INDEX stage_routed_held_lane   ON stage_routed (lane_key, id)   WHERE status IN ('in_flight', 'error');
CREATE INDEX stage_outbound_held_lane ON stage_outbound (lane_key, id) WHERE status IN ('in_flight', 'error');
