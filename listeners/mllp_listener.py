"""MLLP framing (``<VT> message <FS><CR>``) and the Twisted protocol that ACKs each message.

The protocol only frames and hands over: every complete message goes to an asynchronous
``handler(message, peer) -> Deferred[AckDecision]`` (which stores it durably) and the ACK is
written when that Deferred fires — in arrival order (the queue of :mod:`listeners.stream`, shared
with raw TCP), and positive only if the handler said AA.

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

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, cast

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IAddress, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from listeners import batchgate
from listeners.hl7ack import AckCode, AckDecision, accept_code, build_ack, build_fallback_ack, commit_code
from listeners.hl7batch import starts_batch
from listeners.hl7errors import INTERNAL, UNSUPPORTED_MESSAGE_TYPE, Condition
from listeners.hl7msg import HL7Header, HL7HeaderError, parse_header
from listeners.stream import OrderedReplyProtocol, Slot, StreamFactory, safe_id

if TYPE_CHECKING:
    from listeners.metrics import ListenerCounters

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

NOT_CONFIRMED = "not confirmed stored in time; resend it (a resend is recognised, never stored twice)"
"""The AE of a handler timeout: the commit may still land, so the answer does not say "not stored";
the re-send gets the first copy's id (`listeners.resend`, docs/listenerd.md)."""

# One debug line per answer costs a log event per message even when debug is filtered out; the
# daemon turns it on only with --log-level debug (`log_each_answer`).
_log_answers = False


def log_each_answer(enabled: bool) -> None:
    """Log every answer's code and control id at debug level (off by default: it is per message)."""
    global _log_answers
    _log_answers = enabled


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

    @property
    def partial(self) -> bool:
        """A frame has started (``<VT>`` seen) and not ended: the guard times how long it takes."""
        return self._state == self._IN_FRAME

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
# batch_handler(batch, peer): a frame holding an HL7 batch (FHS/BHS first); fires with the whole answer
BatchHandler = Callable[[bytes, IAddress], "Deferred[bytes]"]


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


