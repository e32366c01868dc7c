"""The `Store`: a connection source plus short transactions that run named queries.

One `Store` per process, holding `[store].pool_size` connections. PostgreSQL's come from a psycopg
pool. SQLite's are a fixed set, all opened at the first transaction and kept: a transaction takes a
free one and gives it back, and waits (up to POOL_WAIT_SECONDS) when every one is in use. So a
process's SQLite descriptors (two a connection: the database and its WAL) are the same at rest
whatever ran meanwhile — not one connection per thread, which a thread pool grows as it pleases
(and SQLite defers closing a file another connection holds a lock on, so closing surplus ones would
not keep the count steady). SQL Server keeps one connection per thread. A
transaction either commits as a whole or rolls back; nothing here retries, so callers see every
failure.

Every statement and every write transaction is timed: one slower than SLOW_SECONDS is logged
(`slow statement <name> took <ms> ms`, `slow write transaction took <ms> ms: <names>`) — a
statement whose cost grows with the table shows up here long before it stalls anyone — and each
thread keeps the longest write transaction it ran since it last asked (`Store.longest_write`), which
is how a stage sizes its next micro-batch by time (`include.batch_size`).

Durability (docs/store.md): each new server connection is pinned and checked
(`include.store.durability`); once `check_durability` was called (listenerd at start) the check is
also repeated every DURABILITY_RECHECK_SECONDS on a pooled connection as a transaction takes it (so
off the reactor thread, and at least with each heartbeat): a server whose `fsync` was turned off at
run time is noticed within that time, logged as an error at every recheck, shown by
`durability_problem`, and every transaction fails (listenerd answers `AE`) until it is back on.
On PostgreSQL a commit whose wait for the synchronous standby was cancelled raises
`CommitUnconfirmed` (`include.store.unconfirmed`) although the server kept it.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from include.config import StoreConfig
from include.store import queries
from include.store.dialects import DIALECTS, Dialect, PostgresDialect
from include.store.durability import UnsafeDurability, check_connection
from include.store.unconfirmed import watching

log = logging.getLogger(__name__)

POOL_WAIT_SECONDS = 30.0
"""How long a SQLite transaction waits for a free connection (psycopg's pool waits as long)."""
DURABILITY_RECHECK_SECONDS = 60.0
"""How often a checked store asks the server again whether its commits are durable (a setting such
as PostgreSQL's `fsync` can change with a reload, without any new connection)."""
SLOW_SECONDS = 0.1
"""A statement or write transaction slower than this is logged: on SQLite the write lock is
everyone's, and at the rated rate no one may hold it longer (invariant 13)."""


class ReadTimedOut(RuntimeError):
    """A read ran past its bound and was stopped by the store."""

    def __init__(self, seconds: float, setting: str) -> None:
        super().__init__(f"the read ran past {seconds:g} s and was stopped ({setting})")
        self.seconds = seconds


def _timed_out(exc: BaseException) -> bool:
    """`exc` is the store stopping a statement at its time bound."""
    if isinstance(exc, sqlite3.OperationalError):
        return "interrupted" in str(exc)
    number = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    return type(exc).__name__ == "QueryCanceled" or number == 1222  # psycopg; SQL Server's lock timeout


@dataclass(frozen=True)
class StagedTable:
    """A staged table the row-lease primitives may touch (the whitelist for `{table}`)."""

    name: str
    key: str
    """Its short name (`inbound`, `routed`, `outbound`): the `stage` column of its audit events, its
    retention key, its row in `stageline stages`. A stage that claims from it has a name of its own
    (`include.store.stages`: `route` claims from `inbound`)."""
    has_destination: bool
    purge: str
    """The retention query of this table (each repeats its own finished predicate; inbound and
    outbound rows take their bodies with them)."""

    def template(self) -> dict[str, str]:
        return {"table": self.name, "dest": "destination" if self.has_destination else "NULL"}


INBOUND = StagedTable("stage_inbound", "inbound", False, "purge_finished_inbound")
ROUTED = StagedTable("stage_routed", "routed", True, "purge_finished_routed")
OUTBOUND = StagedTable("stage_outbound", "outbound", True, "purge_finished_outbound")
STAGED_TABLES = (INBOUND, ROUTED, OUTBOUND)


class Tx:
    """One open transaction; methods run named queries and return dict rows."""

    def __init__(self, store: Store, conn: Any) -> None:
        self.store = store
        self.conn = conn
        self.dialect: Dialect = store.dialect
        self._fenced = False
        self.names: list[str] = []
        """The named statements this transaction ran, in order (for the slow-transaction log)."""

    def sql(self, name: str, table: StagedTable | None = None) -> str:
        return self.store.sql(name, table)

    def all(
        self, name: str, params: Mapping[str, Any] | None = None, *, table: StagedTable | None = None
    ) -> list[dict[str, Any]]:
        return self._fetch(name, self.sql(name, table), dict(params or {}))

    def _fetch(self, name: str, text: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        started = time.perf_counter()
        cur = self.conn.cursor()
        cur.execute(text, params)
        rows = cur.fetchall() if cur.description else []  # dict rows (every dialect's row factory)
        self._timed(name, started, len(rows))
        return rows

    def _timed(self, name: str, started: float, rows: int) -> None:
        self.names.append(name)
        took = time.perf_counter() - started
        if took > SLOW_SECONDS:
            log.warning("slow statement %s took %.0f ms (%d rows)", name, took * 1000, rows)

    def one(
        self, name: str, params: Mapping[str, Any] | None = None, *, table: StagedTable | None = None
    ) -> dict[str, Any] | None:
        rows = self.all(name, params, table=table)
        return rows[0] if rows else None

    def row(
        self, name: str, params: Mapping[str, Any] | None = None, *, table: StagedTable | None = None
    ) -> dict[str, Any]:
        """The row of a statement that always returns one (an aggregate, a read of the lease row)."""
        found = self.one(name, params, table=table)
        if found is None:
            raise LookupError(f"statement {name} returned no row")
        return found

    def execute(self, name: str, params: Mapping[str, Any] | None = None, *, table: StagedTable | None = None) -> int:
        started = time.perf_counter()
        cur = self.conn.cursor()
        cur.execute(self.sql(name, table), dict(params or {}))
        rowcount: int = cur.rowcount
        self._timed(name, started, max(rowcount, 0))
        return rowcount

    def script(self, text: str) -> None:
        cur = self.conn.cursor()
        for statement in self.dialect.split_script(text):
            cur.execute(statement)

    def fence(self) -> None:
        """Join the epoch fence (once per transaction) before any epoch-conditional write."""
        if not self._fenced:
            self.execute("fence_shared")
            self._fenced = True

    def transition(
        self,
        name: str,
        params: Mapping[str, Any],
        *,
        table: StagedTable,
        event: str,
        from_status: str | None,
        epoch: int | None,
        node_id: str | None,
        ids_only: bool = False,
    ) -> list[dict[str, Any]]:
        """Run transition query `name` and append one audit event per row it moved; the rows
        (with `ids_only`, at least their ids: a caller that needs no more is not sent more).

        One statement where the dialect can (PostgreSQL's `audited`: the events come from the
        transition's own RETURNING), else the transition then `record_events`.
        """
        text = self.store.audited_sql(name, table, returning="id" if ids_only else "*")
        if text is None:
            rows = self.all(name, params, table=table)
            self.record_events(rows, table=table, event=event, from_status=from_status, epoch=epoch, node_id=node_id)
            return rows
        return self._fetch(
            name,
            text,
            {
                **params,
                "ev_stage": table.key,
                "ev_event": event,
                "ev_from": from_status,
                "ev_epoch": epoch,
                "ev_node": node_id,
            },
        )

    def record_events(
        self,
        rows: list[dict[str, Any]],
        *,
        table: StagedTable,
        event: str,
        from_status: str | None,
        epoch: int | None,
        node_id: str | None,
    ) -> None:
        """Append one audit event per row just transitioned (rows as returned by a transition query).

        The events are built by the database from the rows themselves (`record_events_for`: state,
        attempts, last_error as detail) — only the ids travel, not one JSON object per row.
        """
        if not rows:
            return
        self.execute(
            "record_events_for",
            {
                "ids": self.dialect.id_list([r["id"] for r in rows]),
                "stage": table.key,
                "event": event,
                "from_status": from_status,
                "epoch": epoch,
                "node_id": node_id,
            },
            table=table,
        )


class Store:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.dialect = DIALECTS[config.backend]
        self._queries = queries.load(config.backend)
        self._sql_cache: dict[tuple[str, str | None], str] = {}
        self._local = threading.local()
        self._held = threading.local()  # this thread's longest write transaction since it last asked
        self._free: queue.LifoQueue[Any] | None = None  # SQLite: the connections not in a transaction
        self._free_lock = threading.Lock()
        self._pool: Any = None
        self._unsafe: UnsafeDurability | None = None  # set by a new connection to an unsafe server
        self._strict = False  # check_durability() was called: an unsafe server fails every transaction
        self.clock = time.monotonic  # for the durability recheck's interval (tests move it)
        self._checked_at = self.clock()  # when a connection last checked durability
        self._rechecking = threading.Lock()
        self.read_timeout: float | None = None
        """Seconds a read transaction may run before the store stops it (ReadTimedOut); None: no
        bound. An operator's command sets it (`[store] read_timeout_seconds`, `--timeout`); a
        process whose reads are its own work (listenerd, a stage) leaves it: a bound costs each
        read transaction a statement on PostgreSQL."""
        if config.backend == "postgres":
            from psycopg.rows import dict_row

            from include.store.pg_pool import PromptPool

            assert isinstance(self.dialect, PostgresDialect)
            self._pool = PromptPool(
                kwargs={**self.dialect.conninfo(config), "row_factory": dict_row, "autocommit": False},
                min_size=1,
                max_size=config.pool_size,
                open=True,
                name="stageline",
                timeout=30,
                configure=self._pin_durability,
            )

    @property
    def backend(self) -> str:
        return self.config.backend

    def sql(self, name: str, table: StagedTable | None = None) -> str:
        key = (name, table.name if table else None)
        text = self._sql_cache.get(key)
        if text is None:
            text = self._sql_cache[key] = self._render(self._raw(name), table)
        return text

    def has_query(self, name: str) -> bool:
        """Whether this dialect defines `name` (some statements exist only where they pay)."""
        return name in self._queries

    def audited_sql(self, name: str, table: StagedTable | None = None, *, returning: str = "*") -> str | None:
        """Transition `name` with its audit events as one statement (the dialect's `audited`
        wrapper, reading back `returning`: "*" or "id"), or None where the dialect writes them in
        a second statement."""
        if not self.has_query("audited"):
            return None
        if returning not in ("*", "id"):
            raise ValueError(f"returning must be '*' or 'id', got {returning!r}")
        key = (f"audited:{returning}:{name}", table.name if table else None)
        text = self._sql_cache.get(key)
        if text is None:
            raw = self._raw("audited").replace("{transition}", self._raw(name)).replace("{returning}", returning)
            text = self._sql_cache[key] = self._render(raw, table)
        return text

    def _raw(self, name: str) -> str:
        try:
            return self._queries[name]
        except KeyError:
            raise KeyError(f"no query {name!r} for {self.backend}") from None

    def _render(self, raw: str, table: StagedTable | None) -> str:
        if "{" in raw:
            raw = raw.format_map({**self.dialect.template, **(table.template() if table else {})})
        return self.dialect.translate(raw)

    def _pin_durability(self, conn: Any) -> None:
        """Every new server connection: synchronous_commit pinned, fsync / delayed durability
        checked (`include.store.durability`). A refusal is kept and raised by every transaction:
        raised here, the pool would only retry the connection."""
        was = self._unsafe
        try:
            check_connection(conn, self.backend, allow_unsafe=self.config.allow_unsafe_durability)
        except UnsafeDurability as exc:
            self._unsafe = exc
            if self._strict:
                log.error("store durability lost, every transaction refused until fixed: %s", exc)
        else:
            self._unsafe = None
            if was is not None and self._strict:
                log.warning("store durability restored: transactions accepted again")
        self._checked_at = self.clock()

    def durability_refusal(self) -> UnsafeDurability | None:
        """What a commit must raise now: the last check's refusal once `check_durability` was
        called (listenerd), else None. For a writer with its own connection (listeners.pgcommit)."""
        return self._unsafe if self._strict else None

    @property
    def durability_problem(self) -> str | None:
        """Why the server may lose commits, as last found (None: durable, or allowed)."""
        return str(self._unsafe) if self._unsafe is not None else None

    def _recheck_durability(self, conn: Any) -> None:
        """Check durability again on `conn` (idle, just taken) if DURABILITY_RECHECK_SECONDS have
        passed since the last check; one thread at a time, the others go on."""
        if not self._strict or self.backend == "sqlite" or self.clock() - self._checked_at < DURABILITY_RECHECK_SECONDS:
            return
        if not self._rechecking.acquire(blocking=False):
            return
        try:
            if self.clock() - self._checked_at >= DURABILITY_RECHECK_SECONDS:
                self._pin_durability(conn)
        finally:
            self._rechecking.release()

    def check_durability(self) -> None:
        """Raise `UnsafeDurability` if the server may lose commits; from now on every transaction
        of this store raises it too whenever a new connection finds the server so (a server
        restarted with fsync off). listenerd calls this at start: the ingest path never answers AA
        on such a server unless `allow_unsafe_durability` says so."""
        self._strict = True
        with self._connection():
            pass

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        if self._pool is not None:
            with self._pool.connection() as conn:
                self._recheck_durability(conn)
                if self._strict and self._unsafe is not None:
                    raise self._unsafe
                yield conn
            return
        if self.backend == "sqlite":
            free = self._sqlite_pool()
            try:
                conn = free.get(timeout=POOL_WAIT_SECONDS)
            except queue.Empty:
                raise TimeoutError(
                    f"no free SQLite connection in {POOL_WAIT_SECONDS:.0f} s "
                    f"(all {self.config.pool_size} in transactions)"
                ) from None
            try:
                if conn is None:  # its predecessor broke and could not be replaced then
                    conn = self.dialect.connect(self.config)
                yield conn
            except BaseException:
                conn = self._replace(conn)  # a broken connection is not reused
                raise
            finally:
                free.put(conn)
            return
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self.dialect.connect(self.config)
            try:
                self._pin_durability(conn)
                if self._strict and self._unsafe is not None:
                    raise self._unsafe
            except BaseException:
                conn.close()
                raise
            self._local.conn = conn
        try:
            self._recheck_durability(conn)
            if self._strict and self._unsafe is not None:
                raise self._unsafe
            yield conn
        except BaseException:
            # a broken connection is not reused
            self._local.conn = None
            try:
                conn.close()
            except Exception:  # noqa: S110  closing a broken connection is best effort
                pass
            raise

    def _sqlite_pool(self) -> queue.LifoQueue[Any]:
        with self._free_lock:
            if self._free is None:
                free: queue.LifoQueue[Any] = queue.LifoQueue()
                for _ in range(max(1, self.config.pool_size)):
                    free.put(self.dialect.connect(self.config))
                self._free = free
            return self._free

    def _replace(self, conn: Any) -> Any:
        """A new connection in place of `conn` (closed); None when none can be opened now."""
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: S110  closing a broken connection is best effort
                pass
        try:
            return self.dialect.connect(self.config)
        except Exception:
            return None

    @contextmanager
    def transaction(self, *, write: bool = True) -> Iterator[Tx]:
        """One transaction; a read one (`write=False`) is stopped after `read_timeout` seconds."""
        with self._connection() as conn:
            self.dialect.begin(conn, write=write)
            started = time.perf_counter()
            tx = Tx(self, conn)
            try:
                if write or self.read_timeout is None:
                    yield tx
                else:
                    with self.bounded(tx, self.read_timeout, setting="[store] read_timeout_seconds / --timeout"):
                        yield tx
            except BaseException:
                conn.rollback()
                if write:
                    self._note_write(tx, time.perf_counter() - started)
                raise
            if self._pool is not None:  # PostgreSQL: a commit its standby did not confirm raises
                with watching(conn):
                    conn.commit()
            else:
                conn.commit()
            if write:  # the commit (its fsync) is part of the hold
                self._note_write(tx, time.perf_counter() - started)

    @contextmanager
    def bounded(self, tx: Tx, seconds: float, *, setting: str) -> Iterator[None]:
        """`tx`'s statements end after `seconds`, whatever the dialect (PostgreSQL's statement_timeout
        for this transaction, SQLite's progress handler, SQL Server's LOCK_TIMEOUT: there a scan is
        not stopped, a wait on a lock is); ReadTimedOut naming `setting` when they do."""
        tx.one("read_timeout", {"ms": max(1, int(seconds * 1000))})
        conn = tx.conn
        if isinstance(conn, sqlite3.Connection):
            deadline = time.monotonic() + seconds
            conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        try:
            yield
        except Exception as exc:
            if _timed_out(exc):
                raise ReadTimedOut(seconds, setting) from None
            raise
        finally:
            if isinstance(conn, sqlite3.Connection):
                conn.set_progress_handler(None, 0)

    def note_hold(self, seconds: float) -> None:
        """Count a write this thread caused outside a `transaction` (a Spark JDBC landing write on
        SQLite: another process holds the lock for it) in `longest_write`."""
        self._held.longest = max(getattr(self._held, "longest", 0.0), seconds)

    def _note_write(self, tx: Tx, held: float) -> None:
        self.note_hold(held)
        if held > SLOW_SECONDS:
            log.warning("slow write transaction took %.0f ms: %s", held * 1000, ", ".join(tx.names) or "-")

    def longest_write(self) -> float:
        """Seconds of the longest write transaction this thread ran since its last call (0.0 if none)."""
        longest = getattr(self._held, "longest", 0.0)
        self._held.longest = 0.0
        return longest

    @contextmanager
    def single_statement(self) -> Iterator[Tx]:
        """For work that is one atomic statement on this dialect (PostgreSQL's staging CTE):
        autocommit saves the BEGIN and COMMIT round trips. Elsewhere an ordinary transaction."""
        if not self.dialect.atomic_staging:
            with self.transaction() as tx:
                yield tx
            return
        with self._connection() as conn:
            conn.autocommit = True
            try:
                with watching(conn):  # its statement is its commit
                    yield Tx(self, conn)
            finally:
                conn.autocommit = False

    def close(self) -> None:
        """Close the connections (SQLite: those not in a transaction; SQL Server: this thread's);
        using the store again opens new ones."""
        if self._pool is not None:
            self._pool.close()
        with self._free_lock:
            free, self._free = self._free, None
        while free is not None and not free.empty():
            conn = free.get_nowait()
            if conn is not None:
                conn.close()
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
