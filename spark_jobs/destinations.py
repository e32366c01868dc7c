"""Delivery destinations: config as plain data, and one `send()` per transport (MLLP, file, HTTP).

Plain Python on purpose — no Twisted, no store — so it imports inside Spark's Python workers.
A destination spec, as loaded from TOML/JSON config::

    {"name": "ehr", "kind": "mllp", "host": "ehr.example", "port": 2575, "timeout_seconds": 10,
     "tls": {"ca_file": "/etc/stageline/ca.pem", "cert_file": "...", "key_file": "..."},
     "max_attempts": 10, "backoff_seconds": 5, "max_backoff_seconds": 300, "lane": "PID-3.1"}
    {"name": "archive", "kind": "file", "directory": "/data/out", "suffix": ".hl7"}
    {"name": "api", "kind": "http", "url": "https://api.example/hl7", "headers": {"X-Tenant": "a"}}

Every send returns a `DeliveryResult(ok, retryable, detail)` and never raises: an exception
inside a Spark task would fail the task, and Spark's task retry would re-send the whole
partition. `retryable=False` means retrying the same bytes cannot help; the deliver stage then
moves the row straight to `dead` (reason in `last_error` and the audit trail).

Idempotency (a re-delivery can always happen: at-least-once, invariant 5 in docs/invariants.md):

* MLLP has no header for a key. The message goes out unchanged, so its MSH-10 is the same on
  every attempt; receivers de-duplicate on MSH-10 (HL7's own rule), and the idempotency key is
  recorded with the row and its audit events.
* File: the file is named `<idempotency_key><suffix>` and written atomically (temp file in the
  same directory, fsync, `os.replace`, fsync of the directory), so a re-delivery overwrites the
  same file with the same bytes. Pollers must ignore dot-files (`.stageline-*.tmp`).
* HTTP: `Idempotency-Key: <key>` on every POST.

MLLP acknowledgements (original mode): `AA`/`CA` ok; `AE`/`CE` retryable; `AR`/`CR` permanent by
default — an application reject says this message is unacceptable, and re-sending identical bytes
gets the same answer. HL7 also allows AR for "system down"; a receiver that uses it that way is
configured with `"permanent_ack_codes": []`, making AR retryable (still bounded by
`max_attempts`). An ACK whose MSA-2 is not the sent MSH-10, an unknown code, no ACK within
`timeout_seconds`, or a broken connection are retryable.

Connection reuse: MLLP and HTTP connections are cached per worker process (Spark reuses Python
workers between tasks), keyed by the destination's whole config, at most one idle connection per
destination. A cached connection is used only if it has been idle less than
`idle_timeout_seconds` and has nothing unread (a peer's close or a stray late ACK makes the
socket readable: it is dropped); after any failure, timeout or ACK mismatch the connection is
closed, never reused, so a late ACK cannot be matched to the next message. If a *reused*
connection turns out dead while sending, the message is sent once more on a fresh connection
(the receiver may then see it twice — the de-duplication above covers that).
`idle_timeout_seconds: 0` disables reuse.

Lanes: `"lane": "destination"` (default) is one FIFO lane per destination; an HL7 path such as
`"PID-3.1"` is one lane per value per destination. `lane_key()` computes the key the stage that
writes `stage_outbound` must store; it always starts with the destination name, because the claim
groups lanes by `lane_key` alone and a failing head must block only its own destination's lane.
"""
from __future__ import annotations

import codecs
import hashlib
import http.client
import os
import select
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

from include.hl7path import FieldPathError, parse_path
from include.hl7path import value as hl7_value

__all__ = [
    "DEFAULT_CONTENT_TYPE",
    "Destination",
    "DestinationConfigError",
    "DeliveryResult",
    "FileDestination",
    "HttpDestination",
    "MllpDestination",
    "TlsSettings",
    "close_connections",
    "lane_key",
    "parse_destinations",
    "send",
]

