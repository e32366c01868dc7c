"""Close a connection without destroying the answers just written to it (a clean stop).

Closing a socket that still holds unread input makes the kernel send RST and throw away whatever
it had not sent yet — the ACKs of the last commits included, whose senders would then resend and
duplicate. So a clean stop half-closes instead: the answers and a FIN go out in order, input keeps
being read (and dropped: the protocol stopped taking messages), and the socket is closed once the
peer closed its side or acknowledged everything we sent (Linux ``SIOCOUTQ``); a bound ends it in
any case. TLS has no half-close: it sends close_notify after the answers, and the socket is closed
once the peer acknowledged them, without waiting for a close_notify an idle peer never sends.
"""

from __future__ import annotations

import fcntl
import struct
import termios
from typing import Any

from twisted.internet.interfaces import IReactorTime, ISSLTransport

__all__ = ["close_after_answers"]

CHECK_SECONDS = 0.01


def close_after_answers(transport: Any, clock: IReactorTime, *, linger_seconds: float = 2.0) -> None:
    """Flush what was written, send FIN (TLS: close_notify), close once the peer has it all."""
    if not getattr(transport, "connected", False):
        return
    half_close = getattr(transport, "loseWriteConnection", None)
    tls = half_close is None or ISSLTransport.providedBy(transport)
    if half_close is not None and not tls:
        half_close()
        transport.resumeProducing()  # drain input so the final close is not a reset
    else:  # no half-close: TLS's orderly shutdown, which would wait for the peer's close_notify
        transport.loseConnection()
    deadline = clock.seconds() + linger_seconds
    sock = _socket_of(transport)

    def check() -> None:
        if not getattr(sock, "connected", False) or getattr(sock, "disconnected", False):
            return
        sent = _flushed(sock) if tls else getattr(sock, "_writeDisconnected", False)
        if clock.seconds() >= deadline or (sent and _unacknowledged(sock) == 0):
            transport.abortConnection()
            return
        clock.callLater(CHECK_SECONDS, check)

    check()


def _socket_of(transport: Any) -> Any:
    """The TCP transport under any protocol wrappers (TLS is one)."""
    while hasattr(transport, "wrappedProtocol") and getattr(transport, "transport", None) is not None:
        transport = transport.transport
    return transport


def _flushed(transport: Any) -> bool:
    """Twisted's own write buffer is empty (FileDescriptor internals; False where unknown)."""
    try:
        return bool(len(transport.dataBuffer) - transport.offset + transport._tempDataLen == 0)
    except (AttributeError, TypeError):
        return False


def _unacknowledged(transport: Any) -> int | None:
    """Bytes sent on the socket that the peer has not acknowledged; None where unknown."""
    try:
        fileno = transport.getHandle().fileno()
        out = fcntl.ioctl(fileno, termios.TIOCOUTQ, struct.pack("i", 0))  # SIOCOUTQ on Linux
    except (AttributeError, OSError, ValueError):
        return None
    unsent: int = struct.unpack("i", out)[0]
    return unsent
