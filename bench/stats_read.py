"""What reading each destination's health costs (include/store/stats.py), on a store filled like one
that has run for a day at its rated rate: about a million rows in the big tables, a day of finished
history (about 40,000 deliveries an hour) and a live backlog of 30,000 deliveries on top
(tests/store/plan_fill.py, the statement-plan test's fill), on PostgreSQL 15 (a throwaway cluster,
after VACUUM ANALYZE) and on SQLite.

Timed, each the median of `--repeat` runs: `stageline stages --by destination` (with the view's
chart) and `--by connection` (both windows: 5 min and the hour), the rows open now, and one
`/metrics` read of what finished in the last 15 s (a scrape interval's increment).

    uv run python bench/stats_read.py [--repeat 5] [--store postgres|sqlite|both]
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from include.app.lab.postgres_server import PostgresServer
from include.config import StoreConfig
from include.store import Store, stats
from include.store.migrate import migrate
from tests.store import plan_fill

CLUSTER = "bench-cluster"


def timed(what: Callable[[], object], repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        started = time.perf_counter()
        what()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs) * 1000


def measure(store: Store, repeat: int) -> dict[str, float]:
    now = stats.db_now_ms(store)
    return {
        "stages --by destination (+ chart)": timed(lambda: stats.health(store, by="destination", chart=True), repeat),
        "stages --by connection": timed(lambda: stats.health(store, by="connection"), repeat),
        "open rows now": timed(lambda: stats.open_rows(store), repeat),
        "/metrics increment (15 s)": timed(lambda: stats.flow(store, now - 15_000, now), repeat),
    }


def postgres(repeat: int) -> dict[str, float]:
    with PostgresServer() as server:
        server.execute("CREATE DATABASE bench_stats")
        config = StoreConfig(
            backend="postgres",
            server=server.host,
            port=server.port,
            database="bench_stats",
            username=server.user,
            allow_unsafe_durability=True,
        )
        store = Store(config)
        try:
            migrate(store, cluster_name=CLUSTER)
            with psycopg.connect(server.conninfo("bench_stats"), autocommit=True) as conn:
                with conn.transaction():
                    for statement in plan_fill.statements("postgres"):
                        conn.execute(statement)
                conn.execute("VACUUM ANALYZE")
            return measure(store, repeat)
        finally:
            store.close()


def sqlite(repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stageline.db"
        store = Store(StoreConfig(backend="sqlite", path=str(path)))
        try:
            migrate(store, cluster_name=CLUSTER)
            conn = sqlite3.connect(str(path), isolation_level=None)
            conn.execute("BEGIN")
            for statement in plan_fill.statements("sqlite"):
                conn.execute(statement)
            conn.execute("COMMIT")
            conn.close()
            return measure(store, repeat)
        finally:
            store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--store", choices=("postgres", "sqlite", "both"), default="both")
    args = ap.parse_args()
    results = {}
    if args.store in ("postgres", "both"):
        results["PostgreSQL 15"] = postgres(args.repeat)
    if args.store in ("sqlite", "both"):
        results["SQLite"] = sqlite(args.repeat)
    print(f"each destination's health on a day's store (~1 M rows, 30,000 deliveries queued), median of {args.repeat}")
    for store, figures in results.items():
        print(f"  {store}")
        for what, ms in figures.items():
            print(f"    {what:<36}{ms:>9.1f} ms")


if __name__ == "__main__":
    main()
