"""Group commit isolation (invariant 9, docs/invariants.md): a batch the store refuses for some
rows' data is split until only those rows fail; the rest commit, in arrival order. A store that is
down is not split. Real SQLite and PostgreSQL stores; a refusing CHECK/trigger stands in for any
data the store turns down."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest

from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from listeners.ingest import Inbound, IngestWriter, NotLeader, RowRefused, StoreUnavailable
from listeners.metrics import Metrics


class CountingStore(Store):
    """The real store, counting the staging statements the writer runs."""

    statements = 0

    @contextmanager
    def single_statement(self) -> Iterator:
        self.statements += 1
        with super().single_statement() as tx:
            yield tx


def refuse_poison(store: Store) -> None:
    """Make the store itself refuse any payload containing POISON (as it would refuse bad data)."""
    with store.transaction() as tx:
        if store.backend == "postgres":
            tx.script("ALTER TABLE inbound_bodies ADD CONSTRAINT no_poison CHECK (payload NOT LIKE '%POISON%')")
        else:
            tx.script("CREATE TRIGGER no_poison BEFORE INSERT ON inbound_bodies WHEN NEW.payload LIKE '%POISON%' "
                      "BEGIN SELECT RAISE(ABORT, 'poison refused'); END;")


def writer_for(config: StoreConfig) -> tuple[IngestWriter, CountingStore, Metrics]:
    store = CountingStore(config)
    epoch = acquire_permanent(store, node_id="n")
    metrics = Metrics()
    return IngestWriter(store, node_id="n", epoch=lambda: epoch, metrics=metrics, reactor=None), store, metrics


def items(n: int, bad: set[int], *, bad_text: str = "POISON") -> list[Inbound]:
    return [Inbound(connection="c", control_id=f"M{i}", payload=f"MSH|{i}|{bad_text if i in bad else 'ok'}")
            for i in range(n)]


def staged_control_ids(store: Store) -> list[str]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute("SELECT control_id FROM stage_inbound ORDER BY id")
        return [r["control_id"] for r in cur.fetchall()]


@pytest.mark.parametrize("bad", [set(), {0}, {63}, {5, 6, 40}, set(range(0, 64, 2))],
                         ids=["none", "first", "last", "three", "half"])
def test_only_the_rows_the_store_refuses_fail_and_the_rest_commit_in_arrival_order(store_config, bad):
    writer, store, metrics = writer_for(store_config)
    try:
        refuse_poison(store)
        store.statements = 0
        outcomes = writer._commit(items(64, bad))
        assert [i for i, o in enumerate(outcomes) if o is not None] == sorted(bad)
        assert all(isinstance(outcomes[i], RowRefused) for i in bad)
        assert all("refused by the store" in str(outcomes[i]) and "POISON" not in str(outcomes[i]) for i in bad)
        assert staged_control_ids(store) == [f"M{i}" for i in range(64) if i not in bad]
        assert store.statements <= min(2 * 64 - 1, 1 + 2 * len(bad) * 6)  # 1 + 2k·log2(n), at most 2n-1
        refused = metrics.store_errors.labels("stage_inbound_refused")._value.get()
        assert refused == len(bad)
    finally:
        store.close()


def test_every_row_refused_costs_at_most_2n_minus_1_statements(store_config):
    writer, store, _ = writer_for(store_config)
    try:
        refuse_poison(store)
        store.statements = 0
        outcomes = writer._commit(items(16, set(range(16))))
        assert all(isinstance(o, RowRefused) for o in outcomes)
        assert store.statements == 2 * 16 - 1
        assert staged_control_ids(store) == []
    finally:
        store.close()


@pytest.mark.parametrize("store_config", ["postgres"], indirect=True)
def test_a_nul_that_slipped_past_validation_fails_alone_on_postgresql(store_config):
    """PostgreSQL text refuses NUL (the json → text cast raises a DataError): only that row fails."""
    writer, store, _ = writer_for(store_config)
    try:
        outcomes = writer._commit(items(10, {3}, bad_text="A\x00B"))
        assert [type(o).__name__ for o in outcomes] == ["NoneType"] * 3 + ["RowRefused"] + ["NoneType"] * 6
        assert str(outcomes[3]) == "refused by the store (UntranslatableCharacter); not stored"
        assert staged_control_ids(store) == [f"M{i}" for i in range(10) if i != 3]
    finally:
        store.close()


def test_a_store_that_is_down_fails_the_batch_without_splitting(tmp_path, sqlite_config_fresh):
    import sqlite3
    from dataclasses import replace

    config = replace(sqlite_config_fresh, busy_timeout_ms=100)
    writer, store, metrics = writer_for(config)
    blocker = sqlite3.connect(config.path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")  # the database takes no writes: not the rows' fault
        store.statements = 0
        outcomes = writer._commit(items(32, set()))
        assert store.statements == 1
        assert all(isinstance(o, StoreUnavailable) for o in outcomes)
        assert metrics.store_errors.labels("stage_inbound")._value.get() == 1
        blocker.execute("ROLLBACK")
        assert staged_control_ids(store) == []
    finally:
        blocker.close()
        store.close()


def test_the_store_going_down_mid_split_fails_the_rest_at_once(store_config):
    """Refused rows make the writer split; if the store then fails for another reason, the pieces
    not yet committed fail together with StoreUnavailable — no more splitting."""
    writer, store, _ = writer_for(store_config)
    try:
        refuse_poison(store)
        real = CountingStore.single_statement

        @contextmanager
        def failing_after_two(self) -> Iterator:
            if self.statements >= 2:
                self.statements += 1
                raise ConnectionError("server closed the connection")
            with real(self) as tx:
                yield tx

        store.single_statement = failing_after_two.__get__(store)  # type: ignore[method-assign]
        store.statements = 0
        outcomes = writer._commit(items(8, {7}))
        # 1: whole batch refused; 2: left half [0, 4) commits; 3: right half fails → rest halts
        assert [o is None for o in outcomes] == [True] * 4 + [False] * 4
        assert all(isinstance(o, StoreUnavailable) for o in outcomes[4:])
        assert store.statements == 3
        assert staged_control_ids(store) == ["M0", "M1", "M2", "M3"]
    finally:
        store.close()


def test_a_stale_epoch_fails_the_batch_as_not_leader(store_config):
    writer, store, _ = writer_for(store_config)
    try:
        acquire_permanent(store, node_id="other")  # a newer epoch: ours is stale
        outcomes = writer._commit(items(4, set()))
        assert all(isinstance(o, NotLeader) for o in outcomes)
        assert staged_control_ids(store) == []
    finally:
        store.close()
