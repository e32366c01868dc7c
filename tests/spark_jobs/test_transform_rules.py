"""transform(): per-destination rewrite rules and JSON output (validation: tests/config/test_transforms_config.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import hl7
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import LongType, StringType, StructField, StructType
from pyspark.testing import assertDataFrameEqual

from include.transforms_config import parse_transforms
from spark_jobs.transform_rules import transform
from tests.spark_jobs.hl7_samples import (
    ADT_A01,
    CUSTOM_HASH,
    NO_SUBCOMPONENT,
    NOT_HL7,
    ORM_O01,
    ORU_R01,
    REGEX_HOSTILE,
)

HL7 = "application/hl7-v2"
JSON = "application/json"

# A batch file (LF endings): two ORU messages inside FHS/BHS ... BTS/FTS.
BATCH = (
    "FHS|^~\\&|SENDER|FAC|RCV|RFAC|20240107\n"
    "BHS|^~\\&|SENDER|FAC|RCV|RFAC|20240107\n"
    "MSH|^~\\&|LAB|FAC|EHR|CITY|20240107||ORU^R01|B1|P|2.5\n"
    "PID|1||111^^^LAB^MR\n"
    "OBX|1|ST|A^a||one||||||F\n"
    "OBX|2|ST|B^b||two||||||F\n"
    "ZPI|1|x\n"
    "MSH|^~\\&|LAB|FAC|EHR|CITY|20240107||ORU^R01|B2|P|2.5\n"
    "PID|1||222^^^LAB^MR\n"
    "OBX|1|ST|C^c||three||||||F\n"
    "BTS|2\n"
    "FTS|1\n"
)

# Already-decoded text: the listener hands the stages str, not bytes.
NON_ASCII = (
    "MSH|^~\\&|APP|FAC|EHR|CITY|20240108||ADT^A08|MSG7|P|2.5\r"
    "PID|1||9^^^FAC^MR||Müller^Zoë^É||||||Straße 1^^Köln^^50667\r"
    "NTE|1||東京 — naïve ☃\r"
)

ROUTED = StructType(
    [StructField("id", LongType()), StructField("destination", StringType()), StructField("payload", StringType())]
)
OUTPUT = StructType(
    [
        StructField("id", LongType()),
        StructField("destination", StringType()),
        StructField("content_type", StringType()),
        StructField("payload", StringType()),
    ]
)


def routed(spark: SparkSession, rows: list[tuple[int, str, str | None]]) -> DataFrame:
    """A routed frame: id, destination, payload."""
    return spark.createDataFrame(rows, ROUTED)


def expected(spark: SparkSession, rows: list[tuple[int, str, str, str | None]]) -> DataFrame:
    """Expected transform() output: id, destination, content_type, payload."""
    return spark.createDataFrame(rows, OUTPUT)


def hl7_text(*segments: str) -> str:
    """Segments as the transform writes them: each ends with CR."""
    return "".join(f"{s}\r" for s in segments)


def payloads(df: DataFrame) -> dict[tuple[int, str], str | None]:
    return {(r["id"], r["destination"]): r["payload"] for r in df.collect()}


def as_json(obj: Any) -> str:
    """The exact text Spark's to_json writes: compact, key order kept, non-ASCII as is."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# --- rules ----------------------------------------------------------------------------------

EHR_RULES = [
    {"set": "MSH-5", "value": "EHR"},
    {"set": "MSH-6", "value": "CITY^WEST"},  # a separator in a constant is escaped
    {"copy": "PID-3.1", "to": "PID-2"},
    {"clear": "PID-8"},
    {"clear": "PID-19"},  # absent: nothing is created
    {"map": "PV1-2", "table": "patient_class"},
    {"drop_segment": "ZPI"},
    {"rename_segment": "NK1", "to": "ZNK"},
    {"set": "PV1-12.2", "value": "NEW"},  # creates the missing trailing fields and component
]
LOOKUPS = {"patient_class": {"I": "INPATIENT", "O": "OUTPATIENT"}, "flags": {"N": "NORMAL", "H": "HIGH^!"}}


