"""The soak bench's verdict (bench/soak_verdict.py): a steady run passes; a backlog or a p99 that
climbs minute over minute fails even below its bound; one noisy minute is no trend but breaks the
bound it crosses; a process, the WAL or a table (per row kept) that keeps growing over the last
half fails; every negative answer, lock error, failed task, lost or undelivered message fails; a
run too short to judge a trend says so instead of passing it silently."""

from __future__ import annotations

import pytest

from bench.soak import process_group
from bench.soak_verdict import MIB, Limits, growth_failure, theil_sen_slope, trend_failure, verdict

RATE = 200.0
LIMITS = Limits(rate=RATE)
CLEAN = {"not_delivered": 0, "lost": 0, "dead": 0, "unrouted": 0}


def minute(
    m: int,
    *,
    backlog: float = 300,
    p99: float = 2.5,
    rss: float = 600 * MIB,
    wal: float = 4 * MIB,
    table_bytes: float | None = None,
    rows: int | None = None,
    phase: str | None = None,
    **extra,
) -> dict:
    row = {
        "minute": m,
        "phase": phase or ("warmup" if m <= 2 else "judged"),
        "acks": {"AA": 12_000, "AE": 0, "AR": 0, "timeout": 0, "conn_error": 0},
        "backlog": {"inbound": backlog, "routed": backlog, "outbound": backlog},
        "delivered": {"n": 18_000, "p50": 1.4, "p99": p99, "max": p99 + 0.3},
        "lock_errors": 0,
        "failed_tasks": 0,
        "rss_max": {"spark driver": rss, "listenerd": 48 * MIB},
        "wal_bytes": wal,
        "tables": None,
        "dead_tuples": None,
    }
    if table_bytes is not None:
        row["tables"] = {"stage_inbound": {"bytes": table_bytes, "rows": rows}}
    row.update(extra)
    return row


def run(n: int = 30, **per_minute) -> list[dict]:
    """`n` minutes, each keyword a function of the minute number giving that field."""
    return [minute(m, **{k: f(m) for k, f in per_minute.items()}) for m in range(1, n + 1)]


NOISE = [0, 40, -30, 25, -45, 10, 35, -20, 5, -40]  # a fixed ± jitter, no randomness in tests


def test_a_flat_run_passes() -> None:
    rows = run(
        backlog=lambda m: 300 + NOISE[m % 10],
        p99=lambda m: 2.5 + NOISE[m % 10] / 100,
        rss=lambda m: (600 + NOISE[m % 10] / 4) * MIB,
    )
    v = verdict(rows, CLEAN, LIMITS)
    assert v.ok, v.failures
    assert v.notes == []


def test_a_backlog_growing_minute_over_minute_fails_before_it_reaches_the_bound() -> None:
    rows = run(backlog=lambda m: 300 + 120 * m)  # 660 → 3,900 rows: under the 6,000-row bound throughout
    v = verdict(rows, CLEAN, LIMITS)
    assert not any("above" in f for f in v.failures)
    assert [f.split(" grows")[0] for f in v.failures] == ["inbound backlog", "routed backlog", "outbound backlog"]


def test_a_single_spike_is_no_trend_but_breaks_the_p99_bound() -> None:
    rows = run(p99=lambda m: 9.0 if m == 17 else 2.5 + NOISE[m % 10] / 100)
    v = verdict(rows, CLEAN, LIMITS)
    assert len(v.failures) == 1
    assert v.failures[0].startswith("delivered p99 above 5 s in 1 minute(s) (min 17: 9 s)")


def test_a_single_backlog_spike_breaks_the_bound_only() -> None:
    rows = run(backlog=lambda m: 7_000 if m == 20 else 300)
    assert verdict(rows, CLEAN, LIMITS).failures == [
        "inbound backlog (rows) above 6000 in 1 minute(s) (min 20: 7000)",
        "routed backlog (rows) above 6000 in 1 minute(s) (min 20: 7000)",
        "outbound backlog (rows) above 6000 in 1 minute(s) (min 20: 7000)",
    ]


def test_a_p99_creeping_up_fails_as_a_trend() -> None:
    rows = run(p99=lambda m: 1.5 + 0.08 * m)  # 1.7 → 3.9 s: within 5 s, but 2.2 s up over the run
    v = verdict(rows, CLEAN, LIMITS)
    assert len(v.failures) == 1 and v.failures[0].startswith("delivered p99 grows minute over minute")


