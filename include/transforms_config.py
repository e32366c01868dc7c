"""Transform config: per-destination rewrite rules (`transforms.toml`, `[[transform]]`).

A transform spec per destination is plain data, as loaded from TOML/JSON config::

    {"destination": "ehr", "output": "hl7",            # "hl7" (default) or "json"
     "rules": [
        {"set": "MSH-5", "value": "EHR"},
        {"copy": "PID-3.1", "to": "PID-2"},
        {"clear": "PID-19"},
        {"map": "PV1-2", "table": "patient_class", "default": "keep"},
        {"set": "OBX-11", "value": "F", "each": true},
        {"drop_segment": "ZPI"},
        {"rename_segment": "ZPD", "to": "ZPX"},
     ]}

Rules run in order, each on the result of the previous one. Paths follow the grammar of
:mod:`include.hl7path` (``SEG[occurrence]-FIELD[repetition].COMPONENT.SUBCOMPONENT``), with
one difference for writes and reads done by rules: **a path without a repetition index is the
whole field, all repetitions** (``clear PID-3`` clears every identifier; ``copy PID-3`` copies
them all). ``PID-3[2]`` is one repetition; a component without a repetition index is in the first.

* ``set``   writes a constant. The constant is literal text: the escape character and any of the
  message's own separators in it are escaped (``A^B`` becomes ``A\\S\\B`` under ``^``), so a
  constant can never add structure. Missing trailing fields/repetitions/components/subcomponents
  are created; a missing *segment* is not (where it belongs is message-type knowledge), nor is an
  element that needs a separator the message does not declare (``PID-3.1.2`` when MSH-2 has no
  ``&``): such a rule leaves the message alone. Setting ``""`` is the same as ``clear``.
* ``copy``  ``{"copy": SRC, "to": DST}``: DST := the raw text of SRC (escape sequences kept). Text
  from a higher level is escaped where its separators would be structural at DST (copying
  ``PID-3`` with two repetitions into ``PID-2.1`` escapes the ``~`` and ``^``). MSH-1/MSH-2 as a
  source are literal text. A missing or empty SRC clears DST.
* ``clear`` empties an existing element; nothing is created, trailing separators are kept.
* ``map``   ``{"map": PATH, "table": T, "default": "keep" | "clear" | <string>}``: the raw value
  is looked up in lookup table ``T``; a hit is written like a ``set`` constant, a miss keeps the
  value (``keep``, the default), empties it (``clear``) or writes the given string. An absent or
  empty value is left alone: ``map`` translates codes, it does not invent them (use ``set``).
  Consequently a default of the literal text ``keep``/``clear`` cannot be expressed.
* ``drop_segment`` removes every occurrence of a segment (Z segments included);
  ``rename_segment`` renames every occurrence. MSH and the batch envelope cannot be dropped,
  renamed or renamed to.
* ``"each": true`` (set, clear, map, copy) applies a rule to every occurrence of its segment
  instead of the first (or ``[n]``-th): ``{"set": "OBX-11", "value": "F", "each": true}``. An
  ``each`` copy reads and writes within the same segment occurrence, so SRC and DST must name the
  same segment.

Lookup tables: ``map`` rules name tables of ``{table: {from: to}}`` that live in the store
(`stageline lookups`). :func:`parse_transforms` without ``lookups`` checks table names for shape
only (config load, before the store is reachable); with them (the transform run) every named
table must exist, be ``str -> str`` and hold at most :data:`MAX_LOOKUP_ENTRIES` entries (each
becomes a map literal in the Spark plan, see :mod:`spark_jobs.transform_rules`).

Since issue 13 (reference with examples: docs/rules.md):

* ``"when": <condition>`` on any rule: the rule applies only to messages the condition holds for
  (the grammar of :mod:`include.conditions`, the one routes use), tested on the message as the
  earlier rules left it.
* ``add_segment`` ``{"add_segment": "ZST|1|A^B", "after": "PID"}`` (or ``"before"``; default the
  end): the text is written with ``|^~\\&`` and translated to the message's own separators;
  ``after`` goes after the last occurrence, ``before`` before the first; a missing anchor adds nothing.
* string functions, each ``{OP: PATH, ..., "to": TARGET?, "each": bool?}`` reading the raw text
  at PATH and writing the result to TARGET (default PATH): ``upper``, ``lower`` (escape sequences
  kept), ``substring`` (``start`` 1-based, ``length``), ``pad`` (``length``, ``with`` one
  character, ``side`` left/right; never truncates), ``replace`` (``pattern`` a Java regex,
  ``with`` the replacement), ``format_date`` (``from``/``to``: ``"hl7"`` or a Spark datetime
  pattern; ``on_error`` keep/clear/dead_letter). A missing or empty source leaves TARGET alone.
* ``concat`` ``{"concat": ["PID-5.2", {"text": " "}, "PID-5.1"], "to": "ZNM-1"}``: fields (raw)
  and constants (literal text); an empty result clears TARGET.
* ``map`` gains ``not_found``: ``keep`` | ``default`` (needs ``default``, any string) | ``clear``
  | ``dead_letter``.
* ``set`` with ``generate``: ``"timestamp"`` (the transform's time, ``format`` default ``hl7``,
  e.g. for MSH-7) or ``"control_id"`` (a 20-character id per message and destination, stable
  across re-runs, optional ``prefix``; e.g. for MSH-10).
* ``dead_letter`` ``{"dead_letter": "reason", "when": ...}``: the message is not delivered to this
  destination; its routed row is dead with the reason.

``"output": "json"`` delivers ``application/json`` instead of HL7 (the format:
:mod:`spark_jobs.hl7_json`); ``"output": "fhir-r4"`` a FHIR R4 transaction Bundle
(``application/fhir+json``, :mod:`spark_jobs.hl7_fhir`), with its settings in an optional
``"fhir"`` table (:mod:`include.fhir_options`). How rules meet messages (separators, escapes, batches):
:mod:`spark_jobs.transform_rules`.

The schema is `include.schema.transforms` (strict pydantic models, one per operation); every
problem of the file is reported at once, keyed ``transform[0].rules[3].length``. Plain Python, no
Spark.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from include.conditions import Condition
from include.fhir_options import FHIR_CONTENT_TYPE, FhirOptions
from include.hl7path import FieldPath, parse_path
from include.schema import ConfigProblem
from include.schema.items import ConfigProblemsError, problem, type_name, validate_item, validate_list
from include.schema.transforms import (
    RULE_MODELS,
    AddSegmentRule,
    ClearRule,
    ConcatRule,
    CopyRule,
    DeadLetterRule,
    DropSegmentRule,
    FormatDateRule,
    MapRule,
    PadRule,
    RenameSegmentRule,
    ReplaceRule,
    SetRule,
    SubstringRule,
    TextPart,
    TransformHead,
    TransformsFile,
    condition,
)

__all__ = [
    "DATE_HL7",
    "ENVELOPE_SEGMENTS",
    "FHIR_CONTENT_TYPE",
    "HEADER_SEGMENTS",
    "HL7_CONTENT_TYPE",
    "JSON_CONTENT_TYPE",
    "MAX_LOOKUP_ENTRIES",
    "OUTPUTS",
    "STRING_FUNCTIONS",
    "AddSegment",
    "ClearField",
    "Concat",
    "CopyField",
    "DeadLetter",
    "DropSegment",
    "FormatDate",
    "Generate",
    "MapField",
    "RenameSegment",
    "Rule",
    "SetField",
    "StringFunction",
    "Transform",
    "TransformConfigError",
    "TransformsFile",
    "parse_transforms",
]

HL7_CONTENT_TYPE = "application/hl7-v2"
JSON_CONTENT_TYPE = "application/json"
OUTPUTS = {"hl7": HL7_CONTENT_TYPE, "json": JSON_CONTENT_TYPE, "fhir-r4": FHIR_CONTENT_TYPE}
MAX_LOOKUP_ENTRIES = 50_000

# Header segments carry separators and have the "field 1 is the field separator" numbering.
HEADER_SEGMENTS = ("MSH", "FHS", "BHS")
# The batch envelope: passed through untouched, so rules may not name it.
ENVELOPE_SEGMENTS = ("FHS", "BHS", "BTS", "FTS")

STRING_FUNCTIONS = ("upper", "lower", "substring", "pad", "replace", "format_date")
DATE_HL7 = "yyyyMMddHHmmss"
"""``"hl7"`` as a ``format_date``/``generate`` output format: an HL7 DTM to the second."""
CONTROL_ID_LENGTH = 20


class TransformConfigError(ConfigProblemsError):
    """`transforms.toml` breaks the schema: every problem, keyed ``transform[0].rules[3].pad``."""


@dataclass(frozen=True)
class SetField:
    """Write the literal ``value`` at ``path`` (escaped; creates missing trailing elements)."""

    path: FieldPath
    value: str
    each: bool = False
    when: Condition | None = None


@dataclass(frozen=True)
class CopyField:
    """Write the raw text at ``source`` to ``target`` (same message; same segment if ``each``)."""

    source: FieldPath
    target: FieldPath
    each: bool = False
    when: Condition | None = None


@dataclass(frozen=True)
class ClearField:
    """Empty the element at ``path`` if it exists."""

    path: FieldPath
    each: bool = False
    when: Condition | None = None


@dataclass(frozen=True)
class MapField:
    """Translate the value at ``path`` through lookup ``table``; ``default`` None keeps a miss,
    ``""`` clears it, any other string replaces it."""

    path: FieldPath
    table: str
    default: str | None = None
    each: bool = False
    when: Condition | None = None
    dead_letter: bool = False


@dataclass(frozen=True)
class DropSegment:
    """Remove every occurrence of ``segment``."""

    segment: str
    when: Condition | None = None


@dataclass(frozen=True)
class RenameSegment:
    """Rename every occurrence of ``segment`` to ``to``."""

    segment: str
    to: str
    when: Condition | None = None


@dataclass(frozen=True)
class AddSegment:
    """Add ``text`` (written with ``|^~\\&``) after the last ``after`` / before the first ``before``
    segment, or at the end of the message."""

    text: str
    after: str | None = None
    before: str | None = None
    when: Condition | None = None


@dataclass(frozen=True)
class StringFunction:
    """``op`` (upper, lower, substring, pad, replace) of the raw text at ``source``, written to
    ``target``; ``args`` are the op's settings in a fixed order (see ``_parse_function``)."""

    op: str
    source: FieldPath
    target: FieldPath
    args: tuple[Any, ...] = ()
    each: bool = False
    when: Condition | None = None


