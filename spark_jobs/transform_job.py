"""The transform stage's pure transform: routed rows → outbound rows, each rewritten for its destination.

The stage is the record `include.store.stages.TRANSFORM` (stage_routed → landing_outbound →
stage_outbound, `finalize_transform`), run by `spark_jobs.stage_job.run_stage_job` with the
transform `checked()` returns — the specs checked against the lookup tables and the code hooks
imported before anything is claimed, so a rule naming a missing table claims nothing.

`outbound_rows()`: each row's outbound lane key from its destination's lane rule (read from the
message as routed), then the destination's transform rules (`spark_jobs.transform_rules`), then its
code hook if it names one (`spark_jobs.code_hook`). A message the rules cannot read lands with a
NULL payload and is dead-lettered by the finalize. Rows bound for a pass-through destination
(`include.stage_config.passthrough_destinations`) are left out: the finalize moves them in SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from include.destinations_config import Destination
from include.stage_config import passthrough_destinations
from include.store import Store
from include.store import lookups as lookup_tables
from include.transforms_config import Transform, parse_transforms
from spark_jobs.code_hook import apply_code_hooks, check_hooks
from spark_jobs.hl7_fields import field
from spark_jobs.transform_rules import transform


def lane_key(destination: Column, payload: Column, destinations: Mapping[str, Destination]) -> Column:
    """The outbound lane key, the Spark twin of `include.destinations_config.lane_key`.

    `<name>` for a destination-wide lane (and for a destination not configured), `<name>|<value>`
    for an HL7-path lane, the value read raw from the message as routed (before any rule runs).
    Destinations that key on the same path share one read of it (a smaller plan to analyze).
    """
    by_path: dict[str, list[str]] = {}
    for name, dest in sorted(destinations.items()):
        if dest.lane != "destination":
            by_path.setdefault(dest.lane, []).append(name)
    key: Column | None = None
    for path, names in by_path.items():
        value = F.concat(destination, F.lit("|"), F.coalesce(field(payload, path), F.lit("")))
        cond = destination.isin(names)
        key = F.when(cond, value) if key is None else key.when(cond, value)
    return destination if key is None else key.otherwise(destination)


def code_hooks(destinations: Mapping[str, Destination]) -> dict[str, str]:
    """Destination -> its `module:function` code hook, for those that have one."""
    return {name: dest.code for name, dest in destinations.items() if dest.code}


def outbound_rows(
    claimed: DataFrame,
    specs: Sequence[Mapping[str, Any] | Transform],
    lookups: Mapping[str, Mapping[str, str]],
    destinations: Mapping[str, Destination],
    *,
    run_id: str,
    code_dir: str | None = None,
) -> DataFrame:
    """Claimed routed rows → landing rows (pure; no I/O). NULL payload = not to be delivered: the
    rules could not read the message, or a rule or the destination's code hook (run after the
    rules, `spark_jobs.code_hook`, modules from `code_dir`) dead-lettered it, the reason then in
    content_type. Rows for a pass-through destination (`passthrough_destinations`) are left out:
    the finalize moves them."""
    passing = sorted(passthrough_destinations(specs, destinations))
    if passing:
        claimed = claimed.where(~F.col("destination").isin(passing))
    laned = claimed.withColumn("lane_key", lane_key(F.col("destination"), F.col("payload"), destinations))
    rewritten = laned.transform(
        transform,
        specs,
        lookups,
        carry=("source_id", "message_id", "control_id", "lane_key"),
        message_id_col="message_id",
    ).transform(apply_code_hooks, code_hooks(destinations), code_dir)
    return rewritten.select(
        F.lit(run_id).alias("run_id"),
        "source_id",
        F.col("id").alias("routed_id"),
        "destination",
        "content_type",
        "lane_key",
        "payload",
        "message_id",
        "control_id",
    )


def checked(
    store: Store,
    specs: Sequence[Mapping[str, Any] | Transform],
    destinations: Mapping[str, Destination],
    *,
    lookups: Mapping[str, Mapping[str, str]] | None = None,
    code_dir: str | None = None,
) -> Callable[..., DataFrame]:
    """`outbound_rows` bound to this config, once it holds: the specs parsed against the lookup tables
    (`lookups`, or the store's read now) and the destinations' code hooks imported (from `code_dir`
    first). Call it before the claim: a config that cannot run claims nothing."""
    lookups = lookup_tables.load_all(store) if lookups is None else lookups
    parsed = parse_transforms(list(specs), lookups=lookups)
    check_hooks(code_hooks(destinations), code_dir)
    return partial(outbound_rows, specs=parsed, lookups=lookups, destinations=destinations, code_dir=code_dir)
