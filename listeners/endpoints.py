"""The node's listening services: one `InboundService` per configured inbound connection (bound
or polling only on the leader, see `listeners.gate`) and the `ListeningService` that serves the control plane.

Taking an inbound service down has two steps so a clean stop loses and duplicates nothing:
`stop_intake` (stop listening and polling, stop reading open connections) before the last commits
are drained, and `close` after their answers are written — or at once (`abort`) when the lease is
lost. `stopService` alone does both at once. The services only wire a transport to its listener:
framing and answering live in the transport modules, validation in `listeners.validation`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.logger import Logger

from listeners.connections_config import InboundConfig, TLSConfig
from listeners.dbpoll import DbPoll
from listeners.filedrop import FileDrop
from listeners.group_commit import InboundBatch
from listeners.guard import GuardedFactory, PeerLimits, Refusals
from listeners.hl7ack import (
    AckCode,
    AckDecision,
    batch_header,
    build_ack,
    build_ack_batch,
    build_fallback_ack,
    message_header,
)
from listeners.hl7batch import BatchHeader
from listeners.hl7errors import INTERNAL, Condition
from listeners.hl7msg import HL7Header
from listeners.http_listener import make_inbound_site
from listeners.metrics import Metrics
from listeners.mllp_listener import MLLPConfig, MLLPFactory
from listeners.offload import SEGMENT_WEIGHT, off_reactor
from listeners.server_tls import listen
from listeners.stream import Intake
from listeners.tcp import TCPFactory
from listeners.validation import (
    IngestSink,
    LaneOf,
    PayloadRejected,
    build_batch,
    build_inbound,
    codec_name,
    lane_rule,
    rejection_reason,
)

__all__ = ["InboundService", "ListeningService", "Wiring", "inbound_service", "mllp_batch_handler", "mllp_handler"]

_log = Logger(namespace="stageline.endpoints")


@dataclass(frozen=True)
class Wiring:
    """What every inbound service is wired to: the group-commit writer, the metrics, the reactor,
    and where bound ports are published (useful with port 0)."""

    ingest: IngestSink
    metrics: Metrics
    reactor: Any
    bound_ports: dict[str, int]
    refusals: Refusals | None = None
    store: Callable[[], Any] = lambda: None  # the node's Store (a database poll keeps its watermark there)
    epoch: Callable[[], int | None] = lambda: None  # the lease epoch this node leads under, None if not

    def guard(self, name: str, limits: PeerLimits) -> Callable[[IProtocolFactory, bool], IProtocolFactory]:
        """What `listeners.server_tls.listen` wraps a listener's factory in: its peer limits."""
        refusals = self.refusals or Refusals(self.metrics, self.reactor, interval=limits.log_interval_seconds)
        return lambda factory, tls: GuardedFactory(
            factory, limits, name=name, clock=self.reactor, refusals=refusals, tls=tls
        )


def peer_limits(conn: InboundConfig) -> PeerLimits:
    """An inbound connection's peer limits (`listeners.guard`), from its settings."""
    return PeerLimits(
        max_connections=conn.max_connections,
        max_connections_per_peer=conn.max_connections_per_peer,
        connect_rate_per_peer=conn.connect_rate_per_peer,
        frame_timeout_seconds=conn.frame_timeout_seconds,
        handshake_timeout_seconds=conn.handshake_timeout_seconds,
        max_bytes_per_second_per_peer=conn.max_bytes_per_second_per_peer,
        allowed_sources=tuple(conn.allowed_sources),
    )


