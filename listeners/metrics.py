"""Prometheus metrics of one `listenerd` (its own registry, served on `/metrics`).

Every inbound kind (MLLP, raw TCP, HTTP, file drop) reports the same counters through
`ListenerCounters`, labelled with its connection name (`stageline_inbound_connection_info` gives
each name its kind): messages received, bytes received, every answer by code (``AA`` accepted,
``AE`` not stored / resend, ``AR`` refused; raw TCP's ``ACK``/``NAK`` and HTTP's status codes are
counted as the ``AA``/``AE``/``AR`` they mean), and open connections (always 0 for a file drop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no `_created` series beside every counter and histogram: noise to a scraper

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, open fds, …
        PlatformCollector(registry=r)  # python_info
        GCCollector(registry=r)  # python_gc_*
        self.received = Counter(
            "stageline_messages_received_total", "Messages received, per inbound connection", ["connection"], registry=r
        )
        self.received_bytes = Counter(
            "stageline_received_bytes_total",
            "Message bytes read (content, without framing; a message refused for its size before "
            "it is read counts 0), per inbound connection",
            ["connection"],
            registry=r,
        )
        self.inbound_info = Gauge(
            "stageline_inbound_connection_info",
            "1 per configured inbound connection, with its kind (mllp, tcp, http, file)",
            ["connection", "kind"],
            registry=r,
        )
        self.acks = Counter(
            "stageline_acks_total",
            "Acknowledgements sent, per connection and code (AA/AE/AR, CA/CE/CR)",
            ["connection", "code"],
            registry=r,
        )
        self.acks_withheld = Counter(
            "stageline_acks_withheld_total",
            "Commit ACKs not sent because MSH-15 asked for none (NE; ER on CA; SU on CE/CR), per "
            "connection and the code the answer would have had",
            ["connection", "code"],
            registry=r,
        )
        self.commit_seconds = Histogram(
            "stageline_commit_seconds",
            "Group-commit transaction latency",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.commit_batch = Histogram(
            "stageline_commit_batch_messages",
            "Messages per group commit",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=r,
        )
        self.leader = Gauge("stageline_leader", "1 while this node holds a live, unfenced lease", registry=r)
        self.epoch = Gauge("stageline_epoch", "Leader epoch held by this node (0 when not leader)", registry=r)
        self.bound = Gauge("stageline_listeners_bound", "Inbound connections currently bound", registry=r)
        self.inbound_bound = Gauge(
            "stageline_inbound_bound",
            "1 while this leader has the inbound connection bound, 0 while it is retrying it (or not leading)",
            ["connection"],
            registry=r,
        )
        self.bind_failures = Counter(
            "stageline_inbound_bind_failures_total",
            "Failed bind attempts of an inbound connection (the leader retries them)",
            ["connection"],
            registry=r,
        )
        self.step_downs = Counter(
            "stageline_step_downs_total",
            "Times this node released the lease because an inbound connection stayed unbound past the grace",
            registry=r,
        )
        self.connections = Gauge("stageline_open_connections", "Open inbound connections", ["connection"], registry=r)
        self.config_mismatch = Gauge(
            "stageline_config_mismatch", "1 when this node's config hash differs from the leader's", registry=r
        )
        self.config_version = Gauge("stageline_config_version", "Shared config version loaded", registry=r)
        self.elections = Counter(
            "stageline_election_outcomes_total", "Lease elector step outcomes", ["outcome"], registry=r
        )
        self.refusals = Counter(
            "stageline_connections_refused_total",
            "Connections refused or closed by a listener's peer limits, per connection and reason "
            "(connect_rate, peer_connections, listener_full, evicted_for_new_connection, "
            "frame_timeout, handshake_timeout; throttled: reading paused for bandwidth)",
            ["connection", "reason"],
            registry=r,
        )
        self.store_durable = Gauge(
            "stageline_store_durable",
            "1 while the store's server keeps what it commits; 0 when a "
            "recheck found it may lose commits (fsync turned off): every commit is refused (AE)",
            registry=r,
        )
        self.store_sync_standbys = Gauge(
            "stageline_store_sync_standbys",
            "Synchronous standbys streaming from the store's PostgreSQL (include/store/replication.py): "
            ">= 1 while a commit (and so an AA) is on two servers; 0 when standbys are named but none "
            "is in sync, or none is named; NaN where there is no replication to read (SQLite, SQL Server) "
            "or when no read has succeeded for two rechecks (the posture is unknown)",
            registry=r,
        )
        self.store_sync_standbys_expected = Gauge(
            "stageline_store_sync_standbys_expected",
            "Synchronous standbys the operator expects ([store] sync_standbys_expected): the alert "
            "StagelineStoreOnOneServer fires while stageline_store_sync_standbys is below it (or NaN)",
            registry=r,
        )
        self.store_clock_offset = Gauge(
            "stageline_store_clock_offset_seconds",
            "The store server's clock minus this node's, measured at each heartbeat (the database's "
            "time against the midpoint of the query's round trip); after a promotion, another host's clock",
            registry=r,
        )
        self.lease_skew_bound = Gauge(
            "stageline_lease_skew_bound_seconds",
            "How far a promoted database's clock may run ahead of the old primary's before a fenced "
            "leader could overlap the next (leader_lease_ttl_seconds - leader_fence_timeout_seconds); "
            "NaN on a single node",
            registry=r,
        )
        self.store_errors = Counter(
            "stageline_store_errors_total", "Store operations that failed", ["operation"], registry=r
        )
        self.store_busy = Counter(
            "stageline_store_busy_retries_total",
            "Group commits tried again because the store was busy (SQLite's write lock held "
            "past the busy timeout); each ends AA once its turn comes, within 40 s of its oldest message",
            registry=r,
        )

        self.stage_backlog = Gauge(
            "stageline_stage_backlog", "Rows due or backing off, per stage (the leader's view)", ["stage"], registry=r
        )
        self.stage_oldest = Gauge(
            "stageline_stage_oldest_pending_seconds",
            "Age of the oldest row due or backing off, per stage (0: none)",
            ["stage"],
            registry=r,
        )
        self.stage_in_flight = Gauge(
            "stageline_stage_in_flight", "Rows claimed by a stage task, per stage", ["stage"], registry=r
        )
        self.stage_dead = Gauge("stageline_stage_dead_letters", "Dead letters, per stage", ["stage"], registry=r)

    def inbound_bind(self, connection: str, bound: bool, failed: bool) -> None:
        """One inbound's bind state (the leader gate's `on_bind`)."""
        self.inbound_bound.labels(connection).set(1 if bound else 0)
        if failed:
            self.bind_failures.labels(connection).inc()

    def listener(self, connection: str, kind: str) -> ListenerCounters:
        """The counters of one inbound connection (what its transport counts with)."""
        self.inbound_info.labels(connection, kind).set(1)
        return ListenerCounters(self, connection)

    def set_stages(self, overview: dict[str, dict[str, Any]]) -> None:
        """Publish `include.store.operator.stages` (only the leader does; a standby clears them)."""
        for stage, s in overview.items():
            self.stage_backlog.labels(stage).set(s["backlog"])
            self.stage_oldest.labels(stage).set(s["oldest_pending_seconds"] or 0)
            self.stage_in_flight.labels(stage).set(s["in_flight"])
            self.stage_dead.labels(stage).set(s["dead"])

    def clear_stages(self) -> None:
        for gauge in (self.stage_backlog, self.stage_oldest, self.stage_in_flight, self.stage_dead):
            gauge.clear()

    def render(self) -> bytes:
        return generate_latest(self.registry)


_ANSWER_CODES = frozenset({"AA", "AE", "AR", "CA", "CE", "CR"})
"""Every code an inbound answer is counted under, sent or withheld."""


class ListenerCounters:
    """What every inbound transport counts, bound to one connection: the same set for each kind."""

    def __init__(self, metrics: Metrics, connection: str) -> None:
        self.connection = connection
        self._received = metrics.received.labels(connection)
        self._bytes = metrics.received_bytes.labels(connection)
        self._acks = metrics.acks
        self._by_code = {code: metrics.acks.labels(connection, code) for code in ("AA", "AE", "AR")}
        self._withheld = {code: metrics.acks_withheld.labels(connection, code) for code in ("CA", "CE", "CR")}
        self._open = metrics.connections.labels(connection)
        self._open.set(0)

    def received(self, size: int) -> None:
        """One message (or file, or request body) came in, `size` bytes of content."""
        self._received.inc()
        self._bytes.inc(size)

    def answered(self, code: str) -> None:
        """It was answered `code` (AA, AE or AR)."""
        counter = self._by_code.get(code)
        if counter is None:
            counter = self._acks.labels(self.connection, code)
            if code in _ANSWER_CODES:  # a bounded set: kept, so the next one skips `labels`
                self._by_code[code] = counter
        counter.inc()

    def withheld(self, code: str) -> None:
        """It was not answered because MSH-15 asked for no `code` (CA, CE or CR) answer."""
        self._withheld[code].inc()

    def open_connections(self, count: int) -> None:
        self._open.set(count)

    def open_connections_from(self, count: Callable[[], float]) -> None:
        """Read the open connections from `count` at each scrape (a transport that keeps no tally)."""
        self._open.set_function(count)
