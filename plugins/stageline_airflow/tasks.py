"""What the Stageline DAGs' tasks do, one function per task, so the DAG files stay configuration.

Why here, in the Airflow plugin, and not beside the Spark jobs: this is the layer that turns an
Airflow task into calls below it — the leader check's XCom (`{"epoch": int, "owner": str | None}`)
becomes an epoch, the task instance's run id a claim owner, the Spark provider's session a job's
`spark`, Airflow's connections the store (`StagelineStoreHook`) — and it calls every stage job,
the housekeeping and the stage loop. Beside the jobs it would make `spark_jobs` know about
Airflow; in `include/` it made the lowest layer import the Spark jobs. Imports flow one way:
config/HL7 ← store ← `spark_jobs` ← this module ← the DAG files.

Every function works under the epoch it is given, on a store its hook opens once per task. The
service config comes from `$STAGELINE_CONFIG` (default `./stageline.toml`) and the pipeline config
from `$STAGELINE_PIPELINE_DIR` (`include.stage_config`) when a task *runs*: nothing here touches a
file, a database or Spark when a DAG file is parsed, and Spark and the stage jobs are imported
only inside `run_batch_stage` and `run_deliver_stage` (the DAG processor never loads pyspark). Their Spark
session comes from the `stageline_spark` connection (`SPARK_CONN_ID`, through
`hooks.StagelineSparkHook`).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from include import housekeeping, stage_config, stage_loop
from include.batch_size import BatchSize
from include.claim_keeper import ClaimKeeper
from include.config import ServiceConfig
from include.keys_config import KeyRules, load_keys
from include.stage_loop import Batch, claim_owner
from include.store import INBOUND, rowlease
from include.store import lookups as lookup_store
from include.store.keys import catch_up_quietly as keys_catch_up
from include.store.keys import index_alongside as index_keys
from include.store.stages import DELIVER, Stage, stage_named
from stageline_airflow.hooks import StagelineSparkHook, StagelineStoreHook

log = logging.getLogger(__name__)

AIRFLOW_DB_CONN_ENV = "STAGELINE_AIRFLOW_DB_CONN"
"""Airflow metadata DB URL for the metadata clean task (see `metadata_clean_command`)."""
METADATA_TABLES = ("dag_run", "task_instance", "xcom")
SPARK_CONN_ID = "stageline_spark"
"""The Airflow connection the stage tasks' Spark sessions come from (`hooks.StagelineSparkHook`):
type `spark_connect` for a long-lived Spark Connect server (the default deployment: no JVM start
per run; its extra `standby` names servers to move to), or type `spark` with a master such as
`local[*]` (a classic session per task).
Set e.g. as `AIRFLOW_CONN_STAGELINE_SPARK`; `include.spark.spark_connect_connection` and
`classic_spark_connection` build the value."""
SPARK_TASK_CONF = {"spark.sql.shuffle.partitions": "4", "spark.sql.session.timeZone": "UTC"}
"""Session settings of every stage task: runtime SQL settings only, so they apply to Connect too."""
DELIVER_IN_PROCESS_ENV = "STAGELINE_DELIVER_IN_PROCESS"
"""Set (non-empty) to send deliveries from the task process instead of Spark workers."""
BATCH_SIZE = 10_000
"""The most rows a batch stage's micro-batch claims (fewer while batches run long: `include.batch_size`)."""
DELIVER_MAX_LANES = 1_000
DELIVER_CONCURRENCY = 4
"""Lanes sent at once by each Spark partition (threads: sends wait on the network and on fsync)."""
DELIVER_ROUND_BUDGET_SECONDS = 60.0
HUNG_BATCH_SECONDS = 480.0
"""A micro-batch still running after this is hung (a Spark server that stopped answering, a destination
on a hung mount): the task is ended so Airflow's retry recovers its claim (`ClaimKeeper`). Eight
minutes, the whole task's timeout when a run lasted four."""
HUNG_EXIT_SECONDS = 60.0
LOOKUP_CHECK_SECONDS = 10.0
"""How soon a running transform task maps with lookup tables `stageline lookups` changed."""

Leader = Mapping[str, Any]


def recover_step(leader: Leader) -> int | None:
    """On-promotion recovery for the run's epoch (a no-op after the epoch's first run)."""
    with StagelineStoreHook() as hook:
        return housekeeping.recover(hook.get_conn(), int(leader["epoch"]), leader.get("owner"))


