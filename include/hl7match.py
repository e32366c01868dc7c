"""Routing conditions (`include.conditions`) tested on one message in plain Python, and the short
text form an operator types (`stageline messages find --where 'PID-8 = "F"'`).

The semantics are `spark_jobs/condition_columns.py`'s, which the route stage runs: raw values,
missing and empty both absent, a leaf on an absent value is false (so `not` means what it says),
`segments`/`repetitions` quantify with `any` (one passes) or `all` (one exists and all pass), a
regex is searched. The `regex` package runs the regexes (`re`'s syntax; `include.conditions`
already refused what Java would not take), with a time limit and without holding the GIL: a search
runs inside listenerd's API threads and the Airflow view, where a pattern that backtracks for
ever under `re` would stop every thread of the process — its ACKs and its lease heartbeat too.
A regex still running at the caller's deadline (or after REGEX_SECONDS on one value) raises
RegexTooCostly.

The text form, clauses joined by ` and ` (each `--where` is another clause):

    PID-8 = "F"          PID-8 != "F"          PID-8 in ("F", "U")
    PID-5.1 ~ "^DO"      (a regex, searched)   PV1-2 exists          segment ZPI
    any OBX-8 = "H"      all OBX-11 = "F"      (over every segment of the path's kind)
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable
from functools import cache
from typing import Any

import regex  # type: ignore[import-untyped]  # no stubs; its API is re's plus timeout= and concurrent=

from include.conditions import (
    AllOf,
    Condition,
    ConditionError,
    Connection,
    FhirLeaf,
    Findings,
    Leaf,
    Not,
    SegmentPresent,
    parse_condition,
)
from include.hl7path import FieldPath

_SEGMENTS = re.compile(r"\r\n?|\n")
# A quantified group that holds a quantifier ("(a+)+", "(\w*x)*"): the shape whose backtracking
# grows exponentially with the text; Python's re cannot be stopped once it runs.
_NESTED_QUANTIFIER = re.compile(r"\((?:[^()\\]|\\.)*[+*}](?:[^()\\]|\\.)*\)\s*[+*{?]")
MAX_REGEX_CHARS = 200
_AND = re.compile(r"\s+and\s+")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'')
_OPS = {"=": "eq", "!=": "ne", "~": "regex", "in": "in"}
_IN = re.compile(r"\s*(?P<quantifier>(?:any|all)\s+)?(?P<path>\S+)\s+in\s*\((?P<values>.*)\)\s*", re.DOTALL)


def parse_where(text: str) -> Condition:
    """A condition from the text form (module docstring); ConditionError saying what is wrong."""
    clauses = [c.strip() for c in _clauses(str(text).strip()) if c.strip()]
    if not clauses:
        raise ConditionError("where: empty condition")
    parsed = [_clause(c, where=f"where[{n}]") for n, c in enumerate(clauses)]
    for n, leaf in enumerate(parsed):
        if leaf.get("op") == "regex":
            pattern = str(leaf["value"])
            if len(pattern) > MAX_REGEX_CHARS or _NESTED_QUANTIFIER.search(pattern):
                raise ConditionError(
                    f"where[{n}]: a regex of at most {MAX_REGEX_CHARS} characters without a repeated group that "
                    "repeats inside (such as (a+)+): one body could keep the search busy for ever"
                )
    return parse_condition(parsed[0] if len(parsed) == 1 else {"all": parsed}, where="where")


def _clauses(text: str) -> list[str]:
    """`text` cut at each ` and ` that is not inside a quoted value (`PID-5 = "SMITH and SONS"` is one
    clause): quoted as the clauses themselves are read (shlex, POSIX: `\\"` escapes in double quotes)."""
    quoted = [m.span() for m in _QUOTED.finditer(text)]
    cuts = [m.span() for m in _AND.finditer(text) if not any(a < m.end() and m.start() < b for a, b in quoted)]
    starts = [0, *(end for _, end in cuts)]
    ends = [*(start for start, _ in cuts), len(text)]
    return [text[a:b] for a, b in zip(starts, ends, strict=True)]


def _clause(text: str, *, where: str) -> dict[str, Any]:
    usage = f'{where}: expected PATH = "VALUE" (or !=, ~, in (...), exists, segment SEG), got {text!r}'
    listed = _IN.fullmatch(text)
    try:
        if listed is not None:  # PATH in ("A", "B"): the values between the parentheses
            lexer = shlex.shlex(listed["values"], posix=True)
            lexer.whitespace += ","
            lexer.whitespace_split = True
            words = [*(listed["quantifier"] or "").split(), listed["path"], "in", *lexer]
        else:
            words = shlex.split(text)
    except ValueError as exc:
        raise ConditionError(f"{where}: {exc}: {text!r}") from None
    if len(words) == 2 and words[0] == "segment":
        return {"segment": words[1]}
    quantifier = None
    if words and words[0] in ("any", "all"):
        quantifier, words = words[0], words[1:]
    if len(words) == 2 and words[1] == "exists":
        leaf: dict[str, Any] = {"field": words[0], "op": "exists"}
    elif len(words) >= 3 and words[1] in _OPS and (words[1] == "in") == (listed is not None):
        values = words[2:]
        if words[1] != "in" and len(values) != 1:
            raise ConditionError(usage)
        leaf = {"field": words[0], "op": _OPS[words[1]], "value": values if words[1] == "in" else values[0]}
    else:
        raise ConditionError(usage)
    if quantifier is not None:
        leaf["segments"] = quantifier
    return leaf


REGEX_SECONDS = 1.0
"""The most one regex may take on one value, whatever the caller's deadline."""


