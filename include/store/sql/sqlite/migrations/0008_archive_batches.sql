-- Stageline store, SQLite, version 8: retention archives HL7 batches (versions 6 and 7 meet).
--
-- archive_inbound keeps an archived message's batch_id and batch_seq, so it still names its batch.
-- archive_inbound_batches: retention copies an inbound_batches row here, then deletes it, once none
-- of its messages' inbound rows is left in stage_inbound (include/housekeeping.py). Keyed by the
-- batch_id, like the hot row: archiving again (a run killed between archive and purge) adds nothing.
-- A message archived under version 7 and not yet purged gets its batch from its hot row here.
ALTER TABLE archive_inbound ADD COLUMN batch_id TEXT;
ALTER TABLE archive_inbound ADD COLUMN batch_seq INTEGER;
CREATE INDEX archive_inbound_batch ON archive_inbound (batch_id, batch_seq) WHERE batch_id IS NOT NULL;
UPDATE archive_inbound
   SET batch_id = (SELECT s.batch_id FROM stage_inbound AS s WHERE s.id = archive_inbound.id),
       batch_seq = (SELECT s.batch_seq FROM stage_inbound AS s WHERE s.id = archive_inbound.id)
 WHERE id IN (SELECT s.id FROM stage_inbound AS s WHERE s.batch_seq > 0);

CREATE TABLE archive_inbound_batches (
    batch_id        TEXT        PRIMARY KEY,
    connection      TEXT        NOT NULL,
    fhs_control_id  TEXT,
    bhs_control_id  TEXT,
    declared_count  INTEGER,
    message_count   INTEGER     NOT NULL,
    created_at      INTEGER     NOT NULL,
    archived_at     INTEGER     NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
