"""The config dir's inbound connections (`<config>/connections.toml`): what `listenerd` binds.

Each `[[inbound]]` table is one connection. Every node must run the same config dir; its hash is
published in `nodes.config_hash` so a node that differs from the leader is reported loudly.
The file is checked by the typed models of `include.schema.connections` (every problem at once,
with file and dotted key); the frozen dataclasses here, built from them, are what the listeners
read. See docs/listenerd.md for the format with a complete example.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from include.schema import ConfigProblem, ConfigProblems
from include.schema.connections import DEFAULT_MAX_FHIR_ELEMENTS, ConnectionsFile, InboundModel, file_paths
from include.schema.reading import read_config_bytes
from include.schema.rules import validate
from listeners.profile_check import Conformance, profile_paths, read_conformance

TCP_FRAMINGS = ("newline", "length")


class ConnectionConfigError(ConfigProblems):
    """`connections.toml` is wrong: every problem, each naming the file and the key (a plain
    message is one problem without a key)."""

    def __init__(self, problems: str | list[ConfigProblem]) -> None:
        super().__init__([ConfigProblem(None, "", problems)] if isinstance(problems, str) else problems)


@dataclass(frozen=True)
class TLSConfig:
    cert: str = ""
    key: str = ""
    ca: str = ""  # client CAs; with require_client_cert this is mTLS
    require_client_cert: bool = False


@dataclass(frozen=True)
class DatabaseSource:
    """A `kind = "database"` connection's source (`[inbound.database]`, listeners/dbpoll.py)."""

    backend: str = "postgres"  # postgres | sqlserver | sqlite
    server: str = "localhost"
    port: int = 0  # 0: the backend's default
    database: str = ""  # the database name; sqlite: the file
    username: str = ""
    password_env: str = ""  # the environment variable holding the password (never the file)
    query: str = ""  # SELECT of the rows to stage, ordered by key_column
    key_column: str = "id"  # unique per source row; gives the message id (and the watermark)
    message_column: str = ""  # the column holding the message; empty = the whole row as JSON
    strategy: str = "watermark"  # watermark (a high-water mark in the store) | mark (an UPDATE)
    mark: str = ""  # mark: the statement that marks one row read (`:key`)
    reject: str = ""  # mark: for a row that cannot be staged (default: mark)
    start_after: int | str = 0  # watermark: the mark before the first poll
    batch_size: int = 100  # at most this many rows a poll (`:limit`)
    connect_timeout_seconds: float = 10.0


@dataclass(frozen=True)
class InboundConfig:
    name: str
    kind: str
    host: str = "127.0.0.1"
    port: int = 0
    directory: str = ""  # file: polled directory
    archive: str = ""  # file: where ingested files go (default <var>/filedrop/<name>/archive)
    error_directory: str = ""  # file: where refused files go, with a .reason (default <var>/filedrop/<name>/rejected)
    pattern: str = "*"  # file: glob of files to ingest
    poll_seconds: float = 1.0  # file
    framing: str = "newline"  # tcp: newline | length (4-byte big-endian length prefix)
    lane_key: str = ""  # HL7 path (e.g. "PID-3.1") giving the row's lane; empty = none
    hl7_only: bool = False  # tcp/http/file: refuse what is not HL7 v2 (MLLP always does)
    accept: tuple[str, ...] = ("hl7v2",)  # http: "hl7v2" and/or "fhir" (FHIR R4 JSON, listeners/fhir_inbound.py)
    batch_ack: str = "batch"  # mllp: a batch gets one ACK ("batch") or an ACK batch ("messages")
    charset: str = "utf-8"  # used when a message does not declare MSH-18
    max_message_bytes: int = 4 * 1024 * 1024
    max_fhir_elements: int = DEFAULT_MAX_FHIR_ELEMENTS  # http: JSON values a FHIR body may hold
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
    profile: tuple[str, ...] = ()  # conformance profile files (absolute), docs/profiles.md
    on_violation: str = "reject"  # reject | flag | off
    # The profiles read, as the listeners apply them (listeners/profile_check.py); None: no check.
    conformance: Conformance | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ListenerConfig:
    inbound: tuple[InboundConfig, ...] = ()
    config_hash: str = ""
    directory: Path | None = None
    api: dict[str, Any] = field(default_factory=dict)  # the [api] table, read by the control plane


def inbound_from(model: InboundModel, base: Path, var: Path | None = None) -> InboundConfig:
    """The runtime connection of a validated `[[inbound]]` table (paths made absolute)."""
    values: dict[str, Any] = model.model_dump(exclude={"tls", "database", "allowed_sources", "profile"})
    values["allowed_sources"] = tuple(model.allowed_sources)
    values["accept"] = tuple(dict.fromkeys(model.accept))
    values["profile"] = profile_paths(model.profile, base)
    if model.tls is not None:
        tls: dict[str, Any] = {
            k: (str((base / v).resolve()) if k != "require_client_cert" and v else v)
            for k, v in model.tls.model_dump().items()
        }
        values["tls"] = TLSConfig(**tls)
    if model.database is not None:
        src = model.database.model_dump()
        if src["backend"] == "sqlite":
            src["database"] = str((base / src["database"]).resolve())
        values["database"] = DatabaseSource(**src)
    if model.kind == "file":
        values["directory"], values["archive"], values["error_directory"] = file_paths(model, base, var)
    return InboundConfig(**values)


