"""Service configuration (`stageline.toml`): the `[store]`, `[cluster]` and `[retention]` sections.

Every rule is checked at load so a misconfigured node refuses to start with an error that names the
setting and the rule, instead of misbehaving later (a cluster on SQLite, a fence timeout that lets
two leaders overlap, ...). The store password is never read from the file.
"""
from __future__ import annotations

import os
import secrets
import socket
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

PASSWORD_ENV = "STAGELINE_STORE_PASSWORD"
CONFIG_ENV = "STAGELINE_CONFIG"
DEFAULT_CONFIG = "stageline.toml"
VAR_ENV = "STAGELINE_VAR"
"""Where a node keeps its local state, logs and the demo's outputs (default `var/` in the checkout)."""
BACKENDS = ("sqlite", "postgres", "sqlserver")
DEFAULT_PORTS = {"postgres": 5432, "sqlserver": 1433}
ANSWER_SECONDS = 60.0
"""Within this a sender gets its answer (listenerd's MLLP handler timeout, `listeners/mllp.py`)."""


class ConfigError(ValueError):
    """A setting breaks a rule; the message names the setting and the rule."""


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
    allow_unsafe_durability: bool = False
    """Start even on a server that may lose acknowledged commits (PostgreSQL `fsync = off`, SQL
    Server `DELAYED_DURABILITY = FORCED`); never for production."""
    """How long after its oldest message arrived listenerd may still retry a group commit that met
    SQLite's write lock busy (`listeners.ingest`); 0: answer `AE` at the first busy timeout."""

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
        return {name: {stage: days * 86_400.0 for stage, days in per.items()}
                for name, per in self.connections.items()}


@dataclass(frozen=True)
class ServiceConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    source: Path | None = None


def var_dir() -> Path:
    return Path(os.environ.get(VAR_ENV) or Path(__file__).resolve().parents[1] / "var").resolve()


