"""listeners/store_metrics.py on its own: when it reads the store and what it publishes. The store is
a real SQLite store with messages moved by tests/support/pump.py; the thread hop and the clock are
in the test's hands (the read runs when the test says, time passes when it advances the clock), so
a read that never returns and a scrape storm are exact, not timed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from include.app.lab.postgres_server import wait_for
from include.store import Store, stats
from include.store.lease import acquire_permanent
from listeners import store_metrics
from listeners.store_metrics import StoreMetrics
from tests.support import pump


class Reads:
    """Stands in for `threads.deferToThread`: each read waits until `run` (or never)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Deferred[Any], Any, tuple[Any, ...]]] = []
        self.started = 0

    def __call__(self, fn: Any, *args: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.pending.append((d, fn, args))
        self.started += 1
        return d

    def run(self) -> None:
        d, fn, args = self.pending.pop(0)
        d.callback(fn(*args))


@pytest.fixture
def setup(monkeypatch, sqlite_config_fresh):
    reads = Reads()
    monkeypatch.setattr(store_metrics.threads, "deferToThread", reads)
    store = Store(sqlite_config_fresh)
    epoch = acquire_permanent(store, node_id="node-a")
    registry = CollectorRegistry()
    leader = {"is": True}
    clock = Clock()
    m = StoreMetrics(registry, store=lambda: store, is_leader=lambda: leader["is"], clock=clock, max_age=2, lag=0)
    yield SimpleNamespace(m=m, reads=reads, registry=registry, clock=clock, leader=leader, store=store, epoch=epoch)
    store.close()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def fired(d: Deferred[Any]) -> bool:
    return d.called


def test_scrapes_within_max_age_share_one_read(setup, monkeypatch) -> None:
    m, reads, registry = setup.m, setup.reads, setup.registry
    now = [100.0]
    monkeypatch.setattr(store_metrics.time, "monotonic", lambda: now[0])
    first, second = m.fresh(), m.fresh()  # a scrape storm while the read runs
    assert reads.started == 1 and not fired(first) and not fired(second)
    reads.run()
    assert fired(first) and fired(second) and value(registry, "stageline_store_up") == 1
    now[0] += 1.0
    assert fired(m.fresh()) and reads.started == 1  # fresh enough: no read at all
    now[0] += 1.5
    m.fresh()
    assert reads.started == 2


def test_a_read_stuck_past_the_timeout_answers_store_up_0_and_starts_no_second_read(setup) -> None:
    m, reads, registry, clock = setup.m, setup.reads, setup.registry, setup.clock
    scrape = m.fresh()
    clock.advance(m.timeout - 0.1)
    assert not fired(scrape)
    clock.advance(0.2)
    assert fired(scrape) and value(registry, "stageline_store_up") == 0
    again = m.fresh()  # the store still has not answered
    assert reads.started == 1 and not fired(again)
    clock.advance(m.timeout)
    assert fired(again) and value(registry, "stageline_store_up") == 0
    reads.run()  # it answers at last
    assert value(registry, "stageline_store_up") == 1 and not clock.getDelayedCalls()


def test_counters_grow_by_what_finished_since_the_last_read_and_a_standby_publishes_none(setup, monkeypatch) -> None:
    m, reads, registry, leader, store, epoch = (
        setup.m,
        setup.reads,
        setup.registry,
        setup.leader,
        setup.store,
        setup.epoch,
    )
    now = [100.0]
    monkeypatch.setattr(store_metrics.time, "monotonic", lambda: now[0])

    def scrape() -> None:
        now[0] += 10
        m.fresh()
        reads.run()
        # what comes next happens after the read's window (the store's clock has milliseconds)
        wait_for(lambda: stats.db_now_ms(store) >= (m._watermark_ms or 0), timeout=5, interval=0.001, what="ms")

    scrape()  # the first read sets the watermark: nothing counted before it
    pump.stage(store, epoch=epoch, n=3, connection="adt-in", prefix="A")
    pump.route(store, epoch=epoch, destinations=lambda row: ["ehr"])
    pump.deliver(store, epoch=epoch, send=lambda row: True)
    scrape()
    sent = {"destination": "ehr", "outcome": "sent"}
    assert value(registry, "stageline_destination_messages_total", **sent) == 3
    assert value(registry, "stageline_connection_messages_total", connection="adt-in", outcome="received") == 3
    assert value(registry, "stageline_delivery_latency_seconds_count", destination="ehr", connection="adt-in") == 3
    assert value(registry, "stageline_destination_rows", destination="ehr", state="queued") == 0
    scrape()  # nothing new: the counters stay
    assert value(registry, "stageline_destination_messages_total", **sent) == 3

    leader["is"] = False  # a standby: the leader's figures are the cluster's
    scrape()
    assert value(registry, "stageline_store_up") == 1
    assert value(registry, "stageline_destination_messages_total", **sent) is None
    assert value(registry, "stageline_destination_rows", destination="ehr", state="queued") is None

    leader["is"] = True  # leading again: counting starts over from this read
    scrape()
    assert value(registry, "stageline_destination_messages_total", **sent) is None
    pump.stage(store, epoch=epoch, n=1, connection="adt-in", prefix="B")
    pump.route(store, epoch=epoch, destinations=lambda row: ["ehr"])
    pump.deliver(store, epoch=epoch, send=lambda row: True)
    scrape()
    assert value(registry, "stageline_destination_messages_total", **sent) == 1