DEFAULT_CONTENT_TYPE = "application/hl7-v2"
MAX_DETAIL_CHARS = 500
MAX_ACK_BYTES = 1 << 20          # an ACK larger than this is not an ACK
MAX_HTTP_BODY_BYTES = 64 << 10   # read at most this much of a response (only an excerpt is kept)
START_BLOCK, END_BLOCK, CARRIAGE_RETURN = b"\x0b", b"\x1c", b"\x0d"

# HL7 table 0211 (MSH-18) → Python codec; the same table the listener accepts.
_HL7_CHARSETS: dict[str, str] = {
    "ASCII": "ascii", "ISO IR6": "ascii", "8859/1": "iso8859_1", "ISO IR100": "iso8859_1",
    "8859/2": "iso8859_2", "8859/3": "iso8859_3", "8859/4": "iso8859_4", "8859/5": "iso8859_5",
    "8859/6": "iso8859_6", "8859/7": "iso8859_7", "8859/8": "iso8859_8", "8859/9": "iso8859_9",
    "8859/15": "iso8859_15", "ISO IR87": "iso2022_jp", "ISO IR159": "iso2022_jp_1",
    "GB 18030-2000": "gb18030", "KS X 1001": "euc_kr", "BIG-5": "big5", "UNICODE UTF-8": "utf_8",
    "UTF-8": "utf_8",
}


class DestinationConfigError(ValueError):
    """A destination spec that cannot be used; the message names the destination and the setting."""


@dataclass(frozen=True)
class DeliveryResult:
    """The outcome of one send. `retryable` only matters when `ok` is false."""

    ok: bool
    retryable: bool
    detail: str

    @classmethod
    def success(cls, detail: str) -> DeliveryResult:
        return cls(True, False, _clip(detail))

    @classmethod
    def retry(cls, detail: str) -> DeliveryResult:
        return cls(False, True, _clip(detail))

    @classmethod
    def permanent(cls, detail: str) -> DeliveryResult:
        return cls(False, False, _clip(detail))


