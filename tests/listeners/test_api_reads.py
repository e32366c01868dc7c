"""API reads cannot take a node down (listeners/api_reads.py): with the staged tables locked, so every
read of them waits, a burst of viewer requests gets quick 503s past the pool's limit, while the leader
keeps its lease, `/leader` stays 200 and senders keep getting `AA`; when the lock goes, the reads that
were let in answer 200. Before, the reads took the reactor's threads — the heartbeat's — and a dozen
of them fenced the leader (a red team's finding)."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import psycopg
from hl7.client import MLLPClient

from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.store import Store
from include.store.lease import read_lease
from listeners.api_reads import MAX_PENDING
from tests.support.hostile import adt
from tests.support.nodes import FENCE, TTL, fast_cluster, mllp_node

REQUESTS = MAX_PENDING + 6  # under the API's 16 connections per address (with /leader polls)


def timed_get(url: str, token: str, out: list[tuple[int, float, str | None]]) -> None:
    started = time.monotonic()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out.append((r.status, time.monotonic() - started, None))
    except urllib.error.HTTPError as e:
        out.append((e.code, time.monotonic() - started, e.headers.get("retry-after")))


def test_a_burst_of_slow_api_reads_neither_fences_the_leader_nor_holds_its_acks(tmp_path, pg_server, pg_config_fresh):
    port = free_port()
    node = mllp_node(tmp_path / "a", pg_config_fresh, node_id="node-a:1:aa", port=port, cluster=fast_cluster())
    locker = psycopg.connect(pg_server.conninfo(pg_config_fresh.database))
    store = Store(pg_config_fresh)
    answers: list[tuple[int, float, str | None]] = []
    try:
        wait_for(lambda: port_open(port), timeout=30, what="the leader binds")
        epoch = read_lease(store).epoch
        locker.execute("LOCK TABLE stage_outbound, stage_routed IN ACCESS EXCLUSIVE MODE")
        url = f"http://127.0.0.1:{node.api_port}/stages?by=destination"
        burst = [threading.Thread(target=timed_get, args=(url, node.token, answers)) for _ in range(REQUESTS)]
        for t in burst:
            t.start()
        acks, leader = [], []
        with MLLPClient("127.0.0.1", port) as client:
            deadline = time.monotonic() + 2 * (FENCE + TTL)  # long past the fence: a starved heartbeat would show
            n = 0
            while time.monotonic() < deadline:
                started = time.monotonic()
                reply = client.send_message(adt(f"R{n}", patient=f"P{n}").decode())
                acks.append((b"MSA|AA|" in reply, time.monotonic() - started))
                leader.append(node.get("/leader", token=None)[0])
                n += 1
                time.sleep(0.2)
        refused = [a for a in answers if a[0] == 503]
        assert len(refused) >= REQUESTS - MAX_PENDING, answers
        assert all(took < 2 and retry == "1" for _, took, retry in refused), refused
        assert all(ok for ok, _ in acks) and max(took for _, took in acks) < 1.0, acks
        assert set(leader) == {200}, leader
        assert read_lease(store).epoch == epoch  # never fenced, never re-elected
        locker.rollback()  # the reads let in finish now
        for t in burst:
            t.join(timeout=30)
        assert sorted(code for code, _, _ in answers).count(200) == REQUESTS - len(refused), answers
    finally:
        locker.close()
        store.close()
        node.stop()
