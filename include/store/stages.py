"""The pipeline's stages, each declared once: what it claims, how it reads, where it lands, how it ends.

    route      stage_inbound  → landing_routed   → stage_routed     (finalize_route)
    transform  stage_routed   → landing_outbound → stage_outbound   (finalize_transform)
    deliver    stage_outbound lane heads → destinations, no landing  (finalize_deliveries)

A `Stage` is read by everything that works on a stage: the Spark job (`spark_jobs.stage_job.
run_stage_job` claims from `input`, reads with `read_query`/`schema`, lands into `landing`, calls
`finalize`), the Airflow plugin (the DAG `stage_<name>`, its task `<name>`, its claim keeper), the
leader check (`work_pending`: which table is this stage's work, which stages come before it) and the
batch history (`stage_batches.stage` is the stage's name). A stage has this one name; its input
table has its own (`StagedTable.key`: `inbound`, `routed`, `outbound`), which the audit trail,
retention and `stageline stages` use.

Why here, in the store: the record is read where Spark must not be imported — when Airflow parses
a DAG file, by the leader check, by the embedded stack and the lab — and everything in it is the
store's (tables, named queries, fenced finalizes); a Spark type string (`schema`) is only text. The
stage's pure transform is Spark code: the record names it (`job`, e.g. `spark_jobs.route_job:bind`)
and the stage task imports it when it runs. Adding a stage is a record here and its SQL:
docs/stages.md, "Adding a stage".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from include.store import queries
from include.store.db import INBOUND, OUTBOUND, ROUTED, StagedTable, Store, Tx
from include.store.finalize import (
    BatchOutcome,
    DeliverOutcome,
    RouteOutcome,
    Run,
    clear_landing,
    dead_letter,
    dead_letter_reason,
    finalize_deliveries,
    finalize_route,
    finalize_transform,
    move_on,
)

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@dataclass(frozen=True)
class Landing:
    """A stage's landing table: scratch rows keyed by run, appended by Spark, moved by the finalize.

    Its named queries follow the table's name: `<table>_insert` (a small batch's rows, as JSON),
    `<table>_delete` (one run's rows) and `<table>_delete_sources` (earlier runs' leftovers).
    """

    table: str
    columns: tuple[str, ...]

    def discard(self, store: Store, run_id: str) -> int:
        """Delete one run's landing rows (its own transaction): cleanup after a failed or fenced run."""
        with store.transaction() as tx:
            return tx.execute(f"{self.table}_delete", {"run_id": run_id})


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline (module docstring). A batch stage (one with a `landing`) needs
    nothing but this record and its SQL: `run_stage_job` runs it, `finalize_landed` finishes it,
    `stageline_airflow.tasks.run_batch_stage` is its task and `dags/stages.py` gives it its DAG."""

    name: str
    """`route`, `transform`, `deliver`: the DAG `stage_<name>` and its job task `<name>`."""
    input: StagedTable
    """The staged table it claims from; its due rows are the stage's work."""
    read_query: str
    """The read-only named query of a run's claimed rows (bounded by owner + epoch)."""
    schema: str
    """Spark's customSchema of those rows (SQLite's INTEGER would arrive as a 32-bit int)."""
    doc: str
    """What its job does, in a sentence or two: the job step of its DAG's page (`stage_dag`)."""
    landing: Landing | None = None
    """Where its Spark job appends results; None when it lands none (deliver collects outcomes)."""
    output: StagedTable | None = None
    """The staged table its finished rows move to (the next stage's input); None for deliver."""
    event: str = ""
    """The audit event of a row it moves into `output` (`routed`, `transformed`)."""
    job: str = ""
    """`module:function` that builds its pure transform before each claim, from a `StageContext`
    (`spark_jobs.stage_job`): Spark code, so named here and imported only when a task runs."""
    finalize: Callable[..., Any] | None = None
    """Its fenced finalize (`include.store.finalize`), called `finalize(tx, run, passthrough=…)`
    (`finalize.Run`) in the run's one transaction (`finish`): all of a run lands, or none of it.
    None: `finalize_landed`, from the stage's SQL alone. Deliver's takes one round's send outcomes
    instead, from its own job."""
    outcome: Callable[..., Any] = BatchOutcome
    """What a run returns; `outcome(run_id=…)` is a run that claimed nothing."""
    read_task_query: str = ""
    """`read_query` selecting by the stage task's owner prefix instead of one batch's owner: the
    same text for every batch of a task, so the plan on it is kept (`spark_jobs.stage_job.KeptPlans`).
    Empty: every batch builds its plan."""

    @property
    def dag_id(self) -> str:
        return f"stage_{self.name}"

    @property
    def columns(self) -> list[str]:
        """The claimed rows' columns, in `schema` order."""
        return [c.strip().split()[0] for c in self.schema.split(",")]

    def finish(self, tx: Tx, *, run_id: str, owner: str, epoch: int, claimed_ids: list[int], **args: Any) -> Any:
        """Finalize one run in `tx` (`finalize`, or `finalize_landed` when it names none)."""
        run = Run.of(run_id=run_id, owner=owner, epoch=epoch, claimed_ids=claimed_ids)
        if self.finalize is None:
            return finalize_landed(tx, run, stage=self, **args)
        return self.finalize(tx, run, **args)

    def read_sql(self, store: Store, *, owner: str, epoch: int) -> str:
        """`read_query` for Spark's JDBC `query`, the run's owner and epoch written in (`inline_query`)."""
        return inline_query(store, self.read_query, {"owner": owner, "epoch": int(epoch)})

    def read_task_sql(self, store: Store, *, prefix: str, epoch: int) -> str:
        """`read_task_query` for Spark's JDBC `query`: the rows in flight under `epoch` whose owner
        starts with `prefix` (a task's batches, one at a time: the batch's own)."""
        return inline_query(store, self.read_task_query, {"prefix": prefix, "epoch": int(epoch)})


