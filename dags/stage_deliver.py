"""
### stage_deliver — outbound → destinations

1. **leader_check** — proceed only under a live leader lease (always, on a single node); the
   epoch goes to XCom. No leader within a minute: the run ends *skipped*.
2. **recover** — on-promotion recovery for the epoch: a dead leader's stranded lane heads are
   re-pended before anything newer in their lanes can be claimed.
3. **wait_for_work** — hold the run until `stage_outbound` has a due row (pending, or failed and
   past its backoff); an idle five minutes, or a change of leader, ends the run *skipped*.
4. **deliver** — `spark_jobs/deliver_job.py`: rounds of lane heads (one row per lane, per-lane FIFO),
   sent from Spark partitions to MLLP / file / HTTP destinations (`destinations.toml`) with an
   idempotency key; each round finalized fenced: done, retry with exponential backoff, or dead
   letter after the destination's `max_attempts`. A failing head holds only its own lane. Rounds
   repeat until nothing is due or two minutes are spent.

The job's Spark session comes from the `stageline_spark` connection: the stage's own session on a
Spark Connect server (or its standby), or a classic `local[*]` session (docs/pipeline.md).

Scheduled `@continuous`, like `stage_route` (why: docs/pipeline.md).
"""

from __future__ import annotations

from stageline_airflow import tasks
from stageline_airflow.stage_dag import stage_dag

from include.store.stages import DELIVER

dag = stage_dag(DELIVER, job=tasks.run_deliver_stage, doc_md=__doc__)
