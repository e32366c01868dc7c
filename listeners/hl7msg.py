"""Minimal HL7 v2 header (MSH) parsing straight from the bytes a listener received.

The listener only needs the header: to validate the message enough to ACK it, to pick the
charset for the ACK and to echo MSH-10 in MSA-2. Full parsing happens later, off the reactor.
Field values are returned *raw* (still HL7-escaped) so an ACK built with the same separators
echoes them byte-for-byte.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import string
from dataclasses import dataclass, field
from enum import StrEnum

from include.accept_ack import ACCEPT_ACK_TYPES, accept_ack_type
from include.charsets import HL7_CHARSETS, charset_to_codec, codec_for
from listeners.hl7errors import (
    DATA_TYPE_ERROR,
    REQUIRED_FIELD_MISSING,
    SEGMENT_SEQUENCE_ERROR,
    TABLE_VALUE_NOT_FOUND,
    Condition,
    Location,
)

__all__ = [
    "ACCEPT_ACK_TYPES",
    "HL7_CHARSETS",
    "MAX_CONTROL_ID_CHARS",
    "HL7Header",
    "HL7HeaderError",
    "HeaderErrorReason",
    "charset_to_codec",
    "parse_header",
]

# HL7 table 0211 lives in include/charsets.py (the one allowlist, shared with the config check and
# the HTTP inbound); re-exported here for compatibility.
# Separators must be printable ASCII punctuation: never alphanumeric, space or a control char.
_SEPARATOR_BYTES = frozenset(string.punctuation.encode("ascii"))
_LEADING_NOISE = b" \t\r\n"
_UTF8_BOM = codecs.BOM_UTF8

MAX_CONTROL_ID_CHARS = 199
"""The longest MSH-10 accepted (HL7 v2.7's length; the stored control_id column holds 199). A
longer one is refused with AR and not echoed, so no ACK carries a sender's 50 KB field back."""


class HeaderErrorReason(StrEnum):
    """Machine-readable reason a header was rejected (goes into logs, metrics and ERR)."""

    NO_MSH = "no_msh"
    MSH_NOT_FIRST = "msh_not_first"
    BAD_FIELD_SEPARATOR = "bad_field_separator"
    BAD_ENCODING_CHARACTERS = "bad_encoding_characters"
    DUPLICATE_ENCODING_CHARACTERS = "duplicate_encoding_characters"
    MISSING_CONTROL_ID = "missing_control_id"
    CONTROL_ID_TOO_LONG = "control_id_too_long"
    UNKNOWN_CHARSET = "unknown_charset"
    UNDECODABLE = "undecodable"
    UNKNOWN_ACCEPT_ACK_TYPE = "unknown_accept_ack_type"


_MSH = "MSH"
#: What each header refusal tells the sender in ERR: the table 0357 code and the field at fault.
_CONDITIONS: dict[HeaderErrorReason, Condition] = {
    HeaderErrorReason.NO_MSH: Condition(SEGMENT_SEQUENCE_ERROR, Location(_MSH)),
    HeaderErrorReason.MSH_NOT_FIRST: Condition(SEGMENT_SEQUENCE_ERROR, Location(_MSH)),
    HeaderErrorReason.BAD_FIELD_SEPARATOR: Condition(DATA_TYPE_ERROR, Location(_MSH, 1, 1)),
    HeaderErrorReason.BAD_ENCODING_CHARACTERS: Condition(DATA_TYPE_ERROR, Location(_MSH, 1, 2)),
    HeaderErrorReason.DUPLICATE_ENCODING_CHARACTERS: Condition(DATA_TYPE_ERROR, Location(_MSH, 1, 2)),
    HeaderErrorReason.MISSING_CONTROL_ID: Condition(REQUIRED_FIELD_MISSING, Location(_MSH, 1, 10)),
    HeaderErrorReason.CONTROL_ID_TOO_LONG: Condition(DATA_TYPE_ERROR, Location(_MSH, 1, 10)),
    HeaderErrorReason.UNKNOWN_CHARSET: Condition(TABLE_VALUE_NOT_FOUND, Location(_MSH, 1, 18)),
    HeaderErrorReason.UNDECODABLE: Condition(DATA_TYPE_ERROR),
    HeaderErrorReason.UNKNOWN_ACCEPT_ACK_TYPE: Condition(TABLE_VALUE_NOT_FOUND, Location(_MSH, 1, 15)),
}


class HL7HeaderError(ValueError):
    """The bytes do not carry a usable MSH header; the message must be rejected (AR).

    ``str(error)`` never contains message content, only the reason and a short detail, so it
    is safe to log and to send back in an ERR segment.
    """

    def __init__(
        self, reason: HeaderErrorReason, detail: str = "", *, control_id: str = "", header: HL7Header | None = None
    ) -> None:
        self.reason = reason
        self.detail = detail
        # MSH-10 when it could still be read (plain ASCII) although the header as a whole could
        # not: the reject then names the message, so the sender can correlate it.
        self.control_id = control_id
        # What of the header could be read once MSH-1/MSH-2 were (None before that): the refusal is
        # then answered like any other message — addressed back, in its version and charset, and
        # in the acknowledgment mode its MSH-15/16 ask for (docs/listenerd.md).
        self.header = header
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)

    @property
    def condition(self) -> Condition:
        """The ERR this refusal gets: table 0357 code and location."""
        return _CONDITIONS[self.reason]


