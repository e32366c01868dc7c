"""HTTP listener: the real Site/HTTPChannel over StringTransport with a hand-fired fake ingest,
and real requests over loopback against the real store and IngestWriter."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail, inlineCallbacks, succeed
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from twisted.trial import unittest as trial
from twisted.web.server import Site

from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from listeners.connections_config import InboundConfig
from listeners.group_commit import Inbound, IngestWriter, NotLeader, RowRefused, StoreUnavailable
from listeners.http_listener import make_inbound_site
from listeners.metrics import Metrics
from tests.listeners.fakes import FakeIngest

PEER = IPv4Address("TCP", "127.0.0.1", 50000)
HOST = IPv4Address("TCP", "127.0.0.1", 8080)


def adt(control_id: str, *, pid: str = "DOE^JANE") -> str:
    return f"MSH|^~\\&|SEND|FAC|RECV|RFAC|20240101||ADT^A01|{control_id}|P|2.5\rPID|1||123||{pid}\r"


def conn(name: str = "web", **overrides: Any) -> InboundConfig:
    return InboundConfig(**{"name": name, "kind": "http", "max_message_bytes": 1024, **overrides})


def site_for(ingest: Any, *configs: InboundConfig, **kwargs: Any) -> Site:
    return make_inbound_site(ingest, configs or [conn()], reactor=MemoryReactorClock(), **kwargs)


class Exchange:
    """One HTTP connection to the real Site over a StringTransport."""

    def __init__(self, site: Site) -> None:
        self.channel = site.buildProtocol(PEER)
        self.transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
        self.channel.makeConnection(self.transport)

    def send(self, data: bytes) -> Exchange:
        self.channel.dataReceived(data)
        return self

    def request(
        self,
        body: bytes = b"",
        *,
        method: str = "POST",
        path: str = "/messages/web",
        content_type: str | None = "application/hl7-v2",
        headers: str = "",
    ) -> Exchange:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        if content_type is not None:
            head += f"Content-Type: {content_type}\r\n"
        return self.send(head.encode() + headers.encode() + b"\r\n" + body)

    def response(self) -> tuple[int, dict[str, str], Any]:
        head, _, body = self.transport.value().partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)

    def close(self) -> None:
        self.channel.connectionLost(Failure(Exception("test over")))


@pytest.fixture
def exchanges() -> Iterator[list[Exchange]]:
    made: list[Exchange] = []
    yield made
    for ex in made:
        ex.close()


@pytest.fixture
def open_(exchanges: list[Exchange]) -> Any:
    def opener(site: Site) -> Exchange:
        ex = Exchange(site)
        exchanges.append(ex)
        return ex

    return opener


# -- unit: the Site over StringTransport ------------------------------------------------------


def test_202_with_message_id_only_after_the_commit_fires(open_: Any) -> None:
    ingest = FakeIngest()
    ex = open_(site_for(ingest, lane_of={"web": lambda text: "LANE"})).request(adt("C1").encode())
    [(item, _)] = ingest.calls
    assert (item.connection, item.control_id, item.lane_key, item.payload) == ("web", "C1", "LANE", adt("C1"))
    assert ex.transport.value() == b""
    ingest.fire(0)
    status, headers, body = ex.response()
    assert (status, body) == (202, {"message_id": item.message_id})
    assert headers["content-type"] == "application/json"


def test_disconnect_all_drops_keep_alive_connections_too(open_: Any) -> None:
    """On losing leadership the node drops HTTP connections, idle keep-alive ones included."""
    ingest = FakeIngest()
    site = site_for(ingest)
    idle = open_(site).request(adt("K1").encode())
    ingest.fire(0)  # answered; the connection stays open for the next request (keep-alive)
    assert idle.response()[0] == 202 and not idle.transport.disconnecting
    waiting = open_(site).request(adt("K2").encode())  # a request still awaiting its commit
    site.disconnect_all()
    assert idle.transport.disconnected and waiting.transport.disconnected


def test_a_clean_stop_answers_what_was_taken_and_refuses_new_requests(open_: Any) -> None:
    ingest = FakeIngest()
    site = site_for(ingest)
    taken = open_(site).request(adt("D1").encode())
    site.stop_reading()
    late = open_(site).request(adt("D2").encode())
    assert late.response()[0::2] == (503, {"error": "shutting down, resend later"})
    assert len(ingest.calls) == 1  # D2 was not staged
    ingest.fire(0)
    assert taken.response()[0] == 202
    site.close_all()
    assert taken.transport.disconnecting and late.transport.disconnecting


@pytest.mark.parametrize(
    "exc, status, error",
    [
        (NotLeader("no lease"), 503, "not leader, resend later"),
        (StoreUnavailable("down"), 503, "store unavailable, resend later"),
        (
            RowRefused("refused by the store (CheckViolation); not stored"),
            400,
            "refused by the store (CheckViolation); not stored",
        ),
        (RuntimeError("PHI in here"), 500, "internal error, resend later"),
    ],
)
def test_ingest_failure_answers_with_a_reason_and_no_content(
    open_: Any, exc: Exception, status: int, error: str
) -> None:
    ingest = FakeIngest()
    ex = open_(site_for(ingest)).request(b"hello")
    ingest.calls[0][1].errback(exc)
    assert ex.response()[0::2] == (status, {"error": error})


UNDECODABLE = {"hl7_error": {"code": "102", "text": "Data type error", "location": None}}
NO_CONTROL_ID = {"hl7_error": {"code": "101", "text": "Required field missing", "location": "MSH^1^10"}}


@pytest.mark.parametrize(
    "kwargs, status, error, more",
    [
        ({"path": "/messages/nope"}, 404, "unknown connection", {}),
        ({"path": "/other"}, 404, "unknown connection", {}),
        ({"method": "GET"}, 405, "method not allowed; use POST", {}),
        ({"method": "PUT", "body": b"x"}, 405, "method not allowed; use POST", {}),
        ({"body": b""}, 400, "empty message", {}),
        ({"body": b"\xff\xfe"}, 400, "undecodable: byte offset 0 is not valid utf-8", UNDECODABLE),
        ({"body": adt("").encode()}, 400, "missing_control_id: MSH-10 is empty", NO_CONTROL_ID),
        (
            {"body": b"x", "content_type": "application/json"},
            415,
            "unsupported content type; use text/plain or application/hl7-v2",
            {},
        ),
    ],
)
def test_bad_requests_are_refused_without_submitting(
    open_: Any, kwargs: dict[str, Any], status: int, error: str, more: dict[str, Any]
) -> None:
    ingest = FakeIngest()
    ex = open_(site_for(ingest)).request(**kwargs)
    got_status, headers, body = ex.response()
    assert (got_status, body) == (status, {"error": error, **more})
    assert ingest.calls == []
    if status == 405:
        assert headers["allow"] == "POST"


@pytest.mark.parametrize(
    "charset", ["klingon", "punycode", "base64", "zlib", "rot13", "idna", "hex", "utf-16", "unicode_escape", "x" * 500]
)
def test_a_charset_outside_hl7_table_0211_is_400_naming_the_accepted_ones(open_: Any, charset: str) -> None:
    ingest = FakeIngest()
    metrics = Metrics()
    ex = open_(site_for(ingest, metrics=metrics)).request(b"MSH|^~\\&|A", content_type=f"text/plain; charset={charset}")
    status, headers, body = ex.response()
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["error"].startswith("unknown charset ") and "UNICODE UTF-8" in body["error"]
    assert "8859/1" in body["accepted"] and "UTF-8" in body["accepted"]
    assert ingest.calls == []
    assert metrics.acks.labels("web", "AR")._value.get() == 1


@pytest.mark.parametrize(
    "charset, codec",
    [
        ("latin-1", "iso8859-1"),
        ("ISO-8859-1", "iso8859-1"),
        ("8859/1", "iso8859-1"),
        ("utf8", "utf-8"),
        ("big5", "big5"),
    ],
)
def test_aliases_of_allowed_codecs_are_accepted(open_: Any, charset: str, codec: str) -> None:
    ingest = FakeIngest()
    open_(site_for(ingest)).request(b"plain text", content_type=f"text/plain; charset={charset}")
    assert ingest.calls[0][0].charset == codec


def test_charset_comes_from_the_content_type_else_the_connection(open_: Any) -> None:
    ingest = FakeIngest()
    site = site_for(ingest, conn(), conn("legacy", charset="8859/15"))
    open_(site).request("Zoë".encode("latin-1"), content_type="text/plain; charset=ISO-8859-1")
    open_(site).request("Zoë €".encode("iso8859-15"), path="/messages/legacy", content_type=None)
    assert [(i.payload, i.charset, i.connection) for i, _ in ingest.calls] == [
        ("Zoë", "iso8859-1", "web"),
        ("Zoë €", "iso8859-15", "legacy"),
    ]


def test_declared_oversize_is_refused_before_the_body_is_read(open_: Any) -> None:
    ingest = FakeIngest()
    ex = open_(site_for(ingest)).send(
        b"POST /messages/web HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\nExpect: 100-continue\r\n\r\n"
    )
    status, headers, body = ex.response()
    assert (status, body) == (413, {"error": "message too large: 50000000 bytes, limit 1024"})
    assert headers["connection"] == "close" and ex.transport.disconnecting
    assert b"100 Continue" not in ex.transport.value()
    ex.send(b"x" * 100_000)  # whatever still arrives is dropped unread
    assert ingest.calls == []


def test_chunked_body_is_cut_off_once_it_passes_the_limit(open_: Any) -> None:
    ingest = FakeIngest()
    ex = open_(site_for(ingest)).send(
        b"POST /messages/web HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n"
    )
    ex.send(b"200\r\n" + b"a" * 512 + b"\r\n")
    assert ex.transport.value() == b""
    ex.send(b"200\r\n" + b"b" * 512 + b"\r\n" + b"1\r\nc\r\n")
    status, _, body = ex.response()
    assert (status, body) == (413, {"error": "message too large: 1025 bytes, limit 1024"})
    assert ex.transport.disconnecting and ingest.calls == []


def test_chunked_body_within_the_limit_is_accepted(open_: Any) -> None:
    ingest = FakeIngest()
    ex = open_(site_for(ingest)).send(
        b"POST /messages/web HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    ingest.fire(0)
    assert ex.response()[0] == 202 and ingest.calls[0][0].payload == "hello world"


def test_unknown_connection_body_is_discarded_not_buffered(open_: Any) -> None:
    ex = open_(site_for(FakeIngest())).request(b"z" * 5000, path="/messages/nope")
    assert ex.response()[0] == 404


def test_client_gone_before_the_commit_gets_nothing_written(open_: Any) -> None:
    ingest = FakeIngest()
    ex = open_(site_for(ingest)).request(b"hello")
    ex.channel.connectionLost(Failure(Exception("client went away")))
    ex.transport.clear()
    ingest.fire(0)
    assert ex.transport.value() == b""


def test_only_http_connections_are_served() -> None:
    with pytest.raises(ValueError, match="not an http connection"):
        make_inbound_site(FakeIngest(), [InboundConfig(name="t", kind="tcp")], reactor=MemoryReactorClock())


def test_metrics_count_received_and_answers(open_: Any) -> None:
    ingest, metrics = FakeIngest(), Metrics()
    site = site_for(ingest, metrics=metrics)
    open_(site).request(b"hello")
    open_(site).request(b"")
    ingest.fire(0)
    assert metrics.received.labels("web")._value.get() == 2
    assert metrics.acks.labels("web", "AA")._value.get() == 1
    assert metrics.acks.labels("web", "AR")._value.get() == 1


# -- real requests over loopback ---------------------------------------------------------------


class _Rejecting:
    def submit(self, item: Inbound) -> Deferred[str]:
        return fail(StoreUnavailable("store down"))


def rows(path: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as db:
        return db.execute(
            "SELECT message_id, control_id, connection, payload FROM inbound_messages ORDER BY id"
        ).fetchall()


class HTTPLoopbackTests(trial.TestCase):
    """`requests` in a worker thread against the real Site, IngestWriter and SQLite store."""

    @pytest.fixture(autouse=True)
    def _store(self, sqlite_config_fresh: StoreConfig) -> None:
        self.store_config = sqlite_config_fresh

    def setUp(self) -> None:
        self.pool = ThreadPool(minthreads=0, maxthreads=2, name="http-test-client")
        self.pool.start()
        self.addCleanup(self.pool.stop)
        self._open: set[Any] = set()
        self._waiters: list[Deferred[None]] = []

    def _serve(self, ingest: Any = None) -> str:
        if ingest is None:
            store = Store(self.store_config)
            self.addCleanup(store.close)
            epoch = acquire_permanent(store, node_id="n")
            ingest = IngestWriter(store, node_id="n", epoch=lambda: epoch, metrics=Metrics(), reactor=reactor)
            ingest.start()
            self.addCleanup(ingest.stop)
        site = make_inbound_site(ingest, [conn(max_message_bytes=4096)])
        build = site.buildProtocol

        def tracked(addr: Any) -> Any:  # so the test can wait for the server side to close
            proto = build(addr)
            lost = proto.connectionLost

            def connection_lost(reason: Failure) -> None:
                lost(reason)
                self._open.discard(proto)
                if not self._open:
                    waiters, self._waiters = self._waiters, []
                    for d in waiters:
                        d.callback(None)

            proto.connectionLost = connection_lost
            self._open.add(proto)
            return proto

        site.buildProtocol = tracked  # type: ignore[method-assign]
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return f"http://127.0.0.1:{port.getHost().port}/messages/web"

    def _closed(self) -> Deferred[None]:
        if not self._open:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiters.append(d)
        return d

    def _call(self, method: str, url: str, **kwargs: Any) -> Deferred[requests.Response]:
        headers = {"Connection": "close", **kwargs.pop("headers", {})}
        return deferToThreadPool(
            reactor, self.pool, requests.request, method, url, headers=headers, timeout=10, **kwargs
        )

    @inlineCallbacks
    def test_post_is_answered_202_after_its_row_is_committed(self) -> Any:
        url = self._serve()
        response = yield self._call(
            "POST", url, data=adt("C1").encode(), headers={"Content-Type": "application/hl7-v2"}
        )
        assert response.status_code == 202
        message_id = response.json()["message_id"]
        assert rows(self.store_config.path) == [(message_id, "C1", "web", adt("C1"))]
        yield self._closed()

    @inlineCallbacks
    def test_refusals_stage_nothing(self) -> Any:
        url = self._serve()
        base = url.rsplit("/", 1)[0]
        got = []
        for method, target, data in [
            ("POST", url, b""),
            ("POST", url, b"\xff"),
            ("POST", base + "/nope", b"x"),
            ("GET", url, None),
            ("DELETE", url, None),
        ]:
            response = yield self._call(method, target, data=data, headers={"Content-Type": "text/plain"})
            got.append(response.status_code)
        assert got == [400, 400, 404, 405, 405]
        assert rows(self.store_config.path) == []
        yield self._closed()

    @inlineCallbacks
    def test_large_bodies_get_413_without_being_read(self) -> Any:
        url = self._serve()
        big = b"x" * (8 * 1024 * 1024)
        response = yield self._call("POST", url, data=big, headers={"Content-Type": "text/plain"})
        assert response.status_code == 413
        assert response.json() == {"error": f"message too large: {len(big)} bytes, limit 4096"}
        chunks = (b"y" * 65536 for _ in range(128))  # no Content-Length: chunked
        response = yield self._call("POST", url, data=chunks, headers={"Content-Type": "text/plain"})
        assert response.status_code == 413
        assert rows(self.store_config.path) == []
        yield self._closed()

    @inlineCallbacks
    def test_rejecting_ingest_gives_503_with_a_reason(self) -> Any:
        url = self._serve(_Rejecting())
        response = yield self._call("POST", url, data=b"hello", headers={"Content-Type": "text/plain"})
        assert (response.status_code, response.json()) == (503, {"error": "store unavailable, resend later"})
        yield self._closed()
