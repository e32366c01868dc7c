"""File drop inbound: poll a directory, stage each finished file (a message, or a batch of them),
then archive it.

The directory is a shared resource, so the daemon runs this only on the leader: ``start()`` when
the lease is won, ``stop()`` when it is lost (``stop`` waits for the file in hand).

Rules, in order of a poll:

* **Stability.** A file is taken only when its size and mtime are unchanged across two
  consecutive polls (and once more when it is opened), so a file still being written is left
  alone; a new file therefore waits at least ``poll_seconds``. This needs no clock agreement with
  the writer (mtimes on network shares come from other hosts' clocks). Writers should still write
  under a name ``pattern`` does not match and rename when done; the rule is the safety net.
* **Order.** Stable files go oldest mtime first (then by name), one at a time. A failed submit
  stops the poll, so later files never overtake an earlier one; all are retried next poll.
* **Exactly one row per file.** The message_id is sha256(connection NUL file name NUL content),
  first 32 hex digits, and the file moves to ``archive`` (``os.replace``; a clashing name gets a
  ``.N`` suffix before its extension) only after the commit. A crash between commit and move
  re-reads the file next time: same message_id, ``stage_inbound`` skips it, then it is moved.
  The same content dropped again under the same name is therefore treated as a duplicate.
* **Rejects.** Over ``max_message_bytes``, refused by :func:`listeners.inbound.build_inbound`
  (malformed HL7, undecodable in ``charset`` or MSH-18, NUL characters, a batch that does not add
  up, ...) or refused by the store itself: moved to the connection's ``error_directory`` (default
  ``<archive>/rejected/``) with a ``<name>.reason`` text file beside it; nothing staged. The
  reason is the text MLLP would send back for the same bytes.
* **Batches.** A file whose first segment is FHS or BHS is an HL7 batch: split into its messages,
  each its own row (message ids derived from the file's), staged in one commit with the batch's
  record, or the whole file is rejected.

All file-system work (scan, read and hash, moves) runs off the reactor thread.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from listeners.connections import InboundConfig
from listeners.ingest import RowRefused
from listeners.inbound import IngestSink, LaneOf, PayloadRejected, build_inbound, codec_name, rejection_reason
from listeners.polling import PollingInbound, RunBlocking

if TYPE_CHECKING:
    from listeners.metrics import Metrics

__all__ = ["FileDrop", "RunBlocking", "file_message_id"]

_log = Logger(namespace="stageline.filedrop")


def file_message_id(connection: str, file_name: str, content: bytes) -> str:
    """The deterministic message_id that makes re-reading a file after a crash harmless."""
    digest = hashlib.sha256()
    digest.update(connection.encode())
    digest.update(b"\0")
    digest.update(file_name.encode("utf-8", "surrogateescape"))
    digest.update(b"\0")
    digest.update(content)
    return digest.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class _Read:
    data: bytes
    message_id: str


class _Changed(Exception):
    """The file changed between the stability check and the read: wait for it to settle."""


class FileDrop(PollingInbound):
    """Polls one ``kind = "file"`` connection's directory while started."""

    def __init__(self, ingest: IngestSink, config: InboundConfig, *, lane_of: LaneOf | None = None,
                 metrics: Metrics | None = None, reactor: IReactorTime | None = None,
                 run_blocking: RunBlocking | None = None) -> None:
        """``reactor`` schedules the polls; ``run_blocking`` defaults to its thread pool."""
        if not config.directory:
            raise ValueError(f"{config.name}: a file connection needs directory")
        codec_name(config.charset)
        self.directory = Path(config.directory)
        self.archive = Path(config.archive) if config.archive else self.directory / "archive"
        if self.archive.resolve() == self.directory.resolve():
            raise ValueError(f"{config.name}: archive must differ from directory")
        self.errors = Path(config.error_directory) if config.error_directory else self.archive / "rejected"
        if self.errors.resolve() == self.directory.resolve():
            raise ValueError(f"{config.name}: error_directory must differ from directory")
        super().__init__(config, what="file drop poll", log=_log, reactor=reactor, run_blocking=run_blocking)
        self.ingest = ingest
        self.lane_of = lane_of
        self.metrics = metrics
        self._counters = metrics.listener(config.name, "file") if metrics is not None else None
        self._seen: dict[str, tuple[int, int]] = {}
        self._scan_error: str | None = None

    def _on_start(self) -> None:
        self._seen = {}  # stability is re-proven after every (re)start

    @inlineCallbacks
    def poll(self) -> Any:
        """One pass over the directory; returns how many files were staged and archived."""
        try:
            listing: list[_Entry] = yield self._run(_scan, self.directory, self.config.pattern)
        except OSError as exc:
            reason = f"{type(exc).__name__} (errno {exc.errno})"
            if reason != self._scan_error:
                _log.warn("cannot scan {directory} for {connection}: {reason}",
                          directory=str(self.directory), connection=self.config.name, reason=reason)
            self._scan_error = reason
            return 0
        self._scan_error = None
        ready = [e for e in listing if self._seen.get(e.name) == (e.size, e.mtime_ns)]
        self._seen = {e.name: (e.size, e.mtime_ns) for e in listing}
        ready.sort(key=lambda e: (e.mtime_ns, e.name))
        archived = 0
        for entry in ready:
            if not self._running:
                break
            outcome = yield self._take(entry)
            if outcome is None:
                break  # not stored: keep the order, retry everything next poll
            archived += outcome
        return archived

    @inlineCallbacks
    def _take(self, entry: _Entry) -> Any:
        """Stage and archive one stable file: 1 archived, 0 skipped or rejected, None stop here."""
        name, limit = entry.name, self.config.max_message_bytes
        path = self.directory / name
        if entry.size > limit:
            self._count_received(0)  # refused for its size, never read
            yield self._reject(path, f"message too large: {entry.size} bytes, limit {limit}")
            return 0
        try:
            read: _Read = yield self._run(_read, path, entry, self.config.name)
        except FileNotFoundError:
            self._seen.pop(name, None)
            return 0
        except _Changed:
            self._seen.pop(name, None)
            return 0
        except OSError as exc:
            _log.error("cannot read {file} for {connection}: {error}", file=name,
                       connection=self.config.name, error=type(exc).__name__)
            return None
        self._count_received(len(read.data))
        try:
            item = build_inbound(read.data, connection=self.config.name, charset=self.config.charset,
                                 lane_of=self.lane_of, message_id=read.message_id, hl7_only=self.config.hl7_only)
        except PayloadRejected as exc:
            yield self._reject(path, str(exc))
            return 0
        try:
            yield self.ingest.submit(item)
        except Exception:
            failure = Failure()
            reason, code = rejection_reason(failure)
            if failure.check(RowRefused):  # the store refuses this file for good: set it aside
                yield self._reject(path, reason)
                return 0
            self._count_ack(code)
            _log.warn("file {file} on {connection} not stored ({reason}); left in place",
                      file=name, connection=self.config.name, reason=reason)
            return None
        self._count_ack("AA")
        try:
            target = yield self._run(_move_into, path, self.archive)
        except OSError as exc:
            # Committed but not moved: the next poll re-reads it, stage_inbound skips it, moves it.
            _log.error("staged {file} on {connection} but cannot archive it: {error}", file=name,
                       connection=self.config.name, error=type(exc).__name__)
            return None
        self._seen.pop(name, None)
        _log.info("staged {file} on {connection} as {message_id}; archived as {target}", file=name,
                  connection=self.config.name, message_id=read.message_id, target=Path(target).name)
        return 1

    @inlineCallbacks
    def _reject(self, path: Path, reason: str) -> Any:
        self._count_ack("AR")
        try:
            target = yield self._run(_reject_into, path, self.errors, reason, self.config.name)
        except OSError as exc:
            _log.error("cannot move rejected {file} on {connection}: {error}", file=path.name,
                       connection=self.config.name, error=type(exc).__name__)
            return
        self._seen.pop(path.name, None)
        _log.warn("rejected {file} on {connection}: {reason}; moved to {target}", file=path.name,
                  connection=self.config.name, reason=reason, target=str(target))

    def _count_received(self, size: int) -> None:
        if self._counters is not None:
            self._counters.received(size)

    def _count_ack(self, code: str) -> None:
        if self._counters is not None:
            self._counters.answered(code)


