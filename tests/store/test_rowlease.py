"""Row-lease primitives: concurrent claims, per-lane FIFO with stranded-head reclaim, fenced finish,
on-promotion recovery once per epoch, the expired-lease sweep, retries and dead letters."""

from __future__ import annotations

import multiprocessing
from collections import Counter

import pytest

from include.app.lab.postgres_server import wait_for
from include.store import INBOUND, Store
from include.store import rowlease as rl
from include.store.lease import LeaderElector, acquire_permanent
from tests.store.workers import claim_until_empty
from tests.support.staging import insert_inbound


def seed_inbound(store: Store, n: int, *, lanes: int = 100) -> None:
    with store.transaction() as tx:
        tx.conn.cursor().execute(
            f"WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < {int(n)}) "
            "INSERT INTO stage_inbound (message_id, control_id, connection, lane_key) "
            f"SELECT 'm' || n, 'c' || n, 'mllp-in', CAST(n % {int(lanes)} AS TEXT) FROM g"
        )
        tx.conn.cursor().execute(
            "INSERT INTO inbound_bodies (id, payload) SELECT id, 'MSH|^~\\&|A|B|C|D' FROM stage_inbound"
        )


def rows(store: Store, sql: str) -> list[dict]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(sql)
        return [dict(r) for r in cur.fetchall()]


def take_lease(store: Store, node: str = "a") -> LeaderElector:
    e = LeaderElector(store, node_id=node, ttl_seconds=600, fence_timeout_seconds=300)
    assert e.step().is_leader
    return e


def test_four_concurrent_claimers_claim_nothing_twice_and_lose_nothing(store, store_config):
    n = 100_000 if store.backend == "postgres" else 20_000
    seed_inbound(store, n)
    epoch = take_lease(store).epoch
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=claim_until_empty, args=(store_config, f"w{i}", epoch, 500, start, results))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    assert [err for _, _, err in outcomes if err] == []
    everything = [i for _, ids, _ in outcomes for i in ids]
    assert len(everything) == n and len(set(everything)) == n
    assert rows(store, "SELECT status, count(*) AS n FROM stage_inbound GROUP BY status") == [
        {"status": "done", "n": n}
    ]
    events = rows(store, "SELECT count(*) AS n, count(DISTINCT row_id) AS d FROM message_events WHERE event = 'done'")
    assert events == [{"n": n, "d": n}]
    print(f"{store.backend}: claims per worker {sorted(len(ids) for _, ids, _ in outcomes)}")


def test_lane_heads_are_claimed_in_fifo_order_one_per_lane(store):
    epoch = take_lease(store).epoch
    with store.transaction() as tx:
        ids = {
            k: insert_inbound(
                tx, epoch=epoch, node_id="a", message_id=k, control_id=k, connection="c", payload="MSH|", lane_key=k[0]
            )
            for k in ("a1", "b1", "a2", "b2", "a3")
        }
    with store.transaction() as tx:
        first = [r["id"] for r in rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=10)]
    assert first == [ids["a1"], ids["b1"]]
    with store.transaction() as tx:  # heads in flight block their lanes
        assert rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=10) == []
        rl.finish_batch(tx, INBOUND, [ids["a1"]], owner="a", epoch=epoch)
    with store.transaction() as tx:
        assert [r["id"] for r in rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=10)] == [ids["a2"]]


def test_a_row_capped_lane_claim_takes_lanes_round_robin_and_leaves_each_a_prefix(store):
    epoch = take_lease(store).epoch
    with store.transaction() as tx:
        ids = {
            k: insert_inbound(
                tx, epoch=epoch, node_id="a", message_id=k, control_id=k, connection="c", payload="MSH|", lane_key=k[0]
            )
            for k in ("a1", "a2", "b1", "a3", "c1", "b2", "a4", "a5")
        }
    with store.transaction() as tx:
        first = [
            r["id"] for r in rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=10, per_lane=10, max_rows=5)
        ]
    assert first == sorted(ids[k] for k in ("a1", "b1", "c1", "a2", "b2"))  # every lane's 1st, then 2nds
    with store.transaction() as tx:  # lanes with rows in flight give nothing more
        assert rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=10, per_lane=10, max_rows=5) == []
        rl.finish_batch(tx, INBOUND, first, owner="a", epoch=epoch)
    with store.transaction() as tx:  # one lane left: it moves max_rows at once, in order
        rest = [
            r["id"] for r in rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=10, per_lane=10, max_rows=5)
        ]
    assert rest == [ids["a3"], ids["a4"], ids["a5"]]


