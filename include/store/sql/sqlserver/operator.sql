-- What an operator does with messages (include/store/operator.py): find, show, replay, requeue,
-- dead letters, the stages at a glance. Times come back as epoch milliseconds in every dialect.

-- name: messages_find
-- Inbound messages, newest first, each filter optional (NULL: any); a destination or status
-- matches a message when any of its stages' rows has it. Paged by id (:before_id).
SELECT TOP (CAST(:limit AS int))
       i.id, i.message_id, i.control_id, i.connection, i.lane_key, i.status, i.attempts,
       DATEDIFF_BIG(millisecond, '1970-01-01', i.created_at) AS created_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', i.updated_at) AS updated_ms, i.last_error,
       (SELECT count(*) FROM stage_routed AS r WHERE r.source_id = i.id) AS routed,
       (SELECT count(*) FROM stage_outbound AS o WHERE o.source_id = i.id AND o.status = 'done') AS delivered,
       (SELECT count(*) FROM stage_routed AS r WHERE r.source_id = i.id AND r.status = 'dead')
         + (SELECT count(*) FROM stage_outbound AS o WHERE o.source_id = i.id AND o.status = 'dead') AS dead
  FROM stage_inbound AS i
 WHERE (:control_id IS NULL OR i.control_id = :control_id)
   AND (:message_id IS NULL OR i.message_id = :message_id)
   AND (:lane_key IS NULL OR i.lane_key = :lane_key)
   AND (:connection IS NULL OR i.connection = :connection)
   AND (:since_ms IS NULL
        OR i.created_at >= DATEADD(second, CAST(CAST(:since_ms AS bigint) / 1000 AS int),
                                   CAST('1970-01-01' AS datetime2)))
   AND (:until_ms IS NULL
        OR i.created_at < DATEADD(second, CAST(CAST(:until_ms AS bigint) / 1000 AS int),
                                  CAST('1970-01-01' AS datetime2)))
   AND (:before_id IS NULL OR i.id < :before_id)
   AND (:destination IS NULL
        OR EXISTS (SELECT 1 FROM stage_routed AS r WHERE r.source_id = i.id AND r.destination = :destination))
   AND (:status IS NULL OR i.status = :status
        OR EXISTS (SELECT 1 FROM stage_routed AS r WHERE r.source_id = i.id AND r.status = :status)
        OR EXISTS (SELECT 1 FROM stage_outbound AS o WHERE o.source_id = i.id AND o.status = :status))
 ORDER BY i.id DESC

-- name: message_inbound
SELECT i.id, i.message_id, i.control_id, i.connection, i.lane_key, i.status, i.attempts, i.charset,
       DATEDIFF_BIG(millisecond, '1970-01-01', i.created_at) AS created_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', i.updated_at) AS updated_ms, i.last_error, i.lease_owner,
       b.payload, i.batch_id, i.batch_seq, i.findings
  FROM stage_inbound AS i LEFT JOIN inbound_bodies AS b ON b.id = i.id
 WHERE i.id = :id

-- name: message_batch
-- The HL7 batch a message came in (inbound_batches), while it is hot; archived_batch after.
SELECT b.batch_id, b.connection, b.fhs_control_id, b.bhs_control_id, b.declared_count, b.message_count,
       DATEDIFF_BIG(millisecond, '1970-01-01', b.created_at) AS created_ms, NULL AS archived_ms
  FROM inbound_batches AS b
 WHERE b.batch_id = :batch_id

-- name: message_routed
SELECT r.id, r.destination, r.route_name, r.lane_key, r.status, r.attempts,
       DATEDIFF_BIG(millisecond, '1970-01-01', r.created_at) AS created_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', r.updated_at) AS updated_ms, r.last_error, r.lease_owner
  FROM stage_routed AS r
 WHERE r.source_id = :id
 ORDER BY r.id

