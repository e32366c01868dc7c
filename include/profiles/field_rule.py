"""One field rule of a profile: what a field of a segment must hold (read by `load`, applied by
`check`, turned into a pattern by `fast`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FieldRule"]


@dataclass(frozen=True, slots=True)
class FieldRule:
    """What one field of a segment must hold. ``values`` (None: no value set) applies to the
    whole value of a primitive type, to the first component of a composite one."""

    segment: str
    field: int
    name: str
    type: str
    usage: str = "O"
    repeat: bool = False
    length: int | None = None
    values: frozenset[str] | None = None
    value_set: str = ""  # the set's name, for a finding's text ("HL7 table 0001")
    required_components: tuple[int, ...] = ()
    composite: bool = False
    formatted: tuple[tuple[int, str], ...] = ()  # (component, its type) of the components with a format
