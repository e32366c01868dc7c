"""What the stream transports (MLLP, raw TCP) share: answers in arrival order, and the registry of
open connections through which the node takes them down.

Commits finish in any order, but a sender matches answers to messages by position, so each message
takes a `Slot` when it arrives and `flush` writes the ready slots at the head of the queue, stopping
at the first that is still waiting. Reading pauses while `max_in_flight` answers are owed (memory
stays bounded; an HL7 batch owes one per message, so a large batch pauses reading until it is
answered) and resumes as they go out. A message whose commit does not fire within the reply
timeout gets the transport's "not stored, resend" answer; the late outcome is then ignored.

Answers a peer does not read are bounded too: the protocol is its transport's streaming producer,
so once the transport holds more unsent bytes than its buffer size (64 KB) Twisted pauses it and
reading stops until the peer has read them; a peer that reads none of its answers for
`idle_timeout` (`WRITE_TIMEOUT_SECONDS` when there is none) is cut off (aborted: its bytes would
never drain). Without this, every answer written to a peer that never reads stayed in memory.

`StreamFactory` is the connection registry: it admits connections up to `max_connections` and takes
them all down in the two steps of a clean stop (`stop_reading`, then `close_all` after the answers)
or at once (`disconnect_all`, on losing the lease). The HTTP site offers the same three calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar
from typing import Protocol as TypingProtocol

from twisted.internet import tcp
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime, ISSLTransport
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.logger import Logger
from twisted.protocols.policies import TimeoutMixin
from twisted.python.failure import Failure

from listeners.guard import GuardedProtocol
from listeners.linger import close_after_answers

if TYPE_CHECKING:
    from listeners.metrics import ListenerCounters

__all__ = [
    "WRITE_TIMEOUT_SECONDS",
    "Intake",
    "OrderedReplyProtocol",
    "Slot",
    "StreamFactory",
    "describe_peer",
    "safe_id",
    "write_now",
]

WRITE_TIMEOUT_SECONDS = 300.0
"""How long a peer may leave its answers unread when its connection has no idle timeout."""

_log = Logger(namespace="stageline.stream")


class Intake(TypingProtocol):
    """How the node takes an inbound listener's open connections down (stream factories, HTTP site)."""

    @property
    def active_connections(self) -> int: ...

    def stop_reading(self) -> None: ...

    def close_all(self) -> None: ...

    def disconnect_all(self) -> None: ...


@dataclass(slots=True, eq=False)
class Slot:
    """One received message awaiting its turn to be answered."""

    label: str = ""  # what log lines call it (a control id), never content
    reply: bytes | None = None  # the framed answer, once known
    close: bool = False  # close the connection after this slot (after its reply, if any)
    deadline: float | None = None  # when its outcome is overdue (see `await_answer`)
    weight: int = 1  # messages it answers (an HL7 batch: its messages), counted against max_in_flight
    on_timeout: Callable[[], None] | None = None
    outcome: Deferred[Any] | None = None  # cancelled once overdue

    @property
    def ready(self) -> bool:
        return self.reply is not None or self.close

    def forget_deadline(self) -> None:
        self.deadline = self.on_timeout = self.outcome = None


def write_now(transport: Any, data: bytes) -> None:
    """`transport.write`, except that on a plain TCP connection with nothing buffered the bytes go
    to the socket at once.

    Twisted's `write` only buffers and asks the reactor for the socket's writability, and the bytes
    leave on its next turn: two `epoll_ctl` calls and one more dispatch for each answer (most of
    what an ACK cost). When nothing is buffered, sending now keeps the order; whatever the socket
    does not take (or a send that fails) goes through `write` as before, whose next turn finds any
    error. Anything else (TLS, a test transport, a connection closing) takes `write` unchanged.
    """
    if type(transport) is GuardedProtocol:  # the guard only watches; TLS below it is another type
        transport = transport.transport
    if (
        type(transport) is tcp.Server
        and transport.connected
        and not transport.disconnecting
        and not transport._writeDisconnected
        and not transport._tempDataLen
        and len(transport.dataBuffer) == transport.offset
    ):
        sent = transport.writeSomeData(data)
        if isinstance(sent, int):
            if sent == len(data):
                return
            data = data[sent:]
    transport.write(data)


