"""The route stage end to end on real SQLite and PostgreSQL: claim → Spark read → route → land →
fenced finalize; fan-out, unrouted messages, audit events, a stale epoch, a crash between landing
and finalize, a lost claim, and one run through a Spark Connect server."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import LongType, StringType, StructField, StructType
from pyspark.testing import assertDataFrameEqual

from include.app.lab.postgres_server import free_port
from include.config import StoreConfig
from include.routes_config import parse_routes
from include.spark import jdbc_options
from include.store import INBOUND, Store, rowlease
from include.store.finalize import RouteOutcome, StaleEpoch
from include.store.lease import acquire_permanent
from include.store.stages import ROUTE
from spark_jobs import stage_job
from spark_jobs.route_job import routed_rows
from tests.spark_jobs.hl7_samples import ADT_A01, CUSTOM_HASH, NOT_HL7, ORM_O01, ORU_R01

REPO = Path(__file__).resolve().parents[2]
NODE = "node-a"
ROUTES_SPEC: list[dict[str, Any]] = [
    {"name": "adt", "destinations": ["ehr", "archive"], "when": {"field": "MSH-9.1", "op": "eq", "value": "ADT"}},
    {
        "name": "results",
        "destinations": ["ehr", "lab"],
        "when": {"field": "MSH-9.1", "op": "in", "value": ["ORU", "ORM"]},
    },
    {
        "name": "inpatient",
        "destinations": ["bedboard", "archive"],
        "when": {"field": "PV1-2", "op": "eq", "value": "I"},
    },
]
ROUTES = parse_routes(ROUTES_SPEC)


def siu(patient_class: str) -> str:
    return (
        "MSH|^~\\&|SCHED|HOSP|EHR|CITY|20240107090000||SIU^S12|MSG00007|P|2.5\r"
        "PID|1||888^^^HOSP^MR||DOE^JANE\r"
        f"PV1|1|{patient_class}\r"
    )


# (payload, {destination: route_name}); an empty map is an unrouted message.
TEMPLATES: list[tuple[str, dict[str, str]]] = [
    (ADT_A01, {"ehr": "adt", "archive": "adt", "bedboard": "inpatient"}),  # PV1-2 I: three destinations
    (ORU_R01, {"ehr": "results", "lab": "results"}),
    (ORM_O01, {"ehr": "results", "lab": "results"}),  # LF segment endings
    (CUSTOM_HASH, {"ehr": "adt", "archive": "adt"}),  # '#'/'*' separators
    (siu("I"), {"bedboard": "inpatient", "archive": "inpatient"}),  # archive named by the route that reached it
    (siu("O"), {}),  # HL7, but no route matches
    (NOT_HL7, {}),
]
N_MESSAGES = 30


def message(n: int) -> dict[str, Any]:
    payload, _ = TEMPLATES[n % len(TEMPLATES)]
    return {
        "message_id": f"m{n:03d}",
        "control_id": f"CTL{n:03d}",
        "connection": "mllp-in",
        "lane_key": None if n % 5 == 0 else f"PAT{n % 4}",
        "charset": None,
        "payload": payload,
    }


def expected_routes(n: int) -> dict[str, str]:
    return TEMPLATES[n % len(TEMPLATES)][1]


def stage_messages(store: Store, epoch: int, numbers: range = range(N_MESSAGES)) -> dict[int, int]:
    """{message number: stage_inbound id}."""
    with store.transaction() as tx:
        staged = rowlease.stage_inbound(tx, [message(n) for n in numbers], epoch=epoch, node_id=NODE)
    assert staged is not None
    return {n: staged[f"m{n:03d}"] for n in numbers}


def rows(store: Store, sql: str) -> list[dict[str, Any]]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(sql)
        return [dict(r) for r in cur.fetchall()]


def routed_triples(store: Store) -> list[tuple[int, str, str]]:
    return [
        (r["source_id"], r["destination"], r["route_name"])
        for r in rows(
            store, "SELECT source_id, destination, route_name FROM stage_routed ORDER BY source_id, destination"
        )
    ]


def expected_triples(ids: dict[int, int]) -> list[tuple[int, str, str]]:
    return sorted((ids[n], dest, name) for n in ids for dest, name in expected_routes(n).items())


def inbound_status(store: Store) -> dict[int, str]:
    return {r["id"]: r["status"] for r in rows(store, "SELECT id, status FROM stage_inbound")}


def ids_by_number(store: Store) -> dict[int, int]:
    """{message number: stage_inbound id} for everything staged."""
    return {int(r["message_id"][1:]): r["id"] for r in rows(store, "SELECT id, message_id FROM stage_inbound")}


def landing_count(store: Store) -> int:
    return rows(store, "SELECT count(*) AS n FROM landing_routed")[0]["n"]


ROUTED_SCHEMA = StructType(
    [
        StructField("source_id", LongType()),
        StructField("message_id", StringType()),
        StructField("control_id", StringType()),
        StructField("destination", StringType()),
        StructField("route_name", StringType()),
        StructField("lane_key", StringType()),
        StructField("status", StringType()),
        StructField("payload", StringType()),
    ]
)


def read_routed(spark: SparkSession, store: Store) -> DataFrame:
    """stage_routed as Spark sees it through the same JDBC path the job uses."""
    return (
        spark.read.format("jdbc")
        .options(**jdbc_options(store.config))
        .option(
            "query",
            "SELECT source_id, message_id, control_id, destination, route_name, lane_key, "
            "status, payload FROM routed_messages",
        )
        .option("customSchema", ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in ROUTED_SCHEMA))
        .load()
    )


def expected_routed(spark: SparkSession, ids: dict[int, int]) -> DataFrame:
    data = [
        (ids[n], f"m{n:03d}", f"CTL{n:03d}", dest, name, message(n)["lane_key"], "pending", message(n)["payload"])
        for n in ids
        for dest, name in expected_routes(n).items()
    ]
    return spark.createDataFrame(data, ROUTED_SCHEMA)


def route_run(store: Store, spark: SparkSession, *, owner: str, epoch: int, run_id: str, **kwargs: Any) -> RouteOutcome:
    """One route run with ROUTES, as the stage task makes it (`run_stage_job` with the route transform)."""
    return stage_job.run_stage_job(
        ROUTE,
        store,
        spark,
        transform=partial(routed_rows, routes=ROUTES),
        owner=owner,
        epoch=epoch,
        run_id=run_id,
        **kwargs,
    )


def run_once(store: Store, spark: SparkSession, epoch: int, run: str, **kwargs: Any) -> RouteOutcome:
    return route_run(store, spark, owner=f"{NODE}/{run}", epoch=epoch, run_id=run, **kwargs)


# ---------------------------------------------------------------------------------------------


def test_transform_lands_one_decision_per_destination_and_keeps_unrouted(spark: SparkSession) -> None:
    claimed = spark.createDataFrame(
        [(1, "mllp-in", ADT_A01, None, None), (2, "mllp-in", NOT_HL7, None, None), (3, "mllp-in", ORU_R01, None, None)],
        ROUTE.schema,
    )
    actual = routed_rows(claimed, ROUTES, run_id="r1")
    expected = spark.createDataFrame(
        [
            ("r1", 1, "ehr", "adt", "pending"),
            ("r1", 1, "archive", "adt", "pending"),
            ("r1", 1, "bedboard", "inpatient", "pending"),
            ("r1", 2, None, None, "unrouted"),
            ("r1", 3, "ehr", "results", "pending"),
            ("r1", 3, "lab", "results", "pending"),
        ],
        "run_id STRING, source_id BIGINT, destination STRING, route_name STRING, status STRING",
    )
    assertDataFrameEqual(actual, expected)


def test_a_run_routes_every_claimed_message_fans_out_and_keeps_unrouted_visible(
    store: Store, spark: SparkSession
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)

    outcome = run_once(store, spark, epoch, "run-1")

    unrouted = sorted(ids[n] for n in ids if not expected_routes(n))
    assert outcome.claimed == tuple(sorted(ids.values()))
    assert outcome.unrouted == tuple(unrouted)
    assert outcome.done == tuple(sorted(set(ids.values()) - set(unrouted)))
    assert outcome.not_finished == ()
    assert routed_triples(store) == expected_triples(ids)
    assertDataFrameEqual(read_routed(spark, store), expected_routed(spark, ids))
    assert inbound_status(store) == {i: "done" if expected_routes(n) else "unrouted" for n, i in ids.items()}
    # routed rows are new work for the next stage, in arrival order, each with its audit event
    routed = rows(store, "SELECT id, source_id, status, attempts, lease_owner FROM stage_routed ORDER BY id")
    assert [r["id"] for r in routed] == sorted(outcome.routed)
    assert [r["source_id"] for r in routed] == sorted(r["source_id"] for r in routed)
    assert {(r["status"], r["attempts"], r["lease_owner"]) for r in routed} == {("pending", 0, None)}
    events = rows(
        store,
        "SELECT stage, row_id, event, from_status, to_status, epoch, node_id FROM message_events "
        "WHERE event <> 'received' ORDER BY id",
    )
    expected_events = (
        [("inbound", i, "done", "in_flight", "done") for i in outcome.done]
        + [("inbound", i, "unrouted", "in_flight", "unrouted") for i in outcome.unrouted]
        + [("routed", i, "routed", None, "pending") for i in outcome.routed]
    )
    assert sorted((e["stage"], e["row_id"], e["event"], e["from_status"], e["to_status"]) for e in events) == sorted(
        expected_events, key=lambda e: (e[0], e[1], e[2])
    )
    assert {(e["epoch"], e["node_id"]) for e in events} == {(epoch, f"{NODE}/run-1")}
    assert landing_count(store) == 0

    # a second run finds nothing to claim and changes nothing
    assert run_once(store, spark, epoch, "run-2") == RouteOutcome(run_id="run-2")
    assert routed_triples(store) == expected_triples(ids)


def test_rows_for_a_pass_through_destination_get_their_outbound_rows_from_the_route_finalize(
    store: Store, spark: SparkSession
) -> None:
    """`archive` has nothing to compute: its routed rows are done at once and its outbound rows, with
    the inbound body, come from the same finalize, in arrival order on the destination's lane."""
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)

    outcome = run_once(store, spark, epoch, "run-1", passthrough={"archive"})

    assert routed_triples(store) == expected_triples(ids)
    routed = rows(store, "SELECT id, source_id, destination, status, attempts FROM stage_routed ORDER BY id")
    assert {(r["destination"] == "archive", r["status"], r["attempts"]) for r in routed} == {
        (True, "done", 0),
        (False, "pending", 0),
    }
    archive = [r for r in routed if r["destination"] == "archive"]
    got = rows(
        store,
        "SELECT id, source_id, message_id, destination, content_type, idempotency_key, lane_key, "
        "status, payload FROM outbound_messages ORDER BY id",
    )
    # the body is written once: the outbound row has none of its own and sends the inbound row's
    assert rows(store, "SELECT count(*) AS n FROM outbound_bodies") == [{"n": 0}]
    assert outcome.outbound == tuple(r["id"] for r in got)
    number = {i: n for n, i in ids.items()}
    assert [
        (
            r["source_id"],
            r["message_id"],
            r["destination"],
            r["content_type"],
            r["idempotency_key"],
            r["lane_key"],
            r["status"],
            r["payload"],
        )
        for r in got
    ] == [
        (
            r["source_id"],
            f"m{number[r['source_id']]:03d}",
            "archive",
            "application/hl7-v2",
            f"m{number[r['source_id']]:03d}-archive",
            "archive",
            "pending",
            message(number[r["source_id"]])["payload"],
        )
        for r in archive
    ]
    assert [r["source_id"] for r in got] == sorted(r["source_id"] for r in got)  # arrival order
    events = rows(
        store,
        "SELECT stage, event, to_status, count(*) AS n FROM message_events "
        "WHERE stage IN ('routed', 'outbound') GROUP BY stage, event, to_status ORDER BY stage, to_status",
    )
    assert events == [
        {"stage": "outbound", "event": "transformed", "to_status": "pending", "n": len(archive)},
        {"stage": "routed", "event": "routed", "to_status": "done", "n": len(archive)},
        {"stage": "routed", "event": "routed", "to_status": "pending", "n": len(routed) - len(archive)},
    ]
    assert landing_count(store) == 0


