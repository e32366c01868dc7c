"""The listenerd node most cluster tests start (one MLLP inbound, `adt-in`, on a given port) and the
fast cluster timings they run it under."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from include.app.lab.listenerd import Daemon
from include.app.lab.two_nodes import Timings

_LAB = Timings()
HEARTBEAT, FENCE, TTL = _LAB.heartbeat, _LAB.fence, _LAB.lease_ttl
"""The lab's fast cluster timings: heartbeat, leader fence timeout and leader lease TTL, in seconds."""


def fast_cluster(**more: Any) -> dict[str, Any]:
    """A node's `[cluster]` table under the fast timings; `more` adds or overrides keys."""
    return {
        "enabled": True,
        "heartbeat_seconds": HEARTBEAT,
        "leader_fence_timeout_seconds": FENCE,
        "leader_lease_ttl_seconds": TTL,
        "node_timeout_seconds": _LAB.node_timeout,
        **more,
    }


def mllp_node(
    path: Path, store_config: Any, *, node_id: str, port: int, options: dict[str, Any] | None = None, **kwargs: Any
) -> Daemon:
    """A started listenerd (`Daemon`) whose one inbound is MLLP `adt-in` on 127.0.0.1:`port`, with
    `options` (more keys of that connection) added."""
    inbound = [{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": port, **(options or {})}]
    return Daemon(path, store_config, node_id=node_id, inbound=inbound, **kwargs).start()