-- name: message_outbound
SELECT o.id, o.destination, o.content_type, o.idempotency_key, o.lane_key, o.status, o.attempts,
       DATEDIFF_BIG(millisecond, '1970-01-01', o.created_at) AS created_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', o.updated_at) AS updated_ms, o.last_error, o.lease_owner,
       o.payload
  FROM outbound_messages AS o
 WHERE o.source_id = :id
 ORDER BY o.id

-- name: message_trail
-- Every audit event of a message, in order (replays and operator actions included).
SELECT e.id, DATEDIFF_BIG(millisecond, '1970-01-01', e.at) AS at_ms, e.stage, e.row_id, e.destination,
       e.event, e.from_status, e.to_status, e.epoch, e.node_id, e.attempt, e.detail
  FROM message_events AS e
 WHERE e.message_id = :message_id
 ORDER BY e.id

-- name: replay_inbound
-- A replay from inbound is a new inbound row (a new id: behind what is queued in its lane) with the
-- original's connection, lane, control id and charset; its body is copied next.
INSERT INTO stage_inbound (message_id, control_id, connection, lane_key, charset)
OUTPUT inserted.id, inserted.message_id, inserted.control_id, inserted.attempts, inserted.status
SELECT :new_message_id, i.control_id, i.connection, i.lane_key, i.charset
  FROM stage_inbound AS i
 WHERE i.id = :id

-- name: replay_inbound_body
INSERT INTO inbound_bodies (id, payload)
SELECT :new_id, b.payload FROM inbound_bodies AS b WHERE b.id = :id

-- name: requeue_rows
-- Back to pending, attempts reset, for rows of {table} in one of :statuses (JSON list) among :ids.
UPDATE {table}
   SET status = 'pending', attempts = 0, next_attempt_at = NULL, lease_owner = NULL,
       lease_expires_at = NULL, claim_epoch = NULL, updated_at = SYSUTCDATETIME()
OUTPUT inserted.id, inserted.status
 WHERE id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
   AND status IN (SELECT CAST(value AS nvarchar(16)) FROM OPENJSON(:statuses))

-- name: dead_ids
-- Dead rows of {table}, optionally of one destination and/or lane, oldest first (lane order).
-- Read through the table's dead index (migration 0013): the dead letters, not the table.
SELECT t.id FROM {table} AS t
 WHERE t.status = 'dead'
   AND (:destination IS NULL OR {dest} = :destination)
   AND (:lane_key IS NULL OR t.lane_key = :lane_key)
 ORDER BY t.id

-- name: operator_events
-- One audit event per row of {table} an operator moved (:ids): who (node_id 'operator:<actor>')
-- and why (the detail).
INSERT INTO message_events (stage, row_id, message_id, control_id, destination, event,
                            from_status, to_status, epoch, node_id, attempt, detail)
SELECT :stage, t.id, t.message_id, t.control_id, {dest}, :event, :from_status, t.status,
       CAST(NULL AS bigint), :actor, t.attempts, :detail
  FROM {table} AS t
 WHERE t.id IN (SELECT CAST(value AS bigint) FROM OPENJSON(:ids))
 ORDER BY t.id

-- name: dead_letters
-- Every dead letter (there are few, read through each table's dead index; the caller groups them
-- by stage, destination and reason).
SELECT 'outbound' AS stage, destination, control_id, last_error AS reason, DATEDIFF_BIG(millisecond, '1970-01-01', updated_at) AS updated_ms
  FROM stage_outbound WHERE status = 'dead'
UNION ALL
SELECT 'routed' AS stage, destination, control_id, last_error AS reason, DATEDIFF_BIG(millisecond, '1970-01-01', updated_at) AS updated_ms
  FROM stage_routed WHERE status = 'dead'
UNION ALL
SELECT 'inbound' AS stage, NULL AS destination, control_id, last_error AS reason, DATEDIFF_BIG(millisecond, '1970-01-01', updated_at) AS updated_ms
  FROM stage_inbound WHERE status = 'dead'

