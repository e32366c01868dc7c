"""Search (issue 26) on PostgreSQL: find by business key and content search over a day of a million
messages, each beside the same search without its index; and what indexing the keys costs the
route stage.

    store     a throwaway PostgreSQL cluster (fsync and synchronous_commit on)
    day       --messages (1,000,000) inbound rows spread over the last 24 h with bodies (`bench/hl7_corpus.py`-
              like ADT/ORU, ~400 bytes, --patients MRNs) and their keys (mrn, event, visit: what the
              indexer writes), generated in SQL (generate_series), not through listenerd
    key       `include.store.keys.find` of random MRNs, exact (--lookups of them) and by prefix:
              p50/p99 ms; then the same with message_keys_search dropped
    content   `include.store.search.find` of a text a few messages hold, over the whole day, newest 50:
              without the trigram index, then with it (its build time too), best of --repeat
    route     (--route N, needs Spark) the route stage's phases over N staged messages as
              bench/pipeline.py runs them, without and with `keys.index` of each claim in a thread
              alongside Spark (as the route task runs it), --rounds of each, alternating; msg/s
              each, and the indexer's own time in its thread

    uv run python bench/search.py [--messages 1000000] [--lookups 1000] [--route 50000 [--rounds 2] [--batch 20000]]
    (--messages 0: the route runs only)

With --sqlite: the same day in a SQLite store (fsync on, WAL), content search without and with the
FTS5 trigram index (`stageline messages content-index`: its build time and the store's size), and
--ingest messages written 100 a transaction before and after it (what its triggers cost ingest).

    uv run python bench/search.py --sqlite [--messages 1000000] [--ingest 20000]

Figures: docs/performance.md ("Search").
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from include.app.lab.postgres_server import PostgresServer  # noqa: E402
from include.config import StoreConfig  # noqa: E402
from include.keys_config import parse_keys  # noqa: E402
from include.store import Store  # noqa: E402
from include.store import keys as K  # noqa: E402
from include.store import search as S  # noqa: E402
from include.store.lease import acquire_permanent  # noqa: E402
from include.store.migrate import migrate  # noqa: E402

RULES = parse_keys({"keys": {"mrn": "PID-3.1", "event": "MSH-9.2", "visit": "PV1-19"}})
NEEDLE = "NEEDLE-7731"


def execute(store: Store, *statements: str) -> None:
    with store.transaction() as tx:
        cur = tx.conn.cursor()
        for sql in statements:
            cur.execute(sql)


def day_sql(patients: int, *, sqlite: bool = False) -> tuple[str, str, str]:
    """The SQL of message `i`'s MRN, event and body (ADT, every third an ORU; ~400 bytes)."""
    mrn = f"'P' || lpad(CAST((CAST(i AS bigint) * 7919) % {patients} AS text), 7, '0')"
    if sqlite:
        mrn = f"'P' || printf('%07d', (i * 7919) % {patients})"
    event = "CASE WHEN i % 3 = 0 THEN 'R01' ELSE 'A0' || CAST(i % 8 + 1 AS text) END"
    body = (
        "'MSH|^~\\&|' || CASE WHEN i % 3 = 0 THEN 'LAB|LABFAC' ELSE 'ADT1|HOSP' END || '|STAGELINE|SL|20261127120000||'"
        f" || CASE WHEN i % 3 = 0 THEN 'ORU^' ELSE 'ADT^' END || {event} || '|C' || CAST(i AS text) || '|P|2.5.1'"
        " || chr(13) || 'EVN|A01|20261127120000' || chr(13)"
        f" || 'PID|1||' || {mrn} || '^^^HOSP^MR~' || CAST(i % 999983 AS text) || '^^^SSA^SS||'"
        " || CASE WHEN i % 100000 = 17 THEN '"
        + NEEDLE
        + "' ELSE 'DOE' END || '^JANE^Q||19700101|F|||1 MAIN ST^^METRO^ST^12345'"
        " || chr(13) || 'PV1|1|' || CASE WHEN i % 2 = 0 THEN 'I' ELSE 'O' END"
        " || '|W^1^2||||1234^WELBY^MARCUS|||MED|||||||||V'"
        " || CAST(i % 500000 AS text) || chr(13)"
        " || CASE WHEN i % 3 = 0 THEN 'OBR|1|ORD' || CAST(i AS text) || '|F' || CAST(i AS text) || '|2345-7^GLUCOSE^LN'"
        " || chr(13) || 'OBX|1|NM|2345-7^GLUCOSE^LN||' || CAST(70 + i % 60 AS text) || '|mg/dL|70-99|N|||F' || chr(13)"
        " ELSE '' END"
    )
    return mrn, event, body.replace("chr(13)", "char(13)") if sqlite else body


