"""Durability pinned (docs/store.md, "Durability"): a commit the store reports is one the server keeps.

On a private PostgreSQL server (never the suite's shared one: these tests change server settings
with ALTER SYSTEM + reload): a server, database or role default of `synchronous_commit = off` does
not reach a store session, the ingest one included; a synchronous standby's level is kept; a server
with `fsync = off` is refused by `check_durability` (and by listenerd at start) unless
`allow_unsafe_durability`. SQL Server has no server here: its SQL text is parsed and the decision
tested on a stand-in cursor (docs/sqlserver.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from include.app.lab.postgres_server import PostgresServer
from include.config import StoreConfig
from include.store import Store
from include.store.durability import (
    UnsafeDurability,
    check_connection,
    durability_queries,
    postgres_refusal,
    postgres_synchronous_commit,
    sqlserver_refusal,
)
from include.store.migrate import migrate
from tests.support.nodes import mllp_node


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    """A private server whose default is synchronous_commit = off."""
    server = PostgresServer(settings={"synchronous_commit": "off"})
    del server.settings["fsync"]  # not on the command line: ALTER SYSTEM + reload can turn it off
    server.start()
    try:
        server.execute("CREATE DATABASE durable")
        yield server
    finally:
        server.stop()


@pytest.fixture
def config(server: PostgresServer) -> Iterator[StoreConfig]:
    yield StoreConfig(
        backend="postgres", server=server.host, port=server.port, database="durable", username=server.user, pool_size=2
    )
    for sql in ("ALTER SYSTEM RESET ALL", "ALTER DATABASE durable RESET ALL", "SELECT pg_reload_conf()"):
        server.execute(sql)


def reload(server: PostgresServer, **settings: str) -> None:
    for key, value in settings.items():
        server.execute(f"ALTER SYSTEM SET {key} = '{value}'")
    server.execute("SELECT pg_reload_conf()")
    with psycopg.connect(server.conninfo("durable")) as conn:  # a new backend reads the reloaded file
        for key, value in settings.items():
            assert conn.execute(f"SHOW {key}").fetchone()[0] == value


def session_setting(store: Store, *, ingest: bool = False) -> str:
    """synchronous_commit as a store transaction sees it (`ingest`: the group commit's autocommit session)."""
    ctx = store.single_statement() if ingest else store.transaction(write=False)
    with ctx as tx:
        cur = tx.conn.cursor()
        cur.execute("SHOW synchronous_commit")
        return cur.fetchone()["synchronous_commit"]


def test_a_server_default_of_synchronous_commit_off_does_not_reach_store_sessions(server, config) -> None:
    with psycopg.connect(server.conninfo("durable")) as raw:
        assert raw.execute("SHOW synchronous_commit").fetchone()[0] == "off"  # what the server gives
    store = Store(config)
    try:
        assert session_setting(store) == "on"
        assert session_setting(store, ingest=True) == "on"
    finally:
        store.close()


def test_a_database_default_of_local_is_overridden_too(server, config) -> None:
    server.execute("ALTER DATABASE durable SET synchronous_commit = 'local'")
    store = Store(config)
    try:
        assert session_setting(store, ingest=True) == "on"
    finally:
        store.close()


def test_a_synchronous_standby_level_is_kept(server, config) -> None:
    # No standby exists: only read-only commits run here, which do not wait for one.
    reload(server, synchronous_standby_names="standby1")
    server.execute("ALTER DATABASE durable SET synchronous_commit = 'remote_apply'")
    store = Store(config)
    try:
        assert session_setting(store, ingest=True) == "remote_apply"
    finally:
        store.close()


def test_fsync_off_is_refused_unless_allowed(server, config) -> None:
    reload(server, fsync="off")
    store = Store(config)
    try:
        with pytest.raises(UnsafeDurability, match=r"fsync = off.*allow_unsafe_durability"):
            store.check_durability()
        with pytest.raises(UnsafeDurability):  # and from then on every transaction of that store
            with store.transaction():
                pass
    finally:
        store.close()
    allowed = Store(replace(config, allow_unsafe_durability=True))
    try:
        allowed.check_durability()
        assert session_setting(allowed, ingest=True) == "on"
    finally:
        allowed.close()


def test_fsync_turned_off_at_run_time_is_found_by_the_recheck_and_fails_every_transaction(
    server, config, caplog: pytest.LogCaptureFixture
) -> None:
    # red team (issue 23, item 10): ALTER SYSTEM SET fsync = off + reload under a running
    # listenerd went unnoticed, pooled connections were never checked again and AA went on.
    from include.store import db

    now = [1000.0]
    store = Store(config)
    store.clock = lambda: now[0]
    try:
        store.check_durability()
        with store.transaction() as tx:
            tx.conn.cursor().execute("SELECT 1")
        reload(server, fsync="off")
        now[0] += db.DURABILITY_RECHECK_SECONDS
        with caplog.at_level("ERROR", logger="include.store.db"):
            for ctx in (store.transaction, store.single_statement, store.transaction):  # ingest's too
                with pytest.raises(UnsafeDurability, match="fsync = off"):
                    with ctx():
                        pass
        assert "fsync = off" in (store.durability_problem or "")
        assert "store durability lost" in caplog.text
        reload(server, fsync="on")  # back on: accepted again after the next recheck
        now[0] += db.DURABILITY_RECHECK_SECONDS
        with store.transaction() as tx:
            tx.conn.cursor().execute("SELECT 1")
        assert store.durability_problem is None
    finally:
        store.close()


def test_the_recheck_runs_at_most_once_an_interval(server, config) -> None:
    from include.store import db

    now = [0.0]
    store = Store(config)
    store.clock = lambda: now[0]
    checks: list[float] = []
    real = store._pin_durability
    store._pin_durability = lambda conn: (checks.append(now[0]), real(conn))[1]  # type: ignore[method-assign]
    try:
        store.check_durability()
        checks.clear()
        for step in range(10):  # 10 transactions over 2.5 intervals
            now[0] = step * db.DURABILITY_RECHECK_SECONDS / 4
            with store.transaction(write=False):
                pass
        assert len(checks) == 2
    finally:
        store.close()


def test_allowed_unsafe_durability_is_not_refused_by_the_recheck(server, config) -> None:
    from include.store import db

    now = [0.0]
    store = Store(replace(config, allow_unsafe_durability=True))
    store.clock = lambda: now[0]
    try:
        store.check_durability()
        reload(server, fsync="off")
        now[0] += db.DURABILITY_RECHECK_SECONDS
        with store.transaction():
            pass
        assert store.durability_problem is None
    finally:
        store.close()


def test_fsync_on_passes_the_check(server, config) -> None:
    store = Store(config)
    try:
        store.check_durability()
    finally:
        store.close()


def test_listenerd_refuses_to_start_on_a_server_with_fsync_off(server, config, tmp_path) -> None:
    from include.app.lab.listenerd import Daemon

    store = Store(replace(config, allow_unsafe_durability=True))
    try:
        migrate(store, cluster_name="test-cluster")
    finally:
        store.close()
    reload(server, fsync="off")
    d = Daemon(tmp_path / "node", config, node_id="solo:1:du")
    with pytest.raises(RuntimeError, match="fsync = off"):
        d.start()
    assert d.proc is not None and d.proc.returncode != 0
    d.log.close()
    ok = Daemon(tmp_path / "node-allowed", replace(config, allow_unsafe_durability=True), node_id="solo:1:dv").start()
    try:
        assert ok.health()
    finally:
        ok.stop()


@pytest.mark.parametrize(
    "current, standbys, wanted",
    [
        ("off", "", "on"),
        ("local", "", "on"),
        ("on", "", None),
        ("remote_apply", "", "on"),
        ("off", "s1", "on"),
        ("local", "s1", "on"),
        ("on", "s1", None),
        ("remote_write", "s1", None),
        ("remote_apply", "FIRST 1 (s1, s2)", None),
        ("OFF", " ", "on"),
    ],
)
def test_postgres_synchronous_commit_decision(current: str, standbys: str, wanted: str | None) -> None:
    assert postgres_synchronous_commit(current, standbys) == wanted


def test_postgres_fsync_decision() -> None:
    assert postgres_refusal("on") is None
    assert "fsync = off" in (postgres_refusal("off") or "")


class FakeCursor:
    def __init__(self, row: dict[str, Any] | None) -> None:
        self.row, self.executed = row, []

    def execute(self, sql: str, params: Any = None) -> None:
        self.executed.append(sql)

    def fetchone(self) -> dict[str, Any] | None:
        return self.row


class FakeConn:
    def __init__(self, row: dict[str, Any] | None) -> None:
        self.cur = FakeCursor(row)
        self.committed = False

    def cursor(self) -> FakeCursor:
        return self.cur

    def commit(self) -> None:
        self.committed = True


@pytest.mark.parametrize("desc, refused", [("DISABLED", False), ("ALLOWED", False), ("FORCED", True), (None, False)])
def test_sqlserver_delayed_durability_forced_is_refused(desc: str | None, refused: bool) -> None:
    sql = durability_queries("sqlserver")
    conn = FakeConn({"delayed_durability": desc} if desc else None)
    if refused:
        with pytest.raises(UnsafeDurability, match="DELAYED_DURABILITY = FORCED"):
            check_connection(conn, "sqlserver", allow_unsafe=False)
    else:
        check_connection(conn, "sqlserver", allow_unsafe=False)
    check_connection(FakeConn({"delayed_durability": desc}), "sqlserver", allow_unsafe=True)
    assert conn.cur.executed == [sql["durability_settings"]] and conn.committed
    assert (sqlserver_refusal(desc) is not None) is refused


def test_sqlserver_durability_query_parses_as_tsql() -> None:
    import sqlglot

    text = durability_queries("sqlserver")["durability_settings"]
    tree = sqlglot.parse_one(text, read="tsql")
    assert "sys.databases" in tree.sql(dialect="tsql") and "DB_NAME()" in text


def pg_show(pgconn: Any, name: str) -> str:
    return pgconn.exec_(f"SHOW {name}".encode()).get_value(0, 0).decode()


def test_the_ingest_writers_own_connection_runs_with_synchronous_commit_on(server, config) -> None:
    # listenerd's group commit on PostgreSQL goes through its own libpq connection
    # (listeners.pgcommit), not the store's pool: it too must not inherit the server's `off`.
    from listeners import pgcommit

    store = Store(config)
    try:
        conninfo = {**store.dialect.conninfo(store.config), "client_encoding": "UTF8"}
    finally:
        store.close()
    pgconn = pgcommit._open(conninfo, [], allow_unsafe=False)
    try:
        assert pg_show(pgconn, "synchronous_commit") == "on"
    finally:
        pgconn.finish()
    reload(server, fsync="off")
    with pytest.raises(UnsafeDurability, match="fsync = off"):
        pgcommit._open(conninfo, [], allow_unsafe=False)
    pgconn = pgcommit._open(conninfo, [], allow_unsafe=True)
    pgconn.finish()


def test_listenerd_stops_acking_once_fsync_is_turned_off_under_it(server, config, tmp_path) -> None:
    """End to end (red team item 10): a running listenerd on a durable server answers AA; after
    `ALTER SYSTEM SET fsync = off` + reload it answers AE within a recheck interval (plus a
    heartbeat), the refused message is not stored, and /cluster/status, /metrics and the log say
    why. Before: AA went on for good. Takes about a minute (the recheck's interval)."""
    import time

    from hl7.client import MLLPClient

    from include.app.lab.postgres_server import free_port
    from include.store import db
    from tests.support.hostile import adt

    def ack_of(answer: str | bytes) -> str:
        return answer.decode() if isinstance(answer, bytes) else answer

    store = Store(config)
    try:
        migrate(store, cluster_name="test-cluster")
    finally:
        store.close()
    mllp = free_port()
    d = mllp_node(tmp_path / "node", config, node_id="solo:1:dw", port=mllp)
    try:
        with MLLPClient("127.0.0.1", mllp) as client:
            assert "MSA|AA|DUR0" in ack_of(client.send_message(adt("DUR0").decode()))
            reload(server, fsync="off")
            turned_off = time.monotonic()
            answers: list[str] = []
            while time.monotonic() - turned_off < db.DURABILITY_RECHECK_SECONDS + 20:
                n = len(answers) + 1
                ack = ack_of(client.send_message(adt(f"DUR{n}").decode()))
                answers.append("AE" if f"MSA|AE|DUR{n}" in ack else "AA" if f"MSA|AA|DUR{n}" in ack else ack)
                if answers[-1] == "AE":
                    break
                time.sleep(2)
            took = time.monotonic() - turned_off
        assert answers[-1] == "AE", answers
        assert took <= db.DURABILITY_RECHECK_SECONDS + 15, took  # the recheck, plus at most a heartbeat
        status = d.status()
        assert status["store_durable"] is False and "fsync = off" in status["durability_problem"]
        code, metrics = d.get("/metrics")
        assert code == 200 and b"\nstageline_store_durable 0.0" in metrics
        assert "store durability lost" in d.output()
    finally:
        d.stop()
    refused = f"DUR{len(answers)}"
    with psycopg.connect(server.conninfo("durable")) as conn:
        stored = {r[0] for r in conn.execute("SELECT control_id FROM stage_inbound")}
    assert "DUR0" in stored and refused not in stored
