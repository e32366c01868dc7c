"""Reading a config file without trusting what is at its path.

A config file is read only if it is a regular file (a symbolic link to one is followed: config
dirs mounted from a Kubernetes ConfigMap are links) of at most `MAX_CONFIG_BYTES`. A fifo would
block the reader for good and `/dev/zero` would fill memory, so each is a problem line instead:
`stat` first (no open of a device or fifo), then the open is non-blocking and its descriptor is
checked again with `fstat` (the path may have been swapped in between), and the read is bounded.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from include.schema import ConfigProblem, ConfigProblems

__all__ = ["MAX_CONFIG_BYTES", "read_config_bytes", "read_toml", "unreadable"]

MAX_CONFIG_BYTES = 1024 * 1024
"""1 MiB per config file: room for some ten thousand connections or routes; anything larger is not
a config someone wrote."""


def unreadable(path: Path, *, limit: int = MAX_CONFIG_BYTES) -> str | None:
    """Why `path` is not a config file that may be read (None: it may, or it does not exist)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read: {exc.strerror or type(exc).__name__}"
    return _kind(st, limit)


def _kind(st: os.stat_result, limit: int) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        what = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a fifo"
            if stat.S_ISFIFO(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket"
            if stat.S_ISSOCK(st.st_mode)
            else "not a file"
        )
        return f"not a regular file ({what}); a config file is read only if it is one"
    if st.st_size > limit:
        return f"{st.st_size} bytes, more than the {limit} a config file may have"
    return None


def read_config_bytes(path: Path, *, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of the regular file `path`; `ConfigProblems` (one line, naming the file) when it is
    not one, is too large or cannot be read. `FileNotFoundError` passes through."""
    why = unreadable(path, limit=limit)
    if why is not None:
        raise ConfigProblems([ConfigProblem(path, "", why)])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigProblems(
            [ConfigProblem(path, "", f"cannot be read: {exc.strerror or type(exc).__name__}")]
        ) from None
    try:
        why = _kind(os.fstat(fd), limit)
        if why is not None:
            raise ConfigProblems([ConfigProblem(path, "", why)])
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise ConfigProblems([ConfigProblem(path, "", f"more than the {limit} bytes a config file may have")])
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigProblems(
            [ConfigProblem(path, "", f"cannot be read: {exc.strerror or type(exc).__name__}")]
        ) from None
    finally:
        os.close(fd)


def read_toml(path: Path, *, limit: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """`path` parsed as TOML (read as `read_config_bytes` does); every failure is one problem line."""
    data = read_config_bytes(path, limit=limit)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ConfigProblems([ConfigProblem(path, "", f"not valid TOML: {exc}")]) from None