@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """Client TLS for MLLP/HTTPS; `verify=False` is for test rigs only (it still encrypts)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_hostname: str | None = None
    verify: bool = True

    def context(self) -> ssl.SSLContext:
        """Built per worker process and cached (an SSLContext does not pickle into Spark)."""
        return _ssl_context(self)


@dataclass(frozen=True, kw_only=True)
class Destination:
    """Settings every destination has: its retry policy and its lane rule."""

    kind: ClassVar[str] = ""
    name: str
    max_attempts: int = 10
    backoff_seconds: float = 5.0
    max_backoff_seconds: float = 300.0
    lane: str = "destination"


@dataclass(frozen=True, kw_only=True)
class MllpDestination(Destination):
    kind: ClassVar[str] = "mllp"
    host: str
    port: int
    timeout_seconds: float = 10.0
    tls: TlsSettings | None = None
    permanent_ack_codes: tuple[str, ...] = ("AR", "CR")
    idle_timeout_seconds: float = 30.0


@dataclass(frozen=True, kw_only=True)
class FileDestination(Destination):
    kind: ClassVar[str] = "file"
    directory: str
    suffix: str = ".hl7"
    mode: int = 0o600


@dataclass(frozen=True, kw_only=True)
class HttpDestination(Destination):
    kind: ClassVar[str] = "http"
    url: str
    timeout_seconds: float = 10.0
    headers: tuple[tuple[str, str], ...] = ()
    tls: TlsSettings | None = None
    idle_timeout_seconds: float = 30.0


_KINDS: dict[str, type[Destination]] = {c.kind: c for c in (MllpDestination, FileDestination, HttpDestination)}
_COMMON_KEYS = frozenset({"name", "kind", "max_attempts", "backoff_seconds", "max_backoff_seconds", "lane"})
_KIND_KEYS: dict[str, frozenset[str]] = {
    "mllp": frozenset({"host", "port", "timeout_seconds", "tls", "permanent_ack_codes", "idle_timeout_seconds"}),
    "file": frozenset({"directory", "suffix", "mode"}),
    "http": frozenset({"url", "timeout_seconds", "headers", "tls", "idle_timeout_seconds"}),
}
_TLS_KEYS = frozenset({"ca_file", "cert_file", "key_file", "server_hostname", "verify"})
_ACK_CODES = frozenset({"AA", "AE", "AR", "CA", "CE", "CR"})


# ---------------------------------------------------------------------------------------------
# config


def parse_destinations(config: Any) -> dict[str, Destination]:
    """Validate destination specs (a list of tables, or a table keyed by name); no I/O.

    Unknown keys are errors (a typo must not silently fall back to a default).
    """
    if isinstance(config, Mapping):
        specs = [{"name": name, **spec} if isinstance(spec, Mapping) else spec for name, spec in config.items()]
    elif isinstance(config, (str, bytes)) or not isinstance(config, Sequence):
        raise DestinationConfigError(f"destinations must be a list of tables, got {type(config).__name__}")
    else:
        specs = list(config)
    parsed: dict[str, Destination] = {}
    for index, spec in enumerate(specs):
        dest = _parse_one(spec, index)
        if dest.name in parsed:
            raise DestinationConfigError(f"destination {dest.name!r}: duplicate destination name")
        parsed[dest.name] = dest
    return parsed


def _parse_one(spec: Any, index: int) -> Destination:
    if not isinstance(spec, Mapping):
        raise DestinationConfigError(f"destination #{index}: must be a table/object, got {type(spec).__name__}")
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise DestinationConfigError(f"destination #{index}: 'name' must be a non-empty string without "
                                     "surrounding whitespace")
    where = f"destination {name!r}"
    kind = spec.get("kind")
    if kind not in _KINDS:
        raise DestinationConfigError(f"{where}: 'kind' must be one of {sorted(_KINDS)}, got {kind!r}")
    allowed = _COMMON_KEYS | _KIND_KEYS[kind]
    unknown = set(spec) - allowed
    if unknown:
        raise DestinationConfigError(f"{where}: unknown setting(s) {sorted(map(str, unknown))} for kind "
                                     f"{kind!r} (allowed: {', '.join(sorted(allowed))})")
    s = _Settings(spec, where)
    common: dict[str, Any] = {
        "name": name,
        "max_attempts": s.integer("max_attempts", 10, minimum=1),
        "backoff_seconds": s.number("backoff_seconds", 5.0, minimum=0.0),
        "max_backoff_seconds": s.number("max_backoff_seconds", 300.0, minimum=0.0),
        "lane": s.lane(),
    }
    if common["max_backoff_seconds"] < common["backoff_seconds"]:
        raise DestinationConfigError(f"{where}: 'max_backoff_seconds' must be >= 'backoff_seconds'")
    if kind == "mllp":
        codes = s.get("permanent_ack_codes", ["AR", "CR"])
        if (isinstance(codes, (str, bytes)) or not isinstance(codes, Sequence)
                or not all(isinstance(c, str) and c in _ACK_CODES - {"AA", "CA"} for c in codes)):
            raise DestinationConfigError(f"{where}: 'permanent_ack_codes' must be a list drawn from "
                                         "AE, AR, CE, CR")
        return MllpDestination(**common, host=s.text("host"), port=s.port(),
                               timeout_seconds=s.number("timeout_seconds", 10.0, minimum=0.001),
                               tls=s.tls(), permanent_ack_codes=tuple(dict.fromkeys(codes)),
                               idle_timeout_seconds=s.number("idle_timeout_seconds", 30.0, minimum=0.0))
    if kind == "file":
        directory = s.text("directory")
        if not os.path.isabs(directory):
            raise DestinationConfigError(f"{where}: 'directory' must be an absolute path, got {directory!r}")
        suffix = s.get("suffix", ".hl7")
        if not isinstance(suffix, str) or "/" in suffix or os.sep in suffix or "\x00" in suffix:
            raise DestinationConfigError(f"{where}: 'suffix' must be a string without path separators")
        mode = s.integer("mode", 0o600, minimum=0)
        if mode > 0o777:
            raise DestinationConfigError(f"{where}: 'mode' must be permission bits (0..0o777), got {oct(mode)}")
        return FileDestination(**common, directory=directory, suffix=suffix, mode=mode)
    url = s.text("url")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DestinationConfigError(f"{where}: 'url' must be an http:// or https:// URL with a host, got {url!r}")
    try:
        _ = parts.port  # raises on a malformed port
    except ValueError:
        raise DestinationConfigError(f"{where}: 'url' has an invalid port: {url!r}") from None
    tls = s.tls()
    if tls is not None and parts.scheme != "https":
        raise DestinationConfigError(f"{where}: 'tls' needs an https:// url")
    headers = s.get("headers", {})
    if not isinstance(headers, Mapping) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                   for k, v in headers.items()):
        raise DestinationConfigError(f"{where}: 'headers' must be a table of string values")
    reserved = {k for k in headers if k.lower() in ("idempotency-key", "content-type", "content-length", "host")}
    if reserved:
        raise DestinationConfigError(f"{where}: 'headers' may not set {sorted(reserved)} (Stageline sets them)")
    return HttpDestination(**common, url=url, timeout_seconds=s.number("timeout_seconds", 10.0, minimum=0.001),
                           headers=tuple(sorted(headers.items())), tls=tls,
                           idle_timeout_seconds=s.number("idle_timeout_seconds", 30.0, minimum=0.0))


class _Settings:
    """Typed getters whose errors name the destination and the setting."""

    def __init__(self, spec: Mapping[str, Any], where: str) -> None:
        self.spec, self.where = spec, where

    def get(self, key: str, default: Any) -> Any:
        return self.spec.get(key, default)

    def fail(self, key: str, expected: str) -> DestinationConfigError:
        return DestinationConfigError(f"{self.where}: {key!r} must be {expected}, got {self.spec.get(key)!r}")

    def text(self, key: str) -> str:
        value = self.spec.get(key)
        if not isinstance(value, str) or not value.strip():
            raise self.fail(key, "a non-empty string")
        return value

    def integer(self, key: str, default: int, *, minimum: int) -> int:
        value = self.spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: float, *, minimum: float) -> float:
        value = self.spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < minimum:
            raise self.fail(key, f"a number >= {minimum:g}")
        return float(value)

    def port(self) -> int:
        value = self.spec.get("port")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise self.fail("port", "an integer 1..65535")
        return value

    def lane(self) -> str:
        value = self.spec.get("lane", "destination")
        if value == "destination":
            return value
        if not isinstance(value, str):
            raise self.fail("lane", "'destination' or an HL7 field path such as 'PID-3.1'")
        try:
            parse_path(value)
        except FieldPathError as exc:
            raise DestinationConfigError(f"{self.where}: 'lane' must be 'destination' or an HL7 field path: "
                                         f"{exc}") from None
        return value

    def tls(self) -> TlsSettings | None:
        value = self.spec.get("tls")
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self.fail("tls", "a table")
        unknown = set(value) - _TLS_KEYS
        if unknown:
            raise DestinationConfigError(f"{self.where}: unknown 'tls' setting(s) {sorted(map(str, unknown))} "
                                         f"(allowed: {', '.join(sorted(_TLS_KEYS))})")
        for key in ("ca_file", "cert_file", "key_file", "server_hostname"):
            if key in value and not (isinstance(value[key], str) and value[key]):
                raise DestinationConfigError(f"{self.where}: 'tls.{key}' must be a non-empty string")
        if "key_file" in value and "cert_file" not in value:
            raise DestinationConfigError(f"{self.where}: 'tls.key_file' needs 'tls.cert_file'")
        verify = value.get("verify", True)
        if not isinstance(verify, bool):
            raise DestinationConfigError(f"{self.where}: 'tls.verify' must be true or false")
        return TlsSettings(ca_file=value.get("ca_file"), cert_file=value.get("cert_file"),
                           key_file=value.get("key_file"), server_hostname=value.get("server_hostname"),
                           verify=verify)


def lane_key(dest: Destination, payload: str | None) -> str:
    """The `stage_outbound.lane_key` for a message to `dest`, per its lane rule.

    Always prefixed by the destination name. A message without the lane field gets the
    destination's shared "no value" lane (`"<name>|"`), never NULL (NULL rows form one lane across
    every destination).
    """
    if dest.lane == "destination":
        return dest.name
    return f"{dest.name}|{hl7_value(payload, dest.lane) or ''}"


# ---------------------------------------------------------------------------------------------
# sending


def send(dest: Destination, *, payload: str, content_type: str, idempotency_key: str) -> DeliveryResult:
    """Deliver one message to `dest`; never raises (an unexpected error is a retryable result)."""
    try:
        if isinstance(dest, MllpDestination):
            return _send_mllp(dest, payload)
        if isinstance(dest, FileDestination):
            return _send_file(dest, payload, content_type, idempotency_key)
        if isinstance(dest, HttpDestination):
            return _send_http(dest, payload, content_type, idempotency_key)
        return DeliveryResult.retry(f"destination {dest.name!r}: no sender for kind {dest.kind!r}")
    except Exception as exc:  # noqa: BLE001 — a raise would fail the Spark task and re-send the partition
        return DeliveryResult.retry(f"{dest.name}: internal error: {type(exc).__name__}: {exc}")


def close_connections() -> None:
    """Close every cached connection of this process (tests; orderly worker shutdown)."""
    _POOL.close_all()


# --- MLLP -------------------------------------------------------------------------------------


class _StaleConnection(OSError):
    """The peer had closed a reused connection before answering (EOF before any ACK byte)."""


def _send_mllp(dest: MllpDestination, payload: str) -> DeliveryResult:
    control_id = hl7_value(payload, "MSH-10")
    if control_id is None or not control_id.strip():
        return DeliveryResult.permanent(f"{dest.name}: payload has no MSH-10, so no ACK could be matched to it")
    control_id = control_id.strip()
    codec = _encoding(payload, DEFAULT_CONTENT_TYPE)
    try:
        frame = START_BLOCK + payload.encode(codec) + END_BLOCK + CARRIAGE_RETURN
    except UnicodeEncodeError as exc:
        return DeliveryResult.permanent(f"{dest.name}: message {control_id} cannot be encoded as {codec} "
                                        f"(MSH-18): position {exc.start}")
    key = _pool_key(dest)
    sock = _POOL.take(key, dest.idle_timeout_seconds)
    reused = sock is not None
    deadline = time.monotonic() + dest.timeout_seconds
    while True:
        try:
            if sock is None:
                sock = _mllp_connect(dest)
                deadline = time.monotonic() + dest.timeout_seconds
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(frame)
            ack = _read_block(sock, deadline)
            break
        except (_StaleConnection, BrokenPipeError, ConnectionResetError) as exc:
            _close(sock)
            sock = None
            if reused:  # an idle connection the peer dropped: once more on a fresh one
                reused = False
                continue
            return DeliveryResult.retry(f"{dest.name}: connection lost before the ACK for {control_id}: "
                                        f"{_os_error(exc)}")
        except TimeoutError:  # socket.timeout is TimeoutError
            _close(sock)
            return DeliveryResult.retry(f"{dest.name}: no ACK for {control_id} within {dest.timeout_seconds:g} s")
        except (OSError, ValueError) as exc:
            _close(sock)
            return DeliveryResult.retry(f"{dest.name}: {_os_error(exc)} (sending {control_id})")
    result, reusable = _judge_ack(dest, ack, codec, control_id)
    if reusable and dest.idle_timeout_seconds > 0:
        _POOL.give(key, sock)
    else:
        _close(sock)
    return result


def _mllp_connect(dest: MllpDestination) -> socket.socket:
    sock = socket.create_connection((dest.host, dest.port), timeout=dest.timeout_seconds)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if dest.tls is not None:
            sock = dest.tls.context().wrap_socket(sock, server_hostname=dest.tls.server_hostname or dest.host)
    except BaseException:
        _close(sock)
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
            return bytes(buf[start + 1:end])
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
    reason = _printable(hl7_value(text, "MSA-3") or hl7_value(text, "ERR-8") or "")
    reason_part = f": {reason}" if reason else ""
    if not code:
        return DeliveryResult.retry(f"{dest.name}: answer to {control_id} is not an HL7 ACK (no MSA-1)"), False
    if acked != control_id:
        return DeliveryResult.retry(f"{dest.name}: {code} acknowledges control id {_printable(acked)!r}, "
                                    f"expected {control_id!r}"), False
    if code in ("AA", "CA"):
        return DeliveryResult.success(f"{dest.name}: {code} for {control_id}"), True
    if code in dest.permanent_ack_codes:
        return DeliveryResult.permanent(f"{dest.name}: {code} (reject) for {control_id}{reason_part}"), True
    if code in _ACK_CODES:
        return DeliveryResult.retry(f"{dest.name}: {code} for {control_id}{reason_part}"), True
    return DeliveryResult.retry(f"{dest.name}: unknown MSA-1 {_printable(code)!r} for {control_id}"), False


# --- file -------------------------------------------------------------------------------------


def _send_file(dest: FileDestination, payload: str, content_type: str, idempotency_key: str) -> DeliveryResult:
    name = _file_name(idempotency_key, dest.suffix)
    if name is None:
        return DeliveryResult.permanent(f"{dest.name}: idempotency key {idempotency_key!r} cannot name a file")
    codec = _encoding(payload, content_type)
    try:
        data = payload.encode(codec)
    except UnicodeEncodeError as exc:
        return DeliveryResult.permanent(f"{dest.name}: payload cannot be encoded as {codec}: position {exc.start}")
    if not os.path.isdir(dest.directory):  # never create it: a missing mount must not fill its mount point
        return DeliveryResult.retry(f"{dest.name}: directory {dest.directory} does not exist")
    final = os.path.join(dest.directory, name)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".stageline-", suffix=".tmp", dir=dest.directory)
        try:
            os.fchmod(fd, dest.mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        tmp = None
        _fsync_directory(dest.directory)
    except OSError as exc:
        return DeliveryResult.retry(f"{dest.name}: writing {name}: {_os_error(exc)}")
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return DeliveryResult.success(f"{dest.name}: wrote {name} ({len(data)} bytes)")


def _file_name(key: str, suffix: str) -> str | None:
    """`<key><suffix>`, percent-quoted so no key can leave the directory; hashed if too long."""
    if not key:
        return None
    stem = quote(key, safe="-_.@+=")
    if stem.startswith("."):  # no hidden files, no "." or ".."
        stem = "%2E" + stem[1:]
    if len((stem + suffix).encode()) > 255:
        stem = "sha256-" + hashlib.sha256(key.encode()).hexdigest()
    return stem + suffix


def _fsync_directory(directory: str) -> None:
    """Make the rename durable: without it a crash can lose the new directory entry."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- HTTP -------------------------------------------------------------------------------------


