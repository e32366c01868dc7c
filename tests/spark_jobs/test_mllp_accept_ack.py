"""Which answers the MLLP sender waits for. By default (`accept_ack = "always"`) every message's
ACK, so an NE message to a receiver that honours MSH-15 times out and is retried, the reason
saying why. With `accept_ack = "msh15"` it expects what the outbound MSH-15 asks for, read exactly
as listenerd reads it: against a real listenerd an NE message is delivered without waiting, an ER
one after a quiet `er_wait_seconds` or refused on its CR; an answer a receiver sends anyway is
read and matched to its own message by MSA-2 — never taken for the next message's, never left
unread under a close (a TCP RST would drop what the receiver had not read yet), and a refusal read
in the same round fails the message it refuses."""

from __future__ import annotations

import select
import time

import pytest

from include.destinations_config import MllpDestination, parse_destinations
from spark_jobs.senders import close_connections, send
from spark_jobs.senders.common import DeliveryResult
from spark_jobs.senders.mllp import LATE_ANSWERS, NE_HINT
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
    dest = destination(listenerd.mllp_port, timeout_seconds=5, er_wait_seconds=0.3, accept_ack="msh15")
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
    dest = destination(listenerd.mllp_port, timeout_seconds=0.5, accept_ack="msh15")
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
        dest = destination(receiver.port, timeout_seconds=5, accept_ack="msh15")
        answered = LATE_ANSWERS["AA"]
        assert deliver(dest, with_accept_ack("N1", "NE")).ok
        # its unasked-for AA reaches the pooled connection; the next message must not take it for its own
        pooled = POOL._idle[pool_key(dest)][0]
        assert select.select([pooled], [], [], 5)[0], "the receiver's AA for N1 never arrived"
        assert deliver(dest, with_accept_ack("N2", "AL")) == DeliveryResult(True, False, "ehr: AA for N2")
        assert receiver.control_ids == ["A1", "N1", "N2"]
        assert receiver.connections == 2  # the stale AA was read and matched to N1: the connection kept
        assert LATE_ANSWERS["AA"] == answered + 1
    finally:
        close_connections()
        receiver.stop()


def test_by_default_an_ne_message_waits_for_its_ack_and_the_timeout_says_why(listenerd, store_config):
    """A receiver that honours NE sends nothing: the default waits, times out, and the retry (then
    the dead letter, after `max_attempts`) names the cause and the two ways out."""
    dest = destination(listenerd.mllp_port, timeout_seconds=0.5)
    assert dest.accept_ack == "always"
    result = deliver(dest, with_accept_ack("D1", "NE"))
    assert result == DeliveryResult(False, True, f"ehr: no ACK for D1 within 0.5 s; {NE_HINT}")
    assert "no ACK" in result.detail and 'accept_ack = "msh15"' in result.detail
    assert staged_ids(store_config) == ["D1"]  # it was received: waiting was the sender's choice
    assert deliver(dest, with_accept_ack("D2", "AL")) == DeliveryResult(True, False, "ehr: CA for D2")


@pytest.mark.parametrize("accept", ["ne", "NE~AL", "NE^X", "\\E\\NE", "Ne"])
def test_an_msh_15_outside_table_0155_is_awaited_as_listenerd_refuses_it(listenerd, store_config, accept):
    """Read as listenerd reads it: not exactly NE is no NE, so the sender waits and gets the refusal
    (it was taken as NE before: delivered, while listenerd had refused it)."""
    dest = destination(listenerd.mllp_port, timeout_seconds=5, accept_ack="msh15")
    result = deliver(dest, with_accept_ack("X1", accept))
    assert (result.ok, result.retryable) == (False, False)
    assert result.detail.startswith("ehr: CR (reject) for X1: unknown_accept_ack_type")
    assert staged_ids(store_config) == []


def test_listenerd_and_the_sender_read_msh_15_alike():
    from include.accept_ack import accept_ack_type, msh_field
    from listeners.hl7msg import HL7HeaderError, parse_header

    for accept in ["NE", " NE ", "ER", "AL", "SU", "", " ", "ne", "NE~AL", "NE^X", "N E", "\\E\\NE", "NEX"]:
        text = with_accept_ack("S1", accept)
        read = accept_ack_type(msh_field(text, 15))
        try:
            header = parse_header(text.encode())
        except HL7HeaderError:
            assert read is None, accept
        else:
            assert read == header.accept_ack_type, accept


class SlowReceiver:
    """A receiver that reads little at a time and answers every message (NE ones too) slowly: its
    kernel buffer holds messages it has not read yet — what a TCP RST from the sender destroys."""

    def __init__(self, *, answer_delay: float = 0.0, per_message: float = 0.5, answers=None) -> None:
        import socket
        import threading

        self.received: list[str] = []
        self.per_message = per_message
        self.answers = answers or (lambda cid: "AA")
        self.answer_delay = answer_delay
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(8)
        self.port = self.srv.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        import threading

        buf = b""
        while True:
            try:
                data = conn.recv(200)
            except OSError as exc:
                self.received.append(f"ERR {type(exc).__name__}")
                return
            if not data:  # the sender is done: what it is owed goes out first
                time.sleep(self.answer_delay + 0.1)
                conn.close()
                return
            buf += data
            while b"\x1c\r" in buf:
                block, _, buf = buf.partition(b"\x1c\r")
                cid = block.lstrip(b"\x0b").split(b"\r")[0].split(b"|")[9].decode()
                self.received.append(cid)
                head = "\x0bMSH|^~\\&|EHR|HOSP|SL|SL|20240101||ACK|A1|P|2.5.1"
                ack = f"{head}\rMSA|{self.answers(cid)}|{cid}\r\x1c\r".encode()
                threading.Timer(self.answer_delay, send_quietly, args=(conn, ack)).start()
                time.sleep(self.per_message)

    def close(self) -> None:
        self.srv.close()


