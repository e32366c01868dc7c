"""The staged SQL store: schema, leader lease, membership and row-lease primitives."""

from __future__ import annotations

from include.store.db import INBOUND, OUTBOUND, ROUTED, STAGED_TABLES, StagedTable, Store, Tx

__all__ = ["INBOUND", "OUTBOUND", "ROUTED", "STAGED_TABLES", "StagedTable", "Store", "Tx"]
