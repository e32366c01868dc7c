"""The leader check (`include/leader_check.py`) on real SQLite and PostgreSQL stores, without
Airflow: who may run a stage, and whether a waiting run has work."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from include.config import ClusterConfig
from include.leader_check import check_leadership, work_pending
from include.store import INBOUND, Store
from include.store import rowlease as rl
from include.store.lease import acquire_permanent
from include.store.migrate import ClusterIdentityError
from tests.dags.stores import CLUSTER, age, elector, seed_inbound

SINGLE = ClusterConfig(enabled=False, cluster_name=CLUSTER)
CLUSTERED = ClusterConfig(enabled=True, cluster_name=CLUSTER)


# ---------------------------------------------------------------------------------------------
# check_leadership


@pytest.fixture
def pg_store(pg_config_fresh) -> Iterator[Store]:
    store = Store(pg_config_fresh)
    yield store
    store.close()


def test_single_node_proceeds_before_any_listener_ever_started(store):
    check = check_leadership(store, SINGLE)
    assert (check.proceed, check.epoch, check.owner) == (True, 0, None)
    assert "single node" in check.reason


def test_single_node_proceeds_with_the_current_permanent_epoch(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    assert check_leadership(store, SINGLE).as_xcom() == {"epoch": epoch, "owner": "solo:1:aa"}


def test_single_node_proceeds_even_when_the_lease_row_has_expired(store):
    e = elector(store, "old-cluster-node")
    epoch = e.step().epoch
    e.release()
    check = check_leadership(store, SINGLE)
    assert (check.proceed, check.epoch) == (True, epoch)


def test_cluster_proceeds_under_a_live_leader_with_its_epoch(pg_store):
    result = elector(pg_store, "node-a").step()
    check = check_leadership(pg_store, CLUSTERED)
    assert (check.proceed, check.epoch, check.owner) == (True, result.epoch, "node-a")
    assert "leader node-a" in check.reason


def test_cluster_does_not_proceed_when_the_lease_was_never_held(pg_store):
    check = check_leadership(pg_store, CLUSTERED)
    assert (check.proceed, check.epoch, check.owner) == (False, None, None)
    assert "never been held" in check.reason


def test_cluster_does_not_proceed_once_the_leader_lease_expired(pg_store):
    e = elector(pg_store, "node-a")
    e.step()
    e.release()  # a clean stop expires the lease at once
    check = check_leadership(pg_store, CLUSTERED)
    assert (check.proceed, check.epoch) == (False, None)
    assert "node-a" in check.reason and "expired" in check.reason


def test_a_store_of_another_cluster_is_an_error_not_a_skip(store):
    with pytest.raises(ClusterIdentityError, match="someone-else"):
        check_leadership(store, ClusterConfig(enabled=False, cluster_name="someone-else"))


# ---------------------------------------------------------------------------------------------
# work_pending


def test_work_is_pending_only_while_a_row_is_due_under_the_current_epoch(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    assert work_pending(store, epoch, "route", require_live=False) is False
    [row] = seed_inbound(store, 1)
    assert work_pending(store, epoch, "route", require_live=False) is True
    assert work_pending(store, epoch, "transform", require_live=False) is False
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=1)
    assert work_pending(store, epoch, "route", require_live=False) is False  # claimed: in flight, not due
    with store.transaction() as tx:
        rl.fail_batch(tx, INBOUND, [row], owner="w", epoch=epoch, error="boom", max_attempts=5, backoff_seconds=3600)
    assert work_pending(store, epoch, "route", require_live=False) is False  # backing off
    age(store, "stage_inbound", "next_attempt_at", f"id = {row}", 7200)
    assert work_pending(store, epoch, "route", require_live=False) is True  # backoff over: due again
    acquire_permanent(store, node_id="solo:2:bb")
    # leadership moved: stop waiting
    assert work_pending(store, epoch, "route", require_live=False) is None


def test_work_ahead_counts_rows_due_in_the_stages_before(store):
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    seed_inbound(store, 1)
    assert work_pending(store, epoch, "deliver", require_live=False) is False
    assert work_pending(store, epoch, "deliver", require_live=False, ahead=True) is True
    assert work_pending(store, epoch, "transform", require_live=False, ahead=True) is True
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=1)
    # in flight upstream is not due anywhere: nothing to start for
    assert work_pending(store, epoch, "deliver", require_live=False, ahead=True) is False
    acquire_permanent(store, node_id="solo:2:bb")
    assert work_pending(store, epoch, "deliver", require_live=False, ahead=True) is None


def test_in_a_cluster_work_stops_being_pending_when_the_leader_lease_lapses(pg_config_fresh):
    store = Store(pg_config_fresh)
    try:
        leader = elector(store, "node-a")
        epoch = leader.step().epoch
        seed_inbound(store, 1)
        assert work_pending(store, epoch, "route", require_live=True) is True
        leader.release()  # same epoch, but nobody leads: wait no longer
        assert work_pending(store, epoch, "route", require_live=True) is None
        assert work_pending(store, epoch, "route", require_live=False) is True
    finally:
        store.close()


def test_work_pending_refuses_an_unknown_stage(store):
    with pytest.raises(ValueError, match="unknown stage"):
        work_pending(store, 0, "rout", require_live=False)
    with pytest.raises(ValueError, match="unknown stage"):  # a table is not a stage
        work_pending(store, 0, "inbound", require_live=False)