class MLLPProtocol(OrderedReplyProtocol):
    """One MLLP connection: decode frames, call the handler, write ACKs in arrival order."""

    kind = "MLLP"
    factory: MLLPFactory | None = None

    def __init__(
        self, handler: Handler, *, config: MLLPConfig, clock: IReactorTime, batch_handler: BatchHandler | None = None
    ) -> None:
        super().__init__(
            clock=clock, idle_timeout_seconds=config.idle_timeout_seconds, max_in_flight=config.max_in_flight
        )
        self._handler = handler
        self._batch_handler = batch_handler
        self._config = config
        self._decoder = MLLPDecoder(max_message_bytes=config.max_message_bytes, prefix_bytes=config.prefix_bytes)

    # -- inbound --------------------------------------------------------------------------

    progress_events = (Message, Oversize)

    def decode(self, data: bytes) -> list[MLLPEvent]:
        return self._decoder.feed(data)

    @property
    def receiving(self) -> bool:
        return self._decoder.partial

    def end_of_stream(self) -> None:
        for event in self._decoder.close():
            self.on_event(event)

    def on_event(self, event: object) -> None:
        if isinstance(event, Message):
            self._on_message(event.payload)
        elif isinstance(event, Oversize):
            self._on_oversize(event)
        elif isinstance(event, Garbage):
            _log.warn(
                "skipped {size} byte(s) from {peer}: {reason}",
                size=event.size,
                peer=self.peer_text,
                reason=event.reason.value,
            )

    def _reply(self, slot: Slot, code: AckCode, ack: bytes) -> None:
        """Answer `slot` with `ack` (an ACK with MSA-1 `code`) and count the answer."""
        if self.answer(slot, frame(ack)) and self.factory is not None:
            self.factory.count_ack(code.value)

    def _on_message(self, payload: bytes) -> None:
        if self.factory is not None:
            self.factory.count_received(len(payload))
        if starts_batch(payload):  # told apart once: the batch handler builds it as a batch
            self._on_batch(payload)
            return
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
                peer=self.peer_text,
                reason=exc.reason.value,
            )
            self._refuse_header(exc, str(exc), exc.condition)
            return
        slot = Slot(safe_id(header.control_id))
        self.enqueue(slot)
        assert self.peer is not None
        d = maybeDeferred(self._handler, payload, self.peer, header)
        self.await_answer(d, slot, self._config.handler_timeout_seconds, lambda: self._handler_timed_out(slot, header))
        d.addCallbacks(
            self._handler_done,
            self._handler_failed,
            callbackArgs=(slot, header),
            errbackArgs=(slot, header),
        )
        d.addErrback(self._internal_error, slot)

    def _refuse_header(self, exc: HL7HeaderError, reason: str, why: Condition) -> None:
        """Refuse a message for its header (`why`, ERR) with what of the header could be read: once
        MSH-1/MSH-2 were, the answer is addressed back in the sender's version and charset and
        follows its MSH-15 like any other refusal (an NE or SU sender gets nothing, an ER or AL
        sender in enhanced mode a CR). Before that, nothing can be trusted: original mode, AR with
        default separators (MSA-2 its MSH-10 when that much was readable)."""
        if exc.header is not None:
            slot = Slot(safe_id(exc.header.control_id))
            self.enqueue(slot)
            self._answer(slot, exc.header, AckDecision.reject(reason, error_code=why.code, location=why.location))
            return
        slot = Slot(safe_id(exc.control_id))
        self.enqueue(slot)
        self._reply(slot, AckCode.AR, self._fallback_ack(reason, acked=exc.control_id, why=why))

    def _on_batch(self, payload: bytes) -> None:
        """A frame holding an HL7 batch: the batch handler answers it whole (one ACK, or an ACK
        batch), in arrival order like any message."""
        slot = Slot("batch", weight=max(1, _messages_in(payload)))
        self.enqueue(slot)
        handler = self._batch_handler
        if handler is None:
            refusal = self._fallback_ack(
                "batches are not accepted on this connection", why=Condition(UNSUPPORTED_MESSAGE_TYPE)
            )
            self._reply(slot, AckCode.AR, refusal)
            return
        assert self.peer is not None
        peer = self.peer

        def timed_out() -> None:
            _log.error("handler timed out for a batch from {peer}; answering AE", peer=self.peer_text)
            self._reply(slot, AckCode.AE, self._fallback_ack(NOT_CONFIRMED, code=AckCode.AE))

        def done(ack: bytes) -> None:
            if not slot.ready:
                self._reply(slot, _batch_answer_code(ack), ack)

        def failed(failure: Failure) -> None:
            if slot.ready:
                return
            _log.error(
                "batch handler failed for a batch from {peer}: {error}; answering AE",
                peer=self.peer_text,
                error=failure.type.__name__ if failure.type else "unknown",
            )
            self._reply(slot, AckCode.AE, self._fallback_ack("batch not stored; resend later", code=AckCode.AE))

        def start() -> Deferred[None] | None:
            if not self._connected:  # the sender left while it waited: nothing stored, it resends
                return None
            d = maybeDeferred(handler, payload, peer)
            # The reply timeout counts from here: a turn's wait is bounded by the batches ahead.
            self.await_answer(d, slot, self._config.handler_timeout_seconds, timed_out)
            return d.addCallbacks(done, failed).addErrback(self._internal_error, slot)

        # Large batches take turns process-wide (listeners/batchgate.py): splitting one holds many
        # times its size until it is committed. This connection reads nothing while it waits.
        batchgate.batch_gate.run(len(payload), start)

    def _on_oversize(self, event: Oversize) -> None:
        limit = self._config.max_message_bytes
        if self.factory is not None:
            self.factory.count_received(event.size)
        if starts_batch(event.prefix):  # a batch over the limit: refused whole, the connection stays
            _log.warn(
                "rejecting oversize batch ({size} bytes > {limit}) from {peer}",
                size=event.size,
                limit=limit,
                peer=self.peer_text,
            )
            slot = Slot("batch")
            self.enqueue(slot)
            self._reply(slot, AckCode.AR, self._fallback_ack(f"batch too large: {event.size} bytes, limit {limit}"))
            return
        try:
            header = parse_header(
                event.prefix,
                default_encoding=self._config.default_encoding,
                strict_charset=self._config.strict_charset,
                complete=False,
            )
        except HL7HeaderError as exc:
            _log.warn(
                "rejecting oversize frame ({size} bytes > {limit}) from {peer} with unreadable header ({reason})",
                size=event.size,
                limit=limit,
                peer=self.peer_text,
                reason=exc.reason.value,
            )
            # Refused for its size like any oversize message (207), and the header's own fault is
            # named too; the frame ended at its FS, so the connection goes on with the next one.
            self._refuse_header(exc, f"message too large: {event.size} bytes, limit {limit}; header {exc}", INTERNAL)
            return
        _log.warn(
            "rejecting oversize message {control_id} ({size} bytes > {limit}) from {peer}",
            control_id=safe_id(header.control_id),
            size=event.size,
            limit=limit,
            peer=self.peer_text,
        )
        decision = AckDecision.reject(f"message too large: {event.size} bytes, limit {limit}")
        slot = Slot(safe_id(header.control_id))
        self.enqueue(slot)
        self._answer(slot, header, decision)

    # -- handler outcome ------------------------------------------------------------------

    def _handler_done(self, result: object, slot: Slot, header: HL7Header) -> None:
        if slot.ready:
            return  # already answered (handler timeout)
        if isinstance(result, AckDecision):
            decision = result
        else:
            _log.error(
                "handler returned {type} instead of AckDecision for {control_id}",
                type=type(result).__name__,
                control_id=slot.label,
            )
            decision = AckDecision.error("message not accepted; resend later")
        if _log_answers:
            _log.debug(
                "{code} for {control_id} from {peer}",
                code=decision.code.value,
                control_id=slot.label,
                peer=self.peer_text,
            )
        if header.ack_types is None:  # original mode, the common case: as decided, one call less
            self._reply(slot, *self._ack(header, decision, decision.code))
        else:
            self._answer(slot, header, decision)

    def _handler_failed(self, failure: Failure, slot: Slot, header: HL7Header) -> None:
        if slot.ready:
            return  # already answered (handler timeout); swallows the CancelledError
        # Only the exception type: its text may quote stored values (PHI).
        _log.error(
            "handler failed for {control_id} from {peer}: {error}; answering AE",
            control_id=slot.label,
            peer=self.peer_text,
            error=failure.type.__name__ if failure.type else "unknown",
        )
        self._answer(slot, header, AckDecision.error("message not stored; resend later"))

    def _handler_timed_out(self, slot: Slot, header: HL7Header) -> None:
        _log.error(
            "handler timed out for {control_id} from {peer}; answering AE",
            control_id=slot.label,
            peer=self.peer_text,
        )
        self._answer(slot, header, AckDecision.error(NOT_CONFIRMED))

    def _internal_error(self, failure: Failure, slot: Slot) -> None:
        _log.critical(
            "internal error answering {control_id}: {error}",
            control_id=slot.label,
            error=failure.type.__name__ if failure.type else "unknown",
        )
        if not slot.ready:
            self._reply(slot, AckCode.AE, self._fallback_ack("internal error", code=AckCode.AE))

    # -- ACKs -----------------------------------------------------------------------------

    def _answer(self, slot: Slot, header: HL7Header, decision: AckDecision) -> None:
        """Answer `slot` with `decision` in the sender's acknowledgment mode (`accept_code`): when
        MSH-15 asks for no answer, the slot is still answered in its turn, with nothing written."""
        code: AckCode | None = decision.code
        if header.ack_types is not None:  # MSH-15/16 valued, maybe enhanced (original mode: as decided)
            code = accept_code(header, decision.code)
        if code is None:
            if self.answer(slot, b"") and self.factory is not None:
                self.factory.count_withheld(commit_code(decision.code).value)
            return
        self._reply(slot, *self._ack(header, decision, code))

    def _ack(self, header: HL7Header, decision: AckDecision, code: AckCode) -> tuple[AckCode, bytes]:
        """(the code that goes on the wire, the ACK). A positive ACK is always built (`build_ack`
        falls back to a minimal one); a negative one that fails becomes an internal-error AE/CE."""
        try:
            return code, build_ack(
                header,
                code,
                reason=decision.reason,
                error_code=decision.error_code,
                location=decision.location,
                more=decision.more,
                detail=decision.detail,
                sending_application=self._config.sending_application,
                sending_facility=self._config.sending_facility,
            )
        except Exception as exc:  # never let an ACK bug leave a slot unanswered
            _log.critical(
                "cannot build ACK for {control_id}: {error}",
                control_id=safe_id(header.control_id),
                error=type(exc).__name__,
            )
            return code, self._fallback_ack("internal error", code=code, acked=header.control_id)

    def _fallback_ack(
        self, reason: str, *, code: AckCode = AckCode.AR, acked: str = "", why: Condition | None = None
    ) -> bytes:
        return build_fallback_ack(
            code,
            reason=reason,
            error_code=why.code if why is not None else "207",
            location=why.location if why is not None else None,
            acked_control_id=acked,
            sending_application=self._config.sending_application or "",
            sending_facility=self._config.sending_facility or "",
            version=self._config.fallback_version,
        )


