"""Airflow for the DAG tests: a private AIRFLOW_HOME with a SQLite metadata DB, migrated once.

Airflow reads its configuration when `airflow` is first imported, so the environment is set here,
at collection time, before any test module of this directory imports it. `dag.test()` needs the
metadata DB (it syncs the DAG folder's bundle and records the run) but no scheduler, API server
or executor: tasks run in-process against an in-process Execution API.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAGS = ROOT / "dags"
PLUGINS = ROOT / "plugins"

if "airflow" in sys.modules:  # pragma: no cover - a guard against test-ordering surprises
    raise RuntimeError("airflow was imported before tests/dags/conftest.py could configure it")

AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="stageline-airflow-"))
atexit.register(shutil.rmtree, AIRFLOW_HOME, ignore_errors=True)
os.environ.update(
    {
        "AIRFLOW_HOME": str(AIRFLOW_HOME),
        "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{AIRFLOW_HOME / 'airflow.db'}",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        # A stage task ends as soon as its work is done (no lingering for more): dag.test() runs one at a time.
        "STAGELINE_STAGE_LINGER_SECONDS": "0",
    }
)
# Under Airflow the plugins folder is put on sys.path by airflow.settings; DagBag imports and the
# tests' own imports must not depend on that having happened first.
if str(PLUGINS) not in sys.path:
    sys.path.insert(0, str(PLUGINS))

MIGRATE_SECONDS: float | None = None
DAG_TEST_SECONDS: list[tuple[str, float]] = []
"""(dag_id, seconds) of every `dag.test()` the session ran, for the summary below."""


@pytest.fixture(scope="session")
def airflow_db() -> Iterator[Path]:
    """The migrated metadata DB (in-process `initdb`, once per session; removed at exit)."""
    global MIGRATE_SECONDS
    from airflow.utils import db

    started = time.perf_counter()
    db.initdb()
    MIGRATE_SECONDS = time.perf_counter() - started
    yield AIRFLOW_HOME / "airflow.db"


def pytest_terminal_summary(terminalreporter) -> None:
    if MIGRATE_SECONDS is not None:
        terminalreporter.write_line(f"airflow metadata DB migrated in {MIGRATE_SECONDS:.2f} s")
    if DAG_TEST_SECONDS:
        runs = ", ".join(f"{dag_id} {seconds:.2f}" for dag_id, seconds in DAG_TEST_SECONDS)
        terminalreporter.write_line(f"dag.test() seconds per run, in order: {runs}")


@pytest.fixture
def without_spark_sessions(monkeypatch) -> None:
    """Stage job tasks run with a session-less `StageSession` instead of starting Spark: for
    in-process `dag.test()` runs whose stage job is replaced (a Spark session, classic or Connect,
    must not start inside the test process; the real sessions run in subprocesses)."""
    import contextlib

    from stageline_airflow.hooks import StagelineSparkHook

    from include.spark import StageSession

    @contextlib.contextmanager
    def no_session(self, *, name, conf):
        yield StageSession(None)

    monkeypatch.setattr(StagelineSparkHook, "stage_session", no_session)
