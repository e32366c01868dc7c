"""Migration is idempotent and concurrent-safe; a store refuses nodes of another cluster."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from include.config import StoreConfig
from include.store import Store
from include.store.migrate import ClusterIdentityError, SchemaError, check_identity, latest_version, migrate
from tests.conftest import CLUSTER


def test_migrate_twice_applies_nothing_the_second_time(store):
    report = migrate(store, cluster_name=CLUSTER)
    assert report.applied == [] and report.version == latest_version(store.backend)
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute("SELECT version FROM schema_version")
        assert [dict(r)["version"] for r in cur.fetchall()] == list(range(1, report.version + 1))


def test_a_node_of_another_cluster_is_refused_and_told_why(store):
    identity = check_identity(store, cluster_name=CLUSTER)
    with pytest.raises(ClusterIdentityError) as err:
        check_identity(store, cluster_name="prod-east")
    assert CLUSTER in str(err.value) and "prod-east" in str(err.value) and identity["cluster_id"] in str(err.value)
    with pytest.raises(ClusterIdentityError):
        migrate(store, cluster_name="prod-east")
    assert check_identity(store, cluster_name=CLUSTER) == identity  # the identity never changes


def test_an_unmigrated_store_is_refused_with_the_command_to_run(tmp_path):
    store = Store(StoreConfig(backend="sqlite", path=str(tmp_path / "empty.db")))
    try:
        with pytest.raises(SchemaError, match="stageline db migrate"):
            check_identity(store, cluster_name=CLUSTER)
    finally:
        store.close()


def test_concurrent_migrations_apply_each_version_once(pg_server):
    from tests.conftest import pg_config

    pg_server.execute("CREATE DATABASE race")
    try:
        stores = [Store(pg_config(pg_server, "race")) for _ in range(4)]
        reports, errors = [], []

        def run(s: Store) -> None:
            try:
                reports.append(migrate(s, cluster_name="race"))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        # each version applied by exactly one of the four (different versions may go to different ones)
        assert sorted(v for r in reports for v in r.applied) == list(range(1, latest_version("postgres") + 1))
        assert len({r.cluster_id for r in reports}) == 1
        for s in stores:
            s.close()
    finally:
        pg_server.execute("DROP DATABASE race WITH (FORCE)")


def test_sqlite_store_runs_in_wal_with_full_sync_and_a_busy_timeout(sqlite_config_fresh):
    store = Store(sqlite_config_fresh)
    try:
        with store.transaction(write=False) as tx:
            pragmas = {
                p: next(iter(tx.conn.execute(f"PRAGMA {p}").fetchone().values()))
                for p in ("journal_mode", "synchronous", "busy_timeout")
            }
    finally:
        store.close()
    assert pragmas == {"journal_mode": "wal", "synchronous": 2, "busy_timeout": 10_000}
    # WAL is a property of the file: a plain sqlite3 client sees it too
    assert sqlite3.connect(sqlite_config_fresh.path).execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_sqlite_timestamps_are_epoch_milliseconds_from_the_database_clock(sqlite_config_fresh):
    store = Store(sqlite_config_fresh)
    with store.transaction() as tx:
        now = tx.one("db_now")["db_now"]
        tx.conn.execute("INSERT INTO stage_inbound (message_id, connection) VALUES ('m', 'c')")
        created = tx.conn.execute("SELECT created_at, typeof(created_at) AS t FROM stage_inbound").fetchone()
    store.close()
    assert created["t"] == "integer" and abs(created["created_at"] / 1000 - now) < 5
