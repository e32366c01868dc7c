"""`stageline up`: the whole single-node stack on the embedded defaults, one command.

SQLite store (migrated by the CLI first; `config/lookups/*.csv` imported as lookup tables) → Spark
Connect on local[*] → Airflow (scheduler, dag-processor, api-server as processes of their own on a SQLite
metadata DB, DAGs unpaused) → the demo MLLP receiver standing in for the EHR
(`python -m include.app.demo`, as `stageline demo receive`, writing `var/out/ehr/received.hl7`) →
listenerd with `config/`.
Progress is shown while starting; Ctrl-C stops everything in reverse order. State and the demo's
deliveries live under `var/` (`$STAGELINE_VAR`).

Sized for a small machine (`bench/stack_memory.py` measures it; docs/performance.md states the figure):
Airflow runs at most `EMBEDDED_PARALLELISM` tasks at once — what the Stageline DAGs need, not
Airflow's default of 32, whose LocalExecutor keeps a forked worker per slot — with one api-server
worker and one DAG-parsing process; no triggerer, since no Stageline task defers (start
`airflow triggerer` beside it if your own DAGs do). Airflow's three components are forked from one
process that has imported what they and their task processes share (`include.app.airflow_fork`),
so those pages are held once. Deliveries are sent from the deliver task itself
(`$STAGELINE_DELIVER_IN_PROCESS`): no Spark Python workers, no Spark session for that task. A Spark
driver with a 512 MiB heap, the serial collector and a status history sized for micro-batches;
glibc limited to two malloc arenas per process, which keeps threaded processes from holding memory
they have freed. Once everything is up, `stageline up` hands over to the slim supervisor
(`supervisor.Stack.handover`).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from include.app import ROOT, demo
from include.app.supervisor import Proc, Stack, port_open, python_module
from include.config import VAR_ENV, ServiceConfig, StoreConfig, private_var_dir
from include.schema.connections import DEFAULT_API_PORT
from include.store.stages import STAGES

AIRFLOW_PORT = 8080
DELIVER_IN_PROCESS_ENV = "STAGELINE_DELIVER_IN_PROCESS"
SPARK_CONNECT_PORT = 15002


MIN_SECRET_CHARS = 16
"""A kept secret shorter than this (an empty file left by a failed write, a truncated one) is not
used: it is generated anew."""


def _secret(path: Path) -> str:
    """A random secret generated once and kept, so restarts keep logins and tokens.

    Written to a private temporary name (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600 from the first
    byte), fsynced, then linked into place: the secret's name never shows a partial or empty file,
    even when the disk fills mid-write, and of two processes creating it at once both read the one
    that won. A kept file that is empty or shorter than MIN_SECRET_CHARS (left by an older version's
    failed write) is replaced by a new secret, never used as ''; one left group- or world-readable
    is tightened. A symlink in its place is refused (OSError), not followed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            _publish(path, secrets.token_urlsafe(24), replace=False)
            continue
        with os.fdopen(fd) as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                os.fchmod(f.fileno(), 0o600)
            value = f.read(4096).strip()
        if len(value) >= MIN_SECRET_CHARS:
            return value
        _publish(path, secrets.token_urlsafe(24), replace=True)
    raise OSError(f"cannot keep a secret in {path}")


def _publish(path: Path, text: str, *, replace: bool) -> None:
    """Put `text` at `path` whole or not at all: a 0600 temporary file, written and fsynced, then
    renamed over (`replace`) or hard-linked to a name that must not exist yet; the temporary name
    never outlives the call, and a failed write leaves `path` as it was."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, text)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path, follow_symlinks=False)
            except FileExistsError:
                pass  # another process made it first: the caller reads theirs
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, text: str) -> None:
    """Write `text` to `fd`, fsync it and close it."""
    try:
        view = memoryview(text.encode())
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, mode 0600 from the first byte (a new file renamed over the old)."""
    _publish(path, text, replace=True)