def test_a_failing_head_blocks_only_its_own_lane_and_dead_letters_after_the_limit(store):
    epoch = take_lease(store).epoch
    with store.transaction() as tx:
        a1, a2, b1 = (
            insert_inbound(
                tx, epoch=epoch, node_id="a", message_id=m, control_id=m, connection="c", payload="MSH|", lane_key=m[0]
            )
            for m in ("a1", "a2", "b1")
        )
    for attempt in (1, 2):
        with store.transaction() as tx:
            heads = {r["id"]: r for r in rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=10)}
            assert a1 in heads and heads[a1]["attempts"] == attempt
            failed = rl.fail_batch(
                tx, INBOUND, [a1], owner="a", epoch=epoch, error="NAK AE from ehr", max_attempts=2, backoff_seconds=0.0
            )
            assert failed[0]["status"] == ("error" if attempt == 1 else "dead")
            if b1 in heads:
                rl.finish_batch(tx, INBOUND, [b1], owner="a", epoch=epoch)
    with store.transaction() as tx:  # dead is terminal: the lane moves on
        assert [r["id"] for r in rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=10)] == [a2]
    history = rows(
        store,
        f"SELECT event, to_status, attempt, detail FROM message_events WHERE row_id = {a1} "
        "AND event <> 'received' ORDER BY id",
    )
    assert history == [
        {"event": "attempt_failed", "to_status": "error", "attempt": 1, "detail": "NAK AE from ehr"},
        {"event": "attempt_failed", "to_status": "dead", "attempt": 2, "detail": "NAK AE from ehr"},
    ]


def test_backoff_holds_a_failed_head_until_next_attempt_at(store):
    epoch = take_lease(store).epoch
    with store.transaction() as tx:
        a1 = insert_inbound(
            tx, epoch=epoch, node_id="a", message_id="a1", control_id="1", connection="c", payload="MSH|", lane_key="a"
        )
        rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=1)
        rl.fail_batch(tx, INBOUND, [a1], owner="a", epoch=epoch, error="timeout", max_attempts=5, backoff_seconds=0.3)
    with store.transaction() as tx:
        assert rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=1) == []
        assert rl.claim_batch(tx, INBOUND, owner="a", epoch=epoch, limit=1) == []

    def retried():
        with store.transaction() as tx:
            return rl.claim_lane_heads(tx, INBOUND, owner="a", epoch=epoch, limit=1)

    assert wait_for(retried, timeout=5, what="backoff to pass")[0]["attempts"] == 2


def test_stranded_head_is_reclaimed_before_anything_newer_in_its_lane(store):
    old = LeaderElector(store, node_id="old", ttl_seconds=0.4, fence_timeout_seconds=0.2)
    epoch1 = old.step().epoch
    with store.transaction() as tx:
        h1, h2 = (
            insert_inbound(
                tx,
                epoch=epoch1,
                node_id="old",
                message_id=m,
                control_id=m,
                connection="c",
                payload="MSH|",
                lane_key="pid-1",
            )
            for m in ("h1", "h2")
        )
        assert [
            r["id"] for r in rl.claim_lane_heads(tx, INBOUND, owner="old", epoch=epoch1, limit=5, lease_seconds=0.2)
        ] == [h1]
    # the old leader dies; its lease and the row lease age out; a new leader claims the lane
    new = LeaderElector(store, node_id="new", ttl_seconds=600, fence_timeout_seconds=300)
    wait_for(lambda: new.step().is_leader, timeout=5, what="takeover")

    def claim():
        with store.transaction() as tx:
            return rl.claim_lane_heads(tx, INBOUND, owner="new", epoch=new.epoch, limit=5)

    heads = wait_for(claim, timeout=5, what="stranded head reclaimed")
    assert [(r["id"], r["attempts"]) for r in heads] == [(h1, 2)]
    assert rows(store, f"SELECT status FROM stage_inbound WHERE id = {h2}") == [{"status": "pending"}]
    ev = rows(
        store, f"SELECT event, node_id, detail FROM message_events WHERE row_id = {h1} AND event = 'lease_expired'"
    )
    assert len(ev) == 1 and ev[0]["node_id"] == "new" and "old" in ev[0]["detail"]


