"""The shipped profiles against the project's corpus (all accepted) and crafted bad messages (each
finding as hand-checked: code, ERL, and what the text names), plus each rule type alone."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.hl7_corpus import messages
from include.app.demo import TEMPLATES
from include.profiles.check import MAX_FINDINGS, findings, findings_json, survey
from include.profiles.load import read_profiles

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [ROOT / "config" / "profiles" / f"{n}.toml" for n in ("adt_a01", "oru_r01", "orm_o01")]


SHIPPED_PROFILES = read_profiles(SHIPPED)


@pytest.fixture(scope="module")
def shipped():
    return SHIPPED_PROFILES


def test_every_corpus_message_fits_its_shipped_profile(shipped):
    corpus = messages(5000, seed=11)
    kinds = {m.split("|")[8].rsplit("^", 1)[0] for m in corpus}
    assert kinds == {"ADT^A01", "ADT^A08", "ORU^R01", "ORM^O01"}
    assert [m for m in corpus if findings(m, shipped)] == []


def test_the_demo_messages_fit_theirs(shipped):
    for template in TEMPLATES.values():
        message = template.format(ts="20240101120000", cid="C1", pid="P1", n=1, value=5)
        assert findings(message, shipped) == []


A01 = "MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||ADT^A01^ADT_A01|C1|P|2.5.1\rEVN|A01|20240101120000\r"
PID = "PID|1||P1^^^HOSP^MR||DOE^JANE||19800101|F\r"
PV1 = "PV1|1|I|WARD^1^A\r"
ORU = "MSH|^~\\&|LAB|HOSP|SL|SL|20240101120000||ORU^R01|C2|P|2.5.1\r"
OBR = "OBR|1|O1||2345-7^Glucose^LN\r"
ORM = "MSH|^~\\&|C|H|S|S|20240101||ORM^O01|C3|P|2.5.1\r"
OBX = "OBX|1|NM|2345-7^Glucose^LN||95|mg/dL|70-99|N|||F\r"

# (name, message, [(code, ERL, words the text must hold)]) — worked out by hand from the profiles.
CRAFTED = [
    ("no PID", A01 + PV1, [("101", "PID^1", "required segment PID missing after EVN")]),
    ("no PV1", A01 + PID, [("101", "PV1^1", "required segment PV1 missing after PID")]),
    (
        "EVN after PID",
        A01.split("\r")[0] + "\r" + PID + "EVN|A01|20240101\r" + PV1,
        [("100", "EVN^1", "EVN is not expected")],
    ),
    ("PV1 twice", A01 + PID + PV1 + PV1, [("100", "PV1^2", "PV1 is not expected")]),
    ("unknown segment", A01 + PID + PV1 + "QRD|x\r", [("100", "QRD^1", "QRD is not expected")]),
    ("Z segment is fine", A01 + PID + PV1 + "ZPI|1\r", []),
    ("text-only CE (v2.5.1 CE has no required component)", A01 + PID + PV1 + "AL1|1|DA|^PENICILLIN|SV|RASH\r", []),
    ("text-only OBX-3", ORU + PID + OBR.replace("2345-7^Glucose^LN", "^Glucose") + OBX.replace("2345-7^", "^"), []),
    (
        "empty PID-3",
        A01 + "PID|1||||DOE^JANE\r" + PV1,
        [("101", "PID^1^3", "(Patient Identifier List) is required")],
    ),
    ("PID-3.1 empty", A01 + "PID|1||^^^HOSP^MR||DOE\r" + PV1, [("101", "PID^1^3^1^1", "component 1 is required")]),
    ('PID-5 ""', A01 + 'PID|1||P1||""\r' + PV1, [("101", "PID^1^5", "PID-5 (Patient Name) is required")]),
    ("DOB not a date", A01 + "PID|1||P1||DOE||1980-01-01\r" + PV1, [("102", "PID^1^7^1^1", "not a date/time")]),
    ("DOB month 13", A01 + "PID|1||P1||DOE||19801301\r" + PV1, [("102", "PID^1^7^1^1", "month out of range")]),
    ("DOB Feb 30", A01 + "PID|1||P1||DOE||19800230\r" + PV1, [("102", "PID^1^7^1^1", "day out of range")]),
    ("sex outside 0001", A01 + "PID|1||P1||DOE|||X\r" + PV1, [("103", "PID^1^8", "not in HL7 table 0001")]),
    ("class outside 0004", A01 + PID + "PV1|1|Q\r", [("103", "PV1^1^2", "not in HL7 table 0004")]),
    ("no patient class", A01 + PID + "PV1|1\r", [("101", "PV1^1^2", "PV1-2 (Patient Class) is required")]),
    ("sex repeats", A01 + "PID|1||P1||DOE|||F~M\r" + PV1, [("102", "PID^1^8^2", "does not repeat")]),
    (
        "SSN too long",
        A01 + "PID|1||P1||DOE" + "|" * 14 + "9" * 17 + "\r" + PV1,
        [("102", "PID^1^19", "than 16")],
    ),
    ("bad set id", A01 + "PID|one||P1||DOE\r" + PV1, [("102", "PID^1^1", "not a sequence number")]),
    ("no MSH-7", A01.replace("20240101120000||ADT", "||ADT") + PID + PV1, [("101", "MSH^1^7", "MSH-7")]),
    ("processing id", A01.replace("|P|2.5.1", "|Q|2.5.1") + PID + PV1, [("103", "MSH^1^11^1^1", "HL7 table 0103")]),
    (
        "MSH-9.2 empty",
        A01.replace("ADT^A01^ADT_A01", "ADT^A01").replace("ADT^A01", "ADT^"),
        [("200", "MSH^1^9", "ADT^")],
    ),
    ("unsupported type", A01.replace("ADT^A01", "ADT^A03"), [("200", "MSH^1^9", "ADT^A03 is not one of")]),
    ("OBX value type", ORU + PID + OBR + OBX.replace("|NM|", "|ZZ|"), [("103", "OBX^1^2", "HL7 table 0125")]),
    ("no OBX-11", ORU + PID + OBR + OBX.replace("|||F\r", "|||\r"), [("101", "OBX^1^11", "OBX-11")]),
    ("OBX before OBR", ORU + PID + OBX + OBR, [("101", "OBR^1", "required segment OBR missing after PID")]),
    ("PV2 after OBX", ORU + PID + OBR + OBX + "PV2|1\r", [("100", "PV2^1", "PV2 is not expected")]),
    ("ends too soon", A01.split("\r")[0] + "\r", [("101", "EVN^1", "required segment EVN missing after MSH")]),
    ("ORU ends after PID", ORU + PID, [("101", "OBR^1", "required segment OBR missing after PID")]),
    (  # the missing OBR is the second one: OBR^1 is there, and valid
        "second OBR missing",
        ORU + PID + OBR + "SPM|1\r" + OBX + "NTE|1\r",
        [("101", "OBR^2", "required segment OBR missing after OBX")],
    ),
    (
        "segment id 5,000 characters long",
        A01 + PID + PV1 + "Q" * 5000 + "|x\r",
        [("100", "QQQ^1", "a segment with an invalid id (5000 characters, not 3) is not expected")],
    ),
    (  # a four-character id is not PID: not checked as one, out of place as what it is
        "PIDX is not PID",
        A01 + "PIDX|1||||DOE\r" + PID + PV1,
        [("100", "PID^1", "a segment with an invalid id (4 characters, not 3)")],
    ),
    ("second OBX bad flag", ORU + PID + OBR + OBX + OBX.replace("|N|", "|NOPE|"), [("103", "OBX^2^8", "table 0078")]),
    (
        "ORM without ORC",
        ORM + PID + OBR,
        [("101", "ORC^1", "ORC missing")],
    ),
    ("ORC-1 unknown", ORM + "ORC|XY\r", [("103", "ORC^1^1", "table 0119")]),
]


@pytest.mark.parametrize(("name", "message", "expected"), CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_messages_get_their_hand_checked_findings(shipped, name, message, expected):
    got = findings(message, shipped)
    assert [(f.code, f.where()) for f in got] == [(code, where) for code, where, _ in expected]
    for f, (_, _, words) in zip(got, expected, strict=True):
        assert words in f.text


def test_texts_never_quote_the_value(shipped):
    got = findings(A01 + "PID|1||P1||DOE||SECRETDOB|SECRETSEX\r" + PV1, shipped)
    assert {f.code for f in got} == {"102", "103"}
    assert all("SECRET" not in f.text for f in got)


def test_findings_are_capped_and_all_counted(shipped):
    bad_obx = OBX.replace("|NM|", "|ZZ|").replace("|F\r", "|Q\r")
    got = findings(ORU + PID + OBR + bad_obx * 50, shipped)
    assert len(got) == MAX_FINDINGS
    listed = survey(ORU + PID + OBR + bad_obx * 50, shipped)
    assert (listed, listed.total, listed.codes) == (got, 100, {"103"})  # OBX-2 and OBX-11 outside their tables
    listed = survey(ORU + PID + OBR + OBX + "PV2|1\r" + OBX.replace("|N|", "|NOPE|") * 5000, shipped)
    assert (len(listed), listed.total, listed.codes) == (MAX_FINDINGS, 5001, {"100", "103"})
    clean = survey(A01 + PID + PV1, shipped)
    assert (clean, clean.total) == ([], 0)


def test_the_stored_findings_carry_the_total_and_codes_past_the_cap(shipped):
    """20 findings are stored; the first carries how many there were and all their codes (a 102
    past the cap still routes on `finding = "102"`); 20 or fewer are stored as before."""
    bad_obx = OBX.replace("|N|", "|NOPE|")
    stored = json.loads(findings_json(survey(ORU + PID + OBR + bad_obx * 30 + OBX.replace("|F\r", "|F~F\r"), shipped)))
    assert len(stored) == MAX_FINDINGS
    assert stored[0] == {
        "code": "103",
        "where": "OBX^1^8",
        "text": "OBX-8 (Abnormal Flags) is not in HL7 table 0078",
        "total": 31,
        "codes": ["102", "103"],
    }
    assert all(set(f) == {"code", "where", "text"} for f in stored[1:])
    assert "total" not in findings_json(survey(ORU + PID + OBR + bad_obx * 20, shipped))


def test_findings_json_is_what_the_store_keeps(shipped):
    got = findings(A01 + PID + "PV1|1|Q\r", shipped)
    assert findings_json(got) == (
        '[{"code":"103","where":"PV1^1^2","text":"PV1-2 (Patient Class) is not in HL7 table 0004"}]'
    )


def test_other_separators_are_read_from_the_message(shipped):
    message = A01.replace("|", "#").replace("^", "!") + "PID#1##P1!!!H!MR##DOE###X\r" + PV1.replace("|", "#")
    assert [(f.code, f.where()) for f in findings(message, shipped)] == [("103", "PID^1^8")]


def test_a_message_without_msh(shipped):
    assert [f.code for f in findings("PID|1||P1", shipped)] == ["100"]


def mutations(seed: int, n: int) -> list[str]:
    """Corpus messages with one to three characters replaced by ones that matter to the rules
    (digits, letters, separators, quotes), or a field emptied: mostly near misses."""
    rng = random.Random(seed)
    alphabet = '0123456789ABCFHILMNOPQXZ|^~&"+-.'
    out = []
    for message in messages(n, seed=seed):
        chars = list(message)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(9, len(chars))
            if chars[at] != "\r":
                chars[at] = rng.choice(alphabet) if rng.random() < 0.8 else ""
        out.append("".join(chars))
    return out


def test_the_fast_patterns_never_change_the_answer(shipped):
    """A segment the fast pattern accepts skips the rule loop; over 4,000 mutated messages (about
    half of them with findings) the answer is the same with and without that shortcut."""
    differing, with_findings = [], 0
    for message in mutations(7, 4000) + [m.replace("20", "0229", 1) for m in messages(200, seed=8)]:
        quick, slow = findings(message, SHIPPED_PROFILES), findings(message, SHIPPED_PROFILES, quick=False)
        with_findings += bool(slow)
        if quick != slow:
            differing.append((message, quick, slow))
    assert differing == []
    assert with_findings > 1000


def test_a_long_message_is_checked_in_linear_time_with_a_bounded_answer(shipped):
    """60,000 OBX: matched without the position sets growing per step; a departure late in it is a
    100 at the segment found there (no trial insertion per segment id beyond 1,000 segments)."""
    head = ORU + PID + OBR
    assert findings(head + OBX * 60000, shipped) == []
    late = findings(head + (OBX + "NTE|1||x\r") * 30000 + "PV2|1\r", shipped)
    assert [(f.code, f.where()) for f in late] == [("100", "PV2^1")]
