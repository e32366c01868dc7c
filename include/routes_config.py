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

The Spark side (:mod:`spark_jobs.route_rules`, :mod:`spark_jobs.condition_columns`) compiles the
conditions into Columns. Plain Python, no Spark: a config loader checks routes without a
session. The schema is `include.schema.routes` (strict pydantic); every problem of the file is
reported at once, keyed ``route[1].when`` (and where in the condition tree).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
from include.schema.items import ConfigProblemsError, problem, type_name, validate_item, validate_list
from include.schema.routes import RouteModel, RoutesFile
from include.schema.transforms import condition

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
    "RoutesFile",
    "SegmentPresent",
    "parse_condition",
    "parse_routes",
]

# A routing decision's status: one `pending` row per matched destination, else one `unrouted`
# row (shared by the Spark route and the plain-Python bench peer).
PENDING = "pending"
UNROUTED = "unrouted"


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
        return _parse_condition(cond, where=where, fhir=True)
    except ConditionError as exc:
        raise RouteConfigError(f"route {route_name!r}: {exc}") from None


def parse_routes(routes: Any) -> list[Route]:
    """Validate a whole route config (list of specs, config order kept) against the schema
    (`include.schema.routes`); no Spark needed. Raises `RouteConfigError` with every problem of
    every route, keyed ``route[1].destinations``."""
    specs, problems = validate_list(routes, "route")
    parsed: list[Route] = []
    seen: set[str] = set()
    for index, spec in enumerate(specs or []):
        key = f"route[{index}]"
        if isinstance(spec, Route):
            route = spec
        elif not isinstance(spec, Mapping):
            problems.append(problem(key, f"must be a table, got {type_name(spec)}"))
            continue
        else:
            model, found = validate_item(RouteModel, spec, key)
            problems += found
            if model is None:
                continue
            route = Route(
                name=model.name,
                destinations=tuple(dict.fromkeys(model.destinations)),
                when=None if model.when is None else condition(model.when, fhir=True),
                catch_all=model.catch_all,
            )
        if route.name in seen:
            problems.append(problem(f"{key}.name", f"duplicate route name {route.name!r}"))
        seen.add(route.name)
        parsed.append(route)
    if problems:
        raise RouteConfigError(problems)
    return parsed
