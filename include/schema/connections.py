"""The models of `<config>/connections.toml`: `[[inbound]]` (with `[inbound.tls]` and
`[inbound.database]`) and `[api]` (with `[api.tls]` and `[[api.tokens]]`).

Validation context (`context=` of `include.schema.rules.validate`):
``base``  the config dir: TLS files, file-drop directories and SQLite sources are relative to it;
          TLS files must exist there as readable regular files (without it, no file is looked at).
``var``   the node's var dir (`include.config.var_dir()`): where a file inbound's archive and
          rejected directories go by default, outside the partner-writable drop tree.
``roles`` the API roles a token may name (default `API_ROLES`).
``store_dir`` the SQLite store's directory, when known: no file inbound may poll it or move files into it.
The runtime structures (`listeners.connections_config.InboundConfig`, `listeners.api.ApiSettings`) are built
from these models; docs/config-reference.md describes every key.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails

from include.charsets import HL7_CHARSETS, codec_for
from include.cidrs import source_network
from include.hl7path import FieldPathError, parse_path
from include.schema import Strict
from include.schema.filedrop_paths import processing_dir
from include.schema.rules import Rules, refuses

__all__ = [
    "API_ROLES",
    "DEFAULT_API_PORT",
    "DEFAULT_MAX_FHIR_ELEMENTS",
    "ApiModel",
    "ApiTokenModel",
    "ConnectionsFile",
    "DatabaseSourceModel",
    "InboundModel",
    "TLSModel",
    "file_paths",
    "is_loopback",
]

API_ROLES = ("viewer", "operator", "admin")
NETWORK_KINDS = ("mllp", "tcp", "http")
DEFAULT_API_PORT = 8470
"""`[api].port` when a connections.toml does not set it."""
DEFAULT_MAX_FHIR_ELEMENTS = 50_000
"""JSON values a FHIR body may hold (`listeners.fhir_inbound`): validating costs about the same per
value whatever the shape, so this bounds one body's CPU and memory (figures: docs/performance.md);
a transaction Bundle of 2,000 Observations holds about 42,000."""
_NAME = r"^[A-Za-z0-9_-]+$"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SQL_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")  # as include.store.queries finds them

Port = Annotated[int, Field(ge=0, le=65535)]
Seconds = Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)]
"""A timeout: above zero, at most a day (a larger one is a typo, and holds a slot for good)."""
PollSeconds = Annotated[float, Field(ge=0.05, le=3600, allow_inf_nan=False)]
"""A poll interval: below 0.05 s a poll is a busy loop (and a file is taken while it is written)."""
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Count = Annotated[int, Field(gt=0, le=1_000_000)]
UNION_MAX = {4: 2**24, 6: 2**112}
"""The most addresses all `allowed_sources` entries of one version may admit together (one /8, one
/16 of IPv6): judged on the union, or 256 /8 entries would admit every IPv4 address."""
NAME_MAX = 64
LANE_INDEX_MAX = 999
MIN_PREFIX = {4: 8, 6: 16}
"""The widest network an `allowed_sources` entry may be and still count as authenticating senders:
an IPv4 /8 (16 M addresses, the largest private range) or an IPv6 /16. A wider entry (`0.0.0.0/0`,
`::/0`, `0.0.0.0/1`) lets (nearly) anyone in, so it needs `allow_unauthenticated_senders = true`."""
FILE_KEYS = ("directory", "archive", "error_directory", "pattern", "allow_archive_in_directory")
NETWORK_KEYS = (
    "host",
    "port",
    "idle_timeout_seconds",
    "max_connections",
    "max_connections_per_peer",
    "connect_rate_per_peer",
    "frame_timeout_seconds",
    "handshake_timeout_seconds",
    "max_bytes_per_second_per_peer",
    "allow_insecure_bind",
    "allowed_sources",
    "allow_unauthenticated_senders",
    "tls",
)
ONLY_FOR = {
    **dict.fromkeys(FILE_KEYS, ("file",)),
    **dict.fromkeys(NETWORK_KEYS, NETWORK_KINDS),
    "poll_seconds": ("file", "database"),
    "framing": ("tcp",),
    "batch_ack": ("mllp",),
    "accept": ("http",),
    "max_fhir_elements": ("http",),
}
"""Keys that mean something for some kinds only: set on another kind they would be silently ignored."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ctx(info: ValidationInfo, key: str) -> Any:
    return (info.context or {}).get(key)


