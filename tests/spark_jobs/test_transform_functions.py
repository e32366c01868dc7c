"""The transform rules of issue 13 in Spark (spark_jobs/transform_rules.py): add_segment, copy
between segments, string functions, format_date, concat, generated MSH-7/MSH-10, map not_found
and dead_letter (validation: tests/config/test_transforms_config.py)."""

from __future__ import annotations

import hashlib
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from spark_jobs.transform_rules import transform
from tests.spark_jobs.hl7_samples import CUSTOM_HASH, ORU_R01

HL7 = "application/hl7-v2"
MSG = (
    "MSH|^~\\&|APP|FAC|EHR|CITY|20240101120000||ADT^A08|M1|P|2.5\r"
    "PID|1||42^^^H^MR||doe^John^Q||19610615|M|||1 Main Street^^Town\r"
    "PV1|1|I|W1^101^A||||||||||||||||V1|||||||||||||||||||||||||20240101083000\r"
    "OBX|1|ST|A||one||||||P\r"
    "OBX|2|ST|B||two||||||P\r"
)
OUT = "id long, destination string, content_type string, payload string"


def run(
    spark: SparkSession, rules: list[dict[str, Any]], *payloads: str, lookups: dict | None = None, **kwargs: Any
) -> DataFrame:
    frame = spark.createDataFrame(
        [(i + 1, "dest", p) for i, p in enumerate(payloads)], "id long, destination string, payload string"
    )
    return frame.transform(transform, [{"destination": "dest", "rules": rules}], lookups, **kwargs)


def rows(spark: SparkSession, *payloads: str | tuple[str, str | None]) -> DataFrame:
    """Expected output: a payload delivered as HL7, or (reason, None) for a dead-lettered one."""
    data = [(i + 1, "dest", *(p if isinstance(p, tuple) else (HL7, p))) for i, p in enumerate(payloads)]
    return spark.createDataFrame(data, OUT)


def test_add_segment_at_the_end_after_the_last_or_before_the_first_in_the_messages_own_separators(
    spark: SparkSession,
) -> None:
    actual = run(
        spark,
        [
            {"add_segment": "ZEN|end"},
            {"add_segment": "ZAF|after^obx", "after": "OBX"},
            {"add_segment": "ZBF|before~obx", "before": "OBX"},
            {"add_segment": "ZNO|x", "after": "NK1"},  # no NK1: nothing added
        ],
        MSG,
        CUSTOM_HASH,
    )
    msg = MSG.replace("OBX|1|", "ZBF|before~obx\rOBX|1|").replace("||||||P\r", "||||||P\rZAF|after^obx\r", 2)
    msg = msg.replace("ZAF|after^obx\rOBX|2", "OBX|2") + "ZEN|end\r"
    custom = CUSTOM_HASH.replace("\r\n", "\r") + "ZEN#end\r"  # '|' written as '#': its field separator
    assertDataFrameEqual(actual, rows(spark, msg, custom))


def test_copy_between_segments_and_string_functions_read_raw_text_and_write_where_told(spark: SparkSession) -> None:
    actual = run(
        spark,
        [
            {"copy": "PV1-19", "to": "OBX-4"},  # between segments
            {"upper": "PID-5.1"},
            {"lower": "PID-5.2", "to": "PID-9"},
            {"substring": "MSH-7", "start": 1, "length": 8, "to": "PV1-44"},
            {"pad": "PID-3.1", "length": 8, "with": "0"},
            {"pad": "PID-8", "length": 3, "side": "right", "with": "_"},
            {"pad": "PID-7", "length": 4},  # longer already: never truncated
            {"replace": "PID-11.1", "pattern": "Street$", "with": "St"},
            {"upper": "OBX-5", "each": True},
            {"upper": "PID-19"},  # empty source: the target is left alone
        ],
        MSG,
    )
    want = (
        MSG.replace(
            "PID|1||42^^^H^MR||doe^John^Q||19610615|M|||1 Main Street^^Town",
            "PID|1||00000042^^^H^MR||DOE^John^Q||19610615|M__|john||1 Main St^^Town",
        )
        .replace("|20240101083000\r", "|20240101\r")
        .replace("OBX|1|ST|A||one", "OBX|1|ST|A|V1|ONE")
        .replace("OBX|2|ST|B||two", "OBX|2|ST|B||TWO")
    )
    assertDataFrameEqual(actual, rows(spark, want))


def test_lower_keeps_escape_sequences_and_separators_in_a_result_are_escaped_at_the_target(spark: SparkSession) -> None:
    actual = run(spark, [{"lower": "PID-6"}, {"upper": "PID-5", "to": "PID-9.1"}], ORU_R01)
    want = ORU_R01.replace("See \\F\\ note\\S\\1\\T\\2\\R\\3\\E\\ end", "see \\F\\ note\\S\\1\\T\\2\\R\\3\\E\\ end")
    want = want.replace("end\r", "end|||PATIENT\\S\\PAT\r")
    assertDataFrameEqual(actual, rows(spark, want))


