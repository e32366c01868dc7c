"""The plain-Python peer for the pipeline benchmark: route and transform with python-hl7.

What a small integration engine without Spark would do: one loop, ``hl7.parse`` per message, the
route conditions evaluated on the parsed tree and the transform rules applied to python-hl7's
object model (``Message`` / ``Segment`` / ``Field`` / ``Repetition`` / ``Component``), rendered
back with ``str(message)``. It applies the *same* configs as the Spark stage code —
``include.routes_config.parse_routes`` and ``include.transforms_config.parse_transforms``
validate them (plain Python, no Spark) — and aims at byte-identical output, so the benchmark
compares equal work. Semantics are the Spark modules' docstrings; in brief:

* routing reads ``hl7_fields`` values (first repetition by default, missing/empty -> no value,
  a leaf on a missing field is false) and emits one ``pending`` row per (message, destination),
  named by the first matching route in config order, or one ``unrouted`` row;
* transforms read and write whole fields when a path has no repetition index, escape constants
  with each message's own separators, never invent segments, render every segment with CR,
  handle batch envelopes and concatenated messages unit by unit, and give ``None`` for a payload
  that is not HL7 (destinations without a spec pass through byte for byte).

Where python-hl7 alone would not give Spark's answer, the peer adapts rather than differs:

* python-hl7 splits segments on CR only: LF and CRLF endings are normalised and blank lines
  dropped before ``hl7.parse`` (as the Spark jobs do).
* ``hl7.parse`` strips surrounding whitespace, which would eat trailing spaces of the last
  segment: such a payload is parsed with a sentinel segment appended and removed again.
* python-hl7 falls back to ``~ ^ &`` for separators MSH-2 does not declare; Spark never splits on
  an undeclared separator. Reads and writes therefore use the declared separators: a python-hl7
  container split on another character is read as its text.
* python-hl7's ``escape``/``unescape`` hex-encode non-ASCII and decode or drop ``\\H\\ \\N\\
  \\X..\\``; Spark escapes only separators and the escape character and decodes only
  ``\\F\\ \\S\\ \\T\\ \\R\\ \\E\\`` for JSON. The peer does the Spark version itself.
* Accessor paths (``message["PID.F3"]``) unescape and descend to the first leaf, and
  ``Segment.assign_field`` pads differently; the peer walks the containers itself.
* Route regexes run on Python's ``re`` with ``re.ASCII`` (Java's ``\\w \\d \\s`` and ``(?i)`` are
  ASCII by default). ``parse_routes`` only admits the syntax both engines share; matching on
  non-ASCII text may still differ in corners (Unicode line terminators and ``.``).

JSON is ``json.dumps(..., separators=(",", ":"), ensure_ascii=False)``, which writes what Spark's
``to_json`` writes (control characters included).

Known differences left in place, malformed input only: an MSH with nothing after MSH-2 is
mis-parsed by python-hl7; a segment that is just ``MSH``/``FHS``/``BHS`` after the first makes
``hl7.parse`` raise (routing) or stays untouched (transform; Spark applies the rules to it); a
segment id longer than three characters that starts like a header (``MSHX|``) is split like one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import hl7

from include.hl7path import FieldPath
from include.routes_config import PENDING, UNROUTED, AllOf, Condition, Leaf, Not, Route, parse_routes
from include.transforms_config import (
    HL7_CONTENT_TYPE,
    ClearField,
    CopyField,
    DropSegment,
    MapField,
    RenameSegment,
    Rule,
    SetField,
    Transform,
    parse_transforms,
)

__all__ = ["route_messages", "run", "transform_messages"]

Node = str | hl7.Container
"""An element of the parsed tree: a python-hl7 container or a leaf string (its raw text)."""

Lookups = Mapping[str, Mapping[str, str]]

_HEADERS = frozenset({"MSH", "FHS", "BHS"})
_UNIT_STARTS = frozenset({"MSH", "FHS", "BHS", "BTS", "FTS"})
# Text that needs no escaping under any separators (HL7 separators are never letters, digits, space).
_PLAIN = re.compile(r"[A-Za-z0-9 ]*")
# What hl7.parse strips from the end of a payload besides CR.
_TRAILING_WS = frozenset(" \t\n\x0b\x0c")


@dataclass(frozen=True)
class _Seps:
    """Separators a header declares ("" when MSH-2 omits one) and the encoding characters."""

    fs: str
    cs: str
    rs: str
    esc: str
    ss: str
    enc: str

    @classmethod
    def of(cls, header: str) -> _Seps:
        """From a header segment's text: the 4th character, then MSH-2 up to the next fs."""
        fs = header[3]
        enc = header[4:].split(fs, 1)[0]
        return cls(fs, enc[0:1], enc[1:2], enc[2:3], enc[3:4], enc)


