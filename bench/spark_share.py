"""Where a route and a transform micro-batch spend their Spark time, step by step, in server CPU.

bench/pipeline.py times a stage's Spark phase as one figure; this splits it. On a warm Spark Connect
server (local[*]) and a throwaway PostgreSQL, one claim of `--rows` rows per stage (10,000 by default:
the stage task's batch cap, `plugins/stageline_airflow/tasks.py` BATCH_SIZE), and for each stage:

    analysis    the landing frame's schema from a fresh DataFrame: one AnalyzePlan round trip, i.e.
                the server's analysis of the stage's whole expression tree and nothing else
    plan only   the same job over no rows (an owner that claimed nothing) into Spark's noop sink:
                everything a job costs that does not grow with its rows
    read        the JDBC read of the claimed rows alone, into the noop sink
    compute     read + the stage's transform, into the noop sink
    land        read + transform + the JDBC append into the landing table (what the stage runs)
    kept        compute and land again on the plan kept across batches (`stage_job.KeptPlans`): the
                landing frame built once over a read that is the same every batch, its analysis
                cached by the server, each run only swapping the run id on top

Each step runs `--rounds` times after one unmeasured round (the JIT compiles Spark's code during
the first ones); the table holds medians of the Spark Connect server's CPU seconds (`/proc`, the
whole JVM: it moves far less than wall time when other work loads the machine) and wall seconds.

With `--fhir` the transform stage maps every message to FHIR R4 (`output = "fhir-r4"`, the
bench's FHIR route and destination), the plan whose analysis costs most.

    uv run python bench/spark_share.py [--rows 10000] [--rounds 5] [--warm-messages 10000] [--fhir]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hl7_corpus import messages as corpus  # noqa: E402
from bench.ingest import cpu_seconds  # noqa: E402
from bench.pipeline import (  # noqa: E402
    FHIR_ROUTES,
    FHIR_SPECS,
    LOOKUPS,
    ROUTES,
    SPECS,
    bench_database,
    bench_store,
    destinations,
    stage_backlog,
    warm_jit,
)
from include.app.lab.postgres_server import PostgresServer, free_port  # noqa: E402
from include.routes_config import parse_routes  # noqa: E402
from include.spark import close_session, spark_session, start_connect_server, stop_connect_server  # noqa: E402
from include.stage_config import passthrough_destinations  # noqa: E402
from include.store import Store  # noqa: E402
from include.store.stages import ROUTE, TRANSFORM, Stage  # noqa: E402
from spark_jobs import stage_job, transform_job  # noqa: E402
from spark_jobs.route_job import routed_rows  # noqa: E402


def measured(pid: int, rounds: int, fn: Callable[[], Any]) -> tuple[float, float]:
    """Median server CPU and wall seconds of `fn` over `rounds` runs, after one unmeasured run."""
    fn()
    cpus, walls = [], []
    for _ in range(rounds):
        cpu, started = cpu_seconds(pid), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - started)
        cpus.append(cpu_seconds(pid) - cpu)
    return statistics.median(cpus), statistics.median(walls)


def stage_steps(
    store: Store,
    spark: Any,
    stage: Stage,
    transform: Callable[[Any, str], Any],
    *,
    pid: int,
    epoch: int,
    rows: int,
    rounds: int,
    **finalize_args: Any,
) -> list[str]:
    """Claim `rows` rows of `stage`, time its steps on them, then land and finalize them for real
    (the transform stage reads what the route stage finalized); the table's rows."""
    assert stage.landing is not None
    owner = f"bench/share-{stage.name}"
    ids = stage_job.claim(store, stage, owner=owner, epoch=epoch, batch_size=rows)
    columns = list(stage.landing.columns)

    def read(who: str = owner) -> Any:
        return stage_job.read_claimed(store, spark, stage, owner=who, epoch=epoch, ids=ids)

    def noop(frame: Any) -> None:
        frame.write.format("noop").mode("overwrite").save()

    landed = iter(range(1_000_000))

    def land() -> None:
        run = f"share-{next(landed)}"
        stage_job.land(store, transform(read(), run), stage.landing)
        stage.landing.discard(store, run)

    plans = stage_job.KeptPlans(owner)

    def kept_transform(claimed: Any, *, run_id: str) -> Any:
        return transform(claimed, run_id)

    def kept(run: str) -> Any:
        return stage_job.landing_frame(
            store, spark, stage, kept_transform, owner=owner, epoch=epoch, run_id=run, ids=ids, plans=plans
        )

    def kept_land() -> None:
        run = f"share-{next(landed)}"
        stage_job.land(store, kept(run), stage.landing)
        stage.landing.discard(store, run)

    steps = {
        "analysis": lambda: transform(read(), "r").select(*columns).schema,
        "plan only (no rows)": lambda: noop(transform(read("bench/nobody"), "r").select(*columns)),
        "read": lambda: noop(read()),
        "compute (read + transform)": lambda: noop(transform(read(), "r").select(*columns)),
        "land (read + transform + JDBC append)": land,
        "compute, plan kept": lambda: noop(kept(f"share-{next(landed)}")),
        "land, plan kept": kept_land,
    }
    lines = []
    for name, fn in steps.items():
        cpu, wall = measured(pid, rounds, fn)
        lines.append(f"| {stage.name} | {name} | {cpu:.2f} | {wall:.2f} | {cpu * 10_000 / len(ids):.2f} |")
    assert plans.built == 1, plans.built  # one frame built, reused by every other kept run
    stage_job.land(store, transform(read(), "share"), stage.landing)
    stage_job.finalize(store, stage, run_id="share", owner=owner, epoch=epoch, claimed_ids=ids, **finalize_args)
    return [f"| {stage.name} | claimed | {len(ids):,} rows | | |", *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000, help="rows claimed per stage")
    parser.add_argument("--rounds", type=int, default=5, help="measured runs per step (medians)")
    parser.add_argument("--warm-messages", type=int, default=10_000, metavar="N", help="JIT warm-up first")
    parser.add_argument("--fhir", action="store_true", help="route to FHIR and transform to FHIR R4 Bundles")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stageline-share-"))
    server = PostgresServer().start()
    connect = spark = None
    try:
        store, epoch = bench_store(bench_database(server))
        port = free_port()
        connect = start_connect_server(port, log_dir=work / "log")
        spark = spark_session(remote=f"sc://127.0.0.1:{port}")
        dests = destinations(work / "out")
        if args.warm_messages:
            warm_jit(spark, corpus(args.warm_messages, seed=2), dests, fhir=args.fhir)
        stage_backlog(store, corpus(args.rows, seed=1), epoch)
        specs, lookups = (FHIR_SPECS, {}) if args.fhir else (SPECS, LOOKUPS)
        passthrough = passthrough_destinations(specs, dests)
        routes = parse_routes(FHIR_ROUTES if args.fhir else ROUTES)
        print("| stage | step | server CPU s | wall s | CPU s per 10,000 rows |")
        print("|---|---|---|---|---|")
        for stage, transform in (
            (ROUTE, lambda frame, run: frame.transform(routed_rows, routes, run_id=run)),
            (
                TRANSFORM,
                lambda frame, run: frame.transform(transform_job.outbound_rows, specs, lookups, dests, run_id=run),
            ),
        ):
            lines = stage_steps(
                store,
                spark,
                stage,
                transform,
                pid=connect.pid,
                epoch=epoch,
                rows=args.rows,
                rounds=args.rounds,
                passthrough=passthrough,
            )
            print("\n".join(lines), flush=True)
        store.close()
    finally:
        close_session(spark)
        if connect is not None:
            stop_connect_server(connect)
        server.stop()


if __name__ == "__main__":
    main()
