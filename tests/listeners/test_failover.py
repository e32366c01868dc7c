"""Two listenerd processes on one PostgreSQL: only the leader binds the data port; SIGKILL,
SIGTERM and a database partition each hand the port to the standby in the documented time, the
partitioned leader fences itself before the standby can take over, and no ACKed message is lost.
Both nodes run the same config dir (same port: only the leader binds it, like a VIP)."""

from __future__ import annotations

import signal
import time
from dataclasses import replace

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.lab.tcpproxy import TcpProxy
from include.app.supervisor import port_open
from include.store import Store
from tests.listeners.hl7_traffic import Sender
from tests.support.nodes import FENCE, HEARTBEAT, TTL, fast_cluster

CLUSTER = fast_cluster()
SLACK = 0.6  # supervisor tick, process scheduling and the poll interval of the measurement


@pytest.fixture
def pair(tmp_path, pg_config_fresh, pg_server):
    port = free_port()
    proxy = TcpProxy(pg_server.host, pg_server.port).start()
    a = Daemon(
        tmp_path / "a",
        replace(pg_config_fresh, port=proxy.port),
        node_id="node-a:1:aa",
        cluster=CLUSTER,
        inbound=[{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": port}],
    ).start()
    wait_for(lambda: a.status()["is_leader"] and port_open(port), timeout=15, what="node A to lead")
    b = Daemon(
        tmp_path / "b", pg_config_fresh, node_id="node-b:2:bb", cluster=CLUSTER, config_dir=a.workdir / "config"
    ).start()
    wait_for(lambda: b.status()["role"] == "standby", timeout=15, what="node B to stand by")
    yield a, b, port, proxy, pg_config_fresh
    for d in (a, b):
        d.stop()
    proxy.stop()


def acked_are_staged(sender: Sender, store_config) -> None:
    store = Store(store_config)
    try:
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute("SELECT control_id FROM stage_inbound")
            staged = {r["control_id"] for r in cur.fetchall()}
    finally:
        store.close()
    missing = sorted(set(sender.acked) - staged)
    assert missing == [], f"{len(missing)} ACKed message(s) lost"
    assert len(sender.acked) > 20


def test_only_the_leader_binds_and_both_report_the_same_leader(pair):
    a, b, _port, _, _ = pair
    assert (a.status()["role"], b.status()["role"]) == ("primary", "standby")
    assert b"stageline_listeners_bound 0.0" in b.get("/metrics")[1]
    assert b"stageline_listeners_bound 1.0" in a.get("/metrics")[1]
    for node in (a, b):
        wait_for(
            lambda: __import__("json").loads(node.get("/cluster/nodes")[1])["leader_node_id"] == "node-a:1:aa",
            timeout=5,
            what="membership view",
        )
    assert "cannot bind" not in b.output()


def handover_seconds(pair, prefix: str, act) -> float:
    """Traffic flows, `act()` hits the leader; seconds until the standby leads and holds the port.
    Checks afterwards that every message ACKed during the whole exercise was staged."""
    _a, b, port, _, store_config = pair
    sender = Sender(port, prefix=prefix)
    sender.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    act()
    wait_for(lambda: port_open(port) and b.status()["is_leader"], timeout=15, interval=0.02, what="takeover")
    took = time.monotonic() - t0
    time.sleep(1.0)
    sender.stop()
    acked_are_staged(sender, store_config)
    return took


def test_sigkill_of_the_leader_hands_over_within_ttl_plus_heartbeat(pair):
    took = handover_seconds(pair, "K", pair[0].kill)
    print(f"SIGKILL failover: standby bound the port {took:.2f}s after the kill (TTL {TTL}s + heartbeat {HEARTBEAT}s)")
    assert took <= TTL + HEARTBEAT + SLACK


def test_sigterm_of_the_leader_hands_over_within_about_one_heartbeat(pair):
    a = pair[0]
    took = handover_seconds(pair, "T", lambda: a.signal(signal.SIGTERM))
    assert a.stop() == 0
    print(f"SIGTERM failover: standby bound the port {took:.2f}s after the signal (heartbeat {HEARTBEAT}s)")
    assert took <= HEARTBEAT + SLACK


def test_a_partitioned_leader_fences_itself_before_the_standby_takes_over(pair):
    a, b, port, proxy, store_config = pair
    sender = Sender(port, prefix="P")
    sender.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    proxy.cut()
    wait_for(lambda: not a.status()["is_leader"], timeout=10, interval=0.02, what="self-fence")
    fenced = time.monotonic() - t0
    wait_for(lambda: b.status()["is_leader"], timeout=10, interval=0.02, what="takeover")
    took_over = time.monotonic() - t0
    wait_for(lambda: port_open(port), timeout=5, interval=0.02, what="new leader binding")
    time.sleep(1.0)
    sender.stop()
    print(
        f"partition: old leader fenced after {fenced:.2f}s (fence {FENCE}s), standby took over after "
        f"{took_over:.2f}s (TTL {TTL}s)"
    )
    assert fenced <= FENCE + SLACK
    assert took_over >= TTL - HEARTBEAT  # the lease had to expire on the DB clock first
    assert fenced < took_over
    acked_are_staged(sender, store_config)
    proxy.restore()
    wait_for(
        lambda: a.status()["role"] == "standby" and b.status()["role"] == "primary", timeout=30, what="healed cluster"
    )


def test_sighup_reload_bumps_the_shared_config_version_and_every_node_converges(pair):
    a, b, _port, _, _ = pair
    extra = free_port()
    conf = a.workdir / "config" / "connections.toml"
    conf.write_text(
        conf.read_text() + f'\n[[inbound]]\nname = "orders-in"\nkind = "mllp"\nhost = "127.0.0.1"\nport = {extra}\n'
    )
    a.signal(signal.SIGHUP)
    wait_for(
        lambda: a.status()["config_version"] == 1 and b.status()["config_version"] == 1,
        timeout=10,
        what="both nodes on config version 1",
    )
    wait_for(lambda: port_open(extra), timeout=10, what="the leader to bind the new connection")
    assert b"stageline_listeners_bound 0.0" in b.get("/metrics")[1]  # the standby still binds nothing
    assert "reloading the config dir" in b.output()


def test_a_node_running_a_different_config_is_reported_loudly(pair, tmp_path):
    import json

    a, b, port, _, store_config = pair
    c = Daemon(
        tmp_path / "c",
        store_config,
        node_id="node-c:3:cc",
        cluster=CLUSTER,
        inbound=[{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": port, "max_connections": 5}],
    )
    c.start()
    try:
        wait_for(lambda: b"stageline_config_mismatch 1.0" in c.get("/metrics")[1], timeout=10, what="mismatch metric")
        assert "CONFIG MISMATCH" in c.output()
        nodes = json.loads(a.get("/cluster/nodes")[1])
        assert nodes["config_mismatch"] == ["node-c:3:cc"]
        assert b"stageline_config_mismatch 0.0" in b.get("/metrics")[1]
    finally:
        c.stop()
