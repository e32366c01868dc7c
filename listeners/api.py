"""The control plane of `listenerd`: `/health`, `/cluster/status`, `/cluster/nodes`, `/metrics`.

Served on every node, leader or not, so a load balancer can health-check any node and an operator
can ask any node who leads. Everything but `/health` needs a bearer token whose role holds
MONITORING_READ. It fails closed: no configured tokens means only `/health` answers with data;
a non-loopback bind without TLS refuses to start unless `allow_insecure_bind` says otherwise.
Tokens and message bodies are never logged. The `[api]` format is in docs/api.md.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from include.parquet_archive import ParquetArchive
from include.store import operator
from listeners.connections import ConnectionConfigError, TLSConfig, check_bind
from listeners.guard import guard_channels
from listeners.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from listeners.state import NodeState

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
MIN_TOKEN_LENGTH = 16
REALM = "stageline"

log = Logger(namespace="stageline.api")

_BEARER_TOKEN = re.compile(rb"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 b64token
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


class ApiConfigError(ConnectionConfigError):
    """The `[api]` table is wrong; the message names the setting (never a token's value)."""


class Permission(StrEnum):
    """What a request may do; one member per permission an endpoint checks."""
    MONITORING_READ = "monitoring:read"  # cluster posture, nodes, metrics: no PHI
    MESSAGES_READ = "messages:read"      # find / show messages (bodies: PHI), dead letters, stages
    MESSAGES_WRITE = "messages:write"    # replay, requeue (audit events name the token)


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"


# Every role reads monitoring and messages; replay and requeue are for operators and admins.
ROLE_PERMISSIONS: Mapping[Role, frozenset[Permission]] = MappingProxyType({
    Role.VIEWER: frozenset({Permission.MONITORING_READ, Permission.MESSAGES_READ}),
    Role.OPERATOR: frozenset({Permission.MONITORING_READ, Permission.MESSAGES_READ, Permission.MESSAGES_WRITE}),
    Role.ADMIN: frozenset({Permission.MONITORING_READ, Permission.MESSAGES_READ, Permission.MESSAGES_WRITE}),
})


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
    label: str     # for logs: the entry's name or where it came from, never the token


class ApiAuth:
    """Bearer tokens mapped to roles; a token is compared as a SHA-256 digest, in constant time.

    `tokens` holds (sha256 digest, role, log label) triples; `role_permissions` is replaceable so a
    deployment (or a test) can narrow what a role may do.
    """

    def __init__(self, tokens: Iterable[tuple[bytes, Role, str]] = (), *,
                 role_permissions: Mapping[Role, frozenset[Permission]] = ROLE_PERMISSIONS) -> None:
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
    def from_config(cls, api: Mapping[str, Any], env: Mapping[str, str], *,
                    role_permissions: Mapping[Role, frozenset[Permission]] = ROLE_PERMISSIONS) -> ApiAuth:
        """Read `[[api.tokens]]`: each has `role` and one of `token_env` / `token_sha256`."""
        entries = api.get("tokens", [])
        if not isinstance(entries, list):
            raise ApiConfigError("[api] tokens must be an array of tables ([[api.tokens]])")
        tokens: list[tuple[bytes, Role, str]] = []
        for number, entry in enumerate(entries, 1):
            where = f"[[api.tokens]] #{number}"
            if not isinstance(entry, dict):
                raise ApiConfigError(f"{where}: must be a table")
            if isinstance(entry.get("name"), str) and entry["name"]:
                where += f" ({entry['name']!r})"
            if "token" in entry:
                raise ApiConfigError(f"{where}: a plaintext token in the config file is refused; set token_env "
                                     "(an environment variable holding the token) or token_sha256 (its hex "
                                     "SHA-256 digest)")
            unknown = sorted(set(entry) - {"name", "role", "token_env", "token_sha256"})
            if unknown:
                raise ApiConfigError(f"{where}: unknown setting(s): {', '.join(unknown)}")
            try:
                role = Role(str(entry.get("role")).lower())  # "viewer" and "VIEWER" alike
            except ValueError:
                raise ApiConfigError(f"{where}: role must be one of {', '.join(r.value for r in Role)}") from None
            if ("token_env" in entry) == ("token_sha256" in entry):
                raise ApiConfigError(f"{where}: give exactly one of token_env or token_sha256")
            if "token_env" in entry:
                digest = _digest_from_env(entry["token_env"], env, where)
            else:
                value = entry["token_sha256"]
                if not isinstance(value, str) or not _SHA256_HEX.fullmatch(value):
                    raise ApiConfigError(f"{where}: token_sha256 must be 64 hex digits")
                digest = bytes.fromhex(value)
            clash = next((t[2] for t in tokens if hmac.compare_digest(t[0], digest)), None)
            if clash:
                raise ApiConfigError(f"{where}: the same token as {clash}")
            tokens.append((digest, role, where))
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
        raise ApiConfigError(f"{where}: the token in {name} may hold only letters, digits and -._~+/ "
                             "(with trailing =), so it can be sent as a bearer token")
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
        (the working directory when None)."""
        unknown = sorted(set(api) - {"host", "port", "tls", "allow_insecure_bind", "tokens"})
        if unknown:
            raise ApiConfigError(f"[api]: unknown setting(s): {', '.join(unknown)}")
        host = api.get("host", DEFAULT_HOST)
        port = api.get("port", DEFAULT_PORT)
        insecure = api.get("allow_insecure_bind", False)
        if not isinstance(host, str) or not host:
            raise ApiConfigError("[api] host must be a non-empty string")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ApiConfigError("[api] port must be an integer 0..65535")
        if not isinstance(insecure, bool):
            raise ApiConfigError("[api] allow_insecure_bind must be true or false")
        tls = _tls(api["tls"], Path(base_dir or ".")) if "tls" in api else None
        check_bind(host, tls=tls is not None, allow_insecure=insecure, what=f"[api] (API on {host}:{port})")
        return cls(host=host, port=port, tls=tls, allow_insecure_bind=insecure)


def _tls(raw: Any, base: Path) -> TLSConfig:
    known = {f.name for f in fields(TLSConfig)}
    if not isinstance(raw, dict) or set(raw) - known:
        raise ApiConfigError("[api.tls] must be a table with cert, key, ca, require_client_cert")
    for name in ("cert", "key", "ca"):
        if not isinstance(raw.get(name, ""), str):
            raise ApiConfigError(f"[api.tls] {name} must be a file path")
    if not isinstance(raw.get("require_client_cert", False), bool):
        raise ApiConfigError("[api.tls] require_client_cert must be true or false")
    tls = TLSConfig(**{k: (str((base / v).resolve()) if k != "require_client_cert" and v else v)
                       for k, v in raw.items()})
    if not (tls.cert and tls.key):
        raise ApiConfigError("[api.tls] needs cert and key")
    if tls.require_client_cert and not tls.ca:
        raise ApiConfigError("[api.tls] require_client_cert needs ca (the client CA bundle)")
    return tls


# --- the resource tree -----------------------------------------------------------------------------

def make_api(state: NodeState, auth: ApiAuth) -> Site:
    """The control-plane site; bind it with `listeners.tls.listen(reactor, host, port, site, tls)`."""

    def health(request: Request) -> bytes:
        return _json(request, 200, {"status": "ok", "node_id": state.node_id, "role": state.status()["role"]})

    def status(request: Request) -> bytes:
        return _json(request, 200, state.status())

    def metrics(request: Request) -> bytes:
        request.setHeader(b"content-type", METRICS_CONTENT_TYPE.encode())
        return state.metrics.render()

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
    root.putChild(b"cluster", cluster)
    root.putChild(b"metrics", _Endpoint(metrics, auth=auth, permission=read))
    root.putChild(b"messages", message_resources(state, auth))
    root.putChild(b"stages", _Endpoint(lambda r: _deferred(r, lambda store: operator.stages(store), state),
                                       auth=auth, permission=Permission.MESSAGES_READ))
    site = Site(root)
    site.displayTracebacks = False
    site.noisy = False
    return guard_channels(site)


def _json(request: Request, code: int, doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc).encode()  # before any header: a failure here leaves the response untouched
    request.setResponseCode(code)
    request.setHeader(b"content-type", b"application/json")
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

    def __init__(self, handler: Callable[[Request], Any], *, auth: ApiAuth | None = None,
                 permission: Permission | None = None, methods: tuple[bytes, ...] = (b"GET", b"HEAD")) -> None:
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
                log.info("api: {status} for {path} from {peer}: {reason}", status=denial.status,
                         path=request.path.decode("ascii", "replace"), peer=_peer(request), reason=denial.reason)
                request.setHeader(b"www-authenticate", denial.challenge())
                return _json(request, denial.status, {"error": "unauthorized" if denial.status == 401
                                                      else "forbidden"})
        try:
            return self._handler(request)
        except ValueError as exc:  # bad input the handler refused before any work
            return _json(request, 400, {"error": str(exc)})
        except Exception:
            log.failure("api: {path} failed", path=request.path.decode("ascii", "replace"))
            return _json(request, 500, {"error": "internal error"})


# --- /messages and /stages: the operator's operations (include/store/operator.py) ------------------

def message_resources(state: NodeState, auth: ApiAuth) -> Resource:
    """GET /messages?control_id=…, GET /messages/dead, GET /messages/{ref}, POST /messages/{ref}/replay
    {"from": "inbound"|"outbound", "reason": …}, POST /messages/requeue {"stage", "ids" | "destination"
    | "lane", "reason"}. Reads need messages:read, replay/requeue messages:write; the audit events
    name the token's entry. Nothing of a message is logged."""
    read, write = Permission.MESSAGES_READ, Permission.MESSAGES_WRITE

    def find(request: Request) -> Any:
        filters = operator.Filters.from_query({k.decode(): v[0].decode() for k, v in request.args.items() if v})
        return _deferred(request, lambda store: {"messages": operator.find(store, filters)}, state)

    def replay(ref: str) -> Callable[[Request], Any]:
        def handler(request: Request) -> Any:
            body = _body(request)
            actor = auth.label_for(request.getHeader(b"authorization"))
            return _deferred(request, lambda store: {"replayed": operator.replay(
                store, [operator.resolve(store, ref)], source=str(body.get("from", "")), actor=f"api {actor}",
                reason=_reason(body))}, state)
        return handler

    def requeue(request: Request) -> Any:
        body = _body(request)
        actor = auth.label_for(request.getHeader(b"authorization"))

        def work(store: Any) -> dict:
            return {"requeued": operator.requeue_dead(
                store, str(body.get("stage", "outbound")), ids=[int(i) for i in body.get("ids", [])],
                destination=body.get("destination"), lane_key=body.get("lane"), actor=f"api {actor}",
                reason=_reason(body))}
        return _deferred(request, work, state)

    class Messages(_Endpoint):
        def getChild(self, path: bytes, request: Request) -> IResource:
            if path == b"dead":
                return _Endpoint(lambda r: _deferred(r, lambda s: {"dead_letters": operator.dead_letters(s)}, state),
                                 auth=auth, permission=read)
            if path == b"requeue":
                return _Endpoint(requeue, auth=auth, permission=write, methods=(b"POST",))
            ref = path.decode("utf-8", "replace")
            cold = ParquetArchive(state.archive_path) if state.archive_path else None
            one = _Endpoint(lambda r: _deferred(r, lambda s: operator.show(
                s, operator.resolve(s, ref, parquet=cold), parquet=cold).__dict__, state), auth=auth, permission=read)
            one.putChild(b"replay", _Endpoint(replay(ref), auth=auth, permission=write, methods=(b"POST",)))
            return one

    return Messages(find, auth=auth, permission=read)


def _body(request: Request) -> dict[str, Any]:
    try:
        doc = json.loads(request.content.read() or b"{}")
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
        elif failure.check(ValueError):
            answer(400, {"error": str(failure.value)})
        else:
            log.warn("api: {path}: {error}", path=request.path.decode("ascii", "replace"), error=failure.type.__name__)
            answer(503, {"error": "store unavailable"})

    def run() -> Any:
        store = state.store()
        if store is None:
            raise RuntimeError("no store")
        return work(store)

    threads.deferToThread(run).addCallbacks(lambda doc: answer(200, doc), failed)
    return NOT_DONE_YET


def _peer(request: Request) -> str:
    address = request.getClientAddress()
    return str(getattr(address, "host", address))
