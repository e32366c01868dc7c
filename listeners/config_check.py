"""`stageline config check [DIR]`: every problem of a whole config dir at once, each with its file
and key, before anything starts (docs/config-reference.md describes every key).

    <dir>/connections.toml   [[inbound]], [api], [[api.tokens]]        (listeners.connections, listeners.api)
    <dir>/routes.toml        [[route]]                                 (include.routes_config)
    <dir>/destinations.toml  [[destination]]                           (include.destinations_config)
    <dir>/transforms.toml    [[transform]]                             (include.transforms_config)
    <dir>/lookups/*.csv      lookup tables, and every table a `map` rule names

The loaders stop at their first error, which is right for a running node; a user fixing a config
wants all of them. So each table is parsed on its own (one error per table, the parser's own
message naming the key inside it), then the whole file for what spans tables (duplicate names),
then the references between files: a route or transform naming a destination that is not
configured, a `map` rule naming a lookup table that is neither a CSV in `lookups/` nor (when the
store can be read) already in the store. `listenerd` and `stageline up` run the same check at start
and refuse to start on any problem.

This lives with the listeners because `connections.toml` and `[api]` are theirs; the CLI runs it as
`python -m listeners.config_check` (include/ does not import listeners).
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from include.destinations_config import DestinationConfigError, parse_destinations
from include.routes_config import Route, RouteConfigError, parse_routes
from include.stage_config import FILES, PipelineConfigError, _resolved
from include.store.lookups import LookupTableError, read_table_file
from include.transforms_config import MapField, Transform, TransformConfigError, parse_transforms
from listeners.api import ApiAuth, ApiSettings
from listeners.connections import ConnectionConfigError, _inbound

__all__ = ["Problem", "Report", "check_dir", "main"]

CONNECTIONS = "connections.toml"
LOOKUPS = "lookups"
_PLACEHOLDER_TOKEN = "config-check-placeholder-token"
_ALONE = re.compile(r"^(route|destination|transform) #0: ")  # a table parsed alone is always "#0"


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the file, the key (table and index, or setting) and what is wrong."""

    file: Path
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.message}" if self.key else f"{self.file}: {self.message}"


@dataclass
class Report:
    """What a check found: the problems, and what was read without one (for the summary line)."""

    directory: Path
    problems: list[Problem]
    counts: dict[str, int]

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        what = ", ".join(f"{n} {kind}" for kind, n in self.counts.items())
        return f"{self.directory}: {what}" + ("" if self.ok else f"; {len(self.problems)} problem(s)")


def check_dir(directory: str | Path, *, store_tables: Iterable[str] | None = None,
              store_note: str = "", lookups_unverified_ok: bool = False) -> Report:
    """Check the config dir; `store_tables` are the lookup tables already in the store (None: the
    store was not read, `store_note` says why; then a table without a CSV is a problem unless
    `lookups_unverified_ok`)."""
    base = Path(directory).resolve()
    report = Report(base, [], {})
    if not base.is_dir():
        report.problems.append(Problem(base, "", "not a directory"))
        return report
    _connections(base, report)
    routes = _pipeline_file(base, "route", report, lambda specs: parse_routes(specs))
    destination_names = _destination_names(base, report)
    transforms = _pipeline_file(base, "transform", report, lambda specs: parse_transforms(specs))
    _references(base, routes, transforms, destination_names, report)
    _lookups(base, transforms, store_tables, store_note, report, unverified_ok=lookups_unverified_ok)
    report.problems.sort(key=lambda p: str(p.file))  # stable: each file's problems in the order found
    return report


# -- connections.toml ------------------------------------------------------------------------

