"""What every sender shares: the result of a send, the payload's codec and error text fit for a row.

A `DeliveryResult` lands in `stage_outbound.last_error` and the audit trail, so its detail is
clipped and printable, and it never carries the message body.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

from include.hl7path import value as hl7_value

__all__ = ["DEFAULT_CONTENT_TYPE", "DeliveryResult", "describe_error", "payload_codec", "printable"]

DEFAULT_CONTENT_TYPE = "application/hl7-v2"
MAX_DETAIL_CHARS = 500

# HL7 table 0211 (MSH-18) → Python codec; the same table the listener accepts.
_HL7_CHARSETS: dict[str, str] = {
    "ASCII": "ascii",
    "ISO IR6": "ascii",
    "8859/1": "iso8859_1",
    "ISO IR100": "iso8859_1",
    "8859/2": "iso8859_2",
    "8859/3": "iso8859_3",
    "8859/4": "iso8859_4",
    "8859/5": "iso8859_5",
    "8859/6": "iso8859_6",
    "8859/7": "iso8859_7",
    "8859/8": "iso8859_8",
    "8859/9": "iso8859_9",
    "8859/15": "iso8859_15",
    "ISO IR87": "iso2022_jp",
    "ISO IR159": "iso2022_jp_1",
    "GB 18030-2000": "gb18030",
    "KS X 1001": "euc_kr",
    "BIG-5": "big5",
    "UNICODE UTF-8": "utf_8",
    "UTF-8": "utf_8",
}


@dataclass(frozen=True)
class DeliveryResult:
    """The outcome of one send. `retryable` only matters when `ok` is false."""

    ok: bool
    retryable: bool
    detail: str

    @classmethod
    def success(cls, detail: str) -> DeliveryResult:
        return cls(True, False, _clip(detail))

    @classmethod
    def retry(cls, detail: str) -> DeliveryResult:
        return cls(False, True, _clip(detail))

    @classmethod
    def permanent(cls, detail: str) -> DeliveryResult:
        return cls(False, False, _clip(detail))


def payload_codec(payload: str, content_type: str | None) -> str:
    """A charset parameter of the content type wins; else an HL7 message's MSH-18; else UTF-8."""
    for param in (content_type or "").split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip():
            try:
                return codecs.lookup(value.strip().strip('"')).name
            except LookupError:
                break
    charset = hl7_value(payload, "MSH-18")
    if charset:
        repetition = (hl7_value(payload, "MSH-2") or "^~")[1:2] or "~"
        for candidate in (charset, charset.split(repetition)[0]):
            codec = _HL7_CHARSETS.get(" ".join(candidate.split()).upper())
            if codec:
                return codec
    return "utf_8"


def describe_error(exc: BaseException) -> str:
    """`Type: reason` of a failed send, without a traceback."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def printable(text: str) -> str:
    """A peer's text made safe for a log line: control characters blanked, at most 200 characters."""
    return "".join(c if c.isprintable() else " " for c in text).strip()[:200]


def _clip(detail: str) -> str:
    return detail if len(detail) <= MAX_DETAIL_CHARS else detail[: MAX_DETAIL_CHARS - 1] + "…"
