"""Leader-gated polling: the start/stop/schedule skeleton of every inbound that polls a shared
resource (file drop, database poll), so each of those modules holds only what one poll does.

The daemon calls ``start()`` when this node wins the lease and ``stop()`` when it loses it
(invariant 4). A poll in hand is never cut short: ``stop()`` fires once it is over, and a
``start()`` during it lets that poll reschedule itself rather than starting a second one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure

from listeners.connections_config import InboundConfig

__all__ = ["PollingInbound", "RunBlocking"]

RunBlocking = Callable[..., Deferred[Any]]
"""``run_blocking(f, *args) -> Deferred`` runs ``f(*args)`` off the reactor thread."""


class PollingInbound:
    """Runs ``poll()`` every ``config.poll_seconds`` (or `_next_delay`) while started.

    Subclasses write ``poll()`` and may hook `_on_start`, `_next_delay` and `_on_stop`.
    """

    def __init__(
        self,
        config: InboundConfig,
        *,
        what: str,
        log: Logger,
        reactor: IReactorTime | None,
        run_blocking: RunBlocking | None,
    ) -> None:
        """``what`` names the poll in the log ("file drop poll"); ``reactor`` schedules the polls;
        ``run_blocking`` defaults to its thread pool."""
        if reactor is None:
            from twisted.internet import reactor as global_reactor

            reactor = cast(IReactorTime, global_reactor)
        if run_blocking is None:
            threads = cast(IReactorThreads, reactor)  # a real reactor: it has a thread pool too
            run_blocking = partial(deferToThreadPool, threads, threads.getThreadPool())
        self.config = config
        self._what = what
        self._poll_log = log
        self._clock = reactor
        self._run = run_blocking
        self._running = False
        self._call: IDelayedCall | None = None
        self._polling: Deferred[Any] | None = None
        self._stop_waiters: list[Deferred[None]] = []

    @property
    def running(self) -> bool:
        return self._running

    def poll(self) -> Deferred[Any]:
        """One poll; a failure is logged and the next poll scheduled as usual."""
        raise NotImplementedError

    def start(self) -> None:
        """Begin polling (the daemon calls this on the leader only)."""
        if self._running:
            return
        self._running = True
        self._on_start()
        if self._polling is None:  # else the poll still running from before stop() reschedules
            self._schedule(0)

    def stop(self) -> Deferred[None]:
        """Stop polling; fires once the poll in hand (if any) is over and `_on_stop` is done."""
        self._running = False
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        if self._polling is None:
            return self._on_stop()
        d: Deferred[None] = Deferred()
        self._stop_waiters.append(d)
        return d.addCallback(lambda _: self._on_stop())

    def _on_start(self) -> None:
        """Called by every ``start()`` that was not already running."""

    def _next_delay(self) -> float:
        """How long after a poll the next one starts."""
        return self.config.poll_seconds

    def _on_stop(self) -> Deferred[None]:
        """What ``stop()`` waits for once no poll is running."""
        return succeed(None)

    def _schedule(self, delay: float) -> None:
        self._call = self._clock.callLater(delay, self._tick)

    def _tick(self) -> None:
        self._call = None
        self._polling = self.poll()
        self._polling.addErrback(self._poll_crashed).addBoth(self._poll_done)

    def _poll_crashed(self, failure: Failure) -> None:
        self._poll_log.critical(
            "{what} of {connection} crashed: {error}",
            what=self._what,
            connection=self.config.name,
            error=failure.type.__name__ if failure.type else "unknown",
        )

    def _poll_done(self, _: object) -> None:
        self._polling = None
        waiters, self._stop_waiters = self._stop_waiters, []
        for d in waiters:
            d.callback(None)
        if self._running:
            self._schedule(self._next_delay())