def fill_day(store: Store, n: int, patients: int) -> None:
    """`n` finished messages over the last day, bodies and keys, in SQL; NEEDLE in every 100,000th."""
    mrn, event, body = day_sql(patients)
    at = f"now() - make_interval(secs => 86400.0 * ({n} - i) / {n} + 1)"
    step = 250_000
    for lo in range(1, n + 1, step):
        hi = min(n, lo + step - 1)
        series = f"generate_series({lo}, {hi}) AS s(i)"
        execute(
            store,
            "INSERT INTO stage_inbound (message_id, control_id, connection, lane_key, status, attempts, created_at,"
            f" updated_at) SELECT 'm' || lpad(CAST(i AS text), 31, '0'), 'C' || CAST(i AS text),"
            f" CASE WHEN i % 3 = 0 THEN 'lab-in' ELSE 'adt-in' END, {mrn}, 'done', 1, {at}, {at} FROM {series}",
            f"INSERT INTO inbound_bodies (id, payload) SELECT i, {body} FROM {series}",
            "INSERT INTO message_keys (message, name, value, received_at, connection)"
            f" SELECT i, 'mrn', {mrn}, {at}, CASE WHEN i % 3 = 0 THEN 'lab-in' ELSE 'adt-in' END FROM {series}"
            f" UNION ALL SELECT i, 'event', {event}, {at}, CASE WHEN i % 3 = 0 THEN 'lab-in' ELSE 'adt-in' END"
            f" FROM {series}"
            f" UNION ALL SELECT i, 'visit', 'V' || CAST(i % 500000 AS text), {at},"
            f" CASE WHEN i % 3 = 0 THEN 'lab-in' ELSE 'adt-in' END FROM {series}",
        )
    execute(
        store,
        "SELECT setval(pg_get_serial_sequence('stage_inbound', 'id'), (SELECT max(id) FROM stage_inbound))",
        f"UPDATE key_progress SET last_id = {n}",
    )
    with store.transaction() as tx:  # VACUUM cannot run in a transaction: autovacuum's statistics instead
        tx.conn.cursor().execute("ANALYZE")


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return (time.perf_counter() - started) * 1000, out


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def key_lookups(store: Store, mrns: list[str], *, prefix: bool = False) -> tuple[list[float], int]:
    times, rows = [], 0
    for mrn in mrns:
        query = K.KeyQuery(name="mrn", value=mrn, prefix=prefix)
        ms, found = timed(lambda q=query: K.find(store, q))
        times.append(ms)
        rows += len(found)
    return times, rows


def line(what: str, times: list[float], rows: int) -> str:
    return (
        f"{what}: {len(times)} searches, p50 {percentile(times, 50):.1f} ms, p99 {percentile(times, 99):.1f} ms, "
        f"max {max(times):.1f} ms, {rows / len(times):.1f} rows each"
    )


def content(store: Store, text: str, repeat: int) -> tuple[float, int]:
    best, rows = float("inf"), 0
    for _ in range(repeat):
        ms, found = timed(lambda: S.find(store, S.ContentQuery(text=text), timeout=600))
        best, rows = min(best, ms), len(found)
    return best, rows


def route_cost(store: Store, epoch: int, n: int, rounds: int, batch: int) -> list[str]:
    """Route throughput over `n` messages without and with the key indexer, `rounds` of each,
    alternating, claiming at most `batch` messages at a time."""
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    from bench.hl7_corpus import messages as corpus
    from bench.pipeline import ROUTES, Phases, stage_backlog
    from include.app.lab.postgres_server import free_port
    from include.routes_config import parse_routes
    from include.spark import close_session, spark_session, start_connect_server, stop_connect_server
    from include.store.stages import ROUTE
    from spark_jobs.route_job import routed_rows

    out = []
    work = Path(tempfile.mkdtemp(prefix="stageline-bench-search-"))
    port = free_port()
    connect = start_connect_server(port, log_dir=work / "log")
    spark = spark_session(remote=f"sc://127.0.0.1:{port}")
    routes = parse_routes(ROUTES)
    indexer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keys")

    def transform(frame: Any, run: str) -> Any:
        return frame.transform(partial(routed_rows, routes=routes), run_id=run)

    try:
        warm, warming = Phases(), partial(indexer.submit, K.index, store, RULES)
        for _ in range(2):  # warm the servers and the indexer's connection: the first runs are slower
            stage_backlog(store, corpus(10_000, seed=5), epoch)
            while drain_one(store, spark, epoch, warm, ROUTE, transform, alongside=warming, batch=batch):
                pass
        rates: dict[str, list[float]] = {"without keys": [], "with keys": []}
        for turn in range(2 * rounds):
            label = "with keys" if turn % 2 else "without keys"
            rules = RULES if turn % 2 else None
            stage_backlog(store, corpus(n, seed=turn + 1), epoch)
            phases = Phases()
            own = [0.0, 0]  # the indexer's own seconds and messages, in its thread

            def index(ids: list[int], rules: Any = rules, own: list[Any] = own) -> None:
                started = time.perf_counter()
                own[1] += K.index(store, rules, ids)
                own[0] += time.perf_counter() - started

            alongside = partial(indexer.submit, index) if rules else None
            started = time.perf_counter()
            done = 0
            while moved := drain_one(store, spark, epoch, phases, ROUTE, transform, alongside=alongside, batch=batch):
                done += moved
            seconds = time.perf_counter() - started
            rates[label].append(done / seconds)
            out.append(
                f"route {label} ({turn // 2 + 1}): {done:,} messages in {seconds:.1f} s = {done / seconds:,.0f} msg/s "
                f"({phases.batches} batches: {phases.line()}; indexer {own[0]:.2f} s for {own[1]:,} messages "
                f"in its thread, alongside Spark)"
            )
        with_keys = sum(rates["with keys"]) / rounds
        without = sum(rates["without keys"]) / rounds
        out.append(f"route with keys: {with_keys / without:.1%} of the throughput without (mean of {rounds} runs each)")
    finally:
        indexer.shutdown(wait=True)
        close_session(spark)
        stop_connect_server(connect)
    return out


