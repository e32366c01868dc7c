"""The archive's last move: rows held in the `archive_*` tables longer than `[retention] archive_days`
go to a Parquet archive under `[retention] archive_path`, then leave the store.

    mark      one fenced transaction: up to `batch_size` rows of one archive table archived longer
              ago than the hold get the batch's name (`export_batch`), and the batch is recorded in
              `archive_exports` (state `marked`)
    extract   the batch's rows, read with the store's connection (a batch is thousands of rows),
              times as epoch milliseconds whatever the dialect, plus the connection each message
              came in on
    transform pure: the partition columns — `day` (UTC day of the row's creation / the event),
              `connection`, `batch`
    load      Parquet, partitioned `<kind>/day=…/connection=…/batch=…/`, overwriting exactly this
              batch's partitions (dynamic partition overwrite): writing a batch again replaces it
    verify    read the batch's partitions back and count them against the rows read; only then is
              the batch noted `written`, and in that same fenced transaction its lookup index
              recorded (store v14: the partition directories it wrote, the keys it holds), so
              `stageline messages show` opens only the files that hold a message, or none
    delete    the batch's rows from the archive table in bounded, fenced transactions; then the
              batch's record goes

A run killed anywhere resumes its open batches first (`archive_exports`): a `marked` batch is
written again over its own partitions (nothing twice), a `written` one only deleted (its Parquet
is verified; its rows are never written again, so a batch half-deleted loses nothing). A row an
archive query copies again (its hot row changed) loses its mark and goes in a later batch.
Every store write is fenced by the epoch: under a stale epoch nothing is marked or deleted.

A local archive is written only through real directories: the archive path, a kind's directory and
the batch's partition directories (and Spark's `_temporary`) are checked with `lstat` before the
write, and one that is a symlink stops the batch (`UnsafeArchive`; its rows stay in the store), so a
link planted in the archive tree cannot send rows, or Spark's overwrite, elsewhere.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from include.store import Store
from include.store.lease import read_lease
from include.store.parquet_archive import ParquetArchive, partition_dirs

log = logging.getLogger(__name__)

KINDS = ("routed", "outbound", "events", "batches", "inbound")
"""In export order: the inbound rows last, so the others still find their connection beside them."""
TABLES = {
    "inbound": "archive_inbound",
    "routed": "archive_routed",
    "outbound": "archive_outbound",
    "events": "archive_events",
    "batches": "archive_inbound_batches",
}
STATE_COLUMNS = ("lane_key", "status", "claim_epoch", "attempts", "created_at", "updated_at", "last_error")
"""What every staged row carries about its progress, in the three staged archive tables' order."""
COLUMNS: dict[str, tuple[str, ...]] = {
    "inbound": (
        "id",
        "message_id",
        "control_id",
        "connection",
        *STATE_COLUMNS,
        "charset",
        "payload",
        "batch_id",
        "batch_seq",
        "archived_at",
    ),
    "routed": (
        "id",
        "source_id",
        "message_id",
        "control_id",
        "destination",
        "route_name",
        *STATE_COLUMNS,
        "archived_at",
    ),
    "outbound": (
        "id",
        "source_id",
        "message_id",
        "control_id",
        "destination",
        "content_type",
        "idempotency_key",
        *STATE_COLUMNS,
        "payload",
        "archived_at",
    ),
    "events": (
        "id",
        "at",
        "stage",
        "row_id",
        "message_id",
        "control_id",
        "destination",
        "event",
        "from_status",
        "to_status",
        "epoch",
        "node_id",
        "attempt",
        "detail",
        "archived_at",
        "connection",
    ),
    "batches": (
        "batch_id",
        "connection",
        "fhs_control_id",
        "bhs_control_id",
        "declared_count",
        "message_count",
        "created_at",
        "archived_at",
    ),
}
"""The Parquet columns per kind (the archive table's, times in epoch milliseconds), then the partitions."""
LONGS = {
    "id",
    "source_id",
    "claim_epoch",
    "attempts",
    "created_at",
    "updated_at",
    "archived_at",
    "batch_seq",
    "at",
    "row_id",
    "epoch",
    "attempt",
    "declared_count",
    "message_count",
}
DAY_OF = {"events": "at"}
"""The column a row's `day` partition comes from (default `created_at`)."""
PARTITIONS = ("day", "connection", "batch")
UNKNOWN_CONNECTION = "unknown"
DAY_MS = 86_400_000


