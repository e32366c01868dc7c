"""The per-process connection cache the MLLP and HTTP senders share.

Connection reuse: MLLP and HTTP connections are cached per worker process (Spark reuses Python
workers between tasks), keyed by the destination's whole config, at most one idle connection per
destination. A cached connection is used only if it has been idle less than
`idle_timeout_seconds`; an HTTP one only if it has nothing unread (a peer's close or stray bytes
make the socket readable: it is dropped), an MLLP one reads what it holds itself (late answers to
its earlier messages, `spark_jobs.senders.mllp`); after any failure, timeout or ACK mismatch the
connection is closed, never reused, so a late ACK cannot be matched to the next message. If a *reused*
connection turns out dead while sending, the message is sent once more on a fresh connection
(the receiver may then see it twice — the idempotency rules in `spark_jobs.senders` cover that).
`idle_timeout_seconds: 0` disables reuse.
"""

from __future__ import annotations

import http.client
import select
import ssl
import threading
import time
from collections.abc import Hashable
from typing import Any

from include.destinations_config import Destination

__all__ = ["POOL", "ConnectionPool", "close_quietly", "pool_key"]


class ConnectionPool:
    """At most one idle connection per key; a connection in use is out of the pool (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[Hashable, tuple[Any, float]] = {}

    def take(self, key: Hashable, idle_timeout: float, *, quiet_only: bool = True) -> Any | None:
        """The idle connection for `key`, if it has been idle less than `idle_timeout`; with
        `quiet_only`, only if nothing is readable on it (else the caller reads what is there)."""
        with self._lock:
            entry = self._idle.pop(key, None)
        if entry is None:
            return None
        conn, since = entry
        if time.monotonic() - since >= idle_timeout or (quiet_only and not _quiet(conn)):
            close_quietly(conn)
            return None
        return conn

    def give(self, key: Hashable, conn: Any) -> None:
        with self._lock:
            old = self._idle.pop(key, None)
            self._idle[key] = (conn, time.monotonic())
        if old is not None:
            close_quietly(old[0])

    def idle(self, kind: type) -> list[Any]:
        """The idle connections of class `kind` (still in the pool: for reading what they hold)."""
        with self._lock:
            return [conn for conn, _ in self._idle.values() if isinstance(conn, kind)]

    def close_all(self) -> None:
        with self._lock:
            entries, self._idle = list(self._idle.values()), {}
        for conn, _ in entries:
            close_quietly(conn)


POOL = ConnectionPool()


def pool_key(dest: Destination) -> Hashable:
    """The whole config: a changed host, port or TLS setting never reuses an old connection."""
    return (type(dest).__name__, dest)


def _quiet(conn: Any) -> bool:
    """True when nothing is readable: readable means the peer closed it or sent something unasked."""
    sock = conn.sock if isinstance(conn, http.client.HTTPConnection) else conn
    if sock is None:
        return False
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False  # decrypted bytes nobody asked for
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def close_quietly(conn: Any) -> None:
    """Close a socket or HTTP connection (None is fine); a failure to close is nobody's business."""
    if conn is None:
        return
    try:
        conn.close()
    except Exception:  # noqa: S110 — closing is best effort
        pass
