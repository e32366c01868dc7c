"""HL7 v2 → FHIR R4 transaction Bundle for ``output = "fhir-r4"`` transforms, in native Spark SQL.

Which resources a message becomes (the mapping tables per message type: docs/rules.md):

* ADT^A01 / A04 / A08 → Patient (PID; each NK1 one of its contacts), and an Encounter (PV1) when
  the message has a PV1;
* ORU^R01 → a Patient per PID (each PATIENT_RESULT group), one DiagnosticReport per OBR, one
  Observation per OBX (each OBX reports to the OBR before it in its group; the NTE right after it
  are its notes), every resource referring to its group's Patient;
* ORM^O01 → a Patient per PID, one ServiceRequest per OBR (with the ORC before it in its group;
  the NTE right after the OBR are its notes), each referring to its group's Patient.

A segment's patient group is the PID before it (what precedes the first PID is the first
patient's, unless there are several: then the message is refused).

Data types follow HL7's *V2 to FHIR* IG: XPN → HumanName, CX → Identifier (its system from the
assigning authority, ``[transform.fhir] identifier_systems``), XAD → Address, XTN → ContactPoint,
TS/DTM → dateTime (an offset is always written: the value's own, else ``timezone``), CWE/CE →
CodeableConcept (systems from ``code_systems``), OBX-5 by OBX-2 → valueQuantity (NM, SN),
valueCodeableConcept (CWE, CE, CNE), valueDateTime (DT, DTM, TS) or valueString (the rest).

Idempotent delivery: every entry is a conditional write keyed on an identifier, so a re-delivery of
the Bundle updates what the first one created instead of adding to it: ``PUT
Patient?identifier=system|value`` on the first PID-3 whose authority has a system (a patient
without one is a plain POST, and a re-delivery duplicates it — configure the systems). Encounters,
reports, observations and orders carry a Stageline identifier (``urn:ietf:rfc:3986``, a UUID from
the identity of their patient group — MSH-3, MSH-4, MSH-7, MSH-10, that group's PID-3 — and the
segment's number among its kind within that group) besides
their own, and are PUT on it. Each entry's
``fullUrl`` is a UUID derived from the message id and the entry, so references resolve inside the
Bundle and a re-run of the transform builds the same bytes.

How it runs: each used segment of the transform engine's parsed payload (its units, after the
destination's rules) is split into its fields once per message, with the separator escapes resolved
before the split (:func:`_split_unit`); a field is split into repetitions, components and
subcomponents only where the mapping reads it, and only the leaves it reads are decoded. The
resources are ``to_json`` of structs built from them. No Python runs per row. A message the
mapping cannot take (another message type, a batch of several messages, an ADT with several PIDs,
results or an order without a patient or before the first of several, two groups with one PID-3 or
sharing an identifier, more than :data:`MAX_PATIENTS` groups, a segment id that is a mapped one only
once trimmed or upper-cased, two entries on one identifier) comes out with a NULL Bundle and the reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from pyspark.sql import Column
from pyspark.sql import functions as F

from include.fhir_options import FhirOptions
from spark_jobs.hl7_fields import let

__all__ = ["ENTRY_PARTS", "fhir_bundle", "fhir_context", "fhir_entries"]

# Segments the mapping reads; the others are not cut into trees.
_USED = ("MSH", "PID", "PV1", "NK1", "ORC", "OBR", "OBX", "NTE")
_ADT_EVENTS = ("A01", "A04", "A08")
_STAGELINE_SYSTEM = "urn:ietf:rfc:3986"
_V2_0203 = "http://terminology.hl7.org/CodeSystem/v2-0203"
_V2_0078 = "http://terminology.hl7.org/CodeSystem/v2-0078"
_V2_0004 = "http://terminology.hl7.org/CodeSystem/v2-0004"
_ACT_CODE = "http://terminology.hl7.org/CodeSystem/v3-ActCode"
_NULL_FLAVOR = "http://terminology.hl7.org/CodeSystem/v3-NullFlavor"

# Fixed v2 → FHIR vocabularies (the IG's ConceptMaps); the site-specific ones are FhirOptions.
_NAME_USE = {"L": "official", "D": "usual", "M": "maiden", "N": "nickname", "A": "usual", "S": "anonymous"}
_NAME_USE.update({"T": "temp", "B": "official", "C": "official"})
_ADDRESS_USE = {"H": "home", "B": "work", "O": "work", "C": "temp", "BA": "old", "BI": "billing"}
_OBSERVATION_STATUS = {"C": "corrected", "D": "entered-in-error", "F": "final", "I": "registered", "P": "preliminary"}
_OBSERVATION_STATUS.update({"R": "preliminary", "S": "preliminary", "U": "final", "W": "entered-in-error"})
_OBSERVATION_STATUS.update({"X": "cancelled", "O": "registered"})
_REPORT_STATUS = {"O": "registered", "I": "registered", "S": "partial", "A": "partial", "P": "preliminary"}
_REPORT_STATUS.update({"C": "corrected", "R": "partial", "F": "final", "X": "cancelled", "M": "partial"})
# ORC-5 (order status, table 0038) first, else ORC-1 (order control, table 0119).
_ORDER_STATUS = {"A": "active", "IP": "active", "SC": "active", "CA": "revoked", "DC": "revoked"}
_ORDER_STATUS.update({"CM": "completed", "HD": "on-hold", "ER": "entered-in-error", "RP": "revoked"})
_ORDER_CONTROL = {"NW": "active", "XO": "active", "SC": "active", "OK": "active", "CA": "revoked", "OC": "revoked"}
_ORDER_CONTROL.update({"DC": "revoked", "HD": "on-hold", "RL": "active", "CM": "completed"})
_PRIORITY = {"S": "stat", "A": "asap", "R": "routine", "T": "urgent", "P": "routine"}
_COMPARATORS = ("<", "<=", ">", ">=")
_CODED_TYPES = ("CWE", "CE", "CNE", "CF")
_DATE_TYPES = ("DT", "DTM", "TS")

# A decimal as HL7 NM writes it (sign, digits, point) with at most 18 digits, what FHIR asks every
# reader to hold (a longer one is text: JSON readers turn 800 digits into infinity); JSON wants no
# '+', no bare '.', no leading 0s.
_NUMBER = r"^[+-]?(?!(?:\.?\d){19})(\d+\.?\d*|\.\d+)$"
# TS/DTM: digits (4 to 14, even; no year 0000, which FHIR has not), optional fraction of a second,
# optional offset (at most 14 hours, as FHIR's).
_DTM = r"^(?!0000)(\d{4}|\d{6}|\d{8}|\d{10}|\d{12}|\d{14})(\.\d{1,4})?([+-](?:(?:0\d|1[0-3])[0-5]\d|1400))?$"
# Whitespace as FHIR's code grammar means it ([^\s]+( [^\s]+)*): around a code it is trimmed, inside
# one a run of it becomes one space.
_SPACE = r"[ \t\n\x0B\f\r]"


ENTRY_PARTS = ("patients", "encounter", "reports", "observations", "orders")
"""The columns of step 2, in Bundle order (each an entry's JSON, or an array of them)."""


def fhir_context(units: Column, seed: Column) -> Column:
    """Step 1: the message's segments grouped for the mapping, and why it cannot be mapped.

    ``struct<kind, event, patients, pv1, obr, obx, orc, sp, error>`` (each segment its fields; a
    patient its PID, fullUrl, identity and NK1; each OBR, OBX and ORC the number of its patient's
    group, the OBR and OBX that patient's fullUrl; the OBX their report's number and fullUrl, ``sp``
    how to split and decode a field); ``units`` is the transform engine's parsed payload
    (:mod:`spark_jobs.transform_rules`), ``seed`` a string unique per message and destination. NULL
    ``units`` (not HL7) give NULL. The mapping runs as three projections — this context, the
    entries (:func:`fhir_entries`), the Bundle (:func:`fhir_bundle`) — because Spark Connect refuses
    an expression nested deeper than its protobuf limit, and the whole mapping in one expression is
    deeper than that.
    """
    messages = F.filter(units, lambda u: u["message"])
    # The unit is bound inside _split_unit's argument, not around the rest: each binding a lambda
    # deeper, and the deepest path (an OBR's notes) is at Spark Connect's limit.
    single = let(_split_unit(F.element_at(messages, 1)), lambda t: _context(t, seed, t["seps"]))
    several = F.lit(
        "fhir-r4: a batch of several messages cannot be one Bundle; split the batch before this destination"
    )
    misnamed = F.exists(
        F.element_at(messages, 1)["segments"],
        lambda s: ~F.substring(s, 1, 3).isin(*_USED) & F.upper(F.regexp_extract(s, _LOOSE_ID, 1)).isin(*_USED),
    )
    return F.when(
        units.isNotNull(),
        F.when(F.size(messages) != 1, _refused(several)).when(misnamed, _refused(F.lit(_MISNAMED))).otherwise(single),
    )


# A segment id after whitespace or a byte-order mark, in any case: written so, a PID (or OBX...) is no
# segment of the mapping's, and guessing that it is one would file results under the wrong patient.
_LOOSE_ID = r"^[\s\x{FEFF}]*([A-Za-z0-9]{3})(?:[^A-Za-z0-9]|$)"
_MISNAMED = (
    "fhir-r4: a segment whose id is a mapped segment's (PID, OBR, OBX, ORC, NK1, PV1, NTE, MSH) only once "
    "trimmed of whitespace or upper-cased: fix the sender's segment ids (no space, tab or byte-order mark "
    "before them, upper case)"
)


def fhir_entries(ctx: Column, seed: Column, options: FhirOptions) -> dict[str, Column]:
    """Step 2: the Bundle's entries under one destination's ``options``, named as :data:`ENTRY_PARTS`."""
    # The context arrives as Spark's binary row (the previous projection's output), where every
    # field read inside a lambda looks its type's accessor up afresh (a configuration lookup each,
    # Spark 4.2); the mapping reads ``sp`` at every leaf, so each part reads an in-memory copy of
    # the fields it needs.
    sp = F.struct(*(ctx["sp"][name].alias(name) for name in _SP_FIELDS))

    def part(names: str, body: Callable[[Column, _Maps], Column]) -> Column:
        return let(
            F.struct(sp.alias("sp"), *(ctx[n].alias(n) for n in names.split())),
            lambda m: body(m, _Maps(options, m["sp"])),
        )

    def kind(test: Callable[[Column, Column], Column], m: Column) -> Column:
        return test(m["kind"], m["event"])

    # A Patient per PID (patient group), each read from an in-memory copy as the parts are.
    patients = F.transform(
        ctx["patients"],
        lambda p: F.struct(sp.alias("sp"), *(p[n].alias(n) for n in ("seg", "nk1", "url"))),
    )
    return {
        "patients": F.transform(
            patients, lambda p: _patient_entry(p["seg"], p["nk1"], p["url"], _Maps(options, p["sp"]))
        ),
        "encounter": part(
            "kind event pv1 patients",
            lambda m, maps: F.when(kind(_is_adt, m) & m["pv1"].isNotNull(), _encounter_entry(m, seed, maps)),
        ),
        "reports": part(
            "kind event obr",
            lambda m, maps: F.when(
                kind(_is_oru, m), F.transform(m["obr"], lambda o, k: _report_entry(o, k, seed, maps))
            ),
        ),
        "observations": part(
            "kind event obx",
            lambda m, maps: F.when(kind(_is_oru, m), F.transform(m["obx"], lambda o: _observation_entry(o, maps))),
        ),
        "orders": part(
            "kind event obr orc",
            lambda m, maps: F.when(
                kind(_is_orm, m), F.transform(m["obr"], lambda o, k: _order_entry(o, k, m, seed, maps))
            ),
        ),
    }


def fhir_bundle(ctx: Column, entries: list[Column]) -> tuple[Column, Column]:
    """Step 3: (the Bundle's JSON, NULL when refused; the refusal's reason, NULL when mapped).

    Two entries written on the same conditional URL (two OBR with one filler number, two orders
    with one placer number, one patient in two groups) refuse the message: FHIR fails such a
    transaction as a whole.
    """
    body = F.concat_ws(",", *entries)
    # Patients, reports and orders can collide; an Encounter is alone, Observations keyed on their position.
    keyed = F.concat_ws(",", *(e for name, e in zip(ENTRY_PARTS, entries) if name in ("patients", "reports", "orders")))
    urls = F.regexp_extract_all(keyed, F.lit(r'"request":\{"method":"PUT","url":"([^"]*)"'), 1)
    twice = F.when(F.size(F.array_distinct(urls)) < F.size(urls), F.lit(_SAME_URL))
    error = F.coalesce(ctx["error"], F.when(ctx.isNotNull(), twice))
    bundle = F.concat(F.lit('{"resourceType":"Bundle","type":"transaction","entry":['), body, F.lit("]}"))
    return F.when(ctx.isNotNull() & error.isNull(), bundle), error


_SAME_URL = (
    "fhir-r4: two entries would be written on one identifier (a filler or placer number repeated in the "
    "message, or one patient in two of its groups), a transaction FHIR fails: give each order its own number, "
    "send a patient's results in one group, or send them as separate messages"
)


class _Maps:
    """The option maps as ``map<string,string>`` literals (one JSON literal each, folded at optimization)."""

    def __init__(self, options: FhirOptions, sp: Column) -> None:
        self.sp = sp  # how the message's fields are split and its leaves decoded (the context's sp)
        self.identifier_systems = _literal(options.identifier_systems)
        self.code_systems = _literal(options.code_systems)
        self.gender = _literal(options.gender)
        self.patient_class = _literal(options.patient_class)
        self.timezone = options.timezone


def _literal(table: Mapping[str, str]) -> Column:
    return F.from_json(F.lit(json.dumps(dict(table))), "map<string,string>")


def _lookup(table: Column | Mapping[str, str], key: Column) -> Column:
    """``table[key]``, NULL for a NULL key or a miss."""
    literal = _literal(table) if isinstance(table, Mapping) else table
    return F.try_element_at(literal, key)


# --- reading the segments ----------------------------------------------------------------------
#
# A used segment is kept split into its fields only (``array<string>``, element 1 its id); a field
# is split into repetitions, components and subcomponents where the mapping reads it, and only the
# leaves it reads are decoded. Separator escapes are resolved once per segment, before any split:
# each ``\F\ \S\ \R\ \T\ \E\`` becomes a placeholder character that no split cuts, and a leaf turns
# placeholders back into separators with one ``translate``.

# Placeholders for the escaped field, component, repetition, subcomponent and escape characters, and
# the two marks an escape sequence is bracketed with while they are chosen: Unicode noncharacters
# (reserved for a program's internal use, never meant to be interchanged). A message holding one
# anyway is read with no escape decoded, rather than misread.
_PLACEHOLDERS = "\ufdd2\ufdd3\ufdd4\ufdd5\ufdd6"
_ESCAPED = ("fs", "cs", "rs", "ss", "esc")
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_RESERVED = "[\ufdd0-\ufdd6]"
_ALPHANUMERIC = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def _split_unit(unit: Column) -> Column:
    """The unit's used segments split into fields, escapes marked, and how to read them.

    ``struct<segs: array<array<string>>, sp: struct<rs_re, cs_re, ss_re, to>, seps>``; ``to`` is
    what the placeholders translate to, NULL when no leaf needs it (no escape, or a message that
    must not be decoded); ``seps`` the unit's separators.
    """
    return let(unit, _split_bound)


def _split_bound(unit: Column) -> Column:
    seps = unit["seps"]
    # The others are kept as empty strings: their places tell which segment an NTE follows.
    used = F.transform(unit["segments"], lambda s: F.when(F.substring(s, 1, 3).isin(*_USED), s).otherwise(F.lit("")))
    return let(
        used,
        lambda u: let((seps["esc"] != "") & ~F.array_join(u, "").rlike(_RESERVED), lambda d: _marked(u, d, seps)),
    )


def _marked(used: Column, decode: Column, seps: Column) -> Column:
    marked = F.transform(used, lambda s: F.when(decode & s.contains(seps["esc"]), _mark_escapes(s, seps)).otherwise(s))
    restored = F.concat(*(F.when(seps[n] != "", seps[n]).otherwise(F.lit(p)) for n, p in zip(_ESCAPED, _PLACEHOLDERS)))

    def split(ms: Column) -> Column:
        escaped = decode & F.array_join(ms, "").rlike(f"[{_PLACEHOLDERS}]")
        sp = F.struct(
            seps["rs_re"].alias("rs_re"),
            seps["cs_re"].alias("cs_re"),
            seps["ss_re"].alias("ss_re"),
            F.when(escaped, restored).alias("to"),
        )
        return F.struct(
            F.transform(ms, lambda s: F.split(s, seps["fs_re"], -1)).alias("segs"), sp.alias("sp"), seps.alias("seps")
        )

    return let(marked, split)


def _mark_escapes(segment: Column, seps: Column) -> Column:
    """The segment with each separator escape replaced by its placeholder, other escapes kept.

    An escape is the escape character, text without a separator, the escape character, paired
    left to right — exactly the pairs ``hl7_fields.decode_escapes`` finds leaf by leaf (a leaf is
    the text between separators, so a pair never spans one). A code whose separator the message
    does not define stays verbatim, as there.
    """

    def in_class(sep: Column) -> Column:  # one character of a regex character class
        return F.when(F.lit(_ALPHANUMERIC).contains(sep), sep).otherwise(F.concat(F.lit("\\"), sep))

    members = F.concat(*(F.when(seps[n] != "", in_class(seps[n])).otherwise(F.lit("")) for n in _ESCAPED))
    pattern = F.concat(seps["esc_re"], F.lit("([^"), members, F.lit("]*)"), seps["esc_re"])
    out = F.regexp_replace(segment, pattern, F.lit(_OPEN + "$1" + _CLOSE))
    for code, name, placeholder in zip("FSRTE", _ESCAPED, _PLACEHOLDERS):
        marked = F.lit(_OPEN + code + _CLOSE)
        out = F.replace(out, marked, F.when(seps[name] != "", F.lit(placeholder)).otherwise(marked))
    return F.replace(F.replace(out, F.lit(_OPEN), seps["esc"]), F.lit(_CLOSE), seps["esc"])


def _nth(array: Column, n: int | Column) -> Column:
    """Element ``n`` (1-based), NULL when missing."""
    return F.try_element_at(array, n if isinstance(n, Column) else F.lit(n))


def _leaf(x: Column, sp: Column) -> Column:
    """A leaf's raw text as its value: NULL when empty or HL7's ``""``, escaped separators restored.

    ``x`` is read twice: keep it cheap (a lambda variable, an element of a bound array). Spark's
    ``nullif`` would not help — inside a lambda it repeats its argument too.
    """
    # translate gives NULL when there is nothing to translate to (sp.to NULL), which costs nothing.
    return F.when(~x.isin("", '""'), F.coalesce(F.call_function("translate", x, F.lit(_PLACEHOLDERS), sp["to"]), x))


def _reps(seg: Column, segment: str, n: int, sp: Column) -> Column:
    """The raw repetitions of field ``n`` (HL7 numbering: for MSH, element n is MSH-n); NULL when absent."""
    return F.split(_nth(seg, n if segment == "MSH" else n + 1), sp["rs_re"], -1)


def _rep(seg: Column, segment: str, n: int, sp: Column, rep: int = 1) -> Column:
    return _nth(_reps(seg, segment, n, sp), rep)


def _value(seg: Column, segment: str, n: int, sp: Column, component: int = 1, sub: int = 1, rep: int = 1) -> Column:
    """One leaf, decoded: for a value read once, split down to it without splitting the rest."""
    raw = _nth(F.split(_rep(seg, segment, n, sp, rep), sp["cs_re"], -1), component)
    return _nth(F.transform(F.split(raw, sp["ss_re"], -1), lambda x: _leaf(x, sp)), sub)


def _split_rep(raw: Column, sp: Column) -> Column:
    """A raw repetition as ``array<array<string>>`` (components, subcomponents; leaves still raw)."""
    return F.transform(F.split(raw, sp["cs_re"], -1), lambda c: F.split(c, sp["ss_re"], -1))


def _with_rep(raw: Column, sp: Column, body: Callable[[Column], Column]) -> Column:
    """``body`` of a repetition read several times: split once and bound (see :func:`_c`)."""
    return let(_split_rep(raw, sp), body)


def _c(rep: Column, sp: Column, component: int, sub: int = 1) -> Column:
    """Component (and subcomponent) of a :func:`_split_rep` repetition, decoded."""
    return _leaf(_nth(_nth(rep, component), sub), sp)


def _text(rep: Column, sp: Column) -> Column:
    """A repetition as text again: components joined with ``^``, subcomponents with ``&`` (for
    string values whose text held unescaped separators), trailing empty ones dropped."""
    joined = F.array_join(
        F.transform(
            F.split(rep, sp["cs_re"], -1),
            lambda c: F.array_join(
                F.transform(F.split(c, sp["ss_re"], -1), lambda x: F.coalesce(_leaf(x, sp), F.lit(""))), "&"
            ),
        ),
        "^",
    )
    return F.nullif(F.regexp_replace(joined, r"[\^&]+$", ""), F.lit(""))


# --- the Bundle --------------------------------------------------------------------------------


def _is_adt(kind: Column, event: Column) -> Column:
    return (kind == "ADT") & event.isin(*_ADT_EVENTS)


def _is_oru(kind: Column, event: Column) -> Column:
    return (kind == "ORU") & (event == "R01")


def _is_orm(kind: Column, event: Column) -> Column:
    return (kind == "ORM") & (event == "O01")


_SEGMENT = "array<string>"
_SP_FIELDS = ("rs_re", "cs_re", "ss_re", "to")
_CONTEXT_FIELDS = (
    ("kind", "string"),
    ("event", "string"),
    # One a PID (a patient group): its fullUrl, the identity its results' identifiers derive from, its NK1.
    (
        "patients",
        f"array<struct<seg:{_SEGMENT},pos:int,url:string,sender:string,obr0:int,obx0:int,nk1:array<{_SEGMENT}>>>",
    ),
    ("pv1", _SEGMENT),
    (
        "obr",
        f"array<struct<seg:{_SEGMENT},pos:int,grp:int,num:int,patient:string,sender:string,"
        "results:array<struct<reference:string>>,notes:array<string>>>",
    ),
    (
        "obx",
        f"array<struct<seg:{_SEGMENT},pos:int,report:int,url:string,key:string,patient:string,notes:array<string>>>",
    ),
    ("orc", f"array<struct<seg:{_SEGMENT},pos:int,grp:int>>"),
    ("sp", "struct<" + ",".join(f"{name}:string" for name in _SP_FIELDS) + ">"),
    ("error", "string"),
)
_CONTEXT = "struct<" + ",".join(f"{name}:{kind}" for name, kind in _CONTEXT_FIELDS) + ">"


def _refused(reason: Column) -> Column:
    """A context with only the reason the message cannot be mapped."""
    return F.struct(
        *(F.lit(None).cast(kind).alias(name) for name, kind in _CONTEXT_FIELDS if name != "error"),
        reason.alias("error"),
    )


def _context(u: Column, seed: Column, seps: Column) -> Column:
    """The split segments ``u`` of one message grouped for the mapping (see :func:`fhir_context`).

    Each OBX gets the number of its OBR here, once, and each segment a patient the number of its
    PID: their cost is OBX × OBR and segments × PID, so a message with more than
    :data:`MAX_GROUP_SEGMENTS` of any of them is refused before any of that work.
    """
    sp = u["sp"]
    positioned = F.transform(
        u["segs"], lambda s, i: F.struct(s.alias("seg"), i.alias("pos"), _segment_id(_nth(s, 1), seps).alias("id"))
    )

    def groups(ps: Column) -> Column:
        # One character a segment, N for an NTE: the NTE right after a segment are its notes.
        kinds = F.array_join(F.transform(ps, lambda p: F.when(p["id"] == "NTE", "N").otherwise("x")), "")
        placed = (_placed(ps, name).alias(name) for name in _USED if name != "NTE")
        return F.struct(*placed, kinds.alias("kinds"), u["segs"].alias("segs"))

    return let(positioned, lambda ps: let(groups(ps), lambda g: _grouped(g, sp, seed)))


def _segment_id(first: Column, seps: Column) -> Column:
    """The id of a used segment: the first leaf of its element 1 (for MSH, "MSH-1" is that element).

    Every used segment starts with its three-letter name (the filter of :func:`_split_unit`), so the
    leaf is that name exactly when the element is the name alone or goes on with a repetition,
    component or subcomponent separator; otherwise the leaf holds more (a placeholder among them,
    which no name holds) and is no used id — unless a separator is a letter of the name itself (the
    leaf ends sooner). No split and no decoding for it.
    """
    name, inner = F.substring(first, 1, 3), F.concat(seps["rs"], seps["cs"], seps["ss"])
    ends = (F.length(first) == 3) | F.substring(first, 4, 1).isin(seps["rs"], seps["cs"], seps["ss"])
    return F.when(ends & (F.call_function("translate", name, inner, F.lit("")) == name), name)


def _placed(positioned: Column, name: str) -> Column:
    return F.transform(
        F.filter(positioned, lambda p: p["id"] == F.lit(name)),
        lambda p: F.struct(p["seg"].alias("seg"), p["pos"].alias("pos")),
    )


MAX_GROUP_SEGMENTS = 1000
"""OBR, OBX, ORC, PID or NK1 segments one message may have for FHIR output (refused above: grouping
them costs OBX × OBR and segments × PID, and no server takes a Bundle of that many entries)."""
_GROUPS = ("OBR", "OBX", "ORC", "PID", "NK1")
MAX_PATIENTS = 100
"""PID segments (patient groups) one message may have for FHIR output: grouping costs segments × PID,
and at 1,000 of each a message took ~100 s to transform (docs/rules.md has the figures)."""
_TOO_MANY_PATIENTS = (
    f"fhir-r4: more than {MAX_PATIENTS} PID segments (patient groups) in one message: split it per patient "
    "before this destination"
)
_SAME_PATIENT = (
    "fhir-r4: two patient groups with the same PID-3 (or both without one), or sharing an identifier "
    "(the same value from the same assigning authority): one patient in two groups, or two whose results "
    "could not be told apart on a re-send; send a patient's results in one group, each group with its own PID-3"
)
_SEVERAL_PATIENTS = (
    "fhir-r4: an ADT message with more than one PID: an ADT is one patient's (the V2-to-FHIR IG maps "
    "its one PID); split the message per patient before this destination"
)
_BEFORE_FIRST_PID = (
    "fhir-r4: an OBR, OBX, ORC or NK1 before the first of several PIDs: which patient it belongs to is "
    "not said; send each patient's group after its PID"
)
# The message types whose patient groups repeat: ORU^R01's PATIENT_RESULT (the IG maps each to its
# own Patient); ORM^O01's PATIENT is 0..1 in v2, but orders after a second PID are read as its own.
_GROUPED = ("ORU", "ORM")


def _grouped(g: Column, sp: Column, seed: Column) -> Column:
    msh = _nth(g["MSH"], 1)["seg"]
    too_many = (F.greatest(*(F.size(g[name]) for name in _GROUPS)) > MAX_GROUP_SEGMENTS) | (
        F.size(g["PID"]) > MAX_PATIENTS
    )
    header = F.struct(
        _value(msh, "MSH", 9, sp, 1).alias("kind"),
        _value(msh, "MSH", 9, sp, 2).alias("event"),
        too_many.alias("too_many"),
        # Here, where the expression is shallower than in the errors (Spark Connect's nesting limit).
        ((F.size(g["PID"]) > 1) & ~too_many & _shared_identity(g["PID"], sp)).alias("shared"),
        # Counted only for a message within bounds.
        F.when(~too_many, _patients(g, _identity(msh, sp, seed), seed)).alias("patients"),
    )
    return let(header, lambda h: _typed(g, h, sp, seed))


def _identity(msh: Column, sp: Column, seed: Column) -> Column:
    """Who sent the message, when and its control id: the whole of MSH-3, MSH-4 and MSH-7 as sent,
    and MSH-10 (the message id when there is none); :func:`_patients` adds each patient's PID-3.

    The same message sent again keeps its identity, so a re-delivery updates what it wrote; a sender
    whose counter wrapped reuses MSH-10 but not MSH-7 and the patient, so another message does not
    overwrite its results. Each part is prefixed with its length: no two lists of parts read alike.
    """
    parts = [F.coalesce(x, F.lit("")) for x in (_nth(msh, 3), _nth(msh, 4), _nth(msh, 7))]
    parts += [F.coalesce(_value(msh, "MSH", 10, sp), seed)]
    return F.concat_ws("|", *(_counted(x) for x in parts))


def _counted(x: Column) -> Column:
    return F.concat(F.length(x).cast("string"), F.lit(":"), x)


def _patients(g: Column, identity: Column, seed: Column) -> Column:
    """Each PID with what its group's resources read: the Patient's fullUrl (the first one's as when a
    message had one patient), the identity of the group (the message's and this PID-3 as sent: a
    re-send keeps it, and two groups' positions never meet) and its NK1 (those before the next PID;
    the first also those before it)."""
    return F.transform(
        g["PID"],
        lambda p, i: F.struct(
            p["seg"].alias("seg"),
            p["pos"].alias("pos"),
            _uuid(
                seed, F.when(i == 0, F.lit("Patient")).otherwise(F.concat(F.lit("Patient/"), (i + 1).cast("string")))
            ).alias("url"),
            F.concat(identity, F.lit("|"), _counted(F.coalesce(_nth(p["seg"], 4), F.lit("")))).alias("sender"),
            _before(g["OBR"], p["pos"], i).alias("obr0"),
            _before(g["OBX"], p["pos"], i).alias("obx0"),
            F.transform(
                F.filter(
                    g["NK1"],
                    lambda k: (
                        ((i == 0) | (k["pos"] > p["pos"]))
                        & F.coalesce(k["pos"] < _nth(g["PID"], i + 2)["pos"], F.lit(True))
                    ),
                ),
                lambda k: k["seg"],
            ).alias("nk1"),
        ),
    )


def _before(segments: Column, pos: Column, i: Column) -> Column:
    """How many of ``segments`` come before the PID at ``pos`` (number ``i`` from 0; the first
    PID's group also has what precedes it): a group's resources are numbered from there, so their
    identifiers do not move when another group gains or loses a segment or the groups change order."""
    return F.when(i == 0, F.lit(0)).otherwise(F.size(F.filter(segments, lambda s: s["pos"] < pos)))


def _owner(pids: Column, pos: Column) -> Column:
    """The number of the patient group the segment at ``pos`` belongs to: the PID before it (what
    comes before the first PID is the first patient's, as when a message had one)."""
    # Most messages have one PID: no lambda for them.
    return F.when(F.size(pids) < 2, F.lit(1)).otherwise(
        F.greatest(F.size(F.filter(pids, lambda p: p["pos"] < pos)), F.lit(1))
    )


def _typed(g: Column, h: Column, sp: Column, seed: Column) -> Column:
    pv1 = _nth(g["PV1"], 1)["seg"]
    kind, event, patients = h["kind"], h["event"], h["patients"]
    obr, pids = g["OBR"], g["PID"]
    adt, oru, orm = _is_adt(kind, event), _is_oru(kind, event), _is_orm(kind, event)
    message_type = F.substring(F.concat_ws("^", kind, event), 1, 20)
    first_pid = _nth(pids, 1)["pos"]
    before_first = F.exists(F.concat(obr, g["OBX"], g["ORC"], g["NK1"]), lambda x: x["pos"] < first_pid)
    error = (
        F.when(
            ~F.coalesce(adt | oru | orm, F.lit(False)),
            F.concat(F.lit("fhir-r4: no FHIR mapping for message type "), F.coalesce(message_type, F.lit("(none)"))),
        )
        .when(F.size(pids) > MAX_PATIENTS, F.lit(_TOO_MANY_PATIENTS))
        .when(
            h["too_many"],
            F.lit(
                f"fhir-r4: more than {MAX_GROUP_SEGMENTS} OBR, OBX, ORC, PID or NK1 segments: too many for one Bundle"
            ),
        )
        .when(adt & (F.size(pids) > 1), F.lit(_SEVERAL_PATIENTS))
        # Several patients: whatever comes before the first PID is nobody's for sure.
        .when((F.size(pids) > 1) & before_first, F.lit(_BEFORE_FIRST_PID))
        .when(h["shared"], F.lit(_SAME_PATIENT))
        .when(orm & (F.size(pids) == 0), F.lit("fhir-r4: ORM^O01 without a PID: a ServiceRequest needs a subject"))
        .when(orm & (F.size(obr) == 0), F.lit("fhir-r4: ORM^O01 without an OBR: nothing to order"))
        .when(oru & (F.size(pids) == 0), F.lit("fhir-r4: ORU^R01 without a PID: results need a subject"))
        .when(F.size(pids) == 0, F.lit("fhir-r4: ADT without a PID: no Patient to write"))
    )

    def of(grp: Column) -> Column:  # the patient of group ``grp``
        return _nth(patients, grp)

    # The number of the OBR each OBX follows in its patient's group (0: none), counted only for a
    # message within bounds, the OBX's fullUrl, which its report's results refer to too, its
    # Stageline identifier and its patient's fullUrl.
    obx = F.when(
        ~h["too_many"],
        F.transform(
            g["OBX"],
            lambda x, j: F.struct(
                x["seg"].alias("seg"),
                x["pos"].alias("pos"),
                _report_number(obr, pids, x["pos"]).alias("report"),
                _uuid(seed, F.concat(F.lit("OBX/"), (j + 1).cast("string"))).alias("url"),
                _key(of(_owner(pids, x["pos"])), "OBX", "obx0", j).alias("key"),
                of(_owner(pids, x["pos"]))["url"].alias("patient"),
                _notes(x["pos"], g, sp).alias("notes"),
            ),
        ),
    )

    def context(obx: Column) -> Column:  # obx bound: the OBR's results read it too
        return F.struct(
            kind.alias("kind"),
            event.alias("event"),
            patients.alias("patients"),
            pv1.alias("pv1"),
            F.when(obx.isNotNull(), _reported(obr, obx, patients, g, sp)).alias("obr"),  # NULL OBX: too many
            obx.alias("obx"),
            F.when(
                obx.isNotNull(),
                F.transform(
                    g["ORC"],
                    lambda c: F.struct(
                        c["seg"].alias("seg"), c["pos"].alias("pos"), _owner(pids, c["pos"]).alias("grp")
                    ),
                ),
            ).alias("orc"),
            sp.alias("sp"),
            error.alias("error"),
        ).cast(_CONTEXT)

    return let(obx, context)


def _key(patient: Column, name: str, first: str, j: Column) -> Column:
    """The Stageline identifier of the ``j``-th (from 0) ``name`` of the message: its group's
    identity and its number within the group (``_uuid(sender, name/n)``, one expression less deep)."""
    number = F.lit(1) + j - patient[first]
    return _uuid_of(F.format_string(f"%s|{name}/%d", patient["sender"], number))


def _shared_identity(pids: Column, sp: Column) -> Column:
    """Whether two patient groups have the same PID-3 as sent (two without one among them: their
    results' identifiers would be the same), or share an identifier — any repetition of PID-3 with
    the same value and assigning authority (namespace or universal id), what every system the
    options may give it is keyed on."""
    raw = F.transform(pids, lambda p: F.coalesce(_nth(p["seg"], 4), F.lit("")))
    keys = F.flatten(F.transform(pids, lambda p: F.array_distinct(_identifier_keys(p["seg"], sp))))
    return (F.size(F.array_distinct(raw)) < F.size(raw)) | (F.size(F.array_distinct(keys)) < F.size(keys))


def _identifier_keys(pid: Column, sp: Column) -> Column:
    """Each PID-3 repetition's value with its namespace, and with its universal id (``N|ns|value``,
    ``U|uid|value``), where both are there."""

    def keys(r: Column) -> Column:
        value = _trimmed(_c(r, sp, 1))
        return F.array(
            *(
                F.when(
                    value.isNotNull() & _c(r, sp, 4, sub).isNotNull(),
                    F.concat_ws("|", F.lit(tag), _c(r, sp, 4, sub), value),
                )
                for tag, sub in (("N", 1), ("U", 2))
            )
        )

    reps = F.transform(_reps(pid, "PID", 3, sp), lambda raw: _with_rep(raw, sp, keys))
    return F.filter(F.flatten(reps), lambda k: k.isNotNull())


def _report_number(obr: Column, pids: Column, pos: Column) -> Column:
    """The number of the OBR before ``pos`` when it is in the same patient's group, else 0."""
    k = F.size(F.filter(obr, lambda r: r["pos"] < pos))
    last = _nth(obr, F.greatest(k, F.lit(1)))["pos"]
    return F.when((k > 0) & (_owner(pids, last) == _owner(pids, pos)), k).otherwise(F.lit(0))


def _notes(pos: Column, g: Column, sp: Column) -> Column:
    """The texts of the NTE right after the segment at ``pos`` (NTE-3, repetitions joined with a
    line break, as a string value's): that segment's notes."""
    count = F.length(F.regexp_extract(F.substring(g["kinds"], pos + 2, 1 << 30), "^N*", 0))
    texts = F.transform(
        F.slice(g["segs"], pos + 2, count),
        lambda n: F.array_join(
            F.filter(F.transform(_reps(n, "NTE", 3, sp), lambda r: _text(r, sp)), lambda x: x.isNotNull()), "\n"
        ),
    )
    # Most segments have none: the next kind alone says so, before any slice or split.
    return F.when(F.substring(g["kinds"], pos + 2, 1) == "N", F.filter(texts, lambda t: t != ""))


def _reported(obr: Column, obx: Column, patients: Column, g: Column, sp: Column) -> Column:
    """Each OBR with its patient's group, fullUrl and identity, its results (the fullUrls of the OBX
    that follow it, gathered here, where the OBX are in memory, rather than by each report from the
    context row) and its notes (the NTE right after it: an order's, ServiceRequest.note)."""
    pids = g["PID"]
    return F.transform(
        obr,
        lambda r, k: F.struct(
            r["seg"].alias("seg"),
            r["pos"].alias("pos"),
            _owner(pids, r["pos"]).alias("grp"),
            (F.lit(1) + k - _nth(patients, _owner(pids, r["pos"]))["obr0"]).alias("num"),
            _nth(patients, _owner(pids, r["pos"]))["url"].alias("patient"),
            _nth(patients, _owner(pids, r["pos"]))["sender"].alias("sender"),
            F.transform(
                F.filter(obx, lambda x: x["report"] == k + 1), lambda x: F.struct(x["url"].alias("reference"))
            ).alias("results"),
            _notes(r["pos"], g, sp).alias("notes"),
        ),
    )


def _entry(full_url: Column, resource_json: Column, request: Column) -> Column:
    """One Bundle entry's JSON (the resource is JSON text already: entries differ in type)."""
    return F.concat(
        F.lit('{"fullUrl":"'),
        full_url,  # urn:uuid: and hex digits, nothing to escape
        F.lit('","resource":'),
        resource_json,
        F.lit(',"request":'),
        F.to_json(request),
        F.lit("}"),
    )


def _keyed_entry(url: Column, resource_type: str, identifiers: Column, *fields: Column) -> Column:
    """An entry written conditionally on its identifiers (bound once: the resource and its request read them)."""
    return let(
        identifiers,
        lambda ids: _entry(
            url,
            _resource(resource_type, ids.alias("identifier"), *fields),
            _conditional(resource_type, F.coalesce(ids, F.array().cast(_IDENTIFIERS))),
        ),
    )


def _uuid(seed: Column, key: Column) -> Column:
    """``urn:uuid:`` + a name-based UUID (version 5 layout) of seed and key: the same on every run."""
    return _uuid_of(F.concat_ws("|", seed, key))


def _uuid_of(name: Column) -> Column:
    h = F.sha2(name, 256)
    return F.concat(
        F.lit("urn:uuid:"),
        F.substring(h, 1, 8),
        F.lit("-"),
        F.substring(h, 9, 4),
        F.lit("-5"),
        F.substring(h, 14, 3),
        F.lit("-a"),
        F.substring(h, 18, 3),
        F.lit("-"),
        F.substring(h, 21, 12),
    )


def _stageline_identifier(sender: Column, key: str, k: Column | None = None) -> Column:
    """The resource's own Stageline identifier: from its patient group's identity (the sender, its
    control id, the patient) and the position."""
    name = F.lit(key) if k is None else F.concat(F.lit(key + "/"), k.cast("string"))
    return _identifier_of(None, F.lit(_STAGELINE_SYSTEM), _uuid(sender, name))


def _subject(url: Column) -> Column:
    """The reference to a patient's entry (its fullUrl)."""
    return F.when(url.isNotNull(), F.struct(url.alias("reference")))


_IDENTIFIER_TYPE = "struct<coding:array<struct<system:string,code:string>>>"


def _identifier_of(code: Column | None, system: Column, value: Column) -> Column:
    """An Identifier, one struct type for all (typed by a v2 table 0203 code when there is one)."""
    kind = (
        F.lit(None)
        if code is None
        else F.when(
            code.isNotNull(),
            F.struct(F.array(F.struct(F.lit(_V2_0203).alias("system"), code.alias("code"))).alias("coding")),
        )
    )
    return F.struct(
        kind.cast(_IDENTIFIER_TYPE).alias("type"), system.cast("string").alias("system"), value.alias("value")
    )


def _conditional(resource: str, identifiers: Column) -> Column:
    """PUT on the first identifier that has a system, else a plain POST."""
    keyed = F.try_element_at(
        F.filter(identifiers, lambda i: i["system"].isNotNull() & i["value"].isNotNull()), F.lit(1)
    )
    url = F.concat(
        F.lit(f"{resource}?identifier="),
        F.url_encode(_search_escape(keyed["system"])),
        F.lit("|"),
        F.url_encode(_search_escape(keyed["value"])),
    )
    return F.when(keyed.isNotNull(), F.struct(F.lit("PUT").alias("method"), url.alias("url"))).otherwise(
        F.struct(F.lit("POST").alias("method"), F.lit(resource).alias("url"))
    )


def _search_escape(x: Column) -> Column:
    """FHIR search escaping: ``\\``, ``|``, ``,`` and ``$`` in a token are preceded by ``\\``."""
    return F.regexp_replace(x, r"([\\|,$])", r"\\$1")


def _nonempty(array: Column) -> Column:
    """The array without NULLs, or NULL when nothing is left (FHIR has no empty arrays)."""
    return let(F.array_compact(array), lambda a: F.when(F.size(a) > 0, a))


def _resource(name: str, *fields: Column) -> Column:
    return F.to_json(F.struct(F.lit(name).alias("resourceType"), *fields))


# --- Patient, Encounter ------------------------------------------------------------------------


def _patient_entry(pid: Column, nk1: Column, url: Column, maps: _Maps) -> Column:
    sp = maps.sp
    identifiers = F.transform(_reps(pid, "PID", 3, sp), lambda r: _identifier(r, maps))
    return _keyed_entry(
        url,
        "Patient",
        _nonempty(identifiers),
        _nonempty(F.transform(_reps(pid, "PID", 5, sp), lambda r: _human_name(r, sp))).alias("name"),
        _nonempty(
            F.flatten(  # a missing PID-14 is NULL, which concat would spread to the whole list
                F.array_compact(
                    F.array(
                        F.transform(_reps(pid, "PID", 13, sp), lambda r: _contact(r, sp, "home")),
                        F.transform(_reps(pid, "PID", 14, sp), lambda r: _contact(r, sp, "work")),
                    )
                )
            )
        ).alias("telecom"),
        _lookup(maps.gender, _value(pid, "PID", 8, sp)).alias("gender"),
        _date(_value(pid, "PID", 7, sp)).alias("birthDate"),
        _datetime(_value(pid, "PID", 29, sp), maps).alias("deceasedDateTime"),
        F.when(_value(pid, "PID", 29, sp).isNull(), _yes_no(_value(pid, "PID", 30, sp))).alias("deceasedBoolean"),
        _nonempty(F.transform(_reps(pid, "PID", 11, sp), lambda r: _address(r, sp))).alias("address"),
        _nonempty(F.transform(nk1, lambda k: _next_of_kin(k, maps))).alias("contact"),
    )


def _no_contacts() -> Column:
    return F.array().cast("array<struct<system:string,value:string,use:string>>")


def _next_of_kin(nk1: Column, maps: _Maps) -> Column:
    """NK1 → Patient.contact (the IG's NK1 map): relationship NK1-3 (CWE), name NK1-2 (XPN, the
    first), telecom NK1-5 (home) and NK1-6 (work) (XTN), address NK1-4 (XAD, the first). A contact
    needs a name, a telecom or an address (FHIR's pat-1): an NK1 with none of them is left out."""
    sp = maps.sp
    name, address = _human_name(_rep(nk1, "NK1", 2, sp), sp), _address(_rep(nk1, "NK1", 4, sp), sp)
    relationship = _codeable(_rep(nk1, "NK1", 3, sp), maps)
    # No _nonempty here or for the relationship: its binding would take the Patient past Spark
    # Connect's nesting limit.
    phones = F.filter(
        F.concat(
            F.coalesce(F.transform(_reps(nk1, "NK1", 5, sp), lambda r: _contact(r, sp, "home")), _no_contacts()),
            F.coalesce(F.transform(_reps(nk1, "NK1", 6, sp), lambda r: _contact(r, sp, "work")), _no_contacts()),
        ),
        lambda c: c.isNotNull(),
    )
    telecom = F.when(F.size(phones) > 0, phones)
    return F.when(
        name.isNotNull() | telecom.isNotNull() | address.isNotNull(),
        F.struct(
            F.when(relationship.isNotNull(), F.array(relationship)).alias("relationship"),
            name.alias("name"),
            telecom.alias("telecom"),
            address.alias("address"),
        ),
    )


_IDENTIFIERS = f"array<struct<type:{_IDENTIFIER_TYPE},system:string,value:string>>"


def _identifier(raw: Column, maps: _Maps) -> Column:
    """CX → Identifier; the system from CX-4 (namespace, else universal id), ``urn:oid:`` for an
    ISO universal id nobody configured. NULL without CX-1."""
    return _with_rep(raw, maps.sp, lambda r: _identifier_of_rep(r, maps))


def _identifier_of_rep(r: Column, maps: _Maps) -> Column:
    sp = maps.sp
    namespace, universal, universal_type = _c(r, sp, 4, 1), _c(r, sp, 4, 2), _c(r, sp, 4, 3)
    # The universal id first: two authorities may share a local namespace name, never an OID.
    system = F.coalesce(
        _lookup(maps.identifier_systems, universal),
        F.when(
            (universal_type == "ISO") & universal.rlike(r"^[0-2](\.(0|[1-9]\d*))+$"),
            F.concat(F.lit("urn:oid:"), universal),
        ),
        _lookup(maps.identifier_systems, namespace),
    )
    return let(_trimmed(_c(r, sp, 1)), lambda v: F.when(v.isNotNull(), _identifier_of(_code(_c(r, sp, 5)), system, v)))


def _human_name(raw: Column, sp: Column) -> Column:
    """XPN → HumanName: family, given (XPN-2, XPN-3), suffix, prefix, use (XPN-7)."""
    return _with_rep(raw, sp, lambda r: _human_name_of_rep(r, sp))


def _human_name_of_rep(r: Column, sp: Column) -> Column:
    family, given = _c(r, sp, 1), _nonempty(F.array(_c(r, sp, 2), _c(r, sp, 3)))
    return F.when(
        family.isNotNull() | given.isNotNull(),
        F.struct(
            _lookup(_NAME_USE, _c(r, sp, 7)).alias("use"),
            family.alias("family"),
            given.alias("given"),
            _nonempty(F.array(_c(r, sp, 5))).alias("prefix"),
            _nonempty(F.array(_c(r, sp, 4))).alias("suffix"),
        ),
    )


def _address(raw: Column, sp: Column) -> Column:
    """XAD → Address: line (XAD-1, XAD-2), city, state, postalCode, country, use (XAD-7)."""
    return _with_rep(raw, sp, lambda r: _address_of_rep(r, sp))


def _address_of_rep(r: Column, sp: Column) -> Column:
    fields = [
        _lookup(_ADDRESS_USE, _c(r, sp, 7)).alias("use"),
        _nonempty(F.array(_c(r, sp, 1), _c(r, sp, 2))).alias("line"),
        _c(r, sp, 3).alias("city"),
        _c(r, sp, 4).alias("state"),
        _c(r, sp, 5).alias("postalCode"),
        _c(r, sp, 6).alias("country"),
    ]
    present = F.coalesce(*(_c(r, sp, n) for n in range(1, 7)))
    return F.when(present.isNotNull(), F.struct(*fields))


def _contact(raw: Column, sp: Column, use: str) -> Column:
    """XTN → ContactPoint: e-mail (XTN-2 NET or XTN-3 Internet) from XTN-4, else a phone number
    (XTN-1, else XTN-6 area code + XTN-7)."""
    return _with_rep(raw, sp, lambda r: _contact_of_rep(r, sp, use))


def _contact_of_rep(r: Column, sp: Column, use: str) -> Column:
    email = (_c(r, sp, 2) == "NET") | (_c(r, sp, 3) == "Internet")
    number = F.coalesce(_c(r, sp, 1), F.when(_c(r, sp, 7).isNotNull(), F.concat_ws(" ", _c(r, sp, 6), _c(r, sp, 7))))
    value = F.when(email, F.coalesce(_c(r, sp, 4), _c(r, sp, 1))).otherwise(number)
    system = F.when(email, F.lit("email")).when(_c(r, sp, 3) == "FX", F.lit("fax")).otherwise(F.lit("phone"))
    use_code = F.when(_c(r, sp, 3) == "CP", F.lit("mobile")).otherwise(F.lit(use))
    return F.when(value.isNotNull(), F.struct(system.alias("system"), value.alias("value"), use_code.alias("use")))


def _yes_no(v: Column) -> Column:
    return F.when(v == "Y", F.lit(True)).when(v == "N", F.lit(False))


def _encounter_entry(m: Column, seed: Column, maps: _Maps) -> Column:
    pv1, sp = m["pv1"], maps.sp
    patient = _nth(m["patients"], 1)  # an ADT has one
    patient_class = _code(_value(pv1, "PV1", 2, sp))
    mapped = _lookup(maps.patient_class, patient_class)
    klass = (
        F.when(mapped.isNotNull(), F.struct(F.lit(_ACT_CODE).alias("system"), mapped.alias("code")))
        .when(patient_class.isNotNull(), F.struct(F.lit(_V2_0004).alias("system"), patient_class.alias("code")))
        .otherwise(F.struct(F.lit(_NULL_FLAVOR).alias("system"), F.lit("UNK").alias("code")))
    )
    period = F.struct(
        _datetime(_value(pv1, "PV1", 44, sp), maps).alias("start"),
        _datetime(_value(pv1, "PV1", 45, sp), maps).alias("end"),
    )
    identifiers = F.array_compact(
        F.array(_identifier(_rep(pv1, "PV1", 19, sp), maps), _stageline_identifier(patient["sender"], "PV1"))
    )
    return let(
        period,
        lambda p: _keyed_entry(
            _uuid(seed, F.lit("Encounter")),
            "Encounter",
            identifiers,
            F.when(p["end"].isNotNull(), F.lit("finished")).otherwise(F.lit("in-progress")).alias("status"),
            klass.alias("class"),
            _subject(patient["url"]).alias("subject"),
            F.when(p["start"].isNotNull() | p["end"].isNotNull(), p).alias("period"),
        ),
    )


# --- DiagnosticReport, Observation, ServiceRequest ---------------------------------------------


def _order_identifier(seg: Column, segment: str, n: int, code: str, maps: _Maps) -> Column:
    """EI (placer / filler number) → Identifier typed PLAC / FILL, the system from EI-2 (or EI-3)."""
    sp = maps.sp
    value = _trimmed(_value(seg, segment, n, sp, 1))
    system = F.coalesce(
        _lookup(maps.identifier_systems, _value(seg, segment, n, sp, 2)),
        _lookup(maps.identifier_systems, _value(seg, segment, n, sp, 3)),
    )
    return F.when(value.isNotNull(), _identifier_of(F.lit(code), system, value))


def _report_entry(o: Column, k: Column, seed: Column, maps: _Maps) -> Column:
    obr, sp = o["seg"], maps.sp
    number = k + 1
    results = o["results"]  # this OBR's OBX: those after it and before the next OBR
    identifiers = F.array_compact(
        F.array(_order_identifier(obr, "OBR", 3, "FILL", maps), _stageline_identifier(o["sender"], "OBR", o["num"]))
    )
    return _keyed_entry(
        _uuid(seed, F.concat(F.lit("OBR/"), number.cast("string"))),
        "DiagnosticReport",
        identifiers,
        F.coalesce(_lookup(_REPORT_STATUS, _value(obr, "OBR", 25, sp)), F.lit("unknown")).alias("status"),
        _required(_codeable(_rep(obr, "OBR", 4, sp), maps)).alias("code"),
        _subject(o["patient"]).alias("subject"),
        _datetime(_value(obr, "OBR", 7, sp), maps).alias("effectiveDateTime"),
        F.when(F.size(results) > 0, results).alias("result"),
    )


def _observation_entry(o: Column, maps: _Maps) -> Column:
    obx, sp = o["seg"], maps.sp

    def entry(identifiers: Column) -> Column:
        base = _resource(
            "Observation",
            identifiers.alias("identifier"),
            F.coalesce(_lookup(_OBSERVATION_STATUS, _value(obx, "OBX", 11, sp)), F.lit("unknown")).alias("status"),
            _required(_codeable(_rep(obx, "OBX", 3, sp), maps)).alias("code"),
            _subject(o["patient"]).alias("subject"),
            _datetime(_value(obx, "OBX", 14, sp), maps).alias("effectiveDateTime"),
            _nonempty(F.array(_codeable(_rep(obx, "OBX", 8, sp), maps, default_system=_V2_0078))).alias(
                "interpretation"
            ),
            _annotations(o["notes"]).alias("note"),
            let(_value(obx, "OBX", 7, sp), lambda r: F.when(r.isNotNull(), F.array(F.struct(r.alias("text"))))).alias(
                "referenceRange"
            ),
        )
        resource = let(
            _observation_value(obx, maps),
            lambda v: F.when(v.isNull(), base).otherwise(
                F.concat(F.substr(base, F.lit(1), F.length(base) - 1), F.lit(","), v, F.lit("}"))
            ),
        )
        return _entry(o["url"], resource, _conditional("Observation", identifiers))

    # Its Stageline identifier's value comes from the context (beside its fullUrl): no binding here,
    # where Spark Connect's nesting limit is nearest.
    return entry(F.array(_identifier_of(None, F.lit(_STAGELINE_SYSTEM), o["key"])))


def _observation_value(obx: Column, maps: _Maps) -> Column:
    """``"value[x]":...`` JSON for OBX-5 read as OBX-2 says, NULL without a value.

    Numbers are written as their text (``7.20`` stays ``7.20``; FHIR decimals keep their precision),
    so the quantity is assembled as text rather than ``to_json`` of a double.
    """
    sp = maps.sp
    reps = _reps(obx, "OBX", 5, sp)
    strings = F.array_join(F.filter(F.transform(reps, lambda r: _text(r, sp)), lambda x: x.isNotNull()), "\n")
    value = F.struct(
        _value(obx, "OBX", 2, sp).alias("kind"),
        _split_rep(_nth(reps, 1), sp).alias("first"),
        _split_rep(_rep(obx, "OBX", 6, sp), sp).alias("unit"),
        _member("valueString", F.nullif(strings, F.lit(""))).alias("string"),
    )
    return let(value, lambda v: _typed_value(v["kind"], v["first"], v["unit"], v["string"], maps))


def _member(name: str, value: Column) -> Column:
    """``"name":value`` as JSON text (no braces), NULL for a NULL value."""
    text = F.to_json(F.struct(value.alias(name)))
    return F.when(value.isNotNull(), F.substr(text, F.lit(2), F.length(text) - 2))


def _typed_value(kind: Column, first: Column, unit: Column, as_string: Column, maps: _Maps) -> Column:
    sp = maps.sp
    unit_system = _lookup(maps.code_systems, _c(unit, sp, 3))
    unit_fields = [
        F.coalesce(_c(unit, sp, 2), _c(unit, sp, 1)).alias("unit"),
        unit_system.alias("system"),
        F.when(unit_system.isNotNull(), _code(_c(unit, sp, 1))).alias("code"),
    ]

    def quantity(number: Column, comparator: Column) -> Column:
        rest = F.to_json(F.struct(comparator.alias("comparator"), *unit_fields))
        tail = F.when(rest != "{}", F.concat(F.lit(","), F.substr(rest, F.lit(2), F.length(rest) - 2))).otherwise(
            F.lit("")
        )
        return F.concat(F.lit('"valueQuantity":{"value":'), _json_number(number), tail, F.lit("}"))

    def pair(member: str, low: str, high: str, first_number: Column, second_number: Column, units: bool) -> Column:
        """``"valueRange":{"low":{...},"high":{...}}`` or a Ratio's numerator and denominator."""
        rest = F.to_json(F.struct(*unit_fields)) if units else F.lit("{}")
        tail = F.when(rest != "{}", F.concat(F.lit(","), F.substr(rest, F.lit(2), F.length(rest) - 2))).otherwise(
            F.lit("")
        )
        return F.concat(
            F.lit(f'"{member}":{{"{low}":{{"value":'),
            _json_number(first_number),
            tail,
            F.lit(f'}},"{high}":{{"value":'),
            _json_number(second_number),
            tail,
            F.lit("}}"),
        )

    nm = _c(first, sp, 1)
    sn_comparator, sn_number, sn_separator, sn_second = (
        _c(first, sp, 1),
        _c(first, sp, 2),
        _c(first, sp, 3),
        _c(first, sp, 4),
    )
    # SN-1 empty, SN-2 and SN-4 numbers: "-" a range (in OBX-6's unit), ":" or "/" a ratio.
    sn_pair = (kind == "SN") & sn_comparator.isNull() & sn_number.rlike(_NUMBER) & sn_second.rlike(_NUMBER)
    return (
        F.when(first.isNull(), F.lit(None).cast("string"))
        .when((kind == "NM") & nm.rlike(_NUMBER), quantity(nm, F.lit(None).cast("string")))
        .when(
            (kind == "SN")
            & sn_number.rlike(_NUMBER)
            & _c(first, sp, 3).isNull()
            & (sn_comparator.isNull() | sn_comparator.isin(*_COMPARATORS, "=")),
            quantity(sn_number, F.when(sn_comparator != "=", sn_comparator)),
        )
        .when(sn_pair & (sn_separator == "-"), pair("valueRange", "low", "high", sn_number, sn_second, True))
        .when(
            sn_pair & sn_separator.isin(":", "/"),
            pair("valueRatio", "numerator", "denominator", sn_number, sn_second, False),
        )
        .when(
            kind.isin(*_CODED_TYPES),
            F.coalesce(_member("valueCodeableConcept", _codeable_of_rep(first, maps, None)), as_string),
        )
        .when(
            kind.isin(*_DATE_TYPES),
            F.coalesce(_member("valueDateTime", _datetime(_c(first, sp, 1), maps)), as_string),
        )
        .otherwise(as_string)
    )


def _json_number(text: Column) -> Column:
    """HL7 NM text as a JSON number: no '+', a 0 before a bare point, none after, no leading zeros."""
    out = F.regexp_replace(text, r"^\+", "")
    out = F.regexp_replace(out, r"^(-?)\.", "$10.")
    out = F.regexp_replace(out, r"\.$", "")
    return F.regexp_replace(out, r"^(-?)0+(\d)", "$1$2")


def _order_entry(o: Column, k: Column, m: Column, seed: Column, maps: _Maps) -> Column:
    obr, sp = o["seg"], maps.sp
    number = k + 1
    # The ORC before this OBR in its patient's group (ORM^O01 pairs them in order); none: no ORC fields.
    before = F.filter(m["orc"], lambda c: (c["grp"] == o["grp"]) & (c["pos"] < o["pos"]))
    orc = F.try_element_at(before, F.lit(-1))["seg"]
    status = F.coalesce(
        _lookup(_ORDER_STATUS, _value(orc, "ORC", 5, sp)),
        _lookup(_ORDER_CONTROL, _value(orc, "ORC", 1, sp)),
        F.lit("unknown"),
    )
    placer = F.coalesce(_order_identifier(obr, "OBR", 2, "PLAC", maps), _order_identifier(orc, "ORC", 2, "PLAC", maps))
    filler = F.coalesce(_order_identifier(obr, "OBR", 3, "FILL", maps), _order_identifier(orc, "ORC", 3, "FILL", maps))
    priority = F.coalesce(_value(orc, "ORC", 7, sp, 6), _value(obr, "OBR", 27, sp, 6))
    identifiers = F.array_compact(F.array(placer, filler, _stageline_identifier(o["sender"], "ORD", o["num"])))
    return _keyed_entry(
        _uuid(seed, F.concat(F.lit("ORD/"), number.cast("string"))),
        "ServiceRequest",
        identifiers,
        status.alias("status"),
        F.lit("order").alias("intent"),
        _lookup(_PRIORITY, priority).alias("priority"),
        _codeable(_rep(obr, "OBR", 4, sp), maps).alias("code"),
        _subject(o["patient"]).alias("subject"),
        F.coalesce(_datetime(_value(orc, "ORC", 9, sp), maps), _datetime(_value(obr, "OBR", 6, sp), maps)).alias(
            "authoredOn"
        ),
        # The IG's ORDER_DETAIL NTE: the NTE right after the OBR (NTE-3 → note.text).
        _annotations(o["notes"]).alias("note"),
    )


def _annotations(notes: Column) -> Column:
    """NTE-3 texts as Annotations (``note``), NULL for none."""
    return F.when(F.size(notes) > 0, F.transform(notes, lambda t: F.struct(t.alias("text"))))


# --- data types --------------------------------------------------------------------------------


def _codeable(raw: Column, maps: _Maps, *, default_system: str | None = None) -> Column:
    """CWE/CE (one raw repetition: the field's first) → CodeableConcept: a coding per triplet (1-3
    and 4-6), the systems from ``code_systems``; text from CWE-9, else the display of a code nobody
    coded."""
    return _with_rep(raw, maps.sp, lambda r: _codeable_of_rep(r, maps, default_system))


def _codeable_of_rep(r: Column, maps: _Maps, default_system: str | None) -> Column:
    sp = maps.sp

    def coding(code: int) -> Column:
        name = _c(r, sp, code + 2)
        system = _lookup(maps.code_systems, name)
        if default_system is not None:
            system = F.coalesce(system, F.when(name.isNull(), F.lit(default_system)))
        value = _code(_c(r, sp, code))
        return F.when(
            value.isNotNull(),
            F.struct(system.alias("system"), value.alias("code"), _c(r, sp, code + 1).alias("display")),
        )

    codings = _nonempty(F.array(coding(1), coding(4)))
    text = F.coalesce(_c(r, sp, 9), F.when(_code(_c(r, sp, 1)).isNull(), _c(r, sp, 2)))
    return let(
        codings, lambda cs: F.when(cs.isNotNull() | text.isNotNull(), F.struct(cs.alias("coding"), text.alias("text")))
    )


def _trimmed(x: Column) -> Column:
    """An identifier's value without the whitespace around it; NULL when nothing else is left."""
    out = F.regexp_replace(x, f"^{_SPACE}+|{_SPACE}+$", "")
    return F.when(out != "", out)


def _code(x: Column) -> Column:
    """A FHIR ``code`` from v2 text: trimmed, each inner run of whitespace one space; NULL when blank."""
    out = F.regexp_replace(F.regexp_replace(x, f"^{_SPACE}+|{_SPACE}+$", ""), f"{_SPACE}+", " ")
    return F.when(out != "", out)


def _required(concept: Column) -> Column:
    """A CodeableConcept FHIR requires (Observation.code, DiagnosticReport.code): "unknown" text
    when the message has none."""
    return F.coalesce(
        concept,
        F.struct(
            F.lit(None).cast("array<struct<system:string,code:string,display:string>>").alias("coding"),
            F.lit("unknown").alias("text"),
        ),
    )


def _date(v: Column) -> Column:
    """TS/DT → FHIR date (YYYY, YYYY-MM or YYYY-MM-DD; a time part is dropped). NULL if not a date."""
    return let(
        v, lambda v: let(_dtm_digits(v), lambda d: F.when(d.isNotNull(), _date_part(d, F.least(F.length(d), F.lit(8)))))
    )


def _datetime(v: Column, maps: _Maps) -> Column:
    """TS/DTM → FHIR dateTime; a time gets seconds and an offset (the value's, else ``timezone``).
    NULL if the text is not a valid DTM."""

    def build(v: Column, d: Column) -> Column:
        n = F.length(d)
        offset = F.regexp_extract(v, r"([+-]\d{4})$", 1)
        zone = F.when(
            offset != "", F.concat(F.substring(offset, 1, 3), F.lit(":"), F.substring(offset, 4, 2))
        ).otherwise(F.lit(maps.timezone))
        fraction = F.when(n == 14, F.regexp_extract(v, r"(\.\d{1,4})", 1)).otherwise(F.lit(""))
        time = F.concat(
            F.lit("T"),
            F.substring(d, 9, 2),
            F.lit(":"),
            F.when(n >= 12, F.substring(d, 11, 2)).otherwise(F.lit("00")),
            F.lit(":"),
            F.when(n >= 14, F.substring(d, 13, 2)).otherwise(F.lit("00")),
            fraction,
            zone,
        )
        return F.when(
            d.isNotNull(), F.concat(_date_part(d, F.least(n, F.lit(8))), F.when(n >= 10, time).otherwise(F.lit("")))
        )

    return let(v, lambda v: let(_dtm_digits(v), lambda d: build(v, d)))


def _dtm_digits(v: Column) -> Column:
    """The digits of a valid DTM (4 to 14 of them, a real calendar date and time), else NULL."""
    digits = F.regexp_extract(v, _DTM, 1)
    padded = F.concat(digits, F.substr(F.lit("0101000000"), F.length(digits) - 3, 14 - F.length(digits)))
    valid = v.rlike(_DTM) & F.try_to_timestamp(padded, F.lit("yyyyMMddHHmmss")).isNotNull()
    return F.when(valid, digits)


def _date_part(d: Column, n: Column) -> Column:
    return F.concat(
        F.substring(d, 1, 4),
        F.when(n >= 6, F.concat(F.lit("-"), F.substring(d, 5, 2))).otherwise(F.lit("")),
        F.when(n >= 8, F.concat(F.lit("-"), F.substring(d, 7, 2))).otherwise(F.lit("")),
    )
