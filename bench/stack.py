"""The embedded single-node stack (`stageline up`) for the benchmarks that measure it whole
(bench/latency.py, bench/stack_memory.py, bench/soak.py): started in a work dir of its own, waited for until its
banner says it is up, stopped as a user stops it (Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from include.app.lab.postgres_server import wait_for

ROOT = Path(__file__).resolve().parents[1]
STAGELINE = Path(sys.executable).parent / "stageline"


class EmbeddedStack:
    """`stageline up` on `work/stageline.toml` (written from `service_toml`), var dir `work/var`."""

    def __init__(self, work: Path, service_toml: str) -> None:
        self.work = work
        self.service_toml = service_toml
        self.var = work / "var"
        self.env = {**os.environ, "STAGELINE_VAR": str(self.var)}
        self.proc: subprocess.Popen | None = None
        self.up_seconds = 0.0
        self._log: IO[str] | None = None

    @property
    def log_path(self) -> Path:
        return self.work / "up.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, *, timeout: float = 600) -> EmbeddedStack:
        """Start it and wait for "Stageline is up"; a stack that exits first ends the bench with its log."""
        config = self.work / "stageline.toml"
        config.write_text(self.service_toml)
        self._log = open(self.log_path, "w+")
        self.proc = proc = subprocess.Popen(
            [str(STAGELINE), "up", "--service-config", str(config)],
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        started = time.perf_counter()
        wait_for(
            lambda: proc.poll() is not None or "Stageline is up" in self.log_path.read_text(),
            timeout=timeout,
            interval=1,
            what="the stack",
        )
        if proc.poll() is not None:
            raise SystemExit(self.log_path.read_text())
        self.up_seconds = time.perf_counter() - started
        return self

    def stop(self) -> None:
        """Ctrl-C, as a user would; killed if it has not stopped within 180 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._log is not None:
            self._log.close()
