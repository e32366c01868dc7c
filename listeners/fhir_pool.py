"""The threads FHIR bodies are validated on, apart from every other input's.

Validating FHIR JSON against the R4B models costs far more per byte than HL7 v2's checks
(docs/performance.md), so no FHIR body is validated on the reactor, and none waits in (or holds)
the large-input gate that MLLP, TCP, file and HL7 HTTP bodies share (`listeners.batchgate`): a
costly Bundle must not make an MLLP batch wait. Instead FHIR has a few threads of its own and a
short queue in front of them; when both are full the body is refused at once (503 with
Retry-After) rather than held in memory. What one body may cost is bounded before it gets here
(``max_fhir_elements``, `listeners.fhir_inbound`), so this pool bounds the whole: at most
`THREADS` bodies in work and `QUEUE` waiting, each within its connection's limits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet import threads
from twisted.internet.defer import Deferred
from twisted.python.threadpool import ThreadPool

__all__ = ["QUEUE", "THREADS", "FhirPool", "PoolFull"]

THREADS = 2
"""Bodies validated at once (each one core while it runs)."""
QUEUE = 8
"""Bodies waiting for a thread; one more is refused with 503."""
RETRY_AFTER_SECONDS = 1


class PoolFull(Exception):
    """Every thread is busy and the queue is full: refuse, and let the sender retry."""


class FhirPool:
    """`run(work)` on one of `threads` threads, with at most `queue` waiting; else `PoolFull`.

    Counted on the reactor thread (no lock): a body is taken when `run` is called and let go when
    its Deferred fires. The threads start with the first body and stop with the reactor."""

    def __init__(self, reactor: Any, *, threads: int = THREADS, queue: int = QUEUE) -> None:
        self.reactor = reactor
        self.capacity = threads + queue
        self.taken = 0
        self._threads = threads
        self._pool: ThreadPool | None = None

    def run(self, work: Callable[[], Any]) -> Deferred[Any]:
        if self.taken >= self.capacity:
            raise PoolFull(f"{self.taken} FHIR bodies in work or waiting; resend in a moment")
        if self._pool is None:
            self._pool = ThreadPool(0, self._threads, name="stageline-fhir")
            self._pool.start()
            self.reactor.addSystemEventTrigger("during", "shutdown", self._pool.stop)
        self.taken += 1
        done: Deferred[Any] = threads.deferToThreadPool(self.reactor, self._pool, work)
        return done.addBoth(self._let_go)

    def _let_go(self, result: Any) -> Any:
        self.taken -= 1
        return result