class RegexTooCostly(ValueError):
    """A condition's regex ran past its time: the search stops with this instead of freezing."""


def matches(
    cond: Condition, message: str | None, connection: str | None = None, *, deadline: float | None = None
) -> bool:
    """Does `message` (received on `connection`) satisfy `cond`? Never raises on content, only
    RegexTooCostly when a regex runs past `deadline` (time.monotonic()) or REGEX_SECONDS."""
    if isinstance(cond, Connection):
        if connection is None:
            return False
        if cond.op == "eq":
            return connection == cond.value
        if cond.op == "in":
            return connection in (cond.value or ())
        return _searched(str(cond.value), connection, deadline)
    if isinstance(cond, Not):
        return not matches(cond.condition, message, connection, deadline=deadline)
    if isinstance(cond, AllOf):
        return all(matches(c, message, connection, deadline=deadline) for c in cond.conditions)
    if isinstance(cond, (Leaf, SegmentPresent)):
        seps = _separators(message)
        if seps is None or message is None:
            return False
        segments = [s for s in _SEGMENTS.split(message.lstrip("\r\n")) if s]
        if isinstance(cond, SegmentPresent):
            return any(_is_segment(s, cond.segment, seps[0]) for s in segments)
        return _leaf(cond, segments, seps, deadline)
    if isinstance(cond, (FhirLeaf, Findings)):
        return False  # `where` searches HL7 v2 (parse_condition refuses fhir and findings leaves there)
    return any(matches(c, message, connection, deadline=deadline) for c in cond.conditions)  # AnyOf


def _separators(message: str | None) -> tuple[str, str, str, str] | None:
    """(field, component, repetition, subcomponent) separators from MSH, or None: not HL7."""
    if not message:
        return None
    text = message.lstrip("\r\n")
    if not text.startswith("MSH") or len(text) < 4:
        return None
    fs = text[3]
    enc = (text[4:].split(fs, 1)[0] + "\0\0\0\0")[:4]
    return fs, enc[0], enc[1], enc[3]


def _is_segment(segment: str, name: str, fs: str) -> bool:
    return segment == name or segment.startswith(name + fs)


def _leaf(cond: Leaf, segments: list[str], seps: tuple[str, str, str, str], deadline: float | None) -> bool:
    fs, cs, rs, ss = seps
    path = cond.path
    test = _test(cond, deadline)

    def in_segment(segment: str) -> bool:
        if path.segment == "MSH" and path.field == 1:
            return test(segment[3:4])
        fields = segment.split(fs)
        position = path.field - 1 if path.segment == "MSH" else path.field
        field = fields[position] if position < len(fields) else None
        if field is None or (path.segment == "MSH" and path.field == 2):
            return test(field)
        reps = field.split(rs) if rs != "\0" else [field]
        if cond.repetitions is not None:
            return _quantified(cond.repetitions, reps, lambda rep: test(_descend(rep, path, cs, ss)))
        index = (path.repetition or 1) - 1
        return test(_descend(reps[index], path, cs, ss) if index < len(reps) else None)

    matching = [s for s in segments if _is_segment(s, path.segment, fs)]
    if cond.segments is not None:
        return _quantified(cond.segments, matching, in_segment)
    return path.occurrence <= len(matching) and in_segment(matching[path.occurrence - 1])


def _descend(rep: str, path: FieldPath, cs: str, ss: str) -> str | None:
    value: str | None = rep
    if path.component is not None and value is not None:
        parts = value.split(cs) if cs != "\0" else [value]
        value = parts[path.component - 1] if path.component <= len(parts) else None
        if path.subcomponent is not None and value is not None:
            subs = value.split(ss) if ss != "\0" else [value]
            value = subs[path.subcomponent - 1] if path.subcomponent <= len(subs) else None
    return value


def _quantified(quantifier: str, items: list[str], test: Callable[[str], bool]) -> bool:
    if quantifier == "any":
        return any(test(i) for i in items)
    return bool(items) and all(test(i) for i in items)


def _test(cond: Leaf, deadline: float | None) -> Callable[[str | None], bool]:
    def test(value: str | None) -> bool:
        if not value:
            return False
        if cond.op == "eq":
            return value == cond.value
        if cond.op == "ne":
            return value != cond.value
        if cond.op == "in":
            return value in (cond.value or ())
        if cond.op == "regex":
            return _searched(str(cond.value), value, deadline)
        return True  # exists

    return test


def _searched(pattern: str, value: str, deadline: float | None) -> bool:
    """`pattern` searched in `value` within the time left (at most REGEX_SECONDS), the GIL released."""
    left = max(REGEX_SECONDS if deadline is None else min(REGEX_SECONDS, deadline - time.monotonic()), 0.001)
    try:
        return _regex(pattern).search(value, timeout=left, concurrent=True) is not None
    except TimeoutError:
        raise RegexTooCostly(
            f"a regex of the condition ran past {left:.3g} s on one value and was stopped: simplify it "
            "(no alternatives or repeats that can match the same text in more than one way)"
        ) from None


@cache
def _regex(pattern: str) -> Any:
    return regex.compile(pattern)
