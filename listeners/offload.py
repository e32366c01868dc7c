"""Work proportional to a large input, off the reactor thread.

Splitting and validating a large HL7 batch is Python work in proportion to its size
(docs/performance.md); on the reactor that time is silence for every other sender, `/health` and
the lease (invariant 10). `off_reactor` runs such work in the reactor's thread pool and hands the result
back to the reactor; small inputs, the common case, run at once (a thread hand-over costs more
than they do). The work must be pure: no reactor, no writer, no shared state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet import threads
from twisted.internet.defer import Deferred, maybeDeferred

__all__ = ["OFFLOAD_BYTES", "SEGMENT_WEIGHT", "off_reactor"]

OFFLOAD_BYTES = 64 * 1024
"""Inputs of this size or more go to a thread (what splitting this much costs: docs/performance.md)."""
SEGMENT_WEIGHT = 128
"""Bytes a segment counts as when a profile checks it: 512 segments go to a thread, however short."""


def off_reactor(reactor: Any, size: int, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
    """`work(*args, **kwargs)` as a Deferred: in `reactor`'s thread pool when `size` (bytes, or a
    like measure) reaches `OFFLOAD_BYTES` and the reactor has one; at once otherwise."""
    pool = getattr(reactor, "getThreadPool", None)
    if size < OFFLOAD_BYTES or pool is None:
        return maybeDeferred(work, *args, **kwargs)
    return threads.deferToThreadPool(reactor, pool(), work, *args, **kwargs)
