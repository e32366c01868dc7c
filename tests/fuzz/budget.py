"""The fuzz set's budget: derandomized (the same examples on every run and machine, so a failure
reproduces and the suite's time is known), no example database, no per-example deadline (timings
are asserted on purpose-built worst cases instead), and a small example count per property."""

from __future__ import annotations

import time
from collections.abc import Callable

from hypothesis import HealthCheck, settings

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
FEW = settings(FUZZ, max_examples=40)

#: A worst-case input of this size must be handled in under WORST_SECONDS.
WORST_BYTES = 100 * 1024
WORST_SECONDS = 0.5


def seconds(fn: Callable[[], object]) -> float:
    """Wall time of one call (best of two: a single GC pause or a busy CI neighbour is not the code)."""
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def linear(
    fn: Callable[[int], object], *, small: int = WORST_BYTES // 8, large: int = WORST_BYTES, slack: float = 3.0
) -> tuple[float, float]:
    """Time `fn(size)` at two sizes; the large one must cost at most `slack` times its share of
    the small one (8x the input, not 64x the time). Returns (small, large) seconds."""
    t_small = max(seconds(lambda: fn(small)), 1e-4)
    t_large = seconds(lambda: fn(large))
    assert t_large <= slack * (large / small) * t_small + 0.02, (
        f"{large} bytes took {t_large:.4f} s, {small} bytes {t_small:.4f} s: not linear"
    )
    return t_small, t_large
