"""The transform stage: stage_routed → stage_outbound, one claimed batch per run.

    claim     routed rows in lane order, one SQL statement outside Spark (`stage_io.claim`)
    extract   Spark JDBC read of exactly the rows this run claimed
    transform pure: `outbound_rows()` — each row's outbound lane key from its destination's lane
              rule (read from the message as routed), then the destination's transform rules
              (`spark_jobs.transform_rules`, config in `include.transforms_config`), then the
              destination's code hook if it names one (`spark_jobs.code_hook`), tagged with the run id
    land      Spark JDBC append into landing_outbound
    finalize  one fenced transaction (`include.store.stages.finalize_transform`): epoch check,
              routed rows finished, landed rows moved to stage_outbound with their idempotency
              keys, audit events, landing cleared; a message the rules cannot read (NULL payload)
              dead-letters its routed row. Rows bound for a pass-through destination (no spec, one
              lane per destination: `include.stage_config.passthrough_destinations`) rarely get
              here — the route finalize hands them to stage_outbound itself — and those that do
              (routed while the destination still had open rows) skip Spark: the finalize moves
              them in SQL, their body the inbound one (not copied)

The lookup tables `map` rules use come in as `run(lookups=...)` — a stage task reads them once, at
its first micro-batch (`stageline_airflow.tasks`) — or are read from the store when not given. Specs are
checked against them before the claim, so a rule naming a missing table claims nothing. Idempotent and crash-safe like the route stage:
stage_outbound is UNIQUE (source_id, destination) and the finalize moves only rows it finished.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from include.destinations_config import Destination
from include.stage_config import passthrough_destinations
from include.store import ROUTED, Store
from include.store import lookups as lookup_tables
from include.store.stages import TransformOutcome, finalize_transform
from include.transforms_config import Transform, parse_transforms
from spark_jobs import stage_io
from spark_jobs.code_hook import apply_code_hooks, check_hooks
from spark_jobs.hl7_fields import field
from spark_jobs.transform_rules import transform

log = logging.getLogger(__name__)

LANDING_TABLE = "landing_outbound"
LANDING_COLUMNS = ("run_id", "source_id", "routed_id", "destination", "content_type", "lane_key", "payload",
                   "message_id", "control_id")
CLAIMED_SCHEMA = ("id BIGINT, source_id BIGINT, destination STRING, payload STRING, message_id STRING, "
                  "control_id STRING, connection STRING")


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


def outbound_rows(claimed: DataFrame, specs: Sequence[Mapping[str, Any] | Transform],
                  lookups: Mapping[str, Mapping[str, str]], destinations: Mapping[str, Destination], *,
                  run_id: str, code_dir: str | None = None) -> DataFrame:
    """Claimed routed rows → landing rows (pure; no I/O). NULL payload = not to be delivered: the
    rules could not read the message, or a rule or the destination's code hook (run after the
    rules, `spark_jobs.code_hook`, modules from `code_dir`) dead-lettered it, the reason then in
    content_type. Rows for a pass-through destination (`passthrough_destinations`) are left out:
    the finalize moves them."""
    passing = sorted(passthrough_destinations(specs, destinations))
    if passing:
        claimed = claimed.where(~F.col("destination").isin(passing))
    laned = claimed.withColumn("lane_key", lane_key(F.col("destination"), F.col("payload"), destinations))
    rewritten = laned.transform(transform, specs, lookups, carry=("source_id", "message_id", "control_id", "lane_key"),
                                message_id_col="message_id").transform(
        apply_code_hooks, code_hooks(destinations), code_dir)
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


def claim(store: Store, *, owner: str, epoch: int, batch_size: int, lease_seconds: float | None = None) -> list[int]:
    return stage_io.claim(store, ROUTED, owner=owner, epoch=epoch, batch_size=batch_size, lease_seconds=lease_seconds)


def extract(store: Store, spark: SparkSession, *, owner: str, epoch: int, small: bool = False,
            ids: Sequence[int] = ()) -> DataFrame:
    return stage_io.read_claimed(store, spark, "transform_read_claimed", CLAIMED_SCHEMA, owner=owner, epoch=epoch,
                                 small=small, ids=ids)


def land(store: Store, landing: DataFrame, *, small: bool = False) -> None:
    stage_io.land(store, landing, LANDING_TABLE, LANDING_COLUMNS, small=small)


def read_lookups(store: Store) -> dict[str, dict[str, str]]:
    with store.transaction(write=False) as tx:
        return lookup_tables.read_all(tx)


def finalize(store: Store, *, run_id: str, owner: str, epoch: int, claimed_ids: list[int],
             passthrough: Collection[str] = ()) -> TransformOutcome:
    """The fenced finalize in one transaction; under a stale epoch, drop the landing rows and re-raise."""
    return stage_io.finalize_fenced(store, run_id=run_id, landing_table=LANDING_TABLE, step=lambda tx: finalize_transform(
        tx, run_id=run_id, owner=owner, epoch=epoch, claimed_ids=claimed_ids, passthrough=passthrough))


def run(store: Store, spark: SparkSession, *, specs: Sequence[Mapping[str, Any] | Transform],
        destinations: Mapping[str, Destination], owner: str, epoch: int, run_id: str,
        batch_size: int = 10_000, lease_seconds: float | None = None,
        lookups: Mapping[str, Mapping[str, str]] | None = None, code_dir: str | None = None) -> TransformOutcome:
    """One transform run: lookups → claim → extract → transform → land → finalize.

    Specs are validated against the lookup tables — `lookups`, or the store's read now — and the
    destinations' code hooks imported (from `code_dir` first) before anything is claimed. With nothing
    to claim Spark is not touched. Failures after the claim: `stage_io.land_and_finalize`.
    `owner` must be unique per run.
    """
    lookups = read_lookups(store) if lookups is None else lookups
    parsed = parse_transforms(list(specs), lookups=lookups)
    check_hooks(code_hooks(destinations), code_dir)  # a hook that cannot load claims nothing
    claimed_ids = claim(store, owner=owner, epoch=epoch, batch_size=batch_size, lease_seconds=lease_seconds)
    if not claimed_ids:
        return TransformOutcome(run_id=run_id)
    outcome = stage_io.land_and_finalize(
        store, ROUTED, claimed_ids=claimed_ids, owner=owner, epoch=epoch, run_id=run_id,
        landing_table=LANDING_TABLE, columns=LANDING_COLUMNS,
        build=lambda small: extract(store, spark, owner=owner, epoch=epoch, small=small, ids=claimed_ids).transform(
            outbound_rows, parsed, lookups, destinations, run_id=run_id, code_dir=code_dir),
        finalize=lambda: finalize(store, run_id=run_id, owner=owner, epoch=epoch, claimed_ids=claimed_ids,
                                  passthrough=passthrough_destinations(parsed, destinations)))
    log.info("transform run %s: claimed %d, outbound %d, failed %d, not finished %d", run_id,
             len(outcome.claimed), len(outcome.outbound), len(outcome.failed), len(outcome.not_finished))
    return outcome
