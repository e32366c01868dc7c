-- What an operator does with messages (include/store/operator.py): find, show, replay, requeue,
-- dead letters, the stages at a glance. Times come back as epoch milliseconds in every dialect.

-- name: messages_find
-- Inbound messages, newest first, each filter optional (NULL: any); a destination or status
-- matches a message when any of its stages' rows has it. Paged by id (:before_id).
SELECT i.id, i.message_id, i.control_id, i.connection, i.lane_key, i.status, i.attempts,
       (extract(epoch FROM i.created_at) * 1000)::bigint AS created_ms, (extract(epoch FROM i.updated_at) * 1000)::bigint AS updated_ms, i.last_error,
       (SELECT count(*) FROM stage_routed r WHERE r.source_id = i.id) AS routed,
       (SELECT count(*) FROM stage_outbound o WHERE o.source_id = i.id AND o.status = 'done') AS delivered,
       (SELECT count(*) FROM stage_routed r WHERE r.source_id = i.id AND r.status = 'dead')
         + (SELECT count(*) FROM stage_outbound o WHERE o.source_id = i.id AND o.status = 'dead') AS dead
  FROM stage_inbound i
 WHERE (CAST(:control_id AS text) IS NULL OR i.control_id = CAST(:control_id AS text))
   AND (CAST(:message_id AS text) IS NULL OR i.message_id = CAST(:message_id AS text))
   AND (CAST(:lane_key AS text) IS NULL OR i.lane_key = CAST(:lane_key AS text))
   AND (CAST(:connection AS text) IS NULL OR i.connection = CAST(:connection AS text))
   AND (CAST(:since_ms AS bigint) IS NULL OR i.created_at >= to_timestamp(CAST(:since_ms AS bigint) / 1000.0))
   AND (CAST(:until_ms AS bigint) IS NULL OR i.created_at < to_timestamp(CAST(:until_ms AS bigint) / 1000.0))
   AND (CAST(:before_id AS bigint) IS NULL OR i.id < CAST(:before_id AS bigint))
   AND (CAST(:destination AS text) IS NULL
        OR EXISTS (SELECT 1 FROM stage_routed r WHERE r.source_id = i.id AND r.destination = CAST(:destination AS text)))
   AND (CAST(:status AS text) IS NULL OR i.status = CAST(:status AS text)
        OR EXISTS (SELECT 1 FROM stage_routed r WHERE r.source_id = i.id AND r.status = CAST(:status AS text))
        OR EXISTS (SELECT 1 FROM stage_outbound o WHERE o.source_id = i.id AND o.status = CAST(:status AS text)))
 ORDER BY i.id DESC
 LIMIT CAST(:limit AS bigint)

-- name: message_inbound
SELECT i.id, i.message_id, i.control_id, i.connection, i.lane_key, i.status, i.attempts, i.charset,
       (extract(epoch FROM i.created_at) * 1000)::bigint AS created_ms, (extract(epoch FROM i.updated_at) * 1000)::bigint AS updated_ms, i.last_error, i.lease_owner, b.payload, i.batch_id, i.batch_seq, i.findings
  FROM stage_inbound i LEFT JOIN inbound_bodies b ON b.id = i.id
 WHERE i.id = :id

-- name: message_batch
-- The HL7 batch a message came in (inbound_batches), while it is hot; archived_batch after.
SELECT b.batch_id, b.connection, b.fhs_control_id, b.bhs_control_id, b.declared_count, b.message_count,
       (extract(epoch FROM b.created_at) * 1000)::bigint AS created_ms, NULL AS archived_ms
  FROM inbound_batches b
 WHERE b.batch_id = :batch_id

-- name: message_routed
SELECT r.id, r.destination, r.route_name, r.lane_key, r.status, r.attempts,
       (extract(epoch FROM r.created_at) * 1000)::bigint AS created_ms, (extract(epoch FROM r.updated_at) * 1000)::bigint AS updated_ms, r.last_error, r.lease_owner
  FROM stage_routed r
 WHERE r.source_id = :id
 ORDER BY r.id

