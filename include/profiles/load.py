"""Reading profile files (TOML, docs/profiles.md) into `Profile`s, every problem at once.

A profile names the message types it is for, their structure (`structure`), the rules of the
segments' fields, and the value sets those rules test against: HL7 tables from table files the
profile names (`tables`, shipped in config/profiles/hl7_tables.toml), inline `values`, or a
Stageline lookup table (`lookup`, the codes of `<config>/lookups/<name>.csv`). A profile is read
once, when the connections are loaded, so nothing here runs per message.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from include.profiles.datatypes import COMPOSITES, FORMATTED, TYPES
from include.profiles.fast import segment_patterns
from include.profiles.field_rule import FieldRule
from include.profiles.structure import Matcher, StructureError, parse_structure, segment_ids
from include.schema.reading import read_config_bytes

__all__ = ["FieldRule", "Profile", "ProfileError", "read_profile", "read_profiles"]

_TYPE = re.compile(r"[A-Z][A-Z0-9]{2}\^[A-Z0-9]{3}")
_SEGMENT = re.compile(r"[A-Z][A-Z0-9]{2}")
_USAGE = ("R", "O", "X")
_RULE_KEYS = frozenset(
    {"name", "type", "usage", "repeat", "length", "table", "values", "lookup", "required_components"}
)
_PROFILE_KEYS = frozenset({"name", "message_types", "structure", "z_segments", "tables", "segment_rules", "segments"})
MAX_FIELD = 999
MAX_VALUES = 100_000


class ProfileError(ValueError):
    """A profile that cannot be used: ``problems`` lists each one as ``key: what is wrong``."""

    def __init__(self, path: Path, problems: Sequence[str]) -> None:
        self.path = path
        self.problems = list(problems)
        super().__init__(f"{path}: " + "; ".join(self.problems))


@dataclass(frozen=True, slots=True)
class Profile:
    """One profile file: the message types it is for, their structure, the field rules by segment."""

    name: str
    path: Path
    message_types: frozenset[str]
    matcher: Matcher
    allow_z: bool
    rules: Mapping[str, tuple[FieldRule, ...]]
    sources: tuple[Path, ...] = ()  # the files it was read from (itself, its tables, its shared rules)
    fast: Mapping[str, re.Pattern[str]] = field(default_factory=dict)  # `include.profiles.fast`


def read_profiles(paths: Sequence[Path], *, lookups: Path | None = None) -> tuple[Profile, ...]:
    """Each path's profile; ProfileError (the first file with a problem, all of its problems) if
    any cannot be used, or if two claim the same message type."""
    out = [read_profile(p, lookups=lookups) for p in paths]
    seen: dict[str, Path] = {}
    for profile in out:
        for kind in sorted(profile.message_types):
            if kind in seen:
                raise ProfileError(profile.path, [f"message type {kind} is also the subject of {seen[kind]}"])
            seen[kind] = profile.path
    return tuple(out)


def read_profile(path: Path, *, lookups: Path | None = None) -> Profile:
    """Read and check one profile file. `lookups`: the directory of the `lookup` tables' CSVs."""
    raw = _read_toml(path)
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ProfileError(path, ["not a TOML table"])
    for key in sorted(set(raw) - _PROFILE_KEYS):
        problems.append(f"{key}: unknown key (known: {', '.join(sorted(_PROFILE_KEYS))})")
    name = raw.get("name", path.stem)
    if not isinstance(name, str):
        problems.append("name: must be a string")
        name = path.stem
    kinds = raw.get("message_types")
    if not (isinstance(kinds, list) and kinds and all(isinstance(k, str) and _TYPE.fullmatch(k) for k in kinds)):
        problems.append('message_types: must be a non-empty list such as ["ADT^A01", "ADT^A04"]')
        kinds = []
    matcher = None
    structure = raw.get("structure")
    if not isinstance(structure, str):
        problems.append('structure: must be a string such as "MSH EVN PID [PD1] PV1"')
    else:
        try:
            matcher = Matcher(parse_structure(structure))
        except StructureError as exc:
            problems.append(f"structure: {exc}")
    z = raw.get("z_segments", "allow")
    if z not in ("allow", "refuse"):
        problems.append('z_segments: must be "allow" or "refuse"')
    tables = _read_tables(path, raw.get("tables", []), problems)
    rules = _read_rules(raw.get("segments", {}), tables, lookups, problems)
    if matcher is not None:
        for segment in sorted(set(rules) - segment_ids(matcher.structure)):
            problems.append(f"segments.{segment}: not in the structure")
        shared = _shared_rules(path, raw.get("segment_rules", []), tables, lookups, problems)
        named = segment_ids(matcher.structure)
        rules = {**{k: v for k, v in shared.items() if k in named}, **rules}
    if problems or matcher is None:
        raise ProfileError(path, problems)
    return Profile(
        name=name,
        path=path,
        message_types=frozenset(kinds),
        matcher=matcher,
        allow_z=z == "allow",
        rules=rules,
        sources=(path, *_sources(path, raw.get("tables"), raw.get("segment_rules"))),
        fast=segment_patterns(rules),
    )


