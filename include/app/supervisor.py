"""A small supervisor for the embedded single-node stack: start named processes in order, wait for
each to be ready, show progress, and stop everything (in reverse order, by PID) on Ctrl-C, SIGTERM
or when any process dies.

Once everything is started, `Stack.handover` replaces the starting program (the `stageline` CLI,
which has imported the config schema, the store and the rest to set things up) with this module
alone, run as `python -m include.app.supervisor`: the same PID, so the same children and the same
terminal, holding only what waiting and stopping need, for the stack's whole life.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn


@dataclass
class Proc:
    name: str
    argv: list[str]
    ready: Callable[[], bool] = lambda: True
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = 120.0
    popen: subprocess.Popen | Adopted | None = None


class Adopted:
    """A child this process had before an exec (a `subprocess.Popen` does not survive one): what is
    asked of a Popen here — its pid, `poll()`, `wait()` and signals."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not (or no longer) ours to wait for: gone
                done, status = self.pid, 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        return code


class Stack:
    def __init__(self, log_dir: Path, *, cwd: Path, echo: Callable[[str], None] = print) -> None:
        self.log_dir = log_dir
        self.cwd = cwd
        self.echo = echo
        self.procs: list[Proc] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, proc: Proc) -> None:
        log = open(self.log_dir / f"{proc.name}.log", "ab")
        self.echo(f"  starting {proc.name:<16} (log: {self.log_dir / (proc.name + '.log')})")
        proc.popen = subprocess.Popen(  # noqa: S603  argv lists built in code, never a shell
            proc.argv,
            cwd=self.cwd,
            env={**os.environ, **proc.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        started = time.monotonic()
        while not proc.ready():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; see its log")
            if time.monotonic() - started > proc.ready_timeout:
                raise RuntimeError(f"{proc.name} not ready after {proc.ready_timeout:.0f}s; see its log")
            time.sleep(0.25)
        self.echo(f"  {proc.name:<25} ready in {time.monotonic() - started:.1f}s")

    def handover(self) -> NoReturn:
        """Become `python -m include.app.supervisor` (module docstring), which waits on the same
        processes as `wait` does and exits with its status. Ctrl-C and SIGTERM are blocked across
        the exec (the mask and a pending signal survive it) until the new program's handlers are
        set, so a stop in that moment is acted on, not lost."""
        plan = {"log_dir": str(self.log_dir), "procs": [[p.name, p.popen.pid] for p in self.procs if p.popen]}
        sys.stdout.flush()
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            os.execv(sys.executable, [sys.executable, "-m", "include.app.supervisor", json.dumps(plan)])  # noqa: S606  fixed argv
        finally:  # exec failed: carry on supervising here
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        sys.exit(self.wait())

    def wait(self) -> int:
        """Block until Ctrl-C/SIGTERM or until a process exits; then stop everything."""
        stop = {"why": ""}

        def on_signal(signum: int, _frame: object) -> None:
            stop["why"] = signal.Signals(signum).name

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked across a handover
        while not stop["why"]:
            for p in self.procs:
                if p.popen and p.popen.poll() is not None:
                    stop["why"] = f"{p.name} exited with {p.popen.returncode}"
                    break
            time.sleep(0.5)
        self.echo(f"\nstopping ({stop['why']}) ...")
        self.stop()
        return 0 if stop["why"] in ("SIGINT", "SIGTERM") else 1

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM each process with all its descendants (collected first: task runners and Spark
        workers may have left the process group), SIGKILL whatever is left after `timeout`; then
        the same for anything still in its session (each is started as a session leader), which
        catches a child started while it was stopping — a task runner the scheduler launched just
        then outlives it otherwise, holding the store open until its task ends."""
        import psutil

        for p in reversed(self.procs):
            if p.popen is None or p.popen.poll() is not None:
                continue
            try:
                tree = [psutil.Process(p.popen.pid)]
                tree += tree[0].children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            _end(list({proc.pid: proc for proc in tree + _session(p.popen.pid)}.values()), timeout)
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:  # seen once in a suite run (the lab's scheduler): kill it by its Popen
                p.popen.kill()
                try:
                    p.popen.wait(10)
                except subprocess.TimeoutExpired:
                    self.echo(f"  {p.name} (pid {p.popen.pid}) did not exit after SIGKILL")
                    continue
            _end(_session(p.popen.pid), timeout)
            self.echo(f"  stopped {p.name}")


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _session(sid: int) -> list:
    """The live processes of session `sid` (never this process)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.getsid(proc.pid) == sid:
                found.append(proc)
        except (OSError, psutil.Error):
            pass
    return found


def _end(procs: list, timeout: float) -> None:
    """SIGTERM `procs`, SIGKILL those still alive after `timeout`."""
    import psutil

    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on `port` (a readiness check)."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def main(argv: list[str] | None = None) -> int:
    """The program `Stack.handover` becomes: argv[0] is its plan, `{"log_dir": …, "procs": [[name, pid], …]}`
    (the stack's processes in the order they were started)."""
    plan = json.loads((sys.argv[1:] if argv is None else argv)[0])
    stack = Stack(Path(plan["log_dir"]), cwd=Path.cwd(), echo=lambda line: print(line, flush=True))
    stack.procs = [Proc(str(name), [], popen=Adopted(int(pid))) for name, pid in plan["procs"]]
    return stack.wait()


if __name__ == "__main__":
    sys.exit(main())
