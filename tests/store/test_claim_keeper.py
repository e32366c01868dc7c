"""The stage task's watch (`include.claim_keeper`) and the primitives under it, on real SQLite and
PostgreSQL: a live claim is renewed past its row lease, a dead one expires and is swept, the claims
of ended tasks come back at once, and a change of epoch or a lapsed lease stops the task."""

from __future__ import annotations

import time

from include.app.lab.postgres_server import wait_for
from include.claim_keeper import ClaimKeeper
from include.store import INBOUND, Store
from include.store import rowlease as rl
from include.store.lease import LeaderElector
from tests.support.staging import insert_inbound


def leader(store: Store, node: str = "a", *, ttl: float = 600, fence: float = 300) -> LeaderElector:
    e = LeaderElector(store, node_id=node, ttl_seconds=ttl, fence_timeout_seconds=fence)
    assert e.step().is_leader
    return e


def stage(store: Store, epoch: int, n: int, *, lanes: bool = True) -> list[int]:
    with store.transaction() as tx:
        return [
            insert_inbound(
                tx,
                epoch=epoch,
                node_id="a",
                message_id=f"m{i}",
                control_id=f"c{i}",
                connection="c",
                payload="MSH|",
                lane_key=f"l{i % 2}" if lanes else None,
            )
            for i in range(n)
        ]


def claim(store: Store, owner: str, epoch: int, *, lease: float) -> list[int]:
    with store.transaction() as tx:
        return [r["id"] for r in rl.claim_batch(tx, INBOUND, owner=owner, epoch=epoch, limit=100, lease_seconds=lease)]


def statuses(store: Store) -> dict[str, int]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute("SELECT status, count(*) AS n FROM stage_inbound GROUP BY status")
        return {r["status"]: r["n"] for r in map(dict, cur.fetchall())}


def keeper(store: Store, epoch: int, *, lease: float = 0.9, clustered: bool = True) -> ClaimKeeper:
    return ClaimKeeper(
        store,
        INBOUND,
        epoch=epoch,
        clustered=clustered,
        check_seconds=0.1,
        lease_seconds=lease,
        reclaim_seconds=0.2,
        max_attempts=rl.SWEEP_MAX_ATTEMPTS,
    )


def test_a_live_claim_is_renewed_past_its_row_lease_and_a_dead_one_is_swept_soon_after(store):
    epoch = leader(store).epoch
    stage(store, epoch, 4, lanes=False)
    with keeper(store, epoch) as watch:
        watch.owner = "task-1"
        assert len(claim(store, "task-1", epoch, lease=0.9)) == 4
        time.sleep(2.0)  # more than twice the row lease: only renewals keep it
        assert statuses(store) == {"in_flight": 4}
        watch.owner = None  # the claimer stops renewing, as a killed one would
        started = time.monotonic()
        wait_for(lambda: statuses(store) == {"pending": 4}, timeout=5, what="the swept claim")
        assert time.monotonic() - started < 0.9 + 0.2 + 0.5  # one lease + one sweep interval + slack
        assert not watch.stopped.is_set()


def test_claims_of_ended_tasks_of_the_same_dag_come_back_at_once_and_never_the_asking_tasks_own(store):
    epoch = leader(store).epoch
    stage(store, epoch, 6, lanes=False)
    with store.transaction() as tx:
        for owner, limit in (
            ("airflow:stage_route:r1#1.0", 2),
            ("airflow:stage_route:r2#1.3", 2),
            ("airflow:stage_transform:r9#1.0", 1),
            ("airflow:stage_route:r2#2.0", 1),
        ):
            assert len(rl.claim_batch(tx, INBOUND, owner=owner, epoch=epoch, limit=limit, lease_seconds=600)) == limit
    with keeper(store, epoch) as watch:
        assert watch.recover_abandoned(prefix="airflow:stage_route:", keep="airflow:stage_route:r2#2.") == 4
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute("SELECT lease_owner FROM stage_inbound WHERE status = 'in_flight' ORDER BY lease_owner")
        assert [r["lease_owner"] for r in map(dict, cur.fetchall())] == [
            "airflow:stage_route:r2#2.0",
            "airflow:stage_transform:r9#1.0",
        ]
        cur.execute("SELECT count(*) AS n FROM message_events WHERE event = 'recovered'")
        assert dict(cur.fetchone())["n"] == 4


def test_a_new_epoch_stops_the_task_within_a_check_and_renewals_under_the_old_one_land_nothing(store):
    first = leader(store, "a", ttl=1.0, fence=0.6)
    old = first.epoch
    stage(store, old, 2)
    with keeper(store, old) as watch:
        watch.owner = "task-1"
        claim(store, "task-1", old, lease=30)
        first.release()  # a clean stop: the lease expires at once and a standby acquires
        second = leader(store, "b")
        assert second.epoch == old + 1
        assert watch.wait(2.0), "the keeper did not see the new epoch"
        assert "no longer current" in (watch.reason or "")
        with store.transaction() as tx:
            assert rl.renew_claims(tx, INBOUND, owner="task-1", epoch=old, lease_seconds=30) == 0


