"""Fuzz of the pipeline config loaders (issue 23): `parse_routes`, `parse_destinations`,
`parse_transforms` and `stage_config.load` given valid tables with keys set to values of random
wrong types (and random junk for whole tables) raise nothing but their `ConfigProblems` subclass,
each problem keyed inside the file — never a TypeError, KeyError or RecursionError traceback."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from include import stage_config
from include.destinations_config import DestinationConfigError, parse_destinations
from include.routes_config import RouteConfigError, parse_routes
from include.schema import ConfigProblems
from include.transforms_config import TransformConfigError, parse_transforms
from tests.fuzz.budget import FUZZ as _FUZZ

FUZZ = settings(_FUZZ, max_examples=200)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=4),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)

ROUTE = {"name": "r", "destinations": ["ehr"], "when": {"field": "MSH-9.1", "op": "eq", "value": "ADT"}}
DESTINATIONS = [
    {
        "name": "ehr",
        "kind": "mllp",
        "host": "h",
        "port": 2575,
        "timeout_seconds": 5,
        "max_attempts": 3,
        "backoff_seconds": 1,
        "max_backoff_seconds": 10,
        "lane": "PID-3.1",
        "permanent_ack_codes": ["AR"],
        "idle_timeout_seconds": 5,
        "tls": {
            "ca_file": "/ca.pem",
            "cert_file": "/c.pem",
            "key_file": "/k.pem",
            "server_hostname": "h",
            "verify": True,
        },
    },
    {"name": "out", "kind": "file", "directory": "/tmp/out", "suffix": ".hl7", "mode": 0o600, "batch": False},
    {"name": "api", "kind": "http", "url": "https://x/y", "headers": {"X-A": "b"}, "timeout_seconds": 3},
]
RULES = [
    {"set": "MSH-5", "value": "X", "each": False, "when": {"segment": "PID"}},
    {"set": "MSH-10", "generate": "control_id", "prefix": "SL"},
    {"set": "MSH-7", "generate": "timestamp", "format": "yyyyMMdd"},
    {"copy": "PID-3.1", "to": "PID-2"},
    {"clear": "PID-19"},
    {"map": "PV1-2", "table": "t", "not_found": "default", "default": "U"},
    {"drop_segment": "ZPI"},
    {"rename_segment": "ZPD", "to": "ZPX"},
    {"add_segment": "ZST|1", "after": "PID"},
    {"concat": ["PID-5.2", {"text": " "}], "to": "ZNM-1"},
    {"dead_letter": "test"},
    {"upper": "PID-5.1"},
    {"substring": "MSH-7", "start": 1, "length": 8},
    {"pad": "PID-3.1", "length": 10, "with": "0", "side": "left"},
    {"replace": "PID-5.1", "pattern": "-", "with": ""},
    {"format_date": "PID-7", "from": "hl7", "to_format": "yyyy-MM-dd", "on_error": "clear"},
]
TRANSFORM = {"destination": "ehr", "output": "hl7", "rules": RULES}


def assert_problems(exc: ConfigProblems, prefix: str) -> None:
    assert exc.problems, exc
    for problem in exc.problems:
        assert problem.key.startswith(prefix), problem
        assert problem.message and str(problem)


def mutated(table: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """`table` with one to three keys (its own, or a typo) set to random values."""
    out = dict(table)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.one_of(st.sampled_from(sorted(table)), st.text(max_size=6)))
        out[key] = data.draw(VALUES)
    return out


def test_the_seed_tables_are_valid() -> None:
    assert parse_routes([ROUTE]) and parse_destinations(DESTINATIONS) and parse_transforms([TRANSFORM])


@FUZZ
@given(st.data())
def test_parse_routes_raises_only_its_problems(data: st.DataObject) -> None:
    routes = data.draw(st.one_of(st.lists(st.builds(mutated, st.just(ROUTE), st.just(data)), max_size=3), VALUES))
    try:
        parse_routes(routes)
    except RouteConfigError as exc:
        assert_problems(exc, "route")


@FUZZ
@given(st.data())
def test_parse_destinations_raises_only_its_problems(data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(DESTINATIONS) - 1))
    specs: Any = [mutated(DESTINATIONS[index], data)]
    if data.draw(st.booleans()):
        specs[0]["tls" if index != 1 else "mode"] = mutated(DESTINATIONS[0]["tls"], data)
    if data.draw(st.integers(0, 9)) == 0:
        specs = data.draw(VALUES)
    try:
        parse_destinations(specs)
    except DestinationConfigError as exc:
        assert_problems(exc, "destination")


@FUZZ
@given(st.data())
def test_parse_transforms_raises_only_its_problems(data: st.DataObject) -> None:
    rules: list[Any] = [
        mutated(rule, data) for rule in data.draw(st.lists(st.sampled_from(RULES), min_size=1, max_size=3))
    ]
    spec = mutated(TRANSFORM, data) if data.draw(st.booleans()) else {**TRANSFORM, "rules": rules}
    if data.draw(st.integers(0, 9)) == 0:
        spec = data.draw(VALUES)
    try:
        parse_transforms([spec], lookups=data.draw(st.one_of(st.none(), st.just({"t": {"a": "b"}}))))
    except TransformConfigError as exc:
        assert_problems(exc, "transform")


def toml_value(value: Any) -> str:
    """A TOML value (TOML has no null and no bytes: those become strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def toml_file(kind: str, tables: list[dict[str, Any]]) -> str:
    return "".join(
        f"[[{kind}]]\n" + "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in t.items()) for t in tables
    )


@FUZZ
@given(st.data())
def test_stage_config_load_of_a_fuzzed_dir_raises_only_its_problems(data: st.DataObject) -> None:
    tables = {
        "route": [mutated(ROUTE, data)],
        "destination": [mutated(d, data) for d in DESTINATIONS],
        "transform": [mutated(TRANSFORM, data)],
    }
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for kind, name in stage_config.FILES.items():
            (base / name).write_text(toml_file(kind, tables[kind]))
        try:
            stage_config.load(base)
        except stage_config.PipelineConfigError as exc:
            assert exc.problems
            for problem in exc.problems:
                assert problem.file is not None and problem.file.parent == base.resolve(), problem
