"""File drop inbound: poll a directory, stage each finished file (a message, or a batch of them),
then archive it.

The directory is a shared resource, so the daemon runs this only on the leader: ``start()`` when
the lease is won, ``stop()`` when it is lost (``stop`` waits for the file in hand).

Rules, in order of a poll:

* **By descriptor, never by following a link.** Whoever may write into the drop directory can plant
  a symlink to a secret, a fifo or a device under a name the pattern matches. The drop, archive and
  error directories are opened as directory descriptors (``O_DIRECTORY|O_NOFOLLOW``); every entry
  is ``lstat``-ed in place and only a regular file is read, opened relative to the directory with
  ``O_NOFOLLOW|O_NONBLOCK`` and checked by ``fstat`` to be the very file listed (device, inode),
  read no further than ``max_message_bytes``; a regular file with more than one name (a hard link,
  perhaps to a file the partner could not read) is not read either. A symlink, fifo, socket or
  device that matches the pattern is never read: it is moved (as itself: a rename moves a link, it never follows one) to
  the error directory with a ``.reason``. Directories are left alone. Every file Stageline writes
  (a ``.reason``, the claim on a target name) is created ``O_CREAT|O_EXCL|O_NOFOLLOW`` mode 0600,
  so a name already taken (even by a dangling link) is skipped for the next one, never written
  through. At every poll the archive and error paths must still be the directories first opened:
  one replaced by a symlink (or anything else) stops the connection taking files, with an error
  naming it, until it is a real directory again.
* **Not yet written.** Whatever ``pattern`` says, a name starting with ``.`` or ending in
  ``.tmp``, ``.part``, ``.filepart``, ``.partial`` or ``~`` is a writer's temp file (rsync, scp,
  WinSCP, editors) and is never taken. An empty file is a file whose writer has not written yet:
  it is left alone until it has been empty for ``EMPTY_GRACE_SECONDS`` (then rejected as empty).
* **Stability.** A file is taken only when its size and mtime are unchanged across two
  consecutive polls (and once more when it is opened), so a file still being written is left
  alone; a new file therefore waits at least ``poll_seconds``. This needs no clock agreement with
  the writer (mtimes on network shares come from other hosts' clocks). Writers should still write
  under a temp name (above) and rename when done; the rule is the safety net.
* **Claimed before it is read.** A stable file is first renamed (by directory descriptor) into
  the connection's private ``processing`` directory (0700, outside the drop tree:
  ``<archive>/.processing-<connection>``, by default ``<var dir>/filedrop/<connection>/archive/
  .processing-<connection>``; `include.schema.filedrop_paths`), and read, staged and archived from
  there. A writer that renames a new file over the same name meanwhile leaves it in the drop for the
  next poll. ``processing`` must be ours: owned by the daemon's uid (else the connection takes no
  file, with an error naming it) and tightened to 0700, with a warning, when group or others had
  access. Files in ``processing`` (a crash, a failed submit) are taken first at the next poll; one
  that keeps changing there (a writer still holds it open) for ``UNSETTLED_SECONDS`` is set aside to
  the error directory with a reason.
* **What is archived is exactly what was staged.** The archive gets a new file (``O_EXCL``,
  0600, fsynced) holding the staged bytes, never the claimed file itself: a writer that kept its
  descriptor open cannot add to it. The claimed file is then unlinked, or, when it changed after
  it was read, moved to the error directory ("changed after it was read: N bytes staged, M on
  disk"). A crash between the copy and the unlink leaves a second archive copy (suffixed name).
* **Order.** Stable files go oldest mtime first (then by name), one at a time. A failed submit
  stops the poll, so later files never overtake an earlier one; all are retried next poll.
* **Exactly one row per file.** The message_id is sha256(connection NUL file name NUL content),
  first 32 hex digits, and the file moves to ``archive`` only after the commit. A crash between
  commit and move re-reads the file (from ``processing``) next time: same message_id,
  ``stage_inbound`` skips it, then it is moved. The same content dropped again under the same name
  is therefore treated as a duplicate.
* **Names never run out.** A name taken in the archive or error directory gets
  ``.<UTC time>-<random>`` before its extension; a name too long for that (or for its ``.reason``)
  is shortened with a digest of the whole name. Should the file system still refuse the name,
  the file is archived as ``<message_id>.hl7``. Names are escaped (``\x0a``, ``\x1b``, ...) in
  ``.reason`` files and in the log.
* **Rejects.** Over ``max_message_bytes``, refused by :func:`listeners.validation.build_inbound`
  (malformed HL7, undecodable in ``charset`` or MSH-18, NUL characters, a batch that does not add
  up, ...), refused by the store itself, or not a regular file: moved to the connection's
  ``error_directory`` with a ``<name>.reason`` text file beside it; nothing staged. The reason is
  the text MLLP would send back for the same bytes.
* **Where files go.** ``archive`` and ``error_directory`` default to
  ``<var dir>/filedrop/<connection>/archive`` and ``.../rejected``, outside the partner-writable
  drop tree, created mode 0700 when missing (with only ``archive`` configured, ``error_directory``
  is ``<archive>/rejected``).
* **Batches.** A file whose first segment is FHS or BHS is an HL7 batch: split into its messages,
  each its own row (message ids derived from the file's), staged in one commit with the batch's
  record, or the whole file is rejected.

All file-system work (scan, read and hash, moves) runs off the reactor thread.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import stat
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from include.config import var_dir
from include.safe_files import (
    Identity,
    NotRegular,
    TooLarge,
    UnsafePath,
    kind,
    move_exclusive,
    open_dir,
    printable,
    private_dir,
    read_regular,
    still_same_dir,
    unlink_quietly,
    write_exclusive,
)
from include.schema.filedrop_paths import processing_dir
from listeners.connections_config import InboundConfig
from listeners.group_commit import RowRefused
from listeners.offload import OFFLOAD_BYTES
from listeners.polling import PollingInbound, RunBlocking
from listeners.validation import IngestSink, LaneOf, PayloadRejected, build_inbound, codec_name, rejection_reason

if TYPE_CHECKING:
    from listeners.metrics import Metrics

__all__ = [
    "EMPTY_GRACE_SECONDS",
    "TEMP_SUFFIXES",
    "UNSETTLED_SECONDS",
    "FileDrop",
    "RunBlocking",
    "default_archive",
    "default_error_directory",
    "default_processing",
    "file_message_id",
    "in_progress",
]

_log = Logger(namespace="stageline.filedrop")

EMPTY_GRACE_SECONDS = 60.0
UNSETTLED_SECONDS = 30.0
"""How long a claimed file in ``processing`` may keep changing (someone still holds it open and
writes) before it is set aside to the error directory, so it stops holding back the drop."""
"""How long a file may stay empty (its writer not started yet) before it is rejected as empty."""

TEMP_SUFFIXES = (".tmp", ".part", ".filepart", ".partial", "~")
"""Names writers use while a file is incomplete; never taken, whatever ``pattern`` says."""

_NAME_ERRORS = (errno.ENAMETOOLONG, errno.EEXIST, errno.EINVAL, errno.EILSEQ)


def in_progress(name: str) -> bool:
    """A hidden name or a temp suffix: a file still being written, by convention."""
    return name.startswith(".") or name.lower().endswith(TEMP_SUFFIXES)


def file_message_id(connection: str, file_name: str, content: bytes) -> str:
    """The deterministic message_id that makes re-reading a file after a crash harmless."""
    digest = hashlib.sha256()
    digest.update(connection.encode())
    digest.update(b"\0")
    digest.update(file_name.encode("utf-8", "surrogateescape"))
    digest.update(b"\0")
    digest.update(content)
    return digest.hexdigest()[:32]


def default_archive(connection: str) -> Path:
    """Where a connection's ingested files go unless ``archive`` says otherwise."""
    return var_dir() / "filedrop" / connection / "archive"


