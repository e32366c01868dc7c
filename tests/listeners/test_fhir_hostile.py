"""FHIR inbound against what a red team sent it (issue 27): a real listenerd on SQLite, real sockets.

Costly bodies are refused before any model sees them and validated on FHIR's own bounded threads
(an MLLP sender never waits for them); a key given twice, a nested resource of no known type, an
R4B-only or R4-only resource, a Bundle identifier that cannot be a control id: each a 4xx
OperationOutcome saying where, never a 500, nothing staged, nothing of the body in the log."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from tests.conftest import migrated_sqlite
from tests.listeners.hl7_traffic import adt
from tests.listeners.test_ack_codes import staged_ids

FHIR = "application/fhir+json"
BIG = 8 * 1024 * 1024


def start_node(workdir: Path) -> Daemon:
    ports = {name: free_port() for name in ("fhir", "mllp")}
    inbound = [
        {"name": "fhir", "kind": "http", "port": ports["fhir"], "accept": ["hl7v2", "fhir"], "max_message_bytes": BIG},
        {"name": "mllp", "kind": "mllp", "port": ports["mllp"]},
    ]
    store = migrated_sqlite(workdir / "stageline.db")
    d = Daemon(workdir / "node", store, node_id="solo:1:aa", inbound=inbound).start()
    wait_for(lambda: all(port_open(p) for p in ports.values()), timeout=30, what="bind")
    d.ports = ports
    return d


@pytest.fixture
def node(tmp_path):
    d = start_node(tmp_path)
    try:
        yield d
    finally:
        assert d.stop() == 0


@pytest.fixture(scope="module")
def refusing_node(tmp_path_factory):
    """One daemon for the refusals: none of them stages anything."""
    d = start_node(tmp_path_factory.mktemp("refusing"))
    try:
        yield d
    finally:
        assert d.stop() == 0


def post(node, body: bytes | str | dict, *, timeout: float = 120) -> tuple[int, dict, dict]:
    """(status, headers, JSON answer) of a FHIR POST."""
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{node.ports['fhir']}/messages/fhir", data=data, headers={"Content-Type": FHIR}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def mllp(node, payload: str, *, timeout: float = 60) -> tuple[float, bytes]:
    """Seconds until the ACK of one MLLP frame, and the ACK."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", node.ports["mllp"]), timeout) as s:
        s.sendall(b"\x0b" + payload.encode() + b"\x1c\r")
        got = b""
        while b"\x1c" not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return time.monotonic() - start, got


