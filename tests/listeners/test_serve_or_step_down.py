"""Leadership means serving (issue 24): a leader that cannot bind an inbound retries it with a short
backoff, says so once per state change (log, /cluster/status, metrics), and, in a cluster, steps
down past its grace so that a node that can serve leads; a single node keeps retrying.

The gate and the elector are proven here piece by piece (a fake clock, real SQLite), then end to
end with real listenerd processes, a real foreign socket holding the port and real MLLP senders:
one node on SQLite, and two nodes on one PostgreSQL."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import globalLogPublisher

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.store import Store
from include.store.lease import LeaderElector, Outcome, read_lease
from listeners.connections_config import InboundConfig
from listeners.endpoints import InboundService, Wiring
from listeners.gate import RETRY_FIRST, RETRY_MAX, LeaderGate
from listeners.metrics import Metrics
from tests.listeners.hl7_traffic import Sender, ack_fields, adt
from tests.support.nodes import HEARTBEAT, fast_cluster, mllp_node

# --- the gate, on a fake clock --------------------------------------------------------------------


class FakeIngest:
    def drain(self, seconds: float) -> Deferred[bool]:
        return succeed(True)


class Endpoint(InboundService):
    """Binds unless its name is in `held` (then it fails the way a held port does)."""

    def __init__(self, conn: InboundConfig, wiring: Wiring, h: Harness) -> None:
        super().__init__(conn, wiring)
        self.h = h

    def startService(self) -> None:
        Service.startService(self)
        self.h.attempts.append((self.name, self.h.clock.seconds()))
        if self.name in self.h.held:
            self.bind_error = self.h.held[self.name]
            return
        self.bound = True
        self.h.events.append(f"bind {self.name}")

    def stop_intake(self) -> Deferred[None]:
        if self.bound:
            self.bound = False
            self.h.events.append(f"stop intake {self.name}")
        return succeed(None)

    def close(self, abort: bool) -> None:
        self.h.events.append(f"{'abort' if abort else 'close'} {self.name}")

    def open_connections(self) -> int:
        return 0


class Harness:
    def __init__(self, *, clustered: bool, grace: float = 1.0) -> None:
        self.clock = MemoryReactorClock()
        self.leader = True
        self.held: dict[str, str] = {"a": "Couldn't listen on 127.0.0.1:2575: [Errno 98] Address already in use."}
        self.attempts: list[tuple[str, float]] = []
        self.events: list[str] = []
        self.step_downs = 0
        self.metrics = Metrics()
        wiring = Wiring(ingest=FakeIngest(), metrics=self.metrics, reactor=self.clock, bound_ports={})  # type: ignore[arg-type]
        self.conns = (InboundConfig("a", "mllp"), InboundConfig("b", "tcp"))
        self.gate = LeaderGate(
            is_leader=lambda: self.leader,
            connections=lambda: self.conns,
            build=lambda conn: Endpoint(conn, wiring, self),
            drain=self.drain,
            reactor=self.clock,
            supervise_seconds=0.05,
            grace_seconds=grace,
            step_down=self.step_down if clustered else None,
            may_step_down=self.may_step_down if clustered else None,
            on_bind=self.metrics.inbound_bind,
        )
        self.why_not: str | None = None  # what may_step_down answers
        self.asked: list[float] = []

    def drain(self, seconds: float) -> Deferred[bool]:
        self.events.append("drain")
        return succeed(True)

    def may_step_down(self, names: list[str]) -> Deferred[str | None]:
        self.asked.append(self.clock.seconds())
        return succeed(self.why_not)

    def step_down(self, names: list[str]) -> Deferred[bool]:
        self.step_downs += 1
        self.events.append("release lease")
        self.leader = False  # what the elector's release does to is_leader
        return succeed(True)

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / 0.05)):
            self.clock.advance(0.05)

    def metric(self, text: str) -> bool:
        return text.encode() in self.metrics.render()


@pytest.fixture
def gate_log():
    """The gate's log events, as (level, text)."""
    from twisted.logger import formatEvent

    seen: list[tuple[str, str]] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "stageline.gate":
            seen.append((event["log_level"].name, formatEvent(event)))

    globalLogPublisher.addObserver(observe)
    yield seen
    globalLogPublisher.removeObserver(observe)