def test_a_pass_through_destination_with_open_routed_rows_queues_new_rows_behind_them(
    store: Store, spark: SparkSession
) -> None:
    """Routed before `archive` became a pass-through, an open archive row keeps the route finalize from
    handing newer archive rows on: they would reach stage_outbound ahead of it."""
    epoch = acquire_permanent(store, node_id=NODE)
    stage_messages(store, epoch, range(1))  # ADT: ehr, archive, bedboard
    run_once(store, spark, epoch, "run-1")  # not yet a pass-through: its archive row stays pending
    stage_messages(store, epoch, range(7, 8))

    outcome = run_once(store, spark, epoch, "run-2", passthrough={"archive"})

    assert outcome.outbound == ()
    assert rows(store, "SELECT count(*) AS n FROM stage_outbound")[0]["n"] == 0
    assert [
        (r["destination"], r["status"])
        for r in rows(store, "SELECT destination, status FROM stage_routed WHERE destination = 'archive' ORDER BY id")
    ] == [("archive", "pending"), ("archive", "pending")]


def test_batches_are_claimed_in_arrival_order_and_the_rest_wait(store: Store, spark: SparkSession) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)
    first = run_once(store, spark, epoch, "run-1", batch_size=12)
    assert first.claimed == tuple(sorted(ids.values())[:12])
    second = run_once(store, spark, epoch, "run-2", batch_size=100)
    assert second.claimed == tuple(sorted(ids.values())[12:])
    assert routed_triples(store) == expected_triples(ids)
    assert set(inbound_status(store).values()) == {"done", "unrouted"}


