"""Negative ACKs say what and where (HL7 table 0357 in ERR-3, the place in ERR-2, severity in
ERR-4), and MSH-15 picks the answer in enhanced mode: a real listenerd, real sockets, the ACKs read
by python-hl7, and the staged rows checked against them."""

from __future__ import annotations

import socket
import time

import hl7
import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.supervisor import port_open
from include.config import StoreConfig
from include.store import Store
from listeners.hl7errors import Location, location_at
from tests.conftest import migrated_sqlite
from tests.listeners.conftest import leading_node
from tests.listeners.hl7_traffic import adt, post_message

VT, FS, CR = b"\x0b", b"\x1c", b"\r"


def mllp(text: str | bytes) -> bytes:
    return VT + (text.encode() if isinstance(text, str) else text) + FS + CR


def with_msh(message: str, **fields: str) -> str:
    """`message` with MSH-n set for each ``MSH<n>="value"``."""
    head, _, rest = message.partition("\r")
    msh = head.split("|")
    for key, value in fields.items():
        n = int(key[3:])
        msh += [""] * (n - len(msh))
        msh[n - 1] = value
    return "|".join(msh) + "\r" + rest


def exchange(port: int, frames: list[bytes], *, expect: int, timeout: float = 15) -> list[hl7.Message]:
    """Send `frames` on one connection and read `expect` ACKs, parsed by python-hl7."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"".join(frames))
        buf, acks = b"", []
        deadline = time.monotonic() + timeout
        while len(acks) < expect and time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            while FS + CR in buf:
                one, buf = buf.split(FS + CR, 1)
                acks.append(hl7.parse(one.lstrip(VT).decode("latin-1").strip("\r")))
    assert len(acks) == expect, f"{len(acks)} ACKs, expected {expect}"
    return acks


def answer(ack: hl7.Message) -> tuple[str, ...]:
    """(MSA-1, MSA-2) and, for a negative ACK, (ERR-2, ERR-3, ERR-4)."""
    msa = ack.segment("MSA")
    out: tuple[str, ...] = (str(msa[1]), str(msa[2]))
    try:
        err = ack.segment("ERR")
    except KeyError:
        return out
    return (*out, str(err[2]), str(err[3]), str(err[4]))


def staged_ids(store_config: StoreConfig, column: str = "control_id") -> list[str]:
    """`column` (the control id, or e.g. the payload) of every staged inbound message, in order."""
    store = Store(store_config)
    try:
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(f"SELECT {column} FROM inbound_messages ORDER BY id")
            return [r[column] for r in cur.fetchall()]
    finally:
        store.close()


@pytest.fixture
def daemon(tmp_path, store_config):
    d = leading_node(tmp_path, store_config, idle_timeout_seconds=30)
    yield d
    d.stop()


def err(code: str, text: str) -> str:
    return f"{code}^{text}^HL70357"


E100 = err("100", "Segment sequence error")
E101 = err("101", "Required field missing")
E102 = err("102", "Data type error")
E103 = err("103", "Table value not found")

REFUSALS = [
    # (what, bytes, expected answer)
    ("empty MSH-10", mllp(adt("")), ("AR", "", "MSH^1^10", E101, "E")),
    ("MSH-18 not in table 0211", mllp(adt("C1", charset="KLINGON")), ("AR", "C1", "MSH^1^18", E103, "E")),
    ("MSH-2 repeats a separator", mllp(adt("E1").replace("^~\\&", "^^\\&", 1)), ("AR", "E1", "MSH^1^2", E102, "E")),
    ("no MSH at all", mllp("PID|1||X\r"), ("AR", "", "MSH^1", E100, "E")),
    ("a NUL in PID-5", mllp(adt("N1", name="DO\x00E^JANE")), ("AR", "N1", "PID^1^5", E102, "E")),
    ("a NUL in PID-5.2", mllp(adt("N2", name="DOE^JA\x00NE")), ("AR", "N2", "PID^1^5^1^2", E102, "E")),
    ("MSH-15 not in table 0155", mllp(with_msh(adt("M1"), MSH15="XX")), ("CR", "M1", "MSH^1^15", E103, "E")),
]


def test_every_refusal_names_its_table_0357_code_and_where(daemon, store_config):
    frames = [mllp(adt("OK1"))] + [wire for _, wire, _ in REFUSALS] + [mllp(adt("OK2"))]
    acks = exchange(daemon.mllp_port, frames, expect=len(frames))
    got = [answer(a) for a in acks]
    assert got == [("AA", "OK1"), *[expected for _, _, expected in REFUSALS], ("AA", "OK2")]
    # MSA-3 still carries the reason text, as before
    assert str(acks[1].segment("MSA")[3]).startswith("missing_control_id")
    assert staged_ids(store_config) == ["OK1", "OK2"]


def test_a_v2_3_refusal_puts_the_place_and_code_in_err_1(daemon, store_config):
    """Before v2.5, ERR has one field (ELD): segment^sequence^field^code&text&table (the text is
    the reason, as MSA-3's)."""
    (ack,) = exchange(daemon.mllp_port, [mllp(adt("OLD1", version="2.3", name="DO\x00E"))], expect=1)
    assert str(ack.segment("MSA")[1]) == "AR"
    assert str(ack.segment("ERR")[1]) == "PID^1^5^102&message contains NUL characters (character offset 129)&HL70357"
    assert staged_ids(store_config) == []


def test_a_batch_refusal_names_the_message_and_field_at_fault(daemon, store_config):
    """A batch member's fault is located at that member's MSH (the 2nd MSH of the batch); the
    batch is answered in original mode (its members' MSH-15 do not silence it)."""
    members = [adt("B1"), adt(""), adt("B3")]
    batch = "BHS|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|||||BATCH7\r" + "".join(members) + "BTS|3\r"
    bad_count = "BHS|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|||||BATCH8\r" + adt("B4") + "BTS|2\r"
    bad_ack_type = f"BHS|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|||||BATCH9\r{adt('B5')}{with_msh(adt('B6'), MSH15='XX')}"
    # a batch is answered in original mode whatever its messages' MSH-15 say (one answer per frame)
    quiet = f"BHS|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|||||BATCH10\r{with_msh(adt('B7'), MSH15='NE')}BTS|1\r"
    acks = exchange(daemon.mllp_port, [mllp(batch), mllp(bad_count), mllp(bad_ack_type), mllp(quiet)], expect=4)
    assert answer(acks[0]) == ("AR", "BATCH7", "MSH^2^10", E101, "E")
    assert answer(acks[1]) == ("AR", "BATCH8", "BTS^1^1", E100, "E")
    assert answer(acks[2]) == ("AR", "BATCH9", "MSH^2^15", E103, "E")
    assert answer(acks[3]) == ("AA", "BATCH10")
    assert staged_ids(store_config) == ["B7"]


def test_msh_15_chooses_which_commit_acks_are_sent_and_order_holds(daemon, store_config):
    """Enhanced mode answers CA/CE/CR as MSH-15 asks; a message answered with nothing (NE, ER on
    success, SU on refusal) still keeps its place, so the next ACK on the connection is the next
    message's. Every accepted message is staged whether or not it was answered."""
    bad = {"name": "DO\x00E"}  # refused: a NUL
    sent = [
        ("AL1", with_msh(adt("AL1"), MSH15="AL")),
        ("NE1", with_msh(adt("NE1"), MSH15="NE")),
        ("NE2", with_msh(adt("NE2", **bad), MSH15="NE")),
        ("ER1", with_msh(adt("ER1"), MSH15="ER")),
        ("ER2", with_msh(adt("ER2", **bad), MSH15="ER")),
        ("SU1", with_msh(adt("SU1"), MSH15="SU")),
        ("SU2", with_msh(adt("SU2", **bad), MSH15="SU")),
        ("AP1", with_msh(adt("AP1"), MSH16="AL")),  # MSH-16 alone: enhanced, MSH-15 empty means AL
        ("OR1", adt("OR1")),  # original mode
        ("OR2", adt("OR2", **bad)),
    ]
    acks = exchange(daemon.mllp_port, [mllp(text) for _, text in sent], expect=6)
    assert [answer(a)[:3] for a in acks] == [
        ("CA", "AL1"),
        ("CR", "ER2", "PID^1^5"),
        ("CA", "SU1"),
        ("CA", "AP1"),
        ("AA", "OR1"),
        ("AR", "OR2", "PID^1^5"),
    ]
    assert staged_ids(store_config) == ["AL1", "NE1", "ER1", "SU1", "AP1", "OR1"]
    code, body = daemon.get("/metrics")
    assert code == 200
    # what was not sent is counted by the code it would have had: NE1, ER1 (CA); NE2, SU2 (CR)
    assert b'stageline_acks_withheld_total{code="CA",connection="adt-in"} 2.0' in body
    assert b'stageline_acks_withheld_total{code="CR",connection="adt-in"} 2.0' in body
    assert b'stageline_acks_total{code="CA",connection="adt-in"} 3.0' in body
    assert b'code="none"' not in body


def test_a_header_refusal_follows_msh_15_like_any_refusal(daemon, store_config):
    """An empty or over-long MSH-10 or an unknown MSH-18 is refused in the sender's own mode (HL7
    v2.5.1 2.9.3): NE and SU senders get nothing, ER and AL senders a CR — so a pipelining sender
    reads the next ACK it asked for, not an AR it did not."""
    long_id = "L" * 200
    sent = [
        with_msh(adt(""), MSH15="NE"),
        with_msh(adt(""), MSH15="ER"),
        with_msh(adt(""), MSH15="SU"),
        with_msh(adt(long_id), MSH15="NE"),
        with_msh(adt(long_id), MSH15="AL"),
        with_msh(adt("C1", charset="KLINGON"), MSH15="NE"),
        with_msh(adt("C2", charset="KLINGON"), MSH15="ER"),
        with_msh(adt("OK1"), MSH15="AL"),
    ]
    acks = exchange(daemon.mllp_port, [mllp(text) for text in sent], expect=4)
    assert [answer(a) for a in acks] == [
        ("CR", "", "MSH^1^10", E101, "E"),
        ("CR", "", "MSH^1^10", E102, "E"),
        ("CR", "C2", "MSH^1^18", E103, "E"),
        ("CA", "OK1"),
    ]
    assert staged_ids(store_config) == ["OK1"]
    code, body = daemon.get("/metrics")
    assert code == 200
    assert b'stageline_acks_withheld_total{code="CR",connection="adt-in"} 4.0' in body
    assert b'stageline_acks_total{code="CR",connection="adt-in"} 3.0' in body


def test_a_header_refusal_is_addressed_back_in_the_senders_version_with_its_control_id_as_sent(daemon):
    """The refusal of an unknown MSH-18 is built from what of the header was read: sender and
    receiver swapped, the sender's version (2.3: ERR-1), MSA-2 its MSH-10 byte for byte (an escape
    sequence is not escaped again), ASCII and no MSH-18."""
    with socket.create_connection(("127.0.0.1", daemon.mllp_port), timeout=15) as s:
        s.sendall(mllp(adt("A\\F\\B", version="2.3", charset="KLINGON")))
        raw = b""
        while FS + CR not in raw:
            chunk = s.recv(65536)
            assert chunk, "connection closed before the ACK"
            raw += chunk
    segments = raw.strip(VT + FS + CR).split(CR)
    msh = segments[0].split(b"|")
    assert msh[2:6] == [b"STAGELINE", b"HOSP", b"SENDAPP", b"SENDFAC"]
    assert msh[8:9] == [b"ACK^A01^ACK"] and msh[11] == b"2.3" and len(msh) == 12
    assert segments[1] == b"MSA|AR|A\\F\\B|unknown_charset: MSH-18 'KLINGON' unsupported"
    assert segments[2] == b"ERR|MSH^1^18^103&unknown_charset: MSH-18 'KLINGON' unsupported&HL70357"


def test_a_bad_msh_2_refusal_is_still_addressed_back_in_the_senders_version(daemon):
    """MSH-2 unreadable: default separators, but sender and receiver swapped and MSH-12 kept."""
    (ack,) = exchange(daemon.mllp_port, [mllp(adt("E2", version="2.3").replace("^~\\&", "^^\\&", 1))], expect=1)
    msh = ack.segment("MSH")
    assert [str(msh[n]) for n in (3, 4, 5, 6, 12)] == ["STAGELINE", "HOSP", "SENDAPP", "SENDFAC", "2.3"]
    assert str(ack.segment("MSA")[1]) == "AR" and str(ack.segment("MSA")[2]) == "E2"
    assert str(ack.segment("ERR")[1]).startswith("MSH^1^2^102&")  # v2.3: ERR-1


def test_a_batch_refusal_in_a_body_segment_counts_that_segment_over_the_batch(daemon, store_config):
    """A NUL in the third message's PID-5 is at the batch's third PID: PID^3^5, not PID^1^5."""
    members = [adt("B1"), adt("B2"), adt("B3", name="DO\x00E")]
    batch = "BHS|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|||||BATCH11\r" + "".join(members) + "BTS|3\r"
    (ack,) = exchange(daemon.mllp_port, [mllp(batch)], expect=1)
    assert answer(ack) == ("AR", "BATCH11", "PID^3^5", E102, "E")
    assert staged_ids(store_config) == []


def test_an_ne_sender_on_one_connection_reads_the_right_ack_next(daemon, store_config):
    """Three NE messages then an AL one: the first bytes the sender reads are the AL one's CA."""
    frames = [mllp(with_msh(adt(f"Q{i}"), MSH15="NE")) for i in range(3)] + [mllp(with_msh(adt("Q3"), MSH15="AL"))]
    (ack,) = exchange(daemon.mllp_port, frames, expect=1)
    assert answer(ack) == ("CA", "Q3")
    assert staged_ids(store_config) == ["Q0", "Q1", "Q2", "Q3"]


def test_http_keeps_its_status_codes_and_names_the_same_hl7_error(tmp_path):
    """A body MLLP would refuse gets its 400 with the ERR's code and place; MSH-15 does not apply
    to HTTP (every POST is answered), but an MSH-15 outside table 0155 is refused there too."""
    cfg = migrated_sqlite(tmp_path / "store.db")
    port = free_port()
    inbound = [{"name": "web", "kind": "http", "host": "127.0.0.1", "port": port}]
    d = Daemon(tmp_path / "node", cfg, node_id="solo:1:aa", inbound=inbound).start()
    try:
        wait_for(lambda: port_open(port), timeout=15, what="bind")
        assert post_message(port, "web", adt("").encode()) == (
            400,
            {
                "error": "missing_control_id: MSH-10 is empty",
                "hl7_error": {"code": "101", "text": "Required field missing", "location": "MSH^1^10"},
            },
        )
        status, body = post_message(port, "web", with_msh(adt("H2"), MSH15="ALWAYS").encode())
        assert status == 400
        assert body["hl7_error"] == {"code": "103", "text": "Table value not found", "location": "MSH^1^15"}
        status, body = post_message(port, "web", with_msh(adt("H3"), MSH15="NE").encode())
        assert status == 202 and body["message_id"]
        assert staged_ids(cfg) == ["H3"]
    finally:
        assert d.stop() == 0


def test_a_location_names_the_segments_occurrence_field_repetition_and_component():
    text = "MSH|^~\\&|A|B|C|D|20240101||ADT^A01|X|P|2.5\rPID|1||a~b^c\x00||DO^JA\x00NE\rNTE|1\rNTE|2||x\x00\r"
    nuls = [i for i, ch in enumerate(text) if ch == "\x00"]
    assert [location_at(text, i).text() for i in nuls] == ["PID^1^3^2^2", "PID^1^5^1^2", "NTE^2^3"]
    assert location_at(text, 3) == Location("MSH", 1, 1)  # MSH-1 is the field separator itself
    assert location_at(text, 5) == Location("MSH", 1, 2)
    assert location_at(text, 14).text("&") == "MSH&1&5"
    assert location_at("not HL7\x00", 7) is None
