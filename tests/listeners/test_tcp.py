"""Raw TCP listener: unit tests over StringTransport/MemoryReactorClock with a hand-fired fake
ingest, and loopback tests against the real store and IngestWriter."""

from __future__ import annotations

import sqlite3
import struct
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import LogEvent, formatEvent
from twisted.python.failure import Failure
from twisted.trial import unittest as trial

from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from listeners.connections_config import InboundConfig
from listeners.group_commit import IngestWriter, NotLeader, StoreUnavailable
from listeners.metrics import Metrics
from listeners.tcp import (
    Frame,
    LengthDecoder,
    NewlineDecoder,
    Oversize,
    TCPFactory,
    TCPProtocol,
)
from tests.listeners.fakes import FakeIngest

PEER = IPv4Address("TCP", "10.1.2.3", 40123)


def adt(control_id: str, *, pid: str = "DOE^JANE", charset: str = "") -> bytes:
    header = f"MSH|^~\\&|SEND|FAC|RECV|RFAC|20240101||ADT^A01|{control_id}|P|2.5"
    if charset:
        header += "||||||" + charset
    return f"{header}\rPID|1||123||{pid}".encode("latin-1" if charset == "8859/1" else "utf-8")


def lp(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def config(**overrides: Any) -> InboundConfig:
    values: dict[str, Any] = {
        "name": "rawtcp",
        "kind": "tcp",
        "max_message_bytes": 64,
        "idle_timeout_seconds": 30.0,
        "max_connections": 2,
    }
    values.update(overrides)
    return InboundConfig(**values)


def make_factory(ingest: Any, clock: MemoryReactorClock | None = None, **overrides: Any) -> TCPFactory:
    kwargs = {
        k: overrides.pop(k) for k in ("lane_of", "max_in_flight", "reply_timeout_seconds", "metrics") if k in overrides
    }
    return TCPFactory(ingest, config(**overrides), clock=clock or MemoryReactorClock(), **kwargs)


def connect(factory: TCPFactory) -> tuple[TCPProtocol, StringTransport]:
    proto = factory.buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER)
    proto.makeConnection(transport)
    return proto, transport


def lines(transport: StringTransport) -> list[str]:
    return transport.value().decode().splitlines()


def frames(transport: StringTransport) -> list[str]:
    data, out = transport.value(), []
    while data:
        (n,) = struct.unpack(">I", data[:4])
        out.append(data[4 : 4 + n].decode())
        data = data[4 + n :]
    return out


# -- decoders ----------------------------------------------------------------------------------


def test_newline_decoder_strips_cr_and_ignores_empty_lines() -> None:
    dec = NewlineDecoder(max_message_bytes=64)
    assert dec.feed(b"one\r\n\n\r\ntwo\nthr") == [Frame(b"one"), Frame(b"two")]
    assert dec.feed(b"ee\n") == [Frame(b"three")]


def test_newline_decoder_events_do_not_depend_on_how_input_is_split() -> None:
    stream = b"a\r\nbb\n" + b"x" * 100 + b"\nccc\n"
    whole = NewlineDecoder(max_message_bytes=64).feed(stream)
    dec = NewlineDecoder(max_message_bytes=64)
    split = [e for i in range(len(stream)) for e in dec.feed(stream[i : i + 1])]
    assert whole == split == [Frame(b"a"), Frame(b"bb"), Oversize(100), Frame(b"ccc")]


def test_newline_decoder_memory_stays_bounded_while_discarding_an_oversize_line() -> None:
    dec = NewlineDecoder(max_message_bytes=64)
    for _ in range(1000):
        assert dec.feed(b"y" * 1000) == []
        assert dec.buffered_bytes <= 65
    assert dec.feed(b"\n") == [Oversize(1_000_000)]


def test_newline_decoder_allows_exactly_the_limit_plus_a_trailing_cr() -> None:
    dec = NewlineDecoder(max_message_bytes=4)
    assert dec.feed(b"abcd\r\nabcde\n") == [Frame(b"abcd"), Oversize(5)]


