-- Stageline store, SQL Server (T-SQL), version 14: the Parquet archive's lookup index (issue 23;
-- postgres/migrations/0014_parquet_index.sql says why). The statements that read the filtered
-- indexes repeat their predicates literally (row_key IS NOT NULL, ...), so they are matched.
CREATE TABLE parquet_partitions (
    id     bigint         IDENTITY(1,1) NOT NULL PRIMARY KEY,
    batch  nvarchar(100)  COLLATE Latin1_General_100_BIN2 NOT NULL,
    kind   nvarchar(20)   NOT NULL,
    part   nvarchar(1000) NOT NULL
);
GO
CREATE INDEX parquet_partitions_batch ON parquet_partitions (batch);
GO

CREATE TABLE parquet_index (
    id          bigint        IDENTITY(1,1) NOT NULL PRIMARY KEY,
    kind        nvarchar(20)  COLLATE Latin1_General_100_BIN2 NOT NULL,
    row_key     bigint        NULL,
    text_key    nvarchar(450) COLLATE Latin1_General_100_BIN2 NULL,
    control_id  nvarchar(200) COLLATE Latin1_General_100_BIN2 NULL,
    batch       nvarchar(100) COLLATE Latin1_General_100_BIN2 NOT NULL
);
GO
CREATE INDEX parquet_index_row     ON parquet_index (kind, row_key)  WHERE row_key IS NOT NULL;
CREATE INDEX parquet_index_text    ON parquet_index (kind, text_key) WHERE text_key IS NOT NULL;
CREATE INDEX parquet_index_control ON parquet_index (control_id)     WHERE control_id IS NOT NULL;
