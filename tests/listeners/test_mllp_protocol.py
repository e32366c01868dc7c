"""MLLPProtocol/MLLPFactory over StringTransport and MemoryReactorClock: no sockets, no sleeps."""

from __future__ import annotations

import gc

import hl7
import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IAddress
from twisted.internet.testing import (
    MemoryReactorClock,
    StringTransport,
    StringTransportWithDisconnection,
)
from twisted.logger import LogEvent, formatEvent
from twisted.python.failure import Failure

from listeners.hl7ack import AckDecision
from listeners.mllp_listener import (
    Message,
    MLLPConfig,
    MLLPDecoder,
    MLLPFactory,
    MLLPProtocol,
    frame,
)

PEER = IPv4Address("TCP", "10.1.2.3", 40123)


def adt(control_id: str, *, pid: str = "DOE^JANE", charset: str = "") -> bytes:
    header = f"MSH|^~\\&|SENDAPP|SENDFAC|RECVAPP|RECVFAC|20240101||ADT^A01^ADT_A01|{control_id}|P|2.5"
    if charset:
        header += "||||||" + charset
    return f"{header}\rPID|1||123||{pid}\r".encode()


class Recorder:
    """A handler whose Deferreds the test fires by hand, in any order."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, IAddress, Deferred[AckDecision]]] = []

    def __call__(self, message: bytes, peer: IAddress, header: object = None) -> Deferred[AckDecision]:
        d: Deferred[AckDecision] = Deferred()
        self.calls.append((message, peer, d))
        return d

    def fire(self, index: int, decision: AckDecision | None = None) -> None:
        self.calls[index][2].callback(decision or AckDecision.accept())


def make_factory(handler: object, clock: MemoryReactorClock | None = None, **config: object) -> MLLPFactory:
    return MLLPFactory(
        handler,  # type: ignore[arg-type]
        config=MLLPConfig(**config),  # type: ignore[arg-type]
        clock=clock or MemoryReactorClock(),
    )


def connect(factory: MLLPFactory, *, disconnecting: bool = False) -> tuple[MLLPProtocol, StringTransport]:
    proto = factory.buildProtocol(PEER)
    transport: StringTransport
    if disconnecting:
        transport = StringTransportWithDisconnection(peerAddress=PEER)
        transport.protocol = proto
    else:
        transport = StringTransport(peerAddress=PEER)
    proto.makeConnection(transport)
    return proto, transport


def acks(transport: StringTransport, encoding: str = "utf-8") -> list[hl7.Message]:
    events = MLLPDecoder().feed(transport.value())
    assert all(isinstance(e, Message) for e in events)
    return [hl7.parse(e.payload, encoding=encoding) for e in events if isinstance(e, Message)]


def msa(ack: hl7.Message) -> tuple[str, str]:
    segment = ack.segment("MSA")
    return str(segment[1]), str(segment[2])


def test_handler_gets_the_exact_message_and_the_peer() -> None:
    handler = Recorder()
    proto, _ = connect(make_factory(handler))
    proto.dataReceived(frame(adt("C1")))
    assert [(m, p) for m, p, _ in handler.calls] == [(adt("C1"), PEER)]


def test_aa_is_written_only_after_the_handler_says_so() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("C1")))
    assert transport.value() == b""
    handler.fire(0)
    [ack] = acks(transport)
    assert msa(ack) == ("AA", "C1")


def test_ack_swaps_sender_and_receiver_and_echoes_msh10_in_msa2() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("MSG-0042")))
    handler.fire(0)
    [ack] = acks(transport)
    msh = ack.segment("MSH")
    assert [str(msh[i]) for i in (3, 4, 5, 6)] == ["RECVAPP", "RECVFAC", "SENDAPP", "SENDFAC"]
    assert str(msh[9]) == "ACK^A01^ACK"
    assert msa(ack) == ("AA", "MSG-0042")


def test_configured_identity_is_used_as_ack_sender() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler, sending_application="STAGELINE", sending_facility="NODE1"))
    proto.dataReceived(frame(adt("C1")))
    handler.fire(0)
    msh = acks(transport)[0].segment("MSH")
    assert (str(msh[3]), str(msh[4]), str(msh[5])) == ("STAGELINE", "NODE1", "SENDAPP")


def test_fragmented_byte_by_byte_input_is_handled_once() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    for b in frame(adt("C1")):
        proto.dataReceived(bytes([b]))
    assert len(handler.calls) == 1
    handler.fire(0)
    assert [msa(a) for a in acks(transport)] == [("AA", "C1")]


def test_pipelined_acks_are_written_in_arrival_order_when_deferreds_fire_out_of_order() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(b"".join(frame(adt(f"C{i}")) for i in range(1, 5)))
    assert len(handler.calls) == 4
    handler.fire(2)
    handler.fire(3)
    assert transport.value() == b""  # C1 still pending: nothing may overtake it
    handler.fire(0)
    assert [msa(a) for a in acks(transport)] == [("AA", "C1")]
    handler.fire(1)
    assert [msa(a)[1] for a in acks(transport)] == ["C1", "C2", "C3", "C4"]
    assert proto.in_flight == 0


def test_handler_errback_yields_ae_and_the_connection_stays_usable(
    logs: list[LogEvent],
) -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("C1")))
    handler.calls[0][2].errback(RuntimeError("database is down"))
    proto.dataReceived(frame(adt("C2")))
    handler.fire(1)
    assert [msa(a) for a in acks(transport)] == [("AE", "C1"), ("AA", "C2")]
    assert not transport.disconnecting
    gc.collect()
    assert not [e for e in logs if e.get("isError") or "log_failure" in e]


@pytest.mark.parametrize(
    "handler",
    [
        pytest.param(lambda m, p, h: fail(ValueError("boom")), id="failed-deferred"),
        pytest.param(lambda m, p, h: 1 / 0, id="raises-synchronously"),
        pytest.param(lambda m, p, h: succeed(True), id="returns-true"),
        pytest.param(lambda m, p, h: succeed(None), id="returns-none"),
        pytest.param(lambda m, p, h: succeed("AA"), id="returns-string-AA"),
    ],
)
def test_anything_but_an_explicit_aa_decision_is_never_acked_aa(handler: object) -> None:
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("C1")))
    assert [msa(a) for a in acks(transport)] == [("AE", "C1")]


def test_handler_reject_and_error_decisions_are_passed_on_with_reason() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("C1")) + frame(adt("C2")))
    handler.fire(0, AckDecision.reject("unknown sender", error_code="103"))
    handler.fire(1, AckDecision.error("duplicate|key"))
    first, second = acks(transport)
    assert msa(first) == ("AR", "C1")
    assert str(first.segment("ERR")[3]) == "103^Table value not found^HL70357"
    assert msa(second) == ("AE", "C2")
    assert second.unescape(str(second.segment("ERR")[8])) == "duplicate|key"


def test_synchronous_handler_is_acked_immediately() -> None:
    proto, transport = connect(make_factory(lambda m, p, h: succeed(AckDecision.accept())))
    proto.dataReceived(frame(adt("C1")) + frame(adt("C2")))
    assert [msa(a) for a in acks(transport)] == [("AA", "C1"), ("AA", "C2")]


def test_unparseable_header_yields_ar_without_calling_the_handler() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler, sending_application="STAGELINE"))
    proto.dataReceived(frame(b"PID|1||123\r") + frame(b"MSH|^^\\&|A|B|C|D|||ADT|C9\r"))
    assert handler.calls == []
    first, second = acks(transport)
    assert msa(first) == ("AR", "")
    assert str(first.segment("ERR")[8]).startswith("no_msh")
    assert str(first.segment("MSH")[3]) == "STAGELINE"
    assert msa(second) == ("AR", "C9")  # MSH-2 is malformed, but MSH-10 is readable: the AR names it
    assert str(second.segment("ERR")[8]).startswith("duplicate_encoding_characters")
    proto.dataReceived(frame(adt("C3")))
    handler.fire(0)
    assert msa(acks(transport)[2]) == ("AA", "C3")


def test_header_errors_queue_behind_pending_acks() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("C1")) + frame(b"not hl7") + frame(adt("C3")))
    assert transport.value() == b""
    handler.fire(1)
    handler.fire(0)
    assert [msa(a) for a in acks(transport)] == [("AA", "C1"), ("AR", ""), ("AA", "C3")]


def test_missing_control_id_is_rejected() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(b"MSH|^~\\&|A|B|C|D|||ADT^A01||P|2.5\r"))
    [ack] = acks(transport)
    assert msa(ack) == ("AR", "")
    assert str(ack.segment("ERR")[8]).startswith("missing_control_id")
    assert handler.calls == []


def test_garbage_between_frames_is_never_handed_over_or_acked() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(b"hello\r\n" + frame(adt("C1")) + b"MSH|^~\\&|X|Y|||||ADT|C2\r")
    assert [m for m, _, _ in handler.calls] == [adt("C1")]
    handler.fire(0)
    assert [msa(a) for a in acks(transport)] == [("AA", "C1")]


def test_oversize_message_with_readable_header_gets_ar_and_is_not_handed_over() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler, max_message_bytes=512, prefix_bytes=128))
    big = adt("BIG1") + b"OBX|1|ED|||" + b"A" * 10_000 + b"\r"
    stream = frame(adt("C1")) + frame(big) + frame(adt("C3"))
    for i in range(0, len(stream), 1000):
        proto.dataReceived(stream[i : i + 1000])
    assert [m for m, _, _ in handler.calls] == [adt("C1"), adt("C3")]
    handler.fire(0)
    handler.fire(1)
    results = acks(transport)
    assert [msa(a) for a in results] == [("AA", "C1"), ("AR", "BIG1"), ("AA", "C3")]
    assert "too large" in str(results[1].segment("ERR")[8])
    assert not transport.disconnecting


def test_oversize_message_with_unreadable_header_gets_ar_and_the_connection_goes_on() -> None:
    """The frame ended at its FS, so the sender is told (AR, 207, "too large" and why the header
    could not be read) and its next frame is handled as usual."""
    handler = Recorder()
    proto, transport = connect(make_factory(handler, max_message_bytes=256), disconnecting=True)
    proto.dataReceived(frame(adt("C1")) + frame(b"x" * 1000) + frame(adt("C3")))
    assert [m for m, _, _ in handler.calls] == [adt("C1"), adt("C3")]
    handler.fire(0)
    handler.fire(1)
    results = acks(transport)
    assert [msa(a) for a in results] == [("AA", "C1"), ("AR", ""), ("AA", "C3")]
    err = results[1].segment("ERR")
    assert str(err[3]) == "207^Application internal error^HL70357"
    assert str(err[8]) == "message too large: 1000 bytes, limit 256; header no_msh: no MSH segment"
    assert transport.connected


def test_idle_connection_is_closed_by_the_clock() -> None:
    clock = MemoryReactorClock()
    handler = Recorder()
    proto, transport = connect(make_factory(handler, clock, idle_timeout_seconds=30))
    clock.advance(29)
    proto.dataReceived(b"\r\n")  # any traffic counts as activity
    clock.advance(29)
    assert not transport.disconnecting
    clock.advance(1.5)
    assert transport.disconnecting


def test_idle_timeout_waits_while_messages_are_in_flight() -> None:
    clock = MemoryReactorClock()
    handler = Recorder()
    proto, transport = connect(make_factory(handler, clock, idle_timeout_seconds=10, handler_timeout_seconds=None))
    proto.dataReceived(frame(adt("C1")))
    clock.advance(100)
    assert not transport.disconnecting  # the sender is waiting on us, not idle
    handler.fire(0)
    assert [msa(a) for a in acks(transport)] == [("AA", "C1")]
    clock.advance(10)
    assert transport.disconnecting


def test_idle_timer_restarts_when_the_last_ack_is_written() -> None:
    clock = MemoryReactorClock()
    handler = Recorder()
    proto, transport = connect(make_factory(handler, clock, idle_timeout_seconds=10, handler_timeout_seconds=None))
    proto.dataReceived(frame(adt("C1")))
    clock.advance(9.5)
    handler.fire(0)  # a slow store: the sender has been silent for 9.5 s, waiting on us
    clock.advance(9)
    assert not transport.disconnecting
    clock.advance(1)
    assert transport.disconnecting


def test_a_batch_counts_its_messages_against_max_in_flight() -> None:
    """One frame holding a batch of 100 messages owes 100 answers: reading pauses until it is
    answered (before, it counted one, whatever its size)."""
    answers: list[Deferred[bytes]] = []

    def batch_handler(data: bytes, peer: IAddress) -> Deferred[bytes]:
        answers.append(Deferred())
        return answers[-1]

    factory = MLLPFactory(
        Recorder(), config=MLLPConfig(max_in_flight=64), clock=MemoryReactorClock(), batch_handler=batch_handler
    )
    proto, transport = connect(factory)
    body = b"".join(adt(f"M{k}") for k in range(100))
    proto.dataReceived(frame(b"BHS|^~\\&|A|B|C|D|||||B1\r" + body + b"BTS|100\r"))
    assert transport.producerState == "paused"
    answers[0].callback(frame(b"MSH|^~\\&|C|D|A|B|||ACK|1|P|2.5\rMSA|AA|B1\r")[1:-2])
    assert transport.producerState == "producing"


def test_a_handler_timeout_says_not_confirmed_rather_than_not_stored() -> None:
    clock = MemoryReactorClock()
    proto, transport = connect(make_factory(Recorder(), clock, handler_timeout_seconds=5))
    proto.dataReceived(frame(adt("C1")))
    clock.advance(5)
    [ack] = acks(transport)
    assert msa(ack) == ("AE", "C1") and "not confirmed stored in time" in str(ack.segment("ERR") or ack)


def test_handler_timeout_answers_ae_and_ignores_the_late_result(logs: list[LogEvent]) -> None:
    clock = MemoryReactorClock()
    handler = Recorder()
    proto, transport = connect(make_factory(handler, clock, handler_timeout_seconds=5))
    proto.dataReceived(frame(adt("C1")) + frame(adt("C2")))
    handler.fire(1)
    clock.advance(5)
    assert [msa(a) for a in acks(transport)] == [("AE", "C1"), ("AA", "C2")]
    handler.fire(0)  # cancelled Deferred: a late success is swallowed, no second ACK
    assert len(acks(transport)) == 2
    assert len(clock.getDelayedCalls()) == 1  # only the idle timer is left
    gc.collect()
    assert not [e for e in logs if "log_failure" in e]  # the CancelledError was consumed


def test_each_message_gets_its_own_handler_timeout_counted_from_its_arrival() -> None:
    clock = MemoryReactorClock()
    handler = Recorder()
    proto, transport = connect(make_factory(handler, clock, handler_timeout_seconds=5))
    proto.dataReceived(frame(adt("C1")))
    clock.advance(2)
    proto.dataReceived(frame(adt("C2")) + frame(adt("C3")))
    handler.fire(2)
    clock.advance(3)  # t=5: C1 is overdue, C2 has 2 s left, C3 waits behind it
    assert [msa(a) for a in acks(transport)] == [("AE", "C1")]
    clock.advance(1.9)
    assert len(acks(transport)) == 1
    clock.advance(0.1)  # t=7: C2 is overdue; C3's AA follows it
    assert [msa(a) for a in acks(transport)] == [("AE", "C1"), ("AE", "C2"), ("AA", "C3")]
    assert len(clock.getDelayedCalls()) == 1  # only the idle timer is left


def test_max_connections_closes_extra_connections_at_once() -> None:
    handler = Recorder()
    factory = make_factory(handler, max_connections=2)
    first, _ = connect(factory)
    connect(factory)
    third, third_transport = connect(factory)
    assert third_transport.disconnecting
    assert factory.active_connections == 2
    third.dataReceived(frame(adt("C1")))
    assert handler.calls == []
    third.connectionLost(Failure(ConnectionDone()))
    assert factory.active_connections == 2
    first.connectionLost(Failure(ConnectionDone()))
    assert factory.active_connections == 1
    _, fourth_transport = connect(factory)
    assert not fourth_transport.disconnecting


def test_disconnect_all_aborts_every_connection() -> None:
    factory = make_factory(Recorder())
    transports = [connect(factory)[1] for _ in range(3)]
    factory.disconnect_all()
    # StringTransport.abortConnection sets "disconnected" (its docstring says "aborted").
    assert all(t.disconnecting and t.disconnected for t in transports)


def test_late_results_after_connection_loss_write_nothing() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("C1")))
    proto.connectionLost(Failure(ConnectionDone()))
    handler.fire(0)
    assert transport.value() == b""


def test_reading_pauses_when_too_many_messages_are_in_flight() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler, max_in_flight=2))
    proto.dataReceived(frame(adt("C1")))
    assert transport.producerState == "producing"
    proto.dataReceived(frame(adt("C2")))
    assert transport.producerState == "paused"
    handler.fire(0)
    assert transport.producerState == "producing"


def test_latin1_message_is_acked_in_latin1() -> None:
    text = "MSH|^~\\&|APP|Zürich|RCV|Genève|||ADT^A01|C-ü|P|2.5||||||8859/1\rPID|1||||Müller\r"
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(text.encode("latin-1")))
    handler.fire(0)
    raw = transport.value()
    assert "Genève".encode("latin-1") in raw and "Genève".encode() not in raw
    [ack] = acks(transport, encoding="latin-1")
    assert str(ack.segment("MSH")[4]) == "Genève"
    assert str(ack.segment("MSH")[6]) == "Zürich"
    assert str(ack.segment("MSH")[18]) == "8859/1"
    assert msa(ack) == ("AA", "C-ü")


def test_five_character_encoding_characters_are_kept_in_the_ack() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(b"MSH|^~\\&#|A|B|C|D|20240101||ADT^A04^ADT_A01|C5|P|2.7\r"))
    handler.fire(0, AckDecision.error("50# done"))
    raw = transport.value()
    assert raw.startswith(b"\x0bMSH|^~\\&#|C|D|A|B|")
    assert b"50\\P\\ done" in raw
    assert msa(acks(transport)[0]) == ("AE", "C5")


def test_logs_never_contain_message_bodies(logs: list[LogEvent]) -> None:
    secret = "SECRET-PATIENT-NAME"
    clock = MemoryReactorClock()
    handler = Recorder()
    proto, _ = connect(make_factory(handler, clock, max_message_bytes=300, idle_timeout_seconds=5))
    proto.dataReceived(
        frame(adt("C1", pid=secret))
        + secret.encode()
        + frame(b"PID|" + secret.encode())
        + frame(adt("C3", pid=secret * 40))
        + frame(adt("C4", pid=secret))
        + frame(adt("C5", pid=secret))
        + b"\x0b"
        + secret.encode()
    )
    handler.calls[0][2].errback(RuntimeError(f"insert failed for {secret}"))
    handler.fire(1, AckDecision.reject(f"bad {secret}"))
    handler.fire(2, b"not a decision")  # type: ignore[arg-type]
    proto.connectionLost(Failure(ConnectionDone()))
    clock.advance(100)
    assert logs, "the listener should log what it rejected"
    for event in logs:
        assert secret not in formatEvent(event)
        assert all(secret not in repr(v) for k, v in event.items() if k != "log_source")


def test_a_clean_stop_reads_nothing_more_but_still_acks_what_was_read() -> None:
    handler = Recorder()
    factory = make_factory(handler, max_in_flight=2)
    proto, transport = connect(factory)
    proto.dataReceived(frame(adt("C1")) + frame(adt("C2")))
    assert transport.producerState == "paused"  # max_in_flight
    factory.stop_reading()
    proto.dataReceived(frame(adt("C3")))  # already in flight on the wire: neither handled nor answered
    assert len(handler.calls) == 2
    handler.fire(0)
    handler.fire(1)
    assert [msa(a) for a in acks(transport)] == [("AA", "C1"), ("AA", "C2")]
    assert transport.producerState == "paused"  # answering does not resume reading while stopping
    factory.close_all()
    assert transport.disconnecting


def test_every_answer_is_counted_by_its_code_protocol_level_ones_included() -> None:
    """The protocol counts what it received and every answer it writes: the handler's AA/AR, an
    unreadable header's AR, an oversize frame's AR, a failed or timed-out handler's AE."""
    from listeners.metrics import Metrics

    metrics, clock, handler = Metrics(), MemoryReactorClock(), Recorder()
    factory = MLLPFactory(
        handler,
        config=MLLPConfig(handler_timeout_seconds=5, max_message_bytes=200),  # type: ignore[arg-type]
        clock=clock,
        counters=metrics.listener("in", "mllp"),
    )
    proto, transport = connect(factory)
    messages = [adt("A1"), adt("R1"), b"not HL7 at all", adt("BIG", pid="X" * 300), adt("F1"), adt("T1")]
    proto.dataReceived(b"".join(frame(m) for m in messages))
    handler.fire(0)
    handler.fire(1, AckDecision.reject("no"))
    handler.calls[2][2].errback(Failure(RuntimeError("db down")))
    clock.advance(5)  # T1's handler never answers
    codes = [
        hl7.parse(e.payload.decode()).segment("MSA")[1][0]
        for e in MLLPDecoder().feed(transport.value())
        if isinstance(e, Message)
    ]
    assert codes == ["AA", "AR", "AR", "AR", "AE", "AE"]

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"connection": "in", **labels}) or 0.0

    assert value("stageline_messages_received_total") == 6
    assert value("stageline_received_bytes_total") == sum(map(len, messages))
    assert {code: value("stageline_acks_total", code=code) for code in ("AA", "AE", "AR")} == {
        "AA": 1,
        "AE": 2,
        "AR": 3,
    }
    assert value("stageline_open_connections") == 1
    assert (
        metrics.registry.get_sample_value("stageline_inbound_connection_info", {"connection": "in", "kind": "mllp"})
        == 1
    )


