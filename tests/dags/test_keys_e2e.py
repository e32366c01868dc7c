"""Business keys end to end, on SQLite and PostgreSQL: messages sent over MLLP to a real listenerd,
routed by the real route stage (`dag.test()` of stage_route, Spark Connect), whose task indexes the
keys.toml keys of what it claims; then `stageline messages find --key` (a real subprocess) finds
one patient's messages, newest first, and `messages show` lists each one's keys."""

from __future__ import annotations

import json
from pathlib import Path

from include.app.lab.postgres_server import free_port
from include.config import StoreConfig
from include.store import Store
from tests.dags.e2e import listenerd, mllp_inbound, run_stages, send
from tests.dags.test_operator_e2e import stageline
from tests.dags.test_pipeline_e2e import messages, pipeline_config
from tests.spark_jobs.test_senders import MllpReceiver


def test_keys_of_messages_sent_through_listenerd_are_found_after_the_route_stage(
    airflow_db, store_config: StoreConfig, tmp_path: Path
) -> None:
    ehr, lab = MllpReceiver().start(), MllpReceiver().start()
    mllp_port = free_port()
    store = Store(store_config)
    try:
        with listenerd(
            tmp_path / "node",
            store_config,
            node_id="solo:1:keys",
            receivers=(ehr, lab),
            inbound=[mllp_inbound("adt-in", mllp_port)],
        ) as daemon:
            svc = daemon.workdir / "stageline.toml"
            pipeline = daemon.workdir / "config"
            archive = tmp_path / "out"
            archive.mkdir()
            pipeline_config(pipeline, ehr=ehr.port, lab=lab.port, archive=archive)
            (pipeline / "keys.toml").write_text(
                '[keys]\nmrn = "PID-3.1"\nevent = "MSH-9.2"\n\n[connections.adt-in]\norder = "OBR-2"\n'
            )
            sent = messages()
            assert {code for code, _ in send(mllp_port, [text for _, _, text in sent])} == {"AA"}
            # staged, not yet routed: the route indexes what it claims
            assert not stageline(svc, "messages", "find", "--key", "mrn=P1", "--json").strip("[]\n")

            run_stages(daemon, "stage_route")

            found = json.loads(stageline(svc, "messages", "find", "--key", "mrn=P1", "--json"))
            p1 = [control for control, patient, _ in sent if patient == "P1"]
            assert [r["control_id"] for r in found] == list(reversed(p1))  # newest first
            assert {(r["status"], r["tier"], r["connection"]) for r in found} == {("done", "hot", "adt-in")}
            assert [r["created_ms"] for r in found] == sorted((r["created_ms"] for r in found), reverse=True)
            # a prefix: every patient whose MRN starts with P (all of them)
            everyone = json.loads(stageline(svc, "messages", "find", "--key", "mrn=P*", "--limit", "1000", "--json"))
            assert len(everyone) == len(sent)
            oru = json.loads(stageline(svc, "messages", "find", "--key", "event=R01", "--json"))
            assert sorted(r["control_id"] for r in oru) == sorted(
                c for c in (s[0] for s in sent) if c.startswith("ORU")
            )
            shown = stageline(svc, "messages", "show", "ORU001")
            assert "  keys: event=R01, mrn=P1, order=ORD1\n" in shown
    finally:
        store.close()
