"""The self-fencing leader lease: one leader per epoch, takeover only after expiry on the DB clock,
self-fencing before expiry, immediate handover on a clean release."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import psycopg
import pytest

from include.app.lab.postgres_server import wait_for
from include.store import Store
from include.store.lease import LeaderElector, Outcome, read_lease
from tests.store.workers import compete


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(store: Store, node: str, *, ttl: float = 30.0, fence: float = 20.0, clock=time.monotonic) -> LeaderElector:
    return LeaderElector(store, node_id=node, ttl_seconds=ttl, fence_timeout_seconds=fence, clock=clock)


def test_competing_electors_in_separate_processes_have_exactly_one_leader_per_epoch(store_config):
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(3), ctx.Queue()
    procs = [
        ctx.Process(target=compete, args=(store_config, f"n{i}", 3.0, i, 0.4, 0.3, start, results)) for i in range(3)
    ]
    for p in procs:
        p.start()
    logs = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    holders: dict[int, set[str]] = defaultdict(set)
    elections: dict[int, int] = defaultdict(int)
    for log in logs:
        for node, outcome, epoch in log:
            if outcome in ("elected", "already_leader"):
                holders[epoch].add(node)
            if outcome == "elected":
                elections[epoch] += 1
    assert len(holders) >= 20, "too few leadership changes to prove anything"
    assert {e: len(n) for e, n in holders.items() if len(n) != 1} == {}
    assert set(elections.values()) == {1}
    assert sorted(holders) == list(range(1, max(holders) + 1))  # no epoch skipped or reused
    store = Store(store_config)
    try:
        assert read_lease(store).epoch == max(holders)
    finally:
        store.close()


def test_standby_takes_over_only_after_the_lease_expires_on_the_db_clock(store):
    a, b = elector(store, "a", ttl=1.0, fence=0.5), elector(store, "b", ttl=1.0, fence=0.5)
    first = a.step()
    assert first.outcome is Outcome.ELECTED and first.epoch == 1
    outcomes = []

    def b_elected():
        r = b.step()
        outcomes.append(r.outcome)
        return r.outcome is Outcome.ELECTED

    wait_for(b_elected, timeout=5, what="standby election")
    lease = read_lease(store)
    assert Outcome.OTHER_LEADER in outcomes[:-1]
    assert (lease.owner, lease.epoch) == ("b", 2)
    assert lease.acquired_at >= first.expires_at  # DB clock: never before A's lease ran out


def test_renewal_after_a_takeover_fails_and_the_old_leader_stands_down(store):
    clock = FakeClock()
    a = elector(store, "a", ttl=0.3, fence=0.2, clock=clock)
    b = elector(store, "b", ttl=0.3, fence=0.2)
    assert a.step().outcome is Outcome.ELECTED
    wait_for(lambda: b.step().outcome is Outcome.ELECTED, timeout=5, what="takeover")
    result = a.step()  # the fake clock never advanced: A still believes it leads until the DB says no
    assert result.outcome is Outcome.CONFLICT and result.leader == "b"
    assert not a.is_leader and a.epoch is None
    assert (read_lease(store).owner, read_lease(store).epoch) == ("b", 2)


def test_leader_self_fences_at_the_fence_timeout_on_its_monotonic_clock(store):
    clock = FakeClock()
    a = elector(store, "a", ttl=30.0, fence=20.0, clock=clock)
    assert a.step().outcome is Outcome.ELECTED
    clock.now += 19.999
    assert a.is_leader
    clock.now += 0.002
    assert not a.is_leader and a.epoch is None
    # fenced while the lease is still live in the database: nobody else can have acquired yet
    lease = read_lease(store)
    assert lease.live and lease.owner == "a"
    # and a fenced leader never renews its old epoch: it waits out its own lease like anyone else
    assert a.step().outcome is Outcome.OTHER_LEADER


@pytest.mark.parametrize("store_config", ["postgres"], indirect=True)
def test_leader_with_a_hung_database_fences_before_its_lease_can_expire(store, store_config, pg_server):
    a = elector(store, "a", ttl=2.0, fence=1.0)
    renewed = time.monotonic()
    assert a.step().outcome is Outcome.ELECTED
    blocker = psycopg.connect(
        f"host={pg_server.host} port={pg_server.port} user=postgres dbname={store_config.database}"
    )
    blocker.execute("SELECT * FROM leader_lease WHERE id = 1 FOR UPDATE")  # the DB stops answering A
    errors: list[BaseException] = []

    def renew():
        try:
            a.step()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=renew)
    t.start()
    wait_for(lambda: not a.is_leader, timeout=5, interval=0.005, what="self-fence")
    fenced_after = time.monotonic() - renewed
    observer = Store(store_config)
    lease = read_lease(observer)  # plain read: not blocked by the row lock
    observer.close()
    t.join(5)  # the step gives up on its own (statement timeout = fence timeout)
    blocker.rollback()
    blocker.close()
    print(f"self-fenced {fenced_after:.3f}s after the last renewal (fence timeout 1.0s, TTL 2.0s)")
    assert 1.0 <= fenced_after < 1.1
    assert lease.live and lease.owner == "a" and lease.expires_at - lease.db_now > 0.5
    assert errors and isinstance(errors[0], psycopg.errors.QueryCanceled)  # the step itself was bounded


class SlowToConnect:
    """The store, but every transaction first waits `wait` seconds for its connection, as one
    does while the pool reconnects to a store that failed over."""

    def __init__(self, store: Store, wait: float) -> None:
        self._store, self.wait = store, wait

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    @contextmanager
    def transaction(self, **kwargs):
        time.sleep(self.wait)
        with self._store.transaction(**kwargs) as tx:
            yield tx


def test_an_election_that_waited_for_its_connection_leads_at_once_and_still_fences_before_expiry(store):
    a = elector(SlowToConnect(store, 2.5), "a", ttl=3.0, fence=2.0)  # the wait alone is past the fence
    assert a.step().outcome is Outcome.ELECTED
    fence_left = a.fence_deadline - time.monotonic()
    assert a.is_leader, "elected, but fenced already: the fence ran from before the wait for a connection"
    lease = read_lease(store)
    assert lease.owner == "a" and 0 < fence_left < lease.expires_at - lease.db_now


def test_clean_release_lets_a_standby_acquire_at_once(store):
    a, b = elector(store, "a", ttl=600.0, fence=300.0), elector(store, "b", ttl=600.0, fence=300.0)
    assert a.step().outcome is Outcome.ELECTED
    assert b.step().outcome is Outcome.OTHER_LEADER
    assert a.release() is True
    result = b.step()
    assert (result.outcome, result.epoch) == (Outcome.ELECTED, 2)
    assert not a.is_leader


def test_renewal_keeps_the_epoch_and_extends_the_lease(store):
    a = elector(store, "a", ttl=5.0, fence=3.0)
    first = a.step()
    second = a.step()
    assert second.outcome is Outcome.ALREADY_LEADER and second.epoch == first.epoch
    assert second.expires_at >= first.expires_at


def test_node_wall_clock_skew_has_no_effect(store, monkeypatch):
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 86_400)  # this node's clock is a day ahead
    a, b = elector(store, "a", ttl=1.0, fence=0.5), elector(store, "b", ttl=1.0, fence=0.5)
    elected = a.step()
    lease = read_lease(store)
    assert 0.8 < elected.expires_at - lease.db_now <= 1.0  # expiry is DB_now + ttl, not node time
    monkeypatch.setattr(time, "time", lambda: real() - 86_400)  # ... and now a day behind
    assert b.step().outcome is Outcome.OTHER_LEADER


def test_single_node_leader_is_permanent_and_each_start_bumps_the_epoch(store):
    from include.store.lease import acquire_permanent

    first = acquire_permanent(store, node_id="solo:1:aa")
    second = acquire_permanent(store, node_id="solo:2:bb")
    lease = read_lease(store)
    assert second == first + 1
    assert lease.live and lease.expires_at is None and lease.owner == "solo:2:bb"


def test_an_acquisition_waits_for_a_write_that_already_passed_the_epoch_check(store):
    from include.store import INBOUND
    from include.store import rowlease as rl
    from tests.support.staging import insert_inbound

    a = elector(store, "a", ttl=600.0, fence=300.0)
    e1 = a.step().epoch
    with store.transaction() as tx:
        insert_inbound(tx, epoch=e1, node_id="a", message_id="m1", control_id="1", connection="c", payload="MSH|")
        ids = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="a", epoch=e1, limit=1)]
    a.release()
    finishing = store.transaction()
    tx = finishing.__enter__()
    assert rl.finish_batch(tx, INBOUND, ids, owner="a", epoch=e1) == ids  # passed the check, not committed
    b_result = []
    t = threading.Thread(target=lambda: b_result.append(elector(store, "b", ttl=600.0, fence=300.0).step()))
    t.start()
    t.join(0.5)
    assert t.is_alive() and b_result == []  # the new epoch cannot commit under an open fenced write
    finishing.__exit__(None, None, None)
    t.join(10)
    assert (b_result[0].outcome, b_result[0].epoch) == (Outcome.ELECTED, e1 + 1)
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute("SELECT status FROM stage_inbound")
        assert [dict(r)["status"] for r in cur.fetchall()] == ["done"]
