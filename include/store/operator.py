"""What an operator does with messages: find them, show one's whole story, replay, requeue dead
letters, see the dead letters and the stages at a glance (`stageline messages …`, `stageline stages`).

Every change an operator makes is a new attempt, never a rewrite of history, and is itself an audit
event in `message_events` naming who (`node_id` = `operator:<actor>`) and why (`detail`):

- *replay from inbound* stages the message again as a new inbound row (its own message id,
  `<original>~replay-<n>`) with the same body, connection, lane and control id, so today's routes,
  transforms and destinations apply; being new it goes behind whatever is queued in its lane.
- *replay from outbound* and *requeue* put existing rows back to pending (attempts reset) with the
  same body and idempotency key: the row keeps its place in its lane, so a requeued dead lane
  drains in its original order — which is what a receiver that missed those messages needs.
- there is no replay *from routed*: a routed row's transform result is its outbound row; replay
  from inbound (today's routes and transforms) or from outbound (the same bytes again).

Nothing here needs the leader lease: the rows it touches are finished (`done`/`dead`), which no
stage task claims; the rows it creates are claimed like any other, under the claimer's epoch.

Bodies are PHI, read on purpose and on the record: `show` gives a message's metadata (what `find`
lists, its stage rows and its trail) without any body unless it is given a `reader`, and then
writes a `body_read` event (who, via which surface, on the store's clock) before it returns one.
A store that cannot record the read gives no body.

Patient identifiers in metadata are masked for a reader without the body permission: a lane key
(usually PID-3, the MRN) becomes ``lane:`` and 12 hex digits of an HMAC under a key of the
serving process (`LaneMask`), so rows of one lane still group together but the MRN cannot be
read, nor guessed by hashing candidate MRNs. The control id (MSH-10, a message's id, not a
patient's) stays.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from include.store.db import INBOUND, OUTBOUND, ROUTED, STAGED_TABLES, StagedTable, Store

if TYPE_CHECKING:
    from include.store.parquet_archive import ParquetArchive

FIND_LIMIT = 50
MAX_FIND_LIMIT = 1000
"""The most rows one `find` returns; a larger `limit` is refused (400 on the API), page on with `before_id`."""
MAX_TIME_MS = 253_402_300_799_999
"""9999-12-31T23:59:59.999Z: the largest time filter accepted (a bigger one is a typo, not a date)."""
MAX_ROW_ID = 2**63 - 1
BODY_FIELDS = ("payload",)
"""The fields of a message row that are content (PHI): the inbound body and every transformed or
delivered body. Withheld from a reader without the body permission."""
BODY_READ = "body_read"
"""The audit event of one read of a message's bodies."""
REPLAY_FROM = ("inbound", "outbound")
STATUSES = ("pending", "in_flight", "done", "error", "dead", "unrouted")


LANE_FIELDS = frozenset({"lane_key", "key_value"})
"""Metadata fields that name a patient (a lane key is usually PID-3, the MRN; a business key's value,
`include.store.keys`): masked by `LaneMask` for a reader without the body permission."""


class LaneMask:
    """Replaces every lane key in a document with ``lane:<12 hex>``, an HMAC-SHA256 of it under a
    random key that never leaves this object (one per serving process): equal lanes give equal
    masks, so a viewer can still group a lane's messages, but no one can get the MRN back or test a
    guessed one without the key. Masks change when the process restarts and differ between nodes."""

    PREFIX = "lane:"

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)

    def digest(self, lane: str) -> str:
        return self.PREFIX + hmac.new(self._key, str(lane).encode(), hashlib.sha256).hexdigest()[:12]

    def apply(self, doc: Any) -> Any:
        """`doc` (dicts, lists and dataclass-free JSON values) with each `LANE_FIELDS` value masked."""
        if isinstance(doc, dict):
            return {
                k: (self.digest(v) if k in LANE_FIELDS and v is not None else self.apply(v)) for k, v in doc.items()
            }
        if isinstance(doc, (list, tuple)):
            return [self.apply(v) for v in doc]
        return doc


