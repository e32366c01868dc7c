"""Each destination's and connection's figures on `/metrics`, read from the store when scraped.

The leader reads `include.store.stats` off the reactor thread at most every `max_age` seconds, so a
scrape storm costs one read: the rows open now become gauges, and what finished since the last
read is added to counters and to the delivery-latency histogram (each read takes the window from
the previous one's end to `lag` seconds before the database's now, so a commit still in flight
when one read ran is counted by the next; a transaction that commits later than `lag` after its
rows' timestamps is not counted at all). A scrape waits for a read at most `timeout` seconds, then
answers with the figures it had — never a frozen daemon — and no second read starts while one
runs; a read that fails, or runs past STALLED_SECONDS, makes `stageline_store_up` 0 (a slow read
of a large backlog does not). Reads are spaced by their own cost (LOAD_SHARE). A standby publishes no figures (the
leader's are the cluster's; summing nodes would count twice), only `stageline_store_up` from a
clock read. Counters start at 0 when a node becomes leader (Prometheus's `rate` reads that as a
reset).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from twisted.internet import threads
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.store import stats

_log = Logger()

MAX_AGE_SECONDS = 2.0
TIMEOUT_SECONDS = 2.0
STALLED_SECONDS = 10.0
"""A read still running after this is a store that does not answer (`stageline_store_up 0`); a read
that is merely slow — a large backlog to count — is not: the scrape gets the last figures at
`timeout`, and `stageline_store_read_seconds` shows how long the read has been going."""
LOAD_SHARE = 0.25
"""Reads are spaced so they take at most this share of the time: after a read of `s` seconds the
next starts no sooner than `s / LOAD_SHARE` after it (a slow store is not read back to back)."""
LAG_SECONDS = 2.0
MAX_DELIVERIES = 50_000
"""The most deliveries one read observes into the latency histogram (the newest; past it the rest
of that window is counted but not timed)."""
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


@dataclass
class _Read:
    leader: bool
    opened: dict[tuple[str, str], dict[str, Any]]
    flow: stats.Flow | None
    now_ms: int
    until_ms: int
    seconds: float


class StoreMetrics:
    """The store-read families of one listenerd's registry, and when to read them."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        store: Callable[[], Any],
        is_leader: Callable[[], bool],
        clock: IReactorTime,
        max_age: float = MAX_AGE_SECONDS,
        timeout: float = TIMEOUT_SECONDS,
        lag: float = LAG_SECONDS,
    ) -> None:
        self._store, self._is_leader, self._clock = store, is_leader, clock
        self.max_age, self.timeout, self.lag = max_age, timeout, lag
        r = registry
        self.up = Gauge(
            "stageline_store_up",
            "1 when this node's last read of the store answered; 0 when it failed, or has been running "
            f"longer than {STALLED_SECONDS:g} s (the store figures are then the last ones read)",
            registry=r,
        )
        self.read_seconds = Gauge(
            "stageline_store_read_seconds", "How long the last read of the store's figures took", registry=r
        )
        self.rows = {
            by: Gauge(
                f"stageline_{by}_rows",
                f"Rows of each {by} now, by state: queued (pending), retrying (backing off after a failed "
                "attempt), in_flight (held by a stage task), dead (dead letters)",
                [by, "state"],
                registry=r,
            )
            for by in stats.BY
        }
        self.oldest = {
            by: Gauge(
                f"stageline_{by}_oldest_queued_seconds",
                f"Age of each {by}'s oldest queued or retrying row (0: none)",
                [by],
                registry=r,
            )
            for by in stats.BY
        }
        self.messages = {
            "destination": Counter(
                "stageline_destination_messages_total",
                "Messages of each destination, by outcome: received (routed to it), sent (delivery done), "
                "dead (dead-lettered)",
                ["destination", "outcome"],
                registry=r,
            ),
            "connection": Counter(
                "stageline_connection_messages_total",
                "Messages of each inbound connection, by outcome: received (staged), filtered (no route took "
                "it), sent (a delivery of it done), dead (a row of it dead-lettered)",
                ["connection", "outcome"],
                registry=r,
            ),
        }
        self.latency = Histogram(
            "stageline_delivery_latency_seconds",
            "Time from a message's arrival to its delivery being done, per destination and connection",
            ["destination", "connection"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._running: Deferred[Any] | None = None
        self._started_at = float("-inf")
        self._last_seconds = 0.0
        self._waiters: list[Deferred[None]] = []
        self._read_at = float("-inf")
        self._watermark_ms: int | None = None
        self._was_leader = False
        self._known: dict[tuple[str, str], Any] = {}

    def fresh(self) -> Deferred[None]:
        """Fires once the figures are at most `max_age` old (longer after a slow read: LOAD_SHARE), or
        after `timeout` with the last figures (store_up 0 once the read has stalled)."""
        if time.monotonic() - self._read_at < max(self.max_age, self._last_seconds / LOAD_SHARE):
            return succeed(None)
        store = self._store()
        if store is None:
            self.up.set(0)
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._waiters.append(waiter)
        timer = self._clock.callLater(self.timeout, self._too_slow, waiter)

        def stop_timer(result: Any) -> Any:
            if timer.active():
                timer.cancel()
            return result

        waiter.addBoth(stop_timer)
        if self._running is None:
            leader = self._is_leader()
            running: Deferred[Any] = threads.deferToThread(
                self._read, store, leader, self._watermark_ms if leader else None
            )
            self._running = running.addCallbacks(self._publish, self._failed).addBoth(self._finished)
            self._started_at = time.monotonic()
        return waiter

    def _read(self, store: Any, leader: bool, watermark_ms: int | None) -> _Read:
        """In a thread: the open rows, and what finished since the watermark (the leader's read)."""
        started = time.perf_counter()
        now = stats.db_now_ms(store)
        until = now - int(self.lag * 1000) + 1  # windows end before `until`: `lag` back from now, inclusive
        if not leader:
            return _Read(False, {}, None, now, until, time.perf_counter() - started)
        if watermark_ms is None:  # the first read: counting starts from here
            return _Read(True, stats.open_rows(store), None, now, until, time.perf_counter() - started)
        flow = stats.flow(store, watermark_ms, until, deliveries=MAX_DELIVERIES)
        return _Read(True, flow.opened, flow, now, until, time.perf_counter() - started)

    def _publish(self, read: _Read) -> None:
        self.up.set(1)
        self.read_seconds.set(read.seconds)
        self._last_seconds = read.seconds
        if not read.leader or read.leader != self._is_leader():
            self._clear()
            return
        if not self._was_leader:
            self._clear()
            self._was_leader = True
        # every destination and connection seen while this node leads keeps its series (zeros when it
        # has no rows open), so a query over them is never empty for one that is merely idle
        self._known.update(read.opened)
        if read.flow is not None:
            self._known.update(dict.fromkeys(read.flow.counts))
        for by, name in self._known:
            row = read.opened.get((by, name)) or dict.fromkeys(stats.STATES, 0)
            for state in stats.STATES:
                self.rows[by].labels(name, state).set(row[state])
            oldest = row.get("oldest_ms")
            self.oldest[by].labels(name).set(0 if oldest is None else max(0, read.now_ms - oldest) / 1000)
            for outcome in _outcomes(by):
                self.messages[by].labels(name, outcome)  # exported from 0
        if read.flow is not None:
            for (by, name), counts in read.flow.counts.items():
                for outcome in _outcomes(by):
                    self.messages[by].labels(name, outcome).inc(counts[outcome])
            for d in read.flow.deliveries:
                self.latency.labels(d["destination"], d["connection"] or "?").observe(max(0, d["latency_ms"]) / 1000)
        self._watermark_ms = read.until_ms

    def _clear(self) -> None:
        for family in (*self.rows.values(), *self.oldest.values(), *self.messages.values(), self.latency):
            family.clear()
        self._watermark_ms = None
        self._was_leader = False
        self._known.clear()

    def _failed(self, failure: Failure) -> None:
        self.up.set(0)
        _log.warn("store figures for /metrics not read: {error}", error=type(failure.value).__name__)

    def _finished(self, _: Any) -> None:
        self._running = None
        self._read_at = time.monotonic()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.called:
                waiter.callback(None)

    def _too_slow(self, waiter: Deferred[None]) -> None:
        if not waiter.called:
            running = time.monotonic() - self._started_at
            self.read_seconds.set(running)  # the read in progress, so a slow store shows
            if running >= STALLED_SECONDS:
                self.up.set(0)
            waiter.callback(None)


def _outcomes(by: str) -> tuple[str, ...]:
    return stats.OUTCOMES if by == "connection" else tuple(o for o in stats.OUTCOMES if o != "filtered")
