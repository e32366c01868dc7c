"""The code escape hatch (spark_jobs/code_hook.py): a destination's `module:function` over each
message in Spark, through Arrow; a raising message dead-letters alone."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import hl7
import pytest
from pyspark.sql import SparkSession
from pyspark.testing import assertDataFrameEqual

from include.destinations_config import parse_destinations
from include.stage_config import passthrough_destinations
from include.store.stages import TRANSFORM
from spark_jobs import transform_job
from spark_jobs.code_hook import CodeHookError, apply_code_hooks, call_hook, check_hooks
from tests.spark_jobs.hl7_samples import ADT_A01

HL7 = "application/hl7-v2"
HOOK = '''
def tag(message):
    """Rename the receiving application; refuse patient BAD; hand back a string for patient STR."""
    patient = str(message["PID.F3.R1.C1"])
    if patient == "BAD":
        raise ValueError("patient BAD is not wanted here")
    if patient == "NONE":
        return None
    message["MSH.F5"] = "HOOKED"
    if patient == "STR":
        return str(message).replace("\\r", "\\n")
    return message
'''
_names = itertools.count()


@pytest.fixture(autouse=True)
def _own_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's code/ dirs leave sys.path with it (processes spawned later inherit sys.path)."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def hook_module(tmp_path: Path) -> tuple[str, str]:
    """A user's module in `<config>/code/`, uniquely named (a Python worker imports a name once)."""
    name = f"user_hooks_{next(_names)}"
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / f"{name}.py").write_text(HOOK)
    return f"{name}:tag", str(code)


def adt(patient: str) -> str:
    return ADT_A01.replace("PATID1234", patient)


def test_call_hook_renders_messages_and_strings_and_names_each_failure(tmp_path: Path) -> None:
    spec, code_dir = hook_module(tmp_path)
    check_hooks({"ehr": spec}, code_dir)
    import importlib

    function = importlib.import_module(spec.split(":")[0]).tag
    assert call_hook(function, spec, adt("P1")) == adt("P1").replace("|EHR|CITY|", "|HOOKED|CITY|")
    assert call_hook(function, spec, adt("STR")) == adt("STR").replace("|EHR|CITY|", "|HOOKED|CITY|")
    with pytest.raises(ValueError, match=f"code hook {spec} raised ValueError: patient BAD is not wanted here"):
        call_hook(function, spec, adt("BAD"))
    with pytest.raises(ValueError, match=f"code hook {spec} returned NoneType, not a message or a string"):
        call_hook(function, spec, adt("NONE"))
    assert isinstance(hl7.parse(call_hook(function, spec, adt("P1"))), hl7.Message)


def test_a_hook_that_cannot_load_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(CodeHookError, match="cannot import 'no_such_module_here'"):
        check_hooks({"ehr": "no_such_module_here:fn"}, str(tmp_path / "code"))
    spec, code_dir = hook_module(tmp_path)
    with pytest.raises(CodeHookError, match="has no function 'nope'"):
        check_hooks({"ehr": spec.replace(":tag", ":nope")}, code_dir)


@pytest.mark.parametrize(
    "spec", ["os:system", "subprocess:run", "builtins:eval", "shutil:rmtree", "hl7:parse", "pytest:main"]
)
def test_a_hook_from_anywhere_but_the_config_code_dir_is_refused_at_run_time(spec: str, tmp_path: Path) -> None:
    """Issue 23: the config dir is code, nothing else is: `os:system` (stdlib, builtin or installed
    modules) never loads, even if config check were bypassed."""
    (tmp_path / "code").mkdir()
    with pytest.raises(CodeHookError, match=r"may only import from <config>/code/"):
        check_hooks({"ehr": spec}, str(tmp_path / "code"))
    with pytest.raises(CodeHookError, match=r"may only import from the pipeline config directory's code/ folder"):
        check_hooks({"ehr": spec}, None)


def test_a_module_of_the_code_dir_named_like_a_loaded_one_is_refused_not_shadowed(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "json.py").write_text("def dumps(m):\n    return m\n")
    with pytest.raises(CodeHookError, match=r"module 'json' is already loaded from outside"):
        check_hooks({"ehr": "json:dumps"}, str(code))


