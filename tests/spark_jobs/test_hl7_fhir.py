"""`output = "fhir-r4"`: HL7 v2 → FHIR R4 transaction Bundles with real Spark, each validated.

Golden files per message type (tests/spark_jobs/golden/fhir_*.json, the samples of hl7_samples.py);
every ADT/ORU/ORM of the test corpora and of the benchmark's generator converts, validates with
`fhir.resources` (R4B models: the R4 ones need pydantic 1, docs/rules.md) and keeps FHIR's JSON
rules (no empty arrays, objects or strings; every reference resolves inside the Bundle); what the
mapping cannot take is refused with its reason and no Bundle.
Regenerate the golden files after a deliberate mapping change: ``STAGELINE_GOLDEN=write pytest ...``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from fhir.resources.R4B.bundle import Bundle
from pyspark.sql import SparkSession

from bench.hl7_corpus import messages
from bench.peers import fhir_peer
from include.fhir_options import FHIR_CONTENT_TYPE
from include.transforms_config import TransformConfigError, parse_transforms
from spark_jobs.hl7_fhir import (
    _BEFORE_FIRST_PID,
    _MISNAMED,
    _SAME_PATIENT,
    _SAME_URL,
    _SEVERAL_PATIENTS,
    _TOO_MANY_PATIENTS,
    MAX_GROUP_SEGMENTS,
    MAX_PATIENTS,
)
from spark_jobs.transform_rules import transform
from tests.spark_jobs.hl7_samples import (
    ADT_A01,
    CORPUS,
    NO_SUBCOMPONENT,
    ORM_O01,
    ORM_O01_TWO_PATIENTS,
    ORU_R01,
    ORU_R01_TWO_PATIENTS,
)

GOLDEN = Path(__file__).parent / "golden"
SYSTEMS = {"GOOD HEALTH HOSPITAL": "urn:oid:2.16.840.1.113883.19.5", "LAB": "urn:oid:2.16.840.1.113883.19.6"}
SPEC = {
    "destination": "fhir",
    "output": "fhir-r4",
    "fhir": {"identifier_systems": {**SYSTEMS, "HOSP": "urn:oid:2.16.840.1.113883.19.7"}, "timezone": "+01:00"},
}
ROUTED = "id long, destination string, payload string, message_id string"


RULED = {
    **SPEC,
    "destination": "ruled",
    "rules": [{"set": "PID-8", "value": "F"}, {"set": "PID-3[1].4", "value": "LAB"}],
}


def check_bundle(text: str) -> dict[str, Any]:
    """Valid R4(B), FHIR's JSON rules kept, every reference resolving to an entry of the Bundle."""
    Bundle.model_validate_json(text)
    doc = json.loads(text)
    assert doc["resourceType"] == "Bundle" and doc["type"] == "transaction"

    def walk(x: Any, where: str) -> None:
        assert x not in ([], {}, "", None), f"empty value at {where}"
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{where}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")

    walk(doc, "Bundle")
    urls = [e["fullUrl"] for e in doc["entry"]]
    assert len(set(urls)) == len(urls)
    # Two entries on one conditional URL: a FHIR server fails the whole transaction.
    puts = [e["request"]["url"] for e in doc["entry"] if e["request"]["method"] == "PUT"]
    assert len(set(puts)) == len(puts), puts
    for ref in re.findall(r'"reference":"([^"]*)"', text):
        assert ref in urls, f"reference {ref} does not resolve inside the Bundle"
    for e in doc["entry"]:
        assert e["request"]["method"] in ("PUT", "POST")
        if e["request"]["method"] == "PUT":
            assert e["request"]["url"].startswith(e["resource"]["resourceType"] + "?identifier=")
    return doc


GOLDEN_SAMPLES = {
    "adt_a01": ADT_A01,
    "oru_r01": ORU_R01,
    "orm_o01": ORM_O01,
    "oru_r01_two_patients": ORU_R01_TWO_PATIENTS,
    "orm_o01_two_patients": ORM_O01_TWO_PATIENTS,
}
CORPUS_ROWS = {i: p for i, p in CORPUS.items() if p and p.startswith("MSH")}
CORPUS_ROWS.update({100 + i: p for i, p in enumerate(messages(600, seed=27))})
DATATYPES_ADT = (
    "MSH|^~\\&|ADT1|GOOD HEALTH HOSPITAL|EHR|CITY|20240101120000+0200||ADT^A04|C1|P|2.5.1\r"
    "PID|1||X1^^^GOOD HEALTH HOSPITAL^MR~X2^^^UNKNOWN^PI||O\\T\\BRIEN^MARY^J^^DR^^L||197402|F|||"
    "1 A ST^APT 2^TOWN^ST^12345^USA^H||^PRN^PH^^^555^1234567~^NET^Internet^mary@example.org|^WPN^CP^^^^7654321"
    "|||||||||||||||20240101103000.5-0500|Y\r"
    "PV1|1|E|||||||||||||||||V9^^^GOOD HEALTH HOSPITAL^VN|||||||||||||||||||||||||202401011030|20240102\r"
)
DATATYPES_ORU = (
    "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240102083000||ORU^R01|C2|P|2.5.1\r"
    "PID|1||555^^^LAB^MR||PATIENT^PAT\r"
    "OBR|1|P1^LAB|F1^LAB|24331-1^Lipid panel^LN|||20240102083000||||||||||||||||||C\r"
    "OBX|1|NM|2093-3^Cholesterol^LN||+007.20|mg/dL^milligram per deciliter^UCUM|<200|H|||C\r"
    "OBX|2|SN|718-7^Hemoglobin^LN||<=^12.5|g/dL|||||F\r"
    "OBX|3|CWE|882-1^ABO+Rh^LN||A+^A positive^L|||||||F\r"
    "OBX|4|DTM|GEST^Date^L||20240101||||||F\r"
    "OBX|5|TX|NOTE^Note^L||line one~line two||||||F\r"
    "OBX|6|NM|BAD^Bad^L||not a number||||||Q\r"
    "OBR|2|P2|F2|58410-2^CBC panel^LN\r"
    "OBX|1|ST|X^Y^L||second panel\r"
)
REFUSED = {
    1: ADT_A01.replace("ADT^A01^ADT_A01", "SIU^S12"),
    2: "MSH|^~\\&|CPOE|HOSP|RIS|HOSP|20240103||ORM^O01|C3|P|2.3\rORC|NW|1\rOBR|1|1||X^Y^L\r",
    3: "FHS|^~\\&\rBHS|^~\\&\r" + ADT_A01 + ORM_O01.replace("\n", "\r") + "BTS|2\rFTS|1\r",
    4: "not HL7",
    5: ADT_A01.replace("ADT^A01", "ADT^A03"),
    6: ORU_R01 + "OBX|1|NM|X^Y^L||1\r" * MAX_GROUP_SEGMENTS,  # grouping costs OBX × OBR: bounded
}


