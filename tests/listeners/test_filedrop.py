"""File drop listener: unit tests on a MemoryReactorClock with synchronous file work and a
hand-fired fake ingest, and tests against the real store with file work in a real thread pool."""

from __future__ import annotations

import os
import re
import sqlite3
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks, maybeDeferred
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool
from twisted.trial import unittest as trial

from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from listeners.connections_config import InboundConfig
from listeners.filedrop import EMPTY_GRACE_SECONDS, FileDrop, file_message_id
from listeners.group_commit import Inbound, IngestWriter, NotLeader, RowRefused
from listeners.metrics import Metrics
from tests.listeners.fakes import FakeIngest


def adt(control_id: str) -> bytes:
    return f"MSH|^~\\&|SEND|FAC|RECV|RFAC|20240101||ADT^A01|{control_id}|P|2.5\rPID|1||123||DOE^JANE\r".encode()


class AutoIngest(FakeIngest):
    """Commits at once."""

    def submit(self, item: Inbound) -> Deferred[str]:
        d = super().submit(item)
        d.callback(item.message_id)
        return d


def sync(f: Any, *args: Any) -> Deferred:
    return maybeDeferred(f, *args)


def config(tmp_path: Path, **overrides: Any) -> InboundConfig:
    values: dict[str, Any] = {
        "name": "drop",
        "kind": "file",
        "directory": str(tmp_path / "in"),
        "archive": str(tmp_path / "archive"),
        "error_directory": str(tmp_path / "rejected"),
        "pattern": "*.hl7",
        "poll_seconds": 5.0,
        "max_message_bytes": 256,
    }
    values.update(overrides)
    (tmp_path / "in").mkdir(exist_ok=True)
    return InboundConfig(**values)


def drop(tmp_path: Path, name: str, data: bytes, *, mtime: int | None = None) -> Path:
    path = tmp_path / "in" / name
    path.write_bytes(data)
    if mtime is not None:
        os.utime(path, ns=(mtime, mtime))
    return path


class Harness:
    def __init__(self, tmp_path: Path, ingest: FakeIngest | None = None, **overrides: Any) -> None:
        self.clock = MemoryReactorClock()
        self.ingest = ingest or FakeIngest()
        lane_of = overrides.pop("lane_of", None)
        self.listener = FileDrop(
            self.ingest, config(tmp_path, **overrides), lane_of=lane_of, reactor=self.clock, run_blocking=sync
        )

    def start(self) -> None:
        self.listener.start()
        self.clock.advance(0)  # first poll: files are seen, none is stable yet

    def next_poll(self) -> None:
        self.clock.advance(self.listener.config.poll_seconds)


def listing(path: Path) -> list[str]:
    """The names in `path`, but the connection's own processing directory inside the archive."""
    return sorted(p.name for p in path.iterdir() if p.name != ".processing-drop") if path.exists() else []


def processing(tmp_path: Path) -> Path:
    """Where the harness's connection keeps claimed files: inside its configured archive, private."""
    return tmp_path / "archive" / ".processing-drop"


UNIQUE = r"\.\d{8}T\d{6}Z-[0-9a-f]{8}"


# -- stability and order -----------------------------------------------------------------------


def test_a_new_file_is_taken_only_once_it_is_unchanged_across_two_polls(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "a.hl7", adt("A"))
    h.start()
    assert h.ingest.calls == []
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["A"]
    assert listing(tmp_path / "in") == [] and listing(tmp_path / "archive") == ["a.hl7"]