def test_length_decoder_handles_split_and_coalesced_frames() -> None:
    stream = lp(b"first") + lp(b"") + lp(b"third\nline")
    whole = LengthDecoder(max_message_bytes=64).feed(stream)
    dec = LengthDecoder(max_message_bytes=64)
    split = [e for i in range(len(stream)) for e in dec.feed(stream[i : i + 1])]
    assert whole == split == [Frame(b"first"), Frame(b""), Frame(b"third\nline")]


def test_length_decoder_stops_at_a_declared_length_over_the_limit() -> None:
    dec = LengthDecoder(max_message_bytes=64)
    assert dec.feed(struct.pack(">I", 65) + b"z" * 10) == [Oversize(65)]
    assert dec.feed(lp(b"later")) == []
    assert dec.buffered_bytes == 0


# -- protocol: newline framing -----------------------------------------------------------------


def test_ack_is_written_only_after_the_commit_fires() -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest))
    proto.dataReceived(b"hello\r\n")
    [(item, _)] = ingest.calls
    assert (item.payload, item.connection, item.charset) == ("hello", "rawtcp", "utf-8")
    assert transport.value() == b""
    ingest.fire(0)
    assert lines(transport) == [f"ACK {item.message_id}"]


def test_replies_keep_arrival_order_when_commits_fire_out_of_order() -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest))
    proto.dataReceived(b"m1\nm2\nm3\nm4\n")
    ids = [item.message_id for item, _ in ingest.calls]
    ingest.fire(2)
    ingest.fail(3, StoreUnavailable("down"))
    assert transport.value() == b""
    ingest.fire(0)
    assert lines(transport) == [f"ACK {ids[0]}"]
    ingest.fire(1)
    assert lines(transport) == [
        f"ACK {ids[0]}",
        f"ACK {ids[1]}",
        f"ACK {ids[2]}",
        "NAK store unavailable, resend later",
    ]
    assert proto.in_flight == 0


@pytest.mark.parametrize(
    "exc, reply",
    [
        (NotLeader("x"), "NAK not leader, resend later"),
        (StoreUnavailable("x"), "NAK store unavailable, resend later"),
        (RuntimeError("secret PHI"), "NAK internal error, resend later"),
    ],
)
def test_errback_yields_nak_and_the_connection_stays_usable(exc: Exception, reply: str) -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest))
    proto.dataReceived(b"m1\n")
    ingest.fail(0, exc)
    proto.dataReceived(b"m2\n")
    ingest.fire(1)
    assert lines(transport) == [reply, f"ACK {ingest.calls[1][0].message_id}"]
    assert not transport.disconnecting


def test_byte_by_byte_and_coalesced_input_give_the_same_messages() -> None:
    ingest = FakeIngest()
    proto, _ = connect(make_factory(ingest))
    for b in b"alpha\r\nbeta\n":
        proto.dataReceived(bytes([b]))
    proto.dataReceived(b"gamma\ndelta\r\n")
    assert [item.payload for item, _ in ingest.calls] == ["alpha", "beta", "gamma", "delta"]


def test_undecodable_line_gets_a_nak_in_order_and_nothing_is_submitted() -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest))
    proto.dataReceived(b"ok\n\xff\xfe\n")
    assert len(ingest.calls) == 1
    assert transport.value() == b""  # the NAK waits behind the first reply
    ingest.fire(0)
    assert lines(transport)[1].startswith("NAK undecodable: byte offset 0 is not valid utf-8")


def test_oversize_line_is_discarded_up_to_its_newline_then_nak_and_close() -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest, max_message_bytes=16))
    proto.dataReceived(b"first\n" + b"x" * 40)
    assert not transport.disconnecting  # still discarding: waits for the newline
    proto.dataReceived(b"x" * 40 + b"\nafter\n")
    assert len(ingest.calls) == 1
    ingest.fire(0)
    assert lines(transport)[1] == "NAK message too large: 80 bytes, limit 16"
    assert transport.disconnecting