def send_quietly(conn, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass  # the sender left: its loss is what the test looks at


def wait_until(check, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_an_answer_read_on_a_pooled_connection_never_makes_the_sender_reset_unread_messages():
    """F1: five NE messages to a slow receiver that answers them anyway. The pooled connection turns
    readable; dropping it then (a close with unread bytes is a TCP RST) destroyed the messages still
    in the receiver's buffer, already counted delivered. Now the answers are read and the connection
    kept: the receiver gets all five."""
    receiver = SlowReceiver(per_message=0.4)
    try:
        dest = destination(receiver.port, timeout_seconds=2, accept_ack="msh15")
        results = [deliver(dest, with_accept_ack(f"M{i}", "NE")) for i in range(1, 5)]
        time.sleep(0.2)
        results.append(deliver(dest, with_accept_ack("M5", "NE")))
        assert all(r.ok for r in results)
        assert wait_until(lambda: len(receiver.received) >= 5, 6), receiver.received
        assert receiver.received == ["M1", "M2", "M3", "M4", "M5"]
        assert receiver.connections == 1
    finally:
        close_connections()
        receiver.close()


def test_a_late_refusal_is_not_taken_for_the_next_message_and_fails_its_own_in_the_round():
    """F5 and the late refusal: an ER message's CR comes after `er_wait_seconds`, while the next
    message waits for its CA. The CR is its own message's (MSA-2), not the next one's — which was
    failed and resent before (a duplicate); the ER message, delivered after its quiet wait, is
    failed in the same round (dead, the refusal in its reason)."""
    from spark_jobs import deliver_job

    answers = {"R1": "CR", "R2": "CA"}
    receiver = SlowReceiver(answer_delay=0.6, per_message=0.0, answers=answers.get)
    try:
        dest = destination(receiver.port, timeout_seconds=3, er_wait_seconds=0.3, accept_ack="msh15")
        rows = [
            {
                "id": i,
                "destination": "ehr",
                "lane_key": "ehr",
                "payload": with_accept_ack(cid, accept),
                "content_type": "application/hl7-v2",
                "idempotency_key": cid,
                "attempts": 1,
            }
            for i, (cid, accept) in enumerate([("R1", "ER"), ("R2", "AL")], start=1)
        ]
        outcomes = {o["id"]: o for o in deliver_job.deliver_lanes(rows, {"ehr": dest})}
        assert (outcomes[2]["ok"], outcomes[2]["detail"]) == (True, "ehr: CA for R2")
        assert (outcomes[1]["ok"], outcomes[1]["retryable"]) == (False, False)
        assert outcomes[1]["detail"] == "ehr: late refusal CR for R1 (MSH-15 ER, delivered once written)"
        assert receiver.received == ["R1", "R2"]  # nothing sent twice
    finally:
        close_connections()
        receiver.close()


def test_an_ne_refusal_read_at_the_end_of_the_round_fails_its_message():
    """The last NE message of a round: its AR reaches the idle pooled connection, read by the sweep
    at the end of the round."""
    from spark_jobs import deliver_job

    receiver = SlowReceiver(per_message=0.0, answers=lambda cid: "AR")
    try:
        dest = destination(receiver.port, timeout_seconds=3, accept_ack="msh15")
        row = {
            "id": 7,
            "destination": "ehr",
            "lane_key": "ehr",
            "payload": with_accept_ack("Z1", "NE"),
            "content_type": "application/hl7-v2",
            "idempotency_key": "Z1",
            "attempts": 1,
        }
        real_sweep = deliver_job.sweep_late_answers

        def sweep_once_answered() -> None:  # the AR is on its way: the sweep reads what has arrived
            wait_until(lambda: bool(select.select(POOL.idle(object), [], [], 0)[0]), 3)
            real_sweep()

        deliver_job.sweep_late_answers = sweep_once_answered
        try:
            (outcome,) = deliver_job.deliver_lanes([row], {"ehr": dest})
        finally:
            deliver_job.sweep_late_answers = real_sweep
        assert (outcome["ok"], outcome["retryable"]) == (False, False)
        assert outcome["detail"] == "ehr: late refusal AR for Z1 (MSH-15 NE, delivered once written)"
    finally:
        close_connections()
        receiver.close()


def test_er_wait_longer_than_the_ack_timeout_is_refused_at_load():
    from include.destinations_config import DestinationConfigError

    with pytest.raises(DestinationConfigError, match=r"er_wait_seconds.*must be <= timeout_seconds"):
        destination(2575, timeout_seconds=1, er_wait_seconds=3)
    assert destination(2575, timeout_seconds=1, er_wait_seconds=1).er_wait_seconds == 1


def test_an_answer_read_while_a_timed_out_connection_closes_is_named_as_its_messages():
    receiver = SlowReceiver(answer_delay=1.2, per_message=0.0, answers=lambda cid: "CA")
    try:
        dest = destination(receiver.port, timeout_seconds=1)
        before = (LATE_ANSWERS["CA"], LATE_ANSWERS["unmatched"])
        result = deliver(dest, with_accept_ack("T1", "AL"))
        assert result == DeliveryResult(False, True, "ehr: no ACK for T1 within 1 s")
        # the close read the CA that came 0.2 s after the timeout: T1's, not "no message's"
        assert (LATE_ANSWERS["CA"], LATE_ANSWERS["unmatched"]) == (before[0] + 1, before[1])
    finally:
        close_connections()
        receiver.close()
