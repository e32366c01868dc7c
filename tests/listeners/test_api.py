"""The control-plane API: `[api]` config, the auth matrix, and the exact JSON it serves.

Config tests are plain functions. HTTP tests are trial TestCases (they run under pytest) that serve
the real Site on an ephemeral loopback port and ask it with `twisted.web.client.Agent`; each test's
cleanup closes the client pool, stops the port and waits until every server connection is gone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import defer, reactor
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import deferLater
from twisted.logger import LogEvent, formatEvent, globalLogPublisher
from twisted.protocols.policies import WrappingFactory
from twisted.python.failure import Failure
from twisted.trial import unittest
from twisted.web.client import Agent, HTTPConnectionPool, IResponse, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.server import NOT_DONE_YET, Site
from twisted.web.test.requesthelper import DummyRequest

from include.store.membership import NodeIdentity, single_node_nodes
from listeners.api import (
    DEFAULT_PORT,
    ROLE_PERMISSIONS,
    ApiAuth,
    ApiConfigError,
    ApiSettings,
    Permission,
    Role,
    make_api,
)
from listeners.connections_config import ConnectionConfigError, TLSConfig
from listeners.metrics import CONTENT_TYPE, Metrics
from listeners.server_tls import listen
from listeners.state import NodeState

VIEWER_TOKEN = "viewer-token-0123456789abcdef"
OPERATOR_TOKEN = "operator-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
ENV = {"VIEWER": VIEWER_TOKEN, "OPERATOR": OPERATOR_TOKEN}
TOKENS_CONFIG: dict[str, Any] = {
    "tokens": [
        {"name": "console", "role": "viewer", "token_env": "VIEWER"},
        {"role": "OPERATOR", "token_env": "OPERATOR"},  # role names are case-insensitive
        {"role": "admin", "token_sha256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()},
    ]
}

TWO_NODES = {
    "nodes": [
        {
            "node_id": "node-a:4812:1f9c2a7b",
            "host": "node-a",
            "pid": 4812,
            "status": "active",
            "started_at": 1750000000.0,
            "last_seen": 1750000123.4,
            "is_leader": True,
        },
        {
            "node_id": "node-b:5210:7c3e9d10",
            "host": "node-b",
            "pid": 5210,
            "status": "active",
            "started_at": 1750000005.0,
            "last_seen": 1750000124.1,
            "is_leader": False,
        },
    ],
    "leader_node_id": "node-a:4812:1f9c2a7b",
    "lease_owner": "node-a:4812:1f9c2a7b",
    "lease_expires_at": 1750000153.4,
}


# --- shared helpers (test_server_tls imports these) -------------------------------------------------------


def node_state(
    *,
    clustered: bool = False,
    leader: bool = True,
    node_id: str = "host:1234:ab12cd34",
    nodes: Callable[[], defer.Deferred] | None = None,
    config_version: int = 7,
) -> NodeState:
    if nodes is None:
        doc = single_node_nodes(NodeIdentity.of(node_id))
        nodes = lambda: defer.succeed(doc)  # noqa: E731
    return NodeState(
        node_id=node_id,
        clustered=clustered,
        metrics=Metrics(),
        is_leader=lambda: leader,
        config_version=lambda: config_version,
        nodes=nodes,
    )


def serve(case: unittest.TestCase, site: Site, *, tls: TLSConfig | None = None) -> int:
    """Listen on 127.0.0.1:<ephemeral> (TLS when given); cleanup leaves no port or connection behind."""
    tracked = WrappingFactory(site)
    port: IListeningPort = listen(reactor, "127.0.0.1", 0, tracked, tls)

    async def close() -> None:
        await port.stopListening()
        for wrapper in list(tracked.protocols):
            wrapper.transport.abortConnection()
        while tracked.protocols:
            await deferLater(reactor, 0.001, lambda: None)

    case.addCleanup(lambda: defer.ensureDeferred(close()))
    return port.getHost().port


def agent(case: unittest.TestCase, **kwargs: Any) -> Agent:
    pool = HTTPConnectionPool(reactor, persistent=True)
    case.addCleanup(pool.closeCachedConnections)
    return Agent(reactor, pool=pool, **kwargs)


async def fetch(
    client: Agent, url: str, *, token: str | None = None, authorization: str | None = None, method: bytes = b"GET"
) -> tuple[IResponse, bytes]:
    headers = Headers()
    if token is not None:
        headers.addRawHeader(b"authorization", f"Bearer {token}".encode())
    if authorization is not None:
        headers.addRawHeader(b"authorization", authorization.encode())
    response = await client.request(method, url.encode(), headers)
    body = _Body()
    response.deliverBody(body)
    return response, await body.done


class _Body(Protocol):
    """Collects a response body (readBody warns about Agent's own proxy transport)."""

    def __init__(self) -> None:
        self.done: defer.Deferred[bytes] = defer.Deferred()
        self._chunks: list[bytes] = []

    def dataReceived(self, data: bytes) -> None:
        self._chunks.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(b"".join(self._chunks))
        else:
            self.done.errback(reason)


def header(response: IResponse, name: str) -> str | None:
    values = response.headers.getRawHeaders(name)
    return values[-1] if values else None


# --- [api] config ----------------------------------------------------------------------------------


def test_settings_default_to_loopback_8470_without_tls(tmp_path: Path) -> None:
    assert ApiSettings.from_config({}, tmp_path) == ApiSettings("127.0.0.1", DEFAULT_PORT, None, False)
    assert DEFAULT_PORT == 8470


def test_settings_refuse_a_non_loopback_bind_without_tls(tmp_path: Path) -> None:
    with pytest.raises(
        ConnectionConfigError,
        match=r"api\.host: refusing a non-loopback bind without TLS "
        r"\(API on 0\.0\.0\.0:8470\)",
    ):
        ApiSettings.from_config({"host": "0.0.0.0"}, tmp_path)


def test_settings_allow_a_non_loopback_bind_when_explicitly_insecure(tmp_path: Path) -> None:
    settings = ApiSettings.from_config({"host": "10.0.0.5", "port": 9000, "allow_insecure_bind": True}, tmp_path)
    assert (settings.host, settings.port, settings.tls, settings.allow_insecure_bind) == ("10.0.0.5", 9000, None, True)


def test_settings_allow_a_non_loopback_bind_with_tls_resolving_paths_in_the_config_dir(tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    for name in ("api.pem", "api.key", "ca.pem"):
        (tmp_path / "pki" / name).write_text("PEM")
    settings = ApiSettings.from_config(
        {
            "host": "0.0.0.0",
            "tls": {"cert": "pki/api.pem", "key": "pki/api.key", "ca": "pki/ca.pem", "require_client_cert": True},
        },
        tmp_path,
    )
    pki = tmp_path.resolve() / "pki"
    assert settings.tls == TLSConfig(str(pki / "api.pem"), str(pki / "api.key"), str(pki / "ca.pem"), True)


@pytest.mark.parametrize(
    ("api", "message"),
    [
        ({"tls": {"cert": "a.pem"}}, r"api\.tls\.key: required, not set"),
        (
            {"tls": {"cert": "a.pem", "key": "a.key", "require_client_cert": True}},
            r"api\.tls\.ca: require_client_cert needs ca",
        ),
        ({"tls": {"cert": "a.pem", "key": "a.key", "password": "x"}}, r"api\.tls\.password: unknown setting"),
        ({"tls": {"cert": "a.pem", "key": "a.key", "require_client_cert": "yes"}}, r"true or false"),
        ({"tls": {"cert": "missing.pem", "key": "a.key"}}, r"api\.tls\.cert: no such file: .*missing\.pem"),
        ({"listen": "0.0.0.0"}, r"api\.listen: unknown setting"),
        ({"port": 70000}, r"api\.port: must be <= 65535"),
        ({"port": True}, r"api\.port: must be an integer, got a boolean"),
        ({"port": "8470"}, r"api\.port: must be an integer, got a string"),
        ({"host": ""}, r"api\.host: must not be empty"),
        ({"allow_insecure_bind": "true"}, r"api\.allow_insecure_bind: must be true or false"),
    ],
)
def test_settings_refuse_bad_values_naming_the_setting(tmp_path: Path, api: dict[str, Any], message: str) -> None:
    (tmp_path / "a.pem").write_text("cert")
    (tmp_path / "a.key").write_text("key")
    with pytest.raises(ApiConfigError, match=message):
        ApiSettings.from_config(api, tmp_path)


def test_auth_reads_tokens_from_env_and_digests_and_maps_roles() -> None:
    auth = ApiAuth.from_config(TOKENS_CONFIG, ENV)
    assert auth.configured
    assert auth.role_for(VIEWER_TOKEN.encode()) is Role.VIEWER
    assert auth.role_for(OPERATOR_TOKEN.encode()) is Role.OPERATOR
    assert auth.role_for(ADMIN_TOKEN.encode()) is Role.ADMIN
    assert auth.role_for(b"not-a-token-at-all-1234") is None


def test_auth_refuses_a_plaintext_token_in_the_file_without_echoing_it() -> None:
    secret = "plaintext-secret-0123456789"
    refused = "plaintext token in the config file is refused; set token_env"
    with pytest.raises(ApiConfigError, match=refused) as exc:
        ApiAuth.from_config({"tokens": [{"role": "viewer", "token": secret}]}, {})
    assert secret not in str(exc.value)


@pytest.mark.parametrize(
    ("entry", "env", "message"),
    [
        ({"role": "viewer", "token_env": "MISSING"}, {}, r"#1: environment variable MISSING \(token_env\) is not set"),
        ({"role": "viewer", "token_env": "SHORT"}, {"SHORT": "abc"}, r"shorter than 16 characters"),
        ({"role": "viewer", "token_env": "SPACE"}, {"SPACE": "has a space in it 0123"}, r"may hold only"),
        ({"role": "viewer", "token_sha256": "abc"}, {}, r"tokens\[0\]\.token_sha256: must be 64 hex digits"),
        ({"role": "root", "token_sha256": "0" * 64}, {}, r"tokens\[0\]\.role: must be one of viewer, operator, admin"),
        ({"token_sha256": "0" * 64}, {}, r"tokens\[0\]\.role: required"),
        ({"role": "viewer"}, {}, r"exactly one of token_env or token_sha256"),
        ({"role": "viewer", "token_env": "V", "token_sha256": "0" * 64}, {"V": VIEWER_TOKEN}, r"exactly one of"),
        ({"role": "viewer", "token_sha256": "0" * 64, "scope": "all"}, {}, r"tokens\[0\]\.scope: unknown setting"),
    ],
)
def test_auth_refuses_bad_token_entries(entry: dict[str, Any], env: dict[str, str], message: str) -> None:
    with pytest.raises(ApiConfigError, match=message):
        ApiAuth.from_config({"tokens": [entry]}, env)


def test_auth_refuses_the_same_token_twice() -> None:
    digest = hashlib.sha256(VIEWER_TOKEN.encode()).hexdigest()
    with pytest.raises(ApiConfigError, match=r"#2 \('ops'\): the same token as \[\[api.tokens\]\] #1"):
        ApiAuth.from_config(
            {
                "tokens": [
                    {"role": "viewer", "token_env": "VIEWER"},
                    {"name": "ops", "role": "admin", "token_sha256": digest},
                ]
            },
            ENV,
        )


def test_every_role_reads_monitoring_and_a_narrowed_role_does_not() -> None:
    assert all(ApiAuth().allows(role, Permission.MONITORING_READ) for role in Role)
    narrowed = ApiAuth(role_permissions={**ROLE_PERMISSIONS, Role.VIEWER: frozenset()})
    assert not narrowed.allows(Role.VIEWER, Permission.MONITORING_READ)
    assert narrowed.allows(Role.OPERATOR, Permission.MONITORING_READ)


@pytest.mark.parametrize(
    ("authorization", "status", "error"),
    [
        (None, 401, ""),
        (b"", 401, ""),
        (b"Basic dXNlcjpwYXNz", 401, "invalid_request"),
        (b"Bearer", 401, "invalid_request"),
        (b"Bearer two words", 401, "invalid_request"),
        (b"Bearer wrong-token-0123456789", 401, "invalid_token"),
        (f"bearer {VIEWER_TOKEN}".encode(), None, None),
    ],
)
def test_check_maps_headers_to_denials(authorization: bytes | None, status: int | None, error: str | None) -> None:
    denial = ApiAuth.from_config(TOKENS_CONFIG, ENV).check(authorization, Permission.MONITORING_READ)
    assert ((denial.status, denial.error) if denial else (None, None)) == (status, error)


def test_check_forbids_a_known_token_whose_role_lacks_the_permission() -> None:
    narrowed = {**ROLE_PERMISSIONS, Role.VIEWER: frozenset()}
    denial = ApiAuth.from_config(TOKENS_CONFIG, ENV, role_permissions=narrowed).check(
        f"Bearer {VIEWER_TOKEN}".encode(), Permission.MONITORING_READ
    )
    assert denial is not None
    assert (denial.status, denial.error, denial.challenge()) == (
        403,
        "insufficient_scope",
        b'Bearer realm="stageline", error="insufficient_scope"',
    )


def test_nodes_writes_nothing_when_the_client_left_before_the_read_finished() -> None:
    pending: defer.Deferred = defer.Deferred()
    site = make_api(node_state(nodes=lambda: pending), ApiAuth.from_config(TOKENS_CONFIG, ENV))
    request = DummyRequest([b"cluster", b"nodes"])
    request.requestHeaders.addRawHeader(b"authorization", f"Bearer {VIEWER_TOKEN}".encode())
    resource = site.getResourceFor(request)
    assert resource.render(request) is NOT_DONE_YET
    request.processingFailed(Failure(ConnectionDone()))  # the connection dropped
    pending.callback(TWO_NODES)
    assert (request.written, request.finished) == ([], 0)


# --- over HTTP ---------------------------------------------------------------------------------------


class ApiOverHttpTests(unittest.TestCase):
    def start(self, state: NodeState, auth: ApiAuth | None = None) -> str:
        port = serve(self, make_api(state, auth or ApiAuth.from_config(TOKENS_CONFIG, ENV)))
        self.client = agent(self)
        return f"http://127.0.0.1:{port}"

    async def get(self, url: str, **kwargs: Any) -> tuple[IResponse, Any]:
        response, body = await fetch(self.client, url, **kwargs)
        self.assertEqual(header(response, "content-type"), "application/json")
        return response, json.loads(body)

    @defer.inlineCallbacks
    def test_health_needs_no_token_and_reports_role(self):
        base = self.start(node_state(clustered=True, leader=False, node_id="node-b:5210:7c3e9d10"))
        response, doc = yield defer.ensureDeferred(self.get(f"{base}/health"))
        self.assertEqual(response.code, 200)
        self.assertEqual(doc, {"status": "ok", "node_id": "node-b:5210:7c3e9d10", "role": "standby"})

    @defer.inlineCallbacks
    def test_health_answers_even_with_no_tokens_configured(self):
        base = self.start(node_state(), ApiAuth())
        response, doc = yield defer.ensureDeferred(self.get(f"{base}/health"))
        self.assertEqual((response.code, doc["role"]), (200, "single-node"))
        response, doc = yield defer.ensureDeferred(self.get(f"{base}/cluster/status", token=VIEWER_TOKEN))
        self.assertEqual((response.code, doc), (401, {"error": "unauthorized"}))  # fails closed

    @defer.inlineCallbacks
    def test_guarded_endpoints_answer_401_with_a_bearer_challenge_and_no_data(self):
        base = self.start(node_state())
        for path in ("/cluster/status", "/cluster/nodes", "/metrics"):
            for kwargs, challenge in [
                ({}, 'Bearer realm="stageline"'),
                ({"authorization": "Basic dXNlcjpwYXNz"}, 'Bearer realm="stageline", error="invalid_request"'),
                ({"token": "wrong-token-0123456789abcdef"}, 'Bearer realm="stageline", error="invalid_token"'),
            ]:
                response, doc = yield defer.ensureDeferred(self.get(base + path, **kwargs))
                self.assertEqual((response.code, doc), (401, {"error": "unauthorized"}), (path, kwargs))
                self.assertEqual(header(response, "www-authenticate"), challenge)

    @defer.inlineCallbacks
    def test_a_role_without_monitoring_read_gets_403_and_no_data(self):
        narrowed = {**ROLE_PERMISSIONS, Role.VIEWER: frozenset()}
        base = self.start(node_state(), ApiAuth.from_config(TOKENS_CONFIG, ENV, role_permissions=narrowed))
        for path in ("/cluster/status", "/cluster/nodes", "/metrics"):
            response, doc = yield defer.ensureDeferred(self.get(base + path, token=VIEWER_TOKEN))
            self.assertEqual((response.code, doc), (403, {"error": "forbidden"}), path)
            self.assertEqual(
                header(response, "www-authenticate"), 'Bearer realm="stageline", error="insufficient_scope"'
            )
        response, _ = yield defer.ensureDeferred(self.get(f"{base}/cluster/status", token=OPERATOR_TOKEN))
        self.assertEqual(response.code, 200)

    @defer.inlineCallbacks
    def test_status_is_the_single_node_document_for_every_role(self):
        base = self.start(node_state())
        for token in (VIEWER_TOKEN, OPERATOR_TOKEN, ADMIN_TOKEN):
            response, doc = yield defer.ensureDeferred(self.get(f"{base}/cluster/status", token=token))
            self.assertEqual(response.code, 200)
            self.assertEqual(header(response, "cache-control"), "no-store")
            self.assertEqual(
                doc,
                {
                    "node_id": "host:1234:ab12cd34",
                    "clustered": False,
                    "is_leader": True,
                    "role": "single-node",
                    "config_version": 0,
                    "unbound": [],
                },
            )

    @defer.inlineCallbacks
    def test_status_reports_primary_and_standby_when_clustered(self):
        for leader, role in ((True, "primary"), (False, "standby")):
            base = self.start(node_state(clustered=True, leader=leader, node_id="node-a:4812:1f9c2a7b"))
            _, doc = yield defer.ensureDeferred(self.get(f"{base}/cluster/status", token=VIEWER_TOKEN))
            self.assertEqual(
                doc,
                {
                    "node_id": "node-a:4812:1f9c2a7b",
                    "clustered": True,
                    "is_leader": leader,
                    "role": role,
                    "config_version": 7,
                    "unbound": [],
                },
            )

    @defer.inlineCallbacks
    def test_nodes_is_the_synthetic_self_entry_on_a_single_node(self):
        base = self.start(node_state())
        response, doc = yield defer.ensureDeferred(self.get(f"{base}/cluster/nodes", token=VIEWER_TOKEN))
        self.assertEqual(response.code, 200)
        self.assertEqual(
            doc,
            {
                "nodes": [
                    {
                        "node_id": "host:1234:ab12cd34",
                        "host": "host",
                        "pid": 1234,
                        "status": "active",
                        "started_at": None,
                        "last_seen": None,
                        "is_leader": True,
                    }
                ],
                "leader_node_id": "host:1234:ab12cd34",
                "lease_owner": "host:1234:ab12cd34",
                "lease_expires_at": None,
            },
        )

    @defer.inlineCallbacks
    def test_nodes_serves_the_membership_document_once_the_read_fires(self):
        pending: defer.Deferred = defer.Deferred()
        base = self.start(node_state(clustered=True, nodes=lambda: pending))
        answered = defer.ensureDeferred(self.get(f"{base}/cluster/nodes", token=VIEWER_TOKEN))
        yield deferLater(reactor, 0.01, lambda: None)
        self.assertFalse(answered.called)  # the reactor is not blocked while the DB read runs
        pending.callback(TWO_NODES)
        response, doc = yield answered
        self.assertEqual((response.code, doc), (200, TWO_NODES))

    @defer.inlineCallbacks
    def test_nodes_answers_503_json_when_the_read_fails(self):
        for nodes in (
            lambda: defer.fail(RuntimeError("database is down: /var/secret")),
            lambda: (_ for _ in ()).throw(RuntimeError("raised before the Deferred")),
        ):
            base = self.start(node_state(clustered=True, nodes=nodes))
            response, doc = yield defer.ensureDeferred(self.get(f"{base}/cluster/nodes", token=VIEWER_TOKEN))
            self.assertEqual((response.code, doc), (503, {"error": "membership unavailable"}))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)

    @defer.inlineCallbacks
    def test_a_failing_handler_is_a_500_json_not_a_traceback(self):
        state = node_state(clustered=True)
        state.is_leader = lambda: 1 / 0  # type: ignore[assignment,return-value]
        base = self.start(state)
        response, doc = yield defer.ensureDeferred(self.get(f"{base}/cluster/status", token=VIEWER_TOKEN))
        self.assertEqual((response.code, doc), (500, {"error": "internal error"}))
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)

    @defer.inlineCallbacks
    def test_metrics_is_prometheus_text(self):
        state = node_state()
        state.metrics.leader.set(1)
        state.metrics.received.labels(connection="adt_in").inc(3)
        base = self.start(state)
        response, body = yield defer.ensureDeferred(fetch(self.client, f"{base}/metrics", token=VIEWER_TOKEN))
        self.assertEqual(response.code, 200)
        self.assertEqual(header(response, "content-type"), CONTENT_TYPE)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }
        self.assertEqual(samples[("stageline_leader", ())], 1.0)
        self.assertEqual(samples[("stageline_messages_received_total", (("connection", "adt_in"),))], 3.0)

    @defer.inlineCallbacks
    def test_unknown_paths_are_404_json_and_other_methods_405(self):
        base = self.start(node_state())
        for path in (
            "/",
            "/nope",
            "/cluster",
            "/cluster/",
            "/cluster/leader",
            "/health/",
            "/health/x",
            "/cluster/status/extra",
        ):
            response, doc = yield defer.ensureDeferred(self.get(base + path, token=VIEWER_TOKEN))
            self.assertEqual((response.code, doc), (404, {"error": "not found"}), path)
        for path in ("/health", "/cluster/status", "/metrics"):
            response, doc = yield defer.ensureDeferred(self.get(base + path, token=VIEWER_TOKEN, method=b"POST"))
            self.assertEqual((response.code, doc), (405, {"error": "method not allowed"}), path)
            self.assertEqual(header(response, "allow"), "GET, HEAD")

    @defer.inlineCallbacks
    def test_tokens_never_reach_the_log(self):
        events: list[LogEvent] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        narrowed = {**ROLE_PERMISSIONS, Role.VIEWER: frozenset()}
        base = self.start(node_state(), ApiAuth.from_config(TOKENS_CONFIG, ENV, role_permissions=narrowed))
        wrong = "wrong-token-0123456789abcdef"
        for token in (wrong, VIEWER_TOKEN, OPERATOR_TOKEN):
            yield defer.ensureDeferred(self.get(f"{base}/cluster/status", token=token))
        logged = "\n".join(formatEvent(e) + repr(e) for e in events)
        self.assertIn("unknown token", logged)
        self.assertIn("role viewer lacks monitoring:read", logged)
        for token in (wrong, VIEWER_TOKEN, OPERATOR_TOKEN):
            self.assertNotIn(token, logged)
