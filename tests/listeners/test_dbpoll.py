"""Database-poll inbound (`listeners/dbpoll.py`): its settings checked at load, and polls of a real
PostgreSQL (and SQLite) source table into the real store through the real group-commit writer:
the watermark and mark strategies, a crash between staging and the advance, a deposed leader, rows
that cannot be staged. The failover across two `listenerd` processes is tests/listeners/test_dbpoll_failover.py."""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool
from twisted.trial import unittest as trial

from include.app.lab.postgres_server import PostgresServer
from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from listeners.connections_config import ConnectionConfigError, DatabaseSource, InboundConfig, load_config_dir
from listeners.dbpoll import DbPoll, SourceDatabase, row_message_id
from listeners.group_commit import IngestWriter
from listeners.metrics import Metrics
from tests.support.queries import rows_of

_sources = itertools.count()


def hl7(n: int) -> str:
    return f"MSH|^~\\&|LIS|LAB|EHR|HOSP|20240101||ORU^R01|LAB{n:04d}|P|2.5\rPID|1||P{n % 3}||DOE^JANE\r"


@pytest.fixture
def source_db(pg_server: PostgresServer) -> Iterator[str]:
    """A separate database on the test server, with the source table `outbox`."""
    name = f"source{next(_sources)}"
    pg_server.execute(f"CREATE DATABASE {name}")
    with psycopg.connect(pg_server.conninfo(name), autocommit=True) as db:
        db.execute(
            "CREATE TABLE outbox (id bigserial PRIMARY KEY, hl7 text NOT NULL, status text NOT NULL DEFAULT 'new')"
        )
    yield name
    pg_server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def insert(server: PostgresServer, db: str, messages: list[str]) -> None:
    with psycopg.connect(server.conninfo(db), autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO outbox (hl7) VALUES (%s)", [(m,) for m in messages])


def source(server: PostgresServer, db: str, **overrides: Any) -> DatabaseSource:
    values: dict[str, Any] = {
        "backend": "postgres",
        "server": server.host,
        "port": server.port,
        "database": db,
        "username": server.user,
        "key_column": "id",
        "message_column": "hl7",
        "batch_size": 10,
        "query": "SELECT id, hl7 FROM outbox WHERE id > :watermark ORDER BY id LIMIT :limit",
    }
    values.update(overrides)
    return DatabaseSource(**values)


def staged(config: StoreConfig) -> list[dict[str, Any]]:
    return rows_of(
        config, "SELECT message_id, control_id, connection, lane_key, payload FROM inbound_messages ORDER BY id"
    )


# -- settings ------------------------------------------------------------------------------------


def write_conf(tmp_path: Path, body: str) -> Path:
    (tmp_path / "connections.toml").write_text(body)
    return tmp_path


GOOD = """
[[inbound]]
name = "lab-db"
kind = "database"
poll_seconds = 2
lane_key = "PID-3"

[inbound.database]
backend = "postgres"
server = "lis.example"
database = "lis"
username = "reader"
password_env = "LIS_DB_PASSWORD"
query = "SELECT id, hl7 FROM outbox WHERE id > :watermark ORDER BY id LIMIT :limit"
key_column = "id"
message_column = "hl7"
"""


def test_a_database_connection_loads_with_its_source(tmp_path: Path) -> None:
    conn = load_config_dir(write_conf(tmp_path, GOOD)).inbound[0]
    assert conn.kind == "database" and conn.poll_seconds == 2.0
    assert conn.database == DatabaseSource(
        backend="postgres",
        server="lis.example",
        database="lis",
        username="reader",
        password_env="LIS_DB_PASSWORD",
        query="SELECT id, hl7 FROM outbox WHERE id > :watermark ORDER BY id LIMIT :limit",
        key_column="id",
        message_column="hl7",
    )


@pytest.mark.parametrize(
    "change,error",
    [
        (
            ('backend = "postgres"', 'backend = "oracle"'),
            "database.backend: must be one of 'postgres', 'sqlserver', 'sqlite'",
        ),
        (
            ('username = "reader"', 'password = "secret"'),
            "database.password: a password in the config file is refused "
            "\\(put the password in an environment variable",
        ),
        (("WHERE id > :watermark ", ""), 'strategy = "watermark" needs :watermark in query'),
        (("SELECT id, hl7", "DELETE FROM outbox; SELECT id, hl7"), "query must be a SELECT"),
        (("LIMIT :limit", "LIMIT :n"), "query takes only :limit, :watermark, got :n"),
        (('key_column = "id"', 'key_column = "id; DROP TABLE x"'), "database.key_column: must be an identifier"),
        (('key_column = "id"', 'strategy = "mark"'), "query takes only :limit, got :watermark"),
        (('key_column = "id"', "batch_size = 0"), "database.batch_size: must be > 0"),
        (
            ('key_column = "id"', 'mark = "UPDATE outbox SET status = 1 WHERE id = :key"'),
            'mark and reject belong to strategy = "mark"',
        ),
        (('database = "lis"', "port = 5432"), "database.database: required, not set"),
        (("poll_seconds = 2", "poll_seconds = 0"), "poll_seconds: must be >= 0.05"),
    ],
)
def test_bad_database_settings_are_refused_at_load_naming_the_setting(
    tmp_path: Path, change: tuple[str, str], error: str
) -> None:
    with pytest.raises(ConnectionConfigError, match=error) as info:
        load_config_dir(write_conf(tmp_path, GOOD.replace(*change)))
    assert "'lab-db'" in str(info.value)


def test_a_database_connection_without_its_source_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConnectionConfigError,
        match=r"inbound\[0\]\.database: a database connection needs an \[inbound.database\] table",
    ):
        load_config_dir(write_conf(tmp_path, GOOD.split("[inbound.database]")[0]))


