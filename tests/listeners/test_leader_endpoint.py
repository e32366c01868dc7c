"""`GET /leader` (issue 24): 200 only on the node that holds the lease, has not fenced and has every
inbound bound; 503 with the reason otherwise. No token (a load balancer's `option httpchk`), and no
database round trip: it answers at once even while the database is unreachable."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import replace

import pytest
from twisted.internet import defer

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.lab.tcpproxy import TcpProxy
from include.app.supervisor import port_open
from listeners.metrics import Metrics
from listeners.state import NodeState
from tests.support.nodes import FENCE, fast_cluster, mllp_node


def state(**kw) -> NodeState:
    base = {
        "node_id": "n1",
        "clustered": True,
        "metrics": Metrics(),
        "is_leader": lambda: True,
        "config_version": lambda: 1,
        "nodes": lambda: defer.succeed({}),
    }
    return NodeState(**{**base, **kw})


@pytest.mark.parametrize(
    "kw, code, reason",
    [
        ({}, 200, None),
        ({"is_leader": lambda: False}, 503, "standby"),
        ({"is_leader": lambda: False, "fenced": lambda: True}, 503, "fenced"),
        ({"is_leader": lambda: False, "aside_seconds": lambda: 3.0}, 503, "standing_aside"),
        ({"serving": lambda: False, "unbound": lambda: [{"name": "adt-in", "reason": "in use"}]}, 503, "unbound"),
        ({"serving": lambda: False}, 503, "binding"),
    ],
)
def test_leader_answers_200_only_when_leading_unfenced_and_serving(kw, code, reason):
    got, doc = state(**kw).leader()
    assert got == code and doc.get("reason") == reason and doc["leader"] is (code == 200)
    if reason == "unbound":
        assert doc["unbound"] == ["adt-in"]


def get(port: int, path: str, *, method: str = "GET") -> tuple[int, dict, float]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            code, body = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        code, body = err.code, err.read()
    took = time.monotonic() - t0
    return code, (json.loads(body) if body else {}), took


def test_a_single_node_is_the_leader_without_a_token(tmp_path, sqlite_config_fresh):
    port = free_port()
    node = mllp_node(tmp_path / "n", sqlite_config_fresh, node_id="solo:1:aa", port=port)
    try:
        wait_for(lambda: port_open(port), timeout=10, what="MLLP bound")
        wait_for(lambda: get(node.api_port, "/leader")[0] == 200, timeout=5, what="/leader 200")
        assert get(node.api_port, "/leader")[:2] == (200, {"node_id": "solo:1:aa", "leader": True})
        assert get(node.api_port, "/leader", method="HEAD")[0] == 200
        assert get(node.api_port, "/leader", method="POST")[0] == 405
        assert get(node.api_port, "/cluster/status")[0] == 401  # the rest of the API still needs a token
        # per inbound: what a load balancer in front of one port asks
        assert get(node.api_port, "/leader?inbound=adt-in")[:2] == (
            200,
            {"node_id": "solo:1:aa", "inbound": "adt-in", "leader": True},
        )
        assert get(node.api_port, "/leader?inbound=nope")[:2] == (
            404,
            {"node_id": "solo:1:aa", "inbound": "nope", "leader": False, "reason": "unknown inbound"},
        )
        get(node.api_port, "/leader?inbound=nope")
        wait_for(
            lambda: "GET /leader?inbound='nope': no such inbound" in node.output(),
            timeout=5,
            what="the unknown inbound said",
        )
        assert node.output().count("no such inbound connection here") == 1  # once per name
        assert get(node.api_port, "/leader?inbound=a&inbound=b")[0] == 400
        assert get(node.api_port, "/leader?inbound=" + "x" * 201)[0] == 400
        assert get(node.api_port, "/leader?inbounds=adt-in")[0] == 400  # a misspelt field is not "every inbound"
        # health checks leave no access line (several a second per balancer); other requests do
        for _ in range(5):
            get(node.api_port, "/health")
            get(node.api_port, "/leader")
        get(node.api_port, "/cluster/status")
        wait_for(lambda: '"GET /cluster/status HTTP/1.1" 401' in node.output(), timeout=5, what="the access line")
        for _ in range(3):
            assert get(node.api_port, "/leader", method="HEAD")[0] == 200
            assert get(node.api_port, "/health", method="HEAD")[0] == 200
        out = node.output()
        assert '"GET /health HTTP/1.1" 200' not in out and '"GET /leader HTTP/1.1" 200' not in out
        assert "HEAD request" not in out and '"HEAD /leader' not in out  # no line, no Twisted warning
        assert '"GET /leader?inbound=...&inbound=... HTTP/1.1" 400' in out  # a malformed one is logged
    finally:
        node.stop()


def test_leader_per_inbound_follows_that_inbound_only():
    serves = {"adt-in": True, "drop": False}
    kept = state(
        serving=lambda: False,
        unbound=lambda: [{"name": "drop", "reason": "missing"}],
        serves=lambda name: serves.get(name),
    )
    assert kept.leader() == (503, {"node_id": "n1", "leader": False, "reason": "unbound", "unbound": ["drop"]})
    assert kept.leader("adt-in") == (200, {"node_id": "n1", "inbound": "adt-in", "leader": True})
    assert kept.leader("drop")[0] == 503 and kept.leader("drop")[1]["reason"] == "unbound"
    assert kept.leader("other")[0] == 404
    standby = state(is_leader=lambda: False, serves=lambda name: True)
    assert standby.leader("adt-in")[0] == 503 and standby.leader("adt-in")[1]["reason"] == "standby"


CLUSTER = fast_cluster()


def test_only_the_serving_leader_answers_200_and_a_partitioned_leader_turns_503_fenced_at_once(
    tmp_path, pg_config_fresh, pg_server
):
    port = free_port()
    proxy = TcpProxy(pg_server.host, pg_server.port).start()
    a = mllp_node(
        tmp_path / "a", replace(pg_config_fresh, port=proxy.port), node_id="node-a:1:aa", port=port, cluster=CLUSTER
    )
    b = None
    try:
        wait_for(lambda: get(a.api_port, "/leader")[0] == 200, timeout=15, what="node A to lead and serve")
        assert port_open(port)
        b = Daemon(
            tmp_path / "b", pg_config_fresh, node_id="node-b:2:bb", cluster=CLUSTER, config_dir=a.workdir / "config"
        ).start()
        wait_for(lambda: b.status()["role"] == "standby", timeout=15, what="node B to stand by")
        assert get(b.api_port, "/leader")[:2] == (503, {"node_id": "node-b:2:bb", "leader": False, "reason": "standby"})
        assert get(a.api_port, "/leader")[0] == 200

        t0 = time.monotonic()
        proxy.cut()  # A can no longer reach the database
        answers: list[tuple[float, int, str | None, float]] = []
        while time.monotonic() - t0 < FENCE + 1.0:
            code, doc, took = get(a.api_port, "/leader")
            answers.append((time.monotonic() - t0, code, doc.get("reason"), took))
            time.sleep(0.02)
        slowest = max(took for *_, took in answers)
        fenced_at = next(t for t, code, reason, _ in answers if code == 503)
        print(
            f"partition: A's /leader turned 503 {fenced_at:.2f}s after the cut (fence {FENCE}s); "
            f"slowest answer {slowest * 1000:.0f} ms over {len(answers)} requests"
        )
        assert slowest < 0.25  # in memory: a cut database does not slow it down
        assert fenced_at <= FENCE + 0.3
        assert {reason for t, code, reason, _ in answers if code == 503} == {"fenced"}
        assert all(code == 503 for t, code, _, _ in answers if t > fenced_at)

        wait_for(lambda: get(b.api_port, "/leader")[0] == 200, timeout=10, interval=0.02, what="node B to serve")
        assert get(a.api_port, "/leader")[0] == 503
        proxy.restore()
        wait_for(
            lambda: get(a.api_port, "/leader")[1].get("reason") == "standby",
            timeout=15,
            what="node A back as a standby",
        )
    finally:
        for node in (a, b):
            if node is not None:
                node.stop()
        proxy.stop()