@dataclass
class _Unit:
    """One message (parsed) or one batch-envelope segment run (kept as text), as Spark's units."""

    seps: _Seps
    message: hl7.Message | None = None
    raw: list[str] | None = None


# --- parsing -----------------------------------------------------------------------------------


def _segments(payload: str | None) -> list[str] | None:
    """CR/LF/CRLF-split segments without blank lines; python-hl7 only knows CR."""
    if payload is None:
        return None
    text = payload
    if "\n" in text:
        text = text.replace("\r\n", "\r").replace("\n", "\r")
    return [s for s in text.split("\r") if s]


def _is_header(segment: str) -> bool:
    return segment[:3] in _HEADERS and len(segment) >= 4


def _parse(segments: Sequence[str]) -> hl7.Message:
    """``hl7.parse`` of CR-joined segments, keeping trailing whitespace it would strip."""
    text = "\r".join(segments)
    if text[-1] in _TRAILING_WS:
        message = hl7.parse(text + "\r_")
        del message[-1]
        return message
    return hl7.parse(text)


def _route_message(segments: list[str] | None) -> tuple[hl7.Message, _Seps] | None:
    """The whole payload as one message for routing; None unless it starts with MSH."""
    if not segments or not segments[0].startswith("MSH") or len(segments[0]) < 4:
        return None
    return _parse(segments), _Seps.of(segments[0])


def _units(segments: list[str] | None) -> list[_Unit] | None:
    """Split a payload into units before each MSH and envelope segment; None unless HL7."""
    if not segments or not _is_header(segments[0]):
        return None
    starts = [i for i, s in enumerate(segments) if s[:3] in _UNIT_STARTS]
    if starts == [0] and segments[0].startswith("MSH"):  # the common case: one plain message
        return [_Unit(_Seps.of(segments[0]), message=_parse(segments))]
    first = _Seps.of(segments[0])
    units = []
    for begin, end in zip(starts, [*starts[1:], len(segments)]):
        chunk = segments[begin:end]
        seps = _Seps.of(chunk[0]) if _is_header(chunk[0]) else first
        if chunk[0].startswith("MSH") and len(chunk[0]) >= 4:
            units.append(_Unit(seps, message=_parse(chunk)))
        else:
            units.append(_Unit(seps, raw=chunk))
    return units


def _seg_id(segment: hl7.Segment) -> str:
    """The segment's text before its first field separator ("" for a blank one)."""
    head = segment[0]
    if isinstance(head, str):
        return head
    if len(head) == 1 and isinstance(head[0], str):
        return head[0]
    return str(head)


# --- reading and writing the tree ----------------------------------------------------------------


def _children(node: Node, sep: str) -> list[Node]:
    """``node`` split on ``sep``: the container itself when python-hl7 split it on that very
    separator, else its text split (a leaf, a value we wrote, or an undeclared-separator split)."""
    if not isinstance(node, str):
        if node.separator == sep:
            return node
        node = str(node)
    return node.split(sep) if sep and sep in node else [node]


def _text(node: Node) -> str:
    return node if isinstance(node, str) else str(node)


def _sublevels(path: FieldPath, seps: _Seps, *, whole_field: bool) -> list[tuple[str, int]]:
    """(separator, 1-based index) below the field. Rules read/write the whole field without a
    repetition index; ``hl7_fields`` (routing) always picks a repetition."""
    levels = []
    if not whole_field or path.repetition is not None or path.component is not None:
        levels.append((seps.rs, path.repetition or 1))
    if path.component is not None:
        levels.append((seps.cs, path.component))
    if path.subcomponent is not None:
        levels.append((seps.ss, path.subcomponent))
    return levels


def _descend(node: Node, levels: Sequence[tuple[str, int]]) -> str | None:
    """Raw text at ``levels`` below ``node``; None when an element is missing."""
    for sep, index in levels:
        if not sep:  # undeclared: element 1 is the whole text, there is no element 2
            if index != 1:
                return None
            continue
        kids = _children(node, sep)
        if index > len(kids):
            return None
        node = kids[index - 1]
    return _text(node)


