"""One bad message harms no one else (invariant 9, docs/invariants.md), against a running listenerd:
eight python-hl7 clients send good messages while a ninth sends messages the store cannot take.
Every good message is answered AA and staged once; each bad one alone is refused (AR) with its
reason.

Two kinds of bad input: NUL bytes (refused by the shared inbound validation before any commit)
and a payload the store itself refuses (a CHECK constraint / trigger added for the test: what
validation cannot foresee), which the group commit isolates by splitting the batch."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import hl7
import pytest
from hl7.mllp import open_hl7_connection

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.store import Store
from tests.listeners.conftest import leading_node
from tests.listeners.hl7_traffic import adt
from tests.listeners.test_group_commit import refuse_poison

GOOD_SENDERS, PER_SENDER, BAD = 8, 120, 120

BAD_KINDS = {
    # kind: (how the bad message differs, expected MSA-3 reason)
    "nul-bytes": ("DOE\x00JANE", "message contains NUL characters"),
    "store-refused": ("POISON^JANE", "refused by the store"),
}


@pytest.fixture
def daemon(tmp_path, store_config):
    d = leading_node(tmp_path, store_config)
    yield d
    assert d.stop() == 0


async def send(port: int, messages: list[str]) -> list[tuple[str, str, str]]:
    """(MSA-1, MSA-2, MSA-3) per message, one python-hl7 connection, one message at a time."""
    reader, writer = await open_hl7_connection("127.0.0.1", port)
    answers = []
    try:
        for m in messages:
            writer.writemessage(hl7.parse(m))
            await writer.drain()
            msa = (await asyncio.wait_for(reader.readmessage(), 15)).segment("MSA")
            answers.append((str(msa[1]), str(msa[2]), str(msa[3]) if len(msa) > 3 else ""))
    finally:
        writer.close()
        await writer.wait_closed()
    return answers


@pytest.mark.parametrize("kind", list(BAD_KINDS))
def test_one_sender_of_bad_messages_harms_none_of_eight_good_senders(daemon, store_config, kind):
    marker, reason = BAD_KINDS[kind]
    store = Store(store_config)
    try:
        if kind == "store-refused":
            refuse_poison(store)
        good = [[adt(f"G{s}-{i}", patient=f"P{s}") for i in range(PER_SENDER)] for s in range(GOOD_SENDERS)]
        bad = [adt(f"BAD-{i}", patient="PX", name=marker) for i in range(BAD)]

        async def all_senders():
            return await asyncio.gather(*(send(daemon.mllp_port, msgs) for msgs in good + [bad]))

        *good_answers, bad_answers = asyncio.run(all_senders())
        not_aa = [(a, m) for answers, msgs in zip(good_answers, good) for a, m in zip(answers, msgs) if a[0] != "AA"]
        print(
            f"{kind} on {store_config.backend}: good answered AA "
            f"{GOOD_SENDERS * PER_SENDER - len(not_aa)}/{GOOD_SENDERS * PER_SENDER}, "
            f"bad refused AR {sum(a[0] == 'AR' for a in bad_answers)}/{BAD}"
        )
        assert not_aa == []
        assert [a[:2] for answers in good_answers for a in answers] == [
            ("AA", f"G{s}-{i}") for s in range(GOOD_SENDERS) for i in range(PER_SENDER)
        ]
        assert [a[:2] for a in bad_answers] == [("AR", f"BAD-{i}") for i in range(BAD)]
        assert all(reason in a[2] for a in bad_answers), bad_answers[:3]
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute("SELECT control_id, lane_key FROM stage_inbound ORDER BY id")
            rows = [dict(r) for r in cur.fetchall()]
        counts = Counter(r["control_id"] for r in rows)
        assert counts == Counter(f"G{s}-{i}" for s in range(GOOD_SENDERS) for i in range(PER_SENDER))  # once each
        for s in range(GOOD_SENDERS):  # each sender's lane in its sending order
            assert [r["control_id"] for r in rows if r["lane_key"] == f"P{s}"] == [
                f"G{s}-{i}" for i in range(PER_SENDER)
            ]
        metrics = daemon.get("/metrics")[1].decode()
        assert f'stageline_acks_total{{code="AR",connection="adt-in"}} {float(BAD)}' in metrics
        assert 'stageline_acks_total{code="AE",connection="adt-in"} 0.0' in metrics
        if kind == "store-refused":
            assert f'stageline_store_errors_total{{operation="stage_inbound_refused"}} {float(BAD)}' in metrics
        assert daemon.proc.poll() is None
    finally:
        store.close()


@pytest.mark.parametrize("store_config", ["sqlite"], indirect=True)
def test_every_transport_refuses_unstorable_input_the_same_way(tmp_path, store_config):
    """The same message with a NUL byte, over MLLP, TCP, HTTP and file drop: each transport refuses
    it with the same reason and stages nothing; the same message without the NUL is staged by each."""
    import socket
    import urllib.request

    ports = {kind: free_port() for kind in ("mllp", "tcp", "http")}
    drop, archive = tmp_path / "drop", tmp_path / "archive"
    drop.mkdir()
    d = Daemon(
        tmp_path / "node",
        store_config,
        node_id="solo:1:aa",
        inbound=[
            {"name": "in-mllp", "kind": "mllp", "port": ports["mllp"]},
            {"name": "in-tcp", "kind": "tcp", "port": ports["tcp"]},
            {"name": "in-http", "kind": "http", "port": ports["http"]},
            {"name": "in-file", "kind": "file", "directory": str(drop), "archive": str(archive), "poll_seconds": 0.1},
        ],
    ).start()
    try:
        for port in ports.values():
            wait_for(lambda: port_open(port), timeout=15, what="bind")
        bad, good = (adt(f"{kind}-X", name=name).encode() for kind, name in (("BAD", "DOE\x00JANE"), ("OK", "DOE")))
        offset = bad.index(b"\x00")
        reason = f"message contains NUL characters (character offset {offset})"

        def over_mllp(data: bytes) -> str:
            with socket.create_connection(("127.0.0.1", ports["mllp"]), timeout=10) as s:
                s.sendall(b"\x0b" + data + b"\x1c\r")
                reply = b""
                while b"\x1c\r" not in reply:
                    reply += s.recv(65536)
            msa = hl7.parse(reply.strip(b"\x0b\x1c\r").decode()).segment("MSA")
            return f"{msa[1]} {msa[3]}" if str(msa[1]) != "AA" else "AA"

        def over_tcp(data: bytes) -> str:
            with socket.create_connection(("127.0.0.1", ports["tcp"]), timeout=10) as s:
                s.sendall(data + b"\n")
                reply = b""
                while not reply.endswith(b"\n"):
                    reply += s.recv(65536)
            return "ACK" if reply.startswith(b"ACK ") else reply.decode().strip()

        def over_http(data: bytes) -> str:
            req = urllib.request.Request(
                f"http://127.0.0.1:{ports['http']}/messages/in-http",
                data=data,
                headers={"Content-Type": "application/hl7-v2"},
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return str(resp.status)
            except urllib.error.HTTPError as err:
                return f"{err.code} {json.loads(err.read())['error']}"

        def over_file(data: bytes, name: str) -> str:
            (drop / name).write_bytes(data)
            rejected = archive / "rejected" / f"{name}.reason"
            wait_for(
                lambda: (archive / name).exists() or (rejected.exists() and rejected.read_text().endswith("\n")),
                timeout=10,
                interval=0.02,
                what="file taken",
            )  # claimed first: done once archived or refused
            return rejected.read_text().splitlines()[0] if rejected.exists() else "archived"

        assert over_mllp(bad) == f"AR {reason}"
        assert over_tcp(bad) == f"NAK {reason}"
        assert over_http(bad) == f"400 {reason}"
        assert over_file(bad, "bad.hl7") == reason
        assert (over_mllp(good), over_tcp(good), over_http(good), over_file(good, "good.hl7")) == (
            "AA",
            "ACK",
            "202",
            "archived",
        )
        rows = Store(store_config)
        try:
            with rows.transaction(write=False) as tx:
                cur = tx.conn.cursor()
                cur.execute("SELECT connection, control_id FROM stage_inbound ORDER BY id")
                staged = [(r["connection"], r["control_id"]) for r in cur.fetchall()]
        finally:
            rows.close()
        assert staged == [("in-mllp", "OK-X"), ("in-tcp", "OK-X"), ("in-http", "OK-X"), ("in-file", "OK-X")]
    finally:
        assert d.stop() == 0
