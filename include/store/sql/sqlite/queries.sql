-- Stageline named queries, SQLite.
-- Parameters are written :name; {table} and {dest} come from the staged-table catalogue and {now}
-- is SQLite's clock in epoch milliseconds. Writers run inside BEGIN IMMEDIATE: SQLite has one
-- writer at a time, so it needs no row locks or SKIP LOCKED.

-- name: bootstrap
CREATE TABLE IF NOT EXISTS schema_version (
    version      INTEGER PRIMARY KEY,
    description  TEXT    NOT NULL,
    applied_at   INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
)

-- name: migrate_lock
SELECT 1

-- name: schema_version_current
SELECT coalesce(max(version), 0) AS version FROM schema_version

-- name: schema_version_record
INSERT INTO schema_version (version, description) VALUES (:version, :description)

-- name: identity_get
SELECT cluster_id, cluster_name, config_version FROM cluster_identity WHERE id = 1

-- name: identity_insert
INSERT OR IGNORE INTO cluster_identity (id, cluster_id, cluster_name) VALUES (1, :cluster_id, :cluster_name)

-- name: db_now
SELECT {now} / 1000.0 AS db_now

-- name: step_timeout
-- SQLite bounds waits with busy_timeout, set per connection.
SELECT :ms AS timeout

-- name: fence_shared
-- BEGIN IMMEDIATE already serializes every writer.
SELECT 1

-- name: fence_exclusive
SELECT 1

-- name: lease_read
SELECT owner, epoch, recovered_epoch, expires_at / 1000.0 AS expires_at,
       acquired_at / 1000.0 AS acquired_at,
       (owner IS NOT NULL AND (expires_at IS NULL OR expires_at > {now})) AS live,
       {now} / 1000.0 AS db_now
  FROM leader_lease WHERE id = 1

-- name: lease_read_locked
SELECT owner, epoch, recovered_epoch, expires_at / 1000.0 AS expires_at,
       acquired_at / 1000.0 AS acquired_at,
       (owner IS NOT NULL AND (expires_at IS NULL OR expires_at > {now})) AS live,
       {now} / 1000.0 AS db_now
  FROM leader_lease WHERE id = 1

-- name: lease_renew
UPDATE leader_lease
   SET renewed_at = {now}, expires_at = {now} + CAST(:ttl * 1000 AS INTEGER)
 WHERE id = 1 AND owner = :owner AND epoch = :epoch AND expires_at > {now}
RETURNING epoch, expires_at / 1000.0 AS expires_at

-- name: lease_acquire
UPDATE leader_lease
   SET owner = :owner, epoch = epoch + 1, acquired_at = {now}, renewed_at = {now},
       expires_at = {now} + CAST(:ttl * 1000 AS INTEGER)
 WHERE id = 1 AND epoch = :prev_epoch
RETURNING epoch, expires_at / 1000.0 AS expires_at

-- name: lease_acquire_permanent
UPDATE leader_lease
   SET owner = :owner, epoch = epoch + 1, acquired_at = {now}, renewed_at = {now}, expires_at = NULL
 WHERE id = 1
RETURNING epoch, NULL AS expires_at

-- name: lease_release
UPDATE leader_lease SET expires_at = {now}
 WHERE id = 1 AND owner = :owner AND epoch = :epoch AND (expires_at IS NULL OR expires_at > {now})

-- name: node_heartbeat
INSERT INTO nodes (node_id, host, pid, status, is_leader, config_hash, cannot_bind)
VALUES (:node_id, :host, :pid, 'active', :is_leader, :config_hash, :cannot_bind)
ON CONFLICT (node_id) DO UPDATE
   SET status = 'active', last_seen = {now}, is_leader = excluded.is_leader,
       config_hash = excluded.config_hash, cannot_bind = excluded.cannot_bind

-- name: node_leave
UPDATE nodes SET status = 'left', is_leader = 0, last_seen = {now} WHERE node_id = :node_id

-- name: nodes_list
SELECT node_id, host, pid, status, is_leader, config_hash, cannot_bind,
       started_at / 1000.0 AS started_at, last_seen / 1000.0 AS last_seen,
       (status = 'active' AND last_seen > {now} - CAST(:node_timeout * 1000 AS INTEGER)) AS fresh
  FROM nodes ORDER BY started_at, node_id

