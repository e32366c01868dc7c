"""FHIR R4 JSON on the HTTP inbound: a resource or a Bundle, validated and staged as it came.

An http connection with ``accept = ["fhir"]`` (or ``["hl7v2", "fhir"]``) takes a body sent as
``application/fhir+json``: it must be UTF-8 JSON whose top level is one resource that
``fhir.resources``' R4B models validate (R4B, not 4.0.1: the package's pure-R4 models need pydantic
v1, and Airflow's pydantic 2 excludes it; R4B shares R4's resources and JSON). A Bundle is one
message — its entries stay in it and are routable by what they hold. The staged payload is the
body's text, byte for byte; the control id is the Bundle's ``identifier.value`` or the resource's
``id`` (a resent body is then recognised like any resend, `listeners.resend`).

A body that is not such a resource is refused with a 4xx FHIR ``OperationOutcome`` saying what and
where (``expression``, e.g. ``Patient.birthDate``); nothing of it is logged but the error kinds.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from listeners.group_commit import Inbound
from listeners.validation import MAX_KEY_CHARS, unstorable

__all__ = [
    "FHIR_MEDIA_TYPES",
    "OFF_REACTOR_BYTES",
    "FhirRejected",
    "build_fhir",
    "load_models",
    "operation_outcome",
]

FHIR_MEDIA_TYPES = frozenset({"application/fhir+json", "application/json+fhir"})
OFF_REACTOR_BYTES = 2048
"""A FHIR body this large or larger is validated on a thread: model validation costs far more per
byte than HL7 v2's checks (bench/fhir_inbound.py, docs/performance.md), and the reactor's turn must
stay short for every other sender."""
MAX_ISSUES = 20  # an OperationOutcome names at most this many problems (a body may have thousands)
_UTF8 = frozenset({"", "utf-8", "utf8"})


@dataclass(frozen=True)
class FhirRejected(ValueError):
    """A body refused: the HTTP status, the issue type (FHIR value set issue-type) and what."""

    status: int
    code: str
    diagnostics: str
    issues: tuple[tuple[str, str], ...] = ()  # (expression, diagnostics) per finding

    def __str__(self) -> str:
        return self.diagnostics

    def outcome(self) -> dict[str, Any]:
        return operation_outcome(self.code, self.diagnostics, self.issues)


def operation_outcome(code: str, diagnostics: str, issues: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """An OperationOutcome: one issue per finding (``expression`` its place), else one for the whole."""
    found = [{"severity": "error", "code": code, "diagnostics": text, "expression": [where]} for where, text in issues]
    return {
        "resourceType": "OperationOutcome",
        "issue": found or [{"severity": "error", "code": code, "diagnostics": diagnostics}],
    }


_RESOURCE_TYPE = re.compile(r"[A-Z][A-Za-z]{1,63}")
_ABSTRACT = frozenset({"Resource", "DomainResource"})


@functools.cache
def _model_class(resource_type: str) -> Any:
    """The R4B model of a concrete resource type; KeyError for anything else — a data type
    (``HumanName``), an abstract base, or a name the package does not know. Only well-formed names
    are looked up (and so cached): a sender's made-up ones are refused before."""
    from fhir.resources.R4B import get_fhir_model_class
    from fhir.resources.R4B.resource import Resource

    model = get_fhir_model_class(resource_type)
    if resource_type in _ABSTRACT or not issubclass(model, Resource):
        raise KeyError(resource_type)
    return model


def load_models() -> None:
    """Import the R4B models once, before the first request (the import takes most of a second)."""
    _model_class("Bundle")


def build_fhir(body: bytes, *, connection: str, charset: str = "") -> Inbound:
    """The staged row for a FHIR JSON body, or `FhirRejected`.

    :param charset: the Content-Type's charset parameter; FHIR JSON is UTF-8 only.
    """
    if charset not in _UTF8:
        raise FhirRejected(415, "not-supported", f"FHIR JSON is UTF-8; charset {charset[:24]!r} is not taken")
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FhirRejected(400, "structure", f"not UTF-8: byte offset {exc.start}") from None
    reason = unstorable(text)
    if reason is not None:
        raise FhirRejected(400, "structure", reason)
    try:
        resource = json.loads(text)
    except RecursionError:
        raise FhirRejected(400, "structure", "JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise FhirRejected(400, "structure", f"not JSON{where}") from None
    if not isinstance(resource, dict):
        raise FhirRejected(400, "structure", "the body must be one JSON object (a FHIR resource or Bundle)")
    resource_type = resource.get("resourceType")
    if not isinstance(resource_type, str) or not resource_type:
        raise FhirRejected(400, "required", "resourceType is missing")
    try:
        if not _RESOURCE_TYPE.fullmatch(resource_type):
            raise KeyError(resource_type)
        model = _model_class(resource_type)
    except (KeyError, ValueError):
        shown = "".join(c for c in resource_type[:40] if c.isalnum())
        raise FhirRejected(400, "not-supported", f"resourceType {shown!r} is not an R4 resource") from None
    _validate(model, resource, resource_type)
    return Inbound(connection=connection, payload=text, control_id=_control_id(resource), charset="utf-8")


def _validate(model: Any, resource: dict[str, Any], resource_type: str) -> None:
    from pydantic import ValidationError

    try:
        model.model_validate(resource)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False, include_context=False)
        issues = tuple((_expression(resource_type, e["loc"]), str(e["msg"])[:200]) for e in errors[:MAX_ISSUES])
        more = f" (the first {MAX_ISSUES} named)" if len(errors) > MAX_ISSUES else ""
        raise FhirRejected(400, "invalid", f"{len(errors)} problem(s) in the {resource_type}{more}", issues) from None
    except RecursionError:
        raise FhirRejected(400, "structure", "resource nested too deeply") from None


def _expression(resource_type: str, loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a FHIRPath-like expression: ``Bundle.entry[0].resource.gender``."""
    out = resource_type
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out[:200]


def _control_id(resource: dict[str, Any]) -> str | None:
    identifier = resource.get("identifier") if resource.get("resourceType") == "Bundle" else None
    value = identifier.get("value") if isinstance(identifier, dict) else resource.get("id")
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_CHARS or unstorable(value):
        return None
    return value
