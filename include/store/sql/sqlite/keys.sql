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

-- name: search_case_twin
-- Another saved search whose name differs from :name only by case (names are ASCII).
SELECT name FROM saved_searches WHERE LOWER(name) = LOWER(:name) AND name <> :name

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

-- name: content_find_indexed
-- The same search where the operator made the FTS5 trigram index (`stageline messages content-index`):
-- the bodies holding :pattern, newest first as the index returns them (so a text most bodies hold
-- stops at the page, not after sorting them all), then the window; CROSS JOIN keeps the index the
-- outer loop (the planner would otherwise probe it once per row of the window).
SELECT i.id, i.message_id, i.control_id, i.connection, i.status, i.created_at AS created_ms, b.payload
  FROM inbound_bodies_fts f
 CROSS JOIN stage_inbound i
 CROSS JOIN inbound_bodies b
 WHERE f.payload GLOB :pattern AND f.rowid < :before_id AND i.id = f.rowid AND b.id = i.id
   AND i.created_at >= :since_ms AND i.created_at < :until_ms
   AND (:connection IS NULL OR i.connection = :connection)
 ORDER BY f.rowid DESC
 LIMIT :limit

-- name: content_index_present
SELECT count(*) AS n FROM sqlite_master WHERE type = 'table' AND name = 'inbound_bodies_fts'

-- name: content_index_table
-- An FTS5 index of the bodies by trigram, case-sensitive (so GLOB, the search's operator, uses it),
-- reading its text from inbound_bodies (external content: no second copy of each body).
CREATE VIRTUAL TABLE IF NOT EXISTS inbound_bodies_fts
 USING fts5(payload, content = 'inbound_bodies', content_rowid = 'id', tokenize = 'trigram case_sensitive 1')

-- name: content_index_on_insert
CREATE TRIGGER IF NOT EXISTS inbound_bodies_fts_insert AFTER INSERT ON inbound_bodies BEGIN
  INSERT INTO inbound_bodies_fts (rowid, payload) VALUES (new.id, new.payload);
END

-- name: content_index_on_delete
CREATE TRIGGER IF NOT EXISTS inbound_bodies_fts_delete AFTER DELETE ON inbound_bodies BEGIN
  INSERT INTO inbound_bodies_fts (inbound_bodies_fts, rowid, payload) VALUES ('delete', old.id, old.payload);
END

-- name: content_index_on_update
CREATE TRIGGER IF NOT EXISTS inbound_bodies_fts_update AFTER UPDATE ON inbound_bodies BEGIN
  INSERT INTO inbound_bodies_fts (inbound_bodies_fts, rowid, payload) VALUES ('delete', old.id, old.payload);
  INSERT INTO inbound_bodies_fts (rowid, payload) VALUES (new.id, new.payload);
END

-- name: content_index_last
-- The newest body when the triggers began: what the fill covers (the triggers index what follows).
SELECT coalesce(max(id), 0) AS last_id FROM inbound_bodies

-- name: content_index_fill
-- One chunk of the bodies that were there before the index, by id range.
INSERT INTO inbound_bodies_fts (rowid, payload)
SELECT id, payload FROM inbound_bodies WHERE id > :after_id AND id <= :last_id

-- name: content_index_drop_insert
DROP TRIGGER IF EXISTS inbound_bodies_fts_insert

-- name: content_index_drop_delete
DROP TRIGGER IF EXISTS inbound_bodies_fts_delete

-- name: content_index_drop_update
DROP TRIGGER IF EXISTS inbound_bodies_fts_update

-- name: content_index_drop
DROP TABLE IF EXISTS inbound_bodies_fts
