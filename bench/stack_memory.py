"""What the embedded single-node stack costs in memory once it has moved messages.

Starts the README's stack (`stageline up`: SQLite store, Spark Connect, Airflow scheduler /
dag-processor / api-server / triggerer, the demo receiver, listenerd) in a temporary var dir, sends
`--count` demo messages of each kind and waits until every one is delivered (so Spark has run each
stage's job and Airflow has run task processes), lets it settle for `--settle` seconds, then sums the
proportional set size (PSS, `/proc/<pid>/smaps_rollup`) over the whole process tree of `stageline up`
and prints it per component. With `--idle`, it then waits that long without traffic, measures
again, and sends one more message of each kind. For each send it prints how long the last message
took from being staged to being delivered (on the store's clock): the first delivery after start,
and the first after the idle wait. The figures docs/performance.md states; the target is ≤ 1 GiB.

    uv run python bench/stack_memory.py [--count 4] [--settle 20] [--samples 5] [--idle 150]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stack import STAGELINE, EmbeddedStack  # noqa: E402
from include.app import demo  # noqa: E402
from include.app.embedded import AIRFLOW_PORT, SPARK_CONNECT_PORT  # noqa: E402
from include.app.lab.postgres_server import wait_for  # noqa: E402
from include.app.supervisor import port_open  # noqa: E402
from tests.support.memory import summary, tree_memory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4, help="demo messages of each kind (ADT, ORU, ORM)")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after the last delivery before measuring")
    parser.add_argument("--samples", type=int, default=5, help="measurements, 2 s apart; the largest is reported")
    parser.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="then wait this long with no traffic (the stage "
        "tasks end after $STAGELINE_STAGE_LINGER_SECONDS, default 120) and measure again",
    )
    args = parser.parse_args()
    busy = [p for p in (AIRFLOW_PORT, SPARK_CONNECT_PORT, 2575, 8470, demo.RECEIVER_PORT) if port_open(p)]
    if busy:
        raise SystemExit(f"port(s) {busy} in use: another embedded stack is running")
    work = Path(tempfile.mkdtemp(prefix="stageline-mem-"))
    stack = EmbeddedStack(work, '[store]\npath = "var/stageline.db"\n')
    try:
        stack.start()
        print(f"stack up in {stack.up_seconds:.0f} s", flush=True)
        send(stack, args.count)
        db = stack.var / "stageline.db"
        seconds = delivered_within(db, 4 * args.count)
        print(f"first deliveries after start: {4 * args.count} done, the last {seconds:.1f} s after staging")
        print(f"settling {args.settle:.0f} s", flush=True)
        time.sleep(args.settle)
        measure(stack.pid, args.samples, "with its stage tasks running")
        if args.idle:
            print(f"\nidle for {args.idle:.0f} s ...", flush=True)
            time.sleep(args.idle)
            measure(stack.pid, args.samples, f"after {args.idle:.0f} s without traffic")
            send(stack, 1)
            seconds = delivered_within(db, 4 * args.count + 4)
            print(f"\nafter {args.idle:.0f} s idle: 4 deliveries, the last {seconds:.1f} s after staging")
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)


def send(stack: EmbeddedStack, count: int) -> None:
    """`stageline demo send --count COUNT` to the stack (every message ACKed, or the bench ends)."""
    sent = subprocess.run(
        [str(STAGELINE), "demo", "send", "--count", str(count)],
        cwd=ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sent.returncode == 0, sent.stdout + sent.stderr


def delivered_within(db: Path, deliveries: int) -> float:
    """Wait until `deliveries` rows of stage_outbound are done; the seconds from the newest inbound
    row's staging to the newest delivery's completion, both on the store's clock (ms columns)."""

    def query(sql: str) -> int:
        with sqlite3.connect(db) as conn:
            return conn.execute(sql).fetchone()[0] or 0

    wait_for(
        lambda: query("SELECT count(*) FROM stage_outbound WHERE status = 'done'") >= deliveries,
        timeout=600,
        interval=0.2,
        what=f"{deliveries} deliveries",
    )
    staged = query("SELECT max(created_at) FROM stage_inbound")
    return (query("SELECT max(updated_at) FROM stage_outbound WHERE status = 'done'") - staged) / 1000.0


def measure(pid: int, samples: int, when: str) -> None:
    """The largest of `samples` measurements, 2 s apart, printed per component."""
    best: list = []
    for _ in range(samples):
        procs = tree_memory(pid)
        if sum(p.pss_kib for p in procs) > sum(p.pss_kib for p in best):
            best = procs
        time.sleep(2)
    print(summary(best))
    print(
        f"\nembedded stack {when}: {len(best)} processes, {sum(p.pss_kib for p in best) / 1024:.0f} MiB PSS "
        f"on {os.cpu_count()} CPU(s), {_mem_total_gib():.1f} GiB RAM",
        flush=True,
    )


def _mem_total_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024 / 1024
    return 0.0


if __name__ == "__main__":
    main()
