"""Is a commit on two servers? The replication posture of a PostgreSQL store (docs/store.md).

An `AA` means the message is committed (invariant 1). On a replicated store — PostgreSQL under
Patroni with `synchronous_mode` — the store's sessions run with `synchronous_commit = on`
(`include.store.durability`), so a commit returns only once the synchronous standby has flushed it
too, and a promotion cannot lose it. Whether that is so at a given moment is the server's to say:
it names its synchronous standbys and shows which are streaming in sync. listenerd reads this at
start and every `RECHECK_SECONDS`, and reports it (`/cluster/status`, `stageline_store_sync_standbys`),
because Patroni (without `synchronous_mode_strict`) empties `synchronous_standby_names` when the
standby is lost: commits then go on, on one server only, and an operator must know.

States:

    synchronous  standbys named and one streaming in sync: a commit is on two servers
    waiting      standbys named, none in sync: commits wait until one is back (strict mode)
    single       no standby named: a commit is on this server only (the default for one server)
    unknown      the role may not read pg_stat_replication's state (grant pg_monitor)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from include.store.db import Store
from include.store.durability import STANDBY_LEVELS

__all__ = ["RECHECK_SECONDS", "Posture", "read_posture"]

RECHECK_SECONDS = 5.0
"""How often listenerd reads the posture again (a standby lost is reported within this)."""


@dataclass(frozen=True)
class Posture:
    standby_names: str
    synchronous_commit: str
    in_recovery: bool
    can_see: bool
    standbys: int
    sync_standbys: int

    @property
    def state(self) -> str:
        if not self.standby_names.strip():
            return "single"
        if not self.can_see:
            return "unknown"
        return "synchronous" if self.sync_standbys > 0 else "waiting"

    @property
    def two_servers(self) -> bool:
        """A commit the store reports now is flushed on a synchronous standby too."""
        return self.state == "synchronous" and self.synchronous_commit in STANDBY_LEVELS

    def document(self) -> dict[str, Any]:
        """What /cluster/status shows."""
        return {"state": self.state, "two_servers": self.two_servers, **asdict(self)}


def read_posture(store: Store) -> Posture | None:
    """The posture of the server the store reaches now; None for a store without replication
    (SQLite, SQL Server: not read)."""
    if not store.has_query("replication_posture"):
        return None
    with store.transaction(write=False) as tx:
        row = tx.row("replication_posture")
    return Posture(
        standby_names=str(row["standby_names"] or ""),
        synchronous_commit=str(row["synchronous_commit"] or ""),
        in_recovery=bool(row["in_recovery"]),
        can_see=bool(row["can_see"]),
        standbys=int(row["standbys"]),
        sync_standbys=int(row["sync_standbys"]),
    )
