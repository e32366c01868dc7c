"""Content search: hot messages of one time window whose body holds a text and/or satisfies routing
conditions (`stageline messages find --contains TEXT --where 'PID-8 = "F"'`).

Bounded in cost by what it is given, not by the table: the window is required to be at most
MAX_WINDOW (one day when only an end is given), the store reads that window's rows newest first
through the received-time index (migration 0017) in chunks, and the whole search stops after
TIMEOUT_SECONDS — PostgreSQL's statement_timeout, SQLite's progress handler — with a clear error
saying to narrow the window. The text is a bound parameter, its characters taken literally and
case-sensitively: a LIKE pattern on PostgreSQL (so the optional trigram index serves it), a GLOB
pattern on SQLite (`pattern`). Conditions run in Python on the bodies read (`include.hl7match`); no body
leaves this module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from include.conditions import Condition
from include.hl7match import RegexTooCostly, matches
from include.store.db import ReadTimedOut, Store, Tx
from include.store.operator import FIND_LIMIT, MAX_ROW_ID, check_page

DAY_MS = 86_400_000
MAX_WINDOW_MS = 7 * DAY_MS
TIMEOUT_SECONDS = 10.0
CHUNK = 500
MAX_TEXT_CHARS = 200


INDEXED_CHARS = 3
"""The shortest text a trigram index (PostgreSQL's pg_trgm, SQLite's FTS5 trigram) can look up;
a shorter one, or conditions alone, read the window's bodies."""
FILL_CHUNK = 2_000
"""Bodies indexed per transaction when the SQLite index is made over bodies already stored."""


class SearchTooBroad(ValueError):
    """The search would read more than it may: its window, or its time."""


@dataclass(frozen=True)
class ContentQuery:
    """Hot messages received in [since_ms, until_ms) holding `text` and satisfying `where`; no end
    is the store's now, no start a day before the end."""

    since_ms: int | None = None
    until_ms: int | None = None
    text: str | None = None
    where: Condition | None = None
    connection: str | None = None
    before_id: int | None = None
    limit: int = FIND_LIMIT

    def window(self, now_ms: int) -> tuple[int, int]:
        """[since, until) checked: SearchTooBroad past MAX_WINDOW_MS, ValueError if inside out."""
        until = self.until_ms if self.until_ms is not None else now_ms + 1
        since = self.since_ms if self.since_ms is not None else until - DAY_MS
        check_page(self.limit, max(since, 0), until, self.before_id)
        if since >= until:
            raise ValueError("the window is empty: --since must be before --until")
        if until - since > MAX_WINDOW_MS:
            raise SearchTooBroad(
                f"a content search reads every body of its window: at most {MAX_WINDOW_MS // DAY_MS} days "
                "(give --since and --until closer together)"
            )
        return max(since, 0), until

    def checked_text(self) -> str:
        if self.text is None:
            return ""
        if not self.text or len(self.text) > MAX_TEXT_CHARS or "\x00" in self.text:
            raise ValueError(f"--contains takes 1 to {MAX_TEXT_CHARS} characters (no NUL)")
        return self.text


def pattern(backend: str, text: str) -> str:
    """A pattern matching bodies that hold `text`, its characters taken literally: GLOB's `*text*`
    on SQLite (brackets around `*`, `?`, `[`), LIKE's `%text%` elsewhere (`\\` before `%`, `_`, `\\`)."""
    if backend == "sqlite":
        return "*" + "".join(f"[{c}]" if c in "*?[" else c for c in text) + "*"
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def find(store: Store, query: ContentQuery, *, timeout: float = TIMEOUT_SECONDS) -> list[dict[str, Any]]:
    """Up to `query.limit` matching messages, newest first (page on with before_id = the last id);
    metadata only. SearchTooBroad when the window is too wide or the time runs out."""
    text = query.checked_text()
    timeout = min(timeout, store.read_timeout or timeout)  # a shorter bound the caller set holds too
    cursor = query.before_id if query.before_id is not None else MAX_ROW_ID
    found: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    with store.transaction(write=False) as tx, _bounded(tx, timeout):
        since, until = query.window(int(float(tx.row("db_now")["db_now"]) * 1000))
        params = {
            "since_ms": since,
            "until_ms": until,
            "connection": query.connection,
            "pattern": pattern(store.backend, text),
            "limit": CHUNK,
        }
        indexed = len(text) >= INDEXED_CHARS and tx.row("content_index_present")["n"]
        statement = "content_find_indexed" if indexed else "content_find"
        while len(found) < query.limit:
            rows = tx.all(statement, {**params, "before_id": cursor})
            for row in rows:
                body = row.pop("payload")
                if query.where is None or _matches(query.where, body, row["connection"], deadline):
                    found.append(row)
                    if len(found) == query.limit:
                        break
            if len(rows) < CHUNK:
                break
            if time.monotonic() > deadline:  # the conditions' time counts too, not only the store's
                raise SearchTooBroad(
                    f"the search ran past {timeout:g} s and was stopped: narrow the window (--since/--until) "
                    "or add --connection"
                )
            cursor = int(rows[-1]["id"])
    return found


def _matches(where: Condition, body: str | None, connection: str | None, deadline: float) -> bool:
    """`where` on one body; a regex that runs past the search's deadline ends the search."""
    try:
        return matches(where, body, connection, deadline=deadline)
    except RegexTooCostly as exc:
        raise SearchTooBroad(str(exc)) from None


@contextmanager
def _bounded(tx: Tx, timeout: float) -> Iterator[None]:
    """The search's statements end after `timeout` seconds, whatever the dialect."""
    try:
        with tx.store.bounded(tx, timeout, setting="the content search's bound"):
            yield
    except ReadTimedOut:
        raise SearchTooBroad(
            f"the search ran past {timeout:g} s and was stopped: narrow the window (--since/--until) "
            "or add --connection"
        ) from None


def create_index(store: Store) -> int:
    """Make the content index the store offers (`stageline messages content-index`): PostgreSQL's
    pg_trgm GIN index, built concurrently; SQLite's FTS5 trigram index of the bodies, kept by
    triggers from the moment it exists and filled with the bodies already there FILL_CHUNK a
    transaction (so ingest waits for one chunk at a time, never the whole fill). Bodies indexed
    (PostgreSQL: -1, it does not say); ValueError on SQL Server, which has none here."""
    if store.backend == "postgres":
        with store.single_statement() as tx:
            tx.execute("content_index_extension")
            tx.execute("content_index_create")
        return -1
    if store.backend != "sqlite":
        raise ValueError(f"no content index on {store.backend}: a content search reads its window's bodies")
    with store.transaction() as tx:
        for name in ("table", "on_insert", "on_delete", "on_update"):
            tx.execute(f"content_index_{name}")
        last = int(tx.row("content_index_last")["last_id"])
    done = 0
    for after in range(0, last, FILL_CHUNK):
        with store.transaction() as tx:
            done += max(
                0, tx.execute("content_index_fill", {"after_id": after, "last_id": min(last, after + FILL_CHUNK)})
            )
    return done


def drop_index(store: Store) -> None:
    """Remove the content index (and SQLite's triggers): searches read the window's bodies again."""
    if store.backend == "postgres":
        with store.single_statement() as tx:
            tx.execute("content_index_drop")
        return
    if store.backend != "sqlite":
        raise ValueError(f"no content index on {store.backend}")
    with store.transaction() as tx:
        for name in ("drop_insert", "drop_delete", "drop_update", "drop"):
            tx.execute(f"content_index_{name}")
