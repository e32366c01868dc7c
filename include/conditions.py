"""The condition grammar: one language for every place a message is tested (a route's `when`, a
transform rule's `when`). Plain data as loaded from TOML/JSON; the reference is docs/rules.md.

    {"field": "MSH-9.1", "op": "eq", "value": "ADT"}                 one HL7 value
    {"field": "OBX-8", "op": "in", "value": ["H", "HH"], "segments": "any"}   any OBX (or "all")
    {"field": "PID-3.5", "op": "eq", "value": "MR", "repetitions": "any"}     any PID-3 repetition
    {"segment": "ZPI"}                                                segment present
    {"connection": "lab-mllp"}   {"connection": ["a", "b"]}   {"connection": "^lab-", "op": "regex"}
    {"fhir": "Patient.gender", "op": "eq", "value": "female"}        a FHIR message (routes only)
    {"findings": 0}   {"findings": 2, "op": "ge"}   {"finding": ["101", "103"]}   profile findings (routes only)
    {"all": [...]}  {"any": [...]}  {"not": {...}}

Field leaves: ``op`` is ``eq`` (a string), ``ne`` (a string; a missing field is not equal),
``in`` (a non-empty list of strings), ``regex`` (a Java regex, searched; Python-only syntax is
refused at load) or ``exists`` (no value). Values are read as :mod:`spark_jobs.hl7_fields` reads
them: raw text, missing and empty are both absent, and a leaf on an absent value is false, never
NULL, so ``not`` means what it says. ``segments``/``repetitions`` quantify over every occurrence
of the segment / every repetition of the field: ``any`` (at least one matches) or ``all`` (at
least one exists and every one matches); the path then names no occurrence / repetition index.

FHIR leaves (a route's `when` only: ``parse_condition(..., fhir=True)``) test a message staged from
FHIR JSON by the FHIR inbound (`listeners.fhir_inbound`, which marks its rows' ``format``
`FHIR_FORMAT`; JSON any other inbound took is never read as FHIR): ``Type.element.element`` names
a resource type and a path of element names into it; the leaf holds when the message is such a
resource, or a Bundle with one among its entries, and any value at that path (every array along it
is walked) passes ``op``.
``{"fhir": "Patient", "op": "exists"}`` tests the resource type alone.

Findings leaves (a route's `when` only, like FHIR leaves) test what a flagging conformance profile
found at ingest (docs/profiles.md): ``findings`` compares their count (``op`` eq — the default —,
ne, gt, ge, lt, le; a message never checked has none), ``finding`` holds when one of them has one
of the table 0357 codes given. The transform stage does not read findings.

Plain Python, no Spark: config load checks conditions without a session. Errors carry where in
the tree the problem is (``when.all[1].not``); the caller prefixes its own location (route,
transform rule) and the config loader the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from include.fhir_types import path_problem
from include.hl7path import FieldPath, FieldPathError, parse_path

__all__ = [
    "FHIR_FORMAT",
    "OPS",
    "QUANTIFIERS",
    "AllOf",
    "AnyOf",
    "Condition",
    "ConditionError",
    "Connection",
    "FhirLeaf",
    "Findings",
    "Leaf",
    "Not",
    "SegmentPresent",
    "check_java_regex",
    "parse_condition",
    "uses_connection",
    "uses_fhir",
    "uses_findings",
]

OPS = ("eq", "ne", "in", "regex", "exists")
FHIR_FORMAT = "fhir"
"""`stage_inbound.format` of a body the FHIR inbound validated: the only rows FHIR leaves read."""
CONNECTION_OPS = ("eq", "in", "regex")
QUANTIFIERS = ("any", "all")

_LEAF_KEYS = frozenset({"field", "op", "value", "segments", "repetitions"})
_FHIR_KEYS = frozenset({"fhir", "op", "value"})
# A resource type, then element names: FHIR's own spelling (``valueQuantity``, ``_birthDate``).
_FHIR_PATH = re.compile(r"[A-Z][A-Za-z]{1,63}(?:\.[a-z_][A-Za-z0-9_]{0,63}){0,8}")
_CONNECTION_KEYS = frozenset({"connection", "op"})
_SEGMENT_ID = re.compile(r"[A-Z][A-Z0-9]{2}")
# Python-only regex syntax that would pass re.compile but make Java's Pattern throw mid-job.
_PYTHON_ONLY_REGEX = re.compile(r"\(\?P|\(\?#|\(\?\(")
_EXPLICIT_OCCURRENCE = re.compile(r"[A-Z0-9]{3}\[")
_EXPLICIT_REPETITION = re.compile(r"-[0-9]+\[")


class ConditionError(ValueError):
    """A condition that cannot be compiled; the message starts with where it is (``when.any[0]``)."""


@dataclass(frozen=True)
class Leaf:
    """Test one HL7 value: ``value`` is a str (eq, ne, regex), a tuple (in) or None (exists).
    ``segments``/``repetitions``: None (the path's own occurrence/repetition), "any" or "all"."""

    path: FieldPath
    op: str
    value: str | tuple[str, ...] | None = None
    segments: str | None = None
    repetitions: str | None = None


@dataclass(frozen=True)
class SegmentPresent:
    """True when the message has at least one ``segment``."""

    segment: str


@dataclass(frozen=True)
class Connection:
    """Test the name of the inbound connection the message arrived on (eq, in, regex)."""

    op: str
    value: str | tuple[str, ...]


@dataclass(frozen=True)
class FhirLeaf:
    """Test a FHIR message: a `resource_type` resource (the message, or a Bundle's entry) with a
    value at `elements` passing `op` (``value`` as for `Leaf`); no elements: the type is there."""

    resource_type: str
    elements: tuple[str, ...]
    op: str
    value: str | tuple[str, ...] | None = None


@dataclass(frozen=True)
class AllOf:
    """True when every member is true."""

    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class AnyOf:
    """True when at least one member is true."""

    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class Not:
    """True when the inner condition is false (including "field missing")."""

    condition: Condition


@dataclass(frozen=True)
class Findings:
    """Test a message's profile findings: their count against ``count`` with ``op`` (eq, ne, gt,
    ge, lt, le), or (``codes``) whether one of them has one of these table 0357 codes."""

    op: str = "eq"
    count: int = 0
    codes: tuple[str, ...] = ()


Condition = Leaf | SegmentPresent | Connection | FhirLeaf | Findings | AllOf | AnyOf | Not
_PARSED = (Leaf, SegmentPresent, Connection, FhirLeaf, Findings, AllOf, AnyOf, Not)
FINDINGS_OPS = ("eq", "ne", "gt", "ge", "lt", "le")
_CODE = re.compile(r"[0-9]{3}")


def parse_condition(cond: Any, *, where: str = "when", fhir: bool = False) -> Condition:
    """Validate one condition tree; ``where`` locates it in errors (``when.all[1].not``).
    ``fhir``: FHIR leaves are allowed (a route's `when`; transforms work on HL7 v2 only)."""

    def fail(problem: str) -> ConditionError:
        return ConditionError(f"{where}: {problem}")

    if isinstance(cond, _PARSED):
        return cond
    if not isinstance(cond, Mapping):
        raise fail(f"condition must be a table/object, got {type(cond).__name__}")
    keys = set(cond)
    if "fhir" in keys:
        if not fhir:
            raise fail("a 'fhir' condition is for a route's when only (transform rules change HL7 v2)")
        unknown = keys - _FHIR_KEYS
        if unknown:
            raise fail(f"unknown key(s) {sorted(map(str, unknown))} in fhir condition (allowed: fhir, op, value)")
        return _parse_fhir(cond, fail)
    if "findings" in keys or "finding" in keys:
        if not fhir:
            raise fail("a findings condition is for a route's when only (the transform stage does not read them)")
        return _parse_findings(cond, fail)
    if "field" in keys or ("op" in keys and "connection" not in keys):
        unknown = keys - _LEAF_KEYS
        if unknown:
            raise fail(
                f"unknown key(s) {sorted(map(str, unknown))} in field condition "
                "(allowed: field, op, value, segments, repetitions)"
            )
        return _parse_leaf(cond, fail)
    if "connection" in keys:
        unknown = keys - _CONNECTION_KEYS
        if unknown:
            raise fail(f"unknown key(s) {sorted(map(str, unknown))} in connection condition (allowed: connection, op)")
        return _parse_connection(cond, fail)
    if "segment" in keys:
        if keys != {"segment"}:
            raise fail(f"a segment condition has only the key 'segment', got {sorted(map(str, keys))}")
        segment = cond["segment"]
        if not isinstance(segment, str) or not _SEGMENT_ID.fullmatch(segment):
            raise fail(
                f"'segment' must be a 3-character segment id (a letter, then upper-case letters or digits), "
                f"got {segment!r}"
            )
        return SegmentPresent(segment)
    if len(keys) != 1 or not keys <= {"all", "any", "not"}:
        raise fail(
            f"expected exactly one of 'field', 'segment', 'connection', 'all', 'any', 'not', got keys "
            f"{sorted(map(str, keys))}"
        )
    (kind,) = keys
    inner = cond[kind]
    if kind == "not":
        return Not(parse_condition(inner, where=f"{where}.not", fhir=fhir))
    if isinstance(inner, (str, bytes, Mapping)) or not isinstance(inner, Sequence):
        raise fail(f"'{kind}' must be a list of conditions, got {type(inner).__name__}")
    if not inner:
        raise fail(f"'{kind}' must not be empty")
    members = tuple(parse_condition(c, where=f"{where}.{kind}[{i}]", fhir=fhir) for i, c in enumerate(inner))
    return AllOf(members) if kind == "all" else AnyOf(members)


def check_java_regex(value: str, fail: Callable[[str], Exception]) -> None:
    """Refuse a regex that Spark's Java ``Pattern`` would throw on mid-job (also for transforms'
    ``replace``): one that does not compile, or that uses Python-only syntax."""
    try:
        re.compile(value)
    except re.error as exc:
        raise fail(f"bad regex {value!r}: {exc}") from None
    if _PYTHON_ONLY_REGEX.search(value):
        raise fail(f"bad regex {value!r}: (?P..), (?#..) and (?(..) are not Java regex syntax")


def _string_list(value: Any) -> TypeGuard[Sequence[str]]:
    return (
        not isinstance(value, (str, bytes, Mapping))
        and isinstance(value, Sequence)
        and bool(value)
        and all(isinstance(v, str) for v in value)
    )


def _parse_leaf(cond: Mapping[str, Any], fail: Callable[[str], ConditionError]) -> Leaf:
    """Validate a ``{"field", "op", "value", "segments", "repetitions"}`` leaf."""
    if "field" not in cond:
        raise fail("field condition needs 'field'")
    raw_path = cond["field"]
    try:
        path = parse_path(raw_path)
    except FieldPathError as exc:
        raise fail(f"bad field path: {exc}") from None
    quantifiers: dict[str, str | None] = {}
    for key, explicit in (("segments", _EXPLICIT_OCCURRENCE), ("repetitions", _EXPLICIT_REPETITION)):
        q = cond.get(key)
        if q is not None and q not in QUANTIFIERS:
            raise fail(f"'{key}' must be 'any' or 'all', got {q!r}")
        if q is not None and explicit.search(raw_path):
            index = "occurrence" if key == "segments" else "repetition"
            raise fail(f"'{key}' covers every {index}: drop the [{index}] index from {raw_path!r}")
        quantifiers[key] = q
    if quantifiers["repetitions"] and path.segment == "MSH" and path.field in (1, 2):
        raise fail("MSH-1 and MSH-2 have no repetitions")
    op, value = _operand(cond, fail)
    return Leaf(path, op, value, segments=quantifiers["segments"], repetitions=quantifiers["repetitions"])


def _operand(
    cond: Mapping[str, Any], fail: Callable[[str], ConditionError]
) -> tuple[str, str | tuple[str, ...] | None]:
    """A leaf's ``op`` and ``value``, checked: (op, a str, a tuple for `in`, None for `exists`)."""
    op = cond.get("op")
    if op not in OPS:
        raise fail(f"unknown op {op!r} (expected one of {', '.join(OPS)})")
    has_value = "value" in cond
    value = cond.get("value")
    if op == "exists":
        if has_value:
            raise fail("op 'exists' takes no value")
        return op, None
    if not has_value:
        raise fail(f"op {op!r} needs a value")
    if op in ("eq", "ne", "regex"):
        if not isinstance(value, str):
            raise fail(f"op {op!r} needs a string value, got {type(value).__name__}")
        if op == "regex":
            check_java_regex(value, fail)
        return op, value
    if not _string_list(value):
        raise fail("op 'in' needs a non-empty list of strings")
    return op, tuple(value)


def _parse_fhir(cond: Mapping[str, Any], fail: Callable[[str], ConditionError]) -> FhirLeaf:
    """Validate a ``{"fhir": "Type.element…", "op", "value"}`` leaf."""
    path = cond["fhir"]
    if not isinstance(path, str) or not _FHIR_PATH.fullmatch(path):
        raise fail(
            "'fhir' must be a resource type and up to 8 element names, e.g. 'Patient.gender' or "
            f"'Observation.code.coding.code', got {path!r}"
        )
    resource_type, *elements = path.split(".")
    problem = path_problem(resource_type, tuple(elements))
    if problem is not None:
        raise fail(f"'fhir' {path!r} can never match: {problem}")
    op, value = _operand(cond, fail)
    if not elements and op != "exists":
        raise fail(f"a resource type alone ({resource_type!r}) takes op 'exists'; name an element to compare")
    return FhirLeaf(resource_type, tuple(elements), op, value)


def _parse_connection(cond: Mapping[str, Any], fail: Callable[[str], ConditionError]) -> Connection:
    """``{"connection": name}`` (eq), ``{"connection": [names]}`` (in), or an explicit ``op``."""
    value = cond["connection"]
    op = cond.get("op", "in" if not isinstance(value, str) else "eq")
    if op not in CONNECTION_OPS:
        raise fail(f"unknown op {op!r} for a connection condition (expected one of {', '.join(CONNECTION_OPS)})")
    if op == "in":
        if not _string_list(value):
            raise fail("'connection' with op 'in' needs a non-empty list of connection names")
        return Connection(op, tuple(value))
    if not isinstance(value, str) or not value:
        raise fail(f"'connection' with op {op!r} needs a non-empty string, got {value!r}")
    if op == "regex":
        check_java_regex(value, fail)
    return Connection(op, value)


def _parse_findings(cond: Mapping[str, Any], fail: Callable[[str], ConditionError]) -> Findings:
    """``{"findings": n[, "op": ...]}`` (their count) or ``{"finding": code | [codes]}``."""
    keys = set(cond)
    if "finding" in keys:
        if keys != {"finding"}:
            raise fail(f"a finding condition has only the key 'finding', got {sorted(map(str, keys))}")
        value = cond["finding"]
        codes = [value] if isinstance(value, str) else value
        if not _string_list(codes) or not all(_CODE.fullmatch(c) for c in codes):
            raise fail("'finding' needs an HL7 table 0357 code such as \"103\", or a non-empty list of them")
        return Findings(codes=tuple(codes))
    unknown = keys - {"findings", "op"}
    if unknown:
        raise fail(f"unknown key(s) {sorted(map(str, unknown))} in findings condition (allowed: findings, op)")
    count = cond["findings"]
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 1000:
        raise fail(f"'findings' needs a count from 0 to 1000, got {count!r}")
    op = cond.get("op", "eq")
    if op not in FINDINGS_OPS:
        raise fail(f"unknown op {op!r} for a findings condition (expected one of {', '.join(FINDINGS_OPS)})")
    return Findings(op, count)


def uses_findings(cond: Condition | None) -> bool:
    """Whether evaluating ``cond`` needs the message's profile findings."""
    return _uses(cond, Findings)


def uses_fhir(cond: Condition | None) -> bool:
    """Whether evaluating ``cond`` reads a FHIR message (needs the raw payload, not the segments)."""
    return _uses(cond, FhirLeaf)


def uses_connection(cond: Condition | None) -> bool:
    """Whether evaluating ``cond`` needs the inbound connection's name."""
    return _uses(cond, Connection)


def _uses(cond: Condition | None, kind: type) -> bool:
    """Whether ``cond`` holds a leaf of ``kind`` anywhere in its tree."""
    if isinstance(cond, kind):
        return True
    if isinstance(cond, Not):
        return _uses(cond.condition, kind)
    if isinstance(cond, (AllOf, AnyOf)):
        return any(_uses(c, kind) for c in cond.conditions)
    return False
