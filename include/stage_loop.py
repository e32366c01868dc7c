"""How a stage task runs: micro-batch after micro-batch, following leadership (invariants 5 and 8).

A DAG run costs seconds of scheduling and task starts (run start, leader check, recovery, sensor,
task start, Spark session; docs/performance.md) before its job begins. A stage under steady traffic
would pay that per batch, and a failover would pay it again before delivery resumed. So one stage
task keeps going:

    recover   re-pend the claims earlier tasks of this DAG left behind (they have ended: Airflow
              runs one task of a stage DAG at a time, and retries only after a try ended)
    loop      claim → job → finalize, the next batch as soon as one finalizes, a poll every
              POLL_SECONDS while idle; a `ClaimKeeper` beside it renews the claim in flight and
              watches the lease
    follow    the keeper sees the epoch move on or the lease lapse (within a heartbeat): no batch
              starts under the old epoch. The task waits up to FOLLOW_SECONDS for a live leader —
              the same check the DAG's leader_check makes — runs that epoch's on-promotion
              recovery (once per epoch, as the DAG's recover task does) and carries on under it.
              No live leader in time: the run ends and the next run's leader check waits.
    end       nothing came for `$STAGELINE_STAGE_LINGER_SECONDS` (default 120) under an epoch still
              current (one that ended meanwhile is followed as above), the pipeline config
              changed on disk, or the time budget is spent: the run ends and the continuous
              schedule starts the next one

Why the budget is hours, not minutes: a hand-over between runs costs seconds of scheduling and task
starts during which nothing of the stage moves, so at the rated rate each one leaves a backlog
and a minute whose p99 is that gap (docs/performance.md). Ended every four
minutes, the hand-overs built a backlog that snowballed under SQLite's lock (issue 22). A run now
ends on a change that needs a new one — config, leadership — or after STAGE_TIME_BUDGET_SECONDS.

Why follow inside the task rather than end and let the next run start: the guarantee is the same —
every claim and finalize is fenced by the epoch the lease named when it was read, exactly as with
a new run's leader check — but delivery resumes about a heartbeat after the new leader is elected
instead of a new run's Airflow scheduling later (docs/pipeline.md, "Failover"). The invariants are
numbered as in docs/invariants.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from include import housekeeping
from include.batch_size import BatchSize
from include.config import ServiceConfig
from include.store.lease import read_lease

log = logging.getLogger(__name__)

DEFAULT_LINGER_SECONDS = 120.0
LINGER_ENV = "STAGELINE_STAGE_LINGER_SECONDS"
"""Seconds a stage task waits for more work after its last batch before its run ends. Waiting is
cheap (one indexed probe per POLL_SECONDS, a Spark session kept open); a new run is not (seconds of
scheduling, a task start and a session before the next message moves). Two minutes keep a lull of
a minute or so at steady-state latency; the run still ends within STAGE_TIME_BUDGET_SECONDS."""
STAGE_TIME_BUDGET_SECONDS = 6 * 3600.0
"""How long one stage task keeps running micro-batches (module docstring; the job task's
execution_timeout is this plus STAGE_TIMEOUT_MARGIN_SECONDS). `$STAGELINE_STAGE_BUDGET_SECONDS` shortens it,
e.g. for a soak that measures the hand-over."""
BUDGET_ENV = "STAGELINE_STAGE_BUDGET_SECONDS"
STAGE_TIMEOUT_MARGIN_SECONDS = 600.0
"""What a job task may take beyond its budget: the batch in flight and the last finalize."""
CONFIG_CHECK_SECONDS = 5.0
"""How often a running task asks whether the pipeline config changed (a few stat calls)."""
POLL_SECONDS = 0.25
"""The wait between claims while idle: half of it is, on average, added to every hop of a message
(three hops); an empty claim is one indexed probe."""
MAX_CONSECUTIVE_FAILURES = 3
"""Batches in a row that may fail (their rows handed back) before the stage task itself fails."""
FAILURE_PAUSE_SECONDS = 2.0
MIN_FOLLOW_SECONDS = 5.0


@dataclass
class Batch:
    """What one micro-batch works with: its store, claim owner, run id and epoch, and `stop()`,
    true once the task must not start anything new (leadership moved)."""

    store: Any
    owner: str
    run_id: str
    epoch: int
    stop: Callable[[], bool] = field(default=lambda: False)
    spark: Any = None
    """The task's Spark session for this batch (a renewed one after a Spark Connect restart)."""
    limit: int | None = None
    """Rows this batch may claim, capped by time (`include.batch_size`); None: the job's own cap."""


Job = Callable[[Batch], Any]


class Session(Protocol):
    """What the loop needs of the task's Spark session (`include.spark.StageSession`)."""

    spark: Any

    def renew(self) -> bool: ...


class Watch(Protocol):
    """What the loop needs of a `ClaimKeeper` (tests give it a fake one)."""

    owner: str | None
    reason: str | None

    def stopping(self) -> bool: ...
    def wait(self, seconds: float) -> bool: ...
    def check(self) -> bool: ...
    def recover_abandoned(self, *, prefix: str, keep: str) -> int: ...


