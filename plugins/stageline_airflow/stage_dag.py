"""The one shape every stage DAG has, so `dags/stage_*.py` are one call each.

    leader_check → recover → wait_for_work (the stage's input table) → <stage name>

Each stage is its record (`include.store.stages`): the DAG is `stage_<name>`, its job task `<name>`,
it waits for due rows in the stage's input table (or in the inputs of the stages before it).

Scheduled `@continuous`, one run at a time: a run waits for work, then its job task runs
micro-batches until it has been idle a while, following leadership (`include.stage_loop`); the next run
starts about a second after one ends. Why this schedule: docs/pipeline.md. The job's Spark session
comes from the `stageline_spark` connection (`tasks.SPARK_CONN_ID`) through `StagelineSparkHook`:
the stage's sticky Spark Connect session, on a standby server when the first stops answering.
Nothing here reads a connection, file or database when a DAG file is parsed.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import DAG, task

from include import stage_loop
from include.store.stages import Stage
from stageline_airflow import tasks
from stageline_airflow.hooks import StagelineSparkHook
from stageline_airflow.sensors import LeaderCheckSensor, WorkPendingSensor

LEADER_POKE_INTERVAL = timedelta(seconds=0.5)
"""A run that starts during a failover proceeds within half a second of the new leader's lease."""
JOB_RETRIES = 3
JOB_RETRY_DELAY = timedelta(0)
"""A killed job task (or a lost Spark session) is retried at once: its claim is recovered when the
retry starts (`ClaimKeeper.recover_abandoned`, via `include.stage_loop`), so the sooner the retry,
the shorter the stall. No delay: the scheduler's pick-up and the task start already take seconds."""
JOB_TIMEOUT = timedelta(seconds=stage_loop.STAGE_TIME_BUDGET_SECONDS + stage_loop.STAGE_TIMEOUT_MARGIN_SECONDS)
"""A job task runs micro-batches for hours (`include.stage_loop`: each hand-over to a new run costs
seconds of stalled traffic); its timeout is that budget plus the batch in flight."""
WORK_POKE_INTERVAL = timedelta(seconds=0.5)
"""Work staged inbound starts all three stage jobs within half a second (`WorkPendingSensor`)."""


DOC = """
### {dag} — {input} → {output}

1. **leader_check** — proceed only under a live leader lease (always, on a single node); the
   epoch goes to XCom. No leader within a minute: the run ends *skipped* (and the next starts).
2. **recover** — on-promotion recovery for the epoch (one read after the epoch's first run), so a
   new leader's first run never waits for rows the old leader held, then the claims earlier runs
   of this DAG left behind.
3. **wait_for_work** — hold the run until `{table}` (or a stage before it) has a due row; an idle
   five minutes, or a change of leader, ends the run *skipped*.
4. **{name}** — the stage's job, micro-batch after micro-batch under the leader's epoch: {doc}

The stage is the record `include.store.stages.{record}`; its job's Spark session comes from the
`stageline_spark` connection: the stage's own session on a Spark Connect server (or its standby),
or a classic `local[*]` session (docs/pipeline.md). Scheduled `@continuous`, one run at a time (why:
docs/pipeline.md).
"""


def stage_dag(stage: Stage) -> DAG:
    """Build the DAG of `stage`; its job task runs `tasks.run_stage(stage, …)`, its page is `DOC`."""
    doc_md = DOC.format(
        dag=stage.dag_id,
        input=stage.input.key,
        output=stage.output.key if stage.output else "destinations",
        table=stage.input.name,
        name=stage.name,
        doc=stage.doc,
        record=stage.name.upper(),
    )
    with DAG(
        stage.dag_id,
        schedule="@continuous",
        start_date=datetime(2025, 1, 1, tzinfo=UTC),
        catchup=False,
        max_active_runs=1,
        # a retry starts a fresh budget: room for every try, so none is cut off mid-batch (a hung
        # batch ends its try within minutes: `tasks.HUNG_BATCH_SECONDS`)
        dagrun_timeout=JOB_TIMEOUT * (JOB_RETRIES + 1) + timedelta(minutes=20),
        tags=["stageline", "stage"],
        default_args={"retries": 1, "retry_delay": timedelta(seconds=5), "execution_timeout": timedelta(minutes=8)},
        doc_md=doc_md,
    ) as built:
        leader = LeaderCheckSensor(
            task_id="leader_check", timeout=timedelta(minutes=1), poke_interval=LEADER_POKE_INTERVAL
        )

        @task
        def recover(leader: dict, ti=None) -> dict:
            """On-promotion recovery (once per epoch) and the claims earlier runs of this DAG left."""
            return tasks.recover_stage_step(leader, stage=stage.name, dag_id=ti.dag_id, run_id=ti.run_id)

        wait_for_work = WorkPendingSensor(
            task_id="wait_for_work",
            stage=stage.name,
            leader=leader.output,
            timeout=timedelta(minutes=5),
            poke_interval=WORK_POKE_INTERVAL,
        )

        @task(task_id=stage.name, retries=JOB_RETRIES, retry_delay=JOB_RETRY_DELAY, execution_timeout=JOB_TIMEOUT)
        def run_job(leader: dict, ti=None) -> dict:
            """Run the stage job under the leader's epoch, on the stage's Spark session (none when
            the stage runs without Spark: deliveries sent from the task process)."""
            if not tasks.needs_spark(stage):
                return tasks.run_stage(
                    stage, int(leader["epoch"]), ti.run_id, spark=None, dag_id=ti.dag_id, try_number=ti.try_number
                )
            with StagelineSparkHook(tasks.SPARK_CONN_ID).stage_session(
                name=ti.dag_id, conf=tasks.SPARK_TASK_CONF
            ) as session:
                return tasks.run_stage(
                    stage, int(leader["epoch"]), ti.run_id, spark=session, dag_id=ti.dag_id, try_number=ti.try_number
                )

        # (TaskFlow passes an XComArg where the task function takes its value: Airflow's types do not say so)
        recover(leader.output) >> wait_for_work >> run_job(leader.output)  # type: ignore[arg-type]
    return built
