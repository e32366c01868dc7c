"""Search on listenerd's API as `stageline messages find` searches (issue 26): by business key (exact
and prefix), by content (`contains`, `where` in the routing condition grammar) within a window, paged
by `before_id`; the saved searches listed, shown and run. Against a running daemon, over its socket,
on SQLite and PostgreSQL. A viewer token may not search by key or content (it would tell whether a
guessed MRN is in the store) and sees saved criteria hidden; bad or unknown fields are 400 and echo
nothing; the daemon's log names no MRN and no saved search."""

from __future__ import annotations

import socket
import time
from urllib.parse import quote

import pytest
from hl7.client import MLLPClient

from include.app.lab.listenerd import Daemon
from include.keys_config import parse_keys
from include.store import Store, saved_searches
from include.store import keys as K
from include.store import operator as ops
from tests.listeners.test_api_messages import OPERATOR_TOKEN, call, running


def adt(control: str, mrn: str, sex: str, name: str) -> str:
    return (
        f"MSH|^~\\&|HIS|HOSP|SL|SL|20261127120000||ADT^A01|{control}|P|2.5\r"
        f"PID|1||{mrn}^^^HOSP^MR||{name}||19800101|{sex}\r"
    )


PATIENTS = [("S0", "P77", "F", "DOE^JANE"), ("S1", "P770", "M", "SMITH and SONS^BOB"), ("S2", "Q1", "F", "ROE^ANN")]


@pytest.fixture
def node(tmp_path, store_config, monkeypatch):
    with running(tmp_path, store_config, monkeypatch) as (d, port):
        with MLLPClient("127.0.0.1", port) as client:
            for patient in PATIENTS:
                assert b"MSA|AA" in client.send_message(adt(*patient))
        store = Store(store_config)
        try:
            ids = {r["control_id"]: r["id"] for r in ops.find(store, ops.Filters())}
            K.index(store, parse_keys({"keys": {"mrn": "PID-3.1"}}), list(ids.values()))  # as the route does
            saved_searches.save(store, "p77s", {"key": "mrn=P77*"}, actor="cli ann")
            saved_searches.save(store, "women", {"where": ['PID-8 = "F"'], "connection": "adt-in"}, actor="cli ann")
            saved_searches.save(store, "pending", {"status": "pending"}, actor="cli bob")
        finally:
            store.close()
        yield d, ids


def found(d: Daemon, query: str, token: str = OPERATOR_TOKEN) -> list[str]:
    status, doc = call(d, "GET", f"/messages?{query}", token)
    assert status == 200, (query, status, doc)
    return [m["control_id"] for m in doc["messages"]]


def test_messages_are_found_by_key_and_by_content_as_the_cli_finds_them(node):
    d, ids = node
    assert found(d, "key=mrn=P77") == ["S0"]
    assert found(d, "key=" + quote("mrn=P77*")) == ["S1", "S0"]
    assert found(d, "key=" + quote("mrn=P77*") + "&limit=1") == ["S1"]
    assert found(d, "key=" + quote("mrn=P77*") + f"&limit=1&before_id={ids['S1']}") == ["S0"]
    assert found(d, "key=mrn=nobody") == []
    assert found(d, "contains=" + quote("ROE^ANN")) == ["S2"]
    assert found(d, "contains=roe") == []  # case-sensitive, as the CLI's --contains
    assert found(d, "where=" + quote('PID-8 = "F"')) == ["S2", "S0"]
    assert found(d, "where=" + quote('PID-8 = "F"') + "&where=" + quote('PID-3.1 = "Q1"')) == ["S2"]
    assert found(d, "where=" + quote('PID-5 = "SMITH and SONS^BOB"')) == ["S1"]  # " and " inside a quoted value
    assert found(d, "contains=HOSP&where=" + quote('PID-8 != "F"')) == ["S1"]
    now_ms = int(time.time() * 1000)
    past = f"since_ms={now_ms - 3 * 86_400_000}&until_ms={now_ms - 2 * 86_400_000}"
    assert found(d, f"contains=HOSP&{past}") == []
    assert found(d, f"key=mrn=P77&{past}") == []
    assert found(d, f"contains=HOSP&since_ms={now_ms - 3_600_000}") == ["S2", "S1", "S0"]


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("key=" + quote("mrn=P77") + "&status=pending", "--key combines with"),
        ("key=mrn", "NAME=VALUE"),
        ("key=mrn=P77&key=mrn=Q1", "key given 2 times"),
        ("contains=HOSP&contains=X", "contains given 2 times"),
        ("contains=HOSP&since_ms=0&until_ms=" + str(8 * 86_400_000), "at most 7 days"),
        ("where=" + quote("PID-8 == F"), "expected"),
        ("where=" + quote('PID-99999999999999999999.1 = "F"'), "field path (not echoed): field number past 99999"),
        ("where=" + quote('PID-5 = "HOSP P77'), "No closing quotation: (not echoed)"),
        ("where=" + quote('PID-8 = "F"') + "&where=" + quote('P77 ~ "HOSP"'), "where clause 2 of 2: "),
        ("where=" + quote('PID-5 ~ "[HOSP P77"'), "bad regex (not echoed): unterminated character set"),
        ("contains=HOSP&limit=0", "limit must be 1..1000"),
        ("key=mrn=P77&before_id=x", "not a number"),
        ("mrn=P77", "unknown field"),
        ("contains=", "--contains takes 1 to"),  # an empty text is refused, not dropped into an unfiltered find
        ("contains", "--contains takes 1 to"),
        ("where=", "empty condition"),
        ("contains=HOSP&where=", "empty condition"),
    ],
)
def test_a_bad_search_is_400_naming_what_is_wrong_and_echoing_no_value(node, query, said):
    d, _ = node
    status, doc = call(d, "GET", f"/messages?{query}", OPERATOR_TOKEN)
    assert status == 400 and said in doc["error"], (query, doc)
    assert "P77" not in doc["error"] and "HOSP" not in doc["error"]


