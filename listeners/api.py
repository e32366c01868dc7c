"""The control plane of `listenerd`: `/health`, `/leader`, `/cluster/status`, `/cluster/nodes`, `/metrics`,
and the operator's reads and writes: `/messages…` (find, search by key or content, show, replay,
requeue), `/searches…` (the saved searches), `/stages`.

Served on every node, leader or not, so a load balancer can health-check any node and an operator
can ask any node who leads. Everything but `/health` and `/leader` needs a bearer token whose role holds
MONITORING_READ. It fails closed: no configured tokens means only `/health` answers with data;
a non-loopback bind without TLS refuses to start unless `allow_insecure_bind` says otherwise.
Tokens and message bodies are never logged. The `[api]` format is in docs/api.md.

Message bodies are PHI: a message's metadata needs `messages:read`, its bodies
`messages:read_body` (operator and admin, not viewer), asked for on purpose (`?body=1`), and each
such read is a `body_read` audit event naming the token's entry. Without `messages:read_body` a
lane key (usually the MRN) is shown as a keyed digest and may not be filtered by (docs/api.md). A
request with a body is checked (token, permission, size) as soon as its headers are in, before any
of the body is read. The access log shows query fields without their values and `/messages/{ref}`
without the ref.
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from io import BytesIO
from pathlib import Path
from types import MappingProxyType
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from include.schema import ConfigProblems
from include.schema.connections import DEFAULT_API_PORT, ApiModel
from include.schema.rules import validate
from include.store import operator, saved_searches, stats
from include.store.parquet_archive import ParquetArchive
from listeners import access_log
from listeners.api_reads import RETRY_AFTER_SECONDS, ApiReads, ReadsBusy, ReadTimedOut
from listeners.connections_config import ConnectionConfigError, TLSConfig
from listeners.guard import guard_channels
from listeners.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from listeners.state import NodeState

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = DEFAULT_API_PORT
MIN_TOKEN_LENGTH = 16
REALM = "stageline"
MAX_BODY_BYTES = 64 * 1024
MAX_NAME_BYTES = 200  # an inbound name in `GET /leader?inbound=` (config names are far shorter)
"""The largest request body the API takes (a replay or requeue is a few hundred bytes); more is 413,
answered from the headers alone."""

log = Logger(namespace="stageline.api")

_BEARER_TOKEN = re.compile(rb"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 b64token


class ApiConfigError(ConnectionConfigError):
    """The `[api]` table is wrong; the message names the setting (never a token's value)."""


class Permission(StrEnum):
    """What a request may do; one member per permission an endpoint checks."""

    MONITORING_READ = "monitoring:read"  # cluster posture, nodes, metrics: no PHI
    MESSAGES_READ = "messages:read"  # find / show messages without bodies, dead letters, stages
    MESSAGES_READ_BODY = "messages:read_body"  # a message's bodies (PHI); each read is an audit event
    MESSAGES_WRITE = "messages:write"  # replay, requeue (audit events name the token)


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"


# Every role reads monitoring and message metadata; bodies (PHI), replay and requeue are for
# operators and admins: a viewer token (what a Prometheus scrape holds) never reads a body.
ROLE_PERMISSIONS: Mapping[Role, frozenset[Permission]] = MappingProxyType(
    {
        Role.VIEWER: frozenset({Permission.MONITORING_READ, Permission.MESSAGES_READ}),
        Role.OPERATOR: frozenset(
            {
                Permission.MONITORING_READ,
                Permission.MESSAGES_READ,
                Permission.MESSAGES_READ_BODY,
                Permission.MESSAGES_WRITE,
            }
        ),
        Role.ADMIN: frozenset(
            {
                Permission.MONITORING_READ,
                Permission.MESSAGES_READ,
                Permission.MESSAGES_READ_BODY,
                Permission.MESSAGES_WRITE,
            }
        ),
    }
)
BODY_PERMISSION = Permission.MESSAGES_WRITE
"""What a request that carries a body needs: only replay and requeue take one."""


@dataclass(frozen=True)
class Denial:
    """Why a request is refused: the HTTP status, the RFC 6750 error code, and a log-safe reason."""

    status: int
    error: str
    reason: str

    def challenge(self) -> bytes:
        extra = f', error="{self.error}"' if self.error else ""
        return f'Bearer realm="{REALM}"{extra}'.encode()


@dataclass(frozen=True)
class _Token:
    digest: bytes  # sha256 of the token: the plaintext is not kept
    role: Role
    label: str  # for logs: the entry's name or where it came from, never the token


class ApiAuth:
    """Bearer tokens mapped to roles; a token is compared as a SHA-256 digest, in constant time.

    `tokens` holds (sha256 digest, role, log label) triples; `role_permissions` is replaceable so a
    deployment (or a test) can narrow what a role may do.
    """

    def __init__(
        self,
        tokens: Iterable[tuple[bytes, Role, str]] = (),
        *,
        role_permissions: Mapping[Role, frozenset[Permission]] = ROLE_PERMISSIONS,
    ) -> None:
        self._tokens = tuple(_Token(digest, role, label) for digest, role, label in tokens)
        self._role_permissions = role_permissions

    @property
    def configured(self) -> bool:
        """False when no token exists: every guarded endpoint then answers 401."""
        return bool(self._tokens)

    @staticmethod
    def digest(token: str | bytes) -> bytes:
        return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()

    @classmethod
    def from_config(
        cls,
        api: Mapping[str, Any],
        env: Mapping[str, str],
        *,
        role_permissions: Mapping[Role, frozenset[Permission]] = ROLE_PERMISSIONS,
    ) -> ApiAuth:
        """Read `[[api.tokens]]`: each has `role` and one of `token_env` / `token_sha256` (the table's
        shape is checked by `include.schema.connections.ApiTokenModel`; the tokens themselves here)."""
        entries = api.get("tokens", []) if isinstance(api, Mapping) else api
        model = _api_model({"tokens": entries}, None)
        tokens: list[tuple[bytes, Role, str]] = []
        for number, entry in enumerate(model.tokens, 1):
            where = f"[[api.tokens]] #{number}" + (f" ({entry.name!r})" if entry.name else "")
            if entry.token_env is not None:
                digest = _digest_from_env(entry.token_env, env, where)
            else:
                digest = bytes.fromhex(entry.token_sha256 or "")
            clash = next((t[2] for t in tokens if hmac.compare_digest(t[0], digest)), None)
            if clash:
                raise ApiConfigError(f"{where}: the same token as {clash}")
            tokens.append((digest, Role(entry.role), where))
        return cls(tokens, role_permissions=role_permissions)

    def label_for(self, authorization: bytes | None) -> str:
        """Who a request is, for the audit trail: its token entry's label (never the token)."""
        token = (authorization or b"").strip().partition(b" ")[2].strip()
        presented = self.digest(token)
        found = "unknown"
        for stored in self._tokens:
            if hmac.compare_digest(presented, stored.digest):
                found = stored.label
        return found

    def role_for(self, token: bytes) -> Role | None:
        """The role of `token`, or None; every stored digest is compared, so timing says nothing."""
        presented = self.digest(token)
        found: Role | None = None
        for stored in self._tokens:
            if hmac.compare_digest(presented, stored.digest):
                found = stored.role
        return found

    def allows(self, role: Role, permission: Permission) -> bool:
        return permission in self._role_permissions.get(role, frozenset())

    def check(self, authorization: bytes | None, permission: Permission) -> Denial | None:
        """None when `authorization` (the raw header) grants `permission`; else why not."""
        if not authorization:
            return Denial(401, "", "no Authorization header")
        scheme, _, token = authorization.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not _BEARER_TOKEN.fullmatch(token):
            return Denial(401, "invalid_request", "malformed Authorization header")
        role = self.role_for(token)
        if role is None:
            return Denial(401, "invalid_token", "unknown token")
        if not self.allows(role, permission):
            return Denial(403, "insufficient_scope", f"role {role.value} lacks {permission.value}")
        return None


def _digest_from_env(name: Any, env: Mapping[str, str], where: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise ApiConfigError(f"{where}: token_env must name an environment variable")
    value = env.get(name, "")
    if not value:
        raise ApiConfigError(f"{where}: environment variable {name} (token_env) is not set")
    if len(value) < MIN_TOKEN_LENGTH:
        raise ApiConfigError(f"{where}: the token in {name} is shorter than {MIN_TOKEN_LENGTH} characters")
    if not _BEARER_TOKEN.fullmatch(value.encode()):
        raise ApiConfigError(
            f"{where}: the token in {name} may hold only letters, digits and -._~+/ "
            "(with trailing =), so it can be sent as a bearer token"
        )
    return ApiAuth.digest(value)


@dataclass(frozen=True)
class ApiSettings:
    """Where the API listens. A non-loopback bind needs TLS unless `allow_insecure_bind`."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    tls: TLSConfig | None = None
    allow_insecure_bind: bool = False

    @classmethod
    def from_config(cls, api: Mapping[str, Any], base_dir: str | Path | None) -> ApiSettings:
        """Read `[api]` (tokens are ApiAuth's); TLS paths are relative to `base_dir`, the config dir
        (the working directory when None). The rules are `include.schema.connections.ApiModel`'s."""
        base = Path(base_dir or ".").resolve()
        model = _api_model(api, base)
        tls = None
        if model.tls is not None:
            paths: dict[str, Any] = {
                k: (str((base / v).resolve()) if k != "require_client_cert" and v else v)
                for k, v in model.tls.model_dump().items()
            }
            tls = TLSConfig(**paths)
        return cls(host=model.host, port=model.port, tls=tls, allow_insecure_bind=model.allow_insecure_bind)


def _api_model(api: Any, base: Path | None) -> ApiModel:
    """`[api]` validated: every problem at once, keyed `api.<setting>` (`ApiConfigError`)."""
    try:
        return validate(ApiModel, api, prefix="api", context={"base": base, "roles": [r.value for r in Role]})
    except ConfigProblems as exc:
        raise ApiConfigError(exc.problems) from None


# --- the resource tree -----------------------------------------------------------------------------


def make_api(state: NodeState, auth: ApiAuth) -> Site:
    """The control-plane site; bind it with `listeners.server_tls.listen(reactor, host, port, site, tls)`."""

    def health(request: Request) -> bytes:
        return _json(request, 200, {"status": "ok", "node_id": state.node_id, "role": state.status()["role"]})

    unknown_asked: set[str] = set()

    def leader(request: Request) -> bytes:
        args = request.args or {}
        names = args.get(b"inbound") or []
        if set(args) - {b"inbound"}:
            return _json(request, 400, {"error": "the only query field of /leader is inbound"})
        if len(names) > 1 or any(len(n) > MAX_NAME_BYTES for n in names):
            return _json(request, 400, {"error": "at most one inbound name, of at most 200 bytes"})
        inbound = names[0].decode("utf-8", "replace") if names else None
        code, doc = state.leader(inbound)  # in memory: no database round trip (a load balancer's health check)
        if code == 404 and inbound not in unknown_asked and len(unknown_asked) < 16:
            unknown_asked.add(inbound or "")  # a balancer asking for a renamed inbound empties its VIP: say so once
            log.warn(
                "GET /leader?inbound={name}: no such inbound connection here (a load balancer's check naming "
                "a renamed or misspelt inbound keeps every node out of its VIP)",
                name=ascii(inbound or ""),
            )
        return _json(request, code, doc)

    def status(request: Request) -> bytes:
        return _json(request, 200, state.status())

    def metrics(request: Request) -> Any:
        """The registry, once the store's figures are fresh (or the wait for them timed out)."""
        request.setHeader(b"content-type", METRICS_CONTENT_TYPE.encode())
        if state.store_metrics is None:
            return state.metrics.render()
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))

        def answer(_: Any) -> None:
            if not gone:
                request.write(state.metrics.render())
                request.finish()

        state.store_metrics.fresh().addCallback(answer)
        return NOT_DONE_YET

    def nodes(request: Request) -> Any:
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))  # the client went away

        def answer(code: int, doc: dict[str, Any]) -> None:
            if not gone:
                request.write(_json(request, code, doc))
                request.finish()

        def failed(failure: Failure) -> None:
            log.failure("api: the /cluster/nodes read failed", failure)
            answer(503, {"error": "membership unavailable"})

        defer.maybeDeferred(state.nodes).addCallback(lambda doc: answer(200, doc)).addErrback(failed)
        return NOT_DONE_YET

    read = Permission.MONITORING_READ
    cluster = _Directory()
    cluster.putChild(b"status", _Endpoint(status, auth=auth, permission=read))
    cluster.putChild(b"nodes", _Endpoint(nodes, auth=auth, permission=read))
    root = _Directory()
    root.putChild(b"health", _Endpoint(health))
    root.putChild(b"leader", _Endpoint(leader))  # no auth, like /health: 200 only on the serving leader
    root.putChild(b"cluster", cluster)
    root.putChild(b"metrics", _Endpoint(metrics, auth=auth, permission=read))
    root.putChild(b"messages", message_resources(state, auth))
    root.putChild(b"searches", search_resources(state, auth))
    root.putChild(b"stages", _Endpoint(lambda r: stages(r, state), auth=auth, permission=Permission.MESSAGES_READ))
    site = _ApiSite(root, auth)
    site.displayTracebacks = False
    site.noisy = False
    return guard_channels(site)


