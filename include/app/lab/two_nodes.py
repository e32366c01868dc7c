"""A two-node Stageline cluster from plain processes on one host, for failover benchmarks and tests.

    PostgreSQL (throwaway; databases `stageline` and `airflow`)
      ├─ TcpProxy per node ── listenerd node-a / node-b (cluster mode, per-node MLLP ports)
      │                          └─ HAProxy VIP: `GET /leader` on each node's API (serving leader only)
      └─ Airflow scheduler, dag-processor, triggerer, api-server (LocalExecutor), DAGs unpaused
           └─ stage tasks ── Spark Connect server ── MLLP destination ── recorder (every delivery)

Why it exists: the failover promise (invariant 8, docs/invariants.md) is about the whole pipeline, and only a
real scheduler, real processes and real sockets show how long each fault keeps messages from the
receiver. `Lab` is one object with `start()` / `stop()`, addresses, a handle per process and one
method per fault; everything is stopped by PID. Stage tasks reach PostgreSQL directly (Airflow is
not a node); only the listenerd links go through the per-node proxies, so `cut_db` partitions one
node. The two nodes' `connections.toml` differ only in the MLLP port, so each reports the other's
config hash as a CONFIG MISMATCH: harmless here, and the price of one-host per-node ports.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from include.app import ROOT
from include.app.lab import recorder
from include.app.lab.haproxy import HAPROXY, vip_servers
from include.app.lab.listenerd import Daemon, toml_value
from include.app.lab.postgres_server import PostgresServer, free_port, wait_for
from include.app.lab.replicated_store import ReplicatedStore
from include.app.lab.tcpproxy import TcpProxy
from include.app.supervisor import Proc, Stack, port_open, python_module
from include.config import StoreConfig
from include.store.stages import STAGES

if TYPE_CHECKING:
    from include.app.lab.spark_cluster import SparkCluster
    from include.spark import ConnectServer

CLUSTER_NAME = "lab"
STAGE_DAGS = tuple(stage.dag_id for stage in STAGES)


def haproxy_config(vip_port: int, stats_port: int, servers: list[tuple[str, int, int]], *, inter_ms: int = 500) -> str:
    """deploy/haproxy.cfg's MLLP VIP on loopback: `balance first`, each server (name, MLLP port, API
    port) checked by `GET /leader` on its API port (200 on the serving leader only; a frozen leader's
    kernel would still pass a TCP connect to its MLLP port), a status page (CSV at `/;csv`)."""
    lines = "\n".join(f"    server {name} 127.0.0.1:{mllp} check port {api}" for name, mllp, api in servers)
    return f"""global
    maxconn 4096

