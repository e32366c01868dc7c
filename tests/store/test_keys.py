"""Business keys (`include/store/keys.py`, `include/keys_config.py`, migrations 0016, 0018): the
config, the extraction, the indexer of a route claim and the catch-up behind its mark, the search by
key (exact, prefix, time window, pages) and the keys' life through retention, on real SQLite and
PostgreSQL stores."""

from __future__ import annotations

import pytest

from include.housekeeping import KEYS, retention
from include.keys_config import KeyRules, KeysConfigError, load_keys, parse_keys
from include.store import Store
from include.store import keys as K
from include.store import operator as ops
from include.store.lease import acquire_permanent
from tests.dags.stores import age, execute, finished_messages, rows
from tests.support.staging import insert_inbound

RULES = parse_keys(
    {"keys": {"mrn": "PID-3.1", "event": "MSH-9.2"}, "connections": {"lab-in": {"accession": "OBR-3.1"}}}
)
DAY = 86_400.0


def hl7(control: str, mrn: str, *, event: str = "A01", accession: str = "") -> str:
    return (
        f"MSH|^~\\&|HIS|H|SL|SL|20261127120000||ADT^{event}|{control}|P|2.5.1\r"
        f"PID|1||{mrn}^^^H^MR~X9^^^SSA^SS||DOE^JANE\r" + (f"OBR|1||{accession}^LAB\r" if accession else "")
    )


def stage(store: Store, epoch: int, messages: list[tuple[str, str, str]]) -> list[int]:
    """Stage (connection, control id, body) messages; their inbound ids."""
    with store.transaction() as tx:
        return [
            insert_inbound(tx, epoch=epoch, node_id="n1", message_id=f"m-{c}", control_id=c, connection=conn, payload=p)
            for conn, c, p in messages
        ]


def find(store: Store, text: str, **kwargs) -> list[tuple[int, str]]:
    return [(r["id"], r["key_value"]) for r in K.find(store, K.KeyQuery.parse(text, **kwargs))]


# --- config and extraction (no store) ---------------------------------------------------------


def test_keys_config_names_every_problem_at_once(tmp_path):
    with pytest.raises(KeysConfigError) as caught:
        parse_keys(
            {
                "keys": {"MRN": "PID-3.1", "visit": "PV1-19x", "event": 9},
                "connections": {"lab": {"acc": "OBR-3.1"}, "bad": "PID-3"},
                "key": {},
            }
        )
    found = {p.key for p in caught.value.problems}
    assert found == {"keys.MRN", "keys.visit", "keys.event", "connections.bad", "key"}
    assert load_keys(tmp_path) == KeyRules() and not load_keys(tmp_path)
    (tmp_path / "keys.toml").write_text('[keys]\nmrn = "PID-3.1"\n[connections.lab-in]\nmrn = "PID-2"\n')
    rules = load_keys(tmp_path)
    assert {n: str(p) for n, p in rules.for_connection("adt-in").items()} == {"mrn": "PID-3.1"}
    assert {n: str(p) for n, p in rules.for_connection("lab-in").items()} == {"mrn": "PID-2"}
    (tmp_path / "keys.toml").write_text("[keys\n")
    with pytest.raises(KeysConfigError, match="not valid TOML"):
        load_keys(tmp_path)


def test_keys_of_a_message_take_the_first_repetition_and_skip_what_cannot_be_kept():
    paths = RULES.for_connection("lab-in")
    assert K.keys_of(hl7("C1", "12345", accession="ACC-9"), paths) == [
        ("mrn", "12345"),
        ("event", "A01"),
        ("accession", "ACC-9"),
    ]
    assert K.keys_of(hl7("C1", ""), paths) == [("event", "A01")]  # empty: no key
    assert K.keys_of(hl7("C1", "9" * 200), paths) == [("event", "A01")]  # too long for the column
    assert K.keys_of(hl7("C1", "12\x0145"), paths) == [("event", "A01")]  # a control character
    # 100 characters outside the BMP are 200 UTF-16 units: too long for SQL Server's nvarchar(200)
    assert K.keys_of(hl7("C1", "\U0001f600" * 100), paths) == [("event", "A01")]
    assert K.keys_of(hl7("C1", "\U0001f600" * 99), paths)[0] == ("mrn", "\U0001f600" * 99)
    assert K.keys_of("not hl7 at all", paths) == [] and K.keys_of(None, paths) == []


