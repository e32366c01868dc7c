"""A store whose PostgreSQL comes back after seconds away is used again at once (include/store/pg_pool.py).

The server is reached through a TCP proxy that is taken down — connections refused, the open ones
closed, as HAProxy does while no server is primary — for OUTAGE seconds and then brought back on
the same port. psycopg's own pool would next try to connect 15 s after the outage began (1, 2, 4,
8 s apart), so a transaction started during the outage would wait about seven seconds more for a
connection; the store's pool tries twice a second. Timed on the test's monotonic clock.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import psycopg
import pytest

from include.app.lab.tcpproxy import TcpProxy
from include.config import StoreConfig
from include.store import Store
from include.store.lease import read_lease

OUTAGE = 8.0
BACK_WITHIN = 1.5
"""Seconds from the server's return to the first transaction on it: the pool's next try comes
within RECONNECT_DELAY_MAX, then a connect and a read on a shared machine."""


def lease_epoch(store: Store) -> int:
    return read_lease(store).epoch


def test_a_transaction_waiting_through_an_outage_runs_within_a_second_of_the_server_coming_back(
    pg_config_fresh: StoreConfig,
) -> None:
    proxy = TcpProxy(pg_config_fresh.server, pg_config_fresh.effective_port).start()
    store = Store(dataclasses.replace(pg_config_fresh, server="127.0.0.1", port=proxy.port))
    try:
        lease_epoch(store)  # the pool's connection is open
        proxy.stop()
        with pytest.raises(psycopg.OperationalError):
            lease_epoch(store)  # the dead connection fails its transaction; the pool starts reconnecting
        done: list[float] = []
        failed: list[BaseException] = []

        def wait_and_read() -> None:  # as listenerd's heartbeat: again after each failure
            while not done:
                try:
                    lease_epoch(store)
                    done.append(time.monotonic())
                except psycopg.OperationalError as exc:  # another connection the outage broke
                    failed.append(exc)
                    time.sleep(0.1)

        waiter = threading.Thread(target=wait_and_read, daemon=True)
        waiter.start()  # waits for a connection from the pool (its timeout: 30 s)
        time.sleep(OUTAGE)
        assert not done, "a transaction ran while the server was away"
        back = time.monotonic()
        proxy = TcpProxy(pg_config_fresh.server, pg_config_fresh.effective_port, listen_port=proxy.port).start()
        waiter.join(30)
        assert done, f"no transaction ran after the outage: {failed[-3:]}"
        took = done[0] - back
        assert took <= BACK_WITHIN, f"the store was used again {took:.1f} s after the server came back"
    finally:
        store.close()
        proxy.stop()
