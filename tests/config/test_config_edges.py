"""The red team's config findings (issue 23, "Safe edges", /tmp/red_ops items 3, 4, 5, 14, 15, 17):
each said `config OK` (or hung) before, and is a problem line with file and key now. A file drop
on the config dir or the store's directory is refused by a real `listenerd` before it moves a file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from listeners.config_check import EXIT_PROBLEMS, check_dir
from listeners.connections_config import ConnectionConfigError, load_config_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGELINE_VAR", str(tmp_path / "var"))


def conf_dir(tmp_path: Path, connections: str | None, **files: str) -> Path:
    conf = tmp_path / "conf"
    conf.mkdir(exist_ok=True)
    if connections is not None:
        (conf / "connections.toml").write_text(connections)
    for name, text in files.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text)
    return conf


def check(conf: Path, *extra: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`stageline config check` as the CLI runs it."""
    env = {**os.environ, "STAGELINE_VAR": os.environ["STAGELINE_VAR"]}
    return subprocess.run(
        [sys.executable, "-m", "listeners.config_check", str(conf), "--no-store", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def problems(conf: Path, **kw: object) -> list[str]:
    return [str(p) for p in check_dir(conf, store_tables=set(), **kw).problems]


def file_conn(name: str, directory: str, extra: str = "") -> str:
    return f'[[inbound]]\nname = "{name}"\nkind = "file"\ndirectory = "{directory}"\n{extra}\n'


# -- 3: a drop directory on Stageline's own directories -------------------------------------------


def test_a_drop_directory_that_is_the_config_dir_the_store_dir_or_the_var_dir_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "stageline.toml").write_text(f'[store]\npath = "{data / "store.db"}"\n')
    conf = conf_dir(
        tmp_path,
        file_conn("cfgdir", ".")
        + file_conn("storedir", str(data))
        + file_conn("vardir", str(tmp_path / "var" / "x"))
        + file_conn("above", str(tmp_path))
        + file_conn("arch", str(tmp_path / "in"), f'archive = "{conf_path(tmp_path)}/lookups"')
        + file_conn("ok", str(tmp_path / "in2"), f'archive = "{data / "archive"}"'),
    )
    done = check(conf, "--service-config", str(tmp_path / "stageline.toml"))
    assert done.returncode == EXIT_PROBLEMS, done.stdout
    path = conf / "connections.toml"
    expected = [
        f"{path}: inbound[0].directory: {conf} is the config dir",
        f"{path}: inbound[1].directory: {data} is the store's directory",
        f"{path}: inbound[2].directory: {tmp_path / 'var' / 'x'} lies inside Stageline's var dir",
        f"{path}: inbound[3].directory: {tmp_path} contains the config dir",
        f"{path}: inbound[4].archive: {conf / 'lookups'} lies inside the config dir",
    ]
    out = done.stdout.splitlines()
    for want in expected:
        assert any(line.startswith(want) for line in out), (want, done.stdout)
    assert not any("inbound[5]" in line for line in out), done.stdout  # beside the store is fine


def conf_path(tmp_path: Path) -> Path:
    return tmp_path / "conf"


def test_the_var_dirs_own_filedrop_defaults_are_allowed(tmp_path):
    conf = conf_dir(
        tmp_path,
        file_conn("drop", str(tmp_path / "in"), f'archive = "{tmp_path / "var" / "filedrop" / "drop" / "done"}"'),
    )
    (tmp_path / "in").mkdir()
    assert problems(conf) == []
    [conn] = load_config_dir(conf).inbound
    assert conn.error_directory == str(tmp_path / "var" / "filedrop" / "drop" / "done" / "rejected")


def test_listenerd_with_a_drop_on_its_config_and_store_dirs_exits_2_and_moves_nothing(tmp_path):
    from include.app.lab.listenerd import Daemon
    from tests.conftest import migrated_sqlite, refused_start

    store = tmp_path / "data" / "store.db"
    store.parent.mkdir()
    config = migrated_sqlite(store)
    d = Daemon(
        tmp_path / "node",
        config,
        node_id="n:1:a",
        inbound=[
            {"name": "cfgdir", "kind": "file", "directory": ".", "poll_seconds": 0.1},
            {"name": "storedir", "kind": "file", "directory": str(store.parent), "poll_seconds": 0.1},
        ],
    )
    out = refused_start(d)
    conf = d.workdir / "config"
    assert f"{conf / 'connections.toml'}: inbound[0].directory: {conf} is the config dir" in out
    assert f"{conf / 'connections.toml'}: inbound[1].directory: {store.parent} is the store's directory" in out
    assert (conf / "connections.toml").is_file() and store.is_file()  # nothing staged, nothing moved


# -- 4: one drop directory, two connections ------------------------------------------------------


def test_two_connections_on_one_drop_or_an_archive_into_another_drop_are_refused(tmp_path):
    drop, other = tmp_path / "drop", tmp_path / "arch4"
    conf = conf_dir(
        tmp_path,
        file_conn("f1", str(drop))
        + file_conn("f2", str(drop))
        + file_conn("f4", str(other), f'archive = "{drop}"')
        + file_conn("f5", str(tmp_path / "d5"), f'error_directory = "{drop / "sub"}"'),
    )
    path = conf / "connections.toml"
    found = problems(conf)
    for want in [
        f"{path}: inbound[1].directory: {drop} is also the drop directory of connection 'f1'",
        f"{path}: inbound[2].archive: {drop} is (or lies inside) the drop directory of connection 'f1'",
        f"{path}: inbound[3].error_directory: {drop / 'sub'} is (or lies inside) the drop directory",
    ]:
        assert any(p.startswith(want) for p in found), (want, found)


# -- 5: allowed_sources that let everyone in ------------------------------------------------------

MLLP_ANY = '[[inbound]]\nname = "adt-in"\nkind = "mllp"\nhost = "0.0.0.0"\nport = 2575\nallow_insecure_bind = true\n'


@pytest.mark.parametrize(
    "cidrs, bad",
    [
        (["0.0.0.0/0", "::/0"], [0, 1]),
        (["10.0.0.0/8", "0.0.0.0/1"], [1]),
        (["2001:db8::/32", "fc00::/7"], [1]),
        (["::ffff:0:0/96", "::ffff:10.0.0.0/104"], [0]),
    ],
)
def test_an_allowlist_wider_than_a_slash_8_does_not_authenticate_senders(tmp_path, cidrs, bad):
    conf = conf_dir(tmp_path, MLLP_ANY + f"allowed_sources = {cidrs!r}\n".replace("'", '"'))
    found = problems(conf)
    assert [p.split(": ")[1] for p in found] == [f"inbound[0].allowed_sources[{i}]" for i in bad], found
    assert "allow_unauthenticated_senders = true" in found[0]
    conf_dir(
        tmp_path,
        MLLP_ANY + f"allowed_sources = {cidrs!r}\n".replace("'", '"') + "allow_unauthenticated_senders = true\n",
    )
    assert problems(conf) == []  # said explicitly: accepted


def test_a_cidr_with_host_bits_is_an_error_not_a_wider_network(tmp_path):
    """`10.1.2.3/8` is a typo for /28 or /32 far more often than a wish to let in all of 10/8."""
    conf = conf_dir(tmp_path, MLLP_ANY + 'allowed_sources = ["10.1.2.3/8", "10.1.2.0/28"]\n')
    found = problems(conf)
    assert len(found) == 1 and "inbound[0].allowed_sources[0]" in found[0] and "host bits" in found[0], found


def test_a_narrow_allowlist_still_counts(tmp_path):
    conf = conf_dir(tmp_path, MLLP_ANY + 'allowed_sources = ["10.0.0.0/8", "10.1.2.7", "2001::/16"]\n')
    assert problems(conf) == []


# -- 14: bounds ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting, message",
    [
        ("poll_seconds = 1e-9", "poll_seconds: must be >= 0.05"),
        ("poll_seconds = 0.0", "poll_seconds: must be >= 0.05"),
        ("poll_seconds = 86400.0", "poll_seconds: must be <= 3600"),
        ("max_message_bytes = 4294967296", "max_message_bytes: must be <= 1073741824"),
    ],
)
def test_a_busy_loop_or_an_absurd_value_is_refused(tmp_path, setting, message):
    (tmp_path / "in").mkdir()
    conf = conf_dir(tmp_path, file_conn("drop", str(tmp_path / "in"), setting))
    assert [p for p in problems(conf) if message in p], problems(conf)
    conf_dir(tmp_path, file_conn("drop", str(tmp_path / "in"), "poll_seconds = 0.05"))
    assert problems(conf) == []


