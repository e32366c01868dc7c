"""`stageline config check [DIR]`: every problem of a whole config dir at once, each with its file
and dotted key, before anything starts (docs/config-reference.md describes every key).

    <dir>/connections.toml   [[inbound]], [api], [[api.tokens]]   (include.schema.connections)
    <dir>/routes.toml        [[route]]                            (include.schema.routes)
    <dir>/destinations.toml  [[destination]]                      (include.schema.destinations)
    <dir>/transforms.toml    [[transform]]                        (include.schema.transforms)
    <dir>/lookups/*.csv      lookup tables, and every table a `map` rule names
    <dir>/code/              destinations' code hooks
    stageline.toml           [store], [cluster], [retention]      (include.schema.service), when given

Every file goes through its typed models, which report every problem of a file at once; then the
references between files (a route or transform naming a destination that is not configured, a
`map` rule naming a lookup table that is neither a CSV in `lookups/` nor, when the store can be
read, already in the store), and any other `*.toml` in the dir (a `route.toml` is a typo whose
routes would never load). Whatever a loader raises becomes a problem line: no input prints a
traceback. `listenerd` runs the same check at start (exit 2, the same lines) and `stageline up`
before it starts anything; `stageline config check` exits 2 on any problem.

This lives with the listeners because `connections.toml` and `[api]` are theirs; the CLI
(`include.app.cli`, above the listeners) calls `main`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from include import config as cfgmod
from include.keys_config import FILE as KEYS_FILE
from include.keys_config import load_keys
from include.routes_config import Route, parse_routes
from include.schema import ConfigProblem, ConfigProblems
from include.schema.reading import read_toml, unreadable
from include.stage_config import CODE_DIR, FILES
from include.stage_config import load as load_pipeline
from include.store.lookups import LookupTableError, read_table_file
from include.transforms_config import MapField, Transform, parse_transforms
from listeners.api import Role
from listeners.connections_config import parse_connections

__all__ = ["EXIT_PROBLEMS", "KNOWN_FILES", "Problem", "Report", "check_dir", "main", "sqlite_store_dir"]

CONNECTIONS = "connections.toml"
SERVICE = cfgmod.DEFAULT_CONFIG
LOOKUPS = "lookups"
KNOWN_FILES = (CONNECTIONS, *FILES.values(), KEYS_FILE, SERVICE)
"""The TOML files a config dir may hold; any other `*.toml` there is a problem."""
EXIT_PROBLEMS = 2
PROBE_SECONDS = 5.0
"""How long the check waits for the store's server before it checks the CSVs alone."""
Problem = ConfigProblem  # one thing wrong: file, dotted key, message


