"""Helpers shared by the DAG tests: a service config file for a test store, seeding and ageing rows.

Setup SQL is inline here on purpose: it builds test states (aged rows, seeded messages) that no
product code ever writes.
"""

from __future__ import annotations

from pathlib import Path

from include.config import StoreConfig
from include.store import INBOUND, OUTBOUND, ROUTED, Store
from include.store import rowlease as rl
from include.store.lease import LeaderElector
from tests.support.queries import rows

__all__ = ["rows"]  # the DAG tests read rows from here

CLUSTER = "test-cluster"  # the name tests/conftest.py migrates every store with


def write_service_config(directory: Path, store: StoreConfig, *, cluster: bool, cluster_name: str = CLUSTER) -> Path:
    """A `stageline.toml` for `store`; the clustered one uses the store's default lease timings."""
    if store.backend == "sqlite":
        store_section = f'backend = "sqlite"\npath = "{store.path}"\n'
    else:
        store_section = (
            f'backend = "{store.backend}"\nserver = "{store.server}"\nport = {store.port}\n'
            f'database = "{store.database}"\nusername = "{store.username}"\n'
        )
    path = directory / "stageline.toml"
    path.write_text(
        f"[store]\n{store_section}\n[cluster]\nenabled = {'true' if cluster else 'false'}\n"
        f'cluster_name = "{cluster_name}"\n'
    )
    return path


def seed_inbound(store: Store, n: int, *, prefix: str = "m") -> list[int]:
    """Stage `n` pending inbound messages; their ids in arrival order."""
    with store.transaction() as tx:
        cur = tx.conn.cursor()
        for i in range(n):
            cur.execute(
                tx.dialect.translate(
                    "INSERT INTO stage_inbound (message_id, control_id, connection) VALUES (:m, :c, 'mllp-in')"
                ),
                {"m": f"{prefix}{i}", "c": f"c{i}"},
            )
        cur.execute(
            "INSERT INTO inbound_bodies (id, payload) SELECT id, 'MSH|^~\\&|A|B|C|D' FROM stage_inbound "
            "WHERE id NOT IN (SELECT id FROM inbound_bodies)"
        )
    return [r["id"] for r in rows(store, f"SELECT id FROM stage_inbound WHERE message_id LIKE '{prefix}%' ORDER BY id")]


def execute(store: Store, sql: str) -> None:
    with store.transaction() as tx:
        tx.conn.cursor().execute(sql)


def age(store: Store, table: str, column: str, where: str, seconds: float) -> None:
    """Move `column` of the matching rows `seconds` into the past (the DB clock's units)."""
    if store.backend == "sqlite":
        execute(store, f"UPDATE {table} SET {column} = {column} - {int(seconds * 1000)} WHERE {where}")
    else:
        execute(
            store, f"UPDATE {table} SET {column} = {column} - make_interval(secs => {float(seconds)}) WHERE {where}"
        )


def status_of(store: Store, table: str = "stage_inbound") -> dict[int, str]:
    return {r["id"]: r["status"] for r in rows(store, f"SELECT id, status FROM {table} ORDER BY id")}


def elector(store: Store, node: str) -> LeaderElector:
    """A cluster node's lease elector with long timings: a test steps and releases it by hand."""
    return LeaderElector(store, node_id=node, ttl_seconds=600, fence_timeout_seconds=300)


def finished_messages(store: Store, epoch: int, prefix: str, connection: str | None, n: int = 2) -> list[int]:
    """`n` messages of `connection` (None: `seed_inbound`'s) taken all the way (inbound, routed,
    outbound done, every transition an audit event); the outbound rows are transformed ones, with a
    body of their own."""
    ids = seed_inbound(store, n, prefix=prefix)
    if connection is not None:
        execute(store, f"UPDATE stage_inbound SET connection = '{connection}' WHERE message_id LIKE '{prefix}%'")
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=n)
        rl.finish_batch(tx, INBOUND, ids, owner="w", epoch=epoch)
    for i, source in enumerate(ids):
        execute(
            store,
            "INSERT INTO stage_routed (source_id, message_id, control_id, destination, route_name) "
            f"VALUES ({source}, '{prefix}{i}', 'c{i}', 'ehr', 'adt')",
        )
        execute(
            store,
            "INSERT INTO stage_outbound (source_id, message_id, control_id, destination, "
            f"idempotency_key) VALUES ({source}, '{prefix}{i}', 'c{i}', 'ehr', '{prefix}{i}-ehr')",
        )
    execute(
        store,
        "INSERT INTO outbound_bodies (id, payload) SELECT o.id, 'MSH|^~\\&|OUT|' || o.message_id "
        f"FROM stage_outbound o WHERE o.message_id LIKE '{prefix}%'",
    )
    for table in (ROUTED, OUTBOUND):
        with store.transaction() as tx:
            claimed = [r["id"] for r in rl.claim_batch(tx, table, owner="w", epoch=epoch, limit=n)]
            rl.finish_batch(tx, table, claimed, owner="w", epoch=epoch)
    return ids
