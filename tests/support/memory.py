"""What a process tree costs in memory: the proportional set size (PSS) of every process in it, read
from `/proc/<pid>/smaps_rollup` (Linux). PSS shares each page among the processes that map it, so
the figures add up to what the tree really holds (RSS would count a forked worker's shared pages
once per worker)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class ProcMemory:
    pid: int
    name: str  # what it runs, short (e.g. "airflow scheduler", "java (spark-connect)")
    group: str  # the top-level process it belongs to (a child of the root), or "supervisor"
    pss_kib: int


def pss_kib(pid: int) -> int:
    """The PSS of one process in KiB (0 if it is gone or unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _label(proc: psutil.Process) -> str:
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return "?"
    if not argv:
        return proc.name()
    exe = Path(argv[0]).name
    if exe == "java":
        return "java (spark-connect)" if any("connect" in a.lower() for a in argv) else "java"
    if exe.startswith("python"):
        rest = [a for a in argv[1:] if not a.startswith("-")]
        return f"python {Path(rest[0]).name if rest else ''}".strip() + (f" {rest[1]}" if len(rest) > 1 else "")
    if exe == "airflow" or (len(argv) > 1 and argv[1].endswith("/airflow")):
        sub = [a for a in argv[1:] if not a.startswith("-") and not a.endswith("/airflow")]
        return "airflow " + " ".join(sub[:1])
    return " ".join([exe, *argv[1:2]])[:60]


def tree_memory(root_pid: int) -> list[ProcMemory]:
    """Every process under (and including) `root_pid`, each with its PSS; a child of the root names
    the group its descendants are counted in."""
    root = psutil.Process(root_pid)
    out = [ProcMemory(root_pid, _label(root), "supervisor", pss_kib(root_pid))]
    for child in root.children():
        group = _label(child)[:34]
        try:
            tree = [child, *child.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        out += [ProcMemory(p.pid, _label(p), group, pss_kib(p.pid)) for p in tree]
    return out


def summary(procs: list[ProcMemory]) -> str:
    """A table per group: processes, PSS; then the total."""
    groups: dict[str, list[ProcMemory]] = defaultdict(list)
    for p in procs:
        groups[p.group].append(p)
    lines = [f"{'component':<34} {'procs':>5} {'PSS MiB':>8}"]
    for group, members in sorted(groups.items(), key=lambda kv: -sum(p.pss_kib for p in kv[1])):
        lines.append(f"{group:<34} {len(members):>5} {sum(p.pss_kib for p in members) / 1024:>8.0f}")
    total = sum(p.pss_kib for p in procs)
    lines.append(f"{'total':<34} {len(procs):>5} {total / 1024:>8.0f}")
    lines.append("\nlargest processes:")
    lines += [f"  {p.pss_kib / 1024:>6.0f} MiB  {p.name[:70]}" for p in sorted(procs, key=lambda p: -p.pss_kib)[:25]]
    return "\n".join(lines)
