"""Conditions as boolean Columns, in native Spark SQL: the one compiler behind a route's `when` and a
transform rule's `when` (the grammar: :mod:`include.conditions`, reference: docs/rules.md).

A condition is compiled over one message given as its segment array and its separators — the
``parse_message`` struct of :mod:`spark_jobs.hl7_fields` for the route stage, a message unit of
:mod:`spark_jobs.transform_rules` (its segments as the earlier rules left them) for a transform —
plus the inbound connection's name. Values are read exactly as :func:`spark_jobs.hl7_fields.extract`
reads them (raw text, missing and empty both absent); a leaf on an absent value is false, never
NULL, so ``not`` and ``any`` mean what they say. Quantifiers run as ``exists``/``forall`` over the
matching segments or the field's repetitions: no Python, no explode.

A FHIR leaf (routes only) reads the raw message instead: the resources it holds (itself, and a
Bundle's entries) as JSON text with ``from_json``, each element of the path with
``get_json_object``, every array along the path walked with ``exists`` — still no Python.
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column
from pyspark.sql import functions as F

from include.conditions import AllOf, Condition, Connection, FhirLeaf, Findings, Leaf, Not, SegmentPresent
from include.hl7path import FieldPath
from spark_jobs.hl7_fields import let

__all__ = ["compile_condition", "is_segment"]


def compile_condition(
    cond: Condition,
    segments: Column,
    seps: Column,
    connection: Column | None = None,
    payload: Column | None = None,
    findings: Column | None = None,
) -> Column:
    """A never-NULL boolean Column: does the message (``segments``, ``seps``) satisfy ``cond``?

    ``seps`` is any struct with ``fs`` and the split regexes ``fs_re rs_re cs_re ss_re``; ``fs``
    empty means "not HL7" (every leaf false). ``connection`` is needed only by connection leaves,
    ``payload`` (the raw message) only by FHIR leaves, ``findings`` (the stored profile findings'
    JSON, NULL for none) only by findings leaves.
    """
    if isinstance(cond, Leaf):
        return F.when(seps["fs"] != "", _leaf(cond, segments, seps)).otherwise(F.lit(False))
    if isinstance(cond, SegmentPresent):
        found = F.exists(segments, lambda s: is_segment(s, cond.segment, seps["fs"]))
        return F.coalesce(F.when(seps["fs"] != "", found), F.lit(False))
    if isinstance(cond, Connection):
        if connection is None:
            raise ValueError("a connection condition needs the inbound connection column")
        if cond.op == "eq":
            test = connection == F.lit(cond.value)
        elif cond.op == "in":
            test = connection.isin(list(cond.value))
        else:
            test = connection.rlike(str(cond.value))
        return F.coalesce(test, F.lit(False))
    if isinstance(cond, FhirLeaf):
        if payload is None:
            raise ValueError("a fhir condition needs the raw message column")
        return F.coalesce(_fhir_leaf(cond, payload), F.lit(False))
    if isinstance(cond, Findings):
        if findings is None:
            raise ValueError("a findings condition needs the findings column")
        return _findings(cond, findings)
    if isinstance(cond, Not):
        return ~compile_condition(cond.condition, segments, seps, connection, payload, findings)
    members = [compile_condition(c, segments, seps, connection, payload, findings) for c in cond.conditions]
    combined = members[0]
    for member in members[1:]:
        combined = (combined & member) if isinstance(cond, AllOf) else (combined | member)
    return combined


FINDINGS_TYPE = "array<struct<code:string,where:string,text:string,total:int,codes:array<string>>>"
"""The stored findings' JSON (`include.profiles.check.findings_json`) as Spark reads it: the first
of more than the stored ones carries ``total`` and ``codes``, which say what all of them were."""


def _findings(cond: Findings, stored: Column) -> Column:
    """Count or codes of the findings JSON, natively (`from_json`); NULL (none found) is empty.
    The count is the stored ``total`` when there is one (more than were kept), else the list's size;
    a code is found in a kept finding or in the ``codes`` of all of them."""
    found = F.coalesce(F.from_json(stored, FINDINGS_TYPE), F.array().cast(FINDINGS_TYPE))
    if cond.codes:
        wanted = F.array(*(F.lit(c) for c in cond.codes))

        def has(f: Column) -> Column:
            return f["code"].isin(list(cond.codes)) | F.coalesce(F.arrays_overlap(f["codes"], wanted), F.lit(False))

        return F.coalesce(F.exists(found, has), F.lit(False))
    total = F.array_max(F.transform(found, lambda f: f["total"]))
    n, k = F.greatest(F.size(found), F.coalesce(total, F.lit(0))), F.lit(cond.count)
    test = {"eq": n == k, "ne": n != k, "gt": n > k, "ge": n >= k, "lt": n < k, "le": n <= k}[cond.op]
    return F.coalesce(test, F.lit(False))


def is_segment(s: Column, name: str, fs: Column) -> Column:
    """A segment is its id alone or its id followed by the field separator ("OBX|..", not "OBXZ")."""
    return (s == F.lit(name)) | s.startswith(F.concat(F.lit(name), fs))


def _quantified(quantifier: str, items: Column, test: Callable[[Column], Column]) -> Column:
    """``any``: at least one item passes; ``all``: at least one item exists and every one passes."""
    if quantifier == "any":
        return F.coalesce(F.exists(items, test), F.lit(False))
    return F.coalesce((F.size(items) > 0) & F.forall(items, test), F.lit(False))


_RESOURCES = "struct<resourceType:string,entry:array<struct<resource:string>>>"


def fhir_resources(payload: Column) -> Column:
    """The FHIR resources a message holds, as JSON text: the message itself and, for a Bundle, each
    entry's resource; empty for anything that is not a JSON object (an HL7 v2 message)."""
    empty = F.array().cast("array<string>")
    no_entries = F.array().cast("array<struct<resource:string>>")

    def held(top: Column) -> Column:
        entries = F.transform(F.coalesce(top["entry"], no_entries), lambda e: e["resource"])
        own = F.when(top["resourceType"] == "Bundle", F.concat(F.array(payload), entries)).otherwise(F.array(payload))
        return F.when(top["resourceType"].isNotNull(), own).otherwise(empty)

    # An HL7 v2 message is told apart by its first character (after JSON's white space), before
    # any JSON is parsed.
    opening = F.ltrim(F.translate(F.substring(payload, 1, 64), "\t\r\n", "   "))
    return F.when(opening.startswith("{"), let(F.from_json(payload, _RESOURCES), held)).otherwise(empty)