def test_claimed_ids_split_into_even_contiguous_ranges() -> None:
    assert stage_job.id_ranges([9, 1, 7, 3, 5, 2], rows=2, most=4) == [(1, 2), (3, 5), (7, 9)]
    assert stage_job.id_ranges(range(1, 11), rows=2, most=2) == [(1, 5), (6, 10)]
    assert stage_job.id_ranges([4, 8, 15], rows=5_000, most=4) == [(4, 15)]  # too few rows for two


def test_a_claim_read_in_id_ranges_gives_each_claimed_row_once_and_nothing_else(
    store: Store, spark: SparkSession
) -> None:
    """Given the claimed ids, the JDBC read runs one partition (connection, query) per id range, so
    the transform and the landing write use more than one core; the rows are the claim's, once."""
    epoch = acquire_permanent(store, node_id=NODE)
    stage_messages(store, epoch)
    owner = f"{NODE}/run-1"
    claimed = stage_job.claim(store, ROUTE, owner=owner, epoch=epoch, batch_size=20)  # 10 more stay pending
    stage_job.claim(store, ROUTE, owner=f"{NODE}/other", epoch=epoch, batch_size=5)  # within the ranges, not ours
    frame = stage_job.read_claimed(
        store, spark, ROUTE, owner=owner, epoch=epoch, ids=claimed, rows_per_partition=3, max_partitions=4
    )
    assert frame.rdd.getNumPartitions() == 4
    assert sorted(r["id"] for r in frame.collect()) == sorted(claimed)

    stage_job.land(store, frame.transform(routed_rows, ROUTES, run_id="run-1"), ROUTE.landing)
    outcome = stage_job.finalize(store, ROUTE, run_id="run-1", owner=owner, epoch=epoch, claimed_ids=claimed)
    assert outcome.not_finished == () and sorted(outcome.claimed) == sorted(claimed)


