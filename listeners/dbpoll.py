"""Database-poll inbound (Mirth's "Database Reader"): poll a table or query of another database and
stage each row as one message, exactly once, across restarts and failover.

The source is a shared resource, so the daemon runs this only on the leader (invariant 4):
``start()`` when the lease is won, ``stop()`` when it is lost (``stop`` waits for the poll in hand).
A `kind = "database"` connection's ``[inbound.database]`` table names the source, the query, the key
column and the strategy (docs/listenerd.md, "Database poll").

One poll, in order:

1. **Read.** Run the configured query on the source with ``:limit`` = ``batch_size`` and, for the
   watermark strategy, ``:watermark`` = the connection's high-water mark, read from the Stageline
   store (``inbound_watermarks``) at every poll, so a new leader starts where the old one stopped.
2. **Stage.** Every row becomes an `Inbound` through the one inbound path every transport takes
   (:func:`listeners.validation.build_inbound`, then the group-commit writer). Its message id is
   derived from the connection and the row's key (:func:`row_message_id`), and ``stage_inbound``
   skips a message id already staged — in the same statement that would write the row (and a row
   whose message retention has since archived is not submitted at all). That is
   what makes a row staged **exactly once**: a row read twice (a crash, or a failover, between its
   commit and step 3) is staged once and skipped the second time, whichever node reads it.
3. **Advance**, only through the rows staged (or refused for good) without a gap: the watermark
   strategy writes the last such row's key to ``inbound_watermarks``, fenced by the epoch (a
   deposed leader cannot move it); the mark strategy runs the ``mark`` UPDATE for each staged row
   and ``reject`` (default: ``mark``) for each refused one, in one source transaction. A row not
   staged for a reason of this node or store (no lease, store down) stops the advance there: it
   and everything after it is read again next poll.

The advance is deliberately not part of the staging commit: the staging commit already carries
what makes a re-read harmless (the message id), while the advance is in another database (mark)
or would need a second statement in the shared group commit of every transport (watermark). So a
crash between the two costs one re-read of the rows in between, never a duplicate or a loss.

A full batch is followed at once by the next poll (a backlog drains at the store's pace); a short
one waits ``poll_seconds``. A source that cannot be reached is logged (once per distinct error)
and retried every poll. All database work runs off the reactor thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.store import Store
from include.store.queries import to_pyformat
from listeners.connections_config import DatabaseSource, InboundConfig
from listeners.group_commit import Inbound, InboundBatch, RowRefused
from listeners.hl7msg import HL7HeaderError, parse_header
from listeners.polling import PollingInbound, RunBlocking
from listeners.validation import IngestSink, LaneOf, PayloadRejected, build_inbound, rejection_reason

if TYPE_CHECKING:
    from listeners.metrics import Metrics

__all__ = ["DbPoll", "SourceDatabase", "row_message_id"]

_log = Logger(namespace="stageline.dbpoll")

DEFAULT_PORTS = {"postgres": 5432, "sqlserver": 1433}


def row_message_id(connection: str, key: Any) -> str:
    """The deterministic message id of a source row: the same row gives the same id on any node."""
    digest = hashlib.sha256(b"database\0")
    digest.update(connection.encode())
    digest.update(b"\0")
    digest.update(json.dumps(key, default=str, sort_keys=True).encode())
    return digest.hexdigest()[:32]


class SourceError(Exception):
    """The source could not be read or marked; ``str()`` names the error class only (no content)."""


class SourceDatabase:
    """One connection to the source database, opened on first use and reopened after a failure.

    Blocking: called from a worker thread, one call at a time. Queries are written with ``:name``
    parameters in every backend, as the store's are.
    """

    def __init__(self, src: DatabaseSource, *, env: dict[str, str] | None = None) -> None:
        self.src = src
        self._env = os.environ if env is None else env
        self._conn: Any = None
        native = src.backend == "sqlite"
        self._query = src.query if native else to_pyformat(src.query)
        self._mark = src.mark if native else to_pyformat(src.mark)
        self._reject = (src.reject or src.mark) if native else to_pyformat(src.reject or src.mark)

    def _connect(self) -> Any:
        src = self.src
        password = self._env.get(src.password_env) if src.password_env else None
        if src.backend == "postgres":
            import psycopg
            from psycopg.rows import dict_row

            info: dict[str, Any] = {
                "host": src.server,
                "port": src.port or DEFAULT_PORTS["postgres"],
                "dbname": src.database,
                "connect_timeout": max(1, int(src.connect_timeout_seconds)),
                "application_name": "stageline-dbpoll",
            }
            if src.username:
                info["user"] = src.username
            if password:
                info["password"] = password
            return psycopg.connect(**info, row_factory=dict_row, autocommit=False)
        if src.backend == "sqlserver":
            import pymssql

            return pymssql.connect(
                server=src.server,
                port=str(src.port or DEFAULT_PORTS["sqlserver"]),
                user=src.username,
                password=password or "",
                database=src.database,
                as_dict=True,
                autocommit=False,
                login_timeout=int(src.connect_timeout_seconds),
            )
        conn = sqlite3.connect(
            f"file:{src.database}?mode=rw",
            uri=True,
            timeout=src.connect_timeout_seconds,
            check_same_thread=False,
            isolation_level="DEFERRED",
        )
        conn.row_factory = lambda cur, row: {d[0]: v for d, v in zip(cur.description, row)}
        return conn

    def _conn_or_open(self) -> Any:
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def fetch(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """The query's rows (dicts by column name), in the query's order; its read transaction ends."""
        try:
            conn = self._conn_or_open()
            cur = conn.cursor()
            cur.execute(self._query, params)
            rows = [dict(r) for r in cur.fetchall()]
            conn.rollback()
            return rows
        except Exception as exc:
            self.close()
            raise SourceError(type(exc).__name__) from exc

    def mark(self, done: list[Any], rejected: list[Any]) -> None:
        """Run ``mark`` for each staged row's key and ``reject`` for each refused one; one commit."""
        try:
            conn = self._conn_or_open()
            cur = conn.cursor()
            for statement, keys in ((self._mark, done), (self._reject, rejected)):
                for key in keys:
                    cur.execute(statement, {"key": key})
            conn.commit()
        except Exception as exc:
            self.close()
            raise SourceError(type(exc).__name__) from exc

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: S110  closing a broken connection is best effort
                pass


