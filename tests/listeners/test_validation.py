"""One inbound validation path for every transport: decode, refuse what no store can hold (with a
reason safe to send back), compute the lane key, build the `Inbound` row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.testing import MemoryReactorClock, StringTransport

from listeners.connections_config import InboundConfig
from listeners.group_commit import Inbound
from listeners.hl7msg import HL7HeaderError, parse_header
from listeners.metrics import Metrics
from listeners.validation import PayloadRejected, build_inbound, lane_rule

PEER = IPv4Address("TCP", "127.0.0.1", 50000)
CONN = InboundConfig("in", "mllp", lane_key="PID-3.1", poll_seconds=1.0)


def adt(control_id: str, *, pid: str = "DOE^JANE", charset: str = "") -> bytes:
    header = f"MSH|^~\\&|SEND|FAC|RECV|RFAC|20240101||ADT^A01|{control_id}|P|2.5"
    if charset:
        header += "||||||" + charset
    return f"{header}\rPID|1||123||{pid}".encode("latin-1" if charset == "8859/1" else "utf-8")


def test_hl7_payload_gives_control_id_and_lane() -> None:
    item = build_inbound(adt("C9"), connection="c", charset="utf-8", lane_of=lambda text: text[-3:])
    assert (item.control_id, item.lane_key, item.charset, item.connection) == ("C9", "ANE", "utf-8", "c")
    assert item.payload == adt("C9").decode()


def test_non_hl7_payload_is_allowed_without_control_id() -> None:
    item = build_inbound(b'{"a": 1}', connection="c", charset="utf-8")
    assert (item.payload, item.control_id, item.lane_key) == ('{"a": 1}', None, None)


def test_msh18_charset_wins_over_the_connection_charset() -> None:
    data = adt("C1", pid="MÜLLER^JÖRG", charset="8859/1")
    item = build_inbound(data, connection="c", charset="utf-8")
    assert "MÜLLER" in item.payload and item.charset == "iso8859-1"


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\xff\xfe bad", "undecodable"),
        (b"a\x00b", "NUL"),
        (b"", "empty"),
    ],
)
def test_unstageable_bytes_are_rejected_with_a_safe_reason(data: bytes, reason: str) -> None:
    with pytest.raises(PayloadRejected, match=reason) as info:
        build_inbound(data, connection="c", charset="utf-8")
    assert "bad" not in str(info.value)


def test_failing_lane_of_refuses_the_message() -> None:
    def lane_of(text: str) -> str | None:
        raise KeyError(text)

    with pytest.raises(PayloadRejected, match="lane"):
        build_inbound(adt("C1"), connection="c", charset="utf-8", lane_of=lane_of)


def test_the_mllp_header_parse_is_reused_and_validated_like_any_other_input() -> None:
    """MLLP hands over its own complete parse; a NUL in it is refused exactly as on TCP/HTTP/file."""
    good = adt("M1")
    item = build_inbound(good, connection="m", charset="utf-8", header=parse_header(good))
    assert (item.payload, item.control_id, item.charset) == (good.decode(), "M1", "utf-8")
    bad = adt("M2", pid="DOE\x00JANE")
    reasons = []
    for header in (parse_header(bad), None):
        with pytest.raises(PayloadRejected) as info:
            build_inbound(bad, connection="m", charset="utf-8", header=header)
        reasons.append(str(info.value))
    assert reasons[0] == reasons[1] and "NUL" in reasons[0] and "DOE" not in reasons[0]


def test_an_overlong_control_id_is_refused_naming_the_limit() -> None:
    """Over 199 characters MSH-10 cannot be the stored key, and an ACK must not echo it: refused
    (it used to be staged with a NULL control_id while the AA echoed it whole; red team net 7)."""
    data = adt("X" * 250)
    with pytest.raises(PayloadRejected, match="control_id_too_long: MSH-10 is 250 characters, limit 199"):
        build_inbound(data, connection="c", charset="utf-8")
    with pytest.raises(HL7HeaderError):
        parse_header(data)
    assert build_inbound(adt("X" * 199), connection="c", charset="utf-8").control_id == "X" * 199


# -- every transport decides the same way ------------------------------------------------------
# The same bytes go through each transport's own framing and handover, in memory (MLLP as the
# daemon wires it, TCP, HTTP, file drop), with a fake ingest that records the row it is given. Each
# either stages the same row or refuses with the same reason (invariant 9, docs/invariants.md).


def _hl7(pid: str, *, charset: str = "", encoding: str = "utf-8") -> bytes:
    header = "MSH|^~\\&|SEND|FAC|RECV|RFAC|20240101||ADT^A01|T1|P|2.5" + ("||||||" + charset if charset else "")
    return f"{header}\rPID|1||{pid}||DOE^JANE".encode(encoding)


TRANSPORT_CASES = {
    "plain utf-8": (_hl7("123^^^H"), ("staged", "T1", "123", "utf-8")),
    "msh-18 wins": (_hl7("MÜLLER", charset="8859/1", encoding="latin-1"), ("staged", "T1", "MÜLLER", "iso8859-1")),
    "nul": (_hl7("12\x003"), ("refused", "message contains NUL characters (character offset 64)")),
    "undecodable": (
        _hl7("1~2").replace(b"1~2", b"1\xff2"),
        ("refused", "undecodable: byte offset 63 is not valid utf-8"),
    ),
    "lane key too long": (_hl7("9" * 250), ("refused", "lane key longer than 199 characters or not storable")),
    "no lane": (_hl7(""), ("staged", "T1", None, "utf-8")),
}


def _via_mllp(data: bytes) -> tuple[Any, ...]:
    from listeners.endpoints import Wiring, mllp_handler
    from listeners.mllp_listener import Message, MLLPDecoder, MLLPFactory, frame

    ingest = AutoIngest()
    wiring = Wiring(ingest=ingest, metrics=Metrics(), reactor=MemoryReactorClock(), bound_ports={})
    factory = MLLPFactory(mllp_handler(CONN, wiring, lane_rule(CONN.lane_key)), clock=wiring.reactor)
    proto = factory.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER)
    proto.makeConnection(transport)
    proto.dataReceived(frame(data))
    [ack] = [e for e in MLLPDecoder().feed(transport.value()) if isinstance(e, Message)]
    msa = ack.payload.split(b"\r")[1].decode().split("|")
    return _staged(ingest) if msa[1] == "AA" else ("refused", msa[3])


def _via_tcp(data: bytes) -> tuple[Any, ...]:
    from listeners.tcp import TCPFactory

    ingest = AutoIngest()
    factory = TCPFactory(ingest, CONN, lane_of=lane_rule(CONN.lane_key), clock=MemoryReactorClock())
    proto = factory.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER)
    proto.makeConnection(transport)
    proto.dataReceived(data + b"\n")
    reply = transport.value().decode().strip()
    return _staged(ingest) if reply.startswith("ACK ") else ("refused", reply.removeprefix("NAK "))


def _via_http(data: bytes) -> tuple[Any, ...]:
    from listeners.http_listener import make_inbound_site

    ingest = AutoIngest()
    http = InboundConfig(**{**CONN.__dict__, "kind": "http"})
    site = make_inbound_site(ingest, [http], lane_of=lane_rule(CONN.lane_key), reactor=MemoryReactorClock())
    channel = site.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER)
    channel.makeConnection(transport)
    channel.dataReceived(
        b"POST /messages/in HTTP/1.1\r\nHost: x\r\nContent-Type: application/hl7-v2\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    head, _, body = transport.value().partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return _staged(ingest) if status == 202 else ("refused", json.loads(body)["error"])


def _via_file(data: bytes, tmp_path: Path) -> tuple[Any, ...]:
    from listeners.filedrop import FileDrop

    ingest, clock = AutoIngest(), MemoryReactorClock()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "m.hl7").write_bytes(data)
    drop = FileDrop(
        ingest,
        InboundConfig(
            **{**CONN.__dict__, "kind": "file", "directory": str(tmp_path / "in"), "archive": str(tmp_path / "archive")}
        ),
        lane_of=lane_rule(CONN.lane_key),
        reactor=clock,
        run_blocking=lambda f, *a: maybeDeferred(f, *a),
    )
    drop.start()
    clock.advance(0)
    clock.advance(CONN.poll_seconds)  # stable across two polls: taken
    reason = tmp_path / "archive" / "rejected" / "m.hl7.reason"
    return ("refused", reason.read_text().splitlines()[0]) if reason.exists() else _staged(ingest)


@pytest.mark.parametrize("case", list(TRANSPORT_CASES))
def test_every_transport_stages_or_refuses_the_same_input_the_same_way(case: str, tmp_path: Path) -> None:
    data, expected = TRANSPORT_CASES[case]
    outcomes = {
        "mllp": _via_mllp(data),
        "tcp": _via_tcp(data),
        "http": _via_http(data),
        "file": _via_file(data, tmp_path),
    }
    assert outcomes == dict.fromkeys(outcomes, expected)


class AutoIngest:
    """Commits at once and keeps the rows it was given."""

    def __init__(self) -> None:
        self.items: list[Inbound] = []

    def submit(self, item: Inbound) -> Deferred[str]:
        self.items.append(item)
        return succeed(item.message_id)


def _staged(ingest: AutoIngest) -> tuple[Any, ...]:
    [item] = ingest.items
    assert item.payload.endswith("||DOE^JANE") and item.connection == "in"
    return ("staged", item.control_id, item.lane_key, item.charset)


def test_the_charset_column_is_one_form_whichever_transport_parsed_the_header() -> None:
    """MLLP hands its own header parse over, file/TCP/HTTP let build_inbound parse: both store the
    Python codec name (never the raw MSH-18 text)."""
    from listeners.validation import build_inbound as build

    data = "MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5||||||8859/1\rPID|1||P1||M\xfcller\r".encode("latin-1")
    mllp = build(data, connection="mllp", charset="UTF-8", header=parse_header(data, default_encoding="utf_8"))
    other = build(data, connection="file", charset="UTF-8")
    assert (mllp.charset, other.charset) == ("iso8859-1", "iso8859-1")
    assert mllp.payload == other.payload and "M\xfcller" in other.payload
