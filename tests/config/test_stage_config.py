"""stage_config.load(): the three pipeline files parsed once, typed and cross-checked, without Spark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from include import stage_config
from include.destinations_config import Destination
from include.routes_config import Route
from include.stage_config import PipelineConfigError
from include.transforms_config import Transform

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config"
FOREIGN = ("pyspark", "spark_jobs", "listeners", "plugins")

# A fresh interpreter: whatever this test process already imported cannot hide an import.
NO_SPARK_CHILD = f"""
import json, sys
from pathlib import Path
import include.stage_config, include.routes_config, include.transforms_config, include.destinations_config
config = include.stage_config.load(Path({str(EXAMPLE)!r}))
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({list(FOREIGN)!r}))))
"""


def test_importing_the_config_modules_and_loading_the_example_config_imports_no_spark() -> None:
    out = subprocess.run([sys.executable, "-c", NO_SPARK_CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_example_config_loads_parsed_and_typed() -> None:
    config = stage_config.load(EXAMPLE)
    assert config.routes and all(isinstance(r, Route) for r in config.routes)
    assert config.destinations and all(isinstance(d, Destination) for d in config.destinations.values())
    assert all(isinstance(t, Transform) for t in config.transforms)
    assert {d for r in config.routes for d in r.destinations} <= set(config.destinations)


def write(directory: Path, routes: str, destinations: str = "") -> Path:
    (directory / "routes.toml").write_text(routes)
    (directory / "destinations.toml").write_text(
        destinations
        or f"""
[[destination]]
name = "archive"
kind = "file"
directory = "{directory}"
"""
    )
    return directory


def test_a_bad_route_fails_the_load_naming_the_file_so_no_stage_task_claims_anything(tmp_path: Path) -> None:
    write(tmp_path, '[[route]]\nname = "x"\ndestinations = []\n')
    with pytest.raises(
        PipelineConfigError, match=r"routes\.toml: route\[0\]\.destinations: List should have at least 1 item"
    ):
        stage_config.load(tmp_path)


def test_a_route_to_a_destination_not_configured_fails_the_load(tmp_path: Path) -> None:
    write(tmp_path, '[[route]]\nname = "x"\ndestinations = ["archive", "ehr"]\n')
    with pytest.raises(PipelineConfigError, match=r"route 'x' sends to \['ehr'\], not configured"):
        stage_config.load(tmp_path)


def test_the_fingerprint_changes_with_content_even_when_size_and_times_do_not(tmp_path):
    """A stage run lasts hours and ends when its config changes: the change must be seen after an
    atomic replace that keeps size and mtime (`cp -p`, `rsync -a`, fixed-mtime images)."""
    import os

    from include.stage_config import fingerprint

    directory = tmp_path / "config"
    directory.mkdir()
    routes = directory / "routes.toml"
    routes.write_text('[[route]]\nname = "a"\n')
    before = fingerprint(directory)
    stat = routes.stat()
    replacement = tmp_path / "routes.new"
    replacement.write_text('[[route]]\nname = "b"\n')  # same size
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, routes)
    assert routes.stat().st_size == stat.st_size and routes.stat().st_mtime_ns == stat.st_mtime_ns
    assert fingerprint(directory) != before
    assert fingerprint(directory) == fingerprint(directory)


def test_the_fingerprint_follows_a_symlink_swapped_to_another_release(tmp_path):
    from include.stage_config import fingerprint

    for release in ("v1", "v2"):
        (tmp_path / release).mkdir()
        (tmp_path / release / "routes.toml").write_text("# same text in both releases\n")
    current = tmp_path / "current"
    current.symlink_to(tmp_path / "v1")
    before = fingerprint(current)
    swapped = tmp_path / "current.new"
    swapped.symlink_to(tmp_path / "v2")
    swapped.replace(current)
    assert fingerprint(current) != before


def test_a_code_module_added_or_removed_changes_the_fingerprint(tmp_path):
    from include.stage_config import fingerprint

    (tmp_path / "code").mkdir()
    before = fingerprint(tmp_path)
    (tmp_path / "code" / "hooks.py").write_text("def f(m):\n    return m\n")
    added = fingerprint(tmp_path)
    assert added != before
    (tmp_path / "code" / "hooks.py").unlink()
    assert fingerprint(tmp_path) == before


def test_every_problem_of_every_pipeline_file_is_reported_at_once_with_file_and_key(tmp_path: Path) -> None:
    """Issue 23: wrong types and ranges in each file, several in one file, a hook outside code/ and a
    file named `route.toml` are reported together (was: the first problem of the first file)."""
    (tmp_path / "routes.toml").write_text('[[route]]\nname = "r"\ndestinations = "ehr"\ncatch_all = "no"\n')
    (tmp_path / "route.toml").write_text('[[route]]\nname = "typo"\ndestinations = ["ehr"]\n')
    (tmp_path / "destinations.toml").write_text(
        '[[destination]]\nname = "ehr"\nkind = "mllp"\nhost = "h"\nport = "2575"\nidle_timeout_seconds = -5\n'
        'code = "os:system"\n'
        f'[[destination]]\nname = "out"\nkind = "file"\ndirectory = "{tmp_path}"\nmode = 4095\n'
    )
    (tmp_path / "transforms.toml").write_text(
        '[[transform]]\ndestination = "ehr"\nrules = [{ pad = "PID-3.1", length = 0, side = "middle" },'
        ' { set = "MSH-5" }]\n'
    )
    with pytest.raises(PipelineConfigError) as caught:
        stage_config.load(tmp_path)
    got = [(p.file.name if p.file else None, p.key) for p in caught.value.problems]
    assert got == [
        ("route.toml", ""),
        ("routes.toml", "route[0].destinations"),
        ("routes.toml", "route[0].catch_all"),
        ("destinations.toml", "destination[0].code"),
        ("destinations.toml", "destination[0].port"),
        ("destinations.toml", "destination[0].idle_timeout_seconds"),
        ("destinations.toml", "destination[1].mode"),
        ("transforms.toml", "transform[0].rules[0].length"),
        ("transforms.toml", "transform[0].rules[0].side"),
        ("transforms.toml", "transform[0].rules[1]"),
    ], caught.value
    assert "module 'os' is Python's own" in str(caught.value)
    assert "did you mean routes.toml?" in str(caught.value)
