-- Business keys (include/store/keys.py, migration 0016); postgres/keys.sql says what each does.

-- name: keys_progress
SELECT last_id, until_id FROM key_progress WHERE id = 1

-- name: keys_of_claimed
SELECT i.id, i.connection, DATEDIFF_BIG(millisecond, '1970-01-01', i.created_at) AS created_ms, b.payload
  FROM stage_inbound AS i
  LEFT JOIN inbound_bodies AS b ON b.id = i.id
 WHERE i.id IN (SELECT CAST(j.value AS bigint) FROM OPENJSON(:ids) AS j)

-- name: keys_pending
SELECT TOP (CAST(:limit AS int)) i.id, i.connection,
       DATEDIFF_BIG(millisecond, '1970-01-01', i.created_at) AS created_ms,
       (SELECT b.payload FROM inbound_bodies AS b WHERE b.id = i.id) AS payload
  FROM stage_inbound AS i
 WHERE i.id > :after_id AND i.id <= :until_id
 ORDER BY i.id

-- name: keys_insert
INSERT INTO message_keys (message, name, value, received_at, connection)
SELECT r.message, r.name, r.value,
       DATEADD(millisecond, CAST(r.received_ms - r.received_ms / 1000 * 1000 AS int),
               DATEADD(second, CAST(r.received_ms / 1000 AS int), CAST('1970-01-01' AS datetime2))),
       r.connection
  FROM OPENJSON(:rows) WITH (
       message      bigint        '$.message',
       name         nvarchar(32)  '$.name',
       value        nvarchar(200) '$.value',
       received_ms  bigint        '$.received_ms',
       connection   nvarchar(200) '$.connection') AS r
 WHERE NOT EXISTS (SELECT 1 FROM message_keys AS k WITH (UPDLOCK, HOLDLOCK)
                    WHERE k.message = r.message AND k.name = r.name AND k.value = r.value)

-- name: keys_advance
UPDATE key_progress SET last_id = :last_id, updated_at = SYSUTCDATETIME()
 WHERE id = 1 AND last_id < :last_id

-- name: keys_find
SELECT TOP (CAST(:limit AS int))
       k.message AS id, k.name, k.value AS key_value, k.connection,
       DATEDIFF_BIG(millisecond, '1970-01-01', k.received_at) AS created_ms,
       COALESCE(i.message_id, a.message_id) AS message_id, COALESCE(i.control_id, a.control_id) AS control_id,
       COALESCE(i.status, a.status) AS status,
       CASE WHEN i.id IS NOT NULL THEN 'hot' WHEN a.id IS NOT NULL THEN 'archive' ELSE 'parquet' END AS tier
  FROM message_keys AS k
  LEFT JOIN stage_inbound AS i ON i.id = k.message
  LEFT JOIN archive_inbound AS a ON a.id = k.message
 WHERE k.name = :name
   AND k.value >= :lo AND k.value < :hi
   AND k.received_at >= DATEADD(second, CAST(CAST(:since_ms AS bigint) / 1000 AS int), CAST('1970-01-01' AS datetime2))
   AND k.received_at < DATEADD(second, CAST(CAST(:until_ms AS bigint) / 1000 AS int), CAST('1970-01-01' AS datetime2))
   AND k.message < :before_id
 ORDER BY k.message DESC

-- name: keys_of_message
SELECT name, value AS key_value FROM message_keys WHERE message = :id ORDER BY name, value

-- name: keys_purge
DELETE k
  FROM message_keys AS k
 WHERE k.message IN (SELECT TOP (:limit) x.message FROM message_keys AS x
                      WHERE x.received_at < DATEADD(second, CAST(:ms / -1000 AS int), SYSUTCDATETIME())
                        AND NOT EXISTS (SELECT 1 FROM stage_inbound AS i WHERE i.id = x.message)
                        AND NOT EXISTS (SELECT 1 FROM archive_inbound AS a WHERE a.id = x.message)
                        AND NOT EXISTS (SELECT 1 FROM parquet_index AS p
                                         WHERE p.kind = 'inbound' AND p.row_key = x.message AND p.row_key IS NOT NULL)
                      ORDER BY x.received_at)
   AND EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)

-- name: search_case_twin
-- Another saved search whose name differs from :name only by case (names are ASCII).
SELECT name FROM saved_searches WHERE LOWER(name) = LOWER(:name) AND name <> :name

-- name: search_save
MERGE INTO saved_searches WITH (HOLDLOCK) AS s
USING (SELECT :name AS name, :query AS query, :actor AS saved_by) AS v
   ON s.name = v.name
 WHEN MATCHED THEN UPDATE SET query = v.query, saved_by = v.saved_by, saved_at = SYSUTCDATETIME()
 WHEN NOT MATCHED THEN INSERT (name, query, saved_by) VALUES (v.name, v.query, v.saved_by);

-- name: search_add
-- A new name only: no row when the name is taken (the caller says to --replace).
INSERT INTO saved_searches (name, query, saved_by)
SELECT :name, :query, :actor
 WHERE NOT EXISTS (SELECT 1 FROM saved_searches WITH (UPDLOCK, HOLDLOCK) WHERE name = :name);

-- name: search_list
SELECT TOP (:limit) name, query, saved_by, DATEDIFF_BIG(millisecond, '1970-01-01', saved_at) AS saved_ms
  FROM saved_searches WHERE name > :after ORDER BY name

-- name: search_get
SELECT name, query, saved_by, DATEDIFF_BIG(millisecond, '1970-01-01', saved_at) AS saved_ms
  FROM saved_searches WHERE name = :name

-- name: search_delete
DELETE FROM saved_searches WHERE name = :name

-- name: content_find
SELECT TOP (CAST(:limit AS int)) w.*
  FROM (SELECT i.id, i.message_id, i.control_id, i.connection, i.status,
               DATEDIFF_BIG(millisecond, '1970-01-01', i.created_at) AS created_ms,
               (SELECT b.payload FROM inbound_bodies AS b WHERE b.id = i.id) AS payload
          FROM stage_inbound AS i
         WHERE i.created_at >= DATEADD(second, CAST(CAST(:since_ms AS bigint) / 1000 AS int), CAST('1970-01-01' AS datetime2))
           AND i.created_at < DATEADD(second, CAST(CAST(:until_ms AS bigint) / 1000 AS int), CAST('1970-01-01' AS datetime2))
           AND i.id < :before_id
           AND (:connection IS NULL OR i.connection = :connection)) AS w
 WHERE w.payload LIKE :pattern ESCAPE '\'
 ORDER BY w.id DESC

-- name: content_index_present
SELECT 0 AS n
