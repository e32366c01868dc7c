"""`write_now`: an answer goes to a plain TCP socket at once when nothing is buffered, and through
Twisted's buffer otherwise, in order either way. Real loopback sockets, a reactor of the test's own."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import StringTransport

from listeners.stream import write_now


class Held(Protocol):
    def connectionMade(self) -> None:
        self.factory.protos.append(self)  # type: ignore[attr-defined]


@pytest.fixture
def connected() -> Iterator[tuple[EPollReactor, Protocol, socket.socket]]:
    reactor = EPollReactor()
    factory = Factory.forProtocol(Held)
    factory.protos = []  # type: ignore[attr-defined]
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    client = socket.create_connection(("127.0.0.1", port.getHost().port))
    deadline = time.monotonic() + 5
    while not factory.protos and time.monotonic() < deadline:  # type: ignore[attr-defined]
        reactor.iterate(0.01)
    yield reactor, factory.protos[0], client  # type: ignore[attr-defined]
    client.close()
    factory.protos[0].transport.abortConnection()  # type: ignore[attr-defined]
    port.stopListening()
    reactor.iterate(0)


def received(client: socket.socket, reactor: EPollReactor, n: int) -> bytes:
    client.settimeout(0.01)
    data = b""
    deadline = time.monotonic() + 5
    while len(data) < n and time.monotonic() < deadline:
        reactor.iterate(0)
        try:
            data += client.recv(65536)
        except TimeoutError:
            pass
    return data


def test_an_answer_reaches_the_socket_without_waiting_for_a_reactor_turn(connected):
    _reactor, proto, client = connected
    write_now(proto.transport, b"ACK-1")
    client.settimeout(2)
    assert client.recv(100) == b"ACK-1"  # no reactor.iterate in between


def test_an_answer_behind_buffered_bytes_stays_behind_them(connected):
    reactor, proto, client = connected
    proto.transport.write(b"first;")  # buffered until the reactor's next turn
    write_now(proto.transport, b"second;")
    assert received(client, reactor, 13) == b"first;second;"


def test_what_the_socket_does_not_take_is_buffered_and_sent_in_order(connected):
    reactor, proto, client = connected
    big = bytes(range(256)) * 40_000  # ~10 MB: more than the socket buffers hold
    write_now(proto.transport, big)
    write_now(proto.transport, b"tail")
    assert received(client, reactor, len(big) + 4) == big + b"tail"


def test_other_transports_get_an_ordinary_write():
    transport = StringTransport()
    write_now(transport, b"ACK")
    assert transport.value() == b"ACK"
