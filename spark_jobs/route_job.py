"""The route stage's pure transform: stage_inbound rows → routing decisions.

The stage itself is the record `include.store.stages.ROUTE` (stage_inbound → landing_routed →
stage_routed, finalized by `include.store.finalize.finalize_route`), which names `bind` as its job;
`spark_jobs.stage_job.run_stage_job` runs it with the transform `bind` returns.

`routes` are already validated (`include.routes_config.parse_routes`, which the stage task's
`stage_config.load()` runs once), so a bad config never gets as far as a claim. Only the decision
lands (source, destination, route, status); the finalize builds the routed rows from it joined
with their inbound rows, so no body goes through Spark's writer. A row bound for a pass-through
destination (`passthrough`: nothing to transform, `include.stage_config.passthrough_destinations`)
is routed straight to `done` with its outbound row.

Idempotent: stage_routed has UNIQUE (source_id, destination) and the finalize only moves rows for
sources it finishes itself, so a re-run after a crash between land and finalize lands no
duplicates; the next finalize of those sources removes the dead run's landing rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from include.routes_config import Route
from spark_jobs.route_rules import route
from spark_jobs.stage_job import StageContext, Transform


def routed_rows(claimed: DataFrame, routes: Sequence[Route], *, run_id: str) -> DataFrame:
    """Route claimed messages into landing rows: run_id, source_id, destination, route_name, status (pure)."""
    routed = claimed.transform(route, routes, id_col="id")
    return routed.select(F.lit(run_id).alias("run_id"), "source_id", "destination", "route_name", "status")


def bind(context: StageContext) -> Transform:
    """The route stage's transform under the pipeline config's routes (`Stage.job`)."""
    return partial(routed_rows, routes=context.config.routes)
