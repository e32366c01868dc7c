"""HTTP inbound: ``POST /messages/{connection}`` with one message as the body, answered after commit.

Answers (always a small JSON object, never message content):

====  =================================================================================
202   ``{"message_id": ...}`` — the row is committed; for an HL7 batch (split into its messages,
      all committed together) ``{"batch_id": ..., "message_ids": [...]}``
400   empty body, undecodable body, a charset outside HL7 table 0211 (the JSON names the accepted
      ones under ``accepted``), text no store can hold (NUL), or the store
      refused this very message (not stored; resending it unchanged will not help). A body refused
      as malformed also says what MLLP's ERR would: ``"hl7_error": {"code": "101", "text":
      "Required field missing", "location": "MSH^1^10"}`` (HL7 table 0357, ERR-2)
404   no http connection of that name
405   any method but POST (``Allow: POST``)
413   body over the connection's ``max_message_bytes``
415   a Content-Type other than text/*, application/hl7-v2 (+er7), or none
500   an unexpected failure (not stored)
503   ingest refused it: not the leader, the store is unavailable, or the node is stopping (not stored)
====  =================================================================================

The body is never buffered beyond the limit and never spilled to a temp file (PHI): a
Content-Length over the limit is answered with 413 as soon as the headers are in, without reading
the body, and the connection is closed; a chunked body is cut off the same way once it passes the
limit. The access log shows the path's connection and ``?<redacted>`` for any query string, never
a body. The charset is the Content-Type's ``charset`` parameter, else the connection's; an HL7
payload declaring a known MSH-18 is decoded with that (see :func:`listeners.validation.build_inbound`).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from io import BytesIO
from typing import TYPE_CHECKING, Any

from twisted.internet import threads
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import _escape
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from include.fhir_options import FHIR_CONTENT_TYPE
from listeners import access_log, batchgate
from listeners.connections_config import InboundConfig
from listeners.fhir_inbound import FHIR_MEDIA_TYPES, FhirRejected, build_fhir, load_models, operation_outcome
from listeners.fhir_pool import RETRY_AFTER_SECONDS, FhirPool, PoolFull
from listeners.group_commit import Inbound, InboundBatch, IngestRejected, RowRefused
from listeners.guard import guard_channels
from listeners.linger import close_after_answers
from listeners.offload import OFFLOAD_BYTES
from listeners.stream import describe_peer
from listeners.validation import (
    ACCEPTED_CHARSETS,
    IngestSink,
    LaneOf,
    PayloadRejected,
    build_inbound,
    codec_name,
    rejection_reason,
)

if TYPE_CHECKING:
    from listeners.metrics import ListenerCounters, Metrics

__all__ = ["InboundResource", "make_inbound_site"]

_log = Logger(namespace="stageline.http")

PREFIX = b"/messages/"
#: Bodies of this size or more are validated (decoded, split, checked) on a thread, not the reactor
#: (the same threshold as MLLP batches, `listeners.offload`).
OFF_REACTOR_BYTES = OFFLOAD_BYTES
HL7_MEDIA_TYPES = frozenset({"application/hl7-v2", "application/hl7-v2+er7", "x-application/hl7-v2+er7"})


class InboundResource(Resource):
    """Serves every configured http connection under ``/messages/{name}``."""

    isLeaf = True

    def __init__(
        self,
        ingest: IngestSink,
        connections: Iterable[InboundConfig],
        *,
        lane_of: LaneOf | Mapping[str, LaneOf] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__()
        self.ingest = ingest
        self.connections: dict[str, InboundConfig] = {}
        for conn in connections:
            if conn.kind != "http":
                raise ValueError(f"{conn.name}: not an http connection (kind {conn.kind!r})")
            codec_name(conn.charset)
            self.connections[conn.name] = conn
        if any("fhir" in conn.accept for conn in self.connections.values()):
            load_models()
        self._lane_of = lane_of
        self.metrics = metrics
        self._counters: dict[str, ListenerCounters] = (
            {name: metrics.listener(name, "http") for name in self.connections} if metrics is not None else {}
        )
        self.draining = False  # a clean stop: take nothing new, answer what was taken
        self.fhir_pool: FhirPool | None = None  # FHIR bodies' own threads, made with the first one

    def connection_for(self, path: bytes) -> InboundConfig | None:
        """The connection a request path names, or None (404)."""
        path = path.split(b"?", 1)[0]
        if not path.startswith(PREFIX):
            return None
        name = path[len(PREFIX) :]
        if name.endswith(b"/"):
            name = name[:-1]
        return self.connections.get(name.decode("ascii", "replace"))

    def lane_of(self, name: str) -> LaneOf | None:
        if isinstance(self._lane_of, Mapping):
            return self._lane_of.get(name)
        return self._lane_of

    def render(self, request: Request) -> bytes | int:
        conn = self.connection_for(request.path)
        if conn is None:
            return _json(request, 404, {"error": "unknown connection"})
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            return _json(request, 405, {"error": "method not allowed; use POST"})
        self._count(conn, received=getattr(request, "_received", 0))
        if self.draining:
            return self._refuse(request, conn, 503, "shutting down, resend later", code="AE")
        media, charset = _content_type(request.getHeader(b"content-type"))
        if media in FHIR_MEDIA_TYPES or (media == "application/json" and conn.accept == ("fhir",)):
            return self._render_fhir(request, conn, charset)
        if "hl7v2" not in conn.accept:
            return self._refuse_fhir(request, conn, FhirRejected(415, "not-supported", _FHIR_ONLY))
        if media and not (media.startswith("text/") or media in HL7_MEDIA_TYPES):
            return self._refuse(request, conn, 415, _unsupported(conn))
        try:  # an allowlist (HL7 table 0211): the client must not choose any decoder Python has
            codec = codec_name(charset or conn.charset)
        except ValueError as exc:
            return self._refuse(request, conn, 400, str(exc), accepted=list(ACCEPTED_CHARSETS))
        assert request.content is not None
        body = request.content.read(conn.max_message_bytes + 1)
        if len(body) > conn.max_message_bytes:
            return self._refuse(request, conn, 413, _too_large(len(body), conn.max_message_bytes))
        if not body:
            return self._refuse(request, conn, 400, "empty message")
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        build = partial(
            build_inbound,
            body,
            connection=conn.name,
            charset=codec,
            lane_of=self.lane_of(conn.name),
            hl7_only=conn.hl7_only,
            conformance=conn.conformance,
        )
        if len(body) < OFF_REACTOR_BYTES:
            try:
                item = build()
            except PayloadRejected as exc:
                return self._refuse(request, conn, 400, str(exc), hl7_error=_hl7_error(exc))
            self._submit(request, conn, gone, item)
            return NOT_DONE_YET

        return self._build_on_a_thread(request, conn, gone, build, len(body))

    def _build_on_a_thread(
        self,
        request: Request,
        conn: InboundConfig,
        gone: list[bool],
        build: Callable[[], Inbound | InboundBatch],
        size: int,
    ) -> int:
        """Build a large HL7 body (a batch of thousands of messages is split, each validated) on a
        thread, so the reactor's turn stays short whatever the body holds; requests on one
        connection are handled one at a time, so nothing is reordered. Large bodies take turns
        process-wide (listeners/batchgate.py) until answered: building one holds many times its
        size until it is committed."""

        def work() -> Deferred[None]:
            built = threads.deferToThread(build)
            return built.addCallbacks(
                lambda item: self._submit(request, conn, gone, item), self._not_built, errbackArgs=(request, conn, gone)
            )

        answered = batchgate.batch_gate.run(size, work)
        answered.addErrback(lambda f: _log.failure("answering a POST to {name} failed", f, name=conn.name))
        return NOT_DONE_YET

    def _render_fhir(self, request: Request, conn: InboundConfig, charset: str) -> bytes | int:
        """A FHIR JSON body (`listeners.fhir_inbound`): validated, then staged like any message;
        refusals are OperationOutcomes."""
        if "fhir" not in conn.accept:
            return self._refuse(request, conn, 415, _unsupported(conn))
        assert request.content is not None
        body = request.content.read(conn.max_message_bytes + 1)
        if len(body) > conn.max_message_bytes:
            too_long = FhirRejected(413, "too-long", _too_large(len(body), conn.max_message_bytes))
            return self._refuse_fhir(request, conn, too_long)
        if not body:
            return self._refuse_fhir(request, conn, FhirRejected(400, "structure", "empty body"))
        build = partial(
            build_fhir, body, connection=conn.name, charset=charset.lower(), max_elements=conn.max_fhir_elements
        )
        if self.fhir_pool is None:
            from twisted.internet import reactor

            self.fhir_pool = FhirPool(reactor)
        try:  # never on the reactor, never in the large-input gate (listeners/fhir_pool.py)
            built = self.fhir_pool.run(build)
        except PoolFull as exc:
            request.setHeader(b"retry-after", b"%d" % RETRY_AFTER_SECONDS)
            return self._refuse_fhir(request, conn, FhirRejected(503, "transient", str(exc)))
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        built.addCallbacks(
            lambda item: self._submit(request, conn, gone, item), self._not_built, errbackArgs=(request, conn, gone)
        )
        built.addErrback(lambda f: _log.failure("answering a POST to {name} failed", f, name=conn.name))
        return NOT_DONE_YET

    def _refuse_fhir(self, request: Request, conn: InboundConfig, exc: FhirRejected) -> bytes:
        # Only the status and the issue type: the diagnostics may quote the body's structure.
        _log.warn(
            "refusing FHIR POST to {name} from {peer}: {status} {code}",
            name=conn.name,
            peer=_peer(request),
            status=exc.status,
            code=exc.code,
        )
        self._count(conn, code="AR")
        body = _json(request, exc.status, exc.outcome())
        request.setHeader(b"content-type", _FHIR_TYPE)
        return body

    def _not_built(self, failure: Failure, request: Request, conn: InboundConfig, gone: list[bool]) -> None:
        exc = failure.value
        if isinstance(exc, FhirRejected):
            body = self._refuse_fhir(request, conn, exc)
        elif isinstance(exc, PayloadRejected):
            body = self._refuse(request, conn, 400, str(exc), hl7_error=_hl7_error(exc))
        else:
            _log.error(
                "building a POST to {name} failed: {error}",
                name=conn.name,
                error=failure.type.__name__ if failure.type else "unknown",
            )
            self._count(conn, code="AE")
            body = _json(request, 500, {"error": "internal error, resend later"})
        if not gone:
            request.setHeader(b"content-length", b"%d" % len(body))
            request.write(body)
            request.finish()

    def _submit(
        self, request: Request, conn: InboundConfig, gone: list[bool], item: Inbound | InboundBatch
    ) -> Deferred[None]:
        d = maybeDeferred(self.ingest.submit, item)
        answered = d.addCallbacks(
            self._committed, self._failed, callbackArgs=(request, conn, gone, item), errbackArgs=(request, conn, gone)
        )
        return answered.addErrback(lambda f: _log.failure("answering a POST to {name} failed", f, name=conn.name))

    def _committed(
        self, message_id: object, request: Request, conn: InboundConfig, gone: list[bool], item: Inbound | InboundBatch
    ) -> None:
        self._count(conn, code="AA")
        if gone:
            return
        if isinstance(item, InboundBatch):
            _finish(request, 202, {"batch_id": str(message_id), "message_ids": [i.message_id for i in item.items]})
        else:
            _finish(request, 202, {"message_id": str(message_id)})

    def _failed(self, failure: Failure, request: Request, conn: InboundConfig, gone: list[bool]) -> None:
        reason, code = rejection_reason(failure)
        self._count(conn, code=code)
        # Only the exception type: its text may quote stored values.
        _log.warn(
            "POST to {name} from {peer} not stored: {error}",
            name=conn.name,
            peer=_peer(request),
            error=failure.type.__name__ if failure.type else "unknown",
        )
        if not gone:
            status = 400 if failure.check(RowRefused) else 503 if failure.check(IngestRejected) else 500
            _finish(request, status, {"error": reason})

    def _refuse(
        self, request: Request, conn: InboundConfig, status: int, reason: str, *, code: str = "AR", **extra: Any
    ) -> bytes:
        _log.warn(
            "refusing POST to {name} from {peer}: {status} {reason}",
            name=conn.name,
            peer=_peer(request),
            status=status,
            reason=reason[:200],
        )
        self._count(conn, code=code)
        return _json(request, status, {"error": reason, **extra})

    def _count(self, conn: InboundConfig, *, received: int | None = None, code: str = "") -> None:
        """Count a request received (`received`: its body's bytes) and/or its answer (as AA/AE/AR)."""
        counters = self._counters.get(conn.name)
        if counters is None:
            return
        if received is not None:
            counters.received(received)
        if code:
            counters.answered(code)


def _hl7_error(exc: PayloadRejected) -> dict[str, Any]:
    """What an MLLP sender would read in the ERR of its AR for the same bytes: table 0357 code and
    text, and the ERR-2 location (``MSH^1^10``) when there is one; a profile's further findings,
    each an ERR of that AR, under ``more`` (with the rule each broke)."""
    why = exc.condition
    out: dict[str, Any] = {
        "code": why.code,
        "text": why.text,
        "location": why.location.text() if why.location else None,
    }
    if exc.detail:
        out["message"] = exc.detail  # the first finding's own rule (`error` is the summary)
    if exc.more:
        out["more"] = [
            {"code": c.code, "text": c.text, "location": c.location.text() if c.location else None, "message": said}
            for c, said in exc.more
        ]
    return out


class _InboundRequest(Request):
    """Keeps the body in memory up to the connection's limit and refuses more without reading it."""

    _refused = False
    _conn: InboundConfig | None = None
    _received = 0
    content: BytesIO  # gotLength sets it before any body arrives

    def gotLength(self, length: int | None) -> None:
        self.content = BytesIO()  # never a temp file: bodies are PHI and are bounded below
        site = self.channel.site  # type: ignore[attr-defined]  # Site.buildProtocol sets it
        # The request line is only the channel's until the body is in; an unknown name
        # (conn None) gets its body discarded unread and a 404 once it is done.
        conn = site.inbound.connection_for(getattr(self.channel, "_path", b""))
        self._conn = conn
        if conn is not None and length is not None and length > conn.max_message_bytes:
            self._refuse_early(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._received += len(data)
        if self._conn is None:
            return
        if self._received > self._conn.max_message_bytes:
            self.content = BytesIO()
            self._refuse_early(self._received)
            return
        self.content.write(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if not self._refused:
            super().requestReceived(command, path, version)

    def _refuse_early(self, size: int) -> None:
        """Answer 413 straight away and close: the rest of the body is never read."""
        self._refused = True
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after our answer
        conn = self._conn
        assert conn is not None
        reason = _too_large(size, conn.max_message_bytes)
        _log.warn("refusing POST to {name} from {peer}: 413 {reason}", name=conn.name, peer=_peer(self), reason=reason)
        site = self.channel.site  # type: ignore[attr-defined]  # Site.buildProtocol sets it
        site.inbound._count(conn, received=self._received, code="AR")  # bytes read: 0 or up to the cut
        media, _ = _content_type(self.getHeader(b"content-type"))
        fhir = media in FHIR_MEDIA_TYPES and "fhir" in conn.accept
        payload = operation_outcome("too-long", reason) if fhir else {"error": reason}
        body = json.dumps(payload).encode()
        transport = self.channel.transport
        assert transport is not None  # the request's headers just came in on it
        transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: %s\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (_FHIR_TYPE if fhir else b"application/json", len(body), body)
        )
        access_log.log_refused(self, 413, len(body))  # one access line per request, refused early too
        self.channel.loseConnection()


def _access_path(inbound: InboundResource) -> Any:
    """An access-log path: a configured connection's, else a placeholder (a path a client made up
    may carry anything)."""

    def shown(path: bytes) -> str:
        conn = inbound.connection_for(path)
        return f"/messages/{conn.name}" if conn is not None else access_log.UNKNOWN_PATH

    return shown


def _access_line(inbound: InboundResource) -> Any:
    """Site's `logFormatter`: Twisted's combined format like the API's (`listeners.access_log`), with
    the path reduced to its connection and any query string shown as ``?<redacted>`` — a sender's
    URL may carry identifiers, and this endpoint reads none of it. Bodies are never logged."""
    shown = _access_path(inbound)

    def line(timestamp: str, request: Request) -> str:
        path, sep, _ = (request.uri or b"").partition(b"?")
        uri = shown(path) + ("?<redacted>" if sep else "")
        ip = getattr(request.getClientAddress(), "host", "-")
        agent = _escape(request.getHeader(b"user-agent") or b"-")
        return (
            f'"{_escape(ip)}" - - {timestamp} "{_escape(request.method)} {uri} '
            f'{_escape(request.clientproto)}" {request.code} {request.sentLength or "-"} "-" "{agent}"'
        )

    return line


class _InboundSite(Site):
    def __init__(self, inbound: InboundResource, **kwargs: Any) -> None:
        super().__init__(
            inbound,
            requestFactory=_InboundRequest,
            parsePOSTFormSubmission=False,
            logFormatter=_access_line(inbound),
            **kwargs,
        )
        self.inbound = inbound
        self._channels: weakref.WeakSet[Any] = weakref.WeakSet()

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)
        if channel is not None:
            self._channels.add(channel)
        return channel

    def disconnect_all(self) -> None:
        """Drop every open connection (keep-alive ones included): a node that lost leadership must
        not keep taking messages on connections it accepted while it was leader."""
        for transport in self._transports():
            transport.abortConnection()

    def stop_reading(self) -> None:
        """A clean stop, first step: new requests (keep-alive ones included) get 503, nothing is
        staged; requests already handed over are still answered."""
        self.inbound.draining = True

    def close_all(self) -> None:
        """A clean stop, last step: close every connection without losing the answers written."""
        for transport in self._transports():
            close_after_answers(transport, self.reactor)

    @property
    def active_connections(self) -> int:
        return len(self._transports())

    def _transports(self) -> list[Any]:
        found = []
        for channel in list(self._channels):
            # Site builds a proxy (_GenericHTTPChannelProtocol); the transport is on the channel in it.
            transport = getattr(getattr(channel, "_channel", channel), "transport", None)
            if transport is not None and not getattr(transport, "disconnected", False):
                found.append(transport)
        return found


def make_inbound_site(
    ingest: IngestSink,
    connections: Iterable[InboundConfig],
    *,
    lane_of: LaneOf | Mapping[str, LaneOf] | None = None,
    metrics: Metrics | None = None,
    reactor: IReactorTime | None = None,
) -> Site:
    """A Site serving ``POST /messages/{name}`` for the given http connections.

    ``lane_of`` is one callable for all, or one per connection name. The idle timeout is the
    shortest ``idle_timeout_seconds`` among them.
    """
    connections = list(connections)
    resource = InboundResource(ingest, connections, lane_of=lane_of, metrics=metrics)
    timeouts = [c.idle_timeout_seconds for c in connections if c.idle_timeout_seconds]
    site = _InboundSite(resource, reactor=reactor, **({"timeout": min(timeouts)} if timeouts else {}))
    for counters in resource._counters.values():
        counters.open_connections_from(lambda: site.active_connections)
    site.displayTracebacks = False
    site.noisy = False
    return guard_channels(site)


def _content_type(value: bytes | None) -> tuple[str, str]:
    """(media type, charset) of a Content-Type header; both lower-cased, empty when absent."""
    if not value:
        return "", ""
    media, *params = value.decode("latin-1").split(";")
    charset = ""
    for param in params:
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset":
            charset = val.strip().strip('"').strip()
    return media.strip().lower(), charset


_FHIR_TYPE = FHIR_CONTENT_TYPE.encode()
_FHIR_ONLY = 'this connection takes FHIR JSON only (accept = ["fhir"]): send ' + FHIR_CONTENT_TYPE


def _unsupported(conn: InboundConfig) -> str:
    if "fhir" in conn.accept:
        return "unsupported content type; use application/hl7-v2, text/plain or application/fhir+json"
    return "unsupported content type; use text/plain or application/hl7-v2"


def _too_large(size: int, limit: int) -> str:
    return f"message too large: {size} bytes, limit {limit}"


def _json(request: Request, status: int, payload: dict[str, Any]) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(payload).encode()


def _finish(request: Request, status: int, payload: dict[str, Any]) -> None:
    body = _json(request, status, payload)
    request.setHeader(b"content-length", b"%d" % len(body))
    request.write(body)
    request.finish()


def _peer(request: Request) -> str:
    return describe_peer(request.getClientAddress())
