"""The deliver stage on real SQLite and PostgreSQL with real receivers: per-lane FIFO over a
backlog, a failing head that blocks only its lane and ends dead with its reason audited, permanent
rejects, re-delivery under the same idempotency key, a stale epoch, and the Spark wrapper."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.testing import assertDataFrameEqual

from include.destinations_config import lane_key, parse_destinations
from include.store import Store
from include.store.finalize import NOT_ATTEMPTED, DeliverOutcome, StaleEpoch, finalize_deliveries
from include.store.lease import acquire_permanent
from include.store.queries import to_pyformat
from include.store.rowlease import recover_on_promotion
from spark_jobs import deliver_job
from tests.spark_jobs.test_senders import (  # noqa: F401 — fixtures and the real receivers
    HttpReceiver,
    MllpReceiver,
    _no_cached_connections,
    control_id_of,
    hl7_message,
    http_receiver,
    mllp_receiver,
    raw_ack,
)

NODE = "n"
PATIENTS = ("P1", "P2", "P3")
PER_LANE = 5

INSERT = (
    "INSERT INTO stage_outbound (source_id, message_id, control_id, destination, content_type, "
    "idempotency_key, lane_key) VALUES (:source_id, :message_id, :control_id, :destination, "
    ":content_type, :idempotency_key, :lane_key)"
)
INSERT_BODY = (
    "INSERT INTO outbound_bodies (id, payload) "
    "SELECT id, :payload FROM stage_outbound WHERE idempotency_key = :idempotency_key"
)


@pytest.fixture
def outbox(tmp_path: Path) -> Path:
    """The file destination's directory (tmp_path itself also holds the SQLite store)."""
    path = tmp_path / "outbox"
    path.mkdir()
    return path


def sql(store: Store, text: str) -> str:
    return text if store.backend == "sqlite" else to_pyformat(text)


