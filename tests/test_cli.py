"""The `stageline` command, run as a real subprocess against real stores."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import hl7
from hl7.client import MLLPClient

from include.app.demo import read_received
from include.config import StoreConfig
from include.store import Store, lookups
from include.store.lease import LeaderElector
from include.store.membership import NodeIdentity, heartbeat
from tests.conftest import CLUSTER

STAGELINE = [sys.executable, "-m", "include.app.cli"]
ROOT = Path(__file__).resolve().parents[1]


def run(cfg: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*STAGELINE, "--service-config", str(cfg), *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert (proc.returncode == 0) is ok, proc.stderr
    return proc


def test_embedded_default_migrates_and_reports_single_node(tmp_path):
    cfg = tmp_path / "stageline.toml"
    cfg.write_text('[store]\npath = "var/s.db"\n')
    assert "applied: 1" in run(cfg, "db", "migrate").stdout
    assert "already current" in run(cfg, "db", "migrate").stdout
    status = json.loads(run(cfg, "cluster", "status", "--json").stdout)
    assert (status["clustered"], status["role"], status["config_version"]) == (False, "down", 0)
    assert (status["node_id"], status["listenerd_running"], status["last_heartbeat"]) == (None, [], None)
    assert (tmp_path / "var" / "s.db").exists()


def test_cluster_commands_on_postgres_show_the_live_leader(tmp_path, pg_config_fresh, monkeypatch):
    c = pg_config_fresh
    cfg = tmp_path / "stageline.toml"
    cfg.write_text(
        f'[store]\nbackend = "postgres"\nserver = "{c.server}"\nport = {c.port}\ndatabase = "{c.database}"\n'
        f'username = "{c.username}"\n[cluster]\nenabled = true\ncluster_name = "test-cluster"\n'
        'node_id = "node-a:1:aa"\nheartbeat_seconds = 1\nleader_fence_timeout_seconds = 2\n'
        "leader_lease_ttl_seconds = 3\nnode_timeout_seconds = 5\n"
    )
    store = Store(c)
    LeaderElector(store, node_id="node-a:1:aa", ttl_seconds=30, fence_timeout_seconds=20).step()
    heartbeat(store, NodeIdentity.of("node-a:1:aa"), is_leader=True)
    store.close()
    status = json.loads(run(cfg, "cluster", "status", "--json").stdout)
    assert {k: status[k] for k in ("node_id", "clustered", "is_leader", "role", "config_version")} == {
        "node_id": "node-a:1:aa",
        "clustered": True,
        "is_leader": True,
        "role": "primary",
        "config_version": 0,
    }
    assert status["listenerd_running"] == ["node-a:1:aa"] == [status["last_heartbeat"]["node_id"]]
    nodes = json.loads(run(cfg, "cluster", "nodes", "--json").stdout)
    assert nodes["leader_node_id"] == nodes["lease_owner"] == "node-a:1:aa"


def test_a_bad_config_and_a_foreign_store_fail_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\nbackend = "sqlite"\n[cluster]\nenabled = true\n')
    assert "needs [store].backend" in run(bad, "db", "migrate", ok=False).stderr
    one = tmp_path / "one.toml"
    one.write_text('[store]\npath = "s.db"\n[cluster]\ncluster_name = "one"\n')
    two = tmp_path / "two.toml"
    two.write_text('[store]\npath = "s.db"\n[cluster]\ncluster_name = "two"\n')
    run(one, "db", "migrate")
    err = run(two, "cluster", "status", ok=False).stderr
    assert "belongs to cluster 'one'" in err and "'two'" in err


def service_toml(tmp_path: Path, c: StoreConfig) -> Path:
    """A stageline.toml for a fresh store of the fixtures (migrated for cluster 'test-cluster')."""
    cfg = tmp_path / "stageline.toml"
    if c.backend == "sqlite":
        store = f'[store]\npath = "{c.path}"\n'
    else:
        store = (
            f'[store]\nbackend = "postgres"\nserver = "{c.server}"\nport = {c.port}\n'
            f'database = "{c.database}"\nusername = "{c.username}"\n'
        )
    cfg.write_text(store + f'[cluster]\ncluster_name = "{CLUSTER}"\n')
    return cfg


def stored_tables(c: StoreConfig) -> dict[str, dict[str, str]]:
    store = Store(c)
    try:
        with store.transaction(write=False) as tx:
            return lookups.read_all(tx)
    finally:
        store.close()


def test_lookups_import_list_show_sync_and_delete(tmp_path, store_config):
    cfg = service_toml(tmp_path, store_config)
    example = ROOT / "config" / "lookups" / "patient_class.csv"
    assert "3 entries imported" in run(cfg, "lookups", "import", "patient_class", str(example)).stdout
    assert stored_tables(store_config) == {"patient_class": {"I": "IN", "O": "OUT", "E": "EMER"}}
    listed = json.loads(run(cfg, "lookups", "list", "--json").stdout)["tables"]
    assert [(t["name"], t["entries"]) for t in listed] == [("patient_class", 3)]
    assert abs(listed[0]["updated_at"] - time.time()) < 120
    assert run(cfg, "lookups", "show", "patient_class").stdout == "code,value\nE,EMER\nI,IN\nO,OUT\n"

    # a re-import replaces the whole table; quoting and non-ASCII survive show → import
    tricky = tmp_path / "tricky.csv"
    tricky.write_text('Code , VALUE\nI,"inpatient, ward"\nä,"say ""hi"""\nZ,\n', encoding="utf-8")
    assert "3 entries imported" in run(cfg, "lookups", "import", "patient_class", str(tricky)).stdout
    expected = {"I": "inpatient, ward", "ä": 'say "hi"', "Z": ""}
    assert stored_tables(store_config) == {"patient_class": expected}
    shown = tmp_path / "shown.csv"
    shown.write_text(run(cfg, "lookups", "show", "patient_class").stdout, encoding="utf-8")
    run(cfg, "lookups", "import", "copy", str(shown))
    assert stored_tables(store_config) == {"patient_class": expected, "copy": expected}

    # sync: every DIR/*.csv under its file stem; other tables are left alone
    sync_dir = tmp_path / "lookups"
    sync_dir.mkdir()
    (sync_dir / "patient_class.csv").write_text(example.read_text())
    (sync_dir / "sex.csv").write_text("code,value\nF,female\nM,male\n")
    (sync_dir / "notes.txt").write_text("not a table")
    out = run(cfg, "lookups", "sync", str(sync_dir)).stdout
    assert "'patient_class': 3 entries" in out and "'sex': 2 entries" in out
    assert stored_tables(store_config) == {
        "patient_class": {"I": "IN", "O": "OUT", "E": "EMER"},
        "sex": {"F": "female", "M": "male"},
        "copy": expected,
    }
    assert [t["name"] for t in json.loads(run(cfg, "lookups", "list", "--json").stdout)["tables"]] == [
        "copy",
        "patient_class",
        "sex",
    ]

    assert "deleted (3 entries)" in run(cfg, "lookups", "delete", "copy").stdout
    assert set(stored_tables(store_config)) == {"patient_class", "sex"}


