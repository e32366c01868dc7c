"""Content search (`include/store/search.py`, `include/hl7match.py`): the condition text, its
Python semantics against the route stage's, and the search on real SQLite and PostgreSQL stores —
the window, wildcards taken literally, pages, and the bounds (window, time)."""

from __future__ import annotations

import threading
import time

import pytest

from include.conditions import ConditionError, parse_condition
from include.hl7match import matches, parse_where
from include.store import Store
from include.store import search as S
from include.store.lease import acquire_permanent
from tests.dags.stores import age
from tests.support.staging import insert_inbound

DAY = 86_400.0
ADT = (
    "MSH|^~\\&|HIS|H|SL|SL|20261127||ADT^A01|C1|P|2.5\rPID|1||P1^^^H^MR~X^^^S||DOE^JANE||19700101|F\r"
    "OBX|1||A||1|||H\rOBX|2||B||2|||N\r"
)


def test_where_text_becomes_the_routing_grammar():
    assert parse_where('PID-8 = "F"') == parse_condition({"field": "PID-8", "op": "eq", "value": "F"})
    assert parse_where('PID-8 != F and PID-5.1 ~ "^DO"') == parse_condition(
        {"all": [{"field": "PID-8", "op": "ne", "value": "F"}, {"field": "PID-5.1", "op": "regex", "value": "^DO"}]}
    )
    assert parse_where('any OBX-8 in ("H", "HH")') == parse_condition(
        {"field": "OBX-8", "op": "in", "value": ["H", "HH"], "segments": "any"}
    )
    assert parse_where("segment ZPI") == parse_condition({"segment": "ZPI"})
    assert parse_where("PV1-2 exists") == parse_condition({"field": "PV1-2", "op": "exists"})
    for bad in ("", "PID-8", 'PID-8 == "F"', 'pid-8 = "F"', 'PID-8 = "F', "PID-8 ~ (?P<x>a)"):
        with pytest.raises(ConditionError):
            parse_where(bad)
    with pytest.raises(ConditionError, match=r"PID-99999999999999999999\.1.*field number past 99999"):
        parse_where('PID-99999999999999999999.1 = "F"')


def test_and_inside_a_quoted_value_is_part_of_the_value():
    """Clauses are cut at ` and ` outside quotes only, as shlex then reads each clause."""
    assert parse_where('PID-5 = "SMITH and SONS"') == parse_condition(
        {"field": "PID-5", "op": "eq", "value": "SMITH and SONS"}
    )
    assert parse_where('PID-5.1 = \'A and B\' and PID-8 = F and PID-5.2 ~ "x\\" and y"') == parse_condition(
        {
            "all": [
                {"field": "PID-5.1", "op": "eq", "value": "A and B"},
                {"field": "PID-8", "op": "eq", "value": "F"},
                {"field": "PID-5.2", "op": "regex", "value": 'x" and y'},
            ]
        }
    )
    assert parse_where('PID-8 in ("F and U", "M")') == parse_condition(
        {"field": "PID-8", "op": "in", "value": ["F and U", "M"]}
    )
    with pytest.raises(ConditionError, match="No closing quotation"):
        parse_where('PID-5 = "SMITH and PID-8 = F')


def test_conditions_read_a_message_as_the_route_stage_does():
    assert matches(parse_where('PID-8 = "F"'), ADT)
    assert not matches(parse_where('PID-8 = "M"'), ADT)
    assert not matches(parse_where('PID-9 = ""'), ADT) and not matches(parse_where('PID-9 != "F"'), ADT)  # absent
    assert matches(parse_where('PID-3.1 = "P1"'), ADT) and not matches(parse_where('PID-3.1 = "X"'), ADT)
    assert matches(parse_where('any OBX-8 = "H"'), ADT) and not matches(parse_where('all OBX-8 = "H"'), ADT)
    assert matches(parse_where('MSH-9.2 in (A01, A04) and PID-5.1 ~ "^DO"'), ADT)
    assert matches(parse_where("segment OBX"), ADT) and not matches(parse_where("segment ZPI"), ADT)
    assert matches(parse_where("MSH-1 = |"), ADT)
    assert not matches(parse_where("PID-8 exists"), "not hl7") and not matches(parse_where("PID-8 exists"), None)
    assert matches(parse_condition({"not": {"field": "PID-8", "op": "eq", "value": "M"}}), ADT)
    assert matches(parse_condition({"connection": "adt-in"}), ADT, "adt-in")


