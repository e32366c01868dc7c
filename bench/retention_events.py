"""Retention of the audit trail alone: N audit events three days old on a throwaway PostgreSQL 15
(fsync on), then retention of the events (archive, then delete; include/housekeeping.py) run after
run until one finds nothing. Unlike `bench/growth.py --retention`, nothing becomes due while it runs,
so the figure is the copy-and-purge work alone (docs/performance.md "Growth").

    uv run python bench/retention_events.py [--events 1000000]
"""

from __future__ import annotations

import argparse
import time

import psycopg

from include.app.lab.postgres_server import PostgresServer
from include.config import StoreConfig
from include.housekeeping import retention
from include.store import Store
from include.store.lease import acquire_permanent
from include.store.migrate import migrate

DAY = 86_400.0


def run(events: int) -> tuple[float, dict[str, int]]:
    """Seconds retention took to archive and delete `events` old events, and the events then left in
    `message_events` and held by `archive_events` (`hot`, `archived`)."""
    server = PostgresServer().start()
    try:
        with psycopg.connect(server.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE stageline")
        store = Store(
            StoreConfig(
                backend="postgres", server=server.host, port=server.port, database="stageline", username=server.user
            )
        )
        migrate(store, cluster_name="bench")
        epoch = acquire_permanent(store, node_id="bench:1:aa")
        with psycopg.connect(server.conninfo("stageline"), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO message_events (at, stage, row_id, message_id, control_id, event, to_status)"
                " SELECT now() - interval '3 days' + g * interval '1 ms', 'inbound', g, 'm' || (g / 8),"
                " 'c' || (g / 8), 'received', 'pending' FROM generate_series(1, %s) AS g",
                (events,),
            )
            conn.execute("VACUUM ANALYZE message_events")
        started = time.perf_counter()
        while retention(store, epoch, {"events": DAY}).get("events"):
            pass
        took = time.perf_counter() - started
        with psycopg.connect(server.conninfo("stageline"), autocommit=True) as conn:
            left = {
                "hot": conn.execute("SELECT count(*) FROM message_events").fetchone()[0],
                "archived": conn.execute("SELECT count(*) FROM archive_events").fetchone()[0],
            }
        store.close()
        return took, left
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    took, _ = run(args.events)
    rate = args.events / took
    print(f"retention of {args.events:,} audit events (archive, then delete): {took:.1f} s = {rate:,.0f} events/s")


if __name__ == "__main__":
    main()
