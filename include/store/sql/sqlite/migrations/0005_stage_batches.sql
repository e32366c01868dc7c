-- Stageline store, SQLite, version 5: the micro-batches' history.
--
-- A stage task runs many micro-batches, but Airflow shows one task that ran for minutes. Each batch
-- that claimed rows leaves a row here: which stage, the claim owner it worked as (the same string
-- as message_events.node_id of the events it wrote, and stage rows' lease_owner: the link from a
-- message's trail to its batch), the Airflow DAG, run and try that ran it, the epoch, when it
-- started and finished, and what it did (claimed, and every other count as JSON).
CREATE TABLE stage_batches (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    stage        TEXT        NOT NULL,
    owner        TEXT        NOT NULL,
    dag_id       TEXT        NOT NULL,
    run_id       TEXT        NOT NULL,
    try_number   INTEGER     NOT NULL,
    epoch        INTEGER,
    started_at   INTEGER     NOT NULL,
    finished_at  INTEGER     NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    claimed      INTEGER     NOT NULL,
    counts       TEXT        NOT NULL
);
CREATE INDEX stage_batches_owner ON stage_batches (owner);
CREATE INDEX stage_batches_finished ON stage_batches (finished_at);
