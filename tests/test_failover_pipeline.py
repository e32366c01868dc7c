"""The whole pipeline survives a leader crash under the real scheduler: on the two-node lab
(`include/app/lab/two_nodes.py`: two listenerd behind HAProxy, Airflow on PostgreSQL, Spark Connect, a recording
MLLP receiver), a stream that resends anything not `AA`'d runs through the VIP, the leader's
listenerd is SIGKILLed mid-stream, and every `AA`'d message must still reach the receiver, in lane
order; the first message sent after the crash must arrive within the failover time + 5 s
(issue 8). The lab runs once for the module; the tests judge what it recorded, then check that
every process and port the lab used is gone.

Select with `-m failover`, leave out with `-m "not failover"`.
"""

from __future__ import annotations

import shutil
import signal
import time
from dataclasses import dataclass, field

import psutil
import pytest

from include.app.lab.postgres_server import wait_for
from include.app.lab.two_nodes import HAPROXY, Lab, Timings
from tests.support.labrun import drained, first_delivery_after, left_behind, tree
from tests.support.stream import Stream, Verdict, judge

pytestmark = [
    pytest.mark.failover,
    pytest.mark.timeout(420),
    pytest.mark.skipif(shutil.which(HAPROXY) is None, reason=f"{HAPROXY} not installed (scripts/setup.sh)"),
]
BOUND_SLACK = 10.0
"""First post-crash delivery ≤ failover + this. The issue's figure is + 5 s, measured by
bench/failover.py (5.3–5.4 s after the crash, 2.8–3.0 s failover); the test leaves room for a
loaded 2-core CI machine while still failing on the old behaviour (25–60 s: stage tasks looping
under the old epoch until their linger ran out)."""
STEADY_SECONDS = 15


@dataclass
class Outcome:
    verdict: Verdict
    failover_s: float
    first_delivery_s: float | None
    drained: bool
    backlog: dict[str, int]
    leftover_pids: list[str] = field(default_factory=list)
    leftover_ports: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def leader_crash() -> Outcome:
    lab = Lab(timings=Timings(linger=5.0))
    stream: Stream | None = None
    procs: dict[str, psutil.Process] = {}
    ports: dict[str, int] = {}
    try:
        lab.start()
        stream = Stream(*lab.mllp_address, rate=30, lanes=10, connections=3, prefix="T").start()
        time.sleep(3)
        stream.pause()  # warm-up: the first stage runs start Spark sessions; wait them out once
        wait_for(
            lambda: {d["control_id"] for d in lab.deliveries()} >= {s.control_id for s in stream.acked()},
            timeout=150,
            interval=0.5,
            what="the warm-up messages to be delivered",
        )
        stream.resume()
        time.sleep(STEADY_SECONDS)  # every stage back in its micro-batch loop: the steady stream the bound is about
        old = lab.wait_leader()
        t0 = time.time()
        lab.signal_node(old, signal.SIGKILL)
        wait_for(
            lambda: (lambda n: n is not None and n is not old)(lab.leader()),
            timeout=30,
            interval=0.02,
            what="the standby to lead",
        )
        failover = time.time() - t0
        lab.restart_node(old)
        time.sleep(10)
        stream.pause()
        ok = drained(lab, stream, timeout=90)
        deliveries = lab.deliveries()
        outcome = Outcome(
            verdict=judge(stream.ledger, deliveries),
            failover_s=failover,
            first_delivery_s=first_delivery_after(stream, deliveries, t0),
            drained=ok,
            backlog=lab.backlog(),
        )
        procs = tree(lab.processes())
        ports = lab.ports()
    except Exception:
        print(lab.log_tails())
        raise
    finally:
        if stream is not None:
            stream.stop()
        lab.stop()
    outcome.leftover_pids, outcome.leftover_ports = left_behind(procs, ports)
    v = outcome.verdict
    first = "—" if outcome.first_delivery_s is None else f"{outcome.first_delivery_s:.1f} s"
    print(
        f"\nleader SIGKILL: failover {outcome.failover_s:.1f} s, first post-crash delivery {first}; "
        f"{v.acked} AA'd, {len(v.lost)} lost, {len(v.duplicated)} duplicated, {len(v.inversions)} inversions"
    )
    return outcome


def test_a_leader_crash_loses_no_acked_message(leader_crash: Outcome) -> None:
    v = leader_crash.verdict
    assert v.acked > 300, f"only {v.acked} messages ACKed: the stream did not run"
    assert v.lost == [], f"{len(v.lost)} ACKed message(s) never delivered, e.g. {v.lost[:5]}"
    assert leader_crash.drained, f"not drained within 90 s: {leader_crash.backlog}"


def test_a_leader_crash_keeps_every_lane_in_order(leader_crash: Outcome) -> None:
    v = leader_crash.verdict
    assert v.inversions == [], f"{len(v.inversions)} delivered out of lane order, e.g. {v.inversions[:5]}"


def test_after_a_leader_crash_delivery_resumes_within_seconds_of_the_failover(leader_crash: Outcome) -> None:
    first = leader_crash.first_delivery_s
    assert first is not None, "nothing sent after the crash was delivered"
    assert first <= leader_crash.failover_s + BOUND_SLACK, (
        f"first post-crash delivery {first:.1f} s after the crash; failover took {leader_crash.failover_s:.1f} s"
    )


def test_the_lab_leaves_no_process_or_port_behind(leader_crash: Outcome) -> None:
    assert leader_crash.leftover_pids == []
    assert leader_crash.leftover_ports == []