def test_hl7_message_carries_msh10_as_control_id() -> None:
    ingest = FakeIngest()
    proto, _ = connect(make_factory(ingest, max_message_bytes=1024, lane_of=lambda t: "L1"))
    proto.dataReceived(adt("CTRL-7") + b"\n")
    [(item, _)] = ingest.calls
    assert (item.control_id, item.lane_key) == ("CTRL-7", "L1")


# -- protocol: length framing ------------------------------------------------------------------


def test_length_framing_replies_length_prefixed_in_order() -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest, framing="length"))
    data = lp(b"one") + lp(b"two\nlines") + lp(b"")
    proto.dataReceived(data[:5])
    proto.dataReceived(data[5:])
    assert [item.payload for item, _ in ingest.calls] == ["one", "two\nlines"]
    ingest.fire(1)
    ingest.fire(0)
    ids = [item.message_id for item, _ in ingest.calls]
    assert frames(transport) == [f"ACK {ids[0]}", f"ACK {ids[1]}", "NAK empty message"]


def test_length_framing_oversize_declared_length_naks_and_closes_without_reading() -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest, framing="length"))
    proto.dataReceived(lp(b"ok") + struct.pack(">I", 1_000_000) + b"partial")
    assert len(ingest.calls) == 1
    ingest.fail(0, NotLeader("x"))
    assert frames(transport) == ["NAK not leader, resend later", "NAK message too large: 1000000 bytes, limit 64"]
    assert transport.disconnecting


# -- connection management ---------------------------------------------------------------------


def test_idle_connection_is_closed_by_the_clock() -> None:
    clock = MemoryReactorClock()
    _, transport = connect(make_factory(FakeIngest(), clock))
    clock.advance(29)
    assert not transport.disconnecting
    clock.advance(2)
    assert transport.disconnecting


def test_idle_timeout_waits_while_a_reply_is_pending_then_restarts() -> None:
    clock = MemoryReactorClock()
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest, clock, reply_timeout_seconds=None))
    proto.dataReceived(b"m\n")
    clock.advance(100)
    assert not transport.disconnecting
    ingest.fire(0)
    clock.advance(29)
    assert not transport.disconnecting
    clock.advance(2)
    assert transport.disconnecting


def test_reply_timeout_answers_nak_and_ignores_the_late_commit() -> None:
    clock = MemoryReactorClock()
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest, clock, reply_timeout_seconds=5))
    proto.dataReceived(b"m\n")
    clock.advance(6)
    assert lines(transport) == ["NAK not confirmed stored in time, resend it (recognised, never stored twice)"]
    ingest.fire(0)
    assert lines(transport) == ["NAK not confirmed stored in time, resend it (recognised, never stored twice)"]


def test_max_connections_closes_extra_connections_at_once() -> None:
    factory = make_factory(FakeIngest(), max_connections=2)
    conns = [connect(factory) for _ in range(3)]
    assert [t.disconnecting for _, t in conns] == [False, False, True]
    assert factory.active_connections == 2
    conns[0][0].connectionLost(Failure(Exception("gone")))
    assert factory.active_connections == 1
    assert not connect(factory)[1].disconnecting


def test_disconnect_all_aborts_every_connection() -> None:
    factory = make_factory(FakeIngest())
    conns = [connect(factory) for _ in range(2)]
    factory.disconnect_all()
    assert all(t.disconnecting for _, t in conns)


def test_reading_pauses_above_max_in_flight_and_resumes_when_answered() -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest, max_in_flight=3))
    proto.dataReceived(b"a\nb\n")
    assert transport.producerState == "producing"
    proto.dataReceived(b"c\n")
    assert transport.producerState == "paused"
    ingest.fire(0)
    assert transport.producerState == "producing"


def test_late_commit_after_connection_loss_writes_nothing() -> None:
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest))
    proto.dataReceived(b"m\n")
    proto.connectionLost(Failure(Exception("gone")))
    transport.clear()
    ingest.fire(0)
    assert transport.value() == b""


