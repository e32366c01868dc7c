"""The config loader fuzzed as a whole, at the TOML boundary: a config dir of random files —
the shipped config/ with values of the wrong type, out of range, keys removed or unknown, files
that are not TOML, files of unknown names, lookup CSVs of any bytes — goes through
`listeners.config_check.check_dir` and the `stageline config check` entry point. Never a traceback:
a report whose problems each name a file of that dir, and an exit code (0 clean, else non-zero)."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.budget import FEW

SHIPPED = Path(__file__).resolve().parents[2] / "config"
FILES = ["connections.toml", "routes.toml", "destinations.toml", "transforms.toml"]


def toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (a lone surrogate: a TOML error, fine)
    if isinstance(value, list):
        return "[" + ", ".join(toml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_scalar(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def to_toml(doc: dict[str, Any]) -> str:
    """TOML for a document of tables and arrays of tables (nested tables inline)."""
    top, tables = [], []
    for key, val in doc.items():
        name = json.dumps(str(key))
        if isinstance(val, list) and val and all(isinstance(v, dict) for v in val):
            for entry in val:
                tables.append(
                    f"[[{name}]]\n" + "".join(f"{json.dumps(str(k))} = {toml_scalar(v)}\n" for k, v in entry.items())
                )
        elif isinstance(val, dict):
            plain = {
                k: v for k, v in val.items() if not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))
            }
            tables.append(
                f"[{name}]\n" + "".join(f"{json.dumps(str(k))} = {toml_scalar(v)}\n" for k, v in plain.items())
            )
            for k, v in val.items():
                if k not in plain:
                    for entry in v:
                        tables.append(
                            f"[[{name}.{json.dumps(str(k))}]]\n"
                            + "".join(f"{json.dumps(str(a))} = {toml_scalar(b)}\n" for a, b in entry.items())
                        )
        else:
            top.append(f"{name} = {toml_scalar(val)}\n")
    return "".join(top) + "\n".join(tables)


odd_values = st.one_of(
    st.text(max_size=12),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.booleans(),
    st.sampled_from(
        [
            "no",
            "yes",
            "0",
            "2575",
            "-5",
            "",
            "klingon",
            "punycode",
            "os:system",
            "../../etc/passwd",
            "/etc/shadow",
            "0.0.0.0",
            "$STAGELINE_VAR/../..",
            "PID-3.1",
            "*",
            "mllp",
            "http",
            "file",
        ]
    ),
    st.sampled_from([-5, 0, 1, 65536, 10**12, -1.5, 0.0]),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def leaves(doc: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in leaves(v, (*path, k))] + [path]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in leaves(v, (*path, i))] + [path]
    return [path]


def _at(doc: Any, path: tuple) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def mutate(doc: Any, path: tuple, action: str, new: Any) -> Any:
    if not path:
        return new if action == "set" else doc
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if action == "set":
        parent[last] = new
    elif action == "delete":
        del parent[last]
    elif action == "unknown" and isinstance(parent[last], dict):
        parent[last]["no_such_key"] = new
    return doc


@st.composite
def config_dirs(draw: st.DrawFn) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for name in FILES:
        choice = draw(st.sampled_from(["shipped", "mutated", "mutated", "absent", "garbage", "empty"]))
        if choice == "absent":
            continue
        if choice == "garbage":
            files[name] = draw(st.one_of(st.binary(max_size=80), st.text(max_size=80).map(str.encode)))
            continue
        if choice == "empty":
            files[name] = b""
            continue
        doc = tomllib.loads((SHIPPED / name).read_text())
        for _ in range(draw(st.integers(1 if choice == "mutated" else 0, 4))):
            spots = leaves(doc)
            values = [p for p in spots if p and not isinstance(_at(doc, p), (dict, list))]
            spot = draw(st.sampled_from(values if values and draw(st.integers(0, 4)) else spots))
            doc = mutate(doc, spot, draw(st.sampled_from(["set", "set", "delete", "unknown"])), draw(odd_values))
        if not isinstance(doc, dict):
            doc = {"value": doc}
        files[name] = to_toml(doc).encode("utf-8", "surrogatepass")
    for extra in draw(
        st.lists(
            st.sampled_from(
                ["route.toml", "stageline.toml", "x.toml", "lookups/t.csv", "lookups/patient_class.csv", "lookups"]
            ),
            max_size=2,
            unique=True,
        )
    ):
        files[extra] = draw(st.binary(max_size=60))
    return files


def write(base: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name == "lookups":
            path.mkdir(exist_ok=True)
            continue
        if not path.is_dir():
            path.write_bytes(data)


def shipped_with(name: str, table: str, key: str, value: Any) -> dict[str, bytes]:
    """The shipped config dir with one value of the first [[table]] in `name` replaced."""
    doc = tomllib.loads((SHIPPED / name).read_text())
    doc[table][0][key] = value
    files = {n: (SHIPPED / n).read_bytes() for n in FILES}
    files[name] = to_toml(doc).encode()
    return files


# The issue 23 rows about config values, each an explicit example (run first, every time).
ISSUE_23 = [
    shipped_with("connections.toml", "inbound", "port", "2575"),
    shipped_with("connections.toml", "inbound", "allow_insecure_bind", "no"),
    shipped_with("connections.toml", "inbound", "idle_timeout_seconds", -5),
    shipped_with("connections.toml", "inbound", "charset", "klingon"),
    shipped_with("connections.toml", "inbound", "charset", "punycode"),
    shipped_with("destinations.toml", "destination", "max_attempts", "10"),
    shipped_with("destinations.toml", "destination", "port", [2576]),
    shipped_with("routes.toml", "route", "destinations", "ehr"),
    {**{n: (SHIPPED / n).read_bytes() for n in FILES}, "route.toml": (SHIPPED / "routes.toml").read_bytes()},
]


def with_issue_rows(test: Any) -> Any:
    for files in ISSUE_23:
        test = example(files)(test)
    return test


@FEW
@with_issue_rows
@given(config_dirs())
def test_any_config_dir_is_reported_never_a_traceback(files: dict[str, bytes]) -> None:
    from listeners.config_check import check_dir

    base = Path(tempfile.mkdtemp(prefix="cfgfuzz-"))
    try:
        write(base, files)
        report = check_dir(base, store_tables=set(), store_note="fuzz", lookups_unverified_ok=True)
        for problem in report.problems:
            assert str(problem)
            assert Path(problem.file).resolve().is_relative_to(base.resolve()), problem
    finally:
        shutil.rmtree(base)


@FEW
@with_issue_rows
@given(config_dirs())
def test_config_check_exits_with_a_code_never_a_traceback(files: dict[str, bytes]) -> None:
    import contextlib
    import io

    from listeners.config_check import main

    base = Path(tempfile.mkdtemp(prefix="cfgfuzz-"))
    out, err = io.StringIO(), io.StringIO()
    try:
        write(base, files)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(base), "--no-store"])
    except SystemExit as exc:  # argparse or an explicit exit: still a code, not a traceback
        code = exc.code
    finally:
        shutil.rmtree(base)
    assert isinstance(code, int) and code >= 0
    assert "Traceback" not in out.getvalue() + err.getvalue()
    assert (code == 0) == ("config OK" in out.getvalue()), out.getvalue()[-500:]


ROW_NAMES = [
    "port-as-text",
    "insecure-bind-flag-as-text",
    "negative-idle-timeout",
    "unknown-charset",
    "punycode-charset",
    "attempts-as-text",
    "port-as-list",
    "destinations-as-text",
    "unknown-file",
]


def test_each_issue_23_config_row_is_a_problem_not_config_ok() -> None:
    """Each row above is reported (a non-zero exit and a problem naming its file), not `config OK`."""
    import contextlib
    import io

    from listeners.config_check import check_dir, main

    failures = []
    for row, files in zip(ROW_NAMES, ISSUE_23, strict=True):
        base = Path(tempfile.mkdtemp(prefix="cfgrow-"))
        try:
            write(base, files)
            report = check_dir(base, store_tables=set(), store_note="fuzz", lookups_unverified_ok=True)
            with contextlib.redirect_stdout(io.StringIO()):
                code = main([str(base), "--no-store"])
        finally:
            shutil.rmtree(base)
        if report.ok or code == 0:
            failures.append(row)
    assert not failures, f"reported as config OK: {failures}"
