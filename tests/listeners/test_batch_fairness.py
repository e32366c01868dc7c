"""A huge HL7 batch makes no other sender wait, and an answer means what it says (issue 23).

Real MLLP sockets, the real MLLP handlers (`listeners.endpoints`), the real group-commit writer and a
real store, on a reactor of the test's own running in a thread:

* one connection sends a batch of 40,000 messages (SQLite) / 20,000 (PostgreSQL) while a second
  connection sends one message at a time: the second sender's longest wait for its AA is at most
  1 s, the batch is answered AA once all its rows are in (before: one commit of the whole batch —
  minutes on SQLite, every other sender AE at 60 s; 35.6 s on PostgreSQL);
* a batch over `max_batch_messages` is refused with AR, nothing staged, the other sender unharmed;
* a commit that outlives the handler's timeout (the SQLite write lock held by the test): the
  sender gets AE "not confirmed", the message lands later, and its re-send — during the commit or
  after it — is answered AA with the first copy's id: one row (before: a second row).
"""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from twisted.internet.epollreactor import EPollReactor

from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from listeners.connections_config import InboundConfig
from listeners.endpoints import Wiring, mllp_batch_handler, mllp_handler
from listeners.group_commit import IngestWriter, ReactorIngestWriter
from listeners.metrics import Metrics
from listeners.mllp_listener import MLLPConfig, MLLPFactory, frame


class Node:
    """The MLLP intake of one listenerd, in-process: handlers, writer and store as the daemon wires them."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        writer: str,
        handler_timeout: float = 60.0,
        batch_ack: str = "batch",
        **writer_kw: Any,
    ) -> None:
        self.reactor = EPollReactor()
        self.store = Store(config)
        epoch = acquire_permanent(self.store, node_id="n")
        metrics = Metrics()
        kind = IngestWriter if writer == "thread" else ReactorIngestWriter
        self.writer: Any = kind(
            self.store, node_id="n", epoch=lambda: epoch, metrics=metrics, reactor=self.reactor, **writer_kw
        )
        conn = InboundConfig(name="in-mllp", kind="mllp", batch_ack=batch_ack)
        wiring = Wiring(ingest=self.writer, metrics=metrics, reactor=self.reactor, bound_ports={})
        factory = MLLPFactory(
            mllp_handler(conn, wiring, None),
            clock=self.reactor,
            config=MLLPConfig(handler_timeout_seconds=handler_timeout),
            batch_handler=mllp_batch_handler(conn, wiring, None),
        )
        self.port = self.reactor.listenTCP(0, factory, interface="127.0.0.1").getHost().port
        if writer == "thread":
            self.writer.start()
        else:
            self.reactor.callWhenRunning(self.writer.start)
        self.thread = threading.Thread(target=self.reactor.run, kwargs={"installSignalHandlers": False}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.reactor.callFromThread(self.reactor.stop)
        self.thread.join(30)
        if isinstance(self.writer, IngestWriter):
            self.writer.stop()
        else:
            self.writer._stager.close()
        self.store.close()

    def count(self, sql: str = "SELECT count(*) AS n FROM stage_inbound") -> int:
        with self.store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(sql)
            return int(dict(cur.fetchone())["n"])


def msg(cid: str) -> bytes:
    return f"MSH|^~\\&|A|B|C|D|20240101||ADT^A01|{cid}|P|2.5\r".encode()


def hl7_batch(n: int, name: str = "B1") -> bytes:
    body = b"".join(msg(f"{name}-{k}") for k in range(n))
    return f"BHS|^~\\&|A|B|C|D|20240101||||{name}\r".encode() + body + f"BTS|{n}\r".encode()


def exchange(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(frame(data))
    reply = b""
    while not reply.endswith(b"\x1c\r"):
        chunk = sock.recv(1 << 20)
        assert chunk, "connection closed without an answer"
        reply += chunk
    return reply


def msa(reply: bytes) -> tuple[str, str]:
    """(MSA-1, MSA-2) of the first ACK in `reply`."""
    seg = reply[reply.index(b"MSA|") :].split(b"\r", 1)[0].decode().split("|")
    return seg[1], seg[2]


class OtherSender(threading.Thread):
    """A second connection sending one message at a time, each after the last one's answer."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.waits: list[float] = []
        self.codes: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=120) as s:
            n = 0
            while not self.stop.is_set():
                n += 1
                started = time.perf_counter()
                code, _ = msa(exchange(s, msg(f"other-{n}")))
                self.waits.append(time.perf_counter() - started)
                self.codes.append(code)
                time.sleep(0.01)


def with_big_batch(node: Node, n: int) -> tuple[bytes, OtherSender, float]:
    """Send an n-message batch on one connection while another sender runs; (answer, sender, seconds)."""
    other = OtherSender(node.port)
    other.start()
    time.sleep(0.3)  # the other sender is under way before the batch arrives
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", node.port), timeout=300) as s:
        answer = exchange(s, hl7_batch(n))
    took = time.perf_counter() - started
    time.sleep(0.3)
    other.stop.set()
    other.join(30)
    return answer, other, took


@pytest.fixture
def sqlite_node(sqlite_config_fresh: StoreConfig) -> Iterator[Node]:
    node = Node(sqlite_config_fresh, writer="thread")
    yield node
    node.close()


@pytest.fixture(params=["reactor", "thread"])
def pg_node(request, pg_config_fresh: StoreConfig) -> Iterator[Node]:
    node = Node(pg_config_fresh, writer=request.param)
    yield node
    node.close()


