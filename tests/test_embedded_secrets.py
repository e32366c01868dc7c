"""`stageline up`'s secrets: files 0600 from the first byte, and a banner that does not print them
unless asked (issue 23)."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from include import embedded
from include.config import ServiceConfig, StoreConfig


@pytest.fixture
def open_umask() -> Any:
    old = os.umask(0)  # the worst an operator's shell may have
    yield
    os.umask(old)


def test_a_new_secret_file_is_0600_before_its_first_byte(tmp_path: Path, open_umask: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
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
    path.write_text("kept-token\n")
    path.chmod(0o644)
    assert embedded._secret(path) == "kept-token"
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
    return embedded.banner(ServiceConfig(store=StoreConfig(path=str(tmp_path / "s.db"))), tmp_path, ends,
                           [("ehr", "var/out/ehr")], tmp_path / "var", api_port=8470,
                           password="PASSWORD-SECRET-1", password_file=tmp_path / ".admin_password",
                           token="TOKEN-SECRET-2", token_from=str(tmp_path / "var" / ".api_token"),
                           show_secrets=show_secrets)


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

    from include.cli import cli

    result = CliRunner().invoke(cli, ["up", "--help"])
    assert result.exit_code == 0 and "--show-secrets" in result.output
