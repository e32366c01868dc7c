"""Inbound → delivered latency under the real Airflow scheduler, at a steady rate.

Starts the README's stack (`stageline up`: SQLite store, Spark Connect, Airflow scheduler /
dag-processor / api-server / triggerer, listenerd, the demo MLLP receiver) in a temporary var dir,
warms it with a few messages, then sends `bench/hl7_corpus.py` messages over MLLP at `--rate`
messages/s for `--seconds` (python-hl7's client on `--connections` connections, each paced at its
share of the rate, each message ACKed before that connection's next). Routes and destinations are
`config/`: ADT to the demo EHR receiver (MLLP, lane per patient) and the file archive, ORU/ORM to
the archive.

Latency per delivery, on the database clock: `stage_inbound.created_at` (the commit before the
ACK) → `stage_outbound.updated_at` of its `done` row. Also per stage: → routed, → transformed.

Two single-message figures a user meets first: the first message sent the moment the stack says it
is up, and one sent after `--idle` seconds of silence (stage tasks have gone idle by then), each
timed from the send to its last delivery.

`--store postgres` runs the same stack on a throwaway PostgreSQL server (initdb here, fsync on) as
its store; Airflow's metadata stays on SQLite.

    uv run python bench/latency.py [--rate 200] [--seconds 60] [--connections 4] [--idle 60] [--store sqlite|postgres]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hl7.client import MLLPClient  # noqa: E402

from bench.hl7_corpus import messages as corpus  # noqa: E402
from bench.stack_store import StackOnStore, percentile  # noqa: E402
from include.app.lab.postgres_server import wait_for  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0, help="messages per second")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--drain-timeout", type=float, default=600.0)
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--idle", type=float, default=60.0, help="silence before the last single message")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stageline-latency-"))
    on_store = StackOnStore(work, args.store)
    stack, query, ms, outstanding = on_store.stack, on_store.query, on_store.ms, on_store.outstanding

    try:
        on_store.start()
        print(f"stack up in {stack.up_seconds:.0f} s (logs: {stack.var / 'log'})", flush=True)

        def one_delivery(payload: bytes) -> float:
            """Seconds from sending one message to its last delivery (nothing else in flight)."""
            [[before]] = query("SELECT count(*) FROM stage_inbound")
            sent = time.perf_counter()
            with MLLPClient("127.0.0.1", 2575) as client:
                client.send_message(payload)
            wait_for(
                lambda: query("SELECT count(*) FROM stage_inbound")[0][0] > before and outstanding() == 0,
                timeout=args.drain_timeout,
                interval=0.05,
                what="one message to be delivered",
            )
            return time.perf_counter() - sent

        total = int(args.rate * args.seconds)
        payloads = corpus(total + 22, seed=7)
        singles = [payloads.pop(), payloads.pop()]
        first = one_delivery(singles[0])
        print(f"first message after the stack is up: delivered in {first:.1f} s", flush=True)
        [[staged]] = query("SELECT count(*) FROM stage_inbound")
        with MLLPClient("127.0.0.1", 2575) as client:
            for p in payloads[:20]:  # warm-up: every DAG runs its Spark job once
                client.send_message(p)
        wait_for(
            lambda: query("SELECT count(*) FROM stage_inbound")[0][0] == staged + 20 and outstanding() == 0,
            timeout=args.drain_timeout,
            interval=1,
            what="the warm-up messages to be delivered",
        )
        [[since]] = query("SELECT max(id) FROM stage_inbound")
        print(f"warm; sending {total:,} messages at {args.rate:.0f}/s", flush=True)

        t0 = time.perf_counter()

        def sender(k: int) -> None:
            mine = payloads[20:][k :: args.connections]
            rate = args.rate / args.connections
            with MLLPClient("127.0.0.1", 2575) as client:
                for i, p in enumerate(mine):
                    delay = t0 + i / rate - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    client.send_message(p)

        threads = [threading.Thread(target=sender, args=(k,)) for k in range(args.connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        send_s = time.perf_counter() - t0
        print(f"sent in {send_s:.1f} s ({total / send_s:.0f} msg/s achieved); draining", flush=True)
        wait_for(lambda: outstanding() == 0, timeout=args.drain_timeout, interval=1, what="the backlog to drain")
        drained_s = time.perf_counter() - t0

        rows = query(f"""SELECT o.destination, {ms("i.created_at")}, {ms("r.created_at")}, {ms("o.created_at")},
                                {ms("o.updated_at")}, o.status
                           FROM stage_outbound o JOIN stage_routed r ON r.source_id = o.source_id
                                                                   AND r.destination = o.destination
                                                 JOIN stage_inbound i ON i.id = o.source_id
                          WHERE i.id > {since}""")
        dead = [r for r in rows if r[5] != "done"]
        lat = [(r[4] - r[1]) / 1000 for r in rows if r[5] == "done"]
        to_routed = [(r[2] - r[1]) / 1000 for r in rows]
        to_outbound = [(r[3] - r[1]) / 1000 for r in rows]
        runs = query("SELECT count(*) FROM message_events WHERE event = 'routed'")
        print(
            f"\n{len(rows):,} deliveries of {total:,} messages ({len(dead)} not done); all delivered "
            f"{drained_s:.0f} s after the first send; {runs[0][0]:,} routed events"
        )
        print("| inbound committed → | p50 | p99 | max |\n|---|---|---|---|")
        for name, values in (("routed", to_routed), ("transformed (outbound row)", to_outbound), ("delivered", lat)):
            print(
                f"| {name} | {statistics.median(values):.1f} s | {percentile(values, 0.99):.1f} s | "
                f"{max(values):.1f} s |"
            )
        for dest in sorted({r[0] for r in rows}):
            d = [(r[4] - r[1]) / 1000 for r in rows if r[0] == dest and r[5] == "done"]
            print(
                f"  {dest}: delivered p50 {statistics.median(d):.1f} s, p99 {percentile(d, 0.99):.1f} s "
                f"({len(d):,} deliveries)"
            )
        time.sleep(args.idle)
        after_idle = one_delivery(singles[1])
        print(f"\nfirst message after the stack is up: {first:.1f} s; after {args.idle:.0f} s idle: {after_idle:.1f} s")
    finally:
        on_store.stop()


if __name__ == "__main__":
    main()