def recover_stage_step(leader: Leader, *, stage: str, dag_id: str, run_id: str) -> dict[str, int | None]:
    """A stage run's recovery before it waits for work: the epoch's on-promotion recovery, then the
    claims earlier runs of this DAG left behind (a killed task's rows: in flight, so not yet work
    its `wait_for_work` would see). Safe because the previous run of the DAG has ended
    (`max_active_runs=1`); this run has claimed nothing yet."""
    epoch = int(leader["epoch"])
    table = stage_named(stage).input
    with StagelineStoreHook() as hook:
        store = hook.get_conn()
        promoted = housekeeping.recover(store, epoch, leader.get("owner"))
        with store.transaction() as tx:
            abandoned = rowlease.recover_abandoned(
                tx,
                table,
                prefix=claim_owner(dag_id, ""),
                keep=claim_owner(dag_id, f"{run_id}#"),
                epoch=epoch,
                owner=claim_owner(dag_id, run_id),
                max_attempts=rowlease.reclaim_cap(table),
            )
    if abandoned:
        log.info("%s: re-pended %d row(s) still claimed by earlier runs of this DAG", dag_id, abandoned)
    return {"promotion": promoted, "abandoned": abandoned}


def reclaim_step(leader: Leader, *, limit: int = 1000) -> dict[str, int]:
    """Re-pend rows whose row lease expired, every staged table."""
    with StagelineStoreHook() as hook:
        return housekeeping.reclaim(hook.get_conn(), int(leader["epoch"]), leader.get("owner"), limit=limit)


def retention_step(leader: Leader, ages: Mapping[str, timedelta] | None = None, *, batch: int = 5000) -> dict[str, int]:
    """Archive, then delete, finished rows and audit events older than their retention; the rows deleted.

    The periods are the service config's `[retention]` (read now, when the task runs), per-connection
    overrides included; `ages` replaces the global ones (tests, a one-off run).
    """
    with StagelineStoreHook() as hook:
        config = hook.config.retention
        older = {key: age.total_seconds() for key, age in ages.items()} if ages is not None else config.ages_seconds()
        return housekeeping.retention(
            hook.get_conn(), int(leader["epoch"]), older, batch=batch, connections=config.connection_ages_seconds()
        )


def archive_parquet_step(leader: Leader, *, spark: Any = None, batch: int = 5000) -> dict[str, int] | None:
    """Move archive rows held longer than `[retention] archive_days` to Parquet under `archive_path`
    (`spark_jobs.archive_job`); the rows moved per kind, or None when no `archive_path` is set
    (then no Spark session is opened and the archive tables keep everything).

    `spark`: a session to use; by default the `stageline_spark` connection's, opened here.
    """
    from spark_jobs import archive_job

    with StagelineStoreHook() as hook:
        retention = hook.config.retention
        if not retention.archive_path:
            return None

        def run(session: Any) -> dict[str, int]:
            return archive_job.run(
                hook.get_conn(),
                session,
                epoch=int(leader["epoch"]),
                path=retention.archive_path,
                older_than_seconds=retention.archive_days * 86_400.0,
                batch_size=batch,
            )

        if spark is not None:
            return run(spark)
        with StagelineSparkHook(SPARK_CONN_ID).stage_session(
            name="maintenance_retention", conf=SPARK_TASK_CONF
        ) as session:
            return run(session.spark)


def needs_spark(stage: Stage) -> bool:
    """Whether `stage`'s job task opens a Spark session: all but deliver with
    `$STAGELINE_DELIVER_IN_PROCESS` set, which sends from the task process (so the task holds no
    Spark Connect client: no gRPC channel, no session on the server)."""
    return not (stage is DELIVER and os.environ.get(DELIVER_IN_PROCESS_ENV))


def run_stage(stage: Stage, epoch: int, run_id: str, **kwargs: Any) -> dict[str, Any]:
    """The job task of `stage`'s DAG (`stage_dag`): deliver's own loop, or any batch stage's."""
    if stage is DELIVER:
        return run_deliver_stage(epoch, run_id, **kwargs)
    return run_batch_stage(stage, epoch, run_id, **kwargs)


