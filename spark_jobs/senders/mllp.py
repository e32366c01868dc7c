"""MLLP sender: one framed message, then wait for its ACK (original-mode acknowledgement).

MLLP acknowledgements (original mode): `AA`/`CA` ok; `AE`/`CE` retryable; `AR`/`CR` permanent by
default — an application reject says this message is unacceptable, and re-sending identical bytes
gets the same answer. HL7 also allows AR for "system down"; a receiver that uses it that way is
configured with `"permanent_ack_codes": []`, making AR retryable (still bounded by
`max_attempts`). An ACK whose MSA-2 is not the sent MSH-10, an unknown code, no ACK within
`timeout_seconds`, or a broken connection are retryable.

MSH-15 (accept acknowledgment type) of the message sent says which answers a receiver that honours
it will send (HL7 v2.5.1 section 2.9.3): `NE` none, `ER` only a CE/CR, `SU` only a CA, `AL` or empty
every one. With `accept_ack = "msh15"` (the default) the sender expects just that: an `NE` message is
delivered once its bytes are written (waiting for an ACK that never comes would time out and resend
it for ever), an `ER` message once `er_wait_seconds` pass without an answer, and an `SU` message
still needs its CA (silence may be a reject: retried, then a dead letter). A receiver that answers
every message whatever MSH-15 says is configured `accept_ack = "always"`; under "msh15" an answer it
sends anyway leaves the pooled connection readable, so the pool drops it (`spark_jobs.senders.pool`)
and the next message goes out on a fresh one: an unasked-for ACK is never taken for the next one's.

Idempotency: MLLP has no header for a key. The message goes out unchanged, so its MSH-10 is the
same on every attempt; receivers de-duplicate on MSH-10 (HL7's own rule). Connections are reused
through `spark_jobs.senders.pool`; only a well-formed ACK for the very message sent keeps one.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Hashable

from include.destinations_config import ACK_CODES, MllpDestination
from include.hl7path import value as hl7_value
from spark_jobs.senders.client_tls import ssl_context
from spark_jobs.senders.common import DEFAULT_CONTENT_TYPE, DeliveryResult, describe_error, payload_codec, printable
from spark_jobs.senders.pool import POOL, close_quietly, pool_key

__all__ = ["send_mllp"]

MAX_ACK_BYTES = 1 << 20  # an ACK larger than this is not an ACK
START_BLOCK, END_BLOCK, CARRIAGE_RETURN = b"\x0b", b"\x1c", b"\x0d"


class _StaleConnection(OSError):
    """The peer had closed a reused connection before answering (EOF before any ACK byte)."""


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
    expected = _expected_answers(dest, payload)
    key = pool_key(dest)
    sock = POOL.take(key, dest.idle_timeout_seconds)
    reused = sock is not None
    deadline = time.monotonic() + dest.timeout_seconds
    while True:
        try:
            if sock is None:
                sock = _mllp_connect(dest)
                deadline = time.monotonic() + dest.timeout_seconds
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(frame)
            if expected == "NE":
                return _unanswered(dest, key, sock, f"{dest.name}: sent {control_id}; MSH-15 NE asks for no ACK")
            if expected == "ER":
                try:
                    ack = _read_block(sock, min(deadline, time.monotonic() + dest.er_wait_seconds))
                except TimeoutError:
                    note = f"{dest.name}: sent {control_id}; no error within {dest.er_wait_seconds:g} s (MSH-15 ER)"
                    return _unanswered(dest, key, sock, note)
            else:
                ack = _read_block(sock, deadline)
            break
        except (_StaleConnection, BrokenPipeError, ConnectionResetError) as exc:
            close_quietly(sock)
            sock = None
            if reused:  # an idle connection the peer dropped: once more on a fresh one
                reused = False
                continue
            return DeliveryResult.retry(
                f"{dest.name}: connection lost before the ACK for {control_id}: {_describe(exc)}"
            )
        except TimeoutError:  # socket.timeout is TimeoutError
            close_quietly(sock)
            return DeliveryResult.retry(f"{dest.name}: no ACK for {control_id} within {dest.timeout_seconds:g} s")
        except (OSError, ValueError) as exc:
            close_quietly(sock)
            return DeliveryResult.retry(f"{dest.name}: {_describe(exc)} (sending {control_id})")
    result, reusable = _judge_ack(dest, ack, codec, control_id)
    if reusable and dest.idle_timeout_seconds > 0:
        POOL.give(key, sock)
    else:
        close_quietly(sock)
    return result


def _expected_answers(dest: MllpDestination, payload: str) -> str:
    """Which answers the receiver will send: "NE" none, "ER" only an error, "" the ACK is awaited
    (AL, SU, empty, or a destination that answers everything)."""
    if dest.accept_ack != "msh15":
        return ""
    accept = (hl7_value(payload, "MSH-15") or "").strip().upper()
    return accept if accept in ("NE", "ER") else ""


def _unanswered(dest: MllpDestination, key: Hashable, sock: socket.socket, note: str) -> DeliveryResult:
    """A message delivered without an answer, as its MSH-15 asked: the connection goes back to the pool."""
    if dest.idle_timeout_seconds > 0:
        POOL.give(key, sock)
    else:
        close_quietly(sock)
    return DeliveryResult.success(note)


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


def _read_block(sock: socket.socket, deadline: float) -> bytes:
    """One MLLP block's content (between VT and FS CR); bytes before VT are skipped."""
    buf = bytearray()
    while True:
        end = buf.find(END_BLOCK + CARRIAGE_RETURN)
        if end >= 0:
            start = buf.find(START_BLOCK)
            if start < 0 or start > end:
                raise ValueError("ACK frame without a start block (VT)")
            return bytes(buf[start + 1 : end])
        if len(buf) > MAX_ACK_BYTES:
            raise ValueError(f"ACK frame larger than {MAX_ACK_BYTES} bytes")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("ACK deadline passed")
        sock.settimeout(remaining)
        chunk = sock.recv(65536)
        if not chunk:
            if not buf:
                raise _StaleConnection("connection closed by the receiver")
            raise ConnectionAbortedError("connection closed in the middle of the ACK")
        buf += chunk


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
