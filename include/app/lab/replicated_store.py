"""A replicated store on one host, from Debian's packages: etcd, two PostgreSQL 15 under Patroni, HAProxy.

    etcd (1 member, or 3 on loopback ports)  ── Patroni's DCS: who is primary, who is the sync standby
    Patroni pg-a ── PostgreSQL ──┐  streaming replication, `synchronous_mode: true`: a commit returns
    Patroni pg-b ── PostgreSQL ──┘  once it is flushed on the synchronous standby too
    HAProxy `port` ── the node whose Patroni answers `GET /primary` 200 (every client connects here)

Why it exists: a store that survives losing its database host (issue 28, docs/deployment.md). Clients
reach the primary through HAProxy rather than libpq multi-host strings because every client then
keeps one plain host:port — listenerd, the CLI, Spark's JDBC URL and Airflow's SQLAlchemy URL alike —
and because `/primary` answers from Patroni's leader key, not from `pg_is_in_recovery()`: a primary
cut off from etcd is demoted by its Patroni and leaves the backend even while PostgreSQL itself
would still accept writes. `on-marked-down shutdown-sessions` closes the sessions a demoted node
still holds, so pools reconnect to the new primary instead of waiting on a frozen host.

Each node's peers reach its PostgreSQL through a `TcpProxy` (its `connect_address`), so a fault can
cut the replication link alone. The object has the throwaway server's surface (`host`, `port`,
`user`, `conninfo`, `execute`, `stop`) so the lab takes either; processes are started and stopped
by PID, PostgreSQL and Patroni as the `postgres` OS user when we are root.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from include.app.lab.haproxy import HAPROXY, vip_servers
from include.app.lab.postgres_server import PG_BIN, free_port, wait_for
from include.app.lab.tcpproxy import TcpProxy
from include.app.supervisor import Proc, Stack, port_open

ETCD = os.environ.get("STAGELINE_ETCD", "/usr/bin/etcd")
PATRONI = os.environ.get("STAGELINE_PATRONI", "/usr/bin/patroni")
SCOPE = "stageline-lab"


def http_status(url: str) -> int:
    """The status `url` answers with within a second (0: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


MAXIMUM_LAG_ON_FAILOVER = 1 << 40
"""Patroni's `maximum_lag_on_failover` in bytes (1 TiB): larger than any WAL a cut replication link
can leave unsent (pg_wal's disk fills first), so it never keeps the synchronous standby from promotion."""


@dataclass(frozen=True)
class PatroniTimings:
    """Patroni's DCS timings (`loop_wait + 2 * retry_timeout <= ttl`, Patroni's rule): a dead
    primary's leader key expires after `ttl`, and the standby takes it at its next loop."""

    ttl: int = 10
    loop_wait: int = 1
    retry_timeout: int = 3
    check_ms: int = 500  # HAProxy's `GET /primary` interval (out after 2 failed checks)
    wal_sender_timeout: int = 10
    """Seconds a primary waits on a silent (frozen) standby before it drops the link; only then
    does Patroni see the standby gone and stop waiting for it (PostgreSQL's default is 60)."""

    @property
    def outage_seconds(self) -> float:
        """The longest a dead primary leaves its clients without one: its leader key expires after
        `ttl`, the standby takes it at its next loop (`loop_wait`, plus `retry_timeout` for a DCS
        call in flight), and HAProxy sends to it after two passed checks at most. Whatever must
        outlive a failover of the store (Airflow's liveness timeouts) is sized from this."""
        return self.ttl + self.loop_wait + self.retry_timeout + 2 * self.check_ms / 1000


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    proc: Proc | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def healthy(self) -> bool:
        return http_status(f"{self.client_url}/health") == 200  # 503 without a quorum


@dataclass
class PgNode:
    """One PostgreSQL under its Patroni; `link` is how its peers reach it (the replication link)."""

    name: str
    pg_port: int
    rest_port: int
    dir: Path
    link: TcpProxy
    proc: Proc | None = None

    @property
    def data(self) -> Path:
        return self.dir / "data"

    def patroni_pid(self) -> int | None:
        p = self.proc.popen if self.proc else None
        return p.pid if p is not None and p.poll() is None else None

    def postmaster_pid(self) -> int | None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError, IndexError):
            return None

    def rest(self, path: str) -> int:
        """The HTTP status Patroni's REST API answers for `path` (0: no answer)."""
        return http_status(f"http://127.0.0.1:{self.rest_port}{path}")

    def role(self) -> str:
        """`primary`, `sync` (the synchronous standby), `replica`, or `down` — as Patroni says."""
        if self.rest("/primary") == 200:
            return "primary"
        if self.rest("/sync") == 200:
            return "sync"
        return "replica" if self.rest("/replica") == 200 else "down"


