"""The SQLite store is private (issue 23, red team item 7): every staged body is PHI, so the store's
directory is created 0700 and the database with its `-wal`, `-shm` and `-journal` 0600 whatever the
operator's umask; an existing store others could read is tightened with a warning (docs/store.md)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from include.config import StoreConfig
from include.store import Store

ROOT = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_db_migrate_under_umask_022_makes_a_private_var_and_store(tmp_path: Path) -> None:
    cfg = tmp_path / "stageline.toml"
    cfg.write_text('[store]\npath = "var/stageline.db"\n')
    done = subprocess.run(
        [sys.executable, "-m", "include.app.cli", "--service-config", str(cfg), "db", "migrate"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        preexec_fn=lambda: os.umask(0o022),
    )
    assert done.returncode == 0, done.stderr
    assert mode(tmp_path / "var") == 0o700
    assert mode(tmp_path / "var" / "stageline.db") == 0o600


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the worst an operator's shell may have
    yield
    os.umask(old)


def test_wal_shm_and_journal_are_0600_while_the_store_runs(tmp_path: Path, open_umask: None) -> None:
    store = Store(StoreConfig(path=str(tmp_path / "data" / "s.db"), pool_size=2))
    try:
        with store.transaction() as tx:
            tx.conn.execute("CREATE TABLE t (x)")
            tx.conn.execute("INSERT INTO t VALUES (1)")
        with store.transaction() as tx:  # a write in flight: the WAL and the shared memory exist
            tx.conn.execute("INSERT INTO t VALUES (2)")
            files = {p.name: mode(p) for p in (tmp_path / "data").iterdir()}
    finally:
        store.close()
    assert files == {"s.db": 0o600, "s.db-wal": 0o600, "s.db-shm": 0o600}
    assert mode(tmp_path / "data") == 0o700
    import sqlite3

    conn = sqlite3.connect(tmp_path / "data" / "s.db")  # a rollback journal (what a non-WAL tool makes)
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO t VALUES (3)")
    assert mode(tmp_path / "data" / "s.db-journal") == 0o600
    conn.rollback()
    conn.close()


def test_an_existing_store_others_can_read_is_tightened_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import sqlite3

    db = tmp_path / "old.db"
    old = sqlite3.connect(db)  # made by an older version under umask 022, WAL left behind by a reader
    old.execute("PRAGMA journal_mode = WAL")
    old.execute("CREATE TABLE t (x)")
    for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        os.chmod(p, 0o644)
    with caplog.at_level(logging.WARNING, logger="include.store.dialects"):
        store = Store(StoreConfig(path=str(db), pool_size=1))
        try:
            with store.transaction(write=False) as tx:
                assert tx.conn.execute("SELECT count(*) AS n FROM t").fetchone()["n"] == 0
        finally:
            store.close()
            old.close()
    assert mode(db) == 0o600
    assert "tightened to 600" in caplog.text and "old.db" in caplog.text
    for p in (Path(f"{db}-wal"), Path(f"{db}-shm")):
        assert not p.exists() or mode(p) == 0o600


def test_the_var_dir_is_created_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_umask: None) -> None:
    from include.config import VAR_ENV, private_var_dir

    monkeypatch.setenv(VAR_ENV, str(tmp_path / "state" / "var"))
    assert private_var_dir() == tmp_path / "state" / "var"
    assert mode(tmp_path / "state" / "var") == 0o700


def open_store(db: Path) -> None:
    store = Store(StoreConfig(path=str(db), pool_size=1))
    try:
        with store.transaction(write=False) as tx:
            tx.conn.execute("SELECT 1")
    finally:
        store.close()


def test_an_existing_0755_store_directory_of_its_own_is_tightened_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Second red-team pass L3: an existing var/ at 0755 was left as is, silently."""
    data = tmp_path / "data"
    data.mkdir()
    open_store(data / "s.db")  # the store, its WAL and shm: nothing else
    os.chmod(data, 0o755)  # noqa: S103 - the loose mode under test
    with caplog.at_level(logging.WARNING, logger="include.store.dialects"):
        open_store(data / "s.db")
    assert mode(data) == 0o700
    assert f"SQLite store directory {data} was mode 0755" in caplog.text and "tightened to 0700" in caplog.text


def test_the_var_dir_holding_the_store_is_tightened_even_with_other_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from include.config import VAR_ENV

    var = tmp_path / "var"
    var.mkdir(mode=0o755)
    os.chmod(var, 0o755)  # noqa: S103 - the loose mode under test
    (var / "api-token").write_text("x")
    monkeypatch.setenv(VAR_ENV, str(var))
    with caplog.at_level(logging.WARNING, logger="include.store.dialects"):
        open_store(var / "stageline.db")
    assert mode(var) == 0o700 and "was mode 0755" in caplog.text


@pytest.mark.parametrize("shared_mode", [0o755, 0o1777])
def test_a_shared_store_directory_is_never_changed_only_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, shared_mode: int
) -> None:
    """Other files beside the store (a home directory, a project dir), or a sticky /tmp-like one:
    chmod would break someone else, so it only says so."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("someone else's")
    if shared_mode & 0o1000:
        (shared / "notes.txt").unlink()  # sticky: left alone even holding nothing else
    os.chmod(shared, shared_mode)
    with caplog.at_level(logging.WARNING, logger="include.store.dialects"):
        open_store(shared / "s.db")
    assert mode(shared) == shared_mode
    assert f"SQLite store directory {shared} is mode {shared_mode:04o}" in caplog.text and "left as is" in caplog.text
    assert mode(shared / "s.db") == 0o600


def test_an_existing_0755_var_dir_is_tightened_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from include.config import VAR_ENV, private_var_dir

    var = tmp_path / "var"
    var.mkdir()
    os.chmod(var, 0o755)  # noqa: S103 - the loose mode under test
    monkeypatch.setenv(VAR_ENV, str(var))
    with caplog.at_level(logging.WARNING, logger="include.config"):
        assert private_var_dir() == var
    assert mode(var) == 0o700
    assert f"var dir {var} was mode 0755" in caplog.text
