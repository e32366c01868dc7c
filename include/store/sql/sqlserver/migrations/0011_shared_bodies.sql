-- Stageline store, SQL Server (T-SQL), version 11: a pass-through row's body is written once
-- (postgres/migrations/0011_shared_bodies.sql says why).
DROP VIEW outbound_messages;
GO

CREATE VIEW outbound_messages AS
SELECT o.id, o.source_id, o.message_id, o.control_id, o.destination, o.content_type, o.idempotency_key,
       o.lane_key, o.status, o.lease_owner, o.lease_expires_at, o.claim_epoch, o.attempts,
       o.next_attempt_at, o.created_at, o.updated_at, o.last_error,
       COALESCE(b.payload, (SELECT i.payload FROM inbound_bodies AS i WHERE i.id = o.source_id)) AS payload
  FROM stage_outbound AS o LEFT JOIN outbound_bodies AS b ON b.id = o.id;
