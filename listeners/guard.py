"""Limits that single out a misbehaving peer instead of the listener (docs/listenerd.md, "Hostile peers").

A listener faces partners it does not control. Without these, 64 connections that each send the
first bytes of a frame and then hold still fill every slot for the five minutes of the idle
timeout, and every honest sender is turned away. So each socket listener (MLLP, TCP, HTTP, the API)
sits behind a `GuardedFactory`, which decides per connection, not per listener:

    source      with `allowed_sources` (CIDRs) set, a peer whose address is in none of them is closed
                at once, before a byte is read or a TLS handshake begun (an IPv4-mapped IPv6 address
                is matched as its IPv4 address); empty means any address
    admission   per peer address: at most `max_connections_per_peer` open connections and
                `connect_rate_per_peer` new ones a second (a bucket of twice that); a full listener
                makes room by closing a connection with nothing in flight: one of the peer address
                that holds the most connections, the one of those stuck longest (idle, or with an
                unfinished message begun, the longest ago); it refuses the newcomer only when every
                connection waits on us for an answer
    bandwidth   a peer address that sends more than `max_bytes_per_second_per_peer` (all its
                connections together) is read more slowly: reading pauses until its allowance
                refills (TCP pushes back on the sender), so a peer streaming an endless or oversize
                frame costs the listener no more than that; nothing is dropped
    progress    a message (MLLP or TCP frame, HTTP request) that has started must be complete
                within `frame_timeout_seconds` of its first byte, however slowly it trickles; a TLS
                handshake within `handshake_timeout_seconds`. Otherwise the connection is closed.
                Nothing is lost: an unfinished message was never acknowledged.

Every refusal and eviction is counted in `stageline_connections_refused_total{connection,reason}`
and logged at most once per peer, reason and `log_interval_seconds` (with how many were not
logged), never with message content.

The guard learns how far the protocol it wraps has got from three duck-typed attributes of the
innermost protocol (below TLS, if any): `receiving` (part of a message is buffered), `units` (how
many messages it has completed) and `in_flight` (messages received but not yet answered).
"""

from __future__ import annotations

import ipaddress
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IAddress, IDelayedCall, IProtocolFactory, IReactorTime
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol
from twisted.web.server import Site

from include.cidrs import Network, source_network

__all__ = [
    "GuardedChannel",
    "GuardedFactory",
    "GuardedProtocol",
    "PeerLimits",
    "Refusals",
    "guard_channels",
    "source_allowed",
    "source_networks",
]

_log = Logger(namespace="stageline.guard")


@dataclass(frozen=True)
class PeerLimits:
    """One listener's limits; every field is a setting of its `[[inbound]]` (or `[api]`) table."""

    max_connections: int = 64
    max_connections_per_peer: int = 16
    connect_rate_per_peer: float = 20.0
    frame_timeout_seconds: float = 10.0
    handshake_timeout_seconds: float = 10.0
    max_bytes_per_second_per_peer: float = 8 * 1024 * 1024
    log_interval_seconds: float = 60.0
    allowed_sources: tuple[str, ...] = ()  # CIDRs a peer may connect from; empty: any


def source_networks(cidrs: tuple[str, ...] | list[str]) -> tuple[Network, ...]:
    """`allowed_sources` parsed; ValueError naming the entry that is not a CIDR (or address)."""
    networks = []
    for cidr in cidrs:
        try:
            networks.append(source_network(str(cidr), strict=False))  # the config check refuses host bits
        except ValueError:
            raise ValueError(f"allowed_sources: {str(cidr)[:60]!r} is not a CIDR such as 10.0.0.0/8") from None
    return tuple(networks)


def source_allowed(host: str, networks: tuple[Network, ...]) -> bool:
    """Whether a peer address is in one of `networks` (any address when there are none)."""
    if not networks:
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:  # not an IP peer (a UNIX socket): no CIDR names it
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in net for net in networks)


