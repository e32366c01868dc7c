"""Soak: the README's stack at a steady rate for an hour (invariant 13, issue 22), judged minute by minute.

Starts the embedded stack (`stageline up`, as bench/latency.py does: SQLite store, or `--store
postgres` for a throwaway PostgreSQL server with fsync on, `pg_stat_statements` loaded and lock
waits logged; Airflow's metadata on SQLite either way), sends 20 messages and waits for their
delivery, then sends `bench/hl7_corpus.py` messages over MLLP at `--rate` msg/s on `--connections`
paced connections for `--minutes`. A sender never stops on an answer: it counts AA / AE / AR, ACK
timeouts (`--ack-timeout`, then it reconnects) and connection errors. The corpus is generated in
chunks of 10,000 as it is sent (seed per chunk, so control ids stay unique: `S<seed>N<index>`); what
became of each message is one byte in a ledger.

Every minute one row (also a JSON line in `<work>/soak.jsonl`; its path is printed):

    sent AA AE AR tmo cerr   messages sent that minute and the answers that came (timeouts, connection errors)
    ack99                    p99 of the ACK round trip, ms (the listener's commit wait)
    backlog in/rt/out        rows of stage_inbound / stage_routed / stage_outbound not finished
                             (pending, error or in flight) at the minute's end ...
    (oldest)                 ... and the age of the oldest of them, s, on the database clock
    dlvd p50 p99 max         deliveries (outbound rows done) first seen done in the minute, and their
                             inbound created_at → outbound updated_at, s, on the database clock; an id
                             watermark (the oldest unfinished outbound row, held back a minute for
                             late commits) keeps each query to the rows since, never the whole table
    lockw                    lock waits: `slow write transaction` lines of the store (a write
                             transaction held > 100 ms: on SQLite everyone else waits; the longest is
                             on the detail line) and, on PostgreSQL, `still waiting for …Lock` lines
                             of its log (log_lock_waits, > 1 s). A record a task writes to its own
                             log and to the scheduler's is counted once (same timestamp and text)
    lockerr                  lines naming `database is locked`, `lock timeout`, `could not obtain
                             lock` or a deadlock, new in the stack's logs (`<work>/up.log`,
                             `<var>/log/**`, Airflow's task logs `<var>/airflow/logs/**`, PostgreSQL's log)
    slow                     `slow statement <name> took <ms> ms` lines of the store in the minute
                             (> 100 ms; the top 3 by ms on a detail line); on PostgreSQL detail lines
                             also show the top 3 of pg_stat_statements by max time, with their mean
                             (the stack's statements only; the statistics are reset every minute)
    fail                     Airflow task tries newly failed or up for retry (`task_instance` and
                             `task_instance_history` of `<var>/airflow/airflow.db`)

and a detail line: RSS per process group of the stack's process tree (listenerd, spark driver,
spark python, scheduler, dag-processor, api-server, executor slot, task runner, ...: its largest
process, and (×n) when it has several; the JSON line has the sums too), the store's size (SQLite:
the db file and its -wal file; PostgreSQL: the database and the WAL bytes written in the minute),
and every `--sizes-every` minutes the largest tables with their indexes and bytes per row (SQLite:
the dbstat virtual table, which reads every page, hence not every minute; PostgreSQL:
pg_total_relation_size / pg_indexes_size and dead tuples, every minute).

After the last minute it waits up to `--drain-timeout` for every row to finish (one more row,
"drain"), counts what became of every message sent (delivered, not delivered, ACKed AA but never
staged = lost) and prints a VERDICT (bench/soak_verdict.py says how each rule is judged); exit 1
when it fails. The first `--warmup-minutes` are reported, not judged by the per-minute bounds and
trends. Ctrl-C (or SIGTERM) stops the senders, the stack and the PostgreSQL server.

    uv run python bench/soak.py [--minutes 60] [--rate 200] [--connections 4] [--store sqlite|postgres]
    uv run python bench/soak.py --minutes 3 --rate 50     # a short try, end to end
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from bench.hl7_corpus import messages as corpus  # noqa: E402
from bench.soak_verdict import MIB, NEGATIVE_ACKS, STAGES, Limits, verdict  # noqa: E402
from bench.stack_store import StackOnStore, percentile  # noqa: E402

CHUNK = 10_000
"""Corpus messages generated at a time per sender (each chunk its own seed)."""
PREFLIGHT = 20
BENCH_ROLE = "soak_bench"
"""The PostgreSQL role the bench's own queries run as (left out of the statement statistics)."""
MLLP_PORT = 2575
PG_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track_utility": "off",
    "log_lock_waits": "on",
}

# What a sender saw, one byte per message in the ledger.
SENT, AA, AE, AR, TIMEOUT, CONN_ERROR = 1, 2, 3, 4, 5, 6
OUTCOME_NAMES = {AA: "AA", AE: "AE", AR: "AR", TIMEOUT: "timeout", CONN_ERROR: "conn_error"}
_CODES = {"AA": AA, "CA": AA, "AE": AE, "CE": AE, "AR": AR, "CR": AR}
_CONTROL = re.compile(r"S(\d+)N(\d+)")


