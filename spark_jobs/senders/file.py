"""File sender: one message, one file, written atomically.

Idempotency: the file is named `<idempotency_key><suffix>` and written atomically (temp file in
the same directory, fsync, `os.replace`, fsync of the directory), so a re-delivery overwrites the
same file with the same bytes. Pollers must ignore dot-files (`.stageline-*.tmp`).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from urllib.parse import quote

from include.destinations_config import FileDestination
from spark_jobs.senders.common import DeliveryResult, describe_error, payload_codec

__all__ = ["send_file"]


def send_file(dest: FileDestination, payload: str, content_type: str, idempotency_key: str) -> DeliveryResult:
    """Write `payload` to `<directory>/<key><suffix>`; a missing directory is retryable, never created."""
    name = _file_name(idempotency_key, dest.suffix)
    if name is None:
        return DeliveryResult.permanent(f"{dest.name}: idempotency key {idempotency_key!r} cannot name a file")
    codec = payload_codec(payload, content_type)
    try:
        data = payload.encode(codec)
    except UnicodeEncodeError as exc:
        return DeliveryResult.permanent(f"{dest.name}: payload cannot be encoded as {codec}: position {exc.start}")
    if not os.path.isdir(dest.directory):  # never create it: a missing mount must not fill its mount point
        return DeliveryResult.retry(f"{dest.name}: directory {dest.directory} does not exist")
    final = os.path.join(dest.directory, name)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".stageline-", suffix=".tmp", dir=dest.directory)
        try:
            os.fchmod(fd, dest.mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        tmp = None
        _fsync_directory(dest.directory)
    except OSError as exc:
        return DeliveryResult.retry(f"{dest.name}: writing {name}: {describe_error(exc)}")
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return DeliveryResult.success(f"{dest.name}: wrote {name} ({len(data)} bytes)")


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


def _fsync_directory(directory: str) -> None:
    """Make the rename durable: without it a crash can lose the new directory entry."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
