"""The leader gate: a `MultiService` whose children, the inbound endpoint services, run only while
this node holds the lease (invariant 4, docs/invariants.md).

    gate running   every `supervise_seconds`, on the reactor (an in-memory check of `is_leader`):
        leader, nothing bound → build one endpoint service per configured connection and start them
        leader, one unbound   → try it again when its backoff is due (RETRY_FIRST doubling to RETRY_MAX)
        ... unbound past grace → clustered: step down (the ordered stop below, then the lease released
                                 with a re-acquire backoff) — unless `may_step_down` says handing over
                                 cannot help (no other live node; or every node seems unable to serve
                                 it): then, like a single node, keep what is bound and retry, loudly
        not leader, bound     → stop listening, drop open connections, stop file polling, at once
    gate stopping  (a clean stop) → the order that loses and duplicates nothing:
        stop intake everywhere → finish the queued commits (`drain`) → close after the answers
        (bounded by `drain_seconds`, then abort)

Leadership is the elector's self-fencing `is_leader`, so a node cut off from the database unbinds
at its fence timeout even while a renewal hangs. Dropping connections on a lost lease gives their
unanswered messages no answer; senders resend to the new leader (at-least-once).

Leading means serving (issue 24): a leader that cannot bind an inbound (port held, VIP address not
here yet, TLS key unreadable) retries it and, in a cluster, hands the lease to a node that can.
One log line per state change (unbound, reason changed, bound again), never one per retry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from twisted.application.internet import TimerService
from twisted.application.service import MultiService, Service
from twisted.internet import defer
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger

from listeners.connections_config import InboundConfig
from listeners.endpoints import InboundService

__all__ = ["LeaderGate", "Unbound", "until"]

_log = Logger(namespace="stageline.gate")
RETRY_FIRST = 0.25
RETRY_MAX = 0.8
"""Seconds between bind attempts of one unbound inbound: RETRY_FIRST, doubling, at most RETRY_MAX, so
a freed port is served within a second (a bind attempt is one cheap syscall; it is logged only when
its outcome or reason changes)."""


@dataclass
class Unbound:
    """One configured inbound this leader could not bind, and since when."""

    name: str
    reason: str
    since: float  # reactor seconds (wall clock on the real reactor) of the first failure
    delay: float = RETRY_FIRST
    next_try: float = 0.0
    attempts: int = 1
    past_grace: bool = False
    ask_after: float = 0.0  # reactor seconds: when a kept inbound asks again whether to hand over
    kept_because: str | None = None

    def doc(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "reason": self.reason,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
            "unbound_seconds": round(max(0.0, now - self.since), 3),
            "attempts": self.attempts,
        }


class LeaderGate(MultiService):
    """Endpoint services, started on gaining the lease and stopped on losing it."""

    def __init__(
        self,
        *,
        is_leader: Callable[[], bool],
        connections: Callable[[], Iterable[InboundConfig]],
        build: Callable[[InboundConfig], InboundService],
        drain: Callable[[float], Deferred[bool]],
        reactor: Any,
        supervise_seconds: float = 0.1,
        drain_seconds: float = 10.0,
        on_change: Callable[[int], None] = lambda bound: None,
        grace_seconds: float = 30.0,
        step_down: Callable[[list[str]], Deferred[Any]] | None = None,
        may_step_down: Callable[[list[str]], Deferred[str | None]] | None = None,
        on_bind: Callable[[str, bool, bool], None] = lambda name, bound, failed: None,
    ) -> None:
        """:param connections: the inbound connections of the config in force.
        :param build: a fresh (unstarted) endpoint service for one of them.
        :param drain: fires True once every queued commit is done (False at the timeout).
        :param on_change: told how many connections are bound after each change.
        :param grace_seconds: how long an inbound may stay unbound before `step_down`.
        :param step_down: releases the lease (a cluster), told the unbound names; None (a single node):
            retry forever.
        :param may_step_down: asked before a step-down: None to go ahead, else why handing over cannot
            help (the inbound is then kept and retried, and asked about again a grace later).
        :param on_bind: told (name, bound, failed) at each bind attempt and unbind."""
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
        self.grace_seconds = grace_seconds
        self._step_down = step_down
        self._may_step_down = may_step_down
        self._on_bind = on_bind
        self._unbound: dict[str, Unbound] = {}
        self._failing_since: dict[str, float] = {}  # bound inbounds that failed at work, until they work
        self._working_since: dict[str, float] = {}  # ... and since when such an inbound works again
        self._logged_failure: dict[str, str] = {}  # the last failure logged per inbound (one line per change)
        self.step_downs = 0
        self.up = False

    @property
    def bound(self) -> int:
        return sum(1 for svc in self if isinstance(svc, InboundService) and svc.bound)

    @property
    def serving(self) -> bool:
        """Bound and serving every configured inbound (what `GET /leader` needs besides the lease)."""
        return self.up and self._changing is None and not self._unbound

    def serves(self, name: str) -> bool | None:
        """Whether the configured inbound `name` is bound now (None: no such inbound configured)."""
        if all(conn.name != name for conn in self._connections()):
            return None
        return (
            self.up
            and self._changing is None
            and any(isinstance(svc, InboundService) and svc.name == name and svc.bound for svc in self)
        )

    def unbound(self) -> list[dict[str, Any]]:
        """The inbound connections this leader is retrying: name, reason, since (for /cluster/status)."""
        now = self._reactor.seconds()
        return [u.doc(now) for u in sorted(self._unbound.values(), key=lambda u: u.name)]

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
        yield self._ordered_stop()
        Service.stopService(self)

    @inlineCallbacks
    def _ordered_stop(self) -> Any:
        """Stop intake everywhere, finish the queued commits, close after the answers (then abort)."""
        services = self._take_down()
        for svc in services:
            yield svc.stop_intake()
        drained = yield self._drain(self.drain_seconds)
        if not drained:
            _log.error("commits still pending after {s}s; their senders get no ACK and resend", s=self.drain_seconds)
        for svc in services:
            svc.close(False)
        closed = yield until(
            self._reactor, lambda: sum(s.open_connections() for s in services) == 0, timeout=self.drain_seconds
        )
        if not closed:
            for svc in services:
                svc.close(True)
        yield self._disown(services)

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
        elif leader and self.up:
            failing = [(svc, why) for svc in self if isinstance(svc, InboundService) and (why := svc.failing())]
            if failing:
                self._change(self._lose(failing))
                return
            self._note_working()
            if self._unbound:
                self._retry()
                if self._unbound:
                    self._check_grace()

    def _note_working(self) -> None:
        """An inbound that failed at work is healthy again once it has worked for a whole grace since
        it was bound again: one that flaps (works a moment, fails again) keeps the clock of its first
        failure, so it still reaches its grace."""
        now = self._reactor.seconds()
        for name in list(self._failing_since):
            svc = next((s for s in self if isinstance(s, InboundService) and s.name == name and s.bound), None)
            if svc is None or not svc.proven():
                self._working_since.pop(name, None)
                continue
            if now - self._working_since.setdefault(name, now) < self.grace_seconds:
                continue
            since = self._failing_since.pop(name)
            self._working_since.pop(name, None)
            self._logged_failure.pop(name, None)
            _log.info("inbound {name} works again after {s:.1f}s", name=name, s=now - since)

    @inlineCallbacks
    def _lose(self, failing: list[tuple[InboundService, str]]) -> Any:
        """A bound inbound that stopped working (a polled directory gone): taken down and handled as
        unbound from the moment it first failed, so a flapping one still reaches its grace."""
        now = self._reactor.seconds()
        for svc, why in failing:
            yield svc.stop_intake()
            svc.close(True)
            yield svc.disownServiceParent()
            since = self._failing_since.setdefault(svc.conn.name, now)
            self._working_since.pop(svc.conn.name, None)
            self._failed(svc.conn, why, since=since)

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
        conns = list(self._connections())
        for conn in conns:
            self._try(conn)
        _log.info("leader: bound {n} of {m} inbound connection(s)", n=self.bound, m=len(conns))

    def _try(self, conn: InboundConfig) -> bool:
        """One bind attempt of one inbound; its outcome recorded (and logged if the state changed)."""
        try:
            svc = self._build(conn)
            svc.setServiceParent(self)  # the gate is running: this starts (binds) it
        except Exception as exc:
            self._failed(conn, str(exc) or type(exc).__name__)
            return False
        if not svc.bound:
            svc.disownServiceParent()  # started but not bound: nothing to stop
            self._failed(conn, getattr(svc, "bind_error", None) or "not bound")
            return False
        self._on_bind(conn.name, True, False)
        was = self._unbound.pop(conn.name, None)
        if conn.name not in self._failing_since:
            self._logged_failure.pop(conn.name, None)
        if was is not None and conn.name not in self._failing_since:
            _log.info(
                "inbound {name} bound after {s:.1f}s unbound ({n} attempt(s))",
                name=conn.name,
                s=self._reactor.seconds() - was.since,
                n=was.attempts + 1,
            )
        return True

    def _failed(self, conn: InboundConfig, reason: str, *, since: float | None = None) -> None:
        self._on_bind(conn.name, False, True)
        now = self._reactor.seconds()
        was = self._unbound.get(conn.name)
        if was is None:
            since = self._failing_since.get(conn.name, now) if since is None else since
            self._unbound[conn.name] = Unbound(conn.name, reason, since=since, next_try=now + RETRY_FIRST)
            if conn.name in self._logged_failure:
                return  # flapping: its first failure was said, and it is said when it works again
            self._logged_failure[conn.name] = reason
            then = (
                f"stepping down if still unbound after {self.grace_seconds:g}s"
                if self._step_down is not None
                else "single node: retrying until it binds"
            )
            where = (
                conn.directory if conn.kind == "file" else "" if conn.kind == "database" else f"{conn.host}:{conn.port}"
            )
            _log.error(
                "cannot bind inbound {name} ({kind} {where}): {err}; retrying every {lo:g}-{hi:g}s, {then}",
                name=conn.name,
                kind=conn.kind,
                where=where,
                err=reason,
                lo=RETRY_FIRST,
                hi=RETRY_MAX,
                then=then,
            )
            return
        was.attempts += 1
        was.delay = min(was.delay * 2, RETRY_MAX)
        was.next_try = now + was.delay
        if reason != was.reason:
            if conn.name not in self._failing_since:  # a flapping inbound's reasons alternate: said once
                _log.error("inbound {name} still unbound, now: {err}", name=conn.name, err=reason)
            was.reason = reason

    def _retry(self) -> None:
        now = self._reactor.seconds()
        due = {u.name for u in self._unbound.values() if u.next_try <= now}
        if not due:
            return
        for conn in self._connections():
            if conn.name in due:
                self._try(conn)
        self._on_change(self.bound)

    def _check_grace(self) -> None:
        now = self._reactor.seconds()
        late = sorted(
            u.name for u in self._unbound.values() if now - u.since >= self.grace_seconds and now >= u.ask_after
        )
        if not late:
            return
        if self._step_down is not None:
            self._change(self._consider(late))
            return
        self._keep(late, "a single node has no one to hand over to", again=float("inf"))

    @inlineCallbacks
    def _consider(self, names: list[str]) -> Any:
        """Step down for `names`, unless handing over cannot help (`may_step_down`)."""
        why = None
        if self._may_step_down is not None:
            try:
                why = yield self._may_step_down(names)
            except Exception as exc:  # the peers could not be read: hand over, as without the check
                _log.warn("cannot tell whether another node could serve ({err}); stepping down", err=type(exc).__name__)
        if why is None:
            yield self._stand_down(names)
        else:
            self._keep(names, why, again=self.grace_seconds)

    def _keep(self, names: list[str], why: str, *, again: float) -> None:
        """Past the grace but kept: keep retrying; say so loudly once per reason."""
        now = self._reactor.seconds()
        for name in names:
            u = self._unbound.get(name)
            if u is None:
                continue
            u.ask_after = now + again
            if not u.past_grace or u.kept_because != why:
                u.past_grace, u.kept_because = True, why
                _log.critical(
                    "NOT SERVING inbound {name}: unbound for {s:.0f}s ({err}); {why}, so it keeps retrying "
                    "and serves the inbound connections it did bind",
                    name=name,
                    s=now - u.since,
                    err=u.reason,
                    why=why,
                )

    @inlineCallbacks
    def _stand_down(self, names: list[str]) -> Any:
        """A leader that cannot serve steps down: the ordered stop of what it did bind, then the lease
        released (with its re-acquire backoff) so a node that can serve leads."""
        _log.error(
            "stepping down: inbound {names} unbound for over {g:g}s; releasing the lease so that a node "
            "that can serve leads",
            names=", ".join(names),
            g=self.grace_seconds,
        )
        self.step_downs += 1
        yield self._ordered_stop()
        assert self._step_down is not None
        try:
            released = yield self._step_down(names)
        except Exception as exc:
            _log.error("lease release failed on step-down ({err}); it ages out instead", err=type(exc).__name__)
        else:
            _log.info("stepped down: lease {how}", how="released" if released else "left to age out")

    @inlineCallbacks
    def _abort(self) -> Any:
        services = self._take_down()
        for svc in services:
            yield svc.stop_intake()
            svc.close(True)
        yield self._disown(services)

    def _take_down(self) -> list[InboundService]:
        self.up = False
        for name in self._unbound:
            self._on_bind(name, False, False)
        self._unbound.clear()
        self._failing_since.clear()
        self._working_since.clear()
        self._logged_failure.clear()
        services = [svc for svc in self if isinstance(svc, InboundService)]
        for svc in services:
            self._on_bind(svc.conn.name, False, False)
        return services

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