def default_error_directory(connection: str) -> Path:
    """Where a connection's refused files go unless ``error_directory`` says otherwise."""
    return var_dir() / "filedrop" / connection / "rejected"


def default_processing(connection: str, archive: str | None = None) -> Path:
    """Where a connection's files wait between claim and archive: inside its archive (writable by us
    and on its file system, as a rename needs); the one rule the config check also keeps drops off."""
    return processing_dir(connection, archive or default_archive(connection))


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    size: int
    mtime_ns: int
    identity: Identity
    kind: str = "regular file"
    where: str = "directory"  # or "processing": claimed already


@dataclass(frozen=True, slots=True)
class _Read:
    data: bytes
    message_id: str


class _Changed(Exception):
    """The file changed between the stability check and the read: wait for it to settle."""


class _HardLinked(Exception):
    """The file has other names: it may be someone else's file linked in, so it is not read."""


class _Dirs:
    """The three directories as descriptors, opened once and re-checked at every poll."""

    def __init__(self, drop: Path, archive: Path, errors: Path, processing: Path) -> None:
        self.paths = {"directory": drop, "archive": archive, "error_directory": errors, "processing": processing}
        self.fds: dict[str, int] = {}

    def check(self) -> None:
        """Open what is not open; UnsafePath when the archive or error path is no longer the
        directory opened (its descriptor is dropped: nothing more goes through it)."""
        for key, path in self.paths.items():
            fd = self.fds.get(key)
            if fd is not None and still_same_dir(fd, path):
                continue
            if fd is not None:
                os.close(self.fds.pop(key))
                if key in ("archive", "error_directory"):  # processing is reopened (never through a link)
                    try:
                        what = kind(os.lstat(path))
                    except OSError:
                        what = "gone"
                    raise UnsafePath(0, f"{key} {path} was replaced (now: {what}); not used", str(path))
            fd = open_dir(path, create=key != "directory", mode=0o700)
            if key == "processing":  # claimed files must be ours alone: nobody else may add to them
                try:
                    warning = private_dir(fd, path)
                except BaseException:
                    os.close(fd)
                    raise
                if warning:
                    _log.warn("file drop processing directory {warning}", warning=warning)
            self.fds[key] = fd

    def fd(self, key: str) -> int:
        return self.fds[key]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class FileDrop(PollingInbound):
    """Polls one ``kind = "file"`` connection's directory while started."""

    def __init__(
        self,
        ingest: IngestSink,
        config: InboundConfig,
        *,
        lane_of: LaneOf | None = None,
        metrics: Metrics | None = None,
        reactor: IReactorTime | None = None,
        run_blocking: RunBlocking | None = None,
    ) -> None:
        """``reactor`` schedules the polls; ``run_blocking`` defaults to its thread pool."""
        if not config.directory:
            raise ValueError(f"{config.name}: a file connection needs directory")
        codec_name(config.charset)
        self.directory = Path(config.directory)
        self.archive = Path(config.archive) if config.archive else default_archive(config.name)
        if config.error_directory:
            self.errors = Path(config.error_directory)
        else:  # beside the default archive, or inside the one configured (as before)
            self.errors = self.archive / "rejected" if config.archive else default_error_directory(config.name)
        self.processing = default_processing(config.name, config.archive)
        for key, path in (("archive", self.archive), ("error_directory", self.errors), ("processing", self.processing)):
            if path.resolve() == self.directory.resolve():
                raise ValueError(f"{config.name}: {key} must differ from directory")
            if path.is_symlink():
                raise ValueError(f"{config.name}: {key} {path} is a symlink; name the real directory")
        super().__init__(config, what="file drop poll", log=_log, reactor=reactor, run_blocking=run_blocking)
        self.ingest = ingest
        self.lane_of = lane_of
        self.metrics = metrics
        self._counters = metrics.listener(config.name, "file") if metrics is not None else None
        self._seen: dict[Identity, tuple[int, int]] = {}  # by identity: a claimed file keeps its own
        self._empty_since: dict[Identity, float] = {}
        self._unsettled_since: dict[Identity, float] = {}  # claimed files still changing
        self._scan_error: str | None = None
        self._move_error: str | None = None
        self._good_polls = 0
        self._dirs = _Dirs(self.directory, self.archive, self.errors, self.processing)

    def open_dirs(self) -> None:
        """Open (and check) the four directories now, as every poll does: what a bind attempt does, so
        that a missing, replaced or symlinked directory is an unbound inbound, not a silent poller."""
        self._dirs.check()

    def failure(self) -> str | None:
        """Why the last poll could not do its work (the directory gone or replaced, a claimed file that
        cannot be archived or moved aside); None after a poll that could."""
        return self._scan_error or self._move_error

    def proven(self) -> bool:
        """A poll since the last start did its work (no scan or move error)."""
        return self._good_polls > 0 and self.failure() is None

    def _on_start(self) -> None:
        self._good_polls = 0
        self._seen = {}  # stability is re-proven after every (re)start
        self._empty_since = {}
        self._unsettled_since = {}

    def _on_stop(self) -> Any:
        self._dirs.close()
        return super()._on_stop()

    @inlineCallbacks
    def poll(self) -> Any:
        """One pass over the directory; returns how many files were staged and archived."""
        try:
            listing: list[_Entry] = yield self._run(self._scan)
        except OSError as exc:
            reason = str(exc) if isinstance(exc, UnsafePath) else f"{type(exc).__name__} (errno {exc.errno})"
            if reason != self._scan_error:
                log = _log.error if isinstance(exc, UnsafePath) else _log.warn
                log(
                    "cannot poll {directory} for {connection}: {reason}",
                    directory=str(self.directory),
                    connection=self.config.name,
                    reason=reason,
                )
            self._scan_error = reason
            return 0
        self._scan_error = None
        archived = 0
        for entry in [e for e in listing if e.kind != "regular file"]:
            self._count_received(0)  # never read
            yield self._reject(entry, f"not a regular file ({entry.kind}): never read")
        regular = [e for e in listing if e.kind == "regular file"]
        ready = [e for e in regular if self._seen.get(e.identity) == (e.size, e.mtime_ns)]
        self._seen = {e.identity: (e.size, e.mtime_ns) for e in regular}
        now = self._clock.seconds()
        self._empty_since = {
            e.identity: self._empty_since.get(e.identity, now)
            for e in regular
            if e.size == 0 and e.where == "directory"
        }
        ready = [
            e
            for e in ready
            if e.size or e.where != "directory" or now - self._empty_since[e.identity] >= EMPTY_GRACE_SECONDS
        ]
        ready.sort(key=lambda e: (e.where != "processing", e.mtime_ns, e.name))
        unsettled = [e for e in regular if e.where == "processing" and e not in ready]
        self._unsettled_since = {e.identity: self._unsettled_since.get(e.identity, now) for e in unsettled}
        for entry in unsettled:  # still written to after it was claimed: set aside after a bound
            if now - self._unsettled_since[entry.identity] >= UNSETTLED_SECONDS:
                self._count_received(0)
                yield self._reject(
                    entry,
                    f"kept changing in processing for over {UNSETTLED_SECONDS:.0f} s "
                    "(a writer still holds it open): never staged",
                )
                self._unsettled_since.pop(entry.identity, None)
        if any(e.identity in self._unsettled_since for e in unsettled):
            ready = [e for e in ready if e.where == "processing"]  # claimed files drain first
        for entry in ready:
            if not self._running:
                break
            outcome = yield self._take(entry)
            if outcome is None:
                break  # not stored: keep the order, retry everything next poll
            archived += outcome
        if self._move_error is None:
            self._good_polls += 1
        return archived

    @inlineCallbacks
    def _take(self, entry: _Entry) -> Any:
        """Claim, stage and archive one stable file: 1 archived, 0 skipped or rejected, None stop here."""
        name, limit = entry.name, self.config.max_message_bytes
        if entry.where == "directory":
            try:
                claimed = yield self._run(self._claim, name)
            except FileNotFoundError:
                self._seen.pop(entry.identity, None)  # gone: the next scan sees what is there now
                return 0
            except OSError as exc:
                _log.error(
                    "cannot claim {file} for {connection}: {error}",
                    file=printable(name),
                    connection=self.config.name,
                    error=type(exc).__name__,
                )
                return None
            if not claimed:
                return None  # its name is still in processing: that one goes first
            entry = _Entry(name, entry.size, entry.mtime_ns, entry.identity, entry.kind, "processing")
        if entry.size > limit:
            self._count_received(0)  # refused for its size, never read
            yield self._reject(entry, f"message too large: {entry.size} bytes, limit {limit}")
            return 0
        try:
            read: _Read = yield self._run(self._read, entry)
        except _HardLinked as exc:
            self._count_received(0)
            yield self._reject(entry, f"a hard link ({exc.args[0]} names for one file): never read")
            return 0
        except TooLarge:
            self._count_received(0)
            yield self._reject(entry, f"message too large: over {limit} bytes, limit {limit}")
            return 0
        except (FileNotFoundError, NotRegular, _Changed):
            # Not the file listed (replaced just before the claim): it waits in processing to settle.
            self._seen.pop(entry.identity, None)
            return 0
        except OSError as exc:
            _log.error(
                "cannot read {file} for {connection}: {error}",
                file=printable(name),
                connection=self.config.name,
                error=type(exc).__name__,
            )
            return None
        self._count_received(len(read.data))
        try:
            build = partial(
                build_inbound,
                read.data,
                connection=self.config.name,
                charset=self.config.charset,
                lane_of=self.lane_of,
                message_id=read.message_id,
                hl7_only=self.config.hl7_only,
                conformance=self.config.conformance,
            )
            # A large file (an HL7 batch of thousands) is split and checked on a thread, like MLLP's.
            item = (yield self._run(build)) if len(read.data) >= OFFLOAD_BYTES else build()
        except PayloadRejected as exc:
            yield self._reject(entry, str(exc))
            return 0
        try:
            yield self.ingest.submit(item)
        except Exception:
            failure = Failure()
            reason, code = rejection_reason(failure)
            if failure.check(RowRefused):  # the store refuses this file for good: set it aside
                yield self._reject(entry, reason)
                return 0
            self._count_ack(code)
            _log.warn(
                "file {file} on {connection} not stored ({reason}); left in {processing}",
                file=printable(name),
                connection=self.config.name,
                reason=reason,
                processing=str(self.processing),
            )
            return None
        self._count_ack("AA")
        try:
            target = yield self._run(self._archive, entry, read)
        except OSError as exc:
            # Committed but not moved: the next poll re-reads it, stage_inbound skips it, moves it.
            error = f"{type(exc).__name__} (errno {exc.errno})"
            if error != self._move_error:
                _log.error(
                    "staged {file} on {connection} but cannot archive it: {error}; it waits in {processing}",
                    file=printable(name),
                    connection=self.config.name,
                    error=error,
                    processing=str(self.processing),
                )
            self._move_error = error
            return None
        self._move_error = None
        self._seen.pop(entry.identity, None)
        _log.info(
            "staged {file} on {connection} as {message_id}; archived as {target}",
            file=printable(name),
            connection=self.config.name,
            message_id=read.message_id,
            target=printable(target),
        )
        return 1

    @inlineCallbacks
    def _reject(self, entry: _Entry, reason: str) -> Any:
        self._count_ack("AR")
        name = entry.name
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        text = f"{reason}\nconnection: {self.config.name}\nfile: {printable(name)}\nrejected_at: {stamp}\n"
        try:
            target = yield self._run(
                self._move, name, entry.where, "error_directory", text.encode("utf-8", "backslashreplace")
            )
        except OSError as exc:
            error = f"{type(exc).__name__} (errno {exc.errno})"
            if error != self._move_error:
                _log.error(
                    "cannot move rejected {file} on {connection}: {error}",
                    file=printable(name),
                    connection=self.config.name,
                    error=error,
                )
            self._move_error = error
            return
        self._move_error = None
        self._seen.pop(entry.identity, None)
        _log.warn(
            "rejected {file} on {connection}: {reason}; moved to {target}",
            file=printable(name),
            connection=self.config.name,
            reason=reason,
            target=printable(str(self.errors / target)),
        )

    def _count_received(self, size: int) -> None:
        if self._counters is not None:
            self._counters.received(size)

    def _count_ack(self, code: str) -> None:
        if self._counters is not None:
            self._counters.answered(code)

    # -- blocking: run in a worker thread ---------------------------------------------------

    def _scan(self) -> list[_Entry]:
        """Claimed files, then the drop's matching entries (not temp names), each lstat-ed in place
        (never followed); directories left out."""
        self._dirs.check()
        entries = []
        for where in ("processing", "directory"):
            fd = self._dirs.fd(where)
            for name in os.listdir(fd):
                if where == "directory" and (in_progress(name) or not fnmatch.fnmatchcase(name, self.config.pattern)):
                    continue
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    continue
                entries.append(_Entry(name, st.st_size, st.st_mtime_ns, Identity.of(st), kind(st), where))
        return entries

    def _claim(self, name: str) -> bool:
        """Rename `name` from the drop into processing (same name); False while that name is still
        there. Only this poller writes processing (0700, ours), so the check cannot be raced."""
        self._dirs.check()
        processing = self._dirs.fd("processing")
        try:
            os.stat(name, dir_fd=processing, follow_symlinks=False)
            return False
        except FileNotFoundError:
            pass
        os.rename(name, name, src_dir_fd=self._dirs.fd("directory"), dst_dir_fd=processing)
        return True

    def _read(self, entry: _Entry) -> _Read:
        where = self._dirs.fd(entry.where)
        links = os.stat(entry.name, dir_fd=where, follow_symlinks=False).st_nlink
        if links != 1:
            raise _HardLinked(links)
        data, st = read_regular(where, entry.name, expect=entry.identity, limit=self.config.max_message_bytes)
        if st.st_nlink != 1:
            raise _HardLinked(st.st_nlink)
        if (st.st_size, st.st_mtime_ns) != (entry.size, entry.mtime_ns) or len(data) != entry.size:
            raise _Changed(entry.name)
        return _Read(data, file_message_id(self.config.name, entry.name, data))

    def _archive(self, entry: _Entry, read: _Read) -> str:
        """Archive exactly the staged bytes as a new file (under ``<message_id>.hl7`` when the file
        system refuses every name made from the file's own), then drop the claimed file: unlinked
        when it is still what was read, else (a writer kept its descriptor open and wrote on) moved
        to the error directory with a reason. A rename would carry on any later writes."""
        self._dirs.check()
        try:
            target = write_exclusive(self._dirs.fd("archive"), entry.name, read.data)
        except OSError as exc:
            if exc.errno not in _NAME_ERRORS:
                raise
            target = write_exclusive(self._dirs.fd("archive"), f"{read.message_id}.hl7", read.data)
        processing = self._dirs.fd("processing")
        try:
            st = os.stat(entry.name, dir_fd=processing, follow_symlinks=False)
        except FileNotFoundError:
            return target
        if (Identity.of(st), st.st_size, st.st_mtime_ns) == (entry.identity, len(read.data), entry.mtime_ns):
            unlink_quietly(processing, entry.name)
            return target
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        text = (
            f"changed after it was read: {len(read.data)} bytes staged (archived as {printable(target)}), "
            f"{st.st_size} on disk\nconnection: {self.config.name}\nfile: {printable(entry.name)}\n"
            f"rejected_at: {stamp}\n"
        )
        moved = self._move(entry.name, "processing", "error_directory", text.encode("utf-8", "backslashreplace"))
        _log.warn(
            "{file} on {connection} changed after it was read ({staged} bytes staged, {now} on disk); "
            "the staged bytes are archived, the file moved to {target}",
            file=printable(entry.name),
            connection=self.config.name,
            staged=len(read.data),
            now=st.st_size,
            target=printable(str(self.errors / moved)),
        )
        return target

    def _move(self, name: str, source: str, into: str, reason: bytes | None, as_name: str | None = None) -> str:
        """Rename `name` out of `source` into `into`; a `.reason` first when given."""
        self._dirs.check()
        return move_exclusive(
            self._dirs.fd(source),
            name,
            self._dirs.fd(into),
            as_name=as_name,
            companion=(".reason", reason) if reason is not None else None,
        )