_H = "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240102083000||"
ESCAPES = {
    "known": _H + "ADT^A01|E1|P|2.5.1\rPID|1||X1^^^HOSP^MR||O\\T\\BRIEN^A\\S\\B\\E\\F\\E\\^\\H\\hi\\N\\^JR\\F\\^DR\r",
    "unterminated": _H + "ADT^A01|E2|P|2.5.1\rPID|1||X2\\^^^HOSP^MR||SMITH\\^JOHN\\X|A\\B|C\\D||NAME\\F\\|M\r",
    "text": _H + "ORU^R01|E3|P|2.5.1\rPID|1||X3^^^HOSP^MR||P^Q\rOBR|1|P1|F1|C^D^LN\r"
    "OBX|1|TX|N^N^L||a\\R\\b~c\\S\\d^e\\T\\f^^&^||||||F\rOBX|2|ST|N^N^L||\\E\\\\E\\x\\||||||F\r"
    'OBX|3|ST|N^N^L||""||||||F\rOBX|4|FT|N^N^L||ab\\|cd\\\\ef||||||F\r',
    "other separators": "MSH#*@!%#A!S!PP#FAC#R#F#20240101120000##ADT*A01#E7#P#2.5\r"
    "PID#1##Z1***HOSP*MR##L!S!AST*F!F!IRST\r",
    "order": _H + "ORM^O01|E8|P|2.5.1\rPID|1||X8^^^HOSP^MR||N\\F\\^G\rORC|NW|P\\S\\1^HOSP|F1^HOSP||CM\r"
    "OBR|1|P\\S\\1^HOSP|F1|C\\T\\X^D\\R\\Y^LN\r",
    "noncharacter": _H + "ADT^A04|E6|P|2.5.1\rPID|1||X7^^^HOSP^MR||NON\ufdd2CHAR\\S\\^G\r",
}


STRUCTURED_NUMBERS = (
    "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240102083000||ORU^R01|C9|P|2.5.1\r"
    "PID|1||555^^^LAB^MR||PATIENT^PAT\r"
    "OBR|1|P1^LAB|F1^LAB|24331-1^Lipid panel^LN\r"
    "OBX|1|SN|X^Range^L||^10^-^20.50|mg/dL^^UCUM\r"
    "OBX|2|SN|X^Ratio^L||^1^:^128\r"
    "OBX|3|SN|X^Ratio^L||^1^/^+04|mL\r"
    "OBX|4|SN|X^Compared^L||>=^5\r"
    "OBX|5|SN|X^Not a range^L||<^1^-^2\r"
    "OBX|6|SN|X^Not a number^L||^1^-^x\r"
    "OBX|7|SN|X^Categorical^L||^2^+\r"
)


# Several patients in one message (issue 27): each PATIENT_RESULT (ORU) or patient's orders (ORM) under its own PID.
_M = "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240105090000||ORU^R01|{cid}|P|2.5.1\r"


def _group(mrn: str, value: str, *, filler: str = "") -> str:
    """One patient's group: PID (MRN under LAB, none when blank), a CBC report with its hemoglobin."""
    pid = f"{mrn}^^^LAB^MR" if mrn else ""
    return f"PID|1||{pid}||P{mrn}^X\rOBR|1||{filler}|58410-2^CBC^LN\rOBX|1|NM|718-7^Hemoglobin^LN||{value}|g/dL\r"


MULTI = {
    "resent": ORU_R01_TWO_PATIENTS,  # the golden message again under another Stageline message id
    "first only": ORU_R01_TWO_PATIENTS[: ORU_R01_TWO_PATIENTS.index("PID|2")],
    "no identifiers": _M.format(cid="G1") + _group("A1", "13.1") + _group("", "9.2"),
    "fifty": _M.format(cid="G2") + "".join(_group(f"N{i}", f"{i}.5") for i in range(1, 51)),
    # A PATIENT_RESULT without results (ORU^R01 requires one; the Patient alone is written).
    "empty group": _M.format(cid="G3") + "PID|1||E1^^^LAB^MR||EMPTY^E\r" + _group("E2", "11.0"),
    # A patient's own OBX (PATIENT_OBSERVATION) before its first OBR: not the previous patient's report's.
    "patient observation": _M.format(cid="G4")
    + _group("O1", "12.0")
    + "PID|2||O2^^^LAB^MR||P^O\rOBX|1|NM|29463-7^Weight^LN||70|kg\rOBR|1|||58410-2^CBC^LN\r",
    "same patient": _M.format(cid="G5") + _group("S1", "12.0", filler="F1") + _group("S1", "12.5", filler="F2"),
    "before the first": _M.format(cid="G6") + "OBR|1|||X^Y^LN\r" + _group("B1", "1") + _group("B2", "2"),
    "orm orders before": "MSH|^~\\&|CPOE|HOSP|RIS|HOSP|20240103||ORM^O01|G7|P|2.3\rORC|NW|O1\r"
    "PID|1||Q1^^^HOSP^MR||A^A\rOBR|1|O1||X^Y^L\rPID|2||Q2^^^HOSP^MR||B^B\rORC|NW|O2\rOBR|1|O2||Z^W^L\r",
}


def _panel(mrn: str, values: list[str]) -> str:
    """One patient's group: a panel report with one result per value (codes T1, T2, ...)."""
    pid = f"{mrn}^^^LAB^MR" if mrn else ""
    obx = "".join(f"OBX|{n}|NM|T{n}^T{n}^LN||{v}\r" for n, v in enumerate(values, 1))
    return f"PID|1||{pid}||P{mrn}^X\rOBR|1|||24331-1^Panel^LN\r{obx}"


