"""One run of a stage job, any stage: claim → extract → transform → land → finalize.

    claim      one SQL statement outside Spark, in lane order (`rowlease.claim_batch` on the stage's
               input table): never inside a Spark read, whose schema probe would run it twice
    extract    Spark JDBC read of exactly the rows the run claimed, bounded by owner + epoch (the
               stage's read query with its parameters inlined); given the claimed ids, one
               partition per id range (`id_ranges`: up to READ_PARTITIONS of at least
               READ_PARTITION_ROWS), so the transform and the landing write after it run on that
               many cores instead of one
    transform  the stage's pure DataFrame → DataFrame function, handed in by the caller
    land       Spark JDBC append into the stage's landing table (it exists up front: Spark cannot
               create tables on SQLite); each partition in its own transaction
    finalize   the stage's fenced finalize, ONE transaction (`include.store.finalize`)

What a stage is — its tables, read query, schema, finalize — is its record
(`include.store.stages.Stage`); this module is the one place that runs it. With nothing to claim
Spark is not touched. On a failure after the claim the run's landing rows are dropped and its
claimed rows handed back at once (`release_quietly`); a run whose process dies leaves them in
flight until the next task of the stage DAG recovers them (`ClaimKeeper.recover_abandoned`) or,
unrenewed, their short row lease expires.

A stage task's batches build the same plan again and again — the stage's whole expression tree over
a read of the batch's rows — and the server analyses it every time: most of a batch's fixed cost
(docs/performance.md, "Spark's share"). With `plans` (`KeptPlans`, one per task) a large batch
instead runs the landing frame its task built once, over a read whose text is the same every
batch (the rows in flight under the task's owner prefix, `Stage.read_task_query`; one partition
per residue of the id, `id % READ_PARTITIONS`, for any batch size): the Spark Connect server
finds that frame's analysed plan in its session's plan cache (keyed on the frame's protobuf plan,
`spark.connect.session.planCache.*`), and only the run id on top is new. A changed transform (new
lookups), epoch or session builds a new one.

Small batches (at most SMALL_BATCH_ROWS claimed rows — the steady trickle of a live feed) take a
shorter path with the same result: the claimed rows are read with the store's own connection and
handed to Spark as a local frame, and the landing rows are collected and inserted in one
statement. That saves the two JDBC round trips Spark makes per read (schema probe + read) and the
separate Spark job of a JDBC write (docs/stages.md). The transform itself always runs in Spark.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import partial
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from include.spark import jdbc_options
from include.stage_config import PipelineConfig
from include.store import StagedTable, Store
from include.store import lookups as lookup_tables
from include.store.finalize import StaleEpoch
from include.store.retry import with_retries
from include.store.rowlease import SWEEP_MAX_ATTEMPTS, claim_batch, fail_batch
from include.store.stages import Landing, Stage

log = logging.getLogger(__name__)

WRITE_BATCH_ROWS = 2_000
SMALL_BATCH_ROWS = 1_000
READ_PARTITION_ROWS = 5_000
READ_PARTITIONS = 4

Transform = Callable[..., DataFrame]
"""A stage's pure transform, called `transform(claimed, run_id=…)`: claimed rows → landing rows."""


@dataclass(frozen=True)
class StageContext:
    """What a stage's `job` (`Stage.job`) builds its transform from, before each claim: the
    store, the pipeline config loaded when the task started, and the lookup tables (`lookups()`,
    read on demand — a stage that maps with none never reads them; a task passes its cache)."""

    store: Store
    config: PipelineConfig
    read_lookups: Callable[[Store], dict[str, dict[str, str]]] = lookup_tables.load_all

    def lookups(self) -> dict[str, dict[str, str]]:
        return self.read_lookups(self.store)


def stage_job(stage: Stage) -> Callable[[StageContext], Transform]:
    """The function `stage.job` names (`module:function`), imported now."""
    module, _, name = stage.job.partition(":")
    if not module or not name:
        raise ValueError(f"stage {stage.name}: job {stage.job!r} is not `module:function`")
    job: Callable[[StageContext], Transform] = getattr(importlib.import_module(module), name)
    return job


