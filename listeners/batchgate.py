"""A process-wide cap on the large inputs (HL7 batches) being split and staged at once.

Each batch within the limits is fine alone, but splitting one holds many times its size in Python
objects (its messages, their rows) until it is committed: sixteen 1 MB batches on sixteen MLLP
connections at once, or ten 1 MB HTTP batch POSTs, multiplied listenerd's memory (issue 23, red team
network item 2; the figures: docs/performance.md). So a large input (`OFFLOAD_BYTES` or more)
waits for its turn here before its work starts, while at most `budget_bytes` of them are in work (one is always let
through, however large). Small inputs, the common case, never wait.

The queue is bounded without a limit of its own: a stream connection reads nothing while its batch
waits (the batch's answers are owed, `listeners.stream`), and an HTTP connection carries one
request at a time, so at most one waiting input per open connection. Turns are first come, first
served. A waiting input whose wait is cancelled (its reply timeout) leaves the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred

from listeners.offload import OFFLOAD_BYTES

__all__ = ["DEFAULT_BUDGET_BYTES", "BatchGate", "batch_gate"]

DEFAULT_BUDGET_BYTES = 4 * 1024 * 1024
"""Input bytes in work at once: one largest (4 MB) batch, or four 1 MB ones."""


class BatchGate:
    """Runs work on large inputs while at most `budget_bytes` of them are in work; the rest wait."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.in_work = 0  # bytes of the inputs whose work has started and not finished
        self.running = 0
        self._waiting: deque[tuple[int, Deferred[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def run(self, size: int, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        """`work(*args, **kwargs)` as a Deferred, started once `size` bytes fit in the budget; the
        bytes count until the Deferred `work` returns has fired. Under `OFFLOAD_BYTES`: at once."""
        if size < OFFLOAD_BYTES:
            return maybeDeferred(work, *args, **kwargs)
        turn: Deferred[None] = Deferred(lambda d: self._leave(d))
        self._waiting.append((size, turn))

        def start(_: None) -> Deferred[Any]:
            done = maybeDeferred(work, *args, **kwargs)
            done.addBoth(self._finished, size)
            return done

        turn.addCallback(start)
        self._admit()
        return turn

    def _leave(self, turn: Deferred[None]) -> None:
        for entry in self._waiting:
            if entry[1] is turn:
                self._waiting.remove(entry)
                break

    def _finished(self, result: Any, size: int) -> Any:
        self.in_work -= size
        self.running -= 1
        self._admit()
        return result

    def _admit(self) -> None:
        while self._waiting:
            size, turn = self._waiting[0]
            if self.running and self.in_work + size > self.budget_bytes:
                return
            self._waiting.popleft()
            self.in_work += size
            self.running += 1
            turn.callback(None)


batch_gate = BatchGate()
"""The process's gate: MLLP and TCP frames, HTTP bodies and file-drop batches share it."""