# The red team's findings on several patients (issue 27): the same message re-sent with its groups
# in another order or a result fewer, patient identities that overlap, segment ids that are a PID
# only once trimmed, an order with its ORC after it, more patient groups than the bound.
_A, _B = _panel("RA", ["5.1", "140", "4.1", "101", "2.3", "0.9"]), _panel("RB", ["9.1", "7.5"])
MULTI.update(
    {
        "groups AB": _M.format(cid="R1") + _A + _B,
        "groups BA": _M.format(cid="R1") + _B + _A,
        "groups A-1 B": _M.format(cid="R1") + _panel("RA", ["5.1", "140", "4.1", "101", "2.3"]) + _B,
        "two anonymous": _M.format(cid="R2") + _panel("", ["13.0", "6.0"]) + _panel("", ["2.2", "150", "6.3"]),
        "shared identifier": _M.format(cid="R3")
        + _group("1", "1.0").replace("1^^^LAB^MR", "1^^^LAB^MR~999^^^HOSP")
        + _group("", "2.0").replace("PID|1||", "PID|1||999^^^HOSP"),
        "space before PID": _M.format(cid="R4") + _group("W1", "1") + " " + _group("W2", "2"),
        "tab before PID": _M.format(cid="R5") + _group("W1", "1") + "\t" + _group("W2", "2"),
        "BOM before PID": _M.format(cid="R6") + _group("W1", "1") + "\ufeff" + _group("W2", "2"),
        "lowercase pid": _M.format(cid="R7") + _group("W1", "1") + _group("W2", "2").replace("PID|", "pid|"),
        "adt space before PID": "MSH|^~\\&|A|B|C|D|2024||ADT^A01|R8|P|2.5.1\rPID|1||1^^^LAB^MR||ONE\r"
        " PID|2||2^^^LAB^MR||TWO\r",
        "orc after obr": "MSH|^~\\&|CPOE|HOSP|RIS|HOSP|20240103||ORM^O01|R9|P|2.3\rPID|1||Q1^^^HOSP^MR||A^A\r"
        "ORC|NW|O1\rOBR|1|O1||X^Y^L\rPID|2||Q2^^^HOSP^MR||B^B\rOBR|1|O2||Z^W^L\rORC|CA|O3||||CA\r",
        "too many patients": _M.format(cid="R10") + "".join(_group(f"N{i}", "1") for i in range(MAX_PATIENTS + 1)),
    }
)


# The red team's findings against this mapping (issue 27): each row either maps right or is refused.
_R = "MSH|^~\\&|LAB|LABFAC|EHR|CITY|{ts}||ORU^R01|{cid}|P|2.5.1\rPID|1||{pid}||PAT^P\r"


def _red_oru(cid: str, body: str, pid: str = "555^^^LAB^MR", ts: str = "20240102083000") -> str:
    return _R.format(cid=cid, pid=pid, ts=ts) + body


_ADT = "MSH|^~\\&|ADT1|HOSP|EHR|CITY|20240101120000||ADT^A01|{cid}|P|2.5.1\rPID|1||{pid}||DOE^J||{birth}\r"
_NO_FILLER = "OBR|1|P1|\rOBX|1|NM|2093-3^Chol^LN||1|mg/dL|||||F\r"  # reports and results keyed on Stageline's id
RED = {
    # H1: a second patient's results would have been filed under the first: now each under its own.
    "two patients": _red_oru(
        "A1", "OBR|1|O1|F1|X^Y^LN\rOBX|1|NM|A^B^LN||1|mg\rPID|2||VICTIM^^^LAB^MR||ROE^R\rOBR|1|O2|F2|X^Y^LN\r"
    ),
    "adt two pids": _ADT.format(cid="A2", pid="Q1^^^HOSP^MR", birth="") + "PID|2||Q2^^^HOSP^MR||ROE^R\r",
    "oru without pid": "MSH|^~\\&|A|B|C|D|2024||ORU^R01|A3|P|2.5.1\rOBR|1|O1|F1|X^Y^LN\rOBX|1|NM|A^B^LN||1\r",
    "msh only": "MSH|^~\\&|A|B|C|D|2024||ORU^R01|A4|P|2.5.1\r",
    # M3: one conditional URL twice in a transaction: refused.
    "same filler": _red_oru("D1", "OBR|1|P1|F1^LAB|X^Y^LN\rOBX|1|NM|A^B^LN||1\rOBR|2|P2|F1^LAB|Z^W^LN\r"),
    "same placer": "MSH|^~\\&|CPOE|HOSP|RIS|HOSP|20240103||ORM^O01|D2|P|2.3\rPID|1||P1^^^LAB^MR||A^A\r"
    "ORC|NW|ORD1^LAB\rOBR|1|ORD1^LAB||X^Y^L\rORC|NW|ORD1^LAB\rOBR|2|ORD1^LAB||Z^W^L\r",
    # M1: a sender's wrapped counter reuses MSH-10 (other time, other patient); an identical re-send.
    "first": _red_oru("C", _NO_FILLER),
    "resent": _red_oru("C", _NO_FILLER),
    "wrapped": _red_oru("C", _NO_FILLER, pid="VICTIM^^^LAB^MR", ts="20250102083000"),
    "other patient": _red_oru("C", _NO_FILLER, pid="VICTIM^^^LAB^MR"),
    "other msh-3": _red_oru("C", _NO_FILLER).replace("|LAB|", "|LAB^1.2.3^ISO|", 1),
    # M2: blank and padded identifiers; an OID beside a namespace another authority shares.
    "blank mrn": _ADT.format(cid="B1", pid=" ^^^HOSP^MR", birth=""),
    "padded mrn": _ADT.format(cid="B2", pid=" X1 ^^^HOSP^MR ~ ^^^HOSP^MR", birth=""),
    "oid": _ADT.format(cid="B3", pid="123^^^HOSP&1.2.840.114350.1&ISO^MR", birth=""),
    # M4: padded codes; M5: impossible offsets and years.
    "codes": _red_oru(
        "E1",
        "OBR|1|O1|F1|   ^Lipid^LN|||20240101120000+1430\r"
        "OBX|1|NM|2093-3  ^Chol^LN||1|mg  /dL^mg^UCUM||H \rOBX|2|CWE|A^B^LN|| a \t b ^AB^L\r"
        "OBX|3|DTM|A^B^LN||0000\rOBX|4|DTM|A^B^LN||20240101120000-1400\r",
        pid="555^^^LAB^MR \t",
    ),
    "adt codes": _ADT.format(cid="E2", pid="Q^^^HOSP^ MR", birth="00000101")
    + "PV1|1| I "
    + "|" * 41
    + "|00000101|20240101+1430\r",
    # Low: FHIR decimals beyond 18 digits are text, not a number JSON readers make infinite.
    "decimals": _red_oru(
        "F1",
        "OBR|1|O1|F1|X^Y^LN\r"
        f"OBX|1|NM|A^B^LN||{'9' * 18}\rOBX|2|NM|A^B^LN||{'9' * 19}\rOBX|3|SN|A^B^LN||^-{'9' * 400}^-^1\r"
        f"OBX|4|NM|A^B^LN||0.{'0' * 400}1\r",
    ),
}