QUERY_FIELDS = frozenset(
    {
        "inbound",
        "control_id",
        "message_id",
        "lane_key",
        "connection",
        "destination",
        "status",
        "since_ms",
        "until_ms",
        "before_id",
        "limit",
        "body",
        "by",
        "chart",
        "key",
        "contains",
        "where",
        "after",
    }
)
"""The query fields the API reads: the access log names these (never their values), others not at all."""
_FIXED = {b"dead", b"requeue", b"replay"}


_ROUTES = frozenset(
    {
        b"/",
        b"/health",
        b"/leader",
        b"/metrics",
        b"/stages",
        b"/messages",
        b"/messages/dead",
        b"/messages/requeue",
        b"/searches",
        b"/cluster/status",
        b"/cluster/nodes",
    }
)


def redact_path(path: bytes) -> str:
    """`/messages/MRN-0042/replay` as `/messages/{ref}/replay`: a message ref may be an identifier;
    `/searches/smith/messages` as `/searches/{name}/messages` (a name may be one too). A path that
    matches no route is `/<unknown>`: a client may put anything in it."""
    if path in _ROUTES:
        return path.decode("ascii")
    parts = path.split(b"/")
    if len(parts) in (3, 4) and parts[1] == b"searches" and parts[2] and (len(parts) == 3 or parts[3] == b"messages"):
        return "/searches/{name}" + ("/messages" if len(parts) == 4 else "")
    if (
        len(parts) in (3, 4)
        and parts[1] == b"messages"
        and parts[2]
        and parts[2] not in _FIXED
        and (len(parts) == 3 or parts[3] == b"replay")
    ):
        return "/messages/{ref}" + ("/replay" if len(parts) == 4 else "")
    return access_log.UNKNOWN_PATH