def test_a_key_search_is_parsed_strictly_and_its_range_is_exact_or_a_prefix():
    exact = K.KeyQuery.parse("mrn=12345").params()
    assert (exact["lo"], exact["hi"]) == ("12345", "12345\x01")
    prefix = K.KeyQuery.parse("mrn=123*").params()
    assert (prefix["lo"], prefix["hi"]) == ("123", "124")
    assert K.KeyQuery.parse("mrn=a=b").value == "a=b"
    assert K._after_prefix("a\ud7ff") == "a\ue000"
    for bad in ("12345", "MRN=1", "=1", "mrn x=1"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            K.KeyQuery.parse(bad)
    for bad, why in (("mrn=", "needs a value"), ("mrn=*", "needs a value"), ("mrn=a\x00", "printable")):
        with pytest.raises(ValueError, match=why):
            K.KeyQuery.parse(bad).params()
    with pytest.raises(ValueError, match="limit"):
        K.KeyQuery.parse("mrn=1", limit=5000).params()
    with pytest.raises(ValueError, match="since_ms"):
        K.KeyQuery.parse("mrn=1", since_ms=-1).params()


# --- on the stores ------------------------------------------------------------------------------


def test_the_indexer_keeps_each_claimed_messages_keys_per_connection_once(store):
    epoch = acquire_permanent(store, node_id="n1")
    ids = stage(
        store,
        epoch,
        [
            ("adt-in", "C1", hl7("C1", "12345")),
            ("lab-in", "C2", hl7("C2", "12345", event="R01", accession="ACC-1")),
            ("adt-in", "C3", hl7("C3", "99")),
        ],
    )
    assert K.index(store, KeyRules(), ids) == 0  # no keys configured: nothing read
    assert K.index(store, RULES, []) == 0
    assert K.index(store, RULES, ids[:2]) == 2
    assert K.index(store, RULES, [ids[2], ids[2], 10**12]) == 1  # a repeated or unknown id: read once, or not
    kept = rows(store, "SELECT message, name, value, connection FROM message_keys ORDER BY message, name")
    expected = [
        (ids[0], "event", "A01", "adt-in"),
        (ids[0], "mrn", "12345", "adt-in"),
        (ids[1], "accession", "ACC-1", "lab-in"),
        (ids[1], "event", "R01", "lab-in"),
        (ids[1], "mrn", "12345", "lab-in"),
        (ids[2], "event", "A01", "adt-in"),
        (ids[2], "mrn", "99", "adt-in"),
    ]
    assert [(r["message"], r["name"], r["value"], r["connection"]) for r in kept] == expected
    # claimed again (a retried batch, a replay re-pended): each key still once
    assert K.index(store, RULES, ids) == 3
    assert rows(store, "SELECT count(*) AS n FROM message_keys")[0]["n"] == 7


def test_an_index_failure_is_retried_once_then_logged_without_a_value_never_raised(store, caplog):
    epoch = acquire_permanent(store, node_id="n1")
    ids = stage(store, epoch, [("adt-in", "C1", hl7("C1", "SECRET-MRN"))])
    execute(store, "DROP TABLE message_keys")  # the insert fails, as a store outage would
    assert K.index_alongside(store, RULES, ids) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "keys" in r.getMessage()]
    assert len(warnings) == 2 and "attempt 2 of 2" in warnings[1]
    assert not any("SECRET-MRN" in r.getMessage() for r in caplog.records)


def test_the_catch_up_indexes_what_was_staged_before_version_18_up_to_its_bound_once(store):
    epoch = acquire_permanent(store, node_id="n1")
    ids = stage(store, epoch, [("adt-in", f"C{n}", hl7(f"C{n}", f"P{n}")) for n in range(4)])
    assert K.catch_up(store, RULES) == 0  # a new store: nothing was staged before version 18
    # as migration 0018 leaves a store whose old indexer had read up to ids[0] when the newest was ids[2]
    execute(store, f"UPDATE key_progress SET last_id = {ids[0]}, until_id = {ids[2]}")
    assert K.catch_up(store, KeyRules()) == 0
    assert K.catch_up(store, RULES, limit=1) == 1
    assert K.catch_up(store, RULES, limit=1) == 1
    assert K.catch_up(store, RULES) == 0
    assert [r["message"] for r in rows(store, "SELECT DISTINCT message FROM message_keys ORDER BY message")] == [
        ids[1],
        ids[2],
    ]  # ids[3] is newer than the bound: the route indexes it when it claims it
    assert rows(store, "SELECT last_id FROM key_progress")[0]["last_id"] == ids[2]
    # a bound past rows that are gone (purged since) still ends
    execute(store, f"UPDATE key_progress SET last_id = {ids[3]}, until_id = {ids[3] + 50}")
    assert K.catch_up(store, RULES) == 0
    assert rows(store, "SELECT last_id FROM key_progress")[0]["last_id"] == ids[3] + 50


