"""A commit whose wait for the synchronous standby ends early is not confirmed (issue 28's red team,
docs/store.md "Across a database failover").

PostgreSQL returns such a COMMIT as successful, with a WARNING, though the standby may never get
it: the store raises `CommitUnconfirmed`, listenerd answers `AE`, the elector holds no epoch; and
a re-send recognised as already staged still waits for the standby before its `AA`.

A server of its own, whose `synchronous_standby_names` names a standby that never connects: while
`standby_gone` every commit that wrote WAL waits in SyncRep, as behind a cut replication link.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import PostgresServer, free_port, wait_for
from include.config import StoreConfig
from include.store import Store
from include.store.lease import LeaderElector
from include.store.migrate import migrate
from include.store.unconfirmed import CommitUnconfirmed, unconfirming
from tests.listeners.hl7_traffic import ack_fields, adt

pytestmark = pytest.mark.timeout(120)
CLUSTER = "test-cluster"


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    with PostgresServer() as srv:
        srv.execute("CREATE DATABASE stageline")
        store = Store(config_of(srv))
        try:
            migrate(store, cluster_name=CLUSTER)
        finally:
            store.close()
        srv.execute("CREATE TABLE probe (marker text)", dbname="stageline")
        yield srv


def config_of(srv: PostgresServer) -> StoreConfig:
    return StoreConfig(
        backend="postgres", server=srv.host, port=srv.port, database="stageline", username=srv.user, pool_size=4
    )


def admin(srv: PostgresServer, sql: str) -> list[tuple]:
    with psycopg.connect(srv.conninfo("stageline"), autocommit=True) as conn:
        cur = conn.execute(sql)
        return cur.fetchall() if cur.description else []


def waiting(srv: PostgresServer) -> list[int]:
    return [r[0] for r in admin(srv, "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'")]


def reload(srv: PostgresServer, names: str) -> None:
    """Set synchronous_standby_names and wait until the postmaster has it: a new session shows it,
    and every older one was signalled before that session began (it applies it at its next command)."""
    if names:
        srv.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
    else:
        srv.execute("ALTER SYSTEM RESET synchronous_standby_names")
    srv.execute("SELECT pg_reload_conf()")
    wait_for(lambda: admin(srv, "SHOW synchronous_standby_names") == [(names,)], timeout=10, what="reload")


@contextmanager
def standby_gone(srv: PostgresServer) -> Iterator[None]:
    """Every WAL-writing commit waits for a standby named 'ghost' (never there) until the block ends."""
    reload(srv, "ghost")
    try:
        yield
    finally:
        reload(srv, "")


def cancel_waiters(srv: PostgresServer) -> None:
    """As a DBA would: `pg_cancel_backend` every session waiting on SyncRep, once one is."""
    wait_for(lambda: waiting(srv), timeout=10, what="a commit waiting for the standby")
    admin(srv, "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")


def in_thread(work) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def cancelled(srv: PostgresServer, work) -> BaseException | None:
    """Run `work` while the standby is gone, cancel its wait as a DBA would; what it raised."""
    with standby_gone(srv):
        thread, out = in_thread(work)
        cancel_waiters(srv)
        thread.join(10)
    assert not thread.is_alive()
    return out.get("error")


@pytest.fixture
def store(server: PostgresServer) -> Iterator[Store]:
    """A store of its own on the server (its pool, its connections), closed after the test."""
    s = Store(config_of(server))
    yield s
    s.close()


def free_lease(srv: PostgresServer) -> None:
    admin(srv, "UPDATE leader_lease SET owner = NULL, expires_at = now() - interval '1 second' WHERE id = 1")


def test_only_a_warning_of_a_cancelled_or_terminated_wait_counts():
    assert unconfirming("WARNING", "01000") and unconfirming("WARNING", "57P01")
    assert not unconfirming("NOTICE", "01000")  # a NOTICE (e.g. "relation already exists, skipping")
    assert not unconfirming("WARNING", None) and not unconfirming("ERROR", "57P01")


@pytest.mark.parametrize("how", ["transaction", "single_statement"])
def test_a_commit_whose_standby_wait_is_cancelled_raises_though_the_server_kept_it(server, store, how):
    marker = f"cancelled-{how}"

    def commit() -> None:
        with getattr(store, how)() as tx:
            tx.script(f"INSERT INTO probe VALUES ('{marker}')")

    error = cancelled(server, commit)
    assert isinstance(error, CommitUnconfirmed) and "01000" in str(error), error
    # committed locally (the reason it must not be acknowledged: only this server has it)
    assert admin(server, f"SELECT count(*) FROM probe WHERE marker = '{marker}'") == [(1,)]
    with store.transaction() as tx:  # the connection goes on serving
        assert tx.row("db_now")["db_now"] > 0


def test_an_election_whose_commit_is_cancelled_holds_no_epoch(server, store):
    free_lease(server)
    before = admin(server, "SELECT epoch FROM leader_lease WHERE id = 1")[0][0]
    b = LeaderElector(store, node_id="b", ttl_seconds=3.0, fence_timeout_seconds=2.0)
    assert isinstance(cancelled(server, b.step), CommitUnconfirmed)
    # the primary granted epoch before+1, which a promotion may lose and grant again: not acted on
    assert admin(server, "SELECT epoch, owner FROM leader_lease WHERE id = 1") == [(before + 1, "b")]
    assert (b.is_leader, b.epoch, b.fence_deadline) == (False, None, None)


def test_a_renewal_whose_commit_is_cancelled_does_not_move_the_fence(server, store):
    free_lease(server)
    a = LeaderElector(store, node_id="a", ttl_seconds=20.0, fence_timeout_seconds=15.0)
    assert a.step().is_leader
    deadline = a.fence_deadline
    assert isinstance(cancelled(server, a.step), CommitUnconfirmed)
    assert a.fence_deadline == deadline  # the unconfirmed renewal bought no time


def mllp(port: int, control_id: str, *, timeout: float = 30) -> str:
    """Send one ADT message; MSA-1 of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"\x0b" + adt(control_id).encode() + b"\x1c\r")
        data = b""
        while not data.endswith(b"\x1c\r"):
            chunk = sock.recv(65536)
            assert chunk, "listenerd closed the connection without an answer"
            data += chunk
    return ack_fields(data)[0]


def test_listenerd_answers_ae_when_the_standby_wait_is_cancelled_and_the_resend_waits_for_the_standby(server, tmp_path):
    port = free_port()
    d = Daemon(
        tmp_path / "node",
        config_of(server),
        node_id="solo",
        inbound=[{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": port}],
    ).start()
    try:
        wait_for(lambda: d.status().get("is_leader"), timeout=30, what="leader")
        assert mllp(port, "U1") == "AA"
        with standby_gone(server):
            thread, out = in_thread(lambda: mllp(port, "U2"))
            cancel_waiters(server)
            thread.join(15)
            assert out.get("value") == "AE", out  # it was: AA, on this server only
            # The sender resends. Already staged, so nothing new to write: yet its answer waits for
            # the standby (it was: AA at once, the first copy still on one server).
            thread, out = in_thread(lambda: mllp(port, "U2"))
            wait_for(lambda: waiting(server), timeout=10, what="the re-send waiting for the standby")
            assert "value" not in out
        thread.join(15)  # the standby is "back" (none required): the re-send's commit returns
        assert out.get("value") == "AA", out
        assert admin(server, "SELECT count(*) FROM stage_inbound WHERE control_id = 'U2'") == [(1,)]
    finally:
        d.stop()