class _ApiRequest(Request):
    """Decides on a request's body from its headers alone: a body (a POST's) needs a token whose role
    may write, and at most MAX_BODY_BYTES; otherwise 401/403/413 at once, the connection closed, and
    not one byte of the body read into memory."""

    _refused = False
    _received = 0
    content: BytesIO  # gotLength sets it before any body arrives

    def gotLength(self, length: int | None) -> None:
        self.content = BytesIO()  # never a temp file
        if length == 0:  # no body: the endpoint checks the token as for any GET
            return
        auth: ApiAuth = self.channel.site.auth  # type: ignore[attr-defined]  # Site.buildProtocol sets it
        denial = auth.check(self.requestHeaders.getRawHeaders(b"authorization", [None])[0], BODY_PERMISSION)
        if denial is not None:
            self._refuse(
                denial.status,
                denial.reason,
                challenge=denial.challenge(),
                error="unauthorized" if denial.status == 401 else "forbidden",
            )
        elif length is not None and length > MAX_BODY_BYTES:
            self._refuse(413, f"a body of {length} bytes (the API takes at most {MAX_BODY_BYTES})")

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._received += len(data)
        if self._received > MAX_BODY_BYTES:  # chunked: no length said up front
            self.content = BytesIO()
            self._refuse(413, f"a body of more than {MAX_BODY_BYTES} bytes")
            return
        self.content.write(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if not self._refused:
            super().requestReceived(command, path, version)

    def _refuse(self, status: int, reason: str, *, challenge: bytes | None = None, error: str | None = None) -> None:
        self._refused = True
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after our answer
        path = redact_path(getattr(self.channel, "_path", b"").partition(b"?")[0])
        log.info(
            "api: {status} for {path} from {peer} before its body: {reason}",
            status=status,
            path=path,
            peer=_peer(self),
            reason=reason,
        )
        phrase = {401: b"Unauthorized", 403: b"Forbidden", 413: b"Payload Too Large"}[status]
        body = json.dumps({"error": error or reason}).encode()
        transport = self.channel.transport
        assert transport is not None  # the request's headers just came in on it
        transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nCache-Control: no-store\r\n%s"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (status, phrase, b"WWW-Authenticate: %s\r\n" % challenge if challenge else b"", len(body), body)
        )
        access_log.log_refused(self, status, len(body))  # one access line per request, refused early too
        self.channel.loseConnection()


