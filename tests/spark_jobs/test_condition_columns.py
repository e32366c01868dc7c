"""The condition grammar in Spark (spark_jobs/condition_columns.py): quantifiers over segments and
repetitions, segment presence, ne, the inbound connection, catch-all routes; one compiler for
routes and transform `when` (validation: tests/config/test_conditions_config.py)."""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from spark_jobs.route_rules import compile_condition, route
from spark_jobs.transform_rules import transform
from tests.spark_jobs.hl7_samples import ADT_A01, ORU_R01, messages
from tests.spark_jobs.test_route_rules import routed

# Corpus: 1 ADT^A01 (PID-3: MR then SS repetition; PV1), 2 ORU^R01 (three OBX, all OBX-11 F,
# OBX-2 NM NM ST; no PV1), 3 ORM^O01 (LF endings, PV1), 4 '#'/'*' separators, 7 not HL7, 8 NULL.
IDS = (1, 2, 3, 4, 7, 8)


def inbound(spark: SparkSession) -> DataFrame:
    """The corpus with the inbound connection's name: even ids came in on "lab-in"."""
    return messages(spark, *IDS).withColumn(
        "connection", F.when(F.col("id") % 2 == 0, F.lit("lab-in")).otherwise(F.lit("adt-in"))
    )


def flags(spark: SparkSession, conditions: dict[str, Any]) -> DataFrame:
    """One boolean column per named condition, over the corpus."""
    return inbound(spark).select(
        "id", *(compile_condition(c, connection="connection").alias(name) for name, c in conditions.items())
    )


def expected(spark: SparkSession, names: list[str], rows: dict[int, tuple[bool, ...]]) -> DataFrame:
    schema = "id long, " + ", ".join(f"{n} boolean" for n in names)
    return spark.createDataFrame([(i, *rows[i]) for i in IDS], schema)


def test_any_and_all_over_repeating_segments(spark: SparkSession) -> None:
    conditions = {
        "any_obx_st": {"field": "OBX-2", "op": "eq", "value": "ST", "segments": "any"},
        "all_obx_final": {"field": "OBX-11", "op": "eq", "value": "F", "segments": "all"},
        "all_obx_nm": {"field": "OBX-2", "op": "eq", "value": "NM", "segments": "all"},
        "no_obx_abnormal": {"not": {"field": "OBX-8", "op": "in", "value": ["H", "HH"], "segments": "any"}},
        "second_obx": {"field": "OBX[2]-3.2", "op": "eq", "value": "Triglyceride"},
    }
    # "all" needs at least one segment: a message without OBX is not "all OBX final".
    rows = {
        1: (False, False, False, True, False),
        2: (True, True, False, True, True),
        3: (False, False, False, True, False),
        4: (False, False, False, True, False),
        7: (False, False, False, True, False),
        8: (False, False, False, True, False),
    }
    assertDataFrameEqual(flags(spark, conditions), expected(spark, list(conditions), rows))


def test_any_and_all_over_field_repetitions_and_a_repetition_index(spark: SparkSession) -> None:
    conditions = {
        "any_ssn": {"field": "PID-3.5", "op": "eq", "value": "SS", "repetitions": "any"},
        "all_known_types": {"field": "PID-3.5", "op": "in", "value": ["MR", "SS"], "repetitions": "all"},
        "second_is_ssn": {"field": "PID-3[2].5", "op": "eq", "value": "SS"},
        "first_is_ssn": {"field": "PID-3.5", "op": "eq", "value": "SS"},
    }
    # 4: its PID-3 repetitions have no 5th component under '*': absent is false, so not "all".
    rows = {
        1: (True, True, True, False),
        2: (False, True, False, False),
        3: (False, True, False, False),
        4: (False, False, False, False),
        7: (False, False, False, False),
        8: (False, False, False, False),
    }
    assertDataFrameEqual(flags(spark, conditions), expected(spark, list(conditions), rows))


