"""Service configuration (`stageline.toml`): the `[store]`, `[cluster]` and `[retention]` sections.

Every rule is checked at load, by the typed models of `include.schema.service`, so a misconfigured
node refuses to start with every problem named by file and key, instead of misbehaving later (a
cluster on SQLite, a fence timeout that lets two leaders overlap, ...). The frozen dataclasses here
are what the rest of the code reads. The store password is never read from the file.
"""

from __future__ import annotations

import os
import secrets
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from include.schema import ConfigProblem, ConfigProblems
from include.schema.rules import validate as validate_model
from include.schema.service import ANSWER_SECONDS as ANSWER_SECONDS  # re-exported: listeners read it here
from include.schema.service import ServiceFile

PASSWORD_ENV = "STAGELINE_STORE_PASSWORD"  # noqa: S105  the variable's name, not a password
CONFIG_ENV = "STAGELINE_CONFIG"
DEFAULT_CONFIG = "stageline.toml"
VAR_ENV = "STAGELINE_VAR"
"""Where a node keeps its local state, logs and the demo's outputs (default `var/` in the checkout)."""
BACKENDS = ("sqlite", "postgres", "sqlserver")
DEFAULT_PORTS = {"postgres": 5432, "sqlserver": 1433}


class ConfigError(ConfigProblems):
    """`stageline.toml` breaks the schema: every problem, each naming the file and the key (a plain
    message is one problem without a key)."""

    def __init__(self, problems: str | list[ConfigProblem]) -> None:
        super().__init__([ConfigProblem(None, "", problems)] if isinstance(problems, str) else problems)


@dataclass(frozen=True)
class StoreConfig:
    backend: str = "sqlite"
    path: str = "var/stageline.db"
    server: str = "localhost"
    port: int | None = None
    database: str = "stageline"
    schema: str = "public"
    username: str = "stageline"
    password: str | None = field(default=None, repr=False)
    pool_size: int = 5
    lease_ttl_seconds: float = 15.0
    busy_timeout_ms: int = 10_000
    busy_retry_seconds: float = 40.0
    read_timeout_seconds: float = 60.0
    """How long a read by a `stageline` command may run before the store stops it (`Store.read_timeout`)."""
    sync_standbys_expected: int = 0
    """Synchronous standbys the store should have streaming (listenerd exports it beside the count
    it reads, for the alert StagelineStoreOnOneServer); 0: none expected."""
    allow_unsafe_durability: bool = False
    """Start even on a server that may lose acknowledged commits (PostgreSQL `fsync = off`, SQL
    Server `DELAYED_DURABILITY = FORCED`); never for production."""
    """How long after its oldest message arrived listenerd may still retry a group commit that met
    SQLite's write lock busy (`listeners.group_commit`); 0: answer `AE` at the first busy timeout."""

    @property
    def effective_port(self) -> int:
        return self.port or DEFAULT_PORTS.get(self.backend, 0)


@dataclass(frozen=True)
class ClusterConfig:
    enabled: bool = False
    cluster_name: str = "stageline"
    node_id: str = ""
    heartbeat_seconds: float = 10.0
    node_timeout_seconds: float = 30.0
    reclaim_interval_seconds: float = 30.0
    leader_lease_ttl_seconds: float = 30.0
    leader_fence_timeout_seconds: float = 20.0
    unbound_grace_seconds: float | None = None  # None: 3 x heartbeat_seconds
    step_down_backoff_seconds: float | None = None  # None: 2 x leader_lease_ttl_seconds

    def unbound_grace(self) -> float:
        """How long a leader may leave a configured inbound unbound before it steps down (a cluster)."""
        return self.unbound_grace_seconds if self.unbound_grace_seconds is not None else 3 * self.heartbeat_seconds

    def step_down_backoff(self) -> float:
        """How long a node that stepped down takes no lease, so that a node that can serve leads."""
        if self.step_down_backoff_seconds is not None:
            return self.step_down_backoff_seconds
        return 2 * self.leader_lease_ttl_seconds


RETENTION_STAGES = ("inbound", "routed", "outbound")


