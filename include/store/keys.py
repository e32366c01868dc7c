"""Business keys: what a message is about (an MRN, an accession number, a visit), kept for search.

The key indexer reads stage_inbound in id order behind a mark (`key_progress`), takes the keys
`keys.toml` names from each body (`include.hl7path.value`, the listener's lane-key reader) and
writes one `message_keys` row per message and key, then moves the mark — in one transaction, so a
crash leaves the mark where the keys are, and a re-run writes each key once. It runs in the route
stage's task after each micro-batch, outside Spark and outside the route's fenced finalize: a
failure here costs the search a few seconds, never a message its route. It reads only messages
staged SETTLE_MS ago or more: ids are taken at insert, so a commit still open with a lower id
than one already visible would otherwise be passed by the mark.

A message keeps its inbound id in the hot tables, retention's archive and the Parquet archive, so
the key rows stay with it through retention; they go only when retention deletes messages
without archiving them (`purge`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from include.hl7path import FieldPath, values
from include.keys_config import NAME, KeyRules
from include.store.db import Store
from include.store.operator import FIND_LIMIT, MAX_ROW_ID, MAX_TIME_MS, check_page

log = logging.getLogger(__name__)

SETTLE_MS = 2_000
INDEX_BATCH = 5_000
MAX_VALUE_CHARS = 199
"""A longer value is not kept (nvarchar(200) on SQL Server); neither is one with control characters."""


def keys_of(text: str | None, paths: Mapping[str, FieldPath]) -> list[tuple[str, str]]:
    """The (name, value) pairs `paths` give in one message; a missing, empty, over-long value or one
    with control characters gives none."""
    if not text or not paths:
        return []
    return [
        (name, got)
        for name, got in values(text, paths).items()
        if got is not None and len(got) <= MAX_VALUE_CHARS and got.isprintable()
    ]


def index(store: Store, rules: KeyRules, *, limit: int = INDEX_BATCH, settle_ms: int = SETTLE_MS) -> int:
    """Index the keys of up to `limit` messages past the mark, in one transaction; messages read."""
    if not rules:
        return 0
    with store.transaction() as tx:
        after = int(tx.row("keys_progress")["last_id"])
        rows = tx.all("keys_pending", {"after_id": after, "settle_ms": int(settle_ms), "limit": int(limit)})
        if not rows:
            return 0
        keys = [
            {
                "message": int(r["id"]),
                "name": name,
                "value": got,
                "received_ms": int(r["created_ms"]),
                "connection": r["connection"],
            }
            for r in rows
            for name, got in keys_of(r["payload"], rules.for_connection(r["connection"]))
        ]
        if keys:
            tx.execute("keys_insert", {"rows": json.dumps(keys)})
        tx.execute("keys_advance", {"last_id": int(rows[-1]["id"])})
    return len(rows)


def index_quietly(store: Store, rules: KeyRules, *, limit: int = INDEX_BATCH) -> int:
    """`index`, logging a failure (its type only: no key value is logged) instead of raising."""
    try:
        return index(store, rules, limit=limit)
    except Exception as exc:
        log.warning("business keys not indexed this time: %s", type(exc).__name__)
        return 0


@dataclass(frozen=True)
class KeyQuery:
    """`name=value` (exact) or `name=prefix*`, within [since_ms, until_ms), newest first."""

    name: str
    value: str
    prefix: bool = False
    since_ms: int | None = None
    until_ms: int | None = None
    before_id: int | None = None
    limit: int = FIND_LIMIT

    @classmethod
    def parse(cls, text: str, **kwargs: Any) -> KeyQuery:
        """`mrn=12345` or `mrn=123*`; ValueError saying what is wrong."""
        name, eq, wanted = str(text).partition("=")
        name = name.strip()
        if not eq or not NAME.fullmatch(name):
            raise ValueError(f"a key search is NAME=VALUE or NAME=PREFIX* (e.g. mrn=12345), got {text!r}")
        prefix = wanted.endswith("*")
        return cls(name=name, value=wanted[:-1] if prefix else wanted, prefix=prefix, **kwargs)

    def params(self) -> dict[str, Any]:
        """The statement's parameters, every value checked (ValueError)."""
        if not self.value:
            raise ValueError("a key search needs a value (a prefix needs at least one character before *)")
        if len(self.value) > MAX_VALUE_CHARS or not self.value.isprintable():
            raise ValueError(f"a key value is at most {MAX_VALUE_CHARS} printable characters")
        check_page(self.limit, self.since_ms, self.until_ms, self.before_id)
        return {
            "name": self.name,
            "lo": self.value,
            "hi": _after_prefix(self.value) if self.prefix else self.value + "\x01",
            "since_ms": self.since_ms if self.since_ms is not None else 0,
            "until_ms": self.until_ms if self.until_ms is not None else MAX_TIME_MS + 1,
            "before_id": self.before_id if self.before_id is not None else MAX_ROW_ID,
            "limit": self.limit,
        }


def _after_prefix(prefix: str) -> str:
    """The least string greater than every string starting with `prefix`, in code point order (which
    is UTF-8's byte order: PostgreSQL's "C" collation, SQLite's BINARY)."""
    last = ord(prefix[-1]) + 1
    if 0xD800 <= last <= 0xDFFF:  # surrogates are not characters; the next one is U+E000
        last = 0xE000
    if last > 0x10FFFF:
        raise ValueError("a key prefix may not end with U+10FFFF")
    return prefix[:-1] + chr(last)


def find(store: Store, query: KeyQuery) -> list[dict[str, Any]]:
    """Messages with the key, newest first: hot, archived (`tier` 'archive') or only in the Parquet
    archive (`tier` 'parquet': `stageline messages show <id>` reads it)."""
    params = query.params()
    with store.transaction(write=False) as tx:
        return tx.all("keys_find", params)


def of_message(store: Store, inbound_id: int) -> list[dict[str, Any]]:
    """A message's keys, by name."""
    with store.transaction(write=False) as tx:
        return tx.all("keys_of_message", {"id": int(inbound_id)})


def purge(store: Store, epoch: int, *, older_than_seconds: float, limit: int = 5000, max_batches: int = 100) -> int:
    """Delete the keys of messages older than the age that no hot or archive table holds any more
    (retention without an archive), `limit` messages a transaction; key rows deleted."""
    total = 0
    for _ in range(max_batches):
        with store.transaction() as tx:
            n = tx.execute("keys_purge", {"ms": int(older_than_seconds * 1000), "limit": limit, "epoch": epoch})
        total += max(n, 0)
        if n <= 0:
            break
    return total
