"""The failover bench's referee: never two serving leaders, never a write under a superseded epoch.

It watches a lab (`include/app/lab/two_nodes.py`) for a whole run, every POLL_SECONDS, from its own thread:

    leaders   every node's `GET /leader` at once (one request per node, concurrently): two 200s in
              one round are two nodes serving as leader at the same moment. A frozen node does not
              answer within the request's timeout: it counts as not serving.
    epochs    the lease's epoch; when it moves on, the audit events the store holds under the
              epoch just superseded are counted. At the end of the run they are counted again: any
              growth is a write that committed under an old epoch after the next one was committed
              (and seen here). Every staged row, claim outcome and finalize writes an event under
              its writer's epoch, so this covers intake and the stages alike. A write that commits
              in the moment between the takeover and the count (one poll) is not caught: the
              count is a lower bound, which is why the suite's frozen-leader test checks the same
              thing around a takeover it controls (`tests/listeners/test_frozen_leader.py`).

A database that is restarting (a fault) is simply asked again at the next poll.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

POLL_SECONDS = 0.1
COUNT_SQL = "SELECT count(*) AS n FROM message_events WHERE epoch = %(e)s"


@dataclass
class Ruling:
    rounds: int = 0
    two_leaders: list[float] = field(default_factory=list)
    """Wall-clock times of the rounds in which more than one node answered `/leader` 200."""
    epochs: list[int] = field(default_factory=list)
    """Every epoch seen, in order."""
    late_writes: dict[int, int] = field(default_factory=dict)
    """Superseded epoch → events that committed under it after the takeover (should be empty)."""

    def line(self) -> str:
        span = f"{self.epochs[0]}→{self.epochs[-1]} ({len(self.epochs) - 1} takeovers)" if self.epochs else "none seen"
        late = sum(self.late_writes.values())
        return (
            f"{self.rounds} rounds; two serving leaders in {len(self.two_leaders)} rounds; epochs {span}; "
            f"writes under a superseded epoch after its takeover: {late}" + (f" ({self.late_writes})" if late else "")
        )


class Referee:
    """Start with the lab up, `stop()` once the run has drained: the verdict."""

    def __init__(self, lab: Any) -> None:
        self.lab = lab
        self.ruling = Ruling()
        self._counted: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="referee", daemon=True)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="referee-leader")
        self._conn: Any = None

    def start(self) -> Referee:
        self._thread.start()
        return self

    def stop(self) -> Ruling:
        self._stop.set()
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True)
        for epoch, at_takeover in self._counted.items():
            now = self._query(COUNT_SQL, e=epoch, retries=20)
            if now is not None and int(now[0]["n"]) > at_takeover:
                self.ruling.late_writes[epoch] = int(now[0]["n"]) - at_takeover
        if self._conn is not None:
            self._conn.close()
        return self.ruling

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            nodes = list(self.lab.nodes.values())
            serving = sum(self._pool.map(lambda node: node.is_leader(), nodes))
            self.ruling.rounds += 1
            if serving > 1:
                self.ruling.two_leaders.append(time.time())
            rows = self._query("SELECT epoch FROM leader_lease WHERE id = 1")
            if not rows:
                continue
            epoch = int(rows[0]["epoch"])
            seen = self.ruling.epochs
            if seen and epoch != seen[-1]:
                superseded = seen[-1]
                counted = self._query(COUNT_SQL, e=superseded)
                if counted is not None:
                    self._counted[superseded] = int(counted[0]["n"])
            if not seen or epoch != seen[-1]:
                seen.append(epoch)

    def _query(self, sql: str, *, retries: int = 0, **params: Any) -> list[dict] | None:
        import psycopg
        from psycopg.rows import dict_row

        for attempt in range(retries + 1):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(
                        self.lab.pg.conninfo("stageline"), autocommit=True, row_factory=dict_row, connect_timeout=2
                    )
                return list(self._conn.execute(sql, params).fetchall())
            except psycopg.Error:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                if attempt < retries:
                    time.sleep(0.5)
        return None
