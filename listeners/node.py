"""One `listenerd` node: membership heartbeat and lease elector always; the listener graph only
while this node holds the lease.

    heartbeat (every heartbeat_seconds, off the reactor thread)
        elector step → membership upsert → shared config version + leader's config hash
        on "elected": on-promotion recovery (once per epoch)
    supervisor (every few hundred ms, on the reactor: an in-memory check)
        leader and graph down  → bind every inbound connection
        not leader and graph up → stop listening, drop open connections, stop file polling

Leadership is read from the elector's self-fencing `is_leader`, so a node cut off from the
database unbinds at its fence timeout even while a renewal hangs. Single node: a permanent lease.
"""
from __future__ import annotations

import os
import signal
from typing import Any, Callable

from twisted.application import service
from twisted.application.internet import TimerService
from twisted.internet import defer, threads
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger

from include.config import ServiceConfig
from include.hl7path import value as hl7_value
from include.store import Store
from include.store import rowlease
from include.store.lease import LeaderElector, Outcome, acquire_permanent
from include.store.membership import NodeIdentity, cluster_nodes, heartbeat, leave, single_node_nodes
from include.store.migrate import check_identity
from listeners.connections import InboundConfig, ListenerConfig, load_config_dir
from listeners.graph import Bound
from listeners.hl7ack import AckCode, AckDecision
from listeners.hl7msg import HL7Header
from listeners.inbound import PayloadRejected, build_inbound, rejection_reason
from listeners.ingest import IngestWriter
from listeners.metrics import Metrics
from listeners.mllp import MLLPConfig, MLLPFactory
from listeners.state import NodeState

_log = Logger(namespace="stageline.node")


class PermanentLease:
    """Single-node leadership: taken once at start (bumping the epoch), never lost."""

    def __init__(self, store: Store, node_id: str) -> None:
        self.epoch = acquire_permanent(store, node_id=node_id)
        self.is_leader = True

    def step(self) -> None:
        return None

    def release(self) -> bool:
        return False


