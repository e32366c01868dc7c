"""HL7 batches (FHS/BHS … BTS/FTS) split at ingest, and one verdict for the same bytes on every
transport (docs/listenerd.md, "Batches" and "The same bytes, the same answer").

The splitter and the shared decision in memory; then a running listenerd on SQLite and PostgreSQL:
a batch sent over MLLP (one batch ACK, or an ACK batch), TCP, HTTP and file drop becomes one row
per message — its own control id and lane, its batch named on the row, in `inbound_batches` and in
its 'received' event — and the same bad bytes get the same answer on all four, staging nothing."""

from __future__ import annotations

import socket
from pathlib import Path

import hl7
import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.testing import MemoryReactorClock, StringTransport

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.config import StoreConfig
from include.store import Store
from listeners.connections_config import InboundConfig
from listeners.endpoints import Wiring, mllp_batch_handler, mllp_handler
from listeners.group_commit import Inbound, InboundBatch
from listeners.hl7ack import AckDecision
from listeners.hl7batch import BatchError, split_batch, starts_batch
from listeners.metrics import Metrics
from listeners.mllp_listener import MLLPConfig, MLLPFactory, frame
from listeners.validation import BatchRejected, PayloadRejected, build_inbound, lane_rule
from tests.listeners.hl7_traffic import post_message


def msh(control_id: str, *, enc: str = "^~\\&", kind: str = "ADT^A01") -> str:
    return f"MSH|{enc}|SEND|FAC|RECV|RFAC|20240101120000||{kind}|{control_id}|P|2.5.1"


def message(control_id: str, patient: str, **kw: str) -> str:
    return f"{msh(control_id, **kw)}\rPID|1||{patient}^^^H^MR||DOE^JANE\r"


def batch(*messages: str, count: int | None = None, files: int | None = 1, fhs: str = "F-1", bhs: str = "B-1") -> bytes:
    n = len(messages) if count is None else count
    text = f"FHS|^~\\&|SEND|FAC|RECV|RFAC|20240101120000||||{fhs}\r" if files is not None else ""
    text += f"BHS|^~\\&|SEND|FAC|RECV|RFAC|20240101120000||||{bhs}\r" + "".join(messages) + f"BTS|{n}\r"
    text += f"FTS|{files}\r" if files is not None else ""
    return text.encode()


GOOD = batch(message("M1", "P1"), message("M2", "P2"), message("M3", "P1"))


# -- the splitter and the shared decision ------------------------------------------------------------


def test_a_batch_is_split_into_its_messages_bytes_untouched_with_its_identity() -> None:
    assert (
        starts_batch(GOOD)
        and starts_batch(b"\r\n" + GOOD[GOOD.index(b"BHS") :])
        and not starts_batch(message("X", "P").encode())
    )
    split = split_batch(GOOD)
    assert split.messages == tuple(message(c, p).encode() for c, p in (("M1", "P1"), ("M2", "P2"), ("M3", "P1")))
    head = split.header
    assert (head.fhs_control_id, head.bhs_control_id, head.control_id, split.declared) == ("F-1", "B-1", "B-1", 3)
    assert (head.sending_application, head.receiving_application) == ("SEND", "RECV")
    bare = split_batch(b"BHS|^~\\&|S|F|R|RF|||||B-9\n" + message("M1", "P1").replace("\r", "\n").encode())
    assert len(bare.messages) == 1 and bare.header.control_id == "B-9" and bare.declared is None  # no BTS: no count


