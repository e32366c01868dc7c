"""The structure holds: imports flow one way and no module imports itself in a circle.

    config / HL7 (include: config, pipeline config, hl7path)
      ← store (include.store) and the rest of include (leader check, housekeeping, stage loop)
        ← listeners, spark_jobs (neither imports the other)
          ← the app (include.app: CLI, embedded stack, demo, lab), the Airflow plugin
            (plugins/stageline_airflow) (neither imports the other)
            ← the DAG files

`include.app` lives inside `include` but is a layer of its own: the rest of `include` never imports it.

Every module's imports are read with `ast` — those inside functions and under `TYPE_CHECKING`
too, since a lazy import is still a dependency — and resolved to the project's own modules.
Nothing is imported to read them. The last test imports the pipeline config in a fresh interpreter
and looks at what came with it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "include": ROOT / "include",
    "listeners": ROOT / "listeners",
    "spark_jobs": ROOT / "spark_jobs",
    "stageline_airflow": ROOT / "plugins" / "stageline_airflow",
    "dags": ROOT / "dags",
}
"""Top-level package → its directory (the plugin is imported as `stageline_airflow`, from `plugins/`)."""
LAYERS = {"include": 0, "listeners": 1, "spark_jobs": 1, "include.app": 2, "stageline_airflow": 2, "dags": 3}
"""A module imports only its own package and the packages of lower layers; a module belongs to the
longest package here that holds it (`include.app.cli` to `include.app`, `include.store` to `include`)."""
CONFIG_MODULES = (
    "include.config",
    "include.hl7path",
    "include.conditions",
    "include.routes_config",
    "include.destinations_config",
    "include.transforms_config",
    "include.stage_config",
    "include.fhir_options",
    "include.fhir_types",
    "include.keys_config",
    "include.charsets",
    "include.cidrs",
    "include.accept_ack",
    "include.schema",
    *(
        f"include.schema.{p.stem}"
        for p in (Path(__file__).resolve().parents[1] / "include" / "schema").glob("*.py")
        if p.stem != "__init__"
    ),
)
"""The bottom of `include`: plain config parsing, no store, no Spark, no other `include` module."""
NOT_SHIPPED = ("tests", "bench")


def modules(sources: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name → file, for every `.py` under each source directory."""
    found = {}
    for package, directory in sources.items():
        for path in sorted(directory.rglob("*.py")):
            parts = [package, *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_names(name: str, path: Path) -> Iterator[tuple[str, ...]]:
    """Every import in `path`, anywhere in the file, as the dotted names it may mean, most precise
    first: `from a.b import c` is module `a.b.c` if there is one, else a name in `a.b`."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name,) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(package + ([module] if module else []))
            yield from ((f"{module}.{alias.name}", module) for alias in node.names)


def graph(sources: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the other project modules (and `tests` / `bench` packages) it imports."""
    known = modules(sources)
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for candidates in imported_names(name, path):
            target = _resolve(candidates, known)
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def _resolve(candidates: tuple[str, ...], known: dict[str, Path]) -> str | None:
    if candidates[0].split(".")[0] in NOT_SHIPPED:
        return candidates[0].split(".")[0]
    for candidate in candidates:
        if candidate in known:
            return candidate
    parts = candidates[-1].split(".")  # a name inside a module: the longest known prefix
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) or None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module, or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if target not in edges:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges[node]:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer_package(module: str) -> str:
    """The package of LAYERS that `module` belongs to: the longest one that holds it."""
    parts = module.split(".")
    while ".".join(parts) not in LAYERS:
        parts.pop()
    return ".".join(parts)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """`module → target` for every import that goes up (or sideways) in LAYERS, or into tests/bench."""
    wrong = []
    for module, targets in sorted(edges.items()):
        own = layer_package(module)
        for target in sorted(targets):
            if target.split(".")[0] in NOT_SHIPPED:
                wrong.append(f"{module} → {target}")
                continue
            other = layer_package(target)
            if other != own and LAYERS[other] >= LAYERS[own]:
                wrong.append(f"{module} → {target}")
    return wrong


def config_imports(edges: dict[str, set[str]], config_modules: Iterable[str]) -> list[str]:
    """Imports from the config modules into the rest of the project."""
    config_modules = set(config_modules)
    return [
        f"{module} → {target}"
        for module in sorted(config_modules & set(edges))
        for target in sorted(edges[module])
        if target not in config_modules
    ]


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return graph(SOURCES)


def test_every_package_is_read(edges):
    assert {name.split(".")[0] for name in edges} == set(SOURCES)
    assert {layer_package(name) for name in edges} == set(LAYERS)
    assert "include.stage_loop" in edges["stageline_airflow.tasks"]  # imports are being read at all


def test_no_module_imports_itself_in_a_circle(edges):
    assert cycles(edges) == []


def test_imports_flow_one_way(edges):
    """In particular `include` imports nothing from spark_jobs, listeners or the plugin, not even lazily."""
    assert upward_imports(edges) == []


def test_the_config_modules_import_no_store_and_nothing_else_of_the_project(edges):
    assert config_imports(edges, CONFIG_MODULES) == []


def test_loading_the_pipeline_config_imports_no_spark_and_no_store():
    code = (
        "import sys\nimport include.stage_config\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'py4j', 'airflow') "
        "or m.startswith('include.store') or m.startswith('spark_jobs')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# the checks themselves, on a tree made to break every rule


def test_checks_see_a_cycle_an_upward_import_a_lazy_one_the_app_imported_from_below_and_a_config_module_reaching_out(
    tmp_path,
):
    def write(relative: str, text: str = "") -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("include/__init__.py")
    write("include/config.py", "from include import store\n")
    write("include/store.py", "from include.a import x\n")
    write("include/a.py", "from . import store\n\ndef later():\n    from spark_jobs import job\n")
    write("include/b.py", "import tests.support\n")
    write("include/c.py", "def later():\n    from include.app import cli\n")
    write("include/app/__init__.py")
    write("include/app/cli.py", "from include import config\nfrom spark_jobs import job\n")
    write("spark_jobs/__init__.py")
    write("spark_jobs/job.py", "from include.b import helper\n")
    write("spark_jobs/other.py", "from include.app import cli\n")
    sources = {"include": tmp_path / "include", "spark_jobs": tmp_path / "spark_jobs"}

    found = graph(sources)

    assert cycles(found) == [["include.a", "include.store"]]
    assert upward_imports(found) == [
        "include.a → spark_jobs.job",
        "include.b → tests",
        "include.c → include.app.cli",
        "spark_jobs.other → include.app.cli",
    ]
    assert config_imports(found, ["include.config"]) == ["include.config → include.store"]
