"""Run real `listenerd` processes (the lab's nodes, tests, benchmarks): write their config, start
them, wait for their API, stop them by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from include.app import ROOT
from include.app.lab.postgres_server import free_port, wait_for
from include.config import StoreConfig


def toml_value(value: object) -> str:
    """TOML for the simple values test configs use (inline tables for dicts)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):  # an array of inline tables, as rules and conditions are
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def store_toml(store: StoreConfig) -> str:
    if store.backend == "sqlite":
        return (
            f'[store]\nbackend = "sqlite"\npath = "{store.path}"\nbusy_timeout_ms = {store.busy_timeout_ms}\n'
            f"busy_retry_seconds = {float(store.busy_retry_seconds)}\n"
        )
    return (
        f'[store]\nbackend = "{store.backend}"\nserver = "{store.server}"\nport = {store.port}\n'
        f'database = "{store.database}"\nusername = "{store.username}"\npool_size = {store.pool_size}\n'
        + ("allow_unsafe_durability = true\n" if store.allow_unsafe_durability else "")
        + (f"sync_standbys_expected = {store.sync_standbys_expected}\n" if store.sync_standbys_expected else "")
    )


@dataclass
class Daemon:
    """One listenerd process with its own config dir and API port."""

    workdir: Path
    store: StoreConfig
    node_id: str
    cluster: dict | None = None  # [cluster] overrides; None = single node
    inbound: list[dict] = field(default_factory=list)
    api_port: int = field(default_factory=free_port)
    token: str = "test-viewer-token"
    proc: subprocess.Popen | None = None
    config_dir: Path | None = None  # share another daemon's config dir (identical config)

    def write_config(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cluster = {"enabled": False, "cluster_name": "test-cluster", "node_id": self.node_id, **(self.cluster or {})}
        lines = [store_toml(self.store), "[cluster]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in cluster.items()]
        (self.workdir / "stageline.toml").write_text("\n".join(lines) + "\n")
        if self.config_dir is not None:
            return
        conf = self.workdir / "config"
        conf.mkdir(exist_ok=True)
        out = ['[api]\nhost = "127.0.0.1"\n', '[[api.tokens]]\nrole = "VIEWER"\ntoken_env = "STAGELINE_TEST_TOKEN"\n']
        for conn in self.inbound:
            out.append("[[inbound]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in conn.items()))
        (conf / "connections.toml").write_text("\n".join(out))

    def start(self, *, wait: bool = True) -> Daemon:
        self.write_config()
        env = {**os.environ, "STAGELINE_TEST_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        self.log = open(self.workdir / "listenerd.log", "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "listeners.daemon",
                "--service-config",
                str(self.workdir / "stageline.toml"),
                "--config",
                str(self.config_dir or self.workdir / "config"),
                "--api-port",
                str(self.api_port),
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        if wait:
            wait_for(lambda: self.proc.poll() is not None or self.health(), timeout=30, what=f"{self.node_id} API")
            if self.proc.poll() is not None:
                raise RuntimeError(f"listenerd exited with {self.proc.returncode}:\n{self.output()}")
        return self

    def get(self, path: str, *, token: str | None = "default") -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.api_port}{path}")
        if token:
            req.add_header("Authorization", f"Bearer {self.token if token == 'default' else token}")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def health(self) -> bool:
        try:
            return self.get("/health", token=None)[0] == 200
        except OSError:
            return False

    def status(self) -> dict:
        return json.loads(self.get("/cluster/status")[1])

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, *, timeout: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait(10)

    def output(self) -> str:
        return (self.workdir / "listenerd.log").read_text(errors="replace")
