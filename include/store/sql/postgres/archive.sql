-- The retention archive (include/housekeeping.py, migration 0007). Each archive query copies up to
-- :limit rows that the matching purge query is about to delete — finished, older than :ms, and not
-- yet archived as they are now — under the current epoch only. A row archived before and changed
-- since (an operator requeued it, it finished again) is copied again over its old copy, so the
-- purge, which deletes only rows whose copy is current, never loses a change. Re-running after a
-- crash between archive and purge copies nothing twice: the archive's key is the hot row's id.

-- Each copies the oldest first: in the order of the finished index (updated_at), whose range
-- `< now() - :ms` holds exactly the rows due, so a run reads what it copies (in id order, a run
-- walks the table from its first row, all of it when nothing is due). Events stay in id order
-- here: message_events_at is a BRIN index, which gives no order — sorting by `at` would read the
-- whole due range for every batch — and event ids follow `at`, so the primary key walks the due
-- rows first.

-- A stage's archive and purge queries also take :conns (',a,b,': connection names between commas)
-- and :within: 1 keeps to the rows of those inbound connections, 0 to every other one, so each
-- `[retention.connections.<name>]` period is its own pass (a routed or outbound row's connection
-- is its inbound row's, hot or archived).
-- name: archive_finished_inbound
INSERT INTO archive_inbound (id, message_id, control_id, connection, lane_key, status, claim_epoch, attempts,
                             created_at, updated_at, last_error, charset, payload, batch_id, batch_seq,
                             findings, format)
SELECT s.id, s.message_id, s.control_id, s.connection, s.lane_key, s.status, s.claim_epoch, s.attempts,
       s.created_at, s.updated_at, s.last_error, s.charset, b.payload, s.batch_id, s.batch_seq, s.findings, s.format
  FROM stage_inbound s LEFT JOIN inbound_bodies b ON b.id = s.id
 WHERE s.id = ANY(ARRAY(SELECT c.id FROM stage_inbound c
                         WHERE c.status IN ('done', 'dead', 'unrouted')
                           AND c.updated_at < now() - make_interval(secs => :ms / 1000.0)
                           AND CASE WHEN strpos(:conns, ',' || c.connection || ',') > 0 THEN 1 ELSE 0 END = CAST(:within AS integer)
                           AND NOT EXISTS (SELECT 1 FROM stage_routed r
                                            WHERE r.source_id = c.id AND r.status IN ('pending', 'in_flight', 'error'))
                           AND NOT EXISTS (SELECT 1 FROM archive_inbound a WHERE a.id = c.id AND a.updated_at = c.updated_at)
                         ORDER BY c.updated_at, c.id
                         LIMIT :limit))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
ON CONFLICT (id) DO UPDATE
   SET status = EXCLUDED.status, claim_epoch = EXCLUDED.claim_epoch, attempts = EXCLUDED.attempts,
       updated_at = EXCLUDED.updated_at, last_error = EXCLUDED.last_error, batch_id = EXCLUDED.batch_id,
       batch_seq = EXCLUDED.batch_seq, archived_at = now(), export_batch = NULL
RETURNING id

-- name: archive_finished_routed
INSERT INTO archive_routed (id, source_id, message_id, control_id, destination, route_name, lane_key, status,
                            claim_epoch, attempts, created_at, updated_at, last_error)
SELECT s.id, s.source_id, s.message_id, s.control_id, s.destination, s.route_name, s.lane_key, s.status,
       s.claim_epoch, s.attempts, s.created_at, s.updated_at, s.last_error
  FROM stage_routed s
 WHERE s.id = ANY(ARRAY(SELECT c.id FROM stage_routed c
                         WHERE c.status IN ('done', 'dead')
                           AND c.updated_at < now() - make_interval(secs => :ms / 1000.0)
                           AND CASE WHEN strpos(:conns, ',' || COALESCE((SELECT i.connection FROM stage_inbound i WHERE i.id = c.source_id), (SELECT i.connection FROM archive_inbound i WHERE i.id = c.source_id), '') || ',') > 0 THEN 1 ELSE 0 END = CAST(:within AS integer)
                           AND NOT EXISTS (SELECT 1 FROM archive_routed a WHERE a.id = c.id AND a.updated_at = c.updated_at)
                         ORDER BY c.updated_at, c.id
                         LIMIT :limit))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
ON CONFLICT (id) DO UPDATE
   SET status = EXCLUDED.status, claim_epoch = EXCLUDED.claim_epoch, attempts = EXCLUDED.attempts,
       updated_at = EXCLUDED.updated_at, last_error = EXCLUDED.last_error, archived_at = now(), export_batch = NULL
RETURNING id

-- name: archive_finished_outbound
INSERT INTO archive_outbound (id, source_id, message_id, control_id, destination, content_type, idempotency_key,
                              lane_key, status, claim_epoch, attempts, created_at, updated_at, last_error, payload)
SELECT s.id, s.source_id, s.message_id, s.control_id, s.destination, s.content_type, s.idempotency_key,
       s.lane_key, s.status, s.claim_epoch, s.attempts, s.created_at, s.updated_at, s.last_error,
       s.payload
  FROM outbound_messages s
 WHERE s.id = ANY(ARRAY(SELECT c.id FROM stage_outbound c
                         WHERE c.status IN ('done', 'dead')
                           AND c.updated_at < now() - make_interval(secs => :ms / 1000.0)
                           AND CASE WHEN strpos(:conns, ',' || COALESCE((SELECT i.connection FROM stage_inbound i WHERE i.id = c.source_id), (SELECT i.connection FROM archive_inbound i WHERE i.id = c.source_id), '') || ',') > 0 THEN 1 ELSE 0 END = CAST(:within AS integer)
                           AND NOT EXISTS (SELECT 1 FROM archive_outbound a WHERE a.id = c.id AND a.updated_at = c.updated_at)
                         ORDER BY c.updated_at, c.id
                         LIMIT :limit))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
ON CONFLICT (id) DO UPDATE
   SET status = EXCLUDED.status, claim_epoch = EXCLUDED.claim_epoch, attempts = EXCLUDED.attempts,
       updated_at = EXCLUDED.updated_at, last_error = EXCLUDED.last_error, archived_at = now(), export_batch = NULL
RETURNING id

-- name: archive_events
-- Audit events never change: one copy each. Each keeps its message's inbound connection (for the
-- Parquet archive's partitions), from the archived inbound row or, for an inbound event, the hot one.
INSERT INTO archive_events (id, at, stage, row_id, message_id, control_id, destination, event, from_status,
                            to_status, epoch, node_id, attempt, detail, connection)
SELECT e.id, e.at, e.stage, e.row_id, e.message_id, e.control_id, e.destination, e.event, e.from_status,
       e.to_status, e.epoch, e.node_id, e.attempt, e.detail,
       COALESCE((SELECT max(i.connection) FROM archive_inbound i WHERE i.message_id = e.message_id),
                (SELECT i.connection FROM stage_inbound i WHERE e.stage = 'inbound' AND i.id = e.row_id))
  FROM message_events e
 WHERE e.id = ANY(ARRAY(SELECT c.id FROM message_events c
                         WHERE c.at < now() - make_interval(secs => :ms / 1000.0)
                           AND NOT EXISTS (SELECT 1 FROM archive_events a WHERE a.id = c.id)
                         ORDER BY c.id
                         LIMIT :limit))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
ON CONFLICT (id) DO NOTHING
RETURNING id

-- name: archive_inbound_batches
-- An HL7 batch's record (inbound_batches), once none of its messages' inbound rows is left in the
-- hot tables: retention runs it after the inbound purge. A batch never changes: one copy each.
INSERT INTO archive_inbound_batches (batch_id, connection, fhs_control_id, bhs_control_id, declared_count,
                                     message_count, created_at)
SELECT b.batch_id, b.connection, b.fhs_control_id, b.bhs_control_id, b.declared_count, b.message_count, b.created_at
  FROM inbound_batches b
 WHERE b.batch_id = ANY(ARRAY(SELECT c.batch_id FROM inbound_batches c
                               WHERE c.created_at < now() - make_interval(secs => :ms / 1000.0)
                                 AND NOT EXISTS (SELECT 1 FROM stage_inbound s WHERE s.batch_id = c.batch_id)
                                 AND NOT EXISTS (SELECT 1 FROM archive_inbound_batches a WHERE a.batch_id = c.batch_id)
                               ORDER BY c.created_at, c.batch_id
                               LIMIT :limit))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
ON CONFLICT (batch_id) DO NOTHING
RETURNING batch_id

-- What `stageline messages show` reads besides the hot tables (include/store/operator.py): the same
-- columns as message_inbound / message_routed / message_outbound / message_trail, plus archived_ms.

-- name: archived_inbound
SELECT i.id, i.message_id, i.control_id, i.connection, i.lane_key, i.status, i.attempts, i.charset,
       (extract(epoch FROM i.created_at) * 1000)::bigint AS created_ms, (extract(epoch FROM i.updated_at) * 1000)::bigint AS updated_ms,
       i.last_error, NULL AS lease_owner, i.payload, i.batch_id, i.batch_seq, i.findings, (extract(epoch FROM i.archived_at) * 1000)::bigint AS archived_ms
  FROM archive_inbound i
 WHERE i.id = :id

-- name: archived_inbound_ref
-- The newest archived inbound row with this message id or control id.
SELECT max(id) AS id FROM archive_inbound WHERE message_id = :ref OR control_id = :ref

-- name: archived_batch
SELECT b.batch_id, b.connection, b.fhs_control_id, b.bhs_control_id, b.declared_count, b.message_count,
       (extract(epoch FROM b.created_at) * 1000)::bigint AS created_ms,
       (extract(epoch FROM b.archived_at) * 1000)::bigint AS archived_ms
  FROM archive_inbound_batches b
 WHERE b.batch_id = :batch_id

-- name: archived_routed
SELECT r.id, r.destination, r.route_name, r.lane_key, r.status, r.attempts,
       (extract(epoch FROM r.created_at) * 1000)::bigint AS created_ms, (extract(epoch FROM r.updated_at) * 1000)::bigint AS updated_ms,
       r.last_error, NULL AS lease_owner, (extract(epoch FROM r.archived_at) * 1000)::bigint AS archived_ms
  FROM archive_routed r
 WHERE r.source_id = :id
 ORDER BY r.id

-- name: archived_outbound
SELECT o.id, o.destination, o.content_type, o.idempotency_key, o.lane_key, o.status, o.attempts,
       (extract(epoch FROM o.created_at) * 1000)::bigint AS created_ms, (extract(epoch FROM o.updated_at) * 1000)::bigint AS updated_ms,
       o.last_error, NULL AS lease_owner, o.payload, (extract(epoch FROM o.archived_at) * 1000)::bigint AS archived_ms
  FROM archive_outbound o
 WHERE o.source_id = :id
 ORDER BY o.id

-- name: archived_trail
SELECT e.id, (extract(epoch FROM e.at) * 1000)::bigint AS at_ms, e.stage, e.row_id, e.destination, e.event, e.from_status,
       e.to_status, e.epoch, e.node_id, e.attempt, e.detail, (extract(epoch FROM e.archived_at) * 1000)::bigint AS archived_ms
  FROM archive_events e
 WHERE e.message_id = :message_id
 ORDER BY e.id
