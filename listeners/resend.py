"""A re-send of a message whose answer did not say "stored" is recognised, not staged twice.

When listenerd answers a message without knowing that it is stored — the handler's timeout
answered `AE` while its commit was still queued or in flight, the store connection broke during
the commit, or an HL7 batch failed after some of its parts were committed — the commit may still
land, or may already have. The sender resends, as `AE` tells it to. This memory gives that
re-send the message ids the first copy was given (same inbound connection, same control id, same
bytes, within `window_seconds`): the store's `ON CONFLICT (message_id) DO NOTHING` then stages
only what the first copy did not, and the re-send's answer is `AA` naming the first copy's id.
So an answer and the rows agree whatever the order of events (docs/listenerd.md, "Answers that
mean what they say").

Only such messages are remembered (a handful, not the feed), for a bounded time and count; a body
digest is computed only for a message whose connection and control id are remembered. Reactor
thread only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["RESEND_WINDOW_SECONDS", "ResendMemory"]

RESEND_WINDOW_SECONDS = 600.0
"""How long a re-send is recognised: well past any sender's ACK timeout and retry interval."""

MAX_REMEMBERED = 50_000
"""At most this many messages remembered (the oldest forgotten first): a store outage at 200 msg/s
fills it in about four minutes, a few MB."""


def _digest(unit: Any) -> bytes:
    h = hashlib.sha256()
    items = unit.items if hasattr(unit, "items") else (unit,)
    for item in items:
        h.update(item.payload.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.digest()


def _key(unit: Any) -> tuple[str, str | None, int]:
    return unit.connection, unit.control_id, len(unit.items) if hasattr(unit, "items") else 0


class ResendMemory:
    """(connection, control id, message count) → [(body digest, message id, expiry)], oldest first."""

    def __init__(
        self,
        *,
        window_seconds: float = RESEND_WINDOW_SECONDS,
        max_entries: int = MAX_REMEMBERED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_seconds = window_seconds
        self.max_entries = max_entries
        self._clock = clock
        self._by_key: OrderedDict[tuple[str, str | None, int], list[tuple[bytes, Any, float]]] = OrderedDict()
        self._count = 0
        self.recognised = 0

    def __len__(self) -> int:
        return self._count

    def remember(self, unit: Any) -> None:
        """`unit` was answered without a "stored": a re-send of it within the window gets its ids."""
        now = self._clock()
        self._expire(now)
        key = _key(unit)
        digest = _digest(unit)
        found = self._by_key.setdefault(key, [])
        if any(d == digest for d, _, _ in found):
            return
        found.append((digest, _ids(unit), now + self.window_seconds))
        self._by_key.move_to_end(key)
        self._count += 1
        while self._count > self.max_entries:
            _, oldest = self._by_key.popitem(last=False)
            self._count -= len(oldest)

    def recall(self, unit: Any) -> Any:
        """`unit`, with the first copy's message ids if it re-sends a remembered message."""
        if not self._count:
            return unit
        found = self._by_key.get(_key(unit))
        if not found:
            return unit
        now = self._clock()
        digest = _digest(unit)
        for d, ids, expires in found:
            if d == digest and expires > now:
                self.recognised += 1
                return _with_ids(unit, ids)
        return unit

    def _expire(self, now: float) -> None:
        while self._by_key:
            key, first = next(iter(self._by_key.items()))
            if any(expires > now for _, _, expires in first):
                return
            del self._by_key[key]
            self._count -= len(first)


def _ids(unit: Any) -> Any:
    """A message's id; a batch's id and its messages' ids."""
    if not hasattr(unit, "items"):
        return unit.message_id
    return unit.batch_id, tuple(item.message_id for item in unit.items)


def _with_ids(unit: Any, ids: Any) -> Any:
    if not hasattr(unit, "items"):
        return dataclasses.replace(unit, message_id=ids)
    batch_id, member_ids = ids
    items = tuple(dataclasses.replace(item, message_id=m) for item, m in zip(unit.items, member_ids))
    return dataclasses.replace(unit, batch_id=batch_id, items=items)
