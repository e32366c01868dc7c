"""How the pipeline's cost grows with the work already done and with the work waiting (issue 29).

One throwaway PostgreSQL 15 cluster (fsync and synchronous_commit on, as bench/pipeline.py) and one
warm Spark Connect server. For each history size, smallest first, the store is topped up with
finished messages by set-based SQL, then VACUUM (ANALYZE) — the state autovacuum leaves a store
that got there by itself — and for each backlog size, smallest first, that many pending messages
are put in front of the queue and measured:

    history   finished messages through every staged table, as the stages leave them: an inbound
              row and its body; 1 or 2 routed rows (1.6 on average: one transformed destination,
              and 3 in 5 also the pass-through `archive`), as many outbound rows (delivered), an
              outbound body for each transformed one; and their audit events (received, routed,
              transformed, and each row's `done`: 8.4 a message). Bodies are bench/hl7_corpus.py
              messages; message ids are time-ordered like listenerd's (UUIDv7 hex), one message
              every 5 ms up to the start of the run (its rows and events within 3 ms of it), row
              ids ascending.
    backlog   pending inbound messages (corpus bodies, lane PID-3.1, their `received` events),
              staged in bulk ahead of the measured ones
    ingest    `--ingests` single messages staged one transaction each, as listenerd stages a lone
              message (rowlease.stage_inbound: the stage_inbound_one statement), commit included:
              p50 / p99 ms
    route + transform  the first `--messages` messages of the backlog routed, then their routed rows
              transformed, `--batch` rows a claim (bench/pipeline.py's phases, corpus, routes and
              rules): msg/s, and the store's µs per row for each named statement it ran
    claim     `--claims` claims of `--claim-rows` inbound rows (claim_batch), each run under
              EXPLAIN ANALYZE and rolled back: the server's execution time, p50 / p99 ms
    sizes     every staged table (heap + TOAST) and each of its indexes, after the measurement
    explain   (--explain DIR) per history size, one more small route + transform round, ingests and
              a claim with auto_explain logging every statement's plan with ANALYZE and BUFFERS:
              DIR/plans-<history>.log

Between history sizes the leftover backlog is deleted (rows, bodies, events) and the measured
messages' outbound rows are marked delivered, so history holds finished messages only.

    uv run python bench/growth.py [--history 0,1000000] [--backlogs 10000,1000000] [--messages 10000]
                                  [--batch 5000] [--explain DIR]

100 M messages do not fit one 2-core machine's disk and afternoon; the run prints the load rate and
the bytes per million messages it measured, and what 100 M would take at those rates.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hl7_corpus import messages as corpus  # noqa: E402
from bench.pipeline import (  # noqa: E402
    LOOKUPS,
    ROUTES,
    SPECS,
    Phases,
    bench_database,
    destinations,
    drain,
    stage_backlog,
    warm_jit,
)
from bench.store_floor import StatementTimes  # noqa: E402
from include.app.lab.postgres_server import PostgresServer, free_port  # noqa: E402
from include.hl7path import value  # noqa: E402
from include.routes_config import parse_routes  # noqa: E402
from include.spark import close_session, spark_session, start_connect_server, stop_connect_server  # noqa: E402
from include.stage_config import passthrough_destinations  # noqa: E402
from include.store import INBOUND, Store, lookups, rowlease  # noqa: E402
from include.store.lease import acquire_permanent  # noqa: E402
from include.store.migrate import migrate  # noqa: E402
from include.store.stages import ROUTE, TRANSFORM  # noqa: E402
from listeners.group_commit import new_message_id  # noqa: E402
from spark_jobs import transform_job  # noqa: E402
from spark_jobs.route_job import routed_rows  # noqa: E402

SAMPLES = 2000
"""Distinct corpus messages the bulk-loaded bodies cycle through."""
RATE = 200
"""Messages a second the history is spread at (one every 5 ms before the run)."""
STAGED = ("stage_inbound", "inbound_bodies", "stage_routed", "stage_outbound", "outbound_bodies", "message_events")
"""The tables that grow with every message: the curve's size columns."""
CONNECTIONS = ("adt-in", "lab-in", "orm-in")
ROWS_PER_MESSAGE = 12.6
"""A history message's rows besides its bodies: 1 inbound, 1.6 routed, 1.6 outbound, 8.4 events."""