# -- issue 23, red team (network) -----------------------------------------------------------------


@pytest.mark.parametrize("alias", ["latin-1", "ISO-8859-1", "utf8", "big5", "8859/1"])
def test_msh18_python_aliases_of_allowed_codecs_are_accepted(alias: str) -> None:
    """MSH-18 takes the same allowlist as a Content-Type or the config (`codec_for`): a Python
    alias of a table-0211 codec is accepted (it used to get AR unknown_charset; red team net 6)."""
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("CS1", charset=alias)))
    assert len(handler.calls) == 1
    handler.fire(0)
    assert msa(acks(transport, "latin-1")[0]) == ("AA", "CS1")


def test_msh18_outside_the_allowlist_is_still_refused() -> None:
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("CS2", charset="punycode")))
    assert handler.calls == []
    assert msa(acks(transport)[0]) == ("AR", "CS2")


def test_a_control_id_over_199_characters_gets_ar_without_the_echo() -> None:
    """An MSH-10 longer than the stored column is refused naming the limit, and MSA-2 stays empty:
    an ACK never carries a sender's 50 KB field back (red team net 1 and 7)."""
    handler = Recorder()
    proto, transport = connect(make_factory(handler))
    proto.dataReceived(frame(adt("L" * 50_000)) + frame(adt("L" * 199)))
    assert len(handler.calls) == 1  # only the 199-character one
    handler.fire(0)
    first, second = acks(transport)
    assert msa(first) == ("AR", "")
    assert "MSH-10 is 50000 characters, limit 199" in str(first.segment("ERR")) + str(first.segment("MSA"))
    assert len(transport.value()) < 2000
    assert msa(second) == ("AA", "L" * 199)


