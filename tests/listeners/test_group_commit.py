"""Group commit isolation (invariant 9, docs/invariants.md): a batch the store refuses for some
rows' data is split until only those rows fail; the rest commit, in arrival order. A store that is
down is not split. Real SQLite and PostgreSQL stores; a refusing CHECK/trigger stands in for any
data the store turns down.

Both writers are held to it: the writer thread (every store) and, on PostgreSQL, the writer on
the reactor (`ReactorIngestWriter` over `listeners.pgcommit`), driven here by a reactor of the
test's own, iterated until the outcomes are in."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail
from twisted.internet.epollreactor import EPollReactor

from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from listeners.group_commit import (
    Inbound,
    InboundBatch,
    IngestRejected,
    IngestWriter,
    NotLeader,
    ReactorIngestWriter,
    RowRefused,
    StoreUnavailable,
)
from listeners.metrics import Metrics
from listeners.pgcommit import PgStager, numbered


class CountingStore(Store):
    """The real store, counting the staging statements the writer runs."""

    statements = 0

    @contextmanager
    def single_statement(self) -> Iterator:
        self.statements += 1
        with super().single_statement() as tx:
            yield tx


class CountingStager(PgStager):
    """The real stager, counting its statements; from `fail_after` on, the connection is 'gone'."""

    statements = 0
    fail_after: int | None = None

    def stage(self, rows: list[dict[str, Any]], *, epoch: int, node_id: str) -> Deferred:
        self.statements += 1
        if self.fail_after is not None and self.statements > self.fail_after:
            return fail(ConnectionError("server closed the connection"))
        return super().stage(rows, epoch=epoch, node_id=node_id)


def run_until(reactor: EPollReactor, done: Any, *, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the writer did not finish in time"
        reactor.iterate(0.01)


class Writer:
    """One writer under test: `commit(items)` gives one outcome per item (None = committed)."""

    def __init__(self, kind: str, config: StoreConfig) -> None:
        self.kind = kind
        self.store = CountingStore(config)
        self.epoch = acquire_permanent(self.store, node_id="n")
        self.metrics = Metrics()
        if kind == "thread":
            self.writer: Any = IngestWriter(
                self.store, node_id="n", epoch=lambda: self.epoch, metrics=self.metrics, reactor=None
            )
        else:
            self.reactor = EPollReactor()
            self.stager = CountingStager(self.store, self.reactor)
            self.writer = ReactorIngestWriter(
                self.store,
                node_id="n",
                epoch=lambda: self.epoch,
                metrics=self.metrics,
                reactor=self.reactor,
                stager=self.stager,
            )

    @property
    def statements(self) -> int:
        return self.store.statements if self.kind == "thread" else self.stager.statements

    def reset(self) -> None:
        if self.kind == "thread":
            self.store.statements = 0
        else:
            self.stager.statements = 0

    def submit_all(self, items: list[Inbound]) -> list[Any]:
        """Submit in one reactor turn; the outcomes fill in as the reactor runs."""
        outcomes: list[Any] = [...] * len(items)
        for n, item in enumerate(items):

            def settle(result: Any, n: int = n) -> None:
                outcomes[n] = result.value if hasattr(result, "value") else None

            self.writer.submit(item).addBoth(settle)
        return outcomes

    def commit(self, items: list[Inbound]) -> list[IngestRejected | None]:
        if self.kind == "thread":
            return self.writer._commit(items)
        outcomes = self.submit_all(items)
        run_until(self.reactor, lambda: all(o is not ... for o in outcomes))
        return outcomes

    def close(self) -> None:
        if self.kind == "reactor":
            self.stager.close()
        self.store.close()


KINDS = [("sqlite", "thread"), ("postgres", "thread"), ("postgres", "reactor")]


@pytest.fixture(params=KINDS, ids=["-".join(k) for k in KINDS])
def writer(request) -> Iterator[Writer]:
    backend, kind = request.param
    config = request.getfixturevalue("sqlite_config_fresh" if backend == "sqlite" else "pg_config_fresh")
    w = Writer(kind, config)
    yield w
    w.close()


pg_writer = pytest.mark.parametrize(
    "writer", [k for k in KINDS if k[0] == "postgres"], indirect=True, ids=["postgres-thread", "postgres-reactor"]
)


def refuse_poison(store: Store) -> None:
    """Make the store itself refuse any payload containing POISON (as it would refuse bad data)."""
    with store.transaction() as tx:
        if store.backend == "postgres":
            tx.script("ALTER TABLE inbound_bodies ADD CONSTRAINT no_poison CHECK (payload NOT LIKE '%POISON%')")
        else:
            tx.script(
                "CREATE TRIGGER no_poison BEFORE INSERT ON inbound_bodies WHEN NEW.payload LIKE '%POISON%' "
                "BEGIN SELECT RAISE(ABORT, 'poison refused'); END;"
            )


def items(n: int, bad: set[int], *, bad_text: str = "POISON") -> list[Inbound]:
    return [
        Inbound(connection="c", control_id=f"M{i}", payload=f"MSH|{i}|{bad_text if i in bad else 'ok'}")
        for i in range(n)
    ]


def staged_control_ids(store: Store) -> list[str]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute("SELECT control_id FROM stage_inbound ORDER BY id")
        return [r["control_id"] for r in cur.fetchall()]


@pytest.mark.parametrize(
    "bad", [set(), {0}, {63}, {5, 6, 40}, set(range(0, 64, 2))], ids=["none", "first", "last", "three", "half"]
)
def test_only_the_rows_the_store_refuses_fail_and_the_rest_commit_in_arrival_order(writer, bad):
    refuse_poison(writer.store)
    writer.reset()
    outcomes = writer.commit(items(64, bad))
    assert [i for i, o in enumerate(outcomes) if o is not None] == sorted(bad)
    assert all(isinstance(outcomes[i], RowRefused) for i in bad)
    assert all("refused by the store" in str(outcomes[i]) and "POISON" not in str(outcomes[i]) for i in bad)
    assert staged_control_ids(writer.store) == [f"M{i}" for i in range(64) if i not in bad]
    assert writer.statements <= min(2 * 64 - 1, 1 + 2 * len(bad) * 6)  # 1 + 2k·log2(n), at most 2n-1
    refused = writer.metrics.store_errors.labels("stage_inbound_refused")._value.get()
    assert refused == len(bad)


def hl7_batch(name: str, n: int, *, bad: int | None = None) -> InboundBatch:
    return InboundBatch(
        connection="c",
        batch_id=f"batch-{name}",
        bhs_control_id=f"B-{name}",
        declared=n,
        items=tuple(
            Inbound(connection="c", control_id=f"{name}{k}", payload=f"MSH|{k}|{'POISON' if k == bad else 'ok'}")
            for k in range(n)
        ),
    )


def test_an_hl7_batch_commits_whole_or_fails_whole_and_the_messages_around_it_commit(writer):
    """A batch is one unit of the group commit: one refused message fails its whole batch (nothing of
    it staged, no batch record), the other batches and single messages in the same commit land."""
    refuse_poison(writer.store)
    units = [*items(2, set()), hl7_batch("A", 3), hl7_batch("B", 4, bad=2), *items(1, {0}), hl7_batch("C", 2)]
    outcomes = writer.commit(units)
    assert [type(o).__name__ for o in outcomes] == ["NoneType"] * 3 + ["RowRefused", "RowRefused", "NoneType"]
    assert str(outcomes[3]).startswith("batch refused by the store (")
    assert staged_control_ids(writer.store) == ["M0", "M1", "A0", "A1", "A2", "C0", "C1"]
    with writer.store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(
            "SELECT batch_id, bhs_control_id, declared_count, message_count FROM inbound_batches ORDER BY batch_id"
        )
        batches = [tuple(r.values()) for r in cur.fetchall()]
        cur.execute("SELECT control_id, batch_id, batch_seq FROM stage_inbound WHERE batch_id IS NOT NULL ORDER BY id")
        members = [tuple(r.values()) for r in cur.fetchall()]
    assert batches == [("batch-A", "B-A", 3, 3), ("batch-C", "B-C", 2, 2)]
    assert members == [
        ("A0", "batch-A", 1),
        ("A1", "batch-A", 2),
        ("A2", "batch-A", 3),
        ("C0", "batch-C", 1),
        ("C1", "batch-C", 2),
    ]


def test_every_row_refused_costs_at_most_2n_minus_1_statements(writer):
    refuse_poison(writer.store)
    writer.reset()
    outcomes = writer.commit(items(16, set(range(16))))
    assert all(isinstance(o, RowRefused) for o in outcomes)
    assert writer.statements == 2 * 16 - 1
    assert staged_control_ids(writer.store) == []


@pg_writer
def test_a_nul_that_slipped_past_validation_fails_alone_on_postgresql(writer):
    """PostgreSQL text refuses NUL (the json → text cast raises a DataError): only that row fails."""
    outcomes = writer.commit(items(10, {3}, bad_text="A\x00B"))
    assert [type(o).__name__ for o in outcomes] == ["NoneType"] * 3 + ["RowRefused"] + ["NoneType"] * 6
    assert str(outcomes[3]) == "refused by the store (UntranslatableCharacter); not stored"
    assert staged_control_ids(writer.store) == [f"M{i}" for i in range(10) if i != 3]


@pg_writer
@pytest.mark.parametrize("bad_text", ["A\ud800B", "\u00e9A\x00"], ids=["surrogate", "nul-after-non-ascii"])
def test_text_no_parameter_can_carry_fails_alone_on_postgresql_alone_or_in_a_batch(writer, bad_text):
    """A lone message is staged with plain parameters (`stage_inbound_one`); text that cannot be one
    (an unpaired surrogate, a NUL) must still come back refused, alone, not as a broken connection."""
    lone = writer.commit(items(1, {0}, bad_text=bad_text))
    assert [type(o).__name__ for o in lone] == ["RowRefused"]
    outcomes = writer.commit(items(4, {2}, bad_text=bad_text))
    assert [type(o).__name__ for o in outcomes] == ["NoneType", "NoneType", "RowRefused", "NoneType"]
    assert staged_control_ids(writer.store) == ["M0", "M1", "M3"]


def test_a_store_that_is_down_fails_the_batch_without_splitting(tmp_path, sqlite_config_fresh):
    import sqlite3
    from dataclasses import replace

    config = replace(sqlite_config_fresh, busy_timeout_ms=100)
    writer = Writer("thread", config)
    writer.writer.locked_retry_seconds = 0.5
    blocker = sqlite3.connect(config.path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")  # the database takes no writes: not the rows' fault
        writer.reset()
        outcomes = writer.commit(items(32, set()))
        assert 2 <= writer.statements <= 6  # the whole batch tried again while locked, never split
        assert all(isinstance(o, StoreUnavailable) for o in outcomes)
        assert writer.metrics.store_errors.labels("stage_inbound")._value.get() == 1
        blocker.execute("ROLLBACK")
        assert staged_control_ids(writer.store) == []
    finally:
        blocker.close()
        writer.close()


def test_a_commit_that_waits_out_a_busy_sqlite_lock_longer_than_its_busy_timeout_still_commits(sqlite_config_fresh):
    """Issue 22: a group commit queued behind stage work holding SQLite's write lock past the busy
    timeout got `AE`. It now takes its turn when the lock is free: every message committed."""
    import sqlite3
    import threading
    from dataclasses import replace

    config = replace(sqlite_config_fresh, busy_timeout_ms=100)
    writer = Writer("thread", config)
    blocker = sqlite3.connect(config.path, isolation_level=None, check_same_thread=False)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # stage work holding the write lock ten busy timeouts long
        releaser = threading.Timer(1.0, lambda: blocker.execute("ROLLBACK"))
        releaser.start()
        started = time.monotonic()
        outcomes = writer.commit(items(16, set()))
        releaser.join()
        assert outcomes == [None] * 16
        assert time.monotonic() - started >= 1.0
        assert writer.metrics.store_busy._value.get() >= 1
        assert writer.metrics.store_errors.labels("stage_inbound")._value.get() == 0
        assert staged_control_ids(writer.store) == [f"M{i}" for i in range(16)]
    finally:
        blocker.close()
        writer.close()


def test_no_busy_retry_starts_that_would_end_after_the_oldest_message_waited_its_budget(sqlite_config_fresh):
    """The retries are bounded from the oldest message's arrival, not from the first try: a batch
    whose oldest message has already waited almost LOCKED_RETRY_SECONDS gets its `AE` now, so no
    answer can outlive the MLLP handler's timeout and be followed by a commit."""
    import sqlite3
    from dataclasses import replace

    from listeners.group_commit import LOCKED_RETRY_SECONDS

    config = replace(sqlite_config_fresh, busy_timeout_ms=100)
    writer = Writer("thread", config)
    blocker = sqlite3.connect(config.path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        writer.reset()
        started = time.monotonic()
        outcomes = writer.writer._commit(items(4, set()), since=started - LOCKED_RETRY_SECONDS + 0.15)
        assert all(isinstance(o, StoreUnavailable) for o in outcomes)
        assert writer.statements == 1 and time.monotonic() - started < 1.0
        assert LOCKED_RETRY_SECONDS + StoreConfig().busy_timeout_ms / 1000 < 60  # the MLLP handler's timeout
    finally:
        blocker.close()
        writer.close()


def test_the_store_going_down_mid_split_fails_the_rest_at_once(writer):
    """Refused rows make the writer split; if the store then fails for another reason, the pieces
    not yet committed fail together with StoreUnavailable — no more splitting."""
    refuse_poison(writer.store)
    if writer.kind == "thread":
        real = CountingStore.single_statement

        @contextmanager
        def failing_after_two(self) -> Iterator:
            if self.statements >= 2:
                self.statements += 1
                raise ConnectionError("server closed the connection")
            with real(self) as tx:
                yield tx

        writer.store.single_statement = failing_after_two.__get__(writer.store)  # type: ignore[method-assign]
    else:
        writer.stager.fail_after = 2
    writer.reset()
    outcomes = writer.commit(items(8, {7}))
    # 1: whole batch refused; 2: left half [0, 4) commits; 3: right half fails → rest halts
    assert [o is None for o in outcomes] == [True] * 4 + [False] * 4
    assert all(isinstance(o, StoreUnavailable) for o in outcomes[4:])
    assert writer.statements == 3
    assert staged_control_ids(writer.store) == ["M0", "M1", "M2", "M3"]


def test_a_stale_epoch_fails_the_batch_as_not_leader(writer):
    acquire_permanent(writer.store, node_id="other")  # a newer epoch: ours is stale
    outcomes = writer.commit(items(4, set()))
    assert all(isinstance(o, NotLeader) for o in outcomes)
    assert staged_control_ids(writer.store) == []


def test_no_lease_fails_the_batch_as_not_leader_without_a_statement(writer):
    writer.epoch = None
    writer.reset()
    outcomes = writer.commit(items(3, set()))
    assert all(isinstance(o, NotLeader) for o in outcomes)
    assert writer.statements == 0


# -- the writer on the reactor (PostgreSQL) --------------------------------------------------------


@pytest.fixture
def reactor_writer(pg_config_fresh) -> Iterator[Writer]:
    w = Writer("reactor", pg_config_fresh)
    yield w
    w.close()


def test_messages_submitted_in_one_reactor_turn_share_one_statement(reactor_writer):
    outcomes = reactor_writer.commit(items(20, set()))
    assert outcomes == [None] * 20
    assert reactor_writer.statements == 1
    assert staged_control_ids(reactor_writer.store) == [f"M{i}" for i in range(20)]


def test_what_arrives_during_a_commit_goes_in_the_next_one_in_arrival_order(reactor_writer):
    w = reactor_writer
    first = w.submit_all(items(1, set()))
    w.reactor.iterate(0)  # the lone message's statement is on its way: it waited for no batch
    assert w.statements == 1
    later = w.submit_all([Inbound(connection="c", control_id=f"L{i}", payload="MSH|x") for i in range(5)])
    run_until(w.reactor, lambda: all(o is not ... for o in first + later))
    assert first + later == [None] * 6
    assert w.statements == 2
    assert staged_control_ids(w.store) == ["M0"] + [f"L{i}" for i in range(5)]


def test_the_deferred_fires_only_once_the_row_is_committed(reactor_writer):
    w = reactor_writer
    outcomes = w.submit_all(items(1, set()))
    seen: list[list[str]] = []
    w.writer.submit(Inbound(connection="c", control_id="M1", payload="MSH|y")).addCallback(
        lambda _: seen.append(staged_control_ids(w.store))
    )
    run_until(w.reactor, lambda: bool(seen) and outcomes[0] is not ...)
    assert seen == [["M0", "M1"]]


def test_a_batch_that_arrives_while_the_connection_opens_waits_for_it(reactor_writer):
    w = reactor_writer
    w.writer.start()  # opens the connection ahead of the first batch
    assert w.commit(items(3, set())) == [None] * 3
    assert staged_control_ids(w.store) == ["M0", "M1", "M2"]


def test_a_connection_dropped_between_batches_is_reopened_for_the_next(reactor_writer):
    w = reactor_writer
    assert w.commit(items(2, set())) == [None, None]
    with w.store.transaction() as tx:
        tx.conn.cursor().execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND datname = current_database() "
            "AND query LIKE '%stage_inbound%'"
        )
    deadline = time.monotonic() + 5
    while w.stager._conn is not None and w.stager._conn.usable and time.monotonic() < deadline:
        w.reactor.iterate(0.01)  # the reactor notices the closed socket on its own
    later = [Inbound(connection="c", control_id=f"L{i}", payload="MSH|x") for i in range(3)]
    assert w.commit(later) == [None] * 3
    assert staged_control_ids(w.store) == ["M0", "M1", "L0", "L1", "L2"]