def _readable_file(value: str, info: ValidationInfo) -> str:
    """`value` resolved against the config dir; it must be a readable regular file there."""
    base = _ctx(info, "base")
    if not value or base is None:
        return value
    path = (Path(base) / value).resolve()
    if not path.is_file():
        raise ValueError(f"no such file: {path}" if not path.exists() else f"not a regular file: {path}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"cannot read {path}")
    return str(path)


class TLSModel(Strict):
    """`[inbound.tls]` / `[api.tls]`: the server's certificate and key, and the client CAs for mTLS."""

    cert: str = Field(min_length=1, description="PEM certificate (chain) file, relative to the config dir")
    key: str = Field(min_length=1, description="PEM private key file (unencrypted)")
    ca: str = Field("", description="PEM bundle of the CAs whose client certificates are accepted")
    require_client_cert: bool = Field(False, description="mTLS: a client without a certificate signed by ca is refused")

    @field_validator("cert", "key", "ca")
    @classmethod
    def _exists(cls, value: str, info: ValidationInfo) -> str:
        return _readable_file(value, info)

    @model_validator(mode="after")
    def _mtls_needs_ca(self) -> TLSModel:
        if self.require_client_cert and not self.ca:
            Rules.raise_if([("ca", "require_client_cert needs ca (the client CA bundle)")])
        return self


class DatabaseSourceModel(Strict):
    """`[inbound.database]`: the table a `kind = "database"` connection polls (listeners/dbpoll.py)."""

    backend: Literal["postgres", "sqlserver", "sqlite"] = "postgres"
    server: str = "localhost"
    port: Port = Field(0, description="0: the backend's default")
    database: str = Field(min_length=1, description="the database name; sqlite: the file (relative to the config dir)")
    username: str = ""
    password_env: str = Field(
        "",
        pattern=r"^([A-Za-z_][A-Za-z0-9_]*)?$",
        description="the environment variable holding the password (never the file)",
    )
    query: str = Field(min_length=1, description="SELECT of the rows to stage, ordered by key_column")
    key_column: str = Field("id", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    message_column: str = Field(
        "",
        pattern=r"^([A-Za-z_][A-Za-z0-9_]*)?$",
        description="the column holding the message; empty: the whole row as JSON",
    )
    strategy: Literal["watermark", "mark"] = "watermark"
    mark: str = Field("", description="strategy mark: the UPDATE that marks one row read (:key)")
    reject: str = Field("", description="strategy mark: the UPDATE for a row that cannot be staged")
    start_after: int | str = Field(0, description="watermark: the mark before the first poll")
    batch_size: int = Field(100, gt=0, le=100_000)
    connect_timeout_seconds: Annotated[float, Field(gt=0, le=600, allow_inf_nan=False)] = 10.0

    _no_password = refuses(
        "password",
        "a password in the config file is refused (put the password in an "
        "environment variable and name it in password_env)",
    )

    @model_validator(mode="after")
    def _statements(self) -> DatabaseSourceModel:
        bad: list[tuple[str, str]] = []
        if not re.match(r"\s*(SELECT|WITH)\b", self.query, re.IGNORECASE):
            bad.append(("query", "query must be a SELECT (or WITH ... SELECT) of the rows to stage"))
        allowed = {"watermark", "limit"} if self.strategy == "watermark" else {"limit"}
        params = set(_SQL_PARAM.findall(self.query))
        if params - allowed:
            bad.append(
                (
                    "query",
                    f"query takes only {', '.join(':' + p for p in sorted(allowed))}, "
                    f"got {', '.join(':' + p for p in sorted(params - allowed))}",
                )
            )
        if self.strategy == "watermark":
            if "watermark" not in params:
                bad.append(
                    (
                        "query",
                        f'strategy = "watermark" needs :watermark in query, e.g. "SELECT ... WHERE '
                        f'{self.key_column} > :watermark ORDER BY {self.key_column} LIMIT :limit"',
                    )
                )
            if self.mark or self.reject:
                bad.append(("mark" if self.mark else "reject", 'mark and reject belong to strategy = "mark"'))
        else:
            for key in ("mark", "reject"):
                statement = getattr(self, key)
                if key == "reject" and not statement:
                    continue
                if not re.match(r"\s*UPDATE\b", statement, re.IGNORECASE) or set(_SQL_PARAM.findall(statement)) != {
                    "key"
                }:
                    bad.append(
                        (
                            key,
                            f'strategy = "mark" needs {key} = an UPDATE that takes only :key, e.g. '  # noqa: S608 (a message, not SQL)
                            f"\"UPDATE outbox SET status = 'sent' WHERE {self.key_column} = :key\"",
                        )
                    )
        Rules.raise_if(bad)
        return self


class InboundModel(Strict):
    """One `[[inbound]]` connection."""

    name: str = Field(
        pattern=_NAME,
        max_length=NAME_MAX,
        description=f"letters, digits, - and _ (at most {NAME_MAX}); unique in the file",
    )
    kind: Literal["mllp", "tcp", "file", "http", "database"]
    host: str = Field("127.0.0.1", min_length=1)
    port: Port = 0
    directory: str = Field("", description="file: the polled drop directory")
    archive: str = Field("", description="file: where ingested files go (default <var>/filedrop/<name>/archive)")
    error_directory: str = Field(
        "",
        description="file: where refused files go, with a .reason "
        "(default <archive>/rejected if archive is set, else "
        "<var>/filedrop/<name>/rejected)",
    )
    pattern: str = Field("*", min_length=1, description="file: glob of files to ingest")
    poll_seconds: PollSeconds = Field(1.0, description="file, database: seconds between polls (0.05 to 3600)")
    framing: Literal["newline", "length"] = "newline"
    lane_key: str = Field("", description="HL7 path (e.g. PID-3.1) giving the row's lane; empty: none")
    hl7_only: bool = False
    accept: list[Literal["hl7v2", "fhir"]] = Field(
        ["hl7v2"],
        min_length=1,
        description='http: what a POST may carry: "hl7v2" (HL7 v2 text) and/or "fhir" (FHIR R4 JSON)',
    )
    batch_ack: Literal["batch", "messages"] = "batch"
    charset: str = Field("utf-8", description="used when a message does not declare MSH-18; HL7 table 0211")
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=64, le=1024**3, description="at most 1 GiB")
    max_fhir_elements: int = Field(
        DEFAULT_MAX_FHIR_ELEMENTS,
        ge=100,
        le=10_000_000,
        description="http: the most JSON values (objects, members, array items) a FHIR body may hold; "
        "more is refused with 413 too-costly before it is validated (100 to 10,000,000)",
    )
    idle_timeout_seconds: Seconds = 300.0
    max_connections: Count = 64
    max_connections_per_peer: Count = 16
    connect_rate_per_peer: Positive = 20.0
    frame_timeout_seconds: Seconds = 10.0
    handshake_timeout_seconds: Seconds = 10.0
    max_bytes_per_second_per_peer: Positive = 8.0 * 1024 * 1024
    allow_insecure_bind: bool = False
    allowed_sources: list[str] = Field(default_factory=list, description="CIDRs a sender may connect from")
    allow_unauthenticated_senders: bool = False
    allow_archive_in_directory: bool = False
    profile: str | list[str] = Field(
        "", description="conformance profile file(s), relative to the config dir (docs/profiles.md); empty: none"
    )
    on_violation: Literal["reject", "flag", "off"] = Field(
        "reject",
        description="a message departing from the profile: reject (AR, one ERR a finding, nothing staged), "
        "flag (staged with its findings), off (not checked)",
    )
    tls: TLSModel | None = None
    database: DatabaseSourceModel | None = None

    @field_validator("profile")
    @classmethod
    def _profile(cls, value: str | list[str]) -> str | list[str]:
        paths = [value] if isinstance(value, str) else value
        if isinstance(value, list) and not all(paths):
            raise ValueError("a profile path cannot be empty")
        if len(paths) > 64:
            raise ValueError("at most 64 profiles a connection")
        return value

    @field_validator("charset")
    @classmethod
    def _charset(cls, value: str) -> str:
        if codec_for(value) is None:
            raise ValueError(
                f"unknown charset; accepted (HL7 table 0211): {', '.join(HL7_CHARSETS)} "
                "(or a Python alias of one of these)"
            )
        return value

    @field_validator("allowed_sources")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        bad = []
        for i, cidr in enumerate(value):
            try:
                source_network(cidr)
            except ValueError as exc:
                hint = (
                    " (host bits set: name the network, e.g. 10.1.2.0/24, or one address)"
                    if "host bits" in str(exc)
                    else ""
                )
                bad.append((f"[{i}]", f"not a CIDR such as 10.1.2.0/24 or 192.0.2.7{hint}"))
        Rules.raise_if(bad)
        return value

    @field_validator("lane_key")
    @classmethod
    def _lane_key(cls, value: str) -> str:
        if value:
            try:
                path = parse_path(value)
            except FieldPathError as exc:
                raise ValueError(f"lane_key must be an HL7 field path such as 'PID-3.1': {exc}") from None
            indices = [
                i
                for i in (path.field, path.occurrence, path.repetition, path.component, path.subcomponent)
                if i is not None
            ]
            if max(indices, default=0) > LANE_INDEX_MAX:
                raise ValueError(f"lane_key {value!r}: an index above {LANE_INDEX_MAX} is no HL7 field")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _kind_keys_always(cls, data: Any, handler: Any) -> Any:
        """A key of another kind is reported beside the fields' own problems (every problem at once):
        when a field fails, the after-validator below never runs, so the raw table is judged here."""
        try:
            return handler(data)
        except ValidationError as exc:
            extra = _other_kind_keys(data)
            if not extra:
                raise
            errors: list[InitErrorDetails] = []
            for e in exc.errors(include_url=False):
                detail: InitErrorDetails = {"type": e["type"], "loc": e["loc"], "input": e.get("input")}
                if "ctx" in e:
                    detail["ctx"] = e["ctx"]
                errors.append(detail)
            errors.append({"type": "value_error", "loc": (), "input": data, "ctx": {"error": Rules(extra)}})
            try:
                both = ValidationError.from_exception_data(exc.title, errors)
            except Exception:  # an error pydantic cannot rebuild: its own errors still stand
                raise exc from None
            raise both from None

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> InboundModel:
        bad: list[tuple[str, str]] = []
        if self.kind == "file" and not self.directory:
            bad.append(("directory", "a file connection needs directory"))
        if self.kind == "database" and self.database is None:
            bad.append(
                (
                    "database",
                    "a database connection needs an [inbound.database] table "
                    "(backend, database, query, key_column, strategy)",
                )
            )
        if self.database is not None and self.kind != "database":
            bad.append(("database", '[inbound.database] belongs to kind = "database" only'))
        if self.kind == "file" and self.directory:
            bad += _drop_tree(self, _ctx(info, "base"), _ctx(info, "var"), _ctx(info, "store_dir"))
        for key in sorted(self.model_fields_set & ONLY_FOR.keys()):
            if self.kind not in ONLY_FOR[key]:
                kinds = " or ".join(f'kind = "{k}"' for k in ONLY_FOR[key])
                bad.append((key, f"only for {kinds}; a {self.kind} connection would ignore it"))
        if self.kind in NETWORK_KINDS and not is_loopback(self.host):
            if self.tls is None and not self.allow_insecure_bind:
                bad.append(
                    (
                        "host",
                        f"refusing a non-loopback bind without TLS ({self.kind} on {self.host}:"
                        f"{self.port}); configure tls, or set allow_insecure_bind = true if the network "
                        "is otherwise protected",
                    )
                )
            mtls = self.tls is not None and self.tls.require_client_cert
            if not (mtls or self.allow_unauthenticated_senders):
                for i, cidr in enumerate(self.allowed_sources):
                    net = source_network(cidr)
                    if net.prefixlen < MIN_PREFIX[net.version]:
                        bad.append(
                            (
                                f"allowed_sources[{i}]",
                                f"{net} lets (nearly) every address in, so it does not "
                                f"authenticate senders (the widest counted is /{MIN_PREFIX[net.version]} for "
                                f"IPv{net.version}); list the senders' networks, or set "
                                "allow_unauthenticated_senders = true if anyone may really send",
                            )
                        )
                if not bad:
                    bad += _union_too_wide(self.allowed_sources)
            if not (mtls or self.allowed_sources or self.allow_unauthenticated_senders):
                bad.append(
                    (
                        "allowed_sources",
                        f"a non-loopback bind ({self.kind} on {self.host}) needs "
                        "authenticated senders: tls.require_client_cert = true (mTLS) or "
                        "allowed_sources (the CIDRs senders connect from), or set "
                        "allow_unauthenticated_senders = true",
                    )
                )
        Rules.raise_if(bad)
        return self


def _other_kind_keys(data: Any) -> list[tuple[str, str]]:
    """Keys of the raw table that mean nothing for its `kind` (as `ONLY_FOR` says)."""
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        return []
    kind = data["kind"]
    if kind not in ("mllp", "tcp", "file", "http", "database"):
        return []
    return [
        (
            key,
            "only for "
            + " or ".join(f'kind = "{k}"' for k in ONLY_FOR[key])
            + f"; a {kind} connection would ignore it",
        )
        for key in sorted(data)
        if key in ONLY_FOR and kind not in ONLY_FOR[key]
    ]


def _union_too_wide(cidrs: list[str]) -> list[tuple[str, str]]:
    """The entries together, per IP version (IPv4-mapped entries as IPv4, as the guard compares a
    peer): many narrow entries can add up to everyone."""
    nets: dict[int, list[Any]] = {4: [], 6: []}
    for cidr in cidrs:
        net = source_network(cidr)
        nets[net.version].append(net)
    bad = []
    for version, listed in nets.items():
        total = sum(n.num_addresses for n in ipaddress.collapse_addresses(listed))
        if total > UNION_MAX[version]:
            widest = "/8" if version == 4 else "/16"
            bad.append(
                (
                    "allowed_sources",
                    f"the IPv{version} entries together admit {total} addresses, more than "
                    f"one {widest} ({UNION_MAX[version]}), so they do not authenticate senders; list the "
                    "senders' networks, or set allow_unauthenticated_senders = true if anyone may really send",
                )
            )
    return bad


def file_paths(conn: InboundModel, base: str | Path | None, var: str | Path | None) -> tuple[str, str, str]:
    """A file connection's (directory, archive, error_directory), absolute; archive defaults to
    `<var>/filedrop/<name>/archive`, error_directory to `<archive>/rejected` when archive is set, else
    `<var>/filedrop/<name>/rejected`: outside the drop tree."""
    root = Path(base or ".")
    directory = (root / conn.directory).resolve()
    default = (Path(var) if var is not None else root / "var").resolve() / "filedrop" / conn.name
    archive = (root / conn.archive).resolve() if conn.archive else default / "archive"
    if conn.error_directory:
        rejected = (root / conn.error_directory).resolve()
    else:  # beside the archive it goes with (listeners/filedrop.py does the same)
        rejected = archive / "rejected" if conn.archive else default / "rejected"
    return str(directory), str(archive), str(rejected)


def _drop_tree(conn: InboundModel, base: Any, var: Any, store_dir: Any) -> list[tuple[str, str]]:
    directory, archive, rejected = (Path(p) for p in file_paths(conn, base, var))
    bad = []
    if rejected == directory:
        bad.append(("error_directory", "error_directory must differ from directory"))
    elif not conn.allow_archive_in_directory:
        for key, path in (("archive", archive), ("error_directory", rejected)):
            if path == directory or path.is_relative_to(directory):
                bad.append(
                    (
                        key,
                        f"{key} lies inside directory (the partner-writable drop tree); put it "
                        "elsewhere, or set allow_archive_in_directory = true",
                    )
                )
    bad += _protected_trees(conn, directory, archive, rejected, base, var, store_dir)
    bad += _through_symlinks(conn, base)
    return bad


def _protected_trees(
    conn: InboundModel, directory: Path, archive: Path, rejected: Path, base: Any, var: Any, store_dir: Any
) -> list[tuple[str, str]]:
    """Stageline's own directories are not a drop tree: a drop directory that is, contains or lies
    inside the config dir, the var dir or the store's directory would stage (and move away) the
    config files, the node's secrets or the live database; an archive or error directory there
    would write partner-named files among them. The var dir's `filedrop/<name>/` (the defaults) is
    the exception for archive and error_directory. Inside the store's directory (a sibling of the
    database) is allowed: polling and moving touch only that one directory's own files."""
    roots = [
        ("the config dir", Path(base).resolve() if base is not None else None, True),
        ("Stageline's var dir", Path(var).resolve() if var is not None else None, True),
        ("the store's directory", Path(store_dir).resolve() if store_dir is not None else None, False),
    ]
    own = Path(var).resolve() / "filedrop" / conn.name if var is not None else None
    bad = []
    for key, path in (("directory", directory), ("archive", archive), ("error_directory", rejected)):
        if key != "directory" and own is not None and (path == own or path.is_relative_to(own)):
            continue
        for label, root, inside_too in roots:
            if root is None:
                continue
            if path == root:
                what = "is"
            elif root.is_relative_to(path):
                what = "contains"
            elif inside_too and path.is_relative_to(root):
                what = "lies inside"
            else:
                continue
            bad.append(
                (
                    key,
                    f"{path} {what} {label} ({root}); a file connection would stage and move "
                    "Stageline's own files: use a directory of its own",
                )
            )
            break
        else:
            bad += _system_tree(key, path)
    return bad


SYSTEM_INSIDE = (
    "/etc",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/boot",
    "/proc",
    "/sys",
    "/dev",
)
"""System trees nothing of a file connection may lie inside either: the OS's own files and devices."""
SYSTEM_TREES = ("/", *SYSTEM_INSIDE, "/root", "/home", "/var/lib", "/run")
"""System directories no file connection may be (or contain): it would stage /etc/shadow or a
user's files and move them away. Their subdirectories are allowed (a drop under /home/partner or
/var/lib/stageline is normal), except those of SYSTEM_INSIDE."""


def _system_roots(names: tuple[str, ...]) -> dict[Path, str]:
    """Each name and what it resolves to (/bin is /usr/bin on a merged-/usr system), plus any other
    /lib* directory of this host."""
    extra = tuple(str(p) for p in Path("/").glob("lib*"))
    roots: dict[Path, str] = {}
    for name in (*names, *extra):
        roots.setdefault(Path(name), name)
        try:
            roots.setdefault(Path(name).resolve(), name)
        except OSError:
            pass
    return roots


def _system_tree(key: str, path: Path) -> list[tuple[str, str]]:
    for root, name in _system_roots(SYSTEM_TREES).items():
        if path == root or root.is_relative_to(path):
            what = "is" if path == root else "contains"
            return [
                (
                    key,
                    f"{path} {what} the system directory {name}; a file connection would stage and move "
                    "the system's files: use a directory of its own",
                )
            ]
    for root, name in _system_roots(SYSTEM_INSIDE).items():
        if path.is_relative_to(root):
            return [
                (
                    key,
                    f"{path} lies inside the system directory {name}; a file connection would stage and "
                    "move the system's files: use a directory of its own",
                )
            ]
    return []


def _through_symlinks(conn: InboundModel, base: Any) -> list[tuple[str, str]]:
    """A directory named through a symbolic link: listenerd refuses links, so name the real one."""
    root = Path(base).resolve() if base is not None else Path.cwd()
    bad = []
    for key in ("directory", "archive", "error_directory"):
        value = getattr(conn, key)
        if not value:
            continue
        named = Path(os.path.normpath(root / value))
        real = named.resolve()
        if real != named:
            bad.append((key, f"{value} is named through a symbolic link; name the real directory, {real}"))
    return bad


class ApiTokenModel(Strict):
    """One `[[api.tokens]]` entry: a role and one of token_env / token_sha256 (never the token itself)."""

    name: str = ""
    role: str = Field(description=f"one of {', '.join(API_ROLES)} (any case)")
    token_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the environment variable holding the token"
    )
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$", description="the token's hex SHA-256")

    _no_plaintext = refuses(
        "token",
        "a plaintext token in the config file is refused; set token_env (an environment "
        "variable holding the token) or token_sha256 (its hex SHA-256 digest)",
    )

    @field_validator("role")
    @classmethod
    def _role(cls, value: str, info: ValidationInfo) -> str:
        roles = tuple(_ctx(info, "roles") or API_ROLES)
        if value.lower() not in roles:
            raise ValueError(f"must be one of {', '.join(roles)}")
        return value.lower()

    @model_validator(mode="after")
    def _one_secret(self) -> ApiTokenModel:
        if (self.token_env is None) == (self.token_sha256 is None):
            Rules.raise_if([("", "give exactly one of token_env or token_sha256")])
        return self