# --- senders ------------------------------------------------------------------------------------


def corpus_stream(first_seed: int, step: int) -> Iterator[tuple[int, int, bytes]]:
    """(seed, index, framed message) forever: chunks of `CHUNK` corpus messages with seeds
    `first_seed`, `first_seed + step`, ... (control id `S<seed>N<index>`: unique across chunks)."""
    seed = first_seed
    while True:
        chunk = corpus(CHUNK, seed=seed)
        if f"|S{seed}N{0:09d}|" not in chunk[0]:
            raise RuntimeError("bench/hl7_corpus.py no longer writes MSH-10 as S<seed>N<index>")
        for i, text in enumerate(chunk):
            yield seed, i, b"\x0b" + text.encode() + b"\x1c\r"
        seed += step


def control_key(control_id: str | None) -> tuple[int, int] | None:
    m = _CONTROL.fullmatch(control_id or "")
    return (int(m[1]), int(m[2])) if m else None


def ack_code(frame: bytes) -> str:
    """MSA-1 of an MLLP-framed ACK ("AA", "AE", "AR"; enhanced-mode C* mapped; "?" if none)."""
    for segment in frame.strip(b"\x0b\x1c\r\n").split(b"\r"):
        if segment.startswith(b"MSA"):
            fields = segment.decode(errors="replace").split(segment[3:4].decode() or "|")
            return fields[1] if len(fields) > 1 else "?"
    return "?"


class Ledger:
    """What became of every message sent (one byte each, by seed and index) and, per minute, the
    counts of sends and answers and the ACK round trips."""

    def __init__(self) -> None:
        self.outcomes: dict[int, bytearray] = {}
        self.per_minute: dict[int, Counter] = defaultdict(Counter)
        self.ack_ms: dict[int, list[float]] = defaultdict(list)
        self._lock = threading.Lock()

    def note(self, minute: int, seed: int, index: int, outcome: int, ack_ms: float | None = None) -> None:
        with self._lock:
            row = self.outcomes.get(seed)
            if row is None:
                row = self.outcomes[seed] = bytearray(CHUNK)
            row[index] = outcome
            self.per_minute[minute]["sent" if outcome == SENT else OUTCOME_NAMES[outcome]] += 1
            if ack_ms is not None:
                self.ack_ms[minute].append(ack_ms)

    def minute(self, minute: int) -> tuple[Counter, list[float]]:
        """The minute's counts and ACK round trips (ms; handed over, not kept: a minute is asked once)."""
        with self._lock:
            return Counter(self.per_minute.get(minute, Counter())), self.ack_ms.pop(minute, [])

    def totals(self) -> dict[str, int]:
        """Sends and answers over the run, and messages sent that never got an answer nor a timeout."""
        with self._lock:
            out = sum(self.per_minute.values(), Counter())
            unanswered = sum(row.count(SENT) for row in self.outcomes.values())
        return {"sent": out["sent"], **{k: out[k] for k in ("AA", *NEGATIVE_ACKS)}, "unanswered": unanswered}


@dataclass
class Clock:
    t0: float
    minutes: int

    def minute(self, now: float | None = None) -> int:
        m = int(((time.monotonic() if now is None else now) - self.t0) // 60) + 1
        return min(max(m, 1), self.minutes)


def sender(
    k: int,
    *,
    connections: int,
    rate: float,
    clock: Clock,
    end: float,
    ledger: Ledger,
    stop: threading.Event,
    port: int,
    ack_timeout: float,
) -> None:
    """Connection `k`: message n is due at t0 + (n·connections + k)/rate; late ones go at once."""
    sock: socket.socket | None = None
    buf = b""
    try:
        for n, (seed, index, frame) in enumerate(corpus_stream(1 + k, connections)):
            due = clock.t0 + (n * connections + k) / rate
            if due >= end or stop.is_set():
                return
            if (delay := due - time.monotonic()) > 0 and stop.wait(delay):
                return
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=ack_timeout)
                    buf = b""
                sent_at = time.monotonic()
                sock.sendall(frame)
                ledger.note(clock.minute(sent_at), seed, index, SENT)
                while b"\x1c" not in buf:
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionResetError("closed by the listener")
                    buf += data
                reply, _, buf = buf.partition(b"\x1c")
                buf = buf.removeprefix(b"\r")
                code = _CODES.get(ack_code(reply), AE)
                ledger.note(clock.minute(), seed, index, code, (time.monotonic() - sent_at) * 1000)
            except TimeoutError:
                ledger.note(clock.minute(), seed, index, TIMEOUT)
                sock = _close(sock)
            except OSError:
                ledger.note(clock.minute(), seed, index, CONN_ERROR)
                sock = _close(sock)
    finally:
        _close(sock)


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass
    return None