def test_a_40000_message_batch_on_sqlite_is_staged_while_another_sender_never_waits_over_1s(sqlite_node):
    answer, other, took = with_big_batch(sqlite_node, 40_000)
    assert msa(answer) == ("AA", "B1")
    assert sqlite_node.count() == 40_000 + len(other.codes)
    assert other.codes and set(other.codes) == {"AA"}
    print(
        f"\nsqlite 40,000-message batch: AA after {took:.2f} s; other sender {len(other.waits)} AA, "
        f"max wait {max(other.waits) * 1000:.0f} ms"
    )
    assert max(other.waits) <= 1.0, f"the other sender waited {max(other.waits):.2f} s"


def test_a_20000_message_batch_on_postgresql_is_staged_while_another_sender_never_waits_over_1s(pg_node):
    answer, other, took = with_big_batch(pg_node, 20_000)
    assert msa(answer) == ("AA", "B1")
    assert pg_node.count() == 20_000 + len(other.codes)
    assert other.codes and set(other.codes) == {"AA"}
    print(
        f"\npostgres ({type(pg_node.writer).__name__}) 20,000-message batch: AA after {took:.2f} s; other sender "
        f"{len(other.waits)} AA, max wait {max(other.waits) * 1000:.0f} ms"
    )
    assert max(other.waits) <= 1.0, f"the other sender waited {max(other.waits):.2f} s"


def test_an_ack_batch_of_40000_acks_keeps_the_other_sender_under_1s(sqlite_config_fresh):
    node = Node(sqlite_config_fresh, writer="thread", batch_ack="messages")
    try:
        answer, other, _ = with_big_batch(node, 40_000)
    finally:
        node.close()
    assert answer.count(b"MSA|AA|") == 40_000 and set(other.codes) == {"AA"}
    assert max(other.waits) <= 1.0, f"the other sender waited {max(other.waits):.2f} s"


def test_a_batch_over_max_batch_messages_is_refused_with_ar_and_nothing_staged(sqlite_config_fresh):
    node = Node(sqlite_config_fresh, writer="thread", max_batch_messages=30_000)
    try:
        answer, other, _ = with_big_batch(node, 40_000)
        assert msa(answer)[0] == "AR" and b"at most 30000 messages per batch" in answer
        assert node.count() == len(other.codes) and set(other.codes) == {"AA"}
        assert max(other.waits) <= 1.0
    finally:
        node.close()


# -- answers that mean what they say ------------------------------------------------------------------------


class HeldLock:
    """SQLite's write lock, held by another connection (a stage job's long transaction) until released."""

    def __init__(self, path: str) -> None:
        self.conn: sqlite3.Connection | None = sqlite3.connect(
            path, timeout=0, isolation_level=None, check_same_thread=False
        )
        self.conn.execute("BEGIN IMMEDIATE")
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self.conn is not None:
                self.conn.execute("COMMIT")
                self.conn.close()
                self.conn = None


@pytest.fixture
def slow_node(sqlite_config_fresh: StoreConfig) -> Iterator[Node]:
    """A handler timeout of 1 s; the writer keeps trying a busy store for 20 s (each try 0.2 s)."""
    config = replace(sqlite_config_fresh, busy_timeout_ms=200)
    node = Node(config, writer="thread", handler_timeout=1.0, locked_retry_seconds=20.0)
    yield node
    node.close()


@pytest.mark.parametrize("resend", ["while the first commit is still waiting", "after the first commit landed"])
def test_a_commit_that_outlives_the_handler_timeout_is_answered_ae_and_its_resend_is_not_a_second_message(
    slow_node, resend
):
    lock = HeldLock(slow_node.store.config.path)
    message = msg("SLOW-1")
    with socket.create_connection(("127.0.0.1", slow_node.port), timeout=30) as s:
        try:
            started = time.perf_counter()
            first = exchange(s, message)
            assert msa(first) == ("AE", "SLOW-1") and b"not confirmed stored in time" in first
            assert 0.9 <= time.perf_counter() - started < 3.0
            if resend == "after the first commit landed":
                lock.release()
                deadline = time.monotonic() + 10
                while slow_node.count() == 0:
                    assert time.monotonic() < deadline, "the first copy never landed"
                    time.sleep(0.05)
            else:
                threading.Timer(0.4, lock.release).start()  # lands while the re-send waits behind it
            second = exchange(s, message)
        finally:
            lock.release()
    assert msa(second) == ("AA", "SLOW-1")
    # the answer and the rows agree: one row, under one message id (the first copy's)
    assert slow_node.count() == 1
    assert slow_node.writer.resends.recognised == 1


def test_a_different_message_with_the_same_control_id_is_not_taken_for_a_resend(slow_node):
    lock = HeldLock(slow_node.store.config.path)
    with socket.create_connection(("127.0.0.1", slow_node.port), timeout=30) as s:
        assert msa(exchange(s, msg("SAME-ID")))[0] == "AE"
        lock.release()
        other_body = msg("SAME-ID").replace(b"ADT^A01", b"ADT^A08")
        assert msa(exchange(s, other_body)) == ("AA", "SAME-ID")
    deadline = time.monotonic() + 10
    while slow_node.count() < 2:
        assert time.monotonic() < deadline, "both messages should be stored"
        time.sleep(0.05)
    assert slow_node.writer.resends.recognised == 0
