"""A group commit is capped by rows, not units; an HL7 batch counts its messages, and one larger
than a commit is committed in parts with other senders' messages between them (issue 23;
docs/listenerd.md, "Large batches"). Its answer still comes only after every part committed; a
failed later part says what was stored, and a re-send of the batch stages only what is missing.

First the plan in memory (`listeners.commitplan`), then both writers on real SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet.epollreactor import EPollReactor

from include.store import Store
from listeners.commitplan import BatchPart, CommitPlan, Entry
from listeners.group_commit import BatchIncomplete, BatchTooLarge, Inbound, InboundBatch, RowRefused, StoreUnavailable
from tests.listeners.test_group_commit import KINDS, Writer, run_until


def one(cid: str, lane: str | None = None) -> Inbound:
    return Inbound(connection="c", control_id=cid, payload=f"MSH|^~\\&|{cid}", lane_key=lane)


def big(name: str, n: int, *, lane: Any = None, poison: int | None = None) -> InboundBatch:
    """A batch of n messages; `lane(k)` gives message k's lane key."""
    return InboundBatch(
        connection="c",
        batch_id=f"batch-{name}",
        bhs_control_id=f"B-{name}",
        declared=n,
        items=tuple(
            Inbound(
                connection="c",
                control_id=f"{name}{k}",
                message_id=f"{name}-m{k}",
                payload=f"MSH|{k}|{'POISON' if k == poison else 'ok'}",
                lane_key=lane(k) if lane else None,
            )
            for k in range(n)
        ),
    )


def plan_of(units: list[Any], cap: int) -> CommitPlan:
    plan = CommitPlan(cap)
    for u in units:
        plan.add(Entry.of(u, None, 0.0, max_rows=cap))
    return plan


def shape(taken: list[tuple[Entry, Any]]) -> list[str]:
    return [
        f"{p.batch.batch_id}[{p.lo}:{p.hi}]"
        if isinstance(p, BatchPart)
        else (p.batch_id if isinstance(p, InboundBatch) else p.control_id)
        for _, p in taken
    ]


def run_plan(plan: CommitPlan, *, arrivals: dict[int, list[Any]] | None = None) -> list[list[str]]:
    """Every commit the plan gives, all committed; `arrivals[k]` join before commit k."""
    commits = []
    while plan or (arrivals and len(commits) in arrivals):
        for u in (arrivals or {}).get(len(commits), []):
            plan.add(Entry.of(u, None, 0.0, max_rows=plan.max_rows))
        taken = plan.take()
        commits.append(shape(taken))
        plan.settle(taken, [None] * len(taken), now=0.0)
    return commits


# -- the plan ------------------------------------------------------------------------------------------


def test_a_commit_is_capped_by_rows_and_a_batch_counts_its_messages():
    small = big("S", 3)
    commits = run_plan(plan_of([one("a"), small, one("b"), one("c")], cap=4))
    assert commits == [["a", "batch-S"], ["b", "c"]]  # the batch is 3 rows: b waits for the next commit


def test_a_batch_larger_than_a_commit_goes_in_parts_with_other_senders_between_them():
    plan = CommitPlan(4, part_rows=3)
    plan.add(Entry.of(big("L", 10), None, 0.0, max_rows=4))
    commits = run_plan(plan, arrivals={1: [one("x")], 2: [one("y"), one("z"), one("w")]})
    assert commits == [["batch-L[0:3]"], ["x", "batch-L[3:6]"], ["y", "z", "w", "batch-L[6:9]"], ["batch-L[9:10]"]]


def test_a_message_of_a_lane_the_batch_holds_waits_for_the_whole_batch_others_pass():
    lanes = big("L", 6, lane=lambda k: f"P{k % 2}")  # lanes P0 and P1
    arrivals = {1: [one("same", "P1"), one("other", "P7"), one("none"), one("same-again", "P1")]}
    commits = run_plan(plan_of([lanes], cap=2), arrivals=arrivals)
    flat = [s for c in commits for s in c]
    last_part = max(i for i, s in enumerate(flat) if s.startswith("batch-L["))
    assert flat.index("other") < last_part and flat.index("none") < last_part  # other lanes pass
    assert last_part < flat.index("same") < flat.index("same-again")  # its lane: after the whole batch, in order


