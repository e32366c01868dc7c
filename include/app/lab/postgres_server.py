"""A throwaway PostgreSQL cluster (the lab's database, tests, benchmarks): `initdb` + `pg_ctl` in a temp dir.

Runs the server as the `postgres` OS user when we are root (PostgreSQL refuses to run as root),
listens on 127.0.0.1 on a free port with trust auth, and removes everything on `stop()`.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_BIN = Path(os.environ.get("STAGELINE_PG_BIN", "/usr/lib/postgresql/15/bin"))


_PORTS_FROM = 15000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now and outside the kernel's ephemeral range. A port handed out here may be bound
    minutes later (a standby's MLLP port when it takes over); an ephemeral one can meanwhile become
    the local end of some outbound connection (a pooled database session), and the bind then fails
    for as long as that connection lives. The bind test runs without SO_REUSEADDR on every address,
    so a port in any use (even TIME_WAIT) is passed over."""
    low, high = _ephemeral_range()
    pick = random.SystemRandom()
    candidates = (_PORTS_FROM, low - 1) if low - 1 - _PORTS_FROM >= 2000 else (high + 1, 65535)
    for _ in range(500):
        port = pick.randint(*candidates)
        if port in _handed_out:
            continue
        try:
            with socket.socket() as s:
                s.bind(("", port))
        except OSError:
            continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a crowded range: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self, *, settings: dict[str, str] | None = None) -> None:
        self.settings = {
            "fsync": "on",
            "synchronous_commit": "on",
            "max_connections": "200",
            "shared_buffers": "256MB",
            **(settings or {}),
        }
        self.port = free_port()
        self.host = "127.0.0.1"
        self.user = "postgres"
        self.root = Path(tempfile.mkdtemp(prefix="stageline-pg-"))
        self.data = self.root / "data"
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=True, capture_output=True, text=True)

    def start(self) -> PostgresServer:
        if not (PG_BIN / "initdb").exists():
            raise RuntimeError(f"PostgreSQL server binaries not found under {PG_BIN}; run scripts/setup.sh as root")
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.root.chmod(0o755)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            self.user,
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-instructions",
        )
        opts = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {self.port} -k {self.root} -c listen_addresses={self.host} {opts}",
            "start",
        )
        return self

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host={self.host} port={self.port} user={self.user} dbname={dbname}"

    def execute(self, sql: str, *, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.conninfo(dbname), autocommit=True) as conn:
            conn.execute(sql)

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(predicate, *, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value; raise after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
