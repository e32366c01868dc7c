"""Cost per row of staging one HL7 batch in one statement, at 1k, 10k and 40k messages (issue 23).

What the group commit spends per message must not grow with the batch (invariant 13): a batch of
40,000 is now committed in parts of 2,000 (`listeners.commitplan`), but each statement — and the
whole batch staged at once, as before — must stay linear. This stages batches of each size through
`rowlease.stage_inbound` (the writer's own call: rows, bodies, batch record, audit events) into a
fresh SQLite file (WAL, synchronous=FULL) and a throwaway PostgreSQL cluster (fsync and
synchronous_commit on), and prints µs per row (median of `--repeat`).

    .venv/bin/python bench/batch_commit.py [--sizes 1000,10000,40000] [--repeat 3] [--backend both]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from include.app.lab.postgres_server import PostgresServer
from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from include.store.migrate import migrate
from include.store.rowlease import stage_inbound


def batch_rows(n: int) -> list[dict]:
    """One batch of n small ADTs (~55 bytes each, as in the issue's 2.2 MB batch of 40,000)."""
    batch_id = uuid.uuid4().hex
    rows = [
        {
            "message_id": uuid.uuid4().hex,
            "control_id": f"C{k}",
            "connection": "mllp-in",
            "lane_key": None,
            "charset": "utf-8",
            "payload": f"MSH|^~\\&|A|B|C|D|20240101||ADT^A01|C{k}|P|2.5\r",
            "batch_id": batch_id,
            "batch_seq": k,
            "batch_size": n,
        }
        for k in range(1, n + 1)
    ]
    rows[0].update(batch_fhs=None, batch_bhs="B1", batch_declared=n)
    return rows


def seconds_to_stage(store: Store, epoch: int, n: int) -> float:
    rows = batch_rows(n)
    started = time.perf_counter()
    with store.single_statement() as tx:
        staged = stage_inbound(tx, rows, epoch=epoch, node_id="bench")
    took = time.perf_counter() - started
    assert staged is not None and len(staged) == n
    return took


def run(config: StoreConfig, sizes: list[int], repeat: int) -> dict[int, float]:
    store = Store(config)
    try:
        migrate(store, cluster_name="bench")
        epoch = acquire_permanent(store, node_id="bench")
        seconds_to_stage(store, epoch, 100)  # warm: connection, statement cache
        return {n: statistics.median(seconds_to_stage(store, epoch, n) for _ in range(repeat)) for n in sizes}
    finally:
        store.close()


def report(name: str, results: dict[int, float]) -> None:
    for n, s in results.items():
        print(f"{name:10} {n:>7,} rows  {s * 1000:9.1f} ms  {s / n * 1e6:7.1f} µs/row")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,40000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.backend in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            report("sqlite", run(StoreConfig(backend="sqlite", path=str(Path(tmp) / "bench.db")), sizes, args.repeat))
    if args.backend in ("postgres", "both"):
        with PostgresServer() as server:
            server.execute("CREATE DATABASE bench")
            config = StoreConfig(
                backend="postgres",
                server=server.host,
                port=server.port,
                database="bench",
                username=server.user,
                pool_size=2,
            )
            report("postgres", run(config, sizes, args.repeat))


if __name__ == "__main__":
    main()
