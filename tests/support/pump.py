"""The stages without Airflow or Spark, for tests that need messages to flow: route every inbound row
to some destinations straight through (pass-through: their outbound rows are written by the route
finalize) and deliver lane heads through a `send(row) -> ok` the test controls — through the real
claims and fenced finalizes the stage jobs use, so every row moves as it would in production."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from include.store import INBOUND, OUTBOUND, Store
from include.store import rowlease as rl
from include.store.finalize import NOT_ATTEMPTED, DeliverOutcome, Run, finalize_deliveries, finalize_route
from tests.support.staging import insert_inbound


def stage(store: Store, *, epoch: int, n: int, connection: str, prefix: str) -> None:
    """Stage `n` ADTs on `connection`, control ids `<prefix>0`…, each in a lane of its own."""
    with store.transaction() as tx:
        for i in range(n):
            insert_inbound(
                tx,
                epoch=epoch,
                node_id="node-a",
                message_id=f"{prefix}{i}",
                control_id=f"{prefix}{i}",
                connection=connection,
                payload=f"MSH|^~\\&|A|B|||20261127||ADT^A01|{prefix}{i}|P|2.5\rPID|1||{i}",
                lane_key=f"{prefix}-lane-{i}",
            )


@dataclass(frozen=True)
class Retry:
    max_attempts: int = 3
    backoff_seconds: float = 0.05
    max_backoff_seconds: float = 0.1


def route(
    store: Store,
    *,
    epoch: int,
    destinations: Callable[[Mapping[str, Any]], list[str]],
    owner: str = "test:route",
    run: int = 0,
) -> int:
    """Route up to 500 due inbound rows: each to `destinations(row)` (none: unrouted). Rows routed."""
    run_id = f"route:{owner}:{run}"
    with store.transaction() as tx:
        claimed = rl.claim_batch(tx, INBOUND, owner=owner, epoch=epoch, limit=500)
        if not claimed:
            return 0
        landing = []
        names: set[str] = set()
        for row in claimed:
            targets = destinations(row)
            names |= set(targets)
            landing += [
                {"run_id": run_id, "source_id": row["id"], "destination": d, "route_name": "r", "status": "pending"}
                for d in targets
            ] or [
                {
                    "run_id": run_id,
                    "source_id": row["id"],
                    "destination": None,
                    "route_name": None,
                    "status": "unrouted",
                }
            ]
        tx.execute("landing_routed_insert", {"rows": json.dumps(landing)})
        run_ = Run.of(run_id=run_id, owner=owner, epoch=epoch, claimed_ids=[r["id"] for r in claimed])
        finalize_route(tx, run_, passthrough=names)
    return len(claimed)


def deliver(
    store: Store,
    *,
    epoch: int,
    send: Callable[[Mapping[str, Any]], bool],
    retry: Retry = Retry(),
    owner: str = "test:deliver",
) -> DeliverOutcome:
    """One deliver round: claim lane heads, `send` each (False: a retryable failure), land the outcomes."""
    with store.transaction() as tx:
        claimed = rl.claim_lane_heads(tx, OUTBOUND, owner=owner, epoch=epoch, limit=500, per_lane=50)
    outcomes = []
    failed_lanes: set[Any] = set()
    for row in claimed:
        lane = row.get("lane_key") or ("id", row["id"])
        if lane in failed_lanes:
            outcomes.append({**_outcome(row, False), "detail": f"{NOT_ATTEMPTED}: lane blocked"})
            continue
        ok = send(row)
        if not ok:
            failed_lanes.add(lane)
        outcomes.append(_outcome(row, ok))
    if not outcomes:
        return DeliverOutcome()
    destinations = {o["destination"]: retry for o in outcomes}
    return finalize_deliveries(store, outcomes, owner=owner, epoch=epoch, destinations=destinations)


def _outcome(row: Mapping[str, Any], ok: bool) -> dict[str, Any]:
    return {
        "id": row["id"],
        "destination": row["destination"],
        "ok": ok,
        "retryable": True,
        "detail": None if ok else f"connection refused by {row['destination']}",
    }