@dataclass(frozen=True)
class RetentionConfig:
    """How long `maintenance_retention` keeps things, in days (fractions allowed).

    A finished row stays in its hot table for its stage's days, then moves to the `archive_*` tables;
    an audit event likewise after `events_days`. An archived row stays there `archive_days` more,
    then the Parquet job moves it under `archive_path` (empty: no Parquet job, the archive tables
    keep everything). `connections` overrides the stage days per inbound connection.
    """

    inbound_days: float = 7.0
    routed_days: float = 7.0
    outbound_days: float = 7.0
    events_days: float = 30.0
    archive_days: float = 30.0
    archive_path: str = ""
    connections: dict[str, dict[str, float]] = field(default_factory=dict)

    def ages_seconds(self) -> dict[str, float]:
        """Per retention key of `include.housekeeping.retention`, the age in seconds."""
        return {key: getattr(self, f"{key}_days") * 86_400.0 for key in (*RETENTION_STAGES, "events")}

    def connection_ages_seconds(self) -> dict[str, dict[str, float]]:
        """Per overridden connection, its own stage ages in seconds."""
        return {name: {stage: days * 86_400.0 for stage, days in per.items()} for name, per in self.connections.items()}


@dataclass(frozen=True)
class ServiceConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    source: Path | None = None


def var_dir() -> Path:
    return Path(os.environ.get(VAR_ENV) or Path(__file__).resolve().parents[1] / "var").resolve()


def private_var_dir() -> Path:
    """`var_dir()`, created 0700 if missing: it holds the SQLite store (PHI), the API token and the
    file drops' archives, none of them for other users. An existing one of ours that group or
    others may enter is tightened to 0700 with a warning naming its old mode (one owned by another
    uid is only warned about)."""
    import logging
    import stat

    var = var_dir()
    var.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = var.stat()
    old = stat.S_IMODE(st.st_mode)
    if old & 0o077 and not var.is_symlink():
        log = logging.getLogger(__name__)
        if st.st_uid == os.geteuid():
            os.chmod(var, 0o700)
            log.warning("var dir %s was mode %04o, open to others: tightened to 0700", var, old)
        else:
            log.warning(
                "var dir %s is mode %04o and owned by uid %d, not ours: left as is; chmod 700 it", var, old, st.st_uid
            )
    return var


def derive_node_id() -> str:
    """`host:pid:hex`: unique per process, readable in `/cluster/nodes`."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def parse(raw: Any, *, source: Path | None = None, env: Mapping[str, str] | None = None) -> ServiceConfig:
    """Build a validated config from already-parsed TOML data (`include.schema.service`); a bad one
    raises `ConfigError` listing every problem with its key (and `source` as the file)."""
    env = os.environ if env is None else env
    try:
        model = validate_model(ServiceFile, raw, file=source)
    except ConfigProblems as exc:
        raise ConfigError(exc.problems) from None
    s, c, r = model.store, model.cluster, model.retention
    store = StoreConfig(**{**s.model_dump(by_alias=True), "password": env.get(PASSWORD_ENV)})
    if store.backend == "sqlite" and source is not None and not Path(store.path).is_absolute():
        store = replace(store, path=str((source.parent / store.path).resolve()))
    cluster = ClusterConfig(**c.model_dump())
    if not cluster.node_id:
        cluster = replace(cluster, node_id=derive_node_id())
    retention = RetentionConfig(
        **{
            **r.model_dump(exclude={"connections"}),
            "archive_path": r.archive_path.strip(),
            "connections": {
                name: {k.removesuffix("_days"): v for k, v in per.model_dump(exclude_none=True).items()}
                for name, per in r.connections.items()
            },
        }
    )
    return ServiceConfig(store=store, cluster=cluster, retention=retention, source=source)


def config_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The service config to use: `path`, else `$STAGELINE_CONFIG`, else `./stageline.toml`."""
    return Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def load(path: str | os.PathLike[str] | None = None) -> ServiceConfig:
    """Load `stageline.toml` (or `$STAGELINE_CONFIG`); no file means the embedded defaults."""
    path = config_path(path)
    if not path.exists():
        if path.name == DEFAULT_CONFIG and path.parent == Path("."):
            return parse({}, source=Path.cwd() / path)
        raise ConfigError([ConfigProblem(path, "", "service config does not exist")])
    if path.is_dir():
        raise ConfigError([ConfigProblem(path, "", f"is a directory: name the {DEFAULT_CONFIG} file in it")])
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError([ConfigProblem(path, "", f"not valid TOML: {exc}")]) from None
    return parse(raw, source=path.resolve())
