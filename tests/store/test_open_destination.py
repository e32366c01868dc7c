"""The open routed rows' index by destination (store v22) serves route_passthrough_open and nothing
else: a claim made on statistics from before a backlog arrived must still probe held lanes through
the held-lane index. With the index's predicate implied by the claim's status filter, PostgreSQL's
planner walked this index for every candidate instead — 10 s for a claim of 5,000 routed rows."""

from __future__ import annotations

import json

import pytest

from include.store import ROUTED, Store
from include.store.lease import acquire_permanent

pytestmark = pytest.mark.postgres

ROUTED_ROWS = (
    "INSERT INTO stage_routed (source_id, message_id, destination, lane_key, status) "
    "SELECT g, 'm' || g, (ARRAY['ehr', 'lab', 'archive'])[g %% 3 + 1], 'P' || (g %% 1000), %(status)s "
    "FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g"
)


def plan(store: Store, name: str, params: dict) -> str:
    """The plan of named statement `name` on stage_routed (rolled back)."""
    with store.transaction() as tx:
        cur = tx.conn.cursor()
        cur.execute("EXPLAIN (FORMAT JSON) " + tx.sql(name, ROUTED), params)
        found = json.dumps(next(iter(dict(cur.fetchone()).values())))
        tx.conn.rollback()
    return found


def test_a_claim_on_stale_statistics_probes_held_lanes_not_the_open_destination_index(pg_config_fresh):
    store = Store(pg_config_fresh)
    try:
        epoch = acquire_permanent(store, node_id="n1")
        with store.transaction() as tx:
            tx.conn.cursor().execute(ROUTED_ROWS, {"status": "done", "first": 1, "last": 30_000})
        with store.transaction() as tx:
            tx.conn.cursor().execute("ANALYZE stage_routed")  # statistics of a store with nothing open
        with store.transaction() as tx:
            tx.conn.cursor().execute(ROUTED_ROWS, {"status": "pending", "first": 30_001, "last": 46_000})

        claim = plan(store, "claim_batch", {"owner": "w", "epoch": epoch, "limit": 5000, "lease_seconds": 60})
        assert "stage_routed_held_lane" in claim and "stage_routed_open_destination" not in claim, claim

        probe = plan(store, "route_passthrough_open", {"names": ["archive"]})
        assert "stage_routed_open_destination" in probe, probe
        with store.transaction() as tx:
            open_now = tx.all("route_passthrough_open", {"names": ["archive", "fax"]})
        assert [r["destination"] for r in open_now] == ["archive"]
    finally:
        store.close()
