"""How many rows a stage's next micro-batch may claim: capped by time as well as by rows.

On SQLite the write lock is everyone's: while a claim or a finalize holds it, listenerd's group
commits, the lease renewal and every other stage wait (invariant 13). A fixed row cap cannot bound
that wait — the same rows take milliseconds on a quiet file and seconds on a busy one
(docs/performance.md) — so each
stage keeps a `BatchSize`: after every batch it is told how many rows the batch claimed and how long
the batch's longest write transaction held the store (`Store.longest_write`, which also counts a
Spark JDBC landing write on SQLite, held by another process), and it scales the next
claim so that transaction would take about `target_seconds`. It grows back gently (×1.5 a batch)
when batches run well inside the target. At steady traffic the batches are small and the cap is
never reached; it matters after a pause, a failover or a hand-over between runs, when a backlog
would otherwise be claimed, landed and finalized in one long transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WRITE_HOLD_TARGET_SECONDS = {"sqlite": 0.1, "postgres": 1.0, "sqlserver": 1.0}
"""The longest a stage's write transaction should take. SQLite's lock stops every writer; a server
database's claim and finalize lock only their own rows, so there the cap only keeps transactions,
and the work a failure throws away, short."""
LEAST_ROWS = 1_000
"""Never smaller than this: a backlog must still drain faster than the rated rate fills it, even when
a fixed cost (an fsync, a WAL checkpoint) makes every commit look slow — a batch a second of 1,000
rows is five times the rated 200 msg/s. It is also where a stage's small-batch path ends
(`spark_jobs.stage_job.SMALL_BATCH_ROWS`), whose writes this process times itself."""
GROWTH = 1.5


@dataclass
class BatchSize:
    """The next claim's row limit (module docstring).

    :param most: the stage's own row cap (the limit when nothing is slow).
    :param target_seconds: the write-transaction time to aim at.
    """

    most: int
    target_seconds: float
    least: int = LEAST_ROWS
    limit: int = field(init=False)

    def __post_init__(self) -> None:
        self.least = min(self.least, self.most)
        self.limit = self.most

    @classmethod
    def for_backend(cls, backend: str, *, most: int) -> BatchSize:
        return cls(most=most, target_seconds=WRITE_HOLD_TARGET_SECONDS.get(backend, 1.0))

    def observe(self, *, rows: int, held_seconds: float) -> int:
        """Fold in one batch (`rows` claimed, longest write transaction `held_seconds`); the new limit."""
        if rows <= 0:
            return self.limit
        if held_seconds > self.target_seconds:
            fitted = int(rows * self.target_seconds / held_seconds)
            self.limit = max(self.least, min(self.limit, fitted))
        elif rows >= self.limit // 2 and held_seconds < self.target_seconds / GROWTH:
            self.limit = min(self.most, int(self.limit * GROWTH) + 1)
        return self.limit
