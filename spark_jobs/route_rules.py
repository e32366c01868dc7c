"""Route stage core: decide, per inbound message, which destinations it goes to.

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

Field values come from :func:`spark_jobs.hl7_fields.field` (missing and empty are NULL). A leaf
on a missing field is false, never NULL, so ``not`` means what it says: a message with no PV1-2
matches ``{"not": {"field": "PV1-2", "op": "eq", "value": "I"}}``.

Validation happens in plain Python (:func:`parse_routes`) before any Column is built, so a
config loader can check routes without a Spark session; every error names the route and where
in its ``when`` the problem is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from spark_jobs.hl7_fields import FieldPath, FieldPathError, extract, parse_path, with_message

__all__ = [
    "PENDING",
    "UNROUTED",
    "AllOf",
    "AnyOf",
    "Leaf",
    "Not",
    "Route",
    "RouteConfigError",
    "compile_condition",
    "parse_condition",
    "parse_routes",
    "route",
]

PENDING = "pending"
UNROUTED = "unrouted"
OPS = ("eq", "in", "regex", "exists")

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


def compile_condition(
    cond: Mapping[str, Any] | Condition,
    *,
    route_name: str = "<unnamed>",
    message: Column | str = "payload",
) -> Column:
    """Compile a condition into a boolean Column over the raw message column; never NULL."""
    parsed = parse_condition(cond, route_name=route_name)
    return with_message(message, lambda m: _compile(parsed, m))


def _compile(cond: Condition, message: Column) -> Column:
    """Build the Column for a validated condition over a ``parse_message`` struct."""
    if isinstance(cond, Leaf):
        value = extract(message, cond.path)
        if cond.op == "eq":
            test = value == F.lit(cond.value)
        elif cond.op == "in":
            test = value.isin(list(cond.value))
        elif cond.op == "regex":
            test = value.rlike(cond.value)
        else:
            test = value.isNotNull()
        # Missing field -> false, so `not` and `any` never see NULL.
        return F.coalesce(test, F.lit(False))
    if isinstance(cond, Not):
        return ~_compile(cond.condition, message)
    members = [_compile(c, message) for c in cond.conditions]
    combined = members[0]
    for member in members[1:]:
        combined = (combined & member) if isinstance(cond, AllOf) else (combined | member)
    return combined


def route(
    messages: DataFrame,
    routes: Sequence[Mapping[str, Any] | Route],
    *,
    id_col: str = "id",
    payload_col: str = "payload",
) -> DataFrame:
    """Fan messages out to destinations: one row per (source_id, destination), or one unrouted row.

    Output columns: ``source_id``, ``destination``, ``route_name``, ``status`` (``pending``, or
    ``unrouted`` with NULL destination and route_name). When several routes reach the same
    destination the first in config order names it, so (source_id, destination) is unique.
    Pure (no I/O, no session); use as ``messages.transform(route, routes)``.
    """
    parsed = list(routes) if routes and all(isinstance(r, Route) for r in routes) else parse_routes(routes)
    return messages.transform(_match_routes, parsed, id_col=id_col, payload_col=payload_col).transform(
        _fan_out, parsed
    )


def _match_routes(
    messages: DataFrame, routes: Sequence[Route], *, id_col: str, payload_col: str
) -> DataFrame:
    """Keep ``source_id`` and ``_matches`` (one boolean per route) from one parse of each message."""
    if not routes:
        matches = F.array().cast("array<boolean>")
    else:
        matches = with_message(
            payload_col,
            lambda m: F.array(*(F.lit(True) if r.when is None else _compile(r.when, m) for r in routes)),
        )
    return messages.select(F.col(id_col).alias("source_id"), matches.alias("_matches"))


def _fan_out(flagged: DataFrame, routes: Sequence[Route]) -> DataFrame:
    """Explode matched destinations; dedupe is planned up front, not done with a shuffle.

    For each distinct destination the route name is a CASE over the routes that target it, in
    config order, so the first matching route wins and a destination appears at most once.
    """
    def matched(i: int) -> Column:
        return F.try_element_at("_matches", F.lit(i + 1))

    by_destination: dict[str, list[int]] = {}
    for i, r in enumerate(routes):
        for dest in r.destinations:
            by_destination.setdefault(dest, []).append(i)
    hit_type = "array<struct<destination:string,route_name:string>>"
    if not by_destination:
        hits = F.lit(None).cast(hit_type)
    else:
        entries = []
        for dest, indices in by_destination.items():
            name = F.when(matched(indices[0]), F.lit(routes[indices[0]].name))
            for i in indices[1:]:
                name = name.when(matched(i), F.lit(routes[i].name))
            entries.append(F.struct(F.lit(dest).alias("destination"), name.alias("route_name")))
        hits = F.filter(F.array(*entries), lambda h: h["route_name"].isNotNull())
    # explode_outer turns "no destination matched" into exactly one row of NULLs.
    exploded = flagged.select("source_id", F.explode_outer(hits).alias("hit"))
    return exploded.select(
        "source_id",
        F.col("hit.destination").alias("destination"),
        F.col("hit.route_name").alias("route_name"),
        F.when(F.col("hit.destination").isNull(), F.lit(UNROUTED)).otherwise(F.lit(PENDING)).alias("status"),
    )