def _read(segment: hl7.Segment, path: FieldPath, seps: _Seps) -> str | None:
    """Rule read: raw text (escapes kept, "" possible), None if absent."""
    if path.segment == "MSH" and path.field <= 2:
        return seps.fs if path.field == 1 else seps.enc
    if path.field >= len(segment):
        return None
    return _descend(segment[path.field], _sublevels(path, seps, whole_field=True))


_Maker = Callable[[list[Node]], hl7.Container]  # a segment's create_field / _repetition / _component


def _put(node: Node, levels: Sequence[tuple[str, int]], value: str, pad: bool, makers: Sequence[_Maker]) -> Node:
    """``node`` with the element at ``levels`` replaced by ``value`` (already escaped).

    Spark's ``_put`` on the tree: an existing element is replaced in place (a leaf becomes a
    container when something is written below it); a missing one is created with empty
    siblings only when ``pad`` and every separator on the way is declared.
    """
    if not levels:
        return value
    (sep, index), rest = levels[0], levels[1:]
    if not sep:
        return _put(node, rest, value, pad, makers[1:]) if index == 1 else node
    kids = _children(node, sep)
    container = kids if kids is node else makers[0](list(kids))
    if index <= len(container):
        container[index - 1] = _put(container[index - 1], rest, value, pad, makers[1:])
        return container
    if not pad or any(not s for s, i in rest if i > 1):
        return node
    container.extend([""] * (index - 1 - len(container)))
    container.append("".join(s * (i - 1) for s, i in rest if i > 1) + value)
    return container


def _write(segment: hl7.Segment, path: FieldPath, value: str, seps: _Seps, *, pad: bool) -> None:
    """Write ``value`` at ``path`` in ``segment`` (python-hl7 index = field number, MSH too)."""
    levels = _sublevels(path, seps, whole_field=True)
    makers = (segment.create_field, segment.create_repetition, segment.create_component)
    if path.field < len(segment):
        segment[path.field] = _put(segment[path.field], levels, value, pad, makers)
    elif pad and not any(not s for s, i in levels if i > 1):
        while len(segment) < path.field:
            segment.append(segment.create_field([""]))
        # Raw text, not Field([text]): a Field split on '~' would hide the separators inside it.
        segment.append("".join(s * (i - 1) for s, i in levels if i > 1) + value)
    else:
        return
    if any(s and s in value for s in (seps.fs, *(s for s, _i in levels))):
        _resplit(segment, seps)


def _resplit(segment: hl7.Segment, seps: _Seps) -> None:
    """Re-read a segment from its text after a write added structure at or above its level.

    Only a value that could not be escaped does that (MSH-2 without an escape character: Spark
    writes such constants raw, and in its text model they then *are* separators for later rules).
    The fields become leaf strings, split again lazily by :func:`_children`.
    """
    parts = str(segment).split(seps.fs)
    if parts[0] in _HEADERS:  # python-hl7's header layout: [MSH, fs, enc, MSH-3, ...]
        parts.insert(1, seps.fs)
    segment[:] = parts


def _escape(value: str, seps: _Seps, names: str, *, escape_escape: bool) -> str:
    """Spark's ``_escape``: the escape char first, then the named separators (f, s, r, t)."""
    esc = seps.esc
    if not esc:
        return value
    out = value.replace(esc, f"{esc}E{esc}") if escape_escape else value
    for name, sep, code in (("f", seps.fs, "F"), ("s", seps.cs, "S"), ("r", seps.rs, "R"), ("t", seps.ss, "T")):
        if name in names and sep:
            out = out.replace(sep, f"{esc}{code}{esc}")
    return out


def _constant(value: str, seps: _Seps, plain: bool) -> str:
    return value if plain else _escape(value, seps, "fsrt", escape_escape=True)


def _unescape(text: str, seps: _Seps) -> str:
    """Decode ``\\F\\ \\S\\ \\R\\ \\T\\ \\E\\`` in one pass; unknown and unterminated escapes stay."""
    esc = seps.esc
    if not esc or esc not in text:
        return text
    codes = {"F": seps.fs, "S": seps.cs, "R": seps.rs, "T": seps.ss, "E": esc}
    parts = text.split(esc)
    last = len(parts) - 1
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(part)
        elif i == last:
            out.append(esc + part)
        else:
            out.append(codes.get(part) or f"{esc}{part}{esc}")
    return "".join(out)


