"""The code escape hatch: a destination's own Python function over each message, inside Spark.

A destination may name ``code = "module:function"`` (`include.destinations_config`). After the
destination's native rules (`spark_jobs.transform_rules`), each of its messages is parsed with
python-hl7 (``hl7.parse_hl7``: a ``Message``, or a ``Batch``/``File`` for a batch) and handed to the
function, which returns the message to send — a python-hl7 object or a string — or raises: that
message alone is dead-lettered with ``code hook <spec> raised <Type>: <text>`` as its reason, the
rest of the batch goes on. Returning anything else (None included) is an error of that message too.

Vectorized: rows travel to the Python workers and back as Arrow record batches (`mapInArrow`),
and only the rows of destinations with a hook do; everyone else stays in the JVM. The function
itself runs once per message (it is the user's Python).

Where the module is found: only in the pipeline config directory's ``code/`` folder
(``<config>/code/<module>.py``, or a package). The config directory is code; nothing else is: a
hook naming an installed or standard-library module (``os:system``, ``subprocess:run``) is refused
at config check (`include.schema.destinations.check_code_spec`) and here again before anything is
imported — the top-level module is looked up in that folder alone, and a module of that name
already loaded from elsewhere is refused, not reused. On a Spark cluster that folder must exist at
the same path on the workers (the config directory is shared or deployed alike). A module is
imported once per Python worker: restart the Spark server (or the stage task's session) after
changing it. A module that cannot be imported fails the whole run before anything is claimed
(`check_hooks`): a configuration error, not a message's.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from include.schema.destinations import CODE_SPEC

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from include.destinations_config import Destination

__all__ = ["CodeHookError", "apply_code_hooks", "call_hook", "check_hooks", "hooks_of", "load_hook"]

_LOADED: dict[tuple[str, str | None], Callable[[Any], Any]] = {}
MAX_REASON = 400


class CodeHookError(ValueError):
    """A hook that cannot be loaded (bad module or function name): a configuration error."""


def _inside(module: Any, root: Path) -> bool:
    """Whether a loaded module's file (or a namespace package's every path) is under `root`."""
    file: str | None = getattr(module, "__file__", None)
    files: list[str] = [file] if file else list(getattr(module, "__path__", []) or [])
    return bool(files) and all(root in Path(f).resolve().parents for f in files)


def _import_from(module_name: str, code_dir: str | None, spec: str) -> Any:
    """`module_name` imported from `code_dir` and nowhere else (its top-level name found there
    alone, never on sys.path; a same-named module already loaded from elsewhere is refused)."""
    if not code_dir or CODE_SPEC.fullmatch(spec) is None:
        raise CodeHookError(
            f"code hook {spec!r}: a code hook may only import from the pipeline config "
            "directory's code/ folder, and none is configured"
            if not code_dir
            else f"code hook {spec!r}: must be 'module:function'"
        )
    root = Path(code_dir).resolve()
    if str(root) not in sys.path:
        # Last, so a hook module may import its siblings in code/ but a file there never shadows the
        # standard library or an installed package for the rest of the process (code/json.py would
        # otherwise be every later `import json`).
        sys.path.append(str(root))
    top = module_name.split(".", 1)[0]
    loaded = sys.modules.get(top)
    if loaded is None:
        importlib.invalidate_caches()  # a module (or the folder) added since this process last looked
        sys.path_importer_cache.pop(str(root), None)
        found = importlib.machinery.PathFinder.find_spec(top, [str(root)])
        if found is None or (found.loader is None and not found.submodule_search_locations):
            raise CodeHookError(
                f"code hook {spec!r}: cannot import {module_name!r}: no module {top!r} in "
                f"{root} (a code hook may only import from <config>/code/)"
            )
        module = importlib.util.module_from_spec(found)
        sys.modules[top] = module
        try:
            if found.loader is not None:
                found.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(top, None)
            raise
    elif not _inside(loaded, root):
        raise CodeHookError(
            f"code hook {spec!r}: module {top!r} is already loaded from outside {root} "
            "(a code hook may only import from <config>/code/; rename the module)"
        )
    module = importlib.import_module(module_name)
    if not _inside(module, root):
        raise CodeHookError(f"code hook {spec!r}: module {module_name!r} is not in {root}")
    return module


def load_hook(spec: str, code_dir: str | None) -> Callable[[Any], Any]:
    """Import ``module:function`` from ``code_dir`` (and only from there), once per process."""
    key = (spec, code_dir)
    if key in _LOADED:
        return _LOADED[key]
    module_name, _, function_name = spec.partition(":")
    try:
        module = _import_from(module_name, code_dir, spec)
    except CodeHookError:
        raise
    except Exception as exc:
        raise CodeHookError(
            f"code hook {spec!r}: cannot import {module_name!r} (from {code_dir}): {type(exc).__name__}: {exc}"
        ) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise CodeHookError(f"code hook {spec!r}: module {module_name!r} has no function {function_name!r}")
    hook: Callable[[Any], Any] = function
    _LOADED[key] = hook
    return hook


def hooks_of(destinations: Mapping[str, Destination]) -> dict[str, str]:
    """Destination -> its `module:function` code hook, for those that have one."""
    return {name: dest.code for name, dest in destinations.items() if dest.code}


def check_hooks(hooks: Mapping[str, str], code_dir: str | None) -> None:
    """Load every hook in this process, so a bad one fails the run before it claims anything."""
    for spec in sorted(set(hooks.values())):
        load_hook(spec, code_dir)


def call_hook(function: Callable[[Any], Any], spec: str, payload: str) -> str:
    """Parse ``payload``, call the hook, render its answer; raise ValueError with the reason."""
    import hl7

    text = payload.replace("\r\n", "\r").replace("\n", "\r").strip("\r")
    try:
        result = function(hl7.parse_hl7(text))
    except Exception as exc:
        raise ValueError(f"code hook {spec} raised {type(exc).__name__}: {exc}"[:MAX_REASON]) from exc
    if isinstance(result, (hl7.Message, hl7.Batch, hl7.File)):
        out = str(result)
    elif isinstance(result, str):
        out = result
    else:
        raise ValueError(f"code hook {spec} returned {type(result).__name__}, not a message or a string")
    out = out.replace("\r\n", "\r").replace("\n", "\r")
    if not out.strip("\r"):
        raise ValueError(f"code hook {spec} returned an empty message")
    return out if out.endswith("\r") else out + "\r"


def _run_batches(
    batches: Iterator[pa.RecordBatch], *, hooks: dict[str, str], code_dir: str | None
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: payload := hook(payload); a failing message gets a NULL payload and its
    reason in content_type (what `include.store.finalize.finalize_transform` dead-letters)."""
    import pyarrow as pa

    functions = {dest: load_hook(spec, code_dir) for dest, spec in hooks.items()}
    for batch in batches:
        columns = batch.to_pydict()
        payloads: list[str | None] = []
        types: list[str] = []
        for dest, payload, content_type in zip(columns["destination"], columns["payload"], columns["content_type"]):
            try:
                payloads.append(call_hook(functions[dest], hooks[dest], payload))
                types.append(content_type)
            except ValueError as exc:
                payloads.append(None)
                types.append(str(exc))
        columns["payload"], columns["content_type"] = payloads, types
        yield pa.RecordBatch.from_pydict(columns, schema=batch.schema)


def apply_code_hooks(frame: DataFrame, hooks: Mapping[str, str], code_dir: str | None) -> DataFrame:
    """Run each destination's hook over its rows of ``frame`` (``destination``, ``content_type``,
    ``payload`` columns; others pass through). Rows already without a payload (the native rules
    dead-lettered them) and other destinations' rows never leave the JVM."""
    from pyspark.sql import functions as F

    if not hooks:
        return frame
    chosen = F.col("destination").isin(sorted(hooks)) & F.col("payload").isNotNull()
    run = partial(_run_batches, hooks=dict(hooks), code_dir=code_dir)
    hooked = frame.where(chosen).mapInArrow(run, frame.schema)
    return frame.where(~chosen).unionByName(hooked)
