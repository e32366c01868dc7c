"""What a negative ACK says went wrong and where: HL7 table 0357 codes and ERR-2 locations.

A refusal is only useful to the sender's analyst if it names the rule and the spot, so every
refusal in listenerd carries an `Condition`: the 0357 code (101 for an empty MSH-10, 103 for an
MSH-18 or MSH-15 outside its table, 207 only for the engine's own faults) and, when there is one,
the `Location` (segment, its occurrence, field, component) that the ACK writes to ERR-2 (v2.5+) or
ERR-1 (v2.1-2.4). The text stays the reason the transports already send (MSA-3, ERR-8, HTTP JSON).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DATA_TYPE_ERROR",
    "ERROR_TEXT",
    "INTERNAL",
    "INTERNAL_ERROR",
    "REQUIRED_FIELD_MISSING",
    "SEGMENT_SEQUENCE_ERROR",
    "TABLE_VALUE_NOT_FOUND",
    "UNSUPPORTED_MESSAGE_TYPE",
    "Condition",
    "Location",
    "location_at",
    "segments_named",
]

SEGMENT_SEQUENCE_ERROR = "100"
REQUIRED_FIELD_MISSING = "101"
DATA_TYPE_ERROR = "102"
TABLE_VALUE_NOT_FOUND = "103"
UNSUPPORTED_MESSAGE_TYPE = "200"
INTERNAL_ERROR = "207"

#: HL7 table 0357, message error condition codes (v2.5.1).
ERROR_TEXT: dict[str, str] = {
    "0": "Message accepted",
    "100": "Segment sequence error",
    "101": "Required field missing",
    "102": "Data type error",
    "103": "Table value not found",
    "200": "Unsupported message type",
    "201": "Unsupported event code",
    "202": "Unsupported processing id",
    "203": "Unsupported version id",
    "204": "Unknown key identifier",
    "205": "Duplicate key identifier",
    "206": "Application record locked",
    "207": "Application internal error",
}


@dataclass(frozen=True, slots=True)
class Location:
    """An ERL (ERR-2): segment id, which occurrence of that segment (1 = the first), field, and
    optionally the field's repetition and component. ``MSH^1^10`` is the first MSH's MSH-10;
    ``PID^1^5^1^2`` the second component of PID-5's first repetition."""

    segment: str
    sequence: int = 1
    field: int | None = None
    component: int | None = None
    repetition: int = 1

    def components(self) -> list[str]:
        """ERL-1.. as text: segment, sequence, field, repetition and component, the last two only
        when they say more than "the first" (trailing empty parts are left out)."""
        parts = [self.segment, str(self.sequence)]
        if self.field is not None:
            parts.append(str(self.field))
            if self.component is not None or self.repetition > 1:
                parts.append(str(self.repetition))
            if self.component is not None:
                parts.append(str(self.component))
        return parts

    def text(self, component_separator: str = "^") -> str:
        return component_separator.join(self.components())

    def within(self, sequence: int, *, earlier: int = 0) -> Location:
        """The same place in the `sequence`-th message of a batch, counted over the batch: the nth
        MSH for an MSH field; for any other segment, its occurrence in its message plus the
        `earlier` segments with its id in the messages before it."""
        own = sequence if self.segment == "MSH" else self.sequence + earlier
        return Location(self.segment, own, self.field, self.component, self.repetition)


@dataclass(frozen=True, slots=True)
class Condition:
    """One refusal's HL7 error: table 0357 ``code``, where (None: not one place), severity (table
    0516: E error, W warning, I information)."""

    code: str = INTERNAL_ERROR
    location: Location | None = None
    severity: str = "E"

    @property
    def text(self) -> str:
        return ERROR_TEXT.get(self.code, "Error")


INTERNAL = Condition()
"""The engine's own fault (store down, overload, timeout, a bug): 207, no location."""


def location_at(text: str, offset: int) -> Location | None:
    """Where character `offset` of a message's `text` is: its segment (and the how-many-th of that
    id), field and component, for a refusal that found something at an offset (a NUL). Only called
    on a refusal, so it may read the message once."""
    if not (0 <= offset < len(text)) or not text.startswith("MSH") or len(text) < 8:
        return None
    fs, cs, rs = text[3], text[4], text[5]
    start = max(text.rfind("\r", 0, offset), text.rfind("\n", 0, offset)) + 1
    segment_id = text[start : start + 3]
    if len(segment_id) < 3 or not segment_id.isalnum():
        return None
    sequence = 1
    probe = 0
    while True:  # the how-many-th segment with this id (counted over the segments before it)
        probe = text.find(segment_id, probe, start)
        if probe < 0:
            break
        if probe == 0 or text[probe - 1] in "\r\n":
            sequence += 1
        probe += 3
    before = text[start:offset]
    field = before.count(fs)
    if segment_id == "MSH":
        field += 1  # MSH-1 is the separator itself
    if field == 0:
        return Location(segment_id, sequence)
    if segment_id == "MSH" and field <= 2:
        return Location(segment_id, sequence, field)  # MSH-1/MSH-2 hold the separators themselves
    last_field = before[before.rfind(fs) + 1 :]
    repetition = last_field.count(rs) + 1
    component = last_field[last_field.rfind(rs) + 1 :].count(cs) + 1
    return Location(segment_id, sequence, field, component if component > 1 else None, repetition)


def segments_named(message: bytes, segment: str) -> int:
    """How many segments of `message` have the id `segment` (a batch refusal counts the ones in the
    messages before the one at fault; only called on a refusal)."""
    return len(re.findall(rb"(?:^|[\r\n])" + re.escape(segment.encode("ascii")) + rb"(?![A-Za-z0-9])", message))
