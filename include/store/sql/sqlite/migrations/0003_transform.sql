-- Stageline store, SQLite, version 3: the transform stage's landing area, the lookup tables, a slimmer route landing.
--
-- landing_outbound: Spark's JDBC writer appends one transform run's results here (keyed by run_id;
-- it cannot create tables on SQLite); the fenced finalize moves them into stage_outbound and deletes
-- them. payload NULL means the message could not be transformed: the finalize dead-letters its
-- routed row instead.
-- lookup_entries: the code tables `map` rules translate through, one row per (table, code),
-- managed with `stageline lookups` and read by each transform run.

-- landing_routed, redone: the route stage lands only its decision (source, destination, route,
-- status); the finalize takes payload, ids and lane from the inbound row itself, so no message body
-- travels through Spark's JDBC writer twice. Scratch data: dropping it loses nothing durable.
DROP TABLE landing_routed;
CREATE TABLE landing_routed (
    run_id       TEXT    NOT NULL,
    source_id    INTEGER NOT NULL,
    destination  TEXT,
    route_name   TEXT,
    status       TEXT    NOT NULL
);
CREATE INDEX landing_routed_run    ON landing_routed (run_id);
CREATE INDEX landing_routed_source ON landing_routed (source_id);

CREATE TABLE landing_outbound (
    run_id           TEXT    NOT NULL,
    source_id        INTEGER NOT NULL,
    routed_id        INTEGER NOT NULL,
    destination      TEXT    NOT NULL,
    content_type     TEXT    NOT NULL,
    lane_key         TEXT    NOT NULL,
    payload          TEXT,
    message_id       TEXT    NOT NULL,
    control_id       TEXT
);
CREATE INDEX landing_outbound_run    ON landing_outbound (run_id);
CREATE INDEX landing_outbound_routed ON landing_outbound (routed_id);

CREATE TABLE lookup_entries (
    table_name  TEXT NOT NULL,
    code        TEXT NOT NULL,
    value       TEXT NOT NULL,
    updated_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    UNIQUE (table_name, code)
);

-- Held lanes: rows in flight or backing off, by lane — what claim_batch probes for every
-- candidate row. Small (only the rows being worked on), unlike the open_lane index.
CREATE INDEX stage_inbound_held_lane  ON stage_inbound (lane_key, id)  WHERE status IN ('in_flight', 'error');
CREATE INDEX stage_routed_held_lane   ON stage_routed (lane_key, id)   WHERE status IN ('in_flight', 'error');
CREATE INDEX stage_outbound_held_lane ON stage_outbound (lane_key, id) WHERE status IN ('in_flight', 'error');
