"""Synthetic HL7 v2.5 traffic for the pipeline benchmark (no PHI; deterministic for a seed).

The mix looks like a hospital feed, so routes and transforms do realistic work rather than
hitting one code path: ADT^A01/A08 (EVN, PID, PV1, sometimes NK1 and Z segments), ORU^R01 (OBR
with 2-6 OBX and an occasional NTE) and ORM^O01 (PV1, ORC, OBR). PID-3 comes from a pool of
1,000 patients, so per-patient lanes repeat; a patient keeps its name, birth date and address
across messages. Some PID-3 and PID-13 carry repetitions, some PID-3 a subcomponent, and some
text carries escape sequences (``\\F\\ \\S\\ \\T\\ \\E\\``). Segments end with CR; MSH-10 is unique
per message within one call.

Built from pre-rendered pieces and one ``random.Random`` per call: 100k messages take about a
second, so generating the input never dominates a benchmark run.

    from bench.hl7_corpus import messages
    payloads = messages(100_000, seed=1)
"""

from __future__ import annotations

import random

__all__ = ["PATIENTS", "messages"]

PATIENTS = 1000
"""Distinct PID-3 identifiers: lanes keyed on the patient repeat ~n/1000 times."""

_LAST = (
    "SMITH",
    "JONES",
    "GARCIA",
    "NGUYEN",
    "MULLER",
    "ROSSI",
    "TANAKA",
    "OKAFOR",
    "DUBOIS",
    "KOWALSKI",
    "SILVA",
    "HANSEN",
    "BROWN",
    "LEE",
    "PATEL",
    "COHEN",
)
_FIRST = ("ADAM", "BEA", "CARLOS", "DANA", "ELIF", "FARID", "GRETA", "HUGO", "IRIS", "JONAS", "KEMAL", "LENA")
_STREETS = ("1 MAIN ST", "22 ELM RD", "300 OAK AVE", "4 HARBOR WAY", "57 MILL LN", "9 STATION SQ")
_CITIES = (
    ("GREENSBORO", "NC", "27401"),
    ("SPRINGFIELD", "IL", "62701"),
    ("SALEM", "OR", "97301"),
    ("DOVER", "DE", "19901"),
)
_APPS = (("ADT1", "GOOD HEALTH HOSPITAL"), ("PAS", "NORTH CAMPUS"), ("EPIC", "SOUTH CAMPUS"))
_WARDS = ("2000^2012^01", "3000^3104^02", "ICU^07^A", "ER^12^B")
_DOCTORS = ("004777^ATTEND^AARON^A", "005112^KILDARE^JAMES", "006001^GREY^MEREDITH^E")
_TESTS = (
    ("2093-3", "Cholesterol", "mg/dL", "<200"),
    ("2571-8", "Triglyceride", "mg/dL", "<150"),
    ("2085-9", "HDL", "mg/dL", ">40"),
    ("718-7", "Hemoglobin", "g/dL", "12-16"),
    ("2345-7", "Glucose", "mg/dL", "70-99"),
    ("6690-2", "WBC", "10*3/uL", "4.5-11"),
)
_PANELS = ("24331-1^Lipid panel^LN", "58410-2^CBC panel^LN", "24323-8^Metabolic panel^LN")
_ORDERS = ("71020^CHEST XRAY 2V^CPT", "70450^CT HEAD^CPT", "93000^ECG^CPT", "80061^LIPID PANEL^CPT")
# Free text, a few with escape sequences (field, component, subcomponent, escape, highlight).
_NOTES = (
    "fasting 12h",
    "see \\F\\ attached note",
    "ratio 3\\S\\1",
    "C:\\E\\lab\\E\\out",
    "R\\T\\D approved",
    "\\H\\critical\\N\\ called to ward",
    "repeat in 3 months",
)
_FLAGS = ("N", "N", "N", "H", "L")
_CLASSES = ("I", "O", "E", "O", "I")


