"""Watching a running listenerd from outside while something is done to it: `/health` asked every
100 ms (each answer's latency), its resident memory and open descriptors read from /proc. Used by
the hostile-input matrix (tests/listeners/test_hostile_matrix.py)."""

from __future__ import annotations

import http.client
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HEALTH_TIMEOUT = 5.0  # a /health that does not answer within this counts as this long


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fd_targets(pid: int) -> dict[str, str]:
    targets = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            pass
    return targets


def fds_back(pid: int, baseline: dict[str, str], seconds: float) -> tuple[bool, float, list[str]]:
    """Wait up to `seconds` for listenerd's descriptors to be no more than the baseline's count:
    (back, how long it took, the extra ones at the deadline if not)."""
    started = time.monotonic()
    while len(os.listdir(f"/proc/{pid}/fd")) > len(baseline):
        if time.monotonic() - started > seconds:
            now = fd_targets(pid)
            return False, seconds, sorted(f"{fd}→{t}" for fd, t in now.items() if baseline.get(fd) != t)
        time.sleep(0.05)
    return True, time.monotonic() - started, []


def health_once(port: int) -> tuple[float, int]:
    """(latency in seconds, status; 0 = no answer) of one GET /health on a new connection."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HEALTH_TIMEOUT)
    try:
        conn.request("GET", "/health")
        status = conn.getresponse().status
    except OSError:
        return HEALTH_TIMEOUT, 0
    finally:
        conn.close()
    return time.monotonic() - started, status


@dataclass(eq=False)  # a thread is hashed by identity
class Watch(threading.Thread):
    """Polls /health every `interval` and samples RSS until stopped."""

    pid: int
    api_port: int
    interval: float = 0.1
    latencies: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    rss_peak: float = 0.0

    def __post_init__(self) -> None:
        super().__init__(name="watch", daemon=True)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            started = time.monotonic()
            latency, status = health_once(self.api_port)
            self.latencies.append(latency)
            self.statuses.append(status)
            try:
                self.rss_peak = max(self.rss_peak, rss_mb(self.pid))
            except OSError:
                pass
            self.halt.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def stop(self) -> Watch:
        self.halt.set()
        self.join(HEALTH_TIMEOUT + 1)
        return self

    @property
    def worst(self) -> float:
        return max(self.latencies, default=float("nan"))

    @property
    def unhealthy(self) -> int:
        return sum(1 for s in self.statuses if s != 200)
