"""The schema of `destinations.toml`: one `[[destination]]` table per destination, by `kind`.

Types are strict (``port = "2575"`` is an error, not a port), ranges are checked, unknown keys
are errors (a typo must not fall back to a default). The runtime dataclasses the Spark jobs use
(`include.destinations_config.MllpDestination`...) are built from these models.

A `code` hook must live in the pipeline config directory's `code/` folder: the config dir is
code, nothing else is. So a hook naming a standard-library or builtin module (``os:system``,
``subprocess:run``, ``builtins:eval``) is refused here without any I/O, and with the directory
known (``context={"code_dir": ...}``) a module not found in it is refused too, and so is a hook
whose dotted module file is missing or whose source binds no such function at top level (read
with `ast`, never imported: checking a config runs none of its code).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from include.hl7path import FieldPathError, parse_path
from include.schema import Strict, Text

__all__ = [
    "KIND_MODELS",
    "DestinationModel",
    "DestinationsFile",
    "FileModel",
    "HttpModel",
    "MllpModel",
    "TlsModel",
    "check_code_spec",
    "hook_module_path",
]

# `module:function`: a dotted module path and a function name (spark_jobs/code_hook.py, docs/rules.md).
CODE_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
RESERVED_HEADERS = ("idempotency-key", "content-type", "content-length", "host")
PERMANENT_CODES = ("AE", "AR", "CE", "CR")


def _name(value: str) -> str:
    if not value.strip() or value != value.strip():
        raise ValueError("must be a non-empty string without surrounding whitespace")
    return value


def _lane(value: str) -> str:
    if value == "destination":
        return value
    try:
        parse_path(value)
    except FieldPathError as exc:
        raise ValueError(f"must be 'destination' or an HL7 field path such as 'PID-3.1': {exc}") from None
    return value


def hook_module_path(module: str, code_dir: str | os.PathLike[str]) -> Path | None:
    """Where `module` (dotted) is inside `code_dir` (a `.py` file or a package), or None.

    Only the top-level name decides: `a.b` needs `<code_dir>/a/` (a package) or `<code_dir>/a.py`.
    The resolved path must stay inside `code_dir` (a symlink out of it does not count)."""
    top = module.split(".", 1)[0]
    base = Path(code_dir)
    try:
        root = base.resolve()
        for candidate in (base / top / "__init__.py", base / f"{top}.py", base / top):
            if candidate.is_file() or (candidate == base / top and candidate.is_dir()):
                resolved = candidate.resolve()
                if root in resolved.parents:
                    return candidate
    except OSError:
        return None
    return None


def check_code_spec(value: str, code_dir: str | os.PathLike[str] | None = None) -> str:
    """A `module:function` hook whose module can only come from the config dir's `code/` folder."""
    if not CODE_SPEC.fullmatch(value):
        raise ValueError("must be 'module:function' (a dotted module path, a colon, a function name)")
    module = value.partition(":")[0]
    top = module.split(".", 1)[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "__main__":
        raise ValueError(
            f"module {top!r} is Python's own, not a hook in the config directory's code/ folder "
            "(a code hook may only import from <config>/code/)"
        )
    if code_dir is not None and hook_module_path(module, code_dir) is None:
        raise ValueError(
            f"module {module!r} not found in {code_dir} (a code hook may only import from "
            "<config>/code/: put it there as <module>.py or a package)"
        )
    if code_dir is not None:
        why = _hook_function_missing(module, value.partition(":")[2], Path(code_dir))
        if why:
            raise ValueError(why)
    return value


def _hook_function_missing(module: str, function: str, code_dir: Path) -> str | None:
    """Why `module:function` cannot be found in `code_dir` without importing anything (None: found,
    or not decidable, e.g. a `from x import *`): the dotted module's file must exist inside
    `code_dir`, and its source must define or import `function` at top level."""
    parts = module.split(".")
    base = code_dir / Path(*parts)
    source = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
    if source is None:
        return (
            f"module {module!r} not found in {code_dir}: no {Path(*parts)}.py or {Path(*parts)}/__init__.py "
            "(a code hook may only import from <config>/code/)"
        )
    try:
        if code_dir.resolve() not in source.resolve().parents:
            return f"module {module!r} lies outside {code_dir} through a symbolic link"
        from include.schema.reading import read_config_bytes

        tree = ast.parse(read_config_bytes(source, limit=4 * 1024 * 1024), filename=str(source))
    except (OSError, SyntaxError, ValueError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"module {module!r} ({source}) cannot be read: {why}"
    names: set[str] = set()
    for node in _module_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None  # not decidable without importing
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    if function not in names:
        return f"module {module!r} ({source}) defines no {function!r} at top level"
    return None


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at import, into if/try/with/for blocks but not into functions or classes."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, block, []) or [])
            for handler in getattr(node, "handlers", []) or []:
                yield from _module_level(handler.body)


Name = Annotated[str, AfterValidator(_name)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Timeout = Annotated[float, Field(ge=0.001, allow_inf_nan=False)]


class TlsModel(Strict):
    """Client TLS for MLLP/HTTPS; `verify = false` is for test rigs only (it still encrypts)."""

    ca_file: Text | None = None
    cert_file: Text | None = None
    key_file: Text | None = None
    server_hostname: Text | None = None
    verify: bool = True

    @field_validator("key_file")
    @classmethod
    def _key_needs_cert(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("cert_file") is None:
            raise ValueError("needs tls.cert_file")
        return value

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and (info.context or {}).get("check_files") and not os.path.isfile(value):
            raise ValueError(f"file {value!r} does not exist")
        return value


class _Common(Strict):
    """Settings every destination has: its retry policy, lane rule and code hook."""

    name: Name
    max_attempts: int = Field(default=10, ge=1)
    backoff_seconds: Seconds = 5.0
    max_backoff_seconds: Seconds = 300.0
    lane: Annotated[str, AfterValidator(_lane)] = "destination"
    code: str | None = None

    @field_validator("max_backoff_seconds")
    @classmethod
    def _max_backoff(cls, value: float, info: ValidationInfo) -> float:
        backoff = info.data.get("backoff_seconds")
        if backoff is not None and value < backoff:
            raise ValueError("must be >= backoff_seconds")
        return value

    @field_validator("code")
    @classmethod
    def _code(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else check_code_spec(value, (info.context or {}).get("code_dir"))


class MllpModel(_Common):
    kind: Literal["mllp"]
    host: Text
    port: int = Field(ge=1, le=65535)
    timeout_seconds: Timeout = 10.0
    tls: TlsModel | None = None
    permanent_ack_codes: list[Literal["AE", "AR", "CE", "CR"]] = ["AR", "CR"]
    idle_timeout_seconds: Seconds = 30.0
    accept_ack: Literal["msh15", "always"] = "always"
    er_wait_seconds: Timeout = 1.0

    @field_validator("er_wait_seconds")
    @classmethod
    def _er_wait(cls, value: float, info: ValidationInfo) -> float:
        # The ER wait is spent inside the ACK timeout: a longer one would be cut to it unseen.
        timeout = info.data.get("timeout_seconds")
        if timeout is not None and value > timeout:
            raise ValueError(f"must be <= timeout_seconds ({timeout:g}): the ER wait is spent inside the ACK timeout")
        return value


class FileModel(_Common):
    kind: Literal["file"]
    directory: Text
    suffix: str = ".hl7"
    mode: int = Field(default=0o600, ge=0)  # at most 0o644: `_private_enough`, in octal
    batch: bool = False

    @field_validator("directory")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not os.path.isabs(value):
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    @field_validator("mode")
    @classmethod
    def _private_enough(cls, value: int) -> int:
        # PHI files: the owner may read and write; group and other may at most read (0o644 at most).
        if value & ~0o644:
            raise ValueError(
                f"{value:#o} grants write or execute to group or other (or execute to the owner); "
                "use 0o600 (the default), 0o640 or 0o644"
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str) -> str:
        if "/" in value or os.sep in value or "\x00" in value:
            raise ValueError("must be a string without path separators")
        return value


class HttpModel(_Common):
    kind: Literal["http"]
    url: Text
    timeout_seconds: Timeout = 10.0
    headers: dict[str, str] = {}
    tls: TlsModel | None = None
    idle_timeout_seconds: Seconds = 30.0

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        try:
            parts = urlsplit(value)
            _ = parts.port  # raises on a malformed port
        except ValueError:
            raise ValueError(f"is not a valid URL: {value!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL with a host, got {value!r}")
        return value

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        if not all(value):
            raise ValueError("header names must be non-empty")
        reserved = sorted(k for k in value if k.lower() in RESERVED_HEADERS)
        if reserved:
            raise ValueError(f"may not set {reserved} (Stageline sets them)")
        return value

    @field_validator("tls")
    @classmethod
    def _tls_https(cls, value: TlsModel | None, info: ValidationInfo) -> TlsModel | None:
        url = info.data.get("url")
        if value is not None and url is not None and urlsplit(url).scheme != "https":
            raise ValueError("needs an https:// url")
        return value


KIND_MODELS: dict[str, type[_Common]] = {"mllp": MllpModel, "file": FileModel, "http": HttpModel}
DestinationModel = Annotated[MllpModel | FileModel | HttpModel, Field(discriminator="kind")]


class DestinationsFile(Strict):
    """`destinations.toml`: an array of `[[destination]]` tables, names unique."""

    destination: list[DestinationModel] = []
