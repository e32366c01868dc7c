"""What every transport (MLLP, TCP, HTTP, file drop) counts as valid inbound input, decided once.

Each transport frames bytes its own way, then calls :func:`build_inbound`: tell an HL7 message, an
HL7 batch (split into its messages, `listeners.hl7batch`) and other text apart, decode (MSH-18,
else the connection's charset), refuse malformed HL7 and what no store can hold, compute the lane
key, build the `Inbound` row (or the `InboundBatch`). A refusal is a :class:`PayloadRejected`
whose text is safe to log and to send back; the transport answers it with its "rejected" answer
(MLLP ``AR``, TCP ``NAK``, HTTP 400, file moved to the error directory) for that message (or
batch) alone, with the same text on every transport. :func:`rejection_reason` maps a failed
commit to the answer the same way for all of them (invariant 9, docs/invariants.md).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.charsets import HL7_CHARSETS, codec_for
from include.hl7path import parse_path
from include.hl7path import value as hl7_value
from listeners.group_commit import (
    BatchIncomplete,
    Inbound,
    InboundBatch,
    IngestRejected,
    NotLeader,
    RowRefused,
    StoreUnavailable,
    new_message_id,
)
from listeners.hl7batch import BatchError, BatchHeader, split_batch, starts_batch
from listeners.hl7errors import (
    DATA_TYPE_ERROR,
    INTERNAL,
    SEGMENT_SEQUENCE_ERROR,
    Condition,
    Location,
    location_at,
    segments_named,
)
from listeners.hl7msg import HL7Header, HL7HeaderError, parse_header
from listeners.profile_check import Conformance, ProfileRefused, conditions_of

__all__ = [
    "ACCEPTED_CHARSETS",
    "MAX_KEY_CHARS",
    "BatchRejected",
    "IngestSink",
    "LaneOf",
    "PayloadRejected",
    "build_batch",
    "build_inbound",
    "codec_name",
    "lane_rule",
    "rejection_reason",
    "unstorable",
]

_log = Logger(namespace="stageline.inbound")

MAX_KEY_CHARS = 199  # control_id / lane_key columns are nvarchar(200) on SQL Server

# PostgreSQL text cannot hold NUL; a lone surrogate cannot be encoded in UTF-8 (nor passed in JSON).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


class IngestSink(TypingProtocol):
    """What a listener needs from `IngestWriter`: a Deferred that fires after the commit."""

    def submit(self, item: Inbound | InboundBatch) -> Deferred[str]: ...


LaneOf = Callable[[str], "str | None"]
"""Gives a decoded payload's lane key (None: no lane). Must not raise; if it does, the message
is refused (not staged) rather than staged in the wrong lane."""


def lane_rule(lane_key: str) -> LaneOf | None:
    """A connection's `lane_key` as a `LaneOf`, parsed once (config load already checked it)."""
    if not lane_key:
        return None
    path = parse_path(lane_key)
    return lambda text: hl7_value(text, path)


class PayloadRejected(ValueError):
    """The bytes cannot be staged; ``str()`` is safe to log and to send back (no content), and
    ``condition`` is what a negative ACK's ERR says (table 0357 code, location)."""

    def __init__(
        self,
        reason: str,
        condition: Condition = INTERNAL,
        more: Sequence[tuple[Condition, str]] = (),
        detail: str = "",
    ) -> None:
        super().__init__(reason)
        self.condition = condition
        self.more = tuple(more)  # further ERRs (condition, text): a profile's findings after the first
        self.detail = detail  # the first ERR's own text when it is not the reason (a profile's first finding)


_NO_MSH = Condition(SEGMENT_SEQUENCE_ERROR, Location("MSH"))
_BAD_DATA = Condition(DATA_TYPE_ERROR)


#: What a refusal of a charset names as accepted: HL7 table 0211's values (aliases of their codecs,
#: such as ``latin-1``, are accepted too).
ACCEPTED_CHARSETS: tuple[str, ...] = tuple(HL7_CHARSETS)