@dataclass(frozen=True, slots=True)
class HL7Header:
    """The MSH fields a listener needs; values are raw (not unescaped) field text."""

    field_separator: str
    encoding_characters: str
    sending_application: str
    sending_facility: str
    receiving_application: str
    receiving_facility: str
    message_type: str
    control_id: str
    processing_id: str
    version: str
    charset: str
    encoding: str  # Python codec used to decode the message (and encode its ACK)
    text: str | None = field(default=None, repr=False, compare=False)  # the decoded message (complete parses)
    # MSH-15 and MSH-16 (table 0155), stripped; None when both are empty (original mode). One
    # field, not two: a header is built per message and each field costs its constructor a call.
    ack_types: tuple[str, str] | None = None

    @classmethod
    def of_fields(
        cls, msh: list[str], *, field_separator: str, encoding_characters: str, encoding: str, text: str | None = None
    ) -> HL7Header:
        """The header an MSH segment's fields give: ``msh[n - 1]`` is MSH-n (MSH-1 being the
        separator itself), a field past the end is empty."""
        f = msh if len(msh) >= 18 else [*msh, *[""] * (18 - len(msh))]
        return cls(
            field_separator=field_separator,
            encoding_characters=encoding_characters,
            sending_application=f[2],
            sending_facility=f[3],
            receiving_application=f[4],
            receiving_facility=f[5],
            message_type=f[8],
            control_id=f[9],
            processing_id=f[10],
            version=f[11],
            charset=f[17],
            encoding=encoding,
            text=text,
            ack_types=(f[14].strip(), f[15].strip()) if f[14] or f[15] else None,
        )

    @property
    def accept_ack_type(self) -> str:
        """MSH-15 (AL, NE, ER, SU, or empty)."""
        return self.ack_types[0] if self.ack_types else ""

    @property
    def application_ack_type(self) -> str:
        """MSH-16; listenerd never sends an application ACK, it only tells the mode."""
        return self.ack_types[1] if self.ack_types else ""

    @property
    def enhanced_mode(self) -> bool:
        """MSH-15 or MSH-16 is valued: the sender wants enhanced-mode (commit) acknowledgments."""
        return self.ack_types is not None and any(self.ack_types)

    @property
    def component_separator(self) -> str:
        return self.encoding_characters[0]

    @property
    def repetition_separator(self) -> str:
        return self.encoding_characters[1]

    @property
    def escape_character(self) -> str:
        return self.encoding_characters[2]

    @property
    def subcomponent_separator(self) -> str:
        return self.encoding_characters[3]

    @property
    def truncation_character(self) -> str | None:
        """The v2.7+ truncation character, or None when MSH-2 has only four characters."""
        return self.encoding_characters[4] if len(self.encoding_characters) > 4 else None

    @property
    def message_code(self) -> str:
        """MSH-9.1, e.g. ``ADT``."""
        return self.message_type.split(self.component_separator)[0]

    @property
    def trigger_event(self) -> str:
        """MSH-9.2, e.g. ``A01``; empty when absent."""
        parts = self.message_type.split(self.component_separator)
        return parts[1] if len(parts) > 1 else ""

    @property
    def version_id(self) -> str:
        """MSH-12.1, e.g. ``2.5.1``."""
        return self.version.split(self.component_separator)[0].strip()


