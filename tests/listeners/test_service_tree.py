"""The node as a service tree, wired without sockets or a database: the one entry point builds it,
the leader gate binds endpoint services only with the lease and stops them in the clean-stop order,
and the listener modules import each other one way only."""

from __future__ import annotations

import ast
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.application.service import IServiceMaker, Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.testing import MemoryReactorClock
from twisted.plugin import getPlugins

from listeners import daemon
from listeners.connections_config import InboundConfig
from listeners.endpoints import InboundService, Wiring, inbound_service
from listeners.gate import LeaderGate
from listeners.metrics import Metrics
from listeners.node import ListenerNode, SequentialMultiService
from tests.listeners.fakes import FakeIngest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sighup() -> Iterator[None]:
    saved = signal.getsignal(signal.SIGHUP)
    yield
    signal.signal(signal.SIGHUP, saved)


def service_config(tmp_path: Path) -> Path:
    path = tmp_path / "stageline.toml"
    path.write_text(
        f'[store]\nbackend = "sqlite"\npath = "{tmp_path / "never.db"}"\n'
        '[cluster]\nenabled = false\nnode_id = "solo:1:aa"\n'
    )
    conf = tmp_path / "config"
    conf.mkdir()
    (conf / "connections.toml").write_text('[[inbound]]\nname = "adt-in"\nkind = "mllp"\nport = 0\n')
    return path


def test_the_entry_point_builds_the_tree_in_start_order_without_touching_the_store(
    tmp_path: Path, sighup: None
) -> None:
    options = daemon.Options()
    options.parseOptions(
        ["--service-config", str(service_config(tmp_path)), "--config", str(tmp_path / "config"), "--api-port", "0"]
    )
    node = daemon.makeService(options)
    assert isinstance(node, ListenerNode)
    assert [svc.name for svc in node] == ["api", "store", "replication", "lease", "ingest", "heartbeat", "leader-gate"]
    assert not node.running and not (tmp_path / "never.db").exists()


def test_the_twistd_plugin_points_at_the_same_entry_point() -> None:
    import twisted.plugins

    makers = {m.tapname: m for m in getPlugins(IServiceMaker, twisted.plugins)}
    maker = makers["stageline-listenerd"]
    assert maker.module == "listeners.daemon"  # type: ignore[attr-defined]
    assert isinstance(maker.options(), daemon.Options)


def test_a_bad_log_level_is_a_usage_error() -> None:
    from twisted.python import usage

    with pytest.raises(usage.UsageError, match="log-level"):
        daemon.Options().parseOptions(["--log-level", "loud"])


def test_children_stop_one_at_a_time_last_started_first() -> None:
    events: list[str] = []
    gates: dict[str, Deferred[None]] = {}

    class Step(Service):
        def __init__(self, name: str) -> None:
            self.setName(name)

        def stopService(self) -> Deferred[None]:
            super().stopService()
            events.append(f"stop {self.name}")
            gates[self.name] = Deferred()
            return gates[self.name]

    tree = SequentialMultiService()
    for name in ("a", "b", "c"):
        Step(name).setServiceParent(tree)
    tree.startService()
    done = tree.stopService()
    assert events == ["stop c"]
    gates["c"].callback(None)
    assert events == ["stop c", "stop b"]
    gates["b"].callback(None)
    gates["a"].callback(None)
    assert events == ["stop c", "stop b", "stop a"] and done.called


class Endpoint(InboundService):
    """Records what the gate does to it; `open` connections stay until closed gracefully."""

    def __init__(self, conn: InboundConfig, wiring: Wiring, events: list[str]) -> None:
        super().__init__(conn, wiring)
        self.events = events
        self.open = 1

    def startService(self) -> None:
        Service.startService(self)
        self.bound = True
        self.events.append(f"bind {self.name}")

    def stop_intake(self) -> Deferred[None]:
        if self.bound:
            self.bound = False
            self.events.append(f"stop intake {self.name}")
        return succeed(None)

    def close(self, abort: bool) -> None:
        self.events.append(f"{'abort' if abort else 'close'} {self.name}")
        self.open = 0

    def open_connections(self) -> int:
        return self.open


