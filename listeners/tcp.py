"""Raw TCP inbound: newline- or length-framed messages, each answered only after its commit.

Framing (``InboundConfig.framing``):

* ``newline`` — one message per line; a trailing ``\\r`` is stripped and empty lines are ignored
  (HL7 v2 keeps its ``\\r`` segment separators inside the line). Replies are ``ACK <message_id>\\n``
  or ``NAK <reason>\\n``.
* ``length`` — a 4-byte big-endian length, then that many bytes. Replies carry the same prefix
  around ``ACK <message_id>`` / ``NAK <reason>``.

Replies go out in arrival order, whatever order the commits finish in (the queue, timeouts and
connection registry are :mod:`listeners.stream`'s, shared with MLLP). A message over
``max_message_bytes`` is answered with a NAK and the connection is closed: with newline framing
the rest of the line is discarded first (memory stays bounded), with length framing the declared
length alone decides and the body is never read. Undecodable bytes get a NAK and nothing is
staged. The protocol only frames and hands over: decoding and validation live in
:func:`listeners.validation.build_inbound` (shared by every transport), staging in the ``ingest`` object.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IAddress, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from listeners import batchgate
from listeners.connections_config import TCP_FRAMINGS, InboundConfig
from listeners.group_commit import InboundBatch
from listeners.offload import OFFLOAD_BYTES, off_reactor
from listeners.stream import OrderedReplyProtocol, Slot, StreamFactory
from listeners.validation import IngestSink, LaneOf, PayloadRejected, build_inbound, codec_name, rejection_reason

if TYPE_CHECKING:
    from listeners.metrics import Metrics

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "Frame",
    "LengthDecoder",
    "NewlineDecoder",
    "Oversize",
    "TCPEvent",
    "TCPFactory",
    "TCPProtocol",
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

    @property
    def partial(self) -> bool:
        """A line has started and not ended (an oversize one being discarded included)."""
        return bool(self._buf) or self._discarding > 0

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

    @property
    def partial(self) -> bool:
        """A frame has started (prefix or body bytes held) and not ended."""
        return not self._broken and (bool(self._buf) or self._need is not None)

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


class TCPProtocol(OrderedReplyProtocol):
    """One raw TCP connection: frame, hand over, answer in arrival order after each commit."""

    kind = "TCP"
    factory: TCPFactory

    def __init__(self, factory: TCPFactory) -> None:
        super().__init__(
            clock=factory.clock,
            idle_timeout_seconds=factory.config.idle_timeout_seconds or None,
            max_in_flight=factory.max_in_flight,
        )
        self.factory = factory
        self._config = factory.config
        decoder = LengthDecoder if self._config.framing == "length" else NewlineDecoder
        self._decoder: NewlineDecoder | LengthDecoder = decoder(max_message_bytes=self._config.max_message_bytes)

    def where(self) -> str:
        return f"to {self._config.name} from {self.peer_text}"

    progress_events = (Frame, Oversize)

    def decode(self, data: bytes) -> list[TCPEvent]:
        return self._decoder.feed(data)

    @property
    def receiving(self) -> bool:
        return self._decoder.partial

    def on_event(self, event: object) -> None:
        if isinstance(event, Frame):
            self._on_frame(event.payload)
        elif isinstance(event, Oversize):
            self._on_oversize(event.size)

    def _on_frame(self, payload: bytes) -> None:
        factory = self.factory
        factory.count_received(len(payload))
        # A large frame (a batch) stops reading until it is answered, as an MLLP batch does: what
        # waits for its turn at the gate is one frame per connection, never a queue of them.
        slot = Slot(weight=self._max_in_flight if len(payload) >= OFFLOAD_BYTES else 1)
        self.enqueue(slot)
        # Large frames take turns process-wide (listeners/batchgate.py) until answered.
        batchgate.batch_gate.run(len(payload), self._build_and_submit, payload, slot)

    def _build_and_submit(self, payload: bytes, slot: Slot) -> Deferred[None]:
        """Build and submit one frame; fires once it is answered (or refused)."""
        factory = self.factory
        if not self._connected:  # the sender left while the frame waited its turn: it resends
            return succeed(None)
        # A large frame (a batch of thousands of messages) is split off the reactor (listeners/offload.py).
        built = off_reactor(
            factory.clock,
            len(payload),
            build_inbound,
            payload,
            connection=self._config.name,
            charset=self._config.charset,
            lane_of=factory.lane_of,
            hl7_only=self._config.hl7_only,
            conformance=self._config.conformance,
        )
        built.addCallbacks(self._submit, self._refused, callbackArgs=(slot,), errbackArgs=(slot, len(payload)))
        return built

    def _refused(self, failure: Failure, slot: Slot, size: int) -> None:
        if not failure.check(PayloadRejected):
            _log.critical(
                "cannot read a message on {connection} from {peer}: {error}",
                connection=self._config.name,
                peer=self.peer_text,
                error=failure.type.__name__ if failure.type else "unknown",
            )
            self.answer(slot, self._nak("internal error, resend later", "AE"))
            return
        _log.warn(
            "rejecting {size}-byte message on {connection} from {peer}: {reason}",
            size=size,
            connection=self._config.name,
            peer=self.peer_text,
            reason=str(failure.value),
        )
        self.answer(slot, self._nak(str(failure.value), "AR"))

    def _submit(self, item: Any, slot: Slot) -> Deferred[None]:
        d = maybeDeferred(self.factory.ingest.submit, item)
        if isinstance(item, InboundBatch):  # one answer for the batch: its id and how many it staged
            count = len(item.items)
            d.addCallback(lambda batch_id: f"{batch_id} ({count} messages)")
        self.await_answer(d, slot, self.factory.reply_timeout_seconds, lambda: self._timed_out_reply(slot))
        return d.addCallbacks(self._committed, self._failed, callbackArgs=(slot,), errbackArgs=(slot,))

    def _on_oversize(self, size: int) -> None:
        limit = self._config.max_message_bytes
        _log.warn(
            "rejecting oversize message ({size} bytes > {limit}) on {connection} from {peer}; closing",
            size=size,
            limit=limit,
            connection=self._config.name,
            peer=self.peer_text,
        )
        # newline framing read (and discarded) the line; length framing never reads the body
        self.factory.count_received(size if self._config.framing == "newline" else 0)
        self.stop_accepting()  # answer what came before, then this NAK, then close
        self.enqueue(Slot(reply=self._nak(f"message too large: {size} bytes, limit {limit}", "AR"), close=True))
        self.flush()

    def _committed(self, message_id: object, slot: Slot) -> None:
        if slot.ready:
            return  # already answered (reply timeout)
        self.factory.count_ack("AA")
        self.answer(slot, encode_reply(f"ACK {message_id}", self._config.framing))

    def _failed(self, failure: Failure, slot: Slot) -> None:
        if slot.ready:
            return
        reason, code = rejection_reason(failure)
        # Only the exception type: its text may quote stored values.
        _log.warn(
            "message on {connection} from {peer} not stored: {error}",
            connection=self._config.name,
            peer=self.peer_text,
            error=failure.type.__name__ if failure.type else "unknown",
        )
        self.answer(slot, self._nak(reason, code))

    def _timed_out_reply(self, slot: Slot) -> None:
        _log.error(
            "no commit within {seconds}s for a message on {connection} from {peer}; answering NAK",
            seconds=self.factory.reply_timeout_seconds,
            connection=self._config.name,
            peer=self.peer_text,
        )
        self.answer(slot, self._nak("not confirmed stored in time, resend it (recognised, never stored twice)", "AE"))

    def _nak(self, reason: str, code: str) -> bytes:
        self.factory.count_ack(code)
        return encode_reply(f"NAK {reason}", self._config.framing)


class TCPFactory(StreamFactory):
    """Builds :class:`TCPProtocol` for one ``kind = "tcp"`` connection; the registry enforces max_connections."""

    def __init__(
        self,
        ingest: IngestSink,
        config: InboundConfig,
        *,
        lane_of: LaneOf | None = None,
        metrics: Metrics | None = None,
        clock: IReactorTime | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        reply_timeout_seconds: float | None = 60.0,
    ) -> None:
        if config.framing not in TCP_FRAMINGS:
            raise ValueError(f"{config.name}: framing must be one of {TCP_FRAMINGS}, got {config.framing!r}")
        codec_name(config.charset)
        super().__init__(metrics.listener(config.name, "tcp") if metrics is not None else None)
        if clock is None:
            from twisted.internet import reactor

            clock = cast(IReactorTime, reactor)
        self.ingest = ingest
        self.config = config
        self.lane_of = lane_of
        self.metrics = metrics
        self.clock = clock
        self.max_in_flight = max_in_flight
        self.max_connections = config.max_connections
        self.reply_timeout_seconds = reply_timeout_seconds

    # (Twisted's Factory wants a protocol whose `factory` is any Factory; ours names its own)
    def buildProtocol(self, addr: IAddress | None) -> TCPProtocol:  # type: ignore[override]
        return TCPProtocol(self)