# One chunk of history, messages %(a)s..%(b)s (global numbers from 1), as set-based SQL. Row ids are
# %(in0)s + (i - a) for inbound and %(rt0)s / %(ob0)s + 2 (i - a) + j for a message's j-th routed /
# outbound row (j = 1, the pass-through, for 3 messages in 5): ids ascend, with gaps.
_MESSAGES = f"""
    SELECT i, c.payload, c.lane,
           to_timestamp(%(t_end)s - (%(n_end)s - i)::float8 / {RATE}) AS at,
           lpad(to_hex(floor((%(t_end)s - (%(n_end)s - i)::float8 / {RATE}) * 1000)::bigint), 12, '0')
             || '7' || substr(md5(i::text), 1, 19) AS message_id,
           'H' || i AS control_id,
           CASE i %% 3 WHEN 0 THEN 'ehr' WHEN 1 THEN 'lab' ELSE 'bedboard' END AS dest
      FROM generate_series(CAST(%(a)s AS bigint), CAST(%(b)s AS bigint)) AS i
      JOIN growth_corpus c ON c.k = i %% {SAMPLES}
"""
_ROUTES = "JOIN (VALUES (0), (1)) AS r(j) ON r.j = 0 OR m.i %% 5 < 3"
_DEST = "CASE r.j WHEN 0 THEN m.dest ELSE 'archive' END"
_CONNECTION = "CASE m.i %% 3 " + " ".join(f"WHEN {n} THEN '{c}'" for n, c in enumerate(CONNECTIONS)) + " END"

