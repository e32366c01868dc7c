-- Stageline store, PostgreSQL, version 6: HL7 batches split at ingest.
--
-- A batch (FHS/BHS … BTS/FTS around several MSH) is staged as one stage_inbound row per message,
-- in the same statement as its inbound_batches row (all or nothing). Each message row names its
-- batch (batch_id) and its place in it (batch_seq, from 1); the batch row keeps what the sender
-- said of it: FHS-11 / BHS-11 (its control ids), BTS-1 (the count it declared) and the count staged.
CREATE TABLE inbound_batches (
    batch_id        text        PRIMARY KEY,
    connection      text        NOT NULL,
    fhs_control_id  text,
    bhs_control_id  text,
    declared_count  integer,
    message_count   integer     NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX inbound_batches_created ON inbound_batches (created_at);

ALTER TABLE stage_inbound ADD COLUMN batch_id text;
ALTER TABLE stage_inbound ADD COLUMN batch_seq integer;
CREATE INDEX stage_inbound_batch ON stage_inbound (batch_id, batch_seq) WHERE batch_id IS NOT NULL;
