"""listenerd as a real process: messages from real third-party clients are ACKed only after they
are staged; bad input gets its documented answer; the control plane and a clean stop behave."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import hl7
import pytest
from hl7.mllp import open_hl7_connection

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.config import StoreConfig
from include.store import Store
from tests.conftest import migrated_sqlite
from tests.listeners.conftest import leading_node
from tests.listeners.hl7_traffic import ack_fields, adt
from tests.support.nodes import mllp_node

VT, FS, CR = b"\x0b", b"\x1c", b"\r"


def staged(store_config: StoreConfig, where: str = "1=1") -> list[dict]:
    store = Store(store_config)
    try:
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(
                "SELECT control_id, connection, lane_key, charset, payload FROM inbound_messages "
                f"WHERE {where} ORDER BY id"
            )
            return [dict(r) for r in cur.fetchall()]
    finally:
        store.close()


@pytest.fixture
def daemon(tmp_path, store_config):
    d = leading_node(tmp_path, store_config, max_message_bytes=65536, idle_timeout_seconds=30)
    yield d
    d.stop()


async def _send_with_python_hl7(port: int, messages: list[str]) -> list[str]:
    reader, writer = await open_hl7_connection("127.0.0.1", port)
    acks = []
    try:
        for m in messages:
            writer.writemessage(hl7.parse(m))
            await writer.drain()
            acks.append(str(await asyncio.wait_for(reader.readmessage(), 15)))
    finally:
        writer.close()
        await writer.wait_closed()
    return acks


def test_python_hl7_clients_get_AA_only_for_staged_messages(daemon, store_config):
    async def two_connections():
        return await asyncio.gather(
            _send_with_python_hl7(daemon.mllp_port, [adt(f"A{i}", patient=f"P{i % 3}") for i in range(10)]),
            _send_with_python_hl7(daemon.mllp_port, [adt(f"B{i}", patient="P9") for i in range(10)]),
        )

    acks_a, acks_b = asyncio.run(two_connections())
    assert [ack_fields(a) for a in acks_a] == [("AA", f"A{i}") for i in range(10)]
    assert [ack_fields(a) for a in acks_b] == [("AA", f"B{i}") for i in range(10)]
    ack = hl7.parse(acks_a[0].strip())
    assert str(ack.segment("MSH")[3]) == "STAGELINE" and str(ack.segment("MSH")[5]) == "SENDAPP"  # swapped
    rows = staged(store_config)
    assert sorted(r["control_id"] for r in rows) == sorted([f"A{i}" for i in range(10)] + [f"B{i}" for i in range(10)])
    assert {r["connection"] for r in rows} == {"adt-in"}
    assert {r["control_id"]: r["lane_key"] for r in rows}["A4"] == "P1"
    assert [r["control_id"] for r in rows if r["control_id"].startswith("A")] == [f"A{i}" for i in range(10)]
    assert rows[0]["payload"] == adt(rows[0]["control_id"], patient="P0" if rows[0]["control_id"] == "A0" else "P9")


def test_mllp_send_command_line_client(daemon, store_config, tmp_path):
    batch = tmp_path / "three.hl7"
    batch.write_text("".join(adt(f"CLI{i}").replace("\r", "\r\n") for i in range(3)))
    mllp_send = Path(sys.executable).parent / "mllp_send"
    out = subprocess.run(
        [str(mllp_send), "--port", str(daemon.mllp_port), "--file", str(batch), "--quiet", "--loose", "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [str(mllp_send), "--port", str(daemon.mllp_port), "--file", str(batch), "--loose", "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    acks = [ack_fields("MSH|" + part) for part in out.stdout.replace("\n", "\r").split("MSH|")[1:]]
    assert [code for code, _ in acks] == ["AA"] * 3
    assert [r["control_id"] for r in staged(store_config, "control_id LIKE 'CLI%'")] == ["CLI0", "CLI1", "CLI2"] * 2


def _exchange(
    port: int, data: bytes | list[bytes], *, expect_acks: int, timeout: float = 10
) -> tuple[list[bytes], bool]:
    """Send raw bytes (a list = separate writes), read `expect_acks` framed ACKs; report a close."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    for chunk in data if isinstance(data, list) else [data]:
        s.sendall(chunk)
        if isinstance(data, list):
            time.sleep(0.002)
    buf, acks, closed = b"", [], False
    deadline = time.monotonic() + timeout
    while len(acks) < expect_acks and time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            closed = True
            break
        buf += chunk
        while FS + CR in buf:
            frame, buf = buf.split(FS + CR, 1)
            acks.append(frame.lstrip(VT))
    if not closed and expect_acks == 0:
        s.settimeout(1.0)
        try:
            closed = s.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            closed = False
    s.close()
    return acks, closed