def send_and_wait(on_store: StackOnStore, count: int, *, port: int, timeout: float) -> None:
    """The pre-flight: `count` messages (seed 0, outside the ledger) on one connection, each ACKed AA,
    then every row finished."""
    frames = [b"\x0b" + m.encode() + b"\x1c\r" for m in corpus(count, seed=0)]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        for frame in frames:
            sock.sendall(frame)
            reply = b""
            while b"\x1c" not in reply:
                data = sock.recv(65536)
                if not data:
                    raise SystemExit("pre-flight: the listener closed the connection")
                reply += data
            if ack_code(reply) != "AA":
                raise SystemExit(f"pre-flight: a message was answered {ack_code(reply)}")
    deadline = time.monotonic() + timeout
    while on_store.outstanding():
        if time.monotonic() > deadline:
            raise SystemExit(f"pre-flight: {count} messages not delivered after {timeout:.0f} s")
        time.sleep(1)


# --- what each minute measures --------------------------------------------------------------------


def backlog(on_store: StackOnStore, conn: Any) -> tuple[dict[str, int], dict[str, float | None]]:
    """Per stage: rows not finished, and the age (s, DB clock) of the oldest; each count through the
    stage's partial indexes (claimable: pending/error; in flight), so it costs the backlog, not the table."""
    rows, oldest = {}, {}
    [[now]] = conn.execute(f"SELECT {on_store.now_ms}").fetchall()
    for stage in STAGES:
        n, first = 0, None
        for where in ("status IN ('pending', 'error')", "status = 'in_flight'"):
            [[count, created]] = conn.execute(
                f"SELECT count(*), min({on_store.ms('created_at')}) FROM stage_{stage} WHERE {where}"
            ).fetchall()
            n += count
            if created is not None:
                first = created if first is None else min(first, created)
        rows[stage] = n
        oldest[stage] = None if first is None else max(0.0, (now - first) / 1000)
    return rows, oldest


class Deliveries:
    """Outbound rows done since the last look, with inbound created_at → outbound updated_at (s).

    Reads rows from a low watermark: the oldest outbound row not finished at the last look, held
    back to the highest id seen the look before (a transaction that took ids earlier may commit
    after a later one: PostgreSQL's sequences), so each look reads about two minutes of rows."""

    def __init__(self, on_store: StackOnStore, since: int) -> None:
        self.on_store = on_store
        self.low = since + 1
        self.prev_top = since
        self.counted: set[int] = set()
        self.dead = 0

    def sample(self, conn: Any) -> list[float]:
        ms = self.on_store.ms
        param = "%s" if self.on_store.pg is not None else "?"
        rows = conn.execute(
            f"SELECT o.id, o.status, {ms('i.created_at')}, {ms('o.updated_at')} FROM stage_outbound o"
            f" JOIN stage_inbound i ON i.id = o.source_id WHERE o.id >= {param}",
            (self.low,),
        ).fetchall()
        latencies = []
        unfinished = []
        top = self.prev_top
        for rid, status, created, updated in rows:
            top = max(top, rid)
            if status in ("done", "dead"):
                if rid not in self.counted:
                    self.counted.add(rid)
                    if status == "done":
                        latencies.append((updated - created) / 1000)
                    else:
                        self.dead += 1
            else:
                unfinished.append(rid)
        low = min(min(unfinished, default=top + 1), self.prev_top + 1)
        self.prev_top = top
        self.low = low
        self.counted = {rid for rid in self.counted if rid >= low}
        return latencies


LOCK_ERROR = re.compile(r"database (table )?is locked|lock timeout|could not obtain lock|deadlock", re.IGNORECASE)
LOCK_WAIT = re.compile(r"slow write transaction took (\d+) ms|still waiting for \w*Lock")
SLOW_STATEMENT = re.compile(r"slow statement (\S+) took (\d+(?:\.\d+)?) ms")
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d\.\d{6})")
INTERESTING = (LOCK_ERROR, LOCK_WAIT, SLOW_STATEMENT)


@dataclass
class LogScan:
    """The minute's lines of interest, from the bytes appended to the stack's logs since the last scan."""

    lock_waits: int = 0
    longest_write_ms: float = 0.0
    lock_errors: int = 0
    lock_error_lines: list[str] = field(default_factory=list)
    slow: list[tuple[float, str]] = field(default_factory=list)

    def add(self, line: str) -> None:
        if LOCK_ERROR.search(line):
            self.lock_errors += 1
            if len(self.lock_error_lines) < 3:
                self.lock_error_lines.append(line.strip()[:300])
        if m := LOCK_WAIT.search(line):
            self.lock_waits += 1
            if m[1]:
                self.longest_write_ms = max(self.longest_write_ms, float(m[1]))
        for name, took in SLOW_STATEMENT.findall(line):
            self.slow.append((float(took), name))


