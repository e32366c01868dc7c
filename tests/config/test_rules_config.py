"""Validation of the issue-13 grammar, without Spark: conditions (one grammar for routes and transform
`when`), catch-all routes, the new transform rules and a destination's code hook; every error names
the file (stage_config), the route / transform rule / destination, and the key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from include import stage_config
from include.conditions import AllOf, ConditionError, Connection, Leaf, Not, SegmentPresent, parse_condition
from include.destinations_config import DestinationConfigError, parse_destinations
from include.hl7path import parse_path
from include.routes_config import Route, RouteConfigError, parse_routes
from include.stage_config import PipelineConfigError
from include.transforms_config import (
    AddSegment,
    Concat,
    DeadLetter,
    FormatDate,
    Generate,
    MapField,
    SetField,
    StringFunction,
    TransformConfigError,
    parse_transforms,
)


def test_conditions_parse_into_their_classes() -> None:
    cond = parse_condition(
        {
            "all": [
                {"field": "OBX-8", "op": "in", "value": ["H", "HH"], "segments": "any"},
                {"field": "PID-3.5", "op": "eq", "value": "MR", "repetitions": "all"},
                {"segment": "ZPI"},
                {"connection": "lab"},
                {"connection": ["a", "b"]},
                {"connection": "^lab-", "op": "regex"},
                {"not": {"field": "MSH-9.1", "op": "ne", "value": "ADT"}},
            ]
        }
    )
    assert cond == AllOf(
        (
            Leaf(parse_path("OBX-8"), "in", ("H", "HH"), segments="any"),
            Leaf(parse_path("PID-3.5"), "eq", "MR", repetitions="all"),
            SegmentPresent("ZPI"),
            Connection("eq", "lab"),
            Connection("in", ("a", "b")),
            Connection("regex", "^lab-"),
            Not(Leaf(parse_path("MSH-9.1"), "ne", "ADT")),
        )
    )


@pytest.mark.parametrize(
    ("cond", "problem"),
    [
        ({"field": "OBX-5", "op": "eq", "value": "x", "segments": "some"}, "when: 'segments' must be 'any' or 'all'"),
        (
            {"field": "OBX[2]-5", "op": "exists", "segments": "any"},
            "when: 'segments' covers every occurrence: drop the [occurrence] index from 'OBX[2]-5'",
        ),
        (
            {"field": "PID-3[2].1", "op": "exists", "repetitions": "all"},
            "when: 'repetitions' covers every repetition: drop the [repetition] index",
        ),
        ({"field": "MSH-2", "op": "exists", "repetitions": "any"}, "MSH-1 and MSH-2 have no repetitions"),
        ({"segment": "zpi"}, "when: 'segment' must be a 3-character segment id"),
        ({"segment": "ZPI", "op": "eq"}, "unknown key(s) ['segment'] in field condition"),
        ({"connection": []}, "when: 'connection' with op 'in' needs a non-empty list"),
        ({"connection": "a", "op": "exists"}, "unknown op 'exists' for a connection condition"),
        ({"connection": "(?P<x>a)", "op": "regex"}, "are not Java regex syntax"),
        ({"any": [{"field": "PID-3", "op": "ne"}]}, "when.any[0]: op 'ne' needs a value"),
        ({"not": {"sgement": "PV1"}}, "when.not: expected exactly one of 'field', 'segment', 'connection'"),
    ],
)
def test_bad_conditions_name_where_they_are(cond: Any, problem: str) -> None:
    with pytest.raises(ConditionError, match=re.escape(problem)):
        parse_condition(cond)


def test_catch_all_routes() -> None:
    assert parse_routes([{"name": "rest", "destinations": ["archive"], "catch_all": True}]) == [
        Route("rest", ("archive",), None, catch_all=True)
    ]
    with pytest.raises(RouteConfigError, match=re.escape("route[0]: a catch_all route takes no 'when'")):
        parse_routes([{"name": "rest", "destinations": ["a"], "catch_all": True, "when": {"segment": "PID"}}])
    with pytest.raises(RouteConfigError, match=re.escape("route[0].catch_all: Input should be a valid boolean")):
        parse_routes([{"name": "rest", "destinations": ["a"], "catch_all": "yes"}])


def rules(*items: dict[str, Any]) -> tuple:
    return parse_transforms([{"destination": "ehr", "rules": list(items)}])[0].rules


def test_new_rules_parse_into_their_classes() -> None:
    p = parse_path
    when = {"field": "MSH-9.1", "op": "eq", "value": "ADT"}
    assert rules(
        {"set": "MSH-5", "value": "X", "when": when},
        {"add_segment": "ZST|1|A^B", "before": "PV1"},
        {"pad": "PID-3.1", "length": 10, "with": "0", "to": "PID-2"},
        {"replace": "PID-5.1", "pattern": "-", "with": ""},
        {"substring": "MSH-7", "start": 1, "length": 8, "to": "ZXX-1"},
        {"format_date": "PID-7", "from": "hl7", "to_format": "yyyy-MM-dd", "on_error": "dead_letter"},
        {"concat": ["PID-5.2", {"text": " "}, "PID-5.1"], "to": "PID-9"},
        {"set": "MSH-10", "generate": "control_id", "prefix": "SL"},
        {"set": "MSH-7", "generate": "timestamp", "format": "yyyyMMddHHmm"},
        {"map": "PV1-2", "table": "t", "not_found": "default", "default": "clear"},
        {"map": "PV1-2", "table": "t", "not_found": "dead_letter"},
        {"dead_letter": "test traffic", "when": {"field": "MSH-11", "op": "eq", "value": "T"}},
    ) == (
        SetField(p("MSH-5"), "X", when=Leaf(p("MSH-9.1"), "eq", "ADT")),
        AddSegment("ZST|1|A^B", before="PV1"),
        StringFunction("pad", p("PID-3.1"), p("PID-2"), (10, "0", "left")),
        StringFunction("replace", p("PID-5.1"), p("PID-5.1"), ("-", "")),
        StringFunction("substring", p("MSH-7"), p("ZXX-1"), (1, 8)),
        FormatDate(p("PID-7"), p("PID-7"), "hl7", "yyyy-MM-dd", "dead_letter"),
        Concat((p("PID-5.2"), " ", p("PID-5.1")), p("PID-9")),
        Generate(p("MSH-10"), "control_id", prefix="SL"),
        Generate(p("MSH-7"), "timestamp", "yyyyMMddHHmm"),
        MapField(p("PV1-2"), "t", "clear"),  # not_found = default: the literal text, even 'clear'
        MapField(p("PV1-2"), "t", None, dead_letter=True),
        DeadLetter("test traffic", when=Leaf(p("MSH-11"), "eq", "T")),
    )


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ({"set": "MSH-5", "value": "X", "when": {"field": "MSH-9", "op": "like"}}, "rules[0].when: unknown op 'like'"),
        ({"drop_segment": "ZPI", "when": {"all": [{"segment": "PV"}]}}, "rules[0].when: at all[0]: 'segment'"),
        ({"add_segment": "MSH|x"}, "rules[0].add_segment: MSH is a message header"),
        ({"add_segment": "ZST|1\rZZZ|2"}, "rules[0].add_segment: must be one segment's text"),
        (
            {"add_segment": "ZST|1", "after": "PID", "before": "PV1"},
            "rules[0].before: give 'after' or 'before', not both",
        ),
        ({"add_segment": "ZST|1", "after": "BHS"}, "rules[0].after: must be a segment id inside the message"),
        ({"pad": "PID-3.1", "length": 10, "with": "00"}, "rules[0].with: String should have at most 1 character"),
        ({"pad": "PID-3.1"}, "rules[0].length: Field required"),
        ({"substring": "PID-3.1", "start": 0}, "rules[0].start: Input should be greater than or equal to 1"),
        ({"replace": "PID-3.1", "pattern": "("}, "rules[0].pattern: bad regex '('"),
        ({"upper": "PID-3.1", "to": "PV1-2", "each": True}, "'each' works within one segment occurrence"),
        (
            {"format_date": "PID-7", "to_format": "yyyy-MM-dd bbb"},
            "rules[0].to_format: pattern 'yyyy-MM-dd bbb' uses letters Spark does not know: b",
        ),
        (
            {"format_date": "PID-7", "on_error": "ignore"},
            "rules[0].on_error: Input should be 'keep', 'clear' or 'dead_letter'",
        ),
        ({"concat": ["PID-5.1", {"txt": " "}], "to": "PID-9"}, "rules[0].concat[1]: a constant is {text"),
        ({"concat": ["PID-5.1"]}, "rules[0].to: Field required"),
        ({"set": "MSH-10", "generate": "uuid"}, "rules[0].generate: Input should be 'timestamp' or 'control_id'"),
        (
            {"set": "MSH-10", "generate": "control_id", "prefix": "S-L"},
            "rules[0].prefix: must be 0-12 letters or digits",
        ),
        (
            {"set": "MSH-10", "value": "x", "generate": "control_id"},
            "rules[0].value: give 'value' or 'generate', not both",
        ),
        ({"map": "PV1-2", "table": "t", "not_found": "default"}, "'default' goes with not_found = 'default'"),
        (
            {"map": "PV1-2", "table": "t", "not_found": "drop"},
            "rules[0].not_found: Input should be 'keep', 'default', 'clear' or 'dead_letter'",
        ),
        ({"dead_letter": ""}, "rules[0].dead_letter: must be a non-empty string"),
    ],
)
def test_bad_rules_name_destination_rule_and_key(rule: dict[str, Any], problem: str) -> None:
    with pytest.raises(TransformConfigError, match=re.escape(problem)):
        rules(rule)


def test_a_destination_code_hook_is_module_colon_function() -> None:
    [dest] = parse_destinations(
        [{"name": "ehr", "kind": "file", "directory": "/tmp", "code": "hooks.ehr:fix"}]
    ).values()
    assert dest.code == "hooks.ehr:fix"
    for bad in ("hooks", "hooks:", "hooks.ehr:fix:x", "1hooks:fix", 5):
        with pytest.raises(DestinationConfigError, match=re.escape("destination[0].code: ")):
            parse_destinations([{"name": "ehr", "kind": "file", "directory": "/tmp", "code": bad}])


def pipeline(directory: Path, *, routes: str = "", transforms: str = "", code: str = "") -> Path:
    (directory / "routes.toml").write_text(routes)
    (directory / "destinations.toml").write_text(
        f'[[destination]]\nname = "ehr"\nkind = "file"\ndirectory = "{directory}"\n{code}'
    )
    (directory / "transforms.toml").write_text(transforms)
    return directory


def test_pipeline_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    pipeline(
        tmp_path,
        routes='[[route]]\nname = "r"\ndestinations = ["ehr"]\n'
        'when = { any = [{ field = "OBX-8", op = "eq", value = "H", segments = "most" }] }\n',
    )
    with pytest.raises(
        PipelineConfigError,
        match=re.escape(f"{tmp_path / 'routes.toml'}: route[0].when: at any[0]: 'segments' must be 'any' or 'all'"),
    ):
        stage_config.load(tmp_path)
    pipeline(
        tmp_path,
        transforms='[[transform]]\ndestination = "ehr"\n'
        'rules = [{ set = "MSH-5", value = "X", when = { connection = 7 } }]\n',
    )
    with pytest.raises(
        PipelineConfigError,
        match=re.escape(f"{tmp_path / 'transforms.toml'}: transform[0].rules[0].when: 'connection' with op 'in'"),
    ):
        stage_config.load(tmp_path)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "h.py").write_text("def f(m):\n    return m\n")
    pipeline(tmp_path, transforms='[[transform]]\ndestination = "ehr"\noutput = "json"\n', code='code = "h:f"\n')
    with pytest.raises(
        PipelineConfigError,
        match=re.escape(
            f"{tmp_path / 'transforms.toml'}: transform[0].output: transform for 'ehr': output 'json' "
            "and the destination's code hook"
        ),
    ):
        stage_config.load(tmp_path)
    pipeline(tmp_path, code='code = "h"\n')
    with pytest.raises(
        PipelineConfigError,
        match=re.escape(f"{tmp_path / 'destinations.toml'}: destination[0].code: must be 'module:function'"),
    ):
        stage_config.load(tmp_path)
    config = stage_config.load(pipeline(tmp_path, code='code = "h:f"\n'))
    assert config.code_dir == tmp_path.resolve() / "code"
