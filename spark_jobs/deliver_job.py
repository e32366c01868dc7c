"""The deliver stage: stage_outbound lane heads → destinations, per-lane FIFO, at-least-once.

One round:

    claim     `claim_lane_heads` in one SQL transaction outside Spark: the first `per_lane` rows
              of each due lane (a prefix, cut before anything held), stranded heads of a dead
              leader re-pended first
    extract   the claimed rows (`read_claimed`: a local frame for a small claim, a Spark JDBC read
              for a large one — `spark_jobs.stage_job`)
    deliver   `spark_deliver`: repartition by lane, `mapInPandas` → `deliver_lanes` → `send()`;
              an outcomes frame (id, destination, ok, retryable, detail) is collected. A
              partition's file lanes are written together: two disk flushes for all of them, not
              two per file (`senders.file.send_file_lanes`); a file destination with
              ``batch = true`` gets one HL7 batch file of all its rows in the partition
              (`senders.file.batch_file`)
    finalize  `include.store.finalize.finalize_deliveries`, ONE fenced transaction: ok → done;
              retryable → error with the destination's backoff, or dead after its
              `max_attempts`; permanent → dead at once; not attempted (an earlier row of its lane
              failed this round) → pending again, the attempt not counted

The stage's record is `include.store.stages.DELIVER` (its input table, read query and schema, its
finalize; no landing table: outcomes are collected, not landed). It claims lane heads, not a
batch, and repeats rounds, so it is its own job rather than `stage_job.run_stage_job`.

`run()` repeats rounds until no lane head is due or its time budget is spent, so one job run
drains a backlog lane by lane, each lane in id order. Within a round a lane's rows are sent one
after another and the first failure stops the lane, so a later message never overtakes a failed
earlier one; a failing head (backing off, then dead) blocks its own lane and nothing else
(invariant 6, docs/invariants.md). `per_lane` > 1 (default 5,000) lets a busy lane — e.g. one lane
per destination — move many messages per round instead of one; `max_rows` (default 20,000) caps a
round over all lanes, taken round-robin so every lane keeps a prefix.

At-least-once (invariant 5): a message can be sent and its finalize never land (crash, lost
lease, stale epoch); the row is re-pended (sweep or promotion recovery) and sent again. Every
send carries the row's idempotency key (see `spark_jobs.senders`). Under a stale epoch the
finalize raises `StaleEpoch` and lands nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from include.destinations_config import Destination, FileDestination, parse_destinations
from include.hl7path import value as hl7_value
from include.store import Store
from include.store.finalize import NOT_ATTEMPTED, DeliverOutcome, StaleEpoch, finalize_deliveries
from include.store.retry import until_done, with_retries
from include.store.rowlease import claim_lane_heads
from include.store.stages import DELIVER
from spark_jobs.senders import send
from spark_jobs.senders.common import DEFAULT_CONTENT_TYPE
from spark_jobs.senders.file import FileSend, batch_file, send_file_lanes
from spark_jobs.senders.mllp import sweep_late_answers, take_late_refusals

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

__all__ = [
    "CLAIMED_COLUMNS",
    "CLAIMED_SCHEMA",
    "OUTCOME_SCHEMA",
    "DeliverOutcome",
    "StaleEpoch",
    "claim",
    "deliver_lanes",
    "deliver_row",
    "fetch_claimed",
    "read_claimed",
    "run",
    "spark_deliver",
]

CLAIMED_COLUMNS = tuple(DELIVER.columns)
CLAIMED_SCHEMA = DELIVER.schema
OUTCOME_COLUMNS = ("id", "destination", "ok", "retryable", "detail")
OUTCOME_SCHEMA = "id BIGINT, destination STRING, ok BOOLEAN, retryable BOOLEAN, detail STRING"
NO_OUTCOME = "no delivery outcome came back from Spark"
DEFAULT_PER_LANE = 5_000
DEFAULT_ROUND_ROWS = 20_000
DEFAULT_ROUND_SECONDS = 2.0
"""How long a round sends before it leaves the rest of its rows for the next one. A round learns of
a change of leader only when it ends (its finalize is fenced), and whatever it sends after the
change is sent again by the new leader: the time box bounds those duplicates, whatever the round's
size. File lanes are written in one go and are not cut."""
ROUND_OVER = "the round's time box was spent"
"""Rows one round claims at most, over all its lanes (round-robin, each lane a prefix): bounds a
round's memory and duration however many lanes are due, while a one-lane backlog still moves
`DEFAULT_PER_LANE` rows a round instead of waiting a round per few hundred."""

Destinations = Mapping[str, Destination] | Iterable[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]


# ---------------------------------------------------------------------------------------------
# deliver (pure Python: runs inside Spark's Python workers, and in unit tests without Spark)


def deliver_row(row: Mapping[str, Any], destinations: Mapping[str, Destination]) -> dict[str, Any]:
    """Send one claimed row; its outcome `{id, destination, ok, retryable, detail}`."""
    name = row["destination"]
    dest = destinations.get(name)
    if dest is None:
        return _outcome(row, ok=False, retryable=True, detail=f"destination {name!r} is not configured")
    result = send(
        dest,
        payload=row["payload"],
        content_type=row.get("content_type") or DEFAULT_CONTENT_TYPE,
        idempotency_key=row["idempotency_key"],
    )
    return _outcome(row, ok=result.ok, retryable=result.retryable, detail=result.detail)


def deliver_lanes(
    rows: Iterable[Mapping[str, Any]],
    destinations: Destinations,
    *,
    concurrency: int = 1,
    deadline: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Send claimed rows lane by lane (`_send_lanes`); yield one outcome per row once all are sent.

    A message delivered unanswered (MLLP, MSH-15 NE or ER under `accept_ack = "msh15"`) that a
    receiver refused anyway, its refusal read later in the round (before another write on that
    connection, while waiting for another ACK, or in the sweep of the idle connections at the end),
    is not left delivered: its outcome becomes that refusal (permanent: dead, the reason in
    `last_error`). A refusal read after its row's round is logged only (`spark_jobs.senders.mllp`).
    """
    rows = list(rows)
    outcomes = list(_send_lanes(rows, destinations, concurrency=concurrency, deadline=deadline))
    yield from _with_late_refusals(rows, outcomes)