Keeper = Callable[[ServiceConfig, Any, int], AbstractContextManager[Watch]]
"""(config, store, epoch) → the watch for one term (one epoch) of the task."""


def claim_owner(dag_id: str, run_id: str) -> str:
    """The row-lease owner a stage run claims as: names the run in `lease_owner` and the audit trail."""
    return f"airflow:{dag_id}:{run_id}"


def linger_seconds() -> float:
    return float(os.environ.get(LINGER_ENV) or DEFAULT_LINGER_SECONDS)


def budget_seconds() -> float:
    """STAGE_TIME_BUDGET_SECONDS, or `$STAGELINE_STAGE_BUDGET_SECONDS` when that is a shorter positive
    number of seconds (anything else is an error: a typo must not turn runs into one batch each)."""
    raw = os.environ.get(BUDGET_ENV)
    if not raw:
        return STAGE_TIME_BUDGET_SECONDS
    seconds = float(raw)
    if not 0 < seconds < float("inf"):
        raise ValueError(f"${BUDGET_ENV} must be a positive number of seconds, got {raw!r}")
    return min(STAGE_TIME_BUDGET_SECONDS, seconds)


def follow_seconds(config: ServiceConfig) -> float:
    """How long a task whose leader went away waits for the next one, at least MIN_FOLLOW_SECONDS:
    two lease TTLs (a crashed leader's lease must expire before a standby acquires), or a
    step-down's backoff plus a TTL (issue 24: a leader that cannot bind releases the lease; when no
    other node can lead — the old one frozen on a shared address — the same node takes it again
    after its backoff, and a task that gave up sooner would cost a new run's seconds of scheduling)."""
    cluster = config.cluster
    return max(
        MIN_FOLLOW_SECONDS,
        2 * cluster.leader_lease_ttl_seconds,
        cluster.step_down_backoff() + cluster.leader_lease_ttl_seconds,
    )