def _send_http(dest: HttpDestination, payload: str, content_type: str, idempotency_key: str) -> DeliveryResult:
    codec = _encoding(payload, content_type)
    try:
        body = payload.encode(codec)
    except UnicodeEncodeError as exc:
        return DeliveryResult.permanent(f"{dest.name}: payload cannot be encoded as {codec}: position {exc.start}")
    parts = urlsplit(dest.url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {**dict(dest.headers), "Content-Type": content_type or DEFAULT_CONTENT_TYPE,
               "Idempotency-Key": idempotency_key, "Content-Length": str(len(body))}
    key = _pool_key(dest)
    conn = _POOL.take(key, dest.idle_timeout_seconds)
    reused = conn is not None
    while True:
        try:
            if conn is None:
                conn = _http_connect(dest)
            conn.request("POST", target, body=body, headers=headers)
            response = conn.getresponse()
            excerpt = response.read(MAX_HTTP_BODY_BYTES)
            drained = response.isclosed()
            break
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
            _close(conn)
            conn = None
            if reused:  # a keep-alive connection the server had dropped: once more on a fresh one
                reused = False
                continue
            return DeliveryResult.retry(f"{dest.name}: connection lost: {_os_error(exc)}")
        except TimeoutError:  # socket.timeout is TimeoutError
            _close(conn)
            return DeliveryResult.retry(f"{dest.name}: no response within {dest.timeout_seconds:g} s")
        except (OSError, http.client.HTTPException) as exc:
            _close(conn)
            return DeliveryResult.retry(f"{dest.name}: {_os_error(exc)}")
    status = response.status
    if drained and not response.will_close and dest.idle_timeout_seconds > 0:
        _POOL.give(key, conn)
    else:
        _close(conn)
    said = f"{dest.name}: HTTP {status} {_printable(response.reason)}"
    if 200 <= status < 300:
        return DeliveryResult.success(said)
    said += _body_excerpt(excerpt)
    if status in (408, 429) or status >= 500:
        return DeliveryResult.retry(said)
    return DeliveryResult.permanent(said)


def _http_connect(dest: HttpDestination) -> http.client.HTTPConnection:
    parts = urlsplit(dest.url)
    if parts.scheme == "https":
        context = dest.tls.context() if dest.tls is not None else ssl.create_default_context()
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=dest.timeout_seconds, context=context)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=dest.timeout_seconds)


