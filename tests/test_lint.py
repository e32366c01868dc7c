"""ruff with its security rules guards the code (pyproject.toml [tool.ruff.lint]; scripts/test.sh
runs the same check before pytest): the tree is clean, and the findings that matter most — a shell
command line, `eval`/`exec`, `pickle`, TLS without verification, SQL built from a string — are
caught wherever they appear, tests included."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise"]


def ruff_on(source: str, as_path: str) -> str:
    """ruff's findings for `source` as if it were the file `as_path` of this repo (its config and
    per-file ignores apply)."""
    done = subprocess.run([*RUFF, "--stdin-filename", as_path, "-"], input=source, text=True,
                          capture_output=True, cwd=ROOT, timeout=60)
    return done.stdout + done.stderr


def test_the_tree_passes_ruff_with_the_security_rules() -> None:
    done = subprocess.run([*RUFF, "."], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


HAZARDS = {
    "S602": "import subprocess\n\ndef run(cmd: str) -> None:\n    subprocess.run(cmd, shell=True)\n",
    "S307": "def calc(expr: str) -> object:\n    return eval(expr)\n",
    "S102": "def run(code: str) -> None:\n    exec(code)\n",
    "S301": "import pickle\n\ndef load(data: bytes) -> object:\n    return pickle.loads(data)\n",
    "S501": "import requests\n\ndef get(url: str) -> object:\n    return requests.get(url, verify=False, timeout=5)\n",
    "S608": "def q(cur, name: str) -> None:\n    cur.execute(f\"SELECT * FROM stage_inbound WHERE connection = '{name}'\")\n",
}


@pytest.mark.parametrize("where", ["listeners/new_module.py", "include/new_module.py",
                                   "spark_jobs/new_job.py", "tests/test_new.py"])
@pytest.mark.parametrize("rule", sorted(HAZARDS))
def test_a_new_security_hazard_fails_the_lint(rule: str, where: str) -> None:
    if rule == "S608" and where.startswith("tests/"):
        pytest.skip("tests build SQL from their own table names (S608 ignored under tests/)")
    findings = ruff_on(HAZARDS[rule], where)
    assert rule in findings, findings


def test_the_test_command_lints_before_it_tests() -> None:
    script = (ROOT / "scripts" / "test.sh").read_text()
    lint = script.index("ruff check .")
    assert lint < script.index("pytest"), script
    assert "set -e" in script