def test_a_finalize_under_a_stale_epoch_lands_nothing_and_leaves_sources_in_flight(
    store: Store, spark: SparkSession
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)
    owner = f"{NODE}/run-1"
    claimed = stage_job.claim(store, ROUTE, owner=owner, epoch=epoch, batch_size=100)
    stage_job.land(
        store,
        stage_job.read_claimed(store, spark, ROUTE, owner=owner, epoch=epoch).transform(
            routed_rows, ROUTES, run_id="run-1"
        ),
        ROUTE.landing,
    )
    assert landing_count(store) > 0

    newer = acquire_permanent(store, node_id="node-b")  # another leader took over meanwhile
    with pytest.raises(StaleEpoch):
        stage_job.finalize(store, ROUTE, run_id="run-1", owner=owner, epoch=epoch, claimed_ids=claimed)

    assert newer == epoch + 1
    assert routed_triples(store) == []
    assert landing_count(store) == 0
    assert rows(store, "SELECT DISTINCT status, lease_owner, claim_epoch FROM stage_inbound") == [
        {"status": "in_flight", "lease_owner": owner, "claim_epoch": epoch}
    ]
    assert rows(store, "SELECT count(*) AS n FROM message_events WHERE event <> 'received'") == [{"n": 0}]
    assert sorted(claimed) == sorted(ids.values())


def test_a_crash_between_landing_and_finalize_is_rerun_after_recovery_without_duplicates(
    store: Store, spark: SparkSession
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)
    owner = f"{NODE}/run-1"
    stage_job.claim(store, ROUTE, owner=owner, epoch=epoch, batch_size=100)
    landed = stage_job.read_claimed(store, spark, ROUTE, owner=owner, epoch=epoch).transform(
        routed_rows, ROUTES, run_id="run-1"
    )
    stage_job.land(store, landed, ROUTE.landing)
    stage_job.land(store, landed, ROUTE.landing)  # and a retried Spark task landed everything twice
    # ... the process dies here. The restarted node takes a new epoch and recovers the stranded rows.
    restarted = acquire_permanent(store, node_id=NODE)
    with store.transaction() as tx:
        assert rowlease.recover_on_promotion(tx, owner=NODE, epoch=restarted) == N_MESSAGES

    outcome = run_once(store, spark, restarted, "run-2")

    assert outcome.not_finished == ()
    assert routed_triples(store) == expected_triples(ids)
    assert landing_count(store) == 0  # the dead run's leftovers went with the sources they belonged to
    assert set(inbound_status(store).values()) == {"done", "unrouted"}
    assert rows(
        store, "SELECT count(*) AS n, count(DISTINCT row_id) AS d FROM message_events WHERE event = 'routed'"
    ) == [{"n": len(outcome.routed), "d": len(expected_triples(ids))}]


def test_landing_twice_in_one_run_still_routes_each_destination_once(store: Store, spark: SparkSession) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch, range(7))
    owner = f"{NODE}/run-1"
    claimed = stage_job.claim(store, ROUTE, owner=owner, epoch=epoch, batch_size=100)
    landed = stage_job.read_claimed(store, spark, ROUTE, owner=owner, epoch=epoch).transform(
        routed_rows, ROUTES, run_id="run-1"
    )
    stage_job.land(store, landed, ROUTE.landing)
    stage_job.land(store, landed, ROUTE.landing)
    outcome = stage_job.finalize(store, ROUTE, run_id="run-1", owner=owner, epoch=epoch, claimed_ids=claimed)
    assert routed_triples(store) == expected_triples(ids)
    assert len(outcome.routed) == len(expected_triples(ids))
    assert landing_count(store) == 0


