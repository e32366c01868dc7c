"""The store's clock against the node's, measured at each heartbeat, and the lease's skew bound
beside it (docs/store.md, "Across a database failover"; alert StagelineClockSkew)."""

from __future__ import annotations

import math

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import wait_for
from tests.support.nodes import FENCE, TTL, fast_cluster


def samples(d: Daemon) -> dict[str, float]:
    status, body = d.get("/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line.startswith(("stageline_store_clock_offset_seconds ", "stageline_lease_skew_bound_seconds ")):
            name, value = line.split()
            out[name] = float(value)
    return out


def test_a_node_exports_the_store_clock_offset_and_the_lease_skew_bound(pg_config_fresh, tmp_path):
    d = Daemon(tmp_path / "a", pg_config_fresh, node_id="node-a", cluster=fast_cluster()).start()
    try:
        offset = "stageline_store_clock_offset_seconds"
        wait_for(lambda: not math.isnan(samples(d).get(offset, math.nan)), timeout=20, what="a heartbeat")
        got = samples(d)
        # the same host's clock: the offset is the round trip's asymmetry, well under a second
        assert abs(got[offset]) < 0.5, got
        assert math.isclose(got["stageline_lease_skew_bound_seconds"], TTL - FENCE), got
    finally:
        d.stop()


def test_a_single_node_has_no_skew_bound(sqlite_config_fresh, tmp_path):
    d = Daemon(tmp_path / "solo", sqlite_config_fresh, node_id="solo").start()
    try:
        offset = "stageline_store_clock_offset_seconds"
        wait_for(lambda: not math.isnan(samples(d).get(offset, math.nan)), timeout=20, what="a heartbeat")
        assert abs(samples(d)[offset]) < 0.5  # SQLite's clock is this host's
        assert math.isnan(samples(d)["stageline_lease_skew_bound_seconds"])
    finally:
        d.stop()
