"""route(): fan messages out to destinations by config rules (validation: tests/config/test_routes_config.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import LongType, StringType, StructField, StructType
from pyspark.testing import assertDataFrameEqual

from include.routes_config import RouteConfigError
from spark_jobs.route_rules import compile_condition, route
from tests.spark_jobs.hl7_samples import messages

ROUTED = StructType(
    [
        StructField("source_id", LongType()),
        StructField("destination", StringType()),
        StructField("route_name", StringType()),
        StructField("status", StringType()),
    ]
)


def routed(spark: SparkSession, rows: list[tuple[int, str | None, str | None]]) -> DataFrame:
    """Expected route() output; a row without destination is the unrouted one."""
    return spark.createDataFrame(
        [(i, dest, name, "unrouted" if dest is None else "pending") for i, dest, name in rows], ROUTED
    )


def eq(path: str, value: str) -> dict[str, Any]:
    return {"field": path, "op": "eq", "value": value}


# Corpus: 1 ADT^A01 (PV1-2 I), 2 ORU^R01 (no PV1), 3 ORM^O01 (PV1-2 O, LF endings),
# 4 ADT^A08 with '#'/'*' separators and MSH-3 LEGACY (no PV1), 7 not HL7, 8 NULL payload.


def test_leaf_operators_select_matching_messages(spark: SparkSession) -> None:
    routes = [
        {"name": "adt-eq", "destinations": ["adt"], "when": eq("MSH-9.1", "ADT")},
        {
            "name": "orders-in",
            "destinations": ["orders"],
            "when": {"field": "MSH-9.1", "op": "in", "value": ["ORM", "ORU"]},
        },
        {
            "name": "a0x-regex",
            "destinations": ["a0x"],
            "when": {"field": "MSH-9.2", "op": "regex", "value": "^A0[18]$"},
        },
        {"name": "visit-exists", "destinations": ["visits"], "when": {"field": "PV1-2", "op": "exists"}},
    ]
    actual = messages(spark, 1, 2, 3, 4, 7, 8).transform(route, routes)
    expected = routed(
        spark,
        [
            (1, "adt", "adt-eq"),
            (1, "a0x", "a0x-regex"),
            (1, "visits", "visit-exists"),
            (2, "orders", "orders-in"),
            (3, "orders", "orders-in"),
            (3, "visits", "visit-exists"),
            (4, "adt", "adt-eq"),  # its own separators: MSH-9 is "ADT*A08"
            (4, "a0x", "a0x-regex"),
            (7, None, None),
            (8, None, None),
        ],
    )
    assertDataFrameEqual(actual, expected)


def test_not_all_any_combine_and_a_missing_field_is_simply_false(spark: SparkSession) -> None:
    routes = [
        # Messages without PV1 (and non-HL7 ones) are "not inpatient" too: leaves are never NULL.
        {"name": "not-inpatient", "destinations": ["outpatient"], "when": {"not": eq("PV1-2", "I")}},
        {
            "name": "adt-inpatient",
            "destinations": ["bed-board"],
            "when": {"all": [eq("MSH-9.1", "ADT"), eq("PV1-2", "I")]},
        },
        {
            "name": "lab-or-legacy",
            "destinations": ["lab"],
            # regex searches anywhere in the raw field ("ORU^R01^ORU_R01")
            "when": {"any": [{"field": "MSH-9", "op": "regex", "value": "R0"}, eq("MSH-3", "LEGACY")]},
        },
        {
            "name": "nested",
            "destinations": ["nested"],
            "when": {"all": [eq("MSH-9.1", "ADT"), {"not": {"any": [eq("PV1-2", "I"), eq("PV1-2", "O")]}}]},
        },
    ]
    actual = messages(spark, 1, 2, 3, 4, 7, 8).transform(route, routes)
    expected = routed(
        spark,
        [
            (1, "bed-board", "adt-inpatient"),
            (2, "outpatient", "not-inpatient"),
            (2, "lab", "lab-or-legacy"),
            (3, "outpatient", "not-inpatient"),
            (4, "outpatient", "not-inpatient"),
            (4, "lab", "lab-or-legacy"),
            (4, "nested", "nested"),
            (7, "outpatient", "not-inpatient"),
            (8, "outpatient", "not-inpatient"),
        ],
    )
    assertDataFrameEqual(actual, expected)


def test_route_without_when_fans_every_message_out_to_all_its_destinations(spark: SparkSession) -> None:
    routes = [{"name": "everything", "destinations": ["archive", "audit", "archive"]}]
    actual = messages(spark, 1, 7, 8).transform(route, routes)
    expected = routed(
        spark,
        [(i, dest, "everything") for i in (1, 7, 8) for dest in ("archive", "audit")],
    )
    assertDataFrameEqual(actual, expected)


def test_a_destination_hit_by_several_routes_lands_once_named_by_the_first(spark: SparkSession) -> None:
    routes = [
        {"name": "adt-feed", "destinations": ["ehr", "archive"], "when": eq("MSH-9.1", "ADT")},
        {"name": "archive-all", "destinations": ["archive"]},
        {"name": "adt-copy", "destinations": ["ehr", "billing"], "when": eq("MSH-9.1", "ADT")},
    ]
    actual = messages(spark, 1, 2).transform(route, routes)
    expected = routed(
        spark,
        [
            (1, "ehr", "adt-feed"),
            (1, "archive", "adt-feed"),
            (1, "billing", "adt-copy"),
            (2, "archive", "archive-all"),
        ],
    )
    assertDataFrameEqual(actual, expected)


def test_unmatched_messages_get_one_unrouted_row_and_other_columns_are_ignored(spark: SparkSession) -> None:
    inbound = messages(spark, 1, 2, 7, 8).selectExpr("id AS message_id", "payload AS body", "'x' AS lane_key")
    routes = [{"name": "adt-only", "destinations": ["ehr"], "when": eq("MSH-9.1", "ADT")}]
    actual = inbound.transform(route, routes, id_col="message_id", payload_col="body")
    expected = routed(spark, [(1, "ehr", "adt-only"), (2, None, None), (7, None, None), (8, None, None)])
    assertDataFrameEqual(actual, expected)


def test_no_routes_leaves_every_message_unrouted(spark: SparkSession) -> None:
    actual = messages(spark, 1, 8).transform(route, [])
    assertDataFrameEqual(actual, routed(spark, [(1, None, None), (8, None, None)]))


def test_compile_condition_is_a_plain_boolean_column(spark: SparkSession) -> None:
    cond = {"any": [eq("OBX[2]-3.2", "Triglyceride"), {"not": {"field": "PID-3", "op": "exists"}}]}
    hit = compile_condition(cond, route_name="lab")
    actual = messages(spark, 1, 2, 3, 7, 8).select("id", hit.alias("hit"))
    expected = spark.createDataFrame([(1, False), (2, True), (3, False), (7, True), (8, True)], "id long, hit boolean")
    assertDataFrameEqual(actual, expected)


def one(when: Any) -> list[dict[str, Any]]:
    return [{"name": "adt-to-ehr", "destinations": ["ehr"], "when": when}]


def test_route_and_compile_condition_validate_before_building_anything() -> None:
    with pytest.raises(RouteConfigError, match=re.escape("route[0].when: unknown op 'like'")):
        route(None, one({"field": "MSH-9.1", "op": "like", "value": "ADT%"}))  # type: ignore[arg-type]
    with pytest.raises(RouteConfigError, match=re.escape("route 'lab': when.not: op 'regex' needs a value")):
        compile_condition({"not": {"field": "OBX-5", "op": "regex"}}, route_name="lab")


def test_conditions_compare_accented_values_of_a_latin1_message(spark: SparkSession) -> None:
    latin1 = "MSH|^~\\&|PAS|HÔPITAL|EHR|CITY|20240109||ADT^A01|MSG9|P|2.5||||||8859/1\rPID|1||77^^^H^MR||MÜLLER^ÅSA\r"
    frame = spark.createDataFrame([(1, latin1)], "id BIGINT, payload STRING")
    routes = [
        {"name": "muller", "destinations": ["ehr"], "when": eq("PID-5.1", "MÜLLER")},
        {"name": "hopital", "destinations": ["archive"], "when": {"field": "MSH-4", "op": "regex", "value": "^HÔP"}},
        {"name": "ascii-only", "destinations": ["lab"], "when": eq("PID-5.1", "MULLER")},
    ]
    assertDataFrameEqual(
        frame.transform(route, routes), routed(spark, [(1, "ehr", "muller"), (1, "archive", "hopital")])
    )
