"""The plain-Python peers on every core: what a user choosing a Python loop over Stageline would run
on this machine — one worker process per core, not one loop.

    in_memory(payloads, routes, specs, lookups, workers)
        the in-memory peer (`python_pipeline.run`) over `workers` processes, each taking an equal
        contiguous share of the payloads; wall time includes the pool's start (a real deployment
        pays it once, so it is small beside the run) but not the payloads' transfer, which a worker
        reading its own input would not pay either: each worker is handed its share before the clock
        starts.
    fhir(payloads, options, workers)
        the FHIR peer (`fhir_peer.run`) likewise, each process converting its share.
    durable(conninfo, pipeline_args, workers, batch)
        the durable peer's claim → process → insert → finish loop (`durable_pipeline.drain`) in
        `workers` processes, each with its own connection, sharing one staged table by
        `FOR UPDATE SKIP LOCKED` as a real multi-worker consumer does. The table is loaded first
        (`durable_pipeline.load`), outside the clock.

Workers are forked (the corpus and the configs are plain data) and started before the clock; a
barrier lets all of them begin together, and the figure is the wall time from the barrier until the
last worker ends.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from bench.peers import durable_pipeline, fhir_peer, python_pipeline


def cores() -> int:
    """The cores this process may run on (the affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def _merge(parts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    total = python_pipeline.new_counts()
    for part in parts:
        for name, n in part.items():
            total[name] = total.get(name, 0) + n
    return total


def _run_workers(target: Any, args_per_worker: list[tuple[Any, ...]]) -> tuple[float, dict[str, int]]:
    """Start one forked process per args tuple, release them together; (seconds, merged counts)."""
    ctx = mp.get_context("fork")
    ready = ctx.Barrier(len(args_per_worker) + 1)
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=target, args=(ready, results, *a), daemon=True) for a in args_per_worker]
    for p in procs:
        p.start()
    ready.wait()
    started = time.perf_counter()
    parts = [results.get() for _ in procs]
    seconds = time.perf_counter() - started
    for p in procs:
        p.join(30)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed or any(isinstance(part, str) for part in parts):
        raise RuntimeError(f"peer worker failed: exit codes {failed}, {[p for p in parts if isinstance(p, str)]}")
    return seconds, _merge(parts)


def _in_memory_worker(ready: Any, results: Any, payloads: list[str], configs: tuple[Any, ...]) -> None:
    pipeline = python_pipeline.Pipeline(*configs)
    counts = python_pipeline.new_counts()
    ready.wait()
    try:
        for payload in payloads:
            pipeline.process(payload, counts)
    except Exception as exc:  # reported, not swallowed: the parent raises
        results.put(f"{type(exc).__name__}: {exc}")
        return
    results.put(counts)


def in_memory(
    payloads: list[str],
    routes: Sequence[Any],
    specs: Sequence[Any],
    lookups: Any = None,
    *,
    workers: int | None = None,
) -> tuple[float, dict[str, int]]:
    """Route and transform every payload over `workers` processes (default: one per core)."""
    n = workers or cores()
    share = -(-len(payloads) // n)
    chunks = [payloads[i : i + share] for i in range(0, len(payloads), share)]
    return _run_workers(_in_memory_worker, [(chunk, (routes, specs, lookups)) for chunk in chunks])


def _durable_worker(ready: Any, results: Any, conninfo: str, configs: tuple[Any, ...], batch: int) -> None:
    import psycopg

    pipeline = python_pipeline.Pipeline(*configs)
    with psycopg.connect(conninfo) as conn:
        conn.execute("SELECT 1")  # connected before the clock
        conn.commit()
        ready.wait()
        try:
            counts = durable_pipeline.drain(conn, pipeline, batch=batch)
        except Exception as exc:
            results.put(f"{type(exc).__name__}: {exc}")
            return
    results.put(counts)


def durable(
    conninfo: str,
    payloads: list[str],
    routes: Sequence[Any],
    specs: Sequence[Any],
    lookups: Any = None,
    *,
    workers: int | None = None,
    batch: int = 1000,
) -> tuple[float, dict[str, int]]:
    """Load `payloads` into the durable peer's table, then drain it with `workers` processes
    (default: one per core) claiming by SKIP LOCKED."""
    import psycopg

    with psycopg.connect(conninfo) as conn:
        durable_pipeline.load(conn, payloads)
    n = workers or cores()
    return _run_workers(_durable_worker, [(conninfo, (routes, specs, lookups), batch)] * n)


def _fhir_worker(ready: Any, results: Any, payloads: list[str], options: Any) -> None:
    ready.wait()
    try:
        counts = fhir_peer.run(payloads, options)
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
        return
    results.put(counts)


def fhir(payloads: list[str], options: Any, *, workers: int | None = None) -> tuple[float, dict[str, int]]:
    """Convert every payload to a FHIR Bundle over `workers` processes (default: one per core)."""
    n = workers or cores()
    share = -(-len(payloads) // n)
    chunks = [payloads[i : i + share] for i in range(0, len(payloads), share)]
    seconds, counts = _run_workers(_fhir_worker, [(chunk, options) for chunk in chunks])
    return seconds, {name: counts[name] for name in ("bundles", "entries")}  # not the route peer's zeros