@dataclass(frozen=True)
class FormatDate:
    """Reformat the date/time at ``source`` (``from_format``, "hl7" = HL7 DTM of any precision) to
    ``to_format`` at ``target``; ``on_error`` keep | clear | dead_letter for an unreadable value."""

    source: FieldPath
    target: FieldPath
    from_format: str = "hl7"
    to_format: str = "hl7"
    on_error: str = "keep"
    each: bool = False
    when: Condition | None = None


@dataclass(frozen=True)
class Concat:
    """Concatenate fields (FieldPath, raw text) and constants (str, literal text) into ``target``."""

    parts: tuple[FieldPath | str, ...]
    target: FieldPath
    when: Condition | None = None


@dataclass(frozen=True)
class Generate:
    """Write a generated value: ``timestamp`` (the transform's time in ``format``) or
    ``control_id`` (``prefix`` + hex, 20 characters, one per message and destination)."""

    path: FieldPath
    kind: str
    format: str = DATE_HL7
    prefix: str = ""
    when: Condition | None = None


@dataclass(frozen=True)
class DeadLetter:
    """Do not deliver: the routed row is dead with ``reason``."""

    reason: str
    when: Condition | None = None


Rule = (
    SetField
    | CopyField
    | ClearField
    | MapField
    | DropSegment
    | RenameSegment
    | AddSegment
    | StringFunction
    | FormatDate
    | Concat
    | Generate
    | DeadLetter
)
_RULE_CLASSES = (
    SetField,
    CopyField,
    ClearField,
    MapField,
    DropSegment,
    RenameSegment,
    AddSegment,
    StringFunction,
    FormatDate,
    Concat,
    Generate,
    DeadLetter,
)