def mllp(text: str | bytes) -> bytes:
    return VT + (text.encode() if isinstance(text, str) else text) + FS + CR


BIG = 70_000  # over the connection's 65,536-byte limit
BAD_INPUT = [
    # name, bytes on the wire, expected (MSA-1, MSA-2) per ACK; "close" = connection closed, no ACK
    ("valid", mllp(adt("V1")), [("AA", "V1")]),
    ("no MSH segment", mllp("PID|1||X\r"), [("AR", "")]),
    ("empty frame", mllp(b""), [("AR", "")]),
    # a malformed MSH-2, but MSH-10 is readable: the reject names the message
    ("duplicate encoding characters", mllp(adt("E1").replace("^~\\&", "^^\\&", 1)), [("AR", "E1")]),
    ("alphanumeric field separator", mllp(adt("E2").replace("MSH|", "MSHA", 1)), [("AR", "")]),
    ("missing MSH-10", mllp(adt("").replace("|P|2.5.1", "|P|2.5.1", 1)), [("AR", "")]),
    # a header that cannot be decoded, but whose MSH-10 is plain ASCII: the reject names the message
    ("unknown charset in MSH-18", mllp(adt("C1", charset="KLINGON")), [("AR", "C1")]),
    (
        "bytes invalid in the declared charset",
        mllp(adt("C2", charset="UNICODE UTF-8").encode().replace(b"DOE", b"D\xffE")),
        [("AR", "C2")],
    ),
    ("garbage before a frame", b"hello\x00\xff" + mllp(adt("G1")), [("AA", "G1")]),
    ("frame split byte by byte", [bytes([b]) for b in mllp(adt("S1"))], [("AA", "S1")]),
    ("two frames in one write", mllp(adt("T1")) + mllp(adt("T2")), [("AA", "T1"), ("AA", "T2")]),
    ("FS without CR", VT + adt("F1").encode() + FS + mllp(adt("F2")), [("AA", "F1"), ("AA", "F2")]),
    ("interrupted frame restarted", VT + b"MSH|^~\\&|half" + mllp(adt("R1")), [("AA", "R1")]),
    ("LF segment terminators", mllp(adt("L1", segment_end="\n")), [("AA", "L1")]),
    (
        "8859/1 with a non-ASCII name",
        mllp(adt("I1", charset="8859/1", name="MÜLLER^ÅSA").encode("latin-1")),
        [("AA", "I1")],
    ),
    ("oversize with a readable header", mllp(adt("O1") + "NTE|1||" + "x" * BIG + "\r"), [("AR", "O1")]),
    ("oversize with no header", mllp(b"y" * BIG), [("AR", "")]),  # answered, and the connection goes on (F4)
]