def peak_rss_mb(node) -> float:
    for line in open(f"/proc/{node.proc.pid}/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def empty_names(size: int) -> str:
    """The red team's costliest shape: a Patient with `size` bytes of empty names."""
    head, tail = '{"resourceType":"Patient","id":"p","name":[', "]}"
    return head + ",".join(["{}"] * ((size - len(head) - len(tail)) // 3)) + tail


def test_a_body_of_millions_of_values_is_refused_at_parse_cost_and_mllp_goes_on(node):
    """4 MiB of empty names cost 80 s of CPU and 1.2 GB before; now the parse stops at the bound."""
    body = empty_names(4 * 1024 * 1024)
    answers: list = []
    sender = threading.Thread(target=lambda: answers.append(post(node, body)))
    start = time.monotonic()
    sender.start()
    took, ack = mllp(node, adt("DURING-1"))
    sender.join(60)
    status, _, outcome = answers[0]
    assert status == 413 and outcome["issue"][0]["code"] == "too-costly"
    assert "max_fhir_elements" in outcome["issue"][0]["diagnostics"]
    assert time.monotonic() - start < 10
    assert b"MSA|AA|DURING-1" in ack and took < 5
    assert peak_rss_mb(node) < 400
    assert staged_ids(node.store) == ["DURING-1"]


def test_fhir_has_its_own_bounded_threads_and_a_full_queue_is_503_with_retry_after(node):
    """Fourteen costly-but-allowed bodies at once (a peer may hold 16 connections): 2 in work and
    8 queued, the rest refused with 503 at once; an MLLP batch sent meanwhile (a large input: it
    takes the shared gate) is not held."""
    body = empty_names(140_000)  # ~46,000 values: under the default bound, about half a second each
    answers: list = []
    senders = [threading.Thread(target=lambda: answers.append(post(node, body))) for _ in range(14)]
    for s in senders:
        s.start()
    time.sleep(0.3)
    messages = "".join(adt(f"B{i}") for i in range(400))
    batch = f"BHS|^~\\&|SENDAPP|SENDFAC\r{messages}BTS|400\r"
    assert len(batch) > 64 * 1024
    took, ack = mllp(node, batch)
    for s in senders:
        s.join(120)
    assert b"MSA|AA" in ack and took < 8
    statuses = sorted(a[0] for a in answers)
    assert statuses.count(503) >= 1 and set(statuses) <= {202, 503}
    busy = next(a for a in answers if a[0] == 503)
    assert busy[1]["Retry-After"] == "1" and busy[2]["issue"][0]["code"] == "transient"
    assert peak_rss_mb(node) < 600


REFUSED = [
    # (what, body, status, issue code, expression or diagnostics start)
    ("a key twice", '{"resourceType":"Patient","gender":"male","gender":"female"}', 400, "structure", "Patient.gender"),
    (
        "a key twice, deep and spelled with an escape",
        '{"resourceType":"Patient","name":[{"given":["a"],"\\u0067iven":["b"]}]}',
        400,
        "structure",
        "Patient.name[0].given",
    ),
    (
        "resourceType twice",
        '{"resourceType":"Patient","id":"d3","resourceType":"Basic","code":{"text":"x"}}',
        400,
        "structure",
        "Patient.resourceType",
    ),
    (
        "a contained resource of no known type",
        {"resourceType": "Patient", "contained": [{"resourceType": "FooType"}]},
        400,
        "not-supported",
        "Patient.contained[0].resourceType",
    ),
    (
        "a contained resourceType that is a number",
        {"resourceType": "Patient", "contained": [{"resourceType": 5}]},
        400,
        "invalid",
        "Patient.contained[0].resourceType",
    ),
    (
        "an entry whose resourceType is null",
        {"resourceType": "Bundle", "type": "collection", "entry": [{"resource": {"resourceType": None}}]},
        400,
        "invalid",
        "Bundle.entry[0].resource.resourceType",
    ),
    (
        "an entry with no resourceType",
        {"resourceType": "Bundle", "type": "collection", "entry": [{"resource": {"id": "x", "gender": "female"}}]},
        400,
        "invalid",
        "Bundle.entry[0].resource",
    ),
    (
        "an entry of an unknown type",
        {"resourceType": "Bundle", "type": "collection", "entry": [{"resource": {"resourceType": "FooType"}}]},
        400,
        "not-supported",
        "Bundle.entry[0].resource.resourceType",
    ),
    ("resourceType a number", {"resourceType": 5}, 400, "required", "resourceType is missing or not a string"),
    (
        "an R4B-only resource",
        {"resourceType": "SubscriptionTopic", "url": "http://x", "status": "draft"},
        400,
        "not-supported",
        "SubscriptionTopic is R4B, not an R4 resource",
    ),
    (
        "an R4-only resource",
        {"resourceType": "MedicinalProduct"},
        400,
        "not-supported",
        "MedicinalProduct is an R4 resource this build cannot validate",
    ),
    (
        "a Bundle identifier too long for a control id",
        {"resourceType": "Bundle", "type": "collection", "identifier": {"value": "B" * 200}},
        400,
        "invalid",
        "Bundle.identifier.value",
    ),
    (
        "a Bundle identifier with control characters",
        {"resourceType": "Bundle", "type": "collection", "identifier": {"value": "\x1b[31mRED\x1b[0m"}},
        400,
        "invalid",
        "Bundle.identifier.value",
    ),
    (
        "a number of 5,000 digits",
        '{"resourceType":"Observation","status":"final","code":{"text":"x"},"valueInteger":' + "7" * 5000 + "}",
        400,
        "structure",
        "a number of more than 4300 digits at line 1 column 83",
    ),
]


@pytest.mark.parametrize(("what", "body", "status", "code", "where"), REFUSED, ids=[r[0] for r in REFUSED])
def test_what_the_red_team_sent_is_a_4xx_operation_outcome_saying_where(refusing_node, what, body, status, code, where):
    node = refusing_node
    got, headers, outcome = post(node, body)
    assert (got, headers["Content-Type"]) == (status, FHIR)
    issue = outcome["issue"][0]
    assert (issue["severity"], issue["code"]) == ("error", code)
    assert where in issue.get("expression", []) or issue["diagnostics"].startswith(where)
    assert staged_ids(node.store) == []
    log = node.output()
    assert "critical" not in log and "Traceback" not in log and "FooType" not in log and "RED" not in log


def test_what_r4b_shares_with_r4_and_a_fitting_identifier_are_still_staged(node):
    bundle = {"resourceType": "Bundle", "type": "collection", "identifier": {"value": "B" * 199}}
    assert post(node, bundle)[0] == 202
    assert post(node, {"resourceType": "Patient", "id": "p-1", "contained": [{"resourceType": "Patient"}]})[0] == 202
    assert staged_ids(node.store) == ["B" * 199, "p-1"]
