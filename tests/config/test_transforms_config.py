"""Transform config: parse_transforms validates specs into rule classes; errors name destination, rule, problem."""

from __future__ import annotations

import re
from typing import Any

import pytest

from include.hl7path import parse_path
from include.transforms_config import (
    JSON_CONTENT_TYPE,
    ClearField,
    CopyField,
    DropSegment,
    MapField,
    RenameSegment,
    SetField,
    Transform,
    TransformConfigError,
    parse_transforms,
)


def test_parse_transforms_reads_every_rule_kind() -> None:
    specs = [
        {
            "destination": "ehr",
            "rules": [
                {"set": "MSH-5", "value": "EHR"},
                {"copy": "PID-3.1", "to": "PID-2"},
                {"clear": "PID-19"},
                {"map": "PV1-2", "table": "patient_class"},
                {"map": "PV1-4", "table": "patient_class", "default": "clear"},
                {"map": "OBX-8", "table": "flags", "default": "U", "each": True},
                {"drop_segment": "ZPI"},
                {"rename_segment": "ZPD", "to": "ZPX"},
            ],
        },
        {"destination": "lake", "output": "json"},
    ]
    lookups = {"patient_class": {"I": "IN"}, "flags": {}}
    assert parse_transforms(specs, lookups=lookups) == [
        Transform(
            "ehr",
            "hl7",
            (
                SetField(parse_path("MSH-5"), "EHR"),
                CopyField(parse_path("PID-3.1"), parse_path("PID-2")),
                ClearField(parse_path("PID-19")),
                MapField(parse_path("PV1-2"), "patient_class", None),
                MapField(parse_path("PV1-4"), "patient_class", ""),
                MapField(parse_path("OBX-8"), "flags", "U", each=True),
                DropSegment("ZPI"),
                RenameSegment("ZPD", "ZPX"),
            ),
        ),
        Transform("lake", "json", ()),
    ]
    assert parse_transforms(specs)[1].content_type == JSON_CONTENT_TYPE


def spec(*rules: Any, **extra: Any) -> list[dict[str, Any]]:
    return [{"destination": "ehr", "rules": list(rules), **extra}]


@pytest.mark.parametrize(
    ("specs", "problem"),
    [
        ({"destination": "ehr"}, "transform: must be an array of tables ([[transform]]), got a table"),
        ([{"rules": []}], "transform[0].destination: Field required"),
        (spec(flavour="x"), "transform[0].flavour: unknown setting"),
        (spec(output="xml"), "transform[0].output: Input should be 'hl7', 'json' or 'fhir-r4'"),
        ([{"destination": "ehr", "rules": "set"}], "transform[0].rules: Input should be a valid list"),
        (spec() + spec(), "transform[1].destination: duplicate transform for destination 'ehr'"),
        (spec({"frobnicate": "PID-3"}), "transform[0].rules[0]: expected exactly one operation"),
        (spec({"set": "PID-3", "clear": "PID-4"}), "rules[0]: expected exactly one operation"),
        (spec({"clear": "PID-3"}, {"set": "PID-3"}), "transform[0].rules[1]: needs 'value'"),
        (spec({"set": "PID-3", "value": 3}), "rules[0].value: Input should be a valid string"),
        (spec({"set": "PID-3", "value": "x", "when": "y"}), "rules[0].when: Input should be a valid dictionary"),
        (spec({"clear": "pid-3"}), "rules[0].clear: invalid HL7 field path 'pid-3'"),
        (spec({"copy": "PID-3"}), "rules[0].to: Field required"),
        (spec({"copy": "PID-3", "to": "PID3"}), "rules[0].to: invalid HL7 field path"),
        (spec({"set": "MSH-2", "value": "^~"}), "MSH-1 and MSH-2 are the message's separators"),
        (spec({"copy": "PID-3", "to": "MSH-1"}), "MSH-1 and MSH-2 are the message's separators"),
        (spec({"set": "BHS-5", "value": "x"}), "batch envelope segments (FHS, BHS, BTS, FTS) are preserved"),
        (spec({"clear": "PID-3", "each": "yes"}), "rules[0].each: Input should be a valid boolean"),
        (spec({"clear": "OBX[2]-5", "each": True}), "'each' applies to every occurrence"),
        (spec({"copy": "PID-3", "to": "PV1-2", "each": True}), "must name the same segment"),
        (spec({"map": "PV1-2"}), "rules[0].table: Field required"),
        (spec({"map": "PV1-2", "table": "t", "default": 5}), "rules[0].default: Input should be a valid string"),
        (spec({"map": "PV1-2", "table": "nope"}), "rules[0].table: unknown lookup table 'nope' (known: bad, t)"),
        (spec({"map": "PV1-2", "table": "bad"}), "lookup table 'bad': keys and values must be strings"),
        (spec({"drop_segment": "MSH"}), "rules[0].drop_segment: MSH is a message header"),
        (spec({"drop_segment": "Z1"}), "must be a 3-character segment id"),
        (spec({"rename_segment": "ZPI"}), "rules[0].to: Field required"),
        (spec({"rename_segment": "ZPI", "to": "FTS"}), "rules[0].to: FTS is a message header or batch envelope"),
    ],
)
def test_invalid_specs_are_rejected_naming_destination_rule_and_problem(specs: Any, problem: str) -> None:
    with pytest.raises(TransformConfigError, match=re.escape(problem)):
        parse_transforms(specs, lookups={"t": {"I": "IN"}, "bad": {"I": 1}})  # type: ignore[dict-item]


def test_a_map_rule_needs_its_table_once_lookups_are_given() -> None:
    specs = spec({"map": "PV1-2", "table": "patient_class"})
    assert parse_transforms(specs)  # config lint without the store: table names unchecked
    with pytest.raises(TransformConfigError, match=r"unknown lookup table 'patient_class' \(known: none\)"):
        parse_transforms(specs, lookups={})


@pytest.mark.parametrize(
    ("fhir", "error"),
    [
        ({"timezone": 5}, "transform[0].fhir.timezone: Input should be a valid string"),
        ({"timezone": True}, "transform[0].fhir.timezone: Input should be a valid string"),
        ({"timezone": ["Z"]}, "transform[0].fhir.timezone: Input should be a valid string"),
        ({"timezone": ""}, "transform[0].fhir.timezone: must be 'Z' or an offset"),
        ({"patient_class": "IMP"}, "transform[0].fhir.patient_class: Input should be a valid dictionary"),
        ({"patient_class": {"I": 5}}, "transform[0].fhir.patient_class.I: Input should be a valid string"),
        ({"patient_class": {"I": ["IMP"]}}, "transform[0].fhir.patient_class.I: Input should be a valid string"),
        (
            {"identifier_systems": {"MRN": 7}},
            "transform[0].fhir.identifier_systems.MRN: Input should be a valid string",
        ),
        ({"code_systems": True}, "transform[0].fhir.code_systems: Input should be a valid dictionary"),
    ],
)
def test_fhir_settings_of_the_wrong_type_are_refused_not_coerced(fhir: dict[str, Any], error: str) -> None:
    """A careless TOML value (a number, a boolean, a list) must not become a string the mapping then uses."""
    with pytest.raises(TransformConfigError) as caught:
        parse_transforms([{"destination": "x", "output": "fhir-r4", "fhir": fhir}])
    assert error in str(caught.value)
