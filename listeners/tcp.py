"""Raw TCP inbound: newline- or length-framed messages, each answered only after its commit.

Framing (``InboundConfig.framing``):

* ``newline`` — one message per line; a trailing ``\\r`` is stripped and empty lines are ignored
  (HL7 v2 keeps its ``\\r`` segment separators inside the line). Replies are ``ACK <message_id>\\n``
  or ``NAK <reason>\\n``.
* ``length`` — a 4-byte big-endian length, then that many bytes. Replies carry the same prefix
  around ``ACK <message_id>`` / ``NAK <reason>``.

Replies go out in arrival order, whatever order the commits finish in. A message over
``max_message_bytes`` is answered with a NAK and the connection is closed: with newline framing
the rest of the line is discarded first (memory stays bounded), with length framing the declared
length alone decides and the body is never read. Undecodable bytes get a NAK and nothing is
staged. The protocol only frames and hands over: decoding and validation live in
:func:`listeners.inbound.build_inbound` (shared by every transport), staging in the ``ingest`` object.
"""
from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from twisted.internet.defer import maybeDeferred
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.logger import Logger
from twisted.protocols.policies import TimeoutMixin
from twisted.python.failure import Failure

from listeners.connections import TCP_FRAMINGS, InboundConfig
from listeners.inbound import IngestSink, LaneOf, PayloadRejected, build_inbound, codec_name, rejection_reason
from listeners.linger import close_after_answers

if TYPE_CHECKING:
    from twisted.internet.interfaces import ITCPTransport

    from listeners.metrics import Metrics

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "Frame",
    "LengthDecoder",
    "NewlineDecoder",
    "Oversize",
    "TCPFactory",
    "TCPProtocol",
    "TCPEvent",
    "encode_reply",
]

_log = Logger(namespace="stageline.tcp")

DEFAULT_MAX_IN_FLIGHT = 64


