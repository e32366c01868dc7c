"""Whole DAG runs with `dag.test()` against real stores: the leader gate, recovery, the reclaim
sweep, retention and Airflow's own metadata cleaning, asserted on task states, XComs and rows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance
from airflow.models.xcom import XComModel
from airflow.sdk import DAG
from airflow.utils.session import create_session
from sqlalchemy import func, select
from stageline_airflow import tasks

from include.config import StoreConfig
from include.spark import classic_spark_connection
from include.store import INBOUND, Store
from include.store import rowlease as rl
from include.store.lease import acquire_permanent
from tests.dags.conftest import DAG_TEST_SECONDS, DAGS, PLUGINS
from tests.dags.stores import age, elector, finished_messages, rows, seed_inbound, status_of, write_service_config

DAY = 86_400.0


def load_dag(dag_id: str) -> DAG:
    """A freshly parsed DAG, so a test may tune its tasks without touching other tests."""
    bag = DagBag(dag_folder=str(DAGS / f"{dag_id}.py"))
    assert bag.import_errors == {}
    return bag.dags[dag_id]


def run(dag: DAG, **kwargs: Any) -> DagRun:
    started = time.perf_counter()
    dr = dag.test(**kwargs)
    DAG_TEST_SECONDS.append((dag.dag_id, time.perf_counter() - started))
    return dr


def states(dr: DagRun) -> dict[str, str]:
    return {ti.task_id: ti.state for ti in dr.get_task_instances()}


def xcom(dr: DagRun, task_id: str) -> Any:
    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(run_id=dr.run_id, dag_ids=dr.dag_id, task_ids=task_id, key="return_value")
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def service(config: StoreConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, cluster: bool) -> Iterator[Store]:
    """The DAGs' service config (`$STAGELINE_CONFIG`) on `config`, and an open store of it."""
    monkeypatch.setenv("STAGELINE_CONFIG", str(write_service_config(tmp_path, config, cluster=cluster)))
    store = Store(config)
    yield store
    store.close()


@pytest.fixture
def sqlite_service(
    airflow_db: Path, sqlite_config_fresh: StoreConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Store]:
    yield from service(sqlite_config_fresh, tmp_path, monkeypatch, cluster=False)


@pytest.fixture
def cluster_service(
    airflow_db: Path, pg_config_fresh: StoreConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Store]:
    yield from service(pg_config_fresh, tmp_path, monkeypatch, cluster=True)


def test_reclaim_run_repends_expired_and_stale_epoch_rows_on_a_single_node(sqlite_service):
    store = sqlite_service
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 6)
    with store.transaction() as tx:  # the previous process: its claims outlive it
        stale = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="solo:1:aa", epoch=e1, limit=2, lease_seconds=3600)]
    e2 = acquire_permanent(store, node_id="solo:2:bb")
    with store.transaction() as tx:
        expired = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="job", epoch=e2, limit=2, lease_seconds=0)]
        live = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="job", epoch=e2, limit=1, lease_seconds=3600)]

    dr = run(load_dag("maintenance_reclaim"))

    assert states(dr) == {"leader_check": "success", "recover": "success", "reclaim": "success"}
    assert xcom(dr, "leader_check") == {"epoch": e2, "owner": "solo:2:bb"}
    assert xcom(dr, "recover") == len(stale)
    assert xcom(dr, "reclaim") == {"inbound": len(expired), "routed": 0, "outbound": 0}
    assert status_of(store) == {i: "in_flight" if i in live else "pending" for i in ids}
    events = rows(store, "SELECT row_id, event, epoch FROM message_events ORDER BY row_id")
    assert events == sorted(
        [{"row_id": i, "event": "recovered", "epoch": e2} for i in stale]
        + [{"row_id": i, "event": "lease_expired", "epoch": e2} for i in expired],
        key=lambda e: e["row_id"],
    )


def claims_left_by(store: Store, node: str, n: int, *, owner: str, lease_seconds: float) -> int:
    """`n` inbound rows claimed by `owner` under `node`'s epoch, then `node` releases its lease
    (stops); that epoch."""
    left = elector(store, node)
    epoch = left.step().epoch
    seed_inbound(store, n)
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner=owner, epoch=epoch, limit=n, lease_seconds=lease_seconds)
    left.release()
    return epoch


