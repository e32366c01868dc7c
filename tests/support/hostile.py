"""Hostile and broken peers, and the honest sender measured beside them (tests and `bench/ingest.py --hostile`).

Each hostile peer is a thread that keeps its pressure on until `stop()`; it connects from its own
loopback address (127.0.0.N, N ≥ 2: Linux routes all of 127/8 to lo) so per-peer limits can tell
it from the honest sender on 127.0.0.1, as they would tell partners apart on a real network.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

VT, FS_CR = b"\x0b", b"\x1c\r"


def adt(control_id: str, patient: str = "P1") -> bytes:
    return (
        f"MSH|^~\\&|HONEST|FAC|STAGELINE|HOSP|20260101120000||ADT^A01|{control_id}|P|2.5\rPID|1||{patient}||DOE^JANE\r"
    ).encode()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


class Peer(threading.Thread):
    """A hostile peer: `attack(sock_factory)` runs again and again until stopped."""

    def __init__(self, name: str, host: str, port: int, *, source: str, action: Callable[[Peer], None]) -> None:
        super().__init__(name=f"hostile-{name}", daemon=True)
        self.host, self.port, self.source, self.action = host, port, source, action
        self.halt = threading.Event()
        self.sockets: list[socket.socket] = []
        self.connects = 0

    def connect(self, timeout: float = 2.0) -> socket.socket | None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout, source_address=(self.source, 0))
        except OSError:
            return None
        self.connects += 1
        return sock

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.action(self)
            except OSError:
                self.halt.wait(0.05)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        for sock in self.sockets:
            try:
                sock.close()
            except OSError:
                pass
        self.sockets.clear()


def _hold(peer: Peer, count: int, first_bytes: bytes) -> None:
    """Keep `count` connections open, each having sent `first_bytes` and then nothing more."""
    alive = []
    for sock in peer.sockets:
        try:
            sock.setblocking(False)
            if sock.recv(1) == b"":
                sock.close()
                continue
        except BlockingIOError:
            pass
        except OSError:
            sock.close()
            continue
        alive.append(sock)
    peer.sockets = alive
    while len(peer.sockets) < count and not peer.halt.is_set():
        sock = peer.connect()
        if sock is None:
            break
        if first_bytes:
            sock.sendall(first_bytes)
        peer.sockets.append(sock)
    peer.halt.wait(0.1)


def half_open(count: int) -> Callable[[Peer], None]:
    """Connections that send the start of an MLLP frame and hold still."""
    return lambda peer: _hold(peer, count, VT + b"MSH|^~\\&|SLOW|")


def silent(count: int) -> Callable[[Peer], None]:
    """Connections that send nothing (a TLS client that never starts its handshake)."""
    return lambda peer: _hold(peer, count, b"")


def slow_http_headers(count: int) -> Callable[[Peer], None]:
    """HTTP requests whose headers never finish."""
    return lambda peer: _hold(peer, count, b"POST /messages/web HTTP/1.1\r\nHost: x\r\nX-Slow: ")


def trickle(count: int, interval: float = 0.2) -> Callable[[Peer], None]:
    """Connections each sending a real message one byte every `interval` seconds."""

    def action(peer: Peer) -> None:
        while len(peer.sockets) < count:
            sock = peer.connect()
            if sock is None:
                break
            peer.sockets.append(sock)
        frame = VT + adt("TRICKLE") + FS_CR
        for i in range(len(frame)):
            if peer.halt.is_set():
                return
            for sock in list(peer.sockets):
                try:
                    sock.sendall(frame[i : i + 1])
                except OSError:
                    peer.sockets.remove(sock)
            peer.halt.wait(interval)

    return action


def endless(chunk: int = 65536) -> Callable[[Peer], None]:
    """One connection streaming a frame that never ends, as fast as the listener reads."""

    def action(peer: Peer) -> None:
        sock = peer.connect()
        if sock is None:
            return
        peer.sockets.append(sock)
        sock.sendall(VT)
        data = b"X" * chunk
        while not peer.halt.is_set():
            sock.sendall(data)

    return action


def churn(payload: bytes = b"") -> Callable[[Peer], None]:
    """Connect, maybe send a little, close: as fast as possible."""

    def action(peer: Peer) -> None:
        sock = peer.connect(timeout=1.0)
        if sock is not None:
            if payload:
                try:
                    sock.sendall(payload)
                except OSError:
                    pass
            sock.close()

    return action


def bad_frames(max_bytes: int) -> Callable[[Peer], None]:
    """One connection alternating oversize frames and frames that are not HL7, reading its answers."""

    def action(peer: Peer) -> None:
        sock = peer.connect(timeout=5.0)
        if sock is None:
            return
        peer.sockets.append(sock)
        n = 0
        while not peer.halt.is_set():
            n += 1
            body = adt(f"BIG{n}") + b"NTE|1||" + b"x" * (max_bytes + 100) + b"\r" if n % 2 else b"not hl7 at all"
            sock.sendall(VT + body + FS_CR)
            _read_frame(sock)

    return action


def _read_frame(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(FS_CR):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


@dataclass
class Honest:
    """What the honest sender saw: per message its answer and latency (connect → answer)."""

    sent: list[str] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def p99(self) -> float:
        return percentile(self.latencies, 0.99)

    @property
    def accepted(self) -> int:
        return sum(1 for code in self.answers.values() if code in ("AA", "200", "202"))

    def summary(self) -> str:
        lat = self.latencies
        return (
            f"{self.accepted}/{len(self.sent)} accepted, p50 {statistics.median(lat) if lat else float('nan'):.3f} s, "
            f"p99 {self.p99:.3f} s; failures {self.failures[:3]}"
        )


def send_honest(transport: Callable[[str], str], count: int, *, interval: float, prefix: str) -> Honest:
    """Send `count` messages, one connection each, `interval` seconds apart; `transport(control_id)`
    returns the answer code (AA/AE/AR for MLLP, the HTTP status for HTTP)."""
    result = Honest()
    t0 = time.monotonic()
    for i in range(count):
        delay = t0 + i * interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        control_id = f"{prefix}{i:05d}"
        result.sent.append(control_id)
        started = time.monotonic()
        try:
            result.answers[control_id] = transport(control_id)
            result.latencies.append(time.monotonic() - started)
        except OSError as exc:
            result.failures.append(f"{control_id}: {type(exc).__name__}: {exc}")
    return result


def mllp_once(
    host: str, port: int, *, context: ssl.SSLContext | None = None, timeout: float = 5.0
) -> Callable[[str], str]:
    """An honest MLLP transport: connect (TLS if `context`), send one ADT, read the ACK's MSA-1."""

    def send(control_id: str) -> str:
        with socket.create_connection((host, port), timeout=timeout, source_address=("127.0.0.1", 0)) as raw:
            sock = context.wrap_socket(raw, server_hostname="localhost") if context else raw
            sock.sendall(VT + adt(control_id) + FS_CR)
            ack = _read_frame(sock).decode(errors="replace")
        for segment in ack.strip("\x0b\x1c\r").split("\r"):
            if segment.startswith("MSA|"):
                return segment.split("|")[1]
        return "?"

    return send