@dataclass(frozen=True)
class Transform:
    """A validated spec for one destination."""

    destination: str
    output: str = "hl7"
    rules: tuple[Rule, ...] = ()
    fhir: FhirOptions | None = None
    """The FHIR mapping's settings, defaults merged in; set exactly when ``output`` is "fhir-r4"."""

    @property
    def content_type(self) -> str:
        """The MIME type delivered for this destination."""
        return OUTPUTS[self.output]


def parse_transforms(specs: Any, *, lookups: Mapping[str, Mapping[str, str]] | None = None) -> list[Transform]:
    """Validate a whole transform config (list of specs, one per destination) against the schema
    (`include.schema.transforms`); no Spark needed. Raises `TransformConfigError` with every
    problem of every table and rule, keyed ``transform[0].rules[3].length``.

    With ``lookups`` the tables that ``map`` rules name must exist in it (and be str -> str);
    without, table names are only checked for shape, so config can be linted before the store
    is reachable.
    """
    if lookups is not None and not isinstance(lookups, Mapping):
        raise TransformConfigError(f"lookups must be a mapping of table name to mapping, got {type(lookups).__name__}")
    items, problems = validate_list(specs, "transform")
    parsed: list[Transform] = []
    seen: set[str] = set()
    for index, spec in enumerate(items or []):
        key = f"transform[{index}]"
        item, found = (spec, []) if isinstance(spec, Transform) else _parse_spec(spec, key)
        problems += found
        if item is None:
            continue
        if item.destination in seen:
            problems.append(problem(f"{key}.destination", f"duplicate transform for destination {item.destination!r}"))
        seen.add(item.destination)
        if lookups is not None:
            for rule_index, rule in enumerate(item.rules):
                if isinstance(rule, MapField):
                    problems += _check_table(rule.table, lookups, f"{key}.rules[{rule_index}].table")
        parsed.append(item)
    if problems:
        raise TransformConfigError(problems)
    return parsed