NEXT_OF_KIN = (
    "MSH|^~\\&|ADT1|HOSP|EHR|CITY|20240101120000||ADT^A01|C7|P|2.5.1\r"
    "PID|1||X1^^^HOSP^MR||DOE^JANE\r"
    "NK1|1|DOE^JOHN^Q|SPO^Spouse^HL70063|1 MAIN ST^^TOWN^ST^12345^^H|^PRN^PH^^^555^1234567|^WPN^FX^^^555^7654321\r"
    "NK1|2||FTH^Father^HL70063\r"
    "NK1|3|ROE\\S\\X^RICHARD|||^NET^Internet^r@example.org\r"
)
NOTES = (
    "MSH|^~\\&|LAB|LABFAC|EHR|CITY|20240102083000||ORU^R01|C8|P|2.5.1\r"
    "PID|1||555^^^LAB^MR||P^Q\r"
    "OBR|1|P1|F1|C^D^LN\rNTE|1||about the order\r"
    "OBX|1|ST|X^Y^L||v1\rNTE|1||first \\T\\ note\rNTE|2||second~line\rNTE|3||\r"
    "OBX|2|ST|X^Y^L||v2\rZXX|1\rNTE|1||after a Z segment\r"
    "OBX|3|ST|X^Y^L||v3\rNTE|1||third\r"
)


SEEDS: dict[tuple[str, Any], str] = {}


@pytest.fixture(scope="module")
def out(spark: SparkSession) -> dict[tuple[str, Any], tuple[str, str | None]]:
    """Every row these tests look at, through one transform (a plan's analysis is most of a run)."""
    rows: list[tuple[str, Any, str | None]] = [("golden", k, p) for k, p in GOLDEN_SAMPLES.items()]
    rows += [("corpus", k, p) for k, p in CORPUS_ROWS.items()]
    rows += [("types", "adt", DATATYPES_ADT), ("types", "oru", DATATYPES_ORU)]
    rows += [("again", "first", ORU_R01), ("again", "other", ORU_R01)]
    rows += [("refused", k, p) for k, p in REFUSED.items()]
    rows += [("ruled", "a04", NO_SUBCOMPONENT)]
    rows += [("escapes", k, p) for k, p in ESCAPES.items()]
    rows += [("types", "sn", STRUCTURED_NUMBERS), ("ig", "nk1", NEXT_OF_KIN), ("ig", "nte", NOTES)]
    rows += [("red", k, p) for k, p in RED.items()]
    rows += [("multi", k, p) for k, p in MULTI.items()]
    keys = {n: (group, key) for n, (group, key, _p) in enumerate(rows)}
    SEEDS.update({(group, key): f"m{n}|fhir" for n, (group, key, _p) in enumerate(rows)})
    frame = spark.createDataFrame(
        [
            (n, "ruled" if group == "ruled" else "fhir", p, "m1" if (group, key) == ("again", "first") else f"m{n}")
            for n, (group, key, p) in enumerate(rows)
        ],
        ROUTED,
    )
    # The "again/first" row shares its message id with golden oru_r01's run below: same message, run twice.
    got = transform(frame, [SPEC, RULED], message_id_col="message_id").collect()
    return {keys[r["id"]]: (r["content_type"], r["payload"]) for r in got}


@pytest.mark.parametrize("name", sorted(GOLDEN_SAMPLES))
def test_each_message_type_gives_its_golden_bundle(out: dict[Any, Any], name: str) -> None:
    content_type, text = out[("golden", name)]
    assert content_type == FHIR_CONTENT_TYPE
    got = check_bundle(text)
    path = GOLDEN / f"fhir_{name}.json"
    if os.environ.get("STAGELINE_GOLDEN") == "write":
        path.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(path.read_text())


def test_every_adt_oru_orm_of_the_corpora_converts_and_validates(out: dict[Any, Any]) -> None:
    kinds = {"ADT": 0, "ORU": 0, "ORM": 0}
    for i, payload in CORPUS_ROWS.items():
        content_type, text = out[("corpus", i)]
        assert content_type == FHIR_CONTENT_TYPE and text is not None, (i, content_type)
        doc = check_bundle(text)
        types = [e["resource"]["resourceType"] for e in doc["entry"]]
        kind = re.search(r"[|#*](ADT|ORU|ORM)[\^*$]", payload)
        assert kind is not None
        kinds[kind.group(1)] += 1
        obx = len(re.findall(r"[\r\n]OBX", payload))
        obr = len(re.findall(r"[\r\n]OBR", payload))
        assert types[0] == "Patient"
        if kind.group(1) == "ORU":
            assert types.count("Observation") == obx and types.count("DiagnosticReport") == obr
        if kind.group(1) == "ORM":
            assert types.count("ServiceRequest") == obr >= 1
        if kind.group(1) == "ADT":
            assert types.count("Encounter") == len(re.findall(r"[\r\n]PV1", payload))
    assert min(kinds.values()) > 50, kinds
    assert len(CORPUS_ROWS) == 606


def test_the_python_peer_builds_the_same_bundles_for_the_benchmark_corpus(out: dict[Any, Any]) -> None:
    """bench/pipeline.py --fhir compares equal work: the in-memory peer's Bundles are the same JSON."""
    options = parse_transforms([SPEC])[0].fhir
    assert options is not None
    compared = 0
    for i, payload in CORPUS_ROWS.items():
        if i >= 100:
            assert fhir_peer.bundle(payload, SEEDS[("corpus", i)], options) == json.loads(out[("corpus", i)][1]), i
            compared += 1
    assert compared == 600