@pytest.mark.parametrize(
    "data, reason",
    [
        (batch(message("M1", "P1"), message("M2", "P2"), count=3), "batch trailer count BTS-1=3 but 2 messages"),
        (batch(message("M1", "P1"), files=2), "file trailer count FTS-1=2 but 1 batch"),
        (GOOD.replace(b"BHS|^~\\&", b"BHS|^~\\&&", 1), "BHS-2 malformed"),
        (GOOD.replace(b"MSH|", b"PID|1\rMSH|", 1), "segment 'PID' outside a message (before its MSH)"),
        (GOOD.replace(b"FTS|1\r", b"FTS|1\rMSH|^~\\&|A\r"), "segment 'MSH' after FTS"),
        (GOOD.replace(b"BTS|3", b"BTS|three"), "BTS-1 is not a number"),
    ],
)
def test_an_envelope_that_does_not_add_up_is_refused_whole_naming_why(data: bytes, reason: str) -> None:
    with pytest.raises(BatchError) as info:
        split_batch(data)
    assert str(info.value).startswith(reason)
    with pytest.raises(BatchRejected) as refused:
        build_inbound(data, connection="c", charset="utf-8")
    assert str(refused.value) == str(info.value)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (message("M2", "P2", enc="^~"), "message 2 of 3: bad_encoding_characters: MSH-2 must be 4 or 5 characters"),
        (
            message("M2", "P2").replace("P|2.5.1", "P|2.5.1||||||KLINGON"),
            "message 2 of 3: unknown_charset: MSH-18 'KLINGON' unsupported",
        ),
        (message("M2", "P2").replace("DOE", "DO\x00E"), "message 2 of 3: message contains NUL characters"),
    ],
)
def test_one_bad_message_refuses_the_batch_naming_which_and_why(bad: str, reason: str) -> None:
    data = batch(message("M1", "P1"), bad, message("M3", "P3"), count=3)
    with pytest.raises(PayloadRejected) as info:
        build_inbound(data, connection="c", charset="utf-8")
    assert str(info.value).startswith(reason)


def test_each_message_gets_its_own_control_id_and_lane_and_a_file_gives_the_same_ids_twice() -> None:
    built = build_inbound(GOOD, connection="c", charset="utf-8", lane_of=lane_rule("PID-3.1"), message_id="f" * 32)
    assert isinstance(built, InboundBatch)
    assert [(i.control_id, i.lane_key) for i in built.items] == [("M1", "P1"), ("M2", "P2"), ("M3", "P1")]
    assert (built.batch_id, built.fhs_control_id, built.bhs_control_id, built.declared) == ("f" * 32, "F-1", "B-1", 3)
    again = build_inbound(GOOD, connection="c", charset="utf-8", message_id="f" * 32)
    assert [i.message_id for i in again.items] == [i.message_id for i in built.items]  # a re-read stages nothing twice
    assert len({i.message_id for i in built.items}) == 3
    rows = built.rows()
    assert [(r["batch_seq"], r["batch_size"], r.get("batch_bhs")) for r in rows] == [
        (1, 3, "B-1"),
        (2, 3, None),
        (3, 3, None),
    ]


def test_malformed_hl7_is_refused_and_other_text_is_opaque_unless_hl7_only() -> None:
    bad = message("X1", "P1", enc="^~").encode()
    with pytest.raises(PayloadRejected, match=r"^bad_encoding_characters: MSH-2 must be 4 or 5 characters$"):
        build_inbound(bad, connection="c", charset="utf-8")
    with pytest.raises(PayloadRejected, match=r"^msh_not_first: MSH is not the first segment$"):
        build_inbound(b"hello\r" + message("X1", "P1").encode(), connection="c", charset="utf-8")
    assert isinstance(build_inbound(b'{"a": 1}', connection="c", charset="utf-8"), Inbound)
    with pytest.raises(PayloadRejected, match=r"^no_msh: no MSH segment$"):
        build_inbound(b'{"a": 1}', connection="c", charset="utf-8", hl7_only=True)


# -- a running listenerd: four transports, one answer ------------------------------------------------


def over_mllp(port: int, data: bytes) -> list[hl7.Message]:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(b"\x0b" + data + b"\x1c\r")
        reply = b""
        while b"\x1c\r" not in reply:
            reply += s.recv(65536)
    return reply.strip(b"\x0b\x1c\r").decode()


def http_verdict(port: int, data: bytes) -> str:
    status, body = post_message(port, "in-http", data)
    return f"{status} {body['error']}"


def mllp_verdict(port: int, data: bytes) -> str:
    msa = hl7.parse(over_mllp(port, data)).segment("MSA")
    return f"{msa[1]} {msa[2]}" if str(msa[1]) == "AA" else f"{msa[1]} {msa[3]}"


