"""
### maintenance_reclaim — put stranded rows back in the queue

Invariant 5 (no loss): a claimed row whose claimer died comes back two ways.

1. **leader_check** — proceed only under a live leader lease (always, on a single node); the
   epoch goes to XCom. No leader: the run ends *skipped*.
2. **recover** — on-promotion recovery: once per epoch, every row claimed under an older epoch is
   re-pended at once, ignoring row leases (the old leader fenced itself). Later runs of the same
   epoch pay one read.
3. **reclaim** — the recurring sweep: in-flight rows whose row lease (`[store].lease_ttl_seconds`)
   expired are re-pended, in bounded batches per staged table.

Every write is fenced by the epoch: if leadership moves mid-run, nothing lands.
Code: `include/housekeeping.py`, `plugins/stageline_airflow/tasks.py`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import dag, task
from stageline_airflow import tasks
from stageline_airflow.sensors import LeaderCheckSensor


@dag(
    schedule=timedelta(minutes=1),
    start_date=datetime(2025, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=5),
    tags=["stageline", "maintenance"],
    default_args={"retries": 1, "retry_delay": timedelta(seconds=15), "execution_timeout": timedelta(minutes=4)},
    doc_md=__doc__,
)
def maintenance_reclaim() -> None:
    leader = LeaderCheckSensor(task_id="leader_check")

    @task
    def recover(leader: dict) -> int | None:
        """On-promotion recovery, once per epoch."""
        return tasks.recover_step(leader)

    @task
    def reclaim(leader: dict) -> dict[str, int]:
        """Sweep expired row leases in every staged table."""
        return tasks.reclaim_step(leader)

    # (TaskFlow passes an XComArg where the task function takes its value: Airflow's types do not say so)
    recover(leader.output) >> reclaim(leader.output)  # type: ignore[arg-type]


maintenance_reclaim()