def test_a_failed_part_ends_the_batch_and_counts_what_was_stored():
    plan = plan_of([big("L", 10)], cap=4)
    taken = plan.take()
    assert plan.settle(taken, [None], now=1.0) == []  # the first part: not answered yet
    taken = plan.take()
    [(entry, outcome)] = plan.settle(taken, [StoreUnavailable("down")], now=2.0)
    assert (entry.done, entry.rows, type(outcome)) == (plan.part_rows, 10, StoreUnavailable) and not plan


# -- the writers, on real stores --------------------------------------------------------------------------


@pytest.fixture(params=KINDS, ids=["-".join(k) for k in KINDS])
def writer(request) -> Iterator[Writer]:
    backend, kind = request.param
    config = request.getfixturevalue("sqlite_config_fresh" if backend == "sqlite" else "pg_config_fresh")
    w = Writer(kind, config)
    w.writer.max_batch = 500
    if kind == "reactor":
        w.writer._plan = CommitPlan(500)
    yield w
    w.close()


def settle_all(w: Writer, units: list[Any], *, between: list[Any] | None = None) -> list[Any]:
    """Submit `units`, then (once the first commit is under way) `between`; run until all answered."""
    outcomes: dict[int, Any] = {}
    reactor = w.reactor if w.kind == "reactor" else EPollReactor()
    if w.kind == "thread":
        w.writer._reactor = reactor
        if not w.writer._thread.is_alive():
            w.writer.start()

    def submit(n: int, unit: Any) -> None:
        def settle(result: Any) -> None:
            outcomes[n] = result.value if hasattr(result, "value") else result

        w.writer.submit(unit).addBoth(settle)

    all_units = units + (between or [])
    for n, u in enumerate(units):
        submit(n, u)
    if between:
        reactor.iterate(0)
        for n, u in enumerate(between, len(units)):
            submit(n, u)
    run_until(reactor, lambda: len(outcomes) == len(all_units), timeout=60)
    return [outcomes[n] for n in range(len(all_units))]


def inbound(store: Store, sql: str) -> list[tuple]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(sql)
        return [tuple(r.values()) for r in cur.fetchall()]


def test_a_batch_of_2_5_commits_worth_lands_in_parts_whole_in_order_and_named_in_its_events(writer):
    batch, x, y = big("L", 1250), one("x"), one("y")
    outcomes = settle_all(writer, [batch], between=[x, y])
    assert outcomes == ["batch-L", x.message_id, y.message_id]
    assert writer.statements in (10, 11)  # ten parts of 125; x and y ride along (or go alone)
    rows = inbound(
        writer.store, "SELECT control_id, batch_seq FROM stage_inbound WHERE batch_id IS NOT NULL ORDER BY id"
    )
    assert rows == [(f"L{k}", k + 1) for k in range(1250)]
    assert inbound(writer.store, "SELECT batch_id, message_count FROM inbound_batches") == [("batch-L", 1250)]
    details = inbound(
        writer.store,
        "SELECT e.detail FROM message_events e JOIN stage_inbound s ON s.id = e.row_id "
        "WHERE s.control_id IN ('L0', 'L700', 'L1249') ORDER BY s.id",
    )
    assert details == [
        ("batch batch-L: message 1 of 1250",),
        ("batch batch-L: message 701 of 1250",),
        ("batch batch-L: message 1250 of 1250",),
    ]
    ids = [r[0] for r in inbound(writer.store, "SELECT control_id FROM stage_inbound ORDER BY id")]
    assert ids.index("y") < ids.index("L1249")  # x and y did not wait for the whole batch


def test_a_batch_over_max_batch_messages_is_refused_whole_with_ar(writer):
    writer.writer.max_batch_messages = 1000
    [outcome] = settle_all(writer, [big("H", 1001)])
    assert isinstance(outcome, BatchTooLarge) and isinstance(outcome, RowRefused)
    assert "batch of 1001 messages refused: at most 1000" in str(outcome)
    assert inbound(writer.store, "SELECT count(*) FROM stage_inbound") == [(0,)]