-- name: message_outbound
SELECT o.id, o.destination, o.content_type, o.idempotency_key, o.lane_key, o.status, o.attempts,
       (extract(epoch FROM o.created_at) * 1000)::bigint AS created_ms, (extract(epoch FROM o.updated_at) * 1000)::bigint AS updated_ms, o.last_error, o.lease_owner, o.payload
  FROM outbound_messages o
 WHERE o.source_id = :id
 ORDER BY o.id

-- name: message_trail
-- Every audit event of a message, in order (replays and operator actions included).
SELECT e.id, (extract(epoch FROM e.at) * 1000)::bigint AS at_ms, e.stage, e.row_id, e.destination, e.event, e.from_status, e.to_status,
       e.epoch, e.node_id, e.attempt, e.detail
  FROM message_events e
 WHERE e.message_id = :message_id
 ORDER BY e.id

-- name: replay_inbound
-- A replay from inbound is a new inbound row (a new id: behind what is queued in its lane) with the
-- original's connection, lane, control id and charset; its body is copied next.
INSERT INTO stage_inbound (message_id, control_id, connection, lane_key, charset)
SELECT CAST(:new_message_id AS text), i.control_id, i.connection, i.lane_key, i.charset
  FROM stage_inbound i
 WHERE i.id = :id
RETURNING id, message_id, control_id, attempts, status

-- name: replay_inbound_body
INSERT INTO inbound_bodies (id, payload)
SELECT CAST(:new_id AS bigint), b.payload FROM inbound_bodies b WHERE b.id = :id

-- name: requeue_rows
-- Back to pending, attempts reset, for rows of {table} in one of :statuses (JSON list) among :ids.
UPDATE {table}
   SET status = 'pending', attempts = 0, next_attempt_at = NULL, lease_owner = NULL,
       lease_expires_at = NULL, claim_epoch = NULL, updated_at = now()
 WHERE id = ANY(CAST(:ids AS bigint[]))
   AND status = ANY(CAST(:statuses AS text[]))
RETURNING id, status

-- name: dead_ids
-- Dead rows of {table}, optionally of one destination and/or lane, oldest first (lane order).
-- Read through the table's dead index (migration 0013): the dead letters, not the table.
SELECT t.id FROM {table} t
 WHERE t.status = 'dead'
   AND (CAST(:destination AS text) IS NULL OR {dest} = CAST(:destination AS text))
   AND (CAST(:lane_key AS text) IS NULL OR t.lane_key = CAST(:lane_key AS text))
 ORDER BY t.id

-- name: operator_events
-- One audit event per row of {table} an operator moved (:ids): who (node_id 'operator:<actor>')
-- and why (the detail).
INSERT INTO message_events (stage, row_id, message_id, control_id, destination, event,
                            from_status, to_status, epoch, node_id, attempt, detail)
SELECT CAST(:stage AS text), t.id, t.message_id, t.control_id, {dest}, CAST(:event AS text),
       CAST(:from_status AS text), t.status, CAST(NULL AS bigint), CAST(:actor AS text), t.attempts,
       CAST(:detail AS text)
  FROM {table} t
 WHERE t.id = ANY(CAST(:ids AS bigint[]))
 ORDER BY t.id

-- name: dead_letters
-- Every dead letter (there are few, read through each table's dead index; the caller groups them
-- by stage, destination and reason).
SELECT 'outbound' AS stage, destination, control_id, last_error AS reason, (extract(epoch FROM updated_at) * 1000)::bigint AS updated_ms
  FROM stage_outbound WHERE status = 'dead'
UNION ALL
SELECT 'routed' AS stage, destination, control_id, last_error AS reason, (extract(epoch FROM updated_at) * 1000)::bigint AS updated_ms
  FROM stage_routed WHERE status = 'dead'
UNION ALL
SELECT 'inbound' AS stage, NULL AS destination, control_id, last_error AS reason, (extract(epoch FROM updated_at) * 1000)::bigint AS updated_ms
  FROM stage_inbound WHERE status = 'dead'

