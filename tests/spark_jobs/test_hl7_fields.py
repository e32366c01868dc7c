"""field(): HL7 v2 values from raw message strings, per the path grammar in spark_jobs.hl7_fields."""

from __future__ import annotations

import re
import time

import hl7
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from spark_jobs.hl7_fields import FieldPath, FieldPathError, extract, field, parse_path, with_message
from tests.spark_jobs.hl7_samples import ADT_A01, CORPUS, frame, messages


def extract_paths(df: DataFrame, paths: list[str], *, unescape: bool = False) -> DataFrame:
    """``id`` plus one column per path, named after the path; each message is parsed once."""
    values = with_message("payload", lambda m: F.struct(*(extract(m, p, unescape=unescape).alias(p) for p in paths)))
    return df.select("id", values.alias("v")).select("id", "v.*")


# --- path grammar (no Spark) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "parsed"),
    [
        ("MSH-9.1", FieldPath("MSH", 9, component=1)),
        ("PID-3.1", FieldPath("PID", 3, component=1)),
        ("PV1-2", FieldPath("PV1", 2)),
        ("PID-3[2].1", FieldPath("PID", 3, repetition=2, component=1)),
        ("PID-3.1.2", FieldPath("PID", 3, component=1, subcomponent=2)),
        ("OBX[2]-5", FieldPath("OBX", 5, occurrence=2)),
        ("ZPD[3]-12[4].5.6", FieldPath("ZPD", 12, occurrence=3, repetition=4, component=5, subcomponent=6)),
        ("MSH-1", FieldPath("MSH", 1)),
        ("MSH-2", FieldPath("MSH", 2)),
    ],
)
def test_parse_path_reads_every_part_of_the_grammar(path: str, parsed: FieldPath) -> None:
    assert parse_path(path) == parsed
    assert str(parsed) == path


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("", "empty path"),
        (" PID-3", "whitespace"),
        ("pid-3", "upper case"),
        ("PI-3", "3 characters"),
        ("PID3", "followed by '-'"),
        ("PID.3.1", "followed by '-'"),
        ("PIDX-3", "followed by '-'"),
        ("PID-0", "field index 0"),
        ("PID-3[0]", "repetition index 0"),
        ("OBX[0]-5", "occurrence index 0"),
        ("PID-3.1.2.4", "expected SEG"),
        ("PID-3.", "expected SEG"),
        ("PID-x", "expected SEG"),
        ("MSH-2.1", "have no repetitions or components"),
        ("MSH-1[2]", "have no repetitions or components"),
        ("PID-99999999999999999999.1", "'PID-99999999999999999999.1': field number past 99999"),
        ("PID-3[100000]", "repetition number past 99999"),
        ("OBX[100000]-5", "occurrence number past 99999"),
        ("PID-3.100000", "component number past 99999"),
        ("PID-3.1.100000", "subcomponent number past 99999"),
        ("PID-" + "9" * 5000, "field number past 99999"),  # not int()'s own 4300-digit error
    ],
)
def test_parse_path_rejects_bad_paths_with_a_reason(path: str, problem: str) -> None:
    with pytest.raises(FieldPathError, match=re.escape(problem)):
        parse_path(path)


def test_field_rejects_a_bad_path_before_building_a_column() -> None:
    with pytest.raises(FieldPathError, match="PID3"):
        field("payload", "PID3")
    with pytest.raises(FieldPathError, match="must be a string"):
        parse_path(3)  # type: ignore[arg-type]


# --- extraction ----------------------------------------------------------------------------


def test_header_fields_use_hl7_numbering_and_each_messages_separators(spark: SparkSession) -> None:
    paths = ["MSH-1", "MSH-2", "MSH-3", "MSH-9", "MSH-9.1", "MSH-9.2", "MSH-10", "MSH-12"]
    actual = extract_paths(messages(spark, *CORPUS), paths)
    expected = frame(
        spark,
        ["id", *paths],
        [
            (1, "|", "^~\\&", "ADT1", "ADT^A01^ADT_A01", "ADT", "A01", "MSG00001", "2.5.1"),
            (2, "|", "^~\\&", "LAB", "ORU^R01^ORU_R01", "ORU", "R01", "MSG00002", "2.5.1"),
            (3, "|", "^~\\&", "CPOE", "ORM^O01", "ORM", "O01", "MSG00003", "2.3"),
            (4, "#", "*~\\&", "LEGACY", "ADT*A08", "ADT", "A08", "MSG00004", "2.3"),
            (5, "*", "$+?.", "APP", "ORU$R01", "ORU", "R01", "MSG00005", "2.5"),
            (6, "|", "^~\\", "APP", "ADT^A04", "ADT", "A04", "MSG00006", "2.3"),
            (7, *[None] * len(paths)),
            (8, *[None] * len(paths)),
        ],
    )
    assertDataFrameEqual(actual, expected)


