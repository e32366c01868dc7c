"""The listener graph: how each kind of inbound connection is bound on the leader and taken down,
and the control-plane API every node serves. One function per kind; the node calls `bind` for
each configured connection when it becomes leader and the returned `stop(drop_connections)` when
it stops being leader (or shuts down)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from twisted.internet import defer
from twisted.internet.defer import Deferred

from listeners.connections import InboundConfig

if TYPE_CHECKING:
    from listeners.node import ListenerNode

Stop = Callable[[bool], Deferred | None]


def _listen(node: ListenerNode, conn: InboundConfig, factory: Any) -> Any:
    from listeners.tls import listen

    port = listen(node.reactor, conn.host, conn.port, factory, conn.tls)
    node.bound_ports[conn.name] = port.getHost().port
    return port


def _socket_stop(node: ListenerNode, conn: InboundConfig, port: Any, factory: Any) -> Stop:
    def stop(drop_connections: bool) -> Deferred | None:
        node.bound_ports.pop(conn.name, None)
        d = defer.maybeDeferred(port.stopListening) if port.connected else defer.succeed(None)
        if drop_connections:
            factory.disconnect_all()
        return d

    return stop


def bind_mllp(node: ListenerNode, conn: InboundConfig) -> Stop:
    factory = node.mllp_factory(conn)
    return _socket_stop(node, conn, _listen(node, conn, factory), factory)


def bind_tcp(node: ListenerNode, conn: InboundConfig) -> Stop:
    from listeners.tcp import TCPFactory

    factory = TCPFactory(node.ingest, conn, lane_of=node.lane_of(conn), clock=node.reactor)
    return _socket_stop(node, conn, _listen(node, conn, factory), factory)


def bind_http(node: ListenerNode, conn: InboundConfig) -> Stop:
    from listeners.http_inbound import make_inbound_site

    site = make_inbound_site(node.ingest, [conn], lane_of=node.lane_of(conn))
    return _socket_stop(node, conn, _listen(node, conn, site), site)


def bind_file(node: ListenerNode, conn: InboundConfig) -> Stop:
    from listeners.filedrop import FileDrop

    drop = FileDrop(node.ingest, conn, lane_of=node.lane_of(conn), reactor=node.reactor)
    drop.start()
    return lambda drop_connections: drop.stop()


BINDERS: dict[str, Callable[[ListenerNode, InboundConfig], Stop]] = {
    "mllp": bind_mllp, "tcp": bind_tcp, "http": bind_http, "file": bind_file,
}


def bind(node: ListenerNode, conn: InboundConfig) -> Stop:
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