class ReplicatedStore:
    """Start with `start()` (or `with ReplicatedStore() as store:`); see the module docstring."""

    def __init__(
        self,
        *,
        etcd_members: int = 1,
        timings: PatroniTimings | None = None,
        strict: bool = False,
        databases: tuple[str, ...] = ("stageline",),
        max_connections: int = 200,
        workdir: Path | None = None,
    ) -> None:
        if etcd_members not in (1, 3):
            raise ValueError("etcd_members: 1 (tests) or 3 (the lab's quorum)")
        self.timings = timings or PatroniTimings()
        self.strict = strict
        self.databases = databases
        self.max_connections = max_connections
        self.root = Path(workdir or tempfile.mkdtemp(prefix="stageline-patroni-")).resolve()
        self._own_root = workdir is None
        self.host = "127.0.0.1"
        self.user = "postgres"
        self.port = free_port()  # HAProxy: the primary, whichever node it is
        self.stats_port = free_port()
        self.etcd = [EtcdMember(f"etcd{i}", free_port(), free_port()) for i in range(etcd_members)]
        self.nodes: dict[str, PgNode] = {}
        self.stack = Stack(self.root / "log", cwd=self.root, echo=lambda _line: None)
        self._as_postgres = os.geteuid() == 0
        self._haproxy: Proc | None = None

    # --- the surface the lab and tests use -----------------------------------------------------

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host={self.host} port={self.port} user={self.user} dbname={dbname}"

    def execute(self, sql: str, *, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.conninfo(dbname), autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql)

    def node_conninfo(self, node: PgNode, dbname: str = "postgres") -> str:
        """One node directly (not through HAProxy): to read a standby, or a demoted primary."""
        return f"host={self.host} port={node.pg_port} user={self.user} dbname={dbname}"

    def roles(self) -> dict[str, str]:
        return {name: node.role() for name, node in self.nodes.items()}

    def primary(self) -> PgNode | None:
        found = [n for n in self.nodes.values() if n.rest("/primary") == 200]
        return found[0] if len(found) == 1 else None

    def standby(self) -> PgNode | None:
        primary = self.primary()
        others = [n for n in self.nodes.values() if n is not primary]
        return others[0] if primary is not None and others else None

    def wait_primary(self, *, timeout: float = 60.0, other_than: PgNode | None = None) -> PgNode:
        def found() -> PgNode | None:
            p = self.primary()
            return p if p is not None and p is not other_than else None

        return wait_for(found, timeout=timeout, interval=0.1, what="a Patroni primary")

    def wait_synchronous(self, *, timeout: float = 120.0) -> tuple[PgNode, PgNode]:
        """Until one node is primary and the other its synchronous standby, as Patroni says and as
        the primary's PostgreSQL says (it streams to a standby in sync); (primary, standby)."""

        def pair() -> tuple[PgNode, PgNode] | None:
            roles = self.roles()
            primary = [self.nodes[n] for n, r in roles.items() if r == "primary"]
            sync = [self.nodes[n] for n, r in roles.items() if r == "sync"]
            if len(primary) != 1 or len(sync) != 1:
                return None
            return (primary[0], sync[0]) if self._streams_in_sync(primary[0]) else None

        return wait_for(pair, timeout=timeout, interval=0.2, what="a primary with a synchronous standby")

    def processes(self) -> dict[str, int | None]:
        """PID of every process this runs (None: not running): etcd, Patroni, PostgreSQL, HAProxy."""
        out = {p.name: p.popen.pid if p.popen and p.popen.poll() is None else None for p in self.stack.procs}
        return out | {f"postgresql-{n.name}": n.postmaster_pid() for n in self.nodes.values()}

    def haproxy_up(self) -> dict[str, str]:
        """HAProxy's view of the store backend: node name → UP / DOWN."""
        return vip_servers(self.stats_port, backend="pg_primary")

    # --- start / stop --------------------------------------------------------------------------

    def start(self) -> ReplicatedStore:
        """Start everything and wait until a commit is on two servers; on any failure stop what started."""
        try:
            self._start()
            return self
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        missing = [p for p in (ETCD, PATRONI, HAPROXY, str(PG_BIN / "initdb")) if not Path(p).exists()]
        if missing:
            raise RuntimeError(f"not installed: {', '.join(missing)}; run scripts/setup.sh as root")
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.etcd)
        for m in self.etcd:
            m.proc = Proc(f"etcd-{m.name}", self._etcd_argv(m, cluster), ready=partial(port_open, m.client_port))
            self.stack.start(m.proc)
        for m in self.etcd:  # a member is healthy once there is a quorum: all are started first
            wait_for(m.healthy, timeout=30, interval=0.1, what=f"etcd member {m.name}")
        for name in ("pg-a", "pg-b"):
            pg_port = free_port()
            node = PgNode(name, pg_port, free_port(), self.root / name, TcpProxy(self.host, pg_port).start())
            self.nodes[name] = node
            self._start_patroni(node)
            if name == "pg-a":  # the first bootstraps the cluster; the second clones it
                wait_for(lambda: node.rest("/primary") == 200, timeout=120, interval=0.2, what="pg-a to bootstrap")
        self._haproxy = Proc(
            "haproxy", [HAPROXY, "-db", "-f", str(self._write_haproxy_config())], ready=lambda: port_open(self.port)
        )
        self.stack.start(self._haproxy)
        self.wait_synchronous()
        wait_for(lambda: "UP" in self.haproxy_up().values(), timeout=30, what="HAProxy to see the primary")
        for db in self.databases:
            self.execute(f'CREATE DATABASE "{db}"')
        _, standby = self.wait_synchronous()
        for db in self.databases:  # replayed there too (a commit waits for the flush, not the replay)
            wait_for(partial(self._reachable, standby, db), timeout=60, interval=0.2, what=f"{db} on the standby")

    def _streams_in_sync(self, node: PgNode) -> bool:
        import psycopg

        sql = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'"
        try:
            with psycopg.connect(self.node_conninfo(node), autocommit=True, connect_timeout=2) as conn:
                row = conn.execute(sql).fetchone()
                return bool(row and row[0])
        except psycopg.OperationalError:
            return False

    def _reachable(self, node: PgNode, dbname: str) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.node_conninfo(node, dbname), connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        """Stop everything this started, by PID (HAProxy, Patroni with its PostgreSQL, etcd), and
        remove its files unless the caller gave the directory."""
        for node in self.nodes.values():
            self._send(node.patroni_pid(), signal.SIGCONT)
            self._send(node.postmaster_pid(), signal.SIGCONT)
        self.stack.stop(timeout=20)
        for node in self.nodes.values():  # a PostgreSQL whose Patroni was killed outlives it
            self._send(node.postmaster_pid(), signal.SIGKILL)
            node.link.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ReplicatedStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- faults --------------------------------------------------------------------------------

    def kill_node(self, node: PgNode) -> None:
        """SIGKILL the node's Patroni and its postmaster: the host is gone as far as anyone can tell."""
        self._send(node.patroni_pid(), signal.SIGKILL)
        self._send(node.postmaster_pid(), signal.SIGKILL)
        if node.proc is not None and node.proc.popen is not None:
            node.proc.popen.wait(10)

    def pause_node(self, node: PgNode) -> None:
        """SIGSTOP Patroni and the whole PostgreSQL (a frozen VM: sockets open, nothing answers)."""
        for pid in self._pg_pids(node):
            self._send(pid, signal.SIGSTOP)

    def resume_node(self, node: PgNode) -> None:
        for pid in self._pg_pids(node):
            self._send(pid, signal.SIGCONT)

    def restart_node(self, node: PgNode) -> None:
        """Start a killed node's Patroni again: it rejoins as a standby (pg_rewind where needed)."""
        if node.patroni_pid() is not None:
            return
        if node.proc in self.stack.procs:
            self.stack.procs.remove(node.proc)
        self._start_patroni(node)

    def kill_etcd_member(self, index: int = 0) -> None:
        member = self.etcd[index]
        popen = member.proc.popen if member.proc else None
        if popen is not None and popen.poll() is None:
            popen.kill()
            popen.wait(10)

    def restart_etcd_member(self, index: int = 0) -> None:
        """Start a killed member again on its data dir: it rejoins the cluster it was in."""
        member = self.etcd[index]
        if member.proc is None or (member.proc.popen is not None and member.proc.popen.poll() is None):
            return
        self.stack.procs.remove(member.proc)
        member.proc = Proc(member.proc.name, member.proc.argv, ready=member.proc.ready)
        self.stack.start(member.proc)
        wait_for(member.healthy, timeout=30, interval=0.1, what=f"etcd member {member.name}")

    # --- pieces --------------------------------------------------------------------------------

    def _pg_pids(self, node: PgNode) -> list[int]:
        import psutil

        pids = [pid for pid in (node.patroni_pid(), node.postmaster_pid()) if pid is not None]
        if (pm := node.postmaster_pid()) is not None:
            try:
                pids += [c.pid for c in psutil.Process(pm).children(recursive=True)]
            except psutil.Error:
                pass
        return pids

    @staticmethod
    def _send(pid: int | None, sig: int) -> None:
        if pid is None:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _etcd_argv(self, m: EtcdMember, cluster: str) -> list[str]:
        return [
            ETCD,
            f"--name={m.name}",
            f"--data-dir={self.root / m.name}",
            f"--listen-client-urls={m.client_url}",
            f"--advertise-client-urls={m.client_url}",
            f"--listen-peer-urls={m.peer_url}",
            f"--initial-advertise-peer-urls={m.peer_url}",
            f"--initial-cluster={cluster}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={SCOPE}-{self.port}",
            "--heartbeat-interval=100",
            "--election-timeout=1000",
            "--log-level=warn",
            "--enable-v2=true",  # Patroni's `etcd` DCS (see _patroni_config)
        ]

    def _start_patroni(self, node: PgNode) -> None:
        node.dir.mkdir(parents=True, exist_ok=True)
        config = node.dir / "patroni.yml"
        config.write_text(json.dumps(self._patroni_config(node), indent=1))  # YAML is a superset of JSON
        argv = [PATRONI, str(config)]
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            for path in (node.dir, config):
                os.chown(path, pw.pw_uid, pw.pw_gid)
            argv = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *argv]
        node.proc = Proc(
            f"patroni-{node.name}",
            argv,
            env={"HOME": str(node.dir), "PYTHONPATH": ""},
            ready=lambda: node.rest("/liveness") == 200,
            ready_timeout=60,
        )
        self.stack.start(node.proc)

    def _patroni_config(self, node: PgNode) -> dict:
        t = self.timings
        return {
            "scope": SCOPE,
            "namespace": "/stageline/",
            "name": node.name,
            "restapi": {"listen": f"127.0.0.1:{node.rest_port}", "connect_address": f"127.0.0.1:{node.rest_port}"},
            # etcd's v2 API, not `etcd3`: Patroni 3.0's etcd3 client re-puts the leader key without a
            # compare when its lease has expired, so a primary woken from a freeze took the key back
            # from the standby promoted meanwhile (which then pg_rewind-ed away its commits); the v2
            # client's leader update is a compare-and-swap on the holder's name.
            "etcd": {"hosts": [f"127.0.0.1:{m.client_port}" for m in self.etcd]},
            "bootstrap": {
                "dcs": {
                    "ttl": t.ttl,
                    "loop_wait": t.loop_wait,
                    "retry_timeout": t.retry_timeout,
                    "synchronous_mode": True,
                    "synchronous_mode_strict": self.strict,
                    # Patroni 3.0 applies this to the synchronous standby too: WAL piled up behind a
                    # cut link (commits waiting, none acknowledged) kept it from promotion, and the
                    # cluster stayed without a primary. In synchronous mode only a standby the sync
                    # key names may be promoted, and it has every acknowledged commit: no lag bound
                    # is needed, so this one is never reached (docs/deployment.md).
                    "maximum_lag_on_failover": MAXIMUM_LAG_ON_FAILOVER,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "max_connections": self.max_connections,
                            "wal_level": "replica",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "hot_standby": "on",
                            "fsync": "on",
                            "shared_buffers": "128MB",
                            "wal_sender_timeout": f"{t.wal_sender_timeout}s",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.link.port}",  # peers replicate through the link
                "data_dir": str(node.data),
                "bin_dir": str(PG_BIN),
                "pgpass": str(node.dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": self.user},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": self.user},
                },
                "parameters": {"unix_socket_directories": str(node.dir)},
                "pg_hba": [
                    "local all all trust",
                    "host replication replicator 127.0.0.1/32 trust",
                    "host all all 127.0.0.1/32 trust",
                ],
            },
            "log": {"level": "INFO"},
        }

    def _write_haproxy_config(self) -> Path:
        servers = "\n".join(
            f"    server {n.name} 127.0.0.1:{n.pg_port} check port {n.rest_port}" for n in self.nodes.values()
        )
        inter = self.timings.check_ms
        path = self.root / "haproxy.cfg"
        path.write_text(
            f"""global
    maxconn 4096

defaults
    mode tcp
    timeout connect 3s
    timeout client 30m
    timeout server 30m
    timeout check {max(100, inter * 4 // 5)}ms
    retries 2

frontend stats
    mode http
    bind 127.0.0.1:{self.stats_port}
    timeout client 30s
    stats enable
    stats uri /

listen pg_primary
    bind 127.0.0.1:{self.port}
    option httpchk GET /primary
    http-check expect status 200
    default-server inter {inter}ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}
"""
        )
        return path
