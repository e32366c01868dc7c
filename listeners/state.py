"""What the control plane reads about this node: cheap in-memory posture, and the membership view
(one `nodes` read, done off the reactor thread)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from twisted.internet.defer import Deferred

from include.store.membership import cluster_status
from listeners.metrics import Metrics


@dataclass
class NodeState:
    node_id: str
    clustered: bool
    metrics: Metrics
    is_leader: Callable[[], bool]
    config_version: Callable[[], int]
    nodes: Callable[[], Deferred]  # fires with the /cluster/nodes document
    store: Callable[[], Any] = lambda: None  # the node's store (None before it opens), for /messages
    archive_path: str = ""  # [retention] archive_path: /messages/<ref> reads the Parquet archive too

    def status(self) -> dict[str, Any]:
        """The /cluster/status document."""
        return cluster_status(node_id=self.node_id, clustered=self.clustered, is_leader=self.is_leader(),
                              config_version=self.config_version())
