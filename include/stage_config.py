"""The pipeline's config: routes, destinations and transforms, one TOML file each in one directory.

    <dir>/routes.toml         [[route]]        which inbound messages go where (include/routes_config.py)
    <dir>/destinations.toml   [[destination]]  where and how to deliver, lane rule, retries
                                               (include/destinations_config.py)
    <dir>/transforms.toml     [[transform]]    per-destination rewrite rules (include/transforms_config.py)
    <dir>/code/               Python modules    destinations' `code = "module:function"` hooks (docs/rules.md)

The directory is `$STAGELINE_PIPELINE_DIR`, default `config/` beside the service config — the same
directory `listenerd --config` reads its inbound connections from, so one directory describes a
node. A missing file means none of that kind. Everything is validated together when a stage task
starts, before it claims anything — once per task, so its micro-batches get parsed routes,
destinations and transforms: a route or transform naming a destination that is not configured
is an error (its messages could only ever wait), as is any bad rule. A file destination's
`directory` may use `$STAGELINE_VAR` (the node's var dir, default `var/` in the checkout); a relative
one is taken relative to the pipeline directory. Lookup tables live in the store
(`stageline lookups`) and are checked by the transform run itself.

Plain Python: imports no Spark (the parsers are plain modules under `include/`), so DAG files and
the CLI can use it.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from include.config import VAR_ENV, config_path, var_dir
from include.destinations_config import Destination, parse_destinations
from include.keys_config import FILE as KEYS_FILE
from include.routes_config import Route, parse_routes
from include.schema import ConfigProblem, ConfigProblems
from include.schema.items import ConfigProblemsError
from include.transforms_config import Transform, parse_transforms

PIPELINE_DIR_ENV = "STAGELINE_PIPELINE_DIR"
CODE_DIR = "code"  # <dir>/code/: the modules destinations' `code` hooks name
FILES = {"route": "routes.toml", "destination": "destinations.toml", "transform": "transforms.toml"}


class PipelineConfigError(ConfigProblemsError):
    """The pipeline config cannot be used: every problem of every file, each with its file and key."""


@dataclass(frozen=True)
class PipelineConfig:
    """The three files, parsed and cross-checked; transforms' lookup tables are checked by the run."""

    directory: Path
    routes: list[Route]
    destinations: dict[str, Destination]
    transforms: list[Transform]

    @property
    def code_dir(self) -> Path:
        """Where destinations' code hooks are imported from first (`spark_jobs.code_hook`)."""
        return self.directory / CODE_DIR

    @property
    def passthrough(self) -> frozenset[str]:
        """The destinations whose messages pass through unchanged (`passthrough_destinations`)."""
        return passthrough_destinations(self.transforms, self.destinations)


def passthrough_destinations(
    specs: Sequence[Mapping[str, Any] | Transform], destinations: Mapping[str, Destination]
) -> frozenset[str]:
    """Destinations whose rows need nothing computed: no transform spec (the body passes byte for
    byte), no code hook, and one lane for the whole destination (no field to read).

    Spark never sees their rows: the route finalize hands them to stage_outbound in SQL
    (`finalize_route(passthrough=…)`), and the transform finalize moves any that reached
    stage_routed as open rows (`finalize_transform(passthrough=…)`).
    """
    specified = {s.destination if isinstance(s, Transform) else s.get("destination") for s in specs}
    return frozenset(
        name
        for name, dest in destinations.items()
        if name not in specified and dest.lane == "destination" and not dest.code
    )


def pipeline_dir(service_config: str | os.PathLike[str] | None = None) -> Path:
    """`$STAGELINE_PIPELINE_DIR`, else `config/` beside the service config (`service_config`, else
    the one `include.config.config_path` finds)."""
    configured = os.environ.get(PIPELINE_DIR_ENV)
    if configured:
        return Path(configured).resolve()
    return config_path(service_config).resolve().parent / "config"


def load(directory: Path | None = None) -> PipelineConfig:
    """Read, validate and cross-check the three files; raises PipelineConfigError with every
    problem of every file (file and key each), never the first one only."""
    base = (directory or pipeline_dir()).resolve()
    if not base.is_dir():
        raise PipelineConfigError(f"pipeline config directory {base} does not exist (set ${PIPELINE_DIR_ENV})")
    problems: list[ConfigProblem] = []
    raw: dict[str, list[Any]] = {}
    for kind, name in FILES.items():
        try:
            raw[kind] = _tables(base / name, kind)
        except PipelineConfigError as exc:
            problems += exc.problems
            raw[kind] = []
    problems += _stray_files(base)

    def parsed(kind: str, parse: Callable[[list[Any]], Any], empty: Any) -> Any:
        try:
            return parse(raw[kind])
        except ConfigProblems as exc:
            problems.extend(p._replace(file=p.file or base / FILES[kind]) for p in exc.problems)
            return empty

    routes = parsed("route", parse_routes, [])
    destinations = parsed(
        "destination",
        lambda specs: parse_destinations(
            [_resolved(spec, base) for spec in specs], code_dir=base / CODE_DIR, check_files=True
        ),
        {},
    )
    transforms = parsed("transform", parse_transforms, [])
    if not problems:
        problems += _cross_checks(base, routes, destinations, transforms)
    if problems:
        raise PipelineConfigError(problems)
    return PipelineConfig(directory=base, routes=routes, destinations=destinations, transforms=transforms)


