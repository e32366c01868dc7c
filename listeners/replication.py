"""The store's replication posture, read at start and every few seconds (`include.store.replication`).

On a replicated PostgreSQL an `AA` means the commit is on two servers only while a synchronous
standby streams; Patroni drops to asynchronous replication when its standby is lost, and commits
go on. The node cannot change that, but it says so: `/cluster/status` shows the posture, the gauge
`stageline_store_sync_standbys` counts the synchronous standbys (NaN where there is no replication
to read: SQLite, SQL Server), and a change is logged once. Beside it `stageline_store_sync_standbys_expected`
says how many the operator expects (`[store] sync_standbys_expected`): the alert compares the two,
so a store that never had its standby fires as well as one that lost it.

A posture that can no longer be read is not shown as the last one read: once reads have failed for
STALE_AFTER rechecks (etcd without a quorum, a pool that cannot connect), `/cluster/status` shows
state `unknown` with the error and since when, and the gauge reads NaN — the alert fires on NaN
where a standby is expected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from twisted.application.internet import TimerService
from twisted.internet import defer, threads
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.store import Store
from include.store.replication import RECHECK_SECONDS, Posture, read_posture
from listeners.metrics import Metrics

__all__ = ["STALE_AFTER", "PostureService"]

STALE_AFTER = 2
"""Rechecks a failing read may span before the last posture read is no longer shown as current."""

_log = Logger(namespace="stageline.replication")


class PostureService(TimerService):
    """Reads the posture off the reactor thread; `posture` is the last one read (None: not read, or
    a store without replication). A failed read counts a store error; once no read has succeeded
    for STALE_AFTER rechecks (failing or hanging), the posture is `unknown` (`stale`)."""

    def __init__(
        self,
        store: Callable[[], Store | None],
        metrics: Metrics,
        *,
        seconds: float = RECHECK_SECONDS,
        expected: int = 0,
        reactor: Any = None,
    ) -> None:
        super().__init__(seconds, self._read)
        self.setName("replication")
        if reactor is not None:
            self.clock = reactor
        self._store = store
        self._metrics = metrics
        self.posture: Posture | None = None
        self._read_since: float | None = None  # when the reads began to be due, then the last good one began
        self._error: tuple[str, float] | None = None  # the last failed read's error, and (wall clock) since when
        metrics.store_sync_standbys.set_function(self._standbys)
        metrics.store_sync_standbys_expected.set(expected)

    def _now(self) -> float:
        if self.clock is None:
            from twisted.internet import reactor

            return float(reactor.seconds())
        return float(self.clock.seconds())

    @property
    def stale(self) -> bool:
        """No read has succeeded for STALE_AFTER rechecks past the last good one (reads failing, or
        one hanging on a pool that cannot connect): what was read may no longer hold."""
        since = self._read_since
        return since is not None and self._now() - since > (STALE_AFTER + 1) * self.step

    def _standbys(self) -> float:
        """The gauge, read at each scrape: NaN where nothing is known (not read, no replication, stale)."""
        posture = self.posture
        return math.nan if posture is None or self.stale else float(posture.sync_standbys)

    def document(self) -> dict[str, Any] | None:
        if not self.stale:
            return self.posture.document() if self.posture is not None else None
        error, since = self._error if self._error is not None else ("a read has not returned", None)
        return {
            "state": "unknown",
            "two_servers": False,
            "error": error,
            "failing_since": None if since is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)),
            "last_read": self.posture.document() if self.posture is not None else None,
        }

    def _read(self) -> Deferred[None]:
        store = self._store()
        if store is None or not store.has_query("replication_posture"):
            return defer.succeed(None)  # not open yet, or nothing to read (SQLite, SQL Server)
        started = self._now()
        if self._read_since is None:
            self._read_since = started
        return threads.deferToThread(read_posture, store).addCallbacks(self._found, self._failed, (started,))

    def _found(self, posture: Posture | None, started: float | None = None) -> None:
        if self._error is not None:
            _log.info("the store's replication posture is read again")
        self._error = None
        self._read_since = self._now() if started is None else started
        before, self.posture = self.posture, posture
        if posture is None or (before is not None and before.state == posture.state):
            return
        what = (
            "a commit is on two servers"
            if posture.two_servers
            else "a commit is on ONE server until a synchronous standby streams"
        )
        # the first read is news only where it is a promise; a change is news either way
        emit = _log.info if posture.two_servers or before is None else _log.warn
        emit(
            "store replication: {state} (standbys named: {names!r}, in sync: {n}); {what}",
            state=posture.state,
            names=posture.standby_names,
            n=posture.sync_standbys,
            what=what,
        )

    def _failed(self, failure: Failure) -> None:
        self._metrics.store_errors.labels("replication_posture").inc()
        error = f"{type(failure.value).__name__}: {str(failure.value)[:200]}"
        self._error = (error, self._error[1] if self._error is not None else time.time())
        _log.warn("reading the store's replication posture failed: {err}", err=type(failure.value).__name__)
