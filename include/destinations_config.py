"""Destination config: where and how routed messages are delivered (`destinations.toml`, `[[destination]]`).

A destination spec, as loaded from TOML/JSON config::

    {"name": "ehr", "kind": "mllp", "host": "ehr.example", "port": 2575, "timeout_seconds": 10,
     "tls": {"ca_file": "/etc/stageline/ca.pem", "cert_file": "...", "key_file": "..."},
     "max_attempts": 10, "backoff_seconds": 5, "max_backoff_seconds": 300, "lane": "PID-3.1"}
    {"name": "archive", "kind": "file", "directory": "/data/out", "suffix": ".hl7"}
    {"name": "nightly", "kind": "file", "directory": "/data/batches", "batch": true}
    {"name": "api", "kind": "http", "url": "https://api.example/hl7", "headers": {"X-Tenant": "a"}}

Unknown settings are errors (a typo must not silently fall back to a default). `max_attempts`,
`backoff_seconds` and `max_backoff_seconds` are the retry policy `include.store.stages` applies to
a failed delivery; `permanent_ack_codes` says which MLLP answers are final (see
`spark_jobs.senders.mllp`).

Code: `"code": "module:function"` names a Python function run on each message after the
destination's transform rules (the escape hatch: `spark_jobs.code_hook`, docs/rules.md).

Lanes: `"lane": "destination"` (default) is one FIFO lane per destination; an HL7 path such as
`"PID-3.1"` is one lane per value per destination. `lane_key()` computes the key the stage that
writes `stage_outbound` must store; it always starts with the destination name, because the claim
groups lanes by `lane_key` alone and a failing head must block only its own destination's lane.

Plain Python, no Spark and no I/O: the config loader, the stage jobs and Spark's Python workers
(which unpickle these frozen dataclasses) all import it. The senders are `spark_jobs.senders`.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from include.hl7path import FieldPathError, parse_path
from include.hl7path import value as hl7_value

__all__ = [
    "ACK_CODES",
    "Destination",
    "DestinationConfigError",
    "FileDestination",
    "HttpDestination",
    "MllpDestination",
    "TlsSettings",
    "lane_key",
    "parse_destinations",
]

# MSA-1 codes of an HL7 acknowledgement (original and enhanced mode).
ACK_CODES = frozenset({"AA", "AE", "AR", "CA", "CE", "CR"})


class DestinationConfigError(ValueError):
    """A destination spec that cannot be used; the message names the destination and the setting."""




@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """Client TLS for MLLP/HTTPS; `verify=False` is for test rigs only (it still encrypts)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_hostname: str | None = None
    verify: bool = True


@dataclass(frozen=True, kw_only=True)
class Destination:
    """Settings every destination has: its retry policy and its lane rule."""

    kind: ClassVar[str] = ""
    name: str
    max_attempts: int = 10
    backoff_seconds: float = 5.0
    max_backoff_seconds: float = 300.0
    lane: str = "destination"
    code: str | None = None
    """A `module:function` run on each message after the destination's rules (`spark_jobs.code_hook`)."""


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
    batch: bool = False  # one HL7 batch file (FHS/BHS … BTS/FTS) per micro-batch, not one file per message


@dataclass(frozen=True, kw_only=True)
class HttpDestination(Destination):
    kind: ClassVar[str] = "http"
    url: str
    timeout_seconds: float = 10.0
    headers: tuple[tuple[str, str], ...] = ()
    tls: TlsSettings | None = None
    idle_timeout_seconds: float = 30.0


_KINDS: dict[str, type[Destination]] = {c.kind: c for c in (MllpDestination, FileDestination, HttpDestination)}
_COMMON_KEYS = frozenset({"name", "kind", "max_attempts", "backoff_seconds", "max_backoff_seconds", "lane", "code"})
# `module:function`: a dotted module path and a function name (spark_jobs/code_hook.py, docs/rules.md).
_CODE_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_KIND_KEYS: dict[str, frozenset[str]] = {
    "mllp": frozenset({"host", "port", "timeout_seconds", "tls", "permanent_ack_codes", "idle_timeout_seconds"}),
    "file": frozenset({"directory", "suffix", "mode", "batch"}),
    "http": frozenset({"url", "timeout_seconds", "headers", "tls", "idle_timeout_seconds"}),
}
_TLS_KEYS = frozenset({"ca_file", "cert_file", "key_file", "server_hostname", "verify"})


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
        "code": s.code(),
    }
    if common["max_backoff_seconds"] < common["backoff_seconds"]:
        raise DestinationConfigError(f"{where}: 'max_backoff_seconds' must be >= 'backoff_seconds'")
    if kind == "mllp":
        codes = s.get("permanent_ack_codes", ["AR", "CR"])
        if (isinstance(codes, (str, bytes)) or not isinstance(codes, Sequence)
                or not all(isinstance(c, str) and c in ACK_CODES - {"AA", "CA"} for c in codes)):
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
        batch = s.get("batch", False)
        if not isinstance(batch, bool):
            raise s.fail("batch", "true or false")
        return FileDestination(**common, directory=directory, suffix=suffix, mode=mode, batch=batch)
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

    def code(self) -> str | None:
        value = self.spec.get("code")
        if value is None:
            return None
        if not isinstance(value, str) or not _CODE_SPEC.fullmatch(value):
            raise self.fail("code", "'module:function' (a dotted module path, a colon, a function name)")
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