def test_repetitions_components_and_subcomponents_are_addressable(spark: SparkSession) -> None:
    paths = ["PID-3", "PID-3[1].1", "PID-3.4", "PID-3[2]", "PID-3[2].1", "PID-3[2].4.2", "PID-5.2", "PV1-3.2"]
    actual = extract_paths(messages(spark, 1), paths)
    expected = frame(
        spark,
        ["id", *paths],
        [
            (
                1,
                "PATID1234^^^GOOD HEALTH HOSPITAL^MR",  # no index: first repetition, raw components
                "PATID1234",
                "GOOD HEALTH HOSPITAL",
                "123456789^^^USSSA&2.16.840.1.113883.4.1&ISO^SS",
                "123456789",
                "2.16.840.1.113883.4.1",
                "ADAM",
                "2012",
            )
        ],
    )
    assertDataFrameEqual(actual, expected)


def test_separators_are_literal_whatever_the_message_declares(spark: SparkSession) -> None:
    """'#', '*', '$', '+', '?', '.' are regex metacharacters or default separators elsewhere."""
    paths = ["PID-3", "PID-3.2", "PID-3.3", "PID-3.3.2", "PID-3[2].4", "PID-5.1", "PID-5.2", "MSH-12.1.2"]
    actual = extract_paths(messages(spark, 4, 5, 6), paths)
    expected = frame(
        spark,
        ["id", *paths],
        [
            (4, "42*^*x&y", "^", "x&y", "y", "ALT", "DOE|JR", "JOHN", None),
            (5, "42$|$x.y", "|", "x.y", "y", "ALT", "DOE^JR", "JOHN", "5"),  # '.' splits "2.5" too
            (6, "42^*^x&y", "*", "x&y", None, "ALT", "DOE#JR", "JOHN", None),  # no subcomponent char
        ],
    )
    assertDataFrameEqual(actual, expected)


def test_segment_occurrences_and_z_segments(spark: SparkSession) -> None:
    paths = ["OBX-5", "OBX[1]-5", "OBX[2]-5", "OBX[2]-3.2", "OBX[3]-3.1", "OBX[4]-5", "OBR-4.2", "ZPI-2.2"]
    actual = extract_paths(messages(spark, 1, 2), paths)
    expected = frame(
        spark,
        ["id", *paths],
        [
            (1, None, None, None, None, None, None, None, "GOLD"),
            (2, "196", "196", "90", "Triglyceride", "NOTE", None, "Lipid panel", None),
        ],
    )
    assertDataFrameEqual(actual, expected)


def test_missing_or_empty_values_are_null_and_hl7_null_is_kept(spark: SparkSession) -> None:
    paths = ["AL1-1", "PV1-4", "PV1-10", "PV1-60", "PID-5.7", "PID-3[3].1", "PID-3.2", "EVN-1.1.2"]
    actual = extract_paths(messages(spark, 1, 7, 8), paths)
    expected = frame(
        spark,
        ["id", *paths],
        [
            (1, None, None, '""', None, None, None, None, None),
            (7, *[None] * len(paths)),  # not HL7: no header, so no separators to trust
            (8, *[None] * len(paths)),
        ],
    )
    assertDataFrameEqual(actual, expected)


def test_lf_and_crlf_segment_endings_give_the_same_values(spark: SparkSession) -> None:
    variants = {
        11: ADT_A01.replace("\r", "\n"),
        12: ADT_A01.replace("\r", "\r\n"),
        13: "\r\n" + ADT_A01.replace("\r", "\n") + "\n\n",
    }
    paths = ["MSH-10", "EVN-1", "PID-3[2].1", "PID-11.5", "PV1-2", "ZPI-2.2"]
    actual = extract_paths(messages(spark, 1, 3, 11, 12, 13, extra=variants), paths)
    adt = ("MSG00001", "A01", "123456789", "27401-1020", "I", "GOLD")
    expected = frame(
        spark,
        ["id", *paths],
        [(1, *adt), (3, "MSG00003", None, None, None, "O", None), (11, *adt), (12, *adt), (13, *adt)],
    )
    assertDataFrameEqual(actual, expected)


def test_a_field_of_many_escapes_decodes_in_time_linear_in_its_length(spark: SparkSession) -> None:
    # A sender controls how many escapes a field holds: decoding re-split the whole field once per
    # escape, so 16,000 of them held the stage's task 37 s and this field's 40,000 several minutes.
    # Linear, it takes about a second; the bound is 30x that for a loaded machine.
    count = 40_000
    payload = "MSH|^~\\&|A|B|C|D|20240101||ADT^A01|1|P|2.5.1\rPID|1||" + "x\\F\\" * count + "\\E\\\r"
    started = time.monotonic()
    (decoded,) = (
        spark.createDataFrame([(payload,)], "payload string").select(field("payload", "PID-3", unescape=True)).first()
    )
    assert decoded == "x|" * count + "\\"
    assert time.monotonic() - started < 30


