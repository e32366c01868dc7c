"""The operator's operations on listenerd's API, against a running daemon and a real store:
GET /messages (find), /messages/{ref} (show, without bodies), /messages/dead, /stages for any role
with a token; a message's bodies (`?body=1`) for operators only, each read an audit event; POST
/messages/{ref}/replay and /messages/requeue for operators only, recorded in the audit trail with
the token's entry (never the token); bad input 400, unknown messages 404; the daemon's log holds
no control id a request named."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hl7.client import MLLPClient

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.store import Store
from include.store.lease import read_lease
from tests.support import pump
from tests.support.hostile import adt

OPERATOR_TOKEN = "test-operator-token"


def call(d: Daemon, method: str, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{d.api_port}{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@contextmanager
def running(tmp_path, store_config, monkeypatch) -> Iterator[tuple[Daemon, int]]:
    """A listenerd with a viewer and an operator token and one MLLP inbound, `adt-in` (lane PID-3.1),
    bound; the daemon and the inbound's port."""
    port = free_port()
    conf = tmp_path / "config"
    conf.mkdir()
    (conf / "connections.toml").write_text(
        '[api]\nhost = "127.0.0.1"\n\n'
        '[[api.tokens]]\nname = "viewer"\nrole = "VIEWER"\ntoken_env = "STAGELINE_TEST_TOKEN"\n\n'
        '[[api.tokens]]\nname = "ops-desk"\nrole = "OPERATOR"\ntoken_env = "STAGELINE_OPERATOR_TOKEN"\n\n'
        f'[[inbound]]\nname = "adt-in"\nkind = "mllp"\nport = {port}\nlane_key = "PID-3.1"\n'
    )
    monkeypatch.setenv("STAGELINE_OPERATOR_TOKEN", OPERATOR_TOKEN)
    d = Daemon(tmp_path / "node", store_config, node_id="solo:1:aa", config_dir=conf).start()
    try:
        wait_for(lambda: port_open(port), timeout=20, what="bind")
        yield d, port
    finally:
        d.stop()


@pytest.fixture
def node(tmp_path, store_config, monkeypatch):
    with running(tmp_path, store_config, monkeypatch) as (d, port):
        with MLLPClient("127.0.0.1", port) as client:
            for n in range(3):
                client.send_message(adt(f"API{n}", patient=f"P{n}").decode())
        yield d, store_config


def test_find_show_replay_and_requeue_over_the_api(node):
    d, store_config = node
    status, doc = call(d, "GET", "/messages?control_id=API1", d.token)
    assert status == 200 and [m["control_id"] for m in doc["messages"]] == ["API1"]
    for search in ("/messages?control_id=API1&P77=1", "/messages?control_id=API1&control_id=API2"):
        status, doc = call(d, "GET", search, d.token)  # not "the newest messages": a search it does not do
        assert status == 400 and "P77" not in doc["error"] and "API2" not in doc["error"], doc
    status, story = call(d, "GET", "/messages/API1", d.token)  # a viewer: metadata, no body
    assert status == 200 and "payload" not in story["inbound"] and story["trail"][0]["event"] == "received"
    assert call(d, "GET", "/messages/API1?body=1", d.token)[0] == 403
    status, story = call(d, "GET", "/messages/API1?body=1", OPERATOR_TOKEN)
    assert status == 200 and story["inbound"]["payload"].startswith("MSH|")
    assert call(d, "GET", "/messages/NOPE", d.token)[0] == 404
    status, stages = call(d, "GET", "/stages", d.token)
    assert status == 200 and stages["inbound"]["backlog"] == 3

    # a viewer may not replay; an operator may, with a reason
    assert call(d, "POST", "/messages/API1/replay", d.token, {"from": "inbound", "reason": "x"})[0] == 403
    assert call(d, "POST", "/messages/API1/replay", OPERATOR_TOKEN, {"from": "inbound"})[0] == 400
    assert call(d, "POST", "/messages/API1/replay", OPERATOR_TOKEN, {"from": "routed", "reason": "x"})[0] == 400
    status, doc = call(d, "POST", "/messages/API1/replay", OPERATOR_TOKEN, {"from": "inbound", "reason": "EHR lost it"})
    assert status == 200 and len(doc["replayed"]) == 1

    store = Store(store_config)
    try:
        with store.transaction() as tx:  # a dead letter to requeue (what a failing route leaves)
            tx.conn.cursor().execute(
                "UPDATE stage_inbound SET status = 'dead', last_error = 'boom' WHERE control_id = 'API2'"
            )
        status, dead = call(d, "GET", "/messages/dead", d.token)
        assert status == 200 and [(g["stage"], g["n"]) for g in dead["dead_letters"]] == [("inbound", 1)]
        assert (
            call(d, "POST", "/messages/requeue", d.token, {"stage": "inbound", "lane": "P2", "reason": "x"})[0] == 403
        )
        status, doc = call(
            d, "POST", "/messages/requeue", OPERATOR_TOKEN, {"stage": "inbound", "lane": "P2", "reason": "route fixed"}
        )
        assert status == 200 and len(doc["requeued"]) == 1
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute("SELECT event, node_id, detail FROM message_events WHERE node_id LIKE 'operator:%' ORDER BY id")
            events = [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in cur.fetchall()]
            cur.execute("SELECT control_id, node_id, detail FROM message_events WHERE event = 'body_read' ORDER BY id")
            reads = [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in cur.fetchall()]
    finally:
        store.close()
    assert [e[0] for e in events] == ["replayed", "staged", "requeued"]
    assert all("ops-desk" in e[1] for e in events) and OPERATOR_TOKEN not in repr(events)
    assert events[2][2] == "route fixed"
    assert reads == [("API1", "reader:api [[api.tokens]] #2 ('ops-desk')", "bodies read via api")]
    assert OPERATOR_TOKEN not in d.output() and "DOE^JANE" not in d.output()  # no token, no PHI in the log
    assert "API1" not in d.output() and "control_id=..." in d.output()  # the access log names no message