def stage(store: Store, bodies: list[tuple[str, str]]) -> list[int]:
    epoch = acquire_permanent(store, node_id="n1")
    with store.transaction() as tx:
        return [
            insert_inbound(
                tx, epoch=epoch, node_id="n1", message_id=f"m{n}", control_id=f"C{n}", connection=c, payload=b
            )
            for n, (c, b) in enumerate(bodies)
        ]


def found(store: Store, **kwargs) -> list[int]:
    return [r["id"] for r in S.find(store, S.ContentQuery(**kwargs))]


def test_content_search_in_a_window_takes_the_text_literally_and_pages(store):
    ids = stage(
        store,
        [
            ("adt-in", ADT.replace("DOE", "O'HARA")),
            ("adt-in", ADT.replace("DOE", "100%_x")),
            ("lab-in", ADT.replace("|F\r", "|M\r")),
            ("adt-in", ADT),
        ],
    )
    assert found(store, text="O'HARA") == [ids[0]]
    assert found(store, text="100%_x") == [ids[1]]
    assert found(store, text="100__x") == [] and found(store, text="%") == [ids[1]]
    assert found(store, text="doe") == []  # case-sensitive on every store
    assert found(store, text="DOE") == [ids[3], ids[2]]
    assert found(store, text="DOE", connection="lab-in") == [ids[2]]
    assert found(store, where=parse_where('PID-8 = "F"')) == [ids[3], ids[1], ids[0]]
    assert found(store, text="JANE", where=parse_where('PID-8 = "F"'), limit=2) == [ids[3], ids[1]]
    assert found(store, text="JANE", where=parse_where('PID-8 = "F"'), limit=2, before_id=ids[1]) == [ids[0]]
    rows = S.find(store, S.ContentQuery(text="O'HARA"))
    assert set(rows[0]) == {"id", "message_id", "control_id", "connection", "status", "created_ms"}  # no body
    # the window: by default the last day, on the store's clock
    age(store, "stage_inbound", "created_at", f"id = {ids[3]}", 2 * DAY)
    assert found(store, text="DOE") == [ids[2]]
    now_ms = rows[0]["created_ms"]
    wide = {"since_ms": now_ms - int(3 * DAY * 1000), "until_ms": now_ms + 60_000}
    assert found(store, text="DOE", **wide) == [ids[3], ids[2]]
    assert found(store, text="DOE", since_ms=wide["since_ms"], until_ms=now_ms - int(DAY * 1000)) == [ids[3]]


def test_content_search_refuses_a_wide_window_and_stops_at_its_time(store):
    stage(store, [("adt-in", ADT)] * 3)
    with pytest.raises(S.SearchTooBroad, match="at most 7 days"):
        S.find(store, S.ContentQuery(text="DOE", since_ms=0, until_ms=8 * int(DAY * 1000)))
    with pytest.raises(ValueError, match="window is empty"):
        S.find(store, S.ContentQuery(text="DOE", since_ms=10, until_ms=10))
    for bad in ("", "x" * 201, "a\x00"):
        with pytest.raises(ValueError, match="--contains"):
            S.find(store, S.ContentQuery(text=bad))
    bulk(store, 100_000)
    assert found(store, text="DOE", limit=1) != []
    with pytest.raises(S.SearchTooBroad, match="narrow the window"):
        S.find(store, S.ContentQuery(text="not in any body"), timeout=0.002)
    assert found(store, text="DOE", limit=2) != []  # the store answers the next search


def bulk(store: Store, n: int) -> None:
    """`n` more messages with bodies, staged in one statement each (test setup, not the product's path)."""
    series = (
        f"WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {n}) SELECT i FROM s"
        if store.backend == "sqlite"
        else f"SELECT i FROM generate_series(1, {n}) AS s(i)"
    )
    with store.transaction() as tx:
        cur = tx.conn.cursor()
        cur.execute(
            "INSERT INTO stage_inbound (message_id, control_id, connection) "
            f"SELECT 'bulk-' || CAST(i AS TEXT), 'B' || CAST(i AS TEXT), 'adt-in' FROM ({series}) AS n"
        )
        cur.execute(
            "INSERT INTO inbound_bodies (id, payload) SELECT id, 'MSH|^~\\&|BULK|' || message_id || '|PID|1||P9' "
            "FROM stage_inbound WHERE message_id LIKE 'bulk-%'"
        )


