"""Staging one inbound message: the shortcut store tests seed rows with (the listener stages
whole group commits through `include.store.rowlease.stage_inbound`)."""

from __future__ import annotations

from include.store import Tx
from include.store.rowlease import stage_inbound


def insert_inbound(
    tx: Tx,
    *,
    epoch: int,
    node_id: str,
    message_id: str,
    control_id: str | None,
    connection: str,
    payload: str,
    lane_key: str | None = None,
    charset: str | None = None,
) -> int | None:
    """Stage one message; its row id, or None when the epoch is stale (nothing written)."""
    staged = stage_inbound(
        tx,
        [
            {
                "message_id": message_id,
                "control_id": control_id,
                "connection": connection,
                "lane_key": lane_key,
                "charset": charset,
                "payload": payload,
            }
        ],
        epoch=epoch,
        node_id=node_id,
    )
    return None if staged is None else staged.get(message_id)