def test_segment_presence_ne_and_the_inbound_connection(spark: SparkSession) -> None:
    conditions = {
        "has_pv1": {"segment": "PV1"},
        "has_zpi": {"segment": "ZPI"},
        "not_adt": {"field": "MSH-9.1", "op": "ne", "value": "ADT"},
        "from_lab": {"connection": "lab-in"},
        "from_either": {"connection": ["lab-in", "adt-in"]},
        "from_adt_regex": {"connection": "^adt-", "op": "regex"},
        "lab_and_visit": {"all": [{"connection": "lab-in"}, {"segment": "PV1"}]},
    }
    # ne on an absent value is false like every leaf (7, 8); "not eq" is the way to include them.
    rows = {
        1: (True, True, False, False, True, True, False),
        2: (False, False, True, True, True, False, False),
        3: (True, False, True, False, True, True, False),
        4: (False, False, False, True, True, False, False),
        7: (False, False, False, False, True, True, False),
        8: (False, False, False, True, True, False, False),
    }
    assertDataFrameEqual(flags(spark, conditions), expected(spark, list(conditions), rows))


def test_a_catch_all_route_takes_exactly_what_no_other_route_matched(spark: SparkSession) -> None:
    routes = [
        {"name": "adt", "destinations": ["ehr"], "when": {"field": "MSH-9.1", "op": "eq", "value": "ADT"}},
        {"name": "rest", "destinations": ["archive"], "catch_all": True},
        {"name": "lab-feed", "destinations": ["lab"], "when": {"connection": "lab-in"}},
    ]
    actual = inbound(spark).transform(route, routes)
    want = routed(
        spark,
        [
            (1, "ehr", "adt"),
            (2, "lab", "lab-feed"),
            (3, "archive", "rest"),
            (4, "ehr", "adt"),
            (4, "lab", "lab-feed"),
            (7, "archive", "rest"),
            (8, "lab", "lab-feed"),
        ],
    )
    assertDataFrameEqual(actual, want)


def test_a_catch_all_alone_takes_everything_and_connection_is_read_only_when_tested(spark: SparkSession) -> None:
    # No connection column: no condition tests it, so none is needed.
    actual = messages(spark, 1, 7).transform(route, [{"name": "all", "destinations": ["archive"], "catch_all": True}])
    assertDataFrameEqual(actual, routed(spark, [(1, "archive", "all"), (7, "archive", "all")]))


def test_a_transform_when_uses_the_same_grammar_on_the_message_as_the_earlier_rules_left_it(
    spark: SparkSession,
) -> None:
    rows = spark.createDataFrame(
        [(1, "ehr", ADT_A01, "adt-in"), (2, "ehr", ORU_R01, "lab-in")],
        "id long, destination string, payload string, connection string",
    )
    specs = [
        {
            "destination": "ehr",
            "rules": [
                {
                    "set": "MSH-5",
                    "value": "RESULTS",
                    "when": {"field": "OBX-11", "op": "eq", "value": "F", "segments": "all"},
                },
                {"set": "MSH-6", "value": "FROMLAB", "when": {"connection": "lab-in"}},
                # sees MSH-5 as rule #0 left it
                {"set": "MSH-8", "value": "SEEN", "when": {"field": "MSH-5", "op": "eq", "value": "RESULTS"}},
                {"drop_segment": "ZPI", "when": {"field": "PID-3.5", "op": "eq", "value": "SS", "repetitions": "any"}},
                {"clear": "PV1-2", "when": {"not": {"segment": "PV1"}}},  # nothing to clear where it holds
            ],
        }
    ]
    actual = rows.transform(transform, specs).select("id", "payload")
    adt = ADT_A01.replace("ZPI|1|loyalty^GOLD\r", "")
    oru = ORU_R01.replace("|EHR|CITY|20240102083000||", "|RESULTS|FROMLAB|20240102083000|SEEN|")
    assertDataFrameEqual(actual, spark.createDataFrame([(1, adt), (2, oru)], "id long, payload string"))
