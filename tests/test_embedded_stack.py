"""The README's first command: `stageline up` brings the whole single-node stack up, a demo message
sent over MLLP is routed by the real Airflow scheduler running the Spark route job, and Ctrl-C
stops every process it started."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil

from include.testing.postgres_server import wait_for

ROOT = Path(__file__).resolve().parents[1]


def test_stageline_up_runs_the_pipeline_and_ctrl_c_stops_everything(tmp_path):
    (tmp_path / "stageline.toml").write_text('[store]\npath = "var/stageline.db"\n')
    env = {**os.environ, "STAGELINE_VAR": str(tmp_path / "var")}
    out = open(tmp_path / "up.log", "w+")
    stageline = Path(sys.executable).parent / "stageline"
    up = subprocess.Popen([str(stageline), "--service-config", str(tmp_path / "stageline.toml"), "up"], cwd=ROOT,
                          env=env, stdout=out, stderr=subprocess.STDOUT)
    started: list[psutil.Process] = []
    try:
        wait_for(lambda: up.poll() is not None or "Stageline is up" in (tmp_path / "up.log").read_text(),
                 timeout=400, interval=1, what="the stack")
        assert up.poll() is None, (tmp_path / "up.log").read_text()
        started = psutil.Process(up.pid).children(recursive=True)
        sent = subprocess.run([str(stageline), "demo", "send", "--count", "1"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert sent.returncode == 0 and sent.stdout.count(" AA") == 3, sent.stdout + sent.stderr
        db = tmp_path / "var" / "stageline.db"

        def routed() -> list[tuple[str, int]]:
            with sqlite3.connect(db) as conn:
                return conn.execute("SELECT destination, count(*) FROM stage_routed GROUP BY 1 ORDER BY 1").fetchall()

        assert wait_for(lambda: routed() == [("archive", 3), ("ehr", 1)], timeout=240, interval=2,
                        what="the scheduler to route the demo messages")
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(120)
        out.close()
    assert code == 0, (tmp_path / "up.log").read_text()
    time.sleep(1)
    leftovers = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert leftovers == [], f"processes left running: {leftovers}"
