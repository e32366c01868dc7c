"""The config dir's inbound connections (`<config>/connections.toml`): what `listenerd` binds.

Each `[[inbound]]` table is one connection. Every node must run the same config dir; its hash is
published in `nodes.config_hash` so a node that differs from the leader is reported loudly.
See docs/listenerd.md for the format with a complete example.
"""
from __future__ import annotations

import hashlib
import ipaddress
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from include.hl7path import FieldPathError, parse_path

KINDS = ("mllp", "tcp", "file", "http", "database")
TCP_FRAMINGS = ("newline", "length")
BATCH_ACKS = ("batch", "messages")
SOURCE_BACKENDS = ("postgres", "sqlserver", "sqlite")
SOURCE_STRATEGIES = ("watermark", "mark")
_SQL_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")  # as include.store.queries finds them


class ConnectionConfigError(ValueError):
    """The config dir is wrong; the message names the connection and the setting."""


@dataclass(frozen=True)
class TLSConfig:
    cert: str = ""
    key: str = ""
    ca: str = ""                     # client CAs; with require_client_cert this is mTLS
    require_client_cert: bool = False


@dataclass(frozen=True)
class DatabaseSource:
    """A `kind = "database"` connection's source (`[inbound.database]`, listeners/dbpoll.py)."""

    backend: str = "postgres"        # postgres | sqlserver | sqlite
    server: str = "localhost"
    port: int = 0                    # 0: the backend's default
    database: str = ""               # the database name; sqlite: the file
    username: str = ""
    password_env: str = ""           # the environment variable holding the password (never the file)
    query: str = ""                  # SELECT of the rows to stage, ordered by key_column
    key_column: str = "id"           # unique per source row; gives the message id (and the watermark)
    message_column: str = ""         # the column holding the message; empty = the whole row as JSON
    strategy: str = "watermark"      # watermark (a high-water mark in the store) | mark (an UPDATE)
    mark: str = ""                   # mark: the statement that marks one row read (`:key`)
    reject: str = ""                 # mark: for a row that cannot be staged (default: mark)
    start_after: int | str = 0       # watermark: the mark before the first poll
    batch_size: int = 100            # at most this many rows a poll (`:limit`)
    connect_timeout_seconds: float = 10.0


@dataclass(frozen=True)
class InboundConfig:
    name: str
    kind: str
    host: str = "127.0.0.1"
    port: int = 0
    directory: str = ""              # file: polled directory
    archive: str = ""                # file: where ingested files go (default <directory>/archive)
    error_directory: str = ""        # file: where refused files go, with a .reason (default <archive>/rejected)
    pattern: str = "*"               # file: glob of files to ingest
    poll_seconds: float = 1.0        # file
    framing: str = "newline"         # tcp: newline | length (4-byte big-endian length prefix)
    lane_key: str = ""               # HL7 path (e.g. "PID-3.1") giving the row's lane; empty = none
    hl7_only: bool = False           # tcp/http/file: refuse what is not HL7 v2 (MLLP always does)
    batch_ack: str = "batch"         # mllp: a batch gets one ACK ("batch") or an ACK batch ("messages")
    charset: str = "utf-8"           # used when a message does not declare MSH-18
    max_message_bytes: int = 4 * 1024 * 1024
    idle_timeout_seconds: float = 300.0
    max_connections: int = 64
    max_connections_per_peer: int = 16  # per peer address (listeners/guard.py)
    connect_rate_per_peer: float = 20.0  # new connections a second per peer address, bursts of twice that
    frame_timeout_seconds: float = 10.0  # a started message must be complete within this
    handshake_timeout_seconds: float = 10.0  # a TLS handshake must be complete within this
    max_bytes_per_second_per_peer: float = 8 * 1024 * 1024  # beyond it a peer is read more slowly
    allow_insecure_bind: bool = False
    allowed_sources: tuple[str, ...] = ()  # CIDRs a sender may connect from (empty: any); see guard.py
    allow_unauthenticated_senders: bool = False  # a non-loopback bind without mTLS or allowed_sources
    allow_archive_in_directory: bool = False  # file: archive/error_directory may lie inside the drop tree
    tls: TLSConfig | None = None
    database: DatabaseSource | None = None  # database: the source table polled (listeners/dbpoll.py)


@dataclass(frozen=True)
class ListenerConfig:
    inbound: tuple[InboundConfig, ...] = ()
    config_hash: str = ""
    directory: Path | None = None
    api: dict[str, Any] = field(default_factory=dict)  # the [api] table, read by the control plane