def test_every_rule_kind_applies_in_order_and_other_destinations_pass_through(spark: SparkSession) -> None:
    rows = [
        (1, "ehr", ADT_A01),
        (3, "ehr", ORM_O01),  # LF endings in, CR out
        (3, "archive", ORM_O01),  # no spec: byte for byte
        (7, "ehr", NOT_HL7),
        (7, "archive", NOT_HL7),
        (8, "ehr", None),
    ]
    actual = transform(routed(spark, rows), [{"destination": "ehr", "rules": EHR_RULES}], LOOKUPS)
    adt = hl7_text(
        "MSH|^~\\&|ADT1|GOOD HEALTH HOSPITAL|EHR|CITY\\S\\WEST|20240101120000||ADT^A01^ADT_A01|MSG00001|P|2.5.1",
        "EVN|A01|20240101120000",
        "PID|1|PATID1234|PATID1234^^^GOOD HEALTH HOSPITAL^MR~123456789^^^USSSA&2.16.840.1.113883.4.1&ISO^SS||"
        "EVERYMAN^ADAM^A^III||19610615||||2222 HOME STREET^^GREENSBORO^NC^27401-1020",
        "ZNK|1|JONES^BARBARA^K|SPO^Spouse^HL70063",
        'PV1|1|INPATIENT|2000^2012^01||||004777^ATTEND^AARON^A|||""||^NEW',
    )
    orm = hl7_text(
        "MSH|^~\\&|CPOE|HOSP|EHR|CITY\\S\\WEST|20240103101500||ORM^O01|MSG00003|P|2.3",
        "PID|1|777|777^^^HOSP^MR||ROE^RICHARD",
        "PV1|1|OUTPATIENT||||||||||^NEW",
        "ORC|NW|ORD777",
        "OBR|1|ORD777||71020^CHEST XRAY 2V^CPT",
    )
    assertDataFrameEqual(
        actual,
        expected(
            spark,
            [
                (1, "ehr", HL7, adt),
                (3, "ehr", HL7, orm),
                (3, "archive", HL7, ORM_O01),
                (7, "ehr", HL7, None),  # not HL7: NULL so the job fails the row, not delivers it
                (7, "archive", HL7, NOT_HL7),
                (8, "ehr", HL7, None),
            ],
        ),
    )
    # A third-party parser reads what we wrote.
    message = hl7.parse(adt)
    assert message["MSH.F5"] == "EHR"
    assert message["MSH.F6"] == "CITY^WEST"  # python-hl7 unescapes on access
    assert message["PID.F2"] == "PATID1234"
    assert message["PID.F3.R2.C4.S2"] == "2.16.840.1.113883.4.1"
    assert message["PV1.F2"] == "INPATIENT"
    assert message["PV1.F12.R1.C2"] == "NEW"
    assert [str(s[0]) for s in message] == ["MSH", "EVN", "PID", "ZNK", "PV1"]


def test_oru_rules_hit_one_occurrence_or_each_and_keep_escapes_verbatim(spark: SparkSession) -> None:
    rules = [
        {"set": "OBX-11", "value": "C", "each": True},
        {"set": "OBX[2]-5", "value": "91"},
        {"copy": "OBX-3.2", "to": "OBX-4", "each": True},
        {"map": "OBX-8", "table": "flags", "default": "clear", "each": True},  # OBX[3]-8 empty: left alone
        {"map": "OBX[3]-2", "table": "flags", "default": "TX^text"},  # miss -> default, escaped
        {"copy": "PID-6", "to": "PID-9"},  # escape sequences copied as they are
        {"set": "NTE-2", "value": "L"},
    ]
    actual = transform(routed(spark, [(2, "lab", ORU_R01)]), [{"destination": "lab", "rules": rules}], LOOKUPS)
    note = "See \\F\\ note\\S\\1\\T\\2\\R\\3\\E\\ end"
    oru = hl7_text(
        "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240102083000||ORU^R01^ORU_R01|MSG00002|P|2.5.1",
        f"PID|1||555^^^LAB^MR||PATIENT^PAT|{note}|||{note}",
        "OBR|1|ORD1|FIL1|24331-1^Lipid panel^LN",
        "OBX|1|NM|2093-3^Cholesterol^LN|Cholesterol|196|mg/dL|<200|NORMAL|||C",
        "OBX|2|NM|2571-8^Triglyceride^LN|Triglyceride|91|mg/dL|<150|NORMAL|||C",
        "OBX|3|TX\\S\\text|NOTE^Comment^L|Comment|C:\\E\\temp\\E\\x||||||C",
        "NTE|1|L|fasting 12h \\E\\F\\E\\ \\H\\bold\\N\\ 50\\ pct",
    )
    assertDataFrameEqual(actual, expected(spark, [(2, "lab", HL7, oru)]))
    message = hl7.parse(oru)
    assert [str(obx[11]) for obx in message.segments("OBX")] == ["C", "C", "C"]
    assert message["OBX3.F2"] == "TX^text"
    assert message["PID.F9"] == message["PID.F6"] == "See | note^1&2~3\\ end"


