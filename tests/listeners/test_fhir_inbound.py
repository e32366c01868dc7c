"""FHIR R4 JSON on the HTTP inbound (`accept = ["hl7v2", "fhir"]`): a real listenerd, real sockets,
real SQLite / PostgreSQL. A valid resource or Bundle is staged as sent; anything else gets a 4xx
OperationOutcome saying what and where, and nothing is staged."""

from __future__ import annotations

import json

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from tests.listeners.hl7_traffic import adt, post_message
from tests.listeners.test_ack_codes import staged_ids

FHIR = "application/fhir+json"
LIMIT = 8192

PATIENT = {
    "resourceType": "Patient",
    "id": "pat-1",
    "identifier": [{"system": "urn:oid:1.2.3", "value": "MRN1"}],
    "name": [{"family": "Doe", "given": ["Jane"]}],
    "gender": "female",
    "birthDate": "1970-01-01",
}
BUNDLE = {
    "resourceType": "Bundle",
    "identifier": {"system": "urn:sender", "value": "bundle-7"},
    "type": "transaction",
    "entry": [
        {"resource": PATIENT, "request": {"method": "PUT", "url": "Patient/pat-1"}},
        {
            "resource": {
                "resourceType": "Observation",
                "status": "final",
                "code": {"coding": [{"system": "http://loinc.org", "code": "8867-4"}]},
                "valueQuantity": {"value": 72, "unit": "/min"},
            },
            "request": {"method": "POST", "url": "Observation"},
        },
    ],
}


@pytest.fixture
def node(tmp_path, store_config):
    port, hl7_port, big_port = free_port(), free_port(), free_port()
    inbound = [
        {"name": "fhir-in", "kind": "http", "port": port, "accept": ["hl7v2", "fhir"], "max_message_bytes": LIMIT},
        {"name": "v2-in", "kind": "http", "port": hl7_port, "accept": ["hl7v2"]},
        {"name": "big-fhir", "kind": "http", "port": big_port, "accept": ["fhir"]},
    ]
    d = Daemon(tmp_path / "node", store_config, node_id="solo:1:aa", inbound=inbound).start()
    try:
        wait_for(lambda: all(port_open(p) for p in (port, hl7_port, big_port)), timeout=30, what="bind")
        d.fhir_port, d.hl7_port, d.big_port = port, hl7_port, big_port
        yield d
    finally:
        assert d.stop() == 0