def run_stage_job(
    stage: Stage,
    store: Store,
    spark: SparkSession,
    *,
    transform: Transform,
    owner: str,
    epoch: int,
    run_id: str,
    batch_size: int = 10_000,
    lease_seconds: float | None = None,
    alongside: Callable[[list[int]], Future[Any]] | None = None,
    plans: KeptPlans | None = None,
    **finalize_args: Any,
) -> Any:
    """One run of `stage`: claim up to `batch_size` due rows, read them, `transform` them, land the
    result and finalize it fenced by `epoch` (module docstring); the stage's outcome.

    `alongside`, given the claimed ids, starts work that runs while Spark does (the route's key
    indexer, `include.store.keys.index_alongside`); the finalize waits for it, and so does a failed
    run before it hands its claim back.

    `owner` must be unique per run: the read selects the claimed rows by it (or, with `plans`, by
    the task's owner prefix it starts with). `finalize_args` go to the stage's finalize (e.g.
    `passthrough`). A StaleEpoch propagates untouched: the finalize
    already dropped the landing rows, and the claim belongs to the new leader's recovery.
    """
    if stage.landing is None:
        raise ValueError(f"stage {stage.name} lands nothing: it runs its own job")
    claimed_ids = claim(store, stage, owner=owner, epoch=epoch, batch_size=batch_size, lease_seconds=lease_seconds)
    if not claimed_ids:
        return stage.outcome(run_id=run_id)
    small = is_small(claimed_ids)
    side: Future[Any] | None = None
    try:
        side = alongside(claimed_ids) if alongside is not None else None
        land(
            store,
            landing_frame(
                store, spark, stage, transform, owner=owner, epoch=epoch, run_id=run_id, ids=claimed_ids, plans=plans
            ),
            stage.landing,
            small=small,
        )
        if side is not None:
            side.result()
        outcome = finalize(
            store, stage, run_id=run_id, owner=owner, epoch=epoch, claimed_ids=claimed_ids, **finalize_args
        )
    except StaleEpoch:
        raise
    except BaseException as exc:
        if side is not None:
            wait([side])
        discard_quietly(store, stage.landing, run_id)
        release_quietly(store, stage.input, claimed_ids, owner=owner, epoch=epoch, error=exc)
        raise
    log.info(
        "%s run %s: %s",
        stage.name,
        run_id,
        ", ".join(f"{key} {len(value)}" for key, value in vars(outcome).items() if isinstance(value, tuple)),
    )
    return outcome


def claim(
    store: Store, stage: Stage, *, owner: str, epoch: int, batch_size: int, lease_seconds: float | None = None
) -> list[int]:
    """Claim up to `batch_size` due rows of the stage's input for `owner`, in lane order; their ids."""
    with store.transaction() as tx:
        rows = claim_batch(tx, stage.input, owner=owner, epoch=epoch, limit=batch_size, lease_seconds=lease_seconds)
    return [int(r["id"]) for r in rows]


def is_small(claimed_ids: Sequence[int]) -> bool:
    """Whether a claim takes the small-batch path (module docstring)."""
    return len(claimed_ids) <= SMALL_BATCH_ROWS


def read_claimed(
    store: Store,
    spark: SparkSession,
    stage: Stage,
    *,
    owner: str,
    epoch: int,
    small: bool = False,
    ids: Sequence[int] = (),
    rows_per_partition: int = READ_PARTITION_ROWS,
    max_partitions: int = READ_PARTITIONS,
) -> DataFrame:
    """The rows `owner` claimed under `epoch`, via the stage's read-only query, as `stage.schema`.

    `small`: the rows are read here and sent to Spark as a local frame.
    """
    if small:
        with store.transaction(write=False) as tx:
            found = tx.all(stage.read_query, {"owner": owner, "epoch": int(epoch)})
        return spark.createDataFrame([tuple(r[c] for c in stage.columns) for r in found], stage.schema)
    ranges = id_ranges(ids, rows=rows_per_partition, most=max_partitions) if ids else []
    query = stage.read_sql(store, owner=owner, epoch=epoch)
    return _jdbc_read(store, spark, stage, query, [f"id BETWEEN {lo} AND {hi}" for lo, hi in ranges])


