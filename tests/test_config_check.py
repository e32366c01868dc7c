"""`stageline config check [DIR]` lists every problem of a config dir at once, each with its file and
key, and exits 2; the example config passes; `listenerd` and `stageline up` run the same check and
refuse to start on a broken dir, before binding or migrating anything."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGELINE = Path(sys.executable).parent / "stageline"

BROKEN = {
    "connections.toml": """
[api]
port = 99999

[[api.tokens]]
role = "boss"
token_env = "SOME_TOKEN"

[[inbound]]
name = "adt-in"
kind = "mllp"
port = 70000

[[inbound]]
name = "drop"
kind = "carrier-pigeon"

[[inbound]]
name = "adt-in"
kind = "tcp"
bogus = 1
""",
    "routes.toml": """
[[route]]
name = "to-nowhere"
destinations = ["nowhere"]

[[route]]
name = "bad-op"
destinations = ["ehr"]
when = { field = "PID-3", op = "like", value = "x" }
""",
    "destinations.toml": """
[[destination]]
name = "ehr"
kind = "mllp"
host = "127.0.0.1"
port = 2576

[[destination]]
name = "ftp-server"
kind = "ftp"
""",
    "transforms.toml": """
[[transform]]
destination = "ehr"
rules = [{ set = "MSH-5" }]