def test_lookups_bad_input_exits_2_with_a_clear_message_and_changes_nothing(tmp_path, store_config):
    cfg = service_toml(tmp_path, store_config)
    run(cfg, "lookups", "import", "patient_class", str(ROOT / "config" / "lookups" / "patient_class.csv"))
    before = stored_tables(store_config)

    def fails(*args: str) -> str:
        proc = run(cfg, *args, ok=False)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""
        return proc.stderr

    def csv_file(name: str, text: str | bytes) -> str:
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(path)

    swapped = csv_file("swapped.csv", "value,code\nIN,I\n")
    assert "header 'code,value'" in fails("lookups", "import", "patient_class", swapped)
    duplicate = csv_file("dup.csv", "code,value\nI,IN\nI,X\n")
    assert "appears twice" in fails("lookups", "import", "patient_class", duplicate)
    assert "line 3: expected 2 columns" in fails(
        "lookups", "import", "patient_class", csv_file("cols.csv", "code,value\nI,IN\nO,OUT,extra\n")
    )
    assert "UTF-8" in fails("lookups", "import", "patient_class", csv_file("latin1.csv", b"code,value\nI,\xe9\n"))
    assert "no entries" in fails("lookups", "import", "patient_class", csv_file("empty.csv", "code,value\n"))
    assert "must be 1" in fails("lookups", "import", "patient_class", csv_file("nocode.csv", "code,value\n,IN\n"))
    assert "table name '1st class'" in fails("lookups", "import", "1st class", csv_file("ok.csv", "code,value\nI,IN\n"))
    assert "does not exist" in fails("lookups", "import", "patient_class", str(tmp_path / "missing.csv"))
    assert "no lookup table 'nope'" in fails("lookups", "show", "nope")
    assert "no lookup table 'nope'" in fails("lookups", "delete", "nope")
    assert "does not exist" in fails("lookups", "sync", str(tmp_path / "no-such-dir"))
    (tmp_path / "empty").mkdir()
    assert "no *.csv files" in fails("lookups", "sync", str(tmp_path / "empty"))
    # one bad file in a sync directory imports nothing, not even the good files
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a_good.csv").write_text("code,value\nX,Y\n")
    (mixed / "patient_class.csv").write_text("code,value\nI,IN\n")
    (mixed / "z_bad.csv").write_text("code;value\nI;IN\n")
    assert "z_bad.csv" in fails("lookups", "sync", str(mixed))
    assert stored_tables(store_config) == before