def test_an_unbound_inbound_is_retried_with_a_doubling_backoff_and_logged_once_per_state_change(gate_log):
    h = Harness(clustered=False)
    h.gate.startService()
    h.run(8.0)
    tries = [t for name, t in h.attempts if name == "a"]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) >= 6
    assert gaps[0] == pytest.approx(RETRY_FIRST, abs=0.06)
    assert all(b >= a - 1e-6 for a, b in zip(gaps, gaps[1:]))  # doubling ...
    assert max(gaps) == pytest.approx(RETRY_MAX, abs=0.06)  # ... up to RETRY_MAX
    assert h.events == ["bind b"]  # the other inbound serves meanwhile
    [doc] = h.gate.unbound()
    assert doc["name"] == "a" and "Address already in use" in doc["reason"] and doc["attempts"] == len(tries)
    assert not h.gate.serving
    assert h.metric('stageline_inbound_bound{connection="a"} 0.0')
    assert h.metric('stageline_inbound_bound{connection="b"} 1.0')
    assert h.metric(f'stageline_inbound_bind_failures_total{{connection="a"}} {float(len(tries))}')
    cannot = [text for _, text in gate_log if text.startswith("cannot bind inbound a")]
    assert len(cannot) == 1, gate_log  # one line for the state change, none per retry

    del h.held["a"]  # the port is freed
    h.run(RETRY_MAX + 0.1)
    assert h.gate.serving and h.gate.unbound() == [] and h.gate.bound == 2
    assert h.metric('stageline_inbound_bound{connection="a"} 1.0')
    assert len([t for _, t in gate_log if t.startswith("inbound a bound after")]) == 1


def test_a_changed_reason_is_one_more_log_line(gate_log):
    h = Harness(clustered=False, grace=60.0)
    h.gate.startService()
    h.run(1.0)
    h.held["a"] = "Couldn't listen on 10.0.0.9:2575: [Errno 99] Cannot assign requested address."
    h.run(3.0)
    assert [t.split(":")[0] for _, t in gate_log if "inbound a" in t] == [
        "cannot bind inbound a (mllp 127.0.0.1",
        "inbound a still unbound, now",
    ]
    assert "Cannot assign" in h.gate.unbound()[0]["reason"]


def test_a_single_node_never_steps_down_and_says_so_loudly_past_the_grace(gate_log):
    h = Harness(clustered=False, grace=1.0)
    h.gate.startService()
    h.run(10.0)
    assert h.step_downs == 0 and h.gate.up and h.events == ["bind b"]
    loud = [t for level, t in gate_log if level == "critical"]
    assert len(loud) == 1 and loud[0].startswith("NOT SERVING inbound a")
    assert len([name for name, _ in h.attempts if name == "a"]) >= 7  # still retrying


def test_a_clustered_leader_steps_down_past_the_grace_after_an_ordered_stop():
    h = Harness(clustered=True, grace=1.0)
    h.gate.startService()
    h.run(0.9)
    assert h.step_downs == 0
    h.run(0.3)
    assert h.step_downs == 1
    assert h.events == ["bind b", "stop intake b", "drain", "close b", "release lease"]
    assert not h.gate.up and list(h.gate) == [] and h.gate.unbound() == []
    assert h.metric('stageline_inbound_bound{connection="b"} 0.0')
    h.run(5.0)
    assert h.step_downs == 1 and h.events[-1] == "release lease"  # not leading: nothing binds again


def test_a_leader_keeps_the_lease_while_handing_over_cannot_help_and_asks_again_a_grace_later(gate_log):
    h = Harness(clustered=True, grace=1.0)
    h.why_not = "no other live node to hand over to"
    h.gate.startService()
    h.run(1.2)
    assert h.step_downs == 0 and h.gate.up and h.events == ["bind b"]  # b still served
    assert len(h.asked) == 1
    loud = [t for level, t in gate_log if level == "critical"]
    assert len(loud) == 1 and "no other live node to hand over to" in loud[0] and "keeps retrying" in loud[0]
    h.run(1.0)
    assert len(h.asked) == 2 and h.step_downs == 0  # asked again a grace later; nothing new logged
    assert len([t for level, t in gate_log if level == "critical"]) == 1
    h.why_not = None  # a node that could serve came up
    h.run(1.0)
    assert h.step_downs == 1 and h.events[-1] == "release lease"