class _ApiSite(Site):
    def __init__(self, root: Resource, auth: ApiAuth) -> None:
        super().__init__(
            root, requestFactory=_ApiRequest, logFormatter=access_log.formatter(path=redact_path, known=QUERY_FIELDS)
        )
        self.auth = auth

    def log(self, request: http.Request) -> None:
        """No access line for a load balancer's health checks that were answered (`GET /health`,
        `GET /leader`: several a second per balancer, they would drown the rest); what they report
        is logged where it changes (the leader gate's state lines). Anything else is logged."""
        if (
            request.method in (b"GET", b"HEAD")
            and request.path in (b"/health", b"/leader")
            and request.code in (200, 404, 503)
        ):
            return
        super().log(request)


def _json(request: Request, code: int, doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc).encode()  # before any header: a failure here leaves the response untouched
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"application/json")
    if request.method == b"HEAD":  # headers only (Twisted would drop the body and log that it did)
        request.setHeader(b"content-length", str(len(body)).encode())
        return b""
    return body


class _NotFound(Resource):
    isLeaf = True

    def render(self, request: Request) -> bytes:
        return _json(request, 404, {"error": "not found"})


class _Directory(Resource):
    """A path segment: itself and anything not mounted below it is a JSON 404."""

    def getChild(self, path: bytes, request: Request) -> IResource:
        return _NotFound()

    def render(self, request: Request) -> bytes:
        return _json(request, 404, {"error": "not found"})


