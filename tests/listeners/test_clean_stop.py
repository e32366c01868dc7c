"""A clean stop loses and duplicates nothing (invariant 2, docs/invariants.md): SIGTERM to the
leader while a careful sender streams over several connections and resends anything not AA'd. The
leader stops reading first, commits and ACKs what it already read, closes, then expires its lease at
once, so the standby takes over within a heartbeat although the lease TTL is far longer."""

from __future__ import annotations

import signal
import socket
import time
from collections import Counter

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.store import Store
from tests.listeners.hl7_traffic import ResendingSender, adt
from tests.support.nodes import HEARTBEAT, fast_cluster, mllp_node

TTL = 10.0  # a long TTL: a prompt takeover can only come from the release
CLUSTER = fast_cluster(leader_lease_ttl_seconds=TTL)


@pytest.fixture
def pair(tmp_path, pg_config_fresh):
    port = free_port()
    a = mllp_node(tmp_path / "a", pg_config_fresh, node_id="node-a:1:aa", port=port, cluster=CLUSTER)
    wait_for(lambda: a.status()["is_leader"] and port_open(port), timeout=15, what="node A to lead")
    b = Daemon(
        tmp_path / "b", pg_config_fresh, node_id="node-b:2:bb", cluster=CLUSTER, config_dir=a.workdir / "config"
    ).start()
    wait_for(lambda: b.status()["role"] == "standby", timeout=15, what="node B to stand by")
    yield a, b, port, pg_config_fresh
    for d in (a, b):
        d.stop()


def db_now(store: Store):
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute("SELECT clock_timestamp() AS now")
        return cur.fetchone()["now"]


@pytest.mark.parametrize("round_", range(2))
def test_sigterm_mid_stream_loses_nothing_duplicates_nothing_and_hands_over_at_once(pair, round_):
    a, b, port, store_config = pair
    store = Store(store_config)
    try:
        sender = ResendingSender(port, prefix="S", connections=6, window=8).start()
        wait_for(lambda: len(sender.acked) >= 300, timeout=20, interval=0.02, what="traffic through node A")
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)  # a sender gone idle on A
        idle.sendall(b"\x0b" + adt("IDLE-1").encode() + b"\x1c\r")
        assert b"|AA|IDLE-1" in idle.recv(65536)
        signalled_at = db_now(store)
        t0 = time.monotonic()
        a.signal(signal.SIGTERM)
        assert a.proc.wait(20) == 0
        exited = time.monotonic() - t0
        assert idle.recv(1) == b""  # the idle connection got an orderly close (FIN), not a reset
        idle.close()
        wait_for(lambda: b.status()["is_leader"] and port_open(port), timeout=TTL, interval=0.02, what="takeover")
        took_over = time.monotonic() - t0
        acked_before = len(sender.acked)
        wait_for(
            lambda: len(sender.acked) >= acked_before + 300, timeout=20, interval=0.02, what="traffic through node B"
        )
        assert sender.finish() == []  # every message the sender made was AA'd in the end

        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute("SELECT control_id FROM stage_inbound")
            counts = Counter(r["control_id"] for r in cur.fetchall())
            cur.execute("SELECT control_id, node_id, at FROM message_events WHERE event = 'received'")
            events = cur.fetchall()
            lease = tx.one("lease_read")
        by_a = {e["control_id"] for e in events if e["node_id"] == "node-a:1:aa"}
        after_signal = {e["control_id"] for e in events if e["node_id"] == "node-a:1:aa" and e["at"] > signalled_at}
        duplicates = {cid: n for cid, n in counts.items() if n > 1}
        resent = sum(n - 1 for n in sender.sends.values())
        print(
            f"SIGTERM round {round_}: {len(counts)} staged ({len(by_a)} by A, {len(after_signal)} by A after "
            f"the signal), resent {resent}, duplicates {len(duplicates)}; A exited {exited:.2f}s, "
            f"B leads {took_over:.2f}s after the signal (TTL {TTL}s)"
        )
        assert duplicates == {}
        assert set(counts) - {"IDLE-1"} == set(sender.acked) == sender.made  # every AA'd message staged, nothing else
        assert set(sender.acked.values()) == {1}
        assert after_signal <= set(sender.acked)  # staged after the stop began: its ACK was delivered
        assert exited < 1.5  # an idle connection does not hold the stop for the linger bound (2 s)
        assert took_over < HEARTBEAT + 2.0 < TTL  # the lease was expired at once, not aged out
        assert lease["owner"] == "node-b:2:bb"
        assert "listenerd node-a:1:aa stopped" in a.output()
    finally:
        store.close()


@pytest.mark.parametrize("store_config", ["sqlite"], indirect=True)
def test_idle_plain_tls_tcp_and_http_connections_do_not_hold_up_a_clean_stop(tmp_path, store_config):
    """Senders that keep a connection open and never read do not delay the stop (nor the lease
    release behind it): each gets an orderly close at once."""
    import http.client
    import ssl

    from tests.listeners.test_server_tls import make_pki

    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    ports = {kind: free_port() for kind in ("mllp", "tls", "tcp", "http")}
    d = Daemon(
        tmp_path / "node",
        store_config,
        node_id="solo:1:aa",
        inbound=[
            {"name": "plain", "kind": "mllp", "port": ports["mllp"]},
            {
                "name": "secure",
                "kind": "mllp",
                "port": ports["tls"],
                "tls": {
                    "cert": str(pki.server_cert),
                    "key": str(pki.server_key),
                    "ca": str(pki.ca),
                    "require_client_cert": True,
                },
            },
            {"name": "raw", "kind": "tcp", "port": ports["tcp"]},
            {"name": "web", "kind": "http", "port": ports["http"]},
        ],
    ).start()
    try:
        for port in ports.values():
            wait_for(lambda: port_open(port), timeout=15, what="bind")
        plain = socket.create_connection(("127.0.0.1", ports["mllp"]), timeout=10)
        raw = socket.create_connection(("127.0.0.1", ports["tcp"]), timeout=10)
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        ctx.load_cert_chain(str(pki.client))
        secure = ctx.wrap_socket(
            socket.create_connection(("127.0.0.1", ports["tls"]), timeout=10), server_hostname="localhost"
        )
        web = http.client.HTTPConnection("127.0.0.1", ports["http"], timeout=10)
        web.request("POST", "/messages/web", body=b"hello", headers={"Content-Type": "text/plain"})
        assert web.getresponse().status == 202  # answered; the keep-alive connection stays open
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.proc.wait(20) == 0
        took = time.monotonic() - t0
        print(f"clean stop with 4 idle connections (plain, TLS, TCP, HTTP keep-alive): {took:.2f}s")
        assert took < 1.5  # not the 2 s linger bound, nor the 10 s drain bound
        assert plain.recv(1) == b"" and raw.recv(1) == b""  # orderly closes (FIN), not resets
        try:
            assert secure.recv(1) == b""  # close_notify
        except (ssl.SSLError, ConnectionResetError):
            pass  # the server did not wait for a close_notify this idle client never sends
        for c in (plain, raw, secure, web):
            c.close()
    finally:
        d.stop()
