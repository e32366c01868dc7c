"""One inbound validation path for every transport: decode, refuse what no store can hold (with a
reason safe to send back), compute the lane key, build the `Inbound` row."""
from __future__ import annotations

import pytest

from listeners.hl7msg import parse_header
from listeners.inbound import PayloadRejected, build_inbound


def adt(control_id: str, *, pid: str = "DOE^JANE", charset: str = "") -> bytes:
    header = f"MSH|^~\\&|SEND|FAC|RECV|RFAC|20240101||ADT^A01|{control_id}|P|2.5"
    if charset:
        header += "||||||" + charset
    return f"{header}\rPID|1||123||{pid}".encode("latin-1" if charset == "8859/1" else "utf-8")


def test_hl7_payload_gives_control_id_and_lane() -> None:
    item = build_inbound(adt("C9"), connection="c", charset="utf-8", lane_of=lambda text: text[-3:])
    assert (item.control_id, item.lane_key, item.charset, item.connection) == ("C9", "ANE", "utf-8", "c")
    assert item.payload == adt("C9").decode()


def test_non_hl7_payload_is_allowed_without_control_id() -> None:
    item = build_inbound(b'{"a": 1}', connection="c", charset="utf-8")
    assert (item.payload, item.control_id, item.lane_key) == ('{"a": 1}', None, None)


def test_msh18_charset_wins_over_the_connection_charset() -> None:
    data = adt("C1", pid="MÜLLER^JÖRG", charset="8859/1")
    item = build_inbound(data, connection="c", charset="utf-8")
    assert "MÜLLER" in item.payload and item.charset == "iso8859-1"


@pytest.mark.parametrize("data, reason", [
    (b"\xff\xfe bad", "undecodable"),
    (b"a\x00b", "NUL"),
    (b"", "empty"),
])
def test_unstageable_bytes_are_rejected_with_a_safe_reason(data: bytes, reason: str) -> None:
    with pytest.raises(PayloadRejected, match=reason) as info:
        build_inbound(data, connection="c", charset="utf-8")
    assert "bad" not in str(info.value)


def test_failing_lane_of_refuses_the_message() -> None:
    def lane_of(text: str) -> str | None:
        raise KeyError(text)

    with pytest.raises(PayloadRejected, match="lane"):
        build_inbound(adt("C1"), connection="c", charset="utf-8", lane_of=lane_of)


def test_the_mllp_header_parse_is_reused_and_validated_like_any_other_input() -> None:
    """MLLP hands over its own complete parse; a NUL in it is refused exactly as on TCP/HTTP/file."""
    good = adt("M1")
    item = build_inbound(good, connection="m", charset="utf-8", header=parse_header(good))
    assert (item.payload, item.control_id, item.charset) == (good.decode(), "M1", "utf-8")
    bad = adt("M2", pid="DOE\x00JANE")
    reasons = []
    for header in (parse_header(bad), None):
        with pytest.raises(PayloadRejected) as info:
            build_inbound(bad, connection="m", charset="utf-8", header=header)
        reasons.append(str(info.value))
    assert reasons[0] == reasons[1] and "NUL" in reasons[0] and "DOE" not in reasons[0]


def test_an_overlong_control_id_is_not_stored_as_the_key() -> None:
    data = adt("X" * 250)
    assert build_inbound(data, connection="c", charset="utf-8").control_id is None
    assert build_inbound(data, connection="c", charset="utf-8", header=parse_header(data)).control_id is None
