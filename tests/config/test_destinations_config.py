"""Destination config: parse_destinations fills defaults and names the destination and setting in
every error; lane_key follows the lane rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from include.destinations_config import (
    DestinationConfigError,
    FileDestination,
    HttpDestination,
    MllpDestination,
    lane_key,
    parse_destinations,
)
from include.schema import ConfigProblems


def hl7_message(control_id: str, patient: str) -> str:
    """A small synthetic ADT^A08 (no PHI); MSH-10 = control_id, PID-3.1 = patient."""
    return (
        f"MSH|^~\\&|STAGELINE|SL|EHR|HOSP|20240101120000||ADT^A08^ADT_A01|{control_id}|P|2.5.1\r"
        f"EVN|A08|20240101120000\rPID|1||{patient}^^^HOSP^MR||DOE^JOHN\r"
    )


def test_parse_destinations_fills_defaults_for_each_kind(tmp_path: Path) -> None:
    parsed = parse_destinations(
        [
            {
                "name": "ehr",
                "kind": "mllp",
                "host": "ehr.example",
                "port": 2575,
                "tls": {"ca_file": "/etc/ca.pem", "cert_file": "/etc/c.pem", "key_file": "/etc/k.pem"},
            },
            {"name": "archive", "kind": "file", "directory": str(tmp_path), "lane": "PID-3.1", "max_attempts": 3},
            {
                "name": "api",
                "kind": "http",
                "url": "https://api.example/hl7",
                "headers": {"X-Tenant": "a"},
                "backoff_seconds": 0.5,
                "max_backoff_seconds": 60,
            },
        ]
    )
    assert list(parsed) == ["ehr", "archive", "api"]
    ehr, archive, api = parsed["ehr"], parsed["archive"], parsed["api"]
    assert isinstance(ehr, MllpDestination) and isinstance(archive, FileDestination)
    assert isinstance(api, HttpDestination)
    assert (
        ehr.timeout_seconds,
        ehr.max_attempts,
        ehr.backoff_seconds,
        ehr.max_backoff_seconds,
        ehr.lane,
        ehr.permanent_ack_codes,
    ) == (10.0, 10, 5.0, 300.0, "destination", ("AR", "CR"))
    assert ehr.tls is not None and (ehr.tls.ca_file, ehr.tls.verify) == ("/etc/ca.pem", True)
    assert (archive.suffix, archive.lane, archive.max_attempts, archive.mode, archive.batch) == (
        ".hl7",
        "PID-3.1",
        3,
        0o600,
        False,
    )
    assert (api.headers, api.backoff_seconds, api.max_backoff_seconds) == ((("X-Tenant", "a"),), 0.5, 60.0)


def test_parse_destinations_accepts_a_table_keyed_by_name() -> None:
    parsed = parse_destinations({"api": {"kind": "http", "url": "http://127.0.0.1:9/x"}})
    assert list(parsed) == ["api"] and parsed["api"].name == "api"


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"kind": "mllp", "host": "h", "port": 1}, r"destination\[0\]\.name: Field required"),
        ({"name": "x", "kind": "ftp"}, r"destination\[0\]\.kind: must be one of mllp, file, http, got 'ftp'"),
        (
            {"name": "ehr", "kind": "mllp", "host": "h", "port": 70000},
            r"destination\[0\]\.port: .*less than or equal to 65535",
        ),
        ({"name": "ehr", "kind": "mllp", "host": "h", "port": "2575"}, r"destination\[0\]\.port: .*valid integer"),
        ({"name": "ehr", "kind": "mllp", "host": "", "port": 1}, r"destination\[0\]\.host: must be a non-empty string"),
        (
            {"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "timeout_seconds": 0},
            r"destination\[0\]\.timeout_seconds: .*greater than or equal to 0.001",
        ),
        (
            {"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "permanent_ack_codes": ["AA"]},
            r"destination\[0\]\.permanent_ack_codes\[0\]: ",
        ),
        (
            {"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "tls": {"ca": "x"}},
            r"destination\[0\]\.tls\.ca: unknown setting",
        ),
        (
            {"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "tls": {"key_file": "k"}},
            r"destination\[0\]\.tls\.key_file: needs tls.cert_file",
        ),
        (
            {"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "directory": "/x"},
            r"destination\[0\]\.directory: unknown setting",
        ),
        (
            {"name": "a", "kind": "file", "directory": "relative/dir"},
            r"destination\[0\]\.directory: must be an absolute path",
        ),
        ({"name": "a", "kind": "file", "directory": "/x", "suffix": "/.hl7"}, r"destination\[0\]\.suffix: "),
        ({"name": "a", "kind": "file", "directory": "/x", "batch": "yes"}, r"destination\[0\]\.batch: .*valid boolean"),
        (
            {"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "batch": True},
            r"destination\[0\]\.batch: unknown setting",
        ),
        (
            {"name": "a", "kind": "file", "directory": "/x", "max_attempts": 0},
            r"destination\[0\]\.max_attempts: .*greater than or equal to 1",
        ),
        (
            {"name": "a", "kind": "file", "directory": "/x", "max_attempts": True},
            r"destination\[0\]\.max_attempts: .*valid integer",
        ),
        (
            {"name": "a", "kind": "file", "directory": "/x", "backoff_seconds": 10, "max_backoff_seconds": 5},
            r"destination\[0\]\.max_backoff_seconds: must be >= backoff_seconds",
        ),
        (
            {"name": "a", "kind": "file", "directory": "/x", "lane": "pid-3"},
            r"destination\[0\]\.lane: must be 'destination' or an HL7 field path",
        ),
        ({"name": "api", "kind": "http", "url": "ftp://x/y"}, r"destination\[0\]\.url: must be an http"),
        (
            {"name": "api", "kind": "http", "url": "http://x/y", "tls": {"verify": False}},
            r"destination\[0\]\.tls: needs an https:// url",
        ),
        (
            {"name": "api", "kind": "http", "url": "http://x/y", "headers": {"Idempotency-Key": "k"}},
            r"destination\[0\]\.headers: may not set \['Idempotency-Key'\]",
        ),
        (
            {"name": "a", "kind": "file", "directory": "/x", "code": "hooks"},
            r"destination\[0\]\.code: must be 'module:function'",
        ),
    ],
)
def test_parse_destinations_errors_name_the_destination_and_the_setting(spec: dict[str, Any], error: str) -> None:
    with pytest.raises(DestinationConfigError, match=error) as caught:
        parse_destinations([spec])
    assert isinstance(caught.value, ConfigProblems) and len(caught.value.problems) == 1


def test_duplicate_destination_names_are_refused() -> None:
    spec = {"name": "a", "kind": "file", "directory": "/x"}
    with pytest.raises(DestinationConfigError, match=r"destination\[1\]\.name: duplicate destination name 'a'"):
        parse_destinations([spec, spec])


def test_every_problem_of_the_file_is_reported_at_once_with_its_key() -> None:
    """Issue 23: `port = "2575"`, `idle_timeout_seconds = -5`, a typo and a wrong kind in one file
    are four problems reported together, each with its file-relative key (was: the first only)."""
    with pytest.raises(DestinationConfigError) as caught:
        parse_destinations(
            [
                {"name": "ehr", "kind": "mllp", "host": "h", "port": "2575", "idle_timeout_seconds": -5},
                {"name": "a", "kind": "file", "directory": "/x", "sufix": ".txt"},
                {"name": "b", "kind": "ftp"},
                "not a table",
            ]
        )
    keys = [p.key for p in caught.value.problems]
    assert keys == [
        "destination[0].port",
        "destination[0].idle_timeout_seconds",
        "destination[1].sufix",
        "destination[2].kind",
        "destination[3]",
    ]


@pytest.mark.parametrize(
    "code", ["os:system", "subprocess:run", "builtins:eval", "shutil:rmtree", "os.path:join", "importlib:import_module"]
)
def test_a_code_hook_from_outside_the_config_code_dir_is_refused(code: str, tmp_path: Path) -> None:
    """Issue 23: `code = "os:system"` passed config check; the config dir is code, nothing else is."""
    spec = {"name": "a", "kind": "file", "directory": "/x", "code": code}
    with pytest.raises(DestinationConfigError, match=r"destination\[0\]\.code: module '[a-z.]+' is Python's own"):
        parse_destinations([spec])
    with pytest.raises(DestinationConfigError, match=r"destination\[0\]\.code: "):
        parse_destinations([spec], code_dir=tmp_path)


def test_a_code_hook_must_be_found_in_the_code_dir_when_it_is_known(tmp_path: Path) -> None:
    (tmp_path / "lab_hooks.py").write_text("def fix(m):\n    return m\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    spec = {"name": "a", "kind": "file", "directory": "/x"}
    (tmp_path / "pkg" / "sub.py").write_text("from lab_hooks import fix as f\n")
    parsed = parse_destinations(
        [{**spec, "code": "lab_hooks:fix"}, {**spec, "name": "b", "code": "pkg.sub:f"}], code_dir=tmp_path
    )
    assert parsed["a"].code == "lab_hooks:fix"
    with pytest.raises(DestinationConfigError, match=r"destination\[0\]\.code: module 'pytest' not found in"):
        parse_destinations([{**spec, "code": "pytest:main"}], code_dir=tmp_path)


@pytest.mark.parametrize(
    "code, message",
    [
        ("pkg.missing:f", "module 'pkg.missing' not found in {d}: no pkg/missing.py or pkg/missing/__init__.py"),
        ("hk:nope", "module 'hk' ({d}/hk.py) defines no 'nope' at top level"),
        ("broken:f", "module 'broken' ({d}/broken.py) cannot be read"),
    ],
)
def test_a_hook_whose_submodule_or_function_is_missing_is_refused_without_importing_it(tmp_path, code, message):
    """Red team item 17: `pkg.missing:f` and `hk:nope` passed `config check` and failed at delivery."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "hk.py").write_text(
        "raise SystemExit('imported!')\nif True:\n    def maybe(m):\n        return m\n"
        "def f(m):\n    def nope(x):\n        return x\n    return m\n"
    )
    (tmp_path / "broken.py").write_text("def f(:\n")
    spec = {"name": "a", "kind": "file", "directory": "/x"}
    with pytest.raises(DestinationConfigError) as caught:
        parse_destinations([{**spec, "code": code}], code_dir=tmp_path)
    assert message.format(d=tmp_path) in str(caught.value)
    for fine in ("hk:f", "hk:maybe"):  # found in the source; the module was never run
        assert parse_destinations([{**spec, "code": fine}], code_dir=tmp_path)["a"].code == fine


