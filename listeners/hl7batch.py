"""HL7 v2 batches (section 2.10.3): ``[FHS] {[BHS] {MSH …} [BTS]} [FTS]``, split into their messages.

A sender may wrap messages in a batch — a file of them (FHS … FTS), one or more batches (BHS …
BTS), or both — on any transport. :func:`split_batch` checks the envelope and cuts it into the
messages' bytes, untouched; each message is then validated like a message sent alone
(:func:`listeners.validation.build_inbound`). What is checked here, each refusal naming its reason:

* the envelope's separators (FHS-1/FHS-2, BHS-1/BHS-2) as MSH-1/MSH-2 are checked;
* segment order: FHS only first, FTS only last, nothing but a message between BHS and BTS, and no
  segment of a message before its MSH;
* the trailers' counts, when given: BTS-1 = the messages of its batch, FTS-1 = the batches.

Bytes only, no charset: the envelope segments are ASCII and a message's own MSH-18 decodes it.
Segments end at CR, LF or CR LF (bytes that no supported charset uses inside a character).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from listeners.hl7errors import DATA_TYPE_ERROR, SEGMENT_SEQUENCE_ERROR, Condition, Location

__all__ = ["ENVELOPE", "BatchError", "BatchHeader", "SplitBatch", "split_batch", "starts_batch"]

ENVELOPE = (b"FHS", b"BHS")
_NOISE = b" \t\r\n"
_BOM = b"\xef\xbb\xbf"
_SEGMENT_END = re.compile(rb"\r\n|\r|\n")
_PUNCTUATION = frozenset(b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


class BatchError(ValueError):
    """The envelope is not a valid batch; ``str()`` is safe to log and to send back (no content).
    ``condition`` is the ERR it gets: 100 (segment sequence) unless a field is named (102)."""

    def __init__(self, reason: str, header: BatchHeader | None = None, condition: Condition | None = None) -> None:
        super().__init__(reason)
        self.header = header  # what could be read of the envelope (to address the answer)
        self.condition = condition or _SEQUENCE


_SEQUENCE = Condition(SEGMENT_SEQUENCE_ERROR)


def _bad_field(segment: str, sequence: int, field: int) -> Condition:
    return Condition(DATA_TYPE_ERROR, Location(segment, sequence, field))


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The envelope's identity: separators, the addressing fields and the control ids, raw."""

    field_separator: str = "|"
    encoding_characters: str = "^~\\&"
    sending_application: str = ""
    sending_facility: str = ""
    receiving_application: str = ""
    receiving_facility: str = ""
    fhs_control_id: str = ""
    bhs_control_ids: tuple[str, ...] = ()

    @property
    def bhs_control_id(self) -> str:
        """BHS-11 when the envelope holds exactly one batch, else empty."""
        return self.bhs_control_ids[0] if len(self.bhs_control_ids) == 1 else ""

    @property
    def control_id(self) -> str:
        """What an answer to the whole batch names (MSA-2): BHS-11 of its one batch, else FHS-11."""
        return self.bhs_control_id or self.fhs_control_id


@dataclass(frozen=True, slots=True)
class SplitBatch:
    header: BatchHeader
    messages: tuple[bytes, ...]
    declared: int | None = None  # the BTS-1 counts' sum, when every batch declared one
    batches: int = 1


def starts_batch(data: bytes) -> bool:
    """True when the first segment (after a BOM and blank lines) is FHS or BHS."""
    start = len(_BOM) if data.startswith(_BOM) else 0
    while start < len(data) and data[start] in _NOISE:
        start += 1
    return data[start : start + 3] in ENVELOPE