def dedup_key(line: str) -> tuple[str, str, str] | None:
    """A line's timestamp (to the microsecond) and the part a pattern matched: the same record
    written to two logs (a task's own and the scheduler's, in two formats) has the same key."""
    stamp = _STAMP.search(line)
    if stamp is None:
        return None
    for pattern in INTERESTING:
        if m := pattern.search(line):
            return stamp[1], stamp[2], m[0]
    return None


class LogTail:
    """New complete lines of every file under `roots` (files or directories, walked each time); a
    record seen in another log within the last few scans is counted once."""

    def __init__(self, roots: Sequence[Path]) -> None:
        self.roots = list(roots)
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.seen: dict[tuple[str, str, str], int] = {}
        self.scans = 0

    def _files(self) -> Iterator[Path]:
        for root in self.roots:
            if root.is_file():
                yield root
            elif root.is_dir():
                for parent, _, names in os.walk(root):
                    for name in names:
                        yield Path(parent) / name

    def skip_to_end(self) -> None:
        for path in self._files():
            try:
                self.offsets[path] = path.stat().st_size
            except OSError:
                pass

    def scan(self) -> LogScan:
        out = LogScan()
        self.scans += 1
        self.seen = {k: n for k, n in self.seen.items() if n >= self.scans - 3}
        for path in self._files():
            try:
                size = path.stat().st_size
                start = self.offsets.get(path, 0)
                if size < start:  # truncated or replaced
                    start, self.partial[path] = 0, b""
                if size == start:
                    continue
                with open(path, "rb") as f:
                    f.seek(start)
                    data = self.partial.pop(path, b"") + f.read(size - start)
                self.offsets[path] = size
            except OSError:
                continue
            *lines, rest = data.split(b"\n")
            if rest:
                self.partial[path] = rest
            for raw in lines:
                line = raw.decode("utf-8", errors="replace")
                if not any(p.search(line) for p in INTERESTING):
                    continue
                if (key := dedup_key(line)) is not None:
                    if key in self.seen:
                        continue
                    self.seen[key] = self.scans
                out.add(line)
        return out


class FailedTasks:
    """Airflow task tries newly failed or up for retry (its SQLite metadata DB, read only)."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.seen: set[tuple[str, int]] = set()

    def new(self) -> list[str] | None:
        """The tries not seen before as "dag.task (state)"; None if the DB could not be read now."""
        if not self.db.exists():
            return []
        try:
            conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)
            try:
                rows = conn.execute(
                    "SELECT id, try_number, dag_id, task_id, state FROM task_instance"
                    " WHERE state IN ('failed', 'up_for_retry')"
                    " UNION ALL SELECT task_instance_id, try_number, dag_id, task_id, state FROM task_instance_history"
                    " WHERE state IN ('failed', 'up_for_retry')"
                ).fetchall()
            finally:
                conn.close()
        except sqlite3.Error:
            return None
        new = []
        for ti, try_number, dag_id, task_id, state in rows:
            if (ti, try_number) not in self.seen:
                self.seen.add((ti, try_number))
                new.append(f"{dag_id}.{task_id} try {try_number} ({state})")
        return new


def process_group(argv: Sequence[str]) -> str:
    """A short name for what a process of the stack runs (its command line, or its title)."""
    text = " ".join(argv)
    exe = Path(argv[0].split(" ")[0]).name if argv else ""
    if "listeners.daemon" in text:
        return "listenerd"
    if exe == "java":
        return "spark driver"
    if "pyspark" in text:
        return "spark python"
    if "LocalExecutor" in text:
        return "executor slot"
    if text.startswith("airflow worker"):
        return "task runner"
    if "api_server" in text or "api-server" in text:
        return "api-server"
    if "dag-processor" in text or "dag_processor" in text:
        return "dag-processor"
    if "scheduler" in text:
        return "scheduler"
    if "demo receive" in text or "include.app.demo" in text:
        return "demo-receiver"
    if any(Path(a).name == "stageline" for a in argv[:2]) and "up" in argv[1:3]:
        return "stageline up"
    return exe or "?"


def rss_by_group(root_pid: int) -> dict[str, dict[str, int]]:
    """{group: {"n": processes, "sum": bytes, "max": bytes}} over the process tree of `root_pid` (/proc)."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    groups: dict[str, dict[str, int]] = {}
    for p in procs:
        try:
            group = process_group(p.cmdline())
            rss = p.memory_info().rss
        except psutil.Error:
            continue
        g = groups.setdefault(group, {"n": 0, "sum": 0, "max": 0})
        g["n"] += 1
        g["sum"] += rss
        g["max"] = max(g["max"], rss)
    return groups


