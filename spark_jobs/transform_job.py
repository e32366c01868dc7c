"""The transform stage's pure transform: routed rows → outbound rows, each rewritten for its destination.

The stage is the record `include.store.stages.TRANSFORM` (stage_routed → landing_outbound →
stage_outbound, `finalize_transform`), run by `spark_jobs.stage_job.run_stage_job` with the
transform its job `bind` returns before each claim — the specs checked against the lookup tables
and the code hooks imported first, so a rule naming a missing table claims nothing.

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

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from include.destinations_config import Destination
from include.stage_config import passthrough_destinations
from include.store.stages import TRANSFORM
from include.transforms_config import Transform, parse_transforms
from spark_jobs.code_hook import apply_code_hooks, check_hooks, hooks_of
from spark_jobs.lanes import lane_key
from spark_jobs.stage_job import StageContext
from spark_jobs.transform_rules import transform

LANDED = TRANSFORM.landing.columns if TRANSFORM.landing else ()


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
    ).transform(apply_code_hooks, hooks_of(destinations), code_dir)
    return rewritten.withColumn("run_id", F.lit(run_id)).withColumnRenamed("id", "routed_id").select(*LANDED)


def bind(context: StageContext) -> Callable[..., DataFrame]:
    """`outbound_rows` under the pipeline config, once it holds (`Stage.job`, before each claim): the
    specs parsed against the lookup tables as they are now and the destinations' code hooks
    imported (from the config's `code/` first). A config that cannot run claims nothing."""
    config, lookups = context.config, context.lookups()
    specs = parse_transforms(list(config.transforms), lookups=lookups)
    check_hooks(hooks_of(config.destinations), code_dir := str(config.code_dir))
    return partial(outbound_rows, specs=specs, lookups=lookups, destinations=config.destinations, code_dir=code_dir)
