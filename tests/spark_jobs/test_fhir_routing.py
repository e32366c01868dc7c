"""Routes on FHIR messages (`{"fhir": "Type.element", ...}`) in native Spark SQL: the compiled
columns over a mixed feed, and the route stage end to end — FHIR posted to a real listenerd over
HTTP, staged in real SQLite / PostgreSQL, routed by a real Spark run."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.testing import assertDataFrameEqual

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.routes_config import RouteConfigError, parse_routes
from include.store import Store
from include.store.lease import acquire_permanent
from include.store.stages import ROUTE
from include.transforms_config import parse_transforms
from spark_jobs import stage_job
from spark_jobs.route_job import routed_rows
from spark_jobs.route_rules import route
from tests.listeners.hl7_traffic import post_message
from tests.listeners.test_fhir_inbound import BUNDLE, PATIENT
from tests.spark_jobs.hl7_samples import ADT_A01
from tests.spark_jobs.test_route_rules import routed

MALE = {**PATIENT, "id": "pat-2", "gender": "male", "name": [{"family": "[Roe]", "given": ["John"]}]}
FEED = {
    1: json.dumps(PATIENT),
    2: json.dumps(BUNDLE),
    3: ADT_A01,
    4: json.dumps(MALE, indent=2),
    5: '{"resourceType": "Patient", "gender": ',  # not JSON (never staged; still no crash)
    6: '["Patient"]',
    7: "\r\n  " + json.dumps(PATIENT),  # JSON's white space before the object
}
TEXT = {8: json.dumps(PATIENT)}  # JSON an HL7 v2 inbound took as text: not staged as FHIR
ROUTES = [
    {"name": "women", "destinations": ["w"], "when": {"fhir": "Patient.gender", "op": "eq", "value": "female"}},
    {"name": "given-j", "destinations": ["j"], "when": {"fhir": "Patient.name.given", "op": "regex", "value": "^J"}},
    {
        "name": "heart",
        "destinations": ["lab"],
        "when": {"fhir": "Observation.code.coding.code", "op": "in", "value": ["8867-4"]},
    },
    {"name": "bundles", "destinations": ["tx"], "when": {"fhir": "Bundle.type", "op": "eq", "value": "transaction"}},
    {"name": "any-patient", "destinations": ["mpi"], "when": {"fhir": "Patient", "op": "exists"}},
    {"name": "bracket", "destinations": ["b"], "when": {"fhir": "Patient.name.family", "op": "eq", "value": "[Roe]"}},
    {"name": "no-gender", "destinations": ["ng"], "when": {"not": {"fhir": "Patient.gender", "op": "exists"}}},
    {"name": "v2-adt", "destinations": ["v2"], "when": {"field": "MSH-9.1", "op": "eq", "value": "ADT"}},
]


def test_fhir_conditions_read_resources_and_bundle_entries_and_never_match_hl7(spark: SparkSession) -> None:
    rows = [(i, p, None if i == 3 else "fhir") for i, p in FEED.items()] + [(i, p, None) for i, p in TEXT.items()]
    feed = spark.createDataFrame(rows, "id BIGINT, payload STRING, format STRING")
    actual = feed.transform(route, ROUTES)
    expected = routed(
        spark,
        [
            (1, "w", "women"),
            (1, "j", "given-j"),
            (1, "mpi", "any-patient"),
            (2, "w", "women"),  # the Bundle's Patient entry
            (2, "j", "given-j"),
            (2, "lab", "heart"),  # its Observation entry: code.coding is an array, walked
            (2, "tx", "bundles"),
            (2, "mpi", "any-patient"),
            (3, "ng", "no-gender"),  # not FHIR: no FHIR leaf holds, so its `not` does
            (3, "v2", "v2-adt"),
            (4, "j", "given-j"),
            (4, "mpi", "any-patient"),
            (4, "b", "bracket"),  # a string that starts with "[" is a value, not an array
            (5, "ng", "no-gender"),
            (6, "ng", "no-gender"),
            (7, "w", "women"),
            (7, "j", "given-j"),
            (7, "mpi", "any-patient"),
            (8, "ng", "no-gender"),  # a Patient by its text, but no FHIR inbound staged it
        ],
    )
    assertDataFrameEqual(actual, expected)


@pytest.mark.parametrize(
    ("when", "problem"),
    [
        ({"fhir": "patient.gender", "op": "eq", "value": "x"}, "'fhir' must be a resource type"),
        ({"fhir": "Patient", "op": "eq", "value": "x"}, "takes op 'exists'"),
        ({"fhir": "Patient.gender", "op": "eq", "value": "x", "segments": "any"}, "unknown key(s) ['segments']"),
        ({"fhir": "Patient.a.b.c.d.e.f.g.h.i", "op": "exists"}, "up to 8 element names"),
        # Paths checked against the R4B models: one that can never match is a config error.
        ({"fhir": "Patient.foo", "op": "exists"}, "Patient has no element 'foo'"),
        ({"fhir": "Foo.bar", "op": "exists"}, "resourceType 'Foo' is not an R4 resource"),
        ({"fhir": "Resource.id", "op": "exists"}, "resourceType 'Resource' is not an R4 resource"),
        ({"fhir": "Patient.gender.code", "op": "exists"}, "Patient.gender is a primitive value"),
        ({"fhir": "Observation.code.coding.cod", "op": "exists"}, "Observation.code.coding has no element 'cod'"),
        ({"fhir": "SubscriptionTopic.url", "op": "exists"}, "SubscriptionTopic is R4B, not an R4 resource"),
        ({"fhir": "MedicinalProduct", "op": "exists"}, "MedicinalProduct is an R4 resource this build cannot"),
    ],
)
def test_a_bad_fhir_condition_is_refused_when_the_routes_load(when: dict[str, Any], problem: str) -> None:
    with pytest.raises(RouteConfigError) as err:
        parse_routes([{"name": "r", "destinations": ["d"], "when": when}])
    assert problem in str(err.value)


def test_paths_r4b_shares_with_r4_load_whatever_their_depth() -> None:
    paths = ["Patient._birthDate.extension.url", "Patient.contained.gender", "Bundle.entry.resource.gender"]
    paths += ["Observation.component.code.coding.system", "Observation.valueQuantity.value", "Patient"]
    routes = [
        {"name": f"r{i}", "destinations": ["d"], "when": {"fhir": p, "op": "exists"}} for i, p in enumerate(paths)
    ]
    assert [r.when.resource_type for r in parse_routes(routes)] == [p.split(".")[0] for p in paths]


def test_a_transform_rule_cannot_test_fhir() -> None:
    with pytest.raises(ValueError) as err:
        when = {"fhir": "Patient.gender", "op": "eq", "value": "female"}
        parse_transforms([{"destination": "ehr", "rules": [{"set": "PID-8", "value": "F", "when": when}]}])
    assert "a 'fhir' condition is for a route's when only" in str(err.value)


def test_fhir_posted_over_http_is_staged_and_routed_by_the_route_stage(tmp_path, store_config, spark) -> None:
    port = free_port()
    inbound = [{"name": "fhir-in", "kind": "http", "port": port, "accept": ["hl7v2", "fhir"]}]
    node = Daemon(tmp_path / "node", store_config, node_id="solo:1:aa", inbound=inbound).start()
    try:
        wait_for(lambda: port_open(port), timeout=30, what="bind")
        for body in (PATIENT, BUNDLE, MALE):
            status, _ = post_message(port, "fhir-in", json.dumps(body).encode(), content_type="application/fhir+json")
            assert status == 202
        assert post_message(port, "fhir-in", ADT_A01.encode())[0] == 202
        # The same Patient as text/plain: taken as text (hl7_only is off), never read as FHIR.
        assert post_message(port, "fhir-in", json.dumps(PATIENT).encode(), content_type="text/plain")[0] == 202
    finally:
        assert node.stop() == 0
    store = Store(store_config)
    try:
        epoch = acquire_permanent(store, node_id="node-r")
        outcome = stage_job.run_stage_job(
            ROUTE,
            store,
            spark,
            transform=partial(routed_rows, routes=parse_routes(ROUTES[:4] + ROUTES[7:])),
            owner="node-r/run-1",
            epoch=epoch,
            run_id="run-1",
        )
        assert len(outcome.claimed) == 5 and len(outcome.unrouted) == 1
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(
                "SELECT i.control_id, r.destination FROM stage_routed r JOIN inbound_messages i ON i.id = r.source_id "
                "ORDER BY r.source_id, r.destination"
            )
            got = [(r["control_id"], r["destination"]) for r in cur.fetchall()]
    finally:
        store.close()
    assert got == [
        ("pat-1", "j"),
        ("pat-1", "w"),
        ("bundle-7", "j"),
        ("bundle-7", "lab"),
        ("bundle-7", "tx"),
        ("bundle-7", "w"),
        ("pat-2", "j"),
        ("MSG00001", "v2"),
    ]