def codec_name(charset: str) -> str:
    """The canonical codec for a configured or declared charset; ValueError if not an allowed one.

    Only HL7 table 0211 and aliases of its codecs (`include.charsets.codec_for`): a name a client
    sends must not pick any decoder Python has (``punycode`` is quadratic, ``base64`` or ``zlib``
    are not character sets at all).
    """
    codec = codec_for(charset)
    if codec is None:
        shown = "".join(c for c in str(charset)[:40] if c.isprintable())
        raise ValueError(f"unknown charset {shown!r}; accepted: {', '.join(ACCEPTED_CHARSETS)}")
    return codec


def unstorable(text: str) -> str | None:
    """Why no store can hold ``text`` (a safe reason), or None when it can."""
    if text.isascii():  # the common case: no surrogate possible, and a NUL is one memchr away
        at = text.find("\x00")
        return None if at < 0 else f"message contains NUL characters (character offset {at})"
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    what = "NUL characters" if found.group() == "\x00" else "unpaired surrogate characters"
    return f"message contains {what} (character offset {found.start()})"


def build_inbound(
    data: bytes,
    *,
    connection: str,
    charset: str,
    lane_of: LaneOf | None = None,
    message_id: str | None = None,
    header: HL7Header | None = None,
    hl7_only: bool = False,
    conformance: Conformance | None = None,
) -> Inbound | InboundBatch:
    """Decide what the received bytes are and build what to stage, or raise `PayloadRejected`.

    The one decision every transport makes (docs/listenerd.md, "The same bytes, the same answer"):

    * the first segment is FHS or BHS: an HL7 batch, split into its messages (`InboundBatch`); one
      bad message, or an envelope that does not add up, refuses it whole (`BatchRejected`);
    * the first segment is MSH: an HL7 message. Its header must parse as MLLP parses it (MSH-1/2,
      MSH-10 present, a known MSH-18 charset, which decodes it); control_id = MSH-10;
    * an MSH/FHS/BHS segment further down: malformed HL7 (MSH is not the first segment), refused;
    * anything else is not HL7: refused when ``hl7_only`` (MLLP always is), else staged as opaque
      text decoded with ``charset``, without a control id.

    ``header`` is the transport's own complete parse (MLLP's), reused rather than parsed twice.
    ``message_id`` (a file's deterministic id) also gives a batch's id and its messages' ids. Text
    the store cannot hold is refused here, so it never reaches (and never fails) a group commit.
    ``conformance`` (the connection's profiles, `listeners.profile_check`) checks each message last:
    ``reject`` refuses one with findings (one ERR a finding), ``flag`` stages it with them.
    """
    if header is None and starts_batch(data):
        return build_batch(
            data, connection=connection, charset=charset, lane_of=lane_of, batch_id=message_id, conformance=conformance
        )
    return _build_one(
        data,
        connection=connection,
        charset=charset,
        lane_of=lane_of,
        message_id=message_id,
        header=header,
        hl7_only=hl7_only,
        conformance=conformance,
    )


class BatchRejected(PayloadRejected):
    """A batch refused whole; ``header`` is its envelope when it could be read (for the answer)."""

    def __init__(
        self,
        reason: str,
        header: BatchHeader | None = None,
        condition: Condition = INTERNAL,
        more: Sequence[tuple[Condition, str]] = (),
        detail: str = "",
    ) -> None:
        super().__init__(reason, condition, more, detail)
        self.header = header


