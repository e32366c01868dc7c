"""The route stage: stage_inbound → stage_routed, one claimed batch per run.

    claim     one SQL statement outside Spark, in lane order (ids only; never inside a Spark read,
              whose schema probe would run it twice)
    extract   Spark JDBC read of exactly the rows this run claimed (owner + epoch + in_flight)
    transform pure: route() fans each message out to its destinations, every row tagged with the
              run id — the decision only (source, destination, route, status)
    land      Spark JDBC append into landing_routed (scratch, keyed by run)
    finalize  one short fenced transaction (include.store.stages.finalize_route): epoch check,
              sources finished, routed rows built from the landed decisions joined with their
              inbound rows (payload, ids, lane: no body goes through Spark's writer), audit
              events, landing cleared; a row bound for a pass-through destination (nothing to
              transform) is routed straight to `done` with its outbound row

Idempotent: stage_routed has UNIQUE (source_id, destination) and the finalize only moves rows for
sources it finishes itself, so a re-run after a crash between land and finalize lands no duplicates.
A run killed before its finalize leaves its sources in_flight; the sweep (row lease expired) or the
next leader's recovery re-pends them, and the next finalize of those sources removes the dead run's
landing rows. The transform and deliver stages copy this shape.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from include.routes_config import Route
from include.store import INBOUND, Store
from include.store.stages import RouteOutcome, finalize_route
from spark_jobs import stage_io
from spark_jobs.route_rules import route

log = logging.getLogger(__name__)

LANDING_TABLE = "landing_routed"
LANDING_COLUMNS = ("run_id", "source_id", "destination", "route_name", "status")
# Spark would map SQLite's INTEGER to a 32-bit int; the ids are 64-bit everywhere.
CLAIMED_SCHEMA = "id BIGINT, connection STRING, payload STRING"


def claim(store: Store, *, owner: str, epoch: int, batch_size: int,
          lease_seconds: float | None = None) -> list[int]:
    """Claim up to `batch_size` due inbound rows for `owner`, in lane order; their ids."""
    return stage_io.claim(store, INBOUND, owner=owner, epoch=epoch, batch_size=batch_size, lease_seconds=lease_seconds)


def extract(store: Store, spark: SparkSession, *, owner: str, epoch: int, small: bool = False,
            ids: Sequence[int] = ()) -> DataFrame:
    """The rows `owner` claimed under `epoch`: id, connection, payload."""
    return stage_io.read_claimed(store, spark, "route_read_claimed", CLAIMED_SCHEMA, owner=owner, epoch=epoch,
                                 small=small, ids=ids)


def transform(claimed: DataFrame, routes: Sequence[Route], *, run_id: str) -> DataFrame:
    """Route claimed messages into landing rows: run_id, source_id, destination, route_name, status (pure)."""
    routed = claimed.transform(route, routes, id_col="id")
    return routed.select(F.lit(run_id).alias("run_id"), "source_id", "destination", "route_name", "status")


def land(store: Store, landing: DataFrame, *, small: bool = False) -> None:
    """Append the landing rows (over JDBC, or inserted here for a small batch)."""
    stage_io.land(store, landing, LANDING_TABLE, LANDING_COLUMNS, small=small)


def finalize(store: Store, *, run_id: str, owner: str, epoch: int, claimed_ids: list[int],
             passthrough: Collection[str] = ()) -> RouteOutcome:
    """The fenced finalize in one transaction; under a stale epoch, drop the landing rows and re-raise."""
    return stage_io.finalize_fenced(store, run_id=run_id, landing_table=LANDING_TABLE, step=lambda tx: finalize_route(
        tx, run_id=run_id, owner=owner, epoch=epoch, claimed_ids=claimed_ids, passthrough=passthrough))


def run(store: Store, spark: SparkSession, *, routes: Sequence[Route], owner: str, epoch: int,
        run_id: str, batch_size: int = 10_000, lease_seconds: float | None = None,
        passthrough: Collection[str] = ()) -> RouteOutcome:
    """One route run: claim → extract → transform → land → finalize.

    `routes` are already validated (`include.routes_config.parse_routes`, which the stage task's
    `stage_config.load()` runs once), so a bad config never gets this far and claims nothing. With
    nothing to claim Spark is not touched. Failures after the claim: `stage_io.land_and_finalize`.
    `owner` must be unique per run: the Spark read selects the rows by it. Rows for the
    `passthrough` destinations (`include.stage_config.passthrough_destinations`) get their outbound
    rows in this finalize (`finalize_route`).
    """
    claimed_ids = claim(store, owner=owner, epoch=epoch, batch_size=batch_size, lease_seconds=lease_seconds)
    if not claimed_ids:
        return RouteOutcome(run_id=run_id)
    outcome = stage_io.land_and_finalize(
        store, INBOUND, claimed_ids=claimed_ids, owner=owner, epoch=epoch, run_id=run_id,
        landing_table=LANDING_TABLE, columns=LANDING_COLUMNS,
        build=lambda small: extract(store, spark, owner=owner, epoch=epoch, small=small, ids=claimed_ids).transform(
            transform, routes, run_id=run_id),
        finalize=lambda: finalize(store, run_id=run_id, owner=owner, epoch=epoch, claimed_ids=claimed_ids,
                                  passthrough=passthrough))
    log.info("route run %s: claimed %d, routed %d (%d passed through), done %d, unrouted %d, not finished %d",
             run_id, len(outcome.claimed), len(outcome.routed), len(outcome.outbound), len(outcome.done),
             len(outcome.unrouted), len(outcome.not_finished))
    return outcome
