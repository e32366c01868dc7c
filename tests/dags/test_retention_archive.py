"""Retention that archives (`include/housekeeping.py`, `archive.sql`) on real SQLite and PostgreSQL
stores: a finished message's rows, bodies and audit trail are copied to the archive tables before
they are purged; a run killed between the two steps re-runs to the same archive and purges; an
archived message's whole story is still read by `stageline messages show`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from include import housekeeping
from include.housekeeping import retention
from include.store import INBOUND, Store
from include.store import operator as ops
from include.store import rowlease as rl
from include.store.lease import acquire_permanent
from tests.conftest import CLUSTER
from tests.dags.stores import age, execute, finished_messages, rows, seed_inbound

DAY = 86_400.0
ROOT = Path(__file__).resolve().parents[2]
EVERYTHING = {"inbound": DAY, "routed": DAY, "outbound": DAY, "events": DAY}


def _history(store: Store, epoch: int, n: int = 3) -> list[int]:
    """`n` messages taken all the way: inbound done, one routed row and one delivered outbound row
    each (with its body), every transition an audit event; all of it two days old."""
    ids = finished_messages(store, epoch, "msg-", None, n)
    for table in ("stage_inbound", "stage_routed", "stage_outbound"):
        age(store, table, "updated_at", "1 = 1", 2 * DAY)
    age(store, "message_events", "at", "1 = 1", 2 * DAY)
    return ids


def _count(store: Store, table: str) -> int:
    return rows(store, f"SELECT count(*) AS n FROM {table}")[0]["n"]


def _archive_ids(store: Store, table: str) -> list[int]:
    return [r["id"] for r in rows(store, f"SELECT id FROM {table} ORDER BY id")]


def test_retention_archives_rows_bodies_and_events_then_purges_them(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = _history(store, epoch)
    events = rows(store, "SELECT id, message_id, event FROM message_events ORDER BY id")
    routed = _archive_ids(store, "stage_routed")
    outbound = _archive_ids(store, "stage_outbound")

    archived: dict[str, int] = {}
    deleted = retention(store, epoch, EVERYTHING, archived=archived)

    assert (
        deleted == archived == {"inbound": 3, "inbound_batches": 0, "routed": 3, "outbound": 3, "events": len(events)}
    )
    for hot in (
        "stage_inbound",
        "inbound_bodies",
        "stage_routed",
        "stage_outbound",
        "outbound_bodies",
        "message_events",
    ):
        assert _count(store, hot) == 0, hot
    assert _archive_ids(store, "archive_inbound") == ids
    assert _archive_ids(store, "archive_routed") == routed
    assert _archive_ids(store, "archive_outbound") == outbound
    assert rows(store, "SELECT id, message_id, event FROM archive_events ORDER BY id") == events
    assert rows(store, "SELECT id, payload FROM archive_inbound ORDER BY id") == [
        {"id": i, "payload": "MSH|^~\\&|A|B|C|D"} for i in ids
    ]
    assert rows(store, "SELECT payload FROM archive_outbound ORDER BY id") == [
        {"payload": f"MSH|^~\\&|OUT|msg-{i}"} for i in range(3)
    ]


def test_a_run_killed_between_archive_and_purge_reruns_to_the_same_archive_and_purges(store, monkeypatch):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    _history(store, epoch)
    real_purge = housekeeping._purge

    def killed_after_archiving(store_: Store, query: str, **kw):
        if query.startswith("purge_"):
            raise SystemExit("killed between archive and purge")
        return real_purge(store_, query, **kw)

    monkeypatch.setattr(housekeeping, "_purge", killed_after_archiving)
    with pytest.raises(SystemExit):
        retention(store, epoch, EVERYTHING)
    # downstream first: outbound archived, not purged
    assert _count(store, "archive_outbound") == 3 and _count(store, "stage_outbound") == 3
    snapshot = {
        t: rows(store, f"SELECT * FROM {t} ORDER BY id")
        for t in ("archive_inbound", "archive_routed", "archive_outbound", "archive_events")
    }
    assert snapshot["archive_routed"] == []  # the kill came at the first purge: later keys never ran
    assert snapshot["archive_inbound"] == []

    monkeypatch.setattr(housekeeping, "_purge", real_purge)
    archived: dict[str, int] = {}
    deleted = retention(store, epoch, EVERYTHING, archived=archived)
    events = _count(store, "archive_events")
    assert archived == {
        "inbound": 3,
        "inbound_batches": 0,
        "routed": 3,
        "outbound": 0,
        "events": events,
    }  # outbound: nothing again
    assert deleted == {"inbound": 3, "inbound_batches": 0, "routed": 3, "outbound": 3, "events": events}
    assert rows(store, "SELECT * FROM archive_outbound ORDER BY id") == snapshot["archive_outbound"]
    for table in ("archive_inbound", "archive_routed", "archive_outbound", "archive_events"):
        assert rows(store, f"SELECT count(*) AS n, count(DISTINCT id) AS d FROM {table}")[0] == {
            "n": 3 if table != "archive_events" else events,
            "d": 3 if table != "archive_events" else events,
        }
    assert retention(store, epoch, EVERYTHING) == {
        "inbound": 0,
        "inbound_batches": 0,
        "routed": 0,
        "outbound": 0,
        "events": 0,
    }


def test_a_row_changed_after_it_was_archived_is_not_purged_until_archived_again(store, monkeypatch):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    [dead] = seed_inbound(store, 1)
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=1)
        rl.finish_batch(tx, INBOUND, [dead], owner="w", epoch=epoch, status="dead")
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)
    real_purge = housekeeping._purge

    def requeued_in_between(store_: Store, query: str, **kw):
        if query == INBOUND.purge:  # an operator requeues the dead letter, it finishes again, still old
            ops.requeue(store_, INBOUND, [dead], actor="jdoe", reason="fixed")
            execute(store_, "UPDATE stage_inbound SET status = 'done', attempts = 7")
            age(store_, "stage_inbound", "updated_at", "1 = 1", DAY + 60)
        return real_purge(store_, query, **kw)

    monkeypatch.setattr(housekeeping, "_purge", requeued_in_between)
    assert retention(store, epoch, {"inbound": DAY}) == {"inbound": 0, "inbound_batches": 0}  # its copy is stale
    assert rows(store, "SELECT status FROM archive_inbound") == [{"status": "dead"}]
    monkeypatch.setattr(housekeeping, "_purge", real_purge)
    archived: dict[str, int] = {}
    assert retention(store, epoch, {"inbound": DAY}, archived=archived) == {"inbound": 1, "inbound_batches": 0}
    assert archived == {"inbound": 1, "inbound_batches": 0}
    assert rows(store, "SELECT id, status, attempts FROM archive_inbound") == [
        {"id": dead, "status": "done", "attempts": 7}
    ]


def test_retention_without_archive_copies_nothing(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    _history(store, epoch)
    assert retention(store, epoch, EVERYTHING, archive=False)["inbound"] == 3
    assert (
        sum(_count(store, t) for t in ("archive_inbound", "archive_routed", "archive_outbound", "archive_events")) == 0
    )


def test_archiving_under_a_stale_epoch_copies_nothing(store):
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    _history(store, e1)
    acquire_permanent(store, node_id="solo:2:bb")
    archived: dict[str, int] = {}
    nothing = {"inbound": 0, "inbound_batches": 0, "routed": 0, "outbound": 0, "events": 0}
    assert retention(store, e1, EVERYTHING, archived=archived) == nothing
    assert archived == nothing


def test_an_archived_message_reads_like_a_hot_one(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = _history(store, epoch)
    before = ops.show(store, ops.resolve(store, "c1"))
    retention(store, epoch, EVERYTHING)

    for ref in ("c1", "msg-1", str(ids[1])):
        assert ops.resolve(store, ref) == ids[1]
    after = ops.show(store, ids[1])
    assert after.inbound["archived_ms"] is not None
    strip = ("archived_ms", "lease_owner")
    same = lambda rs: [{k: v for k, v in r.items() if k not in strip} for r in rs]  # noqa: E731
    assert same([after.inbound]) == same([before.inbound])
    assert same(after.routed) == same(before.routed)
    assert same(after.outbound) == same(before.outbound)
    assert same(after.trail) == same(before.trail) and len(after.trail) == 3  # inbound, routed, outbound done
    with pytest.raises(LookupError):
        ops.resolve(store, "no-such-message")


def test_stageline_messages_show_prints_an_archived_message(store, store_config, tmp_path):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    _history(store, epoch)
    retention(store, epoch, EVERYTHING)
    cfg = tmp_path / "stageline.toml"
    if store_config.backend == "sqlite":
        cfg.write_text(f'[store]\npath = "{store_config.path}"\n[cluster]\ncluster_name = "{CLUSTER}"\n')
    else:
        c = store_config
        cfg.write_text(
            f'[store]\nbackend = "postgres"\nserver = "{c.server}"\nport = {c.port}\n'
            f'database = "{c.database}"\nusername = "{c.username}"\n'
            f'[cluster]\ncluster_name = "{CLUSTER}"\n'
        )
    proc = subprocess.run(
        [sys.executable, "-m", "include.app.cli", "--service-config", str(cfg), "messages", "show", "c2", "--body"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "message msg-2" in out and "archived" in out.splitlines()[1]
    assert "MSH|^~\\&|A|B|C|D" in out and "MSH|^~\\&|OUT|msg-2" in out  # both bodies, from the archive
    assert "routed row" in out and "outbound row" in out and out.count("(archived)") >= 5
