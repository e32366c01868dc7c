"""Senders are authenticated on open networks (docs/listenerd.md, "Sender authentication").

`allowed_sources` (CIDRs) is enforced at accept time by the peer guard for every network kind —
MLLP, TLS MLLP, TCP, HTTP — so a peer outside the list is closed at once, before a byte is read
or a TLS handshake begun, counted (`stageline_connections_refused_total{reason="source"}`) and
logged once. And with `tls.require_client_cert` a TLS client without a certificate from the CA is
refused at the handshake. Against a real `listenerd` (SQLite store) over real sockets.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import wait_for
from include.app.supervisor import port_open
from listeners.guard import source_allowed, source_networks
from tests.conftest import migrated_sqlite
from tests.listeners.test_server_tls import make_pki
from tests.support import hostile

DENY, ALLOW = ["10.0.0.0/8"], ["127.0.0.0/8"]


def distinct_ports(names: tuple[str, ...]) -> dict[str, int]:
    """A free port per name, all different and free on every address (the "mapped" listener binds
    `::`, which also takes the port on 127.0.0.1): the sockets are held until all are chosen."""
    held = []
    try:
        for _ in names:
            s = socket.socket(socket.AF_INET6)
            s.bind(("::", 0))
            held.append(s)
        return {name: s.getsockname()[1] for name, s in zip(names, held)}
    finally:
        for s in held:
            s.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict[str, int], object]]:
    tmp = tmp_path_factory.mktemp("senders")
    config = migrated_sqlite(tmp / "stageline.db")
    (tmp / "pki").mkdir()
    pki = make_pki(tmp / "pki")
    tls = {"cert": str(pki.server_cert), "key": str(pki.server_key)}
    mtls = {**tls, "ca": str(pki.ca), "require_client_cert": True}
    names = (
        "mllp-deny",
        "mllp-allow",
        "tls-deny",
        "tls-allow",
        "tcp-deny",
        "tcp-allow",
        "http-deny",
        "http-allow",
        "mapped",
        "mtls",
    )
    ports = distinct_ports(names)
    kinds = {"mllp": "mllp", "tls": "mllp", "tcp": "tcp", "http": "http"}
    inbound = []
    for name in names[:8]:
        kind, verdict = name.split("-")
        entry = {
            "name": name,
            "kind": kinds[kind],
            "port": ports[name],
            "allowed_sources": DENY if verdict == "deny" else ALLOW,
        }
        if kind == "tls":
            entry["tls"] = tls
        inbound.append(entry)
    # every address (IPv6, dual stack): a client on 127.0.0.1 arrives as ::ffff:127.0.0.1
    inbound.append(
        {
            "name": "mapped",
            "kind": "mllp",
            "host": "::",
            "port": ports["mapped"],
            "allowed_sources": ALLOW,
            "allow_insecure_bind": True,
        }
    )
    inbound.append({"name": "mtls", "kind": "mllp", "port": ports["mtls"], "tls": mtls})
    d = Daemon(tmp / "node", config, node_id="solo:1:sa", inbound=inbound).start()
    try:
        for port in ports.values():
            wait_for(lambda: port_open(port), timeout=15, what="bind")
        yield d, ports, pki
    finally:
        d.stop()


def closed_without_answer(port: int, *, send: bytes = b"") -> bool:
    """Connect from 127.0.0.1; True when the server closes without a byte, before we send anything
    (or, with `send`, after it) — a listener that read would wait for the rest instead."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        if send:
            try:
                s.sendall(send)
            except OSError:
                return True
        try:
            return s.recv(4096) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


@pytest.mark.parametrize("name", ["mllp-deny", "tls-deny", "tcp-deny", "http-deny"])
def test_a_peer_outside_allowed_sources_is_closed_before_anything_is_read(node, name: str) -> None:
    _d, ports, _ = node
    started = time.monotonic()
    assert closed_without_answer(ports[name])
    assert closed_without_answer(ports[name], send=b"\x0b" + hostile.adt("DENIED1") + b"\x1c\r")
    assert time.monotonic() - started < 2.0