# -- framing ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Frame:
    """One complete message, without framing."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class Oversize:
    """A message over the limit: its size (newline: as counted; length: as declared)."""

    size: int


TCPEvent = Frame | Oversize


class NewlineDecoder:
    """Incremental newline framing with bounded memory (at most ``max_message_bytes + 1``)."""

    def __init__(self, *, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._buf = bytearray()
        self._discarding = 0  # bytes of an oversize line seen so far; 0 = not discarding

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[TCPEvent]:
        events: list[TCPEvent] = []
        pos, n = 0, len(data)
        while pos < n:
            nl = data.find(b"\n", pos)
            end = n if nl < 0 else nl
            if self._discarding:
                self._discarding += end - pos
            elif len(self._buf) + (end - pos) > self.max_message_bytes + 1:  # +1: a trailing \r
                self._discarding = len(self._buf) + (end - pos)
                self._buf = bytearray()
            else:
                self._buf += data[pos:end]
            if nl < 0:
                break
            self._end_line(events)
            pos = nl + 1
        return events

    def _end_line(self, events: list[TCPEvent]) -> None:
        if self._discarding:
            events.append(Oversize(self._discarding))
            self._discarding = 0
            return
        line = bytes(self._buf[:-1] if self._buf.endswith(b"\r") else self._buf)
        self._buf = bytearray()
        if len(line) > self.max_message_bytes:
            events.append(Oversize(len(line)))
        elif line:
            events.append(Frame(line))


class LengthDecoder:
    """Incremental 4-byte big-endian length-prefix framing; a declared length over the limit
    ends the stream (the protocol closes, the body is never read)."""

    _HEADER = struct.Struct(">I")

    def __init__(self, *, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._buf = bytearray()
        self._need: int | None = None  # body length once the prefix is read
        self._broken = False

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[TCPEvent]:
        events: list[TCPEvent] = []
        if self._broken:
            return events
        self._buf += data
        while True:
            if self._need is None:
                if len(self._buf) < 4:
                    break
                (length,) = self._HEADER.unpack_from(self._buf)
                del self._buf[:4]
                if length > self.max_message_bytes:
                    events.append(Oversize(length))
                    self._broken = True
                    self._buf = bytearray()
                    break
                self._need = length
            if len(self._buf) < self._need:
                break
            events.append(Frame(bytes(self._buf[: self._need])))
            del self._buf[: self._need]
            self._need = None
        return events


def encode_reply(text: str, framing: str) -> bytes:
    """One reply line/frame; control characters in ``text`` become spaces."""
    body = "".join(ch if ch.isprintable() else " " for ch in text).encode("ascii", "replace")
    if framing == "length":
        return struct.pack(">I", len(body)) + body
    return body + b"\n"


# -- protocol --------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class _Slot:
    """One received message awaiting its turn to be answered."""

    reply: bytes | None = None
    close: bool = False  # close the connection after this reply
    timer: IDelayedCall | None = field(default=None)


class TCPProtocol(Protocol, TimeoutMixin):
    """One raw TCP connection: frame, hand over, answer in arrival order after each commit."""

    def __init__(self, factory: TCPFactory) -> None:
        self.factory = factory
        self._config = factory.config
        self.callLater = factory.clock.callLater  # TimeoutMixin schedules through this
        decoder = LengthDecoder if self._config.framing == "length" else NewlineDecoder
        self._decoder: NewlineDecoder | LengthDecoder = decoder(
            max_message_bytes=self._config.max_message_bytes)
        self._slots: deque[_Slot] = deque()
        self._accepting = False
        self._connected = False
        self._registered = False
        self._paused = False
        self._draining = False  # a clean stop: read nothing more, still answer what was read
        self._peer = "?"

    @property
    def in_flight(self) -> int:
        """Messages received whose reply has not been written yet."""
        return len(self._slots)

    def connectionMade(self) -> None:
        self._peer = _describe(self.transport.getPeer())
        self._connected = True
        if not self.factory.register(self):
            _log.warn("refusing TCP connection to {connection} from {peer}: max_connections reached",
                      connection=self._config.name, peer=self._peer)
            self._connected = False
            self.transport.loseConnection()
            return
        self._registered = True
        self._accepting = True
        self.setTimeout(self._config.idle_timeout_seconds or None)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._accepting = False
        self._connected = False
        self.setTimeout(None)
        for slot in self._slots:
            _cancel(slot)
        if self._slots:
            _log.info("TCP connection to {connection} from {peer} lost with {count} unanswered message(s)",
                      connection=self._config.name, peer=self._peer, count=len(self._slots))
        self._slots.clear()
        if self._registered:
            self.factory.unregister(self)
            self._registered = False

    def stop_reading(self) -> None:
        """A clean stop: read nothing more from this peer; what was read is still answered."""
        self._draining = True
        self._accepting = False
        if self._connected and not self._paused:
            self._paused = True
            cast("ITCPTransport", self.transport).pauseProducing()

    def timeoutConnection(self) -> None:
        if self._slots:  # the sender waits on us; reply_timeout bounds that
            self.setTimeout(self.timeOut)
            return
        _log.info("closing idle TCP connection to {connection} from {peer}",
                  connection=self._config.name, peer=self._peer)
        self._accepting = False
        self.transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        if not self._accepting:
            return
        self.resetTimeout()
        for event in self._decoder.feed(data):
            if not self._accepting:
                break
            if isinstance(event, Frame):
                self._on_frame(event.payload)
            else:
                self._on_oversize(event.size)

    def _on_frame(self, payload: bytes) -> None:
        factory = self.factory
        factory.count_received()
        try:
            item = build_inbound(payload, connection=self._config.name, charset=self._config.charset,
                                 lane_of=factory.lane_of)
        except PayloadRejected as exc:
            _log.warn("rejecting {size}-byte message on {connection} from {peer}: {reason}",
                      size=len(payload), connection=self._config.name, peer=self._peer, reason=str(exc))
            self._enqueue(_Slot(reply=self._nak(str(exc), "AR")))
            self._flush()
            return
        slot = _Slot()
        self._enqueue(slot)
        d = maybeDeferred(factory.ingest.submit, item)
        if factory.reply_timeout_seconds is not None and not d.called:
            slot.timer = factory.clock.callLater(factory.reply_timeout_seconds, self._timed_out, slot)
        d.addCallbacks(self._committed, self._failed, callbackArgs=(slot,), errbackArgs=(slot,))

    def _on_oversize(self, size: int) -> None:
        limit = self._config.max_message_bytes
        _log.warn("rejecting oversize message ({size} bytes > {limit}) on {connection} from {peer}; closing",
                  size=size, limit=limit, connection=self._config.name, peer=self._peer)
        self.factory.count_received()
        self._accepting = False  # answer what came before, then this NAK, then close
        self._enqueue(_Slot(reply=self._nak(f"message too large: {size} bytes, limit {limit}", "AR"),
                            close=True))
        self._flush()

    def _committed(self, message_id: object, slot: _Slot) -> None:
        if slot.reply is not None:
            return  # already answered (reply timeout)
        _cancel(slot)
        self.factory.count_ack("AA")
        slot.reply = encode_reply(f"ACK {message_id}", self._config.framing)
        self._flush()

    def _failed(self, failure: Failure, slot: _Slot) -> None:
        if slot.reply is not None:
            return
        _cancel(slot)
        reason, code = rejection_reason(failure)
        # Only the exception type: its text may quote stored values.
        _log.warn("message on {connection} from {peer} not stored: {error}",
                  connection=self._config.name, peer=self._peer,
                  error=failure.type.__name__ if failure.type else "unknown")
        slot.reply = self._nak(reason, code)
        self._flush()

    def _timed_out(self, slot: _Slot) -> None:
        slot.timer = None
        if slot.reply is not None:
            return
        _log.error("no commit within {seconds}s for a message on {connection} from {peer}; answering NAK",
                   seconds=self.factory.reply_timeout_seconds, connection=self._config.name, peer=self._peer)
        slot.reply = self._nak("not stored in time, resend later", "AE")
        self._flush()

    def _nak(self, reason: str, code: str) -> bytes:
        self.factory.count_ack(code)
        return encode_reply(f"NAK {reason}", self._config.framing)

    def _enqueue(self, slot: _Slot) -> None:
        self._slots.append(slot)
        if not self._paused and len(self._slots) >= self.factory.max_in_flight:
            self._paused = True
            cast("ITCPTransport", self.transport).pauseProducing()

    def _flush(self) -> None:
        """Write every reply at the head of the queue that is ready; stop at the first that is not."""
        while self._slots and self._slots[0].reply is not None:
            slot = self._slots.popleft()
            if not self._connected:
                continue
            assert slot.reply is not None
            self.transport.write(slot.reply)
            if slot.close:
                self._connected = False
                self.transport.loseConnection()
                return
            if not self._slots:
                self.resetTimeout()  # from now on the sender is the one we wait for
        if self._paused and self._connected and not self._draining and len(self._slots) < self.factory.max_in_flight:
            self._paused = False
            cast("ITCPTransport", self.transport).resumeProducing()


def _describe(peer: IAddress) -> str:
    host, port = getattr(peer, "host", None), getattr(peer, "port", None)
    return f"{host}:{port}" if host is not None else str(peer)


def _cancel(slot: _Slot) -> None:
    if slot.timer is not None and slot.timer.active():
        slot.timer.cancel()
    slot.timer = None


class TCPFactory(ServerFactory):
    """Builds :class:`TCPProtocol` for one ``kind = "tcp"`` connection; enforces max_connections."""

    def __init__(self, ingest: IngestSink, config: InboundConfig, *, lane_of: LaneOf | None = None,
                 metrics: Metrics | None = None, clock: IReactorTime | None = None,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 reply_timeout_seconds: float | None = 60.0) -> None:
        if config.framing not in TCP_FRAMINGS:
            raise ValueError(f"{config.name}: framing must be one of {TCP_FRAMINGS}, got {config.framing!r}")
        codec_name(config.charset)
        if clock is None:
            from twisted.internet import reactor

            clock = cast(IReactorTime, reactor)
        self.ingest = ingest
        self.config = config
        self.lane_of = lane_of
        self.metrics = metrics
        self.clock = clock
        self.max_in_flight = max_in_flight
        self.reply_timeout_seconds = reply_timeout_seconds
        self._connections: set[TCPProtocol] = set()

    @property
    def active_connections(self) -> int:
        return len(self._connections)

    def buildProtocol(self, addr: IAddress) -> TCPProtocol:
        return TCPProtocol(self)

    def register(self, proto: TCPProtocol) -> bool:
        """Admit a new connection unless the limit is reached (the caller then closes it)."""
        if len(self._connections) >= self.config.max_connections:
            return False
        self._connections.add(proto)
        self._gauge()
        return True

    def unregister(self, proto: TCPProtocol) -> None:
        self._connections.discard(proto)
        self._gauge()

    def disconnect_all(self) -> None:
        """Drop every connection at once, e.g. when this node loses the leader lease.

        Unanswered messages get no reply; senders resend (at-least-once)."""
        for proto in list(self._connections):
            proto.transport.abortConnection()

    def stop_reading(self) -> None:
        """A clean stop, first step: every open connection stops reading (answers still go out)."""
        for proto in list(self._connections):
            proto.stop_reading()

    def close_all(self) -> None:
        """A clean stop, last step: close every connection without losing the answers written."""
        for proto in list(self._connections):
            close_after_answers(proto.transport, self.clock)

    def count_received(self) -> None:
        if self.metrics is not None:
            self.metrics.received.labels(self.config.name).inc()

    def count_ack(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.acks.labels(self.config.name, code).inc()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.connections.labels(self.config.name).set(len(self._connections))