EMBEDDED_PARALLELISM = 4
"""Airflow task slots: the three stage DAGs hold one each while they run (a sensor or the job), the
two maintenance DAGs share the fourth for seconds a minute (one waits while the other runs; so
does a manual run). Each slot is a forked worker process that stays for the scheduler's life."""
SPARK_DRIVER_MEMORY = "512m"
SPARK_DRIVER_JAVA_OPTIONS = (
    "-XX:+UseSerialGC -Xms64m -XX:MinHeapFreeRatio=10 -XX:MaxHeapFreeRatio=30 "
    "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=48m -Xss512k -Xmn16m "
    "-Dio.netty.allocator.type=unpooled"
)
"""The driver's heap starts small and is given back after a collection (the serial collector does;
the default G1 sizes itself to 1/64 of the machine's memory at start), with a young generation of
16 MiB (micro-batches make little garbage at a time); C1 alone compiles the small jobs' code with a
fraction of C2's memory; netty (gRPC's and Spark's) allocates each buffer as needed instead of
keeping pooled arenas of direct memory."""
SPARK_SMALL_CONF = {
    "spark.network.io.preferDirectBufs": "false",
    "spark.shuffle.io.preferDirectBufs": "false",
    "spark.ui.retainedJobs": "100",
    "spark.ui.retainedStages": "100",
    "spark.ui.retainedTasks": "2000",
    "spark.sql.ui.retainedExecutions": "50",
    "spark.connect.ui.retainedSessions": "20",
    "spark.connect.ui.retainedStatements": "50",
}
"""Spark's netty buffers on the heap (which the driver gives back) rather than in pooled direct
memory (which it keeps), and a status history sized for micro-batches: the driver records every job,
stage, task and SQL execution (plan text included) for its UI even with the UI off, a thousand of
each by default, and a stage task runs several jobs per batch for hours."""
SMALL_MACHINE_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "OPENBLAS_NUM_THREADS": "1",
    "ARROW_DEFAULT_MEMORY_POOL": "system",
}
"""For every process of the stack: two malloc arenas; freed memory above 128 KiB given back to the
system at once rather than kept for reuse; OpenBLAS (loaded with numpy by the Spark Connect client)
without its thread pool — the scheduler imports numpy before forking, and nothing here does linear
algebra; pyarrow on the system allocator rather than jemalloc's retained arenas."""
AIRFLOW_COMPONENTS = ("api-server", "scheduler", "dag-processor")


@dataclass(frozen=True)
class Endpoints:
    """Where the config dir says listenerd answers: its API, and each inbound connection."""

    api_host: str
    api_port: int
    inbound: tuple[tuple[str, str, str], ...]  # (name, kind, where)


def endpoints_of(config_dir: Path) -> Endpoints:
    """Read `[api]` and `[[inbound]]` of `config_dir/connections.toml` for the banner and the
    readiness check (a port 0 is any free port: listenerd's log names the one bound)."""
    path = config_dir / "connections.toml"
    doc = tomllib.loads(path.read_text()) if path.exists() else {}
    api = doc.get("api") or {}
    inbound = []
    for conn in doc.get("inbound") or []:
        if "port" in conn:
            port = int(conn["port"])
            where = f"{conn.get('host', '127.0.0.1')}:{port}" if port else "any free port (see var/log/listenerd)"
        else:
            where = str(conn.get("directory") or conn.get("path") or "")
        inbound.append((str(conn.get("name", "?")), str(conn.get("kind", "?")), where))
    return Endpoints(str(api.get("host", "127.0.0.1")), int(api.get("port", DEFAULT_API_PORT)), tuple(inbound))


AIRFLOW_DB_RETRIES = 10
"""Airflow's `[database] max_db_retries` for every component (jittered backoff up to 5 s a try)."""


def airflow_env(var: Path, service_config: Path, pipeline_dir: Path | None = None) -> dict[str, str]:
    from include.spark import spark_connect_connection

    home = var / "airflow"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": str(EMBEDDED_PARALLELISM),
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        **SMALL_MACHINE_ENV,
        DELIVER_IN_PROCESS_ENV: "1",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        # never Airflow's unit-test mode, even when the caller's environment says so (a test run's
        # does): it loads unit_tests.cfg and its scheduler loops without sleeping, a core's worth of CPU
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{AIRFLOW_PORT}/execution/",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(AIRFLOW_PORT),
        "AIRFLOW__API__SECRET_KEY": _secret(home / ".api_secret"),
        "AIRFLOW__API_AUTH__JWT_SECRET": _secret(home / ".jwt_secret"),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        # A metadata DB restart (about a second) is retried through instead of ending the scheduler
        # (three tries, Airflow's default, give up within ~1.5 s; the scheduler then exits).
        "AIRFLOW__DATABASE__MAX_DB_RETRIES": str(AIRFLOW_DB_RETRIES),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
        "STAGELINE_CONFIG": str(service_config),
        "STAGELINE_PIPELINE_DIR": str(pipeline_dir or demo.PIPELINE_DIR),
        VAR_ENV: str(var),
        "AIRFLOW_CONN_STAGELINE_SPARK": spark_connect_connection("127.0.0.1", SPARK_CONNECT_PORT),
    }


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310  http:// URLs of our own loopback services
            return resp.status == 200
    except OSError:
        return False


