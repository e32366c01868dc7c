"""The dashboard and the alert rules, evaluated by a real Prometheus against a live listenerd.

Debian's `prometheus` scrapes one listenerd (SQLite store) every second while messages flow: a
sender over MLLP, and the stages moved by tests/support/pump.py into two destinations, `ehr` and
`lab` (every fifth message goes nowhere: filtered). Then, through Prometheus's HTTP API:

* every panel query of deploy/grafana-dashboard.json answers series, each carrying the labels its
  legend names (Grafana's `$__rate_interval` set to the test's 10 s);
* every alert rule of deploy/alerts.yml parses and evaluates, Prometheus reports every rule
  healthy, and every metric a rule reads exists with the labels the rule groups and matches by;
* stopping `lab` fires `StagelineDestinationFailing{destination="lab"}` — and not for `ehr` —
  within the rule's `for` + its range window + a scrape interval (+ the store read's lag and cache,
  and a pump round). The rules are loaded with their times shrunk (`for: 5s`, ranges `[10s]`): a
  copy of deploy/alerts.yml, so the expressions are the shipped ones.

Every process and port it starts is stopped before it returns.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.store import Store
from include.store.lease import read_lease
from tests.conftest import migrated_sqlite
from tests.support import pump
from tests.support.hostile import adt

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCRAPE_SECONDS = 1
FOR_SECONDS = 5
RANGE_SECONDS = 10
STORE_READ_SECONDS = 4  # listeners/store_metrics.py: 2 s lag behind the store's clock + 2 s cache
PUMP_SECONDS = 0.3
LOADED_MACHINE_SECONDS = 3  # the test shares two cores with whatever else runs
NOT_ALWAYS_THERE = {
    "stageline_connections_refused_total": "a series appears with the first refused peer",
    "stageline_store_errors_total": "a series appears with the first failed store operation",
}
"""Metrics an alert rule reads that have no series until what they count happens once."""


class Traffic:
    """Messages in over MLLP and through the stages, until stopped; `lab_up` cleared: lab refuses."""

    def __init__(self, store: Store, port: int) -> None:
        self.store, self.port = store, port
        self.lab_up = threading.Event()
        self.lab_up.set()
        self._stop = threading.Event()
        self.sent = 0
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(20)

    def _run(self) -> None:
        try:
            epoch = read_lease(self.store).epoch
            with socket.create_connection(("127.0.0.1", self.port), timeout=15) as sock:
                n = 0
                while not self._stop.is_set():
                    sock.sendall(b"\x0b" + adt(f"T{n}", patient=f"P{n % 7}") + b"\x1c\r")
                    reply = b""
                    while not reply.endswith(b"\x1c\r"):
                        chunk = sock.recv(65536)
                        assert chunk, "listenerd closed the connection"
                        reply += chunk
                    assert b"MSA|AA|" in reply, reply
                    n += 1
                    pump.route(
                        self.store,
                        epoch=epoch,
                        run=n,
                        destinations=lambda row: [] if row["control_id"].endswith("5") else ["ehr", "lab"],
                    )
                    pump.deliver(
                        self.store,
                        epoch=epoch,
                        send=lambda row: row["destination"] != "lab" or self.lab_up.is_set(),
                        retry=pump.Retry(max_attempts=1000, backoff_seconds=60, max_backoff_seconds=60),
                    )
                    self.sent = n
                    self._stop.wait(PUMP_SECONDS)
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.errors.append(exc)


class Prometheus:
    def __init__(self, port: int) -> None:
        self.port = port

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]


def shrunk_rules(text: str) -> str:
    """deploy/alerts.yml with its times made test-sized: every `for` FOR_SECONDS, every range and
    offset RANGE_SECONDS. The expressions are otherwise the shipped ones."""
    text = re.sub(r"^(\s+for:\s*)\S+$", rf"\g<1>{FOR_SECONDS}s", text, flags=re.MULTILINE)
    text = re.sub(r"\[\d+[smh]\]", f"[{RANGE_SECONDS}s]", text)
    return re.sub(r"offset \d+[smh]", f"offset {RANGE_SECONDS}s", text)


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def panels() -> list[tuple[str, str, str]]:
    """(panel title, query, legend) of every target of the dashboard."""
    doc = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return [
        (p["title"], t["expr"].replace("$__rate_interval", f"{RANGE_SECONDS}s"), t.get("legendFormat", ""))
        for p in doc["panels"]
        for t in p.get("targets", [])
    ]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Prometheus, Traffic]]:
    assert shutil.which("prometheus"), "Debian's prometheus is missing: scripts/setup.sh installs it"
    config = migrated_sqlite(tmp_path / "stageline.db")
    mllp = free_port()
    daemon = Daemon(
        tmp_path / "node", config, node_id="solo:1:aa", inbound=[{"name": "adt-in", "kind": "mllp", "port": mllp}]
    )
    (tmp_path / "alerts.yml").write_text(shrunk_rules((DEPLOY / "alerts.yml").read_text()))
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
                "rule_files": [str(tmp_path / "alerts.yml")],
                "scrape_configs": [
                    {
                        "job_name": "stageline",
                        "metrics_path": "/metrics",
                        "authorization": {"type": "Bearer", "credentials": daemon.token},
                        "static_configs": [{"targets": [f"127.0.0.1:{daemon.api_port}"]}],
                    }
                ],
            }
        )
    )
    prom_port = free_port()
    store = Store(config)
    prom = None
    try:
        daemon.start()
        wait_for(lambda: port_open(mllp), timeout=20, what="listenerd binding MLLP")
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "prometheus.log", "wb"),  # closed with the process
        )
        wait_for(lambda: _ready(prom_port), timeout=20, interval=0.2, what="prometheus ready")
        with Traffic(store, mllp) as traffic:
            yield Prometheus(prom_port), traffic
            assert traffic.errors == []
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(10)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait(5)
            if prom.stderr is not None:
                prom.stderr.close()
        daemon.stop()
        store.close()
    assert not port_open(prom_port) and not port_open(daemon.api_port) and not port_open(mllp)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_every_panel_and_rule_evaluates_and_stopping_a_destination_fires_its_alert(stack) -> None:
    prom, traffic = stack
    wait_for(
        lambda: (
            prom.query('stageline_destination_messages_total{destination="lab",outcome="sent"} > 0')
            and prom.query("histogram_quantile(0.5, rate(stageline_delivery_latency_seconds_bucket[10s])) >= 0")
        ),
        timeout=40,
        interval=0.5,
        what="deliveries to lab on Prometheus",
    )
    assert traffic.errors == []

    # every panel answers series with the labels its legend names
    for title, expr, legend in panels():
        result = prom.query(expr)
        assert result, f"panel {title!r}: {expr} answers nothing"
        wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        for series in result:
            assert wanted <= set(series["metric"]), (title, expr, series["metric"])

    # every rule parses, evaluates and is healthy; every metric it reads exists with its labels
    loaded = prom.get("/api/v1/rules")
    health = {r["name"]: (r["health"], r.get("lastError", "")) for g in loaded["groups"] for r in g["rules"]}
    assert set(health) == {r["alert"] for r in rules()}
    assert {name: h for name, h in health.items() if h[0] != "ok"} == {}
    for rule in rules():
        prom.query(rule["expr"])  # evaluates (an error is an HTTP 400: urlopen raises)
        grouped = {
            label.strip()
            for clause in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", rule["expr"])
            for label in clause.split(",")
            if label.strip()
        }
        for metric in sorted(set(re.findall(r"\b((?:stageline|process)_\w+)", rule["expr"]))):
            if metric in NOT_ALWAYS_THERE:
                continue
            series = prom.query(metric)
            assert series, f"{rule['alert']}: no series of {metric}"
            assert all(grouped <= set(s["metric"]) for s in series), (rule["alert"], metric, grouped)

    # the lab stops answering: its alert fires, within for + range + a scrape (+ the store read and a
    # pump round); the EHR, still taking everything, raises nothing
    assert not prom.query('ALERTS{alertname="StagelineDestinationFailing"}')
    traffic.lab_up.clear()
    stopped = time.monotonic()
    # the last delivery reaches Prometheus a store read and a scrape after the stop; the range then
    # has to pass without one, then `for`; then an evaluation
    budget = (
        STORE_READ_SECONDS + SCRAPE_SECONDS + RANGE_SECONDS + FOR_SECONDS + SCRAPE_SECONDS + PUMP_SECONDS
    ) + LOADED_MACHINE_SECONDS

    def firing() -> list[dict[str, Any]]:
        return [
            a
            for a in prom.get("/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == "StagelineDestinationFailing" and a["state"] == "firing"
        ]

    fired = wait_for(firing, timeout=budget + 10, interval=0.25, what="StagelineDestinationFailing firing")
    took = time.monotonic() - stopped
    assert [a["labels"]["destination"] for a in fired] == ["lab"]
    assert fired[0]["labels"]["severity"] == "critical"
    assert took <= budget, f"fired {took:.1f} s after the stop; budget {budget:.1f} s"
    print(f"StagelineDestinationFailing fired {took:.1f} s after lab stopped (budget {budget:.1f} s)")
    assert traffic.errors == []
