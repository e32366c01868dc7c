"""HAProxy in the lab: where its binary is, and what it thinks of a backend's servers.

Both the MLLP VIP (`two_nodes.py`, `GET /leader`) and the replicated store's entry point
(`replicated_store.py`, `GET /primary`) are HAProxy backends whose health the tests read.
"""

from __future__ import annotations

import os
import urllib.request

HAPROXY = os.environ.get("STAGELINE_HAPROXY", "/usr/sbin/haproxy")


def vip_servers(stats_port: int, backend: str = "mllp_leader") -> dict[str, str]:
    """HAProxy's view of a backend from its CSV status page: server name → status (UP, DOWN, ...)."""
    import csv
    import io

    with urllib.request.urlopen(f"http://127.0.0.1:{stats_port}/;csv", timeout=2) as resp:
        rows = csv.DictReader(io.StringIO(resp.read().decode().lstrip("# ")))
        return {
            r["svname"]: r["status"]
            for r in rows
            if r["pxname"] == backend and r["svname"] not in ("FRONTEND", "BACKEND")
        }