class ApiModel(Strict):
    """`[api]`: the control plane's bind, TLS and tokens (every node, leader or standby)."""

    host: str = Field("127.0.0.1", min_length=1)
    port: Port = DEFAULT_API_PORT
    tls: TLSModel | None = None
    allow_insecure_bind: bool = False
    tokens: list[ApiTokenModel] = Field(default_factory=list)

    @model_validator(mode="after")
    def _bind(self) -> ApiModel:
        if self.tls is None and not self.allow_insecure_bind and not is_loopback(self.host):
            Rules.raise_if(
                [
                    (
                        "host",
                        f"refusing a non-loopback bind without TLS (API on {self.host}:{self.port}); "
                        "configure [api.tls], or set allow_insecure_bind = true if the network is "
                        "otherwise protected",
                    )
                ]
            )
        return self


class ConnectionsFile(Strict):
    """`connections.toml`: the inbound connections listenerd binds, and its control plane."""

    inbound: list[InboundModel] = Field(default_factory=list)
    api: ApiModel = Field(default_factory=ApiModel)  # type: ignore[arg-type]  # as in service.ServiceFile

    @model_validator(mode="after")
    def _unique(self, info: ValidationInfo) -> ConnectionsFile:
        seen: set[str] = set()
        bad = []
        for i, conn in enumerate(self.inbound):
            if conn.name in seen:
                bad.append((f"inbound[{i}].name", f"duplicate connection name {conn.name!r}"))
            seen.add(conn.name)
        bad += _shared_drops(self.inbound, _ctx(info, "base"), _ctx(info, "var"))
        bad += _tls_dirs(self, _ctx(info, "base"), _ctx(info, "var"))
        Rules.raise_if(bad)
        return self