def _names_twice(raw: Any) -> list[ConfigProblem]:
    """Duplicate connection names, read from the raw tables (so they are reported beside any other
    problem of the file, not only once every table is valid)."""
    entries = raw.get("inbound") if isinstance(raw, dict) else None
    seen: set[str] = set()
    out = []
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(name, str):
            if name in seen:
                out.append(ConfigProblem(None, f"inbound[{i}].name", f"duplicate connection name {name!r}"))
            seen.add(name)
    return out


def _with_names(problems: list[ConfigProblem], raw: Any) -> list[ConfigProblem]:
    """Each `inbound[i]...` problem also names its connection, which is what a reader looks for."""
    entries = raw.get("inbound") if isinstance(raw, dict) else None
    entries = entries if isinstance(entries, list) else []
    out = []
    for p in problems:
        m = re.match(r"inbound\[(\d+)\]", p.key)
        name = (
            entries[int(m.group(1))].get("name")
            if m and int(m.group(1)) < len(entries) and isinstance(entries[int(m.group(1))], dict)
            else None
        )
        out.append(p._replace(message=f"{p.message} (connection {name!r})") if isinstance(name, str) else p)
    return out


def parse_connections(
    raw: Any,
    directory: Path,
    *,
    file: Path | None = None,
    roles: Any = None,
    var: Path | None = None,
    store_dir: Path | None = None,
) -> tuple[ConnectionsFile, tuple[InboundConfig, ...]]:
    """Validate parsed `connections.toml` data; every problem at once as `ConnectionConfigError`.
    `store_dir` (the SQLite store's directory, when known) is kept out of every file connection."""
    from include.config import var_dir

    var = var_dir() if var is None else var
    context = {
        "base": directory,
        "var": var,
        **({"roles": roles} if roles else {}),
        **({"store_dir": store_dir} if store_dir is not None else {}),
    }
    try:
        model = validate(ConnectionsFile, raw, file=file, context=context)
    except ConfigProblems as exc:
        problems = exc.problems + [
            p._replace(file=file) for p in _names_twice(raw) if p.key not in {q.key for q in exc.problems}
        ]
        raise ConnectionConfigError(_with_names(problems, raw)) from None
    twice = [p._replace(file=file) for p in _names_twice(raw)]
    if twice:
        raise ConnectionConfigError(_with_names(twice, raw))
    inbound, problems = [], []
    for i, conn in enumerate(inbound_from(c, directory, var) for c in model.inbound):
        try:
            inbound.append(replace(conn, conformance=read_conformance(conn.profile, conn.on_violation, directory)))
        except ValueError as exc:
            problems.append(ConfigProblem(file, f"inbound[{i}].profile", str(exc)))
    if problems:
        raise ConnectionConfigError(_with_names(problems, raw))
    return model, tuple(inbound)


def load_config_dir(
    directory: str | Path, *, store_dir: str | Path | None = None, required: bool = False
) -> ListenerConfig:
    """Read and validate `<directory>/connections.toml` (a missing file: no inbound connections,
    unless `required`, as on a reload: then it is a problem); `ConnectionConfigError` lists every
    problem with file and key. The file is read only if it is a regular file of at most 1 MiB
    (`include.schema.reading`). listenerd's start and its SIGHUP reload both come through here."""
    directory = Path(directory).resolve()
    path = directory / "connections.toml"
    try:
        text = read_config_bytes(path)
    except FileNotFoundError:
        if required:
            raise ConnectionConfigError(
                [
                    ConfigProblem(
                        path,
                        "",
                        "missing: a reload needs connections.toml (an empty file means no inbound connections)",
                    )
                ]
            ) from None
        text = b""
    except ConfigProblems as exc:
        raise ConnectionConfigError(exc.problems) from None
    try:
        raw = tomllib.loads(text.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConnectionConfigError([ConfigProblem(path, "", f"not valid TOML: {exc}")]) from None
    _, inbound = parse_connections(
        raw, directory, file=path, store_dir=Path(store_dir) if store_dir is not None else None
    )
    # A profile's files are config too: editing one changes the hash (and a reload rebinds).
    profiles = "".join(c.conformance.digest for c in inbound if c.conformance is not None)
    digest = hashlib.sha256(text + profiles.encode()).hexdigest()[:16]
    return ListenerConfig(inbound=inbound, config_hash=digest, directory=directory, api=raw.get("api", {}))
