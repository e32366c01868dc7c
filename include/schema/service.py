"""The models of `stageline.toml`: `[store]`, `[cluster]` and `[retention]` (with
`[retention.connections.<name>]` overrides).

The rules that keep a cluster safe are here as model rules, each keyed by the setting it is about:
a cluster needs a server store, `heartbeat < fence timeout < lease TTL`, a node timeout longer
than a heartbeat, `pool_size >= 2`, and busy retries that end before a sender's answer is due.
`include.config` builds its frozen dataclasses from these; docs/config-reference.md describes every key.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from include.schema import Strict
from include.schema.rules import Rules, refuses

__all__ = ["ANSWER_SECONDS", "ClusterModel", "RetentionModel", "RetentionOverride", "ServiceFile", "StoreModel"]

ANSWER_SECONDS = 60.0
"""Within this a sender gets its answer (listenerd's MLLP handler timeout, `listeners/mllp_listener.py`)."""

Seconds = Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)]
"""A period: above zero, at most a day (more is a typo: a lease or timeout nobody would wait out)."""
LoopSeconds = Annotated[float, Field(ge=0.05, le=3600, allow_inf_nan=False)]
"""The period of a loop that writes to the store: below 0.05 s it is a busy loop on the database."""
Days = Annotated[float, Field(gt=0, le=36_500, allow_inf_nan=False, description="days (fractions allowed)")]


class StoreModel(Strict):
    """`[store]`: the staged store (the password comes from $STAGELINE_STORE_PASSWORD, never the file)."""

    backend: Literal["sqlite", "postgres", "sqlserver"] = "sqlite"
    path: str = Field("var/stageline.db", min_length=1, description="sqlite: the file, relative to stageline.toml")
    server: str = Field("localhost", min_length=1)
    port: int | None = Field(None, ge=1, le=65535, description="default: the backend's (5432, 1433)")
    database: str = Field("stageline", min_length=1)
    schema_: str = Field("public", alias="schema", pattern=r"^[A-Za-z0-9_]+$")
    username: str = "stageline"
    pool_size: int = Field(
        5, ge=2, description="the heartbeat, the lease elector and the stage work each need a connection"
    )
    lease_ttl_seconds: Seconds = 15.0
    busy_timeout_ms: int = Field(10_000, gt=0)
    busy_retry_seconds: float = Field(40.0, ge=0, allow_inf_nan=False)
    read_timeout_seconds: float = Field(
        60.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="how long a read by a stageline command (messages find, stages, ...) may run before "
        "the store stops it; --timeout overrides it per command",
    )
    sync_standbys_expected: int = Field(
        0,
        ge=0,
        le=16,
        description="postgres: how many synchronous standbys the store should have streaming (1 on a "
        "replicated store under Patroni); fewer for two minutes raises StagelineStoreOnOneServer",
    )
    allow_unsafe_durability: bool = Field(
        False,
        description="start even on a server that may lose acknowledged "
        "commits (PostgreSQL fsync = off); never in production",
    )

    _no_password = refuses(
        "password",
        "unknown setting: the store password is read from $STAGELINE_STORE_PASSWORD, never from the file",
    )

    @model_validator(mode="after")
    def _standbys_need_postgres(self) -> StoreModel:
        if self.sync_standbys_expected > 0 and self.backend != "postgres":
            Rules.raise_if(
                [
                    (
                        "sync_standbys_expected",
                        f"sync_standbys_expected = {self.sync_standbys_expected} needs backend = "
                        f'"postgres" (a replicated PostgreSQL); {self.backend} has no standbys to count',
                    )
                ]
            )
        return self

    @model_validator(mode="after")
    def _answer_in_time(self) -> StoreModel:
        if self.busy_retry_seconds + self.busy_timeout_ms / 1000 >= ANSWER_SECONDS:
            Rules.raise_if(
                [
                    (
                        "busy_retry_seconds",
                        f"busy_retry_seconds + busy_timeout_ms / 1000 must be < "
                        f"{ANSWER_SECONDS:.0f} (got {self.busy_retry_seconds} and "
                        f"{self.busy_timeout_ms} ms): a sender's answer must go out "
                        "before the MLLP handler's timeout",
                    )
                ]
            )
        return self


