"""The Parquet archive's lookup index (store v14, issue 23): `messages show` opens only the files
whose batches hold a message, and for a ref the archive does not hold, none at all.

Proof by sabotage: every Parquet file a lookup must not need is overwritten with garbage, so
opening one fails the lookup (the unindexed reader does fail on them). Real local Spark, real
SQLite and PostgreSQL stores. Also: an archive written before v14 is indexed once by the next run,
and a symlink planted in the archive tree stops the write (rows kept in the store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from include.store import Store, operator
from include.store.lease import acquire_permanent
from include.store.parquet_archive import INDEXED_MARK, ParquetArchive, partition_name
from spark_jobs import archive_job
from tests.dags.stores import execute, rows
from tests.spark_jobs.test_archive_job import ARCHIVES, HOLD, _archived, _count


def _parquet_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.parquet"))


def _spoil(files: list[Path]) -> None:
    for f in files:
        f.write_bytes(b"not parquet: opening this file fails the lookup")


def _needed(store: Store, root: Path, inbound_id: int, message_id: str) -> set[Path]:
    """The files the index names for one message, across the kinds."""
    with store.transaction(write=False) as tx:
        found = [("inbound", r) for r in tx.all("parquet_find_by_row", {"kind": "inbound", "id": inbound_id})]
        found += [
            (k, r) for k in ("routed", "outbound") for r in tx.all("parquet_find_by_row", {"kind": k, "id": inbound_id})
        ]
        found += [("events", r) for r in tx.all("parquet_find_by_text", {"kind": "events", "ref": message_id})]
    return {f for kind, r in found for f in (root / kind / r["part"]).glob("*.parquet")}


def test_a_message_is_read_from_its_own_files_and_an_unknown_ref_opens_none(spark, store, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    _archived(store, epoch)
    [inbound] = rows(store, "SELECT id, message_id FROM archive_inbound WHERE message_id = 'adt-1'")
    root = tmp_path / "parquet"
    archive_job.run(store, spark, epoch=epoch, path=str(root), older_than_seconds=HOLD, batch_size=2)
    assert _count(store, "archive_inbound") == 0
    files = _parquet_files(root)
    needed = _needed(store, root, inbound["id"], "adt-1")
    assert len(files) >= 10 and 0 < len(needed) < len(files)

    _spoil([f for f in files if f not in needed])
    parquet = ParquetArchive(str(root))
    story = operator.show(store, operator.resolve(store, "adt-1", parquet=parquet), parquet=parquet)
    assert story.inbound["message_id"] == "adt-1" and story.inbound["archived_ms"] > 0
    assert [r["destination"] for r in story.routed] == ["ehr"] and len(story.outbound) == 1
    assert story.trail and {e["message_id"] for e in story.trail} == {"adt-1"}

    _spoil(needed)  # now every file is garbage
    for ref in ("no-such-message", "999999999", "CTRL-NONE"):
        with pytest.raises(LookupError):
            operator.resolve(store, ref, parquet=parquet)
        assert ParquetArchive(str(root), store=store).inbound(ref) is None
    with pytest.raises(Exception):  # noqa: B017 - what the unindexed reader does: opens (every) file
        ParquetArchive(str(root)).inbound("no-such-message")


def test_an_archive_written_before_the_index_is_indexed_once_by_the_next_run(spark, store, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    _archived(store, epoch)
    root = tmp_path / "parquet"
    archive_job.run(store, spark, epoch=epoch, path=str(root), older_than_seconds=HOLD, batch_size=3)
    indexed = rows(store, "SELECT kind, count(*) AS n FROM parquet_index GROUP BY kind ORDER BY kind")
    execute(store, "DELETE FROM parquet_index")  # as a store upgraded to v14 over an older archive
    execute(store, "DELETE FROM parquet_partitions")
    (root / INDEXED_MARK).unlink()
    assert ParquetArchive(str(root), store=store).inbound("adt-1") is None

    archive_job.run(store, spark, epoch=epoch, path=str(root), older_than_seconds=HOLD)

    assert (root / INDEXED_MARK).exists()
    assert rows(store, "SELECT kind, count(*) AS n FROM parquet_index GROUP BY kind ORDER BY kind") == indexed
    assert ParquetArchive(str(root), store=store).inbound("adt-1")["message_id"] == "adt-1"
    archive_job.run(store, spark, epoch=epoch, path=str(root), older_than_seconds=HOLD)  # marked: not again
    assert rows(store, "SELECT kind, count(*) AS n FROM parquet_index GROUP BY kind ORDER BY kind") == indexed


def test_a_symlink_planted_in_the_archive_tree_stops_the_write(spark, store, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    before = _archived(store, epoch)
    root, elsewhere = tmp_path / "parquet", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "routed").symlink_to(elsewhere)  # routed is the first kind exported

    with pytest.raises(archive_job.UnsafeArchive, match="symlink"):
        archive_job.run(store, spark, epoch=epoch, path=str(root), older_than_seconds=HOLD)

    assert list(elsewhere.iterdir()) == []
    assert {table: _count(store, table) for table in ARCHIVES} == before


def test_partition_directories_are_named_as_spark_names_them(spark, tmp_path):
    frame = spark.createDataFrame(
        [("2026-11-27", "odd:name/x=1", "b1", 1)], "day STRING, connection STRING, batch STRING, v INT"
    )
    frame.write.partitionBy("day", "connection", "batch").parquet(str(tmp_path / "k"))
    [written] = [p.relative_to(tmp_path / "k").parent.as_posix() for p in (tmp_path / "k").rglob("*.parquet")]
    assert written == "/".join(
        [
            partition_name("day", "2026-11-27"),
            partition_name("connection", "odd:name/x=1"),
            partition_name("batch", "b1"),
        ]
    )