@dataclass(frozen=True)
class Filters:
    """What `find` narrows by; None is "any"."""

    control_id: str | None = None
    message_id: str | None = None
    lane_key: str | None = None
    connection: str | None = None
    destination: str | None = None
    status: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    before_id: int | None = None
    limit: int = FIND_LIMIT

    @classmethod
    def from_query(cls, args: Mapping[str, str]) -> Filters:
        """Filters from a query string's fields (`control_id=…&status=dead&limit=20`); empty ones are
        "any", unknown ones ignored (listenerd's `GET /messages`, the Airflow UI's Stageline view)."""
        fields = ("control_id", "message_id", "lane_key", "connection", "destination", "status")
        texts: dict[str, Any] = {k: args[k] for k in fields if args.get(k)}
        try:
            ints: dict[str, Any] = {
                k: int(args[k]) for k in ("since_ms", "until_ms", "before_id", "limit") if args.get(k)
            }
        except ValueError as exc:
            raise ValueError(f"not a number: {exc}") from None
        return cls(**texts, **ints)

    def params(self) -> dict[str, Any]:
        """The statement's parameters; ValueError for a status not known or a number out of range
        (`limit` 1..MAX_FIND_LIMIT, times 0..year 9999, ids 1..2^63-1), so no figure reaches the store
        that would make it read or return more than a page."""
        if self.status is not None and self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        check_page(self.limit, self.since_ms, self.until_ms, self.before_id)
        return dict(self.__dict__)


def check_page(limit: int, since_ms: int | None, until_ms: int | None, before_id: int | None) -> None:
    """ValueError for a page of a search out of range: `limit` 1..MAX_FIND_LIMIT, times 0..year 9999,
    ids 1..2^63-1 (`Filters`, a search by key)."""
    if not 1 <= limit <= MAX_FIND_LIMIT:
        raise ValueError(f"limit must be 1..{MAX_FIND_LIMIT} (page on with before_id), got {limit}")
    for name, value in (("since_ms", since_ms), ("until_ms", until_ms)):
        if value is not None and not 0 <= value <= MAX_TIME_MS:
            raise ValueError(f"{name} must be 0..{MAX_TIME_MS} (epoch milliseconds), got {value}")
    if before_id is not None and not 1 <= before_id <= MAX_ROW_ID:
        raise ValueError(f"before_id must be 1..{MAX_ROW_ID}, got {before_id}")


@dataclass
class Story:
    """One message in every stage: the inbound row and body, its routed and outbound rows (bodies as
    delivered), and its whole audit trail — replays of it included."""

    inbound: dict[str, Any]
    routed: list[dict[str, Any]] = field(default_factory=list)
    outbound: list[dict[str, Any]] = field(default_factory=list)
    trail: list[dict[str, Any]] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)
    """The micro-batches (stage_batches) that wrote its events: which Airflow DAG run and try moved it."""
    hl7_batch: dict[str, Any] | None = None
    """The HL7 batch it came in (`inbound_batches`, or retention's archive of it; `archived_ms` says
    which), when it came in one; its place in it is `inbound["batch_seq"]`."""
    keys: list[dict[str, Any]] = field(default_factory=list)
    """Its business keys (`include.store.keys`): name and key_value, by name."""


def find(store: Store, filters: Filters) -> list[dict[str, Any]]:
    """Inbound messages matching `filters`, newest first (page on with `before_id` = the last id)."""
    with store.transaction(write=False) as tx:
        return tx.all("messages_find", filters.params())


def resolve(store: Store, ref: str, *, parquet: ParquetArchive | None = None) -> int:
    """The inbound row id named by `ref`: a row id, a message id or a control id (the newest with
    it), in the hot tables first, then in retention's archive tables, then in the Parquet archive
    (`parquet`, when given; looked up through the store's index). LookupError if none."""
    parquet = parquet.indexed(store) if parquet is not None else None
    if ref.isdigit():
        with store.transaction(write=False) as tx:
            if (
                tx.one("message_inbound", {"id": int(ref)}) is not None
                or tx.one("archived_inbound", {"id": int(ref)}) is not None
            ):
                return int(ref)
    with store.transaction(write=False) as tx:  # each an index probe: an unknown ref reads no table
        for name in ("inbound_ref_by_message_id", "inbound_ref_by_control_id", "archived_inbound_ref"):
            row = tx.one(name, {"ref": ref})
            if row and row["id"] is not None:
                return int(row["id"])
    found = parquet.inbound(ref) if parquet is not None else None
    if found is not None:
        return int(found["id"])
    raise LookupError(f"no message {ref!r} (tried row id, message id and control id, hot and archived)")


