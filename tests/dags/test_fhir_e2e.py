"""FHIR R4 output end to end (issue 27), on SQLite: python-hl7 sends ADT, ORU and ORM over MLLP to a
running `listenerd` → `dag.test()` runs stage_route, stage_transform (`output = "fhir-r4"`) and
stage_deliver (Spark local, in a subprocess) → a small FHIR server stand-in on a real socket receives
transaction Bundles (`application/fhir+json`), validates each with `fhir.resources` and applies its
conditional writes; a Bundle it refuses gets a 422 OperationOutcome, whose diagnostics become the
dead row's reason. A message sent twice (same MSH-10) leaves one set of resources on the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fhir.resources.R4B.bundle import Bundle

from include.app.lab.postgres_server import free_port
from include.store import Store
from tests.conftest import migrated_sqlite
from tests.dags.e2e import by_type, listenerd, mllp_inbound, run_stages, send, write_pipeline
from tests.dags.stores import rows
from tests.spark_jobs.test_senders import HttpReceiver, HttpRequest

REFUSAL = "Patient.identifier: a patient must be written conditionally (an identifier with a system)"

ADT = (
    "MSH|^~\\&|ADT1|HOSP|STAGELINE|SL|20240101120000||ADT^A01^ADT_A01|ADT1|P|2.5.1\r"
    "PID|1||P1^^^HOSP^MR||DOE^JOHN||19610615|M\rPV1|1|I\r"
)
ORU = (
    "MSH|^~\\&|LAB|LABFAC|STAGELINE|SL|20240101120000||ORU^R01^ORU_R01|ORU1|P|2.5.1\r"
    "PID|1||P1^^^HOSP^MR||DOE^JOHN\rOBR|1|ORD1|FIL1|24331-1^Lipid panel^LN\r"
    "OBX|1|NM|2093-3^Cholesterol^LN||196|mg/dL|<200|N|||F\r"
    "OBX|2|NM|2571-8^Triglyceride^LN||90|mg/dL|<150|N|||F\r"
)
ORM = (
    "MSH|^~\\&|CPOE|HOSP|STAGELINE|SL|20240101120000||ORM^O01|ORM1|P|2.5.1\r"
    "PID|1||P2^^^HOSP^MR||ROE^RICHARD\rORC|NW|ORD9\rOBR|1|ORD9||71020^CHEST XRAY 2V^CPT\r"
)
# An authority nobody configured: the Patient is a plain create, which this server refuses.
UNKEYED = ADT.replace("P1^^^HOSP^MR", "P3^^^ELSEWHERE^MR").replace("|ADT1|", "|ADT2|")
SIU = ADT.replace("ADT^A01^ADT_A01", "SIU^S12").replace("|ADT1|", "|SIU1|")
# Two patients' results in one message (ORU^R01's PATIENT_RESULT repeats): each under its own Patient.
TWO = (
    "MSH|^~\\&|LAB|LABFAC|STAGELINE|SL|20240101120000||ORU^R01^ORU_R01|ORU2|P|2.5.1\r"
    "PID|1||P4^^^HOSP^MR||ALPHA^ANN\rOBR|1|ORD4|FIL4|24331-1^Lipid panel^LN\r"
    "OBX|1|NM|2093-3^Cholesterol^LN||180|mg/dL\r"
    "PID|2||P5^^^HOSP^MR||BETA^BEN\rOBR|1|ORD5|FIL5|58410-2^CBC panel^LN\r"
    "OBX|1|NM|718-7^Hemoglobin^LN||9.1|g/dL\r"
)
SENT = [ADT, ORU, ORM, UNKEYED, SIU, ORU, TWO]  # the ORU twice: a re-send must not duplicate


@dataclass
class FhirStandIn:
    """A FHIR server's transaction endpoint on a real socket (`HttpReceiver`): validates each Bundle,
    applies conditional PUTs by their search URL (create or replace; references to another entry's
    fullUrl rewritten to that entry's search URL, as a server rewrites them to the ids it assigns),
    refuses a plain POST of a Patient with a 422 OperationOutcome."""

    resources: dict[str, dict[str, Any]] = field(default_factory=dict)

    def start(self) -> FhirStandIn:
        self.receiver = HttpReceiver(reply=self.answer).start()
        self.url = self.receiver.url
        return self

    def stop(self) -> None:
        self.receiver.stop()

    @property
    def posts(self) -> list[tuple[str | None, dict[str, Any]]]:
        return [(r.content_type, json.loads(r.body)) for r in self.receiver.requests]

    def answer(self, request: HttpRequest) -> tuple[int, str, bytes]:
        status, doc = self.transaction(json.loads(request.body))
        return status, "application/fhir+json", json.dumps(doc).encode()

    def transaction(self, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        Bundle.model_validate(doc)  # an invalid Bundle fails the test: the 500 below never hides it
        entries = doc["entry"]
        if any(e["request"]["method"] == "POST" and e["resource"]["resourceType"] == "Patient" for e in entries):
            outcome = {
                "resourceType": "OperationOutcome",
                "issue": [{"severity": "error", "code": "business-rule", "diagnostics": REFUSAL}],
            }
            return 422, outcome
        where = {e["fullUrl"]: e["request"]["url"] for e in entries}
        for e in entries:
            text = json.dumps(e["resource"])
            for full_url, url in where.items():
                text = text.replace(f'"{full_url}"', json.dumps(url))
            self.resources[e["request"]["url"]] = json.loads(text)
        return 200, {
            "resourceType": "Bundle",
            "type": "transaction-response",
            "entry": [{"response": {"status": "200 OK"}} for _ in entries],
        }


@dataclass
class Outcome:
    store: Store
    server: FhirStandIn


@pytest.fixture(scope="module")
def outcome(airflow_db, tmp_path_factory) -> Iterator[Outcome]:
    work = tmp_path_factory.mktemp("fhir")
    config = migrated_sqlite(work / "stageline.db")
    server = FhirStandIn().start()
    port = free_port()
    store = Store(config)
    try:
        with listenerd(work / "node", config, node_id="solo:1:fhir", inbound=[mllp_inbound("in", port)]) as daemon:
            write_pipeline(
                daemon.workdir / "config",
                routes=[by_type(t, t, ["ehr"]) for t in ("ADT", "ORU", "ORM", "SIU")],
                destinations=[{"name": "ehr", "kind": "http", "url": server.url, "timeout_seconds": 5}],
                transforms=[
                    {
                        "destination": "ehr",
                        "output": "fhir-r4",
                        "fhir": {"identifier_systems": {"HOSP": "urn:oid:2.16.840.1.113883.19.5"}},
                    }
                ],
            )
            answers = send(port, SENT)
            assert [a[0] for a in answers] == ["AA"] * len(SENT)
            results = run_stages(daemon)
            assert all(state == "success" for r in results for state in r["states"].values()), results
        yield Outcome(store, server)
    finally:
        server.stop()
        store.close()


def routed(o: Outcome) -> dict[str, list[tuple[str, str | None]]]:
    found = rows(o.store, "SELECT control_id, status, last_error FROM stage_routed ORDER BY id")
    out: dict[str, list[tuple[str, str | None]]] = {}
    for r in found:
        out.setdefault(r["control_id"], []).append((r["status"], r["last_error"]))
    return out


def test_bundles_are_posted_as_fhir_json_and_re_sends_do_not_duplicate(outcome: Outcome) -> None:
    posts = outcome.server.posts
    assert {ct for ct, _ in posts} == {"application/fhir+json"}
    accepted = [doc for _, doc in posts if not any(e["request"]["method"] == "POST" for e in doc["entry"])]
    types = sorted(e["resource"]["resourceType"] for doc in accepted for e in doc["entry"])
    # ADT: Patient + Encounter; ORU twice: Patient + report + 2 observations each; ORM: Patient + order;
    # the two-patient ORU: a Patient, a report and an observation each.
    assert types == sorted(
        ["Patient", "Encounter"]
        + 2 * ["Patient", "DiagnosticReport", "Observation", "Observation"]
        + ["Patient", "ServiceRequest"]
        + 2 * ["Patient", "DiagnosticReport", "Observation"]
    )
    kinds = sorted(url.split("?")[0] for url in outcome.server.resources)
    # The second ORU updated what the first created: one set of its resources on the server.
    assert kinds == [
        *(["DiagnosticReport"] * 3),
        "Encounter",
        *(["Observation"] * 4),
        *(["Patient"] * 4),
        "ServiceRequest",
    ]
    patient_p1 = outcome.server.resources["Patient?identifier=urn%3Aoid%3A2.16.840.1.113883.19.5|P1"]
    assert patient_p1["name"] == [{"family": "DOE", "given": ["JOHN"]}]
    assert {c: [s for s, _ in v] for c, v in routed(outcome).items() if c != "ADT2" and c != "SIU1"} == {
        "ADT1": ["done"],
        "ORU1": ["done", "done"],
        "ORM1": ["done"],
        "ORU2": ["done"],
    }


def test_each_patients_results_land_under_that_patient_on_the_server(outcome: Outcome) -> None:
    """The two-patient ORU on the server: each report and observation refers to its own Patient."""
    patient = "Patient?identifier=urn%3Aoid%3A2.16.840.1.113883.19.5|{}".format
    subjects = {
        (r["resourceType"], r["code"]["coding"][0]["code"]): r["subject"]["reference"]
        for r in outcome.server.resources.values()
        if r["resourceType"] in ("DiagnosticReport", "Observation") and r["subject"]["reference"] != patient("P1")
    }
    assert subjects == {
        ("DiagnosticReport", "24331-1"): patient("P4"),
        ("Observation", "2093-3"): patient("P4"),
        ("DiagnosticReport", "58410-2"): patient("P5"),
        ("Observation", "718-7"): patient("P5"),  # B's hemoglobin is under B
    }
    assert outcome.server.resources[patient("P5")]["name"] == [{"family": "BETA", "given": ["BEN"]}]


def test_a_refused_bundle_is_dead_with_the_servers_operation_outcome(outcome: Outcome) -> None:
    [(status, _reason)] = routed(outcome)["ADT2"]
    outbound = rows(outcome.store, "SELECT status, last_error FROM stage_outbound WHERE control_id = 'ADT2'")
    assert outbound == [
        {
            "status": "dead",
            "last_error": "permanent: ehr: HTTP 422 Unprocessable Entity: "
            f"OperationOutcome: error business-rule: {REFUSAL}",
        }
    ]
    assert status == "done"  # transformed; the delivery is what failed


def test_a_message_the_mapping_cannot_take_is_dead_with_its_reason(outcome: Outcome) -> None:
    assert routed(outcome)["SIU1"] == [("dead", "fhir-r4: no FHIR mapping for message type SIU^S12")]
