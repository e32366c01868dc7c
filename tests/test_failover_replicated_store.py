"""Losing the database host loses nothing: the two-node lab on a replicated store (`Lab(replicated_store=True)`:
etcd ×3, two PostgreSQL under Patroni with `synchronous_mode`, HAProxy on `GET /primary`), a stream
that resends anything not `AA`'d, and the PostgreSQL primary's postmaster and Patroni SIGKILLed
mid-stream (issue 28). Every `AA`'d message must still reach the receiver, in lane order, once the
standby is promoted; delivery must resume; and the killed node rejoins as the new synchronous
standby. Then every process and port the lab used must be gone.

Select with `-m failover`, leave out with `-m "not failover"`.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from include.app.lab.postgres_server import PG_BIN, wait_for
from include.app.lab.replicated_store import ETCD, HAPROXY, PATRONI, ReplicatedStore
from include.app.lab.two_nodes import Lab, Timings
from tests.support.labrun import drained, first_delivery_after, left_behind, tree
from tests.support.stream import Stream, Verdict, judge
from tests.test_failover_pipeline import STEADY_SECONDS

pytestmark = [
    pytest.mark.failover,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        shutil.which(HAPROXY) is None or not all(Path(p).exists() for p in (ETCD, PATRONI, PG_BIN / "initdb")),
        reason="haproxy, etcd, patroni or PostgreSQL 15 not installed (scripts/setup.sh)",
    ),
]
TIMINGS = Timings(linger=5.0)
RESUME_BOUND = TIMINGS.lease_ttl + 3.0 + 5.0
"""The issue's bound: the first delivery of a message sent after the kill comes within Patroni's
failover + the lease TTL + 3 s (`AA` again) + 5 s (through the stages). `bench/failover.py
--replicated-store` measures it (docs/deployment.md)."""
BOUND_SLACK = 10.0
"""Room the suite leaves on a loaded 2-core CI machine, where the new message waits behind its
lane's backlog through every stage; it still fails on the behaviour before the fixes (76 s and
117 s after the kill: the scheduler reset the stage tasks and the pool and fence waited twice)."""


@dataclass
class Outcome:
    verdict: Verdict
    patroni_s: float
    first_delivery_s: float | None
    drained: bool
    backlog: dict[str, int]
    rejoined: bool
    restarted: list[str] = field(default_factory=list)
    leftover_pids: list[str] = field(default_factory=list)
    leftover_ports: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def primary_kill() -> Outcome:
    lab = Lab(timings=TIMINGS, replicated_store=True)
    stream: Stream | None = None
    procs: dict[str, psutil.Process] = {}
    ports: dict[str, int] = {}
    try:
        lab.start()
        store = lab.pg
        assert isinstance(store, ReplicatedStore)
        stream = Stream(*lab.mllp_address, rate=30, lanes=10, connections=3, prefix="P").start()
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
        primary, _ = store.wait_synchronous()
        t0 = time.time()
        store.kill_node(primary)
        store.wait_primary(other_than=primary, timeout=60)
        patroni_s = time.time() - t0
        time.sleep(20)  # the stream runs on against the promoted server
        store.restart_node(primary)
        try:
            store.wait_synchronous(timeout=90)
            rejoined = True
        except TimeoutError:
            rejoined = False
        stream.pause()
        ok = drained(lab, stream, timeout=120)
        deliveries = lab.deliveries()
        outcome = Outcome(
            verdict=judge(stream.ledger, deliveries),
            patroni_s=patroni_s,
            first_delivery_s=first_delivery_after(stream, deliveries, t0),
            drained=ok,
            backlog=lab.backlog(),
            rejoined=rejoined,
            restarted=[name for _, name, _ in lab.restarts],
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
        f"\nPostgreSQL primary SIGKILL: Patroni failover {outcome.patroni_s:.1f} s, first post-kill delivery "
        f"{first}; {v.acked} AA'd, {len(v.lost)} lost, {len(v.duplicated)} duplicated, {len(v.inversions)} inversions; "
        f"restarted by the lab: {', '.join(outcome.restarted) or 'nothing'}"
    )
    return outcome


def test_killing_the_database_primary_loses_no_acked_message(primary_kill: Outcome) -> None:
    v = primary_kill.verdict
    assert v.acked > 300, f"only {v.acked} messages ACKed: the stream did not run"
    assert v.lost == [], f"{len(v.lost)} ACKed message(s) never delivered, e.g. {v.lost[:5]}"
    assert primary_kill.drained, f"not drained within 120 s: {primary_kill.backlog}"


def test_killing_the_database_primary_keeps_every_lane_in_order(primary_kill: Outcome) -> None:
    v = primary_kill.verdict
    assert v.inversions == [], f"{len(v.inversions)} delivered out of lane order, e.g. {v.inversions[:5]}"


def test_delivery_resumes_within_the_bound_after_the_promotion(primary_kill: Outcome) -> None:
    """Within the issue's bound (RESUME_BOUND after Patroni's own failover) and BOUND_SLACK. What it took to get
    there — the scheduler no longer resets the stage tasks, the store's pool and the leader's fence
    no longer wait out the outage a second time — is in docs/deployment.md ("What must outlast a
    failover", and the measured runs under "In the lab")."""
    first = primary_kill.first_delivery_s
    assert first is not None, "nothing sent after the kill was delivered"
    took = primary_kill.patroni_s
    assert first <= took + RESUME_BOUND + BOUND_SLACK, (
        f"first post-kill delivery {first:.1f} s; Patroni's failover took {took:.1f} s (the issue's bound "
        f"{took + RESUME_BOUND:.1f} s, + {BOUND_SLACK:g} s here); restarted by the lab: "
        f"{primary_kill.restarted or 'nothing'}"
    )


def test_the_killed_node_rejoins_as_the_synchronous_standby(primary_kill: Outcome) -> None:
    assert primary_kill.rejoined


def test_the_replicated_lab_leaves_no_process_or_port_behind(primary_kill: Outcome) -> None:
    assert primary_kill.leftover_pids == []
    assert primary_kill.leftover_ports == []