def test_format_date_converts_hl7_timestamps_of_any_precision_and_back(spark: SparkSession) -> None:
    actual = run(
        spark,
        [
            {"format_date": "PID-7", "to_format": "yyyy-MM-dd"},
            {"format_date": "MSH-7", "to_format": "yyyy-MM-dd'T'HH:mm:ss"},
            {"format_date": "MSH-7", "from": "yyyy-MM-dd'T'HH:mm:ss", "to": "PV1-44"},
            {"format_date": "PV1-19", "on_error": "clear"},  # "V1" is no date
            {"format_date": "OBX-5", "each": True},  # "one", "two": kept (on_error keep)
        ],
        MSG,
        MSG.replace("19610615", "196106151230+0100").replace("|20240101120000|", "|2024010112|"),
    )
    first = (
        MSG.replace("19610615", "1961-06-15")
        .replace("|20240101120000|", "|2024-01-01T12:00:00|")
        .replace("|V1|", "||")
        .replace("|20240101083000\r", "|20240101120000\r")
    )
    second = (
        MSG.replace("19610615", "1961-06-15")
        .replace("|20240101120000|", "|2024-01-01T12:00:00|")
        .replace("|V1|", "||")
        .replace("|20240101083000\r", "|20240101120000\r")
    )
    assertDataFrameEqual(actual, rows(spark, first, second))


def test_concat_joins_fields_and_literal_constants(spark: SparkSession) -> None:
    actual = run(
        spark,
        [
            {"concat": ["PID-5.2", {"text": " "}, "PID-5.1", {"text": " & co^"}, "PID-99"], "to": "PID-9"},
        ],
        MSG,
    )
    want = MSG.replace("|19610615|M|||", "|19610615|M|John doe \\T\\ co\\S\\||")
    assertDataFrameEqual(actual, rows(spark, want))


def test_generated_timestamp_and_a_control_id_per_message_and_destination(spark: SparkSession) -> None:
    now = F.lit("2026-03-04 05:06:07").cast("timestamp")
    actual = run(
        spark,
        [
            {"set": "MSH-7", "generate": "timestamp"},
            {"set": "MSH-10", "generate": "control_id", "prefix": "SL"},
            {"set": "PV1-44", "generate": "timestamp", "format": "yyyyMMdd"},
        ],
        MSG,
        MSG,
        now=now,
    )

    def control_id(i: int) -> str:
        return "SL" + hashlib.sha256(f"{i}|dest".encode()).hexdigest()[:18].upper()

    want = [
        MSG.replace("20240101120000||ADT^A08|M1|", f"20260304050607||ADT^A08|{control_id(i)}|").replace(
            "|20240101083000\r", "|20260304\r"
        )
        for i in (1, 2)
    ]
    assertDataFrameEqual(actual, rows(spark, *want))


def test_map_not_found_keeps_defaults_clears_or_dead_letters(spark: SparkSession) -> None:
    lookups = {"classes": {"I": "IN"}, "wards": {"W9": "NINE"}}
    other = MSG.replace("PV1|1|I|", "PV1|1|E|")
    actual = run(
        spark,
        [
            {"map": "PV1-2", "table": "classes", "not_found": "default", "default": "keep"},  # a literal 'keep'
            {"map": "PV1-3.1", "table": "wards", "not_found": "clear"},
            {"map": "PID-8", "table": "classes", "not_found": "keep"},
        ],
        MSG,
        other,
        lookups=lookups,
    )
    assertDataFrameEqual(
        actual, rows(spark, MSG.replace("PV1|1|I|W1^", "PV1|1|IN|^"), other.replace("PV1|1|E|W1^", "PV1|1|keep|^"))
    )
    dead = run(spark, [{"map": "PV1-2", "table": "classes", "not_found": "dead_letter"}], MSG, other, lookups=lookups)
    reason = "dead-lettered: the value at PV1-2 is not in lookup table 'classes'"
    assertDataFrameEqual(dead, rows(spark, MSG.replace("PV1|1|I|", "PV1|1|IN|"), (reason, None)))


def test_a_dead_letter_rule_and_format_date_on_error_stop_only_their_own_messages(spark: SparkSession) -> None:
    test_msg = MSG.replace("|P|2.5", "|T|2.5")
    actual = run(
        spark,
        [
            {
                "dead_letter": "test messages are not sent to production",
                "when": {"field": "MSH-11", "op": "eq", "value": "T"},
            },
            {"format_date": "PID-7", "on_error": "dead_letter", "to_format": "yyyyMMdd"},
        ],
        MSG,
        test_msg,
        MSG.replace("19610615", "1961-06-15"),
    )
    assertDataFrameEqual(
        actual,
        rows(
            spark,
            MSG,
            ("test messages are not sent to production", None),
            ("dead-lettered: the value at PID-7 is not a date/time in format 'hl7'", None),
        ),
    )


def test_each_message_of_a_batch_gets_its_own_control_id(spark: SparkSession) -> None:
    from tests.spark_jobs.test_transform_rules import BATCH

    actual = run(spark, [{"set": "MSH-10", "generate": "control_id"}], BATCH)

    def control_id(seed: str) -> str:
        return hashlib.sha256(seed.encode()).hexdigest()[:20].upper()

    # units: FHS (0), BHS (1), the first MSH (2), the second (3)
    want = (
        BATCH.replace("\n", "\r")
        .replace("|B1|", f"|{control_id('1|dest#2')}|")
        .replace("|B2|", f"|{control_id('1|dest#3')}|")
    )
    assertDataFrameEqual(actual, rows(spark, want))
