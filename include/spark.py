"""Spark sessions for the stage jobs: classic `local[*]` or a client of a long-lived Spark Connect server.

A classic session starts a JVM per job (seconds: docs/performance.md); a warm Spark Connect server
takes that cost once, and each job pays only the client's connect and its own work. JDBC drivers come from
Debian's packages (`/usr/share/java`), never from Maven: the hosts have no route to Maven Central.
With Spark Connect the *server* loads the drivers, so they are given to `start_connect_server`.

Under Airflow a stage task's session comes from the Spark provider, on an Airflow connection whose
value `spark_connect_connection` / `classic_spark_connection` build (the launchers set it), and
runs inside `stage_session`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import quote

# Spark's Python workers (UDFs, mapInPandas) must run this interpreter — the project's venv with
# pandas and pyarrow — not whatever `python3` comes first on PATH.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from include.config import StoreConfig

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_log = logging.getLogger(__name__)


def _builder() -> SparkSession.Builder:
    """pyspark's session builder, imported here and not at the top: the supervisor imports this
    module and must not hold pyspark (the embedded stack's memory, docs/performance.md)."""
    from pyspark.sql import SparkSession

    return SparkSession.builder


# Debian: libpostgresql-jdbc-java, libxerial-sqlite-jdbc-java, libjtds-java.
DRIVER_JARS: dict[str, str] = {
    "postgres": "/usr/share/java/postgresql.jar",
    "sqlite": "/usr/share/java/sqlite-jdbc.jar",
    "sqlserver": "/usr/share/java/jtds.jar",
}
# Named explicitly: jars added at runtime are not visible to java.sql.DriverManager's own lookup.
DRIVER_CLASSES: dict[str, str] = {
    "postgres": "org.postgresql.Driver",
    "sqlite": "org.sqlite.JDBC",
    "sqlserver": "net.sourceforge.jtds.jdbc.Driver",
}
CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_CONNECT_PORT = 15002
# Optimizer rules left out of the stages' plans: on the FHIR R4 mapping's plan they took half of
# the optimizer's time, every micro-batch, for a plan that executes no slower without them
# (docs/performance.md, "FHIR R4 output"). Every optimizer rule keeps a query's result; these only
# fold CASE/IF branches and JSON round trips the stages' expressions do not have.
SKIPPED_OPTIMIZER_RULES = (
    "org.apache.spark.sql.catalyst.optimizer.SimplifyConditionals",
    "org.apache.spark.sql.catalyst.optimizer.PushFoldableIntoBranches",
    "org.apache.spark.sql.catalyst.optimizer.OptimizeCsvJsonExprs",
)
# Settings that suit micro-batches of thousands of rows: no UI, few shuffle partitions, UTC.
SMALL_BATCH_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.optimizer.excludedRules": ",".join(SKIPPED_OPTIMIZER_RULES),
}


def spark_home() -> Path:
    """The pyspark package directory: it carries `bin/spark-submit` and the jars (a full SPARK_HOME).
    Found without importing pyspark, which would cost a process that only starts the server (the
    embedded stack's supervisor) the memory of pyspark.sql for its whole life."""
    import importlib.util

    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("pyspark is not installed")
    return Path(spec.origin).resolve().parent


def driver_jars(backends: Iterable[str] | None = None) -> list[str]:
    """The Debian JDBC driver jars that are installed, for `backends` (default: all three)."""
    wanted = DRIVER_JARS if backends is None else {b: DRIVER_JARS[b] for b in backends}
    return [path for path in wanted.values() if Path(path).exists()]


