"""Housekeeping under a leader's epoch (`include/housekeeping.py`) on real SQLite and PostgreSQL
stores, without Airflow: recovery once per epoch, the reclaim sweep, retention."""

from __future__ import annotations

import pytest

from include.housekeeping import reclaim, recover, retention
from include.store import INBOUND, OUTBOUND, ROUTED, Store
from include.store import rowlease as rl
from include.store.lease import acquire_permanent
from tests.dags.stores import age, execute, rows, seed_inbound, status_of

DAY = 86_400.0


# ---------------------------------------------------------------------------------------------
# recover


def test_recovery_repends_older_epoch_claims_once_per_epoch(store):
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 5)
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="solo:1:aa", epoch=e1, limit=3, lease_seconds=3600)
    e2 = acquire_permanent(store, node_id="solo:2:bb")  # the restart that fenced the first process
    with store.transaction() as tx:
        mine = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="solo:2:bb", epoch=e2, limit=1)]

    assert recover(store, e2, "solo:2:bb") == 3  # lease-blind: their row leases are live
    assert recover(store, e2, "solo:2:bb") is None  # once per epoch
    assert recover(store, e1, "solo:1:aa") is None  # a stale epoch cannot run it
    assert status_of(store) == {i: "in_flight" if i in mine else "pending" for i in ids}
    events = rows(store, "SELECT row_id, epoch, node_id FROM message_events WHERE event = 'recovered' ORDER BY row_id")
    assert events == [{"row_id": i, "epoch": e2, "node_id": "solo:2:bb"} for i in ids[:3]]


def test_recovery_after_the_epoch_ran_it_is_one_read_and_no_write(store, monkeypatch):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    assert recover(store, epoch, "solo:1:aa") == 0
    writes = []
    original = Store.transaction

    def spy(self, *, write=True):
        writes.append(write)
        return original(self, write=write)

    monkeypatch.setattr(Store, "transaction", spy)
    assert recover(store, epoch, "solo:1:aa") is None
    assert writes == [False]


# ---------------------------------------------------------------------------------------------
# reclaim


def test_reclaim_repends_expired_row_leases_in_bounded_batches(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 8)
    with store.transaction() as tx:
        expired = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=5, lease_seconds=0)]
        live = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=3, lease_seconds=3600)]

    assert reclaim(store, epoch, "solo:1:aa", limit=2, max_batches=1) == {
        "inbound": 2,
        "routed": 0,
        "outbound": 0,
    }  # the cap bounds one run's work
    assert reclaim(store, epoch, "solo:1:aa", limit=2) == {"inbound": 3, "routed": 0, "outbound": 0}
    assert status_of(store) == {i: "pending" if i in expired else "in_flight" for i in ids}
    assert set(live) == {i for i, s in status_of(store).items() if s == "in_flight"}
    events = rows(store, "SELECT row_id FROM message_events WHERE event = 'lease_expired' ORDER BY row_id")
    assert [e["row_id"] for e in events] == expired


def test_reclaim_under_a_stale_epoch_changes_nothing(store):
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    seed_inbound(store, 3)
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="w", epoch=e1, limit=3, lease_seconds=0)
    acquire_permanent(store, node_id="solo:2:bb")
    assert reclaim(store, e1, "solo:1:aa") == {"inbound": 0, "routed": 0, "outbound": 0}
    assert set(status_of(store).values()) == {"in_flight"}


# ---------------------------------------------------------------------------------------------
# retention


def _finish(store: Store, ids: list[int], status: str, *, epoch: int) -> None:
    with store.transaction() as tx:
        claimed = rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=len(ids))
        assert sorted(r["id"] for r in claimed) == sorted(ids)
        rl.finish_batch(tx, INBOUND, ids, owner="w", epoch=epoch, status=status)