class Harness:
    def __init__(self) -> None:
        self.clock = MemoryReactorClock()
        self.leader = False
        self.events: list[str] = []
        self.bound: list[int] = []
        self.drained: Deferred[bool] | None = None
        wiring = Wiring(ingest=FakeIngest(), metrics=Metrics(), reactor=self.clock, bound_ports={})
        self.conns = (InboundConfig("a", "mllp"), InboundConfig("b", "tcp"))
        self.gate = LeaderGate(
            is_leader=lambda: self.leader,
            connections=lambda: self.conns,
            build=lambda conn: Endpoint(conn, wiring, self.events),
            drain=self.drain,
            reactor=self.clock,
            supervise_seconds=0.1,
            on_change=self.bound.append,
        )

    def drain(self, seconds: float) -> Deferred[bool]:
        self.events.append("drain")
        self.drained = Deferred()
        return self.drained

    def tick(self) -> None:
        self.clock.advance(0.1)


def test_endpoints_are_bound_only_while_leading_and_dropped_at_once_when_the_lease_is_lost() -> None:
    h = Harness()
    h.gate.startService()
    h.tick()
    assert h.events == [] and list(h.gate) == []  # a standby binds nothing
    h.leader = True
    h.tick()
    assert h.events == ["bind a", "bind b"] and h.bound == [2]
    h.events.clear()
    h.leader = False
    h.tick()
    assert h.events == ["stop intake a", "abort a", "stop intake b", "abort b"]
    assert list(h.gate) == [] and h.bound == [2, 0]
    h.leader = True
    h.tick()
    assert [s.name for s in h.gate] == ["a", "b"] and h.bound == [2, 0, 2]  # fresh services, bound again


def test_a_clean_stop_stops_intake_everywhere_then_drains_then_closes_after_the_answers() -> None:
    h = Harness()
    h.leader = True
    h.gate.startService()
    h.events.clear()
    done = h.gate.stopService()
    assert h.events == ["stop intake a", "stop intake b", "drain"]
    assert h.drained is not None
    h.leader = True
    h.tick()  # no rebinding while stopping
    assert h.events[-1] == "drain"
    h.drained.callback(True)
    h.clock.advance(0.01)
    assert h.events[3:] == ["close a", "close b"]
    assert done.called and list(h.gate) == [] and not h.gate.running


def test_connections_not_closed_within_the_drain_bound_are_aborted() -> None:
    h = Harness()
    h.leader = True
    h.gate.startService()
    for svc in h.gate:
        svc.close = lambda abort, svc=svc: (
            h.events.append(f"{'abort' if abort else 'close'} {svc.name}"),
            setattr(svc, "open", 0) if abort else None,
        )  # type: ignore[method-assign]
    h.events.clear()
    done = h.gate.stopService()
    assert h.drained is not None
    h.drained.callback(True)
    h.clock.pump([0.5] * 25)  # past drain_seconds (10 s)
    assert h.events[-4:] == ["close a", "close b", "abort a", "abort b"] and done.called


def test_a_connection_that_cannot_be_built_is_logged_and_the_others_bind(tmp_path: Path) -> None:
    h = Harness()
    wiring = Wiring(ingest=FakeIngest(), metrics=Metrics(), reactor=h.clock, bound_ports={})
    broken = InboundConfig("drop", "file", directory=str(tmp_path), archive=str(tmp_path))  # archive == directory
    h.conns = (broken, InboundConfig("a", "mllp"))
    gate = LeaderGate(
        is_leader=lambda: True,
        connections=lambda: h.conns,
        build=lambda conn: inbound_service(conn, wiring),
        drain=lambda s: succeed(True),
        reactor=h.clock,
    )
    gate.startService()
    assert [s.name for s in gate] == ["a"] and gate.bound == 1 and "a" in wiring.bound_ports


def test_every_kind_of_inbound_connection_has_an_endpoint_service(tmp_path: Path) -> None:
    clock: Any = MemoryReactorClock()
    clock.getThreadPool = lambda: None  # file drop's blocking work would go there; none runs here
    wiring = Wiring(ingest=FakeIngest(), metrics=Metrics(), reactor=clock, bound_ports={})
    for kind in ("mllp", "tcp", "http", "file"):
        conn = InboundConfig(f"in-{kind}", kind, directory=str(tmp_path), archive=str(tmp_path / "archive"))
        svc: Any = inbound_service(conn, wiring)
        assert isinstance(svc, InboundService) and svc.name == f"in-{kind}"


def _imports(path: Path) -> set[str]:
    """Every listeners.* module `path` imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "listeners":
                found |= {f"listeners.{a.name}" for a in node.names}
            elif node.module.startswith("listeners."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("listeners.")}
    return found


def test_no_import_cycle_between_listener_modules() -> None:
    graph = {f"listeners.{p.stem}": _imports(p) for p in (ROOT / "listeners").glob("*.py")}
    seen: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in seen:
            return
        for dep in sorted(graph.get(module, ())):
            visit(dep, (*path, module))
        seen.add(module)

    for module in sorted(graph):
        visit(module, ())