-- name: claim_batch
-- Up to :limit due rows in id order, in lane order: a row is skipped while an earlier
-- row of its lane is still open and not claimable now (in_flight, or backing off), so a stranded
-- row is finished before anything newer in its lane moves on. NULL lanes are never held back.
UPDATE {table}
   SET status = 'in_flight', lease_owner = :owner, claim_epoch = :epoch,
       lease_expires_at = {now} + CAST(:lease_seconds * 1000 AS INTEGER),
       attempts = attempts + 1, updated_at = {now}
 WHERE id IN (SELECT t.id FROM {table} t
               WHERE t.status IN ('pending', 'error')
                 AND (t.next_attempt_at IS NULL OR t.next_attempt_at <= {now})
                 AND (t.lane_key IS NULL OR NOT EXISTS (SELECT 1 FROM {table} e
                                  WHERE e.status IN ('in_flight', 'error') AND e.lane_key = t.lane_key
                                    AND e.id < t.id AND (e.status = 'in_flight' OR e.next_attempt_at > {now})))
               ORDER BY t.id LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id, message_id, control_id, lane_key, attempts, {dest} AS destination

-- name: claim_lane_heads
-- Per-lane FIFO: the first :per_lane open rows of up to :limit lanes (lanes ordered by their oldest
-- open row), each lane cut before its first row that is in flight or backing off — so a lane whose
-- head is held gives nothing, and one claim never leaves a gap in a lane. At most :max_rows rows in
-- all, taken round-robin (every lane's first row, then every lane's second, ...), so a cut still
-- leaves each lane a prefix and a one-lane backlog moves :max_rows rows a round, not :per_lane.
-- Two concurrent claimers rank the rows they both see the same way and so take nested prefixes:
-- whatever one took, the other's outer status check (evaluated under the row lock) skips. NULL lane
-- keys form one lane. The held-row probe is two: an equality on the lane (the held-lane index, one
-- seek a candidate) and a branch of its own for the NULL lane — an `OR` of the two, or a NULL-safe
-- comparison, keeps the index out and walks every earlier row of the table for each candidate
-- (issue 22: 34,000 candidates over 150,000 rows held SQLite's write lock for minutes).
UPDATE {table}
   SET status = 'in_flight', lease_owner = :owner, claim_epoch = :epoch,
       lease_expires_at = {now} + CAST(:lease_seconds * 1000 AS INTEGER),
       attempts = attempts + 1, updated_at = {now}
 WHERE id IN (SELECT x.id
                FROM (SELECT r.id, r.rn, DENSE_RANK() OVER (ORDER BY r.head) AS lane_no
                        FROM (SELECT o.id, o.rn, MIN(o.id) OVER (PARTITION BY o.lane_key) AS head
                                FROM (SELECT id, lane_key, ROW_NUMBER() OVER (PARTITION BY lane_key ORDER BY id) AS rn
                                        FROM {table} WHERE status IN ('pending', 'error', 'in_flight')) AS o
                               WHERE o.rn <= :per_lane
                                 AND NOT EXISTS (SELECT 1 FROM {table} AS e
                                                  WHERE e.status IN ('in_flight', 'error')
                                                    AND e.lane_key = o.lane_key AND e.id <= o.id
                                                    AND (e.status = 'in_flight' OR e.next_attempt_at > {now}))
                                 AND NOT (o.lane_key IS NULL
                                          AND EXISTS (SELECT 1 FROM {table} AS e
                                                       WHERE e.status IN ('in_flight', 'error')
                                                         AND e.lane_key IS NULL AND e.id <= o.id
                                                         AND (e.status = 'in_flight' OR e.next_attempt_at > {now})))) AS r) AS x
               WHERE x.lane_no <= :limit
               ORDER BY x.rn, x.lane_no
               LIMIT :max_rows)
   AND status IN ('pending', 'error')
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id, message_id, control_id, lane_key, attempts, {dest} AS destination

-- name: finish_batch
UPDATE {table}
   SET status = :status, lease_owner = NULL, lease_expires_at = NULL, next_attempt_at = NULL,
       last_error = :error, updated_at = {now}
 WHERE id IN (SELECT value FROM json_each(:ids))
   AND status = 'in_flight' AND lease_owner = :owner AND claim_epoch = :epoch
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id, message_id, control_id, attempts, status, {dest} AS destination, last_error AS detail

-- name: fail_batch
UPDATE {table}
   SET status = CASE WHEN attempts >= :max_attempts THEN 'dead' ELSE 'error' END,
       next_attempt_at = CASE WHEN attempts >= :max_attempts THEN NULL
                              ELSE {now} + CAST(1000 * min(:max_backoff_seconds,
                                       :backoff_seconds * (1 << (attempts - 1))) AS INTEGER) END,
       lease_owner = NULL, lease_expires_at = NULL, last_error = :error, updated_at = {now}
 WHERE id IN (SELECT value FROM json_each(:ids))
   AND status = 'in_flight' AND lease_owner = :owner AND claim_epoch = :epoch
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id, message_id, control_id, attempts, status, {dest} AS destination, last_error AS detail

-- name: sweep_expired
-- A row whose claimers keep dying (a poison batch) is dead-lettered once it has used :max_attempts.
-- The leases that ran out first go first: ordered as the in-flight index is, the sweep reads only
-- expired rows (ordered by id, SQLite walked the whole table in id order looking for them).
UPDATE {table}
   SET status = CASE WHEN attempts >= :max_attempts THEN 'dead' ELSE 'pending' END,
       lease_owner = NULL, lease_expires_at = NULL, updated_at = {now},
       last_error = 'row lease of ' || lease_owner || ' (epoch ' || claim_epoch || ') expired'
                    || CASE WHEN attempts >= :max_attempts THEN ' after ' || attempts || ' attempts' ELSE '' END
 WHERE id IN (SELECT id FROM {table}
               WHERE status = 'in_flight' AND lease_expires_at <= {now}
               ORDER BY lease_expires_at, id LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id, message_id, control_id, attempts, status, {dest} AS destination, last_error AS detail

-- name: recovery_mark
UPDATE leader_lease SET recovered_epoch = epoch
 WHERE id = 1 AND epoch = :epoch AND recovered_epoch < :epoch
RETURNING epoch

-- name: recover_stale_epoch
UPDATE {table}
   SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL, updated_at = {now},
       last_error = 'recovered on promotion: claimed by ' || lease_owner || ' under epoch ' || claim_epoch
 WHERE status = 'in_flight' AND claim_epoch < :epoch
RETURNING id, message_id, control_id, attempts, status, {dest} AS destination, last_error AS detail

-- name: epoch_current
SELECT epoch FROM leader_lease WHERE id = 1 AND epoch = :epoch

-- name: stage_inbound
-- A file re-read after a crash carries the same message_id: ON CONFLICT makes it a no-op.
-- The bodies follow in stage_inbound_bodies, in the same transaction.
INSERT INTO stage_inbound (message_id, control_id, connection, lane_key, charset, batch_id, batch_seq, findings, format)
SELECT json_extract(m.value, '$.message_id'), json_extract(m.value, '$.control_id'),
       json_extract(m.value, '$.connection'), json_extract(m.value, '$.lane_key'),
       json_extract(m.value, '$.charset'), json_extract(m.value, '$.batch_id'),
       json_extract(m.value, '$.batch_seq'), json_extract(m.value, '$.findings'),
       json_extract(m.value, '$.format')
  FROM json_each(:messages) AS m
 WHERE EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
ON CONFLICT (message_id) DO NOTHING
RETURNING id, message_id, control_id, attempts, status, NULL AS destination, NULL AS detail,
          0 AS events_recorded, 0 AS bodies_written

-- name: stage_inbound_bodies
-- The bodies of the rows stage_inbound has just written (:ids); a message id given twice in one
-- batch keeps the first body, as its row did. `+s.id`: without the unary plus SQLite searches the
-- message-id index by (message_id, rowid) and walks the whole :ids list for every message — n²
-- (4,000 messages: 3.2 s inside the write lock); with it, one probe per message, then the list's
-- own index (40,000 messages: 0.24 s).
INSERT INTO inbound_bodies (id, payload)
SELECT s.id, json_extract(m.value, '$.payload')
  FROM json_each(:messages) AS m
  JOIN stage_inbound s ON s.message_id = json_extract(m.value, '$.message_id')
 WHERE +s.id IN (SELECT value FROM json_each(:ids))
 ORDER BY m.key
ON CONFLICT (id) DO NOTHING

-- name: stage_inbound_batches
-- The batches among the messages just staged (a batch's first message carries its record), in the
-- same transaction. A file re-read after a crash carries the same batch_id: a no-op.
INSERT INTO inbound_batches (batch_id, connection, fhs_control_id, bhs_control_id, declared_count, message_count)
SELECT json_extract(m.value, '$.batch_id'), json_extract(m.value, '$.connection'),
       json_extract(m.value, '$.batch_fhs'), json_extract(m.value, '$.batch_bhs'),
       json_extract(m.value, '$.batch_declared'), json_extract(m.value, '$.batch_size')
  FROM json_each(:messages) AS m
 WHERE json_extract(m.value, '$.batch_seq') = 1
ON CONFLICT (batch_id) DO NOTHING

-- name: stage_inbound_events
-- The 'received' events of the rows stage_inbound has just written (:ids); a batch message's
-- detail names its batch ("batch <id>: message k of n"), anyone else's is empty.
INSERT INTO message_events (stage, row_id, message_id, control_id, event, to_status, epoch, node_id, attempt,
                            detail)
SELECT 'inbound', t.id, t.message_id, t.control_id, 'received', t.status, :epoch, :node_id, t.attempts,
       CASE WHEN t.batch_id IS NULL THEN NULL
            ELSE 'batch ' || t.batch_id || ': message ' || t.batch_seq || ' of '
                 || (SELECT b.message_count FROM inbound_batches b WHERE b.batch_id = t.batch_id) END
  FROM stage_inbound t
 WHERE t.id IN (SELECT value FROM json_each(:ids))
 ORDER BY t.id

-- name: record_events_for
-- One audit event per row of {table} just transitioned (:ids), built from the row itself: its
-- new status, attempts and last_error (the detail). Only the ids travel to the database.
INSERT INTO message_events (stage, row_id, message_id, control_id, destination, event,
                            from_status, to_status, epoch, node_id, attempt, detail)
SELECT :stage, t.id, t.message_id, t.control_id, {dest}, :event, :from_status, t.status,
       :epoch, :node_id, t.attempts, t.last_error
  FROM {table} t
 WHERE t.id IN (SELECT value FROM json_each(:ids))
 ORDER BY t.id

-- name: config_bump
UPDATE cluster_identity SET config_version = config_version + 1 WHERE id = 1
RETURNING config_version

-- name: leader_config_hash
SELECT n.config_hash FROM leader_lease l JOIN nodes n ON n.node_id = l.owner WHERE l.id = 1

-- name: purge_finished_routed
-- Retention: delete up to :limit finished rows unchanged for :ms milliseconds, under the current
-- epoch only (retention is leader work like any other). The status list repeats the partial
-- index's predicate exactly (SQLite uses a partial index only then). Returns the ids deleted.
-- With :archived = 1 a row goes only once archive.sql has copied it as it is now (same id, same
-- updated_at): nothing unarchived is lost.
DELETE FROM stage_routed
 WHERE id IN (SELECT id FROM stage_routed
               WHERE status IN ('done', 'dead') AND updated_at < {now} - :ms
                   AND CASE WHEN instr(:conns, ',' || COALESCE((SELECT i.connection FROM stage_inbound i WHERE i.id = stage_routed.source_id), (SELECT i.connection FROM archive_inbound i WHERE i.id = stage_routed.source_id), '') || ',') > 0 THEN 1 ELSE 0 END = :within
                 AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_routed a
                                                WHERE a.id = stage_routed.id AND a.updated_at = stage_routed.updated_at))
               LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: purge_finished_outbound
-- purge_finished_routed for stage_outbound; a trigger deletes each row's body.
DELETE FROM stage_outbound
 WHERE id IN (SELECT id FROM stage_outbound
               WHERE status IN ('done', 'dead') AND updated_at < {now} - :ms
                   AND CASE WHEN instr(:conns, ',' || COALESCE((SELECT i.connection FROM stage_inbound i WHERE i.id = stage_outbound.source_id), (SELECT i.connection FROM archive_inbound i WHERE i.id = stage_outbound.source_id), '') || ',') > 0 THEN 1 ELSE 0 END = :within
                 AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_outbound a
                                                WHERE a.id = stage_outbound.id AND a.updated_at = stage_outbound.updated_at))
               LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: purge_finished_inbound
-- For stage_inbound, whose finished rows include `unrouted`; a row whose routed rows are still open
-- stays, however old (they read its body), and so does one with an outbound row that has no body of
-- its own (a pass-through row: its body is this one). A trigger deletes each row's body.
DELETE FROM stage_inbound
 WHERE id IN (SELECT s.id FROM stage_inbound s
               WHERE s.status IN ('done', 'dead', 'unrouted') AND s.updated_at < {now} - :ms
                   AND CASE WHEN instr(:conns, ',' || s.connection || ',') > 0 THEN 1 ELSE 0 END = :within
                 AND NOT EXISTS (SELECT 1 FROM stage_routed r
                                  WHERE r.source_id = s.id AND r.status IN ('pending', 'in_flight', 'error'))
                 AND NOT EXISTS (SELECT 1 FROM stage_outbound o
                                  WHERE o.source_id = s.id
                                    AND NOT EXISTS (SELECT 1 FROM outbound_bodies ob WHERE ob.id = o.id))
                 AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_inbound a
                                                WHERE a.id = s.id AND a.updated_at = s.updated_at))
               LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: purge_inbound_batches
-- Retention of HL7 batch records: up to :limit inbound_batches rows older than :ms milliseconds
-- none of whose messages' inbound rows is left in stage_inbound (and, with :archived, whose copy is
-- in archive_inbound_batches); returns the batch ids deleted.
DELETE FROM inbound_batches
 WHERE batch_id IN (SELECT b.batch_id FROM inbound_batches b
                     WHERE b.created_at < {now} - :ms
                       AND NOT EXISTS (SELECT 1 FROM stage_inbound s WHERE s.batch_id = b.batch_id)
                       AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_inbound_batches a
                                                      WHERE a.batch_id = b.batch_id))
                     LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING batch_id