def _body_excerpt(body: bytes) -> str:
    text = _printable(body[:200].decode("utf-8", errors="replace"))
    return f": {text}" if text else ""


# --- connection cache -------------------------------------------------------------------------


class _ConnectionPool:
    """At most one idle connection per key; a connection in use is out of the pool (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[Hashable, tuple[Any, float]] = {}

    def take(self, key: Hashable, idle_timeout: float) -> Any | None:
        with self._lock:
            entry = self._idle.pop(key, None)
        if entry is None:
            return None
        conn, since = entry
        if time.monotonic() - since >= idle_timeout or not _quiet(conn):
            _close(conn)
            return None
        return conn

    def give(self, key: Hashable, conn: Any) -> None:
        with self._lock:
            old = self._idle.pop(key, None)
            self._idle[key] = (conn, time.monotonic())
        if old is not None:
            _close(old[0])

    def close_all(self) -> None:
        with self._lock:
            entries, self._idle = list(self._idle.values()), {}
        for conn, _ in entries:
            _close(conn)


_POOL = _ConnectionPool()


def _pool_key(dest: Destination) -> Hashable:
    """The whole config: a changed host, port or TLS setting never reuses an old connection."""
    return (type(dest).__name__, dest)


def _quiet(conn: Any) -> bool:
    """True when nothing is readable: readable means the peer closed it or sent something unasked."""
    sock = conn.sock if isinstance(conn, http.client.HTTPConnection) else conn
    if sock is None:
        return False
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False  # decrypted bytes nobody asked for
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _close(conn: Any) -> None:
    if conn is None:
        return
    try:
        conn.close()
    except Exception:  # noqa: BLE001 — closing is best effort
        pass


# --- helpers ----------------------------------------------------------------------------------


_TLS_CONTEXTS: dict[TlsSettings, ssl.SSLContext] = {}
_TLS_LOCK = threading.Lock()


def _ssl_context(settings: TlsSettings) -> ssl.SSLContext:
    with _TLS_LOCK:
        context = _TLS_CONTEXTS.get(settings)
        if context is None:
            context = ssl.create_default_context(cafile=settings.ca_file)
            if not settings.verify:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if settings.cert_file:
                context.load_cert_chain(settings.cert_file, settings.key_file)
            _TLS_CONTEXTS[settings] = context
        return context


def _encoding(payload: str, content_type: str | None) -> str:
    """A charset parameter of the content type wins; else an HL7 message's MSH-18; else UTF-8."""
    for param in (content_type or "").split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip():
            try:
                return codecs.lookup(value.strip().strip('"')).name
            except LookupError:
                break
    charset = hl7_value(payload, "MSH-18")
    if charset:
        repetition = (hl7_value(payload, "MSH-2") or "^~")[1:2] or "~"
        for candidate in (charset, charset.split(repetition)[0]):
            codec = _HL7_CHARSETS.get(" ".join(candidate.split()).upper())
            if codec:
                return codec
    return "utf_8"


def _os_error(exc: BaseException) -> str:
    if isinstance(exc, _StaleConnection):
        return str(exc)
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in text).strip()[:200]


def _clip(detail: str) -> str:
    return detail if len(detail) <= MAX_DETAIL_CHARS else detail[:MAX_DETAIL_CHARS - 1] + "…"
