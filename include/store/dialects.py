"""What differs between SQLite, PostgreSQL and SQL Server besides the SQL text itself:
how to connect, how a write transaction starts, how a script is split, how a list of ids is passed,
which driver errors mean "lost a race" (the elector's `conflict`), and which mean "the statement's
data was refused" (a value or constraint: retrying the same rows fails again, other rows may pass)."""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from include.config import StoreConfig, var_dir
from include.store.queries import to_pyformat

log = logging.getLogger(__name__)

NOW_MS_SQLITE = "(CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))"


def _dict_row_sqlite(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
    return {d[0]: v for d, v in zip(cursor.description, row)}


def split_sqlite_script(script: str) -> list[str]:
    statements, buf = [], ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip() and not all(part.strip().startswith("--") or not part.strip() for part in buf.splitlines()):
                statements.append(buf.strip())
            buf = ""
    if buf.strip() and any(part.strip() and not part.strip().startswith("--") for part in buf.splitlines()):
        statements.append(buf.strip())
    return statements


def split_tsql_batches(script: str) -> list[str]:
    """T-SQL scripts are split on `GO` lines, as sqlcmd does."""
    return [b.strip() for b in re.split(r"^\s*GO\s*$", script, flags=re.MULTILINE | re.IGNORECASE) if b.strip()]


@dataclass(frozen=True)
class Dialect:
    name: str
    template: dict[str, str]
    translate: Callable[[str], str]
    atomic_staging: bool = False  # stage_inbound is one self-contained statement (events included)

    def connect(self, cfg: StoreConfig, *, timeout_seconds: int = 10) -> Any:
        """A new connection; a server that does not answer within `timeout_seconds` fails it."""
        raise NotImplementedError

    def begin(self, conn: Any, *, write: bool) -> None:
        """Drivers here open transactions implicitly; SQLite needs an explicit one."""

    def split_script(self, script: str) -> list[str]:
        return [script]

    def id_list(self, ids: list[int]) -> Any:
        return json.dumps([int(i) for i in ids])

    def text_list(self, values: Iterable[str]) -> Any:
        """A list of strings as one parameter (`= ANY(CAST(:x AS text[]))`, or JSON for `json_each`/`OPENJSON`)."""
        return json.dumps([str(v) for v in values])

    def is_conflict(self, exc: BaseException) -> bool:
        return False

    def is_refusal(self, exc: BaseException) -> bool:
        """The statement failed on its data (DB-API DataError or IntegrityError), not on the
        connection or the server: the group commit then isolates the offending rows."""
        return False


WAL_SIZE_LIMIT_BYTES = 8 * 1024 * 1024
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")
"""The files SQLite keeps beside a database; it creates each with the database file's own mode."""


_LEFT_OPEN_WARNED: set[str] = set()


def private_store_dir(db: Path) -> None:
    """The directory holding the SQLite store, when group or others have any access to it: made
    0700 with a warning naming it and its old mode, but only when it is ours (our uid, not a sticky
    /tmp-like one, not `/` or the home directory) and either Stageline's var dir or holding nothing
    but this store's files. A shared directory is never changed: a warning says so (once)."""
    parent = db.parent
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # a symlink or gone: not ours to change
    try:
        st = os.fstat(fd)
        old = stat.S_IMODE(st.st_mode)
        if not old & 0o077:
            return
        where = parent.resolve()
        store_files = {db.name, *(db.name + suffix for suffix in SQLITE_COMPANIONS)}
        if st.st_uid != os.geteuid():
            why = f"owned by uid {st.st_uid}, not ours"
        elif old & stat.S_ISVTX or where in (Path("/"), Path.home().resolve()):
            why = "a shared directory"
        elif where != var_dir() and not set(os.listdir(fd)) <= store_files:
            why = "it holds other files than the store's"
        else:
            os.fchmod(fd, 0o700)
            log.warning("SQLite store directory %s was mode %04o, open to others: tightened to 0700", parent, old)
            return
        if str(where) not in _LEFT_OPEN_WARNED:
            _LEFT_OPEN_WARNED.add(str(where))
            log.warning(
                "SQLite store directory %s is mode %04o, open to others; left as is (%s): "
                "chmod 700 it, or give the store a directory of its own",
                parent,
                old,
                why,
            )
    finally:
        os.close(fd)


def private_sqlite_file(path: str | os.PathLike[str]) -> None:
    """Make sure the SQLite store at `path` (every staged body: PHI) is readable by its owner only,
    whatever the umask: a missing directory is created 0700 and a missing database file 0600
    (``O_CREAT|O_EXCL|O_NOFOLLOW``) before SQLite opens it — SQLite then gives its `-wal`, `-shm`
    and `-journal` the database's mode. An existing store, or a companion file, that others may read
    (made by an older version) is tightened to 0600 with a warning, and its directory to 0700 when
    that is safe (`private_store_dir`). Not for `:memory:`/URIs."""
    db = Path(path)
    if str(path) == ":memory:" or str(path).startswith("file:"):
        return
    db.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    private_store_dir(db)
    try:
        fd = os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    else:
        os.close(fd)
        return
    for name in (db, *(db.with_name(db.name + suffix) for suffix in SQLITE_COMPANIONS)):
        try:
            st = os.lstat(name)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
            log.warning(
                "SQLite store file %s was mode %o, readable by others: tightened to 600", name, stat.S_IMODE(st.st_mode)
            )
            try:
                os.chmod(name, 0o600, follow_symlinks=False)
            except FileNotFoundError:
                pass  # a -journal or -wal removed meanwhile


class SqliteDialect(Dialect):
    def connect(self, cfg: StoreConfig, *, timeout_seconds: int = 10) -> sqlite3.Connection:
        private_sqlite_file(cfg.path)
        conn = sqlite3.connect(
            cfg.path, isolation_level=None, timeout=cfg.busy_timeout_ms / 1000, check_same_thread=False
        )
        conn.row_factory = _dict_row_sqlite
        conn.execute(f"PRAGMA busy_timeout = {int(cfg.busy_timeout_ms)}")
        conn.execute("PRAGMA journal_mode = WAL")
        # A checkpoint that catches up restarts the WAL at its start, but the file keeps the size of
        # its longest stretch — a long reader (an operator's query, a backup) holds checkpoints back
        # and the WAL grows meanwhile; cap what it keeps once reset (issue 22; the sizes measured:
        # docs/performance.md).
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT_BYTES}")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        return conn

    def begin(self, conn: sqlite3.Connection, *, write: bool) -> None:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def split_script(self, script: str) -> list[str]:
        return split_sqlite_script(script)

    def is_conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)

    def is_refusal(self, exc: BaseException) -> bool:
        return isinstance(exc, (sqlite3.DataError, sqlite3.IntegrityError))