def test_unread_answers_pause_reading_and_a_peer_that_never_reads_is_aborted() -> None:
    """The transport pauses its producer (the protocol) when its unsent bytes pass its buffer
    size: reading stops, and after the idle timeout the peer is aborted (red team net 1)."""
    clock = MemoryReactorClock()
    handler = Recorder()
    proto, transport = connect(make_factory(handler, clock, idle_timeout_seconds=5.0))
    assert transport.producer is proto and transport.streaming
    proto.pauseProducing()  # what Twisted does once 64 KB of answers are unsent
    assert transport.producerState == "paused"
    clock.advance(4.9)
    assert not transport.disconnecting
    proto.resumeProducing()  # the peer read them
    assert transport.producerState == "producing"
    clock.advance(10)  # (the idle timer may close it cleanly; the write timer must not abort it)
    proto2, transport2 = connect(make_factory(handler, clock, idle_timeout_seconds=5.0))
    proto2.pauseProducing()
    clock.advance(5.0)
    assert transport2.disconnecting


def test_a_write_past_the_buffer_pauses_reading_again_after_someone_else_resumed_it() -> None:
    """The guard's bandwidth throttle resumes the transport when its allowance refills; the next
    write past the buffer size (Twisted calls pauseProducing again) must stop reading again."""
    clock = MemoryReactorClock()
    proto, transport = connect(make_factory(Recorder(), clock, idle_timeout_seconds=5.0))
    proto.pauseProducing()
    transport.resumeProducing()  # the guard's throttle ends
    proto.pauseProducing()
    assert transport.producerState == "paused"
