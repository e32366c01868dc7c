"""An MLLP receiver that records every delivery, duplicates included, for failover measurements.

The demo receiver (`include/app/demo.py`) de-duplicates on MSH-10 as an EHR would, which hides exactly
what a failover benchmark must count. This one appends one JSON line per delivered message —
`{"t": <host wall clock>, "control_id": MSH-10, "lane": PID-3.1}` — flushes it, and only then
answers `AA` (MSA-2 = MSH-10), so a recorded line is a delivery the pipeline saw acknowledged.

    python -m include.app.lab.recorder --port 2576 --out deliveries.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path

import hl7
from hl7.mllp import InvalidBlockError, start_hl7_server


def _field(message: hl7.Message, segment: str, field: int) -> str:
    try:
        return str(message.segment(segment)[field]).strip()
    except (KeyError, IndexError):
        return ""


def lane_of(message: hl7.Message) -> str:
    """PID-3.1 (the lane key the lab's destination uses)."""
    return _field(message, "PID", 3).split("^", 1)[0]


async def serve(host: str, port: int, out: Path) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sink = open(out, "a", encoding="utf-8")

    async def handle(reader, writer) -> None:
        try:
            while not writer.is_closing():
                block = await reader.readblock()
                message = hl7.parse(block.decode("utf-8", errors="replace"))
                record = {"t": time.time(), "control_id": _field(message, "MSH", 10), "lane": lane_of(message)}
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                writer.writemessage(message.create_ack("AA"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, InvalidBlockError, ValueError):
            pass  # the sender closed (or a readiness probe connected and left), or sent garbage
        finally:
            writer.close()

    server = await start_hl7_server(handle, host, port, encoding="utf-8", encoding_errors="replace")
    try:
        async with server:
            await stop.wait()
    finally:
        sink.close()


def read(path: Path) -> list[dict]:
    """The recorded deliveries, in arrival order."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written right now
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    asyncio.run(serve(args.host, args.port, args.out))


if __name__ == "__main__":
    main()
