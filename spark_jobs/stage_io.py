"""The store side every Spark stage job shares: claim, read the claimed rows, land, clean up.

    claim    one SQL statement outside Spark, in lane order (`claim_in_lane_order`): never inside a
             Spark read, whose schema probe would run it twice
    read     Spark JDBC read of exactly the rows the run claimed, bounded by owner + epoch (a named,
             read-only query with its parameters inlined), one partition: a batch is thousands
             of rows, not millions
    land     Spark JDBC append into the stage's landing table (it exists up front: Spark cannot
             create tables on SQLite); each partition in its own transaction
    discard  drop a failed run's landing rows, best effort
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from pyspark.sql import DataFrame, SparkSession

from include.spark import jdbc_options
from include.store import Store, StagedTable
from include.store.rowlease import claim_in_lane_order
from include.store.stages import discard_landing, inline_query

log = logging.getLogger(__name__)

WRITE_BATCH_ROWS = 2_000


def claim(store: Store, table: StagedTable, *, owner: str, epoch: int, batch_size: int,
          lease_seconds: float | None = None) -> list[int]:
    """Claim up to `batch_size` due rows of `table` for `owner`, in lane order; their ids."""
    with store.transaction() as tx:
        rows = claim_in_lane_order(tx, table, owner=owner, epoch=epoch, limit=batch_size, lease_seconds=lease_seconds)
    return [int(r["id"]) for r in rows]


def read_claimed(store: Store, spark: SparkSession, query_name: str, schema: str, *, owner: str,
                 epoch: int) -> DataFrame:
    """The rows `owner` claimed under `epoch`, via the read-only named query `query_name`.

    `schema` is a Spark customSchema: Spark would map SQLite's INTEGER to a 32-bit int, and the
    ids are 64-bit everywhere.
    """
    query = inline_query(store, query_name, {"owner": owner, "epoch": int(epoch)})
    return (spark.read.format("jdbc").options(**jdbc_options(store.config))
            .option("query", query).option("customSchema", schema).option("fetchsize", "1000")
            .load())


def land(store: Store, frame: DataFrame, table: str, columns: Sequence[str], *,
         batch_rows: int = WRITE_BATCH_ROWS) -> None:
    """Append `frame` to landing table `table` over JDBC.

    SQLite admits one writer at a time, so it gets one writing connection; a server database gets
    one per partition.
    """
    writer = (frame.select(*columns).write.format("jdbc").options(**jdbc_options(store.config))
              .option("dbtable", table).option("batchsize", str(batch_rows)).mode("append"))
    if store.backend == "sqlite":
        writer = writer.option("numPartitions", "1")
    writer.save()


def discard_quietly(store: Store, run_id: str, table: str) -> None:
    """Best effort: the original error matters more, and the next finalize of these rows cleans up."""
    try:
        discard_landing(store, run_id=run_id, table=table)
    except Exception:
        log.warning("run %s: could not drop its rows from %s", run_id, table, exc_info=True)
