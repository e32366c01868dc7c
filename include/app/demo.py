"""The demo: synthetic sample messages (no real patients) for `stageline demo send`, and a demo
MLLP receiver standing in for the EHR (`stageline demo receive`, started by `stageline up`).

The receiver is python-hl7's asyncio MLLP server. For every message it appends the message to
`<out>/received.hl7`, flushes it to disk, and only then answers an `AA` ACK whose MSA-2 is the
message's MSH-10 (python-hl7's `Message.create_ack()`). The file is meant to be read with `cat`
or `less`: one segment per line, a blank line after each message, in arrival order::

    MSH|^~\\&|DEMOADT|DEMOHOSP|EHR|MAIN|...|ADT^A01^ADT_A01|DEMO12345000A|P|2.5.1
    EVN|A01|...
    PID|1||DP0^^^DEMOHOSP^MR||TEST^PATIENT0||19800101|F
    PV1|1|IN|WARD1^101^A

    MSH|...

A message whose MSH-10 is already in the file (a re-delivery: delivery is at-least-once) is
ACKed again but not written twice, as HL7 receivers de-duplicate on MSH-10; the receiver's log
says so. `read_received()` parses the file back into messages.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hl7
from hl7.client import MLLPClient
from hl7.mllp import InvalidBlockError, start_hl7_server

from include.app import ROOT

PIPELINE_DIR = ROOT / "config"
"""The embedded stack's pipeline config (`$STAGELINE_PIPELINE_DIR` of its Airflow)."""
RECEIVER_HOST = "127.0.0.1"
RECEIVER_PORT = 2576
RECEIVED_FILE = "received.hl7"

TEMPLATES = {
    "ADT^A01": (
        "MSH|^~\\&|DEMOADT|DEMOHOSP|STAGELINE|HOSP|{ts}||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
        "EVN|A01|{ts}\rPID|1||{pid}^^^DEMOHOSP^MR||TEST^PATIENT{n}||19800101|F\r"
        "PV1|1|I|WARD1^101^A\r"
    ),
    "ORU^R01": (
        "MSH|^~\\&|DEMOLAB|DEMOHOSP|STAGELINE|HOSP|{ts}||ORU^R01^ORU_R01|{cid}|P|2.5.1\r"
        "PID|1||{pid}^^^DEMOHOSP^MR||TEST^PATIENT{n}\rOBR|1|ORD{n}||2345-7^Glucose^LN\r"
        "OBX|1|NM|2345-7^Glucose^LN||{value}|mg/dL|70-99|N|||F\r"
    ),
    "ORM^O01": (
        "MSH|^~\\&|DEMOCPOE|DEMOHOSP|STAGELINE|HOSP|{ts}||ORM^O01|{cid}|P|2.3\r"
        "PID|1||{pid}^^^DEMOHOSP^MR||TEST^PATIENT{n}\rORC|NW|ORD{n}\rOBR|1|ORD{n}||71020^CHEST XRAY^CPT\r"
    ),
}


def send_samples(host: str, port: int, *, count: int) -> Iterator[tuple[str, str, str]]:
    """Yield (control id, message type, ACK code) for every message sent."""
    ts = time.strftime("%Y%m%d%H%M%S", time.gmtime())
    with MLLPClient(host, port) as client:
        for n in range(count):
            for kind, template in TEMPLATES.items():
                cid = f"DEMO{int(time.time()) % 100000:05d}{n:03d}{kind[:1]}"
                message = template.format(ts=ts, cid=cid, pid=f"DP{n % 3}", n=n, value=80 + n)
                ack = hl7.parse(client.send_message(message).decode().strip("\x0b\x1c\r\n"))
                yield cid, kind, str(ack.segment("MSA")[1])


# --- where the embedded stack's deliveries land --------------------------------------------------


def delivery_locations(var: Path, pipeline_dir: Path | None = None) -> list[tuple[str, str]]:
    """(destination, where its messages land) for the embedded stack's destinations.

    Read from `config/destinations.toml` (so `$STAGELINE_VAR` must be the stack's var dir); an MLLP
    destination at the demo receiver's address lands in the receiver's file. Raises
    `include.stage_config.PipelineConfigError` when the config cannot be read.
    """
    from include import stage_config
    from include.destinations_config import FileDestination, MllpDestination

    where: list[tuple[str, str]] = []
    for name, dest in stage_config.load(pipeline_dir or PIPELINE_DIR).destinations.items():
        if isinstance(dest, MllpDestination) and (dest.host, dest.port) == (RECEIVER_HOST, RECEIVER_PORT):
            where.append((name, str(receiver_dir(var) / RECEIVED_FILE)))
        elif isinstance(dest, MllpDestination):
            where.append((name, f"MLLP {dest.host}:{dest.port}"))
        elif isinstance(dest, FileDestination):
            where.append((name, dest.directory.rstrip("/") + "/"))
        else:
            where.append((name, getattr(dest, "url", dest.kind)))
    return where


