"""Each destination's and each inbound connection's health, read from the staged tables: what is
open now (queued, retrying, in flight, dead letters, the oldest waiting), what happened in a time
window (received, filtered, sent, dead-lettered) and how long deliveries took (p50/p95 from a
message's arrival to its receiver's answer).

`stageline stages --by destination|connection`, listenerd's `GET /stages?by=…`, the Stageline view
and listenerd's `/metrics` (listeners/store_metrics.py) all read it here. Every statement reads a
partial index of the stages — the open rows, the dead letters, or the finished rows of the window
— so what one costs grows with the backlog and the window's traffic, never with the history kept
(tests/store/test_statement_plans.py reads their plans). Windows are on the database clock.

What each figure means, for a destination (its routed and outbound rows) and for a connection
(its inbound rows, and the routed and outbound rows of its messages):

  received    rows that came in within the window (a destination: messages routed to it)
  filtered    messages no route took (`unrouted`; connections only)
  queued      rows waiting their turn (`pending`)
  retrying    rows backing off after a failed attempt (`error`)
  in_flight   rows a stage task holds now
  sent        deliveries done within the window
  dead        dead letters: all of them now, and those dead-lettered within the window
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from include.store.db import OUTBOUND, ROUTED, Store

BY = ("destination", "connection")
WINDOWS = {"5m": 300, "1h": 3600}
"""The windows reported, by name: seconds back from the database's now."""
DELIVERY_SAMPLE = 20_000
"""The most deliveries one window's latency is computed from (the newest); past it the window's
percentiles say `sampled`."""
STATES = ("queued", "retrying", "in_flight", "dead")
_STATE_OF = {"pending": "queued", "error": "retrying", "in_flight": "in_flight", "dead": "dead"}
OUTCOMES = ("received", "filtered", "sent", "dead")


@dataclass
class Flow:
    """What happened to one destination's or connection's rows within [since_ms, until_ms)."""

    counts: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    """{(by, name): {outcome: n}} for by in BY and outcome in OUTCOMES."""
    deliveries: list[dict[str, Any]] = field(default_factory=list)
    """The window's deliveries done (destination, connection, finished_ms, latency_ms), newest first."""
    sampled: bool = False
    """True when there were more than the delivery limit: `deliveries` holds the newest."""
    opened: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """The rows open now, as `open_rows` gives them (read in the same pass: a window's received
    count needs the open rows anyway)."""

    def add(self, by: str, name: str | None, outcome: str, n: int) -> None:
        if n:
            row = self.counts.setdefault((by, name or "?"), dict.fromkeys(OUTCOMES, 0))
            row[outcome] += n


def db_now_ms(store: Store) -> int:
    with store.transaction(write=False) as tx:
        row = tx.one("db_now")
    assert row is not None
    return int(float(row["db_now"]) * 1000)


def flow(store: Store, since_ms: int, until_ms: int, *, deliveries: int = DELIVERY_SAMPLE) -> Flow:
    """What came in, was filtered, was sent and died within [since_ms, until_ms), per destination
    and connection, and the window's newest `deliveries` deliveries (0: none read)."""
    window = {"since_ms": int(since_ms), "until_ms": int(until_ms)}
    out = Flow()
    with store.transaction(write=False) as tx:
        opened = _read_open(tx, window)
        rows = [*opened, *({**r, "table": "inbound"} for r in tx.all("stats_inbound_finished", window))]
        for table in (ROUTED, OUTBOUND):
            rows += [{**r, "table": table.key} for r in tx.all("stats_finished", window, table=table)]
        if deliveries > 0:
            out.deliveries = tx.all("stats_deliveries", {**window, "limit": deliveries + 1})
    if len(out.deliveries) > deliveries:
        out.deliveries, out.sampled = out.deliveries[:deliveries], True
    out.opened = _open_states(opened)
    for r in rows:
        table, status = r["table"], r["status"]
        received, finished = int(r.get("received") or 0), int(r.get("finished") or 0)
        if table == "routed":  # a destination receives a message when it is routed to it
            out.add("destination", r["destination"], "received", received)
        if table == "inbound":
            out.add("connection", r["connection"], "received", received)
            if status == "unrouted":
                out.add("connection", r["connection"], "filtered", finished)
        if status == "dead":
            out.add("connection", r["connection"], "dead", finished)
            if table != "inbound":
                out.add("destination", r["destination"], "dead", finished)
        if status == "done" and table == "outbound":
            out.add("connection", r["connection"], "sent", finished)
            out.add("destination", r["destination"], "sent", finished)
    return out


def open_rows(store: Store) -> dict[tuple[str, str], dict[str, Any]]:
    """{(by, name): {state: n, …, "oldest_ms": the oldest queued or retrying row}} now."""
    with store.transaction(write=False) as tx:
        return _open_states(_read_open(tx, {"since_ms": 0, "until_ms": 0}))