STAGE_DAGS = tuple(stage.dag_id for stage in STAGES)
PIPELINE_READY_SECONDS = 120.0


def _stage_runs_waiting(password: str) -> bool:
    """Whether every stage DAG has a run waiting for work (`wait_for_work` running), asked through
    Airflow's REST API: until then the DAGs are still being parsed and scheduled, and a message
    sent would wait on that (about ten seconds after the processes are up) instead of moving."""
    base = f"http://127.0.0.1:{AIRFLOW_PORT}"
    try:
        login = urllib.request.Request(  # noqa: S310  loopback http://
            f"{base}/auth/token",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"username": "admin", "password": password}).encode(),
        )
        with urllib.request.urlopen(login, timeout=5) as resp:  # noqa: S310  loopback http://
            token = json.load(resp)["access_token"]
        query = urllib.request.Request(  # noqa: S310  loopback http://
            f"{base}/api/v2/dags/~/dagRuns/~/taskInstances?task_id=wait_for_work&state=running&limit=100",
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(query, timeout=5) as resp:  # noqa: S310  loopback http://
            waiting = {ti["dag_id"] for ti in json.load(resp)["task_instances"]}
    except (OSError, ValueError, KeyError):
        return False
    return waiting >= set(STAGE_DAGS)


def store_where(store: StoreConfig) -> str:
    """The store as the banner names it."""
    if store.backend == "sqlite":
        return f"SQLite store at {store.path}"
    return f"{store.backend} store at {store.server}:{store.effective_port}/{store.database}"


def _airflow(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "airflow"), *args]


def _prepare_pipeline(cfg: ServiceConfig, var: Path, echo, pipeline_dir: Path) -> list[tuple[str, str]]:
    """Import `<config dir>/lookups/*.csv` into the (migrated) store, check the pipeline config, create
    the file destinations' directories under `var` (a file destination never creates its own);
    returns where each destination's deliveries land."""
    from include.store import Store
    from include.store import lookups as lookup_tables

    lookups = pipeline_dir / "lookups"
    if lookups.is_dir() and any(lookups.glob("*.csv")):
        store = Store(cfg.store)
        try:
            imported = lookup_tables.import_dir(store, lookups)
        finally:
            store.close()
        echo(f"lookup tables from {lookups}: " + ", ".join(f"{name} ({count})" for name, count in imported))
    from include import stage_config
    from include.destinations_config import FileDestination

    for dest in stage_config.load(pipeline_dir).destinations.values():
        if isinstance(dest, FileDestination) and Path(dest.directory).is_relative_to(var):
            Path(dest.directory).mkdir(parents=True, exist_ok=True)
    return demo.delivery_locations(var, pipeline_dir)


