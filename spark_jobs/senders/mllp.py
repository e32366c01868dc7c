"""MLLP sender: one framed message, then wait for its ACK (original-mode acknowledgement).

MLLP acknowledgements (original mode): `AA`/`CA` ok; `AE`/`CE` retryable; `AR`/`CR` permanent by
default — an application reject says this message is unacceptable, and re-sending identical bytes
gets the same answer. HL7 also allows AR for "system down"; a receiver that uses it that way is
configured with `"permanent_ack_codes": []`, making AR retryable (still bounded by
`max_attempts`). An ACK whose MSA-2 is not the sent MSH-10, an unknown code, no ACK within
`timeout_seconds`, or a broken connection are retryable.

Which answers to wait for (`accept_ack`): `"always"` (the default) waits for every message's ACK,
as MLLP senders do. A receiver that honours an outbound MSH-15 `NE` then sends none: the message
times out, is retried and dead-lettered after `max_attempts`, the reason saying so. `"msh15"`
expects what MSH-15 asks a receiver that honours it for (HL7 v2.5.1 section 2.9.3), read exactly
as listenerd reads it (`include.accept_ack`): `NE` none — delivered once written, at most once
(a receiver that closes, refuses or crashes after the write is not seen); `ER` only an error —
delivered after `er_wait_seconds` of silence; anything else, the ACK.

Answers not awaited (an `NE` message's, an `ER` message's after its wait) may still come. A pooled
connection remembers the control ids it carried (`_Link.owed`) and reads what is there before each
write and while waiting for the next ACK: an answer whose MSA-2 is one of them is that message's,
never the next one's (logged; an `AE`/`AR`/`CE`/`CR` is a late refusal, `take_late_refusals`, that
the deliver stage turns into a failed delivery when the row is still in its round). A connection
is never closed with unread bytes (a close then sends a TCP RST, and the receiver's kernel drops
what it had not read yet — messages already counted as delivered): it is read, half-closed
(shutdown), read again for at most CLOSE_DRAIN_SECONDS, then closed.

Idempotency: MLLP has no header for a key. The message goes out unchanged, so its MSH-10 is the
same on every attempt; receivers de-duplicate on MSH-10 (HL7's own rule). Connections are reused
through `spark_jobs.senders.pool`; only a well-formed ACK for the very message sent keeps one.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable

from include.accept_ack import accept_ack_type, msh_field
from include.destinations_config import ACK_CODES, MllpDestination
from include.hl7path import value as hl7_value
from spark_jobs.senders.client_tls import ssl_context
from spark_jobs.senders.common import DEFAULT_CONTENT_TYPE, DeliveryResult, describe_error, payload_codec, printable
from spark_jobs.senders.pool import POOL, close_quietly, pool_key

__all__ = ["LATE_ANSWERS", "NE_HINT", "send_mllp", "sweep_late_answers", "take_late_refusals"]

MAX_ACK_BYTES = 1 << 20  # an ACK larger than this is not an ACK
START_BLOCK, END_BLOCK, CARRIAGE_RETURN = b"\x0b", b"\x1c", b"\x0d"
CLOSE_DRAIN_SECONDS = 0.5  # after the half-close, how long the receiver's last answers are read
MAX_OWED = 4096  # control ids a connection remembers (the oldest forgotten first)
NE_HINT = (
    'the message\'s MSH-15 is NE — set accept_ack = "msh15" for a receiver that honours it, '
    "or rewrite MSH-15 with a transform rule"
)

_log = logging.getLogger("stageline.deliver.mllp")

LATE_ANSWERS: Counter[str] = Counter()
"""Answers read for messages whose answer was not awaited, by MSA-1 (this process)."""
_late_refusals: dict[tuple[str, str], str] = {}  # (destination, control id) -> why
_late_lock = threading.Lock()


def take_late_refusals() -> dict[tuple[str, str], str]:
    """(destination name, control id) → reason of every late refusal read since the last call."""
    with _late_lock:
        found = dict(_late_refusals)
        _late_refusals.clear()
    return found


class _StaleConnection(OSError):
    """The peer had closed a reused connection before answering (EOF before any ACK byte)."""


class _Link:
    """A pooled MLLP connection: its socket, bytes read past the last ACK, and the control ids sent
    on it whose answers were not awaited (control id -> why not), so a late one is recognised."""

    def __init__(self, sock: socket.socket, dest: MllpDestination) -> None:
        self.sock = sock
        self.name = dest.name
        self.buf = bytearray()
        self.owed: OrderedDict[str, str] = OrderedDict()

    def fileno(self) -> int:
        return self.sock.fileno()

    def owe(self, control_id: str, note: str) -> None:
        self.owed[control_id] = note
        self.owed.move_to_end(control_id)
        while len(self.owed) > MAX_OWED:
            self.owed.popitem(last=False)

    def drain(self) -> None:
        """Read what is there now, without waiting, and settle every whole answer in it.
        :raises _StaleConnection: the receiver closed the connection."""
        while _readable(self.sock):
            chunk = self.sock.recv(65536)
            if not chunk:
                self.settle_buffered()
                raise _StaleConnection("connection closed by the receiver")
            self.buf += chunk
            if len(self.buf) > MAX_ACK_BYTES:
                raise ValueError(f"more than {MAX_ACK_BYTES} unread bytes from the receiver")
        self.settle_buffered()

    def settle_buffered(self) -> None:
        while END_BLOCK + CARRIAGE_RETURN in self.buf:
            block = _pop_block(self.buf)
            if block is not None:
                self.settle(block, None)

    def settle(self, block: bytes, awaited: str | None) -> bool:
        """Record an answer for a message sent earlier on this connection; False when it is not one
        (neither owed nor, when `awaited` is None, anything we can place)."""
        text = block.decode("utf-8", errors="replace")
        code = (hl7_value(text, "MSA-1") or "").strip().upper()
        acked = (hl7_value(text, "MSA-2") or "").strip()
        if awaited is not None and acked == awaited:  # the answer waited for (even if sent before too)
            self.owed.pop(acked, None)
            return False
        note = self.owed.pop(acked, None)
        if note is None:
            if awaited is None:
                LATE_ANSWERS["unmatched"] += 1
                _log.warning(
                    "%s: an answer for no message awaiting one (MSA-2 %r, %s) skipped",
                    self.name,
                    printable(acked),
                    printable(code),
                )
            return False
        LATE_ANSWERS[code or "none"] += 1
        if code in ("AA", "CA"):
            _log.info("%s: %s for %s (%s, not awaited)", self.name, code, acked, note)
        else:
            reason = printable(hl7_value(text, "MSA-3") or hl7_value(text, "ERR-8") or "")
            why = f"{self.name}: late refusal {printable(code)} for {acked} ({note})"
            why += f": {reason}" if reason else ""
            _log.warning("%s", why)
            with _late_lock:
                _late_refusals[(self.name, acked)] = why
        return True

    def close(self) -> None:
        """Never close with unread bytes (that is a TCP RST, and the receiver's kernel would drop what
        it had not read): read what is there, half-close, read the rest for a short while, close."""
        sock = self.sock
        try:
            self.drain()
            if not isinstance(sock, ssl.SSLSocket):  # (TLS: no half-close without ending the session)
                sock.shutdown(socket.SHUT_WR)
            end = time.monotonic() + CLOSE_DRAIN_SECONDS
            while (remaining := end - time.monotonic()) > 0:
                sock.settimeout(remaining)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                self.buf += chunk
                self.settle_buffered()
                if len(self.buf) > MAX_ACK_BYTES:
                    break
        except (OSError, ValueError):
            pass
        finally:
            close_quietly(sock)


def sweep_late_answers() -> None:
    """Settle what the idle pooled MLLP connections hold now (the end of a deliver round)."""
    for link in POOL.idle(_Link):
        try:
            link.drain()
        except (OSError, ValueError):
            pass  # left for the next take, which drops it


def send_mllp(dest: MllpDestination, payload: str) -> DeliveryResult:
    """Send `payload` and judge its ACK; a reused connection found dead is retried once on a fresh one."""
    control_id = hl7_value(payload, "MSH-10")
    if control_id is None or not control_id.strip():
        return DeliveryResult.permanent(f"{dest.name}: payload has no MSH-10, so no ACK could be matched to it")
    control_id = control_id.strip()
    codec = payload_codec(payload, DEFAULT_CONTENT_TYPE)
    try:
        frame = START_BLOCK + payload.encode(codec) + END_BLOCK + CARRIAGE_RETURN
    except UnicodeEncodeError as exc:
        return DeliveryResult.permanent(
            f"{dest.name}: message {control_id} cannot be encoded as {codec} (MSH-18): position {exc.start}"
        )
    accept = accept_ack_type(msh_field(payload, 15))
    expected = _expected_answers(dest, accept)
    key = pool_key(dest)
    link = POOL.take(key, dest.idle_timeout_seconds, quiet_only=False)
    reused = link is not None
    deadline = time.monotonic() + dest.timeout_seconds
    while True:
        try:
            if link is None:
                link = _Link(_mllp_connect(dest), dest)
                deadline = time.monotonic() + dest.timeout_seconds
            else:
                link.drain()  # answers to earlier messages, or the receiver's close, before this write
            link.sock.settimeout(max(0.001, deadline - time.monotonic()))
            link.sock.sendall(frame)
            if expected == "NE":
                link.owe(control_id, "MSH-15 NE, delivered once written")
                return _unanswered(dest, key, link, f"{dest.name}: sent {control_id}; MSH-15 NE asks for no ACK")
            if expected == "ER":
                try:
                    ack = _read_answer(link, control_id, min(deadline, time.monotonic() + dest.er_wait_seconds))
                except TimeoutError:
                    link.owe(control_id, "MSH-15 ER, delivered once written")
                    note = f"{dest.name}: sent {control_id}; no error within {dest.er_wait_seconds:g} s (MSH-15 ER)"
                    return _unanswered(dest, key, link, note)
            else:
                ack = _read_answer(link, control_id, deadline)
            break
        except (_StaleConnection, BrokenPipeError, ConnectionResetError) as exc:
            close_quietly(link)
            link = None
            if reused:  # an idle connection the peer dropped: once more on a fresh one
                reused = False
                continue
            return DeliveryResult.retry(
                f"{dest.name}: connection lost before the ACK for {control_id}: {_describe(exc)}"
            )
        except TimeoutError:  # socket.timeout is TimeoutError
            if link is not None:  # an answer that comes while it closes is named as this message's
                link.owe(control_id, "answered after its ACK timeout; retried")
            close_quietly(link)
            hint = f"; {NE_HINT}" if accept == "NE" else ""
            return DeliveryResult.retry(f"{dest.name}: no ACK for {control_id} within {dest.timeout_seconds:g} s{hint}")
        except (OSError, ValueError) as exc:
            close_quietly(link)
            return DeliveryResult.retry(f"{dest.name}: {_describe(exc)} (sending {control_id})")
    result, reusable = _judge_ack(dest, ack, codec, control_id)
    if reusable and dest.idle_timeout_seconds > 0:
        POOL.give(key, link)
    else:
        close_quietly(link)
    return result


def _expected_answers(dest: MllpDestination, accept: str | None) -> str:
    """Which answers the receiver will send: "NE" none, "ER" only an error, "" the ACK is awaited
    (AL, SU, empty, anything outside table 0155, or `accept_ack = "always"`)."""
    if dest.accept_ack != "msh15":
        return ""
    return accept if accept in ("NE", "ER") else ""


def _unanswered(dest: MllpDestination, key: Hashable, link: _Link, note: str) -> DeliveryResult:
    """A message delivered without an answer, as its MSH-15 asked: the connection goes back to the pool."""
    if dest.idle_timeout_seconds > 0:
        POOL.give(key, link)
    else:
        close_quietly(link)
    return DeliveryResult.success(note)


def _read_answer(link: _Link, control_id: str, deadline: float) -> bytes:
    """The next answer that is not for a message sent earlier on `link` (those are settled)."""
    while True:
        block = _read_block(link, deadline)
        if not link.settle(block, control_id):
            return block


def _mllp_connect(dest: MllpDestination) -> socket.socket:
    sock = socket.create_connection((dest.host, dest.port), timeout=dest.timeout_seconds)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if dest.tls is not None:
            sock = ssl_context(dest.tls).wrap_socket(sock, server_hostname=dest.tls.server_hostname or dest.host)
    except BaseException:
        close_quietly(sock)
        raise
    return sock


def _read_block(link: _Link, deadline: float) -> bytes:
    """One MLLP block's content (between VT and FS CR); bytes before VT are skipped, bytes after
    its end stay in `link.buf` for the next."""
    buf = link.buf
    while True:
        if END_BLOCK + CARRIAGE_RETURN in buf:
            block = _pop_block(buf)
            if block is None:
                raise ValueError("ACK frame without a start block (VT)")
            return block
        if len(buf) > MAX_ACK_BYTES:
            raise ValueError(f"ACK frame larger than {MAX_ACK_BYTES} bytes")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("ACK deadline passed")
        link.sock.settimeout(remaining)
        chunk = link.sock.recv(65536)
        if not chunk:
            if not buf.strip():
                raise _StaleConnection("connection closed by the receiver")
            raise ConnectionAbortedError("connection closed in the middle of the ACK")
        buf += chunk


def _pop_block(buf: bytearray) -> bytes | None:
    """Take the first block (up to FS CR) off `buf`: its content, or None when it had no VT."""
    end = buf.find(END_BLOCK + CARRIAGE_RETURN)
    start = buf.find(START_BLOCK, 0, end)
    block = None if start < 0 else bytes(buf[start + 1 : end])
    del buf[: end + 2]
    return block


def _readable(sock: socket.socket) -> bool:
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _judge_ack(dest: MllpDestination, ack: bytes, codec: str, control_id: str) -> tuple[DeliveryResult, bool]:
    """(result, connection reusable). Only a well-formed ACK for this very message keeps the connection."""
    text = ack.decode(codec, errors="replace")
    code = (hl7_value(text, "MSA-1") or "").strip().upper()
    acked = (hl7_value(text, "MSA-2") or "").strip()
    reason = printable(hl7_value(text, "MSA-3") or hl7_value(text, "ERR-8") or "")
    reason_part = f": {reason}" if reason else ""
    if not code:
        return DeliveryResult.retry(f"{dest.name}: answer to {control_id} is not an HL7 ACK (no MSA-1)"), False
    if acked != control_id:
        return DeliveryResult.retry(
            f"{dest.name}: {code} acknowledges control id {printable(acked)!r}, expected {control_id!r}"
        ), False
    if code in ("AA", "CA"):
        return DeliveryResult.success(f"{dest.name}: {code} for {control_id}"), True
    if code in dest.permanent_ack_codes:
        return DeliveryResult.permanent(f"{dest.name}: {code} (reject) for {control_id}{reason_part}"), True
    if code in ACK_CODES:
        return DeliveryResult.retry(f"{dest.name}: {code} for {control_id}{reason_part}"), True
    return DeliveryResult.retry(f"{dest.name}: unknown MSA-1 {printable(code)!r} for {control_id}"), False


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, _StaleConnection) else describe_error(exc)
