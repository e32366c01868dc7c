"""SQLite connections are a fixed set of `[store].pool_size`, not one per thread (include/store/db.py).

A thread pool adds threads when it pleases; when every thread kept a connection of its own,
listenerd's open file descriptors stepped up by two (the database and its WAL) whenever its pool
grew, and a test waiting for them to come back to a baseline waited in vain. Measured as the
process's open descriptors on a real SQLite database file and its WAL.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest

from include.config import StoreConfig
from include.store import Store


def db_fds(path: str) -> int:
    """This process's open descriptors on the database file and its WAL."""
    names = {str(Path(path).resolve()), str(Path(path).resolve()) + "-wal"}
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in names:
                count += 1
        except OSError:
            pass
    return count


def in_thread(work) -> threading.Thread:
    def run() -> None:
        work()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def one_read(store: Store) -> int:
    with store.transaction(write=False) as tx:
        return tx.conn.execute("SELECT count(*) AS n FROM stage_inbound").fetchone()["n"]


def test_transactions_from_ever_new_threads_use_the_same_connections(sqlite_config_fresh: StoreConfig) -> None:
    store = Store(sqlite_config_fresh)
    try:
        one_read(store)
        at_rest = db_fds(sqlite_config_fresh.path)
        assert at_rest == 2 * sqlite_config_fresh.pool_size  # all opened at once: the database and its WAL each
        for _ in range(12):  # twelve threads, one after another, as a growing pool runs them
            in_thread(lambda: one_read(store)).join(30)
        assert db_fds(sqlite_config_fresh.path) == at_rest
    finally:
        store.close()
    assert db_fds(sqlite_config_fresh.path) == 0


def test_overlapping_transactions_share_the_set_and_wait_when_all_are_in_use(sqlite_config_fresh: StoreConfig) -> None:
    config = dataclasses.replace(sqlite_config_fresh, pool_size=2)
    store = Store(config)
    try:
        one_read(store)
        at_rest = db_fds(config.path)
        release = threading.Event()
        inside = threading.Semaphore(0)

        def hold() -> None:
            with store.transaction(write=False):
                inside.release()
                assert release.wait(30)

        holders = [in_thread(hold) for _ in range(2)]
        for _ in holders:
            assert inside.acquire(timeout=30)
        done: list[float] = []
        third = in_thread(lambda: (one_read(store), done.append(time.monotonic())))
        time.sleep(0.5)
        assert done == []  # both connections are in transactions: the third waits, opens none
        assert db_fds(config.path) == at_rest
        released = time.monotonic()
        release.set()
        third.join(30)
        assert done and done[0] >= released
        for t in holders:
            t.join(30)
        assert db_fds(config.path) == at_rest
    finally:
        release.set()
        store.close()


def test_a_failed_transaction_rolls_back_and_its_connection_is_replaced(sqlite_config_fresh: StoreConfig) -> None:
    store = Store(sqlite_config_fresh)
    try:
        one_read(store)
        at_rest = db_fds(sqlite_config_fresh.path)
        with pytest.raises(RuntimeError):
            with store.transaction() as tx:
                tx.conn.execute(
                    "INSERT INTO stage_inbound (message_id, control_id, connection, lane_key) "
                    "VALUES ('m-gone', 'c', 'x', 'l')"
                )
                raise RuntimeError("the caller fails mid-transaction")
        with store.transaction(write=False) as tx:
            gone = tx.conn.execute("SELECT count(*) AS n FROM stage_inbound WHERE message_id = 'm-gone'").fetchone()
        assert gone["n"] == 0
        assert db_fds(sqlite_config_fresh.path) == at_rest
    finally:
        store.close()


def test_a_wal_grown_behind_a_long_reader_is_cut_back_once_the_readers_are_gone(
    sqlite_config_fresh: StoreConfig,
) -> None:
    """Issue 22: a long reader holds checkpoints back and the WAL grows meanwhile; once it is gone
    and a checkpoint resets the WAL, the file shrinks to the store's limit instead of keeping the
    size of its longest stretch."""
    import sqlite3

    from include.store.dialects import WAL_SIZE_LIMIT_BYTES

    store = Store(sqlite_config_fresh)
    wal = Path(sqlite_config_fresh.path + "-wal")
    reader = sqlite3.connect(sqlite_config_fresh.path, isolation_level=None)
    try:
        with store.transaction() as tx:
            tx.conn.execute("CREATE TABLE filler (b BLOB)")
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM leader_lease").fetchall()  # a snapshot checkpoints must keep
        for _ in range(24):
            with store.transaction() as tx:
                tx.conn.execute("INSERT INTO filler SELECT randomblob(1024 * 1024)")
        assert wal.stat().st_size > 2 * WAL_SIZE_LIMIT_BYTES  # grew behind the reader
        reader.execute("COMMIT")
        writer = store.dialect.connect(sqlite_config_fresh)  # the store's own settings, autocommit
        try:
            writer.execute("PRAGMA wal_checkpoint(PASSIVE)")  # catches up now the reader is gone
            writer.execute("INSERT INTO filler VALUES (x'00')")  # the next write restarts the WAL
            writer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            writer.close()
        assert wal.stat().st_size <= WAL_SIZE_LIMIT_BYTES
    finally:
        reader.close()
        store.close()
