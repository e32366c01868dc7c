"""listenerd's replication posture when it can no longer be read (issue 28's red team): reads that
fail (etcd without a quorum, a pool that cannot connect) or hang make it `unknown` after two
rechecks — never the last posture shown as current — and the gauge NaN; the expected count is
exported beside it for the alert (deploy/alerts.yml, StagelineStoreOnOneServer)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure

from include.store.replication import Posture
from listeners import replication
from listeners.metrics import Metrics
from listeners.replication import STALE_AFTER, PostureService

STEP = 5.0
SYNCHRONOUS = Posture(
    standby_names='"pg-b"', synchronous_commit="on", in_recovery=False, can_see=True, standbys=1, sync_standbys=1
)


class ReplicatedStore:
    """Stands in for a PostgreSQL store: it has the posture query (the reads themselves are driven
    by the test, one Deferred each)."""

    def has_query(self, name: str) -> bool:
        return name == "replication_posture"


def gauge(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


@pytest.fixture
def service(monkeypatch):
    reads: list[Deferred[Any]] = []

    def defer_to_thread(fn, *args):
        reads.append(Deferred())
        return reads[-1]

    monkeypatch.setattr(replication.threads, "deferToThread", defer_to_thread)
    clock = MemoryReactorClock()
    metrics = Metrics()
    svc = PostureService(ReplicatedStore, metrics, seconds=STEP, expected=1, reactor=clock)
    return svc, clock, metrics, reads


def test_reads_that_keep_failing_make_the_posture_unknown_with_the_error_and_the_gauge_nan(service):
    svc, clock, metrics, reads = service
    assert gauge(metrics, "stageline_store_sync_standbys_expected") == 1
    assert math.isnan(gauge(metrics, "stageline_store_sync_standbys"))  # not read yet
    svc._read()
    reads[-1].callback(SYNCHRONOUS)
    assert svc.document()["state"] == "synchronous" and gauge(metrics, "stageline_store_sync_standbys") == 1

    for _ in range(STALE_AFTER):  # a failure or two within the recheck window: still the last read
        clock.advance(STEP)
        svc._read()
        reads[-1].errback(Failure(TimeoutError("couldn't get a connection after 30.00 sec")))
        assert svc.document()["state"] == "synchronous"
    clock.advance(STEP + 0.1)
    svc._read()
    reads[-1].errback(Failure(TimeoutError("couldn't get a connection after 30.00 sec")))
    doc = svc.document()
    assert doc["state"] == "unknown" and doc["two_servers"] is False
    assert doc["error"] == "TimeoutError: couldn't get a connection after 30.00 sec"
    assert doc["failing_since"].endswith("Z") and doc["last_read"]["state"] == "synchronous"
    assert math.isnan(gauge(metrics, "stageline_store_sync_standbys"))
    assert metrics.registry.get_sample_value("stageline_store_errors_total", {"operation": "replication_posture"}) == 3

    clock.advance(STEP)  # read again: current again
    svc._read()
    reads[-1].callback(SYNCHRONOUS)
    assert svc.document()["state"] == "synchronous" and gauge(metrics, "stageline_store_sync_standbys") == 1


def test_a_read_that_hangs_makes_the_posture_unknown_too(service):
    svc, clock, metrics, reads = service
    svc._read()
    reads[-1].callback(SYNCHRONOUS)
    clock.advance(STEP)
    svc._read()  # never returns (a pool waiting for a connection)
    clock.advance(STALE_AFTER * STEP)
    assert svc.document()["state"] == "synchronous"
    clock.advance(0.1)
    doc = svc.document()
    assert doc["state"] == "unknown" and doc["error"] == "a read has not returned" and doc["failing_since"] is None
    assert math.isnan(gauge(metrics, "stageline_store_sync_standbys"))
