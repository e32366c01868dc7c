"""The transform stage on real SQLite and PostgreSQL: claim routed rows in lane order → Spark read →
lane keys + transform rules (lookup tables from the store) → land → fenced finalize into
stage_outbound; dead letter for messages the rules cannot read, a stale epoch, a crash between
landing and finalize, and a config naming a missing lookup table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.testing import assertDataFrameEqual

from include.destinations_config import parse_destinations
from include.stage_config import PipelineConfig, passthrough_destinations
from include.store import ROUTED, Store, lookups, rowlease
from include.store.finalize import UNTRANSFORMABLE, BatchOutcome, StaleEpoch
from include.store.lease import acquire_permanent
from include.store.stages import TRANSFORM
from include.transforms_config import TransformConfigError
from spark_jobs import stage_job, transform_job
from tests.spark_jobs.hl7_samples import ADT_A01, NOT_HL7, ORM_O01, ORU_R01

NODE = "node-a"
DESTINATIONS = parse_destinations(
    [
        {"name": "ehr", "kind": "mllp", "host": "127.0.0.1", "port": 2576, "lane": "PID-3.1"},
        {"name": "archive", "kind": "file", "directory": "/tmp/stageline-archive"},
        {"name": "api", "kind": "http", "url": "http://127.0.0.1:9/hl7", "lane": "MSH-4"},
    ]
)
SPECS: list[dict[str, Any]] = [
    {
        "destination": "ehr",
        "rules": [
            {"set": "MSH-5", "value": "CORE"},
            {"map": "PV1-2", "table": "patient_class"},
            {"drop_segment": "ZPI"},
        ],
    },
    {"destination": "api", "output": "json", "rules": [{"clear": "PID-5"}]},
]
PATIENT_CLASS = {"I": "IN", "O": "OUT"}

ADT_FOR_EHR = (
    ADT_A01.replace("|EHR|CITY|", "|CORE|CITY|", 1).replace("PV1|1|I|", "PV1|1|IN|").replace("ZPI|1|loyalty^GOLD\r", "")
)
ORM_FOR_EHR = ORM_O01.replace("|RIS|HOSP|", "|CORE|HOSP|", 1).replace("PV1|1|O", "PV1|1|OUT").replace("\n", "\r")


def insert_routed(store: Store, routed: list[tuple[int, str, str, str]]) -> dict[tuple[int, str], int]:
    """(source_id, message_id, destination, payload) rows → {(source_id, destination): routed id}."""
    mark = "%s" if store.backend == "postgres" else "?"
    with store.transaction() as tx:
        cur = tx.conn.cursor()
        bodies: dict[int, str] = {}
        for source_id, message_id, destination, payload in routed:
            assert bodies.setdefault(source_id, payload) == payload, "a routed row's body is its source's"
            cur.execute(
                "INSERT INTO stage_routed (source_id, message_id, control_id, destination, route_name, "
                f"lane_key) VALUES ({', '.join([mark] * 6)})",
                (source_id, message_id, f"CTL-{message_id}", destination, "r", f"lane-{source_id}"),
            )
        for source_id, payload in bodies.items():
            cur.execute(f"INSERT INTO inbound_bodies (id, payload) VALUES ({mark}, {mark})", (source_id, payload))
    got = rows(store, "SELECT id, source_id, destination FROM stage_routed")
    return {(r["source_id"], r["destination"]): r["id"] for r in got}


def rows(store: Store, sql: str) -> list[dict[str, Any]]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(sql)
        return [dict(r) for r in cur.fetchall()]


def outbound(store: Store) -> list[dict[str, Any]]:
    return rows(
        store,
        "SELECT source_id, message_id, destination, content_type, idempotency_key, lane_key, "
        "payload, status FROM outbound_messages ORDER BY id",
    )


def load_lookups(store: Store) -> None:
    with store.transaction() as tx:
        lookups.replace_table(tx, "patient_class", PATIENT_CLASS)


def bound(store: Store, specs: list[dict[str, Any]], destinations: dict) -> Any:
    """The transform stage's job bound to this config, as the stage task binds it before a claim."""
    config = PipelineConfig(Path("/nonexistent"), [], destinations, specs)  # type: ignore[arg-type]
    return transform_job.bind(stage_job.StageContext(store, config))