def test_missing_tls_files_are_reported_when_files_are_checked(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    spec = {
        "name": "ehr",
        "kind": "mllp",
        "host": "h",
        "port": 1,
        "tls": {"ca_file": str(ca), "cert_file": str(tmp_path / "nope.pem")},
    }
    assert parse_destinations([spec])["ehr"].tls is not None  # no I/O unless asked
    with pytest.raises(DestinationConfigError) as caught:
        parse_destinations([spec], check_files=True)
    assert [p.key for p in caught.value.problems] == ["destination[0].tls.cert_file"]


def test_lane_key_is_per_destination_or_per_field_value_and_always_names_the_destination() -> None:
    parsed = parse_destinations(
        [
            {"name": "ehr", "kind": "mllp", "host": "h", "port": 1},
            {"name": "lab", "kind": "mllp", "host": "h", "port": 1, "lane": "PID-3.1"},
        ]
    )
    assert lane_key(parsed["ehr"], hl7_message("C1", "P7")) == "ehr"
    assert lane_key(parsed["lab"], hl7_message("C1", "P7")) == "lab|P7"
    assert lane_key(parsed["lab"], "MSH|^~\\&|A|B\rEVN|A08\r") == "lab|"
    assert lane_key(parsed["lab"], "not hl7") == "lab|"
