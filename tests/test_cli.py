"""The `stageline` command, run as a real subprocess against real stores."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from include.store import Store
from include.store.lease import LeaderElector
from include.store.membership import NodeIdentity, heartbeat
from tests.conftest import pg_config

STAGELINE = [sys.executable, "-m", "include.cli"]
ROOT = Path(__file__).resolve().parents[1]


def run(cfg: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*STAGELINE, "--service-config", str(cfg), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert (proc.returncode == 0) is ok, proc.stderr
    return proc


def test_embedded_default_migrates_and_reports_single_node(tmp_path):
    cfg = tmp_path / "stageline.toml"
    cfg.write_text('[store]\npath = "var/s.db"\n')
    assert "applied: 1" in run(cfg, "db", "migrate").stdout
    assert "already current" in run(cfg, "db", "migrate").stdout
    status = json.loads(run(cfg, "cluster", "status").stdout)
    assert (status["clustered"], status["role"], status["config_version"]) == (False, "single-node", 0)
    assert (tmp_path / "var" / "s.db").exists()


def test_cluster_commands_on_postgres_show_the_live_leader(tmp_path, pg_config_fresh, monkeypatch):
    c = pg_config_fresh
    cfg = tmp_path / "stageline.toml"
    cfg.write_text(f'[store]\nbackend = "postgres"\nserver = "{c.server}"\nport = {c.port}\ndatabase = "{c.database}"\n'
                   f'username = "{c.username}"\n[cluster]\nenabled = true\ncluster_name = "test-cluster"\n'
                   'node_id = "node-a:1:aa"\nheartbeat_seconds = 1\nleader_fence_timeout_seconds = 2\n'
                   'leader_lease_ttl_seconds = 3\nnode_timeout_seconds = 5\n')
    store = Store(c)
    LeaderElector(store, node_id="node-a:1:aa", ttl_seconds=30, fence_timeout_seconds=20).step()
    heartbeat(store, NodeIdentity.of("node-a:1:aa"), is_leader=True)
    store.close()
    assert json.loads(run(cfg, "cluster", "status").stdout) == {
        "node_id": "node-a:1:aa", "clustered": True, "is_leader": True, "role": "primary", "config_version": 0}
    nodes = json.loads(run(cfg, "cluster", "nodes").stdout)
    assert nodes["leader_node_id"] == nodes["lease_owner"] == "node-a:1:aa"


def test_a_bad_config_and_a_foreign_store_fail_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\nbackend = "sqlite"\n[cluster]\nenabled = true\n')
    assert "needs [store].backend" in run(bad, "db", "migrate", ok=False).stderr
    one = tmp_path / "one.toml"
    one.write_text('[store]\npath = "s.db"\n[cluster]\ncluster_name = "one"\n')
    two = tmp_path / "two.toml"
    two.write_text('[store]\npath = "s.db"\n[cluster]\ncluster_name = "two"\n')
    run(one, "db", "migrate")
    err = run(two, "cluster", "status", ok=False).stderr
    assert "belongs to cluster 'one'" in err and "'two'" in err