def parse_header(
    data: bytes,
    *,
    default_encoding: str = "utf_8",
    strict_charset: bool = True,
    complete: bool = True,
) -> HL7Header:
    """Parse the MSH segment of one message.

    :param data: the message bytes as framed by MLLP.
    :param default_encoding: codec used when MSH-18 is empty (and, with
        ``strict_charset=False``, when MSH-18 is unknown).
    :param strict_charset: reject an unknown MSH-18 instead of falling back to the default.
    :param complete: True for a whole message: all of it is decoded so undecodable bytes
        anywhere are caught now rather than in a later stage. False for the first bytes of an
        oversize frame: only MSH is decoded, and a final field cut off by the truncation is
        dropped rather than read as a value.
    :raises HL7HeaderError: when no usable header can be read.
    """
    if _allowed_codec(default_encoding) is None:  # only table 0211's decoders run over a message
        shown = "".join(c for c in str(default_encoding)[:24] if c.isprintable())
        raise HL7HeaderError(HeaderErrorReason.UNKNOWN_CHARSET, f"charset {shown!r} unsupported")
    start = _find_msh(data)
    fs_byte = _field_separator(data, start)
    # MSH-1/MSH-2 are checked once per distinct opening (a sender uses one): the check reads only
    # these bytes, so its result is theirs.
    opening = data[start + 3 : start + 11]
    enc_chars = _OPENINGS.get(opening)
    if enc_chars is None:
        try:
            enc_chars = _encoding_characters(data, start, fs_byte)
        except HL7HeaderError as exc:  # a bad MSH-2 still leaves MSH-10 readable: name the message
            end = _segment_end(data, start)
            seg = data[start:] if end < 0 else data[start:end]
            if end < 0 and not complete:  # a field cut off by the truncation is not a control id
                seg = seg[: seg.rfind(fs_byte)]
            raw_fields = seg.split(bytes([fs_byte]))
            exc.control_id = _ascii_control_id(raw_fields)
            exc.header = _addressing(raw_fields)
            raise
        if len(_OPENINGS) < _MAX_CACHED:
            _OPENINGS[opening] = enc_chars
    fs = chr(fs_byte)
    repetition = enc_chars[1]

    seg_end = _segment_end(data, start)
    truncated = seg_end < 0 and not complete
    raw_seg = data[start:] if seg_end < 0 else data[start:seg_end]
    if truncated:
        # Only whole fields count: drop everything after the last field separator.
        raw_seg = raw_seg[: raw_seg.rfind(fs_byte)]

    # First guess of the charset from a byte-level split. In double-byte charsets (Big5,
    # GB 18030, JIS) a trail byte may equal the field separator, which only ever adds fields,
    # so MSH-18 is the first known charset name from byte-field 18 on. The guess is
    # re-checked on the decoded text below.
    raw_fields = raw_seg.split(bytes([fs_byte]))
    try:
        guess = _charset_guess(raw_fields)
        encoding = _resolve_codec_cached(guess, repetition, default_encoding, strict_charset)
        body = data[start:] if complete else raw_seg
        for _attempt in range(2):
            text = _decode(body, encoding)
            fields = _split_msh(text, fs)
            charset = _field(fields, 18)
            resolved = _resolve_codec_cached(charset, repetition, default_encoding, strict_charset)
            if _codec_name(resolved) == _codec_name(encoding):
                break
            encoding = resolved
        else:
            raise HL7HeaderError(HeaderErrorReason.UNDECODABLE, "MSH-18 differs once decoded")
    except HL7HeaderError as exc:
        exc.control_id = _ascii_control_id(raw_fields)
        exc.header = _ascii_header(raw_fields, fs, enc_chars, exact_split=_splits_exactly(raw_seg, fs_byte))
        raise

    control_id = _field(fields, 10)
    codec = _codec_name(encoding)
    if not control_id.strip():
        raise HL7HeaderError(
            HeaderErrorReason.MISSING_CONTROL_ID,
            # (an oversize frame's first bytes may end before MSH-10: it is not empty, only unread)
            f"MSH-10 lies beyond the first {len(data)} bytes read"
            if truncated and len(fields) < 10
            else "MSH-10 is empty",
            header=HL7Header.of_fields(fields, field_separator=fs, encoding_characters=enc_chars, encoding=codec),
        )
    if len(control_id) > MAX_CONTROL_ID_CHARS:  # refused, and not echoed: an ACK stays small
        unechoed = [*fields[:9], "", *fields[10:]]
        raise HL7HeaderError(
            HeaderErrorReason.CONTROL_ID_TOO_LONG,
            f"MSH-10 is {len(control_id)} characters, limit {MAX_CONTROL_ID_CHARS}",
            header=HL7Header.of_fields(unechoed, field_separator=fs, encoding_characters=enc_chars, encoding=codec),
        )
    accept = fields[14] if len(fields) > 14 else ""
    if accept_ack_type(accept) is None:  # the sender reads it the same way (include/accept_ack.py)
        shown = "".join(c for c in accept[:8] if c.isprintable())
        raise HL7HeaderError(
            HeaderErrorReason.UNKNOWN_ACCEPT_ACK_TYPE,
            f"MSH-15 {shown!r} is not in table 0155 (AL, NE, ER, SU)",
            control_id=control_id,
            header=HL7Header.of_fields(fields, field_separator=fs, encoding_characters=enc_chars, encoding=codec),
        )
    return HL7Header.of_fields(
        fields, field_separator=fs, encoding_characters=enc_chars, encoding=codec, text=text if complete else None
    )


