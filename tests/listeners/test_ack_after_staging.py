"""Once a message is staged its answer is positive, whatever its header holds: a version the ACK
builder cannot read (MSH-12 "2.5.1²", a 4300-digit piece) still gets an AA/CA naming its MSH-10,
the sender does not resend it, and the metrics count what went on the wire (issue 27, F4). A real
listenerd, real sockets, the ACKs read by python-hl7, the staged rows checked against them."""

from __future__ import annotations

import re
import socket

import pytest

from listeners.hl7ack import AckCode, build_ack
from listeners.hl7msg import parse_header
from tests.listeners.conftest import leading_node
from tests.listeners.hl7_traffic import adt
from tests.listeners.test_ack_codes import answer, exchange, mllp, staged_ids, with_msh

ODD_VERSIONS = ["2.5.1\u00b2", "2." + "9" * 4300, "\u0662.5"]  # a superscript two, 4300 digits, an Arabic-Indic two


@pytest.fixture
def daemon(tmp_path, store_config):
    d = leading_node(tmp_path, store_config, idle_timeout_seconds=30)
    yield d
    d.stop()


def test_a_staged_message_with_an_unreadable_version_is_answered_aa_once(daemon, store_config):
    sent = [(f"V{i}", adt(f"V{i}", version=v)) for i, v in enumerate(ODD_VERSIONS)]
    sent.append(("VE", with_msh(adt("VE", version=ODD_VERSIONS[0]), MSH15="AL")))
    acks = exchange(daemon.mllp_port, [mllp(text) for _, text in sent], expect=len(sent))
    assert [answer(a) for a in acks] == [("AA", "V0"), ("AA", "V1"), ("AA", "V2"), ("CA", "VE")]
    assert staged_ids(store_config) == ["V0", "V1", "V2", "VE"]
    code, body = daemon.get("/metrics")
    assert code == 200
    assert b'stageline_acks_total{code="AA",connection="adt-in"} 3.0' in body
    assert b'stageline_acks_total{code="CA",connection="adt-in"} 1.0' in body
    assert not re.search(rb'stageline_acks_total\{code="[AC][ER]",connection="adt-in"\} [1-9]', body)


def test_a_staged_batch_with_an_unreadable_version_is_answered_aa(daemon, store_config):
    member = adt("BM1", version=ODD_VERSIONS[0])
    batch = "BHS|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|||||BATCH27\r" + member + "BTS|1\r"
    (ack,) = exchange(daemon.mllp_port, [mllp(batch)], expect=1)
    assert answer(ack) == ("AA", "BATCH27")
    assert staged_ids(store_config) == ["BM1"]


def test_a_positive_ack_falls_back_to_a_minimal_one_when_the_builder_fails(monkeypatch):
    """Whatever trips the full builder, an AA stays an AA for the message's MSH-10, in its separators."""
    header = parse_header(b"MSH#^~\\&#A#B#C#D#20260101##ADT^A01#X^1#P#2.5\rPID#1\r")

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the builder")

    monkeypatch.setattr("listeners.hl7ack._shape", broken)
    ack = build_ack(header, AckCode.AA).decode()
    msh, msa = ack.rstrip("\r").split("\r")
    assert msh.split("#")[8:12][0] == "ACK"
    assert msa == "MSA#AA#X^1"
    with pytest.raises(RuntimeError):  # a negative answer is the caller's to replace (it stays negative)
        build_ack(header, AckCode.AE, reason="r")


def test_a_staged_batch_answered_message_by_message_keeps_its_aas(tmp_path, store_config):
    d = leading_node(tmp_path, store_config, idle_timeout_seconds=30, batch_ack="messages")
    try:
        members = [adt("BM1", version=ODD_VERSIONS[0]), adt("BM2")]
        batch = "BHS|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|||||BATCH28\r" + "".join(members) + "BTS|2\r"
        with socket.create_connection(("127.0.0.1", d.mllp_port), timeout=15) as s:
            s.sendall(mllp(batch))
            buf = b""
            while not buf.endswith(b"\x1c\r"):
                chunk = s.recv(65536)
                assert chunk, "closed before the ACK batch"
                buf += chunk
        segments = buf.strip(b"\x0b\x1c\r").decode().split("\r")
        answers = [s.split("|")[1:3] for s in segments if s.startswith("MSA")]
        assert answers == [["AA", "BM1"], ["AA", "BM2"]]
        assert segments[0].split("|")[11] == "BATCH28"  # BHS-12
        assert staged_ids(store_config) == ["BM1", "BM2"]
    finally:
        d.stop()