class MLLPFactory(StreamFactory):
    """Builds :class:`MLLPProtocol` instances; the registry enforces ``max_connections``."""

    def __init__(
        self,
        handler: Handler,
        *,
        config: MLLPConfig | None = None,
        clock: IReactorTime | None = None,
        batch_handler: BatchHandler | None = None,
        counters: ListenerCounters | None = None,
    ) -> None:
        super().__init__(counters)
        self.batch_handler = batch_handler
        if clock is None:
            from twisted.internet import reactor

            clock = cast(IReactorTime, reactor)
        self.handler = handler
        self.config = config or MLLPConfig()
        self.clock = clock
        self.max_connections = self.config.max_connections

    # (Twisted's Factory wants a protocol whose `factory` is any Factory; ours names its own)
    def buildProtocol(self, addr: IAddress | None) -> MLLPProtocol:  # type: ignore[override]
        proto = MLLPProtocol(self.handler, config=self.config, clock=self.clock, batch_handler=self.batch_handler)
        proto.factory = self
        return proto


def _messages_in(payload: bytes) -> int:
    """How many messages a batch frame holds (its MSH segments), counted in C, before any split."""
    return payload.count(b"\rMSH") + payload.count(b"\nMSH") + payload.startswith(b"MSH")


def _batch_answer_code(ack: bytes) -> AckCode:
    """The code a batch answer is counted under: its first MSA-1 (an ACK batch: its first ACK's)."""
    msa = b"MSA" + ack[3:4]  # in the ACK's own field separator (MSH-1, BHS-1)
    at = ack.find(msa)
    try:
        return AckCode(ack[at + 4 : at + 6].decode("ascii")) if at >= 0 else AckCode.AA
    except ValueError:
        return AckCode.AA
