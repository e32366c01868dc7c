"""Claim+finish throughput on PostgreSQL: the store's fenced primitives vs a raw SKIP LOCKED loop.

Both run in this process, on a fresh copy of the same 100,000 staged rows, against a throwaway
PostgreSQL cluster (fsync and synchronous_commit on). The store's path does more per row on
purpose — the epoch fence, row leases and one audit event per finished row — so the figure to
watch is the ratio (target: >= 85%).

    uv run python bench/claim.py [--rows 100000] [--batch 1000] [--workers 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import psycopg

from include.app.lab.postgres_server import PostgresServer
from include.config import StoreConfig
from include.store import INBOUND, Store
from include.store import rowlease as rl
from include.store.lease import LeaderElector
from include.store.migrate import migrate

SEED = """WITH s AS (INSERT INTO stage_inbound (message_id, control_id, connection, lane_key)
                SELECT 'm' || g, 'c' || g, 'mllp-in', NULL FROM generate_series(1, %(n)s) g RETURNING id)
INSERT INTO inbound_bodies (id, payload) SELECT id, repeat('x', 400) FROM s"""
# No lanes: the raw loop knows none, and with lanes concurrent claimers would (rightly) wait for
# each other's held lanes — this compares the cost of the fenced, audited path, not lane scheduling.

RAW_CLAIM = """UPDATE stage_inbound SET status = 'in_flight', lease_owner = %(owner)s,
       lease_expires_at = now() + interval '60 seconds', attempts = attempts + 1, updated_at = now()
 WHERE id IN (SELECT id FROM stage_inbound WHERE status = 'pending' ORDER BY id LIMIT %(limit)s
              FOR UPDATE SKIP LOCKED)
RETURNING id"""
RAW_FINISH = "UPDATE stage_inbound SET status = 'done', lease_owner = NULL, updated_at = now() WHERE id = ANY(%(ids)s)"


def fresh_db(server: PostgresServer, name: str, rows: int) -> StoreConfig:
    server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    server.execute(f"CREATE DATABASE {name}")
    cfg = StoreConfig(
        backend="postgres", server=server.host, port=server.port, database=name, username=server.user, pool_size=8
    )
    store = Store(cfg)
    migrate(store, cluster_name="bench")
    store.close()
    with psycopg.connect(server.conninfo(name), autocommit=True) as conn:
        conn.execute(SEED, {"n": rows})
        conn.execute("VACUUM ANALYZE stage_inbound")
    return cfg


def run_store(cfg: StoreConfig, batch: int, workers: int) -> float:
    store = Store(cfg)
    elector = LeaderElector(store, node_id="bench", ttl_seconds=600, fence_timeout_seconds=300)
    epoch = elector.step().epoch

    def work(i: int) -> None:
        while True:
            with store.transaction() as tx:
                ids = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner=f"w{i}", epoch=epoch, limit=batch)]
            if not ids:
                return
            with store.transaction() as tx:
                rl.finish_batch(tx, INBOUND, ids, owner=f"w{i}", epoch=epoch)

    elapsed = _timed(work, workers)
    store.close()
    return elapsed


def run_raw(cfg: StoreConfig, batch: int, workers: int, server: PostgresServer) -> float:
    def work(i: int) -> None:
        with psycopg.connect(server.conninfo(cfg.database)) as conn:
            while True:
                with conn.transaction():
                    ids = [r[0] for r in conn.execute(RAW_CLAIM, {"owner": f"w{i}", "limit": batch}).fetchall()]
                if not ids:
                    return
                with conn.transaction():
                    conn.execute(RAW_FINISH, {"ids": ids})

    return _timed(work, workers)


def _timed(work, workers: int) -> float:
    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with PostgresServer() as server:
        results: dict[str, list[float]] = {"store": [], "raw": []}
        for _ in range(args.repeat):  # alternate so drift affects both alike
            cfg = fresh_db(server, "bench_store", args.rows)
            results["store"].append(args.rows / run_store(cfg, args.batch, args.workers))
            cfg = fresh_db(server, "bench_raw", args.rows)
            results["raw"].append(args.rows / run_raw(cfg, args.batch, args.workers, server))
        store_rate, raw_rate = statistics.median(results["store"]), statistics.median(results["raw"])
        print(
            f"claim+finish, PostgreSQL 15, {args.rows:,} rows, batch {args.batch}, {args.workers} worker(s), "
            f"median of {args.repeat}"
        )
        print(f"  {'path':<36}{'rows/s':>12}")
        print(f"  {'store (fenced, row lease, audit)':<36}{store_rate:>12,.0f}")
        print(f"  {'raw SKIP LOCKED loop':<36}{raw_rate:>12,.0f}")
        print(f"  store / raw = {store_rate / raw_rate:.0%} (target >= 85%)")


if __name__ == "__main__":
    main()
