"""
### stage_deliver — outbound → destinations

1. **leader_check** — proceed only under a live leader lease (always, on a single node); the
   epoch goes to XCom. No leader within a minute: the run ends *skipped*.
2. **recover** — on-promotion recovery for the epoch: a dead leader's stranded lane heads are
   re-pended before anything newer in their lanes can be claimed.
3. **wait_for_work** — hold the run until `stage_outbound` has a due row (pending, or failed and
   past its backoff); an idle five minutes, or a change of leader, ends the run *skipped*.
4. **deliver** — `spark_jobs/deliver.py`: rounds of lane heads (one row per lane, per-lane FIFO),
   sent from Spark partitions to MLLP / file / HTTP destinations (`destinations.toml`) with an
   idempotency key; each round finalized fenced: done, retry with exponential backoff, or dead
   letter after the destination's `max_attempts`. A failing head holds only its own lane. Rounds
   repeat until nothing is due or two minutes are spent.

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
def stage_deliver() -> None:
    leader = LeaderCheckSensor(task_id="leader_check", timeout=timedelta(minutes=1))

    @task
    def recover(leader: dict) -> int | None:
        """On-promotion recovery, once per epoch."""
        return pipeline.recover_step(leader)

    wait_for_work = WorkPendingSensor(task_id="wait_for_work", stage="outbound", leader=leader.output,
                                      timeout=timedelta(minutes=5))

    @task.pyspark(conn_id=pipeline.SPARK_CONN_ID, config_kwargs=pipeline.SPARK_TASK_CONF)
    def deliver(leader: dict, spark=None, ti=None) -> dict:
        """Deliver lane heads under the leader's epoch."""
        return pipeline.run_deliver_stage(int(leader["epoch"]), ti.run_id, spark=spark, dag_id=ti.dag_id,
                                          try_number=ti.try_number)

    recover(leader.output) >> wait_for_work >> deliver(leader.output)


stage_deliver()
