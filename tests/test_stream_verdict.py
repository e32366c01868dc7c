"""The failover verdict (`tests/support/stream.judge`) counts what the benchmark reports: an ACKed
message never delivered is lost, a control id delivered twice is a duplicate, a message first
delivered after a later one of its lane is an inversion, and a message that was never ACKed is
neither lost nor late."""

from __future__ import annotations

from tests.support.stream import Sent, judge, parse_control_id


def sent(cid: str, *, acked: float | None = 1.0) -> Sent:
    lane, seq = parse_control_id(cid)
    return Sent(cid, lane, seq, first_try=0.5, attempts=1, acked_at=acked)


def test_lost_duplicated_and_inverted_are_told_apart() -> None:
    ledger = {c: sent(c) for c in ("S-L00-000001", "S-L00-000002", "S-L00-000003", "S-L01-000001", "S-L01-000002")}
    ledger["S-L01-000003"] = sent("S-L01-000003", acked=None)  # never ACKed: not the pipeline's to deliver
    deliveries = [
        {"t": t, "control_id": c}
        for t, c in [
            (2.0, "S-L00-000001"),
            (3.0, "S-L00-000003"),
            (4.0, "S-L00-000002"),  # 2 after 3: inverted
            (2.5, "S-L01-000001"),
            (5.0, "S-L01-000001"),  # re-delivered
        ]
    ]
    v = judge(ledger, deliveries)
    assert (v.sent, v.acked, v.delivered) == (6, 5, 4)
    assert v.lost == ["S-L01-000002"]
    assert v.duplicated == ["S-L01-000001"]
    assert v.inversions == ["S-L00-000002"]
    assert sorted(v.latencies) == [1.0, 1.5, 2.0, 3.0]  # ACK → first delivery


def test_a_late_duplicate_of_an_old_message_is_not_an_inversion() -> None:
    ledger = {c: sent(c) for c in ("S-L00-000001", "S-L00-000002")}
    deliveries = [
        {"t": 2.0, "control_id": "S-L00-000001"},
        {"t": 3.0, "control_id": "S-L00-000002"},
        {"t": 4.0, "control_id": "S-L00-000001"},
    ]
    v = judge(ledger, deliveries)
    assert v.inversions == [] and v.duplicated == ["S-L00-000001"] and v.lost == []
