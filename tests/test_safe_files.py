"""include/safe_files: the descriptor helpers every file Stageline reads or writes goes through."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from include.safe_files import (NotRegular, TooLarge, UnsafePath, create_exclusive, move_exclusive, open_dir,
                                read_regular, still_same_dir)


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafePath, match="symlink"):
        open_dir(tmp_path / "link", create=True)


def test_a_directory_replaced_is_no_longer_the_same(tmp_path: Path) -> None:
    fd = open_dir(tmp_path / "d", create=True)
    try:
        assert still_same_dir(fd, tmp_path / "d")
        (tmp_path / "d").rename(tmp_path / "old")
        (tmp_path / "d").symlink_to(tmp_path / "old")
        assert not still_same_dir(fd, tmp_path / "d")
    finally:
        os.close(fd)


def test_created_files_are_0600_from_the_first_byte_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        fd = open_dir(tmp_path)
        create_exclusive(fd, "f", b"x")
        os.close(fd)
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o600


def test_a_name_taken_by_a_dangling_link_is_never_written_through(tmp_path: Path) -> None:
    (tmp_path / "f").symlink_to(tmp_path / "outside")
    fd = open_dir(tmp_path)
    try:
        with pytest.raises(FileExistsError):
            create_exclusive(fd, "f", b"x")
    finally:
        os.close(fd)
    assert not (tmp_path / "outside").exists()


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "p")
    fd = open_dir(tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(NotRegular):
            read_regular(fd, "p", limit=10)
    finally:
        os.close(fd)
    assert time.monotonic() - started < 1


def test_a_read_stops_at_the_limit(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 100)
    fd = open_dir(tmp_path)
    try:
        with pytest.raises(TooLarge):
            read_regular(fd, "big", limit=99)
        assert read_regular(fd, "big", limit=100)[0] == b"x" * 100
    finally:
        os.close(fd)


def test_a_move_never_replaces_what_is_there(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "a.hl7").write_bytes(b"new")
    (dst / "a.hl7").write_bytes(b"old")
    sfd, dfd = open_dir(src), open_dir(dst)
    try:
        assert move_exclusive(sfd, "a.hl7", dfd, companion=(".reason", b"why")) == "a.1.hl7"
    finally:
        os.close(sfd)
        os.close(dfd)
    assert (dst / "a.hl7").read_bytes() == b"old" and (dst / "a.1.hl7").read_bytes() == b"new"
    assert (dst / "a.1.hl7.reason").read_bytes() == b"why"
