"""Route config: which inbound messages go to which destinations (`routes.toml`, `[[route]]`).

A route spec is plain data, as loaded from TOML/JSON config::

    {"name": "adt-to-ehr", "destinations": ["ehr", "archive"],
     "when": {"all": [{"field": "MSH-9.1", "op": "eq", "value": "ADT"},
                      {"not": {"field": "PV1-2", "op": "in", "value": ["P", "R"]}}]}}

Conditions: a leaf ``{"field": <HL7 path>, "op": ..., "value": ...}`` or ``{"all": [...]}``,
``{"any": [...]}``, ``{"not": cond}``. A route without ``when`` matches every message.

* ``eq``: value is a string, compared exactly.
* ``in``: value is a non-empty list of strings.
* ``regex``: value is a Java regex, searched anywhere in the value (anchor with ``^``/``$``).
  Config load checks it with Python's ``re`` and rejects Python-only syntax (``(?P<n>..)``,
  ``(?#..)``, ``(?(..)``); use the syntax both engines share.
* ``exists``: no value; true when the field is present and non-empty.

Field paths follow :mod:`include.hl7path`; values are read as :func:`spark_jobs.hl7_fields.field`
reads them (missing and empty are NULL). A leaf on a missing field is false, never NULL, so
``not`` means what it says: a message with no PV1-2 matches
``{"not": {"field": "PV1-2", "op": "eq", "value": "I"}}``. The Spark side
(:mod:`spark_jobs.route_rules`) compiles these classes into Columns.

Plain Python, no Spark: a config loader checks routes without a session, and every error names
the route and where in its ``when`` the problem is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from include.hl7path import FieldPath, FieldPathError, parse_path

__all__ = [
    "OPS",
    "PENDING",
    "UNROUTED",
    "AllOf",
    "AnyOf",
    "Condition",
    "Leaf",
    "Not",
    "Route",
    "RouteConfigError",
    "parse_condition",
    "parse_routes",
]

OPS = ("eq", "in", "regex", "exists")
# A routing decision's status: one `pending` row per matched destination, else one `unrouted`
# row (shared by the Spark route and the plain-Python bench peer).
PENDING = "pending"
UNROUTED = "unrouted"

_ROUTE_KEYS = frozenset({"name", "destinations", "when"})
_LEAF_KEYS = frozenset({"field", "op", "value"})
# Python-only regex syntax that would pass re.compile but make Java's Pattern throw mid-job.
_PYTHON_ONLY_REGEX = re.compile(r"\(\?P|\(\?#|\(\?\(")


class RouteConfigError(ValueError):
    """A route spec that cannot be compiled; the message names the route and the problem."""


@dataclass(frozen=True)
class Leaf:
    """Test one HL7 field: ``value`` is a str (eq, regex), a tuple (in) or None (exists)."""

    path: FieldPath
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


Condition = Union[Leaf, AllOf, AnyOf, Not]


@dataclass(frozen=True)
class Route:
    """A validated route; ``when`` None matches everything."""

    name: str
    destinations: tuple[str, ...]
    when: Condition | None = None


def parse_condition(cond: Any, *, route_name: str = "<unnamed>", where: str = "when") -> Condition:
    """Validate one condition tree; ``where`` locates it in errors (``when.all[1].not``)."""

    def fail(problem: str) -> RouteConfigError:
        return RouteConfigError(f"route {route_name!r}: {where}: {problem}")

    if isinstance(cond, (Leaf, AllOf, AnyOf, Not)):
        return cond
    if not isinstance(cond, Mapping):
        raise fail(f"condition must be a table/object, got {type(cond).__name__}")
    keys = set(cond)
    if "field" in keys or "op" in keys:
        unknown = keys - _LEAF_KEYS
        if unknown:
            raise fail(f"unknown key(s) {sorted(map(str, unknown))} in field condition (allowed: field, op, value)")
        return _parse_leaf(cond, fail)
    if len(keys) != 1 or not keys <= {"all", "any", "not"}:
        raise fail(
            f"expected exactly one of 'field', 'all', 'any', 'not', got keys {sorted(map(str, keys))}"
        )
    (kind,) = keys
    inner = cond[kind]
    if kind == "not":
        return Not(parse_condition(inner, route_name=route_name, where=f"{where}.not"))
    if isinstance(inner, (str, bytes, Mapping)) or not isinstance(inner, Sequence):
        raise fail(f"'{kind}' must be a list of conditions, got {type(inner).__name__}")
    if not inner:
        raise fail(f"'{kind}' must not be empty")
    members = tuple(
        parse_condition(c, route_name=route_name, where=f"{where}.{kind}[{i}]") for i, c in enumerate(inner)
    )
    return AllOf(members) if kind == "all" else AnyOf(members)


def _parse_leaf(cond: Mapping[str, Any], fail: Callable[[str], RouteConfigError]) -> Leaf:
    """Validate a ``{"field", "op", "value"}`` leaf."""
    if "field" not in cond:
        raise fail("field condition needs 'field'")
    try:
        path = parse_path(cond["field"])
    except FieldPathError as exc:
        raise fail(f"bad field path: {exc}") from None
    op = cond.get("op")
    if op not in OPS:
        raise fail(f"unknown op {op!r} (expected one of {', '.join(OPS)})")
    has_value = "value" in cond
    value = cond.get("value")
    if op == "exists":
        if has_value:
            raise fail("op 'exists' takes no value")
        return Leaf(path, op)
    if not has_value:
        raise fail(f"op {op!r} needs a value")
    if op in ("eq", "regex"):
        if not isinstance(value, str):
            raise fail(f"op {op!r} needs a string value, got {type(value).__name__}")
        if op == "regex":
            try:
                re.compile(value)
            except re.error as exc:
                raise fail(f"bad regex {value!r}: {exc}") from None
            if _PYTHON_ONLY_REGEX.search(value):
                raise fail(f"bad regex {value!r}: (?P..), (?#..) and (?(..) are not Java regex syntax")
        return Leaf(path, op, value)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not value:
        raise fail("op 'in' needs a non-empty list of strings")
    if not all(isinstance(v, str) for v in value):
        raise fail("op 'in' needs a non-empty list of strings")
    return Leaf(path, op, tuple(value))


def parse_routes(routes: Any) -> list[Route]:
    """Validate a whole route config (list of specs, config order kept); no Spark needed."""
    if isinstance(routes, (str, bytes, Mapping)) or not isinstance(routes, Sequence):
        raise RouteConfigError(f"routes must be a list of route tables, got {type(routes).__name__}")
    parsed: list[Route] = []
    seen: set[str] = set()
    for index, spec in enumerate(routes):
        if not isinstance(spec, Mapping):
            raise RouteConfigError(f"route #{index}: must be a table/object, got {type(spec).__name__}")
        name = spec.get("name")
        if not isinstance(name, str) or not name.strip():
            raise RouteConfigError(f"route #{index}: 'name' must be a non-empty string")
        if name in seen:
            raise RouteConfigError(f"route {name!r}: duplicate route name")
        seen.add(name)
        unknown = set(spec) - _ROUTE_KEYS
        if unknown:
            raise RouteConfigError(
                f"route {name!r}: unknown key(s) {sorted(map(str, unknown))} "
                "(allowed: name, destinations, when)"
            )
        dests = spec.get("destinations")
        if (
            isinstance(dests, (str, bytes, Mapping))
            or not isinstance(dests, Sequence)
            or not dests
            or not all(isinstance(d, str) and d.strip() for d in dests)
        ):
            raise RouteConfigError(
                f"route {name!r}: 'destinations' must be a non-empty list of non-empty strings"
            )
        when = parse_condition(spec["when"], route_name=name) if "when" in spec else None
        parsed.append(Route(name=name, destinations=tuple(dict.fromkeys(dests)), when=when))
    return parsed