class Flappy(Endpoint):
    """Binds, then fails at work whenever `h.broken` (a drop whose directory comes and goes)."""

    def failing(self) -> str | None:
        return "FileNotFoundError (errno 2)" if self.bound and self.h.broken else None

    def proven(self) -> bool:
        return self.bound and not self.h.broken


def test_an_inbound_that_flaps_keeps_the_clock_of_its_first_failure_and_reaches_its_grace(gate_log):
    h = Harness(clustered=True, grace=2.0)
    h.held = {}
    h.broken = False
    wiring = Wiring(ingest=FakeIngest(), metrics=h.metrics, reactor=h.clock, bound_ports={})  # type: ignore[arg-type]
    h.gate._build = lambda conn: (Flappy if conn.name == "a" else Endpoint)(conn, wiring, h)
    h.gate.startService()
    h.run(0.2)
    assert h.gate.serving
    for _ in range(4):  # broken 0.4 s, working 0.3 s: never a whole grace either way
        h.broken = True
        h.run(0.4)
        h.broken = False
        h.run(0.3)
    assert h.step_downs == 1, "a flapping inbound reached its grace"
    errors = [t for level, t in gate_log if level == "error" and "inbound a" in t]
    assert len(errors) <= 2, errors  # its first failure (and the step-down), not one line per flap


def test_a_flapping_inbound_that_then_works_a_whole_grace_is_healthy_again(gate_log):
    h = Harness(clustered=False, grace=1.0)
    h.held = {}
    h.broken = False
    wiring = Wiring(ingest=FakeIngest(), metrics=h.metrics, reactor=h.clock, bound_ports={})  # type: ignore[arg-type]
    h.gate._build = lambda conn: Flappy(conn, wiring, h)
    h.gate.startService()
    h.run(0.2)
    h.broken = True
    h.run(0.3)
    assert {u["name"] for u in h.gate.unbound()} == {"a", "b"} and not h.gate.serving
    h.broken = False
    h.run(2.0)
    assert h.gate.serving and h.gate.unbound() == []
    assert any("works again" in t for _, t in gate_log)


# --- the elector's step-down: release, then no acquiring for the backoff (real SQLite) --------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_node_that_stood_aside_takes_no_lease_during_its_backoff_but_another_node_does(sqlite_config_fresh):
    store = Store(sqlite_config_fresh)
    try:
        clock = FakeClock()
        a = LeaderElector(store, node_id="a", ttl_seconds=30, fence_timeout_seconds=20, clock=clock)
        b = LeaderElector(store, node_id="b", ttl_seconds=30, fence_timeout_seconds=20, clock=FakeClock())
        first = a.step()
        assert first.outcome is Outcome.ELECTED
        assert a.stand_aside(60.0) is True
        assert not a.is_leader and a.aside_seconds == 60.0
        assert not read_lease(store).live  # released: the lease expired at once
        again = a.step()
        assert again.outcome is Outcome.STANDING_ASIDE and not a.is_leader  # the free lease is not taken
        assert read_lease(store).epoch == first.epoch
        took = b.step()
        assert took.outcome is Outcome.ELECTED and took.epoch == first.epoch + 1
        clock.now += 61.0
        assert a.step().outcome is Outcome.OTHER_LEADER  # the backoff over: an ordinary candidate again
        assert b.step().outcome is Outcome.ALREADY_LEADER
    finally:
        store.close()


# --- real processes ------------------------------------------------------------------------------


def hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


