"""`stageline up`'s secrets: files 0600 from the first byte, and a banner that does not print them
unless asked (issue 23)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from include.app import embedded
from include.config import ServiceConfig, StoreConfig


@pytest.fixture
def open_umask() -> Any:
    old = os.umask(0)  # the worst an operator's shell may have
    yield
    os.umask(old)


def test_a_new_secret_file_is_0600_before_its_first_byte(
    tmp_path: Path, open_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))  # the mode while the secret is being written
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    secret = embedded._secret(tmp_path / "home" / ".admin_password")
    monkeypatch.undo()
    assert seen and set(seen) == {0o600}
    assert stat.S_IMODE(os.stat(tmp_path / "home" / ".admin_password").st_mode) == 0o600
    assert len(secret) >= 24 and embedded._secret(tmp_path / "home" / ".admin_password") == secret


def test_a_secret_left_readable_by_an_older_version_is_tightened(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / ".api_token"
    path.write_text("kept-token-0123456789\n")
    path.chmod(0o644)
    assert embedded._secret(path) == "kept-token-0123456789"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_secret_path_planted_as_a_symlink_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / ".api_token").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        embedded._secret(tmp_path / ".api_token")
    assert not (tmp_path / "elsewhere").exists()


def test_the_airflow_passwords_file_is_0600_when_rewritten(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "simple_auth_manager_passwords.json.generated"
    path.write_text('{"admin": "old"}')
    path.chmod(0o644)
    embedded._write_private(path, '{"admin": "new"}')
    assert path.read_text() == '{"admin": "new"}' and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def _banner(tmp_path: Path, *, show_secrets: bool) -> str:
    ends = embedded.Endpoints(api_host="127.0.0.1", api_port=8470, inbound=[("adt", "mllp", "127.0.0.1:2575")])
    return embedded.banner(
        ServiceConfig(store=StoreConfig(path=str(tmp_path / "s.db"))),
        tmp_path,
        ends,
        [("ehr", "var/out/ehr")],
        tmp_path / "var",
        api_port=8470,
        password="PASSWORD-SECRET-1",
        password_file=tmp_path / ".admin_password",
        token="TOKEN-SECRET-2",
        token_from=str(tmp_path / "var" / ".api_token"),
        show_secrets=show_secrets,
    )


def test_the_banner_names_where_the_secrets_are_but_prints_neither(tmp_path: Path) -> None:
    text = _banner(tmp_path, show_secrets=False)
    assert "PASSWORD-SECRET-1" not in text and "TOKEN-SECRET-2" not in text
    assert f"login admin / <the password in {tmp_path / '.admin_password'}>" in text
    assert f"Bearer <the token in {tmp_path / 'var' / '.api_token'}>" in text
    assert "--show-secrets" in text


def test_the_banner_prints_the_secrets_when_asked(tmp_path: Path) -> None:
    text = _banner(tmp_path, show_secrets=True)
    assert "login admin / PASSWORD-SECRET-1" in text and "Bearer TOKEN-SECRET-2" in text


def test_stageline_up_offers_show_secrets() -> None:
    from click.testing import CliRunner

    from include.app.cli import cli

    result = CliRunner().invoke(cli, ["up", "--help"])
    assert result.exit_code == 0 and "--show-secrets" in result.output


def _secret_under_a_full_disk(path: Path) -> str:
    """Run `_secret(path)` in a child whose file-size limit is 0 (writes fail as on a full disk);
    its error's text."""
    import subprocess
    import sys

    code = (
        "import resource, signal, sys; from pathlib import Path; from include.app import embedded\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
        "try:\n    embedded._secret(Path(sys.argv[1]))\nexcept OSError as e:\n    print('OSError', e.errno)\n"
        "else:\n    print('written')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(embedded.__file__).resolve().parents[1],
    )
    return done.stdout.strip() + done.stderr


def test_a_secret_write_that_fails_leaves_no_file_that_is_later_used_as_empty(tmp_path: Path) -> None:
    # red team (issue 23, item 16): under RLIMIT_FSIZE=0 the write failed, a 0-byte .jwt_secret
    # stayed, and every later call returned ''.
    path = tmp_path / "home" / ".jwt_secret"
    assert _secret_under_a_full_disk(path).startswith("OSError")
    assert not path.exists() and list(path.parent.iterdir()) == []  # nothing half-written, no temp left
    secret = embedded._secret(path)
    assert len(secret) >= embedded.MIN_SECRET_CHARS and path.read_text() == secret
    assert embedded._secret(path) == secret


@pytest.mark.parametrize("left", ["", "\n", "short"])
def test_an_empty_or_short_secret_left_by_an_older_version_is_regenerated(tmp_path: Path, left: str) -> None:
    path = tmp_path / ".admin_password"
    path.write_text(left)
    secret = embedded._secret(path)
    assert len(secret) >= embedded.MIN_SECRET_CHARS and secret != left.strip()
    assert path.read_text() == secret and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [".admin_password"]


def test_a_new_secret_directory_is_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        embedded._secret(tmp_path / "var" / ".api_token")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "var").st_mode) == 0o700