def _shared_drops(inbound: list[InboundModel], base: Any, var: Any) -> list[tuple[str, str]]:
    """Two file connections on one drop directory stage each file twice (or race for it), and an
    archive or error directory that is (or lies inside) another connection's drop directory feeds
    every file back in: each file must be one message."""
    files = [
        (i, c, [Path(p) for p in file_paths(c, base, var)])
        for i, c in enumerate(inbound)
        if c.kind == "file" and c.directory
    ]
    drops: dict[Path, InboundModel] = {}
    bad = []
    for i, conn, (drop, _, _) in files:  # linear: a map of drop directories, each path's parents looked up
        if drop in drops:
            bad.append(
                (
                    f"inbound[{i}].directory",
                    f"{drop} is also the drop directory of connection "
                    f"{drops[drop].name!r}: each file would be staged twice",
                )
            )
        else:
            drops[drop] = conn
    for i, conn, (_, archive, rejected) in files:
        for key, path in (("archive", archive), ("error_directory", rejected)):
            other = next((drops[p] for p in (path, *path.parents) if p in drops and drops[p] is not conn), None)
            if other is not None:
                bad.append(
                    (
                        f"inbound[{i}].{key}",
                        f"{path} is (or lies inside) the drop directory of "
                        f"connection {other.name!r}: its files would be staged again",
                    )
                )
    reserved: dict[Path, tuple[InboundModel, str]] = {}
    for _, conn, (_, archive, rejected) in files:  # another's archive, error or processing dir is no drop
        for key, path in (
            ("processing", processing_dir(conn.name, archive)),
            ("archive", archive),
            ("error_directory", rejected),
        ):
            reserved.setdefault(path, (conn, key))
    for i, conn, (drop, _, _) in files:
        hit = next(
            (
                reserved[p]
                for p in (drop, *drop.parents)
                if p in reserved  # drop == archive: said above
                and (reserved[p][1] == "processing" or (reserved[p][0] is not conn and p != drop))
            ),
            None,
        )
        if hit is not None:
            what = "processing directory" if hit[1] == "processing" else hit[1]
            bad.append(
                (
                    f"inbound[{i}].directory",
                    f"{drop} is (or lies inside) the {what} of connection "
                    f"{hit[0].name!r} ({_where(hit, files)}): its files would be "
                    "staged twice",
                )
            )
    return bad


