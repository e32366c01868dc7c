"""MSH-15 (accept acknowledgment type, HL7 table 0155) read ONE way, by listenerd and the MLLP sender.

A receiver honours MSH-15 only when it reads the value it knows; the sender must read it no more
loosely, or it stops waiting for an ACK the receiver will send (or refuses to send). So a value
counts only when, spaces around it aside, it is exactly `AL`, `NE`, `ER` or `SU`: `ne`, `NE~AL`,
`NE^X` or `\\E\\NE` are no table value — listenerd refuses them (`103` at `MSH^1^15`), and the
sender treats them as "wait for the ACK".
"""

from __future__ import annotations

__all__ = ["ACCEPT_ACK_TYPES", "accept_ack_type", "msh_field"]

ACCEPT_ACK_TYPES = frozenset({"AL", "NE", "ER", "SU"})
"""HL7 table 0155 (accept / application acknowledgment conditions)."""


def accept_ack_type(field: str) -> str | None:
    """The table 0155 value MSH-15 holds ("AL", "NE", "ER", "SU"), "" when it is empty, None when
    it holds anything else (the caller refuses it, or waits for the ACK)."""
    value = field.strip()
    if not value:
        return ""
    return value if value in ACCEPT_ACK_TYPES else None


def msh_field(text: str, n: int) -> str:
    """MSH-n of a message as sent (raw: not unescaped, repetitions and components kept): its MSH
    segment ends at the first CR or LF, as listenerd reads it; "" when the field is absent."""
    if not text.startswith("MSH") or len(text) < 4:
        return ""
    fs = text[3]
    end = min((i for i in (text.find("\r"), text.find("\n")) if i >= 0), default=len(text))
    fields = text[:end].split(fs)  # fields[0] "MSH", fields[1] MSH-2: MSH-n is fields[n - 1]
    return fields[n - 1] if n >= 2 and len(fields) >= n else ""
