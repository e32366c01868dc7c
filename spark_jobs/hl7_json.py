"""HL7 v2 → JSON for ``"output": "json"`` transforms, in native Spark SQL (one VARIANT per value).

JSON output (``"output": "json"``, content type ``application/json``) mirrors the HL7 segment list
one to one, batch envelope included, in order::

    {"segments": [
      {"segment": "MSH", "fields": ["|", "^~\\\\&", "ADT1", ..., [["ADT", "A01", "ADT_A01"]], ...]},
      {"segment": "PID", "fields": ["1", "", [["PATID1234", "", "", "GOOD HEALTH HOSPITAL", "MR"],
                                              ["123456789", "", "", ["USSSA", "2.16.840.1", "ISO"], "SS"]],
                                    ...]}]}

``fields[i - 1]`` is field *i* (for MSH/FHS/BHS, ``fields[0]`` is the field separator and
``fields[1]`` the encoding characters, both as plain strings). A field is a **string** when it has
no repetition, component or subcomponent separator, otherwise an **array of repetitions**; a
repetition is a string, or an array of components when it has component/subcomponent
separators; a component is a string, or an array of subcomponents. The array depth therefore
always tells the level (1 = repetitions, 2 = components, 3 = subcomponents), so ``"A~B"`` ->
``["A", "B"]`` and ``"A^B"`` -> ``[["A", "B"]]`` never collide. Empty fields are ``""`` (positions
are kept); leaves have the separator escapes ``\\F\\ \\S\\ \\T\\ \\R\\ \\E\\`` decoded (JSON has no
separators to protect), other escapes (``\\H\\``, ``\\Xhh\\``...) stay verbatim. The mixed
string/array values are built as Spark VARIANTs and serialised with ``to_json``.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F

from include.transforms_config import HEADER_SEGMENTS
from spark_jobs.hl7_fields import decode_escapes, let

__all__ = ["render_json"]


def render_json(units: Column) -> Column:
    """``{"segments": [...]}`` (module docstring) from the transform engine's parsed payload.

    ``units`` is ``array<struct<message, seps, segments>>`` as :mod:`spark_jobs.transform_rules`
    builds it (``seps`` shaped like :func:`spark_jobs.hl7_fields.parse_message`); NULL stays NULL.
    """
    segments = F.flatten(
        F.transform(
            units,
            lambda u: let(u["seps"], lambda seps: F.transform(u["segments"], lambda s: _segment_json(s, seps))),
        )
    )
    # to_json of a struct holding NULL is "{}": keep "not HL7" NULL.
    return F.when(units.isNotNull(), F.to_json(F.struct(segments.alias("segments"))))


def _segment_json(s: Column, seps: Column) -> Column:
    """``struct<segment: string, fields: variant>`` for one segment (module docstring).

    ``fields`` is one variant array. A segment without any repetition, component, subcomponent
    or escape character converts its fields in one step; building a variant per value is the
    expensive part of JSON output.
    """

    def build(parts: Column) -> Column:
        segment_id = F.element_at(parts, 1)
        header = segment_id.isin(*HEADER_SEGMENTS)
        plain = ~header & ~(
            _has(s, seps["rs"]) | _has(s, seps["cs"]) | _has(s, seps["ss"]) | _has(s, seps["esc"])
        )
        # Header segments: field 1 is the separator itself, field 2 (element 2) the encoding
        # characters, both plain text; their other fields start at element 3.
        lead = F.when(
            header, F.array(seps["fs"].cast("variant"), F.element_at(parts, 2).cast("variant"))
        ).otherwise(F.array().cast("array<variant>"))
        rest = F.slice(parts, F.when(header, 3).otherwise(2), F.size(parts))
        fields = F.when(plain, F.to_variant_object(F.slice(parts, 2, F.size(parts)))).otherwise(
            F.to_variant_object(F.concat(lead, F.transform(rest, lambda f: _field_json(f, seps))))
        )
        return F.struct(segment_id.alias("segment"), fields.alias("fields"))

    return let(F.split(s, seps["fs_re"], -1), build)


def _has(text: Column, sep: Column) -> Column:
    """``text`` contains ``sep`` (a separator MSH-2 omits is never contained)."""
    return (sep != "") & text.contains(sep)


def _field_json(f: Column, seps: Column) -> Column:
    """String, or array of repetitions -> components -> subcomponents, arrays only where present.

    A field with no separator inside (most of them) skips the splitting. Otherwise it is split
    into all three levels at once, leaves decoded by one shared expression, and then a level with
    a single element and nothing below collapses to a string.
    """

    def leaf(x: Column) -> Column:
        return F.when(_has(x, seps["esc"]), decode_escapes(x, seps)).otherwise(x)

    def one(arr: Column) -> Column:
        return F.element_at(arr, 1)

    def component(c: Column) -> Column:
        return F.when(F.size(c) == 1, one(c).cast("variant")).otherwise(F.to_variant_object(c))

    def repetition(r: Column) -> Column:
        return F.when((F.size(r) == 1) & (F.size(one(r)) == 1), one(one(r)).cast("variant")).otherwise(
            F.to_variant_object(F.transform(r, component))
        )

    nested = F.transform(
        F.split(f, seps["rs_re"], -1),
        lambda r: F.transform(
            F.split(r, seps["cs_re"], -1), lambda c: F.transform(F.split(c, seps["ss_re"], -1), leaf)
        ),
    )
    simple = ~(_has(f, seps["rs"]) | _has(f, seps["cs"]) | _has(f, seps["ss"]))
    return F.when(simple, leaf(f).cast("variant")).otherwise(
        F.to_variant_object(F.transform(nested, repetition))
    )
