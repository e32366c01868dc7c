"""MLLP ingest: ACKed messages/s and ACK latency at 1, 4 and 16 connections on PostgreSQL
(fsync and synchronous_commit on), listenerd beside, in the same invocation:

  peer     python-hl7's asyncio MLLP server doing one INSERT+COMMIT per message before its ACK
  strong   the strong naive durable peer: the same, framing only (no parse), ACK from MSH-10
  ceiling  the same server framing and ACKing with no database at all

The client is python-hl7's asyncio client in raw block mode (pre-framed bytes, no parsing), one
message outstanding per connection. Every server runs in its own process; listenerd's peak RSS
is read from /proc.

`--hostile` also measures listenerd's honest throughput and ACK latency (4 connections from
127.0.0.1) alone and then beside hostile peers in a process of their own (`tests/support/hostile.py`:
80 half-open frames from 8 addresses, byte-at-a-time senders, an endless frame, connect loops, a
flood of short connections, oversize and malformed frames), on a listener with the default limits.

`--profile reject|flag` gives listenerd's connection the shipped ADT^A01 conformance profile (every
message sent conforms: the check's cost on good traffic, docs/performance.md).

    uv run python bench/ingest.py [--seconds 5] [--connections 1,4,16] [--hostile] [--profile reject]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from hl7.mllp import open_hl7_connection

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import PostgresServer, free_port, wait_for
from include.app.supervisor import port_open
from include.config import StoreConfig
from include.store import Store
from include.store.migrate import migrate
from listeners.connections_config import InboundConfig

ROOT = Path(__file__).resolve().parents[1]
ACK_TIMEOUT = 30.0
MESSAGE = (
    "MSH|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|20261122101500||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
    "EVN|A01|20261122101500\rPID|1||{pid}^^^HOSP^MR||DOE^JANE||19700101|F\rPV1|1|I|W1^101^A\r"
)


async def one_connection(port: int, prefix: str, deadline: float, latencies: list[float], window: int) -> int:
    """Keep `window` messages outstanding (1 = strict send-and-wait, as most MLLP senders do)."""
    reader, writer = await open_hl7_connection("127.0.0.1", port)
    sent: list[float] = []
    n = acked = 0
    try:
        while time.perf_counter() < deadline or acked < n:
            while len(sent) < window and time.perf_counter() < deadline:
                writer.writeblock(MESSAGE.format(cid=f"{prefix}-{n}", pid=n % 50).encode())
                sent.append(time.perf_counter())
                n += 1
            await writer.drain()
            ack = await asyncio.wait_for(reader.readblock(), ACK_TIMEOUT)  # a lost ACK fails the run
            latencies.append(time.perf_counter() - sent.pop(0))
            if b"MSA|AA|" not in ack:
                raise RuntimeError(f"not an AA: {ack[:200]!r}")
            acked += 1
    finally:
        writer.close()
    return acked


def drive(port: int, connections: int, seconds: float, tag: str, window: int = 1) -> dict:
    async def run() -> tuple[int, list[float], float]:
        latencies: list[float] = []
        start = time.perf_counter()
        counts = await asyncio.gather(
            *[
                one_connection(port, f"{tag}{connections}c{i}", start + seconds, latencies, window)
                for i in range(connections)
            ]
        )
        return sum(counts), latencies, time.perf_counter() - start

    total, latencies, elapsed = asyncio.run(run())
    latencies.sort()
    return {
        "rate": total / elapsed,
        "p50": latencies[len(latencies) // 2] * 1000,
        "p99": latencies[int(len(latencies) * 0.99)] * 1000,
        "n": total,
    }


def start_peer(mode: str, dsn: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench/peers/hl7_asyncio_server.py"),
            "--port",
            str(port),
            "--mode",
            mode,
            "--dsn",
            dsn,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc, port


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def beside_hostile_peers(port: int, seconds: float) -> dict:
    """Honest throughput alone, then with the hostile peers of `tests/support/hostile.py` running."""
    quiet = drive(port, 4, seconds, "Q")
    oversize = InboundConfig(name="x", kind="mllp").max_message_bytes  # the listener's (default) limit
    attackers = subprocess.Popen(
        [sys.executable, "-m", "tests.support.hostile", "--port", str(port), "--max-message-bytes", str(oversize)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert attackers.stdout.readline().strip() == "ready"
        time.sleep(2.0)  # the pressure builds: slots held, loops running
        loud = drive(port, 4, seconds, "X")
    finally:
        attackers.terminate()
        out, _ = attackers.communicate(timeout=30)
    return {"quiet": quiet, "loud": loud, "connections": out.strip().splitlines()[-1] if out.strip() else "?"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", default="1,4,16")
    ap.add_argument("--window", type=int, default=1, help="messages outstanding per connection")
    ap.add_argument("--hostile", action="store_true", help="also: honest throughput beside hostile peers")
    ap.add_argument(
        "--profile",
        choices=("reject", "flag"),
        help="listenerd's connection checks the shipped ADT profile (config/profiles/adt_a01.toml) this way",
    )
    args = ap.parse_args()
    profile = (
        {"profile": str(ROOT / "config" / "profiles" / "adt_a01.toml"), "on_violation": args.profile}
        if args.profile
        else {}
    )
    levels = [int(c) for c in args.connections.split(",")]
    results: dict[str, dict[int, dict]] = {"listenerd": {}, "peer": {}, "strong": {}, "ceiling": {}}
    with PostgresServer() as pg, tempfile.TemporaryDirectory() as tmp:
        pg.execute("CREATE DATABASE ingest")
        cfg = StoreConfig(
            backend="postgres", server=pg.host, port=pg.port, database="ingest", username=pg.user, pool_size=4
        )
        store = Store(cfg)
        migrate(store, cluster_name="test-cluster")
        store.close()
        port = free_port()
        daemon = Daemon(
            Path(tmp) / "node",
            cfg,
            node_id="bench:1:aa",
            inbound=[
                {"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": port, "max_connections": 64, **profile}
            ],
        ).start()
        try:
            wait_for(lambda: port_open(port), timeout=20, what="listenerd bind")
            drive(port, 4, 1.0, "warm")
            cpu0 = cpu_seconds(daemon.proc.pid)
            for c in levels:
                results["listenerd"][c] = drive(port, c, args.seconds, "L", args.window)
            cpu_per_msg = (cpu_seconds(daemon.proc.pid) - cpu0) / sum(r["n"] for r in results["listenerd"].values())
            rss = peak_rss_mb(daemon.proc.pid)
            if args.hostile:
                hostile = beside_hostile_peers(port, args.seconds)
                hostile["rss"] = peak_rss_mb(daemon.proc.pid)
        finally:
            daemon.stop()
        for mode, name in (("db", "peer"), ("strong", "strong"), ("ceiling", "ceiling")):
            proc, pport = start_peer(mode, pg.conninfo("ingest"))
            try:
                drive(pport, 4, 1.0, f"warm{mode}")
                for c in levels:
                    results[name][c] = drive(pport, c, args.seconds, name[0].upper(), args.window)
            finally:
                proc.terminate()
                proc.wait(10)
        with psycopg.connect(pg.conninfo("ingest")) as conn:
            staged = conn.execute("SELECT count(*) FROM stage_inbound WHERE connection = 'adt-in'").fetchone()[0]
    print(
        f"MLLP ingest, PostgreSQL 15 (fsync, synchronous_commit on), {args.seconds:.0f}s per level, "
        f"python-hl7 asyncio client in raw block mode, {args.window} message(s) outstanding per connection"
        + (f"; listenerd checks the ADT profile ({args.profile})" if args.profile else "")
    )
    print(f"  {'conns':>5}  {'server':<10}{'msg/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for c in levels:
        for name in ("listenerd", "peer", "strong", "ceiling"):
            r = results[name][c]
            print(f"  {c:>5}  {name:<10}{r['rate']:>9,.0f}{r['p50']:>9.2f}{r['p99']:>9.2f}")
        lr, pr, sr, cr = (results[n][c]["rate"] for n in ("listenerd", "peer", "strong", "ceiling"))
        print(f"         listenerd = {lr / pr:.2f}x peer, {lr / sr:.2f}x strong peer, {lr / cr:.0%} of ceiling")
    if args.hostile:
        quiet, loud = hostile["quiet"], hostile["loud"]
        print(
            f"\nHonest sender beside hostile peers ({hostile['connections']}), listenerd default limits, "
            f"4 connections from 127.0.0.1, {args.seconds:.0f}s each:"
        )
        print(f"  {'':<22}{'msg/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
        for name, r in (("alone", quiet), ("beside hostile peers", loud)):
            print(f"  {name:<22}{r['rate']:>9,.0f}{r['p50']:>9.2f}{r['p99']:>9.2f}")
        print(
            f"  honest throughput beside them: {loud['rate'] / quiet['rate']:.0%} of alone; "
            f"listenerd peak RSS {hostile['rss']:.0f} MB"
        )
    acked = sum(r["n"] for r in results["listenerd"].values())
    print(
        f"  listenerd CPU {cpu_per_msg * 1e6:.0f} us/msg; peak RSS {rss:.0f} MB; "
        f"{staged:,} rows staged for {acked:,} ACKed in the timed runs (+ warm-up)"
    )


if __name__ == "__main__":
    main()
