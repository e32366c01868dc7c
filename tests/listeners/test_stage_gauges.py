"""The leader's listenerd publishes the stages at a glance on /metrics (what deploy/alerts.yml reads):
backlog, oldest pending age, in flight and dead letters per stage, from the store itself."""

from __future__ import annotations

import re

from hl7.client import MLLPClient

from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from tests.support.hostile import adt
from tests.support.nodes import mllp_node


def gauge(text: str, name: str, stage: str) -> float | None:
    found = re.search(rf'^{name}{{stage="{stage}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_the_leader_publishes_stage_backlog_age_and_dead_letters(tmp_path, store_config):
    port = free_port()
    d = mllp_node(
        tmp_path / "node",
        store_config,
        node_id="solo:1:aa",
        port=port,
        cluster={"heartbeat_seconds": 0.5, "leader_fence_timeout_seconds": 1.5, "leader_lease_ttl_seconds": 2.5},
    )
    try:
        wait_for(lambda: port_open(port), timeout=20, what="bind")
        with MLLPClient("127.0.0.1", port) as client:
            for n in range(3):
                client.send_message(adt(f"G{n}").decode())

        def metrics() -> str:
            return d.get("/metrics")[1].decode()

        wait_for(
            lambda: gauge(metrics(), "stageline_stage_backlog", "inbound") == 3,
            timeout=30,
            interval=0.5,
            what="the inbound backlog gauge to show the 3 staged messages",
        )
        text = metrics()
        assert gauge(text, "stageline_stage_oldest_pending_seconds", "inbound") >= 0
        assert gauge(text, "stageline_stage_in_flight", "inbound") == 0
        assert gauge(text, "stageline_stage_dead_letters", "outbound") == 0
        assert gauge(text, "stageline_stage_backlog", "routed") == 0
    finally:
        d.stop()
