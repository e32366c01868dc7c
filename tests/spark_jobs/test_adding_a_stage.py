"""docs/stages.md "Adding a stage", done: a fourth stage that is one record plus its SQL.

`enrich` claims routed rows, notes each message's sending facility (MSH-4) and moves it into a
staged table of its own, `stage_enriched`; a message without one is dead-lettered. Nothing here
is Stageline code but the record, its SQL and its pure transform: the claim, the read, the small
and large paths, landing, the fenced finalize (`finalize_landed`), the audit events and the
hand-back come from `run_stage_job` as they are — the same calls the stage task makes.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from include.store import Store, queries
from include.store.db import ROUTED, StagedTable
from include.store.finalize import BatchOutcome, StaleEpoch
from include.store.lease import acquire_permanent
from include.store.stages import Landing, Stage
from spark_jobs import stage_job
from spark_jobs.hl7_fields import field
from tests.spark_jobs.hl7_samples import ADT_A01, NOT_HL7, ORU_R01
from tests.spark_jobs.test_transform_job import insert_routed, rows

ENRICHED = StagedTable("stage_enriched", "enriched", True, "purge_finished_enriched")

# The record (in include/store/stages.py it would sit between ROUTE and TRANSFORM).
ENRICH = Stage(
    "enrich",
    ROUTED,
    "enrich_read_claimed",
    "id BIGINT, source_id BIGINT, destination STRING, payload STRING",
    doc="note each routed message's sending facility (MSH-4); one without is dead-lettered.",
    landing=Landing("landing_enriched", ("run_id", "routed_id", "facility")),
    output=ENRICHED,
    event="enriched",
    job="tests.spark_jobs.test_adding_a_stage:bind",
)

# Its SQL: a migration and named queries (SQLite's; each dialect has its own file).
MIGRATION = """
CREATE TABLE stage_enriched (
    id INTEGER PRIMARY KEY AUTOINCREMENT, source_id INTEGER NOT NULL, message_id TEXT NOT NULL,
    control_id TEXT, destination TEXT NOT NULL, facility TEXT NOT NULL, lane_key TEXT,
    status TEXT NOT NULL DEFAULT 'pending', lease_owner TEXT, lease_expires_at INTEGER,
    claim_epoch INTEGER, attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at INTEGER,
    created_at INTEGER NOT NULL DEFAULT 0, updated_at INTEGER NOT NULL DEFAULT 0, last_error TEXT,
    UNIQUE (source_id, destination));
CREATE TABLE landing_enriched (run_id TEXT NOT NULL, routed_id INTEGER NOT NULL, facility TEXT);
"""
QUERIES = """
-- name: enrich_read_claimed
SELECT r.id, r.source_id, r.destination, b.payload
  FROM stage_routed r JOIN inbound_bodies b ON b.id = r.source_id
 WHERE r.lease_owner = :owner AND r.claim_epoch = :epoch AND r.status = 'in_flight'

-- name: enrich_landed
SELECT routed_id AS id, min(CASE WHEN facility IS NULL OR facility = '' THEN 0 ELSE 1 END) AS ok,
       'no sending facility (MSH-4)' AS detail
  FROM landing_enriched WHERE run_id = :run_id GROUP BY routed_id

-- name: enrich_finalize_insert
INSERT INTO stage_enriched (source_id, message_id, control_id, destination, facility, lane_key)
SELECT r.source_id, r.message_id, r.control_id, r.destination, l.facility, r.lane_key
  FROM landing_enriched l JOIN stage_routed r ON r.id = l.routed_id
 WHERE l.run_id = :run_id AND l.routed_id IN (SELECT value FROM json_each(:ids))
 GROUP BY l.routed_id ORDER BY l.routed_id
ON CONFLICT DO NOTHING
RETURNING id, message_id, control_id, attempts, status, destination, NULL AS detail

-- name: landing_enriched_insert
INSERT INTO landing_enriched (run_id, routed_id, facility)
SELECT json_extract(r.value, '$.run_id'), json_extract(r.value, '$.routed_id'), json_extract(r.value, '$.facility')
  FROM json_each(:rows) AS r

-- name: landing_enriched_delete
DELETE FROM landing_enriched WHERE run_id = :run_id

