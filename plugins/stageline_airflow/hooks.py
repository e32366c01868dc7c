"""`StagelineStoreHook`: the Stageline store for one Airflow task, resolved once.

The store's settings come from the service config (`stageline.toml`: `$STAGELINE_CONFIG`, else
`./stageline.toml`), its password from `$STAGELINE_STORE_PASSWORD` — the same sources `listenerd`
uses. An Airflow connection `stageline_store` (any way Airflow defines one: the UI, a secrets
backend, `AIRFLOW_CONN_STAGELINE_STORE`) is an alternative source for the server and credentials,
so the password can live in Airflow's secrets instead of the task's environment:

    AIRFLOW_CONN_STAGELINE_STORE='{"conn_type": "stageline", "host": "db", "port": 5432,
                                   "login": "stageline", "password": "…", "schema": "stageline"}'

Each field the connection sets wins over the file (and over the environment, for the password):
host → `[store].server`, port → `port`, login → `username`, schema → `database` (the database, as
in Airflow's PostgreSQL connections), password → the password. The backend and every other setting
stay the file's. No such connection: the file and the environment alone, as before. The
connection type `stageline` and its form in the connections UI (those fields, named as in
`[store]`) are registered by the provider info (`provider_info.py`), once the `stageline`
distribution is installed.

A task makes one hook and keeps it: the config is read and the store (with its connection pool)
opened at the first use, then reused — a sensor's pokes and a stage task's micro-batches share one
store — and closed by `close()` or when the `with` block ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from include.config import ServiceConfig, StoreConfig, load
from include.store import Store
from include.store.stages import STAGES

if TYPE_CHECKING:
    from airflow.sdk import Connection

    from include.spark import StageSession


class StagelineStoreHook(BaseHook):
    """The Stageline store for one task: service config plus the optional Airflow connection.

    :param stageline_conn_id: the Airflow connection that may supply the server and credentials.
    :param config_path: the service config; default `$STAGELINE_CONFIG`, then `./stageline.toml`.
    """

    conn_name_attr = "stageline_conn_id"
    default_conn_name = "stageline_store"
    conn_type = "stageline"
    hook_name = "Stageline store"

    def __init__(
        self, stageline_conn_id: str = default_conn_name, *, config_path: str | os.PathLike[str] | None = None
    ) -> None:
        super().__init__()
        self.stageline_conn_id = stageline_conn_id
        self.config_path = config_path
        self._config: ServiceConfig | None = None
        self._store: Store | None = None

    @property
    def config(self) -> ServiceConfig:
        """The service config, with the connection's fields applied (read once)."""
        if self._config is None:
            config = load(self.config_path)
            conn = self._connection()
            if conn is not None:
                config = replace(config, store=store_settings(config.store, conn))
            self._config = config
        return self._config

    def get_conn(self) -> Store:
        """The store, opened at the first call and reused until `close()`."""
        if self._store is None:
            self._store = Store(self.config.store)
        return self._store

    def close(self) -> None:
        """Close the store and its pool (a later `get_conn()` opens a new one)."""
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def __enter__(self) -> StagelineStoreHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connection(self) -> Connection | None:
        try:
            conn = self.get_connection(self.stageline_conn_id)
        except AirflowNotFoundException:
            return None
        self.log.info(
            "store settings from Airflow connection %r: %s",
            self.stageline_conn_id,
            ", ".join(name for name in ("host", "port", "login", "schema", "password") if getattr(conn, name))
            or "none",
        )
        return conn


def store_settings(store: StoreConfig, conn: Connection) -> StoreConfig:
    """`store` with the connection's host, port, login, schema (database) and password, where set."""
    return replace(
        store,
        server=conn.host or store.server,
        port=conn.port or store.port,
        username=conn.login or store.username,
        database=conn.schema or store.database,
        password=conn.password or store.password,
    )


SPREAD_ORDER = tuple(stage.dag_id for stage in STAGES)
"""The stages are spread over the Spark Connect servers in pipeline order (with two: route and deliver
on the first, transform on the second), so every server runs jobs and is warm for a stage that
moves to it."""


class StagelineSparkHook(BaseHook):
    """The Spark session of one stage task, from the `stageline_spark` Airflow connection.

    Type `spark_connect`: a client of long-lived Spark Connect servers — the one the connection
    names (the Spark provider's `SparkConnectHook` builds its URL: host, port, user id, token, SSL)
    and those its extra `servers` adds ("sc://host:port", comma-separated). The stages are spread
    over them (`SPREAD_ORDER`); a stage whose server stops answering moves to the next one that
    answers, and each task warms its stage's session on the other servers in the background, so
    the move finds Python workers started. The session is the stage's sticky one
    (`include.spark.stage_session_id`): a retry or the next run reopens it warm. Type `spark`: a
    classic session on the connection's master with its extras as Spark conf, as the provider's
    `@task.pyspark` builds it, stopped at the end.

    Why not `@task.pyspark` itself: it opens its session before the task's code runs, on the one
    server the connection names, retrying a dead one for minutes, and releases it at the end.

    No `conn_type` of its own: the connection is one of the Spark provider's types, and its form is theirs.

    :param spark_conn_id: the Airflow connection.
    """

    conn_name_attr = "spark_conn_id"
    default_conn_name = "stageline_spark"
    hook_name = "Stageline stage Spark session"

    def __init__(self, spark_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.spark_conn_id = spark_conn_id

    def remotes(self, stage: str | None = None) -> list[str]:
        """The Spark Connect URLs in the order `stage` tries them (empty for a classic connection)."""
        from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

        conn = self.get_connection(self.spark_conn_id)
        if conn.conn_type != SparkConnectHook.conn_type:
            return []
        more = conn.extra_dejson.get("servers") or ""
        more = more.split(",") if isinstance(more, str) else list(more)
        urls = [SparkConnectHook(self.spark_conn_id).get_connection_url()] + [u.strip() for u in more if u.strip()]
        first = SPREAD_ORDER.index(stage) % len(urls) if stage in SPREAD_ORDER else 0
        return urls[first:] + urls[:first]

    @contextlib.contextmanager
    def stage_session(self, *, name: str, conf: Mapping[str, str]) -> Iterator[StageSession]:
        """The task's session for stage `name` (its DAG id), closed (not released) at the end."""
        from include.spark import StageSession, spark_session, stage_session

        remotes = self.remotes(name)
        if remotes:
            self.log.info("Spark Connect: %s", ", ".join(url.split("/;")[0] for url in remotes))
            session = StageSession.connect(remotes, conf, name=name)
            self.log.info("Spark Connect session on %s", session.remote.split("/;")[0] if session.remote else None)
            session.warm_others()
            try:
                yield session
            finally:
                session.close()
            return
        conn = self.get_connection(self.spark_conn_id)
        master = f"{conn.host}:{conn.port}" if conn.port else (conn.host or "local[*]")
        spark = spark_session(master=master, app_name=name, jars=[], conf={**conn.extra_dejson, **conf})
        try:
            with stage_session(spark, conf) as session:
                yield session
        finally:
            spark.stop()