def _cross_checks(
    base: Path, routes: list[Route], destinations: dict[str, Destination], transforms: list[Transform]
) -> list[ConfigProblem]:
    """Names one file uses that another must define."""
    out = []
    for i, route in enumerate(routes):
        missing = [d for d in route.destinations if d not in destinations]
        if missing:
            out.append(
                ConfigProblem(
                    base / FILES["route"],
                    f"route[{i}].destinations",
                    f"route {route.name!r} sends to {missing}, not configured in {FILES['destination']}",
                )
            )
    for i, t in enumerate(transforms):
        if t.destination not in destinations:
            out.append(
                ConfigProblem(
                    base / FILES["transform"],
                    f"transform[{i}].destination",
                    f"transform for {t.destination!r}, not configured in {FILES['destination']}",
                )
            )
        elif t.output == "json" and destinations[t.destination].code:
            out.append(
                ConfigProblem(
                    base / FILES["transform"],
                    f"transform[{i}].output",
                    f"transform for {t.destination!r}: output 'json' and the destination's code "
                    "hook cannot be combined (the hook receives and returns HL7)",
                )
            )
    return out


def _stray_files(base: Path) -> list[ConfigProblem]:
    """A `route.toml` beside `routes.toml` is a typo whose routes would silently never load."""
    known = set(FILES.values())
    out = []
    for name in sorted(FILES.values()):
        stem = name.removesuffix("s.toml")
        for typo in (f"{stem}.toml",):
            if (base / typo).exists() and typo not in known:
                out.append(ConfigProblem(base / typo, "", f"unknown pipeline file; did you mean {name}?"))
    return out


def fingerprint(directory: Path | None = None) -> str:
    """What the pipeline config on disk is now: a hash of where the directory points and of the
    contents of the three files and the code hooks' modules. A long-running stage task takes it
    *before* loading the config and ends its run once it differs, so the next run loads (and
    checks) the new config — also after an atomic replace that keeps sizes and times, or a symlink
    swapped to another release. Anything unreadable hashes as a change."""
    given = directory or pipeline_dir()
    digest = hashlib.sha256(os.path.realpath(given).encode())
    try:
        paths = [given / name for name in (*FILES.values(), KEYS_FILE)]
        code = given / CODE_DIR
        if code.is_dir():
            paths += sorted(code.rglob("*.py"))
        for path in paths:
            digest.update(str(path.relative_to(given)).encode() + b"\0")
            try:
                digest.update(path.read_bytes())
            except FileNotFoundError:
                digest.update(b"\0missing")
    except OSError as exc:  # a directory going away mid-walk: treat as a change
        digest.update(f"unreadable: {exc}".encode())
    return digest.hexdigest()


def _tables(path: Path, kind: str) -> list[Any]:
    if not path.exists():
        return []
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PipelineConfigError([ConfigProblem(path, "", f"cannot be read: {exc}")]) from None
    unknown = sorted(set(data) - {kind})
    problems = [ConfigProblem(path, key, f"unknown top-level key; expected [[{kind}]] tables") for key in unknown]
    tables = data.get(kind, [])
    if not isinstance(tables, list):
        problems.append(ConfigProblem(path, kind, f"must be an array of tables ([[{kind}]])"))
    if problems:
        raise PipelineConfigError(problems)
    return tables


def _resolved(spec: Any, base: Path) -> Any:
    if not (isinstance(spec, dict) and spec.get("kind") == "file" and isinstance(spec.get("directory"), str)):
        return spec
    directory = spec["directory"].replace(f"${{{VAR_ENV}}}", f"${VAR_ENV}")
    directory = directory.replace(f"${VAR_ENV}", str(var_dir()))
    if "$" in directory:
        raise PipelineConfigError(
            [
                ConfigProblem(
                    base / FILES["destination"],
                    f"destination {spec.get('name')!r}.directory",
                    f"only ${VAR_ENV} may be used, got {spec['directory']!r}",
                )
            ]
        )
    return {**spec, "directory": str((base / directory).resolve())}
