"""include/app/supervisor.py's stop: nothing a stack process started may outlive it — not a child in a
process group of its own, not one started while the process was being stopped (as the scheduler
starts a task runner)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from include.app.supervisor import Proc, Stack

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
