"""Large batches take turns process-wide (listeners/batchgate.py; issue 23, red team network item 2).

Unit tests of the gate, then each transport in memory: while one large batch is in work the next
one (another connection's) waits at the gate, and reading on its connection stays paused.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.testing import MemoryReactorClock, StringTransport

from listeners import batchgate
from listeners.batchgate import BatchGate
from listeners.connections_config import InboundConfig
from listeners.mllp_listener import MLLPConfig, MLLPFactory, frame
from listeners.offload import OFFLOAD_BYTES
from listeners.tcp import TCPFactory

MB = 1024 * 1024
PEER = IPv4Address("TCP", "127.0.0.1", 40000)


class Work:
    """Work items the test finishes by hand."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.pending: dict[str, Deferred[str]] = {}

    def __call__(self, name: str) -> Deferred[str]:
        self.started.append(name)
        d: Deferred[str] = Deferred()
        self.pending[name] = d
        return d

    def finish(self, name: str) -> None:
        self.pending.pop(name).callback(name)


def test_large_inputs_wait_while_the_budget_is_in_use_first_come_first_served() -> None:
    gate, work = BatchGate(budget_bytes=2 * MB), Work()
    results = {n: gate.run(MB, work, n) for n in ("a", "b", "c", "d")}
    assert work.started == ["a", "b"] and gate.waiting == 2 and gate.in_work == 2 * MB
    work.finish("a")
    assert work.started == ["a", "b", "c"]
    out: list[str] = []
    results["a"].addCallback(out.append)
    assert out == ["a"]  # the caller gets the work's own result
    work.finish("b")
    work.finish("c")
    work.finish("d")
    assert gate.in_work == 0 and gate.running == 0 and gate.waiting == 0


def test_one_input_over_the_budget_still_goes_alone() -> None:
    gate, work = BatchGate(budget_bytes=MB), Work()
    gate.run(3 * MB, work, "huge")
    gate.run(MB, work, "next")
    assert work.started == ["huge"]
    work.finish("huge")
    assert work.started == ["huge", "next"]


def test_small_inputs_never_wait() -> None:
    gate, work = BatchGate(budget_bytes=MB), Work()
    gate.run(2 * MB, work, "big")
    gate.run(OFFLOAD_BYTES - 1, work, "small")
    assert work.started == ["big", "small"]


def test_a_cancelled_wait_leaves_the_queue_and_a_failed_work_frees_its_bytes() -> None:
    gate, work = BatchGate(budget_bytes=MB), Work()
    gate.run(MB, work, "a")
    waiting = gate.run(MB, work, "b")
    waiting.addErrback(lambda f: f.trap(CancelledError))
    waiting.cancel()
    assert gate.waiting == 0
    gate.run(MB, work, "c")
    work.pending.pop("a").errback(RuntimeError("store down"))
    assert work.started == ["a", "c"] and gate.in_work == MB


# -- the transports ----------------------------------------------------------------------------


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[BatchGate]:
    g = BatchGate(budget_bytes=MB)
    monkeypatch.setattr(batchgate, "batch_gate", g)
    yield g


def hl7_batch(n: int, tag: str) -> bytes:
    body = b"".join(f"MSH|^~\\&|A|B|C|D|20260101||ADT^A01|{tag}{i}|P|2.5\rPID|1||P{i}\r".encode() for i in range(n))
    return f"BHS|^~\\&|A|B|C|D|20260101||||{tag}\r".encode() + body + f"BTS|{n}\r".encode()


def test_mllp_a_second_large_batch_waits_and_its_connection_stops_reading(gate: BatchGate) -> None:
    calls: list[Deferred[bytes]] = []

    def batch_handler(payload: bytes, peer: object) -> Deferred[bytes]:
        d: Deferred[bytes] = Deferred()
        calls.append(d)
        return d

    factory = MLLPFactory(
        lambda *a: None,
        config=MLLPConfig(),
        clock=MemoryReactorClock(),  # type: ignore[arg-type]
        batch_handler=batch_handler,
    )
    big = hl7_batch(16000, "X")  # ~1 MB
    assert len(big) > MB // 2
    conns = []
    for _ in range(2):
        proto = factory.buildProtocol(PEER)
        transport = StringTransport(peerAddress=PEER)
        proto.makeConnection(transport)
        proto.dataReceived(frame(big))
        conns.append(transport)
    assert len(calls) == 1 and gate.waiting == 1  # the second waits for the first
    assert conns[1].producerState == "paused"  # and its connection reads nothing meanwhile
    calls[0].callback(frame(b"MSH|^~\\&|ACK"))
    assert len(calls) == 2 and gate.waiting == 0


def test_tcp_a_second_large_frame_waits_and_its_connection_stops_reading(gate: BatchGate) -> None:
    submitted: list[Deferred[str]] = []

    class Ingest:
        def submit(self, item: object) -> Deferred[str]:
            d: Deferred[str] = Deferred()
            submitted.append(d)
            return d

    config = InboundConfig(name="raw", kind="tcp", port=0, framing="length")
    factory = TCPFactory(Ingest(), config, clock=MemoryReactorClock())  # type: ignore[arg-type]
    big = hl7_batch(16000, "T")
    transports = []
    for _ in range(2):
        proto = factory.buildProtocol(PEER)
        transport = StringTransport(peerAddress=PEER)
        proto.makeConnection(transport)
        proto.dataReceived(struct.pack(">I", len(big)) + big)
        transports.append(transport)
    assert len(submitted) == 1 and gate.waiting == 1
    assert transports[1].producerState == "paused"
    submitted[0].callback("batch-1")
    assert len(submitted) == 2 and gate.waiting == 0
    assert (
        transports[0].value().startswith(struct.pack(">I", len(transports[0].value()) - 4))
        or b"ACK batch-1" in transports[0].value()
    )


def test_mllp_the_reply_timeout_counts_from_the_batch_turn_and_a_gone_sender_is_skipped(gate: BatchGate) -> None:
    clock = MemoryReactorClock()
    calls: list[Deferred[bytes]] = []

    def batch_handler(payload: bytes, peer: object) -> Deferred[bytes]:
        d: Deferred[bytes] = Deferred()
        calls.append(d)
        return d

    factory = MLLPFactory(
        lambda *a: None,
        config=MLLPConfig(handler_timeout_seconds=10),
        clock=clock,  # type: ignore[arg-type]
        batch_handler=batch_handler,
    )
    big = hl7_batch(16000, "W")
    protos = []
    for _ in range(3):
        proto = factory.buildProtocol(PEER)
        transport = StringTransport(peerAddress=PEER)
        proto.makeConnection(transport)
        proto.dataReceived(frame(big))
        protos.append((proto, transport))
    clock.advance(9)
    calls[0].callback(b"MSH|^~\\&|A|B|C|D|20260101||ACK|1|P|2.5\rMSA|AA|W\r")
    clock.advance(9)  # the second has waited 18 s in all, 9 s since its turn: no AE yet
    assert len(calls) == 2 and b"MSA|AE" not in protos[1][1].value()
    protos[2][0].connectionLost(None)  # the third's sender leaves while it waits
    calls[1].callback(b"MSH|^~\\&|A|B|C|D|20260101||ACK|2|P|2.5\rMSA|AA|W\r")
    assert b"MSA|AA" in protos[1][1].value()
    assert len(calls) == 2 and gate.in_work == 0  # never handed over