-- name: purge_events
-- Retention of the audit trail: up to :limit events older than :ms milliseconds.
DELETE FROM message_events
 WHERE id IN (SELECT id FROM message_events
               WHERE at < {now} - :ms
                 AND (:archived = 0 OR EXISTS (SELECT 1 FROM archive_events a WHERE a.id = message_events.id))
               LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- Route stage (include/store/stages.py ROUTE, finalize.py finalize_route). Spark reads the claimed rows
-- with route_read_claimed (its parameters inlined as literals: a JDBC `query` takes none), appends
-- its results to landing_routed, and one transaction finalizes with the queries below.

-- name: route_read_claimed
-- Read-only, so Spark's schema probe running it a second time is harmless; the claim itself
-- happened before, in one statement outside Spark. The connection's name is for conditions that test it.
SELECT s.id, s.connection, b.payload, s.findings, s.format
  FROM stage_inbound s JOIN inbound_bodies b ON b.id = s.id
 WHERE s.lease_owner = :owner AND s.claim_epoch = :epoch AND s.status = 'in_flight'

-- name: route_read_task
-- The same rows as route_read_claimed, selected by the stage task's owner prefix (each of its batches
-- claims as <prefix><n>, one batch at a time): the same text every batch, so Spark keeps
-- the plan built on it (spark_jobs.stage_job.KeptPlans). A row an earlier batch could not
-- hand back is read again, and ignored: the finalize takes only the batch's claimed ids.
SELECT s.id, s.connection, b.payload, s.findings, s.format
  FROM stage_inbound s JOIN inbound_bodies b ON b.id = s.id
 WHERE substr(s.lease_owner, 1, length(:prefix)) = :prefix AND s.claim_epoch = :epoch AND s.status = 'in_flight'