def test_finish_under_a_stale_epoch_changes_nothing(store):
    a = LeaderElector(store, node_id="a", ttl_seconds=600, fence_timeout_seconds=300)
    e1 = a.step().epoch
    seed_inbound(store, 10)
    with store.transaction() as tx:
        ids = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="a", epoch=e1, limit=10)]
    a.release()
    b = LeaderElector(store, node_id="b", ttl_seconds=600, fence_timeout_seconds=300)
    assert b.step().epoch == e1 + 1
    before = rows(store, "SELECT id, status, lease_owner, claim_epoch, updated_at FROM stage_inbound ORDER BY id")
    events_before = rows(store, "SELECT count(*) AS n FROM message_events")
    with store.transaction() as tx:
        assert rl.finish_batch(tx, INBOUND, ids, owner="a", epoch=e1) == []
        assert rl.fail_batch(tx, INBOUND, ids, owner="a", epoch=e1, error="x", max_attempts=1) == []
        assert rl.claim_batch(tx, INBOUND, owner="a", epoch=e1, limit=10) == []
        assert (
            insert_inbound(
                tx, epoch=e1, node_id="a", message_id="late", control_id="late", connection="c", payload="MSH|"
            )
            is None
        )
        assert rl.sweep_expired(tx, INBOUND, owner="a", epoch=e1) == 0
    assert (
        rows(store, "SELECT id, status, lease_owner, claim_epoch, updated_at FROM stage_inbound ORDER BY id") == before
    )
    assert rows(store, "SELECT count(*) AS n FROM message_events") == events_before


def test_recovery_on_promotion_repends_older_epochs_once_and_spares_current_claims(store):
    a = LeaderElector(store, node_id="a", ttl_seconds=600, fence_timeout_seconds=300)
    e1 = a.step().epoch
    seed_inbound(store, 30)
    with store.transaction() as tx:
        stale = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="a", epoch=e1, limit=10)]
    a.release()
    b = LeaderElector(store, node_id="b", ttl_seconds=600, fence_timeout_seconds=300)
    e2 = b.step().epoch
    with store.transaction() as tx:
        mine = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="b", epoch=e2, limit=5)]
    with store.transaction() as tx:
        assert rl.recover_on_promotion(tx, owner="b", epoch=e2) == 10  # lease-blind: row leases still live
    with store.transaction() as tx:
        assert rl.recover_on_promotion(tx, owner="b", epoch=e2) is None  # once per epoch
        assert rl.recover_on_promotion(tx, owner="a", epoch=e1) is None  # a stale epoch cannot run it
    got = rows(store, "SELECT id, status FROM stage_inbound WHERE status <> 'pending' ORDER BY id")
    assert got == [{"id": i, "status": "in_flight"} for i in sorted(mine)]
    ev = rows(store, "SELECT row_id, epoch, node_id FROM message_events WHERE event = 'recovered' ORDER BY row_id")
    assert ev == [{"row_id": i, "epoch": e2, "node_id": "b"} for i in sorted(stale)]


def test_sweep_repends_only_expired_row_leases(store):
    epoch = take_lease(store).epoch
    seed_inbound(store, 6)
    with store.transaction() as tx:
        short = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="a", epoch=epoch, limit=3, lease_seconds=0.1)]
        long = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="a", epoch=epoch, limit=3, lease_seconds=600)]

    def swept():
        with store.transaction() as tx:
            return rl.sweep_expired(tx, INBOUND, owner="a", epoch=epoch)

    assert wait_for(swept, timeout=5, what="row leases to expire") == 3
    got = rows(store, "SELECT id, status FROM stage_inbound ORDER BY id")
    assert got == [{"id": i, "status": "pending"} for i in short] + [{"id": i, "status": "in_flight"} for i in long]