def test_escape_sequences_are_never_split_on_and_decode_on_request(spark: SparkSession) -> None:
    # field() on its own (one parse per column) rather than the shared-parse helper.
    actual = messages(spark, 2, 4, 5, 6).select(
        "id",
        field("payload", "PID-6").alias("raw"),
        field("payload", "PID-6.2").alias("component 2"),
        field("payload", "PID-6", unescape=True).alias("decoded"),
        field("payload", "NTE-3", unescape=True).alias("NTE-3 decoded"),
        field("payload", "OBX[3]-5", unescape=True).alias("OBX[3]-5 decoded"),
    )
    expected = frame(
        spark,
        ["id", "raw", "component 2", "decoded", "NTE-3 decoded", "OBX[3]-5 decoded"],
        [
            (
                2,
                "See \\F\\ note\\S\\1\\T\\2\\R\\3\\E\\ end",
                None,
                "See | note^1&2~3\\ end",
                # \E\F\E\ is a literal "\F\"; \H\ \N\ and an unterminated escape are kept
                "fasting 12h \\F\\ \\H\\bold\\N\\ 50\\ pct",
                "C:\\temp\\x",
            ),
            (4, "A\\F\\B\\S\\C", None, "A#B*C", None, None),
            (5, "A?F?B?S?C", None, "A*B$C", None, None),
            (6, "A\\F\\B\\S\\C\\T\\D", None, "A|B^C\\T\\D", None, None),  # no subcomponent char
        ],
    )
    assertDataFrameEqual(actual, expected)


# Leaf paths as (segment, occurrence, field, repetition, component, subcomponent).
CROSS_CHECK_LEAVES = [
    ("MSH", 1, 3, 1, 1, 1),
    ("MSH", 1, 9, 1, 1, 1),
    ("MSH", 1, 9, 1, 2, 1),
    ("MSH", 1, 10, 1, 1, 1),
    ("MSH", 1, 12, 1, 1, 2),
    ("PID", 1, 3, 1, 1, 1),
    ("PID", 1, 3, 1, 2, 1),
    ("PID", 1, 3, 1, 3, 2),
    ("PID", 1, 3, 2, 1, 1),
    ("PID", 1, 3, 2, 4, 2),
    ("PID", 1, 5, 1, 1, 1),
    ("PID", 1, 5, 1, 2, 1),
    ("PID", 1, 6, 1, 1, 1),
    ("PV1", 1, 2, 1, 1, 1),
    ("PV1", 1, 3, 1, 2, 1),
    ("OBX", 1, 5, 1, 1, 1),
    ("OBX", 2, 3, 1, 2, 1),
    ("OBX", 3, 5, 1, 1, 1),
    ("ZPI", 1, 2, 1, 2, 1),
]


def test_leaf_values_match_python_hl7(spark: SparkSession) -> None:
    """python-hl7 (a real, independent parser) agrees on every leaf, escapes decoded.

    Leaves are fully specified because python-hl7 descends to the first leaf where we return
    raw composites. Deliberate differences are left out: python-hl7 renders \\H\\/\\N\\ as '_'
    and drops an unterminated escape (NTE-3), and fills separators a short MSH-2 omits with
    the defaults (message 6), where we split on none.
    """
    ids = [1, 2, 3, 4, 5]
    paths = [f"{s}{'' if o == 1 else f'[{o}]'}-{f}[{r}].{c}.{sc}" for s, o, f, r, c, sc in CROSS_CHECK_LEAVES]
    actual = extract_paths(messages(spark, *ids), paths, unescape=True)

    def reference(text: str, leaf: tuple[str, int, int, int, int, int]) -> str | None:
        s, o, f, r, c, sc = leaf
        parsed = hl7.parse(re.sub(r"\r\n|\n", "\r", text))
        try:
            value = parsed[f"{s}{'' if o == 1 else o}.F{f}.R{r}.C{c}.S{sc}"]
        except (KeyError, IndexError):  # python-hl7 raises for a missing segment
            return None
        return value or None

    expected = frame(
        spark,
        ["id", *paths],
        [(i, *(reference(CORPUS[i], leaf) for leaf in CROSS_CHECK_LEAVES)) for i in ids],
    )
    assertDataFrameEqual(actual, expected)


def test_the_python_extractor_agrees_with_the_spark_one_on_every_sample(spark: SparkSession) -> None:
    """include.hl7path.value (listener lane keys) and field() (Spark stages) are one semantics."""
    from include.hl7path import value

    paths = [
        "MSH-1",
        "MSH-2",
        "MSH-9",
        "MSH-9.1",
        "MSH-9.2",
        "MSH-10",
        "MSH-12",
        "PID-3",
        "PID-3.1",
        "PID-3[2].1",
        "PID-3[2].4.2",
        "PID-5.1",
        "PID-6",
        "PV1-2",
        "PV1-10",
        "OBX[2]-5",
        "OBX[3]-5",
        "ZPI-2.2",
        "NTE-3",
        "EVN-1",
        "PID-99",
    ]
    df = messages(spark, *CORPUS)
    spark_rows = df.select("id", *[field("payload", p).alias(p) for p in paths]).orderBy("id").collect()
    payloads = {r["id"]: r["payload"] for r in df.collect()}
    for row in spark_rows:
        expected = {p: row[p] for p in paths}
        assert {p: value(payloads[row["id"]], p) for p in paths} == expected, row["id"]
