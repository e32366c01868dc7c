"""The tools in the test command guard the code (scripts/test.sh runs both before pytest):

- ruff (pyproject.toml [tool.ruff.lint]): the tree is clean, and the findings that matter most — a
  shell command line, `eval`/`exec`, `pickle`, TLS without verification, SQL built from a string —
  are caught wherever they appear, tests included, beside the everyday ones (an unused import, a
  mutable default, a line over 120 characters, unsorted imports).
- mypy (pyproject.toml [tool.mypy]): the shipped tree type-checks, strictly in the store, the
  listener daemon and the stage jobs (an unannotated function there fails), plainly elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise"]
MYPY = [sys.executable, "-m", "mypy", "--no-error-summary"]


def ruff_on(source: str, as_path: str) -> str:
    """ruff's findings for `source` as if it were the file `as_path` of this repo (its config and
    per-file ignores apply)."""
    done = subprocess.run(
        [*RUFF, "--stdin-filename", as_path, "-"], input=source, text=True, capture_output=True, cwd=ROOT, timeout=60
    )
    return done.stdout + done.stderr


def test_the_tree_passes_ruff() -> None:
    done = subprocess.run([*RUFF, "."], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_tree_is_formatted_as_ruff_format_writes_it() -> None:
    """One layout everywhere (`ruff format`, line length 120), so a diff shows only what changed."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


HAZARDS = {
    "S602": "import subprocess\n\ndef run(cmd: str) -> None:\n    subprocess.run(cmd, shell=True)\n",
    "S307": "def calc(expr: str) -> object:\n    return eval(expr)\n",
    "S102": "def run(code: str) -> None:\n    exec(code)\n",
    "S301": "import pickle\n\ndef load(data: bytes) -> object:\n    return pickle.loads(data)\n",
    "S501": "import requests\n\ndef get(url: str) -> object:\n    return requests.get(url, verify=False, timeout=5)\n",
    "S608": "def q(cur, name: str) -> None:\n"
    "    cur.execute(f\"SELECT * FROM stage_inbound WHERE connection = '{name}'\")\n",
}


@pytest.mark.parametrize(
    "where", ["listeners/new_module.py", "include/new_module.py", "spark_jobs/new_job.py", "tests/test_new.py"]
)
@pytest.mark.parametrize("rule", sorted(HAZARDS))
def test_a_new_security_hazard_fails_the_lint(rule: str, where: str) -> None:
    if rule == "S608" and where.startswith("tests/"):
        pytest.skip("tests build SQL from their own table names (S608 ignored under tests/)")
    findings = ruff_on(HAZARDS[rule], where)
    assert rule in findings, findings


EVERYDAY = {
    "F401": "import os\n",
    "B006": "def add(item: int, into: list[int] = []) -> list[int]:\n    return into\n",
    "E501": f"NAME = {'x' * 120!r}\n",
    "I001": "import sys\nimport os\n\nprint(os, sys)\n",
}


@pytest.mark.parametrize("rule", sorted(EVERYDAY))
def test_an_everyday_finding_fails_the_lint(rule: str) -> None:
    findings = ruff_on(EVERYDAY[rule], "include/new_module.py")
    assert rule in findings, findings


@pytest.fixture(scope="module")
def shadow_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A mypy cache of the tests' own: results for a stand-in file never reach the tree's cache."""
    return tmp_path_factory.mktemp("mypy-cache")


def mypy_on(source: str, as_path: str, tmp_path: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """mypy on the existing file `as_path` with `source` in its place (so that module's overrides
    apply to it)."""
    shadow = tmp_path / "shadow.py"
    shadow.write_text(source)
    return subprocess.run(
        [*MYPY, "--cache-dir", str(cache), "--shadow-file", as_path, str(shadow), as_path],
        text=True,
        capture_output=True,
        cwd=ROOT,
        timeout=600,
    )


def test_the_tree_passes_mypy() -> None:
    done = subprocess.run(MYPY, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


UNTYPED = "\n\ndef helper(value):\n    return value\n"


@pytest.mark.parametrize(
    ("path", "strict"),
    [
        ("include/store/retry.py", True),
        ("listeners/offload.py", True),
        ("spark_jobs/hl7_fields.py", True),
        ("include/batch_size.py", False),
    ],
)
def test_an_unannotated_function_fails_mypy_where_it_is_strict(
    path: str, strict: bool, tmp_path: Path, shadow_cache: Path
) -> None:
    done = mypy_on((ROOT / path).read_text() + UNTYPED, path, tmp_path, shadow_cache)
    assert ("[no-untyped-def]" in done.stdout) is strict, done.stdout[-4000:] + done.stderr[-2000:]
    assert (done.returncode != 0) is strict


def test_a_type_error_fails_mypy_outside_the_strict_packages_too(tmp_path: Path, shadow_cache: Path) -> None:
    path = "include/batch_size.py"
    done = mypy_on(
        (ROOT / path).read_text() + "\n\ndef half(n: int) -> int:\n    return n / 2\n", path, tmp_path, shadow_cache
    )
    assert done.returncode != 0 and "[return-value]" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_test_command_lints_and_type_checks_before_it_tests() -> None:
    script = (ROOT / "scripts" / "test.sh").read_text()
    lint, types = script.index("ruff check ."), script.index("--locked mypy")
    assert lint < types < script.index("pytest"), script
    assert "set -e" in script