def test_a_store_that_cannot_be_reached_fails_each_batch_as_unavailable(pg_config_fresh):
    from dataclasses import replace

    w = Writer("reactor", pg_config_fresh)
    try:
        w.stager._conninfo["port"] = 1  # nothing listens there
        outcomes = w.commit(items(4, set()))
        assert all(isinstance(o, StoreUnavailable) for o in outcomes)
        assert w.metrics.store_errors.labels("stage_inbound")._value.get() == 1
        w.stager._conninfo["port"] = replace(pg_config_fresh).effective_port
        assert w.commit([Inbound(connection="c", control_id="A", payload="MSH|a")]) == [None]
    finally:
        w.close()


def test_a_fault_inside_the_writer_answers_the_batch_and_the_writer_goes_on(reactor_writer, monkeypatch):
    w = reactor_writer
    import listeners.group_commit as group_commit

    real = group_commit._GroupCommit.statements

    def broken(self):  # the split logic fails after its first statement
        steps = real(self)
        yield next(steps)
        raise KeyError("bug")

    monkeypatch.setattr(group_commit._GroupCommit, "statements", broken)
    assert all(isinstance(o, StoreUnavailable) for o in w.commit(items(2, set())))
    monkeypatch.setattr(group_commit._GroupCommit, "statements", real)
    assert w.commit([Inbound(connection="c", control_id="A", payload="MSH|a")]) == [None]


