-- The Parquet export of the archive tables (spark_jobs/archive_job.py, migration 0009): mark a
-- bounded batch of rows archived longer than :ms ago, record the batch, read it, note it written
-- once Parquet holds it, delete its rows in bounded batches, close it. Every write is fenced by
-- the epoch; the archive_* queries in archive.sql clear export_batch of a row they copy again.
-- A batch is the rows archived longest ago, in the order of the table's unexported index
-- (archived_at, migration 0013): its range is exactly the rows due, so marking reads what it marks.

-- name: export_mark_inbound
UPDATE t SET t.export_batch = :batch
OUTPUT inserted.id
  FROM archive_inbound AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM archive_inbound AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch IS NULL AND x.archived_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                 ORDER BY x.archived_at, x.id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_delete_inbound
DELETE t
OUTPUT deleted.id
  FROM archive_inbound AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM archive_inbound AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch = :batch)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_read_inbound
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, r.connection AS export_connection
  FROM archive_inbound AS r
 WHERE r.export_batch = :batch
 ORDER BY r.id

-- name: export_mark_routed
UPDATE t SET t.export_batch = :batch
OUTPUT inserted.id
  FROM archive_routed AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM archive_routed AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch IS NULL AND x.archived_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                 ORDER BY x.archived_at, x.id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_delete_routed
DELETE t
OUTPUT deleted.id
  FROM archive_routed AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM archive_routed AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch = :batch)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_read_routed
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, COALESCE((SELECT i.connection FROM archive_inbound AS i WHERE i.id = r.source_id), (SELECT i.connection FROM stage_inbound AS i WHERE i.id = r.source_id)) AS export_connection
  FROM archive_routed AS r
 WHERE r.export_batch = :batch
 ORDER BY r.id

-- name: export_mark_outbound
UPDATE t SET t.export_batch = :batch
OUTPUT inserted.id
  FROM archive_outbound AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM archive_outbound AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch IS NULL AND x.archived_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                 ORDER BY x.archived_at, x.id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_delete_outbound
DELETE t
OUTPUT deleted.id
  FROM archive_outbound AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM archive_outbound AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch = :batch)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_read_outbound
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, COALESCE((SELECT i.connection FROM archive_inbound AS i WHERE i.id = r.source_id), (SELECT i.connection FROM stage_inbound AS i WHERE i.id = r.source_id)) AS export_connection
  FROM archive_outbound AS r
 WHERE r.export_batch = :batch
 ORDER BY r.id

-- name: export_mark_events
UPDATE t SET t.export_batch = :batch
OUTPUT inserted.id
  FROM archive_events AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM archive_events AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch IS NULL AND x.archived_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                 ORDER BY x.archived_at, x.id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_delete_events
DELETE t
OUTPUT deleted.id
  FROM archive_events AS t
 WHERE t.id IN (SELECT TOP (:limit) x.id FROM archive_events AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch = :batch)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_read_events
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, COALESCE(r.connection, (SELECT max(i.connection) FROM archive_inbound AS i WHERE i.message_id = r.message_id)) AS export_connection
  FROM archive_events AS r
 WHERE r.export_batch = :batch
 ORDER BY r.id

-- name: export_mark_batches
UPDATE t SET t.export_batch = :batch
OUTPUT inserted.batch_id
  FROM archive_inbound_batches AS t
 WHERE t.batch_id IN (SELECT TOP (:limit) x.batch_id FROM archive_inbound_batches AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch IS NULL AND x.archived_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                 ORDER BY x.archived_at, x.batch_id)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_delete_batches
DELETE t
OUTPUT deleted.batch_id
  FROM archive_inbound_batches AS t
 WHERE t.batch_id IN (SELECT TOP (:limit) x.batch_id FROM archive_inbound_batches AS x WITH (READPAST, ROWLOCK)
                 WHERE x.export_batch = :batch)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: export_read_batches
-- Every column, and the connection the message came in on (Parquet is partitioned by it).
SELECT r.*, r.connection AS export_connection
  FROM archive_inbound_batches AS r
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
