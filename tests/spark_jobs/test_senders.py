"""The senders against real receivers: python-hl7's asyncio MLLP server and a ThreadingHTTPServer,
each in a background thread, and real files (the config and lane keys: tests/config/test_destinations_config.py).

`MllpReceiver` and `HttpReceiver` are reused by test_deliver_job.py.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import ssl
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hl7
import hl7.mllp
import pytest

from include.app.lab.postgres_server import free_port
from include.destinations_config import FileDestination, HttpDestination, MllpDestination, parse_destinations
from spark_jobs.senders import close_connections, send
from spark_jobs.senders.common import DeliveryResult
from spark_jobs.senders.file import FileSend, send_file_lanes
from tests.listeners.test_server_tls import make_pki

# An MLLP receiver's answer to one message: an ACK text to send back, None to stay silent, or
# HANG_UP to close the connection without answering.
Answer = Callable[[str], "str | None"]
HANG_UP = "<hang up>"


def hl7_message(control_id: str, patient: str = "P1", *, charset: str = "", extra: str = "") -> str:
    """A small synthetic ADT^A08 (no PHI); MSH-10 = control_id, PID-3.1 = patient."""
    msh = f"MSH|^~\\&|STAGELINE|SL|EHR|HOSP|20240101120000||ADT^A08^ADT_A01|{control_id}|P|2.5.1"
    if charset:
        msh += f"||||||{charset}"
    return f"{msh}\rEVN|A08|20240101120000\rPID|1||{patient}^^^HOSP^MR||DOE^{extra or 'JOHN'}\r"


def ack_with(code: str) -> Answer:
    """python-hl7's own ACK builder: MSA-1 = code, MSA-2 = the message's MSH-10."""
    return lambda text: str(hl7.parse(text).create_ack(ack_code=code))


def raw_ack(code: str, acked: str) -> str:
    return f"MSH|^~\\&|EHR|HOSP|STAGELINE|SL|20240101120000||ACK^A08^ACK|A1|P|2.5.1\rMSA|{code}|{acked}|test\r"


def control_id_of(text: str) -> str:
    return str(hl7.parse(text).segment("MSH")(10))


@dataclass
class MllpReceiver:
    """python-hl7's asyncio MLLP server on its own event loop in a background thread.

    Records every message in arrival order (raw bytes) and answers via `answer`; with
    `close_after_ack` it drops the connection after each ACK (a receiver that does not keep
    connections open). Thread-safe enough for tests: the lists are appended on the loop thread
    and read after the sends returned.
    """

    answer: Answer = field(default_factory=lambda: ack_with("AA"))
    close_after_ack: bool = False
    tls: ssl.SSLContext | None = None
    received: list[bytes] = field(default_factory=list)
    connections: int = 0
    port: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mllp-receiver", daemon=True)
        self._writers: list[Any] = []

    @property
    def texts(self) -> list[str]:
        return [b.decode("utf-8", errors="replace") for b in self.received]

    @property
    def control_ids(self) -> list[str]:
        return [control_id_of(t) for t in self.texts]

    def start(self) -> MllpReceiver:
        self._thread.start()
        assert self._ready.wait(10), "MLLP receiver did not start"
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            hl7.mllp.start_hl7_server(self._client, "127.0.0.1", 0, ssl=self.tls)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.close()

    async def _client(self, reader: hl7.mllp.HL7StreamReader, writer: hl7.mllp.HL7StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                block = await reader.readblock()
                self.received.append(block)
                ack = self.answer(block.decode("utf-8", errors="replace"))
                if ack is None:
                    continue
                if ack == HANG_UP:
                    break
                writer.writeblock(ack.encode("utf-8"))
                await writer.drain()
                if self.close_after_ack:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        def shutdown() -> None:
            for w in self._writers:
                w.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(shutdown)
        self._thread.join(10)


@dataclass
class HttpRequest:
    path: str
    idempotency_key: str | None
    content_type: str | None
    body: bytes
    connection: tuple[str, int]


class HttpReceiver:
    """A real HTTP/1.1 server (keep-alive) in a thread; records each POST, answers `status(key)`.

    A status of None holds the request until `stop()` (a receiver that never answers).
    """

    def __init__(
        self,
        status: Callable[[str | None], int | None] = lambda key: 200,
        *,
        reply: Callable[[HttpRequest], tuple[int, str, bytes]] | None = None,
    ) -> None:
        self.status = status
        self.reply = reply  # a server with answers of its own: (status, content type, body) per request
        self.requests: list[HttpRequest] = []
        self._release = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # the http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                key = self.headers.get("Idempotency-Key")
                request = HttpRequest(self.path, key, self.headers.get("Content-Type"), body, self.client_address)
                receiver.requests.append(request)
                code = receiver.status(key) if receiver.reply is None else None
                if receiver.reply is not None:
                    code, content_type, reply = receiver.reply(request)
                elif code is None:
                    receiver._release.wait(30)
                    self.close_connection = True
                    return
                else:
                    content_type, reply = "text/plain", f"status {code}".encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/inbound/hl7"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="http-receiver", daemon=True
        )

    @property
    def keys(self) -> list[str | None]:
        return [r.idempotency_key for r in self.requests]

    def start(self) -> HttpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


@pytest.fixture(autouse=True)
def _no_cached_connections() -> Iterator[None]:
    """Every test starts and ends with an empty connection cache (receivers differ per test)."""
    close_connections()
    yield
    close_connections()


@pytest.fixture
def mllp_receiver() -> Iterator[Callable[..., MllpReceiver]]:
    started: list[MllpReceiver] = []

    def make(**kwargs: Any) -> MllpReceiver:
        receiver = MllpReceiver(**kwargs).start()
        started.append(receiver)
        return receiver

    yield make
    close_connections()
    for r in started:
        r.stop()


@pytest.fixture
def http_receiver() -> Iterator[Callable[..., HttpReceiver]]:
    started: list[HttpReceiver] = []

    def make(status: Callable[[str | None], int | None] = lambda key: 200) -> HttpReceiver:
        receiver = HttpReceiver(status).start()
        started.append(receiver)
        return receiver

    yield make
    close_connections()
    for r in started:
        r.stop()


def mllp(receiver: MllpReceiver, **settings: Any) -> MllpDestination:
    dest = parse_destinations(
        [{"name": "ehr", "kind": "mllp", "host": "127.0.0.1", "port": receiver.port, "timeout_seconds": 5, **settings}]
    )["ehr"]
    assert isinstance(dest, MllpDestination)
    return dest


def send_hl7(dest: Any, control_id: str, **kwargs: Any) -> DeliveryResult:
    return send(
        dest,
        payload=hl7_message(control_id, **kwargs),
        content_type="application/hl7-v2",
        idempotency_key=f"key-{control_id}",
    )


# --- MLLP -------------------------------------------------------------------------------------


def test_mllp_aa_is_ok_and_one_connection_carries_consecutive_messages(mllp_receiver) -> None:
    receiver = mllp_receiver()
    dest = mllp(receiver)
    results = [send_hl7(dest, f"C{i}") for i in range(3)]
    assert results == [DeliveryResult(True, False, f"ehr: AA for C{i}") for i in range(3)]
    assert receiver.control_ids == ["C0", "C1", "C2"]
    assert receiver.connections == 1
    assert receiver.texts[0] == hl7_message("C0")  # the message goes out unchanged


def test_mllp_ae_for_one_control_id_is_retryable_and_the_rest_still_go_through(mllp_receiver) -> None:
    receiver = mllp_receiver(answer=lambda t: raw_ack("AE" if control_id_of(t) == "BAD" else "AA", control_id_of(t)))
    dest = mllp(receiver)
    assert send_hl7(dest, "OK1").ok
    bad = send_hl7(dest, "BAD")
    assert (bad.ok, bad.retryable) == (False, True)
    assert bad.detail == "ehr: AE for BAD: test"
    assert send_hl7(dest, "OK2").ok
    assert receiver.connections == 1  # an AE for this very message leaves the connection in step


def test_mllp_ar_is_permanent_unless_the_destination_says_otherwise(mllp_receiver) -> None:
    receiver = mllp_receiver(answer=ack_with("AR"))
    assert send_hl7(mllp(receiver), "C1") == DeliveryResult(False, False, "ehr: AR (reject) for C1")
    lenient = send_hl7(mllp(receiver, permanent_ack_codes=[]), "C2")
    assert (lenient.ok, lenient.retryable, lenient.detail) == (False, True, "ehr: AR for C2")


def test_mllp_ack_for_another_control_id_is_retryable_and_drops_the_connection(mllp_receiver) -> None:
    wrong = {"C2"}
    receiver = mllp_receiver(answer=lambda t: raw_ack("AA", "OTHER" if control_id_of(t) in wrong else control_id_of(t)))
    dest = mllp(receiver)
    assert send_hl7(dest, "C1").ok
    mismatch = send_hl7(dest, "C2")
    assert (mismatch.ok, mismatch.retryable) == (False, True)
    assert mismatch.detail == "ehr: AA acknowledges control id 'OTHER', expected 'C2'"
    assert send_hl7(dest, "C3").ok
    assert receiver.connections == 2


def test_mllp_receiver_that_never_answers_times_out_as_retryable(mllp_receiver) -> None:
    receiver = mllp_receiver(answer=lambda t: None)
    dest = mllp(receiver, timeout_seconds=0.3)
    started = time.monotonic()
    result = send_hl7(dest, "C1")
    assert time.monotonic() - started < 3
    assert result == DeliveryResult(False, True, "ehr: no ACK for C1 within 0.3 s")
    assert receiver.control_ids == ["C1"]


def test_mllp_connection_refused_is_retryable() -> None:
    dest = parse_destinations(
        [{"name": "ehr", "kind": "mllp", "host": "127.0.0.1", "port": free_port(), "timeout_seconds": 2}]
    )["ehr"]
    result = send_hl7(dest, "C1")
    assert (result.ok, result.retryable) == (False, True)
    assert "ConnectionRefusedError" in result.detail


def test_mllp_connection_the_receiver_closed_is_not_reused_and_nothing_is_sent_twice(mllp_receiver) -> None:
    receiver = mllp_receiver(close_after_ack=True)
    dest = mllp(receiver)
    for i in range(3):
        assert send_hl7(dest, f"C{i}").ok
    assert receiver.control_ids == ["C0", "C1", "C2"]
    assert receiver.connections == 3


def hang_up_once_on(control_id: str) -> Answer:
    hung_up: list[str] = []

    def answer(text: str) -> str | None:
        if control_id_of(text) == control_id and not hung_up:
            hung_up.append(control_id)
            return HANG_UP
        return raw_ack("AA", control_id_of(text))

    return answer


def test_mllp_reused_connection_dropped_before_the_ack_is_retried_once_on_a_fresh_one(mllp_receiver) -> None:
    receiver = mllp_receiver(answer=hang_up_once_on("C1"))
    dest = mllp(receiver)
    assert send_hl7(dest, "C0").ok
    assert send_hl7(dest, "C1").ok
    assert receiver.control_ids == ["C0", "C1", "C1"]  # at-least-once: the receiver de-duplicates on MSH-10
    assert receiver.connections == 2


def test_mllp_fresh_connection_dropped_before_the_ack_is_retryable(mllp_receiver) -> None:
    receiver = mllp_receiver(answer=hang_up_once_on("C1"))
    result = send_hl7(mllp(receiver), "C1")
    assert result == DeliveryResult(
        False, True, "ehr: connection lost before the ACK for C1: connection closed by the receiver"
    )
    assert receiver.control_ids == ["C1"]


def test_mllp_without_connection_reuse_opens_a_connection_per_message(mllp_receiver) -> None:
    receiver = mllp_receiver()
    dest = mllp(receiver, idle_timeout_seconds=0)
    assert all(send_hl7(dest, f"C{i}").ok for i in range(2))
    assert receiver.connections == 2


def test_mllp_message_without_msh10_is_permanent_and_not_sent(mllp_receiver) -> None:
    receiver = mllp_receiver()
    result = send(
        mllp(receiver), payload="MSH|^~\\&|A|B|C|D|20240101||ADT^A08||P|2.5\r", content_type="x", idempotency_key="k"
    )
    assert (result.ok, result.retryable) == (False, False)
    assert "no MSH-10" in result.detail
    assert receiver.received == []


def test_mllp_encodes_the_message_in_its_msh18_charset(mllp_receiver) -> None:
    receiver = mllp_receiver(answer=lambda t: raw_ack("AA", "C1"))
    message = hl7_message("C1", charset="8859/1", extra="JOSÉ")
    assert send(mllp(receiver), payload=message, content_type="application/hl7-v2", idempotency_key="k").ok
    assert receiver.received == [message.encode("iso8859_1")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_pki(tmp_path_factory.mktemp("pki"))


def mtls_receiver_context(pki: Any) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
    context.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def test_mllp_over_mutual_tls_delivers_and_reuses_the_connection(mllp_receiver, pki) -> None:
    receiver = mllp_receiver(tls=mtls_receiver_context(pki))
    dest = mllp(receiver, tls={"ca_file": str(pki.ca), "cert_file": str(pki.client), "server_hostname": "localhost"})
    assert [send_hl7(dest, f"C{i}").ok for i in range(2)] == [True, True]
    assert receiver.control_ids == ["C0", "C1"]
    assert receiver.connections == 1


def test_mllp_tls_to_an_untrusted_receiver_is_retryable_and_sends_nothing(mllp_receiver, pki) -> None:
    receiver = mllp_receiver(tls=mtls_receiver_context(pki))
    dest = mllp(receiver, tls={"ca_file": str(pki.rogue_ca), "cert_file": str(pki.client)})
    result = send_hl7(dest, "C1")
    assert (result.ok, result.retryable) == (False, True)
    assert "CERTIFICATE_VERIFY_FAILED" in result.detail
    assert receiver.received == []


# --- file -------------------------------------------------------------------------------------


def file_dest(directory: Path, **settings: Any) -> FileDestination:
    dest = parse_destinations([{"name": "archive", "kind": "file", "directory": str(directory), **settings}])["archive"]
    assert isinstance(dest, FileDestination)
    return dest


def test_file_is_named_by_the_idempotency_key_and_a_redelivery_overwrites_it(tmp_path: Path) -> None:
    dest = file_dest(tmp_path)
    first = send(dest, payload=hl7_message("C1"), content_type="application/hl7-v2", idempotency_key="out-17")
    assert first == DeliveryResult(True, False, f"archive: wrote out-17.hl7 ({len(hl7_message('C1'))} bytes)")
    again = send(dest, payload=hl7_message("C1"), content_type="application/hl7-v2", idempotency_key="out-17")
    assert again.ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out-17.hl7"]  # no temp files left behind
    assert (tmp_path / "out-17.hl7").read_bytes() == hl7_message("C1").encode()
    assert stat.S_IMODE(os.stat(tmp_path / "out-17.hl7").st_mode) == 0o600


def test_file_names_cannot_escape_the_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dest = file_dest(out, suffix=".txt", mode=0o640)
    assert send(dest, payload="x", content_type="text/plain", idempotency_key="../evil/k").ok
    assert send(dest, payload="y", content_type="text/plain", idempotency_key="..").ok
    assert sorted(p.name for p in out.iterdir()) == ["%2E.%2Fevil%2Fk.txt", "%2E..txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert stat.S_IMODE(os.stat(out / "%2E..txt").st_mode) == 0o640


def test_file_into_a_missing_directory_is_retryable_and_creates_nothing(tmp_path: Path) -> None:
    result = send(file_dest(tmp_path / "missing"), payload="x", content_type="text/plain", idempotency_key="k")
    assert (result.ok, result.retryable) == (False, True)
    assert not (tmp_path / "missing").exists()


def test_file_uses_the_content_type_charset(tmp_path: Path) -> None:
    dest = file_dest(tmp_path, suffix="")
    assert send(dest, payload="é", content_type="text/plain; charset=iso-8859-1", idempotency_key="k").ok
    assert (tmp_path / "k").read_bytes() == "é".encode("iso8859_1")
    bad = send(dest, payload="€", content_type="text/plain; charset=ascii", idempotency_key="k2")
    assert (bad.ok, bad.retryable) == (False, False)


def test_file_lanes_are_written_together_and_a_lane_stops_at_its_first_failure(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    a, b = file_dest(one, suffix=""), file_dest(two, suffix="")
    lanes = [
        [
            FileSend(a, "a1", "text/plain", "a1"),
            FileSend(a, "€", "text/plain; charset=ascii", "a2"),
            FileSend(a, "a3", "text/plain", "a3"),
        ],
        [FileSend(b, "b1", "text/plain", "b1"), FileSend(b, "b2", "text/plain", "b2")],
        [FileSend(file_dest(tmp_path / "missing"), "c1", "text/plain", "c1")],
    ]
    results = send_file_lanes(lanes)
    assert [[None if r is None else (r.ok, r.retryable) for r in lane] for lane in results] == [
        [(True, False), (False, False), None],
        [(True, False), (True, False)],
        [(False, True)],
    ]
    assert sorted(p.name for p in one.iterdir()) == ["a1"]  # a3 never written: its lane stopped at a2
    assert sorted(p.name for p in two.iterdir()) == ["b1", "b2"]  # no temp files left anywhere
    assert (two / "b2").read_text() == "b2"


# --- HTTP -------------------------------------------------------------------------------------


def http_dest(receiver: HttpReceiver, **settings: Any) -> HttpDestination:
    dest = parse_destinations(
        [
            {
                "name": "api",
                "kind": "http",
                "url": receiver.url,
                "timeout_seconds": 5,
                "headers": {"X-Tenant": "t1"},
                **settings,
            }
        ]
    )["api"]
    assert isinstance(dest, HttpDestination)
    return dest


def test_http_posts_with_the_idempotency_key_and_content_type_over_one_connection(http_receiver) -> None:
    receiver = http_receiver()
    dest = http_dest(receiver)
    for key in ("k1", "k2"):
        result = send(dest, payload=hl7_message(key), content_type="application/hl7-v2", idempotency_key=key)
        assert result == DeliveryResult(True, False, "api: HTTP 200 OK")
    assert [(r.path, r.idempotency_key, r.content_type, r.body) for r in receiver.requests] == [
        ("/inbound/hl7", k, "application/hl7-v2", hl7_message(k).encode()) for k in ("k1", "k2")
    ]
    assert len({r.connection for r in receiver.requests}) == 1


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(408, True), (429, True), (500, True), (503, True), (400, False), (404, False), (409, False)],
)
def test_http_status_decides_retryable_or_permanent(http_receiver, status: int, retryable: bool) -> None:
    receiver = http_receiver(lambda key: status)
    result = send(http_dest(receiver), payload="x", content_type="text/plain", idempotency_key="k")
    assert (result.ok, result.retryable) == (False, retryable)
    assert result.detail.startswith(f"api: HTTP {status} ") and result.detail.endswith(f": status {status}")


def test_http_without_an_answer_times_out_as_retryable(http_receiver) -> None:
    receiver = http_receiver(lambda key: None)
    result = send(http_dest(receiver, timeout_seconds=0.3), payload="x", content_type="text/plain", idempotency_key="k")
    assert result == DeliveryResult(False, True, "api: no response within 0.3 s")


def test_http_connection_refused_is_retryable() -> None:
    dest = parse_destinations([{"name": "api", "kind": "http", "url": f"http://127.0.0.1:{free_port()}/x"}])["api"]
    result = send(dest, payload="x", content_type="text/plain", idempotency_key="k")
    assert (result.ok, result.retryable) == (False, True)
    assert "ConnectionRefusedError" in result.detail