defaults
    mode tcp
    timeout connect 3s
    timeout client 6m
    timeout server 6m
    # a frozen node never answers: out within inter x fall + timeout check
    timeout check {max(100, inter_ms * 4 // 5)}ms
    retries 2
    option redispatch
    # no on-marked-down shutdown-sessions: see deploy/haproxy.cfg
    default-server inter {inter_ms}ms fall 2 rise 1

frontend mllp_vip
    bind 127.0.0.1:{vip_port}
    default_backend mllp_leader

frontend stats
    mode http
    bind 127.0.0.1:{stats_port}
    timeout client 30s
    stats enable
    stats uri /

backend mllp_leader
    balance first
    option httpchk GET /leader?inbound=adt-in
    http-check expect status 200
{lines}
"""


@dataclass(frozen=True)
class Timings:
    """The lab's fast cluster timings (issue 8's measurement) and the stage tasks' idle linger."""

    heartbeat: float = 0.5
    fence: float = 1.5
    lease_ttl: float = 2.5
    node_timeout: float = 2.0
    linger: float = 5.0
    reclaim_interval: float = 1.0
    haproxy_check_ms: int = 500

    def cluster(self) -> dict[str, object]:
        return {
            "enabled": True,
            "cluster_name": CLUSTER_NAME,
            "heartbeat_seconds": self.heartbeat,
            "leader_fence_timeout_seconds": self.fence,
            "leader_lease_ttl_seconds": self.lease_ttl,
            "node_timeout_seconds": self.node_timeout,
            "reclaim_interval_seconds": self.reclaim_interval,
        }


SCHEDULER_HEARTBEAT_SECONDS = 5
"""Airflow's `[scheduler] scheduler_heartbeat_sec` (its default): how often a scheduler marks itself alive."""


def airflow_liveness(store_outage: float) -> dict[str, str]:
    """Airflow's settings for telling a dead scheduler or task from a live one, for a metadata DB
    that can be gone for `store_outage` seconds (a replicated store's failover; 0: a single server).

    A scheduler that dies with its node: the others adopt or reset its running tasks within seconds,
    not Airflow's default five minutes (docs/deployment.md). But no heartbeat reaches a metadata DB
    that is failing over, so both thresholds must outlast that: a scheduler whose own heartbeat
    was held longer than its threshold marks itself failed when the store is back and resets every
    task it runs — the stage tasks that would have followed the new leader are killed and start
    over (a new try, a new Spark session: seconds of stalled delivery; issue 28)."""
    threshold = round(store_outage) + 3 * SCHEDULER_HEARTBEAT_SECONDS if store_outage > 0 else 10
    return {
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": str(SCHEDULER_HEARTBEAT_SECONDS),
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": str(threshold),
        "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(threshold + 10),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
    }


@dataclass
class Node:
    """One listenerd node: its daemon (re-created on restart), its DB proxy and its MLLP port."""

    name: str
    mllp_port: int
    proxy: TcpProxy
    daemon: Daemon
    incarnation: int = 1

    @property
    def pid(self) -> int | None:
        return self.daemon.proc.pid if self.daemon.proc and self.daemon.proc.poll() is None else None

    def alive(self) -> bool:
        return self.pid is not None

    def is_leader(self) -> bool:
        """Serving leader: `GET /leader` answers 200 (lease held, not fenced, every inbound bound).
        A frozen node does not answer within the second: not the leader."""
        if not self.alive():
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.daemon.api_port}/leader", timeout=1.0) as resp:
                return resp.status == 200
        except (OSError, ValueError):  # 503 (HTTPError), refused, timed out
            return False