class ExportMismatch(RuntimeError):
    """Parquet does not hold what was written: the batch's rows stay in the store."""


class UnsafeArchive(RuntimeError):
    """A directory the batch would be written through is a symlink: the batch's rows stay in the store."""


INDEX_STATEMENT = {kind: f"parquet_index_{kind}" for kind in KINDS}
"""The statement that records a batch's keys in the lookup index (parquet_index.sql)."""


def schema(kind: str) -> str:
    """The Spark schema of a kind's extracted rows (DDL string)."""
    cols = [f"{c} {'BIGINT' if c in LONGS else 'STRING'}" for c in COLUMNS[kind]]
    return ", ".join(cols + ["export_connection STRING"])


def dataset(path: str, kind: str) -> str:
    return f"{path.rstrip('/')}/{kind}"


def run(
    store: Store,
    spark: SparkSession,
    *,
    epoch: int,
    path: str,
    older_than_seconds: float,
    batch_size: int = 5000,
    max_batches: int = 20,
) -> dict[str, int]:
    """Move archived rows older than `older_than_seconds` to Parquet under `path`; rows moved per kind.

    Open batches of an earlier run come first; then each kind, at most `max_batches` batches of
    `batch_size` rows (what is left waits for the next run).
    """
    moved = dict.fromkeys(KINDS, 0)
    if read_lease(store).epoch != epoch:  # a stale leader writes no Parquet (its store writes are fenced anyway)
        log.info("Parquet archive: epoch %s is not the lease's; nothing to do", epoch)
        return moved
    indexed = ParquetArchive(path, store=store).ensure_indexed(epoch=epoch)
    if indexed:
        log.info("Parquet archive %s written before store v14: lookup index built (%s)", path, indexed)
    for open_batch in _open_batches(store):
        moved[open_batch["kind"]] += export_batch(
            store,
            spark,
            epoch=epoch,
            path=path,
            kind=open_batch["kind"],
            batch=open_batch["batch"],
            state=open_batch["state"],
            batch_size=batch_size,
        )
    for kind in KINDS:
        for _ in range(max_batches):
            batch, marked = mark(store, epoch=epoch, kind=kind, older_than_seconds=older_than_seconds, limit=batch_size)
            if marked:
                moved[kind] += export_batch(
                    store, spark, epoch=epoch, path=path, kind=kind, batch=batch, state="marked", batch_size=batch_size
                )
            if marked < batch_size:
                break
    if any(moved.values()):
        log.info("Parquet archive under epoch %s: moved %s to %s", epoch, moved, path)
    return moved


def mark(store: Store, *, epoch: int, kind: str, older_than_seconds: float, limit: int) -> tuple[str, int]:
    """Mark the next batch of `kind` and record it, in one fenced transaction; (its name, its rows)."""
    batch = f"{kind}-e{epoch}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
    with store.transaction() as tx:
        tx.fence()
        marked = len(
            tx.all(
                f"export_mark_{kind}",
                {"batch": batch, "epoch": epoch, "limit": int(limit), "ms": int(older_than_seconds * 1000)},
            )
        )
        if marked:
            tx.execute("export_open", {"batch": batch, "kind": kind, "row_count": marked, "epoch": epoch})
    return batch, marked


def export_batch(
    store: Store,
    spark: SparkSession,
    *,
    epoch: int,
    path: str,
    kind: str,
    batch: str,
    state: str,
    batch_size: int = 5000,
) -> int:
    """Write (unless `written`), verify, delete and close one batch; the rows deleted from the store."""
    if state == "marked":
        rows = extract(store, kind=kind, batch=batch)
        parts: list[str] = []
        if rows:
            framed = transform(spark.createDataFrame(rows, schema(kind)), kind=kind, batch=batch)
            parts = partition_dirs(
                batch, [(r["day"], r["connection"]) for r in framed.select("day", "connection").distinct().collect()]
            )
            check_no_links(path, kind, parts)
            load(framed, path=path, kind=kind)
            keys = [r[0] for r in rows]  # the key is the first column of every kind
            found = verify(spark, path=path, kind=kind, batch=batch, keys=keys)
            if found != len(rows):
                raise ExportMismatch(
                    f"Parquet batch {batch} holds {found} of its {len(rows)} row(s): kept in the store"
                )
        mark_written(store, epoch=epoch, batch=batch, kind=kind, parts=parts)
    deleted = delete(store, epoch=epoch, kind=kind, batch=batch, limit=batch_size)
    with store.transaction() as tx:
        tx.fence()
        tx.execute("export_close", {"batch": batch, "epoch": epoch})
    return deleted


