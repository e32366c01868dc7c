-- Stageline store, SQL Server (T-SQL), version 5: the micro-batches' history.
--
-- A stage task runs many micro-batches, but Airflow shows one task that ran for minutes. Each batch
-- that claimed rows leaves a row here: which stage, the claim owner it worked as (the same string
-- as message_events.node_id of the events it wrote, and stage rows' lease_owner: the link from a
-- message's trail to its batch), the Airflow DAG, run and try that ran it, the epoch, when it
-- started and finished, and what it did (claimed, and every other count as JSON).
CREATE TABLE stage_batches (
    id           bigint        IDENTITY(1,1) NOT NULL PRIMARY KEY,
    stage        nvarchar(16)  NOT NULL,
    owner        nvarchar(400) COLLATE Latin1_General_100_BIN2 NOT NULL,
    dag_id       nvarchar(250) NOT NULL,
    run_id       nvarchar(250) NOT NULL,
    try_number   int           NOT NULL,
    epoch        bigint        NULL,
    started_at   datetime2(3)  NOT NULL,
    finished_at  datetime2(3)  NOT NULL DEFAULT SYSUTCDATETIME(),
    claimed      int           NOT NULL,
    counts       nvarchar(2000) NOT NULL
);
GO

CREATE INDEX stage_batches_owner ON stage_batches (owner);
CREATE INDEX stage_batches_finished ON stage_batches (finished_at);