def test_find_by_key_exact_prefix_window_and_pages_newest_first(store):
    epoch = acquire_permanent(store, node_id="n1")
    mrns = ["12345", "12399", "123", "777", "12345", "1234%", "1234_"]
    ids = stage(store, epoch, [("adt-in", f"C{n}", hl7(f"C{n}", m)) for n, m in enumerate(mrns)])
    K.index(store, RULES, ids)
    assert find(store, "mrn=12345") == [(ids[4], "12345"), (ids[0], "12345")]
    assert find(store, "mrn=123*") == [(i, mrns[n]) for n, i in reversed(list(enumerate(ids))) if n != 3]
    # LIKE's wildcards in a value are plain characters
    assert find(store, "mrn=1234%") == [(ids[5], "1234%")]
    assert find(store, "mrn=1234_*") == [(ids[6], "1234_")]
    assert find(store, "mrn=1234") == [] and find(store, "mrn=2*") == [] and find(store, "visit=1") == []
    assert find(store, "mrn=' OR 1=1 --") == []
    page = find(store, "mrn=123*", limit=2)
    assert page == [(ids[6], "1234_"), (ids[5], "1234%")]
    assert find(store, "mrn=123*", limit=2, before_id=page[-1][0]) == [(ids[4], "12345"), (ids[2], "123")]
    # the window is on the message's received time, the store's clock
    age(store, "message_keys", "received_at", f"message = {ids[0]}", DAY)
    found = K.find(store, K.KeyQuery.parse("mrn=12345"))
    now_ms = found[0]["created_ms"]
    assert now_ms - found[1]["created_ms"] >= DAY * 1000
    assert find(store, "mrn=12345", since_ms=now_ms - 3_600_000) == [(ids[4], "12345")]
    assert find(store, "mrn=12345", until_ms=now_ms - 3_600_000) == [(ids[0], "12345")]
    first = K.find(store, K.KeyQuery.parse("mrn=12345"))[0]
    assert (first["control_id"], first["connection"], first["status"], first["tier"]) == (
        "C4",
        "adt-in",
        "pending",
        "hot",
    )


def test_a_messages_keys_follow_it_into_the_archive_and_go_only_when_it_is_deleted_unarchived(store):
    epoch = acquire_permanent(store, node_id="n1")
    ids = finished_messages(store, epoch, "msg-", None, 3)
    for n, i in enumerate(ids):
        execute(store, f"UPDATE inbound_bodies SET payload = '{hl7(f'c{n}', 'P7')}' WHERE id = {i}")
    K.index(store, RULES, ids)
    assert [r["key_value"] for r in ops.show(store, ids[0]).keys] == ["A01", "P7"]
    for table in ("stage_inbound", "stage_routed", "stage_outbound"):
        age(store, table, "updated_at", "1 = 1", 2 * DAY)

    retention(store, epoch, {"inbound": DAY, "routed": DAY, "outbound": DAY})
    assert [(r["id"], r["tier"], r["control_id"]) for r in K.find(store, K.KeyQuery.parse("mrn=P7"))] == [
        (ids[2], "archive", "c2"),
        (ids[1], "archive", "c1"),
        (ids[0], "archive", "c0"),
    ]
    assert [r["key_value"] for r in ops.show(store, ids[0]).keys] == ["A01", "P7"]
    # the Parquet export deletes archived rows once Parquet holds them: the keys stay, naming the tier
    execute(store, f"DELETE FROM archive_inbound WHERE id = {ids[0]}")
    assert [r["tier"] for r in K.find(store, K.KeyQuery.parse("mrn=P7"))] == ["archive", "archive", "parquet"]
    # retention without an archive deletes the messages, and their keys with them
    later = finished_messages(store, epoch, "late-", None, 1)
    execute(store, f"UPDATE inbound_bodies SET payload = '{hl7('L1', 'P8')}' WHERE id = {later[0]}")
    K.index(store, RULES, later)
    for table in ("stage_inbound", "stage_routed", "stage_outbound"):
        age(store, table, "updated_at", "1 = 1", 2 * DAY)
    age(store, "message_keys", "received_at", f"message = {later[0]}", 2 * DAY)
    assert retention(store, epoch, {"inbound": DAY, "routed": DAY, "outbound": DAY}, archive=False)[KEYS] == 2
    assert find(store, "mrn=P8") == []
    assert len(find(store, "mrn=P7")) == 3  # archived ones are untouched


