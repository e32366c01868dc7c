"""A frozen leader, end to end (issue 24): two real listenerd processes on the suite's PostgreSQL, a
sender streaming, the leader stopped with SIGSTOP for longer than its lease TTL (a stalled VM, a
swap storm), then woken with SIGCONT.

What must hold: the standby takes over once the lease expires on the database clock; the woken node
fences before it serves anything it read while frozen — nothing commits under its old epoch after
the takeover, nothing it answers AA is missing from the store, its connections are closed and it
rejoins as a standby; the sender gets AA again (within the TTL + 3 s when the nodes have their own
addresses), every AA is a stored row, and no two nodes lead at once."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import free_port, wait_for
from include.app.lab.two_nodes import HAPROXY, haproxy_config, vip_servers
from include.app.supervisor import port_open
from include.store import Store
from tests.listeners.hl7_traffic import ack_fields, adt
from tests.support.nodes import HEARTBEAT, TTL, fast_cluster, mllp_node

CLUSTER = fast_cluster()
FROZEN = TTL + 3.5  # SIGSTOP this long: well past the lease TTL, so the standby must take over
ANSWER_TIMEOUT = 1.0  # the sender's wait for an ACK before it tries the other address


@dataclass(eq=False)
class RetryingSender(threading.Thread):
    """One message at a time, resent under the same control id until it is AA'd (a careful real
    sender); on no answer, a negative ACK or a refused connect it moves to the next address.
    Records the monotonic time of every AA."""

    ports: list[int]
    prefix: str
    acked: dict[str, float] = field(default_factory=dict)
    nacked: list[str] = field(default_factory=list)
    made: list[str] = field(default_factory=list)
    retries: int = 0

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True)
        self._new = threading.Event()
        self._new.set()
        self._quit = threading.Event()

    def run(self) -> None:
        which, sock, n = 0, None, 0
        while not self._quit.is_set():
            if not self.made or self.made[-1] in self.acked:
                if not self._new.is_set():
                    break
                self.made.append(f"{self.prefix}{n:06d}")
                n += 1
            cid = self.made[-1]
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.ports[which]), timeout=0.5)
                    sock.settimeout(ANSWER_TIMEOUT)
                sock.sendall(b"\x0b" + adt(cid).encode() + b"\x1c\r")
                buf = b""
                while b"\x1c\r" not in buf:
                    chunk = sock.recv(4096)
                    if not chunk:
                        raise ConnectionError("closed before the answer")
                    buf += chunk
                code, msa2 = ack_fields(buf.split(b"\x1c\r", 1)[0])
                if code == "AA" and msa2 == cid:
                    self.acked[cid] = time.monotonic()
                    time.sleep(0.01)
                    continue
                self.nacked.append(cid)
                raise ConnectionError(f"{code} for {cid}")
            except (OSError, ValueError):
                self.retries += 1
                if sock is not None:
                    sock.close()
                sock = None
                which = (which + 1) % len(self.ports)
                time.sleep(0.05)
        if sock is not None:
            sock.close()

    def finish(self, timeout: float = 20) -> list[str]:
        """Stop making ids; wait until the last one is AA'd. The ids never AA'd."""
        self._new.clear()
        self.join(timeout)
        self._quit.set()
        self.join(5)
        return [cid for cid in self.made if cid not in self.acked]

    def first_aa_after(self, t: float) -> float | None:
        later = [at for at in self.acked.values() if at > t]
        return min(later) - t if later else None


class FrozenProbe(threading.Thread):
    """A partner that connects to the frozen node during the freeze (its kernel completes the
    handshake) and sends one message, then waits for whatever the node does on waking."""

    def __init__(self, port: int, control_id: str) -> None:
        super().__init__(daemon=True)
        self.port, self.control_id = port, control_id
        self.answer: str | None = None  # MSA-1, or None when closed without an answer
        self.closed_at: float | None = None

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(b"\x0b" + adt(self.control_id).encode() + b"\x1c\r")
            sock.settimeout(60)
            buf = b""
            try:
                while True:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    buf += chunk
                    if b"\x1c\r" in buf and self.answer is None:
                        self.answer = ack_fields(buf.split(b"\x1c\r", 1)[0])[0]
            except OSError:
                pass
            self.closed_at = time.monotonic()


class LeaderWatch(threading.Thread):
    """Samples both nodes' /cluster/status every 50 ms: a moment where both say they lead is two
    leaders (a frozen node cannot answer, and counts as not leading)."""

    def __init__(self, a: Daemon, b: Daemon) -> None:
        super().__init__(daemon=True)
        self.nodes, self.both = (a, b), []
        self._quit = threading.Event()

    def run(self) -> None:
        while not self._quit.is_set():
            if all((_status(n, timeout=0.3) or {}).get("is_leader") for n in self.nodes):
                self.both.append(time.monotonic())
            time.sleep(0.05)

    def stop(self) -> list[float]:
        self._quit.set()
        self.join(5)
        return self.both


def _status(node: Daemon, *, timeout: float = 2.0) -> dict | None:
    """/cluster/status, or None when the node does not answer in time (frozen, or just woken)."""
    req = urllib.request.Request(f"http://127.0.0.1:{node.api_port}/cluster/status")
    req.add_header("Authorization", f"Bearer {node.token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def _query(store_config, sql: str, **params) -> list[dict]:
    store = Store(store_config)
    try:
        with store.transaction(write=False) as tx:
            cur = tx.conn.cursor()
            cur.execute(sql, params)
            return [dict(r) for r in cur.fetchall()]
    finally:
        store.close()


def _lease(store_config) -> dict:
    return _query(store_config, "SELECT owner, epoch FROM leader_lease WHERE id = 1")[0]


def _received_under(store_config, epoch: int, *, later: bool = False) -> int:
    """Rows the store took in under `epoch` (or any later one): their 'received' events carry the
    writer's epoch."""
    op = ">" if later else "="
    return _query(
        store_config, f"SELECT count(*) AS n FROM message_events WHERE event = 'received' AND epoch {op} %(e)s", e=epoch
    )[0]["n"]


