"""What the whole-pipeline lab tests check after a fault: the drain, the first delivery after it, and
that stopping the lab left no process or port behind."""

from __future__ import annotations

from typing import Any

import psutil

from include.app.lab.postgres_server import wait_for
from include.app.supervisor import port_open
from tests.support.stream import Stream


def drained(lab: Any, stream: Stream, *, timeout: float) -> bool:
    """Whether every `AA`'d message is delivered and nothing is left staged within `timeout` s."""

    def done() -> bool:
        try:
            delivered = {d["control_id"] for d in lab.deliveries()}
            return all(s.control_id in delivered for s in stream.acked()) and not lab.backlog()
        except Exception:  # the store may be briefly unreachable (a fault): not drained yet
            return False

    try:
        wait_for(done, timeout=timeout, interval=0.5, what="the drain")
        return True
    except TimeoutError:
        return False


def first_delivery_after(stream: Stream, deliveries: list[dict], t0: float) -> float | None:
    """Seconds from t0 to the first delivery of a message first sent at or after t0."""
    post = {cid for cid, s in stream.ledger.items() if s.first_try >= t0}
    firsts = [d["t"] for d in deliveries if d["control_id"] in post]
    return min(firsts) - t0 if firsts else None


def tree(pids: dict[str, int | None]) -> dict[str, psutil.Process]:
    """Every named process and its descendants, by `name[pid]` / `name/pid`."""
    procs: dict[str, psutil.Process] = {}
    for name, pid in pids.items():
        if pid is None:
            continue
        try:
            root = psutil.Process(pid)
            procs[f"{name}[{pid}]"] = root
            for child in root.children(recursive=True):
                procs[f"{name}/{child.pid}"] = child
        except psutil.NoSuchProcess:
            pass
    return procs


def left_behind(procs: dict[str, psutil.Process], ports: dict[str, int]) -> tuple[list[str], list[str]]:
    """(processes still alive 10 s on, ports still open) of what a stopped lab ran."""
    _, alive = psutil.wait_procs(list(procs.values()), timeout=10)
    return (
        sorted(name for name, p in procs.items() if p in alive),
        sorted(f"{name}:{port}" for name, port in ports.items() if port_open(port)),
    )