-- name: landing_enriched_delete_sources
DELETE FROM landing_enriched WHERE routed_id IN (SELECT value FROM json_each(:ids))
"""


# Its pure transform, and the job the record names.
def noted(claimed: DataFrame, *, run_id: str) -> DataFrame:
    """Claimed routed rows → landing rows: the routed id and MSH-4.1 (NULL when there is none)."""
    return claimed.select(
        F.lit(run_id).alias("run_id"), F.col("id").alias("routed_id"), field("payload", "MSH-4.1").alias("facility")
    )


def bind(context: stage_job.StageContext) -> stage_job.Transform:
    return partial(noted)


@pytest.fixture
def store(sqlite_config_fresh: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    s = Store(sqlite_config_fresh)
    with s.transaction() as tx:
        for statement in MIGRATION.split(";"):
            if statement.strip():
                tx.conn.execute(statement)
    for name, sql in queries.parse_named(QUERIES).items():
        monkeypatch.setitem(queries.load("sqlite"), name, sql)
    yield s
    s.close()


def run(store: Store, spark: SparkSession, epoch: int, run_id: str, **kwargs: Any) -> BatchOutcome:
    """One run, as `stageline_airflow.tasks.run_batch_stage` makes it: the record's job bound, then
    `run_stage_job`."""
    transform = stage_job.stage_job(ENRICH)(stage_job.StageContext(store, None))  # type: ignore[arg-type]
    return stage_job.run_stage_job(
        ENRICH, store, spark, transform=transform, owner=f"enrich/{run_id}", epoch=epoch, run_id=run_id, **kwargs
    )


@pytest.mark.parametrize("path", ["small", "jdbc"])
def test_a_fourth_stage_declared_as_a_record_and_its_sql_moves_its_rows(
    store: Store, spark: SparkSession, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    if path == "jdbc":  # Spark reads the claim and writes the landing rows itself, as for a large batch
        monkeypatch.setattr(stage_job, "SMALL_BATCH_ROWS", 0)
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = insert_routed(store, [(1, "m1", "ehr", ADT_A01), (2, "m2", "lab", ORU_R01), (3, "m3", "ehr", NOT_HL7)])

    outcome = run(store, spark, epoch, "run-1")

    assert outcome == BatchOutcome(
        run_id="run-1",
        claimed=(ids[1, "ehr"], ids[2, "lab"], ids[3, "ehr"]),
        output=outcome.output,
        done=(ids[1, "ehr"], ids[2, "lab"]),
        failed=(ids[3, "ehr"],),
    )
    enriched = rows(store, "SELECT id, source_id, destination, facility, status FROM stage_enriched ORDER BY id")
    assert [(r["source_id"], r["destination"], r["facility"], r["status"]) for r in enriched] == [
        (1, "ehr", "GOOD HEALTH HOSPITAL", "pending"),
        (2, "lab", "LABFAC", "pending"),
    ]
    assert tuple(r["id"] for r in enriched) == outcome.output
    routed = rows(store, "SELECT source_id, status, last_error FROM stage_routed ORDER BY id")
    assert [(r["source_id"], r["status"], r["last_error"]) for r in routed] == [
        (1, "done", None),
        (2, "done", None),
        (3, "dead", "no sending facility (MSH-4)"),
    ]
    events = rows(store, "SELECT stage, event, to_status FROM message_events WHERE stage = 'enriched'")
    assert [(e["event"], e["to_status"]) for e in events] == [("enriched", "pending")] * 2
    assert rows(store, "SELECT count(*) AS n FROM landing_enriched") == [{"n": 0}]
    assert run(store, spark, epoch, "run-2") == BatchOutcome(run_id="run-2")  # nothing left to claim


def test_a_finalize_under_a_stale_epoch_lands_nothing_of_the_new_stage(store: Store, spark: SparkSession) -> None:
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    insert_routed(store, [(1, "m1", "ehr", ADT_A01)])
    owner = "enrich/run-1"
    claimed = stage_job.claim(store, ENRICH, owner=owner, epoch=epoch, batch_size=100)
    landed = stage_job.read_claimed(store, spark, ENRICH, owner=owner, epoch=epoch).transform(noted, run_id="run-1")
    stage_job.land(store, landed, ENRICH.landing, small=True)  # type: ignore[arg-type]
    acquire_permanent(store, node_id="node-b")  # leadership moved before the finalize

    with pytest.raises(StaleEpoch):
        stage_job.finalize(store, ENRICH, run_id="run-1", owner=owner, epoch=epoch, claimed_ids=claimed)

    assert rows(store, "SELECT count(*) AS n FROM stage_enriched") == [{"n": 0}]
    assert rows(store, "SELECT count(*) AS n FROM landing_enriched") == [{"n": 0}]
    assert rows(store, "SELECT status FROM stage_routed") == [{"status": "in_flight"}]