def test_lookups_refuse_a_store_that_is_not_migrated(tmp_path):
    cfg = tmp_path / "stageline.toml"
    cfg.write_text('[store]\npath = "s.db"\n')
    assert "stageline db migrate" in run(cfg, "lookups", "list", ok=False).stderr


def test_demo_receiver_acks_with_aa_and_appends_each_message_once(tmp_path):
    out = tmp_path / "ehr"
    receiver = subprocess.Popen(
        [*STAGELINE, "demo", "receive", "--port", "0", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        first = receiver.stdout.readline()
        port = int(re.search(r"127\.0\.0\.1:(\d+)", first).group(1))
        template = (
            "MSH|^~\\&|DEMOADT|DEMOHOSP|EHR|MAIN|20250101120000||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
            "PID|1||DP0^^^DEMOHOSP^MR||TEST^PATIENT\rPV1|1|IN\r"
        )
        acks = []
        with MLLPClient("127.0.0.1", port) as client:
            for cid in ("C1", "C2", "C1"):  # C1 again: a re-delivery
                acks.append(hl7.parse(client.send_message(template.format(cid=cid)).decode().strip("\x0b\x1c\r\n")))
        assert [(str(a.segment("MSA")[1]), str(a.segment("MSA")[2])) for a in acks] == [
            ("AA", "C1"),
            ("AA", "C2"),
            ("AA", "C1"),
        ]
        text = (out / "received.hl7").read_text()
        assert text.startswith("MSH|^~\\&|DEMOADT|DEMOHOSP|EHR|MAIN|") and "\r" not in text
        assert read_received(out / "received.hl7") == [template.format(cid="C1"), template.format(cid="C2")]
    finally:
        receiver.terminate()
        code = receiver.wait(10)
        log = receiver.stdout.read()
    assert code == 0 and "already received" in log and "demo receiver stopped" in log, log


def test_db_migrate_takes_service_config_after_the_subcommand_too(tmp_path):
    cfg = tmp_path / "stageline.toml"
    cfg.write_text('[store]\npath = "var/after.db"\n')
    proc = subprocess.run(
        [*STAGELINE, "db", "migrate", "--service-config", str(cfg)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "schema version" in proc.stdout and (tmp_path / "var" / "after.db").exists()


def test_up_takes_the_users_service_config_and_config_dir(tmp_path):
    cfg = tmp_path / "mine.toml"
    cfg.write_text('[store]\npath = "var/mine.db"\n')
    conf = tmp_path / "myconf"
    conf.mkdir()
    proc = subprocess.run(
        [*STAGELINE, "up", "--no-stack", "--service-config", str(cfg), "--config", str(conf)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "var" / "mine.db").exists()
    missing = subprocess.run(
        [*STAGELINE, "up", "--no-stack", "--config", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_the_banner_and_readiness_read_ports_from_the_config_dir(tmp_path):
    from include.app.embedded import DEFAULT_API_PORT, endpoints_of

    checkout = endpoints_of(ROOT / "config")
    assert (checkout.api_port, checkout.inbound[0]) == (8470, ("adt-in", "mllp", "127.0.0.1:2575"))
    (tmp_path / "connections.toml").write_text(
        '[api]\nport = 9471\n[[inbound]]\nname = "lab"\nkind = "mllp"\nport = 0\n'
        '[[inbound]]\nname = "drop"\nkind = "file"\ndirectory = "/srv/in"\n'
    )
    mine = endpoints_of(tmp_path)
    assert mine.api_port == 9471
    assert mine.inbound == (("lab", "mllp", "any free port (see var/log/listenerd)"), ("drop", "file", "/srv/in"))
    assert endpoints_of(tmp_path / "empty").api_port == DEFAULT_API_PORT


# --- `stageline messages show`: bodies (PHI) only with --body, and each such read on the record ----

MRN = "MRN-0042-7731"
PHI_BODY = f"MSH|^~\\&|ADT1|HOSP|EHR|CITY|20240101120000||ADT^A01|{MRN}|P|2.5\rPID|1||P77^^^HOSP^MR||DOE^JANE\r"


def _body_reads(store: Store) -> list[dict]:
    with store.transaction(write=False) as tx:
        cur = tx.conn.cursor()
        cur.execute(
            "SELECT row_id, message_id, control_id, event, node_id, detail FROM message_events "
            "WHERE event = 'body_read' ORDER BY id"
        )
        return [dict(r) for r in cur.fetchall()]


def test_messages_show_prints_bodies_only_with_body_and_records_the_os_user(tmp_path, store_config):
    import os
    import pwd

    from include.store import rowlease
    from include.store.lease import acquire_permanent
    from tests.dags.stores import write_service_config

    store = Store(store_config)
    try:
        epoch = acquire_permanent(store, node_id="solo:1:aa")
        with store.transaction() as tx:
            row_id = rowlease.stage_inbound(
                tx,
                [
                    {
                        "message_id": "adt-1",
                        "control_id": MRN,
                        "connection": "adt-in",
                        "lane_key": "P77",
                        "charset": None,
                        "payload": PHI_BODY,
                    }
                ],
                epoch=epoch,
                node_id="solo:1:aa",
            )["adt-1"]
        cfg = write_service_config(tmp_path, store_config, cluster=False)

        plain = run(cfg, "messages", "show", MRN).stdout
        assert f"inbound row {row_id}" in plain and "DOE^JANE" not in plain and "add --body" in plain
        story = json.loads(run(cfg, "messages", "show", MRN, "--json").stdout)
        assert story["inbound"]["control_id"] == MRN and "payload" not in story["inbound"]
        assert "DOE^JANE" not in json.dumps(story)
        assert _body_reads(store) == []  # metadata only: nothing to record

        shown = run(cfg, "messages", "show", MRN, "--body").stdout
        assert "PID|1||P77^^^HOSP^MR||DOE^JANE" in shown
        assert (
            json.loads(run(cfg, "messages", "show", "adt-1", "--body", "--json").stdout)["inbound"]["payload"]
            == PHI_BODY
        )
        me = pwd.getpwuid(os.getuid()).pw_name
        assert (
            _body_reads(store)
            == [
                {
                    "row_id": row_id,
                    "message_id": "adt-1",
                    "control_id": MRN,
                    "event": "body_read",
                    "node_id": f"reader:cli {me}",
                    "detail": "bodies read via cli",
                }
            ]
            * 2
        )
    finally:
        store.close()


def test_messages_find_refuses_a_limit_past_the_page(tmp_path):
    cfg = tmp_path / "stageline.toml"
    cfg.write_text('[store]\npath = "var/s.db"\n')
    run(cfg, "db", "migrate")
    proc = run(cfg, "messages", "find", "--limit", "100000000", ok=False)
    assert proc.returncode == 2 and "limit must be 1..1000 (page on with before_id), got 100000000" in proc.stderr
    assert run(cfg, "messages", "find", "--limit", "1000").stdout.strip() == "no messages match"
    proc = run(cfg, "stages", "--batches", "100000", ok=False)
    assert proc.returncode == 2 and "--batches: limit must be 1..500, got 100000" in proc.stderr
