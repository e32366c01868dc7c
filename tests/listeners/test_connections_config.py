"""Loading `connections.toml`: a bad setting is refused at load, naming the connection and the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from listeners.connections_config import ConnectionConfigError, load_config_dir
from listeners.validation import lane_rule


def write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "connections.toml").write_text(body)
    return tmp_path


@pytest.mark.parametrize("lane_key", ["PID3.1", "pid-3", "PID-0", "PID-3.1 ", 7])
def test_a_lane_key_that_is_no_hl7_field_path_refuses_the_config_naming_connection_and_setting(
    tmp_path: Path, lane_key: object
) -> None:
    value = f'"{lane_key}"' if isinstance(lane_key, str) else str(lane_key)
    with pytest.raises(ConnectionConfigError) as info:
        load_config_dir(write(tmp_path, f'[[inbound]]\nname = "adt-in"\nkind = "mllp"\nlane_key = {value}\n'))
    assert "adt-in" in str(info.value) and "lane_key" in str(info.value)


def test_a_valid_lane_key_loads_and_gives_the_lane_of_each_message(tmp_path: Path) -> None:
    config = load_config_dir(write(tmp_path, '[[inbound]]\nname = "adt-in"\nkind = "tcp"\nlane_key = "PID-3.1"\n'))
    lane_of = lane_rule(config.inbound[0].lane_key)
    assert lane_of is not None
    assert lane_of("MSH|^~\\&|A|B|C|D|20240101||ADT^A01|C1|P|2.5\rPID|1||123^^^H||DOE") == "123"
    assert lane_rule("") is None


@pytest.mark.parametrize(
    "key",
    [
        "max_connections_per_peer",
        "connect_rate_per_peer",
        "frame_timeout_seconds",
        "handshake_timeout_seconds",
        "max_bytes_per_second_per_peer",
        "max_connections",
    ],
)
@pytest.mark.parametrize("value", [0, -1, "ten"])
def test_peer_limits_must_be_positive_numbers(tmp_path, key, value):
    write(tmp_path, f'[[inbound]]\nname = "a"\nkind = "mllp"\nport = 2575\n{key} = {json.dumps(value)}\n')
    with pytest.raises(ConnectionConfigError, match=rf"connections.toml: inbound\[0\]\.{key}: must be"):
        load_config_dir(tmp_path)


def test_peer_limits_have_protective_defaults(tmp_path):
    write(tmp_path, '[[inbound]]\nname = "a"\nkind = "mllp"\nport = 2575\n')
    [conn] = load_config_dir(tmp_path).inbound
    assert (
        conn.max_connections_per_peer,
        conn.connect_rate_per_peer,
        conn.frame_timeout_seconds,
        conn.handshake_timeout_seconds,
    ) == (16, 20.0, 10.0, 10.0)
    assert conn.frame_timeout_seconds < conn.idle_timeout_seconds


def test_accept_is_for_http_only_and_names_hl7v2_and_fhir(tmp_path):
    write(
        tmp_path,
        '[[inbound]]\nname = "h"\nkind = "http"\n[[inbound]]\nname = "f"\nkind = "http"\n'
        'accept = ["fhir", "hl7v2", "fhir"]\n',
    )
    plain, fhir = load_config_dir(tmp_path).inbound
    assert (plain.accept, fhir.accept) == (("hl7v2",), ("fhir", "hl7v2"))
    for kind, body, error in [
        ("mllp", 'accept = ["fhir"]', 'accept: only for kind = "http"'),
        ("http", "accept = []", "accept: .*at least 1"),
        ("http", 'accept = ["fhir-r5"]', "accept\\[0\\]: must be one of 'hl7v2', 'fhir'"),
        ("http", 'accept = "fhir"', "accept: "),
    ]:
        write(tmp_path, f'[[inbound]]\nname = "a"\nkind = "{kind}"\nport = 2575\n{body}\n')
        with pytest.raises(ConnectionConfigError, match=error):
            load_config_dir(tmp_path)


def test_batch_and_verdict_settings_have_defaults_and_are_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGELINE_VAR", str(tmp_path / "var"))
    conf = tmp_path / "conf"
    conf.mkdir()
    write(
        conf,
        '[[inbound]]\nname = "a"\nkind = "mllp"\nport = 2575\n'
        '[[inbound]]\nname = "f"\nkind = "file"\ndirectory = "../in"\n'
        '[[inbound]]\nname = "g"\nkind = "file"\ndirectory = "../in2"\nerror_directory = "../bad"\n'
        "hl7_only = true\n",
    )
    mllp, f, g = load_config_dir(conf).inbound
    assert (mllp.batch_ack, mllp.hl7_only) == ("batch", False)
    # archive and rejected default to the var dir, outside the partner-writable drop tree
    assert f.archive == str((tmp_path / "var" / "filedrop" / "f" / "archive").resolve())
    assert f.error_directory == str((tmp_path / "var" / "filedrop" / "f" / "rejected").resolve())
    assert (g.error_directory, g.hl7_only) == (str((tmp_path / "bad").resolve()), True)
    for body, error in [
        ('batch_ack = "each"', "batch_ack: must be one of 'batch', 'messages'"),
        ('hl7_only = "yes"', "hl7_only: must be true or false, got a string"),
    ]:
        write(tmp_path, f'[[inbound]]\nname = "a"\nkind = "mllp"\nport = 2575\n{body}\n')
        with pytest.raises(ConnectionConfigError, match=error):
            load_config_dir(tmp_path)
    write(tmp_path, '[[inbound]]\nname = "f"\nkind = "file"\ndirectory = "in"\nerror_directory = "in"\n')
    with pytest.raises(
        ConnectionConfigError,
        match=r"inbound\[0\]\.error_directory: error_directory must differ "
        "from directory",
    ):
        load_config_dir(tmp_path)
