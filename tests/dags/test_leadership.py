"""Leader gating and housekeeping (`include/leadership.py`) on real SQLite and PostgreSQL stores,
without Airflow: who may run a stage, recovery once per epoch, the reclaim sweep, retention."""
from __future__ import annotations

from pathlib import Path

import pytest

from include import leadership
from include.config import StoreConfig
from include.store import INBOUND, OUTBOUND, ROUTED, Store
from include.store import rowlease as rl
from include.store.lease import LeaderElector, acquire_permanent
from include.store.migrate import ClusterIdentityError
from tests.dags.stores import age, execute, rows, seed_inbound, status_of, write_service_config

DAY = 86_400.0


@pytest.fixture
def single(store_config: StoreConfig, tmp_path: Path) -> Path:
    return write_service_config(tmp_path, store_config, cluster=False)


@pytest.fixture
def clustered(pg_config_fresh: StoreConfig, tmp_path: Path) -> Path:
    return write_service_config(tmp_path, pg_config_fresh, cluster=True)


def elector(store: Store, node: str) -> LeaderElector:
    return LeaderElector(store, node_id=node, ttl_seconds=600, fence_timeout_seconds=300)


# ---------------------------------------------------------------------------------------------
# check_leadership


def test_single_node_proceeds_before_any_listener_ever_started(single):
    check = leadership.check_leadership(single)
    assert (check.proceed, check.epoch, check.owner) == (True, 0, None)
    assert "single node" in check.reason


def test_single_node_proceeds_with_the_current_permanent_epoch(single, store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    assert leadership.check_leadership(single).as_xcom() == {"epoch": epoch, "owner": "solo:1:aa"}


def test_single_node_proceeds_even_when_the_lease_row_has_expired(single, store):
    e = elector(store, "old-cluster-node")
    epoch = e.step().epoch
    e.release()
    check = leadership.check_leadership(single)
    assert (check.proceed, check.epoch) == (True, epoch)


def test_cluster_proceeds_under_a_live_leader_with_its_epoch(clustered, pg_config_fresh):
    store = Store(pg_config_fresh)
    try:
        result = elector(store, "node-a").step()
        check = leadership.check_leadership(clustered)
    finally:
        store.close()
    assert (check.proceed, check.epoch, check.owner) == (True, result.epoch, "node-a")
    assert "leader node-a" in check.reason


def test_cluster_does_not_proceed_when_the_lease_was_never_held(clustered):
    check = leadership.check_leadership(clustered)
    assert (check.proceed, check.epoch, check.owner) == (False, None, None)
    assert "never been held" in check.reason


def test_cluster_does_not_proceed_once_the_leader_lease_expired(clustered, pg_config_fresh):
    store = Store(pg_config_fresh)
    try:
        e = elector(store, "node-a")
        e.step()
        e.release()  # a clean stop expires the lease at once
    finally:
        store.close()
    check = leadership.check_leadership(clustered)
    assert (check.proceed, check.epoch) == (False, None)
    assert "node-a" in check.reason and "expired" in check.reason


def test_a_store_of_another_cluster_is_an_error_not_a_skip(store_config, tmp_path):
    path = write_service_config(tmp_path, store_config, cluster=False, cluster_name="someone-else")
    with pytest.raises(ClusterIdentityError, match="someone-else"):
        leadership.check_leadership(path)


def test_the_config_path_comes_from_stageline_config_when_not_given(single, monkeypatch):
    monkeypatch.setenv("STAGELINE_CONFIG", str(single))
    assert leadership.config_path() == single
    assert leadership.check_leadership().proceed


# ---------------------------------------------------------------------------------------------
# work_pending


def test_work_is_pending_only_while_a_row_is_due_under_the_current_epoch(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    assert leadership.work_pending(store, epoch, "inbound", require_live=False) is False
    [row] = seed_inbound(store, 1)
    assert leadership.work_pending(store, epoch, "inbound", require_live=False) is True
    assert leadership.work_pending(store, epoch, "routed", require_live=False) is False
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=1)
    assert leadership.work_pending(store, epoch, "inbound", require_live=False) is False  # claimed: in flight, not due
    with store.transaction() as tx:
        rl.fail_batch(tx, INBOUND, [row], owner="w", epoch=epoch, error="boom", max_attempts=5,
                      backoff_seconds=3600)
    assert leadership.work_pending(store, epoch, "inbound", require_live=False) is False  # backing off
    age(store, "stage_inbound", "next_attempt_at", f"id = {row}", 7200)
    assert leadership.work_pending(store, epoch, "inbound", require_live=False) is True  # backoff over: due again
    acquire_permanent(store, node_id="solo:2:bb")
    # leadership moved: stop waiting
    assert leadership.work_pending(store, epoch, "inbound", require_live=False) is None


def test_in_a_cluster_work_stops_being_pending_when_the_leader_lease_lapses(pg_config_fresh):
    store = Store(pg_config_fresh)
    try:
        leader = elector(store, "node-a")
        epoch = leader.step().epoch
        seed_inbound(store, 1)
        assert leadership.work_pending(store, epoch, "inbound", require_live=True) is True
        leader.release()  # same epoch, but nobody leads: wait no longer
        assert leadership.work_pending(store, epoch, "inbound", require_live=True) is None
        assert leadership.work_pending(store, epoch, "inbound", require_live=False) is True
    finally:
        store.close()


def test_work_pending_refuses_an_unknown_stage(store):
    with pytest.raises(ValueError, match="unknown stage"):
        leadership.work_pending(store, 0, "inbund", require_live=False)


# ---------------------------------------------------------------------------------------------
# recover


def test_recovery_repends_older_epoch_claims_once_per_epoch(single, store):
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 5)
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="solo:1:aa", epoch=e1, limit=3, lease_seconds=3600)
    e2 = acquire_permanent(store, node_id="solo:2:bb")  # the restart that fenced the first process
    with store.transaction() as tx:
        mine = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="solo:2:bb", epoch=e2, limit=1)]

    assert leadership.recover(single, e2, "solo:2:bb") == 3  # lease-blind: their row leases are live
    assert leadership.recover(single, e2, "solo:2:bb") is None  # once per epoch
    assert leadership.recover(single, e1, "solo:1:aa") is None  # a stale epoch cannot run it
    assert status_of(store) == {i: "in_flight" if i in mine else "pending" for i in ids}
    events = rows(store, "SELECT row_id, epoch, node_id FROM message_events WHERE event = 'recovered' ORDER BY row_id")
    assert events == [{"row_id": i, "epoch": e2, "node_id": "solo:2:bb"} for i in ids[:3]]


