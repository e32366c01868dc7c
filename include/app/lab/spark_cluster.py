"""A Spark standalone cluster from the pyspark wheel: a master and workers as separate processes,
started the way an operator starts them on other hosts (`spark-class …Master` / `…Worker`, what
`sbin/start-master.sh` and `start-worker.sh` run, in the foreground so we own their PIDs), for the
lab, tests and benchmarks. A Spark Connect server then runs its jobs on it:
`start_connect_server(master=cluster.master_url)` (`include/spark.py`).

What must be shared between hosts in a real deployment is in docs/deployment.md: the JDBC jars
(Debian packages on every worker host), the checkout's `.venv` at the same path (the executors'
Python), and file destinations' directories.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from include.app.lab.postgres_server import free_port
from include.spark import spark_home


@dataclass
class SparkProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    work_dir: Path | None = None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to its process group (it leads one), SIGKILL after `timeout`; by PID only."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL (a fault: a worker lost mid-batch)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@dataclass
class SparkCluster:
    """A standalone master and `workers` workers (each `cores` cores) on this host."""

    log_dir: Path
    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    host: str = "127.0.0.1"
    master_port: int = field(default_factory=free_port)
    processes: list[SparkProcess] = field(default_factory=list)

    @property
    def master_url(self) -> str:
        return f"spark://{self.host}:{self.master_port}"

    def start(self, timeout: float = 90.0) -> SparkCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.processes.append(
                self._spawn(
                    "master",
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    self.host,
                    "--port",
                    str(self.master_port),
                    "--webui-port",
                    str(free_port()),
                )
            )
            self._wait(
                lambda: "I have been elected leader" in self.processes[0].log_path.read_text(errors="replace"),
                timeout,
                "the Spark master",
            )
            for n in range(self.workers):
                work = self.log_dir / f"worker-{n}"
                work.mkdir(exist_ok=True)
                self.processes.append(self._spawn_worker(f"worker-{n}", work))
            for worker in self.processes[1:]:
                self._wait(
                    lambda w=worker: "Successfully registered with master" in w.log_path.read_text(errors="replace"),
                    timeout,
                    f"Spark {worker.name} to register",
                )
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, worker: SparkProcess, timeout: float = 90.0) -> SparkProcess:
        """Start a stopped or killed worker again (as a supervisor would), in its place in the list."""

        def registrations() -> int:
            return worker.log_path.read_text(errors="replace").count("Successfully registered with master")

        if worker.work_dir is None:
            raise ValueError(f"{worker.name} is not a worker of this cluster")
        before = registrations()
        again = self._spawn_worker(worker.name, worker.work_dir)
        self.processes[self.processes.index(worker)] = again
        self._wait(lambda: registrations() > before, timeout, f"Spark {worker.name} to register again")
        return again

    @property
    def worker_processes(self) -> list[SparkProcess]:
        return [p for p in self.processes if p.name.startswith("worker")]

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()

    def _spawn_worker(self, name: str, work_dir: Path) -> SparkProcess:
        """A worker of this cluster's size, registering with its master; a restart keeps its work dir."""
        worker = self._spawn(
            name,
            "org.apache.spark.deploy.worker.Worker",
            "--host",
            self.host,
            "--cores",
            str(self.cores),
            "--memory",
            self.memory,
            "--work-dir",
            str(work_dir),
            "--webui-port",
            str(free_port()),
            self.master_url,
        )
        worker.work_dir = work_dir
        return worker

    def _spawn(self, name: str, main_class: str, *args: str) -> SparkProcess:
        home = spark_home()
        log_path = self.log_dir / f"spark-{name}.log"
        env = {
            **os.environ,
            "SPARK_HOME": str(home),
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOG_DIR": str(self.log_dir),
            "SPARK_NO_DAEMONIZE": "1",
        }
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [str(home / "bin" / "spark-class"), main_class, *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return SparkProcess(name, process, log_path)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self.processes if p.process.poll() is not None]
            if dead:
                raise RuntimeError(
                    f"{dead[0].name} exited with {dead[0].process.returncode}: "
                    f"{dead[0].log_path.read_text(errors='replace')[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {what} ({self.log_dir})")
            time.sleep(0.2)
