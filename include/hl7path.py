"""HL7 v2 field paths (`PID-3[2].1`): the grammar, shared by the Spark jobs (native Spark SQL in
`spark_jobs/hl7_fields.py`) and the listener (lane keys, here in plain Python).

Grammar and semantics are documented in `spark_jobs/hl7_fields.py`; `value()` follows the same
rules: separators from the message's own header, MSH numbering per HL7, first repetition by
default, missing or empty values are None, escapes returned raw.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["FieldPath", "FieldPathError", "parse_path", "value", "values"]

_PATH_RE = re.compile(
    r"""
    (?P<segment>[A-Z][A-Z0-9]{2})
    (?:\[(?P<occurrence>[0-9]+)\])?
    -(?P<field>[0-9]+)
    (?:\[(?P<repetition>[0-9]+)\])?
    (?:\.(?P<component>[0-9]+)(?:\.(?P<subcomponent>[0-9]+))?)?
    """,
    re.VERBOSE,
)
_ALNUM = string.ascii_letters + string.digits
MAX_INDEX = 99_999
"""The largest occurrence, field, repetition, component or subcomponent number a path may name: far
past any real message, and short of what a Spark int or an array index of the route stage holds."""
_GRAMMAR_HINT = "expected SEG[occurrence]-FIELD[repetition].COMPONENT.SUBCOMPONENT, e.g. 'PID-3[2].1'"


class FieldPathError(ValueError):
    """An HL7 field path that does not follow the grammar in this module's docstring."""


@dataclass(frozen=True)
class FieldPath:
    """A parsed HL7 path; ``None`` means "not addressed" (repetition defaults to the first)."""

    segment: str
    field: int
    occurrence: int = 1
    repetition: int | None = None
    component: int | None = None
    subcomponent: int | None = None

    def __str__(self) -> str:
        out = self.segment
        if self.occurrence != 1:
            out += f"[{self.occurrence}]"
        out += f"-{self.field}"
        if self.repetition is not None:
            out += f"[{self.repetition}]"
        if self.component is not None:
            out += f".{self.component}"
        if self.subcomponent is not None:
            out += f".{self.subcomponent}"
        return out


def parse_path(path: str) -> FieldPath:
    """Parse ``path`` so config errors surface at load time, not as NULL columns at run time."""
    if not isinstance(path, str):
        raise FieldPathError(f"HL7 field path must be a string, got {type(path).__name__}")
    match = _PATH_RE.fullmatch(path)
    if match is None:
        raise FieldPathError(f"invalid HL7 field path {path!r}: {_diagnose(path)}")
    texts = {k: v for k, v in match.groupdict().items() if k != "segment"}
    for name, text in texts.items():
        if text is not None and (len(text) > len(str(MAX_INDEX)) or int(text) > MAX_INDEX):
            shown = path if len(path) <= 80 else path[:80] + "…"
            raise FieldPathError(f"invalid HL7 field path {shown!r}: {name} number past {MAX_INDEX}")
    parts = {k: (int(v) if v is not None else None) for k, v in texts.items()}
    for name in ("occurrence", "field", "repetition", "component", "subcomponent"):
        if parts[name] == 0:
            raise FieldPathError(f"invalid HL7 field path {path!r}: {name} index 0, indices are 1-based")
    parsed = FieldPath(
        segment=match["segment"],
        field=int(match["field"]),  # the grammar requires it
        occurrence=parts["occurrence"] or 1,
        repetition=parts["repetition"],
        component=parts["component"],
        subcomponent=parts["subcomponent"],
    )
    if (
        parsed.segment == "MSH"
        and parsed.field in (1, 2)
        and (parsed.repetition is not None or parsed.component is not None)
    ):
        raise FieldPathError(
            f"invalid HL7 field path {path!r}: MSH-1 (field separator) and MSH-2 (encoding "
            "characters) have no repetitions or components"
        )
    return parsed


def _diagnose(path: str) -> str:
    """Name the most likely mistake in a path the grammar rejected."""
    if not path:
        return "empty path"
    if path != path.strip():
        return "surrounding whitespace"
    head = path[: len(path) - len(path.lstrip(_ALNUM))]
    if len(head) < 3 or not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{2}", head[:3]):
        return f"segment id must be 3 characters (a letter, then letters or digits); {_GRAMMAR_HINT}"
    if head[:3] != head[:3].upper():
        return f"segment id must be upper case ({head[:3].upper()!r}); {_GRAMMAR_HINT}"
    if len(head) > 3 or path[3:4] not in ("-", "["):
        return f"segment id must be followed by '-' and a field number; {_GRAMMAR_HINT}"
    return _GRAMMAR_HINT


_SEGMENTS = re.compile(r"\r\n?|\n")


def value(message: str | None, path: str | FieldPath) -> str | None:
    """The value at `path` in one message, or None (pure Python; for per-message work such as
    a listener's lane key)."""
    p = parse_path(path) if isinstance(path, str) else path
    return values(message, {"": p})[""]


def values(message: str | None, paths: Mapping[str, FieldPath]) -> dict[str, str | None]:
    """`value` of each of `paths` (by name) in one message, which is split once for all of them."""
    found: dict[str, str | None] = dict.fromkeys(paths)
    if message is None:
        return found
    text = message.lstrip("\r\n")
    if not text.startswith("MSH") or len(text) < 4:
        return found
    fs = text[3]
    segments = text.split("\r") if "\n" not in text else _SEGMENTS.split(text)
    enc = segments[0][4:].split(fs, 1)[0]
    padded = enc + "\0\0\0\0"
    seps = (fs, enc, padded[0], padded[1], padded[3])
    wanted = {p.segment for p in paths.values()}
    by_id: dict[str, list[str]] = {}
    for segment in segments:
        if segment[:3] in wanted and segment[3:4] in (fs, ""):
            by_id.setdefault(segment[:3], []).append(segment)
    for name, p in paths.items():
        occurrences = by_id.get(p.segment, ())
        if len(occurrences) >= p.occurrence:
            found[name] = _in_segment(occurrences[p.occurrence - 1], p, seps)
    return found


def _in_segment(segment: str, p: FieldPath, seps: tuple[str, str, str, str, str]) -> str | None:
    fs, enc, cs, rs, ss = seps
    fields = segment.split(fs)
    if p.segment == "MSH":
        if p.field == 1:
            return fs
        if p.field == 2:
            return enc or None
        index = p.field - 1
    else:
        index = p.field
    if index >= len(fields):
        return None
    raw = fields[index]
    if p.component is None and p.repetition is None:
        return (raw.split(rs)[0] if rs != "\0" else raw) or None
    reps = raw.split(rs) if rs != "\0" else [raw]
    rep_index = (p.repetition or 1) - 1
    if rep_index >= len(reps):
        return None
    out = reps[rep_index]
    if p.component is not None:
        comps = out.split(cs) if cs != "\0" else [out]
        if p.component > len(comps):
            return None
        out = comps[p.component - 1]
        if p.subcomponent is not None:
            subs = out.split(ss) if ss != "\0" else [out]
            if p.subcomponent > len(subs):
                return None
            out = subs[p.subcomponent - 1]
    return out or None
