"""The stream framings fuzzed: MLLP (listeners/mllp_listener.py), newline and 4-byte length prefix
(listeners/tcp.py). Any bytes, cut anywhere: the same events as the whole stream, never an
exception, memory bounded by the message limit, and time linear in the input (a 100 KiB stream of
the worst kind for each decoder in under 0.5 s)."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from listeners.mllp_listener import MLLPDecoder, frame
from listeners.tcp import Frame, LengthDecoder, NewlineDecoder
from listeners.tcp import Oversize as TCPOversize
from tests.fuzz.budget import FUZZ, WORST_BYTES, WORST_SECONDS, linear, seconds

MAX = 512
Decoder = NewlineDecoder | LengthDecoder | MLLPDecoder


def cut(data: st.DataObject, stream: bytes) -> list[bytes]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=30)))
    bounds = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in zip(bounds, bounds[1:])]


def feed_all(decoder: Decoder, chunks: list[bytes]) -> list[object]:
    events: list[object] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
        assert decoder.buffered_bytes <= MAX + 4 + len(chunk)  # never more than the limit and one read
    return events


line_parts = st.one_of(
    st.binary(max_size=60),
    st.sampled_from([b"\n", b"\r\n", b"\r", b"\n\n"]),
    st.integers(MAX - 2, MAX * 3).map(lambda n: b"y" * n + b"\n"),
)


@FUZZ
@given(st.lists(line_parts, max_size=30).map(b"".join), st.data())
def test_newline_framing_any_split_gives_the_same_bounded_events(stream: bytes, data: st.DataObject) -> None:
    whole = feed_all(NewlineDecoder(max_message_bytes=MAX), [stream])
    assert feed_all(NewlineDecoder(max_message_bytes=MAX), cut(data, stream)) == whole
    consumed = 0
    for event in whole:
        if isinstance(event, Frame):
            assert 0 < len(event.payload) <= MAX and b"\n" not in event.payload
            consumed += len(event.payload)
        else:
            assert isinstance(event, TCPOversize) and event.size > MAX
            consumed += event.size
    assert consumed <= len(stream)


def length_frames(draw_sizes: list[int]) -> bytes:
    return b"".join(struct.pack(">I", n) + bytes([n % 251]) * n for n in draw_sizes)


length_parts = st.one_of(
    st.binary(max_size=40),
    st.lists(st.integers(0, MAX), max_size=5).map(length_frames),
    st.integers(MAX + 1, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
)


@FUZZ
@given(st.lists(length_parts, max_size=20).map(b"".join), st.data())
def test_length_framing_any_split_gives_the_same_bounded_events(stream: bytes, data: st.DataObject) -> None:
    whole = feed_all(LengthDecoder(max_message_bytes=MAX), [stream])
    assert feed_all(LengthDecoder(max_message_bytes=MAX), cut(data, stream)) == whole
    for i, event in enumerate(whole):
        if isinstance(event, Frame):
            assert len(event.payload) <= MAX
        else:  # a declared length over the limit ends the stream: nothing after it
            assert isinstance(event, TCPOversize) and event.size > MAX and i == len(whole) - 1


@FUZZ
@given(st.lists(st.integers(0, MAX), max_size=12), st.data())
def test_length_framing_returns_every_well_formed_frame(sizes: list[int], data: st.DataObject) -> None:
    stream = length_frames(sizes)
    assert feed_all(LengthDecoder(max_message_bytes=MAX), cut(data, stream)) == [
        Frame(bytes([n % 251]) * n) for n in sizes
    ]


# -- worst cases, timed ---------------------------------------------------------------------------
# Each is the input that makes its decoder do the most work per byte: the most events (tiny or
# empty frames, one per few bytes), or the longest scan (one frame that never ends), fed whole or
# one byte at a time.


def mllp_tiny_frames(n: int) -> bytes:
    return (frame(b"M") * (n // 4 + 1))[:n]


def mllp_garbage(n: int) -> bytes:
    return b"\x1c\r" * (n // 2)


def mllp_endless(n: int) -> bytes:
    return b"\x0b" + b"x" * n


def newline_blank_lines(n: int) -> bytes:
    return b"a\n" * (n // 2)


def length_empty_frames(n: int) -> bytes:
    return b"\0\0\0\0" * (n // 4)


def run(
    decoder_factory: Callable[[], Decoder], make: Callable[[int], bytes], *, chunk: int | None = None
) -> Callable[[int], int]:
    def go(n: int) -> int:
        decoder = decoder_factory()
        data = make(n)
        if chunk is None:
            return len(decoder.feed(data))
        events = 0
        for i in range(0, len(data), chunk):
            events += len(decoder.feed(data[i : i + chunk]))
        return events

    return go


WORST = {
    "mllp-tiny-frames": (lambda: MLLPDecoder(max_message_bytes=MAX), mllp_tiny_frames),
    "mllp-garbage-trailers": (lambda: MLLPDecoder(max_message_bytes=MAX), mllp_garbage),
    "mllp-endless-frame": (lambda: MLLPDecoder(max_message_bytes=MAX), mllp_endless),
    "newline-one-byte-lines": (lambda: NewlineDecoder(max_message_bytes=MAX), newline_blank_lines),
    "newline-endless-line": (lambda: NewlineDecoder(max_message_bytes=MAX), lambda n: b"z" * n),
    "length-empty-frames": (lambda: LengthDecoder(max_message_bytes=MAX), length_empty_frames),
}


@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "byte-by-byte"])
@pytest.mark.parametrize("case", list(WORST))
def test_worst_case_stream_is_decoded_in_linear_time(case: str, chunk: int | None) -> None:
    factory, make = WORST[case]
    go = run(factory, make, chunk=chunk)
    took = seconds(lambda: go(WORST_BYTES))
    assert took < WORST_SECONDS, f"{case}: 100 KiB took {took:.3f} s"
    if chunk is None:  # byte-by-byte is dominated by the per-call cost: its ratio says nothing new
        linear(go)
