"""HL7 batches end to end on real parts, SQLite and PostgreSQL: a batch file dropped into a running
`listenerd`'s file drop and a batch sent in one MLLP frame are split at ingest → `dag.test()` runs
stage_route, stage_transform and stage_deliver (Spark local) → python-hl7 MLLP receivers get each
message by its own route (ADT to the ADT route, ORU to the results route), in lane order, and a
`batch = true` file destination writes them back as ONE batch file; every message's audit trail
names the batch it came in (docs/listenerd.md, "Batches")."""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from pathlib import Path

import hl7

from include.app.lab.postgres_server import free_port, wait_for
from include.config import StoreConfig
from include.store import Store
from listeners.hl7batch import split_batch
from tests.dags.e2e import (
    LANE,
    by_type,
    file_destination,
    listenerd,
    mllp_destination,
    mllp_inbound,
    run_stages,
    write_pipeline,
)
from tests.dags.stores import rows
from tests.spark_jobs.test_senders import MllpReceiver

FILE_BATCH = [("A1", "ADT^A01", "P1"), ("R1", "ORU^R01", "P2"), ("A2", "ADT^A08", "P2"), ("R2", "ORU^R01", "P1")]
MLLP_BATCH = [("A3", "ADT^A03", "P1"), ("R3", "ORU^R01", "P3")]


def batch(name: str, messages: list[tuple[str, str, str]]) -> bytes:
    body = "".join(
        f"MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||{kind}|{cid}|P|2.5.1\r"
        f"PID|1||{patient}^^^HOSP^MR||DOE^JANE\rPV1|1|O\r"
        for cid, kind, patient in messages
    )
    return (
        f"FHS|^~\\&|HIS|HOSP|SL|SL|20240101120000||||F-{name}\r"
        f"BHS|^~\\&|HIS|HOSP|SL|SL|20240101120000||||B-{name}\r{body}BTS|{len(messages)}\rFTS|1\r"
    ).encode()


def pipeline_config(directory: Path, *, ehr: int, lab: int, nightly: Path) -> None:
    write_pipeline(
        directory,
        routes=[by_type("adt", "ADT", ["ehr", "nightly"]), by_type("results", "ORU", ["lab", "nightly"])],
        destinations=[
            mllp_destination("ehr", ehr, lane=LANE),
            mllp_destination("lab", lab, lane=LANE),
            file_destination("nightly", nightly, batch=True),
        ],
    )


def send_mllp(port: int, data: bytes) -> hl7.Message:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(b"\x0b" + data + b"\x1c\r")
        reply = b""
        while b"\x1c\r" not in reply:
            reply += s.recv(65536)
    return hl7.parse(reply.strip(b"\x0b\x1c\r").decode())


def test_a_batch_file_and_an_mllp_batch_reach_their_routes_destinations_one_message_each_with_trails_naming_the_batch(
    airflow_db, store_config: StoreConfig, tmp_path: Path
) -> None:
    ehr, lab = MllpReceiver().start(), MllpReceiver().start()
    mllp_port, drop = free_port(), tmp_path / "drop"
    drop.mkdir()
    store = Store(store_config)
    with listenerd(
        tmp_path / "node",
        store_config,
        node_id="solo:1:batch-e2e",
        receivers=(ehr, lab),
        inbound=[
            mllp_inbound("batch-mllp", mllp_port),
            {
                "name": "batch-file",
                "kind": "file",
                "directory": str(drop),
                "poll_seconds": 0.1,
                "archive": str(tmp_path / "archive"),
                "lane_key": LANE,
            },
        ],
    ) as daemon:
        nightly = tmp_path / "out" / "nightly"
        nightly.mkdir(parents=True)
        pipeline_config(daemon.workdir / "config", ehr=ehr.port, lab=lab.port, nightly=nightly)

        (drop / "adt-results.hl7").write_bytes(batch("file", FILE_BATCH))
        wait_for(lambda: (tmp_path / "archive" / "adt-results.hl7").exists(), timeout=20, what="the batch file staged")
        ack = send_mllp(mllp_port, batch("mllp", MLLP_BATCH))
        assert (str(ack.segment("MSA")(1)), str(ack.segment("MSA")(2))) == ("AA", "B-mllp")

        started = time.perf_counter()
        results = run_stages(daemon)
        elapsed = time.perf_counter() - started
        assert [set(r["states"].values()) for r in results] == [{"success"}] * 3

    sent = FILE_BATCH + MLLP_BATCH
    inbound = rows(
        store,
        "SELECT id, message_id, control_id, connection, batch_id, batch_seq, status FROM stage_inbound ORDER BY id",
    )
    assert [(r["control_id"], r["connection"], r["batch_seq"], r["status"]) for r in inbound] == [
        (cid, "batch-file", n, "done") for n, (cid, _, _) in enumerate(FILE_BATCH, 1)
    ] + [(cid, "batch-mllp", n, "done") for n, (cid, _, _) in enumerate(MLLP_BATCH, 1)]
    batches = {b["connection"]: b for b in rows(store, "SELECT * FROM inbound_batches")}
    assert {c: (b["fhs_control_id"], b["bhs_control_id"], b["message_count"]) for c, b in batches.items()} == {
        "batch-file": ("F-file", "B-file", 4),
        "batch-mllp": ("F-mllp", "B-mllp", 2),
    }

    # each message by its own route, each lane (patient) in the order sent
    def lanes(texts: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for t in texts:
            m = hl7.parse(t)
            out[str(m.segment("PID")(3)(1)(1))].append(str(m.segment("MSH")(10)))
        return dict(out)

    def expected(kind: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for cid, k, patient in sent:
            if k.startswith(kind):
                out[patient].append(cid)
        return dict(out)

    assert lanes(ehr.texts) == expected("ADT") and sorted(ehr.control_ids) == ["A1", "A2", "A3"]
    assert lanes(lab.texts) == expected("ORU") and sorted(lab.control_ids) == ["R1", "R2", "R3"]
    # the file destination re-batched them: one batch file, every message once, in arrival order
    [written] = list(nightly.iterdir())
    split = split_batch(written.read_bytes())
    assert [str(hl7.parse(m.decode()).segment("MSH")(10)) for m in split.messages] == [c for c, _, _ in sent]
    assert split.declared == len(sent)

    trail = rows(store, "SELECT message_id, stage, destination, event, detail FROM message_events ORDER BY id")
    for row in inbound:
        events = [(e["stage"], e["destination"], e["event"]) for e in trail if e["message_id"] == row["message_id"]]
        first = next(e for e in trail if e["message_id"] == row["message_id"])
        size = batches[row["connection"]]["message_count"]
        assert first["detail"] == f"batch {row['batch_id']}: message {row['batch_seq']} of {size}"
        to = "ehr" if row["control_id"].startswith("A") else "lab"
        assert sorted(e for e in events if e[0] == "outbound" and e[2] == "done") == [
            ("outbound", to, "done"),
            ("outbound", "nightly", "done"),
        ]
    print(
        f"\n{store.backend}: 2 batches ({len(sent)} messages) route → transform → deliver via dag.test(): "
        f"{elapsed:.1f} s"
    )
    store.close()