# --- routing -----------------------------------------------------------------------------------


class _RouteReader:
    """``hl7_fields`` values of one parsed message, each path read at most once."""

    def __init__(self, parsed: tuple[hl7.Message, _Seps] | None) -> None:
        self.message, self.seps = parsed if parsed is not None else (None, None)
        self._by_id: dict[str, list[hl7.Segment]] | None = None
        self._cache: dict[FieldPath, str | None] = {}

    def value(self, path: FieldPath) -> str | None:
        if path not in self._cache:
            self._cache[path] = self._read(path) if self.message is not None else None
        return self._cache[path]

    def _read(self, path: FieldPath) -> str | None:
        if self._by_id is None:
            self._by_id = {}
            for segment in self.message:
                self._by_id.setdefault(_seg_id(segment), []).append(segment)
        found = self._by_id.get(path.segment, ())
        if path.occurrence > len(found):
            return None
        segment = found[path.occurrence - 1]
        if path.segment == "MSH" and path.field <= 2:  # python-hl7: [MSH, fs, enc, MSH-3, ...]
            value = _text(segment[path.field]) if path.field < len(segment) else None
        else:
            # hl7_fields numbers only MSH the HL7 way, but python-hl7 splits FHS/BHS like MSH
            # (an extra fs element, the encoding characters kept as one unsplit leaf), so
            # FHS-n is one further along and FHS-1 is read from its text.
            envelope = path.segment in ("FHS", "BHS")
            index = path.field + envelope
            if index >= len(segment):
                return None
            node = _text(segment[index]) if envelope and index == 2 else segment[index]
            value = _descend(node, _sublevels(path, self.seps, whole_field=False))
        return value or None


def _compile(cond: Condition) -> Any:
    """A predicate over a :class:`_RouteReader` (regexes compiled once)."""
    if isinstance(cond, Leaf):
        path, op, expected = cond.path, cond.op, cond.value
        if op == "eq":
            return lambda r: r.value(path) == expected
        if op == "in":
            options = frozenset(expected)
            return lambda r: r.value(path) in options
        if op == "regex":
            search = re.compile(expected, re.ASCII).search
            return lambda r: (v := r.value(path)) is not None and search(v) is not None
        return lambda r: r.value(path) is not None
    if isinstance(cond, Not):
        inner = _compile(cond.condition)
        return lambda r: not inner(r)
    members = [_compile(c) for c in cond.conditions]
    if isinstance(cond, AllOf):
        return lambda r: all(m(r) for m in members)
    return lambda r: any(m(r) for m in members)


class _Router:
    """Validated routes, with the destination -> routes fan-out planned once (as Spark does)."""

    def __init__(self, routes: Sequence[Mapping[str, Any] | Route]) -> None:
        parsed = list(routes) if routes and all(isinstance(r, Route) for r in routes) else parse_routes(routes)
        self.names = [r.name for r in parsed]
        self.tests = [(lambda r: True) if r.when is None else _compile(r.when) for r in parsed]
        by_destination: dict[str, list[int]] = {}
        for i, r in enumerate(parsed):
            for dest in r.destinations:
                by_destination.setdefault(dest, []).append(i)
        self.by_destination = list(by_destination.items())

    def hits(self, parsed: tuple[hl7.Message, _Seps] | None) -> list[tuple[str, str]]:
        """(destination, route_name) per destination a matching route reaches, config order."""
        reader = _RouteReader(parsed)
        matched = [test(reader) for test in self.tests]
        out = []
        for dest, indices in self.by_destination:
            for i in indices:
                if matched[i]:
                    out.append((dest, self.names[i]))
                    break
        return out


def route_messages(
    payloads: list[str], routes: Sequence[Mapping[str, Any] | Route]
) -> list[tuple[int, str | None, str | None, str]]:
    """``route()``'s rows for ``payloads``: (index, destination, route_name, status)."""
    router = _Router(routes)
    rows: list[tuple[int, str | None, str | None, str]] = []
    for index, payload in enumerate(payloads):
        hits = router.hits(_route_message(_segments(payload)))
        if hits:
            rows.extend((index, dest, name, PENDING) for dest, name in hits)
        else:
            rows.append((index, None, None, UNROUTED))
    return rows


# --- transforms --------------------------------------------------------------------------------


