"""What the control plane reads about this node: cheap in-memory posture, and the membership view
(one `nodes` read, done off the reactor thread)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred

from include.store.membership import cluster_status
from listeners.metrics import Metrics
from listeners.store_metrics import StoreMetrics


@dataclass
class NodeState:
    node_id: str
    clustered: bool
    metrics: Metrics
    is_leader: Callable[[], bool]
    config_version: Callable[[], int]
    nodes: Callable[[], Deferred[Any]]  # fires with the /cluster/nodes document
    store: Callable[[], Any] = lambda: None  # the node's store (None before it opens), for /messages
    archive_path: str = ""  # [retention] archive_path: /messages/<ref> reads the Parquet archive too
    fenced: Callable[[], bool] = lambda: False  # holds an epoch it stopped acting on (fence tripped)
    serving: Callable[[], bool] = lambda: True  # every configured inbound bound (the leader gate)
    unbound: Callable[[], list[dict[str, Any]]] = list  # inbound the leader is retrying, and why
    aside_seconds: Callable[[], float] = lambda: 0.0  # what is left of a step-down's backoff
    serves: Callable[[str], bool | None] = lambda name: None  # one inbound bound? (None: not configured)
    store_metrics: StoreMetrics | None = None  # the destinations' and connections' figures, read on scrape
    replication: Callable[[], dict[str, Any] | None] = lambda: None  # the store's replication posture

    def __post_init__(self) -> None:
        self.metrics.store_durable.set_function(lambda: 0.0 if self.durability_problem() else 1.0)

    def durability_problem(self) -> str | None:
        """Why the store's server may lose commits (fsync turned off at run time: every commit is
        refused meanwhile), as the store's last recheck found; None when durable."""
        return getattr(self.store(), "durability_problem", None)

    def status(self) -> dict[str, Any]:
        """The /cluster/status document."""
        doc = cluster_status(
            node_id=self.node_id,
            clustered=self.clustered,
            is_leader=self.is_leader(),
            config_version=self.config_version(),
        )
        problem = self.durability_problem()
        if problem:  # only then: the document of a healthy node stays as it was
            doc.update(store_durable=False, durability_problem=problem)
        replication = self.replication()
        if replication is not None:  # a PostgreSQL store: is a commit on two servers?
            doc["replication"] = replication
        doc["unbound"] = self.unbound()
        aside = self.aside_seconds()
        if aside > 0:
            doc["standing_aside_seconds"] = round(aside, 3)
        return doc

    def leader(self, inbound: str | None = None) -> tuple[int, dict[str, Any]]:
        """`GET /leader`: 200 only on the node that holds the lease, has not fenced and serves every
        inbound; else 503 and why. In-memory only: a load balancer polls it every second or so.

        `GET /leader?inbound=<name>`: the same for that one inbound — what a load balancer in front of
        that inbound's port asks, so that a leader which serves it is kept in the VIP even while
        another inbound (a file drop whose share is down on every node) is not bound; 404 for a
        name that is not configured."""
        doc: dict[str, Any] = {"node_id": self.node_id}
        if inbound is not None:
            doc["inbound"] = inbound
        if self.fenced():
            return 503, {**doc, "leader": False, "reason": "fenced"}
        if not self.is_leader():
            reason = "standing_aside" if self.aside_seconds() > 0 else "standby"
            return 503, {**doc, "leader": False, "reason": reason}
        if inbound is not None:
            serves = self.serves(inbound)
            if serves is None:
                return 404, {**doc, "leader": False, "reason": "unknown inbound"}
            if not serves:
                unbound = [u["name"] for u in self.unbound()]
                return 503, {
                    **doc,
                    "leader": False,
                    "reason": "unbound" if inbound in unbound else "binding",
                    "unbound": unbound,
                }
            return 200, {**doc, "leader": True}
        unbound = self.unbound()
        if unbound or not self.serving():
            return 503, {
                **doc,
                "leader": False,
                "reason": "unbound" if unbound else "binding",
                "unbound": [u["name"] for u in unbound],
            }
        return 200, {**doc, "leader": True}
