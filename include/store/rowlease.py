"""Row-lease primitives the stage jobs use, each fenced by the leader epoch.

A claim moves rows `pending|error → in_flight`, stamping the claimer, the epoch and a row lease
(DB_now + `[store].lease_ttl_seconds`). Finishing or failing a claimed row only lands while that
epoch is still the lease's current one and the row is still ours; otherwise nothing changes.
Rows of a dead claimer come back two ways: at once on promotion (every row claimed under an older
epoch, lease-blind, once per epoch) and by the recurring sweep of expired row leases.

Each function takes an open `Tx` so a caller can compose it with its own writes (the Spark
finalize moves landed rows and finishes the sources in one transaction). Claims are not audited
row by row — the row itself carries owner, epoch and attempts, and the finishing event records
them; every other transition appends to `message_events`.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any, NamedTuple

from include.store.db import OUTBOUND, STAGED_TABLES, StagedTable, Store, Tx

Row = dict[str, Any]
FINAL_STATUSES = ("done", "dead", "unrouted")
SWEEP_MAX_ATTEMPTS = 10
"""Claims after which the sweep dead-letters an expired row instead of re-pending it."""
NO_LIMIT = 2**31 - 1
UNLIMITED_ATTEMPTS = NO_LIMIT


def reclaim_cap(table: StagedTable) -> int:
    """Claims after which a row taken back from a dead claimer is dead-lettered instead.

    Outbound rows are retried per their destination's max_attempts (the deliver stage); only the
    stages whose failures are whole crashed jobs (a poison batch) are capped here.
    """
    return UNLIMITED_ATTEMPTS if table is OUTBOUND else SWEEP_MAX_ATTEMPTS


def claim_batch(
    tx: Tx, table: StagedTable, *, owner: str, epoch: int, limit: int, lease_seconds: float | None = None
) -> list[Row]:
    """Claim up to `limit` due rows in id order, skipping rows another claimer holds — and rows
    whose lane has an earlier row in flight or backing off.

    So a batch stranded by a dead job holds its lanes until it is re-pended, and the next stage's
    rows (and finally the deliveries) keep lane order across crashes and failover (invariant 6,
    docs/invariants.md). Rows with a NULL lane never wait. Lane order holds for one claimer per
    stage at a time (each stage DAG runs one run at a time); concurrent claimers are safe — nothing
    is claimed twice — but may interleave a lane's rows.
    """
    tx.fence()
    return _by_id(
        tx.all(
            "claim_batch",
            {"owner": owner, "epoch": epoch, "limit": int(limit), "lease_seconds": _lease(tx, lease_seconds)},
            table=table,
        )
    )


def claim_lane_heads(
    tx: Tx,
    table: StagedTable,
    *,
    owner: str,
    epoch: int,
    limit: int,
    lease_seconds: float | None = None,
    per_lane: int = 1,
    max_rows: int = NO_LIMIT,
) -> list[Row]:
    """Claim the head — or the first `per_lane` rows — of up to `limit` lanes (per-lane FIFO),
    at most `max_rows` rows in all (round-robin over the lanes, each lane keeps a prefix).

    A lane's head is its oldest unfinished row; a lane is cut before its first row in flight
    elsewhere or waiting out its backoff, so such a row blocks only its own lane. Expired in-flight
    rows are re-pended first in the same transaction, so a crashed leader's stranded head is
    retried before anything newer in its lane. The caller must send a lane's rows in id order and
    stop at the first failure (`release_batch` the rest).
    """
    sweep_expired(tx, table, owner=owner, epoch=epoch, limit=1_000_000, max_attempts=UNLIMITED_ATTEMPTS)
    tx.fence()
    return _by_id(
        tx.all(
            "claim_lane_heads",
            {
                "owner": owner,
                "epoch": epoch,
                "limit": int(limit),
                "per_lane": int(per_lane),
                "max_rows": int(max_rows),
                "lease_seconds": _lease(tx, lease_seconds),
            },
            table=table,
        )
    )


def release_batch(tx: Tx, table: StagedTable, ids: list[int], *, owner: str, epoch: int) -> list[int]:
    """Hand claimed rows back as pending without counting the attempt (never tried); ids released."""
    if not ids:
        return []
    tx.fence()
    rows = tx.all("release_batch", {"ids": tx.dialect.id_list(ids), "owner": owner, "epoch": epoch}, table=table)
    return sorted(int(r["id"]) for r in rows)


def finish_batch(
    tx: Tx,
    table: StagedTable,
    ids: list[int],
    *,
    owner: str,
    epoch: int,
    status: str = "done",
    error: str | None = None,
) -> list[int]:
    """Mark claimed rows finished; returns the ids that landed (none under a stale epoch)."""
    if status not in FINAL_STATUSES:
        raise ValueError(f"finish status must be one of {FINAL_STATUSES}, got {status!r}")
    if not ids:
        return []
    tx.fence()
    rows = _out_of_flight(
        tx,
        "finish_batch",
        {"ids": tx.dialect.id_list(ids), "owner": owner, "epoch": epoch, "status": status, "error": error},
        table=table,
        event=status,
        owner=owner,
        epoch=epoch,
        ids_only=True,
    )
    return sorted(int(r["id"]) for r in rows)


def fail_batch(
    tx: Tx,
    table: StagedTable,
    ids: list[int],
    *,
    owner: str,
    epoch: int,
    error: str,
    max_attempts: int,
    backoff_seconds: float = 1.0,
    max_backoff_seconds: float = 300.0,
) -> list[Row]:
    """Record a failed attempt: `error` with exponential backoff, or `dead` after `max_attempts`."""
    if not ids:
        return []
    tx.fence()
    rows = _out_of_flight(
        tx,
        "fail_batch",
        {
            "ids": tx.dialect.id_list(ids),
            "owner": owner,
            "epoch": epoch,
            "error": error,
            "max_attempts": int(max_attempts),
            "backoff_seconds": float(backoff_seconds),
            "max_backoff_seconds": float(max_backoff_seconds),
        },
        table=table,
        event="attempt_failed",
        owner=owner,
        epoch=epoch,
    )
    return _by_id(rows)


def sweep_expired(
    tx: Tx, table: StagedTable, *, owner: str, epoch: int, limit: int = 1000, max_attempts: int = SWEEP_MAX_ATTEMPTS
) -> int:
    """Re-pend in-flight rows whose row lease expired (the recurring, lease-gated sweep).

    A row that has already been claimed `max_attempts` times goes to `dead` instead: a batch that
    kills every job that claims it (a poison message) must not be retried forever.
    """
    tx.fence()
    rows = _out_of_flight(
        tx,
        "sweep_expired",
        {"epoch": epoch, "limit": int(limit), "max_attempts": int(max_attempts)},
        table=table,
        event="lease_expired",
        owner=owner,
        epoch=epoch,
    )
    return len(rows)


def renew_claims(tx: Tx, table: StagedTable, *, owner: str, epoch: int, lease_seconds: float | None = None) -> int:
    """Extend the row lease of every row `owner` holds under `epoch`; how many were renewed.

    A live claimer calls this well within its lease, so its rows never expire under a long batch
    and the lease itself can be short: a claimer that dies stops renewing, and its rows are due
    again one short lease later. Fenced: under a stale epoch nothing is renewed.
    """
    tx.fence()
    return tx.execute(
        "renew_claims", {"owner": owner, "epoch": epoch, "lease_seconds": _lease(tx, lease_seconds)}, table=table
    )


def recover_abandoned(
    tx: Tx,
    table: StagedTable,
    *,
    prefix: str,
    keep: str,
    epoch: int,
    owner: str,
    max_attempts: int = SWEEP_MAX_ATTEMPTS,
) -> int:
    """Re-pend, lease-blind, the rows claimed by owners starting with `prefix` except those
    starting with `keep` (the caller's own); how many.

    Owner-scoped recovery for claimers known to have ended: a stage task passes its DAG's owner
    prefix and its own, because Airflow starts a stage task only after the previous one ended.
    Fenced; a row already claimed `max_attempts` times goes to `dead`, as with the sweep.
    """
    tx.fence()
    rows = _out_of_flight(
        tx,
        "recover_abandoned",
        {"prefix": prefix, "keep": keep, "epoch": epoch, "max_attempts": int(max_attempts)},
        table=table,
        event="recovered",
        owner=owner,
        epoch=epoch,
    )
    return len(rows)


def recover_on_promotion(tx: Tx, *, owner: str, epoch: int) -> int | None:
    """Re-pend every row claimed under an older epoch, once per epoch.

    Lease-blind by design: the previous leader has provably stopped (it fenced itself before its
    lease expired), so its rows need not wait out their row leases. Returns the number recovered, or
    None when this epoch already ran its recovery or is no longer current.
    """
    # Lease row first, then the fence: the same order as an acquisition, so the two cannot deadlock.
    if tx.one("recovery_mark", {"epoch": epoch}) is None:
        return None
    tx.fence()
    total = 0
    for table in STAGED_TABLES:
        rows = _out_of_flight(
            tx, "recover_stale_epoch", {"epoch": epoch}, table=table, event="recovered", owner=owner, epoch=epoch
        )
        total += len(rows)
    return total


Staged = dict[str, int] | None
"""What staging gave: {message_id: row id} for the rows written, or None when the epoch was stale."""


ONE_STATEMENT_STAGING = ("stage_inbound", "stage_inbound_one", "epoch_current", "stage_inbound_resent")
"""The only statements `staging` runs where the dialect's staging is self-contained
(`Dialect.atomic_staging`): the staging statement itself, and the epoch check after it (the
re-send's, `stage_inbound_resent`, where the dialect has one)."""


class Statement(NamedTuple):
    """One named query `staging` wants run, its parameters, and whether its rows are read back."""

    name: str
    params: dict[str, Any]
    table: StagedTable | None = None
    reads: bool = True


def stage_inbound(tx: Tx, messages: list[Row], *, epoch: int, node_id: str) -> Staged:
    """Stage received messages under `epoch` (the listener's group commit) in `tx`: `staging`'s
    statements, run in this one transaction."""
    steps = staging(tx.store, messages, epoch=epoch, node_id=node_id)
    result: list[Row] | int | None = None
    try:
        while True:
            step = steps.send(result)
            if step.reads:
                result = tx.all(step.name, step.params, table=step.table)
            else:
                result = tx.execute(step.name, step.params, table=step.table)
    except StopIteration as done:
        staged: Staged = done.value
        return staged


def staging(
    store: Store,
    messages: list[Row],
    *,
    epoch: int,
    node_id: str,
) -> Generator[Statement, Any, Staged]:
    """The statements that stage received messages under `epoch`, without a connection: yields
    each `Statement` and is sent back the rows it returned (a list of dicts, as the store's
    cursors give them); returns `Staged`. Both writers drive it: `stage_inbound` in one
    transaction, and on PostgreSQL `listeners.pgcommit` on its own connection, one statement at a
    time in autocommit — which is sound only because there the staging statement is
    self-contained (`Dialect.atomic_staging`) and the epoch check after it only reads (or, after
    a re-send that wrote nothing, writes a marker so that its commit waits for the standby).

    `messages`: dicts with message_id, control_id, connection, lane_key, charset, payload (and
    optionally findings, format); a
    batch's messages also carry batch_id and batch_seq (from 1), and its first one the batch's
    record (batch_size, batch_fhs, batch_bhs, batch_declared), written to `inbound_batches` in the
    same transaction: a batch lands whole or not at all. A message_id already staged is skipped,
    which makes re-reading a file after a crash harmless. Under a stale epoch nothing is written.
    The epoch is checked by the insert itself rather than under the fence lock: an inbound row
    staged just as leadership moved is still a durable, valid message, and skipping the lock saves
    the hot path a round trip. PostgreSQL writes the bodies (`inbound_bodies`) and the audit events
    in the same statement; elsewhere they follow, in the same transaction. A lone message outside
    a batch takes the dialect's `stage_inbound_one` where it has one (PostgreSQL: the same
    statement without the JSON).
    """
    if not messages:
        return {} if (yield Statement("epoch_current", {"epoch": epoch})) else None
    lone = lone_message(messages) if store.has_query("stage_inbound_one") else None
    if lone is not None:  # its statement writes bodies and events itself: no JSON wanted below
        batch = ""
        optional = {"findings": None, "format": None}  # a caller's row may leave them out
        rows = yield Statement("stage_inbound_one", {**optional, **lone, "epoch": epoch, "node_id": node_id})
    else:
        batch = json.dumps(messages)
        rows = yield Statement("stage_inbound", {"messages": batch, "epoch": epoch, "node_id": node_id})
    if not rows:  # stale epoch, or every message was a re-delivery of one already staged
        # PostgreSQL: a check whose commit waits for the synchronous standby, as the first copy's
        # may not have (`stage_inbound_resent`); an AA for a re-send must mean two servers too.
        check = "stage_inbound_resent" if store.has_query("stage_inbound_resent") else "epoch_current"
        return {} if (yield Statement(check, {"epoch": epoch})) else None
    ids = store.dialect.id_list([r["id"] for r in rows])
    if not rows[0]["bodies_written"]:
        yield Statement("stage_inbound_bodies", {"messages": batch, "ids": ids}, reads=False)
        if any(m.get("batch_id") is not None for m in messages):  # its first message carries the record
            yield Statement("stage_inbound_batches", {"messages": batch}, reads=False)
    if not rows[0]["events_recorded"]:
        # After the batch record: a batch message's event names its batch, a message of a large
        # batch's later part (listeners/commitplan.py) too, from the record its first part wrote.
        yield Statement("stage_inbound_events", {"ids": ids, "epoch": epoch, "node_id": node_id}, reads=False)
    return {r["message_id"]: int(r["id"]) for r in rows}


def lone_message(messages: list[Row]) -> Row | None:
    """The message `stage_inbound_one` may take in place of `stage_inbound`: the only one, outside
    a batch, with text a plain UTF-8 parameter can carry. A NUL or an unpaired surrogate (which
    validation refuses before this) goes the general way, as JSON, where the server refuses it
    for its data; as a text parameter libpq would cut a NUL short, and a surrogate cannot be
    encoded at all."""
    if len(messages) != 1:
        return None
    message = messages[0]
    if message.get("batch_id") is not None or not all(_plain_text(v) for v in message.values()):
        return None
    return message


def _plain_text(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if "\x00" in value:
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _out_of_flight(
    tx: Tx,
    name: str,
    params: dict[str, Any],
    *,
    table: StagedTable,
    event: str,
    owner: str,
    epoch: int,
    ids_only: bool = False,
) -> list[Row]:
    """Run transition `name`, which moves in-flight rows of `table`, auditing each move as `event`
    by `owner` under `epoch` (the caller has fenced)."""
    return tx.transition(
        name, params, table=table, event=event, from_status="in_flight", epoch=epoch, node_id=owner, ids_only=ids_only
    )


def _lease(tx: Tx, lease_seconds: float | None) -> float:
    return float(lease_seconds if lease_seconds is not None else tx.store.config.lease_ttl_seconds)


def _by_id(rows: list[Row]) -> list[Row]:
    """RETURNING/OUTPUT order is unspecified; callers get id (arrival) order."""
    return sorted(rows, key=lambda r: r["id"])
