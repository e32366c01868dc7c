"""Every DAG file parses like configuration: no connection, Variable, database, service config or
Spark at parse time, the project's DAG conventions hold, and the leader check comes first."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk import DAG, BaseSensorOperator
from airflow.sdk.definitions.timetables.simple import ContinuousTimetable
from stageline_airflow.sensors import LeaderCheckSensor, WorkPendingSensor

from tests.dags.conftest import DAGS, PLUGINS, ROOT

DAG_FILES = sorted(p.name for p in DAGS.glob("*.py") if not p.name.startswith("_"))


class ParseTimeAccess(AssertionError):
    """A DAG file reached for an external resource while being parsed."""


def _refuse(what: str):
    def refuse(*args: object, **kwargs: object) -> None:
        raise ParseTimeAccess(f"{what} touched at parse time")

    return refuse


@pytest.fixture(scope="module")
def dag_bag() -> Iterator[DagBag]:
    """The DAG folder parsed with every outside resource made to fail loudly."""
    patches = [
        mock.patch("airflow.sdk.Connection.get", _refuse("an Airflow connection")),
        mock.patch("airflow.sdk.Variable.get", _refuse("an Airflow Variable")),
        mock.patch("include.config.load", _refuse("the service config")),
        mock.patch("stageline_airflow.hooks.load", _refuse("the service config")),
        mock.patch("include.store.db.Store.__init__", _refuse("the Stageline store")),
        mock.patch("include.store.dialects.SqliteDialect.connect", _refuse("a SQLite store")),
        mock.patch("include.store.dialects.PostgresDialect.connect", _refuse("a PostgreSQL store")),
        mock.patch("include.store.dialects.SqlServerDialect.connect", _refuse("a SQL Server store")),
        mock.patch("psycopg.connect", _refuse("a PostgreSQL database")),
        mock.patch.dict(os.environ, {"STAGELINE_CONFIG": "/nonexistent/stageline.toml"}),
    ]
    for p in patches:
        p.start()
    try:
        yield DagBag(dag_folder=str(DAGS))
    finally:
        for p in reversed(patches):
            p.stop()


def _dag(dag_bag: DagBag, file_name: str) -> DAG:
    found = [d for d in dag_bag.dags.values() if Path(d.fileloc).name == file_name]
    assert len(found) == 1, f"{file_name} must define exactly one DAG, found {[d.dag_id for d in found]}"
    return found[0]


def test_every_dag_file_imports_without_errors(dag_bag):
    assert dag_bag.import_errors == {}
    assert sorted(Path(d.fileloc).name for d in dag_bag.dags.values()) == DAG_FILES


def test_the_expected_dags_exist(dag_bag):
    assert {"stage_route", "stage_transform", "stage_deliver", "maintenance_reclaim", "maintenance_retention"} <= set(
        dag_bag.dag_ids
    )


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_dag_id_is_the_file_name(dag_bag, file_name):
    assert _dag(dag_bag, file_name).dag_id == file_name.removesuffix(".py")


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_dag_follows_the_conventions(dag_bag, file_name):
    dag = _dag(dag_bag, file_name)
    assert "stageline" in dag.tags
    assert dag.default_args.get("retries", 0) >= 1
    assert dag.max_active_runs == 1
    assert dag.catchup is False
    assert dag.doc_md and dag.doc_md.strip().startswith(f"### {dag.dag_id}")
    assert dag.start_date is not None and dag.start_date.tzinfo is not None
    assert dag.dagrun_timeout is not None


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_start_date_is_fixed_not_computed_at_parse_time(dag_bag, file_name):
    again = DagBag(dag_folder=str(DAGS / file_name))
    assert _dag(again, file_name).start_date == _dag(dag_bag, file_name).start_date


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_the_leader_check_is_the_only_root_and_gates_every_task(dag_bag, file_name):
    dag = _dag(dag_bag, file_name)
    [root] = dag.roots
    assert isinstance(root, LeaderCheckSensor)
    assert root.task_id == "leader_check"
    assert root.get_flat_relative_ids(upstream=False) == set(dag.task_ids) - {root.task_id}


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_a_leaderless_run_ends_skipped_in_bounded_time(dag_bag, file_name):
    """An interval DAG's leaderless run ends before the next is due; a continuous one within minutes."""
    dag = _dag(dag_bag, file_name)
    sensor = dag.get_task("leader_check")
    assert sensor.soft_fail is True and sensor.mode == "poke"
    if isinstance(dag.timetable, ContinuousTimetable):
        assert sensor.timeout <= 300
    else:
        assert isinstance(dag.schedule, timedelta), f"{dag.dag_id}: a fixed interval, got {dag.schedule}"
        assert sensor.timeout < dag.schedule.total_seconds()


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_continuous_dags_wait_for_work_instead_of_spinning(dag_bag, file_name):
    dag = _dag(dag_bag, file_name)
    waits = [t for t in dag.tasks if isinstance(t, WorkPendingSensor)]
    if not isinstance(dag.timetable, ContinuousTimetable):
        assert waits == []
        return
    [wait] = waits
    assert wait.soft_fail is True and wait.poke_interval <= 2
    assert "recover" in wait.upstream_task_ids  # recovered rows count as work
    stage = {"stage_route": "route", "stage_transform": "transform", "stage_deliver": "deliver"}[dag.dag_id]
    assert wait.downstream_task_ids == {stage}  # the job starts only once there is work
    assert wait.stage == stage  # one name: the DAG's stage, its job task, the work it waits for


@pytest.mark.parametrize("file_name", DAG_FILES)
def test_timeouts_nest_so_a_wait_skips_before_anything_kills_it(dag_bag, file_name):
    """A sensor killed by its execution_timeout fails; only its own timeout ends it skipped."""
    dag = _dag(dag_bag, file_name)
    waited = 0.0
    for task in dag.tasks:
        assert task.execution_timeout is not None, task.task_id
        assert task.execution_timeout < dag.dagrun_timeout, task.task_id
        if isinstance(task, BaseSensorOperator):
            assert task.timeout < task.execution_timeout.total_seconds(), task.task_id
            waited += task.timeout
    longest_work = max(t.execution_timeout for t in dag.tasks if not isinstance(t, BaseSensorOperator))
    assert timedelta(seconds=waited) + longest_work < dag.dagrun_timeout


def test_parsing_the_dags_imports_neither_spark_nor_the_route_job():
    """The route task imports Spark lazily: a DAG processor without pyspark parses every file."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(PLUGINS)!r})\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(DAGS)!r})\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'pyspark' or m in "
        "('include.spark', 'spark_jobs.route_job', 'spark_jobs.route_rules'))\n"
        "print(len(bag.dags), loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"{len(DAG_FILES)} []"
