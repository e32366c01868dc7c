"""`keys.toml` in the pipeline directory: which business keys to keep for search (issue 26).

    [keys]                      # for messages of every connection
    mrn = "PID-3.1"
    event = "MSH-9.2"

    [connections.lab-in]        # for messages of one connection, besides (or instead of) the above
    accession = "OBR-3.1"

A key is a name (lower case, digits, `_`; up to 32 characters) and an HL7 field path
(`include.hl7path`). A connection's own key of the same name as one in `[keys]` replaces it for that
connection. A missing file keeps no keys. Every problem is reported at once, each with its key, and
a bad file stops the stage task before it claims anything, as a bad route does.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from include.hl7path import FieldPath, FieldPathError, parse_path
from include.schema import ConfigProblem
from include.schema.items import ConfigProblemsError

FILE = "keys.toml"
NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_KEYS = 32
"""Keys one connection's messages may keep: each is an index row per message."""


class KeysConfigError(ConfigProblemsError):
    """keys.toml cannot be used: every problem, each with its key."""


@dataclass(frozen=True)
class KeyRules:
    """The keys to keep: `common` for every connection, `per_connection` on top of them."""

    common: Mapping[str, FieldPath] = field(default_factory=dict)
    per_connection: Mapping[str, Mapping[str, FieldPath]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.common) or any(self.per_connection.values())

    def for_connection(self, connection: str) -> Mapping[str, FieldPath]:
        own = self.per_connection.get(connection)
        return {**self.common, **own} if own else self.common

    @property
    def names(self) -> list[str]:
        """Every key name configured anywhere, sorted."""
        return sorted({*self.common, *(n for keys in self.per_connection.values() for n in keys)})


def parse_keys(doc: Mapping[str, Any], *, file: Path | None = None) -> KeyRules:
    """A parsed `keys.toml` document as `KeyRules`; KeysConfigError naming every problem."""
    problems: list[ConfigProblem] = []
    for key in doc:
        if key not in ("keys", "connections"):
            problems.append(ConfigProblem(file, key, "unknown table; expected [keys] or [connections.<name>]"))

    def table(raw: Any, where: str) -> dict[str, FieldPath]:
        if not isinstance(raw, Mapping):
            problems.append(ConfigProblem(file, where, f"must be a table, got {type(raw).__name__}"))
            return {}
        out: dict[str, FieldPath] = {}
        for name, path in raw.items():
            at = f"{where}.{name}"
            if not NAME.fullmatch(name):
                problems.append(ConfigProblem(file, at, "key name must be lower case letters, digits or _ (≤ 32)"))
            elif not isinstance(path, str):
                problems.append(ConfigProblem(file, at, f"must be an HL7 field path string, got {type(path).__name__}"))
            else:
                try:
                    out[name] = parse_path(path)
                except FieldPathError as exc:
                    problems.append(ConfigProblem(file, at, str(exc)))
        return out

    common = table(doc.get("keys", {}), "keys")
    per: dict[str, dict[str, FieldPath]] = {}
    connections = doc.get("connections", {})
    if not isinstance(connections, Mapping):
        problems.append(ConfigProblem(file, "connections", "must be a table of [connections.<name>] tables"))
        connections = {}
    for name, raw in connections.items():
        per[name] = table(raw, f"connections.{name}")
        if len({*common, *per[name]}) > MAX_KEYS:
            problems.append(ConfigProblem(file, f"connections.{name}", f"more than {MAX_KEYS} keys"))
    if len(common) > MAX_KEYS:
        problems.append(ConfigProblem(file, "keys", f"more than {MAX_KEYS} keys"))
    if problems:
        raise KeysConfigError(problems)
    return KeyRules(common=common, per_connection=per)


def load_keys(directory: Path) -> KeyRules:
    """`<directory>/keys.toml`, parsed; no file keeps no keys."""
    path = directory / FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return KeyRules()
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KeysConfigError([ConfigProblem(path, "", f"not valid TOML: {exc}")]) from None
    return parse_keys(doc, file=path)
