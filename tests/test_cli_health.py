"""`stageline stages --by destination|connection` on a store where messages flowed: the table an
operator reads and its `--json`, through the real command (a subprocess, like tests/test_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from tests.support import pump
from tests.test_cli import run


def _flowed(tmp_path: Path) -> Path:
    cfg = tmp_path / "stageline.toml"
    cfg.write_text('[store]\npath = "var/s.db"\n')
    run(cfg, "db", "migrate")
    store = Store(StoreConfig(backend="sqlite", path=str(tmp_path / "var" / "s.db")))
    try:
        epoch = acquire_permanent(store, node_id="node-a")
        pump.stage(store, epoch=epoch, n=5, connection="adt-in", prefix="C")
        pump.route(store, epoch=epoch, destinations=lambda row: [] if row["control_id"] == "C4" else ["ehr", "lab"])
        # the lab refuses: its head backs off, the rest of its lane waits
        pump.deliver(
            store, epoch=epoch, send=lambda row: row["destination"] == "ehr", retry=pump.Retry(backoff_seconds=60)
        )
    finally:
        store.close()
    return cfg


def test_stages_by_destination_prints_each_destinations_health(tmp_path: Path) -> None:
    cfg = _flowed(tmp_path)
    lines = run(cfg, "stages", "--by", "destination").stdout.splitlines()
    assert lines[0].split() == [
        "destination", "queued", "retrying", "in_flight", "dead", "oldest_s",
        "recv_5m", "sent_5m", "dead_5m", "p50_5m", "p95_5m", "recv_1h", "sent_1h", "dead_1h", "p95_1h",
    ]  # fmt: skip
    ehr = next(line.split() for line in lines if line.startswith("ehr "))
    lab = next(line.split() for line in lines if line.startswith("lab "))
    assert ehr[1:5] == ["0", "0", "0", "0"] and ehr[5] == "-"
    assert ehr[6:9] == ["4", "4", "0"] and ehr[11:14] == ["4", "4", "0"]
    assert lab[1:5] == ["3", "1", "0", "0"] and float(lab[5]) >= 0
    assert lab[6:11] == ["4", "0", "0", "-", "-"] and lab[14] == "-"


def test_stages_by_connection_as_json_counts_the_filtered_message(tmp_path: Path) -> None:
    cfg = _flowed(tmp_path)
    doc = json.loads(run(cfg, "stages", "--by", "connection", "--json").stdout)
    assert doc["by"] == "connection" and doc["windows"] == {"5m": 300, "1h": 3600}
    [adt] = doc["rows"]
    assert adt["connection"] == "adt-in"
    assert (adt["queued"], adt["retrying"], adt["in_flight"], adt["dead"]) == (3, 1, 0, 0)
    five = adt["windows"]["5m"]
    assert (five["received"], five["filtered"], five["sent"], five["dead"], five["deliveries"]) == (5, 1, 4, 0, 4)
    assert 0 <= five["p50_seconds"] <= five["p95_seconds"]


def test_stages_by_something_else_is_a_usage_error(tmp_path: Path) -> None:
    cfg = tmp_path / "stageline.toml"
    cfg.write_text('[store]\npath = "var/s.db"\n')
    run(cfg, "db", "migrate")
    proc = run(cfg, "stages", "--by", "lane", ok=False)
    assert proc.returncode == 2 and "'lane' is not one of 'destination', 'connection'" in proc.stderr