def test_single_node_restart_recovers_the_previous_process_claims(store):
    e1 = acquire_permanent(store, node_id="solo:1:aa")
    seed_inbound(store, 4)
    with store.transaction() as tx:
        rl.claim_batch(tx, INBOUND, owner="solo:1:aa", epoch=e1, limit=4)
    e2 = acquire_permanent(store, node_id="solo:2:bb")
    with store.transaction() as tx:
        assert rl.recover_on_promotion(tx, owner="solo:2:bb", epoch=e2) == 4
    assert Counter(r["status"] for r in rows(store, "SELECT status FROM stage_inbound")) == {"pending": 4}


def test_finish_rejects_a_non_final_status(store):
    with store.transaction() as tx, pytest.raises(ValueError, match="finish status"):
        rl.finish_batch(tx, INBOUND, [1], owner="a", epoch=1, status="pending")


def test_a_claim_holds_a_lane_behind_its_stranded_row_and_lets_other_lanes_pass(store):
    epoch = take_lease(store).epoch
    seed_inbound(store, 9, lanes=3)  # ids 1..9, lane = id % 3
    with store.transaction() as tx:
        stranded = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="dead", epoch=epoch, limit=1)]
        # the claimer died; its row stays in_flight until the sweep. The next claim:
        nxt = rl.claim_batch(tx, INBOUND, owner="next", epoch=epoch, limit=100)
    lanes = {r["id"]: r["lane_key"] for r in rows(store, "SELECT id, lane_key FROM stage_inbound")}
    [dead_lane] = {lanes[i] for i in stranded}
    assert [r["id"] for r in nxt] == sorted(i for i, lane in lanes.items() if lane != dead_lane)
    assert rows(
        store, f"SELECT count(*) AS n FROM stage_inbound WHERE lane_key = '{dead_lane}' AND status = 'pending'"
    ) == [{"n": 2}]


def test_a_claim_holds_a_lane_behind_a_row_backing_off(store):
    epoch = take_lease(store).epoch
    seed_inbound(store, 4, lanes=2)
    with store.transaction() as tx:
        [first] = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="a", epoch=epoch, limit=1)]
        rl.fail_batch(tx, INBOUND, [first], owner="a", epoch=epoch, error="boom", max_attempts=5, backoff_seconds=600)
        got = rl.claim_batch(tx, INBOUND, owner="b", epoch=epoch, limit=100)
    lane = rows(store, f"SELECT lane_key FROM stage_inbound WHERE id = {first}")[0]["lane_key"]
    assert {r["lane_key"] for r in got} == {"0", "1"} - {lane}
    assert len(got) == 2


def test_the_sweep_dead_letters_a_row_whose_claimers_keep_dying(store):
    epoch = take_lease(store).epoch
    seed_inbound(store, 2)

    def claim_and_die() -> None:
        with store.transaction() as tx:
            rl.claim_batch(tx, INBOUND, owner="doomed", epoch=epoch, limit=1, lease_seconds=0.0)
        with store.transaction() as tx:
            assert rl.sweep_expired(tx, INBOUND, owner="a", epoch=epoch, max_attempts=3) == 1

    for _ in range(3):
        claim_and_die()
    got = rows(store, "SELECT id, status, attempts, last_error FROM stage_inbound ORDER BY id")
    assert [(r["status"], r["attempts"]) for r in got] == [("dead", 3), ("pending", 0)]
    assert "expired after 3 attempts" in got[0]["last_error"]
    events = rows(store, "SELECT to_status FROM message_events WHERE event = 'lease_expired' ORDER BY id")
    assert [e["to_status"] for e in events] == ["pending", "pending", "dead"]


