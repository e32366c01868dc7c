"""The one-machine cluster command, run as a user runs it: `stageline lab up` brings up PostgreSQL,
two listenerd nodes behind HAProxy, Airflow with two HA schedulers on PostgreSQL, a Spark standalone
master with two workers behind Spark Connect, and a recording receiver. A stream through the VIP is
delivered; then the leader node's listenerd and an Airflow scheduler (with every task it ran) are
SIGKILLed at once — the node that ran the leader and a scheduler dies — and everything `AA`'d is still
delivered, in lane order. Ctrl-C then stops everything the command started.

Select with `-m failover`, leave out with `-m "not failover"`.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from include.app.lab import recorder
from include.app.lab.postgres_server import wait_for
from include.app.lab.two_nodes import HAPROXY
from tests.support.stream import Stream, judge

pytestmark = [
    pytest.mark.failover,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which(HAPROXY) is None, reason=f"{HAPROXY} not installed (scripts/setup.sh)"),
]
ROOT = Path(__file__).resolve().parents[1]


def cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def kill_tree(proc: psutil.Process) -> None:
    for p in [proc, *proc.children(recursive=True)]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_stageline_lab_up_survives_losing_the_leader_and_a_scheduler_at_once(tmp_path: Path) -> None:
    log = open(tmp_path / "lab.log", "w+")
    lab = subprocess.Popen(
        [sys.executable, "-m", "include.app.cli", "lab", "up"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stream = None
    everything: list[psutil.Process] = []
    try:
        wait_for(
            lambda: lab.poll() is not None or "Ctrl-C stops everything" in (tmp_path / "lab.log").read_text(),
            timeout=400,
            interval=1,
            what="stageline lab up",
        )
        text = (tmp_path / "lab.log").read_text()
        assert lab.poll() is None, text[-4000:]
        vip = int(re.search(r"MLLP VIP\s+127\.0\.0\.1:(\d+)", text).group(1))
        deliveries = Path(re.search(r"recorder\s+\S+ → (\S+)", text).group(1))
        assert "Airflow schedulers  2 on the shared PostgreSQL metadata DB (HA)" in text
        assert re.search(r"Spark master\s+spark://127\.0\.0\.1:\d+ with 2 worker\(s\)", text)
        tree = psutil.Process(lab.pid)
        everything = tree.children(recursive=True)

        stream = Stream("127.0.0.1", vip, rate=20, lanes=8, connections=2, prefix="L").start()
        time.sleep(3)
        stream.pause()
        wait_for(
            lambda: {d["control_id"] for d in recorder.read(deliveries)} >= {s.control_id for s in stream.acked()},
            timeout=240,
            interval=1,
            what="the first messages to be delivered through the VIP",
        )
        stream.resume()
        time.sleep(8)

        procs = tree.children(recursive=True)
        leader = [p for p in procs if "listeners.daemon" in cmdline(p) and "node-a" in cmdline(p)]
        schedulers = sorted(
            (p for p in procs if cmdline(p).endswith("airflow scheduler")), key=lambda p: p.create_time()
        )
        assert len(leader) == 1 and len(schedulers) == 2, [cmdline(p) for p in procs]
        kill_tree(leader[0])
        kill_tree(schedulers[0])
        time.sleep(20)
        stream.pause()
        wait_for(
            lambda: {d["control_id"] for d in recorder.read(deliveries)} >= {s.control_id for s in stream.acked()},
            timeout=240,
            interval=1,
            what="every AA'd message to be delivered after the crash",
        )
        verdict = judge(stream.ledger, recorder.read(deliveries))
        print(
            f"\nlab up: {verdict.acked} AA'd, {len(verdict.lost)} lost, {len(verdict.duplicated)} duplicated, "
            f"{len(verdict.inversions)} inversions"
        )
        assert verdict.acked > 100 and not verdict.lost and not verdict.inversions
    finally:
        if stream is not None:
            stream.stop()
        lab.send_signal(signal.SIGINT)
        try:
            lab.wait(180)
        except subprocess.TimeoutExpired:
            lab.kill()
        log.close()
    _, alive = psutil.wait_procs(everything, timeout=15)
    assert not alive, [p.pid for p in alive]
    assert "stopping the lab" in (tmp_path / "lab.log").read_text()