-- name: route_pending_ids
SELECT DISTINCT source_id FROM landing_routed WHERE run_id = :run_id AND status = 'pending'

-- name: route_unrouted_ids
SELECT DISTINCT source_id FROM landing_routed WHERE run_id = :run_id AND status = 'unrouted'

-- name: route_finalize_insert
-- :ids are the sources this transaction has just finished, so nothing lands for a source whose
-- claim was lost. ON CONFLICT makes a repeat a no-op, also for duplicate landing rows (a retried
-- Spark task); ORDER BY keeps arrival order in the ids. The WHERE clause also settles SQLite's
-- INSERT … SELECT … ON CONFLICT parsing ambiguity.
-- A row bound for one of :direct (pass-through destinations, route_passthrough_open) is routed
-- straight to `done`: the same finalize gives it its outbound row (passthrough_outbound_insert).
INSERT INTO stage_routed (source_id, message_id, control_id, destination, route_name, lane_key, status)
SELECT l.source_id, i.message_id, i.control_id, l.destination, l.route_name, i.lane_key,
       CASE WHEN l.destination IN (SELECT value FROM json_each(:direct)) THEN 'done' ELSE 'pending' END
  FROM landing_routed l JOIN stage_inbound i ON i.id = l.source_id
 WHERE l.run_id = :run_id AND l.status = 'pending'
   AND l.source_id IN (SELECT value FROM json_each(:ids))
 ORDER BY l.source_id, l.destination
