"""Reading the Parquet archive (`[retention] archive_path`, written by `spark_jobs/archive_job.py`)
without Spark: `stageline messages show` finds a message there once it left the archive tables.

With the store's lookup index (store v14, `indexed(store)`): the index names the partition
directories whose batches hold the key — the message's row id, message id or control id, the
inbound id its routed and outbound rows came from, its events' message id — and only the Parquet
files in those directories are opened; a key the index does not hold opens no file at all. (An
archive written before store v14 has no index rows: `reindex` builds them once from the files.)
Without a store, every file of the kind is filtered, as before.

pyarrow datasets with a filter on the key columns, so only the matching row groups are read; the
rows come back shaped like the `archived_*` queries of `archive.sql` (times in epoch ms, an
`archived_ms`), so the operator code merges them like the archive tables' rows.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from include.store import Store

PARTITIONS = ("day", "connection", "batch")
RENAMED = {"created_at": "created_ms", "updated_at": "updated_ms", "archived_at": "archived_ms", "at": "at_ms"}
_ALL = None
"""`_rows`' `parts` when every file of the kind is to be read (no index)."""
INDEXED_MARK = "_stageline_indexed"
"""A file at the archive's root: every batch in it is in the store's lookup index (`reindex` ran)."""
_HIVE_ESCAPED = set("\"#%'*/:=?\\{[]^") | {chr(c) for c in range(1, 32)} | {chr(127)}


def partition_name(column: str, value: str | None) -> str:
    """The directory Spark names a partition value (Hive's escaping; null is its default partition)."""
    if value is None:
        return f"{column}=__HIVE_DEFAULT_PARTITION__"
    return f"{column}=" + "".join(f"%{ord(c):02X}" if c in _HIVE_ESCAPED else c for c in value)


def partition_dirs(batch: str, values: list[tuple[str | None, str | None]]) -> list[str]:
    """`day=…/connection=…/batch=…` of each (day, connection) a batch writes, sorted."""
    return sorted(
        {
            f"{partition_name('day', d)}/{partition_name('connection', c)}/{partition_name('batch', batch)}"
            for d, c in values
        }
    )


