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
:mod:`spark_jobs.hl7_json`). How rules meet messages (separators, escapes, batches):
:mod:`spark_jobs.transform_rules`.

Plain Python, no Spark: every error names the destination, the rule index and the problem.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Union

from include.schema.items import ConfigProblemsError
from include.conditions import Condition, ConditionError, check_java_regex, parse_condition
from include.hl7path import FieldPath, FieldPathError, parse_path

__all__ = [
    "DATE_HL7",
    "STRING_FUNCTIONS",
    "AddSegment",
    "Concat",
    "DeadLetter",
    "FormatDate",
    "Generate",
    "StringFunction",
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
STRING_FUNCTIONS = ("upper", "lower", "substring", "pad", "replace", "format_date")
# Operation key -> every key allowed in a rule of that kind ("when" is allowed on every rule).
_RULE_KEYS: dict[str, frozenset[str]] = {
    "set": frozenset({"set", "value", "each", "generate", "format", "prefix"}),
    "copy": frozenset({"copy", "to", "each"}),
    "clear": frozenset({"clear", "each"}),
    "map": frozenset({"map", "table", "default", "not_found", "each"}),
    "drop_segment": frozenset({"drop_segment"}),
    "rename_segment": frozenset({"rename_segment", "to"}),
    "add_segment": frozenset({"add_segment", "after", "before"}),
    "concat": frozenset({"concat", "to"}),
    "dead_letter": frozenset({"dead_letter"}),
    "upper": frozenset({"upper", "to", "each"}),
    "lower": frozenset({"lower", "to", "each"}),
    "substring": frozenset({"substring", "start", "length", "to", "each"}),
    "pad": frozenset({"pad", "length", "with", "side", "to", "each"}),
    "replace": frozenset({"replace", "pattern", "with", "to", "each"}),
    "format_date": frozenset({"format_date", "from", "to_format", "to", "on_error", "each"}),
}
DATE_HL7 = "yyyyMMddHHmmss"
"""``"hl7"`` as a ``format_date``/``generate`` output format: an HL7 DTM to the second."""
CONTROL_ID_LENGTH = 20
# Spark datetime pattern letters (docs: sql-ref-datetime-pattern); anything else fails mid-job.
_PATTERN_LETTERS = set("GyMdDQqLEuaHhKkmsSVzOXxZ")


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


Rule = Union[SetField, CopyField, ClearField, MapField, DropSegment, RenameSegment, AddSegment, StringFunction,
             FormatDate, Concat, Generate, DeadLetter]
_RULE_CLASSES = (SetField, CopyField, ClearField, MapField, DropSegment, RenameSegment, AddSegment, StringFunction,
                 FormatDate, Concat, Generate, DeadLetter)


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
    if isinstance(rule, _RULE_CLASSES):
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

    allowed = _RULE_KEYS[op] | {"when"}
    unknown = set(rule) - allowed
    if unknown:
        raise fail(f"unknown key(s) {sorted(map(str, unknown))} (allowed: {', '.join(sorted(allowed))})")
    when: Condition | None = None
    if "when" in rule:
        try:
            when = parse_condition(rule["when"], where="when")
        except ConditionError as exc:
            raise fail(str(exc)) from None
    parsed = _parse_op(op, rule, fail)
    return replace(parsed, when=when) if when is not None else parsed


def _parse_op(op: str, rule: Mapping[str, Any], fail: Callable[[str], TransformConfigError]) -> Rule:
    """The rule without its ``when``."""
    if op in ("drop_segment", "rename_segment"):
        segment = _segment_name(rule[op], "segment", fail)
        if op == "drop_segment":
            return DropSegment(segment)
        if "to" not in rule:
            raise fail("needs 'to' (the new segment id)")
        return RenameSegment(segment, _segment_name(rule["to"], "'to'", fail))
    if op == "add_segment":
        return _parse_add_segment(rule, fail)
    if op == "dead_letter":
        reason = rule[op]
        if not isinstance(reason, str) or not reason.strip():
            raise fail("'dead_letter' must be a non-empty reason")
        return DeadLetter(reason.strip()[:300])
    if op == "concat":
        return _parse_concat(rule, fail)

    each = rule.get("each", False)
    if not isinstance(each, bool):
        raise fail(f"'each' must be true or false, got {each!r}")
    if op in STRING_FUNCTIONS:
        source = _rule_path(rule[op], "path", fail, write=False, each=each)
        target = _rule_path(rule.get("to", rule[op]), "'to'", fail, write=True, each=each)
        if each and target.segment != source.segment:
            raise fail(f"'each' works within one segment occurrence, so the path and 'to' must name the same "
                       f"segment (got {source.segment} and {target.segment})")
        if op == "format_date":
            return _parse_format_date(rule, source, target, each, fail)
        return StringFunction(op, source, target, _function_args(op, rule, fail), each)
    path = _rule_path(rule[op], "path", fail, write=op != "copy", each=each)
    if op == "set":
        if "generate" in rule:
            return _parse_generate(rule, path, each, fail)
        for key in ("format", "prefix"):
            if key in rule:
                raise fail(f"{key!r} goes with 'generate'")
        if "value" not in rule:
            raise fail("needs 'value' (or 'generate')")
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
    if "not_found" in rule:
        policy = rule["not_found"]
        if policy not in ("keep", "default", "clear", "dead_letter"):
            raise fail(f"'not_found' must be keep, default, clear or dead_letter, got {policy!r}")
        if (policy == "default") != ("default" in rule):
            raise fail("'default' goes with not_found = 'default' (and it needs one)")
        default = rule.get("default")
        if policy == "default" and not isinstance(default, str):
            raise fail(f"'default' must be a string, got {type(default).__name__}")
        value = {"keep": None, "clear": "", "dead_letter": None}.get(policy, default)
        return MapField(path, table, value, each, dead_letter=policy == "dead_letter")
    default = rule.get("default", "keep")
    if not isinstance(default, str):
        raise fail(f"'default' must be 'keep', 'clear' or a string, got {type(default).__name__}")
    return MapField(path, table, None if default == "keep" else "" if default == "clear" else default, each)


def _parse_add_segment(rule: Mapping[str, Any], fail: Callable[[str], TransformConfigError]) -> AddSegment:
    text = rule["add_segment"]
    if not isinstance(text, str) or not re.fullmatch(r"[A-Z][A-Z0-9]{2}(\|[^\r\n]*)?", text):
        raise fail("'add_segment' must be one segment's text: its id, then '|' and its fields "
                   f"(no line breaks), e.g. 'ZST|1|A^B'; got {text!r}")
    _segment_name(text[:3], "the added segment", fail)
    if "after" in rule and "before" in rule:
        raise fail("give 'after' or 'before', not both")
    anchors = {k: _anchor(rule[k], k, fail) for k in ("after", "before") if k in rule}
    return AddSegment(text, anchors.get("after"), anchors.get("before"))


def _anchor(value: Any, what: str, fail: Callable[[str], TransformConfigError]) -> str:
    if not isinstance(value, str) or not _SEGMENT_ID.fullmatch(value) or value in ENVELOPE_SEGMENTS:
        raise fail(f"{what!r} must be a segment id inside the message (not the batch envelope), got {value!r}")
    return value


def _parse_concat(rule: Mapping[str, Any], fail: Callable[[str], TransformConfigError]) -> Concat:
    parts = rule["concat"]
    if isinstance(parts, (str, bytes, Mapping)) or not isinstance(parts, Sequence) or not parts:
        raise fail("'concat' must be a non-empty list of field paths and {text = \"...\"} constants")
    parsed: list[FieldPath | str] = []
    for i, part in enumerate(parts):
        if isinstance(part, Mapping):
            if set(part) != {"text"} or not isinstance(part["text"], str):
                raise fail(f"part #{i}: a constant is {{text = \"...\"}}, got {dict(part)!r}")
            parsed.append(part["text"])
        else:
            parsed.append(_rule_path(part, f"part #{i}", fail, write=False, each=False))
    if "to" not in rule:
        raise fail("needs 'to' (the target path)")
    return Concat(tuple(parsed), _rule_path(rule["to"], "'to'", fail, write=True, each=False))


def _integer(rule: Mapping[str, Any], key: str, fail: Callable[[str], TransformConfigError], *, minimum: int,
             default: int | None = None) -> int | None:
    value = rule.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(f"{key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _function_args(op: str, rule: Mapping[str, Any], fail: Callable[[str], TransformConfigError]) -> tuple[Any, ...]:
    """Settings of a string function, validated: substring (start, length|None), pad (length,
    char, side), replace (pattern, replacement); upper and lower take none."""
    if op == "substring":
        if "start" not in rule:
            raise fail("needs 'start' (1-based)")
        return (_integer(rule, "start", fail, minimum=1), _integer(rule, "length", fail, minimum=0))
    if op == "pad":
        if "length" not in rule:
            raise fail("needs 'length'")
        char = rule.get("with", " ")
        if not isinstance(char, str) or len(char) != 1:
            raise fail(f"'with' must be one character, got {char!r}")
        side = rule.get("side", "left")
        if side not in ("left", "right"):
            raise fail(f"'side' must be left or right, got {side!r}")
        return (_integer(rule, "length", fail, minimum=1), char, side)
    if op == "replace":
        pattern, replacement = rule.get("pattern"), rule.get("with", "")
        if not isinstance(pattern, str) or not pattern:
            raise fail("needs 'pattern', a non-empty Java regex")
        check_java_regex(pattern, fail)
        if not isinstance(replacement, str):
            raise fail(f"'with' must be a string, got {type(replacement).__name__}")
        return (pattern, replacement)
    return ()


def _date_pattern(value: Any, what: str, fail: Callable[[str], TransformConfigError]) -> str:
    """"hl7" or a Spark datetime pattern whose letters Spark knows (a bad one would fail mid-job)."""
    if value == "hl7":
        return value
    if not isinstance(value, str) or not value:
        raise fail(f"{what!r} must be 'hl7' or a Spark datetime pattern, got {value!r}")
    unquoted = re.sub(r"'[^']*'", "", value)
    if unquoted.count("'"):
        raise fail(f"{what!r}: unbalanced quote in pattern {value!r}")
    bad = sorted({c for c in unquoted if c.isascii() and c.isalpha() and c not in _PATTERN_LETTERS})
    if bad:
        raise fail(f"{what!r}: pattern {value!r} uses letters Spark does not know: {', '.join(bad)} "
                   "(quote literal text with '...')")
    return value


def _parse_format_date(rule: Mapping[str, Any], source: FieldPath, target: FieldPath, each: bool,
                       fail: Callable[[str], TransformConfigError]) -> FormatDate:
    on_error = rule.get("on_error", "keep")
    if on_error not in ("keep", "clear", "dead_letter"):
        raise fail(f"'on_error' must be keep, clear or dead_letter, got {on_error!r}")
    from_format = _date_pattern(rule.get("from", "hl7"), "from", fail)
    to_format = _date_pattern(rule.get("to_format", "hl7"), "to_format", fail)
    return FormatDate(source, target, from_format, to_format, on_error, each)


def _parse_generate(rule: Mapping[str, Any], path: FieldPath, each: bool,
                    fail: Callable[[str], TransformConfigError]) -> Generate:
    kind = rule["generate"]
    if "value" in rule:
        raise fail("give 'value' or 'generate', not both")
    if each:
        raise fail("'generate' writes one value per message: no 'each'")
    if kind == "timestamp":
        if "prefix" in rule:
            raise fail("'prefix' goes with generate = 'control_id'")
        fmt = _date_pattern(rule.get("format", "hl7"), "format", fail)
        return Generate(path, kind, DATE_HL7 if fmt == "hl7" else fmt)
    if kind == "control_id":
        if "format" in rule:
            raise fail("'format' goes with generate = 'timestamp'")
        prefix = rule.get("prefix", "")
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9]{0,12}", prefix):
            raise fail(f"'prefix' must be 0-12 letters or digits, got {prefix!r}")
        return Generate(path, kind, prefix=prefix)
    raise fail(f"'generate' must be 'timestamp' or 'control_id', got {kind!r}")


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
