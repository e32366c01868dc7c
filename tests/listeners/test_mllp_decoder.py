"""The pure MLLP decoder: framing edge cases, garbage, oversize frames, bounded memory."""

from __future__ import annotations

import time

import pytest

from listeners.mllp_listener import (
    Garbage,
    GarbageReason,
    Message,
    MLLPDecoder,
    MLLPEvent,
    Oversize,
    frame,
)

MSG_A = b"MSH|^~\\&|A|B|C|D|||ADT^A01|CTRL-A|P|2.5\rPID|1\r"
MSG_B = b"MSH|^~\\&|A|B|C|D|||ADT^A08|CTRL-B|P|2.5\rPID|2\r"


def feed_all(decoder: MLLPDecoder, chunks: list[bytes]) -> list[MLLPEvent]:
    events: list[MLLPEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    return events


def test_frame_wraps_in_vt_fs_cr() -> None:
    assert frame(b"x") == b"\x0bx\x1c\x0d"


def test_decodes_one_frame() -> None:
    decoder = MLLPDecoder()
    assert decoder.feed(frame(MSG_A)) == [Message(MSG_A)]
    assert decoder.messages == 1
    assert decoder.buffered_bytes == 0


def test_frame_split_byte_by_byte_gives_the_same_message() -> None:
    stream = frame(MSG_A) + frame(MSG_B)
    events = feed_all(MLLPDecoder(), [bytes([b]) for b in stream])
    assert events == [Message(MSG_A), Message(MSG_B)]


def test_message_is_emitted_at_fs_without_waiting_for_cr() -> None:
    decoder = MLLPDecoder()
    assert decoder.feed(b"\x0b" + MSG_A + b"\x1c") == [Message(MSG_A)]
    assert decoder.feed(b"\r") == []
    assert decoder.feed(frame(MSG_B)) == [Message(MSG_B)]
    assert decoder.missing_cr == 0


def test_coalesced_frames_in_one_read_are_all_decoded_in_order() -> None:
    decoder = MLLPDecoder()
    assert decoder.feed(frame(MSG_A) + frame(MSG_B) + frame(MSG_A)) == [
        Message(MSG_A),
        Message(MSG_B),
        Message(MSG_A),
    ]


def test_garbage_between_frames_is_skipped_counted_and_never_a_message() -> None:
    decoder = MLLPDecoder()
    events = decoder.feed(b"GET / HTTP/1.1\r\n" + frame(MSG_A) + b"junk" + frame(MSG_B))
    assert events == [
        Garbage(16, GarbageReason.BETWEEN_FRAMES),
        Message(MSG_A),
        Garbage(4, GarbageReason.BETWEEN_FRAMES),
        Message(MSG_B),
    ]
    assert decoder.garbage_bytes == 20


def test_garbage_run_is_reported_once_when_it_ends_however_it_was_split() -> None:
    decoder = MLLPDecoder()
    assert feed_all(decoder, [b"ju", b"n", b"k"]) == []
    assert decoder.feed(b"\x0b") == [Garbage(4, GarbageReason.BETWEEN_FRAMES)]


def test_trailing_garbage_is_reported_at_close() -> None:
    decoder = MLLPDecoder()
    assert decoder.feed(frame(MSG_A) + b"xyz") == [Message(MSG_A)]
    assert decoder.close() == [Garbage(3, GarbageReason.BETWEEN_FRAMES)]
    assert decoder.close() == []


def test_line_noise_between_frames_is_ignored() -> None:
    decoder = MLLPDecoder()
    events = decoder.feed(b"\r\n" + frame(MSG_A) + b"\n\r\n" + frame(MSG_B) + b"\n")
    assert events == [Message(MSG_A), Message(MSG_B)]
    assert decoder.close() == []
    assert decoder.garbage_bytes == 0


def test_fs_without_cr_still_ends_the_frame_and_is_counted() -> None:
    decoder = MLLPDecoder()
    events = decoder.feed(b"\x0b" + MSG_A + b"\x1c" + b"\x0b" + MSG_B + b"\x1cX")
    assert events == [Message(MSG_A), Message(MSG_B)]
    assert decoder.missing_cr == 2
    assert decoder.close() == [Garbage(1, GarbageReason.BETWEEN_FRAMES)]


def test_vt_inside_a_frame_drops_the_partial_frame_and_starts_again() -> None:
    decoder = MLLPDecoder()
    events = decoder.feed(b"\x0bMSH|partial" + frame(MSG_A))
    assert events == [Garbage(11, GarbageReason.INTERRUPTED_FRAME), Message(MSG_A)]


def test_unterminated_frame_is_reported_at_close() -> None:
    decoder = MLLPDecoder()
    assert decoder.feed(b"\x0b" + MSG_A) == []
    assert decoder.close() == [Garbage(len(MSG_A), GarbageReason.UNTERMINATED_FRAME)]
    assert decoder.feed(frame(MSG_B)) == [Message(MSG_B)]


def test_empty_frame_is_a_message_with_empty_payload() -> None:
    assert MLLPDecoder().feed(b"\x0b\x1c\r") == [Message(b"")]


def test_frame_of_exactly_the_limit_is_accepted_one_more_byte_is_oversize() -> None:
    decoder = MLLPDecoder(max_message_bytes=10, prefix_bytes=4)
    assert decoder.feed(frame(b"0123456789")) == [Message(b"0123456789")]
    assert decoder.feed(frame(b"0123456789A")) == [Oversize(b"0123", 11)]
    assert decoder.oversize == 1


def test_oversize_frame_is_discarded_to_its_end_and_keeps_its_first_bytes() -> None:
    limit = 1000
    big = MSG_A + b"OBX|" + b"x" * 50_000 + b"\r"
    decoder = MLLPDecoder(max_message_bytes=limit, prefix_bytes=64)
    events: list[MLLPEvent] = []
    stream = frame(big) + frame(MSG_B)
    for i in range(0, len(stream), 333):
        events += decoder.feed(stream[i : i + 333])
        assert decoder.buffered_bytes <= limit
    assert events == [Oversize(big[:64], len(big)), Message(MSG_B)]


def test_oversize_prefix_is_never_larger_than_the_limit() -> None:
    decoder = MLLPDecoder(max_message_bytes=8, prefix_bytes=4096)
    assert decoder.feed(frame(b"x" * 20)) == [Oversize(b"x" * 8, 20)]


def test_oversize_frame_interrupted_by_vt_is_garbage() -> None:
    decoder = MLLPDecoder(max_message_bytes=8, prefix_bytes=4)
    events = decoder.feed(b"\x0b" + b"y" * 30 + frame(b"ok"))
    assert events == [Garbage(30, GarbageReason.INTERRUPTED_FRAME), Message(b"ok")]


def test_memory_stays_bounded_for_an_endless_frame() -> None:
    decoder = MLLPDecoder(max_message_bytes=4096, prefix_bytes=128)
    decoder.feed(b"\x0b")
    chunk = b"z" * 65536
    for _ in range(200):  # ~13 MB
        assert decoder.feed(chunk) == []
        assert decoder.buffered_bytes <= 4096
    assert decoder.feed(b"\x1c\r") == [Oversize(b"z" * 128, 200 * 65536)]


def test_memory_stays_bounded_for_endless_garbage() -> None:
    decoder = MLLPDecoder(max_message_bytes=100)
    for _ in range(100):
        decoder.feed(b"g" * 65536)
        assert decoder.buffered_bytes == 0
    assert decoder.close() == [Garbage(100 * 65536, GarbageReason.BETWEEN_FRAMES)]


def test_large_message_in_small_reads_is_fast() -> None:
    big = b"MSH|^~\\&|||||||ADT|1\r" + b"OBX|1|ED|||" + b"A" * (4 * 1024 * 1024) + b"\r"
    stream = frame(big)
    decoder = MLLPDecoder(max_message_bytes=8 * 1024 * 1024)
    started = time.perf_counter()
    events = feed_all(decoder, [stream[i : i + 4096] for i in range(0, len(stream), 4096)])
    assert time.perf_counter() - started < 2.0
    assert events == [Message(big)]


@pytest.mark.parametrize(("max_bytes", "prefix"), [(0, 10), (10, -1)])
def test_invalid_limits_are_refused(max_bytes: int, prefix: int) -> None:
    with pytest.raises(ValueError):
        MLLPDecoder(max_message_bytes=max_bytes, prefix_bytes=prefix)