def _parse_spec(spec: Any, key: str) -> tuple[Transform | None, list[ConfigProblem]]:
    """One ``{"destination", "output", "rules"}`` table, every rule validated alone."""
    if not isinstance(spec, Mapping):
        return None, [problem(key, f"must be a table, got {type_name(spec)}")]
    head, problems = validate_item(TransformHead, spec, key)
    raw_rules = spec.get("rules", [])
    rules: list[Rule] = []
    if isinstance(raw_rules, list):
        for index, rule in enumerate(raw_rules):
            parsed, found = _parse_rule(rule, f"{key}.rules[{index}]")
            problems += found
            if parsed is not None:
                rules.append(parsed)
    if head is None or problems:
        return None, problems
    fhir = FhirOptions.of(head.fhir.model_dump() if head.fhir else None) if head.output == "fhir-r4" else None
    return Transform(destination=head.destination, output=head.output, rules=tuple(rules), fhir=fhir), []


def _parse_rule(rule: Any, key: str) -> tuple[Rule | None, list[ConfigProblem]]:
    if isinstance(rule, _RULE_CLASSES):
        return rule, []
    if not isinstance(rule, Mapping):
        return None, [problem(key, f"must be a table, got {type_name(rule)}")]
    ops = [k for k in rule if k in RULE_MODELS]
    if len(ops) != 1:
        found = f"got {sorted(map(str, ops))}" if ops else f"got keys {sorted(map(str, rule))}"
        return None, [problem(key, f"expected exactly one operation ({', '.join(RULE_MODELS)}), {found}")]
    model, problems = validate_item(RULE_MODELS[ops[0]], dict(rule), key)
    if model is None:
        return None, problems
    built = _rule(model)
    return (replace(built, when=condition(model.when)) if model.when is not None else built), []


