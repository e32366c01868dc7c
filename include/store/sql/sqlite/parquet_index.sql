-- The Parquet archive's lookup index (migration 0014, spark_jobs/archive_job.py, include/store/parquet_archive.py).
-- parquet_index_*: in the fenced transaction that notes a batch written, while its rows are still in
-- the archive table (read through its export_batch index), the keys it holds; parquet_partition_add:
-- each partition directory it wrote. parquet_find_*: the partition directories holding a key, read
-- through one index each; no row, no Parquet file opened.

-- name: parquet_partition_add
INSERT INTO parquet_partitions (batch, kind, part)
SELECT :batch, :kind, :part
 WHERE EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: parquet_index_inbound
INSERT INTO parquet_index (kind, row_key, text_key, control_id, batch)
SELECT 'inbound', r.id, r.message_id, r.control_id, :batch
  FROM archive_inbound r
 WHERE r.export_batch = :batch AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: parquet_index_routed
INSERT INTO parquet_index (kind, row_key, batch)
SELECT DISTINCT 'routed', r.source_id, :batch
  FROM archive_routed r
 WHERE r.export_batch = :batch AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: parquet_index_outbound
INSERT INTO parquet_index (kind, row_key, batch)
SELECT DISTINCT 'outbound', r.source_id, :batch
  FROM archive_outbound r
 WHERE r.export_batch = :batch AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: parquet_index_events
INSERT INTO parquet_index (kind, text_key, batch)
SELECT DISTINCT 'events', r.message_id, :batch
  FROM archive_events r
 WHERE r.export_batch = :batch AND r.message_id IS NOT NULL AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: parquet_index_batches
INSERT INTO parquet_index (kind, text_key, batch)
SELECT 'batches', r.batch_id, :batch
  FROM archive_inbound_batches r
 WHERE r.export_batch = :batch AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: parquet_find_by_row
-- The partitions holding rows of :kind keyed by :id (an inbound row id; a routed or outbound
-- row's source_id).
SELECT p.batch, p.part
  FROM parquet_index i JOIN parquet_partitions p ON p.batch = i.batch
 WHERE i.kind = :kind AND i.row_key = :id AND i.row_key IS NOT NULL

-- name: parquet_find_by_text
-- The partitions holding rows of :kind keyed by :ref (a message id; an HL7 batch id).
SELECT p.batch, p.part
  FROM parquet_index i JOIN parquet_partitions p ON p.batch = i.batch
 WHERE i.kind = :kind AND i.text_key = :ref AND i.text_key IS NOT NULL

-- name: parquet_find_by_control
-- The partitions holding inbound rows with control id :ref.
SELECT p.batch, p.part
  FROM parquet_index i JOIN parquet_partitions p ON p.batch = i.batch
 WHERE i.control_id = :ref AND i.control_id IS NOT NULL

-- name: parquet_index_add
-- One key of a batch written before store v14 (ParquetArchive.reindex, from the files).
INSERT INTO parquet_index (kind, row_key, text_key, control_id, batch)
SELECT :kind, CAST(:id AS bigint), :ref, :control_id, :batch
 WHERE EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: parquet_batch_indexed
SELECT 1 AS indexed FROM parquet_partitions WHERE batch = :batch LIMIT 1