def test_a_step_that_comes_back_down_is_no_trend() -> None:
    rows = run(backlog=lambda m: 2_500 if 12 <= m <= 16 else 300)
    assert verdict(rows, CLEAN, LIMITS).ok


def test_warmup_minutes_are_reported_but_not_judged() -> None:
    rows = run(p99=lambda m: 30.0 if m <= 2 else 2.5, backlog=lambda m: 9_000 if m == 1 else 300)
    assert verdict(rows, CLEAN, LIMITS).ok


def test_the_drain_counts_against_the_p99_bound() -> None:
    rows = run() + [minute(0, phase="drain", p99=7.5, backlog=0)]
    assert verdict(rows, CLEAN, LIMITS).failures == ["delivered p99 above 5 s in 1 minute(s) (drain: 7.5 s)"]


def test_negative_acks_lock_errors_failed_tasks_and_losses_each_fail() -> None:
    rows = run(n=8)
    rows[1]["acks"]["AE"] = 3  # a warm-up minute: counts still count
    rows[5]["acks"]["timeout"] = 1
    rows[6]["lock_errors"] = 2
    rows[7]["failed_tasks"] = 1
    totals = {**CLEAN, "not_delivered": 4, "lost": 1}
    assert verdict(rows, totals, LIMITS).failures == [
        "4 message(s) not delivered after the drain",
        "1 message(s) ACKed AA but never staged (lost)",
        "3 AE answer(s) to senders",
        "1 timeout answer(s) to senders",
        "2 lock error line(s) in the stack's logs",
        "1 failed or retried Airflow task tr(ies)",
    ]


def test_rss_growing_over_the_last_half_fails_but_noise_and_growth_before_it_do_not() -> None:
    leaking = run(n=40, rss=lambda m: (600 + 8 * m) * MIB)  # +13% between the thirds of minutes 22–40
    assert [f.split(" grew")[0] for f in verdict(leaking, CLEAN, LIMITS).failures] == ["RSS of spark driver"]
    warming = run(n=40, rss=lambda m: min(600, 300 + 30 * m) * MIB)  # grows, then flat for the last half
    assert verdict(warming, CLEAN, LIMITS).ok


def test_wal_growth_below_its_floor_does_not_count() -> None:
    rows = run(n=40, wal=lambda m: 1 * MIB + m * 40_000)  # doubles, but by ~1 MiB only
    assert verdict(rows, CLEAN, LIMITS).ok
    rows = run(n=40, wal=lambda m: m * 2 * MIB)
    assert [f.split(" grew")[0] for f in verdict(rows, CLEAN, LIMITS).failures] == ["WAL"]


def test_a_table_is_judged_per_row_kept_so_retained_rows_are_not_growth() -> None:
    # 12,000 rows a minute at 500 bytes a row: the table grows with every row retention keeps.
    kept = run(n=40, table_bytes=lambda m: m * 12_000 * 500, rows=lambda m: m * 12_000)
    assert verdict(kept, CLEAN, LIMITS).ok
    # Purged every 10 minutes (retention): the size falls with the rows, per row it stays flat.
    purged = run(n=40, table_bytes=lambda m: (m % 10 + 1) * 12_000 * 500, rows=lambda m: (m % 10 + 1) * 12_000)
    assert verdict(purged, CLEAN, LIMITS).ok
    # Bloat: the same rows take more bytes each as the run goes on.
    bloating = run(n=40, table_bytes=lambda m: m * 12_000 * (500 + 10 * m), rows=lambda m: m * 12_000)
    assert [f.split(" grew")[0] for f in verdict(bloating, CLEAN, LIMITS).failures] == [
        "table stage_inbound (bytes per row)"
    ]


def test_a_table_that_keeps_no_rows_is_judged_by_its_bytes() -> None:
    def landing(bytes_of):
        rows = run(n=40)
        for r in rows:
            r["tables"] = {"landing_outbound": {"bytes": bytes_of(r["minute"]), "rows": (r["minute"] * 7) % 50}}
        return rows

    assert verdict(landing(lambda m: 3 * MIB), CLEAN, LIMITS).ok
    assert [f.split(" grew")[0] for f in verdict(landing(lambda m: m * MIB), CLEAN, LIMITS).failures] == [
        "table landing_outbound (bytes)"
    ]