class Refusals:
    """Counts refusals and evictions per listener and reason; logs each (peer, reason) at most once
    per interval, saying how many went unlogged since."""

    MAX_KEYS = 10_000

    def __init__(self, metrics: Any, clock: IReactorTime, *, interval: float = 60.0) -> None:
        self._metrics = metrics
        self._clock = clock
        self._interval = interval
        self._last: dict[tuple[str, str, str], list[float]] = {}  # key → [logged at, unlogged since]

    def __call__(self, listener: str, peer: str, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.refusals.labels(listener, reason).inc()
        now = self._clock.seconds()
        key = (listener, peer, reason)
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self._interval:
            seen[1] += 1
            return
        if len(self._last) >= self.MAX_KEYS:  # a scan from many addresses: forget what is stale
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self._interval}
        unlogged = int(seen[1]) if seen is not None else 0
        self._last[key] = [now, 0]
        _log.warn(
            "{listener}: {reason} for peer {peer}{more}",
            listener=listener,
            reason=reason,
            peer=peer,
            more=f" ({unlogged} more since the last line)" if unlogged else "",
        )


class GuardedProtocol(ProtocolWrapper):
    """One connection behind the guard: watches its progress, is the one closed when it stalls."""

    factory: GuardedFactory
    # The connection below: TCP or TLS, a push producer that can abort (Twisted says only ITransport).
    transport: Any

    def __init__(self, factory: GuardedFactory, wrapped: Any, host: str) -> None:
        super().__init__(factory, wrapped)
        self.host = host
        self.last_active = factory.clock.seconds()
        self.started_at: float | None = None  # when the message being received began
        self._units = 0
        self._inner: Any = None
        self._frame_timer: IDelayedCall | None = None
        self._handshake_timer: IDelayedCall | None = None
        self._throttle: IDelayedCall | None = None
        self._gone = False

    # -- what the wrapped protocol says -----------------------------------------------------

    def inner(self) -> Any:
        """The innermost protocol (below TLS and Twisted's HTTP proxy), found once."""
        if self._inner is None:
            p: Any = self.wrappedProtocol
            while p is not None and not hasattr(type(p), "receiving"):  # (wrappers' __getattr__ would ask us)
                p = getattr(p, "wrappedProtocol", None) or getattr(p, "_channel", None)
            self._inner = p
        return self._inner

    @property
    def in_flight(self) -> int:
        inner = self.inner()
        return int(getattr(inner, "in_flight", 0) or 0) if inner is not None else 0

    @property
    def receiving(self) -> bool:
        inner = self.inner()
        return bool(inner is not None and inner.receiving)

    # -- lifecycle ----------------------------------------------------------------------------

    def makeConnection(self, transport: Any) -> None:
        super().makeConnection(transport)
        if self.factory.tls and not self._gone:
            self._handshake_timer = self.factory.clock.callLater(
                self.factory.limits.handshake_timeout_seconds, self._handshake_check
            )

    def dataReceived(self, data: bytes) -> None:
        self.last_active = self.factory.clock.seconds()
        super().dataReceived(data)
        if self.wrappedProtocol is None or self._gone:
            return
        wait = self.factory.spend_bytes(self.host, len(data))
        if wait > 0 and self._throttle is None:
            self.transport.pauseProducing()
            self._throttle = self.factory.clock.callLater(wait, self._resume)
            self.factory.refusals(self.factory.name, self.host, "throttled")
        if self.receiving:
            if self._frame_timer is None:
                self.started_at = self.last_active
                self._units = getattr(self.inner(), "units", 0)
                self._frame_timer = self.factory.clock.callLater(
                    self.factory.limits.frame_timeout_seconds, self._frame_check
                )
        elif self._frame_timer is not None:
            self._cancel_frame_timer()

    def _frame_check(self) -> None:
        self._frame_timer = None
        if self._gone or self.wrappedProtocol is None or not self.receiving:
            self.started_at = None
            return
        units = getattr(self.inner(), "units", 0)
        if units != self._units:  # messages completed meanwhile: what is buffered now began since
            self._units, self.started_at = units, self.factory.clock.seconds()
            self._frame_timer = self.factory.clock.callLater(
                self.factory.limits.frame_timeout_seconds, self._frame_check
            )
            return
        self.close_for("frame_timeout")

    def _resume(self) -> None:
        self._throttle = None
        if not self._gone and self.wrappedProtocol is not None:
            self.transport.resumeProducing()

    def _handshake_check(self) -> None:
        self._handshake_timer = None
        if not self._gone and not getattr(self.wrappedProtocol, "_handshakeDone", True):
            self.close_for("handshake_timeout")

    def close_for(self, reason: str) -> None:
        """Close this connection at once and count why (its unfinished message was never answered)."""
        if self._gone:
            return
        self.factory.refusals(self.factory.name, self.host, reason)
        self._forget()
        evict = getattr(self.inner(), "evict", None)
        if evict is not None:
            evict()  # leave the listener's registry now, not on the next reactor turn
        self.transport.abortConnection()

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._forget()
        super().connectionLost(reason)

    def _forget(self) -> None:
        if not self._gone:
            self._gone = True
            self._cancel_frame_timer()
            for timer in (self._handshake_timer, self._throttle):
                if timer is not None and timer.active():
                    timer.cancel()
            self._handshake_timer = self._throttle = None
            self.factory.forget(self)

    def _cancel_frame_timer(self) -> None:
        if self._frame_timer is not None and self._frame_timer.active():
            self._frame_timer.cancel()
        self._frame_timer = None
        self.started_at = None