def _read_open(tx: Any, window: dict[str, int]) -> list[dict[str, Any]]:
    """The open rows and dead letters of every stage, grouped; each row names its table."""
    rows = [{**r, "table": "inbound"} for r in tx.all("stats_inbound_open", window)]
    for table in (ROUTED, OUTBOUND):
        rows += [{**r, "table": table.key} for r in tx.all("stats_open", window, table=table)]
    return rows


def _open_states(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        state = _STATE_OF[r["status"]]
        keys = [("connection", r["connection"] or "?")]
        if r["destination"] is not None:
            keys.append(("destination", r["destination"]))
        for key in keys:
            row = found.setdefault(key, {**dict.fromkeys(STATES, 0), "oldest_ms": None})
            row[state] += int(r["n"])
            if state in ("queued", "retrying") and r["oldest_ms"] is not None:
                oldest = int(r["oldest_ms"])
                row["oldest_ms"] = oldest if row["oldest_ms"] is None else min(row["oldest_ms"], oldest)
    return found


def percentile(values: list[int], q: float) -> int | None:
    """The `q` quantile (0..1) of `values` by the nearest rank; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-int(q * 1000) * len(ordered) // 1000))  # ceil(q * n), in integers
    return ordered[min(rank, len(ordered)) - 1]


def latency(deliveries: Iterable[dict[str, Any]], by: str) -> dict[str, dict[str, float | None]]:
    """{name: {"p50_seconds", "p95_seconds", "deliveries"}} of `deliveries` grouped `by`."""
    grouped: dict[str, list[int]] = {}
    for d in deliveries:
        grouped.setdefault(d[by] or "?", []).append(max(0, int(d["latency_ms"])))
    return {
        name: {
            "p50_seconds": _seconds(percentile(values, 0.50)),
            "p95_seconds": _seconds(percentile(values, 0.95)),
            "deliveries": len(values),
        }
        for name, values in grouped.items()
    }


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else round(ms / 1000, 3)


def health(store: Store, *, by: str = "destination", chart: bool = False) -> dict[str, Any]:
    """Each destination's (or connection's) figures now and over WINDOWS, as `stageline stages
    --by` and `GET /stages?by=` answer them; `chart` adds each destination's deliveries done and
    dead-lettered per minute over the last hour (the view's chart). ValueError for another `by`."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}, got {by!r}")
    now = db_now_ms(store)
    current: dict[str, dict[str, Any]] = {}
    windows: dict[str, dict[str, dict[str, Any]]] = {}
    for label, seconds in WINDOWS.items():
        seen = flow(store, now - seconds * 1000, now + 1)
        current = current or {name: row for (kind, name), row in seen.opened.items() if kind == by}
        lat = latency(seen.deliveries, by)
        figures: dict[str, dict[str, Any]] = {}
        for (kind, name), counts in seen.counts.items():
            if kind == by:
                figures[name] = dict(counts)
        for name, figure in lat.items():
            figures.setdefault(name, dict.fromkeys(OUTCOMES, 0)).update(figure, sampled=seen.sampled)
        windows[label] = figures
    names = set(current).union(*windows.values())
    per_minute = _per_minute(store, now) if chart and by == "destination" else {}
    rows = []
    for name in sorted(names):
        state = current.get(name) or {**dict.fromkeys(STATES, 0), "oldest_ms": None}
        oldest = state["oldest_ms"]
        row: dict[str, Any] = {
            by: name,
            **{s: state[s] for s in STATES},
            "oldest_queued_seconds": None if oldest is None else round(max(0, now - oldest) / 1000, 1),
            "windows": {
                label: {
                    **dict.fromkeys(OUTCOMES, 0),
                    "p50_seconds": None,
                    "p95_seconds": None,
                    "deliveries": 0,
                    "sampled": False,
                    **windows[label].get(name, {}),
                }
                for label in WINDOWS
            },
        }
        if by == "destination":  # filtering happens before a message has a destination
            for w in row["windows"].values():
                w.pop("filtered", None)
        if chart and by == "destination":
            row["per_minute"] = per_minute.get(name, [])
        rows.append(row)
    return {"by": by, "now_ms": now, "windows": dict(WINDOWS), "rows": rows}


def _per_minute(store: Store, now_ms: int) -> dict[str, list[dict[str, int]]]:
    """{destination: [{minute_ms, sent, dead}] for each of the last 60 minutes, oldest first}."""
    first = (now_ms // 60_000 - 59) * 60_000
    with store.transaction(write=False) as tx:
        rows = tx.all("stats_per_minute", {"since_ms": first})
    minutes: dict[str, dict[int, dict[str, int]]] = {}
    for r in rows:
        series = minutes.setdefault(r["destination"], {})
        slot = series.setdefault(int(r["minute_ms"]), {"sent": 0, "dead": 0})
        slot["sent" if r["status"] == "done" else "dead"] += int(r["n"])
    return {
        name: [{"minute_ms": m, **series.get(m, {"sent": 0, "dead": 0})} for m in range(first, now_ms + 1, 60_000)]
        for name, series in minutes.items()
    }