def test_data_types_follow_the_v2_to_fhir_mapping(out: dict[Any, Any]) -> None:
    patient, encounter = (e["resource"] for e in check_bundle(out[("types", "adt")][1])["entry"])
    assert patient["identifier"][0]["system"] == SYSTEMS["GOOD HEALTH HOSPITAL"]
    assert "system" not in patient["identifier"][1]  # an authority nobody configured: no guessed URI
    assert patient["name"] == [{"use": "official", "family": "O&BRIEN", "given": ["MARY", "J"], "prefix": ["DR"]}]
    assert patient["gender"] == "female" and patient["birthDate"] == "1974-02"
    assert patient["address"] == [
        {
            "use": "home",
            "line": ["1 A ST", "APT 2"],
            "city": "TOWN",
            "state": "ST",
            "postalCode": "12345",
            "country": "USA",
        }
    ]
    assert patient["telecom"] == [
        {"system": "phone", "value": "555 1234567", "use": "home"},
        {"system": "email", "value": "mary@example.org", "use": "home"},
        {"system": "phone", "value": "7654321", "use": "mobile"},
    ]
    assert patient["deceasedDateTime"] == "2024-01-01T10:30:00.5-05:00"
    assert encounter["class"]["code"] == "EMER" and encounter["status"] == "finished"
    assert encounter["period"] == {"start": "2024-01-01T10:30:00+01:00", "end": "2024-01-02"}
    assert encounter["identifier"][0]["value"] == "V9"

    entries = [e["resource"] for e in check_bundle(out[("types", "oru")][1])["entry"]]
    reports = [r for r in entries if r["resourceType"] == "DiagnosticReport"]
    obs = [r for r in entries if r["resourceType"] == "Observation"]
    assert [r["status"] for r in reports] == ["corrected", "unknown"]
    assert reports[0]["effectiveDateTime"] == "2024-01-02T08:30:00+01:00"
    assert [len(r["result"]) for r in reports] == [6, 1]
    assert obs[0]["valueQuantity"] == {
        "value": 7.2,
        "unit": "milligram per deciliter",
        "system": "http://unitsofmeasure.org",
        "code": "mg/dL",
    }
    assert '"value":7.20,' in out[("types", "oru")][1]  # the number's own text: FHIR decimals keep their precision
    assert obs[0]["status"] == "corrected" and obs[0]["interpretation"][0]["coding"][0]["code"] == "H"
    assert obs[1]["valueQuantity"] == {"value": 12.5, "comparator": "<=", "unit": "g/dL"}
    assert obs[2]["valueCodeableConcept"] == {"coding": [{"code": "A+", "display": "A positive"}]}
    assert obs[3]["valueDateTime"] == "2024-01-01"
    assert obs[4]["valueString"] == "line one\nline two"
    assert obs[5]["valueString"] == "not a number" and obs[5]["status"] == "unknown"
    assert obs[6]["valueString"] == "second panel"


def test_separator_escapes_are_decoded_in_the_leaves_the_mapping_reads(out: dict[Any, Any]) -> None:
    """Escapes pair left to right within a leaf; unknown codes and an unterminated one stay verbatim."""

    def resources(key: str) -> list[dict[str, Any]]:
        return [e["resource"] for e in check_bundle(out[("escapes", key)][1])["entry"]]

    known = resources("known")[0]
    assert known["name"] == [
        {"family": "O&BRIEN", "given": ["A^B\\F\\", "\\H\\hi\\N\\"], "prefix": ["DR"], "suffix": ["JR|"]}
    ]
    unterminated = resources("unterminated")[0]
    assert unterminated["identifier"][0]["value"] == "X2\\"
    assert unterminated["name"] == [{"family": "SMITH\\", "given": ["JOHN\\X"]}]
    texts = [r.get("valueString") for r in resources("text") if r["resourceType"] == "Observation"]
    assert texts == ["a~b\nc^d^e&f", "\\\\x\\", None, "ab\\"]
    assert resources("other separators")[0]["name"] == [{"family": "L*AST", "given": ["F#IRST"]}]
    patient, order = resources("order")
    assert patient["name"] == [{"family": "N|", "given": ["G"]}]
    assert order["identifier"][0]["value"] == "P^1"
    assert order["code"]["coding"][0] == {"system": "http://loinc.org", "code": "C&X", "display": "D~Y"}
    # U+FDD0-FDD6 are what the mapping resolves escapes with: a message holding one is read undecoded.
    assert resources("noncharacter")[0]["name"] == [{"family": "NON\ufdd2CHAR\\S\\", "given": ["G"]}]


def test_structured_numbers_become_quantities_ranges_and_ratios(out: dict[Any, Any]) -> None:
    """SN per the V2-to-FHIR IG: a comparator and a number → valueQuantity, ``-`` → valueRange (in
    OBX-6's unit), ``:`` or ``/`` → valueRatio; anything else stays its text."""
    values = [
        {k: v for k, v in e["resource"].items() if k.startswith("value")}
        for e in check_bundle(out[("types", "sn")][1])["entry"]
        if e["resource"]["resourceType"] == "Observation"
    ]
    ucum = {"unit": "mg/dL", "system": "http://unitsofmeasure.org", "code": "mg/dL"}
    assert values == [
        {"valueRange": {"low": {"value": 10, **ucum}, "high": {"value": 20.5, **ucum}}},
        {"valueRatio": {"numerator": {"value": 1}, "denominator": {"value": 128}}},
        {"valueRatio": {"numerator": {"value": 1}, "denominator": {"value": 4}}},
        {"valueQuantity": {"value": 5, "comparator": ">="}},
        {"valueString": "<^1^-^2"},
        {"valueString": "^1^-^x"},
        {"valueString": "^2^+"},
    ]
    assert '"high":{"value":20.50,' in out[("types", "sn")][1]  # the number's own text


def test_next_of_kin_become_contacts_and_notes_follow_their_observation(out: dict[Any, Any]) -> None:
    """Per the V2-to-FHIR IG: NK1 → Patient.contact (an NK1 with no name, telecom or address is no
    contact: FHIR's pat-1), an NTE right after an OBX → that Observation's note; an NTE after the OBR
    or after another segment is no Observation's."""
    patient = check_bundle(out[("ig", "nk1")][1])["entry"][0]["resource"]
    spouse = {"system": "http://terminology.hl7.org/CodeSystem/v2-0063", "code": "SPO", "display": "Spouse"}
    assert patient["contact"] == [
        {
            "relationship": [{"coding": [spouse]}],
            "name": {"family": "DOE", "given": ["JOHN", "Q"]},
            "telecom": [
                {"system": "phone", "value": "555 1234567", "use": "home"},
                {"system": "fax", "value": "555 7654321", "use": "work"},
            ],
            "address": {"use": "home", "line": ["1 MAIN ST"], "city": "TOWN", "state": "ST", "postalCode": "12345"},
        },
        {
            "name": {"family": "ROE^X", "given": ["RICHARD"]},
            "telecom": [{"system": "email", "value": "r@example.org", "use": "home"}],
        },
    ]
    notes = [
        e["resource"].get("note")
        for e in check_bundle(out[("ig", "nte")][1])["entry"]
        if e["resource"]["resourceType"] == "Observation"
    ]
    assert notes == [[{"text": "first & note"}, {"text": "second\nline"}], None, [{"text": "third"}]]