def _build_one(
    data: bytes,
    *,
    connection: str,
    charset: str,
    lane_of: LaneOf | None,
    message_id: str | None,
    header: HL7Header | None,
    hl7_only: bool,
    conformance: Conformance | None = None,
) -> Inbound:
    control_id: str | None = None
    if header is None:
        codec = codec_name(charset)
        if _is_hl7(data):
            try:
                header = parse_header(data, default_encoding=codec, strict_charset=True)
            except HL7HeaderError as exc:
                raise PayloadRejected(str(exc), exc.condition) from None
        elif hl7_only or _MISPLACED.search(data):
            try:
                parse_header(data, default_encoding=codec)  # raises the reason MLLP gives
            except HL7HeaderError as exc:
                raise PayloadRejected(str(exc), exc.condition) from None
        else:
            segment = _bare_segment(data)
            if segment is not None:
                raise PayloadRejected(
                    f"starts with an HL7 {segment} segment but no MSH: the message's segments "
                    "arrived apart (CRLF segment ends with newline framing?)",
                    _NO_MSH,
                )
    if header is not None and header.text is not None:
        text, codec, control_id = header.text, header.encoding, header.control_id
    else:
        codec = codec_name(charset)
        try:
            text = data.decode("utf-8-sig" if codec == "utf-8" else codec)
        except UnicodeDecodeError as exc:
            raise PayloadRejected(f"undecodable: byte offset {exc.start} is not valid {codec}", _BAD_DATA) from None
    if control_id is not None and len(control_id) > MAX_KEY_CHARS:
        control_id = None
    if not text:
        raise PayloadRejected("empty message", _NO_MSH)
    reason = unstorable(text)
    if reason is not None:
        found = _UNSTORABLE.search(text)
        where = location_at(text, found.start()) if found is not None else None
        raise PayloadRejected(reason, Condition(DATA_TYPE_ERROR, where))
    lane_key: str | None = None
    if lane_of is not None:
        try:
            lane_key = lane_of(text)
        except Exception as exc:
            _log.error(
                "lane_of failed for a message on {connection}: {error}", connection=connection, error=type(exc).__name__
            )
            raise PayloadRejected("internal error: lane key not computable") from None
        if lane_key is not None and (len(lane_key) > MAX_KEY_CHARS or unstorable(lane_key)):
            raise PayloadRejected(f"lane key longer than {MAX_KEY_CHARS} characters or not storable", _BAD_DATA)
    flagged = None
    if conformance is not None:
        try:
            flagged = conformance.check(text)
        except ProfileRefused as exc:
            (first, said), *more = conditions_of(exc.findings)
            raise PayloadRejected(str(exc), first, more, said) from None
    extra = {"message_id": message_id} if message_id is not None else {}
    return Inbound(
        connection=connection,
        payload=text,
        control_id=control_id,
        lane_key=lane_key,
        charset=codec,
        findings=flagged,
        **extra,
    )


def build_batch(
    data: bytes,
    *,
    connection: str,
    charset: str,
    lane_of: LaneOf | None = None,
    batch_id: str | None = None,
    conformance: Conformance | None = None,
) -> InboundBatch:
    """`build_inbound` for bytes already known to be an HL7 batch (`starts_batch`: MLLP tells a
    batch frame apart as it frames it, to answer it whole): its messages, each validated as if sent
    alone; any refusal refuses the batch (`BatchRejected`)."""
    try:
        split = split_batch(data)
    except BatchError as exc:
        raise BatchRejected(str(exc), exc.header, exc.condition) from None
    batch_id = batch_id or new_message_id()
    items: list[Inbound] = []
    n = len(split.messages)
    for seq, message in enumerate(split.messages, 1):
        # Derived from the batch's id: a file's batch id is deterministic, so a re-read after a
        # crash gives the same message ids and stages nothing twice.
        own_id = _member_id(batch_id, seq)
        try:
            items.append(
                _build_one(
                    message,
                    connection=connection,
                    charset=charset,
                    lane_of=lane_of,
                    message_id=own_id,
                    header=None,
                    hl7_only=True,
                    conformance=conformance,
                )
            )
        except PayloadRejected as exc:
            before = split.messages[: seq - 1]
            raise BatchRejected(
                f"message {seq} of {n}: {exc}",
                split.header,
                _in_batch(exc.condition, seq, before),
                [(_in_batch(c, seq, before), text) for c, text in exc.more],
                exc.detail,
            ) from None
    head = split.header
    return InboundBatch(
        connection=connection,
        batch_id=batch_id,
        items=tuple(items),
        fhs_control_id=_key(head.fhs_control_id),
        bhs_control_id=_key(head.bhs_control_id),
        declared=split.declared,
        envelope=head,
    )


