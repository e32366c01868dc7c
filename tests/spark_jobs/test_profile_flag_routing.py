"""``on_violation = "flag"`` end to end: a real listenerd on real SQLite and PostgreSQL answers every
message ``AA`` and stages the ones with findings with their findings; `stageline messages show`,
the API's message read and the Stageline view's message page list them; the route stage (real
Spark) routes on them with ``when = { findings = … }`` and ``{ finding = "103" }``, natively."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from stageline_airflow.view_html import findings_part

from include.routes_config import parse_routes
from include.store import Store, operator
from include.store.stages import ROUTE
from spark_jobs import stage_job
from spark_jobs.route_job import routed_rows
from tests.listeners.conftest import leading_node
from tests.listeners.test_ack_codes import exchange, mllp
from tests.test_cli import run, service_toml

PROFILES = Path(__file__).resolve().parents[2] / "config" / "profiles"
GOOD = (
    "MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
    "EVN|A01|20240101120000\rPID|1||P1^^^HOSP^MR||DOE^JANE||19800101|F\rPV1|1|I\r"
)
ROUTES = parse_routes(
    [
        {"name": "clean", "destinations": ["ehr"], "when": {"findings": 0}},
        {"name": "review", "destinations": ["review"], "when": {"findings": 0, "op": "gt"}},
        {"name": "codes", "destinations": ["codes"], "when": {"finding": "103"}},
        {"name": "many", "destinations": ["many"], "when": {"findings": 2, "op": "ge"}},
        {"name": "over20", "destinations": ["over20"], "when": {"findings": 20, "op": "gt"}},
        {"name": "late", "destinations": ["late"], "when": {"finding": "102"}},
    ]
)


@pytest.fixture
def daemon(tmp_path, store_config):
    d = leading_node(
        tmp_path, store_config, idle_timeout_seconds=30, profile=str(PROFILES / "adt_a01.toml"), on_violation="flag"
    )
    yield d
    d.stop()


def test_flag_stages_with_findings_shows_them_and_routes_on_them(daemon, store_config, spark, monkeypatch, tmp_path):
    bad_class = GOOD.format(cid="F1").replace("PV1|1|I", "PV1|1|Q")  # one 103
    two = GOOD.format(cid="F2").replace("19800101|F", "19801301|F").replace("PID|1||P1^^^HOSP^MR", "PID|1||")
    obx = "OBX|{n}|NM|2345-7^Glucose^LN||95|mg/dL|70-99|{flag}|||{status}\r"
    # 22 findings: 21 OBX-8 outside table 0078 (103), then an OBX-11 that repeats (102), past the 20 stored
    past_cap = GOOD.format(cid="F3") + "".join(obx.format(n=n, flag="NOPE", status="F") for n in range(1, 22))
    past_cap += obx.format(n=22, flag="N", status="F~F")
    frames = [mllp(GOOD.format(cid="OK1")), mllp(bad_class), mllp(two), mllp(past_cap)]
    acks = exchange(daemon.mllp_port, frames, expect=4)
    assert [(str(a.segment("MSA")[1]), str(a.segment("MSA")[2])) for a in acks] == [
        ("AA", "OK1"),
        ("AA", "F1"),
        ("AA", "F2"),
        ("AA", "F3"),
    ]
    store = Store(store_config)
    try:
        staged = {r["control_id"]: r for r in _rows(store, "SELECT id, control_id, findings FROM stage_inbound")}
        (epoch,) = [r["epoch"] for r in _rows(store, "SELECT epoch FROM leader_lease WHERE id = 1")]
        assert staged["OK1"]["findings"] is None
        assert json.loads(staged["F1"]["findings"]) == [
            {"code": "103", "where": "PV1^1^2", "text": "PV1-2 (Patient Class) is not in HL7 table 0004"}
        ]
        assert [(f["code"], f["where"]) for f in json.loads(staged["F2"]["findings"])] == [
            ("101", "PID^1^3"),
            ("102", "PID^1^7^1^1"),
        ]
        stored = json.loads(staged["F3"]["findings"])
        assert len(stored) == 20 and (stored[0]["total"], stored[0]["codes"]) == (22, ["102", "103"])

        outcome = stage_job.run_stage_job(
            ROUTE,
            store,
            spark,
            transform=partial(routed_rows, routes=ROUTES),
            owner="node-a/profiles",
            epoch=epoch,
            run_id="profiles-1",
        )
        assert outcome is not None
        routed = sorted((r["source_id"], r["destination"]) for r in _rows(store, "SELECT * FROM stage_routed"))
    finally:
        store.close()
    ok1, f1, f2, f3 = (staged[c]["id"] for c in ("OK1", "F1", "F2", "F3"))
    assert routed == sorted(
        [(ok1, "ehr"), (f1, "review"), (f1, "codes"), (f2, "review"), (f2, "many"), (f2, "late")]
        + [(f3, d) for d in ("review", "codes", "many", "over20", "late")]  # the count and the 102 past the cap
    )

    code, body = daemon.get(f"/messages/{f1}")
    assert code == 200
    assert json.loads(json.loads(body)["inbound"]["findings"]) == [
        {"code": "103", "where": "PV1^1^2", "text": "PV1-2 (Patient Class) is not in HL7 table 0004"}
    ]
    assert "payload" not in json.loads(body)["inbound"]  # findings name rules, not values: no body read
    store = Store(store_config)
    try:
        story = operator.show(store, f2)
    finally:
        store.close()
    section = findings_part(story.inbound["findings"])
    assert "<h3>Profile findings (2)</h3>" in section
    assert "<tr><td>101</td><td>PID^1^3</td><td>PID-3 (Patient Identifier List) is required</td></tr>" in section
    assert findings_part(None) == ""
    assert "<h3>Profile findings (22, the first 20 listed)</h3>" in findings_part(staged["F3"]["findings"])

    shown = run(service_toml(tmp_path, store_config), "messages", "show", str(f1)).stdout
    assert "profile findings: 1\n    103 PV1^1^2  PV1-2 (Patient Class) is not in HL7 table 0004" in shown
    shown = run(service_toml(tmp_path, store_config), "messages", "show", str(f3)).stdout
    assert "profile findings: 22, the first 20 listed\n    103 OBX^1^8  OBX-8" in shown
    assert "profile findings" not in run(service_toml(tmp_path, store_config), "messages", "show", str(ok1)).stdout


def _rows(store: Store, sql: str) -> list[dict]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(sql)
        return list(cur.fetchall())