def receiver_dir(var: Path) -> Path:
    """Where `stageline up` has the demo receiver write (`$STAGELINE_VAR/out/ehr`)."""
    return var / "out" / "ehr"


# --- the demo MLLP receiver ----------------------------------------------------------------------

_SEGMENT_BREAK = re.compile(r"\r\n|\r|\n")


def read_received(path: Path) -> list[str]:
    """The messages in a receiver's `received.hl7`, in arrival order, segments joined by CR."""
    if not path.exists():
        return []
    blocks = re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
    return ["\r".join(block.strip("\n").split("\n")) + "\r" for block in blocks if block.strip()]


class ReceivedFile:
    """Appends each new message to `<out_dir>/received.hl7` (see the module docstring)."""

    def __init__(self, out_dir: Path, *, echo: Callable[[str], None] = print) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / RECEIVED_FILE
        self.echo = echo
        self.seen = {_control_id(hl7.parse(m)) for m in read_received(self.path)}
        self._file = open(self.path, "a", encoding="utf-8")

    def accept(self, text: str) -> hl7.Message:
        """Store `text` (unless its MSH-10 was stored before) and return its AA ACK."""
        message = hl7.parse(text)
        control_id = _control_id(message)
        if control_id in self.seen:
            self.echo(f"{control_id}: already received, ACKed again, not written twice")
        else:
            segments = [s for s in _SEGMENT_BREAK.split(text) if s.strip()]
            self._file.write("\n".join(segments) + "\n\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self.seen.add(control_id)
            self.echo(f"{control_id}: {_field(message, 'MSH', 9)} received, appended to {self.path}")
        return message.create_ack("AA")

    def close(self) -> None:
        self._file.close()


def _field(message: hl7.Message, segment: str, field: int) -> str:
    try:
        return str(message.segment(segment)[field])
    except (KeyError, IndexError):
        return ""


def _control_id(message: hl7.Message) -> str:
    return _field(message, "MSH", 10).strip()


async def serve_receiver(
    host: str, port: int, out_dir: Path, *, echo: Callable[[str], None] = print, stop: asyncio.Event | None = None
) -> None:
    """Run the demo receiver until `stop` is set (or SIGTERM / SIGINT when `stop` is None)."""
    received = ReceivedFile(out_dir, echo=echo)

    async def handle(reader, writer) -> None:
        try:
            while not writer.is_closing():
                block = await reader.readblock()
                text = block.decode("utf-8", errors="replace")
                try:
                    ack = received.accept(text)
                except Exception as exc:  # not HL7: nothing to ACK, drop the connection
                    echo(f"not an HL7 message ({type(exc).__name__}: {exc}); closing the connection")
                    break
                writer.writemessage(ack)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the sender closed the connection (or a readiness probe connected and left)
        except (InvalidBlockError, ValueError) as exc:
            echo(f"invalid MLLP framing ({exc}); closing the connection")
        finally:
            writer.close()

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    server = await start_hl7_server(handle, host, port, encoding="utf-8", encoding_errors="replace")
    bound = server.sockets[0].getsockname()[1]
    echo(f"demo receiver listening on {host}:{bound}, ACKing every message with AA, appending to {received.path}")
    try:
        async with server:
            await stop.wait()
    finally:
        received.close()
    echo("demo receiver stopped")


def run_receiver(host: str, port: int, out_dir: Path, *, echo: Callable[[str], None] = print) -> None:
    asyncio.run(serve_receiver(host, port, out_dir, echo=echo))


def main(argv: list[str] | None = None) -> int:
    """`python -m include.app.demo --host H --port P --out DIR`: the demo receiver alone, without the
    CLI's imports (the embedded stack runs it this way: a process it keeps for its whole life)."""
    import argparse

    parser = argparse.ArgumentParser(description="the demo MLLP receiver (`stageline demo receive`)")
    parser.add_argument("--host", default=RECEIVER_HOST)
    parser.add_argument("--port", type=int, default=RECEIVER_PORT)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        run_receiver(args.host, args.port, args.out)
    except OSError as exc:
        print(f"demo receiver on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
