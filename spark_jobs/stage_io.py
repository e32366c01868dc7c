"""The store side every Spark stage job shares: claim, read the claimed rows, land, clean up.

    claim    one SQL statement outside Spark, in lane order (`rowlease.claim_batch`): never inside a
             Spark read, whose schema probe would run it twice
    read     Spark JDBC read of exactly the rows the run claimed, bounded by owner + epoch (a named,
             read-only query with its parameters inlined); given the claimed ids, one partition per
             id range (`id_ranges`: up to READ_PARTITIONS of at least READ_PARTITION_ROWS), so the
             transform and the landing write after it run on that many cores instead of one
    land     Spark JDBC append into the stage's landing table (it exists up front: Spark cannot
             create tables on SQLite); each partition in its own transaction
    discard  drop a failed run's landing rows, best effort

Small batches (at most SMALL_BATCH_ROWS claimed rows — the steady trickle of a live feed) take a
shorter path with the same result: the claimed rows are read with the store's own connection and
handed to Spark as a local frame, and the landing rows are collected and inserted in one
statement. That saves the two JDBC round trips Spark makes per read (schema probe + read) and the
separate Spark job of a JDBC write: about a second per run on a warm Connect server. The
transform itself always runs in Spark.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from pyspark.sql import DataFrame, SparkSession

from include.spark import jdbc_options
from include.store import Store, StagedTable, Tx
from include.store.retry import with_retries
from include.store.rowlease import SWEEP_MAX_ATTEMPTS, claim_batch, fail_batch
from include.store.stages import StaleEpoch, discard_landing, inline_query

log = logging.getLogger(__name__)

T = TypeVar("T")
WRITE_BATCH_ROWS = 2_000
SMALL_BATCH_ROWS = 1_000
READ_PARTITION_ROWS = 5_000
READ_PARTITIONS = 4


def claim(store: Store, table: StagedTable, *, owner: str, epoch: int, batch_size: int,
          lease_seconds: float | None = None) -> list[int]:
    """Claim up to `batch_size` due rows of `table` for `owner`, in lane order; their ids."""
    with store.transaction() as tx:
        rows = claim_batch(tx, table, owner=owner, epoch=epoch, limit=batch_size, lease_seconds=lease_seconds)
    return [int(r["id"]) for r in rows]


def is_small(claimed_ids: Sequence[int]) -> bool:
    """Whether a claim takes the small-batch path (module docstring)."""
    return len(claimed_ids) <= SMALL_BATCH_ROWS


def read_claimed(store: Store, spark: SparkSession, query_name: str, schema: str, *, owner: str,
                 epoch: int, small: bool = False, ids: Sequence[int] = (),
                 rows_per_partition: int = READ_PARTITION_ROWS, max_partitions: int = READ_PARTITIONS) -> DataFrame:
    """The rows `owner` claimed under `epoch`, via the read-only named query `query_name`.

    `schema` is a Spark customSchema: Spark would map SQLite's INTEGER to a 32-bit int, and the
    ids are 64-bit everywhere. `small`: the rows are read here and sent to Spark as a local frame.
    """
    if small:
        columns = [c.strip().split()[0] for c in schema.split(",")]
        with store.transaction(write=False) as tx:
            found = tx.all(query_name, {"owner": owner, "epoch": int(epoch)})
        return spark.createDataFrame([tuple(r[c] for c in columns) for r in found], schema)
    query = inline_query(store, query_name, {"owner": owner, "epoch": int(epoch)})
    ranges = id_ranges(ids, rows=rows_per_partition, most=max_partitions) if ids else []
    if len(ranges) < 2:
        return (spark.read.format("jdbc").options(**jdbc_options(store.config))
                .option("query", query).option("customSchema", schema).option("fetchsize", "1000")
                .load())
    # One partition (own connection, own query) per id range: the transform and the landing write
    # then run on as many cores as there are ranges, not on one.
    return spark.read.jdbc(jdbc_options(store.config)["url"], f"({query}) claimed",
                           predicates=[f"id BETWEEN {lo} AND {hi}" for lo, hi in ranges],
                           properties={**jdbc_options(store.config), "customSchema": schema, "fetchsize": "1000"})


def id_ranges(ids: Sequence[int], *, rows: int = READ_PARTITION_ROWS, most: int = READ_PARTITIONS) -> list[tuple[int, int]]:
    """Split claimed ids into at most `most` contiguous ranges of at least `rows` ids each (as even
    as the ids allow): disjoint, and together they hold every id."""
    ordered = sorted(int(i) for i in ids)
    parts = max(1, min(most, len(ordered) // max(rows, 1)))
    bounds = [len(ordered) * k // parts for k in range(parts + 1)]
    return [(ordered[a], ordered[b - 1]) for a, b in zip(bounds, bounds[1:]) if b > a]


def land(store: Store, frame: DataFrame, table: str, columns: Sequence[str], *,
         batch_rows: int = WRITE_BATCH_ROWS, small: bool = False) -> None:
    """Append `frame` to landing table `table` over JDBC, or (`small`) collect it and insert it here.

    SQLite admits one writer at a time, so it gets one writing connection; a server database gets
    one per partition.
    """
    if small:
        landed = [dict(zip(columns, r)) for r in frame.select(*columns).collect()]
        if landed:
            with store.transaction() as tx:
                tx.execute(f"{table}_insert", {"rows": json.dumps(landed)})
        return
    writer = (frame.select(*columns).write.format("jdbc").options(**jdbc_options(store.config))
              .option("dbtable", table).option("batchsize", str(batch_rows)).mode("append"))
    if store.backend == "sqlite":
        writer = writer.option("numPartitions", "1")
    started = time.perf_counter()
    writer.save()
    if store.backend == "sqlite":  # the JVM's transaction held SQLite's one write lock (its upper bound)
        store.note_hold(time.perf_counter() - started)


def finalize_fenced(store: Store, *, run_id: str, landing_table: str, step: Callable[[Tx], T]) -> T:
    """Run a stage's fenced finalize `step` in one transaction; under a stale epoch drop the run's
    landing rows (nothing of it may land) and re-raise."""
    try:
        with store.transaction() as tx:
            return step(tx)
    except StaleEpoch:
        discard_landing(store, run_id=run_id, table=landing_table)
        raise


def land_and_finalize(store: Store, table: StagedTable, *, claimed_ids: list[int], owner: str, epoch: int,
                      run_id: str, landing_table: str, columns: Sequence[str],
                      build: Callable[[bool], DataFrame], finalize: Callable[[], T]) -> T:
    """The part of a stage run after its claim: `build(small)` the landing frame (read + pure
    transform), land it, `finalize()` (one fenced transaction).

    On a failure the run's landing rows are dropped and its claimed rows handed back at once
    (`release_quietly`, retried while the database is briefly gone); if the process dies they stay
    in_flight until the next task of the stage DAG recovers them (`ClaimKeeper.recover_abandoned`)
    or, unrenewed, their short row lease expires. A StaleEpoch propagates
    untouched: the finalize already dropped the landing rows, and the claim belongs to the new
    leader's recovery.
    """
    small = is_small(claimed_ids)
    try:
        land(store, build(small), landing_table, columns, small=small)
        return finalize()
    except StaleEpoch:
        raise
    except BaseException as exc:
        discard_quietly(store, run_id, landing_table)
        release_quietly(store, table, claimed_ids, owner=owner, epoch=epoch, error=exc)
        raise


def release_quietly(store: Store, table: StagedTable, ids: list[int], *, owner: str, epoch: int,
                    error: BaseException) -> None:
    """After a failed run, hand its claimed rows back at once (best effort) instead of leaving them
    in flight — holding their lanes — until the sweep: due again now, the failure in `last_error`
    and an `attempt_failed` event; after SWEEP_MAX_ATTEMPTS claims `dead`, as the sweep would.
    A database that is briefly gone (a restart) is waited for (`with_retries`). Fenced like every
    write: under a stale epoch it changes nothing."""
    detail = f"stage run failed: {type(error).__name__}: {error}"[:400]

    def hand_back() -> None:
        with store.transaction() as tx:
            fail_batch(tx, table, ids, owner=owner, epoch=epoch, error=detail, max_attempts=SWEEP_MAX_ATTEMPTS,
                       backoff_seconds=0.0, max_backoff_seconds=0.0)

    with_retries(hand_back, what=f"hand back {len(ids)} claimed rows of {table.name}")


def discard_quietly(store: Store, run_id: str, table: str) -> None:
    """Best effort: the original error matters more, and the next finalize of these rows cleans up."""
    try:
        discard_landing(store, run_id=run_id, table=table)
    except Exception:
        log.warning("run %s: could not drop its rows from %s", run_id, table, exc_info=True)
