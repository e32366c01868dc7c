"""The structure check's work stays bounded by design (issue 27, red team): a wide structure of
optional repeating segments and a long message departing at its end is answered at once, and a
structure built to be costly ends in one finding instead of going on."""

from __future__ import annotations

import itertools
import time

from include.profiles import structure
from include.profiles.structure import Departure, Matcher, parse_structure

IDS = ["Y" + a + b for a, b in itertools.product("ABCDEFGHIJKLMNOPQRSTUVWXY", repeat=2)][:190]
WIDE = "MSH " + " ".join(f"[{{{i}}}]" for i in IDS) + " PID"
PAIRS = list(itertools.product("ABCDEFGHIJKLMNOPQRSTUVWXY", repeat=2))
RED_TEAM = "MSH " + " ".join(f"[{{Y{a}{b}}}]" for a, b in PAIRS[:390]) + " PID"  # issue 27's e4_probe.py 390


def test_the_red_team_structure_is_refused_at_load_for_its_size():
    import pytest

    from include.profiles.structure import StructureError

    with pytest.raises(StructureError, match="too many ways through"):
        Matcher(parse_structure(RED_TEAM))


def test_red_team_wide_structure_departing_at_the_end_is_answered_at_once():
    matcher = Matcher(parse_structure(WIDE))
    same = ["MSH"] + [IDS[0]] * 997 + ["QQQ"]
    spread = ["MSH"] + [IDS[k * len(IDS) // 997] for k in range(997)] + ["QQQ"]
    for ids in (same, spread):
        t0 = time.perf_counter()
        assert matcher(ids) == Departure(998, None)
        assert time.perf_counter() - t0 < 0.25
    assert matcher(["MSH"] + [IDS[0]] * 997) == Departure(998, "PID")
    assert matcher(["MSH", IDS[5], IDS[7], "PID"]) is None


def test_a_missing_segment_is_named_only_when_putting_it_in_makes_the_message_fit():
    matcher = Matcher(parse_structure("MSH [{SFT}] EVN PID [PD1] PV1"))
    assert matcher(["MSH", "PID", "PV1"]) == Departure(1, "EVN")
    assert matcher(["MSH", "PID", "EVN", "PV1"]) == Departure(2, None)  # 100 at the EVN after PID
    assert matcher(["MSH", "EVN", "PID"]) == Departure(3, "PV1")
    assert matcher(["MSH", "EVN", "PID", "PV1", "PV1"]) == Departure(4, None)


def test_past_the_work_budget_the_check_ends_with_one_costly_finding(monkeypatch):
    monkeypatch.setattr(structure, "BUDGET_FLOOR", 100)
    monkeypatch.setattr(structure, "BUDGET_PER_SEGMENT", 1)
    # every OBX position is live at once: each new step is the structure's width in work
    many = Matcher(parse_structure("MSH " + " ".join("[{OBX}]" for _ in range(150)) + " PID"))
    found = many(["MSH"] + ["OBX"] * 50 + ["QQQ"])
    assert found is not None and found.costly and found.missing is None


def test_finding_texts_never_echo_a_value_the_sender_put_in_msh_9_or_a_segment_id():
    from include.app import ROOT
    from include.profiles.check import findings, findings_json
    from include.profiles.load import read_profiles

    shipped = read_profiles([ROOT / "config/profiles/adt_a01.toml"])
    phi = "DOE JANE SSN 123-45-6789 <script>" + "X" * 2000
    body = "EVN|A01|20240101120000\rPID|1||P1^^^HOSP^MR||DOE^JANE||19800101|F\rPV1|1|I\r"
    msg = "MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||" + phi + "^A01|C1|P|2.5.1\r" + body
    (found,) = findings(msg, shipped)
    assert found.code == "200" and "123-45" not in found.text and "an unsupported message type" in found.text
    assert "123-45" not in findings_json([found]) and len(findings_json([found])) < 400
    (typed,) = findings(msg.replace(phi + "^A01", "ADT^A03"), shipped)
    assert typed.text.startswith("message type ADT^A03 is not one of")
    bad_id = msg.replace(phi + "^A01", "ADT^A01") + "q1$|x\r"
    assert [f.text for f in findings(bad_id, shipped)] == ["a segment with an invalid id is not expected here"]


def test_a_profile_reads_no_table_or_rule_file_outside_its_own_directory(tmp_path):
    import pytest

    from include.profiles.load import ProfileError, read_profile

    secret = tmp_path / "secret.toml"
    secret.write_text('[tables.HL70001]\nvalues = ["F"]\n')
    home = tmp_path / "profiles"
    home.mkdir()
    (home / "link.toml").symlink_to(secret)
    (home / "mine.toml").write_text('[tables.HL70001]\nvalues = ["M"]\n')
    for name in (str(secret), "../secret.toml", "link.toml"):
        (home / "p.toml").write_text(f'message_types = ["ADT^A01"]\nstructure = "MSH PID"\ntables = ["{name}"]\n')
        with pytest.raises(ProfileError) as refused:
            read_profile(home / "p.toml")
        assert "must be a file in the profile's directory" in str(refused.value)
        assert "secret" not in str(refused.value)
    (home / "p.toml").write_text('message_types = ["ADT^A01"]\nstructure = "MSH PID"\ntables = ["mine.toml"]\n')
    assert read_profile(home / "p.toml").message_types