class _Transformer:
    """Validated transform specs; applies one destination's rules to parsed units."""

    def __init__(self, specs: Sequence[Mapping[str, Any] | Transform], lookups: Lookups | None) -> None:
        lookups = lookups or {}
        self.specs = {t.destination: t for t in parse_transforms(specs, lookups=lookups)}
        self.lookups = lookups
        # Spark skips escaping a map result only when every value of the table (and the default)
        # is plain text; mirrored so an odd alphanumeric separator behaves the same.
        used = {r.table for t in self.specs.values() for r in t.rules if isinstance(r, MapField)}
        self.plain_tables = {name: all(_PLAIN.fullmatch(v) for v in lookups[name].values()) for name in used}

    def apply(self, spec: Transform, units: list[_Unit] | None) -> str | None:
        """Rules in order on every message unit, then HL7 or JSON text; None if not HL7."""
        if units is None:
            return None
        for unit in units:
            if unit.message is not None:
                for rule in spec.rules:
                    self._rule(rule, unit.message, unit.seps)
        if spec.output == "json":
            return _to_json(units)
        return "".join(str(u.message) if u.message is not None else "".join(s + "\r" for s in u.raw) for u in units)

    def _rule(self, rule: Rule, message: hl7.Message, seps: _Seps) -> None:
        if isinstance(rule, DropSegment):
            message[:] = [s for s in message if _seg_id(s) != rule.segment]
            return
        if isinstance(rule, RenameSegment):
            for segment in message:
                if _seg_id(segment) == rule.segment:
                    segment[0] = rule.to if isinstance(segment[0], str) else segment.create_field([rule.to])
            return
        if isinstance(rule, CopyField) and not rule.each:
            source = _nth(message, rule.source)
            value = _copy_value(_read(source, rule.source, seps) if source is not None else None, rule, seps)
            target = _nth(message, rule.target)
            if target is not None:
                _write(target, rule.target, value, seps, pad=value != "")
            return
        path = rule.target if isinstance(rule, CopyField) else rule.path
        if rule.each:
            targets = [s for s in message if _seg_id(s) == path.segment]
        else:
            one = _nth(message, path)
            targets = [one] if one is not None else []
        for segment in targets:
            self._edit(rule, segment, seps)

    def _edit(self, rule: SetField | ClearField | CopyField | MapField, segment: hl7.Segment, seps: _Seps) -> None:
        if isinstance(rule, SetField):
            value = _constant(rule.value, seps, _PLAIN.fullmatch(rule.value) is not None)
            _write(segment, rule.path, value, seps, pad=rule.value != "")
        elif isinstance(rule, ClearField):
            _write(segment, rule.path, "", seps, pad=False)
        elif isinstance(rule, CopyField):  # each: within this segment
            value = _copy_value(_read(segment, rule.source, seps), rule, seps)
            _write(segment, rule.target, value, seps, pad=value != "")
        else:
            key = _read(segment, rule.path, seps)
            if not key:  # map translates codes, it does not invent them
                return
            new = self.lookups[rule.table].get(key)
            if new is None:
                new = rule.default
            if new is None:  # default "keep"
                return
            plain = self.plain_tables[rule.table] and _PLAIN.fullmatch(rule.default or "") is not None
            _write(segment, rule.path, _constant(new, seps, plain), seps, pad=False)


def _nth(message: hl7.Message, path: FieldPath) -> hl7.Segment | None:
    """The ``path.occurrence``-th segment named ``path.segment``."""
    seen = 0
    for segment in message:
        if _seg_id(segment) == path.segment:
            seen += 1
            if seen == path.occurrence:
                return segment
    return None


def _copy_value(value: str | None, rule: CopyField, seps: _Seps) -> str:
    """Missing -> ""; escape what would be structure at the target (separators: all of them)."""
    value = value or ""
    if rule.source.segment == "MSH" and rule.source.field <= 2:
        return _escape(value, seps, "fsrt", escape_escape=True)
    depth = 1 + len(_sublevels(rule.target, seps, whole_field=True))
    return _escape(value, seps, "frst"[:depth], escape_escape=False)


def transform_messages(
    rows: list[tuple[str, str | None]],
    specs: Sequence[Mapping[str, Any] | Transform],
    lookups: Lookups | None = None,
) -> list[tuple[str, str | None]]:
    """``transform()``'s (content_type, payload) for each (destination, payload) row."""
    transformer = _Transformer(specs, lookups)
    out: list[tuple[str, str | None]] = []
    for destination, payload in rows:
        spec = transformer.specs.get(destination)
        if spec is None:
            out.append((HL7_CONTENT_TYPE, payload))
        else:
            out.append((spec.content_type, transformer.apply(spec, _units(_segments(payload)))))
    return out