def sqlite_tables(db: Path) -> dict[str, dict[str, int]]:
    """{table: {"bytes": table + indexes, "index_bytes", "rows"}} from the dbstat virtual table (every
    page read once: not cheap on a large file), else {} if this SQLite has no dbstat."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        owner = dict(conn.execute("SELECT name, tbl_name FROM sqlite_master WHERE type IN ('table', 'index')"))
        kinds = dict(conn.execute("SELECT name, type FROM sqlite_master WHERE type IN ('table', 'index')"))
        try:
            sizes = conn.execute("SELECT name, pgsize FROM dbstat('main', 1)").fetchall()
        except sqlite3.OperationalError:
            try:
                sizes = conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall()
            except sqlite3.OperationalError:
                return {}
        tables: dict[str, dict[str, int]] = {}
        for name, size in sizes:
            t = tables.setdefault(owner.get(name, name), {"bytes": 0, "index_bytes": 0, "rows": 0})
            t["bytes"] += size
            if kinds.get(name) == "index":
                t["index_bytes"] += size
        for name in tables:
            if kinds.get(name) == "table":
                tables[name]["rows"] = conn.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0]
        return tables
    finally:
        conn.close()


def pg_tables(conn: Any) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """({table: {"bytes", "index_bytes", "rows"}}, {table: dead tuples}) from the server's statistics."""
    tables, dead = {}, {}
    for name, total, index, live, n_dead in conn.execute(
        "SELECT relname, pg_total_relation_size(relid), pg_indexes_size(relid), n_live_tup, n_dead_tup"
        " FROM pg_stat_user_tables"
    ).fetchall():
        tables[name] = {"bytes": total, "index_bytes": index, "rows": live}
        dead[name] = n_dead
    return tables, dead


def pg_top_statements(conn: Any, limit: int = 3) -> list[dict[str, Any]]:
    """The stack's statements with the longest single run since the last call (then reset)."""
    rows = conn.execute(
        "SELECT s.query, s.calls, s.mean_exec_time, s.max_exec_time FROM pg_stat_statements s"
        " JOIN pg_database d ON d.oid = s.dbid JOIN pg_roles r ON r.oid = s.userid"
        f" WHERE d.datname = 'stageline' AND r.rolname <> '{BENCH_ROLE}' ORDER BY s.max_exec_time DESC LIMIT {limit}"
    ).fetchall()
    conn.execute("SELECT pg_stat_statements_reset()")
    return [
        {"query": " ".join(q.split())[:160], "calls": calls, "mean_ms": round(mean, 1), "max_ms": round(mx, 1)}
        for q, calls, mean, mx in rows
    ]


# --- the minute rows ------------------------------------------------------------------------------


