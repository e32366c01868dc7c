"""A peer that never reads its answers cannot grow listenerd's memory (issue 23, red team network
item 1; docs/listenerd.md, "Answers a peer does not read").

One real `listenerd` (SQLite store) with an MLLP and a length-framed TCP listener, idle timeout 2 s.
A peer with a 4 KB receive buffer sends valid messages as fast as it can and reads nothing. Before
the fix every answer handed to the transport stayed in its write buffer (RSS +170 MB in 20 s);
now reading stops once 64 KB of answers are unsent and the peer is cut off after the idle timeout.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from tests.conftest import migrated_sqlite
from tests.support.watch import rss_mb

IDLE_TIMEOUT = 2.0
CUT_OFF_WITHIN = 12.0  # seconds from the first byte: time to fill the buffers, the idle timeout, margin
MAX_RSS_GROWTH_MB = 30.0


def message(cid: str) -> bytes:
    return (f"MSH|^~\\&|A|B|C|D|20260101||ADT^A01|{cid}|P|2.5\rPID|1||P1\r").encode()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict[str, int]]]:
    tmp = tmp_path_factory.mktemp("unread")
    config = migrated_sqlite(tmp / "stageline.db")
    ports = {"mllp": free_port(), "tcp": free_port()}
    common = {"idle_timeout_seconds": IDLE_TIMEOUT}
    d = Daemon(
        tmp / "node",
        config,
        node_id="solo:1:aa",
        inbound=[
            {"name": "plain", "kind": "mllp", "port": ports["mllp"], **common},
            {"name": "raw", "kind": "tcp", "port": ports["tcp"], "framing": "length", **common},
        ],
    ).start()
    try:
        for port in ports.values():
            wait_for(lambda: port_open(port), timeout=15, what="bind")
        yield d, ports
    finally:
        d.stop()


def flood_without_reading(
    port: int, chunk: Callable[[int], bytes], seconds: float, pid: int
) -> tuple[float | None, float]:
    """Send `chunk(i)` as fast as the server takes it, never reading; returns (seconds until the
    server cut the connection off, or None; the largest RSS growth seen, MB)."""
    base = rss_mb(pid)
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(pid))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.settimeout(0.5)
    start = time.monotonic()
    cut: float | None = None
    i = 0
    try:
        while time.monotonic() - start < seconds:
            try:
                s.sendall(chunk(i))
                i += 1
            except TimeoutError:  # the server stopped reading: keep pushing until it cuts us off
                continue
            except OSError:  # reset / broken pipe: cut off
                cut = time.monotonic() - start
                break
    finally:
        s.close()
        done.set()
        watcher.join()
    return cut, peak[0] - base


def test_mllp_peer_that_never_reads_is_bounded_and_cut_off(node: tuple[Daemon, dict[str, int]]) -> None:
    d, ports = node
    assert d.proc is not None
    # a 199-character control id (the longest kept): each AA echoes it, ~300 bytes an answer
    cid = "Y" * 190
    batch = [b"\x0b" + message(f"{cid}{i:09d}") + b"\x1c\r" for i in range(100)]
    cut, growth = flood_without_reading(ports["mllp"], lambda i: b"".join(batch), CUT_OFF_WITHIN + 5, d.proc.pid)
    assert cut is not None and cut <= CUT_OFF_WITHIN, f"not cut off within {CUT_OFF_WITHIN}s (cut={cut})"
    assert growth < MAX_RSS_GROWTH_MB, f"RSS grew {growth:.0f} MB"
    assert "has read none of its answers" in d.output()


def test_tcp_peer_that_never_reads_is_bounded_and_cut_off(node: tuple[Daemon, dict[str, int]]) -> None:
    d, ports = node
    assert d.proc is not None

    def chunk(i: int) -> bytes:
        return b"".join(struct.pack(">I", len(m)) + m for m in (message(f"TN{i}-{j}") for j in range(200)))

    cut, growth = flood_without_reading(ports["tcp"], chunk, CUT_OFF_WITHIN + 5, d.proc.pid)
    assert cut is not None and cut <= CUT_OFF_WITHIN, f"not cut off within {CUT_OFF_WITHIN}s (cut={cut})"
    assert growth < MAX_RSS_GROWTH_MB, f"RSS grew {growth:.0f} MB"


def test_honest_sender_still_answered_after_a_stalled_peer(node: tuple[Daemon, dict[str, int]]) -> None:
    """The listener still answers a sender that reads, at once."""
    _, ports = node
    with socket.create_connection(("127.0.0.1", ports["mllp"]), timeout=5) as s:
        s.sendall(b"\x0b" + message("HONEST1") + b"\x1c\r")
        buf = b""
        while b"\x1c\r" not in buf:
            buf += s.recv(4096)
    assert b"MSA|AA|HONEST1" in buf