def test_recovery_after_the_epoch_ran_it_is_one_read_and_no_write(single, store, monkeypatch):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    assert leadership.recover(single, epoch, "solo:1:aa") == 0
    writes = []
    original = Store.transaction

    def spy(self, *, write=True):
        writes.append(write)
        return original(self, write=write)

    monkeypatch.setattr(Store, "transaction", spy)
    assert leadership.recover(single, epoch, "solo:1:aa") is None
    assert writes == [False]


# ---------------------------------------------------------------------------------------------
# reclaim


def test_reclaim_repends_expired_row_leases_in_bounded_batches(single, store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 8)
    with store.transaction() as tx:
        expired = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=5, lease_seconds=0)]
        live = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=3, lease_seconds=3600)]

    assert leadership.reclaim(single, epoch, "solo:1:aa", limit=2, max_batches=1) == \
        {"inbound": 2, "routed": 0, "outbound": 0}  # the cap bounds one run's work
    assert leadership.reclaim(single, epoch, "solo:1:aa", limit=2) == {"inbound": 3, "routed": 0, "outbound": 0}
    assert status_of(store) == {i: "pending" if i in expired else "in_flight" for i in ids}
    assert set(live) == {i for i, s in status_of(store).items() if s == "in_flight"}
    events = rows(store, "SELECT row_id FROM message_events WHERE event = 'lease_expired' ORDER BY row_id")
    assert [e["row_id"] for e in events] == expired


def test_reclaim_under_a_stale_epoch_changes_nothing(single, store):
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    seed_inbound(store, 3)
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="w", epoch=e1, limit=3, lease_seconds=0)
    acquire_permanent(store, node_id="solo:2:bb")
    assert leadership.reclaim(single, e1, "solo:1:aa") == {"inbound": 0, "routed": 0, "outbound": 0}
    assert set(status_of(store).values()) == {"in_flight"}


# ---------------------------------------------------------------------------------------------
# retention


def _finish(store: Store, ids: list[int], status: str, *, epoch: int) -> None:
    with store.transaction() as tx:
        claimed = rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=len(ids))
        assert sorted(r["id"] for r in claimed) == sorted(ids)
        rl.finish_batch(tx, INBOUND, ids, owner="w", epoch=epoch, status=status)


def test_retention_purges_only_old_finished_rows_in_batches(single, store):
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

    deleted = leadership.retention(single, epoch, {"inbound": 7 * DAY, "routed": 7 * DAY, "events": 30 * DAY},
                                   batch=3)
    assert deleted == {"inbound": 8, "routed": 0, "events": 5}
    assert sorted(status_of(store)) == sorted(done_new + in_flight_old + pending_old)
    assert rows(store, "SELECT count(*) AS n FROM message_events")[0]["n"] == events_before - 5


def test_retention_deletes_at_most_batch_times_max_batches_per_run(single, store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 7)
    _finish(store, ids, "done", epoch=epoch)
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)
    assert leadership.retention(single, epoch, {"inbound": DAY}, batch=2, max_batches=2) == {"inbound": 4}
    assert leadership.retention(single, epoch, {"inbound": DAY}, batch=2, max_batches=2) == {"inbound": 3}
    assert status_of(store) == {}


def test_retention_purges_every_staged_table(single, store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    [source] = seed_inbound(store, 1)
    execute(store, "INSERT INTO stage_routed (source_id, message_id, destination, status) "
                   f"VALUES ({source}, 'm0', 'ehr', 'done')")
    execute(store, "INSERT INTO stage_outbound (source_id, message_id, destination, idempotency_key, "
                   "status) VALUES (1, 'm0', 'ehr', 'k1', 'dead')")
    execute(store, "INSERT INTO outbound_bodies (id, payload) SELECT id, 'x' FROM stage_outbound")
    for table in (ROUTED, OUTBOUND):
        age(store, table.name, "updated_at", "1 = 1", 2 * DAY)
    assert leadership.retention(single, epoch, DAY) == {"inbound": 0, "routed": 1, "outbound": 1, "events": 0}
    assert status_of(store) == {source: "pending"}


def test_retention_under_a_stale_epoch_deletes_nothing(single, store):
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    ids = seed_inbound(store, 2)
    _finish(store, ids, "done", epoch=e1)
    age(store, "stage_inbound", "updated_at", "1 = 1", 2 * DAY)
    acquire_permanent(store, node_id="solo:2:bb")
    assert leadership.retention(single, e1, DAY) == {"inbound": 0, "routed": 0, "outbound": 0, "events": 0}
    assert len(status_of(store)) == 2


def test_retention_refuses_unknown_keys_and_negative_ages(single):
    with pytest.raises(ValueError, match="unknown retention key"):
        leadership.retention(single, 0, {"inbund": DAY})
    with pytest.raises(ValueError, match="negative"):
        leadership.retention(single, 0, {"inbound": -1.0})
