"""The README's first command, on a user's own config dir (`--config`): `stageline up` brings the
whole single-node stack up, demo messages
sent over MLLP are routed, transformed and delivered by the real Airflow scheduler running the Spark
stage jobs — to both destinations of `config/`: the file archive and the demo MLLP receiver standing
in for the EHR — a message sent after a silent minute is delivered within seconds, the stack's memory
(PSS) stays within its budget while the stage tasks run and once they have ended, and Ctrl-C stops
every process it started."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import hl7
import psutil

from include import stage_loop
from include.app.demo import read_received
from include.app.lab.postgres_server import wait_for
from tests.support.memory import summary, tree_memory
from tests.support.user_env import user_env

ROOT = Path(__file__).resolve().parents[1]
MEMORY_BUDGET_MIB = 1300  # while the stage tasks run (measured 1167-1208 MiB: docs/performance.md)
IDLE_MEMORY_BUDGET_MIB = 1300  # once they have ended for want of work (measured 1148-1156 MiB)
AFTER_IDLE_MINUTE_SECONDS = 3.0  # the bound: the first delivery after an idle minute (the 11-20 s of
# full-suite runs came from tests/dags/conftest.py's settings reaching the stack: tests/support/user_env.py)
IDLE_MINUTE = 60.0
COUNT = 4  # of each kind, per batch: 4 ADT (to ehr + archive; patients DP0, DP1, DP2, DP0), 4 ORU + 4 ORM
# (to archive). Three batches: the first right after startup (cold), the second once it is delivered,
# the third after a minute without traffic.


def test_the_stack_is_started_without_the_suites_airflow_settings(tmp_path):
    """What tests/dags/conftest.py leaves in os.environ (a stage task that ends at once, Airflow's
    unit-test mode) must not reach the stack: in full-suite runs it made the first delivery after an
    idle minute wait for new DAG runs and task starts (11-20 s instead of about one)."""
    from include.app.embedded import airflow_env

    suite = {
        "PATH": "/usr/bin",
        "STAGELINE_STAGE_LINGER_SECONDS": "0",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        "AIRFLOW_HOME": "/elsewhere",
    }
    assert user_env({"STAGELINE_VAR": "v"}, base=suite) == {
        "PATH": "/usr/bin",
        "STAGELINE_VAR": "v",
    }
    # and the stack itself never runs in unit-test mode, whatever its caller's environment says
    assert airflow_env(tmp_path, tmp_path / "stageline.toml")["AIRFLOW__CORE__UNIT_TEST_MODE"] == "False"


def test_stageline_up_runs_the_pipeline_and_ctrl_c_stops_everything(tmp_path):
    (tmp_path / "stageline.toml").write_text('[store]\npath = "var/stageline.db"\n')
    # the user's own config dir (a copy of the example, its API on another port), given with --config
    mine = tmp_path / "myconfig"
    shutil.copytree(ROOT / "config", mine)
    connections = mine / "connections.toml"
    connections.write_text(connections.read_text().replace("port = 8470", "port = 8471", 1))
    var = tmp_path / "var"
    # as a user's shell starts it: not with the Airflow settings tests/dags/conftest.py put in os.environ
    env = user_env({"STAGELINE_VAR": str(var)})
    out = open(tmp_path / "up.log", "w+")
    stageline = Path(sys.executable).parent / "stageline"
    up = subprocess.Popen(
        [str(stageline), "up", "--service-config", str(tmp_path / "stageline.toml"), "--config", str(mine)],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    started: list[psutil.Process] = []
    received_file = var / "out" / "ehr" / "received.hl7"
    archive = var / "out" / "archive"
    try:
        wait_for(
            lambda: up.poll() is not None or "Stageline is up" in (tmp_path / "up.log").read_text(),
            timeout=400,
            interval=1,
            what="the stack",
        )
        assert up.poll() is None, (tmp_path / "up.log").read_text()
        started = psutil.Process(up.pid).children(recursive=True)
        progress, banner = (tmp_path / "up.log").read_text().split("Stageline is up")
        assert "stage DAGs                waiting for work in" in progress, progress  # up means ready to move
        assert str(received_file) in banner and f"{archive}/" in banner, banner
        assert f"config {mine}" in banner and ":8471/cluster/status" in banner, banner
        assert "MLLP inbound        127.0.0.1:2575      (adt-in)" in banner, banner
        db = tmp_path / "var" / "stageline.db"

        def query(sql: str) -> list[tuple]:
            with sqlite3.connect(db) as conn:
                return conn.execute(sql).fetchall()

        def routed() -> list[tuple[str, int]]:
            return query("SELECT destination, count(*) FROM stage_routed GROUP BY 1 ORDER BY 1")

        sent_order: list[str] = []
        sent_adt: list[str] = []
        timings: list[str] = []
        delivered_after: list[float] = []
        for batch, label in enumerate(("cold: right after `stageline up`", "warm", "after an idle minute"), start=1):
            if batch == 3:
                # what the whole stack holds while its stage tasks are running (PSS: shared pages split)
                busy = tree_memory(up.pid)
                time.sleep(IDLE_MINUTE)
            sent = subprocess.run(
                [str(stageline), "demo", "send", "--count", str(COUNT)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert sent.returncode == 0 and sent.stdout.count(" AA") == 3 * COUNT, sent.stdout + sent.stderr
            hint = sent.stdout.splitlines()[-1]
            assert str(received_file) in hint and f"{archive}/" in hint and "Airflow UI" in hint, hint
            sent_order += [line.split()[0] for line in sent.stdout.splitlines() if line.rstrip().endswith(" AA")]
            sent_adt += [line.split()[0] for line in sent.stdout.splitlines() if " ADT^A01 " in line]

            assert wait_for(
                lambda: routed() == [("archive", 3 * COUNT * batch), ("ehr", COUNT * batch)],
                timeout=240,
                interval=2,
                what="the scheduler to route the demo messages",
            )

            def delivered() -> bool:
                dead = query("SELECT control_id, destination, last_error FROM stage_outbound WHERE status = 'dead'")
                assert not dead, f"dead-lettered deliveries: {dead}"
                return query("SELECT status, count(*) FROM stage_outbound GROUP BY 1") == [("done", 4 * COUNT * batch)]

            try:
                wait_for(delivered, timeout=300, interval=0.5, what="the scheduler to transform and deliver them")
            except TimeoutError:
                rows = query("SELECT control_id, destination, status, attempts, last_error FROM stage_outbound")
                raise AssertionError(
                    f"stage_outbound: {rows}; stage_routed: "
                    f"{query('SELECT status, count(*) FROM stage_routed GROUP BY 1')}"
                ) from None
            # from the last message staged (its ACK follows the commit) to each stage's last write
            last_sent, last_routed, last_landed = (
                query(f"SELECT max(created_at) / 1000.0 FROM {table}")[0][0]
                for table in ("stage_inbound", "stage_routed", "stage_outbound")
            )
            last_delivered = query("SELECT max(updated_at) / 1000.0 FROM stage_outbound")[0][0]
            delivered_after.append(last_delivered - last_sent)
            last_written = max(p.stat().st_mtime for p in [received_file, *archive.iterdir()])
            timings.append(
                f"batch {batch} ({label}): last send → routed {last_routed - last_sent:.1f} s, "
                f"→ transformed {last_landed - last_sent:.1f} s, → delivered {last_delivered - last_sent:.1f} s, "
                f"→ last delivery written {last_written - last_sent:.1f} s"
            )

        inbound = dict(query("SELECT message_id, payload FROM inbound_messages"))
        outbound = query("SELECT message_id, control_id, destination FROM stage_outbound")
        # the archive: one file per message, named by the idempotency key, holding the message as received
        to_archive = {message_id: control_id for message_id, control_id, dest in outbound if dest == "archive"}
        assert sorted(to_archive.values()) == sorted(sent_order)
        assert sorted(p.name for p in archive.iterdir()) == sorted(f"{m}-archive.hl7" for m in to_archive)
        for message_id in to_archive:
            assert (archive / f"{message_id}-archive.hl7").read_bytes().decode() == inbound[message_id]
        # the EHR (the demo receiver): every ADT arrived, transformed (transforms.toml, the patient_class lookup table),
        # and each patient's messages in the order they were sent
        by_control = {control_id: inbound[message_id] for message_id, control_id, dest in outbound if dest == "ehr"}
        received = [hl7.parse(m) for m in read_received(received_file)]
        received_ids = [str(m.segment("MSH")[10]) for m in received]
        assert sorted(received_ids) == sorted(sent_adt) == sorted(by_control), (received_ids, sent_adt)
        for message, control_id in zip(received, received_ids):
            assert (str(message.segment("MSH")[5]), str(message.segment("MSH")[6])) == ("EHR", "MAIN")
            assert str(message.segment("PV1")[2]) == "IN"
            original = by_control[control_id]
            assert "\rPV1|1|I|" in original and "|STAGELINE|HOSP|" in original
            expected = original.replace("|STAGELINE|HOSP|", "|EHR|MAIN|", 1).replace("\rPV1|1|I|", "\rPV1|1|IN|")
            assert str(message).rstrip("\r") == expected.rstrip("\r")
        patient = {cid: m.extract_field("PID", 1, 3, 1, 1) for m, cid in zip(received, received_ids)}
        assert sorted(set(patient.values())) == ["DP0", "DP1", "DP2"]
        for pid in set(patient.values()):
            assert [c for c in received_ids if patient[c] == pid] == [c for c in sent_adt if patient[c] == pid]

        print(f"\n{3 * COUNT} demo messages ({4 * COUNT} deliveries) per batch:\n  " + "\n  ".join(timings))
        assert delivered_after[2] <= AFTER_IDLE_MINUTE_SECONDS, timings
        busy_mib = sum(p.pss_kib for p in busy) / 1024
        print(f"\nthe stack after the deliveries: {len(busy)} processes, {busy_mib:.0f} MiB PSS\n{summary(busy)}")
        assert busy_mib <= MEMORY_BUDGET_MIB, summary(busy)
        # once the stage tasks have ended for want of work, and each stage DAG's next run waits for it
        time.sleep(stage_loop.DEFAULT_LINGER_SECONDS + 30)
        idle = tree_memory(up.pid)
        idle_mib = sum(p.pss_kib for p in idle) / 1024
        print(f"\nthe stack idle: {len(idle)} processes, {idle_mib:.0f} MiB PSS\n{summary(idle)}")
        assert idle_mib <= IDLE_MEMORY_BUDGET_MIB, summary(idle)
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(120)
        out.close()
    assert code == 0, (tmp_path / "up.log").read_text()
    time.sleep(1)
    leftovers = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert leftovers == [], f"processes left running: {leftovers}"
    assert "stopped demo-receiver" in (tmp_path / "up.log").read_text()
