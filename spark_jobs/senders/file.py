"""File sender: one message, one file, written atomically (or, with ``batch = true``, a micro-batch's
messages to one destination as one HL7 batch file: `batch_file`).

Idempotency: the file is named `<idempotency_key><suffix>` and written atomically (temp file in
the same directory, fsync, `os.replace`, fsync of the directory), so a re-delivery overwrites the
same file with the same bytes. Pollers must ignore dot-files (`.stageline-*.tmp`).

By descriptor (issue 23): the destination directory is opened `O_DIRECTORY|O_NOFOLLOW` one path
component at a time (`include.safe_files.open_dir`: a symlink at ANY component, say a partner's
`partner -> elsewhere` above `partner/outbox`, is refused, retryably, and nothing is written), the temp file is
created relative to it `O_CREAT|O_EXCL|O_NOFOLLOW` with the destination's `mode` from the first
byte, and the rename happens between that directory's descriptor and itself: a symlink planted at
the final name is replaced, never followed.

`send_file_lanes` does the same for many messages at once with two flushes instead of two per
file: every temp file written, ONE `syncfs` of their filesystem (their data is on disk), every
rename in lane order, ONE fsync per directory (the renames are on disk). Nothing is reported sent
before both flushes, so a crash loses no acknowledged file; it can leave temp files behind (as the
single path can) and re-sends the rows, which rewrite the same names.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from include.destinations_config import FileDestination
from include.safe_files import open_dir, unlink_quietly
from spark_jobs.senders.common import DeliveryResult, describe_error, payload_codec

__all__ = ["FileSend", "batch_file", "send_file", "send_file_lanes"]


def send_file(dest: FileDestination, payload: str, content_type: str, idempotency_key: str) -> DeliveryResult:
    """Write `payload` to `<directory>/<key><suffix>`; a missing directory is retryable, never created."""
    [[result]] = send_file_lanes([[FileSend(dest, payload, content_type, idempotency_key)]])
    assert result is not None
    return result


def _file_name(key: str, suffix: str) -> str | None:
    """`<key><suffix>`, percent-quoted so no key can leave the directory; hashed if too long."""
    if not key:
        return None
    stem = quote(key, safe="-_.@+=")
    if stem.startswith("."):  # no hidden files, no "." or ".."
        stem = "%2E" + stem[1:]
    if len((stem + suffix).encode()) > 255:
        stem = "sha256-" + hashlib.sha256(key.encode()).hexdigest()
    return stem + suffix


def _open_directory(directory: str) -> int:
    """The destination directory itself as a descriptor, reached without following a symlink at any
    component of its path; never created (a missing directory is the operator's to make)."""
    return open_dir(directory)


FILE_MODE_BITS = 0o644
"""The most a delivered file may grant: never write or execute to group or other (PHI)."""


def batch_file(dest: FileDestination, rows: Sequence[Mapping[str, Any]]) -> FileSend:
    """Many messages to one destination as ONE HL7 batch file (v2 section 2.10.3): ``FHS``,
    ``BHS``, the messages in the order given, ``BTS`` (their count), ``FTS``.

    Its name and FHS-11/BHS-11 derive from the rows' idempotency keys, so re-delivering the same
    rows rewrites the same file; a re-delivery that groups them differently writes another file
    (at-least-once, as for single files). The file's charset is the messages' (MSH-18) when they
    all share one, else UTF-8."""
    digest = hashlib.sha256("\0".join(str(r["idempotency_key"]) for r in rows).encode()).hexdigest()[:32]
    codecs = {payload_codec(r["payload"], r.get("content_type")) for r in rows}
    codec = codecs.pop() if len(codecs) == 1 else "utf-8"
    stamp = time.strftime("%Y%m%d%H%M%S", time.gmtime())
    head = f"|^~\\&|STAGELINE||{dest.name}||{stamp}||||"
    body = "".join(r["payload"].rstrip("\r\n") + "\r" for r in rows)
    text = f"FHS{head}{digest}\rBHS{head}{digest}\r{body}BTS|{len(rows)}\rFTS|1\r"
    return FileSend(dest, text, f"application/hl7-v2; charset={codec}", f"batch-{digest}")


@dataclass(frozen=True)
class FileSend:
    """One message of a lane for `send_file_lanes`."""

    dest: FileDestination
    payload: str
    content_type: str
    idempotency_key: str


@dataclass
class _Staged:
    send: FileSend
    lane: int
    index: int
    dir_fd: int
    tmp: str
    final: str
    size: int


def send_file_lanes(lanes: Sequence[Sequence[FileSend]]) -> list[list[DeliveryResult | None]]:
    """Write many lanes of files with one data flush and one flush per directory (module docstring).

    Per lane, results in the lane's order; a lane stops at its first failure and the rest of it is
    None (not attempted). Never raises.
    """
    dirs: dict[str, int | str] = {}  # directory -> its descriptor, or why it cannot be written
    try:
        return _send_lanes(lanes, dirs)
    finally:
        for fd in dirs.values():
            if isinstance(fd, int):
                os.close(fd)


def _send_lanes(lanes: Sequence[Sequence[FileSend]], dirs: dict[str, int | str]) -> list[list[DeliveryResult | None]]:
    results: list[list[DeliveryResult | None]] = [[None] * len(lane) for lane in lanes]
    staged: list[_Staged] = []
    for li, lane in enumerate(lanes):
        for i, item in enumerate(lane):
            outcome = _write_temp(item, dirs)
            if isinstance(outcome, DeliveryResult):
                results[li][i] = outcome
                break
            staged.append(_Staged(item, li, i, *outcome))
    if not staged:
        return results
    flushed = _flush_data({s.dir_fd for s in staged})
    stopped: set[int] = set()
    renamed: dict[int, list[_Staged]] = {}
    for st in staged:
        if st.lane in stopped or flushed is not None:
            unlink_quietly(st.dir_fd, st.tmp)
            if st.lane not in stopped:
                results[st.lane][st.index] = DeliveryResult.retry(f"{st.send.dest.name}: flushing files: {flushed}")
                stopped.add(st.lane)
            continue
        try:
            os.replace(st.tmp, st.final, src_dir_fd=st.dir_fd, dst_dir_fd=st.dir_fd)
        except OSError as exc:
            unlink_quietly(st.dir_fd, st.tmp)
            results[st.lane][st.index] = DeliveryResult.retry(
                f"{st.send.dest.name}: writing {st.final}: {describe_error(exc)}"
            )
            stopped.add(st.lane)
            continue
        renamed.setdefault(st.dir_fd, []).append(st)
    for dir_fd, done in renamed.items():
        try:
            os.fsync(dir_fd)  # the renames are on disk
        except OSError as exc:
            failed = DeliveryResult.retry(
                f"{done[0].send.dest.name}: syncing {done[0].send.dest.directory}: {describe_error(exc)}"
            )
            for st in done:
                results[st.lane][st.index] = failed
            continue
        for st in done:
            results[st.lane][st.index] = DeliveryResult.success(
                f"{st.send.dest.name}: wrote {st.final} ({st.size} bytes)"
            )
    for outcomes in results:  # after a failure nothing later in the lane counts as sent
        for i, r in enumerate(outcomes):
            if r is not None and not r.ok:
                outcomes[i + 1 :] = [None] * (len(outcomes) - i - 1)
                break
    return results


def _directory(dest: FileDestination, dirs: dict[str, int | str]) -> int | str:
    """`dest.directory`'s descriptor (opened once per call), or why it cannot be written."""
    if dest.directory not in dirs:
        try:
            dirs[dest.directory] = _open_directory(dest.directory)
        except FileNotFoundError:
            dirs[dest.directory] = f"directory {dest.directory} does not exist"
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                dirs[dest.directory] = f"directory {dest.directory} is a symlink or not a directory: refused"
            else:
                dirs[dest.directory] = f"directory {dest.directory}: {describe_error(exc)}"
    return dirs[dest.directory]


def _write_temp(item: FileSend, dirs: dict[str, int | str]) -> tuple[int, str, str, int] | DeliveryResult:
    """The message in a temp file beside its final name, not yet flushed; or why not."""
    dest = item.dest
    name = _file_name(item.idempotency_key, dest.suffix)
    if name is None:
        return DeliveryResult.permanent(f"{dest.name}: idempotency key {item.idempotency_key!r} cannot name a file")
    codec = payload_codec(item.payload, item.content_type)
    try:
        data = item.payload.encode(codec)
    except UnicodeEncodeError as exc:
        return DeliveryResult.permanent(f"{dest.name}: payload cannot be encoded as {codec}: position {exc.start}")
    dir_fd = _directory(dest, dirs)
    if isinstance(dir_fd, str):
        return DeliveryResult.retry(f"{dest.name}: {dir_fd}")
    tmp = f".stageline-{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
            dest.mode & FILE_MODE_BITS,
            dir_fd=dir_fd,
        )
    except OSError as exc:
        return DeliveryResult.retry(f"{dest.name}: writing {name}: {describe_error(exc)}")
    try:
        try:
            # exactly the configured mode (the schema refuses more than 0o644), whatever the umask
            os.fchmod(fd, dest.mode & FILE_MODE_BITS)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except OSError as exc:
        unlink_quietly(dir_fd, tmp)
        return DeliveryResult.retry(f"{dest.name}: writing {name}: {describe_error(exc)}")
    return dir_fd, tmp, name, len(data)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if os.name == "posix" else None


def _flush_data(dir_fds: set[int]) -> str | None:
    """Flush the written data of every file system holding `dir_fds` (one `syncfs` each; a global
    `sync` where there is none); None, or the error."""
    devices: dict[int, int] = {}
    try:
        for fd in dir_fds:
            devices.setdefault(os.fstat(fd).st_dev, fd)
        for fd in devices.values():
            if _LIBC is not None and hasattr(_LIBC, "syncfs"):
                if _LIBC.syncfs(fd) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            else:
                os.sync()
    except OSError as exc:
        return describe_error(exc)
    return None
