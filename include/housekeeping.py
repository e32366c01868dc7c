"""The stage DAGs' housekeeping under a leader's epoch (invariant 5 in docs/invariants.md), in plain Python.

- `recover` — on-promotion recovery: once per epoch, every row claimed under an older epoch is
  re-pended at once, ignoring row leases (the old leader fenced itself);
- `reclaim` — the recurring sweep: in-flight rows whose row lease expired are re-pended;
- `retention` — finished rows, HL7 batch records and audit events past their retention are
  archived, then deleted.

Each takes an open store (in Airflow: `StagelineStoreHook`, once per task) and the epoch the
run's leader check returned (`include/leader_check.py`), does bounded work in short transactions,
is safe to repeat (Airflow retries) and does nothing under a stale epoch. Nothing here imports
Airflow, so all of it is tested without a scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from include.store import INBOUND, STAGED_TABLES, StagedTable, Store, rowlease
from include.store.keys import purge as purge_keys
from include.store.lease import read_lease

log = logging.getLogger(__name__)

EVENTS = "events"
"""Key of the audit trail (`message_events`) in a retention mapping; the others are stage names."""
KEYS = "message_keys"
"""Key of the business keys (`include.store.keys`) in what retention returns: those of messages
deleted without an archive. Not a retention key: keys follow their messages."""
BATCHES = "inbound_batches"
"""Key of the HL7 batch records in what retention returns. Not a retention key: a batch follows
the inbound key, and goes once none of its messages' inbound rows is left."""


def recover(store: Store, epoch: int, owner: str | None) -> int | None:
    """Run the on-promotion recovery for `epoch`; the rows re-pended, or None when nothing ran.

    None means this epoch's recovery already ran (the usual case: every run after the first of an
    epoch pays one read-only query) or the epoch is no longer current.
    """
    if read_lease(store).recovered_epoch >= epoch:
        return None
    with store.transaction() as tx:
        recovered = rowlease.recover_on_promotion(tx, owner=owner or "airflow", epoch=epoch)
    if recovered is not None:
        log.info("recovery for epoch %s re-pended %s row(s) claimed under older epochs", epoch, recovered)
    return recovered


def reclaim(
    store: Store, epoch: int, owner: str | None, *, limit: int = 1000, max_batches: int = 100
) -> dict[str, int]:
    """Re-pend in-flight rows whose row lease expired, in every staged table.

    Each batch of at most `limit` rows is its own short transaction; a table stops at a short
    batch or after `max_batches` (what is left waits for the next run). Returns rows per stage.
    """
    counts: dict[str, int] = {}
    for table in STAGED_TABLES:
        counts[table.key] = _batches(
            lambda: _sweep(store, table, epoch=epoch, owner=owner or "airflow", limit=limit),
            limit=limit,
            max_batches=max_batches,
        )
    if any(counts.values()):
        log.info("reclaim under epoch %s re-pended %s", epoch, counts)
    return counts


ARCHIVE_QUERIES = {
    "inbound": "archive_finished_inbound",
    "routed": "archive_finished_routed",
    "outbound": "archive_finished_outbound",
    EVENTS: "archive_events",
    BATCHES: "archive_inbound_batches",
}
"""Per retention key, the query that copies what its purge query deletes into the archive tables."""


def retention(
    store: Store,
    epoch: int,
    older_than_seconds: float | Mapping[str, float],
    *,
    batch: int = 5000,
    max_batches: int = 100,
    archive: bool = True,
    archived: dict[str, int] | None = None,
    connections: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, int]:
    """Archive, then delete, finished rows (done, dead, unrouted) older than each stage's retention.

    `older_than_seconds`: one age for every stage and the audit trail, or a mapping from stage
    name (`inbound`, `routed`, `outbound`) and `events` to an age; a key left out is not purged.
    Unfinished rows are never touched, however old. Returns rows deleted per key.

    Stages go downstream first (outbound, routed, inbound): an inbound row is kept while its routed
    rows are open or an outbound row sends its body (a pass-through row, docs/store.md "Bodies"),
    so a run that purges those purges it too.

    With `inbound`, HL7 batch records (`inbound_batches`, key `inbound_batches`) go too, right after
    the inbound rows: a batch once none of its messages' inbound rows is left in the hot tables (its
    archived messages keep `batch_id` and `batch_seq`, so each still names its batch in the archive).

    With `archive` (the default) each key is two steps, batch by batch, each batch fenced: copy the
    rows (bodies included) and events into the `archive_*` tables, then delete from the hot tables
    only what the archive holds as it is now (same id, same `updated_at`). The steps are separate
    transactions: a run killed between them has archived rows it did not purge, and the next run
    copies none of them again (the archive is keyed by the hot row's id) and purges them. So what
    is purged was archived first, and nothing is archived twice. `archived`, when given, receives
    the rows archived per key. `archive=False` deletes without copying (the behaviour before the
    archive existed), and then the business keys of the messages it deleted go too (key
    `message_keys`, when there were any); archived messages keep theirs.

    `connections` maps a connection name to its own ages per stage (`[retention.connections.*]`):
    a message received on it keeps its inbound, routed and outbound rows for those instead (its
    routed and outbound rows find their connection through their inbound row, hot or archived).
    Each such connection is its own pass; the stage's default pass skips every overridden one.
    """
    ages = _ages(older_than_seconds)
    overrides = {name: _ages(per, keys=TABLE_KEYS) for name, per in (connections or {}).items()}
    if any("," in name for name in overrides):
        raise ValueError(f"a connection name must not contain ',': {sorted(overrides)}")
    counts: dict[str, int] = {}
    copied: dict[str, int] = {}
    if "inbound" in ages:
        ages[BATCHES] = ages["inbound"]
    # downstream first: an inbound row waits for its routed rows, and for outbound rows that send
    # its body (pass-through rows have none of their own), so those go in the same run
    steps = [(t.key, t.purge) for t in reversed(STAGED_TABLES)] + [(EVENTS, "purge_events")]
    steps.insert(
        steps.index((INBOUND.key, INBOUND.purge)) + 1,  # after the inbound rows it waits for
        (BATCHES, "purge_inbound_batches"),
    )
    for key, purge in steps:
        for age, scope in _passes(key, ages, overrides):

            def delete(purge: str = purge, age: float = age, scope: Mapping[str, Any] | None = scope) -> int:
                return _purge(store, purge, epoch=epoch, age=age, limit=batch, archived=archive, scope=scope)

            if archive:

                def copy(key: str = key, age: float = age, scope: Mapping[str, Any] | None = scope) -> int:
                    return _purge(store, ARCHIVE_QUERIES[key], epoch=epoch, age=age, limit=batch, scope=scope)

                n_copied, n_deleted = _copy_then_delete(copy, delete, limit=batch, max_batches=max_batches)
                copied[key] = copied.get(key, 0) + n_copied
            else:
                n_deleted = _batches(delete, limit=batch, max_batches=max_batches)
            counts[key] = counts.get(key, 0) + n_deleted
    if not archive and "inbound" in ages:  # archived messages keep their keys, wherever they go next
        youngest = min([ages["inbound"], *(per["inbound"] for per in overrides.values() if "inbound" in per)])
        purged = purge_keys(store, epoch, older_than_seconds=youngest, limit=batch, max_batches=max_batches)
        if purged:
            counts[KEYS] = purged
    if archived is not None:
        archived.update(copied)
    if any(counts.values()) or any(copied.values()):
        log.info("retention under epoch %s archived %s, deleted %s", epoch, copied, counts)
    return counts