def test_an_archived_and_purged_message_is_still_shown_over_the_api(node):
    from include.housekeeping import retention
    from include.store.lease import read_lease
    from tests.dags.stores import age, execute

    d, store_config = node
    store = Store(store_config)
    try:
        execute(store, "UPDATE stage_inbound SET status = 'done' WHERE control_id = 'API0'")
        age(store, "stage_inbound", "updated_at", "control_id = 'API0'", 2 * 86_400)
        age(store, "message_events", "at", "control_id = 'API0'", 2 * 86_400)
        assert retention(store, read_lease(store).epoch, 86_400.0) == {
            "inbound": 1,
            "inbound_batches": 0,
            "routed": 0,
            "outbound": 0,
            "events": 1,
        }
    finally:
        store.close()
    status, story = call(d, "GET", "/messages/API0?body=1", OPERATOR_TOKEN)
    assert status == 200 and story["inbound"]["archived_ms"] is not None
    assert story["inbound"]["control_id"] == "API0" and story["inbound"]["payload"].startswith("MSH|")
    assert [(e["event"], e["archived_ms"] is not None) for e in story["trail"]] == [("received", True)]
    status, story = call(d, "GET", "/messages/API0", d.token)  # the read above is on the record
    assert [(e["event"], e["archived_ms"] is not None) for e in story["trail"]] == [
        ("received", True),
        ("body_read", False),
    ]


def test_stages_by_destination_and_connection_over_the_api(node):
    """`GET /stages?by=…`: each destination's and connection's health, the chart on request; a
    grouping that is not one is a 400."""
    d, store_config = node
    store = Store(store_config)
    try:
        epoch = read_lease(store).epoch  # the daemon's: the pump moves rows as its stage jobs would
        assert pump.route(store, epoch=epoch, destinations=lambda row: ["ehr"]) == 3
        assert len(pump.deliver(store, epoch=epoch, send=lambda row: True).done) == 3
    finally:
        store.close()
    status, doc = call(d, "GET", "/stages?by=destination&chart=1", d.token)
    assert status == 200 and [r["destination"] for r in doc["rows"]] == ["ehr"]
    [ehr] = doc["rows"]
    assert (ehr["windows"]["5m"]["received"], ehr["windows"]["5m"]["sent"], ehr["queued"]) == (3, 3, 0)
    assert len(ehr["per_minute"]) == 60 and sum(m["sent"] for m in ehr["per_minute"]) == 3
    status, doc = call(d, "GET", "/stages?by=connection", d.token)
    assert status == 200 and [(r["connection"], r["windows"]["1h"]["sent"]) for r in doc["rows"]] == [("adt-in", 3)]
    assert "per_minute" not in doc["rows"][0]
    for bad in (
        "/stages?by=lane",
        "/stages?by=destination&chart=yes",
        "/stages?by=destination&by=connection",  # twice: which one was meant?
        "/stages?by=destination&by=",
        "/stages?by=destination&chart=1&chart=1",
        "/stages?by",
        "/stages?chart=1",
        "/stages?by=destination&foo=1",
        "/stages?by=%ff",
    ):
        status, doc = call(d, "GET", bad, d.token)
        assert status == 400, (bad, status, doc)
        assert doc["error"] == "give by= one of destination, connection once, and at most chart=0 or 1; nothing else"
