"""What goes into the next group commit: rows, not units, and a large HL7 batch in parts.

A group commit is capped by the rows (messages) it writes, `max_rows`: a message counts one, an
HL7 batch counts its messages. Units are taken in arrival order while they fit (the first always
does). A batch of more than `max_rows` messages is not one unit: it is committed in parts, one part
per commit (`part_rows`, a quarter of a commit), each part after whatever else is waiting — so a
40,000-message batch is some eighty short commits with every other sender's messages between them,
and no other sender waits behind more than about one commit (docs/listenerd.md, "Large batches").

What a batch keeps, split or not:

* **one answer, after every message is committed**: its Deferred fires once its last part has
  committed; if a part fails, it fails with what the earlier parts did (`BatchIncomplete` when
  some were stored), and its remaining parts are not tried;
* **its order**: parts commit in order, so its rows' ids are in the batch's order;
* **lane order** (invariant 6): a message that shares a lane key with a batch still being
  committed, and anything behind that message in its lane, waits until the batch is done. Messages
  of other lanes, and messages without a lane, pass.

Pure bookkeeping: no clock of its own, no threads, no database.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["BatchPart", "CommitPlan", "Entry"]


class _Batch(Protocol):
    """What a `BatchPart` reads of its batch (`listeners.group_commit.InboundBatch`)."""

    @property
    def connection(self) -> str: ...
    @property
    def batch_id(self) -> str: ...
    @property
    def control_id(self) -> str | None: ...
    def rows(self, lo: int = 0, hi: int | None = None) -> list[dict[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class BatchPart:
    """Messages ``lo`` to ``hi`` (from 0) of an HL7 batch (`listeners.group_commit.InboundBatch`) larger
    than one commit's row cap: one unit of one commit."""

    batch: _Batch
    lo: int
    hi: int

    @property
    def connection(self) -> str:
        return self.batch.connection

    @property
    def control_id(self) -> str | None:
        return self.batch.control_id

    @property
    def message_id(self) -> str:
        return self.batch.batch_id

    def rows(self) -> list[dict[str, Any]]:
        return self.batch.rows(self.lo, self.hi)


def _is_batch(unit: Any) -> bool:
    return hasattr(unit, "items")


def _lanes(unit: Any) -> frozenset[str]:
    if _is_batch(unit):
        return frozenset(i.lane_key for i in unit.items if i.lane_key is not None)
    lane = unit.lane_key
    return frozenset() if lane is None else frozenset((lane,))


@dataclass(eq=False, slots=True)
class Entry:
    """One submitted unit and its Deferred, until its answer is known."""

    unit: Any  # an `Inbound` or an `InboundBatch`
    d: Any
    since: float  # monotonic: when it (its next part, for a split batch) started waiting
    rows: int
    lanes: frozenset[str]
    split: bool = False  # a batch committed in parts
    done: int = 0  # messages of a split batch committed so far

    @classmethod
    def of(cls, unit: Any, d: Any, since: float, *, max_rows: int) -> Entry:
        rows = len(unit.items) if _is_batch(unit) else 1
        return cls(unit, d, since, rows, _lanes(unit), split=rows > max_rows)


@dataclass(slots=True)
class CommitPlan:
    """The waiting units, in arrival order; `take` gives the next commit, `settle` its outcomes."""

    max_rows: int
    part_rows: int = 0  # rows per part of a split batch; 0: a quarter of max_rows
    entries: list[Entry] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.part_rows <= 0:
            self.part_rows = max(1, self.max_rows // 4)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)

    def take(self) -> list[tuple[Entry, Any]]:
        """The next commit's pieces, in the order their rows go in: whole units first (arrival
        order, while they fit), then one part (`part_rows`) of each split batch that may go, while
        the commit is not full. Parts are smaller than a commit: a commit's time is what another
        sender may wait behind it."""
        cap = self.max_rows
        used = 0
        whole: list[tuple[Entry, Any]] = []
        splits: list[Entry] = []
        blocked: list[frozenset[str]] = []  # lanes that must wait for a batch still being committed
        for entry in self.entries:
            if entry.lanes and blocked and any(not entry.lanes.isdisjoint(b) for b in blocked):
                blocked.append(entry.lanes)  # held, and what is behind it in its lanes too
                continue
            if entry.split:
                splits.append(entry)
                if entry.lanes:
                    blocked.append(entry.lanes)  # its part goes after the whole units below
                continue
            if whole and used + entry.rows > cap:
                break  # the rest waits for the next commit, in arrival order
            whole.append((entry, entry.unit))
            used += entry.rows
        parts: list[tuple[Entry, Any]] = []
        for entry in splits:
            if (whole or parts) and used >= cap:
                break
            n = min(entry.rows - entry.done, self.part_rows)
            parts.append((entry, BatchPart(entry.unit, entry.done, entry.done + n)))
            used += n
        return whole + parts

    def settle(self, taken: list[tuple[Entry, Any]], outcomes: Iterable[Any], *, now: float) -> list[tuple[Entry, Any]]:
        """Apply one commit's outcomes (None = committed); returns the entries now answered, each
        with its outcome (None, or why not; a split batch's `entry.done` says how many of its
        messages were committed before it failed), and drops them from the plan."""
        finished: list[tuple[Entry, Any]] = []
        for (entry, piece), outcome in zip(taken, outcomes):
            if piece.__class__ is BatchPart and outcome is None:
                entry.done = piece.hi
                entry.since = now
                if entry.done < entry.rows:
                    continue
            finished.append((entry, outcome))
        if finished:
            gone = {id(e) for e, _ in finished}
            self.entries = [e for e in self.entries if id(e) not in gone]
        return finished

    def fail_all(self) -> list[Entry]:
        """Every waiting entry, dropped (no lease, writer stopped): the caller answers them."""
        entries, self.entries = self.entries, []
        return entries