def test_without_a_live_leader_the_whole_run_ends_skipped_and_touches_nothing(cluster_service):
    store = cluster_service
    claims_left_by(store, "node-a", 3, owner="job", lease_seconds=0)  # node-a stopped; no standby yet
    dag = load_dag("maintenance_reclaim")
    sensor = dag.get_task("leader_check")
    sensor.timeout, sensor.poke_interval = 1.0, 0.3  # the shipped 10 s bound, shortened for the test

    started = time.perf_counter()
    dr = run(dag)
    elapsed = time.perf_counter() - started

    assert states(dr) == {"leader_check": "skipped", "recover": "skipped", "reclaim": "skipped"}
    assert dr.state == "success"  # skipped is not failed: a standby cluster is a normal state
    assert elapsed < 30
    assert set(status_of(store).values()) == {"in_flight"}  # nobody swept without a lease
    assert rows(store, "SELECT count(*) AS n FROM message_events")[0]["n"] == 0


def test_under_a_live_cluster_leader_the_run_works_under_its_epoch(cluster_service):
    store = cluster_service
    claims_left_by(store, "node-a", 2, owner="node-a-job", lease_seconds=3600)
    leader = elector(store, "node-b")
    e2 = leader.step().epoch

    dr = run(load_dag("maintenance_reclaim"))

    assert states(dr) == {"leader_check": "success", "recover": "success", "reclaim": "success"}
    assert xcom(dr, "leader_check") == {"epoch": e2, "owner": "node-b"}
    assert set(status_of(store).values()) == {"pending"}
    assert rows(store, "SELECT DISTINCT event, epoch, node_id FROM message_events") == [
        {"event": "recovered", "epoch": e2, "node_id": "node-b"}
    ]


def test_a_store_without_schema_fails_the_run_instead_of_skipping_it(airflow_db, tmp_path, monkeypatch):
    """Misconfiguration is not leaderlessness: it must show up red, not as a quiet skip."""
    unmigrated = StoreConfig(backend="sqlite", path=str(tmp_path / "never-migrated.db"))
    monkeypatch.setenv("STAGELINE_CONFIG", str(write_service_config(tmp_path, unmigrated, cluster=False)))
    dag = load_dag("maintenance_reclaim")
    for task in dag.tasks:
        task.retries = 0

    dr = run(dag)

    assert states(dr) == {"leader_check": "failed", "recover": "upstream_failed", "reclaim": "upstream_failed"}
    assert dr.state == "failed"


def test_route_run_waits_for_work_then_runs_the_job_under_the_leader_epoch(
    sqlite_service, monkeypatch, without_spark_sessions
):
    store = sqlite_service
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    seed_inbound(store, 2)
    calls = []

    def fake_batch_stage(stage, epoch: int, run_id: str, *, spark: object, dag_id: str, try_number: int) -> dict:
        calls.append((stage.name, epoch, run_id, dag_id, try_number))
        return {"claimed": 2, "routed": 2}

    monkeypatch.setattr(tasks, "run_batch_stage", fake_batch_stage)  # Spark is not this test's subject

    dr = run(load_dag("stage_route"))

    assert states(dr) == {
        "leader_check": "success",
        "recover": "success",
        "wait_for_work": "success",
        "route": "success",
    }
    assert calls == [("route", epoch, dr.run_id, "stage_route", 1)]
    assert xcom(dr, "route") == {"claimed": 2, "routed": 2}


def test_an_idle_route_run_ends_skipped_without_starting_the_job(sqlite_service, monkeypatch, without_spark_sessions):
    acquire_permanent(sqlite_service, node_id="solo:1:aa")
    monkeypatch.setattr(tasks, "run_batch_stage", _refuse_route)
    dag = load_dag("stage_route")
    wait = dag.get_task("wait_for_work")
    wait.timeout, wait.poke_interval = 1.0, 0.3  # the shipped five idle minutes, shortened

    dr = run(dag)

    assert states(dr) == {
        "leader_check": "success",
        "recover": "success",
        "wait_for_work": "skipped",
        "route": "skipped",
    }
    assert dr.state == "success"


def _refuse_route(*args: object, **kwargs: object) -> None:
    raise AssertionError("the route job must not start without work")