class _Endpoint(_Directory):
    """One endpoint (GET unless `methods` says otherwise): 405 for other methods, then the
    permission check, then the handler."""

    def __init__(
        self,
        handler: Callable[[Request], Any],
        *,
        auth: ApiAuth | None = None,
        permission: Permission | None = None,
        methods: tuple[bytes, ...] = (b"GET", b"HEAD"),
    ) -> None:
        super().__init__()
        self._handler = handler
        self._auth = auth
        self._permission = permission
        self._methods = methods

    def render(self, request: Request) -> Any:
        request.setHeader(b"cache-control", b"no-store")
        if request.method not in self._methods:
            request.setHeader(b"allow", b", ".join(self._methods))
            return _json(request, 405, {"error": "method not allowed"})
        if self._permission is not None:
            assert self._auth is not None
            denial = self._auth.check(request.getHeader(b"authorization"), self._permission)
            if denial is not None:
                log.info(
                    "api: {status} for {path} from {peer}: {reason}",
                    status=denial.status,
                    path=redact_path(request.path),
                    peer=_peer(request),
                    reason=denial.reason,
                )
                request.setHeader(b"www-authenticate", denial.challenge())
                return _json(request, denial.status, {"error": "unauthorized" if denial.status == 401 else "forbidden"})
        try:
            return self._handler(request)
        except _Forbidden as exc:
            return _json(request, 403, {"error": str(exc)})
        except ValueError as exc:  # bad input the handler refused before any work
            return _json(request, 400, {"error": str(exc)})
        except Exception:
            log.failure("api: {path} failed", path=redact_path(request.path))
            return _json(request, 500, {"error": "internal error"})


# --- /messages and /stages: the operator's operations (include/store/operator.py) ------------------