def _connections(base: Path, report: Report) -> None:
    path = base / CONNECTIONS
    if not path.exists():
        report.counts["inbound connections"] = 0
        return
    raw = _toml(path, report)
    if raw is None:
        return
    add = _adder(report, path)
    for section in sorted(set(raw) - {"inbound", "api"}):
        add(f"[{section}]", "unknown section (known: [[inbound]], [api])")
    entries = raw.get("inbound", [])
    if not isinstance(entries, list):
        add("inbound", "must be an array of tables ([[inbound]])")
        entries = []
    names: list[str] = []
    good = 0
    for i, entry in enumerate(entries):
        key = f"[[inbound]] #{i + 1}"
        if not isinstance(entry, dict):
            add(key, "must be a table")
            continue
        if isinstance(entry.get("name"), str):
            names.append(entry["name"])
        try:
            _inbound(entry, i, base)
            good += 1
        except ConnectionConfigError as exc:
            add(*_split_where(str(exc), key))
    for name in sorted({n for n in names if names.count(n) > 1}):
        add("[[inbound]] name", f"duplicate connection name {name!r}")
    report.counts["inbound connections"] = good
    api = raw.get("api", {})
    if not isinstance(api, dict):
        add("[api]", "must be a table")
        return
    try:
        ApiSettings.from_config(api, base)
    except ConnectionConfigError as exc:
        section = "[api.tls]" if str(exc).startswith("[api.tls]") else "[api]"
        add(section, re.sub(r"^\[api(\.tls)?\]:? ", "", str(exc)))
    tokens = api.get("tokens", [])
    if not isinstance(tokens, list):
        add("[[api.tokens]]", "must be an array of tables")
        return
    # token_env names an environment variable that listenerd reads when it starts (`stageline up`
    # sets its own): only the table's shape is checked here, with a placeholder token.
    env = {e["token_env"]: _PLACEHOLDER_TOKEN + str(i) for i, e in enumerate(tokens)
           if isinstance(e, dict) and isinstance(e.get("token_env"), str) and e["token_env"]}
    for i, entry in enumerate(tokens):
        try:
            ApiAuth.from_config({"tokens": [entry]}, env)
        except ConnectionConfigError as exc:
            add(f"[[api.tokens]] #{i + 1}", re.sub(r"^\[\[api\.tokens\]\] #1( \([^)]*\))?: ", "", str(exc)))


def _split_where(message: str, key: str) -> tuple[str, str]:
    """The connection parser starts with `[[inbound]] #N ('name')`: that is the key."""
    head, sep, rest = message.partition(": ")
    if sep and head.startswith(key):
        return head, rest
    return key, message


# -- routes, destinations, transforms --------------------------------------------------------

def _pipeline_file(base: Path, kind: str, report: Report, parse: Callable[[list[Any]], Sequence[Any]]) -> list[Any]:
    """Each [[kind]] table parsed alone, then the whole file; the parsed items of a clean file."""
    path = base / FILES[kind]
    specs = _tables(path, kind, report)
    parsed: list[Any] = []
    failed = False
    for i, spec in enumerate(specs):
        try:
            parsed += parse([spec])
        except (RouteConfigError, TransformConfigError, DestinationConfigError, PipelineConfigError) as exc:
            report.problems.append(Problem(path, f"[[{kind}]] #{i + 1}", _ALONE.sub("", str(exc))))
            failed = True
    if not failed and specs:
        try:
            parsed = list(parse(specs))
        except (RouteConfigError, TransformConfigError, DestinationConfigError, PipelineConfigError) as exc:
            report.problems.append(Problem(path, f"[[{kind}]]", str(exc)))
    report.counts[f"{kind}s"] = len(parsed)
    return parsed


def _destination_names(base: Path, report: Report) -> set[str]:
    """Check destinations.toml; the names it configures (a broken table's name too, so routes
    naming it are not reported twice)."""

    def parse(specs: list[Any]) -> list[str]:
        return list(parse_destinations([_resolved(spec, base) for spec in specs]))

    names = set(_pipeline_file(base, "destination", report, parse))
    for spec in _tables(base / FILES["destination"], "destination", None):
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            names.add(spec["name"])
    return names


