"""An HL7 batch file split at ingest is routed message by message (docs/listenerd.md, "Batches"), on
real SQLite and PostgreSQL with a real route run: a batch of N messages is N staged rows and, after
the route stage, N routed messages — each to its own route's destinations (the ADT to the ADT route,
not only a catch-all), each with its own audit trail that names the batch it came in."""

from __future__ import annotations

from pyspark.sql import SparkSession

from include.store import Store, rowlease
from include.store.lease import acquire_permanent
from listeners.filedrop import file_message_id
from listeners.group_commit import InboundBatch
from listeners.validation import build_inbound, lane_rule
from tests.spark_jobs.test_route_job import NODE, rows, run_once

MESSAGES = [  # (control id, type, patient): ADT and ORU mixed in one batch
    ("A1", "ADT^A01", "P1"),
    ("R1", "ORU^R01", "P2"),
    ("A2", "ADT^A08", "P2"),
    ("R2", "ORU^R01", "P1"),
    ("A3", "ADT^A03", "P3"),
]
EXPECTED = {"ADT": {"ehr": "adt", "archive": "adt"}, "ORU": {"ehr": "results", "lab": "results"}}


def batch_file() -> bytes:
    body = "".join(
        f"MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||{kind}|{cid}|P|2.5.1\r"
        f"PID|1||{patient}^^^HOSP^MR||DOE^JANE\rPV1|1|O\r"
        for cid, kind, patient in MESSAGES
    )
    return (
        f"FHS|^~\\&|HIS|HOSP|SL|SL|20240101120000||||FILE-7\rBHS|^~\\&|HIS|HOSP|SL|SL|20240101120000||||BATCH-7\r"
        f"{body}BTS|{len(MESSAGES)}\rFTS|1\r"
    ).encode()


def test_a_batch_file_of_n_messages_is_n_rows_then_n_routed_messages_each_with_a_trail_naming_its_batch(
    store: Store, spark: SparkSession
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    data = batch_file()
    batch = build_inbound(
        data,
        connection="file-in",
        charset="utf-8",
        lane_of=lane_rule("PID-3.1"),
        message_id=file_message_id("file-in", "adt.batch", data),
    )
    assert isinstance(batch, InboundBatch)
    with store.transaction() as tx:
        staged = rowlease.stage_inbound(tx, batch.rows(), epoch=epoch, node_id=NODE)
    assert staged is not None and len(staged) == len(MESSAGES)
    inbound = rows(
        store, "SELECT id, message_id, control_id, lane_key, batch_id, batch_seq FROM stage_inbound ORDER BY id"
    )
    assert [(r["control_id"], r["lane_key"], r["batch_id"], r["batch_seq"]) for r in inbound] == [
        (cid, patient, batch.batch_id, n) for n, (cid, _, patient) in enumerate(MESSAGES, 1)
    ]
    assert rows(store, "SELECT fhs_control_id, bhs_control_id, declared_count, message_count FROM inbound_batches") == [
        {"fhs_control_id": "FILE-7", "bhs_control_id": "BATCH-7", "declared_count": 5, "message_count": 5}
    ]

    outcome = run_once(store, spark, epoch, "run-1")

    assert len(outcome.done) == len(MESSAGES) and outcome.unrouted == ()
    routed = rows(
        store,
        "SELECT r.control_id, r.destination, r.route_name, r.message_id, r.lane_key "
        "FROM stage_routed r ORDER BY r.source_id, r.destination",
    )
    assert sorted((r["control_id"], r["destination"], r["route_name"]) for r in routed) == sorted(
        (cid, dest, route) for cid, kind, _ in MESSAGES for dest, route in EXPECTED[kind[:3]].items()
    )
    trails = rows(store, "SELECT message_id, stage, event, detail FROM message_events ORDER BY id")
    for n, row in enumerate(inbound, 1):
        trail = [(e["stage"], e["event"], e["detail"]) for e in trails if e["message_id"] == row["message_id"]]
        kind = MESSAGES[n - 1][1][:3]
        assert trail[0] == ("inbound", "received", f"batch {batch.batch_id}: message {n} of {len(MESSAGES)}")
        assert trail[1:] == [("inbound", "done", None)] + [("routed", "routed", None)] * len(EXPECTED[kind])
