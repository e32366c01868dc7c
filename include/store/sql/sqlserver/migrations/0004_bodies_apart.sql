-- Stageline store, SQL Server (T-SQL), version 4: message bodies apart from row state.
--
-- A body is written once and never changed by a state change. Before, the route stage copied each
-- inbound body into every routed row, and a body sat in the clustered row that every claim, finish
-- and retry updates (fewer rows per page for every scan and seek of the state). Now:
--   inbound_bodies   the body as received, one per stage_inbound row (same id), written at ingest
--                    (stage_inbound_bodies, in the staging transaction)
--   outbound_bodies  the body as it is delivered, one per stage_outbound row (same id), written
--                    by the transform finalize (transform_finalize_bodies)
--   stage_routed     no body: a routed row's message is its source's (source_id -> inbound_bodies)
-- The stage tables keep only narrow state. The *_messages views give the old shape (state and
-- body in one row) for audit queries; a routed row's payload is NULL once its inbound row is purged.
--
-- A body goes when its row is purged, and the purge query deletes it, not a trigger:
-- purge_finished_inbound / purge_finished_outbound delete the rows with OUTPUT deleted.id INTO a
-- table variable, delete the bodies of exactly those ids, and return them. Why not AFTER DELETE
-- triggers as on SQLite: SQL Server refuses an OUTPUT clause without INTO on a statement whose
-- target has an enabled trigger for that action (error 334), so a trigger would not spare the
-- purge its table variable; it would only hide a second delete from the reader of queries.sql
-- (and from tests/store/test_tsql.py, whose parser cannot read CREATE TRIGGER). Retention is the
-- only code that deletes stage rows, and PostgreSQL deletes the bodies in its purge statements too.
-- A row deleted by hand leaves its body behind; such orphans are found with
-- `SELECT b.id FROM inbound_bodies AS b WHERE NOT EXISTS (SELECT 1 FROM stage_inbound AS s WHERE s.id = b.id)`.
--
-- DROP COLUMN payload: no default, CHECK, index, INCLUDE or schema-bound view names the column
-- (versions 1 to 3), so nothing blocks it; auto-created statistics on it are dropped with it. It is
-- a metadata change: rows written before it keep the dropped bytes until they are rewritten
-- (ALTER TABLE ... REBUILD, or DBCC CLEANTABLE for the off-row part) or, without either, until
-- retention purges them. The migration does not rebuild: that would rewrite every row of the
-- three tables inside the migration's one transaction.
CREATE TABLE inbound_bodies (
    id       bigint        NOT NULL PRIMARY KEY,
    payload  nvarchar(max) NOT NULL
);
GO

CREATE TABLE outbound_bodies (
    id       bigint        NOT NULL PRIMARY KEY,
    payload  nvarchar(max) NOT NULL
);
GO

-- The moves run in batches of their own, compiled while stage_*.payload still exists.
INSERT INTO inbound_bodies (id, payload) SELECT id, payload FROM stage_inbound;
INSERT INTO outbound_bodies (id, payload) SELECT id, payload FROM stage_outbound;
GO

ALTER TABLE stage_inbound  DROP COLUMN payload;
ALTER TABLE stage_routed   DROP COLUMN payload;
ALTER TABLE stage_outbound DROP COLUMN payload;
GO

-- Indexes cost an entry on every claim and finish (a state change moves a row between filtered
-- indexes). Dropped as redundant: the claim-epoch indexes (recovery and the claimed-row reads use
-- the small in_flight index instead) and the open-lane indexes of the stages that never claim lane
-- heads (only deliver does). message_events_at stays a b-tree: SQL Server has no BRIN, and
-- retention (its only reader) seeks it for the oldest events.
DROP INDEX stage_inbound_epoch ON stage_inbound;
DROP INDEX stage_routed_epoch ON stage_routed;
DROP INDEX stage_outbound_epoch ON stage_outbound;
DROP INDEX stage_inbound_open_lane ON stage_inbound;
DROP INDEX stage_routed_open_lane ON stage_routed;
GO

-- Rows without a lane (lane-less feeds) are never probed by lane (claim_batch skips the probe for
-- them): keep them out of the held-lane index. claim_batch repeats `lane_key IS NOT NULL` in its
-- probe, since a filtered index is matched on the query's literal predicates.
DROP INDEX stage_inbound_held_lane ON stage_inbound;
DROP INDEX stage_routed_held_lane ON stage_routed;
DROP INDEX stage_outbound_held_lane ON stage_outbound;
CREATE INDEX stage_inbound_held_lane  ON stage_inbound (lane_key, id)  WHERE status IN ('in_flight', 'error') AND lane_key IS NOT NULL;
CREATE INDEX stage_routed_held_lane   ON stage_routed (lane_key, id)   WHERE status IN ('in_flight', 'error') AND lane_key IS NOT NULL;
CREATE INDEX stage_outbound_held_lane ON stage_outbound (lane_key, id) WHERE status IN ('in_flight', 'error') AND lane_key IS NOT NULL;
GO

-- CREATE VIEW must be alone in its batch. The columns are listed (PostgreSQL's s.* expanded, in
-- table order): SQL Server fixes a view's * at creation, so a listed view says what it returns.
CREATE VIEW inbound_messages AS
SELECT s.id, s.message_id, s.control_id, s.connection, s.lane_key, s.status, s.lease_owner,
       s.lease_expires_at, s.claim_epoch, s.attempts, s.next_attempt_at, s.created_at, s.updated_at,
       s.last_error, s.charset, b.payload
  FROM stage_inbound AS s JOIN inbound_bodies AS b ON b.id = s.id;
GO

CREATE VIEW routed_messages AS
SELECT r.id, r.source_id, r.message_id, r.control_id, r.destination, r.route_name, r.lane_key, r.status,
       r.lease_owner, r.lease_expires_at, r.claim_epoch, r.attempts, r.next_attempt_at, r.created_at,
       r.updated_at, r.last_error, b.payload
  FROM stage_routed AS r LEFT JOIN inbound_bodies AS b ON b.id = r.source_id;
GO

CREATE VIEW outbound_messages AS
SELECT o.id, o.source_id, o.message_id, o.control_id, o.destination, o.content_type, o.idempotency_key,
       o.lane_key, o.status, o.lease_owner, o.lease_expires_at, o.claim_epoch, o.attempts,
       o.next_attempt_at, o.created_at, o.updated_at, o.last_error, b.payload
  FROM stage_outbound AS o JOIN outbound_bodies AS b ON b.id = o.id;
