"""The node's place in the cluster, as services that run on every node, leader or not: the store,
the lease and the membership heartbeat.

    StoreService      opened and checked (this cluster's, migrated) at start; closed last
    LeaseService      the elector (single node: a permanent lease taken at start); stopping it
                      releases the lease at once and marks the node `left`
    HeartbeatService  every heartbeat_seconds, off the reactor thread: elector step → membership
                      upsert → shared config version and the leader's config hash;
                      on "elected": on-promotion recovery (once per epoch)

The lease state machine itself is `include.store.lease.LeaderElector` (invariant 2,
docs/invariants.md); these services only give it a lifetime and a clock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from twisted.application.internet import TimerService
from twisted.application.service import Service
from twisted.internet import defer, threads
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.config import ClusterConfig, StoreConfig
from include.store import Store, rowlease
from include.store.lease import ElectionResult, LeaderElector, Outcome, acquire_permanent
from include.store.membership import NodeIdentity, heartbeat, leave, live_peers
from include.store.migrate import check_identity
from listeners.metrics import Metrics

__all__ = ["Beat", "HeartbeatService", "LeaseService", "PermanentLease", "StoreService"]

_log = Logger(namespace="stageline.node")


class StoreService(Service):
    """The shared store for the node's lifetime; `store` is None until started."""

    def __init__(self, config: StoreConfig, *, cluster_name: str) -> None:
        self.setName("store")
        self._config = config
        self._cluster_name = cluster_name
        self.store: Store | None = None
        self.identity: dict[str, Any] = {}

    def startService(self) -> None:
        """Blocking, once, before anything else runs: a node that cannot reach its store does not start."""
        self.store = Store(self._config)
        self.identity = check_identity(self.store, cluster_name=self._cluster_name)
        self.store.check_durability()  # fsync off / delayed durability forced: refused (docs/store.md)
        super().startService()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        store, self.store = self.store, None
        return threads.deferToThread(store.close) if store is not None else defer.succeed(None)


class PermanentLease:
    """Single-node leadership: taken once at start (bumping the epoch), never lost."""

    fenced = False
    aside_seconds = 0.0

    def __init__(self, store: Store, node_id: str) -> None:
        self.epoch: int | None = acquire_permanent(store, node_id=node_id)
        self.is_leader = True

    def step(self) -> None:
        return None

    def release(self) -> bool:
        return False


class LeaseService(Service):
    """Who leads: the self-fencing elector in a cluster, a permanent lease on a single node."""

    def __init__(self, stores: StoreService, node: NodeIdentity, cluster: ClusterConfig) -> None:
        self.setName("lease")
        self._stores = stores
        self._node = node
        self._cluster = cluster
        self.elector: LeaderElector | PermanentLease | None = None
        self._stepping = threading.Lock()  # one elector call at a time: a step or a step-down

    @property
    def fenced(self) -> bool:
        """Still holds an epoch it stopped acting on (its fence tripped; cleared at the next step)."""
        return bool(self.elector is not None and self.elector.fenced)

    @property
    def aside_seconds(self) -> float:
        """Seconds left of a step-down's backoff (0: none, or a single node)."""
        return self.elector.aside_seconds if self.elector is not None else 0.0

    @property
    def is_leader(self) -> bool:
        """The elector's self-fencing view: false once renewals stopped for the fence timeout."""
        return bool(self.elector is not None and self.elector.is_leader)

    @property
    def epoch(self) -> int | None:
        return self.elector.epoch if self.elector is not None else None

    def startService(self) -> None:
        store = self._stores.store
        assert store is not None, "the store service starts first"
        if self._cluster.enabled:
            self.elector = LeaderElector(
                store,
                node_id=self._node.node_id,
                ttl_seconds=self._cluster.leader_lease_ttl_seconds,
                fence_timeout_seconds=self._cluster.leader_fence_timeout_seconds,
            )
        else:
            self.elector = PermanentLease(store, self._node.node_id)
        super().startService()

    def step(self) -> ElectionResult | None:
        """One election step (blocking: run it off the reactor thread). A node standing aside after a
        step-down ends its backoff early once no other node is live: nobody else would take the lease."""
        assert self.elector is not None
        with self._stepping:
            elector = self.elector
            if isinstance(elector, LeaderElector) and elector.aside_seconds > 0 and not self._live_peers():
                _log.warn(
                    "no other live node: ending the step-down backoff early ({s:.1f}s left)", s=elector.aside_seconds
                )
                elector.end_stand_aside()
            return elector.step()

    def live_peers(self) -> Deferred[dict[str, frozenset[str]]]:
        """The other active nodes whose heartbeat is within `node_timeout_seconds`, each with the
        inbound names it could not bind when it last led (off the reactor)."""
        return threads.deferToThread(self._live_peers)

    def _live_peers(self) -> dict[str, frozenset[str]]:
        store = self._stores.store
        if store is None:
            return {}
        return live_peers(store, self._node.node_id, node_timeout_seconds=self._cluster.node_timeout_seconds)

    def step_down(self, backoff_seconds: float) -> Deferred[bool]:
        """Release the lease now (the epoch moves on with the next leader) and take none for
        `backoff_seconds`; fires True if the release was written (else the lease ages out).
        A single node's permanent lease is never released."""
        elector = self.elector

        def work() -> bool:
            if not isinstance(elector, LeaderElector):
                return False
            with self._stepping:
                return elector.stand_aside(backoff_seconds)

        return threads.deferToThread(work)

    def stopService(self) -> Deferred[None]:
        """Leave last: release the lease at once (the standby takes over on its next heartbeat,
        whatever the TTL) and mark this node `left`."""
        super().stopService()
        return threads.deferToThread(self._leave_blocking)

    def _leave_blocking(self) -> None:
        store = self._stores.store
        if store is None or self.elector is None:
            return
        try:
            with self._stepping:
                self.elector.release()
            leave(store, self._node.node_id)
        except Exception as exc:
            _log.warn("clean leave failed ({err}); the lease will age out", err=type(exc).__name__)