def test_a_redelivery_is_the_same_bundle_with_conditional_writes(spark: SparkSession, out: dict[Any, Any]) -> None:
    first = out[("again", "first")][1]
    rerun = transform(
        spark.createDataFrame([(1, "fhir", ORU_R01, "m1")], ROUTED), [SPEC], message_id_col="message_id"
    ).collect()[0]["payload"]
    assert first == rerun  # the transform run again (a crash, a reclaim): the same bytes
    requests = [e["request"] for e in json.loads(first)["entry"]]
    assert requests[0] == {
        "method": "PUT",
        "url": "Patient?identifier=urn%3Aoid%3A2.16.840.1.113883.19.6|555",
    }
    assert all(r["method"] == "PUT" for r in requests)
    # Another message id: other fullUrls, the same identifiers (the server updates, never duplicates).
    other = json.loads(out[("again", "other")][1])
    assert [e["fullUrl"] for e in other["entry"]] != [e["fullUrl"] for e in json.loads(first)["entry"]]
    assert [e["request"] for e in other["entry"]] == requests


def test_what_the_mapping_cannot_take_is_refused_with_its_reason(out: dict[Any, Any]) -> None:
    refused = {k: out[("refused", k)] for k in REFUSED}
    assert refused[1] == ("fhir-r4: no FHIR mapping for message type SIU^S12", None)
    assert refused[2] == ("fhir-r4: ORM^O01 without a PID: a ServiceRequest needs a subject", None)
    assert refused[3][1] is None and refused[3][0].startswith("fhir-r4: a batch of several messages")
    assert refused[4][1] is None  # not HL7: the finalize dead-letters it like any unreadable payload
    assert refused[6] == (
        "fhir-r4: more than 1000 OBR, OBX, ORC, PID or NK1 segments: too many for one Bundle",
        None,
    )
    assert refused[5] == ("fhir-r4: no FHIR mapping for message type ADT^A03", None)


def test_rules_run_before_the_mapping(out: dict[Any, Any]) -> None:
    doc = check_bundle(out[("ruled", "a04")][1])
    patient = doc["entry"][0]["resource"]
    assert patient["gender"] == "female"
    assert patient["identifier"][0] == {"system": SYSTEMS["LAB"], "value": "42"}


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"destination": "x", "fhir": {}}, "transform[0]: 'fhir' settings go with output = 'fhir-r4'"),
        (
            {"destination": "x", "output": "fhir-r4", "fhir": {"timezone": "CET"}},
            "transform[0].fhir.timezone: must be 'Z' or an offset such as '+01:00', got 'CET'",
        ),
        (
            {"destination": "x", "output": "fhir-r4", "fhir": {"timezone": "+14:30"}},  # FHIR's offsets end at 14:00
            "transform[0].fhir.timezone: must be 'Z' or an offset such as '+01:00', got '+14:30'",
        ),
        (
            {"destination": "x", "output": "fhir-r4", "fhir": {"patient_class": {"R": " IMP"}}},
            "transform[0].fhir.patient_class.R: must be a code: no leading, trailing or repeated",
        ),
        (
            {"destination": "x", "output": "fhir-r4", "fhir": {"code_systems": {"LN": "loinc"}}},
            "transform[0].fhir.code_systems.LN: must be an absolute URI",
        ),
        (
            {"destination": "x", "output": "fhir-r4", "fhir": {"gender": {"M": "man"}}},
            "transform[0].fhir.gender.M: Input should be 'male', 'female', 'other' or 'unknown'",
        ),
        (
            {"destination": "x", "output": "fhir-r4", "fhir": {"systems": {}}},
            "transform[0].fhir.systems: unknown setting",
        ),
        ({"destination": "x", "output": "fhir"}, "transform[0].output: Input should be 'hl7', 'json' or 'fhir-r4'"),
    ],
)
def test_fhir_settings_are_checked_at_config_load(spec: dict[str, Any], error: str) -> None:
    with pytest.raises(TransformConfigError) as caught:
        parse_transforms([spec])
    assert error in str(caught.value)


def test_red_team_findings_are_mapped_right_or_refused(out: dict[Any, Any]) -> None:
    """Issue 27's red team: nothing filed under the wrong patient, nothing a server must reject."""
    red = {k: out[("red", k)] for k in RED}

    def entries(key: str) -> list[dict[str, Any]]:
        assert red[key][0] == FHIR_CONTENT_TYPE, red[key]
        return check_bundle(red[key][1])["entry"]

    assert red["adt two pids"] == (_SEVERAL_PATIENTS, None)  # an ADT is one patient's
    patients = {e["fullUrl"]: e["resource"]["identifier"][0]["value"] for e in entries("two patients")[:2]}
    assert list(patients.values()) == ["555", "VICTIM"]
    filed = {
        r["resource"]["identifier"][0]["value"]: patients[r["resource"]["subject"]["reference"]]
        for r in entries("two patients")
        if r["resource"]["resourceType"] == "DiagnosticReport"
    }
    assert filed == {"F1": "555", "F2": "VICTIM"}
    assert red["oru without pid"] == ("fhir-r4: ORU^R01 without a PID: results need a subject", None)
    assert red["msh only"] == red["oru without pid"]
    assert red["same filler"] == (_SAME_URL, None) and red["same placer"] == (_SAME_URL, None)

    # M1: the same message again keeps its identifiers; another one (a wrapped MSH-10 with another
    # time or patient, another MSH-3) writes its own.
    def keyed(key: str) -> list[str]:
        return [e["request"]["url"] for e in entries(key)[1:]]

    assert keyed("first") == keyed("resent") and len(keyed("first")) == 2
    others = [keyed(k) for k in ("first", "wrapped", "other patient", "other msh-3")]
    assert len({u for urls in others for u in urls}) == 8

    # M2: a blank MRN is no identifier (no conditional write on it); a padded one is trimmed; the
    # OID names the authority, not a namespace another hospital may use too.
    assert "identifier" not in entries("blank mrn")[0]["resource"]
    assert entries("blank mrn")[0]["request"] == {"method": "POST", "url": "Patient"}
    padded = entries("padded mrn")[0]
    assert [i["value"] for i in padded["resource"]["identifier"]] == ["X1"]
    assert padded["request"]["url"] == "Patient?identifier=urn%3Aoid%3A2.16.840.1.113883.19.7|X1"
    assert entries("oid")[0]["resource"]["identifier"][0]["system"] == "urn:oid:1.2.840.114350.1"

    # M4: codes trimmed, inner whitespace one space, a blank one absent; M5: no +14:30, no year 0000.
    patient, report, *obs = (e["resource"] for e in entries("codes"))
    assert patient["identifier"][0]["value"] == "555"
    assert report["code"] == {"text": "Lipid"} and "effectiveDateTime" not in report
    assert obs[0]["code"]["coding"][0]["code"] == "2093-3"
    assert obs[0]["valueQuantity"]["code"] == "mg /dL"
    assert obs[0]["interpretation"][0]["coding"][0]["code"] == "H"
    assert obs[1]["valueCodeableConcept"]["coding"][0]["code"] == "a b"
    assert obs[2]["valueString"] == "0000" and "valueDateTime" not in obs[2]
    assert obs[3]["valueDateTime"] == "2024-01-01T12:00:00-14:00"
    patient, encounter = (e["resource"] for e in entries("adt codes"))
    assert patient["identifier"][0]["type"]["coding"][0]["code"] == "MR" and "birthDate" not in patient
    assert encounter["class"]["code"] == "IMP" and "period" not in encounter

    # Low: at most 18 digits make a FHIR decimal; more stay the text sent.
    values = [{k: v for k, v in e["resource"].items() if k.startswith("value")} for e in entries("decimals")[2:]]
    assert values[0] == {"valueQuantity": {"value": int("9" * 18)}}
    assert values[1] == {"valueString": "9" * 19}
    assert list(values[2]) == ["valueString"] and list(values[3]) == ["valueString"]


