-- Business keys (include/store/keys.py, migration 0016): the indexer's reads and writes, the
-- search by key, a message's keys, retention's purge of keys whose message is gone, and saved
-- searches. Times come back as epoch milliseconds.

-- name: keys_progress
SELECT last_id, until_id FROM key_progress WHERE id = 1

-- name: keys_of_claimed
-- The inbound messages :ids (a route claim) with their bodies, for their keys.
SELECT i.id, i.connection, (extract(epoch FROM i.created_at) * 1000)::bigint AS created_ms, b.payload
  FROM stage_inbound i
  LEFT JOIN inbound_bodies b ON b.id = i.id
 WHERE i.id = ANY(CAST(:ids AS bigint[]))

-- name: keys_pending
-- The catch-up (migration 0018): the next inbound messages after :after_id up to :until_id (the
-- newest id when the store moved to version 18), in id order, through the primary key's range.
SELECT i.id, i.connection, (extract(epoch FROM i.created_at) * 1000)::bigint AS created_ms,
       (SELECT b.payload FROM inbound_bodies b WHERE b.id = i.id) AS payload
  FROM stage_inbound i
 WHERE i.id > CAST(:after_id AS bigint) AND i.id <= CAST(:until_id AS bigint)
 ORDER BY i.id
 LIMIT CAST(:limit AS bigint)

-- name: keys_insert
-- :rows, a JSON array of {message, name, value, received_ms, connection}; a key already kept is
-- kept once (a message claimed again: a retried batch, a replay).
INSERT INTO message_keys (message, name, value, received_at, connection)
SELECT r.message, r.name, r.value, to_timestamp(r.received_ms / 1000.0), r.connection
  FROM json_to_recordset(CAST(:rows AS json)) AS r(message bigint, name text, value text, received_ms bigint, connection text)
ON CONFLICT DO NOTHING

-- name: keys_advance
UPDATE key_progress SET last_id = CAST(:last_id AS bigint), updated_at = now()
 WHERE id = 1 AND last_id < CAST(:last_id AS bigint)

-- name: keys_find
-- Messages with key :name whose value is in [:lo, :hi) (one value: :hi is it followed by \x01;
-- a prefix: the prefix with its last character stepped), newest first, paged by :before_id, within
-- [:since_ms, :until_ms). Each is looked up where it is now: hot, in the archive tables, or neither
-- (in the Parquet archive, whose index the caller reads).
SELECT k.message AS id, k.name, k.value AS key_value, k.connection,
       (extract(epoch FROM k.received_at) * 1000)::bigint AS created_ms,
       COALESCE(i.message_id, a.message_id) AS message_id, COALESCE(i.control_id, a.control_id) AS control_id,
       COALESCE(i.status, a.status) AS status,
       CASE WHEN i.id IS NOT NULL THEN 'hot' WHEN a.id IS NOT NULL THEN 'archive' ELSE 'parquet' END AS tier
  FROM message_keys k
  LEFT JOIN stage_inbound i ON i.id = k.message
  LEFT JOIN archive_inbound a ON a.id = k.message
 WHERE k.name = CAST(:name AS text)
   AND k.value >= CAST(:lo AS text) AND k.value < CAST(:hi AS text)
   AND k.received_at >= to_timestamp(CAST(:since_ms AS bigint) / 1000.0)
   AND k.received_at < to_timestamp(CAST(:until_ms AS bigint) / 1000.0)
   AND k.message < CAST(:before_id AS bigint)
 ORDER BY k.message DESC
 LIMIT CAST(:limit AS bigint)

-- name: keys_of_message
SELECT name, value AS key_value FROM message_keys WHERE message = CAST(:id AS bigint) ORDER BY name, value

-- name: keys_purge
-- Retention without an archive: the keys of messages received before :ms ago that are in none of
-- the hot tables, the archive tables and the Parquet archive's index any more, :limit messages at
-- a time, oldest first (message_keys_received).
DELETE FROM message_keys
 WHERE message = ANY(ARRAY(SELECT k.message FROM message_keys k
                            WHERE k.received_at < now() - make_interval(secs => :ms / 1000.0)
                              AND NOT EXISTS (SELECT 1 FROM stage_inbound i WHERE i.id = k.message)
                              AND NOT EXISTS (SELECT 1 FROM archive_inbound a WHERE a.id = k.message)
                              AND NOT EXISTS (SELECT 1 FROM parquet_index p
                                               WHERE p.kind = 'inbound' AND p.row_key = k.message AND p.row_key IS NOT NULL)
                            ORDER BY k.received_at
                            LIMIT :limit))
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: search_case_twin
-- Another saved search whose name differs from :name only by case (names are ASCII).
SELECT name FROM saved_searches WHERE LOWER(name) = LOWER(CAST(:name AS text)) AND name <> CAST(:name AS text)

