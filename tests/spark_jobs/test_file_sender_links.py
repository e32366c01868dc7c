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


def test_the_file_has_its_mode_before_its_first_byte_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_write(fd, data)

    old = os.umask(0)
    try:
        monkeypatch.setattr(os, "write", write)
        results = send_file_lanes(
            [
                [
                    FileSend(file_dest(tmp_path, mode=0o640), "a", "text/plain", "a"),
                    FileSend(file_dest(tmp_path), "b", "text/plain", "b"),
                ]
            ]
        )
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


def test_a_symlink_above_the_destination_directory_is_refused_and_nothing_written(tmp_path: Path) -> None:
    """Red team 6: `partner` (above `partner/outbox`) swapped for a link; the next file went through it."""
    (tmp_path / "partner" / "outbox").mkdir(parents=True)
    (tmp_path / "elsewhere" / "outbox").mkdir(parents=True)
    dest = file_dest(tmp_path / "partner" / "outbox")
    assert send_file(dest, "MSH|1", "text/plain", "k1").ok
    (tmp_path / "partner").rename(tmp_path / "partner.old")
    (tmp_path / "partner").symlink_to(tmp_path / "elsewhere")
    result = send_file(dest, "MSH|2", "text/plain", "k2")
    assert (result.ok, result.retryable) == (False, True) and "symlink" in result.detail
    assert list((tmp_path / "elsewhere" / "outbox").iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o666, 0o622, 0o700, 0o604 | 0o002])
def test_a_mode_granting_write_or_execute_beyond_the_owner_is_refused_by_the_schema(mode: int) -> None:
    """Red team 18: `mode = 0o777` was accepted, PHI files world-writable."""
    from pydantic import ValidationError

    from include.schema.destinations import FileModel

    with pytest.raises(ValidationError, match="grants write or execute"):
        FileModel(name="f", kind="file", directory="/srv/out", mode=mode)
    for ok in (0o600, 0o640, 0o644, 0o400):
        assert FileModel(name="f", kind="file", directory="/srv/out", mode=ok).mode == ok


def test_the_sender_never_writes_more_than_0644_whatever_it_is_given(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        assert send_file(file_dest(tmp_path, mode=0o777), "x", "text/plain", "k").ok
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k.hl7").stat().st_mode) == 0o644
