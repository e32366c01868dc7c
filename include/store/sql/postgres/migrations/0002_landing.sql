-- Stageline store, PostgreSQL, version 2: the route stage's landing area.
-- Spark's JDBC writer appends one run's results here (keyed by run_id); the fenced finalize
-- transaction moves them into stage_routed and deletes them. Scratch data: a run that dies before
-- its finalize leaves rows that the next finalize of the same sources removes. No timestamps:
-- nothing decides anything by the time a landing row was written.

CREATE TABLE landing_routed (
    run_id       text   NOT NULL,
    source_id    bigint NOT NULL,
    destination  text,
    route_name   text,
    lane_key     text,
    status       text   NOT NULL,
    payload      text   NOT NULL,
    message_id   text   NOT NULL,
    control_id   text
);
CREATE INDEX landing_routed_run    ON landing_routed (run_id);
CREATE INDEX landing_routed_source ON landing_routed (source_id);