-- name: search_save
INSERT INTO saved_searches (name, query, saved_by) VALUES (CAST(:name AS text), CAST(:query AS text), CAST(:actor AS text))
ON CONFLICT (name) DO UPDATE SET query = EXCLUDED.query, saved_by = EXCLUDED.saved_by, saved_at = now()

-- name: search_add
-- A new name only: no row when the name is taken (the caller says to --replace).
INSERT INTO saved_searches (name, query, saved_by) VALUES (CAST(:name AS text), CAST(:query AS text), CAST(:actor AS text))
ON CONFLICT (name) DO NOTHING

-- name: search_list
SELECT name, query, saved_by, (extract(epoch FROM saved_at) * 1000)::bigint AS saved_ms
  FROM saved_searches WHERE name > CAST(:after AS text) ORDER BY name LIMIT :limit

-- name: search_get
SELECT name, query, saved_by, (extract(epoch FROM saved_at) * 1000)::bigint AS saved_ms
  FROM saved_searches WHERE name = CAST(:name AS text)

-- name: search_delete
DELETE FROM saved_searches WHERE name = CAST(:name AS text)

-- name: content_find
-- Content search (include/store/search.py): hot inbound messages received in [:since_ms, :until_ms)
-- (stage_inbound_created), optionally of one :connection, whose body holds :pattern (a LIKE
-- pattern: the user's text with its wildcards escaped), newest first, :limit at a time below
-- :before_id. Each body is read by its key, the window's rows only. Bodies come back for the
-- caller's HL7 conditions; it shows none.
SELECT w.* FROM (
  SELECT i.id, i.message_id, i.control_id, i.connection, i.status,
         (extract(epoch FROM i.created_at) * 1000)::bigint AS created_ms,
         (SELECT b.payload FROM inbound_bodies b WHERE b.id = i.id) AS payload
    FROM stage_inbound i
   WHERE i.created_at >= to_timestamp(CAST(:since_ms AS bigint) / 1000.0)
     AND i.created_at < to_timestamp(CAST(:until_ms AS bigint) / 1000.0)
     AND i.id < CAST(:before_id AS bigint)
     AND (CAST(:connection AS text) IS NULL OR i.connection = CAST(:connection AS text))
   ORDER BY i.id DESC
   OFFSET 0) w
 WHERE w.payload LIKE CAST(:pattern AS text) ESCAPE '\'
 LIMIT CAST(:limit AS bigint)

-- name: content_find_indexed
-- The same search where the operator made the trigram index (`stageline messages content-index`):
-- the bodies holding :pattern first (the index's bitmap), then the window.
SELECT i.id, i.message_id, i.control_id, i.connection, i.status,
       (extract(epoch FROM i.created_at) * 1000)::bigint AS created_ms, b.payload
  FROM inbound_bodies b JOIN stage_inbound i ON i.id = b.id
 WHERE b.payload LIKE CAST(:pattern AS text) ESCAPE '\'
   AND i.created_at >= to_timestamp(CAST(:since_ms AS bigint) / 1000.0)
   AND i.created_at < to_timestamp(CAST(:until_ms AS bigint) / 1000.0)
   AND i.id < CAST(:before_id AS bigint)
   AND (CAST(:connection AS text) IS NULL OR i.connection = CAST(:connection AS text))
 ORDER BY i.id DESC
 LIMIT CAST(:limit AS bigint)

-- name: content_index_present
-- Whether the operator made the trigram index on the bodies (docs/operations.md, "Content search").
SELECT count(*) AS n FROM pg_indexes WHERE indexname = 'inbound_bodies_trgm'

-- name: content_index_extension
CREATE EXTENSION IF NOT EXISTS pg_trgm

-- name: content_index_create
-- Concurrently (autocommit): ingest goes on while it builds.
CREATE INDEX CONCURRENTLY IF NOT EXISTS inbound_bodies_trgm ON inbound_bodies USING gin (payload gin_trgm_ops)

-- name: content_index_drop
DROP INDEX CONCURRENTLY IF EXISTS inbound_bodies_trgm