def test_a_lapsed_lease_stops_a_clustered_task_but_not_a_single_node_one(store):
    e = leader(store, "a", ttl=0.5, fence=0.3)  # never renewed: lapses half a second from now
    with keeper(store, e.epoch) as clustered, keeper(store, e.epoch, clustered=False) as single:
        assert clustered.wait(3.0) and "lapsed" in (clustered.reason or "")
        assert not single.stopped.is_set()


def test_following_a_new_leader_runs_its_recovery_once_and_returns_its_epoch(store):
    from dataclasses import replace

    from include.config import ClusterConfig, ServiceConfig
    from include.stage_loop import follow_leader

    config = ServiceConfig(
        store=store.config,
        cluster=replace(
            ClusterConfig(),
            enabled=True,
            leader_lease_ttl_seconds=1.0,
            leader_fence_timeout_seconds=0.6,
            heartbeat_seconds=0.2,
        ),
    )
    first = leader(store, "a", ttl=1.0, fence=0.6)
    old = first.epoch
    stage(store, old, 3, lanes=False)
    claim(store, "airflow:stage_route:r1#1.0", old, lease=600)
    first.release()
    ticks = iter(range(0, 1000, 3))  # each read of the clock: 3 s later
    with keeper(store, old) as watch:
        assert watch.wait(2.0)
        # no live leader: it asks until the follow window (`follow_seconds`, at least 5 s) has passed
        assert follow_leader(config, store, old, watch, clock=lambda: float(next(ticks))) is None
    assert statuses(store) == {"in_flight": 3}  # nobody recovers without a leader
    leader(store, "b")
    with keeper(store, old) as watch:
        new = follow_leader(config, store, old, watch)
    assert new == old + 1
    assert statuses(store) == {"pending": 3}  # the old leader's claim is due under the new epoch at once


def test_a_hung_batch_is_given_up_its_rows_swept_and_the_task_told_to_end(store):
    """A stage run lasts hours, so a batch that never returns (a Spark server that stopped
    answering) must not hold its lanes for all of it: past `max_batch_seconds` its claim is no
    longer renewed — the sweep re-pends its rows one row lease later — and `on_hung` ends the task."""
    epoch = leader(store).epoch
    stage(store, epoch, 4, lanes=False)
    told: list[str] = []
    watch = ClaimKeeper(
        store,
        INBOUND,
        epoch=epoch,
        clustered=True,
        check_seconds=0.1,
        lease_seconds=0.9,
        reclaim_seconds=0.2,
        max_attempts=rl.SWEEP_MAX_ATTEMPTS,
        max_batch_seconds=1.5,
        on_hung=told.append,
    )
    with watch:
        watch.owner = "task-1.0"
        assert len(claim(store, "task-1.0", epoch, lease=0.9)) == 4
        time.sleep(1.2)  # past its row lease, inside max_batch_seconds: still renewed
        assert statuses(store) == {"in_flight": 4} and told == []
        wait_for(lambda: told == ["task-1.0"], timeout=5, what="the hung batch to be given up")
        wait_for(lambda: statuses(store) == {"pending": 4}, timeout=5, what="the hung batch's rows swept")
        assert told == ["task-1.0"]  # told once
        watch.owner = "task-1.1"  # a new batch is watched afresh
        time.sleep(0.5)
        assert watch.hung == "task-1.0" and told == ["task-1.0"]


def test_the_follow_window_outlasts_a_step_down_backoff():
    """Issue 24: a leader that cannot bind steps down and takes the lease again only after its
    backoff; a stage task that stopped following sooner would end its run and cost the next run's
    scheduling in the middle of the failover."""
    from dataclasses import replace

    from include.config import ClusterConfig, ServiceConfig
    from include.stage_loop import MIN_FOLLOW_SECONDS, follow_seconds

    lab = replace(
        ClusterConfig(),
        enabled=True,
        heartbeat_seconds=0.5,
        leader_fence_timeout_seconds=1.5,
        leader_lease_ttl_seconds=2.5,
    )
    assert follow_seconds(ServiceConfig(cluster=lab)) == 5.0 + 2.5  # default backoff 2 TTLs, plus a TTL
    slow_backoff = replace(lab, step_down_backoff_seconds=30.0)
    assert follow_seconds(ServiceConfig(cluster=slow_backoff)) == 32.5
    quick = replace(lab, leader_lease_ttl_seconds=0.5, step_down_backoff_seconds=0.5)
    assert follow_seconds(ServiceConfig(cluster=quick)) == MIN_FOLLOW_SECONDS