-- name: stage_overview
-- One stage at a glance: backlog (due or backing off), the oldest of it, in flight, dead, and what
-- finished in the last :window_ms. Each figure reads its own partial index (claimable, in flight,
-- dead, finished), so the leader's gauge every few seconds reads the open rows and the last
-- window's, not the table (sqlite/operator.sql says why the finished count names both finished
-- predicates).
SELECT (SELECT count(*) FROM {table} WHERE status IN ('pending', 'error')) AS backlog,
       (SELECT (extract(epoch FROM min(created_at)) * 1000)::bigint FROM {table}
         WHERE status IN ('pending', 'error')) AS oldest_ms,
       (SELECT count(*) FROM {table} WHERE status = 'in_flight') AS in_flight,
       (SELECT count(*) FROM {table} WHERE status = 'dead') AS dead,
       (SELECT count(*) FROM {table}
         WHERE status IN ('done', 'dead', 'unrouted') AND status IN ('done', 'dead') AND status = 'done'
           AND updated_at >= now() - CAST(:window_ms AS bigint) * interval '1 millisecond') AS finished_recently,
       (extract(epoch FROM now()) * 1000)::bigint AS now_ms

-- name: batch_record
-- One micro-batch that claimed rows (include/store/operator.py record_batch).
INSERT INTO stage_batches (stage, owner, dag_id, run_id, try_number, epoch, started_at, claimed, counts)
VALUES (CAST(:stage AS text), CAST(:owner AS text), CAST(:dag_id AS text), CAST(:run_id AS text),
        CAST(:try_number AS integer), CAST(:epoch AS bigint),
        now() - CAST(:duration_ms AS bigint) * interval '1 millisecond', CAST(:claimed AS integer),
        CAST(:counts AS text))

-- name: batches_by_owner
-- The batches that wrote a message's events (:owners: the trail's node_ids).
SELECT b.id, b.stage, b.owner, b.dag_id, b.run_id, b.try_number, b.epoch,
       (extract(epoch FROM b.started_at) * 1000)::bigint AS started_ms,
       (extract(epoch FROM b.finished_at) * 1000)::bigint AS finished_ms, b.claimed, b.counts
  FROM stage_batches b
 WHERE b.owner = ANY(CAST(:owners AS text[]))
 ORDER BY b.id

-- name: batches_recent
-- The latest micro-batches, newest first (optionally of one stage).
SELECT b.id, b.stage, b.owner, b.dag_id, b.run_id, b.try_number, b.epoch,
       (extract(epoch FROM b.started_at) * 1000)::bigint AS started_ms,
       (extract(epoch FROM b.finished_at) * 1000)::bigint AS finished_ms, b.claimed, b.counts
  FROM stage_batches b
 WHERE (CAST(:stage AS text) IS NULL OR b.stage = CAST(:stage AS text))
 ORDER BY b.id DESC
 LIMIT CAST(:limit AS bigint)

-- name: body_read_event
-- The access log of PHI: one event per read of a message's bodies (event 'body_read'), naming who
-- (node_id 'reader:<surface> <who>') and through which surface (the detail); `at` is the store's
-- clock (the column's default). The row's status is unchanged (to_status = from_status).
INSERT INTO message_events (stage, row_id, message_id, control_id, destination, event,
                            from_status, to_status, epoch, node_id, attempt, detail)
VALUES ('inbound', CAST(:id AS bigint), CAST(:message_id AS text), CAST(:control_id AS text), NULL, 'body_read',
        CAST(:status AS text), CAST(:status AS text), NULL, CAST(:actor AS text), NULL, CAST(:detail AS text))

-- name: inbound_ref_by_message_id
-- The hot inbound row with this message id (its unique index): how `resolve` reads a ref, so an
-- unknown one costs one index probe, not a read of the table as the search's optional filters would.
SELECT max(id) AS id FROM stage_inbound WHERE message_id = :ref

-- name: inbound_ref_by_control_id
-- The newest hot inbound row with this control id (stage_inbound_control).
SELECT max(id) AS id FROM stage_inbound WHERE control_id = :ref
