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

The job's Spark session comes from the `stageline_spark` connection: the stage's own session on a
Spark Connect server (or its standby), or a classic `local[*]` session (docs/pipeline.md).

Scheduled `@continuous` (one run at a time, the next starts when one ends): a message waits
for the sensor's next poke plus one task start before the route job starts, where a 30 s interval
schedule makes it wait 15 s on average and 30 s at worst. Measurements: docs/pipeline.md and
docs/performance.md.
"""

from __future__ import annotations

from stageline_airflow import tasks
from stageline_airflow.stage_dag import stage_dag

from include.store.stages import ROUTE

dag = stage_dag(ROUTE, job=tasks.run_route_stage, doc_md=__doc__)