TABLE_KEYS = tuple(t.key for t in STAGED_TABLES)
"""The staged tables' retention keys (`inbound`, `routed`, `outbound`): per-connection ones apply to these."""


def _passes(
    key: str, ages: Mapping[str, float], overrides: Mapping[str, Mapping[str, float]]
) -> list[tuple[float, dict[str, Any] | None]]:
    """The (age, connection scope) passes of one retention key: one per connection with its own age
    for a stage (`within` 1: only its rows), then the default one skipping those (`within` 0).
    The scope is None for the keys that are not per connection (events, batches)."""
    if key not in TABLE_KEYS:
        return [(ages[key], None)] if key in ages else []
    own = sorted(name for name, per in overrides.items() if key in per)
    passes: list[tuple[float, dict[str, Any] | None]] = [
        (overrides[name][key], {"conns": f",{name},", "within": 1}) for name in own
    ]
    if key in ages:
        passes.append((ages[key], {"conns": "," + "".join(f"{name}," for name in own), "within": 0}))
    return passes


def _ages(older_than_seconds: float | Mapping[str, float], *, keys: tuple[str, ...] | None = None) -> dict[str, float]:
    known = list(keys) if keys is not None else [t.key for t in STAGED_TABLES] + [EVENTS]
    if isinstance(older_than_seconds, Mapping):
        unknown = sorted(set(older_than_seconds) - set(known))
        if unknown:
            raise ValueError(f"unknown retention key(s) {unknown}; known: {known}")
        ages = {k: float(v) for k, v in older_than_seconds.items()}
    else:
        ages = dict.fromkeys(known, float(older_than_seconds))
    negative = sorted(k for k, v in ages.items() if v < 0)
    if negative:
        raise ValueError(f"retention must not be negative: {negative}")
    return ages


def _batches(step: Callable[[], int], *, limit: int, max_batches: int) -> int:
    """Repeat `step` (one transaction, returns rows done) until a short batch or the cap."""
    total = 0
    for _ in range(max_batches):
        done = step()
        total += done
        if done < limit:
            break
    return total


def _copy_then_delete(
    copy: Callable[[], int], delete: Callable[[], int], *, limit: int, max_batches: int
) -> tuple[int, int]:
    """Archive batches, each followed by a purge batch, until both come back short or the cap.

    Purging as it goes keeps each copy's scan short: a copy finds its next rows as the oldest hot
    ones not yet archived, so with every purge left to the end, batch n walked past the n - 1
    batches this run had already copied (bench/growth.py --retention: the events' copy went from
    35 ms for the first batch to 1,145 ms for the 120th). Each step is still its own transaction
    and a purge still deletes only what the archive holds, so a run killed between the two has
    copied rows it did not purge, which the next run purges without copying them again."""
    copied = deleted = 0
    for _ in range(max_batches):
        c = copy()
        d = delete()
        copied += c
        deleted += d
        if c < limit and d < limit:
            break
    return copied, deleted


def _sweep(store: Store, table: StagedTable, *, epoch: int, owner: str, limit: int) -> int:
    with store.transaction() as tx:
        return rowlease.sweep_expired(
            tx, table, owner=owner, epoch=epoch, limit=limit, max_attempts=rowlease.reclaim_cap(table)
        )


def _purge(
    store: Store,
    query: str,
    *,
    epoch: int,
    age: float,
    limit: int,
    archived: bool | None = None,
    scope: Mapping[str, Any] | None = None,
) -> int:
    """One batch of a retention query (an archive copy or a purge); it returns the ids (batch ids) it
    wrote or deleted (a row count is not portable through a statement that also deletes the rows' bodies)."""
    params = {"epoch": epoch, "ms": int(age * 1000), "limit": int(limit)}
    if archived is not None:
        params["archived"] = int(archived)
    if scope is not None:
        params.update(scope)
    with store.transaction() as tx:
        tx.fence()
        return len(tx.all(query, params))