@dataclass
class Report:
    """What a check found: the problems, and what was read without one (for the summary line)."""

    directory: Path
    problems: list[ConfigProblem]
    counts: dict[str, int]
    warnings: list[ConfigProblem] = field(default_factory=list)
    """Things that work but may not be meant (a drop directory not there yet): printed, not fatal."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        what = ", ".join(f"{n} {kind}" for kind, n in self.counts.items())
        return f"{self.directory}: {what}" + ("" if self.ok else f"; {len(self.problems)} problem(s)")

    def add(self, problems: Iterable[ConfigProblem], file: Path) -> None:
        self.problems.extend(p._replace(file=p.file or file) for p in problems)


def check_dir(
    directory: str | Path,
    *,
    store_tables: Iterable[str] | None = None,
    store_note: str = "",
    lookups_unverified_ok: bool = False,
    service_config: str | Path | None = None,
    store_dir: str | Path | None = None,
    connections_required: bool = False,
) -> Report:
    """Check the config dir (and `service_config`, a stageline.toml, when given); `store_tables` are
    the lookup tables already in the store (None: the store was not read, `store_note` says why;
    then a table without a CSV is a problem unless `lookups_unverified_ok`). `store_dir` is the
    SQLite store's directory (default: the service config's, when given), which no file inbound may
    use; with `connections_required` (a reload) a missing connections.toml is a problem. Every file
    is read only if it is a regular file of at most 1 MiB (a fifo or /dev/zero is a problem line)."""
    base = Path(directory).resolve()
    report = Report(base, [], {})
    if not base.is_dir():
        report.problems.append(ConfigProblem(base, "", "not a directory"))
        return report
    service = Path(service_config).resolve() if service_config else None
    if service is None and (base / SERVICE).is_file():
        service = base / SERVICE
    if _unreadable_files(base, service, report):
        return report
    names: list[str] = []
    if store_dir is None and service is not None:
        store_dir = _store_dir(service)
    transforms: list[tuple[int, Transform]] = []
    steps: list[tuple[Path, Callable[[], Any]]] = [
        (
            base / CONNECTIONS,
            lambda: _connections(
                base, report, store_dir=store_dir, required=connections_required, names=names, service=service
            ),
        ),
        (base, lambda: _pipeline(base, report, transforms)),
        (base / KEYS_FILE, lambda: _keys(base, report)),
        (
            base / LOOKUPS,
            lambda: _lookups(base, transforms, store_tables, store_note, report, unverified_ok=lookups_unverified_ok),
        ),
        (base, lambda: _unknown_files(base, report)),
    ]
    if service is not None:
        steps.append((service, lambda: _service(service, report, names)))
    for where, step in steps:
        try:
            step()
        except ConfigProblems as exc:
            report.add(exc.problems, where)
        except Exception as exc:  # any loader's surprise is a problem line, never a traceback
            report.problems.append(ConfigProblem(where, "", f"cannot be checked: {type(exc).__name__}: {exc}"))
    unique: dict[str, ConfigProblem] = {}
    for problem in report.problems:
        unique.setdefault(str(problem), problem)
    report.problems = sorted(unique.values(), key=lambda p: str(p.file))  # stable: each file's in order found
    return report


# -- the files -----------------------------------------------------------------------------------


def _connections(
    base: Path,
    report: Report,
    *,
    store_dir: str | Path | None,
    required: bool,
    names: list[str],
    service: Path | None = None,
) -> None:
    path = base / CONNECTIONS
    report.counts["inbound connections"] = 0
    if not path.exists():
        if required:
            report.problems.append(
                ConfigProblem(
                    path, "", "missing: a reload needs connections.toml (an empty file means no inbound connections)"
                )
            )
        return
    raw = _toml(path)
    report.problems.extend(_service_dir_drops(path, base, raw, service))  # beside any other problem
    _model, inbound = parse_connections(
        raw,
        base,
        file=path,
        roles=[r.value for r in Role],
        store_dir=Path(store_dir) if store_dir is not None else None,
    )
    names.extend(c.name for c in inbound)
    report.counts["inbound connections"] = len(inbound)
    for i, conn in enumerate(inbound):
        if conn.kind == "file" and not Path(conn.directory).is_dir():
            report.warnings.append(
                ConfigProblem(
                    path,
                    f"inbound[{i}].directory",
                    f"{conn.directory} does not exist (yet): connection {conn.name!r} "
                    "polls nothing until it does (a mount that comes later is fine; a typo is not)",
                )
            )


def _service_dir_drops(path: Path, base: Path, raw: Any, service: Path | None) -> list[ConfigProblem]:
    """A file connection on the service config's directory would stage stageline.toml (and whatever
    secrets sit beside it) and move it away; one whose archive or error directory is that directory
    would write partner-named files among them. Read from the raw tables, so it is reported beside
    every other problem of the file."""
    entries = raw.get("inbound") if isinstance(raw, dict) else None
    if service is None or not isinstance(entries, list):
        return []
    home = service.resolve().parent
    out = []
    for i, conn in enumerate(entries):
        if not isinstance(conn, dict) or conn.get("kind") != "file":
            continue
        for key in ("directory", "archive", "error_directory"):
            value = conn.get(key)
            if isinstance(value, str) and value and (base / value).resolve() == home:
                out.append(
                    ConfigProblem(
                        path,
                        f"inbound[{i}].{key}",
                        f"{value} is the directory of the service "
                        f"config ({service}); a file connection would stage and move it: use a "
                        f"directory of its own (connection {conn.get('name')!r})",
                    )
                )
    return out


def _unreadable_files(base: Path, service: Path | None, report: Report) -> bool:
    """Every file the check would read that is no regular file of at most 1 MiB (a fifo, a device,
    /dev/zero through a link, a huge file) is a problem, and nothing is read: reading a fifo blocks
    for good and a device has no end."""
    paths = [
        base / CONNECTIONS,
        *(base / name for name in FILES.values()),
        *sorted(base.glob("*.toml")),
        *(sorted((base / LOOKUPS).glob("*.csv")) if (base / LOOKUPS).is_dir() else []),
        *([service] if service is not None else []),
    ]
    bad = False
    for path in dict.fromkeys(paths):
        why = unreadable(path)
        if why is not None:
            report.problems.append(ConfigProblem(path, "", why))
            bad = True
    return bad


def _store_dir(service: Path) -> Path | None:
    """The SQLite store's directory named by the service config (None: another backend, or the
    service config is broken, which its own check reports)."""
    try:
        store = cfgmod.load(service).store
    except Exception:  # reported by the service config's own step
        return None
    return sqlite_store_dir(store)


def sqlite_store_dir(store: Any) -> Path | None:
    """The directory of a SQLite store's file (None: another backend, or no file: `:memory:`, a URI)."""
    if store.backend != "sqlite" or not store.path or store.path == ":memory:" or store.path.startswith("file:"):
        return None
    return Path(store.path).resolve().parent