@dataclass(frozen=True)
class Beat:
    """What one heartbeat learned."""

    result: ElectionResult | None
    config_version: int
    leader_config_hash: str | None
    clock_offset: float | None = None
    """The database's clock minus this node's (wall clocks, seconds): what the lease's skew bound
    is about (docs/store.md, "Across a database failover")."""


class HeartbeatService(TimerService):
    """Steps the elector and upserts this node's membership row every heartbeat_seconds."""

    def __init__(
        self,
        stores: StoreService,
        lease: LeaseService,
        node: NodeIdentity,
        *,
        seconds: float,
        metrics: Metrics,
        config_hash: Callable[[], str],
        on_beat: Callable[[Beat], None],
        config_version: Callable[[], int],
        reactor: Any = None,
        cannot_bind: Callable[[], Iterable[str]] = lambda: (),
    ) -> None:
        super().__init__(seconds, self._beat)
        self._cannot_bind = cannot_bind
        self.setName("heartbeat")
        if reactor is not None:
            self.clock = reactor
        self._stores = stores
        self._lease = lease
        self._node = node
        self._metrics = metrics
        self._config_hash = config_hash
        self._on_beat = on_beat
        self._config_version = config_version
        metrics.store_clock_offset.set(math.nan)  # until a heartbeat measured it

    def _beat(self) -> Deferred[None]:
        return threads.deferToThread(self._beat_blocking).addCallbacks(self._after_beat, self._beat_failed)

    def _beat_blocking(self) -> Beat:
        store = self._stores.store
        assert store is not None
        result = self._lease.step()
        heartbeat(
            store,
            self._node,
            is_leader=self._lease.is_leader,
            config_hash=self._config_hash(),
            cannot_bind=self._cannot_bind(),
        )
        with store.transaction(write=False) as tx:
            version = int(tx.row("identity_get")["config_version"])
            row = tx.one("leader_config_hash")
            sent = time.time()
            db_now = float(tx.row("db_now")["db_now"])
            offset = db_now - (sent + time.time()) / 2  # the reading taken halfway through the round trip
        if result is not None and result.outcome is Outcome.ELECTED and result.epoch is not None:
            with store.transaction() as tx:
                recovered = rowlease.recover_on_promotion(tx, owner=self._node.node_id, epoch=result.epoch)
            _log.info(
                "elected leader, epoch {epoch}; recovered {n} in-flight row(s) of older epochs",
                epoch=result.epoch,
                n=recovered or 0,
            )
        return Beat(result, version, row["config_hash"] if row else None, offset)

    def _after_beat(self, beat: Beat) -> None:
        if beat.clock_offset is not None:
            self._metrics.store_clock_offset.set(beat.clock_offset)
        result = beat.result
        if result is not None:
            self._metrics.elections.labels(result.outcome.value).inc()
            if result.outcome is Outcome.CONFLICT:
                _log.warn(
                    "lost the leader lease (now {leader}, epoch {epoch})", leader=result.leader, epoch=result.epoch
                )
        self.publish()
        self._on_beat(beat)

    def _beat_failed(self, failure: Failure) -> None:
        self._metrics.store_errors.labels("heartbeat").inc()
        _log.warn("heartbeat failed: {err}; leader fence continues to run", err=type(failure.value).__name__)
        self.publish()

    def publish(self) -> None:
        self._metrics.leader.set(1 if self._lease.is_leader else 0)
        self._metrics.epoch.set(self._lease.epoch or 0)
        self._metrics.config_version.set(self._config_version())
