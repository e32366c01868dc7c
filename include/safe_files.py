"""Files by descriptor, never by following links (invariant 10).

Whoever can write into a directory Stageline reads or writes (a partner's drop directory, a shared
destination) can plant a symlink, a fifo or a device under any name. So every directory is opened
once as a descriptor (``O_DIRECTORY|O_NOFOLLOW``), every name is opened relative to it with
``O_NOFOLLOW``, every file Stageline creates is ``O_CREAT|O_EXCL`` (mode 0600 unless told) so a
name taken by anyone else is never written through, and moves are renames between directory
descriptors (a rename replaces a link, it never follows one). A name collision picks another name
by trying to create it, never by an ``exists()`` check that someone can race.
"""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["UnsafePath", "Identity", "open_dir", "identity", "still_same_dir", "create_exclusive",
           "read_regular", "candidate_names", "move_exclusive", "NotRegular", "TooLarge"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC


class UnsafePath(OSError):
    """A path that must be a real directory (or file) is a symlink or something else."""


class NotRegular(OSError):
    """The name is not (or no longer) the regular file it was listed as."""


class TooLarge(OSError):
    """The file grew past the limit while it was read."""


@dataclass(frozen=True, slots=True)
class Identity:
    """What makes a file the same file: its device and inode."""

    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino)


def open_dir(path: str | os.PathLike[str], *, create: bool = False, mode: int = 0o700) -> int:
    """A descriptor of the directory `path` itself, never of what a symlink there points at.

    With `create`, a missing directory (and its missing parents) is made with `mode` first.
    UnsafePath when `path` is a symlink or not a directory."""
    try:
        return os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(exc.errno, f"{_what(path)}, not a directory: refused", str(path)) from None
        raise
    os.makedirs(path, mode=mode, exist_ok=True)
    return open_dir(path)


def _what(path: str | os.PathLike[str]) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return "gone"
    return kind(st)


def kind(st: os.stat_result) -> str:
    """A word for what an lstat found: "regular file", "symlink", "fifo", ..."""
    mode = st.st_mode
    for test, word in ((stat.S_ISREG, "regular file"), (stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return word
    return "special file"


def identity(fd: int) -> Identity:
    return Identity.of(os.fstat(fd))


def still_same_dir(fd: int, path: str | os.PathLike[str]) -> bool:
    """Whether `path` (not followed) is still the directory `fd` was opened on: False once it was
    replaced by a symlink, another directory, or removed."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and Identity.of(st) == identity(fd)


def create_exclusive(dir_fd: int, name: str, data: bytes = b"", *, mode: int = 0o600, sync: bool = False) -> None:
    """Create `name` in `dir_fd` holding `data`: FileExistsError when the name is taken by anything
    (a file, a dangling symlink), never written through. The mode holds from the first byte."""
    fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(dir_fd, name)
        raise
    os.close(fd)


def read_regular(dir_fd: int, name: str, *, expect: Identity | None = None, limit: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file `name` in `dir_fd`, at most `limit` (TooLarge beyond).

    Opened without following a link and without blocking on a fifo; NotRegular when what was
    opened is not a regular file or not the one listed (`expect`)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegular(exc.errno, "a symlink: refused", name) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, f"a {kind(st)}: refused", name)
        if expect is not None and Identity.of(st) != expect:
            raise NotRegular(errno.ESTALE, "replaced since it was listed", name)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise TooLarge(errno.EFBIG, f"larger than {limit} bytes", name)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def candidate_names(name: str) -> Iterator[str]:
    """`name`, then `stem.1.ext`, `stem.2.ext`, ... (`name.N` without an extension)."""
    stem, dot, ext = name.rpartition(".") if "." in name.lstrip(".") else (name, "", "")
    yield name
    n = 0
    while True:
        n += 1
        yield f"{stem}.{n}.{ext}" if dot else f"{name}.{n}"


def move_exclusive(src_dir_fd: int, name: str, dst_dir_fd: int, *, companion: tuple[str, bytes] | None = None,
                   tries: int = 10_000) -> str:
    """Rename `name` from `src_dir_fd` into `dst_dir_fd` under a name nobody holds; the name used.

    The target is claimed by creating it (``O_EXCL``) and the rename then replaces that claim, so
    nothing already there is overwritten and no link is followed. `companion` = (suffix, bytes):
    a file `<target><suffix>` written first the same way (a `.reason`), removed if the move fails."""
    for candidate in _limited(candidate_names(name), tries):
        extra = f"{candidate}{companion[0]}" if companion else None
        if extra is not None:
            try:
                create_exclusive(dst_dir_fd, extra, companion[1])  # type: ignore[index]
            except FileExistsError:
                continue
        try:
            create_exclusive(dst_dir_fd, candidate)
        except FileExistsError:
            if extra is not None:
                _unlink(dst_dir_fd, extra)
            continue
        try:
            os.rename(name, candidate, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        except BaseException:
            _unlink(dst_dir_fd, candidate)
            if extra is not None:
                _unlink(dst_dir_fd, extra)
            raise
        return candidate
    raise FileExistsError(errno.EEXIST, f"no free name for {name} after {tries} tries", name)


def _limited(names: Iterator[str], n: int) -> Iterator[str]:
    for i, name in enumerate(names):
        if i >= n:
            return
        yield name


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
