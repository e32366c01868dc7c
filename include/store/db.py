"""The `Store`: a connection source plus short transactions that run named queries.

One `Store` per process. PostgreSQL connections come from a psycopg pool sized by
`[store].pool_size`. SQLite connections are shared out the same way, without a bound: a
transaction takes an idle connection (or opens one) and gives it back, so a process holds as many
as it ever ran transactions at once — not one for every thread that ever touched the store (a
thread pool adds threads as it pleases, and each kept a connection, two file descriptors, for
good: listenerd's descriptor count stepped up at random). SQL Server keeps one connection per
thread. A transaction either commits as a whole or rolls back; nothing here retries, so callers
see every failure.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from include.config import StoreConfig
from include.store import queries
from include.store.dialects import DIALECTS, Dialect


@dataclass(frozen=True)
class StagedTable:
    """A staged table the row-lease primitives may touch (the whitelist for `{table}`)."""

    name: str
    stage: str
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

    def sql(self, name: str, table: StagedTable | None = None) -> str:
        return self.store.sql(name, table)

    def all(self, name: str, params: Mapping[str, Any] | None = None, *,
            table: StagedTable | None = None) -> list[dict[str, Any]]:
        cur = self.conn.cursor()
        cur.execute(self.sql(name, table), dict(params or {}))
        rows = cur.fetchall() if cur.description else []
        return [dict(r) for r in rows]

    def one(self, name: str, params: Mapping[str, Any] | None = None, *,
            table: StagedTable | None = None) -> dict[str, Any] | None:
        rows = self.all(name, params, table=table)
        return rows[0] if rows else None

    def execute(self, name: str, params: Mapping[str, Any] | None = None, *,
                table: StagedTable | None = None) -> int:
        cur = self.conn.cursor()
        cur.execute(self.sql(name, table), dict(params or {}))
        return cur.rowcount

    def script(self, text: str) -> None:
        cur = self.conn.cursor()
        for statement in self.dialect.split_script(text):
            cur.execute(statement)

    def fence(self) -> None:
        """Join the epoch fence (once per transaction) before any epoch-conditional write."""
        if not self._fenced:
            self.execute("fence_shared")
            self._fenced = True

    def record_events(self, rows: list[dict[str, Any]], *, table: StagedTable, event: str,
                      from_status: str | None, epoch: int | None, node_id: str | None) -> None:
        """Append one audit event per row just transitioned (rows as returned by a transition query).

        The events are built by the database from the rows themselves (`record_events_for`: state,
        attempts, last_error as detail) — only the ids travel, not one JSON object per row.
        """
        if not rows:
            return
        self.execute("record_events_for", {"ids": self.dialect.id_list([r["id"] for r in rows]),
                                           "stage": table.stage, "event": event, "from_status": from_status,
                                           "epoch": epoch, "node_id": node_id}, table=table)


class Store:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.dialect = DIALECTS[config.backend]
        self._queries = queries.load(config.backend)
        self._sql_cache: dict[tuple[str, str | None], str] = {}
        self._local = threading.local()
        self._idle: list[Any] = []  # SQLite: connections not in a transaction, last used last
        self._idle_lock = threading.Lock()
        self._pool: Any = None
        if config.backend == "postgres":
            from psycopg_pool import ConnectionPool
            from psycopg.rows import dict_row

            self._pool = ConnectionPool(
                kwargs={**self.dialect.conninfo(config), "row_factory": dict_row, "autocommit": False},
                min_size=1, max_size=config.pool_size, open=True, name="stageline", timeout=30)

    @property
    def backend(self) -> str:
        return self.config.backend

    def sql(self, name: str, table: StagedTable | None = None) -> str:
        key = (name, table.name if table else None)
        text = self._sql_cache.get(key)
        if text is None:
            try:
                raw = self._queries[name]
            except KeyError:
                raise KeyError(f"no query {name!r} for {self.backend}") from None
            if "{" in raw:
                raw = raw.format_map({**self.dialect.template, **(table.template() if table else {})})
            text = self._sql_cache[key] = self.dialect.translate(raw)
        return text

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        if self._pool is not None:
            with self._pool.connection() as conn:
                yield conn
            return
        if self.backend == "sqlite":
            with self._idle_lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self.dialect.connect(self.config)
            try:
                yield conn
            except BaseException:
                try:  # a broken connection is not reused
                    conn.close()
                except Exception:
                    pass
                raise
            with self._idle_lock:
                self._idle.append(conn)
            return
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.dialect.connect(self.config)
        try:
            yield conn
        except BaseException:
            # a broken connection is not reused
            self._local.conn = None
            try:
                conn.close()
            except Exception:
                pass
            raise

    @contextmanager
    def transaction(self, *, write: bool = True) -> Iterator[Tx]:
        with self._connection() as conn:
            self.dialect.begin(conn, write=write)
            try:
                yield Tx(self, conn)
            except BaseException:
                conn.rollback()
                raise
            conn.commit()

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
                yield Tx(self, conn)
            finally:
                conn.autocommit = False

    def close(self) -> None:
        """Close the connections not in use (SQL Server: this thread's); using the store again
        opens new ones."""
        if self._pool is not None:
            self._pool.close()
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