def test_repetitions_components_and_subcomponents_are_written_in_place(spark: SparkSession) -> None:
    rules = [
        {"set": "PID-3[2].4.2", "value": "1.2.3"},
        {"set": "PID-3[3].1", "value": "X99"},  # a new repetition
        {"clear": "PID-3[1].4"},
        {"copy": "PID-3[2]", "to": "PID-4"},  # into a field: components and subcomponents stay structure
        {"copy": "PID-3", "to": "PID-2.1"},  # into a component: '~' and '^' would be structure -> escaped
        {"set": "PID-5.2.2", "value": "Q"},
        {"clear": "PID-5[2]"},  # no second repetition: nothing happens
        {"set": "PID-11[1]", "value": "ONLY"},  # first repetition, its components included
        {"clear": "PID-3[9].1"},
    ]
    actual = transform(routed(spark, [(1, "ehr", ADT_A01)]), [{"destination": "ehr", "rules": rules}])
    pid3 = "PATID1234^^^^MR~123456789^^^USSSA&1.2.3&ISO^SS~X99"
    copied = "PATID1234\\S\\\\S\\\\S\\\\S\\MR\\R\\123456789\\S\\\\S\\\\S\\USSSA&1.2.3&ISO\\S\\SS\\R\\X99"
    pid = f"PID|1|{copied}|{pid3}|123456789^^^USSSA&1.2.3&ISO^SS|EVERYMAN^ADAM&Q^A^III||19610615|M|||ONLY"
    adt = ADT_A01.replace(ADT_A01.split("\r")[2], pid)
    assertDataFrameEqual(actual, expected(spark, [(1, "ehr", HL7, adt)]))
    message = hl7.parse(adt)
    assert message["PID.F3.R2.C4.S2"] == "1.2.3"
    assert message["PID.F3.R3.C1"] == "X99"
    assert message["PID.F3.R1.C4"] == ""
    assert message["PID.F5.R1.C2.S2"] == "Q"
    assert message.unescape(copied.split("&")[0]) == pid3.split("&")[0]