def test_metrics_count_received_and_acks() -> None:
    ingest, metrics = FakeIngest(), Metrics()
    proto, _ = connect(make_factory(ingest, metrics=metrics))
    proto.dataReceived(b"a\n\xff\n")
    ingest.fire(0)
    assert metrics.received.labels("rawtcp")._value.get() == 2
    assert metrics.acks.labels("rawtcp", "AA")._value.get() == 1
    assert metrics.acks.labels("rawtcp", "AR")._value.get() == 1
    assert metrics.connections.labels("rawtcp")._value.get() == 1


def test_logs_never_contain_message_bodies(logs: list[LogEvent]) -> None:
    ingest = FakeIngest()
    proto, _ = connect(make_factory(ingest, max_message_bytes=40, max_connections=1))
    connect(proto.factory)  # refused: logs a warning
    proto.dataReceived(b"SECRET-PHI-1\n\xffSECRET-PHI-2\n")
    ingest.fail(0, RuntimeError("SECRET-PHI-1"))
    proto.dataReceived(b"SECRET-PHI-3" * 10 + b"\n")
    text = " ".join(formatEvent(e) for e in logs)
    assert logs and "SECRET" not in text


# -- loopback against the real store -----------------------------------------------------------


class _Client(Protocol):
    """Collects replies of either framing and fires waiters once enough have arrived."""

    def __init__(self, framing: str) -> None:
        self.framing = framing
        self.buf = b""
        self.replies: list[str] = []
        self._waiters: list[tuple[int, Deferred[list[str]]]] = []
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.framing == "newline":
                line, sep, rest = self.buf.partition(b"\n")
                if not sep:
                    break
                self.replies.append(line.decode())
                self.buf = rest
            else:
                if len(self.buf) < 4:
                    break
                (n,) = struct.unpack(">I", self.buf[:4])
                if len(self.buf) < 4 + n:
                    break
                self.replies.append(self.buf[4 : 4 + n].decode())
                self.buf = self.buf[4 + n :]
        for n, d in list(self._waiters):
            if len(self.replies) >= n:
                self._waiters.remove((n, d))
                d.callback(self.replies[:n])

    def wait_for(self, n: int) -> Deferred[list[str]]:
        if len(self.replies) >= n:
            return succeed(self.replies[:n])
        d: Deferred[list[str]] = Deferred()
        self._waiters.append((n, d))
        return d

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.closed.callback(None)


