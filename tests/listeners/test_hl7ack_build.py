"""ACK building, checked by parsing the result with python-hl7 (a real third-party parser)."""

from __future__ import annotations

from datetime import UTC, datetime

import hl7
import pytest

from listeners.hl7ack import AckCode, AckDecision, accept_code, build_ack, build_fallback_ack, escape
from listeners.hl7msg import HL7Header, parse_header

INBOUND = (
    b"MSH|^~\\&|SENDAPP|SENDFAC|RECVAPP|RECVFAC|20240102030405||ADT^A01^ADT_A01|MSG00001|P|2.5.1"
    b"|||AL|NE\r"
    b"PID|1||12345^^^HOSP^MR||DOE^JANE\r"
)
NOW = datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC)


def parsed(ack: bytes, encoding: str = "utf-8") -> hl7.Message:
    return hl7.parse(ack, encoding=encoding)


def test_sender_and_receiver_are_swapped() -> None:
    ack = parsed(build_ack(parse_header(INBOUND), AckCode.AA))
    msh = ack.segment("MSH")
    assert (str(msh[3]), str(msh[4])) == ("RECVAPP", "RECVFAC")
    assert (str(msh[5]), str(msh[6])) == ("SENDAPP", "SENDFAC")


def test_configured_identity_becomes_the_sending_application_escaped() -> None:
    ack = build_ack(
        parse_header(INBOUND),
        AckCode.AA,
        sending_application="STAGE|LINE",
        sending_facility="HQ^1",
    )
    msh = parsed(ack).segment("MSH")
    assert str(msh[3]) == "STAGE\\F\\LINE"
    assert str(msh[4]) == "HQ\\S\\1"
    assert str(msh[5]) == "SENDAPP"


def test_msa2_equals_the_inbound_control_id() -> None:
    for control_id in ["MSG00001", "a-b.c_d 1", "20240101120000.1234"]:
        data = INBOUND.replace(b"MSG00001", control_id.encode())
        for code in AckCode:
            msa = parsed(build_ack(parse_header(data), code)).segment("MSA")
            assert str(msa[1]) == code.value
            assert str(msa[2]) == control_id


def test_ack_has_a_fresh_control_id_type_version_and_processing_id() -> None:
    header = parse_header(INBOUND)
    first = parsed(build_ack(header, AckCode.AA, now=NOW)).segment("MSH")
    second = parsed(build_ack(header, AckCode.AA)).segment("MSH")
    assert str(first[10]) not in {"MSG00001", str(second[10])}
    assert 1 <= len(str(first[10])) <= 20
    assert str(first[9]) == "ACK^A01^ACK"
    assert str(first[11]) == "P"
    assert str(first[12]) == "2.5.1"
    assert str(first[7]) == "20240506070809+0000"
    assert build_ack(header, "AA", control_id="ACK1").split(b"|")[9] == b"ACK1"


def test_message_type_is_plain_ack_without_a_trigger_event() -> None:
    data = INBOUND.replace(b"ADT^A01^ADT_A01", b"ADT")
    assert str(parsed(build_ack(parse_header(data), AckCode.AA)).segment("MSH")[9]) == "ACK"


def test_accept_has_no_err_segment() -> None:
    ack = parsed(build_ack(parse_header(INBOUND), AckCode.AA, reason="ignored"))
    assert [str(s[0]) for s in ack] == ["MSH", "MSA"]
    assert len(ack.segment("MSA")) == 3


@pytest.mark.parametrize("code", [AckCode.AE, AckCode.AR])
def test_negative_acks_carry_an_err_segment_with_the_reason(code: AckCode) -> None:
    ack = parsed(build_ack(parse_header(INBOUND), code, reason="db down", error_code="207"))
    assert [str(s[0]) for s in ack] == ["MSH", "MSA", "ERR"]
    err = ack.segment("ERR")
    assert str(err[3]) == "207^Application internal error^HL70357"
    assert str(err[4]) == "E"
    assert str(err[8]) == "db down"
    assert str(ack.segment("MSA")[3]) == "db down"  # MSA-3 still read by pre-2.7 senders


