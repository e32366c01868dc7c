"""Build HL7 v2 ACK messages (bytes) for inbound headers: original mode (AA/AE/AR) or, when the
sender valued MSH-15/MSH-16, enhanced mode's commit ACK (CA/CE/CR) as MSH-15 asks (`accept_code`).

The ACK reuses the inbound message's separators, version and charset so the sender's parser
reads it the way it reads its own messages. Values echoed from the inbound MSH are raw
(already escaped with the same separators); text we author (reasons, our own identity) is
escaped here, so nothing we write can break the ACK's structure.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING

from twisted.logger import Logger

from listeners.hl7errors import ERROR_TEXT, Condition, Location
from listeners.hl7msg import HL7Header

if TYPE_CHECKING:
    from listeners.hl7batch import BatchHeader

__all__ = [
    "DEFAULT_ENCODING_CHARACTERS",
    "ERROR_TEXT",
    "AckCode",
    "AckDecision",
    "accept_code",
    "batch_header",
    "build_ack",
    "build_ack_batch",
    "build_fallback_ack",
    "commit_code",
    "escape",
    "message_header",
    "minimal_ack",
    "new_control_id",
]

_log = Logger(namespace="stageline.ack")

DEFAULT_FIELD_SEPARATOR = "|"
DEFAULT_ENCODING_CHARACTERS = "^~\\&"
MAX_REASON_CHARS = 200


class AckCode(StrEnum):
    """MSA-1 acknowledgment codes (table 0008): original mode AA/AE/AR, enhanced mode's commit
    ACK CA/CE/CR."""

    AA = "AA"
    AE = "AE"
    AR = "AR"
    CA = "CA"
    CE = "CE"
    CR = "CR"


_COMMIT = {AckCode.AA: AckCode.CA, AckCode.AE: AckCode.CE, AckCode.AR: AckCode.CR}


def _positive(code: AckCode) -> bool:
    # Identity, not a set lookup: hashing an enum member runs Python code, and this is per ACK.
    return code is AckCode.AA or code is AckCode.CA


def commit_code(code: AckCode) -> AckCode:
    """Enhanced mode's commit ACK for a handler's AA/AE/AR: CA/CE/CR (a commit code as is)."""
    return _COMMIT.get(code, code)


def accept_code(header: HL7Header, code: AckCode) -> AckCode | None:
    """The MSA-1 to answer `code` (a handler's AA/AE/AR) with under the sender's acknowledgment
    mode, or None when MSH-15 asks for no answer to it.

    Original mode (MSH-15 and MSH-16 empty): `code` itself. Enhanced mode: the commit ACK (CA, CE,
    CR), sent as MSH-15 says: AL (or empty) always, NE never, ER only for CE/CR, SU only for CA.
    """
    types = header.ack_types
    if types is None or not (types[0] or types[1]):
        return code
    accept = types[0]
    commit = code
    if code is AckCode.AA:  # (identity, not `_COMMIT`: an enum member hashes in Python code)
        commit = AckCode.CA
    elif code is AckCode.AE or code is AckCode.AR:
        commit = _COMMIT[code]
    if accept == "NE" or (accept == "ER" and commit is AckCode.CA) or (accept == "SU" and commit is not AckCode.CA):
        return None
    return commit


@dataclass(frozen=True, slots=True)
class AckDecision:
    """What a message handler decided; only an explicit ``AA`` ever produces a positive ACK."""

    code: AckCode
    reason: str = ""
    error_code: str = "207"  # HL7 table 0357 (`listeners.hl7errors`)
    location: Location | None = None  # ERR-2: where the fault is
    more: tuple[tuple[Condition, str], ...] = ()  # further ERRs (a profile's findings): condition, text
    detail: str = ""  # the first ERR's own ERR-8 when it is not `reason` (a profile's first finding)

    def __post_init__(self) -> None:
        # Coerce "AA" -> AckCode.AA and refuse anything else early, in the handler's frame. A handler
        # decides in original-mode terms; the commit codes are `accept_code`'s to choose.
        code = AckCode(self.code)
        if code not in _COMMIT:
            raise ValueError(f"a handler decides AA, AE or AR, not {code.value}")
        object.__setattr__(self, "code", code)

    @classmethod
    def accept(cls) -> AckDecision:
        return ACCEPT

    @classmethod
    def error(cls, reason: str, *, error_code: str = "207", location: Location | None = None) -> AckDecision:
        return cls(AckCode.AE, reason, error_code, location)

    @classmethod
    def reject(
        cls,
        reason: str,
        *,
        error_code: str = "207",
        location: Location | None = None,
        more: tuple[tuple[Condition, str], ...] = (),
        detail: str = "",
    ) -> AckDecision:
        return cls(AckCode.AR, reason, error_code, location, more, detail)


ACCEPT = AckDecision(AckCode.AA)
"""The one positive decision (immutable, so shared rather than built per message)."""


def new_control_id() -> str:
    """A fresh 20-character control id (fits MSH-10's length in every v2 version): 80 random bits
    in hex, as random as the uuid4 prefix it replaces without building a UUID per ACK."""
    return os.urandom(10).hex()


def escape(
    text: str,
    *,
    field_separator: str = DEFAULT_FIELD_SEPARATOR,
    encoding_characters: str = DEFAULT_ENCODING_CHARACTERS,
) -> str:
    """Escape free text for one HL7 field (section 2.7): separators become \\F\\ \\S\\ \\R\\ \\T\\
    \\E\\ (\\P\\ for the v2.7 truncation character); control characters become \\Xhh\\."""
    specials = field_separator + encoding_characters
    if not _CONTROLS.search(text) and not any(ch in text for ch in specials):
        return text  # the common case: nothing to escape
    esc = encoding_characters[2]
    table = {
        field_separator: "F",
        encoding_characters[0]: "S",
        encoding_characters[1]: "R",
        esc: "E",
        encoding_characters[3]: "T",
    }
    if len(encoding_characters) > 4:
        table[encoding_characters[4]] = "P"
    out: list[str] = []
    for ch in text:
        code = table.get(ch)
        if code is not None:
            out.append(f"{esc}{code}{esc}")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"{esc}X{ord(ch):02X}{esc}")
        else:
            out.append(ch)
    return "".join(out)


def build_ack(
    header: HL7Header,
    code: AckCode | str,
    *,
    reason: str = "",
    error_code: str = "207",
    location: Location | None = None,
    sending_application: str | None = None,
    sending_facility: str | None = None,
    control_id: str | None = None,
    now: datetime | None = None,
    more: Sequence[tuple[Condition, str]] = (),
    detail: str = "",
) -> bytes:
    """ACK for ``header``: sender and receiver swapped, MSA-2 = the inbound MSH-10.

    :param code: AA/CA, or AE/AR/CE/CR which add an ERR segment: ``error_code`` (table 0357) at
        ``location``, severity E, with ``reason`` as its text (and MSA-3 before v2.7).
    :param sending_application: our MSH-3 (plain text, escaped here); by default the inbound
        MSH-5 is echoed, i.e. the application the sender addressed.
    :param sending_facility: our MSH-4, same rule with the inbound MSH-6.
    :param control_id: the ACK's own MSH-10; a fresh one by default.
    :param now: the ACK's MSH-7; the current UTC time by default.
    :param more: further ERR segments after the first (a profile's findings): each one's
        condition (code, location, severity) and text.
    :param detail: the first ERR's ERR-8 when it is not ``reason`` (MSA-3 summarises a profile's
        findings; each ERR says its own).

    A positive ACK cannot fail: it answers a message already staged, so were anything of the
    header to trip the builder, the answer is still an AA/CA for its MSH-10 (`minimal_ack`), never
    an exception its caller would turn into "not stored".
    """
    ack_code = code if code.__class__ is AckCode else AckCode(code)
    if ack_code is AckCode.AA or ack_code is AckCode.CA:
        try:
            return _build_ack(header, ack_code, "", "207", None, sending_application, sending_facility, control_id, now)
        except Exception as exc:
            _log.critical(
                "ACK for {control_id} built minimal: {error}",
                control_id=_strip_controls(header.control_id)[:64],
                error=type(exc).__name__,
            )
            return minimal_ack(header, ack_code)
    return _build_ack(
        header,
        ack_code,
        reason,
        error_code,
        location,
        sending_application,
        sending_facility,
        control_id,
        now,
        more,
        detail,
    )


def minimal_ack(header: HL7Header, code: AckCode) -> bytes:
    """The least an AA/CA needs: the sender's own separators, MSH-9 ACK, MSH-12 2.5, MSA-2 its
    MSH-10 as sent. Built from plain strings only, so it is what answers a staged message when the
    full builder fails on something of its header."""
    fs = header.field_separator if len(header.field_separator) == 1 else DEFAULT_FIELD_SEPARATOR
    enc = header.encoding_characters or DEFAULT_ENCODING_CHARACTERS
    acked = _strip_controls(header.control_id)
    msh = fs.join(["MSH", enc, "", "", "", "", _timestamp(None, utc_offset="+" not in fs + enc), "", "ACK"])
    text = f"{msh}{fs}{new_control_id()}{fs}P{fs}2.5\rMSA{fs}{code.value}{fs}{acked}\r"
    try:
        return text.encode(header.encoding, errors="replace")
    except LookupError:
        return text.encode("utf-8", errors="replace")


def _build_ack(
    header: HL7Header,
    ack_code: AckCode,
    reason: str,
    error_code: str,
    location: Location | None,
    sending_application: str | None,
    sending_facility: str | None,
    control_id: str | None,
    now: datetime | None,
    more: Sequence[tuple[Condition, str]] = (),
    detail: str = "",
) -> bytes:
    shape = _shape(header, sending_application, sending_facility)
    fs = shape.fs
    # A fresh id is hex (nothing to escape); one given by the caller is escaped like any text.
    own_id = new_control_id() if control_id is None else shape.plain(control_id or new_control_id())
    stamp = _timestamp(now, utc_offset=shape.utc_offset)
    acked = _strip_controls(header.control_id)
    # (literals, not `ack_code.value`: an enum's value is a Python-level property, and this is per ACK)
    positive = "AA" if ack_code is AckCode.AA else "CA" if ack_code is AckCode.CA else None
    if positive is not None:
        text = f"{shape.head}{stamp}{shape.middle}{own_id}{shape.tail}MSA{fs}{positive}{fs}{acked}\r"
    else:
        msa = _msa(ack_code, acked, reason, shape.version, shape.plain, fs)
        err = _err(error_code, detail or reason, shape.version, shape.plain, fs, shape.enc, location)
        for why, said in more:
            err += "\r" + _err(why.code, said, shape.version, shape.plain, fs, shape.enc, why.location, why.severity)
        text = f"{shape.head}{stamp}{shape.middle}{own_id}{shape.tail}{msa}\r{err}\r"
    # "replace" only matters for our own reason text: echoed values came from this charset.
    return text.encode(header.encoding, errors="replace")


@dataclass(frozen=True, slots=True)
class _AckShape:
    """What an ACK to one kind of header looks like around its per-message parts (MSH-7, MSH-10,
    MSA): built once per distinct header shape, not once per message."""

    fs: str
    enc: str
    head: str  # MSH-0 .. MSH-6, then the field separator before MSH-7
    middle: str  # after MSH-7: MSH-8, MSH-9 and the separator before MSH-10
    tail: str  # after MSH-10: MSH-11, MSH-12 (MSH-18), end of segment
    utc_offset: bool
    version: tuple[int, ...]
    plain: Callable[[str], str]


_SHAPES: dict[tuple[str | None, ...], _AckShape] = {}
_MAX_SHAPES = 1024  # distinct sender/receiver/type combinations kept; cleared when exceeded


def _shape(header: HL7Header, sending_application: str | None, sending_facility: str | None) -> _AckShape:
    key = (
        header.field_separator,
        header.encoding_characters,
        header.receiving_application,
        header.receiving_facility,
        header.sending_application,
        header.sending_facility,
        header.message_type,
        header.processing_id,
        header.version,
        header.charset,
        sending_application,
        sending_facility,
    )
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) >= _MAX_SHAPES:
            _SHAPES.clear()
        shape = _SHAPES[key] = _new_shape(header, sending_application, sending_facility)
    return shape


def _new_shape(header: HL7Header, sending_application: str | None, sending_facility: str | None) -> _AckShape:
    fs = header.field_separator
    enc = header.encoding_characters

    def raw(value: str) -> str:
        return _echoed(value, enc[2])

    plain = _escaper(fs, enc)
    app = raw(header.receiving_application)
    if sending_application is not None:
        app = plain(sending_application)
    fac = raw(header.receiving_facility)
    if sending_facility is not None:
        fac = plain(sending_facility)
    trigger = raw(header.trigger_event)
    cs = enc[0]
    message_type = f"ACK{cs}{trigger}{cs}ACK" if trigger else "ACK"
    head = fs.join(["MSH", enc, app, fac, raw(header.sending_application), raw(header.sending_facility), ""])
    tail = ["", raw(header.processing_id), raw(header.version)]
    if header.charset:
        tail += ["", "", "", "", "", raw(header.charset)]
    return _AckShape(
        fs=fs,
        enc=enc,
        head=head,
        middle=fs.join(["", "", message_type, ""]),
        tail=fs.join(tail) + "\r",
        utc_offset="+" not in fs + enc,
        version=_version_tuple(header.version_id),
        plain=plain,
    )


def build_fallback_ack(
    code: AckCode | str = AckCode.AR,
    *,
    reason: str = "",
    error_code: str = "207",
    location: Location | None = None,
    sending_application: str = "",
    sending_facility: str = "",
    version: str = "2.5",
    control_id: str | None = None,
    acked_control_id: str = "",
    now: datetime | None = None,
) -> bytes:
    """ACK for a message whose header could not be read: default separators, ASCII, no receiver,
    MSA-2 = `acked_control_id` (the message's MSH-10 when it was readable, else empty). Normally
    used with AR."""
    ack_code = AckCode(code)
    fs, enc = DEFAULT_FIELD_SEPARATOR, DEFAULT_ENCODING_CHARACTERS
    plain = _escaper(fs, enc)
    msh = [
        "MSH",
        enc,
        plain(sending_application),
        plain(sending_facility),
        "",
        "",
        _timestamp(now),
        "",
        "ACK",
        plain(control_id or new_control_id()),
        "P",
        plain(version),
    ]
    parsed = _version_tuple(version)
    segments = [fs.join(msh), _msa(ack_code, plain(acked_control_id), reason, parsed, plain, fs)]
    if not _positive(ack_code):
        segments.append(_err(error_code, reason, parsed, plain, fs, enc, location))
    text = "".join(segment + "\r" for segment in segments)
    return text.encode("ascii", errors="replace")


def _escaper(fs: str, enc: str) -> Callable[[str], str]:
    def plain(text: str) -> str:
        return escape(text, field_separator=fs, encoding_characters=enc)

    return plain


_CONTROLS = re.compile(r"[\x00-\x1f\x7f]")

MAX_ECHOED_CHARS = 227
"""The most of one inbound header field (MSH-3..6, MSH-9, MSH-11, MSH-12, MSH-18; BHS-3..6) an ACK
echoes: HD's length in v2.5.1, the longest of them. A sender's 50 KB MSH-3 is not sent back."""


def _echoed(value: str, escape_character: str) -> str:
    """`value` as an ACK echoes it: control characters dropped, at most MAX_ECHOED_CHARS, never
    cut inside an escape sequence (an odd escape character left would open one)."""
    value = _strip_controls(value)
    if len(value) <= MAX_ECHOED_CHARS:
        return value
    value = value[:MAX_ECHOED_CHARS]
    if value.count(escape_character) % 2:
        value = value[: value.rindex(escape_character)]
    return value


def _strip_controls(value: str) -> str:
    """Echoed values cannot contain separators (they were split on them) but drop control
    characters anyway: a stray VT/FS would corrupt the MLLP frame around the ACK."""
    if value.isprintable():  # the common case: no control character (they are all unprintable)
        return value
    return _CONTROLS.sub("", value)


def _msa(
    code: AckCode,
    control_id: str,
    reason: str,
    version: tuple[int, ...],
    plain: Callable[[str], str],
    fs: str,
) -> str:
    fields = ["MSA", code.value, control_id]
    # MSA-3 (text message) was withdrawn in v2.7 but older senders still display it.
    if not _positive(code) and reason and version < (2, 7):
        fields.append(plain(reason[:MAX_REASON_CHARS]))
    return fs.join(fields)


def _err(
    error_code: str,
    reason: str,
    version: tuple[int, ...],
    plain: Callable[[str], str],
    fs: str,
    enc: str,
    location: Location | None,
    severity: str = "E",
) -> str:
    code = plain(error_code)
    code_text = plain(ERROR_TEXT.get(error_code, "Error"))
    message = plain(reason[:MAX_REASON_CHARS])
    cs = enc[0]
    # A location's parts are a segment id and numbers: escaped only if one is anything else.
    where = [p if p.isalnum() else plain(p) for p in location.components()] if location is not None else []
    if version and version < (2, 5):
        # v2.1-2.4: ERR-1 (ELD) = segment^sequence^field^code&text&table
        sub = enc[3]
        text = message or code_text
        eld = (where + ["", "", ""])[:3]
        return fs.join(["ERR", cs.join([*eld, f"{code}{sub}{text}{sub}HL70357"])])
    # v2.5+: ERR-2 location (ERL), ERR-3 HL7 error code (CWE), ERR-4 severity (table 0516), ERR-8 user message
    return fs.join(["ERR", "", cs.join(where), f"{code}{cs}{code_text}{cs}HL70357", severity, "", "", "", message])


def _timestamp(now: datetime | None, *, utc_offset: bool = True) -> str:
    """MSH-7 in UTC. The "+0000" offset is left out when "+" is one of the message's
    separators: it would split the field."""
    if now is None:
        stamp = _now_stamp()
    else:
        moment = now if now.tzinfo is not None else now.replace(tzinfo=UTC)
        stamp = moment.astimezone(UTC).strftime("%Y%m%d%H%M%S")
    return stamp + ("+0000" if utc_offset else "")


_stamp_cache: tuple[int, str] = (0, "")


def _now_stamp() -> str:
    """The current second, formatted once per second (an ACK per message would strftime each)."""
    global _stamp_cache
    second = int(time.time())
    if _stamp_cache[0] != second:
        _stamp_cache = (second, datetime.fromtimestamp(second, UTC).strftime("%Y%m%d%H%M%S"))
    return _stamp_cache[1]


MAX_VERSION_PIECE = 4
"""Digits read per piece of a version (MSH-12.1): "2.5.1" has pieces of one; a longer run is no
version HL7 has, and `int` of a few thousand digits raises."""


def _version_tuple(version: str) -> tuple[int, ...]:
    """(2, 5, 1) for "2.5.1": only ASCII digits count (`str.isdigit` takes "²", which `int`
    refuses), and only pieces of at most MAX_VERSION_PIECE of them; reading stops at the first other."""
    parts: list[int] = []
    for piece in version.strip().split("."):
        if not (piece.isascii() and piece.isdigit() and len(piece) <= MAX_VERSION_PIECE):
            break
        parts.append(int(piece))
    return tuple(parts)


# -- batches (HL7 v2 section 2.10.3) ----------------------------------------------------------------


def batch_header(
    envelope: BatchHeader,
    *,
    first_message: str = "",
    encoding: str = "ascii",
) -> HL7Header:
    """An `HL7Header` standing for a whole batch, so `build_ack` can answer it: the envelope's
    separators and addressing (BHS-3..6, else FHS-3..6), MSA-2 = its control id (BHS-11 of its
    one batch, else FHS-11), processing id, version and charset from its first message (MSH-11,
    MSH-12, MSH-18) when it has one."""
    msh = _msh_fields(first_message)
    return HL7Header(
        field_separator=envelope.field_separator,
        encoding_characters=envelope.encoding_characters,
        sending_application=envelope.sending_application,
        sending_facility=envelope.sending_facility,
        receiving_application=envelope.receiving_application,
        receiving_facility=envelope.receiving_facility,
        message_type="",
        control_id=envelope.control_id,
        processing_id=_nth(msh, 11) or "P",
        version=_nth(msh, 12) or "2.5",
        charset=_nth(msh, 18),
        encoding=encoding,
    )


def message_header(text: str, *, encoding: str) -> HL7Header:
    """The `HL7Header` of one staged message's text (a batch member, already validated), to
    answer it inside an ACK batch."""
    msh = _msh_fields(text)
    return HL7Header.of_fields(
        msh,
        field_separator=text[3] if len(text) > 3 else DEFAULT_FIELD_SEPARATOR,
        encoding_characters=_nth(msh, 2) or DEFAULT_ENCODING_CHARACTERS,
        encoding=encoding,
    )


def build_ack_batch(
    envelope: HL7Header,
    acks: list[bytes],
    *,
    sending_application: str | None = None,
    sending_facility: str | None = None,
    now: datetime | None = None,
) -> bytes:
    """An ACK batch: ``BHS`` (addressed back to the sender, BHS-12 = the batch's control id),
    one ACK per message in the order received, ``BTS`` with their count."""
    fs, enc = envelope.field_separator, envelope.encoding_characters
    plain = _escaper(fs, enc)

    def raw(value: str) -> str:
        return _echoed(value, enc[2])

    app = plain(sending_application) if sending_application is not None else raw(envelope.receiving_application)
    fac = plain(sending_facility) if sending_facility is not None else raw(envelope.receiving_facility)
    bhs = fs.join(
        [
            "BHS",
            enc,
            app,
            fac,
            raw(envelope.sending_application),
            raw(envelope.sending_facility),
            _timestamp(now, utc_offset="+" not in fs + enc),
            "",
            "",
            "",
            new_control_id(),
            _strip_controls(envelope.control_id),
        ]
    )
    head = f"{bhs}\r".encode(envelope.encoding, errors="replace")
    tail = f"BTS{fs}{len(acks)}\r".encode(envelope.encoding, errors="replace")
    return head + b"".join(acks) + tail


def _msh_fields(text: str) -> list[str]:
    if not text.startswith("MSH") or len(text) < 4:
        return []
    end = min((i for i in (text.find("\r"), text.find("\n")) if i >= 0), default=len(text))
    return ["MSH", *text[3:end].split(text[3])[1:]] if text[3] else []


def _nth(msh: list[str], n: int) -> str:
    """MSH-n from `_msh_fields` (MSH-1 is the separator itself, so MSH-n is msh[n - 1])."""
    return msh[n - 1] if n >= 2 and len(msh) >= n else ""
