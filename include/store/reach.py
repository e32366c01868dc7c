"""Whether this process can use its store at all, and if not, why — in words an operator acts on.

A command that only reads must not wait out the pool's retries before it fails, must not call an
unreachable server "a store without a schema", and must not create the SQLite file it was asked to
read. `probe` connects once, with a short timeout, creates nothing, and raises `StoreUnavailable`
naming the cause: the server is not reachable, it refused the login, the database does not exist,
there is no store file, or the file is not a SQLite database. Whether the schema is there is the
next question (`include.store.migrate.check_identity`).

The drivers give no error code for a failed connection (psycopg's `sqlstate` is None then), so
the cause is read from libpq's and the server's message text; a message not recognised keeps its
own words under the generic cause `failed`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from include.config import PASSWORD_ENV, StoreConfig

UNREACHABLE = "unreachable"
AUTH = "auth"
NO_DATABASE = "no-database"
NO_STORE = "no-store"
NOT_A_STORE = "not-a-store"
FAILED = "failed"

SQLITE_HEADER = b"SQLite format 3\x00"
MIN_TIMEOUT_SECONDS = 2
"""libpq treats a connect_timeout below 2 s as 2 s."""

_PATTERNS = (
    # (cause, lower-case fragments of libpq's / the server's / pymssql's message), first match wins:
    # a refused login names its database too (`no pg_hba.conf entry for ... database "x"`)
    (
        AUTH,
        (
            'role "',
            "password authentication failed",
            "no password supplied",
            "no pg_hba.conf entry",
            "authentication failed",
            "login failed",
            "permission denied for database",
        ),
    ),
    (NO_DATABASE, ('database "', "cannot open database")),
    (
        UNREACHABLE,
        (
            "connection refused",
            "timeout expired",
            "failed to resolve host",
            "could not translate host name",
            "name or service not known",
            "no route to host",
            "network is unreachable",
            "server closed the connection unexpectedly",
            "ssl negotiation",
            "unable to connect",
            "adaptive server is unavailable",
        ),
    ),
)


class StoreUnavailable(RuntimeError):
    """The store cannot be used; `cause` is one of the names above, stable for scripts."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def describe(config: StoreConfig) -> str:
    """The store in a few words: `the SQLite file /x/s.db`, `PostgreSQL db1 at host:5432`."""
    if config.backend == "sqlite":
        return f"the SQLite file {config.path}"
    kind = "PostgreSQL" if config.backend == "postgres" else "SQL Server"
    return f"{kind} database {config.database!r} at {config.server}:{config.effective_port}"


def probe(config: StoreConfig, *, timeout_seconds: float) -> None:
    """Raise `StoreUnavailable` unless the store can be opened; connects once, writes nothing."""
    if config.backend == "sqlite":
        _probe_file(config.path)
        return
    errors: tuple[type[Exception], ...] = (OSError, *_driver_errors(config.backend))
    try:
        _connect_once(config, timeout_seconds)
    except errors as exc:
        raise _classified(config, exc, timeout_seconds) from exc


def _probe_file(path: str) -> None:
    if path == ":memory:" or path.startswith("file:"):
        return
    file = Path(path)
    if not file.exists():
        raise StoreUnavailable(NO_STORE, f"no SQLite store at {file} (no such file)")
    if not file.is_file():
        raise StoreUnavailable(NOT_A_STORE, f"{file} is not a SQLite store: it is not a regular file")
    if not os.access(file, os.R_OK | os.W_OK):
        raise StoreUnavailable(AUTH, f"cannot open the SQLite store {file}: no read and write permission for this user")
    with file.open("rb") as f:
        head = f.read(len(SQLITE_HEADER))
    if not head:  # opening it would make it a database: only the migration may
        raise StoreUnavailable(NO_STORE, f"{file} is an empty file, not a SQLite store yet")
    if head != SQLITE_HEADER:
        raise StoreUnavailable(NOT_A_STORE, f"{file} is not a SQLite database (wrong [store].path?)")


def _driver_errors(backend: str) -> tuple[type[Exception], ...]:
    if backend == "postgres":
        import psycopg

        return (psycopg.Error,)
    import pymssql

    return (pymssql.Error,)


def _connect_once(config: StoreConfig, timeout_seconds: float) -> None:
    from include.store.dialects import DIALECTS

    seconds = max(MIN_TIMEOUT_SECONDS, math.ceil(timeout_seconds))
    DIALECTS[config.backend].connect(config, timeout_seconds=seconds).close()


def _classified(config: StoreConfig, exc: BaseException, timeout_seconds: float) -> StoreUnavailable:
    text = " ".join(str(exc).split())
    lowered = text.lower()
    cause = next((c for c, fragments in _PATTERNS if any(f in lowered for f in fragments)), FAILED)
    store = describe(config)
    detail = _server_words(text)
    if cause == UNREACHABLE:
        if "timeout expired" in lowered:
            detail = f"no answer within {max(MIN_TIMEOUT_SECONDS, math.ceil(timeout_seconds))} s"
        return StoreUnavailable(
            cause,
            f"cannot reach {store} ({detail}): is the server running, and are [store].server and port right?",
        )
    if cause == AUTH:
        return StoreUnavailable(
            cause,
            f"{store} refused the login of user {config.username!r} ({detail}): check [store].username and "
            f"the password in ${PASSWORD_ENV}",
        )
    if cause == NO_DATABASE:
        return StoreUnavailable(
            cause,
            f"the server at {config.server}:{config.effective_port} has no database {config.database!r}: "
            "check [store].database, or create the database and run `stageline db migrate`",
        )
    return StoreUnavailable(cause, f"cannot connect to {store}: {detail}")


def _server_words(text: str) -> str:
    """The part of a driver's message that says what went wrong, without its preamble."""
    for marker in ("FATAL:", "failed:"):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
    return text.replace("Is the server running on that host and accepting TCP/IP connections?", "").strip(" .")
