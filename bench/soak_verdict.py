"""The soak bench's verdict (bench/soak.py): small pure functions over the per-minute rows it records.

A row is the dict soak.py prints and writes to its JSON-lines file; the verdict reads only these keys:

    minute        1, 2, ... (the drain after the last minute is minute 0)
    phase         "warmup" (reported, not judged), "judged", or "drain"
    acks          {"AA": n, "AE": n, "AR": n, "timeout": n, "conn_error": n}
    backlog       {"inbound": rows, "routed": rows, "outbound": rows}   not finished at the minute's end
    delivered     {"n": deliveries, "p50": s, "p99": s, "max": s}       of the rows delivered in the minute
    lock_errors   log lines naming a lock failure that appeared in the minute
    failed_tasks  Airflow task tries newly failed or up for retry in the minute
    rss_max       {group: bytes}: the largest process of each group of the stack's process tree
    wal_bytes     SQLite: size of the -wal file; PostgreSQL: WAL bytes written in the minute
    tables        {table: {"bytes": table + indexes, "rows": rows}} or None when not measured
    dead_tuples   PostgreSQL: {table: n_dead_tup}, else None

How each kind of failure is judged (all bounds in `Limits`):

- **Counts** over the whole run, warm-up included: any AE, AR, ACK timeout or connection error,
  lock error in the logs, or failed task try fails the run; so does any message not delivered after
  the drain, any message ACKed `AA` but never staged (lost), dead or unrouted.
- **Bounds** on each judged minute and the drain: delivered p99 above `p99_s`; a stage backlog
  above `backlog_seconds` of traffic (`rate × backlog_seconds` rows).
- **Trends** over the judged minutes (at least `min_trend_points`): a series fails when it rises by
  more than its bound over the run by BOTH measures: the Theil–Sen slope (the median of the slopes
  between every pair of minutes: a single spike, however tall, moves it hardly at all) times the
  run's length, and the median of the last third of the minutes over the median of the first
  third (a step up that stays; two thirds of the bound, which is how far apart those medians are
  on a straight line rising by the bound). Bounds: a third of the backlog bound (`rate × backlog_seconds / 3`
  rows) for each stage's backlog, `p99_rise_s` for the delivered p99. A slow steady climb that has
  not reached a bound yet is what this catches: it would reach it in a longer run.
- **Growth** over the last half of the judged minutes (at least `min_growth_points` values, so
  sizes measured every few minutes still count): the median of the window's last third against the
  median of its first third; more than `growth_limit` (10 %) and more than the series' floor
  (small absolute changes never count) fails. Series: each process group's largest RSS; the WAL
  (SQLite's file; PostgreSQL's bytes written per minute, which at a steady rate stays flat unless a
  statement writes more as the table grows); each table's bytes **per row kept** when its rows
  grew over the window (retention's share: a table grows with the rows retention keeps — with the
  default 7 days, all of them — so what must stay flat is the size per row; bloat, dead space and
  index churn show up there), else its bytes (floor `table_min_bytes`: a landing table, or a hot
  table once retention purges as much as arrives, must not grow at all); PostgreSQL's dead tuples
  per table (autovacuum must keep up).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

STAGES = ("inbound", "routed", "outbound")
NEGATIVE_ACKS = ("AE", "AR", "timeout", "conn_error")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    rate: float
    """Messages per second sent (the backlog bounds are seconds of this traffic)."""
    p99_s: float = 5.0
    backlog_seconds: float = 30.0
    p99_rise_s: float = 1.0
    min_trend_points: int = 6
    growth_limit: float = 0.10
    min_growth_points: int = 4
    rss_floor: float = 16 * MIB
    wal_floor: float = 4 * MIB
    table_min_bytes: float = 1 * MIB
    """Tables smaller than this at the window's end are not judged (a few pages jump by 10 %)."""

    @property
    def backlog_max(self) -> float:
        return self.rate * self.backlog_seconds

    @property
    def backlog_rise(self) -> float:
        return self.backlog_max / 3

    @property
    def dead_tuple_floor(self) -> float:
        return self.rate * 60  # a minute of rows


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What could not be judged (too few minutes), so a short run does not look like a pass it is not."""

    @property
    def ok(self) -> bool:
        return not self.failures


def theil_sen_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The median of the slopes between every pair of points (robust to outliers); 0 for < 2 points."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]
    ]
    return statistics.median(slopes) if slopes else 0.0


def thirds(ys: Sequence[float]) -> tuple[float, float]:
    """The medians of the first and the last third of `ys` (at least one value each)."""
    k = max(1, len(ys) // 3)
    return statistics.median(ys[:k]), statistics.median(ys[-k:])


def trend_failure(
    what: str, xs: Sequence[float], ys: Sequence[float], *, rise_bound: float, unit: str = "", min_points: int = 6
) -> str | None:
    """Why `ys` (over minutes `xs`) is a rising trend, or None: it must rise by more than
    `rise_bound` over the span by the Theil–Sen slope AND by the last third's median over the first's
    (by two thirds of the bound: the thirds' medians of a straight line are two thirds of its span apart)."""
    if len(ys) < min_points:
        return None
    span = xs[-1] - xs[0]
    rise = theil_sen_slope(xs, ys) * span
    first, last = thirds(ys)
    if rise > rise_bound and last - first > rise_bound * 2 / 3:
        return (
            f"{what} grows minute over minute: +{rise:.4g}{unit} over {span:g} min by its Theil–Sen slope, "
            f"median {first:.4g}{unit} in the first third → {last:.4g}{unit} in the last "
            f"(bound +{rise_bound:.4g}{unit})"
        )
    return None


def growth_failure(
    what: str,
    ys: Sequence[float],
    *,
    limit: float,
    floor: float,
    unit: str = "",
    scale: float = 1.0,
    min_points: int = 4,
) -> str | None:
    """Why `ys` (one window, oldest first) grew by more than `limit` (a fraction) and more than `floor`
    (absolute), comparing the medians of its first and last thirds; None if it did not, or too few points."""
    if len(ys) < min_points:
        return None
    first, last = thirds(ys)
    if last - first > floor and last > first * (1 + limit):
        pct = (last / first - 1) * 100 if first > 0 else float("inf")
        return (
            f"{what} grew {pct:.0f}% over the last half of the run "
            f"({first / scale:.4g}{unit} → {last / scale:.4g}{unit}; limit {limit:.0%})"
        )
    return None


def bound_failures(what: str, points: Iterable[tuple[Any, float | None]], bound: float, unit: str = "") -> str | None:
    """Which (label, value) points exceed `bound`, as one failure line, or None."""
    over = [(label, v) for label, v in points if v is not None and v > bound]
    if not over:
        return None
    shown = ", ".join(f"{label}: {v:.4g}{unit}" for label, v in over[:8]) + (" …" if len(over) > 8 else "")
    return f"{what} above {bound:.4g}{unit} in {len(over)} minute(s) ({shown})"


def _label(row: dict) -> str:
    return "drain" if row.get("phase") == "drain" else f"min {row['minute']}"


def last_half(rows: Sequence[dict]) -> list[dict]:
    """The judged minutes of the second half of the run (by minute number)."""
    judged = [r for r in rows if r.get("phase") == "judged"]
    if not judged:
        return []
    first, last = judged[0]["minute"], judged[-1]["minute"]
    middle = first + (last - first) / 2
    return [r for r in judged if r["minute"] >= middle]


def table_series(samples: Sequence[dict], *, limit: float) -> tuple[list[float], bool]:
    """A table's judged values over the window, and whether they are per row: bytes per row kept
    when its rows grew over the window (retention keeps them; its share of the size is then the
    rows'), else its bytes (a table whose rows stay level — a landing table, a hot table once
    retention purges as much as arrives — must stay level in bytes too)."""
    rows = [s.get("rows") or 0 for s in samples]
    first, last = thirds(rows) if rows else (0, 0)
    if last > 0 and last > first * (1 + limit):
        return [s["bytes"] / s["rows"] for s in samples if (s.get("rows") or 0) > 0], True
    return [s["bytes"] for s in samples], False


def verdict(rows: Sequence[dict], totals: dict, limits: Limits) -> Verdict:
    """Every failure of a soak run (its minute rows and end totals), with notes on what was not judged."""
    v = Verdict()
    fail = v.failures.append

    # Counts over the whole run.
    for key, why in (
        ("not_delivered", "message(s) not delivered after the drain"),
        ("lost", "message(s) ACKed AA but never staged (lost)"),
        ("dead", "row(s) dead-lettered"),
        ("unrouted", "message(s) unrouted"),
    ):
        if totals.get(key):
            fail(f"{totals[key]:,} {why}")
    for key in NEGATIVE_ACKS:
        n = sum(r["acks"].get(key, 0) for r in rows)
        if n:
            fail(f"{n:,} {key} answer(s) to senders")
    for key, why in (
        ("lock_errors", "lock error line(s) in the stack's logs"),
        ("failed_tasks", "failed or retried Airflow task tr(ies)"),
    ):
        n = sum(r.get(key) or 0 for r in rows)
        if n:
            fail(f"{n:,} {why}")

    # Bounds per minute (after the warm-up; the drain's deliveries count too).
    bounded = [r for r in rows if r.get("phase") in ("judged", "drain")]
    for line in (
        bound_failures("delivered p99", [(_label(r), r["delivered"].get("p99")) for r in bounded], limits.p99_s, " s"),
        *(
            bound_failures(
                f"{stage} backlog (rows)", [(_label(r), r["backlog"].get(stage)) for r in bounded], limits.backlog_max
            )
            for stage in STAGES
        ),
    ):
        if line:
            fail(line)

    # Trends over the judged minutes.
    judged = [r for r in rows if r.get("phase") == "judged"]
    if len(judged) < limits.min_trend_points:
        v.notes.append(f"trends not judged: {len(judged)} judged minute(s), {limits.min_trend_points} needed")
    else:
        for stage in STAGES:
            pts = [(r["minute"], r["backlog"][stage]) for r in judged if r["backlog"].get(stage) is not None]
            line = trend_failure(
                f"{stage} backlog",
                [p[0] for p in pts],
                [p[1] for p in pts],
                rise_bound=limits.backlog_rise,
                unit=" rows",
                min_points=limits.min_trend_points,
            )
            if line:
                fail(line)
        pts = [(r["minute"], r["delivered"]["p99"]) for r in judged if r["delivered"].get("p99") is not None]
        line = trend_failure(
            "delivered p99",
            [p[0] for p in pts],
            [p[1] for p in pts],
            rise_bound=limits.p99_rise_s,
            unit=" s",
            min_points=limits.min_trend_points,
        )
        if line:
            fail(line)

    # Growth over the last half.
    window = last_half(rows)
    series: list[tuple[str, list[float], float, str, float]] = []  # (what, values, floor, unit, scale)
    groups = sorted({g for r in window for g in (r.get("rss_max") or {})})
    for g in groups:
        series.append(
            (
                f"RSS of {g}",
                [r["rss_max"][g] for r in window if (r.get("rss_max") or {}).get(g)],
                limits.rss_floor,
                " MiB",
                MIB,
            )
        )
    series.append(
        ("WAL", [r["wal_bytes"] for r in window if r.get("wal_bytes") is not None], limits.wal_floor, " MiB", MIB)
    )
    measured = [r["tables"] for r in window if r.get("tables")]
    for t in sorted({t for tables in measured for t in tables}):
        if not measured or (measured[-1].get(t) or {}).get("bytes", 0) < limits.table_min_bytes:
            continue
        values, by_row = table_series([tables[t] for tables in measured if t in tables], limit=limits.growth_limit)
        series.append(
            (f"table {t} (bytes per row)", values, 0.0, " B/row", 1.0)
            if by_row
            else (f"table {t} (bytes)", values, limits.table_min_bytes, " MiB", MIB)
        )
    for t in sorted({t for r in window for t in (r.get("dead_tuples") or {})}):
        series.append(
            (
                f"dead tuples of {t}",
                [r["dead_tuples"][t] for r in window if t in (r.get("dead_tuples") or {})],
                limits.dead_tuple_floor,
                "",
                1.0,
            )
        )
    short = [what for what, ys, *_ in series if len(ys) < limits.min_growth_points]
    for what, ys, floor, unit, scale in series:
        line = growth_failure(
            what,
            ys,
            limit=limits.growth_limit,
            floor=floor,
            unit=unit,
            scale=scale,
            min_points=limits.min_growth_points,
        )
        if line:
            fail(line)
    if short:
        v.notes.append(
            f"growth not judged for {len(short)} series (fewer than {limits.min_growth_points} "
            f"values in the last half): {', '.join(short[:6])}{' …' if len(short) > 6 else ''}"
        )
    return v