def _pipeline(base: Path, report: Report, transforms: list[tuple[int, Transform]]) -> None:
    """routes, destinations and transforms: `include.stage_config.load`, what every stage task runs.
    When a file has problems, the tables that parse alone are still checked against the other
    files, so a dir's problems come out together; `transforms` gets those that parse."""
    for kind in FILES:
        report.counts[f"{kind}s"] = 0
    try:
        config = load_pipeline(base)
    except ConfigProblems as exc:
        report.add(exc.problems, base)
        routes, names, parsed = _each_table(base)
        transforms.extend(parsed)
        _references(base, routes, parsed, names, report)
        return
    transforms.extend(enumerate(config.transforms))
    report.counts.update(
        {"routes": len(config.routes), "destinations": len(config.destinations), "transforms": len(config.transforms)}
    )


def _keys(base: Path, report: Report) -> None:
    """keys.toml: the business keys the route task indexes (`include.keys_config`), as it loads them."""
    if (base / KEYS_FILE).exists():
        report.counts["business keys"] = len(load_keys(base).names)


def _each_table(base: Path) -> tuple[list[tuple[int, Route]], set[str], list[tuple[int, Transform]]]:
    """Each route and transform table parsed alone (those that parse, with their index), and every
    destination name written (a broken table's too, so routes naming it are not reported twice)."""

    def tables(kind: str) -> list[Any]:
        path = base / FILES[kind]
        try:
            found = _toml(path).get(kind, []) if path.exists() else []
        except ConfigProblems:
            return []
        return found if isinstance(found, list) else []

    def alone(kind: str, parse: Callable[[list[Any]], Any]) -> list[tuple[int, Any]]:
        out = []
        for i, spec in enumerate(tables(kind)):
            try:
                out += [(i, item) for item in parse([spec])]
            except Exception:  # noqa: S112 - reported by the whole-file load already
                continue
        return out

    names = {
        spec["name"] for spec in tables("destination") if isinstance(spec, dict) and isinstance(spec.get("name"), str)
    }
    return alone("route", parse_routes), names, alone("transform", parse_transforms)


def _references(
    base: Path,
    routes: list[tuple[int, Route]],
    transforms: list[tuple[int, Transform]],
    destinations: set[str],
    report: Report,
) -> None:
    for i, route in routes:
        for name in route.destinations:
            if name not in destinations:
                report.problems.append(
                    ConfigProblem(
                        base / FILES["route"],
                        f"route[{i}].destinations",
                        f"{name!r} is not configured in {FILES['destination']}",
                    )
                )
    for i, t in transforms:
        if t.destination not in destinations:
            report.problems.append(
                ConfigProblem(
                    base / FILES["transform"],
                    f"transform[{i}].destination",
                    f"{t.destination!r} is not configured in {FILES['destination']}",
                )
            )


def _service(path: Path, report: Report, names: list[str]) -> None:
    """The service config; a `[retention.connections.<name>]` override for a connection that is not
    configured is a problem (a PHI retention policy that silently applies to nothing)."""
    config = cfgmod.load(path)
    report.counts["service config"] = 1
    if not (report.directory / CONNECTIONS).is_file() or any(
        p.file == report.directory / CONNECTIONS for p in report.problems
    ):
        return  # the connections are not known (no file, or a broken one): nothing to compare with
    for name in sorted(set(config.retention.connections) - set(names)):
        report.problems.append(
            ConfigProblem(
                path,
                f"retention.connections.{name}",
                f"no inbound connection {name!r} in {CONNECTIONS} (configured: "
                f"{', '.join(names) or 'none'}); the override would apply to nothing",
            )
        )


def _unknown_files(base: Path, report: Report) -> None:
    """Any `*.toml` beside the known ones: most likely a typo (`route.toml`) whose settings would
    silently never load."""
    known = f"known: {', '.join(KNOWN_FILES)}; also {LOOKUPS}/*.csv and {CODE_DIR}/"
    for path in sorted(base.glob("*.toml")):
        if path.name in KNOWN_FILES:
            continue
        said = [i for i, p in enumerate(report.problems) if p.file == path and not p.key]
        if said:  # the pipeline loader's "did you mean routes.toml?": add the list
            report.problems[said[0]] = report.problems[said[0]]._replace(
                message=f"{report.problems[said[0]].message} ({known})"
            )
        else:
            report.problems.append(ConfigProblem(path, "", f"unknown config file ({known})"))


