"""Findings leaves of the condition grammar: what parses, what is refused (with where), and that
only a route's `when` may hold one."""

from __future__ import annotations

import pytest

from include.conditions import ConditionError, Findings, parse_condition
from include.schema import ConfigProblems
from include.schema.rules import validate
from include.schema.transforms import TransformsFile


@pytest.mark.parametrize(
    ("cond", "parsed"),
    [
        ({"findings": 0}, Findings("eq", 0)),
        ({"findings": 2, "op": "ge"}, Findings("ge", 2)),
        ({"finding": "103"}, Findings(codes=("103",))),
        ({"finding": ["101", "103"]}, Findings(codes=("101", "103"))),
    ],
)
def test_findings_leaves_parse(cond, parsed):
    assert parse_condition(cond, fhir=True) == parsed


@pytest.mark.parametrize(
    ("cond", "problem"),
    [
        ({"findings": -1}, "when: 'findings' needs a count from 0 to 1000, got -1"),
        ({"findings": True}, "when: 'findings' needs a count from 0 to 1000, got True"),
        ({"findings": "0"}, "when: 'findings' needs a count from 0 to 1000, got '0'"),
        ({"findings": 0, "op": "like"}, "when: unknown op 'like' for a findings condition"),
        ({"findings": 0, "value": 1}, "when: unknown key(s) ['value'] in findings condition"),
        ({"finding": "ABC"}, "when: 'finding' needs an HL7 table 0357 code"),
        ({"finding": []}, "when: 'finding' needs an HL7 table 0357 code"),
        ({"finding": "103", "op": "eq"}, "when: a finding condition has only the key 'finding'"),
        ({"all": [{"findings": 0}, {"finding": 7}]}, "when.all[1]: 'finding' needs"),
    ],
)
def test_bad_findings_leaves_are_refused_saying_where(cond, problem):
    with pytest.raises(ConditionError) as caught:
        parse_condition(cond, fhir=True)
    assert str(caught.value).startswith(problem)


def test_only_a_route_may_test_findings():
    with pytest.raises(ConditionError, match="a findings condition is for a route's when only"):
        parse_condition({"not": {"findings": 0}})


def test_a_transform_rule_may_not_test_findings():
    raw = {"transform": [{"destination": "ehr", "rules": [{"drop_segment": "ZPI", "when": {"findings": 0}}]}]}
    with pytest.raises(ConfigProblems) as caught:
        validate(TransformsFile, raw)
    assert "a findings condition is for a route's when only" in str(caught.value)