ADT = "MSH|^~\\&|ADT1|HOSP|EHR|CITY|20240101120000||ADT^A01|MSG1|P|2.5\rPID|1||P1^^^HOSP^MR\r"
ORU = "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240102083000||ORU^R01|MSG2|P|2.5\rPID|1||P2^^^LAB^MR\r"
ROUTES_TOML = """
[[route]]
name = "adt"
destinations = ["ehr", "archive"]
when = { field = "MSH-9.1", op = "eq", value = "ADT" }
"""
DESTINATIONS_TOML = """
[[destination]]
name = "ehr"
kind = "file"
directory = "out/ehr"

[[destination]]
name = "archive"
kind = "file"
directory = "out/archive"
"""
RUN_STAGE_ROUTE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
dag = DagBag(dag_folder=sys.argv[2]).dags["stage_route"]
dr = dag.test()
print("STATES " + json.dumps({ti.task_id: ti.state for ti in dr.get_task_instances()}))
"""


def test_a_route_run_moves_messages_through_spark_end_to_end(sqlite_service, tmp_path):
    """The whole chain: DAG → stageline_airflow.tasks → spark_jobs.route_job → Spark (local) → store.

    In a subprocess, so the JVM stays out of this test session (the Spark tests configure their own).
    """
    store = sqlite_service
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    with store.transaction() as tx:
        staged = rl.stage_inbound(
            tx,
            [
                {
                    "message_id": "adt-1",
                    "control_id": "MSG1",
                    "connection": "mllp-in",
                    "lane_key": None,
                    "charset": None,
                    "payload": ADT,
                },
                {
                    "message_id": "oru-1",
                    "control_id": "MSG2",
                    "connection": "mllp-in",
                    "lane_key": None,
                    "charset": None,
                    "payload": ORU,
                },
            ],
            epoch=epoch,
            node_id="solo:1:aa",
        )
    (tmp_path / "routes.toml").write_text(ROUTES_TOML)
    (tmp_path / "destinations.toml").write_text(DESTINATIONS_TOML)
    env = {
        **os.environ,
        "STAGELINE_PIPELINE_DIR": str(tmp_path),
        "AIRFLOW_CONN_STAGELINE_SPARK": classic_spark_connection("local[1]"),
    }

    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", RUN_STAGE_ROUTE, str(PLUGINS), str(DAGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    DAG_TEST_SECONDS.append(("stage_route with Spark, subprocess", time.perf_counter() - started))

    assert out.returncode == 0, out.stderr[-4000:]
    [line] = [text for text in out.stdout.splitlines() if text.startswith("STATES ")]
    assert json.loads(line.removeprefix("STATES ")) == {
        "leader_check": "success",
        "recover": "success",
        "wait_for_work": "success",
        "route": "success",
    }
    assert status_of(store) == {staged["adt-1"]: "done", staged["oru-1"]: "unrouted"}
    # no transforms and one lane per destination: both are pass-through destinations, so the route
    # finalize routes them straight to done and creates their outbound rows
    routed = rows(store, "SELECT source_id, destination, route_name, status FROM stage_routed ORDER BY destination")
    assert routed == [
        {"source_id": staged["adt-1"], "destination": d, "route_name": "adt", "status": "done"}
        for d in ("archive", "ehr")
    ]
    outbound = rows(
        store, "SELECT source_id, destination, lane_key, status, payload FROM outbound_messages ORDER BY destination"
    )
    assert outbound == [
        {"source_id": staged["adt-1"], "destination": d, "lane_key": d, "status": "pending", "payload": ADT}
        for d in ("archive", "ehr")
    ]
    [owner] = {r["node_id"] for r in rows(store, "SELECT node_id FROM message_events WHERE event <> 'received'")}
    assert owner.startswith("airflow:stage_route:") and owner.endswith("#1.0")  # try 1, first batch


RUN_RETENTION = RUN_STAGE_ROUTE.replace('"stage_route"', '"maintenance_retention"')


def test_a_retention_run_moves_old_messages_through_the_archive_tables_to_parquet(sqlite_service, tmp_path):
    """Hot → archive tables → Parquet in one run (an archive hold of a fraction of a second), with the
    periods from the service config and the Spark job on a local session; then `messages show` finds
    the message in Parquet. In a subprocess, like the route run above, to keep the JVM out."""
    store = sqlite_service
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    finished_messages(store, epoch, "adt-", "adt-in")
    finished_messages(store, epoch, "lab-", "lab-in")
    for table in ("stage_inbound", "stage_routed", "stage_outbound"):
        age(store, table, "updated_at", "1 = 1", 2 * DAY)
    archive = tmp_path / "parquet"
    config = Path(os.environ["STAGELINE_CONFIG"])
    config.write_text(
        config.read_text()
        + f'''
[retention]
inbound_days = 1
routed_days = 1
outbound_days = 1
archive_days = 0.000001
archive_path = "{archive}"
[retention.connections.lab-in]
inbound_days = 30
routed_days = 30
outbound_days = 30
'''
    )
    env = {**os.environ, "AIRFLOW_CONN_STAGELINE_SPARK": classic_spark_connection("local[1]")}

    out = subprocess.run(
        [sys.executable, "-c", RUN_RETENTION, str(PLUGINS), str(DAGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert out.returncode == 0, out.stderr[-4000:]
    [line] = [text for text in out.stdout.splitlines() if text.startswith("STATES ")]
    assert json.loads(line.removeprefix("STATES ")) == {
        "leader_check": "success",
        "recover": "success",
        "purge": "success",
        "archive_parquet": "success",
        "clean_airflow_metadata": "success",
    }
    assert [r["message_id"] for r in rows(store, "SELECT message_id FROM stage_inbound ORDER BY id")] == [
        "lab-0",
        "lab-1",
    ]  # the 30-day connection stays hot
    assert rows(store, "SELECT count(*) AS n FROM archive_inbound") == [{"n": 0}]
    assert sorted(p.name for p in next((archive / "inbound").iterdir()).iterdir()) == ["connection=adt-in"]
    show = subprocess.run(
        [
            sys.executable,
            "-m",
            "include.app.cli",
            "--service-config",
            str(config),
            "messages",
            "show",
            "adt-1",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=DAGS.parent,
        timeout=120,
    )
    assert show.returncode == 0, show.stderr
    story = json.loads(show.stdout)
    assert story["inbound"]["message_id"] == "adt-1" and story["inbound"]["archived_ms"] is not None
    assert [o["status"] for o in story["outbound"]] == ["done"]


def _stage_route_run_at(when: datetime) -> DagRun:
    """A stage_route run recorded at `when` (the Spark route task marked done without running)."""
    return run(load_dag("stage_route"), logical_date=when, run_after=when, mark_success_pattern="wait_for_work|route")


def test_retention_run_purges_old_finished_rows_and_old_stage_dag_runs(sqlite_service):
    store = sqlite_service
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 4)
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="job", epoch=epoch, limit=3)
        rl.finish_batch(tx, INBOUND, ids[:3], owner="job", epoch=epoch)
    age(store, "stage_inbound", "updated_at", f"id IN ({ids[0]}, {ids[1]}, {ids[3]})", 8 * DAY)
    now = datetime.now(UTC)
    old_run = _stage_route_run_at(now - timedelta(days=2))
    recent_run = _stage_route_run_at(now - timedelta(minutes=5))
    assert states(old_run) == {
        "leader_check": "success",
        "recover": "success",
        "wait_for_work": "success",
        "route": "success",
    }

    dr = run(load_dag("maintenance_retention"))

    assert states(dr) == {
        "leader_check": "success",
        "recover": "success",
        "purge": "success",
        "archive_parquet": "success",
        "clean_airflow_metadata": "success",
    }
    assert xcom(dr, "archive_parquet") is None  # no [retention] archive_path: no Spark, nothing moved
    assert xcom(dr, "purge") == {"inbound": 2, "inbound_batches": 0, "routed": 0, "outbound": 0, "events": 0}
    assert status_of(store) == {ids[2]: "done", ids[3]: "pending"}  # recent done, and old but unfinished
    with create_session() as session:
        kept = set(session.scalars(select(DagRun.run_id).where(DagRun.dag_id == "stage_route")))
        old_tis = session.scalar(
            select(func.count()).select_from(TaskInstance).where(TaskInstance.run_id == old_run.run_id)
        )
    assert old_run.run_id not in kept and recent_run.run_id in kept
    assert old_tis == 0


FAKE_AIRFLOW = """#!/bin/sh
echo "conn=${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-<unset>} core=${AIRFLOW__CORE__SQL_ALCHEMY_CONN:-<unset>} args=$*"
"""
BLOCKED = "airflow-db-not-allowed:///"


@pytest.mark.parametrize(
    "own_url, expected",
    [
        ("postgresql://airflow@db/airflow", "conn=postgresql://airflow@db/airflow core=<unset>"),
        (None, "conn=<unset> core=<unset>"),  # airflow.cfg / _CMD / the SQLite default apply
    ],
)
def test_metadata_clean_script_gets_past_airflow_3s_blocked_db_url(tmp_path, own_url, expected):
    """Inside a real worker the task's env carries Airflow 3's blocked URL; the script must not."""
    fake = tmp_path / "airflow"
    fake.write_text(FAKE_AIRFLOW)
    fake.chmod(0o755)
    script = tasks.metadata_clean_command(dag_ids=["stage_route", "maintenance_reclaim"], keep=timedelta(hours=24))
    rendered = re.sub(r"\{\{.*?\}\}", "2026-01-01T00:00:00+00:00", script)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": BLOCKED,
        "AIRFLOW__CORE__SQL_ALCHEMY_CONN": BLOCKED,
    }
    if own_url:
        env["STAGELINE_AIRFLOW_DB_CONN"] = own_url
    out = subprocess.run(["bash", "-c", rendered], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        f"{expected} args=db clean --clean-before-timestamp 2026-01-01T00:00:00+00:00 "
        "--tables dag_run,task_instance,xcom --dag-ids stage_route,maintenance_reclaim "
        "--batch-size 10000 --skip-archive --yes"
    )
