"""The MLLP sender expects the answers the outbound message's MSH-15 asks for: against a real
listenerd (which honours MSH-15) an NE message is delivered without waiting for an ACK that never
comes, an ER one after a quiet `er_wait_seconds` or refused on its CR; against a receiver that
answers everything, `accept_ack = "always"` waits for that answer, and under "msh15" the answer it
sends anyway is never taken for the next message's ACK."""

from __future__ import annotations

import select
import time

import pytest

from include.destinations_config import MllpDestination, parse_destinations
from spark_jobs.senders import close_connections, send
from spark_jobs.senders.common import DeliveryResult
from spark_jobs.senders.pool import POOL, pool_key
from tests.listeners.conftest import leading_node
from tests.listeners.test_ack_codes import staged_ids
from tests.spark_jobs.test_senders import MllpReceiver, ack_with, hl7_message


def with_accept_ack(control_id: str, accept: str, *, extra: str = "") -> str:
    """`hl7_message` with MSH-15 = `accept` (MSH-13, MSH-14 empty)."""
    head, _, rest = hl7_message(control_id, extra=extra).partition("\r")
    return f"{head}|||{accept}\r{rest}"


def destination(port: int, **settings: object) -> MllpDestination:
    dest = parse_destinations([{"name": "ehr", "kind": "mllp", "host": "127.0.0.1", "port": port, **settings}])["ehr"]
    assert isinstance(dest, MllpDestination)
    return dest


def deliver(dest: MllpDestination, text: str) -> DeliveryResult:
    return send(dest, payload=text, content_type="application/hl7-v2", idempotency_key=f"key-{len(text)}")


@pytest.fixture(autouse=True)
def _fresh_pool():
    close_connections()
    yield
    close_connections()


@pytest.fixture
def listenerd(tmp_path, store_config):
    d = leading_node(tmp_path, store_config, idle_timeout_seconds=30)
    yield d
    d.stop()


def test_ne_and_er_messages_to_a_receiver_that_honours_msh_15_are_delivered_once_without_waiting(
    listenerd, store_config
):
    dest = destination(listenerd.mllp_port, timeout_seconds=5, er_wait_seconds=0.3)
    started = time.monotonic()
    ne = [deliver(dest, with_accept_ack(f"NE{i}", "NE")) for i in range(5)]
    ne_seconds = time.monotonic() - started
    assert [r.ok for r in ne] == [True] * 5
    assert ne[0].detail == "ehr: sent NE0; MSH-15 NE asks for no ACK"
    assert ne_seconds < 2  # not five ACK timeouts (25 s): nothing was awaited
    er_ok = deliver(dest, with_accept_ack("ER1", "ER"))
    assert er_ok == DeliveryResult(True, False, "ehr: sent ER1; no error within 0.3 s (MSH-15 ER)")
    er_bad = deliver(dest, with_accept_ack("ER2", "ER", extra="JO\x00HN"))
    assert (er_bad.ok, er_bad.retryable) == (False, False)
    assert er_bad.detail.startswith("ehr: CR (reject) for ER2: message contains NUL characters")
    al = deliver(dest, with_accept_ack("AL1", "AL"))
    assert al == DeliveryResult(True, False, "ehr: CA for AL1")
    # each delivered message staged exactly once: nothing timed out, so nothing was sent again
    assert staged_ids(store_config) == ["NE0", "NE1", "NE2", "NE3", "NE4", "ER1", "AL1"]


def test_an_su_message_refused_by_a_receiver_that_honours_msh_15_is_not_taken_as_delivered(listenerd, store_config):
    """SU: a refusal is silent, so silence is not success: the ACK timeout makes it retryable."""
    dest = destination(listenerd.mllp_port, timeout_seconds=0.5)
    result = deliver(dest, with_accept_ack("SU1", "SU", extra="JO\x00HN"))
    assert result == DeliveryResult(False, True, "ehr: no ACK for SU1 within 0.5 s")
    assert deliver(dest, with_accept_ack("SU2", "SU")) == DeliveryResult(True, False, "ehr: CA for SU2")
    assert staged_ids(store_config) == ["SU2"]


def test_a_receiver_that_answers_ne_messages_anyway(tmp_path):
    receiver = MllpReceiver(answer=ack_with("AA")).start()
    try:
        always = destination(receiver.port, timeout_seconds=5, accept_ack="always")
        assert deliver(always, with_accept_ack("A1", "NE")) == DeliveryResult(True, False, "ehr: AA for A1")
        close_connections()
        dest = destination(receiver.port, timeout_seconds=5)
        assert deliver(dest, with_accept_ack("N1", "NE")).ok
        # its unasked-for AA reaches the pooled connection; the next message must not take it for its own
        pooled = POOL._idle[pool_key(dest)][0]
        assert select.select([pooled], [], [], 5)[0], "the receiver's AA for N1 never arrived"
        assert deliver(dest, with_accept_ack("N2", "AL")) == DeliveryResult(True, False, "ehr: AA for N2")
        assert receiver.control_ids == ["A1", "N1", "N2"]
        assert receiver.connections == 3  # the connection holding the stale AA was dropped, not read
    finally:
        close_connections()
        receiver.stop()
