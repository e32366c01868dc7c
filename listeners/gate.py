"""The leader gate: a `MultiService` whose children, the inbound endpoint services, run only while
this node holds the lease (invariant 4, docs/invariants.md).

    gate running   every `supervise_seconds`, on the reactor (an in-memory check of `is_leader`):
        leader, nothing bound → build one endpoint service per configured connection and start them
        not leader, bound     → stop listening, drop open connections, stop file polling, at once
    gate stopping  (a clean stop) → the order that loses and duplicates nothing:
        stop intake everywhere → finish the queued commits (`drain`) → close after the answers
        (bounded by `drain_seconds`, then abort)

Leadership is the elector's self-fencing `is_leader`, so a node cut off from the database unbinds
at its fence timeout even while a renewal hangs. Dropping connections on a lost lease gives their
unanswered messages no answer; senders resend to the new leader (at-least-once).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from twisted.application.internet import TimerService
from twisted.application.service import MultiService, Service
from twisted.internet import defer
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger

from listeners.connections import InboundConfig
from listeners.endpoints import InboundService

__all__ = ["LeaderGate", "until"]

_log = Logger(namespace="stageline.gate")


class LeaderGate(MultiService):
    """Endpoint services, started on gaining the lease and stopped on losing it."""

    def __init__(self, *, is_leader: Callable[[], bool], connections: Callable[[], Iterable[InboundConfig]],
                 build: Callable[[InboundConfig], InboundService], drain: Callable[[float], Deferred[bool]],
                 reactor: Any, supervise_seconds: float = 0.1, drain_seconds: float = 10.0,
                 on_change: Callable[[int], None] = lambda bound: None) -> None:
        """:param connections: the inbound connections of the config in force.
        :param build: a fresh (unstarted) endpoint service for one of them.
        :param drain: fires True once every queued commit is done (False at the timeout).
        :param on_change: told how many connections are bound after each change."""
        super().__init__()
        self.setName("leader-gate")
        self._is_leader = is_leader
        self._connections = connections
        self._build = build
        self._drain = drain
        self._reactor = reactor
        self.drain_seconds = drain_seconds
        self._on_change = on_change
        self._supervisor = TimerService(supervise_seconds, self._supervise)
        self._supervisor.clock = reactor
        self._changing: Deferred[None] | None = None
        self.up = False

    @property
    def bound(self) -> int:
        return sum(1 for svc in self if isinstance(svc, InboundService) and svc.bound)

    def startService(self) -> None:
        Service.startService(self)  # children start only with the lease
        self._supervisor.startService()

    @inlineCallbacks
    def stopService(self) -> Any:
        """A clean stop: stop intake, finish the commits, close after the answers (docs/listenerd.md)."""
        yield self._supervisor.stopService()
        while self._changing is not None:
            yield self._changing
        self._changing = Deferred()  # nothing may bind from here on
        services = self._take_down()
        for svc in services:
            yield svc.stop_intake()
        drained = yield self._drain(self.drain_seconds)
        if not drained:
            _log.error("commits still pending after {s}s; their senders get no ACK and resend", s=self.drain_seconds)
        for svc in services:
            svc.close(False)
        closed = yield until(self._reactor, lambda: sum(s.open_connections() for s in services) == 0,
                             timeout=self.drain_seconds)
        if not closed:
            for svc in services:
                svc.close(True)
        yield self._disown(services)
        Service.stopService(self)

    def unbind(self) -> Deferred[None]:
        """Take every endpoint down at once (a changed config); the supervisor binds again with the
        config in force on its next tick if this node still leads."""
        if self._changing is not None or not self.up:
            return defer.succeed(None)
        return self._change(self._abort())

    # -- supervision ------------------------------------------------------------------------------

    def _supervise(self) -> None:
        if self._changing is not None:
            return
        leader = bool(self._is_leader())
        if leader and not self.up:
            self._change(defer.maybeDeferred(self._bind))
        elif not leader and self.up:
            _log.warn("not the leader any more: unbinding inbound connections")
            self._change(self._abort())

    def _change(self, d: Deferred[None]) -> Deferred[None]:
        done: Deferred[None] = Deferred()

        def settled(_: object) -> None:
            self._changing = None
            self._on_change(self.bound if self.up else 0)
            done.callback(None)

        self._changing = done
        d.addErrback(lambda f: _log.failure("listener gate change failed", f))
        d.addBoth(settled)
        return done

    def _bind(self) -> None:
        self.up = True
        for conn in self._connections():
            try:
                svc = self._build(conn)
            except Exception as exc:
                _log.error("cannot bind inbound {name} ({kind} {host}:{port}): {err}", name=conn.name,
                           kind=conn.kind, host=conn.host, port=conn.port, err=exc)
                continue
            svc.setServiceParent(self)  # the gate is running: this starts (binds) it
        _log.info("leader: bound {n} inbound connection(s)", n=self.bound)

    @inlineCallbacks
    def _abort(self) -> Any:
        services = self._take_down()
        for svc in services:
            yield svc.stop_intake()
            svc.close(True)
        yield self._disown(services)

    def _take_down(self) -> list[InboundService]:
        self.up = False
        return [svc for svc in self if isinstance(svc, InboundService)]

    @inlineCallbacks
    def _disown(self, services: list[InboundService]) -> Any:
        for svc in services:
            yield svc.disownServiceParent()


def until(reactor: Any, condition: Callable[[], bool], *, timeout: float, interval: float = 0.01) -> Deferred[bool]:
    """Fires True once `condition()` holds (checked every `interval` on the reactor), False at `timeout`."""
    d: Deferred[bool] = Deferred()
    deadline = reactor.seconds() + timeout

    def check() -> None:
        if condition():
            d.callback(True)
        elif reactor.seconds() >= deadline:
            d.callback(False)
        else:
            reactor.callLater(interval, check)

    check()
    return d
