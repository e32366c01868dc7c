"""Time-boxed property tests: random byte streams and random splits into the decoder, random
headers into the parser and ACK builder, random traffic into the protocol."""

from __future__ import annotations

import hl7
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.defer import succeed
from twisted.internet.testing import MemoryReactorClock, StringTransport

from listeners.hl7ack import AckCode, AckDecision, build_ack, build_fallback_ack
from listeners.hl7msg import HL7Header, HL7HeaderError, parse_header
from listeners.mllp_listener import (
    Garbage,
    Message,
    MLLPConfig,
    MLLPDecoder,
    MLLPEvent,
    MLLPFactory,
    Oversize,
    frame,
)
from tests.fuzz.budget import FUZZ

MAX = 256
PREFIX = 64
# The fuzz set's budget (tests/fuzz/budget.py): derandomized, no example database (no .hypothesis/
# directory in the repo), no deadline.
# "-", "/" and "." are left out: they occur in values this generator writes unescaped
# ("8859/1", "UTF-8", "2.5"); a sender using them as separators would have to escape those.
PUNCTUATION = "!\"#$%&'()*+,:;<=>?@[\\]^_`{|}~"
CHARSETS = {"": "utf-8", "ASCII": "ascii", "8859/1": "latin-1", "UNICODE UTF-8": "utf-8"}


def sample_message(control_id: str) -> bytes:
    return f"MSH|^~\\&|A|B|C|D|||ADT^A01|{control_id}|P|2.5\rPID|1\r".encode()


parts = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"\x0b", b"\x1c", b"\r", b"\n", b"\x1c\r", b"\x0b\x1c\r"]),
    st.integers(0, 99_999).map(lambda n: frame(sample_message(f"C{n}"))),
    st.integers(MAX - 2, MAX * 3).map(lambda n: frame(b"MSH|^~\\&|||||||ADT|BIG|" + b"x" * n)),
)


@st.composite
def split_stream(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    stream = b"".join(draw(st.lists(parts, max_size=25)))
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=30)))
    bounds = [0, *cuts, len(stream)]
    return stream, [stream[a:b] for a, b in zip(bounds, bounds[1:])]


def decode(chunks: list[bytes]) -> list[MLLPEvent]:
    decoder = MLLPDecoder(max_message_bytes=MAX, prefix_bytes=PREFIX)
    events: list[MLLPEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
        assert decoder.buffered_bytes <= MAX
    return events + decoder.close()


@FUZZ
@given(split_stream())
def test_resplitting_a_stream_gives_the_same_events_with_bounded_memory(
    case: tuple[bytes, list[bytes]],
) -> None:
    stream, chunks = case
    whole = decode([stream])
    assert decode(chunks) == whole
    assert decode([bytes([b]) for b in stream[:600]] + [stream[600:]]) == whole
    accounted = 0
    for event in whole:
        if isinstance(event, Message):
            assert len(event.payload) <= MAX
            assert b"\x0b" not in event.payload and b"\x1c" not in event.payload
            accounted += len(event.payload)
        elif isinstance(event, Oversize):
            assert event.size > MAX and len(event.prefix) <= PREFIX
            assert event.prefix and b"\x0b" not in event.prefix and b"\x1c" not in event.prefix
            accounted += event.size
        else:
            assert isinstance(event, Garbage) and event.size > 0
            accounted += event.size
    assert accounted <= len(stream)


@FUZZ
@given(st.lists(st.integers(0, 10**9), max_size=15), st.data())
def test_well_formed_frames_survive_any_split(ids: list[int], data: st.DataObject) -> None:
    messages = [sample_message(f"ID{n}") for n in ids]
    stream = b"".join(frame(m) for m in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=40)))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in zip(bounds, bounds[1:])]
    assert decode(chunks) == [Message(m) for m in messages]