class ParquetArchive:
    """The Parquet archive under `path` (a directory, or a URI pyarrow's filesystems know)."""

    def __init__(self, path: str, *, store: Store | None = None) -> None:
        """`store`: the store holding the archive's lookup index; without it lookups read every file."""
        self.path = path.rstrip("/")
        self.store = store

    def indexed(self, store: Store) -> ParquetArchive:
        """The same archive, looked up through `store`'s index."""
        return self if self.store is store else ParquetArchive(self.path, store=store)

    def inbound(self, ref: str | int) -> dict[str, Any] | None:
        """The newest archived inbound row with this row id, message id or control id."""
        import pyarrow.dataset as ds

        text = str(ref)
        condition = (ds.field("message_id") == text) | (ds.field("control_id") == text)
        lookups: list[tuple[str, dict[str, Any]]] = [
            ("parquet_find_by_text", {"kind": "inbound", "ref": text}),
            ("parquet_find_by_control", {"ref": text}),
        ]
        if text.isdigit():
            condition = condition | (ds.field("id") == int(text))
            lookups.append(("parquet_find_by_row", {"kind": "inbound", "id": int(text)}))
        found = self._rows("inbound", condition, parts=self._parts(lookups))
        return max(found, key=lambda r: r["id"]) if found else None

    def routed(self, inbound_id: int) -> list[dict[str, Any]]:
        return self._from_source("routed", inbound_id)

    def outbound(self, inbound_id: int) -> list[dict[str, Any]]:
        return self._from_source("outbound", inbound_id)

    def _from_source(self, kind: str, inbound_id: int) -> list[dict[str, Any]]:
        """The archived `kind` rows made from inbound row `inbound_id` (their source_id)."""
        import pyarrow.dataset as ds

        return self._rows(
            kind,
            ds.field("source_id") == int(inbound_id),
            lease_owner=True,
            parts=self._parts([("parquet_find_by_row", {"kind": kind, "id": int(inbound_id)})]),
        )

    def trail(self, message_id: str) -> list[dict[str, Any]]:
        import pyarrow.dataset as ds

        return self._rows(
            "events",
            ds.field("message_id") == message_id,
            parts=self._parts([("parquet_find_by_text", {"kind": "events", "ref": message_id})]),
        )

    def hl7_batch(self, batch_id: str) -> dict[str, Any] | None:
        import pyarrow.dataset as ds

        found = self._rows(
            "batches",
            ds.field("batch_id") == batch_id,
            parts=self._parts([("parquet_find_by_text", {"kind": "batches", "ref": batch_id})]),
        )
        return found[0] if found else None

    def _parts(self, lookups: list[tuple[str, dict[str, Any]]]) -> list[str] | None:
        """The partition directories the index names for these lookups (None: no index, read all)."""
        if self.store is None:
            return _ALL
        parts: set[str] = set()
        with self.store.transaction(write=False) as tx:
            for name, params in lookups:
                parts.update(r["part"] for r in tx.all(name, params))
        return sorted(parts)

    def _rows(
        self, kind: str, condition: Any, *, lease_owner: bool = False, parts: list[str] | None = _ALL
    ) -> list[dict[str, Any]]:
        """Matching rows of one kind, newest export of each key once, ordered by key; only the files
        of `parts` (partition directories under the kind) when given."""
        import pyarrow as pa
        import pyarrow.dataset as ds

        if parts is not None and not parts:
            return []  # the index holds no such key: no file is opened
        filesystem, location = self._filesystem(kind)
        partitioning = ds.partitioning(pa.schema([(p, pa.string()) for p in PARTITIONS]), flavor="hive")
        if parts is None:
            if _missing(filesystem, location):
                return []
            dataset = ds.dataset(location, format="parquet", filesystem=filesystem, partitioning=partitioning)
        else:
            files = _files(filesystem, [f"{location}/{p}" for p in parts])
            if not files:
                return []
            dataset = ds.dataset(
                files, format="parquet", filesystem=filesystem, partitioning=partitioning, partition_base_dir=location
            )
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

    def _filesystem(self, kind: str) -> tuple[Any, str]:
        import pyarrow.fs as pafs

        location = f"{self.path}/{kind}"
        if "://" in location:
            filesystem, path = pafs.FileSystem.from_uri(location.replace("s3a://", "s3://", 1))
            return filesystem, path
        return pafs.LocalFileSystem(), location

    def ensure_indexed(self, *, epoch: int) -> dict[str, int] | None:
        """Index an archive written before store v14, once (then a mark file says so); what was indexed."""
        filesystem, root = self._filesystem("")
        root = root.rstrip("/")
        if not _missing(filesystem, f"{root}/{INDEXED_MARK}"):
            return None
        done = self.reindex(epoch=epoch)
        if "://" in self.path:
            filesystem.create_dir(root, recursive=True)
            with filesystem.open_output_stream(f"{root}/{INDEXED_MARK}") as out:
                out.write(b"every batch of this archive is in the store's parquet_index (store v14)\n")
        else:
            from include.safe_files import create_exclusive, open_dir

            fd = open_dir(root, create=True, mode=0o755)  # Spark (maybe another user) writes here next
            try:
                create_exclusive(
                    fd,
                    INDEXED_MARK,
                    b"every batch of this archive is in the store's parquet_index (store v14)\n",
                    mode=0o644,
                )
            except FileExistsError:
                pass
            finally:
                os.close(fd)
        return done

    def reindex(self, *, epoch: int) -> dict[str, int]:
        """Build the lookup index of an archive written before store v14 from its files (once; the
        batches already indexed are skipped); rows indexed per kind."""
        import pyarrow as pa
        import pyarrow.dataset as ds

        if self.store is None:
            raise ValueError("reindex needs the store (ParquetArchive(path, store=...))")
        keys = {
            "inbound": ("id", "message_id", "control_id"),
            "routed": ("source_id",),
            "outbound": ("source_id",),
            "events": ("message_id",),
            "batches": ("batch_id",),
        }
        done: dict[str, int] = {}
        partitioning = ds.partitioning(pa.schema([(p, pa.string()) for p in PARTITIONS]), flavor="hive")
        for kind, columns in keys.items():
            filesystem, location = self._filesystem(kind)
            done[kind] = 0
            if _missing(filesystem, location):
                continue
            dataset = ds.dataset(location, format="parquet", filesystem=filesystem, partitioning=partitioning)
            if not dataset.files:
                continue
            table = dataset.to_table(columns=[*columns, *PARTITIONS])
            by_batch: dict[str, dict[str, Any]] = {}
            for row in table.to_pylist():
                entry = by_batch.setdefault(row["batch"], {"parts": set(), "keys": set()})
                entry["parts"].add(_part_of(row))
                entry["keys"].add(tuple(row[c] for c in columns))
            for batch, entry in by_batch.items():  # one short transaction per batch: no long write lock
                with self.store.transaction() as tx:
                    tx.fence()
                    if tx.all("parquet_batch_indexed", {"batch": batch}):
                        continue
                    for part in sorted(entry["parts"]):
                        tx.execute(
                            "parquet_partition_add", {"batch": batch, "kind": kind, "part": part, "epoch": epoch}
                        )
                    for key in entry["keys"]:
                        row_key, text_key, control_id = _index_key(kind, key)
                        tx.execute(
                            "parquet_index_add",
                            {
                                "kind": kind,
                                "id": row_key,
                                "ref": text_key,
                                "control_id": control_id,
                                "batch": batch,
                                "epoch": epoch,
                            },
                        )
                        done[kind] += 1
        return done


def _index_key(kind: str, key: tuple[Any, ...]) -> tuple[int | None, str | None, str | None]:
    if kind == "inbound":
        return int(key[0]), key[1], key[2]
    if kind in ("routed", "outbound"):
        return int(key[0]), None, None
    return None, key[0], None


def _part_of(row: dict[str, Any]) -> str:
    return "/".join(partition_name(p, row[p]) for p in PARTITIONS)


def _missing(filesystem: Any, location: str) -> bool:
    import pyarrow.fs as pafs

    return bool(filesystem.get_file_info(location).type == pafs.FileType.NotFound)


def _files(filesystem: Any, directories: list[str]) -> list[str]:
    """The Parquet files directly in `directories` (Spark's `_SUCCESS`, `.crc` and the like left out);
    a directory gone since it was indexed holds none."""
    import pyarrow.fs as pafs

    files: list[str] = []
    for directory in directories:
        infos = filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        files.extend(
            i.path
            for i in infos
            if i.type == pafs.FileType.File
            and not i.base_name.startswith((".", "_"))
            and i.base_name.endswith(".parquet")
        )
    return sorted(files)
