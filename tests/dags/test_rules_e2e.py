"""Issue 13's routing, `when` transforms and code escape hatch end to end, on SQLite and PostgreSQL:
python-hl7 sends over MLLP to a running `listenerd` on two inbound connections → `dag.test()` runs
stage_route, stage_transform and stage_deliver (Spark local, in a subprocess) → python-hl7 MLLP
receivers and file destinations get what the rules say, and what a rule or the code hook refused is
dead in the store with its reason.

One pipeline run per backend (a module fixture: a JVM start is the bulk of the time), three tests
reading its outcome — one per capability."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import hl7
import pytest

from include.app.lab.postgres_server import PostgresServer, free_port
from include.store import Store
from tests.conftest import TEMPLATE_DB, migrated_sqlite, pg_config
from tests.dags.e2e import (
    file_destination,
    listenerd,
    load_patient_classes,
    mllp_destination,
    mllp_inbound,
    run_stages,
    send,
    write_pipeline,
)
from tests.dags.stores import rows
from tests.spark_jobs.test_senders import MllpReceiver

_dbs = itertools.count()
HOOK = '''
"""A user's escape hatch (`code = "lab_hooks:stamp"`): python-hl7 in, python-hl7 out."""


def stamp(message):
    if str(message["PID.F3.R1.C1"]) == "BAD":
        raise ValueError("lab system rejects test patient")
    message["MSH.F5"] = "HOOKED"
    return message
