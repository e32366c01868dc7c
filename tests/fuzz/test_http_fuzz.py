"""HTTP inbound fuzzed (listeners/http_listener.py, the real Site over a StringTransport) and the
charset allowlist (`include.charsets.codec_for`) it decides with. Any request — method, path,
Content-Type (charset included), body, cut anywhere — gets a JSON answer with a 2xx/4xx status,
never a 500 or a traceback; any name gives an allowed codec or None; and a 1.6 MB punycode body
(issue 23: 22 s on the reactor) is refused in milliseconds."""

from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from include.charsets import ALLOWED_CODECS, codec_for
from listeners.connections_config import InboundConfig
from listeners.http_listener import _content_type, make_inbound_site
from tests.fuzz.budget import FEW, FUZZ, WORST_BYTES, linear, seconds
from tests.fuzz.test_hl7_fuzz import CHARSETS, message_bytes

PEER = IPv4Address("TCP", "127.0.0.1", 50000)
HOST = IPv4Address("TCP", "127.0.0.1", 8080)
LIMIT = 4096
VALID = b"MSH|^~\\&|A|B|C|D|20260101||ADT^A01|C1|P|2.5\rPID|1||123||DOE^JANE\r"
ANSWERS = {202, 400, 404, 405, 411, 413, 415}


class Committing:
    """An ingest that commits everything at once."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def submit(self, item: Any) -> Deferred[str]:
        self.items.append(item)
        return succeed(getattr(item, "message_id", None) or getattr(item, "batch_id", "b"))


def site(ingest: Committing) -> Any:
    conn = InboundConfig(name="web", kind="http", max_message_bytes=LIMIT)
    return make_inbound_site(ingest, [conn], reactor=MemoryReactorClock())


def exchange(raw: bytes, cuts: list[int]) -> tuple[StringTransport, bytes]:
    channel = site(Committing()).buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
    channel.makeConnection(transport)
    bounds = [0, *sorted(cuts), len(raw)]
    for a, b in zip(bounds, bounds[1:]):
        if transport.disconnecting:
            break
        channel.dataReceived(raw[a:b])
    out = transport.value()
    channel.connectionLost(Failure(ConnectionError("test over")))
    return transport, out


def statuses(out: bytes) -> list[int]:
    found = []
    for part in out.split(b"HTTP/1.1 ")[1:]:
        status = int(part[:3])
        head, _, rest = part.partition(b"\r\n\r\n")
        if rest.startswith(b"{"):  # ours are JSON (twisted's own 400 for a bad request line is plain; HEAD has none)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            json.loads(rest[:length])
        found.append(status)
    return found


content_types = st.one_of(
    st.none(),
    st.sampled_from(
        [
            "text/plain",
            "application/hl7-v2",
            "application/json",
            'TEXT/PLAIN ; CHARSET="UTF-8"',
            "text/plain; charset=",
            "text/plain; charset",
            ";;;",
            'text/plain; charset=""',
        ]
    ),
    st.sampled_from(CHARSETS).map(lambda c: f"text/plain; charset={c}"),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80),
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(["POST"] * 8 + ["GET", "PUT", "DELETE", "OPTIONS", "HEAD"]))
    path = draw(
        st.sampled_from(
            ["/messages/web"] * 6
            + ["/messages/web/", "/messages/other", "/", "/messages/web?x=1", "/messages/%2e%2e", "/messages/web#f"]
        )
    )
    body = draw(
        st.one_of(
            message_bytes(),
            st.binary(max_size=64),
            st.sampled_from([VALID, VALID.replace(b"\r", b"\n")]),
            st.integers(LIMIT - 10, LIMIT * 2).map(lambda n: b"MSH|^~\\&|" + b"x" * n),
        )
    )
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n"
    ctype = draw(content_types)
    if ctype is not None:
        head += f"Content-Type: {ctype}\r\n"
    framing = draw(st.sampled_from(["length"] * 4 + ["wrong-length", "chunked"]))
    if framing == "chunked":
        head += "Transfer-Encoding: chunked\r\n"
        payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:100], body[100:]) if c) + b"0\r\n\r\n"
    else:
        declared = len(body) if framing == "length" else draw(st.integers(0, 2**40))
        head += f"Content-Length: {declared}\r\n"
        payload = body
    return head.encode() + b"\r\n" + payload


@FUZZ
@given(requests(), st.lists(st.integers(0, 10_000), max_size=8))
def test_any_request_gets_a_json_answer_never_a_500(raw: bytes, cuts: list[int]) -> None:
    _transport, out = exchange(raw, [c % (len(raw) + 1) for c in cuts])
    for status in statuses(out):
        assert status in ANSWERS, out[:400]
    assert b"Traceback" not in out and b"<html" not in out.lower()


@FEW
@given(st.binary(max_size=300))
def test_garbage_bytes_on_the_http_port_never_crash_the_channel(raw: bytes) -> None:
    _transport, out = exchange(raw + b"\r\n\r\n", [])
    for status in statuses(out):
        assert status in ANSWERS | {501}, out[:400]  # 501: a method twisted.web does not implement


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.sampled_from(CHARSETS).map(lambda c: f"text/plain; charset={c}".encode())))
def test_content_type_parse_never_raises_and_never_grows(value: bytes) -> None:
    media, charset = _content_type(value)
    assert isinstance(media, str) and isinstance(charset, str)
    assert len(media) + len(charset) <= len(value)


@FUZZ
@given(
    st.one_of(
        st.text(max_size=60),
        st.sampled_from(CHARSETS),
        st.sampled_from(CHARSETS).map(str.lower),
        st.none(),
        st.integers(),
        st.binary(max_size=10),
        st.lists(st.text(max_size=3), max_size=2),
    )
)
def test_codec_for_gives_an_allowed_codec_or_none(name: Any) -> None:
    codec = codec_for(name)
    assert codec is None or codec in ALLOWED_CODECS
    if codec is not None:  # and a linear C decoder, usable at once
        b"abc".decode(codec)


def test_no_codec_that_is_not_a_charset_is_ever_allowed() -> None:
    for name in (
        "punycode",
        "base64",
        "base_64",
        "zlib",
        "zip",
        "rot13",
        "rot_13",
        "hex",
        "bz2",
        "uu",
        "quopri",
        "idna",
        "unicode_escape",
        "raw_unicode_escape",
        "utf-16",
        "utf-32",
        "utf_7",
        "mbcs",
        "klingon",
    ):
        assert codec_for(name) is None, name


def test_a_punycode_body_of_1_6_mb_is_refused_in_milliseconds() -> None:
    """Issue 23 row 1: `charset=punycode` with a 1.6 MB body held the reactor for 22 s."""
    body = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5\rNTE|1||x-" + b"b" * 1_600_000  # quadratic in punycode
    conn = InboundConfig(name="web", kind="http", max_message_bytes=2_000_000)
    ingest = Committing()
    channel = make_inbound_site(ingest, [conn], reactor=MemoryReactorClock()).buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER, hostAddress=HOST)
    channel.makeConnection(transport)
    started = time.perf_counter()
    channel.dataReceived(
        b"POST /messages/web HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain; charset=punycode\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    took = time.perf_counter() - started
    assert statuses(transport.value()) == [400], transport.value()[:300]
    assert not ingest.items
    assert took < 0.2, f"{took:.3f} s"


def test_content_type_parse_is_linear_in_its_length() -> None:
    def many_params(n: int) -> object:
        return _content_type(b"text/plain" + b"; a=b" * (n // 5))

    assert seconds(lambda: many_params(WORST_BYTES)) < 0.1
    linear(many_params)