def run_batch_stage(
    stage: Stage,
    epoch: int,
    run_id: str,
    *,
    spark: Any,
    dag_id: str | None = None,
    try_number: int = 1,
    batch_size: int = BATCH_SIZE,
) -> dict[str, Any]:
    """Micro-batches of a batch stage (one with a landing) from `epoch` on (`include.stage_loop`):
    claim its due rows, run its transform (`Stage.job`, built before each claim from the pipeline
    config loaded once per task), land, finalize fenced.

    Returns counts, not ids, for the XCom. A change of leader is followed, not raised: the batch
    under the old epoch lands nothing and the task carries on under the new leader's epoch (or
    ends, reporting it, when no leader is live in time).
    """
    from spark_jobs.stage_job import KeptPlans, StageContext, run_stage_job, stage_job

    dag_id = dag_id or stage.dag_id
    # every batch of this task claims as this prefix + its number: one plan for all of them
    plans = KeptPlans(claim_owner(dag_id, f"{run_id}#{try_number}."))
    loaded = stage_config.fingerprint()  # before the load: an edit meanwhile ends the run
    config = stage_config.load()
    job, lookups = stage_job(stage), LookupCache()
    # the business keys of what the first stage claims, taken out while Spark routes it
    # (include/store/keys.py): one worker thread for the task, so its connection is reused
    keys = load_keys(config.directory) if stage.input is INBOUND else KeyRules()
    indexer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keys") if keys else None
    catching_up = bool(keys)

    def batch(b: Batch) -> Any:
        nonlocal catching_up
        if catching_up:  # messages staged before store version 18, once
            catching_up = keys_catch_up(b.store, keys) != 0
        return run_stage_job(
            stage,
            b.store,
            b.spark,
            transform=job(StageContext(b.store, config, lookups.get)),
            owner=b.owner,
            epoch=b.epoch,
            run_id=b.run_id,
            batch_size=b.limit or batch_size,
            passthrough=config.passthrough,
            alongside=(lambda ids: indexer.submit(index_keys, b.store, keys, ids)) if indexer else None,
            plans=plans,
        )

    try:
        return _micro_batches(stage, dag_id, run_id, try_number, epoch, spark, batch, loaded=loaded, most=batch_size)
    finally:
        if indexer is not None:
            indexer.shutdown(wait=True)


