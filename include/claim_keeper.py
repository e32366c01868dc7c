"""The watch a stage task keeps beside its micro-batches (invariants 5 and 8).

A stage task runs batch after batch under one epoch. One daemon thread beside it, on its own
store connection:

- **follows leadership** — every `check_seconds` (at most a second, at most the cluster
  heartbeat) it reads the lease. Once the epoch has moved on, or in a cluster the lease has
  lapsed, it sets `stopped`; the micro-batch loop looks between batches and while idle and ends
  the task at once, so the next run starts under the new leader within about a heartbeat instead
  of after the idle linger.
- **keeps the claim alive** — every `renew_seconds` (a third of the row lease) it renews the row
  leases of the batch in flight (`owner`). So the row lease can be short: a live batch never
  loses its rows however long it runs, while a dead one (its process killed) stops renewing and
  its rows are due again one short lease later.
- **sweeps** — every `reclaim_seconds` (`[cluster].reclaim_interval_seconds`) it re-pends its
  stage's rows whose row lease expired (claimers that died without anyone noticing).
- **gives up on a hung batch** — a batch still running after `max_batch_seconds` (a Spark server
  that stopped answering, a destination on a hung mount) is not renewed any more, so its rows are
  swept one row lease later, and `on_hung` ends the task (the stage's run lasts hours: without this
  the only run of the DAG would sit on its lanes until the run's timeout).

A failed read or write is logged and tried again next tick: the batches' own fenced writes are
what keeps the data safe; the watch only makes recovery prompt. Invariants: docs/invariants.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from include.store import StagedTable, Store
from include.store.rowlease import recover_abandoned, renew_claims, sweep_expired

log = logging.getLogger(__name__)

MAX_CHECK_SECONDS = 1.0


class ClaimKeeper:
    """Watch the lease and keep `owner`'s claim alive while a stage task runs (module docstring).

    :param table: the staged table the task claims from (its rows are renewed and swept).
    :param clustered: a lapsed lease also stops the task (a single node's lease never lapses).
    :param max_attempts: claims after which a swept or recovered row is dead-lettered instead.
    :param max_batch_seconds: a batch (one `owner`) running longer is hung (module docstring).
    :param on_hung: called once, with the owner, when a batch is found hung.
    """

    _batch: tuple[str | None, float]  # the batch in flight and when this keeper first saw it

    def __init__(
        self,
        store: Store,
        table: StagedTable,
        *,
        epoch: int,
        clustered: bool,
        check_seconds: float,
        lease_seconds: float,
        reclaim_seconds: float,
        max_attempts: int,
        max_batch_seconds: float | None = None,
        on_hung: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.table = table
        self.epoch = epoch
        self.clustered = clustered
        self.check_seconds = min(check_seconds, MAX_CHECK_SECONDS)
        self.lease_seconds = lease_seconds
        self.renew_seconds = lease_seconds / 3
        self.reclaim_seconds = reclaim_seconds
        self.max_attempts = max_attempts
        self.max_batch_seconds = max_batch_seconds
        self.on_hung = on_hung
        self.hung: str | None = None
        """The owner of a batch found hung (no longer renewed), if any."""
        self.owner: str | None = None
        """The claim in flight (set by the loop before each batch, None while idle)."""
        self.stopped = threading.Event()
        self.reason: str | None = None
        self._clock = clock
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stageline-keeper-{table.key}", daemon=True)

    def __enter__(self) -> ClaimKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._thread.join(timeout=10)

    def stopping(self) -> bool:
        """Whether the task must not start another batch under this epoch."""
        return self.stopped.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True (at once) when the task must stop."""
        return self.stopped.wait(seconds)

    def check(self) -> bool:
        """Read the lease once; True (and `stopped` set) when the task must stop."""
        with self.store.transaction(write=False) as tx:
            row = tx.one("lease_watch")
        if row is None:
            return self._stop("the lease row is gone")
        if int(row["epoch"]) != self.epoch:
            return self._stop(f"epoch {self.epoch} is no longer current (now {row['epoch']})")
        if self.clustered and not row["live"]:
            return self._stop(f"the lease of epoch {self.epoch} has lapsed: no live leader")
        return False

    def recover_abandoned(self, *, prefix: str, keep: str) -> int:
        """Re-pend at once the rows held by ended claimers: owners starting with `prefix` but not
        `keep` (`rowlease.recover_abandoned`); how many."""
        with self.store.transaction() as tx:
            recovered = recover_abandoned(
                tx,
                self.table,
                prefix=prefix,
                keep=keep,
                epoch=self.epoch,
                owner=keep.rstrip("."),
                max_attempts=self.max_attempts,
            )
        if recovered:
            log.info("re-pended %d %s row(s) held by claimers that have ended (%s…)", recovered, self.table.key, prefix)
        return recovered

    def renew(self) -> int:
        """Renew the row leases of the claim in flight; how many rows."""
        owner = self.owner
        if owner is None or owner == self.hung:
            return 0
        with self.store.transaction() as tx:
            return renew_claims(tx, self.table, owner=owner, epoch=self.epoch, lease_seconds=self.lease_seconds)

    def sweep(self) -> int:
        """Re-pend this stage's rows whose row lease expired; how many."""
        with self.store.transaction() as tx:
            swept = sweep_expired(
                tx, self.table, owner=f"keeper:{self.table.key}", epoch=self.epoch, max_attempts=self.max_attempts
            )
        if swept:
            log.info("re-pended %d %s row(s) whose row lease expired", swept, self.table.key)
        return swept

    def _stop(self, reason: str) -> bool:
        if not self.stopped.is_set():
            self.reason = reason
            log.warning("stage task stops: %s", reason)
            self.stopped.set()
        return True

    def _watch_batch(self, now: float) -> None:
        """Note when the batch in flight started; past `max_batch_seconds`, give it up (once)."""
        owner = self.owner
        if owner != self._batch[0]:
            self._batch = (owner, now)
        if owner is None or self.max_batch_seconds is None or owner == self.hung:
            return
        if now - self._batch[1] > self.max_batch_seconds:
            self.hung = owner
            log.error(
                "stage batch %s has run %.0f s (more than %.0f s): hung; its rows are no longer "
                "renewed and the task ends",
                owner,
                now - self._batch[1],
                self.max_batch_seconds,
            )
            if self.on_hung is not None:
                self.on_hung(owner)

    def _run(self) -> None:
        now = self._clock()
        self._batch = (self.owner, now)
        due = {"check": now, "renew": now + self.renew_seconds, "sweep": now}
        steps = {
            "check": (self.check, self.check_seconds),
            "renew": (self.renew, self.renew_seconds),
            "sweep": (self.sweep, self.reclaim_seconds),
        }
        while not self._closing.is_set() and not self.stopped.is_set():
            now = self._clock()
            self._watch_batch(now)
            for name, (step, every) in steps.items():
                if now >= due[name]:
                    due[name] = now + every
                    try:
                        step()
                    except Exception as exc:  # the next tick tries again
                        log.warning("stage keeper: %s failed: %s: %s", name, type(exc).__name__, exc)
            self._closing.wait(max(0.0, min(due.values()) - self._clock()))