def describe_peer(peer: IAddress | Any) -> str:
    """``host:port`` for a log line."""
    host, port = getattr(peer, "host", None), getattr(peer, "port", None)
    return f"{host}:{port}" if host is not None else str(peer)


def safe_id(control_id: str) -> str:
    """A control id fit for a log line: bounded, no control characters."""
    control_id = control_id[:64]
    if control_id.isprintable():  # the common case, without a pass per character
        return control_id
    return "".join(ch if ch.isprintable() else "?" for ch in control_id)


class StreamFactory(ServerFactory):
    """The registry of one listener's open connections, and its counters; subclasses build the protocol."""

    max_connections: int = 64
    clock: IReactorTime

    def __init__(self, counters: ListenerCounters | None = None) -> None:
        self._connections: set[OrderedReplyProtocol] = set()
        self.counters = counters

    @property
    def active_connections(self) -> int:
        return len(self._connections)

    def register(self, proto: OrderedReplyProtocol) -> bool:
        """Admit a new connection unless the limit is reached (the caller then closes it)."""
        if len(self._connections) >= self.max_connections:
            return False
        self._connections.add(proto)
        self.connections_changed(len(self._connections))
        return True

    def unregister(self, proto: OrderedReplyProtocol) -> None:
        self._connections.discard(proto)
        self.connections_changed(len(self._connections))

    def connections_changed(self, count: int) -> None:
        if self.counters is not None:
            self.counters.open_connections(count)

    def count_received(self, size: int) -> None:
        if self.counters is not None:
            self.counters.received(size)

    def count_ack(self, code: str) -> None:
        if self.counters is not None:
            self.counters.answered(code)

    def count_withheld(self, code: str) -> None:
        if self.counters is not None:
            self.counters.withheld(code)

    def disconnect_all(self) -> None:
        """Drop every connection at once, e.g. when this node loses the leader lease.

        Unanswered messages get no answer; senders resend (at-least-once)."""
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


