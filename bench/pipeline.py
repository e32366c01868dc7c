"""Stage throughput on a warm Spark Connect server: a backlog through route, transform and delivery
to files, beside the plain-Python peer (python-hl7, same rules) in the same invocation.

    store     a throwaway PostgreSQL cluster (fsync and synchronous_commit on) or a SQLite file
    backlog   `bench/hl7_corpus.py` messages staged in stage_inbound (lane = PID-3.1)
    Spark     one Spark Connect server on local[*], started here and warmed by one small run
    route     the route stage's phases (`spark_jobs.stage_job`), batch after batch until the backlog is empty
    transform the transform stage's phases, likewise (config/transforms.toml-like rules, lookup table)
    deliver   deliver_job.run to file destinations (atomic writes, two flushes per partition)
    mllp      deliver_job.run of `--mllp-rows` rows over 20 lanes to an MLLP receiver that ACKs each
              message (bench/peers/hl7_asyncio_server.py --mode ack), concurrency as the stage task
    peer      bench/peers/python_pipeline.run over the same payloads and the same configs, in memory;
              then the same on one process per core (bench/peers/all_cores.py)
    durable   bench/peers/durable_pipeline: the same loop claiming from and writing to plain staged
              tables on the same PostgreSQL server, one transaction per 1,000 messages (postgres only);
              then one worker per core sharing the table by FOR UPDATE SKIP LOCKED
    statements (--statements) the store's seconds per named statement during route + transform, and
              the same server's floor for that many row changes (bench/store_floor.py)
    overhead  one route run of a single message on the warm server (the per-micro-batch floor)
    warm-up   (--warm-messages N) N other messages routed and transformed into Spark's noop sink first, then N more
              through the route and transform stages (with --fhir-only, FHIR's), untimed
    plans     each stage's batches, the warm-up's and the measured ones, share one plan as a stage
              task's do (spark_jobs.stage_job.KeptPlans); --per-batch-plans: each batch builds its own;
              --all-optimizer-rules: the session runs the optimizer rules include.spark skips too
    code hook (--code-hook N) the `lab` destination's rules as native Spark SQL vs the same rules as a
              python-hl7 code hook (bench/code/bench_hooks.py, run through mapInArrow), and a hook
              that only parses and renders: N ORU rows through `transform_job.outbound_rows` into
              Spark's noop sink (no store I/O), best of two runs each, printed side by side
    fhir      (--fhir N) N other corpus messages staged, routed (one route: ADT, ORU, ORM) and
              transformed to FHIR R4 Bundles (`output = "fhir-r4"`, spark_jobs/hl7_fhir.py) through the
              store like the main run, beside bench/peers/fhir_peer.py building the same Bundles with
              python-hl7 and dicts in memory, one process and one per core, in the same invocation
              (--fhir-only: this and the warm-up alone)

Figures are messages/s (a message is one inbound row; fan-out makes ~1.6 routed rows each) and
seconds per phase. Latency under the real scheduler: bench/latency.py.

    uv run python bench/pipeline.py [--messages 100000] [--batch 20000] [--backend postgres] [--deliver-seconds 120]
                                    [--code-hook 20000] [--fhir 20000 [--fhir-only]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hl7_corpus import messages as corpus  # noqa: E402
from bench.ingest import cpu_seconds  # noqa: E402
from bench.peers import all_cores, durable_pipeline, fhir_peer, python_pipeline  # noqa: E402
from bench.store_floor import StatementTimes, bare_floor  # noqa: E402
from include.app.lab.postgres_server import PostgresServer, free_port  # noqa: E402
from include.config import StoreConfig  # noqa: E402
from include.destinations_config import parse_destinations  # noqa: E402
from include.routes_config import parse_routes  # noqa: E402
from include.spark import close_session, spark_session, start_connect_server, stop_connect_server  # noqa: E402
from include.stage_config import PipelineConfig, passthrough_destinations  # noqa: E402
from include.store import Store, lookups, rowlease  # noqa: E402
from include.store.lease import acquire_permanent  # noqa: E402
from include.store.migrate import migrate  # noqa: E402
from include.store.stages import ROUTE, TRANSFORM, Stage  # noqa: E402
from listeners.group_commit import new_message_id  # noqa: E402
from spark_jobs import deliver_job, stage_job, transform_job  # noqa: E402
from spark_jobs.route_job import routed_rows  # noqa: E402

ROUTES: list[dict[str, Any]] = [
    {
        "name": "adt-to-ehr",
        "destinations": ["ehr", "archive"],
        "when": {"field": "MSH-9.1", "op": "eq", "value": "ADT"},
    },
    {
        "name": "results",
        "destinations": ["lab", "archive"],
        "when": {
            "any": [{"field": "MSH-9.1", "op": "eq", "value": "ORU"}, {"field": "MSH-9.1", "op": "eq", "value": "ORM"}]
        },
    },
    {
        "name": "inpatients",
        "destinations": ["bedboard"],
        "when": {
            "all": [{"field": "PV1-2", "op": "eq", "value": "I"}, {"not": {"field": "PID-8", "op": "eq", "value": "U"}}]
        },
    },
]
SPECS: list[dict[str, Any]] = [
    {
        "destination": "ehr",
        "rules": [
            {"set": "MSH-5", "value": "EHR"},
            {"set": "MSH-6", "value": "MAIN"},
            {"map": "PV1-2", "table": "patient_class"},
            {"drop_segment": "ZPI"},
        ],
    },
    {
        "destination": "lab",
        "rules": [{"set": "MSH-5", "value": "LIS"}, {"clear": "PID-19"}, {"set": "OBX-11", "value": "F", "each": True}],
    },
    {"destination": "bedboard", "output": "json", "rules": [{"copy": "PID-3.1", "to": "PID-2"}]},
]
LOOKUPS = {"patient_class": {"I": "IN", "O": "OUT", "E": "EMER"}}
FHIR_ROUTES: list[dict[str, Any]] = [
    {
        "name": "to-fhir",
        "destinations": ["fhir"],
        "when": {"field": "MSH-9.1", "op": "in", "value": ["ADT", "ORU", "ORM"]},
    }
]
FHIR_SPECS: list[dict[str, Any]] = [
    {
        "destination": "fhir",
        "output": "fhir-r4",
        "fhir": {"identifier_systems": {"HOSP": "urn:oid:2.16.840.1.113883.19.7"}, "timezone": "+01:00"},
    }
]


def destinations(out: Path) -> dict[str, Any]:
    specs = [
        {
            "name": name,
            "kind": "file",
            "directory": str(out / name),
            **({"lane": "PID-3.1"} if name != "archive" else {}),
        }
        for name in ("ehr", "lab", "bedboard", "archive", "fhir")
    ]
    for s in specs:
        Path(s["directory"]).mkdir(parents=True, exist_ok=True)
    return parse_destinations(specs)


def stage_backlog(store: Store, payloads: list[str], epoch: int) -> None:
    from include.hl7path import value

    for start in range(0, len(payloads), 5000):
        chunk = payloads[start : start + 5000]
        with store.transaction() as tx:
            rowlease.stage_inbound(
                tx,
                [
                    {
                        "message_id": new_message_id(),
                        "control_id": value(p, "MSH-10"),
                        "connection": "bench",
                        "lane_key": value(p, "PID-3.1"),
                        "charset": None,
                        "payload": p,
                    }
                    for i, p in enumerate(chunk)
                ],
                epoch=epoch,
                node_id="bench",
            )


class Phases:
    """Seconds per phase, summed over batches; with `server` (the Spark Connect server's PID), also
    the server's CPU seconds during the Spark phase, which moves far less than wall time when other
    work loads the machine."""

    def __init__(self, server: int | None = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.batches = 0
        self.server = server
        self.server_cpu = 0.0

    def time(self, name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        cpu = cpu_seconds(self.server) if self.server and name == "spark" else None
        try:
            return fn()
        finally:
            self.seconds[name] += time.perf_counter() - started
            if cpu is not None and self.server:
                self.server_cpu += cpu_seconds(self.server) - cpu

    def line(self) -> str:
        cpu = f" (server CPU {self.server_cpu:.1f} s)" if self.server else ""
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()) + cpu


def drain(
    store: Store,
    spark: Any,
    epoch: int,
    batch: int,
    phases: Phases,
    stage: Stage,
    transform: stage_job.Transform,
    most: int | None = None,
    prefix: str = "",
    plans: stage_job.KeptPlans | None = None,
    **finalize_args: Any,
) -> int:
    """Run `stage` (ROUTE or TRANSFORM) batch after batch until nothing is claimed (or `most` rows
    were), timing the steps of `stage_job.run_stage_job`; `transform(claimed_frame, run_id=…)` is the
    stage's pure transform. `plans` (prefix `bench/`): the batches share one plan per stage, as a
    stage task's do, with the warm-up's; None: each builds its own."""
    done = 0
    while most is None or done < most:
        run = f"{prefix}{stage.name}_job-{phases.batches}"
        owner = f"bench/{run}"
        size = batch if most is None else min(batch, most - done)
        ids = phases.time("claim", lambda: stage_job.claim(store, stage, owner=owner, epoch=epoch, batch_size=size))
        if not ids:
            return done
        phases.time(
            "spark",
            lambda: stage_job.land(
                store,
                stage_job.landing_frame(
                    store, spark, stage, transform, owner=owner, epoch=epoch, run_id=run, ids=ids, plans=plans
                ),
                stage.landing,
                small=stage_job.is_small(ids),
            ),
        )
        out = phases.time(
            "finalize",
            lambda: stage_job.finalize(
                store, stage, run_id=run, owner=owner, epoch=epoch, claimed_ids=ids, **finalize_args
            ),
        )
        assert not out.not_finished, out.not_finished[:5]
        done += len(ids)
        phases.batches += 1
    return done


def fhir_stages(dests: dict[str, Any]) -> tuple[tuple[Stage, stage_job.Transform], ...]:
    """The route and transform stages with their transforms for FHIR output (FHIR_ROUTES, FHIR_SPECS)."""
    return (
        (ROUTE, partial(routed_rows, routes=parse_routes(FHIR_ROUTES))),
        (TRANSFORM, partial(transform_job.outbound_rows, specs=FHIR_SPECS, lookups={}, destinations=dests)),
    )


def route_frame(frame: Any, *, run_id: str) -> Any:
    """The route stage's transform under the bench's routes."""
    return frame.transform(routed_rows, parse_routes(ROUTES), run_id=run_id)


def transform_frame(frame: Any, *, run_id: str, dests: dict[str, Any]) -> Any:
    """The transform stage's transform under the bench's specs, lookups and `dests`."""
    return frame.transform(transform_job.outbound_rows, SPECS, LOOKUPS, dests, run_id=run_id)


def mllp_delivery(store: Store, spark: Any, epoch: int, payloads: list[str], n: int) -> str:
    """`n` outbound rows over 20 lanes delivered to an ACKing MLLP receiver; the figure line."""
    import subprocess

    port = free_port()
    peer = subprocess.Popen(
        [sys.executable, str(ROOT / "bench/peers/hl7_asyncio_server.py"), "--port", str(port), "--mode", "ack"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "ready"
        dests = parse_destinations(
            [
                {
                    "name": "ehr-mllp",
                    "kind": "mllp",
                    "host": "127.0.0.1",
                    "port": port,
                    "timeout_seconds": 10,
                    "lane": "PID-3.1",
                }
            ]
        )
        with store.transaction() as tx:
            cur = tx.conn.cursor()
            cur.execute(
                "INSERT INTO stage_outbound (source_id, message_id, destination, idempotency_key, lane_key) "
                "SELECT -g, 'mllp' || g, 'ehr-mllp', 'mllp' || g, 'ehr-mllp|P' || (g %% 20) "
                "FROM generate_series(1, %(n)s) g",
                {"n": n},
            )
            cur.execute(
                "INSERT INTO outbound_bodies (id, payload) SELECT o.id, %(p)s FROM stage_outbound o "
                "WHERE o.destination = 'ehr-mllp'",
                {"p": payloads[0]},
            )
        started = time.perf_counter()
        summary = deliver_job.run(
            store,
            spark,
            destinations=dests,
            owner="bench/mllp",
            epoch=epoch,
            max_lanes=5000,
            concurrency=4,
            time_budget_seconds=300,
        )
        took = time.perf_counter() - started
    finally:
        peer.terminate()
        peer.wait(10)
    return (
        f"mllp:      {len(summary.done):,} rows over 20 lanes in {took:.1f} s = {len(summary.done) / took:,.0f} "
        f"rows/s ({summary.rounds} rounds, {len(summary.retrying) + len(summary.dead)} failed)"
    )


def code_hook_versus_native(spark: Any, payloads: list[str], dests: dict[str, Any], n: int) -> list[str]:
    """The `lab` rules native vs as a code hook (module docstring); the figure lines."""
    import dataclasses

    results = [p for p in payloads if "|ORU^" in p.split("\r", 1)[0]]
    oru = [results[i % len(results)] for i in range(n)]
    frame = spark.createDataFrame(
        [(i, i, "lab", p, f"m{i}", f"C{i}", "bench") for i, p in enumerate(oru)], TRANSFORM.schema
    ).cache()
    frame.count()  # uploaded and cached once: the runs below time the transform alone
    code_dir = str(ROOT / "bench" / "code")
    no_lab = [s for s in SPECS if s["destination"] != "lab"]
    variants = {
        "native rules": (SPECS, dests),
        "code hook (same rules)": (no_lab, {**dests, "lab": dataclasses.replace(dests["lab"], code="bench_hooks:lab")}),
        "code hook (parse + render only)": (
            no_lab,
            {**dests, "lab": dataclasses.replace(dests["lab"], code="bench_hooks:identity")},
        ),
    }
    outputs: dict[str, list[str]] = {}
    rates: dict[str, float] = {}
    for name, (specs, variant_dests) in variants.items():

        def out() -> Any:
            return frame.transform(
                transform_job.outbound_rows, specs, LOOKUPS, variant_dests, run_id="hook", code_dir=code_dir
            )

        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            out().write.format("noop").mode("overwrite").save()
            best = min(best, time.perf_counter() - started)
        rates[name] = len(oru) / best
        outputs[name] = [r.payload for r in out().orderBy("routed_id").limit(200).collect()]
    same = sum(a == b for a, b in zip(outputs["native rules"], outputs["code hook (same rules)"]))
    native = rates["native rules"]
    frame.unpersist()
    return [
        f"code hook: {len(oru):,} ORU rows to `lab`, transform only (noop sink, best of 2; outputs identical "
        f"on {same} of the first {len(outputs['native rules'])})",
        "| lab transform | rows/s | vs native |",
        "|---|---|---|",
        *(f"| {name} | {rate:,.0f} | {rate / native:.2f}× |" for name, rate in rates.items()),
    ]


def fhir_versus_peer(
    store: Store,
    spark: Any,
    epoch: int,
    dests: dict[str, Any],
    n: int,
    batch: int,
    *,
    plans: stage_job.KeptPlans | None = None,
    server: int | None = None,
) -> list[str]:
    """Route + transform of `n` messages to FHIR Bundles through the store, and the peers (module
    docstring; `server`: the Spark Connect server's PID, for its CPU seconds); the figure lines."""
    from include.transforms_config import parse_transforms

    payloads = corpus(n, seed=27)
    before = count(store, "SELECT count(*) FROM stage_outbound WHERE destination = 'fhir'")
    stage_backlog(store, payloads, epoch)
    phases, tphases = Phases(server), Phases(server)
    seconds = []
    for stage_phases, (stage, job) in zip((phases, tphases), fhir_stages(dests)):
        started = time.perf_counter()
        drain(store, spark, epoch, batch, stage_phases, stage, job, passthrough=set(), plans=plans)
        seconds.append(time.perf_counter() - started)
    route_s, transform_s = seconds
    bundles = count(store, "SELECT count(*) FROM stage_outbound WHERE destination = 'fhir'") - before
    assert bundles == n, (bundles, n)  # every message of the corpus is an ADT, ORU or ORM
    rate = n / (route_s + transform_s)
    options = parse_transforms(FHIR_SPECS)[0].fhir
    assert options is not None
    started = time.perf_counter()
    peer_counts = fhir_peer.run(payloads, options)
    peer_rate = n / (time.perf_counter() - started)
    workers = all_cores.cores()
    wide_s, wide_counts = all_cores.fhir(payloads, options, workers=workers)
    assert wide_counts == peer_counts, (wide_counts, peer_counts)
    wide_rate = n / wide_s
    return [
        f"fhir:      {n:,} messages routed in {route_s:.1f} s ({phases.batches} batches: {phases.line()}) and "
        f"transformed to FHIR R4 Bundles in {transform_s:.1f} s ({tphases.batches} batches: {tphases.line()}); "
        f"plans {f'kept ({plans.built} built in all)' if plans else 'built per batch'}; peer: {peer_counts}",
        "| route + transform to FHIR R4 | msg/s | Stageline ÷ it |",
        "|---|---|---|",
        f"| Stageline (Spark Connect, local[*], through the store) | {rate:,.0f} | |",
        f"| peer: python-hl7 + dicts + json.dumps, 1 process, in memory | {peer_rate:,.0f} | {rate / peer_rate:.2f}× |",
        f"| the peer on {workers} processes | {wide_rate:,.0f} | {rate / wide_rate:.2f}× |",
    ]


def warm_jit(spark: Any, payloads: list[str], dests: dict[str, Any], *, fhir: bool = False) -> None:
    """Route and transform `payloads` into Spark's noop sink twice (no store I/O): a fresh JVM
    interprets Spark's expression code until its JIT has compiled it, which the first large batch
    otherwise pays for (--warm-messages); with `fhir`, each message to FHIR R4 as well."""
    inbound = spark.createDataFrame([(i, "bench", p, None, None) for i, p in enumerate(payloads)], ROUTE.schema)
    routed = inbound.transform(routed_rows, parse_routes(ROUTES), run_id="warm")
    claimed = (
        routed.where("status = 'pending'")
        .join(inbound.withColumnRenamed("id", "source_id"), "source_id")
        .select("source_id", "destination", "payload", "connection")
    )
    claimed = claimed.selectExpr(
        "source_id AS id",
        "source_id",
        "destination",
        "payload",
        "CAST(source_id AS STRING) AS message_id",
        "'C' AS control_id",
        "connection",
    )
    # --fhir: every message to the FHIR destination too (its mapping is other expression code).
    to_fhir = claimed.dropDuplicates(["id"]).selectExpr(
        "id", "source_id", "'fhir' AS destination", "payload", "message_id", "control_id", "connection"
    )
    for _ in range(2):
        routed.write.format("noop").mode("overwrite").save()
        claimed.transform(transform_job.outbound_rows, SPECS, LOOKUPS, dests, run_id="warm").write.format("noop").mode(
            "overwrite"
        ).save()
        if fhir:
            to_fhir.transform(transform_job.outbound_rows, FHIR_SPECS, {}, dests, run_id="warm").write.format(
                "noop"
            ).mode("overwrite").save()


def bench_database(server: PostgresServer) -> StoreConfig:
    """A `bench` database on `server`, and the store config that reaches it."""
    server.execute("CREATE DATABASE bench")
    return StoreConfig(
        backend="postgres", server=server.host, port=server.port, database="bench", username=server.user, pool_size=8
    )


def bench_store(cfg: StoreConfig, *, node: str = "bench") -> tuple[Store, int]:
    """The store at `cfg` migrated, its leader lease held for good by `node`, the lookup tables in
    place; the store and the lease's epoch."""
    store = Store(cfg)
    migrate(store, cluster_name=node)
    epoch = acquire_permanent(store, node_id=node)
    with store.transaction() as tx:
        for name, table in LOOKUPS.items():
            lookups.replace_table(tx, name, table)
    return store, epoch


def count(store: Store, sql: str) -> int:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(sql)
        return int(next(iter(dict(cur.fetchone()).values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=20_000, help="rows claimed per route/transform run")
    parser.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument(
        "--deliver-seconds",
        type=float,
        default=120.0,
        help="time budget for delivering the outbound rows to files (0: skip)",
    )
    parser.add_argument(
        "--mllp-rows", type=int, default=20_000, help="rows delivered to an MLLP receiver over 20 lanes (0: skip)"
    )
    parser.add_argument(
        "--warm-messages",
        type=int,
        default=0,
        metavar="N",
        help="before timing, route and transform N other messages into Spark's noop sink, then N more "
        "through the stages themselves (untimed; delivery, if timed, sends them too), so the server's "
        "JIT has compiled the hot paths, as on a server that has been running (0: skip)",
    )
    parser.add_argument(
        "--statements",
        action="store_true",
        help="also print the store's time per statement during route + transform, and the "
        "server's floor for the same number of row changes (bench/store_floor.py)",
    )
    parser.add_argument(
        "--code-hook",
        type=int,
        default=0,
        metavar="ROWS",
        help="also time the lab rules native vs as a python-hl7 code hook over ROWS ORU rows (0: skip)",
    )
    parser.add_argument(
        "--fhir",
        type=int,
        default=0,
        metavar="N",
        help="also route + transform N messages to FHIR R4 Bundles beside the python peer (0: skip)",
    )
    parser.add_argument("--fhir-only", action="store_true", help="with --fhir: skip the main pipeline run")
    parser.add_argument(
        "--per-batch-plans",
        action="store_true",
        help="every batch builds (and the server analyses) its own plan, as before stage_job.KeptPlans",
    )
    parser.add_argument(
        "--all-optimizer-rules",
        action="store_true",
        help="the session runs every optimizer rule (include.spark.SKIPPED_OPTIMIZER_RULES too)",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stageline-bench-"))
    server = None
    if args.backend == "postgres":
        server = PostgresServer().start()
        cfg = bench_database(server)
    else:
        cfg = StoreConfig(backend="sqlite", path=str(work / "bench.db"))
    connect = None
    spark = None
    try:
        store, epoch = bench_store(cfg)

        port = free_port()
        started = time.perf_counter()
        connect = start_connect_server(port, log_dir=work / "log")
        every_rule = {"spark.sql.optimizer.excludedRules": ""} if args.all_optimizer_rules else {}
        spark = spark_session(remote=f"sc://127.0.0.1:{port}", conf=every_rule)
        print(f"Spark Connect server up in {time.perf_counter() - started:.1f} s")
        dests = destinations(work / "out")

        # warm-up and per-micro-batch overhead: single-message route runs on the warm server
        extra = corpus(3, seed=99)
        overheads = []
        for i, p in enumerate(extra):
            with store.transaction() as tx:
                rowlease.stage_inbound(
                    tx,
                    [
                        {
                            "message_id": f"o{i}",
                            "control_id": f"O{i}",
                            "connection": "bench",
                            "lane_key": "warm",
                            "charset": None,
                            "payload": p,
                        }
                    ],
                    epoch=epoch,
                    node_id="bench",
                )
            t = time.perf_counter()
            stage_job.run_stage_job(
                ROUTE,
                store,
                spark,
                transform=partial(routed_rows, routes=parse_routes(ROUTES)),
                owner=f"bench/warm{i}",
                epoch=epoch,
                run_id=f"warm{i}",
                batch_size=1,
            )
            overheads.append(time.perf_counter() - t)
        stage_job.run_stage_job(
            TRANSFORM,
            store,
            spark,
            transform=transform_job.bind(
                stage_job.StageContext(store, PipelineConfig(Path("/nonexistent"), [], dests, SPECS))  # type: ignore[arg-type]
            ),
            passthrough=passthrough_destinations(SPECS, dests),
            owner="bench/warm-t",
            epoch=epoch,
            run_id="warm-t",
        )
        deliver_job.run(store, spark, destinations=dests, owner="bench/warm-d", epoch=epoch)

        # One stage task per stage, as in the DAGs: its batches (the warm-up's and the measured ones)
        # share one plan (stage_job.KeptPlans), built by its first batch.
        plans = None if args.per_batch_plans else stage_job.KeptPlans("bench/")
        if args.warm_messages:
            started = time.perf_counter()
            warm_jit(spark, corpus(args.warm_messages, seed=2), dests, fhir=bool(args.fhir))
            # ...and the stages' own path (JDBC read, land, finalize) over other messages, untimed: a
            # server that has been running has compiled that code too, and a cold JIT's compiler
            # threads would otherwise bill the measured batches (docs/stages.md, "Per micro-batch").
            # With --fhir-only, the stages that are measured: FHIR's route and transform.
            stage_backlog(store, corpus(args.warm_messages, seed=3), epoch)
            warm_stages = (
                fhir_stages(dests)
                if args.fhir_only
                else ((ROUTE, route_frame), (TRANSFORM, partial(transform_frame, dests=dests)))
            )
            for stage, fn in warm_stages:
                drain(
                    store,
                    spark,
                    epoch,
                    args.batch,
                    Phases(),
                    stage,
                    fn,
                    prefix="warm-",
                    plans=plans,
                    passthrough=set() if args.fhir_only else passthrough_destinations(SPECS, dests),
                )
            print(
                f"warmed the server's JIT with {args.warm_messages:,} messages in {time.perf_counter() - started:.1f} s"
            )

        if args.fhir_only:
            fhir = fhir_versus_peer(store, spark, epoch, dests, args.fhir, args.batch, plans=plans, server=connect.pid)
            print("\n".join(fhir))
            store.close()
            return
        payloads = corpus(args.messages, seed=1)
        started = time.perf_counter()
        stage_backlog(store, payloads, epoch)
        print(f"staged {len(payloads):,} messages on {args.backend} in {time.perf_counter() - started:.1f} s")

        times = StatementTimes()
        recording = times.recording() if args.statements else nullcontext(times)
        with recording:  # --statements: the store's time per statement
            phases = Phases(connect.pid)
            routed_before = count(store, "SELECT count(*) FROM stage_routed")
            started = time.perf_counter()
            passthrough = passthrough_destinations(SPECS, dests)
            routed_msgs = drain(
                store,
                spark,
                epoch,
                args.batch,
                phases,
                ROUTE,
                route_frame,
                plans=plans,
                passthrough=passthrough,
            )
            route_s = time.perf_counter() - started
            n_routed = count(store, "SELECT count(*) FROM stage_routed") - routed_before
            n_direct = count(store, "SELECT count(*) FROM stage_routed WHERE status = 'done'") - routed_before
            print(
                f"route:     {routed_msgs:,} messages → {n_routed:,} routed rows ({n_direct:,} to a pass-through "
                f"destination, handed on by the route finalize) in {route_s:.1f} s = "
                f"{routed_msgs / route_s:,.0f} msg/s ({phases.batches} batches: {phases.line()})"
            )

            tphases = Phases(connect.pid)
            started = time.perf_counter()
            transformed = drain(
                store,
                spark,
                epoch,
                args.batch,
                tphases,
                TRANSFORM,
                partial(transform_frame, dests=dests),
                plans=plans,
                passthrough=passthrough,
            )
            transform_s = time.perf_counter() - started
        print(
            f"transform: {transformed:,} routed rows in {transform_s:.1f} s = {transformed / transform_s:,.0f} rows/s"
            f" = {routed_msgs / transform_s:,.0f} msg/s ({tphases.batches} batches: {tphases.line()})"
        )

        deliver_line = "deliver:   skipped"
        if args.deliver_seconds:
            started = time.perf_counter()
            summary = deliver_job.run(
                store,
                spark,
                destinations=dests,
                owner="bench/deliver",
                epoch=epoch,
                max_lanes=5000,
                time_budget_seconds=args.deliver_seconds,
            )
            deliver_s = time.perf_counter() - started
            deliver_line = (
                f"deliver:   {len(summary.done):,} rows to files in {deliver_s:.1f} s = "
                f"{len(summary.done) / deliver_s:,.0f} rows/s ({summary.rounds} rounds of lane heads, "
                f"{len(summary.retrying) + len(summary.dead)} failed)"
            )
        print(deliver_line)
        if args.mllp_rows and server is not None:  # generate_series: PostgreSQL
            print(mllp_delivery(store, spark, epoch, payloads, args.mllp_rows))
        hook_lines = code_hook_versus_native(spark, payloads, dests, args.code_hook) if args.code_hook else []
        fhir_lines = (
            fhir_versus_peer(store, spark, epoch, dests, args.fhir, args.batch, plans=plans, server=connect.pid)
            if args.fhir
            else []
        )

        started = time.perf_counter()
        peer_counts = python_pipeline.run(payloads, ROUTES, SPECS, LOOKUPS)
        peer_s = time.perf_counter() - started
        peer_rate = len(payloads) / peer_s
        print(
            f"peer:      python-hl7 route + transform of {len(payloads):,} messages in {peer_s:.1f} s = "
            f"{peer_rate:,.0f} msg/s ({peer_counts})"
        )

        workers = all_cores.cores()
        wide_s, wide_counts = all_cores.in_memory(payloads, ROUTES, SPECS, LOOKUPS, workers=workers)
        wide_rate = len(payloads) / wide_s
        print(
            f"peer ×{workers}:  the same on {workers} processes in {wide_s:.1f} s = {wide_rate:,.0f} msg/s "
            f"({wide_counts})"
        )

        durable_rate = wide_durable_rate = None
        if server is not None:
            import psycopg

            with psycopg.connect(host=server.host, port=server.port, user=server.user, dbname="bench") as conn:
                durable_pipeline.load(conn, payloads)
                started = time.perf_counter()
                durable_counts = durable_pipeline.drain(conn, python_pipeline.Pipeline(ROUTES, SPECS, LOOKUPS))
                durable_s = time.perf_counter() - started
            durable_rate = len(payloads) / durable_s
            print(
                f"durable:   the same loop over staged tables, {len(payloads):,} messages in {durable_s:.1f} s = "
                f"{durable_rate:,.0f} msg/s ({durable_counts})"
            )
            conninfo = server.conninfo("bench")
            wide_durable_s, wide_durable_counts = all_cores.durable(
                conninfo, payloads, ROUTES, SPECS, LOOKUPS, workers=workers
            )
            wide_durable_rate = len(payloads) / wide_durable_s
            print(
                f"durable ×{workers}: {workers} processes claiming by SKIP LOCKED, {wide_durable_s:.1f} s = "
                f"{wide_durable_rate:,.0f} msg/s ({wide_durable_counts})"
            )

        both = routed_msgs / (route_s + transform_s)

        def cell(rate: float | None) -> str:
            return f"{rate:,.0f} msg/s ({both / rate:.2f}×)" if rate else "(postgres only)"

        print(
            "\n| | Stageline (Spark Connect, local[*]) | peer (python-hl7, in memory) "
            "| durable peer (python-hl7 + SQL) |"
        )
        print("|---|---|---|---|")
        print(
            f"| route | {routed_msgs / route_s:,.0f} msg/s (finalize {phases.seconds['finalize'] / route_s:.0%}) | | |"
        )
        print(
            f"| transform | {routed_msgs / transform_s:,.0f} msg/s ({transformed / transform_s:,.0f} rows/s, "
            f"finalize {tphases.seconds['finalize'] / transform_s:.0%}) | | |"
        )
        print(
            f"| route + transform (Stageline ÷ peer in brackets) | {both:,.0f} msg/s "
            f"| 1 process: {cell(peer_rate)} | 1 process: {cell(durable_rate)} |"
        )
        print(f"| the peers on all {workers} cores | | {cell(wide_rate)} | {cell(wide_durable_rate)} |")
        print(
            f"| Spark server CPU per 10,000 messages | route {phases.server_cpu * 1e4 / routed_msgs:.2f} s, "
            f"transform {tphases.server_cpu * 1e4 / routed_msgs:.2f} s | | |"
        )
        print(
            f"| micro-batch overhead (1 message, warm) | median {statistics.median(overheads):.2f} s "
            f"(runs: {', '.join(f'{o:.2f}' for o in overheads)}) | | |"
        )
        if hook_lines:
            print("\n" + "\n".join(hook_lines))
        if fhir_lines:
            print("\n" + "\n".join(fhir_lines))
        if args.statements:
            print("\n" + "\n".join(times.lines()))
            if server is not None:
                print("\n".join(bare_floor(server.conninfo("bench"), n_routed)))
        store.close()
    finally:
        close_session(spark)  # before the server stops: pyspark's exit hook would wait on it for minutes
        if connect is not None:
            stop_connect_server(connect)
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