def test_the_python_peer_agrees_on_the_red_team_rows(out: dict[Any, Any]) -> None:
    options = parse_transforms([SPEC])[0].fhir
    assert options is not None
    for key, payload in RED.items():
        if key == "decimals":
            continue  # SN ranges: the peer's scope leaves SN out (bench/peers/fhir_peer.py)
        text = out[("red", key)][1]
        assert fhir_peer.bundle(payload, SEEDS[("red", key)], options) == (json.loads(text) if text else None), key


def _multi(out: dict[Any, Any], group: str, key: str) -> list[dict[str, Any]]:
    content_type, text = out[(group, key)]
    assert content_type == FHIR_CONTENT_TYPE, (key, content_type)
    return check_bundle(text)["entry"]


def _by_patient(entries: list[dict[str, Any]]) -> dict[str, list[tuple[str, str]]]:
    """What each Patient (its MRN, else "-") has filed under it: (resource type, code or value)."""
    names = {
        e["fullUrl"]: next((i["value"] for i in e["resource"].get("identifier", [])), "-")
        for e in entries
        if e["resource"]["resourceType"] == "Patient"
    }
    filed: dict[str, list[tuple[str, str]]] = {name: [] for name in names.values()}
    for e in entries:
        r = e["resource"]
        if "subject" in r:
            value = r.get("valueQuantity", {}).get("value", r["code"].get("coding", [{}])[0].get("code"))
            filed[names[r["subject"]["reference"]]].append((r["resourceType"], str(value)))
    return filed


def test_each_patient_group_of_an_oru_is_its_own_patient_with_its_own_results(out: dict[Any, Any]) -> None:
    """The IG's ORU_R01 map: each PATIENT_RESULT's PID its own Patient, its ORDER_OBSERVATION groups'
    reports and observations referring to it; the NTE after an OBR is mapped nowhere (the IG maps
    none, and R4's DiagnosticReport has no note)."""
    entries = _multi(out, "golden", "oru_r01_two_patients")
    by_url = {e["fullUrl"]: e["resource"] for e in entries}
    patients = {r["identifier"][0]["value"]: url for url, r in by_url.items() if r["resourceType"] == "Patient"}
    assert list(patients) == ["555", "556"]
    hemoglobin = next(
        (url, r)
        for url, r in by_url.items()
        if r["resourceType"] == "Observation" and r["code"]["coding"][0]["code"] == "718-7"
    )
    assert hemoglobin[1]["subject"] == {"reference": patients["556"]}  # B's hemoglobin is under B
    assert hemoglobin[1]["valueQuantity"]["value"] == 9.1
    reports = {r["identifier"][0]["value"]: r for r in by_url.values() if r["resourceType"] == "DiagnosticReport"}
    assert reports["FIL2"]["subject"] == {"reference": patients["556"]}
    assert hemoglobin[0] in [x["reference"] for x in reports["FIL2"]["result"]]
    assert [by_url[x["reference"]]["subject"] for x in reports["FIL1"]["result"]] == [{"reference": patients["555"]}]
    assert _by_patient(entries) == {
        "555": [("DiagnosticReport", "24331-1"), ("Observation", "196")],
        "556": [("DiagnosticReport", "58410-2"), ("Observation", "9.1"), ("Observation", "7.5")],
    }
    assert "contact" not in by_url[patients["555"]]  # the NK1 is the second patient's
    assert by_url[patients["556"]]["contact"][0]["name"] == {"family": "OTHER", "given": ["BOB"]}
    assert "hemolyzed" not in out[("golden", "oru_r01_two_patients")][1]


def test_each_patient_of_an_orm_gets_its_orders_and_an_order_gets_its_notes(out: dict[Any, Any]) -> None:
    """ORM^O01: the orders after a PID are that patient's; the NTE right after an OBR (the IG's
    ORDER_DETAIL NTE) → ServiceRequest.note, NTE-3 its text."""
    entries = _multi(out, "golden", "orm_o01_two_patients")
    assert _by_patient(entries) == {"777": [("ServiceRequest", "71020")], "778": [("ServiceRequest", "74150")]}
    first, second = (e["resource"] for e in entries if e["resource"]["resourceType"] == "ServiceRequest")
    assert first["note"] == [{"text": "patient on oxygen"}, {"text": "portable & bedside if possible"}]
    assert first["priority"] == "routine" and first["status"] == "active"
    assert "note" not in second and second["priority"] == "stat"


