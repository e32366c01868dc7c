"""Test doubles shared by the listener tests."""

from __future__ import annotations

from twisted.internet.defer import Deferred

from listeners.group_commit import Inbound


class FakeIngest:
    """Records submissions; the test fires each Deferred by hand, in any order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Inbound, Deferred[str]]] = []

    def submit(self, item: Inbound) -> Deferred[str]:
        d: Deferred[str] = Deferred()
        self.calls.append((item, d))
        return d

    def fire(self, index: int) -> None:
        item, d = self.calls[index]
        d.callback(item.message_id)

    def fail(self, index: int, exc: Exception) -> None:
        self.calls[index][1].errback(exc)
