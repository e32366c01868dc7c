"""The self-fencing leader lease.

State machine of one elector (one per node), stepped every `heartbeat_seconds`:

    candidate ──step: lease free or expired──▶ leader (epoch = previous + 1)            "elected"
    candidate ──step: someone else's live lease──▶ candidate                             "other_leader"
    leader    ──step: renewed to DB_now + ttl──▶ leader (same epoch)                     "already_leader"
    leader    ──step: lease now has another owner/epoch──▶ candidate                     "conflict"
    leader    ──no successful renewal for fence_timeout (local monotonic clock)──▶ fenced → candidate
    leader    ──release()──▶ candidate, lease expires at once so a standby acquires on its next step
    leader    ──stand_aside(s)──▶ released as above, then "standing_aside" (no acquiring) for s seconds

Every step is one short transaction that locks the lease row, so two electors never both win.
Lease times are the database's clock; the node's wall clock is never consulted. The fence is
measured from the *start* of the last successful renewal's transaction (its connection in hand,
its first statement not yet sent) on the local monotonic clock, so it always trips before the
lease can expire (fence_timeout < ttl) and a fenced leader is provably idle
by the time a standby can acquire. Each acquisition bumps the epoch: the fencing token every staged
write checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from include.store.db import Store


class Outcome(str, Enum):
    ELECTED = "elected"
    ALREADY_LEADER = "already_leader"
    OTHER_LEADER = "other_leader"
    CONFLICT = "conflict"
    STANDING_ASIDE = "standing_aside"


@dataclass(frozen=True)
class ElectionResult:
    outcome: Outcome
    epoch: int | None
    leader: str | None
    expires_at: float | None

    @property
    def is_leader(self) -> bool:
        return self.outcome in (Outcome.ELECTED, Outcome.ALREADY_LEADER)


@dataclass(frozen=True)
class LeaseState:
    """The lease row as any reader sees it (sensor, `/cluster/nodes`)."""

    owner: str | None
    epoch: int
    acquired_at: float | None
    expires_at: float | None
    live: bool
    db_now: float
    recovered_epoch: int


def read_lease(store: Store) -> LeaseState:
    with store.transaction(write=False) as tx:
        row = tx.row("lease_read")
    return _state(row)


def _state(row: dict[str, Any]) -> LeaseState:
    return LeaseState(
        owner=row["owner"],
        epoch=int(row["epoch"]),
        acquired_at=row["acquired_at"],
        expires_at=row["expires_at"],
        live=bool(row["live"]),
        db_now=float(row["db_now"]),
        recovered_epoch=int(row["recovered_epoch"]),
    )


def acquire_permanent(store: Store, *, node_id: str) -> int:
    """Single-node mode: this process is leader for good; a new epoch fences the previous process."""
    with store.transaction() as tx:
        return int(tx.row("lease_acquire_permanent", {"owner": node_id})["epoch"])


class LeaderElector:
    def __init__(
        self,
        store: Store,
        *,
        node_id: str,
        ttl_seconds: float,
        fence_timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not fence_timeout_seconds < ttl_seconds:
            raise ValueError("fence_timeout_seconds must be < ttl_seconds")
        self.store = store
        self.node_id = node_id
        self.ttl = float(ttl_seconds)
        self.fence_timeout = float(fence_timeout_seconds)
        self._clock = clock
        self._epoch: int | None = None
        self._renewed_at: float | None = None  # local monotonic time at the start of the last good renewal
        self._aside_until = float("-inf")  # local monotonic time until which this node takes no lease
        self._fenced = False  # self-fenced, and no step has reached the database since

    @property
    def epoch(self) -> int | None:
        """The epoch held, or None; meaningful only while `is_leader`."""
        return self._epoch if self.is_leader else None

    @property
    def fence_deadline(self) -> float | None:
        """Local monotonic time at which this leader stops acting unless it renews first."""
        if self._epoch is None or self._renewed_at is None:
            return None
        return self._renewed_at + self.fence_timeout

    @property
    def is_leader(self) -> bool:
        deadline = self.fence_deadline
        return deadline is not None and self._clock() < deadline

    @property
    def fenced(self) -> bool:
        """Stopped acting on its epoch (no good renewal for the fence timeout), and no step has
        reached the database since."""
        return self._fenced or (self._epoch is not None and not self.is_leader)

    @property
    def aside_seconds(self) -> float:
        """Seconds left of a step-down's backoff (0 when none)."""
        return max(0.0, self._aside_until - self._clock())

    def step(self) -> ElectionResult:
        """One elect-or-renew transaction. Database errors propagate; the fence keeps running."""
        if self._epoch is not None and not self.is_leader:
            self._drop()  # self-fenced: never renew a lease we already stopped acting on
            self._fenced = True
        result = self._step()
        self._fenced = False  # the database answered: this node knows where it stands again
        return result

    def _step(self) -> ElectionResult:
        if self._epoch is None and self.aside_seconds > 0:
            state = read_lease(self.store)  # stepped down: watch, never acquire, until the backoff ends
            return ElectionResult(
                Outcome.STANDING_ASIDE, state.epoch, state.owner if state.live else None, state.expires_at
            )
        params = {"owner": self.node_id, "ttl": self.ttl}
        held: tuple[int, float] | None = None  # (epoch, start) this step holds once its commit is confirmed
        try:
            with self.store.transaction() as tx:
                # The fence runs from here: a connection in hand, before the statement that starts
                # the transaction whose clock the expiry is counted from, so it still trips first.
                # Not from before the wait for a connection: after a store failover that wait is
                # seconds long, and an election that began fenced bound nothing and lost its
                # epoch to the next one (issue 28).
                started = self._clock()
                tx.one("step_timeout", {"ms": int(self.fence_timeout * 1000)})
                cur = tx.row("lease_read_locked")
                owner, epoch, live = cur["owner"], int(cur["epoch"]), bool(cur["live"])
                result: ElectionResult | None = None
                if self._epoch is not None:
                    if owner != self.node_id or epoch != self._epoch:
                        self._drop()
                        return ElectionResult(Outcome.CONFLICT, epoch, owner if live else None, cur["expires_at"])
                    if live:
                        row = tx.one("lease_renew", {**params, "epoch": epoch})
                        if row is not None:
                            held = (epoch, started)
                            result = ElectionResult(Outcome.ALREADY_LEADER, epoch, self.node_id, row["expires_at"])
                        # else expired between the read and the renewal (a per-statement clock): acquire anew
                    # our lease ran out and nobody took it: fall through and acquire a new epoch
                elif live:
                    return ElectionResult(Outcome.OTHER_LEADER, epoch, owner, cur["expires_at"])
                if result is None:
                    tx.execute("fence_exclusive")  # waits out writers that checked the old epoch
                    row = tx.one("lease_acquire", {**params, "prev_epoch": epoch})
                    if row is None:
                        self._drop()
                        return ElectionResult(Outcome.CONFLICT, None, None, None)
                    held = (int(row["epoch"]), started)
                    result = ElectionResult(Outcome.ELECTED, held[0], self.node_id, row["expires_at"])
        except Exception as exc:
            if self.store.dialect.is_conflict(exc):
                return ElectionResult(Outcome.CONFLICT, None, None, None)
            raise
        # Only a confirmed commit counts (include.store.unconfirmed): one that raised — its wait for
        # the synchronous standby cancelled — may be gone after a promotion, and its epoch with it,
        # to be granted again to another node (issue 28).
        assert held is not None and result is not None  # every path without them returned above
        self._epoch, self._renewed_at = held
        return result

    def release(self) -> bool:
        """Clean stop: expire our lease now so a standby acquires on its next step."""
        epoch, self._epoch = self._epoch, None
        self._renewed_at = None
        if epoch is None:
            return False
        with self.store.transaction() as tx:
            return tx.execute("lease_release", {"owner": self.node_id, "epoch": epoch}) == 1

    def stand_aside(self, seconds: float) -> bool:
        """Step down: expire our lease now (`release`) and take no lease for `seconds`, so that a
        node that can serve acquires it instead of this one taking it straight back."""
        self._aside_until = self._clock() + seconds
        return self.release()

    def end_stand_aside(self) -> None:
        """End a step-down's backoff now (no other node is live to take the lease)."""
        self._aside_until = float("-inf")

    def _drop(self) -> None:
        self._epoch = None
        self._renewed_at = None