def over_tcp(port: int, data: bytes) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(data + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            reply += s.recv(65536)
    return reply.decode().strip()


def over_file(drop: Path, errors: Path, archive: Path, data: bytes, name: str) -> str:
    (drop / name).write_bytes(data)
    reason = errors / f"{name}.reason"  # written just after the file is moved beside it
    wait_for(
        lambda: (archive / name).exists() or (reason.exists() and reason.read_text().endswith("\n")),
        timeout=15,
        interval=0.02,
        what="file taken",
    )
    return reason.read_text().splitlines()[0] if reason.exists() else "archived"


@pytest.fixture
def listenerd(tmp_path: Path, store_config: StoreConfig):
    ports = {kind: free_port() for kind in ("mllp", "each", "tcp", "http")}
    drop, errors, archive = tmp_path / "drop", tmp_path / "refused", tmp_path / "archive"
    drop.mkdir()
    cluster = (
        None
        if store_config.backend == "sqlite"
        else {
            "enabled": True,
            "heartbeat_seconds": 0.5,
            "leader_fence_timeout_seconds": 1.5,
            "leader_lease_ttl_seconds": 2.5,
            "node_timeout_seconds": 2.0,
        }
    )
    lane = {"lane_key": "PID-3.1"}
    d = Daemon(
        tmp_path / "node",
        store_config,
        node_id="solo:1:batch",
        cluster=cluster,
        inbound=[
            {"name": "in-mllp", "kind": "mllp", "port": ports["mllp"], **lane},
            {"name": "in-each", "kind": "mllp", "port": ports["each"], "batch_ack": "messages", **lane},
            {"name": "in-tcp", "kind": "tcp", "port": ports["tcp"], **lane},
            {"name": "in-http", "kind": "http", "port": ports["http"], **lane},
            {
                "name": "in-file",
                "kind": "file",
                "directory": str(drop),
                "archive": str(archive),
                "error_directory": str(errors),
                "poll_seconds": 0.1,
                **lane,
            },
        ],
    ).start()
    try:
        for port in ports.values():
            wait_for(lambda port=port: port_open(port), timeout=20, what="bind")
        d.ports, d.drop, d.errors, d.archive = ports, drop, errors, archive
        yield d
    finally:
        assert d.stop() == 0


def rows(store_config: StoreConfig, sql: str) -> list[dict]:
    store = Store(store_config)
    try:
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(sql)
            return [dict(r) for r in cur.fetchall()]
    finally:
        store.close()


def test_a_batch_on_every_transport_becomes_its_messages_each_staged_naming_its_batch(listenerd, store_config):
    d = listenerd
    one_ack = hl7.parse(over_mllp(d.ports["mllp"], GOOD))
    assert str(one_ack.segment("MSH")(9)) == "ACK" and str(one_ack.segment("MSH")(5)) == "SEND"
    assert (str(one_ack.segment("MSA")(1)), str(one_ack.segment("MSA")(2))) == ("AA", "B-1")  # MSA-2: BHS-11

    each = over_mllp(d.ports["each"], GOOD).split("\r")
    assert each[0].startswith("BHS|^~\\&|RECV|RFAC|SEND|FAC|") and each[0].endswith("|B-1")  # BHS-12: theirs
    assert [s for s in each if s.startswith("MSA")] == ["MSA|AA|M1", "MSA|AA|M2", "MSA|AA|M3"]
    assert each[-1] == "BTS|3"

    tcp = over_tcp(d.ports["tcp"], GOOD)
    assert tcp.startswith("ACK ") and tcp.endswith(" (3 messages)")
    status, body = post_message(d.ports["http"], "in-http", GOOD)
    assert status == 202 and len(body["message_ids"]) == 3
    assert over_file(d.drop, d.errors, d.archive, GOOD, "batch.hl7") == "archived"

    staged = rows(
        store_config,
        "SELECT id, message_id, connection, control_id, lane_key, batch_id, batch_seq FROM stage_inbound ORDER BY id",
    )
    connections = ["in-mllp", "in-each", "in-tcp", "in-http", "in-file"]
    assert [(r["connection"], r["control_id"], r["lane_key"], r["batch_seq"]) for r in staged] == [
        (c, m, p, n) for c in connections for n, (m, p) in enumerate((("M1", "P1"), ("M2", "P2"), ("M3", "P1")), 1)
    ]
    batches = rows(
        store_config,
        "SELECT batch_id, connection, fhs_control_id, bhs_control_id, declared_count, "
        "message_count FROM inbound_batches",
    )
    assert sorted(
        (b["connection"], b["fhs_control_id"], b["bhs_control_id"], b["declared_count"], b["message_count"])
        for b in batches
    ) == sorted((c, "F-1", "B-1", 3, 3) for c in connections)
    by_connection = {b["connection"]: b["batch_id"] for b in batches}
    assert all(r["batch_id"] == by_connection[r["connection"]] for r in staged)
    assert tcp == f"ACK {by_connection['in-tcp']} (3 messages)" and body["batch_id"] == by_connection["in-http"]
    events = rows(store_config, "SELECT message_id, event, detail FROM message_events ORDER BY id")
    assert [(e["message_id"], e["event"], e["detail"]) for e in events] == [
        (r["message_id"], "received", f"batch {r['batch_id']}: message {r['batch_seq']} of 3") for r in staged
    ]


BAD_BYTES = {
    "malformed MSH-2": (
        message("X1", "P1", enc="^~").encode(),
        "bad_encoding_characters: MSH-2 must be 4 or 5 characters",
    ),
    "trailer count": (
        batch(message("M1", "P1"), message("M2", "P2"), count=3),
        "batch trailer count BTS-1=3 but 2 messages",
    ),
    "bad message in a batch": (
        batch(message("M1", "P1"), message("M2", "P2", enc="^~"), message("M3", "P3")),
        "message 2 of 3: bad_encoding_characters: MSH-2 must be 4 or 5 characters",
    ),
    "MSH not first": (b"hello\r" + message("X2", "P1").encode(), "msh_not_first: MSH is not the first segment"),
}


def test_the_same_bad_bytes_get_the_same_verdict_on_every_transport_and_stage_nothing(listenerd, store_config):
    d = listenerd
    for n, (case, (data, reason)) in enumerate(BAD_BYTES.items()):
        verdicts = {
            "mllp": mllp_verdict(d.ports["mllp"], data).removeprefix("AR "),
            "tcp": over_tcp(d.ports["tcp"], data).removeprefix("NAK "),
            "http": http_verdict(d.ports["http"], data).removeprefix("400 "),
            "file": over_file(d.drop, d.errors, d.archive, data, f"bad{n}.hl7"),
        }
        assert verdicts == dict.fromkeys(verdicts, reason), case
    assert rows(store_config, "SELECT count(*) AS n FROM stage_inbound")[0]["n"] == 0
    assert rows(store_config, "SELECT count(*) AS n FROM inbound_batches")[0]["n"] == 0
    assert sorted(p.name for p in d.errors.iterdir()) == sorted(
        f"bad{n}.hl7{ext}" for n in range(len(BAD_BYTES)) for ext in ("", ".reason")
    )


def test_an_mllp_listener_without_a_batch_handler_refuses_a_batch_plainly() -> None:
    """A bare `MLLPFactory` (no batch handler wired) answers a batch with AR naming why, not the
    "msh_not_first" with ERR 207 a sender would read as our fault."""
    peer = IPv4Address("TCP", "127.0.0.1", 50000)
    proto = MLLPFactory(lambda *_: succeed(AckDecision.accept()), clock=MemoryReactorClock()).buildProtocol(peer)
    transport = StringTransport(peerAddress=peer)
    proto.makeConnection(transport)
    proto.dataReceived(frame(GOOD))
    msa = hl7.parse(transport.value().strip(b"\x0b\x1c\r").decode()).segment("MSA")
    assert (str(msa[1]), str(msa[3])) == ("AR", "batches are not accepted on this connection")


def test_a_batch_over_the_frame_limit_is_refused_whole_and_the_connection_goes_on() -> None:
    class Ingest:
        """Commits at once; keeps what it was given."""

        def __init__(self) -> None:
            self.items: list[InboundBatch] = []

        def submit(self, item: InboundBatch) -> Deferred[str]:
            self.items.append(item)
            return succeed(item.message_id)

    conn, ingest = InboundConfig("in", "mllp"), Ingest()
    wiring = Wiring(ingest=ingest, metrics=Metrics(), reactor=MemoryReactorClock(), bound_ports={})
    factory = MLLPFactory(
        mllp_handler(conn, wiring, None),
        clock=wiring.reactor,
        config=MLLPConfig(max_message_bytes=200),
        batch_handler=mllp_batch_handler(conn, wiring, None),
    )
    peer = IPv4Address("TCP", "127.0.0.1", 50000)
    proto, transport = factory.buildProtocol(peer), StringTransport(peerAddress=peer)
    proto.makeConnection(transport)
    small = batch(message("S1", "P1"), files=None)
    proto.dataReceived(frame(GOOD) + frame(small))
    answers = [hl7.parse(a.strip(b"\x0b\r").decode()).segment("MSA") for a in transport.value().split(b"\x1c\r")[:-1]]
    assert [(str(m[1]), str(m[3]) if str(m[1]) != "AA" else str(m[2])) for m in answers] == [
        ("AR", f"batch too large: {len(GOOD)} bytes, limit 200"),
        ("AA", "B-1"),
    ]
    assert [i.control_id for b in ingest.items for i in b.items] == ["S1"] and not transport.disconnecting