'''


def adt(control_id: str, patient: str, visit: str | None) -> str:
    pv1 = f"PV1|1|{visit}\r" if visit is not None else ""
    return (
        f"MSH|^~\\&|ADT1|HOSP|STAGELINE|SL|20240101120000||ADT^A01^ADT_A01|{control_id}|P|2.5.1\r"
        f"PID|1||{patient}^^^HOSP^MR||DOE^JOHN||19610615\r{pv1}"
    )


def oru(control_id: str, patient: str, *flags: str) -> str:
    obx = "".join(f"OBX|{i}|NM|2345-7^Glucose^LN||{90 + i}|mg/dL|70-99|{flag}|||F\r" for i, flag in enumerate(flags, 1))
    return (
        f"MSH|^~\\&|LAB|LABFAC|STAGELINE|SL|20240101120000||ORU^R01^ORU_R01|{control_id}|P|2.5.1\r"
        f"PID|1||{patient}^^^HOSP^MR||DOE^JANE\rOBR|1|ORD1\r{obx}"
    )


SENT = {  # control id -> (connection, text)
    "ADT1": ("adt-in", adt("ADT1", "P1", "I")),  # inpatient: MSH-5 set (when), new control id
    "ADT2": ("adt-in", adt("ADT2", "P2", "O")),  # outpatient: MSH-5 left alone
    "ADT3": ("adt-in", adt("ADT3", "P3", "X")),  # unknown patient class: map dead-letters it
    "ADT4": ("adt-in", adt("ADT4", "P4", None)),  # no PV1: no route but the catch-all
    "ORU1": ("lab-in", oru("ORU1", "P1", "N", "N")),  # lab connection: to the hooked destination
    "ORU2": ("lab-in", oru("ORU2", "P2", "N", "H")),  # any OBX abnormal: alerts too
    "ORU3": ("lab-in", oru("ORU3", "BAD", "N")),  # the hook raises: dead, alone
}


def pipeline_config(directory: Path, *, ehr: int, alerts: int, lab: Path, archive: Path) -> None:
    write_pipeline(
        directory,
        routes=[
            {
                "name": "admissions",
                "destinations": ["ehr"],
                "when": {"all": [{"field": "MSH-9.1", "op": "eq", "value": "ADT"}, {"segment": "PV1"}]},
            },
            {"name": "lab-feed", "destinations": ["lab"], "when": {"connection": "lab-in"}},
            {
                "name": "abnormal",
                "destinations": ["alerts"],
                "when": {"field": "OBX-8", "op": "in", "value": ["H", "HH", "L", "LL"], "segments": "any"},
            },
            {"name": "the-rest", "destinations": ["archive"], "catch_all": True},
        ],
        destinations=[
            mllp_destination("ehr", ehr),
            mllp_destination("alerts", alerts),
            file_destination("lab", lab, code="lab_hooks:stamp"),
            file_destination("archive", archive),
        ],
        transforms=[
            {
                "destination": "ehr",
                "rules": [
                    {"set": "MSH-5", "value": "WARDS", "when": {"field": "PV1-2", "op": "eq", "value": "I"}},
                    {"map": "PV1-2", "table": "patient_class", "not_found": "dead_letter"},
                    {"format_date": "PID-7", "to_format": "yyyy-MM-dd"},
                    {"set": "MSH-10", "generate": "control_id", "prefix": "SL"},
                ],
            }
        ],
    )
    (directory / "code").mkdir()
    (directory / "code" / "lab_hooks.py").write_text(HOOK)


@dataclass
class Outcome:
    store: Store
    ehr: list[str]
    alerts: list[str]
    lab: dict[str, str]
    archive: dict[str, str]
    message_ids: dict[str, str]


def field(text: str, path: str) -> str:
    return str(hl7.parse(text)[path])


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def outcome(request, airflow_db, tmp_path_factory) -> Iterator[Outcome]:
    work = tmp_path_factory.mktemp(f"rules-{request.param}")
    server: PostgresServer | None = None
    if request.param == "sqlite":
        config = migrated_sqlite(work / "stageline.db")
    else:
        server = request.getfixturevalue("pg_server")
        name = f"rules{next(_dbs)}"
        server.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
        config = pg_config(server, name)
    ehr, alerts = MllpReceiver().start(), MllpReceiver().start()
    ports = {"adt-in": free_port(), "lab-in": free_port()}
    store = Store(config)
    lab, archive = work / "out" / "lab", work / "out" / "archive"
    with listenerd(
        work / "node",
        config,
        node_id="solo:1:rules",
        receivers=(ehr, alerts),
        inbound=[mllp_inbound(n, p) for n, p in ports.items()],
    ) as daemon:
        lab.mkdir(parents=True)
        archive.mkdir(parents=True)
        pipeline_config(daemon.workdir / "config", ehr=ehr.port, alerts=alerts.port, lab=lab, archive=archive)
        load_patient_classes(store)
        for control_id, (connection, text) in SENT.items():
            assert send(ports[connection], [text]) == [("AA", control_id)]
        results = run_stages(daemon)
        assert all(state == "success" for r in results for state in r["states"].values()), results
    message_ids = {
        r["control_id"]: r["message_id"] for r in rows(store, "SELECT control_id, message_id FROM stage_inbound")
    }
    yield Outcome(
        store=store,
        ehr=ehr.texts,
        alerts=alerts.texts,
        lab={p.name: p.read_bytes().decode() for p in lab.iterdir()},
        archive={p.name: p.read_bytes().decode() for p in archive.iterdir()},
        message_ids=message_ids,
    )
    store.close()
    if server is not None:
        server.execute(f"DROP DATABASE IF EXISTS {config.database} WITH (FORCE)")


def routed(o: Outcome) -> dict[tuple[str, str], tuple[str, str, str | None]]:
    found = rows(o.store, "SELECT control_id, destination, route_name, status, last_error FROM stage_routed")
    return {(r["control_id"], r["destination"]): (r["route_name"], r["status"], r["last_error"]) for r in found}


def test_routing_by_segment_presence_connection_any_obx_and_a_catch_all(outcome: Outcome) -> None:
    assert {k: v[0] for k, v in routed(outcome).items()} == {
        ("ADT1", "ehr"): "admissions",
        ("ADT2", "ehr"): "admissions",
        ("ADT3", "ehr"): "admissions",
        ("ADT4", "archive"): "the-rest",
        ("ORU1", "lab"): "lab-feed",
        ("ORU2", "lab"): "lab-feed",
        ("ORU2", "alerts"): "abnormal",
        ("ORU3", "lab"): "lab-feed",
    }
    assert rows(outcome.store, "SELECT DISTINCT status FROM stage_inbound") == [{"status": "done"}]
    assert outcome.alerts == [SENT["ORU2"][1]]  # no rules for alerts: byte for byte
    assert outcome.archive == {f"{outcome.message_ids['ADT4']}-archive.hl7": SENT["ADT4"][1]}


def test_when_rules_generated_control_ids_and_a_map_dead_letter(outcome: Outcome) -> None:
    got = sorted(outcome.ehr, key=lambda t: field(t, "PID.F3.R1.C1"))
    assert [field(t, "PID.F3.R1.C1") for t in got] == ["P1", "P2"]  # P3 dead-lettered, never sent
    adt1, adt2 = got
    control_ids = [field(t, "MSH.F10") for t in got]
    assert all(c.startswith("SL") and len(c) == 20 for c in control_ids) and len(set(control_ids)) == 2
    assert adt1 == SENT["ADT1"][1].replace("|STAGELINE|SL|", "|WARDS|SL|").replace(
        "|ADT1|P|", f"|{control_ids[0]}|P|"
    ).replace("19610615", "1961-06-15").replace("PV1|1|I", "PV1|1|IN")
    assert adt2 == SENT["ADT2"][1].replace("|ADT2|P|", f"|{control_ids[1]}|P|").replace(
        "19610615", "1961-06-15"
    ).replace("PV1|1|O", "PV1|1|OUT")  # when false: MSH-5 kept
    assert routed(outcome)[("ADT3", "ehr")][1:] == (
        "dead",
        "dead-lettered: the value at PV1-2 is not in lookup table 'patient_class'",
    )
    outbound = rows(
        outcome.store, "SELECT control_id, destination, status FROM stage_outbound WHERE destination = 'ehr'"
    )
    assert sorted((r["control_id"], r["status"]) for r in outbound) == [("ADT1", "done"), ("ADT2", "done")]


def test_the_code_hook_rewrites_its_destinations_messages_and_a_raising_one_dies_alone(outcome: Outcome) -> None:
    ids = outcome.message_ids
    assert outcome.lab == {
        f"{ids[c]}-lab.hl7": SENT[c][1].replace("|STAGELINE|SL|", "|HOOKED|SL|") for c in ("ORU1", "ORU2")
    }
    assert routed(outcome)[("ORU3", "lab")][1:] == (
        "dead",
        "code hook lab_hooks:stamp raised ValueError: lab system rejects test patient",
    )
    trail = rows(
        outcome.store,
        "SELECT stage, destination, event, to_status FROM message_events "
        f"WHERE message_id = '{ids['ORU3']}' ORDER BY id",
    )
    assert [tuple(e.values()) for e in trail] == [
        ("inbound", None, "received", "pending"),
        ("inbound", None, "done", "done"),
        ("routed", "lab", "routed", "pending"),
        ("routed", "lab", "dead", "dead"),
    ]
