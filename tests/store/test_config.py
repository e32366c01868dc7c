"""Config load enforces the cluster's safety rules with errors that name the setting and the rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from include.config import ConfigError, config_path, load, parse

CLUSTER_PG = {
    "store": {"backend": "postgres", "server": "db", "pool_size": 3},
    "cluster": {
        "enabled": True,
        "heartbeat_seconds": 2,
        "leader_fence_timeout_seconds": 4,
        "leader_lease_ttl_seconds": 6,
        "node_timeout_seconds": 5,
    },
}


def with_(section: str, **values):
    return {**CLUSTER_PG, section: {**CLUSTER_PG[section], **values}}


def test_embedded_default_is_single_node_sqlite():
    cfg = parse({})
    assert (cfg.store.backend, cfg.cluster.enabled, cfg.store.pool_size) == ("sqlite", False, 5)


def test_valid_cluster_config_loads_and_derives_host_pid_hex_node_id():
    cfg = parse(CLUSTER_PG)
    assert re.fullmatch(r"[^:]+:\d+:[0-9a-f]{8}", cfg.cluster.node_id)
    assert cfg.cluster.leader_lease_ttl_seconds == 6.0


def test_pinned_node_id_is_kept():
    assert parse(with_("cluster", node_id="node-a")).cluster.node_id == "node-a"


@pytest.mark.parametrize(
    "raw, words",
    [
        (
            with_("cluster", leader_fence_timeout_seconds=6),
            ["heartbeat_seconds < leader_fence_timeout_seconds < leader_lease_ttl_seconds"],
        ),
        (with_("cluster", heartbeat_seconds=4), ["heartbeat_seconds < leader_fence_timeout_seconds"]),
        (with_("cluster", node_timeout_seconds=2), ["node_timeout_seconds", "heartbeat_seconds"]),
        (with_("store", backend="sqlite"), ["[cluster].enabled", "postgres", "sqlserver"]),
        (with_("store", pool_size=1), ["store.pool_size: must be >= 2"]),
        (with_("store", backend="mysql"), ["store.backend: must be one of 'sqlite', 'postgres', 'sqlserver'"]),
        (with_("store", colour="blue"), ["store.colour: unknown setting"]),
        (with_("cluster", leader_ttl=5), ["cluster.leader_ttl: unknown setting"]),
        ({"stores": {}}, ["stores: unknown setting"]),
        (with_("store", password="secret"), ["store.password: unknown setting", "STAGELINE_STORE_PASSWORD"]),
        (with_("store", pool_size="3"), ["store.pool_size: must be an integer, got a string"]),
        (with_("cluster", enabled="yes"), ["cluster.enabled: must be true or false, got a string"]),
        (with_("cluster", cluster_name=" "), ["cluster_name"]),
        (with_("store", schema="x; drop"), ["store.schema: must be"]),
    ],
)
def test_rule_violations_are_refused_naming_the_setting(raw, words):
    with pytest.raises(ConfigError) as err:
        parse(raw)
    for word in words:
        assert word in str(err.value)


def test_password_comes_only_from_the_environment():
    cfg = parse(CLUSTER_PG, env={"STAGELINE_STORE_PASSWORD": "s3cret"})
    assert cfg.store.password == "s3cret"
    assert "s3cret" not in repr(cfg)


def test_file_load_resolves_sqlite_path_beside_the_file(tmp_path):
    path = tmp_path / "conf" / "stageline.toml"
    path.parent.mkdir()
    path.write_text('[store]\nbackend = "sqlite"\npath = "data/s.db"\n[cluster]\ncluster_name = "lab"\n')
    cfg = load(path)
    assert cfg.store.path == str(tmp_path / "conf" / "data" / "s.db")
    assert cfg.cluster.cluster_name == "lab"


def test_bad_toml_and_missing_file_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[store\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.toml")


def test_the_config_path_is_the_argument_else_stageline_config_else_the_working_directorys(tmp_path, monkeypatch):
    monkeypatch.delenv("STAGELINE_CONFIG", raising=False)
    assert config_path() == Path("stageline.toml")
    from_env = tmp_path / "from-env.toml"
    from_env.write_text('[cluster]\ncluster_name = "from-env"\n')
    monkeypatch.setenv("STAGELINE_CONFIG", str(from_env))
    assert config_path() == from_env
    assert load().cluster.cluster_name == "from-env"
    assert config_path(tmp_path / "given.toml") == tmp_path / "given.toml"


@pytest.mark.parametrize("retry, busy_ms", [(-1.0, 10_000), (50.0, 10_000), (59.9, 100)])
def test_busy_retries_that_could_outlive_the_senders_answer_are_refused(tmp_path, retry, busy_ms):
    from include.config import ConfigError, load

    path = tmp_path / "stageline.toml"
    path.write_text(f'[store]\npath = "s.db"\nbusy_retry_seconds = {retry}\nbusy_timeout_ms = {busy_ms}\n')
    with pytest.raises(ConfigError, match="busy_retry_seconds"):
        load(path)


def test_busy_retry_seconds_is_typed_and_defaults_to_forty(tmp_path):
    from include.config import ConfigError, load

    path = tmp_path / "stageline.toml"
    path.write_text('[store]\npath = "s.db"\n')
    assert load(path).store.busy_retry_seconds == 40.0
    path.write_text('[store]\npath = "s.db"\nbusy_retry_seconds = "40"\n')
    with pytest.raises(ConfigError, match=r"store.busy_retry_seconds: must be a number, got a string"):
        load(path)
