"""include/safe_files: the descriptor helpers every file Stageline reads or writes goes through."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from include.safe_files import (
    NotRegular,
    TooLarge,
    UnsafePath,
    create_exclusive,
    move_exclusive,
    open_dir,
    printable,
    read_regular,
    still_same_dir,
)

UNIQUE = r"\.\d{8}T\d{6}Z-[0-9a-f]{8}"


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
        target = move_exclusive(sfd, "a.hl7", dfd, companion=(".reason", b"why"))
    finally:
        os.close(sfd)
        os.close(dfd)
    assert re.fullmatch(r"a" + UNIQUE + r"\.hl7", target)
    assert (dst / "a.hl7").read_bytes() == b"old" and (dst / target).read_bytes() == b"new"
    assert (dst / f"{target}.reason").read_bytes() == b"why"


# -- red team, issue 23: names that must never run out, links in the middle of a path ---------------


def test_ten_thousand_clashing_names_cost_one_extra_try_not_ten_thousand(tmp_path: Path) -> None:
    """Red team 2b: a feed that always writes ADT.hl7 once filled ADT.1 .. ADT.9999 and then stalled."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    for n in range(10_000):
        (dst / (f"ADT.{n}.hl7" if n else "ADT.hl7")).touch()
    (src / "ADT.hl7").write_bytes(b"new")
    sfd, dfd = open_dir(src), open_dir(dst)
    started = time.monotonic()
    try:
        target = move_exclusive(sfd, "ADT.hl7", dfd)
    finally:
        os.close(sfd)
        os.close(dfd)
    assert time.monotonic() - started < 0.5
    assert re.fullmatch(r"ADT" + UNIQUE + r"\.hl7", target) and (dst / target).read_bytes() == b"new"


@pytest.mark.parametrize("companion", [None, (".reason", b"why")])
def test_a_255_byte_name_dropped_twice_is_shortened_and_keeps_its_extension(tmp_path: Path, companion) -> None:
    """Red team 2a and 12: `stem.1.hl7` (or `<name>.reason`) was over NAME_MAX: ENAMETOOLONG at every poll."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    name = "L" * 251 + ".hl7"
    (dst / name).write_bytes(b"first")
    (src / name).write_bytes(b"second")
    sfd, dfd = open_dir(src), open_dir(dst)
    try:
        target = move_exclusive(sfd, name, dfd, companion=companion)
    finally:
        os.close(sfd)
        os.close(dfd)
    assert target.endswith(".hl7") and target.startswith("LLLL") and "~" in target
    assert len(target.encode()) + (len(companion[0]) if companion else 0) <= 255
    assert (dst / target).read_bytes() == b"second" and (dst / name).read_bytes() == b"first"
    if companion:
        assert (dst / f"{target}.reason").read_bytes() == b"why"


def test_a_long_multibyte_name_is_cut_on_a_character_boundary(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    name = "é" * 125 + ".hl7"  # 254 bytes
    (src / name).write_bytes(b"x")
    sfd, dfd = open_dir(src), open_dir(dst)
    try:
        target = move_exclusive(sfd, name, dfd, companion=(".reason", b"why"))
    finally:
        os.close(sfd)
        os.close(dfd)
    assert target.encode("utf-8").decode("utf-8") == target  # still valid UTF-8: no half character
    assert target.startswith("éé") and target.endswith(".hl7") and len(target.encode()) <= 248


def test_a_symlink_in_a_middle_component_is_refused_and_nothing_is_created_through_it(tmp_path: Path) -> None:
    """Red team 6: `drop/sub` swapped for a link; makedirs created `target/archive` through it."""
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "drop").mkdir()
    (tmp_path / "drop" / "sub").symlink_to(target)
    with pytest.raises(UnsafePath, match="drop/sub is a symlink"):
        open_dir(tmp_path / "drop" / "sub" / "archive" / "rejected", create=True)
    assert list(target.iterdir()) == []


def test_missing_directories_are_created_one_by_one_with_the_mode(tmp_path: Path) -> None:
    fd = open_dir(tmp_path / "a" / "b" / "c", create=True, mode=0o700)
    os.close(fd)
    assert {oct(os.stat(tmp_path / p).st_mode & 0o777) for p in ("a", "a/b", "a/b/c")} == {"0o700"}


def test_a_directory_above_swapped_for_a_link_is_no_longer_the_same(tmp_path: Path) -> None:
    fd = open_dir(tmp_path / "sub" / "archive", create=True)
    try:
        assert still_same_dir(fd, tmp_path / "sub" / "archive")
        (tmp_path / "sub").rename(tmp_path / "sub.old")
        (tmp_path / "sub").symlink_to(tmp_path / "sub.old")  # the very same directory, through a link
        assert not still_same_dir(fd, tmp_path / "sub" / "archive")
    finally:
        os.close(fd)


def test_printable_escapes_newlines_escapes_and_undecodable_bytes() -> None:
    """Red team 13: a name with newlines forged `connection:` lines; ESC reached the terminal raw."""
    assert printable("evil.hl7\nconnection: other") == "evil.hl7\\x0aconnection: other"
    assert printable("esc\x1b[31mred") == "esc\\x1b[31mred"
    assert printable(os.fsdecode(b"bad\xff.hl7")) == "bad\\xff.hl7"
    assert printable("rtl\u202egnp.hl7") == "rtl\\u202egnp.hl7"
    assert printable("plain é.hl7") == "plain é.hl7"
    assert printable("a\\b") == "a\\\\b"


def test_write_exclusive_writes_a_new_0600_file_and_never_overwrites(tmp_path):
    from include.safe_files import write_exclusive

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "a.hl7").write_bytes(b"theirs")
        (tmp_path / "b.hl7").symlink_to(tmp_path / "elsewhere")
        first = write_exclusive(fd, "a.hl7", b"staged")
        second = write_exclusive(fd, "b.hl7", b"staged")
    finally:
        os.close(fd)
    assert first != "a.hl7" and first.startswith("a.") and (tmp_path / "a.hl7").read_bytes() == b"theirs"
    assert second != "b.hl7" and not (tmp_path / "elsewhere").exists()
    assert (tmp_path / first).read_bytes() == b"staged"
    assert oct((tmp_path / first).stat().st_mode & 0o777) == "0o600"


def test_private_dir_tightens_ours_and_refuses_anothers(tmp_path):
    from include.safe_files import UnsafePath, private_dir

    ours = tmp_path / "ours"
    ours.mkdir()
    os.chmod(ours, 0o777)  # noqa: S103 - the loose mode under test
    fd = os.open(ours, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert private_dir(fd, ours) == f"{ours} was mode 0777; tightened to 0700"
        assert private_dir(fd, ours) is None
    finally:
        os.close(fd)
    assert oct(ours.stat().st_mode & 0o777) == "0o700"
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        fd = os.open(theirs, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(UnsafePath, match="owned by uid 65534"):
                private_dir(fd, theirs)
        finally:
            os.close(fd)
