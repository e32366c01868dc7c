"""What every transport (MLLP, TCP, HTTP, file drop) counts as valid inbound input, decided once.

Each transport frames bytes its own way, then calls :func:`build_inbound`: decode (MSH-18, else the
connection's charset), refuse what no store can hold, compute the lane key, build the `Inbound`
row. A refusal is a :class:`PayloadRejected` whose text is safe to log and to send back; the
transport answers it with its "rejected" answer (MLLP ``AR``, TCP ``NAK``, HTTP 400, file moved to
``rejected/``) for that message alone. :func:`rejection_reason` maps a failed commit to the answer
the same way for all of them (invariant 9, docs/invariants.md).
"""
from __future__ import annotations

import codecs
import re
from typing import Callable, Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.hl7path import parse_path
from include.hl7path import value as hl7_value
from listeners.hl7msg import HL7Header, HL7HeaderError, parse_header
from listeners.ingest import Inbound, IngestRejected, NotLeader, RowRefused, StoreUnavailable

__all__ = [
    "MAX_KEY_CHARS",
    "IngestSink",
    "LaneOf",
    "PayloadRejected",
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

    def submit(self, item: Inbound) -> Deferred[str]: ...


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
    """The bytes cannot be staged; ``str()`` is safe to log and to send back (no content)."""


def codec_name(charset: str) -> str:
    """The canonical Python codec for a configured or declared charset; ValueError if unknown."""
    try:
        return codecs.lookup(charset).name
    except LookupError:
        raise ValueError(f"unknown charset {charset[:40]!r}") from None


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


def build_inbound(data: bytes, *, connection: str, charset: str, lane_of: LaneOf | None = None,
                  message_id: str | None = None, header: HL7Header | None = None) -> Inbound:
    """Decode one received message into an `Inbound`, or raise `PayloadRejected`.

    An HL7 v2 payload (one whose MSH parses) is decoded with its MSH-18 charset when it declares
    a known one, else with ``charset``, and gives control_id = MSH-10; any other payload is
    decoded with ``charset`` and has no control id. ``header`` is the transport's own complete
    parse (MLLP requires one), reused rather than parsed twice. Text the store cannot hold is
    refused here, so it never reaches (and never fails) a group commit.
    """
    control_id: str | None = None
    if header is not None and header.text is not None:
        text, codec, control_id = header.text, header.encoding, header.control_id
    else:
        codec = codec_name(charset)
        try:
            parsed = parse_header(data, default_encoding=codec, strict_charset=False)
        except HL7HeaderError:
            pass  # not HL7 (allowed on tcp/file/http), or unreadable MSH: treat as opaque text
        else:
            codec, control_id = parsed.encoding, parsed.control_id
        try:
            text = data.decode("utf-8-sig" if codec == "utf-8" else codec)
        except UnicodeDecodeError as exc:
            raise PayloadRejected(f"undecodable: byte offset {exc.start} is not valid {codec}") from None
    if control_id is not None and len(control_id) > MAX_KEY_CHARS:
        control_id = None
    if not text:
        raise PayloadRejected("empty message")
    reason = unstorable(text)
    if reason is not None:
        raise PayloadRejected(reason)
    lane_key: str | None = None
    if lane_of is not None:
        try:
            lane_key = lane_of(text)
        except Exception as exc:
            _log.error("lane_of failed for a message on {connection}: {error}",
                       connection=connection, error=type(exc).__name__)
            raise PayloadRejected("internal error: lane key not computable") from None
        if lane_key is not None and (len(lane_key) > MAX_KEY_CHARS or unstorable(lane_key)):
            raise PayloadRejected(f"lane key longer than {MAX_KEY_CHARS} characters or not storable")
    extra = {"message_id": message_id} if message_id is not None else {}
    return Inbound(connection=connection, payload=text, control_id=control_id, lane_key=lane_key,
                   charset=codec, **extra)


def rejection_reason(failure: Failure) -> tuple[str, str]:
    """(reason text safe to send back, ACK code) for a failed submit.

    ``AR`` when the store refused this very row (resending it unchanged cannot help), ``AE`` when
    the message was not stored for a reason of this node or its store (resend later)."""
    if failure.check(RowRefused):
        return str(failure.value), "AR"
    if failure.check(NotLeader):
        return "not leader, resend later", "AE"
    if failure.check(StoreUnavailable):
        return "store unavailable, resend later", "AE"
    if failure.check(IngestRejected):
        return "not stored, resend later", "AE"
    return "internal error, resend later", "AE"