def test_saved_searches_keep_checked_criteria_by_name(store):
    from include.store import saved_searches as saved

    assert saved.save(store, "p1", {"key": "mrn=P1", "status": None, "where": []}, actor="jdoe") == {"key": "mrn=P1"}
    saved.save(store, "ohara", {"contains": "O'HARA", "where": 'PID-8 = "F"'}, actor="x" * 500)
    with pytest.raises(saved.SearchExists, match="a saved search p1 exists: replace it on purpose"):
        saved.save(store, "p1", {"key": "mrn=P2"}, actor="ann")  # not over someone's search by a typo
    assert saved.get(store, "p1")["saved_by"] == "jdoe"
    saved.save(store, "p1", {"key": "mrn=P2"}, actor="ann", replace=True)  # replaced on purpose
    listed = saved.list_all(store)
    assert [(s["name"], s["query"], s["saved_by"]) for s in listed] == [
        ("ohara", {"contains": "O'HARA", "where": ['PID-8 = "F"']}, "x" * 200),
        ("p1", {"key": "mrn=P2"}, "ann"),
    ]
    assert saved.get(store, "p1")["query"] == {"key": "mrn=P2"} and saved.get(store, "p2") is None
    for name, replace in (("P1", False), ("P1", True), ("OHara", True)):  # a name told apart by case alone
        with pytest.raises(saved.SearchExists, match="exists \\(names are compared ignoring case\\)"):
            saved.save(store, name, {"key": "mrn=P3"}, actor="eve", replace=replace)
    assert saved.get(store, "P1") is None and saved.get(store, "p1")["query"] == {"key": "mrn=P2"}
    assert saved.delete(store, "p1") and not saved.delete(store, "p1")
    for doc, why in (
        ({}, "at least one criterion"),
        ({"sql": "DROP TABLE x"}, "unknown field"),
        ({"key": 5}, "must be text"),
        ({"where": [1]}, "list of condition texts"),
        ({"contains": "x" * 1001}, "at most 1000"),
        ([], "JSON object"),
    ):
        with pytest.raises(ValueError, match=why):
            saved.save(store, "bad", doc, actor="a")
    for name in ("", "-x", "a b", "x" * 65, "a/b"):
        with pytest.raises(ValueError, match="name"):
            saved.save(store, name, {"key": "mrn=1"}, actor="a")
    assert [s["name"] for s in saved.list_all(store)] == ["ohara"]
    for name in ("a", "b", "c"):
        saved.save(store, name, {"status": "dead"}, actor="a")
    assert [s["name"] for s in saved.list_all(store, saved.Page(2))] == ["a", "b"]
    assert [s["name"] for s in saved.list_all(store, saved.Page(2, after="b"))] == ["c", "ohara"]
    assert saved.list_all(store, saved.Page(2, after="ohara")) == []
    for page, why in ((saved.Page(0), "limit must be 1..1000"), (saved.Page(1, after="a b"), "name")):
        with pytest.raises(ValueError, match=why):
            saved.list_all(store, page)


def test_config_check_reads_keys_toml_as_the_route_task_does(tmp_path):
    from listeners.config_check import check_dir

    (tmp_path / "routes.toml").write_text("")
    assert check_dir(tmp_path).ok  # no keys.toml: no keys, nothing to say
    (tmp_path / "keys.toml").write_text('[keys]\nmrn = "PID-3.1"\nvisit = "PV1-19"\n')
    report = check_dir(tmp_path)
    assert report.ok and report.counts["business keys"] == 2  # listenerd and `stageline up` accept the dir
    (tmp_path / "keys.toml").write_text('[keys]\nmrn = "PID-3.x"\n[connections.lab]\nACC = "OBR-3"\n')
    report = check_dir(tmp_path)
    assert not report.ok
    assert {(p.file.name, p.key) for p in report.problems} == {
        ("keys.toml", "keys.mrn"),
        ("keys.toml", "connections.lab.ACC"),
    }