def test_a_lost_claim_lands_nothing_and_its_sources_are_routed_by_the_next_run(
    store: Store, spark: SparkSession
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)
    owner = f"{NODE}/slow"
    claimed = stage_job.claim(store, ROUTE, owner=owner, epoch=epoch, batch_size=100, lease_seconds=0.0)
    stage_job.land(
        store,
        stage_job.read_claimed(store, spark, ROUTE, owner=owner, epoch=epoch).transform(
            routed_rows, ROUTES, run_id="slow"
        ),
        ROUTE.landing,
    )
    with store.transaction() as tx:  # the slow run's row leases ran out: the sweep re-pends its rows
        assert rowlease.sweep_expired(tx, INBOUND, owner=NODE, epoch=epoch) == N_MESSAGES

    late = stage_job.finalize(store, ROUTE, run_id="slow", owner=owner, epoch=epoch, claimed_ids=claimed)

    assert late == RouteOutcome(run_id="slow", claimed=tuple(sorted(claimed)), not_finished=tuple(sorted(claimed)))
    assert routed_triples(store) == []
    assert landing_count(store) == 0
    assert set(inbound_status(store).values()) == {"pending"}
    run_once(store, spark, epoch, "next")
    assert routed_triples(store) == expected_triples(ids)


# ---------------------------------------------------------------------------------------------
# Spark Connect: once, on SQLite. The client runs in a child process: creating a Connect session
# switches pyspark's functions to Connect for the whole process (SPARK_CONNECT_MODE_ENABLED), which
# would break the classic session the other tests share.

CONNECT_CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    from include.config import StoreConfig
    from include.spark import spark_session
    from include.store import Store
    from tests.spark_jobs.test_route_job import route_run, stage_messages, N_MESSAGES
    url, path, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = Store(StoreConfig(backend="sqlite", path=path))
    t1 = time.perf_counter()
    spark = spark_session(remote=url)
    first = route_run(store, spark, owner="connect/run-1", epoch=epoch, run_id="run-1")
    t2 = time.perf_counter()
    overhead = []
    for _ in range(3):  # a job's fixed cost on a warm server: new client session, one tiny query
        spark.stop()
        start = time.perf_counter()
        spark = spark_session(remote=url)
        spark.range(1).collect()
        overhead.append(time.perf_counter() - start)
    stage_messages(store, epoch, range(N_MESSAGES, 2 * N_MESSAGES))
    start = time.perf_counter()
    second = route_run(store, spark, owner="connect/run-2", epoch=epoch, run_id="run-2")
    t3 = time.perf_counter() - start
    # a stage task's batches on one kept plan (stage_job.KeptPlans), over Connect's plan cache
    from spark_jobs import stage_job
    stage_job.SMALL_BATCH_ROWS = 0
    stage_messages(store, epoch, range(2 * N_MESSAGES, 3 * N_MESSAGES))
    plans, kept = stage_job.KeptPlans("connect/task#1."), []
    for n in range(20):
        o = route_run(store, spark, owner=f"connect/task#1.{n}", epoch=epoch, run_id=f"task-{n}", batch_size=8,
                      plans=plans)
        if not o.claimed:
            break
        kept.append(len(o.routed))
    spark.stop()
    print(json.dumps({"first": len(first.routed), "second": len(second.routed), "imports": t1 - t0,
                      "first_job": t2 - t1, "overhead": overhead, "second_job": t3, "kept": kept,
                      "built": plans.built}))
""")


def test_a_route_run_through_spark_connect(sqlite_config_fresh: StoreConfig, tmp_path) -> None:
    from include.spark import start_connect_server, stop_connect_server

    store = Store(sqlite_config_fresh)
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)
    started = time.perf_counter()
    server = start_connect_server(  # a short-lived server: C1-only JIT and serial GC start faster
        free_port(),
        log_dir=tmp_path,
        master="local[2]",
        conf={
            "spark.sql.shuffle.partitions": "1",
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        },
    )
    try:
        startup = time.perf_counter() - started
        child = subprocess.run(
            [sys.executable, "-c", CONNECT_CHILD, server.url, sqlite_config_fresh.path, str(epoch)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert child.returncode == 0, child.stderr[-4000:]
        figures = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        stop_connect_server(server)
    assert server.process.poll() is not None
    everything = ids_by_number(store)
    more = {n: i for n, i in everything.items() if N_MESSAGES <= n < 2 * N_MESSAGES}
    last = {n: i for n, i in everything.items() if n >= 2 * N_MESSAGES}
    assert len(more) == len(last) == N_MESSAGES
    assert routed_triples(store) == expected_triples(everything)
    assert (figures["first"], figures["second"]) == (len(expected_triples(ids)), len(expected_triples(more)))
    assert len(figures["kept"]) >= 2 and figures["built"] == 1  # the last 30 in batches, on one plan
    assert sum(figures["kept"]) == len(expected_triples(last))
    assert landing_count(store) == 0
    store.close()
    print(
        f"\nSpark Connect: server start {startup:.1f} s; client imports {figures['imports']:.1f} s; "
        f"first job {figures['first_job']:.2f} s; per-job overhead on a warm server "
        f"{', '.join(f'{x:.2f}' for x in figures['overhead'])} s; a 30-message route job {figures['second_job']:.2f} s"
    )


KILLED_SERVER_CHILD = textwrap.dedent("""
    import json, sys, time
    from include.config import StoreConfig
    from include.spark import spark_session, stage_session
    from include.store import Store
    from tests.spark_jobs.test_route_job import route_run
    url, path, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = Store(StoreConfig(backend="sqlite", path=path))
    spark = spark_session(remote=url)
    with stage_session(spark):
        spark.range(1).collect()
        print("ready", flush=True)
        sys.stdin.readline()  # the parent kills the server, then answers
        started = time.monotonic()
        try:
            route_run(store, spark, owner="connect/killed", epoch=epoch, run_id="killed")
            error = None
        except Exception as exc:
            error = type(exc).__name__
    print(json.dumps({"error": error, "failed_after": time.monotonic() - started}), flush=True)
