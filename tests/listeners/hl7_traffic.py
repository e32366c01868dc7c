"""Synthetic HL7 traffic and a reconnecting sender for listenerd tests (no PHI)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import hl7
from hl7.client import MLLPClient


def adt(
    control_id: str,
    *,
    patient: str = "P1",
    charset: str = "",
    version: str = "2.5.1",
    segment_end: str = "\r",
    name: str = "DOE^JANE",
) -> str:
    msh18 = f"||||||{charset}" if charset else ""
    return (
        segment_end.join(
            [
                f"MSH|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|20261122101500||ADT^A01^ADT_A01|{control_id}|P|{version}{msh18}",
                "EVN|A01|20261122101500",
                f"PID|1||{patient}^^^HOSP^MR||{name}||19700101|F",
                "PV1|1|I|W1^101^A",
            ]
        )
        + segment_end
    )


def post_message(
    port: int,
    connection: str,
    data: bytes,
    *,
    content_type: str = "application/hl7-v2",
    answer_type: list | None = None,
) -> tuple[int, dict]:
    """POST `data` (HL7 v2, or as `content_type` says) to a listenerd's HTTP inbound `connection`:
    (status, its JSON answer); `answer_type`, if given, gets the answer's Content-Type appended."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/messages/{connection}", data=data, headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            if answer_type is not None:
                answer_type.append(resp.headers.get("Content-Type"))
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        if answer_type is not None:
            answer_type.append(err.headers.get("Content-Type"))
        return err.code, json.loads(err.read())


def ack_fields(ack: str | bytes) -> tuple[str, str]:
    """(MSA-1, MSA-2) of an ACK, parsed by python-hl7."""
    text = ack.decode("latin-1") if isinstance(ack, bytes) else ack
    text = text.strip("\x0b\x1c\r\n")
    msa = hl7.parse(text).segment("MSA")
    return str(msa[1]), str(msa[2])


class Sender(threading.Thread):
    """Sends numbered messages through python-hl7's MLLPClient, reconnecting on any failure, and
    records which control ids were acknowledged AA. Stops when told."""

    def __init__(self, port: int, *, prefix: str, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.port, self.prefix, self.interval = port, prefix, interval
        self.acked: list[str] = []
        self.nacked: list[str] = []
        self.failures = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        n, client = 0, None
        while not self._stop_event.is_set():
            control_id = f"{self.prefix}{n:06d}"
            try:
                if client is None:
                    client = MLLPClient("127.0.0.1", self.port)
                    client.socket.settimeout(5)
                code, msa2 = ack_fields(client.send_message(adt(control_id)))
                (self.acked if code == "AA" and msa2 == control_id else self.nacked).append(control_id)
                n += 1  # a NAKed message is not retried under the same id; it simply was not accepted
            except (OSError, hl7.exceptions.ParseException):  # the latter: closed before the ACK (empty reply)
                self.failures += 1
                if client is not None:
                    try:
                        client.close()
                    except OSError:
                        pass
                client = None
                time.sleep(0.05)
                n += 1  # unknown outcome: never counted as acknowledged
            time.sleep(self.interval)
        if client is not None:
            client.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(15)


class ResendingSender:
    """A pipelining MLLP sender over several connections that resends anything not answered AA
    (negative ACK, or the connection closed first) until it is — a careful real sender.

    Each connection owns its own control ids and keeps up to `window` messages in flight. After
    `stop_new()` no new ids are made; `finish()` waits until every id made so far is AA'd."""

    def __init__(self, port: int, *, prefix: str, connections: int = 4, window: int = 8) -> None:
        self.port, self.prefix, self.window = port, prefix, window
        self.acked: dict[str, int] = {}  # control id -> how many AA it got (must be 1)
        self.sends: dict[str, int] = {}  # control id -> how many times it was sent
        self.made: set[str] = set()
        self.reconnects = 0
        self._lock = threading.Lock()
        self._new = threading.Event()
        self._new.set()
        self._quit = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in range(connections)]

    def start(self) -> ResendingSender:
        for t in self._threads:
            t.start()
        return self

    def stop_new(self) -> None:
        self._new.clear()

    def unacked(self) -> list[str]:
        with self._lock:
            return sorted(self.made - set(self.acked))

    def finish(self, timeout: float = 30) -> list[str]:
        """Stop making ids, wait until all made ones are AA'd; the ids still unacknowledged."""
        self.stop_new()
        deadline = time.monotonic() + timeout
        while self.unacked() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._quit.set()
        for t in self._threads:
            t.join(10)
        return self.unacked()

    def _run(self, conn: int) -> None:
        pending: list[str] = []  # to (re)send, in order
        n = 0
        while not self._quit.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                time.sleep(0.02)  # nobody listening yet: the standby binds within a heartbeat
                continue
            in_flight: list[str] = []
            buf = b""
            try:
                while not self._quit.is_set():
                    while len(in_flight) < self.window and (pending or self._new.is_set()):
                        if pending:
                            cid = pending.pop(0)
                        else:
                            cid = f"{self.prefix}{conn}-{n:06d}"
                            n += 1
                            with self._lock:
                                self.made.add(cid)
                        in_flight.append(cid)  # before sending: a failed send is resent too
                        self.sends[cid] = self.sends.get(cid, 0) + 1
                        sock.sendall(b"\x0b" + adt(cid, patient=f"{self.prefix}{conn}").encode() + b"\x1c\r")
                    if not in_flight:
                        time.sleep(0.01)
                        continue
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                    while b"\x1c\r" in buf:
                        frame, buf = buf.split(b"\x1c\r", 1)
                        code, msa2 = ack_fields(frame)
                        cid = in_flight.pop(0)
                        if code == "AA" and msa2 == cid:
                            with self._lock:
                                self.acked[cid] = self.acked.get(cid, 0) + 1
                        else:
                            pending.append(cid)
            except OSError:
                pass
            finally:
                sock.close()
            pending[:0] = in_flight  # unanswered: resend first, in order
            self.reconnects += 1