HISTORY_SQL = [
    "INSERT INTO stage_inbound (id, message_id, control_id, connection, lane_key, status, claim_epoch, attempts, "
    "created_at, updated_at, charset) OVERRIDING SYSTEM VALUE "
    f"SELECT %(in0)s + m.i - %(a)s, m.message_id, m.control_id, {_CONNECTION}, m.lane, 'done', %(epoch)s, 1, "
    f"m.at, m.at + interval '1 ms', NULL FROM ({_MESSAGES}) AS m",
    f"INSERT INTO inbound_bodies (id, payload) SELECT %(in0)s + m.i - %(a)s, m.payload FROM ({_MESSAGES}) AS m",
    "INSERT INTO stage_routed (id, source_id, message_id, control_id, destination, route_name, lane_key, status, "
    "claim_epoch, attempts, created_at, updated_at) OVERRIDING SYSTEM VALUE "
    f"SELECT %(rt0)s + 2 * (m.i - %(a)s) + r.j, %(in0)s + m.i - %(a)s, m.message_id, m.control_id, {_DEST}, "
    f"'r-' || {_DEST}, m.lane, 'done', %(epoch)s, 1, m.at + interval '1 ms', m.at + interval '2 ms' "
    f"FROM ({_MESSAGES}) AS m {_ROUTES}",
    "INSERT INTO stage_outbound (id, source_id, message_id, control_id, destination, content_type, idempotency_key, "
    "lane_key, status, claim_epoch, attempts, created_at, updated_at) OVERRIDING SYSTEM VALUE "
    f"SELECT %(ob0)s + 2 * (m.i - %(a)s) + r.j, %(rt0)s + 2 * (m.i - %(a)s) + r.j, m.message_id, m.control_id, "
    f"{_DEST}, 'application/hl7-v2', m.message_id || ':' || {_DEST}, {_DEST} || '|' || m.lane, 'done', %(epoch)s, 1, "
    f"m.at + interval '2 ms', m.at + interval '3 ms' FROM ({_MESSAGES}) AS m {_ROUTES}",
    f"INSERT INTO outbound_bodies (id, payload) SELECT %(ob0)s + 2 * (m.i - %(a)s), m.payload FROM ({_MESSAGES}) AS m",
    "INSERT INTO message_events (at, stage, row_id, message_id, control_id, destination, event, from_status, "
    "to_status, epoch, node_id, attempt) "
    "SELECT m.at + e.after, 'inbound', %(in0)s + m.i - %(a)s, m.message_id, m.control_id, NULL, e.event, e.from_s, "
    "e.to_s, %(epoch)s, 'growth', 1 "
    f"FROM ({_MESSAGES}) AS m "
    "CROSS JOIN (VALUES (interval '0 ms', 'received', NULL, 'pending'), "
    "                   (interval '1 ms', 'done', 'in_flight', 'done')) AS e(after, event, from_s, to_s)",
    "INSERT INTO message_events (at, stage, row_id, message_id, control_id, destination, event, from_status, "
    "to_status, epoch, node_id, attempt) "
    "SELECT m.at + e.after, e.stage, CASE e.stage WHEN 'routed' THEN %(rt0)s ELSE %(ob0)s END + 2 * (m.i - %(a)s) "
    f"+ r.j, m.message_id, m.control_id, {_DEST}, e.event, e.from_s, e.to_s, %(epoch)s, 'growth', 1 "
    f"FROM ({_MESSAGES}) AS m {_ROUTES} "
    "CROSS JOIN (VALUES (interval '1 ms', 'routed', 'routed', NULL, 'pending'), "
    "                   (interval '2 ms', 'routed', 'done', 'in_flight', 'done'), "
    "                   (interval '2 ms', 'outbound', 'transformed', NULL, 'pending'), "
    "                   (interval '3 ms', 'outbound', 'done', 'in_flight', 'done')) "
    "AS e(after, stage, event, from_s, to_s)",
]

BACKLOG_SQL = [
    "INSERT INTO stage_inbound (id, message_id, control_id, connection, lane_key, status, attempts, created_at, "
    "updated_at) OVERRIDING SYSTEM VALUE "
    f"SELECT %(in0)s + m.i - %(a)s, m.message_id, m.control_id, 'bench', m.lane, 'pending', 0, m.at, m.at "
    f"FROM ({_MESSAGES}) AS m",
    f"INSERT INTO inbound_bodies (id, payload) SELECT %(in0)s + m.i - %(a)s, m.payload FROM ({_MESSAGES}) AS m",
    "INSERT INTO message_events (at, stage, row_id, message_id, control_id, event, to_status, epoch, node_id, "
    "attempt) SELECT m.at, 'inbound', %(in0)s + m.i - %(a)s, m.message_id, m.control_id, 'received', 'pending', "
    "%(epoch)s, 'growth', 0 "
    f"FROM ({_MESSAGES}) AS m",
]

SIZES_SQL = """
SELECT t.relname AS tab, t.relname AS rel, pg_table_size(t.oid) AS bytes, t.reltuples::bigint AS tuples
  FROM pg_class t WHERE t.relname = ANY(%(tables)s)
UNION ALL
SELECT t.relname, i.relname, pg_relation_size(i.oid), i.reltuples::bigint
  FROM pg_index x JOIN pg_class t ON t.oid = x.indrelid JOIN pg_class i ON i.oid = x.indexrelid
 WHERE t.relname = ANY(%(tables)s)
 ORDER BY 1, 2
"""


