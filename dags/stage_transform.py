"""
### stage_transform — routed → outbound

1. **leader_check** — proceed only under a live leader lease (always, on a single node); the
   epoch goes to XCom. No leader within a minute: the run ends *skipped*.
2. **recover** — on-promotion recovery for the epoch (a no-op after the epoch's first run).
3. **wait_for_work** — hold the run until `stage_routed` has a due row (polled every second);
   an idle five minutes, or a change of leader, ends the run *skipped*.
4. **transform** — the PySpark transform job (`spark_jobs/transform_job.py`): claim due routed
   rows in lane order, rewrite each for its destination (`transforms.toml`, lookup tables from the
   store), compute its outbound lane (`destinations.toml`), land, finalize fenced by the epoch.
   A message the rules cannot read is dead-lettered with the reason, never delivered unchanged.

The job's Spark session comes from the Spark provider (`@task.pyspark`) on the `stageline_spark`
connection: a Spark Connect server, or a classic `local[*]` session (docs/pipeline.md).

Scheduled `@continuous`, like `stage_route` (why: docs/pipeline.md).
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from airflow.sdk import dag, task
from stageline_airflow.sensors import LeaderCheckSensor, WorkPendingSensor

from include import pipeline


@dag(
    schedule="@continuous",
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=20),
    tags=["stageline", "stage"],
    default_args={"retries": 1, "retry_delay": timedelta(seconds=5),
                  "execution_timeout": timedelta(minutes=8)},
    doc_md=__doc__,
)
def stage_transform() -> None:
    leader = LeaderCheckSensor(task_id="leader_check", timeout=timedelta(minutes=1))

    @task
    def recover(leader: dict) -> int | None:
        """On-promotion recovery, once per epoch."""
        return pipeline.recover_step(leader)

    wait_for_work = WorkPendingSensor(task_id="wait_for_work", stage="routed", leader=leader.output,
                                      timeout=timedelta(minutes=5))

    @task.pyspark(conn_id=pipeline.SPARK_CONN_ID, config_kwargs=pipeline.SPARK_TASK_CONF)
    def transform(leader: dict, spark=None, ti=None) -> dict:
        """Run the transform job under the leader's epoch."""
        return pipeline.run_transform_stage(int(leader["epoch"]), ti.run_id, spark=spark, dag_id=ti.dag_id,
                                            try_number=ti.try_number)

    recover(leader.output) >> wait_for_work >> transform(leader.output)


stage_transform()
