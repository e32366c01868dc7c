"""The set-up every end-to-end pipeline test shares: a running `listenerd` with its ports bound,
and the stage DAGs run by `dag.test()` against its config.

The DAGs run in a subprocess, one per call (one JVM, kept out of the test session); each run's
seconds go to the session summary (tests/dags/conftest.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from include.config import StoreConfig
from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import wait_for
from include.spark import classic_spark_connection
from include.app.supervisor import port_open
from tests.dags.conftest import DAG_TEST_SECONDS, DAGS, PLUGINS
from tests.spark_jobs.test_senders import MllpReceiver

STAGES = ("stage_route", "stage_transform", "stage_deliver")
RUN_DAGS = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[2])
for dag_id in sys.argv[3:]:
    started = time.perf_counter()
    dr = bag.dags[dag_id].test()
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    print("STATES " + json.dumps({"dag_id": dag_id, "seconds": time.perf_counter() - started, "states": states}),
          flush=True)
"""


def run_dags(service_config: Path, pipeline_dir: Path, *dag_ids: str, **popen: Any) -> subprocess.Popen:
    env = {**os.environ, "STAGELINE_CONFIG": str(service_config), "STAGELINE_PIPELINE_DIR": str(pipeline_dir),
           "AIRFLOW_CONN_STAGELINE_SPARK": classic_spark_connection("local[2]")}
    return subprocess.Popen([sys.executable, "-c", RUN_DAGS, str(PLUGINS), str(DAGS), *dag_ids], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def dag_results(proc: subprocess.Popen, *, timeout: float = 600) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    results = [json.loads(line.removeprefix("STATES ")) for line in out.splitlines() if line.startswith("STATES ")]
    for r in results:
        DAG_TEST_SECONDS.append((f"{r['dag_id']} (e2e subprocess)", r["seconds"]))
    return results


def run_stages(daemon: Daemon, *dag_ids: str) -> list[dict[str, Any]]:
    """Run `dag_ids` (default: route, transform, deliver) on `daemon`'s service and pipeline config."""
    return dag_results(run_dags(daemon.workdir / "stageline.toml", daemon.workdir / "config", *(dag_ids or STAGES)))


@contextmanager
def listenerd(workdir: Path, store: StoreConfig, *, node_id: str, inbound: list[dict[str, Any]],
              receivers: Sequence[MllpReceiver] = ()) -> Iterator[Daemon]:
    """A single-node `listenerd` with every MLLP port of `inbound` bound; on exit it stops, and so
    do `receivers` (the destinations the test started for it), whatever the test raised."""
    daemon = Daemon(workdir=workdir, store=store, node_id=node_id, inbound=inbound)
    ports = [conn["port"] for conn in inbound if conn["kind"] == "mllp"]
    try:
        daemon.start()
        wait_for(lambda: all(port_open(p) for p in ports), timeout=20, what="listenerd binds its MLLP ports")
        yield daemon
    finally:
        daemon.stop()
        for receiver in receivers:
            receiver.stop()
