-- Stageline store, SQLite, version 2: the route stage's landing area.
-- Spark's JDBC writer appends one run's results here (keyed by run_id); it cannot create tables on
-- SQLite, so the table exists up front. The fenced finalize transaction moves the rows into
-- stage_routed and deletes them. Scratch data: a run that dies before its finalize leaves rows that
-- the next finalize of the same sources removes. No timestamps: nothing decides anything by them.

CREATE TABLE landing_routed (
    run_id       TEXT    NOT NULL,
    source_id    INTEGER NOT NULL,
    destination  TEXT,
    route_name   TEXT,
    lane_key     TEXT,
    status       TEXT    NOT NULL,
    payload      TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    control_id   TEXT
);
CREATE INDEX landing_routed_run    ON landing_routed (run_id);
CREATE INDEX landing_routed_source ON landing_routed (source_id);