def drain_one(
    store: Store,
    spark: Any,
    epoch: int,
    phases: Any,
    stage: Any,
    transform: Any,
    *,
    alongside: Any = None,
    batch: int = 20_000,
) -> int:
    """One batch of bench/pipeline.py's drain: claim, Spark, finalize, with `alongside` (the route
    task's key indexer) started after the claim and waited for before the finalize, as
    `run_stage_job` does; messages moved (0: none left)."""
    from spark_jobs import stage_job

    run = f"{stage.name}_job-k{phases.batches}"
    owner = f"bench/{run}"
    ids = phases.time("claim", lambda: stage_job.claim(store, stage, owner=owner, epoch=epoch, batch_size=batch))
    if not ids:
        return 0
    side = alongside(ids) if alongside else None
    small = stage_job.is_small(ids)
    phases.time(
        "spark",
        lambda: stage_job.land(
            store,
            transform(stage_job.read_claimed(store, spark, stage, owner=owner, epoch=epoch, small=small, ids=ids), run),
            stage.landing,
            small=small,
        ),
    )
    if side is not None:
        phases.time("keys wait", side.result)
    phases.time(
        "finalize",
        lambda: stage_job.finalize(store, stage, run_id=run, owner=owner, epoch=epoch, claimed_ids=ids),
    )
    phases.batches += 1
    return len(ids)


def sqlite_rows(store: Store, lo: int, hi: int, patients: int, at: str, *, per_tx: int) -> float:
    """Messages lo..hi (bodies too) into a SQLite store, `per_tx` a transaction; seconds taken."""
    mrn, _, body = day_sql(patients, sqlite=True)
    started = time.perf_counter()
    for first in range(lo, hi + 1, per_tx):
        last = min(hi, first + per_tx - 1)
        series = (
            f"(WITH RECURSIVE s(i) AS (SELECT {first} UNION ALL SELECT i + 1 FROM s WHERE i < {last}) SELECT i FROM s)"
        )
        execute(
            store,
            "INSERT INTO stage_inbound (id, message_id, control_id, connection, lane_key, status, attempts, created_at,"
            f" updated_at) SELECT i, 'm' || printf('%031d', i), 'C' || CAST(i AS text),"
            f" CASE WHEN i % 3 = 0 THEN 'lab-in' ELSE 'adt-in' END, {mrn}, 'done', 1, {at}, {at} FROM {series}",
            f"INSERT INTO inbound_bodies (id, payload) SELECT i, {body} FROM {series}",
        )
    return time.perf_counter() - started