@dataclass
class Lab:
    """Start with `start()` (or `with Lab() as lab:`); see the module docstring."""

    workdir: Path | None = None
    timings: Timings = field(default_factory=Timings)
    airflow: bool = True
    haproxy: bool = True
    echo: Callable[[str], None] = print
    keep_workdir: bool = False
    schedulers: int = 1
    """Airflow schedulers on the shared metadata DB: 2 = one per node (Airflow's HA schedulers)."""
    spark_workers: int = 0
    """0: Spark Connect on local[*]; n: on a Spark standalone master with n workers (separate processes)."""
    second_spark: bool | None = None
    """A second Spark Connect server (the connection's `servers`): the stages are spread over both
    and move to the other when one stops answering. Default: on with local[*], off on a standalone
    master (two applications would split its cores)."""
    shared_mllp_port: bool = False
    """Both nodes on one MLLP address (one host, one port: only the leader can hold it), as two
    nodes sharing a VIP address; default: each node its own port."""
    replicated_store: bool = False
    """The store on two PostgreSQL under Patroni (synchronous replication, three etcd members, HAProxy
    on `GET /primary`: `replicated_store.py`) instead of one throwaway server."""
    restart_policy: bool = True
    """Restart an exited Airflow component, the recorder or HAProxy, as compose's
    `restart: unless-stopped` does (Airflow's scheduler, dag-processor and triggerer exit when
    their metadata DB restarts). Nodes and Spark are restarted by whoever injected the fault."""

    def __post_init__(self) -> None:
        self._own_workdir = self.workdir is None
        self.dir: Path = Path(self.workdir or tempfile.mkdtemp(prefix="stageline-lab-")).resolve()
        self.workdir = self.dir
        self.pg: PostgresServer | ReplicatedStore | None = None
        self.nodes: dict[str, Node] = {}
        self.stack = Stack(self.dir / "log", cwd=ROOT, echo=self.echo)
        self.spark: ConnectServer | None = None
        self.spark_cluster: SparkCluster | None = None  # with spark_workers
        self.vip_port = free_port()
        self.haproxy_stats_port = free_port()
        self.receiver_port = free_port()
        self.spark_port = free_port()
        if self.second_spark is None:
            self.second_spark = not self.spark_workers
        self.spark_b: ConnectServer | None = None  # with second_spark
        self.spark_b_port = free_port() if self.second_spark else None
        self.airflow_port = free_port()
        self.pipeline_dir = self.dir / "pipeline"
        self.deliveries_path = self.dir / "deliveries.jsonl"
        self.service_config = self.dir / "stageline.toml"
        self.restarts: list[tuple[float, str, int | None]] = []
        """(wall clock, process name, its exit code) for every restart the restart policy made."""
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._migrate_proc: subprocess.Popen[bytes] | None = None

    # --- addresses and state -------------------------------------------------------------------

    @property
    def store_config(self) -> StoreConfig:
        """The store, reached directly (not through a node's proxy)."""
        assert self.pg is not None
        return StoreConfig(
            backend="postgres",
            server=self.pg.host,
            port=self.pg.port,
            database="stageline",
            username=self.pg.user,
            pool_size=4,
        )

    @property
    def mllp_address(self) -> tuple[str, int]:
        """Where senders connect: the VIP, or the leader's own port when the lab runs without HAProxy."""
        if self.haproxy:
            return "127.0.0.1", self.vip_port
        leader = self.leader()
        if leader is None:
            raise RuntimeError("no leader")
        return "127.0.0.1", leader.mllp_port

    def leader(self) -> Node | None:
        leaders = [n for n in self.nodes.values() if n.is_leader()]
        return leaders[0] if len(leaders) == 1 else None

    def vip_servers(self) -> dict[str, str]:
        """HAProxy's view of the MLLP backend: node name → status (UP, DOWN, "UP 1/2", ...)."""
        return {name.removeprefix("node-"): status for name, status in vip_servers(self.haproxy_stats_port).items()}

    def wait_leader(self, timeout: float = 30.0) -> Node:
        return wait_for(self.leader, timeout=timeout, interval=0.05, what="a leader bound to its MLLP port")

    def deliveries(self) -> list[dict]:
        return recorder.read(self.deliveries_path)

    def query(self, sql: str) -> list[dict]:
        import psycopg
        from psycopg.rows import dict_row

        assert self.pg is not None
        with psycopg.connect(
            self.pg.conninfo("stageline"), autocommit=True, row_factory=dict_row, connect_timeout=5
        ) as conn:
            return list(conn.execute(sql).fetchall())

    def backlog(self) -> dict[str, int]:
        """Staged rows not finished, per `table:status` (empty when everything is delivered)."""
        rows = self.query(
            "SELECT 'inbound:' || status AS k, count(*) AS n FROM stage_inbound"
            " WHERE status NOT IN ('done', 'unrouted') GROUP BY status"
            " UNION ALL SELECT 'routed:' || status, count(*) FROM stage_routed"
            " WHERE status <> 'done' GROUP BY status"
            " UNION ALL SELECT 'outbound:' || status, count(*) FROM stage_outbound"
            " WHERE status <> 'done' GROUP BY status"
        )
        return {r["k"]: int(r["n"]) for r in rows}

    def processes(self) -> dict[str, int | None]:
        """PID of every process the lab runs (None: not running)."""
        out: dict[str, int | None] = {f"listenerd-{n.name}": n.pid for n in self.nodes.values()}
        for p in self.stack.procs:
            out[p.name] = p.popen.pid if p.popen and p.popen.poll() is None else None
        if self.spark is not None:
            out["spark-connect"] = self.spark.pid if self.spark.process.poll() is None else None
        if self.spark_b is not None:
            out["spark-connect-b"] = self.spark_b.pid if self.spark_b.process.poll() is None else None
        if isinstance(self.pg, ReplicatedStore):
            out |= {f"store-{name}": pid for name, pid in self.pg.processes().items()}
        elif self.pg is not None:
            try:
                out["postgresql"] = int((self.pg.data / "postmaster.pid").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                out["postgresql"] = None
        return out

    def summary(self) -> str:
        """Where everything is, for a person (what `stageline lab up` would print)."""
        lines = [
            f"MLLP VIP            127.0.0.1:{self.vip_port}" if self.haproxy else "MLLP VIP            (no HAProxy)"
        ]
        for n in self.nodes.values():
            lines.append(
                f"listenerd {n.name}         MLLP 127.0.0.1:{n.mllp_port}, API http://127.0.0.1:{n.daemon.api_port}"
                f", DB via proxy :{n.proxy.port} (pid {n.pid})"
            )
        if self.pg is not None:
            lines.append(f"PostgreSQL          {self.pg.conninfo('stageline')} (and dbname=airflow)")
        if isinstance(self.pg, ReplicatedStore):
            nodes = self.pg.nodes
            roles = ", ".join(f"{name} {role} (:{nodes[name].pg_port})" for name, role in self.pg.roles().items())
            lines.append(f"  under Patroni     {roles}; HAProxy on GET /primary")
            lines.append(f"  etcd              {', '.join(m.client_url for m in self.pg.etcd)}")
        if self.airflow:
            lines.append(f"Airflow UI          http://127.0.0.1:{self.airflow_port}  (admin / admin)")
        if self.schedulers > 1:
            lines.append(f"Airflow schedulers  {self.schedulers} on the shared PostgreSQL metadata DB (HA)")
        if self.spark_cluster is not None:
            lines.append(f"Spark master        {self.spark_cluster.master_url} with {self.spark_workers} worker(s)")
        lines += [
            f"Spark Connect       sc://127.0.0.1:{self.spark_port}"
            + (f" and sc://127.0.0.1:{self.spark_b_port}" if self.spark_b_port else ""),
            f"recorder            127.0.0.1:{self.receiver_port} → {self.deliveries_path}",
            f"logs                {self.dir / 'log'}",
        ]
        return "\n".join(lines)

    def ports(self) -> dict[str, int]:
        """Every TCP port the lab listens on (for a caller that checks they are all released)."""
        out = {
            "vip": self.vip_port,
            "recorder": self.receiver_port,
            "spark-connect": self.spark_port,
            "airflow-api": self.airflow_port,
        }
        if self.haproxy:
            out["haproxy-stats"] = self.haproxy_stats_port
        if self.pg is not None:
            out["postgresql"] = self.pg.port
        if isinstance(self.pg, ReplicatedStore):
            for node in self.pg.nodes.values():
                out |= {f"{node.name}-pg": node.pg_port, f"{node.name}-rest": node.rest_port}
            out |= {f"{m.name}-client": m.client_port for m in self.pg.etcd}
            out["store-haproxy-stats"] = self.pg.stats_port
        for n in self.nodes.values():
            out |= {
                f"{n.name}-mllp": n.mllp_port,
                f"{n.name}-api": n.daemon.api_port,
                f"{n.name}-dbproxy": n.proxy.port,
            }
        return out

    # --- start / stop --------------------------------------------------------------------------

    def start(self) -> Lab:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        started = time.monotonic()
        self.echo(f"lab in {self.dir}")
        if self.replicated_store:
            self.dir.chmod(0o711)  # PostgreSQL and Patroni run as `postgres` under it: traverse, not list
            self.pg = ReplicatedStore(
                etcd_members=3,
                databases=("stageline", "airflow"),
                max_connections=300,
                workdir=self.dir / "store",
            )
            self.pg.start()
            self.echo(f"  postgresql under Patroni  ready on {self.pg.port} (HAProxy), {self.pg.roles()}")
        else:
            self.pg = PostgresServer(settings={"max_connections": "300"}).start()
            for db in ("stageline", "airflow"):
                self.pg.execute(f"CREATE DATABASE {db}")
            self.echo(f"  postgresql                ready on {self.pg.port}")
        self._migrate_store()
        self._write_pipeline_config()
        self._write_service_config()
        spark_error: list[BaseException] = []
        spark_thread = threading.Thread(target=self._start_spark_into, args=(spark_error,), daemon=True)
        spark_thread.start()
        airflow_migrate = self._migrate_proc = self._airflow_migrate() if self.airflow else None
        self.stack.start(
            Proc(
                "recorder",
                python_module(
                    "include.app.lab.recorder", "--port", str(self.receiver_port), "--out", str(self.deliveries_path)
                ),
                ready=lambda: port_open(self.receiver_port),
            )
        )
        for name in ("a", "b"):
            self.nodes[name] = self._node(name)
            self.nodes[name].daemon.start()
            if name == "a":
                wait_for(lambda: self.nodes["a"].is_leader(), timeout=30, what="node a to lead")
        self.echo("  listenerd a (leader), b   ready")
        if self.haproxy:
            self.stack.start(
                Proc(
                    "haproxy",
                    [HAPROXY, "-db", "-f", str(self._write_haproxy_config())],
                    ready=lambda: port_open(self.vip_port),
                )
            )
        spark_thread.join()
        if spark_error:
            raise spark_error[0]
        self.echo(f"  spark-connect             ready on {self.spark_port}")
        if airflow_migrate is not None:
            if airflow_migrate.wait() != 0:
                raise RuntimeError(f"airflow db migrate failed; see {self.dir / 'log' / 'airflow-migrate.log'}")
            self._start_airflow()
        if self.restart_policy:
            self._watchdog = threading.Thread(target=self._watch, name="lab-watchdog", daemon=True)
            self._watchdog.start()
        self.echo(f"lab up in {time.monotonic() - started:.0f} s")

    def _watch(self) -> None:
        while not self._stopping.wait(1.0):
            for i, proc in enumerate(list(self.stack.procs)):
                if self._stopping.is_set() or proc.popen is None or proc.popen.poll() is None:
                    continue
                code = proc.popen.returncode
                self.echo(f"  {proc.name} exited with {code}; restarting it")
                self.restarts.append((time.time(), proc.name, code))
                again = Proc(proc.name, proc.argv, ready=proc.ready, env=proc.env, ready_timeout=proc.ready_timeout)
                try:
                    self._start_proc(again, replace_index=i)
                except (RuntimeError, OSError) as exc:  # the dead entry stays: tried again next tick
                    if again in self.stack.procs:
                        self.stack.procs.remove(again)
                    self.echo(f"  {proc.name} did not come back: {exc}")

    def _start_proc(self, proc: Proc, *, replace_index: int | None = None) -> None:
        """Start through the Stack; a restarted process takes its predecessor's place in the list."""
        self.stack.start(proc)
        if replace_index is not None:
            self.stack.procs.remove(proc)
            self.stack.procs[replace_index] = proc

    def stop(self) -> None:
        """Stop everything this lab started, by PID, and remove its files (unless `keep_workdir`)."""
        self._stopping.set()
        if self._watchdog is not None:
            self._watchdog.join(200)
        if self._migrate_proc is not None and self._migrate_proc.poll() is None:
            self._migrate_proc.kill()  # start() failed while `airflow db migrate` ran
            self._migrate_proc.wait(10)
        self.stack.stop(timeout=15)
        for node in self.nodes.values():
            try:
                node.daemon.signal(signal.SIGCONT)  # a paused node cannot act on SIGTERM
                node.daemon.stop(timeout=10)
            except Exception as exc:  # keep stopping the rest
                self.echo(f"  stopping listenerd {node.name}: {exc}")
            node.proxy.stop()
        from include.spark import stop_connect_server

        for server in (self.spark, self.spark_b):
            if server is not None:
                stop_connect_server(server, timeout=10)
        if self.spark_cluster is not None:
            self.spark_cluster.stop()
        if self.pg is not None:
            self.pg.stop()
            self.pg = None
        if self._own_workdir and not self.keep_workdir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tails(self, lines: int = 40) -> str:
        """The last lines of each node's listenerd log: what a failed lab test prints before `stop()`
        removes the files (CI keeps only the test's output)."""
        out = []
        for node in self.nodes.values():
            path = node.daemon.workdir / "listenerd.log"
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]
            out.append(f"--- listenerd {node.name}: last {len(text)} lines of {path}\n" + "\n".join(text))
        return "\n".join(out)

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- faults ----------------------------------------------------------------------------------

    def signal_node(self, node: Node, sig: int) -> None:
        """Send `sig` to a node's listenerd and wait for it to exit (SIGKILL after 20 s)."""
        node.daemon.signal(sig)
        assert node.daemon.proc is not None  # a node that runs
        try:
            node.daemon.proc.wait(20)
        except subprocess.TimeoutExpired:
            node.daemon.kill()
        node.daemon.log.close()

    def pause_node(self, node: Node) -> None:
        """SIGSTOP: what a stalled VM or a swap storm looks like (its sockets stay open)."""
        node.daemon.signal(signal.SIGSTOP)

    def resume_node(self, node: Node) -> None:
        node.daemon.signal(signal.SIGCONT)

    def restart_node(self, node: Node) -> None:
        """Start a stopped node again (a new incarnation: a new node id, same config and ports)."""
        if node.alive():
            return
        node.incarnation += 1
        node.daemon = self._daemon(
            node.name, node.mllp_port, node.proxy, node.incarnation, api_port=node.daemon.api_port
        )
        node.daemon.start()

    def cut_db(self, node: Node) -> None:
        """Partition one node from PostgreSQL (its proxy swallows traffic; see TcpProxy)."""
        node.proxy.cut()

    def restore_db(self, node: Node) -> None:
        node.proxy.restore()

    def running_task(self, dag_id: str = "stage_deliver", task_id: str | None = None) -> tuple[str, int] | None:
        """(task instance id, PID) of a running task of `dag_id` (its job task by default).

        Airflow 3's LocalExecutor titles the process that runs a task `airflow worker -- <ti id>`
        (a child of the executor's worker, which supervises it); `task_instance.pid` names it.
        """
        import psutil
        import psycopg

        task_id = task_id or next((stage.name for stage in STAGES if stage.dag_id == dag_id), dag_id)
        assert self.pg is not None
        with psycopg.connect(self.pg.conninfo("airflow"), autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT id::text, pid FROM task_instance WHERE dag_id = %s AND task_id = %s"
                " AND state = 'running' AND pid IS NOT NULL",
                (dag_id, task_id),
            ).fetchall()
        for ti_id, pid in rows:
            try:
                if ti_id in " ".join(psutil.Process(pid).cmdline()):
                    return ti_id, pid
            except psutil.Error:
                continue
        return None

    def kill_stage_task(self, dag_id: str = "stage_deliver", *, timeout: float = 90.0) -> tuple[str, int]:
        """SIGKILL the process running `dag_id`'s job task once one runs; returns (ti id, PID)."""
        ti_id, pid = wait_for(
            lambda: self.running_task(dag_id), timeout=timeout, interval=0.1, what=f"a running {dag_id} job task"
        )
        os.kill(pid, signal.SIGKILL)
        return ti_id, pid

    def kill_spark(self) -> None:
        """SIGKILL the Spark Connect server (its whole process group)."""
        assert self.spark is not None
        try:
            os.killpg(self.spark.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.spark.process.wait(10)
        from include.spark import stop_connect_server

        stop_connect_server(self.spark)

    def start_spark(self) -> None:
        from include.spark import start_connect_server

        wait_for(lambda: not port_open(self.spark_port), timeout=30, what="the old Spark Connect port to close")
        master = "local[*]"
        if self.spark_workers:
            if self.spark_cluster is None:
                from include.app.lab.spark_cluster import SparkCluster

                self.spark_cluster = SparkCluster(
                    self.dir / "log" / "spark-cluster", workers=self.spark_workers, cores=1, memory="1g"
                ).start()
            master = self.spark_cluster.master_url
        self.spark = start_connect_server(self.spark_port, log_dir=self.dir / "log" / "spark-connect", master=master)

    def start_spark_b(self) -> None:
        """The second Spark Connect server (local[*]): the stage tasks warm their sessions on it."""
        from include.spark import start_connect_server

        assert self.spark_b_port is not None
        self.spark_b = start_connect_server(
            self.spark_b_port, log_dir=self.dir / "log" / "spark-connect-b", master="local[*]"
        )

    def restart_postgres(self) -> None:
        """`pg_ctl restart -m fast`: every connection is dropped; the server is back in about a second."""
        if not isinstance(self.pg, PostgresServer):
            raise RuntimeError("restart_postgres: the single server only (a replicated store has node faults)")
        self.pg._run(
            "pg_ctl",
            "-D",
            str(self.pg.data),
            "-l",
            str(self.pg.root / "server.log"),
            "-w",
            "-t",
            "60",
            "-m",
            "fast",
            "restart",
        )

    # --- pieces ----------------------------------------------------------------------------------

    def _migrate_store(self) -> None:
        from include.store import Store
        from include.store.migrate import migrate

        store = Store(self.store_config)
        try:
            migrate(store, cluster_name=CLUSTER_NAME)
        finally:
            store.close()

    def _write_pipeline_config(self) -> None:
        """One MLLP destination (the recorder), one FIFO lane per patient; every message routed to it."""
        d = self.pipeline_dir
        d.mkdir(parents=True, exist_ok=True)
        (d / "destinations.toml").write_text(
            '[[destination]]\nname = "ehr"\nkind = "mllp"\nhost = "127.0.0.1"\n'
            f'port = {self.receiver_port}\nlane = "PID-3.1"\nmax_attempts = 10\nbackoff_seconds = 1\n'
            "max_backoff_seconds = 5\n"
        )
        (d / "routes.toml").write_text(
            '[[route]]\nname = "all-to-ehr"\ndestinations = ["ehr"]\n'
            'when = { field = "MSH-9.1", op = "eq", value = "ADT" }\n'
        )
        (d / "transforms.toml").write_text(
            '[[transform]]\ndestination = "ehr"\noutput = "hl7"\nrules = [{ set = "MSH-5", value = "EHR" }]\n'
        )

    def _write_service_config(self) -> None:
        """The stage tasks' service config: the store directly, the cluster's timings."""
        s = self.store_config
        lines = [
            "[store]",
            'backend = "postgres"',
            f'server = "{s.server}"',
            f"port = {s.port}",
            f'database = "{s.database}"',
            f'username = "{s.username}"',
            "pool_size = 4",
            "",
            "[cluster]",
        ]
        lines += [f"{k} = {toml_value(v)}" for k, v in self.timings.cluster().items()]
        self.service_config.write_text("\n".join(lines) + "\n")

    def _daemon(
        self, name: str, mllp_port: int, proxy: TcpProxy, incarnation: int, *, api_port: int | None = None
    ) -> Daemon:
        """A node's daemon; a restart keeps its API port, where HAProxy asks `GET /leader`."""
        store = StoreConfig(
            backend="postgres",
            server="127.0.0.1",
            port=proxy.port,
            database="stageline",
            username=self.store_config.username,
            pool_size=5,
            sync_standbys_expected=1 if self.replicated_store else 0,  # the alert's and status's baseline
        )
        return Daemon(
            self.dir / f"node-{name}",
            store,
            node_id=f"node-{name}:{incarnation}",
            cluster=self.timings.cluster(),
            api_port=api_port or free_port(),
            inbound=[{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": mllp_port, "lane_key": "PID-3.1"}],
        )

    def _node(self, name: str) -> Node:
        assert self.pg is not None
        proxy = TcpProxy(self.pg.host, self.pg.port).start()
        port = self.nodes["a"].mllp_port if self.shared_mllp_port and "a" in self.nodes else free_port()
        return Node(name, port, proxy, self._daemon(name, port, proxy, 1))

    def _write_haproxy_config(self) -> Path:
        """deploy/haproxy.cfg's VIP, on loopback (see `haproxy_config`)."""
        path = self.dir / "haproxy.cfg"
        path.write_text(
            haproxy_config(
                self.vip_port,
                self.haproxy_stats_port,
                [(f"node-{n.name}", n.mllp_port, n.daemon.api_port) for n in self.nodes.values()],
                inter_ms=self.timings.haproxy_check_ms,
            )
        )
        return path

    def _start_spark_into(self, errors: list[BaseException]) -> None:
        try:
            self.start_spark()
            if self.second_spark:
                self.start_spark_b()
        except BaseException as exc:  # re-raised by the starting thread
            errors.append(exc)

    def airflow_env(self) -> dict[str, str]:
        from include.app import embedded
        from include.spark import spark_connect_connection

        var = self.dir / "var"
        assert self.pg is not None
        db = f"postgresql+psycopg2://{self.pg.user}@{self.pg.host}:{self.pg.port}/airflow"
        env = embedded.airflow_env(var, self.service_config)
        env.update(
            {
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db,
                "STAGELINE_AIRFLOW_DB_CONN": db,
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.airflow_port}/execution/",
                "AIRFLOW__API__PORT": str(self.airflow_port),
                "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
                **airflow_liveness(self.pg.timings.outage_seconds if isinstance(self.pg, ReplicatedStore) else 0.0),
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                "STAGELINE_PIPELINE_DIR": str(self.pipeline_dir),
                "STAGELINE_STAGE_LINGER_SECONDS": str(self.timings.linger),
                "AIRFLOW_CONN_STAGELINE_SPARK": spark_connect_connection(
                    "127.0.0.1",
                    self.spark_port,
                    servers=[f"sc://127.0.0.1:{self.spark_b_port}"] if self.spark_b_port else (),
                ),
            }
        )
        return env

    def _airflow(self, *args: str) -> list[str]:
        return [str(Path(sys.executable).parent / "airflow"), *args]

    def _airflow_migrate(self) -> subprocess.Popen:
        (self.dir / "log").mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "log" / "airflow-migrate.log", "ab")
        return subprocess.Popen(
            self._airflow("db", "migrate"),
            cwd=ROOT,
            env={**os.environ, **self.airflow_env()},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _start_airflow(self) -> None:
        import json
        import urllib.request

        env = self.airflow_env()
        home = Path(env["AIRFLOW_HOME"])
        (home / "simple_auth_manager_passwords.json.generated").write_text(json.dumps({"admin": "admin"}))

        def api_ok() -> bool:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.airflow_port}/api/v2/monitor/health", timeout=2
                ) as resp:
                    return resp.status == 200
            except OSError:
                return False

        for name in ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"):
            self.stack.start(
                Proc(
                    name,
                    self._airflow(name.removeprefix("airflow-")),
                    env=env,
                    ready_timeout=180,
                    ready=api_ok if name == "airflow-api-server" else (lambda: True),
                )
            )
        for n in range(2, self.schedulers + 1):  # HA schedulers: each its own task log server port
            self.stack.start(
                Proc(
                    f"airflow-scheduler-{n}",
                    self._airflow("scheduler"),
                    env={**env, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port())},
                )
            )
