"""The HTTP inbound's access log carries no query strings, no made-up paths and no bodies (docs/listenerd.md).

Issue 23: access logs recorded query strings such as ``control_id=MRN-…``. Against a real
`listenerd`: requests whose query strings, paths and bodies carry markers leave none of them in its
log; each request is still logged (method, the connection's path, ``?<redacted>``, status).
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from tests.conftest import migrated_sqlite
from tests.support import hostile


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    tmp = tmp_path_factory.mktemp("accesslog")
    config = migrated_sqlite(tmp / "stageline.db")
    port = free_port()
    d = Daemon(
        tmp / "node", config, node_id="solo:1:al", inbound=[{"name": "web", "kind": "http", "port": port}]
    ).start()
    try:
        wait_for(lambda: port_open(port), timeout=15, what="bind")
        yield d, port
    finally:
        d.stop()


def request(port: int, method: str, path: str, body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/hl7-v2"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_query_strings_paths_and_bodies_stay_out_of_the_log(node) -> None:
    d, port = node
    body = hostile.adt("CTRL-SECRET-1", patient="PATIENT-SECRET-1")
    assert request(port, "POST", "/messages/web?control_id=MRN-SECRET-1&x=1", body) == 202
    assert request(port, "GET", "/messages/web?mrn=MRN-SECRET-2") == 405
    assert request(port, "POST", "/messages/MRN-SECRET-3?q=MRN-SECRET-4", body) == 404
    assert request(port, "POST", "/messages/web?charset=x", b"\xff\xfeMRN-SECRET-5") == 400
    deadline = time.monotonic() + 5
    while d.output().count("?<redacted>") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = d.output()
    assert "SECRET" not in log, [line for line in log.splitlines() if "SECRET" in line]
    assert '"POST /messages/web?<redacted> HTTP/1.1" 202' in log
    assert '"GET /messages/web?<redacted> HTTP/1.1" 405' in log
    assert '"POST /<unknown>?<redacted> HTTP/1.1" 404' in log


def test_a_post_refused_from_its_headers_gets_its_access_line(node) -> None:
    """A 413 answered from the Content-Length alone (the body never read) is still logged once,
    redacted like any request (issue 23, red team network item 8)."""
    import socket

    d, port = node
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"POST /messages/web?mrn=MRN-SECRET-9 HTTP/1.1\r\nHost: x\r\nContent-Type: application/hl7-v2\r\n"
            b"Content-Length: 100000000\r\n\r\n"
        )
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    deadline = time.monotonic() + 5
    while '" 413 ' not in d.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = d.output()
    assert '"POST /messages/web?<redacted> HTTP/1.1" 413' in log
    assert "SECRET-9" not in log
