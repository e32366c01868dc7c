"""Where the store's part of a stage goes, statement by statement, beside what PostgreSQL needs at
the least for the same number of row changes (`bench/pipeline.py --statements`).

`StatementTimes` times each named query a transaction runs (`Tx.all`, `Tx.execute`,
`Tx.transition`: a transition's audit events are part of its statement) and counts the rows it
returned or changed. `bare_floor` measures, on the same server, the cheapest durable form of the
same kinds of change: a narrow row inserted into a table with only a primary key, the same with one
event row, and a status update — no lanes, no claim indexes, no fence. Their difference is the price
of what the staged tables do beyond durability (lane order, claims, audit lookups).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from include.store import db


class StatementTimes:
    """Seconds, calls and rows per named query while `recording()` is open (this process only)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.rows: dict[str, int] = defaultdict(int)

    @contextmanager
    def recording(self) -> Iterator[StatementTimes]:
        originals = {m: getattr(db.Tx, m) for m in ("all", "execute", "transition")}
        inside = [False]

        def timed(method: Any) -> Any:
            def run(tx: db.Tx, name: str, *args: Any, **kwargs: Any) -> Any:
                if inside[0]:  # a transition's own statements count as the transition
                    return method(tx, name, *args, **kwargs)
                inside[0] = True
                started = time.perf_counter()
                try:
                    result = method(tx, name, *args, **kwargs)
                finally:
                    self.seconds[name] += time.perf_counter() - started
                    self.calls[name] += 1
                    inside[0] = False
                self.rows[name] += max(result, 0) if isinstance(result, int) else len(result)  # rowcount -1: unknown
                return result

            return run

        for name, method in originals.items():
            setattr(db.Tx, name, timed(method))
        try:
            yield self
        finally:
            for name, method in originals.items():
                setattr(db.Tx, name, method)

    def lines(self, *, top: int = 12, during: str = "route + transform") -> list[str]:
        total = sum(self.seconds.values())
        out = [
            f"store statements during {during}: {total:.2f} s in all",
            f"  {'statement':<30}{'calls':>6}{'rows':>10}{'s':>8}{'us/row':>8}",
        ]
        for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:top]:
            rows = self.rows[name]
            per = f"{s / rows * 1e6:.1f}" if rows else "-"
            out.append(f"  {name:<30}{self.calls[name]:>6}{rows:>10,}{s:>8.2f}{per:>8}")
        return out


def bare_floor(conninfo: str, rows: int, *, runs: int = 3) -> list[str]:
    """The cheapest durable row changes on the server at `conninfo` (logged tables, fsync as
    configured), `rows` at a time in one transaction each, median of `runs`: µs per row."""
    import psycopg

    insert = (
        "INSERT INTO floor_rows (source_id, destination, status) "
        f"SELECT g, 'd' || (g % 3), 'pending' FROM generate_series(1, {int(rows)}) g"
    )
    steps = [  # (kind, statement, empty the tables first); the update changes the rows inserted before it
        ("insert (primary key only)", insert, True),
        (
            "insert + one event row",
            f"WITH ins AS ({insert} RETURNING id) "
            "INSERT INTO floor_events (row_id, event) SELECT id, 'routed' FROM ins",
            True,
        ),
        (
            "status update + one event row",
            "WITH up AS (UPDATE floor_rows SET status = 'done' RETURNING id) "
            "INSERT INTO floor_events (row_id, event) SELECT id, 'finished' FROM up",
            False,
        ),
    ]
    times: dict[str, list[float]] = {kind: [] for kind, _, _ in steps}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE floor_rows (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "source_id bigint NOT NULL, destination text NOT NULL, status text NOT NULL)"
        )
        conn.execute(
            "CREATE TABLE floor_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "row_id bigint, event text, at timestamptz NOT NULL DEFAULT now())"
        )
        try:
            for _ in range(runs):
                for kind, sql, empty_first in steps:
                    if empty_first:
                        conn.execute("TRUNCATE floor_rows, floor_events")
                    conn.execute("CHECKPOINT")
                    started = time.perf_counter()
                    with conn.transaction():
                        conn.execute(sql)
                    times[kind].append(time.perf_counter() - started)
        finally:
            conn.execute("DROP TABLE floor_rows, floor_events")
    out = [f"the same server's floor ({rows:,} rows a transaction, no lane or claim indexes, no fence):"]
    for kind, measured in times.items():
        out.append(f"  {kind:<32}{statistics.median(measured) / rows * 1e6:>6.2f} us/row")
    return out