# -- lookups -------------------------------------------------------------------------------------


def _lookups(
    base: Path,
    transforms: list[tuple[int, Transform]],
    store_tables: Iterable[str] | None,
    store_note: str,
    report: Report,
    *,
    unverified_ok: bool,
) -> None:
    directory = base / LOOKUPS
    files: set[str] = set()
    if directory.is_dir():
        for path in sorted(directory.glob("*.csv")):
            try:
                read_table_file(path.stem, path)
            except LookupTableError as exc:
                report.problems.append(ConfigProblem(path, "", str(exc).removeprefix(f"{path}: ")))
            files.add(path.stem)
    report.counts["lookup CSVs"] = len(files)
    if store_tables is None and unverified_ok:
        return
    known = files | set(store_tables or ())
    for n, t in transforms:
        for i, rule in enumerate(t.rules):
            if isinstance(rule, MapField) and rule.table not in known:
                where = (
                    "not in the store either"
                    if store_tables is not None
                    else f"and the store was not read{': ' + store_note if store_note else ''}"
                )
                report.problems.append(
                    ConfigProblem(
                        base / FILES["transform"],
                        f"transform[{n}].rules[{i}].table",
                        f"lookup table {rule.table!r}: no {LOOKUPS}/{rule.table}.csv, {where} "
                        "(CSVs are imported by `stageline up` or `stageline lookups import|sync`)",
                    )
                )


# -- helpers -------------------------------------------------------------------------------------


def _toml(path: Path) -> dict[str, Any]:
    try:
        return read_toml(path)
    except OSError as exc:
        raise ConfigProblems([ConfigProblem(path, "", f"cannot be read: {exc}")]) from None


def store_lookup_tables(service_config: str | None) -> tuple[set[str] | None, str]:
    """The lookup tables in the store of `service_config`, or (None, why not)."""
    from include import config as cfgmod
    from include.store import Store
    from include.store.lookups import read_all
    from include.store.reach import StoreUnavailable, probe

    why = unreadable(cfgmod.config_path(service_config))
    if why is not None:  # reported by check_dir; reading it here could block (a fifo) or never end
        return None, "the service config " + why.split(";")[0]
    try:
        cfg = cfgmod.load(service_config)
        probe(cfg.store, timeout_seconds=PROBE_SECONDS)  # creates no SQLite file, waits out no pool
        store = Store(cfg.store)
        try:
            with store.transaction(write=False) as tx:
                return set(read_all(tx)), ""
        finally:
            store.close()
    except StoreUnavailable as exc:
        return None, str(exc)
    except Exception as exc:  # an unmigrated store: the CSVs alone are checked
        return None, type(exc).__name__


def report_document(report: Report) -> dict[str, Any]:
    """The report as `stageline config check --json` prints it."""

    def entry(p: ConfigProblem) -> dict[str, str | None]:
        return {"file": str(p.file) if p.file else None, "key": p.key, "message": p.message}

    return {
        "ok": report.ok,
        "directory": str(report.directory),
        "counts": report.counts,
        "problems": [entry(p) for p in report.problems],
        "warnings": [entry(w) for w in report.warnings],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stageline config check", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=None, help="the config dir (default: the pipeline dir)")
    parser.add_argument(
        "--service-config",
        default=None,
        help="stageline.toml: checked too, and its store is asked for lookup tables that have no CSV",
    )
    parser.add_argument("--no-store", action="store_true", help="do not read the store")
    parser.add_argument("--json", action="store_true", help="one JSON document: ok, counts, problems, warnings")
    args = parser.parse_args(argv)
    try:
        if args.directory is None:
            from include.stage_config import pipeline_dir

            args.directory = str(pipeline_dir(args.service_config))
        tables, note = (None, "--no-store") if args.no_store else store_lookup_tables(args.service_config)
        report = check_dir(args.directory, store_tables=tables, store_note=note, service_config=args.service_config)
    except Exception as exc:  # a line and the exit code, never a traceback
        print(f"config cannot be checked: {type(exc).__name__}: {exc}")
        return EXIT_PROBLEMS
    if args.json:
        print(json.dumps(report_document(report), indent=2))
        return 0 if report.ok else EXIT_PROBLEMS
    for problem in report.problems:
        print(problem)
    for warning in report.warnings:
        print(f"warning: {warning}")
    print(("config OK: " if report.ok else "config has problems: ") + report.summary())
    return 0 if report.ok else EXIT_PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
