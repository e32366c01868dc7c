-- Stageline store, SQLite, version 4: message bodies apart from row state.
--
-- A body is written once and never rewritten by a state change (SQLite rewrites a whole record on
-- every UPDATE, body included, and the route stage copied each inbound body into every routed row):
--   inbound_bodies   the body as received, one per stage_inbound row (same id), written at ingest
--   outbound_bodies  the body as it is delivered, one per stage_outbound row (same id), written
--                    by the transform finalize
--   stage_routed     no body: a routed row's message is its source's (source_id → inbound_bodies)
-- The stage tables keep only narrow state. The *_messages views give the old shape (state and
-- body in one row) for audit queries. Deleting a row deletes its body (triggers: SQLite enforces
-- foreign keys only when each connection asks for it, triggers always).

CREATE TABLE inbound_bodies (
    id       INTEGER PRIMARY KEY,
    payload  TEXT    NOT NULL
);
CREATE TABLE outbound_bodies (
    id       INTEGER PRIMARY KEY,
    payload  TEXT    NOT NULL
);
INSERT INTO inbound_bodies (id, payload) SELECT id, payload FROM stage_inbound;
INSERT INTO outbound_bodies (id, payload) SELECT id, payload FROM stage_outbound;
ALTER TABLE stage_inbound  DROP COLUMN payload;
ALTER TABLE stage_routed   DROP COLUMN payload;
ALTER TABLE stage_outbound DROP COLUMN payload;

CREATE TRIGGER stage_inbound_body_gone AFTER DELETE ON stage_inbound
BEGIN
    DELETE FROM inbound_bodies WHERE id = OLD.id;
END;
CREATE TRIGGER stage_outbound_body_gone AFTER DELETE ON stage_outbound
BEGIN
    DELETE FROM outbound_bodies WHERE id = OLD.id;
END;

-- Indexes cost an entry on every claim and finish (a state change moves a row between partial
-- indexes). Dropped as redundant: the claim-epoch indexes (recovery and the claimed-row reads use
-- the small in_flight index instead) and the open-lane indexes of the stages that never claim lane
-- heads (only deliver does).
DROP INDEX stage_inbound_epoch;
DROP INDEX stage_routed_epoch;
DROP INDEX stage_outbound_epoch;
DROP INDEX stage_inbound_open_lane;
DROP INDEX stage_routed_open_lane;

-- Rows without a lane (lane-less feeds) are never probed by lane (claim_batch skips the probe for
-- them): keep them out of the held-lane index.
DROP INDEX stage_inbound_held_lane;
DROP INDEX stage_routed_held_lane;
DROP INDEX stage_outbound_held_lane;
CREATE INDEX stage_inbound_held_lane  ON stage_inbound (lane_key, id)  WHERE status IN ('in_flight', 'error') AND lane_key IS NOT NULL;
CREATE INDEX stage_routed_held_lane   ON stage_routed (lane_key, id)   WHERE status IN ('in_flight', 'error') AND lane_key IS NOT NULL;
CREATE INDEX stage_outbound_held_lane ON stage_outbound (lane_key, id) WHERE status IN ('in_flight', 'error') AND lane_key IS NOT NULL;

CREATE VIEW inbound_messages AS
SELECT s.*, b.payload FROM stage_inbound s JOIN inbound_bodies b ON b.id = s.id;
CREATE VIEW routed_messages AS
SELECT r.*, b.payload FROM stage_routed r LEFT JOIN inbound_bodies b ON b.id = r.source_id;
CREATE VIEW outbound_messages AS
SELECT o.*, b.payload FROM stage_outbound o JOIN outbound_bodies b ON b.id = o.id;