@dataclass
class Point:
    """What one (history, backlog) point measured."""

    history: int
    backlog: int
    route_rate: float = 0.0
    transform_rate: float = 0.0
    both_rate: float = 0.0
    claim_ms: list[float] = field(default_factory=list)
    ingest_ms: list[float] = field(default_factory=list)
    statements: dict[str, float] = field(default_factory=dict)  # µs per row
    sizes: dict[str, int] = field(default_factory=dict)  # relation → bytes

    def row(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "backlog": self.backlog,
            "route_msg_s": self.route_rate,
            "transform_msg_s": self.transform_rate,
            "route_transform_msg_s": self.both_rate,
            "claim_p50_ms": quantile(self.claim_ms, 0.5),
            "claim_p99_ms": quantile(self.claim_ms, 0.99),
            "ingest_p50_ms": quantile(self.ingest_ms, 0.5),
            "ingest_p99_ms": quantile(self.ingest_ms, 0.99),
            "staged_bytes": sum(self.sizes.values()),
        }


COLUMNS = (
    ("history", "history (messages)", "{:,}"),
    ("backlog", "backlog", "{:,}"),
    ("route_msg_s", "route msg/s", "{:,.0f}"),
    ("transform_msg_s", "transform msg/s", "{:,.0f}"),
    ("route_transform_msg_s", "route + transform msg/s", "{:,.0f}"),
    ("claim_p50_ms", "claim p50 ms", "{:.2f}"),
    ("claim_p99_ms", "claim p99 ms", "{:.2f}"),
    ("ingest_p50_ms", "ingest p50 ms", "{:.2f}"),
    ("ingest_p99_ms", "ingest p99 ms", "{:.2f}"),
    ("staged_bytes", "staged tables + indexes", "{}"),
)


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(points: list[Point]) -> list[str]:
    """The curve, one row a point, as a Markdown table."""
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for p in points:
        row = p.row()
        cells = [human(row[k]) if k == "staged_bytes" else fmt.format(row[k]) for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def statements_table(points: list[Point]) -> list[str]:
    names = sorted(
        {n for p in points for n in p.statements}, key=lambda n: -max(p.statements.get(n, 0) for p in points)
    )
    head = "| µs per row | " + " | ".join(f"{p.history:,} / {p.backlog:,}" for p in points) + " |"
    lines = [head, "|" + "---|" * (len(points) + 1)]
    for name in names:
        cells = [f"{p.statements[name]:.1f}" if name in p.statements else "" for p in points]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def sizes_table(points: list[Point]) -> list[str]:
    names = list(dict.fromkeys(n for p in points for n in p.sizes))
    head = "| relation | " + " | ".join(f"{p.history:,} / {p.backlog:,}" for p in points) + " |"
    lines = [head, "|" + "---|" * (len(points) + 1)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(human(p.sizes.get(name, 0)) for p in points) + " |")
    return lines


class Bench:
    """The store, its raw connection for the bulk SQL, and the id and message counters."""

    def __init__(self, server: PostgresServer, store: Store, epoch: int, t_end: float, n_end: int) -> None:
        import psycopg

        self.server = server
        self.store = store
        self.epoch = epoch
        self.conn = psycopg.connect(server.conninfo("bench"), autocommit=True)
        self.t_end = t_end  # history's last message is at t_end (epoch seconds) ...
        self.n_end = n_end  # ... and is message number n_end
        self.loaded = 0  # history messages loaded so far
        self.numbered = n_end  # backlog messages are numbered after every history message

    def one(self, sql: str, params: dict[str, Any] | None = None) -> Any:
        row = self.conn.execute(sql, params or {}).fetchone()
        return row[0] if row else None

    def next_ids(self) -> dict[str, int]:
        return {
            key: int(self.one(f"SELECT COALESCE(max(id), 0) + 1 FROM {table}"))
            for key, table in (("in0", "stage_inbound"), ("rt0", "stage_routed"), ("ob0", "stage_outbound"))
        }

    def bump_sequences(self) -> None:
        for table in ("stage_inbound", "stage_routed", "stage_outbound"):
            self.one(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))")

    def load_corpus(self) -> None:
        payloads = corpus(SAMPLES, seed=5)
        self.conn.execute("CREATE TABLE growth_corpus (k integer PRIMARY KEY, payload text NOT NULL, lane text)")
        with self.conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO growth_corpus (k, payload, lane) VALUES (%s, %s, %s)",
                [(k, p, value(p, "PID-3.1") or None) for k, p in enumerate(payloads)],
            )
        self.conn.execute("ANALYZE growth_corpus")

    def run_chunks(self, statements: list[str], first: int, last: int, chunk: int, *, t_end: float) -> None:
        """`statements` over messages first..last, `chunk` messages a transaction; message `last`
        at `t_end` (epoch seconds), each earlier one 1/RATE s before the next."""
        bases = self.next_ids()
        for a in range(first, last + 1, chunk):
            b = min(last, a + chunk - 1)
            args: dict[str, Any] = {"a": a, "b": b, "epoch": self.epoch, "t_end": t_end, "n_end": last}
            args.update({k: v + (a - first) * (1 if k == "in0" else 2) for k, v in bases.items()})
            with self.conn.transaction():
                for sql in statements:
                    self.conn.execute(sql, args)

    def add_history(self, upto: int, chunk: int) -> tuple[float, float]:
        """Top history up to `upto` messages; (seconds loading, seconds in VACUUM ANALYZE)."""
        started = time.perf_counter()
        if upto > self.loaded:
            t_last = self.t_end - (self.n_end - upto) / RATE  # the history's clock: n_end at t_end
            self.run_chunks(HISTORY_SQL, self.loaded + 1, upto, chunk, t_end=t_last)
            self.bump_sequences()
            self.loaded = upto
        loaded = time.perf_counter() - started
        started = time.perf_counter()
        self.conn.execute("VACUUM (ANALYZE)")
        return loaded, time.perf_counter() - started

    def add_backlog(self, n: int, chunk: int) -> None:
        """`n` pending messages, their message times just before now (a recent arrival)."""
        first = self.numbered + 1
        self.numbered += n
        self.run_chunks(BACKLOG_SQL, first, self.numbered, chunk, t_end=time.time())
        self.bump_sequences()
        self.conn.execute("ANALYZE stage_inbound")

    def tidy(self) -> None:
        """Leave only finished messages: the measured ones' outbound rows delivered, the rest of the
        backlog (rows, bodies, received events) gone."""
        self.conn.execute("UPDATE stage_outbound SET status = 'done', updated_at = now() WHERE status = 'pending'")
        with self.conn.transaction():
            self.conn.execute(
                "DELETE FROM message_events e USING stage_inbound s "
                "WHERE s.status = 'pending' AND e.stage = 'inbound' AND e.row_id = s.id"
            )
            self.conn.execute(
                "DELETE FROM inbound_bodies b USING stage_inbound s WHERE s.status = 'pending' AND b.id = s.id"
            )
            self.conn.execute("DELETE FROM stage_inbound WHERE status = 'pending'")

    def sizes(self) -> dict[str, int]:
        rows = self.conn.execute(SIZES_SQL, {"tables": list(STAGED)}).fetchall()
        return {rel: int(size) for _, rel, size, _ in rows}