def run_stage(
    stage: str,
    dag_id: str,
    run_id: str,
    try_number: int,
    epoch: int,
    job: Job,
    *,
    config: ServiceConfig,
    store: Any,
    keeper: Keeper,
    clock: Callable[[], float] = time.monotonic,
    follow: Callable[[ServiceConfig, Any, int, Watch], int | None] | None = None,
    session: Session | None = None,
    history: Callable[..., None] | None = None,
    size: BatchSize | None = None,
    changed: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Run `job(batch)` again and again in this one task, following leadership (module docstring).

    `config` and `store` are the task's (opened once per task by the caller, in Airflow
    `StagelineStoreHook`); every batch and the keeper work on that one store.

    Each batch claims as its own owner (`<run>#<try>.<n>`), so a retry or a later batch never
    reads rows an earlier one still holds. A finalize that meets a stale epoch (StaleEpoch) is
    handled like the keeper's signal. A failed batch (its rows already handed back by the job) is
    retried after a pause; MAX_CONSECUTIVE_FAILURES in a row fail the task (Airflow's retry starts a
    fresh one). A lost Spark Connect session (its server killed or restarted) is renewed in place
    once the server answers again (`session.renew()`); one that cannot be renewed fails the task.
    Each batch that claimed rows is handed to `history` (stage, owner, run_id, epoch, seconds,
    counts): `stage_batches`, so a long task's batches can be seen one by one. With `size`, each
    batch's claim is capped by time as well as rows (`include.batch_size`: told every batch's rows
    and its longest write transaction). `changed()`, asked every CONFIG_CHECK_SECONDS, true ends
    the run (the pipeline config changed: the next run loads and checks it). Returns counts summed
    over batches (the XCom), the epochs worked under, and why the task stopped early if it did.
    """
    from include.store.finalize import StaleEpoch

    follow = follow or follow_leader
    linger = linger_seconds()
    budget = budget_seconds()
    started = clock()
    next_config_check = started + CONFIG_CHECK_SECONDS
    failures = 0
    n = -1
    totals: dict[str, Any] = {
        "run_id": f"{run_id}#{try_number}",
        "epoch": epoch,
        "epochs": [epoch],
        "stale_epoch": False,
        "batches": 0,
    }
    while True:  # one term per epoch
        idle_since: float | None = None
        with keeper(config, store, epoch) as watch:
            watch.recover_abandoned(prefix=claim_owner(dag_id, ""), keep=claim_owner(dag_id, f"{run_id}#{try_number}."))
            while not watch.stopping():
                n += 1
                job_run_id = f"{run_id}#{try_number}.{n}"
                watch.owner = claim_owner(dag_id, job_run_id)
                batch_started = clock()
                _longest_write(store)  # from here on: this batch's
                try:
                    outcome = job(
                        Batch(
                            store,
                            watch.owner,
                            job_run_id,
                            epoch,
                            watch.stopping,
                            session.spark if session is not None else None,
                            size.limit if size is not None else None,
                        )
                    )
                except StaleEpoch:
                    log.warning("%s run %s: epoch %s is no longer current; nothing landed", stage, job_run_id, epoch)
                    watch.reason = watch.reason or f"epoch {epoch} is no longer current"
                    break
                except Exception as exc:
                    from include.spark import session_lost

                    failures += 1
                    if session_lost(exc):
                        log.warning(
                            "%s run %s: the Spark session is gone (%s); waiting for the server",
                            stage,
                            job_run_id,
                            type(exc).__name__,
                        )
                        if session is None or not session.renew():
                            raise
                        log.warning("%s: a new Spark session; carrying on", stage)
                        continue
                    if failures > MAX_CONSECUTIVE_FAILURES:
                        raise
                    # The job handed its claimed rows back; a busy SQLite file or a database
                    # restart is usually gone a moment later: cheaper to retry here than as a new try.
                    log.warning(
                        "%s run %s failed (%d in a row); trying again", stage, job_run_id, failures, exc_info=True
                    )
                    watch.wait(FAILURE_PAUSE_SECONDS)
                    continue
                finally:
                    owner, watch.owner = watch.owner, None
                failures = 0
                counts = _summary(outcome)
                if size is not None and counts.get("claimed"):
                    size.observe(rows=int(counts["claimed"]), held_seconds=_longest_write(store))
                if counts.get("claimed"):
                    if history is not None:
                        try:
                            history(
                                stage=stage,
                                owner=owner,
                                run_id=job_run_id,
                                epoch=epoch,
                                seconds=clock() - batch_started,
                                counts=counts,
                            )
                        except Exception as exc:  # history must not fail the stage
                            log.warning(
                                "%s run %s: batch history not written: %s", stage, job_run_id, type(exc).__name__
                            )
                    totals["batches"] += 1
                    for key, value in counts.items():
                        if isinstance(value, int) and not isinstance(value, bool) and key != "epoch":
                            totals[key] = totals.get(key, 0) + value
                    idle_since = None
                elif idle_since is None:
                    idle_since = clock()
                now = clock()
                if now - started >= budget:
                    return totals
                if idle_since is not None and now - idle_since >= linger:
                    if not _term_ended(watch):
                        return totals
                    break  # its epoch ended while the task looked idle: follow the new leader
                if changed is not None and now >= next_config_check:
                    next_config_check = now + CONFIG_CHECK_SECONDS
                    if changed():
                        log.warning("%s: the pipeline config changed; this run ends so the next one loads it", stage)
                        return {**totals, "stopped": "pipeline config changed"}
                if idle_since is not None:
                    watch.wait(POLL_SECONDS)
            reason = watch.reason or "leadership moved"
            new_epoch = follow(config, store, epoch, watch)
        if new_epoch is None:
            return {**totals, "stale_epoch": True, "stopped": reason}
        log.warning("%s: %s; carrying on under epoch %s", stage, reason, new_epoch)
        epoch = new_epoch
        totals["epochs"].append(epoch)


def _term_ended(watch: Watch) -> bool:
    """Asked before an idle run ends: whether its epoch ended meanwhile, so the task follows the
    next leader instead — a new run costs seconds of scheduling and task starts. A claim that
    waited through a store failover for a connection comes back empty under the old epoch, and the
    seconds it waited look like idleness (issue 28: the deliver run ended as the new leader was
    elected, and delivery waited for the next run). An unreadable lease: the run ends as before."""
    try:
        return watch.check()
    except Exception as exc:
        log.info("lease not read before ending an idle run: %s: %s", type(exc).__name__, exc)
        return False


def follow_leader(
    config: ServiceConfig, store: Any, epoch: int, watch: Watch, *, clock: Callable[[], float] = time.monotonic
) -> int | None:
    """Wait for a live leader after `epoch` stopped being usable; the epoch to carry on under, or
    None (no live leader within `follow_seconds`: the run ends, the next run's leader check waits).

    A new epoch gets its on-promotion recovery here (once per epoch, whoever comes first: the
    listener, a DAG's recover task or a stage task), so the old leader's claims are due before the
    first claim under it. The same epoch live again (a late renewal) is simply resumed.
    """
    deadline = clock() + follow_seconds(config)
    while True:
        try:
            lease = read_lease(store)
            if lease.live or not config.cluster.enabled:
                if lease.epoch != epoch:
                    housekeeping.recover(store, lease.epoch, lease.owner)
                return lease.epoch
        except Exception as exc:  # the database may be restarting; keep asking until the deadline
            log.info("waiting for a live leader: %s: %s", type(exc).__name__, exc)
        if clock() >= deadline:
            return None
        time.sleep(POLL_SECONDS)


def _longest_write(store: Any) -> float:
    """The store's longest write transaction on this thread since last asked (0.0 for a store
    that does not time them, as tests' fakes)."""
    longest = getattr(store, "longest_write", None)
    return float(longest()) if callable(longest) else 0.0


def _summary(outcome: Any) -> dict[str, Any]:
    """An outcome dataclass as XCom-sized plain data: id tuples become counts."""
    is_instance = dataclasses.is_dataclass(outcome) and not isinstance(outcome, type)
    fields_ = dataclasses.asdict(outcome) if is_instance else dict(outcome)
    return {k: len(v) if isinstance(v, (tuple, list)) else v for k, v in fields_.items()}
