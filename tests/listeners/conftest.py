"""Fixtures the listener tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from zope.interface import provider

from include.config import StoreConfig

FAST_LEASE = {
    "enabled": True,
    "heartbeat_seconds": 0.5,
    "leader_fence_timeout_seconds": 1.5,
    "leader_lease_ttl_seconds": 2.5,
    "node_timeout_seconds": 2.0,
}
"""A `[cluster]` whose lease a test sees taken, lost and handed over within seconds."""


def cluster_for(store_config: StoreConfig) -> dict[str, Any] | None:
    """A test `listenerd`'s `[cluster]` on `store_config`: none on SQLite (a single node, leader for
    good), FAST_LEASE on a server store, so the daemon runs the real lease."""
    return None if store_config.backend == "sqlite" else dict(FAST_LEASE)


@pytest.fixture
def logs() -> Iterator[list[LogEvent]]:
    """Every event logged while the test runs, in order: for asserting what a log line says (or
    that none carries a message body)."""
    events: list[LogEvent] = []

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        events.append(event)

    globalLogPublisher.addObserver(observe)
    yield events
    globalLogPublisher.removeObserver(observe)