def _sources(profile: Path, *lists: Any) -> list[Path]:
    return [(profile.parent / name).resolve() for names in lists if isinstance(names, list) for name in names]


def _read_toml(path: Path) -> Any:
    try:
        text = read_config_bytes(path)
    except FileNotFoundError:
        raise ProfileError(path, ["no such file"]) from None
    except Exception as exc:  # read_config_bytes' own refusals (not a regular file, too large)
        raise ProfileError(path, [str(exc)]) from None
    try:
        return tomllib.loads(text.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ProfileError(path, [f"not valid TOML: {exc}"]) from None


def _named_files(profile: Path, names: Any, key: str, problems: list[str]) -> Iterator[tuple[str, Path, Any]]:
    """(where, path, parsed TOML) of each file a profile names under `key` (paths relative to the
    profile, resolving inside its directory: a profile copied from elsewhere reads nothing else);
    a file that cannot be read is a problem, and is skipped."""
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        problems.append(f"{key}: must be a list of file paths (relative to the profile)")
        return
    home = profile.parent.resolve()
    for n, name in enumerate(names):
        path = (home / name).resolve()
        if not path.is_relative_to(home):  # absolute, `..` or a symlink out: not read, not named
            problems.append(f"{key}[{n}]: must be a file in the profile's directory (or below it)")
            continue
        try:
            yield f"{key}[{n}]: {path}", path, _read_toml(path)
        except ProfileError as exc:
            problems.append(f"{key}[{n}]: {exc}")


def _read_tables(profile: Path, names: Any, problems: list[str]) -> dict[str, frozenset[str]]:
    """The value sets of the table files a profile names (`tables`)."""
    out: dict[str, frozenset[str]] = {}
    for where, _, raw in _named_files(profile, names, "tables", problems):
        entries = raw.get("tables") if isinstance(raw, dict) else None
        if not isinstance(entries, dict):
            problems.append(f"{where}: has no [tables.<id>] tables")
            continue
        for table, body in entries.items():
            values = body.get("values") if isinstance(body, dict) else None
            if not (isinstance(values, list) and values and all(isinstance(v, str) for v in values)):
                problems.append(f"{where}: tables.{table}.values must be a non-empty list of strings")
                continue
            out[str(table)] = frozenset(values)
    return out


def _shared_rules(
    profile: Path, names: Any, tables: dict[str, frozenset[str]], lookups: Path | None, problems: list[str]
) -> dict[str, tuple[FieldRule, ...]]:
    """The `[segments.<ID>]` rules of the files a profile shares them from (`segment_rules`); a
    later file's segment replaces an earlier one's."""
    out: dict[str, tuple[FieldRule, ...]] = {}
    for where, _, raw in _named_files(profile, names, "segment_rules", problems):
        own: list[str] = []
        out.update(_read_rules(raw.get("segments", {}) if isinstance(raw, dict) else None, tables, lookups, own))
        problems.extend(f"{where}: {p}" for p in own)
    return out


def _read_rules(
    segments: Any, tables: dict[str, frozenset[str]], lookups: Path | None, problems: list[str]
) -> dict[str, tuple[FieldRule, ...]]:
    if not isinstance(segments, dict):
        problems.append("segments: must be a table of [segments.<ID>] tables")
        return {}
    out: dict[str, tuple[FieldRule, ...]] = {}
    for segment, fields in segments.items():
        where = f"segments.{segment}"
        if not _SEGMENT.fullmatch(segment):
            problems.append(f"{where}: not a segment id")
            continue
        if not isinstance(fields, dict):
            problems.append(f"{where}: must be a table of field number = {{...}}")
            continue
        rules = []
        for number, body in fields.items():
            rule = _read_rule(segment, number, body, f"{where}.{number}", tables, lookups, problems)
            if rule is not None:
                rules.append(rule)
        out[segment] = tuple(sorted(rules, key=lambda r: r.field))
    return out


def _read_rule(
    segment: str,
    number: str,
    body: Any,
    where: str,
    tables: dict[str, frozenset[str]],
    lookups: Path | None,
    problems: list[str],
) -> FieldRule | None:
    before = len(problems)
    if not (number.isdigit() and 1 <= int(number) <= MAX_FIELD) or (segment == "MSH" and number in ("1", "2")):
        problems.append(f"{where}: a field number from 1 to {MAX_FIELD} (MSH: from 3)")
    if not isinstance(body, dict):
        problems.append(f'{where}: must be a table such as {{ type = "CX", usage = "R" }}')
        return None
    for key in sorted(set(body) - _RULE_KEYS):
        problems.append(f"{where}.{key}: unknown key (known: {', '.join(sorted(_RULE_KEYS))})")
    kind = body.get("type", "ST")
    if kind not in TYPES:
        problems.append(f"{where}.type: unknown data type {kind!r}")
    usage = body.get("usage", "O")
    if usage not in _USAGE:
        problems.append(f"{where}.usage: must be R (required), O (optional) or X (not supported)")
    repeat = body.get("repeat", False)
    if not isinstance(repeat, bool):
        problems.append(f"{where}.repeat: must be true or false")
    length = body.get("length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
        problems.append(f"{where}.length: must be a positive integer")
    components = body.get("required_components", [])
    if not (
        isinstance(components, list)
        and all(isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= 99 for c in components)
    ):
        problems.append(f"{where}.required_components: must be a list of component numbers")
        components = []
    elif components and kind in TYPES and kind not in COMPOSITES:
        problems.append(f"{where}.required_components: type {kind} has no components")
    values, value_set = _value_set(body, where, tables, lookups, problems)
    name = body.get("name", "")
    if not isinstance(name, str):
        problems.append(f"{where}.name: must be a string")
    if len(problems) > before:
        return None
    return FieldRule(
        segment=segment,
        field=int(number),
        name=name,
        type=kind,
        usage=usage,
        repeat=repeat,
        length=length,
        values=values,
        value_set=value_set,
        required_components=tuple(components),
        composite=kind in COMPOSITES,
        formatted=tuple((n, t) for n, t in enumerate(COMPOSITES.get(kind, ()), 1) if t in FORMATTED),
    )


def _value_set(
    body: dict[str, Any], where: str, tables: dict[str, frozenset[str]], lookups: Path | None, problems: list[str]
) -> tuple[frozenset[str] | None, str]:
    given = [k for k in ("table", "values", "lookup") if k in body]
    if len(given) > 1:
        problems.append(f"{where}: one of table, values, lookup (not {' and '.join(given)})")
        return None, ""
    if "table" in body:
        table = body["table"]
        if not isinstance(table, str) or table not in tables:
            problems.append(f"{where}.table: {table!r} is in none of the profile's table files")
            return None, ""
        return tables[table], f"HL7 table {table}"
    if "values" in body:
        values = body["values"]
        if not (isinstance(values, list) and values and all(isinstance(v, str) for v in values)):
            problems.append(f"{where}.values: must be a non-empty list of strings")
            return None, ""
        return frozenset(values), "the profile's values"
    if "lookup" in body:
        return _lookup(body["lookup"], where, lookups, problems)
    return None, ""


def _lookup(name: Any, where: str, lookups: Path | None, problems: list[str]) -> tuple[frozenset[str] | None, str]:
    """The codes of Stageline lookup table `name` (`<config>/lookups/<name>.csv`)."""
    from include.store.lookups import LookupTableError, read_table_file

    if not isinstance(name, str) or lookups is None:
        problems.append(f"{where}.lookup: a lookup table name (and a config dir with lookups/)")
        return None, ""
    path = lookups / f"{name}.csv"
    if "/" in name or "\\" in name or not path.is_file():
        problems.append(f"{where}.lookup: no lookup table {name!r} ({path})")
        return None, ""
    try:
        entries = read_table_file(name, path)
    except LookupTableError as exc:
        problems.append(f"{where}.lookup: {exc}")
        return None, ""
    if len(entries) > MAX_VALUES:
        problems.append(f"{where}.lookup: more than {MAX_VALUES} codes")
        return None, ""
    return frozenset(entries), f"lookup table {name}"
