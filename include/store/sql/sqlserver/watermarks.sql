-- A database-poll inbound connection's high-water mark (listeners/dbpoll.py, migration 0007).

-- name: watermark_get
SELECT watermark FROM inbound_watermarks WHERE connection = :connection

-- name: watermark_set
-- Fenced: only the current leader moves a connection's mark (nothing is written, and no row comes
-- back, under a stale epoch). HOLDLOCK makes the MERGE's read and write one atomic step.
MERGE inbound_watermarks WITH (HOLDLOCK) AS t
USING (SELECT :connection AS connection, :watermark AS watermark, :epoch AS epoch
        WHERE EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)) AS s
   ON t.connection = s.connection
 WHEN MATCHED THEN UPDATE SET watermark = s.watermark, epoch = s.epoch, updated_at = SYSUTCDATETIME()
 WHEN NOT MATCHED THEN INSERT (connection, watermark, epoch) VALUES (s.connection, s.watermark, s.epoch)
OUTPUT inserted.connection;

-- name: archived_message_ids
-- Of these message ids (:ids, a JSON array), those retention has archived (and maybe purged): a
-- source row read again after its staged row left the hot tables is not staged a second time.
SELECT message_id FROM archive_inbound
 WHERE message_id IN (SELECT CAST(value AS nvarchar(450)) FROM OPENJSON(:ids))
