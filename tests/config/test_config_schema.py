"""The strict config schema of connections.toml, [api] and stageline.toml (issue 23): a value of the
wrong type is an error, never truthy; ranges, enums, charsets, TLS files, CIDRs, sender
authentication and the file-drop tree are checked; every problem of a dir comes out at once with
file and dotted key, exit code 2 and no traceback; the published JSON Schemas are current.

Each case of issue 23's table that concerns config is a test here (they all said `config OK`, or
crashed, before)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from include.schema.json_schema import FILES as SCHEMA_FILES
from include.schema.json_schema import schema_text
from listeners.config_check import EXIT_PROBLEMS, check_dir
from listeners.connections_config import ConnectionConfigError, load_config_dir

ROOT = Path(__file__).resolve().parents[2]
STAGELINE = Path(sys.executable).parent / "stageline"


def conf_dir(tmp_path: Path, connections: str, **files: str) -> Path:
    conf = tmp_path / "conf"
    conf.mkdir(exist_ok=True)
    (conf / "connections.toml").write_text(connections)
    for name, text in files.items():
        (conf / name).write_text(text)
    return conf


def check(conf: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The real entry point, as `stageline config check` runs it."""
    return subprocess.run(
        [sys.executable, "-m", "listeners.config_check", str(conf), "--no-store", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stdout.splitlines() if not line.startswith("config ")]


MLLP_ANY = '[[inbound]]\nname = "adt-in"\nkind = "mllp"\nhost = "0.0.0.0"\nport = 2575\n'


def test_allow_insecure_bind_no_is_a_type_error_not_a_yes(tmp_path):
    conf = conf_dir(tmp_path, MLLP_ANY + 'allow_insecure_bind = "no"\nallowed_sources = ["10.0.0.0/8"]\n')
    done = check(conf)
    assert done.returncode == EXIT_PROBLEMS, done.stdout
    assert (
        f"{conf / 'connections.toml'}: inbound[0].allow_insecure_bind: must be true or false, got a string "
        "(connection 'adt-in')" in done.stdout
    )
    with pytest.raises(ConnectionConfigError):  # what listenerd loads: refused, so nothing is bound
        load_config_dir(conf)


def test_a_port_given_as_text_is_a_typed_error_with_exit_2_and_no_traceback(tmp_path):
    conf = conf_dir(tmp_path, '[[inbound]]\nname = "adt-in"\nkind = "mllp"\nport = "2575"\n')
    for done in (
        check(conf),
        subprocess.run(
            [str(STAGELINE), "config", "check", str(conf)], capture_output=True, text=True, timeout=60, cwd=tmp_path
        ),
    ):
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{conf / 'connections.toml'}: inbound[0].port: must be an integer, got a string" in done.stdout
        assert "Traceback" not in done.stdout + done.stderr


def test_the_issues_quiet_mistakes_are_all_reported_together_with_file_and_key(tmp_path):
    conf = conf_dir(
        tmp_path,
        """
[[inbound]]
name = "adt-in"
kind = "mllp"
idle_timeout_seconds = -5
charset = "klingon"
port = 70000
tls = { cert = "pki/missing.pem", key = "pki/missing.key" }

[[inbound]]
name = "drop"
kind = "file"
directory = "in"
poll_seconds = 0
""",
        **{"route.toml": '[[route]]\nname = "x"\ndestinations = ["y"]\n'},
    )
    done = check(conf)
    assert done.returncode == 2
    path = conf / "connections.toml"
    expected = [
        f"{path}: inbound[0].port: must be <= 65535 (connection 'adt-in')",
        f"{path}: inbound[0].charset: unknown charset; accepted (HL7 table 0211): ASCII, ISO IR6, 8859/1",
        f"{path}: inbound[0].idle_timeout_seconds: must be > 0 (connection 'adt-in')",
        f"{path}: inbound[0].tls.cert: no such file: {conf.resolve() / 'pki/missing.pem'} (connection 'adt-in')",
        f"{path}: inbound[0].tls.key: no such file: {conf.resolve() / 'pki/missing.key'} (connection 'adt-in')",
        f"{path}: inbound[1].poll_seconds: must be >= 0.05 (connection 'drop')",
        f"{conf / 'route.toml'}: unknown",
    ]
    out = lines(done)
    for want in expected:
        assert any(line.startswith(want) for line in out), (want, done.stdout)
    assert "klingon" not in done.stdout.split("charset:")[1].split("\n")[0]  # the accepted names, not the input


@pytest.mark.parametrize("charset", ["klingon", "punycode", "base64", "rot13", "zlib", "utf-16"])
def test_a_charset_outside_hl7_table_0211_is_refused(tmp_path, charset):
    conf = conf_dir(tmp_path, f'[[inbound]]\nname = "a"\nkind = "tcp"\ncharset = "{charset}"\n')
    with pytest.raises(
        ConnectionConfigError,
        match=r"inbound\[0\]\.charset: unknown charset; accepted \(HL7 "
        r"table 0211\): ASCII.*UNICODE UTF-8",
    ):
        load_config_dir(conf)


@pytest.mark.parametrize("charset", ["8859/1", "latin-1", "UNICODE UTF-8", "utf-8", "ASCII", "iso-8859-15"])
def test_table_0211_charsets_and_their_aliases_load(tmp_path, charset):
    conf = conf_dir(tmp_path, f'[[inbound]]\nname = "a"\nkind = "tcp"\ncharset = "{charset}"\n')
    assert load_config_dir(conf).inbound[0].charset == charset


def pki(conf: Path) -> dict[str, str]:
    (conf / "pki").mkdir(parents=True, exist_ok=True)
    for name in ("server.pem", "server.key", "ca.pem"):
        (conf / "pki" / name).write_text("PEM\n")
    return {"cert": "pki/server.pem", "key": "pki/server.key", "ca": "pki/ca.pem"}


@pytest.mark.parametrize(
    "extra, mtls, ok",
    [
        ("", False, False),  # TLS, but anyone may send
        ('allowed_sources = ["10.1.0.0/16", "192.0.2.7", "2001:db8::/32"]\n', False, True),
        ("allow_unauthenticated_senders = true\n", False, True),
        ("", True, True),  # mTLS
    ],
)
def test_a_non_loopback_network_inbound_needs_authenticated_senders(tmp_path, extra, mtls, ok):
    conf = tmp_path / "conf"
    tls = "[inbound.tls]\n" + "".join(f'{k} = "{v}"\n' for k, v in pki(conf).items())
    conf_dir(tmp_path, MLLP_ANY + extra + tls + ("require_client_cert = true\n" if mtls else ""))
    if ok:
        [conn] = load_config_dir(conf).inbound
        assert conn.host == "0.0.0.0" and conn.allowed_sources == (
            ("10.1.0.0/16", "192.0.2.7", "2001:db8::/32") if extra.startswith("allowed") else ()
        )
    else:
        with pytest.raises(
            ConnectionConfigError,
            match=r"inbound\[0\]\.allowed_sources: a non-loopback bind \(mllp "
            r"on 0\.0\.0\.0\) needs authenticated senders",
        ):
            load_config_dir(conf)


def test_a_loopback_inbound_needs_neither_tls_nor_sender_authentication(tmp_path):
    for host in ("127.0.0.1", "localhost", "::1"):
        conf = conf_dir(tmp_path, f'[[inbound]]\nname = "a"\nkind = "http"\nhost = "{host}"\n')
        assert load_config_dir(conf).inbound[0].host == host


def test_a_non_loopback_bind_without_tls_and_without_senders_reports_both_rules(tmp_path):
    conf = conf_dir(tmp_path, MLLP_ANY)
    with pytest.raises(ConnectionConfigError) as info:
        load_config_dir(conf)
    keys = [p.key for p in info.value.problems]
    assert keys == ["inbound[0].host", "inbound[0].allowed_sources"]
    assert "refusing a non-loopback bind without TLS" in str(info.value)


def test_allowed_sources_must_be_cidrs(tmp_path):
    conf = conf_dir(
        tmp_path,
        MLLP_ANY + 'allow_insecure_bind = true\nallowed_sources = ["10.0.0.0/8", "10.0.0.0/33", "partner-host", 7]\n',
    )
    with pytest.raises(ConnectionConfigError) as info:
        load_config_dir(conf)
    assert [(p.key, p.message.split(" (")[0]) for p in info.value.problems] == [
        ("inbound[0].allowed_sources[3]", "must be a string, got an integer")
    ]
    conf = conf_dir(
        tmp_path,
        MLLP_ANY + 'allow_insecure_bind = true\nallowed_sources = ["10.0.0.0/8", "10.0.0.0/33", "partner-host"]\n',
    )
    with pytest.raises(ConnectionConfigError) as info:
        load_config_dir(conf)
    assert [p.key for p in info.value.problems] == ["inbound[0].allowed_sources[1]", "inbound[0].allowed_sources[2]"]
    assert all("not a CIDR" in p.message for p in info.value.problems)


def test_tls_files_must_exist_as_readable_regular_files_relative_to_the_config_dir(tmp_path):
    conf = tmp_path / "conf"
    files = pki(conf)
    (conf / "pki" / "dir.pem").mkdir()
    body = (
        '[[inbound]]\nname = "a"\nkind = "mllp"\n[inbound.tls]\ncert = "pki/dir.pem"\nkey = "pki/server.key"\n'
        'ca = "pki/none.pem"\nrequire_client_cert = true\n'
    )
    conf_dir(tmp_path, body)
    with pytest.raises(ConnectionConfigError) as info:
        load_config_dir(conf)
    assert [(p.key, p.message.split(":")[0]) for p in info.value.problems] == [
        ("inbound[0].tls.cert", "not a regular file"),
        ("inbound[0].tls.ca", "no such file"),
    ]
    conf_dir(tmp_path, body.replace("pki/dir.pem", files["cert"]).replace("pki/none.pem", files["ca"]))
    tls = load_config_dir(conf).inbound[0].tls
    assert tls is not None and tls.cert == str((conf / "pki/server.pem").resolve()) and tls.require_client_cert


def test_a_file_inbounds_archive_and_rejected_default_outside_the_drop_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGELINE_VAR", str(tmp_path / "var"))
    conf = conf_dir(tmp_path, '[[inbound]]\nname = "drop"\nkind = "file"\ndirectory = "../in"\n')
    [conn] = load_config_dir(conf).inbound
    var = (tmp_path / "var").resolve()
    assert (conn.directory, conn.archive, conn.error_directory) == (
        str((tmp_path / "in").resolve()),
        str(var / "filedrop/drop/archive"),
        str(var / "filedrop/drop/rejected"),
    )


@pytest.mark.parametrize(
    "setting, key",
    [
        ('archive = "../in/archive"', "archive"),
        ('error_directory = "../in/sub/rejected"', "error_directory"),
        ('archive = "../in"', "archive"),
    ],
)
def test_an_archive_or_rejected_directory_inside_the_drop_tree_is_refused_unless_allowed(tmp_path, setting, key):
    body = f'[[inbound]]\nname = "drop"\nkind = "file"\ndirectory = "../in"\n{setting}\n'
    conf = conf_dir(tmp_path, body)
    with pytest.raises(
        ConnectionConfigError,
        match=rf"inbound\[0\]\.{key}: {key} lies inside directory \(the "
        r"partner-writable drop tree\)",
    ):
        load_config_dir(conf)
    conf_dir(tmp_path, body + "allow_archive_in_directory = true\n")
    assert load_config_dir(conf).inbound[0].directory == str((tmp_path / "in").resolve())


def test_every_wrong_setting_of_one_file_is_reported_at_once(tmp_path):
    conf = conf_dir(
        tmp_path,
        """
[api]
port = "8470"
allow_insecure_bind = 1
colour = "blue"

[[inbound]]
name = "a"
kind = "tcp"
framing = "crlf"
max_connections = 0
hl7_only = "yes"
lane_key = "PID3"

[[inbound]]
name = "b b"
kind = "database"
[inbound.database]
backend = "oracle"
batch_size = -1
""",
    )
    done = check(conf)
    assert done.returncode == 2
    keys = [line.split(": ")[1] for line in lines(done)]
    assert sorted(keys) == sorted(
        [
            "inbound[0].framing",
            "inbound[0].lane_key",
            "inbound[0].hl7_only",
            "inbound[0].max_connections",
            "inbound[1].name",
            "inbound[1].database.backend",
            "inbound[1].database.database",
            "inbound[1].database.query",
            "inbound[1].database.batch_size",
            "api.port",
            "api.allow_insecure_bind",
            "api.colour",
        ]
    ), done.stdout


def test_the_service_config_is_checked_with_the_config_dir(tmp_path):
    conf = conf_dir(tmp_path, "")
    service = tmp_path / "stageline.toml"
    service.write_text(
        '[store]\nbackend = "postgres"\npool_size = "5"\nallow_unsafe_durability = "yes"\n'
        "busy_timeout_ms = -1\n[cluster]\nenabled = true\nheartbeat_seconds = 0\n"
        "[retention]\ninbound_days = 0\n[retention.connections.adt-in]\nevents_days = 3\n[stores]\n"
    )
    done = check(conf, "--service-config", str(service))
    assert done.returncode == 2
    found = {line.split(": ")[1] for line in lines(done) if line.startswith(str(service))}
    assert found == {
        "store.pool_size",
        "store.allow_unsafe_durability",
        "store.busy_timeout_ms",
        "cluster.heartbeat_seconds",
        "retention.inbound_days",
        "retention.connections.adt-in.events_days",
        "stores",
    }, done.stdout
    service.write_text('[store]\nbackend = "postgres"\nallow_unsafe_durability = true\n')
    assert check(conf, "--service-config", str(service)).returncode == 0


@pytest.mark.parametrize("name", ["route.toml", "connection.toml", "stageline.local.toml", "Routes.toml"])
def test_an_unknown_toml_file_in_the_config_dir_is_an_error_naming_the_known_ones(tmp_path, name):
    conf = conf_dir(tmp_path, "", **{name: "[[route]]\n"})
    report = check_dir(conf, store_tables=set())
    assert [(p.file.name, p.key) for p in report.problems] == [(name, "")]
    assert (
        "connections.toml, routes.toml, destinations.toml, transforms.toml, keys.toml, stageline.toml"
        in report.problems[0].message
    )


def test_other_files_of_a_config_dir_are_not_problems(tmp_path):
    conf = conf_dir(tmp_path, "", **{"README.md": "notes", "lookups.csv.bak": ""})
    (conf / "code").mkdir()
    (conf / "code" / "hooks.py").write_text("")
    assert check_dir(conf, store_tables=set()).ok


def test_a_loader_that_blows_up_is_a_problem_line_not_a_traceback(tmp_path, monkeypatch):
    import listeners.config_check as cc

    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(cc, "parse_connections", boom)
    report = check_dir(conf_dir(tmp_path, ""), store_tables=set())
    assert [str(p) for p in report.problems] == [
        f"{(tmp_path / 'conf' / 'connections.toml').resolve()}: cannot be checked: RuntimeError: unexpected"
    ]


@pytest.mark.parametrize("name", sorted(SCHEMA_FILES))
def test_the_published_json_schemas_are_current(name):
    """docs/schema/<file>.json is what `stageline config schema --file <file>` prints; regenerate with
    `for f in connections stageline routes destinations transforms; do stageline config schema --file $f
    > docs/schema/$f.json; done`."""
    assert (ROOT / "docs" / "schema" / f"{name}.json").read_text() == schema_text(name)


def test_config_schema_prints_every_files_schema(tmp_path):
    import json

    done = subprocess.run([str(STAGELINE), "config", "schema"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert sorted(doc) == sorted(SCHEMA_FILES)
    inbound = doc["connections"]["$defs"]["InboundModel"]
    assert inbound["additionalProperties"] is False
    assert inbound["properties"]["port"] == {
        "default": 0,
        "maximum": 65535,
        "minimum": 0,
        "title": "Port",
        "type": "integer",
    }
    assert inbound["properties"]["kind"]["enum"] == ["mllp", "tcp", "file", "http", "database"]
    one = subprocess.run(
        [str(STAGELINE), "config", "schema", "--file", "stageline"], capture_output=True, text=True, timeout=60
    )
    assert json.loads(one.stdout)["properties"].keys() == {"store", "cluster", "retention"}


def test_the_shipped_and_deploy_config_dirs_pass(tmp_path):
    for conf in (ROOT / "config", ROOT / "deploy" / "config"):
        report = check_dir(
            conf,
            store_tables=None,
            lookups_unverified_ok=True,
            service_config=conf.parent / "stageline.toml" if (conf.parent / "stageline.toml").exists() else None,
        )
        assert report.ok, [str(p) for p in report.problems]


def test_every_command_refuses_a_bad_service_config_with_every_problem_and_exit_2(tmp_path):
    service = tmp_path / "stageline.toml"
    service.write_text('[store]\npool_size = "5"\nbackend = "mysql"\n')
    done = subprocess.run(
        [str(STAGELINE), "--service-config", str(service), "cluster", "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"{service}: store.backend: must be one of 'sqlite', 'postgres', 'sqlserver'" in done.stderr
    assert f"{service}: store.pool_size: must be an integer, got a string" in done.stderr
    assert "Traceback" not in done.stderr


def test_every_runtime_setting_has_its_key_in_the_schema_and_back():
    """The frozen dataclasses the code reads are built from the models: a field added to one and not
    the other would be a setting nobody can set, or one that is silently dropped."""
    from dataclasses import fields

    from include import config as cfgmod
    from include.schema import connections as conn_schema
    from include.schema import service
    from listeners import connections_config

    pairs = [
        (connections_config.InboundConfig, conn_schema.InboundModel, {"conformance"}),
        (connections_config.DatabaseSource, conn_schema.DatabaseSourceModel, set()),
        (connections_config.TLSConfig, conn_schema.TLSModel, set()),
        (cfgmod.StoreConfig, service.StoreModel, {"password"}),
        (cfgmod.ClusterConfig, service.ClusterModel, set()),
        (cfgmod.RetentionConfig, service.RetentionModel, set()),
    ]
    for runtime, model, not_in_file in pairs:
        keys = {info.alias or name for name, info in model.model_fields.items()}
        assert {f.name for f in fields(runtime)} - not_in_file == keys, runtime.__name__


@pytest.mark.parametrize("value", ['"1"', "true", "-1", "1.0", "17"])
def test_sync_standbys_expected_is_a_small_whole_number_and_config_check_names_it(tmp_path, value):
    conf = conf_dir(tmp_path, "")
    service = tmp_path / "stageline.toml"
    service.write_text(f'[store]\nbackend = "postgres"\nsync_standbys_expected = {value}\n')
    done = check(conf, "--service-config", str(service))
    assert done.returncode == 2
    assert {line.split(": ")[1] for line in lines(done) if line.startswith(str(service))} == {
        "store.sync_standbys_expected"
    }, done.stdout


def test_sync_standbys_expected_needs_a_postgres_store():
    from include.config import ConfigError, parse

    assert parse({"store": {"backend": "postgres", "sync_standbys_expected": 1}}).store.sync_standbys_expected == 1
    assert parse({"store": {"backend": "postgres"}}).store.sync_standbys_expected == 0
    with pytest.raises(ConfigError) as refused:
        parse({"store": {"backend": "sqlite", "sync_standbys_expected": 1}})
    assert [p.key for p in refused.value.problems] == ["store.sync_standbys_expected"]
    assert "needs backend" in str(refused.value)