# --- JSON ----------------------------------------------------------------------------------------


def _to_json(units: list[_Unit]) -> str:
    """``{"segments": [...]}`` as transform_rules documents it (python-hl7 has no JSON)."""
    segments = []
    for unit in units:
        seps = unit.seps
        if unit.message is not None:
            for segment in unit.message:
                name = _seg_id(segment)
                if name in _HEADERS:  # python-hl7: [id, fs, enc, MSH-3, ...]
                    fields = [seps.fs, _text(segment[2]), *(_field_json(f, seps) for f in segment[3:])]
                else:
                    fields = [_field_json(f, seps) for f in segment[1:]]
                segments.append({"segment": name, "fields": fields})
        else:
            for text in unit.raw:
                parts = text.split(seps.fs)
                if parts[0] in _HEADERS:
                    fields = [seps.fs, *parts[1:2], *(_field_json(f, seps) for f in parts[2:])]
                else:
                    fields = [_field_json(f, seps) for f in parts[1:]]
                segments.append({"segment": parts[0], "fields": fields})
    return json.dumps({"segments": segments}, separators=(",", ":"), ensure_ascii=False)


def _field_json(field: Node, seps: _Seps) -> Any:
    """A string without structure, else repetitions -> components -> subcomponents."""
    text = _text(field)
    if not any(s and s in text for s in (seps.rs, seps.cs, seps.ss)):
        return _unescape(text, seps)
    reps = []
    for rep in _children(field, seps.rs):
        comps = [[_unescape(_text(s), seps) for s in _children(c, seps.ss)] for c in _children(rep, seps.cs)]
        if len(comps) == 1 and len(comps[0]) == 1:
            reps.append(comps[0][0])
        else:
            reps.append([c[0] if len(c) == 1 else c for c in comps])
    return reps


# --- both, as one engine loop ---------------------------------------------------------------------


class Pipeline:
    """Routes and transforms, validated once; `process` is one message through both."""

    def __init__(
        self,
        routes: Sequence[Mapping[str, Any] | Route],
        specs: Sequence[Mapping[str, Any] | Transform],
        lookups: Lookups | None = None,
    ) -> None:
        self.router = _Router(routes)
        self.transformer = _Transformer(specs, lookups)

    def process(self, payload: str, counts: dict[str, int]) -> list[tuple[str, str | None]]:
        """(destination, output or None if it cannot be transformed) per destination; [] if unrouted.

        The message is parsed once for routing; the first destination with a spec reuses that parse
        (routing only reads it), every further one parses again, since rules edit the tree in place.
        """
        counts["messages"] += 1
        segments = _segments(payload)
        parsed = _route_message(segments)
        hits = self.router.hits(parsed)
        if not hits:
            counts["unrouted"] += 1
            return []
        reusable = parsed is not None and not any(s[:3] in _UNIT_STARTS for s in segments[1:])
        results: list[tuple[str, str | None]] = []
        for destination, _name in hits:
            counts["routed"] += 1
            spec = self.transformer.specs.get(destination)
            if spec is None:
                out: str | None = payload
                counts["passed_through"] += 1
            else:
                if reusable:
                    units: list[_Unit] | None = [_Unit(parsed[1], message=parsed[0])]
                    reusable = False
                else:
                    units = _units(segments)
                out = self.transformer.apply(spec, units)
                counts["transformed"] += 1
            if out is None:
                counts["failed"] += 1
            else:
                counts["bytes_out"] += len(out)
            results.append((destination, out))
        return results


def new_counts() -> dict[str, int]:
    return dict.fromkeys(("messages", "unrouted", "routed", "transformed", "passed_through", "failed", "bytes_out"), 0)


def run(
    payloads: list[str],
    routes: Sequence[Mapping[str, Any] | Route],
    specs: Sequence[Mapping[str, Any] | Transform],
    lookups: Lookups | None = None,
) -> dict[str, int]:
    """Route and transform every payload in one loop, in memory, as a naive engine would; counts."""
    pipeline = Pipeline(routes, specs, lookups)
    counts = new_counts()
    for payload in payloads:
        pipeline.process(payload, counts)
    return counts
