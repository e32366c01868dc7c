"""Extract HL7 v2 values from raw message strings with native Spark SQL functions.

Stage jobs route and transform on header and patient fields. Parsing every message into a
Python object (or calling a Python UDF per row) would move each payload through a Python
worker; everything here is built from Spark's own ``split`` / ``filter`` / ``try_element_at``,
so it runs inside the JVM (classic or Spark Connect) and is safe under ANSI mode.

Path grammar (indices are 1-based, as in the HL7 standard)::

    path         := segment [ "[" occurrence "]" ] "-" field [ "[" repetition "]" ]
                    [ "." component [ "." subcomponent ] ]
    segment      := uppercase letter, then two uppercase letters or digits  (MSH, PID, PV1, ZPD)
    occurrence, field, repetition, component, subcomponent := integer >= 1

    MSH-9.1     component 1 of field 9 of the first MSH
    PV1-2       field 2 of PV1 (first repetition, components left intact)
    PID-3[2].1  component 1 of the second repetition of PID-3
    PID-3.1.2   subcomponent 2 of component 1 of PID-3
    OBX[2]-5    field 5 of the second OBX segment

Semantics:

* Separators come from each message's own header: the field separator is the character after
  ``MSH``; MSH-2 gives component, repetition, escape and subcomponent separators, in that
  order. A separator MSH-2 omits is simply never split on.
* MSH-1 is the field separator and MSH-2 the encoding characters, so for MSH the field number
  is the HL7 one (MSH-3 is the sending application), not the position after splitting.
  MSH-1 and MSH-2 take no repetition or component index.
* Segments end with CR; LF and CRLF are tolerated. The message must start with ``MSH``
  (leading CR/LF are ignored); otherwise every path yields NULL.
* Without a repetition index the first repetition is used. A path that stops at the field or
  component level returns that element's raw text, inner separators included
  (``MSH-9`` -> ``ADT^A01^ADT_A01``). python-hl7 and HAPI's Terser instead descend to the
  first leaf (``ADT``); spell out ``.1`` for that.
* A missing segment, field, repetition, component or subcomponent and an empty value are
  both NULL, never ``""``: HL7 treats an empty field as "not present", and one NULL rule
  keeps ``exists`` and ``eq`` conditions simple. HL7's explicit null ``""`` (two double
  quotes) is returned verbatim.
* Escape sequences (``\\F\\``, ``\\S\\``, ...) are text, never split on, and are returned
  as-is unless ``unescape=True`` decodes the separator escapes of the selected value.
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column
from pyspark.sql import functions as F

from include.hl7path import FieldPath, FieldPathError, parse_path

__all__ = [
    "FieldPath",
    "FieldPathError",
    "decode_escapes",
    "extract",
    "field",
    "let",
    "parse_message",
    "parse_path",
    "with_message",
]

# Header: optional leading line breaks, "MSH", the field separator, MSH-2 up to the next field
# separator (or end of line). Group 1 = field separator, group 2 = encoding characters.
_HEADER_RE = r"^[\r\n]*MSH([^\r\n])([^\r\n]*?)(?:\1|[\r\n]|$)"
# A regex no string matches: splitting on it returns the input unchanged.
_NEVER_MATCHES = "(?!)"
# Separators that a bare backslash would not quote in a Java regex.
_ALPHANUMERIC = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
# MSH-2 order: component, repetition, escape, subcomponent.
_ENCODING_ORDER = ("cs", "rs", "esc", "ss")


def parse_message(message_col: Column | str) -> Column:
    """Split a raw message once into its separators and segments, for several extractions.

    Returns ``struct<fs, cs, rs, esc, ss, fs_re, cs_re, rs_re, esc_re, ss_re: string,
    segments: array<string>>``; a separator MSH-2 omits is ``""`` and its ``*_re`` never
    matches. Use through :func:`with_message` so the work is done once per row.
    """
    msg = F.col(message_col) if isinstance(message_col, str) else message_col
    header = F.struct(
        F.regexp_extract(msg, _HEADER_RE, 1).alias("fs"),
        F.regexp_extract(msg, _HEADER_RE, 2).alias("enc"),
    )

    def build(h: Column) -> Column:
        seps = {"fs": h["fs"]}
        seps.update((name, F.substring(h["enc"], i, 1)) for i, name in enumerate(_ENCODING_ORDER, start=1))
        return F.struct(
            *(sep.alias(name) for name, sep in seps.items()),
            *(split_regex(sep).alias(f"{name}_re") for name, sep in seps.items()),
            split_segments(msg).alias("segments"),
        )

    return let(header, build)


def with_message(message_col: Column | str, body: Callable[[Column], Column]) -> Column:
    """Parse each message once and build ``body(parsed)`` from it (any number of :func:`extract`).

    Spark has no LET: a parsed struct referenced by ten extractions would otherwise be
    recomputed (or inlined by the optimizer) ten times, each splitting the whole message.
    """
    return let(parse_message(message_col), body)


def extract(parsed: Column, path: str | FieldPath, *, unescape: bool = False) -> Column:
    """Like :func:`field`, over a :func:`parse_message` struct (e.g. inside :func:`with_message`)."""
    fp = path if isinstance(path, FieldPath) else parse_path(path)
    name = F.lit(fp.segment)
    # A segment is its id alone or its id followed by the field separator ("OBX|..."), not "OBXZ".
    matching = F.filter(parsed["segments"], lambda s: (s == name) | s.startswith(F.concat(name, parsed["fs"])))
    segment = F.try_element_at(matching, F.lit(fp.occurrence))

    if fp.segment == "MSH" and fp.field == 1:
        value = F.substring(segment, 4, 1)
    else:
        # After splitting, element 1 is the segment id; for MSH element 2 is already MSH-2.
        position = fp.field if fp.segment == "MSH" else fp.field + 1
        value = F.try_element_at(F.split(segment, parsed["fs_re"], -1), F.lit(position))
        if not (fp.segment == "MSH" and fp.field == 2):
            value = F.try_element_at(F.split(value, parsed["rs_re"], -1), F.lit(fp.repetition or 1))
            if fp.component is not None:
                value = F.try_element_at(F.split(value, parsed["cs_re"], -1), F.lit(fp.component))
                if fp.subcomponent is not None:
                    value = F.try_element_at(F.split(value, parsed["ss_re"], -1), F.lit(fp.subcomponent))
    if unescape:
        value = decode_escapes(value, parsed)
    # No header means no separators to trust: NULL rather than a guess. Empty -> NULL.
    return F.when(parsed["fs"] != "", let(value, lambda v: F.when(v != "", v)))


def field(message_col: Column | str, path: str | FieldPath, *, unescape: bool = False) -> Column:
    """Return a string Column with the value at ``path`` in each raw HL7 message (NULL if absent).

    :param message_col: column (or column name) holding the raw message text.
    :param path: an HL7 path, see the module docstring; parsed eagerly so bad paths fail here.
    :param unescape: decode ``\\F\\ \\S\\ \\T\\ \\R\\ \\E\\`` in the selected value; other
        escapes (``\\H\\``, ``\\Xhh\\``, ...) are kept verbatim. Only meaningful on leaves:
        a decoded ``^`` is indistinguishable from a component separator.

    For several fields of one message prefer ``with_message(col, lambda m: ... extract(m, p) ...)``,
    which splits the message once.
    """
    fp = path if isinstance(path, FieldPath) else parse_path(path)
    return with_message(message_col, lambda m: extract(m, fp, unescape=unescape))


def let(value: Column, body: Callable[[Column], Column]) -> Column:
    """Evaluate ``value`` once per row and hand it to ``body`` as a lambda variable (Spark has no
    LET; the transform engine and the JSON renderer bind their intermediate values with it too)."""
    return F.try_element_at(F.transform(F.array(value), body), F.lit(1))


def split_regex(sep: Column) -> Column:
    """A regex matching exactly the one-character separator ``sep`` (never matching if absent).

    ``split`` runs Java's ``String.split``, which compiles the regex on every call unless it is a
    backslash plus one non-alphanumeric character; such a pair is always a literal in Java regex
    and HL7 separators are punctuation, so this is both safe and the fast path (a compiled
    ``\\Q..\\E`` per split was a large share of the route job's time: docs/performance.md). An
    alphanumeric separator falls back to ``\\Q..\\E`` quoting.
    """
    return (
        F.when(sep == "", F.lit(_NEVER_MATCHES))
        .when(F.lit(_ALPHANUMERIC).contains(sep), F.concat(F.lit(r"\Q"), sep, F.lit(r"\E")))
        .otherwise(F.concat(F.lit("\\"), sep))
    )


def split_segments(text: Column) -> Column:
    """Segments of a message: CR per the standard, LF and CRLF tolerated (blank ones kept).

    Line endings are normalised with two plain replaces, then split on the one literal CR: the
    same pieces as a split on ``\\r\\n?|\\n``, without compiling that regex for every row.
    """
    return F.split(F.replace(F.replace(text, F.lit("\r\n"), F.lit("\r")), F.lit("\n"), F.lit("\r")), "\r", -1)


def decode_escapes(value: Column, parsed: Column) -> Column:
    """Decode the separator escapes of ``value`` (``parsed``: any struct with ``fs cs rs ss esc esc_re``)
    in one left-to-right pass; public because the JSON renderer decodes its leaves the same way.

    Splitting on the escape character puts literal text at even positions and escape codes at
    odd ones, so ``\\E\\F\\E\\`` decodes to the literal ``\\F\\``, where chained replaces would
    first turn its middle ``\\F\\`` into a field separator.
    An unterminated escape (the last odd element) and unknown codes are kept verbatim.
    """
    esc = parsed["esc"]
    codes = {"F": parsed["fs"], "S": parsed["cs"], "R": parsed["rs"], "T": parsed["ss"], "E": esc}

    def decoded(pieces: Column) -> Column:
        # The pieces are bound once: the last piece's index read inside the lambda from a fresh
        # split re-split the value for every escape, quadratic in a field's escapes (16,000 took
        # 37 s of the stage's one task; a hostile sender controls that count).
        last = F.size(pieces) - 1

        def piece(x: Column, i: Column) -> Column:
            out = F.when(i % 2 == 0, x).when(i == last, F.concat(esc, x))
            for code, sep in codes.items():
                # An escape for a separator this message does not define stays verbatim.
                out = out.when((x == code) & (sep != ""), sep)
            return out.otherwise(F.concat(esc, x, esc))

        return F.array_join(F.transform(pieces, piece), "")

    return let(F.split(value, parsed["esc_re"], -1), decoded)