class LookupCache:
    """The lookup tables a stage task's batches map with: read by its first batch, and read
    again when `stageline lookups` changed them (asked at most every LOOKUP_CHECK_SECONDS, one
    small aggregate) — a stage task runs for hours, a changed table applies within seconds."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tables: dict[str, dict[str, str]] | None = None
        self._seen: object = None
        self._next_check = 0.0

    def get(self, store: Any) -> dict[str, dict[str, str]]:
        now = self._clock()
        if self._tables is None or now >= self._next_check:
            self._next_check = now + LOOKUP_CHECK_SECONDS
            seen = lookup_store.fingerprint(store)
            if self._tables is None or seen != self._seen:
                self._tables, self._seen = lookup_store.load_all(store), seen
        return self._tables


def run_deliver_stage(
    epoch: int,
    run_id: str,
    *,
    spark: Any,
    dag_id: str = DELIVER.dag_id,
    try_number: int = 1,
    max_lanes: int = DELIVER_MAX_LANES,
) -> dict[str, Any]:
    """Deliver rounds of lane prefixes under `epoch` (see `_micro_batches`).

    Sends run in Spark (lanes spread over partitions) unless `$STAGELINE_DELIVER_IN_PROCESS` is
    set, which sends from the task process itself (no Spark; for a tiny single node).
    """
    from spark_jobs import deliver_job

    loaded = stage_config.fingerprint()
    config = stage_config.load()
    if os.environ.get(DELIVER_IN_PROCESS_ENV):
        spark = None
    return _micro_batches(
        DELIVER,
        dag_id,
        run_id,
        try_number,
        epoch,
        spark,
        lambda b: deliver_job.run(
            b.store,
            b.spark,
            destinations=config.destinations,
            owner=b.owner,
            epoch=b.epoch,
            max_lanes=max_lanes,
            concurrency=DELIVER_CONCURRENCY,
            time_budget_seconds=DELIVER_ROUND_BUDGET_SECONDS,
            stop=b.stop,
        ),
        loaded=loaded,
        most=None,
    )


def _micro_batches(
    stage: Stage,
    dag_id: str,
    run_id: str,
    try_number: int,
    epoch: int,
    spark: Any,
    job: stage_loop.Job,
    *,
    loaded: str,
    most: int | None,
    **kwargs: Any,
) -> dict[str, Any]:
    """The stage task's loop (`include.stage_loop.run_stage`) on the task's store, with the real
    `ClaimKeeper`; `spark` a session or the DAG's `include.spark.StageSession` (renewed in place).
    Batches are capped by time as well as `most` rows (`include.batch_size`; `most=None`: the job
    caps its own claims — deliver, whose batch is many rounds, each one claim of lane heads of at
    most `deliver.DEFAULT_ROUND_ROWS`, one short claim (docs/performance.md); the run ends when
    the pipeline config's fingerprint differs from `loaded` (taken before the task loaded it)."""
    from include.spark import StageSession
    from include.store import operator

    kwargs.setdefault("session", StageSession.of(spark))
    kwargs.setdefault("changed", lambda: stage_config.fingerprint() != loaded)
    with StagelineStoreHook() as hook:
        if most is not None:
            kwargs.setdefault("size", BatchSize.for_backend(hook.config.store.backend, most=most))
        kwargs.setdefault(
            "history",
            lambda **batch: operator.record_batch(hook.get_conn(), dag_id=dag_id, try_number=try_number, **batch),
        )
        return stage_loop.run_stage(
            stage.name,
            dag_id,
            run_id,
            try_number,
            epoch,
            job,
            config=hook.config,
            store=hook.get_conn(),
            keeper=lambda config, store, term_epoch: claim_keeper(config, store, stage=stage, epoch=term_epoch),
            **kwargs,
        )


def claim_keeper(config: ServiceConfig, store: Any, *, stage: Stage, epoch: int) -> ClaimKeeper:
    """The watch beside a stage task (`include.claim_keeper`) on the stage's input, timed by the service config."""
    table = stage.input
    return ClaimKeeper(
        store,
        table,
        epoch=epoch,
        clustered=config.cluster.enabled,
        check_seconds=config.cluster.heartbeat_seconds,
        lease_seconds=config.store.lease_ttl_seconds,
        reclaim_seconds=config.cluster.reclaim_interval_seconds,
        max_attempts=rowlease.reclaim_cap(table),
        max_batch_seconds=HUNG_BATCH_SECONDS,
        on_hung=end_hung_task,
    )


def end_hung_task(owner: str) -> None:
    """End this task process because batch `owner` hung: SIGTERM (Airflow fails the try and retries
    it at once; the retry re-pends the claim), and if a call that ignores signals keeps it alive,
    exit HUNG_EXIT_SECONDS later."""
    import signal
    import threading

    log.error("ending the stage task: batch %s hung", owner)
    exit_later = threading.Timer(HUNG_EXIT_SECONDS, os._exit, args=(70,))
    exit_later.daemon = True
    exit_later.start()
    os.kill(os.getpid(), signal.SIGTERM)


def metadata_clean_command(
    *, dag_ids: Sequence[str], keep: timedelta, tables: Sequence[str] = METADATA_TABLES, batch_size: int = 10_000
) -> str:
    """A bash script that runs `airflow db clean` for the frequent stage DAGs' old runs.

    Rows older than `keep` before the run's `run_after` go (deleting a dag_run cascades to its task
    instances and their XComs); Airflow always keeps each DAG's latest scheduled run. Airflow 3
    blocks the metadata DB inside task processes by overwriting `AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`
    with `airflow-db-not-allowed:///`, and that value is inherited by child processes; the script
    therefore takes the URL from `$STAGELINE_AIRFLOW_DB_CONN` when set, else drops the blocked value
    so `airflow.cfg` or `..._CONN_CMD` / `..._CONN_SECRET` apply (the single-node SQLite default).
    """
    seconds = int(keep.total_seconds())
    if seconds <= 0:
        raise ValueError("keep must be positive")
    args = [
        "airflow",
        "db",
        "clean",
        "--clean-before-timestamp",
        "__BEFORE__",
        "--tables",
        ",".join(tables),
        "--dag-ids",
        ",".join(dag_ids),
        "--batch-size",
        str(int(batch_size)),
        "--skip-archive",
        "--yes",
    ]
    command = shlex.join(args).replace(
        "__BEFORE__", f"'{{{{ (dag_run.run_after - macros.timedelta(seconds={seconds})).isoformat() }}}}'"
    )
    blocked = "airflow-db-not-allowed:///"
    return "\n".join(
        [
            "set -eu",
            # the project's own `airflow` when the worker's PATH lacks the venv (not run under `uv run`)
            f'export PATH="$PATH:{Path(sys.executable).parent}"',
            f'if [ -n "${{{AIRFLOW_DB_CONN_ENV}:-}}" ]; then',
            f'  export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW_DB_CONN_ENV}"',
            f'elif [ "${{AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-}}" = "{blocked}" ]; then',
            "  unset AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
            "fi",
            f'if [ "${{AIRFLOW__CORE__SQL_ALCHEMY_CONN:-}}" = "{blocked}" ]; then',
            "  unset AIRFLOW__CORE__SQL_ALCHEMY_CONN",
            "fi",
            command,
        ]
    )
