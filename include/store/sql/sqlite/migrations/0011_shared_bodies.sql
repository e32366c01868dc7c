-- Stageline store, SQLite, version 11: a pass-through row's body is written once
-- (postgres/migrations/0011_shared_bodies.sql says why).
DROP VIEW outbound_messages;
CREATE VIEW outbound_messages AS
SELECT o.*, COALESCE(b.payload, (SELECT i.payload FROM inbound_bodies i WHERE i.id = o.source_id)) AS payload
  FROM stage_outbound o LEFT JOIN outbound_bodies b ON b.id = o.id;
