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

from include.conditions import FHIR_FORMAT, uses_connection, uses_fhir, uses_findings
from include.routes_config import PENDING, UNROUTED, Condition, Route, parse_condition, parse_routes
from spark_jobs.condition_columns import compile_condition as compile_over
from spark_jobs.hl7_fields import let, with_message

__all__ = ["compile_condition", "route"]


def compile_condition(
    cond: Mapping[str, Any] | Condition,
    *,
    route_name: str = "<unnamed>",
    message: Column | str = "payload",
    connection: Column | str | None = None,
) -> Column:
    """Compile a condition into a boolean Column over the raw message column; never NULL."""
    parsed = parse_condition(cond, route_name=route_name)
    conn = F.col(connection) if isinstance(connection, str) else connection
    raw = F.col(message) if isinstance(message, str) else message
    return with_message(message, lambda m: _compile(parsed, m, conn, raw))


def _compile(
    cond: Condition,
    message: Column,
    connection: Column | None,
    payload: Column | None = None,
    findings: Column | None = None,
) -> Column:
    """Build the Column for a validated condition over a ``parse_message`` struct (and, for FHIR
    leaves, the raw message; for findings leaves, the stored findings)."""
    return compile_over(cond, message["segments"], message, connection, payload, findings)


def route(
    messages: DataFrame,
    routes: Sequence[Mapping[str, Any] | Route],
    *,
    id_col: str = "id",
    payload_col: str = "payload",
    connection_col: str = "connection",
    findings_col: str = "findings",
    format_col: str = "format",
) -> DataFrame:
    """Fan messages out to destinations: one row per (source_id, destination), or one unrouted row.

    Output columns: ``source_id``, ``destination``, ``route_name``, ``status`` (``pending``, or
    ``unrouted`` with NULL destination and route_name). When several routes reach the same
    destination the first in config order names it, so (source_id, destination) is unique. A
    ``catch_all`` route matches when no other route does. ``connection_col`` (the inbound
    connection's name) is read only when a condition tests it, as is ``findings_col`` (the
    message's profile findings, JSON), and ``format_col`` only when one tests FHIR: a `fhir`
    condition reads a message only if the FHIR inbound staged it (format ``"fhir"``), never JSON
    some other inbound took as text.
    Pure (no I/O, no session); use as ``messages.transform(route, routes)``.
    """
    parsed = list(routes) if routes and all(isinstance(r, Route) for r in routes) else parse_routes(routes)
    return messages.transform(
        _match_routes,
        parsed,
        id_col=id_col,
        payload_col=payload_col,
        connection_col=connection_col,
        findings_col=findings_col,
        format_col=format_col,
    ).transform(_fan_out, parsed)


def _match_routes(
    messages: DataFrame,
    routes: Sequence[Route],
    *,
    id_col: str,
    payload_col: str,
    connection_col: str,
    findings_col: str,
    format_col: str,
) -> DataFrame:
    """Keep ``source_id`` and ``_matches`` (one boolean per route) from one parse of each message."""
    connection = F.col(connection_col) if any(uses_connection(r.when) for r in routes) else None
    fhir = any(uses_fhir(r.when) for r in routes)
    payload = F.when(F.col(format_col) == F.lit(FHIR_FORMAT), F.col(payload_col)) if fhir else None
    findings = F.col(findings_col) if any(uses_findings(r.when) for r in routes) else None
    regular = [r for r in routes if not r.catch_all]
    if not regular:
        matches = F.array(*(F.lit(True) for _ in routes)).cast("array<boolean>")
    else:

        def flags(m: Column) -> Column:
            conds = [
                F.lit(True) if r.when is None else _compile(r.when, m, connection, payload, findings) for r in regular
            ]
            if len(conds) == len(routes):
                return F.array(*conds)

            def with_catch_all(arr: Column) -> Column:
                unmatched = ~F.exists(arr, lambda x: x)
                out, k = [], 0
                for r in routes:
                    if r.catch_all:
                        out.append(unmatched)
                    else:
                        k += 1
                        out.append(F.element_at(arr, k))
                return F.array(*out)

            return let(F.array(*conds), with_catch_all)

        matches = with_message(payload_col, flags)
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
