"""The HTTP sender reads a FHIR server's OperationOutcome into the retry / dead-letter reason, and
distrusts everything about it: a body that is not one, or is one of the wrong shape, is never an
error of its own."""

from __future__ import annotations

import json

import pytest

from spark_jobs.senders.http import operation_outcome


def outcome(*issues: object) -> bytes:
    return json.dumps({"resourceType": "OperationOutcome", "issue": list(issues)}).encode()


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            outcome({"severity": "error", "code": "invalid", "diagnostics": "Bundle.entry[0]: bad"}),
            "OperationOutcome: error invalid: Bundle.entry[0]: bad",
        ),
        (
            outcome({"severity": "error", "code": "processing", "details": {"text": "no such code"}}),
            "OperationOutcome: error processing: no such code",
        ),
        (
            outcome({"severity": "fatal", "details": {"coding": [{"code": "MSG_UNKNOWN_TYPE"}]}}),
            "OperationOutcome: fatal: MSG_UNKNOWN_TYPE",
        ),
        (
            outcome({"severity": "error", "diagnostics": "a"}, {"severity": "warning", "diagnostics": "b"}),
            "OperationOutcome: error: a; warning: b",
        ),
        (outcome("not an issue", {"severity": 3, "diagnostics": ["x"]}), "OperationOutcome: no issues given"),
        (json.dumps({"resourceType": "OperationOutcome", "issue": "x"}).encode(), "OperationOutcome: no issues given"),
        (outcome({"diagnostics": "line\r\nbreak\x00"}), "OperationOutcome: line  break"),
    ],
)
def test_an_operation_outcome_becomes_one_line(body: bytes, said: str) -> None:
    assert operation_outcome(body) == said


@pytest.mark.parametrize(
    "body",
    [b"", b"status 500", b'{"resourceType": "Bundle"}', b"[1, 2]", b'{"resourceType": "OperationOut', b"[" * 100_000],
)
def test_anything_else_is_not_one(body: bytes) -> None:
    assert operation_outcome(body) is None


def test_a_long_outcome_is_cut_to_what_a_reason_holds() -> None:
    said = operation_outcome(outcome(*({"severity": "error", "diagnostics": "x" * 300} for _ in range(50))))
    assert said is not None and len(said) == 200
