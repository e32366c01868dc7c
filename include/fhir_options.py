"""What a ``output = "fhir-r4"`` transform needs besides the message: systems, vocabularies, a zone.

HL7 v2 names an identifier's assigning authority (``CX-4``) and a code's coding system (``CWE-3``)
with short local names; FHIR wants URIs. Which URI a name stands for is the site's knowledge, so it
is configuration (``[transform.fhir]``, docs/rules.md); the defaults below cover the code systems
HL7's *V2 to FHIR* IG names and the v2 tables the mapping reads (administrative sex, patient class).
A name without a URI is left out rather than guessed: an identifier without a system is kept but
never used for a conditional create, a coding without a system keeps its code and display.

Plain Python, no Spark: the transform schema (`include.schema.transforms`) validates the table and
`spark_jobs.hl7_fhir` compiles the maps into literals.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CODE_SYSTEMS",
    "FHIR_CONTENT_TYPE",
    "GENDER",
    "PATIENT_CLASS",
    "FhirOptions",
    "check_code",
    "check_offset",
    "check_uri",
]

FHIR_CONTENT_TYPE = "application/fhir+json"

# HL7 table 0396 names → FHIR code system URIs (the IG's CodeSystem ConceptMap, the common part).
CODE_SYSTEMS: Mapping[str, str] = {
    "LN": "http://loinc.org",
    "LOINC": "http://loinc.org",
    "SCT": "http://snomed.info/sct",
    "SNM": "http://snomed.info/sct",
    "SNOMEDCT": "http://snomed.info/sct",
    "UCUM": "http://unitsofmeasure.org",
    "I10": "http://hl7.org/fhir/sid/icd-10",
    "I10C": "http://hl7.org/fhir/sid/icd-10-cm",
    "I9C": "http://hl7.org/fhir/sid/icd-9-cm",
    "CPT": "http://www.ama-assn.org/go/cpt",
    "C4": "http://www.ama-assn.org/go/cpt",
    "RXNORM": "http://www.nlm.nih.gov/research/umls/rxnorm",
    "NDC": "http://hl7.org/fhir/sid/ndc",
    "CVX": "http://hl7.org/fhir/sid/cvx",
    "HL70063": "http://terminology.hl7.org/CodeSystem/v2-0063",
    "HL70078": "http://terminology.hl7.org/CodeSystem/v2-0078",
    "HL70203": "http://terminology.hl7.org/CodeSystem/v2-0203",
}

# HL7 table 0001 (administrative sex) → FHIR AdministrativeGender.
GENDER: Mapping[str, str] = {"F": "female", "M": "male", "O": "other", "U": "unknown", "A": "other", "N": "unknown"}

# HL7 table 0004 (patient class) → v3 ActCode, for Encounter.class.
PATIENT_CLASS: Mapping[str, str] = {
    "E": "EMER",
    "I": "IMP",
    "O": "AMB",
    "P": "PRENC",
    "R": "AMB",
    "B": "AMB",
    "C": "AMB",
    "N": "AMB",
}

_OFFSET = re.compile(r"Z|[+-]((0\d|1[0-3]):[0-5]\d|14:00)")  # FHIR's offsets reach 14:00
_CODE = re.compile(r"[^\s]+( [^\s]+)*")  # FHIR's code grammar
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:\S+")


def check_offset(value: str) -> str:
    """``Z`` or ``+HH:MM``/``-HH:MM``: what FHIR appends to a time that came without an offset."""
    if not _OFFSET.fullmatch(value):
        raise ValueError(f"must be 'Z' or an offset such as '+01:00', got {value!r}")
    return value


def check_code(value: str) -> str:
    """A FHIR ``code``: no whitespace around it, single spaces inside (``IMP``, not `` IMP``)."""
    if not _CODE.fullmatch(value):
        raise ValueError(f"must be a code: no leading, trailing or repeated whitespace, got {value!r}")
    return value


def check_uri(value: str) -> str:
    """An absolute URI without spaces (``http://loinc.org``, ``urn:oid:1.2.3``)."""
    if not _URI.fullmatch(value):
        raise ValueError(f"must be an absolute URI such as 'urn:oid:1.2.3' or 'http://...', got {value!r}")
    return value


@dataclass(frozen=True)
class FhirOptions:
    """A destination's FHIR mapping settings, defaults merged in (``[transform.fhir]``)."""

    identifier_systems: Mapping[str, str] = field(default_factory=dict)
    code_systems: Mapping[str, str] = field(default_factory=lambda: dict(CODE_SYSTEMS))
    gender: Mapping[str, str] = field(default_factory=lambda: dict(GENDER))
    patient_class: Mapping[str, str] = field(default_factory=lambda: dict(PATIENT_CLASS))
    timezone: str = "Z"

    @classmethod
    def of(cls, given: Mapping[str, Any] | None) -> FhirOptions:
        """Options from the validated table: its maps extend (and override) the defaults."""
        given = given or {}
        return cls(
            identifier_systems=dict(given.get("identifier_systems") or {}),
            code_systems={**CODE_SYSTEMS, **(given.get("code_systems") or {})},
            gender={**GENDER, **(given.get("gender") or {})},
            patient_class={**PATIENT_CLASS, **(given.get("patient_class") or {})},
            timezone=given.get("timezone") or "Z",
        )

    def __hash__(self) -> int:  # maps are not hashable; the repr is stable and complete
        return hash(repr(self))
