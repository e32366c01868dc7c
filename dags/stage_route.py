"""
### stage_route — inbound → routed

1. **leader_check** — proceed only under a live leader lease (always, on a single node); the
   epoch goes to XCom. No leader within a minute: the run ends *skipped* (and the next starts).
2. **recover** — on-promotion recovery for the epoch (one read after the epoch's first run), so a
   new leader's first route run never waits for rows the old leader held.
3. **wait_for_work** — hold the run until `stage_inbound` has a due row (polled every second);
   an idle five minutes, or a change of leader, ends the run *skipped*.
4. **route** — the PySpark route job (`spark_jobs/route_job.py`): claim due inbound rows in one
   SQL statement, route them with the configured rules (`routes.toml` in `$STAGELINE_PIPELINE_DIR`), land one routed row
   per destination, finalize fenced by the epoch.

The job's Spark session comes from the Spark provider (`@task.pyspark`) on the `stageline_spark`
connection: a Spark Connect server, or a classic `local[*]` session (docs/pipeline.md).

Scheduled `@continuous` (one run at a time, the next starts when one ends): a message waits
about 1 s plus one task start (~1 s) before the route job starts, where a 30 s interval
schedule makes it wait 15 s on average and 30 s at worst. Measurements: docs/pipeline.md.
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
def stage_route() -> None:
    leader = LeaderCheckSensor(task_id="leader_check", timeout=timedelta(minutes=1))

    @task
    def recover(leader: dict) -> int | None:
        """On-promotion recovery, once per epoch."""
        return pipeline.recover_step(leader)

    wait_for_work = WorkPendingSensor(task_id="wait_for_work", stage="inbound", leader=leader.output,
                                      timeout=timedelta(minutes=5))

    @task.pyspark(conn_id=pipeline.SPARK_CONN_ID, config_kwargs=pipeline.SPARK_TASK_CONF)
    def route(leader: dict, spark=None, ti=None) -> dict:
        """Run the route job under the leader's epoch."""
        return pipeline.run_route_stage(int(leader["epoch"]), ti.run_id, spark=spark, dag_id=ti.dag_id,
                                        try_number=ti.try_number)

    recover(leader.output) >> wait_for_work >> route(leader.output)


stage_route()