def test_the_mark_strategy_needs_an_update_taking_key(tmp_path: Path) -> None:
    mark = GOOD.replace("WHERE id > :watermark ", "WHERE status = 'new' ") + 'strategy = "mark"\n'
    with pytest.raises(ConnectionConfigError, match="needs mark = an UPDATE that takes only :key"):
        load_config_dir(write_conf(tmp_path, mark))
    ok = load_config_dir(write_conf(tmp_path, mark + "mark = \"UPDATE outbox SET status = 'sent' WHERE id = :key\"\n"))
    assert ok.inbound[0].database.strategy == "mark"


def test_the_row_message_id_is_the_connection_and_the_key() -> None:
    assert row_message_id("a", 1) == row_message_id("a", 1) != row_message_id("b", 1)
    assert row_message_id("a", 1) != row_message_id("a", "1") != row_message_id("a", 2)
    assert len(row_message_id("a", 1)) == 32


# -- scheduling, on a fake clock ----------------------------------------------------------------


class FakeSource:
    """A source table in memory (the mark strategy: marked rows are not read again)."""

    def __init__(self, n: int) -> None:
        self.rows = [{"id": i, "hl7": hl7(i)} for i in range(1, n + 1)]
        self.marked: list[Any] = []
        self.fetches = 0

    def fetch(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        self.fetches += 1
        return [r for r in self.rows if r["id"] not in self.marked][: params["limit"]]

    def mark(self, done: list[Any], rejected: list[Any]) -> None:
        self.marked += done + rejected

    def close(self) -> None:
        pass


class AutoIngest:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def submit(self, item: Any) -> Any:
        from twisted.internet.defer import succeed

        self.items.append(item)
        return succeed(item.message_id)


def test_a_full_batch_is_followed_at_once_and_nothing_polls_outside_start_and_stop() -> None:
    from twisted.internet.defer import maybeDeferred

    clock, fake, ingest = MemoryReactorClock(), FakeSource(25), AutoIngest()
    src = DatabaseSource(
        database="x",
        strategy="mark",
        batch_size=10,
        query="SELECT 1 LIMIT :limit",
        mark="UPDATE t SET s = 1 WHERE id = :key",
    )
    poller = DbPoll(
        ingest,
        InboundConfig(name="db", kind="database", poll_seconds=5.0, database=src),
        store=lambda: None,
        epoch=lambda: 1,
        reactor=clock,
        run_blocking=maybeDeferred,
        source=fake,
    )  # type: ignore[arg-type]
    clock.advance(60)
    assert fake.fetches == 0  # not started: no poll
    poller.start()
    clock.advance(0)  # 10 (full: next at once), 10 (full), 5 (short: wait poll_seconds)
    assert fake.fetches == 3 and len(ingest.items) == 25 and fake.marked == list(range(1, 26))
    clock.advance(4.9)
    assert fake.fetches == 3
    clock.advance(0.1)
    assert fake.fetches == 4
    poller.stop()
    clock.advance(60)
    assert fake.fetches == 4 and not poller.running


def test_a_key_that_repeats_stops_the_feed_instead_of_losing_a_row() -> None:
    from twisted.internet.defer import maybeDeferred

    fake, ingest = FakeSource(3), AutoIngest()
    fake.rows[1]["id"] = 1
    src = DatabaseSource(
        database="x", strategy="mark", query="SELECT 1 LIMIT :limit", mark="UPDATE t SET s = 1 WHERE id = :key"
    )
    poller = DbPoll(
        ingest,
        InboundConfig(name="db", kind="database", database=src),
        store=lambda: None,
        epoch=lambda: 1,
        reactor=MemoryReactorClock(),
        run_blocking=maybeDeferred,
        source=fake,
    )  # type: ignore[arg-type]
    poller.poll()
    assert ingest.items == [] and fake.marked == []


def test_without_the_lease_a_poll_reads_nothing() -> None:
    from twisted.internet.defer import maybeDeferred

    fake = FakeSource(3)
    src = DatabaseSource(
        database="x", strategy="mark", query="SELECT 1 LIMIT :limit", mark="UPDATE t SET s = 1 WHERE id = :key"
    )
    poller = DbPoll(
        AutoIngest(),
        InboundConfig(name="db", kind="database", database=src),
        store=lambda: None,
        epoch=lambda: None,
        reactor=MemoryReactorClock(),
        run_blocking=maybeDeferred,
        source=fake,
    )  # type: ignore[arg-type]
    poller.poll()
    assert fake.fetches == 0 and fake.marked == []


# -- against a real source and the real store ------------------------------------------------------


@inlineCallbacks
def polls(poller: DbPoll, n: int) -> Any:
    """What each of `n` polls in a row returned."""
    out = []
    for _ in range(n):
        out.append((yield poller.poll()))
    return out


class DbPollStoreTests(trial.TestCase):
    """The real IngestWriter and store (SQLite), a real PostgreSQL source; work in a real thread pool.
    Each test drives the polls itself (the poller's own clock never fires)."""

    @pytest.fixture(autouse=True)
    def _fixtures(
        self, sqlite_config_fresh: StoreConfig, pg_server: PostgresServer, source_db: str, tmp_path: Path
    ) -> None:
        self.store_config = sqlite_config_fresh
        self.server = pg_server
        self.db = source_db
        self.tmp = tmp_path

    def _poller(self, src: DatabaseSource, *, leader: bool = True) -> DbPoll:
        self.store = Store(self.store_config)
        self.addCleanup(self.store.close)
        self.epoch = acquire_permanent(self.store, node_id="n") if leader else None
        writer = IngestWriter(self.store, node_id="n", epoch=lambda: self.epoch, metrics=Metrics(), reactor=reactor)
        writer.start()
        self.addCleanup(writer.stop)
        pool = ThreadPool(minthreads=0, maxthreads=2, name="dbpoll-test")
        pool.start()
        self.addCleanup(pool.stop)
        conn = InboundConfig(name="lab-db", kind="database", lane_key="PID-3", database=src)
        from listeners.validation import lane_rule

        poller = DbPoll(
            writer,
            conn,
            store=lambda: self.store,
            epoch=lambda: self.epoch,
            lane_of=lane_rule("PID-3"),
            reactor=MemoryReactorClock(),
            run_blocking=partial(deferToThreadPool, reactor, pool),
        )
        self.addCleanup(poller.source.close)
        return poller

    def _watermark(self) -> Any:
        with self.store.transaction(write=False) as tx:
            row = tx.one("watermark_get", {"connection": "lab-db"})
        return json.loads(row["watermark"]) if row else None

    @inlineCallbacks
    def test_watermark_polls_stage_every_row_once_in_key_order_and_move_the_mark(self) -> Any:
        insert(self.server, self.db, [hl7(n) for n in range(1, 26)])
        poller = self._poller(source(self.server, self.db))
        assert (yield polls(poller, 4)) == [10, 10, 5, 0]
        rows = staged(self.store_config)
        assert [r["message_id"] for r in rows] == [row_message_id("lab-db", n) for n in range(1, 26)]
        assert [r["control_id"] for r in rows] == [f"LAB{n:04d}" for n in range(1, 26)]
        assert rows[0] == {
            "message_id": row_message_id("lab-db", 1),
            "control_id": "LAB0001",
            "connection": "lab-db",
            "lane_key": "P1",
            "payload": hl7(1),
        }
        assert self._watermark() == 25

    @inlineCallbacks
    def test_the_mark_strategy_marks_each_staged_row_in_the_source(self) -> Any:
        insert(self.server, self.db, [hl7(n) for n in range(1, 13)])
        poller = self._poller(
            source(
                self.server,
                self.db,
                strategy="mark",
                query="SELECT id, hl7 FROM outbox WHERE status = 'new' ORDER BY id LIMIT :limit",
                mark="UPDATE outbox SET status = 'sent' WHERE id = :key",
            )
        )
        assert (yield polls(poller, 3)) == [10, 2, 0]
        assert len(staged(self.store_config)) == 12
        with psycopg.connect(self.server.conninfo(self.db)) as db:
            assert db.execute("SELECT status, count(*) FROM outbox GROUP BY status").fetchall() == [("sent", 12)]
        assert self._watermark() is None  # the mark strategy keeps no watermark

    @inlineCallbacks
    def test_a_crash_between_staging_and_the_advance_rereads_the_rows_and_stages_none_twice(self) -> Any:
        insert(self.server, self.db, [hl7(n) for n in range(1, 8)])
        poller = self._poller(source(self.server, self.db))
        real = poller._write_watermark
        poller._write_watermark = lambda key, epoch: (_ for _ in ()).throw(OSError("crashed"))  # type: ignore
        assert (yield poller.poll()) == 0  # staged, but the watermark was not moved
        assert len(staged(self.store_config)) == 7 and self._watermark() is None
        poller._write_watermark = real  # type: ignore[method-assign]
        assert (yield poller.poll()) == 7  # read again: skipped as already staged, then the mark moves
        assert [r["message_id"] for r in staged(self.store_config)] == [
            row_message_id("lab-db", n) for n in range(1, 8)
        ]
        assert self._watermark() == 7
        assert (yield poller.poll()) == 0

    @inlineCallbacks
    def test_a_row_read_again_after_retention_archived_and_purged_its_message_is_not_staged_again(self) -> Any:
        from include.housekeeping import retention
        from tests.dags.stores import age, execute

        insert(self.server, self.db, [hl7(1), hl7(2)])
        poller = self._poller(
            source(
                self.server,
                self.db,
                strategy="mark",
                query="SELECT id, hl7 FROM outbox WHERE status = 'new' ORDER BY id LIMIT :limit",
                mark="UPDATE outbox SET status = 'sent' WHERE id = :key",
            )
        )
        poller.source.mark = lambda done, rejected: (_ for _ in ()).throw(OSError("no UPDATE grant"))  # type: ignore
        assert (yield poller.poll()) == 0  # staged, never marked (the reader lacks the grant)
        execute(self.store, "UPDATE stage_inbound SET status = 'done'")
        age(self.store, "stage_inbound", "updated_at", "1 = 1", 8 * 86_400)
        assert retention(self.store, self.epoch, {"inbound": 7 * 86_400})["inbound"] == 2  # archived, purged
        del poller.source.mark  # the grant is fixed
        assert (yield poller.poll()) == 2
        assert staged(self.store_config) == []  # not staged again: the archive has them
        with psycopg.connect(self.server.conninfo(self.db)) as db:
            assert db.execute("SELECT count(*) FROM outbox WHERE status = 'sent'").fetchone() == (2,)

    @inlineCallbacks
    def test_a_node_without_the_lease_stages_nothing_and_moves_nothing(self) -> Any:
        insert(self.server, self.db, [hl7(1)])
        poller = self._poller(source(self.server, self.db), leader=False)
        assert (yield poller.poll()) == 0
        assert staged(self.store_config) == [] and self._watermark() is None

    @inlineCallbacks
    def test_a_deposed_leader_cannot_move_the_watermark(self) -> Any:
        insert(self.server, self.db, [hl7(1), hl7(2)])
        poller = self._poller(source(self.server, self.db))
        stale = self.epoch
        acquire_permanent(self.store, node_id="other")  # a new leader; this poller still holds the old epoch
        self.epoch = stale
        assert (yield poller.poll()) == 0
        assert staged(self.store_config) == [] and self._watermark() is None

    @inlineCallbacks
    def test_a_row_that_cannot_be_staged_is_passed_over_and_marked_rejected(self) -> Any:
        insert(self.server, self.db, [hl7(1), "", hl7(3)])
        poller = self._poller(
            source(
                self.server,
                self.db,
                strategy="mark",
                query="SELECT id, hl7 FROM outbox WHERE status = 'new' ORDER BY id LIMIT :limit",
                mark="UPDATE outbox SET status = 'sent' WHERE id = :key",
                reject="UPDATE outbox SET status = 'rejected' WHERE id = :key",
            )
        )
        assert (yield poller.poll()) == 3
        assert [r["control_id"] for r in staged(self.store_config)] == ["LAB0001", "LAB0003"]
        with psycopg.connect(self.server.conninfo(self.db)) as db:
            assert db.execute("SELECT id, status FROM outbox ORDER BY id").fetchall() == [
                (1, "sent"),
                (2, "rejected"),
                (3, "sent"),
            ]

    @inlineCallbacks
    def test_a_source_that_cannot_be_reached_is_retried_every_poll(self) -> Any:
        insert(self.server, self.db, [hl7(1)])
        poller = self._poller(source(self.server, self.db, port=1, connect_timeout_seconds=1.0))
        assert (yield poller.poll()) == 0
        poller.source = SourceDatabase(source(self.server, self.db))
        self.addCleanup(poller.source.close)
        assert (yield poller.poll()) == 1

    @inlineCallbacks
    def test_a_sqlite_source_and_a_whole_row_as_json(self) -> Any:
        path = self.tmp / "source.db"
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE orders (order_no TEXT PRIMARY KEY, patient TEXT, qty INTEGER)")
            db.executemany("INSERT INTO orders VALUES (?, ?, ?)", [("A-1", "Doe", 2), ("A-2", "Roe", 1)])
        poller = self._poller(
            DatabaseSource(
                backend="sqlite",
                database=str(path),
                key_column="order_no",
                query="SELECT order_no, patient, qty FROM orders WHERE order_no > :watermark ORDER BY order_no "
                "LIMIT :limit",
                start_after="",
            )
        )
        assert (yield poller.poll()) == 2
        assert [json.loads(r["payload"]) for r in staged(self.store_config)] == [
            {"order_no": "A-1", "patient": "Doe", "qty": 2},
            {"order_no": "A-2", "patient": "Roe", "qty": 1},
        ]
        assert self._watermark() == "A-2"
        assert (yield poller.poll()) == 0


def test_source_database_reads_and_marks_a_postgres_table(pg_server: PostgresServer, source_db: str) -> None:
    insert(pg_server, source_db, [hl7(1), hl7(2)])
    db = SourceDatabase(
        source(
            pg_server,
            source_db,
            strategy="mark",
            query="SELECT id, hl7 FROM outbox WHERE status = 'new' ORDER BY id LIMIT :limit",
            mark="UPDATE outbox SET status = 'sent' WHERE id = :key",
        )
    )
    try:
        assert db.fetch({"limit": 10}) == [{"id": 1, "hl7": hl7(1)}, {"id": 2, "hl7": hl7(2)}]
        db.mark([1], [])
        assert db.fetch({"limit": 10}) == [{"id": 2, "hl7": hl7(2)}]
    finally:
        db.close()
