"""`StagelineStoreHook` with real Airflow connections (`AIRFLOW_CONN_STAGELINE_STORE`, read through
Airflow's own secrets backends) against real stores: what the connection supplies and what it does
not, the store resolved once, and a sensor's pokes sharing that one store."""

from __future__ import annotations

import json

import pytest
from stageline_airflow import hooks
from stageline_airflow.hooks import StagelineStoreHook
from stageline_airflow.sensors import WorkPendingSensor

from include.config import PASSWORD_ENV, StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent, read_lease
from include.store.migrate import check_identity
from tests.dags.stores import CLUSTER, seed_inbound, write_service_config

CONN_ENV = "AIRFLOW_CONN_STAGELINE_STORE"


def connection(**fields: object) -> str:
    return json.dumps({"conn_type": StagelineStoreHook.conn_type, **fields})


@pytest.fixture
def sqlite_toml(sqlite_config_fresh: StoreConfig, tmp_path, monkeypatch):
    path = write_service_config(tmp_path, sqlite_config_fresh, cluster=False)
    monkeypatch.setenv("STAGELINE_CONFIG", str(path))
    monkeypatch.delenv(CONN_ENV, raising=False)
    return path


def test_the_hook_declares_its_airflow_connection():
    hook = StagelineStoreHook()
    assert getattr(hook, StagelineStoreHook.conn_name_attr) == StagelineStoreHook.default_conn_name == "stageline_store"
    assert StagelineStoreHook.hook_name


def test_the_password_comes_from_the_airflow_connection_instead_of_the_environment(sqlite_toml, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "from-the-environment")
    monkeypatch.setenv(CONN_ENV, connection(login="svc_stageline", password="from-airflow-secrets"))

    with StagelineStoreHook() as hook:
        store = hook.get_conn()
        assert (hook.config.store.password, hook.config.store.username) == ("from-airflow-secrets", "svc_stageline")
        assert hook.config.store.path == str(sqlite_toml.parent / "stageline.db")  # the rest is the file's
        assert check_identity(store, cluster_name=CLUSTER)["cluster_name"] == CLUSTER
        assert read_lease(store).epoch == 0
        assert hook.get_conn() is store  # resolved once


def test_without_a_connection_the_file_and_the_environment_apply(sqlite_toml, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "from-the-environment")
    with StagelineStoreHook() as hook:
        assert hook.config.store.password == "from-the-environment"
        assert hook.config.store.username == StoreConfig().username
        assert read_lease(hook.get_conn()).epoch == 0


def test_the_connections_server_and_database_win_over_the_file(pg_config_fresh, tmp_path, monkeypatch):
    """The file names a database that does not exist; the connection names the real one."""
    wrong = StoreConfig(backend="postgres", server="db.invalid", port=1, database="nowhere", username="nobody")
    path = write_service_config(tmp_path, wrong, cluster=True)
    monkeypatch.setenv(
        CONN_ENV,
        connection(
            host=pg_config_fresh.server,
            port=pg_config_fresh.port,
            login=pg_config_fresh.username,
            schema=pg_config_fresh.database,
        ),
    )

    with StagelineStoreHook(config_path=path) as hook:
        resolved = hook.config.store
        assert (resolved.server, resolved.port, resolved.database, resolved.username) == (
            pg_config_fresh.server,
            pg_config_fresh.port,
            pg_config_fresh.database,
            pg_config_fresh.username,
        )
        assert hook.config.cluster.enabled and resolved.backend == "postgres"
        assert check_identity(hook.get_conn(), cluster_name=CLUSTER)["cluster_name"] == CLUSTER


def test_a_sensors_pokes_share_one_store_opened_and_closed_by_its_task(sqlite_toml, monkeypatch):
    opened: list[Store] = []
    closed: list[Store] = []

    class RecordingStore(Store):
        def __init__(self, config: StoreConfig) -> None:
            super().__init__(config)
            opened.append(self)

        def close(self) -> None:
            closed.append(self)
            super().close()

    monkeypatch.setattr(hooks, "Store", RecordingStore)
    setup = Store(StagelineStoreHook().config.store)
    try:
        epoch = acquire_permanent(setup, node_id="solo:1:aa")
        sensor = WorkPendingSensor(
            task_id="wait_for_work", stage="route", leader={"epoch": epoch}, poke_interval=0, timeout=60
        )
        poked_with: list[Store] = []
        poke = sensor.poke

        def counting_poke(context):
            poked_with.append(sensor.hook.get_conn())
            if len(poked_with) == 3:
                seed_inbound(setup, 1)  # work arrives before the third poke
            return poke(context)

        sensor.poke = counting_poke
        sensor.execute({})
    finally:
        setup.close()

    assert len(poked_with) == 3
    assert opened == closed == [poked_with[0]]  # one store for every poke, closed when the task ended
    assert all(store is opened[0] for store in poked_with)