class GuardedFactory(WrappingFactory[GuardedProtocol]):
    """Admits connections to `wrapped` per peer (module docstring); `tls`: `wrapped` is a TLS factory."""

    protocol = GuardedProtocol
    noisy = False  # no "Starting factory" lines: the wrapped factory's are enough

    def __init__(
        self,
        wrapped: IProtocolFactory,
        limits: PeerLimits,
        *,
        name: str,
        clock: IReactorTime,
        refusals: Refusals,
        tls: bool = False,
    ) -> None:
        super().__init__(wrapped)
        self.limits, self.name, self.clock, self.refusals, self.tls = limits, name, clock, refusals, tls
        self.open: dict[GuardedProtocol, None] = {}  # admitted and not yet gone, oldest first
        self.per_peer: Counter[str] = Counter()
        self._buckets: dict[str, tuple[float, float]] = {}  # host → (connection tokens, at)
        self._bytes: dict[str, tuple[float, float]] = {}  # host → (byte allowance, at)
        self._sources = source_networks(limits.allowed_sources)

    def buildProtocol(self, addr: IAddress) -> GuardedProtocol | None:  # type: ignore[override]
        host = str(getattr(addr, "host", addr))
        # None: Twisted closes the accepted socket at once, before reading or any TLS handshake.
        if not source_allowed(host, self._sources):
            self.refusals(self.name, host, "source")
            return None
        if not self._take_token(host):
            self.refusals(self.name, host, "connect_rate")
            return None
        if self.per_peer[host] >= self.limits.max_connections_per_peer:
            self.refusals(self.name, host, "peer_connections")
            return None
        if len(self.open) >= self.limits.max_connections:
            victim = self._victim()
            if victim is None:
                self.refusals(self.name, host, "listener_full")
                return None
            victim.close_for("evicted_for_new_connection")
        wrapped = self.wrappedFactory.buildProtocol(addr)
        if wrapped is None:
            return None
        proto = GuardedProtocol(self, wrapped, host)
        self.open[proto] = None
        self.per_peer[host] += 1
        return proto

    def forget(self, proto: GuardedProtocol) -> None:
        if self.open.pop(proto, 0) is None:
            self.per_peer[proto.host] -= 1
            if self.per_peer[proto.host] <= 0:
                del self.per_peer[proto.host]

    def _victim(self) -> GuardedProtocol | None:
        """The connection to close for a new one, of those with nothing in flight: one of the peer
        address holding the most connections (a partner that opened many is the likeliest to be
        the one holding slots), and of those the one stuck longest — idle, or an unfinished
        message begun, the longest ago. None when every connection waits on us for an answer."""
        now = self.clock.seconds()
        victim: GuardedProtocol | None = None
        best = (-1, -1.0)
        for proto in self.open:
            if proto.in_flight:
                continue
            since = proto.started_at if proto.started_at is not None else proto.last_active
            score = (self.per_peer[proto.host], now - since)
            if score > best:
                victim, best = proto, score
        return victim

    def _take_token(self, host: str) -> bool:
        rate = self.limits.connect_rate_per_peer
        now = self.clock.seconds()
        tokens, at = self._buckets.get(host, (2 * rate, now))
        tokens = min(2 * rate, tokens + (now - at) * rate)
        if len(self._buckets) >= 10_000:  # keep the table bounded under a scan: drop full buckets
            self._buckets = {h: v for h, v in self._buckets.items() if v[0] + (now - v[1]) * rate < 2 * rate}
        if tokens < 1:
            self._buckets[host] = (tokens, now)
            return False
        self._buckets[host] = (tokens - 1, now)
        return True

    def spend_bytes(self, host: str, size: int) -> float:
        """Take `size` bytes from the peer's allowance; the seconds to pause reading if it is spent."""
        rate = self.limits.max_bytes_per_second_per_peer
        now = self.clock.seconds()
        allowance, at = self._bytes.get(host, (rate, now))
        allowance = min(rate, allowance + (now - at) * rate) - size
        if len(self._bytes) >= 10_000 and host not in self._bytes:
            self._bytes = {h: v for h, v in self._bytes.items() if h in self.per_peer}
        self._bytes[host] = (allowance, now)
        return -allowance / rate if allowance < 0 else 0.0

    # WrappingFactory's own registry is not used: `open` is kept at admission, so an eviction
    # frees its place at once rather than when the socket is finally closed.
    def registerProtocol(self, p: Any) -> None:
        pass

    def unregisterProtocol(self, p: Any) -> None:
        pass