def message_resources(state: NodeState, auth: ApiAuth) -> Resource:
    """GET /messages?control_id=…, GET /messages/dead, GET /messages/{ref}[?body=1], POST
    /messages/{ref}/replay {"from": "inbound"|"outbound", "reason": …}, POST /messages/requeue {"stage",
    "ids" | "destination" | "lane", "reason"}. Reads need messages:read (no bodies), `?body=1`
    messages:read_body (and is a `body_read` audit event), replay/requeue messages:write; the audit
    events name the token's entry. Nothing of a message is logged."""
    read, write = Permission.MESSAGES_READ, Permission.MESSAGES_WRITE
    mask = operator.LaneMask()  # a viewer's lane keys (usually the MRN): keyed digests (docs/api.md)

    def masked(request: Request, work: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`work` as the caller may see it: lane keys masked unless it may read bodies."""
        if auth.check(request.getHeader(b"authorization"), Permission.MESSAGES_READ_BODY) is None:
            return work
        return lambda store: mask.apply(work(store))

    def find(request: Request) -> Any:
        query = _search(request, auth, _fields(request, FIND_FIELDS, repeatable={"where"}, blank={"contains", "where"}))
        return _deferred(request, masked(request, lambda store: {"messages": saved_searches.run(store, query)}), state)

    def show(ref: str) -> Callable[[Request], Any]:
        def handler(request: Request) -> Any:
            reader = None
            if _flag(_args(request).get("body")):
                denial = auth.check(request.getHeader(b"authorization"), Permission.MESSAGES_READ_BODY)
                if denial is not None:
                    log.info(
                        "api: {status} for a message's bodies from {peer}: {reason}",
                        status=denial.status,
                        peer=_peer(request),
                        reason=denial.reason,
                    )
                    return _json(
                        request, denial.status, {"error": f"bodies need {Permission.MESSAGES_READ_BODY.value}"}
                    )
                reader = operator.Reader(auth.label_for(request.getHeader(b"authorization")), "api")
            cold = ParquetArchive(state.archive_path) if state.archive_path else None
            return _deferred(
                request,
                masked(
                    request,
                    lambda s: (
                        operator.show(s, operator.resolve(s, ref, parquet=cold), parquet=cold, reader=reader).__dict__
                    ),
                ),
                state,
            )

        return handler

    def replay(ref: str) -> Callable[[Request], Any]:
        def handler(request: Request) -> Any:
            body = _body(request)
            actor = auth.label_for(request.getHeader(b"authorization"))
            return _deferred(
                request,
                lambda store: {
                    "replayed": operator.replay(
                        store,
                        [operator.resolve(store, ref)],
                        source=str(body.get("from", "")),
                        actor=f"api {actor}",
                        reason=_reason(body),
                    )
                },
                state,
            )

        return handler

    def requeue(request: Request) -> Any:
        body = _body(request)
        actor = auth.label_for(request.getHeader(b"authorization"))

        def work(store: Any) -> dict[str, Any]:
            return {
                "requeued": operator.requeue_dead(
                    store,
                    str(body.get("stage", "outbound")),
                    ids=[int(i) for i in body.get("ids", [])],
                    destination=body.get("destination"),
                    lane_key=body.get("lane"),
                    actor=f"api {actor}",
                    reason=_reason(body),
                )
            }

        return _deferred(request, work, state)

    class Messages(_Endpoint):
        def getChild(self, path: bytes, request: Request) -> IResource:
            if path == b"dead":
                return _Endpoint(
                    lambda r: _deferred(r, lambda s: {"dead_letters": operator.dead_letters(s)}, state),
                    auth=auth,
                    permission=read,
                )
            if path == b"requeue":
                return _Endpoint(requeue, auth=auth, permission=write, methods=(b"POST",))
            ref = path.decode("utf-8", "replace")
            one = _Endpoint(show(ref), auth=auth, permission=read)
            one.putChild(b"replay", _Endpoint(replay(ref), auth=auth, permission=write, methods=(b"POST",)))
            return one

    return Messages(find, auth=auth, permission=read)


def search_resources(state: NodeState, auth: ApiAuth) -> Resource:
    """GET /searches (the saved searches, by name), /searches/{name} (one), /searches/{name}/messages
    (run it over `since_ms`, `until_ms`, `before_id`, `limit`): messages:read. For a caller who may
    not read bodies, criteria values are hidden (`saved_searches.hidden`) and running one that
    searches by lane, key or content is 403, as in the Stageline view."""
    mask = operator.LaneMask()

    def may_read_bodies(request: Request) -> bool:
        return auth.check(request.getHeader(b"authorization"), Permission.MESSAGES_READ_BODY) is None

    def shown(request: Request, doc: dict[str, Any]) -> dict[str, Any]:
        return doc if may_read_bodies(request) else saved_searches.hidden(doc)

    def listing(request: Request) -> Any:
        fields = _fields(request, frozenset({"limit", "after"}))
        page = saved_searches.Page.from_query({k: v[0] for k, v in fields.items()})
        return _deferred(
            request,
            lambda store: {"searches": [shown(request, s) for s in saved_searches.list_all(store, page)]},
            state,
        )

    def one(name: str) -> Callable[[Request], Any]:
        def handler(request: Request) -> Any:
            _fields(request, frozenset())

            def work(store: Any) -> dict[str, Any]:
                found = saved_searches.get(store, name)
                if found is None:
                    raise LookupError("no saved search of that name")
                return shown(request, found)

            return _deferred(request, work, state)

        return handler

    def run(name: str) -> Callable[[Request], Any]:
        def handler(request: Request) -> Any:
            fields = _fields(request, PAGE_FIELDS)

            def work(store: Any) -> dict[str, Any]:
                found = saved_searches.get(store, name)
                if found is None:
                    raise LookupError("no saved search of that name")
                query = _search(request, auth, {**fields, **_as_fields(found["query"])})
                messages = saved_searches.run(store, query)
                return {"messages": messages if may_read_bodies(request) else mask.apply(messages)}

            return _deferred(request, work, state)

        return handler

    class Searches(_Endpoint):
        def getChild(self, path: bytes, request: Request) -> IResource:
            name = path.decode("utf-8", "replace")
            search = _Endpoint(one(name), auth=auth, permission=Permission.MESSAGES_READ)
            search.putChild(b"messages", _Endpoint(run(name), auth=auth, permission=Permission.MESSAGES_READ))
            return search

    return Searches(listing, auth=auth, permission=Permission.MESSAGES_READ)


class _Forbidden(ValueError):
    """A search the caller's role may not make (403)."""


def _fields(
    request: Request,
    allowed: frozenset[str],
    *,
    repeatable: frozenset[str] | set[str] = frozenset(),
    blank: frozenset[str] | set[str] = frozenset(),
) -> dict[str, list[str]]:
    """The query string's non-empty fields as text, and those in `blank` even when empty (`?contains=`
    searches for nothing: the search refuses it, as the CLI does, rather than it being dropped into an
    unfiltered find); ValueError (400) for a field not in `allowed` (not echoed: its name may be data)
    or one given twice that may not be."""
    fields: dict[str, list[str]] = {}
    unknown = 0
    args = dict(request.args or {})
    for bare in re.split(rb"[&;]", request.uri.partition(b"?")[2]):  # `?contains` alone: Twisted drops it
        if bare in {b.encode() for b in blank} and bare not in args:
            args[bare] = [b""]
    for raw, values in args.items():
        name = raw.decode("utf-8", "replace")
        if name not in allowed:
            unknown += 1
            continue
        if len(values) > 1 and name not in repeatable:
            raise ValueError(f"{name} given {len(values)} times: give it once")
        texts = [v.decode("utf-8", "replace") for v in values if v or name in blank]
        if texts:
            fields[name] = texts
    if unknown:
        raise ValueError(
            f"{unknown} unknown field(s) (not echoed): this takes {', '.join(sorted(allowed)) or 'no fields'}"
        )
    return fields


def _as_fields(criteria: Mapping[str, Any]) -> dict[str, list[str]]:
    """A saved search's criteria as query fields."""
    return {k: (list(v) if isinstance(v, list) else [str(v)]) for k, v in criteria.items()}


def _search(request: Request, auth: ApiAuth, fields: Mapping[str, list[str]]) -> saved_searches.Query:
    """The search `fields` ask for (`messages find`'s criteria and page, as `saved_searches.query_for`
    reads them); 400 for what it refuses, 403 for a lane, key or content search by a caller who may not
    read bodies (each would tell whether a guessed MRN or text is in the store)."""
    wanted: dict[str, Any] = {k: v[0] for k, v in fields.items() if k in saved_searches.FIELDS and k != "where"}
    wanted["where"] = list(fields.get("where", []))
    refused = saved_searches.reveals(wanted)
    if refused and auth.check(request.getHeader(b"authorization"), Permission.MESSAGES_READ_BODY) is not None:
        raise _Forbidden(f"{refused} need {Permission.MESSAGES_READ_BODY.value}")
    page = operator.Filters.from_query({k: v[0] for k, v in fields.items() if k in PAGE_FIELDS})
    try:
        return saved_searches.query_for(
            wanted, since_ms=page.since_ms, until_ms=page.until_ms, before_id=page.before_id, limit=page.limit
        )
    except ValueError as exc:
        raise ValueError(unechoed(str(exc), [v for values in fields.values() for v in values])) from None


QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'" + r'|"(?:[^"\\]|\\.)*"')


