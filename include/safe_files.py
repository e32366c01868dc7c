"""Files by descriptor, never by following links (invariant 10).

Whoever can write into a directory Stageline reads or writes (a partner's drop directory, a shared
destination) can plant a symlink, a fifo or a device under any name. So every directory is opened
once as a descriptor (``O_DIRECTORY|O_NOFOLLOW``), every name is opened relative to it with
``O_NOFOLLOW``, every file Stageline creates is ``O_CREAT|O_EXCL`` (mode 0600 unless told) so a
name taken by anyone else is never written through, and moves are renames between directory
descriptors (a rename replaces a link, it never follows one). A name collision picks another name
by trying to create it, never by an ``exists()`` check that someone can race.

A path is resolved one component at a time (``openat`` with ``O_NOFOLLOW`` from ``/``, or from the
working directory for a relative path), so a symlink planted at ANY component, not only the last,
is refused, and a missing directory is created with ``mkdirat`` under its parent's descriptor
(never ``os.makedirs``, which follows links). Names Stageline makes always fit: a clash gets a
timestamp and a random token, an over-long name is shortened (its extension kept, a digest of the
full name added), so a partner's choice of name can never leave "no free name".
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import time
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "NAME_MAX",
    "Identity",
    "NotRegular",
    "TooLarge",
    "UnsafePath",
    "candidate_names",
    "create_exclusive",
    "identity",
    "move_exclusive",
    "open_dir",
    "printable",
    "private_dir",
    "read_regular",
    "still_same_dir",
    "unlink_quietly",
    "write_exclusive",
]

NAME_MAX = 255

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
    """A descriptor of the directory `path` itself, resolved component by component without
    following a symlink at any of them.

    With `create`, each missing directory on the way is made with `mode` (``mkdirat`` under its
    parent's descriptor). UnsafePath when any component is a symlink or not a directory."""
    text = os.fspath(path)
    if not text:
        raise FileNotFoundError(errno.ENOENT, "empty path", text)
    parts = [part for part in text.split("/") if part not in ("", ".")]
    fd = os.open("/" if text.startswith("/") else ".", _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            try:
                child = _open_child(fd, part, create=create, mode=mode)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    here = ("/" if text.startswith("/") else "") + "/".join(parts[: i + 1])
                    raise UnsafePath(
                        exc.errno, f"{here} is a {_what(fd, part)}, not a directory: refused", text
                    ) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_child(parent: int, part: str, *, create: bool, mode: int) -> int:
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(part, mode, dir_fd=parent)
    except FileExistsError:
        pass  # made meanwhile: opened below like any other, never followed
    return os.open(part, _DIR_FLAGS, dir_fd=parent)


def _what(parent: int, name: str) -> str:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return "gone"
    return kind(st)


def kind(st: os.stat_result) -> str:
    """A word for what an lstat found: "regular file", "symlink", "fifo", ..."""
    mode = st.st_mode
    for test, word in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return word
    return "special file"


def identity(fd: int) -> Identity:
    return Identity.of(os.fstat(fd))


def still_same_dir(fd: int, path: str | os.PathLike[str]) -> bool:
    """Whether `path`, resolved without following a link at any component, is still the directory
    `fd` was opened on: False once it (or any directory above it) was replaced by a symlink,
    another directory, or removed."""
    try:
        now = open_dir(path)
    except OSError:
        return False
    try:
        return identity(now) == identity(fd)
    finally:
        os.close(now)


def create_exclusive(dir_fd: int, name: str, data: bytes = b"", *, mode: int = 0o600, sync: bool = False) -> None:
    """Create `name` in `dir_fd` holding `data`: FileExistsError when the name is taken by anything
    (a file, a dangling symlink), never written through. The mode holds from the first byte."""
    fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(dir_fd, name)
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


def printable(name: str) -> str:
    """`name` safe for one line of a log or a ``.reason`` file: control and format characters
    (newline, ESC, bidi overrides, ...), backslash and undecodable bytes written as escapes."""
    out = []
    for ch in name:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def _size(name: str) -> int:
    return len(os.fsencode(name))


def _cut(text: str, size: int) -> str:
    """The longest start of `text` at most `size` bytes, never ending inside a UTF-8 character."""
    whole = os.fsencode(text)
    end = max(min(size, len(whole)), 0)
    while 0 < end < len(whole) and 0x80 <= whole[end] < 0xC0:  # `end` is inside a character
        end -= 1
    return os.fsdecode(whole[:end])


def _fit(stem: str, unique: str, ext: str, original: str, limit: int) -> str:
    """`stem + unique + ext`, or when that is over `limit` bytes, `stem` shortened with a digest of
    `original` (the extension kept when it is short)."""
    name = stem + unique + ext
    if _size(name) <= limit:
        return name
    if _size(ext) > 32:
        stem, ext = stem + ext, ""
    mark = "~" + hashlib.sha256(os.fsencode(original)).hexdigest()[:16]
    return _cut(stem, limit - _size(mark + unique + ext)) + mark + unique + ext


def candidate_names(name: str, *, limit: int = NAME_MAX) -> Iterator[str]:
    """`name`, then `stem.<UTC time>-<random>.ext` names, each at most `limit` bytes (shortened,
    with a digest of `name`, when longer), so a free one always turns up at once."""
    stem, dot, ext = name.rpartition(".") if "." in name.lstrip(".") else (name, "", "")
    ext = dot + ext
    yield _fit(stem, "", ext, name, limit)
    while True:
        unique = f".{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"
        yield _fit(stem, unique, ext, name, limit)


def _name_max(dir_fd: int) -> int:
    try:
        return min(NAME_MAX, os.fpathconf(dir_fd, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX


def move_exclusive(
    src_dir_fd: int,
    name: str,
    dst_dir_fd: int,
    *,
    companion: tuple[str, bytes] | None = None,
    tries: int = 100,
    as_name: str | None = None,
) -> str:
    """Rename `name` from `src_dir_fd` into `dst_dir_fd` under a name nobody holds; the name used.

    The target (`as_name`, by default `name`, or a variant of it: `candidate_names`) is claimed by
    creating it (``O_EXCL``) and the rename then replaces that claim, so nothing already there is
    overwritten and no link is followed. `companion` = (suffix, bytes): a file `<target><suffix>`
    written first the same way (a `.reason`), removed if the move fails; the target is shortened
    so that the companion's name fits too."""
    limit = _name_max(dst_dir_fd) - (_size(companion[0]) if companion else 0)
    for candidate in _limited(candidate_names(as_name or name, limit=limit), tries):
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
                unlink_quietly(dst_dir_fd, extra)
            continue
        try:
            os.rename(name, candidate, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        except BaseException:
            unlink_quietly(dst_dir_fd, candidate)
            if extra is not None:
                unlink_quietly(dst_dir_fd, extra)
            raise
        return candidate
    raise FileExistsError(errno.EEXIST, f"no free name for {printable(name)} after {tries} tries", name)


def write_exclusive(dst_dir_fd: int, name: str, data: bytes, *, tries: int = 100) -> str:
    """Write `data` as a new file (``O_EXCL``, 0600, fsynced) under `name` or a free variant of
    it (`candidate_names`); the name used. Used to archive exactly the bytes that were staged:
    a copy, so a writer still holding the original open cannot add to what is archived."""
    for candidate in _limited(candidate_names(name, limit=_name_max(dst_dir_fd)), tries):
        try:
            create_exclusive(dst_dir_fd, candidate, data, sync=True)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(errno.EEXIST, f"no free name for {printable(name)} after {tries} tries", name)


def private_dir(fd: int, path: str | os.PathLike[str]) -> str | None:
    """Make the open directory `fd` private to us: UnsafePath when another uid owns it; when we
    own it and group or others have any access, chmod 0700 and return a warning naming its old mode."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise UnsafePath(
            errno.EPERM,
            f"{path} is owned by uid {st.st_uid}, not this daemon's uid {os.geteuid()}; not used",
            str(path),
        )
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077:
        return None
    os.fchmod(fd, 0o700)
    return f"{path} was mode {mode:04o}; tightened to 0700"


def _limited(names: Iterator[str], n: int) -> Iterator[str]:
    for i, name in enumerate(names):
        if i >= n:
            return
        yield name


def unlink_quietly(dir_fd: int, name: str) -> None:
    """Remove `name` in the directory `dir_fd` if it is there (a temp file's cleanup)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
