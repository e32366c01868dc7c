"""Database-poll inbound across a failover: two `listenerd` processes on one PostgreSQL store poll a
source table in another PostgreSQL database while rows keep arriving; the leader is SIGKILLed in
the middle. Only the leader polls, and every source row is staged exactly once — by whichever
node read it first — for both strategies (a watermark in the store, a mark UPDATE in the source)."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import PostgresServer, wait_for
from include.store import Store
from listeners.dbpoll import row_message_id
from tests.listeners.test_dbpoll import hl7, source_db  # noqa: F401  (the fixture)
from tests.support.nodes import fast_cluster
from tests.support.queries import rows_of

CLUSTER = fast_cluster()
ROWS = 600
STRATEGIES = {
    "watermark": {"query": "SELECT id, hl7 FROM outbox WHERE id > :watermark ORDER BY id LIMIT :limit"},
    # The mark is slowed down (10 ms a row, one transaction a poll) so that the kill most likely
    # lands between a poll's staging commit and its marks: the rows in between are read again by
    # the new leader, and must not be staged again.
    "mark": {
        "strategy": "mark",
        "query": "SELECT id, hl7 FROM outbox WHERE status = 'new' ORDER BY id LIMIT :limit",
        "mark": "UPDATE outbox SET status = 'sent' WHERE id = :key AND (SELECT true FROM pg_sleep(0.01))",
    },
}


def in_between(store_config: Any, server: PostgresServer, db: str, strategy: str) -> int:
    """Rows staged but not yet advanced past (marked, or under the watermark): what a new leader reads again."""
    staged = {r["message_id"] for r in received(store_config)}
    with psycopg.connect(server.conninfo(db)) as conn:
        if strategy == "mark":
            keys = [r[0] for r in conn.execute("SELECT id FROM outbox WHERE status = 'new'").fetchall()]
        else:
            store = Store(store_config)
            try:
                with store.transaction(write=False) as tx:
                    row = tx.one("watermark_get", {"connection": "lab-db"})
            finally:
                store.close()
            mark = int(row["watermark"]) if row else 0
            keys = [r[0] for r in conn.execute("SELECT id FROM outbox WHERE id > %s", (mark,)).fetchall()]
    return sum(1 for k in keys if row_message_id("lab-db", k) in staged)


class Feeder(threading.Thread):
    """Inserts `ROWS` source rows, a few at a time, as an application would."""

    def __init__(self, server: PostgresServer, db: str) -> None:
        super().__init__(daemon=True)
        self.server, self.db = server, db
        self.inserted = 0

    def run(self) -> None:
        with psycopg.connect(self.server.conninfo(self.db), autocommit=True) as conn:
            while self.inserted < ROWS:
                batch = [hl7(n) for n in range(self.inserted + 1, self.inserted + 6)]
                with conn.cursor() as cur:
                    cur.executemany("INSERT INTO outbox (hl7) VALUES (%s)", [(m,) for m in batch])
                self.inserted += len(batch)
                time.sleep(0.02)


def received(store_config: Any) -> list[dict[str, Any]]:
    """Each staged row's message id and the node whose 'received' event staged it."""
    return rows_of(
        store_config,
        "SELECT i.message_id, e.node_id FROM stage_inbound i "
        "JOIN message_events e ON e.row_id = i.id AND e.stage = 'inbound' "
        "AND e.event = 'received' ORDER BY i.id",
    )


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_source_row_is_staged_exactly_once_across_a_leader_kill(
    tmp_path, pg_config_fresh, pg_server, source_db, strategy
):
    conn = {
        "name": "lab-db",
        "kind": "database",
        "poll_seconds": 0.05,
        "lane_key": "PID-3",
        "database": {
            "backend": "postgres",
            "server": pg_server.host,
            "port": pg_server.port,
            "database": source_db,
            "username": pg_server.user,
            "key_column": "id",
            "message_column": "hl7",
            "batch_size": 25,
            **STRATEGIES[strategy],
        },
    }
    a = Daemon(tmp_path / "a", pg_config_fresh, node_id="node-a:1:aa", cluster=CLUSTER, inbound=[conn]).start()
    b = None
    feeder = Feeder(pg_server, source_db)
    try:
        wait_for(lambda: a.status()["is_leader"], timeout=15, what="node A to lead")
        b = Daemon(
            tmp_path / "b", pg_config_fresh, node_id="node-b:2:bb", cluster=CLUSTER, config_dir=a.workdir / "config"
        ).start()
        wait_for(lambda: b.status()["role"] == "standby", timeout=15, what="node B to stand by")
        feeder.start()
        wait_for(lambda: len(received(pg_config_fresh)) >= ROWS // 4, timeout=30, what="A staging rows")
        assert "staged" not in b.output()  # the standby polls nothing
        a.kill()  # in the middle of the feed, most likely in the middle of a poll
        killed_at = feeder.inserted
        reread = in_between(pg_config_fresh, pg_server, source_db, strategy)
        wait_for(lambda: b.status()["is_leader"], timeout=15, what="node B to take over")
        feeder.join(30)
        wait_for(lambda: len(received(pg_config_fresh)) >= ROWS, timeout=60, what="every row staged")
        time.sleep(0.5)  # a few more polls: nothing more may come
        rows = received(pg_config_fresh)
    finally:
        a.stop()
        if b is not None:
            b.stop()

    expected = [row_message_id("lab-db", n) for n in range(1, ROWS + 1)]
    assert [r["message_id"] for r in rows] == expected  # each row once, in source order
    by_node = {node: sum(1 for r in rows if r["node_id"] == node) for node in ("node-a:1:aa", "node-b:2:bb")}
    assert by_node["node-a:1:aa"] > 0 and by_node["node-b:2:bb"] > 0 and sum(by_node.values()) == ROWS
    print(
        f"{strategy}: {ROWS} rows, leader killed after {killed_at} inserted, {reread} staged but not yet "
        f"advanced past; staged by A {by_node['node-a:1:aa']}, by B {by_node['node-b:2:bb']}, none twice"
    )
    if strategy == "mark":
        assert reread > 0  # the kill did land between a staging commit and its marks
    with psycopg.connect(pg_server.conninfo(source_db)) as db:
        if strategy == "mark":
            assert db.execute("SELECT status, count(*) FROM outbox GROUP BY status").fetchall() == [("sent", ROWS)]
    if strategy == "watermark":
        store = Store(pg_config_fresh)
        try:
            with store.transaction(write=False) as tx:
                assert tx.one("watermark_get", {"connection": "lab-db"}) == {"watermark": str(ROWS)}
        finally:
            store.close()
