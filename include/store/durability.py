"""Durability pinned: a commit the store reports is a commit the server will not lose (docs/store.md).

listenerd answers `AA` only after the commit (invariant 1); that means nothing if the server may
still drop the commit. So on every new connection:

* PostgreSQL: the session runs with ``synchronous_commit = on`` (a role, database or server default
  of ``off``/``local`` is overridden), except that where the server names
  ``synchronous_standby_names`` a setting of ``on``, ``remote_write`` or ``remote_apply`` is kept (the
  standby's wait the operator chose). A server running with ``fsync = off`` is refused.
* SQL Server: a database whose ``DELAYED_DURABILITY`` is ``FORCED`` is refused (there is no
  session setting that overrides it; ``ALLOWED`` is durable for Stageline, whose commits never ask
  for delayed durability).
* SQLite: ``synchronous = FULL`` is set on every connection already (`SqliteDialect.connect`).

A refusal is :class:`UnsafeDurability`, unless ``[store] allow_unsafe_durability = true`` (a test
box, a throwaway store): then it is only logged.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from typing import Any

from include.store.queries import SQL_ROOT, parse_named, to_pyformat

log = logging.getLogger(__name__)

__all__ = [
    "STANDBY_LEVELS",
    "UnsafeDurability",
    "check_connection",
    "durability_queries",
    "postgres_refusal",
    "postgres_synchronous_commit",
    "sqlserver_refusal",
]

#: synchronous_commit values that wait for a synchronous standby when one is configured.
STANDBY_LEVELS = frozenset({"on", "remote_write", "remote_apply"})


class UnsafeDurability(RuntimeError):
    """The server may lose commits the store reports; the text says which setting and what to do."""


def postgres_synchronous_commit(current: str, standby_names: str) -> str | None:
    """The ``synchronous_commit`` a store session must SET, or None to keep the current one.

    Never ``off`` or ``local``: with standbys configured, a standby-waiting level the server (or
    role) chose is kept; everything else becomes ``on``.
    """
    value = (current or "").strip().lower()
    if (standby_names or "").strip() and value in STANDBY_LEVELS:
        return None
    return None if value == "on" else "on"


def postgres_refusal(fsync: str) -> str | None:
    """Why a PostgreSQL server may lose committed data, or None."""
    if (fsync or "").strip().lower() != "on":
        return (
            "PostgreSQL runs with fsync = off: a crash of the server can lose or corrupt commits that "
            "listenerd has acknowledged. Turn fsync on, or set [store] allow_unsafe_durability = true "
            "for a store whose data may be lost"
        )
    return None


def sqlserver_refusal(delayed_durability: str | None) -> str | None:
    """Why a SQL Server database may lose committed data, or None."""
    if (delayed_durability or "").strip().upper() == "FORCED":
        return (
            "SQL Server database has DELAYED_DURABILITY = FORCED: commits are acknowledged before their "
            "log is on disk. Run ALTER DATABASE ... SET DELAYED_DURABILITY = DISABLED, or set "
            "[store] allow_unsafe_durability = true for a store whose data may be lost"
        )
    return None


@cache
def durability_queries(backend: str) -> dict[str, str]:
    """The named durability queries of a server dialect (`sql/durability/<backend>.sql`, apart from
    the store's catalogue: they exist only where there is a server to ask), in the driver's style."""
    path: Path = SQL_ROOT / "durability" / f"{backend}.sql"
    return {name: to_pyformat(text) for name, text in parse_named(path.read_text()).items()}


def check_connection(conn: Any, backend: str, *, allow_unsafe: bool) -> None:
    """Pin and check one new connection (left idle: its reads are committed); raises
    `UnsafeDurability` unless `allow_unsafe`. SQLite: nothing to do (`SqliteDialect.connect`)."""
    if backend not in ("postgres", "sqlserver"):
        return
    sql = durability_queries(backend).__getitem__
    reason: str | None = None
    cur = conn.cursor()
    if backend == "postgres":
        cur.execute(sql("durability_settings"))
        row = cur.fetchone()
        reason = postgres_refusal(row["fsync"])
        wanted = postgres_synchronous_commit(row["synchronous_commit"], row["standby_names"])
        if wanted is not None:
            cur.execute(sql("pin_synchronous_commit"), {"value": wanted})
    elif backend == "sqlserver":
        cur.execute(sql("durability_settings"))
        row = cur.fetchone()
        reason = sqlserver_refusal(row["delayed_durability"] if row else None)
    conn.commit()  # set_config(..., false) is session-wide and survives the commit
    if reason is not None:
        if not allow_unsafe:
            raise UnsafeDurability(reason)
        log.warning("%s (allowed by allow_unsafe_durability)", reason.split(". ")[0])
