"""Testing one message against its connection's profiles: what is wrong, and where.

A finding carries an HL7 table 0357 code — 100 segment sequence, 101 required field (or segment,
or component) missing, 102 data type (a malformed value, a repetition the field does not allow, a
value longer than its length), 103 table value not found, 200 a message type no profile is for —
and its place as an ERL (segment, its occurrence, field, repetition, component). Texts name the
rule, never the value (no PHI in an ACK's ERR-8 or a log). At most `MAX_FINDINGS` are kept (an
ACK's ERRs, the stored list): more says nothing a sender can use. All of them are counted, so the
summary and a route's `findings > n` see the true number; the work stays linear in the message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from include.profiles.datatypes import FORMATTED, bad_primitive
from include.profiles.field_rule import FieldRule
from include.profiles.load import Profile

__all__ = ["MAX_FINDINGS", "Finding", "Survey", "findings", "findings_json", "stored_count", "survey"]

MAX_FINDINGS = 20
MAX_TEXT = 200
"""Characters of one finding's text the store keeps (a long rule name is cut, not a row grown)."""
_MESSAGE_TYPE = re.compile(r"[A-Z0-9]{1,3}(?:\^[A-Z0-9]{1,3})?")
_SEGMENT_ID = re.compile(r"[A-Z][A-Z0-9]{2}")
_NOT_AN_ID = "#"
"""What the structure sees for a segment whose id is not three characters: no structure names it,
and a long id (a stray line break can make a field's text one) is neither kept nor remembered."""

SEGMENT_SEQUENCE = "100"
REQUIRED_MISSING = "101"
DATA_TYPE = "102"
TABLE_VALUE = "103"
UNSUPPORTED_TYPE = "200"


@dataclass(frozen=True, slots=True)
class Finding:
    """One departure from the profile: table 0357 ``code``, where (``segment`` and its
    ``sequence``; ``field``, ``repetition``, ``component`` when it is inside one), and ``text``."""

    code: str
    segment: str
    sequence: int = 1
    field: int | None = None
    repetition: int = 1
    component: int | None = None
    text: str = ""

    def where(self) -> str:
        """The place as ERL text: ``PID^1^3^1^1``; repetition and component only when they say more."""
        inside: tuple[int, ...] = ()
        if self.field is not None:
            deeper = self.component is not None or self.repetition > 1
            inside = (
                (self.field, self.repetition, self.component)
                if self.component is not None
                else ((self.field, self.repetition) if deeper else (self.field,))
            )
        return "^".join([self.segment, str(self.sequence), *map(str, inside)])


def findings_json(found: Sequence[Finding]) -> str:
    """The findings as the store keeps them: a JSON array of {code, where, text}. When there were
    more than it lists (a `Survey` past `MAX_FINDINGS`), the first also carries ``total`` (how many)
    and ``codes`` (the table 0357 codes of all of them), so a route's `findings > 20` and `finding =
    "103"` answer for the whole message; readers that know only code, where and text are unchanged."""
    kept: list[dict[str, object]] = [
        {"code": f.code, "where": f.where(), "text": f.text[:MAX_TEXT]} for f in found[:MAX_FINDINGS]
    ]
    if isinstance(found, Survey) and found.total > len(kept):
        kept[0] |= {"total": found.total, "codes": sorted(found.codes)}
    return json.dumps(kept, separators=(",", ":"))


def stored_count(stored: list[object]) -> str:
    """How many findings a stored list (`findings_json`, parsed) stands for, as `messages show` and
    the view say it: its ``total`` and how many it lists when it kept only the first ones."""
    first = stored[0] if isinstance(stored, list) and stored else None
    total = first.get("total") if isinstance(first, dict) else None
    if isinstance(total, int) and total > len(stored):
        return f"{total}, the first {len(stored)} listed"
    return str(len(stored))


def findings(text: str, profiles: Sequence[Profile], *, quick: bool = True) -> list[Finding]:
    """What is wrong with HL7 message `text` (decoded, starting with its MSH) for `profiles`: the
    first `MAX_FINDINGS`. ``quick``: let a segment its `fast` pattern accepts skip the rule loop
    (False: the loop for every segment; the answer is the same, the tests compare the two)."""
    return list(survey(text, profiles, quick=quick))