def test_retention_purges_only_old_finished_rows_in_batches(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    done_old = seed_inbound(store, 5, prefix="done-old-")
    _finish(store, done_old, "done", epoch=epoch)
    unrouted_old = seed_inbound(store, 2, prefix="unrouted-old-")
    _finish(store, unrouted_old, "unrouted", epoch=epoch)
    dead_old = seed_inbound(store, 1, prefix="dead-old-")
    _finish(store, dead_old, "dead", epoch=epoch)
    done_new = seed_inbound(store, 2, prefix="done-new-")
    _finish(store, done_new, "done", epoch=epoch)
    in_flight_old = seed_inbound(store, 1, prefix="flight-old-")
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=1)
    pending_old = seed_inbound(store, 1, prefix="pending-old-")
    old = done_old + unrouted_old + dead_old + in_flight_old + pending_old
    age(store, "stage_inbound", "updated_at", f"id IN ({','.join(map(str, old))})", 8 * DAY)
    age(store, "message_events", "at", f"row_id IN ({','.join(map(str, done_old))}) AND stage = 'inbound'", 31 * DAY)
    events_before = rows(store, "SELECT count(*) AS n FROM message_events")[0]["n"]

    deleted = retention(store, epoch, {"inbound": 7 * DAY, "routed": 7 * DAY, "events": 30 * DAY}, batch=3)
    assert deleted == {"inbound": 8, "inbound_batches": 0, "routed": 0, "events": 5}
    assert sorted(status_of(store)) == sorted(done_new + in_flight_old + pending_old)
    assert rows(store, "SELECT count(*) AS n FROM message_events")[0]["n"] == events_before - 5


def test_retention_deletes_at_most_batch_times_max_batches_per_run(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 7)
    _finish(store, ids, "done", epoch=epoch)
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)
    assert retention(store, epoch, {"inbound": DAY}, batch=2, max_batches=2) == {"inbound": 4, "inbound_batches": 0}
    assert retention(store, epoch, {"inbound": DAY}, batch=2, max_batches=2) == {"inbound": 3, "inbound_batches": 0}
    assert status_of(store) == {}