def test_patient_groups_keep_their_identifiers_when_resent_and_never_share_one(out: dict[Any, Any]) -> None:
    """Each group's Stageline identifiers derive from the message's identity and that group's PID-3:
    a re-send writes on the same URLs; the first group's are those the message had with that patient
    alone (what main wrote before several patients were mapped); no two groups meet."""
    golden = _multi(out, "golden", "oru_r01_two_patients")
    resent = _multi(out, "multi", "resent")
    assert [e["request"] for e in resent] == [e["request"] for e in golden]
    assert [e["resource"] for e in resent] != [e["resource"] for e in golden]  # other fullUrls in the references
    assert [e["fullUrl"] for e in resent] != [e["fullUrl"] for e in golden]
    alone = _multi(out, "multi", "first only")
    mine = {"reference": golden[0]["fullUrl"]}  # the first patient's entry
    first_group = [e for e in golden if e is golden[0] or e["resource"].get("subject") == mine]
    assert [e["request"] for e in alone] == [e["request"] for e in first_group]
    assert len(first_group) == 3
    keys = [i["value"] for e in golden for i in e["resource"]["identifier"] if i.get("system") == "urn:ietf:rfc:3986"]
    assert len(keys) == len(set(keys)) == 5


def test_hostile_patient_groups_are_mapped_under_the_right_patient_or_refused(out: dict[Any, Any]) -> None:
    fifty = _multi(out, "multi", "fifty")
    assert _by_patient(fifty) == {
        f"N{i}": [("DiagnosticReport", "58410-2"), ("Observation", f"{i}.5")] for i in range(1, 51)
    }
    reports = [e["resource"] for e in fifty if e["resource"]["resourceType"] == "DiagnosticReport"]
    observations = {e["fullUrl"]: e["resource"] for e in fifty if e["resource"]["resourceType"] == "Observation"}
    for report in reports:
        (result,) = report["result"]
        assert observations[result["reference"]]["subject"] == report["subject"]

    # A second patient with no identifier: a plain POST, its hemoglobin under it by fullUrl.
    anonymous = _multi(out, "multi", "no identifiers")
    assert _by_patient(anonymous) == {
        "A1": [("DiagnosticReport", "58410-2"), ("Observation", "13.1")],
        "-": [("DiagnosticReport", "58410-2"), ("Observation", "9.2")],
    }
    assert anonymous[1]["request"] == {"method": "POST", "url": "Patient"}

    # A group with no results: its Patient alone; the next group's results are the next patient's.
    assert _by_patient(_multi(out, "multi", "empty group")) == {
        "E1": [],
        "E2": [("DiagnosticReport", "58410-2"), ("Observation", "11.0")],
    }

    # A patient's own OBX before its first OBR is its own, in no report of the patient before.
    observed = _multi(out, "multi", "patient observation")
    assert _by_patient(observed) == {
        "O1": [("DiagnosticReport", "58410-2"), ("Observation", "12.0")],
        "O2": [("DiagnosticReport", "58410-2"), ("Observation", "70")],
    }
    reports = [e["resource"] for e in observed if e["resource"]["resourceType"] == "DiagnosticReport"]
    assert [len(r.get("result", [])) for r in reports] == [1, 0]  # O2's report: its OBX came before it

    # One patient in two groups: refused (a server would fail its two entries on one conditional URL).
    assert out[("multi", "same patient")] == (_SAME_PATIENT, None)
    # Results or orders before the first of several PIDs: whose they are is not said.
    assert out[("multi", "before the first")] == (_BEFORE_FIRST_PID, None)
    assert out[("multi", "orm orders before")] == (_BEFORE_FIRST_PID, None)


def test_the_python_peer_agrees_on_several_patients(out: dict[Any, Any]) -> None:
    options = parse_transforms([SPEC])[0].fhir
    assert options is not None
    rows = [("multi", k, p) for k, p in MULTI.items()]
    rows += [("golden", k, GOLDEN_SAMPLES[k]) for k in ("oru_r01_two_patients", "orm_o01_two_patients")]
    for group, key, payload in rows:
        text = out[(group, key)][1]
        got = fhir_peer.bundle(payload, SEEDS[(group, key)], options)
        assert got == (json.loads(text) if text else None), key


def _observed(out: dict[Any, Any], key: str) -> dict[str, tuple[str, str, float]]:
    """Each Observation's conditional URL → (its patient's MRN, its code, its value)."""
    entries = _multi(out, "multi", key)
    mrn = {
        e["fullUrl"]: e["resource"]["identifier"][0]["value"]
        for e in entries
        if e["resource"]["resourceType"] == "Patient"
    }
    return {
        e["request"]["url"]: (
            mrn[r["subject"]["reference"]],
            r["code"]["coding"][0]["code"],
            r["valueQuantity"]["value"],
        )
        for e in entries
        if (r := e["resource"])["resourceType"] == "Observation"
    }


def test_a_resent_message_writes_each_result_on_its_own_url_whatever_the_other_groups(out: dict[Any, Any]) -> None:
    """Re-sent with its groups in another order, or a result fewer in the first, a message's results
    keep their conditional URLs: each is numbered within its patient's group (red team H, issue 27)."""
    first = _observed(out, "groups AB")
    assert len(first) == 8 and len(set(first.values())) == 8
    assert _observed(out, "groups BA") == first
    fewer = _observed(out, "groups A-1 B")
    assert len(fewer) == 7 and all(first[url] == result for url, result in fewer.items())

    # Reports too: each group's panel keeps its URL.
    def reports(key: str) -> dict[str, str]:
        entries = _multi(out, "multi", key)
        return {
            e["request"]["url"]: e["resource"]["subject"]["reference"]
            for e in entries
            if e["resource"]["resourceType"] == "DiagnosticReport"
        }

    assert set(reports("groups AB")) == set(reports("groups BA"))
    # Two groups without a PID-3 could not be told apart on a re-send: refused.
    assert out[("multi", "two anonymous")] == (_SAME_PATIENT, None)


def test_hostile_patient_identities_and_segment_ids_are_refused(out: dict[Any, Any]) -> None:
    # The same identifier (HOSP|999) in two groups, as the second of one's and the first of the other's.
    assert out[("multi", "shared identifier")] == (_SAME_PATIENT, None)
    for key in ("space before PID", "tab before PID", "BOM before PID", "lowercase pid", "adt space before PID"):
        assert out[("multi", key)] == (_MISNAMED, None), key
    assert out[("multi", "too many patients")] == (_TOO_MANY_PATIENTS, None)


def test_an_order_without_an_orc_before_it_takes_none_after_it(out: dict[Any, Any]) -> None:
    entries = _multi(out, "multi", "orc after obr")
    orders = [e["resource"] for e in entries if e["resource"]["resourceType"] == "ServiceRequest"]
    assert [o["status"] for o in orders] == ["active", "unknown"]  # not the CA after patient 2's OBR
    assert next(i.get("value") for i in orders[1]["identifier"]) == "O2"
