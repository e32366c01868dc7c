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

The job's Spark session comes from the `stageline_spark` connection: the stage's own session on a
Spark Connect server (or its standby), or a classic `local[*]` session (docs/pipeline.md).

Scheduled `@continuous`, like `stage_route` (why: docs/pipeline.md).
"""

from __future__ import annotations

from stageline_airflow import tasks
from stageline_airflow.stage_dag import stage_dag

from include.store.stages import TRANSFORM

dag = stage_dag(TRANSFORM, job=tasks.run_transform_stage, doc_md=__doc__)