class GuardedChannel(HTTPChannel):
    """Twisted's HTTP channel, telling the guard how far a request has got: `receiving` from its
    first byte until its body is complete (so slow headers and slow bodies are both timed)."""

    receiving = False
    units = 0

    @property
    def in_flight(self) -> int:
        return 1 if self._handlingRequest else 0

    def dataReceived(self, data: bytes) -> None:
        if data and not self._handlingRequest:
            self.receiving = True
        super().dataReceived(data)

    def allContentReceived(self) -> None:
        self.receiving = False
        self.units += 1
        super().allContentReceived()

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request line (or a header line) past `MAX_LENGTH` bytes: answer why before closing, as
        JSON (`414` for the request line, `431` for a header), where Twisted would close in silence
        and leave the client guessing."""
        first = bool(getattr(self, "_HTTPChannel__first_line", 0))
        what = "the request line (method, path and query)" if first else "a header line"
        status = b"414 URI Too Long" if first else b"431 Request Header Fields Too Large"
        self._refuse(status, f"{what} is longer than {self.MAX_LENGTH} bytes")

    def _respondToBadRequestAndDisconnect(self) -> None:
        """Twisted's bare `400` (a malformed request line or header, too many headers, request line
        and headers past `totalHeadersSize` together), with a JSON reason as every other answer."""
        self._refuse(
            b"400 Bad Request",
            f"malformed request line or headers, or more than {self.totalHeadersSize} bytes of them together",
        )

    def _refuse(self, status: bytes, error: str) -> None:
        self.receiving = False
        if self.transport is None:  # already gone
            return
        body = json.dumps({"error": error}).encode()
        self.transport.write(
            b"HTTP/1.1 "
            + status
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + body
        )
        self.loseConnection()


def guard_channels(site: Site) -> Site:
    """Give `site` channels the guard can watch (`GuardedChannel`); returns the site."""
    site.protocol = lambda: _GenericHTTPChannelProtocol(GuardedChannel())  # type: ignore[method-assign]
    return site
