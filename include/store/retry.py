"""Retry a short store write through a brief outage (a database restart, a failover of its VIP).

Only for writes that hand work back after a failure: if they are given up, the rows they would
free stay claimed — holding their lanes — until a row lease runs out. Nothing else in the store
retries; callers see every failure.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

RETRY_SECONDS = 15.0
"""Longer than a database restart takes; shorter than a row lease is renewed for."""


def with_retries(step: Callable[[], object], *, what: str, seconds: float = RETRY_SECONDS,
                 give_up_on: tuple[type[BaseException], ...] = (),
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> bool:
    """Run `step` until it succeeds or `seconds` have passed (backoff 0.1 s doubling to 2 s).

    Returns whether it succeeded; never raises an Exception (the caller is already handling a
    failure that matters more). An exception of `give_up_on` ends the retries at once.
    """
    deadline = clock() + seconds
    pause, tries = 0.1, 0
    while True:
        tries += 1
        try:
            step()
            if tries > 1:
                log.info("%s: done after %d tries", what, tries)
            return True
        except give_up_on:
            log.warning("%s: given up", what, exc_info=True)
            return False
        except Exception as exc:  # noqa: BLE001
            if clock() + pause > deadline:
                log.warning("%s: failed %d times over %.0f s; a row lease runs out instead", what, tries, seconds,
                            exc_info=True)
                return False
            log.info("%s failed (%s); trying again in %.1f s", what, type(exc).__name__, pause)
            sleep(pause)
            pause = min(pause * 2, 2.0)