def test_the_code_dir_never_shadows_the_standard_library_for_the_rest_of_the_process(tmp_path: Path) -> None:
    """code/ goes last on sys.path: a code/json.py must not become every later `import json` (a
    process spawned from this one inherits sys.path and imported code/json.py as json before)."""
    import importlib.machinery

    code = tmp_path / "code"
    code.mkdir()
    (code / "json.py").write_text("def dumps(m):\n    return m\n")
    name = f"user_hook_{next(_names)}"
    (code / f"{name}.py").write_text(HOOK)
    check_hooks({"ehr": f"{name}:tag"}, str(code))
    assert sys.path[-1] == str(code.resolve())
    found = importlib.machinery.PathFinder.find_spec("json", sys.path)
    assert found is not None and found.origin is not None and not found.origin.startswith(str(tmp_path))


def test_a_package_hook_in_the_code_dir_loads(tmp_path: Path) -> None:
    name = f"user_pkg_{next(_names)}"
    package = tmp_path / "code" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "fix.py").write_text(HOOK)
    check_hooks({"ehr": f"{name}.fix:tag"}, str(tmp_path / "code"))


def test_hooked_rows_run_through_arrow_and_a_raising_message_fails_alone(spark: SparkSession, tmp_path: Path) -> None:
    spec, code_dir = hook_module(tmp_path)
    schema = "id long, destination string, content_type string, payload string, lane_key string"
    frame = spark.createDataFrame(
        [
            (1, "ehr", HL7, adt("P1"), "ehr"),
            (2, "ehr", HL7, adt("BAD"), "ehr"),
            (3, "archive", HL7, adt("BAD"), "a"),
            (4, "ehr", HL7, None, "ehr"),
            (5, "ehr", HL7, adt("STR"), "ehr"),
        ],
        schema,
    )
    actual = frame.transform(apply_code_hooks, {"ehr": spec}, code_dir)
    hooked = {p: adt(p).replace("|EHR|CITY|", "|HOOKED|CITY|") for p in ("P1", "STR")}
    expected = spark.createDataFrame(
        [
            (1, "ehr", HL7, hooked["P1"], "ehr"),
            (2, "ehr", f"code hook {spec} raised ValueError: patient BAD is not wanted here", None, "ehr"),
            (3, "archive", HL7, adt("BAD"), "a"),  # no hook: untouched, never left the JVM
            (4, "ehr", HL7, None, "ehr"),  # already dead-lettered by the rules: not handed to the hook
            (5, "ehr", HL7, hooked["STR"], "ehr"),
        ],
        schema,
    )
    assertDataFrameEqual(actual, expected)


def test_outbound_rows_run_the_native_rules_first_then_the_hook(spark: SparkSession, tmp_path: Path) -> None:
    spec, code_dir = hook_module(tmp_path)
    dests = parse_destinations([{"name": "ehr", "kind": "file", "directory": str(tmp_path), "code": spec}])
    assert passthrough_destinations([], dests) == frozenset()  # a hook is work: never pass-through
    claimed = spark.createDataFrame(
        [(10, 1, "ehr", adt("P1"), "m1", "C1", "mllp-in"), (11, 2, "ehr", adt("BAD"), "m2", "C2", "mllp-in")],
        TRANSFORM.schema,
    )
    specs = [{"destination": "ehr", "rules": [{"set": "MSH-6", "value": "RULED"}]}]
    got = claimed.transform(transform_job.outbound_rows, specs, {}, dests, run_id="r1", code_dir=code_dir)
    want = adt("P1").replace("|EHR|CITY|", "|HOOKED|RULED|")
    expected = spark.createDataFrame(
        [
            ("r1", 1, 10, "ehr", HL7, "ehr", want, "m1", "C1"),
            (
                "r1",
                2,
                11,
                "ehr",
                f"code hook {spec} raised ValueError: patient BAD is not wanted here",
                "ehr",
                None,
                "m2",
                "C2",
            ),
        ],
        got.schema,
    )
    assertDataFrameEqual(got, expected)
