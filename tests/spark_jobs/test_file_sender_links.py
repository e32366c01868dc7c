"""File destinations written by descriptor (issue 23): a symlinked target directory or a symlink
planted at the final name is never followed; the file has its mode from the first byte."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from include.destinations_config import FileDestination
from spark_jobs.senders.file import FileSend, send_file, send_file_lanes


def file_dest(directory: Path, **settings: Any) -> FileDestination:
    return FileDestination(name="ehr", directory=str(directory), **settings)


def test_a_destination_directory_that_is_a_symlink_is_refused_and_nothing_written(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    result = send_file(file_dest(tmp_path / "out"), "x", "text/plain", "k")
    assert (result.ok, result.retryable) == (False, True)
    assert "symlink" in result.detail
    assert list(elsewhere.iterdir()) == []


def test_a_symlink_planted_at_the_final_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("keep me")
    (out / "k.hl7").symlink_to(victim)
    assert send_file(file_dest(out), "MSH|new", "text/plain", "k").ok
    assert victim.read_text() == "keep me"
    assert not (out / "k.hl7").is_symlink() and (out / "k.hl7").read_text() == "MSH|new"


def test_the_file_has_its_mode_before_its_first_byte_whatever_the_umask(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_write(fd, data)

    old = os.umask(0)
    try:
        monkeypatch.setattr(os, "write", write)
        results = send_file_lanes([[FileSend(file_dest(tmp_path, mode=0o640), "a", "text/plain", "a"),
                                    FileSend(file_dest(tmp_path), "b", "text/plain", "b")]])
        monkeypatch.undo()
    finally:
        os.umask(old)
    assert [r.ok for r in results[0] if r is not None] == [True, True]
    assert seen == [0o640, 0o600]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {"a.hl7": 0o640, "b.hl7": 0o600}


def test_a_directory_swapped_for_a_symlink_mid_lanes_receives_nothing_through_it(tmp_path: Path) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    dest = file_dest(out)
    first = send_file_lanes([[FileSend(dest, "1", "text/plain", "one")]])
    assert first[0][0] is not None and first[0][0].ok
    out.rename(tmp_path / "out.old")
    out.symlink_to(elsewhere)
    again = send_file_lanes([[FileSend(dest, "2", "text/plain", "two")]])
    assert again[0][0] is not None and (again[0][0].ok, again[0][0].retryable) == (False, True)
    assert list(elsewhere.iterdir()) == []
