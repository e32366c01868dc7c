"""What of a refused header still counts (issue 27, F7): MSH-15 is read whenever the separators
are, so a stray byte in MSH-3 does not hand an NE sender an AR it never asked for; an oversize
frame cut before MSH-10 says so rather than "MSH-10 is empty". A real listenerd, real sockets, the
ACKs read by python-hl7, the staged rows checked against them."""

from __future__ import annotations

import pytest

from listeners.hl7msg import HL7HeaderError, parse_header
from tests.listeners.conftest import leading_node
from tests.listeners.hl7_traffic import adt
from tests.listeners.test_ack_codes import answer, exchange, mllp, staged_ids, with_msh

E102 = "102^Data type error^HL70357"


@pytest.fixture
def daemon(tmp_path, store_config):
    d = leading_node(tmp_path, store_config, idle_timeout_seconds=30, max_message_bytes=1000)
    yield d
    d.stop()


def stray_byte_in_msh3(control_id: str, accept: str) -> bytes:
    return with_msh(adt(control_id), MSH15=accept).encode().replace(b"|SENDAPP|", b"|SEND\xffAPP|", 1)


def test_a_stray_byte_in_msh_3_leaves_msh_15_and_msh_10_read(daemon, store_config):
    frames = [
        mllp(stray_byte_in_msh3("B1", "NE")),  # refused, and NE: nothing
        mllp(stray_byte_in_msh3("B2", "AL")),  # refused, AL: a CR naming it
        mllp(with_msh(adt("OK1"), MSH15="AL")),
    ]
    acks = exchange(daemon.mllp_port, frames, expect=2)
    assert [answer(a) for a in acks] == [("CR", "B2", "", E102, "E"), ("CA", "OK1")]
    assert staged_ids(store_config) == ["OK1"]
    code, body = daemon.get("/metrics")
    assert code == 200
    assert b'stageline_acks_withheld_total{code="CR",connection="adt-in"} 1.0' in body


def test_an_oversize_frame_cut_before_msh_10_says_so(daemon, store_config):
    big = with_msh(adt("O1"), MSH15="NE").replace("SENDAPP", "S" * 1200, 1)
    acks = exchange(daemon.mllp_port, [mllp(big), mllp(adt("OK2"))], expect=2)
    # MSH-15 lies beyond the first max_message_bytes too: original mode, an AR (docs/listenerd.md)
    assert answer(acks[0])[:2] == ("AR", "")
    reason = str(acks[0].segment("MSA")[3])
    assert "MSH-10 lies beyond the first" in reason and "MSH-10 is empty" not in reason
    assert answer(acks[1]) == ("AA", "OK2")
    assert staged_ids(store_config) == ["OK2"]


def test_a_double_byte_charset_keeps_only_the_fields_before_its_first_non_ascii_one():
    """Big5's trail bytes may equal "|": after one, the byte split is no field split, so MSH-15 is
    not trusted there (the refusal is answered in original mode)."""
    raw = b"MSH|^~\\&|S\xa4|F|R|RF|20260101||ADT^A01|Q1|P|2.5||||NE||BIG-5\rPID|1\r"
    raw = raw.replace(b"S\xa4", b"S\xa4\xff")  # an undecodable Big5 sequence
    with pytest.raises(HL7HeaderError) as caught:
        parse_header(raw)
    assert caught.value.header is not None
    assert caught.value.header.ack_types is None


def test_a_huge_header_field_is_echoed_at_most_227_characters(daemon, store_config):
    """HD is 227 characters in v2.5.1: a sender's 900-character MSH-3 (with an escape sequence
    where the cut falls) comes back cut at 227, never inside the escape sequence."""
    long_app = "A" * 225 + "\\F\\" + "B" * 600
    (ack,) = exchange(daemon.mllp_port, [mllp(adt("H1").replace("SENDAPP", long_app, 1))], expect=1)
    assert answer(ack) == ("AA", "H1")
    echoed = str(ack.segment("MSH")[5])  # our MSH-5: the sender's MSH-3
    assert echoed == "A" * 225
    assert staged_ids(store_config) == ["H1"]


def test_an_lf_in_msh_10_ends_the_segment_for_the_ack_the_store_and_the_stages_alike(daemon, store_config):
    """HL7 ends a segment with CR only; listenerd, like the stages, also takes a lone LF (and CRLF)
    for one. So "AB<LF>CD" in MSH-10 ends MSH after "AB": MSA-2 says AB, the staged control id is AB,
    and the stages read MSH-10 as AB from the payload staged as sent."""
    from include.hl7path import value

    acks = exchange(daemon.mllp_port, [mllp(adt("AB\nCD")), mllp(adt("EF\r\nGH"))], expect=2)
    assert [answer(a) for a in acks] == [("AA", "AB"), ("AA", "EF")]
    assert staged_ids(store_config) == ["AB", "EF"]
    payloads = staged_ids(store_config, "payload")
    assert [value(p, "MSH-10") for p in payloads] == ["AB", "EF"]
    assert "AB\nCD|P|2.5.1" in payloads[0]  # staged byte for byte