def sqlite_search(args: argparse.Namespace) -> None:
    """Content search on SQLite over a day of --messages, without and with the FTS5 trigram index
    (`stageline messages content-index`), and what the index costs each body written."""
    work = Path(tempfile.mkdtemp(prefix="stageline-bench-search-"))
    store = Store(StoreConfig(backend="sqlite", path=str(work / "stageline.db"), pool_size=2))
    migrate(store, cluster_name="bench")
    n, tail = args.messages, args.ingest
    now_ms = int(time.time() * 1000)
    day = f"{now_ms} - 86400000 * ({n} - i) / {n} - 1000"
    seconds = sqlite_rows(store, 1, n, args.patients, day, per_tx=100_000)
    print(f"filled {n:,} messages (bodies) over the last day in {seconds:.1f} s", flush=True)
    execute(store, "ANALYZE")
    ingest = sqlite_rows(store, n + 1, n + tail, args.patients, f"{now_ms} + i - {n}", per_tx=100)
    print(f"wrote {tail:,} more messages, 100 a transaction, no index: {tail / ingest:,.0f} msg/s", flush=True)
    for text in (NEEDLE, "DOE^JANE"):
        ms, rows = content(store, text, args.repeat)
        print(f"find --contains {text} over the day, no index: best of {args.repeat} {ms:,.0f} ms, {rows} rows")
    ms_build, done = timed(lambda: S.create_index(store))
    size = sum(f.stat().st_size for f in work.iterdir())
    print(f"FTS5 trigram index over {done:,} bodies in {ms_build / 1000:.1f} s; store files now {size / 1e9:.2f} GB")
    for text in (NEEDLE, "DOE^JANE"):
        ms, rows = content(store, text, args.repeat)
        print(f"find --contains {text} over the day, FTS5 index: best of {args.repeat} {ms:,.0f} ms, {rows} rows")
    ingest = sqlite_rows(store, n + tail + 1, n + 2 * tail, args.patients, f"{now_ms} + i - {n}", per_tx=100)
    print(f"wrote {tail:,} more messages, 100 a transaction, with the index: {tail / ingest:,.0f} msg/s", flush=True)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--patients", type=int, default=100_000)
    parser.add_argument("--lookups", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--route", type=int, default=0, help="messages for the route-cost runs (0: skip)")
    parser.add_argument("--rounds", type=int, default=2, help="route-cost runs of each side, alternating")
    parser.add_argument("--batch", type=int, default=20_000, help="the most messages a route-cost claim takes")
    parser.add_argument("--sqlite", action="store_true", help="content search on SQLite, without and with FTS5")
    parser.add_argument("--ingest", type=int, default=20_000, help="--sqlite: messages written to time the index")
    args = parser.parse_args()
    if args.rounds < 1 or args.batch < 1 or args.route < 0 or args.messages < 0 or args.ingest < 1:
        parser.error("--rounds, --batch and --ingest must be at least 1; --route and --messages at least 0")
    if args.sqlite:
        sqlite_search(args)
        return

    server = PostgresServer().start()
    try:
        server.execute("CREATE DATABASE bench")
        store = Store(
            StoreConfig(
                backend="postgres",
                server=server.host,
                port=server.port,
                database="bench",
                username=server.user,
                pool_size=4,
            )
        )
        migrate(store, cluster_name="bench")
        epoch = acquire_permanent(store, node_id="bench")
        if args.route:
            for text in route_cost(store, epoch, args.route, args.rounds, args.batch):
                print(text, flush=True)
            execute(store, "TRUNCATE message_keys, stage_routed, stage_outbound, message_events, landing_routed")
            execute(store, "TRUNCATE stage_inbound, inbound_bodies CASCADE")
        if not args.messages:
            return
        ms, _ = timed(lambda: fill_day(store, args.messages, args.patients))
        print(
            f"filled {args.messages:,} messages (bodies, 3 keys each) over the last day in {ms / 1000:.1f} s",
            flush=True,
        )

        rng = random.Random(7)
        mrns = [f"P{rng.randrange(args.patients):07d}" for _ in range(args.lookups)]
        K.find(store, K.KeyQuery(name="mrn", value=mrns[0]))  # a warm pool
        print(line("find --key mrn=P… (exact, index)", *key_lookups(store, mrns)), flush=True)
        prefixes = [m[:-1] for m in mrns[: max(1, args.lookups // 5)]]
        print(line("find --key mrn=P…* (prefix of 10 MRNs, index)", *key_lookups(store, prefixes, prefix=True)))
        execute(store, "DROP INDEX message_keys_search")
        print(line("find --key mrn=P… (exact, no index)", *key_lookups(store, mrns[:20])), flush=True)
        execute(store, "CREATE INDEX message_keys_search ON message_keys (name, value, received_at)")

        ms, rows = content(store, NEEDLE, args.repeat)
        print(
            f"find --contains {NEEDLE} over the day, no trigram index: best of {args.repeat} {ms:,.0f} ms, {rows} rows"
        )
        ms_build, _ = timed(
            lambda: execute(
                store,
                "CREATE EXTENSION IF NOT EXISTS pg_trgm",
                "CREATE INDEX inbound_bodies_trgm ON inbound_bodies USING gin (payload gin_trgm_ops)",
            )
        )
        print(f"trigram index built over {args.messages:,} bodies in {ms_build / 1000:.1f} s", flush=True)
        ms, rows = content(store, NEEDLE, args.repeat)
        print(f"find --contains {NEEDLE} over the day, trigram index: best of {args.repeat} {ms:,.0f} ms, {rows} rows")
        ms, rows = content(store, "DOE^JANE", args.repeat)
        print(f"find --contains DOE^JANE (most bodies), trigram index: best of {args.repeat} {ms:,.0f} ms, {rows} rows")
        store.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
