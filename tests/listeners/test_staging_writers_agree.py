"""The listener stages through two writers on PostgreSQL: the store's transaction
(`rowlease.stage_inbound`, the writer thread) and the libpq connection on the reactor
(`listeners.pgcommit`). Both run the store's `rowlease.staging`; what differs is the transport —
how parameters travel and how result rows are read back. The same group commits, run through each
into its own fresh database, must give the same answers and leave the same rows behind, column
for column, in every table staging writes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from twisted.internet.epollreactor import EPollReactor
from twisted.python.failure import Failure

from include.config import StoreConfig
from include.store import Store
from include.store import rowlease as rl
from include.store.lease import acquire_permanent
from listeners.group_commit import Inbound, InboundBatch
from listeners.pgcommit import PgStager
from tests.conftest import TEMPLATE_DB, pg_config

NODE = "n1"
TABLES = {"stage_inbound": "id", "inbound_bodies": "id", "inbound_batches": "batch_id", "message_events": "id"}
"""Every table staging writes, and the key its rows are compared in order of."""
_dbs = itertools.count()


def message(n: int, **fields: Any) -> dict[str, Any]:
    return Inbound(
        **{
            "connection": "adt-in",
            "control_id": f"C{n}",
            "lane_key": f"P{n % 3}",
            "charset": "utf-8",
            "payload": f"MSH|^~\\&|A|B|C|D|||ADT^A01|C{n}|P|2.5\rPID|1||P{n}||Müller^Zoë",
            "message_id": f"m{n}",
            **fields,
        }
    ).row()


def batch(name: str, n: int, *, declared: int | None = None) -> InboundBatch:
    return InboundBatch(
        connection="lab-in",
        batch_id=f"b-{name}",
        fhs_control_id=f"F-{name}",
        bhs_control_id=f"B-{name}",
        declared=declared,
        items=tuple(
            Inbound(
                connection="lab-in",
                control_id=f"{name}{k}",
                lane_key=f"L{k % 2}",
                charset="iso-8859-1",
                payload=f"MSH|^~\\&|L|B|||||ORU^R01|{name}{k}|P|2.5",
                message_id=f"{name}-{k}",
            )
            for k in range(n)
        ),
    )


@dataclass(frozen=True)
class Stale:
    """A group commit that reaches the store just after another acquisition: its epoch is stale."""

    rows: list[dict[str, Any]]


COMMITS: list[list[dict[str, Any]] | Stale] = [
    [message(1)],  # 0: a lone message, every column set (`stage_inbound_one`)
    [message(2, control_id=None, lane_key=None, charset=None)],  # 1: a lone message, its optional columns empty
    [message(3), message(4), message(5, lane_key=None)],  # 2: single messages in one commit, three lanes
    batch("A", 3, declared=3).rows(),  # 3: an HL7 batch and its record
    [message(6), *batch("B", 2).rows(), message(7)],  # 4: a batch between single messages, no declared count
    batch("C", 5, declared=5).rows(0, 2),  # 5: a large batch committed in parts: the first has its record,
    batch("C", 5, declared=5).rows(2, 5),  # 6: the later one's events name the batch all the same
    [message(1)],  # 7: a re-sent lone message: skipped
    [message(3), message(8), message(4)],  # 8: a re-sent group commit with one new message in it
    batch("A", 3, declared=3).rows(),  # 9: a re-sent batch: nothing twice, its record not either
    [message(10, payload="x" * 70_000)],  # 10: a body larger than a page
    [message(11, payload="MSH|\x00")],  # 11: text the store refuses (a NUL that slipped past validation)
    Stale([message(12)]),  # 12: nothing written
    [message(13), *batch("D", 2).rows()],  # 13: under the new epoch
]


@pytest.fixture
def other_pg_config(pg_server) -> Iterator[StoreConfig]:
    """A second fresh database beside `pg_config_fresh`: the same row ids for the same commits."""
    name = f"agree{next(_dbs)}"
    pg_server.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    yield pg_config(pg_server, name)
    pg_server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def stage_all(store: Store, stage: Callable[[list[dict[str, Any]], int], Any]) -> list[Any]:
    """Each commit's answer (a refusal: its exception class), staged by `stage(rows, epoch)`."""
    epoch = acquire_permanent(store, node_id=NODE)
    answers = []
    for commit in COMMITS:
        rows, at = commit, epoch
        if isinstance(commit, Stale):
            rows, at, epoch = commit.rows, epoch, acquire_permanent(store, node_id=NODE)
        try:
            answers.append(stage(rows, at))
        except Exception as exc:
            answers.append(type(exc))
    return answers


