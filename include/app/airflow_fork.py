"""Airflow's long-running components in processes forked from one that has already imported what they share.

Started as separate programs, the api-server, the scheduler and the dag-processor each import Airflow,
SQLAlchemy, pydantic and the rest on their own: one private copy per process. The LocalExecutor then
forks its task slots from the scheduler, and each slot forks the task process, which imports the
Spark Connect client (pandas, pyarrow, gRPC) and the stage jobs: a private copy per running stage.
Here one process imports all of that once (`PRELOAD`), freezes it out of the garbage collector's
reach, forks every component but the last, and runs the last itself: each page nobody writes to
stays one copy, which the kernel shares and PSS splits between the processes mapping it. Nothing is
started before the forks — no thread, no connection, no file — so each child begins as a fresh
process that happens to have its imports done.

    python -m include.app.airflow_fork --log-dir DIR [--ready-url URL] COMPONENT ...

Each COMPONENT (`api-server`, `scheduler`, `dag-processor`) runs as `airflow COMPONENT`, writing
`DIR/airflow-COMPONENT.log`; with `--ready-url`, the components after the first start once that URL
answers 200 (the api-server's health: the others talk to it). The process running the last one
watches the forked ones: when one exits, the last is stopped as a SIGTERM stops it, the others after
it, and the process exits with status 1, so the embedded stack's supervisor sees it as it sees any
process ending. A stop (SIGTERM) reaches every component from the supervisor, which signals the
whole process tree.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

COMPONENTS = {
    "api-server": ("api-server",),
    "scheduler": ("scheduler", "--skip-serve-logs"),
    "dag-processor": ("dag-processor",),
}
"""The Airflow CLI arguments of each component this parent can fork."""
PRELOAD = (
    "airflow.models",
    "airflow.cli.cli_parser",
    "airflow.jobs.scheduler_job_runner",
    "airflow.executors.local_executor",
    "airflow.dag_processing.manager",
    "airflow.api_fastapi.app",
    "airflow.sdk.execution_time.supervisor",
    "airflow.sdk.execution_time.task_runner",
    "uvicorn",
    "pyspark.sql.connect.session",
    "stageline_airflow.stage_dag",
    "stageline_airflow.tasks",
    "spark_jobs.stage_job",
    "spark_jobs.deliver_job",
)
"""Imported once by the parent: what two or more of its descendants import anyway (Airflow's core
and its API app, the task runner and supervisor every task slot and task uses, the Stageline DAGs'
modules, the Spark Connect client and the stage jobs every stage task loads). Named as strings so
the app layer takes no import of the plugin or the jobs; one that fails to import is left to the
child that needs it, which then reports it as it always would."""
STOP_SECONDS = 20.0
"""How long the parent waits for its children after passing a stop on, before SIGKILL."""


def preload(modules: Sequence[str] = PRELOAD) -> list[str]:
    """Import `modules`; the names that failed (left for the children to fail on, loudly)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # the child that needs it imports it again and reports it
            failed.append(name)
    gc.collect()
    gc.freeze()  # what is imported now is never scanned again: a collection would write to its pages
    return failed


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _keep_frozen() -> None:
    """`gc.unfreeze` in the scheduler: what was frozen stays frozen (see `_fork`)."""


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310  the caller's loopback health URL
            return resp.status == 200
    except OSError:
        return False


def _fork(component: str, log_dir: Path) -> int:
    """Fork one component; the child never returns from here."""
    log = os.open(log_dir / f"airflow-{component}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(log)
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        code = _run(component)
    finally:
        os._exit(code)  # never back into the parent's code


def _run(component: str) -> int:
    """Run `airflow <component>` in this process; its exit status."""
    try:
        try:
            from setproctitle import setproctitle

            setproctitle(f"airflow {component}")
        except ImportError:
            pass
        if component == "scheduler":
            # the LocalExecutor freezes the collector around forking its task slots, then unfreezes,
            # which hands every preloaded object back to the scheduler's collections: each full one
            # would then write to all of their pages, copying them out of the share
            gc.unfreeze = _keep_frozen
        from airflow.__main__ import main

        sys.argv = ["airflow", *COMPONENTS[component]]
        main()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # reported in the component's log, then it ends
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _stop(children: dict[int, str], timeout: float = STOP_SECONDS) -> None:
    """SIGTERM `children`, reap them, SIGKILL those still running after `timeout`."""
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while children and time.monotonic() < deadline:
        for pid in list(children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                children.pop(pid)
        time.sleep(0.1)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _ended(children: dict[int, str]) -> str | None:
    """The first of `children` that has exited (reaped), as `<component> exited with <status>`.
    Only these PIDs are waited for: the component running in this process reaps its own children."""
    for pid, component in list(children.items()):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            del children[pid]
            return f"{component} exited with status {os.waitstatus_to_exitcode(status)}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--ready-url", help="start the components after the first once this answers 200")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("components", nargs="+", choices=sorted(COMPONENTS))
    args = parser.parse_args(argv)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: stopping.append(signum))
    failed = preload()
    if failed:
        print(f"not preloaded (each component imports them itself): {', '.join(failed)}", flush=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    *forked, last = args.components
    children: dict[int, str] = {}
    for n, component in enumerate(forked):
        children[_fork(component, args.log_dir)] = component
        if n == 0 and args.ready_url:
            deadline = time.monotonic() + args.ready_timeout
            while not stopping and not _http_ok(args.ready_url):
                ended = _ended(children)
                if ended or time.monotonic() > deadline:
                    print(ended or f"{component} not ready in {args.ready_timeout:.0f} s; stopping", flush=True)
                    _stop(children)
                    return 1
                time.sleep(0.25)
    if stopping:
        _stop(children)
        return 0
    return _become(last, children, args.log_dir)


def _become(component: str, children: dict[int, str], log_dir: Path) -> int:
    """Run the last component in this process (one process fewer than a parent that only waits),
    watching the forked ones: when one exits, this one is asked to stop (SIGTERM, which Airflow's
    components handle by ending cleanly) and the rest are stopped after it; exit status 1."""
    why: list[str] = []

    def on_child(_signum: int, _frame: object) -> None:
        ended = _ended(children)
        if ended and not why:
            why.append(ended)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, _exit_on_signal)  # until Airflow sets its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, on_child)
    log = os.open(log_dir / f"airflow-{component}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    on_child(signal.SIGCHLD, None)  # one may have ended before the handler was set
    code = _run(component)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _stop(children)
    if why:
        print(why[0], flush=True)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