def test_retention_purges_each_archived_batch_before_copying_the_next(store, monkeypatch):
    """Copy, purge, copy, purge ...: with every purge left to the end, each copy batch walked past
    all the rows and events the run had already copied (they stay hot until purged)."""
    import include.housekeeping as hk

    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 7)
    _finish(store, ids, "done", epoch=epoch)
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)
    age(store, "message_events", "at", "1 = 1", 2 * DAY)
    events = rows(store, "SELECT count(*) AS n FROM message_events")[0]["n"]
    calls: list[str] = []
    real = hk._purge
    monkeypatch.setattr(hk, "_purge", lambda s, query, **kw: calls.append(query) or real(s, query, **kw))

    archived: dict[str, int] = {}
    deleted = retention(store, epoch, {"inbound": DAY, "events": DAY}, batch=3, archived=archived)

    assert deleted == {"inbound": 7, "inbound_batches": 0, "events": events}
    assert archived["inbound"] == 7 and archived["events"] == events
    inbound_calls = [q for q in calls if q in ("archive_finished_inbound", "purge_finished_inbound")]
    assert inbound_calls == ["archive_finished_inbound", "purge_finished_inbound"] * 3  # 3 + 3 + 1 rows
    event_calls = [q for q in calls if q in ("archive_events", "purge_events")]
    assert event_calls == ["archive_events", "purge_events"] * (events // 3 + 1)
    assert status_of(store) == {}
    assert rows(store, "SELECT count(*) AS n FROM message_events")[0]["n"] == 0


def test_retention_keeps_an_inbound_body_its_open_routed_rows_read_and_deletes_bodies_with_rows(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    old, other = seed_inbound(store, 2)
    _finish(store, [old, other], "done", epoch=epoch)
    execute(
        store,
        f"INSERT INTO stage_routed (source_id, message_id, destination, status) VALUES ({old}, 'm0', 'ehr', 'pending')",
    )
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)
    # `old` stays: its routed row reads it
    assert retention(store, epoch, {"inbound": DAY}) == {"inbound": 1, "inbound_batches": 0}
    assert status_of(store) == {old: "done"}
    assert rows(store, "SELECT id FROM inbound_bodies") == [{"id": old}]
    execute(store, "UPDATE stage_routed SET status = 'done'")
    assert retention(store, epoch, {"inbound": DAY}) == {"inbound": 1, "inbound_batches": 0}
    assert rows(store, "SELECT count(*) AS n FROM inbound_bodies") == [{"n": 0}]


def test_retention_keeps_an_inbound_body_a_pass_through_outbound_row_sends_until_that_row_is_purged(store):
    """A pass-through outbound row has no body of its own: it sends its inbound row's, so that body
    outlives the inbound row's own retention until the outbound row is gone."""
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    shared, copied = seed_inbound(store, 2)
    _finish(store, [shared, copied], "done", epoch=epoch)
    execute(
        store,
        "INSERT INTO stage_outbound (source_id, message_id, destination, idempotency_key, status) "
        f"VALUES ({shared}, 'm0', 'archive', 'm0-archive', 'done'), "
        f"({copied}, 'm1', 'ehr', 'm1-ehr', 'done')",
    )
    execute(
        store,
        "INSERT INTO outbound_bodies (id, payload) SELECT id, 'rewritten' FROM stage_outbound "
        "WHERE destination = 'ehr'",
    )
    [inbound_body] = rows(store, f"SELECT payload FROM inbound_bodies WHERE id = {shared}")
    assert [r["payload"] for r in rows(store, "SELECT payload FROM outbound_messages ORDER BY id")] == [
        inbound_body["payload"],
        "rewritten",
    ]
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)

    # `shared` stays: its outbound row's body is its own
    assert retention(store, epoch, {"inbound": DAY}) == {"inbound": 1, "inbound_batches": 0}
    assert status_of(store) == {shared: "done"}
    assert rows(store, "SELECT id FROM inbound_bodies") == [{"id": shared}]

    age(store, "stage_outbound", "updated_at", "1 = 1", 2 * DAY)
    # a run purges downstream first: the outbound rows go (archived with the body they send), then
    # the inbound row they kept
    assert retention(store, epoch, {"inbound": DAY, "outbound": DAY}) == {
        "inbound": 1,
        "inbound_batches": 0,
        "outbound": 2,
    }
    assert [r["payload"] for r in rows(store, "SELECT payload FROM archive_outbound ORDER BY id")] == [
        inbound_body["payload"],
        "rewritten",
    ]
    assert status_of(store) == {}
    assert rows(store, "SELECT count(*) AS n FROM inbound_bodies") == [{"n": 0}]


def test_retention_purges_every_staged_table(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    [source] = seed_inbound(store, 1)
    execute(
        store,
        f"INSERT INTO stage_routed (source_id, message_id, destination, status) VALUES ({source}, 'm0', 'ehr', 'done')",
    )
    execute(
        store,
        "INSERT INTO stage_outbound (source_id, message_id, destination, idempotency_key, "
        "status) VALUES (1, 'm0', 'ehr', 'k1', 'dead')",
    )
    execute(store, "INSERT INTO outbound_bodies (id, payload) SELECT id, 'x' FROM stage_outbound")
    for table in (ROUTED, OUTBOUND):
        age(store, table.name, "updated_at", "1 = 1", 2 * DAY)
    assert retention(store, epoch, DAY) == {"inbound": 0, "inbound_batches": 0, "routed": 1, "outbound": 1, "events": 0}
    assert status_of(store) == {source: "pending"}
    assert rows(store, "SELECT count(*) AS n FROM outbound_bodies") == [{"n": 0}]  # gone with its row


def test_retention_under_a_stale_epoch_deletes_nothing(store):
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 2)
    _finish(store, ids, "done", epoch=e1)
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)
    acquire_permanent(store, node_id="solo:2:bb")
    assert retention(store, e1, DAY) == {"inbound": 0, "inbound_batches": 0, "routed": 0, "outbound": 0, "events": 0}
    assert len(status_of(store)) == 2


def test_retention_refuses_unknown_keys_and_negative_ages(store):
    with pytest.raises(ValueError, match="unknown retention key"):
        retention(store, 0, {"inbund": DAY})
    with pytest.raises(ValueError, match="negative"):
        retention(store, 0, {"inbound": -1.0})