def _staged(store_config) -> set[str]:
    return {r["control_id"] for r in _query(store_config, "SELECT control_id FROM stage_inbound")}


class VipWatch(threading.Thread):
    """Polls HAProxy's status page every 100 ms and keeps every view (server name → UP/DOWN/...)."""

    def __init__(self, stats_port: int) -> None:
        super().__init__(daemon=True)
        self.stats_port = stats_port
        self.seen: list[tuple[float, dict[str, str]]] = []
        self._quit = threading.Event()

    def run(self) -> None:
        while not self._quit.is_set():
            try:
                self.seen.append((time.monotonic(), vip_servers(self.stats_port)))
            except OSError:
                pass
            time.sleep(0.1)

    def first(self, server: str, prefix: str, after: float) -> float | None:
        return next(
            (at - after for at, view in self.seen if at >= after and view.get(server, "").startswith(prefix)), None
        )

    def stop(self) -> None:
        self._quit.set()
        self.join(5)


def _start_pair(tmp_path, store_config, *, shared_port: bool) -> tuple[Daemon, Daemon, int, int]:
    port_a = free_port()
    port_b = port_a if shared_port else free_port()
    a = mllp_node(tmp_path / "a", store_config, node_id="node-a:1:aa", port=port_a, cluster=CLUSTER)
    wait_for(lambda: a.status()["is_leader"] and port_open(port_a), timeout=15, what="node A to lead")
    if shared_port:  # one config dir, one address: only the leader can hold it (like one host's VIP)
        b = Daemon(
            tmp_path / "b", store_config, node_id="node-b:2:bb", cluster=CLUSTER, config_dir=a.workdir / "config"
        )
    else:
        b = Daemon(
            tmp_path / "b",
            store_config,
            node_id="node-b:2:bb",
            cluster=CLUSTER,
            inbound=[{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": port_b}],
        )
    b.start()
    wait_for(lambda: b.status()["role"] == "standby", timeout=15, what="node B to stand by")
    return a, b, port_a, port_b


@dataclass
class FreezeRun:
    sender: RetryingSender
    probe: FrozenProbe
    old_epoch: int
    new_epoch: int
    frozen_at: float
    woke_at: float
    takeover_s: float
    old_epoch_rows_at_takeover: int
    two_leaders: list[float]
    standby_after_wake_s: float


def _freeze_leader(
    a: Daemon,
    b: Daemon,
    port_a: int,
    port_b: int,
    store_config,
    *,
    a_rejoins: bool = True,
    sender_ports: list[int] | None = None,
) -> FreezeRun:
    """Stream, freeze A past the lease TTL, wake it. `a_rejoins`: wait for A to report standby
    (else only for it to answer again: on a shared address either node may lead afterwards)."""
    old_epoch = _lease(store_config)["epoch"]
    ports = sender_ports or ([port_a] if port_a == port_b else [port_a, port_b])
    sender = RetryingSender(ports, prefix="F")
    sender.start()
    wait_for(lambda: len(sender.acked) >= 20, timeout=15, what="traffic through the leader")
    watch = LeaderWatch(a, b)
    watch.start()

    a.signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    time.sleep(0.3)
    probe = FrozenProbe(port_a, "Z000001")  # a partner reaching the frozen node's still-open port
    probe.start()
    wait_for(
        lambda: _lease(store_config)["epoch"] > old_epoch,
        timeout=FROZEN,
        interval=0.05,
        what="the standby to take the lease while A is frozen",
    )
    takeover_s = time.monotonic() - frozen_at
    # A is still frozen: whatever it commits under the old epoch from here on came after the takeover
    at_takeover = _received_under(store_config, old_epoch)
    new_epoch = _lease(store_config)["epoch"]
    time.sleep(max(0.0, FROZEN - (time.monotonic() - frozen_at)))

    a.signal(signal.SIGCONT)
    woke_at = time.monotonic()
    if a_rejoins:
        wait_for(
            lambda: (_status(a) or {}).get("role") == "standby",
            timeout=15,
            interval=0.05,
            what="A to rejoin as a standby",
        )
    else:
        wait_for(lambda: _status(a) is not None, timeout=15, interval=0.05, what="A to answer again")
    standby_after = time.monotonic() - woke_at
    time.sleep(3.0)  # the stream goes on after the wake: A must stay out, B must keep serving
    probe.join(20)
    return FreezeRun(
        sender, probe, old_epoch, new_epoch, frozen_at, woke_at, takeover_s, at_takeover, watch.stop(), standby_after
    )


def _assert_fenced_and_lossless(run: FreezeRun, store_config) -> None:
    never = run.sender.finish()
    assert never == [], f"the sender gave up on {never}"
    staged = _staged(store_config)
    lost = sorted(set(run.sender.acked) - staged)
    assert lost == [], f"{len(lost)} AA'd message(s) not in the store"
    # the woken node committed nothing under its old epoch after the standby took over
    assert run.old_epoch_rows_at_takeover > 0, "the old leader's rows carry its epoch (else this proves nothing)"
    assert _received_under(store_config, run.old_epoch, later=True) > 0
    assert _received_under(store_config, run.old_epoch) == run.old_epoch_rows_at_takeover
    assert run.two_leaders == [], f"both nodes said they lead at {len(run.two_leaders)} sample(s)"
    # what the frozen node read while frozen: answered AA only if stored; its connection closed
    assert run.probe.closed_at is not None, "the woken node left the connection it read while frozen open"
    assert run.probe.closed_at - run.woke_at <= 2.0, "the connection accepted while frozen outlived the wake"
    if run.probe.answer == "AA":
        assert "Z000001" in staged, "AA for a message the woken node did not commit"


def test_a_frozen_leader_on_its_own_address_fences_on_waking_and_the_standby_serves(tmp_path, pg_config_fresh):
    a, b, port_a, port_b = _start_pair(tmp_path, pg_config_fresh, shared_port=False)
    try:
        run = _freeze_leader(a, b, port_a, port_b, pg_config_fresh)
        first_aa = run.sender.first_aa_after(run.frozen_at)
        print(
            f"frozen leader, own addresses: lease taken {run.takeover_s:.2f}s after SIGSTOP (TTL {TTL}s), "
            f"first AA {first_aa:.2f}s after it, A standby {run.standby_after_wake_s:.2f}s after SIGCONT, "
            f"probe answer {run.probe.answer!r}, {len(run.sender.acked)} AA, {run.sender.retries} retries"
        )
        assert first_aa is not None and first_aa <= TTL + 3.0
        _assert_fenced_and_lossless(run, pg_config_fresh)
        assert _lease(pg_config_fresh) == {"owner": "node-b:2:bb", "epoch": run.new_epoch}
        assert (a.status()["role"], b.status()["role"]) == ("standby", "primary")
        assert run.standby_after_wake_s <= HEARTBEAT + 1.0
        assert not port_open(port_a), "the woken node still holds its MLLP port"
        # what HAProxy asks: only the serving leader answers 200
        assert (a.get("/leader", token=None)[0], b.get("/leader", token=None)[0]) == (503, 200)
    finally:
        for d in (a, b):
            d.signal(signal.SIGCONT)
            d.stop()


def test_a_frozen_leader_sharing_the_address_is_served_again_within_three_seconds_of_waking(tmp_path, pg_config_fresh):
    """Both nodes on one address (one host, one config): while A is frozen it still holds the port,
    so the standby that takes the lease cannot bind. It retries (and steps down past its grace); once
    A wakes, fences and closes the port, a node binds it and the sender gets AA within 3 s."""
    a, b, port, _ = _start_pair(tmp_path, pg_config_fresh, shared_port=True)
    try:
        run = _freeze_leader(a, b, port, port, pg_config_fresh, a_rejoins=False)
        wait_for(
            lambda: run.sender.first_aa_after(run.woke_at) is not None,
            timeout=10,
            interval=0.05,
            what="AA again after the frozen node woke",
        )
        again = run.sender.first_aa_after(run.woke_at)
        leader = _lease(pg_config_fresh)
        print(
            f"frozen leader, shared address: lease taken {run.takeover_s:.2f}s after SIGSTOP, AA again "
            f"{again:.2f}s after SIGCONT (frozen {FROZEN}s), leader now {leader['owner']} epoch {leader['epoch']}, "
            f"probe answer {run.probe.answer!r}, {len(run.sender.acked)} AA, {run.sender.retries} retries"
        )
        # B took the lease while A still held the port: it could not bind and retried. Past its grace
        # (3 heartbeats) it stepped down — or, when A's heartbeat was already older than the node
        # timeout (A frozen), kept the lease: no other live node could have taken it
        out = b.output()
        assert "cannot bind inbound adt-in" in out
        assert "stepping down: inbound adt-in" in out or "no other live node to hand over to" in out
        assert again <= 3.0
        _assert_fenced_and_lossless(run, pg_config_fresh)
        assert leader["epoch"] >= run.new_epoch
        roles = sorted((_status(n) or {}).get("role") for n in (a, b))
        assert roles == ["primary", "standby"], roles
        codes = sorted(n.get("/leader", token=None)[0] for n in (a, b))
        assert codes == [200, 503], codes
    finally:
        for d in (a, b):
            d.signal(signal.SIGCONT)
            d.stop()


@pytest.mark.skipif(shutil.which(HAPROXY) is None, reason=f"{HAPROXY} not installed (scripts/setup.sh)")
def test_a_frozen_leader_leaves_the_vip_within_three_seconds_and_senders_through_it_get_aa(tmp_path, pg_config_fresh):
    """Issue 24's lab run: nodes on their own addresses behind HAProxy, the sender only knows the
    VIP. With the old TCP-connect check HAProxy kept the frozen node UP (its kernel still accepted)
    and `balance first` sent every sender to it; with `GET /leader` it is DOWN within ~1.4 s."""
    a, b, port_a, port_b = _start_pair(tmp_path, pg_config_fresh, shared_port=False)
    vip, stats = free_port(), free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(vip, stats, [("node-a", port_a, a.api_port), ("node-b", port_b, b.api_port)]))
    with open(tmp_path / "haproxy.log", "wb") as log:
        haproxy = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    watch = VipWatch(stats)
    try:
        wait_for(lambda: port_open(vip), timeout=10, what="the VIP")
        wait_for(
            lambda: (
                vip_servers(stats).get("node-a") == "UP" and vip_servers(stats).get("node-b", "").startswith("DOWN")
            ),
            timeout=10,
            what="HAProxy to see A as the only serving node",
        )
        watch.start()
        run = _freeze_leader_through(a, b, vip, port_a, pg_config_fresh)
        down = watch.first("node-a", "DOWN", run.frozen_at)
        b_up = watch.first("node-b", "UP", run.frozen_at)
        first_aa = run.sender.first_aa_after(run.frozen_at)
        print(
            f"frozen leader behind HAProxy: A DOWN in the VIP {down:.2f}s after SIGSTOP, B UP {b_up:.2f}s, "
            f"first AA through the VIP {first_aa:.2f}s after SIGSTOP (lease taken {run.takeover_s:.2f}s)"
        )
        assert down is not None and down <= 3.0, f"the frozen leader stayed in the VIP ({down})"
        assert first_aa is not None and first_aa <= TTL + 3.0
        _assert_fenced_and_lossless(run, pg_config_fresh)
        assert not watch.first("node-a", "UP", run.woke_at + 0.5), "the woken node came back into the VIP"
    finally:
        watch.stop()
        haproxy.terminate()
        haproxy.wait(10)
        for d in (a, b):
            d.signal(signal.SIGCONT)
            d.stop()


def _freeze_leader_through(a: Daemon, b: Daemon, vip: int, port_a: int, store_config) -> FreezeRun:
    """`_freeze_leader` with the sender on the VIP only (the frozen-side probe still reaches A's own port)."""
    return _freeze_leader(a, b, port_a, port_a, store_config, sender_ports=[vip])
