"""Reading profile files: a usable one loads; every problem of a bad one is named with its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from include.profiles.load import ProfileError, read_profile, read_profiles

GOOD = """
message_types = ["ADT^A01"]
structure = "MSH EVN PID [PV1]"
tables = ["t.toml"]
[segments.PID]
8 = { type = "IS", table = "0001" }
3 = { type = "CX", usage = "R", repeat = true, required_components = [1] }
[segments.PV1]
2 = { lookup = "patient_class" }
"""


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    (tmp_path / "t.toml").write_text('[tables."0001"]\nvalues = ["F", "M"]\n')
    (tmp_path / "lookups").mkdir(exist_ok=True)
    (tmp_path / "lookups" / "patient_class.csv").write_text("code,value\nI,IN\nO,OUT\n")
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_profile_reads_into_its_rules(tmp_path):
    profile = read_profile(write(tmp_path, GOOD), lookups=tmp_path / "lookups")
    assert profile.message_types == {"ADT^A01"}
    assert [r.field for r in profile.rules["PID"]] == [3, 8]
    assert profile.rules["PID"][1].values == {"F", "M"}
    assert profile.rules["PV1"][0].values == {"I", "O"}
    assert profile.rules["PV1"][0].value_set == "lookup table patient_class"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (GOOD.replace('"CX"', '"QQ"'), "segments.PID.3.type: unknown data type 'QQ'"),
        (GOOD.replace('"0001"', '"0002"'), "segments.PID.8.table: '0002' is in none of the profile's table files"),
        (GOOD.replace('"MSH EVN', '"MSH [EVN'), "structure: '[' without its ']'"),
        (GOOD.replace('"MSH EVN', '"EVN MSH'), "structure: a message structure starts with MSH"),
        (GOOD.replace('["ADT^A01"]', '"ADT^A01"'), "message_types: must be a non-empty list"),
        (GOOD.replace("[segments.PV1]", "[segments.OBX]"), "segments.OBX: not in the structure"),
        (GOOD.replace('usage = "R"', 'usage = "M"'), "segments.PID.3.usage: must be R"),
        (GOOD.replace("repeat = true", 'repeat = "yes"'), "segments.PID.3.repeat: must be true or false"),
        (GOOD.replace("[1]", "[0]"), "segments.PID.3.required_components"),
        (GOOD.replace('"patient_class"', '"../secrets"'), "segments.PV1.2.lookup: no lookup table '../secrets'"),
        (GOOD.replace('"patient_class"', '"nope"'), "segments.PV1.2.lookup: no lookup table 'nope'"),
        (GOOD.replace("8 = {", "0 = {"), "segments.PID.0: a field number from 1"),
        ("colour = 1\n" + GOOD, "colour: unknown key"),
        (GOOD.replace('type = "IS", table', 'type = "IS", lenght = 3, table'), "segments.PID.8.lenght: unknown key"),
        ("structure = ", "not valid TOML"),
    ],
)
def test_a_bad_profile_names_each_problem_and_its_key(tmp_path, text, problem):
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as caught:
        read_profile(path, lookups=tmp_path / "lookups")
    assert str(caught.value).startswith(f"{path}: ")
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_every_problem_at_once(tmp_path):
    text = "colour = 1\n" + GOOD.replace('"CX"', '"QQ"').replace('"0001"', '"0002"')
    with pytest.raises(ProfileError) as caught:
        read_profile(write(tmp_path, text), lookups=tmp_path / "lookups")
    assert len(caught.value.problems) == 3


def test_a_missing_file_and_a_directory_are_refused(tmp_path):
    with pytest.raises(ProfileError, match="no such file"):
        read_profile(tmp_path / "absent.toml")
    with pytest.raises(ProfileError):
        read_profile(tmp_path)


def test_two_profiles_for_one_message_type_are_refused(tmp_path):
    a = write(tmp_path, GOOD, "a.toml")
    b = write(tmp_path, GOOD, "b.toml")
    with pytest.raises(ProfileError, match=r"ADT\^A01 is also the subject of"):
        read_profiles([a, b], lookups=tmp_path / "lookups")
