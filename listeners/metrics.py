"""Prometheus metrics of one `listenerd` (its own registry, served on `/metrics`)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.received = Counter("stageline_messages_received_total", "Messages received, per inbound connection",
                                ["connection"], registry=r)
        self.acks = Counter("stageline_acks_total", "Acknowledgements sent, per connection and code (AA/AE/AR)",
                            ["connection", "code"], registry=r)
        self.commit_seconds = Histogram(
            "stageline_commit_seconds", "Group-commit transaction latency",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)
        self.commit_batch = Histogram("stageline_commit_batch_messages", "Messages per group commit",
                                      buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.leader = Gauge("stageline_leader", "1 while this node holds a live, unfenced lease", registry=r)
        self.epoch = Gauge("stageline_epoch", "Leader epoch held by this node (0 when not leader)", registry=r)
        self.bound = Gauge("stageline_listeners_bound", "Inbound connections currently bound", registry=r)
        self.connections = Gauge("stageline_open_connections", "Open inbound connections", ["connection"],
                                 registry=r)
        self.config_mismatch = Gauge("stageline_config_mismatch",
                                     "1 when this node's config hash differs from the leader's", registry=r)
        self.config_version = Gauge("stageline_config_version", "Shared config version loaded", registry=r)
        self.elections = Counter("stageline_election_outcomes_total", "Lease elector step outcomes",
                                 ["outcome"], registry=r)
        self.refusals = Counter("stageline_connections_refused_total",
                                "Connections refused or closed by a listener's peer limits, per connection and reason "
                                "(connect_rate, peer_connections, listener_full, evicted_for_new_connection, "
                                "frame_timeout, handshake_timeout; throttled: reading paused for bandwidth)", ["connection", "reason"], registry=r)
        self.store_errors = Counter("stageline_store_errors_total", "Store operations that failed",
                                    ["operation"], registry=r)

        self.stage_backlog = Gauge("stageline_stage_backlog", "Rows due or backing off, per stage (the leader's view)",
                                   ["stage"], registry=r)
        self.stage_oldest = Gauge("stageline_stage_oldest_pending_seconds",
                                  "Age of the oldest row due or backing off, per stage (0: none)", ["stage"], registry=r)
        self.stage_in_flight = Gauge("stageline_stage_in_flight", "Rows claimed by a stage task, per stage",
                                     ["stage"], registry=r)
        self.stage_dead = Gauge("stageline_stage_dead_letters", "Dead letters, per stage", ["stage"], registry=r)

    def set_stages(self, overview: dict[str, dict]) -> None:
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
