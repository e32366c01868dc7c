"""What the replication posture says, from what the server reports (include/store/replication.py);
the posture on a real Patroni pair is tests/store/test_replicated_store.py."""

from __future__ import annotations

import pytest

from include.store.replication import Posture, read_posture


def posture(names: str, sync: int, *, level: str = "on", can_see: bool = True) -> Posture:
    return Posture(
        standby_names=names,
        synchronous_commit=level,
        in_recovery=False,
        can_see=can_see,
        standbys=sync,
        sync_standbys=sync,
    )


@pytest.mark.parametrize(
    ("p", "state", "two_servers"),
    [
        (posture('"pg-b"', 1), "synchronous", True),
        (posture('"pg-b"', 1, level="remote_apply"), "synchronous", True),
        (posture('"pg-b"', 1, level="local"), "synchronous", False),  # the session does not wait
        (posture('"pg-b"', 0), "waiting", False),
        (posture("", 0), "single", False),
        (posture("  ", 1), "single", False),  # an asynchronous standby is not a second server for a commit
        (posture('"pg-b"', 0, can_see=False), "unknown", False),
    ],
)
def test_the_state_says_whether_a_commit_is_on_two_servers(p: Posture, state: str, two_servers: bool) -> None:
    assert (p.state, p.two_servers) == (state, two_servers)
    assert p.document()["state"] == state


def test_a_single_server_store_reads_as_one_server_and_sqlite_has_nothing_to_read(store) -> None:
    p = read_posture(store)
    if store.backend == "sqlite":
        assert p is None
    else:
        assert p is not None and (p.state, p.two_servers, p.sync_standbys) == ("single", False, 0)