def test_when_idle_fires_once_the_last_batch_is_answered(reactor_writer):
    w = reactor_writer
    assert w.writer.when_idle(1.0).result is True  # nothing submitted
    outcomes = w.submit_all(items(3, set()))
    idle: list[bool] = []
    w.writer.when_idle(10.0).addCallback(idle.append)
    run_until(w.reactor, lambda: bool(idle))
    assert idle == [True] and outcomes == [None] * 3


def test_named_parameters_become_numbered_ones_in_order_of_first_use():
    assert numbered("SELECT %(a)s, %(b)s, %(a)s, 100%%") == ("SELECT $1, $2, $1, 100%", ["a", "b"])


def test_message_ids_are_time_ordered_version_7_uuids():
    """Ids minted later sort later (whole milliseconds apart), so message-id indexes grow at their
    right-hand edge; within a millisecond they stay unique."""
    import time
    import uuid

    from listeners.group_commit import new_message_id

    first = [new_message_id() for _ in range(2000)]
    time.sleep(0.002)
    later = new_message_id()
    assert len(set(first)) == 2000
    assert all(len(i) == 32 and uuid.UUID(i).version == 7 and uuid.UUID(i).variant == uuid.RFC_4122 for i in first)
    assert later > max(first)
    assert abs((uuid.UUID(later).int >> 80) / 1000 - time.time()) < 5