def run_once(store: Store, spark: SparkSession, epoch: int, run: str, **kwargs: Any) -> BatchOutcome:
    """One transform run, as the stage task makes it: the config checked before the claim (lookup
    tables read from the store), then `run_stage_job`."""
    transform = bound(store, SPECS, DESTINATIONS)
    return stage_job.run_stage_job(
        TRANSFORM,
        store,
        spark,
        transform=transform,
        owner=f"{NODE}/{run}",
        epoch=epoch,
        run_id=run,
        passthrough=passthrough_destinations(SPECS, DESTINATIONS),
        **kwargs,
    )


ROUTED_ROWS = [
    (1, "m1", "ehr", ADT_A01),
    (1, "m1", "archive", ADT_A01),
    (2, "m2", "ehr", ORM_O01),
    (3, "m3", "ehr", NOT_HL7),  # has a transform: cannot be read → dead letter
    (3, "m3", "archive", NOT_HL7),  # no transform: delivered byte for byte
    (4, "m4", "api", ORU_R01),
    (5, "m5", "unknown", ORU_R01),  # a destination no longer configured: its own lane, unchanged
]


def test_outbound_rows_compute_lanes_and_apply_each_destinations_rules(spark: SparkSession) -> None:
    claimed = spark.createDataFrame(
        [(10 + i, s, d, p, m, f"C{i}", "mllp-in") for i, (s, m, d, p) in enumerate(ROUTED_ROWS)], TRANSFORM.schema
    )
    got = claimed.transform(
        transform_job.outbound_rows, SPECS, {"patient_class": PATIENT_CLASS}, DESTINATIONS, run_id="r1"
    )
    hl7, js = "application/hl7-v2", "application/json"
    # archive: no spec, one lane for the destination — left out of Spark, moved by the finalize
    assert passthrough_destinations(SPECS, DESTINATIONS) == {"archive"}
    expected = [
        ("r1", 1, 10, "ehr", hl7, "ehr|PATID1234", ADT_FOR_EHR, "m1", "C0"),
        ("r1", 2, 12, "ehr", hl7, "ehr|777", ORM_FOR_EHR, "m2", "C2"),
        ("r1", 3, 13, "ehr", hl7, "ehr|", None, "m3", "C3"),
        ("r1", 5, 16, "unknown", hl7, "unknown", ORU_R01, "m5", "C6"),
    ]
    assertDataFrameEqual(got.filter("destination <> 'api'"), spark.createDataFrame(expected, got.schema))
    [api] = got.filter("destination = 'api'").collect()
    assert (api.content_type, api.lane_key) == (js, "api|LABFAC")
    assert api.payload.startswith('{"segments":[{"segment":"MSH"') and "PATIENT" not in api.payload


