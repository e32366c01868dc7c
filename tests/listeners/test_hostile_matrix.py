"""The hostile-input matrix (issue 23, "Safe edges"): one real `listenerd` per store backend
(SQLite, and PostgreSQL on the suite's throwaway server) with MLLP, TLS MLLP, TCP, HTTP and
file-drop inbound, and for each hostile input — a row of issue 23's table or a hostile peer —
while it is being handled:

* `/health` answers 200 within 1 s, asked every 100 ms on a connection of its own;
* an honest sender on another connection (MLLP from 127.0.0.1, one connection per message, 0.1 s
  apart) gets `AA` for every message, p99 ≤ 1 s;
* listenerd's resident memory stays ≤ 150 MB;
* once the input is handled and its peers gone, listenerd's open descriptors are back to the
  baseline (within the listener's frame timeout and a margin).

Hostile peers connect from 127.0.0.2+ (tests/support/hostile.py). Each case's figures are
printed (`-s`) and collected in `FIGURES`; the last test of the module prints the table.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import PostgresServer, free_port, wait_for
from include.app.supervisor import port_open
from include.config import StoreConfig
from tests.conftest import TEMPLATE_DB, migrated_sqlite, pg_config
from tests.support import hostile
from tests.support.hostile import FS_CR, VT, Peer
from tests.support.watch import Watch, fd_targets, fds_back

HONEST_MESSAGES, HONEST_INTERVAL, HONEST_TIMEOUT = 15, 0.1, 3.0
HEALTH_LIMIT, HONEST_P99_LIMIT, RSS_LIMIT_MB = 1.0, 1.0, 150.0
FRAME_TIMEOUT = 1.0
RELEASE_SECONDS = FRAME_TIMEOUT + 4.0  # fds back: the guard's timeout, the reactor's turn, polling
BULK_BYTES = 4 * 1024 * 1024  # the listener the huge batch goes to; the honest one keeps 64 KiB
WEB_BYTES = 2 * 1024 * 1024  # the HTTP listener takes a 1.6 MB body
BATCH_MESSAGES = {"sqlite": 40_000, "postgres": 20_000}  # issue 23: 40,000 (2.2 MB) / 20,000 on PG
LIMITS = {
    "max_connections": 32,
    "max_connections_per_peer": 16,
    "connect_rate_per_peer": 20,
    "frame_timeout_seconds": FRAME_TIMEOUT,
    "handshake_timeout_seconds": FRAME_TIMEOUT,
    "idle_timeout_seconds": 30,
}
SECRET = "TOP-SECRET-7f3a9c"
FIGURES: dict[str, dict[str, Any]] = {}


@dataclass
class Node:
    backend: str
    daemon: Daemon
    ports: dict[str, int]
    tls: ssl.SSLContext
    drop: Path
    outside: Path
    store: StoreConfig

    @property
    def pid(self) -> int:
        assert self.daemon.proc is not None
        return self.daemon.proc.pid


def _store(backend: str, tmp: Path, request: pytest.FixtureRequest) -> Iterator[StoreConfig]:
    if backend == "sqlite":
        yield migrated_sqlite(tmp / "stageline.db")
        return
    server: PostgresServer = request.getfixturevalue("pg_server")
    name = f"hostile_matrix_{os.getpid()}"
    server.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    try:  # the suite's server runs with fsync = off (a throwaway): say so, as an operator would have to
        yield replace(pg_config(server, name), allow_unsafe_durability=True)
    finally:
        server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    from tests.listeners.test_server_tls import make_pki

    backend = request.param
    tmp = tmp_path_factory.mktemp(f"matrix-{backend}")
    stores = _store(backend, tmp, request)
    config = next(stores)
    (tmp / "pki").mkdir()
    pki = make_pki(tmp / "pki")
    drop, outside = tmp / "drop", tmp / "outside"
    for d in (drop, outside, tmp / "archive", tmp / "rejected"):
        d.mkdir()
    (outside / "secrets.hl7").write_text(f"MSH|^~\\&|S|S|S|S|||ADT^A01|{SECRET}|P|2.5\rPID|1||{SECRET}\r")
    ports = {kind: free_port() for kind in ("mllp", "bulk", "tls", "tcp", "http")}
    tls = {"cert": str(pki.server_cert), "key": str(pki.server_key)}
    daemon = Daemon(
        tmp / "node",
        config,
        node_id=f"solo:1:{backend[:2]}",
        inbound=[
            {"name": "plain", "kind": "mllp", "port": ports["mllp"], **LIMITS, "max_message_bytes": 65536},
            {
                "name": "bulk",
                "kind": "mllp",
                "port": ports["bulk"],
                **LIMITS,
                "max_message_bytes": BULK_BYTES,
                "frame_timeout_seconds": 30.0,
            },
            {"name": "secure", "kind": "mllp", "port": ports["tls"], "tls": tls, **LIMITS, "max_message_bytes": 65536},
            {"name": "raw", "kind": "tcp", "port": ports["tcp"], **LIMITS, "max_message_bytes": 65536},
            {
                "name": "web",
                "kind": "http",
                "port": ports["http"],
                **LIMITS,
                "max_message_bytes": WEB_BYTES,
                "frame_timeout_seconds": 5.0,
            },
            {
                "name": "drop",
                "kind": "file",
                "directory": str(drop),
                "archive": str(tmp / "archive"),
                "error_directory": str(tmp / "rejected"),
                "poll_seconds": 0.3,
            },
        ],
    )
    daemon.start()
    ports["api"] = daemon.api_port
    try:
        for port in ports.values():
            wait_for(lambda: port_open(port), timeout=15, what="bind")
        warm = hostile.send_honest(honest(ports), 10, interval=0, prefix=f"W{backend[:2]}")
        assert warm.accepted == 10, warm.summary()
        yield Node(backend, daemon, ports, ssl.create_default_context(cafile=str(pki.ca)), drop, outside, config)
    finally:
        daemon.stop()
        for _ in stores:  # drop the PostgreSQL database
            pass


def honest(ports: dict[str, int]) -> Callable[[str], str]:
    return hostile.mllp_once("127.0.0.1", ports["mllp"], timeout=HONEST_TIMEOUT)


def honest_while(runner: threading.Thread, node: Node, prefix: str) -> hostile.Honest:
    """HONEST_MESSAGES from the honest sender, and more, 0.1 s apart, for as long as the input is
    still being handled (a huge batch takes seconds: every one of them is measured)."""
    sent = hostile.send_honest(honest(node.ports), HONEST_MESSAGES, interval=HONEST_INTERVAL, prefix=prefix)
    deadline = time.monotonic() + 90
    round_ = 0
    while runner.is_alive() and time.monotonic() < deadline:
        round_ += 1
        more = hostile.send_honest(honest(node.ports), 5, interval=HONEST_INTERVAL, prefix=f"{prefix}r{round_:03d}")
        sent.sent += more.sent
        sent.answers.update(more.answers)
        sent.latencies += more.latencies
        sent.failures += more.failures
    runner.join(max(0.0, deadline - time.monotonic()))
    return sent


# -- the hostile inputs ---------------------------------------------------------------------------
# Each runs in a thread until it is done or `halt` is set, and returns what it saw (answers).


@dataclass
class Ctx:
    node: Node
    halt: threading.Event
    seen: dict[str, Any] = field(default_factory=dict)
    peers: list[Peer] = field(default_factory=list)

    def peer_group(self, target: str, action: Callable[[Peer], None], sources: int, first: int = 2) -> None:
        for i in range(sources):
            peer = Peer(
                f"{target}{i}", "127.0.0.1", self.node.ports[target], source=f"127.0.0.{first + i}", action=action
            )
            self.peers.append(peer)
            peer.start()
        self.halt.wait(3.0)  # the pressure stays on while the honest sender sends (1.5 s)


def post(ctx: Ctx, body: bytes, content_type: str, *, timeout: float = 30.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(
        "127.0.0.1", ctx.node.ports["http"], timeout=timeout, source_address=("127.0.0.2", 0)
    )
    try:
        conn.request("POST", "/messages/web", body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def punycode_body(ctx: Ctx) -> None:
    """Issue 23 row 1: `charset=punycode` and a 1.6 MB body held the reactor for 22 s."""
    # ASCII after the last "-": punycode decodes it as insertions, quadratic in their number
    body = b"MSH|^~\\&|A|B|C|D|||ADT^A01|PUNY1|P|2.5\rNTE|1||x-" + b"b" * 1_600_000
    started = time.monotonic()
    status, answer = post(ctx, body, "text/plain; charset=punycode")
    ctx.seen.update(status=status, answered_in=round(time.monotonic() - started, 3), answer=answer[:120].decode())


def non_text_charsets(ctx: Ctx) -> None:
    """Issue 23 row 2: `charset=base64` / `zlib` / `rot13` gave an HTML 500 and a traceback."""
    body = b"MSH|^~\\&|A|B|C|D|||ADT^A01|B64|P|2.5\rPID|1\r" * 2000
    ctx.seen["statuses"] = {c: post(ctx, body, f"text/plain; charset={c}")[0] for c in ("base64", "zlib", "rot13")}


def huge_batch(ctx: Ctx) -> None:
    """Issue 23 rows 3-4: one MLLP batch of 40,000 messages (SQLite) / 20,000 (PostgreSQL)."""
    n = BATCH_MESSAGES[ctx.node.backend]
    one = "MSH|^~\\&|BULK|F|||||ADT^A01|B{:06d}|P|2.5\rPID|1||P{:03d}\r"  # 55 bytes: 40,000 = 2.2 MB
    batch = (
        "BHS|^~\\&|BULK|FAC|STAGELINE|HOSP|||||BATCH1\r"
        + "".join(one.format(i, i % 997) for i in range(n))
        + f"BTS|{n}\r"
    ).encode()
    ctx.seen["bytes"] = len(batch)
    started = time.monotonic()
    with socket.create_connection(
        ("127.0.0.1", ctx.node.ports["bulk"]), timeout=60, source_address=("127.0.0.2", 0)
    ) as sock:
        sock.sendall(VT + batch + FS_CR)
        try:
            ack = hostile._read_frame(sock).decode(errors="replace")
            msa = [s for s in ack.split("\r") if s.startswith("MSA|")]
            ctx.seen["answer"] = msa[0][:60] if msa else ack[:60]
        except (OSError, ConnectionError) as exc:
            ctx.seen["answer"] = f"{type(exc).__name__}"
    ctx.seen["answered_in"] = round(time.monotonic() - started, 2)
    ctx.seen["stored"] = connection_rows(ctx.node, "bulk")
    ctx.seen["messages"] = n


def symlink_to_secret(ctx: Ctx) -> None:
    """Issue 23 row 5: a symlink in the drop directory to a secrets file got it staged."""
    (ctx.node.drop / "leak.hl7").symlink_to(ctx.node.outside / "secrets.hl7")
    (ctx.node.drop / "fine.hl7").write_bytes(hostile.adt("DROPPED-OK"))
    ctx.halt.wait(3.0)  # several polls (0.3 s) past the stability check
    ctx.seen["secret_staged"] = stored_count(ctx.node, SECRET)
    ctx.seen["regular_file_staged"] = stored_count(ctx.node, "DROPPED-OK")


def half_open(ctx: Ctx) -> None:
    ctx.peer_group("mllp", hostile.half_open(10), sources=4)


def byte_at_a_time(ctx: Ctx) -> None:
    ctx.peer_group("mllp", hostile.trickle(6), sources=2)


def oversize_frames(ctx: Ctx) -> None:
    ctx.peer_group("mllp", hostile.bad_frames(65536), sources=2)


def endless_frame(ctx: Ctx) -> None:
    ctx.peer_group("mllp", hostile.endless(), sources=1)


NOISE = bytes(random.Random(23).getrandbits(8) for _ in range(65536))


def garbage_bytes(target: str, sources: int = 2) -> Callable[[Ctx], None]:
    """Random bytes, 1 MiB a connection, again and again from `sources` peers, at one port."""

    def spray(peer: Peer) -> None:
        sock = peer.connect(timeout=2.0)
        if sock is None:
            return
        try:
            for _ in range(16):
                if peer.halt.is_set():
                    break
                sock.sendall(NOISE)
        finally:
            sock.close()

    return lambda ctx: ctx.peer_group(target, spray, sources=sources)


def tcp_endless_line(ctx: Ctx) -> None:
    def action(peer: Peer) -> None:
        sock = peer.connect()
        if sock is None:
            return
        peer.sockets.append(sock)
        while not peer.halt.is_set():
            sock.sendall(b"MSH" + b"x" * 65536)

    ctx.peer_group("tcp", action, sources=1)


def huge_content_length(ctx: Ctx) -> None:
    """HTTP requests that announce a body (over the limit, and under it) and never send it."""

    def action(peer: Peer) -> None:
        hostile._hold(
            peer,
            8,
            b"POST /messages/web HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 1500000\r\n\r\nMSH|",
        )

    def over(peer: Peer) -> None:
        sock = peer.connect()
        if sock is not None:
            sock.sendall(b"POST /messages/web HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n")
            peer.sockets.append(sock)
            peer.halt.wait(0.2)

    ctx.peer_group("http", action, sources=2)
    ctx.peer_group("http", over, sources=1, first=20)


def many_connections_one_peer(ctx: Ctx) -> None:
    ctx.peer_group("mllp", hostile.half_open(200), sources=1)
    ctx.peer_group("mllp", hostile.churn(), sources=1, first=3)


def tls_never_handshaken(ctx: Ctx) -> None:
    ctx.peer_group("tls", hostile.silent(8), sources=3)


CASES: dict[str, Callable[[Ctx], None]] = {
    "http-punycode-1.6MB": punycode_body,
    "http-base64-zlib-rot13": non_text_charsets,
    "mllp-huge-batch": huge_batch,
    "filedrop-symlink-to-secret": symlink_to_secret,
    "mllp-slowloris-half-open": half_open,
    "mllp-byte-at-a-time": byte_at_a_time,
    "mllp-oversize-and-malformed": oversize_frames,
    "mllp-endless-frame": endless_frame,
    "garbage-bytes-mllp": garbage_bytes("mllp"),
    "garbage-bytes-tcp": garbage_bytes("tcp"),
    "garbage-bytes-tls": garbage_bytes("tls"),
    "garbage-bytes-http": garbage_bytes("http"),
    "tcp-endless-line": tcp_endless_line,
    "http-content-length-without-body": huge_content_length,
    "many-connections-one-peer": many_connections_one_peer,
    "tls-handshake-never-started": tls_never_handshaken,
}


def connection_rows(node: Node, connection: str) -> int:
    """How many inbound rows the connection has staged."""
    return _scalar(node, "SELECT COUNT(*) FROM stage_inbound WHERE connection = ?", connection)


def stored_count(node: Node, needle: str) -> int:
    """How many stored message bodies contain `needle`."""
    return _scalar(node, "SELECT COUNT(*) FROM inbound_bodies WHERE payload LIKE ?", f"%{needle}%")


def _scalar(node: Node, sql: str, param: str) -> int:
    if node.backend == "sqlite":
        import sqlite3

        with sqlite3.connect(node.store.path, timeout=30) as conn:
            return conn.execute(sql, (param,)).fetchone()[0]
    import psycopg

    with psycopg.connect(
        host=node.store.server, port=node.store.port, dbname=node.store.database, user=node.store.username
    ) as conn:
        return conn.execute(sql.replace("?", "%s"), (param,)).fetchone()[0]


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_leaves_health_honest_senders_memory_and_fds_alone(node: Node, case: str) -> None:
    d = node.daemon
    assert d.proc is not None and d.proc.poll() is None, d.output()[-3000:]
    baseline = fd_targets(node.pid)
    watch = Watch(node.pid, node.ports["api"])
    watch.start()
    ctx = Ctx(node, threading.Event())
    runner = threading.Thread(target=CASES[case], args=(ctx,), name=f"case-{case}", daemon=True)
    started = time.monotonic()
    runner.start()
    try:
        time.sleep(0.5)  # the input is on its way / the pressure is on
        sent = honest_while(runner, node, f"H{node.backend[:1]}{list(CASES).index(case):02d}")
    finally:
        ctx.halt.set()
        for peer in ctx.peers:
            peer.stop()
        runner.join(10)
        watch.stop()
    handled = time.monotonic() - started
    back, back_in, extra = fds_back(node.pid, baseline, RELEASE_SECONDS)
    figures = {
        "health_max_s": round(watch.worst, 3),
        "health_not_200": watch.unhealthy,
        "health_polls": len(watch.latencies),
        "honest": f"{sent.accepted}/{len(sent.sent)}",
        "honest_p99_s": round(sent.p99, 3),
        "rss_peak_mb": round(watch.rss_peak, 1),
        "fds_baseline": len(baseline),
        "fds_back_in_s": round(back_in, 2) if back else None,
        "case_s": round(handled, 1),
        **ctx.seen,
    }
    FIGURES[f"{node.backend}/{case}"] = figures
    print(f"\n{node.backend}/{case}: {json.dumps(figures)}")
    assert d.proc.poll() is None, d.output()[-3000:]
    problems = []
    if watch.worst > HEALTH_LIMIT or watch.unhealthy:
        problems.append(f"/health worst {watch.worst:.2f} s, {watch.unhealthy} not 200")
    if sent.accepted != len(sent.sent) or sent.p99 > HONEST_P99_LIMIT:
        problems.append(f"honest sender: {sent.summary()}")
    if watch.rss_peak > RSS_LIMIT_MB:
        problems.append(f"RSS {watch.rss_peak:.0f} MB")
    if not back:
        problems.append(f"fds not back to {len(baseline)} within {RELEASE_SECONDS} s: {extra[:8]}")
    problems += case_problems(case, ctx.seen)
    assert not problems, f"{node.backend}/{case}: " + "; ".join(problems)


def case_problems(case: str, seen: dict[str, Any]) -> list[str]:
    """What the input itself must get (beyond the matrix's four bounds)."""
    if case == "http-punycode-1.6MB" and seen.get("status") != 400:
        return [f"a punycode charset must be refused with 400, got {seen.get('status')}"]
    if case == "http-base64-zlib-rot13" and set(seen.get("statuses", {}).values()) != {400}:
        return [f"non-text charsets must be refused with 400, got {seen.get('statuses')}"]
    if case == "filedrop-symlink-to-secret":
        out = []
        if seen.get("secret_staged"):
            out.append("the symlinked secret was staged")
        if not seen.get("regular_file_staged"):
            out.append("the regular file beside the link was not staged")
        return out
    if case == "mllp-huge-batch":
        answer = str(seen.get("answer", ""))
        if not answer.startswith("MSA|"):
            return [f"the batch got no answer: {answer} after {seen.get('answered_in')} s"]
        if answer.startswith("MSA|AA|") and seen.get("stored") != seen.get("messages"):
            return [f"AA for the batch but {seen.get('stored')} of {seen.get('messages')} messages stored"]
        if not answer.startswith("MSA|AA|") and seen.get("stored"):
            return [f"{answer[:10]} for the batch but {seen.get('stored')} of its messages stored"]
    return []


def test_zz_matrix_figures(node: Node) -> None:
    """Prints the figures of this backend's cases (run last in the module)."""
    rows = {k: v for k, v in FIGURES.items() if k.startswith(node.backend + "/")}
    print("\n" + "\n".join(f"{k}: {json.dumps(v)}" for k, v in rows.items()))
    out = Path(os.environ.get("STAGELINE_MATRIX_FIGURES", "")) if os.environ.get("STAGELINE_MATRIX_FIGURES") else None
    if out is not None:
        merged = json.loads(out.read_text()) if out.exists() else {}
        out.write_text(json.dumps({**merged, **rows}, indent=1))