# -- blocking helpers: run in a worker thread --------------------------------------------------

def _scan(directory: Path, pattern: str) -> list[_Entry]:
    entries = []
    with os.scandir(directory) as it:
        for entry in it:
            if not fnmatch.fnmatchcase(entry.name, pattern):
                continue
            try:
                if not entry.is_file():
                    continue
                st = entry.stat()
            except FileNotFoundError:
                continue
            entries.append(_Entry(entry.name, st.st_size, st.st_mtime_ns))
    return entries


def _read(path: Path, entry: _Entry, connection: str) -> _Read:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if (st.st_size, st.st_mtime_ns) != (entry.size, entry.mtime_ns):
            raise _Changed(path.name)
        data = f.read(entry.size + 1)
    if len(data) != entry.size:
        raise _Changed(path.name)
    return _Read(data, file_message_id(connection, path.name, data))


def _free_name(directory: Path, name: str, *, also: str = "") -> Path:
    """``name``, or ``stem.N.ext`` for the first N not taken (nor ``<candidate><also>``)."""
    stem, dot, ext = name.rpartition(".") if "." in name.lstrip(".") else (name, "", "")
    candidate, n = directory / name, 0
    while candidate.exists() or (also and Path(f"{candidate}{also}").exists()):
        n += 1
        candidate = directory / (f"{stem}.{n}.{ext}" if dot else f"{name}.{n}")
    return candidate


def _move_into(path: Path, directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    target = _free_name(directory, path.name)
    os.replace(path, target)
    return str(target)


def _reject_into(path: Path, directory: Path, reason: str, connection: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    target = _free_name(directory, path.name, also=".reason")
    # The reason first: whoever sees the file gone from the drop (or in rejected/) finds it.
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    reason_file = Path(f"{target}.reason")
    reason_file.write_text(
        f"{reason}\nconnection: {connection}\nfile: {path.name}\nrejected_at: {stamp}\n", encoding="utf-8")
    try:
        os.replace(path, target)
    except OSError:
        reason_file.unlink(missing_ok=True)
        raise
    return str(target)