@pytest.mark.parametrize("key", ["idle_timeout_seconds", "frame_timeout_seconds", "handshake_timeout_seconds"])
def test_a_timeout_over_a_day_is_refused(tmp_path, key):
    conf = conf_dir(tmp_path, f'[[inbound]]\nname = "a"\nkind = "mllp"\n{key} = 1e9\n')
    assert [p for p in problems(conf) if f"inbound[0].{key}: must be <= 86400" in p], problems(conf)


# -- 15: a fifo or a device where a config file belongs -------------------------------------------


@pytest.mark.parametrize("name", ["routes.toml", "connections.toml", "lookups/x.csv", "extra.toml"])
def test_a_fifo_config_file_is_a_problem_line_not_a_hang(tmp_path, name):
    conf = conf_dir(tmp_path, "")
    (conf / name).parent.mkdir(exist_ok=True)
    (conf / name).unlink(missing_ok=True)
    os.mkfifo(conf / name)
    started = time.monotonic()
    done = check(conf, timeout=20)
    assert time.monotonic() - started < 15
    assert done.returncode == EXIT_PROBLEMS, done.stdout + done.stderr
    assert f"{conf / name}: not a regular file (a fifo)" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_dev_zero_through_a_link_and_a_huge_file_are_problem_lines(tmp_path):
    conf = conf_dir(tmp_path, None, **{"routes.toml": "# x\n" * 300_000})
    (conf / "connections.toml").symlink_to("/dev/zero")
    done = check(conf, timeout=20)
    assert done.returncode == EXIT_PROBLEMS, done.stdout + done.stderr
    assert f"{conf / 'connections.toml'}: not a regular file (a device)" in done.stdout
    assert f"{conf / 'routes.toml'}: 1200000 bytes, more than the 1048576 a config file may have" in done.stdout
    with pytest.raises(ConnectionConfigError, match="not a regular file"):
        load_config_dir(conf)