def test_hostile_reason_is_escaped_and_cannot_break_the_structure() -> None:
    reason = "a|b^c~d\\e&f\rMSH|fake\nOBX\x0b\x1cend"
    raw = build_ack(parse_header(INBOUND), AckCode.AE, reason=reason)
    assert raw.count(b"\r") == 3
    assert b"\x0b" not in raw and b"\x1c" not in raw and b"\n" not in raw
    ack = parsed(raw)
    assert [str(s[0]) for s in ack] == ["MSH", "MSA", "ERR"]
    err = ack.segment("ERR")
    assert len(err) == 9
    assert ack.unescape(str(err[8])) == reason


def test_escape_maps_every_separator_and_control_character() -> None:
    assert escape("|^~\\&") == "\\F\\\\S\\\\R\\\\E\\\\T\\"
    assert escape("x\r\ny\x7f") == "x\\X0D\\\\X0A\\y\\X7F\\"
    assert escape("#", encoding_characters="^~\\&#") == "\\P\\"
    assert escape("#") == "#"
    assert escape("a!b", field_separator="#", encoding_characters="$%!*") == "a!E!b"
    assert escape("Zürich ✓") == "Zürich ✓"


def test_long_reasons_are_truncated() -> None:
    ack = parsed(build_ack(parse_header(INBOUND), AckCode.AE, reason="x" * 5000))
    assert len(str(ack.segment("ERR")[8])) == 200


def test_custom_separators_are_reused_in_the_ack() -> None:
    data = b"MSH#$%!*#APP#FAC#RA#RF#20240101##ORU$R01#ID-7#P#2.4\rOBX#1\r"
    raw = build_ack(parse_header(data), AckCode.AR, reason="bad # and $")
    assert raw.startswith(b"MSH#$%!*#RA#RF#APP#FAC#")
    ack = parsed(raw)
    assert str(ack.segment("MSA")[2]) == "ID-7"
    assert str(ack.segment("MSH")[9]) == "ACK$R01$ACK"
    assert b"bad !F! and !S!" in raw


def test_five_encoding_characters_are_kept_and_the_truncation_character_escaped() -> None:
    data = b"MSH|^~\\&#|A|B|C|D|20240101||ADT^A04^ADT_A01|C5|P|2.7\r"
    raw = build_ack(parse_header(data), AckCode.AE, reason="50# off")
    assert raw.startswith(b"MSH|^~\\&#|C|D|A|B|")
    assert b"50\\P\\ off" in raw
    header = parse_header(raw)
    assert header.encoding_characters == "^~\\&#"
    assert header.message_type == "ACK^A04^ACK"
    ack = parsed(raw)
    assert str(ack.segment("MSA")[2]) == "C5"
    assert len(ack.segment("MSA")) == 3  # MSA-3 was withdrawn in v2.7


def test_latin1_charset_round_trips_in_the_ack() -> None:
    text = "MSH|^~\\&|APP|Zürich|RÉCEPTEUR|Genève|||ADT^A01|C-ü1|P|2.5|||||CHE|8859/1\rPID|1\r"
    header = parse_header(text.encode("latin-1"))
    raw = build_ack(header, AckCode.AE, reason="Données refusées")
    assert "Zürich".encode("latin-1") in raw
    assert "Zürich".encode() not in raw
    ack = parsed(raw, encoding="latin-1")
    msh = ack.segment("MSH")
    assert (str(msh[3]), str(msh[4]), str(msh[6])) == ("RÉCEPTEUR", "Genève", "Zürich")
    assert str(msh[18]) == "8859/1"
    assert str(ack.segment("MSA")[2]) == "C-ü1"
    assert str(ack.segment("ERR")[8]) == "Données refusées"
    assert parse_header(raw).encoding == "iso8859-1"


def test_characters_outside_the_charset_degrade_to_question_marks() -> None:
    data = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5||||||ASCII\r"
    raw = build_ack(parse_header(data), AckCode.AE, reason="naïve ✓")
    assert b"na?ve ?" in raw
    raw.decode("ascii")