class Survey(list[Finding]):
    """A message's first `MAX_FINDINGS` findings, and what all of them were: ``total`` (how many)
    and ``codes`` (their table 0357 codes)."""

    def __init__(self, first: Sequence[Finding] = ()) -> None:
        super().__init__()
        self.total = 0
        self.codes: set[str] = set()
        for finding in first:
            self.append(finding)

    def append(self, finding: Finding) -> None:
        self.total += 1
        self.codes.add(finding.code)
        if len(self) < MAX_FINDINGS:
            super().append(finding)


def survey(text: str, profiles: Sequence[Profile], *, quick: bool = True) -> Survey:
    """`findings`, counted: the first `MAX_FINDINGS`, with the number and codes of all of them."""
    fs = text[3:4]
    if len(text) < 8 or not text.startswith("MSH") or fs.isalnum() or not fs:
        return Survey([Finding(SEGMENT_SEQUENCE, "MSH", text="the message does not start with an MSH segment")])
    cs, rs, ss = text[4], text[5], (text[7] if text[7] != fs else "\x00")
    segments = [s for s in text.replace("\r\n", "\r").replace("\n", "\r").split("\r") if s]
    msh = segments[0].split(fs)
    msg_type = msh[8].split(cs) if len(msh) > 8 else []
    kind = "^".join(msg_type[:2])
    profile = next((p for p in profiles if kind in p.message_types), None)
    if profile is None:
        types = ", ".join(sorted(t for p in profiles for t in p.message_types))
        return Survey([Finding(UNSUPPORTED_TYPE, "MSH", 1, 9, text=f"{_type_named(kind)} is not one of {types}")])
    found = Survey()
    ids: list[str] = []
    counted: dict[str, int] = {}
    keep: list[tuple[str, int, str]] = []  # (id, its occurrence, the segment) for the structure
    for segment in segments:
        sid = segment[:3]
        if len(segment) > 3 and segment[3] != fs:  # the id runs on: not a segment id
            end = segment.find(fs)
            sid = segment if end < 0 else segment[:end]
        counted[sid] = n = counted.get(sid, 0) + 1
        if sid.startswith("Z") and len(sid) == 3 and profile.allow_z:
            continue
        keep.append((sid, n, segment))
        ids.append(sid if len(sid) == 3 else _NOT_AN_ID)
    departure = profile.matcher(ids)
    if departure is not None:
        found.append(_departure_finding(departure.index, departure.missing, keep, departure.costly))
    fast = profile.fast if quick and text[3:8] == "|^~\\&" else {}
    for sid, n, segment in keep:
        rules = profile.rules.get(sid)
        if rules:
            accepts = fast.get(sid)
            if accepts is not None and accepts.fullmatch(segment):
                continue  # nothing to find: the rules' own loop would say the same, slower
            _check_segment(segment, sid, n, rules, (fs, cs, rs, ss), found)
    return found


def _departure_finding(index: int, missing: str | None, keep: list[tuple[str, int, str]], costly: bool) -> Finding:
    if costly:  # the work budget ran out: where it got to, and no more structure checking
        sid, n, _ = keep[min(index, len(keep) - 1)]
        return Finding(SEGMENT_SEQUENCE, sid[:3], n, text="the structure is too costly to locate this departure in")
    if missing is not None:  # at the occurrence it would have: OBR^2 when one OBR came before
        n = next((m for sid, m, _ in reversed(keep[:index]) if sid == missing), 0) + 1
        before = keep[index - 1][0] if index > 0 else "MSH"
        after = before if _SEGMENT_ID.fullmatch(before) else _named(before)
        return Finding(REQUIRED_MISSING, missing, n, text=f"required segment {missing} missing after {after}")
    if index >= len(keep):  # the structure names nothing to put in (`depart` names one if it can)
        return Finding(REQUIRED_MISSING, keep[-1][0], keep[-1][1], text="the message ends before its required segments")
    sid, n, _ = keep[index]
    return Finding(SEGMENT_SEQUENCE, sid[:3], n, text=f"{_named(sid)} is not expected here")


def _named(sid: str) -> str:
    """A segment named by its id only when that is a segment id: anything else a sender put there
    may be PHI (a stray line break makes a field's text a "segment")."""
    if _SEGMENT_ID.fullmatch(sid):
        return f"segment {sid}"
    if len(sid) == 3:
        return "a segment with an invalid id"
    return f"a segment with an invalid id ({len(sid)} characters, not 3)"