def test_sizes_measured_every_few_minutes_are_judged_on_the_minutes_that_have_them() -> None:
    rows = run(n=60, table_bytes=lambda m: m * 12_000 * (500 + 10 * m), rows=lambda m: m * 12_000)
    for r in rows:
        if r["minute"] % 5:
            r["tables"] = None
    assert [f.split(" grew")[0] for f in verdict(rows, CLEAN, LIMITS).failures] == [
        "table stage_inbound (bytes per row)"
    ]


def test_a_short_run_says_what_it_could_not_judge() -> None:
    rows = run(n=3, p99=lambda m: 2.0)
    v = verdict(rows, CLEAN, LIMITS)
    assert v.ok
    assert v.notes[0] == "trends not judged: 1 judged minute(s), 6 needed"
    assert v.notes[1].startswith("growth not judged for")


def test_theil_sen_ignores_one_outlier() -> None:
    xs = list(range(10))
    assert theil_sen_slope(xs, [1.0] * 9 + [100.0]) == 0.0
    assert theil_sen_slope(xs, [2.0 * x for x in xs]) == pytest.approx(2.0)


def test_trend_and_growth_need_enough_points() -> None:
    assert trend_failure("x", [1, 2, 3], [1, 100, 1000], rise_bound=1) is None
    assert growth_failure("x", [1, 2, 3], limit=0.1, floor=0) is None


@pytest.mark.parametrize(
    ("argv", "group"),
    [
        (["/work/main/.venv/bin/python", "-m", "listeners.daemon", "--service-config", "s.toml"], "listenerd"),
        (
            ["/usr/lib/jvm/java-17-openjdk-amd64/bin/java", "-cp", "x", "org.apache.spark.deploy.SparkSubmit"],
            "spark driver",
        ),
        (["/work/main/.venv/bin/python", "-m", "pyspark.daemon", "pyspark.worker"], "spark python"),
        (
            ["/work/main/.venv/bin/python", "/work/main/.venv/bin/airflow", "scheduler", "--skip-serve-logs"],
            "scheduler",
        ),
        (["/work/main/.venv/bin/python", "/work/main/.venv/bin/airflow", "dag-processor"], "dag-processor"),
        (["airflow api_server -- host:127.0.0.1 port:8080"], "api-server"),
        (["airflow worker -- LocalExecutor: <idle>"], "executor slot"),
        (["airflow worker -- 01a21b01-9f62-71b7-9ca1-f46b921650bd"], "task runner"),
        (
            ["/work/main/.venv/bin/python", "-m", "include.app.cli", "demo", "receive", "--port", "2576"],
            "demo-receiver",
        ),
        (["/work/main/.venv/bin/python", "-m", "include.app.demo", "--port", "2576", "--out", "x"], "demo-receiver"),
        (["airflow scheduler"], "scheduler"),
        (["airflow dag-processor"], "dag-processor"),
        (
            ["/work/main/.venv/bin/python", "/work/main/.venv/bin/stageline", "up", "--service-config", "x"],
            "stageline up",
        ),
    ],
)
def test_processes_are_grouped_by_what_they_run(argv: list[str], group: str) -> None:
    assert process_group(argv) == group


def test_a_log_record_written_to_two_logs_counts_once_and_only_new_lines_count(tmp_path) -> None:
    from bench.soak import LogTail

    task = tmp_path / "airflow" / "attempt=1.log"
    task.parent.mkdir()
    scheduler = tmp_path / "airflow-scheduler.log"
    task.write_text(
        '{"timestamp":"2026-11-27T03:23:49.016919Z","event":"slow write transaction took 287 ms: '
        'fence_shared, renew_claims"}\n'
    )
    scheduler.write_text(
        "2026-11-27 03:23:49.016919+00:00 [warning  ] slow write transaction took 287 ms: "
        "fence_shared, renew_claims [include.store.db]\n"
    )
    tail = LogTail([tmp_path])
    first = tail.scan()
    assert (first.lock_waits, first.longest_write_ms, first.lock_errors) == (1, 287.0, 0)
    with open(scheduler, "a") as f:
        f.write(
            "2026-11-27 03:24:00.000001+00:00 [warning  ] slow statement claim_lane_heads took 340 ms (9 rows)\n"
            "sqlite3.OperationalError: database is locked\n"
            "2026-11-27 03:24:01.000001+00:00 [warning  ] half a line, not yet ended"
        )
    second = tail.scan()
    assert (second.lock_waits, second.lock_errors, second.slow) == (0, 1, [(340.0, "claim_lane_heads")])
    assert tail.scan().lock_errors == 0
