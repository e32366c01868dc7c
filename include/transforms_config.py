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

``"output": "json"`` delivers ``application/json`` instead of HL7 (the format:
:mod:`spark_jobs.hl7_json`). How rules meet messages (separators, escapes, batches):
:mod:`spark_jobs.transform_rules`.

Plain Python, no Spark: every error names the destination, the rule index and the problem.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from include.hl7path import FieldPath, FieldPathError, parse_path

__all__ = [
    "ENVELOPE_SEGMENTS",
    "HEADER_SEGMENTS",
    "HL7_CONTENT_TYPE",
    "JSON_CONTENT_TYPE",
    "MAX_LOOKUP_ENTRIES",
    "OUTPUTS",
    "ClearField",
    "CopyField",
    "DropSegment",
    "MapField",
    "RenameSegment",
    "Rule",
    "SetField",
    "Transform",
    "TransformConfigError",
    "parse_transforms",
]

HL7_CONTENT_TYPE = "application/hl7-v2"
JSON_CONTENT_TYPE = "application/json"
OUTPUTS = {"hl7": HL7_CONTENT_TYPE, "json": JSON_CONTENT_TYPE}
MAX_LOOKUP_ENTRIES = 50_000

# Header segments carry separators and have the "field 1 is the field separator" numbering.
HEADER_SEGMENTS = ("MSH", "FHS", "BHS")
# The batch envelope: passed through untouched, so rules may not name it.
ENVELOPE_SEGMENTS = ("FHS", "BHS", "BTS", "FTS")
_SEGMENT_ID = re.compile(r"[A-Z][A-Z0-9]{2}")
_EXPLICIT_OCCURRENCE = re.compile(r"[A-Z0-9]{3}\[")

_SPEC_KEYS = frozenset({"destination", "output", "rules"})
# Operation key -> every key allowed in a rule of that kind.
_RULE_KEYS: dict[str, frozenset[str]] = {
    "set": frozenset({"set", "value", "each"}),
    "copy": frozenset({"copy", "to", "each"}),
    "clear": frozenset({"clear", "each"}),
    "map": frozenset({"map", "table", "default", "each"}),
    "drop_segment": frozenset({"drop_segment"}),
    "rename_segment": frozenset({"rename_segment", "to"}),
}


class TransformConfigError(ValueError):
    """A transform spec that cannot be compiled; the message names destination, rule and problem."""


@dataclass(frozen=True)
class SetField:
    """Write the literal ``value`` at ``path`` (escaped; creates missing trailing elements)."""

    path: FieldPath
    value: str
    each: bool = False


@dataclass(frozen=True)
class CopyField:
    """Write the raw text at ``source`` to ``target`` (same message; same segment if ``each``)."""

    source: FieldPath
    target: FieldPath
    each: bool = False


@dataclass(frozen=True)
class ClearField:
    """Empty the element at ``path`` if it exists."""

    path: FieldPath
    each: bool = False


@dataclass(frozen=True)
class MapField:
    """Translate the value at ``path`` through lookup ``table``; ``default`` None keeps a miss,
    ``""`` clears it, any other string replaces it."""

    path: FieldPath
    table: str
    default: str | None = None
    each: bool = False


@dataclass(frozen=True)
class DropSegment:
    """Remove every occurrence of ``segment``."""

    segment: str


@dataclass(frozen=True)
class RenameSegment:
    """Rename every occurrence of ``segment`` to ``to``."""

    segment: str
    to: str


Rule = Union[SetField, CopyField, ClearField, MapField, DropSegment, RenameSegment]


@dataclass(frozen=True)
class Transform:
    """A validated spec for one destination."""

    destination: str
    output: str = "hl7"
    rules: tuple[Rule, ...] = ()

    @property
    def content_type(self) -> str:
        """The MIME type delivered for this destination."""
        return OUTPUTS[self.output]