ON CONFLICT (source_id, destination) DO NOTHING
RETURNING id, message_id, control_id, attempts, status, destination, NULL AS detail

-- name: route_passthrough_open
-- Of the pass-through destinations (:names), those with routed rows still open: their new rows go
-- through the transform stage like the open ones, so the lane keeps its order (postgres/queries.sql).
-- One probe a name of the open rows' own index (stage_routed_open_destination, version 22), whose
-- predicate the subquery repeats word for word (SQLite uses a partial index only then).
SELECT n.value AS destination FROM json_each(:names) AS n
 WHERE EXISTS (SELECT 1 FROM stage_routed
                WHERE status IN ('pending', 'in_flight', 'error') AND destination <> ''
                  AND destination = n.value)

-- name: landing_routed_delete
DELETE FROM landing_routed WHERE run_id = :run_id

-- name: landing_routed_delete_sources
-- Leftovers of earlier runs that died between landing and finalize, for sources now finished.
DELETE FROM landing_routed WHERE source_id IN (SELECT value FROM json_each(:ids))

-- name: deliver_read_claimed
-- The deliver stage's read of the lane heads it claimed. Read-only and bounded by owner + epoch (no
-- id list), so it also serves as a Spark JDBC `query` unchanged; no ORDER BY (Spark wraps it in a
-- subquery), the caller orders by id. The body through outbound_messages, the one place that says
-- which it is (a pass-through row has none of its own and sends its inbound row's).
SELECT o.id, o.destination, o.lane_key, o.payload, o.content_type, o.idempotency_key, o.attempts, o.message_id,
       o.control_id
  FROM outbound_messages o
 WHERE o.lease_owner = :owner AND o.claim_epoch = :epoch AND o.status = 'in_flight'

-- name: work_pending
-- What a waiting stage run polls: the current epoch (has leadership moved?), whether the lease is
-- live (has the leader died?) and whether any row is due to be claimed (pending, or failed and
-- past its backoff).
SELECT l.epoch,
       (l.owner IS NOT NULL AND (l.expires_at IS NULL OR l.expires_at > {now})) AS live,
       EXISTS (SELECT 1 FROM {table}
                WHERE status IN ('pending', 'error')
                  AND (next_attempt_at IS NULL OR next_attempt_at <= {now})) AS due
  FROM leader_lease l WHERE l.id = 1

-- name: transform_read_claimed
-- Read-only (Spark's schema probe may run it twice), bounded by owner + epoch.
SELECT r.id, r.source_id, r.destination, b.payload, r.message_id, r.control_id, i.connection
  FROM stage_routed r JOIN inbound_bodies b ON b.id = r.source_id
  LEFT JOIN stage_inbound i ON i.id = r.source_id
 WHERE r.lease_owner = :owner AND r.claim_epoch = :epoch AND r.status = 'in_flight'

-- name: transform_read_task
-- The same rows as transform_read_claimed, selected by the stage task's owner prefix (each of its batches
-- claims as <prefix><n>, one batch at a time): the same text every batch, so Spark keeps
-- the plan built on it (spark_jobs.stage_job.KeptPlans). A row an earlier batch could not
-- hand back is read again, and ignored: the finalize takes only the batch's claimed ids.
SELECT r.id, r.source_id, r.destination, b.payload, r.message_id, r.control_id, i.connection
  FROM stage_routed r JOIN inbound_bodies b ON b.id = r.source_id
  LEFT JOIN stage_inbound i ON i.id = r.source_id
 WHERE substr(r.lease_owner, 1, length(:prefix)) = :prefix AND r.claim_epoch = :epoch AND r.status = 'in_flight'

-- name: transform_landed
-- One line per routed row this run landed; ok = 0 when the message could not be transformed (or a
-- rule or code hook dead-lettered it), and then detail is why: a NULL payload's content_type
-- carries the reason (spark_jobs/transform_job.py).
SELECT routed_id AS id, min(CASE WHEN payload IS NULL THEN 0 ELSE 1 END) AS ok,
       max(CASE WHEN payload IS NULL THEN content_type END) AS detail
  FROM landing_outbound WHERE run_id = :run_id GROUP BY routed_id

-- name: transform_finalize_insert
-- :ids are the routed rows this transaction has just finished. The idempotency key is the inbound
-- message id and the destination: stable across re-runs and re-deliveries. ON CONFLICT makes a
-- repeat a no-op (GROUP BY keeps one of duplicate landing rows); ORDER BY keeps the routed (arrival)
-- order in the outbound ids, which is lane order. The WHERE clause settles SQLite's
-- INSERT … SELECT … ON CONFLICT parsing ambiguity.
INSERT INTO stage_outbound (source_id, message_id, control_id, destination, content_type, idempotency_key,
                            lane_key)
SELECT l.source_id, l.message_id, l.control_id, l.destination, l.content_type,
       l.message_id || '-' || l.destination, l.lane_key
  FROM landing_outbound l
 WHERE l.run_id = :run_id AND l.payload IS NOT NULL
   AND l.routed_id IN (SELECT value FROM json_each(:ids))
 GROUP BY l.routed_id
 ORDER BY l.routed_id
ON CONFLICT DO NOTHING
RETURNING id, message_id, control_id, attempts, status, destination, NULL AS detail

-- name: transform_finalize_bodies
-- The bodies of the outbound rows transform_finalize_insert has just written (:ids), from the
-- same landed rows; written once, never rewritten by a state change. `+o.id` keeps the :ids list
-- out of the index search, which would walk the whole list for every landed row (n²; see
-- stage_inbound_bodies).
INSERT INTO outbound_bodies (id, payload)
SELECT o.id, l.payload
  FROM stage_outbound o
  JOIN landing_outbound l ON l.source_id = o.source_id AND l.destination = o.destination
 WHERE +o.id IN (SELECT value FROM json_each(:ids)) AND l.run_id = :run_id AND l.payload IS NOT NULL
 GROUP BY o.id
ON CONFLICT (id) DO NOTHING

-- name: transform_passthrough_ids
-- Of the routed rows this run claimed and Spark did not land (:ids), those bound for a destination
-- that passes messages through unchanged (:names: no transform spec, one lane for the destination):
-- the finalize moves them here, in SQL, without Spark reading, rewriting or landing their bodies.
-- Few get here: the route finalize hands most of them on itself (route_passthrough_open).
SELECT id FROM stage_routed
 WHERE id IN (SELECT value FROM json_each(:ids)) AND destination IN (SELECT value FROM json_each(:names))

-- name: passthrough_outbound_insert
-- The outbound rows of pass-through routed rows this transaction has just finished (:ids) — in the
-- transform finalize, or in the route finalize for rows it routed straight to `done` — in routed
-- (arrival) order: HL7 content type, the destination's own lane, the same idempotency key as
-- the landed path. ON CONFLICT makes a repeat a no-op.
INSERT INTO stage_outbound (source_id, message_id, control_id, destination, content_type, idempotency_key,
                            lane_key)
SELECT r.source_id, r.message_id, r.control_id, r.destination, 'application/hl7-v2',
       r.message_id || '-' || r.destination, r.destination
  FROM stage_routed r
 WHERE r.id IN (SELECT value FROM json_each(:ids))
 ORDER BY r.id
ON CONFLICT DO NOTHING
RETURNING id, message_id, control_id, attempts, status, destination, NULL AS detail

-- name: landing_outbound_delete
DELETE FROM landing_outbound WHERE run_id = :run_id

-- name: landing_outbound_delete_sources
-- Leftovers of earlier runs that died between landing and finalize, for routed rows now finished.
DELETE FROM landing_outbound WHERE routed_id IN (SELECT value FROM json_each(:ids))

-- name: lookup_entries_all
SELECT table_name, code, value FROM lookup_entries ORDER BY table_name, code

-- name: lookup_tables
SELECT table_name, count(*) AS entries, max(updated_at) / 1000.0 AS updated_at
  FROM lookup_entries GROUP BY table_name ORDER BY table_name

-- name: lookup_delete_table
DELETE FROM lookup_entries WHERE table_name = :table_name

-- name: lookup_insert
-- :entries is a JSON array of {"code", "value"} objects: one statement per table, however large.
INSERT INTO lookup_entries (table_name, code, value)
SELECT :table_name, json_extract(e.value, '$.code'), json_extract(e.value, '$.value')
  FROM json_each(:entries) AS e

-- name: landing_routed_insert
-- The small-batch path: a run of a few rows lands them in one statement instead of a Spark JDBC
-- write (a Spark job of its own). :rows is a JSON array of landing rows.
INSERT INTO landing_routed (run_id, source_id, destination, route_name, status)
SELECT json_extract(r.value, '$.run_id'), json_extract(r.value, '$.source_id'),
       json_extract(r.value, '$.destination'), json_extract(r.value, '$.route_name'),
       json_extract(r.value, '$.status')
  FROM json_each(:rows) AS r

-- name: landing_outbound_insert
INSERT INTO landing_outbound (run_id, source_id, routed_id, destination, content_type, lane_key, payload,
                              message_id, control_id)
SELECT json_extract(r.value, '$.run_id'), json_extract(r.value, '$.source_id'),
       json_extract(r.value, '$.routed_id'), json_extract(r.value, '$.destination'),
       json_extract(r.value, '$.content_type'), json_extract(r.value, '$.lane_key'),
       json_extract(r.value, '$.payload'), json_extract(r.value, '$.message_id'),
       json_extract(r.value, '$.control_id')
  FROM json_each(:rows) AS r

-- name: release_batch
-- Hand claimed rows back untouched (claimed but never attempted: an earlier row of their lane
-- failed first): pending again, the claim's attempt not counted.
UPDATE {table}
   SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL, attempts = attempts - 1, updated_at = {now}
 WHERE id IN (SELECT value FROM json_each(:ids)) AND status = 'in_flight' AND lease_owner = :owner
   AND claim_epoch = :epoch
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: renew_claims
-- A live stage task keeps its claim: the rows it holds get a fresh row lease, so only a claimer
-- that stopped renewing (its process died) lets its rows expire.
UPDATE {table}
   SET lease_expires_at = {now} + CAST(:lease_seconds * 1000 AS INTEGER)
 WHERE status = 'in_flight' AND lease_owner = :owner AND claim_epoch = :epoch
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: recover_abandoned
-- Owner-scoped recovery: re-pend the rows held by earlier tasks of one stage DAG (owners starting
-- with :prefix), except the asking task's own (owners starting with :keep). Airflow starts a task
-- of a stage DAG only after the previous one ended (one run at a time, a retry after the try
-- failed), so those claimers are dead. Poison rows are dead-lettered as the sweep does.
UPDATE {table}
   SET status = CASE WHEN attempts >= :max_attempts THEN 'dead' ELSE 'pending' END,
       lease_owner = NULL, lease_expires_at = NULL, updated_at = {now},
       last_error = 'recovered: its claimer ' || lease_owner || ' (epoch ' || claim_epoch || ') has ended'
                    || CASE WHEN attempts >= :max_attempts THEN ' after ' || attempts || ' attempts' ELSE '' END
 WHERE status = 'in_flight' AND substr(lease_owner, 1, length(:prefix)) = :prefix
   AND substr(lease_owner, 1, length(:keep)) <> :keep
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id, message_id, control_id, attempts, status, {dest} AS destination, last_error AS detail

-- name: lease_watch
-- What a running stage task checks every heartbeat: has the epoch moved on, has the lease lapsed.
SELECT epoch, (owner IS NOT NULL AND (expires_at IS NULL OR expires_at > {now})) AS live
  FROM leader_lease WHERE id = 1

-- name: read_timeout
-- SQLite has no statement timeout: Store.bounded's progress handler ends a read after :ms.
SELECT :ms AS timeout