def _rule(m: Any) -> Rule:
    """The rule dataclass the Spark jobs compile, from a validated model (without its `when`)."""
    p = parse_path
    if isinstance(m, SetRule):
        if m.generate == "timestamp":
            fmt = m.format or "hl7"
            return Generate(p(m.path), "timestamp", DATE_HL7 if fmt == "hl7" else fmt)
        if m.generate == "control_id":
            return Generate(p(m.path), "control_id", prefix=m.prefix or "")
        return SetField(p(m.path), m.value or "", m.each)
    if isinstance(m, CopyRule):
        return CopyField(p(m.source), p(m.to), m.each)
    if isinstance(m, ClearRule):
        return ClearField(p(m.path), m.each)
    if isinstance(m, MapRule):
        if m.not_found is not None:
            value = {"keep": None, "clear": "", "dead_letter": None}.get(m.not_found, m.default)
            return MapField(p(m.path), m.table, value, m.each, dead_letter=m.not_found == "dead_letter")
        default = "keep" if m.default is None else m.default
        return MapField(
            p(m.path), m.table, None if default == "keep" else "" if default == "clear" else default, m.each
        )
    if isinstance(m, DropSegmentRule):
        return DropSegment(m.segment)
    if isinstance(m, RenameSegmentRule):
        return RenameSegment(m.segment, m.to)
    if isinstance(m, AddSegmentRule):
        return AddSegment(m.text, m.after, m.before)
    if isinstance(m, ConcatRule):
        parts = tuple(part.text if isinstance(part, TextPart) else p(part) for part in m.parts)
        return Concat(parts, p(m.to))
    if isinstance(m, DeadLetterRule):
        return DeadLetter(m.reason.strip()[:300])
    target = p(m.to if m.to is not None else m.source)
    if isinstance(m, FormatDateRule):
        return FormatDate(p(m.source), target, m.from_format, m.to_format, m.on_error, m.each)
    op = next(op for op, model in RULE_MODELS.items() if isinstance(m, model))
    args: tuple[Any, ...] = ()
    if isinstance(m, SubstringRule):
        args = (m.start, m.length)
    elif isinstance(m, PadRule):
        args = (m.length, m.char, m.side)
    elif isinstance(m, ReplaceRule):
        args = (m.pattern, m.replacement)
    return StringFunction(op, p(m.source), target, args, m.each)


def _check_table(name: str, lookups: Mapping[str, Any], key: str) -> list[ConfigProblem]:
    """A lookup table a rule uses must exist, be ``{str: str}`` and be small enough for a map literal."""
    if name not in lookups:
        known = ", ".join(sorted(map(str, lookups))) or "none"
        return [problem(key, f"unknown lookup table {name!r} (known: {known})")]
    table = lookups[name]
    if not isinstance(table, Mapping):
        return [problem(key, f"lookup table {name!r} must be a mapping, got {type(table).__name__}")]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        return [problem(key, f"lookup table {name!r}: keys and values must be strings")]
    if len(table) > MAX_LOOKUP_ENTRIES:
        return [
            problem(
                key,
                f"lookup table {name!r} has {len(table)} entries, more than {MAX_LOOKUP_ENTRIES} "
                "(it is compiled into a map literal that every lookup scans)",
            )
        ]
    return []
