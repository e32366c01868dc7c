"""Retention periods from the service config's `[retention]` (include/config.py) on real SQLite and
PostgreSQL stores: the global periods, and a connection's own periods applied in the archive and
purge SQL — its messages' inbound, routed and outbound rows are kept longer (or shorter) than the
others', whichever stage they are in."""

from __future__ import annotations

import tomllib

import pytest

from include.config import ConfigError, parse
from include.housekeeping import retention
from include.store import Store
from include.store.lease import acquire_permanent
from tests.dags.stores import age, finished_messages, rows, write_service_config

DAY = 86_400.0
CONFIG = """
[retention]
inbound_days = 1
routed_days = 1
outbound_days = 1
events_days = 1
archive_days = 10

[retention.connections.adt-in]
inbound_days = 30
routed_days = 30
outbound_days = 30
"""


def two_connections_two_days_old(store: Store) -> int:
    """Two messages of each of `adt-in` and `lab-in` taken all the way, every stage's row two days
    old; the epoch they were moved under."""
    epoch = acquire_permanent(store, node_id="solo:1:aa")
    finished_messages(store, epoch, "adt-", "adt-in")
    finished_messages(store, epoch, "lab-", "lab-in")
    for table in ("stage_inbound", "stage_routed", "stage_outbound"):
        age(store, table, "updated_at", "1 = 1", 2 * DAY)
    return epoch


def _messages(store: Store, table: str) -> list[str]:
    return [r["message_id"] for r in rows(store, f"SELECT message_id FROM {table} ORDER BY id")]


def _run(store: Store, epoch: int, text: str) -> dict[str, int]:
    config = parse(tomllib.loads(text)).retention
    return retention(store, epoch, config.ages_seconds(), connections=config.connection_ages_seconds())


def test_a_connections_own_periods_keep_its_rows_in_every_stage_longer(store):
    epoch = two_connections_two_days_old(store)

    deleted = _run(store, epoch, CONFIG)

    assert {k: deleted[k] for k in ("inbound", "routed", "outbound")} == {"inbound": 2, "routed": 2, "outbound": 2}
    for stage in ("inbound", "routed", "outbound"):
        assert _messages(store, f"stage_{stage}") == ["adt-0", "adt-1"], stage
        assert _messages(store, f"archive_{stage}") == ["lab-0", "lab-1"], stage

    for table in ("stage_inbound", "stage_routed", "stage_outbound"):
        age(store, table, "updated_at", "1 = 1", 29 * DAY)
    deleted = _run(store, epoch, CONFIG)

    assert {k: deleted[k] for k in ("inbound", "routed", "outbound")} == {"inbound": 2, "routed": 2, "outbound": 2}
    for stage in ("inbound", "routed", "outbound"):
        assert _messages(store, f"stage_{stage}") == [], stage
        assert sorted(_messages(store, f"archive_{stage}")) == ["adt-0", "adt-1", "lab-0", "lab-1"], stage


def test_a_connection_may_keep_one_stage_shorter_and_the_others_by_default(store):
    epoch = two_connections_two_days_old(store)
    text = (
        "[retention]\ninbound_days = 7\nrouted_days = 7\noutbound_days = 7\n"
        "[retention.connections.adt-in]\noutbound_days = 1\n"
    )

    _run(store, epoch, text)

    assert _messages(store, "stage_outbound") == ["lab-0", "lab-1"]
    assert _messages(store, "archive_outbound") == ["adt-0", "adt-1"]
    assert len(_messages(store, "stage_inbound")) == len(_messages(store, "stage_routed")) == 4


def test_the_retention_task_reads_the_periods_from_the_service_config(store, store_config, tmp_path, monkeypatch):
    from stageline_airflow import tasks

    epoch = two_connections_two_days_old(store)
    path = write_service_config(tmp_path, store_config, cluster=False)
    path.write_text(path.read_text() + CONFIG)
    monkeypatch.setenv("STAGELINE_CONFIG", str(path))

    deleted = tasks.retention_step({"epoch": epoch, "owner": None})

    assert deleted["inbound"] == 2
    assert _messages(store, "stage_inbound") == ["adt-0", "adt-1"]


@pytest.mark.parametrize(
    "text, words",
    [
        ("[retention]\ninbound_days = 0\n", "retention.inbound_days: must be > 0"),
        ('[retention]\nevents_days = "30"\n', "retention.events_days: must be a number, got a string"),
        ("[retention]\nkeep = 3\n", "retention.keep: unknown setting"),
        ("[retention]\narchive_path = 3\n", "retention.archive_path: must be a string, got an integer"),
        (
            "[retention.connections.adt-in]\nevents_days = 3\n",
            "retention.connections.adt-in.events_days: unknown setting",
        ),
        (
            "[retention.connections.adt-in]\ninbound_days = -1\n",
            "retention.connections.adt-in.inbound_days: must be > 0",
        ),
        ("[retention]\nconnections = 3\n", "retention.connections: must be a table, got an integer"),
        ('[retention.connections]\n"a,b" = {inbound_days = 3}\n', "contain no ','"),
    ],
)
def test_bad_retention_settings_are_refused_naming_the_setting(text, words):
    with pytest.raises(ConfigError) as err:
        parse(tomllib.loads(text))
    assert words in str(err.value)


def test_retention_defaults_and_overrides_load():
    default = parse({}).retention
    assert default.ages_seconds() == {"inbound": 7 * DAY, "routed": 7 * DAY, "outbound": 7 * DAY, "events": 30 * DAY}
    assert default.archive_path == "" and default.connections == {}
    config = parse(tomllib.loads(CONFIG + "\n[retention.connections.lab-in]\nrouted_days = 0.5\n")).retention
    assert config.archive_days == 10.0
    assert config.connection_ages_seconds() == {
        "adt-in": {"inbound": 30 * DAY, "routed": 30 * DAY, "outbound": 30 * DAY},
        "lab-in": {"routed": 0.5 * DAY},
    }


def test_routed_and_outbound_rows_find_their_connection_once_their_inbound_row_is_archived(store):
    epoch = two_connections_two_days_old(store)
    text = (
        "[retention]\ninbound_days = 1\nrouted_days = 1\noutbound_days = 1\n"
        "[retention.connections.adt-in]\nrouted_days = 30\noutbound_days = 30\n"
    )

    _run(store, epoch, text)

    assert _messages(store, "stage_inbound") == []  # both connections' inbound rows archived and purged
    assert _messages(store, "archive_inbound") == ["adt-0", "adt-1", "lab-0", "lab-1"]
    for stage in ("routed", "outbound"):  # adt-in's found through archive_inbound: kept
        assert _messages(store, f"stage_{stage}") == ["adt-0", "adt-1"], stage