def _references(base: Path, routes: list[Route], transforms: list[Transform], destinations: set[str],
                report: Report) -> None:
    for route in routes:
        for name in route.destinations:
            if name not in destinations:
                report.problems.append(Problem(base / FILES["route"], f"route {route.name!r} destinations",
                                               f"{name!r} is not configured in {FILES['destination']}"))
    for t in transforms:
        if t.destination not in destinations:
            report.problems.append(Problem(base / FILES["transform"], f"transform {t.destination!r} destination",
                                           f"{t.destination!r} is not configured in {FILES['destination']}"))


# -- lookups -------------------------------------------------------------------------------------

def _lookups(base: Path, transforms: list[Transform], store_tables: Iterable[str] | None, store_note: str,
             report: Report, *, unverified_ok: bool) -> None:
    directory = base / LOOKUPS
    files: set[str] = set()
    if directory.is_dir():
        for path in sorted(directory.glob("*.csv")):
            try:
                read_table_file(path.stem, path)
            except LookupTableError as exc:
                report.problems.append(Problem(path, "", str(exc).removeprefix(f"{path}: ")))
            files.add(path.stem)
    report.counts["lookup CSVs"] = len(files)
    if store_tables is None and unverified_ok:
        return
    known = files | set(store_tables or ())
    for t in transforms:
        for i, rule in enumerate(t.rules):
            if isinstance(rule, MapField) and rule.table not in known:
                where = "not in the store either" if store_tables is not None else \
                    f"and the store was not read{': ' + store_note if store_note else ''}"
                report.problems.append(Problem(
                    base / FILES["transform"], f"transform {t.destination!r} rule #{i} (map) table",
                    f"lookup table {rule.table!r}: no {LOOKUPS}/{rule.table}.csv, {where} "
                    "(CSVs are imported by `stageline up` or `stageline lookups import|sync`)"))


# -- helpers -------------------------------------------------------------------------------------

def _adder(report: Report, path: Path) -> Callable[[str, str], None]:
    return lambda key, message: report.problems.append(Problem(path, key, message))


def _toml(path: Path, report: Report | None) -> dict[str, Any] | None:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        if report is not None:
            report.problems.append(Problem(path, "", f"not valid TOML: {exc}"))
        return None


def _tables(path: Path, kind: str, report: Report | None) -> list[Any]:
    if not path.exists():
        return []
    raw = _toml(path, report)
    if raw is None:
        return []
    if report is not None:
        for key in sorted(set(raw) - {kind}):
            report.problems.append(Problem(path, key, f"unexpected top-level key; expected [[{kind}]] tables"))
    tables = raw.get(kind, [])
    if not isinstance(tables, list):
        if report is not None:
            report.problems.append(Problem(path, kind, f"must be an array of tables ([[{kind}]])"))
        return []
    return tables


def store_lookup_tables(service_config: str | None) -> tuple[set[str] | None, str]:
    """The lookup tables in the store of `service_config`, or (None, why not)."""
    from include import config as cfgmod
    from include.store import Store
    from include.store.lookups import read_all

    try:
        cfg = cfgmod.load(service_config)
        if cfg.store.backend == "sqlite" and not Path(cfg.store.path).exists():
            return None, f"no store at {cfg.store.path} yet"  # opening it would create the file
        store = Store(cfg.store)
        try:
            with store.transaction(write=False) as tx:
                return set(read_all(tx)), ""
        finally:
            store.close()
    except Exception as exc:  # an unmigrated or unreachable store: the CSVs alone are checked
        return None, type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stageline config check", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=None, help="the config dir (default: the pipeline dir)")
    parser.add_argument("--service-config", default=None, help="stageline.toml, whose store is asked for "
                        "lookup tables that have no CSV")
    parser.add_argument("--no-store", action="store_true", help="do not read the store")
    args = parser.parse_args(argv)
    if args.directory is None:
        from include.stage_config import pipeline_dir

        args.directory = str(pipeline_dir())
    tables, note = (None, "--no-store") if args.no_store else store_lookup_tables(args.service_config)
    report = check_dir(args.directory, store_tables=tables, store_note=note)
    for problem in report.problems:
        print(problem)
    print(("config OK: " if report.ok else "config has problems: ") + report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
