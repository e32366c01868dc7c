"""The PostgreSQL connection pool: psycopg's, with its reconnect backoff capped.

When its server goes away, psycopg's pool tries to connect again after 1 s, then 2, 4, 8, 16 …
seconds, and every transaction waits for that loop to bring a connection in. A store that fails
over (PostgreSQL under Patroni behind HAProxy: docs/deployment.md) is back within seconds, but
after an outage of 10 s the next try was due 15 s in (and after one of 16 s, 31 s in): listenerd's
first heartbeat, hence its lease and every `AA`, and each stage task's first claim waited up to as
long again as the outage itself for a connection the server would have given at once (issue 28).

`PromptPool` keeps psycopg's behaviour but never waits more than RECONNECT_DELAY_MAX between tries.
A try is one connect: refused at once by HAProxy while no server is primary, bounded by
`connect_timeout` against a dead host, so trying twice a second costs nothing worth saving.
"""

from __future__ import annotations

from psycopg_pool import ConnectionPool
from psycopg_pool.base import AttemptWithBackoff

RECONNECT_DELAY_MAX = 0.5
"""Seconds, at most, between a pool's tries to reach its server again (psycopg: doubling, no cap)."""


class CappedBackoff(AttemptWithBackoff):
    """psycopg's reconnect attempt (its jitter and its give-up time) with each delay capped."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_DELAY_MAX)


class PromptPool(ConnectionPool):
    """A `psycopg_pool.ConnectionPool` that reconnects within RECONNECT_DELAY_MAX of its server's return."""

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        # psycopg makes the attempt on the first try and hands the same one to every retry
        super()._add_connection(attempt or CappedBackoff(timeout=self.reconnect_timeout), growing)
