"""SQLite connections follow transactions, not threads (include/store/db.py).

A thread pool adds threads when it pleases; when every thread kept a connection of its own,
listenerd's open file descriptors stepped up by two (the database and its WAL) whenever its pool
grew, and a test waiting for them to come back to a baseline waited in vain. Measured here as the
process's open descriptors on the database file, a real SQLite file.
"""
from __future__ import annotations

import os
import threading
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


def in_thread(work) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # reported in the caller's thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not errors, errors


def one_read(store: Store) -> None:
    with store.transaction(write=False) as tx:
        assert tx.conn.execute("SELECT count(*) AS n FROM stage_inbound").fetchone()["n"] >= 0


def test_transactions_from_ever_new_threads_share_one_connection(sqlite_config_fresh: StoreConfig) -> None:
    store = Store(sqlite_config_fresh)
    try:
        one_read(store)
        held = db_fds(sqlite_config_fresh.path)
        assert held >= 1
        for _ in range(12):  # twelve threads, one after another, as a growing pool runs them
            in_thread(lambda: one_read(store))
        assert db_fds(sqlite_config_fresh.path) == held
    finally:
        store.close()
    assert db_fds(sqlite_config_fresh.path) == 0  # close() closes what is idle


def test_concurrent_transactions_open_a_connection_each_and_keep_them_for_later(
        sqlite_config_fresh: StoreConfig) -> None:
    store = Store(sqlite_config_fresh)
    try:
        one_read(store)
        single = db_fds(sqlite_config_fresh.path)
        inside, release = threading.Event(), threading.Event()

        def hold() -> None:
            with store.transaction(write=False):
                inside.set()
                assert release.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert inside.wait(30)
            in_thread(lambda: one_read(store))  # while the other is open: a second connection
        finally:
            release.set()
            holder.join(30)
        both = db_fds(sqlite_config_fresh.path)
        assert both == 2 * single
        for _ in range(6):
            in_thread(lambda: one_read(store))
        assert db_fds(sqlite_config_fresh.path) == both  # kept, reused, no more
    finally:
        store.close()


def test_a_failed_transaction_rolls_back_and_its_connection_is_not_reused(sqlite_config_fresh: StoreConfig) -> None:
    store = Store(sqlite_config_fresh)
    try:
        one_read(store)
        held = db_fds(sqlite_config_fresh.path)
        with pytest.raises(RuntimeError):
            with store.transaction() as tx:
                tx.conn.execute("INSERT INTO stage_inbound (message_id, control_id, connection, lane_key) "
                                "VALUES ('m-gone', 'c', 'x', 'l')")
                raise RuntimeError("the caller fails mid-transaction")
        assert db_fds(sqlite_config_fresh.path) == 0  # closed, not given back
        with store.transaction(write=False) as tx:
            gone = tx.conn.execute("SELECT count(*) AS n FROM stage_inbound WHERE message_id = 'm-gone'").fetchone()
        assert gone["n"] == 0
        assert db_fds(sqlite_config_fresh.path) == held
    finally:
        store.close()
