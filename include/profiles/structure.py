"""A message structure in HL7's abstract message syntax, and where a message departs from it.

    MSH [{SFT}] EVN PID [PD1] [{NK1}] PV1 [PV2] [{OBX}] [{IN1 [IN2] [{IN3}]}]

A segment id is required once; ``[...]`` is optional, ``{...}`` repeats (one or more), ``[{...}]``
any number, and ``<A|B>`` one of the alternatives — each of them a sequence. A message is matched
left to right against the structure as an automaton whose states are the structure's segments:
a set of states per message segment, the step for a (set, id) pair remembered. When it does not
fit, a segment put in where the reading stops is the answer (101, required segment missing) when
the rest of the message then fits, or when the message ends there (the first segment of the
shortest way to the structure's end); else the furthest segment any reading reached is out of
place (100). A work budget bounds all of it, so a structure built to be costly costs one finding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Departure", "Matcher", "Node", "StructureError", "depart", "parse_structure", "segment_ids"]

_TOKEN = re.compile(r"\s*(?:([A-Z][A-Z0-9]{2})|([\[\]{}<>|]))")
MAX_NODES = 2000
MAX_STEPS = 20_000
"""Segment-to-segment steps a structure may allow (each optional repeating segment can be followed by
every later one): the automaton's size, so its memory and the cost of a message's first pass."""


class StructureError(ValueError):
    """The structure text is not abstract message syntax; the message says where."""


@dataclass(frozen=True, slots=True)
class Node:
    """``kind``: "seg" (``name``), "seq", "opt", "rep" or "alt" (``items``: their parts)."""

    kind: str
    name: str = ""
    items: tuple[Node, ...] = ()


@dataclass(frozen=True, slots=True)
class Departure:
    """Where a segment list leaves the structure: ``index`` into the list (= its length when it
    ended too soon), and ``missing``, the segment id that belongs there, if putting one in helps;
    ``costly`` when locating it went past the work budget (``index`` is as far as it got)."""

    index: int
    missing: str | None
    costly: bool = False


def parse_structure(text: str) -> Node:
    """The structure as a tree; StructureError for anything but well-formed syntax."""
    tokens: list[str] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise StructureError(f"unexpected text at character {pos}: {text[pos : pos + 10]!r}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    if len(tokens) > MAX_NODES:
        raise StructureError(f"more than {MAX_NODES} segments and brackets")
    node, at = _sequence(tokens, 0, closers=())
    if at != len(tokens):
        raise StructureError(f"unbalanced {tokens[at]!r} (token {at + 1})")
    if not node.items or node.items[0] != Node("seg", "MSH"):
        raise StructureError("a message structure starts with MSH")
    return node


def _sequence(tokens: list[str], at: int, closers: tuple[str, ...]) -> tuple[Node, int]:
    items: list[Node] = []
    while at < len(tokens) and tokens[at] not in closers:
        tok = tokens[at]
        if tok in ("[", "{"):
            close = "]" if tok == "[" else "}"
            inner, at = _sequence(tokens, at + 1, (close,))
            if at >= len(tokens) or tokens[at] != close:
                raise StructureError(f"{tok!r} without its {close!r}")
            if not inner.items:
                raise StructureError(f"empty {tok}{close}")
            items.append(Node("opt" if tok == "[" else "rep", items=(inner,)))
            at += 1
        elif tok == "<":
            choices = []
            while True:
                inner, at = _sequence(tokens, at + 1, ("|", ">"))
                if at >= len(tokens):
                    raise StructureError("'<' without its '>'")
                if not inner.items:
                    raise StructureError("an empty alternative in <...>")
                choices.append(inner)
                if tokens[at] == ">":
                    break
            items.append(Node("alt", items=tuple(choices)))
            at += 1
        elif tok in ("]", "}", ">", "|"):
            raise StructureError(f"unbalanced {tok!r} (token {at + 1})")
        else:
            items.append(Node("seg", tok))
            at += 1
    return Node("seq", items=tuple(items)), at


def segment_ids(node: Node) -> set[str]:
    """Every segment id the structure names."""
    if node.kind == "seg":
        return {node.name}
    return set().union(*(segment_ids(i) for i in node.items)) if node.items else set()


class _Automaton:
    """The structure as a position automaton (Glushkov): a state is one segment of the structure,
    and `follow` says which segments may come next. Matching walks the message once, left to right,
    as a set of states; the next set for a (set, segment id) pair is remembered, so a feed's
    repeated shapes cost a dictionary probe per segment. `spent` counts the uncached work."""

    def __init__(self, structure: Node) -> None:
        self.names: list[str] = []
        self.follow: list[set[int]] = []
        nullable, first, last = self._build(structure)
        steps = len(first) + sum(map(len, self.follow))
        if steps > MAX_STEPS:
            raise StructureError(f"the structure allows too many ways through ({steps} steps; at most {MAX_STEPS})")
        self.start = -1
        self.first = frozenset(first)
        self.accept = frozenset(last) | ({self.start} if nullable else set())
        self.next: dict[int, dict[str, frozenset[int]]] = {}  # state -> id -> the states it goes to
        self.before: dict[str, set[int]] = {}  # segment id -> the states it may follow
        for state, targets in [(self.start, self.first), *enumerate(self.follow)]:
            grouped: dict[str, set[int]] = {}
            for t in targets:
                grouped.setdefault(self.names[t], set()).add(t)
                self.before.setdefault(self.names[t], set()).add(state)
            self.next[state] = {k: frozenset(v) for k, v in grouped.items()}
        self._steps: dict[tuple[frozenset[int], str], frozenset[int]] = {}
        self.spent = 0

    def _build(self, node: Node) -> tuple[bool, set[int], set[int]]:
        if node.kind == "seg":
            self.names.append(node.name)
            self.follow.append(set())
            p = len(self.names) - 1
            return False, {p}, {p}
        if node.kind in ("opt", "rep"):
            nullable, first, last = self._build(node.items[0])
            if node.kind == "rep":
                for x in last:
                    self.follow[x] |= first
            return nullable or node.kind == "opt", first, last
        parts = [self._build(item) for item in node.items]
        if node.kind == "alt":
            return (
                any(n for n, _, _ in parts),
                set().union(*(f for _, f, _ in parts)),
                set().union(*(la for _, _, la in parts)),
            )
        nullable, first, last = True, set(), set()  # seq
        for n, f, la in parts:
            for x in last:
                self.follow[x] |= f
            if nullable:
                first |= f
            last = (last | la) if n else set(la)
            nullable = nullable and n
        return nullable, first, last

    def step(self, states: frozenset[int], sid: str) -> frozenset[int]:
        key = (states, sid)
        self.spent += 1
        out = self._steps.get(key)
        if out is None:
            empty: frozenset[int] = frozenset()
            out = empty.union(*(self.next[s].get(sid, empty) for s in states))
            self.spent += len(states) + len(out)
            if len(self._steps) >= REMEMBER_STEPS:
                self._steps.clear()
            self._steps[key] = out
        return out


REMEMBER_STEPS = 65536
"""Remembered (state set, segment id) steps per structure; past it the memory starts over."""
BUDGET_PER_SEGMENT = 64
"""Uncached work one check may spend per segment of the message (beyond a fixed allowance):
past it the check ends with one finding instead of going on (a structure built to be costly)."""
BUDGET_FLOOR = 200_000


class Matcher:
    """`depart` for one structure, remembering the answer for the last shapes seen: a feed sends
    the same few segment lists over and over, so most messages cost one dictionary probe."""

    def __init__(self, structure: Node, *, remember: int = 4096, longest: int = 256) -> None:
        self.structure = structure
        self.known = segment_ids(structure)
        self.automaton = _Automaton(structure)
        self._seen: dict[tuple[str, ...], Departure | None] = {}
        self._remember = remember
        self._longest = longest  # a longer list is matched, not remembered (memory stays bounded)

    def __call__(self, ids: list[str]) -> Departure | None:
        if len(ids) > self._longest:
            return _depart(self.automaton, ids)
        key = tuple(ids)
        try:
            return self._seen[key]
        except KeyError:
            pass
        found = _depart(self.automaton, ids)
        if len(self._seen) >= self._remember:
            self._seen.clear()
        self._seen[key] = found
        return found


def depart(structure: Node, ids: list[str], known: set[str] | None = None) -> Departure | None:
    """None when `ids` (the message's segment ids, in order) fits `structure`, else where not.
    (`known` is accepted for callers of the earlier form; the automaton knows its segments.)"""
    return _depart(_Automaton(structure), ids)


def _depart(auto: _Automaton, ids: list[str]) -> Departure | None:
    auto.spent = 0
    budget = BUDGET_FLOOR + BUDGET_PER_SEGMENT * len(ids)
    states, at = _run(auto, frozenset({auto.start}), ids, 0, budget)
    if at is None:
        return Departure(len(ids), None, costly=True)
    if at == len(ids) and states & auto.accept:
        return None
    # A segment put in at `at` is the answer (101) when the rest of the message then fits;
    # otherwise the place is the furthest any such try got (100 at the segment found there).
    furthest = at
    for name in sorted({name for s in states for name in auto.next[s]}):
        trial = auto.step(states, name)
        after, stop = _run(auto, trial, ids, at, budget)
        if stop is None:
            return Departure(furthest, None, costly=True)
        if stop == len(ids) and after & auto.accept:
            return Departure(at, name)
        furthest = max(furthest, stop)
    if at == len(ids):  # it ends too soon: the first segment of the shortest way to its end is missing
        return Departure(at, _next_required(auto, states))
    return Departure(furthest, None)


def _next_required(auto: _Automaton, states: frozenset[int]) -> str | None:
    """The first segment id on the shortest way from `states` to an accepting state (breadth first
    over the structure's segments, each in the structure's order: at most its steps, once)."""
    frontier = sorted(states)
    first: dict[int, str] = dict.fromkeys(frontier, "")
    while frontier:
        reached = []
        for state in frontier:
            for t in sorted(auto.first if state == auto.start else auto.follow[state]):
                if t in first:
                    continue
                first[t] = first[state] or auto.names[t]
                if t in auto.accept:
                    return first[t]
                reached.append(t)
        frontier = reached
    return None


def _run(
    auto: _Automaton, states: frozenset[int], ids: list[str], at: int, budget: int
) -> tuple[frozenset[int], int | None]:
    """Step from `states` through ids[at:]: the last non-empty set and where it stopped (None:
    the budget ran out)."""
    for sid in ids[at:]:
        following = auto.step(states, sid)
        if auto.spent > budget:
            return states, None
        if not following:
            break
        states = following
        at += 1
    return states, at