def extract(store: Store, *, kind: str, batch: str) -> list[tuple[Any, ...]]:
    """The batch's rows as tuples in `schema(kind)` order: times as epoch ms in every dialect."""
    with store.transaction(write=False) as tx:
        rows = tx.all(f"export_read_{kind}", {"batch": batch})
    return [tuple(_plain(r.get(c)) for c in (*COLUMNS[kind], "export_connection")) for r in rows]


def transform(frame: DataFrame, *, kind: str, batch: str) -> DataFrame:
    """Add the partition columns (pure): `day` (UTC, yyyy-MM-dd), `connection` (of the message), `batch`."""
    day_ms = F.col(DAY_OF.get(kind, "created_at"))
    day = F.date_format(F.date_add(F.to_date(F.lit("1970-01-01")), F.floor(day_ms / DAY_MS).cast("int")), "yyyy-MM-dd")
    known = [F.col("connection")] if "connection" in COLUMNS[kind] else []  # the row's own, when it has one
    return (
        frame.withColumn("day", day)
        .withColumn("connection", F.coalesce(*known, F.col("export_connection"), F.lit(UNKNOWN_CONNECTION)))
        .withColumn("batch", F.lit(batch))
        .drop("export_connection")
    )


def load(frame: DataFrame, *, path: str, kind: str) -> None:
    """Write the batch, replacing exactly its own partitions (a batch written twice is there once)."""
    (
        frame.write.mode("overwrite")
        .option("partitionOverwriteMode", "dynamic")
        .partitionBy(*PARTITIONS)
        .parquet(dataset(path, kind))
    )


def verify(spark: SparkSession, *, path: str, kind: str, batch: str, keys: Sequence[Any]) -> int:
    """How many of `keys` Parquet holds exactly once in `batch`'s partitions, read back.

    Only the batch's own directories are read (a glob on `batch=`), not the whole archive. Counting
    the keys, not the files' rows, lets a batch rewritten after its rows changed pass even when an
    earlier partial write left a partition this write did not replace (its rows are older copies).
    """
    key = COLUMNS[kind][0]
    base = dataset(path, kind)
    frame = (
        spark.read.option("basePath", base)
        .parquet(f"{base}/day=*/connection=*/batch={batch}")
        .where(F.col(key).isin(list(keys)))
        .groupBy(key)
        .count()
    )
    return frame.where(F.col("count") == 1).count()


def mark_written(store: Store, *, epoch: int, batch: str, kind: str | None = None, parts: Sequence[str] = ()) -> None:
    """Note the batch written and, in the same fenced transaction, index it: the partition
    directories it wrote and the keys it holds (read from the archive table, its rows still there)."""
    with store.transaction() as tx:
        tx.fence()
        tx.execute("export_written", {"batch": batch, "epoch": epoch})
        if kind is not None and parts:
            for part in parts:
                tx.execute("parquet_partition_add", {"batch": batch, "kind": kind, "part": part, "epoch": epoch})
            tx.execute(INDEX_STATEMENT[kind], {"batch": batch, "epoch": epoch})


def check_no_links(path: str, kind: str, parts: Sequence[str]) -> None:
    """UnsafeArchive when a directory the batch is written through (local archives) is a symlink."""
    if "://" in path and not path.startswith("file:"):
        return  # object stores have no links
    base = Path(path.removeprefix("file://").removeprefix("file:"))
    candidates = [base, base / kind, base / kind / "_temporary"]
    for part in parts:
        here = base / kind
        for piece in part.split("/"):
            here = here / piece
            candidates.append(here)
    for candidate in candidates:
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeArchive(
                f"{candidate} is a symlink: the Parquet archive is written only through real "
                f"directories; batch kept in the store"
            )


def delete(store: Store, *, epoch: int, kind: str, batch: str, limit: int) -> int:
    """Delete the batch's rows from the archive table, `limit` per fenced transaction."""
    total = 0
    while True:
        with store.transaction() as tx:
            tx.fence()
            done = len(tx.all(f"export_delete_{kind}", {"batch": batch, "epoch": epoch, "limit": int(limit)}))
        total += done
        if done < limit:
            return total


def _open_batches(store: Store) -> Sequence[Mapping[str, Any]]:
    with store.transaction(write=False) as tx:
        return tx.all("export_open_batches")


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return int(value.timestamp() * 1000)
    if isinstance(value, Decimal):
        return int(value)
    return value
