"""The transform rules over Spark Connect give what they give on a classic session.

Spark Connect refuses expressions nested deeper than its plan's protobuf limit; a rule's
expression nests per path level and per rule kind (the deepest: a `map` into a subcomponent that
dead-letters a miss), and the classic session the other tests share has no such limit. So the
deepest rules, every other kind, JSON and FHIR output run here once through a real Connect server (the
client in a child process: a Connect session switches pyspark's functions process-wide) and their
output must equal the classic session's, byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from pyspark.sql import SparkSession

from include.app.lab.postgres_server import free_port
from spark_jobs.transform_rules import transform
from tests.spark_jobs.hl7_samples import (
    ADT_A01,
    CUSTOM_HASH,
    NOT_HL7,
    ORM_O01,
    ORM_O01_TWO_PATIENTS,
    ORU_R01,
    ORU_R01_TWO_PATIENTS,
)
from tests.spark_jobs.test_transform_rules import BATCH, EHR_RULES, LOOKUPS, ROUTED

REPO = Path(__file__).resolve().parents[2]

DEEP_RULES = [
    {"map": "PID-3[2].4.2", "table": "flags", "not_found": "dead_letter"},  # the deepest expression
    {"map": "PID-3.4.2", "table": "flags", "not_found": "default", "default": "U"},
    {"set": "ZPI-2[2].3.2", "value": "x"},
    {"copy": "PID-3[2].4.3", "to": "PID-4.1.2"},
]
SPECS = [
    {"destination": "ehr", "rules": EHR_RULES + DEEP_RULES[1:]},
    {"destination": "deep", "rules": DEEP_RULES},
    {"destination": "lake", "output": "json", "rules": [{"drop_segment": "ZPI"}, *DEEP_RULES[1:]]},
    # The FHIR mapping (issue 27) nests deepest of all outputs: a resource's structs inside lambdas.
    {"destination": "fhir", "output": "fhir-r4", "rules": DEEP_RULES[1:]},
]
ROWS = [
    (i, destination, payload)
    for i, payload in enumerate(
        (ADT_A01, ORU_R01, ORM_O01, CUSTOM_HASH, BATCH, NOT_HL7, ORU_R01_TWO_PATIENTS, ORM_O01_TWO_PATIENTS), start=1
    )
    for destination in ("ehr", "deep", "lake", "fhir", "archive")
]

CHILD = textwrap.dedent("""
    import json, sys
    from include.spark import spark_session
    from spark_jobs.transform_rules import transform
    from tests.spark_jobs.test_transform_connect import LOOKUPS, ROUTED, ROWS, SPECS
    spark = spark_session(remote=sys.argv[1])
    out = transform(spark.createDataFrame(ROWS, ROUTED), SPECS, LOOKUPS).collect()
    print(json.dumps(sorted([r["id"], r["destination"], r["content_type"], r["payload"]] for r in out)))
    spark.stop()
""")


def test_the_deepest_rules_give_the_same_output_over_spark_connect(spark: SparkSession, tmp_path) -> None:
    from include.spark import start_connect_server, stop_connect_server

    classic = sorted(
        [r["id"], r["destination"], r["content_type"], r["payload"]]
        for r in transform(spark.createDataFrame(ROWS, ROUTED), SPECS, LOOKUPS).collect()
    )
    assert len(classic) == len(ROWS)
    assert any(p is None for i, d, _, p in classic if d == "deep" and i != 6)  # a miss dead-lettered
    assert any(p is not None and d == "lake" and p.startswith("{") for _, d, _, p in classic)
    assert any(p is not None and d == "fhir" and p.startswith('{"resourceType":"Bundle"') for _, d, _, p in classic)
    # Two patients' results and orders (rows 7, 8): a Bundle each, with a Patient per PID.
    assert [p.count('"resourceType":"Patient"') for i, d, _, p in classic if d == "fhir" and i > 6] == [2, 2]
    server = start_connect_server(
        free_port(),
        log_dir=tmp_path,
        master="local[1]",
        conf={
            "spark.sql.shuffle.partitions": "1",
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        },
    )
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, server.url], capture_output=True, text=True, timeout=180, cwd=REPO
        )
    finally:
        stop_connect_server(server)
    assert child.returncode == 0, child.stderr[-4000:]
    assert json.loads(child.stdout.strip().splitlines()[-1]) == classic


# The mapping's projections as a Spark Connect client sends them (is_remote(): pyspark's functions
# build protobuf expressions), measured in protobuf message levels without a server.
DEPTHS = textwrap.dedent("""
    import json
    from google.protobuf.message import Message
    from pyspark.sql import functions as F
    from include.transforms_config import parse_transforms
    from spark_jobs import hl7_fhir

    def depth(m):
        inner = [
            x
            for fd, v in m.ListFields()
            if fd.message_type is not None
            for x in (v if not isinstance(v, Message) and hasattr(v, "__len__") else [v])
            if isinstance(x, Message)
        ]
        return 1 + max((depth(x) for x in inner), default=0)

    options = parse_transforms([{"destination": "fhir", "output": "fhir-r4"}])[0].fhir
    ctx = F.col("ctx")
    parts = {"context": hl7_fhir.fhir_context(F.col("units"), F.col("seed"))}
    parts.update(hl7_fhir.fhir_entries(ctx, F.col("seed"), options))
    parts["bundle"] = hl7_fhir.fhir_bundle(ctx, [F.col(n) for n in hl7_fhir.ENTRY_PARTS])[0]
    print(json.dumps({name: depth(c._expr.to_plan(None)) for name, c in parts.items()}))
""")
CONNECT_DEPTH = 96
"""The deepest expression main's mapping sent (the Observation's, 2026-11-28) and the test above took;
a few levels more and the plan, with the relations above it, passes protobuf's limit of 100."""


def test_no_fhir_projection_nests_deeper_than_spark_connect_took() -> None:
    """Fast and precise where the test above is slow and whole: the depth of each FHIR projection."""
    env = {**os.environ, "SPARK_CONNECT_MODE_ENABLED": "1"}
    child = subprocess.run(
        [sys.executable, "-c", DEPTHS], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )
    assert child.returncode == 0, child.stderr[-4000:]
    depths = json.loads(child.stdout.strip().splitlines()[-1])
    assert set(depths) == {"context", "bundle", "patients", "encounter", "reports", "observations", "orders"}
    assert max(depths.values()) <= CONNECT_DEPTH, depths
    assert min(depths.values()) > 10, depths  # measured, not an empty plan