class DbPoll(PollingInbound):
    """Polls one ``kind = "database"`` connection's source while started."""

    def __init__(
        self,
        ingest: IngestSink,
        config: InboundConfig,
        *,
        store: Callable[[], Store | None],
        epoch: Callable[[], int | None],
        lane_of: LaneOf | None = None,
        metrics: Metrics | None = None,
        reactor: IReactorTime | None = None,
        run_blocking: RunBlocking | None = None,
        source: SourceDatabase | None = None,
    ) -> None:
        """``store`` and ``epoch`` give the node's store and lease epoch (the watermark is written
        under it); ``reactor`` schedules the polls; ``run_blocking`` defaults to its thread pool."""
        if config.database is None:
            raise ValueError(f"{config.name}: a database connection needs [inbound.database]")
        super().__init__(config, what="database poll", log=_log, reactor=reactor, run_blocking=run_blocking)
        self.ingest = ingest
        self.src: DatabaseSource = config.database
        self.source = source if source is not None else SourceDatabase(config.database)
        self.lane_of = lane_of
        self.metrics = metrics
        self._store = store
        self._epoch = epoch
        self._error: str | None = None
        self._full = False

    def _next_delay(self) -> float:
        return 0 if self._full else self.config.poll_seconds  # a full batch: a backlog, drain it

    def _on_stop(self) -> Deferred[None]:
        return self._run(self.source.close)  # after the poll in hand: its commits and its advance

    def _poll_crashed(self, failure: Failure) -> None:
        self._full = False
        super()._poll_crashed(failure)

    def _problem(self, what: str) -> None:
        if what != self._error:
            _log.warn(
                "database poll of {connection}: {what}; retrying every poll", connection=self.config.name, what=what
            )
        self._error = what

    @inlineCallbacks
    def poll(self) -> Any:
        """One poll (the module docstring); returns how many rows it passed (staged or refused)."""
        self._full = False
        epoch = self._epoch()
        if epoch is None:
            return 0
        params: dict[str, Any] = {"limit": self.src.batch_size}
        try:
            if self.src.strategy == "watermark":
                params["watermark"] = yield self._run(self._read_watermark)
            rows: list[dict[str, Any]] = yield self._run(self.source.fetch, params)
        except SourceError as exc:
            self._problem(f"cannot read the source ({exc})")
            return 0
        except Exception as exc:
            self._problem(f"cannot read the watermark ({type(exc).__name__})")
            return 0
        if rows and self.src.key_column not in rows[0]:
            self._problem(f"the query returns no column {self.src.key_column!r} (key_column)")
            return 0
        if rows and self.src.message_column and self.src.message_column not in rows[0]:
            self._problem(f"the query returns no column {self.src.message_column!r} (message_column)")
            return 0
        self._error = None
        if not rows:
            return 0
        keys = [row[self.src.key_column] for row in rows]
        if len({row_message_id(self.config.name, k) for k in keys}) < len(keys):  # one id for two rows: one lost
            self._problem(f"key_column {self.src.key_column!r} repeats a value in one poll: it must be unique")
            return 0
        items: list[Inbound | InboundBatch | str] = [self._inbound(row, key) for row, key in zip(rows, keys)]
        try:
            archived: set[str] = yield self._run(
                self._archived, [i.message_id for i in items if isinstance(i, Inbound)]
            )
        except Exception as exc:
            self._problem(f"cannot read the archive ({type(exc).__name__})")
            return 0
        outcomes: list[tuple[bool, Any]] = yield DeferredList(
            [
                succeed(i)
                if not isinstance(i, Inbound)
                else succeed(i.message_id)
                if i.message_id in archived
                else self.ingest.submit(i)
                for i in items
            ],
            consumeErrors=True,
        )
        done: list[Any] = []
        rejected: list[Any] = []
        for key, item, (ok, result) in zip(keys, items, outcomes):
            if ok and isinstance(item, Inbound):
                self._count("AA")
                done.append(key)
                continue
            if ok:  # refused before staging (build_inbound): `result` is the reason
                reason = result
            elif cast(Failure, result).check(RowRefused):
                reason = rejection_reason(result)[0]
            else:  # not staged for a reason of this node or store: stop here, read again next poll
                self._count(rejection_reason(result)[1])
                _log.warn(
                    "row {key} of {connection} not staged ({reason}); read again next poll",
                    key=str(key)[:64],
                    connection=self.config.name,
                    reason=rejection_reason(result)[0],
                )
                break
            self._count("AR")
            rejected.append(key)
            _log.warn(
                "row {key} of {connection} cannot be staged: {reason}; passed over",
                key=str(key)[:64],
                connection=self.config.name,
                reason=reason,
            )
        passed = len(done) + len(rejected)
        if passed == 0:
            return 0
        try:
            if self.src.strategy == "watermark":
                moved = yield self._run(self._write_watermark, keys[passed - 1], epoch)
                if not moved:
                    _log.warn(
                        "watermark of {connection} not moved: epoch {epoch} is no longer current",
                        connection=self.config.name,
                        epoch=epoch,
                    )
                    return 0
            else:
                yield self._run(self.source.mark, done, rejected)
        except Exception as exc:
            _log.error(
                "staged {n} row(s) of {connection} but cannot advance ({error}); they are read again "
                "and skipped as already staged",
                n=len(done),
                connection=self.config.name,
                error=str(exc) if isinstance(exc, SourceError) else type(exc).__name__,
            )
            return 0
        self._full = passed == len(rows) == self.src.batch_size
        _log.info(
            "staged {n} row(s) of {connection}{rejected}",
            n=len(done),
            connection=self.config.name,
            rejected=f", passed over {len(rejected)}" if rejected else "",
        )
        return passed

    def _inbound(self, row: dict[str, Any], key: Any) -> Inbound | InboundBatch | str:
        """The row as an `Inbound`, or why it cannot be staged."""
        self._count_received()
        column = self.src.message_column
        value: Any = row[column] if column else json.dumps(row, default=str, ensure_ascii=False)
        message_id = row_message_id(self.config.name, key)
        try:
            if value is None:
                raise PayloadRejected(f"column {column} is NULL")
            if isinstance(value, (bytes, bytearray, memoryview)):
                return build_inbound(
                    bytes(value),
                    connection=self.config.name,
                    charset=self.config.charset,
                    lane_of=self.lane_of,
                    message_id=message_id,
                    conformance=self.config.conformance,
                )
            text = value if isinstance(value, str) else str(value)
            data = text.encode("utf-8", "surrogatepass")
            try:  # the driver has decoded the text already: keep it, and MSH-18's name for the record
                header = parse_header(data, default_encoding="utf_8", strict_charset=False)
                header = dataclasses.replace(header, text=text)
            except (HL7HeaderError, UnicodeDecodeError):
                header = None
            return build_inbound(
                data,
                connection=self.config.name,
                charset="utf-8",
                lane_of=self.lane_of,
                message_id=message_id,
                header=header,
                conformance=self.config.conformance,
            )
        except PayloadRejected as exc:
            return str(exc)

    def _archived(self, message_ids: list[str]) -> set[str]:
        """Which of these rows' messages retention has archived: staged long ago, not again."""
        store = self._store()
        if store is None or not message_ids:
            return set()
        with store.transaction(write=False) as tx:
            return {r["message_id"] for r in tx.all("archived_message_ids", {"ids": tx.dialect.text_list(message_ids)})}

    def _read_watermark(self) -> Any:
        store = self._store()
        if store is None:
            raise RuntimeError("no store")
        with store.transaction(write=False) as tx:
            row = tx.one("watermark_get", {"connection": self.config.name})
        return json.loads(row["watermark"]) if row else self.src.start_after

    def _write_watermark(self, key: Any, epoch: int) -> bool:
        store = self._store()
        if store is None:
            raise RuntimeError("no store")
        with store.transaction() as tx:
            tx.fence()
            row = tx.one(
                "watermark_set",
                {"connection": self.config.name, "epoch": epoch, "watermark": json.dumps(key, default=str)},
            )
        return row is not None

    def _count_received(self) -> None:
        if self.metrics is not None:
            self.metrics.received.labels(self.config.name).inc()

    def _count(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.acks.labels(self.config.name, code).inc()
