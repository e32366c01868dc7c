"""A PostgreSQL commit the server returned as successful but did not confirm on its standby.

With a synchronous standby, a commit waits until the standby has flushed it. If that wait is
cancelled — a DBA's `pg_cancel_backend`, the transaction's own `statement_timeout` — PostgreSQL
does not fail the COMMIT: the commit is already in its own WAL, so it returns success with a
WARNING ("canceling wait for synchronous replication …: committed locally, but might not have
been replicated"). A promotion then loses it. So a commit that brings such a warning is not
confirmed: `watching` raises `CommitUnconfirmed` after it, the ingest path answers `AE` (the
sender's re-send is recognised, and waits for the standby: `rowlease.staging`), and the lease
elector does not count the step (docs/store.md, "Across a database failover").

The warning is recognised by its severity and SQLSTATE, never by its (translated) text: a
WARNING in class 01 (the cancelled wait is 01000) or 57P01 (the session terminated while it
waited; the connection also ends, so that one fails anyway).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["CommitUnconfirmed", "unconfirming", "watching"]


class CommitUnconfirmed(RuntimeError):
    """The server committed locally and said the commit may not be on its synchronous standby."""

    def __init__(self, warning: str) -> None:
        super().__init__(
            "the commit was not confirmed by the synchronous standby (the server warned: "
            f"{warning}); it may be lost at a promotion, so it is not acknowledged"
        )


def unconfirming(severity: str | None, sqlstate: str | None) -> bool:
    """A notice of this non-localized severity and SQLSTATE says a commit's standby wait ended early."""
    return severity == "WARNING" and sqlstate is not None and (sqlstate.startswith("01") or sqlstate == "57P01")


@contextmanager
def watching(conn: Any) -> Iterator[None]:
    """Raise `CommitUnconfirmed` after the block if `conn` (a psycopg connection) got an
    unconfirming notice meanwhile: put the COMMIT (or an autocommitted statement) in it."""
    seen: list[str] = []

    def notice(diag: Any) -> None:
        if unconfirming(diag.severity_nonlocalized, diag.sqlstate):
            seen.append(f"{diag.sqlstate} {diag.message_primary}")

    conn.add_notice_handler(notice)
    try:
        yield
    finally:
        conn.remove_notice_handler(notice)
    if seen:
        raise CommitUnconfirmed(seen[0])