def test_constants_are_escaped_with_each_messages_own_separators(spark: SparkSession) -> None:
    constant = "a|b^c~d\\e&f#g*h$i+j?k.l"
    rules = [
        {"set": "MSH-3", "value": "APP2"},
        {"set": "PID-3[2].1", "value": "NEW"},
        {"set": "PID-3.3.2", "value": "Z"},  # message 6 declares no subcomponent separator: no-op
        {"set": "PID-9", "value": constant},
        {"set": "PID-13.1.2", "value": "S"},  # created, with the message's own separators; not in 6
    ]
    rows = [(1, "x", ADT_A01), (4, "x", CUSTOM_HASH), (5, "x", REGEX_HOSTILE), (6, "x", NO_SUBCOMPONENT)]
    actual = transform(routed(spark, rows), [{"destination": "x", "rules": rules}])

    def rewrite(message: str, header: tuple[str, str], pid: tuple[str, str]) -> str:
        segments = [s for s in re.split(r"\r\n?|\n", message) if s]
        return hl7_text(*(s.replace(*header) if s.startswith("MSH") else s.replace(*pid) for s in segments))

    adt_pid = ADT_A01.split("\r")[2]
    adt_new = (
        adt_pid.replace("PATID1234^^^GOOD", "PATID1234^^&Z^GOOD")
        .replace("~123456789^", "~NEW^")
        .replace("|M|||", "|M|a\\F\\b\\S\\c\\R\\d\\E\\e\\T\\f#g*h$i+j?k.l||")
        + "||&S"
    )
    assertDataFrameEqual(
        actual,
        expected(
            spark,
            [
                (1, "x", HL7, rewrite(ADT_A01, ("|ADT1|", "|APP2|"), (adt_pid, adt_new))),
                (
                    4,
                    "x",
                    HL7,
                    rewrite(
                        CUSTOM_HASH,
                        ("#LEGACY#", "#APP2#"),
                        (
                            "42*^*x&y~43***ALT##DOE|JR*JOHN#A\\F\\B\\S\\C",
                            "42*^*x&Z~NEW***ALT##DOE|JR*JOHN#A\\F\\B\\S\\C###a|b^c\\R\\d\\E\\e\\T\\f\\F\\g\\S\\h$i+j?k.l"
                            "####&S",
                        ),
                    ),
                ),
                (
                    5,
                    "x",
                    HL7,
                    rewrite(
                        REGEX_HOSTILE,
                        ("*APP*", "*APP2*"),
                        (
                            "42$|$x.y+43$$$ALT**DOE^JR$JOHN*A?F?B?S?C",
                            "42$|$x.Z+NEW$$$ALT**DOE^JR$JOHN*A?F?B?S?C***a|b^c~d\\e&f#g?F?h?S?i?R?j?E?k?T?l****.S",
                        ),
                    ),
                ),
                (
                    6,
                    "x",
                    HL7,
                    rewrite(
                        NO_SUBCOMPONENT,
                        ("|APP|", "|APP2|"),
                        (
                            "42^*^x&y~43^^^ALT||DOE#JR^JOHN|A\\F\\B\\S\\C\\T\\D",
                            "42^*^x&y~NEW^^^ALT||DOE#JR^JOHN|A\\F\\B\\S\\C\\T\\D"
                            "|||a\\F\\b\\S\\c\\R\\d\\E\\e&f#g*h$i+j?k.l",
                        ),
                    ),
                ),
            ],
        ),
    )
    # python-hl7 reads each message's separators and decodes the constant back.
    out = payloads(actual)
    for message_id in (1, 4, 5):
        assert hl7.parse(out[(message_id, "x")])["PID.F9"] == constant
        assert hl7.parse(out[(message_id, "x")])["PID.F13.R1.C1.S2"] == "S"


def test_missing_segments_and_sources_and_rule_order(spark: SparkSession) -> None:
    rules = [
        {"set": "ZPI-1", "value": "x"},  # no ZPI: segments are never invented
        {"copy": "NTE-3", "to": "PID-5"},  # missing source clears the target
        {"copy": "NTE-3", "to": "PID-30"},  # ... and does not pad an absent one
        {"copy": "MSH-2", "to": "PID-20"},  # the separators themselves are literal text
        {"copy": "MSH-1", "to": "PID-21"},
        {"rename_segment": "ORC", "to": "ZRC"},
        {"set": "ZRC-3", "value": "after-rename"},  # rules see the previous rules' result
        {"drop_segment": "OBR"},
        {"set": "OBR-2", "value": "gone"},
        {"set": "PV1-2", "value": ""},  # setting "" is clearing
    ]
    actual = transform(routed(spark, [(3, "ris", ORM_O01)]), [{"destination": "ris", "rules": rules}])
    orm = hl7_text(
        "MSH|^~\\&|CPOE|HOSP|RIS|HOSP|20240103101500||ORM^O01|MSG00003|P|2.3",
        "PID|1||777^^^HOSP^MR||" + "|" * 15 + "\\S\\\\R\\\\E\\\\T\\|\\F\\",
        "PV1|1|",
        "ZRC|NW|ORD777|after-rename",
    )
    assertDataFrameEqual(actual, expected(spark, [(3, "ris", HL7, orm)]))
    message = hl7.parse(orm)
    assert message["PID.F20"] == "^~\\&"
    assert message["PID.F21"] == "|"