def _fhir_leaf(cond: FhirLeaf, payload: Column) -> Column:
    test = _test(cond)

    def values_pass(node: Column, elements: tuple[str, ...]) -> Column:
        """Some value at `elements` below `node` (JSON text) passes: an array at any step is
        walked (`$.e[0]` tells a JSON array from a string that only starts with "[")."""
        if not elements:
            return test(node)
        step = f"$.{elements[0]}"
        value = F.get_json_object(node, step)
        is_array = value.startswith("[") & F.get_json_object(node, f"{step}[0]").isNotNull()
        items = F.when(is_array, F.from_json(value, "array<string>")).otherwise(F.array(value))
        return F.coalesce(F.exists(items, lambda item: values_pass(item, elements[1:])), F.lit(False))

    def matches(resource: Column) -> Column:
        typed = F.get_json_object(resource, "$.resourceType") == F.lit(cond.resource_type)
        if not cond.elements:
            return F.coalesce(typed, F.lit(False))
        return F.coalesce(typed, F.lit(False)) & values_pass(resource, cond.elements)

    return F.exists(fhir_resources(payload), matches)


def _test(cond: Leaf | FhirLeaf) -> Callable[[Column], Column]:
    """The leaf's operator over one raw value (empty counts as absent); never NULL."""

    def test(raw: Column) -> Column:
        def on(v: Column) -> Column:
            if cond.op == "eq":
                result = v == F.lit(cond.value)
            elif cond.op == "ne":
                result = v != F.lit(cond.value)
            elif cond.op == "in":
                result = v.isin(list(cond.value or ()))
            elif cond.op == "regex":
                result = v.rlike(str(cond.value))
            else:
                result = v.isNotNull()
            return F.coalesce(F.when(v != "", result), F.lit(False))

        return on(raw)

    return test


def _descend(repetition: Column, path: FieldPath, seps: Column) -> Column:
    """Component / subcomponent of one repetition's raw text (the repetition itself if none)."""
    value = repetition
    if path.component is not None:
        value = F.try_element_at(F.split(value, seps["cs_re"], -1), F.lit(path.component))
        if path.subcomponent is not None:
            value = F.try_element_at(F.split(value, seps["ss_re"], -1), F.lit(path.subcomponent))
    return value


def _leaf(cond: Leaf, segments: Column, seps: Column) -> Column:
    path = cond.path
    test = _test(cond)

    def in_segment(seg: Column) -> Column:
        if path.segment == "MSH" and path.field == 1:
            return test(F.substring(seg, 4, 1))
        position = path.field if path.segment == "MSH" else path.field + 1
        field = F.try_element_at(F.split(seg, seps["fs_re"], -1), F.lit(position))
        if path.segment == "MSH" and path.field == 2:
            return test(field)
        if cond.repetitions is not None:
            return _quantified(
                cond.repetitions, F.split(field, seps["rs_re"], -1), lambda rep: test(_descend(rep, path, seps))
            )
        rep = F.try_element_at(F.split(field, seps["rs_re"], -1), F.lit(path.repetition or 1))
        return test(_descend(rep, path, seps))

    matching = F.filter(segments, lambda s: is_segment(s, path.segment, seps["fs"]))
    if cond.segments is not None:
        return _quantified(cond.segments, matching, in_segment)
    return let(F.try_element_at(matching, F.lit(path.occurrence)), in_segment)