_DEFAULT_SEPARATORS = frozenset("|^~\\&")


def _addressing(raw_fields: list[bytes]) -> HL7Header:
    """The header a message with unreadable encoding characters (MSH-2) still shows: its sender,
    receiver, type, MSH-10, processing id and version where they are plain ASCII with none of the
    default separators the answer must use (they cannot be escaped: their own escape character is
    what is unknown). Original mode: with MSH-2 in doubt, MSH-15 is not trusted."""
    fields = ["MSH", "^~\\&"]
    for raw in raw_fields[2:12]:
        text = raw.decode("ascii") if raw.isascii() else ""
        fields.append(text if text.isprintable() and not _DEFAULT_SEPARATORS & set(text) else "")
    if len(fields) > 9 and len(fields[9]) > MAX_CONTROL_ID_CHARS:
        fields[9] = ""
    header = HL7Header.of_fields(fields, field_separator="|", encoding_characters="^~\\&", encoding="ascii")
    return dataclasses.replace(header, ack_types=None)


def _ascii_header(
    raw_fields: list[bytes], fs: str, encoding_characters: str, *, exact_split: bool = False
) -> HL7Header:
    """The header a message whose charset failed still shows: its MSH fields up to the first one
    holding a byte outside ASCII (before it, no charset can have moved a field boundary: a double-
    byte character's trail byte only follows a lead byte above 0x7F), the rest empty. With
    `exact_split` (no separator can be a character's trail byte, `_splits_exactly`: the byte split
    is the field split) every field that is ASCII is kept and only the others are
    emptied, so MSH-10 and MSH-15/16 behind a stray byte in MSH-3 still count. Its ACK is ASCII and
    names no charset; an MSH-10 too long to echo is left out."""
    fields: list[str] = []
    for raw in raw_fields:
        if not raw.isascii():
            if not exact_split:
                break
            fields.append("")
            continue
        fields.append(raw.decode("ascii"))
    if len(fields) > 9 and len(fields[9]) > MAX_CONTROL_ID_CHARS:
        fields[9] = ""
    fields = fields[:17]  # MSH-18 named a charset that failed: the ACK names none
    return HL7Header.of_fields(fields, field_separator=fs, encoding_characters=encoding_characters, encoding="ascii")


def _splits_exactly(segment: bytes, fs: int) -> bool:
    """True when no byte above 0x7F stands right before a field separator: then no double-byte
    character can have a separator for its trail byte (its lead byte is above 0x7F), whatever the
    charset, and the byte split is the field split."""
    return not any(b > 0x7F for b in (segment[i - 1] for i in _positions(segment, fs) if i > 0))


def _positions(data: bytes, byte: int) -> list[int]:
    found, at = [], data.find(byte)
    while at >= 0:
        found.append(at)
        at = data.find(byte, at + 1)
    return found


def _ascii_control_id(raw_fields: list[bytes]) -> str:
    """MSH-10 from the byte-level split, if it and every field before it are ASCII (a double-byte
    character's trail byte may equal the separator and move the fields after it) and it is
    printable."""
    if len(raw_fields) <= 9 or not all(f.isascii() for f in raw_fields[:9]):
        return ""
    raw = raw_fields[9]
    if not raw or not all(0x20 <= b < 0x7F for b in raw) or len(raw) > 199:
        return ""
    return raw.decode("ascii").strip()


def _find_msh(data: bytes) -> int:
    start = 0
    if data.startswith(_UTF8_BOM):
        start = len(_UTF8_BOM)
    while start < len(data) and data[start] in _LEADING_NOISE:
        start += 1
    if data.startswith(b"MSH", start):
        return start
    if b"\rMSH" in data or b"\nMSH" in data:
        raise HL7HeaderError(HeaderErrorReason.MSH_NOT_FIRST, "MSH is not the first segment")
    if start == len(data):
        raise HL7HeaderError(HeaderErrorReason.NO_MSH, "empty message")
    raise HL7HeaderError(HeaderErrorReason.NO_MSH, "no MSH segment")


