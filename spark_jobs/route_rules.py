"""Route stage core: decide, per inbound message, which destinations it goes to, in native Spark SQL.

The route config — its grammar, classes and validation — is :mod:`include.routes_config` (plain
Python, no Spark). Here the validated conditions become boolean Columns over the raw message,
read with :mod:`spark_jobs.hl7_fields` (missing and empty are NULL; a leaf on a missing field is
false, never NULL), and :func:`route` fans each message out to the destinations of the routes it
matches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from include.routes_config import PENDING, UNROUTED, AllOf, Condition, Leaf, Not, Route, parse_condition, parse_routes
from spark_jobs.hl7_fields import extract, with_message

__all__ = ["compile_condition", "route"]


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
