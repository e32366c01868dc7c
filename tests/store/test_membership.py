"""Membership heartbeat and the derived leader: at most one, never a stale or departed node."""

from __future__ import annotations

import pytest

from include.app.lab.postgres_server import wait_for
from include.store.lease import LeaderElector
from include.store.membership import NodeIdentity, cluster_nodes, cluster_status, heartbeat, leave, single_node_nodes

NODE_KEYS = {"node_id", "host", "pid", "status", "started_at", "last_seen", "is_leader"}


def test_two_node_view_has_the_documented_shape_and_one_leader(store):
    a, b = NodeIdentity.of("node-a:4812:1f9c2a7b"), NodeIdentity.of("node-b:5210:7c3e9d10")
    elector = LeaderElector(store, node_id=a.node_id, ttl_seconds=30, fence_timeout_seconds=20)
    elector.step()
    heartbeat(store, a, is_leader=True, config_hash="h1")
    heartbeat(store, b, is_leader=False, config_hash="h1")
    doc = cluster_nodes(store, node_timeout_seconds=30)
    assert set(doc) == {
        "nodes",
        "leader_node_id",
        "lease_owner",
        "lease_expires_at",
        "epoch",
        "db_now",
        "config_mismatch",
    }
    assert doc["epoch"] == elector.epoch and doc["config_mismatch"] == []
    assert doc["lease_expires_at"] > doc["db_now"]
    assert [set(n) for n in doc["nodes"]] == [NODE_KEYS, NODE_KEYS]
    assert [(n["node_id"], n["host"], n["pid"], n["status"], n["is_leader"]) for n in doc["nodes"]] == [
        ("node-a:4812:1f9c2a7b", "node-a", 4812, "active", True),
        ("node-b:5210:7c3e9d10", "node-b", 5210, "active", False),
    ]
    assert doc["leader_node_id"] == doc["lease_owner"] == a.node_id
    assert isinstance(doc["lease_expires_at"], float) and isinstance(doc["nodes"][0]["last_seen"], float)
    heartbeat(store, b, is_leader=False, config_hash="h2")  # B now runs another config dir
    assert cluster_nodes(store, node_timeout_seconds=30)["config_mismatch"] == [b.node_id]
    leave(store, b.node_id)  # a departed node is no mismatch
    assert cluster_nodes(store, node_timeout_seconds=30)["config_mismatch"] == []


def test_a_stale_leader_flag_is_never_reported_and_the_freshest_flag_wins(store):
    old, new = NodeIdentity.of("old:1:aa"), NodeIdentity.of("new:2:bb")
    heartbeat(store, old, is_leader=True)
    wait_for(
        lambda: cluster_nodes(store, node_timeout_seconds=0.2)["leader_node_id"] is None,
        timeout=5,
        what="old leader flag to go stale",
    )
    heartbeat(store, old, is_leader=True)
    before = cluster_nodes(store, node_timeout_seconds=30)["nodes"][0]["last_seen"]

    def new_beats_later():  # failover window: two flags set, the fresher one wins
        heartbeat(store, new, is_leader=True)
        return {n["node_id"]: n["last_seen"] for n in cluster_nodes(store, node_timeout_seconds=30)["nodes"]}[
            new.node_id
        ] > before

    wait_for(new_beats_later, timeout=5, what="a strictly later heartbeat")
    doc = cluster_nodes(store, node_timeout_seconds=30)
    assert doc["leader_node_id"] == new.node_id
    assert [n["node_id"] for n in doc["nodes"] if n["is_leader"]] == [new.node_id]


def test_a_cleanly_stopped_node_leaves_a_tombstone_without_the_leader_flag(store):
    a = NodeIdentity.of("a:1:aa")
    heartbeat(store, a, is_leader=True)
    leave(store, a.node_id)
    doc = cluster_nodes(store, node_timeout_seconds=30)
    assert [(n["status"], n["is_leader"]) for n in doc["nodes"]] == [("left", False)]
    assert doc["leader_node_id"] is None and doc["lease_owner"] is None


def test_single_node_forms_match_the_documented_shapes():
    node = NodeIdentity.of("host:1234:ab12cd34")
    assert single_node_nodes(node) == {
        "nodes": [
            {
                "node_id": "host:1234:ab12cd34",
                "host": "host",
                "pid": 1234,
                "status": "active",
                "started_at": None,
                "last_seen": None,
                "is_leader": True,
            }
        ],
        "leader_node_id": "host:1234:ab12cd34",
        "lease_owner": "host:1234:ab12cd34",
        "lease_expires_at": None,
    }
    assert cluster_status(node_id=node.node_id, clustered=False, is_leader=False, config_version=5) == {
        "node_id": "host:1234:ab12cd34",
        "clustered": False,
        "is_leader": True,
        "role": "single-node",
        "config_version": 0,
    }


@pytest.mark.parametrize("is_leader, role", [(True, "primary"), (False, "standby")])
def test_clustered_status_reports_primary_or_standby(is_leader, role):
    doc = cluster_status(node_id="n:1:a", clustered=True, is_leader=is_leader, config_version=7)
    assert doc == {"node_id": "n:1:a", "clustered": True, "is_leader": is_leader, "role": role, "config_version": 7}
