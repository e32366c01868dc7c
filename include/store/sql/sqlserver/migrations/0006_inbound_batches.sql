-- Stageline store, SQL Server (T-SQL), version 6: HL7 batches split at ingest.
--
-- A batch (FHS/BHS … BTS/FTS around several MSH) is staged as one stage_inbound row per message,
-- in the same transaction as its inbound_batches row (all or nothing). Each message row names its
-- batch (batch_id) and its place in it (batch_seq, from 1); the batch row keeps what the sender
-- said of it: FHS-11 / BHS-11 (its control ids), BTS-1 (the count it declared) and the count staged.
CREATE TABLE inbound_batches (
    batch_id        nvarchar(64)  COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY,
    connection      nvarchar(200) NOT NULL,
    fhs_control_id  nvarchar(200) NULL,
    bhs_control_id  nvarchar(200) NULL,
    declared_count  int           NULL,
    message_count   int           NOT NULL,
    created_at      datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME()
);
GO

CREATE INDEX inbound_batches_created ON inbound_batches (created_at);
ALTER TABLE stage_inbound ADD batch_id nvarchar(64) COLLATE Latin1_General_100_BIN2 NULL, batch_seq int NULL;
GO

CREATE INDEX stage_inbound_batch ON stage_inbound (batch_id, batch_seq) WHERE batch_id IS NOT NULL;
