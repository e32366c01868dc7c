"""The whole pipeline on real parts, SQLite and PostgreSQL: python-hl7 sends over MLLP to a running
`listenerd` → `dag.test()` runs stage_route, stage_transform and stage_deliver (Spark local) →
python-hl7's asyncio MLLP servers and a file destination receive every message, transformed, in
lane order, with the audit trail complete; a destination that NAKs one patient dead-letters only
that patient's lane. And: a route job SIGKILLed mid-batch loses nothing and duplicates nothing once
the sweep (maintenance_reclaim) re-pends its rows.

Each DAG sequence runs in one subprocess (one JVM, kept out of this test session)."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import hl7

from include.app.lab.listenerd import Daemon, store_toml
from include.app.lab.postgres_server import free_port, wait_for
from include.config import StoreConfig
from include.store import Store, rowlease
from include.store.lease import acquire_permanent
from tests.dags.e2e import (
    LANE,
    by_type,
    dag_results,
    file_destination,
    listenerd,
    load_patient_classes,
    mllp_destination,
    mllp_inbound,
    run_dags,
    run_stages,
    send,
    write_pipeline,
)
from tests.dags.stores import rows
from tests.spark_jobs.test_senders import MllpReceiver, raw_ack

PATIENTS = ("P0", "P1", "P2", "PNAK")
N_MESSAGES = 24


def adt(n: int, patient: str) -> str:
    return (
        f"MSH|^~\\&|ADT1|HOSP|STAGELINE|SL|20240101120000||ADT^A01^ADT_A01|ADT{n:03d}|P|2.5.1\r"
        f"EVN|A01|20240101120000\rPID|1||{patient}^^^HOSP^MR||DOE^JOHN{n}\rPV1|1|{'IO'[n % 2]}\r"
        "ZPI|1|loyalty^GOLD\r"
    )


def oru(n: int, patient: str) -> str:
    return (
        f"MSH|^~\\&|LAB|LABFAC|STAGELINE|SL|20240101120000||ORU^R01^ORU_R01|ORU{n:03d}|P|2.5.1\r"
        f"PID|1||{patient}^^^HOSP^MR||DOE^JOHN{n}\rOBR|1|ORD{n}\r"
        f"OBX|1|NM|2345-7^Glucose^LN||{80 + n}|mg/dL|70-99|N|||F\r"
    )


def messages() -> list[tuple[str, str, str]]:
    """(control id, patient, text), in send order: ADT and ORU alternating, patients round robin."""
    out = []
    for n in range(N_MESSAGES):
        patient = PATIENTS[n % len(PATIENTS)]
        text = adt(n, patient) if n % 2 == 0 else oru(n, patient)
        out.append((("ADT" if n % 2 == 0 else "ORU") + f"{n:03d}", patient, text))
    return out


def field(text: str, segment: str, index: int) -> str:
    return str(hl7.parse(text).segment(segment)(index))


def pipeline_config(directory: Path, *, ehr: int, lab: int, archive: Path) -> None:
    write_pipeline(
        directory,
        routes=[by_type("adt", "ADT", ["ehr", "archive"]), by_type("results", "ORU", ["lab", "archive"])],
        destinations=[
            mllp_destination("ehr", ehr, lane=LANE),
            mllp_destination("lab", lab, lane=LANE, max_attempts=2, backoff_seconds=0, max_backoff_seconds=0),
            file_destination("archive", archive),
        ],
        transforms=[
            {
                "destination": "ehr",
                "rules": [
                    {"set": "MSH-5", "value": "CORE"},
                    {"map": "PV1-2", "table": "patient_class"},
                    {"drop_segment": "ZPI"},
                ],
            },
            {"destination": "lab", "rules": [{"set": "MSH-5", "value": "LIS"}]},
        ],
    )


@dataclass(frozen=True)
class Pipeline:
    """A running `listenerd` with `pipeline_config` in place and its receivers listening."""

    daemon: Daemon
    store: Store
    ehr: MllpReceiver
    lab: MllpReceiver
    archive: Path
    mllp_port: int


@contextmanager
def running_pipeline(
    store_config: StoreConfig, tmp_path: Path, *, node_id: str, lab_refuses: Callable[[str], bool]
) -> Iterator[Pipeline]:
    """`listenerd` on one MLLP port, the ehr and lab receivers (the lab answers AE where
    `lab_refuses(PID-3)`), the archive directory and the `patient_class` lookup; all stop on exit."""
    ehr = MllpReceiver().start()
    lab = MllpReceiver(
        answer=lambda t: raw_ack("AE" if lab_refuses(field(t, "PID", 3)) else "AA", field(t, "MSH", 10))
    ).start()
    mllp_port = free_port()
    store = Store(store_config)
    inbound = [mllp_inbound("adt-in", mllp_port)]
    with listenerd(tmp_path / "node", store_config, node_id=node_id, receivers=(ehr, lab), inbound=inbound) as daemon:
        archive = tmp_path / "out" / "archive"
        archive.mkdir(parents=True)  # a file destination never creates its directory (a missing mount)
        pipeline_config(daemon.workdir / "config", ehr=ehr.port, lab=lab.port, archive=archive)
        load_patient_classes(store)
        yield Pipeline(daemon, store, ehr, lab, archive, mllp_port)


def test_messages_sent_over_mllp_reach_every_destination_in_lane_order_with_a_complete_audit_trail(
    airflow_db, store_config: StoreConfig, tmp_path: Path
) -> None:
    with running_pipeline(
        store_config, tmp_path, node_id="solo:1:e2e", lab_refuses=lambda patient: patient.startswith("PNAK")
    ) as pipeline:
        store, ehr, lab, archive = pipeline.store, pipeline.ehr, pipeline.lab, pipeline.archive
        sent = messages()
        assert send(pipeline.mllp_port, [text for _, _, text in sent]) == [("AA", c) for c, _, _ in sent]

        started = time.perf_counter()
        results = run_stages(pipeline.daemon)
        elapsed = time.perf_counter() - started
        assert [(r["dag_id"], r["states"]) for r in results] == [
            (dag_id, {"leader_check": "success", "recover": "success", "wait_for_work": "success", job: "success"})
            for dag_id, job in (
                ("stage_route", "route"),
                ("stage_transform", "transform"),
                ("stage_deliver", "deliver"),
            )
        ]

    message_ids = {
        r["control_id"]: r["message_id"] for r in rows(store, "SELECT control_id, message_id FROM stage_inbound")
    }
    by_patient: dict[str, list[str]] = defaultdict(list)
    for control_id, patient, _ in sent:
        by_patient[patient].append(control_id)

    # ehr: every ADT once, transformed, in send order per patient (lane)
    ehr_texts = ehr.texts
    assert sorted(ehr.control_ids) == sorted(c for c, _, _ in sent if c.startswith("ADT"))
    for patient, ids in by_patient.items():
        got = [field(t, "MSH", 10) for t in ehr_texts if field(t, "PID", 3).startswith(patient + "^")]
        assert got == [c for c in ids if c.startswith("ADT")], patient
    originals = {c: text for c, _, text in sent}
    for text in ehr_texts:
        control_id = field(text, "MSH", 10)
        n = int(control_id[3:])
        assert text == adt(n, PATIENTS[n % 4]).replace("|STAGELINE|SL|", "|CORE|SL|", 1).replace(
            f"PV1|1|{'IO'[n % 2]}", f"PV1|1|{['IN', 'OUT'][n % 2]}"
        ).replace("ZPI|1|loyalty^GOLD\r", "")
    # lab: ORU in lane order; the NAKing patient's lane: each message twice (max_attempts 2), in order
    lab_ids = lab.control_ids
    for patient, ids in by_patient.items():
        got = [c for c in lab_ids if originals[c] and f"|{patient}^" in originals[c]]
        expected = [c for c in ids if c.startswith("ORU")]
        assert got == ([c for c in expected for _ in range(2)] if patient == "PNAK" else expected), patient
    assert all(field(t, "MSH", 5) == "LIS" for t in lab.texts)
    # archive: one file per message, named by its idempotency key, the message as received
    files = {p.name: p.read_bytes().decode() for p in archive.iterdir()}
    assert files == {f"{message_ids[c]}-archive.hl7": text for c, _, text in sent}

    # the store: every outbound row done, except the NAKed lane's, dead with the receiver's answer
    outbound = rows(store, "SELECT control_id, destination, status, attempts, last_error FROM stage_outbound")
    for r in outbound:
        nak = r["destination"] == "lab" and "|PNAK^" in originals[r["control_id"]]
        assert (r["status"], r["attempts"]) == (("dead", 2) if nak else ("done", 1)), r
        if nak:
            assert "AE" in r["last_error"]
    assert len(outbound) == 2 * N_MESSAGES
    # the audit trail: one query answers "what happened to message X"
    trail = rows(store, "SELECT message_id, stage, destination, event, to_status FROM message_events ORDER BY id")
    per_message: dict[str, list[tuple]] = defaultdict(list)
    for e in trail:
        per_message[e["message_id"]].append((e["stage"], e["destination"], e["event"], e["to_status"]))
    first_adt = per_message[message_ids["ADT000"]]
    # archive is a pass-through destination: the route finalize routes it straight to done and
    # creates its outbound row; ehr has rules and goes through the transform stage
    assert sorted(first_adt, key=repr) == sorted(
        [
            ("inbound", None, "received", "pending"),
            ("inbound", None, "done", "done"),
            ("routed", "archive", "routed", "done"),
            ("routed", "ehr", "routed", "pending"),
            ("routed", "ehr", "done", "done"),
            ("outbound", "archive", "transformed", "pending"),
            ("outbound", "ehr", "transformed", "pending"),
            ("outbound", "archive", "done", "done"),
            ("outbound", "ehr", "done", "done"),
        ],
        key=repr,
    )
    for dest in ("archive", "ehr"):  # in the order it happened
        stages = [e[0] for e in first_adt if e[1] in (None, dest)]
        assert stages == sorted(stages, key=["inbound", "routed", "outbound"].index), dest
    nak_oru = message_ids["ORU003"]
    assert [e for e in per_message[nak_oru] if e[0] == "outbound" and e[1] == "lab"] == [
        ("outbound", "lab", "transformed", "pending"),
        ("outbound", "lab", "attempt_failed", "error"),
        ("outbound", "lab", "attempt_failed", "dead"),
    ]
    print(
        f"\n{store.backend}: {N_MESSAGES} messages route → transform → deliver via dag.test(): "
        f"{elapsed:.1f} s (three DAG runs in one process, JVM start included)"
    )
    store.close()


def kill_route_job_mid_batch(
    store_config: StoreConfig, tmp_path: Path, *, lease: float, n: int
) -> tuple[Path, Path, Store]:
    """Stage `n` messages, start `stage_route` and SIGKILL it (its task process and Spark JVM) once
    its job has claimed; returns the service config, the pipeline dir and an open store."""
    service = tmp_path / "stageline.toml"
    service.write_text(
        store_toml(store_config) + f"lease_ttl_seconds = {lease}\n"
        '[cluster]\nenabled = false\ncluster_name = "test-cluster"\n'
    )
    pipeline = tmp_path / "config"
    pipeline.mkdir()
    pipeline_config(pipeline, ehr=9, lab=9, archive=tmp_path / "archive")
    store = Store(store_config)
    epoch = acquire_permanent(store, node_id="solo:1:kill")
    with store.transaction() as tx:
        rowlease.stage_inbound(
            tx,
            [
                {
                    "message_id": f"m{i}",
                    "control_id": f"C{i}",
                    "connection": "mllp-in",
                    "lane_key": PATIENTS[i % 4],
                    "charset": None,
                    "payload": adt(i, PATIENTS[i % 4]),
                }
                for i in range(n)
            ],
            epoch=epoch,
            node_id="solo:1:kill",
        )
    proc = run_dags(service, pipeline, "stage_route", start_new_session=True)
    try:
        wait_for(
            lambda: rows(store, "SELECT count(*) AS n FROM stage_inbound WHERE status = 'in_flight'")[0]["n"] > 0,
            timeout=120,
            what="the route job to claim its batch",
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the task process and its Spark JVM
        proc.communicate(timeout=30)
    return service, pipeline, store


def test_a_route_job_killed_mid_batch_loses_nothing_and_duplicates_nothing(
    airflow_db, store_config: StoreConfig, tmp_path: Path
) -> None:
    lease, n = 4.0, 3000
    service, pipeline, store = kill_route_job_mid_batch(store_config, tmp_path, lease=lease, n=n)
    claimed = rows(store, "SELECT count(*) AS n FROM stage_inbound WHERE status = 'in_flight'")[0]["n"]
    assert claimed == n  # killed before its finalize: the whole batch is stranded
    assert rows(store, "SELECT count(*) AS n FROM stage_routed") == [{"n": 0}]

    wait_for(
        lambda: (
            rows(
                store,
                "SELECT count(*) AS n FROM stage_inbound WHERE status = 'in_flight'"
                + (
                    " AND lease_expires_at > (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))"
                    if store.backend == "sqlite"
                    else " AND lease_expires_at > now()"
                ),
            )[0]["n"]
            == 0
        ),
        timeout=lease + 10,
        what="the stranded row leases to expire (DB clock)",
    )
    results = dag_results(run_dags(service, pipeline, "maintenance_reclaim", "stage_route"))
    assert [r["states"].get("reclaim") or r["states"].get("route") for r in results] == ["success", "success"]

    assert rows(store, "SELECT status, count(*) AS n FROM stage_inbound GROUP BY status") == [
        {"status": "done", "n": n}
    ]
    assert rows(store, "SELECT count(*) AS n, count(DISTINCT source_id) AS s FROM stage_routed") == [
        {"n": 2 * n, "s": n}
    ]
    assert rows(store, "SELECT count(*) AS n FROM landing_routed") == [{"n": 0}]
    assert rows(store, "SELECT count(*) AS n FROM message_events WHERE event = 'lease_expired'") == [{"n": n}]
    store.close()


def test_a_killed_route_jobs_claim_comes_back_when_the_next_task_starts_not_a_row_lease_later(
    airflow_db, store_config: StoreConfig, tmp_path: Path
) -> None:
    n = 2000  # a row lease of 600 s: none expires in this test
    service, pipeline, store = kill_route_job_mid_batch(store_config, tmp_path, lease=600, n=n)
    assert rows(store, "SELECT count(*) AS n FROM stage_inbound WHERE status = 'in_flight'")[0]["n"] == n

    results = dag_results(run_dags(service, pipeline, "stage_route"))  # the next run: no sweep, no wait
    assert results[0]["states"]["route"] == "success"
    assert rows(store, "SELECT status, count(*) AS n FROM stage_inbound GROUP BY status") == [
        {"status": "done", "n": n}
    ]
    assert rows(store, "SELECT count(*) AS n, count(DISTINCT source_id) AS s FROM stage_routed") == [
        {"n": 2 * n, "s": n}
    ]
    assert rows(store, "SELECT count(*) AS n FROM message_events WHERE event = 'recovered'") == [{"n": n}]
    assert rows(store, "SELECT count(*) AS n FROM message_events WHERE event = 'lease_expired'") == [{"n": 0}]
    store.close()
