"""The store's replication posture, read at start and every few seconds (`include.store.replication`).

On a replicated PostgreSQL an `AA` means the commit is on two servers only while a synchronous
standby streams; Patroni drops to asynchronous replication when its standby is lost, and commits
go on. The node cannot change that, but it says so: `/cluster/status` shows the posture, the gauge
`stageline_store_sync_standbys` counts the synchronous standbys (NaN where there is no replication
to read: SQLite, SQL Server), and a change is logged once.
"""

from __future__ import annotations

import math
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

__all__ = ["PostureService"]

_log = Logger(namespace="stageline.replication")


class PostureService(TimerService):
    """Reads the posture off the reactor thread; `posture` is the last one read (None: not read, or
    a store without replication). A failed read keeps the last posture and counts a store error."""

    def __init__(
        self,
        store: Callable[[], Store | None],
        metrics: Metrics,
        *,
        seconds: float = RECHECK_SECONDS,
        reactor: Any = None,
    ) -> None:
        super().__init__(seconds, self._read)
        self.setName("replication")
        if reactor is not None:
            self.clock = reactor
        self._store = store
        self._metrics = metrics
        self.posture: Posture | None = None
        metrics.store_sync_standbys.set(math.nan)

    def document(self) -> dict[str, Any] | None:
        return self.posture.document() if self.posture is not None else None

    def _read(self) -> Deferred[None]:
        store = self._store()
        if store is None or not store.has_query("replication_posture"):
            return defer.succeed(None)  # not open yet, or nothing to read (SQLite, SQL Server)
        return threads.deferToThread(read_posture, store).addCallbacks(self._found, self._failed)

    def _found(self, posture: Posture | None) -> None:
        before, self.posture = self.posture, posture
        self._metrics.store_sync_standbys.set(math.nan if posture is None else posture.sync_standbys)
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
        _log.warn("reading the store's replication posture failed: {err}", err=type(failure.value).__name__)
