"""The leader check of the stage DAGs (invariant 4 in docs/invariants.md), in plain Python.

Airflow is not a cluster node: it holds no lease of its own. Every stage DAG run first asks the
store who leads (`check_leadership`, on the database clock) and then does its work under *that*
leader's epoch, so each write it makes is fenced exactly like the leader's own: if leadership moves
mid-run, the run's writes fail instead of landing (invariant 3).

- single node (`[cluster].enabled = false`): the lease is permanent, so a run always proceeds with
  the current epoch — even epoch 0 before `listenerd` first started;
- cluster: a run proceeds only while some node holds a live lease.

A waiting run then asks `work_pending` until its stage has rows due. Both take a store the caller
opened (in Airflow: `StagelineStoreHook`, once per task). What a run does under the epoch it was
given — recovery, the reclaim sweep, retention — is `include/housekeeping.py`. Nothing here
imports Airflow, so all of it is tested without a scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from include.config import ClusterConfig
from include.store import Store
from include.store.lease import read_lease
from include.store.migrate import check_identity
from include.store.stages import STAGES, stage_named


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


def check_leadership(store: Store, cluster: ClusterConfig) -> LeaderCheck:
    """Read the lease on the DB clock and decide whether a stage run may proceed.

    A store that belongs to another cluster, or has no schema, raises: that is a misconfiguration
    to fix, not a leaderless moment to wait out.
    """
    check_identity(store, cluster_name=cluster.cluster_name)
    lease = read_lease(store)
    if not cluster.enabled:
        return LeaderCheck(
            True,
            lease.epoch,
            lease.owner,
            f"single node: permanent lease, epoch {lease.epoch} (owner {lease.owner or 'none yet'})",
        )
    if lease.live:
        return LeaderCheck(
            True,
            lease.epoch,
            lease.owner,
            f"leader {lease.owner} holds epoch {lease.epoch}, "
            f"lease expires in {(lease.expires_at or lease.db_now) - lease.db_now:.1f} s (DB clock)",
        )
    if lease.owner is None:
        return LeaderCheck(False, None, None, "no live leader: the lease has never been held")
    ago = lease.db_now - lease.expires_at if lease.expires_at is not None else 0.0
    return LeaderCheck(
        False,
        None,
        None,
        f"no live leader: the lease of {lease.owner} (epoch {lease.epoch}) expired {ago:.1f} s ago (DB clock)",
    )


def work_pending(store: Store, epoch: int, stage: str, *, require_live: bool, ahead: bool = False) -> bool | None:
    """Whether the stage named `stage` (`include.store.stages`) has rows due to be claimed in its
    input table: True / False, or None when the run must stop waiting — `epoch` is no longer
    current, or (`require_live`, a cluster) the lease has lapsed. An unknown stage is a ValueError.

    `ahead` also counts rows due in the inputs of the stages before this one (for `deliver`:
    inbound and routed too): work on its way. A waiting stage run starts its job then, so the job
    task is already running when the rows reach its table — the task start (seconds under a real
    scheduler) is paid once, side by side for all three stages, instead of once per hop.

    A waiting run polls this every second or so, on one store kept open for the whole wait.
    """
    this = stage_named(stage)
    tables = [s.input for s in STAGES[: STAGES.index(this) + 1]] if ahead else [this.input]
    due = False
    with store.transaction(write=False) as tx:
        for table in reversed(tables):  # its own table first: the likeliest to have work
            row = tx.row("work_pending", table=table)
            if int(row["epoch"]) != epoch or (require_live and not row["live"]):
                return None
            if row["due"]:
                due = True
                break
    return due