def _jdbc_read(store: Store, spark: SparkSession, stage: Stage, query: str, predicates: list[str]) -> DataFrame:
    """`query` over JDBC as `stage.schema`: one partition (own connection, own query) per predicate,
    so the transform and the landing write run on as many cores as there are predicates; with fewer
    than two, one plain read."""
    options = {**jdbc_options(store.config), "customSchema": stage.schema, "fetchsize": "1000"}
    if len(predicates) < 2:
        return spark.read.format("jdbc").options(**options).option("query", query).load()
    return spark.read.jdbc(options["url"], f"({query}) claimed", predicates=predicates, properties=options)


def landing_frame(
    store: Store,
    spark: SparkSession,
    stage: Stage,
    transform: Transform,
    *,
    owner: str,
    epoch: int,
    run_id: str,
    ids: Sequence[int],
    plans: KeptPlans | None = None,
) -> DataFrame:
    """The landing rows of the batch `owner` claimed (`ids`): `transform` over its rows, from the
    task's kept plan when `plans` has one for it (module docstring), else built for this batch."""
    small = is_small(ids)
    if plans is not None and not small:
        kept = plans.frame(store, spark, stage, transform, owner=owner, epoch=epoch)
        if kept is not None:
            return kept.withColumn("run_id", F.lit(run_id))
    claimed = read_claimed(store, spark, stage, owner=owner, epoch=epoch, small=small, ids=ids)
    return transform(claimed, run_id=run_id)


KEPT_RUN_ID = "kept-plan"
"""The run id a kept landing frame is built with; each batch puts its own on top (`landing_frame`)."""


