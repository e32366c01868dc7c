"""Destination config: where and how routed messages are delivered (`destinations.toml`, `[[destination]]`).

A destination spec, as loaded from TOML/JSON config::

    {"name": "ehr", "kind": "mllp", "host": "ehr.example", "port": 2575, "timeout_seconds": 10,
     "tls": {"ca_file": "/etc/stageline/ca.pem", "cert_file": "...", "key_file": "..."},
     "max_attempts": 10, "backoff_seconds": 5, "max_backoff_seconds": 300, "lane": "PID-3.1"}
    {"name": "archive", "kind": "file", "directory": "/data/out", "suffix": ".hl7"}
    {"name": "nightly", "kind": "file", "directory": "/data/batches", "batch": true}
    {"name": "api", "kind": "http", "url": "https://api.example/hl7", "headers": {"X-Tenant": "a"}}

The schema is `include.schema.destinations` (strict pydantic models: types, ranges, unknown
keys); every problem of the file is reported at once, keyed ``destination[2].port``. `max_attempts`,
`backoff_seconds` and `max_backoff_seconds` are the retry policy `include.store.finalize` applies to
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from include.hl7path import value as hl7_value
from include.schema import ConfigProblem
from include.schema.destinations import (
    KIND_MODELS,
    DestinationsFile,
    FileModel,
    MllpModel,
    TlsModel,
)
from include.schema.items import ConfigProblemsError, choose, problem, validate_item, validate_list

__all__ = [
    "ACK_CODES",
    "Destination",
    "DestinationConfigError",
    "DestinationsFile",
    "FileDestination",
    "HttpDestination",
    "MllpDestination",
    "TlsSettings",
    "lane_key",
    "parse_destinations",
]

# MSA-1 codes of an HL7 acknowledgement (original and enhanced mode).
ACK_CODES = frozenset({"AA", "AE", "AR", "CA", "CE", "CR"})


class DestinationConfigError(ConfigProblemsError):
    """`destinations.toml` breaks the schema: every problem, keyed ``destination[2].port``."""


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
    # "msh15": expect the answer the outbound message's MSH-15 asks for (none for NE, only an error
    # for ER); "always": the receiver answers every message, whatever MSH-15 says.
    accept_ack: str = "always"
    er_wait_seconds: float = 1.0  # MSH-15 ER: how long silence must last to mean "committed"


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


def parse_destinations(
    config: Any, *, code_dir: str | os.PathLike[str] | None = None, check_files: bool = False
) -> dict[str, Destination]:
    """Validate destination specs (a list of tables, or a table keyed by name) against the schema.

    Raises `DestinationConfigError` with every problem of every table. No I/O unless asked:
    `code_dir` (the pipeline dir's `code/`) makes a hook whose module is not in it an error;
    `check_files` makes missing TLS files errors.
    """
    if isinstance(config, Mapping):
        config = [{"name": name, **spec} if isinstance(spec, Mapping) else spec for name, spec in config.items()]
    specs, problems = validate_list(config, "destination")
    context = {"code_dir": code_dir, "check_files": check_files}
    parsed: dict[str, Destination] = {}
    for index, spec in enumerate(specs or []):
        key = f"destination[{index}]"
        model: Destination | BaseModel | None
        found: list[ConfigProblem]
        if isinstance(spec, Destination):
            model, found = spec, []
        else:
            chosen, found = choose(spec, key, "kind", KIND_MODELS)
            model = None
            if chosen is not None:
                model, found = validate_item(chosen, spec, key, context)
        problems += found
        if model is None:
            continue
        dest = model if isinstance(model, Destination) else _runtime(model)
        if dest.name in parsed:
            problems.append(problem(f"{key}.name", f"duplicate destination name {dest.name!r}"))
        parsed[dest.name] = dest
    if problems:
        raise DestinationConfigError(problems)
    return parsed


def _tls(model: TlsModel | None) -> TlsSettings | None:
    return None if model is None else TlsSettings(**model.model_dump())


def _runtime(model: Any) -> Destination:
    """The frozen dataclass the stage jobs and senders use, from a validated model."""
    common: dict[str, Any] = {
        "name": model.name,
        "max_attempts": model.max_attempts,
        "backoff_seconds": float(model.backoff_seconds),
        "max_backoff_seconds": float(model.max_backoff_seconds),
        "lane": model.lane,
        "code": model.code,
    }
    if isinstance(model, MllpModel):
        return MllpDestination(
            **common,
            host=model.host,
            port=model.port,
            timeout_seconds=float(model.timeout_seconds),
            tls=_tls(model.tls),
            permanent_ack_codes=tuple(dict.fromkeys(model.permanent_ack_codes)),
            idle_timeout_seconds=float(model.idle_timeout_seconds),
            accept_ack=model.accept_ack,
            er_wait_seconds=float(model.er_wait_seconds),
        )
    if isinstance(model, FileModel):
        return FileDestination(
            **common, directory=model.directory, suffix=model.suffix, mode=model.mode, batch=model.batch
        )
    return HttpDestination(
        **common,
        url=model.url,
        timeout_seconds=float(model.timeout_seconds),
        headers=tuple(sorted(model.headers.items())),
        tls=_tls(model.tls),
        idle_timeout_seconds=float(model.idle_timeout_seconds),
    )


def lane_key(dest: Destination, payload: str | None) -> str:
    """The `stage_outbound.lane_key` for a message to `dest`, per its lane rule.

    Always prefixed by the destination name. A message without the lane field gets the
    destination's shared "no value" lane (`"<name>|"`), never NULL (NULL rows form one lane across
    every destination).
    """
    if dest.lane == "destination":
        return dest.name
    return f"{dest.name}|{hl7_value(payload, dest.lane) or ''}"
