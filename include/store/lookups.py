"""Lookup tables held in the store: the code tables transform `map` rules translate through.

One row per (table, code) in `lookup_entries`. A table is replaced whole in one transaction, so a
reader sees either the old table or the new one, never half of each; a stage task reads them all
once, at its first micro-batch (code tables are small). Tables come from `code,value` CSV files
(`read_table_file`, `import_dir`: the CLI's `lookups import|sync`, the embedded stack's start-up).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from include.store.db import Store, Tx

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,199}")
MAX_CODE_CHARS = 200
MAX_VALUE_CHARS = 1000


class LookupTableError(ValueError):
    """A lookup table that cannot be stored as given; the message says which entry and why."""


def read_all(tx: Tx) -> dict[str, dict[str, str]]:
    """Every lookup table: `{table: {code: value}}`."""
    tables: dict[str, dict[str, str]] = {}
    for row in tx.all("lookup_entries_all"):
        tables.setdefault(row["table_name"], {})[row["code"]] = row["value"]
    return tables


def load_all(store: Store) -> dict[str, dict[str, str]]:
    """Every lookup table, read in a transaction of its own (`read_all`)."""
    with store.transaction(write=False) as tx:
        return read_all(tx)


def list_tables(tx: Tx) -> list[dict[str, Any]]:
    """Name, entry count and last change (epoch seconds) of each table."""
    return [dict(r) for r in tx.all("lookup_tables")]


def fingerprint(store: Store) -> tuple[tuple[object, ...], ...]:
    """What the lookup tables are now, in one small aggregate (name, entries, last change each):
    a long-running transform task re-reads them when this changes."""
    with store.transaction(write=False) as tx:
        return tuple(tuple(r.values()) for r in list_tables(tx))


def replace_table(tx: Tx, name: str, entries: Mapping[str, str]) -> int:
    """Replace table `name` with `entries` in the caller's transaction; the number stored."""
    _check(name, entries)
    tx.execute("lookup_delete_table", {"table_name": name})
    if entries:
        rows = [{"code": code, "value": value} for code, value in entries.items()]
        tx.execute("lookup_insert", {"table_name": name, "entries": json.dumps(rows)})
    return len(entries)


def delete_table(tx: Tx, name: str) -> int:
    return tx.execute("lookup_delete_table", {"table_name": name})


def read_csv(source: Path | str | Iterable[str]) -> dict[str, str]:
    """`code,value` rows (a header line `code,value` is required, so a column swap cannot go unseen)."""
    text = Path(source).read_text(encoding="utf-8") if isinstance(source, (str, Path)) else "".join(source)
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or [h.strip().lower() for h in header] != ["code", "value"]:
        raise LookupTableError(f"the first line must be the header 'code,value', got {header!r}")
    entries: dict[str, str] = {}
    for line, row in enumerate(reader, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 2:
            raise LookupTableError(f"line {line}: expected 2 columns (code,value), got {len(row)}")
        code, value = row
        if code in entries:
            raise LookupTableError(f"line {line}: code {code!r} appears twice")
        entries[code] = value
    return entries


def read_table_file(name: str, path: Path) -> dict[str, str]:
    """Check the table name and read `path` (`code,value` rows); LookupTableError names the file."""
    if not NAME.fullmatch(name):
        raise LookupTableError(
            f"{path}: table name {name!r}: use letters, digits, '_', '.', '-' (200 at most), not starting with a digit"
        )
    try:
        entries = read_csv(path)
    except LookupTableError as exc:
        raise LookupTableError(f"{path}: {exc}") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise LookupTableError(f"{path}: cannot read it as UTF-8 CSV: {exc}") from None
    if not entries:
        raise LookupTableError(
            f"{path}: no entries after the header line (to remove table "
            f"{name!r}, use `stageline lookups delete {name}`)"
        )
    return entries


def import_dir(store: Store, directory: Path) -> list[tuple[str, int]]:
    """Import every `directory/*.csv` as the table named by its file stem, all in one transaction
    (every file is read and checked first: one bad file imports nothing). Tables without a file
    are left alone. Returns (table, entries) per file; raises LookupTableError."""
    tables = {path.stem: read_table_file(path.stem, path) for path in sorted(directory.glob("*.csv"))}
    with store.transaction() as tx:
        return [(name, replace_table(tx, name, entries)) for name, entries in tables.items()]


def _check(name: str, entries: Mapping[str, str]) -> None:
    if not NAME.fullmatch(name):
        raise LookupTableError(
            f"table name {name!r}: letters, digits, '_', '.', '-' (200 at most), not starting with a digit"
        )
    for code, value in entries.items():
        if not isinstance(code, str) or not isinstance(value, str):
            raise LookupTableError(f"table {name!r}: codes and values must be strings ({code!r})")
        if not code or len(code) > MAX_CODE_CHARS:
            raise LookupTableError(f"table {name!r}: code {code[:40]!r} must be 1–{MAX_CODE_CHARS} characters")
        if len(value) > MAX_VALUE_CHARS:
            raise LookupTableError(f"table {name!r}: value of {code!r} is longer than {MAX_VALUE_CHARS} characters")