def _inbound(raw: dict[str, Any], index: int, base: Path) -> InboundConfig:
    name = raw.get("name")
    where = f"[[inbound]] #{index + 1}" + (f" ({name!r})" if name else "")
    if not isinstance(name, str) or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ConnectionConfigError(f"{where}: name must be a non-empty identifier (letters, digits, - and _)")
    known = {f.name: f for f in fields(InboundConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConnectionConfigError(f"{where}: unknown setting(s): {', '.join(unknown)}")
    values = dict(raw)
    if "tls" in values:
        tls = values["tls"]
        if not isinstance(tls, dict) or set(tls) - {f.name for f in fields(TLSConfig)}:
            raise ConnectionConfigError(f"{where}: tls must be a table with cert, key, ca, require_client_cert")
        tls = {k: (str((base / v).resolve()) if k in ("cert", "key", "ca") and v else v) for k, v in tls.items()}
        values["tls"] = TLSConfig(**tls)
    if "database" in values:
        values["database"] = _database_source(values["database"], where, base)
    for key in ("directory", "archive", "error_directory"):
        if values.get(key):
            values[key] = str((base / values[key]).resolve())
    for key in ("poll_seconds", "idle_timeout_seconds", "connect_rate_per_peer", "frame_timeout_seconds",
                "handshake_timeout_seconds", "max_bytes_per_second_per_peer"):
        if isinstance(values.get(key), int):
            values[key] = float(values[key])
    try:
        conn = InboundConfig(**values)
    except TypeError as exc:
        raise ConnectionConfigError(f"{where}: {exc}") from exc
    if conn.kind not in KINDS:
        raise ConnectionConfigError(f"{where}: kind must be one of {', '.join(KINDS)}, got {conn.kind!r}")
    if conn.kind in ("mllp", "tcp", "http") and not (0 <= conn.port <= 65535):
        raise ConnectionConfigError(f"{where}: port must be 0..65535")
    if conn.kind == "tcp" and conn.framing not in TCP_FRAMINGS:
        raise ConnectionConfigError(f"{where}: framing must be newline or length, got {conn.framing!r}")
    if conn.kind == "file" and not conn.directory:
        raise ConnectionConfigError(f"{where}: a file connection needs directory")
    if conn.kind == "database" and conn.database is None:
        raise ConnectionConfigError(f"{where}: a database connection needs an [inbound.database] table "
                                    "(backend, database, query, key_column, strategy)")
    if conn.database is not None and conn.kind != "database":
        raise ConnectionConfigError(f"{where}: [inbound.database] belongs to kind = \"database\" only")
    if conn.kind == "database" and conn.poll_seconds <= 0:
        raise ConnectionConfigError(f"{where}: poll_seconds must be > 0")
    if conn.kind == "file" and not conn.archive:
        conn = InboundConfig(**{**conn.__dict__, "archive": str(Path(conn.directory) / "archive")})
    if conn.kind == "file" and not conn.error_directory:
        conn = InboundConfig(**{**conn.__dict__, "error_directory": str(Path(conn.archive) / "rejected")})
    if conn.kind == "file" and Path(conn.error_directory).resolve() == Path(conn.directory).resolve():
        raise ConnectionConfigError(f"{where}: error_directory must differ from directory")
    if conn.batch_ack not in BATCH_ACKS:
        raise ConnectionConfigError(f"{where}: batch_ack must be batch or messages, got {conn.batch_ack!r}")
    if not isinstance(conn.hl7_only, bool):
        raise ConnectionConfigError(f"{where}: hl7_only must be true or false")
    if conn.lane_key:
        try:
            parse_path(conn.lane_key)
        except FieldPathError as exc:  # refused here, like a destination's lane, not as NULL lanes later
            raise ConnectionConfigError(f"{where}: lane_key must be an HL7 field path such as 'PID-3.1': "
                                        f"{exc}") from None
    if conn.max_message_bytes < 64:
        raise ConnectionConfigError(f"{where}: max_message_bytes must be >= 64")
    for key in ("max_connections", "max_connections_per_peer", "connect_rate_per_peer", "frame_timeout_seconds",
                "handshake_timeout_seconds", "max_bytes_per_second_per_peer"):
        value = getattr(conn, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConnectionConfigError(f"{where}: {key} must be a number > 0, got {value!r}")
    if conn.tls and conn.tls.require_client_cert and not conn.tls.ca:
        raise ConnectionConfigError(f"{where}: tls.require_client_cert needs tls.ca (the client CA bundle)")
    if conn.tls and not (conn.tls.cert and conn.tls.key):
        raise ConnectionConfigError(f"{where}: tls needs cert and key")
    check_bind(conn.host, tls=conn.tls is not None, allow_insecure=conn.allow_insecure_bind,
               what=f"{where} ({conn.kind} on {conn.host}:{conn.port})",
               network=conn.kind not in ("file", "database"))
    return conn


def _database_source(raw: Any, where: str, base: Path) -> DatabaseSource:
    """`[inbound.database]`, checked: every rule a poll would otherwise break on at run time."""
    where = f"{where} [inbound.database]"
    if not isinstance(raw, dict):
        raise ConnectionConfigError(f"{where}: must be a table")
    known = {f.name for f in fields(DatabaseSource)}
    unknown = sorted(set(raw) - known)
    if unknown:
        hint = " (put the password in an environment variable and name it in password_env)" \
            if "password" in unknown else ""
        raise ConnectionConfigError(f"{where}: unknown setting(s): {', '.join(unknown)}{hint}")
    values = dict(raw)
    if isinstance(values.get("connect_timeout_seconds"), int):
        values["connect_timeout_seconds"] = float(values["connect_timeout_seconds"])
    defaults = DatabaseSource()
    for key, value in values.items():
        expected = (int, str) if key == "start_after" else type(getattr(defaults, key))
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise ConnectionConfigError(f"{where}: {key} has the wrong type ({type(value).__name__})")
    src = DatabaseSource(**values)
    if src.backend not in SOURCE_BACKENDS:
        raise ConnectionConfigError(f"{where}: backend must be one of {', '.join(SOURCE_BACKENDS)}, "
                                    f"got {src.backend!r}")
    if not src.database:
        raise ConnectionConfigError(f"{where}: database is required (the database name; sqlite: the file)")
    if src.backend == "sqlite":
        src = DatabaseSource(**{**src.__dict__, "database": str((base / src.database).resolve())})
    if not (0 <= src.port <= 65535):
        raise ConnectionConfigError(f"{where}: port must be 0..65535")
    if src.strategy not in SOURCE_STRATEGIES:
        raise ConnectionConfigError(f"{where}: strategy must be watermark or mark, got {src.strategy!r}")
    for key in ("key_column", "message_column"):
        value = getattr(src, key)
        if (value or key == "key_column") and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ConnectionConfigError(f"{where}: {key} must be a column name (letters, digits, _), got {value!r}")
    if not re.match(r"\s*(SELECT|WITH)\b", src.query, re.IGNORECASE):
        raise ConnectionConfigError(f"{where}: query must be a SELECT (or WITH ... SELECT) of the rows to stage")
    allowed = {"watermark", "limit"} if src.strategy == "watermark" else {"limit"}
    params = set(_SQL_PARAM.findall(src.query))
    if params - allowed:
        raise ConnectionConfigError(f"{where}: query takes only {', '.join(':' + p for p in sorted(allowed))}, "
                                    f"got {', '.join(':' + p for p in sorted(params - allowed))}")
    if src.strategy == "watermark":
        if "watermark" not in params:
            raise ConnectionConfigError(
                f"{where}: strategy = \"watermark\" needs :watermark in query, e.g. "
                f"\"SELECT ... WHERE {src.key_column} > :watermark ORDER BY {src.key_column} LIMIT :limit\"")
        if src.mark or src.reject:
            raise ConnectionConfigError(f"{where}: mark and reject belong to strategy = \"mark\"")
    else:
        for key in ("mark", "reject"):
            statement = getattr(src, key)
            if key == "reject" and not statement:
                continue
            if not re.match(r"\s*UPDATE\b", statement, re.IGNORECASE) or set(_SQL_PARAM.findall(statement)) != {"key"}:
                raise ConnectionConfigError(
                    f"{where}: strategy = \"mark\" needs {key} = an UPDATE that takes only :key, e.g. "
                    f"\"UPDATE outbox SET status = 'sent' WHERE {src.key_column} = :key\"")
    if src.batch_size < 1:
        raise ConnectionConfigError(f"{where}: batch_size must be >= 1")
    if src.connect_timeout_seconds <= 0:
        raise ConnectionConfigError(f"{where}: connect_timeout_seconds must be > 0")
    if src.password_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", src.password_env):
        raise ConnectionConfigError(f"{where}: password_env must name an environment variable")
    return src


def check_bind(host: str, *, tls: bool, allow_insecure: bool, what: str, network: bool = True) -> None:
    """Transport security fails closed: a non-loopback bind needs TLS unless explicitly allowed."""
    if not network or tls or allow_insecure:
        return
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback:
        raise ConnectionConfigError(
            f"{what}: refusing a non-loopback bind without TLS; configure tls, or set "
            "allow_insecure_bind = true if the network is otherwise protected")


def load_config_dir(directory: str | Path) -> ListenerConfig:
    """Read `<directory>/connections.toml`; a missing file means no inbound connections."""
    directory = Path(directory).resolve()
    path = directory / "connections.toml"
    text = path.read_bytes() if path.exists() else b""
    try:
        raw = tomllib.loads(text.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConnectionConfigError(f"{path}: not valid TOML: {exc}") from exc
    unknown = sorted(set(raw) - {"inbound", "api"})
    if unknown:
        raise ConnectionConfigError(f"{path}: unknown section(s): {', '.join(unknown)} (known: inbound, api)")
    inbound = tuple(_inbound(c, i, directory) for i, c in enumerate(raw.get("inbound", [])))
    names = [c.name for c in inbound]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConnectionConfigError(f"{path}: duplicate connection name(s): {', '.join(dupes)}")
    digest = hashlib.sha256(text).hexdigest()[:16]
    return ListenerConfig(inbound=inbound, config_hash=digest, directory=directory, api=raw.get("api", {}))
