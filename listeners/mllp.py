"""MLLP framing (``<VT> message <FS><CR>``) and the Twisted protocol that ACKs each message.

The protocol only frames and hands over: every complete message goes to an asynchronous
``handler(message, peer) -> Deferred[AckDecision]`` (which stores it durably) and the ACK is
written when that Deferred fires — in arrival order, and positive only if the handler said AA.

Decoder choices (the MLLP spec leaves these open; they follow common practice, e.g. HAPI):

* ``<FS>`` ends a frame on its own; a ``<CR>`` right after it is consumed, a missing one is
  only counted (``missing_cr``). The frame is emitted at ``<FS>``, without waiting for ``<CR>``.
* A ``<VT>`` inside a frame means the sender gave up on that frame and started again (a
  retransmission): the partial frame is dropped as garbage and a new frame starts. So a
  message never contains 0x0B or 0x1C.
* Bytes outside frames are skipped and counted, never parsed. CR/LF between frames is normal
  line noise and is ignored silently.
* A frame longer than ``max_message_bytes`` stops being buffered; the rest is discarded up to
  its ``<FS>`` and an :class:`Oversize` event carries its first bytes so its MSH can still be
  read to reject it with AR. Memory per connection stays under ``max_message_bytes``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, cast

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.logger import Logger
from twisted.protocols.policies import TimeoutMixin
from twisted.python.failure import Failure

from listeners.hl7ack import AckCode, AckDecision, build_ack, build_fallback_ack
from listeners.hl7msg import HL7Header, HL7HeaderError, parse_header
from listeners.linger import close_after_answers

if TYPE_CHECKING:
    from twisted.internet.interfaces import ITCPTransport

__all__ = [
    "END_BLOCK",
    "START_BLOCK",
    "Garbage",
    "GarbageReason",
    "Handler",
    "MLLPConfig",
    "MLLPDecoder",
    "MLLPEvent",
    "MLLPFactory",
    "MLLPProtocol",
    "Message",
    "Oversize",
    "frame",
]

START_BLOCK = b"\x0b"
END_BLOCK = b"\x1c\x0d"
_VT, _FS, _CR = 0x0B, 0x1C, 0x0D

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DEFAULT_PREFIX_BYTES = 4096

_log = Logger(namespace="stageline.mllp")


def frame(message: bytes) -> bytes:
    """Wrap one message (e.g. an ACK) in an MLLP block."""
    return START_BLOCK + message + END_BLOCK


class GarbageReason(StrEnum):
    BETWEEN_FRAMES = "between_frames"  # bytes outside any frame
    INTERRUPTED_FRAME = "interrupted_frame"  # a <VT> arrived before the frame's <FS>
    UNTERMINATED_FRAME = "unterminated_frame"  # the stream ended inside a frame


@dataclass(frozen=True, slots=True)
class Message:
    """A complete frame's content, without the MLLP delimiters."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class Oversize:
    """A complete frame larger than the limit: its first bytes and its total content size."""

    prefix: bytes
    size: int


@dataclass(frozen=True, slots=True)
class Garbage:
    """Bytes that were skipped; ``size`` counts content bytes (delimiters excluded)."""

    size: int
    reason: GarbageReason


MLLPEvent = Message | Oversize | Garbage