def test_batch_rules_apply_to_every_message_and_the_envelope_is_kept(spark: SparkSession) -> None:
    rules = [
        {"set": "MSH-5", "value": "EHR2"},
        {"copy": "PID-3.1", "to": "PID-2"},
        {"set": "OBX[2]-5", "value": "TWO"},  # occurrences count per message
        {"set": "OBX-11", "value": "C", "each": True},
        {"drop_segment": "ZPI"},
    ]
    actual = transform(routed(spark, [(9, "ehr", BATCH)]), [{"destination": "ehr", "rules": rules}])
    batch = hl7_text(
        "FHS|^~\\&|SENDER|FAC|RCV|RFAC|20240107",
        "BHS|^~\\&|SENDER|FAC|RCV|RFAC|20240107",
        "MSH|^~\\&|LAB|FAC|EHR2|CITY|20240107||ORU^R01|B1|P|2.5",
        "PID|1|111|111^^^LAB^MR",
        "OBX|1|ST|A^a||one||||||C",
        "OBX|2|ST|B^b||TWO||||||C",
        "MSH|^~\\&|LAB|FAC|EHR2|CITY|20240107||ORU^R01|B2|P|2.5",
        "PID|1|222|222^^^LAB^MR",
        "OBX|1|ST|C^c||three||||||C",
        "BTS|2",
        "FTS|1",
    )
    assertDataFrameEqual(actual, expected(spark, [(9, "ehr", HL7, batch)]))
    parsed = hl7.parse_file(batch)
    (inner,) = parsed
    assert str(parsed.header) == "FHS|^~\\&|SENDER|FAC|RCV|RFAC|20240107"
    assert str(parsed.trailer) == "FTS|1"
    assert str(inner.trailer) == "BTS|2"
    assert [(m["MSH.F5"], m["PID.F2"], [str(o[11]) for o in m.segments("OBX")]) for m in inner] == [
        ("EHR2", "111", ["C", "C"]),
        ("EHR2", "222", ["C"]),
    ]


def test_non_ascii_text_is_copied_and_escaped_and_carried_columns_ride_along(spark: SparkSession) -> None:
    rules = [{"copy": "PID-5.2", "to": "PID-2"}, {"set": "PID-9", "value": "Ærøskøbing^Ø"}]
    lane = StructField("lane_key", StringType())
    source = spark.createDataFrame([(10, "ehr", NON_ASCII, "FAC|9")], StructType([*ROUTED.fields, lane]))
    actual = transform(source, [{"destination": "ehr", "rules": rules}], carry=["lane_key"])
    text = hl7_text(
        "MSH|^~\\&|APP|FAC|EHR|CITY|20240108||ADT^A08|MSG7|P|2.5",
        "PID|1|Zoë|9^^^FAC^MR||Müller^Zoë^É||||Ærøskøbing\\S\\Ø||Straße 1^^Köln^^50667",
        "NTE|1||東京 — naïve ☃",
    )
    assertDataFrameEqual(
        actual, spark.createDataFrame([(10, "ehr", HL7, text, "FAC|9")], StructType([*OUTPUT.fields, lane]))
    )
    assert hl7.parse(text)["PID.F9"] == "Ærøskøbing^Ø"


# --- JSON -----------------------------------------------------------------------------------


