"""The HL7 parsers fuzzed: the header parse (listeners/hl7msg.py), the batch split
(listeners/hl7batch.py) and the one decision every transport makes on received bytes
(`listeners.validation.build_inbound`). Any input: a result or the documented refusal
(`HL7HeaderError`, `BatchError`, `PayloadRejected`), never another exception; what comes out is
no bigger than what went in; and the worst 100 KiB of each kind takes under 0.5 s, linearly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from listeners.hl7batch import BatchError, split_batch
from listeners.hl7msg import HL7HeaderError, parse_header
from listeners.validation import Inbound, InboundBatch, PayloadRejected, build_inbound
from tests.fuzz.budget import FUZZ, WORST_BYTES, WORST_SECONDS, linear, seconds

# Charset names a sender could put in MSH-18: table 0211, aliases, and names Python has as codecs
# that are not character sets (the issue 23 rows: quadratic, or not text at all).
CHARSETS = [
    "",
    "ASCII",
    "8859/1",
    "UNICODE UTF-8",
    "UTF-8",
    "latin-1",
    "ISO IR87",
    "BIG-5",
    "GB 18030-2000",
    "punycode",
    "base64",
    "zlib",
    "rot13",
    "hex",
    "bz2",
    "uu",
    "quopri",
    "utf-16",
    "utf-32",
    "UNICODE",
    "idna",
    "unicode_escape",
    "raw_unicode_escape",
    "klingon",
    "8859/1~UTF-8",
    "x" * 300,
]
SEPARATORS = "|^~\\&#!*$@%"

field = st.one_of(
    st.text(max_size=12), st.binary(max_size=12).map(lambda b: b.decode("latin-1")), st.sampled_from(CHARSETS)
)


@st.composite
def msh(draw: st.DrawFn) -> bytes:
    fs = draw(st.sampled_from(SEPARATORS))
    enc = draw(st.one_of(st.just("^~\\&"), st.text(alphabet=SEPARATORS, max_size=6)))
    fields = [draw(field) for _ in range(draw(st.integers(0, 20)))]
    if len(fields) >= 16 and draw(st.booleans()):
        fields[15] = draw(st.sampled_from(CHARSETS))
    text = "MSH" + fs + enc + fs + fs.join(fields)
    codec = draw(st.sampled_from(["utf-8", "latin-1"]))
    return text.encode(codec, "replace")


segment = st.one_of(
    msh(),
    st.sampled_from([b"PID|1||123", b"EVN|A01", b"OBX|1|TX|||\xff\xfe", b"", b"\x00"]),
    st.binary(max_size=30),
    st.sampled_from(
        [
            b"FHS|^~\\&|A|B",
            b"BHS|^~\\&|A|B||||||B1",
            b"BTS|1",
            b"BTS|x",
            b"FTS|1",
            b"BHS|",
            b"FHS",
            b"BTS|99999999999999999999",
        ]
    ),
)
ending = st.sampled_from([b"\r", b"\n", b"\r\n", b""])


@st.composite
def message_bytes(draw: st.DrawFn) -> bytes:
    parts = draw(st.lists(st.tuples(segment, ending), max_size=10))
    prefix = draw(st.sampled_from([b"", b"\xef\xbb\xbf", b"\r\n", b" \t"]))
    return prefix + b"".join(s + e for s, e in parts)


@FUZZ
@given(message_bytes(), st.booleans(), st.booleans(), st.sampled_from(["utf-8", "latin-1", "ascii"]))
def test_header_parse_gives_a_header_or_its_documented_error(
    data: bytes, complete: bool, strict: bool, default: str
) -> None:
    try:
        header = parse_header(data, complete=complete, default_encoding=default, strict_charset=strict)
    except HL7HeaderError as exc:
        assert str(exc)
        return
    assert header.control_id.strip()
    assert header.encoding  # a codec was chosen, and it is one of the allowed ones
    assert parse_header(data, complete=complete, default_encoding=default, strict_charset=strict) == header
    if complete:
        assert header.text is not None and len(header.text) <= len(data)


@FUZZ
@given(message_bytes())
def test_batch_split_gives_messages_or_its_documented_error(data: bytes) -> None:
    try:
        split = split_batch(data)
    except BatchError as exc:
        assert str(exc)
        return
    assert sum(len(m) for m in split.messages) <= len(data) + len(split.messages)  # + a CR each
    for message in split.messages:
        assert message.lstrip(b"\r\n \t").startswith(b"MSH"), message[:40]


@FUZZ
@given(message_bytes(), st.sampled_from(CHARSETS[:7]), st.booleans())
def test_every_transport_decision_stages_or_refuses_with_a_reason(data: bytes, charset: str, hl7_only: bool) -> None:
    try:
        built = build_inbound(data, connection="fuzz", charset=charset or "UTF-8", hl7_only=hl7_only)
    except PayloadRejected as exc:
        assert str(exc)
        return
    items = built.items if isinstance(built, InboundBatch) else (built,)
    assert sum(len(item.payload) for item in items) <= len(data) + len(items)
    for item in items:
        assert isinstance(item, Inbound) and item.payload and "\x00" not in item.payload


@FUZZ
@given(st.sampled_from(CHARSETS), st.binary(max_size=200))
def test_a_declared_charset_outside_table_0211_is_refused_not_decoded(charset: str, tail: bytes) -> None:
    data = f"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5|||||{charset}\r".encode() + tail
    try:
        header = parse_header(data, strict_charset=True)
    except HL7HeaderError:
        return
    assert header.encoding in {"ascii", "iso8859-1", "utf-8", "iso2022_jp", "big5", "gb18030"}, header.encoding


# -- worst cases, timed ---------------------------------------------------------------------------


def header_one_huge_field(n: int) -> bytes:
    return b"MSH|^~\\&|" + b"A" * n + b"|||||C1|P|2.5\rPID|1\r"


def header_all_separators(n: int) -> bytes:
    return b"MSH|^~\\&" + b"|" * n + b"\r"


def header_punycode(n: int) -> bytes:  # issue 23: 1.6 MB decoded for 22 s on the reactor
    return b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5|||||punycode\rNTE|1||x-" + b"b" * n + b"\r"


def batch_of_tiny_messages(n: int) -> bytes:
    one = b"MSH|^~\\&|||||||A|1|P|2.5\r"
    count = max(1, (n - 40) // len(one))
    return b"BHS|^~\\&|A|B\r" + one * count + f"BTS|{count}\r".encode()


def batch_of_segments(n: int) -> bytes:
    return b"BHS|^~\\&\rMSH|^~\\&|||||||A|1|P|2.5\r" + b"Z\r" * (n // 2) + b"BTS|1\r"


def lone_bhs_lines(n: int) -> bytes:
    return b"BHS|^~\\&\r" + b"BHS|\r" * (n // 5)


WORST = {
    "header-one-huge-field": lambda n: parse_header(header_one_huge_field(n)),
    "header-all-separators": lambda n: _refused(lambda: parse_header(header_all_separators(n))),
    "header-punycode-charset": lambda n: _refused(lambda: parse_header(header_punycode(n), strict_charset=True)),
    "batch-of-tiny-messages": lambda n: split_batch(batch_of_tiny_messages(n)),
    "batch-one-message-of-tiny-segments": lambda n: split_batch(batch_of_segments(n)),
    "batch-of-bhs-lines": lambda n: _refused(lambda: split_batch(lone_bhs_lines(n))),
    "inbound-batch-of-tiny-messages": lambda n: build_inbound(
        batch_of_tiny_messages(n), connection="w", charset="UTF-8"
    ),
    "inbound-punycode-charset": lambda n: _refused(
        lambda: build_inbound(header_punycode(n), connection="w", charset="UTF-8")
    ),
}


def _refused(fn: Callable[[], object]) -> object:
    """The result, or the documented refusal (a refusal is as good an answer as a parse)."""
    try:
        return fn()
    except (HL7HeaderError, BatchError, PayloadRejected) as exc:
        return exc


@pytest.mark.parametrize("case", list(WORST))
def test_worst_case_input_is_parsed_in_linear_time(case: str) -> None:
    go = WORST[case]
    took = seconds(lambda: go(WORST_BYTES))
    assert took < WORST_SECONDS, f"{case}: 100 KiB took {took:.3f} s"
    linear(go)