class ClusterModel(Strict):
    """`[cluster]`: active-passive HA over one shared store."""

    enabled: bool = False
    cluster_name: str = Field("stageline", pattern=r"\S")
    node_id: str = Field("", description="default: host:pid:random, unique per process")
    heartbeat_seconds: LoopSeconds = 10.0
    node_timeout_seconds: Seconds = 30.0
    reclaim_interval_seconds: LoopSeconds = 30.0
    leader_lease_ttl_seconds: Seconds = 30.0
    leader_fence_timeout_seconds: Seconds = 20.0
    unbound_grace_seconds: Seconds | None = Field(
        None, description="a leader steps down when an inbound stays unbound this long; default 3 x heartbeat_seconds"
    )
    step_down_backoff_seconds: Seconds | None = Field(
        None, description="after a step-down, take no lease for this long; default 2 x leader_lease_ttl_seconds"
    )


class RetentionOverride(Strict):
    """`[retention.connections.<name>]`: one inbound connection's own stage days."""

    inbound_days: Days | None = None
    routed_days: Days | None = None
    outbound_days: Days | None = None


class RetentionModel(Strict):
    """`[retention]`: how long finished rows, events and the archive are kept, in days."""

    inbound_days: Days = 7.0
    routed_days: Days = 7.0
    outbound_days: Days = 7.0
    events_days: Days = 30.0
    archive_days: Days = 30.0
    archive_path: str = Field("", description="where the Parquet archive goes; empty: no Parquet job")
    connections: dict[str, RetentionOverride] = Field(default_factory=dict)

    @field_validator("connections")
    @classmethod
    def _names(cls, value: dict[str, RetentionOverride]) -> dict[str, RetentionOverride]:
        Rules.raise_if(
            [
                (name, "a connection name must be non-empty and contain no ','")
                for name in value
                if not name.strip() or "," in name
            ]
        )
        return value


class ServiceFile(Strict):
    """`stageline.toml`: the node's store, cluster and retention settings."""

    # (mypy cannot infer a model class as Field's factory: the overloads take one of no argument or
    # of the validated data, and a model's constructor takes both)
    store: StoreModel = Field(default_factory=StoreModel)  # type: ignore[arg-type]
    cluster: ClusterModel = Field(default_factory=ClusterModel)  # type: ignore[arg-type]
    retention: RetentionModel = Field(default_factory=RetentionModel)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _cluster_rules(self) -> ServiceFile:
        c, bad = self.cluster, []
        if c.enabled:
            if self.store.backend == "sqlite":
                bad.append(
                    (
                        "cluster.enabled",
                        '[cluster].enabled = true needs [store].backend = "postgres" or '
                        '"sqlserver": a SQLite file cannot be shared between nodes',
                    )
                )
            if not (c.heartbeat_seconds < c.leader_fence_timeout_seconds < c.leader_lease_ttl_seconds):
                bad.append(
                    (
                        "cluster.leader_fence_timeout_seconds",
                        "needs heartbeat_seconds < leader_fence_timeout_seconds < leader_lease_ttl_seconds (got "
                        f"{c.heartbeat_seconds} / {c.leader_fence_timeout_seconds} / "
                        f"{c.leader_lease_ttl_seconds}): a leader must fence itself before its lease can expire",
                    )
                )
            if c.node_timeout_seconds <= c.heartbeat_seconds:
                bad.append(
                    (
                        "cluster.node_timeout_seconds",
                        f"node_timeout_seconds ({c.node_timeout_seconds}) must be > heartbeat_seconds "
                        f"({c.heartbeat_seconds}): otherwise a live node looks dead between beats",
                    )
                )
        Rules.raise_if(bad)
        return self