def rows(store: Store, text: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(sql(store, text), params or {})
        return [dict(r) for r in cur.fetchall()]


def execute(store: Store, text: str, params: dict[str, Any] | None = None) -> None:
    with store.transaction() as tx:
        tx.conn.cursor().execute(sql(store, text), params or {})


def insert_outbound(store: Store, messages: list[dict[str, Any]]) -> list[int]:
    """Insert stage_outbound rows in list order; their ids in the same order."""
    with store.transaction() as tx:
        cur = tx.conn.cursor()
        for n, m in enumerate(messages):
            cur.execute(sql(store, INSERT), {"source_id": n + 1, "content_type": "application/hl7-v2", **m})
            cur.execute(sql(store, INSERT_BODY), {"payload": m["payload"], "idempotency_key": m["idempotency_key"]})
    by_key = {r["idempotency_key"]: r["id"] for r in rows(store, "SELECT id, idempotency_key FROM stage_outbound")}
    return [by_key[m["idempotency_key"]] for m in messages]


def backlog(dests: dict[str, Any], destination: str = "ehr") -> list[dict[str, Any]]:
    """PER_LANE messages for each patient, interleaved across lanes in arrival order."""
    out = []
    for i in range(PER_LANE):
        for p in PATIENTS:
            payload = hl7_message(f"{p}-{i}", p)
            out.append(
                {
                    "message_id": f"m-{p}-{i}",
                    "control_id": f"{p}-{i}",
                    "destination": destination,
                    "idempotency_key": f"{destination}-{p}-{i}",
                    "lane_key": lane_key(dests[destination], payload),
                    "payload": payload,
                }
            )
    return out


def mllp_config(receiver: MllpReceiver, **settings: Any) -> list[dict[str, Any]]:
    return [
        {
            "name": "ehr",
            "kind": "mllp",
            "host": "127.0.0.1",
            "port": receiver.port,
            "timeout_seconds": 5,
            "lane": "PID-3.1",
            "backoff_seconds": 0,
            "max_backoff_seconds": 0,
            **settings,
        }
    ]


def arrivals_by_lane(receiver: MllpReceiver) -> dict[str, list[str]]:
    lanes: dict[str, list[str]] = defaultdict(list)
    for cid in receiver.control_ids:
        lanes[cid.split("-")[0]].append(cid)
    return dict(lanes)


def statuses(store: Store) -> dict[str, str]:
    return {r["control_id"]: r["status"] for r in rows(store, "SELECT control_id, status FROM stage_outbound")}


def run(store: Store, spark: SparkSession | None, epoch: int, config: Any, **kwargs: Any) -> DeliverOutcome:
    return deliver_job.run(store, spark, destinations=config, owner=f"{NODE}/deliver", epoch=epoch, **kwargs)


# --- pure: deliver_lanes ----------------------------------------------------------------------


def test_deliver_lanes_sends_each_row_and_reports_unknown_destinations_as_retryable(tmp_path: Path) -> None:
    dests = parse_destinations([{"name": "archive", "kind": "file", "directory": str(tmp_path)}])
    claimed = [
        {
            "id": 1,
            "destination": "archive",
            "lane_key": "archive",
            "payload": "a",
            "content_type": "text/plain",
            "idempotency_key": "k1",
            "attempts": 1,
        },
        {
            "id": 2,
            "destination": "gone",
            "lane_key": "gone",
            "payload": "b",
            "content_type": None,
            "idempotency_key": "k2",
            "attempts": 1,
        },
    ]
    assert list(deliver_job.deliver_lanes(claimed, dests)) == [
        {
            "id": 1,
            "destination": "archive",
            "ok": True,
            "retryable": False,
            "detail": "archive: wrote k1.hl7 (1 bytes)",
        },
        {
            "id": 2,
            "destination": "gone",
            "ok": False,
            "retryable": True,
            "detail": "destination 'gone' is not configured",
        },
    ]


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_lane_with_several_rows_stops_at_its_first_failure(http_receiver, concurrency: int) -> None:
    receiver = http_receiver(lambda key: 503 if key == "a1" else 200)
    dests = parse_destinations([{"name": "api", "kind": "http", "url": receiver.url}])
    claimed = [
        {
            "id": i,
            "destination": "api",
            "lane_key": lane,
            "payload": "x",
            "content_type": "text/plain",
            "idempotency_key": f"{lane}{i}",
            "attempts": 1,
        }
        for i, lane in [(3, "b"), (1, "a"), (2, "a"), (4, "b")]
    ]
    outcomes = {o["id"]: o for o in deliver_job.deliver_lanes(claimed, dests, concurrency=concurrency)}
    assert {i: (o["ok"], o["retryable"]) for i, o in outcomes.items()} == {
        1: (False, True),
        2: (False, True),
        3: (True, False),
        4: (True, False),
    }
    assert outcomes[2]["detail"] == "not attempted: message 1 earlier in the lane failed"
    assert sorted(receiver.keys) == ["a1", "b3", "b4"]
    assert [k for k in receiver.keys if k.startswith("b")] == ["b3", "b4"]


def test_a_round_past_its_time_box_sends_each_lane_head_and_leaves_the_rest(http_receiver) -> None:
    receiver = http_receiver(lambda key: 200)
    dests = parse_destinations([{"name": "api", "kind": "http", "url": receiver.url}])
    claimed = [
        {
            "id": i,
            "destination": "api",
            "lane_key": lane,
            "payload": "x",
            "content_type": "text/plain",
            "idempotency_key": f"{lane}{i}",
            "attempts": 1,
        }
        for i, lane in [(1, "a"), (2, "b"), (3, "a"), (4, "b"), (5, "a")]
    ]
    outcomes = {o["id"]: o for o in deliver_job.deliver_lanes(claimed, dests, deadline=time.time() - 1)}
    assert {i: o["ok"] for i, o in outcomes.items()} == {1: True, 2: True, 3: False, 4: False, 5: False}
    assert outcomes[3]["detail"] == f"{NOT_ATTEMPTED}: {deliver_job.ROUND_OVER}"  # released, attempt not counted
    assert sorted(receiver.keys) == ["a1", "b2"]


# --- the store and real receivers -------------------------------------------------------------


@pytest.mark.parametrize("per_lane", [1, 50])
def test_a_backlog_of_three_lanes_is_delivered_in_lane_order_through_spark(
    store, spark, mllp_receiver, per_lane: int
) -> None:
    receiver = mllp_receiver()
    config = mllp_config(receiver)
    ids = insert_outbound(store, backlog(parse_destinations(config)))
    epoch = acquire_permanent(store, node_id=NODE)
    summary = run(store, spark, epoch, config, per_lane=per_lane)
    assert arrivals_by_lane(receiver) == {p: [f"{p}-{i}" for i in range(PER_LANE)] for p in PATIENTS}
    rounds = PER_LANE if per_lane == 1 else 1  # heads only: one message per lane per round
    assert summary == DeliverOutcome(rounds=rounds, claimed=tuple(sorted(ids)), done=tuple(sorted(ids)))
    assert set(statuses(store).values()) == {"done"}
    assert rows(store, "SELECT event, count(*) AS n FROM message_events GROUP BY event") == [
        {"event": "done", "n": len(ids)}
    ]


def test_a_failing_head_blocks_only_its_lane_and_goes_dead_after_max_attempts(store, mllp_receiver) -> None:
    receiver = mllp_receiver(answer=lambda t: raw_ack("AE" if control_id_of(t) == "P2-0" else "AA", control_id_of(t)))
    config = mllp_config(receiver, max_attempts=3)
    ids = insert_outbound(store, backlog(parse_destinations(config)))
    epoch = acquire_permanent(store, node_id=NODE)
    summary = run(store, None, epoch, config)
    head = ids[1]  # P2-0
    arrivals = arrivals_by_lane(receiver)
    assert arrivals["P2"] == ["P2-0"] * 3 + [f"P2-{i}" for i in range(1, PER_LANE)]  # nothing overtook the head
    assert arrivals["P1"] == [f"P1-{i}" for i in range(PER_LANE)]
    assert arrivals["P3"] == [f"P3-{i}" for i in range(PER_LANE)]
    assert statuses(store) == {
        f"{p}-{i}": "dead" if (p, i) == ("P2", 0) else "done" for p in PATIENTS for i in range(PER_LANE)
    }
    assert summary.dead == (head,) and summary.retrying == (head,)
    events = rows(
        store,
        "SELECT event, from_status, to_status, attempt, node_id, epoch, destination, detail "
        "FROM message_events WHERE row_id = :id ORDER BY id",
        {"id": head},
    )
    assert events == [
        {
            "event": "attempt_failed",
            "from_status": "in_flight",
            "to_status": to,
            "attempt": n,
            "node_id": f"{NODE}/deliver",
            "epoch": epoch,
            "destination": "ehr",
            "detail": "ehr: AE for P2-0: test",
        }
        for n, to in [(1, "error"), (2, "error"), (3, "dead")]
    ]
    assert rows(store, "SELECT attempts, last_error FROM stage_outbound WHERE id = :id", {"id": head}) == [
        {"attempts": 3, "last_error": "ehr: AE for P2-0: test"}
    ]
    # the rest of P2's lane was claimed with its head each round but never tried: not counted
    assert rows(
        store, "SELECT DISTINCT attempts FROM stage_outbound WHERE control_id LIKE 'P2-%' AND id <> :id", {"id": head}
    ) == [{"attempts": 1}]
    p2_rest = {r["id"] for r in rows(store, "SELECT id FROM stage_outbound WHERE control_id LIKE 'P2-%'")} - {head}
    assert set(summary.released) == p2_rest


def test_a_head_backing_off_holds_its_lane_while_the_other_lanes_drain(store, mllp_receiver) -> None:
    receiver = mllp_receiver(answer=lambda t: raw_ack("AE" if control_id_of(t) == "P2-0" else "AA", control_id_of(t)))
    config = mllp_config(receiver, backoff_seconds=600, max_backoff_seconds=600)
    ids = insert_outbound(store, backlog(parse_destinations(config)))
    summary = run(store, None, acquire_permanent(store, node_id=NODE), config)
    assert arrivals_by_lane(receiver) == {
        "P1": [f"P1-{i}" for i in range(PER_LANE)],
        "P2": ["P2-0"],
        "P3": [f"P3-{i}" for i in range(PER_LANE)],
    }
    assert summary.retrying == (ids[1],) and summary.dead == ()
    assert statuses(store) == {
        f"{p}-{i}": ("error" if i == 0 else "pending") if p == "P2" else "done"
        for p in PATIENTS
        for i in range(PER_LANE)
    }
    assert rows(
        store, "SELECT count(*) AS n FROM stage_outbound WHERE id = :id AND next_attempt_at IS NOT NULL", {"id": ids[1]}
    ) == [{"n": 1}]


def test_a_reject_is_dead_at_once_and_the_lane_moves_on(store, mllp_receiver) -> None:
    receiver = mllp_receiver(answer=lambda t: raw_ack("AR" if control_id_of(t) == "P1-1" else "AA", control_id_of(t)))
    config = mllp_config(receiver, max_attempts=5)
    ids = insert_outbound(store, backlog(parse_destinations(config)))
    summary = run(store, None, acquire_permanent(store, node_id=NODE), config)
    rejected = ids[3]  # P1-1
    assert summary.dead == (rejected,) and summary.retrying == ()
    assert arrivals_by_lane(receiver)["P1"] == [f"P1-{i}" for i in range(PER_LANE)]
    assert rows(
        store, "SELECT event, to_status, attempt, detail FROM message_events WHERE row_id = :id", {"id": rejected}
    ) == [
        {
            "event": "attempt_failed",
            "to_status": "dead",
            "attempt": 1,
            "detail": "permanent: ehr: AR (reject) for P1-1: test",
        }
    ]
    assert sorted(statuses(store).values()) == ["dead"] + ["done"] * (len(ids) - 1)


def test_a_redelivery_writes_the_same_file_and_sends_the_same_idempotency_key(store, outbox, http_receiver) -> None:
    receiver = http_receiver()
    config = [
        {"name": "archive", "kind": "file", "directory": str(outbox)},
        {"name": "api", "kind": "http", "url": receiver.url},
    ]
    insert_outbound(
        store,
        [
            {
                "message_id": "m1",
                "control_id": "C1",
                "destination": "archive",
                "idempotency_key": "out-1-archive",
                "lane_key": "archive",
                "payload": hl7_message("C1"),
            },
            {
                "message_id": "m1",
                "control_id": "C1",
                "destination": "api",
                "idempotency_key": "out-1-api",
                "lane_key": "api",
                "payload": hl7_message("C1"),
            },
        ],
    )
    epoch = acquire_permanent(store, node_id=NODE)
    assert len(run(store, None, epoch, config).done) == 2
    execute(store, "UPDATE stage_outbound SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL")
    assert len(run(store, None, epoch, config).done) == 2
    assert sorted(p.name for p in outbox.iterdir()) == ["out-1-archive.hl7"]
    assert (outbox / "out-1-archive.hl7").read_bytes() == hl7_message("C1").encode()
    assert receiver.keys == ["out-1-api", "out-1-api"]
    assert rows(store, "SELECT attempts FROM stage_outbound") == [{"attempts": 2}, {"attempts": 2}]


def test_a_finalize_under_a_stale_epoch_lands_nothing_and_the_next_leader_redelivers(store, outbox) -> None:
    config = [{"name": "archive", "kind": "file", "directory": str(outbox)}]
    (head,) = insert_outbound(
        store,
        [
            {
                "message_id": "m1",
                "control_id": "C1",
                "destination": "archive",
                "idempotency_key": "k1",
                "lane_key": "archive",
                "payload": hl7_message("C1"),
            }
        ],
    )
    old = acquire_permanent(store, node_id="old")
    assert deliver_job.claim(store, owner="old/run", epoch=old, max_lanes=10) == [head]
    outcomes = list(
        deliver_job.deliver_lanes(
            deliver_job.fetch_claimed(store, owner="old/run", epoch=old, ids=[head]), parse_destinations(config)
        )
    )
    assert [o["ok"] for o in outcomes] == [True]
    new = acquire_permanent(store, node_id="new")
    with pytest.raises(StaleEpoch):
        finalize_deliveries(store, outcomes, owner="old/run", epoch=old, destinations=parse_destinations(config))
    assert rows(store, "SELECT status, claim_epoch FROM stage_outbound") == [
        {"status": "in_flight", "claim_epoch": old}
    ]
    assert rows(store, "SELECT count(*) AS n FROM message_events") == [{"n": 0}]
    assert run(store, None, old, config) == DeliverOutcome()  # a deposed leader claims nothing either
    with store.transaction() as tx:
        assert recover_on_promotion(tx, owner="new", epoch=new) == 1
    assert run(store, None, new, config).done == (head,)
    assert sorted(p.name for p in outbox.iterdir()) == ["k1.hl7"]


def test_a_row_for_an_unconfigured_destination_waits_instead_of_dying(store, outbox) -> None:
    config = [{"name": "archive", "kind": "file", "directory": str(outbox), "max_attempts": 1}]
    (row,) = insert_outbound(
        store,
        [
            {
                "message_id": "m1",
                "control_id": "C1",
                "destination": "renamed",
                "idempotency_key": "k1",
                "lane_key": "renamed",
                "payload": "x",
            }
        ],
    )
    summary = run(store, None, acquire_permanent(store, node_id=NODE), config)
    assert summary.retrying == (row,) and summary.dead == ()
    assert rows(store, "SELECT status, last_error FROM stage_outbound") == [
        {"status": "error", "last_error": "destination 'renamed' is not configured"}
    ]


class _BrokenSpark:
    """Stands in for a Spark session whose job fails (the failure path, not Spark itself, is under test)."""

    def createDataFrame(self, *args: Any, **kwargs: Any) -> Any:  # Spark's name
        raise RuntimeError("spark is down")


def test_a_failed_spark_round_releases_its_heads_as_retryable_and_raises(store, outbox) -> None:
    config = [{"name": "archive", "kind": "file", "directory": str(outbox)}]
    insert_outbound(
        store,
        [
            {
                "message_id": "m1",
                "control_id": "C1",
                "destination": "archive",
                "idempotency_key": "k1",
                "lane_key": "archive",
                "payload": "x",
            }
        ],
    )
    with pytest.raises(RuntimeError, match="spark is down"):
        run(store, _BrokenSpark(), acquire_permanent(store, node_id=NODE), config)  # type: ignore[arg-type]
    assert rows(store, "SELECT status, lease_owner, last_error FROM stage_outbound") == [
        {"status": "error", "lease_owner": None, "last_error": "delivery round failed: RuntimeError: spark is down"}
    ]
    assert list(outbox.iterdir()) == []


def test_run_stops_when_its_time_budget_is_spent(store, outbox) -> None:
    config = [{"name": "archive", "kind": "file", "directory": str(outbox)}]
    insert_outbound(
        store,
        [
            {
                "message_id": f"m{i}",
                "control_id": f"C{i}",
                "destination": "archive",
                "idempotency_key": f"k{i}",
                "lane_key": "archive",
                "payload": "x",
            }
            for i in range(3)
        ],
    )
    ticks = iter(range(100))
    summary = run(
        store,
        None,
        acquire_permanent(store, node_id=NODE),
        config,
        time_budget_seconds=0.5,
        clock=lambda: float(next(ticks)),
        per_lane=1,
    )
    assert summary.rounds == 1 and len(summary.done) == 1
    assert sorted(statuses(store).values()) == ["done", "pending", "pending"]


# --- the Spark wrapper ------------------------------------------------------------------------


def test_spark_deliver_returns_one_outcome_per_claimed_row(spark: SparkSession, tmp_path: Path) -> None:
    dests = parse_destinations([{"name": "archive", "kind": "file", "directory": str(tmp_path)}])
    claimed = spark.createDataFrame(
        [
            (1, "archive", "archive", "MSH|x", "application/hl7-v2", "k1", 1, "m1", "C1"),
            (2, "gone", "gone", "y", None, "k2", 3, "m2", None),
        ],
        deliver_job.CLAIMED_SCHEMA,
    )
    expected = spark.createDataFrame(
        [
            (1, "archive", True, False, "archive: wrote k1.hl7 (5 bytes)"),
            (2, "gone", False, True, "destination 'gone' is not configured"),
        ],
        deliver_job.OUTCOME_SCHEMA,
    )
    assertDataFrameEqual(deliver_job.spark_deliver(claimed, dests, partitions=2), expected)
    assert (tmp_path / "k1.hl7").read_text() == "MSH|x"


def test_a_batch_file_destination_writes_one_hl7_batch_file_per_round_in_lane_order(tmp_path: Path) -> None:
    """``batch = true``: the round's rows for that destination become ONE batch file (FHS/BHS … BTS/FTS)
    whose messages keep id order (so every lane's order); a plain file destination beside it still
    writes a file per message; the same rows delivered again rewrite the same file."""
    from listeners.hl7batch import split_batch

    (tmp_path / "batches").mkdir()
    (tmp_path / "single").mkdir()
    dests = parse_destinations(
        [
            {
                "name": "nightly",
                "kind": "file",
                "directory": str(tmp_path / "batches"),
                "batch": True,
                "lane": "PID-3.1",
            },
            {"name": "single", "kind": "file", "directory": str(tmp_path / "single")},
        ]
    )
    claimed = []
    for n in range(6):
        patient = PATIENTS[n % 3]
        payload = hl7_message(f"{patient}-{n}", patient)
        for dest in ("nightly", "single"):
            claimed.append(
                {
                    "id": 2 * n + (dest == "single") + 1,
                    "destination": dest,
                    "payload": payload,
                    "lane_key": lane_key(dests[dest], payload),
                    "content_type": "application/hl7-v2",
                    "idempotency_key": f"{dest}-{n}",
                    "attempts": 1,
                }
            )
    outcomes = list(deliver_job.deliver_lanes(claimed, dests))
    assert sorted(o["id"] for o in outcomes) == list(range(1, 13)) and all(o["ok"] for o in outcomes)
    [written] = list((tmp_path / "batches").iterdir())
    split = split_batch(written.read_bytes())
    assert [control_id_of(m.decode()) for m in split.messages] == [f"{PATIENTS[n % 3]}-{n}" for n in range(6)]
    assert split.declared == 6 and split.header.sending_application == "STAGELINE"
    assert split.header.receiving_application == "nightly" and split.header.fhs_control_id
    assert all("a batch of 6 messages" in o["detail"] for o in outcomes if o["destination"] == "nightly")
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == [f"single-{n}.hl7" for n in range(6)]
    list(deliver_job.deliver_lanes(claimed, dests))  # a re-delivery of the same round
    assert [p.name for p in (tmp_path / "batches").iterdir()] == [written.name]


def test_the_deliver_stage_is_not_run_as_a_batch_job_and_claims_nothing_when_asked(store: Store) -> None:
    """Its record lands nothing (outcomes are collected, not landed): the generic stage job refuses it
    before claiming, so its lane heads stay due for `deliver_job.run`."""
    from include.store.stages import DELIVER
    from spark_jobs.stage_job import run_stage_job

    epoch = acquire_permanent(store, node_id=NODE)
    dests = parse_destinations([{"name": "ehr", "kind": "file", "directory": "/nonexistent", "lane": "PID-3.1"}])
    insert_outbound(store, backlog(dests)[:2])
    with pytest.raises(ValueError, match="lands nothing"):
        run_stage_job(
            DELIVER,
            store,
            None,
            transform=lambda claimed, run_id: claimed,  # type: ignore[arg-type]
            owner=f"{NODE}/batch",
            epoch=epoch,
            run_id="r1",
        )
    assert {r["status"] for r in rows(store, "SELECT status FROM stage_outbound")} == {"pending"}
