"""Service configuration (`stageline.toml`): the `[store]` and `[cluster]` sections.

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


@dataclass(frozen=True)
class ServiceConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
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
    unknown = sorted(set(raw) - {"store", "cluster"})
    if unknown:
        raise ConfigError(f"unknown section(s): {', '.join(unknown)} (known: store, cluster)")
    store = _section(raw, "store", StoreConfig)
    if store.backend == "sqlite" and source is not None and not Path(store.path).is_absolute():
        store = replace(store, path=str((source.parent / store.path).resolve()))
    store = replace(store, password=env.get(PASSWORD_ENV))
    return validate(ServiceConfig(store=store, cluster=_section(raw, "cluster", ClusterConfig), source=source))


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
