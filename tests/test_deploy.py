"""The host-level deployment files are valid for the tools that will read them: every systemd unit
in deploy/systemd passes `systemd-analyze verify` (with the install root pointed at this checkout, so
the executables it names exist), the VIP configs pass `haproxy -c`, and the Prometheus alert rules
pass `promtool check rules` and their own `promtool test rules` cases."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service")) + sorted((DEPLOY / "systemd").glob("*.target"))


def run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    assert shutil.which(cmd[0]), f"{cmd[0]} is missing: scripts/setup.sh installs it"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_there_is_a_unit_for_each_process_of_a_node():
    names = {u.name for u in UNITS}
    assert {
        "stageline-listenerd.service",
        "stageline-airflow-scheduler.service",
        "stageline-airflow-dag-processor.service",
        "stageline-airflow-triggerer.service",
        "stageline-airflow-api-server.service",
        "stageline-spark-master.service",
        "stageline-spark-worker.service",
        "stageline-spark-connect.service",
        "stageline.target",
    } <= names
    for unit in UNITS:
        if unit.suffix == ".service":
            assert "Restart=always" in unit.read_text(), f"{unit.name}: a killed process must come back"


def test_every_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path):
    for unit in UNITS:
        (tmp_path / unit.name).write_text(unit.read_text().replace("/opt/stageline", str(ROOT)))
    done = run("systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.iterdir()), cwd=tmp_path)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "Unknown" not in report and "not executable" not in report, report


@pytest.mark.parametrize("config", ["haproxy/hosts.cfg", "haproxy.cfg"])
def test_the_vip_config_passes_haproxy_check(config: str):
    done = run("haproxy", "-c", "-f", str(DEPLOY / config))
    assert done.returncode == 0 and "Configuration file is valid" in done.stdout + done.stderr, done.stderr


@pytest.mark.parametrize("config", ["haproxy/hosts.cfg", "haproxy.cfg"])
def test_every_vip_backend_asks_leader_on_the_api_port(config: str):
    """Issue 24: a TCP check on the data port passes on a frozen leader (its kernel still accepts);
    each backend asks `GET /leader?inbound=<the MLLP inbound>` (200 on the leader serving that inbound
    only) on the API port, 8470 — per inbound, so one that no node can bind does not empty the VIP."""
    import tomllib

    inbound = {
        c["name"]
        for c in tomllib.loads((DEPLOY / "config" / "connections.toml").read_text())["inbound"]
        if c["kind"] == "mllp"
    }
    text = (DEPLOY / config).read_text()
    backends = list(text.split("\nbackend ")[1:])
    assert backends
    for block in backends:
        lines = [line.split("#", 1)[0].strip() for line in block.split("\n\n", 1)[0].splitlines()]
        checks = [line for line in lines if line.startswith("option httpchk ")]
        assert [c.removeprefix("option httpchk GET /leader?inbound=") in inbound for c in checks] == [True], block
        assert "http-check expect status 200" in lines, block
        servers = [line for line in lines if line.startswith("server ")]
        assert servers and all(" check port 8470" in line for line in servers), servers


def test_the_alert_rules_pass_promtool_and_their_own_tests():
    checked = run("promtool", "check", "rules", "alerts.yml", cwd=DEPLOY)
    assert checked.returncode == 0 and "SUCCESS: 14 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = run("promtool", "test", "rules", "alerts_test.yml", cwd=DEPLOY)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_a_broken_unit_is_caught(tmp_path: Path):
    """The verify test above can fail: a misspelt key or a missing executable is reported."""
    (tmp_path / "broken.service").write_text("[Service]\nExecStart=/nonexistent/listenerd\nRestrt=always\n")
    done = run("systemd-analyze", "verify", str(tmp_path / "broken.service"))
    assert done.returncode != 0 or "Unknown key" in done.stderr
