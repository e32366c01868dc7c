"""The set-up every end-to-end pipeline test shares: a running `listenerd` with its ports bound,
its pipeline config written from plain dicts, messages sent to it by python-hl7's own MLLP client,
and the stage DAGs run by `dag.test()` against its config. A test file keeps only what it is about:
its messages, its routes and destinations, and what it asserts.

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

import hl7
from hl7.client import MLLPClient

from include.app.lab.listenerd import Daemon, toml_value
from include.app.lab.postgres_server import wait_for
from include.app.supervisor import port_open
from include.config import StoreConfig
from include.spark import classic_spark_connection
from include.store import Store, lookups
from tests.dags.conftest import DAG_TEST_SECONDS, DAGS, PLUGINS
from tests.spark_jobs.test_senders import MllpReceiver

STAGES = ("stage_route", "stage_transform", "stage_deliver")
LANE = "PID-3.1"
"""Every e2e connection and MLLP destination keeps one lane per patient."""
PATIENT_CLASS = {"I": "IN", "O": "OUT"}
"""The `patient_class` lookup table the e2e transforms map PV1-2 through."""
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
    env = {
        **os.environ,
        "STAGELINE_CONFIG": str(service_config),
        "STAGELINE_PIPELINE_DIR": str(pipeline_dir),
        "AIRFLOW_CONN_STAGELINE_SPARK": classic_spark_connection("local[2]"),
    }
    return subprocess.Popen(
        [sys.executable, "-c", RUN_DAGS, str(PLUGINS), str(DAGS), *dag_ids],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


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
def listenerd(
    workdir: Path,
    store: StoreConfig,
    *,
    node_id: str,
    inbound: list[dict[str, Any]],
    receivers: Sequence[MllpReceiver] = (),
) -> Iterator[Daemon]:
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


def mllp_inbound(name: str, port: int) -> dict[str, Any]:
    """An MLLP connection of listenerd's connections.toml on loopback."""
    return {"name": name, "kind": "mllp", "host": "127.0.0.1", "port": port, "lane_key": LANE}


def mllp_destination(name: str, port: int, **options: Any) -> dict[str, Any]:
    """A `[[destination]]` that sends to an MLLP receiver on loopback (`options`: lane, retries …)."""
    return {"name": name, "kind": "mllp", "host": "127.0.0.1", "port": port, "timeout_seconds": 5, **options}


def file_destination(name: str, directory: Path, **options: Any) -> dict[str, Any]:
    """A `[[destination]]` that writes files into `directory` (which it never creates)."""
    return {"name": name, "kind": "file", "directory": str(directory), **options}


def by_type(name: str, message_type: str, destinations: Sequence[str]) -> dict[str, Any]:
    """A `[[route]]` of the messages whose MSH-9.1 is `message_type`."""
    return {
        "name": name,
        "destinations": list(destinations),
        "when": {"field": "MSH-9.1", "op": "eq", "value": message_type},
    }


def write_pipeline(
    directory: Path,
    *,
    routes: Sequence[dict[str, Any]],
    destinations: Sequence[dict[str, Any]],
    transforms: Sequence[dict[str, Any]] = (),
) -> None:
    """Write a pipeline config dir: routes.toml, destinations.toml and (if any) transforms.toml,
    one dict per table, in the order given."""
    for kind, tables in (("route", routes), ("destination", destinations), ("transform", transforms)):
        if tables:
            (directory / f"{kind}s.toml").write_text(
                "".join(
                    f"\n[[{kind}]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in table.items())
                    for table in tables
                )
            )


def load_patient_classes(store: Store) -> None:
    with store.transaction() as tx:
        lookups.replace_table(tx, "patient_class", PATIENT_CLASS)


def send(port: int, texts: Sequence[str]) -> list[tuple[str, str]]:
    """Send `texts` in order over one connection with python-hl7's own MLLP client; the answers'
    (MSA-1, MSA-2)."""
    with MLLPClient("127.0.0.1", port) as client:
        answers = [hl7.parse(client.send_message(text).decode().strip("\x0b\x1c\r\n")) for text in texts]
    return [(str(a.segment("MSA")(1)), str(a.segment("MSA")(2))) for a in answers]
