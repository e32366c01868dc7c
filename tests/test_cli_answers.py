"""The `stageline` console script as a new user meets it: a missing config, a dead or silent
database server, a refused login, a store of another cluster, an empty store. Each answer is one
line on stderr with the exit code of its cause (include/app/cli_common.py), never a traceback,
and no read command leaves a file behind."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from include.app.lab.postgres_server import PostgresServer, free_port
from include.config import StoreConfig
from include.store import Store
from include.store.lease import acquire_permanent
from include.store.membership import NodeIdentity, heartbeat, leave
from tests.conftest import CLUSTER, migrated_sqlite

ROOT = Path(__file__).resolve().parents[1]
STAGELINE = Path(sys.executable).parent / "stageline"
READ_COMMANDS = (
    ("stages",),
    ("messages", "find"),
    ("messages", "dead"),
    ("messages", "show", "C1"),
    ("cluster", "status"),
    ("cluster", "nodes"),
    ("lookups", "list"),
    ("lookups", "show", "sex"),
)


def stageline(*args: str, cwd: Path, code: int = 0, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the installed console script on this checkout's code, without $STAGELINE_CONFIG."""
    env = {k: v for k, v in os.environ.items() if k not in ("STAGELINE_CONFIG", "STAGELINE_CONNECT_TIMEOUT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([str(STAGELINE), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert proc.returncode == code, (args, proc.returncode, proc.stdout, proc.stderr)
    if code:
        assert "Traceback" not in proc.stderr and proc.stderr.startswith("Error: "), proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr  # one line
    return proc


def pg_toml(directory: Path, *, port: int, database: str = "stageline", user: str = "postgres", **cluster: str) -> Path:
    cfg = directory / "stageline.toml"
    cfg.write_text(
        f'[store]\nbackend = "postgres"\nserver = "127.0.0.1"\nport = {port}\ndatabase = "{database}"\n'
        f'username = "{user}"\n[cluster]\n' + "".join(f'{k} = "{v}"\n' for k, v in cluster.items())
    )
    return cfg


def test_version_is_the_package_version(tmp_path):
    assert stageline("--version", cwd=tmp_path).stdout == f"stageline {metadata.version('stageline')}\n"


def test_no_read_command_creates_a_store_and_each_says_where_it_looked(tmp_path):
    for args in READ_COMMANDS:
        for extra in ((), ("--json",)):
            err = stageline(*args, *extra, cwd=tmp_path, code=4).stderr
            assert f"no SQLite store at {tmp_path}/var/stageline.db (no such file)" in err, err
            assert f"there is no stageline.toml in {tmp_path} and no --service-config" in err, err
            assert "stageline db migrate" in err
    named = tmp_path / "conf" / "mine.toml"
    named.parent.mkdir()
    named.write_text('[store]\npath = "data/s.db"\n')
    err = stageline("--service-config", str(named), "stages", cwd=tmp_path, code=4).stderr
    assert f"no SQLite store at {named.parent}/data/s.db" in err and f"the [store].path of {named}" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["conf", "mine.toml"]  # nothing created

    # the one command that creates a store does, and says where
    out = stageline("--service-config", str(named), "db", "migrate", cwd=tmp_path).stdout
    assert out.startswith(f"the SQLite file {named.parent}/data/s.db: schema version ")
    # an empty store: every read answers, in words
    empty = {
        ("stages",): "inbound",
        ("messages", "find"): "no messages match",
        ("messages", "dead"): "no dead letters",
        ("cluster", "status"): "listenerd: none running; none ever beat on this store",
        ("cluster", "nodes"): "no nodes: no listenerd ever ran on this store",
        ("lookups", "list"): "no lookup tables",
    }
    for args, words in empty.items():
        assert words in stageline("--service-config", str(named), *args, cwd=tmp_path).stdout, args
    for args, words in (
        (("messages", "show", "C1"), "no message 'C1'"),
        (("lookups", "show", "sex"), "no lookup table"),
    ):
        assert words in stageline("--service-config", str(named), *args, cwd=tmp_path, code=2).stderr


def test_a_file_that_is_not_a_store_and_an_empty_one(tmp_path):
    (tmp_path / "stageline.toml").write_text('[store]\npath = "notes.txt"\n')
    (tmp_path / "notes.txt").write_text("shopping list\n")
    err = stageline("stages", cwd=tmp_path, code=4).stderr
    assert f"{tmp_path}/notes.txt is not a SQLite database (wrong [store].path?)" in err
    assert (tmp_path / "notes.txt").read_text() == "shopping list\n"
    (tmp_path / "stageline.toml").write_text('[store]\npath = "empty.db"\n')
    (tmp_path / "empty.db").touch(mode=0o600)  # what an older version's read command left behind
    err = stageline("cluster", "status", cwd=tmp_path, code=4).stderr
    assert f"{tmp_path}/empty.db is an empty file, not a SQLite store yet" in err and "stageline db migrate" in err
    assert (tmp_path / "empty.db").stat().st_size == 0  # a read left it as it was (it used to make it a database)
    stageline("db", "migrate", cwd=tmp_path)  # the migration may: it is how a store is made
    stageline("cluster", "status", cwd=tmp_path)


def test_a_locked_store_is_said_to_be_locked_not_unmigrated(tmp_path):
    db = migrated_sqlite(tmp_path / "s.db").path
    (tmp_path / "stageline.toml").write_text(
        f'[store]\npath = "{db}"\nbusy_timeout_ms = 1000\n[cluster]\ncluster_name = "{CLUSTER}"\n'
    )
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode = EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("SELECT 1 FROM leader_lease")  # takes the lock
        err = stageline("stages", cwd=tmp_path, code=4).stderr
    finally:
        holder.close()
    assert "could not be read (OperationalError: database is locked)" in err and "db migrate" not in err, err


def test_a_closed_port_is_unreachable_at_once(tmp_path):
    cfg = pg_toml(tmp_path, port=free_port())
    for args in (("stages",), ("cluster", "status", "--json"), ("db", "migrate")):
        started = time.monotonic()
        err = stageline("--service-config", str(cfg), *args, cwd=tmp_path, code=3).stderr
        assert time.monotonic() - started < 10
        assert "cannot reach PostgreSQL database 'stageline' at 127.0.0.1:" in err and "Connection refused" in err, err
        assert "is the server running, and are [store].server and port right?" in err
        assert "schema" not in err


@pytest.mark.postgres
def test_a_stopped_postgres_is_unreachable_not_unmigrated(tmp_path):
    server = PostgresServer(settings={"fsync": "off"}).start()
    try:
        server.execute("CREATE DATABASE cli_stopped")
        cfg = pg_toml(tmp_path, port=server.port, database="cli_stopped")
        stageline("--service-config", str(cfg), "db", "migrate", cwd=tmp_path)
        assert stageline("--service-config", str(cfg), "messages", "find", cwd=tmp_path).stdout == "no messages match\n"
    finally:
        server.stop()
    started = time.monotonic()
    err = stageline("--service-config", str(cfg), "messages", "find", cwd=tmp_path, code=3).stderr
    assert time.monotonic() - started < 10
    assert f"cannot reach PostgreSQL database 'cli_stopped' at 127.0.0.1:{server.port} (Connection refused)" in err
    assert "schema" not in err and "migrate" not in err


def test_a_server_that_never_answers_times_out_in_the_connect_timeout(tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nobody ever answers the startup packet
    try:
        cfg = pg_toml(tmp_path, port=silent.getsockname()[1])
        started = time.monotonic()
        err = stageline(
            "--connect-timeout", "2", "--service-config", str(cfg), "messages", "find", cwd=tmp_path, code=3
        ).stderr
        took = time.monotonic() - started
    finally:
        silent.close()
    assert "no answer within 2 s" in err, err
    assert 2 <= took < 12, took  # not the pool's 30 s of retries


@pytest.mark.postgres
def test_postgres_causes_each_have_their_own_message(tmp_path, pg_server, pg_config_fresh: StoreConfig):
    port = pg_server.port
    err = stageline(
        "--service-config", str(pg_toml(tmp_path, port=port, database="nope")), "stages", cwd=tmp_path, code=3
    ).stderr
    assert f"the server at 127.0.0.1:{port} has no database 'nope': check [store].database" in err, err
    ghost = pg_toml(tmp_path, port=port, database=pg_config_fresh.database, user="ghost")
    err = stageline("--service-config", str(ghost), "stages", cwd=tmp_path, code=3).stderr
    assert "refused the login of user 'ghost' (role \"ghost\" does not exist)" in err, err
    assert "$STAGELINE_STORE_PASSWORD" in err

    pg_server.execute("CREATE DATABASE cli_unmigrated")
    try:
        bare = pg_toml(tmp_path, port=port, database="cli_unmigrated")
        err = stageline("--service-config", str(bare), "lookups", "list", cwd=tmp_path, code=4).stderr
        assert "database 'cli_unmigrated' at 127.0.0.1:" in err and "LINE" not in err, err
        assert "has no Stageline schema yet; run `stageline db migrate`" in err
    finally:
        pg_server.execute("DROP DATABASE cli_unmigrated WITH (FORCE)")

    other = pg_toml(tmp_path, port=port, database=pg_config_fresh.database, cluster_name="elsewhere")
    err = stageline("--service-config", str(other), "cluster", "nodes", cwd=tmp_path, code=4).stderr
    assert f"belongs to cluster '{CLUSTER}'" in err and "'elsewhere'" in err

    mine = pg_toml(tmp_path, port=port, database=pg_config_fresh.database, cluster_name=CLUSTER)
    assert json.loads(stageline("--service-config", str(mine), "stages", "--json", cwd=tmp_path).stdout)["inbound"] == {
        "backlog": 0,
        "oldest_pending_seconds": None,
        "in_flight": 0,
        "dead": 0,
        "finished_per_minute": 0.0,
    }


def test_cluster_status_on_a_single_node_says_who_runs(tmp_path):
    config = migrated_sqlite(tmp_path / "s.db")
    (tmp_path / "stageline.toml").write_text(f'[store]\npath = "s.db"\n[cluster]\ncluster_name = "{CLUSTER}"\n')

    def status() -> tuple[dict, str]:
        doc = json.loads(stageline("cluster", "status", "--json", cwd=tmp_path).stdout)
        return doc, stageline("cluster", "status", cwd=tmp_path).stdout

    doc, text = status()
    assert (doc["role"], doc["node_id"], doc["is_leader"], doc["lease_owner"]) == ("down", None, False, None)
    assert "listenerd: none running; none ever beat on this store" in text and "lease: free" in text

    store = Store(config)
    node = NodeIdentity.of("solo:4242:ab")
    try:  # what a single-node listenerd does at start and every heartbeat_seconds
        epoch = acquire_permanent(store, node_id=node.node_id)
        heartbeat(store, node, is_leader=True)
        doc, text = status()
        assert (doc["role"], doc["node_id"], doc["is_leader"]) == ("single-node", "solo:4242:ab", True)
        assert (doc["lease_owner"], doc["epoch"], doc["listenerd_running"]) == ("solo:4242:ab", epoch, ["solo:4242:ab"])
        assert f"lease: held by solo:4242:ab, epoch {epoch}" in text and "listenerd running: solo:4242:ab" in text
        nodes = stageline("cluster", "nodes", cwd=tmp_path).stdout.splitlines()
        assert nodes[0].split() == [
            "node",
            "host",
            "pid",
            "status",
            "running",
            "leader",
            "started",
            "(UTC)",
            "last",
            "heartbeat",
            "(UTC)",
        ]
        assert nodes[1].split()[:6] == ["solo:4242:ab", "solo", "4242", "active", "yes", "yes"]

        leave(store, node.node_id)  # a clean stop; its permanent lease stays with it
        doc, text = status()
        assert (doc["role"], doc["node_id"], doc["listenerd_running"]) == ("down", None, [])
        assert doc["last_heartbeat"]["node_id"] == "solo:4242:ab" and doc["lease_owner"] == "solo:4242:ab"
        assert "listenerd: none running; last heartbeat " in text and "s ago) from solo:4242:ab" in text
    finally:
        store.close()


def test_tables_keep_their_columns_apart_and_every_command_answers_json(tmp_path):
    from include.store import lookups, rowlease

    config = migrated_sqlite(tmp_path / "s.db")
    (tmp_path / "stageline.toml").write_text(f'[store]\npath = "s.db"\n[cluster]\ncluster_name = "{CLUSTER}"\n')
    store = Store(config)
    try:
        epoch = acquire_permanent(store, node_id="solo:1:aa")
        with store.transaction() as tx:
            for n, (cid, conn) in enumerate(
                (("C1", "adt"), ("A-VERY-LONG-CONTROL-ID-0123456789", "laboratory-results-in"))
            ):
                rowlease.stage_inbound(
                    tx,
                    [
                        {
                            "message_id": f"m{n}",
                            "control_id": cid,
                            "connection": conn,
                            "lane_key": None,
                            "charset": None,
                            "payload": "MSH|^~\\&|A\r",
                        }
                    ],
                    epoch=epoch,
                    node_id="solo:1:aa",
                )
            lookups.replace_table(tx, "sex", {"F": "female", "M": "male"})
    finally:
        store.close()

    lines = stageline("messages", "find", cwd=tmp_path).stdout.splitlines()
    header = lines[0]
    assert len(lines) == 3 and "A-VERY-LONG-CONTROL-ID-0123456789" in lines[1] and "laboratory-results-in" in lines[1]
    for column in ("received (UTC)", "connection", "control id", "lane", "status"):
        at = header.index(column)  # every left-aligned cell starts under its header, after two blanks
        assert all(line[at - 2 : at] == "  " and line[at] != " " for line in lines), (column, lines)
    listed = stageline("lookups", "list", cwd=tmp_path).stdout.splitlines()
    assert listed[0].split() == ["table", "entries", "updated", "(UTC)"] and listed[1].split()[:2] == ["sex", "2"]

    for args in (*READ_COMMANDS, ("db", "migrate"), ("config", "schema"), ("messages", "show", "m1")):
        doc = json.loads(stageline(*args, "--json", cwd=tmp_path).stdout)
        assert doc is not None
    assert json.loads(stageline("lookups", "show", "sex", "--json", cwd=tmp_path).stdout) == {
        "name": "sex",
        "entries": [{"code": "F", "value": "female"}, {"code": "M", "value": "male"}],
    }


def test_wrong_flags_and_bad_values_are_usage_errors(tmp_path):
    for args, words in (
        (("stages", "--bogus"), "No such option '--bogus'"),
        (("messages", "find", "--status", "sent-ish"), "Invalid value for '--status'"),
        (("--connect-timeout", "0", "stages"), "Invalid value for '--connect-timeout'"),
        (("--connect-timeout", "nan", "stages"), "must be a number of seconds, not nan"),
        (("nope",), "No such command 'nope'"),
        (("demo", "send", "--count", "0"), "Invalid value for '--count'"),
        (
            ("--service-config", str(tmp_path), "stages"),
            f"{tmp_path}: is a directory: name the stageline.toml file in it",
        ),
    ):
        proc = subprocess.run(
            [str(STAGELINE), *args], capture_output=True, text=True, cwd=tmp_path, timeout=60, env={**os.environ}
        )
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_demo_send_to_nothing_is_one_line(tmp_path):
    err = stageline("demo", "send", "--port", str(free_port()), cwd=tmp_path, code=1).stderr
    assert "cannot send to 127.0.0.1:" in err and "is listenerd running" in err


def test_a_store_error_mid_command_is_one_line_with_exit_1(tmp_path):
    import sqlite3

    migrated_sqlite(tmp_path / "s.db")
    (tmp_path / "stageline.toml").write_text(f'[store]\npath = "s.db"\n[cluster]\ncluster_name = "{CLUSTER}"\n')
    with sqlite3.connect(tmp_path / "s.db") as db:  # a damaged store: someone dropped a table by hand
        db.execute("DROP TABLE stage_batches")
    err = stageline("stages", "--batches", "5", cwd=tmp_path, code=1).stderr
    assert err == "Error: OperationalError: no such table: stage_batches ($STAGELINE_DEBUG=1 shows the traceback)\n"