def _where(hit: tuple[InboundModel, str], files: list[Any]) -> str:
    conn, key = hit
    for _, c, (_, archive, rejected) in files:
        if c is conn:
            return str(
                processing_dir(c.name, archive) if key == "processing" else archive if key == "archive" else rejected
            )
    return ""


def _tls_dirs(model: ConnectionsFile, base: Any, var: Any) -> list[tuple[str, str]]:
    """A file connection on (or moving files into) the directory of a configured TLS certificate,
    key or CA would stage the private key and move it away: refused."""
    root = Path(base) if base is not None else Path(".")
    tls = [(f"inbound[{i}].tls", c.tls) for i, c in enumerate(model.inbound) if c.tls is not None]
    if model.api.tls is not None:
        tls.append(("api.tls", model.api.tls))
    dirs: dict[Path, str] = {}
    for where, t in tls:
        for key in ("cert", "key", "ca"):
            value = getattr(t, key)
            if value:
                dirs.setdefault((root / value).resolve().parent, f"{where}.{key}")
    bad = []
    for i, conn in enumerate(model.inbound):
        if conn.kind != "file" or not conn.directory:
            continue
        for key, path in zip(
            ("directory", "archive", "error_directory"), (Path(p) for p in file_paths(conn, base, var)), strict=True
        ):
            if path in dirs:
                bad.append(
                    (
                        f"inbound[{i}].{key}",
                        f"{path} is the directory of the TLS file {dirs[path]}; a file "
                        "connection would stage and move the key and certificates: use "
                        "a directory of its own",
                    )
                )
    return bad
