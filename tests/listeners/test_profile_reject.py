"""A connection with a conformance profile, end to end: a real listenerd, real MLLP sockets, real
SQLite and PostgreSQL. ``reject`` answers a message with findings ``AR`` with one ERR a finding
(ERR-2 where, ERR-3 its table 0357 code, ERR-4 severity) and stages nothing of it; conforming
messages on the same connection are answered ``AA`` and staged as always."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.listeners.conftest import leading_node
from tests.listeners.test_ack_codes import E101, E102, E103, err, exchange, mllp, staged_ids

PROFILES = Path(__file__).resolve().parents[2] / "config" / "profiles"

GOOD = (
    "MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
    "EVN|A01|20240101120000\rPID|1||P1^^^HOSP^MR||DOE^JANE||19800101|F\rPV1|1|I\r"
)


@pytest.fixture
def daemon(tmp_path, store_config):
    d = leading_node(
        tmp_path,
        store_config,
        idle_timeout_seconds=30,
        profile=[str(PROFILES / "adt_a01.toml"), str(PROFILES / "oru_r01.toml")],
        on_violation="reject",
    )
    yield d
    d.stop()


def errs(ack) -> list[tuple[str, str, str]]:
    return [(str(e[2]), str(e[3]), str(e[4])) for e in ack.segments("ERR")]


def test_reject_answers_ar_with_one_err_a_finding_and_stages_nothing(daemon, store_config):
    bad = GOOD.format(cid="BAD1").replace("19800101|F", "19801301|X").replace("PV1|1|I", "PV1|1|Q")
    wrong_type = GOOD.format(cid="BAD2").replace("ADT^A01^ADT_A01", "ADT^A03")
    no_pv1 = GOOD.format(cid="BAD3").replace("PV1|1|I\r", "")
    frames = [mllp(GOOD.format(cid="OK1")), mllp(bad), mllp(wrong_type), mllp(no_pv1), mllp(GOOD.format(cid="OK2"))]
    acks = exchange(daemon.mllp_port, frames, expect=5)
    assert [(str(a.segment("MSA")[1]), str(a.segment("MSA")[2])) for a in acks] == [
        ("AA", "OK1"),
        ("AR", "BAD1"),
        ("AR", "BAD2"),
        ("AR", "BAD3"),
        ("AA", "OK2"),
    ]
    assert errs(acks[1]) == [
        ("PID^1^7^1^1", E102, "E"),
        ("PID^1^8", E103, "E"),
        ("PV1^1^2", E103, "E"),
    ]
    assert str(acks[1].segment("MSA")[3]).startswith("profile: PID-7 (Date/Time of Birth) component 1 month")
    assert str(acks[1].segment("MSA")[3]).endswith("(and 2 more)")
    assert [str(e[8]) for e in acks[1].segments("ERR")] == [  # each ERR its own rule, not the summary
        str(acks[1].segment("MSA")[3]).removeprefix("profile: ").removesuffix(" (and 2 more)"),
        "PID-8 (Administrative Sex) is not in HL7 table 0001",
        "PV1-2 (Patient Class) is not in HL7 table 0004",
    ]
    assert errs(acks[2]) == [("MSH^1^9", err("200", "Unsupported message type"), "E")]
    assert errs(acks[3]) == [("PV1^1", E101, "E")]
    assert staged_ids(store_config) == ["OK1", "OK2"]


def test_many_findings_are_counted_and_a_long_segment_id_is_named_invalid(daemon, store_config):
    """5,000 findings: 20 ERRs, and MSA-3 gives the true count of the rest and of those not listed.
    A 5,000-character segment id (here with a separator in it) is not a segment id: the ERR says so,
    names at most its first three characters, escaped, and stays short."""
    oru = "MSH|^~\\&|LAB|HOSP|SL|SL|20240101120000||ORU^R01|MANY|P|2.5.1\rPID|1||P1^^^HOSP^MR||DOE\rOBR|1|O1||GLU\r"
    many = oru + "OBX|1|NM|2345-7^Glucose^LN||95|mg/dL|70-99|NOPE|||F\r" * 5000
    long_id = GOOD.format(cid="LONG") + "Q^" + "Q" * 4998 + "|x\r"
    acks = exchange(daemon.mllp_port, [mllp(many), mllp(long_id)], expect=2, timeout=30)
    assert [str(a.segment("MSA")[1]) for a in acks] == ["AR", "AR"]
    assert errs(acks[0]) == [(f"OBX^{n}^8", E103, "E") for n in range(1, 21)]
    assert str(acks[0].segment("MSA")[3]) == (
        "profile: OBX-8 (Abnormal Flags) is not in HL7 table 0078 (and 4999 more: 4980 not listed)"
    )
    (err_segment,) = acks[1].segments("ERR")
    assert errs(acks[1]) == [("Q\\S\\Q^1", err("100", "Segment sequence error"), "E")]
    assert str(err_segment[8]) == "a segment with an invalid id (5000 characters, not 3) is not expected here"
    assert len(str(err_segment)) < 200
    assert staged_ids(store_config) == []


def test_a_batch_with_one_bad_message_is_refused_with_its_findings_located_in_the_batch(daemon, store_config):
    bad = GOOD.format(cid="B2").replace("PID|1||P1^^^HOSP^MR", "PID|1||")
    batch = f"BHS|^~\\&|HIS|HOSP|SL|SL|||||BATCH1\r{GOOD.format(cid='B1')}{bad}BTS|2\r"
    (ack,) = exchange(daemon.mllp_port, [mllp(batch)], expect=1)
    assert (str(ack.segment("MSA")[1]), str(ack.segment("MSA")[2])) == ("AR", "BATCH1")
    assert errs(ack) == [("PID^2^3", E101, "E")]
    assert staged_ids(store_config) == []


def test_a_large_message_is_checked_off_the_reactor_with_the_same_answer(daemon, store_config):
    """Over 64 KiB the check runs on a thread (listeners/offload.py): the answer is the same."""
    head = "MSH|^~\\&|LAB|HOSP|SL|SL|20240101120000||ORU^R01|{cid}|P|2.5.1\rPID|1||P1^^^HOSP^MR||DOE\rOBR|1|O1||GLU\r"
    obx = "OBX|1|NM|2345-7^Glucose^LN||95|mg/dL|70-99|N|||F\r"
    good = head.format(cid="BIG1") + obx * 3000
    bad = head.format(cid="BIG2") + obx * 2999 + obx.replace("|N|", "|NOPE|")
    assert len(bad) > 128 * 1024
    acks = exchange(daemon.mllp_port, [mllp(good), mllp(bad)], expect=2)
    assert [str(a.segment("MSA")[1]) for a in acks] == ["AA", "AR"]
    assert errs(acks[1]) == [("OBX^3000^8", E103, "E")]
    assert staged_ids(store_config) == ["BIG1"]


def test_http_names_every_finding_as_mllp_would():
    """HTTP's 400 body carries the first ERR as `hl7_error` and the others under `more`."""
    from listeners.http_listener import _hl7_error
    from listeners.profile_check import read_conformance
    from listeners.validation import PayloadRejected, build_inbound

    conformance = read_conformance((str(PROFILES / "adt_a01.toml"),), "reject", PROFILES)
    bad = GOOD.format(cid="H1").replace("19800101|F", "19800101|X").replace("PV1|1|I", "PV1|1|Q")
    with pytest.raises(PayloadRejected) as caught:
        build_inbound(bad.encode(), connection="http-in", charset="utf-8", conformance=conformance)
    assert _hl7_error(caught.value) == {
        "code": "103",
        "text": "Table value not found",
        "location": "PID^1^8",
        "message": "PID-8 (Administrative Sex) is not in HL7 table 0001",
        "more": [
            {
                "code": "103",
                "text": "Table value not found",
                "location": "PV1^1^2",
                "message": "PV1-2 (Patient Class) is not in HL7 table 0004",
            }
        ],
    }
