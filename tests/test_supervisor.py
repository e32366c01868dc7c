"""include/app/supervisor.py's stop: nothing a stack process started may outlive it — not a child in a
process group of its own, not one started while the process was being stopped (as the scheduler
starts a task runner) — also once the starting program has handed over to the slim supervisor."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from include.app.supervisor import Proc, Stack

ROOT = Path(__file__).resolve().parents[1]

# On SIGTERM: start a straggler in a process group of its own, record its pid, then exit.
LATE_CHILD = """
import os, signal, subprocess, sys, time
def on_term(*_):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=False,
                             preexec_fn=os.setpgrp)
    open(sys.argv[1], "w").write(str(child.pid))
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1] + ".ready", "w").write("1")
while True:
    time.sleep(0.1)
"""


def test_stop_ends_a_child_started_while_its_parent_was_stopping(tmp_path: Path):
    pid_file = tmp_path / "late.pid"
    stack = Stack(tmp_path / "log", cwd=tmp_path, echo=lambda _: None)
    stack.start(
        Proc(
            "spawner",
            [sys.executable, "-c", LATE_CHILD, str(pid_file)],
            ready=lambda: (tmp_path / "late.pid.ready").exists(),
            ready_timeout=30,
        )
    )
    stack.stop(timeout=5)
    late = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 5
        while psutil.pid_exists(late) and psutil.Process(late).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"pid {late} outlived the stack"
            time.sleep(0.1)
    finally:
        if psutil.pid_exists(late):
            psutil.Process(late).kill()


# A stack of two sleepers handed over to the slim supervisor (what `stageline up` does once it is up).
HANDOVER = """
import sys
from pathlib import Path
from include.app.supervisor import Proc, Stack
stack = Stack(Path(sys.argv[1]), cwd=Path(sys.argv[1]), echo=lambda line: print(line, flush=True))
for name in ("first", "second"):
    stack.start(Proc(name, [sys.executable, "-c", "import time; time.sleep(300)"]))
stack.handover()
"""


@contextlib.contextmanager
def _handed_over(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, list[psutil.Process]]]:
    """The HANDOVER program, once it has become `python -m include.app.supervisor`, and its children;
    whatever of them is left is killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HANDOVER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(proc.pid).cmdline()[1:3] != ["-m", "include.app.supervisor"]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.05)
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2, children
        yield proc, children
    finally:
        for child in children:
            if child.is_running():
                child.kill()
        proc.kill()


def test_the_handed_over_supervisor_keeps_the_processes_and_stops_them_all_on_ctrl_c(tmp_path: Path):
    with _handed_over(tmp_path) as (proc, children):
        assert psutil.Process(proc.pid).memory_info().rss < 40 * 1024 * 1024  # holds only what waiting needs
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "stopping (SIGINT)" in out and out.index("stopped second") < out.index("stopped first"), out
        assert psutil.wait_procs(children, timeout=5)[1] == []


def test_the_handed_over_supervisor_stops_the_rest_when_one_process_dies(tmp_path: Path):
    with _handed_over(tmp_path) as (proc, children):
        children[0].kill()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1, out
        assert "exited with -9" in out and "stopped" in out, out
        assert psutil.wait_procs(children, timeout=5)[1] == []