def test_a_viewer_may_not_search_by_key_or_content_and_sees_lanes_masked(node):
    d, _ = node
    for query in ("key=mrn=P77", "contains=DOE", "where=" + quote('PID-8 = "F"'), "lane_key=P77"):
        status, doc = call(d, "GET", f"/messages?{query}", d.token)
        assert status == 403 and "need messages:read_body" in doc["error"] and "P77" not in doc["error"], doc
    status, doc = call(d, "GET", "/messages?status=pending", d.token)
    assert status == 200 and [m["control_id"] for m in doc["messages"]] == ["S2", "S1", "S0"]
    assert all(m["lane_key"].startswith("lane:") for m in doc["messages"])


def test_saved_searches_are_listed_shown_and_run_over_the_api(node):
    d, ids = node
    status, doc = call(d, "GET", "/searches", OPERATOR_TOKEN)
    assert status == 200 and [(s["name"], s["query"], s["saved_by"]) for s in doc["searches"]] == [
        ("p77s", {"key": "mrn=P77*"}, "cli ann"),
        ("pending", {"status": "pending"}, "cli bob"),
        ("women", {"where": ['PID-8 = "F"'], "connection": "adt-in"}, "cli ann"),
    ]
    status, doc = call(d, "GET", "/searches", d.token)  # a viewer sees which criteria, not their values
    assert status == 200 and [s["query"] for s in doc["searches"]] == [
        {"key": "mrn=…"},
        {"status": "pending"},
        {"where": ["…"], "connection": "adt-in"},
    ]
    status, doc = call(d, "GET", "/searches?limit=2", OPERATOR_TOKEN)
    assert [s["name"] for s in doc["searches"]] == ["p77s", "pending"]
    status, doc = call(d, "GET", "/searches?limit=2&after=pending", OPERATOR_TOKEN)
    assert [s["name"] for s in doc["searches"]] == ["women"]
    assert call(d, "GET", "/searches/p77s", OPERATOR_TOKEN) == (
        200,
        {"name": "p77s", "query": {"key": "mrn=P77*"}, "saved_by": "cli ann", "saved_ms": pytest.approx(0, abs=1e14)},
    )
    assert call(d, "GET", "/searches/p77s", d.token)[1]["query"] == {"key": "mrn=…"}

    def ran(name: str, query: str = "", token: str = OPERATOR_TOKEN) -> tuple[int, list[str]]:
        status, doc = call(d, "GET", f"/searches/{name}/messages?{query}", token)
        return status, [m["control_id"] for m in doc.get("messages", [])]

    assert ran("p77s") == (200, ["S1", "S0"])
    assert ran("p77s", f"limit=1&before_id={ids['S1']}") == (200, ["S0"])
    assert ran("women") == (200, ["S2", "S0"])
    assert ran("p77s", token=d.token)[0] == 403 and ran("women", token=d.token)[0] == 403
    status, doc = call(d, "GET", "/searches/pending/messages", d.token)
    assert status == 200 and all(m["lane_key"].startswith("lane:") for m in doc["messages"])

    for path, code in (
        ("/searches/nope", 404),
        ("/searches/nope/messages", 404),
        ("/searches/bad%20name", 400),
        ("/searches/p77s/messages?key=mrn=Q1", 400),  # a run takes the window and the page only
        ("/searches/p77s?limit=1", 400),
        ("/searches?limit=0", 400),
        ("/searches?after=a%2Fb", 400),
        ("/searches/p77s/other", 404),
    ):
        assert call(d, "GET", path, OPERATOR_TOKEN)[0] == code, path
    assert call(d, "GET", "/searches", "not-a-token-at-all")[0] == 401
    assert call(d, "POST", "/searches/p77s", OPERATOR_TOKEN, {})[0] == 405
    log = d.output()
    assert "P77" not in log and "p77s" not in log and "/searches/{name}/messages" in log and "key=..." in log


def test_a_request_line_past_the_limit_is_answered_414_json_not_closed_in_silence(node):
    d, _ = node
    status, doc = call(d, "GET", "/messages?where=" + quote('PID-5 = "' + "A" * 7000 + '"'), OPERATOR_TOKEN)
    assert status == 200 and doc == {"messages": []}  # 7k: read and searched
    status, doc = call(d, "GET", "/messages?where=" + quote('PID-5 = "' + "P77" * 7000 + '"'), OPERATOR_TOKEN)
    assert status == 414 and doc == {"error": "the request line (method, path and query) is longer than 16384 bytes"}
    with socket.create_connection(("127.0.0.1", d.api_port), timeout=10) as sock:  # line + headers past the total
        sock.sendall(b"GET /messages?contains=" + b"P" * 15000 + b" HTTP/1.1\r\nX-Pad: " + b"x" * 2000 + b"\r\n\r\n")
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 400 ") and b'"error": "malformed request line or headers, or more' in answer
    assert call(d, "GET", "/messages?status=pending", OPERATOR_TOKEN)[0] == 200  # the daemon serves on