@pytest.mark.parametrize("name, wire, expected", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_matrix(daemon, store_config, name, wire, expected):
    acks, closed = _exchange(daemon.mllp_port, wire, expect_acks=0 if expected == "close" else len(expected))
    if expected == "close":
        assert acks == [] and closed
    else:
        assert [ack_fields(a) for a in acks] == expected
    accepted = [msa2 for code, msa2 in ([] if expected == "close" else expected) if code == "AA"]
    ids = "', '".join(accepted + ["V1" if name != "valid" else "-"])
    stored = [r["control_id"] for r in staged(store_config, f"control_id IN ('{ids}')") if r["control_id"] in accepted]
    assert stored == accepted  # rows exist exactly for the AA'd messages
    if name.startswith("8859/1"):
        assert "MÜLLER^ÅSA" in staged(store_config, "control_id = 'I1'")[0]["payload"]
    assert daemon.proc.poll() is None  # the daemon is still running


def test_store_failure_answers_AE_never_AA_and_the_daemon_recovers(tmp_path):
    db = tmp_path / "store.db"
    cfg = migrated_sqlite(db, busy_timeout_ms=300, busy_retry_seconds=0.0)  # locked = down
    port = free_port()
    d = mllp_node(tmp_path / "node", cfg, node_id="solo:1:aa", port=port)
    try:
        wait_for(lambda: port_open(port), timeout=15, what="bind")
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # the store cannot take writes
        acks, _ = _exchange(port, mllp(adt("DOWN1")), expect_acks=1)
        assert [ack_fields(a)[0] for a in acks] == ["AE"]
        assert (
            str(hl7.parse(acks[0].decode().strip("\r")).segment("ERR")[3]) == "207^Application internal error^HL70357"
        )
        # enhanced mode (MSH-15 valued): the commit error CE, sent unless MSH-15 is SU (success only)
        enhanced = [adt(c).replace("|P|2.5.1", f"|P|2.5.1|||{c[:2]}", 1) for c in ("ER1", "SU1", "AL1")]
        acks, _ = _exchange(port, b"".join(mllp(m) for m in enhanced), expect_acks=2)
        assert [ack_fields(a) for a in acks] == [("CE", "ER1"), ("CE", "AL1")]
        blocker.execute("ROLLBACK")
        blocker.close()
        acks, _ = _exchange(port, mllp(adt("UP1")), expect_acks=1)
        assert [ack_fields(a) for a in acks] == [("AA", "UP1")]
        assert [r["control_id"] for r in staged(cfg)] == ["UP1"]
        code, body = d.get("/metrics")
        assert code == 200 and b'stageline_acks_total{code="AE",connection="adt-in"} 1.0' in body
    finally:
        assert d.stop() == 0


def test_control_plane_answers_on_the_node_and_needs_a_token(daemon):
    assert daemon.get("/health", token=None)[0] == 200
    assert daemon.get("/cluster/status", token=None)[0] == 401
    assert daemon.get("/cluster/status", token="wrong")[0] == 401
    status = daemon.status()
    assert status["node_id"] == "node-a:1:aa" and status["is_leader"] is True
    assert status["role"] in ("single-node", "primary")
    code, body = daemon.get("/cluster/nodes")
    nodes = json.loads(body)
    assert code == 200 and nodes["leader_node_id"] == "node-a:1:aa" and nodes["lease_owner"] == "node-a:1:aa"
    code, body = daemon.get("/metrics")
    assert code == 200 and b"stageline_leader 1.0" in body


def test_sigterm_finishes_in_flight_work_releases_the_lease_and_exits_0(daemon, store_config):
    asyncio.run(_send_with_python_hl7(daemon.mllp_port, [adt("LAST1")]))
    assert daemon.stop() == 0
    assert not port_open(daemon.mllp_port)
    store = Store(store_config)
    try:
        with store.transaction(write=False) as tx:
            node = tx.one("nodes_list", {"node_timeout": 30.0})
            lease = tx.one("lease_read")
    finally:
        store.close()
    assert (node["status"], bool(node["is_leader"])) == ("left", False)
    assert bool(lease["live"]) is (store_config.backend == "sqlite")  # single node: permanent lease
    assert "listenerd node-a:1:aa stopped" in daemon.output()


@pytest.mark.parametrize("store_config", ["sqlite"], indirect=True)
def test_a_non_loopback_bind_without_tls_refuses_to_start(tmp_path, store_config):
    d = Daemon(
        tmp_path / "node",
        store_config,
        node_id="n:1:a",
        inbound=[{"name": "open", "kind": "mllp", "host": "0.0.0.0", "port": free_port()}],
    )
    d.start(wait=False)
    assert d.proc.wait(30) == 2
    assert "refusing a non-loopback bind without TLS" in d.output()
    d.stop()


@pytest.mark.parametrize("store_config", ["sqlite"], indirect=True)
def test_mllp_over_mutual_tls_accepts_only_clients_with_a_trusted_certificate(tmp_path, store_config):
    import ssl

    from tests.listeners.test_server_tls import make_pki

    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    port = free_port()
    d = Daemon(
        tmp_path / "node",
        store_config,
        node_id="n:1:a",
        inbound=[
            {
                "name": "secure-in",
                "kind": "mllp",
                "host": "127.0.0.1",
                "port": port,
                "tls": {
                    "cert": str(pki.server_cert),
                    "key": str(pki.server_key),
                    "ca": str(pki.ca),
                    "require_client_cert": True,
                },
            }
        ],
    ).start()
    try:
        wait_for(lambda: port_open(port), timeout=15, what="bind")

        def send(client_cert: Path | None) -> list[bytes]:
            ctx = ssl.create_default_context(cafile=str(pki.ca))
            if client_cert:
                ctx.load_cert_chain(str(client_cert))
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                    s.sendall(mllp(adt("TLS1")))
                    data = b""
                    while FS + CR not in data:
                        chunk = s.recv(65536)
                        if not chunk:
                            break
                        data += chunk
            return [f.lstrip(VT) for f in data.split(FS + CR) if f]

        assert [ack_fields(a) for a in send(pki.client)] == [("AA", "TLS1")]
        for bad in (None, pki.rogue_client):
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                if send(bad) == []:
                    raise ConnectionError("closed without an ACK")
        with socket.create_connection(("127.0.0.1", port), timeout=3) as plain:  # plaintext MLLP to a TLS port
            plain.sendall(mllp(adt("PLAIN1")))
            try:
                reply = plain.recv(65536)
            except (TimeoutError, ConnectionResetError):
                reply = b""
            assert b"MSA" not in reply
        assert [r["control_id"] for r in staged(store_config)] == ["TLS1"]
    finally:
        d.stop()
