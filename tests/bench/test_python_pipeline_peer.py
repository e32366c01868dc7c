"""The plain-Python benchmark peer (bench/peers/python_pipeline.py) against the Spark stage code.

The benchmark is only fair if both sides do the same work, so whole outputs are compared: every
route row, every transformed payload byte for byte. Inputs are the spark_jobs samples (odd
separators, LF/CRLF endings, escapes, not-HL7, NULL), a few malformed-but-legal extras (batch
envelope, concatenated messages, undeclared separators, bare segments, blank lines, trailing
spaces, non-ASCII) and a slice of the benchmark corpus. No case needed excluding: where
python-hl7 alone differs from Spark the peer adapts (see its module docstring).

One local SparkSession for the run (the spark_jobs fixture), one Spark job per comparison.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import LongType, StringType, StructField, StructType

from bench.hl7_corpus import messages as corpus
from bench.peers.python_pipeline import route_messages, run, transform_messages
from spark_jobs.route_rules import route
from spark_jobs.transform_rules import transform
from tests.spark_jobs.conftest import spark  # noqa: F401  (the session fixture, shared)
from tests.spark_jobs.hl7_samples import CORPUS

ROOT = Path(__file__).resolve().parents[2]
CONFIG_ROUTES: list[dict[str, Any]] = tomllib.loads((ROOT / "config" / "routes.toml").read_text())["route"]

EXTRA: dict[int, str] = {
    # Batch file, LF endings: rules apply per message, the envelope passes through.
    20: "FHS|^~\\&|SND|FAC|RCV|RFAC|20240107\nBHS|^~\\&|SND|FAC|RCV|RFAC|20240107\n"
    "MSH|^~\\&|LAB|FAC|EHR|CITY|20240107||ORU^R01|B1|P|2.5\nPID|1||111^^^LAB^MR\n"
    "OBX|1|ST|A^a||one||||||F\nOBX|2|ST|B^b||two|||H|||F\nZPI|1|x\n"
    "MSH|^~\\&|LAB|FAC|EHR|CITY|20240107||ORU^R01|B2|P|2.5\nPID|1||222^^^LAB^MR\n"
    "OBX|1|ST|C^c||three|||N|||F\nBTS|2\nFTS|1\n",
    # Two messages concatenated without an envelope, CRLF, the second with its own separators.
    21: "MSH|^~\\&|ADT1|FAC|EHR|CITY|20240108||ADT^A08|C1|P|2.5\r\nPID|1||5^^^F^MR||A^B\r\nPV1|1|O\r\n"
    "MSH#*~\\&#ADT1#FAC#EHR#CITY#20240108##ADT*A08#C2#P#2.5\r\nPID#1##6***F*MR##C*D\r\n",
    # MSH-2 declares only '^': '~' and '&' are text, and nothing can be escaped.
    22: "MSH|^|APP|FAC|EHR|CITY|20240109||ADT^A01|U1|P|2.3\rPID|1||a~b^c&d^^x||X~Y^Z|\\F\\\rPV1|1|I\rZPD|1|k~v\r",
    # Leading and blank lines, trailing spaces (also at the very end, after the last segment).
    23: "\r\nMSH|^~\\&|APP|FAC|EHR|CITY|20240110||ADT^A01^ADT_A01|T1|P|2.5\r\r"
    "PID|1||9^^^H^MR||N^M  \rPV1|1|E\rZPI|1|x  ",
    # Bare segments (id only) are still segments: rules pad them, drop and rename find them.
    24: "MSH|^~\\&|LAB|FAC|EHR|CITY|20240111||ORU^R01|Z1|P|2.5\rPID|1||7^^^H^MR\rOBX\rOBX|2|ST|X^x||v|||L\rZPD\r",
    # Already-decoded non-ASCII text.
    25: "MSH|^~\\&|APP|FAC|EHR|CITY|20240112||ADT^A08|N1|P|2.5\r"
    "PID|1||9^^^FAC^MR~8^^^X&1.2&ISO^SS||Müller^Zoë^É||||||Straße 1^^Köln\rNTE|1||東京 — naïve ☃\r",
    # v2.7 MSH-2 with the truncation character: five encoding characters, '#' is plain text.
    26: "MSH|^~\\&#|LAB|FAC|EHR|CITY|20240113||ORU^R01^ORU_R01|V1|P|2.7\rPID|1||4#2^^^H^MR\r"
    "OBX|1|ST|A^a||x#y|||H|||F\r",
}
PAYLOADS: dict[int, str | None] = {**CORPUS, **EXTRA, **{100 + i: m for i, m in enumerate(corpus(300, seed=7))}}

# Every leaf operator and combinator, routes sharing destinations, and a catch-all.
ROUTES: list[dict[str, Any]] = [
    {
        "name": "adt-inpatient",
        "destinations": ["ehr", "bed-board"],
        "when": {
            "all": [
                {"field": "MSH-9.1", "op": "eq", "value": "ADT"},
                {"not": {"field": "PV1-2", "op": "in", "value": ["O", "E"]}},
            ]
        },
    },
    {
        "name": "labs",
        "destinations": ["lab", "ehr"],
        "when": {
            "any": [{"field": "MSH-9", "op": "regex", "value": "^OR[UM]\\^"}, {"field": "OBX[2]-8", "op": "exists"}]
        },
    },
    {"name": "second-id", "destinations": ["mpi"], "when": {"field": "PID-3[2].4.2", "op": "exists"}},
    {"name": "hash-senders", "destinations": ["legacy"], "when": {"field": "MSH-1", "op": "eq", "value": "#"}},
    {
        "name": "z-segments",
        "destinations": ["lab", "zeta"],
        "when": {
            "any": [{"field": "ZPI-1", "op": "exists"}, {"field": "ZPD-1", "op": "regex", "value": "(?i)CONSENT"}]
        },
    },
    {"name": "everything", "destinations": ["audit"]},
]

LOOKUPS = {
    "patient_class": {"I": "INPATIENT", "O": "OUTPATIENT", "E": "EMERGENCY"},
    "flags": {"N": "NORMAL", "H": "HIGH^!", "L": "LOW"},
}
# Every rule kind and `each`, in an order where later rules see earlier results.
EHR_RULES: list[dict[str, Any]] = [
    {"set": "MSH-5", "value": "EHR"},
    {"set": "MSH-6", "value": "CITY^WEST"},  # a constant is escaped with the message's separators
    {"copy": "PID-3.1", "to": "PID-2"},
    {"copy": "PID-3", "to": "PID-4.1"},  # a whole field into a component: '~' and '^' escaped
    {"copy": "NTE-3", "to": "PID-9"},  # escapes copied as they are; a missing source clears
    {"clear": "PID-8"},
    {"map": "PV1-2", "table": "patient_class"},
    {"map": "OBX-8", "table": "flags", "default": "clear", "each": True},
    {"set": "OBX-11", "value": "C", "each": True},
    {"copy": "OBX-3.2", "to": "OBX-4", "each": True},
    {"drop_segment": "ZPI"},
    {"rename_segment": "ZPD", "to": "ZPX"},
    {"set": "ZPX-2[2].3.2", "value": "x&y"},  # creates repetition, components, subcomponent
    {"set": "PID-3[2].4.2", "value": "1.2.3"},
    {"clear": "PID-3[1].4"},
    {"set": "PV1-12.2", "value": "NEW"},
    {"set": "OBX[2]-5", "value": "91"},
]
SPECS: dict[str, list[dict[str, Any]]] = {
    "hl7": [{"destination": "ehr", "rules": EHR_RULES}],
    "json": [{"destination": "lake", "output": "json", "rules": EHR_RULES}],
    "mixed": [
        {
            "destination": "ehr",
            "rules": [
                {"set": "PID-9", "value": "a|b^c~d\\e&f#g*h$i+j?k.l"},
                {"copy": "MSH-2", "to": "PID-20"},
                {"copy": "MSH-1", "to": "PID-21"},
                {"set": "PID-13.1.2", "value": "S"},
                {"set": "PV1-2", "value": ""},
            ],
        },
        {"destination": "lake", "output": "json"},  # no rules: the plain JSON rendering
    ],
}


def _spark_routes(spark: SparkSession, routes: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    schema = StructType([StructField("id", LongType()), StructField("payload", StringType())])
    frame = spark.createDataFrame(list(PAYLOADS.items()), schema)
    return sorted((tuple(r) for r in frame.transform(route, routes).collect()), key=repr)


@pytest.mark.parametrize("routes", [CONFIG_ROUTES, ROUTES], ids=["config-routes", "all-operators"])
def test_route_rows_equal_spark(spark: SparkSession, routes: list[dict[str, Any]]) -> None:
    ids = list(PAYLOADS)
    peer = sorted(((ids[i], d, n, s) for i, d, n, s in route_messages(list(PAYLOADS.values()), routes)), key=repr)
    assert peer == _spark_routes(spark, routes)


@pytest.mark.parametrize("name", list(SPECS))
def test_transformed_payloads_equal_spark(spark: SparkSession, name: str) -> None:
    specs = SPECS[name]
    destinations = [s["destination"] for s in specs] + ["archive"]  # archive: no spec, passes through
    rows = [(i, d, p) for i, p in PAYLOADS.items() for d in destinations]
    schema = StructType(
        [StructField(c, t) for c, t in (("id", LongType()), ("destination", StringType()), ("payload", StringType()))]
    )
    frame = spark.createDataFrame(rows, schema).transform(transform, specs, LOOKUPS)
    expected = {(r["id"], r["destination"]): (r["content_type"], r["payload"]) for r in frame.collect()}
    peer = transform_messages([(d, p) for _i, d, p in rows], specs, LOOKUPS)
    actual = {(i, d): out for (i, d, _p), out in zip(rows, peer)}
    assert actual.keys() == expected.keys()
    mismatched = [key for key in expected if actual[key] != expected[key]]
    first = mismatched[0] if mismatched else None
    assert not mismatched, (
        f"{len(mismatched)} rows differ, first {first}: peer {actual.get(first)!r} spark {expected.get(first)!r}"
    )


def test_run_loop_agrees_with_the_two_stages() -> None:
    """run() reuses the routing parse for the first transform: same bytes as parsing afresh."""
    payloads = list(PAYLOADS.values())
    routes = CONFIG_ROUTES + ROUTES[:2]  # no catch-all: some messages stay unrouted
    specs = [
        *SPECS["hl7"],
        {"destination": "lab", "rules": EHR_RULES[-6:]},
        {"destination": "archive", "output": "json"},
    ]
    rows = route_messages(payloads, routes)
    routed = [(i, d) for i, d, _n, status in rows if status == "pending"]
    outputs = transform_messages([(d, payloads[i]) for i, d in routed], specs, LOOKUPS)
    written = [p for _c, p in outputs if p is not None]
    with_spec = sum(1 for _i, d in routed if d in {"ehr", "lab", "archive"})
    assert run(payloads, routes, specs, LOOKUPS) == {
        "messages": len(payloads),
        "unrouted": len(rows) - len(routed),
        "routed": len(routed),
        "transformed": with_spec,
        "passed_through": len(routed) - with_spec,
        "failed": len(outputs) - len(written),
        "bytes_out": sum(map(len, written)),
    }


def test_corpus_is_deterministic_varied_and_parseable() -> None:
    first = corpus(2000, seed=3)
    assert first == corpus(2000, seed=3) and first != corpus(2000, seed=4)
    assert len({m.split("|", 10)[9] for m in first}) == len(first)  # MSH-10 unique
    kinds = {m.split("|", 9)[8] for m in first}
    assert kinds == {"ADT^A01^ADT_A01", "ADT^A08^ADT_A01", "ORU^R01^ORU_R01", "ORM^O01^ORM_O01"}
    patients = {m.split("\rPID|1||", 1)[1].split("^", 1)[0] for m in first}
    assert 800 < len(patients) <= 1000  # a pool: lanes repeat
    assert all("\n" not in m and m.endswith("\r") for m in first)
    assert any("\\F\\" in m for m in first) and any("~" in m.split("\rPID", 1)[1] for m in first)
