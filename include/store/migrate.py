"""`stageline db migrate`: apply the versioned schema files and pin the store to its cluster.

Each version applies in its own transaction under a migration lock, so two nodes migrating at once
apply it exactly once. The first migrate writes the cluster identity (a random cluster id plus the
configured `cluster_name`); afterwards a node configured for another cluster is refused, so two
clusters can never share — and corrupt — one store by mistake.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from include.store import queries
from include.store.db import Store
from include.store.reach import describe


class ClusterIdentityError(RuntimeError):
    """The store belongs to a different cluster than this node's config names."""


class SchemaError(RuntimeError):
    """The store's schema is missing or newer than this code understands."""


@dataclass(frozen=True)
class MigrationReport:
    applied: list[int]
    version: int
    cluster_id: str
    cluster_name: str


def latest_version(backend: str) -> int:
    return len(queries.migrations(backend))


def migrate(store: Store, *, cluster_name: str) -> MigrationReport:
    applied: list[int] = []
    with store.transaction() as tx:
        tx.one("migrate_lock")  # CREATE TABLE IF NOT EXISTS alone races on PostgreSQL
        tx.execute("bootstrap")
    for version, description, sql in queries.migrations(store.backend):
        with store.transaction() as tx:
            tx.one("migrate_lock")
            current = tx.row("schema_version_current")["version"]
            if current >= version:
                continue
            tx.script(sql)
            tx.execute("schema_version_record", {"version": version, "description": description})
            applied.append(version)
    with store.transaction() as tx:
        tx.one("migrate_lock")
        tx.execute("identity_insert", {"cluster_id": str(uuid.uuid4()), "cluster_name": cluster_name})
    identity = check_identity(store, cluster_name=cluster_name)
    return MigrationReport(
        applied=applied,
        version=latest_version(store.backend),
        cluster_id=identity["cluster_id"],
        cluster_name=identity["cluster_name"],
    )


_MISSING_TABLE = ("no such table", "does not exist", "invalid object name")
"""How SQLite, PostgreSQL and SQL Server say a table is not there."""


def _missing_table(error: str) -> bool:
    return any(words in error.lower() for words in _MISSING_TABLE)


def check_identity(store: Store, *, cluster_name: str) -> dict[str, Any]:
    """Refuse a store that is unmigrated, too new, or owned by another cluster."""
    store_name = describe(store.config)
    try:
        with store.transaction(write=False) as tx:
            version = tx.row("schema_version_current")["version"]
            identity = tx.one("identity_get")
    except Exception as exc:  # missing tables look different on every driver
        first_line = (str(exc).strip().splitlines() or [""])[0]  # PostgreSQL adds LINE 1: and a caret
        if not _missing_table(first_line):  # locked, cut, refused: the store is there, it did not answer
            raise SchemaError(f"{store_name} could not be read ({type(exc).__name__}: {first_line})") from exc
        raise SchemaError(
            f"{store_name} has no Stageline schema yet; run `stageline db migrate` ({type(exc).__name__}: {first_line})"
        ) from exc
    expected = latest_version(store.backend)
    if version < expected:
        raise SchemaError(
            f"{store_name} is at schema version {version}, this code needs {expected}; run `stageline db migrate`"
        )
    if version > expected:
        raise SchemaError(
            f"{store_name} is at schema version {version}, newer than this code ({expected}); "
            "upgrade Stageline on this node"
        )
    if identity is None:
        raise SchemaError(f"{store_name} has no cluster identity; run `stageline db migrate`")
    if identity["cluster_name"] != cluster_name:
        raise ClusterIdentityError(
            f"{store_name} belongs to cluster {identity['cluster_name']!r} (cluster id {identity['cluster_id']}), "
            f"but this node's [cluster].cluster_name is {cluster_name!r}; refusing to start. Point [store] at "
            "the right database or fix cluster_name."
        )
    return identity
