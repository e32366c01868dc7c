"""Route config: parse_routes validates specs into plain data; every error names the route and the place."""

from __future__ import annotations

import re
from typing import Any

import pytest

from include.hl7path import parse_path
from include.routes_config import Leaf, Route, RouteConfigError, parse_routes


def eq(path: str, value: str) -> dict[str, Any]:
    return {"field": path, "op": "eq", "value": value}


def one(when: Any) -> list[dict[str, Any]]:
    return [{"name": "adt-to-ehr", "destinations": ["ehr"], "when": when}]


@pytest.mark.parametrize(
    ("routes", "problem"),
    [
        (one({"field": "MSH-9.1", "op": "equals", "value": "ADT"}), "route[0].when: unknown op 'equals'"),
        (one({"field": "MSH-9.1", "op": "eq"}), "route[0].when: op 'eq' needs a value"),
        (one({"field": "MSH-9.1", "op": "eq", "value": 1}), "op 'eq' needs a string value, got int"),
        (one({"field": "MSH-9.1", "op": "in", "value": "ADT"}), "op 'in' needs a non-empty list of strings"),
        (one({"field": "MSH-9.1", "op": "in", "value": []}), "op 'in' needs a non-empty list of strings"),
        (one({"field": "MSH-9.1", "op": "regex", "value": "ADT("}), "when: bad regex 'ADT('"),
        (one({"field": "MSH-9", "op": "regex", "value": "(?P<t>ADT)"}), "not Java regex syntax"),
        (one({"field": "PV1-2", "op": "exists", "value": "I"}), "op 'exists' takes no value"),
        (one({"field": "MSH9.1", "op": "eq", "value": "ADT"}), "when: bad field path: invalid HL7 field path 'MSH9.1'"),
        (one({"op": "eq", "value": "ADT"}), "field condition needs 'field'"),
        (one({"field": "MSH-9.1", "op": "eq", "vaule": "ADT"}), "unknown key(s) ['vaule']"),
        (
            one({"all": [eq("MSH-9.1", "ADT"), {"field": "PID-3", "op": "exist"}]}),
            "route[0].when: at all[1]: unknown op 'exist'",
        ),
        (one({"not": {"any": [{"field": "pid-3", "op": "exists"}]}}), "route[0].when: at not.any[0]: bad field path"),
        (one({"all": []}), "'all' must not be empty"),
        (one({"any": eq("MSH-9.1", "ADT")}), "'any' must be a list of conditions"),
        (one({"all": [], "any": []}), "expected exactly one of 'field', 'segment', 'connection', 'all', 'any', 'not'"),
        (one("MSH-9.1 == ADT"), "route[0].when: Input should be a valid dictionary"),
        ([{"destinations": ["ehr"]}], "route[0].name: Field required"),
        (
            [{"name": "a", "destinations": ["x"]}, {"name": "a", "destinations": ["y"]}],
            "route[1].name: duplicate route name 'a'",
        ),
        ([{"name": "a"}], "route[0].destinations: Field required"),
        ([{"name": "a", "destinations": "ehr"}], "route[0].destinations: Input should be a valid list"),
        ([{"name": "a", "destinations": ["ehr", ""]}], "route[0].destinations[1]: must be a non-empty string"),
        ([{"name": "a", "destinations": ["ehr"], "wehn": eq("MSH-9.1", "ADT")}], "route[0].wehn: unknown setting"),
        ({"name": "a", "destinations": ["ehr"]}, "route: must be an array of tables ([[route]]), got a table"),
    ],
)
def test_invalid_route_specs_are_rejected_naming_route_and_problem(routes: Any, problem: str) -> None:
    with pytest.raises(RouteConfigError, match=re.escape(problem)):
        parse_routes(routes)


def test_valid_specs_parse_to_plain_data_in_config_order() -> None:
    parsed = parse_routes(
        [
            {"name": "adt", "destinations": ["ehr", "archive", "ehr"], "when": eq("MSH-9.1", "ADT")},
            {"name": "rest", "destinations": ["archive"]},
        ]
    )
    assert parsed == [
        Route("adt", ("ehr", "archive"), Leaf(parse_path("MSH-9.1"), "eq", "ADT")),
        Route("rest", ("archive",), None),
    ]


def test_a_path_number_past_the_cap_is_refused_naming_the_path_wherever_paths_are_read() -> None:
    """keys.toml, routes and `--where` read paths with the one grammar (include/hl7path.py)."""
    from include.conditions import ConditionError
    from include.hl7match import parse_where
    from include.keys_config import KeysConfigError, parse_keys

    huge = "PID-99999999999999999999.1"
    said = re.escape(f"'{huge}': field number past 99999")
    with pytest.raises(KeysConfigError, match=said):
        parse_keys({"keys": {"mrn": huge}})
    with pytest.raises(RouteConfigError, match=said):
        parse_routes(one({"field": huge, "op": "exists"}))
    with pytest.raises(ConditionError, match=said):
        parse_where(f'{huge} = "F"')
    assert str(parse_path("OBX[99999]-99999[99999].99999.99999")) == "OBX[99999]-99999[99999].99999.99999"