def test_json_output_mirrors_segments_with_arrays_only_where_structure_is(spark: SparkSession) -> None:
    specs = [
        {
            "destination": "lake",
            "output": "json",
            "rules": [{"drop_segment": "ZPI"}, {"set": "PV1-2", "value": "O"}],
        },
        {"destination": "ehr", "rules": [{"set": "MSH-5", "value": "X"}]},
    ]
    rows = [
        (1, "lake", ADT_A01),
        (2, "lake", ORU_R01),
        (4, "lake", CUSTOM_HASH),
        (9, "lake", BATCH),
        (10, "lake", NON_ASCII),
        (7, "lake", NOT_HL7),
        (3, "ehr", ORM_O01),
    ]
    actual = transform(routed(spark, rows), parse_transforms(specs))  # parsed specs are accepted too

    def seg(name: str, *fields: Any) -> dict[str, Any]:
        return {"segment": name, "fields": list(fields)}

    msh = ["|", "^~\\&"]
    adt = {
        "segments": [
            seg(
                "MSH",
                *msh,
                "ADT1",
                "GOOD HEALTH HOSPITAL",
                "EHR",
                "CITY",
                "20240101120000",
                "",
                [["ADT", "A01", "ADT_A01"]],
                "MSG00001",
                "P",
                "2.5.1",
            ),
            seg("EVN", "A01", "20240101120000"),
            seg(
                "PID",
                "1",
                "",
                [
                    ["PATID1234", "", "", "GOOD HEALTH HOSPITAL", "MR"],  # two repetitions
                    ["123456789", "", "", ["USSSA", "2.16.840.1.113883.4.1", "ISO"], "SS"],
                ],  # subcomponents
                "",
                [["EVERYMAN", "ADAM", "A", "III"]],
                "",
                "19610615",
                "M",
                "",
                "",
                [["2222 HOME STREET", "", "GREENSBORO", "NC", "27401-1020"]],
            ),
            seg("NK1", "1", [["JONES", "BARBARA", "K"]], [["SPO", "Spouse", "HL70063"]]),
            seg(
                "PV1",
                "1",
                "O",
                [["2000", "2012", "01"]],
                "",
                "",
                "",
                [["004777", "ATTEND", "AARON", "A"]],
                "",
                "",
                '""',
            ),
        ]
    }
    oru = {
        "segments": [
            seg(
                "MSH",
                *msh,
                "LAB",
                "LABFAC",
                "EHR",
                "CITY",
                "20240102083000",
                "",
                [["ORU", "R01", "ORU_R01"]],
                "MSG00002",
                "P",
                "2.5.1",
            ),
            # Separator escapes decode to text; other escapes stay as they are.
            seg("PID", "1", "", [["555", "", "", "LAB", "MR"]], "", [["PATIENT", "PAT"]], "See | note^1&2~3\\ end"),
            seg("OBR", "1", "ORD1", "FIL1", [["24331-1", "Lipid panel", "LN"]]),
            seg("OBX", "1", "NM", [["2093-3", "Cholesterol", "LN"]], "", "196", "mg/dL", "<200", "N", "", "", "F"),
            seg("OBX", "2", "NM", [["2571-8", "Triglyceride", "LN"]], "", "90", "mg/dL", "<150", "N", "", "", "F"),
            seg("OBX", "3", "ST", [["NOTE", "Comment", "L"]], "", "C:\\temp\\x", "", "", "", "", "", "F"),
            seg("NTE", "1", "", "fasting 12h \\F\\ \\H\\bold\\N\\ 50\\ pct"),
        ]
    }
    custom = {
        "segments": [
            seg(
                "MSH",
                "#",
                "*~\\&",
                "LEGACY",
                "FAC",
                "EHR",
                "CITY",
                "20240104",
                "",
                [["ADT", "A08"]],
                "MSG00004",
                "P",
                "2.3",
            ),
            seg("PID", "1", "", [["42", "^", ["x", "y"]], ["43", "", "", "ALT"]], "", [["DOE|JR", "JOHN"]], "A#B*C"),
        ]
    }
    header = ["SENDER", "FAC", "RCV", "RFAC", "20240107"]
    batch = {
        "segments": [
            seg("FHS", *msh, *header),
            seg("BHS", *msh, *header),
            seg("MSH", *msh, "LAB", "FAC", "EHR", "CITY", "20240107", "", [["ORU", "R01"]], "B1", "P", "2.5"),
            seg("PID", "1", "", [["111", "", "", "LAB", "MR"]]),
            seg("OBX", "1", "ST", [["A", "a"]], "", "one", "", "", "", "", "", "F"),
            seg("OBX", "2", "ST", [["B", "b"]], "", "two", "", "", "", "", "", "F"),
            seg("MSH", *msh, "LAB", "FAC", "EHR", "CITY", "20240107", "", [["ORU", "R01"]], "B2", "P", "2.5"),
            seg("PID", "1", "", [["222", "", "", "LAB", "MR"]]),
            seg("OBX", "1", "ST", [["C", "c"]], "", "three", "", "", "", "", "", "F"),
            seg("BTS", "2"),
            seg("FTS", "1"),
        ]
    }
    non_ascii = {
        "segments": [
            seg("MSH", *msh, "APP", "FAC", "EHR", "CITY", "20240108", "", [["ADT", "A08"]], "MSG7", "P", "2.5"),
            seg(
                "PID",
                "1",
                "",
                [["9", "", "", "FAC", "MR"]],
                "",
                [["Müller", "Zoë", "É"]],
                "",
                "",
                "",
                "",
                "",
                [["Straße 1", "", "Köln", "", "50667"]],
            ),
            seg("NTE", "1", "", "東京 — naïve ☃"),
        ]
    }
    documents = {1: adt, 2: oru, 4: custom, 9: batch, 10: non_ascii}
    orm = ORM_O01.replace("|RIS|", "|X|").replace("\n", "\r")
    assertDataFrameEqual(
        actual,
        expected(
            spark,
            [
                *((i, "lake", JSON, as_json(doc)) for i, doc in documents.items()),
                (7, "lake", JSON, None),
                (3, "ehr", HL7, orm),
            ],
        ),
    )
    out = payloads(actual)
    assert {i: json.loads(out[(i, "lake")]) for i in documents} == documents