def test_a_run_moves_routed_rows_to_outbound_in_order_and_dead_letters_unreadable_messages(
    store: Store, spark: SparkSession
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    load_lookups(store)
    ids = insert_routed(store, ROUTED_ROWS)

    outcome = run_once(store, spark, epoch, "run-1")

    assert outcome.claimed == tuple(sorted(ids.values()))
    assert outcome.failed == (ids[(3, "ehr")],)
    assert outcome.not_finished == ()
    got = outbound(store)
    assert sorted((r["source_id"], r["destination"]) for r in got) == sorted(
        (s, d) for s, _, d, _ in ROUTED_ROWS if (s, d) != (3, "ehr")
    )
    for dest in {d for _, _, d, _ in ROUTED_ROWS}:  # routed order kept in every destination's lanes
        assert [r["source_id"] for r in got if r["destination"] == dest] == [
            s for s, _, d, _ in ROUTED_ROWS if d == dest and (s, d) != (3, "ehr")
        ]
    by_key = {(r["source_id"], r["destination"]): r for r in got}
    assert by_key[(1, "ehr")] == {
        "source_id": 1,
        "message_id": "m1",
        "destination": "ehr",
        "content_type": "application/hl7-v2",
        "idempotency_key": "m1-ehr",
        "lane_key": "ehr|PATID1234",
        "payload": ADT_FOR_EHR,
        "status": "pending",
    }
    assert by_key[(3, "archive")]["payload"] == NOT_HL7
    assert by_key[(4, "api")]["content_type"] == "application/json"
    routed = {
        r["id"]: (r["status"], r["last_error"]) for r in rows(store, "SELECT id, status, last_error FROM stage_routed")
    }
    assert routed == {i: ("dead", UNTRANSFORMABLE) if key == (3, "ehr") else ("done", None) for key, i in ids.items()}
    events = rows(
        store,
        "SELECT stage, event, to_status, count(*) AS n FROM message_events "
        "GROUP BY stage, event, to_status ORDER BY stage, event",
    )
    assert events == [
        {"stage": "outbound", "event": "transformed", "to_status": "pending", "n": 6},
        {"stage": "routed", "event": "dead", "to_status": "dead", "n": 1},
        {"stage": "routed", "event": "done", "to_status": "done", "n": 6},
    ]
    assert rows(store, "SELECT count(*) AS n FROM landing_outbound") == [{"n": 0}]


def test_a_finalize_under_a_stale_epoch_lands_nothing(store: Store, spark: SparkSession) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    load_lookups(store)
    insert_routed(store, ROUTED_ROWS[:3])
    owner = f"{NODE}/run-1"
    claimed = stage_job.claim(store, TRANSFORM, owner=owner, epoch=epoch, batch_size=100)
    landing = stage_job.read_claimed(store, spark, TRANSFORM, owner=owner, epoch=epoch).transform(
        transform_job.outbound_rows, SPECS, {"patient_class": PATIENT_CLASS}, DESTINATIONS, run_id="run-1"
    )
    stage_job.land(store, landing, TRANSFORM.landing)
    acquire_permanent(store, node_id="node-b")

    with pytest.raises(StaleEpoch):
        stage_job.finalize(store, TRANSFORM, run_id="run-1", owner=owner, epoch=epoch, claimed_ids=claimed)

    assert outbound(store) == []
    assert rows(store, "SELECT count(*) AS n FROM landing_outbound") == [{"n": 0}]
    assert rows(store, "SELECT DISTINCT status FROM stage_routed") == [{"status": "in_flight"}]


def test_a_crash_between_landing_and_finalize_is_rerun_after_recovery_without_duplicates(
    store: Store, spark: SparkSession
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    load_lookups(store)
    ids = insert_routed(store, ROUTED_ROWS)
    owner = f"{NODE}/run-1"
    stage_job.claim(store, TRANSFORM, owner=owner, epoch=epoch, batch_size=100)
    landing = stage_job.read_claimed(store, spark, TRANSFORM, owner=owner, epoch=epoch).transform(
        transform_job.outbound_rows, SPECS, {"patient_class": PATIENT_CLASS}, DESTINATIONS, run_id="run-1"
    )
    stage_job.land(store, landing, TRANSFORM.landing)
    stage_job.land(store, landing, TRANSFORM.landing)
    restarted = acquire_permanent(store, node_id=NODE)  # the process died; a new epoch recovers
    with store.transaction() as tx:
        assert rowlease.recover_on_promotion(tx, owner=NODE, epoch=restarted) == len(ids)

    outcome = run_once(store, spark, restarted, "run-2")

    assert outcome.not_finished == ()
    assert len(outbound(store)) == len(ROUTED_ROWS) - 1
    assert len({r["idempotency_key"] for r in outbound(store)}) == len(ROUTED_ROWS) - 1
    assert rows(store, "SELECT count(*) AS n FROM landing_outbound") == [{"n": 0}]


def test_a_rule_naming_a_missing_lookup_table_claims_nothing(store: Store, spark: SparkSession) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    insert_routed(store, ROUTED_ROWS[:2])
    with pytest.raises(TransformConfigError, match="unknown lookup table 'patient_class'"):
        run_once(store, spark, epoch, "run-1")
    assert rows(store, "SELECT DISTINCT status FROM stage_routed") == [{"status": "pending"}]


def test_a_stranded_routed_row_holds_its_lane_until_it_is_recovered(store: Store, spark: SparkSession) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    load_lookups(store)
    ids = insert_routed(store, [(1, "m1", "ehr", ADT_A01), (1, "m1b", "archive", ADT_A01), (2, "m2", "ehr", ORM_O01)])
    with store.transaction() as tx:  # a job claimed the first row and died
        rowlease.claim_batch(tx, ROUTED, owner="dead", epoch=epoch, limit=1)
    first = run_once(store, spark, epoch, "run-1")
    assert first.claimed == (ids[(2, "ehr")],)  # lanes are per source (lane-1 / lane-2 in insert_routed)
    restarted = acquire_permanent(store, node_id=NODE)
    with store.transaction() as tx:
        rowlease.recover_on_promotion(tx, owner=NODE, epoch=restarted)
    second = run_once(store, spark, restarted, "run-2")
    assert second.claimed == (ids[(1, "ehr")], ids[(1, "archive")])


def test_batches_on_a_kept_plan_land_byte_for_byte_what_a_plan_per_batch_lands(
    store: Store, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage task's batches share one plan (`stage_job.KeptPlans`: a read by the task's owner
    prefix, the run id swapped on top); every outbound row — HL7, JSON and FHIR R4 Bundles — is
    what the same rows transformed on their own give."""
    monkeypatch.setattr(stage_job, "SMALL_BATCH_ROWS", 0)  # these few rows take the JDBC path
    monkeypatch.setattr(stage_job, "READ_PARTITION_ROWS", 1)
    monkeypatch.setattr(stage_job, "READ_PARTITIONS", 2)
    specs = [*SPECS, {"destination": "fhir", "output": "fhir-r4"}]
    dests = {**DESTINATIONS, **parse_destinations([{"name": "fhir", "kind": "file", "directory": "/tmp/fhir"}])}
    routed = [*ROUTED_ROWS, *((s, m, "fhir", p) for s, m, d, p in ROUTED_ROWS if d in ("ehr", "api") and s != 3)]
    epoch = acquire_permanent(store, node_id=NODE)
    load_lookups(store)
    ids = insert_routed(store, routed)
    plans = stage_job.KeptPlans(f"{NODE}/task#1.")
    batches = []
    for n in range(20):
        outcome = stage_job.run_stage_job(
            TRANSFORM,
            store,
            spark,
            transform=bound(store, specs, dests),  # made afresh per batch, as the stage task does
            owner=f"{NODE}/task#1.{n}",
            epoch=epoch,
            run_id=f"task-{n}",
            batch_size=3,
            plans=plans,
            passthrough=passthrough_destinations(specs, dests),
        )
        if not outcome.claimed:
            break
        batches.append(outcome)
    assert len(batches) >= 2 and sum(len(b.claimed) for b in batches) == len(ids)
    assert plans.built == 1
    alone = spark.createDataFrame(
        [(ids[(s, d)], s, d, p, m, f"CTL-{m}", None) for s, m, d, p in routed], TRANSFORM.schema
    ).transform(transform_job.outbound_rows, specs, {"patient_class": PATIENT_CLASS}, dests, run_id="alone")
    expected = {(r.source_id, r.destination): r.payload for r in alone.collect() if r.payload is not None}
    got = {(r["source_id"], r["destination"]): r["payload"] for r in outbound(store) if r["destination"] != "archive"}
    assert got == expected
    assert sum(1 for (_, d) in got if d == "fhir") == 3 and all(
        got[(s, "fhir")].startswith('{"resourceType":"Bundle"') for s, d in got if d == "fhir"
    )
    assert rows(store, "SELECT count(*) AS n FROM landing_outbound") == [{"n": 0}]


def test_the_optimizer_rules_stage_sessions_skip_change_no_outbound_byte(spark: SparkSession) -> None:
    """`include.spark.SMALL_BATCH_CONF` leaves out optimizer rules that cost the FHIR plan most:
    every outbound row of corpus messages — FHIR R4, HL7 rules, JSON — is the same without them."""
    from bench.hl7_corpus import messages as corpus
    from include.spark import SMALL_BATCH_CONF

    specs = [*SPECS, {"destination": "fhir", "output": "fhir-r4"}]
    dests = {**DESTINATIONS, **parse_destinations([{"name": "fhir", "kind": "file", "directory": "/tmp/fhir"}])}
    claimed = spark.createDataFrame(
        [
            (4 * i + k, i, d, p, f"m{i}", f"C{i}", "mllp-in")
            for i, p in enumerate(corpus(300, seed=29))
            for k, d in enumerate(("fhir", "ehr", "api", "archive"))
        ],
        TRANSFORM.schema,
    )

    def landed() -> dict[int, tuple[Any, ...]]:
        out = claimed.transform(transform_job.outbound_rows, specs, {"patient_class": PATIENT_CLASS}, dests, run_id="r")
        return {r.routed_id: tuple(r) for r in out.collect()}

    key = "spark.sql.optimizer.excludedRules"
    assert spark.conf.get(key, None) in (None, "")
    every_rule = landed()
    spark.conf.set(key, SMALL_BATCH_CONF[key])
    try:
        assert landed() == every_rule
    finally:
        spark.conf.unset(key)
    bundles = [row for row in every_rule.values() if row[3] == "fhir"]
    assert len(bundles) == 300 and all(str(row[6]).startswith('{"resourceType":"Bundle"') for row in bundles)
