"""Named SQL loaded from `sql/<dialect>/*.sql` (`queries.sql`: the stages'; `operator.sql`: what
an operator does with messages).

Each query starts with `-- name: <name>`; parameters are written `:name` in every dialect and turned
into the driver's style here, once. `{table}`/`{dest}` are filled from the staged-table catalogue
and `{now}` from the dialect (SQLite's epoch-millisecond clock), never from input.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

SQL_ROOT = Path(__file__).parent / "sql"
_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def parse_named(text: str) -> dict[str, str]:
    """Split a queries file into {name: sql}; comment lines inside a block are dropped."""
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        if name in queries:
            raise ValueError(f"query {name!r} defined twice")
        queries[name] = "\n".join(lines).strip()
    return queries


def to_pyformat(sql: str) -> str:
    """`:name` → `%(name)s` for psycopg and pymssql (literal `%` doubled first)."""
    return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))


@cache
def load(dialect: str) -> dict[str, str]:
    return parse_named("\n".join(path.read_text() for path in sorted((SQL_ROOT / dialect).glob("*.sql"))))


def migrations(dialect: str) -> list[tuple[int, str, str]]:
    """[(version, description, sql)] in version order, from `NNNN_description.sql` files."""
    found = []
    for path in sorted((SQL_ROOT / dialect / "migrations").glob("*.sql")):
        number, _, description = path.stem.partition("_")
        found.append((int(number), description.replace("_", " "), path.read_text()))
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"{dialect} migrations must be numbered 1..n without gaps, got {versions}")
    return found
