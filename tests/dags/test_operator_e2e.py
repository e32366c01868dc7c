"""The operator's day on real parts, SQLite and PostgreSQL (`stageline messages …`, `stageline stages`).

A real pipeline run (listenerd over MLLP → `dag.test()` of the three stage DAGs → python-hl7
receivers) leaves one patient's lane dead at the lab, whose receiver answers AE for that patient.
Then, through the real CLI: find and show the dead messages and their trail, list the dead letters,
fix the receiver and requeue the dead lane, replay one message from inbound; a second pipeline run
delivers the requeued lane in its order and the replayed message again, and every operator action
is in the audit trail with who and why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from include.app.lab.listenerd import Daemon
from include.config import StoreConfig
from tests.dags.e2e import run_stages, send
from tests.dags.stores import rows
from tests.dags.test_pipeline_e2e import field, messages, running_pipeline


def stageline(service_config: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "include.app.cli", "--service-config", str(service_config), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def as_json(service_config: Path, *args: str) -> Any:
    return json.loads(stageline(service_config, *args, "--json"))


def test_find_show_requeue_a_dead_lane_and_replay_a_message_through_the_cli(
    airflow_db, store_config: StoreConfig, tmp_path: Path
) -> None:
    lab_broken = [True]
    with running_pipeline(
        store_config,
        tmp_path,
        node_id="solo:1:ops",
        lab_refuses=lambda patient: lab_broken[0] and patient.startswith("PNAK"),
    ) as pipeline:
        daemon, store, ehr, lab = pipeline.daemon, pipeline.store, pipeline.ehr, pipeline.lab
        svc = daemon.workdir / "stageline.toml"
        sent = messages()
        send(pipeline.mllp_port, [text for _, _, text in sent])
        run_stages(daemon)
        nak_orus = [c for c, patient, _ in sent if patient == "PNAK"]
        assert lab.control_ids.count(nak_orus[0]) == 2  # two attempts, then dead

        # where are they, why did they fail
        dead = as_json(svc, "messages", "find", "--status", "dead")
        assert sorted(r["control_id"] for r in dead) == sorted(nak_orus)
        assert [r["id"] for r in dead] == sorted((r["id"] for r in dead), reverse=True)  # newest first
        page = as_json(svc, "messages", "find", "--limit", "5")
        more = as_json(svc, "messages", "find", "--limit", "50", "--before-id", str(page[-1]["id"]))
        assert len(page) == 5 and len(page) + len(more) == len(sent)
        assert {r["control_id"] for r in as_json(svc, "messages", "find", "--lane", "PNAK")} == set(nak_orus)
        groups = as_json(svc, "messages", "dead")
        assert [(g["stage"], g["destination"], g["n"]) for g in groups] == [("outbound", "lab", len(nak_orus))]
        assert "AE" in groups[0]["reason"]
        story = as_json(svc, "messages", "show", nak_orus[0])
        assert sorted((o["destination"], o["status"]) for o in story["outbound"]) == [
            ("archive", "done"),
            ("lab", "dead"),
        ]
        assert [e["event"] for e in story["trail"] if e["destination"] == "lab" and e["stage"] == "outbound"] == [
            "transformed",
            "attempt_failed",
            "attempt_failed",
        ]
        # which Airflow runs moved it: one batch per stage that touched it, linked by the claim owner
        assert {b["stage"] for b in story["batches"]} == {"route", "transform", "deliver"}
        assert {b["dag_id"] for b in story["batches"]} == {"stage_route", "stage_transform", "stage_deliver"}
        assert all(b["claimed"] > 0 and b["finished_ms"] >= b["started_ms"] for b in story["batches"])
        recent = as_json(svc, "stages", "--batches", "5")["batches"]
        assert recent and recent[0]["id"] > recent[-1]["id"]
        text = stageline(svc, "messages", "show", nak_orus[0], "--body")  # bodies: asked for, audited
        assert "moved by route batch airflow:stage_route:" in text
        assert "\n    PID|1||PNAK^^^HOSP^MR||" in text  # readable HL7, one segment a line
        assert as_json(svc, "stages")["outbound"]["dead"] == len(nak_orus)

        # fix the receiver, requeue the dead lane, replay one ADT from inbound
        lab_broken[0] = False
        out = stageline(
            svc,
            "messages",
            "requeue",
            "--destination",
            "lab",
            "--actor",
            "tester",
            "--reason",
            "lab receiver fixed (INC-7)",
        )
        assert out.startswith(f"requeued {len(nak_orus)} outbound row(s)")
        out = stageline(
            svc, "messages", "replay", "ADT000", "--from", "inbound", "--actor", "tester", "--reason", "EHR lost it"
        )
        assert "new inbound row(s)" in out
        lab_before, ehr_before = len(lab.control_ids), len(ehr.control_ids)
        run_stages(daemon)

    assert lab.control_ids[lab_before:] == nak_orus  # the dead lane drained, in its order
    assert ehr.control_ids[ehr_before:] == ["ADT000"]  # the replay, delivered again
    assert all(field(t, "MSH", 5) == "CORE" for t in ehr.texts)  # today's transform applied to the replay
    assert as_json(svc, "stages") == {
        stage: {
            "backlog": 0,
            "oldest_pending_seconds": None,
            "in_flight": 0,
            "dead": 0,
            "finished_per_minute": s["finished_per_minute"],
        }
        for stage, s in as_json(svc, "stages").items()
    }
    inbound = {r["message_id"]: r for r in rows(store, "SELECT message_id, control_id, status FROM stage_inbound")}
    [original] = [m for m, r in inbound.items() if r["control_id"] == "ADT000" and "~" not in m]
    assert inbound[f"{original}~replay-1"]["status"] == "done"
    events = rows(
        store,
        "SELECT message_id, event, node_id, detail FROM message_events WHERE node_id LIKE 'operator:%' ORDER BY id",
    )
    assert [(e["event"], e["node_id"]) for e in events] == (
        [("requeued", "operator:tester")] * len(nak_orus)
        + [("replayed", "operator:tester"), ("staged", "operator:tester")]
    )
    assert all(e["detail"] == "lab receiver fixed (INC-7)" for e in events[: len(nak_orus)])
    assert events[-2]["message_id"] == original and "EHR lost it" in events[-2]["detail"]
    story = as_json(svc, "messages", "show", original)
    assert any(e["event"] == "replayed" and e["node_id"] == "operator:tester" for e in story["trail"])
    store.close()


def test_operator_commands_refuse_bad_input_with_a_clear_error(store_config: StoreConfig, tmp_path: Path) -> None:
    daemon = Daemon(workdir=tmp_path / "node", store=store_config, node_id="solo:1:ops")
    daemon.write_config()
    svc = str(daemon.workdir / "stageline.toml")
    for args, expected in (
        (["messages", "show", "no-such-message"], "no message 'no-such-message'"),
        (["messages", "requeue", "--reason", "x"], "name the dead letters"),
        (["messages", "find", "--since", "yesterday"], "not an ISO date/time"),
        (["messages", "replay", "1", "--from", "routed", "--reason", "x"], "Invalid value"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "include.app.cli", "--service-config", svc, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and expected in done.stderr, (args, done.stderr)