def up(
    cfg: ServiceConfig,
    service_config: Path,
    *,
    config_dir: Path | None = None,
    echo=print,
    show_secrets: bool = False,
    handover: bool = False,
) -> int:
    """The stack on `config_dir` (listenerd's connections and the pipeline: routes, transforms,
    destinations, lookups; default the checkout's `config/`). The banner names the files holding the
    admin password and the API token; it prints them only with `show_secrets`. With `handover`
    (the `stageline up` program), this process then becomes the slim supervisor
    (`supervisor.Stack.handover`) and never returns."""
    config_dir = (config_dir or demo.PIPELINE_DIR).resolve()
    ends = endpoints_of(config_dir)
    var = private_var_dir()  # 0700: the store, the API token, Airflow's secrets
    env = airflow_env(var, service_config, config_dir)
    home = Path(env["AIRFLOW_HOME"])
    password = _secret(home / ".admin_password")
    _write_private(home / "simple_auth_manager_passwords.json.generated", json.dumps({"admin": password}))
    token_from = "$STAGELINE_API_TOKEN" if os.environ.get("STAGELINE_API_TOKEN") else str(var / ".api_token")
    token = os.environ.get("STAGELINE_API_TOKEN") or _secret(var / ".api_token")
    stack = Stack(var / "log", cwd=ROOT, echo=echo)
    try:
        deliveries = _prepare_pipeline(cfg, var, echo, config_dir)
        if port_open(demo.RECEIVER_PORT, demo.RECEIVER_HOST):
            raise RuntimeError(f"port {demo.RECEIVER_PORT} (the demo receiver's) is already in use")
        echo("migrating Airflow's metadata DB (first run: about a minute) ...")
        subprocess.run(  # noqa: S603  fixed argv
            _airflow("db", "migrate"),
            cwd=ROOT,
            env={**os.environ, **env},
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        from include.spark import start_connect_server

        echo(f"  starting spark-connect     (log: {var / 'log' / 'spark-connect'})")
        spark = start_connect_server(
            SPARK_CONNECT_PORT,
            log_dir=var / "log" / "spark-connect",
            driver_memory=SPARK_DRIVER_MEMORY,
            env=SMALL_MACHINE_ENV,
            conf={"spark.driver.extraJavaOptions": SPARK_DRIVER_JAVA_OPTIONS, **SPARK_SMALL_CONF},
        )
        stack.procs.append(Proc("spark-connect", [], popen=spark.process))
        echo("  spark-connect             ready")
        health = f"http://127.0.0.1:{AIRFLOW_PORT}/api/v2/monitor/health"
        stack.start(
            Proc(
                "airflow",
                python_module(
                    "include.app.airflow_fork",
                    "--log-dir",
                    str(var / "log"),
                    "--ready-url",
                    health,
                    *AIRFLOW_COMPONENTS,
                ),
                ready=lambda: _http_ok(health),
                env=env,
                ready_timeout=180,
            )
        )
        stack.start(
            Proc(
                "demo-receiver",
                python_module(
                    "include.app.demo",
                    "--host",
                    demo.RECEIVER_HOST,
                    "--port",
                    str(demo.RECEIVER_PORT),
                    "--out",
                    str(demo.receiver_dir(var)),
                ),
                env=SMALL_MACHINE_ENV,
                ready=lambda: port_open(demo.RECEIVER_PORT, demo.RECEIVER_HOST),
            )
        )
        api_port = ends.api_port
        stack.start(
            Proc(
                "listenerd",
                python_module("listeners.daemon", "--service-config", str(service_config), "--config", str(config_dir)),
                env={"STAGELINE_API_TOKEN": token, **SMALL_MACHINE_ENV},
                ready=lambda: port_open(api_port, ends.api_host),
            )
        )
        echo("  stage DAGs                waiting for their first runs ...")
        started = time.monotonic()
        while not _stage_runs_waiting(password):
            if time.monotonic() - started > PIPELINE_READY_SECONDS:
                echo(
                    f"  stage DAGs                not waiting for work after {PIPELINE_READY_SECONDS:.0f} s "
                    "(see the Airflow UI); starting anyway"
                )
                break
            time.sleep(0.5)
        else:
            echo(f"  stage DAGs                waiting for work in {time.monotonic() - started:.1f}s")
    except BaseException as exc:
        echo(f"\nstartup failed: {exc}")
        stack.stop()
        return 1
    echo(
        banner(
            cfg,
            config_dir,
            ends,
            deliveries,
            var,
            api_port=api_port,
            password=password,
            password_file=home / ".admin_password",
            token=token,
            token_from=token_from,
            show_secrets=show_secrets,
        )
    )
    if handover:
        stack.handover()
    return stack.wait()


def banner(
    cfg: ServiceConfig,
    config_dir: Path,
    ends: Endpoints,
    deliveries: list[tuple[str, str]],
    var: Path,
    *,
    api_port: int,
    password: str,
    password_file: Path,
    token: str,
    token_from: str,
    show_secrets: bool = False,
) -> str:
    """What `stageline up` prints once the stack is up: where everything is. The admin password and
    the API token only with `show_secrets` (a terminal's scrollback and a CI log outlive the run);
    otherwise where they are kept."""
    delivered = "\n                      ".join(f"{name:<8} → {place}" for name, place in deliveries)
    inbound = (
        "\n".join(f"  {kind.upper() + ' inbound':<19} {where:<19} ({name})" for name, kind, where in ends.inbound)
        or "  (no inbound connections configured)"
    )
    if any(kind == "mllp" for _, kind, _ in ends.inbound):
        inbound += "\n                      try: uv run stageline demo send --port <the MLLP port>"
    login = password if show_secrets else f"<the password in {password_file}>"
    bearer = token if show_secrets else f"<the token in {token_from}>"
    hint = "" if show_secrets else "\n  (secrets are not printed: `stageline up --show-secrets` prints them)"
    return f"""
Stageline is up (single node, {store_where(cfg.store)}, config {config_dir}).
{inbound}
  Airflow UI          http://127.0.0.1:{AIRFLOW_PORT}   login admin / {login}
  Stageline view      http://127.0.0.1:{AIRFLOW_PORT}/stageline/   (in the Airflow UI's nav: Stageline)
  listenerd API       http://{ends.api_host}:{api_port}/cluster/status   (Authorization: Bearer {bearer})
  Spark Connect       sc://127.0.0.1:{SPARK_CONNECT_PORT}
  deliveries          {delivered}
  logs                {var / "log"}{hint}
Ctrl-C stops everything."""
