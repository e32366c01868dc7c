"""Business keys: what a message is about (an MRN, an accession number, a visit), kept for search.

The route stage indexes what it claims: right after a micro-batch's claim, while Spark routes it, a
worker thread reads the claimed messages' bodies, takes the keys `keys.toml` names from each
(`include.hl7path.values`, the listener's lane-key reader) and writes one `message_keys` row per
message and key; the route waits for it before its finalize (`index_alongside`). Every message is
claimed by the route before it can be routed — a replay too — so every message is indexed, however
late its ingest committed; a re-run writes each key once. The earlier indexer read stage_inbound in
id order behind a mark and skipped for good a message whose commit came later than the mark's
settle time. The mark (`key_progress`) now only drives the catch-up of the messages staged before
store version 18 that it had not reached (`catch_up`).

A failure to index a batch is retried once and then logged, never raised: it costs the search
those messages' keys, never a message its route.

A message keeps its inbound id in the hot tables, retention's archive and the Parquet archive, so
the key rows stay with it through retention; they go only when retention deletes messages
without archiving them (`purge`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from include.hl7path import FieldPath, values
from include.keys_config import NAME, KeyRules
from include.store.db import Store, Tx
from include.store.operator import FIND_LIMIT, MAX_ROW_ID, MAX_TIME_MS, check_page

log = logging.getLogger(__name__)

INDEX_BATCH = 5_000
MAX_VALUE_CHARS = 199
"""A longer value is not kept (nvarchar(200) on SQL Server, which counts UTF-16 units: a character
outside the BMP counts twice); neither is one with control characters."""


def keys_of(text: str | None, paths: Mapping[str, FieldPath]) -> list[tuple[str, str]]:
    """The (name, value) pairs `paths` give in one message; a missing, empty, over-long value or one
    with control characters gives none."""
    if not text or not paths:
        return []
    return [
        (name, got) for name, got in values(text, paths).items() if got is not None and _fits(got) and got.isprintable()
    ]


def _fits(value: str) -> bool:
    return len(value) <= MAX_VALUE_CHARS and (value.isascii() or len(value.encode("utf-16-le")) <= 2 * MAX_VALUE_CHARS)


def index(store: Store, rules: KeyRules, ids: Sequence[int]) -> int:
    """Index the keys of inbound messages `ids` (a route claim), in one transaction, each key once
    however often its message is indexed; messages read."""
    if not rules or not ids:
        return 0
    with store.transaction() as tx:
        rows = tx.all("keys_of_claimed", {"ids": tx.dialect.id_list(sorted({int(i) for i in ids}))})
        _write(tx, rules, rows)
    return len(rows)


def index_alongside(store: Store, rules: KeyRules, ids: Sequence[int]) -> int:
    """`index`, retried once, then logged (its type only: no key value is logged) instead of raised."""
    for attempt in (1, 2):
        try:
            return index(store, rules, ids)
        except Exception as exc:
            log.warning(
                "business keys of %d claimed messages not indexed (attempt %d of 2): %s",
                len(ids),
                attempt,
                type(exc).__name__,
            )
    return 0


def catch_up(store: Store, rules: KeyRules, *, limit: int = INDEX_BATCH) -> int:
    """Index up to `limit` messages staged before store version 18 that its mark had not reached
    (they may have been routed already, so no claim brings them back), in one transaction, moving
    the mark; messages read (0: nothing left)."""
    if not rules:
        return 0
    with store.transaction() as tx:
        mark = tx.row("keys_progress")
        after, until = int(mark["last_id"]), int(mark["until_id"])
        if after >= until:
            return 0
        rows = tx.all("keys_pending", {"after_id": after, "until_id": until, "limit": int(limit)})
        _write(tx, rules, rows)
        tx.execute("keys_advance", {"last_id": int(rows[-1]["id"]) if len(rows) == limit else until})
    return len(rows)


def catch_up_quietly(store: Store, rules: KeyRules) -> int:
    """`catch_up`, logging a failure (its type only) instead of raising; -1 after a failure."""
    try:
        return catch_up(store, rules)
    except Exception as exc:
        log.warning("business keys of messages staged before version 18 not indexed yet: %s", type(exc).__name__)
        return -1


def _write(tx: Tx, rules: KeyRules, rows: list[dict[str, Any]]) -> None:
    """The key rows of inbound `rows` (id, connection, created_ms, payload), each at most once."""
    keys: list[dict[str, Any]] = []
    for r in rows:
        try:
            found = keys_of(r["payload"], rules.for_connection(r["connection"]))
        except Exception:  # a body no rule can read keeps no keys; it never stops the batch
            found = []
        keys.extend(
            {
                "message": int(r["id"]),
                "name": name,
                "value": got,
                "received_ms": int(r["created_ms"]),
                "connection": r["connection"],
            }
            for name, got in found
        )
    if keys:
        tx.execute("keys_insert", {"rows": json.dumps(keys)})


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
        if not _fits(self.value) or not self.value.isprintable():
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
