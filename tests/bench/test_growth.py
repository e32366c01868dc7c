"""bench/growth.py at toy sizes, end to end (its own PostgreSQL and Spark Connect server, as a run
does): every point gets every figure, the history and backlog it claims to hold are in the tables,
and the plans file has the hot statements' plans — so the growth curve in docs/performance.md can
be measured again."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.growth import COLUMNS, STAGED, quantile, sizes

ROOT = Path(__file__).resolve().parents[2]


def test_quantiles_are_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.99) == 99.0
    assert quantile(values, 1.0) == 100.0
    assert quantile([7.0], 0.99) == 7.0
    assert quantile([], 0.5) == 0.0


@pytest.mark.parametrize("text", ["1000,10", "10,10", "-1,5", "1e6", "", "10,,20"])
def test_point_sizes_must_be_distinct_ascending_counts(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        sizes(text)


def test_a_toy_run_measures_every_figure_at_every_point(tmp_path):
    out = tmp_path / "points.json"
    plans = tmp_path / "plans"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/growth.py"),
            *("--history", "0,2000", "--backlogs", "300,1500", "--messages", "300", "--batch", "200"),
            *("--claims", "5", "--ingests", "10", "--chunk", "700", "--warm-messages", "200"),
            *("--explain", str(plans), "--json", str(out), "--retention", "500"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    points = json.loads(out.read_text())
    assert [(p["history"], p["backlog"]) for p in points] == [(0, 300), (0, 1500), (2000, 300), (2000, 1500)]
    for p in points:
        for key, _, _ in COLUMNS:
            assert p[key] > 0 or key in ("history",), (key, p)
        assert p["claim_p99_ms"] >= p["claim_p50_ms"] and p["ingest_p99_ms"] >= p["ingest_p50_ms"], p
        assert {"claim_batch", "route_finalize_insert", "transform_finalize_insert"} <= set(p["statements"]), p
        assert set(STAGED) <= set(p["sizes"]) and "message_events_message" in p["sizes"], p["sizes"]
    # 2,000 messages of history take room: each staged table grew between the two history sizes
    for table in STAGED:
        assert points[2]["sizes"][table] > points[0]["sizes"][table], table

    # the printed curve: a header with every column and one row a point
    header = next(line for line in run.stdout.splitlines() if line.startswith("| history (messages)"))
    assert [c.strip() for c in header.strip("|").split("|")] == [title for _, title, _ in COLUMNS]
    rows = [line for line in run.stdout.splitlines() if re.match(r"\| [\d,]+ \| [\d,]+ \| [\d,]+ \|", line)]
    assert len(rows) == 4, run.stdout
    assert "a million messages" in run.stdout and "100 M messages" in run.stdout
    # retention reached the 500 oldest messages (and, as its batches' clock moves on, a few more)
    retained = re.search(r"reaching the oldest 500 messages: deleted (\{.*?\}) in", run.stdout)
    assert retained, run.stdout
    counts = json.loads(retained.group(1).replace("'", '"'))
    assert min(counts["inbound"], counts["routed"], counts["outbound"]) >= 500 and counts["events"] >= 4000, counts

    # plans with buffers for the claim, the finalizes and the ingest statement, per history size
    for h in (0, 2000):
        log = (plans / f"plans-{h}.log").read_text()
        assert "Buffers:" in log
        for statement in ("status = 'in_flight', lease_owner", "INSERT INTO stage_routed", "INSERT INTO stage_inbound"):
            assert statement in log, (h, statement)