def test_with_the_content_index_the_search_answers_the_same(tmp_path, store):
    """`stageline messages content-index` makes PostgreSQL's trigram index or SQLite's FTS5 one; the
    search then goes through it (a text of 3 characters or more) and answers as without; on SQLite
    the triggers keep it as bodies come and go; --drop removes it."""
    from tests.dags.stores import write_service_config
    from tests.test_cli import run

    ids = stage(store, [("adt-in", ADT.replace("DOE", "100%_x*[y]")), ("adt-in", ADT), ("lab-in", ADT)])
    texts = ("100%_x", "DOE", "%", "x*[y]", "nothing", "DO", "OE^JANE")
    before = [found(store, text=t) for t in texts]
    assert before == [[ids[0]], [ids[2], ids[1]], [ids[0]], [ids[0]], [], [ids[2], ids[1]], [ids[2], ids[1]]]
    cfg = write_service_config(tmp_path, store.config, cluster=False)
    made = run(cfg, "messages", "content-index").stdout
    assert made.startswith("content index made" + (" over 3 bodies" if store.backend == "sqlite" else " in"))
    with store.transaction(write=False) as tx:
        assert tx.row("content_index_present")["n"] == 1
    assert [found(store, text=t) for t in texts] == before
    assert found(store, text="DOE", where=parse_where('PID-8 = "F"'), connection="lab-in") == [ids[2]]
    run(cfg, "messages", "content-index")  # again: nothing changes, nothing indexed twice
    assert [found(store, text=t) for t in texts] == before

    epoch = acquire_permanent(store, node_id="n1")
    with store.transaction() as tx:  # a message after the index: found through it
        later = insert_inbound(
            tx, epoch=epoch, node_id="n1", message_id="late", control_id="L", connection="adt-in", payload=ADT
        )
    assert found(store, text="DOE") == [later, ids[2], ids[1]]
    with store.transaction() as tx:  # retention deletes a message (its body goes with it): not found
        tx.conn.cursor().execute(f"DELETE FROM stage_inbound WHERE id = {ids[1]}")
    assert found(store, text="DOE") == [later, ids[2]]

    assert run(cfg, "messages", "content-index", "--drop").stdout.startswith("content index dropped")
    with store.transaction(write=False) as tx:
        assert tx.row("content_index_present")["n"] == 0
    assert found(store, text="DOE") == [later, ids[2]]
    with store.transaction() as tx:  # no trigger is left behind: a body writes as before
        insert_inbound(tx, epoch=epoch, node_id="n1", message_id="last", control_id="Z", connection="x", payload=ADT)


def test_a_regex_that_could_backtrack_for_ever_is_refused_before_any_read():
    for bad in ('PID-5 ~ "(a+)+$"', 'PID-5 ~ "(\\w*x)*y"', 'PID-5 ~ "(.*a){20}"'):
        with pytest.raises(ConditionError, match="repeated group"):
            parse_where(bad)
    with pytest.raises(ConditionError, match="at most 200"):
        parse_where(f'PID-5 ~ "{"a" * 201}"')
    assert matches(parse_where('PID-5 ~ "^(DOE|ROE)\\^"'), ADT)  # groups and quantifiers apart are fine
    assert parse_where('PID-8 in ("F", "A,B")') == parse_condition(
        {"field": "PID-8", "op": "in", "value": ["F", "A,B"]}
    )


def test_a_regex_that_backtracks_past_the_guard_stops_the_search_and_never_the_process(store):
    """Red team: `(A|AA)+$` passes the nested-quantifier guard and, under Python's `re`, held the
    GIL for minutes — listenerd's ACKs and lease heartbeat stopped with it. The search now ends with
    SearchTooBroad, and other threads run while the regex does."""
    stage(store, [("adt-in", ADT.replace("DOE^JANE", "A" * 5000 + "B"))])
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    started = time.monotonic()
    try:
        with pytest.raises(S.SearchTooBroad, match="regex of the condition ran past"):
            S.find(store, S.ContentQuery(text="MSH", where=parse_where('PID-5 ~ "(A|AA)+$"')), timeout=0.5)
    finally:
        stop.set()
        ticker.join()
    during = [t for t in ticks if t > started]
    assert max(b - a for a, b in zip([started, *during], [*during, time.monotonic()])) < 1.0, "a thread was starved"
    assert found(store, text="MSH", where=parse_where('PID-5 ~ "^A{5000}B$"')) != []  # a sound regex still runs