class PostgresDialect(Dialect):
    def connect(self, cfg: StoreConfig, *, timeout_seconds: int = 10) -> Any:
        import psycopg
        from psycopg.rows import dict_row

        info = {**self.conninfo(cfg), "connect_timeout": timeout_seconds}
        return psycopg.connect(**info, row_factory=dict_row, autocommit=False)

    def conninfo(self, cfg: StoreConfig) -> dict[str, Any]:
        info: dict[str, Any] = {
            "host": cfg.server,
            "port": cfg.effective_port,
            "dbname": cfg.database,
            "user": cfg.username,
            "application_name": "stageline",
            # jit off: the claim's estimated cost trips JIT compilation on every
            # micro-batch, tens of ms spent on short statements
            "options": f"-c search_path={cfg.schema} -c jit=off",
            "connect_timeout": 10,
            # notice a silently dead server within ~15 s instead of hanging
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
        }
        if cfg.password:
            info["password"] = cfg.password
        return info

    def id_list(self, ids: list[int]) -> Any:
        return [int(i) for i in ids]

    def text_list(self, values: Iterable[str]) -> Any:
        return [str(v) for v in values]

    def is_conflict(self, exc: BaseException) -> bool:
        import psycopg.errors as e

        return isinstance(exc, (e.SerializationFailure, e.DeadlockDetected, e.LockNotAvailable))

    def is_refusal(self, exc: BaseException) -> bool:
        import psycopg

        # SQLSTATE classes 22 (data exception) and 23 (integrity constraint violation)
        return isinstance(exc, (psycopg.DataError, psycopg.IntegrityError))


class SqlServerDialect(Dialect):
    def connect(self, cfg: StoreConfig, *, timeout_seconds: int = 10) -> Any:
        import pymssql

        return pymssql.connect(
            server=cfg.server,
            port=str(cfg.effective_port),
            user=cfg.username,
            password=cfg.password or "",
            database=cfg.database,
            as_dict=True,
            autocommit=False,
            login_timeout=timeout_seconds,
        )

    def begin(self, conn: Any, *, write: bool) -> None:
        # pymssql opens transactions itself; LOCK_TIMEOUT is per session, so undo an elector's bound
        conn.cursor().execute("SET LOCK_TIMEOUT -1")

    def split_script(self, script: str) -> list[str]:
        return split_tsql_batches(script)

    def is_conflict(self, exc: BaseException) -> bool:
        # 1205 deadlock victim, 1222 lock request timeout; THROWn lock failures carry the number too
        number = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        return number in (1205, 1222) or any(f"as error {n}" in str(exc) for n in (1205, 1222))

    def is_refusal(self, exc: BaseException) -> bool:
        import pymssql

        # pymssql reports most server errors as OperationalError: also go by the error number
        # (245 conversion, 515 NULL, 547 constraint, 2601/2627 unique, 2628/8152 truncation)
        number = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        return isinstance(exc, (pymssql.DataError, pymssql.IntegrityError)) or number in (
            245,
            515,
            547,
            2601,
            2627,
            2628,
            8152,
        )


DIALECTS: dict[str, Dialect] = {
    "sqlite": SqliteDialect("sqlite", {"now": NOW_MS_SQLITE}, lambda sql: sql),
    "postgres": PostgresDialect("postgres", {}, to_pyformat, atomic_staging=True),
    "sqlserver": SqlServerDialect("sqlserver", {}, to_pyformat),
}