def through_the_store(store: Store) -> list[Any]:
    """As the writer thread stages a commit: `rowlease.stage_inbound`, one transaction each."""

    def stage(rows: list[dict[str, Any]], epoch: int) -> Any:
        with store.single_statement() as tx:
            return rl.stage_inbound(tx, rows, epoch=epoch, node_id=NODE)

    return stage_all(store, stage)


def through_pgcommit(store: Store) -> list[Any]:
    """As the writer on the reactor stages a commit: `PgStager.stage` on its own connection."""
    reactor = EPollReactor()
    stager = PgStager(store, reactor)

    def stage(rows: list[dict[str, Any]], epoch: int) -> Any:
        got: list[Any] = []
        stager.stage(rows, epoch=epoch, node_id=NODE).addBoth(got.append)
        deadline = time.monotonic() + 30
        while not got:
            assert time.monotonic() < deadline, "the stager gave no answer"
            reactor.iterate(0.01)
        if isinstance(got[0], Failure):
            got[0].raiseException()
        return got[0]

    try:
        return stage_all(store, stage)
    finally:
        stager.close()


def everything_staged(store: Store) -> dict[str, list[dict[str, Any]]]:
    """Every row of every table staging writes, every column: a clock column as whether it is set
    (the two databases' clocks differ), everything else as it is."""
    tables: dict[str, list[dict[str, Any]]] = {}
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        for table, key in TABLES.items():
            cur.execute(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_schema = current_schema() AND table_name = %(t)s",
                {"t": table},
            )
            clocks = {c["column_name"] for c in cur.fetchall() if c["data_type"].startswith("timestamp")}
            cur.execute(f"SELECT * FROM {table} ORDER BY {key}")
            tables[table] = [{k: (v is not None) if k in clocks else v for k, v in r.items()} for r in cur.fetchall()]
    return tables


def test_the_store_and_pgcommit_stage_the_same_commits_into_the_same_rows(pg_config_fresh, other_pg_config):
    stores = Store(pg_config_fresh), Store(other_pg_config)
    try:
        by_store, by_pgcommit = through_the_store(stores[0]), through_pgcommit(stores[1])
        staged, staged_by_pgcommit = everything_staged(stores[0]), everything_staged(stores[1])
    finally:
        for s in stores:
            s.close()

    assert by_pgcommit == by_store
    for table in TABLES:
        assert staged_by_pgcommit[table] == staged[table], table

    # What the commits were meant to do, so that agreeing cannot mean both doing nothing.
    assert by_store[0] == {"m1": 1} and len(by_store[3]) == 3 and len(by_store[13]) == 3
    assert by_store[7] == {} and set(by_store[8]) == {"m8"} and by_store[9] == {}
    assert isinstance(by_store[11], type) and issubclass(by_store[11], Exception) and by_store[12] is None
    inbound = {r["message_id"]: r for r in staged["stage_inbound"]}
    bodies = {r["id"]: r["payload"] for r in staged["inbound_bodies"]}
    assert len(inbound) == len(bodies) == len(staged["message_events"]) == 22
    assert inbound["m1"]["lane_key"] == "P1" and inbound["m2"]["control_id"] is None
    assert bodies[inbound["m1"]["id"]].endswith("Müller^Zoë") and len(bodies[inbound["m10"]["id"]]) == 70_000
    assert "m11" not in inbound and "m12" not in inbound and "m13" in inbound
    assert [(b["batch_id"], b["declared_count"], b["message_count"]) for b in staged["inbound_batches"]] == [
        ("b-A", 3, 3),
        ("b-B", None, 2),
        ("b-C", 5, 5),
        ("b-D", None, 2),
    ]
    assert [e["detail"] for e in staged["message_events"] if e["message_id"].startswith("C-")] == [
        f"batch b-C: message {k} of 5" for k in range(1, 6)
    ]
