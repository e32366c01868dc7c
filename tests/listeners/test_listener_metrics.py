"""Every inbound kind reports the same counters on listenerd's /metrics: one running listenerd with an
MLLP, a raw TCP, an HTTP and a file-drop connection, each sent messages that are accepted (AA),
refused (AR: a NUL byte, over the size limit, for MLLP also a frame with no readable header) and
not stored because the store is locked (AE), over real sockets and real files on a real SQLite
store. Each kind's received / bytes / answers-by-code / open-connections series are asserted."""

from __future__ import annotations

import socket
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from tests.conftest import migrated_sqlite
from tests.listeners.hl7_traffic import adt

LIMIT = 512  # every connection's max_message_bytes
KINDS = ("mllp", "tcp", "http", "file")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Senders:
    """One message over each transport, returning the transport's answer as AA / AE / AR."""

    def __init__(self, ports: dict[str, int], drop: Path) -> None:
        self.ports, self.drop = ports, drop

    def mllp(self, payload: bytes) -> str:
        with socket.create_connection(("127.0.0.1", self.ports["mllp"]), timeout=15) as s:
            s.sendall(b"\x0b" + payload + b"\x1c\r")
            reply = b""
            while b"\x1c\r" not in reply:
                chunk = s.recv(65536)
                assert chunk, "connection closed without an answer"
                reply += chunk
        msa = next(seg for seg in reply.strip(b"\x0b\x1c\r").split(b"\r") if seg.startswith(b"MSA|"))
        return msa.split(b"|")[1].decode()

    def tcp(self, payload: bytes) -> str:
        with socket.create_connection(("127.0.0.1", self.ports["tcp"]), timeout=15) as s:
            s.sendall(payload + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = s.recv(65536)
                assert chunk, "connection closed without an answer"
                reply += chunk
        if reply.startswith(b"ACK "):
            return "AA"
        return "AE" if b"resend later" in reply else "AR"

    def http(self, payload: bytes) -> str:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.ports['http']}/messages/in-http",
            data=payload,
            headers={"Content-Type": "application/hl7-v2"},
        )
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                return "AA" if resp.status == 202 else str(resp.status)
        except urllib.error.HTTPError as err:
            return "AE" if err.code == 503 else "AR" if err.code in (400, 413) else str(err.code)
        except (ConnectionError, urllib.error.URLError):  # a 413 may close before the body is all sent
            return "AR"

    def file(self, payload: bytes, name: str) -> str:
        (self.drop / name).write_bytes(payload)
        archive = self.drop.parent / "archive"
        reason = archive / "rejected" / f"{name}.reason"  # claimed first: done once archived or its reason is written
        wait_for(
            lambda: (archive / name).exists() or (reason.exists() and reason.read_text().endswith("\n")),
            timeout=20,
            interval=0.05,
            what=f"{name} taken",
        )
        return "AR" if reason.exists() else "AA"