def ingest_ms(store: Store, epoch: int, n: int) -> list[float]:
    """`n` messages staged alone, one committed transaction each: milliseconds each."""
    payloads = corpus(n, seed=11)
    took = []
    for p in payloads:
        message = {
            "message_id": new_message_id(),
            "control_id": value(p, "MSH-10"),
            "connection": "ingest",
            "lane_key": value(p, "PID-3.1") or None,
            "charset": None,
            "payload": p,
        }
        started = time.perf_counter()
        with store.transaction() as tx:
            staged = rowlease.stage_inbound(tx, [message], epoch=epoch, node_id="growth")
        took.append((time.perf_counter() - started) * 1000)
        assert staged and len(staged) == 1, staged
    return took


class _RollBack(Exception):
    pass


def claim_ms(store: Store, epoch: int, n: int, rows: int) -> list[float]:
    """`n` claims of `rows` inbound rows under EXPLAIN ANALYZE, each rolled back: the server's
    execution time of each, milliseconds."""
    took = []
    params = {"owner": "growth/claim", "epoch": epoch, "limit": rows, "lease_seconds": 300}
    for _ in range(n):
        try:
            with store.transaction() as tx:
                cur = tx.conn.cursor()
                cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + tx.sql("claim_batch", INBOUND), params)
                plan = next(iter(dict(cur.fetchone()).values()))
                plan = json.loads(plan) if isinstance(plan, str) else plan
                took.append(float(plan[0]["Execution Time"]))
                raise _RollBack
        except _RollBack:
            pass
    return took


