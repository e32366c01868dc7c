"""How every `stageline` command answers: text for people, or with `--json` one JSON document on
stdout for programs (the same keys the text is made from, so a script never parses a table).

Tables have one renderer: each column as wide as its widest cell, so a long value widens its
column instead of running into the next one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import click

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Answer with one JSON document on stdout (stable keys) instead of text."
)


def _default(value: Any) -> Any:
    return str(value)


def echo_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, default=_default))  # ASCII: a body's odd bytes print anywhere


def answer(as_json: bool, doc: Any, text: Callable[[], str]) -> None:
    """`doc` as JSON, or what `text` makes of it for a person."""
    if as_json:
        echo_json(doc)
    else:
        click.echo(text())


def when_ms(ms: Any) -> str:
    """Epoch milliseconds as `2026-11-24 08:00:00.123Z` ("-" for none)."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(int(ms) / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def when_s(seconds: Any) -> str:
    """Epoch seconds as `2026-11-24 08:00:00Z` ("-" for none)."""
    if seconds is None:
        return "-"
    return datetime.fromtimestamp(float(seconds), tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _plain(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    right: bool = False
    """Aligned right (numbers)."""
    show: Callable[[Any], str] = _plain


def table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """Rows under a header line, columns two spaces apart; no trailing blanks."""
    cells = [[c.header for c in columns]] + [[c.show(row.get(c.key)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(
            cell.rjust(width) if column.right else cell.ljust(width)
            for cell, width, column in zip(line, widths, columns, strict=True)
        ).rstrip()
        for line in cells
    )
