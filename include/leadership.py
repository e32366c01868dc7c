"""Leader gating and housekeeping for the stage DAGs (invariants 4 and 5, docs/invariants.md), in plain Python.

Airflow is not a cluster node: it holds no lease of its own. Every stage DAG run first asks the
store who leads (`check_leadership`, on the database clock) and then does its work under *that*
leader's epoch, so each write it makes is fenced exactly like the leader's own: if leadership moves
mid-run, the run's writes fail instead of landing (invariant 3).

- single node (`[cluster].enabled = false`): the lease is permanent, so a run always proceeds with
  the current epoch — even epoch 0 before `listenerd` first started;
- cluster: a run proceeds only while some node holds a live lease.

`recover`, `reclaim` and `retention` each open the store, do bounded work in short transactions
and close it again; each is safe to repeat (Airflow retries) and does nothing under a stale epoch.
Nothing here imports Airflow, so all of it is tested without a scheduler.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from include.config import ServiceConfig, config_path, load
from include.store import INBOUND, STAGED_TABLES, StagedTable, Store
from include.store import rowlease
from include.store.lease import read_lease
from include.store.migrate import check_identity

log = logging.getLogger(__name__)

EVENTS = "events"
"""Key of the audit trail (`message_events`) in a retention mapping; the others are stage names."""


@dataclass(frozen=True)
class LeaderCheck:
    """Whether a stage run may proceed, and under which epoch and leader."""

    proceed: bool
    epoch: int | None
    owner: str | None
    reason: str

    def as_xcom(self) -> dict[str, int | str | None]:
        """What the sensor hands to the run's other tasks."""
        return {"epoch": self.epoch, "owner": self.owner}


@contextmanager
def open_store(path: str | os.PathLike[str] | None = None) -> Iterator[tuple[ServiceConfig, Store]]:
    """Load the config and open its store for one task; closed (pool included) on exit."""
    config = load(config_path(path))
    store = Store(config.store)
    try:
        yield config, store
    finally:
        store.close()


def check_leadership(path: str | os.PathLike[str] | None = None) -> LeaderCheck:
    """Read the lease on the DB clock and decide whether a stage run may proceed.

    A store that belongs to another cluster, or has no schema, raises: that is a misconfiguration
    to fix, not a leaderless moment to wait out.
    """
    with open_store(path) as (config, store):
        check_identity(store, cluster_name=config.cluster.cluster_name)
        lease = read_lease(store)
    if not config.cluster.enabled:
        return LeaderCheck(True, lease.epoch, lease.owner,
                           f"single node: permanent lease, epoch {lease.epoch} (owner {lease.owner or 'none yet'})")
    if lease.live:
        return LeaderCheck(True, lease.epoch, lease.owner,
                           f"leader {lease.owner} holds epoch {lease.epoch}, "
                           f"lease expires in {(lease.expires_at or lease.db_now) - lease.db_now:.1f} s (DB clock)")
    if lease.owner is None:
        return LeaderCheck(False, None, None, "no live leader: the lease has never been held")
    ago = lease.db_now - lease.expires_at if lease.expires_at is not None else 0.0
    return LeaderCheck(False, None, None,
                       f"no live leader: the lease of {lease.owner} (epoch {lease.epoch}) "
                       f"expired {ago:.1f} s ago (DB clock)")


def work_pending(store: Store, epoch: int, stage: str, *, require_live: bool) -> bool | None:
    """Whether `stage` has rows due to be claimed: True / False, or None when the run must stop
    waiting — `epoch` is no longer current, or (`require_live`, a cluster) the lease has lapsed.

    Takes an open store: a waiting run polls this every second or so and keeps one store for it.
    """
    with store.transaction(write=False) as tx:
        row = tx.one("work_pending", table=stage_table(stage))
    if int(row["epoch"]) != epoch or (require_live and not row["live"]):
        return None
    return bool(row["due"])


def stage_table(stage: str) -> StagedTable:
    for table in STAGED_TABLES:
        if table.stage == stage:
            return table
    raise ValueError(f"unknown stage {stage!r}; known: {[t.stage for t in STAGED_TABLES]}")


def recover(path: str | os.PathLike[str] | None, epoch: int, owner: str | None) -> int | None:
    """Run the on-promotion recovery for `epoch`; the rows re-pended, or None when nothing ran.

    None means this epoch's recovery already ran (the usual case: every run after the first of an
    epoch pays one read-only query) or the epoch is no longer current.
    """
    with open_store(path) as (_, store):
        return recover_with(store, epoch, owner)