def _field_separator(data: bytes, start: int) -> int:
    if len(data) <= start + 3:
        raise HL7HeaderError(HeaderErrorReason.BAD_FIELD_SEPARATOR, "MSH-1 missing")
    fs = data[start + 3]
    if fs not in _SEPARATOR_BYTES:
        raise HL7HeaderError(HeaderErrorReason.BAD_FIELD_SEPARATOR, "MSH-1 must be ASCII punctuation")
    return fs


def _encoding_characters(data: bytes, start: int, fs: int) -> str:
    end = start + 4
    limit = min(len(data), start + 10)  # never scan far: MSH-2 is at most 5 characters
    while end < limit and data[end] != fs and data[end] not in b"\r\n":
        end += 1
    enc = data[start + 4 : end]
    overlong = end == limit and end < len(data) and data[end] not in (fs, 0x0D, 0x0A)
    if len(enc) not in (4, 5) or overlong:
        raise HL7HeaderError(HeaderErrorReason.BAD_ENCODING_CHARACTERS, "MSH-2 must be 4 or 5 characters")
    if any(b not in _SEPARATOR_BYTES for b in enc):
        raise HL7HeaderError(HeaderErrorReason.BAD_ENCODING_CHARACTERS, "MSH-2 must be ASCII punctuation")
    if len(set(enc) | {fs}) != len(enc) + 1:
        raise HL7HeaderError(
            HeaderErrorReason.DUPLICATE_ENCODING_CHARACTERS,
            "MSH-1/MSH-2 characters must be distinct",
        )
    return enc.decode("ascii")


def _segment_end(data: bytes, start: int) -> int:
    cr = data.find(b"\r", start)
    lf = data.find(b"\n", start)
    if cr < 0:
        return lf
    return cr if lf < 0 else min(cr, lf)


def _charset_guess(raw_fields: list[bytes]) -> str:
    # raw_fields[0] is "MSH"; MSH-1 is the separator itself, so MSH-n is raw_fields[n - 1].
    candidates = [f.decode("ascii", "replace") for f in raw_fields[17:]]
    for candidate in candidates:
        if candidate.strip() and codec_for(candidate.strip()) is not None:
            return candidate
    return candidates[0] if candidates else ""


def _split_msh(text: str, fs: str) -> list[str]:
    cr = text.find("\r")
    lf = text.find("\n")
    ends = [i for i in (cr, lf) if i >= 0]
    segment = text[: min(ends)] if ends else text
    return segment.split(fs)


def _field(fields: list[str], n: int) -> str:
    return fields[n - 1] if len(fields) >= n else ""


def _resolve_codec(charset: str, repetition: str, default: str, strict: bool) -> str:
    # The whole value first: a charset name such as "8859/1" may itself contain a character
    # the sender uses as a separator. Otherwise the first repetition is the message charset.
    # Table 0211 values and the Python aliases of their codecs (``latin-1``, ``utf8``), the same
    # allowlist as an HTTP Content-Type and the config (`include.charsets.codec_for`).
    codec = codec_for(charset)
    if codec is not None:
        return codec
    first = charset.split(repetition)[0].strip()
    if not first:
        return default
    codec = codec_for(first)
    if codec is not None:
        return codec
    if strict:
        # Only a short, sanitised charset name goes into the detail, never message text.
        shown = "".join(c for c in first[:24] if c.isprintable())
        raise HL7HeaderError(HeaderErrorReason.UNKNOWN_CHARSET, f"MSH-18 {shown!r} unsupported")
    return default


# Per-message lookups answered once: bounded, since their keys come from the senders.
_MAX_CACHED = 256
_OPENINGS: dict[bytes, str] = {}  # MSH-1.. bytes -> MSH-2, for openings that passed the check
_resolve_codec_cached = functools.lru_cache(maxsize=_MAX_CACHED)(_resolve_codec)  # raising calls are not kept


_allowed_codec = functools.lru_cache(maxsize=64)(codec_for)


@functools.lru_cache(maxsize=64)
def _codec_name(encoding: str) -> str:
    return codecs.lookup(encoding).name


def _decode(data: bytes, encoding: str) -> str:
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise HL7HeaderError(
            HeaderErrorReason.UNDECODABLE,
            f"byte offset {exc.start} is not valid {codecs.lookup(encoding).name}",
        ) from None