[[transform]]
destination = "ghost"
rules = [{ map = "PV1-2", table = "no_such_table" }]
""",
    "lookups/empty.csv": "code,value\n",
}

EXPECTED = [  # (file, key, what the message says), in the order printed
    ("connections.toml", "inbound[0].port", "must be <= 65535 (connection 'adt-in')"),
    ("connections.toml", "inbound[1].kind", "must be one of 'mllp', 'tcp', 'file', 'http', 'database'"),
    ("connections.toml", "inbound[2].bogus", "unknown setting"),
    ("connections.toml", "api.port", "must be <= 65535"),
    ("connections.toml", "api.tokens[0].role", "must be one of viewer, operator, admin"),
    ("connections.toml", "inbound[2].name", "duplicate connection name 'adt-in'"),
    ("destinations.toml", "destination[1].kind", "must be one of mllp, file, http, got 'ftp'"),
    ("lookups/empty.csv", None, "no entries after the header line"),
    ("routes.toml", "route[1].when", "unknown op 'like'"),
    ("routes.toml", "route[0].destinations", "'nowhere' is not configured in destinations.toml"),
    ("transforms.toml", "transform[0].rules[0]", "needs 'value'"),
    ("transforms.toml", "transform[1].destination", "'ghost' is not configured in destinations.toml"),
    ("transforms.toml", "transform[1].rules[0].table", "lookup table 'no_such_table': no lookups/no_such_table.csv"),
]


def broken_dir(tmp_path: Path) -> Path:
    conf = tmp_path / "broken"
    for name, text in BROKEN.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text)
    return conf


def assert_every_problem(output: str, conf: Path, prefix: str = "") -> None:
    lines = [line.removeprefix(prefix) for line in output.splitlines() if line.startswith(prefix + str(conf))]
    assert len(lines) == len(EXPECTED), output
    for line, (file, key, message) in zip(lines, EXPECTED):
        head = f"{conf / file}: " + (f"{key}: " if key else "")
        assert line.startswith(head) and message in line.removeprefix(head), (line, head, message)


def test_config_check_prints_every_problem_with_file_and_key_and_exits_2(tmp_path):
    conf = broken_dir(tmp_path)
    (tmp_path / "stageline.toml").write_text(f'[store]\npath = "{tmp_path / "none.db"}"\n')
    done = subprocess.run(
        [str(STAGELINE), "config", "check", str(conf), "--service-config", str(tmp_path / "stageline.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert_every_problem(done.stdout, conf)
    assert done.stdout.splitlines()[-1].endswith(f"{len(EXPECTED)} problem(s)")


def test_the_example_config_passes(tmp_path):
    done = subprocess.run(
        [str(STAGELINE), "config", "check", str(ROOT / "config")], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith(f"config OK: {ROOT / 'config'}: 1 inbound connections")


def test_a_lookup_table_already_in_the_store_needs_no_csv(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "config", conf)
    (conf / "lookups" / "patient_class.csv").unlink()
    (tmp_path / "stageline.toml").write_text(f'[store]\npath = "{tmp_path / "s.db"}"\n')
    check = [str(STAGELINE), "config", "check", str(conf), "--service-config", str(tmp_path / "stageline.toml")]
    missing = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "lookup table 'patient_class': no lookups/patient_class.csv" in missing.stdout
    csv = str(ROOT / "config/lookups/patient_class.csv")
    for argv in (["db", "migrate"], ["lookups", "import", "patient_class", csv]):
        subprocess.run(
            [str(STAGELINE), "--service-config", str(tmp_path / "stageline.toml"), *argv],
            check=True,
            capture_output=True,
            timeout=60,
        )
    found = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stdout


def test_listenerd_refuses_a_broken_config_dir_naming_every_problem(tmp_path):
    conf = broken_dir(tmp_path)
    (tmp_path / "stageline.toml").write_text(f'[store]\npath = "{tmp_path / "s.db"}"\n')
    # a migrated store: the lookup tables a transform names are looked for there too (unreadable, unchecked)
    subprocess.run(
        [str(STAGELINE), "--service-config", str(tmp_path / "stageline.toml"), "db", "migrate"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "listeners.daemon",
            "--service-config",
            str(tmp_path / "stageline.toml"),
            "--config",
            str(conf),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert_every_problem(done.stderr, conf, prefix="listenerd: configuration error: ")


def test_stageline_up_refuses_a_broken_config_dir_before_starting_anything(tmp_path):
    conf = broken_dir(tmp_path)
    (tmp_path / "stageline.toml").write_text(f'[store]\npath = "{tmp_path / "s.db"}"\n')
    done = subprocess.run(
        [str(STAGELINE), "up", "--service-config", str(tmp_path / "stageline.toml"), "--config", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "STAGELINE_VAR": str(tmp_path / "var")},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert_every_problem(done.stdout, conf)
    assert "nothing was started" in done.stderr
    assert not (tmp_path / "s.db").exists()  # not even migrated


# -- listenerd: start and SIGHUP reload go through the same schema ------------------------------


def test_listenerd_with_a_badly_typed_config_exits_2_with_file_and_key_not_a_traceback(tmp_path, sqlite_config_fresh):
    from include.app.lab.listenerd import Daemon
    from include.app.lab.postgres_server import free_port
    from tests.conftest import refused_start

    port = free_port()
    d = Daemon(
        tmp_path / "node",
        sqlite_config_fresh,
        node_id="n:1:a",
        inbound=[
            {
                "name": "open",
                "kind": "mllp",
                "host": "0.0.0.0",
                "port": port,
                "allow_insecure_bind": "no",
                "allowed_sources": ["10.0.0.0/8"],
            },
            {"name": "text", "kind": "mllp", "port": str(port)},
        ],
    )
    out = refused_start(d)
    path = d.workdir / "config" / "connections.toml"
    assert (
        f"listenerd: configuration error: {path}: inbound[0].allow_insecure_bind: must be true or false, "
        "got a string (connection 'open')" in out
    )
    assert (
        f"listenerd: configuration error: {path}: inbound[1].port: must be an integer, got a string "
        "(connection 'text')" in out
    )
    assert "Traceback" not in out


def test_a_sighup_with_a_bad_config_logs_file_and_key_and_keeps_the_old_config(tmp_path, sqlite_config_fresh):
    import signal

    from include.app.lab.postgres_server import free_port, wait_for
    from include.app.supervisor import port_open
    from tests.support.nodes import mllp_node

    port = free_port()
    d = mllp_node(tmp_path / "node", sqlite_config_fresh, node_id="n:1:a", port=port)
    try:
        wait_for(lambda: port_open(port), timeout=15, what="bind")
        conf = d.workdir / "config" / "connections.toml"
        conf.write_text(conf.read_text().replace(f"port = {port}", f'port = "{port}"\nidle_timeout_seconds = -5'))
        d.signal(signal.SIGHUP)
        wait_for(lambda: "config reload refused" in d.output(), timeout=15, what="the reload to be refused")
        out = d.output()
        assert f"{conf}: inbound[0].port: must be an integer, got a string (connection 'adt-in')" in out
        assert f"{conf}: inbound[0].idle_timeout_seconds: must be > 0 (connection 'adt-in')" in out
        assert "Traceback" not in out
        assert d.status()["config_version"] == 0 and port_open(port)  # the old config still serves
    finally:
        d.stop()


def test_a_sighup_goes_through_the_whole_dir_check_as_a_start_does(tmp_path, sqlite_config_fresh):
    """Red team item 11: a broken routes.toml, an unknown route.toml or a missing connections.toml
    was "config reloaded" (the last one as zero connections, every listener closed); item 3: a
    reload that points a file drop at the store's directory is refused too."""
    import signal

    from include.app.lab.postgres_server import free_port, wait_for
    from include.app.supervisor import port_open
    from tests.support.nodes import mllp_node

    port = free_port()
    d = mllp_node(tmp_path / "node", sqlite_config_fresh, node_id="n:1:a", port=port)
    conf = d.workdir / "config"
    store = Path(sqlite_config_fresh.path)
    saved = (conf / "connections.toml").read_text()
    try:
        wait_for(lambda: port_open(port), timeout=15, what="bind")
        cases = [
            (
                lambda: (conf / "routes.toml").write_text('[[route]]\nname = 5\ndestinations = ["x"]\n'),
                f"{conf / 'routes.toml'}: route[0].name: ",
                lambda: (conf / "routes.toml").unlink(),
            ),
            (
                lambda: (conf / "route.toml").write_text("[[route]]\n"),
                f"{conf / 'route.toml'}: ",
                lambda: (conf / "route.toml").unlink(),
            ),
            (
                lambda: (conf / "connections.toml").rename(conf / "saved.bak"),
                f"{conf / 'connections.toml'}: missing: a reload needs connections.toml",
                lambda: (conf / "saved.bak").rename(conf / "connections.toml"),
            ),
            (
                lambda: (conf / "connections.toml").write_text(
                    saved + f'\n[[inbound]]\nname = "eats-the-store"\nkind = "file"\ndirectory = "{store.parent}"\n'
                ),
                f"{conf / 'connections.toml'}: inbound[1].directory: {store.parent} ",
                lambda: (conf / "connections.toml").write_text(saved),
            ),
        ]
        for n, (breaks, line, mends) in enumerate(cases, start=1):
            breaks()
            d.signal(signal.SIGHUP)
            wait_for(
                lambda n=n: d.output().count("keeping the old config") >= n, timeout=15, what="the reload to be refused"
            )
            assert f"config reload refused: {line}" in d.output(), d.output()
            mends()
            assert d.status()["config_version"] == 0 and port_open(port)  # the old config still serves
        assert "config reloaded" not in d.output() and "Traceback" not in d.output()
        d.signal(signal.SIGHUP)  # mended: accepted
        wait_for(lambda: "config reloaded" in d.output(), timeout=15, what="the mended reload")
    finally:
        d.stop()