def test_a_file_still_being_written_is_not_taken_early(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    path = drop(tmp_path, "a.hl7", adt("A")[:20])
    h.start()
    with open(path, "ab") as f:
        f.write(adt("A")[20:40])
    h.next_poll()
    assert h.ingest.calls == []
    with open(path, "ab") as f:
        f.write(adt("A")[40:])
    h.next_poll()
    assert h.ingest.calls == []
    h.next_poll()
    [(item, _)] = h.ingest.calls
    assert item.payload == adt("A").decode()


def test_files_go_oldest_mtime_first_and_only_matching_regular_files(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "b.hl7", adt("B"), mtime=2_000_000_000_000_000_000)
    drop(tmp_path, "c.hl7", adt("C"), mtime=3_000_000_000_000_000_000)
    drop(tmp_path, "a.hl7", adt("A"), mtime=4_000_000_000_000_000_000)
    drop(tmp_path, "ignored.tmp", adt("X"))
    (tmp_path / "in" / "dir.hl7").mkdir()
    h.start()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["B", "C", "A"]
    assert listing(tmp_path / "in") == ["dir.hl7", "ignored.tmp"]


def test_nothing_is_polled_before_start_or_after_stop(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "a.hl7", adt("A"))
    for _ in range(3):
        h.next_poll()
    assert h.ingest.calls == [] and not h.clock.getDelayedCalls()
    h.start()
    done = h.listener.stop()
    assert done.called
    for _ in range(3):
        h.next_poll()
    assert h.ingest.calls == [] and not h.clock.getDelayedCalls()


# -- commit, then move -------------------------------------------------------------------------


def test_file_is_archived_only_after_the_commit_fires(tmp_path: Path) -> None:
    h = Harness(tmp_path, lane_of=lambda text: "L-" + text[:3])
    drop(tmp_path, "a.hl7", adt("A"))
    h.start()
    h.next_poll()
    [(item, _)] = h.ingest.calls
    assert (item.connection, item.control_id, item.lane_key) == ("drop", "A", "L-MSH")
    assert item.message_id == file_message_id("drop", "a.hl7", adt("A"))
    assert listing(tmp_path / "in") == [] and listing(processing(tmp_path)) == ["a.hl7"]  # claimed first
    assert listing(tmp_path / "archive") == []
    h.ingest.fire(0)
    assert listing(processing(tmp_path)) == [] and listing(tmp_path / "archive") == ["a.hl7"]


def test_failed_submit_leaves_the_file_and_stops_the_poll_then_retries(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    drop(tmp_path, "a.hl7", adt("A"), mtime=1_000_000_000_000_000_000)
    drop(tmp_path, "b.hl7", adt("B"), mtime=2_000_000_000_000_000_000)
    h.start()
    h.next_poll()
    assert len(h.ingest.calls) == 1
    h.ingest.calls[0][1].errback(NotLeader("no lease"))
    assert len(h.ingest.calls) == 1  # b.hl7 must not overtake a.hl7
    assert listing(tmp_path / "in") == ["b.hl7"] and listing(processing(tmp_path)) == ["a.hl7"]
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["A", "A"]
    assert h.ingest.calls[1][0].message_id == h.ingest.calls[0][0].message_id
    h.ingest.fire(1)
    h.ingest.fire(2)
    assert listing(tmp_path / "archive") == ["a.hl7", "b.hl7"]


def test_a_file_the_store_refuses_goes_to_rejected_and_the_next_file_follows(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    drop(tmp_path, "a.hl7", adt("A"), mtime=1_000_000_000_000_000_000)
    drop(tmp_path, "b.hl7", adt("B"), mtime=2_000_000_000_000_000_000)
    h.start()
    h.next_poll()
    h.ingest.calls[0][1].errback(RowRefused("refused by the store (CheckViolation); not stored"))
    assert [item.control_id for item, _ in h.ingest.calls] == ["A", "B"]  # a refused file blocks nothing
    h.ingest.fire(1)
    rejected = tmp_path / "rejected"
    assert listing(rejected) == ["a.hl7", "a.hl7.reason"]
    assert (rejected / "a.hl7.reason").read_text().startswith("refused by the store (CheckViolation)")
    assert listing(tmp_path / "archive") == ["b.hl7"]


def test_stop_waits_for_the_file_in_hand_and_takes_no_further_file(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    drop(tmp_path, "a.hl7", adt("A"), mtime=1_000_000_000_000_000_000)
    drop(tmp_path, "b.hl7", adt("B"), mtime=2_000_000_000_000_000_000)
    h.start()
    h.next_poll()
    stopped = h.listener.stop()
    assert not stopped.called
    h.ingest.fire(0)
    assert stopped.called
    assert len(h.ingest.calls) == 1 and listing(tmp_path / "in") == ["b.hl7"]
    assert not h.clock.getDelayedCalls()


def test_a_restart_while_a_file_is_in_hand_does_not_start_a_second_poll(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    drop(tmp_path, "a.hl7", adt("A"))
    h.start()
    h.next_poll()
    stopped = h.listener.stop()
    h.listener.start()
    assert not h.clock.getDelayedCalls()  # the running poll reschedules when it ends
    h.ingest.fire(0)
    assert stopped.called and len(h.clock.getDelayedCalls()) == 1


def test_a_name_clash_in_the_archive_gets_a_suffix(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "a.hl7").write_bytes(b"older")
    drop(tmp_path, "a.hl7", adt("A"))
    h.start()
    h.next_poll()
    [new] = [n for n in listing(tmp_path / "archive") if n != "a.hl7"]
    assert re.fullmatch("a" + UNIQUE + r"\.hl7", new) and (tmp_path / "archive" / new).read_bytes() == adt("A")


def test_message_id_depends_on_connection_name_and_content() -> None:
    base = file_message_id("drop", "a.hl7", b"x")
    assert len(base) == 32 and base == file_message_id("drop", "a.hl7", b"x")
    assert (
        len(
            {
                base,
                file_message_id("drop2", "a.hl7", b"x"),
                file_message_id("drop", "b.hl7", b"x"),
                file_message_id("drop", "a.hl7", b"y"),
            }
        )
        == 4
    )


# -- rejects -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"x" * 300, "message too large: 300 bytes, limit 256"),
        (b"\xff\xfe\x00junk", "undecodable: byte offset 0 is not valid utf-8"),
        (b"", "empty message"),
    ],
)
def test_unstageable_files_go_to_rejected_with_a_reason(tmp_path: Path, data: bytes, reason: str) -> None:
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "bad.hl7", data)
    drop(tmp_path, "good.hl7", adt("G"))
    h.start()
    h.next_poll()
    if not data:  # an empty file may be a writer that has not written yet: it waits
        assert listing(tmp_path / "in") == ["bad.hl7"]
        h.clock.advance(EMPTY_GRACE_SECONDS)
    assert [item.control_id for item, _ in h.ingest.calls] == ["G"]
    rejected = tmp_path / "rejected"
    assert listing(rejected) == ["bad.hl7", "bad.hl7.reason"]
    assert (rejected / "bad.hl7").read_bytes() == data
    text = (rejected / "bad.hl7.reason").read_text()
    assert text.startswith(reason + "\n") and "connection: drop" in text


def test_the_archive_must_not_be_the_polled_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="archive"):
        FileDrop(
            FakeIngest(),
            config(tmp_path, archive=str(tmp_path / "in")),
            reactor=MemoryReactorClock(),
            run_blocking=sync,
        )


def test_a_missing_directory_is_reported_and_polling_goes_on(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest(), directory=str(tmp_path / "missing"))
    h.start()
    h.next_poll()
    assert h.listener.running and h.clock.getDelayedCalls()


# -- against the real store --------------------------------------------------------------------


def rows(path: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as db:
        return db.execute(
            "SELECT message_id, control_id, connection, payload FROM inbound_messages ORDER BY id"
        ).fetchall()


class _RealStore(trial.TestCase):
    """The real IngestWriter and SQLite store; file work in a real thread pool."""

    @pytest.fixture(autouse=True)
    def _fixtures(self, sqlite_config_fresh: StoreConfig, tmp_path: Path) -> None:
        self.store_config = sqlite_config_fresh
        self.tmp = tmp_path

    def _listener(self, *, leader: bool = True, wrap: Any = None, **overrides: Any) -> tuple[FileDrop, IngestWriter]:
        store = Store(self.store_config)
        self.addCleanup(store.close)
        epoch = acquire_permanent(store, node_id="n") if leader else None
        writer = IngestWriter(store, node_id="n", epoch=lambda: epoch, metrics=Metrics(), reactor=reactor)
        writer.start()
        self.addCleanup(writer.stop)
        pool = ThreadPool(minthreads=0, maxthreads=2, name="filedrop-test")
        pool.start()
        self.addCleanup(pool.stop)
        listener = FileDrop(
            wrap(writer) if wrap else writer,
            config(self.tmp, **overrides),
            reactor=MemoryReactorClock(),
            run_blocking=partial(deferToThreadPool, reactor, pool),
        )
        listener.start()  # the fake clock never fires: the test drives each poll itself
        self.addCleanup(listener.stop)
        return listener, writer


class FileDropStoreTests(_RealStore):
    """Files become rows, once, only after the commit."""

    @inlineCallbacks
    def test_files_become_rows_and_are_archived(self) -> Any:
        listener, _ = self._listener()
        drop(self.tmp, "a.hl7", adt("A"), mtime=1_000_000_000_000_000_000)
        drop(self.tmp, "b.hl7", b"plain text file", mtime=2_000_000_000_000_000_000)
        assert (yield listener.poll()) == 0
        assert (yield listener.poll()) == 2
        assert rows(self.store_config.path) == [
            (file_message_id("drop", "a.hl7", adt("A")), "A", "drop", adt("A").decode()),
            (file_message_id("drop", "b.hl7", b"plain text file"), None, "drop", "plain text file"),
        ]
        assert listing(self.tmp / "in") == [] and listing(self.tmp / "archive") == ["a.hl7", "b.hl7"]

    @inlineCallbacks
    def test_a_file_committed_but_not_moved_before_a_crash_is_staged_once_and_archived(self) -> Any:
        listener, writer = self._listener()
        drop(self.tmp, "a.hl7", adt("A"))
        message_id = file_message_id("drop", "a.hl7", adt("A"))
        # The previous run committed the file, then crashed before moving it.
        yield writer.submit(
            Inbound(connection="drop", payload=adt("A").decode(), control_id="A", message_id=message_id)
        )
        yield listener.poll()
        assert (yield listener.poll()) == 1
        assert [r[0] for r in rows(self.store_config.path)] == [message_id]
        assert listing(self.tmp / "in") == [] and listing(self.tmp / "archive") == ["a.hl7"]

    @inlineCallbacks
    def test_a_failing_ingest_leaves_the_file_in_place(self) -> Any:
        listener, _ = self._listener(leader=False)
        drop(self.tmp, "a.hl7", adt("A"))
        yield listener.poll()
        assert (yield listener.poll()) == 0
        assert rows(self.store_config.path) == []
        assert listing(processing(self.tmp)) == ["a.hl7"] and listing(self.tmp / "archive") == []

    @inlineCallbacks
    def test_rejected_files_stage_nothing(self) -> Any:
        listener, _ = self._listener()
        drop(self.tmp, "big.hl7", b"x" * 1000)
        drop(self.tmp, "bin.hl7", b"\xc3\x28 not utf-8")
        yield listener.poll()
        yield listener.poll()
        assert rows(self.store_config.path) == []
        assert listing(self.tmp / "rejected") == ["big.hl7", "big.hl7.reason", "bin.hl7", "bin.hl7.reason"]


# -- by descriptor, never by following a link (issue 23) ----------------------------------------


def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secrets.txt"
    path.write_bytes(adt("SECRET"))  # valid HL7, so only the link check stands between it and the store
    return path


def test_a_symlink_in_the_drop_directory_is_never_read_and_is_moved_aside_as_a_link(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    target = secret(tmp_path)
    (tmp_path / "in" / "leak.hl7").symlink_to(target)
    drop(tmp_path, "good.hl7", adt("G"))
    h.start()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["G"]
    rejected = tmp_path / "rejected"
    assert listing(rejected) == ["leak.hl7", "leak.hl7.reason"]
    assert (rejected / "leak.hl7").is_symlink() and os.readlink(rejected / "leak.hl7") == str(target)
    assert (rejected / "leak.hl7.reason").read_text().startswith("not a regular file (symlink): never read\n")
    assert target.read_bytes() == adt("SECRET")


def test_a_dangling_symlink_in_rejected_is_not_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    h = Harness(tmp_path, AutoIngest())
    rejected = tmp_path / "rejected"
    rejected.mkdir()
    (rejected / "bad.hl7.reason").symlink_to(outside / "planted.reason")
    (rejected / "bad.1.hl7").symlink_to(outside / "planted.hl7")
    drop(tmp_path, "bad.hl7", b"\xff not utf-8")
    h.start()
    h.next_poll()
    assert listing(outside) == []  # nothing written outside, through either link
    [moved] = [n for n in listing(rejected) if not n.endswith(".reason") and n != "bad.1.hl7"]
    assert re.fullmatch("bad" + UNIQUE + r"\.hl7", moved)
    assert sorted(listing(rejected)) == sorted(["bad.1.hl7", moved, f"{moved}.reason", "bad.hl7.reason"])
    assert (rejected / f"{moved}.reason").read_text().startswith("undecodable")
    assert oct(os.stat(rejected / f"{moved}.reason").st_mode & 0o777) == "0o600"
    assert (rejected / "bad.hl7.reason").is_symlink() and (rejected / "bad.1.hl7").is_symlink()


def test_an_archive_replaced_by_a_symlink_stops_the_connection_taking_files(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "archive").mkdir()
    h = Harness(tmp_path, AutoIngest())
    h.start()  # the archive is opened as a directory descriptor
    (tmp_path / "archive").rename(tmp_path / "archive.old")
    (tmp_path / "archive").symlink_to(elsewhere)
    drop(tmp_path, "a.hl7", adt("A"))
    for _ in range(3):
        h.next_poll()
    assert h.ingest.calls == [] and listing(elsewhere) == [] and listing(tmp_path / "archive.old") == []
    assert listing(tmp_path / "in") == ["a.hl7"]
    assert h.listener.running and "archive" in (h.listener._scan_error or "")
    (tmp_path / "archive").unlink()  # a real directory again: files flow
    (tmp_path / "archive").mkdir()
    h.next_poll()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["A"] and listing(tmp_path / "archive") == ["a.hl7"]


@pytest.mark.parametrize("key", ["archive", "error_directory"])
def test_an_archive_or_error_directory_that_is_a_symlink_refuses_to_start(tmp_path: Path, key: str) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match=f"{key} .* is a symlink"):
        FileDrop(
            FakeIngest(),
            config(tmp_path, **{key: str(tmp_path / "link")}),
            reactor=MemoryReactorClock(),
            run_blocking=sync,
        )


def test_archive_and_rejected_default_outside_the_drop_tree_mode_0700(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGELINE_VAR", str(tmp_path / "var"))
    h = Harness(tmp_path, AutoIngest(), archive="", error_directory="")
    drop(tmp_path, "a.hl7", adt("A"))
    drop(tmp_path, "b.hl7", b"\xff")
    h.start()
    h.next_poll()
    base = tmp_path / "var" / "filedrop" / "drop"
    assert listing(base / "archive") == ["a.hl7"]
    assert listing(base / "rejected") == ["b.hl7", "b.hl7.reason"]
    assert listing(base / "archive" / ".processing-drop") == []
    assert {oct(os.stat(base / d).st_mode & 0o777) for d in ("archive", "rejected", "archive/.processing-drop")} == {
        "0o700"
    }
    assert listing(tmp_path / "in") == []


def test_a_fifo_or_socket_in_the_drop_directory_is_set_aside_unread(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    os.mkfifo(tmp_path / "in" / "pipe.hl7")
    drop(tmp_path, "good.hl7", adt("G"))
    h.start()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["G"]
    assert listing(tmp_path / "rejected") == ["pipe.hl7", "pipe.hl7.reason"]
    assert (tmp_path / "rejected" / "pipe.hl7.reason").read_text().startswith("not a regular file (fifo)")


class FileDropLinkStoreTests(_RealStore):
    """Issue 23 against the real store and a real thread pool: what a link points at never becomes a row."""

    timeout = 20  # a poll blocked on a fifo would hang here

    @inlineCallbacks
    def test_a_symlink_to_a_secret_stages_nothing_and_a_fifo_blocks_no_poll(self) -> Any:
        listener, _ = self._listener()
        target = secret(self.tmp)
        (self.tmp / "in" / "leak.hl7").symlink_to(target)
        os.mkfifo(self.tmp / "in" / "pipe.hl7")
        (self.tmp / "in" / "pipe-link.hl7").symlink_to(self.tmp / "in" / "pipe.hl7")
        drop(self.tmp, "a.hl7", adt("A"))
        yield listener.poll()
        assert (yield listener.poll()) == 1
        assert rows(self.store_config.path) == [
            (file_message_id("drop", "a.hl7", adt("A")), "A", "drop", adt("A").decode())
        ]
        assert listing(self.tmp / "rejected") == [
            "leak.hl7",
            "leak.hl7.reason",
            "pipe-link.hl7",
            "pipe-link.hl7.reason",
            "pipe.hl7",
            "pipe.hl7.reason",
        ]
        assert listing(self.tmp / "in") == []

    @inlineCallbacks
    def test_an_archive_swapped_for_a_symlink_receives_nothing_through_it(self) -> Any:
        (self.tmp / "archive").mkdir()
        listener, _ = self._listener()
        yield listener.poll()  # directories opened
        elsewhere = self.tmp / "elsewhere"
        elsewhere.mkdir()
        (self.tmp / "archive").rename(self.tmp / "archive.old")
        (self.tmp / "archive").symlink_to(elsewhere)
        drop(self.tmp, "a.hl7", adt("A"))
        yield listener.poll()
        assert (yield listener.poll()) == 0
        assert rows(self.store_config.path) == [] and listing(elsewhere) == []
        assert listing(self.tmp / "in") == ["a.hl7"]


def test_a_hard_link_to_another_file_is_set_aside_unread(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    target = secret(tmp_path)
    os.link(target, tmp_path / "in" / "linked.hl7")
    h.start()
    h.next_poll()
    assert h.ingest.calls == []
    assert listing(tmp_path / "rejected") == ["linked.hl7", "linked.hl7.reason"]
    assert (
        (tmp_path / "rejected" / "linked.hl7.reason")
        .read_text()
        .startswith("a hard link (2 names for one file): never read\n")
    )
    assert target.read_bytes() == adt("SECRET")


def test_the_directory_descriptors_are_closed_on_stop(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "a.hl7", adt("A"))
    h.start()
    h.next_poll()
    assert len(os.listdir("/proc/self/fd")) == before + 4  # drop, processing, archive, rejected
    assert h.listener.stop().called
    assert len(os.listdir("/proc/self/fd")) == before
    h.listener.start()  # a new lease: opened again
    h.next_poll()
    assert len(os.listdir("/proc/self/fd")) == before + 4
    h.listener.stop()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_large_batch_file_is_split_on_a_thread_not_the_reactor(tmp_path: Path) -> None:
    """A 4 MB batch file costs a second of Python to split; that second must not be the reactor's."""
    on_thread: list[str] = []

    def recording(f: Any, *args: Any) -> Deferred:
        on_thread.append(getattr(getattr(f, "func", f), "__name__", repr(f)))
        return maybeDeferred(f, *args)

    messages = b"".join(adt(f"B{i}") for i in range(2_000))
    batch = b"BHS|^~\\&|LAB\r" + messages + b"BTS|2000\r"
    small = adt("S")
    ingest = AutoIngest()
    clock = MemoryReactorClock()
    listener = FileDrop(
        ingest, config(tmp_path, max_message_bytes=len(batch) + 1), reactor=clock, run_blocking=recording
    )
    drop(tmp_path, "a-big.hl7", batch)
    drop(tmp_path, "b-small.hl7", small)
    listener.start()
    clock.advance(0)
    clock.advance(listener.config.poll_seconds)
    assert len(batch) >= 64 * 1024 > len(small)
    assert on_thread.count("build_inbound") == 1  # the big file's; the small one is cheaper in place
    assert len(ingest.calls) == 2


# -- red team, issue 23 ("Safe edges"), items 1, 2, 6, 8, 12, 13 --------------------------------


class _ReplaceDuringCommit:
    """The real writer, but while the first file's commit is in flight a writer renames a new file
    over the same name in the drop (the documented way to deliver)."""

    def __init__(self, writer: IngestWriter, action: Any) -> None:
        self.writer, self.action = writer, action

    def submit(self, item: Inbound) -> Deferred[str]:
        d = self.writer.submit(item)
        action, self.action = self.action, None
        if action is not None:
            action()
        return d


class FileDropRedTeamStoreTests(_RealStore):
    @inlineCallbacks
    def test_a_file_replaced_under_the_same_name_during_the_commit_is_staged_too(self) -> Any:
        """Red team 1: RACE-B renamed over victim.hl7 while RACE-A committed was archived unstaged."""

        def replace() -> None:
            (self.tmp / "in" / ".victim.tmp").write_bytes(adt("RACE-B"))
            os.rename(self.tmp / "in" / ".victim.tmp", self.tmp / "in" / "victim.hl7")

        listener, _ = self._listener(wrap=lambda writer: _ReplaceDuringCommit(writer, replace))
        drop(self.tmp, "victim.hl7", adt("RACE-A"))
        yield listener.poll()
        assert (yield listener.poll()) == 1
        assert [r[1] for r in rows(self.store_config.path)] == ["RACE-A"]
        assert listing(self.tmp / "in") == ["victim.hl7"]  # RACE-B: still in the drop, not archived unseen
        yield listener.poll()
        assert (yield listener.poll()) == 1
        assert [r[1] for r in rows(self.store_config.path)] == ["RACE-A", "RACE-B"]
        archived = {(self.tmp / "archive" / n).read_bytes() for n in listing(self.tmp / "archive")}
        assert archived == {adt("RACE-A"), adt("RACE-B")} and listing(self.tmp / "in") == []

    @inlineCallbacks
    def test_a_file_left_in_processing_by_a_crash_is_taken_first_and_staged_once(self) -> Any:
        listener, writer = self._listener()
        message_id = file_message_id("drop", "a.hl7", adt("A"))
        # The previous run claimed a.hl7 and committed it, then crashed before archiving it.
        yield writer.submit(
            Inbound(connection="drop", payload=adt("A").decode(), control_id="A", message_id=message_id)
        )
        processing(self.tmp).mkdir(mode=0o700, parents=True)
        (processing(self.tmp) / "a.hl7").write_bytes(adt("A"))
        os.utime(processing(self.tmp) / "a.hl7", ns=(2_000_000_000_000_000_000,) * 2)
        drop(self.tmp, "b.hl7", adt("B"), mtime=1_000_000_000_000_000_000)  # older, but not claimed yet
        yield listener.poll()
        assert (yield listener.poll()) == 2
        assert [r[1] for r in rows(self.store_config.path)] == ["A", "B"]  # A once, and first
        assert listing(processing(self.tmp)) == [] and listing(self.tmp / "archive") == ["a.hl7", "b.hl7"]

    @inlineCallbacks
    def test_a_partial_dot_temp_file_is_never_staged_and_the_renamed_file_is_whole(self) -> Any:
        """Red team 8: `.adt.hl7.Xa12Bc` matched `*` and was staged truncated; the rename then failed."""
        listener, _ = self._listener(pattern="*")
        partial_body = adt("PARTIAL")[:-10]
        for name in (".adt.hl7.Xa12Bc", "adt.hl7.part", "adt.hl7.filepart", "adt.hl7.tmp", "adt.hl7~"):
            drop(self.tmp, name, partial_body)
        for _ in range(3):
            yield listener.poll()
        assert rows(self.store_config.path) == [] and listing(self.tmp / "rejected") == []
        (self.tmp / "in" / ".adt.hl7.Xa12Bc").write_bytes(adt("PARTIAL"))
        os.rename(self.tmp / "in" / ".adt.hl7.Xa12Bc", self.tmp / "in" / "adt.hl7")
        yield listener.poll()
        yield listener.poll()
        assert [r[3] for r in rows(self.store_config.path)] == [adt("PARTIAL").decode()]


def test_temp_names_are_skipped_whatever_the_pattern_says(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest(), pattern="*")
    for name in (
        ".adt.hl7.Xa12Bc",
        ".hidden.hl7",
        "a.hl7.part",
        "a.hl7.PART",
        "a.filepart",
        "a.partial",
        "a.hl7.tmp",
        "a.hl7~",
    ):
        drop(tmp_path, name, adt("PARTIAL"))
    drop(tmp_path, "whole.hl7", adt("W"))
    h.start()
    for _ in range(3):
        h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["W"]
    assert len(listing(tmp_path / "in")) == 8 and listing(tmp_path / "rejected") == []


def test_an_empty_file_waits_for_its_writer_and_is_staged_whole(tmp_path: Path) -> None:
    """Red team 8: `msg.py X > drop/x.hl7` (the shell creates, python writes later) was rejected empty."""
    h = Harness(tmp_path, AutoIngest())
    path = drop(tmp_path, "x.hl7", b"")
    h.start()
    for _ in range(5):
        h.next_poll()
    assert h.ingest.calls == [] and listing(tmp_path / "in") == ["x.hl7"] and listing(tmp_path / "rejected") == []
    path.write_bytes(adt("X"))
    h.next_poll()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["X"]


def test_an_empty_file_is_rejected_only_after_the_grace_and_blocks_no_other(tmp_path: Path) -> None:
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "empty.hl7", b"", mtime=1_000_000_000_000_000_000)
    drop(tmp_path, "later.hl7", adt("L"), mtime=2_000_000_000_000_000_000)
    h.start()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["L"] and listing(tmp_path / "in") == ["empty.hl7"]
    h.clock.advance(EMPTY_GRACE_SECONDS - h.listener.config.poll_seconds * 2)
    assert listing(tmp_path / "in") == ["empty.hl7"]
    h.clock.advance(h.listener.config.poll_seconds * 2)
    assert listing(tmp_path / "rejected") == ["empty.hl7", "empty.hl7.reason"]


def test_a_255_byte_name_dropped_twice_is_archived_and_the_next_file_follows(tmp_path: Path) -> None:
    """Red team 2a: `stem.1.hl7` was over NAME_MAX; ENAMETOOLONG at every poll, after1.hl7 never taken."""
    h = Harness(tmp_path, AutoIngest(), max_message_bytes=4096)
    long_name = "L" * 251 + ".hl7"
    drop(tmp_path, long_name, adt("FIRST"))
    h.start()
    h.next_poll()
    drop(tmp_path, long_name, adt("SECOND"), mtime=1_000_000_000_000_000_000)
    drop(tmp_path, "after1.hl7", adt("AFTER"), mtime=2_000_000_000_000_000_000)
    h.next_poll()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["FIRST", "SECOND", "AFTER"]
    assert listing(tmp_path / "in") == [] and len(listing(tmp_path / "archive")) == 3
    assert {(tmp_path / "archive" / n).read_bytes() for n in listing(tmp_path / "archive")} == {
        adt("FIRST"),
        adt("SECOND"),
        adt("AFTER"),
    }


def test_a_feed_that_always_writes_one_name_never_runs_out_of_archive_names(tmp_path: Path) -> None:
    """Red team 2b: ADT.hl7 and ADT.1.hl7 .. ADT.9999.hl7 in the archive stalled the connection."""
    (tmp_path / "archive").mkdir()
    for n in range(10_000):
        (tmp_path / "archive" / (f"ADT.{n}.hl7" if n else "ADT.hl7")).touch()
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "ADT.hl7", adt("NEW"), mtime=1_000_000_000_000_000_000)
    drop(tmp_path, "next.hl7", adt("NEXT"), mtime=2_000_000_000_000_000_000)
    h.start()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["NEW", "NEXT"]
    assert listing(tmp_path / "in") == [] and len(listing(tmp_path / "archive")) == 10_002


def test_an_archive_that_refuses_every_derived_name_gets_the_message_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However a name is refused (ENAMETOOLONG on an odd file system), a staged file never stalls."""
    import errno

    import listeners.filedrop as filedrop

    real = filedrop.write_exclusive

    def picky(dst: int, name: str, data: bytes, **kw: Any) -> str:
        if not name.endswith(".hl7") or len(name) != 36:  # only <message_id>.hl7 is accepted
            raise OSError(errno.ENAMETOOLONG, "File name too long")
        return real(dst, name, data, **kw)

    monkeypatch.setattr(filedrop, "write_exclusive", picky)
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "a.hl7", adt("A"), mtime=1_000_000_000_000_000_000)
    drop(tmp_path, "b.hl7", adt("B"), mtime=2_000_000_000_000_000_000)
    h.start()
    h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["A", "B"]
    assert listing(tmp_path / "archive") == sorted(
        f"{file_message_id('drop', n, adt(c))}.hl7" for n, c in (("a.hl7", "A"), ("b.hl7", "B"))
    )


def test_a_rejected_file_with_a_250_byte_name_leaves_the_drop(tmp_path: Path) -> None:
    """Red team 12: `<name>.reason` was over NAME_MAX: `cannot move rejected ...: OSError` every poll."""
    h = Harness(tmp_path, AutoIngest())
    name = "S" * 250 + ".hl7"
    (tmp_path / "in" / name).symlink_to(secret(tmp_path))
    drop(tmp_path, "good.hl7", adt("G"))
    h.start()
    h.next_poll()
    assert listing(tmp_path / "in") == [] and [item.control_id for item, _ in h.ingest.calls] == ["G"]
    [moved, reason] = listing(tmp_path / "rejected")
    assert reason == moved + ".reason" and moved.endswith(".hl7") and (tmp_path / "rejected" / moved).is_symlink()
    assert f"file: {name}\n" in (tmp_path / "rejected" / reason).read_text()  # the whole name, on record


def test_newlines_and_escapes_in_a_name_are_escaped_in_the_reason_and_the_log(tmp_path: Path) -> None:
    """Red team 13: a name with newlines forged `connection:`/`rejected_at:` lines; ESC reached the log raw."""
    from twisted.logger import capturedLogs, formatEvent

    h = Harness(tmp_path, AutoIngest())
    evil = "evil.hl7\nconnection: other\nfile: innocent.hl7\nrejected_at: 1999-01-01T00:00:00Z\n.hl7"
    (tmp_path / "in" / evil).symlink_to(secret(tmp_path))
    drop(tmp_path, "esc\x1b[31mred.hl7", adt("E"))
    with capturedLogs() as events:
        h.start()
        h.next_poll()
    [reason] = [n for n in listing(tmp_path / "rejected") if n.endswith(".reason")]
    lines = (tmp_path / "rejected" / reason).read_text().splitlines()
    assert lines[:3] == [
        "not a regular file (symlink): never read",
        "connection: drop",
        "file: evil.hl7\\x0aconnection: other\\x0afile: innocent.hl7\\x0arejected_at: 1999-01-01T00:00:00Z\\x0a.hl7",
    ]
    assert len(lines) == 4 and lines[3].startswith("rejected_at: 20")
    text = [formatEvent(e) for e in events]
    assert any("esc\\x1b[31mred.hl7" in t for t in text) and any("evil.hl7\\x0aconnection" in t for t in text)
    assert not any("\x1b" in t or "\n" in t for t in text)


def test_a_symlink_above_the_archive_is_never_written_through(tmp_path: Path) -> None:
    """Red team 6: `drop/sub` swapped for a link; the next poll created target/archive through it."""
    target = tmp_path / "target"
    target.mkdir()
    h = Harness(
        tmp_path,
        AutoIngest(),
        archive=str(tmp_path / "in" / "sub" / "archive"),
        error_directory=str(tmp_path / "rejected"),
    )
    drop(tmp_path, "one.hl7", adt("ONE"))
    h.start()
    h.next_poll()
    assert listing(tmp_path / "in" / "sub" / "archive") == ["one.hl7"]
    (tmp_path / "in" / "sub").rename(tmp_path / "in" / "sub.old")
    (tmp_path / "in" / "sub").symlink_to(target)
    drop(tmp_path, "authorized_keys.hl7", adt("TWO"))
    for _ in range(4):
        h.next_poll()
    assert listing(target) == []  # nothing created or moved through the link
    assert [item.control_id for item, _ in h.ingest.calls] == ["ONE"]
    assert "authorized_keys.hl7" in listing(tmp_path / "in")


# -- second red-team pass (issue 23): processing is ours; archived is exactly what was staged ----


def test_a_writer_holding_the_file_open_cannot_add_to_the_archive(tmp_path: Path) -> None:
    """L2: the partner's fd stayed open and kept appending after the file was staged; the archive
    held 772 bytes for 52 staged. The archive is now a fresh copy of the staged bytes."""
    h = Harness(tmp_path, AutoIngest())
    path = drop(tmp_path, "hold.hl7", adt("H"))
    with open(path, "ab") as writer:
        h.start()
        h.next_poll()
        [(item, _)] = h.ingest.calls
        writer.write(b"NTE|1||appended after staging\r" * 20)
        writer.flush()
    archived = tmp_path / "archive" / "hold.hl7"
    assert archived.read_bytes() == adt("H") == item.payload.encode()
    assert oct(archived.stat().st_mode & 0o777) == "0o600"
    assert listing(processing(tmp_path)) == []


def test_a_file_that_grows_between_read_and_commit_is_archived_as_staged_and_set_aside(tmp_path: Path) -> None:
    """L2: grown after the read, before the archive: the archive gets the staged bytes, the grown
    original goes to rejected with a reason that says so."""
    h = Harness(tmp_path)
    drop(tmp_path, "grow.hl7", adt("G"))
    h.start()
    h.next_poll()
    [(_item, _)] = h.ingest.calls
    with open(processing(tmp_path) / "grow.hl7", "ab") as writer:  # the partner's fd, still open
        writer.write(b"NTE|1||late\r")
    h.ingest.fire(0)
    staged = len(adt("G"))
    assert (tmp_path / "archive" / "grow.hl7").read_bytes() == adt("G")
    assert listing(tmp_path / "rejected") == ["grow.hl7", "grow.hl7.reason"]
    assert (tmp_path / "rejected" / "grow.hl7").read_bytes() == adt("G") + b"NTE|1||late\r"
    reason = (tmp_path / "rejected" / "grow.hl7.reason").read_text().splitlines()[0]
    assert reason.startswith(f"changed after it was read: {staged} bytes staged")
    assert reason.endswith(f"{staged + 12} on disk")
    assert listing(processing(tmp_path)) == []


def test_an_existing_processing_directory_of_ours_is_tightened_to_0700_with_a_warning(tmp_path: Path) -> None:
    """M4: a processing directory left at 0777 let a partner write into claimed files."""
    from twisted.logger import capturedLogs, formatEvent

    processing(tmp_path).mkdir(parents=True)
    os.chmod(processing(tmp_path), 0o777)  # noqa: S103 - the loose mode under test
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "a.hl7", adt("A"))
    with capturedLogs() as events:
        h.start()
        h.next_poll()
    assert oct(processing(tmp_path).stat().st_mode & 0o777) == "0o700"
    assert any("was mode 0777; tightened to 0700" in formatEvent(e) for e in events)
    assert listing(tmp_path / "archive") == ["a.hl7"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another uid")
def test_a_processing_directory_owned_by_another_uid_refuses_the_connection(tmp_path: Path) -> None:
    """M4: someone else's processing directory is never used: the drop takes no file, and says why."""
    from twisted.logger import capturedLogs, formatEvent

    processing(tmp_path).mkdir(parents=True)
    os.chown(processing(tmp_path), 65534, 65534)
    h = Harness(tmp_path, AutoIngest())
    drop(tmp_path, "a.hl7", adt("A"))
    with capturedLogs() as events:
        h.start()
        h.next_poll()
    assert h.ingest.calls == [] and listing(tmp_path / "in") == ["a.hl7"]
    assert any("owned by uid 65534" in formatEvent(e) and "not used" in formatEvent(e) for e in events)


def test_a_claimed_file_that_keeps_changing_is_set_aside_and_the_drop_goes_on(tmp_path: Path) -> None:
    """M4: a file in processing appended to at every poll stalled the whole drop for ever; after
    UNSETTLED_SECONDS it goes to rejected with a reason and the waiting files are staged."""
    from listeners.filedrop import UNSETTLED_SECONDS

    h = Harness(tmp_path, AutoIngest())
    processing(tmp_path).mkdir(parents=True, mode=0o700)
    stall = processing(tmp_path) / "stall.hl7"
    stall.write_bytes(adt("S"))
    drop(tmp_path, "b.hl7", adt("B"))
    h.start()
    polls = 0
    while polls * h.listener.config.poll_seconds < UNSETTLED_SECONDS - h.listener.config.poll_seconds:
        with open(stall, "ab") as f:
            f.write(b"NTE|1||x\r")
        h.next_poll()
        polls += 1
        assert h.ingest.calls == []  # within the bound, the claimed file still goes first
    for _ in range(3):
        if stall.exists():
            with open(stall, "ab") as f:
                f.write(b"NTE|1||x\r")
        h.next_poll()
    assert [item.control_id for item, _ in h.ingest.calls] == ["B"]
    assert listing(tmp_path / "rejected") == ["stall.hl7", "stall.hl7.reason"]
    reason = (tmp_path / "rejected" / "stall.hl7.reason").read_text()
    assert reason.startswith("kept changing in processing for over 30 s")
    assert listing(tmp_path / "archive") == ["b.hl7"]