def _segments(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every non-blank segment."""
    out, pos = [], 0
    for m in _SEGMENT_END.finditer(data):
        if data[pos : m.start()].strip(_NOISE):
            out.append((pos, m.start()))
        pos = m.end()
    if data[pos:].strip(_NOISE):
        out.append((pos, len(data)))
    return out


def _separators(segment: bytes, name: str, sequence: int = 1) -> tuple[int, str]:
    if len(segment) < 4 or segment[3] not in _PUNCTUATION:
        raise BatchError(f"{name}-1 must be ASCII punctuation", condition=_bad_field(name, sequence, 1))
    fs = segment[3]
    end = segment.find(bytes([fs]), 4)
    enc = segment[4:] if end < 0 else segment[4:end]
    if len(enc) not in (4, 5) or any(b not in _PUNCTUATION for b in enc) or len(set(enc) | {fs}) != len(enc) + 1:
        raise BatchError(
            f"{name}-2 malformed: 4 or 5 distinct ASCII punctuation characters expected",
            condition=_bad_field(name, sequence, 2),
        )
    return fs, enc.decode("ascii")


def _fields(segment: bytes, fs: int) -> list[str]:
    """Fields as text (envelope fields are ASCII; anything else is replaced, never trusted)."""
    return segment.decode("ascii", "replace").split(chr(fs))


def _field(fields: list[str], n: int) -> str:
    """Field n of an envelope segment whose first field is the separator (as MSH-n: fields[n - 1])."""
    return fields[n - 1].strip() if len(fields) >= n else ""


def _count(fields: list[str], name: str, sequence: int = 1) -> int | None:
    text = _field(fields, 2)  # BTS-1 / FTS-1
    if not text:
        return None
    if not text.isdigit():
        raise BatchError(f"{name}-1 is not a number", condition=_bad_field(name, sequence, 1))
    return int(text)


def split_batch(data: bytes) -> SplitBatch:
    """The batch's messages (each as its bytes, ending with CR) and its identity, or `BatchError`."""
    segments = _segments(data)
    if not segments or data[segments[0][0] : segments[0][0] + 3] not in ENVELOPE:
        raise BatchError("not a batch: the first segment is not FHS or BHS")
    first = data[segments[0][0] : segments[0][1]]
    if data.startswith(_BOM) and segments[0][0] == 0:
        first = first[len(_BOM) :]
    fs, enc = _separators(first, first[:3].decode())
    head = _fields(first, fs)
    header_fields = {
        "field_separator": chr(fs),
        "encoding_characters": enc,
        "sending_application": _field(head, 3),
        "sending_facility": _field(head, 4),
        "receiving_application": _field(head, 5),
        "receiving_facility": _field(head, 6),
    }
    fhs_id = _field(head, 11) if first.startswith(b"FHS") else ""
    bhs_ids: list[str] = []
    messages: list[bytes] = []
    in_batch: list[int] = []  # messages per batch (BHS … BTS), a batch without BHS included
    declared: list[int | None] = []
    file_count: int | None = None
    open_batch = False  # a BHS (or a bare MSH) started a batch that no BTS has closed
    message_start: int | None = None
    file_ended = False

    def header() -> BatchHeader:
        return BatchHeader(**header_fields, fhs_control_id=fhs_id, bhs_control_ids=tuple(bhs_ids))

    def fail(reason: str, condition: Condition | None = None) -> BatchError:
        return BatchError(reason, header(), condition)

    def end_message(at: int) -> None:
        nonlocal message_start
        if message_start is not None:
            messages.append(data[message_start:at].rstrip(_NOISE) + b"\r")
            in_batch[-1] += 1
            message_start = None

    for index, (start, end) in enumerate(segments):
        segment = data[start:end]
        if index == 0:
            segment = first
        name = segment[:3]
        if file_ended:
            raise fail(f"segment {name.decode('ascii', 'replace')!r} after FTS")
        if name == b"FHS":
            if index != 0:
                raise fail("FHS is not the first segment")
            continue
        if name == b"BHS":
            end_message(start)
            if open_batch:
                raise fail(f"batch {len(in_batch)} has no BTS before the next BHS")
            if index != 0:
                try:  # every batch's own separators must be valid too
                    _separators(segment, "BHS", len(bhs_ids) + 1)
                except BatchError as exc:
                    raise fail(str(exc), exc.condition) from None
            bhs_ids.append(_field(_fields(segment, fs), 11))
            in_batch.append(0)
            declared.append(None)
            open_batch = True
            continue
        if name == b"MSH":
            end_message(start)
            if not open_batch:
                if in_batch and bhs_ids:
                    raise fail("MSH after BTS: a message outside any batch")
                if not in_batch:
                    in_batch.append(0)
                    declared.append(None)
                open_batch = True
            message_start = start
            continue
        if name == b"BTS":
            end_message(start)
            if not open_batch:
                raise fail("BTS without a batch")
            try:
                declared[-1] = _count(_fields(segment, fs), "BTS", len(in_batch))
            except BatchError as exc:
                raise fail(str(exc), exc.condition) from None
            if declared[-1] is not None and declared[-1] != in_batch[-1]:
                raise fail(
                    f"batch trailer count BTS-1={declared[-1]} but {in_batch[-1]} "
                    f"message{'s' if in_batch[-1] != 1 else ''}",
                    Condition(SEGMENT_SEQUENCE_ERROR, Location("BTS", len(in_batch), 1)),
                )
            open_batch = False
            continue
        if name == b"FTS":
            end_message(start)
            if not first.startswith(b"FHS"):
                raise fail("FTS without FHS")
            try:
                file_count = _count(_fields(segment, fs), "FTS")
            except BatchError as exc:
                raise fail(str(exc), exc.condition) from None
            file_ended = True
            continue
        if message_start is None:
            raise fail(f"segment {name.decode('ascii', 'replace')!r} outside a message (before its MSH)")
    end_message(len(data))
    batches = max(len(in_batch), 1)
    if file_count is not None and file_count != batches:
        raise fail(
            f"file trailer count FTS-1={file_count} but {batches} batch{'es' if batches != 1 else ''}",
            Condition(SEGMENT_SEQUENCE_ERROR, Location("FTS", 1, 1)),
        )
    total = None if any(d is None for d in declared) or not declared else sum(d for d in declared if d is not None)
    return SplitBatch(header(), tuple(messages), declared=total, batches=batches)