def test_one_statement_transitions_write_the_same_events_as_two(store):
    """PostgreSQL writes a transition's audit events in the transition's own statement (`audited`);
    the events must be exactly those of the two-statement path SQLite and SQL Server take."""
    if store.audited_sql("finish_batch", INBOUND) is None:
        pytest.skip("this dialect writes the events in a second statement")
    seed_inbound(store, 40, lanes=40)
    epoch = take_lease(store).epoch
    with store.transaction() as tx:
        ids = [r["id"] for r in rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=40)]
    one_done, two_done = ids[:10], ids[10:20]
    one_failed, two_failed = ids[20:30], ids[30:]
    with store.transaction() as tx:
        rl.finish_batch(tx, INBOUND, one_done, owner="w", epoch=epoch)
        rl.fail_batch(tx, INBOUND, one_failed, owner="w", epoch=epoch, error="boom", max_attempts=5)
    two_statements = {k: v for k, v in store._queries.items() if k != "audited"}
    store._queries, kept = two_statements, store._queries
    try:
        assert store.audited_sql("finish_batch", INBOUND) is None
        with store.transaction() as tx:
            rl.finish_batch(tx, INBOUND, two_done, owner="w", epoch=epoch)
            rl.fail_batch(tx, INBOUND, two_failed, owner="w", epoch=epoch, error="boom", max_attempts=5)
    finally:
        store._queries = kept

    def events(row_ids: list[int]) -> list[dict]:
        got = rows(
            store,
            "SELECT row_id, stage, message_id, control_id, destination, event, from_status, to_status, "
            f"epoch, node_id, attempt, detail FROM message_events WHERE event <> 'received' "
            f"AND row_id IN ({','.join(map(str, row_ids))}) ORDER BY row_id",
        )
        return [{k: v for k, v in e.items() if k not in ("row_id", "message_id", "control_id")} for e in got]

    assert len(events(one_done + one_failed)) == 20
    assert events(one_done) == events(two_done)
    assert events(one_failed) == events(two_failed)
    assert {e["event"] for e in events(one_failed)} == {"attempt_failed"}
    assert {e["detail"] for e in events(one_failed)} == {"boom"}


def test_a_lone_message_is_staged_as_a_batch_of_one_would_be(store):
    """PostgreSQL stages a lone message with `stage_inbound_one` (plain parameters, no JSON): its
    state row, body and `received` event must be exactly those the general statement writes, and a
    re-delivery of the same message_id is skipped the same way; under a stale epoch nothing lands."""
    if not store.has_query("stage_inbound_one"):
        pytest.skip("this dialect has one staging statement")
    epoch = take_lease(store).epoch
    lone = {
        "connection": "adt-in",
        "control_id": "C1",
        "lane_key": "P1",
        "charset": "utf-8",
        "payload": "MSH|^~\\&|A|B|C|D|20240101||ADT^A01|C1|P|2.5\rPID|1||P1",
    }
    with store.transaction() as tx:
        one = rl.stage_inbound(tx, [{**lone, "message_id": "one"}], epoch=epoch, node_id="n1")
        assert rl.stage_inbound(tx, [{**lone, "message_id": "one"}], epoch=epoch, node_id="n1") == {}
        assert rl.stage_inbound(tx, [{**lone, "message_id": "stale"}], epoch=epoch - 1, node_id="n1") is None
    general = {k: v for k, v in store._queries.items() if k != "stage_inbound_one"}
    store._queries, kept = general, store._queries
    try:
        with store.transaction() as tx:
            two = rl.stage_inbound(tx, [{**lone, "message_id": "general"}], epoch=epoch, node_id="n1")
    finally:
        store._queries = kept
    assert set(one) == {"one"} and set(two) == {"general"}

    def staged(message_id: str) -> list[dict]:
        got = rows(
            store,
            "SELECT i.message_id, i.control_id, i.connection, i.lane_key, i.charset, i.status, "
            "i.attempts, i.batch_id, b.payload, e.stage, e.event, e.from_status, e.to_status, "
            "e.epoch, e.node_id, e.attempt, e.detail, e.row_id = i.id AS event_on_row "
            "FROM stage_inbound i JOIN inbound_bodies b ON b.id = i.id "
            f"JOIN message_events e ON e.message_id = i.message_id WHERE i.message_id = '{message_id}'",
        )
        return [{k: v for k, v in r.items() if k != "message_id"} for r in got]

    assert staged("one") == staged("general")
    assert staged("one")[0]["payload"] == lone["payload"] and staged("one")[0]["event"] == "received"
    assert rows(store, "SELECT count(*) AS n FROM stage_inbound WHERE message_id = 'stale'")[0]["n"] == 0
