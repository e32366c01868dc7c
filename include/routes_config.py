"""Route config: which inbound messages go to which destinations (`routes.toml`, `[[route]]`).

A route spec is plain data, as loaded from TOML/JSON config::

    {"name": "adt-to-ehr", "destinations": ["ehr", "archive"],
     "when": {"all": [{"field": "MSH-9.1", "op": "eq", "value": "ADT"},
                      {"not": {"field": "PV1-2", "op": "in", "value": ["P", "R"]}}]}}
    {"name": "the-rest", "destinations": ["archive"], "catch_all": true}

``when`` follows the condition grammar of :mod:`include.conditions` (field leaves with any/all
over segments and repetitions, segment presence, the inbound connection, all/any/not), the same
grammar a transform rule's ``when`` uses; the reference is docs/rules.md. A route without
``when`` matches every message. A ``catch_all`` route (no ``when``) matches exactly the messages
no other route matched; a message no route matches at all is ``unrouted``.

The Spark side (:mod:`spark_jobs.route_rules`, :mod:`spark_jobs.conditions`) compiles the
conditions into Columns. Plain Python, no Spark: a config loader checks routes without a
session, and every error names the route and where in its ``when`` the problem is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from include.schema.items import ConfigProblemsError
from include.conditions import (
    OPS,
    AllOf,
    AnyOf,
    Condition,
    ConditionError,
    Connection,
    Leaf,
    Not,
    SegmentPresent,
)
from include.conditions import parse_condition as _parse_condition

__all__ = [
    "OPS",
    "PENDING",
    "UNROUTED",
    "AllOf",
    "AnyOf",
    "Condition",
    "Connection",
    "Leaf",
    "Not",
    "Route",
    "RouteConfigError",
    "SegmentPresent",
    "parse_condition",
    "parse_routes",
]

# A routing decision's status: one `pending` row per matched destination, else one `unrouted`
# row (shared by the Spark route and the plain-Python bench peer).
PENDING = "pending"
UNROUTED = "unrouted"

_ROUTE_KEYS = frozenset({"name", "destinations", "when", "catch_all"})


class RouteConfigError(ConfigProblemsError):
    """`routes.toml` breaks the schema: every problem, keyed ``route[1].when``."""


@dataclass(frozen=True)
class Route:
    """A validated route; ``when`` None matches everything, ``catch_all`` what no other route matched."""

    name: str
    destinations: tuple[str, ...]
    when: Condition | None = None
    catch_all: bool = False


def parse_condition(cond: Any, *, route_name: str = "<unnamed>", where: str = "when") -> Condition:
    """Validate one condition tree; errors read ``route 'x': when.all[1].not: problem``."""
    try:
        return _parse_condition(cond, where=where)
    except ConditionError as exc:
        raise RouteConfigError(f"route {route_name!r}: {exc}") from None


def parse_routes(routes: Any) -> list[Route]:
    """Validate a whole route config (list of specs, config order kept); no Spark needed."""
    if isinstance(routes, (str, bytes, Mapping)) or not isinstance(routes, Sequence):
        raise RouteConfigError(f"routes must be a list of route tables, got {type(routes).__name__}")
    parsed: list[Route] = []
    seen: set[str] = set()
    for index, spec in enumerate(routes):
        if isinstance(spec, Route):
            if spec.name in seen:
                raise RouteConfigError(f"route {spec.name!r}: duplicate route name")
            seen.add(spec.name)
            parsed.append(spec)
            continue
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
                "(allowed: name, destinations, when, catch_all)"
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
        catch_all = spec.get("catch_all", False)
        if not isinstance(catch_all, bool):
            raise RouteConfigError(f"route {name!r}: 'catch_all' must be true or false, got {catch_all!r}")
        if catch_all and "when" in spec:
            raise RouteConfigError(f"route {name!r}: a catch_all route takes no 'when' (it matches what no "
                                   "other route matched)")
        when = parse_condition(spec["when"], route_name=name) if "when" in spec else None
        parsed.append(Route(name=name, destinations=tuple(dict.fromkeys(dests)), when=when, catch_all=catch_all))
    return parsed
