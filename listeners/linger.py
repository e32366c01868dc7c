"""Close a connection without destroying the answers just written to it (a clean stop).

Closing a socket that still holds unread input makes the kernel send RST and throw away whatever
it had not sent yet — the ACKs of the last commits included, whose senders would then resend and
duplicate. So a clean stop half-closes instead: the answers and a FIN go out in order, input keeps
being read (and dropped: the protocol stopped taking messages), and the socket is closed once the
peer closed its side or acknowledged everything we sent (Linux ``SIOCOUTQ``); a bound ends it in
any case. TLS connections have no half-close: they get TLS's own orderly shutdown.
"""
from __future__ import annotations

import fcntl
import struct
import termios
from typing import Any

from twisted.internet.interfaces import IReactorTime

__all__ = ["close_after_answers"]

CHECK_SECONDS = 0.01


def close_after_answers(transport: Any, clock: IReactorTime, *, linger_seconds: float = 2.0) -> None:
    """Flush what was written, send FIN, keep reading, close once the peer has it all."""
    if not getattr(transport, "connected", False):
        return
    half_close = getattr(transport, "loseWriteConnection", None)
    if half_close is None:  # TLS: orderly TLS shutdown after the pending writes
        transport.loseConnection()
        return
    half_close()
    transport.resumeProducing()  # drain input so the final close is not a reset
    deadline = clock.seconds() + linger_seconds

    def check() -> None:
        if not transport.connected:
            return
        if clock.seconds() >= deadline or (getattr(transport, "_writeDisconnected", False)
                                           and _unacknowledged(transport) == 0):
            transport.abortConnection()
            return
        clock.callLater(CHECK_SECONDS, check)

    check()


def _unacknowledged(transport: Any) -> int | None:
    """Bytes sent on the socket that the peer has not acknowledged; None where unknown."""
    try:
        fileno = transport.getHandle().fileno()
        out = fcntl.ioctl(fileno, termios.TIOCOUTQ, struct.pack("i", 0))  # SIOCOUTQ on Linux
    except (AttributeError, OSError, ValueError):
        return None
    return struct.unpack("i", out)[0]
