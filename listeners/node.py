"""One `listenerd` node as a service tree, built without I/O and started in this order:

    ListenerNode (stops its children one at a time, last started first)
    ├── api         control plane: /health, /cluster/*, /metrics        every node
    ├── store       opened and checked at start, closed at the end       every node
    ├── lease       elector (single node: permanent lease)               every node
    ├── ingest      group-commit writer (PostgreSQL: on the reactor; else a thread) every node
    ├── heartbeat   elector step, membership, shared config version      every node
    └── leader-gate endpoint services (MLLP, TCP, HTTP, file drop, database poll) only while leading

So a clean stop (SIGTERM) runs: the gate's ordered stop (intake, commits and their answers,
close), the heartbeat, the writer, then the lease is released and the node marked left, the store
closed, and the API last (invariant 2, docs/invariants.md). The node itself owns only the config
dir: loading it, SIGHUP reloads, and following the cluster's shared config version.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any

from twisted.application.service import MultiService
from twisted.internet import defer, threads
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.config import ServiceConfig
from include.schema import ConfigProblems
from include.store import operator
from include.store.membership import NodeIdentity, cluster_nodes, single_node_nodes
from listeners.api import READS, ApiAuth, ApiSettings, make_api
from listeners.cluster import Beat, HeartbeatService, LeaseService, StoreService
from listeners.connections_config import ListenerConfig, load_config_dir
from listeners.endpoints import ListeningService, Wiring, inbound_service
from listeners.gate import LeaderGate
from listeners.group_commit import IngestService
from listeners.guard import PeerLimits, Refusals
from listeners.metrics import Metrics
from listeners.replication import PostureService
from listeners.state import NodeState
from listeners.store_metrics import StoreMetrics

__all__ = ["ListenerNode", "SequentialMultiService"]

_log = Logger(namespace="stageline.node")
API_LIMITS = PeerLimits(connect_rate_per_peer=200.0)
"""The control plane's peer limits: monitoring and scripts poll it from one address, often with a
new connection per request, so its connect rate is ten times an inbound listener's."""
STAGE_GAUGE_SECONDS = 5.0
"""At most this often (and at most once a heartbeat) the leader reads the stages for its gauges."""


class SequentialMultiService(MultiService):
    """A `MultiService` that stops its children one at a time, last started first, each waiting
    for the one before: the stop order is the reverse of the start order, and nothing overlaps."""

    @inlineCallbacks
    def stopService(self) -> Any:
        super(MultiService, self).stopService()
        for svc in reversed(list(self)):
            yield defer.maybeDeferred(svc.stopService)