ROUTE = Stage(
    "route",
    INBOUND,
    "route_read_claimed",
    "id BIGINT, connection STRING, payload STRING, findings STRING, format STRING",
    doc="claim due inbound rows, route each by the configured rules (`routes.toml`) to its "
    "destinations, land one routed row per destination; a message no route takes is `unrouted`.",
    landing=Landing("landing_routed", ("run_id", "source_id", "destination", "route_name", "status")),
    output=ROUTED,
    event="routed",
    job="spark_jobs.route_job:bind",
    finalize=finalize_route,
    outcome=RouteOutcome,
    read_task_query="route_read_task",
)
TRANSFORM = Stage(
    "transform",
    ROUTED,
    "transform_read_claimed",
    "id BIGINT, source_id BIGINT, destination STRING, payload STRING, message_id STRING, control_id STRING, "
    "connection STRING",
    doc="claim due routed rows in lane order, rewrite each for its destination (`transforms.toml`, "
    "lookup tables from the store, code hooks), compute its outbound lane (`destinations.toml`), "
    "land. A message the rules cannot read is dead-lettered with the reason, never delivered unchanged.",
    landing=Landing(
        "landing_outbound",
        (
            "run_id",
            "source_id",
            "routed_id",
            "destination",
            "content_type",
            "lane_key",
            "payload",
            "message_id",
            "control_id",
        ),
    ),
    output=OUTBOUND,
    event="transformed",
    job="spark_jobs.transform_job:bind",
    finalize=finalize_transform,
    read_task_query="transform_read_task",
)
DELIVER = Stage(
    "deliver",
    OUTBOUND,
    "deliver_read_claimed",
    "id BIGINT, destination STRING, lane_key STRING, payload STRING, content_type STRING, idempotency_key STRING, "
    "attempts INT, message_id STRING, control_id STRING",
    doc="rounds of lane heads (one row per lane, per-lane FIFO) sent from Spark partitions to MLLP / "
    "TCP / HTTP / file destinations (`destinations.toml`) with an idempotency key; each round finalized "
    "fenced: done, retried with exponential backoff, or dead-lettered after the destination's "
    "`max_attempts`. A failing head holds only its own lane.",
    finalize=finalize_deliveries,
    outcome=DeliverOutcome,
)
STAGES = (ROUTE, TRANSFORM, DELIVER)
"""In pipeline order: a stage's work comes from the stages before it."""


def finalize_landed(tx: Tx, run: Run, *, stage: Stage, **_: Any) -> BatchOutcome:
    """Any batch stage's finalize, from its SQL alone: `<name>_landed` (one line per claimed row the
    run landed: `id`, `ok`, `detail`), then `<name>_finalize_insert` (`:run_id`, `:ids` — the rows
    this transaction has just finished — into `stage.output`, RETURNING the new rows), then the
    landing table's deletes. Same contract as `include.store.finalize.finalize_route`."""
    assert stage.output is not None and stage.landing is not None, f"stage {stage.name} is not a batch stage"
    params = run.begin(tx)
    landed = {int(r["id"]): r for r in tx.all(f"{stage.name}_landed", params)}
    done = run.finish(tx, stage.input, [i for i, r in landed.items() if r["ok"]])
    reasons = {i: dead_letter_reason(r["detail"]) for i, r in landed.items() if not r["ok"] and i in run.claimed}
    failed = dead_letter(tx, run, stage.input, reasons)
    rows = move_on(tx, run, f"{stage.name}_finalize_insert", params, done, to=stage.output, event=stage.event)
    clear_landing(tx, run, stage.landing.table, [*done, *failed])
    return BatchOutcome.of(run, rows, done, failed)


def stage_named(name: str) -> Stage:
    """The stage called `name`; ValueError if none is."""
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise ValueError(f"unknown stage {name!r}; known: {[s.name for s in STAGES]}")


def inline_query(store: Store, name: str, params: Mapping[str, Any]) -> str:
    """A named query with its parameters written in as SQL literals, for Spark's JDBC `query`.

    Spark sends a JDBC `query` as text (twice: a schema probe, then the read) and has no bind
    parameters, so values are rendered here: integers as digits, strings quoted with '' doubled
    (N'…' on SQL Server), None as NULL. Anything else is refused rather than guessed.
    """
    raw = queries.load(store.backend)[name]
    if "{" in raw:
        raw = raw.format_map(store.dialect.template)

    def literal(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in params:
            raise KeyError(f"query {name!r} needs parameter {key!r}")
        value = params[key]
        if value is None:
            return "NULL"
        if isinstance(value, int) and not isinstance(value, bool):
            return str(int(value))
        if isinstance(value, str):
            if "\x00" in value:
                raise ValueError(f"parameter {key!r} contains a NUL character")
            quoted = "'" + value.replace("'", "''") + "'"
            return "N" + quoted if store.backend == "sqlserver" else quoted
        raise TypeError(f"parameter {key!r}: cannot inline a {type(value).__name__} as a SQL literal")

    return _PARAM.sub(literal, raw)