class MLLPDecoder:
    """Incremental, pure MLLP decoder: bytes in, events out, bounded memory.

    Events depend only on the byte stream, never on how it was split into ``feed`` calls
    (garbage runs are reported when they end, i.e. at the next ``<VT>`` or at ``close``).
    """

    _IDLE, _IN_FRAME, _AFTER_FS = range(3)

    def __init__(
        self,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        prefix_bytes: int = DEFAULT_PREFIX_BYTES,
    ) -> None:
        if max_message_bytes < 1 or prefix_bytes < 0:
            raise ValueError("max_message_bytes must be >= 1 and prefix_bytes >= 0")
        self.max_message_bytes = max_message_bytes
        self.prefix_bytes = min(prefix_bytes, max_message_bytes)
        self._state = self._IDLE
        self._buf = bytearray()
        self._size = 0  # content bytes of the current frame, including discarded ones
        self._oversize = False
        self._garbage = 0  # bytes in the current run outside frames
        self._garbage_noise_only = True  # the run so far is only CR/LF
        # Counters for metrics.
        self.messages = 0
        self.oversize = 0
        self.garbage_bytes = 0
        self.missing_cr = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes held between calls; never more than ``max_message_bytes``."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[MLLPEvent]:
        """Consume ``data`` and return the events it completes, in stream order."""
        events: list[MLLPEvent] = []
        pos, n = 0, len(data)
        while pos < n:
            if self._state == self._AFTER_FS:
                if data[pos] == _CR:
                    pos += 1
                else:
                    self.missing_cr += 1
                self._state = self._IDLE
            elif self._state == self._IDLE:
                vt = data.find(START_BLOCK, pos)
                end = n if vt < 0 else vt
                self._skip(data, pos, end)
                if vt < 0:
                    break
                self._end_garbage_run(events)
                self._start_frame()
                pos = vt + 1
            else:
                fs = data.find(b"\x1c", pos)
                vt = data.find(START_BLOCK, pos, n if fs < 0 else fs)
                end = vt if vt >= 0 else (fs if fs >= 0 else n)
                self._append(data, pos, end)
                if end == n:
                    break
                if end == vt:
                    self._drop_frame(events, GarbageReason.INTERRUPTED_FRAME)
                    self._start_frame()
                else:
                    self._end_frame(events)
                    self._state = self._AFTER_FS
                pos = end + 1
        return events

    def close(self) -> list[MLLPEvent]:
        """End of stream: report what was pending (garbage or an unterminated frame)."""
        events: list[MLLPEvent] = []
        if self._state == self._IN_FRAME:
            self._drop_frame(events, GarbageReason.UNTERMINATED_FRAME)
        else:
            self._end_garbage_run(events)
        self._state = self._IDLE
        return events

    def _skip(self, data: bytes, start: int, end: int) -> None:
        if end <= start:
            return
        self._garbage += end - start
        if self._garbage_noise_only and data[start:end].strip(b"\r\n"):
            self._garbage_noise_only = False

    def _end_garbage_run(self, events: list[MLLPEvent]) -> None:
        if self._garbage and not self._garbage_noise_only:
            events.append(Garbage(self._garbage, GarbageReason.BETWEEN_FRAMES))
            self.garbage_bytes += self._garbage
        self._garbage = 0
        self._garbage_noise_only = True

    def _start_frame(self) -> None:
        self._state = self._IN_FRAME
        self._buf = bytearray()
        self._size = 0
        self._oversize = False

    def _append(self, data: bytes, start: int, end: int) -> None:
        count = end - start
        if count <= 0:
            return
        if not self._oversize and self._size + count <= self.max_message_bytes:
            self._buf += data[start:end]
        elif not self._oversize:
            self._oversize = True
            room = self.prefix_bytes - len(self._buf)
            if room > 0:
                self._buf += data[start : min(end, start + room)]
            else:
                del self._buf[self.prefix_bytes :]
        self._size += count

    def _end_frame(self, events: list[MLLPEvent]) -> None:
        if self._oversize:
            events.append(Oversize(bytes(self._buf), self._size))
            self.oversize += 1
        else:
            events.append(Message(bytes(self._buf)))
            self.messages += 1
        self._buf = bytearray()
        self._size = 0
        self._oversize = False

    def _drop_frame(self, events: list[MLLPEvent], reason: GarbageReason) -> None:
        if self._size:
            events.append(Garbage(self._size, reason))
            self.garbage_bytes += self._size
        self._buf = bytearray()
        self._size = 0
        self._oversize = False


# handler(message, peer, header): the header is the protocol's own parse (with the decoded text)
Handler = Callable[[bytes, IAddress, HL7Header], "Deferred[AckDecision]"]


