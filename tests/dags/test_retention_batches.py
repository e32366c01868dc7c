"""Retention of HL7 batches (`include/housekeeping.py`, `archive.sql`, migration 0008) on real SQLite
and PostgreSQL stores: a batch split at ingest keeps its record (`inbound_batches`) while any of its
messages' inbound rows is hot; then the record is archived with its FHS/BHS ids and counts and
purged. Archived messages keep `batch_id` / `batch_seq`, so each names its batch and the batch's
messages are found in the archive; a run killed between archive and purge re-runs to the same
archive; `stageline messages show` names the batch of a hot and of an archived message alike."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from include import housekeeping
from include.housekeeping import BATCHES, retention
from include.store import INBOUND, Store, queries
from include.store import operator as ops
from include.store import rowlease as rl
from include.store.lease import acquire_permanent
from include.store.migrate import migrate
from listeners.filedrop import file_message_id
from listeners.group_commit import InboundBatch
from listeners.validation import build_inbound
from tests.conftest import CLUSTER
from tests.dags.stores import age, execute, rows, seed_inbound, write_service_config

DAY = 86_400.0
ROOT = Path(__file__).resolve().parents[2]
NODE = "solo:1:aa"
KEEP = {"inbound": DAY}
# What the query in docs/store.md ("a batch's archived messages") reads.
ARCHIVED_MESSAGES_OF = (
    "SELECT a.batch_seq, a.control_id, a.message_id FROM archive_inbound a "
    "WHERE a.batch_id = '{batch_id}' ORDER BY a.batch_seq"
)
BATCH_COLUMNS = "batch_id, connection, fhs_control_id, bhs_control_id, declared_count, message_count"


def batch_file(n: int = 3) -> bytes:
    body = "".join(
        f"MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||ADT^A01|C{k}|P|2.5.1\rPID|1||P{k}\r" for k in range(1, n + 1)
    )
    return (
        f"FHS|^~\\&|HIS|HOSP|SL|SL|20240101120000||||FILE-7\rBHS|^~\\&|HIS|HOSP|SL|SL|20240101120000||||BATCH-7\r"
        f"{body}BTS|{n}\rFTS|1\r"
    ).encode()


def stage_batch(store: Store, epoch: int, n: int = 3) -> tuple[str, list[int]]:
    """Stage one HL7 batch of `n` messages as the listener does; its batch_id and inbound row ids."""
    data = batch_file(n)  # a file's message id: the same file read again is the same batch
    batch = build_inbound(
        data, connection="file-in", charset="utf-8", message_id=file_message_id("file-in", "adt.batch", data)
    )
    assert isinstance(batch, InboundBatch)
    with store.transaction() as tx:
        assert rl.stage_inbound(tx, batch.rows(), epoch=epoch, node_id=NODE) is not None
    ids = [
        r["id"]
        for r in rows(store, f"SELECT id FROM stage_inbound WHERE batch_id = '{batch.batch_id}' ORDER BY batch_seq")
    ]
    assert len(ids) == n
    return batch.batch_id, ids


def finish(store: Store, epoch: int, ids: list[int], *, days_ago: float = 2) -> None:
    """Claim and finish these inbound rows, then move them and their batch `days_ago` into the past."""
    with store.transaction() as tx:
        claimed = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=1000)]
        assert set(ids) <= set(claimed)
        rl.finish_batch(tx, INBOUND, ids, owner="w", epoch=epoch, status="unrouted")
        rest = sorted(set(claimed) - set(ids))
        if rest:  # back to pending: only `ids` finish here
            tx.conn.cursor().execute(
                "UPDATE stage_inbound SET status = 'pending', lease_owner = NULL, "
                f"lease_expires_at = NULL WHERE id IN ({', '.join(map(str, rest))})"
            )
    where = f"id IN ({', '.join(map(str, ids))})"
    age(store, "stage_inbound", "updated_at", where, days_ago * DAY)
    age(store, "inbound_batches", "created_at", "1 = 1", days_ago * DAY)


def _count(store: Store, table: str) -> int:
    return rows(store, f"SELECT count(*) AS n FROM {table}")[0]["n"]


def test_a_batch_is_archived_and_purged_once_none_of_its_messages_is_hot(store):
    epoch = acquire_permanent(store, node_id=NODE)
    batch_id, ids = stage_batch(store, epoch)
    batch_row = rows(store, f"SELECT {BATCH_COLUMNS} FROM inbound_batches")
    assert batch_row == [
        {
            "batch_id": batch_id,
            "connection": "file-in",
            "fhs_control_id": "FILE-7",
            "bhs_control_id": "BATCH-7",
            "declared_count": 3,
            "message_count": 3,
        }
    ]
    finish(store, epoch, ids[:2])  # the third message is still pending

    archived: dict[str, int] = {}
    assert retention(store, epoch, KEEP, archived=archived) == {"inbound": 2, BATCHES: 0}
    assert archived == {"inbound": 2, BATCHES: 0}
    assert rows(store, ARCHIVED_MESSAGES_OF.format(batch_id=batch_id)) == [
        {
            "batch_seq": 1,
            "control_id": "C1",
            "message_id": rows(store, f"SELECT message_id FROM archive_inbound WHERE id = {ids[0]}")[0]["message_id"],
        },
        {
            "batch_seq": 2,
            "control_id": "C2",
            "message_id": rows(store, f"SELECT message_id FROM archive_inbound WHERE id = {ids[1]}")[0]["message_id"],
        },
    ]
    assert _count(store, "inbound_batches") == 1 and _count(store, "archive_inbound_batches") == 0  # one is hot

    finish(store, epoch, ids[2:])
    archived = {}
    assert retention(store, epoch, KEEP, archived=archived) == {"inbound": 1, BATCHES: 1}
    assert archived == {"inbound": 1, BATCHES: 1}
    assert _count(store, "inbound_batches") == 0 and _count(store, "stage_inbound") == 0
    assert rows(store, f"SELECT {BATCH_COLUMNS} FROM archive_inbound_batches") == batch_row
    assert [(r["batch_seq"], r["control_id"]) for r in rows(store, ARCHIVED_MESSAGES_OF.format(batch_id=batch_id))] == [
        (1, "C1"),
        (2, "C2"),
        (3, "C3"),
    ]
    assert retention(store, epoch, KEEP) == {"inbound": 0, BATCHES: 0}


def test_a_batch_waits_for_its_inbound_rows_not_for_its_age_alone(store):
    """A young batch record stays however finished; a message outside any batch never touches one."""
    epoch = acquire_permanent(store, node_id=NODE)
    batch_id, ids = stage_batch(store, epoch)
    [single] = seed_inbound(store, 1, prefix="single-")
    finish(store, epoch, ids + [single], days_ago=0.5)  # finished, but younger than the retention
    assert retention(store, epoch, KEEP) == {"inbound": 0, BATCHES: 0}
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)  # the rows old, the batch record not
    assert retention(store, epoch, KEEP) == {"inbound": 4, BATCHES: 0}
    assert rows(store, "SELECT batch_id, batch_seq FROM archive_inbound WHERE message_id = 'single-0'") == [
        {"batch_id": None, "batch_seq": None}
    ]
    age(store, "inbound_batches", "created_at", "1 = 1", 2 * DAY)
    assert retention(store, epoch, KEEP) == {"inbound": 0, BATCHES: 1}
    assert rows(store, "SELECT batch_id FROM archive_inbound_batches") == [{"batch_id": batch_id}]


def test_a_run_killed_between_archiving_a_batch_and_purging_it_reruns_to_the_same_archive(store, monkeypatch):
    epoch = acquire_permanent(store, node_id=NODE)
    _batch_id, ids = stage_batch(store, epoch)
    finish(store, epoch, ids)
    real_purge = housekeeping._purge

    def killed_after_archiving(store_: Store, query: str, **kw):
        if query == "purge_inbound_batches":
            raise SystemExit("killed between archive and purge")
        return real_purge(store_, query, **kw)

    monkeypatch.setattr(housekeeping, "_purge", killed_after_archiving)
    with pytest.raises(SystemExit):
        retention(store, epoch, KEEP)
    assert _count(store, "archive_inbound_batches") == 1 and _count(store, "inbound_batches") == 1
    snapshot = rows(store, "SELECT * FROM archive_inbound_batches")

    monkeypatch.setattr(housekeeping, "_purge", real_purge)
    archived: dict[str, int] = {}
    assert retention(store, epoch, KEEP, archived=archived) == {"inbound": 0, BATCHES: 1}
    assert archived == {"inbound": 0, BATCHES: 0}  # nothing copied again
    assert rows(store, "SELECT * FROM archive_inbound_batches") == snapshot
    assert _count(store, "inbound_batches") == 0
    assert rows(store, "SELECT count(*) AS n, count(DISTINCT batch_id) AS d FROM archive_inbound_batches") == [
        {"n": 1, "d": 1}
    ]


def test_a_batch_staged_again_after_its_record_was_archived_is_purged_only_once_its_rows_are_gone(store):
    """The same file read again (a restart lost the move) stages the same batch_id: its record is
    hot again and waits for the new rows; the archive keeps its one copy."""
    epoch = acquire_permanent(store, node_id=NODE)
    batch_id, ids = stage_batch(store, epoch)
    finish(store, epoch, ids)
    assert retention(store, epoch, KEEP) == {"inbound": 3, BATCHES: 1}
    again, new_ids = stage_batch(store, epoch)
    assert again == batch_id and _count(store, "inbound_batches") == 1
    age(store, "inbound_batches", "created_at", "1 = 1", 2 * DAY)
    assert retention(store, epoch, KEEP) == {"inbound": 0, BATCHES: 0}  # its rows are pending
    finish(store, epoch, new_ids)
    assert retention(store, epoch, KEEP) == {"inbound": 3, BATCHES: 1}
    assert _count(store, "archive_inbound_batches") == 1 and _count(store, "inbound_batches") == 0


def test_retention_without_archive_purges_a_finished_batch_without_copying_it(store):
    epoch = acquire_permanent(store, node_id=NODE)
    _, ids = stage_batch(store, epoch)
    finish(store, epoch, ids)
    assert retention(store, epoch, KEEP, archive=False) == {"inbound": 3, BATCHES: 1}
    assert _count(store, "archive_inbound_batches") == 0 and _count(store, "archive_inbound") == 0


def test_batches_under_a_stale_epoch_are_left_alone(store):
    e1 = acquire_permanent(store, node_id=NODE)
    _, ids = stage_batch(store, e1)
    finish(store, e1, ids)
    execute(store, "DELETE FROM stage_inbound")  # as if its rows were purged already
    acquire_permanent(store, node_id="solo:2:bb")
    archived: dict[str, int] = {}
    assert retention(store, e1, KEEP, archived=archived) == {"inbound": 0, BATCHES: 0} == archived
    assert _count(store, "inbound_batches") == 1 and _count(store, "archive_inbound_batches") == 0


def test_an_archived_message_names_its_batch_as_a_hot_one_does(store, store_config, tmp_path):
    epoch = acquire_permanent(store, node_id=NODE)
    batch_id, ids = stage_batch(store, epoch)
    finish(store, epoch, ids)
    hot = ops.show(store, ops.resolve(store, "C2"))
    assert (hot.inbound["batch_id"], hot.inbound["batch_seq"]) == (batch_id, 2)
    assert hot.hl7_batch is not None and hot.hl7_batch["archived_ms"] is None
    cfg = write_service_config(tmp_path, store_config, cluster=False)

    def show_c2() -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "include.app.cli", "--service-config", str(cfg), "messages", "show", "C2"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        [line] = [x for x in proc.stdout.splitlines() if x.startswith("  in batch ")]
        return line

    named = f"  in batch {batch_id}: message 2 of 3 (declared 3), FHS FILE-7, BHS BATCH-7, received "
    hot_line = show_c2()
    assert hot_line.startswith(named) and "archived" not in hot_line

    assert retention(store, epoch, KEEP) == {"inbound": 3, BATCHES: 1}
    archived = ops.show(store, ops.resolve(store, "C2"))
    assert archived.inbound["archived_ms"] is not None
    assert (archived.inbound["batch_id"], archived.inbound["batch_seq"]) == (batch_id, 2)
    assert archived.hl7_batch is not None and archived.hl7_batch["archived_ms"] is not None
    assert {k: v for k, v in archived.hl7_batch.items() if k != "archived_ms"} == {
        k: v for k, v in hot.hl7_batch.items() if k != "archived_ms"
    }
    archived_line = show_c2()
    assert archived_line.startswith(hot_line) and "; archived " in archived_line


@pytest.fixture(params=["sqlite", "postgres"])
def store_at_7(request, tmp_path, monkeypatch):
    """A store migrated to version 7 only (before this migration), with its cluster identity."""
    from include.config import StoreConfig
    from tests.conftest import pg_config

    if request.param == "sqlite":
        config = StoreConfig(backend="sqlite", path=str(tmp_path / "v7.db"))
    else:
        pg_server = request.getfixturevalue("pg_server")
        name = f"v7_{uuid.uuid4().hex[:12]}"
        pg_server.execute(f"CREATE DATABASE {name}")
        request.addfinalizer(lambda: pg_server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        config = pg_config(pg_server, name)
    real = queries.migrations
    monkeypatch.setattr(queries, "migrations", lambda backend: real(backend)[:7])
    s = Store(config)
    migrate(s, cluster_name=CLUSTER)
    monkeypatch.setattr(queries, "migrations", real)
    yield s
    s.close()


LATER_STAGING_COLUMNS = ("findings", "format")
"""What versions 19 and 20 added to stage_inbound, which today's staging statement writes."""