def route_and_transform(
    store: Store, spark: Any, epoch: int, dests: dict[str, Any], *, messages: int, batch: int
) -> tuple[float, float, float, dict[str, float]]:
    """The first `messages` pending messages routed, then all pending routed rows transformed:
    (route msg/s, transform msg/s, both msg/s, µs per row of each store statement)."""
    passthrough = passthrough_destinations(SPECS, dests)
    times = StatementTimes()
    with times.recording():
        started = time.perf_counter()
        routed = drain(
            store,
            spark,
            epoch,
            batch,
            Phases(),
            ROUTE,
            lambda frame, run_id: frame.transform(routed_rows, parse_routes(ROUTES), run_id=run_id),
            most=messages,
            passthrough=passthrough,
        )
        route_s = time.perf_counter() - started
        started = time.perf_counter()
        drain(
            store,
            spark,
            epoch,
            batch,
            Phases(),
            TRANSFORM,
            lambda frame, run_id: frame.transform(transform_job.outbound_rows, SPECS, LOOKUPS, dests, run_id=run_id),
            passthrough=passthrough,
        )
        transform_s = time.perf_counter() - started
    assert routed == messages, (routed, messages)
    per_row = {name: s / times.rows[name] * 1e6 for name, s in times.seconds.items() if times.rows[name]}
    return routed / route_s, routed / transform_s, routed / (route_s + transform_s), per_row


def explained(bench: Bench, spark: Any, dests: dict[str, Any], out: Path, *, messages: int) -> None:
    """One small round with auto_explain on: every statement's plan (ANALYZE, BUFFERS) to `out`."""
    log = bench.server.root / "server.log"
    start = log.stat().st_size
    settings = {"log_min_duration": "0", "log_analyze": "on", "log_buffers": "on", "log_nested_statements": "on"}
    for k, v in settings.items():
        bench.conn.execute(f"ALTER SYSTEM SET auto_explain.{k} = '{v}'")
    bench.conn.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)  # every backend takes the reload before its next statement
    try:
        stage_backlog(bench.store, corpus(messages, seed=4), bench.epoch)  # at least `messages` pending
        ingest_ms(bench.store, bench.epoch, 3)
        route_and_transform(bench.store, spark, bench.epoch, dests, messages=messages, batch=messages)
        claim_ms(bench.store, bench.epoch, 1, 100)
    finally:
        for k in settings:
            bench.conn.execute(f"ALTER SYSTEM RESET auto_explain.{k}")
        bench.conn.execute("SELECT pg_reload_conf()")
    with log.open("rb") as f:
        f.seek(start)
        out.write_bytes(f.read())


