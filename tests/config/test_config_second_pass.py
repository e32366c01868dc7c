"""The second red-team pass's config findings (issue 23, "Safe edges", /tmp/red_second items M1-M3,
L4): each said `config OK` before (or lost a problem), and is a problem line with file and key now.
A file drop on a TLS key's directory is refused by a real `listenerd` before it moves the key."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from include.schema.filedrop_paths import processing_dir
from listeners.config_check import EXIT_PROBLEMS, check_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGELINE_VAR", str(tmp_path / "var"))


def conf_dir(tmp_path: Path, connections: str) -> Path:
    conf = tmp_path / "conf"
    conf.mkdir(exist_ok=True)
    (conf / "connections.toml").write_text(connections)
    return conf


def problems(conf: Path, **kw: object) -> list[str]:
    return [str(p) for p in check_dir(conf, store_tables=set(), **kw).problems]


def file_conn(name: str, directory: str, extra: str = "") -> str:
    return f'[[inbound]]\nname = "{name}"\nkind = "file"\ndirectory = "{directory}"\n{extra}\n'


def cli(conf: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`stageline config check` as the CLI runs it."""
    return subprocess.run(
        [sys.executable, "-m", "listeners.config_check", str(conf), "--no-store", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ),
    )


def keys_dir(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    keys.mkdir(exist_ok=True)
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (keys / name).write_text("-----BEGIN PLACEHOLDER-----\n")
    return keys


# -- M1: a drop on the service config's, a TLS file's or a system directory ----------------------


def test_a_drop_on_the_api_tls_key_directory_is_refused(tmp_path):
    """Repro /tmp/red_second/repro_k1_connections.toml: listenerd staged key.pem and moved it away."""
    keys = keys_dir(tmp_path)
    conf = conf_dir(
        tmp_path,
        f'[api]\nport = 8470\n[api.tls]\ncert = "{keys / "cert.pem"}"\n'
        f'key = "{keys / "key.pem"}"\n\n' + file_conn("f", str(keys)),
    )
    done = cli(conf)
    assert done.returncode == EXIT_PROBLEMS, done.stdout + done.stderr
    assert (
        f"{conf / 'connections.toml'}: inbound[0].directory: {keys} is the directory of the TLS file "
        "api.tls.cert" in done.stdout
    ), done.stdout


def test_an_archive_or_error_directory_on_an_inbound_tls_directory_is_refused(tmp_path):
    keys = keys_dir(tmp_path)
    tls = f'tls = {{ cert = "{keys / "cert.pem"}", key = "{keys / "key.pem"}" }}\n'
    conf = conf_dir(
        tmp_path,
        f'[[inbound]]\nname = "m"\nkind = "mllp"\nport = 2575\n{tls}\n'
        + file_conn("f", str(tmp_path / "in"), f'archive = "{keys}"')
        + file_conn("g", str(tmp_path / "in2"), f'error_directory = "{keys}"'),
    )
    found = problems(conf)
    for key in ("inbound[1].archive", "inbound[2].error_directory"):
        assert any(f"{key}: {keys} is the directory of the TLS file inbound[0].tls.cert" in p for p in found), found


def test_a_drop_on_the_service_config_directory_is_refused(tmp_path):
    home = tmp_path / "etc-stageline"
    home.mkdir()
    (home / "stageline.toml").write_text(f'[store]\npath = "{tmp_path / "data" / "store.db"}"\n')
    for key, table in (
        ("directory", file_conn("f", str(home))),
        ("archive", file_conn("g", str(tmp_path / "in"), f'archive = "{home}"')),
    ):
        conf = conf_dir(tmp_path, table)
        done = cli(conf, "--service-config", str(home / "stageline.toml"))
        assert done.returncode == EXIT_PROBLEMS, done.stdout + done.stderr
        assert (
            f"{conf / 'connections.toml'}: inbound[0].{key}: {home} is the directory of the service config"
            in done.stdout
        ), done.stdout
        assert cli(conf).returncode == 0, cli(conf).stdout  # no service config there: nothing of ours


@pytest.mark.parametrize(
    "key, path, what",
    [
        ("directory", "/", "/ contains the config dir"),
        ("directory", "/etc", "is the system directory /etc"),
        ("directory", "/home", "is the system directory /home"),
        ("directory", "/var/lib", "is the system directory"),
        ("directory", "/proc", "is the system directory /proc"),
        ("directory", "/run", "is the system directory /run"),
        ("directory", "/root", "is the system directory /root"),
        ("directory", "/var", "contains the system directory"),
        ("directory", "/usr/share/doc", "lies inside the system directory"),
        ("directory", "/etc/ssl/private", "lies inside the system directory /etc"),
        ("archive", "/etc", "is the system directory /etc"),
        ("error_directory", "/dev", "is the system directory /dev"),
    ],
)
def test_a_file_connection_on_a_system_tree_is_refused(tmp_path, key, path, what):
    drop = tmp_path / "in"
    conf = conf_dir(
        tmp_path, file_conn("f", path) if key == "directory" else file_conn("f", str(drop), f'{key} = "{path}"')
    )
    found = problems(conf)
    assert any(f"inbound[0].{key}: " in p and what in p for p in found), found


@pytest.mark.parametrize("path", ["/home/partner/drop", "/var/lib/stageline/drop", "/srv/hl7/in"])
def test_a_drop_below_home_or_var_lib_is_still_allowed(tmp_path, path):
    assert problems(conf_dir(tmp_path, file_conn("f", path))) == []


# -- M2: a drop on another connection's processing directory ----------------------------------------


def test_a_drop_on_another_connections_processing_directory_is_refused(tmp_path):
    """Repro /tmp/red_second/repro_w2_connections.toml: each file was staged twice."""
    arch = tmp_path / "arch"
    processing = arch / ".processing-f1"
    conf = conf_dir(
        tmp_path,
        file_conn("f1", str(tmp_path / "drop"), f'archive = "{arch}"')
        + file_conn("f2", str(processing))
        + file_conn("f3", str(arch / "sub"))
        + file_conn("f4", str(tmp_path / "ok")),
    )
    found = problems(conf)
    path = conf / "connections.toml"
    assert any(
        p.startswith(
            f"{path}: inbound[1].directory: {processing} is (or lies inside) the processing "
            "directory of connection 'f1'"
        )
        for p in found
    ), found
    assert any(
        p.startswith(f"{path}: inbound[2].directory: {arch / 'sub'} is (or lies inside) the archive of connection 'f1'")
        for p in found
    ), found
    assert not any("inbound[3]" in p or "inbound[0]" in p for p in found), found


def test_the_processing_rule_is_the_one_listenerd_uses(tmp_path):
    from listeners.connections_config import load_config_dir
    from listeners.filedrop import default_processing

    conf = conf_dir(
        tmp_path,
        file_conn("f1", str(tmp_path / "in")) + file_conn("f2", str(tmp_path / "in2"), f'archive = "{tmp_path / "a"}"'),
    )
    for conn in load_config_dir(conf).inbound:  # archive filled in (default or configured), as at run time
        assert default_processing(conn.name, conn.archive) == processing_dir(conn.name, conn.archive)
    default = load_config_dir(conf).inbound[0]
    assert (
        processing_dir(default.name, default.archive)
        == tmp_path / "var" / "filedrop" / "f1" / "archive" / ".processing-f1"
    )


# -- M3: the allowlist judged as a whole --------------------------------------------------------

MLLP_ANY = '[[inbound]]\nname = "adt-in"\nkind = "mllp"\nhost = "0.0.0.0"\nport = 2575\nallow_insecure_bind = true\n'


def allowlist(cidrs: list[str], extra: str = "") -> str:
    return MLLP_ANY + "allowed_sources = [" + ", ".join(f'"{c}"' for c in cidrs) + "]\n" + extra


@pytest.mark.parametrize(
    "cidrs, version",
    [
        ([f"{i}.0.0.0/8" for i in range(256)], 4),  # repro_a5: every IPv4 address, one /8 at a time
        (["10.0.0.0/8", "11.0.0.0/8"], 4),
        (["10.0.0.0/8", "::ffff:11.0.0.0/104"], 4),  # a mapped entry is IPv4
        (["2001::/16", "2002::/16"], 6),
    ],
)
def test_an_allowlist_whose_union_is_wider_than_a_slash_8_does_not_authenticate(tmp_path, cidrs, version):
    conf = conf_dir(tmp_path, allowlist(cidrs))
    found = problems(conf)
    assert [p.split(": ")[1] for p in found] == ["inbound[0].allowed_sources"], found
    assert (
        f"the IPv{version} entries together admit" in found[0] and "allow_unauthenticated_senders = true" in found[0]
    ), found
    conf_dir(tmp_path, allowlist(cidrs, "allow_unauthenticated_senders = true\n"))
    assert problems(conf) == []  # said explicitly: accepted


def test_overlapping_entries_count_once(tmp_path):
    cidrs = ["10.0.0.0/8", "10.1.0.0/16", "10.2.3.4", "::ffff:10.9.0.0/112", "2001::/16", "2001:db8::/32"]
    assert (
        sum(n.num_addresses for n in ipaddress.collapse_addresses(ipaddress.ip_network(c) for c in cidrs[:3])) == 2**24
    )
    assert problems(conf_dir(tmp_path, allowlist(cidrs))) == []


# -- L4: a key of another kind beside a field's own problem --------------------------------------


def test_a_bad_field_and_a_key_of_another_kind_are_reported_together(tmp_path):
    (tmp_path / "in").mkdir()
    conf = conf_dir(tmp_path, file_conn("f", str(tmp_path / "in"), 'lane_key = "bad!!"\nport = 5\ncharset = "klingon"'))
    keys = sorted(p.split(": ")[1] for p in problems(conf))
    assert keys == ["inbound[0].charset", "inbound[0].lane_key", "inbound[0].port"], keys
    assert any("inbound[0].port: only for kind" in p for p in problems(conf))


def test_a_type_error_and_a_key_of_another_kind_are_reported_together(tmp_path):
    conf = conf_dir(tmp_path, '[[inbound]]\nname = "c"\nkind = "mllp"\nport = "2575"\ndirectory = "/srv/in"\n')
    found = problems(conf)
    assert any("inbound[0].port: must be an integer" in p for p in found), found
    assert any('inbound[0].directory: only for kind = "file"' in p for p in found), found


def test_a_nested_rule_keeps_its_key_beside_a_key_of_another_kind(tmp_path):
    keys = keys_dir(tmp_path)
    (tmp_path / "in").mkdir()
    conf = conf_dir(
        tmp_path,
        file_conn(
            "f",
            str(tmp_path / "in"),
            f'tls = {{ cert = "{keys / "cert.pem"}", key = "{keys / "key.pem"}", require_client_cert = true }}',
        ),
    )
    found = problems(conf)
    assert any("inbound[0].tls.ca: require_client_cert needs ca" in p for p in found), found
    assert any("inbound[0].tls: only for kind" in p for p in found), found


# -- a real listenerd ---------------------------------------------------------------------------


def test_listenerd_with_a_drop_on_its_tls_key_directory_exits_2_and_moves_nothing(tmp_path):
    from include.app.lab.listenerd import Daemon
    from tests.conftest import migrated_sqlite, refused_start

    keys = keys_dir(tmp_path)
    store = tmp_path / "data" / "store.db"
    store.parent.mkdir()
    config = migrated_sqlite(store)
    d = Daemon(
        tmp_path / "node",
        config,
        node_id="n:1:a",
        inbound=[
            {
                "name": "m",
                "kind": "mllp",
                "port": 0,
                "tls": {"cert": str(keys / "cert.pem"), "key": str(keys / "key.pem")},
            },
            {"name": "keys", "kind": "file", "directory": str(keys), "poll_seconds": 0.1},
        ],
    )
    out = refused_start(d)
    assert f"inbound[1].directory: {keys} is the directory of the TLS file inbound[0].tls.cert" in out, out
    assert sorted(p.name for p in keys.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]  # nothing moved