def post_fhir(port: int, body: object, *, content_type: str = FHIR, connection: str = "fhir-in"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    kinds: list = []
    status, answer = post_message(port, connection, data, content_type=content_type, answer_type=kinds)
    return status, kinds[0], answer


def test_a_resource_and_a_bundle_are_staged_as_sent_beside_hl7_v2(node, store_config):
    patient = json.dumps(PATIENT, indent=1).encode()
    status, kind, answer = post_fhir(node.fhir_port, patient)
    assert (status, kind) == (202, "application/json") and answer["message_id"]
    status, _, answer = post_fhir(node.fhir_port, BUNDLE)
    assert status == 202 and answer["message_id"]
    assert post_message(node.fhir_port, "fhir-in", adt("V2-1").encode())[0] == 202  # HL7 v2 still taken
    assert staged_ids(store_config) == ["pat-1", "bundle-7", "V2-1"]
    payloads = staged_ids(store_config, "payload")
    assert payloads[0] == patient.decode() and json.loads(payloads[1]) == BUNDLE


REFUSED = [
    # (what, body, content type, status, issue code, expression or diagnostics start)
    ("a bad date", {**PATIENT, "birthDate": "1970-13-45"}, FHIR, 400, "invalid", "Patient.birthDate"),
    ("an unknown element", {**PATIENT, "shoeSize": 44}, FHIR, 400, "invalid", "Patient.shoeSize"),
    (
        "a bad element inside a Bundle entry",
        {**BUNDLE, "entry": [{"resource": {**PATIENT, "active": "maybe"}}]},
        FHIR,
        400,
        "invalid",
        "Bundle.entry[0].resource.active",
    ),
    ("no resourceType", {"id": "x"}, FHIR, 400, "required", "resourceType is missing"),
    ("a made-up resourceType", {"resourceType": "Spaceship"}, FHIR, 400, "not-supported", "resourceType 'Spaceship'"),
    (
        "a data type, not a resource",
        {"resourceType": "HumanName", "family": "Doe"},
        FHIR,
        400,
        "not-supported",
        "resourceType 'HumanName'",
    ),
    (
        "an abstract resource",
        {"resourceType": "DomainResource"},
        FHIR,
        400,
        "not-supported",
        "resourceType 'DomainResource'",
    ),
    (
        "a resourceType that is no name",
        {"resourceType": "../Patient"},
        FHIR,
        400,
        "not-supported",
        "resourceType 'Patient'",
    ),
    ("not JSON", b'{"resourceType": "Patient",', FHIR, 400, "structure", "not JSON at line 1"),
    ("a JSON array", b"[1, 2]", FHIR, 400, "structure", "the body must be one JSON object"),
    ("nested past any limit", b"[" * 4000 + b"]" * 4000, FHIR, 400, "structure", "JSON nested too deeply"),
    ("not UTF-8", b'{"resourceType": "Patient", "id": "\xff"}', FHIR, 400, "structure", "not UTF-8"),
    ("a charset other than UTF-8", PATIENT, FHIR + "; charset=latin-1", 415, "not-supported", "FHIR JSON is UTF-8"),
    ("over max_message_bytes", {**PATIENT, "id": "x" * LIMIT}, FHIR, 413, "too-long", "message too large"),
]


@pytest.mark.parametrize(
    ("what", "body", "content_type", "status", "code", "where"), REFUSED, ids=[r[0] for r in REFUSED]
)
def test_a_body_that_is_not_a_valid_r4_resource_gets_an_operation_outcome(
    node, store_config, what, body, content_type, status, code, where
):
    got, kind, outcome = post_fhir(node.fhir_port, body, content_type=content_type)
    assert (got, kind) == (status, FHIR)
    assert outcome["resourceType"] == "OperationOutcome"
    issue = outcome["issue"][0]
    assert (issue["severity"], issue["code"]) == ("error", code)
    assert where in issue.get("expression", []) or issue["diagnostics"].startswith(where)
    assert "1970-13-45" not in json.dumps(outcome)  # the sender's values are not echoed
    assert staged_ids(store_config) == []


def test_fhir_goes_only_where_it_is_accepted(node, store_config):
    status, kind, answer = post_fhir(node.hl7_port, PATIENT, connection="v2-in")
    assert (status, kind) == (415, "application/json")
    assert answer == {"error": "unsupported content type; use text/plain or application/hl7-v2"}
    assert staged_ids(store_config) == []


def test_a_large_bundle_is_validated_off_the_reactor_with_the_same_answers(node, store_config):
    """Past 64 KiB a body is validated on a thread (listeners/offload.py); a FHIR-only connection
    takes plain application/json too and refuses HL7 v2 with an OperationOutcome."""
    entries = [{"resource": {**PATIENT, "id": f"p{i}"}} for i in range(400)]
    big = {"resourceType": "Bundle", "id": "big-1", "type": "collection", "entry": entries}
    assert len(json.dumps(big)) > 64 * 1024
    status, _, answer = post_fhir(node.big_port, big, connection="big-fhir", content_type="application/json")
    assert status == 202 and answer["message_id"]
    entries[399]["resource"]["birthDate"] = "yesterday"
    status, kind, outcome = post_fhir(node.big_port, {**big, "id": "big-2"}, connection="big-fhir")
    assert (status, kind) == (400, FHIR)
    assert outcome["issue"][0]["expression"] == ["Bundle.entry[399].resource.birthDate"]
    status, kind, outcome = post_fhir(
        node.big_port, adt("V2-2").encode(), connection="big-fhir", content_type="application/hl7-v2"
    )
    assert (status, kind, outcome["issue"][0]["code"]) == (415, FHIR, "not-supported")
    assert staged_ids(store_config) == ["big-1"]