class _ObservedFactory(TCPFactory):
    """Tells the test when the server side of every connection is gone (clean reactor)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.all_closed: Deferred[None] | None = None

    def unregister(self, proto: TCPProtocol) -> None:
        super().unregister(proto)
        if not self.active_connections and self.all_closed is not None:
            d, self.all_closed = self.all_closed, None
            d.callback(None)

    def wait_closed(self) -> Deferred[None]:
        if not self.active_connections:
            return succeed(None)
        self.all_closed = Deferred()
        return self.all_closed


def rows(path: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as db:
        return db.execute(
            "SELECT message_id, control_id, connection, payload, lane_key FROM inbound_messages ORDER BY id"
        ).fetchall()


class TCPLoopbackTests(trial.TestCase):
    """Real sockets, the real IngestWriter and a migrated SQLite store."""

    @pytest.fixture(autouse=True)
    def _store(self, sqlite_config_fresh: StoreConfig) -> None:
        self.store_config = sqlite_config_fresh

    def _serve(self, **overrides: Any) -> tuple[_ObservedFactory, int]:
        store = Store(self.store_config)
        self.addCleanup(store.close)
        epoch = acquire_permanent(store, node_id="n")
        writer = IngestWriter(store, node_id="n", epoch=lambda: epoch, metrics=Metrics(), reactor=reactor)
        writer.start()
        self.addCleanup(writer.stop)
        factory = _ObservedFactory(
            writer,
            config(max_message_bytes=4096, **overrides),
            lane_of=lambda text: "LANE" if text.startswith("MSH") else None,
        )
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return factory, port.getHost().port

    @inlineCallbacks
    def _client(self, port: int, framing: str) -> Any:
        client = _Client(framing)
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)
        return client

    @inlineCallbacks
    def _close(self, client: _Client, factory: _ObservedFactory) -> Any:
        closed = factory.wait_closed()
        client.transport.loseConnection()
        yield client.closed
        yield closed

    @inlineCallbacks
    def test_newline_messages_are_acked_after_their_rows_are_committed(self) -> Any:
        factory, port = self._serve()
        client = yield self._client(port, "newline")
        client.transport.write(adt("C1") + b"\r\nplain text\n\n\xff\n")
        replies = yield client.wait_for(3)
        assert replies[0].startswith("ACK ") and replies[1].startswith("ACK ")
        assert replies[2].startswith("NAK undecodable")
        staged = rows(self.store_config.path)
        assert staged == [
            (replies[0][4:], "C1", "rawtcp", adt("C1").decode(), "LANE"),
            (replies[1][4:], None, "rawtcp", "plain text", None),
        ]
        yield self._close(client, factory)

    @inlineCallbacks
    def test_length_framed_oversize_closes_after_answering_earlier_messages(self) -> Any:
        factory, port = self._serve(framing="length")
        client = yield self._client(port, "length")
        client.transport.write(lp(b"one") + lp(b"two") + struct.pack(">I", 10_000))
        replies = yield client.wait_for(3)
        yield client.closed
        assert [r[:3] for r in replies] == ["ACK", "ACK", "NAK"]
        assert [r[0] for r in rows(self.store_config.path)] == [replies[0][4:], replies[1][4:]]
        yield factory.wait_closed()

    @inlineCallbacks
    def test_not_leader_is_answered_with_nak_and_nothing_is_staged(self) -> Any:
        store = Store(self.store_config)
        self.addCleanup(store.close)
        writer = IngestWriter(store, node_id="n", epoch=lambda: None, metrics=Metrics(), reactor=reactor)
        writer.start()
        self.addCleanup(writer.stop)
        factory = _ObservedFactory(writer, config())
        listening = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        client = yield self._client(listening.getHost().port, "newline")
        client.transport.write(b"hello\n")
        assert (yield client.wait_for(1)) == ["NAK not leader, resend later"]
        assert rows(self.store_config.path) == []
        yield self._close(client, factory)


def test_a_clean_stop_reads_nothing_more_but_still_answers_what_was_read() -> None:
    ingest = FakeIngest()
    factory = make_factory(ingest)
    proto, transport = connect(factory)
    proto.dataReceived(b"a\n")
    factory.stop_reading()
    assert transport.producerState == "paused"
    proto.dataReceived(b"b\n")
    assert len(ingest.calls) == 1
    ingest.fire(0)
    assert lines(transport) == [f"ACK {ingest.calls[0][0].message_id}"]
    assert transport.producerState == "paused"
    factory.close_all()
    assert transport.disconnecting


def test_crlf_segments_with_newline_framing_get_a_nak_for_the_bare_segment_line() -> None:
    """A sender ending segments with CRLF on a newline-framed connection splits each message into
    lines: the PID line alone is not stored as an opaque message with an ACK, it gets a NAK naming
    the likely cause (issue 23, red team network item 7)."""
    ingest = FakeIngest()
    proto, transport = connect(make_factory(ingest, max_message_bytes=1024))
    proto.dataReceived(adt("CRLF1").replace(b"\r", b"\r\n") + b"\r\n")
    assert len(ingest.calls) == 1  # the MSH line (a message of one segment); the PID line is refused
    ingest.fire(0)
    nak = lines(transport)[1]
    assert nak.startswith("NAK starts with an HL7 PID segment but no MSH"), nak
    assert "123" not in nak and "DOE" not in nak


def test_opaque_lines_that_are_not_hl7_segments_are_still_staged() -> None:
    ingest = FakeIngest()
    proto, _ = connect(make_factory(ingest, max_message_bytes=1024))
    proto.dataReceived(b"ABC|1|2\nhello\n")
    assert len(ingest.calls) == 2
