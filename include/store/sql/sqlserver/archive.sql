-- The retention archive (include/housekeeping.py, migration 0007). Each archive query copies up to
-- :limit rows that the matching purge query is about to delete — finished, older than :ms (whole
-- seconds), and not yet archived as they are now — under the current epoch only, and returns their
-- ids. A row archived before and changed since (an operator requeued it, it finished again) has
-- its old copy replaced, so the purge, which deletes only rows whose copy is current, never loses a
-- change. Re-running after a crash between archive and purge copies nothing twice: the archive's
-- key is the hot row's id. (PostgreSQL and SQLite replace with ON CONFLICT; here a DELETE and an
-- INSERT of the same ids in one batch and transaction.)

-- Each copies the oldest first: in the order of the finished index (updated_at; message_events_at for
-- events), whose range `< now - :ms` holds exactly the rows due, so a run reads what it copies
-- (in id order, a run walks the table from its first row, all of it when nothing is due).

-- A stage's archive and purge queries also take :conns (',a,b,': connection names between commas)
-- and :within: 1 keeps to the rows of those inbound connections, 0 to every other one, so each
-- `[retention.connections.<name>]` period is its own pass (a routed or outbound row's connection
-- is its inbound row's, hot or archived).
-- name: archive_finished_inbound
DECLARE @ids TABLE (id bigint NOT NULL PRIMARY KEY);
INSERT INTO @ids (id)
SELECT TOP (:limit) c.id FROM stage_inbound AS c WITH (READPAST, ROWLOCK)
 WHERE c.status IN ('done', 'dead', 'unrouted')
   AND c.updated_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
   AND CASE WHEN CHARINDEX(',' + c.connection + ',', :conns) > 0 THEN 1 ELSE 0 END = :within
   AND NOT EXISTS (SELECT 1 FROM stage_routed AS r
                    WHERE r.source_id = c.id AND r.status IN ('pending', 'in_flight', 'error'))
   AND NOT EXISTS (SELECT 1 FROM archive_inbound AS a WHERE a.id = c.id AND a.updated_at = c.updated_at)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
 ORDER BY c.updated_at, c.id;
DELETE FROM archive_inbound WHERE id IN (SELECT id FROM @ids);
INSERT INTO archive_inbound (id, message_id, control_id, connection, lane_key, status, claim_epoch, attempts, created_at, updated_at, last_error, charset, payload, batch_id, batch_seq, findings, format)
SELECT s.id, s.message_id, s.control_id, s.connection, s.lane_key, s.status, s.claim_epoch, s.attempts, s.created_at, s.updated_at, s.last_error, s.charset, b.payload, s.batch_id, s.batch_seq, s.findings, s.format
  FROM stage_inbound AS s LEFT JOIN inbound_bodies AS b ON b.id = s.id
 WHERE s.id IN (SELECT id FROM @ids);
SELECT id FROM @ids;

-- name: archive_finished_routed
DECLARE @ids TABLE (id bigint NOT NULL PRIMARY KEY);
INSERT INTO @ids (id)
SELECT TOP (:limit) c.id FROM stage_routed AS c WITH (READPAST, ROWLOCK)
 WHERE c.status IN ('done', 'dead')
   AND c.updated_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
   AND CASE WHEN CHARINDEX(',' + COALESCE((SELECT i.connection FROM stage_inbound AS i WHERE i.id = c.source_id), (SELECT i.connection FROM archive_inbound AS i WHERE i.id = c.source_id), '') + ',', :conns) > 0 THEN 1 ELSE 0 END = :within
   AND NOT EXISTS (SELECT 1 FROM archive_routed AS a WHERE a.id = c.id AND a.updated_at = c.updated_at)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
 ORDER BY c.updated_at, c.id;
DELETE FROM archive_routed WHERE id IN (SELECT id FROM @ids);
INSERT INTO archive_routed (id, source_id, message_id, control_id, destination, route_name, lane_key, status, claim_epoch, attempts, created_at, updated_at, last_error)
SELECT s.id, s.source_id, s.message_id, s.control_id, s.destination, s.route_name, s.lane_key, s.status, s.claim_epoch, s.attempts, s.created_at, s.updated_at, s.last_error
  FROM stage_routed AS s
 WHERE s.id IN (SELECT id FROM @ids);
SELECT id FROM @ids;

-- name: archive_finished_outbound
DECLARE @ids TABLE (id bigint NOT NULL PRIMARY KEY);
INSERT INTO @ids (id)
SELECT TOP (:limit) c.id FROM stage_outbound AS c WITH (READPAST, ROWLOCK)
 WHERE c.status IN ('done', 'dead')
   AND c.updated_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
   AND CASE WHEN CHARINDEX(',' + COALESCE((SELECT i.connection FROM stage_inbound AS i WHERE i.id = c.source_id), (SELECT i.connection FROM archive_inbound AS i WHERE i.id = c.source_id), '') + ',', :conns) > 0 THEN 1 ELSE 0 END = :within
   AND NOT EXISTS (SELECT 1 FROM archive_outbound AS a WHERE a.id = c.id AND a.updated_at = c.updated_at)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
 ORDER BY c.updated_at, c.id;
DELETE FROM archive_outbound WHERE id IN (SELECT id FROM @ids);
INSERT INTO archive_outbound (id, source_id, message_id, control_id, destination, content_type, idempotency_key, lane_key, status, claim_epoch, attempts, created_at, updated_at, last_error, payload)
SELECT s.id, s.source_id, s.message_id, s.control_id, s.destination, s.content_type, s.idempotency_key, s.lane_key, s.status, s.claim_epoch, s.attempts, s.created_at, s.updated_at, s.last_error,
       s.payload
  FROM outbound_messages AS s
 WHERE s.id IN (SELECT id FROM @ids);
SELECT id FROM @ids;

-- name: archive_events
-- Audit events never change: one copy each. Each keeps its message's inbound connection (for the
-- Parquet archive's partitions), from the archived inbound row or, for an inbound event, the hot one.
DECLARE @ids TABLE (id bigint NOT NULL PRIMARY KEY);
INSERT INTO @ids (id)
SELECT TOP (:limit) c.id FROM message_events AS c WITH (READPAST, ROWLOCK)
 WHERE c.at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
   AND NOT EXISTS (SELECT 1 FROM archive_events AS a WHERE a.id = c.id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
 ORDER BY c.at, c.id;
INSERT INTO archive_events (id, at, stage, row_id, message_id, control_id, destination, event, from_status, to_status, epoch, node_id, attempt, detail, connection)
SELECT e.id, e.at, e.stage, e.row_id, e.message_id, e.control_id, e.destination, e.event, e.from_status, e.to_status, e.epoch, e.node_id, e.attempt, e.detail,
       COALESCE((SELECT max(i.connection) FROM archive_inbound AS i WHERE i.message_id = e.message_id),
                (SELECT i.connection FROM stage_inbound AS i WHERE e.stage = 'inbound' AND i.id = e.row_id))
  FROM message_events AS e
 WHERE e.id IN (SELECT id FROM @ids);
SELECT id FROM @ids;

-- name: archive_inbound_batches
-- An HL7 batch's record (inbound_batches), once none of its messages' inbound rows is left in the
-- hot tables: retention runs it after the inbound purge. A batch never changes: one copy each.
-- The probe of stage_inbound takes no READPAST: skipping a locked message row would make its batch
-- look finished.
DECLARE @ids TABLE (batch_id nvarchar(64) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY);
INSERT INTO @ids (batch_id)
SELECT TOP (:limit) c.batch_id FROM inbound_batches AS c WITH (READPAST, ROWLOCK)
 WHERE c.created_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
   AND NOT EXISTS (SELECT 1 FROM stage_inbound AS s WHERE s.batch_id = c.batch_id)
   AND NOT EXISTS (SELECT 1 FROM archive_inbound_batches AS a WHERE a.batch_id = c.batch_id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
 ORDER BY c.created_at, c.batch_id;
INSERT INTO archive_inbound_batches (batch_id, connection, fhs_control_id, bhs_control_id, declared_count, message_count, created_at)
SELECT b.batch_id, b.connection, b.fhs_control_id, b.bhs_control_id, b.declared_count, b.message_count, b.created_at
  FROM inbound_batches AS b
 WHERE b.batch_id IN (SELECT batch_id FROM @ids);
SELECT batch_id FROM @ids;

-- What `stageline messages show` reads besides the hot tables (include/store/operator.py): the same
-- columns as message_inbound / message_routed / message_outbound / message_trail, plus archived_ms.

-- name: archived_inbound
SELECT i.id, i.message_id, i.control_id, i.connection, i.lane_key, i.status, i.attempts, i.charset,
       DATEDIFF_BIG(millisecond, '1970-01-01', i.created_at) AS created_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', i.updated_at) AS updated_ms, i.last_error, NULL AS lease_owner,
       i.payload, i.batch_id, i.batch_seq, i.findings, DATEDIFF_BIG(millisecond, '1970-01-01', i.archived_at) AS archived_ms
  FROM archive_inbound AS i
 WHERE i.id = :id

-- name: archived_inbound_ref
-- The newest archived inbound row with this message id or control id.
SELECT max(id) AS id FROM archive_inbound WHERE message_id = :ref OR control_id = :ref

-- name: archived_batch
SELECT b.batch_id, b.connection, b.fhs_control_id, b.bhs_control_id, b.declared_count, b.message_count,
       DATEDIFF_BIG(millisecond, '1970-01-01', b.created_at) AS created_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', b.archived_at) AS archived_ms
  FROM archive_inbound_batches AS b
 WHERE b.batch_id = :batch_id

-- name: archived_routed
SELECT r.id, r.destination, r.route_name, r.lane_key, r.status, r.attempts,
       DATEDIFF_BIG(millisecond, '1970-01-01', r.created_at) AS created_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', r.updated_at) AS updated_ms, r.last_error, NULL AS lease_owner,
       DATEDIFF_BIG(millisecond, '1970-01-01', r.archived_at) AS archived_ms
  FROM archive_routed AS r
 WHERE r.source_id = :id
 ORDER BY r.id

-- name: archived_outbound
SELECT o.id, o.destination, o.content_type, o.idempotency_key, o.lane_key, o.status, o.attempts,
       DATEDIFF_BIG(millisecond, '1970-01-01', o.created_at) AS created_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', o.updated_at) AS updated_ms, o.last_error, NULL AS lease_owner,
       o.payload, DATEDIFF_BIG(millisecond, '1970-01-01', o.archived_at) AS archived_ms
  FROM archive_outbound AS o
 WHERE o.source_id = :id
 ORDER BY o.id

-- name: archived_trail
SELECT e.id, DATEDIFF_BIG(millisecond, '1970-01-01', e.at) AS at_ms, e.stage, e.row_id, e.destination,
       e.event, e.from_status, e.to_status, e.epoch, e.node_id, e.attempt, e.detail,
       DATEDIFF_BIG(millisecond, '1970-01-01', e.archived_at) AS archived_ms
  FROM archive_events AS e
 WHERE e.message_id = :message_id
 ORDER BY e.id
