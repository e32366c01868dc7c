"""The HTTP API's store reads, on threads of their own, bounded in number and in time.

The reactor's thread pool carries what keeps a node alive: the heartbeat that renews the leader's
lease, the hand-off of large batches and bodies (`listeners.offload`). An API read that waits on a
lock, or counts a large backlog, must not take those threads: a dozen `GET /stages?by=` against a
million queued rows used to hold them all, and the leader fenced itself and closed its ports. So
API reads run in a pool of their own (READ_THREADS), at most MAX_PENDING at a time — the next is
answered 503 at once, with `Retry-After` — and each is answered within READ_SECONDS even when its
statement is not done (503 "timed out"; the statement finishes in the background and its place frees
when it does), so a hung store costs neither the node nor the API's connection slots.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

READ_THREADS = 4
MAX_PENDING = 8
READ_SECONDS = 15.0
RETRY_AFTER_SECONDS = 1


class _Pool(ThreadPool):
    """Daemon threads: a read stuck in the store must not keep the process from exiting (the pool is
    stopped at reactor shutdown; a process that never runs one, like a test, would hang at exit)."""

    def threadFactory(self, *args: Any, **kwargs: Any) -> threading.Thread:  # type: ignore[override]
        return threading.Thread(*args, daemon=True, **kwargs)


class ReadsBusy(RuntimeError):
    """MAX_PENDING reads are already running: the caller should retry shortly."""


class ReadTimedOut(RuntimeError):
    """The read was not done within READ_SECONDS (it goes on in the background)."""


class ApiReads:
    """Runs `work()` off the reactor in the API's own pool (module docstring)."""

    def __init__(
        self,
        reactor: Any = None,
        *,
        threads: int = READ_THREADS,
        most: int = MAX_PENDING,
        seconds: float = READ_SECONDS,
    ) -> None:
        self._given = reactor  # None: the global reactor, looked up when first used (not at import)
        self._threads, self._most, self._seconds = threads, most, seconds
        self._pool: ThreadPool | None = None
        self.pending = 0

    def run(self, work: Callable[[], Any]) -> Deferred[Any]:
        """`work()`'s result; ReadsBusy at once when MAX_PENDING are running, ReadTimedOut after
        READ_SECONDS."""
        reactor = self._reactor()
        if self.pending >= self._most:
            return fail(ReadsBusy(f"{self.pending} store reads are running; retry in {RETRY_AFTER_SECONDS} s"))
        self.pending += 1
        answer: Deferred[Any] = Deferred()

        def settle(result: Any) -> None:
            if not answer.called:
                answer.errback(result) if isinstance(result, Failure) else answer.callback(result)

        timer = reactor.callLater(
            self._seconds, settle, Failure(ReadTimedOut(f"the store did not answer within {self._seconds:g} s"))
        )

        def done(result: Any) -> None:
            self.pending -= 1
            if timer.active():
                timer.cancel()
            settle(result)

        deferToThreadPool(reactor, self._start(reactor), work).addBoth(done)
        return answer

    def _reactor(self) -> Any:
        if self._given is not None:
            return self._given
        from twisted.internet import reactor

        return reactor

    def _start(self, reactor: Any) -> ThreadPool:
        if self._pool is None:
            self._pool = _Pool(0, self._threads, name="stageline-api-reads")
            self._pool.start()
            reactor.addSystemEventTrigger("during", "shutdown", self._pool.stop)
        return self._pool
