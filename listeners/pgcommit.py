"""The listener's staging statement on PostgreSQL without a thread: libpq's non-blocking API on
the reactor.

On PostgreSQL `stage_inbound` is one self-contained statement (`Dialect.atomic_staging`: state
rows, bodies and events, the epoch checked by the insert itself), run in autocommit: its result
arrives only once it is committed (`synchronous_commit` on). So nothing blocks between handing a
batch over and its outcome, and the writer need not be a thread: `PgStager` sends the prepared
statement on its own connection and the reactor reads the result when the socket has it. That
saves, per group commit, the two thread hand-overs (a wake-up of the writer thread, then
`callFromThread` back) and the connection-pool checkout around the statement — most of what one
message alone cost (docs/listenerd.md, "Group commit").

What to send is the store's alone: `include.store.rowlease.staging` chooses the statements, gives
their parameters and reads their rows, here as in `rowlease.stage_inbound`. This module is only the
transport: the store's named queries prepared once, each result's rows loaded by psycopg's own
adapters. The connection is opened off the reactor (libpq's connect blocks) and reopened on the
next batch after a failure; a statement that fails because of the connection fails its batch (the
caller answers "resend later"), one the server refuses for its data comes back as the driver's own
exception class, so `Dialect.is_refusal` reads it as it reads the store's.

Durability as the store's own sessions (`include.store.durability`, docs/store.md): the connection
is opened with `synchronous_commit` pinned on (this is the session whose commit an `AA` follows) and
refused on a server with `fsync = off` unless allowed; and while the store's periodic recheck finds
the server unsafe (`Store.durability_refusal`), every batch fails (`AE`) without being sent. A
statement whose commit's wait for the synchronous standby was cancelled (its server's warning) fails
with `CommitUnconfirmed` as the store's own commits do (`include.store.unconfirmed`).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Generator
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReadWriteDescriptor
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from include.store import Store
from include.store.dialects import PostgresDialect
from include.store.durability import UnsafeDurability, postgres_refusal, postgres_synchronous_commit
from include.store.rowlease import ONE_STATEMENT_STAGING, Staged, Statement, staging
from include.store.unconfirmed import CommitUnconfirmed, unconfirming

__all__ = ["PgStager", "numbered"]

_log = Logger(namespace="stageline.ingest")

_PARAM = re.compile(r"%\((\w+)\)s|%%")


def numbered(sql: str) -> tuple[str, list[str]]:
    """Pyformat SQL (``%(name)s``, as `Store.sql` gives it for psycopg) as libpq wants it:
    ``$1``, ``$2``… in order of first use (a name used twice is one parameter), and the names."""
    names: list[str] = []

    def sub(m: re.Match[str]) -> str:
        if m.group(1) is None:
            return "%"
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    return _PARAM.sub(sub, sql), names


def _rows(result: Any, loader: Any) -> list[dict[str, Any]]:
    """A libpq result's rows as the store's cursors give them (dicts of Python values, loaded by
    psycopg's own adapters: `loader`, a ``psycopg.adapt.Transformer``), so `rowlease.staging`
    reads them as it reads the store's."""
    names = [result.fname(i).decode() for i in range(result.nfields)]
    loader.set_pgresult(result)
    rows: list[dict[str, Any]] = loader.load_rows(0, result.ntuples, lambda values: dict(zip(names, values)))
    return rows


class _Query:
    """One prepared statement: its name on the connection and its parameters' order."""

    def __init__(self, name: str, sql: str) -> None:
        self.name = name.encode()
        self.sql, self.params = numbered(sql)

    def values(self, params: dict[str, Any]) -> list[bytes | None]:
        return [None if params[p] is None else str(params[p]).encode() for p in self.params]


class PgStager:
    """`stage(rows, epoch=…, node_id=…)` as a Deferred, one statement at a time on one connection.

    Not thread-safe: the reactor thread only. The caller (the group-commit writer) runs one
    statement at a time and waits for its outcome before the next.
    """

    def __init__(self, store: Store, reactor: Any) -> None:
        if not store.dialect.atomic_staging or store.backend != "postgres":
            raise ValueError("PgStager needs PostgreSQL, whose stage_inbound is one self-contained statement")
        from psycopg.adapt import Transformer

        self._reactor = reactor
        assert isinstance(store.dialect, PostgresDialect)  # checked just above: store.backend is postgres
        self._conninfo = {**store.dialect.conninfo(store.config), "client_encoding": "UTF8"}
        self._queries = {name: _Query(name, store.sql(name)) for name in ONE_STATEMENT_STAGING if store.has_query(name)}
        self._is_refusal = store.dialect.is_refusal
        self._store = store
        self._allow_unsafe = store.config.allow_unsafe_durability
        self._conn: _Connection | None = None
        self._waiting: list[Deferred[_Connection]] = []  # for the connection being opened
        self._closed = False
        self._loader = Transformer()  # reused: the reactor thread only, one result at a time

    # -- what the writer calls ----------------------------------------------------------------

    def stage(self, rows: list[dict[str, Any]], *, epoch: int, node_id: str) -> Deferred[Staged]:
        """`rowlease.stage_inbound` on this connection: the store's statements (`rowlease.staging`)
        sent in turn, each one's rows handed back; {message_id: row id} for the rows written (a
        message_id already staged is skipped), or None when `epoch` is no longer current."""
        if (unsafe := self._store.durability_refusal()) is not None:
            return fail(unsafe)  # the server may lose this commit: not sent, answered AE
        return self._next(staging(self._store, rows, epoch=epoch, node_id=node_id), None)

    def _next(
        self,
        steps: Generator[Statement, Any, Staged],
        result: list[dict[str, Any]] | None,
    ) -> Deferred[Staged]:
        """Send `staging`'s next statement (`result`: the rows of the one before), or give its outcome."""
        try:
            step = steps.send(result)
        except StopIteration as done:
            return succeed(done.value)
        except Exception:
            return fail()
        if step.name not in self._queries:
            # Only PostgreSQL's self-contained statements may run here, each in autocommit; never
            # ACK what a follow-up statement of another transaction would have had to finish.
            return fail(RuntimeError(f"{step.name} is not part of PostgreSQL's one-statement staging"))
        return self._run(step.name, step.params).addCallback(lambda r: self._next(steps, _rows(r, self._loader)))

    def close(self) -> None:
        """Drop the connection (a statement in flight fails); the stager takes no more work."""
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- one statement --------------------------------------------------------------------------

    def _run(self, name: str, params: dict[str, Any]) -> Deferred[Any]:
        if self._closed:
            return fail(ConnectionError("the staging connection is closed"))
        query = self._queries[name]
        if self._conn is not None and self._conn.usable:
            return self._conn.execute(query, params)
        return self._connection().addCallback(lambda conn: conn.execute(query, params))

    def open(self) -> None:
        """Open the connection ahead of the first batch (a failure here is only retried then)."""
        if not self._closed and (self._conn is None or not self._conn.usable):
            self._connection().addErrback(
                lambda f: _log.warn("staging connection not opened yet: {err}", err=f.type.__name__ if f.type else "?")
            )

    def _connection(self) -> Deferred[_Connection]:
        """The connection, opened in a thread when there is none (libpq's connect blocks): one
        attempt per batch that needs it, so a store that is down fails each batch in turn."""
        d: Deferred[_Connection] = Deferred()
        self._waiting.append(d)
        if len(self._waiting) > 1:
            return d  # an attempt is under way
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        queries = list(self._queries.values())

        def opened(result: Any) -> None:
            waiting, self._waiting = self._waiting, []
            if not isinstance(result, BaseException) and self._closed:
                result.finish()
                result = ConnectionError("the staging connection is closed")
            if isinstance(result, BaseException):
                for w in waiting:
                    w.errback(Failure(result))
                return
            self._conn = _Connection(result, self._reactor, self._is_refusal)
            for w in waiting:
                w.callback(self._conn)

        def work() -> None:
            try:
                pgconn = _open(self._conninfo, queries, allow_unsafe=self._allow_unsafe)
            except BaseException as exc:
                self._reactor.callFromThread(opened, exc)
            else:
                self._reactor.callFromThread(opened, pgconn)

        threading.Thread(target=work, name="stageline-ingest-connect", daemon=True).start()
        return d


def _open(conninfo: dict[str, Any], queries: list[_Query], *, allow_unsafe: bool = False) -> Any:
    """A libpq connection, durability pinned and checked (`_pin_durability`), its statements
    prepared, switched to non-blocking mode (in a thread)."""
    import psycopg
    from psycopg import errors, pq
    from psycopg.conninfo import make_conninfo

    pgconn = pq.PGconn.connect(make_conninfo("", **conninfo).encode())
    if pgconn.status != pq.ConnStatus.OK:
        message = pgconn.error_message.decode("utf-8", "replace").strip()
        pgconn.finish()
        raise psycopg.OperationalError(f"connection failed: {message}")
    try:
        _pin_durability(pgconn, allow_unsafe=allow_unsafe)
        for query in queries:
            result = pgconn.prepare(query.name, query.sql.encode())
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise errors.error_from_result(result)
        pgconn.nonblocking = 1
    except BaseException:
        pgconn.finish()
        raise
    return pgconn


def _pin_durability(pgconn: Any, *, allow_unsafe: bool) -> None:
    """`include.store.durability.check_connection` for a bare libpq connection: synchronous_commit
    set on where the server, database or role says otherwise (a synchronous standby's level kept),
    and `UnsafeDurability` on a server with fsync off unless `allow_unsafe`."""
    from psycopg import errors, pq

    def one(sql: bytes) -> list[str]:
        result = pgconn.exec_(sql)
        if result.status != pq.ExecStatus.TUPLES_OK:
            raise errors.error_from_result(result)
        return [(result.get_value(0, i) or b"").decode() for i in range(result.nfields)]

    fsync, current, standbys = one(
        b"SELECT current_setting('fsync'), current_setting('synchronous_commit'), "
        b"current_setting('synchronous_standby_names')"
    )
    if (wanted := postgres_synchronous_commit(current, standbys)) is not None:
        assert wanted == "on"  # the only value it asks for: no parameter to pass
        one(b"SELECT set_config('synchronous_commit', 'on', false)")
    reason = postgres_refusal(fsync)
    if reason is not None and not allow_unsafe:
        raise UnsafeDurability(reason)


@implementer(IReadWriteDescriptor)
class _Connection:
    """One libpq connection in non-blocking mode, read by the reactor while it is open."""

    def __init__(self, pgconn: Any, reactor: Any, keep_after: Callable[[BaseException], bool]) -> None:
        from psycopg import pq

        self._pq = pq
        self.pgconn = pgconn
        self._reactor = reactor
        self._keep_after = keep_after
        # The reactor watches a duplicate of libpq's socket: libpq closes its own when it finds
        # the connection broken, and the reactor must still be able to unregister ours.
        self._fd = os.dup(pgconn.socket)
        self._unconfirmed: str | None = None  # the statement's commit wait for the standby ended early
        pgconn.notice_handler = self._notice
        self._pending: Deferred[Any] | None = None
        self._results: list[Any] = []
        self._writing = False
        self.usable = True
        reactor.addReader(self)

    # IReadWriteDescriptor, for the reactor
    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "stageline-ingest-pg"

    def execute(self, query: _Query, params: dict[str, Any]) -> Deferred[Any]:
        """Send the prepared statement; the Deferred gets its result (a libpq ``PGresult``)."""
        assert self._pending is None, "one statement at a time"
        d: Deferred[Any] = Deferred()
        self._pending = d
        self._results = []
        self._unconfirmed = None
        try:
            self.pgconn.send_query_prepared(query.name, query.values(params))
            self._flush()
        except Exception as exc:
            self._broken(exc)
        return d

    def _flush(self) -> None:
        if self.pgconn.flush() == 0:
            if self._writing:
                self._writing = False
                self._reactor.removeWriter(self)
        elif not self._writing:  # the rest goes out when the socket can take it
            self._writing = True
            self._reactor.addWriter(self)

    def doWrite(self) -> None:
        try:
            self._flush()
        except Exception as exc:
            self._broken(exc)

    def doRead(self) -> None:
        pgconn = self.pgconn
        try:
            pgconn.consume_input()
            while self._pending is not None and not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    self._finished()
                else:
                    self._results.append(result)
            if pgconn.status != self._pq.ConnStatus.OK:
                raise ConnectionError("the staging connection was closed by the server")
        except Exception as exc:
            self._broken(exc)

    def connectionLost(self, reason: Failure) -> None:
        self._broken(ConnectionError("the staging connection was lost"))

    def _notice(self, result: Any) -> None:
        """libpq's notice receiver: remember a warning that the autocommitted statement's wait for
        the synchronous standby ended early (`include.store.unconfirmed`)."""
        field = self._pq.DiagnosticField
        severity = result.error_field(field.SEVERITY_NONLOCALIZED)
        sqlstate = result.error_field(field.SQLSTATE)
        if unconfirming(severity and severity.decode(), sqlstate and sqlstate.decode()):
            primary = result.error_field(field.MESSAGE_PRIMARY) or b""
            self._unconfirmed = f"{sqlstate.decode()} {primary.decode('utf-8', 'replace')}"

    def _finished(self) -> None:
        from psycopg import errors

        d, self._pending = self._pending, None
        results, self._results = self._results, []
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        assert d is not None
        failed = [r for r in results if r.status not in (self._pq.ExecStatus.TUPLES_OK, self._pq.ExecStatus.COMMAND_OK)]
        if failed:
            error = errors.error_from_result(failed[0])
            # Refused for its data (a constraint, a value): the connection is still good, as
            # autocommit left no transaction open. Anything else (a plan gone stale after a
            # migration, …): the next statement starts over on a new connection.
            if not self._keep_after(error):
                self.close()
            d.errback(Failure(error))
            return
        if unconfirmed is not None:  # committed here, maybe not on the standby: never AA'd
            d.errback(Failure(CommitUnconfirmed(unconfirmed)))
            return
        d.callback(results[-1])

    def _broken(self, exc: BaseException) -> None:
        d, self._pending = self._pending, None
        self.close()
        if d is not None:
            d.errback(Failure(exc))

    def close(self) -> None:
        if not self.usable:
            return
        self.usable = False
        self._reactor.removeReader(self)
        if self._writing:
            self._writing = False
            self._reactor.removeWriter(self)
        os.close(self._fd)
        self.pgconn.notice_handler = None
        self.pgconn.finish()
        d, self._pending = self._pending, None
        if d is not None:
            d.errback(Failure(ConnectionError("the staging connection was closed")))