def recover_with(store: Store, epoch: int, owner: str | None) -> int | None:
    """`recover` on an open store (a stage task that follows a new leader runs it itself)."""
    if read_lease(store).recovered_epoch >= epoch:
        return None
    with store.transaction() as tx:
        recovered = rowlease.recover_on_promotion(tx, owner=owner or "airflow", epoch=epoch)
    if recovered is not None:
        log.info("recovery for epoch %s re-pended %s row(s) claimed under older epochs", epoch, recovered)
    return recovered


def reclaim(path: str | os.PathLike[str] | None, epoch: int, owner: str | None, *,
            limit: int = 1000, max_batches: int = 100) -> dict[str, int]:
    """Re-pend in-flight rows whose row lease expired, in every staged table.

    Each batch of at most `limit` rows is its own short transaction; a table stops at a short
    batch or after `max_batches` (what is left waits for the next run). Returns rows per stage.
    """
    counts: dict[str, int] = {}
    with open_store(path) as (_, store):
        for table in STAGED_TABLES:
            counts[table.stage] = _batches(
                lambda: _sweep(store, table, epoch=epoch, owner=owner or "airflow", limit=limit),
                limit=limit, max_batches=max_batches)
    if any(counts.values()):
        log.info("reclaim under epoch %s re-pended %s", epoch, counts)
    return counts


def retention(path: str | os.PathLike[str] | None, epoch: int,
              older_than_seconds: float | Mapping[str, float], *, batch: int = 5000,
              max_batches: int = 100) -> dict[str, int]:
    """Delete finished rows (done, dead, unrouted) older than each stage's retention.

    `older_than_seconds`: one age for every stage and the audit trail, or a mapping from stage
    name (`inbound`, `routed`, `outbound`) and `events` to an age; a key left out is not purged.
    Unfinished rows are never touched, however old. Returns rows deleted per key.
    """
    ages = _ages(older_than_seconds)
    counts: dict[str, int] = {}
    with open_store(path) as (_, store):
        for table in STAGED_TABLES:
            if table.stage in ages:
                # inbound's finished set (with `unrouted`) differs; each query repeats its index's predicate
                query, templated = ("purge_finished_inbound", None) if table is INBOUND else ("purge_finished", table)
                counts[table.stage] = _batches(
                    lambda: _purge(store, query, templated, epoch=epoch, age=ages[table.stage], limit=batch),
                    limit=batch, max_batches=max_batches)
        if EVENTS in ages:
            counts[EVENTS] = _batches(
                lambda: _purge(store, "purge_events", None, epoch=epoch, age=ages[EVENTS], limit=batch),
                limit=batch, max_batches=max_batches)
    if any(counts.values()):
        log.info("retention under epoch %s deleted %s", epoch, counts)
    return counts


def _ages(older_than_seconds: float | Mapping[str, float]) -> dict[str, float]:
    keys = [t.stage for t in STAGED_TABLES] + [EVENTS]
    if isinstance(older_than_seconds, Mapping):
        unknown = sorted(set(older_than_seconds) - set(keys))
        if unknown:
            raise ValueError(f"unknown retention key(s) {unknown}; known: {keys}")
        ages = {k: float(v) for k, v in older_than_seconds.items()}
    else:
        ages = dict.fromkeys(keys, float(older_than_seconds))
    negative = sorted(k for k, v in ages.items() if v < 0)
    if negative:
        raise ValueError(f"retention must not be negative: {negative}")
    return ages


def _batches(step: Callable[[], int], *, limit: int, max_batches: int) -> int:
    """Repeat `step` (one transaction, returns rows done) until a short batch or the cap."""
    total = 0
    for _ in range(max_batches):
        done = step()
        total += done
        if done < limit:
            break
    return total


def _sweep(store: Store, table: StagedTable, *, epoch: int, owner: str, limit: int) -> int:
    with store.transaction() as tx:
        return rowlease.sweep_expired(tx, table, owner=owner, epoch=epoch, limit=limit,
                                      max_attempts=rowlease.reclaim_cap(table))


def _purge(store: Store, query: str, table: StagedTable | None, *, epoch: int, age: float, limit: int) -> int:
    with store.transaction() as tx:
        tx.fence()
        return tx.execute(query, {"epoch": epoch, "ms": int(age * 1000), "limit": int(limit)}, table=table)