class ListeningService(Service):
    """A listening port (TLS when configured) for as long as the service runs."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        factory: IProtocolFactory,
        tls: TLSConfig | None,
        *,
        reactor: Any,
        on_bound: Callable[[int], None] | None = None,
        guard: Callable[[IProtocolFactory, bool], IProtocolFactory] | None = None,
    ) -> None:
        self.setName(name)
        self.host, self.port, self.factory, self.tls = host, port, factory, tls
        self._guard = guard
        self._reactor = reactor
        self._on_bound = on_bound
        self.listening: IListeningPort | None = None

    def startService(self) -> None:
        self.listening = listen(self._reactor, self.host, self.port, self.factory, self.tls, guard=self._guard)
        super().startService()
        if self._on_bound is not None:
            self._on_bound(bound_port(self.listening))

    def stopService(self) -> Deferred[None]:
        super().stopService()
        port, self.listening = self.listening, None
        return stop_listening(port)


def bound_port(port: IListeningPort) -> int:
    """The TCP port a listening port is bound to (the one the OS chose for port 0)."""
    address = port.getHost()
    assert isinstance(address, (IPv4Address, IPv6Address))  # every listener here is TCP
    return address.port


def stop_listening(port: IListeningPort | None) -> Deferred[None]:
    """Stop `port` if it still listens: fires once it has (`maybeDeferred(port.stopListening)`)."""
    if port is None or not getattr(port, "connected", False):  # tcp.Port's flag; IListeningPort lacks it
        return defer.succeed(None)
    try:
        stopped = port.stopListening()
    except Exception:
        return defer.fail()
    return stopped if stopped is not None else defer.succeed(None)


class InboundService(Service):
    """One inbound connection while bound: a listening port and its open connections, or a polled
    directory. A bind that fails leaves the others bound (`bound` stays False, `bind_error` says why;
    the leader gate logs it and retries)."""

    def __init__(
        self,
        conn: InboundConfig,
        wiring: Wiring,
        *,
        intake: Intake | None = None,
        start: Callable[[], None] | None = None,
        stop: Callable[[], Deferred[None]] | None = None,
        failure: Callable[[], str | None] | None = None,
        proven: Callable[[], bool] | None = None,
    ) -> None:
        self.setName(conn.name)
        self.conn = conn
        self._wiring = wiring
        self._intake = intake  # a socket listener's open connections
        self._start_polling = start  # a polled directory instead
        self._stop_polling = stop
        self._port: IListeningPort | None = None
        self.bound = False
        self.bind_error: str | None = None  # why the last start did not bind (the gate logs and retries it)
        self._failure = failure  # a polled directory's: why its last poll failed after it bound
        self._proven = proven  # a polled directory's: a poll has done its work since it was bound

    def failing(self) -> str | None:
        """Why this bound inbound cannot do its work now (a polled directory that went away after it
        bound); None while it can. The gate then treats it as unbound: retried, reported, and past the
        grace a reason to step down."""
        return self._failure() if self.bound and self._failure is not None else None

    def proven(self) -> bool:
        """Bound and shown to work (a listening port: at once; a polled directory: after a good poll)."""
        return self.bound and (self._proven is None or self._proven())

    def startService(self) -> None:
        super().startService()
        conn = self.conn
        try:
            if self._intake is not None:
                factory = cast(IProtocolFactory, self._intake)  # stream factories and the HTTP site are
                self._port = listen(
                    self._wiring.reactor,
                    conn.host,
                    conn.port,
                    factory,
                    conn.tls,
                    guard=self._wiring.guard(conn.name, peer_limits(conn)),
                )
                self._wiring.bound_ports[conn.name] = bound_port(self._port)
            elif self._start_polling is not None:
                self._start_polling()
            self.bound = True
        except Exception as exc:
            self.bind_error = str(exc) or type(exc).__name__  # logged by the gate, once per state change

    def stop_intake(self) -> Deferred[None]:
        """Take nothing new; fires once nothing more is read (a file drop: the file in hand is done)."""
        if not self.bound:
            return defer.succeed(None)
        self.bound = False
        if self._intake is None:
            return self._stop_polling() if self._stop_polling is not None else defer.succeed(None)
        self._wiring.bound_ports.pop(self.conn.name, None)
        port, self._port = self._port, None
        d = stop_listening(port)
        self._intake.stop_reading()
        return d

    def close(self, abort: bool) -> None:
        """Close open connections: abort at once, or flush the answers written first."""
        if self._intake is None:
            return
        if abort:
            self._intake.disconnect_all()
        else:
            self._intake.close_all()

    def open_connections(self) -> int:
        return self._intake.active_connections if self._intake is not None else 0

    @defer.inlineCallbacks
    def stopService(self) -> Any:
        """On its own (not through the gate's ordered stop): stop intake, drop what is open."""
        super().stopService()
        if self.bound:
            yield self.stop_intake()
            self.close(True)


def mllp_handler(
    conn: InboundConfig, wiring: Wiring, lane_of: LaneOf | None
) -> Callable[[bytes, Any, HL7Header], Deferred[AckDecision]]:
    """MLLP's handover: validate like every transport, submit, map the commit outcome to an ACK
    decision (the protocol counts what it received and answered)."""

    def build(message: bytes, header: HL7Header) -> Any:
        return build_inbound(
            message,
            connection=conn.name,
            charset=conn.charset,
            lane_of=lane_of,
            header=header,
            conformance=conn.conformance,
        )

    def refused(exc: PayloadRejected, header: HL7Header) -> AckDecision:
        _log.warn(
            "rejecting message {control_id} on {connection}: {reason}",
            control_id=header.control_id[:64],
            connection=conn.name,
            reason=str(exc),
        )
        why = exc.condition
        return AckDecision.reject(
            str(exc), error_code=why.code, location=why.location, more=exc.more, detail=exc.detail
        )

    def failed(f: Any) -> AckDecision:
        reason, code = rejection_reason(f)
        return AckDecision(AckCode(code), reason)

    def submit(item: Any) -> Deferred[AckDecision]:
        return wiring.ingest.submit(item).addCallbacks(lambda _: AckDecision.accept(), failed)

    def handle(message: bytes, peer: Any, header: HL7Header) -> Deferred[AckDecision]:
        if conn.conformance is not None:
            # A profile's check is work in proportion to the message's bytes and its segments (a
            # short segment costs a structure step all the same): a large one runs on a thread.
            weight = max(len(message), message.count(b"\r") * SEGMENT_WEIGHT)
            built = off_reactor(wiring.reactor, weight, build, message, header)

            def refusal(f: Any) -> AckDecision:
                f.trap(PayloadRejected)
                return refused(f.value, header)

            return built.addCallbacks(submit, refusal)
        try:
            item = build(message, header)
        except PayloadRejected as exc:
            return defer.succeed(refused(exc, header))
        return submit(item)

    return handle


def mllp_batch_handler(
    conn: InboundConfig, wiring: Wiring, lane_of: LaneOf | None
) -> Callable[[bytes, Any], Deferred[bytes]]:
    """MLLP's handover of a batch in one frame: validate and split like every transport, submit it
    as one unit, answer per HL7 batch rules — one ACK for the batch (MSA-2 = its BHS-11, else
    FHS-11), or with ``batch_ack = "messages"`` an ACK batch of one AA per message. A refused or
    unstored batch is always one ACK (AR/AE) naming the reason: nothing of it was staged, or (a
    large batch committed in parts, `listeners.commitplan`) which of its messages were. The frame is
    counted (received, its answer) by the MLLP protocol that hands it over, as every frame is."""

    def answer(
        envelope: BatchHeader | None,
        code: AckCode,
        reason: str = "",
        first: str = "",
        encoding: str = "ascii",
        why: Condition = INTERNAL,
        more: tuple[tuple[Condition, str], ...] = (),
        detail: str = "",
    ) -> bytes:
        if envelope is None:
            return build_fallback_ack(code, reason=reason, error_code=why.code, location=why.location)
        head = batch_header(envelope, first_message=first, encoding=encoding)
        return build_ack(
            head, code, reason=reason, error_code=why.code, location=why.location, more=more, detail=detail
        )

    def handle(data: bytes, peer: Any) -> Deferred[bytes]:
        # A large batch is long work to split: off the reactor (listeners/offload.py), as is its ACK batch.
        built = off_reactor(
            wiring.reactor,
            len(data),
            build_batch,
            data,
            connection=conn.name,
            charset=conn.charset,
            lane_of=lane_of,
            conformance=conn.conformance,
        )
        return built.addCallbacks(submit, refused)

    def refused(f: Any) -> bytes:
        f.trap(PayloadRejected)
        exc = f.value
        head = getattr(exc, "header", None)
        _log.warn(
            "rejecting batch {control_id} on {connection}: {reason}",
            connection=conn.name,
            control_id=(head.control_id if head else "")[:64] or "-",
            reason=str(exc),
        )
        return answer(head, AckCode.AR, str(exc), why=exc.condition, more=exc.more, detail=exc.detail)

    def submit(batch: InboundBatch) -> Deferred[bytes]:
        envelope: BatchHeader = batch.envelope
        first = batch.items[0] if batch.items else None
        text, codec = (first.payload, first.charset or "ascii") if first else ("", "ascii")

        def acks() -> bytes:
            return build_ack_batch(
                batch_header(envelope, first_message=text, encoding=codec),
                [build_ack(message_header(i.payload, encoding=i.charset or codec), AckCode.AA) for i in batch.items],
            )

        def one_aa(f: Any = None) -> bytes:
            # Staged: the answer is an AA whatever fails in building the ACK batch (`build_ack`'s
            # own AA cannot fail), never the "not stored" of a failed handler.
            if f is not None:
                _log.critical(
                    "ACK batch for {control_id} not built ({error}); one AA instead",
                    control_id=envelope.control_id[:64],
                    error=f.type.__name__ if f.type else "unknown",
                )
            return answer(envelope, AckCode.AA, first=text, encoding=codec)

        def ok(_: str) -> bytes | Deferred[bytes]:
            if conn.batch_ack == "messages":
                return off_reactor(wiring.reactor, 100 * len(batch.items), acks).addErrback(one_aa)
            return one_aa()

        def failed(f: Any) -> bytes:
            reason, code = rejection_reason(f)
            return answer(envelope, AckCode(code), reason, first=text, encoding=codec)

        return wiring.ingest.submit(batch).addCallbacks(ok, failed)

    return handle


def _mllp(conn: InboundConfig, wiring: Wiring, lane_of: LaneOf | None) -> InboundService:
    factory = MLLPFactory(
        mllp_handler(conn, wiring, lane_of),
        clock=wiring.reactor,
        config=MLLPConfig(
            max_message_bytes=conn.max_message_bytes,
            idle_timeout_seconds=conn.idle_timeout_seconds,
            max_connections=conn.max_connections,
            default_encoding=codec_name(conn.charset),
        ),
        batch_handler=mllp_batch_handler(conn, wiring, lane_of),
        counters=wiring.metrics.listener(conn.name, "mllp"),
    )
    return InboundService(conn, wiring, intake=factory)


def _tcp(conn: InboundConfig, wiring: Wiring, lane_of: LaneOf | None) -> InboundService:
    factory = TCPFactory(wiring.ingest, conn, lane_of=lane_of, metrics=wiring.metrics, clock=wiring.reactor)
    return InboundService(conn, wiring, intake=factory)


def _http(conn: InboundConfig, wiring: Wiring, lane_of: LaneOf | None) -> InboundService:
    site = make_inbound_site(wiring.ingest, [conn], lane_of=lane_of, metrics=wiring.metrics, reactor=wiring.reactor)
    return InboundService(conn, wiring, intake=site)  # type: ignore[arg-type]  # _InboundSite is an Intake


def _file(conn: InboundConfig, wiring: Wiring, lane_of: LaneOf | None) -> InboundService:
    drop = FileDrop(wiring.ingest, conn, lane_of=lane_of, metrics=wiring.metrics, reactor=wiring.reactor)

    def start() -> None:
        try:  # not mounted yet, replaced, a symlink: unbound, so the leader retries or steps down
            drop.open_dirs()
        except OSError as exc:
            raise OSError(
                exc.errno, f"file drop {drop.directory} is missing or unusable: {exc.strerror or exc}"
            ) from exc
        drop.start()

    return InboundService(conn, wiring, start=start, stop=drop.stop, failure=drop.failure, proven=drop.proven)


def _database(conn: InboundConfig, wiring: Wiring, lane_of: LaneOf | None) -> InboundService:
    poll = DbPoll(
        wiring.ingest,
        conn,
        store=wiring.store,
        epoch=wiring.epoch,
        lane_of=lane_of,
        metrics=wiring.metrics,
        reactor=wiring.reactor,
    )
    return InboundService(conn, wiring, start=poll.start, stop=poll.stop)


_KINDS: dict[str, Callable[[InboundConfig, Wiring, LaneOf | None], InboundService]] = {
    "mllp": _mllp,
    "tcp": _tcp,
    "http": _http,
    "file": _file,
    "database": _database,
}


def inbound_service(conn: InboundConfig, wiring: Wiring) -> InboundService:
    """The (not yet started) service for one configured inbound connection."""
    return _KINDS[conn.kind](conn, wiring, lane_rule(conn.lane_key))
