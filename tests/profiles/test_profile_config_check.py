"""`stageline config check` reads a connection's profiles: a missing file, a bad rule or an
unknown `on_violation` is a problem naming the file, the key and the connection (exit 2); the
shipped profiles pass, named relative to the config dir."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGELINE = Path(sys.executable).parent / "stageline"


def check(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(STAGELINE), "config", "check", str(directory)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def config_dir(tmp_path: Path, inbound: str) -> Path:
    directory = tmp_path / "config"
    directory.mkdir()
    shutil.copytree(ROOT / "config" / "profiles", directory / "profiles")
    (directory / "connections.toml").write_text(inbound)
    return directory


def test_the_shipped_profiles_pass_config_check(tmp_path):
    directory = config_dir(
        tmp_path,
        '[[inbound]]\nname = "adt-in"\nkind = "mllp"\nport = 2599\n'
        'profile = ["profiles/adt_a01.toml", "profiles/oru_r01.toml", "profiles/orm_o01.toml"]\n'
        'on_violation = "flag"\n',
    )
    done = check(directory)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "config OK" in done.stdout


def test_a_missing_or_bad_profile_is_a_problem_naming_connection_file_and_key(tmp_path):
    directory = config_dir(
        tmp_path,
        '[[inbound]]\nname = "adt-in"\nkind = "mllp"\nport = 2599\nprofile = "profiles/nope.toml"\n'
        '[[inbound]]\nname = "lab-in"\nkind = "mllp"\nport = 2598\nprofile = "profiles/oru_r01.toml"\n',
    )
    (directory / "profiles" / "oru_r01.toml").write_text(
        (directory / "profiles" / "oru_r01.toml").read_text() + '\n[segments.OBX]\n11 = { type = "QQ" }\n'
    )
    done = check(directory)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    connections = directory / "connections.toml"
    assert (
        f"{connections}: inbound[0].profile: {directory / 'profiles' / 'nope.toml'}: no such file (connection 'adt-in')"
        in out
    )
    assert (
        f"{connections}: inbound[1].profile: {directory / 'profiles' / 'oru_r01.toml'}: "
        "segments.OBX.11.type: unknown data type 'QQ' (connection 'lab-in')" in out
    )


def test_an_unknown_on_violation_is_refused(tmp_path):
    directory = config_dir(
        tmp_path,
        '[[inbound]]\nname = "adt-in"\nkind = "mllp"\nport = 2599\nprofile = "profiles/adt_a01.toml"\n'
        'on_violation = "sometimes"\n',
    )
    done = check(directory)
    assert done.returncode == 2
    assert (
        "inbound[0].on_violation: must be one of 'reject', 'flag', 'off' (connection 'adt-in')"
        in done.stdout + done.stderr
    )
