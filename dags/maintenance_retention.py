"""
### maintenance_retention — keep the staged tables and Airflow's own metadata small

1. **leader_check** — proceed only under a live leader lease (always, on a single node).
2. **recover** — on-promotion recovery for the epoch, in case this is the epoch's first run.
3. **purge** — archive, then delete, *finished* rows (`done`, `dead`, `unrouted`) whose last
   change is older than their stage's retention, and audit events older than theirs (the service
   config's `[retention]`, per-connection overrides included, read when the task runs): rows, bodies
   and events are copied to the `archive_*` tables first, and only what the archive holds is
   deleted; bounded batches, fenced by the epoch. Unfinished rows are never purged, however old.
4. **archive_parquet** — archive rows held longer than `[retention] archive_days` move to the
   Parquet archive under `[retention] archive_path` (the PySpark job `spark_jobs/archive_job.py`, on
   the `stageline_spark` connection's session): written by day and connection, counted back, then
   deleted from the archive tables in bounded, fenced batches. Nothing to do (and no Spark session)
   without an `archive_path`.
5. **clean_airflow_metadata** — `airflow db clean` of `dag_run` / `task_instance` / `xcom` for the
   frequent DAGs (a stage run every 30 s is ~2,900 runs a day); Airflow keeps each DAG's latest
   scheduled run. The worker needs `$STAGELINE_AIRFLOW_DB_CONN` when its metadata DB URL comes
   from `AIRFLOW__DATABASE__SQL_ALCHEMY_CONN` (see docs/pipeline.md).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import dag, task
from stageline_airflow import tasks
from stageline_airflow.sensors import LeaderCheckSensor

from include.store.stages import STAGES

FREQUENT_DAGS = (*(stage.dag_id for stage in STAGES), "maintenance_reclaim")
AIRFLOW_METADATA_KEEP = timedelta(hours=24)


@dag(
    schedule=timedelta(minutes=30),
    start_date=datetime(2025, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=25),
    tags=["stageline", "maintenance"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1), "execution_timeout": timedelta(minutes=20)},
    doc_md=__doc__,
)
def maintenance_retention() -> None:
    leader = LeaderCheckSensor(task_id="leader_check")

    @task
    def recover(leader: dict) -> int | None:
        """On-promotion recovery, once per epoch."""
        return tasks.recover_step(leader)

    @task
    def purge(leader: dict) -> dict[str, int]:
        """Archive, then delete, finished rows and events past their retention."""
        return tasks.retention_step(leader)

    @task
    def archive_parquet(leader: dict) -> dict[str, int] | None:
        """Move archive rows past the archive hold to Parquet."""
        return tasks.archive_parquet_step(leader)

    clean_metadata = BashOperator(
        task_id="clean_airflow_metadata",
        bash_command=tasks.metadata_clean_command(dag_ids=FREQUENT_DAGS, keep=AIRFLOW_METADATA_KEEP),
    )

    # (TaskFlow passes an XComArg where the task function takes its value: Airflow's types do not say so)
    recover(leader.output) >> purge(leader.output) >> archive_parquet(leader.output)  # type: ignore[arg-type]
    leader >> clean_metadata


maintenance_retention()
