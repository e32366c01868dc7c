"""The listener graph: how each kind of inbound connection is bound on the leader and taken down,
and the control-plane API every node serves. One function per kind; the node calls `bind` for
each configured connection when it becomes leader and gets a `Bound` back to take it down.

Taking down has two steps so a clean stop loses and duplicates nothing: `stop_intake` (stop
listening and polling, stop reading open connections) before the last commits are drained, and
`close` after their answers are written (graceful) — or at once with `abort` when leadership is lost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from twisted.internet import defer
from twisted.internet.defer import Deferred

from listeners.connections import InboundConfig

if TYPE_CHECKING:
    from listeners.node import ListenerNode


@dataclass(frozen=True)
class Bound:
    """One bound inbound connection, as the node takes it down."""

    stop_intake: Callable[[], Deferred | None]  # take nothing new; fires once nothing more is read
    close: Callable[[bool], None]  # close open connections: True aborts, False flushes answers first
    open_connections: Callable[[], int]


def _listen(node: ListenerNode, conn: InboundConfig, factory: Any) -> Any:
    from listeners.tls import listen

    port = listen(node.reactor, conn.host, conn.port, factory, conn.tls)
    node.bound_ports[conn.name] = port.getHost().port
    return port


def _socket_bound(node: ListenerNode, conn: InboundConfig, port: Any, factory: Any) -> Bound:
    def stop_intake() -> Deferred | None:
        node.bound_ports.pop(conn.name, None)
        d = defer.maybeDeferred(port.stopListening) if port.connected else defer.succeed(None)
        factory.stop_reading()
        return d

    def close(abort: bool) -> None:
        if abort:
            factory.disconnect_all()
        else:
            factory.close_all()

    return Bound(stop_intake, close, lambda: factory.active_connections)


def bind_mllp(node: ListenerNode, conn: InboundConfig) -> Bound:
    factory = node.mllp_factory(conn)
    return _socket_bound(node, conn, _listen(node, conn, factory), factory)


def bind_tcp(node: ListenerNode, conn: InboundConfig) -> Bound:
    from listeners.tcp import TCPFactory

    factory = TCPFactory(node.ingest, conn, lane_of=node.lane_of(conn), clock=node.reactor)
    return _socket_bound(node, conn, _listen(node, conn, factory), factory)


def bind_http(node: ListenerNode, conn: InboundConfig) -> Bound:
    from listeners.http_inbound import make_inbound_site

    site = make_inbound_site(node.ingest, [conn], lane_of=node.lane_of(conn))
    return _socket_bound(node, conn, _listen(node, conn, site), site)


def bind_file(node: ListenerNode, conn: InboundConfig) -> Bound:
    from listeners.filedrop import FileDrop

    drop = FileDrop(node.ingest, conn, lane_of=node.lane_of(conn), reactor=node.reactor)
    drop.start()
    return Bound(drop.stop, lambda abort: None, lambda: 0)  # stop() waits for the file in hand


BINDERS: dict[str, Callable[[ListenerNode, InboundConfig], Bound]] = {
    "mllp": bind_mllp, "tcp": bind_tcp, "http": bind_http, "file": bind_file,
}


def bind(node: ListenerNode, conn: InboundConfig) -> Bound:
    return BINDERS[conn.kind](node, conn)


def start_api(node: ListenerNode) -> list[Any]:
    """The control plane, on every node, leader or not."""
    from listeners.api import make_api
    from listeners.tls import listen

    settings = node.api_settings
    port = listen(node.reactor, settings.host, node.api_port or settings.port, make_api(node.state, node.api_auth),
                  settings.tls)
    node.api_port = port.getHost().port
    return [port]