class ListenerNode(SequentialMultiService):
    def __init__(
        self,
        config: ServiceConfig,
        config_dir: str,
        *,
        reactor: Any = None,
        supervise_seconds: float = 0.1,
        drain_seconds: float = 10.0,
        api_port: int | None = None,
    ) -> None:
        """Read and check the config dir and `[api]` (a bad one raises before anything runs) and
        wire the tree; `startService` does the I/O."""
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.reactor = reactor
        self.config = config
        self.config_dir = config_dir
        self.listeners: ListenerConfig = load_config_dir(config_dir)
        api_settings = ApiSettings.from_config(self.listeners.api, self.listeners.directory)
        api_auth = ApiAuth.from_config(self.listeners.api, os.environ)
        self.identity = NodeIdentity.of(config.cluster.node_id)
        self.metrics = Metrics()
        self.config_version = 0
        self.leader_config_hash: str | None = None
        self._stages_gauged_at = float("-inf")
        self._stages_reading = False
        self.bound_ports: dict[str, int] = {}  # inbound name -> bound port (useful with port 0)
        self._cannot_bind: dict[str, float] = {}  # inbound name -> monotonic time it was last found unbindable
        self.api_port: int | None = api_port  # overrides [api].port when given

        node_id = self.identity.node_id
        self.stores = StoreService(config.store, cluster_name=config.cluster.cluster_name)
        self.lease = LeaseService(self.stores, self.identity, config.cluster)
        self.ingest = IngestService(
            lambda: self.stores.store,
            node_id=node_id,
            epoch=lambda: self.lease.epoch,
            metrics=self.metrics,
            reactor=reactor,
        )
        self.replication = PostureService(
            lambda: self.stores.store, self.metrics, expected=config.store.sync_standbys_expected, reactor=reactor
        )
        cluster = config.cluster
        self.metrics.lease_skew_bound.set(
            cluster.leader_lease_ttl_seconds - cluster.leader_fence_timeout_seconds if cluster.enabled else math.nan
        )
        self.heartbeat = HeartbeatService(
            self.stores,
            self.lease,
            self.identity,
            seconds=config.cluster.heartbeat_seconds,
            metrics=self.metrics,
            config_hash=lambda: self.listeners.config_hash,
            on_beat=self._after_beat,
            config_version=lambda: self.config_version,
            reactor=reactor,
            cannot_bind=self._cannot_bind_now,
        )
        wiring = Wiring(
            ingest=self.ingest,
            metrics=self.metrics,
            reactor=reactor,
            bound_ports=self.bound_ports,
            refusals=Refusals(self.metrics, reactor),
            store=lambda: self.stores.store,
            epoch=lambda: self.lease.epoch,
        )
        cluster = config.cluster
        self.gate = LeaderGate(
            is_leader=lambda: self.lease.is_leader,
            connections=lambda: self.listeners.inbound,
            build=lambda conn: inbound_service(conn, wiring),
            drain=self.ingest.drain,
            reactor=reactor,
            supervise_seconds=supervise_seconds,
            drain_seconds=drain_seconds,
            on_change=self.metrics.bound.set,
            grace_seconds=cluster.unbound_grace(),
            step_down=self._step_down if cluster.enabled else None,
            may_step_down=self._may_step_down if cluster.enabled else None,
            on_bind=self._on_bind,
        )
        self.state = NodeState(
            node_id=node_id,
            clustered=cluster.enabled,
            metrics=self.metrics,
            is_leader=lambda: self.lease.is_leader,
            config_version=lambda: self.config_version,
            nodes=self._nodes_doc,
            store=lambda: self.stores.store,
            archive_path=config.retention.archive_path,
            fenced=lambda: self.lease.fenced,
            serving=lambda: self.gate.serving,
            unbound=self.gate.unbound,
            aside_seconds=lambda: self.lease.aside_seconds,
            serves=self.gate.serves,
            replication=self.replication.document,
            store_metrics=StoreMetrics(
                self.metrics.registry,
                store=lambda: self.stores.store,
                is_leader=lambda: self.lease.is_leader,
                clock=reactor,
            ),
        )
        self.api = ListeningService(
            "api",
            api_settings.host,
            api_settings.port if api_port is None else api_port,
            make_api(self.state, api_auth),
            api_settings.tls,
            reactor=reactor,
            on_bound=self._api_bound,
            guard=wiring.guard("api", API_LIMITS),
        )
        for svc in (self.api, self.stores, self.replication, self.lease, self.ingest, self.heartbeat, self.gate):
            svc.setServiceParent(self)

    def startService(self) -> None:
        super().startService()
        self.config_version = int(self.stores.identity["config_version"])
        cfg = self.config
        _log.info(
            "listenerd {node} started ({mode}); {n} inbound connection(s) configured",
            node=self.identity.node_id,
            mode="cluster" if cfg.cluster.enabled else "single node",
            n=len(self.listeners.inbound),
        )

    @inlineCallbacks
    def stopService(self) -> Any:
        yield super().stopService()
        _log.info("listenerd {node} stopped", node=self.identity.node_id)

    def _may_step_down(self, names: list[str]) -> Deferred[str | None]:
        """Why handing the lease over cannot help (None: step down), asked past the grace: when no other
        node is live (a lone node would only take the lease back after its backoff, serving nothing
        meanwhile), or every live one published that it could not bind these inbounds either when it
        last led (a share down on every node: the node that keeps the lease at least serves the
        inbounds it bound, instead of the lease going round). A node that restarted or never led
        published nothing: it counts as able, so it is given the lease (docs/listenerd.md)."""
        now = time.monotonic()
        self._cannot_bind.update(dict.fromkeys(names, now))  # published with the next heartbeat
        wanted = set(names)

        def why_not(peers: dict[str, frozenset[str]]) -> str | None:
            if not peers:
                return "no other live node to hand over to"
            if all(wanted <= failed for failed in peers.values()):
                return "every other live node could not bind it either when it last led"
            return None

        return self.lease.live_peers().addCallback(why_not)

    def _cannot_bind_now(self) -> list[str]:
        """The inbounds this node could not bind when it last led (published with each heartbeat),
        forgotten after `_cannot_bind_memory()`: then the lease is offered to this node again."""
        horizon = time.monotonic() - self._cannot_bind_memory()
        known = dict(self._cannot_bind)  # one copy (atomic): the heartbeat asks from its thread
        return sorted(name for name, at in known.items() if at >= horizon)

    def _cannot_bind_memory(self) -> float:
        """Long against a hand-over (each costs a grace and a gap): an inbound that no node can bind
        makes the lease move at most once per this period (20 minutes at the defaults)."""
        c = self.config.cluster
        return 10 * (c.unbound_grace() + c.step_down_backoff() + c.leader_lease_ttl_seconds)

    def _on_bind(self, name: str, bound: bool, failed: bool) -> None:
        self.metrics.inbound_bind(name, bound, failed)
        if bound:
            self._cannot_bind.pop(name, None)

    def _step_down(self, names: list[str]) -> Deferred[bool]:
        """The gate could not serve an inbound past its grace: release the lease, and take none for
        `[cluster] step_down_backoff_seconds` so a node that can serve leads (docs/listenerd.md)."""
        self.metrics.step_downs.inc()
        d = self.lease.step_down(self.config.cluster.step_down_backoff())

        def publish(result: bool | Failure) -> bool | Failure:
            self.heartbeat.publish()
            return result

        return d.addBoth(publish)

    def _api_bound(self, port: int) -> None:
        self.api_port = port
        _log.info("API listening on port {port}", port=port)  # the actual port, when --api-port 0 asked for any

    # -- config: the node's own concern ------------------------------------------------------

    def _after_beat(self, beat: Beat) -> None:
        """Follow the cluster: report a config dir that differs from the leader's, reload when the
        shared config version moved past ours."""
        leader_hash = beat.leader_config_hash
        mismatch = bool(leader_hash and leader_hash != self.listeners.config_hash)
        if mismatch and leader_hash != self.leader_config_hash:
            _log.error(
                "CONFIG MISMATCH: this node's config dir hash {mine} differs from the leader's {theirs}; "
                "every node must run the same config",
                mine=self.listeners.config_hash,
                theirs=leader_hash,
            )
        self.leader_config_hash = leader_hash
        self.metrics.config_mismatch.set(1 if mismatch else 0)
        self._gauge_stages()
        if beat.config_version > self.config_version:
            _log.info(
                "shared config version {v} > loaded {mine}: reloading the config dir",
                v=beat.config_version,
                mine=self.config_version,
            )
            self._reload(bump=False, version=beat.config_version)

    def _gauge_stages(self) -> None:
        """The leader publishes the stages' backlog, oldest age, in flight and dead letters on its
        heartbeat, at most every STAGE_GAUGE_SECONDS (deploy/alerts.yml reads them; one scan of each
        staged table's rows); a standby publishes none."""
        if not self.lease.is_leader or self.stores.store is None:
            self.metrics.clear_stages()
            return
        now = time.monotonic()
        if now - self._stages_gauged_at < STAGE_GAUGE_SECONDS or self._stages_reading:
            return  # one read at a time: a read stuck on a lock must not take thread after thread
        self._stages_gauged_at, self._stages_reading = now, True
        d = threads.deferToThread(operator.stages, self.stores.store)
        d.addCallbacks(
            self.metrics.set_stages, lambda f: _log.warn("stage gauges not read: {err}", err=type(f.value).__name__)
        )
        d.addBoth(lambda _: setattr(self, "_stages_reading", False))

    def reload(self) -> Deferred[None]:
        """SIGHUP: reload the config dir here and bump the shared version so peers reload too."""
        return self._reload(bump=True)

    def _reload(self, *, bump: bool, version: int | None = None) -> Deferred[None]:
        """The same whole-dir check as a start (`listeners.config_check.check_dir`: connections,
        routes, destinations, transforms, lookups, unknown files; a missing connections.toml is a
        problem, not "no connections"); any problem is logged, one line each with file and key,
        and the old config stays."""
        from listeners.config_check import check_dir, sqlite_store_dir

        store_dir = sqlite_store_dir(self.config.store)
        source = self.config.source
        service = source if source is not None and source.exists() else None  # no file: the defaults

        def work() -> tuple[ListenerConfig, int]:
            report = check_dir(
                self.config_dir,
                lookups_unverified_ok=True,
                store_dir=store_dir,
                service_config=service,
                connections_required=True,
            )
            if not report.ok:
                raise ConfigProblems(report.problems)
            new = load_config_dir(self.config_dir, store_dir=store_dir, required=True)
            if bump:
                assert self.stores.store is not None
                with self.stores.store.transaction() as tx:
                    return new, int(tx.row("config_bump")["config_version"])
            return new, version if version is not None else self.config_version

        def apply(result: tuple[ListenerConfig, int]) -> Deferred[None]:
            new, new_version = result
            changed = new.config_hash != self.listeners.config_hash
            self.listeners, self.config_version = new, new_version
            self.metrics.config_version.set(new_version)
            _log.info(
                "config reloaded (version {v}, hash {h}, {c})",
                v=new_version,
                h=new.config_hash,
                c="changed" if changed else "unchanged",
            )
            # bound connections follow the new config: down now, up again on the gate's next tick
            return self.gate.unbind() if changed else defer.succeed(None)

        def refused(failure: Any) -> None:
            problems = getattr(failure.value, "problems", None)
            if not problems:
                _log.error("config reload refused, keeping the old config: {err}", err=failure.value)
                return
            _log.error("config reload refused, keeping the old config: {n} problem(s)", n=len(problems))
            for problem in problems:
                _log.error("config reload refused: {problem}", problem=str(problem))

        return threads.deferToThread(work).addCallbacks(apply, refused)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGHUP, lambda *_: self.reactor.callFromThread(self.reload))

    # -- control plane -----------------------------------------------------------------------

    def _nodes_doc(self) -> Deferred[dict[str, Any]]:
        if not self.config.cluster.enabled:
            return defer.succeed(single_node_nodes(self.identity))
        timeout = self.config.cluster.node_timeout_seconds

        def read() -> dict[str, Any]:
            store = self.stores.store
            assert store is not None
            return cluster_nodes(store, node_timeout_seconds=timeout)  # config_mismatch included

        return READS.run(read)  # an API read: the API's own threads (listeners.api_reads)
