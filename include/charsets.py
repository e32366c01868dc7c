"""The character sets Stageline decodes: HL7 table 0211, and nothing a client can choose beyond it.

A charset named by a sender (MSH-18, an HTTP ``Content-Type``) or by the config picks a decoder
that runs over every byte of a message. Python's codec registry also holds codecs that are not
character sets at all (``punycode``, quadratic in its input; ``base64``, ``zlib``, ``rot13``, which
do not give text), so a name is accepted only when it is in HL7 table 0211 or is an alias of one
of the codecs that table maps to. Every codec here is a linear C decoder.

UTF-16/32 and bare "UNICODE" are left out on purpose: they are not ASCII-compatible, so MLLP's
0x0B/0x1C framing bytes can occur inside characters and the message cannot be framed safely.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["ALLOWED_CODECS", "HL7_CHARSETS", "charset_to_codec", "codec_for"]

#: HL7 table 0211 value (upper case, single spaces) -> canonical Python codec name.
HL7_CHARSETS: Mapping[str, str] = MappingProxyType(
    {
        "ASCII": "ascii",
        "ISO IR6": "ascii",
        "8859/1": "iso8859-1",
        "ISO IR100": "iso8859-1",
        "8859/2": "iso8859-2",
        "8859/3": "iso8859-3",
        "8859/4": "iso8859-4",
        "8859/5": "iso8859-5",
        "8859/6": "iso8859-6",
        "8859/7": "iso8859-7",
        "8859/8": "iso8859-8",
        "8859/9": "iso8859-9",
        "8859/15": "iso8859-15",
        "ISO IR87": "iso2022_jp",
        "ISO IR159": "iso2022_jp_1",
        "GB 18030-2000": "gb18030",
        "KS X 1001": "euc_kr",
        "BIG-5": "big5",
        "UNICODE UTF-8": "utf-8",
        # Not in table 0211 but sent by many real senders; harmless to accept.
        "UTF-8": "utf-8",
    }
)

#: The canonical codec names (as `codecs.lookup(...).name` gives them) a charset may resolve to.
ALLOWED_CODECS: frozenset[str] = frozenset(codecs.lookup(c).name for c in HL7_CHARSETS.values())


def charset_to_codec(charset: str) -> str | None:
    """An HL7 MSH-18 value's Python codec, or None if it is not in table 0211."""
    return HL7_CHARSETS.get(" ".join(charset.split()).upper())


def codec_for(name: str) -> str | None:
    """The canonical codec for a table-0211 value or a Python alias of an allowed codec; else None.

    ``"8859/1"``, ``"latin-1"`` and ``"ISO-8859-1"`` all give ``"iso8859-1"``; ``"punycode"``,
    ``"base64"`` and ``"klingon"`` give None.
    """
    if not isinstance(name, str) or len(name) > 40:
        return None
    hl7 = charset_to_codec(name)
    if hl7 is not None:
        return codecs.lookup(hl7).name
    try:
        canonical = codecs.lookup(name.strip()).name
    except (LookupError, ValueError):  # ValueError: a NUL in the name (found by tests/fuzz)
        return None
    return canonical if canonical in ALLOWED_CODECS else None
