"""Membership heartbeat (`nodes`) and the derived cluster view served as `/cluster/nodes`.

A node upserts its row every heartbeat (status `active`, `last_seen` = DB now, its leader flag);
a clean stop leaves a `left` tombstone. The derived leader is the freshest active node whose flag
is set and whose `last_seen` is within `node_timeout_seconds` — at most one, never a dead one. The
lease row stays the authority on who may process; this view can lag it by one heartbeat.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from include.store.db import Store
from include.store.lease import read_lease


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    host: str
    pid: int

    @classmethod
    def of(cls, node_id: str) -> NodeIdentity:
        """Host and pid come from `host:pid:hex` ids; a pinned id gets this process's."""
        parts = node_id.split(":")
        if len(parts) == 3 and parts[1].isdigit():
            return cls(node_id, parts[0], int(parts[1]))
        return cls(node_id, socket.gethostname(), os.getpid())


def heartbeat(
    store: Store,
    node: NodeIdentity,
    *,
    is_leader: bool,
    config_hash: str | None = None,
    cannot_bind: Iterable[str] = (),
) -> None:
    """Upsert this node's row; `cannot_bind`: the inbound names it could not bind when it last led."""
    names = sorted(set(cannot_bind))
    with store.transaction() as tx:
        tx.execute(
            "node_heartbeat",
            {
                "node_id": node.node_id,
                "host": node.host,
                "pid": node.pid,
                "is_leader": bool(is_leader),
                "config_hash": config_hash,
                "cannot_bind": json.dumps(names) if names else None,
            },
        )


def leave(store: Store, node_id: str) -> None:
    with store.transaction() as tx:
        tx.execute("node_leave", {"node_id": node_id})


def live_peers(store: Store, node_id: str, *, node_timeout_seconds: float) -> dict[str, frozenset[str]]:
    """The other active nodes whose heartbeat is within `node_timeout_seconds` (DB clock) — the nodes
    that could take the lease if this one let it go — each with the inbound names it published as
    not bindable when it last led (empty: it bound everything, or has not led since it started)."""
    with store.transaction(write=False) as tx:
        rows = tx.all("nodes_list", {"node_timeout": float(node_timeout_seconds)})
    return {
        r["node_id"]: frozenset(json.loads(r["cannot_bind"]) if r["cannot_bind"] else ())
        for r in rows
        if r["fresh"] and r["node_id"] != node_id
    }


def cluster_nodes(store: Store, *, node_timeout_seconds: float) -> dict[str, Any]:
    """The `/cluster/nodes` document for a clustered store (also what the Airflow UI's Stageline
    view shows): the nodes, the derived leader, the lease (owner, epoch, expiry) and the active
    nodes whose config dir hash differs from the lease owner's (`config_mismatch`)."""
    with store.transaction(write=False) as tx:
        rows = tx.all("nodes_list", {"node_timeout": float(node_timeout_seconds)})
    lease = read_lease(store)
    candidates = [r for r in rows if r["is_leader"] and r["fresh"]]
    owner = lease.owner if lease.live else None
    # freshest flag wins; the lease owner wins a tie (the lease is the authority)
    leader = max(candidates, key=lambda r: (r["last_seen"], r["node_id"] == owner))["node_id"] if candidates else None
    nodes = [
        {
            "node_id": r["node_id"],
            "host": r["host"],
            "pid": int(r["pid"]),
            "status": r["status"],
            "started_at": r["started_at"],
            "last_seen": r["last_seen"],
            "is_leader": r["node_id"] == leader,
        }
        for r in rows
    ]
    leader_hash = next((r["config_hash"] for r in rows if owner and r["node_id"] == owner), None)
    mismatch = sorted(
        r["node_id"] for r in rows if leader_hash and r["status"] == "active" and r["config_hash"] != leader_hash
    )
    return {
        "nodes": nodes,
        "leader_node_id": leader,
        "lease_owner": owner,
        "lease_expires_at": lease.expires_at if lease.live else None,
        "epoch": lease.epoch,
        "db_now": lease.db_now,
        "config_mismatch": mismatch,
    }


def single_node_nodes(node: NodeIdentity) -> dict[str, Any]:
    """The synthetic single-node form: permanently leader, no heartbeat history."""
    return {
        "nodes": [
            {
                "node_id": node.node_id,
                "host": node.host,
                "pid": node.pid,
                "status": "active",
                "started_at": None,
                "last_seen": None,
                "is_leader": True,
            }
        ],
        "leader_node_id": node.node_id,
        "lease_owner": node.node_id,
        "lease_expires_at": None,
    }


def cluster_status(*, node_id: str, clustered: bool, is_leader: bool, config_version: int) -> dict[str, Any]:
    """The `/cluster/status` document: this node's own posture."""
    if not clustered:
        return {"node_id": node_id, "clustered": False, "is_leader": True, "role": "single-node", "config_version": 0}
    return {
        "node_id": node_id,
        "clustered": True,
        "is_leader": is_leader,
        "role": "primary" if is_leader else "standby",
        "config_version": int(config_version),
    }