class ListenerNode(service.MultiService):
    def __init__(self, config: ServiceConfig, config_dir: str, *, reactor: Any = None,
                 supervise_seconds: float = 0.1, drain_seconds: float = 10.0, api_port: int | None = None) -> None:
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.reactor = reactor
        self.config = config
        self.config_dir = config_dir
        self.listeners: ListenerConfig = load_config_dir(config_dir)
        from listeners.api import ApiAuth, ApiSettings

        # refuse a bad [api] (plaintext token, insecure bind, unreadable cert) before doing anything
        self.api_settings = ApiSettings.from_config(self.listeners.api, self.listeners.directory)
        self.api_auth = ApiAuth.from_config(self.listeners.api, os.environ)
        self.identity = NodeIdentity.of(config.cluster.node_id)
        self.metrics = Metrics()
        self.supervise_seconds = supervise_seconds
        self.drain_seconds = drain_seconds
        self.config_version = 0
        self.leader_config_hash: str | None = None
        self._bound: list[Bound] = []  # how to take each bound piece down
        self._graph_up = False
        self._binding: Deferred | None = None
        self._stopping = False
        self.store: Store | None = None
        self.leadership: Any = None
        self.ingest: IngestWriter | None = None
        self.state: NodeState | None = None
        self.bound_ports: dict[str, int] = {}  # inbound name -> bound port (useful with port 0)
        self.api_port: int | None = api_port  # overrides [api].port when given

    # -- lifecycle ---------------------------------------------------------------------------
    def startService(self) -> None:
        cfg = self.config
        self.store = Store(cfg.store)
        identity = check_identity(self.store, cluster_name=cfg.cluster.cluster_name)
        self.config_version = int(identity["config_version"])
        if cfg.cluster.enabled:
            self.leadership = LeaderElector(self.store, node_id=self.identity.node_id,
                                            ttl_seconds=cfg.cluster.leader_lease_ttl_seconds,
                                            fence_timeout_seconds=cfg.cluster.leader_fence_timeout_seconds)
        else:
            self.leadership = PermanentLease(self.store, self.identity.node_id)
        self.ingest = IngestWriter(self.store, node_id=self.identity.node_id, epoch=lambda: self.leadership.epoch,
                                   metrics=self.metrics, reactor=self.reactor)
        self.ingest.start()
        self.state = NodeState(node_id=self.identity.node_id, clustered=cfg.cluster.enabled, metrics=self.metrics,
                               is_leader=lambda: bool(self.leadership.is_leader),
                               config_version=lambda: self.config_version, nodes=self._nodes_doc)
        self._start_api()
        beat = TimerService(cfg.cluster.heartbeat_seconds, self._beat)
        beat.setServiceParent(self)
        supervise = TimerService(self.supervise_seconds, self._supervise)
        supervise.setServiceParent(self)
        super().startService()
        _log.info("listenerd {node} started ({mode}); {n} inbound connection(s) configured",
                  node=self.identity.node_id, mode="cluster" if cfg.cluster.enabled else "single node",
                  n=len(self.listeners.inbound))

    @inlineCallbacks
    def stopService(self):
        """SIGTERM, in this order, so a clean stop loses and duplicates nothing (invariant 2 in
        docs/invariants.md): stop taking input (stop listening, stop reading open connections,
        stop file polling and HTTP intake); finish every queued commit, each firing its ACK onto
        its connection; close the connections once those ACKs are flushed; only then expire the
        lease and leave."""
        self._stopping = True
        bound, self._bound = self._bound, []
        self._graph_up = False
        for piece in bound:
            yield defer.maybeDeferred(piece.stop_intake)
        if self.ingest is not None:
            drained = yield threads.deferToThread(self.ingest.drain, self.drain_seconds)
            if not drained:
                _log.error("commits still pending after {s}s; their senders get no ACK and resend",
                           s=self.drain_seconds)
        for piece in bound:
            piece.close(False)
        closed = yield _until(self.reactor, lambda: sum(p.open_connections() for p in bound) == 0,
                              timeout=self.drain_seconds)
        if not closed:
            for piece in bound:
                piece.close(True)
        yield super().stopService()
        if self.ingest is not None:
            yield threads.deferToThread(self.ingest.stop)
        if self.store is not None:
            yield threads.deferToThread(self._leave_blocking)
        for port in getattr(self, "_api_ports", []):
            yield port.stopListening()
        _log.info("listenerd {node} stopped", node=self.identity.node_id)

    def _leave_blocking(self) -> None:
        try:
            self.leadership.release()
            leave(self.store, self.identity.node_id)
        except Exception as exc:
            _log.warn("clean leave failed ({err}); the lease will age out", err=type(exc).__name__)
        finally:
            self.store.close()

    # -- heartbeat ---------------------------------------------------------------------------
    def _beat(self) -> Deferred:
        d = threads.deferToThread(self._beat_blocking)
        d.addCallbacks(self._after_beat, self._beat_failed)
        return d

    def _beat_blocking(self) -> tuple[Any, int, str | None]:
        result = self.leadership.step()
        heartbeat(self.store, self.identity, is_leader=bool(self.leadership.is_leader),
                  config_hash=self.listeners.config_hash)
        with self.store.transaction(write=False) as tx:
            version = int(tx.one("identity_get")["config_version"])
            row = tx.one("leader_config_hash")
        if result is not None and result.outcome is Outcome.ELECTED:
            with self.store.transaction() as tx:
                recovered = rowlease.recover_on_promotion(tx, owner=self.identity.node_id, epoch=result.epoch)
            _log.info("elected leader, epoch {epoch}; recovered {n} in-flight row(s) of older epochs",
                      epoch=result.epoch, n=recovered or 0)
        return result, version, row["config_hash"] if row else None

    def _after_beat(self, beat: tuple[Any, int, str | None]) -> None:
        result, version, leader_hash = beat
        if result is not None:
            self.metrics.elections.labels(result.outcome.value).inc()
            if result.outcome is Outcome.CONFLICT:
                _log.warn("lost the leader lease (now {leader}, epoch {epoch})", leader=result.leader,
                          epoch=result.epoch)
        self._publish_leadership()
        mismatch = bool(leader_hash and leader_hash != self.listeners.config_hash)
        if mismatch and leader_hash != self.leader_config_hash:
            _log.error("CONFIG MISMATCH: this node's config dir hash {mine} differs from the leader's {theirs}; "
                       "every node must run the same config", mine=self.listeners.config_hash, theirs=leader_hash)
        self.leader_config_hash = leader_hash
        self.metrics.config_mismatch.set(1 if mismatch else 0)
        if version > self.config_version:
            _log.info("shared config version {v} > loaded {mine}: reloading the config dir", v=version,
                      mine=self.config_version)
            self._reload(bump=False, version=version)

    def _beat_failed(self, failure) -> None:
        self.metrics.store_errors.labels("heartbeat").inc()
        _log.warn("heartbeat failed: {err}; leader fence continues to run", err=failure.type.__name__)
        self._publish_leadership()

    def _publish_leadership(self) -> None:
        self.metrics.leader.set(1 if self.leadership.is_leader else 0)
        self.metrics.epoch.set(self.leadership.epoch or 0)
        self.metrics.config_version.set(self.config_version)

    # -- supervisor --------------------------------------------------------------------------
    def _supervise(self) -> Deferred | None:
        if self._stopping or self._binding is not None:
            return None
        leader = bool(self.leadership.is_leader)
        if leader and not self._graph_up:
            self._binding = defer.maybeDeferred(self._bind)
        elif not leader and self._graph_up:
            _log.warn("not the leader any more: unbinding inbound connections")
            self._binding = self._unbind()
        else:
            return None
        self._binding.addErrback(lambda f: _log.failure("listener graph change failed", f))
        self._binding.addBoth(self._binding_done)
        return None

    def _binding_done(self, _: Any) -> None:
        self._binding = None
        self.metrics.bound.set(len(self._bound) if self._graph_up else 0)

    def _bind(self) -> None:
        from listeners import graph

        self._graph_up = True
        for conn in self.listeners.inbound:
            try:
                self._bound.append(graph.bind(self, conn))
            except Exception as exc:
                _log.error("cannot bind inbound {name} ({kind} {host}:{port}): {err}", name=conn.name,
                           kind=conn.kind, host=conn.host, port=conn.port, err=exc)
        _log.info("leader: bound {n} inbound connection(s)", n=len(self._bound))

    @inlineCallbacks
    def _unbind(self):
        """Leadership lost (or a changed config): stop listening and drop open connections at once;
        unanswered messages get no ACK and their senders resend (at-least-once)."""
        bound, self._bound = self._bound, []
        self._graph_up = False
        for piece in bound:
            yield defer.maybeDeferred(piece.stop_intake)
            piece.close(True)

    # -- handlers used by the listener graph -------------------------------------------------
    def mllp_handler(self, conn: InboundConfig) -> Callable[[bytes, Any, HL7Header], Deferred]:
        metrics, received = self.metrics, self.metrics.received.labels(conn.name)
        aa = metrics.acks.labels(conn.name, "AA")
        lane_of = self.lane_of(conn)

        def handle(message: bytes, peer: Any, header: HL7Header) -> Deferred:
            received.inc()
            try:
                item = build_inbound(message, connection=conn.name, charset=conn.charset, lane_of=lane_of,
                                     header=header)
            except PayloadRejected as exc:
                _log.warn("rejecting message {control_id} on {connection}: {reason}",
                          control_id=header.control_id[:64], connection=conn.name, reason=str(exc))
                metrics.acks.labels(conn.name, "AR").inc()
                return defer.succeed(AckDecision.reject(str(exc)))

            def ok(_: str) -> AckDecision:
                aa.inc()
                return AckDecision.accept()

            def failed(f) -> AckDecision:
                reason, code = rejection_reason(f)
                metrics.acks.labels(conn.name, code).inc()
                return AckDecision(AckCode(code), reason)

            return self.ingest.submit(item).addCallbacks(ok, failed)

        return handle

    def lane_of(self, conn: InboundConfig) -> Callable[[str], str | None]:
        path = conn.lane_key
        return (lambda text: hl7_value(text, path)) if path else (lambda text: None)

    def mllp_factory(self, conn: InboundConfig) -> MLLPFactory:
        return MLLPFactory(self.mllp_handler(conn), clock=self.reactor, config=MLLPConfig(
            max_message_bytes=conn.max_message_bytes, idle_timeout_seconds=conn.idle_timeout_seconds,
            max_connections=conn.max_connections, default_encoding=_codec(conn.charset)))

    # -- control plane and config ------------------------------------------------------------
    def _start_api(self) -> None:
        from listeners import graph

        self._api_ports = graph.start_api(self)

    def _nodes_doc(self) -> Deferred:
        if not self.config.cluster.enabled:
            return defer.succeed(single_node_nodes(self.identity))
        timeout = self.config.cluster.node_timeout_seconds

        def read() -> dict:
            doc = cluster_nodes(self.store, node_timeout_seconds=timeout)
            with self.store.transaction(write=False) as tx:
                hashes = {r["node_id"]: r["config_hash"] for r in tx.all("nodes_list", {"node_timeout": timeout})}
            leader_hash = hashes.get(doc["lease_owner"]) if doc["lease_owner"] else None
            doc["config_mismatch"] = sorted(n for n, h in hashes.items()
                                            if leader_hash and h != leader_hash and n in {
                                                x["node_id"] for x in doc["nodes"] if x["status"] == "active"})
            return doc

        return threads.deferToThread(read)

    def reload(self) -> Deferred:
        """SIGHUP: reload the config dir here and bump the shared version so peers reload too."""
        return self._reload(bump=True)

    def _reload(self, *, bump: bool, version: int | None = None) -> Deferred:
        def work() -> tuple[ListenerConfig, int]:
            new = load_config_dir(self.config_dir)
            if bump:
                with self.store.transaction() as tx:
                    return new, int(tx.one("config_bump")["config_version"])
            return new, version if version is not None else self.config_version

        @inlineCallbacks
        def apply(result):
            new, new_version = result
            changed = new.config_hash != self.listeners.config_hash
            self.listeners, self.config_version = new, new_version
            self.metrics.config_version.set(new_version)
            _log.info("config reloaded (version {v}, hash {h}, {c})", v=new_version, h=new.config_hash,
                      c="changed" if changed else "unchanged")
            if changed and self._graph_up and self._binding is None:
                self._binding = self._unbind()
                yield self._binding
                self._binding = None  # the supervisor rebinds with the new config on its next tick

        d = threads.deferToThread(work)
        d.addCallbacks(apply, lambda f: _log.error("config reload refused, keeping the old config: {err}",
                                                   err=f.value))
        return d

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGHUP, lambda *_: self.reactor.callFromThread(self.reload))


def _codec(charset: str) -> str:
    return charset.replace("-", "_").lower()


def _until(reactor: Any, condition: Callable[[], bool], *, timeout: float, interval: float = 0.01) -> Deferred:
    """Fires True once `condition()` holds (checked every `interval` on the reactor), False at `timeout`."""
    d: Deferred = Deferred()
    deadline = reactor.seconds() + timeout

    def check() -> None:
        if condition():
            d.callback(True)
        elif reactor.seconds() >= deadline:
            d.callback(False)
        else:
            reactor.callLater(interval, check)

    check()
    return d
