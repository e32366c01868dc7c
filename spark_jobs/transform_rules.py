"""Transform stage core: rewrite each routed message for its destination, in native Spark SQL.

The rules — their grammar, classes and validation — are :mod:`include.transforms_config` (plain
Python, no Spark); :func:`transform` applies validated rules to a DataFrame of routed rows and
renders HL7, or JSON through :mod:`spark_jobs.hl7_json`.

Lookup tables: ``lookups`` is ``{table: {from: to}}`` (the stage job loads it from the store).
Each table a rule uses becomes a ``map<string,string>`` literal, read with ``try_element_at``.
Code tables hold tens to a few thousand entries, so the literal wins over a join: it keeps every
rule a per-row expression, whereas a join would have to explode the keys each rule needs, shuffle
them back per message and re-split the message between rules. The literal is one JSON string
folded into a constant map by the optimizer (not ``create_map``, which costs two plan nodes per
entry; its lookup rate: docs/performance.md). Tables above
:data:`include.transforms_config.MAX_LOOKUP_ENTRIES` are refused at config load: at that size the plan itself gets heavy
and a broadcast join in a stage of its own is the better tool.

Message handling:

* Separators come from each message's own MSH (FHS/BHS for the envelope); nothing assumes
  ``|^~\\&``. Escape sequences are text: never split on, kept verbatim unless a rule overwrites
  them. A message whose MSH-2 has no escape character cannot escape a separator in a constant;
  such a constant is written raw (a known limitation).
* CR, LF and CRLF segment endings are accepted; blank lines are dropped; output segments each end
  with CR. MSH-1/MSH-2 use HL7 numbering (MSH-3 is the sending application) and are read-only.
* Batch files (FHS/BHS ... MSH ... MSH ... BTS/FTS): every message in the batch gets the rules,
  occurrence counts restart at each MSH, and envelope segments pass through untouched (rules may
  not name FHS, BHS, BTS or FTS). Messages simply concatenated without an envelope are handled
  the same way, each with its own MSH separators.
* A payload that does not start with MSH, FHS or BHS (after leading line breaks) cannot be
  transformed: its ``payload`` is NULL so the stage job can fail that row instead of delivering
  it unchanged. Destinations without a spec pass through byte for byte, as HL7.

Cost: everything runs in the JVM (no Python UDF), but Spark interprets higher-order functions
rather than generating code for them. The payload is parsed once and a row's rules run as the
steps of one ``aggregate`` (:func:`_fold`), so the message stays an in-memory row from parse to
rules; only the rendering reads it back from Spark's binary row format (Spark 4.2 looks up its
configuration at every field or element read from it, so the renderers read each unit's
separators once). Within a rule, lambdas nest at most one level per path level, because Spark's
analyzer slows down steeply with lambda depth; the plan's size is most of a job's fixed cost
(analysis, and the plan text Spark builds for its listeners). That cost and the rows per second per
core, to HL7 and to JSON: docs/performance.md.
Constants of letters, digits and spaces skip escaping (no message could use those as separators).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from include.conditions import uses_connection
from include.hl7path import FieldPath
from include.transforms_config import (
    CONTROL_ID_LENGTH,
    DATE_HL7,
    ENVELOPE_SEGMENTS,
    HEADER_SEGMENTS,
    HL7_CONTENT_TYPE,
    OUTPUTS,
    AddSegment,
    ClearField,
    Concat,
    CopyField,
    DeadLetter,
    DropSegment,
    FormatDate,
    Generate,
    MapField,
    RenameSegment,
    Rule,
    SetField,
    StringFunction,
    Transform,
    parse_transforms,
)
from spark_jobs.condition_columns import compile_condition
from spark_jobs.hl7_fhir import ENTRY_PARTS, fhir_bundle, fhir_context, fhir_entries
from spark_jobs.hl7_fields import let, split_regex
from spark_jobs.hl7_json import render_json

__all__ = ["transform"]

# A batch splits into units before each MSH and each envelope segment: segment ids are exactly
# three characters, so a segment starting "MSH" is an MSH whatever its field separator.
_UNIT_STARTS = ("MSH", *ENVELOPE_SEGMENTS)
# MSH-2 order: component, repetition, escape, subcomponent.
_ENCODING_ORDER = ("cs", "rs", "esc", "ss")
# HL7 escape code per separator (\F\ field, \S\ component, \R\ repetition, \T\ subcomponent).
_ESCAPE_CODES = (("fs", "F"), ("cs", "S"), ("rs", "R"), ("ss", "T"))
# HL7 separators are never letters, digits or space, so such text needs no escaping.
_PLAIN_TEXT = re.compile(r"[A-Za-z0-9 ]*")
_REST = 1 << 30  # "to the end" length for substring
# Scratch column holding the parsed payload, the rules applied, until transform()'s last projection renders it.
_UNITS = "_transform_units"
# Hidden input columns some rules read, and the dead-letter reason before it moves to content_type.
_CONNECTION = "_transform_connection"
_SEED = "_transform_control_seed"
_FHIR_SEED = "_transform_fhir_seed"
_FHIR = "_transform_fhir"


# --- the DataFrame transform ----------------------------------------------------------------


def transform(
    routed: DataFrame,
    specs: Sequence[Mapping[str, Any] | Transform],
    lookups: Mapping[str, Mapping[str, str]] | None = None,
    *,
    id_col: str = "id",
    destination_col: str = "destination",
    payload_col: str = "payload",
    carry: Sequence[str] = (),
    connection_col: str = "connection",
    message_id_col: str | None = None,
    now: Column | None = None,
) -> DataFrame:
    """Rewrite each routed row for its destination: ``id, destination, content_type, payload``.

    Rows whose destination has no spec keep their payload byte for byte (HL7). ``carry`` names
    further input columns to keep (appended after ``payload``), e.g. ``lane_key``. Pure (no I/O);
    use as ``routed.transform(transform, specs, lookups)``.

    A row a rule dead-letters (``dead_letter``, ``map`` not_found = dead_letter, ``format_date``
    on_error = dead_letter) comes out with a NULL payload and the reason in ``content_type``.
    ``connection_col`` is read only when a ``when`` tests the connection; ``message_id_col`` seeds
    generated control ids (else the row id); ``now`` replaces the current timestamp (tests).

    One expression parses the payload and applies the row's destination's rules (:func:`_fold`);
    a last projection renders HL7 or JSON.
    """
    parsed = parse_transforms(specs, lookups=lookups or {})
    destination = F.col("destination")
    rules = [r for spec in parsed for r in spec.rules]
    hidden = []
    if any(uses_connection(r.when) for r in rules):
        hidden.append(F.col(connection_col).alias(_CONNECTION))
    if any(isinstance(r, Generate) and r.kind == "control_id" for r in rules):
        seed = F.col(message_id_col) if message_id_col else F.col(id_col).cast("string")
        hidden.append(F.concat(seed, F.lit("|"), F.col(destination_col)).alias(_SEED))
    fhir_specs = [s for s in parsed if s.output == "fhir-r4"]
    if fhir_specs:
        seed = F.col(message_id_col) if message_id_col else F.col(id_col).cast("string")
        hidden.append(F.concat(seed, F.lit("|"), F.col(destination_col)).alias(_FHIR_SEED))
    frame = routed.select(
        F.col(id_col).alias("id"),
        F.col(destination_col).alias("destination"),
        F.col(payload_col).alias("payload"),
        *carry,
        *hidden,
    )
    if not parsed:
        return frame.select("id", "destination", F.lit(HL7_CONTENT_TYPE).alias("content_type"), "payload", *carry)
    ctx = _Context(connection=F.col(_CONNECTION), seed=F.col(_SEED), now=F.current_timestamp() if now is None else now)

    tables = _tables(rules, lookups or {})
    units = F.col(_UNITS)
    frame = frame.withColumn(_UNITS, _fold(parsed, F.col("payload"), tables, ctx))

    json_destinations = [s.destination for s in parsed if s.output == "json"]
    hl7_destinations = [s.destination for s in parsed if s.output == "hl7"]
    # One renderer per output kind, not per destination: a smaller plan to analyze. FHIR is the
    # exception: its settings (systems, vocabularies) are the destination's own.
    renderers = [(hl7_destinations, _render_hl7), (json_destinations, render_json)]
    out: Column | None = None
    for names, render in renderers:
        if names:
            cond, rendered = destination.isin(names), render(units)
            out = F.when(cond, rendered) if out is None else out.when(cond, rendered)
    fhir_error: Column | None = None
    if fhir_specs:
        # Three projections (hl7_fhir.fhir_context): the context once, each destination's entries, the Bundle.
        fhir_ctx = F.col(_FHIR)
        fhir_destinations = [s.destination for s in fhir_specs]
        frame = frame.withColumn(
            _FHIR, F.when(destination.isin(fhir_destinations), fhir_context(units, F.col(_FHIR_SEED)))
        )
        parts: dict[str, Column] = {}
        for spec in fhir_specs:
            assert spec.fhir is not None  # parse_transforms sets it for this output
            cond = destination == F.lit(spec.destination)
            for name, entry in fhir_entries(fhir_ctx, F.col(_FHIR_SEED), spec.fhir).items():
                parts[name] = F.when(cond, entry) if name not in parts else parts[name].when(cond, entry)
        frame = frame.withColumns({f"{_FHIR}_{name}": parts[name] for name in ENTRY_PARTS})
        bundle, fhir_error = fhir_bundle(fhir_ctx, [F.col(f"{_FHIR}_{name}") for name in ENTRY_PARTS])
        cond = destination.isin(fhir_destinations)
        out = F.when(cond, bundle) if out is None else out.when(cond, bundle)
    content_type = F.lit(HL7_CONTENT_TYPE)
    typed = [
        (names, OUTPUTS[kind])
        for kind, names in (("json", json_destinations), ("fhir-r4", [s.destination for s in fhir_specs]))
        if names
    ]
    if typed:
        choice: Column | None = None
        for names, mime in typed:
            choice = (
                F.when(destination.isin(names), F.lit(mime))
                if choice is None
                else choice.when(destination.isin(names), F.lit(mime))
            )
        content_type = choice.otherwise(F.lit(HL7_CONTENT_TYPE))  # type: ignore[union-attr]
    payload = out.otherwise(F.col("payload"))  # type: ignore[union-attr]
    errors = [fhir_error] if fhir_error is not None else []
    if any(_may_dead_letter(r) for r in rules):
        # The first unit's reason; the row is not delivered, the finalize dead-letters it.
        errors.insert(
            0, F.try_element_at(F.filter(F.transform(units, lambda u: u["error"]), lambda e: e.isNotNull()), F.lit(1))
        )
    if errors:
        error = F.coalesce(*errors) if len(errors) > 1 else errors[0]
        content_type = F.when(error.isNotNull(), error).otherwise(content_type)
        payload = F.when(error.isNull(), payload)
    return frame.select("id", "destination", content_type.alias("content_type"), payload.alias("payload"), *carry)


def _fold(
    specs: Sequence[Transform], payload: Column, tables: Mapping[str, tuple[Column, bool]], ctx: _Context
) -> Column:
    """Each row's payload parsed into units, then its destination's rules applied in order; NULL for
    a destination without a spec.

    One ``aggregate`` for all destinations: its accumulator is the parsed payload (parsed once,
    whatever the destination), its steps the numbers of the row's destination's rules (every rule
    of every spec has its own), its merge a CASE on the number. Every intermediate value stays an
    in-memory row: across the projections a chain of ``withColumn`` needs, each rule read the
    message back from Spark's binary row format, which costs a configuration lookup per field and
    array element read (Spark 4.2). The expression is as deep as its deepest rule plus three
    levels, not the whole chain: Spark Connect refuses expressions nested deeper than 48
    (protobuf's 100 levels), and the deepest rule (a dead-lettering ``map`` of a subcomponent) is 43.
    Nesting a few rules per step would save the copy ``aggregate`` makes of its accumulator after
    each, but measured no faster.
    """
    destination = F.col("destination")
    numbered: list[Rule] = []
    steps: Column | None = None
    for spec in specs:
        numbers = F.array(*(F.lit(n) for n in range(len(numbered), len(numbered) + len(spec.rules))))
        numbered.extend(spec.rules)
        cond = destination == F.lit(spec.destination)
        steps = (
            F.when(cond, numbers.cast("array<int>")) if steps is None else steps.when(cond, numbers.cast("array<int>"))
        )

    def merge(units: Column, k: Column) -> Column:
        step: Column | None = None
        for n, rule in enumerate(numbered):
            applied = _apply_to_messages(units, rule, tables, ctx)
            step = F.when(k == n, applied) if step is None else step.when(k == n, applied)
        return units if step is None else step.otherwise(units)

    # A destination without a spec has no steps (NULL): aggregate gives NULL, nothing is parsed.
    assert steps is not None  # the caller folds at least one spec
    return F.aggregate(steps, F.when(steps.isNotNull(), _parse_units(payload)), merge)


@dataclass(frozen=True)
class _Context:
    """What rules read besides the message: the inbound connection, the control-id seed, the time."""

    connection: Column
    seed: Column
    now: Column


def _may_dead_letter(rule: Rule) -> bool:
    return (
        isinstance(rule, DeadLetter)
        or (isinstance(rule, MapField) and rule.dead_letter)
        or (isinstance(rule, FormatDate) and rule.on_error == "dead_letter")
    )


def _apply_to_messages(units: Column, rule: Rule, tables: Mapping[str, tuple[Column, bool]], ctx: _Context) -> Column:
    """Apply one rule to every message unit its ``when`` holds for (envelope units pass untouched).

    ``units`` must be an in-memory value (inside :func:`_fold`): a unit's separators are read at
    every use, which from Spark's binary row format would cost a configuration lookup each time.
    """

    def on_unit(u: Column, i: Column, seps: Column) -> Column:
        # A batch's later messages get control ids of their own: the unit index joins the seed.
        unit_ctx = replace(
            ctx, seed=F.when(i == 0, ctx.seed).otherwise(F.concat(ctx.seed, F.lit("#"), i.cast("string")))
        )
        out = u.withField("segments", _apply_rule(rule, u["segments"], seps, tables, unit_ctx))
        error = _rule_error(rule, u["segments"], seps, tables)
        if error is not None:
            out = out.withField("error", F.coalesce(u["error"], error))
        applies = u["message"]
        if rule.when is not None:
            applies = applies & compile_condition(rule.when, u["segments"], seps, ctx.connection)
        return F.when(applies, out).otherwise(u)

    return F.transform(units, lambda u, i: on_unit(u, i, u["seps"]))


def _render_hl7(units: Column) -> Column:
    """All segments, each ending with CR."""
    return F.concat(F.array_join(F.flatten(F.transform(units, lambda u: u["segments"])), "\r"), F.lit("\r"))


def _tables(rules: Sequence[Rule], lookups: Mapping[str, Mapping[str, str]]) -> dict[str, tuple[Column, bool]]:
    """Map literal and "all values plain" flag per lookup table the rules use."""
    return {
        r.table: (_map_literal(lookups[r.table]), all(map(_is_plain, lookups[r.table].values())))
        for r in rules
        if isinstance(r, MapField)
    }


def _map_literal(table: Mapping[str, str]) -> Column:
    """A ``map<string,string>`` constant: one JSON literal that the optimizer folds into a map.

    ``create_map`` would need two literal nodes per entry (thousands of client calls and plan
    nodes for a code table); ``from_json`` of a literal is evaluated once, at optimization.
    """
    return F.from_json(F.lit(json.dumps(dict(table))), "map<string,string>")


# --- parsing a payload into units (messages and envelope segments) ---------------------------


def _parse_units(payload: Column) -> Column:
    """Split a payload into units: ``array<unit>``, NULL unless it looks like HL7.

    A unit is ``struct<message: boolean, seps: struct, segments: array<string>, error: string>``
    (error: why a rule dead-lettered the message, else NULL): one message
    (MSH and the segments after it) or one envelope segment (FHS, BHS, BTS, FTS). A plain message
    is a single unit. ``seps`` come from the unit's own header, else from the payload's first.

    No regex runs per row here: line endings are normalised with plain replaces, and every split
    is on one literal character (Java's ``String.split`` fast path; a real regex would be
    compiled again for every row).
    """
    text = F.replace(F.replace(payload, F.lit("\r\n"), F.lit("\r")), F.lit("\n"), F.lit("\r"))
    # Blank lines (and the final CR) give empty segments: dropped.
    segments = F.filter(F.split(text, "\r", -1), lambda s: s != "")

    def units(segs: Column) -> Column:
        first = F.try_element_at(segs, F.lit(1))

        def unit(raw: Column) -> Column:
            def fields(unit_segs: Column) -> Column:
                head = F.element_at(unit_segs, 1)
                header = F.when(_is_header(head), head).otherwise(first)
                return F.struct(
                    head.startswith("MSH").alias("message"),
                    _separators(header).alias("seps"),
                    unit_segs.alias("segments"),
                    F.lit(None).cast("string").alias("error"),
                )

            return let(F.split(raw, "\r", -1), fields)

        # Segments are rejoined with CR, but each unit start with LF (none is left in the text),
        # so one more split on LF yields the units. The payload starts with a unit, so element 1
        # is the empty text before the first LF.
        marked = F.array_join(
            F.transform(
                segs,
                lambda s: F.concat(
                    F.when(F.substring(s, 1, 3).isin(*_UNIT_STARTS), F.lit("\n")).otherwise(F.lit("\r")), s
                ),
            ),
            "",
        )
        raw_units = let(F.split(marked, "\n", -1), lambda parts: F.slice(parts, 2, F.size(parts)))
        return F.when(_is_header(first), F.transform(raw_units, unit))

    return let(segments, units)


def _is_header(segment: Column) -> Column:
    """MSH, FHS or BHS followed by a field separator: the segments that declare separators."""
    return F.substring(segment, 1, 3).isin(*HEADER_SEGMENTS) & (F.length(segment) >= 4)


def _separators(header: Column) -> Column:
    """Separators of one header segment, shaped like ``hl7_fields.parse_message`` (+ ``enc``).

    The field separator is the 4th character; the encoding characters run from the 5th to the
    next field separator (or the end of the segment).
    """
    fs = F.substring(header, 4, 1)
    enc = F.call_function("substring_index", F.substring(header, 5, _REST), fs, F.lit(1))
    raw = F.struct(fs.alias("fs"), enc.alias("enc"))

    def build(h: Column) -> Column:
        seps = {"fs": h["fs"]}
        seps.update((name, F.substring(h["enc"], i, 1)) for i, name in enumerate(_ENCODING_ORDER, start=1))
        return F.struct(
            h["enc"].alias("enc"),
            *(sep.alias(name) for name, sep in seps.items()),
            *(split_regex(sep).alias(f"{name}_re") for name, sep in seps.items()),
        )

    return let(raw, build)


# --- rules ----------------------------------------------------------------------------------


def _apply_rule(
    rule: Rule, segs: Column, seps: Column, tables: Mapping[str, tuple[Column, bool]], ctx: _Context
) -> Column:
    """One rule over one message's segment array."""
    if isinstance(rule, DeadLetter):
        return segs
    if isinstance(rule, AddSegment):
        return _add_segment(rule, segs, seps)
    if isinstance(rule, (StringFunction, FormatDate)):
        return _compute(segs, rule.source, rule.target, seps, _function(rule, seps), each=rule.each)
    if isinstance(rule, Concat):
        return _concat(rule, segs, seps)
    if isinstance(rule, Generate):
        value = _constant(_generated(rule, ctx), seps, plain=False)
        return _edit_segments(segs, rule.path, seps, lambda s: _write(s, rule.path, value, seps, pad=F.lit(True)))
    if isinstance(rule, DropSegment):
        return F.filter(segs, lambda s: ~_is_segment(s, rule.segment, seps))
    if isinstance(rule, RenameSegment):
        return F.transform(
            segs,
            lambda s: F.when(
                _is_segment(s, rule.segment, seps), F.concat(F.lit(rule.to), F.substring(s, 4, _REST))
            ).otherwise(s),
        )
    if isinstance(rule, CopyField) and not rule.each:
        # The source may live in another segment: read it once, then edit the target segment.
        source = F.try_element_at(segs, _occurrence_index(segs, rule.source, seps) + 1)

        def write(v: Column) -> Callable[[Column], Column]:
            return lambda s: _write(s, rule.target, v, seps, pad=v != "")

        return let(
            _copy_value(_read(source, rule.source, seps), rule, seps),
            lambda v: _edit_segments(segs, rule.target, seps, write(v)),
        )
    path = rule.target if isinstance(rule, CopyField) else rule.path
    return _edit_segments(segs, path, seps, _segment_edit(rule, seps, tables), each=rule.each)


# --- rules of issue 13: add_segment, string functions, format_date, concat, generate, dead letters ---


def _rule_error(rule: Rule, segs: Column, seps: Column, tables: Mapping[str, tuple[Column, bool]]) -> Column | None:
    """The dead-letter reason this rule gives the message (NULL if none), or None if it never does.
    Reasons name the rule and the path, never the value (no PHI in last_error)."""
    if isinstance(rule, DeadLetter):
        return F.lit(rule.reason)
    if isinstance(rule, MapField) and rule.dead_letter:
        table = tables[rule.table][0]

        def missing(v: Column) -> Column:
            return (v != "") & F.try_element_at(table, v).isNull()

        reason = f"dead-lettered: the value at {rule.path} is not in lookup table {rule.table!r}"
        return F.when(_any_value(segs, rule.path, seps, missing, each=rule.each), F.lit(reason))
    if isinstance(rule, FormatDate) and rule.on_error == "dead_letter":

        def unreadable(v: Column) -> Column:
            return (v != "") & _parse_datetime(v, rule.from_format).isNull()

        reason = f"dead-lettered: the value at {rule.source} is not a date/time in format {rule.from_format!r}"
        return F.when(_any_value(segs, rule.source, seps, unreadable, each=rule.each), F.lit(reason))
    return None


def _any_value(segs: Column, path: FieldPath, seps: Column, test: Callable[[Column], Column], *, each: bool) -> Column:
    """Whether ``test`` holds for the value at ``path`` (in any occurrence, with ``each``); never NULL."""
    if each:
        return F.exists(
            segs, lambda s: _is_segment(s, path.segment, seps) & F.coalesce(test(_read(s, path, seps)), F.lit(False))
        )
    source = F.try_element_at(segs, _occurrence_index(segs, path, seps) + 1)
    return F.coalesce(test(_read(source, path, seps)), F.lit(False))


def _add_segment(rule: AddSegment, segs: Column, seps: Column) -> Column:
    """Insert the segment (its standard separators translated to the message's own)."""
    text = F.call_function(
        "translate",
        F.lit(rule.text),
        F.lit("|^~\\&"),
        F.concat(seps["fs"], seps["cs"], seps["rs"], seps["esc"], seps["ss"]),
    )
    if rule.after is None and rule.before is None:
        return F.concat(segs, F.array(text))
    anchor = rule.after or rule.before
    assert anchor is not None  # one of them is set: checked above

    def anchor_index(s: Column, i: Column) -> Column:
        return F.when(_is_segment(s, anchor, seps), i)

    indices = F.transform(segs, anchor_index)
    at = F.array_max(indices) if rule.after else F.try_element_at(F.filter(indices, lambda i: i.isNotNull()), F.lit(1))

    def insert(index: Column) -> Column:
        def placed(s: Column) -> Column:
            return F.array(s, text) if rule.after else F.array(text, s)

        def expand(s: Column, i: Column) -> Column:
            return F.when(i == index, placed(s)).otherwise(F.array(s))

        return F.flatten(F.transform(segs, expand))

    return let(at, insert)


def _structural_escape(value: Column, target: FieldPath, seps: Column) -> Column:
    """Escape the separators that would be structural at ``target`` (raw text keeps its escapes)."""
    depth = len(_levels(target, seps))
    return _escape(value, seps, ("fs", "rs", "cs", "ss")[:depth], escape_escape=False)


def _compute(
    segs: Column, source: FieldPath, target: FieldPath, seps: Column, fn: Callable[[Column], Column], *, each: bool
) -> Column:
    """TARGET := fn(raw text at SOURCE). A missing or empty source, or fn giving NULL, leaves TARGET
    alone; fn giving "" clears it."""

    def result(v: Column) -> Column:
        return F.when(v != "", fn(v))

    def put(s: Column, r: Column) -> Column:
        return F.when(r.isNull(), s).otherwise(
            _write(s, target, _structural_escape(r, target, seps), seps, pad=r != "")
        )

    if each:
        return F.transform(
            segs,
            lambda s: F.when(
                _is_segment(s, target.segment, seps), let(result(_read(s, source, seps)), lambda r: put(s, r))
            ).otherwise(s),
        )
    source_seg = F.try_element_at(segs, _occurrence_index(segs, source, seps) + 1)
    return let(
        result(_read(source_seg, source, seps)), lambda r: _edit_segments(segs, target, seps, lambda s: put(s, r))
    )


def _function(rule: StringFunction | FormatDate, seps: Column) -> Callable[[Column], Column]:
    """The value function of a string or date rule (raw text in, raw text out)."""
    if isinstance(rule, FormatDate):
        pattern = DATE_HL7 if rule.to_format == "hl7" else rule.to_format

        def reformat(v: Column) -> Column:
            out = F.date_format(_parse_datetime(v, rule.from_format), pattern)
            return F.coalesce(out, F.lit("")) if rule.on_error == "clear" else out

        return reformat
    if rule.op == "upper":
        return F.upper  # escape codes (\F\ \S\ \T\ \R\ \E\ \X..\) are upper case already
    if rule.op == "lower":

        def lower(v: Column) -> Column:
            # Literal text sits at even positions between escape characters, codes at odd ones.
            parts = F.split(v, seps["esc_re"], -1)
            return F.array_join(
                F.transform(
                    parts,
                    lambda x, i: (
                        F.when(i == 0, F.lower(x))
                        .when(i % 2 == 0, F.concat(seps["esc"], F.lower(x)))
                        .otherwise(F.concat(seps["esc"], x))
                    ),
                ),
                "",
            )

        return lower
    if rule.op == "substring":
        start, length = rule.args
        return lambda v: F.substring(v, start, _REST if length is None else length)
    if rule.op == "pad":
        length, char, side = rule.args
        padder = F.lpad if side == "left" else F.rpad
        return lambda v: F.when(F.length(v) >= length, v).otherwise(padder(v, length, char))
    pattern, replacement = rule.args
    return lambda v: F.regexp_replace(v, F.lit(pattern), F.lit(replacement))


# HL7 DTM: YYYY[MM[DD[HH[MM[SS[.S[S[S[S]]]]]]]]][+/-ZZZZ]; the offset is not converted (wall time kept).
_HL7_DTM = r"^(\d{4})(\d{2})?(\d{2})?(\d{2})?(\d{2})?(\d{2})?(\.\d{1,4})?([+-]\d{4})?$"


def _parse_datetime(v: Column, fmt: str) -> Column:
    """A timestamp from text in ``fmt`` ("hl7": any DTM precision), NULL when it is not one."""
    if fmt != "hl7":
        return F.try_to_timestamp(v, F.lit(fmt))

    def part(i: int, default: str) -> Column:
        g = F.regexp_extract(v, _HL7_DTM, i)
        return F.when(g != "", g).otherwise(F.lit(default))

    iso = F.concat(
        part(1, ""),
        F.lit("-"),
        part(2, "01"),
        F.lit("-"),
        part(3, "01"),
        F.lit(" "),
        part(4, "00"),
        F.lit(":"),
        part(5, "00"),
        F.lit(":"),
        part(6, "00"),
        part(7, ""),
    )
    return F.when(v.rlike(_HL7_DTM), F.try_to_timestamp(iso, F.lit("yyyy-MM-dd HH:mm:ss[.SSSS]")))


def _concat(rule: Concat, segs: Column, seps: Column) -> Column:
    """TARGET := fields (raw, missing = "") and constants (literal text) in order; "" clears."""
    pieces = []
    for part in rule.parts:
        if isinstance(part, str):
            pieces.append(_constant(F.lit(part), seps, plain=_is_plain(part)))
        else:
            seg = F.try_element_at(segs, _occurrence_index(segs, part, seps) + 1)
            pieces.append(F.coalesce(_structural_escape(_read(seg, part, seps), rule.target, seps), F.lit("")))
    return let(
        F.concat(*pieces),
        lambda v: _edit_segments(segs, rule.target, seps, lambda s: _write(s, rule.target, v, seps, pad=v != "")),
    )


def _generated(rule: Generate, ctx: _Context) -> Column:
    """The transform's time in the rule's format, or a control id: prefix + hex of a hash of
    (message id, destination) — one per message and destination, the same on a re-run."""
    if rule.kind == "timestamp":
        return F.date_format(ctx.now, rule.format)
    digest = F.upper(F.substring(F.sha2(ctx.seed, 256), 1, CONTROL_ID_LENGTH - len(rule.prefix)))
    return F.concat(F.lit(rule.prefix), digest)


def _segment_edit(
    rule: SetField | ClearField | CopyField | MapField, seps: Column, tables: Mapping[str, tuple[Column, bool]]
) -> Callable[[Column], Column]:
    """What a field-level rule does to one segment it applies to."""
    if isinstance(rule, SetField):
        constant = _constant(F.lit(rule.value), seps, plain=_is_plain(rule.value))
        return lambda s: _write(s, rule.path, constant, seps, pad=F.lit(rule.value != ""))
    if isinstance(rule, ClearField):
        return lambda s: _write(s, rule.path, F.lit(""), seps, pad=F.lit(False))
    if isinstance(rule, CopyField):  # each: source and target in the same segment occurrence
        return lambda s: let(
            _copy_value(_read(s, rule.source, seps), rule, seps),
            lambda v: _write(s, rule.target, v, seps, pad=v != ""),
        )
    table, plain_values = tables[rule.table]
    plain = plain_values and _is_plain(rule.default or "")

    def mapped(s: Column) -> Column:
        def with_key(key: Column) -> Column:
            hit = F.try_element_at(table, key)
            new = hit if rule.default is None else F.coalesce(hit, F.lit(rule.default))
            # Absent/empty values are not codes; a miss with default "keep" leaves the value.
            untouched = key.isNull() | (key == "") | new.isNull()
            return F.when(untouched, s).otherwise(
                _write(s, rule.path, _constant(new, seps, plain=plain), seps, pad=F.lit(False))
            )

        return let(_read(s, rule.path, seps), with_key)

    return mapped


def _edit_segments(
    segs: Column,
    path: FieldPath,
    seps: Column,
    edit: Callable[[Column], Column],
    *,
    each: bool = False,
) -> Column:
    """Apply ``edit`` to the segment ``path`` addresses (or, with ``each``, to all of its kind)."""
    if each:
        return F.transform(segs, lambda s: F.when(_is_segment(s, path.segment, seps), edit(s)).otherwise(s))
    # Bound once: referenced inside the lambda it would be recomputed for every segment.
    # A missing occurrence is NULL: i == NULL is never true, so nothing changes.
    return let(
        _occurrence_index(segs, path, seps),
        lambda target: F.transform(segs, lambda s, i: F.when(i == target, edit(s)).otherwise(s)),
    )


def _occurrence_index(segs: Column, path: FieldPath, seps: Column) -> Column:
    """0-based array index of the ``path.occurrence``-th segment named ``path.segment``, or NULL."""
    hits = F.filter(
        F.transform(segs, lambda s, i: F.when(_is_segment(s, path.segment, seps), i)), lambda i: i.isNotNull()
    )
    return F.try_element_at(hits, F.lit(path.occurrence))


def _is_segment(s: Column, name: str, seps: Column) -> Column:
    """A segment is its id alone or its id followed by the field separator ("OBX|..", not "OBXZ")."""
    return (s == F.lit(name)) | s.startswith(F.concat(F.lit(name), seps["fs"]))


def _levels(path: FieldPath, seps: Column) -> list[tuple[Column, Column, int]]:
    """(separator, its regex, 1-based index) per level the path descends through.

    After splitting on the field separator element 1 is the segment id, so field n is element
    n + 1 — except MSH, whose element 2 is already MSH-2. No repetition index on a field-level
    path means the whole field; a component without one lives in the first repetition.
    """
    position = path.field if path.segment == "MSH" else path.field + 1
    levels = [(seps["fs"], seps["fs_re"], position)]
    if path.repetition is not None or path.component is not None:
        levels.append((seps["rs"], seps["rs_re"], path.repetition or 1))
    if path.component is not None:
        levels.append((seps["cs"], seps["cs_re"], path.component))
    if path.subcomponent is not None:
        levels.append((seps["ss"], seps["ss_re"], path.subcomponent))
    return levels


def _read(s: Column, path: FieldPath, seps: Column) -> Column:
    """Raw text at ``path`` in segment ``s`` (escapes kept), NULL if absent."""
    if path.segment == "MSH" and path.field == 1:
        return F.when(s.isNotNull(), seps["fs"])
    if path.segment == "MSH" and path.field == 2:
        return F.when(s.isNotNull(), seps["enc"])
    value = s
    for _sep, sep_re, index in _levels(path, seps):
        value = F.try_element_at(F.split(value, sep_re, -1), F.lit(index))
    return value


def _copy_value(value: Column, rule: CopyField, seps: Column) -> Column:
    """Escape the separators that would be structural at the target; missing source -> ""."""
    value = F.coalesce(value, F.lit(""))
    if rule.source.segment == "MSH" and rule.source.field in (1, 2):
        # The separators themselves: literal text wherever they go.
        return _escape(value, seps, ("fs", "cs", "rs", "ss"), escape_escape=True)
    depth = len(_levels(rule.target, seps))
    return _escape(value, seps, ("fs", "rs", "cs", "ss")[:depth], escape_escape=False)


def _is_plain(text: str) -> bool:
    """Letters, digits and spaces only: no message could use any of them as a separator."""
    return _PLAIN_TEXT.fullmatch(text) is not None


def _constant(value: Column, seps: Column, *, plain: bool) -> Column:
    """A literal text value made safe to write (skipped when it is plain: a smaller plan)."""
    return value if plain else _escape(value, seps, ("fs", "cs", "rs", "ss"), escape_escape=True)


def _escape(value: Column, seps: Column, names: Sequence[str], *, escape_escape: bool) -> Column:
    """Escape the named separators (and the escape char itself) with the message's escape char.

    The escape char goes first, so the escape chars the later replacements insert are not
    escaped again. Without an escape char (MSH-2 shorter than 3) nothing can be escaped.
    """
    esc = seps["esc"]
    out = value
    if escape_escape:
        out = F.replace(out, esc, F.concat(esc, F.lit("E"), esc))
    for name, code in _ESCAPE_CODES:
        if name in names:
            out = F.replace(out, seps[name], F.concat(esc, F.lit(code), esc))
    return F.when(esc == "", value).otherwise(out)


def _write(s: Column, path: FieldPath, value: Column, seps: Column, *, pad: Column) -> Column:
    """Segment ``s`` with the element at ``path`` replaced by ``value`` (already escaped).

    ``pad`` false (clearing, empty copies) leaves a missing element missing instead of creating
    empty trailing fields/components just to hold an empty value.
    """
    return _put(s, _levels(path, seps), value, pad)


def _put(text: Column, levels: Sequence[tuple[Column, Column, int]], value: Column, pad: Column) -> Column:
    """Replace element ``index`` of ``text`` (split on the first level's separator), recursively.

    Works on the text with ``substring_index`` instead of split/transform/join: no lambda per
    level, because Spark's analyzer time grows steeply with the nesting depth of lambdas, and a
    rule chain already nests a few. Only a level with deeper levels below binds its element (LET)
    so the recursion does not copy the expression.
    """
    if not levels:
        return value
    (sep, _sep_re, index), rest = levels[0], levels[1:]

    def put(element: Column) -> Column:
        return _put(element, rest, value, pad)

    def bound(element: Column, build: Callable[[Column], Column]) -> Column:
        return let(element, build) if rest else build(element)

    if index == 1:
        # Element 1 always exists (possibly empty); without the separator it is the whole text.
        first = F.when(sep == "", text).otherwise(F.call_function("substring_index", text, sep, F.lit(1)))
        return bound(first, lambda e: F.concat(put(e), F.substr(text, F.length(e) + 1, F.lit(_REST))))

    separators = F.length(text) - F.length(F.replace(text, sep, F.lit("")))
    prefix = F.call_function("substring_index", text, sep, F.lit(index - 1))  # elements 1 .. index-1
    after = F.substr(text, F.length(prefix) + 2, F.lit(_REST))  # from element `index` on
    element = F.call_function("substring_index", after, sep, F.lit(1))
    replaced = bound(element, lambda e: F.concat(prefix, sep, put(e), F.substr(after, F.length(e) + 1, F.lit(_REST))))
    filler = F.call_function("repeat", sep, F.lit(index - 1) - separators)
    fresh, unaddressable = _fresh(rest, value)
    return (
        # Without this separator (MSH-2 omits it) only element 1 — the whole text — exists.
        F.when(sep == "", text)
        .when(separators >= index - 1, replaced)
        .when(pad & ~unaddressable, F.concat(text, filler, fresh))
        .otherwise(text)
    )


def _fresh(levels: Sequence[tuple[Column, Column, int]], value: Column) -> tuple[Column, Column]:
    """What ``_put`` gives for an empty text (only separators before ``value`` at each level), and
    whether that is impossible because a separator it needs is not declared.

    Spelled out rather than recursing into ``_put``, whose two branches per level would double
    the expression at every level.
    """
    leading = [(sep, index) for sep, _sep_re, index in levels if index > 1]
    if not leading:
        return value, F.lit(False)
    out = F.concat(*(F.call_function("repeat", sep, F.lit(index - 1)) for sep, index in leading), value)
    unaddressable = leading[0][0] == ""
    for sep, _index in leading[1:]:
        unaddressable = unaddressable | (sep == "")
    return out, unaddressable
