"""A whole-segment regex per segment id that matches only a segment its field rules find nothing
in: the common case costs one `fullmatch` in C instead of a Python loop over the rules.

Each rule becomes a pattern that accepts a subset of what `check` accepts (dates are exact but for
29 February, which is left to `check`); a segment the pattern refuses goes through `check`, which
finds what is wrong — or nothing, when the pattern was only stricter. So the answer never depends
on which path ran. Built for the default separators (``|^~\\&``); a message with others takes the
rule loop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from include.profiles.field_rule import FieldRule

__all__ = ["segment_patterns"]

F, C, R, S = "\\|", "\\^", "~", "&"
_DATE = (
    "\\d{4}(?:(?:0[13578]|1[02])(?:0[1-9]|[12]\\d|3[01])|(?:0[469]|11)(?:0[1-9]|[12]\\d|30)|02(?:0[1-9]|1\\d|2[0-8]))"
)
_TIME = "(?:(?:[01]\\d|2[0-3])(?:[0-5]\\d(?:[0-5]\\d(?:\\.\\d{1,4})?)?)?)?"
_ZONE = "(?:[+-](?:0\\d|1[0-4])[0-5]\\d)?"
_FORMATS = {
    "DT": f"(?:\\d{{4}}(?:0[1-9]|1[0-2])?|{_DATE})",
    "DTM": f"(?:\\d{{4}}(?:0[1-9]|1[0-2])?{_ZONE}|{_DATE}{_TIME}{_ZONE})",
    "NM": "[+-]?(?:\\d+\\.?\\d*|\\.\\d+)",
    "SI": "\\d{1,4}",
}
_FORMATS["TS"] = _FORMATS["DTM"]


def segment_patterns(rules: Mapping[str, tuple[FieldRule, ...]]) -> dict[str, re.Pattern[str]]:
    """Segment id → the compiled pattern of a segment its rules accept (default separators)."""
    return {sid: re.compile(_segment(sid, found)) for sid, found in rules.items() if found}


def _segment(sid: str, rules: tuple[FieldRule, ...]) -> str:
    by_field = {r.field: r for r in rules}
    last = max(by_field)
    first = 3 if sid == "MSH" else 1
    head = f"MSH{F}[^|]*" if sid == "MSH" else sid

    def tail(i: int) -> str:
        if i > last:
            return f"(?:{F}.*)?"
        rule = by_field.get(i)
        body = F + (_field(rule) if rule is not None else "[^|]*") + tail(i + 1)
        needed = any(r.usage == "R" and r.field >= i for r in rules)
        return f"(?:{body})" + ("" if needed else "?")

    return head + tail(first)


def _field(rule: FieldRule) -> str:
    if rule.usage == "X":
        return '(?:"")?'
    rep = _repetition(rule)
    reps = f"{rep}(?:{R}{rep})*" if rule.repeat else rep
    if rule.usage == "R":
        return f'(?!""(?:{F}|$))(?=[^|]){reps}'
    return f'(?:""(?={F}|$)|{reps})'


def _repetition(rule: FieldRule) -> str:
    """One repetition: empty, or what the rule accepts (within its length)."""
    limit = f"(?=[^|~]{{1,{rule.length}}}(?![^|~]))" if rule.length is not None else "(?=[^|~])"
    if not rule.composite:
        core = _FORMATS.get(rule.type) or (_one_of(rule.values) if rule.values is not None else "[^|~]*")
        return f"(?:{limit}{core})?"
    formatted = dict(rule.formatted)
    needed = max([*formatted, *rule.required_components, 1])
    parts = []
    for c in range(1, needed + 1):
        part = "[^|~^]*"
        if c in formatted:
            sub = f"(?:{S}[^|~^]*)?" if formatted[c] == "TS" else ""
            part = f"(?:{_FORMATS[formatted[c]]}{sub})?"
        if c == 1 and rule.values is not None:
            part = f"(?:{_one_of(rule.values)})?"
        if c in rule.required_components:
            part = f'(?!""(?:[|~^]|$))(?=[^|~^]){part}'
        parts.append(part)
    last_required = max(rule.required_components, default=0)  # components up to it must be there
    inner = f"(?:{C}[^|~]*)?"  # the components after the last one with a rule
    for c in range(needed, 1, -1):
        inner = f"(?:{C}{parts[c - 1]}{inner})" + ("" if c <= last_required else "?")
    body = parts[0] + inner
    return f"(?:{limit}{body})?"


def _one_of(values: frozenset[str]) -> str:
    return "|".join(re.escape(v) for v in sorted(values, key=len, reverse=True))
