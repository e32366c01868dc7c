"""Fixtures the listener tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from zope.interface import provider

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.config import StoreConfig
from tests.support.nodes import fast_cluster, mllp_node


def cluster_for(store_config: StoreConfig) -> dict[str, Any] | None:
    """A test `listenerd`'s `[cluster]` on `store_config`: none on SQLite (a single node, leader for
    good), the fast timings on a server store, so the daemon runs the real lease and a test sees it
    taken, lost and handed over within seconds."""
    return None if store_config.backend == "sqlite" else fast_cluster()


def leading_node(tmp_path: Path, store_config: StoreConfig, **options: Any) -> Daemon:
    """A started `listenerd` (`cluster_for` this store) once it has bound its MLLP `adt-in` (lane
    PID-3.1, and `options`) on a free port, `.mllp_port`: it leads."""
    port = free_port()
    d = mllp_node(
        tmp_path / "node",
        store_config,
        node_id="node-a:1:aa",
        port=port,
        cluster=cluster_for(store_config),
        options={"lane_key": "PID-3.1", **options},
    )
    d.mllp_port = port
    try:
        wait_for(lambda: port_open(port), timeout=15, what="leader to bind MLLP")
    except BaseException:
        d.stop()
        raise
    return d


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