def test_a_long_rule_chain_stays_plannable(spark: SparkSession) -> None:
    """A long chain of rules (folded as the steps of one `aggregate`) neither hits the analyzer's
    iteration limit nor nests deeper with every rule, as one nested expression per chain did."""
    rules = [{"set": f"ZPI-{i}", "value": str(i)} for i in range(3, 18)] + [{"set": "ZPI-2[2].3.2", "value": "x"}]
    actual = transform(routed(spark, [(1, "ehr", ADT_A01)]), [{"destination": "ehr", "rules": rules}])
    zpi = "ZPI|1|loyalty^GOLD~^^&x|" + "|".join(str(i) for i in range(3, 18))
    assertDataFrameEqual(actual, expected(spark, [(1, "ehr", HL7, ADT_A01.replace("ZPI|1|loyalty^GOLD", zpi))]))


# --- a message declared in a non-UTF-8 charset --------------------------------------------------

LATIN1_ADT = (  # received as ISO 8859-1 bytes (MSH-18 "8859/1"); listenerd staged it decoded
    "MSH|^~\\&|PAS|HÔPITAL|EHR|CITY|20240109||ADT^A01|MSG9|P|2.5||||||8859/1\r"
    "PID|1||77^^^H^MR||MÜLLER^ÅSA||19700101|F\r"
    "PV1|1|I\r"
)


def test_a_latin1_message_keeps_its_charset_and_accented_text_through_the_rules(spark: SparkSession) -> None:
    rules = [
        {"set": "MSH-5", "value": "ÉHR"},
        {"map": "PV1-2", "table": "patient_class"},
        {"copy": "PID-5.1", "to": "PID-9"},
    ]
    actual = transform(routed(spark, [(1, "ehr", LATIN1_ADT)]), [{"destination": "ehr", "rules": rules}], LOOKUPS)
    text = hl7_text(
        "MSH|^~\\&|PAS|HÔPITAL|ÉHR|CITY|20240109||ADT^A01|MSG9|P|2.5||||||8859/1",
        "PID|1||77^^^H^MR||MÜLLER^ÅSA||19700101|F|MÜLLER",
        "PV1|1|INPATIENT",
    )
    assertDataFrameEqual(actual, expected(spark, [(1, "ehr", HL7, text)]))
    text.encode("latin-1")  # still representable in its declared charset for delivery
