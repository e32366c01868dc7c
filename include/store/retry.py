"""Retry a short store write through a brief outage (a database restart, a failover of its VIP).

For writes that hand work back after a failure (`with_retries`): if they are given up, the rows
they would free stay claimed — holding their lanes — until a row lease runs out. And for the
deliver round's finalize (`until_done`): the round's messages were sent, and outcomes lost to a
restart would send them all again. Nothing else in the store retries; callers see every failure.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_SECONDS = 60.0
"""Longer than a database restart takes, and than any wait for a busy SQLite file. The rows a
hand-back frees stay claimed by a task that is still alive meanwhile — its keeper renews their row
lease — so giving up early would only swap a short wait for a full row lease (issue 22: hand-backs
of 10,000 rows given up after 15 s under lock contention made the next batches bigger)."""
JITTER = 0.5
"""Each pause is drawn from ±50% of the backoff step, so writers that failed together (on one
busy SQLite file) do not all come back in the same millisecond."""


def until_done(
    step: Callable[[], T],
    *,
    what: str,
    seconds: float = RETRY_SECONDS,
    give_up_on: tuple[type[BaseException], ...] = (),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`step()`'s result, run again while it fails until `seconds` have passed (backoff 0.1 s
    doubling to 2 s, with jitter); then its last error is raised. An exception of `give_up_on` is
    raised at once."""
    deadline = clock() + seconds
    pause, tries = 0.1, 0
    while True:
        tries += 1
        try:
            result = step()
        except give_up_on:
            raise
        except Exception as exc:
            wait = pause * random.uniform(1 - JITTER, 1 + JITTER)  # noqa: S311  jitter, not a secret
            if clock() + wait > deadline:
                raise
            log.info("%s failed (%s); trying again in %.1f s", what, type(exc).__name__, wait)
            sleep(wait)
            pause = min(pause * 2, 2.0)
            continue
        if tries > 1:
            log.info("%s: done after %d tries", what, tries)
        return result


def with_retries(
    step: Callable[[], object],
    *,
    what: str,
    seconds: float = RETRY_SECONDS,
    give_up_on: tuple[type[BaseException], ...] = (),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """`until_done` for a caller already handling a failure that matters more: whether it
    succeeded, never an Exception raised."""
    try:
        until_done(step, what=what, seconds=seconds, give_up_on=give_up_on, sleep=sleep, clock=clock)
        return True
    except give_up_on:
        log.warning("%s: given up", what, exc_info=True)
        return False
    except Exception:
        log.warning("%s: still failing after %.0f s; a row lease runs out instead", what, seconds, exc_info=True)
        return False