def parse_transforms(
    specs: Any, *, lookups: Mapping[str, Mapping[str, str]] | None = None
) -> list[Transform]:
    """Validate a whole transform config (list of specs, one per destination); no Spark needed.

    With ``lookups`` the tables that ``map`` rules name must exist in it (and be str -> str);
    without, table names are only checked for shape, so config can be linted before the store
    is reachable.
    """
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise TransformConfigError(f"transforms must be a list of transform tables, got {type(specs).__name__}")
    if lookups is not None and not isinstance(lookups, Mapping):
        raise TransformConfigError(
            f"lookups must be a mapping of table name to mapping, got {type(lookups).__name__}"
        )
    parsed: list[Transform] = []
    seen: set[str] = set()
    for index, spec in enumerate(specs):
        if isinstance(spec, Transform):
            item = spec
        else:
            item = _parse_spec(spec, index)
        if item.destination in seen:
            raise TransformConfigError(f"transform {item.destination!r}: duplicate destination")
        seen.add(item.destination)
        if lookups is not None:
            for rule_index, rule in enumerate(item.rules):
                if not isinstance(rule, MapField):
                    continue
                where = f"transform {item.destination!r}: rule #{rule_index} (map)"
                if rule.table not in lookups:
                    known = ", ".join(sorted(map(str, lookups))) or "none"
                    raise TransformConfigError(f"{where}: unknown lookup table {rule.table!r} (known: {known})")
                _check_table(rule.table, lookups[rule.table], where)
        parsed.append(item)
    return parsed


def _parse_spec(spec: Any, index: int) -> Transform:
    """Validate one ``{"destination", "output", "rules"}`` table."""
    if not isinstance(spec, Mapping):
        raise TransformConfigError(f"transform #{index}: must be a table/object, got {type(spec).__name__}")
    destination = spec.get("destination")
    if not isinstance(destination, str) or not destination.strip():
        raise TransformConfigError(f"transform #{index}: 'destination' must be a non-empty string")
    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise TransformConfigError(
            f"transform {destination!r}: unknown key(s) {sorted(map(str, unknown))} "
            "(allowed: destination, output, rules)"
        )
    output = spec.get("output", "hl7")
    if output not in OUTPUTS:
        raise TransformConfigError(
            f"transform {destination!r}: 'output' must be one of {', '.join(OUTPUTS)}, got {output!r}"
        )
    rules = spec.get("rules", [])
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
        raise TransformConfigError(
            f"transform {destination!r}: 'rules' must be a list, got {type(rules).__name__}"
        )
    parsed = tuple(_parse_rule(rule, destination, i) for i, rule in enumerate(rules))
    return Transform(destination=destination, output=output, rules=parsed)