def test_big5_ack_echoes_facility_bytes_that_contain_separator_bytes() -> None:
    text = "MSH|^~\\&|APP|咽喉科|R|F|||ADT^A01|C9|P|2.5|||||TWN|BIG-5\r"
    raw = build_ack(parse_header(text.encode("big5")), AckCode.AA)
    back = parse_header(raw)
    assert back.receiving_facility == "咽喉科"
    assert back.charset == "BIG-5"


def test_control_characters_in_echoed_values_are_dropped() -> None:
    header = HL7Header(
        field_separator="|",
        encoding_characters="^~\\&",
        sending_application="AP\x0bP",
        sending_facility="F\x1cAC",
        receiving_application="R",
        receiving_facility="RF",
        message_type="ADT^A\x0001",
        control_id="C\x1b1",
        processing_id="P",
        version="2.5",
        charset="",
        encoding="utf-8",
    )
    raw = build_ack(header, AckCode.AA)
    assert all(b >= 0x20 or b == 0x0D for b in raw)
    ack = parsed(raw)
    assert str(ack.segment("MSH")[5]) == "APP"
    assert str(ack.segment("MSA")[2]) == "C1"


def test_pre_25_versions_use_err1_and_msa3() -> None:
    data = INBOUND.replace(b"2.5.1", b"2.3")
    ack = parsed(build_ack(parse_header(data), AckCode.AR, reason="nope", error_code="101"))
    err = ack.segment("ERR")
    assert len(err) == 2
    assert str(err[1]) == "^^^101&nope&HL70357"
    assert str(ack.segment("MSA")[3]) == "nope"


def test_fallback_ack_uses_default_separators_and_an_empty_msa2() -> None:
    raw = build_fallback_ack(AckCode.AR, reason="no_msh: no MSH segment", sending_application="STAGELINE", now=NOW)
    raw.decode("ascii")
    assert raw.startswith(b"MSH|^~\\&|STAGELINE|||")
    ack = parsed(raw)
    assert [str(s[0]) for s in ack] == ["MSH", "MSA", "ERR"]
    assert str(ack.segment("MSH")[9]) == "ACK"
    assert str(ack.segment("MSH")[12]) == "2.5"
    msa = ack.segment("MSA")
    assert str(msa[1]) == "AR"
    assert str(msa[2]) == ""
    assert str(ack.segment("ERR")[8]) == "no_msh: no MSH segment"


def test_ack_decision_helpers() -> None:
    assert AckDecision.accept() == AckDecision(AckCode.AA)
    assert AckDecision.error("x").code is AckCode.AE
    assert AckDecision.reject("y", error_code="101") == AckDecision(AckCode.AR, "y", "101")
    assert AckDecision("AA").code is AckCode.AA  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AckDecision("OK")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AckDecision("CA")  # type: ignore[arg-type]  # the commit codes are accept_code's, not a handler's
    with pytest.raises(ValueError):
        build_ack(parse_header(INBOUND), "OK")


@pytest.mark.parametrize(
    "msh15, msh16, answers",
    [
        # MSH-15, MSH-16 -> the answer to AA, AE, AR (None: nothing is sent)
        ("", "", ("AA", "AE", "AR")),
        ("AL", "", ("CA", "CE", "CR")),
        ("", "NE", ("CA", "CE", "CR")),  # enhanced by MSH-16 alone; empty MSH-15 means always
        ("NE", "AL", (None, None, None)),
        ("ER", "", (None, "CE", "CR")),
        ("SU", "", ("CA", None, None)),
    ],
)
def test_accept_code_follows_msh_15_in_enhanced_mode(msh15: str, msh16: str, answers: tuple) -> None:
    msh = f"MSH|^~\\&|A|B|C|D|20240101||ADT^A01|X1|P|2.5|||{msh15}|{msh16}\rPID|1\r".encode()
    header = parse_header(msh)
    got = tuple(accept_code(header, code) for code in (AckCode.AA, AckCode.AE, AckCode.AR))
    assert got == answers