def _type_named(kind: str) -> str:
    """MSH-9.1^9.2 named only when it has the message type's shape: anything else a sender put
    there may be PHI, and a finding's text goes into the ACK, the log and the store."""
    if not kind:
        return "an empty message type"
    return f"message type {kind}" if _MESSAGE_TYPE.fullmatch(kind) else "an unsupported message type"


def _check_segment(
    segment: str, sid: str, n: int, rules: tuple[FieldRule, ...], seps: tuple[str, ...], out: list[Finding]
) -> None:
    fs, rs = seps[0], seps[2]
    fields = segment.split(fs)
    shift = -1 if sid == "MSH" else 0  # MSH-1 is the separator itself: MSH-n is fields[n - 1]
    count = len(fields)
    for rule in rules:
        at = rule.field + shift
        value = fields[at] if at < count else ""
        if not value or value == '""':
            if rule.usage == "R":
                out.append(Finding(REQUIRED_MISSING, sid, n, rule.field, text=f"{_label(rule)} is required"))
            continue
        if rule.usage == "X":
            out.append(Finding(SEGMENT_SEQUENCE, sid, n, rule.field, text=f"{_label(rule)} is not supported"))
            continue
        if rs in value:
            reps = value.split(rs)
            if not rule.repeat:
                out.append(Finding(DATA_TYPE, sid, n, rule.field, 2, text=f"{_label(rule)} does not repeat"))
            for r, rep in enumerate(reps, 1):
                if rep:
                    _check_value(rep, rule, sid, n, r, seps, out)
        else:
            _check_value(value, rule, sid, n, 1, seps, out)


def _label(rule: FieldRule) -> str:
    return f"{rule.segment}-{rule.field}" + (f" ({rule.name})" if rule.name else "")


def _check_value(
    rep: str, rule: FieldRule, sid: str, n: int, r: int, seps: tuple[str, ...], out: list[Finding]
) -> None:
    if rule.length is not None and len(rep) > rule.length:
        out.append(Finding(DATA_TYPE, sid, n, rule.field, r, text=f"{_label(rule)} is longer than {rule.length}"))
    if not rule.composite:
        why = bad_primitive(rule.type, rep) if rule.type in FORMATTED else None
        if why is not None:
            out.append(Finding(DATA_TYPE, sid, n, rule.field, r, text=f"{_label(rule)} {why} ({rule.type})"))
        elif rule.values is not None and rep not in rule.values:
            out.append(Finding(TABLE_VALUE, sid, n, rule.field, r, text=f"{_label(rule)} is not in {rule.value_set}"))
        return
    cs = seps[1]
    if cs not in rep:  # one component: only the first component's rules can apply
        if rule.formatted and rule.formatted[0][0] == 1:
            _check_component(rep, rule.formatted[0][1], rule, sid, n, r, 1, seps, out)
        for c in rule.required_components:
            if c > 1:
                text = f"{_label(rule)} component {c} is required"
                out.append(Finding(REQUIRED_MISSING, sid, n, rule.field, r, c, text))
        if rule.values is not None and rep not in rule.values:
            out.append(Finding(TABLE_VALUE, sid, n, rule.field, r, 1, f"{_label(rule)} is not in {rule.value_set}"))
        return
    comps = rep.split(cs)
    for c in rule.required_components:
        if c > len(comps) or comps[c - 1] in ("", '""'):
            out.append(Finding(REQUIRED_MISSING, sid, n, rule.field, r, c, f"{_label(rule)} component {c} is required"))
    for c, kind in rule.formatted:
        if c <= len(comps) and comps[c - 1]:
            _check_component(comps[c - 1], kind, rule, sid, n, r, c, seps, out)
    if rule.values is not None and comps[0] and comps[0] not in rule.values:
        out.append(Finding(TABLE_VALUE, sid, n, rule.field, r, 1, f"{_label(rule)} is not in {rule.value_set}"))


def _check_component(
    comp: str, kind: str, rule: FieldRule, sid: str, n: int, r: int, c: int, seps: tuple[str, ...], out: list[Finding]
) -> None:
    why = bad_primitive(kind, comp.split(seps[3], 1)[0] if kind == "TS" else comp)
    if why is not None:
        out.append(Finding(DATA_TYPE, sid, n, rule.field, r, c, f"{_label(rule)} component {c} {why} ({kind})"))