# -- 17: what run time would trip over -----------------------------------------------------------


def test_a_missing_drop_directory_is_a_warning(tmp_path):
    conf = conf_dir(tmp_path, file_conn("drop", str(tmp_path / "not-yet")))
    done = check(conf)
    assert done.returncode == 0, done.stdout
    assert (
        f"warning: {conf / 'connections.toml'}: inbound[0].directory: {tmp_path / 'not-yet'} does not exist"
        in done.stdout
    )


@pytest.mark.parametrize("key", ["directory", "archive", "error_directory"])
def test_a_directory_named_through_a_symlink_is_refused_naming_the_real_one(tmp_path, key):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    values = {"directory": str(tmp_path / "in"), key: str(tmp_path / "link")}
    (tmp_path / "in").mkdir(exist_ok=True)
    body = '[[inbound]]\nname = "drop"\nkind = "file"\n' + "".join(f'{k} = "{v}"\n' for k, v in values.items())
    conf = conf_dir(tmp_path, body)
    found = problems(conf)
    assert any(
        p.startswith(
            f"{conf / 'connections.toml'}: inbound[0].{key}: {tmp_path / 'link'} is named "
            f"through a symbolic link; name the real directory, {real}"
        )
        for p in found
    ), found


@pytest.mark.parametrize(
    "kind, setting, key, only",
    [
        ("file", 'host = "0.0.0.0"', "host", 'kind = "mllp" or kind = "tcp" or kind = "http"'),
        ("file", "port = 2575", "port", 'kind = "mllp"'),
        ("mllp", 'directory = "/srv/in"', "directory", 'kind = "file"'),
        ("mllp", 'framing = "length"', "framing", 'kind = "tcp"'),
        ("http", "poll_seconds = 2.0", "poll_seconds", 'kind = "file" or kind = "database"'),
    ],
)
def test_a_key_of_another_kind_is_refused(tmp_path, kind, setting, key, only):
    (tmp_path / "in").mkdir()
    extra = f'directory = "{tmp_path / "in"}"\n' if kind == "file" else ""
    conf = conf_dir(tmp_path, f'[[inbound]]\nname = "c"\nkind = "{kind}"\n{extra}{setting}\n')
    found = problems(conf)
    assert any(p.startswith(f"{conf / 'connections.toml'}: inbound[0].{key}: only for {only}") for p in found), found