def _patients(rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(PID-3, PID-5, PID-7 + PID-8, PID-11 + PID-13) per patient, rendered once."""
    out = []
    for n in range(PATIENTS):
        pid3 = f"P{n:06d}^^^HOSP^MR"
        if rng.random() < 0.2:  # a second identifier: a repetition, with a subcomponent
            pid3 += f"~{rng.randrange(10**8, 10**9)}^^^USSSA&2.16.840.1.113883.4.1&ISO^SS"
        name = f"{rng.choice(_LAST)}^{rng.choice(_FIRST)}^{rng.choice('ABCDEFGH')}"
        born = f"{rng.randrange(1930, 2020)}{rng.randrange(1, 13):02d}{rng.randrange(1, 29):02d}|{rng.choice('MFU')}"
        city, state, zip_code = rng.choice(_CITIES)
        phones = f"555{rng.randrange(10**6, 10**7)}"
        if rng.random() < 0.3:
            phones += f"~555{rng.randrange(10**6, 10**7)}"
        place = f"{rng.choice(_STREETS)}^^{city}^{state}^{zip_code}||{phones}"
        out.append((pid3, name, born, place))
    return out


def messages(n: int, *, seed: int = 0) -> list[str]:
    """``n`` HL7 v2.5 messages (str, CR segment endings); the same ``seed`` gives the same list."""
    rng = random.Random(seed)
    patients = _patients(rng)
    rand, choice, randrange = rng.random, rng.choice, rng.randrange
    out: list[str] = []
    for i in range(n):
        app, facility = choice(_APPS)
        stamp = f"2024{randrange(1, 13):02d}{randrange(1, 29):02d}{randrange(24):02d}{randrange(60):02d}00"
        pid3, name, born, place = patients[randrange(PATIENTS)]
        pid = f"PID|1||{pid3}||{name}||{born}|||{place}\r"
        control = f"S{seed}N{i:09d}"
        kind = rand()
        if kind < 0.5:  # ADT: A01 admit or A08 update
            event = "A01" if kind < 0.3 else "A08"
            parts = [
                f"MSH|^~\\&|{app}|{facility}|STAGELINE|HOSP|{stamp}||ADT^{event}^ADT_A01|{control}|P|2.5\r",
                f"EVN|{event}|{stamp}\r",
                pid,
            ]
            if rand() < 0.3:
                parts.append(f"NK1|1|{choice(_LAST)}^{choice(_FIRST)}|SPO^Spouse^HL70063\r")
            parts.append(f"PV1|1|{choice(_CLASSES)}|{choice(_WARDS)}||||{choice(_DOCTORS)}\r")
            if rand() < 0.4:
                parts.append(f"ZPI|1|loyalty^{choice(('GOLD', 'SILVER', 'NONE'))}\r")
            if rand() < 0.2:
                parts.append(f"ZPD|{choice(('consent', 'no-contact'))}|{stamp}\r")
        elif kind < 0.85:  # ORU^R01 lab result
            parts = [
                f"MSH|^~\\&|LAB|LABFAC|STAGELINE|HOSP|{stamp}||ORU^R01^ORU_R01|{control}|P|2.5\r",
                pid,
                f"OBR|1|ORD{i}|FIL{i}|{choice(_PANELS)}|||{stamp}\r",
            ]
            for k in range(1, 2 + randrange(2, 6)):
                code, label, unit, ref = choice(_TESTS)
                parts.append(f"OBX|{k}|NM|{code}^{label}^LN||{randrange(1, 400)}|{unit}|{ref}|{choice(_FLAGS)}|||F\r")
            if rand() < 0.3:
                parts.append(f"NTE|1||{choice(_NOTES)}\r")
            if rand() < 0.1:
                parts.append(f"ZLB|{choice(('RUN7', 'RUN8'))}|{choice(_NOTES)}\r")
        else:  # ORM^O01 order
            parts = [
                f"MSH|^~\\&|CPOE|{facility}|STAGELINE|HOSP|{stamp}||ORM^O01^ORM_O01|{control}|P|2.5\r",
                pid,
                f"PV1|1|{choice(_CLASSES)}|{choice(_WARDS)}\r",
                f"ORC|NW|ORD{i}|||SC||^^^{stamp}^^R\r",
                f"OBR|1|ORD{i}||{choice(_ORDERS)}|||{stamp}\r",
            ]
            if rand() < 0.2:
                parts.append(f"NTE|1||{choice(_NOTES)}\r")
        out.append("".join(parts))
    return out
