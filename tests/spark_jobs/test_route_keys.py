"""The route stage indexes the business keys of what it claims (`include/store/keys.py`), on real
PostgreSQL with a local Spark: a message whose ingest commit comes long after later messages were
routed and indexed is indexed when the route claims it; a failure to index never fails the route."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pyspark.sql import SparkSession

from include.config import StoreConfig
from include.keys_config import parse_keys
from include.store import Store, rowlease
from include.store import keys as K
from include.store import operator as ops
from include.store.lease import acquire_permanent
from tests.spark_jobs.test_route_job import NODE, inbound_status, message, rows, run_once

RULES = parse_keys({"keys": {"mrn": "PID-3.1", "event": "MSH-9.2"}})
OLD_SETTLE_SECONDS = 2.0
"""How long the indexer before store version 18 waited for an open commit before its mark passed it."""


def mrn_message(n: int, mrn: str) -> dict[str, Any]:
    body = f"MSH|^~\\&|HIS|H|SL|SL|20261127120000||ADT^A01|K{n}|P|2.5.1\rPID|1||{mrn}^^^H^MR||DOE^JANE\rPV1|1|I\r"
    return {**message(n), "message_id": f"k{n:03d}", "control_id": f"K{n}", "payload": body}


def stage(store: Store, epoch: int, n: int, mrn: str) -> int:
    with store.transaction() as tx:
        staged = rowlease.stage_inbound(tx, [mrn_message(n, mrn)], epoch=epoch, node_id=NODE)
    assert staged is not None
    return staged[f"k{n:03d}"]


def found(store: Store, text: str) -> list[str]:
    return [r["control_id"] for r in K.find(store, K.KeyQuery.parse(text))]


@pytest.fixture
def indexer() -> Any:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keys")
    yield pool
    pool.shutdown(wait=True)


def test_a_message_committed_long_after_later_ones_were_indexed_is_indexed_when_routed(
    pg_config_fresh: StoreConfig, spark: SparkSession, indexer: ThreadPoolExecutor
) -> None:
    store, stalled = Store(pg_config_fresh), Store(pg_config_fresh)
    try:
        epoch = acquire_permanent(store, node_id=NODE)

        def alongside(ids: list[int]) -> Any:
            return indexer.submit(K.index_alongside, store, RULES, ids)

        # a client stalls mid-commit: its message has taken its id and is not visible yet
        held = stalled.transaction()
        tx = held.__enter__()
        try:
            late = rowlease.stage_inbound(tx, [mrn_message(0, "LATE-1")], epoch=epoch, node_id=NODE)
            assert late is not None
            on_time = [stage(store, epoch, n, f"ON-{n}") for n in (1, 2)]
            assert late["k000"] < min(on_time)
            time.sleep(OLD_SETTLE_SECONDS + 0.5)  # the old mark would pass the late id here, for good
            first = run_once(store, spark, epoch, "run-1", alongside=alongside)
            assert first.claimed == tuple(on_time)
            assert found(store, "mrn=ON-*") == ["K2", "K1"]
            assert found(store, "mrn=LATE-1") == []
        finally:
            held.__exit__(None, None, None)  # the stalled commit lands, seconds late
        assert found(store, "mrn=LATE-1") == []  # not yet routed: not yet indexed
        second = run_once(store, spark, epoch, "run-2", alongside=alongside)
        assert second.claimed == (late["k000"],)
        assert found(store, "mrn=LATE-1") == ["K0"]
        assert found(store, "event=A01") == ["K2", "K1", "K0"]
        assert set(inbound_status(store).values()) == {"done"}
    finally:
        stalled.close()
        store.close()


def test_a_route_whose_key_index_fails_still_routes_and_its_keys_are_kept_when_claimed_again(
    pg_config_fresh: StoreConfig, spark: SparkSession, indexer: ThreadPoolExecutor, caplog
) -> None:
    store = Store(pg_config_fresh)
    try:
        epoch = acquire_permanent(store, node_id=NODE)

        def alongside(ids: list[int]) -> Any:
            return indexer.submit(K.index_alongside, store, RULES, ids)

        ids = [stage(store, epoch, n, f"P{n}") for n in range(3)]
        with store.transaction() as tx:
            tx.conn.cursor().execute("ALTER TABLE message_keys RENAME TO message_keys_away")
        outcome = run_once(store, spark, epoch, "run-1", alongside=alongside)
        assert outcome.claimed == tuple(ids) and set(inbound_status(store).values()) == {"done"}
        assert any("not indexed (attempt 2 of 2)" in r.getMessage() for r in caplog.records)
        with store.transaction() as tx:
            tx.conn.cursor().execute("ALTER TABLE message_keys_away RENAME TO message_keys")
        assert found(store, "mrn=P*") == []
        # a replay stages the message again: the route claims the new row, and indexes it then
        [again] = ops.replay(store, [ids[0]], source="inbound", actor="test", reason="keys")
        assert run_once(store, spark, epoch, "run-2", alongside=alongside).claimed == (again,)
        assert [(r["id"], r["control_id"]) for r in K.find(store, K.KeyQuery.parse("mrn=P*"))] == [(again, "K0")]
        assert rows(store, "SELECT count(*) AS n FROM message_keys")[0]["n"] == 2
    finally:
        store.close()