""")


def test_a_job_whose_connect_server_was_killed_fails_in_seconds_hands_its_rows_back_and_exits(
    sqlite_config_fresh: StoreConfig, tmp_path
) -> None:
    import os
    import signal

    from include.spark import start_connect_server, stop_connect_server

    store = Store(sqlite_config_fresh)
    epoch = acquire_permanent(store, node_id=NODE)
    stage_messages(store, epoch, range(5))
    server = start_connect_server(
        free_port(),
        log_dir=tmp_path,
        master="local[1]",
        conf={"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"},
    )
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SERVER_CHILD, server.url, sqlite_config_fresh.path, str(epoch)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
        killed = time.monotonic()
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
        exited_after = time.monotonic() - killed
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        stop_connect_server(server)
    assert child.returncode == 0, err[-4000:]
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["error"] is not None
    assert figures["failed_after"] < 15, figures  # pyspark's own retries would take minutes
    assert exited_after < 25, f"the client process took {exited_after:.1f} s to exit after its server died"
    got = rows(store, "SELECT status, lease_owner, last_error FROM stage_inbound ORDER BY id")
    assert [(r["status"], r["lease_owner"]) for r in got] == [("error", None)] * 5  # handed back, due now
    assert all(r["last_error"].startswith("stage run failed:") for r in got)
    store.close()
    print(
        f"\nSpark Connect server killed: the job failed after {figures['failed_after']:.1f} s, "
        f"the client exited {exited_after:.1f} s after the kill"
    )


RENEW_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    from include.config import StoreConfig
    from include.app.lab.postgres_server import free_port
    from include.spark import session_lost, spark_session, stage_session, start_connect_server, stop_connect_server
    from include.store import Store
    from tests.spark_jobs.test_route_job import route_run
    path, epoch, logs = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    store = Store(StoreConfig(backend="sqlite", path=path))
    port = free_port()
    fast_jvm = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}
    servers = [start_connect_server(port, log_dir=logs, master="local[1]", conf=fast_jvm)]
    result = {}
    try:
        with stage_session(spark_session(remote=servers[0].url)) as session:
            session.spark.range(1).collect()
            os.killpg(servers[0].process.pid, signal.SIGKILL)
            servers[0].process.wait(timeout=30)
            try:
                route_run(store, session.spark, owner="connect/lost", epoch=epoch, run_id="lost")
            except Exception as exc:
                result["lost"] = session_lost(exc)
            servers.append(start_connect_server(port, log_dir=logs, master="local[1]", conf=fast_jvm))
            result["renewed"] = session.renew(timeout=60)
            outcome = route_run(store, session.spark, owner="connect/renewed", epoch=epoch,
                                    run_id="renewed")
            result["claimed"] = len(outcome.claimed)
    finally:
        for server in servers:
            stop_connect_server(server)
    print(json.dumps(result), flush=True)
""")