def jdbc_options(config: StoreConfig) -> dict[str, str]:
    """`url`, `driver` and credentials for Spark's JDBC source/sink, built from the store config.

    SQLite: xerial reads pragmas from the URL; busy_timeout makes Spark's connections wait out the
    store's short write transactions instead of failing with SQLITE_BUSY (WAL is already on, a
    property of the file). PostgreSQL: the store's schema as currentSchema, and batched INSERTs
    rewritten into multi-row ones. SQL Server: jTDS (Debian packages no Microsoft driver); Spark
    has no dialect for `jdbc:jtds:` URLs and uses its generic one (double-quoted identifiers).
    """
    backend = config.backend
    options = {"driver": DRIVER_CLASSES[backend]}
    if backend == "sqlite":
        path = Path(config.path).resolve()
        options["url"] = f"jdbc:sqlite:{path}?busy_timeout={int(config.busy_timeout_ms)}"
        return options
    host, port, database = config.server, config.effective_port, config.database
    if backend == "postgres":
        options["url"] = (
            f"jdbc:postgresql://{host}:{port}/{quote(database)}"
            f"?currentSchema={quote(config.schema)}&reWriteBatchedInserts=true"
            "&ApplicationName=stageline-spark"
        )
    elif backend == "sqlserver":
        options["url"] = f"jdbc:jtds:sqlserver://{host}:{port}/{database};appName=stageline-spark"
    else:
        raise ValueError(f"no JDBC mapping for backend {backend!r}")
    options["user"] = config.username
    if config.password:
        options["password"] = config.password
    return options


