"""A store whose server stopped keeping commits (fsync turned off at run time, found by the store's
periodic recheck: tests/store/test_durability.py) is loud: `/cluster/status` says so and why
(`store_durable: false`, `durability_problem`), and the `stageline_store_durable` gauge drops to 0
(issue 23, red team item 10)."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import succeed

from listeners.metrics import Metrics
from listeners.state import NodeState


class StandInStore:
    durability_problem: str | None = None


def state_of(store: Any) -> NodeState:
    return NodeState(
        node_id="n1",
        clustered=False,
        metrics=Metrics(),
        is_leader=lambda: True,
        config_version=lambda: 0,
        nodes=lambda: succeed({}),
        store=lambda: store,
    )


def gauge(state: NodeState) -> str:
    return next(
        line for line in state.metrics.render().decode().splitlines() if line.startswith("stageline_store_durable ")
    )


def test_status_and_metric_follow_the_stores_durability() -> None:
    store = StandInStore()
    state = state_of(store)
    assert "store_durable" not in state.status() and "durability_problem" not in state.status()
    assert gauge(state) == "stageline_store_durable 1.0"
    store.durability_problem = "PostgreSQL runs with fsync = off: ..."
    doc = state.status()
    assert doc["store_durable"] is False and doc["durability_problem"].startswith("PostgreSQL runs with fsync = off")
    assert gauge(state) == "stageline_store_durable 0.0"


def test_a_node_whose_store_is_not_open_yet_reports_durable() -> None:
    state = state_of(None)
    assert "store_durable" not in state.status() and gauge(state) == "stageline_store_durable 1.0"
