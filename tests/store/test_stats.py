"""Each destination's and connection's health (include/store/stats.py) on a real store (SQLite and
PostgreSQL): messages staged on two connections, routed to two destinations (one message no route
takes), the EHR failing until its rows are dead while the archive takes everything — and every
figure asserted, now and in each window, latency included."""

from __future__ import annotations

import pytest

from include.store import Store, stats
from include.store.lease import acquire_permanent
from tests.support import pump


def _targets(row) -> list[str]:
    return [] if row["control_id"] == "L0" else ["ehr", "archive"]  # L0: no route takes it


@pytest.fixture
def flowed(store: Store) -> Store:
    epoch = acquire_permanent(store, node_id="node-a")
    pump.stage(store, epoch=epoch, n=4, connection="adt-in", prefix="A")
    pump.stage(store, epoch=epoch, n=3, connection="lab-in", prefix="L")
    assert pump.route(store, epoch=epoch, destinations=_targets) == 7
    ehr_tries = pump.Retry(max_attempts=1)  # the EHR refuses everything: each row dead on its first try
    out = pump.DeliverOutcome()
    for _ in range(10):  # each destination is one lane (pass-through): one dead EHR head a round
        out += pump.deliver(store, epoch=epoch, send=lambda row: row["destination"] == "archive", retry=ehr_tries)
    assert len(out.done) == 6 and len(out.dead) == 6
    pump.stage(store, epoch=epoch, n=2, connection="adt-in", prefix="B")  # staged, not routed yet: queued on adt-in
    return store


def test_each_destination_reports_what_it_received_sent_and_dead_lettered(flowed: Store) -> None:
    doc = stats.health(flowed, by="destination", chart=True)
    rows = {r["destination"]: r for r in doc["rows"]}
    assert sorted(rows) == ["archive", "ehr"]
    archive, ehr = rows["archive"], rows["ehr"]
    for label in ("5m", "1h"):
        a, e = archive["windows"][label], ehr["windows"][label]
        assert (a["received"], a["sent"], a["dead"], a["deliveries"]) == (6, 6, 0, 6)
        assert (e["received"], e["sent"], e["dead"], e["deliveries"]) == (6, 0, 6, 0)
        assert 0 <= a["p50_seconds"] <= a["p95_seconds"] < 60
        assert e["p50_seconds"] is None and "filtered" not in a
    assert (archive["queued"], archive["retrying"], archive["in_flight"], archive["dead"]) == (0, 0, 0, 0)
    assert (ehr["queued"], ehr["retrying"], ehr["in_flight"], ehr["dead"]) == (0, 0, 0, 6)
    assert ehr["oldest_queued_seconds"] is None
    assert len(archive["per_minute"]) == 60
    assert sum(m["sent"] for m in archive["per_minute"]) == 6
    assert sum(m["dead"] for m in ehr["per_minute"]) == 6


def test_each_connection_reports_received_filtered_queued_sent_and_dead(flowed: Store) -> None:
    rows = {r["connection"]: r for r in stats.health(flowed, by="connection")["rows"]}
    assert sorted(rows) == ["adt-in", "lab-in"]
    adt, lab = rows["adt-in"], rows["lab-in"]
    w_adt, w_lab = adt["windows"]["5m"], lab["windows"]["5m"]
    assert (w_adt["received"], w_adt["filtered"], w_adt["sent"], w_adt["dead"]) == (6, 0, 4, 4)
    assert (w_lab["received"], w_lab["filtered"], w_lab["sent"], w_lab["dead"]) == (3, 1, 2, 2)
    assert (adt["queued"], adt["dead"], lab["queued"], lab["dead"]) == (2, 4, 0, 2)
    assert adt["oldest_queued_seconds"] is not None and 0 <= adt["oldest_queued_seconds"] < 60
    assert lab["oldest_queued_seconds"] is None


def test_a_retrying_destination_shows_its_backlog_and_its_age(store: Store) -> None:
    epoch = acquire_permanent(store, node_id="node-a")
    pump.stage(store, epoch=epoch, n=3, connection="adt-in", prefix="A")
    pump.route(store, epoch=epoch, destinations=lambda row: ["ehr"])
    out = pump.deliver(store, epoch=epoch, send=lambda row: False, retry=pump.Retry(max_attempts=5, backoff_seconds=60))
    assert len(out.retrying) == 1 and len(out.released) == 2  # the lane's head backs off, the rest wait
    [ehr] = stats.health(store, by="destination")["rows"]
    assert (ehr["queued"], ehr["retrying"], ehr["in_flight"], ehr["dead"]) == (2, 1, 0, 0)
    assert ehr["oldest_queued_seconds"] is not None


def test_a_window_counts_only_what_happened_within_it(flowed: Store) -> None:
    now = stats.db_now_ms(flowed)
    before = stats.flow(flowed, now - 3_600_000, now - 1_800_000)
    assert before.counts == {} and before.deliveries == []
    seen = stats.flow(flowed, now - 60_000, now + 1, deliveries=2)
    assert seen.counts[("destination", "archive")] == {"received": 6, "filtered": 0, "sent": 6, "dead": 0}
    assert len(seen.deliveries) == 2 and seen.sampled


def test_another_grouping_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="by must be one of destination, connection"):
        stats.health(store, by="lane")


@pytest.mark.parametrize(
    "values,p50,p95", [([], None, None), ([7], 7, 7), (list(range(1, 101)), 50, 95), ([5, 1, 3, 2, 4], 3, 5)]
)
def test_percentiles_take_the_nearest_rank(values: list[int], p50: int | None, p95: int | None) -> None:
    assert (stats.percentile(values, 0.5), stats.percentile(values, 0.95)) == (p50, p95)
