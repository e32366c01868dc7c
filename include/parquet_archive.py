"""Reading the Parquet archive (`[retention] archive_path`, written by `spark_jobs/archive_job.py`)
without Spark: `stageline messages show` finds a message there once it left the archive tables.

pyarrow datasets with a filter on the key columns, so only the matching row groups are read; the
rows come back shaped like the `archived_*` queries of `archive.sql` (times in epoch ms, an
`archived_ms`), so the operator code merges them like the archive tables' rows.
"""
from __future__ import annotations

from typing import Any

PARTITIONS = ("day", "connection", "batch")
RENAMED = {"created_at": "created_ms", "updated_at": "updated_ms", "archived_at": "archived_ms", "at": "at_ms"}


class ParquetArchive:
    """The Parquet archive under `path` (a directory, or a URI pyarrow's filesystems know)."""

    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/")

    def inbound(self, ref: str | int) -> dict[str, Any] | None:
        """The newest archived inbound row with this row id, message id or control id."""
        import pyarrow.dataset as ds

        text = str(ref)
        condition = (ds.field("message_id") == text) | (ds.field("control_id") == text)
        if text.isdigit():
            condition = condition | (ds.field("id") == int(text))
        found = self._rows("inbound", condition)
        return max(found, key=lambda r: r["id"]) if found else None

    def routed(self, inbound_id: int) -> list[dict[str, Any]]:
        import pyarrow.dataset as ds

        return self._rows("routed", ds.field("source_id") == int(inbound_id), lease_owner=True)

    def outbound(self, inbound_id: int) -> list[dict[str, Any]]:
        import pyarrow.dataset as ds

        return self._rows("outbound", ds.field("source_id") == int(inbound_id), lease_owner=True)

    def trail(self, message_id: str) -> list[dict[str, Any]]:
        import pyarrow.dataset as ds

        return self._rows("events", ds.field("message_id") == message_id)

    def hl7_batch(self, batch_id: str) -> dict[str, Any] | None:
        import pyarrow.dataset as ds

        found = self._rows("batches", ds.field("batch_id") == batch_id)
        return found[0] if found else None

    def _rows(self, kind: str, condition: Any, *, lease_owner: bool = False) -> list[dict[str, Any]]:
        """Matching rows of one kind, newest export of each key once, ordered by key."""
        import pyarrow as pa
        import pyarrow.dataset as ds
        import pyarrow.fs as pafs

        location = f"{self.path}/{kind}"
        if "://" in location:
            filesystem, location = pafs.FileSystem.from_uri(location.replace("s3a://", "s3://", 1))
        else:
            filesystem = pafs.LocalFileSystem()
        if filesystem.get_file_info(location).type == pafs.FileType.NotFound:
            return []
        partitioning = ds.partitioning(pa.schema([(p, pa.string()) for p in PARTITIONS]), flavor="hive")
        dataset = ds.dataset(location, format="parquet", filesystem=filesystem, partitioning=partitioning)
        key = "batch_id" if kind == "batches" else "id"
        rows: dict[Any, dict[str, Any]] = {}
        for row in dataset.to_table(filter=condition).to_pylist():
            shaped = {RENAMED.get(k, k): v for k, v in row.items() if k not in ("day", "batch")}
            if lease_owner or kind == "inbound":
                shaped["lease_owner"] = None
            # A row exported twice (copied again into the archive after a change) shows its newest copy.
            if row[key] not in rows or (shaped.get("archived_ms") or 0) >= (rows[row[key]].get("archived_ms") or 0):
                rows[row[key]] = shaped
        return [rows[k] for k in sorted(rows)]
