"""A profile gives the same verdict on every transport: MLLP `AR`, TCP `NAK`, HTTP 400 and the
file drop's `.reason` all name the same first finding, and nothing of a refused message is
staged; a conforming message goes through each of them (real listenerd, real store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from tests.listeners.hl7_traffic import post_message
from tests.listeners.test_batches import http_verdict, mllp_verdict, over_file, over_tcp, rows

PROFILE = Path(__file__).resolve().parents[2] / "config" / "profiles" / "adt_a01.toml"
GOOD = (
    "MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
    "EVN|A01|20240101120000\rPID|1||P1^^^HOSP^MR||DOE^JANE||19800101|F\rPV1|1|I\r"
)


@pytest.fixture
def listenerd(tmp_path, store_config):
    ports = {kind: free_port() for kind in ("mllp", "tcp", "http")}
    drop, errors, archive = tmp_path / "drop", tmp_path / "refused", tmp_path / "archive"
    drop.mkdir()
    checked = {"profile": str(PROFILE), "on_violation": "reject"}
    d = Daemon(
        tmp_path / "node",
        store_config,
        node_id="solo:1:profiles",
        inbound=[
            {"name": "in-mllp", "kind": "mllp", "port": ports["mllp"], **checked},
            {"name": "in-tcp", "kind": "tcp", "port": ports["tcp"], **checked},
            {"name": "in-http", "kind": "http", "port": ports["http"], **checked},
            {
                "name": "in-file",
                "kind": "file",
                "directory": str(drop),
                "archive": str(archive),
                "error_directory": str(errors),
                "poll_seconds": 0.1,
                **checked,
            },
        ],
    ).start()
    try:
        for port in ports.values():
            wait_for(lambda port=port: port_open(port), timeout=20, what="bind")
        d.ports, d.drop, d.errors, d.archive = ports, drop, errors, archive
        yield d
    finally:
        d.stop()


def test_every_transport_refuses_with_the_same_first_finding_and_takes_what_conforms(listenerd, store_config):
    d = listenerd
    # two findings: MSH-7 not a date/time, PV1-2 outside table 0004
    bad = GOOD.format(cid="BAD").replace("SL|20240101120000|", "SL|2024013|").replace("PV1|1|I", "PV1|1|Q").encode()
    verdicts = {
        "mllp": mllp_verdict(d.ports["mllp"], bad).removeprefix("AR "),
        "tcp": over_tcp(d.ports["tcp"], bad).removeprefix("NAK "),
        "http": http_verdict(d.ports["http"], bad).removeprefix("400 "),
        "file": over_file(d.drop, d.errors, d.archive, bad, "bad.hl7"),
    }
    assert verdicts == dict.fromkeys(verdicts, verdicts["mllp"])
    assert verdicts["mllp"].startswith("profile: MSH-7 (Date/Time Of Message) component 1 not a date/time")
    assert verdicts["mllp"].endswith("(and 1 more)")
    assert rows(store_config, "SELECT count(*) AS n FROM stage_inbound")[0]["n"] == 0

    assert mllp_verdict(d.ports["mllp"], GOOD.format(cid="G1").encode()) == "AA G1"
    assert over_tcp(d.ports["tcp"], GOOD.format(cid="G2").encode()).startswith("ACK")
    status, _ = post_message(d.ports["http"], "in-http", GOOD.format(cid="G3").encode())
    assert status == 202  # accepted: staged
    assert over_file(d.drop, d.errors, d.archive, GOOD.format(cid="G4").encode(), "good.hl7") == "archived"
    staged = rows(store_config, "SELECT connection, control_id FROM stage_inbound ORDER BY control_id")
    assert [(r["connection"], r["control_id"]) for r in staged] == [
        ("in-mllp", "G1"),
        ("in-tcp", "G2"),
        ("in-http", "G3"),
        ("in-file", "G4"),
    ]