def send_one(port: int, control_id: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"\x0b" + adt(control_id).encode() + b"\x1c\r")
        data = b""
        while not data.endswith(b"\x1c\r"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    code, msa2 = ack_fields(data)
    assert msa2 == control_id
    return code


def leader(node: Daemon) -> tuple[int, dict]:
    code, body = node.get("/leader", token=None)
    return code, json.loads(body)


def metrics(node: Daemon) -> str:
    return node.get("/metrics")[1].decode()


def test_single_node_port_held_at_start_reports_it_then_binds_within_1s_of_the_port_freeing(
    tmp_path, sqlite_config_fresh
):
    port = free_port()
    holder = hold(port)
    node = mllp_node(tmp_path / "node", sqlite_config_fresh, node_id="solo:1:aa", port=port)
    try:
        wait_for(lambda: node.status()["unbound"], timeout=10, what="the unbound inbound reported")
        [unbound] = node.status()["unbound"]
        assert unbound["name"] == "adt-in" and "in use" in unbound["reason"] and unbound["since"].endswith("Z")
        assert leader(node) == (
            503,
            {"node_id": "solo:1:aa", "leader": False, "reason": "unbound", "unbound": ["adt-in"]},
        )
        assert 'stageline_inbound_bound{connection="adt-in"} 0.0' in metrics(node)
        time.sleep(3.0)  # several retries (at most RETRY_MAX apart) ...
        assert node.output().count("cannot bind inbound adt-in") == 1  # ... one line
        assert node.status()["unbound"][0]["attempts"] >= 3
        assert node.status()["is_leader"]  # a single node never steps down

        holder.close()
        t0 = time.monotonic()
        wait_for(lambda: leader(node)[0] == 200, timeout=5, interval=0.02, what="/leader 200")
        took = time.monotonic() - t0
        print(f"single node: bound {took:.2f}s after the port was freed")
        assert took <= 1.0  # the retries are at most RETRY_MAX (0.8 s) apart, on a 0.1 s supervisor tick
        assert leader(node) == (200, {"node_id": "solo:1:aa", "leader": True})
        assert node.status()["unbound"] == []
        assert send_one(port, "SOLO-1") == "AA"
        assert 'stageline_inbound_bound{connection="adt-in"} 1.0' in metrics(node)
        assert "inbound adt-in bound after" in node.output()
    finally:
        holder.close()
        node.stop()


GRACE, BACKOFF = 1.5, 8.0
CLUSTER = fast_cluster(unbound_grace_seconds=GRACE, step_down_backoff_seconds=BACKOFF)

HOLDER = """import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(1)
print("held", flush=True); time.sleep(600)
"""


def test_a_leader_whose_port_is_held_steps_down_and_a_node_that_can_serve_takes_over(tmp_path, pg_config_fresh):
    port_a, port_b = free_port(), free_port()
    foreign = subprocess.Popen([sys.executable, "-c", HOLDER, str(port_a)], stdout=subprocess.PIPE, text=True)
    a = b = None
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().strip() == "held"
        a = mllp_node(tmp_path / "a", pg_config_fresh, node_id="node-a:1:aa", port=port_a, cluster=CLUSTER)
        wait_for(lambda: a.status()["is_leader"], timeout=15, interval=0.02, what="node A to lead")
        elected = time.monotonic()
        a_epoch = read_epoch(pg_config_fresh)
        # a standby that can serve (its own port is free): what makes a step-down worth it
        b = mllp_node(tmp_path / "b", pg_config_fresh, node_id="node-b:2:bb", port=port_b, cluster=CLUSTER)
        wait_for(lambda: b.status()["role"] == "standby", timeout=15, interval=0.02, what="node B to stand by")
        b_live = time.monotonic()
        wait_for(lambda: not a.status()["is_leader"], timeout=GRACE + 10, interval=0.02, what="node A to step down")
        stepped = time.monotonic() - elected
        print(
            f"bind conflict: node A stepped down {stepped:.2f}s after its election, "
            f"{time.monotonic() - b_live:.2f}s after node B stood by (grace {GRACE}s)"
        )
        # past its grace A asks whether anyone could take over; with B live it hands over at once
        # (before B was live it kept the lease and asked again a grace later)
        assert time.monotonic() - b_live <= GRACE + 1.0
        assert "stepping down: inbound adt-in unbound" in a.output()
        wait_for(lambda: "stepped down: lease released" in a.output(), timeout=5, what="the release logged")
        code, doc = leader(a)
        assert code == 503 and doc["reason"] == "standing_aside"
        assert a.status()["standing_aside_seconds"] > 0
        assert "stageline_step_downs_total 1.0" in metrics(a)

        wait_for(
            lambda: leader(b)[0] == 200 and port_open(port_b),
            timeout=10,
            interval=0.02,
            what="node B to lead and serve",
        )
        b_epoch = read_epoch(pg_config_fresh)
        assert b_epoch == a_epoch + 1
        assert a.status()["standing_aside_seconds"] > 0  # B is live: A's backoff runs its course
        sender = Sender(port_b, prefix="B")
        sender.start()
        time.sleep(1.0)
        sender.stop()
        sender.join(10)
        assert len(sender.acked) > 10 and sender.nacked == []
        assert send_one(port_b, "B-LAST") == "AA"

        # A's backoff ends: B's lease is live, so A stays a standby
        remaining = BACKOFF - (time.monotonic() - elected - stepped)
        time.sleep(max(0.0, remaining) + 2 * HEARTBEAT)
        assert not a.status()["is_leader"] and leader(a)[1]["reason"] == "standby"
        assert b.status()["is_leader"] and read_epoch(pg_config_fresh) == b_epoch

        # no write under an old epoch: every event was written by B under B's epoch
        writers = events_by_writer(pg_config_fresh)
        assert writers == {("node-b:2:bb", b_epoch)}, writers
    finally:
        for node in (a, b):
            if node is not None:
                node.stop()
        foreign.kill()
        foreign.wait(5)


def read_lease_state(store_config):
    store = Store(store_config)
    try:
        return read_lease(store)
    finally:
        store.close()


def read_epoch(store_config) -> int:
    return read_lease_state(store_config).epoch


def events_by_writer(store_config) -> set[tuple[str, int]]:
    store = Store(store_config)
    try:
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute("SELECT DISTINCT node_id, epoch FROM message_events")
            return {(r["node_id"], int(r["epoch"])) for r in cur.fetchall()}
    finally:
        store.close()


def test_a_missing_file_drop_directory_is_an_unbound_inbound_until_it_appears(tmp_path):
    from listeners.endpoints import inbound_service

    clock: Any = MemoryReactorClock()
    clock.getThreadPool = lambda: None  # no poll runs on this clock
    metrics = Metrics()
    wiring = Wiring(ingest=FakeIngest(), metrics=metrics, reactor=clock, bound_ports={})  # type: ignore[arg-type]
    drop = tmp_path / "mnt" / "in"
    conn = InboundConfig(
        "drop",
        "file",
        directory=str(drop),
        archive=str(tmp_path / "archive"),
        error_directory=str(tmp_path / "rejected"),
    )
    gate = LeaderGate(
        is_leader=lambda: True,
        connections=lambda: (conn,),
        build=lambda c: inbound_service(c, wiring),
        drain=lambda s: succeed(True),
        reactor=clock,
        supervise_seconds=0.05,
        grace_seconds=60,
    )
    gate.startService()
    clock.advance(0.05)
    [unbound] = gate.unbound()
    assert unbound["name"] == "drop" and "missing or unusable" in unbound["reason"] and not gate.serving
    drop.mkdir(parents=True)  # mounted
    for _ in range(20):
        clock.advance(0.05)
    assert gate.serving and gate.unbound() == [] and gate.bound == 1


def test_a_lone_clustered_node_keeps_the_lease_and_serves_within_1s_of_its_port_freeing(tmp_path, pg_config_fresh):
    """No other node is live: a step-down would leave the lease unowned for a backoff, so the node keeps
    it, says why, and binds as soon as the port frees (as a single node does)."""
    port = free_port()
    holder = hold(port)
    node = mllp_node(tmp_path / "a", pg_config_fresh, node_id="lone-a:1:aa", port=port, cluster=CLUSTER)
    try:
        wait_for(
            lambda: "no other live node to hand over to" in node.output(),
            timeout=GRACE + 10,
            what="the kept lease logged",
        )
        assert node.status()["is_leader"] and "standing_aside_seconds" not in node.status()
        assert "stageline_step_downs_total 0.0" in metrics(node)
        assert leader(node)[1]["reason"] == "unbound"
        holder.close()
        t0 = time.monotonic()
        wait_for(lambda: leader(node)[0] == 200, timeout=5, interval=0.02, what="/leader 200")
        took = time.monotonic() - t0
        print(f"lone clustered node: bound {took:.2f}s after the port was freed")
        assert took <= 1.0
        assert send_one(port, "LONE-1") == "AA"
    finally:
        holder.close()
        node.stop()


def test_when_no_node_can_bind_an_inbound_the_lease_stops_going_round_and_the_rest_is_served(tmp_path, pg_config_fresh):
    """Every node's file-drop share is missing (the same mount on every node): the first leader hands
    over (its peer published nothing yet), the next finds in the store that its peer could not bind
    it either and keeps the lease, serving its MLLP inbound; a load balancer asking
    `/leader?inbound=adt-in` keeps that node in the VIP while `/leader` reports the drop."""
    nodes = []
    try:
        for name in ("a", "b"):
            port = free_port()
            nodes.append(
                (
                    Daemon(
                        tmp_path / name,
                        pg_config_fresh,
                        node_id=f"node-{name}:1:{name}{name}",
                        cluster=CLUSTER,
                        inbound=[
                            {"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": port},
                            {
                                "name": "drop",
                                "kind": "file",
                                "directory": str(tmp_path / "mnt" / "in"),
                                "archive": str(tmp_path / name / "archive"),
                                "error_directory": str(tmp_path / name / "rejected"),
                            },
                        ],
                    ).start(),
                    port,
                )
            )

        def settled() -> bool:  # (a node that led before its peer was live kept the lease for a grace first)
            return any(leader_of(d, "adt-in")[0] == 200 and "could not bind it either" in d.output() for d, _ in nodes)

        def leader_of(d: Daemon, inbound: str) -> tuple[int, dict]:
            code, body = d.get(f"/leader?inbound={inbound}", token=None)
            return code, json.loads(body)

        wait_for(settled, timeout=3 * (GRACE + BACKOFF) + 10, interval=0.1, what="a leader that keeps the lease")
        [(serving, port)] = [(d, p) for d, p in nodes if d.status()["is_leader"]]
        epoch = read_epoch(pg_config_fresh)
        assert send_one(port, "KEPT-1") == "AA"
        assert leader_of(serving, "drop")[0] == 503
        code, doc = leader(serving)
        assert code == 503 and doc["unbound"] == ["drop"]
        assert leader_of(serving, "nope")[0] == 404
        time.sleep(2 * (GRACE + BACKOFF))  # it stays put: no more step-downs, the same epoch
        assert serving.status()["is_leader"] and read_epoch(pg_config_fresh) == epoch
        downs = [
            float(line.split()[-1])
            for d, _ in nodes
            for line in metrics(d).splitlines()
            if line.startswith("stageline_step_downs_total")
        ]
        print(f"no node can bind the drop: step-downs per node {downs}")
        assert sorted(downs) == [0.0, 1.0]  # one hand-over in all
        assert send_one(port, "KEPT-2") == "AA"
    finally:
        for d, _ in nodes:
            d.stop()


def test_a_file_drop_that_breaks_after_it_bound_is_reported_unbound_and_taken_again_once_back(
    tmp_path, sqlite_config_fresh
):
    """The drop's directory is removed, then replaced by a symlink, while the node leads: the inbound is
    reported unbound (status, /leader, metric) from the poll that failed, and serves again once the
    real directory is back."""
    drop = tmp_path / "in"
    drop.mkdir()
    node = Daemon(
        tmp_path / "node",
        sqlite_config_fresh,
        node_id="solo:1:dd",
        inbound=[
            {
                "name": "drop",
                "kind": "file",
                "directory": str(drop),
                "poll_seconds": 0.2,
                "archive": str(tmp_path / "archive"),
                "error_directory": str(tmp_path / "rejected"),
            }
        ],
    ).start()
    try:
        wait_for(lambda: leader(node)[0] == 200, timeout=10, what="the drop bound")
        drop.rmdir()
        wait_for(lambda: node.status()["unbound"], timeout=5, interval=0.05, what="the lost drop reported")
        assert leader(node)[1]["unbound"] == ["drop"]
        assert 'stageline_inbound_bound{connection="drop"} 0.0' in metrics(node)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "F3.hl7").write_text(adt("F3").replace("\n", "\r"))
        drop.symlink_to(elsewhere)  # a link where the directory was: never followed
        time.sleep(1.5)
        assert node.status()["unbound"] and (elsewhere / "F3.hl7").exists()
        drop.unlink()
        drop.mkdir()
        (drop / "F4.hl7").write_text(adt("F4").replace("\n", "\r"))
        wait_for(
            lambda: leader(node)[0] == 200 and not (drop / "F4.hl7").exists(),
            timeout=10,
            interval=0.05,
            what="the drop serving again and F4 taken",
        )
        assert node.output().count("cannot bind inbound drop") == 1  # one line for all its failures
    finally:
        node.stop()
