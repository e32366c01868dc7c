"""listenerd's /metrics carries each destination's and connection's figures, read from the store on
scrape (listeners/store_metrics.py): a live listenerd, messages sent over MLLP (one of them an HL7
batch), the stages moved by tests/support/pump.py, and every family asserted by its labels — and a
store that does not answer costs a scrape at most its timeout, with `stageline_store_up 0`, while
the daemon keeps answering."""

from __future__ import annotations

import socket
import time

import psycopg
import pytest
from hl7.client import MLLPClient
from prometheus_client.parser import text_string_to_metric_families

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.store import Store
from include.store.lease import read_lease
from listeners.store_metrics import STALLED_SECONDS
from tests.support import pump
from tests.support.hostile import adt


def scrape(d: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = d.get("/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def batch(n: int, name: str) -> bytes:
    body = "".join(f"MSH|^~\\&|A|B|C|D|20240101||ADT^A01|{name}-{k}|P|2.5\rPID|1||P{k}\r" for k in range(n))
    return f"BHS|^~\\&|A|B|C|D|20240101||||{name}\r{body}BTS|{n}\r".encode()


def send_frame(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(b"\x0b" + data + b"\x1c\r")
        reply = b""
        while not reply.endswith(b"\x1c\r"):
            chunk = s.recv(65536)
            assert chunk, "closed without an answer"
            reply += chunk
    return reply


@pytest.fixture
def daemon(tmp_path, store_config):
    port = free_port()
    d = Daemon(
        tmp_path / "node", store_config, node_id="solo:1:aa", inbound=[{"name": "adt-in", "kind": "mllp", "port": port}]
    ).start()
    try:
        wait_for(lambda: port_open(port), timeout=20, what="bind")
        yield d, port, store_config
    finally:
        d.stop()


def test_metrics_carry_each_destinations_and_connections_figures_from_the_store(daemon) -> None:
    d, port, store_config = daemon
    before = scrape(d)
    assert value(before, "stageline_store_up") == 1
    assert value(before, "process_resident_memory_bytes") > 0 and value(before, "process_cpu_seconds_total") >= 0
    assert not [name for name, _ in before if name.endswith("_created")]

    with MLLPClient("127.0.0.1", port) as client:
        for n in range(4):
            client.send_message(adt(f"M{n}", patient=f"P{n}").decode())
    reply = send_frame(port, batch(3, "BATCH1"))  # one frame, three messages, one answer
    assert b"MSA|AA|BATCH1" in reply
    store = Store(store_config)
    try:
        epoch = read_lease(store).epoch
        assert pump.route(store, epoch=epoch, destinations=lambda row: ["ehr", "lab"]) == 7
        refused = pump.deliver(store, epoch=epoch, send=lambda row: row["destination"] == "ehr")
        assert len(refused.done) == 7 and len(refused.retrying) == 1 and len(refused.released) == 6
    finally:
        store.close()

    def counted() -> dict:
        samples = scrape(d)
        done = value(samples, "stageline_destination_messages_total", destination="ehr", outcome="sent") == 7
        return samples if done else {}

    samples = wait_for(counted, timeout=20, interval=0.5, what="the EHR's 7 deliveries on /metrics")
    # the frames as the listener counts them: the batch is one frame, one answer (it was counted twice)
    assert value(samples, "stageline_messages_received_total", connection="adt-in") == 5
    assert value(samples, "stageline_acks_total", connection="adt-in", code="AA") == 5
    # the store's figures: messages
    conn = "stageline_connection_messages_total"
    assert value(samples, conn, connection="adt-in", outcome="received") == 7
    assert value(samples, conn, connection="adt-in", outcome="sent") == 7
    assert value(samples, conn, connection="adt-in", outcome="filtered") == 0
    dest = "stageline_destination_messages_total"
    assert value(samples, dest, destination="ehr", outcome="received") == 7
    assert value(samples, dest, destination="lab", outcome="received") == 7
    assert value(samples, dest, destination="lab", outcome="sent") == 0
    rows = "stageline_destination_rows"
    assert [value(samples, rows, destination="lab", state=s) for s in ("queued", "retrying", "in_flight", "dead")] == [
        6,
        1,
        0,
        0,
    ]
    assert value(samples, rows, destination="ehr", state="queued") == 0
    assert value(samples, "stageline_destination_oldest_queued_seconds", destination="lab") >= 0
    assert value(samples, "stageline_destination_oldest_queued_seconds", destination="ehr") == 0
    assert value(samples, "stageline_connection_rows", connection="adt-in", state="queued") == 6
    latency = "stageline_delivery_latency_seconds"
    assert value(samples, latency + "_count", destination="ehr", connection="adt-in") == 7
    assert value(samples, latency + "_bucket", destination="ehr", connection="adt-in", le="+Inf") == 7
    assert 0 <= value(samples, latency + "_sum", destination="ehr", connection="adt-in") < 7 * 60


def test_a_store_that_does_not_answer_costs_a_scrape_its_timeout_and_stalls_to_store_up_0(
    tmp_path, pg_server, pg_config_fresh
) -> None:
    port = free_port()
    d = Daemon(
        tmp_path / "node",
        pg_config_fresh,
        node_id="solo:1:aa",
        inbound=[{"name": "adt-in", "kind": "mllp", "port": port}],
    ).start()
    locker = psycopg.connect(pg_server.conninfo(pg_config_fresh.database))
    try:
        wait_for(lambda: port_open(port), timeout=20, what="bind")
        assert value(scrape(d), "stageline_store_up") == 1
        locker.execute("LOCK TABLE stage_outbound IN ACCESS EXCLUSIVE MODE")  # every read of it waits
        time.sleep(2.5)  # past the figures' cache: the next scrape reads again
        started = time.monotonic()
        samples = scrape(d)
        took = time.monotonic() - started
        # slow is not down: the last figures, the read's running time, store_up still 1 ...
        assert value(samples, "stageline_store_up") == 1 and 1.5 <= took < 4, took
        assert value(samples, "stageline_store_read_seconds") >= 1.5
        started = time.monotonic()
        assert d.get("/health", token=None)[0] == 200 and time.monotonic() - started < 1  # the reactor is free
        # ... until the read has stalled
        wait_for(lambda: value(scrape(d), "stageline_store_up") == 0, timeout=20, interval=0.5, what="stalled")
        assert value(scrape(d), "stageline_store_read_seconds") >= STALLED_SECONDS
        locker.rollback()
        wait_for(lambda: value(scrape(d), "stageline_store_up") == 1, timeout=20, interval=0.5, what="store up again")
    finally:
        locker.close()
        d.stop()