def _parse_rule(rule: Any, destination: str, index: int) -> Rule:
    """Validate one rule table; errors read ``transform 'ehr': rule #2 (map): problem``."""
    if isinstance(rule, (SetField, CopyField, ClearField, MapField, DropSegment, RenameSegment)):
        return rule
    if not isinstance(rule, Mapping):
        raise TransformConfigError(
            f"transform {destination!r}: rule #{index}: must be a table/object, got {type(rule).__name__}"
        )
    ops = [key for key in rule if key in _RULE_KEYS]
    if len(ops) != 1:
        found = f"got {sorted(map(str, ops))}" if ops else f"got keys {sorted(map(str, rule))}"
        raise TransformConfigError(
            f"transform {destination!r}: rule #{index}: expected exactly one operation "
            f"({', '.join(_RULE_KEYS)}), {found}"
        )
    (op,) = ops

    def fail(problem: str) -> TransformConfigError:
        return TransformConfigError(f"transform {destination!r}: rule #{index} ({op}): {problem}")

    unknown = set(rule) - _RULE_KEYS[op]
    if unknown:
        raise fail(f"unknown key(s) {sorted(map(str, unknown))} (allowed: {', '.join(sorted(_RULE_KEYS[op]))})")

    if op in ("drop_segment", "rename_segment"):
        segment = _segment_name(rule[op], "segment", fail)
        if op == "drop_segment":
            return DropSegment(segment)
        if "to" not in rule:
            raise fail("needs 'to' (the new segment id)")
        return RenameSegment(segment, _segment_name(rule["to"], "'to'", fail))

    each = rule.get("each", False)
    if not isinstance(each, bool):
        raise fail(f"'each' must be true or false, got {each!r}")
    path = _rule_path(rule[op], "path", fail, write=op != "copy", each=each)
    if op == "set":
        if "value" not in rule:
            raise fail("needs 'value'")
        if not isinstance(rule["value"], str):
            raise fail(f"'value' must be a string, got {type(rule['value']).__name__}")
        return SetField(path, rule["value"], each)
    if op == "clear":
        return ClearField(path, each)
    if op == "copy":
        if "to" not in rule:
            raise fail("needs 'to' (the target path)")
        target = _rule_path(rule["to"], "'to'", fail, write=True, each=each)
        if each and target.segment != path.segment:
            raise fail(
                f"'each' copies within one segment occurrence, so source and target must name the "
                f"same segment (got {path.segment} and {target.segment})"
            )
        return CopyField(path, target, each)
    # map
    table = rule.get("table")
    if not isinstance(table, str) or not table.strip():
        raise fail("needs 'table', a non-empty lookup table name")
    default = rule.get("default", "keep")
    if not isinstance(default, str):
        raise fail(f"'default' must be 'keep', 'clear' or a string, got {type(default).__name__}")
    return MapField(path, table, None if default == "keep" else "" if default == "clear" else default, each)


def _segment_name(value: Any, what: str, fail: Callable[[str], TransformConfigError]) -> str:
    """A segment id a rule may drop, rename or rename to (not MSH, not the batch envelope)."""
    if not isinstance(value, str) or not _SEGMENT_ID.fullmatch(value):
        raise fail(f"{what} must be a 3-character segment id (a letter, then letters or digits), got {value!r}")
    if value == "MSH" or value in ENVELOPE_SEGMENTS:
        raise fail(
            f"{what} {value} is a message header or batch envelope segment and cannot be dropped or renamed"
        )
    return value


def _rule_path(
    value: Any, what: str, fail: Callable[[str], TransformConfigError], *, write: bool, each: bool
) -> FieldPath:
    """Parse a rule's path and refuse what rules cannot do (envelope, MSH-1/2 writes, each+[n])."""
    try:
        path = parse_path(value)
    except FieldPathError as exc:
        raise fail(f"bad {what}: {exc}") from None
    if path.segment in ENVELOPE_SEGMENTS:
        raise fail(
            f"bad {what} {value!r}: batch envelope segments ({', '.join(ENVELOPE_SEGMENTS)}) are "
            "preserved as they are; rules apply to the messages inside"
        )
    if write and path.segment == "MSH" and path.field in (1, 2):
        raise fail(f"bad {what} {value!r}: MSH-1 and MSH-2 are the message's separators and cannot be written")
    if each and _EXPLICIT_OCCURRENCE.match(value):
        raise fail(f"bad {what} {value!r}: 'each' applies to every occurrence; drop the [occurrence] index")
    return path


def _check_table(name: str, table: Any, where: str) -> None:
    """A lookup table a rule uses must be ``{str: str}`` and small enough for a map literal."""
    if not isinstance(table, Mapping):
        raise TransformConfigError(f"{where}: lookup table {name!r} must be a mapping, got {type(table).__name__}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise TransformConfigError(f"{where}: lookup table {name!r}: keys and values must be strings")
    if len(table) > MAX_LOOKUP_ENTRIES:
        raise TransformConfigError(
            f"{where}: lookup table {name!r} has {len(table)} entries, more than {MAX_LOOKUP_ENTRIES} "
            "(it is compiled into a map literal that every lookup scans)"
        )