def derive_node_id() -> str:
    """`host:pid:hex`: unique per process, readable in `/cluster/nodes`."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _section(raw: dict[str, Any], name: str, cls: type) -> Any:
    data = raw.get(name, {})
    if not isinstance(data, dict):
        raise ConfigError(f"[{name}] must be a table")
    known = {f.name: f for f in fields(cls) if f.name != "password"}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"[{name}] unknown setting(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    defaults = cls()
    values: dict[str, Any] = {}
    for key, value in data.items():
        expected = type(getattr(defaults, key))
        if key == "port":
            expected = int
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"[{name}].{key} must be {expected.__name__}, got {type(value).__name__}")
        values[key] = value
    return cls(**values)


def _days(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number of days, got {type(value).__name__}")
    if value <= 0:
        raise ConfigError(f"{where} must be > 0 days, got {value}")
    return float(value)


def _retention(raw: dict[str, Any]) -> RetentionConfig:
    """`[retention]`: days per stage, events and archive, `archive_path`, and
    `[retention.connections.<name>]` tables of `<stage>_days` overrides."""
    data = raw.get("retention", {})
    if not isinstance(data, dict):
        raise ConfigError("[retention] must be a table")
    known = [f.name for f in fields(RetentionConfig)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"[retention] unknown setting(s): {', '.join(unknown)} (known: {', '.join(known)})")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "archive_path":
            if not isinstance(value, str):
                raise ConfigError(f"[retention].archive_path must be str, got {type(value).__name__}")
            values[key] = value.strip()
        elif key != "connections":
            values[key] = _days(f"[retention].{key}", value)
    connections = data.get("connections", {})
    if not isinstance(connections, dict):
        raise ConfigError("[retention].connections must be a table of [retention.connections.<name>] tables")
    stage_keys = [f"{stage}_days" for stage in RETENTION_STAGES]
    overrides: dict[str, dict[str, float]] = {}
    for name, per in connections.items():
        where = f"[retention.connections.{name}]"
        if not isinstance(per, dict):
            raise ConfigError(f"{where} must be a table")
        if not name.strip() or "," in name:
            raise ConfigError(f"{where}: a connection name must be non-empty and contain no ','")
        bad = sorted(set(per) - set(stage_keys))
        if bad:
            raise ConfigError(f"{where} unknown setting(s): {', '.join(bad)} (known: {', '.join(stage_keys)}; "
                              "audit events and the archive are kept alike for every connection)")
        overrides[name] = {key.removesuffix("_days"): _days(f"{where}.{key}", v) for key, v in per.items()}
    return RetentionConfig(**values, connections=overrides)


def validate(config: ServiceConfig) -> ServiceConfig:
    """Enforce the cross-setting rules; returns the config with `node_id` filled in."""
    store, cluster = config.store, config.cluster
    if store.backend not in BACKENDS:
        raise ConfigError(f"[store].backend must be one of {', '.join(BACKENDS)}, got {store.backend!r}")
    if store.pool_size < 2:
        raise ConfigError(f"[store].pool_size must be >= 2 (got {store.pool_size}): the heartbeat, "
                          "the lease elector and the stage work each need a connection")
    if store.lease_ttl_seconds <= 0:
        raise ConfigError("[store].lease_ttl_seconds must be > 0")
    if store.busy_timeout_ms <= 0:
        raise ConfigError("[store].busy_timeout_ms must be > 0")
    if not (0 <= store.busy_retry_seconds and store.busy_retry_seconds + store.busy_timeout_ms / 1000 < ANSWER_SECONDS):
        raise ConfigError(f"[store] needs 0 <= busy_retry_seconds and busy_retry_seconds + busy_timeout_ms / 1000 < "
                          f"{ANSWER_SECONDS:.0f} (got {store.busy_retry_seconds} and {store.busy_timeout_ms} ms): "
                          "a sender's answer must go out before the MLLP handler's timeout")
    if not store.schema.replace("_", "").isalnum():
        raise ConfigError(f"[store].schema must be a plain identifier, got {store.schema!r}")
    for key in ("heartbeat_seconds", "node_timeout_seconds", "reclaim_interval_seconds",
                "leader_lease_ttl_seconds", "leader_fence_timeout_seconds"):
        if getattr(cluster, key) <= 0:
            raise ConfigError(f"[cluster].{key} must be > 0")
    if cluster.enabled:
        if store.backend == "sqlite":
            raise ConfigError("[cluster].enabled = true needs [store].backend = \"postgres\" or \"sqlserver\": "
                              "a SQLite file cannot be shared between nodes")
        if not (cluster.heartbeat_seconds < cluster.leader_fence_timeout_seconds < cluster.leader_lease_ttl_seconds):
            raise ConfigError(
                "[cluster] needs heartbeat_seconds < leader_fence_timeout_seconds < leader_lease_ttl_seconds "
                f"(got {cluster.heartbeat_seconds} / {cluster.leader_fence_timeout_seconds} / "
                f"{cluster.leader_lease_ttl_seconds}): a leader must fence itself before its lease can expire")
        if cluster.node_timeout_seconds <= cluster.heartbeat_seconds:
            raise ConfigError(
                f"[cluster].node_timeout_seconds ({cluster.node_timeout_seconds}) must be > heartbeat_seconds "
                f"({cluster.heartbeat_seconds}): otherwise a live node looks dead between beats")
    if not cluster.cluster_name.strip():
        raise ConfigError("[cluster].cluster_name must not be empty")
    if not cluster.node_id:
        config = replace(config, cluster=replace(cluster, node_id=derive_node_id()))
    return config


def parse(raw: dict[str, Any], *, source: Path | None = None, env: dict[str, str] | None = None) -> ServiceConfig:
    """Build a validated config from already-parsed TOML data."""
    env = os.environ if env is None else env
    unknown = sorted(set(raw) - {"store", "cluster", "retention"})
    if unknown:
        raise ConfigError(f"unknown section(s): {', '.join(unknown)} (known: store, cluster, retention)")
    store = _section(raw, "store", StoreConfig)
    if store.backend == "sqlite" and source is not None and not Path(store.path).is_absolute():
        store = replace(store, path=str((source.parent / store.path).resolve()))
    store = replace(store, password=env.get(PASSWORD_ENV))
    return validate(ServiceConfig(store=store, cluster=_section(raw, "cluster", ClusterConfig),
                                  retention=_retention(raw), source=source))


def config_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The service config to use: `path`, else `$STAGELINE_CONFIG`, else `./stageline.toml`."""
    return Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def load(path: str | os.PathLike[str] | None = None) -> ServiceConfig:
    """Load `stageline.toml` (or `$STAGELINE_CONFIG`); no file means the embedded defaults."""
    path = config_path(path)
    if not path.exists():
        if path.name == DEFAULT_CONFIG and path.parent == Path("."):
            return parse({}, source=Path.cwd() / path)
        raise ConfigError(f"service config {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse(raw, source=path.resolve())
