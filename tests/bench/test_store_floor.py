"""bench/store_floor.py: the per-statement times `bench/pipeline.py --statements` prints must name
the store's own statements with the rows they touched, and the floor must come from real row
changes on the server; otherwise the ceiling it is quoted for is not measured."""

from __future__ import annotations

from bench.store_floor import StatementTimes, bare_floor
from include.store import INBOUND, Store
from include.store import rowlease as rl
from include.store.lease import acquire_permanent
from include.store.migrate import migrate


def test_statement_times_count_each_named_statement_and_its_rows(pg_config_fresh):
    store = Store(pg_config_fresh)
    try:
        migrate(store, cluster_name="test-cluster")
        epoch = acquire_permanent(store, node_id="n1")
        times = StatementTimes()
        with times.recording():
            with store.transaction() as tx:
                rl.stage_inbound(
                    tx,
                    [
                        {
                            "message_id": f"m{i}",
                            "control_id": f"c{i}",
                            "connection": "x",
                            "lane_key": None,
                            "charset": None,
                            "payload": "MSH|^~\\&|A",
                        }
                        for i in range(7)
                    ],
                    epoch=epoch,
                    node_id="n1",
                )
            with store.transaction() as tx:
                claimed = rl.claim_batch(tx, INBOUND, owner="w", epoch=epoch, limit=5)
        with store.transaction() as tx:  # after recording: not counted
            rl.finish_batch(tx, INBOUND, [r["id"] for r in claimed], owner="w", epoch=epoch)
    finally:
        store.close()
    assert (times.calls["stage_inbound"], times.rows["stage_inbound"]) == (1, 7)
    assert (times.calls["claim_batch"], times.rows["claim_batch"]) == (1, 5)
    assert "finish_batch" not in times.calls
    assert all(s > 0 for s in times.seconds.values())
    lines = times.lines()
    assert lines[0].startswith("store statements during route + transform:")
    assert any(line.split()[0] == "stage_inbound" and line.split()[2] == "7" for line in lines[2:])


def test_the_floor_is_measured_on_the_server_and_leaves_nothing_behind(pg_server):
    lines = bare_floor(pg_server.conninfo(), 2000, runs=1)
    per_row = {line.rsplit(None, 2)[0].strip(): float(line.split()[-2]) for line in lines[1:]}
    assert set(per_row) == {"insert (primary key only)", "insert + one event row", "status update + one event row"}
    assert all(0 < v < 1000 for v in per_row.values())
    import psycopg

    with psycopg.connect(pg_server.conninfo()) as conn:
        assert conn.execute("SELECT to_regclass('floor_events'), to_regclass('floor_rows')").fetchone() == (None, None)
