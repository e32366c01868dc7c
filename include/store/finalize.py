"""The stages' fenced finalizes: how a run's results land, all or nothing.

A stage job claims in plain SQL, lets Spark read the claimed rows and append its results to a
landing table keyed by the run, then calls a finalize here in ONE short transaction: join the
epoch fence, check the epoch, finish the sources, move their landed rows to the next stage, record
the audit events and clear the landing rows. Either all of it commits or none of it does, so a
stale leader's job lands nothing (invariant 3) and a re-run lands no duplicates (invariant 5).
The deliver stage lands no rows: its finalize turns one round's send outcomes into row states
(`finalize_deliveries`). Invariants: docs/invariants.md.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

from include.store.db import INBOUND, OUTBOUND, ROUTED, StagedTable, Store, Tx
from include.store.rowlease import fail_batch, finish_batch, release_batch


class StaleEpoch(RuntimeError):
    """The job's epoch is no longer the lease's: its results must not land."""


def check_epoch(tx: Tx, epoch: int, *, what: str, landed: str = "nothing landed") -> None:
    """Join the epoch fence and check that `epoch` is still the lease's, first in every finalize;
    StaleEpoch if not (the caller's transaction then rolls back: nothing of `what` lands)."""
    tx.fence()
    if tx.one("epoch_current", {"epoch": int(epoch)}) is None:
        raise StaleEpoch(f"{what}: epoch {epoch} is no longer current; {landed}")


@dataclass(frozen=True)
class Run:
    """One stage run as its finalize sees it: its id (its landing rows' key), the claimer and
    epoch it claimed as, and the ids it claimed. Every write of the finalize is fenced by these."""

    run_id: str
    owner: str
    epoch: int
    claimed: frozenset[int]

    @classmethod
    def of(cls, *, run_id: str, owner: str, epoch: int, claimed_ids: Iterable[int]) -> Run:
        return cls(run_id, owner, int(epoch), frozenset(int(i) for i in claimed_ids))

    def begin(self, tx: Tx) -> dict[str, Any]:
        """Join the fence and check the epoch (`check_epoch`), first; the run's query parameters."""
        check_epoch(tx, self.epoch, what=f"run {self.run_id}")
        return {"run_id": self.run_id}

    def finish(self, tx: Tx, table: StagedTable, ids: Iterable[int], status: str = "done", **kw: Any) -> list[int]:
        """`finish_batch` of those of `ids` this run claimed, as its owner and epoch; the ids finished."""
        mine = sorted(self.claimed & {int(i) for i in ids})
        return finish_batch(tx, table, mine, owner=self.owner, epoch=self.epoch, status=status, **kw)


@dataclass(frozen=True)
class BatchOutcome:
    """What one run of a batch stage changed (`finalize_landed`, `finalize_transform`); ids ascending.

    `done`: claimed rows finished, with `output` their rows in the next stage's table. `failed`:
    claimed rows the stage's transform dead-lettered (it landed them not ok), with its reason.
    `not_finished`: claimed rows this run could not finish (row lease lost, or nothing landed).
    """

    run_id: str
    claimed: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    done: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    not_finished: tuple[int, ...] = ()

    @classmethod
    def of(cls, run: Run, rows: list[dict[str, Any]], done: list[int], failed: list[int]) -> BatchOutcome:
        """The outcome of `run`'s finalize: it finished `done` and `failed` and wrote `rows`."""
        return cls(
            run_id=run.run_id,
            claimed=tuple(sorted(run.claimed)),
            output=tuple(sorted(int(r["id"]) for r in rows)),
            done=tuple(sorted(done)),
            failed=tuple(sorted(failed)),
            not_finished=tuple(sorted(run.claimed - {*done, *failed})),
        )


def dead_letter(tx: Tx, run: Run, table: StagedTable, reasons: Mapping[int, str]) -> list[int]:
    """Finish claimed rows as `dead`, each with its reason (one statement per distinct reason); the ids."""
    by_reason: dict[str, list[int]] = {}
    for i, reason in sorted(reasons.items()):
        by_reason.setdefault(reason, []).append(i)
    return sorted(f for reason, ids in by_reason.items() for f in run.finish(tx, table, ids, "dead", error=reason))


def move_on(
    tx: Tx, run: Run, query: str, params: Mapping[str, Any], ids: list[int], *, to: StagedTable, event: str, **kw: Any
) -> list[dict[str, Any]]:
    """Insert the next stage's rows (into table `to`) for the just-finished `ids` with transition
    `query`, one audit `event` each; the new rows (none when `ids` is empty; `ids_only=False`: all
    their columns)."""
    if not ids:
        return []
    params = {**params, "ids": tx.dialect.id_list(ids)}
    kw.setdefault("ids_only", True)
    return tx.transition(
        query, params, table=to, event=event, from_status=None, epoch=run.epoch, node_id=run.owner, **kw
    )


def clear_landing(tx: Tx, run: Run, landing: str, finished: Iterable[int]) -> list[int]:
    """Delete the run's rows from landing table `landing`, and earlier runs' leftovers for the
    sources it finished (runs that died between landing and finalize); the finished ids, sorted."""
    ids = sorted({int(i) for i in finished})
    tx.execute(f"{landing}_delete", {"run_id": run.run_id})
    if ids:
        tx.execute(f"{landing}_delete_sources", {"ids": tx.dialect.id_list(ids)})
    return ids


@dataclass(frozen=True)
class RouteOutcome:
    """What one route run changed; ids in ascending order.

    `not_finished`: claimed sources this run could not finish — its row lease was lost to the sweep
    (another run owns them now) or Spark landed nothing for them. They stay as they are and come
    back through the sweep; none of their landed rows moved. `outbound`: the outbound rows of
    pass-through rows, which were routed straight to `done` (`finalize_route`).
    """

    run_id: str
    claimed: tuple[int, ...] = ()
    routed: tuple[int, ...] = ()
    done: tuple[int, ...] = ()
    unrouted: tuple[int, ...] = ()
    not_finished: tuple[int, ...] = ()
    outbound: tuple[int, ...] = ()


def finalize_route(tx: Tx, run: Run, *, passthrough: Collection[str] = ()) -> RouteOutcome:
    """Move one run's landed rows into stage_routed and finish its sources, in the caller's `tx`.

    Raises StaleEpoch when `epoch` is no longer current; the caller's transaction then rolls
    back and nothing lands. Sources are finished first, so only sources this transaction really
    finished (their rows now locked by it) get routed rows: a source whose claim was lost lands
    nothing even if Spark landed rows for it.

    A row bound for a `passthrough` destination (nothing to compute: no spec, no hook, one lane)
    is routed straight to `done` and gets its outbound row here, so the transform stage never
    claims and finishes it. Not while the destination has routed rows still open (routed before a
    config change made it a pass-through): its new rows then queue behind them, in lane order.
    """
    params = run.begin(tx)
    unrouted_ids = {int(r["source_id"]) for r in tx.all("route_unrouted_ids", params)}
    pending_ids = {int(r["source_id"]) for r in tx.all("route_pending_ids", params)}
    pending_ids -= unrouted_ids  # route() never emits both for one source; never mark one twice
    done = run.finish(tx, INBOUND, pending_ids)
    unrouted = run.finish(tx, INBOUND, unrouted_ids, "unrouted")
    direct: set[str] = set()
    if passthrough and done:
        names = tx.dialect.text_list(sorted(passthrough))
        direct = set(passthrough) - {r["destination"] for r in tx.all("route_passthrough_open", {"names": names})}
    params["direct"] = tx.dialect.text_list(sorted(direct))
    rows = move_on(tx, run, "route_finalize_insert", params, done, to=ROUTED, event="routed", ids_only=not direct)
    rows.sort(key=lambda r: r["id"])
    passed = [int(r["id"]) for r in rows if direct and r["status"] == "done"]
    outbound = pass_through(tx, run, passed)
    finished = clear_landing(tx, run, "landing_routed", [*done, *unrouted])
    return RouteOutcome(
        run_id=run.run_id,
        claimed=tuple(sorted(run.claimed)),
        routed=tuple(int(r["id"]) for r in rows),
        done=tuple(done),
        unrouted=tuple(unrouted),
        outbound=tuple(sorted(int(r["id"]) for r in outbound)),
        not_finished=tuple(sorted(run.claimed - set(finished))),
    )


def pass_through(tx: Tx, run: Run, routed_ids: list[int]) -> list[dict[str, Any]]:
    """The outbound rows of pass-through routed rows just finished — no body of their own: a
    pass-through row's body is its inbound row's (docs/store.md "Bodies")."""
    return move_on(tx, run, "passthrough_outbound_insert", {}, routed_ids, to=OUTBOUND, event="transformed")


UNTRANSFORMABLE = "cannot transform: the payload is not an HL7 v2 message (no MSH, FHS or BHS header)"


def dead_letter_reason(detail: str | None) -> str:
    """Why a landed row with a NULL payload is dead: its content_type carries the reason a rule or a
    code hook gave (docs/rules.md); a plain content type there means the rules could not read it."""
    if detail and not detail.startswith("application/"):
        return detail[:400]
    return UNTRANSFORMABLE


def finalize_transform(tx: Tx, run: Run, *, passthrough: Collection[str] = ()) -> BatchOutcome:
    """Move one transform run's landed rows into stage_outbound and finish its routed rows, in `tx`.

    `finalize_landed` plus two things: each new row's body is written once from its landed row
    (`transform_finalize_bodies`), and claimed rows bound for a `passthrough` destination (no
    spec, one lane for the destination: nothing to compute) were never given to Spark — they move
    here, in SQL, their body staying the inbound one. A landed NULL payload (the rules could not
    read the message) dead-letters its routed row instead of delivering it untransformed.
    """
    params = run.begin(tx)
    landed = {int(r["id"]): r for r in tx.all("transform_landed", params) if int(r["id"]) in run.claimed}
    passing: set[int] = set()
    unlanded = run.claimed - landed.keys()  # Spark lands nothing for a pass-through row
    if passthrough and unlanded:
        names = tx.dialect.text_list(sorted(passthrough))
        found = tx.all("transform_passthrough_ids", {"ids": tx.dialect.id_list(sorted(unlanded)), "names": names})
        passing = {int(r["id"]) for r in found}
    done = run.finish(tx, ROUTED, passing | {i for i, r in landed.items() if r["ok"]})
    failed = dead_letter(
        tx, run, ROUTED, {i: dead_letter_reason(r["detail"]) for i, r in landed.items() if not r["ok"]}
    )
    landed_ids = [i for i in done if i not in passing]
    rows = move_on(tx, run, "transform_finalize_insert", params, landed_ids, to=OUTBOUND, event="transformed")
    if rows:  # each new row's body, once (docs/store.md "Bodies")
        tx.execute("transform_finalize_bodies", {**params, "ids": tx.dialect.id_list([r["id"] for r in rows])})
    rows += pass_through(tx, run, [i for i in done if i in passing])
    clear_landing(tx, run, "landing_outbound", [*done, *failed])
    return BatchOutcome.of(run, rows, done, failed)


NOT_ATTEMPTED = "not attempted"
"""How a deliver outcome's detail starts when its row was not sent: an earlier row of its lane failed."""
# A row whose destination is not configured (removed, renamed) waits for the config to be fixed:
# retried with the default backoff, never dead-lettered for it.
UNCONFIGURED_MAX_ATTEMPTS = 2**31 - 1
UNCONFIGURED_BACKOFF = (5.0, 300.0)


class RetryPolicy(Protocol):
    """A destination's retry settings, all the deliver finalize needs of it
    (`include.destinations_config.Destination` is one; the store does not import the senders)."""

    @property
    def max_attempts(self) -> int: ...

    @property
    def backoff_seconds(self) -> float: ...

    @property
    def max_backoff_seconds(self) -> float: ...


@dataclass(frozen=True)
class DeliverOutcome:
    """What one deliver finalize (or a whole run, summed with `+`) changed; ids ascending.

    `retrying`: failed attempts now `error`, due again after their backoff. `dead`: given up
    (permanent failure, or `max_attempts` reached). `released`: claimed but not tried because an
    earlier row of the lane failed; pending again. `not_finished`: outcomes that did not land
    because the row was no longer this claimer's (its row lease was swept, another claimer has it).
    """

    rounds: int = 0
    claimed: tuple[int, ...] = ()
    done: tuple[int, ...] = ()
    released: tuple[int, ...] = ()
    retrying: tuple[int, ...] = ()
    dead: tuple[int, ...] = ()
    not_finished: tuple[int, ...] = ()

    def __add__(self, other: DeliverOutcome) -> DeliverOutcome:
        merged: dict[str, Any] = {"rounds": self.rounds + other.rounds}
        for f in fields(self):
            if f.name != "rounds":
                merged[f.name] = tuple(sorted({*getattr(self, f.name), *getattr(other, f.name)}))
        return DeliverOutcome(**merged)


def finalize_deliveries(
    store: Store, outcomes: Iterable[Any], *, owner: str, epoch: int, destinations: Mapping[str, RetryPolicy]
) -> DeliverOutcome:
    """Land one deliver round's outcomes in ONE fenced transaction; StaleEpoch (nothing lands) if deposed.

    An outcome is a mapping (or a Spark Row) with id, destination, ok, retryable, detail. ok →
    `done`. Not attempted (detail starts with NOT_ATTEMPTED) → pending again, the attempt not
    counted. Retryable → `fail_batch` with the destination's max_attempts and backoff (`dead` once
    attempts reach max_attempts; an unconfigured destination waits, never dies for it). Permanent →
    `dead` now. Failures are grouped by (destination, detail) so an outage costs one statement per
    destination, not one per row; the detail becomes `last_error` and the audit event's detail.
    """
    by_id: dict[int, dict[str, Any]] = {}
    for raw in outcomes:
        o = raw.asDict() if hasattr(raw, "asDict") else dict(raw)
        i = int(o["id"])
        if i not in by_id or (o["ok"] and not by_id[i]["ok"]):  # a Spark task retry: any success counts
            by_id[i] = o
    ok_ids = sorted(i for i, o in by_id.items() if o["ok"])
    untried = sorted(i for i, o in by_id.items() if not o["ok"] and (o.get("detail") or "").startswith(NOT_ATTEMPTED))
    groups: dict[tuple[str, bool, str], list[int]] = {}
    for i, o in sorted(by_id.items()):
        if not o["ok"] and i not in untried:
            groups.setdefault((o.get("destination") or "", bool(o["retryable"]), o.get("detail") or ""), []).append(i)
    with store.transaction() as tx:
        check_epoch(tx, epoch, what=f"deliver {owner}", landed=f"{len(by_id)} outcomes not landed")
        done = finish_batch(tx, OUTBOUND, ok_ids, owner=owner, epoch=epoch, status="done")
        released = release_batch(tx, OUTBOUND, untried, owner=owner, epoch=epoch)
        failed: list[dict[str, Any]] = []
        for (name, retryable, detail), ids in groups.items():
            dest = destinations.get(name)
            if not retryable:  # permanent: dead now
                error, attempts, backoff = f"permanent: {detail}", 0, (1.0, 300.0)
            elif dest is None:  # not configured: waits for the config, never dies for it
                error, attempts, backoff = detail, UNCONFIGURED_MAX_ATTEMPTS, UNCONFIGURED_BACKOFF
            else:
                error, attempts, backoff = detail, dest.max_attempts, (dest.backoff_seconds, dest.max_backoff_seconds)
            failed += fail_batch(
                tx,
                OUTBOUND,
                ids,
                owner=owner,
                epoch=epoch,
                error=error,
                max_attempts=attempts,
                backoff_seconds=backoff[0],
                max_backoff_seconds=backoff[1],
            )
    landed = set(done) | set(released) | {int(r["id"]) for r in failed}
    return DeliverOutcome(
        claimed=tuple(sorted(by_id)),
        done=tuple(sorted(done)),
        released=tuple(released),
        retrying=tuple(sorted(int(r["id"]) for r in failed if r["status"] == "error")),
        dead=tuple(sorted(int(r["id"]) for r in failed if r["status"] == "dead")),
        not_finished=tuple(sorted(set(by_id) - landed)),
    )