def unechoed(error: str, given: Iterable[str]) -> str:
    """`error` (the CLI's reason) without what the caller sent: each quoted text in it that is part
    of a value given (a clause, a field path, a regex) reads `(not echoed)`. A 400 body is read by
    proxies, logs and whoever holds the response; the CLI echoes to its own user only."""
    values = [v for v in given if v]

    def scrub(found: re.Match[str]) -> str:
        try:
            text = ast.literal_eval(found.group())
        except (ValueError, SyntaxError):
            text = found.group()[1:-1]
        echoed = text in values or (len(text) > 1 and any(text in v for v in values))  # `'-'` tells nothing
        return "(not echoed)" if echoed else found.group()

    return QUOTED.sub(scrub, error)


def stages(request: Request, state: NodeState) -> Any:
    """`GET /stages`: per stage; `?by=destination|connection` each one's health (include/store/stats.py),
    `&chart=1` with each destination's deliveries per minute over the last hour (the view's chart)."""
    if not request.uri.partition(b"?")[2]:
        return _deferred(request, lambda store: operator.stages(store), state)
    fields = {k.decode("utf-8", "replace"): v for k, v in request.args.items()}  # `?by` alone has none
    by, chart = fields.pop("by", [b""]), fields.pop("chart", [b"0"])
    by_name = by[0].decode("utf-8", "replace") if len(by) == 1 else ""
    if fields or by_name not in stats.BY or len(chart) != 1 or chart[0] not in (b"0", b"1"):
        return _json(
            request,
            400,
            {"error": f"give by= one of {', '.join(stats.BY)} once, and at most chart=0 or 1; nothing else"},
        )
    return _deferred(request, lambda store: stats.health(store, by=by_name, chart=chart[0] == b"1"), state)


