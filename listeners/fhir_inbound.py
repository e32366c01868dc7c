"""FHIR R4 JSON on the HTTP inbound: a resource or a Bundle, validated and staged as it came.

An http connection with ``accept = ["fhir"]`` (or ``["hl7v2", "fhir"]``) takes a body sent as
``application/fhir+json``: it must be UTF-8 JSON whose top level is one resource that
``fhir.resources``' R4B models validate (R4B, not 4.0.1: the package's pure-R4 models need pydantic
v1, and Airflow's pydantic 2 excludes it). R4B keeps R4's JSON and most of its resources but not
all: the resources R4B added are refused as not R4, and the R4 ones it dropped (MedicinalProduct…,
the Substance* details, Effect/RiskEvidenceSynthesis) are refused as ones this build cannot
validate. A Bundle is one message — its entries stay in it and are routable by what they hold.
The staged payload is the body's text, byte for byte; the control id is the Bundle's
``identifier.value`` (refused where HL7 refuses an MSH-10) or the resource's ``id`` (a resent body
is then recognised like any resend, `listeners.resend`).

What the JSON may hold is checked as it is parsed, before any model sees it: at most the
connection's ``max_fhir_elements`` values (validation costs about the same per value, whatever the
shape) and no key twice in one object (a validator would read one value and Spark's JSON functions
the other). A body that is not such a resource is refused with a 4xx FHIR ``OperationOutcome``
saying what and where (``expression``, e.g. ``Patient.birthDate``); nothing of it is logged but the
error kinds. The work runs on FHIR's own threads (`listeners.fhir_pool`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from include.conditions import FHIR_FORMAT
from include.fhir_types import model_of, why_not
from include.schema.connections import DEFAULT_MAX_FHIR_ELEMENTS as DEFAULT_MAX_ELEMENTS
from listeners.group_commit import Inbound
from listeners.validation import MAX_KEY_CHARS, unstorable

__all__ = [
    "FHIR_MEDIA_TYPES",
    "FhirRejected",
    "build_fhir",
    "load_models",
    "operation_outcome",
]

FHIR_MEDIA_TYPES = frozenset({"application/fhir+json", "application/json+fhir"})
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


def load_models() -> None:
    """Import the R4B models once, before the first request (the import takes most of a second)."""
    model_of("Bundle")


def build_fhir(body: bytes, *, connection: str, charset: str = "", max_elements: int = DEFAULT_MAX_ELEMENTS) -> Inbound:
    """The staged row for a FHIR JSON body, or `FhirRejected`.

    :param charset: the Content-Type's charset parameter; FHIR JSON is UTF-8 only.
    :param max_elements: the most JSON values (objects, arrays' items, members) the body may hold;
        more is refused before any model sees it (413 ``too-costly``).
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
    resource = _parse(text, max_elements)
    resource_type = resource.get("resourceType")
    if not isinstance(resource_type, str) or not resource_type:
        raise FhirRejected(400, "required", "resourceType is missing or not a string")
    model = _resource_model(resource_type, "")
    try:
        _check_nested_types(resource, resource_type)
    except RecursionError:
        raise FhirRejected(400, "structure", "resource nested too deeply") from None
    _validate(model, resource, resource_type)
    return Inbound(
        connection=connection, payload=text, control_id=_control_id(resource), charset="utf-8", format=FHIR_FORMAT
    )


class _Counted(dict[str, Any]):
    """An object whose members the parse has seen; `duplicate` names a key it held twice."""

    duplicate: str | None = None


class _TooCostly(Exception):
    pass


def _parse(text: str, max_elements: int) -> dict[str, Any]:
    """The body as JSON, counted as it is parsed (the C parser calls the hook once per object):
    past `max_elements` values the parse stops; an object with a key twice is marked, and refused
    with the key's place (a validator reads one value, Spark's JSON functions another)."""
    seen = [0, False]  # values so far, a duplicate met

    def counted(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        n = 1  # this object; the objects in it counted themselves
        for _, value in pairs:
            n += _items(value) if type(value) is list else type(value) is not _Counted
        seen[0] += n
        if seen[0] > max_elements:
            raise _TooCostly
        obj = _Counted(pairs)
        if len(obj) != len(pairs):  # refused: the first values kept, to name the place by them
            obj = _Counted(reversed(pairs))
            keys: set[str] = set()
            obj.duplicate = next(k for k, _ in pairs if k in keys or keys.add(k))  # type: ignore[func-returns-value]
            seen[1] = True
        return obj

    try:
        resource = json.loads(text, object_pairs_hook=counted)
    except _TooCostly:
        raise FhirRejected(
            413,
            "too-costly",
            f"more than {max_elements} JSON values; this connection validates at most that many "
            "(max_fhir_elements): split the Bundle",
        ) from None
    except RecursionError:
        raise FhirRejected(400, "structure", "JSON nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise FhirRejected(400, "structure", f"not JSON at line {exc.lineno} column {exc.colno}") from None
    except ValueError:  # an integer past Python's 4,300-digit conversion limit
        raise FhirRejected(400, "structure", f"a number of more than 4300 digits{_long_number(text)}") from None
    if not isinstance(resource, dict):
        raise FhirRejected(400, "structure", "the body must be one JSON object (a FHIR resource or Bundle)")
    if seen[1]:
        top = resource.get("resourceType")
        try:
            where = _duplicate_at(resource, top if isinstance(top, str) and _RESOURCE_TYPE.fullmatch(top) else "$")
        except RecursionError:
            where = "(too deep to name)"
        raise FhirRejected(400, "structure", f"a key given twice in one object: {where}", ((where, "duplicate key"),))
    return resource


def _items(values: list[Any]) -> int:
    """Values in an array, itself included, not counting the objects (each counted itself)."""
    n = 1
    for value in values:
        n += _items(value) if type(value) is list else type(value) is not _Counted
    return n


def _long_number(text: str) -> str:
    found = re.search(r"\d{4301}", text)
    if found is None:
        return ""
    line = text.count("\n", 0, found.start()) + 1
    return f" at line {line} column {found.start() - text.rfind(chr(10), 0, found.start())}"


def _duplicate_at(node: Any, where: str) -> str:
    """The place of the first duplicated key below `node` (a marked `_Counted`), e.g.
    ``Patient.name[0].given``; the key is an element name only when it looks like one."""
    if isinstance(node, _Counted) and node.duplicate is not None:
        dup = node.duplicate
        return f"{where}.{dup}" if _ELEMENT.fullmatch(dup) else f"{where} (a key that is no element name)"
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        if isinstance(child, dict | list):
            found = _duplicate_at(child, where + _step(key))
            if found:
                return found
    return ""


_ELEMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _step(key: int | str) -> str:
    """One step of a place: ``[2]``, ``.name``, or ``.?`` for a key that is no element name (a
    sender's made-up key is not echoed)."""
    return f"[{key}]" if isinstance(key, int) else f".{key}" if _ELEMENT.fullmatch(key) else ".?"


def _resource_model(resource_type: str, where: str) -> Any:
    """The model for a resource type the sender gave, or `FhirRejected` saying why not
    (`include.fhir_types`); `where` places a nested one."""
    why = why_not(resource_type)
    if why is not None:
        raise FhirRejected(400, "not-supported", f"{where}: {why}" if where else why, ((where, why),) if where else ())
    return model_of(resource_type)


def _check_nested_types(node: Any, where: str) -> None:
    """Every resource inside (``contained``, a Bundle's entries, ``Parameters``…) names a
    resource type this inbound validates: the models look an unknown one up and fail."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        if isinstance(child, dict | list):
            step = _step(key)
            if key == "contained" and isinstance(child, list):
                for i, item in enumerate(child):
                    if not isinstance(item, dict) or "resourceType" not in item:
                        here = f"{where}.contained[{i}]"
                        raise FhirRejected(400, "invalid", f"{here} has no resourceType", ((here, "no resourceType"),))
            if key == "resource" and isinstance(child, dict) and "resourceType" not in child:
                here = f"{where}.resource"
                raise FhirRejected(400, "invalid", f"{here} has no resourceType", ((here, "no resourceType"),))
            if isinstance(child, dict) and "resourceType" in child:
                here = f"{where}{step}.resourceType"
                kind = child["resourceType"]
                if not isinstance(kind, str) or not kind:
                    raise FhirRejected(
                        400, "invalid", f"{here} is not a resource type", ((here, "not a resource type"),)
                    )
                _resource_model(kind, here)
            _check_nested_types(child, where + step)


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
    except Exception as exc:  # a model's own fault on odd input: still the sender's 4xx
        name = type(exc).__name__  # never its text: it may quote the body
        raise FhirRejected(400, "invalid", f"the {resource_type} could not be validated ({name})") from None


def _expression(resource_type: str, loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a FHIRPath-like expression: ``Bundle.entry[0].resource.gender``."""
    out = resource_type
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out[:200]


_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f]")


def _control_id(resource: dict[str, Any]) -> str | None:
    """The Bundle's ``identifier.value``, else the resource's ``id`` (its pattern is FHIR's); a
    Bundle identifier is refused where HL7 refuses an MSH-10: blank, over 199 characters, or
    holding control characters (it is shown and searched as the message's control id)."""
    identifier = resource.get("identifier") if resource.get("resourceType") == "Bundle" else None
    if isinstance(identifier, dict) and isinstance(identifier.get("value"), str):
        value: str = identifier["value"]
        why = (
            "is blank"
            if not value.strip()
            else f"is {len(value)} characters, limit {MAX_KEY_CHARS}"
            if len(value) > MAX_KEY_CHARS
            else "holds control characters"
            if _CONTROL_CHARS.search(value)
            else None
        )
        if why is not None:
            where = "Bundle.identifier.value"
            raise FhirRejected(400, "invalid", f"{where} {why} (it is the message's control id)", ((where, why),))
        return value
    own = resource.get("id")
    return own if isinstance(own, str) and own and len(own) <= MAX_KEY_CHARS else None
