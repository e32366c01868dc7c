"""The README's embedded stack on the store a whole-stack bench asks for, and SQL against that store
(bench/latency.py, bench/soak.py).

`sqlite`: the store is `var/stageline.db` under the stack's work dir. `postgres`: a throwaway
PostgreSQL server (initdb in a temp dir, fsync on; `settings` added to the server's) with a
`stageline` database, created before the stack starts and removed after it stops; Airflow's
metadata stays on SQLite either way. Timestamps compare on the database clock: SQLite's store
keeps epoch milliseconds, PostgreSQL's `timestamptz` (`ms()` turns a column into milliseconds).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from bench.stack import EmbeddedStack
from include.app.lab.postgres_server import PostgresServer
from include.store.dialects import NOW_MS_SQLITE


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class StackOnStore:
    """`EmbeddedStack` on SQLite or a throwaway PostgreSQL server; `start()`, `stop()` (always safe)."""

    def __init__(
        self,
        work: Path,
        store: str = "sqlite",
        *,
        pg_settings: dict[str, str] | None = None,
        pg_setup: Sequence[str] = (),
        bench_role: str | None = None,
    ) -> None:
        """`pg_setup`: statements run in the `stageline` database before the stack starts;
        `bench_role`: a superuser the bench's own queries run as (so the server's statistics can
        tell them from the stack's)."""
        if store not in ("sqlite", "postgres"):
            raise ValueError(f"unknown store {store!r}")
        self.backend = store
        self.pg = PostgresServer(settings=pg_settings) if store == "postgres" else None
        self.pg_setup = list(pg_setup)
        self.bench_role = bench_role
        if self.pg is not None:
            toml = (
                f'[store]\nbackend = "postgres"\nserver = "{self.pg.host}"\nport = {self.pg.port}\n'
                f'database = "stageline"\nusername = "{self.pg.user}"\n'
            )
        else:
            toml = '[store]\npath = "var/stageline.db"\n'
        self.stack = EmbeddedStack(work, toml)

    @property
    def db_path(self) -> Path:
        """The SQLite store's file."""
        return self.stack.var / "stageline.db"

    def start(self) -> StackOnStore:
        if self.pg is not None:
            self.pg.start()
            self.pg.execute("CREATE DATABASE stageline")
            if self.bench_role:
                self.pg.execute(f"CREATE ROLE {self.bench_role} LOGIN SUPERUSER")
            for sql in self.pg_setup:
                self.pg.execute(sql, dbname="stageline")
        self.stack.start()
        return self

    def stop(self) -> None:
        """The stack, then the PostgreSQL server (each even if the other fails)."""
        try:
            self.stack.stop()
        finally:
            if self.pg is not None:
                self.pg.stop()

    def connect(self) -> Any:
        """A new DB-API connection to the store (autocommit on PostgreSQL); the caller closes it."""
        if self.pg is not None:
            info = self.pg.conninfo("stageline")
            if self.bench_role:
                info = info.replace(f"user={self.pg.user}", f"user={self.bench_role}")
            return psycopg.connect(info, autocommit=True)
        return sqlite3.connect(self.db_path, timeout=30, isolation_level=None)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Rows of one statement (parameters `?` on SQLite, `%s` on PostgreSQL), on a connection of its own."""
        conn = self.connect()
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def ms(self, column: str) -> str:
        """A timestamp column as epoch milliseconds (SQLite stores them so already)."""
        return f"(extract(epoch FROM {column}) * 1000)::float8" if self.pg is not None else column

    @property
    def now_ms(self) -> str:
        """The database clock, in epoch milliseconds."""
        return "(extract(epoch FROM clock_timestamp()) * 1000)::float8" if self.pg is not None else NOW_MS_SQLITE

    def outstanding(self) -> int:
        """Staged rows not finished, over all three stages."""
        return self.query(
            "SELECT (SELECT count(*) FROM stage_inbound WHERE status NOT IN ('done', 'unrouted', 'dead'))"
            " + (SELECT count(*) FROM stage_routed WHERE status NOT IN ('done', 'dead'))"
            " + (SELECT count(*) FROM stage_outbound WHERE status NOT IN ('done', 'dead'))"
        )[0][0]
