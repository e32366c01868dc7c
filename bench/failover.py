"""Failover of the whole pipeline: each fault in turn under a steady stream, on a two-node lab.

    lab       include/app/lab/two_nodes.py: PostgreSQL, two listenerd (heartbeat 0.5 s, fence 1.5 s, lease TTL
              2.5 s) behind an HAProxy VIP, Airflow (scheduler, dag-processor, triggerer,
              api-server; LocalExecutor on a PostgreSQL metadata DB), Spark Connect, a recording
              MLLP receiver; one MLLP destination, one FIFO lane per patient
    stream    tests/support/stream.py: `--rate` msg/s over `--lanes` lanes and `--connections`
              connections through the VIP; anything not `AA`'d is resent with the same control id
    faults    leader-sigkill, leader-sigterm (the node is restarted after: always two nodes),
              leader-db-cut (through the node's proxy; restored once the other node leads),
              task-sigkill (the running stage_deliver job task process), spark-restart (SIGKILL +
              start), postgres-restart (`pg_ctl restart -m fast`), pause-leader (SIGSTOP for
              `--pause` s, longer than the lease TTL, then SIGCONT: a stalled VM), bind-conflict
              (another process holds the standby's MLLP port when the leader stops; the leader is
              restarted at once, as systemd would). `--shared-port`: both nodes on one MLLP port
              (one host, one address), as in issue 24's first run.
              `--replicated-store` (issue 28): the store on two PostgreSQL under Patroni, and the
              faults pg-primary-kill (SIGKILL postmaster + Patroni; the node rejoins after the
              promotion), pg-primary-stop (SIGSTOP the primary for 20 s), pg-link-cut (the
              primary–standby link swallows traffic for 20 s), etcd-member-kill (one of three, back
              after 10 s); "Patroni s" is Patroni's own promotion time (fault → GET /primary 200
              on the other node), beside the failover of a serving listenerd leader

Each fault: `--before` s of stream, the fault, `--after` s of stream, then the stream pauses and
the lab drains (≤ `--drain` s) before the next fault. Per fault:

    failover   fault → a leader (another node, for leader faults) answers `GET /leader` 200 (holds
               the lease, not fenced, every inbound bound)
    out of VIP pause-leader: SIGSTOP → HAProxy marks the frozen node DOWN (its kernel still accepts)
    AA again   fault → every connection has an `AA` again after its last failed send (slowest)
    1st deliv  fault → the first message *sent* after the fault reaches the receiver
    every lane fault → every lane has delivered a message sent after the fault (the slowest lane)
    lost       `AA`'d in the fault's window, never delivered by the end of the run
    dup        delivered more than once (same control id)
    inv        first delivered after a later message of its lane (per-lane order)
    p99        `AA` → first delivery over the window
    drained    the pause → nothing pending / in flight / retrying and every `AA`'d message delivered
    end state  staged rows left unfinished after the drain (table:status), dead letters, processes
               that died, and those that exited and were restarted by the lab's restart policy
               (compose's `restart: unless-stopped`)

Per run, `bench/referee.py` watches the whole run every 0.1 s: two nodes answering `GET /leader` 200 in
the same round, and any audit event committed under an epoch after the next one took over (both
should be 0).

All times are host wall clock (`time.time()`): the sender, the receiver and PostgreSQL share one host.

    uv run python bench/failover.py [--runs 1] [--faults leader-sigkill,...] [--rate 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.referee import Referee  # noqa: E402
from include.app.lab.postgres_server import wait_for  # noqa: E402
from include.app.lab.replicated_store import ReplicatedStore  # noqa: E402
from include.app.lab.two_nodes import Lab, Timings  # noqa: E402
from tests.support.stream import Sent, Stream, Verdict, judge, percentile  # noqa: E402

CLOCK = "host wall clock (time.time())"


@dataclass
class FaultResult:
    run: int
    fault: str
    window: tuple[float, float]
    at: float
    failover_s: float | None = None
    aa_again_s: float | None = None
    first_delivery_s: float | None = None
    every_lane_s: float | None = None
    drained_s: float | None = None
    end_state: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    dead_processes: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    note: str = ""
    sent: int = 0
    acked: int = 0
    lost: int = 0
    duplicated: int = 0
    inversions: int = 0
    p50_s: float | None = None
    p99_s: float | None = None
    out_of_vip_s: float | None = None
    patroni_s: float | None = None
    examples: dict[str, list[str]] = field(default_factory=dict)
    duplicate_causes: dict[str, int] = field(default_factory=dict)


# --- faults: each injects, recovers, and returns (fault time, failover seconds or None, note) -----


def _leader_fault(lab: Lab, act: Callable) -> tuple[float, float | None, str]:
    old = lab.wait_leader()
    t0 = time.time()
    act(old)
    new = wait_for(
        lambda: (lambda n: n if n is not None and n is not old else None)(lab.leader()),
        timeout=60,
        interval=0.02,
        what="another node to lead",
    )
    failover = time.time() - t0
    return t0, failover, f"{old.name}→{new.name}"


def leader_sigkill(lab: Lab) -> tuple[float, float | None, str]:
    out = _leader_fault(lab, lambda node: lab.signal_node(node, signal.SIGKILL))
    _restart_dead(lab)
    return out


def leader_sigterm(lab: Lab) -> tuple[float, float | None, str]:
    out = _leader_fault(lab, lambda node: lab.signal_node(node, signal.SIGTERM))
    _restart_dead(lab)
    return out


def leader_db_cut(lab: Lab) -> tuple[float, float | None, str]:
    cut: list = []

    def act(node) -> None:
        cut.append(node)
        lab.cut_db(node)

    t0, failover, note = _leader_fault(lab, act)
    time.sleep(2.0)  # the partition outlives the takeover a little
    lab.restore_db(cut[0])
    _restart_dead(lab)
    return t0, failover, note


def task_sigkill(lab: Lab) -> tuple[float, float | None, str]:
    lab.running_task("stage_deliver")
    t0 = time.time()
    _ti_id, pid = lab.kill_stage_task("stage_deliver")
    if time.time() - t0 > 0.5:  # no job task was running at once: the fault is when it was killed
        t0 = time.time()
    return t0, None, f"stage_deliver pid {pid}"


def spark_restart(lab: Lab) -> tuple[float, float | None, str]:
    t0 = time.time()
    lab.kill_spark()
    lab.start_spark()
    return t0, None, f"server back after {time.time() - t0:.1f} s"


def postgres_restart(lab: Lab) -> tuple[float, float | None, str]:
    t0 = time.time()
    lab.restart_postgres()
    back = time.time() - t0
    wait_for(lab.leader, timeout=60, interval=0.02, what="a leader after the restart")
    return t0, time.time() - t0, f"server back after {back:.1f} s"


def spark_worker_kill(lab: Lab) -> tuple[float, float | None, str]:
    """SIGKILL one Spark standalone worker mid-stream (with --spark-workers); it comes back 5 s later,
    as a supervisor would restart it."""
    cluster = lab.spark_cluster
    if cluster is None:
        raise RuntimeError("no Spark standalone cluster: run with --spark-workers 2")
    worker = cluster.worker_processes[0]
    t0 = time.time()
    worker.kill()
    time.sleep(5)
    cluster.restart(worker)
    return t0, None, f"{worker.name} killed, restarted after 5 s"


def node_and_scheduler_kill(lab: Lab) -> tuple[float, float | None, str]:
    """The leader's listenerd and an Airflow scheduler (with the tasks it runs) SIGKILLed at once:
    a whole node lost (with --schedulers 2)."""
    import psutil

    procs = lab.processes()
    scheduler = procs.get("airflow-scheduler")
    if scheduler is not None:
        root = psutil.Process(scheduler)
        for proc in [root, *root.children(recursive=True)]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
    return _leader_fault(lab, lambda node: lab.signal_node(node, signal.SIGKILL))


PAUSE_SECONDS = 10.0  # --pause: the freeze (issue 24's run), well past the lease TTL (2.5 s)
OUT_OF_VIP: dict[str, float | None] = {}  # fault name → SIGSTOP → HAProxy marks the frozen node DOWN


def _other_serving(lab: Lab, old) -> object | None:
    """A node other than `old` answering `GET /leader` 200 (never asks `old`: it may be frozen)."""
    serving = [n for n in lab.nodes.values() if n is not old and n.is_leader()]
    return serving[0] if len(serving) == 1 else None


def pause_leader(lab: Lab) -> tuple[float, float | None, str]:
    """SIGSTOP the leader for PAUSE_SECONDS (past the lease TTL), then SIGCONT. Its sockets stay open
    and its kernel still completes handshakes: HAProxy must drop it by its `GET /leader` check; the
    standby takes over once the lease expires; the woken node fences and rejoins as a standby (on a
    shared port the standby cannot bind until then: it retries and steps down, and whichever node
    leads next binds as soon as the port is free)."""
    old = lab.wait_leader()
    t0 = time.time()
    lab.pause_node(old)
    out_of_vip = failover = None
    while time.time() - t0 < PAUSE_SECONDS:
        if out_of_vip is None and lab.haproxy:
            try:
                if lab.vip_servers().get(old.name, "").startswith("DOWN"):
                    out_of_vip = time.time() - t0
            except OSError:
                pass
        if failover is None and _other_serving(lab, old) is not None:
            failover = time.time() - t0
        time.sleep(0.05)
    lab.resume_node(old)
    woke = time.time()
    wait_for(
        lambda: _role(old) == "standby" or old.is_leader(),
        timeout=30,
        interval=0.05,
        what="the woken node to fence and rejoin",
    )
    rejoined = time.time() - woke
    serving = wait_for(lab.leader, timeout=30, interval=0.05, what="a serving leader after the wake")
    served_after_wake = time.time() - woke
    if failover is None:  # shared port: nobody could bind while the frozen node held it
        failover = time.time() - t0
    OUT_OF_VIP["pause-leader"] = out_of_vip
    return (
        t0,
        failover,
        (
            f"{old.name} frozen {PAUSE_SECONDS:.0f} s; out of the VIP after "
            f"{f'{out_of_vip:.1f} s' if out_of_vip is not None else 'NEVER'}; woken node "
            f"{'rejoined' if not old.is_leader() else 'leads again'} {rejoined:.1f} s after SIGCONT; "
            f"{serving.name} serving {served_after_wake:.1f} s after SIGCONT"
        ),
    )


def _role(node) -> str | None:
    try:
        return node.daemon.status().get("role")
    except (OSError, ValueError):  # just woken: its API may drop what queued while it was frozen
        return None


_HOLD_PORT = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(8)\n"
    "while True: time.sleep(60)\n"
)


def bind_conflict(lab: Lab) -> tuple[float, float | None, str]:
    """Another process holds the standby's MLLP port when it is promoted: the leader is stopped
    (SIGTERM) and restarted at once (systemd's Restart=always); the standby takes the lease, cannot
    bind, retries and steps down within its grace; the restarted node then leads and serves."""
    old = lab.wait_leader()
    standby = next(n for n in lab.nodes.values() if n is not old)
    steps_before = standby.daemon.output().count("stepping down: inbound")
    if lab.shared_mllp_port:  # the standby binds the shared port within a heartbeat of the stop: no gap to hold it
        raise RuntimeError("bind-conflict needs per-node ports (run without --shared-port)")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_PORT, str(standby.mllp_port)])
    wait_for(lambda: _port_taken(standby.mllp_port), timeout=10, interval=0.05, what="the port holder")
    t0 = time.time()
    try:
        lab.signal_node(old, signal.SIGTERM)
        lab.restart_node(old)
        serving = wait_for(lab.leader, timeout=60, interval=0.02, what="a serving leader")
        failover = time.time() - t0
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait(5)
    stepped = standby.daemon.output().count("stepping down: inbound") - steps_before
    return (
        t0,
        failover,
        (
            f"{standby.name}'s port held; {standby.name} stepped down {stepped}x; "
            f"{serving.name} serving {failover:.1f} s after {old.name}'s SIGTERM"
        ),
    )


def _port_taken(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# --- the replicated store's faults (--replicated-store; issue 28) ---------------------------------

PG_HOLD_SECONDS = 20.0  # pg-primary-stop and pg-link-cut: how long the fault lasts
PATRONI: dict[str, float | None] = {}  # fault name → fault → Patroni's new primary answers GET /primary 200


def _store(lab: Lab) -> ReplicatedStore:
    if not isinstance(lab.pg, ReplicatedStore):
        raise RuntimeError("a replicated-store fault: run with --replicated-store")
    return lab.pg


def _serving_after(lab: Lab, t0: float, since: float) -> float:
    """Seconds from t0 until a node serves as leader at or after `since` (the store is back)."""
    while time.time() < since:
        time.sleep(0.02)
    wait_for(lab.leader, timeout=90, interval=0.02, what="a serving leader on the promoted store")
    return time.time() - t0


def _promotion(lab: Lab, act: Callable, *, name: str, hold: float = 0.0, undo: Callable | None = None):
    """`act(primary)`, then until Patroni promotes the other node; `undo(primary)` after `hold` s
    (from the fault), then the old primary rejoins. failover = a serving listenerd leader again."""
    store = _store(lab)
    primary, standby = store.wait_synchronous()
    t0 = time.time()
    act(primary)
    store.wait_primary(other_than=primary, timeout=90)
    promoted = time.time()
    PATRONI[name] = promoted - t0
    failover = _serving_after(lab, t0, promoted)
    if hold:
        time.sleep(max(0.0, t0 + hold - time.time()))
    (undo or store.restart_node)(primary)
    try:
        store.wait_synchronous(timeout=120)
        back = f"{primary.name} back as the sync standby {time.time() - t0:.0f} s after the fault"
    except TimeoutError:
        back = f"{primary.name} NOT back as the sync standby"
    return t0, failover, f"{standby.name} promoted after {promoted - t0:.1f} s; {back}"


def pg_primary_kill(lab: Lab) -> tuple[float, float | None, str]:
    """SIGKILL the PostgreSQL primary's postmaster and its Patroni (the host is gone); the killed
    node is started again once the standby is promoted and rejoins (pg_rewind)."""
    return _promotion(lab, _store(lab).kill_node, name="pg-primary-kill")


def pg_primary_stop(lab: Lab) -> tuple[float, float | None, str]:
    """SIGSTOP the primary's Patroni and every PostgreSQL process for PG_HOLD_SECONDS (a frozen
    VM: its sockets stay open), then SIGCONT: it finds the leader key gone, demotes and rejoins."""
    store = _store(lab)
    return _promotion(lab, store.pause_node, name="pg-primary-stop", hold=PG_HOLD_SECONDS, undo=store.resume_node)


def pg_link_cut(lab: Lab) -> tuple[float, float | None, str]:
    """Cut the replication link to the primary (the standby's stream hangs, silently) for
    PG_HOLD_SECONDS: commits wait up to wal_sender_timeout, then Patroni drops to one server;
    restored, the standby catches up and is named again. No promotion."""
    store = _store(lab)
    primary, standby = store.wait_synchronous()
    t0 = time.time()
    primary.link.cut()
    single = None
    while time.time() - t0 < PG_HOLD_SECONDS:
        if single is None and standby.role() == "replica":  # Patroni no longer names it synchronous
            single = time.time() - t0
        time.sleep(0.1)
    primary.link.restore()
    store.wait_synchronous(timeout=120)
    return (
        t0,
        None,
        (f"standby dropped from sync after {_s(single)} s; sync again {time.time() - t0:.0f} s after the cut"),
    )


def etcd_member_kill(lab: Lab) -> tuple[float, float | None, str]:
    """SIGKILL one of the three etcd members (two keep the quorum); it is started again after 10 s."""
    store = _store(lab)
    t0 = time.time()
    store.kill_etcd_member(0)
    time.sleep(10)
    store.restart_etcd_member(0)
    primary, _ = store.wait_synchronous(timeout=60)
    return t0, None, f"etcd0 killed, back after 10 s; {primary.name} primary throughout"


FAULTS: dict[str, Callable[[Lab], tuple[float, float | None, str]]] = {
    "leader-sigkill": leader_sigkill,
    "leader-sigterm": leader_sigterm,
    "leader-db-cut": leader_db_cut,
    "task-sigkill": task_sigkill,
    "spark-restart": spark_restart,
    "postgres-restart": postgres_restart,
    "spark-worker-kill": spark_worker_kill,
    "node-and-scheduler-kill": node_and_scheduler_kill,
    "pause-leader": pause_leader,
    "bind-conflict": bind_conflict,
    "pg-primary-kill": pg_primary_kill,
    "pg-primary-stop": pg_primary_stop,
    "pg-link-cut": pg_link_cut,
    "etcd-member-kill": etcd_member_kill,
}
REPLICATED_FAULTS = ("pg-primary-kill", "pg-primary-stop", "pg-link-cut", "etcd-member-kill")
DEFAULT_FAULTS = (
    "leader-sigkill",
    "leader-sigterm",
    "leader-db-cut",
    "task-sigkill",
    "spark-restart",
    "postgres-restart",
)


def _restart_dead(lab: Lab) -> None:
    """Bring every stopped node back (after the takeover), so the next fault again meets two."""
    for node in lab.nodes.values():
        if not node.alive():
            lab.restart_node(node)


# --- the run ------------------------------------------------------------------------------------


def drain(lab: Lab, stream: Stream, *, timeout: float) -> float | None:
    """Seconds until every `AA`'d message is delivered and no staged row is pending, in flight or
    retrying (dead letters do not count); None after `timeout`."""
    t0 = time.time()

    def done() -> bool:
        try:
            delivered = {d["control_id"] for d in lab.deliveries()}
            if any(s.control_id not in delivered for s in stream.acked()):
                return False
            return not any(not k.endswith(":dead") for k in lab.backlog())
        except Exception:  # the store may be unreachable right now (a fault): not drained
            return False

    try:
        wait_for(done, timeout=timeout, interval=0.5, what="the drain")
    except TimeoutError:
        return None
    return time.time() - t0


def aa_again(stream: Stream, t0: float, until: float) -> float | None:
    """Fault → `AA` again, slowest connection: each connection's first `AA` on a send begun after
    its last failed send (NAK, timeout, drop) between t0 and `until` (after t0 when none failed)."""
    attempts = [a for a in list(stream.attempts) if a.at >= t0]
    worst = 0.0
    for k in range(len(stream._threads)):
        mine = [a for a in attempts if a.conn == k]
        fails = [a.at for a in mine if not a.ok and a.at < until]
        since = max(fails) if fails else t0
        oks = [a.done for a in mine if a.ok and a.at >= since]
        if not oks:
            return None
        worst = max(worst, min(oks) - t0)
    return worst


def first_delivery_after(stream: Stream, deliveries: list[dict], t0: float) -> float | None:
    post = {cid for cid, s in list(stream.ledger.items()) if s.first_try >= t0}
    times = [d["t"] for d in deliveries if d["control_id"] in post]
    return min(times) - t0 if times else None


def every_lane_after(stream: Stream, deliveries: list[dict], t0: float) -> float | None:
    """Fault → the moment every lane has delivered a message sent after the fault (the slowest
    lane: a lane held by a dead owner's claimed rows shows here, not in the first delivery)."""
    post = {cid: s.lane for cid, s in list(stream.ledger.items()) if s.first_try >= t0}
    firsts: dict[str, float] = {}
    for d in deliveries:
        lane = post.get(d["control_id"])
        if lane is not None and lane not in firsts:
            firsts[lane] = d["t"]
    if len(firsts) < len(stream.lanes):
        return None
    return max(firsts.values()) - t0


def dead_letters(lab: Lab) -> int:
    return sum(
        int(r["n"])
        for r in lab.query(
            "SELECT count(*) AS n FROM stage_outbound WHERE status = 'dead' UNION ALL "
            "SELECT count(*) FROM stage_routed WHERE status = 'dead' UNION ALL "
            "SELECT count(*) FROM stage_inbound WHERE status = 'dead'"
        )
    )


def one_run(run: int, args: argparse.Namespace, echo: Callable[[str], None]) -> tuple[list[FaultResult], dict]:
    lab = Lab(
        timings=Timings(linger=args.linger),
        echo=lambda line: None if args.quiet else echo(line),
        keep_workdir=args.keep,
        schedulers=args.schedulers,
        spark_workers=args.spark_workers,
        second_spark=args.second_spark,
        shared_mllp_port=args.shared_port,
        replicated_store=args.replicated_store,
    )
    results: list[FaultResult] = []
    summary: dict = {}
    stream: Stream | None = None
    try:
        lab.start()
        referee = Referee(lab).start()
        host, port = lab.mllp_address
        stream = Stream(
            host, port, rate=args.rate, lanes=args.lanes, connections=args.connections, prefix=f"R{run}"
        ).start()
        warm_start = time.time()
        time.sleep(5)
        stream.pause()
        took = drain(lab, stream, timeout=300)
        echo(
            f"run {run}: lab up (logs {lab.workdir / 'log'}); warm-up delivered "
            f"{'in %.0f s' % (time.time() - warm_start) if took is not None else 'NOT within 300 s'}"
        )
        base_start = time.time()
        stream.resume()
        time.sleep(args.baseline)
        stream.pause()
        drain(lab, stream, timeout=args.drain)
        baseline_window = (base_start, time.time())
        for name in args.faults:
            start = time.time()
            stream.resume()
            time.sleep(args.before)
            dead_before = [p for p, pid in lab.processes().items() if pid is None]
            try:
                t0, failover, note = FAULTS[name](lab)
            except Exception as exc:  # report the fault as not injected, go on
                t0, failover, note = time.time(), None, f"FAULT FAILED: {type(exc).__name__}: {exc}"
            echo(f"run {run}: {name} at {time.strftime('%H:%M:%S', time.localtime(t0))} ({note})")
            time.sleep(args.after)
            stream.pause()
            r = FaultResult(
                run, name, (start, 0.0), t0, failover_s=failover, note=note, out_of_vip_s=OUT_OF_VIP.pop(name, None)
            )
            r.patroni_s = PATRONI.pop(name, None)
            r.drained_s = drain(lab, stream, timeout=args.drain)
            r.aa_again_s = aa_again(stream, t0, t0 + args.after)
            deliveries = lab.deliveries()
            r.first_delivery_s = first_delivery_after(stream, deliveries, t0)
            r.every_lane_s = every_lane_after(stream, deliveries, t0)
            r.end_state = lab.backlog()
            r.dead_letters = dead_letters(lab)
            r.dead_processes = [p for p, pid in lab.processes().items() if pid is None and p not in dead_before]
            r.restarted = [f"{name} (exit {code})" for at, name, code in lab.restarts if at >= start]
            r.window = (start, time.time())
            results.append(r)
            _restart_dead(lab)
        drain(lab, stream, timeout=args.drain)  # a last chance for anything late: "lost" is final
        stream.stop()
        ruling = referee.stop()
        echo(f"run {run}: referee: {ruling.line()}")
        deliveries = lab.deliveries()

        def in_window(window: tuple[float, float]) -> Callable[[Sent], bool]:
            return lambda s: window[0] <= s.first_try < window[1]

        staged = {
            row["control_id"]: int(row["n"])
            for row in lab.query(
                "SELECT control_id, count(*) AS n FROM stage_inbound GROUP BY control_id HAVING count(*) > 1"
            )
        }
        for r in results:
            v = judge(stream.ledger, deliveries, select=in_window(r.window))
            _fill(r, v, stream.ledger, staged)
        base = judge(stream.ledger, deliveries, select=in_window(baseline_window))
        faulted_from = results[0].window[0] if results else time.time()
        whole = judge(stream.ledger, deliveries, select=lambda s: s.first_try >= faulted_from)
        everything = judge(stream.ledger, deliveries, select=lambda s: s.first_try >= warm_start)
        summary = {
            "run": run,
            "baseline": _lat(base),
            "faulted": _lat(whole),
            "total": {
                "sent": everything.sent,
                "acked": everything.acked,
                "lost": len(everything.lost),
                "duplicated": len(everything.duplicated),
                "inversions": len(everything.inversions),
            },
            "referee": asdict(ruling),
            "referee_line": ruling.line(),
            "workdir": str(lab.workdir) if args.keep else None,
        }
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not strand the lab
        try:
            if stream is not None:
                stream.stop()
        finally:
            lab.stop()
            signal.signal(signal.SIGINT, previous)
    return results, summary


def _fill(r: FaultResult, v: Verdict, ledger: dict[str, Sent], staged: dict[str, int]) -> None:
    r.sent, r.acked, r.lost, r.duplicated, r.inversions = (
        v.sent,
        v.acked,
        len(v.lost),
        len(v.duplicated),
        len(v.inversions),
    )
    r.p50_s = percentile(v.latencies, 0.5) if v.latencies else None
    r.p99_s = percentile(v.latencies, 0.99) if v.latencies else None
    r.examples = {k: getattr(v, k)[:5] for k in ("lost", "duplicated", "inversions") if getattr(v, k)}
    causes: dict[str, int] = {}
    for cid in v.duplicated:
        # Staged twice: the sender resent a message a leader had committed (ingest). Staged once:
        # the stages delivered it twice (a deliver round whose finalize could not land).
        s = ledger[cid]
        if staged.get(cid, 1) > 1:
            why = "staged twice (resent after " + "/".join(dict.fromkeys(s.failures)) + ")"
        else:
            why = "staged once, delivered twice"
        causes[why] = causes.get(why, 0) + 1
    r.duplicate_causes = causes


def _lat(v: Verdict) -> dict:
    return {
        "messages": v.acked,
        "p50_s": percentile(v.latencies, 0.5),
        "p99_s": percentile(v.latencies, 0.99),
        "max_s": max(v.latencies) if v.latencies else float("nan"),
        "lost": len(v.lost),
        "duplicated": len(v.duplicated),
        "inversions": len(v.inversions),
    }


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def table(results: list[FaultResult]) -> str:
    lines = [
        "| run | fault | failover s | Patroni s | out of VIP s | AA again s | 1st delivery s | every lane s | sent | "
        "AA'd | lost | dup | inv | p50 s | p99 s | drained s | end state |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        state = ", ".join(f"{k} {v}" for k, v in sorted(r.end_state.items())) or "clean"
        if r.dead_letters:
            state += f"; {r.dead_letters} dead letters"
        if r.dead_processes:
            state += f"; died: {', '.join(r.dead_processes)}"
        if r.restarted:
            state += f"; exited and restarted: {', '.join(r.restarted)}"
        if r.note.startswith("FAULT FAILED"):
            state += f"; {r.note}"
        lines.append(
            f"| {r.run} | {r.fault} | {_s(r.failover_s)} | {_s(r.patroni_s)} | {_s(r.out_of_vip_s)} | "
            f"{_s(r.aa_again_s)} | {_s(r.first_delivery_s)} | {_s(r.every_lane_s)} | "
            f"{r.sent} | {r.acked} | {r.lost} | {r.duplicated} | {r.inversions} | {_s(r.p50_s)} | "
            f"{_s(r.p99_s)} | {_s(r.drained_s) if r.drained_s is not None else 'NOT drained'} | {state} |"
        )
    return "\n".join(lines)


def main() -> None:
    global PAUSE_SECONDS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1, help="full runs, each on a fresh lab")
    ap.add_argument(
        "--faults", default=",".join(DEFAULT_FAULTS), help=f"comma-separated, in order (of: {', '.join(FAULTS)})"
    )
    ap.add_argument("--schedulers", type=int, default=1, help="Airflow HA schedulers (2: one per node)")
    ap.add_argument("--spark-workers", type=int, default=0, help="Spark standalone workers (0: local[*])")
    ap.add_argument(
        "--second-spark",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a second Spark Connect server the stages spread over (default: on with local[*], off "
        "with workers); spark-restart kills the first",
    )
    ap.add_argument("--rate", type=float, default=60.0, help="messages per second (all connections)")
    ap.add_argument("--lanes", type=int, default=20)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--baseline", type=float, default=30.0, help="seconds of stream before the first fault")
    ap.add_argument("--before", type=float, default=10.0, help="seconds of stream before each fault")
    ap.add_argument("--after", type=float, default=30.0, help="seconds of stream after each fault")
    ap.add_argument("--drain", type=float, default=180.0, help="seconds to wait for the drain after each fault")
    ap.add_argument("--linger", type=float, default=5.0, help="STAGELINE_STAGE_LINGER_SECONDS of the stage tasks")
    ap.add_argument("--pause", type=float, default=PAUSE_SECONDS, help="pause-leader: seconds the leader is frozen")
    ap.add_argument(
        "--shared-port",
        action="store_true",
        help="both nodes on one MLLP port (one host, one address): the standby cannot bind while "
        "a frozen leader holds it",
    )
    ap.add_argument(
        "--replicated-store",
        action="store_true",
        help="the store on two PostgreSQL under Patroni (etcd x3, HAProxy on GET /primary); the default "
        f"faults become {', '.join(REPLICATED_FAULTS)}",
    )
    ap.add_argument("--json", metavar="PATH", help="also write every figure as JSON ('-': stdout)")
    ap.add_argument("--keep", action="store_true", help="keep the lab's work dir (logs) after each run")
    ap.add_argument("--quiet", action="store_true", help="no lab start-up lines")
    args = ap.parse_args()
    if args.replicated_store and args.faults == ",".join(DEFAULT_FAULTS):
        args.faults = ",".join(REPLICATED_FAULTS)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    PAUSE_SECONDS = args.pause
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s): {', '.join(unknown)} (known: {', '.join(FAULTS)})")

    def echo(line: str) -> None:
        print(line, file=sys.stderr if args.json == "-" else sys.stdout, flush=True)

    results: list[FaultResult] = []
    summaries: list[dict] = []
    for run in range(1, args.runs + 1):
        r, s = one_run(run, args, echo)
        results += r
        summaries.append(s)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(
        f"\nclock: {CLOCK}; rate {args.rate:.0f} msg/s, {args.lanes} lanes, {args.connections} connections; "
        f"heartbeat 0.5 s, fence 1.5 s, lease TTL 2.5 s, linger {args.linger:.0f} s\n",
        file=out,
    )
    print(table(results), file=out)
    print(
        "\n| run | inbound AA → delivered | messages | p50 s | p99 s | max s | lost | dup | inv |\n"
        "|---|---|---|---|---|---|---|---|---|",
        file=out,
    )
    for s in summaries:
        for key, label in (("baseline", "before the first fault"), ("faulted", "whole faulted stream")):
            if key in s:
                v = s[key]
                print(
                    f"| {s['run']} | {label} | {v['messages']} | {v['p50_s']:.1f} | {v['p99_s']:.1f} | "
                    f"{v['max_s']:.1f} | {v['lost']} | {v['duplicated']} | {v['inversions']} |",
                    file=out,
                )
    for s in summaries:
        if "referee_line" in s:
            print(f"  run {s['run']} referee: {s['referee_line']}", file=out)
    for r in results:
        if r.examples:
            print(
                f"  run {r.run} {r.fault}: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in r.examples.items()),
                file=out,
            )
        if r.duplicate_causes:
            print(
                f"  run {r.run} {r.fault}: duplicates "
                + ", ".join(f"{n} {why}" for why, n in r.duplicate_causes.items()),
                file=out,
            )
    if args.json:
        doc = json.dumps(
            {"clock": CLOCK, "args": vars(args), "faults": [asdict(r) for r in results], "runs": summaries},
            indent=2,
            default=str,
        )
        if args.json == "-":
            print(doc)
        else:
            Path(args.json).write_text(doc)


if __name__ == "__main__":
    main()
