"""Reading a store from a test: every row a query returns, as a dict, on SQLite and PostgreSQL alike.

Test SQL is inline and read-only here; what the product reads goes through `include/store`'s
named queries."""

from __future__ import annotations

from typing import Any

from include.config import StoreConfig
from include.store import Store


def rows(store: Store, sql: str) -> list[dict[str, Any]]:
    """The rows of `sql`, read in a read-only transaction of `store`."""
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(sql)
        return [dict(r) for r in cur.fetchall()]


def rows_of(config: StoreConfig, sql: str) -> list[dict[str, Any]]:
    """The rows of `sql` in the store of `config`, on a connection of its own (closed after)."""
    store = Store(config)
    try:
        return rows(store, sql)
    finally:
        store.close()