def sizes(text: str) -> list[int]:
    """A comma-separated list of message counts, distinct and ascending."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of counts: {text!r}") from None
    if counts != sorted(set(counts)) or counts[0] < 0:
        raise argparse.ArgumentTypeError(f"counts must be distinct, ascending and not negative: {text!r}")
    return counts


def retention_rate(bench: Bench, oldest: int) -> str:
    """Retention as configured by default (archive, then delete; include/housekeeping.py, runs of
    its default size until one finds nothing) with an age that reaches the oldest `oldest`
    history messages: the figure lines, the store's time per statement among them. Each batch
    measures the age from its own now(), so a long run takes somewhat more than `oldest`; the rate
    is of what it took: all rows deleted, in messages' worth (the events, purged last, reach
    furthest)."""
    # the `oldest`-th message's time, and its last row's (3 ms later, before the next message's)
    last = bench.t_end - (bench.n_end - oldest) / RATE + 0.004
    times = StatementTimes()
    started = time.perf_counter()
    with times.recording():
        counts = _retain(bench, time.time() - last)
    took = time.perf_counter() - started
    rows = sum(counts.get(k, 0) for k in ("inbound", "routed", "outbound", "events"))
    rate = rows / ROWS_PER_MESSAGE / took
    day = RATE * 86_400
    return "\n".join(
        [
            f"retention (archive, then delete) reaching the oldest {oldest:,} messages: deleted {counts} in "
            f"{took:.1f} s = {rows / took:,.0f} rows/s = {rate:,.0f} messages/s at {ROWS_PER_MESSAGE} rows "
            f"each; a day at {RATE} msg/s ({day / 1e6:.1f} M messages) takes {day / rate / 3600:.1f} h of it",
            *times.lines(during="retention"),
        ]
    )


def _retain(bench: Bench, age: float) -> dict[str, int]:
    """Retention of what is older than `age` seconds, run after run as the retention DAG runs it,
    until a run finds nothing; the rows deleted per key."""
    from include.housekeeping import retention

    counts: dict[str, int] = {}
    while True:
        done = retention(bench.store, bench.epoch, age)
        for key, n in done.items():
            counts[key] = counts.get(key, 0) + n
        if not any(done.values()):
            return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=sizes, default=[0, 1_000_000], help="finished messages at each point")
    parser.add_argument("--backlogs", type=sizes, default=[10_000, 1_000_000], help="pending messages at each point")
    parser.add_argument("--messages", type=int, default=10_000, help="messages routed + transformed at each point")
    parser.add_argument("--batch", type=int, default=5_000, help="rows a claim in the route + transform runs")
    parser.add_argument("--claims", type=int, default=100, help="claim samples at each point")
    parser.add_argument("--claim-rows", type=int, default=100, help="rows each sampled claim takes")
    parser.add_argument("--ingests", type=int, default=500, help="single-message stagings timed at each point")
    parser.add_argument("--chunk", type=int, default=250_000, help="messages bulk-loaded a transaction")
    parser.add_argument("--warm-messages", type=int, default=10_000, help="messages through Spark's noop sink first")
    parser.add_argument("--explain", type=Path, help="a directory for each history size's plans (auto_explain)")
    parser.add_argument("--json", type=Path, help="also write the points here")
    parser.add_argument(
        "--retention", type=int, default=0, metavar="N", help="at the end, time retention of the N oldest messages"
    )
    args = parser.parse_args(argv)
    history, backlogs = args.history, args.backlogs
    if (
        not 0 < args.messages <= backlogs[0]
        or min(args.batch, args.claims, args.claim_rows, args.ingests, args.chunk) < 1
        or args.retention < 0
    ):
        parser.error(
            "--messages must be positive and at most the smallest backlog; --batch, --claims, "
            "--claim-rows, --ingests and --chunk positive; --retention not negative"
        )
    if args.explain:
        args.explain.mkdir(parents=True, exist_ok=True)

    from os import getloadavg

    # a TERM (a timeout, an operator) unwinds like an error, so the cluster below is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="stageline-growth-"))
    server = PostgresServer(settings={"shared_preload_libraries": "auto_explain", "max_wal_size": "4GB"}).start()
    connect = spark = None
    try:
        store = Store(bench_database(server))
        migrate(store, cluster_name="growth")
        epoch = acquire_permanent(store, node_id="growth")
        with store.transaction() as tx:
            for name, entries in LOOKUPS.items():
                lookups.replace_table(tx, name, entries)
        bench = Bench(server, store, epoch, t_end=time.time() - 60, n_end=history[-1])
        bench.load_corpus()

        port = free_port()
        connect = start_connect_server(port, log_dir=work / "log")
        spark = spark_session(remote=f"sc://127.0.0.1:{port}")
        dests = destinations(work / "out")
        # warm: the server's first runs and its JIT, then a small real round through the store
        warm_jit(spark, corpus(args.warm_messages, seed=2), dests)
        stage_backlog(store, corpus(min(2000, args.messages), seed=3), epoch)
        route_and_transform(store, spark, epoch, dests, messages=min(2000, args.messages), batch=args.batch)
        bench.tidy()

        points: list[Point] = []
        loads: list[tuple[int, int, float, float]] = []  # (from, to, seconds loading, seconds vacuuming)
        before = bench.loaded
        for h in history:
            loaded_s, vacuum_s = bench.add_history(h, args.chunk)
            loads.append((before, h, loaded_s, vacuum_s))
            before = h
            print(f"history {h:,}: loaded in {loaded_s:.1f} s, VACUUM (ANALYZE) {vacuum_s:.1f} s", flush=True)
            for b in backlogs:
                started = time.perf_counter()
                bench.add_backlog(b, args.chunk)
                print(f"  backlog {b:,}: staged in {time.perf_counter() - started:.1f} s", flush=True)
                p = Point(h, b)
                p.ingest_ms = ingest_ms(store, epoch, args.ingests)
                p.route_rate, p.transform_rate, p.both_rate, p.statements = route_and_transform(
                    store, spark, epoch, dests, messages=args.messages, batch=args.batch
                )
                p.claim_ms = claim_ms(store, epoch, args.claims, args.claim_rows)
                p.sizes = bench.sizes()
                points.append(p)
                print("  " + json.dumps(p.row()), flush=True)
            if args.explain:
                explained(bench, spark, dests, args.explain / f"plans-{h}.log", messages=min(1000, args.messages))
            if h != history[-1]:
                bench.tidy()

        retention_line = retention_rate(bench, min(args.retention, history[-1])) if args.retention else ""
        load1, load5, _ = getloadavg()
        print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load1:.2f} / {load5:.2f}")
        print("\n".join(table(points)))
        print("\nstore statements during route + transform, µs per row (history / backlog):")
        print("\n".join(statements_table(points)))
        print("\nsizes (history / backlog):")
        print("\n".join(sizes_table(points)))
        print("\nloading history (set-based SQL, fsync on, then VACUUM (ANALYZE)):")
        by_history = {p.history: p for p in points if p.backlog == backlogs[0]}
        per_million = []
        for first, last, loaded_s, vacuum_s in loads:
            if last == first:
                continue
            n = last - first
            grew = sum(by_history[last].sizes.values()) - (
                sum(by_history[first].sizes.values()) if first in by_history else 0
            )
            per_million.append((grew / n * 1e6, n / (loaded_s + vacuum_s)))
            print(
                f"  {first:,} → {last:,}: {n / loaded_s:,.0f} messages/s loading ({loaded_s:.0f} s), VACUUM "
                f"{vacuum_s:.0f} s; the staged tables grew {human(grew)} = {human(grew / n * 1e6)} a million messages"
            )
        if per_million:
            bytes_m, rate = per_million[-1]
            print(
                f"  at these rates 100 M messages of history take {human(bytes_m * 100)} of table and index "
                f"(WAL and free space besides) and {100e6 / rate / 3600:.1f} h to load"
            )
        if retention_line:
            print(retention_line)
        if args.json:
            args.json.write_text(
                json.dumps([{**p.row(), "statements": p.statements, "sizes": p.sizes} for p in points])
            )
        bench.conn.close()
        store.close()
    finally:
        close_session(spark)  # before the server stops: pyspark's exit hook would wait on it for minutes
        if connect is not None:
            stop_connect_server(connect)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
