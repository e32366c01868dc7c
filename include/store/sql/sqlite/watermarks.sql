-- A database-poll inbound connection's high-water mark (listeners/dbpoll.py, migration 0007).

-- name: watermark_get
SELECT watermark FROM inbound_watermarks WHERE connection = :connection

-- name: watermark_set
-- Fenced: only the current leader moves a connection's mark (nothing is written, and no row comes
-- back, under a stale epoch).
INSERT INTO inbound_watermarks (connection, watermark, epoch)
SELECT :connection, :watermark, :epoch
 WHERE EXISTS (SELECT 1 FROM leader_lease WHERE id = 1 AND epoch = :epoch)
ON CONFLICT (connection) DO UPDATE
   SET watermark = excluded.watermark, epoch = excluded.epoch, updated_at = {now}
RETURNING connection

-- name: archived_message_ids
-- Of these message ids (:ids, a JSON array), those retention has archived (and maybe purged): a
-- source row read again after its staged row left the hot tables is not staged a second time.
SELECT message_id FROM archive_inbound WHERE message_id IN (SELECT value FROM json_each(:ids))
