"""Session fixtures: a throwaway PostgreSQL cluster (started and removed by the test run) and
fresh migrated stores on PostgreSQL and SQLite for each test."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from include.app.lab.postgres_server import PostgresServer
from include.config import StoreConfig
from include.store import Store
from include.store.migrate import migrate

if TYPE_CHECKING:
    from include.app.lab.listenerd import Daemon

CLUSTER = "test-cluster"
TEMPLATE_DB = "stageline_template"
_db_numbers = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    server = PostgresServer(settings={"fsync": "off"}).start()
    try:
        server.execute(f"CREATE DATABASE {TEMPLATE_DB}")
        store = Store(pg_config(server, TEMPLATE_DB))
        try:
            migrate(store, cluster_name=CLUSTER)
        finally:
            store.close()
        yield server
    finally:
        server.stop()


def pg_config(server: PostgresServer, database: str, **overrides) -> StoreConfig:
    # The suite's server runs with fsync off (speed): say so, or listenerd refuses it (docs/store.md).
    return StoreConfig(
        backend="postgres",
        server=server.host,
        port=server.port,
        database=database,
        username=server.user,
        pool_size=8,
        **{"allow_unsafe_durability": True, **overrides},
    )


@pytest.fixture
def pg_config_fresh(pg_server: PostgresServer) -> Iterator[StoreConfig]:
    """A new migrated database (copied from the template) for this test alone."""
    name = f"t{next(_db_numbers)}"
    pg_server.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    yield pg_config(pg_server, name)
    pg_server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def migrated_sqlite(path: Path, **settings: Any) -> StoreConfig:
    """A new SQLite store file at `path`, migrated and pinned to CLUSTER: for fixtures of any scope
    (`settings`: other `StoreConfig` fields, e.g. a short busy timeout)."""
    config = StoreConfig(backend="sqlite", path=str(path), **settings)
    store = Store(config)
    try:
        migrate(store, cluster_name=CLUSTER)
    finally:
        store.close()
    return config


def refused_start(daemon: Daemon) -> str:
    """Start `daemon`, which must refuse its config: exit code 2 within 30 s. Its output."""
    daemon.start(wait=False)
    try:
        assert daemon.proc is not None and daemon.proc.wait(30) == 2
    finally:
        daemon.stop()
    return daemon.output()


@pytest.fixture
def sqlite_config_fresh(tmp_path) -> StoreConfig:
    return migrated_sqlite(tmp_path / "stageline.db")


@pytest.fixture(params=["sqlite", "postgres"])
def store_config(request) -> StoreConfig:
    return request.getfixturevalue(f"{request.param}_config_fresh" if request.param == "sqlite" else "pg_config_fresh")


@pytest.fixture
def store(store_config: StoreConfig) -> Iterator[Store]:
    s = Store(store_config)
    yield s
    s.close()