def _in_batch(condition: Condition, seq: int, before: Sequence[bytes]) -> Condition:
    """The `seq`-th message's condition as the batch's: its segment counted over the batch
    (`before`: the messages ahead of it)."""
    where = condition.location
    if where is not None:
        where = where.within(seq, earlier=sum(segments_named(m, where.segment) for m in before))
    return Condition(condition.code, where, condition.severity)


def _member_id(batch_id: str, seq: int) -> str:
    return hashlib.sha256(f"{batch_id}\0{seq}".encode()).hexdigest()[:32]


def _key(value: str) -> str | None:
    """A control id as a stored key: None when empty or too long for the column."""
    return value if value and len(value) <= MAX_KEY_CHARS and not unstorable(value) else None


_LEADING = b" \t\r\n"
_MISPLACED = re.compile(rb"[\r\n](?:MSH|FHS|BHS)")


_SEGMENT_START = re.compile(rb"([A-Z][A-Z0-9]{2})\|")
# HL7 v2 segments a message body carries (chapters 2-15, the common ones) and any Z-segment: a
# payload that starts with one of these is a piece of a message. Other "XYZ|" openings stay opaque
# data (a pipe-delimited export of one's own).
_BODY_SEGMENTS = frozenset(
    [
        "ACC",
        "AIG",
        "AIL",
        "AIP",
        "AIS",
        "AL1",
        "ARQ",
        "AUT",
        "BLG",
        "BPO",
        "BPX",
        "BTX",
        "CON",
        "CSR",
        "CTD",
        "CTI",
        "DB1",
        "DG1",
        "DRG",
        "EVN",
        "FT1",
        "GT1",
        "IAM",
        "IN1",
        "IN2",
        "IN3",
        "IPC",
        "MFE",
        "MFI",
        "MRG",
        "MSA",
        "NK1",
        "NTE",
        "OBR",
        "OBX",
        "ODS",
        "ODT",
        "ORC",
        "PD1",
        "PDA",
        "PR1",
        "PRA",
        "PRB",
        "PRD",
        "PV1",
        "PV2",
        "QAK",
        "QPD",
        "QRD",
        "RCP",
        "RDF",
        "RDT",
        "RF1",
        "RGS",
        "RXA",
        "RXC",
        "RXD",
        "RXE",
        "RXG",
        "RXO",
        "RXR",
        "SAC",
        "SCH",
        "SFT",
        "SPM",
        "STF",
        "TQ1",
        "TQ2",
        "TXA",
        "UB1",
        "UB2",
        "ERR",
        "ROL",
        "PID",
    ]
)


def _bare_segment(data: bytes) -> str | None:
    """The id of the HL7 segment `data` starts with (after a BOM and blank lines), if it looks like
    one (``PID|``, ``OBX|``…): such a payload is a piece of a message, not a message of its own.
    MSH, FHS and BHS are not asked about here (they start a message or a batch)."""
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    while start < len(data) and data[start] in _LEADING:
        start += 1
    m = _SEGMENT_START.match(data, start)
    if m is None:
        return None
    segment = m.group(1).decode("ascii")
    return segment if segment in _BODY_SEGMENTS or segment.startswith("Z") else None


def _is_hl7(data: bytes) -> bool:
    """The first segment (after a BOM and blank lines) is MSH."""
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    while start < len(data) and data[start] in _LEADING:
        start += 1
    return data.startswith(b"MSH", start)


def rejection_reason(failure: Failure) -> tuple[str, str]:
    """(reason text safe to send back, ACK code) for a failed submit.

    ``AR`` when the store refused this very row (resending it unchanged cannot help), ``AE`` when
    the message was not stored for a reason of this node or its store (resend later)."""
    if failure.check(RowRefused):
        return str(failure.value), "AR"
    if failure.check(NotLeader):
        return "not leader, resend later", "AE"
    if failure.check(BatchIncomplete):  # says which of its messages are stored
        return str(failure.value), "AE"
    if failure.check(StoreUnavailable):
        return "store unavailable, resend later", "AE"
    if failure.check(IngestRejected):
        return "not stored, resend later", "AE"
    return "internal error, resend later", "AE"
