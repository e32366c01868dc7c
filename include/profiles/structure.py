"""A message structure in HL7's abstract message syntax, and where a message departs from it.

    MSH [{SFT}] EVN PID [PD1] [{NK1}] PV1 [PV2] [{OBX}] [{IN1 [IN2] [{IN3}]}]

A segment id is required once; ``[...]`` is optional, ``{...}`` repeats (one or more), ``[{...}]``
any number, and ``<A|B>`` one of the alternatives — each of them a sequence. A message is matched
by following every way through the structure at once (a set of positions in the message's segment
list), so the work is the structure's size times the message's segments, with no backtracking.
When it does not match, the furthest segment any way reached is the place to report: a segment
that the structure wants there and the message lacks (101, required segment missing) when putting
one in gets further, else the segment found there is out of place (100, segment sequence error).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Departure", "Matcher", "Node", "StructureError", "depart", "parse_structure", "segment_ids"]

_TOKEN = re.compile(r"\s*(?:([A-Z][A-Z0-9]{2})|([\[\]{}<>|]))")
MAX_NODES = 2000
MAX_TRIALS = 1000
"""Segments beyond which a departure is not tried for a missing segment (reported as found)."""


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
    ended too soon), and ``missing``, the segment id that belongs there, if putting one in helps."""

    index: int
    missing: str | None


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


class _Walk:
    """One matching run over a segment list; `furthest` is the furthest index any way reached.
    Position sets are updated in place, so a repetition costs what its own segments do (a message
    of 50,000 OBX is 50,000 steps, not 50,000 times a growing set)."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.furthest = 0

    def advance(self, node: Node, at: set[int]) -> set[int]:
        if not at:
            return at
        kind = node.kind
        if kind == "seg":
            ids, name, size = self.ids, node.name, len(self.ids)
            out = {p + 1 for p in at if p < size and ids[p] == name}
            if out:
                self.furthest = max(self.furthest, max(out))
            return out
        if kind == "seq":
            for item in node.items:
                at = self.advance(item, at)
            return at
        if kind == "opt":
            return at | self.advance(node.items[0], at)
        if kind == "alt":
            out = set()
            for item in node.items:
                out |= self.advance(item, at)
            return out
        reached = set(self.advance(node.items[0], at))  # rep: one or more
        frontier = reached
        while frontier:
            frontier = self.advance(node.items[0], frontier) - reached
            reached |= frontier
        return reached


class Matcher:
    """`depart` for one structure, remembering the answer for the last shapes seen: a feed sends
    the same few segment lists over and over, so most messages cost one dictionary probe."""

    def __init__(self, structure: Node, *, remember: int = 4096, longest: int = 256) -> None:
        self.structure = structure
        self.known = segment_ids(structure)
        self._seen: dict[tuple[str, ...], Departure | None] = {}
        self._remember = remember
        self._longest = longest  # a longer list is matched, not remembered (memory stays bounded)

    def __call__(self, ids: list[str]) -> Departure | None:
        if len(ids) > self._longest:
            return depart(self.structure, ids, self.known)
        key = tuple(ids)
        try:
            return self._seen[key]
        except KeyError:
            pass
        found = depart(self.structure, ids, self.known)
        if len(self._seen) >= self._remember:
            self._seen.clear()
        self._seen[key] = found
        return found


def depart(structure: Node, ids: list[str], known: set[str]) -> Departure | None:
    """None when `ids` (the message's segment ids, in order) fits `structure`, else where not.
    `known` is `segment_ids(structure)` (the candidates for a missing segment)."""
    walk = _Walk(ids)
    if len(ids) in walk.advance(structure, {0}):
        return None
    at = walk.furthest
    if len(ids) > MAX_TRIALS:  # a trial insertion per known segment: kept to lists of bounded length
        return Departure(at, None)
    for name in sorted(known):
        trial = _Walk(ids[:at] + [name] + ids[at:])
        ends = trial.advance(structure, {0})
        if len(ids) + 1 in ends or trial.furthest > at + 1:
            return Departure(at, name)
    return Departure(at, None)