def http_once(host: str, port: int, path: str, *, timeout: float = 5.0) -> Callable[[str], str]:
    """An honest HTTP transport: one POST (or GET when path starts with 'GET ') per connection."""

    def send(control_id: str) -> str:
        conn = http.client.HTTPConnection(host, port, timeout=timeout, source_address=("127.0.0.1", 0))
        try:
            if path.startswith("GET "):
                conn.request("GET", path[4:])
            else:
                conn.request("POST", path, body=adt(control_id), headers={"Content-Type": "application/hl7-v2"})
            return str(conn.getresponse().status)
        finally:
            conn.close()

    return send


ATTACKS: dict[str, tuple[Callable[[int], Callable[[Peer], None]], int]] = {
    # name: (action factory, sources); each source a loopback address of its own
    "half-open": (lambda max_bytes: half_open(10), 8),
    "trickle": (lambda max_bytes: trickle(8), 2),
    "endless": (lambda max_bytes: endless(), 1),
    "churn": (lambda max_bytes: churn(), 2),
    "flood": (lambda max_bytes: churn(VT + b"MSH|garbage"), 8),
    "bad-frames": (lambda max_bytes: bad_frames(max_bytes), 2),
}


def main() -> None:
    """Run hostile peers against host:port until SIGTERM (`bench/ingest.py --hostile` runs this
    in a process of its own, so the attackers do not slow the honest client down)."""
    import argparse
    import signal

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--max-message-bytes", type=int, default=65536)
    args = ap.parse_args()
    running: list[Peer] = []
    n = 2
    for name in args.attacks.split(","):
        factory, sources = ATTACKS[name]
        for _ in range(sources):
            running.append(
                Peer(name, "127.0.0.1", args.port, source=f"127.0.0.{n}", action=factory(args.max_message_bytes))
            )
            n += 1
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    for peer in running:
        peer.start()
    print("ready", flush=True)
    done.wait()
    for peer in running:
        peer.stop()
    print(f"connections {sum(p.connects for p in running)}", flush=True)


if __name__ == "__main__":
    main()
