-- Stageline store, PostgreSQL, version 14: the Parquet archive's lookup index (issue 23).
--
-- Without it, a message ref the store no longer holds was looked for in every Parquet file of the
-- archive. The export job (spark_jobs/archive_job.py) now records, in the transaction that notes a
-- batch written, which partition directories the batch wrote (parquet_partitions) and which keys
-- it holds (parquet_index: inbound row id, message id and control id; the inbound id a routed or
-- outbound row came from; the message id of events; an HL7 batch's id), so a lookup reads the
-- batches that hold the key, or no file at all. One narrow row per archived message and kind.
CREATE TABLE parquet_partitions (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    batch  text NOT NULL,
    kind   text NOT NULL,
    part   text NOT NULL
);
CREATE INDEX parquet_partitions_batch ON parquet_partitions (batch);

CREATE TABLE parquet_index (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind        text NOT NULL,
    row_key     bigint,
    text_key    text,
    control_id  text,
    batch       text NOT NULL
);
CREATE INDEX parquet_index_row     ON parquet_index (kind, row_key)  WHERE row_key IS NOT NULL;
CREATE INDEX parquet_index_text    ON parquet_index (kind, text_key) WHERE text_key IS NOT NULL;
CREATE INDEX parquet_index_control ON parquet_index (control_id)     WHERE control_id IS NOT NULL;