-- name: stage_overview
-- One stage at a glance: backlog (due or backing off), the oldest of it, in flight, dead, and what
-- finished in the last :window_ms. Each figure reads its own filtered index (claimable, in flight,
-- dead, finished), so the leader's gauge every few seconds reads the open rows and the last
-- window's, not the table (sqlite/operator.sql says why the finished count names both finished
-- predicates).
SELECT (SELECT count(*) FROM {table} WHERE status IN ('pending', 'error')) AS backlog,
       (SELECT DATEDIFF_BIG(millisecond, '1970-01-01', min(created_at)) FROM {table}
         WHERE status IN ('pending', 'error')) AS oldest_ms,
       (SELECT count(*) FROM {table} WHERE status = 'in_flight') AS in_flight,
       (SELECT count(*) FROM {table} WHERE status = 'dead') AS dead,
       (SELECT count(*) FROM {table}
         WHERE status IN ('done', 'dead', 'unrouted') AND status IN ('done', 'dead') AND status = 'done'
           AND updated_at >= DATEADD(millisecond, 0 - CAST(:window_ms AS int), SYSUTCDATETIME())) AS finished_recently,
       DATEDIFF_BIG(millisecond, '1970-01-01', SYSUTCDATETIME()) AS now_ms

-- name: batch_record
-- One micro-batch that claimed rows (include/store/operator.py record_batch).
INSERT INTO stage_batches (stage, owner, dag_id, run_id, try_number, epoch, started_at, claimed, counts)
VALUES (:stage, :owner, :dag_id, :run_id, :try_number, :epoch,
        DATEADD(millisecond, 0 - CAST(:duration_ms AS int), SYSUTCDATETIME()), :claimed, :counts)

-- name: batches_by_owner
-- The batches that wrote a message's events (:owners: the trail's node_ids, a JSON list).
SELECT b.id, b.stage, b.owner, b.dag_id, b.run_id, b.try_number, b.epoch,
       DATEDIFF_BIG(millisecond, '1970-01-01', b.started_at) AS started_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', b.finished_at) AS finished_ms, b.claimed, b.counts
  FROM stage_batches AS b
 WHERE b.owner IN (SELECT CAST(value AS nvarchar(400)) FROM OPENJSON(:owners))
 ORDER BY b.id

-- name: batches_recent
-- The latest micro-batches, newest first (optionally of one stage).
SELECT TOP (CAST(:limit AS int))
       b.id, b.stage, b.owner, b.dag_id, b.run_id, b.try_number, b.epoch,
       DATEDIFF_BIG(millisecond, '1970-01-01', b.started_at) AS started_ms,
       DATEDIFF_BIG(millisecond, '1970-01-01', b.finished_at) AS finished_ms, b.claimed, b.counts
  FROM stage_batches AS b
 WHERE (:stage IS NULL OR b.stage = :stage)
 ORDER BY b.id DESC

-- name: body_read_event
-- The access log of PHI: one event per read of a message's bodies (event 'body_read'), naming who
-- (node_id 'reader:<surface> <who>') and through which surface (the detail); `at` is the store's
-- clock (the column's default). The row's status is unchanged (to_status = from_status).
INSERT INTO message_events (stage, row_id, message_id, control_id, destination, event,
                            from_status, to_status, epoch, node_id, attempt, detail)
VALUES ('inbound', CAST(:id AS bigint), :message_id, :control_id, NULL, 'body_read', :status, :status,
        NULL, :actor, NULL, :detail)

-- name: inbound_ref_by_message_id
-- The hot inbound row with this message id (its unique index): how `resolve` reads a ref, so an
-- unknown one costs one index probe, not a read of the table as the search's optional filters would.
SELECT max(id) AS id FROM stage_inbound WHERE message_id = :ref

-- name: inbound_ref_by_control_id
-- The newest hot inbound row with this control id (stage_inbound_control).
SELECT max(id) AS id FROM stage_inbound WHERE control_id = :ref