class Soak:
    def __init__(self, on_store: StackOnStore, args: argparse.Namespace, out: Path) -> None:
        self.on_store = on_store
        self.args = args
        self.out = out
        self.rows: list[dict] = []
        self.ledger = Ledger()
        self.sizes_every = args.sizes_every or max(1, round(args.minutes / 12))
        var = on_store.stack.var
        roots = [on_store.stack.log_path, var / "log", var / "airflow" / "logs"]
        if on_store.pg is not None:
            roots.append(on_store.pg.root / "server.log")
        self.logs = LogTail(roots)
        self.failed = FailedTasks(var / "airflow" / "airflow.db")
        self.deliveries: Deliveries | None = None
        self.latencies = array("d")
        self.wal_lsn: str | None = None

    def prime(self) -> None:
        """Start PostgreSQL's counters at the first send: the WAL position, the statement statistics."""
        if self.on_store.pg is None:
            return
        conn = self.on_store.connect()
        try:
            [[self.wal_lsn]] = conn.execute("SELECT pg_current_wal_lsn()::text").fetchall()
            conn.execute("SELECT pg_stat_statements_reset()")
        finally:
            conn.close()

    def row(self, minute: int, phase: str) -> dict:
        """Measure the minute just ended."""
        on_store, pg = self.on_store, self.on_store.pg is not None
        acks, ack_ms = self.ledger.minute(minute) if phase != "drain" else (Counter(), [])
        conn = on_store.connect()
        try:
            rows, oldest = backlog(on_store, conn)
            assert self.deliveries is not None
            lat = self.deliveries.sample(conn)
            tables = dead = top = None
            if pg:
                tables, dead = pg_tables(conn)
                [[db_bytes]] = conn.execute("SELECT pg_database_size('stageline')").fetchall()
                [[lsn, wal]] = conn.execute(
                    "SELECT pg_current_wal_lsn()::text, pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)",
                    (self.wal_lsn or "0/0",),
                ).fetchall()
                wal_bytes = int(wal) if self.wal_lsn else None
                self.wal_lsn = lsn
                top = pg_top_statements(conn)
        finally:
            conn.close()
        if not pg:
            db_bytes = _size(on_store.db_path)
            wal_bytes = _size(on_store.db_path.with_name(on_store.db_path.name + "-wal"))
            if phase == "drain" or minute == 1 or minute % self.sizes_every == 0 or minute == self.args.minutes:
                tables = sqlite_tables(on_store.db_path)
        self.latencies.extend(lat)
        logs = self.logs.scan()
        failed = self.failed.new()
        rss = rss_by_group(on_store.stack.pid)
        return {
            "minute": minute,
            "phase": phase,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "sent": acks.get("sent", 0),
            "acks": {k: acks.get(k, 0) for k in ("AA", *NEGATIVE_ACKS)},
            "ack_p99_ms": round(percentile(ack_ms, 0.99), 1) if ack_ms else None,
            "backlog": rows,
            "oldest_s": {k: None if v is None else round(v, 1) for k, v in oldest.items()},
            "delivered": {
                "n": len(lat),
                **(
                    {
                        "p50": round(statistics.median(lat), 3),
                        "p99": round(percentile(lat, 0.99), 3),
                        "max": round(max(lat), 3),
                    }
                    if lat
                    else {"p50": None, "p99": None, "max": None}
                ),
            },
            "lock_waits": logs.lock_waits,
            "longest_write_ms": logs.longest_write_ms or None,
            "lock_errors": logs.lock_errors,
            "lock_error_lines": logs.lock_error_lines,
            "slow_statements": len(logs.slow),
            "slowest": [[n, t] for t, n in sorted(logs.slow, reverse=True)[:3]],
            "failed_tasks": len(failed) if failed is not None else 0,
            "failed_task_tries": failed or [],
            "rss": rss,
            "rss_max": {g: v["max"] for g, v in rss.items()},
            "db_bytes": db_bytes,
            "wal_bytes": wal_bytes,
            "tables": tables,
            "dead_tuples": dead,
            "pg_top": top,
        }

    def record(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(format_row(row, pg=self.on_store.pg is not None), flush=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


HEADER = (
    f"{'min':>5} {'sent':>6} {'AA':>6} {'AE':>3} {'AR':>3} {'tmo':>3} {'cerr':>4} {'ack99':>6} | "
    f"{'backlog in / rt / out (oldest s)':<36} | {'dlvd':>6} {'p50':>5} {'p99':>5} {'max':>5} | "
    f"{'lockw':>5} {'lockerr':>7} {'slow':>4} | {'fail':>4}"
)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_row(r: dict, *, pg: bool) -> str:
    """The minute's table row and its detail lines."""
    a, b, o, d = r["acks"], r["backlog"], r["oldest_s"], r["delivered"]
    label = "drain" if r["phase"] == "drain" else f"{r['minute']}{'w' if r['phase'] == 'warmup' else ''}"
    backlog_text = " / ".join(f"{b[s]}({_s(o[s])})" for s in STAGES)
    ack99 = "-" if r["ack_p99_ms"] is None else f"{r['ack_p99_ms']:.0f}"
    lines = [
        f"{label:>5} {r['sent']:>6} {a['AA']:>6} {a['AE']:>3} {a['AR']:>3} {a['timeout']:>3} {a['conn_error']:>4} "
        f"{ack99:>6} | {backlog_text:<36} | {d['n']:>6} {_s(d['p50']):>5} {_s(d['p99']):>5} {_s(d['max']):>5} | "
        f"{r['lock_waits']:>5} {r['lock_errors']:>7} {r['slow_statements']:>4} | {r['failed_tasks']:>4}"
    ]
    rss = " · ".join(
        f"{g} {v['max'] / MIB:.0f}{' (×' + str(v['n']) + ')' if v['n'] > 1 else ''}"
        for g, v in sorted(r["rss"].items(), key=lambda kv: -kv[1]["max"])
    )
    if pg:
        wal = "-" if r["wal_bytes"] is None else f"{r['wal_bytes'] / MIB:.1f} MiB written"
        store = f"db {r['db_bytes'] / MIB:.1f} MiB, WAL {wal}"
    else:
        store = f"db {r['db_bytes'] / MIB:.1f} MiB, -wal {r['wal_bytes'] / MIB:.1f} MiB"
    lines.append(f"{'':>6}RSS MiB: {rss} | {store}")
    if r["tables"]:
        biggest = sorted(r["tables"].items(), key=lambda kv: -kv[1]["bytes"])[:5]
        dead = r.get("dead_tuples") or {}
        lines.append(
            f"{'':>6}tables MiB (of which indexes; bytes/row{'; dead tuples' if pg else ''}): "
            + " · ".join(
                f"{t} {v['bytes'] / MIB:.1f} ({v['index_bytes'] / MIB:.1f}; "
                f"{v['bytes'] / v['rows'] if v['rows'] else 0:.0f}{'; ' + str(dead.get(t, 0)) if pg else ''})"
                for t, v in biggest
            )
        )
    if r["slowest"] or r.get("longest_write_ms"):
        lines.append(
            f"{'':>6}slow statements: "
            + (", ".join(f"{n} {t:.0f} ms" for n, t in r["slowest"]) or "none")
            + (f"; longest write transaction {r['longest_write_ms']:.0f} ms" if r.get("longest_write_ms") else "")
        )
    for s in r.get("pg_top") or []:
        lines.append(
            f"{'':>6}pg_stat_statements: max {s['max_ms']:>5.0f} ms, mean {s['mean_ms']:>6.1f} ms, "
            f"{s['calls']:>6} calls: {s['query'][:90]}"
        )
    for line in r["lock_error_lines"]:
        lines.append(f"{'':>6}lock error: {line[:200]}")
    for t in r["failed_task_tries"][:3]:
        lines.append(f"{'':>6}failed task: {t}")
    return "\n".join(lines)


# --- the end --------------------------------------------------------------------------------------


def what_became(on_store: StackOnStore, ledger: Ledger, since: int) -> dict[str, int]:
    """Every message of the run: staged or not (against the ledger), delivered or not (its rows)."""
    param = "%s" if on_store.pg is not None else "?"
    staged = {seed: bytearray(len(row)) for seed, row in ledger.outcomes.items()}
    duplicates = other = 0
    last = since
    while True:
        batch = on_store.query(
            f"SELECT id, control_id FROM stage_inbound WHERE id > {param} ORDER BY id LIMIT 50000", (last,)
        )
        if not batch:
            break
        last = batch[-1][0]
        for _, control_id in batch:
            key = control_key(control_id)
            if key is None or key[0] not in staged:
                other += 1
                continue
            seed, index = key
            if staged[seed][index]:
                duplicates += 1
            staged[seed][index] = 1
    lost = staged_without_aa = 0
    for seed, row in ledger.outcomes.items():
        for index, outcome in enumerate(row):
            if outcome == AA and not staged[seed][index]:
                lost += 1
            elif outcome not in (0, AA) and staged[seed][index]:
                staged_without_aa += 1
    counts = {
        stage: dict(
            on_store.query(
                f"SELECT status, count(*) FROM stage_{stage} "
                f"WHERE {'id' if stage == 'inbound' else 'source_id'} > {param}"
                " GROUP BY status",
                (since,),
            )
        )
        for stage in STAGES
    }
    [[not_delivered]] = on_store.query(
        f"SELECT count(*) FROM stage_inbound i WHERE i.id > {param} AND (i.status <> 'done'"
        " OR EXISTS (SELECT 1 FROM stage_routed r WHERE r.source_id = i.id AND r.status <> 'done')"
        " OR EXISTS (SELECT 1 FROM stage_outbound o WHERE o.source_id = i.id AND o.status <> 'done'))",
        (since,),
    )
    staged_n = sum(counts["inbound"].values())
    return {
        "staged": staged_n,
        "delivered": staged_n - not_delivered,
        "not_delivered": not_delivered,
        "lost": lost,
        "staged_without_aa": staged_without_aa,
        "duplicates_staged": duplicates,
        "foreign_rows": other,
        "deliveries": counts["outbound"].get("done", 0),
        "dead": sum(c.get("dead", 0) for c in counts.values()),
        "unrouted": counts["inbound"].get("unrouted", 0),
    }


def wait_drained(on_store: StackOnStore, timeout: float) -> float:
    """Seconds until no staged row is unfinished (backlog of every stage 0), at most `timeout`."""
    started = time.monotonic()
    while True:
        conn = on_store.connect()
        try:
            rows, _ = backlog(on_store, conn)
        finally:
            conn.close()
        if not any(rows.values()) or time.monotonic() - started > timeout:
            return time.monotonic() - started
        time.sleep(2)


def ports_in_use(port: int) -> list[int]:
    from include.app import demo
    from include.app.embedded import AIRFLOW_PORT, SPARK_CONNECT_PORT
    from include.app.supervisor import port_open

    return [p for p in (AIRFLOW_PORT, SPARK_CONNECT_PORT, port, 8470, demo.RECEIVER_PORT) if port_open(p)]


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0, help="messages per second, all connections together")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--warmup-minutes", type=int, default=2, help="reported, not judged by bounds and trends")
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--drain-timeout", type=float, default=600.0, help="seconds to wait for the backlog to finish")
    parser.add_argument("--ack-timeout", type=float, default=30.0, help="seconds a sender waits for an ACK")
    parser.add_argument(
        "--sizes-every",
        type=int,
        default=0,
        help="SQLite: measure table sizes (dbstat) every N minutes (default: minutes / 12)",
    )
    parser.add_argument("--port", type=int, default=MLLP_PORT, help="listenerd's MLLP port (config/connections.toml)")
    parser.add_argument("--work", type=Path, help="work dir (default: a new temp dir); kept after the run")
    args = parser.parse_args()
    if args.minutes < 1 or args.rate <= 0 or args.connections < 1:
        parser.error("--minutes, --rate and --connections must be positive")
    if busy := ports_in_use(args.port):
        raise SystemExit(f"port(s) {busy} in use: another embedded stack is running")

    work = args.work or Path(tempfile.mkdtemp(prefix=f"stageline-soak-{args.store}-"))
    work.mkdir(parents=True, exist_ok=True)
    out = work / "soak.jsonl"
    on_store = StackOnStore(
        work,
        args.store,
        pg_settings=PG_SETTINGS if args.store == "postgres" else None,
        pg_setup=["CREATE EXTENSION pg_stat_statements"],
        bench_role=BENCH_ROLE,
    )
    soak = Soak(on_store, args, out)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    signal.signal(signal.SIGTERM, _terminate)
    limits = Limits(rate=args.rate)
    try:
        on_store.start()
        soak.logs.skip_to_end()  # the startup's lines are not the soak's
        print(
            f"stack up in {on_store.stack.up_seconds:.0f} s on {args.store}; work dir {work} "
            f"(logs: {on_store.stack.var / 'log'}, {on_store.stack.log_path})",
            flush=True,
        )
        send_and_wait(on_store, PREFLIGHT, port=args.port, timeout=args.drain_timeout)
        [[since]] = on_store.query("SELECT coalesce(max(id), 0) FROM stage_inbound")
        [[since_out]] = on_store.query("SELECT coalesce(max(id), 0) FROM stage_outbound")
        soak.deliveries = Deliveries(on_store, since_out)
        soak.prime()
        total = int(args.rate * args.minutes * 60)
        print(
            f"pre-flight: {PREFLIGHT} messages delivered; sending {total:,} messages at {args.rate:g}/s on "
            f"{args.connections} connection(s) for {args.minutes} min (warm-up {args.warmup_minutes} min, "
            f"judged after; limits: p99 ≤ {limits.p99_s:g} s, backlog ≤ {limits.backlog_max:,.0f} rows)\n"
            f"per-minute rows → {out}\n",
            flush=True,
        )
        print(HEADER, flush=True)
        clock = Clock(time.monotonic() + 0.5, args.minutes)
        end = clock.t0 + args.minutes * 60
        threads = [
            threading.Thread(
                target=sender,
                name=f"sender-{k}",
                daemon=True,
                kwargs={
                    "k": k,
                    "connections": args.connections,
                    "rate": args.rate,
                    "clock": clock,
                    "end": end,
                    "ledger": soak.ledger,
                    "stop": stop,
                    "port": args.port,
                    "ack_timeout": args.ack_timeout,
                },
            )
            for k in range(args.connections)
        ]
        for t in threads:
            t.start()
        for m in range(1, args.minutes + 1):
            if m == args.minutes:
                for t in threads:  # the last answers belong to the last minute
                    t.join()
            else:
                time.sleep(max(0.0, clock.t0 + 60 * m - time.monotonic()))
            soak.record(soak.row(m, "warmup" if m <= args.warmup_minutes else "judged"))
        drained = wait_drained(on_store, args.drain_timeout)
        soak.record(soak.row(args.minutes + 1, "drain"))
        totals = {**soak.ledger.totals(), **what_became(on_store, soak.ledger, since)}
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the senders, the stack" + (" and PostgreSQL" if on_store.pg else ""), flush=True)
        return 130
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=args.ack_timeout + 5)
        on_store.stop()

    lat = soak.latencies
    print(f"\ndrained {drained:.0f} s after the last minute; per-minute rows in {out}; work dir {work}")
    print(
        f"sent {totals['sent']:,}: AA {totals['AA']:,}, AE {totals['AE']:,}, AR {totals['AR']:,}, "
        f"timeouts {totals['timeout']:,}, connection errors {totals['conn_error']:,}, "
        f"unanswered {totals['unanswered']:,}"
    )
    print(
        f"staged {totals['staged']:,} (lost: ACKed AA, not staged {totals['lost']:,}; staged without an AA "
        f"{totals['staged_without_aa']:,}; staged twice {totals['duplicates_staged']:,}); delivered "
        f"{totals['delivered']:,}, not delivered {totals['not_delivered']:,} (dead rows {totals['dead']:,}, "
        f"unrouted {totals['unrouted']:,}); {totals['deliveries']:,} deliveries"
    )
    if lat:
        print(
            f"delivered over the run: p50 {statistics.median(lat):.2f} s, p99 {percentile(lat, 0.99):.2f} s, "
            f"max {max(lat):.2f} s"
        )
    with open(out, "a") as f:
        f.write(json.dumps({"totals": totals, "args": {k: str(v) for k, v in vars(args).items()}}) + "\n")
    v = verdict(soak.rows, totals, limits)
    for note in v.notes:
        print(f"note: {note}")
    if v.ok:
        print(f"VERDICT: PASS ({args.minutes} min at {args.rate:g} msg/s on {args.store})")
        return 0
    print(f"VERDICT: FAIL ({args.minutes} min at {args.rate:g} msg/s on {args.store})")
    for failure in v.failures:
        print(f"  - {failure}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
