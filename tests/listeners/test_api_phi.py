"""PHI on the control-plane API (issue 23): bodies are their own permission, every body read is an
audit event, the access log carries no identifier, a request's body is judged from its headers
before any of it is read, and no query figure can ask the store for more than a page.

The real Site (`make_api`) on an ephemeral loopback port, over a real migrated SQLite store with
staged messages; the early-refusal cases talk to it over a plain socket from a thread, so the
reactor serves while the client waits.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import tempfile
import time
from dataclasses import replace
from typing import Any

from twisted.internet import defer, reactor, task, threads
from twisted.logger import LogEvent, formatEvent, globalLogPublisher
from twisted.trial import unittest

from include.config import StoreConfig
from include.store import Store, rowlease
from include.store.lease import acquire_permanent
from include.store.migrate import migrate
from include.store.operator import MAX_FIND_LIMIT
from listeners.api import MAX_BODY_BYTES, ApiAuth, make_api
from tests.conftest import CLUSTER
from tests.listeners.test_api import ENV, OPERATOR_TOKEN, TOKENS_CONFIG, VIEWER_TOKEN, agent, fetch, node_state, serve

ADMIN_TOKEN = "admin-token-0123456789abcdef"
MRN = "MRN-0042-7731"
BODY = f"MSH|^~\\&|ADT1|HOSP|EHR|CITY|20240101120000||ADT^A01|{MRN}|P|2.5\rPID|1||P77^^^HOSP^MR||DOE^JANE\r"
PHI = ("DOE^JANE", "P77^^^HOSP^MR")


class PhiOverTheApi(unittest.TestCase):
    def setUp(self) -> None:
        where = tempfile.mkdtemp(prefix="stageline-phi-")
        self.addCleanup(shutil.rmtree, where, True)
        config = StoreConfig(backend="sqlite", path=f"{where}/stageline.db")
        self.store = Store(config)
        self.addCleanup(self.store.close)
        migrate(self.store, cluster_name=CLUSTER)
        epoch = acquire_permanent(self.store, node_id="solo:1:aa")
        with self.store.transaction() as tx:
            staged = rowlease.stage_inbound(
                tx,
                [
                    {
                        "message_id": "adt-1",
                        "control_id": MRN,
                        "connection": "adt-in",
                        "lane_key": "P77",
                        "charset": None,
                        "payload": BODY,
                    }
                ],
                epoch=epoch,
                node_id="solo:1:aa",
            )
        assert staged is not None
        self.row_id = staged["adt-1"]
        state = replace(node_state(), store=lambda: self.store)
        self.port = serve(self, make_api(state, ApiAuth.from_config(TOKENS_CONFIG, ENV)))
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = agent(self)

    async def get(self, path: str, token: str | None) -> tuple[int, Any]:
        response, body = await fetch(self.client, self.base + path, token=token)
        return response.code, json.loads(body)

    def events(self) -> list[dict[str, Any]]:
        with self.store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(
                "SELECT at, stage, row_id, message_id, control_id, event, to_status, node_id, detail "
                "FROM message_events WHERE event = 'body_read' ORDER BY id"
            )
            return [dict(row) for row in cur.fetchall()]

    def db_now_ms(self) -> int:
        with self.store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute("SELECT CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) AS now")
            return int(cur.fetchone()["now"])

    # --- 1. PHI is a permission -------------------------------------------------------------------

    @defer.inlineCallbacks
    def test_a_viewer_reads_metadata_but_never_a_body(self):
        for path in ("/messages/adt-1", f"/messages/{MRN}", f"/messages/{self.row_id}"):
            code, story = yield defer.ensureDeferred(self.get(path, VIEWER_TOKEN))
            self.assertEqual(code, 200, path)
            self.assertEqual(
                (story["inbound"]["id"], story["inbound"]["control_id"], story["inbound"]["status"]),
                (self.row_id, MRN, "pending"),
            )
            self.assertNotIn("payload", story["inbound"])
            for text in PHI:
                self.assertNotIn(text, json.dumps(story))
        code, found = yield defer.ensureDeferred(self.get(f"/messages?control_id={MRN}", VIEWER_TOKEN))
        self.assertEqual((code, [m["id"] for m in found["messages"]]), (200, [self.row_id]))
        for asked in ("1", "true"):
            code, doc = yield defer.ensureDeferred(self.get(f"/messages/adt-1?body={asked}", VIEWER_TOKEN))
            self.assertEqual((code, doc), (403, {"error": "bodies need messages:read_body"}))
        self.assertEqual(self.events(), [])  # nothing read, nothing recorded

    @defer.inlineCallbacks
    def test_an_operator_and_an_admin_read_bodies_only_when_they_ask(self):
        code, story = yield defer.ensureDeferred(self.get("/messages/adt-1", OPERATOR_TOKEN))
        self.assertEqual(code, 200)
        self.assertNotIn("payload", story["inbound"])  # not asked: metadata, no audit event
        self.assertEqual(self.events(), [])
        for token in (OPERATOR_TOKEN, ADMIN_TOKEN):
            code, story = yield defer.ensureDeferred(self.get("/messages/adt-1?body=1", token))
            self.assertEqual((code, story["inbound"]["payload"]), (200, BODY))
        code, doc = yield defer.ensureDeferred(self.get("/messages/adt-1?body=maybe", OPERATOR_TOKEN))
        self.assertEqual((code, doc), (400, {"error": "body must be 1 or 0, got 'maybe'"}))

    @defer.inlineCallbacks
    def test_a_viewer_sees_lane_keys_masked_stable_per_lane_and_cannot_filter_by_one(self):
        # red team (issue 23, item 19): viewer metadata carried lane_key, usually PID-3 (the MRN)
        epoch = acquire_permanent(self.store, node_id="solo:1:aa")
        with self.store.transaction() as tx:
            rowlease.stage_inbound(
                tx,
                [
                    {
                        "message_id": f"adt-{n}",
                        "control_id": f"C{n}",
                        "connection": "adt-in",
                        "lane_key": lane,
                        "charset": None,
                        "payload": BODY,
                    }
                    for n, lane in ((2, "P77"), (3, "P88"))
                ],
                epoch=epoch,
                node_id="solo:1:aa",
            )
        code, found = yield defer.ensureDeferred(self.get("/messages", VIEWER_TOKEN))
        self.assertEqual(code, 200)
        lanes = {m["message_id"]: m["lane_key"] for m in found["messages"]}
        self.assertEqual(set(lanes), {"adt-1", "adt-2", "adt-3"})
        self.assertTrue(all(re.fullmatch(r"lane:[0-9a-f]{12}", v) for v in lanes.values()), lanes)
        self.assertEqual(lanes["adt-1"], lanes["adt-2"])  # one lane: one mask, so grouping still works
        self.assertNotEqual(lanes["adt-1"], lanes["adt-3"])
        self.assertNotIn("P77", json.dumps(found))
        code, story = yield defer.ensureDeferred(self.get("/messages/adt-1", VIEWER_TOKEN))
        self.assertEqual(
            (code, story["inbound"]["lane_key"], story["inbound"]["control_id"]), (200, lanes["adt-1"], MRN)
        )  # the control id (a message's id) stays
        self.assertNotIn('"P77"', json.dumps(story))
        self.assertNotEqual(lanes["adt-1"], "lane:" + hashlib.sha256(b"P77").hexdigest()[:12])  # keyed
        code, doc = yield defer.ensureDeferred(self.get("/messages?lane_key=P77", VIEWER_TOKEN))
        self.assertEqual((code, doc), (403, {"error": "lane filters need messages:read_body"}))
        for token in (OPERATOR_TOKEN, ADMIN_TOKEN):  # who may read bodies sees the lane as it is
            code, found = yield defer.ensureDeferred(self.get("/messages?lane_key=P77", token))
            self.assertEqual((code, sorted(m["message_id"] for m in found["messages"])), (200, ["adt-1", "adt-2"]))
            self.assertEqual({m["lane_key"] for m in found["messages"]}, {"P77"})
            code, story = yield defer.ensureDeferred(self.get("/messages/adt-1", token))
            self.assertEqual((code, story["inbound"]["lane_key"]), (200, "P77"))

    # --- 2. every body read is audited ------------------------------------------------------------

    @defer.inlineCallbacks
    def test_each_body_read_is_an_audit_event_naming_the_token_entry_on_the_db_clock(self):
        before = self.db_now_ms()
        yield defer.ensureDeferred(self.get("/messages/adt-1?body=1", OPERATOR_TOKEN))
        yield defer.ensureDeferred(self.get(f"/messages/{MRN}?body=1", ADMIN_TOKEN))
        yield defer.ensureDeferred(self.get("/messages/adt-1", VIEWER_TOKEN))  # metadata: not an event
        after = self.db_now_ms()
        events = self.events()
        self.assertEqual(
            [
                (
                    e["stage"],
                    e["row_id"],
                    e["message_id"],
                    e["control_id"],
                    e["event"],
                    e["to_status"],
                    e["node_id"],
                    e["detail"],
                )
                for e in events
            ],
            [
                (
                    "inbound",
                    self.row_id,
                    "adt-1",
                    MRN,
                    "body_read",
                    "pending",
                    "reader:api [[api.tokens]] #2",
                    "bodies read via api",
                ),
                (
                    "inbound",
                    self.row_id,
                    "adt-1",
                    MRN,
                    "body_read",
                    "pending",
                    "reader:api [[api.tokens]] #3",
                    "bodies read via api",
                ),
            ],
        )
        self.assertTrue(all(before <= e["at"] <= after for e in events), (before, events, after))
        for token in (OPERATOR_TOKEN, ADMIN_TOKEN):
            self.assertNotIn(token, repr(events))
        # the reads are in the message's own trail too, for whoever looks at it next
        _code, story = yield defer.ensureDeferred(self.get("/messages/adt-1", VIEWER_TOKEN))
        self.assertEqual([t["event"] for t in story["trail"]], ["received", "body_read", "body_read"])

    # --- 3. access logs redact query strings ------------------------------------------------------

    @defer.inlineCallbacks
    def test_the_access_log_and_our_log_lines_carry_no_identifier(self):
        events: list[LogEvent] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        yield defer.ensureDeferred(self.get(f"/messages?control_id={MRN}&limit=5&{MRN}=x", VIEWER_TOKEN))
        yield defer.ensureDeferred(self.get(f"/messages/{MRN}", VIEWER_TOKEN))
        yield defer.ensureDeferred(self.get(f"/messages/{MRN}?body=1", VIEWER_TOKEN))  # 403, logged
        yield defer.ensureDeferred(self.get(f"/messages/{MRN}", "not-a-token-0123456789"))  # 401, logged
        yield defer.ensureDeferred(self.get(f"/messages/{MRN}?body=1", OPERATOR_TOKEN))
        logged = "\n".join(formatEvent(e) + repr(e) for e in events)
        self.assertIn('"GET /messages?control_id=...&limit=...&... HTTP/1.1" 400', logged)  # the access log is on
        self.assertIn('"GET /messages/{ref} HTTP/1.1" 200', logged)
        self.assertIn('"GET /messages/{ref}?body=... HTTP/1.1" 403', logged)
        self.assertIn("unknown token", logged)
        for text in (MRN, "adt-1", *PHI):
            self.assertNotIn(text, logged)

    @defer.inlineCallbacks
    def test_unknown_paths_are_logged_as_unknown_and_early_refusals_get_an_access_line(self):
        """Issue 23, red team network items 5 and 8: a path no route matches is `/<unknown>` in the
        access log and in the before-body refusal line; a request refused from its headers (401,
        403, 413) still gets its one access line."""
        events: list[LogEvent] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        for path in ("/zz/MRN-4444", "/messages//MRN-5555", "/messages/C1/extra/MRN-7777"):
            yield defer.ensureDeferred(self.get(path, VIEWER_TOKEN))
        head = b"POST /anything/MRN-12121 HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        answer, _, _ = yield threads.deferToThread(self.raw, head)
        self.assertTrue(answer.startswith(b"HTTP/1.1 401"), answer)
        answer, _, _ = yield threads.deferToThread(self.raw, self.post_head(100_000_000, OPERATOR_TOKEN))
        self.assertTrue(answer.startswith(b"HTTP/1.1 413"), answer)
        yield task.deferLater(reactor, 0.1, lambda: None)
        logged = "\n".join(formatEvent(e) + repr(e) for e in events)
        self.assertNotIn("MRN-", logged)
        self.assertGreaterEqual(logged.count('"GET /<unknown> HTTP/1.1" 404'), 2, logged)
        self.assertIn("401 for /<unknown> from", logged)
        self.assertIn('"POST /<unknown> HTTP/1.1" 401', logged)
        self.assertIn('"POST /messages/requeue HTTP/1.1" 413', logged)

    # --- 4. the token and the size are checked before the body is read ----------------------------

    def raw(self, head: bytes, body_chunk: bytes = b"", *, keep_sending: int = 0) -> tuple[bytes, float, int]:
        """Send `head` (then `body_chunk` `keep_sending` times while the server lets us); return the
        answer, how long it took after the head, and how many body bytes went out before it came."""
        sent = 0
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(head)
            started = time.monotonic()
            sock.settimeout(2)
            answer = sock.recv(65536)
            took = time.monotonic() - started
            try:
                for _ in range(keep_sending):
                    sock.sendall(body_chunk)
                    sent += len(body_chunk)
            except OSError:
                pass
            sock.settimeout(5)
            while True:  # the server closes: the rest of the body is never read
                more = sock.recv(65536)
                if not more:
                    break
                answer += more
        return answer, took, sent

    def post_head(self, length: int | None, token: str | None) -> bytes:
        head = b"POST /messages/requeue HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        if token:
            head += b"Authorization: Bearer %s\r\n" % token.encode()
        head += b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
        return head + b"\r\n"

    @defer.inlineCallbacks
    def test_an_unauthenticated_100_mb_post_is_refused_at_once_unread(self):
        answer, took, _ = yield threads.deferToThread(self.raw, self.post_head(100_000_000, None))
        self.assertTrue(answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n"), answer)
        self.assertIn(b'WWW-Authenticate: Bearer realm="stageline"', answer)
        self.assertIn(b"Connection: close", answer)
        self.assertLess(took, 1.0)  # answered from the headers: not one body byte was sent

    @defer.inlineCallbacks
    def test_a_post_is_refused_by_role_and_by_size_before_its_body(self):
        for token, length, status in (
            (VIEWER_TOKEN, 100, b"403 Forbidden"),
            ("not-a-token-0123456789", 100, b"401 Unauthorized"),
            (OPERATOR_TOKEN, 100_000_000, b"413 Payload Too Large"),
            (OPERATOR_TOKEN, MAX_BODY_BYTES + 1, b"413 Payload Too Large"),
        ):
            answer, took, _ = yield threads.deferToThread(self.raw, self.post_head(length, token))
            self.assertTrue(answer.startswith(b"HTTP/1.1 " + status), (token, length, answer))
            self.assertLess(took, 1.0)

    @defer.inlineCallbacks
    def test_a_chunked_body_past_the_cap_is_cut_off(self):
        chunk = b"%x\r\n%s\r\n" % (16 * 1024, b"x" * 16 * 1024)
        answer, _, sent = yield threads.deferToThread(
            self.raw, self.post_head(None, OPERATOR_TOKEN) + chunk * 5, chunk, keep_sending=400
        )
        self.assertTrue(answer.startswith(b"HTTP/1.1 413 Payload Too Large"), answer)
        self.assertLess(sent, 400 * len(chunk))  # the server closed: the rest was never taken

    @defer.inlineCallbacks
    def test_an_operator_post_within_the_cap_still_works(self):
        body = json.dumps({"stage": "inbound", "ids": [self.row_id], "reason": "check"}).encode()
        head = self.post_head(len(body), OPERATOR_TOKEN)
        answer, _, _ = yield threads.deferToThread(self.raw, head.replace(b"HTTP/1.1", b"HTTP/1.0") + body)
        self.assertTrue(answer.startswith(b"HTTP/1.0 200"), answer)
        self.assertTrue(answer.endswith(b'{"requeued": []}'), answer)  # pending, not dead: left alone

    # --- 5. no figure asks for more than a page ----------------------------------------------------

    @defer.inlineCallbacks
    def test_limit_and_every_figure_out_of_range_are_400_naming_the_range(self):
        cases = {
            "limit=100000000": f"limit must be 1..{MAX_FIND_LIMIT} (page on with before_id), got 100000000",
            "limit=0": f"limit must be 1..{MAX_FIND_LIMIT} (page on with before_id), got 0",
            "limit=ten": "not a number: invalid literal for int() with base 10: 'ten'",
            "since_ms=-1": "since_ms must be 0..253402300799999 (epoch milliseconds), got -1",
            "until_ms=99999999999999999999": "until_ms must be 0..253402300799999 (epoch milliseconds), "
            "got 99999999999999999999",
            "before_id=0": "before_id must be 1..9223372036854775807, got 0",
            "before_id=9223372036854775808": "before_id must be 1..9223372036854775807, got 9223372036854775808",
        }
        for query, error in cases.items():
            code, doc = yield defer.ensureDeferred(self.get(f"/messages?{query}", VIEWER_TOKEN))
            self.assertEqual((code, doc), (400, {"error": error}), query)
        code, doc = yield defer.ensureDeferred(self.get(f"/messages?limit={MAX_FIND_LIMIT}", VIEWER_TOKEN))
        self.assertEqual((code, len(doc["messages"])), (200, 1))


# --- 6. an unknown ref reads no table from end to end -------------------------------------------------


def test_resolving_an_unknown_ref_uses_only_index_probes(sqlite_config_fresh, monkeypatch):
    """`resolve` (GET /messages/{ref}, `stageline messages show`, the view) asks the store only
    statements whose plans tests/store/test_statement_plans.py holds to the rows they touch: never
    the ad-hoc search (`messages_find`, allowed to scan), which an unknown ref would read to the end."""
    import pytest

    from include.store import db, operator
    from tests.store.test_statement_plans import ALLOWED_SCANS

    asked: list[str] = []
    for method in ("one", "all"):
        real = getattr(db.Tx, method)

        def spy(self, name, *args, _real=real, **kwargs):
            asked.append(name)
            return _real(self, name, *args, **kwargs)

        monkeypatch.setattr(db.Tx, method, spy)
    store = Store(sqlite_config_fresh)
    try:
        with pytest.raises(LookupError):
            operator.resolve(store, "MRN-NOT-THERE")
        with pytest.raises(LookupError):
            operator.resolve(store, "12345")
    finally:
        store.close()
    assert asked and not set(asked) & set(ALLOWED_SCANS), asked