@dataclass(frozen=True, slots=True)
class MLLPConfig:
    """Per-listener settings.

    ``sending_application``/``sending_facility`` are our MSH-3/4 in ACKs; None echoes the
    inbound MSH-5/6 (the application the sender addressed).
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    prefix_bytes: int = DEFAULT_PREFIX_BYTES
    idle_timeout_seconds: float | None = 300.0
    handler_timeout_seconds: float | None = 60.0
    max_connections: int = 64
    max_in_flight: int = 64
    sending_application: str | None = None
    sending_facility: str | None = None
    default_encoding: str = "utf_8"
    strict_charset: bool = True
    fallback_version: str = "2.5"


@dataclass(slots=True, eq=False)
class _Slot:
    """One received frame awaiting its turn to be answered."""

    control_id: str
    ack: bytes | None = None
    close: bool = False
    timer: IDelayedCall | None = None

    @property
    def ready(self) -> bool:
        return self.ack is not None or self.close


class MLLPProtocol(Protocol, TimeoutMixin):
    """One MLLP connection: decode frames, call the handler, write ACKs in arrival order."""

    factory: MLLPFactory | None = None

    def __init__(self, handler: Handler, *, config: MLLPConfig, clock: IReactorTime) -> None:
        self._handler = handler
        self._config = config
        self._clock = clock
        self.callLater = clock.callLater  # TimeoutMixin schedules through this
        self._decoder = MLLPDecoder(
            max_message_bytes=config.max_message_bytes, prefix_bytes=config.prefix_bytes
        )
        self._slots: deque[_Slot] = deque()
        self._accepting = False  # False before connectionMade, after a close decision, or lost
        self._connected = False
        self._registered = False
        self._paused = False
        self._draining = False  # a clean stop: read nothing more, still answer what was read
        self._peer: IAddress | None = None
        self._peer_text = "?"

    @property
    def in_flight(self) -> int:
        """Frames received whose ACK has not been written yet."""
        return len(self._slots)

    # -- connection lifecycle -------------------------------------------------------------

    def connectionMade(self) -> None:
        self._peer = self.transport.getPeer()
        self._peer_text = _describe(self._peer)
        self._connected = True
        if self.factory is not None and not self.factory.register(self):
            _log.warn(
                "refusing MLLP connection from {peer}: max_connections reached",
                peer=self._peer_text,
            )
            self.transport.loseConnection()
            return
        self._registered = self.factory is not None
        self._accepting = True
        self.setTimeout(self._config.idle_timeout_seconds)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._accepting = False
        self._connected = False
        self.setTimeout(None)
        for slot in self._slots:
            _cancel(slot)
        if self._slots:
            _log.info(
                "MLLP connection from {peer} lost with {count} unacknowledged message(s)",
                peer=self._peer_text,
                count=len(self._slots),
            )
        self._slots.clear()
        for event in self._decoder.close():
            self._on_event(event)
        if self._registered and self.factory is not None:
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
        if self._slots:
            # The sender is idle because it is waiting on us; handler_timeout bounds that.
            self.setTimeout(self.timeOut)
            return
        _log.info("closing idle MLLP connection from {peer}", peer=self._peer_text)
        self._accepting = False
        self.transport.loseConnection()

    # -- inbound --------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if not self._accepting:
            return
        self.resetTimeout()
        for event in self._decoder.feed(data):
            if not self._accepting:
                break
            self._on_event(event)

    def _on_event(self, event: MLLPEvent) -> None:
        if isinstance(event, Message):
            self._on_message(event.payload)
        elif isinstance(event, Oversize):
            self._on_oversize(event)
        else:
            _log.warn(
                "skipped {size} byte(s) from {peer}: {reason}",
                size=event.size,
                peer=self._peer_text,
                reason=event.reason.value,
            )

    def _on_message(self, payload: bytes) -> None:
        try:
            header = parse_header(
                payload,
                default_encoding=self._config.default_encoding,
                strict_charset=self._config.strict_charset,
            )
        except HL7HeaderError as exc:
            _log.warn(
                "rejecting {size}-byte message from {peer}: {reason}",
                size=len(payload),
                peer=self._peer_text,
                reason=exc.reason.value,
            )
            self._enqueue(_Slot(_safe(exc.control_id), ack=self._fallback_ack(str(exc), acked=exc.control_id)))
            self._flush()
            return
        slot = _Slot(_safe(header.control_id))
        self._enqueue(slot)
        assert self._peer is not None
        d = maybeDeferred(self._handler, payload, self._peer, header)
        if self._config.handler_timeout_seconds is not None and not d.called:
            slot.timer = self._clock.callLater(
                self._config.handler_timeout_seconds, self._handler_timed_out, slot, header, d
            )
        d.addCallbacks(
            self._handler_done,
            self._handler_failed,
            callbackArgs=(slot, header),
            errbackArgs=(slot, header),
        )
        d.addErrback(self._internal_error, slot)

    def _on_oversize(self, event: Oversize) -> None:
        limit = self._config.max_message_bytes
        try:
            header = parse_header(
                event.prefix,
                default_encoding=self._config.default_encoding,
                strict_charset=self._config.strict_charset,
                complete=False,
            )
        except HL7HeaderError as exc:
            _log.warn(
                "oversize frame ({size} bytes > {limit}) from {peer} with unreadable header"
                " ({reason}); closing connection",
                size=event.size,
                limit=limit,
                peer=self._peer_text,
                reason=exc.reason.value,
            )
            self._accepting = False  # answer what came before, then close
            self._enqueue(_Slot("", close=True))
            self._flush()
            return
        _log.warn(
            "rejecting oversize message {control_id} ({size} bytes > {limit}) from {peer}",
            control_id=_safe(header.control_id),
            size=event.size,
            limit=limit,
            peer=self._peer_text,
        )
        decision = AckDecision.reject(f"message too large: {event.size} bytes, limit {limit}")
        self._enqueue(_Slot(_safe(header.control_id), ack=self._ack(header, decision)))
        self._flush()

    # -- handler outcome ------------------------------------------------------------------

    def _handler_done(self, result: object, slot: _Slot, header: HL7Header) -> None:
        if slot.ready:
            return  # already answered (handler timeout)
        _cancel(slot)
        if isinstance(result, AckDecision):
            decision = result
        else:
            _log.error(
                "handler returned {type} instead of AckDecision for {control_id}",
                type=type(result).__name__,
                control_id=_safe(header.control_id),
            )
            decision = AckDecision.error("message not accepted; resend later")
        slot.ack = self._ack(header, decision)
        _log.debug(
            "{code} for {control_id} from {peer}",
            code=decision.code.value,
            control_id=_safe(header.control_id),
            peer=self._peer_text,
        )
        self._flush()

    def _handler_failed(self, failure: Failure, slot: _Slot, header: HL7Header) -> None:
        if slot.ready:
            return  # already answered (handler timeout); swallows the CancelledError
        _cancel(slot)
        # Only the exception type: its text may quote stored values (PHI).
        _log.error(
            "handler failed for {control_id} from {peer}: {error}; answering AE",
            control_id=_safe(header.control_id),
            peer=self._peer_text,
            error=failure.type.__name__ if failure.type else "unknown",
        )
        slot.ack = self._ack(header, AckDecision.error("message not stored; resend later"))
        self._flush()

    def _handler_timed_out(
        self, slot: _Slot, header: HL7Header, d: Deferred[AckDecision]
    ) -> None:
        slot.timer = None
        if slot.ready:
            return
        _log.error(
            "handler timed out for {control_id} from {peer}; answering AE",
            control_id=_safe(header.control_id),
            peer=self._peer_text,
        )
        slot.ack = self._ack(header, AckDecision.error("message not stored in time; resend later"))
        self._flush()
        d.cancel()

    def _internal_error(self, failure: Failure, slot: _Slot) -> None:
        _log.critical(
            "internal error answering {control_id}: {error}",
            control_id=slot.control_id,
            error=failure.type.__name__ if failure.type else "unknown",
        )
        if not slot.ready:
            slot.ack = self._fallback_ack("internal error", code=AckCode.AE)
            self._flush()

    # -- outbound -------------------------------------------------------------------------

    def _ack(self, header: HL7Header, decision: AckDecision) -> bytes:
        try:
            return build_ack(
                header,
                decision.code,
                reason=decision.reason,
                error_code=decision.error_code,
                sending_application=self._config.sending_application,
                sending_facility=self._config.sending_facility,
            )
        except Exception as exc:  # never let an ACK bug leave a slot unanswered
            _log.critical("cannot build ACK for {control_id}: {error}",
                          control_id=_safe(header.control_id), error=type(exc).__name__)
            code = AckCode.AE if decision.code is AckCode.AA else decision.code
            return self._fallback_ack("internal error", code=code)

    def _fallback_ack(self, reason: str, *, code: AckCode = AckCode.AR, acked: str = "") -> bytes:
        return build_fallback_ack(
            code,
            reason=reason,
            acked_control_id=acked,
            sending_application=self._config.sending_application or "",
            sending_facility=self._config.sending_facility or "",
            version=self._config.fallback_version,
        )

    def _enqueue(self, slot: _Slot) -> None:
        self._slots.append(slot)
        if not self._paused and len(self._slots) >= self._config.max_in_flight:
            self._paused = True
            cast("ITCPTransport", self.transport).pauseProducing()

    def _flush(self) -> None:
        """Write every ACK at the head of the queue that is ready; stop at the first that is not."""
        while self._slots and self._slots[0].ready:
            slot = self._slots.popleft()
            if not self._connected:
                continue
            if slot.close:
                self._accepting = False
                self._connected = False
                self.transport.loseConnection()
                return
            assert slot.ack is not None
            self.transport.write(frame(slot.ack))
            if not self._slots:
                self.resetTimeout()  # from now on we are the ones waiting: idle starts here
        if self._paused and self._connected and not self._draining and len(self._slots) < self._config.max_in_flight:
            self._paused = False
            cast("ITCPTransport", self.transport).resumeProducing()


def _describe(peer: IAddress) -> str:
    host, port = getattr(peer, "host", None), getattr(peer, "port", None)
    return f"{host}:{port}" if host is not None else str(peer)


def _safe(control_id: str) -> str:
    """A control id fit for a log line: bounded, no control characters."""
    return "".join(ch if ch.isprintable() else "?" for ch in control_id[:64])


def _cancel(slot: _Slot) -> None:
    if slot.timer is not None and slot.timer.active():
        slot.timer.cancel()
    slot.timer = None


class MLLPFactory(ServerFactory):
    """Builds :class:`MLLPProtocol` instances and enforces ``max_connections``."""

    def __init__(
        self,
        handler: Handler,
        *,
        config: MLLPConfig | None = None,
        clock: IReactorTime | None = None,
    ) -> None:
        if clock is None:
            from twisted.internet import reactor

            clock = cast(IReactorTime, reactor)
        self.handler = handler
        self.config = config or MLLPConfig()
        self.clock = clock
        self._connections: set[MLLPProtocol] = set()

    @property
    def active_connections(self) -> int:
        return len(self._connections)

    def buildProtocol(self, addr: IAddress) -> MLLPProtocol:
        proto = MLLPProtocol(self.handler, config=self.config, clock=self.clock)
        proto.factory = self
        return proto

    def register(self, proto: MLLPProtocol) -> bool:
        """Admit a new connection unless the limit is reached (the caller then closes it)."""
        if len(self._connections) >= self.config.max_connections:
            return False
        self._connections.add(proto)
        return True

    def unregister(self, proto: MLLPProtocol) -> None:
        self._connections.discard(proto)

    def disconnect_all(self) -> None:
        """Drop every connection at once, e.g. when this node loses the leader lease.

        Unanswered messages get no ACK; senders resend (at-least-once)."""
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