def _with_late_refusals(rows: list[Mapping[str, Any]], outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sweep_late_answers()
    refused = take_late_refusals()
    if not refused:
        return outcomes
    by_id = {int(r["id"]): r for r in rows}
    for out in outcomes:
        row = by_id.get(out["id"])
        if not out["ok"] or row is None:
            continue
        control_id = (hl7_value(str(row.get("payload") or ""), "MSH-10") or "").strip()
        why = refused.get((out["destination"], control_id))
        if why is not None:
            out.update(ok=False, retryable=False, detail=why)
    return outcomes


def _send_lanes(
    rows: Iterable[Mapping[str, Any]],
    destinations: Destinations,
    *,
    concurrency: int = 1,
    deadline: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Send claimed rows lane by lane; yield one outcome per row.

    A claim hands over a prefix of each due lane (up to `per_lane` rows), so lanes are independent
    and may be sent concurrently (`concurrency` threads: sends are I/O-bound). A lane's rows go in
    id order and, after a failure, the rest of that lane is not attempted (an outcome whose detail
    starts with NOT_ATTEMPTED; the finalize re-pends it) — a later message never overtakes a
    failed earlier one.
    """
    dests = _parsed(destinations)
    lanes: dict[Any, list[Mapping[str, Any]]] = {}
    for row in rows:
        lanes.setdefault(row.get("lane_key"), []).append(row)
    ordered = [sorted(lane, key=lambda r: int(r["id"])) for lane in lanes.values()]

    def one_lane(lane: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for row in lane:
            if out and not out[-1]["ok"]:
                out.append(
                    _outcome(
                        row,
                        ok=False,
                        retryable=True,
                        detail=f"{NOT_ATTEMPTED}: message {out[-1]['id']} earlier in the lane failed",
                    )
                )
            elif out and deadline is not None and time.time() > deadline:  # a lane's head always goes
                out.append(_outcome(row, ok=False, retryable=True, detail=f"{NOT_ATTEMPTED}: {ROUND_OVER}"))
            else:
                out.append(deliver_row(row, dests))
        return out

    files: list[list[Mapping[str, Any]]] = []
    others: list[list[Mapping[str, Any]]] = []
    for lane in ordered:  # a lane is one destination's (its key starts with the name)
        (files if all(isinstance(dests.get(r["destination"]), FileDestination) for r in lane) else others).append(lane)
    if files:
        yield from _deliver_file_lanes(files, dests)
    ordered = others
    if concurrency <= 1 or len(ordered) <= 1:
        for lane in ordered:
            yield from one_lane(lane)
        return
    with ThreadPoolExecutor(max_workers=min(concurrency, len(ordered)), thread_name_prefix="deliver") as pool:
        for outcomes in pool.map(one_lane, ordered):
            yield from outcomes


def _deliver_file_lanes(
    lanes: list[list[Mapping[str, Any]]], dests: Mapping[str, Destination]
) -> Iterator[dict[str, Any]]:
    """File lanes all at once: two flushes for the lot instead of two per file (`send_file_lanes`).
    A destination with ``batch = true`` gets all its rows here as ONE batch file instead."""
    batched: dict[str, list[Mapping[str, Any]]] = {}
    single: list[list[Mapping[str, Any]]] = []
    for lane in lanes:
        dest = dests[lane[0]["destination"]]
        if isinstance(dest, FileDestination) and dest.batch:
            batched.setdefault(dest.name, []).extend(lane)
        else:
            single.append(lane)
    groups = [sorted(rows, key=lambda r: int(r["id"])) for rows in batched.values()]  # lanes stay in order
    files = {name: d for name, d in dests.items() if isinstance(d, FileDestination)}  # every lane here is one
    sends = [
        [
            FileSend(
                files[r["destination"]],
                r["payload"],
                r.get("content_type") or DEFAULT_CONTENT_TYPE,
                r["idempotency_key"],
            )
            for r in lane
        ]
        for lane in single
    ]
    sends += [[batch_file(files[rows[0]["destination"]], rows)] for rows in groups]
    results_all = send_file_lanes(sends)
    for rows, [result] in zip(groups, results_all[len(single) :]):
        assert result is not None
        for row in rows:
            yield _outcome(
                row,
                ok=result.ok,
                retryable=result.retryable,
                detail=f"{result.detail}, a batch of {len(rows)} messages",
            )
    lanes = single
    for lane, results in zip(lanes, results_all):
        failed: Mapping[str, Any] | None = None
        for row, result in zip(lane, results):
            if result is None:
                yield _outcome(
                    row,
                    ok=False,
                    retryable=True,
                    detail=f"{NOT_ATTEMPTED}: message {failed['id'] if failed else '?'} earlier in the lane failed",
                )
            else:
                if not result.ok:
                    failed = row
                yield _outcome(row, ok=result.ok, retryable=result.retryable, detail=result.detail)


def spark_deliver(
    claimed: DataFrame,
    destinations: Destinations,
    *,
    partitions: int | None = None,
    concurrency: int = 1,
    round_seconds: float | None = None,
) -> DataFrame:
    """Deliver a frame of claimed rows (CLAIMED_COLUMNS) in Spark; returns the outcomes frame.

    Repartitioned by lane so lanes spread over the executors (each partition sends its lanes one
    after another, or `concurrency` at a time). Destinations are validated here, on the driver,
    and travel to the workers as plain frozen dataclasses.
    """
    dests = _parsed(destinations)

    def deliver_batches(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas as pd

        # The whole partition at once: Arrow may split one lane's rows over two batches, and a lane
        # must stop at its first failure across all of them.
        records = [_plain(r) for batch in batches for r in batch.to_dict("records")]
        deadline = None if round_seconds is None else time.time() + round_seconds  # from the first send
        outcomes = list(deliver_lanes(records, dests, concurrency=concurrency, deadline=deadline))
        if outcomes:
            yield pd.DataFrame(outcomes, columns=list(OUTCOME_COLUMNS)).astype(
                {"id": "int64", "ok": "bool", "retryable": "bool"}
            )

    spread = claimed.repartition(partitions, "lane_key") if partitions else claimed.repartition("lane_key")
    return spread.sortWithinPartitions("lane_key", "id").mapInPandas(deliver_batches, schema=OUTCOME_SCHEMA)


# ---------------------------------------------------------------------------------------------
# store side: claim and read (the finalize is `include.store.finalize.finalize_deliveries`)


def claim(
    store: Store,
    *,
    owner: str,
    epoch: int,
    max_lanes: int,
    lease_seconds: float | None = None,
    per_lane: int = 1,
    max_rows: int = DEFAULT_ROUND_ROWS,
) -> list[int]:
    """Claim the first `per_lane` rows of up to `max_lanes` lanes, at most `max_rows` in all, in their
    own transaction; their ids."""
    with store.transaction() as tx:
        rows = claim_lane_heads(
            tx,
            DELIVER.input,
            owner=owner,
            epoch=epoch,
            limit=max_lanes,
            lease_seconds=lease_seconds,
            per_lane=per_lane,
            max_rows=max_rows,
        )
    return [int(r["id"]) for r in rows]


def fetch_claimed(store: Store, *, owner: str, epoch: int, ids: Iterable[int]) -> list[dict[str, Any]]:
    """The claimed rows still ours, in id order (plain SQL, read-only)."""
    wanted = {int(i) for i in ids}
    with store.transaction(write=False) as tx:
        found = tx.all(DELIVER.read_query, {"owner": owner, "epoch": int(epoch)})
    return sorted(
        ({c: r[c] for c in CLAIMED_COLUMNS} for r in found if int(r["id"]) in wanted), key=lambda r: int(r["id"])
    )


def read_claimed(store: Store, spark: SparkSession, *, owner: str, epoch: int, ids: Iterable[int]) -> DataFrame:
    """The claimed rows as a Spark frame with CLAIMED_SCHEMA: read here and handed over as a local
    frame for a small claim, a Spark JDBC read of `deliver_read_claimed` (bounded by owner + epoch)
    for a large one."""
    from spark_jobs import stage_job

    return stage_job.read_claimed(store, spark, DELIVER, owner=owner, epoch=epoch, small=stage_job.is_small(list(ids)))


# ---------------------------------------------------------------------------------------------
# the job


def run(
    store: Store,
    spark: SparkSession | None,
    *,
    destinations: Destinations,
    owner: str,
    epoch: int,
    max_lanes: int = 1000,
    per_lane: int = DEFAULT_PER_LANE,
    max_rows: int = DEFAULT_ROUND_ROWS,
    round_seconds: float = DEFAULT_ROUND_SECONDS,
    time_budget_seconds: float = 240.0,
    lease_seconds: float | None = None,
    partitions: int | None = None,
    concurrency: int = 1,
    clock: Callable[[], float] = time.monotonic,
    stop: Callable[[], bool] = lambda: False,
) -> DeliverOutcome:
    """Deliver rounds of lane heads until none is due or `time_budget_seconds` is spent.

    Destinations are validated before anything is claimed. `spark=None` sends in this process
    (single node, tests); otherwise through `spark_deliver`. `lease_seconds` (default the store's
    row-lease TTL) must outlast one round — about max_lanes × timeout / partitions in the worst case
    — or the sweep may hand a head to another claimer while it is being sent (a duplicate, not a
    loss). If delivery itself fails (Spark error), the claimed heads are failed as retryable so
    their lanes do not wait out the row lease, and the error propagates. `owner` must be unique
    per run. `stop()` is asked before every round: true once the task must end (leadership moved).
    A round sends for at most `round_seconds` (`DEFAULT_ROUND_SECONDS`); what it did not reach is
    released, not counted as an attempt, and goes first in the next round.
    """
    dests = _parsed(destinations)
    deadline = clock() + time_budget_seconds
    total = DeliverOutcome()
    while not stop():
        ids = claim(
            store,
            owner=owner,
            epoch=epoch,
            max_lanes=max_lanes,
            lease_seconds=lease_seconds,
            per_lane=per_lane,
            max_rows=max_rows,
        )
        if not ids:
            break
        try:
            outcomes = _deliver_round(
                store,
                spark,
                dests,
                owner=owner,
                epoch=epoch,
                ids=ids,
                partitions=partitions,
                concurrency=concurrency,
                round_seconds=round_seconds,
            )
        except BaseException as exc:
            _fail_quietly(
                store,
                ids,
                owner=owner,
                epoch=epoch,
                dests=dests,
                detail=f"delivery round failed: {type(exc).__name__}: {exc}"[:400],
            )
            raise
        # the round's sends happened: its outcomes wait out a database restart rather than be lost
        # (every row of the round sent again); a deposed leader's (StaleEpoch) are not retried
        summary = until_done(
            lambda: finalize_deliveries(store, outcomes, owner=owner, epoch=epoch, destinations=dests),
            what=f"deliver {owner}: finalize a round",
            give_up_on=(StaleEpoch,),
        )
        total = total + DeliverOutcome(rounds=1) + summary
        log.info(
            "deliver %s round %d: claimed %d, done %d, retrying %d, dead %d, not finished %d",
            owner,
            total.rounds,
            len(ids),
            len(summary.done),
            len(summary.retrying),
            len(summary.dead),
            len(summary.not_finished),
        )
        if clock() >= deadline:
            break
    return total


def _deliver_round(
    store: Store,
    spark: SparkSession | None,
    dests: Mapping[str, Destination],
    *,
    owner: str,
    epoch: int,
    ids: list[int],
    partitions: int | None,
    concurrency: int,
    round_seconds: float,
) -> list[dict[str, Any]]:
    """Outcomes for every claimed id; an id with no outcome (row vanished, Spark lost it) is retryable."""
    if spark is None:
        rows = fetch_claimed(store, owner=owner, epoch=epoch, ids=ids)
        outcomes = list(deliver_lanes(rows, dests, concurrency=concurrency, deadline=time.time() + round_seconds))
    else:
        frame = read_claimed(store, spark, owner=owner, epoch=epoch, ids=ids)
        outcomes = [
            r.asDict()
            for r in spark_deliver(
                frame, dests, partitions=partitions, concurrency=concurrency, round_seconds=round_seconds
            ).collect()
        ]
    seen = {int(o["id"]) for o in outcomes}
    outcomes += [
        {"id": i, "destination": None, "ok": False, "retryable": True, "detail": NO_OUTCOME}
        for i in ids
        if i not in seen
    ]
    return outcomes


def _fail_quietly(
    store: Store, ids: list[int], *, owner: str, epoch: int, dests: Mapping[str, Destination], detail: str
) -> None:
    """After a failed round, fail its claimed heads as retryable so their lanes move on; retried
    while the database is briefly gone (`with_retries`), never raising: the original error matters
    more."""

    def hand_back() -> None:
        with store.transaction() as tx:
            heads = tx.all(DELIVER.read_query, {"owner": owner, "epoch": int(epoch)})
        wanted = set(ids)
        outcomes = [
            {"id": int(r["id"]), "destination": r["destination"], "ok": False, "retryable": True, "detail": detail}
            for r in heads
            if int(r["id"]) in wanted
        ]
        finalize_deliveries(store, outcomes, owner=owner, epoch=epoch, destinations=dests)

    with_retries(hand_back, what=f"deliver {owner}: hand back {len(ids)} claimed heads", give_up_on=(StaleEpoch,))


def _parsed(destinations: Destinations) -> dict[str, Destination]:
    if isinstance(destinations, Mapping) and all(isinstance(d, Destination) for d in destinations.values()):
        return dict(destinations)
    return parse_destinations(destinations)


def _outcome(row: Mapping[str, Any], *, ok: bool, retryable: bool, detail: str) -> dict[str, Any]:
    return {
        "id": int(row["id"]),
        "destination": row.get("destination"),
        "ok": bool(ok),
        "retryable": bool(retryable) and not ok,
        "detail": detail,
    }


def _plain(record: Mapping[str, Any]) -> dict[str, Any]:
    """pandas hands numpy scalars and NaN/NA for nulls; the senders want Python types and None."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if type(value).__name__ == "NAType":
            value = None
        elif hasattr(value, "item") and not isinstance(value, (str, bytes)):
            value = value.item()
        if isinstance(value, float) and math.isnan(value):
            value = None
        out[key] = value
    return out