def test_a_lost_connect_session_is_renewed_once_its_server_is_back_and_routing_carries_on(
    sqlite_config_fresh: StoreConfig, tmp_path
) -> None:
    """A Spark Connect restart costs a stage task the server's restart, not a failed try: the
    batch that met the dead server hands its rows back, the task's `StageSession` waits for the
    server on the same port and opens a new session, and the next batch routes everything. (In a
    child process: this session already holds a classic Spark session, and pyspark allows one kind.)"""
    store = Store(sqlite_config_fresh)
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch, range(5))
    child = subprocess.run(
        [sys.executable, "-c", RENEW_CHILD, sqlite_config_fresh.path, str(epoch), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result == {"lost": True, "renewed": True, "claimed": 5}
    assert routed_triples(store) == expected_triples(ids)
    store.close()


STANDBY_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from include.config import StoreConfig
    from include.app.lab.postgres_server import free_port
    from include.spark import StageSession, session_lost, stage_session_id, start_connect_server, stop_connect_server
    from include.store import Store
    from tests.spark_jobs.test_route_job import route_run
    path, epoch, logs = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    store = Store(StoreConfig(backend="sqlite", path=path))
    fast_jvm = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}
    servers = [start_connect_server(free_port(), log_dir=logs, master="local[1]", conf=fast_jvm) for _ in range(2)]
    result = {}
    try:
        first = StageSession.connect([s.url for s in servers], name="stage_route")
        result["first_on"] = [s.url for s in servers].index(first.remote)
        warming = first.warm_others()
        warming.join(120)
        result["warmed"] = not warming.is_alive()
        result["sticky_id"] = first.spark.client._session_id == stage_session_id("stage_route")
        first.close()  # not released: the next task of the stage reopens it
        session = StageSession.connect([s.url for s in servers], name="stage_route")
        result["same_id"] = session.spark.client._session_id == stage_session_id("stage_route")
        os.killpg(servers[0].process.pid, signal.SIGKILL)
        servers[0].process.wait(timeout=30)
        killed = time.monotonic()
        try:
            route_run(store, session.spark, owner="connect/lost", epoch=epoch, run_id="lost")
        except Exception as exc:
            result["lost"] = session_lost(exc)
        result["renewed"] = session.renew(timeout=5)
        result["renewed_on"] = [s.url for s in servers].index(session.remote)
        outcome = route_run(store, session.spark, owner="connect/standby", epoch=epoch,
                                run_id="standby")
        result["claimed"] = len(outcome.claimed)
        result["seconds"] = time.monotonic() - killed
        session.close()
    finally:
        for server in servers:
            stop_connect_server(server)
    print(json.dumps(result), flush=True)
""")


def test_a_stage_session_moves_to_another_server_when_its_server_dies_and_reopens_its_sticky_id(
    sqlite_config_fresh: StoreConfig, tmp_path
) -> None:
    """With a second Spark Connect server a killed server costs a batch, not a restart: the batch
    that met the dead server hands its rows back, the session reopens on the other server (no
    waiting for the first), and the next batch routes everything. Warming the other server's
    session happens in the background and does not disturb the first. Each task of a stage reopens the same
    session id (warm Python workers). In a child process: this session holds a classic Spark session."""
    store = Store(sqlite_config_fresh)
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch, range(5))
    child = subprocess.run(
        [sys.executable, "-c", STANDBY_CHILD, sqlite_config_fresh.path, str(epoch), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    seconds = result.pop("seconds")
    assert result == {
        "first_on": 0,
        "warmed": True,
        "sticky_id": True,
        "same_id": True,
        "lost": True,
        "renewed": True,
        "renewed_on": 1,
        "claimed": 5,
    }
    assert seconds < 60  # bounded by the client's retry budget, not pyspark's ten minutes
    assert routed_triples(store) == expected_triples(ids)
    store.close()


class _SparkDown:
    """A Spark session whose every use fails, as a lost Connect server would."""

    @property
    def read(self) -> Any:
        raise RuntimeError("spark is down")

    def createDataFrame(self, *args: Any, **kwargs: Any) -> Any:  # Spark's name
        raise RuntimeError("spark is down")


def test_a_failed_run_hands_its_claimed_rows_back_at_once_and_the_next_run_routes_them(
    store: Store, spark: SparkSession
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch, range(5))
    with pytest.raises(RuntimeError, match="spark is down"):
        run_once(store, _SparkDown(), epoch, "run-1")  # type: ignore[arg-type]
    got = rows(store, "SELECT status, lease_owner, attempts, last_error FROM stage_inbound ORDER BY id")
    assert (
        got
        == [
            {
                "status": "error",
                "lease_owner": None,
                "attempts": 1,
                "last_error": "stage run failed: RuntimeError: spark is down",
            }
        ]
        * 5
    )
    assert rows(store, "SELECT count(*) AS n FROM message_events WHERE event = 'attempt_failed'") == [{"n": 5}]
    outcome = run_once(store, spark, epoch, "run-2")  # due again at once, no waiting for the sweep
    assert outcome.claimed == tuple(sorted(ids.values()))
    assert routed_triples(store) == expected_triples(ids)


# --- plans kept across a task's batches (stage_job.KeptPlans) ----------------------------------


@pytest.fixture
def every_batch_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of these few rows take the large-batch path (JDBC read, kept plan); a kept plan reads
    in two partitions."""
    monkeypatch.setattr(stage_job, "SMALL_BATCH_ROWS", 0)
    monkeypatch.setattr(stage_job, "READ_PARTITION_ROWS", 1)
    monkeypatch.setattr(stage_job, "READ_PARTITIONS", 2)


def claimed_by(store: Store, owner: str) -> set[int]:
    return {r["id"] for r in rows(store, f"SELECT id FROM stage_inbound WHERE lease_owner = '{owner}'")}


def test_a_tasks_batches_share_one_kept_plan_and_route_exactly_their_own_rows(
    store: Store, spark: SparkSession, every_batch_large: None
) -> None:
    """One plan for the task (its read selects by the task's owner prefix): each batch still lands
    and finalizes exactly its claim, whatever else is in flight (another claimer's rows, inside
    the same id range)."""
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)
    plans = stage_job.KeptPlans(f"{NODE}/task#1.")
    other = set(stage_job.claim(store, ROUTE, owner=f"{NODE}/other#1.0", epoch=epoch, batch_size=3))
    outcomes = []
    for n in range(10):
        outcome = route_run(
            store, spark, owner=f"{NODE}/task#1.{n}", epoch=epoch, run_id=f"task-{n}", batch_size=7, plans=plans
        )
        if not outcome.claimed:
            break
        outcomes.append(outcome)
    assert len(outcomes) >= 2
    assert plans.built == 1  # every batch on one plan (one analysis)
    assert all(o.not_finished == () for o in outcomes)
    routed = {i for o in outcomes for i in o.claimed}
    assert routed and not routed & other
    assert routed_triples(store) == expected_triples({n: i for n, i in ids.items() if i in routed})
    assert claimed_by(store, f"{NODE}/other#1.0") == other  # untouched, still in flight
    assert landing_count(store) == 0


