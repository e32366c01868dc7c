"""A charset a client names picks a decoder only from HL7 table 0211 (docs/listenerd.md, "HTTP inbound").

Issue 23's first row: one `POST /messages/<conn>` declaring ``charset=punycode`` with a 1.6 MB body
kept the reactor decoding for 22 s (``/health`` blocked, every listener frozen); ``base64``, ``zlib``
and ``rot13`` gave an HTML 500 with a traceback. Against a real `listenerd` (SQLite store): such a
POST is a 400 JSON naming the accepted charsets, counted as AR, while `/health` keeps answering
within 1 s and an MLLP sender keeps getting AA.
"""

from __future__ import annotations

import codecs
import http.client
import json
import time
from collections.abc import Iterator

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.charsets import ALLOWED_CODECS
from tests.conftest import migrated_sqlite
from tests.support import hostile
from tests.support.watch import Watch

PUNYCODE_BODY = b"a-" + b"b" * 1_600_000  # 1.6 MB; punycode decodes it in quadratic time (200 kB: 1.3 s)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict[str, int]]]:
    tmp = tmp_path_factory.mktemp("charsets")
    config = migrated_sqlite(tmp / "stageline.db")
    ports = {"mllp": free_port(), "http": free_port()}
    d = Daemon(
        tmp / "node",
        config,
        node_id="solo:1:cs",
        inbound=[
            {"name": "plain", "kind": "mllp", "port": ports["mllp"]},
            {"name": "web", "kind": "http", "port": ports["http"]},
        ],
    ).start()
    try:
        for port in ports.values():
            wait_for(lambda: port_open(port), timeout=15, what="bind")
        yield d, ports
    finally:
        d.stop()


def post(port: int, body: bytes, charset: str) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/messages/web", body=body, headers={"Content-Type": f"text/plain; charset={charset}"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type") or "", resp.read()
    finally:
        conn.close()


def test_punycode_post_is_400_while_health_and_an_mllp_sender_are_served(node) -> None:
    d, ports = node
    health = Watch(d.proc.pid, d.api_port, interval=0.02)
    health.start()
    try:
        answers = []
        for _ in range(3):
            answers.append(post(ports["http"], PUNYCODE_BODY, "punycode"))
        honest = hostile.send_honest(hostile.mllp_once("127.0.0.1", ports["mllp"]), 10, interval=0.05, prefix="CSP")
    finally:
        health.stop()
    for status, ctype, body in answers:
        assert status == 400 and ctype == "application/json", (status, body[:200])
        answer = json.loads(body)
        assert answer["error"].startswith("unknown charset 'punycode'")
        assert "8859/1" in answer["accepted"]
    assert honest.accepted == 10, honest.summary()
    assert health.latencies and health.unhealthy == 0 and health.worst <= 1.0, (
        f"/health took up to {health.worst:.2f} s ({health.unhealthy} answers not 200)"
    )


@pytest.mark.parametrize("charset", ["base64", "zlib", "rot13", "idna", "klingon", "hex_codec", "uu"])
def test_non_text_codecs_are_a_400_json_never_a_500(node, charset: str) -> None:
    d, ports = node
    body = codecs.encode(b"MSH|^~\\&|A|B", "base64") if charset == "base64" else b"MSH|^~\\&|A|B|C"
    status, ctype, raw = post(ports["http"], body, charset)
    assert status == 400 and ctype == "application/json", (status, raw[:200])
    assert json.loads(raw)["error"].startswith("unknown charset")
    assert "Traceback" not in d.output()


def test_refused_charsets_are_counted_as_ar(node) -> None:
    d, ports = node
    post(ports["http"], b"hello", "rot13")
    _, metrics = d.get("/metrics")
    line = next(
        line
        for line in metrics.decode().splitlines()
        if line.startswith(
            ('stageline_acks_total{code="AR",connection="web"}', 'stageline_acks_total{connection="web",code="AR"}')
        )
    )
    assert float(line.split()[-1]) >= 1


def test_every_allowed_codec_decodes_4_mib_in_well_under_100_ms() -> None:
    """Decoding is linear: each allowed codec (C decoders) takes a 4 MiB body in far less than the
    100 ms a reactor turn may take. Figures printed for docs/listenerd.md."""
    sample = "MSH|^~\\&|SEND|FAC|RECV|RFAC|20240101||ADT^A01|C1|P|2.5\rPID|1||123||MÜLLER^ZOË^東京^Жанна\r"
    figures = {}
    for codec in sorted(ALLOWED_CODECS):
        data = (sample * (4 * 1024 * 1024 // len(sample) + 1)).encode(codec, errors="replace")[: 4 * 1024 * 1024]
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            data.decode(codec, errors="replace")
            best = min(best, time.perf_counter() - started)
        figures[codec] = best
    print("\n" + ", ".join(f"{c} {s * 1000:.1f} ms" for c, s in figures.items()))
    assert max(figures.values()) < 0.1, figures


def test_a_large_http_batch_is_validated_off_the_reactor(node) -> None:
    """A 20,000-message HL7 batch (about 1 MB) POSTed at once: split and checked on a thread, so
    `/health` keeps answering within 1 s meanwhile; the batch is staged (202)."""
    d, ports = node
    messages = b"".join(hostile.adt(f"BIG{i:05d}") for i in range(20_000))
    batch = b"BHS|^~\\&|SEND|FAC|RECV|RFAC|20240101||||BIGBATCH\r" + messages + b"BTS|20000\r"
    health = Watch(d.proc.pid, d.api_port, interval=0.02)
    health.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", ports["http"], timeout=60)
        conn.request("POST", "/messages/web", body=batch, headers={"Content-Type": "application/hl7-v2"})
        resp = conn.getresponse()
        status, body = resp.status, resp.read()
        conn.close()
    finally:
        health.stop()
    assert status == 202, body[:300]
    assert len(json.loads(body)["message_ids"]) == 20_000
    assert health.latencies and health.unhealthy == 0 and health.worst <= 1.0, (
        f"/health took up to {health.worst:.2f} s ({health.unhealthy} answers not 200)"
    )
