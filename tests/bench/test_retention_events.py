"""bench/retention_events.py at a tiny size: every old event archived once and gone from the hot table."""

from __future__ import annotations

from bench.retention_events import run


def test_the_retention_bench_archives_and_deletes_every_event():
    took, left = run(12_000)  # more than two of retention's 5,000-row batches
    assert left == {"hot": 0, "archived": 12_000}
    assert took > 0
