-- Stageline store, SQLite, version 6: HL7 batches split at ingest.
--
-- A batch (FHS/BHS … BTS/FTS around several MSH) is staged as one stage_inbound row per message,
-- in the same commit as its inbound_batches row (all or nothing). Each message row names its batch
-- (batch_id) and its place in it (batch_seq, from 1); the batch row keeps what the sender said of
-- it: FHS-11 / BHS-11 (its control ids), BTS-1 (the count it declared) and the count staged.
CREATE TABLE inbound_batches (
    batch_id        TEXT        PRIMARY KEY,
    connection      TEXT        NOT NULL,
    fhs_control_id  TEXT,
    bhs_control_id  TEXT,
    declared_count  INTEGER,
    message_count   INTEGER     NOT NULL,
    created_at      INTEGER     NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
CREATE INDEX inbound_batches_created ON inbound_batches (created_at);

ALTER TABLE stage_inbound ADD COLUMN batch_id TEXT;
ALTER TABLE stage_inbound ADD COLUMN batch_seq INTEGER;
CREATE INDEX stage_inbound_batch ON stage_inbound (batch_id, batch_seq) WHERE batch_id IS NOT NULL;
