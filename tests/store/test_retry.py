"""`include.store.retry`: a short store write waits out a brief outage, within a bound, and a
deposed leader's write is never retried (fake clock: the backoff is not slept)."""

from __future__ import annotations

import pytest

from include.store.finalize import StaleEpoch
from include.store.retry import JITTER, until_done, with_retries


class Outage:
    """A step that fails `failures` times (as a restarting database would), then returns `result`."""

    def __init__(self, failures: int, result: object = "landed", error: BaseException | None = None) -> None:
        self.failures, self.result, self.calls = failures, result, 0
        self.error = error or ConnectionError("server closed the connection unexpectedly")
        self.now = 0.0
        self.pauses: list[float] = []

    def __call__(self) -> object:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.result

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


def test_until_done_returns_the_result_once_the_outage_is_over_with_a_doubling_jittered_backoff() -> None:
    step = Outage(failures=3)
    assert until_done(step, what="finalize", sleep=step.sleep, clock=step.clock) == "landed"
    assert step.calls == 4
    for pause, step_seconds in zip(step.pauses, [0.1, 0.2, 0.4], strict=True):
        assert step_seconds * (1 - JITTER) <= pause <= step_seconds * (1 + JITTER)


def test_writers_that_failed_together_do_not_retry_in_step() -> None:
    """Jitter: ten writers that met the same busy SQLite file come back at ten different moments."""
    outages = [Outage(failures=1) for _ in range(10)]
    for step in outages:
        until_done(step, what="claim", sleep=step.sleep, clock=step.clock)
    assert len({step.pauses[0] for step in outages}) == 10


def test_until_done_raises_the_last_error_when_the_outage_outlasts_its_bound() -> None:
    step = Outage(failures=1_000)
    with pytest.raises(ConnectionError):
        until_done(step, what="finalize", seconds=10.0, sleep=step.sleep, clock=step.clock)
    assert step.now <= 10.0 and step.calls > 3
    assert 2.0 * (1 - JITTER) <= max(step.pauses) <= 2.0 * (1 + JITTER)


def test_a_stale_epoch_is_raised_at_once_and_never_retried() -> None:
    step = Outage(failures=1, error=StaleEpoch("epoch 3 is no longer current"))
    with pytest.raises(StaleEpoch):
        until_done(step, what="finalize", give_up_on=(StaleEpoch,), sleep=step.sleep, clock=step.clock)
    assert step.calls == 1 and step.pauses == []


def test_with_retries_reports_instead_of_raising() -> None:
    gone = Outage(failures=1_000)
    assert with_retries(gone, what="hand back", seconds=3.0, sleep=gone.sleep, clock=gone.clock) is False
    back = Outage(failures=2)
    assert with_retries(back, what="hand back", sleep=back.sleep, clock=back.clock) is True
    stale = Outage(failures=1, error=StaleEpoch("deposed"))
    assert (
        with_retries(stale, what="hand back", give_up_on=(StaleEpoch,), sleep=stale.sleep, clock=stale.clock) is False
    )
    assert stale.calls == 1