class KeptPlans:
    """A stage task's landing frames, kept across its micro-batches so the Spark Connect server
    analyses each plan once per task instead of once per batch (module docstring).

    `prefix`: what every batch owner of the task starts with (`include.stage_loop.claim_owner` of
    `<run>#<try>.`); its batches run one at a time, so the rows in flight under it are the batch's.
    A frame is kept per stage, session and epoch, for the transform it was built with: a batch whose
    transform differs (the lookups changed) builds and keeps a new one. Its read has READ_PARTITIONS
    partitions whatever the batch's size (one plan for every size, so every batch finds it).
    """

    def __init__(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("a kept plan needs the task's owner prefix")
        self.prefix = prefix
        self._kept: dict[tuple[Any, ...], tuple[Any, DataFrame]] = {}
        self.built = 0

    def frame(
        self,
        store: Store,
        spark: SparkSession,
        stage: Stage,
        transform: Transform,
        *,
        owner: str,
        epoch: int,
    ) -> DataFrame | None:
        """The kept landing frame for this batch (built and analysed now if there is none yet), or
        None when the batch cannot use one: the stage has no task read, or `owner` is not the task's."""
        if not stage.read_task_query or stage.landing is None or not owner.startswith(self.prefix):
            return None
        key = (stage.name, id(spark), int(epoch))
        made = _made_of(transform)
        found = self._kept.get(key)
        if found is not None and found[0] == made:
            return found[1]
        claimed = read_task(store, spark, stage, prefix=self.prefix, epoch=epoch, parts=READ_PARTITIONS)
        frame = transform(claimed, run_id=KEPT_RUN_ID).select(*stage.landing.columns)
        frame.schema  # noqa: B018  one AnalyzePlan: the server caches the analysed plan under this frame
        # the stage's frames under an older epoch or a lost session go
        self._kept = {k: v for k, v in self._kept.items() if k[0] != key[0]}
        self._kept[key] = (made, frame)
        self.built += 1
        return frame


def _made_of(transform: Transform) -> Any:
    """What a transform is built from, to compare two of them (a `functools.partial` made afresh
    for every batch by the stage's `bind` is equal when its function and arguments are)."""
    if isinstance(transform, partial):
        return (transform.func, transform.args, sorted(transform.keywords.items()))
    return transform


def read_task(store: Store, spark: SparkSession, stage: Stage, *, prefix: str, epoch: int, parts: int) -> DataFrame:
    """The rows in flight under `epoch` whose owner starts with `prefix`, over JDBC as `stage.schema`,
    in `parts` partitions by `id % parts`: a read whose plan is the same for every batch of a task."""
    query = stage.read_task_sql(store, prefix=prefix, epoch=epoch)
    return _jdbc_read(store, spark, stage, query, [f"id % {parts} = {k}" for k in range(parts)])


def id_ranges(
    ids: Sequence[int], *, rows: int = READ_PARTITION_ROWS, most: int = READ_PARTITIONS
) -> list[tuple[int, int]]:
    """Split claimed ids into at most `most` contiguous ranges of at least `rows` ids each (as even
    as the ids allow): disjoint, and together they hold every id."""
    ordered = sorted(int(i) for i in ids)
    parts = max(1, min(most, len(ordered) // max(rows, 1)))
    bounds = [len(ordered) * k // parts for k in range(parts + 1)]
    return [(ordered[a], ordered[b - 1]) for a, b in zip(bounds, bounds[1:]) if b > a]


def land(
    store: Store, frame: DataFrame, landing: Landing, *, batch_rows: int = WRITE_BATCH_ROWS, small: bool = False
) -> None:
    """Append `frame` to the landing table over JDBC, or (`small`) collect it and insert it here.

    SQLite admits one writer at a time, so it gets one writing connection; a server database gets
    one per partition.
    """
    if small:
        landed = [dict(zip(landing.columns, r)) for r in frame.select(*landing.columns).collect()]
        if landed:
            with store.transaction() as tx:
                tx.execute(f"{landing.table}_insert", {"rows": json.dumps(landed)})
        return
    writer = (
        frame.select(*landing.columns)
        .write.format("jdbc")
        .options(**jdbc_options(store.config))
        .option("dbtable", landing.table)
        .option("batchsize", str(batch_rows))
        .mode("append")
    )
    if store.backend == "sqlite":
        writer = writer.option("numPartitions", "1")
    started = time.perf_counter()
    writer.save()
    if store.backend == "sqlite":  # the JVM's transaction held SQLite's one write lock (its upper bound)
        store.note_hold(time.perf_counter() - started)


def finalize(store: Store, stage: Stage, *, run_id: str, **finalize_args: Any) -> Any:
    """The stage's fenced finalize in one transaction; under a stale epoch drop the run's landing
    rows (nothing of it may land) and re-raise."""
    try:
        with store.transaction() as tx:
            return stage.finish(tx, run_id=run_id, **finalize_args)
    except StaleEpoch:
        if stage.landing is not None:
            stage.landing.discard(store, run_id)
        raise


def release_quietly(
    store: Store, table: StagedTable, ids: list[int], *, owner: str, epoch: int, error: BaseException
) -> None:
    """After a failed run, hand its claimed rows back at once (best effort) instead of leaving them
    in flight — holding their lanes — until the sweep: due again now, the failure in `last_error`
    and an `attempt_failed` event; after SWEEP_MAX_ATTEMPTS claims `dead`, as the sweep would.
    A database that is briefly gone (a restart) is waited for (`with_retries`). Fenced like every
    write: under a stale epoch it changes nothing."""
    detail = f"stage run failed: {type(error).__name__}: {error}"[:400]

    def hand_back() -> None:
        with store.transaction() as tx:
            fail_batch(
                tx,
                table,
                ids,
                owner=owner,
                epoch=epoch,
                error=detail,
                max_attempts=SWEEP_MAX_ATTEMPTS,
                backoff_seconds=0.0,
                max_backoff_seconds=0.0,
            )

    with_retries(hand_back, what=f"hand back {len(ids)} claimed rows of {table.name}")


def discard_quietly(store: Store, landing: Landing, run_id: str) -> None:
    """Best effort: the original error matters more, and the next finalize of these rows cleans up."""
    try:
        landing.discard(store, run_id)
    except Exception:
        log.warning("run %s: could not drop its rows from %s", run_id, landing.table, exc_info=True)
