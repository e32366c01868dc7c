"""A steady multi-lane HL7 stream that resends until `AA`, and the ledger that judges its delivery.

Lanes (patients) are split over connections so each lane has one sender and a defined order: a
connection sends its lanes round-robin, one message at a time, and resends a message that got
anything but `AA` (a NAK, a timeout, a dropped connection) with the *same* control id until it is
`AA`'d, then moves on. So a control id delivered twice is a duplicate, and a lane's sequence
numbers must arrive in order. Times are host wall clock (`time.time()`), the clock the recorder
(`include/app/lab/recorder.py`) stamps deliveries with.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

SB, EB, CR = b"\x0b", b"\x1c", b"\r"


def message(control_id: str, lane: str, seq: int) -> str:
    ts = time.strftime("%Y%m%d%H%M%S", time.gmtime())
    return (
        "\r".join(
            [
                f"MSH|^~\\&|LABSEND|LABHOSP|STAGELINE|HOSP|{ts}||ADT^A08^ADT_A01|{control_id}|P|2.5.1",
                f"EVN|A08|{ts}",
                f"PID|1||{lane}^^^LABHOSP^MR||TEST^PATIENT{lane}||19800101|F",
                f"PV1|1|I|WARD1^{seq % 100}^A",
            ]
        )
        + "\r"
    )


def parse_control_id(control_id: str) -> tuple[str, int]:
    """(lane, seq) of a control id made by `Stream` (`<prefix>-<lane>-<seq>`)."""
    _, lane, seq = control_id.rsplit("-", 2)
    return lane, int(seq)


@dataclass
class Sent:
    """One message's life at the sender."""

    control_id: str
    lane: str
    seq: int
    first_try: float
    attempts: int = 0
    acked_at: float | None = None
    naks: int = 0
    failures: list[str] = field(default_factory=list)
    """Why each attempt before the `AA` failed: `AE`/`AR`/…, or the exception (a drop, a timeout)."""


@dataclass
class Attempt:
    at: float  # send begun
    done: float  # answer (or failure) seen
    ok: bool  # answered AA for this control id
    conn: int


class _Link:
    """One MLLP connection: a frame out, one ACK back (python-hl7's client reads a single recv)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.buf = b""

    def send(self, text: str) -> str:
        self.sock.sendall(SB + text.encode() + EB + CR)
        while EB + CR not in self.buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed by peer")
            self.buf += chunk
        frame, self.buf = self.buf.split(EB + CR, 1)
        return frame.lstrip(SB).decode(errors="replace")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _msa(ack: str) -> tuple[str, str]:
    for seg in ack.replace("\n", "\r").split("\r"):
        if seg.startswith("MSA|"):
            parts = seg.split("|")
            return (parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else "")
    return "", ""


class Stream:
    """`rate` msg/s over `lanes` lanes and `connections` connections to host:port, until stopped.

    `pause()` / `resume()` hold and release every connection between messages (the lab drains
    between faults). `ledger` holds every message; `attempts` every try, for outage figures.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        rate: float = 60.0,
        lanes: int = 20,
        connections: int = 4,
        prefix: str = "S",
        timeout: float = 3.0,
    ) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.rate, self.prefix = rate, prefix
        self.lanes = [f"L{n:02d}" for n in range(lanes)]
        self.ledger: dict[str, Sent] = {}
        self.attempts: list[Attempt] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._run = threading.Event()
        self._run.set()
        self._idle = [threading.Event() for _ in range(connections)]
        self._threads = [
            threading.Thread(target=self._sender, args=(k, self.lanes[k::connections]), daemon=True, name=f"stream-{k}")
            for k in range(connections)
        ]

    def start(self) -> Stream:
        for t in self._threads:
            t.start()
        return self

    def pause(self, timeout: float = 60.0) -> None:
        """Stop sending new messages; returns once every connection has its last one `AA`'d."""
        self._run.clear()
        deadline = time.monotonic() + timeout
        for idle in self._idle:
            idle.wait(max(0.0, deadline - time.monotonic()))

    def resume(self) -> None:
        self._run.set()

    def stop(self) -> None:
        self._stop.set()
        self._run.set()
        for t in self._threads:
            t.join(self.timeout + 5)

    def acked(self) -> list[Sent]:
        with self._lock:
            return [s for s in self.ledger.values() if s.acked_at is not None]

    def _sender(self, k: int, lanes: list[str]) -> None:
        interval = len(self._threads) / self.rate
        seqs = dict.fromkeys(lanes, 0)
        link: _Link | None = None
        turn = 0
        next_at = time.time()
        while not self._stop.is_set():
            if not self._run.is_set():
                self._idle[k].set()
                self._run.wait()
                self._idle[k].clear()
                next_at = time.time()
                continue
            lane = lanes[turn % len(lanes)]
            turn += 1
            seqs[lane] += 1
            control_id = f"{self.prefix}-{lane}-{seqs[lane]:06d}"
            sent = Sent(control_id, lane, seqs[lane], first_try=time.time())
            with self._lock:
                self.ledger[control_id] = sent
            text = message(control_id, lane, seqs[lane])
            while not self._stop.is_set():  # resend until AA, same control id
                delay = next_at - time.time()
                if delay > 0:
                    time.sleep(delay)
                next_at = max(next_at + interval, time.time() - interval)  # no bursts after an outage
                sent.attempts += 1
                at = time.time()
                try:
                    if link is None:
                        link = _Link(self.host, self.port, self.timeout)
                    code, msa2 = _msa(link.send(text))
                except OSError as exc:
                    code, msa2 = "", ""
                    sent.failures.append(type(exc).__name__)
                    if link is not None:
                        link.close()
                    link = None
                done = time.time()
                ok = code == "AA" and msa2 == control_id
                with self._lock:
                    self.attempts.append(Attempt(at, done, ok, k))
                if ok:
                    sent.acked_at = done
                    break
                if code:
                    sent.naks += 1
                    sent.failures.append(code if msa2 == control_id else f"{code} for {msa2!r}")
                time.sleep(0.05)
        if link is not None:
            link.close()
        self._idle[k].set()


@dataclass
class Verdict:
    """What happened to a set of messages, judged against the recorder's deliveries."""

    sent: int = 0
    acked: int = 0
    delivered: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    inversions: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def judge(ledger: dict[str, Sent], deliveries: list[dict], *, select=lambda s: True) -> Verdict:
    """Lost (ACKed, never delivered), duplicated (delivered more than once), order inversions (a
    message first delivered after a later message of its lane), latency (AA → first delivery) —
    for the messages `select` picks; order is judged on every lane's whole delivery sequence."""
    first: dict[str, float] = {}
    count: dict[str, int] = defaultdict(int)
    inverted: set[str] = set()
    highest: dict[str, int] = {}
    for d in deliveries:
        cid = d["control_id"]
        count[cid] += 1
        if cid in first:
            continue
        first[cid] = d["t"]
        try:
            lane, seq = parse_control_id(cid)
        except ValueError:
            continue
        if seq < highest.get(lane, 0):
            inverted.add(cid)
        highest[lane] = max(highest.get(lane, 0), seq)
    v = Verdict()
    for s in ledger.values():
        if not select(s):
            continue
        v.sent += 1
        if s.acked_at is not None:
            v.acked += 1
            if s.control_id not in first:
                v.lost.append(s.control_id)
            else:
                v.latencies.append(first[s.control_id] - s.acked_at)
        if s.control_id in first:
            v.delivered += 1
        if count.get(s.control_id, 0) > 1:
            v.duplicated.append(s.control_id)
        if s.control_id in inverted:
            v.inversions.append(s.control_id)
    return v


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