def test_a_kept_plan_is_rebuilt_when_the_transform_changes_and_only_then(
    store: Store, spark: SparkSession, every_batch_large: None
) -> None:
    """The stage's `bind` makes a new transform every batch: an equal one reuses the plan, one built
    from other routes (or lookups) builds a new one; a batch of another size uses the same."""
    epoch = acquire_permanent(store, node_id=NODE)
    stage_messages(store, epoch)
    plans = stage_job.KeptPlans(f"{NODE}/task#1.")
    archive = parse_routes([{"name": "all", "destinations": ["archive"], "when": {"field": "MSH-9.1", "op": "exists"}}])

    def run(n: int, routes: Any, rows: int) -> RouteOutcome:
        return stage_job.run_stage_job(
            ROUTE,
            store,
            spark,
            transform=partial(routed_rows, routes=routes),
            owner=f"{NODE}/task#1.{n}",
            epoch=epoch,
            run_id=f"task-{n}",
            batch_size=rows,
            plans=plans,
        )

    run(0, ROUTES, 4)
    assert plans.built == 1
    run(1, parse_routes(ROUTES_SPEC), 4)  # equal routes, parsed afresh
    assert plans.built == 1
    to_archive = run(2, archive, 4)
    assert plans.built == 2
    archived = rows(store, "SELECT source_id, destination FROM stage_routed WHERE route_name = 'all'")
    assert sorted(r["source_id"] for r in archived) == sorted(to_archive.claimed)
    assert {r["destination"] for r in archived} == {"archive"}
    single = run(3, archive, 1)
    assert plans.built == 2 and len(single.claimed) == 1 and single.not_finished == ()


def test_a_batch_whose_owner_is_not_the_tasks_builds_its_own_plan(
    store: Store, spark: SparkSession, every_batch_large: None
) -> None:
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)
    plans = stage_job.KeptPlans(f"{NODE}/task#1.")
    outcome = route_run(store, spark, owner=f"{NODE}/elsewhere", epoch=epoch, run_id="x", batch_size=100, plans=plans)
    assert plans.built == 0
    assert len(outcome.claimed) == len(ids)
    assert routed_triples(store) == expected_triples(ids)


def test_rows_an_earlier_batch_of_the_task_still_holds_are_read_again_but_never_land(
    store: Store, spark: SparkSession, every_batch_large: None
) -> None:
    """A batch that failed and could not hand its rows back leaves them in flight under the task's
    prefix: the next batch's read sees them too, and its finalize takes only its own claim (the
    run's landing rows all go)."""
    epoch = acquire_permanent(store, node_id=NODE)
    ids = stage_messages(store, epoch)
    plans = stage_job.KeptPlans(f"{NODE}/task#1.")
    stranded = set(stage_job.claim(store, ROUTE, owner=f"{NODE}/task#1.0", epoch=epoch, batch_size=4))
    outcome = route_run(
        store, spark, owner=f"{NODE}/task#1.1", epoch=epoch, run_id="task-1", batch_size=100, plans=plans
    )
    assert plans.built == 1 and len(outcome.claimed) >= 2
    assert not set(outcome.claimed) & stranded and outcome.not_finished == ()
    assert routed_triples(store) == expected_triples({n: i for n, i in ids.items() if i in outcome.claimed})
    assert claimed_by(store, f"{NODE}/task#1.0") == stranded
    assert landing_count(store) == 0