def _merged(
    hot: list[dict[str, Any]], archived: list[dict[str, Any]], parquet: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Hot rows, archived ones and those in Parquet by id; a row in more than one (archived, not yet
    purged) shows as the hottest. An archived row carries `archived_ms`; a hot one None."""
    rows = {r["id"]: {**r, "archived_ms": None} for r in hot}
    for r in [*archived, *(parquet or [])]:
        rows.setdefault(r["id"], r)
    return [rows[k] for k in sorted(rows)]


@dataclass(frozen=True)
class Reader:
    """Who reads a message's bodies, for the audit event: `who` (a token's entry, an Airflow user, an
    OS user) through `surface` (`api`, `airflow`, `cli`)."""

    who: str
    surface: str

    @property
    def actor(self) -> str:
        return f"reader:{self.surface} {self.who}"[:400]


def show(
    store: Store, inbound_id: int, *, parquet: ParquetArchive | None = None, reader: Reader | None = None
) -> Story:
    """One message's whole story, from the hot tables, retention's archive tables and the Parquet
    archive (`parquet`, when given) alike: a message whose rows and events were archived, purged
    and moved to Parquet reads the same as one still hot.

    Without `reader` the story has no body (`BODY_FIELDS` removed from every row: metadata only).
    With one, a `body_read` event naming the reader is committed first, then the bodies returned."""
    story = _story(store, inbound_id, parquet=parquet.indexed(store) if parquet is not None else None)
    if reader is None:
        return without_bodies(story)
    record_body_read(store, story.inbound, reader)
    return story


def without_bodies(story: Story) -> Story:
    """`story` with every body field removed (the inbound row's, each outbound row's)."""

    def strip(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k not in BODY_FIELDS}

    return Story(
        strip(story.inbound),
        [strip(r) for r in story.routed],
        [strip(o) for o in story.outbound],
        list(story.trail),
        list(story.batches),
        story.hl7_batch,
        list(story.keys),
    )


def record_body_read(store: Store, inbound: Mapping[str, Any], reader: Reader) -> None:
    """Commit one `body_read` event for the message `inbound` (its row as `show` read it)."""
    with store.transaction() as tx:
        tx.execute(
            "body_read_event",
            {
                "id": int(inbound["id"]),
                "message_id": inbound["message_id"],
                "control_id": inbound.get("control_id"),
                "status": inbound.get("status") or "unknown",
                "actor": reader.actor,
                "detail": f"bodies read via {reader.surface}",
            },
        )


def _story(store: Store, inbound_id: int, *, parquet: ParquetArchive | None = None) -> Story:
    with store.transaction(write=False) as tx:
        inbound = tx.one("message_inbound", {"id": inbound_id})
        inbound = (
            {**inbound, "archived_ms": None} if inbound is not None else tx.one("archived_inbound", {"id": inbound_id})
        )
        if inbound is None and parquet is not None:
            inbound = parquet.inbound(inbound_id)
        if inbound is None:
            raise LookupError(f"no inbound row {inbound_id}")
        story = Story(
            inbound,
            _merged(
                tx.all("message_routed", {"id": inbound_id}),
                tx.all("archived_routed", {"id": inbound_id}),
                parquet.routed(inbound_id) if parquet is not None else None,
            ),
            _merged(
                tx.all("message_outbound", {"id": inbound_id}),
                tx.all("archived_outbound", {"id": inbound_id}),
                parquet.outbound(inbound_id) if parquet is not None else None,
            ),
            _merged(
                tx.all("message_trail", {"message_id": inbound["message_id"]}),
                tx.all("archived_trail", {"message_id": inbound["message_id"]}),
                parquet.trail(inbound["message_id"]) if parquet is not None else None,
            ),
        )
        story.keys = tx.all("keys_of_message", {"id": inbound_id})
        owners = sorted({e["node_id"] for e in story.trail if (e["node_id"] or "").startswith("airflow:")})
        if owners:
            story.batches = tx.all("batches_by_owner", {"owners": tx.dialect.text_list(owners)})
        if inbound.get("batch_id") is not None:  # hot while any of its messages is, then archived
            key = {"batch_id": inbound["batch_id"]}
            story.hl7_batch = (
                tx.one("message_batch", key)
                or tx.one("archived_batch", key)
                or (parquet.hl7_batch(inbound["batch_id"]) if parquet is not None else None)
            )
        return story


def replay(store: Store, inbound_ids: list[int], *, source: str, actor: str, reason: str) -> list[int]:
    """Replay messages from `source` (`inbound`: a new inbound row each; `outbound`: their finished
    deliveries back to pending). Returns the new inbound row ids, or the outbound row ids requeued."""
    if source not in REPLAY_FROM:
        raise ValueError(
            f"replay --from must be one of {', '.join(REPLAY_FROM)} (see `stageline messages "
            f"replay --help`), got {source!r}"
        )
    if source == "outbound":
        with store.transaction(write=False) as tx:
            ids = [int(o["id"]) for i in inbound_ids for o in tx.all("message_outbound", {"id": i})]
        return requeue(store, OUTBOUND, ids, actor=actor, reason=reason, statuses=("done", "dead"), event="replayed")
    created: list[int] = []
    with store.transaction() as tx:
        for inbound_id in inbound_ids:
            original = tx.one("message_inbound", {"id": inbound_id})
            if original is None:
                raise LookupError(f"no inbound row {inbound_id}")
            n = 1 + sum(
                1
                for e in tx.all("message_trail", {"message_id": original["message_id"]})
                if e["event"] == "replayed" and e["stage"] == "inbound"
            )
            new_message_id = f"{original['message_id']}~replay-{n}"
            [row] = tx.all("replay_inbound", {"id": inbound_id, "new_message_id": new_message_id})
            tx.execute("replay_inbound_body", {"id": inbound_id, "new_id": row["id"]})
            _events(
                tx,
                INBOUND,
                [inbound_id],
                event="replayed",
                from_status=original["status"],
                actor=actor,
                detail=f"as {new_message_id} (row {row['id']}): {reason}",
            )
            _events(
                tx,
                INBOUND,
                [int(row["id"])],
                event="staged",
                from_status=None,
                actor=actor,
                detail=f"replay of {original['message_id']} (row {inbound_id}): {reason}",
            )
            created.append(int(row["id"]))
    return created


def dead_ids(
    store: Store, table: StagedTable, *, destination: str | None = None, lane_key: str | None = None
) -> list[int]:
    with store.transaction(write=False) as tx:
        return [
            int(r["id"]) for r in tx.all("dead_ids", {"destination": destination, "lane_key": lane_key}, table=table)
        ]


def requeue(
    store: Store,
    table: StagedTable,
    ids: list[int],
    *,
    actor: str,
    reason: str,
    statuses: tuple[str, ...] = ("dead",),
    event: str = "requeued",
) -> list[int]:
    """Rows of `table` among `ids` in one of `statuses` back to pending (attempts reset, same body
    and place in their lane); one audit event each. Returns the ids moved."""
    if not ids:
        return []
    with store.transaction() as tx:
        moved = [
            int(r["id"])
            for r in tx.all(
                "requeue_rows",
                {"ids": tx.dialect.id_list(ids), "statuses": tx.dialect.text_list(statuses)},
                table=table,
            )
        ]
        _events(tx, table, moved, event=event, from_status="/".join(statuses), actor=actor, detail=reason)
    return sorted(moved)


def requeue_dead(
    store: Store,
    stage: str,
    *,
    ids: list[int] | None = None,
    destination: str | None = None,
    lane_key: str | None = None,
    actor: str,
    reason: str,
) -> list[int]:
    """Dead letters of `stage` back to pending: the rows `ids`, else every dead letter of
    `destination` and/or `lane_key` (one of them is required). Returns the ids moved."""
    table = table_of(stage)
    if not ids and not (destination or lane_key):
        raise ValueError("name the dead letters: ids, destination or lane")
    chosen = list(ids or []) or dead_ids(store, table, destination=destination or None, lane_key=lane_key or None)
    return requeue(store, table, chosen, actor=actor, reason=reason)


def dead_letters(store: Store) -> list[dict[str, Any]]:
    """Dead letters grouped by stage, destination and reason, the biggest group first. A reason
    naming the message's own control id ("AE for MSG0042") is grouped with its siblings'."""
    with store.transaction(write=False) as tx:
        rows = tx.all("dead_letters")
    groups: dict[tuple[str, str | None, str], dict[str, Any]] = {}
    for row in rows:
        reason = row["reason"] or ""
        if row["control_id"]:
            reason = reason.replace(row["control_id"], "<control id>")
        key = (row["stage"], row["destination"], reason)
        group = groups.setdefault(
            key,
            {
                "stage": row["stage"],
                "destination": row["destination"],
                "reason": reason,
                "n": 0,
                "oldest_ms": row["updated_ms"],
            },
        )
        group["n"] += 1
        group["oldest_ms"] = min(group["oldest_ms"], row["updated_ms"])
    return sorted(groups.values(), key=lambda g: (-g["n"], g["stage"], g["destination"] or "", g["reason"]))


def stages(store: Store, *, window_seconds: float = 300.0) -> dict[str, dict[str, Any]]:
    """Per stage: backlog, oldest pending age (s), in flight, dead, finished per minute lately."""
    out: dict[str, dict[str, Any]] = {}
    with store.transaction(write=False) as tx:
        for table in STAGED_TABLES:
            row = tx.one("stage_overview", {"window_ms": int(window_seconds * 1000)}, table=table) or {}
            oldest = row.get("oldest_ms")
            out[table.key] = {
                "backlog": int(row.get("backlog") or 0),
                "oldest_pending_seconds": round((int(row["now_ms"]) - int(oldest)) / 1000, 1) if oldest else None,
                "in_flight": int(row.get("in_flight") or 0),
                "dead": int(row.get("dead") or 0),
                "finished_per_minute": round(int(row.get("finished_recently") or 0) * 60 / window_seconds, 1),
            }
    return out


def record_batch(
    store: Store,
    *,
    stage: str,
    owner: str,
    dag_id: str,
    run_id: str,
    try_number: int,
    epoch: int | None,
    seconds: float,
    counts: dict[str, Any],
) -> None:
    """One micro-batch that claimed rows, into `stage_batches` (the Airflow UI shows one long task)."""
    with store.transaction() as tx:
        tx.execute(
            "batch_record",
            {
                "stage": stage,
                "owner": owner,
                "dag_id": dag_id,
                "run_id": run_id,
                "try_number": int(try_number),
                "epoch": epoch,
                "duration_ms": int(seconds * 1000),
                "claimed": int(counts.get("claimed") or 0),
                "counts": json.dumps(counts, default=str)[:2000],
            },
        )


MAX_BATCHES = 500
"""The most micro-batches one `recent_batches` returns; more is refused."""


def recent_batches(store: Store, *, stage: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
    """The latest `limit` (1..MAX_BATCHES) micro-batches, of `stage` or of all; ValueError past the range."""
    if not 1 <= limit <= MAX_BATCHES:
        raise ValueError(f"limit must be 1..{MAX_BATCHES}, got {limit}")
    with store.transaction(write=False) as tx:
        return tx.all("batches_recent", {"stage": stage, "limit": limit})


def table_of(stage: str) -> StagedTable:
    for table in (INBOUND, ROUTED, OUTBOUND):
        if stage in (table.key, table.name):
            return table
    raise ValueError(f"unknown stage {stage!r}: inbound, routed or outbound")


def _events(
    tx: Any, table: StagedTable, ids: list[int], *, event: str, from_status: str | None, actor: str, detail: str
) -> None:
    if ids:
        tx.execute(
            "operator_events",
            {
                "ids": tx.dialect.id_list(ids),
                "stage": table.key,
                "event": event,
                "from_status": from_status,
                "actor": f"operator:{actor}",
                "detail": detail[:2000],
            },
            table=table,
        )
