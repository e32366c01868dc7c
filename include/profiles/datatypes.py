"""The HL7 v2.5.1 data types a profile may name, and what a value of each must look like.

Only the primitive types that have a format are checked character by character (DT, DTM, TS's
first component, NM, SI); the others (ST, TX, FT, ID, IS…) take any text, and ID/IS are tested
against their value set instead. A composite type is checked component by component: for each
component whose type has a format, that component's text (its first subcomponent when the
component is itself composite) must have it.
"""

from __future__ import annotations

import re

__all__ = ["COMPOSITES", "FORMATTED", "PRIMITIVES", "TYPES", "bad_primitive", "components_of"]

_DATE = r"(\d{4})(?:(\d{2})(?:(\d{2}))?)?"
_DT = re.compile(_DATE)
_DTM = re.compile(r"(\d{4})(?:(\d{2})(?:(\d{2})(?:(\d{2})(?:(\d{2})(?:(\d{2})(?:\.\d{1,4})?)?)?)?)?)?([+-]\d{4})?")
_NM = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
_SI = re.compile(r"\d{1,4}")

PRIMITIVES = frozenset({"ST", "TX", "FT", "ID", "IS", "DT", "DTM", "TM", "NM", "SI", "GTS", "TN"})
"""Types without components."""

COMPOSITES: dict[str, tuple[str, ...]] = {
    # component n's type is [n - 1]; only the formatted ones matter to the check
    "TS": ("DTM", "ID"),
    "DR": ("TS", "TS"),
    "CX": ("ST", "ST", "ID", "HD", "ID", "HD", "DT", "DT", "CWE", "CWE"),
    "XPN": ("FN", "ST", "ST", "ST", "ST", "IS", "ID", "ID", "CE", "DR", "ID", "TS", "TS", "ST"),
    "XCN": ("ST", "FN", "ST", "ST", "ST", "ST", "IS", "IS", "HD", "ID", "ST", "ID", "ID", "HD"),
    "XAD": ("SAD", "ST", "ST", "ST", "ST", "ID", "ID", "ST", "IS", "IS", "ID", "DR", "TS", "TS"),
    "XTN": ("ST", "ID", "ID", "ST", "NM", "NM", "NM", "NM", "ST", "ST", "ST", "ST"),
    "XON": ("ST", "IS", "NM", "NM", "ID", "HD", "ID", "HD", "ID", "ST"),
    "CE": ("ST", "ST", "ID", "ST", "ST", "ID"),
    "CWE": ("ST", "ST", "ID", "ST", "ST", "ID", "ST", "ST", "ST"),
    "CNE": ("ST", "ST", "ID", "ST", "ST", "ID", "ST", "ST", "ST"),
    "HD": ("IS", "ST", "ID"),
    "EI": ("ST", "IS", "ST", "ID"),
    "EIP": ("EI", "EI"),
    "MSG": ("ID", "ID", "ID"),
    "PT": ("ID", "ID"),
    "VID": ("ID", "CE", "CE"),
    "PL": ("IS", "IS", "IS", "HD", "IS", "IS", "IS", "HD", "ST", "EI", "IS"),
    "CQ": ("NM", "CE"),
    "FN": ("ST", "ST", "ST", "ST", "ST"),
    "SAD": ("ST", "ST", "ST"),
    "DLD": ("IS", "TS"),
    "FC": ("IS", "TS"),
    "JCC": ("IS", "IS", "TX"),
    "PRL": ("CE", "ST", "TX"),
    "SN": ("ST", "NM", "ST", "NM"),
    "MOC": ("MO", "CE"),
    "MO": ("NM", "ID"),
    "TQ": ("CQ", "RI", "ST", "TS", "TS", "ST", "ST", "TX", "ST", "ST", "TS", "NM"),
    "RI": ("IS", "ST"),
    "ELD": ("ST", "NM", "NM", "CE"),
    "ERL": ("ST", "NM", "NM", "NM", "NM", "NM"),
    "PRT": ("EI", "ST", "IS", "IS"),
    "DLN": ("ST", "IS", "DT"),
    "CP": ("MO", "ID", "NM", "NM", "CE", "ID"),
    "SPS": ("CWE", "TX", "TX", "CWE", "CWE", "CWE", "CWE"),
    "NDL": ("CNN", "TS", "TS", "IS", "IS", "IS", "IS", "IS", "HD", "IS", "IS"),
    "CNN": ("ST", "ST", "ST", "ST", "ST", "ST", "IS", "IS", "IS", "ST", "ID"),
    "DLT": ("NR", "NM", "ID", "NM"),
    "NR": ("NM", "NM"),
    "ED": ("HD", "ID", "ID", "ID", "TX"),
    "RP": ("ST", "HD", "ID", "ID"),
    "VARIES": (),
}
"""Composite types, by their components' types."""

TYPES = PRIMITIVES | COMPOSITES.keys()
"""Every type a profile may name."""

_FORMATTED = {"DT": _DT, "DTM": _DTM, "NM": _NM, "SI": _SI}
FORMATTED = frozenset({"DT", "DTM", "TS", "NM", "SI"})
"""The types whose values have a format to check (TS: its first component, a DTM)."""


def components_of(kind: str) -> tuple[str, ...]:
    """A composite type's components' types (empty for a primitive)."""
    return COMPOSITES.get(kind, ())


def bad_primitive(kind: str, value: str) -> str | None:
    """Why `value` is not a valid `kind` (a short reason without the value: no PHI), or None.
    Types without a format (and composites, checked by component) always pass here."""
    if kind == "TS":
        kind = "DTM"
    pattern = _FORMATTED.get(kind)
    if pattern is None:
        return None
    m = pattern.fullmatch(value)
    if m is None:
        return _EXPECTED[kind]
    if kind in ("DT", "DTM"):
        return _bad_date(m.groups())
    return None


_EXPECTED = {
    "DT": "not a date (YYYY[MM[DD]])",
    "DTM": "not a date/time (YYYY[MM[DD[HH[MM[SS[.S]]]]]][+/-ZZZZ])",
    "NM": "not a number",
    "SI": "not a sequence number (1-4 digits)",
}


def _bad_date(parts: tuple[str | None, ...]) -> str | None:
    """Range checks of a DT/DTM's matched parts: month 1-12, day within the month, hour < 24…"""
    year, month, day = (int(p) if p else None for p in parts[:3])
    if month is not None and not 1 <= month <= 12:
        return "month out of range"
    if day is not None and month is not None and year is not None:
        leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        days = (31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)[month - 1]
        if not 1 <= day <= days:
            return "day out of range"
    limits = (24, 60, 60)
    for part, limit in zip(parts[3:6], limits, strict=False):
        if part is not None and int(part) >= limit:
            return "time out of range"
    zone = parts[6] if len(parts) > 6 else None
    if zone is not None and (int(zone[1:3]) > 14 or int(zone[3:5]) >= 60):
        return "time zone out of range"
    return None