def test_a_tls_peer_outside_allowed_sources_gets_no_handshake(node) -> None:
    _d, ports, pki = node
    context = ssl.create_default_context(cafile=str(pki.ca))
    with socket.create_connection(("127.0.0.1", ports["tls-deny"]), timeout=3) as raw:
        with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
            context.wrap_socket(raw, server_hostname="localhost")


def test_a_peer_inside_allowed_sources_is_served(node) -> None:
    _d, ports, pki = node
    context = ssl.create_default_context(cafile=str(pki.ca))
    assert hostile.mllp_once("127.0.0.1", ports["mllp-allow"])("ALLOW1") == "AA"
    assert hostile.mllp_once("127.0.0.1", ports["tls-allow"], context=context)("ALLOW2") == "AA"
    assert hostile.http_once("127.0.0.1", ports["http-allow"], "/messages/http-allow")("ALLOW3") == "202"
    with socket.create_connection(("127.0.0.1", ports["tcp-allow"]), timeout=5) as s:
        s.sendall(hostile.adt("ALLOW4") + b"\n")
        assert s.recv(4096).startswith(b"ACK ")


def test_an_ipv4_mapped_peer_matches_its_ipv4_cidr(node) -> None:
    _d, ports, _ = node
    assert hostile.mllp_once("127.0.0.1", ports["mapped"])("MAPPED1") == "AA"


def test_refusals_for_source_are_counted_and_logged_once(node) -> None:
    d, ports, _ = node
    for _ in range(5):
        closed_without_answer(ports["mllp-deny"])
    _, body = d.get("/metrics")
    lines = [
        line
        for line in body.decode().splitlines()
        if line.startswith("stageline_connections_refused_total{")
        and 'reason="source"' in line
        and 'connection="mllp-deny"' in line
    ]
    assert lines and float(lines[0].split()[-1]) >= 5, body.decode()[-2000:]
    assert d.output().count("mllp-deny: source for peer 127.0.0.1") == 1


def test_mtls_refuses_a_tls_client_without_a_certificate(node) -> None:
    _d, ports, pki = node
    context = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
        hostile.mllp_once("127.0.0.1", ports["mtls"], context=context)("NOCERT1")
    with_cert = ssl.create_default_context(cafile=str(pki.ca))
    with_cert.load_cert_chain(str(pki.client))
    assert hostile.mllp_once("127.0.0.1", ports["mtls"], context=with_cert)("CERT1") == "AA"


@pytest.mark.parametrize(
    "host, cidrs, allowed",
    [
        ("127.0.0.1", ["127.0.0.0/8"], True),
        ("127.0.0.1", ["10.0.0.0/8"], False),
        ("::ffff:10.1.2.3", ["10.0.0.0/8"], True),
        ("::ffff:192.168.1.1", ["10.0.0.0/8"], False),
        ("fe80::1%eth0", ["fe80::/10"], True),
        ("2001:db8::5", ["2001:db8::/32", "10.0.0.0/8"], True),
        ("10.0.0.1", [], True),
        ("not-an-ip", ["10.0.0.0/8"], False),
    ],
)
def test_source_matching(host: str, cidrs: list[str], allowed: bool) -> None:
    assert source_allowed(host, source_networks(cidrs)) is allowed


def test_a_bad_cidr_is_named() -> None:
    with pytest.raises(ValueError, match=r"'10\.0\.0/33'"):
        source_networks(["10.0.0/33"])


def test_an_ipv4_mapped_allowlist_entry_matches_ipv4_peers_as_the_guard_sees_them() -> None:
    """The guard compares an IPv4-mapped peer as its IPv4 address, so a mapped entry must be read as
    the IPv4 network it maps, or it would never match anyone."""
    from listeners.guard import source_allowed, source_networks

    networks = source_networks(["::ffff:127.0.0.0/104"])
    assert source_allowed("127.0.0.1", networks) and source_allowed("::ffff:127.0.0.9", networks)
    assert not source_allowed("10.0.0.1", networks)