def test_a_retention_override_for_no_connection_is_refused(tmp_path):
    conf = conf_dir(tmp_path, '[[inbound]]\nname = "adt-in"\nkind = "mllp"\n')
    service = tmp_path / "stageline.toml"
    service.write_text(
        f'[store]\npath = "{tmp_path / "s.db"}"\n[retention.connections.adt-inn]\ninbound_days = 1.0\n'
        "[retention.connections.adt-in]\ninbound_days = 2.0\n"
    )
    found = problems(conf, service_config=service)
    assert found == [
        f"{service}: retention.connections.adt-inn: no inbound connection 'adt-inn' in connections.toml "
        "(configured: adt-in); the override would apply to nothing"
    ], found


def test_a_long_connection_name_and_an_absurd_lane_key_are_refused(tmp_path):
    conf = conf_dir(
        tmp_path,
        f'[[inbound]]\nname = "{"n" * 65}"\nkind = "mllp"\n'
        '[[inbound]]\nname = "b"\nkind = "mllp"\nlane_key = "PID-99999999999999999999"\n'
        '[[inbound]]\nname = "c"\nkind = "mllp"\nlane_key = "PID-1000"\n',
    )
    found = problems(conf)
    assert any("inbound[0].name: " in p and "64" in p for p in found), found
    assert any("inbound[1].lane_key: " in p and "past 99999" in p for p in found), found  # the path grammar's cap
    assert any("inbound[2].lane_key: " in p and "above 999" in p for p in found), found  # no segment has 1000 fields
    conf_dir(tmp_path, f'[[inbound]]\nname = "{"n" * 64}"\nkind = "mllp"\nlane_key = "PID-3.1"\n')
    assert problems(conf) == []


@pytest.mark.parametrize(
    "setting, message",
    [
        ("[cluster]\nheartbeat_seconds = 0.001", "cluster.heartbeat_seconds: must be >= 0.05"),
        ("[cluster]\nreclaim_interval_seconds = 1e-9", "cluster.reclaim_interval_seconds: must be >= 0.05"),
        ("[cluster]\nnode_timeout_seconds = 1e12", "cluster.node_timeout_seconds: must be <= 86400"),
        ("[retention]\ninbound_days = 1e9", "retention.inbound_days: must be <= 36500"),
    ],
)
def test_a_service_loop_that_would_spin_or_an_absurd_period_is_refused(tmp_path, setting, message):
    conf = conf_dir(tmp_path, "")
    service = tmp_path / "stageline.toml"
    service.write_text(f'[store]\npath = "{tmp_path / "s.db"}"\n{setting}\n')
    found = problems(conf, service_config=service)
    assert [p for p in found if p.startswith(f"{service}: {message}")], found


def test_a_fifo_service_config_is_a_problem_line_not_a_hang(tmp_path):
    conf = conf_dir(tmp_path, "")
    os.mkfifo(tmp_path / "stageline.toml")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "listeners.config_check",
            str(conf),
            "--service-config",
            str(tmp_path / "stageline.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=ROOT,
    )
    assert done.returncode == EXIT_PROBLEMS, done.stdout + done.stderr
    assert f"{tmp_path / 'stageline.toml'}: not a regular file (a fifo)" in done.stdout