@FUZZ
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_parse_or_raise_only_the_documented_error(data: bytes, complete: bool) -> None:
    candidates = [data, b"MSH" + data, b"MSH|^~\\&|" + data]
    for candidate in candidates:
        try:
            header = parse_header(candidate, complete=complete)
        except HL7HeaderError:
            continue
        for code in AckCode:
            ack = build_ack(header, code, reason=data.decode("latin-1"))
            assert b"\x0b" not in ack and b"\x1c" not in ack
            assert parse_header(ack).encoding == header.encoding


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, str, str]:
    seps = draw(st.permutations(PUNCTUATION).map(lambda p: "".join(p[:6])))
    width = draw(st.sampled_from([4, 5]))
    fs, enc = seps[0], seps[1 : 1 + width]
    charset = draw(st.sampled_from(sorted(CHARSETS)))
    codec = CHARSETS[charset]
    banned = set(fs + enc + "\r\n")
    safe = st.characters(codec=codec, exclude_characters=banned, exclude_categories=["Cc"])
    value = st.text(safe, max_size=12)
    control_id = draw(st.text(safe, min_size=1, max_size=20).filter(lambda s: s.strip()))
    fields = ["MSH", enc] + [draw(value) for _ in range(6)]
    fields += ["ADT" + enc[0] + "A01", control_id, "P", "2.5", "", "", "", "", "", charset]
    text = fs.join(fields) + "\rPID" + fs + "1" + fs + draw(value) + "\r"
    return text.encode(codec), control_id, codec


@FUZZ
@given(headers(), st.sampled_from(list(AckCode)), st.text(max_size=80))
def test_acks_for_random_headers_parse_and_echo_the_control_id(
    case: tuple[bytes, str, str], code: AckCode, reason: str
) -> None:
    message, control_id, codec = case
    header = parse_header(message)
    assert header.control_id == control_id
    raw = build_ack(header, code, reason=reason)
    ack = hl7.parse(raw, encoding=codec)
    assert str(ack.segment("MSA")[1]) == code.value
    # python-hl7 strips the whole message, so compare a trailing-space id on the raw bytes too.
    assert str(ack.segment("MSA")[2]).rstrip() == control_id.rstrip()
    fs = header.field_separator
    [msa_line] = [line for line in raw.decode(codec).split("\r") if line.startswith("MSA")]
    assert msa_line.split(fs)[1:3] == [code.value, control_id]
    expected = ["MSH", "MSA"] if code in (AckCode.AA, AckCode.CA) else ["MSH", "MSA", "ERR"]
    assert [str(segment[0]) for segment in ack] == expected
    assert raw.count(b"\r") == len(expected)
    back: HL7Header = parse_header(raw)
    assert (back.field_separator, back.encoding_characters) == (
        header.field_separator,
        header.encoding_characters,
    )
    assert (back.sending_application, back.receiving_application) == (
        header.receiving_application,
        header.sending_application,
    )


@FUZZ
@given(st.text(max_size=200))
def test_fallback_ack_is_always_ascii_and_well_formed(reason: str) -> None:
    raw = build_fallback_ack(AckCode.AR, reason=reason, sending_application=reason[:10])
    raw.decode("ascii")
    assert raw.count(b"\r") == 3
    assert [str(s[0]) for s in hl7.parse(raw)] == ["MSH", "MSA", "ERR"]


@FUZZ
@given(split_stream())
def test_protocol_answers_every_complete_frame_and_never_crashes(
    case: tuple[bytes, list[bytes]],
) -> None:
    stream, chunks = case
    factory = MLLPFactory(
        lambda message, peer, header: succeed(AckDecision.accept()),
        config=MLLPConfig(max_message_bytes=MAX, prefix_bytes=PREFIX),
        clock=MemoryReactorClock(),
    )
    peer = IPv4Address("TCP", "127.0.0.1", 1)
    proto = factory.buildProtocol(peer)
    transport = StringTransport(peerAddress=peer)
    proto.makeConnection(transport)
    for chunk in chunks:
        proto.dataReceived(chunk)
    answered = MLLPDecoder().feed(transport.value())
    frames = [e for e in decode([stream]) if not isinstance(e, Garbage)]
    if transport.disconnecting:
        assert len(answered) < len(frames)
    else:
        assert len(answered) == len(frames)
    for ack_event, inbound in zip(answered, frames):
        assert isinstance(ack_event, Message)
        ack = parse_header(ack_event.payload)
        assert ack.message_code == "ACK"
        code = ack_event.payload.split(b"\rMSA|")[1][:2]
        if isinstance(inbound, Message):
            try:
                expected = parse_header(inbound.payload).control_id
            except HL7HeaderError:
                assert code == b"AR"
            else:
                assert code == b"AA"
                assert ack_event.payload.split(b"\rMSA|")[1].split(b"\r")[0] == (b"AA|" + expected.encode("utf-8"))
        else:
            assert code == b"AR"