def test_a_later_part_that_fails_says_what_was_stored_and_a_resend_stages_only_the_rest(writer):
    """The store refuses message 800 (part 7 of 125 each): the first 750 stay stored, the answer says so; the
    same batch re-sent (the bytes fixed, as a sender would) lands the rest, nothing twice."""
    from tests.listeners.test_group_commit import refuse_poison

    refuse_poison(writer.store)
    batch = big("F", 1250, poison=800)
    [outcome] = settle_all(writer, [batch])
    assert isinstance(outcome, BatchIncomplete) and (outcome.stored, outcome.total) == (750, 1250)
    assert "messages 1-750 of 1250 stored, 751-1250 not" in str(outcome)
    assert inbound(writer.store, "SELECT count(*) FROM stage_inbound") == [(750,)]
    # a re-send of the same bytes is recognised: the rest staged under the same ids, nothing twice
    with writer.store.transaction() as tx:
        if writer.store.backend == "postgres":
            tx.script("ALTER TABLE inbound_bodies DROP CONSTRAINT no_poison")
        else:
            tx.script("DROP TRIGGER no_poison")
    resent = InboundBatch(
        connection="c",
        batch_id="batch-F-again",
        bhs_control_id="B-F",
        declared=1250,
        items=tuple(
            Inbound(connection="c", control_id=i.control_id, payload=i.payload, message_id=f"again-{k}")
            for k, i in enumerate(batch.items)
        ),
    )
    [again] = settle_all(writer, [resent])
    assert again == "batch-F"  # the first copy's id
    rows = inbound(writer.store, "SELECT control_id, batch_id FROM stage_inbound ORDER BY id")
    assert rows == [(f"F{k}", "batch-F") for k in range(1250)]


def test_a_message_resent_after_a_store_failure_is_recognised(writer):
    """The connection broke during the commit (it may have landed): the re-send gets the first
    copy's id and is answered AA; one row."""
    first = one("R1")
    if writer.kind == "reactor":
        writer.stager.fail_after = 0
    else:
        orig = writer.store.single_statement

        def broken():
            raise ConnectionError("server closed the connection")

        writer.store.single_statement = broken  # type: ignore[method-assign]
    [outcome] = settle_all(writer, [first])
    assert isinstance(outcome, StoreUnavailable)
    if writer.kind == "reactor":
        writer.stager.fail_after = None
    else:
        writer.store.single_statement = orig  # type: ignore[method-assign]
    [again] = settle_all(writer, [one("R1")])
    assert again == first.message_id
    assert inbound(writer.store, "SELECT message_id FROM stage_inbound") == [(first.message_id,)]


def test_postgresql_stages_a_batch_in_one_pass_not_a_lookup_per_message(pg_config_fresh):
    """The staging statement's plan has no subquery run per message: each message's 'received'
    event found its batch's size by scanning the whole batch again (n²: a 20,000-message batch in
    one statement took ~35 s, issue 23); now the sizes are grouped once and joined by hash."""
    import json
    import re

    import psycopg

    store = Store(pg_config_fresh)
    try:
        sql = re.sub(r"(?<![:\w]):([A-Za-z_]\w*)", r"%(\1)s", store.sql("stage_inbound"))
        rows = big("P", 3).rows()
        cfg = pg_config_fresh
        with psycopg.connect(host=cfg.server, port=cfg.port, dbname=cfg.database, user=cfg.username) as conn:
            plan = conn.execute(
                "EXPLAIN (FORMAT JSON) " + sql, {"messages": json.dumps(rows), "epoch": 1, "node_id": "n"}
            ).fetchone()[0]
    finally:
        store.close()
    text = json.dumps(plan)
    assert "SubPlan" not in text, "a subquery runs once per staged message"
    assert '"Hash Right Join"' in text or '"Hash Left Join"' in text or '"Hash Join"' in text