def stage_batch_at_7(store: Store, epoch: int) -> tuple[str, list[int]]:
    """stage_batch on a version-7 store: today's staging statement, given the columns it writes for
    the moment of the insert only (the migrations after 7 add them for real)."""
    for column in LATER_STAGING_COLUMNS:
        execute(store, f"ALTER TABLE stage_inbound ADD COLUMN {column} TEXT")
    try:
        return stage_batch(store, epoch)
    finally:
        for column in LATER_STAGING_COLUMNS:
            execute(store, f"ALTER TABLE stage_inbound DROP COLUMN {column}")


def test_migration_8_gives_a_message_archived_under_version_7_its_batch_while_it_is_hot(store_at_7):
    store = store_at_7
    epoch = acquire_permanent(store, node_id=NODE)
    batch_id, ids = stage_batch_at_7(store, epoch)
    finish(store, epoch, ids)
    copied = "id, message_id, control_id, connection, status, attempts, created_at, updated_at"
    execute(store, f"INSERT INTO archive_inbound ({copied}) SELECT {copied} FROM stage_inbound")  # v7's copy
    execute(store, f"DELETE FROM stage_inbound WHERE id = {ids[0]}")  # purged under version 7

    assert migrate(store, cluster_name=CLUSTER).applied[0] == 8
    assert rows(store, "SELECT id, batch_id, batch_seq FROM archive_inbound ORDER BY id") == [
        {"id": ids[0], "batch_id": None, "batch_seq": None},  # its hot row was gone: nothing to take
        {"id": ids[1], "batch_id": batch_id, "batch_seq": 2},
        {"id": ids[2], "batch_id": batch_id, "batch_seq": 3},
    ]
    assert retention(store, epoch, KEEP) == {"inbound": 2, BATCHES: 1}  # the copies are current: purged
    assert rows(store, "SELECT batch_id FROM archive_inbound_batches") == [{"batch_id": batch_id}]
