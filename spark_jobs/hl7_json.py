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
separators to protect), other escapes (``\\H\\``, ``\\Xhh\\``...) stay verbatim. The text is
exactly what ``to_json`` would write for those values (compact, non-ASCII as is).
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column
from pyspark.sql import functions as F

from include.transforms_config import HEADER_SEGMENTS
from spark_jobs.hl7_fields import decode_escapes, let

__all__ = ["render_json"]


# Characters JSON must escape (Jackson, as to_json writes it): control characters, quote, backslash.
_JSON_SPECIAL = r'[\x00-\x1f"\\]'


def render_json(units: Column) -> Column:
    """``{"segments": [...]}`` (module docstring) from the transform engine's parsed payload.

    ``units`` is ``array<struct<message, seps, segments>>`` as :mod:`spark_jobs.transform_rules`
    builds it (``seps`` shaped like :func:`spark_jobs.hl7_fields.parse_message`); NULL stays NULL.

    The JSON text is assembled with string functions: a string value is its text in quotes, and
    only a value holding a character JSON escapes (quote, backslash, control characters — rare
    outside MSH-2 and decoded escapes) goes through ``to_json``. Building a VARIANT per value and
    serialising it was slower (docs/performance.md); the output is the same bytes.
    """
    # One entry per segment: its fields split once, whether any of it needs JSON escaping, whether
    # it has structure below the field, and its unit's separators — copied once per unit out of
    # Spark's binary row, where every read of a field costs a configuration lookup (Spark 4.2).
    entries = F.flatten(
        F.transform(
            units,
            lambda u: let(
                _separators(u["seps"]),
                lambda seps: F.transform(
                    u["segments"],
                    lambda s: F.struct(
                        F.split(s, seps["fs_re"], -1).alias("parts"),
                        s.rlike(_JSON_SPECIAL).alias("special"),
                        F.coalesce(
                            _has(s, seps["rs"]) | _has(s, seps["cs"]) | _has(s, seps["ss"]) | _has(s, seps["esc"]),
                            F.lit(False),
                        ).alias("structured"),
                        seps.alias("seps"),
                    ),
                ),
            ),
        )
    )
    # NULL units (not HL7) give NULL.
    return F.concat(F.lit('{"segments":['), F.array_join(F.transform(entries, _segment_json), ","), F.lit("]}"))


def _separators(seps: Column) -> Column:
    """The unit's separators, a separator MSH-2 omits NULL rather than "" (so ``contains`` alone
    tells whether text has it: NULL is never true), and the split regexes."""
    return F.struct(
        *(F.nullif(seps[name], F.lit("")).alias(name) for name in ("fs", "cs", "rs", "esc", "ss")),
        *(seps[name].alias(name) for name in ("fs_re", "cs_re", "rs_re", "ss_re", "esc_re")),
    )


def _segment_json(entry: Column) -> Column:
    """``{"segment":"<id>","fields":[...]}`` for one segment (module docstring).

    A segment without any repetition, component, subcomponent or escape character, nor a character
    JSON escapes, is its fields joined with ``","``: no value is looked at on its own.
    """
    parts, seps, special = entry["parts"], entry["seps"], entry["special"]
    segment_id = F.element_at(parts, 1)
    header = segment_id.isin(*HEADER_SEGMENTS)
    count = F.size(parts)
    joined = F.when(count > 1, F.concat(F.lit('"'), F.array_join(F.slice(parts, 2, count), '","'), F.lit('"')))
    # Header segments: field 1 is the separator itself, field 2 (element 2) the encoding
    # characters, both plain text; their other fields start at element 3.
    lead = F.when(header, F.array(_quote(seps["fs"]), _quote(F.element_at(parts, 2)))).otherwise(
        F.array().cast("array<string>")
    )
    rest = F.slice(parts, F.when(header, 3).otherwise(2), count)
    fields = F.when(~header & ~entry["structured"] & ~special, F.coalesce(joined, F.lit(""))).otherwise(
        F.concat_ws(",", lead, F.transform(rest, lambda f: _field_json(f, seps, special)))
    )
    return F.concat(F.lit('{"segment":'), _quote(segment_id), F.lit(',"fields":['), fields, F.lit("]}"))


def _has(text: Column, sep: Column) -> Column:
    """``text`` contains ``sep``; NULL, never true, for a separator MSH-2 omits (see ``_separators``):
    only ever tested by ``when``, where NULL counts as false."""
    return text.contains(sep)


def _quote(x: Column) -> Column:
    """A JSON string: the text in quotes, or ``to_json``'s escaping when it holds a special character."""
    return F.when(x.rlike(_JSON_SPECIAL), _escaped(x)).otherwise(F.concat(F.lit('"'), x, F.lit('"')))


def _escaped(x: Column) -> Column:
    """``to_json``'s quoted and escaped string: ``["..."]`` without its brackets (the quotes inside
    them stop the trim)."""
    return F.call_function("btrim", F.to_json(F.array(x)), F.lit("[]"))


def _field_json(f: Column, seps: Column, special: Column) -> Column:
    """String, or array of repetitions -> components -> subcomponents, arrays only where present:
    a level with a single element and nothing below is a string, not an array.

    A field without escapes in a segment without characters JSON escapes (nearly all of them)
    is built from its text with splits and replaces, no value looked at on its own; only the rest
    goes value by value, decoding escapes and escaping for JSON.
    """

    def has(text: Column, name: str) -> Column:
        return _has(text, seps[name])

    def quoted(x: Column) -> Column:
        return F.concat(F.lit('"'), x, F.lit('"'))

    def array(items: Column, item: Callable[[Column], Column]) -> Column:
        return F.concat(F.lit("["), F.array_join(F.transform(items, item), ","), F.lit("]"))

    def component(c: Column) -> Column:
        return F.when(
            has(c, "ss"), F.concat(F.lit('["'), F.replace(c, seps["ss"], F.lit('","')), F.lit('"]'))
        ).otherwise(quoted(c))

    def repetition(r: Column) -> Column:
        return F.when(has(r, "cs") | has(r, "ss"), array(F.split(r, seps["cs_re"], -1), component)).otherwise(quoted(r))

    structured = has(f, "rs") | has(f, "cs") | has(f, "ss")
    plain = F.when(structured, array(F.split(f, seps["rs_re"], -1), repetition)).otherwise(quoted(f))
    return F.when(special | has(f, "esc"), _field_by_value(f, seps, structured)).otherwise(plain)


def _field_by_value(f: Column, seps: Column, structured: Column) -> Column:
    """The same JSON as the plain path, each value decoded (separator escapes) and escaped for JSON.

    Every level is split (a single element stays a string: ``[`` and ``]`` only around a level
    that has the separator or one below it), so the value code appears once in the plan.
    """

    def level(text: Column, nested: Column, sep_re: str, item: Callable[[Column], Column]) -> Column:
        joined = F.array_join(F.transform(F.split(text, seps[sep_re], -1), item), ",")
        return F.concat_ws("", F.when(nested, F.lit("[")), joined, F.when(nested, F.lit("]")))

    def value(x: Column) -> Column:
        return F.when(_has(x, seps["esc"]), _escaped(decode_escapes(x, seps))).otherwise(_quote(x))

    def component(c: Column) -> Column:
        return level(c, _has(c, seps["ss"]), "ss_re", value)

    def repetition(r: Column) -> Column:
        return level(r, _has(r, seps["cs"]) | _has(r, seps["ss"]), "cs_re", component)

    return level(f, structured, "rs_re", repetition)