def spark_session(
    *,
    master: str | None = None,
    remote: str | None = None,
    app_name: str = "stageline",
    jars: Iterable[str] | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A Spark Connect client when `remote` ("sc://host:port") is given, else a classic session.

    Classic sessions get the JDBC driver jars through `spark.jars` (only when this call starts the
    JVM: getOrCreate returns a running session as it is); a Connect client cannot add them (the
    server's classpath is fixed at its start — see `start_connect_server`). `conf` is applied on
    top of SMALL_BATCH_CONF; for Connect only runtime SQL settings take effect. Creating a Connect
    session switches pyspark's functions to Connect for the whole process, so never mix the two
    kinds in one process.
    """
    if master is not None and remote is not None:
        raise ValueError("give master or remote, not both")
    settings = {**SMALL_BATCH_CONF, **(conf or {})}
    if remote is not None:
        session = _builder().remote(remote).appName(app_name).getOrCreate()
        for key, value in settings.items():
            if key.startswith("spark.sql."):
                session.conf.set(key, value)
        return session
    builder = _builder().master(master or "local[*]").appName(app_name)
    jar_list = list(jars) if jars is not None else driver_jars()
    if jar_list:
        builder = builder.config("spark.jars", ",".join(jar_list))
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


@dataclass
class ConnectServer:
    """A Spark Connect server this process started; stop it with `stop_connect_server`."""

    process: subprocess.Popen[bytes]
    port: int
    host: str
    log_path: Path
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"sc://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid


def start_connect_server(
    port: int = DEFAULT_CONNECT_PORT,
    *,
    log_dir: str | os.PathLike[str],
    jars: Iterable[str] | None = None,
    master: str = "local[*]",
    host: str = "127.0.0.1",
    conf: Mapping[str, str] | None = None,
    driver_memory: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 90.0,
) -> ConnectServer:
    """Start a Spark Connect server in the foreground of a child process and wait until it listens.

    Runs what Spark's `sbin/start-connect-server.sh` runs — `spark-submit --class
    SparkConnectServer` (the pip package ships no such script) — but as our own child rather
    than via spark-daemon.sh, so the handle owns exactly that PID. It binds `host` (loopback by
    default); the JDBC driver jars go on the server's classpath with `--jars`.
    """
    home = spark_home()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"spark-connect-{port}.log"
    jar_list = list(jars) if jars is not None else driver_jars()
    settings = {
        **SMALL_BATCH_CONF,
        "spark.connect.grpc.binding.port": str(port),
        "spark.connect.grpc.binding.address": host,
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        **(conf or {}),
    }
    command = [
        str(home / "bin" / "spark-submit"),
        "--class",
        CONNECT_SERVER_CLASS,
        "--name",
        "Spark Connect server",
        "--master",
        master,
    ]
    if jar_list:
        command += ["--jars", ",".join(jar_list)]
    if driver_memory:
        command += ["--driver-memory", driver_memory]
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    env = {**os.environ, **(env or {}), "SPARK_HOME": str(home)}
    log = open(log_path, "ab")
    process = subprocess.Popen(  # noqa: S603  argv built here from config values, never a shell
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # its own group: signals to us do not reach it
    server = ConnectServer(process=process, port=port, host=host, log_path=log_path, _log=log)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            _close(server)
            raise RuntimeError(
                f"Spark Connect server exited with {process.returncode} before listening; "
                f"log {log_path}:\n{_tail(log_path)}"
            )
        if _listening(host, port):
            return server
        if time.monotonic() > deadline:
            stop_connect_server(server)
            raise TimeoutError(
                f"Spark Connect server did not listen on {host}:{port} within {timeout:.0f} s; "
                f"log {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.2)


def stop_connect_server(server: ConnectServer, *, timeout: float = 30.0) -> int | None:
    """Stop a server we started: SIGTERM (the JVM shuts Spark down), SIGKILL after `timeout`.

    The signal goes to the server's own process group (the server leads it; it was started in a
    new session), so anything it spawned goes too. Signals are sent only while the server has not
    been reaped, when its group id cannot belong to anybody else. Returns the exit code.
    """
    process = server.process
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(timeout=timeout)
    _close(server)
    return process.returncode


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _close(server: ConnectServer) -> None:
    if server._log is not None:
        server._log.close()
        server._log = None


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


CONNECT_RETRY_SECONDS = 3.0
"""How long a Connect client keeps retrying an unreachable server before the call fails."""


def bound_connect_retries(spark: SparkSession, *, seconds: float = CONNECT_RETRY_SECONDS) -> None:
    """Give a Spark Connect client a retry budget of seconds, not pyspark's default of 10 minutes.

    A stage task whose server was killed or restarted then fails fast — its rows handed back, its
    session replaced by Airflow's retry — instead of hanging in the client's backoff. Classic
    sessions are left as they are.
    """
    client = _connect_client(spark)
    if client is None:
        return
    from pyspark.sql.connect.client.retries import DefaultPolicy

    initial_ms, multiplier = 100, 2.0
    retries, waited = 0, 0.0
    while waited < seconds * 1000:
        waited += initial_ms * multiplier**retries
        retries += 1
    others = [p for p in client.get_retry_policies() if not isinstance(p, DefaultPolicy)]
    client.set_retry_policies(
        [
            DefaultPolicy(
                max_retries=retries,
                initial_backoff=initial_ms,
                backoff_multiplier=multiplier,
                max_backoff=int(seconds * 1000),
                jitter=50,
                min_jitter_threshold=0,
            )
        ]
        + others
    )


def close_session(spark: SparkSession | None, *, timeout: float = 3.0, release: bool = True) -> None:
    """Close a Spark Connect client without ever hanging on a server that has gone away.

    pyspark's own exit hook (and `SparkSession.stop()`) talk to the server with retries; with the
    server gone the process would wait in them at exit. Here the session is released in a
    background thread for at most `timeout` seconds, then the channel is closed locally, which
    also turns the exit hook into a no-op. Classic sessions are left to their owner. With
    `release=False` the server keeps the session (a stage's sticky one, reopened by the next task).
    """
    client = _connect_client(spark)
    if client is None or client.is_closed:
        return
    if release:
        import threading

        releaser = threading.Thread(target=_release_quietly, args=(client,), name="spark-connect-release", daemon=True)
        releaser.start()
        releaser.join(timeout)
    try:
        client._channel.close()
    finally:
        client._closed = True


RENEW_SECONDS = 60.0
"""How long a stage task waits for a Spark Connect server to answer before it gives up (and fails)."""

_SESSION_NAMESPACE = uuid.UUID("5d6a2d0e-6f0a-4b8e-9a57-5e3b1c0f7a11")


def stage_session_id(name: str) -> str:
    """The Spark Connect session id every task of one stage (`name`: its DAG id) reopens.

    A new Connect session pays for its first Python job (Spark starts a Python worker daemon per
    session: most of a deliver round's cost after a failover, docs/performance.md); a stage task that reopens
    the session its predecessor left — a retry after a killed task, the next run — finds those
    workers warm. One stage runs one task at a time (`max_active_runs=1`), so one id per stage.
    """
    return str(uuid.UUID(bytes=uuid.uuid5(_SESSION_NAMESPACE, name).bytes, version=4))


def with_session_id(url: str, session_id: str) -> str:
    """`url` ("sc://host:port[/;param=…]") with `session_id` as its session."""
    base, _, params = url.partition("/;")
    kept = [p for p in params.split(";") if p and not p.startswith("session_id=")]
    return f"{base.rstrip('/')}/;" + ";".join(kept + [f"session_id={session_id}"])


def endpoint_of(url: str) -> tuple[str, int]:
    """The host and port of a Spark Connect URL."""
    netloc = url.removeprefix("sc://").split("/", 1)[0].split(";", 1)[0]
    host, _, port = netloc.rpartition(":")
    return (host or netloc), int(port or DEFAULT_CONNECT_PORT)


class StageSession:
    """The Spark session a stage task works with, renewed in place when its Connect server goes away.

    A killed or restarted Spark Connect server loses every session on it. Failing the task would get
    a new session from Airflow's retry, but only after the try ends, the scheduler picks the retry
    up and a new task process starts: seconds on top of the server's own restart, and a retry that
    lands while the server is still down fails again. So the task opens a new session itself, on
    the first of its `remotes` that answers — another server, already warm, takes over at once; with one
    server, the task waits for it to come back. The batch that failed has already handed its rows
    back. Classic sessions (and none at all) are not renewed.

    With a `name` the session is the stage's sticky one (`stage_session_id`): opened with that id,
    it interrupts whatever a killed predecessor left running on it, and it is not released at the
    end (the next task reopens it warm). Without one, a session is released when it closes.
    """

    def __init__(
        self,
        spark: SparkSession | None,
        conf: Mapping[str, str] | None = None,
        *,
        remotes: Sequence[str] = (),
        name: str | None = None,
    ) -> None:
        self.spark = spark
        client = _connect_client(spark)
        own = [f"sc://{client._builder.endpoint}"] if client is not None else []
        self.remotes: list[str] = own + [r for r in remotes if r not in own]
        self.remote: str | None = own[0] if own else None
        self._conf = dict(conf or {})
        self._session_id = stage_session_id(name) if name else None

    @classmethod
    def of(cls, spark: SparkSession | StageSession | None) -> StageSession:
        return spark if isinstance(spark, StageSession) else cls(spark)

    @classmethod
    def connect(
        cls,
        remotes: Sequence[str],
        conf: Mapping[str, str] | None = None,
        *,
        name: str | None = None,
        timeout: float = RENEW_SECONDS,
    ) -> StageSession:
        """A session on the first of `remotes` that answers (waiting up to `timeout` seconds)."""
        session = cls(None, conf, remotes=remotes, name=name)
        if not session.renew(timeout=timeout):
            raise ConnectionError(f"no Spark Connect server answered within {timeout:.0f} s: {', '.join(remotes)}")
        return session

    def renew(self, *, timeout: float = RENEW_SECONDS, poll: float = 0.25) -> bool:
        """Replace a lost Connect session with a new one on the first server that answers, waiting up
        to `timeout` seconds; False for a classic session or when no server answers in time."""
        if not self.remotes:
            return False
        if self.spark is not None:
            close_session(self.spark, timeout=0.5, release=self._session_id is None)
            self.spark = None
        # The server just lost is asked last: another server answers at once, while a restarting
        # server may listen before it can serve.
        lost = self.remotes.index(self.remote) if self.remote in self.remotes else -1
        order = self.remotes[lost + 1 :] + self.remotes[: lost + 1]
        deadline = time.monotonic() + timeout
        while True:
            for remote in order:
                if not _listening(*endpoint_of(remote)):
                    continue
                try:
                    self.spark = self._open(remote)
                    self.remote = remote
                    return True
                except Exception as exc:  # a server still starting: ask again
                    _log.info("Spark Connect at %s not ready yet: %s", remote, type(exc).__name__)
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)

    def _open(self, remote: str) -> SparkSession:
        url = with_session_id(remote, self._session_id) if self._session_id else remote
        fresh = _builder().remote(url).create()
        bound_connect_retries(fresh, seconds=STANDBY_RETRY_SECONDS if len(self.remotes) > 1 else CONNECT_RETRY_SECONDS)
        try:
            if self._session_id:
                fresh.interruptAll()  # a killed predecessor's operations, still running on this session
            # Setting the session's conf is a round trip: the server answers, not only listens. No
            # job here: after a killed predecessor it would wait for the executor slots its
            # interrupted tasks still hold (docs/performance.md), which the first real batch waits for anyway.
            for key, value in {**SMALL_BATCH_CONF, **self._conf}.items():
                if key.startswith("spark.sql."):
                    fresh.conf.set(key, value)
        except Exception:
            close_session(fresh, timeout=0.5, release=False)
            raise
        return fresh

    def warm_others(self) -> threading.Thread | None:
        """In the background, open this stage's sticky session on every other server that listens
        and run a Python job on it, so a move there finds its Python workers started (a restarted
        server is warmed again by the next task that starts). Best effort; a daemon thread."""
        others = [r for r in self.remotes if r != self.remote]
        if not others or not self._session_id:
            return None
        thread = threading.Thread(
            target=self._warm, args=(others, self._session_id), name="spark-connect-warm", daemon=True
        )
        thread.start()
        return thread

    def _warm(self, remotes: Sequence[str], session_id: str) -> None:
        def identity(batches: Iterator[Any]) -> Iterator[Any]:
            yield from batches

        for remote in remotes:
            if not _listening(*endpoint_of(remote)):
                continue
            spark = None
            try:
                spark = _builder().remote(with_session_id(remote, session_id)).create()
                bound_connect_retries(spark, seconds=STANDBY_RETRY_SECONDS)
                spark.range(64).repartition(2).mapInPandas(identity, "id long").collect()
            except Exception as exc:  # warming is best effort
                _log.info("Spark Connect at %s not warmed: %s", remote.split("/;")[0], type(exc).__name__)
            finally:
                close_session(spark, timeout=0.5, release=False)

    def close(self) -> None:
        close_session(self.spark, release=self._session_id is None)


STANDBY_RETRY_SECONDS = 1.0
"""A client with other servers to move to gives up on its server after this long."""


@contextlib.contextmanager
def stage_session(spark: SparkSession | None, conf: Mapping[str, str] | None = None) -> Iterator[StageSession]:
    """Around a stage job: a Spark Connect client fails within seconds when its server is gone
    (instead of retrying for minutes), is renewed when the server comes back (`StageSession`),
    and is closed without waiting on a dead server at exit."""
    session = StageSession(spark, conf)
    if spark is None:
        yield session
        return
    bound_connect_retries(spark)
    try:
        yield session
    finally:
        session.close()
        close_session(spark)


def spark_connect_connection(host: str, port: int, *, servers: Sequence[str] = ()) -> str:
    """An Airflow connection (JSON, e.g. for `AIRFLOW_CONN_STAGELINE_SPARK`) to a Spark Connect
    server; its JDBC jars are on the server. `servers`: further servers ("sc://host:port", the
    extra `servers`, comma-separated) the stages are spread over and move to when one stops answering."""
    conn: dict[str, Any] = {"conn_type": "spark_connect", "host": host, "port": int(port)}
    if servers:
        conn["extra"] = {"servers": ",".join(servers)}
    return json.dumps(conn)


def classic_spark_connection(master: str = "local[*]") -> str:
    """An Airflow connection (JSON) for a classic session per task on `master`.

    The connection's extras become the session's Spark conf (Spark provider): the Debian JDBC
    driver jars, this venv's Python for the workers, no UI.
    """
    return json.dumps(
        {
            "conn_type": "spark",
            "host": master,
            "extra": {
                "spark.jars": ",".join(DRIVER_JARS.values()),
                "spark.pyspark.python": sys.executable,
                "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false",
            },
        }
    )


def _connect_client(spark: SparkSession | None) -> Any:
    """The Spark Connect client of `spark`, or None for a classic session (or none at all)."""
    if spark is None:
        return None
    try:
        return spark.client
    except Exception:  # classic sessions raise ONLY_SUPPORTED_WITH_SPARK_CONNECT
        return None


def _release_quietly(client: object) -> None:
    try:
        client.release_session()  # type: ignore[attr-defined]
    except Exception:  # noqa: S110 - best effort: the server may be gone
        pass


def session_lost(exc: BaseException) -> bool:
    """Whether `exc` says the Spark Connect session is gone (server killed, restarted or out of
    reach): retrying on the same session cannot help, a new task with a new session can."""
    for e in _chain(exc):
        name = type(e).__name__
        if (
            name in ("RetriesExceeded", "SparkConnectGrpcException")
            or "SESSION_NOT_FOUND" in str(e)
            or "SESSION_CHANGED" in str(e)
            or "Session not found" in str(e)
        ):
            return True
    return False


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen
