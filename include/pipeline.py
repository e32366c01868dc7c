"""What the stage DAGs' tasks do, one function per task, so the DAG files stay configuration.

Every function takes the leader check's XCom (`{"epoch": int, "owner": str | None}`) and works
under that epoch. The service config comes from `$STAGELINE_CONFIG` (default `./stageline.toml`)
and the pipeline config from `$STAGELINE_PIPELINE_DIR` (`include.stage_config`) when a task
*runs*: nothing here touches a file, a database or Spark when a DAG file is parsed, and Spark and
the stage jobs are imported only inside the `run_*_stage` functions. Their Spark session comes from
the Spark provider (`@task.pyspark` on the `stageline_spark` connection, `SPARK_CONN_ID`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from include import leadership, stage_config
from include.claim_keeper import ClaimKeeper
from include.config import ServiceConfig
from include.store import INBOUND, OUTBOUND, ROUTED, rowlease

log = logging.getLogger(__name__)

AIRFLOW_DB_CONN_ENV = "STAGELINE_AIRFLOW_DB_CONN"
"""Airflow metadata DB URL for the metadata clean task (see `metadata_clean_command`)."""
METADATA_TABLES = ("dag_run", "task_instance", "xcom")
SPARK_CONN_ID = "stageline_spark"
"""The Airflow connection the stage tasks' Spark sessions come from (`@task.pyspark`, Spark
provider): type `spark_connect` for a long-lived Spark Connect server (the default deployment: no
JVM start per run), or type `spark` with a master such as `local[*]` (a classic session per task;
see `classic_spark_connection`). Set e.g. as `AIRFLOW_CONN_STAGELINE_SPARK`."""
SPARK_TASK_CONF = {"spark.sql.shuffle.partitions": "4", "spark.sql.session.timeZone": "UTC"}
"""Session settings of every stage task: runtime SQL settings only, so they apply to Connect too."""
DELIVER_IN_PROCESS_ENV = "STAGELINE_DELIVER_IN_PROCESS"
"""Set (non-empty) to send deliveries from the task process instead of Spark workers."""
ROUTE_BATCH_SIZE = 10_000
TRANSFORM_BATCH_SIZE = 10_000
DELIVER_MAX_LANES = 1_000
DELIVER_CONCURRENCY = 4
"""Lanes sent at once by each Spark partition (threads: sends wait on the network and on fsync)."""
DELIVER_ROUND_BUDGET_SECONDS = 60.0
STAGE_TIME_BUDGET_SECONDS = 240.0
"""How long one stage task keeps running micro-batches (the tasks' execution_timeout is 8 min)."""
DEFAULT_LINGER_SECONDS = 30.0
LINGER_ENV = "STAGELINE_STAGE_LINGER_SECONDS"
"""Seconds a stage task waits for more work after its last batch before its run ends."""
POLL_SECONDS = 0.5
MAX_CONSECUTIVE_FAILURES = 3
"""Batches in a row that may fail (their rows handed back) before the stage task itself fails."""
FAILURE_PAUSE_SECONDS = 2.0

Leader = Mapping[str, Any]


def recover_step(leader: Leader) -> int | None:
    """On-promotion recovery for the run's epoch (a no-op after the epoch's first run)."""
    return leadership.recover(None, int(leader["epoch"]), leader.get("owner"))


def reclaim_step(leader: Leader, *, limit: int = 1000) -> dict[str, int]:
    """Re-pend rows whose row lease expired, every staged table."""
    return leadership.reclaim(None, int(leader["epoch"]), leader.get("owner"), limit=limit)


def retention_step(leader: Leader, ages: Mapping[str, timedelta], *, batch: int = 5000) -> dict[str, int]:
    """Delete finished rows and audit events older than their retention."""
    return leadership.retention(None, int(leader["epoch"]),
                                {key: age.total_seconds() for key, age in ages.items()}, batch=batch)


def claim_owner(dag_id: str, run_id: str) -> str:
    """The row-lease owner a stage run claims as: names the run in `lease_owner` and the audit trail."""
    return f"airflow:{dag_id}:{run_id}"


def spark_connect_connection(host: str, port: int) -> str:
    """`AIRFLOW_CONN_STAGELINE_SPARK` for a Spark Connect server (its JDBC jars are on the server)."""
    return json.dumps({"conn_type": "spark_connect", "host": host, "port": int(port)})


def classic_spark_connection(master: str = "local[*]") -> str:
    """`AIRFLOW_CONN_STAGELINE_SPARK` for a classic session per task on `master`.

    The connection's extras become the session's Spark conf (Spark provider): the Debian JDBC
    driver jars, this venv's Python for the workers, no UI.
    """
    from include.spark import DRIVER_JARS

    return json.dumps({"conn_type": "spark", "host": master, "extra": {
        "spark.jars": ",".join(DRIVER_JARS.values()), "spark.pyspark.python": sys.executable,
        "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"}})


def run_route_stage(epoch: int, run_id: str, *, spark: Any, dag_id: str = "stage_route", try_number: int = 1,
                    batch_size: int = ROUTE_BATCH_SIZE) -> dict[str, Any]:
    """Route micro-batches under `epoch` (see `_micro_batches`): claim inbound rows, route, finalize fenced.

    Returns counts, not ids, for the XCom; a stale epoch (leadership moved mid-run) is reported,
    not raised: nothing landed, and retrying under the same epoch could only fail again — the next
    run works under the new leader's epoch.
    """
    from spark_jobs import route_job

    config = stage_config.load()
    return _micro_batches("route", dag_id, run_id, try_number, epoch, lambda store, owner, job_run_id, _stop: route_job.run(
        store, spark, routes=config.routes, owner=owner, epoch=epoch, run_id=job_run_id, batch_size=batch_size))


def run_transform_stage(epoch: int, run_id: str, *, spark: Any, dag_id: str = "stage_transform",
                        try_number: int = 1, batch_size: int = TRANSFORM_BATCH_SIZE) -> dict[str, Any]:
    """Transform micro-batches under `epoch`: routed rows → outbound rows (same contract as route)."""
    from spark_jobs import transform_job

    config = stage_config.load()
    read: list[dict[str, dict[str, str]]] = []  # the lookup tables, read by the task's first batch

    def batch(store: Any, owner: str, job_run_id: str, _stop: Callable[[], bool]) -> Any:
        if not read:  # once per task, not per micro-batch or idle poll: a changed table applies from the next run
            read.append(transform_job.read_lookups(store))
        return transform_job.run(store, spark, specs=config.transforms, destinations=config.destinations,
                                 owner=owner, epoch=epoch, run_id=job_run_id, batch_size=batch_size,
                                 lookups=read[0])

    return _micro_batches("transform", dag_id, run_id, try_number, epoch, batch)


def run_deliver_stage(epoch: int, run_id: str, *, spark: Any, dag_id: str = "stage_deliver", try_number: int = 1,
                      max_lanes: int = DELIVER_MAX_LANES) -> dict[str, Any]:
    """Deliver rounds of lane prefixes under `epoch` (see `_micro_batches`).

    Sends run in Spark (lanes spread over partitions) unless `$STAGELINE_DELIVER_IN_PROCESS` is
    set, which sends from the task process itself (no Spark; for a tiny single node).
    """
    from spark_jobs import deliver

    config = stage_config.load()
    if os.environ.get(DELIVER_IN_PROCESS_ENV):
        spark = None
    return _micro_batches("deliver", dag_id, run_id, try_number, epoch, lambda store, owner, _job_run_id, stop: deliver.run(
        store, spark, destinations=config.destinations, owner=owner, epoch=epoch, max_lanes=max_lanes,
        concurrency=DELIVER_CONCURRENCY, time_budget_seconds=DELIVER_ROUND_BUDGET_SECONDS, stop=stop))


@contextlib.contextmanager
def stage_session(spark: Any) -> Iterator[None]:
    """Around a stage job: a Spark Connect client fails within seconds when its server is gone
    (instead of retrying for minutes), and is closed without waiting on a dead server at exit."""
    if spark is None:
        yield
        return
    from include.spark import bound_connect_retries, close_session

    bound_connect_retries(spark)
    try:
        yield
    finally:
        close_session(spark)


def linger_seconds() -> float:
    return float(os.environ.get(LINGER_ENV) or DEFAULT_LINGER_SECONDS)


STAGE_TABLES = {"route": INBOUND, "transform": ROUTED, "deliver": OUTBOUND}
"""The staged table each stage claims from."""


def _micro_batches(stage: str, dag_id: str, run_id: str, try_number: int, epoch: int,
                   job: Callable[[Any, str, str, Callable[[], bool]], Any], *, clock: Callable[[], float] = time.monotonic,
                   keeper: Callable[[ServiceConfig, Any], Any] | None = None) -> dict[str, Any]:
    """Run `job(store, owner, job_run_id, stop)` — one micro-batch — again and again in this one task.

    A DAG run costs seconds of scheduling and task starts before its job even begins; a stage
    under steady traffic would pay that for every batch. So a stage task keeps claiming: the next
    batch as soon as one finalizes, polling every POLL_SECONDS while idle, until nothing came for
    `$STAGELINE_STAGE_LINGER_SECONDS` (default 30) or STAGE_TIME_BUDGET_SECONDS is spent; then the
    run ends and the continuous schedule starts the next one (with a fresh leader check). Each
    batch claims as its own owner (`<run>#<try>.<n>`): a retry or a later batch never reads rows an
    earlier one still holds.

    Failover (invariants 5 and 8): the task first re-pends the rows still held by earlier tasks of
    its DAG — Airflow starts a stage task only after the previous one ended, so a killed task's
    claim comes back now, not a row lease later. Then a `ClaimKeeper` runs beside the loop: it
    renews the claim in flight and, once the epoch moves on or the lease lapses, stops the task
    between batches or while idle, so the next run starts under the new leader within a heartbeat.
    A finalize that meets a stale epoch (StaleEpoch) ends it too. A failed batch (its rows already
    handed back by the job) is retried after a pause; MAX_CONSECUTIVE_FAILURES in a row, or a lost
    Spark Connect session, fail the task (Airflow's retry starts a fresh one). Counts are summed
    over batches for the XCom.
    """
    from include.store.stages import StaleEpoch

    linger = linger_seconds()
    started = clock()
    idle_since: float | None = None
    failures = 0
    totals: dict[str, Any] = {"run_id": f"{run_id}#{try_number}", "epoch": epoch, "stale_epoch": False, "batches": 0}
    with leadership.open_store(None) as (config, store):
        with (keeper or claim_keeper)(config, store, stage=stage, epoch=epoch) as watch:
            # Airflow runs one task of a stage DAG at a time (max_active_runs=1, one job task per
            # run, a retry only after the failed try ended): claims of earlier tasks are abandoned.
            watch.recover_abandoned(prefix=claim_owner(dag_id, ""),
                                    keep=claim_owner(dag_id, f"{run_id}#{try_number}."))
            n = -1
            while True:
                if watch.stopped.is_set():
                    return {**totals, "stale_epoch": True, "stopped": watch.reason}
                n += 1
                job_run_id = f"{run_id}#{try_number}.{n}"
                watch.owner = claim_owner(dag_id, job_run_id)
                try:
                    outcome = job(store, watch.owner, job_run_id, watch.stopped.is_set)
                except StaleEpoch:
                    log.warning("%s run %s: epoch %s is no longer current; nothing landed", stage, job_run_id, epoch)
                    return {**totals, "stale_epoch": True, "stopped": f"epoch {epoch} is no longer current"}
                except Exception as exc:
                    from include.spark import session_lost

                    failures += 1
                    if failures > MAX_CONSECUTIVE_FAILURES or session_lost(exc):
                        raise
                    # The job handed its claimed rows back; a busy SQLite file or a database
                    # restart is usually gone a moment later, cheaper to retry here than as a new try.
                    log.warning("%s run %s failed (%d in a row); trying again", stage, job_run_id, failures,
                                exc_info=True)
                    watch.wait(FAILURE_PAUSE_SECONDS)
                    continue
                finally:
                    watch.owner = None
                failures = 0
                counts = _summary(outcome)
                if counts.get("claimed"):
                    totals["batches"] += 1
                    for key, value in counts.items():
                        if isinstance(value, int) and not isinstance(value, bool) and key != "epoch":
                            totals[key] = totals.get(key, 0) + value
                    idle_since = None
                elif idle_since is None:
                    idle_since = clock()
                now = clock()
                if now - started >= STAGE_TIME_BUDGET_SECONDS or (idle_since is not None and now - idle_since >= linger):
                    return totals
                if idle_since is not None:
                    watch.wait(POLL_SECONDS)


def claim_keeper(config: ServiceConfig, store: Any, *, stage: str, epoch: int) -> ClaimKeeper:
    """The watch beside a stage task (`include.claim_keeper`), timed by the service config."""
    table = STAGE_TABLES[stage]
    return ClaimKeeper(store, table, epoch=epoch, clustered=config.cluster.enabled,
                       check_seconds=config.cluster.heartbeat_seconds, lease_seconds=config.store.lease_ttl_seconds,
                       reclaim_seconds=config.cluster.reclaim_interval_seconds,
                       max_attempts=rowlease.UNLIMITED_ATTEMPTS if table is OUTBOUND
                       else rowlease.SWEEP_MAX_ATTEMPTS)


def metadata_clean_command(*, dag_ids: Sequence[str], keep: timedelta,
                           tables: Sequence[str] = METADATA_TABLES, batch_size: int = 10_000) -> str:
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
    args = ["airflow", "db", "clean", "--clean-before-timestamp", "__BEFORE__",
            "--tables", ",".join(tables), "--dag-ids", ",".join(dag_ids),
            "--batch-size", str(int(batch_size)), "--skip-archive", "--yes"]
    command = shlex.join(args).replace(
        "__BEFORE__", f"'{{{{ (dag_run.run_after - macros.timedelta(seconds={seconds})).isoformat() }}}}'")
    blocked = "airflow-db-not-allowed:///"
    return "\n".join([
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
    ])


def _summary(outcome: Any) -> dict[str, Any]:
    """An outcome dataclass as XCom-sized plain data: id tuples become counts."""
    fields = dataclasses.asdict(outcome) if dataclasses.is_dataclass(outcome) else dict(outcome)
    return {k: len(v) if isinstance(v, (tuple, list)) else v for k, v in fields.items()}