class OrderedReplyProtocol(Protocol, TimeoutMixin):
    """One stream connection: decode, hand each message over, answer in arrival order.

    Subclasses give `decode` (bytes to events, pure) and `on_event` (hand over, `enqueue` a slot,
    `flush` when its answer is known); `end_of_stream` sees the decoder's last events."""

    kind: ClassVar[str] = "stream"  # for log lines
    factory: StreamFactory | None = None
    progress_events: ClassVar[tuple[type, ...]] = (object,)
    """Events that complete a message (counted in `units`; skipped noise is not progress)."""
    units = 0
    """Messages completed on this connection (`listeners.guard` watches it)."""

    # The connection: TCP, TLS or the guard's wrapper, a push producer that can abort (Twisted says
    # only ITransport).
    transport: Any

    def __init__(self, *, clock: IReactorTime, idle_timeout_seconds: float | None, max_in_flight: int) -> None:
        self._clock = clock
        self._idle_timeout = idle_timeout_seconds
        self._max_in_flight = max_in_flight
        self._slots: deque[Slot] = deque()
        self._owed = 0  # the slots' weight: messages whose answer is owed
        self._accepting = False  # False before connectionMade, after a close decision, or lost
        self._connected = False
        self._registered = False
        self._paused = False
        self._draining = False  # a clean stop: read nothing more, still answer what was read
        self.peer: IAddress | None = None
        self.peer_text = "?"
        self._overdue_check: IDelayedCall | None = None  # one per connection, not one per message
        self._write_blocked = False  # the transport's unsent bytes are over its buffer size
        self._write_stall: IDelayedCall | None = None  # cuts off a peer that does not read its answers

    def callLater(self, period: float, func: Callable[[], object]) -> IDelayedCall:
        """TimeoutMixin schedules through this: on this connection's clock, not the global reactor."""
        return self._clock.callLater(period, func)

    @property
    def in_flight(self) -> int:
        """Messages received whose answer has not been written yet."""
        return len(self._slots)

    @property
    def receiving(self) -> bool:
        """Part of a message is buffered (the decoder's; `listeners.guard` times it)."""
        return False

    def evict(self) -> None:
        """The guard is closing this connection: leave the registry now, so its place is free for
        the connection being admitted instead of on the next reactor turn."""
        self._accepting = False
        if self._registered and self.factory is not None:
            self.factory.unregister(self)
            self._registered = False

    def where(self) -> str:
        """The connection as log lines name it."""
        return f"from {self.peer_text}"

    # -- to implement ---------------------------------------------------------------------

    def decode(self, data: bytes) -> Iterable[object]:
        raise NotImplementedError

    def on_event(self, event: object) -> None:
        raise NotImplementedError

    def end_of_stream(self) -> None:
        """The connection is gone; the decoder may hold a last event."""

    # -- connection lifecycle -------------------------------------------------------------

    def connectionMade(self) -> None:
        self.peer = self.transport.getPeer()
        self.peer_text = describe_peer(self.peer)
        self._connected = True
        if self.factory is not None and not self.factory.register(self):
            _log.warn("refusing {kind} connection {where}: max_connections reached", kind=self.kind, where=self.where())
            self._connected = False
            self.close_transport()
            return
        self._registered = self.factory is not None
        self._accepting = True
        self.setTimeout(self._idle_timeout)
        self.transport.registerProducer(self, True)  # pauseProducing when answers are not being read

    # -- IPushProducer: the transport says whether the peer reads what we write -------------------

    def pauseProducing(self) -> None:
        """The transport holds more unsent answers than its buffer size: read nothing more until
        the peer has read them, and cut it off if it reads none of them within the write timeout."""
        if not self._connected:
            return
        if not self._write_blocked:
            self._write_blocked = True
            seconds = self._idle_timeout or WRITE_TIMEOUT_SECONDS
            self._write_stall = self._clock.callLater(seconds, self._cut_off_stalled_reader, seconds)
        # Each write past the buffer size asks again: pause reading even if we think it is paused,
        # since the guard's bandwidth throttle resumes the transport when its allowance refills.
        self._paused = True
        self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        """The peer read its answers: reading may go on."""
        if not self._write_blocked:
            return
        self._write_blocked = False
        self._cancel_write_stall()
        if self._connected:
            self._sync_reading()

    def stopProducing(self) -> None:
        """The transport is going away (`connectionLost` does the clean-up)."""
        self._cancel_write_stall()

    def _cancel_write_stall(self) -> None:
        if self._write_stall is not None and self._write_stall.active():
            self._write_stall.cancel()
        self._write_stall = None

    def _cut_off_stalled_reader(self, seconds: float) -> None:
        self._write_stall = None
        if not self._connected or not self._write_blocked:
            return
        _log.warn(
            "closing {kind} connection {where}: it has read none of its answers for {seconds:.0f}s",
            kind=self.kind,
            where=self.where(),
            seconds=seconds,
        )
        self._accepting = False
        self.transport.abortConnection()  # a close would wait for the peer to read what is buffered

    def _sync_reading(self) -> None:
        """Pause or resume reading: paused while `max_in_flight` answers are owed, while answers
        are not being read (`pauseProducing`), and for good once draining."""
        want = self._draining or self._write_blocked or self._owed >= self._max_in_flight
        if want and not self._paused:
            self._paused = True
            self.transport.pauseProducing()
        elif not want and self._paused and self._connected:
            self._paused = False
            self.transport.resumeProducing()

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._accepting = False
        self._connected = False
        self.setTimeout(None)
        if self._overdue_check is not None and self._overdue_check.active():
            self._overdue_check.cancel()
        self._overdue_check = None
        self._cancel_write_stall()
        for slot in self._slots:
            slot.forget_deadline()
        if self._slots:
            _log.info(
                "{kind} connection {where} lost with {count} unanswered message(s)",
                kind=self.kind,
                where=self.where(),
                count=len(self._slots),
            )
        self._slots.clear()
        self._owed = 0
        self.end_of_stream()
        if self._registered and self.factory is not None:
            self.factory.unregister(self)
            self._registered = False

    def stop_reading(self) -> None:
        """A clean stop: read nothing more from this peer; what was read is still answered."""
        self._draining = True
        self._accepting = False
        if self._connected and not self._paused:
            self._paused = True
            self.transport.pauseProducing()

    def timeoutConnection(self) -> None:
        if self._slots:  # the sender is idle because it waits on us; the reply timeout bounds that
            self.setTimeout(self.timeOut)
            return
        _log.info("closing idle {kind} connection {where}", kind=self.kind, where=self.where())
        self._accepting = False
        self.close_transport()

    def close_transport(self) -> None:
        """Close once what was written is out. Over TLS: close_notify after it, and the socket is
        closed as soon as the peer has acknowledged it all (`listeners.linger`, bounded), never
        waiting for the peer's close_notify: Twisted's `loseConnection` would, and a peer that
        stopped talking never sends one, so its socket, descriptor and guard slot stayed held
        until the peer closed TCP (a client that finished its handshake and fell silent: for good)."""
        if ISSLTransport.providedBy(self.transport):
            close_after_answers(self.transport, self._clock)
        else:
            self.transport.loseConnection()

    def stop_accepting(self) -> None:
        """Read no more messages from this connection (answers still go out)."""
        self._accepting = False

    # -- inbound --------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if not self._accepting:
            return
        self.resetTimeout()
        for event in self.decode(data):
            if not self._accepting:
                break
            if isinstance(event, self.progress_events):
                self.units += 1
            self.on_event(event)

    def await_answer(self, d: Deferred[Any], slot: Slot, timeout: float | None, on_timeout: Callable[[], None]) -> None:
        """Bound the wait for a handed-over message's outcome: `on_timeout` answers it at `timeout`.

        One timer per connection, set for the earliest deadline, rather than one per message."""
        if timeout is None or d.called:
            return
        slot.deadline = deadline = self._clock.seconds() + timeout
        slot.on_timeout, slot.outcome = on_timeout, d
        check = self._overdue_check
        if check is None or not check.active():
            self._overdue_check = self._clock.callLater(timeout, self._answer_overdue)
        elif deadline < check.getTime():
            check.reset(timeout)

    def _answer_overdue(self) -> None:
        """Answer every message past its deadline; set the timer for the next deadline, if any."""
        self._overdue_check = None
        now = self._clock.seconds()
        upcoming: float | None = None
        for slot in list(self._slots):
            if not self._connected:
                return
            if slot.ready or slot.deadline is None:
                continue
            if slot.deadline <= now + 1e-6:  # (the timer's own arithmetic may round a hair early)
                on_timeout, d = slot.on_timeout, slot.outcome
                slot.forget_deadline()
                assert on_timeout is not None and d is not None
                on_timeout()
                d.cancel()
            elif upcoming is None or slot.deadline < upcoming:
                upcoming = slot.deadline
        if upcoming is not None and self._connected:
            self._overdue_check = self._clock.callLater(upcoming - now, self._answer_overdue)

    # -- outbound -------------------------------------------------------------------------

    def enqueue(self, slot: Slot) -> None:
        self._slots.append(slot)
        self._owed += slot.weight
        if not self._paused and self._owed >= self._max_in_flight:
            self._sync_reading()

    def answer(self, slot: Slot, reply: bytes) -> bool:
        """Give ``slot`` its reply and write what is ready; False if it was already answered."""
        if slot.ready:
            return False
        slot.forget_deadline()
        slot.reply = reply
        self.flush()
        return True

    def flush(self) -> None:
        """Write every answer at the head of the queue that is ready; stop at the first that is not."""
        while self._slots and self._slots[0].ready:
            slot = self._slots.popleft()
            self._owed -= slot.weight
            if not self._connected:
                continue
            if slot.reply:  # (b"": answered with nothing, e.g. MSH-15 = NE)
                write_now(self.transport, slot.reply)
            if slot.close:
                self._accepting = False
                self._connected = False
                self.close_transport()
                return
            if not self._slots:
                self.resetTimeout()  # from now on the sender is the one we wait for: idle starts here
        if self._paused and self._connected:
            self._sync_reading()
