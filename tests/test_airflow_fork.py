"""include/app/airflow_fork.py's supervision, with stand-ins for Airflow's components (real processes,
real signals): the process that runs the last component ends, with status 1, once a forked one has
exited, and takes the others with it; when the last one is stopped, the forked ones are stopped too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

# Each component sleeps (as Airflow's catch SystemExit from their SIGTERM handler and return); the
# one named in argv[2] exits with status 3 after argv[3] seconds.
STAND_INS = """
import sys, time
from include.app import airflow_fork

def run(component):
    try:
        if component == sys.argv[2]:
            time.sleep(float(sys.argv[3]))
            return 3
        time.sleep(300)
        return 0
    except SystemExit as exc:
        return exc.code

airflow_fork._run = run
airflow_fork.PRELOAD = ()
sys.exit(airflow_fork.main(["--log-dir", sys.argv[1], "api-server", "scheduler", "dag-processor"]))
"""


def _start(tmp_path: Path, failing: str, after: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", STAND_INS, str(tmp_path), failing, str(after)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )


def _children(proc: subprocess.Popen, count: int) -> list[psutil.Process]:
    deadline = time.monotonic() + 30
    while len(children := psutil.Process(proc.pid).children()) < count:
        assert proc.poll() is None and time.monotonic() < deadline, "the components were not forked"
        time.sleep(0.05)
    return children


def test_a_forked_component_exiting_ends_the_last_and_the_others(tmp_path: Path):
    proc = _start(tmp_path, "scheduler", 2.0)
    try:
        forked = _children(proc, 2)
        assert proc.wait(30) == 1
        assert psutil.wait_procs(forked, timeout=5)[1] == []
        assert "scheduler exited with status 3" in (tmp_path / "airflow-dag-processor.log").read_text()
    finally:
        proc.kill()


def test_a_stop_of_the_last_component_stops_the_forked_ones_after_it(tmp_path: Path):
    proc = _start(tmp_path, "none", 0)
    try:
        forked = _children(proc, 2)
        deadline = time.monotonic() + 30  # the last component running (its log opened after its handlers are set)
        while not (tmp_path / "airflow-dag-processor.log").exists():
            assert time.monotonic() < deadline, "the last component did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM  # the last component's own status (here: the stand-in's)
        assert psutil.wait_procs(forked, timeout=5)[1] == []
    finally:
        proc.kill()
