"""The Parquet archive job (spark_jobs/archive_job.py) with a real local Spark session on real SQLite
and PostgreSQL stores: archived rows past the hold are written to Parquet partitioned by day and
connection, counted back, then deleted from the archive tables; a run killed between the write and
the delete (or before the batch is noted written) re-runs to the same Parquet — nothing twice,
nothing lost; under a stale epoch nothing leaves the store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from include.housekeeping import retention
from include.store import Store
from include.store.lease import acquire_permanent
from spark_jobs import archive_job
from tests.dags.stores import age, execute, finished_messages, rows, write_service_config

DAY = 86_400.0
HOLD = 30 * DAY
ROOT = Path(__file__).resolve().parents[2]
ARCHIVES = ("archive_inbound", "archive_routed", "archive_outbound", "archive_events")


def _archived(store: Store, epoch: int) -> dict[str, int]:
    """Two adt-in and two lab-in messages, all the way through, archived, the archive 31 days old."""
    finished_messages(store, epoch, "adt-", "adt-in")
    finished_messages(store, epoch, "lab-", "lab-in")
    for table in ("stage_inbound", "stage_routed", "stage_outbound"):
        age(store, table, "updated_at", "1 = 1", 2 * DAY)
    age(store, "message_events", "at", "1 = 1", 2 * DAY)
    retention(store, epoch, DAY)
    for table in ARCHIVES:
        age(store, table, "archived_at", "1 = 1", HOLD + DAY)
    return {table: _count(store, table) for table in ARCHIVES}


def _count(store: Store, table: str) -> int:
    return rows(store, f"SELECT count(*) AS n FROM {table}")[0]["n"]


def _parquet(path: Path, kind: str) -> list[dict]:
    return ds.dataset(path / kind, format="parquet", partitioning="hive").to_table().to_pylist()


def test_archived_rows_past_the_hold_move_to_parquet_by_day_and_connection(spark, store, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    before = _archived(store, epoch)
    inbound = rows(store, "SELECT id, message_id, payload FROM archive_inbound ORDER BY id")

    moved = archive_job.run(store, spark, epoch=epoch, path=str(tmp_path), older_than_seconds=HOLD, batch_size=3)

    assert moved == {"inbound": 4, "routed": 4, "outbound": 4, "events": before["archive_events"], "batches": 0}
    for table in ARCHIVES:
        assert _count(store, table) == 0, table
    assert _count(store, "archive_exports") == 0
    got = _parquet(tmp_path, "inbound")
    assert sorted((r["id"], r["message_id"], r["payload"]) for r in got) == [
        (r["id"], r["message_id"], r["payload"]) for r in inbound
    ]
    assert {r["connection"] for r in got} == {"adt-in", "lab-in"}
    assert {(r["message_id"][:3], r["connection"]) for r in _parquet(tmp_path, "outbound")} == {
        ("adt", "adt-in"),
        ("lab", "lab-in"),
    }
    assert len(_parquet(tmp_path, "events")) == before["archive_events"]
    days = {p.name for p in (tmp_path / "inbound").iterdir() if p.is_dir()}
    assert len(days) == 1 and days.pop().startswith("day=20")
    assert {p.name for p in next((tmp_path / "inbound").iterdir()).iterdir()} == {
        "connection=adt-in",
        "connection=lab-in",
    }


def test_rows_inside_the_hold_stay_in_the_archive_tables(spark, store, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    before = _archived(store, epoch)

    moved = archive_job.run(store, spark, epoch=epoch, path=str(tmp_path), older_than_seconds=HOLD + 5 * DAY)

    assert not any(moved.values())
    assert {table: _count(store, table) for table in ARCHIVES} == before
    assert not (tmp_path / "inbound").exists()


@pytest.mark.parametrize("crash_at", ["delete", "mark_written"])
def test_a_run_killed_between_write_and_delete_reruns_to_the_same_parquet(
    spark, store, tmp_path, monkeypatch, crash_at
):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    before = _archived(store, epoch)
    real = getattr(archive_job, crash_at)

    def crash(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(archive_job, crash_at, crash)
    with pytest.raises(RuntimeError, match="killed"):
        archive_job.run(store, spark, epoch=epoch, path=str(tmp_path), older_than_seconds=HOLD)
    assert _count(store, "archive_routed") == before["archive_routed"]  # written, not deleted
    assert len(_parquet(tmp_path, "routed")) == before["archive_routed"]
    assert rows(store, "SELECT kind, state FROM archive_exports") == [
        {"kind": "routed", "state": "written" if crash_at == "delete" else "marked"}
    ]

    monkeypatch.setattr(archive_job, crash_at, real)
    archive_job.run(store, spark, epoch=epoch, path=str(tmp_path), older_than_seconds=HOLD)

    for table in ARCHIVES:
        assert _count(store, table) == 0, table
    assert _count(store, "archive_exports") == 0
    for kind, table in (
        ("routed", "archive_routed"),
        ("outbound", "archive_outbound"),
        ("inbound", "archive_inbound"),
        ("events", "archive_events"),
    ):
        ids = [r["id"] for r in _parquet(tmp_path, kind)]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == before[table], kind


def test_under_a_stale_epoch_nothing_leaves_the_store(spark, store, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    before = _archived(store, epoch)

    moved = archive_job.run(store, spark, epoch=epoch - 1, path=str(tmp_path / "parquet"), older_than_seconds=HOLD)

    assert not any(moved.values())
    assert {table: _count(store, table) for table in ARCHIVES} == before
    assert not (tmp_path / "parquet").exists()  # no Parquet written either
    with store.transaction() as tx:  # and the store's side is fenced on its own: a mark under it marks nothing
        assert tx.all("export_mark_inbound", {"batch": "x", "epoch": epoch - 1, "limit": 10, "ms": 0}) == []


def test_the_retention_task_takes_the_hold_and_path_from_the_service_config(
    spark, store, store_config, tmp_path, monkeypatch
):
    from stageline_airflow import tasks

    epoch = acquire_permanent(store, node_id="solo:1:aa")
    before = _archived(store, epoch)
    config = write_service_config(tmp_path, store_config, cluster=False)
    monkeypatch.setenv("STAGELINE_CONFIG", str(config))
    assert tasks.archive_parquet_step({"epoch": epoch, "owner": None}, spark=spark) is None  # no archive_path

    archive = tmp_path / "parquet"
    config.write_text(config.read_text() + f'\n[retention]\narchive_days = 30\narchive_path = "{archive}"\n')
    moved = tasks.archive_parquet_step({"epoch": epoch, "owner": None}, spark=spark)

    assert moved["inbound"] == before["archive_inbound"] == len(_parquet(archive, "inbound"))
    assert _count(store, "archive_inbound") == 0


def _show(config: Path, ref: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "include.app.cli", "--service-config", str(config), "messages", "show", ref, *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_stageline_messages_show_finds_a_message_moved_to_parquet(spark, store, store_config, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    _archived(store, epoch)
    trail = rows(store, "SELECT id, event FROM archive_events WHERE message_id = 'adt-1' ORDER BY id")
    [inbound] = rows(store, "SELECT id, control_id FROM archive_inbound WHERE message_id = 'adt-1'")
    archive = tmp_path / "parquet"
    archive_job.run(store, spark, epoch=epoch, path=str(archive), older_than_seconds=HOLD)
    assert _count(store, "archive_inbound") == 0
    config = write_service_config(tmp_path, store_config, cluster=False)
    without = _show(config, "adt-1")
    assert without.returncode != 0 and "no message 'adt-1'" in without.stderr  # no archive_path: not found
    config.write_text(config.read_text() + f'\n[retention]\narchive_path = "{archive}"\n')

    for ref in ("adt-1", str(inbound["id"])):
        proc = _show(config, ref, "--json", "--body")
        assert proc.returncode == 0, proc.stderr
        story = json.loads(proc.stdout)
        assert story["inbound"]["id"] == inbound["id"] and story["inbound"]["connection"] == "adt-in"
        assert story["inbound"]["payload"] == "MSH|^~\\&|A|B|C|D" and story["inbound"]["archived_ms"] > 0
        assert [(r["destination"], r["status"]) for r in story["routed"]] == [("ehr", "done")]
        assert [(o["idempotency_key"], o["status"]) for o in story["outbound"]] == [("adt-1-ehr", "done")]
        assert [(e["id"], e["event"]) for e in story["trail"] if e["event"] != "body_read"] == [
            (e["id"], e["event"]) for e in trail
        ]
    text = _show(config, "adt-1")
    assert text.returncode == 0, text.stderr
    assert "message adt-1" in text.stdout and "archived" in text.stdout.splitlines()[1]
    assert text.stdout.count("(archived)") == 2 + len(trail)


def test_a_batch_parquet_does_not_hold_stays_in_the_store(spark, store, tmp_path, monkeypatch):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    before = _archived(store, epoch)
    monkeypatch.setattr(archive_job, "verify", lambda *a, **k: 0)  # as if the write went nowhere

    with pytest.raises(archive_job.ExportMismatch):
        archive_job.run(store, spark, epoch=epoch, path=str(tmp_path), older_than_seconds=HOLD)

    assert {table: _count(store, table) for table in ARCHIVES} == before
    assert rows(store, "SELECT kind, state FROM archive_exports") == [{"kind": "routed", "state": "marked"}]


def test_events_keep_their_connection_after_their_inbound_rows_left_the_store(spark, store, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    before = _archived(store, epoch)
    execute(store, "DELETE FROM archive_inbound")  # gone to Parquet before its events (events_days > inbound_days)

    archive_job.run(store, spark, epoch=epoch, path=str(tmp_path), older_than_seconds=HOLD)

    events = _parquet(tmp_path, "events")
    assert len(events) == before["archive_events"]
    assert {(e["message_id"][:3], e["connection"]) for e in events} == {("adt", "adt-in"), ("lab", "lab-in")}