def _args(request: Request) -> dict[str, str]:
    """The query string's fields (the first of each), as text."""
    return {k.decode("utf-8", "replace"): v[0].decode("utf-8", "replace") for k, v in request.args.items() if v}


def _flag(value: str | None) -> bool:
    if value is None or value.lower() in ("", "0", "false", "no"):
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    raise ValueError(f"body must be 1 or 0, got {value[:20]!r}")


def _body(request: Request) -> dict[str, Any]:
    try:
        raw = request.content.read() if request.content is not None else b""
        doc = json.loads(raw or b"{}")
    except ValueError:
        raise ValueError("the body must be a JSON object") from None
    if not isinstance(doc, dict):
        raise ValueError("the body must be a JSON object")
    return doc


def _reason(body: dict[str, Any]) -> str:
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("give a reason (it goes into the audit trail)")
    return reason


PAGE_FIELDS = frozenset({"since_ms", "until_ms", "before_id", "limit"})
"""The window and page of every search (`messages find`'s --since, --until, --before-id, --limit)."""
FIND_FIELDS = frozenset({*saved_searches.FIELDS, *PAGE_FIELDS})
"""The query fields `GET /messages` takes: `messages find`'s criteria (`where` repeatable) and page."""
READS = ApiReads()
"""The API's store reads: their own threads, so a slow read never takes the heartbeat's (`api_reads`)."""


def _deferred(request: Request, work: Callable[[Any], Any], state: NodeState) -> Any:
    """Run `work(store)` off the reactor and answer its result as JSON: 400 for bad input, 404 for
    an unknown message, 503 when the store cannot be read."""
    gone: list[bool] = []
    request.notifyFinish().addErrback(lambda _: gone.append(True))

    def answer(code: int, doc: Any) -> None:
        if not gone:
            request.write(_json(request, code, doc))
            request.finish()

    def failed(failure: Failure) -> None:
        if failure.check(LookupError):
            answer(404, {"error": str(failure.value)})
        elif failure.check(_Forbidden):
            answer(403, {"error": str(failure.value)})
        elif failure.check(ValueError):
            answer(400, {"error": str(failure.value)})
        elif failure.check(ReadsBusy, ReadTimedOut):
            if failure.check(ReadsBusy):
                request.setHeader(b"retry-after", str(RETRY_AFTER_SECONDS).encode())
            log.warn("api: {path}: {error}", path=redact_path(request.path), error=str(failure.value))
            answer(503, {"error": f"store busy: {failure.value}"})
        else:
            log.warn("api: {path}: {error}", path=redact_path(request.path), error=type(failure.value).__name__)
            answer(503, {"error": "store unavailable"})

    def run() -> Any:
        store = state.store()
        if store is None:
            raise RuntimeError("no store")
        return work(store)

    READS.run(run).addCallbacks(lambda doc: answer(200, doc), failed)
    return NOT_DONE_YET


def _peer(request: Request) -> str:
    address = request.getClientAddress()
    return str(getattr(address, "host", address))