def test_every_listener_kind_reports_the_same_counters_AR_and_AE_included(tmp_path):
    db = tmp_path / "store.db"
    cfg = migrated_sqlite(db, busy_timeout_ms=300, busy_retry_seconds=0.0)  # locked = down
    ports = {kind: free_port() for kind in ("mllp", "tcp", "http")}
    drop = tmp_path / "drop"
    drop.mkdir()
    limits = {"max_message_bytes": LIMIT}
    d = Daemon(
        tmp_path / "node",
        cfg,
        node_id="solo:1:aa",
        inbound=[
            {"name": "in-mllp", "kind": "mllp", "port": ports["mllp"], **limits},
            {"name": "in-tcp", "kind": "tcp", "port": ports["tcp"], **limits},
            {"name": "in-http", "kind": "http", "port": ports["http"], **limits},
            {
                "name": "in-file",
                "kind": "file",
                "directory": str(drop),
                "archive": str(tmp_path / "archive"),
                "poll_seconds": 0.1,
                **limits,
            },
        ],
    ).start()
    try:
        for port in ports.values():
            wait_for(lambda: port_open(port), timeout=15, what="bind")
        send = Senders(ports, drop)

        def over(kind: str, payload: bytes, tag: str) -> str:
            return send.file(payload, f"{tag}.hl7") if kind == "file" else getattr(send, kind)(payload)

        good = [adt(f"OK-{i}").encode() for i in range(2)]
        nul = adt("BAD-NUL", name="DOE\x00JANE").encode()
        big = adt("BIG", name="X" * LIMIT).encode()
        not_hl7 = b"HELLO, this is not HL7"
        # newline framing takes a trailing CR before the LF as part of the line end
        size = dict.fromkeys(KINDS, len) | {"tcp": lambda m: len(m) - m.endswith(b"\r")}
        read_bytes = dict.fromkeys(KINDS, 0)  # bytes each transport read, as the counter defines them
        answers = {kind: [] for kind in KINDS}
        for kind in KINDS:
            for i, m in enumerate(good):
                answers[kind].append(over(kind, m, f"good{i}"))
            answers[kind].append(over(kind, nul, "nul"))
            answers[kind].append(over(kind, big, "big"))
            read_bytes[kind] = sum(map(size[kind], good)) + size[kind](nul)
            if kind in ("mllp", "tcp"):  # a stream reads (and discards) an oversize message; HTTP and file do not
                read_bytes[kind] += len(big)
        answers["mllp"].append(send.mllp(not_hl7))
        read_bytes["mllp"] += len(not_hl7)
        assert answers == {kind: ["AA", "AA", "AR", "AR"] for kind in ("tcp", "http", "file")} | {
            "mllp": ["AA", "AA", "AR", "AR", "AR"]
        }

        # the store cannot take writes: every transport answers "not stored, resend" (AE)
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        locked = adt("LOCKED").encode()
        try:
            for kind in ("mllp", "tcp", "http"):
                assert over(kind, locked, "locked") == "AE", kind
                read_bytes[kind] += size[kind](locked)
            (drop / "locked.hl7").write_bytes(locked)  # claimed, then retried each poll while locked

            def file_ae() -> float:
                return samples(d.get("/metrics")[1].decode()).get(
                    ("stageline_acks_total", (("code", "AE"), ("connection", "in-file"))), 0.0
                )

            wait_for(lambda: file_ae() >= 1, timeout=20, interval=0.1, what="the file drop to answer AE")
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        wait_for(
            lambda: (tmp_path / "archive" / "locked.hl7").exists(),
            timeout=20,
            interval=0.05,
            what="locked.hl7 staged and archived",
        )

        # a connection held open shows in the gauge of each network kind
        held = {kind: socket.create_connection(("127.0.0.1", ports[kind]), timeout=5) for kind in ports}
        try:

            def open_now() -> dict[str, float]:
                m = samples(d.get("/metrics")[1].decode())
                return {k: m[("stageline_open_connections", (("connection", f"in-{k}"),))] for k in KINDS}

            wait_for(
                lambda: open_now() == {"mllp": 1, "tcp": 1, "http": 1, "file": 0},
                timeout=10,
                interval=0.1,
                what="open connections gauge",
            )
        finally:
            for sock in held.values():
                sock.close()
        wait_for(lambda: set(open_now().values()) == {0}, timeout=10, interval=0.1, what="connections closed")

        m = samples(d.get("/metrics")[1].decode())
        file_retries = m[("stageline_acks_total", (("code", "AE"), ("connection", "in-file")))]
        assert file_retries >= 1
        for kind in KINDS:
            conn = (("connection", f"in-{kind}"),)
            retries = file_retries if kind == "file" else 1  # each AE'd attempt was a message received
            refused = 3 if kind == "mllp" else 2
            counted = {
                "info": m[("stageline_inbound_connection_info", tuple(sorted((conn[0], ("kind", kind)))))],
                "received": m[("stageline_messages_received_total", conn)],
                "bytes": m[("stageline_received_bytes_total", conn)],
                **{code: m[("stageline_acks_total", (("code", code), *conn))] for code in ("AA", "AE", "AR")},
            }
            assert counted == {
                "info": 1.0,
                "received": 2 + refused + retries + (1 if kind == "file" else 0),
                "bytes": read_bytes[kind] + len(locked) * (retries + 1 if kind == "file" else 0),
                "AA": 3.0 if kind == "file" else 2.0,  # the file drop stored locked.hl7 once unlocked
                "AE": retries,
                "AR": refused,
            }, kind
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0
