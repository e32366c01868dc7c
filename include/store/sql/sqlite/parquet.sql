-- The Parquet export of the archive tables (spark_jobs/archive_job.py, migration 0009): mark a
-- bounded batch of rows archived longer than :ms ago, record the batch, read it, note it written
-- once Parquet holds it, delete its rows in bounded batches, close it. Every write is fenced by
-- the epoch; the archive_* queries in archive.sql clear export_batch of a row they copy again.
-- A batch is the rows archived longest ago, in the order of the table's unexported index
-- (archived_at, migration 0013): its range is exactly the rows due, so marking reads what it marks.

-- name: export_mark_inbound
UPDATE archive_inbound SET export_batch = :batch
 WHERE id IN (SELECT id FROM archive_inbound WHERE export_batch IS NULL AND archived_at < {now} - :ms ORDER BY archived_at, id LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: export_delete_inbound
DELETE FROM archive_inbound
 WHERE id IN (SELECT id FROM archive_inbound WHERE export_batch = :batch LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: export_read_inbound
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, r.connection AS export_connection
  FROM archive_inbound r
 WHERE r.export_batch = :batch
 ORDER BY r.id

-- name: export_mark_routed
UPDATE archive_routed SET export_batch = :batch
 WHERE id IN (SELECT id FROM archive_routed WHERE export_batch IS NULL AND archived_at < {now} - :ms ORDER BY archived_at, id LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: export_delete_routed
DELETE FROM archive_routed
 WHERE id IN (SELECT id FROM archive_routed WHERE export_batch = :batch LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: export_read_routed
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, COALESCE((SELECT i.connection FROM archive_inbound i WHERE i.id = r.source_id), (SELECT i.connection FROM stage_inbound i WHERE i.id = r.source_id)) AS export_connection
  FROM archive_routed r
 WHERE r.export_batch = :batch
 ORDER BY r.id

-- name: export_mark_outbound
UPDATE archive_outbound SET export_batch = :batch
 WHERE id IN (SELECT id FROM archive_outbound WHERE export_batch IS NULL AND archived_at < {now} - :ms ORDER BY archived_at, id LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: export_delete_outbound
DELETE FROM archive_outbound
 WHERE id IN (SELECT id FROM archive_outbound WHERE export_batch = :batch LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: export_read_outbound
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, COALESCE((SELECT i.connection FROM archive_inbound i WHERE i.id = r.source_id), (SELECT i.connection FROM stage_inbound i WHERE i.id = r.source_id)) AS export_connection
  FROM archive_outbound r
 WHERE r.export_batch = :batch
 ORDER BY r.id

-- name: export_mark_events
UPDATE archive_events SET export_batch = :batch
 WHERE id IN (SELECT id FROM archive_events WHERE export_batch IS NULL AND archived_at < {now} - :ms ORDER BY archived_at, id LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: export_delete_events
DELETE FROM archive_events
 WHERE id IN (SELECT id FROM archive_events WHERE export_batch = :batch LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING id

-- name: export_read_events
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, COALESCE(r.connection, (SELECT max(i.connection) FROM archive_inbound i WHERE i.message_id = r.message_id)) AS export_connection
  FROM archive_events r
 WHERE r.export_batch = :batch
 ORDER BY r.id

-- name: export_mark_batches
UPDATE archive_inbound_batches SET export_batch = :batch
 WHERE batch_id IN (SELECT batch_id FROM archive_inbound_batches WHERE export_batch IS NULL AND archived_at < {now} - :ms ORDER BY archived_at, batch_id LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING batch_id

-- name: export_delete_batches
DELETE FROM archive_inbound_batches
 WHERE batch_id IN (SELECT batch_id FROM archive_inbound_batches WHERE export_batch = :batch LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
RETURNING batch_id

-- name: export_read_batches
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, r.connection AS export_connection
  FROM archive_inbound_batches r
 WHERE r.export_batch = :batch
 ORDER BY r.batch_id

-- name: export_open
INSERT INTO archive_exports (batch, kind, row_count, epoch)
SELECT :batch, :kind, :row_count, :epoch
 WHERE EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_open_batches
-- A run resumes these first, oldest first.
SELECT batch, kind, row_count, state FROM archive_exports ORDER BY created_at, batch

-- name: export_written
UPDATE archive_exports SET state = 'written'
 WHERE batch = :batch AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_close
DELETE FROM archive_exports
 WHERE batch = :batch AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
