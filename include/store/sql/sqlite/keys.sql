-- Business keys (include/store/keys.py, migration 0016); postgres/keys.sql says what each does.
-- Times are epoch milliseconds already.

-- name: keys_progress
SELECT last_id, until_id FROM key_progress WHERE id = 1

-- name: keys_of_claimed
SELECT i.id, i.connection, i.created_at AS created_ms, b.payload
  FROM stage_inbound i
  LEFT JOIN inbound_bodies b ON b.id = i.id
 WHERE i.id IN (SELECT value FROM json_each(:ids))

-- name: keys_pending
SELECT i.id, i.connection, i.created_at AS created_ms,
       (SELECT b.payload FROM inbound_bodies b WHERE b.id = i.id) AS payload
  FROM stage_inbound i
 WHERE i.id > :after_id AND i.id <= :until_id
 ORDER BY i.id
 LIMIT :limit

-- name: keys_insert
INSERT OR IGNORE INTO message_keys (message, name, value, received_at, connection)
SELECT json_extract(r.value, '$.message'), json_extract(r.value, '$.name'), json_extract(r.value, '$.value'),
       json_extract(r.value, '$.received_ms'), json_extract(r.value, '$.connection')
  FROM json_each(:rows) AS r

-- name: keys_advance
UPDATE key_progress SET last_id = :last_id, updated_at = {now}
 WHERE id = 1 AND last_id < :last_id

-- name: keys_find
SELECT k.message AS id, k.name, k.value AS key_value, k.connection, k.received_at AS created_ms,
       COALESCE(i.message_id, a.message_id) AS message_id, COALESCE(i.control_id, a.control_id) AS control_id,
       COALESCE(i.status, a.status) AS status,
       CASE WHEN i.id IS NOT NULL THEN 'hot' WHEN a.id IS NOT NULL THEN 'archive' ELSE 'parquet' END AS tier
  FROM message_keys k
  LEFT JOIN stage_inbound i ON i.id = k.message
  LEFT JOIN archive_inbound a ON a.id = k.message
 WHERE k.name = :name
   AND k.value >= :lo AND k.value < :hi
   AND k.received_at >= :since_ms AND k.received_at < :until_ms
   AND k.message < :before_id
 ORDER BY k.message DESC
 LIMIT :limit

-- name: keys_of_message
SELECT name, value AS key_value FROM message_keys WHERE message = :id ORDER BY name, value

-- name: keys_purge
DELETE FROM message_keys
 WHERE message IN (SELECT k.message FROM message_keys k
                    WHERE k.received_at < {now} - :ms
                      AND NOT EXISTS (SELECT 1 FROM stage_inbound i WHERE i.id = k.message)
                      AND NOT EXISTS (SELECT 1 FROM archive_inbound a WHERE a.id = k.message)
                      AND NOT EXISTS (SELECT 1 FROM parquet_index p
                                       WHERE p.kind = 'inbound' AND p.row_key = k.message AND p.row_key IS NOT NULL)
                    ORDER BY k.received_at
                    LIMIT :limit)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: search_save
INSERT INTO saved_searches (name, query, saved_by) VALUES (:name, :query, :actor)
ON CONFLICT (name) DO UPDATE SET query = excluded.query, saved_by = excluded.saved_by, saved_at = {now}

-- name: search_add
-- A new name only: no row when the name is taken (the caller says to --replace).
INSERT INTO saved_searches (name, query, saved_by) VALUES (:name, :query, :actor)
ON CONFLICT (name) DO NOTHING

-- name: search_list
SELECT name, query, saved_by, saved_at AS saved_ms FROM saved_searches
 WHERE name > :after ORDER BY name LIMIT :limit

-- name: search_get
SELECT name, query, saved_by, saved_at AS saved_ms FROM saved_searches WHERE name = :name

-- name: search_delete
DELETE FROM saved_searches WHERE name = :name

-- name: content_find
-- :pattern is a GLOB pattern (case-sensitive, as PostgreSQL's LIKE; SQLite's LIKE is not), the
-- user's text with GLOB's own characters bracketed. Each body is read by its key.
SELECT w.* FROM (
  SELECT i.id, i.message_id, i.control_id, i.connection, i.status, i.created_at AS created_ms,
         (SELECT b.payload FROM inbound_bodies b WHERE b.id = i.id) AS payload
    FROM stage_inbound i
   WHERE i.created_at >= :since_ms AND i.created_at < :until_ms
     AND i.id < :before_id
     AND (:connection IS NULL OR i.connection = :connection)
   ORDER BY i.id DESC) w
 WHERE w.payload GLOB :pattern
 LIMIT :limit

-- name: content_index_present
SELECT 0 AS n
